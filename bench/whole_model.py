"""A whole model (token ids in, logits out) generating greedily on one checkpoint: transformers' LlamaForCausalLM
(`torch`; `torch-static` with its StaticCache), our forms imported from it by `python -m export build --weights
FOLDER --layout hf` (the stateless ones through IOBinding, their presents fed back; `fp32-static*` through the
serving engine's KVPool; no fp16: ONNX Runtime's CPU provider emulates it) and onnxruntime-genai's builder's fp32
and int4 CPU models, run by its Generator in a process of its own (bench/genai_peer.py: it brings an onnxruntime
that must not meet ours) from `.venv-genai`. `python -m bench model --presets llama-whole` runs it.

The checkpoint holds random weights (or, where the work folder has our artifact, its weights) and a tokenizer (the
builder wants one). Each row prompts `prompt` random ids: the prefill (to the first greedy token), then `tokens - 1`
decode steps, each timed; every candidate in `rounds` interleaved rounds. Reported: the prefill's median, a step's
median and p90 over every step, the greedy tokens equal to `torch`'s before the first difference (the fewest over
the rows), and each step against its floor: the bytes it reads (the weights but the embedding table, as its graph
holds them, and the KV cache at the mean past) at the measured bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from bench import results as output
from bench.plot import figure, gridded, grouped_bars, save
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
# The goals, decode step speedups: (key, ours, the peer, the batch asked at (None: every), the least)
GOALS = (
    ("static_vs_genai_decode_B{batch}", STATIC, GENAI, None, 1),
    ("int8w_vs_fused_decode_B1", INT8W, FUSED, 1, 1.5),
    ("static_int8w_vs_genai_decode_B1", STATIC_INT8W, GENAI, 1, 1.5),  # INT8 weights against genai's fp32
    ("static_int4w_vs_genai_int4_decode_B{batch}", STATIC_INT4W, GENAI_INT4, None, 1),  # issue 48
    ("static_int4w_vs_static_int8w_decode_B1", STATIC_INT4W, STATIC_INT8W, 1, 1.5),
)


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


def llama_shaped(cfg: ModelConfig) -> bool:
    """Whether transformers' LlamaForCausalLM computes `cfg`'s model: RMSNorm, rotary, a gated SiLU MLP,
    no biases, an LM head of its own."""
    block = cfg.whole and cfg.norm == "rmsnorm" and cfg.rotary and cfg.mlp == "gated" and cfg.mlp_activation == "silu"
    return block and not (cfg.bias or cfg.mlp_bias or cfg.tie_embeddings)


def hf_config(cfg: ModelConfig):
    """transformers' LlamaConfig of `cfg` (a Llama-shaped whole model): the trainer's, with a head of its own and
    the tokenizer's special ids."""
    import transformers

    from export.train import hf_config as llama_config

    if not llama_shaped(cfg):
        raise BenchError(f"the whole-model bench takes a Llama-shaped config, got {cfg}")
    own = {"tie_word_embeddings": False, "initializer_range": INIT_STD, "bos_token_id": 0, "pad_token_id": 2}
    return transformers.LlamaConfig(**llama_config(cfg, end_id=1) | own)


