"""A whole model (token ids in, logits out) generating greedily: transformers, our ONNX forms and
onnxruntime-genai on one checkpoint. `python -m bench model --presets llama-whole` runs it.

Writes `model_whole.json` and `model_whole.png` and prints a table of ratios.

The checkpoint: transformers' `LlamaForCausalLM` of the preset's shape with random weights drawn wide
enough that the logits spread (the greedy token is then not a coin toss between near-equal logits),
saved with `save_pretrained` beside a tokenizer (onnxruntime-genai's model builder wants one); or,
where the work folder already holds our artifact of the preset (`--artifacts`), that artifact's own
weights under transformers' names. From that one folder:

- `torch`: transformers' LlamaForCausalLM in eager PyTorch with its default (dynamic) cache;
- `torch-static`: the same with transformers' `StaticCache` (the cache `cache_implementation="static"` makes);
- ours, built by the documented import `python -m export build --weights FOLDER --layout hf`:
  `fp32-fused` and `fp32-fused-int8w` stateless (the past in, the presents out and fed back, through
  IOBinding), `fp32-static` and `fp32-static-int8kv` through serving/engine/kv_pool.py's KVPool (the
  cache read in place, each new position written into it). The fp16 forms are left out: ONNX
  Runtime's CPU provider emulates fp16;
- `onnxruntime-genai`: its model builder's fp32 CPU graph of the folder, run by its Generator in a
  process of its own (bench/genai_peer.py: onnxruntime-genai 0.18 brings onnxruntime 1.32, which must
  not meet ours), from the virtual environment `make bench-peers` makes (or this bench, when missing).

A generation: each of the batch's rows prompts `prompt` random ids; the prefill (time to the first
token: the prompt through the model and the greedy choice) then `tokens - 1` greedy decode steps, each
timed alone. Every candidate runs the same prompts, one at a time, in `rounds` rounds with the order
reversed every round, so that drift or other work on the machine falls on every candidate alike.
Reported: the prefill's median over the rounds, a decode step's median and 90th percentile over every
step of every round, and the greedy tokens against transformers' (`torch`): how many of the first
`tokens` agree before the first difference, the fewest over the rows.

The floor of a decode step: the bytes it must read once at the measured bandwidth (bench/timing.py
copy_bandwidth): every weight but the embedding table (a step gathers a row of it per token) and the
keys and values of the past, at the middle of the decode steps' pasts. Each candidate is held to the
floor of what it reads: fp32 weights and cache for most; int8 weights (the bytes of its graph's
initializers) for `fp32-fused-int8w`; an int8 cache for `fp32-static-int8kv`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench import results as output
from bench.timing import SETTLE_S, Timing, copy_bandwidth, interleaved
from contract import files, names
from contract.config import ModelConfig

TORCH, TORCH_STATIC, GENAI = "torch", "torch-static", "onnxruntime-genai"
RUNTIMES = ("torch", "onnxruntime", "transformers")  # the versions a whole model's results name
GENAI_INT4 = "onnxruntime-genai-int4"  # its builder's `-p int4 -e cpu`: MatMulNBits, blocks of 32, accuracy_level 4
FUSED, INT8W, STATIC, STATIC_INT8KV = "fp32-fused", "fp32-fused-int8w", "fp32-static", "fp32-static-int8kv"
STATIC_INT8W = "fp32-static-int8w"  # INT8 weights in the static form: what a session serves with them
STATIC_INT4W = "fp32-static-int4w"  # and 4-bit weights (`--weights-dtype int4`)
OURS = (FUSED, INT8W, STATIC, STATIC_INT8W, STATIC_INT4W, STATIC_INT8KV)
STATIC_FORMS = (STATIC, STATIC_INT8W, STATIC_INT4W, STATIC_INT8KV)  # through the KV pool; the others stateless
GENAI_PRECISIONS = {GENAI: "fp32", GENAI_INT4: "int4"}  # the peer's models, by its builder's `-p`
CANDIDATES = (TORCH, TORCH_STATIC, *OURS, *GENAI_PRECISIONS)
# The checkpoint's weights: transformers' own init (std 0.02: the residual stream stays the size a trained
# model's is), its head scaled so that logits spread as a trained model's do (measured at seed 0: std 0.45 and
# a median top-2 margin of 0.06 unscaled; x20: std 9, margin 1.2), so that a greedy token means something
INIT_STD = 0.02
HEAD_SCALE = 20.0
GENAI_VENV = Path(__file__).resolve().parent.parent / ".venv-genai"
GENAI_REQUIREMENTS = ("onnxruntime-genai==0.18.*", "numpy")


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (a build failed, a candidate answered an error)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    prompt: int = 512  # ids each row's prompt holds
    tokens: int = 128  # greedy tokens generated: the prefill's, then tokens - 1 decode steps
    batches: tuple[int, ...] = (1, 8)
    rounds: int = 3
    seed: int = 0  # the checkpoint's weights and the prompts

    @classmethod
    def quick(cls) -> Plan:
        return cls(prompt=16, tokens=8, batches=(1, 2), rounds=1)

    @property
    def mean_past(self) -> float:
        """The past a decode step reads, on average over the steps (the prompt plus 1 .. tokens - 1)."""
        return self.prompt + self.tokens / 2


@dataclasses.dataclass
class TimedGeneration:
    prefill_ms: float  # the prompt through the model and the first greedy token
    step_ms: list[float]  # each later token: one decode step and its greedy choice
    tokens: np.ndarray  # (B, tokens) int64, the greedy ids


Generate = Callable[[np.ndarray, int], TimedGeneration]  # (prompts (B, T) int64, tokens) -> TimedGeneration


# --- the checkpoint and what is built from it ------------------------------------------------------


def llama_shaped(cfg: ModelConfig) -> bool:
    """Whether transformers' LlamaForCausalLM computes `cfg`'s model: RMSNorm, rotary, a gated SiLU MLP,
    no biases, an LM head of its own."""
    block = cfg.whole and cfg.norm == "rmsnorm" and cfg.rotary and cfg.mlp == "gated" and cfg.mlp_activation == "silu"
    return block and not (cfg.bias or cfg.mlp_bias or cfg.tie_embeddings)


def hf_config(cfg: ModelConfig):
    """transformers' LlamaConfig of `cfg` (a Llama-shaped whole model: RMSNorm, rotary, gated SiLU MLP)."""
    import transformers

    if not llama_shaped(cfg):
        raise BenchError(f"the whole-model bench takes a Llama-shaped config, got {cfg}")
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.mlp_width,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=False,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        initializer_range=INIT_STD,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )


def make_checkpoint(cfg: ModelConfig, folder: Path, seed: int) -> None:
    """LlamaForCausalLM of random weights (seeded) and a tokenizer, saved in `folder`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config(cfg))
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(folder)
    save_tokenizer(cfg, folder)


def save_tokenizer(cfg: ModelConfig, folder: Path) -> None:
    """A word-level tokenizer over the ids (t0 .. t{vocab - 1}): onnxruntime-genai's builder reads one."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t3"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"bos_token": "t0", "eos_token": "t1", "pad_token": "t2", "unk_token": "t3"}
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, **special).save_pretrained(folder)


# our parameter names -> transformers' Llama names (the weights need no change: same shapes, and our
# rotary pairing "half" is transformers' rotate_half)
HF_NAMES = {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}
HF_LAYER_NAMES = {
    "norm": "input_layernorm",
    "attn.W_q": "self_attn.q_proj",
    "attn.W_k": "self_attn.k_proj",
    "attn.W_v": "self_attn.v_proj",
    "attn.W_o": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "mlp.W_gate": "mlp.gate_proj",
    "mlp.W_up": "mlp.up_proj",
    "mlp.W_down": "mlp.down_proj",
}


def hf_name(name: str) -> str:
    module, _, kind = name.rpartition(".")
    if module.startswith("layers."):
        _, index, rest = module.split(".", 2)
        return f"model.layers.{index}.{HF_LAYER_NAMES[rest]}.{kind}"
    return f"{HF_NAMES[module]}.{kind}"


def checkpoint_from_artifact(artifact: Path, folder: Path) -> None:
    """The checkpoint of an artifact already built (its own weights, renamed), so that it is not
    imported again: a reused `--artifacts` folder, the smoke test's session build."""
    import transformers

    from export.artifacts import load_model

    ours = load_model(artifact)
    model = transformers.LlamaForCausalLM(hf_config(ours.cfg))
    model.load_state_dict({hf_name(name): tensor for name, tensor in ours.state_dict().items()}, strict=True)
    model.save_pretrained(folder)
    save_tokenizer(ours.cfg, folder)