def make_checkpoint(cfg: ModelConfig, folder: Path, seed: int, weights: dict | None = None) -> None:
    """LlamaForCausalLM and a tokenizer saved in `folder`: `weights` (transformers' names), or random ones."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config(cfg))
    if weights is None:
        with torch.no_grad():
            model.lm_head.weight.mul_(HEAD_SCALE)
    else:
        model.load_state_dict(weights, strict=True)
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
    "mlp_norm": "post_attention_layernorm",
    **{f"attn.W_{p}": f"self_attn.{p}_proj" for p in "qkvo"},
    **{f"mlp.W_{p}": f"mlp.{p}_proj" for p in ("gate", "up", "down")},
}


def hf_name(name: str) -> str:
    module, _, kind = name.rpartition(".")
    if module.startswith("layers."):
        _, index, rest = module.split(".", 2)
        return f"model.layers.{index}.{HF_LAYER_NAMES[rest]}.{kind}"
    return f"{HF_NAMES[module]}.{kind}"


def checkpoint_from_artifact(artifact: Path, folder: Path) -> None:
    """The checkpoint of an artifact already built (its own weights), so that it is not imported again."""
    from export.artifacts import load_model

    ours = load_model(artifact)
    make_checkpoint(ours.cfg, folder, 0, {hf_name(name): tensor for name, tensor in ours.state_dict().items()})


def import_artifact(checkpoint: Path, out: Path) -> None:
    """Our forms of the checkpoint, by the documented command (each proven at build, report.json)."""
    command = [sys.executable, "-m", "export", "build", "--weights", str(checkpoint), "--layout", "hf"]
    command += ["--out", str(out), "--variants", ",".join(OURS)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 and _built(out):  # a parity rung failed: measured all the same, its verdict reported
        print(f"warning: {done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]}")
    elif done.returncode != 0:
        raise BenchError(f"`{' '.join(command)}` failed ({done.returncode}):\n{done.stderr[-3000:]}")


def _checked(command: list[str], failing: str, **where) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False, **where)
    if done.returncode != 0:
        raise BenchError(f"{failing}: `{' '.join(command)}` ({done.returncode}):\n{done.stderr[-3000:]}")


def ensure_genai_venv(venv: Path = GENAI_VENV) -> Path:
    """The python of `venv`, with onnxruntime-genai installed there first if it is not (about 10 s from PyPI)."""
    python, stamp = venv / "bin" / "python", venv / ".installed-genai"
    if not (stamp.is_file() and python.is_file()):
        _checked([sys.executable, "-m", "venv", "--clear", str(venv)], "cannot make the onnxruntime-genai venv")
        install = [str(python), "-m", "pip", "install", "--quiet", *GENAI_REQUIREMENTS]
        _checked(install, "cannot make the onnxruntime-genai venv")
        stamp.touch()
    return python


def build_genai(python: Path, checkpoint: Path, out: Path, precision: str = "fp32") -> None:
    """onnxruntime-genai's CPU model of the checkpoint. Its builder runs on our python: a pure-Python script
    over torch, transformers and onnx (which its venv leaves out)."""
    found = sorted(python.parent.parent.glob("lib/python*/site-packages/onnxruntime_genai/models/builder.py"))
    if not found:
        raise BenchError(f"no onnxruntime_genai/models/builder.py in {python.parent.parent}")
    command = [sys.executable, str(found[-1]), "-i", str(checkpoint), "-o", str(out), "-p", precision, "-e", "cpu"]
    _checked([*command, "-c", str(out / "cache")], "onnxruntime-genai's builder failed", cwd=out.parent)
    shutil.rmtree(out / "cache", ignore_errors=True)


def prepare(cfg: ModelConfig, folder: Path, seed: int, genai: bool) -> dict:
    """The checkpoint, our artifact and onnxruntime-genai's models under `folder` (each kept when there);
    what was built or why not."""
    from export.progress import Progress

    progress = Progress()
    checkpoint, artifact = folder / "checkpoint", folder / "artifact"
    if not (checkpoint / "config.json").is_file() and _report(artifact).get("passed"):
        with progress.stage("a LlamaForCausalLM checkpoint of the artifact's weights"):
            checkpoint_from_artifact(artifact, checkpoint)
    if not (checkpoint / "config.json").is_file():
        with progress.stage("a LlamaForCausalLM checkpoint of random weights"):
            make_checkpoint(cfg, checkpoint, seed)
    if not _built(artifact):
        with progress.stage(f"export build --weights {checkpoint.name} --layout hf ({', '.join(OURS)})"):
            import_artifact(checkpoint, artifact)
    report = _report(artifact)
    facts: dict = {"checkpoint": str(checkpoint), "artifact": str(artifact)}
    facts["parity"] = {v: _rung(report, v) for v in OURS}
    if "source_check" in report:  # an import's proof against transformers (not a build of random weights)
        facts["source_check"] = {k: report["source_check"].get(k) for k in ("module", "relative", "passed")}
    facts["genai"] = {"used": False}
    if genai:
        try:
            with progress.stage("onnxruntime-genai: its venv and its model builder (fp32, int4)"):
                facts["genai"] = genai_models(checkpoint, folder)
        except BenchError as error:
            facts["genai"] = {"used": False, "reason": str(error)}
    return facts


def genai_models(checkpoint: Path, folder: Path) -> dict:
    """onnxruntime-genai's venv and its models of the checkpoint, `folder/genai` (fp32) and `genai-int4`."""
    python, models = ensure_genai_venv(), {}
    for name, precision in GENAI_PRECISIONS.items():
        model = folder / ("genai" if precision == "fp32" else f"genai-{precision}")
        if not (model / "genai_config.json").is_file():
            model.mkdir(parents=True, exist_ok=True)
            build_genai(python, checkpoint, model, precision)
        models[name] = str(model)
    return {"used": True, "python": str(python), "model": models[GENAI], "models": models}