def import_artifact(checkpoint: Path, out: Path) -> None:
    """Our forms of the checkpoint, by the documented command (each proven at build, report.json)."""
    command = [sys.executable, "-m", "export", "build", "--weights", str(checkpoint), "--layout", "hf"]
    command += ["--out", str(out), "--variants", ",".join(OURS)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 and _built(out):  # a parity rung failed: measured all the same, its verdict reported
        print(f"warning: {done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]}")
    elif done.returncode != 0:
        raise BenchError(f"`{' '.join(command)}` failed ({done.returncode}):\n{done.stderr[-3000:]}")


def ensure_genai_venv(venv: Path = GENAI_VENV) -> Path:
    """The python of `venv`, with onnxruntime-genai installed there first if it is not (about 10 s from
    PyPI); a BenchError says why not."""
    python = venv / "bin" / "python"
    stamp = venv / ".installed-genai"
    if stamp.is_file() and python.is_file():
        return python
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)]]
    steps.append([str(python), "-m", "pip", "install", "--quiet", *GENAI_REQUIREMENTS])
    for command in steps:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BenchError(f"cannot make the onnxruntime-genai venv: `{' '.join(command)}`:\n{done.stderr[-2000:]}")
    stamp.touch()
    return python


def genai_builder(python: Path) -> Path:
    """onnxruntime-genai's model builder script, in its venv. It runs on our python: a pure-Python
    script over torch, transformers and onnx (which its venv leaves out), the runtime not needed."""
    found = sorted(python.parent.parent.glob("lib/python*/site-packages/onnxruntime_genai/models/builder.py"))
    if not found:
        raise BenchError(f"no onnxruntime_genai/models/builder.py in {python.parent.parent}")
    return found[-1]


def build_genai(python: Path, checkpoint: Path, out: Path, precision: str = "fp32") -> None:
    """onnxruntime-genai's CPU model of the checkpoint (`builder -i FOLDER -o OUT -p PRECISION -e cpu`)."""
    command = [sys.executable, str(genai_builder(python)), "-i", str(checkpoint), "-o", str(out)]
    command += ["-p", precision, "-e", "cpu", "-c", str(out / "cache")]
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=out.parent)
    if done.returncode != 0:
        raise BenchError(f"onnxruntime-genai's builder failed ({done.returncode}):\n{done.stderr[-3000:]}")
    shutil.rmtree(out / "cache", ignore_errors=True)


def prepare(cfg: ModelConfig, folder: Path, seed: int, genai: bool) -> dict:
    """The checkpoint, our artifact and onnxruntime-genai's model under `folder` (each kept when there);
    what was built or why not."""
    from export.progress import Progress

    progress = Progress()
    checkpoint, artifact, genai_model = folder / "checkpoint", folder / "artifact", folder / "genai"
    facts: dict = {"checkpoint": str(checkpoint), "artifact": str(artifact)}
    if not (checkpoint / "config.json").is_file() and _passed(artifact):
        with progress.stage("a LlamaForCausalLM checkpoint of the artifact's weights"):
            checkpoint_from_artifact(artifact, checkpoint)
    if not (checkpoint / "config.json").is_file():
        with progress.stage("a LlamaForCausalLM checkpoint of random weights"):
            make_checkpoint(cfg, checkpoint, seed)
    if not _built(artifact):
        with progress.stage(f"export build --weights {checkpoint.name} --layout hf ({', '.join(OURS)})"):
            import_artifact(checkpoint, artifact)
    report = json.loads((artifact / files.REPORT_FILENAME).read_text())
    facts["parity"] = {v: _rung(report, v) for v in OURS}
    if "source_check" in report:  # an import's proof against transformers (not a build of random weights)
        facts["source_check"] = {k: report["source_check"].get(k) for k in ("module", "relative", "passed")}
    facts["genai"] = {"used": False}
    if genai:
        try:
            with progress.stage("onnxruntime-genai: its venv and its model builder (fp32, int4)"):
                python = ensure_genai_venv()
                models = {}
                for name, precision in GENAI_PRECISIONS.items():
                    model = genai_model if precision == "fp32" else folder / f"genai-{precision}"
                    if not (model / "genai_config.json").is_file():
                        model.mkdir(parents=True, exist_ok=True)
                        build_genai(python, checkpoint, model, precision)
                    models[name] = str(model)
            facts["genai"] = {"used": True, "python": str(python), "model": models[GENAI], "models": models}
        except BenchError as error:
            facts["genai"] = {"used": False, "reason": str(error)}
    return facts


def _built(artifact: Path) -> bool:
    """Every form written, its parity rung recorded (a rung that failed is reported, not hidden)."""
    report = artifact / files.REPORT_FILENAME
    return report.is_file() and all(name in json.loads(report.read_text())["variants"] for name in OURS)


def _passed(artifact: Path) -> bool:
    report = artifact / files.REPORT_FILENAME
    return report.is_file() and bool(json.loads(report.read_text()).get("passed"))


def _rung(report: dict, variant: str) -> dict:
    """A form's parity rung at build, from report.json: passed, and its worst error on the logits
    against the PyTorch original (relative to their scale)."""
    entry = report["variants"][variant]
    worst = entry["worst"].get(names.LOGITS, {})
    return {"passed": entry["passed"], "logits_max_abs": worst.get("max_abs"), "logits_max_rel": worst.get("max_rel")}


# --- candidates: each opens once and generates from given prompts ----------------------------------


def transformers_candidate(checkpoint: Path, threads: int, static: bool) -> Generate:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def generate(prompts: np.ndarray, tokens: int) -> TimedGeneration:
        length = prompts.shape[1]
        ids = torch.from_numpy(prompts)
        with torch.inference_mode():
            if static:
                cache = transformers.StaticCache(config=model.config, max_cache_len=length + tokens)
            else:
                cache = transformers.DynamicCache(config=model.config)
            started = time.perf_counter()
            # logits_to_keep=1: the last position's logits, as transformers' generate asks for them
            logits = model(
                input_ids=ids, past_key_values=cache, cache_position=torch.arange(length), logits_to_keep=1
            ).logits
            chosen = [logits[:, -1].argmax(-1)]
            prefill_ms, step_ms = (time.perf_counter() - started) * 1e3, []
            for position in range(length, length + tokens - 1):
                t0 = time.perf_counter()
                logits = model(
                    input_ids=chosen[-1][:, None], past_key_values=cache, cache_position=torch.tensor([position])
                ).logits
                chosen.append(logits[:, -1].argmax(-1))
                step_ms.append((time.perf_counter() - t0) * 1e3)
        return TimedGeneration(prefill_ms, step_ms, torch.stack(chosen, dim=1).numpy())

    return generate


def stateless_candidate(path: Path, cfg: ModelConfig, threads: int) -> Generate:
    """A stateless graph: the presents it answers are bound, in ONNX Runtime's memory, as the next
    step's past (IOBinding: nothing copied between steps but the last position's logits)."""
    from contract.inputs import with_defaults
    from serving.engine.ort import ort_session

    session = ort_session(path, threads=threads)
    inputs = {i.name for i in session.get_inputs()}
    outputs = [o.name for o in session.get_outputs()]

    def run(feeds: dict) -> dict:
        binding = session.io_binding()
        for name, value in feeds.items():
            if name in inputs:  # position_ids only where the graph takes them
                bind = binding.bind_cpu_input if isinstance(value, np.ndarray) else binding.bind_ortvalue_input
                bind(name, value)
        for name in outputs:
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        return dict(zip(outputs, binding.get_outputs(), strict=True))

    def greedy(answer: dict) -> np.ndarray:
        return answer[names.LOGITS].numpy()[:, -1].argmax(-1)

    def generate(prompts: np.ndarray, tokens: int) -> TimedGeneration:
        batch, length = prompts.shape
        started = time.perf_counter()
        answer = run(with_defaults(cfg, {names.INPUT_IDS: prompts}))
        chosen = [greedy(answer)]
        prefill_ms, step_ms = (time.perf_counter() - started) * 1e3, []
        for past in range(length, length + tokens - 1):
            t0 = time.perf_counter()
            feeds = {
                names.INPUT_IDS: chosen[-1][:, None].astype(np.int64),
                names.ATTENTION_MASK: np.ones((batch, past + 1), np.int64),
                names.POSITION_IDS: np.full((batch, 1), past, np.int64),
            }
            for layer in range(cfg.n_layers):
                for kind in names.KV_KINDS:
                    feeds[names.past_name(layer, kind)] = answer[names.present_name(layer, kind)]
            answer = run(feeds)
            chosen.append(greedy(answer))
            step_ms.append((time.perf_counter() - t0) * 1e3)
        return TimedGeneration(prefill_ms, step_ms, np.stack(chosen, axis=1))

    return generate