def _report(artifact: Path) -> dict:
    report = artifact / files.REPORT_FILENAME
    return json.loads(report.read_text()) if report.is_file() else {}


def _built(artifact: Path) -> bool:
    """Every form written, its parity rung recorded (a rung that failed is reported, not hidden)."""
    return all(name in _report(artifact).get("variants", {}) for name in OURS)


def _rung(report: dict, variant: str) -> dict:
    """A form's parity rung at build: passed, and its worst error on the logits (relative: to their scale)."""
    entry = report["variants"][variant]
    worst = entry["worst"].get(names.LOGITS, {})
    return {"passed": entry["passed"], "logits_max_abs": worst.get("max_abs"), "logits_max_rel": worst.get("max_rel")}


def timed(greedy_ids: Iterator[np.ndarray], tokens: int) -> TimedGeneration:
    """`tokens` greedy ids (B,) from `greedy_ids`, each timed: the first the prefill's, then a decode step's."""
    chosen, times_ms = [], []
    for _ in range(tokens):
        started = time.perf_counter()
        chosen.append(next(greedy_ids))
        times_ms.append((time.perf_counter() - started) * 1e3)
    return TimedGeneration(times_ms[0], times_ms[1:], np.stack(chosen, axis=1))


def transformers_candidate(checkpoint: Path, threads: int, static: bool) -> Generate:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def greedy_ids(prompts: np.ndarray, cache) -> Iterator[np.ndarray]:
        length = prompts.shape[1]
        # logits_to_keep=1: the last position's logits, as transformers' generate asks for them
        first = torch.arange(length)
        answer = model(
            input_ids=torch.from_numpy(prompts), past_key_values=cache, cache_position=first, logits_to_keep=1
        )
        for position in itertools.count(length):
            ids = answer.logits[:, -1].argmax(-1)
            yield ids.numpy()
            answer = model(input_ids=ids[:, None], past_key_values=cache, cache_position=torch.tensor([position]))

    def generate(prompts: np.ndarray, tokens: int) -> TimedGeneration:
        with torch.inference_mode():
            if static:
                cache = transformers.StaticCache(config=model.config, max_cache_len=prompts.shape[1] + tokens)
            else:
                cache = transformers.DynamicCache(config=model.config)
            return timed(greedy_ids(prompts, cache), tokens)

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

    def greedy_ids(prompts: np.ndarray) -> Iterator[np.ndarray]:
        batch, length = prompts.shape
        answer = run(with_defaults(cfg, {names.INPUT_IDS: prompts}))
        for past in itertools.count(length):
            ids = answer[names.LOGITS].numpy()[:, -1].argmax(-1)
            yield ids
            feeds = {
                names.INPUT_IDS: ids[:, None].astype(np.int64),
                names.ATTENTION_MASK: np.ones((batch, past + 1), np.int64),
                names.POSITION_IDS: np.full((batch, 1), past, np.int64),
            }
            for layer, kind in itertools.product(range(cfg.n_layers), names.KV_KINDS):
                feeds[names.past_name(layer, kind)] = answer[names.present_name(layer, kind)]
            answer = run(feeds)

    return lambda prompts, tokens: timed(greedy_ids(prompts), tokens)


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

    def step(pool: KVPool, ids: dict[int, np.ndarray], last_only: bool = False) -> np.ndarray:
        answers = pool.run(ids, last_only=last_only)
        for row, answer in answers.items():
            if isinstance(answer, Exception):
                raise BenchError(f"{path.name}: row {row} failed: {answer}") from answer
        return np.array([answers[row][-1].argmax() for row in range(len(ids))], np.int64)

    def greedy_ids(pool: KVPool, prompts: np.ndarray) -> Iterator[np.ndarray]:
        ids = step(pool, dict(enumerate(prompts)), last_only=True)
        while True:
            yield ids
            ids = step(pool, {row: ids[row : row + 1] for row in range(len(ids))})

    def generate(prompts: np.ndarray, tokens: int) -> TimedGeneration:
        batch, length = prompts.shape
        pool = KVPool(session, cfg, rows=batch, capacity=length + tokens, last_logits_session=last_logits)
        return timed(greedy_ids(pool, prompts), tokens)

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