def static_candidate(path: Path, cfg: ModelConfig, threads: int) -> Generate:
    """The static graph through the serving engine's KVPool: a row per prompt, prefilled one row per
    graph run as the engine runs it, then every row's token in one decode run per step."""
    import onnx
    import onnxruntime as ort

    from serving.engine.kv_pool import KVPool, last_logits_graph
    from serving.engine.ort import CPU_PROVIDER, ort_session, session_options

    session = ort_session(path, threads=threads)
    # the prompt's logits at its last position only (as transformers' logits_to_keep=1 and genai compute them)
    last_graph = last_logits_graph(onnx.load(str(path))).SerializeToString()
    last_logits = ort.InferenceSession(last_graph, sess_options=session_options(threads), providers=[CPU_PROVIDER])

    def generate(prompts: np.ndarray, tokens: int) -> TimedGeneration:
        batch, length = prompts.shape
        pool = KVPool(session, cfg, rows=batch, capacity=length + tokens, last_logits_session=last_logits)

        def step(ids: dict[int, np.ndarray], last_only: bool = False) -> np.ndarray:
            answers = pool.run(ids, last_only=last_only)
            for row, answer in answers.items():
                if isinstance(answer, Exception):
                    raise BenchError(f"{path.name}: row {row} failed: {answer}") from answer
            return np.array([answers[row][-1].argmax() for row in range(batch)], np.int64)

        started = time.perf_counter()
        chosen = [step({row: prompts[row] for row in range(batch)}, last_only=True)]
        prefill_ms, step_ms = (time.perf_counter() - started) * 1e3, []
        for _ in range(tokens - 1):
            t0 = time.perf_counter()
            chosen.append(step({row: chosen[-1][row : row + 1] for row in range(batch)}))
            step_ms.append((time.perf_counter() - t0) * 1e3)
        return TimedGeneration(prefill_ms, step_ms, np.stack(chosen, axis=1))

    return generate


class GenaiPeer:
    """onnxruntime-genai in its venv's process (bench/genai_peer.py), loaded once, asked per generation."""

    def __init__(self, python: Path, model: Path, threads: int) -> None:
        script = Path(__file__).with_name("genai_peer.py")
        self.process = subprocess.Popen(
            [str(python), str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.version = self.ask({"model": str(model), "threads": threads})["version"]

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        answer = json.loads(line) if line else {"error": f"the peer exited ({self.process.wait()})"}
        if "error" in answer:
            raise BenchError(f"onnxruntime-genai: {answer['error']}")
        return answer

    def __call__(self, prompts: np.ndarray, tokens: int) -> TimedGeneration:
        answer = self.ask({"prompts": prompts.tolist(), "tokens": tokens})
        return TimedGeneration(answer["prefill_ms"], answer["step_ms"], np.asarray(answer["tokens"], np.int64))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps({"quit": True}) + "\n")
            self.process.stdin.close()
            self.process.wait(timeout=30)


def candidates(cfg: ModelConfig, folder: Path, facts: dict, threads: int) -> dict[str, Generate]:
    checkpoint, artifact = Path(facts["checkpoint"]), Path(facts["artifact"])
    made: dict[str, Generate] = {
        TORCH: transformers_candidate(checkpoint, threads, static=False),
        TORCH_STATIC: transformers_candidate(checkpoint, threads, static=True),
    }
    for name in OURS:
        if not (artifact / files.model_filename(name)).is_file():
            continue  # its parity rung failed at build, which removed it: reported under build.parity
        form = static_candidate if name in STATIC_FORMS else stateless_candidate
        made[name] = form(artifact / files.model_filename(name), cfg, threads)
    if facts["genai"]["used"]:
        models = facts["genai"].get("models", {GENAI: facts["genai"]["model"]})
        for name, model in models.items():
            made[name] = GenaiPeer(Path(facts["genai"]["python"]), Path(model), threads)
    return made


# --- measuring -------------------------------------------------------------------------------------


def prompts_for(cfg: ModelConfig, plan: Plan) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(plan.seed)
    every = rng.integers(0, cfg.vocab_size, (max(plan.batches), plan.prompt), dtype=np.int64)
    return {batch: np.ascontiguousarray(every[:batch]) for batch in plan.batches}


def measure_all(generators: dict[str, Generate], prompts: dict[int, np.ndarray], plan: Plan) -> dict:
    """(candidate, batch) -> (prefill Timing, decode Timing, the first round's tokens); a short warm-up
    generation each first, then `rounds` interleaved rounds."""
    from export.progress import Progress

    progress = Progress()
    with progress.stage("warm-up: every candidate, 4 tokens"):
        for generate in generators.values():
            for batch_prompts in prompts.values():
                generate(batch_prompts, min(4, plan.tokens))
    measured: dict = {}
    for turn, name in interleaved(plan.rounds, list(generators)):
        with progress.stage(f"round {turn + 1}/{plan.rounds}: {name}"):
            for batch, batch_prompts in prompts.items():
                generation = generators[name](batch_prompts, plan.tokens)
                first = (Timing(), Timing(), generation.tokens)  # the first round's tokens are kept
                prefill, decode, _ = measured.setdefault((name, batch), first)
                prefill.samples_ms.append(generation.prefill_ms)
                decode.samples_ms.extend(generation.step_ms)
        time.sleep(SETTLE_S)  # its spinning threads go to sleep before the next candidate
    return measured


def agreement(tokens: np.ndarray, reference: np.ndarray) -> dict:
    """How many of the greedy tokens equal the reference's before the first difference (the fewest
    over the rows), and how many equal in all."""
    equal = tokens == reference
    first_difference = np.where(equal.all(axis=1), equal.shape[1], np.argmin(equal, axis=1))
    return {
        "agree_before_first_difference": int(first_difference.min()),
        "per_row": first_difference.tolist(),
        "equal": int(equal.sum()),
        "of": equal.size,
    }


# --- floors ----------------------------------------------------------------------------------------


def weight_read_bytes(path: Path) -> int:
    """The bytes of a graph's initializers a decode step reads: all but a Gather's table (an embedding:
    a row per token is read)."""
    import onnx

    model = onnx.load(str(path), load_external_data=True)
    consumers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            consumers.setdefault(name, set()).add(node.op_type if index == 0 else f"{node.op_type}:{index}")
    return sum(
        onnx.numpy_helper.to_array(tensor).nbytes
        for tensor in model.graph.initializer
        if consumers.get(tensor.name, set()) != {"Gather"}
    )


def floors_ms(cfg: ModelConfig, plan: Plan, artifact: Path, gbps: float) -> dict[int, dict[str, float]]:
    """batch -> candidate -> the decode step's floor in ms (module docstring)."""
    fp32_weights = (cfg.n_params() - cfg.vocab_size * cfg.d_model) * 4  # all but the embedding table
    # the quantized forms' weights as their graphs hold them (a form whose rung failed at build has no graph)
    quantized = {
        name: weight_read_bytes(artifact / files.model_filename(name))
        for name in (INT8W, STATIC_INT8W, STATIC_INT4W)
        if (artifact / files.model_filename(name)).is_file()
    }
    if STATIC_INT4W in quantized:
        quantized[GENAI_INT4] = quantized[STATIC_INT4W]  # the same scheme, the same bytes
    out = {}
    for batch in plan.batches:
        cache = {itemsize: cfg.kv_cache_bytes(batch, round(plan.mean_past), itemsize) for itemsize in (4, 1)}
        reads = dict.fromkeys((TORCH, TORCH_STATIC, FUSED, STATIC, GENAI), fp32_weights + cache[4])
        reads |= {name: nbytes + cache[4] for name, nbytes in quantized.items()}
        reads[STATIC_INT8KV] = fp32_weights + cache[1]
        out[batch] = {name: nbytes / (gbps * 1e9) * 1e3 for name, nbytes in reads.items()}
    return out


# --- results ---------------------------------------------------------------------------------------


def results_for(cfg, preset_name, plan, facts, measured, floors, bandwidth, threads, load) -> dict:
    rows = []
    for batch in plan.batches:
        reference = measured[(TORCH, batch)][2]
        row: dict = {"batch": batch, "prompt": plan.prompt, "tokens": plan.tokens, "candidates": {}}
        for name in CANDIDATES:
            if (name, batch) not in measured:
                continue
            prefill, decode, tokens = measured[(name, batch)]
            row["candidates"][name] = {
                "prefill": prefill.to_dict(),
                "decode_step": decode.to_dict(),
                "floor_ms": floors[batch][name],
                "greedy": agreement(tokens, reference),
            }
        rows.append(row)
    results = {
        "preset": preset_name,
        "config": cfg.to_dict(),
        "plan": dataclasses.asdict(plan),
        "machine": {**output.machine(threads, *RUNTIMES), "load_average_1min": load},
        "bandwidth": bandwidth,
        "build": facts,
        "rows": rows,
    }
    results["targets"] = targets(results)
    return results


def step_ms(row: dict, name: str) -> float:
    return row["candidates"][name]["decode_step"]["median_ms"]


def targets(results: dict) -> dict:
    """The issue's goals, measured (reported, never asserted)."""
    out: dict = {}
    for row in results["rows"]:
        batch, present = row["batch"], row["candidates"]
        if GENAI in present and STATIC in present:
            speedup = step_ms(row, GENAI) / step_ms(row, STATIC)
            out[f"static_vs_genai_decode_B{batch}"] = output.goal(speedup, least=1, kind="speedup")
        if batch == 1 and FUSED in present and INT8W in present:
            speedup = step_ms(row, FUSED) / step_ms(row, INT8W)
            out["int8w_vs_fused_decode_B1"] = output.goal(speedup, least=1.5, kind="speedup")
        if batch == 1 and GENAI in present and STATIC_INT8W in present:  # the issue's: INT8 weights vs genai's fp32
            speedup = step_ms(row, GENAI) / step_ms(row, STATIC_INT8W)
            out["static_int8w_vs_genai_decode_B1"] = output.goal(speedup, least=1.5, kind="speedup")
        if GENAI_INT4 in present and STATIC_INT4W in present:  # issue 48: 4-bit weights against genai's
            speedup = step_ms(row, GENAI_INT4) / step_ms(row, STATIC_INT4W)
            out[f"static_int4w_vs_genai_int4_decode_B{batch}"] = output.goal(speedup, least=1, kind="speedup")
        if batch == 1 and STATIC_INT8W in present and STATIC_INT4W in present:
            speedup = step_ms(row, STATIC_INT8W) / step_ms(row, STATIC_INT4W)
            out["static_int4w_vs_static_int8w_decode_B1"] = output.goal(speedup, least=1.5, kind="speedup")
    return out


def table(results: dict) -> str:
    plan = results["plan"]
    lines = [
        f"{results['preset']}: a {plan['prompt']}-token prompt then {plan['tokens']} greedy tokens, "
        f"{plan['rounds']} interleaved rounds, {results['machine']['threads']} threads, "
        f"{results['bandwidth']['gbps']:.1f} GB/s",
        f"{'batch':<6}{'candidate':<20}{'prefill ms':>11}{'step ms':>9}{'p90':>8}{'vs torch':>9}{'vs genai':>9}"
        f"{'floor ms':>9}{'/floor':>8}{'greedy = torch':>16}",
    ]
    for row in results["rows"]:
        present = row["candidates"]
        for name, entry in present.items():
            step = entry["decode_step"]
            versus_genai = f"{step_ms(row, GENAI) / step['median_ms']:>8.2f}x" if GENAI in present else f"{'-':>9}"
            greedy = entry["greedy"]
            lines.append(
                f"B{row['batch']:<5}{name:<20}{entry['prefill']['median_ms']:>11.1f}{step['median_ms']:>9.2f}"
                f"{step['p90_ms']:>8.2f}{step_ms(row, TORCH) / step['median_ms']:>8.2f}x{versus_genai}"
                f"{entry['floor_ms']:>9.3f}{step['median_ms'] / entry['floor_ms']:>8.2f}"
                f"{greedy['agree_before_first_difference']:>9} of {row['tokens']}"
            )
    lines.append(
        "step ms: one decode step (a token per row), median; vs torch / vs genai: how many times faster (medians); "
        "greedy = torch: tokens equal to transformers' before the first difference, the fewest over the rows"
    )
    parity = results["build"]["parity"]
    lines.append(
        "parity at build (logits, max error / their scale): "
        + ", ".join(f"{v} {p['logits_max_rel']:.1e} {'pass' if p['passed'] else 'FAILED'}" for v, p in parity.items())
    )
    if not results["build"]["genai"]["used"]:
        lines.append(f"onnxruntime-genai left out: {results['build']['genai'].get('reason', 'not asked for')}")
    lines += output.target_lines("targets:", results["targets"], "speedup")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    from bench.plot import gridded, save

    rows = results["rows"]
    figure, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.5), squeeze=False)
    for axis, row in zip(axes[0], rows, strict=True):
        present = list(row["candidates"])
        steps = [step_ms(row, name) for name in present]
        floors = [row["candidates"][name]["floor_ms"] for name in present]
        axis.bar(range(len(present)), steps, color="tab:blue", label="decode step, median")
        axis.scatter(range(len(present)), floors, color="black", marker="_", s=400, label="bandwidth floor", zorder=3)
        axis.set_xticks(range(len(present)), present, rotation=30, ha="right", fontsize=8)
        axis.set(ylabel="ms per decode step", yscale="log", title=f"{results['preset']}, batch {row['batch']}")
        gridded(axis)
    figure.suptitle(f"greedy decode after a {results['plan']['prompt']}-token prompt (CPU)")
    return save(figure, path)