def candidates(cfg: ModelConfig, facts: dict, threads: int) -> dict[str, Generate]:
    checkpoint, artifact = Path(facts["checkpoint"]), Path(facts["artifact"])
    made = {name: transformers_candidate(checkpoint, threads, name == TORCH_STATIC) for name in (TORCH, TORCH_STATIC)}
    for name in OURS:
        if (artifact / files.model_filename(name)).is_file():  # else its rung failed at build: under build.parity
            form = static_candidate if name in STATIC_FORMS else stateless_candidate
            made[name] = form(artifact / files.model_filename(name), cfg, threads)
    for name, model in facts["genai"].get("models", {}).items():
        made[name] = GenaiPeer(Path(facts["genai"]["python"]), Path(model), threads)
    return made


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
        for generate, batch_prompts in itertools.product(generators.values(), prompts.values()):
            generate(batch_prompts, min(4, plan.tokens))
    measured: dict = {}
    for turn, name in interleaved(plan.rounds, list(generators)):
        with progress.stage(f"round {turn + 1}/{plan.rounds}: {name}"):
            for batch, batch_prompts in prompts.items():
                generation = generators[name](batch_prompts, plan.tokens)
                prefill, decode, _ = measured.setdefault((name, batch), (Timing(), Timing(), generation.tokens))
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
    weights = dict.fromkeys((TORCH, TORCH_STATIC, FUSED, STATIC, GENAI, STATIC_INT8KV), fp32_weights)
    for name in (INT8W, STATIC_INT8W, STATIC_INT4W):  # as their graphs hold them (where built)
        if (artifact / files.model_filename(name)).is_file():
            weights[name] = weight_read_bytes(artifact / files.model_filename(name))
    if STATIC_INT4W in weights:
        weights[GENAI_INT4] = weights[STATIC_INT4W]  # the same scheme, the same bytes
    out = {}
    for batch in plan.batches:
        cache = {itemsize: cfg.kv_cache_bytes(batch, round(plan.mean_past), itemsize) for itemsize in (4, 1)}
        reads = {name: nbytes + cache[1 if name == STATIC_INT8KV else 4] for name, nbytes in weights.items()}
        out[batch] = {name: nbytes / (gbps * 1e9) * 1e3 for name, nbytes in reads.items()}
    return out


def rows_for(plan: Plan, measured: dict, floors: dict) -> list[dict]:
    rows = []
    for batch in plan.batches:
        entries = {}
        for name in [name for name in CANDIDATES if (name, batch) in measured]:
            prefill, decode, tokens = measured[(name, batch)]
            entries[name] = {
                "prefill": prefill.to_dict(),
                "decode_step": decode.to_dict(),
                "floor_ms": floors[batch][name],
                "greedy": agreement(tokens, measured[(TORCH, batch)][2]),
            }
        rows.append({"batch": batch, "prompt": plan.prompt, "tokens": plan.tokens, "candidates": entries})
    return rows


def step_ms(row: dict, name: str) -> float:
    return row["candidates"][name]["decode_step"]["median_ms"]


def targets(results: dict) -> dict:
    """The issue's goals, measured (reported, never asserted)."""
    out: dict = {}
    for row, (key, ours, peer, batch, least) in itertools.product(results["rows"], GOALS):
        if batch in (None, row["batch"]) and {ours, peer} <= set(row["candidates"]):
            speedup = step_ms(row, peer) / step_ms(row, ours)
            out[key.format(batch=row["batch"])] = output.goal(speedup, least=least, kind="speedup")
    return out