# --- command (through `python -m bench model`) -----------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    whole = parser.add_argument_group("a whole model's presets (llama-whole): greedy generation, bench/whole_model.py")
    whole.add_argument("--prompt", type=int, help="prompt ids per row (default 512; --quick 16)")
    whole.add_argument("--tokens", type=int, help="greedy tokens generated (default 128; --quick 8)")
    whole.add_argument("--batches", help="comma-separated batch sizes (default 1,8; --quick 1,2)")
    output.rounds_argument(whole, None, "default 3; --quick 1")
    whole.add_argument("--no-genai", action="store_true", help="leave onnxruntime-genai out")


def plan_from(args: argparse.Namespace) -> Plan:
    return output.planned(args, Plan, "prompt", "tokens", "rounds", batches=output.counts(args.batches))


def benchmark(cfg: ModelConfig, preset_name: str, folder: Path, plan: Plan, threads: int, genai: bool) -> dict:
    load_before = os.getloadavg()[0]
    facts = prepare(cfg, folder, plan.seed, genai)
    generators = candidates(cfg, folder, facts, threads)
    try:
        before = copy_bandwidth(threads)
        measured = measure_all(generators, prompts_for(cfg, plan), plan)
        after = copy_bandwidth(threads)
    finally:
        for name in GENAI_PRECISIONS:
            if isinstance(generators.get(name), GenaiPeer):
                generators[name].close()
    if GENAI in generators:
        facts["genai"]["version"] = generators[GENAI].version
    bandwidth = {"before": before, "after": after, "gbps": max(before["gbps"], after["gbps"])}
    floors = floors_ms(cfg, plan, Path(facts["artifact"]), bandwidth["gbps"])
    load = {"before": load_before, "after": os.getloadavg()[0]}
    return results_for(cfg, preset_name, plan, facts, measured, floors, bandwidth, threads, load)


def run(configs: dict[str, ModelConfig], args: argparse.Namespace, root: Path) -> int:
    """Each whole preset under `root/<preset>`; `model_whole.json` and `.png` in `args.out`."""

    plan = plan_from(args)
    for name, cfg in configs.items():
        results = benchmark(cfg, name, root / name, plan, args.threads, genai=not args.no_genai)
        output.report(
            results, args.out, "model_whole" if len(configs) == 1 else f"model_whole-{name}", plot, table(results)
        )
    return 0