def table(results: dict) -> str:
    plan, build = results["plan"], results["build"]
    heading = (
        f"{results['preset']}: a {plan['prompt']}-token prompt then {plan['tokens']} greedy tokens, "
        f"{plan['rounds']} interleaved rounds, {results['machine']['threads']} threads, "
        f"{results['bandwidth']['gbps']:.1f} GB/s"
    )
    header = ("batch", "candidate", "prefill ms", "step ms", "p90", "vs torch", "vs genai", "floor ms", "/floor")
    rows = []
    for row in results["rows"]:
        for name, entry in row["candidates"].items():
            median, floor = step_ms(row, name), entry["floor_ms"]
            agree = entry["greedy"]["agree_before_first_difference"]
            versus_genai = f"{step_ms(row, GENAI) / median:.2f}x" if GENAI in row["candidates"] else "-"
            times = [f"{entry['prefill']['median_ms']:.1f}", f"{median:.2f}", f"{entry['decode_step']['p90_ms']:.2f}"]
            ratios = [f"{step_ms(row, TORCH) / median:.2f}x", versus_genai, f"{floor:.3f}", f"{median / floor:.2f}"]
            rows.append([f"B{row['batch']}", name, *times, *ratios, f"{agree} of {row['tokens']}"])
    parity = ", ".join(
        f"{v} {p['logits_max_rel']:.1e} {'pass' if p['passed'] else 'FAILED'}" for v, p in build["parity"].items()
    )
    lines = [
        output.table(heading, (*header, "greedy = torch"), rows),
        "step ms: one decode step (a token per row), median; vs torch / vs genai: how many times faster (medians); "
        "greedy = torch: tokens equal to transformers' before the first difference, the fewest over the rows",
        f"parity at build (logits, max error / their scale): {parity}",
    ]
    if not build["genai"]["used"]:
        lines.append(f"onnxruntime-genai left out: {build['genai'].get('reason', 'not asked for')}")
    return "\n".join(lines + output.target_lines("targets:", results["targets"], "speedup"))


def plot(results: dict, path: Path) -> Path:
    rows = results["rows"]
    drawn, axes = figure(len(rows), (6 * len(rows), 4.5))
    for axis, row in zip(axes, rows, strict=True):
        present = list(row["candidates"])
        title = f"{results['preset']}, batch {row['batch']}"
        steps = {"decode step, median": [step_ms(row, name) for name in present]}
        where = grouped_bars(axis, present, steps, ylabel="ms per decode step", yscale="log", title=title)
        floors = [row["candidates"][name]["floor_ms"] for name in present]
        axis.scatter(where, floors, color="black", marker="_", s=400, label="bandwidth floor", zorder=3)
        axis.set_xticks(where, present, rotation=30, ha="right", fontsize=8)
        gridded(axis)
    drawn.suptitle(f"greedy decode after a {results['plan']['prompt']}-token prompt (CPU)")
    return save(drawn, path)


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
    with output.during(threads, *RUNTIMES) as machine:
        facts = prepare(cfg, folder, plan.seed, genai)
        generators = candidates(cfg, facts, threads)
        try:
            bandwidth = {"before": copy_bandwidth(threads)}
            measured = measure_all(generators, prompts_for(cfg, plan), plan)
            bandwidth["after"] = copy_bandwidth(threads)
        finally:
            for generate in generators.values():
                if isinstance(generate, GenaiPeer):
                    generate.close()
    if GENAI in generators:
        facts["genai"]["version"] = generators[GENAI].version
    bandwidth["gbps"] = max(bandwidth["before"]["gbps"], bandwidth["after"]["gbps"])
    floors = floors_ms(cfg, plan, Path(facts["artifact"]), bandwidth["gbps"])
    results = {
        "preset": preset_name,
        "config": cfg.to_dict(),
        "plan": dataclasses.asdict(plan),
        "machine": machine,
        "bandwidth": bandwidth,
        "build": facts,
        "rows": rows_for(plan, measured, floors),
    }
    return results | {"targets": targets(results)}


def run(configs: dict[str, ModelConfig], args: argparse.Namespace, root: Path) -> int:
    """Each whole preset under `root/<preset>`; `model_whole.json` and `.png` in `args.out`."""
    plan = plan_from(args)
    for name, cfg in configs.items():
        results = benchmark(cfg, name, root / name, plan, args.threads, genai=not args.no_genai)
        out_name = "model_whole" if len(configs) == 1 else f"model_whole-{name}"
        output.report(results, args.out, out_name, plot, table(results))
    return 0
