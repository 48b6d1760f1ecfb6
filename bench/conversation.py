"""Conversations: the next turn's time to first token against a cold prefill, through the OpenAI-compatible
chat route. `python -m bench conversation` runs it.

Writes `conversation.json` and `conversation.png` and prints a table and the goal.

The model: transformers' `LlamaForCausalLM` of random weights made from a config (hidden 256, 4 layers, 8
heads, 4 key/value heads, 4,608 positions: the longest turn and its answers fit), beside a byte-level BPE
tokenizer trained on a fixed corpus and Llama 3's chat template (tests/fixtures/text.py). Our artifact is
imported from that folder with the documented command (`python -m export build --weights DIR --layout hf
--variants fp32-fused,fp32-static`); the checkpoint and the artifact are kept under `--work` and reused.

Served for real: Triton (`sessions`: its engine core generates) and the gateway with API keys, called
with the official `openai` SDK, streamed. A conversation of length L: its first request is a user message
whose rendered prompt is about L tokens (a fresh random first line, then text of the tokenizer's corpus);
the next turn re-sends it with the assistant's answer and a short new user message. Each conversation has
an API key of its own, so that its first request shares nothing with any session the gateway keeps:

- `cold`: the first request: the whole prompt prefilled (`cached_tokens` 0);
- `warm`: the next turn: the session model's engine core finds the row the first request left (kept for
  its owner, the API key) and prefills only what the turn adds (`cached_tokens`: the ids reused);
- `torch prefill`: transformers' forward over the cold prompt's ids (one call, the last position's
  logits), the PyTorch original's cost of the same prefill, in this process.

Time to first token (TTFT): from the request to the first streamed chunk with text. Each answer is
`answer` greedy tokens (`ignore_eos`: the random model's end-of-text token does not cut it short). Every
length runs once untimed first (the graphs' first runs at a new size); then `rounds` rounds, the lengths'
order reversed every round, each a new conversation per length then its torch prefill. Reported per
length: the medians over rounds and each round's values, and the ratio cold / warm (the goal: >= 10 at
4,000 tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from bench import results as output
from bench.timing import SETTLE_S, interleaved

MODEL_ID = "bench-llama"  # the model's id on the OpenAI routes
VARIANTS = ("fp32-fused", "fp32-static")  # what the session model and the stateless one serve
TEMPLATE = "llama3"  # it trims each message's content: an answer re-sent parts from the prompt at no token
NEXT_QUESTION = "Thank you. In one sentence, what does the text above do?"
GOAL_LENGTH, GOAL_RATIO = 4000, 10.0  # issue 32: the next turn of a 4,000-token conversation, >= 10x faster
REQUEST_TIMEOUT_S = 300.0  # a cold 4k prefill on 2 cores takes seconds; the gateway's default is 30
QUESTION_ROOM = 64  # positions the next question and its template markers take, at most


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (a build failed, a reply had no text or no usage)."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """The Llama-shaped checkpoint's size, as transformers' LlamaConfig takes it."""

    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 704
    max_positions: int = 4608
    vocab: int = 512  # at most: the tokenizer's trained ids, which the model's vocab_size then is

    @property
    def name(self) -> str:
        """The work folder's name: a build of another shape is never reused for this one."""
        return f"llama-{self.hidden}x{self.layers}-{self.max_positions}"


@dataclasses.dataclass(frozen=True)
class Plan:
    lengths: tuple[int, ...] = (1000, 4000)  # the cold prompt's tokens, as rendered by the chat template
    rounds: int = 3
    answer: int = 16  # tokens each reply generates
    seed: int = 0  # the weights and the first lines
    shape: Shape = Shape()

    @classmethod
    def quick(cls) -> Plan:
        small = Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=176, max_positions=512)
        return cls(lengths=(128, 384), rounds=1, answer=8, shape=small)

    @property
    def conversations(self) -> int:
        """Every conversation the run holds: an untimed one per length, then one per length a round."""
        return len(self.lengths) * (1 + self.rounds)


@dataclasses.dataclass(frozen=True)
class Reply:
    """One streamed chat completion, as its caller saw it."""

    ttft_ms: float  # the request to the first chunk with text
    total_ms: float  # the request to the stream's end
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclasses.dataclass(frozen=True)
class Turns:
    """One conversation: its first request, its next turn and the PyTorch original's prefill of the first."""

    cold: Reply
    warm: Reply
    torch_prefill_ms: float


# --- the checkpoint and our artifact of it ----------------------------------------------------------------


def make_checkpoint(folder: Path, shape: Shape, seed: int) -> None:
    """LlamaForCausalLM of random weights (seeded) beside a byte-level BPE tokenizer and Llama 3's chat
    template, saved as transformers saves a checkpoint."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from tests.fixtures.text import save_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    save_tokenizer(folder, shape.vocab, template=TEMPLATE)
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=False,
        pad_token_id=0,  # the tokenizer's <pad>, <s>, </s>
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def import_command(checkpoint: Path, artifact: Path) -> list[str]:
    """The documented import (docs/importing.md) of the checkpoint's whole decoder."""
    command = [sys.executable, "-m", "export", "build", "--weights", str(checkpoint), "--layout", "hf"]
    return [*command, "--out", str(artifact), "--variants", ",".join(VARIANTS)]


# the build's progress lines ("fp32-static: parity ... done in 3.7 s"): where its time went
STAGE_DONE = re.compile(r"^(?P<variant>[\w-]+): (?P<stage>export|parity) \.\.\. done in (?P<seconds>[\d.]+) s$")


def stage_seconds(log: str) -> dict[str, dict[str, float]]:
    """variant -> {"export": s, "parity": s} from the build's progress lines."""
    stages: dict[str, dict[str, float]] = {}
    for line in log.splitlines():
        found = STAGE_DONE.match(line.strip())
        if found and found["variant"] in VARIANTS:
            stages.setdefault(found["variant"], {})[found["stage"]] = float(found["seconds"])
    return stages


def import_artifact(checkpoint: Path, artifact: Path, record: Path) -> None:
    """Run the import, timed; its wall time and each form's stages written to `record` for later runs."""
    command = import_command(checkpoint, artifact)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    log = done.stdout + done.stderr
    (artifact.parent / "build.log").write_text(log)
    if done.returncode != 0:
        raise BenchError(f"`{' '.join(command)}` failed ({done.returncode}):\n{log[-3000:]}")
    record.write_text(json.dumps({"seconds": seconds, "stages_s": stage_seconds(log)}, indent=2) + "\n")


def built(artifact: Path) -> bool:
    from contract import files

    report = artifact / files.REPORT_FILENAME
    return report.is_file() and all(name in json.loads(report.read_text())["variants"] for name in VARIANTS)


def prepare(folder: Path, shape: Shape, seed: int) -> dict:
    """The checkpoint and our artifact of it under `folder` (each kept when there); what was built, how long
    it took, and each form's parity at build."""
    from contract import files
    from export.progress import Progress

    progress = Progress()
    checkpoint, artifact, record = folder / "checkpoint", folder / "artifact", folder / "build.json"
    if not (checkpoint / "config.json").is_file():
        with progress.stage(f"a LlamaForCausalLM checkpoint of random weights ({shape.name})"):
            make_checkpoint(checkpoint, shape, seed)
    reused = built(artifact) and record.is_file()
    if not reused:
        with progress.stage(f"export build --weights {checkpoint.name} --layout hf ({', '.join(VARIANTS)})"):
            import_artifact(checkpoint, artifact, record)
    report = json.loads((artifact / files.REPORT_FILENAME).read_text())
    variants = {
        name: {"passed": report["variants"][name]["passed"], "build_seconds": report["variants"][name]["build_seconds"]}
        for name in VARIANTS
    }
    return {
        "checkpoint": str(checkpoint),
        "artifact": str(artifact),
        "command": " ".join(["python", *import_command(checkpoint, artifact)[1:]]),
        "reused": reused,
        "import": json.loads(record.read_text()),
        "variants": variants,
        "source_check": {k: report.get("source_check", {}).get(k) for k in ("module", "relative", "passed")},
    }


# --- serving ----------------------------------------------------------------------------------------------


def keys_for(plan: Plan) -> dict[tuple[int, int], str]:
    """(round, length) -> the API key of that conversation (round -1: the untimed one). A key of its own:
    the engine core keeps an owner's finished rows, and a first request must find none to reuse."""
    return {
        (turn, length): f"bench-conversation-{turn + 1}-{length}-{secrets.token_hex(4)}"
        for turn in range(-1, plan.rounds)
        for length in plan.lengths
    }


@contextlib.contextmanager
def serving(artifact: Path, root: Path, plan: Plan, threads: int, keys: list[str]) -> Iterator[tuple[str, dict]]:
    """Triton serving the artifact and the gateway in front of it (on a thread), ready; the gateway's URL
    and what the servers were given. Stopped afterwards."""
    from bench.serving import model_parameters
    from contract.config import ModelConfig
    from contract.deployment import ServingSettings
    from export.progress import Progress
    from serving.gateway import Settings
    from serving.gateway.server import run_gateway
    from serving.host.launcher import start_triton
    from serving.triton import config as triton_config
    from serving.triton.repository import write_repository

    cfg = ModelConfig.load(artifact)
    # every session the run keeps (two a conversation: the first request's and the next turn's, kept until
    # idle) in full rows: no measured request waits for kept conversations to be ended to make room
    sessions = 2 * plan.conversations
    settings = ServingSettings(threads=threads, kv_cache_bytes=cfg.kv_cache_bytes(sessions, cfg.max_seq_len))
    models = (triton_config.FORWARD, triton_config.SESSIONS)
    repository = write_repository(artifact, root / "repository", settings, models=models)
    facts = {
        "kv_cache_bytes": settings.kv_cache_bytes,
        "kv_budget_sessions_of_max_seq_len": sessions,
        "max_seq_len": cfg.max_seq_len,
        "threads": threads,
        "step_tokens": int(model_parameters(repository, models[1])[triton_config.P_STEP_TOKENS]),
    }
    progress = Progress()
    with progress.stage("start Triton"):
        server = start_triton(repository, log_path=root / "triton.log")
    try:
        gateway = run_gateway(
            Settings(
                port=0,
                log_level="warning",
                api_keys=tuple(keys),
                triton_url=server.grpc_url,
                served_model_name=MODEL_ID,
                request_timeout_s=REQUEST_TIMEOUT_S,
            )
        )
        try:
            yield gateway.url, facts
        finally:
            gateway.stop()
    finally:
        server.stop()


# --- conversations ----------------------------------------------------------------------------------------


def chat(client, messages: list[dict], answer: int) -> Reply:
    """A streamed chat completion at temperature 0: its time to the first text, its text and its usage."""
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=messages,
        max_tokens=answer,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    first, pieces, usage = None, [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                pieces.append(choice.delta.content)
    ended = time.perf_counter()
    if usage is None:
        raise BenchError("a streamed reply ended without its usage chunk (stream_options.include_usage was asked)")
    if first is None:
        raise BenchError(f"a reply of {usage.completion_tokens} tokens streamed no text (prompt {usage.prompt_tokens})")
    details = usage.prompt_tokens_details
    return Reply(
        ttft_ms=(first - started) * 1e3,
        total_ms=(ended - started) * 1e3,
        text="".join(pieces),
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=(details.cached_tokens if details else None) or 0,
        completion_tokens=usage.completion_tokens,
    )


class Openings:
    """First user messages whose rendered chat prompt is a given number of tokens: a fresh random first line,
    then the next stretch of the tokenizer's training text."""

    def __init__(self, text, seed: int) -> None:
        from tests.fixtures.text import corpus

        self.text = text  # client.text.TextModel: renders and counts as the gateway does
        self.ids = text.encode("\n".join(corpus()), add_special_tokens=False)
        self.rng = np.random.default_rng(seed)
        self.at = 0

    def messages(self, length: int, label: str) -> list[dict]:
        """[the user message] rendering to `length` tokens (or the closest below it that the text gives)."""
        first_line = f"Conversation {label}, {self.rng.integers(1 << 62):x}: read this and answer."
        take, best = length, None
        for _ in range(8):  # the count of a decoded stretch re-encoded moves by a few ids at its ends
            body = self.text.decode(self._stretch(take))
            messages = [{"role": "user", "content": f"{first_line}\n{body}"}]
            count = len(self.text.chat_ids(messages, add_generation_prompt=True))
            if count <= length and (best is None or count > best[0]):
                best = (count, messages)
            if count == length:
                break
            take += length - count
        if best is None:
            raise BenchError(f"no opening message renders to at most {length} tokens")
        self.at += take
        return best[1]

    def _stretch(self, count: int) -> list[int]:
        if count > len(self.ids):
            raise BenchError(f"the corpus has {len(self.ids)} tokens, fewer than the {count} a prompt needs")
        start = self.at % (len(self.ids) - count + 1)
        return self.ids[start : start + count]


Prefill = Callable[[list[int]], float]  # the prompt's ids -> ms


def torch_prefill(checkpoint: Path, threads: int) -> Prefill:
    """The PyTorch original: one forward over the ids (its cache filled, the last position's logits), in ms."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def prefill(ids: list[int]) -> float:
        tensor = torch.tensor([ids], dtype=torch.int64)
        with torch.inference_mode():
            started = time.perf_counter()
            model(input_ids=tensor, logits_to_keep=1)
            return (time.perf_counter() - started) * 1e3

    return prefill


def converse(client, openings: Openings, prefill: Prefill, label: str, length: int, answer: int) -> Turns:
    """A conversation of `length` tokens: its first request, its next turn, then the PyTorch prefill of the first."""
    opening = openings.messages(length, label)
    cold = chat(client, opening, answer)
    turn = [*opening, {"role": "assistant", "content": cold.text}, {"role": "user", "content": NEXT_QUESTION}]
    warm = chat(client, turn, answer)
    ids = openings.text.chat_ids(opening, add_generation_prompt=True)
    if len(ids) != cold.prompt_tokens:
        raise BenchError(f"the gateway counted {cold.prompt_tokens} prompt tokens, the bench renders {len(ids)}")
    time.sleep(SETTLE_S)  # the servers' spinning threads go to sleep before PyTorch runs
    torch_ms = prefill(ids)
    time.sleep(SETTLE_S)
    return Turns(cold, warm, torch_ms)


def measure(url: str, keys: dict[tuple[int, int], str], text, checkpoint: Path, plan: Plan, threads: int) -> dict:
    """length -> each round's Turns: an untimed conversation per length first, then the rounds, the lengths'
    order reversed every round."""
    import openai

    from export.progress import Progress

    progress = Progress()
    openings = Openings(text, plan.seed)
    prefill = torch_prefill(checkpoint, threads)
    base = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    with progress.stage("warm-up: a conversation at every length"):
        for length in plan.lengths:
            client = base.with_options(api_key=keys[(-1, length)])
            converse(client, openings, prefill, f"warm-up {length}", length, plan.answer)
    measured: dict[int, list[Turns]] = {length: [] for length in plan.lengths}
    for turn, length in interleaved(plan.rounds, plan.lengths):
        with progress.stage(f"round {turn + 1}/{plan.rounds}: a {length}-token conversation"):
            client = base.with_options(api_key=keys[(turn, length)])
            label = f"{turn + 1}-{length}"
            measured[length].append(converse(client, openings, prefill, label, length, plan.answer))
    return measured


# --- results ----------------------------------------------------------------------------------------------


def row_of(length: int, rounds: list[Turns]) -> dict:
    cold = [turns.cold for turns in rounds]
    warm = [turns.warm for turns in rounds]
    torch_ms = [turns.torch_prefill_ms for turns in rounds]
    cold_ms, warm_ms = float(np.median([r.ttft_ms for r in cold])), float(np.median([r.ttft_ms for r in warm]))
    return {
        "length": length,
        "cold": side(cold),
        "warm": side(warm) | {"prefilled_tokens": [r.prompt_tokens - r.cached_tokens for r in warm]},
        "torch_prefill_ms": {"median": float(np.median(torch_ms)), "rounds": torch_ms},
        "cold_over_warm": cold_ms / warm_ms,
        "cold_over_warm_rounds": [c.ttft_ms / w.ttft_ms for c, w in zip(cold, warm, strict=True)],
    }


def side(replies: list[Reply]) -> dict:
    """One kind of request over the rounds: its TTFT (median and each round's) and what each round's said."""
    ttft = [reply.ttft_ms for reply in replies]
    return {
        "ttft_ms": {"median": float(np.median(ttft)), "rounds": ttft},
        "reply_ms": [reply.total_ms for reply in replies],
        "prompt_tokens": [reply.prompt_tokens for reply in replies],
        "cached_tokens": [reply.cached_tokens for reply in replies],
        "completion_tokens": [reply.completion_tokens for reply in replies],
        "answers": [reply.text for reply in replies],
    }


def targets(rows: list[dict]) -> dict:
    """The issue's goal, measured (reported, never asserted): cold / warm TTFT at every length of 4,000 or more."""
    return {
        f"cold_over_warm_ttft_{row['length']}": output.goal(row["cold_over_warm"], least=GOAL_RATIO)
        for row in rows
        if row["length"] >= GOAL_LENGTH
    }


def results_for(plan: Plan, facts: dict, measured: dict[int, list[Turns]], **conditions) -> dict:
    from contract.config import ModelConfig

    rows = [row_of(length, measured[length]) for length in plan.lengths]
    return {
        "model": ModelConfig.load(Path(facts["build"]["artifact"])).to_dict() | {"shape": plan.shape.name},
        "plan": dataclasses.asdict(plan),
        "measured_at": output.commit(),
        "conditions": conditions,
        "build": facts["build"],
        "serving": facts["serving"],
        "rows": rows,
        "targets": targets(rows),
    }


def table(results: dict) -> str:
    plan, build = results["plan"], results["build"]
    lines = [
        f"{results['model']['shape']}: {rounds(plan['rounds'], 'interleaved ')}, answers of {plan['answer']} tokens, "
        f"{results['conditions']['threads']} threads, {results['measured_at']['text']}",
        f"{'length':<8}{'prompt':>7}{'cold TTFT':>11}{'warm TTFT':>11}{'cold/warm':>11}{'cached':>8}{'new':>5}"
        f"{'torch prefill':>15}",
    ]
    for row in results["rows"]:
        cold, warm = row["cold"], row["warm"]
        lines.append(
            f"{row['length']:<8}{int(np.median(cold['prompt_tokens'])):>7}{cold['ttft_ms']['median']:>9.1f}ms"
            f"{warm['ttft_ms']['median']:>9.1f}ms{row['cold_over_warm']:>10.1f}x{int(np.median(warm['cached_tokens'])):>8}"
            f"{int(np.median(warm['prefilled_tokens'])):>5}{row['torch_prefill_ms']['median']:>13.1f}ms"
        )
    lines.append(
        "TTFT: the request to the first streamed chunk with text (median over rounds); cold: a conversation's first "
        "request (nothing kept to reuse); warm: its next turn (the row the first left, kept by the engine core, taken "
        "over: `cached` ids reused, `new` prefilled); torch prefill: transformers' forward over the cold prompt"
    )
    stages = build["import"]["stages_s"].get("fp32-static", {})
    verb = "reused (built earlier:" if build["reused"] else "built in"
    lines.append(
        f"import {verb} {build['import']['seconds']:.1f} s{')' if build['reused'] else ''}; fp32-static's export "
        f"{stages.get('export', float('nan')):.1f} s, its pool parity rung {stages.get('parity', float('nan')):.1f} s "
        f"at max_seq_len {results['serving']['max_seq_len']}"
    )
    if results["targets"]:
        lines += output.target_lines("goal:", results["targets"], "ratio")
    else:
        lines.append(f"goal: cold / warm >= {GOAL_RATIO:g} at {GOAL_LENGTH} tokens: no length that long measured")
    return "\n".join(lines)


def rounds(count: int, kind: str = "") -> str:
    return f"{count} {kind}round{'s' * (count != 1)}"


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    from bench.plot import gridded, save

    rows = results["rows"]
    lengths = [str(row["length"]) for row in rows]
    at = np.arange(len(rows))
    figure, (ttft, ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars = {
        "cold: first request": [row["cold"]["ttft_ms"]["median"] for row in rows],
        "warm: next turn": [row["warm"]["ttft_ms"]["median"] for row in rows],
        "torch prefill": [row["torch_prefill_ms"]["median"] for row in rows],
    }
    width = 0.8 / len(bars)
    for k, (label, values) in enumerate(bars.items()):
        ttft.bar(at + k * width, values, width, label=label)
    ttft.set_xticks(at + width * (len(bars) - 1) / 2, lengths)
    ttft.set(xlabel="conversation length (prompt tokens)", ylabel="time to first token, ms (median)", yscale="log")
    ratio.bar(at, [row["cold_over_warm"] for row in rows], 0.5, label="cold / warm TTFT")
    ratio.axhline(GOAL_RATIO, color="black", linestyle="--", label=f"goal at {GOAL_LENGTH}: {GOAL_RATIO:g}x")
    ratio.set_xticks(at, lengths)
    ratio.set(xlabel="conversation length (prompt tokens)", ylabel="cold TTFT / warm TTFT")
    gridded(ttft, ratio)
    plan = results["plan"]
    figure.suptitle(
        f"{results['model']['shape']}: the next turn against a cold prefill, {rounds(plan['rounds'])} (CPU, "
        f"{results['measured_at']['text']})"
    )
    return save(figure, path)


# --- command (`python -m bench conversation`) -------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="a 512-position model, conversations of 128 and 384 tokens, 1 round"
    )
    parser.add_argument("--lengths", help="comma-separated conversation lengths in tokens (default 1000,4000)")
    output.rounds_argument(parser, None, "default 3; --quick 1")
    parser.add_argument("--answer", type=int, help="tokens each reply generates (default 16; --quick 8)")
    output.threads_argument(parser, "threads for Triton and PyTorch")
    output.output_arguments(parser)


def plan_from(args: argparse.Namespace) -> Plan:
    return output.planned(args, Plan, "rounds", "answer", lengths=output.counts(args.lengths))


def checked(plan: Plan) -> None:
    if plan.rounds < 1 or plan.answer < 1 or not plan.lengths or min(plan.lengths) < 1:
        raise BenchError(f"rounds, answer and every length must be at least 1, got {plan}")
    needed = max(plan.lengths) + 2 * plan.answer + QUESTION_ROOM
    if needed > plan.shape.max_positions:
        raise BenchError(
            f"a {max(plan.lengths)}-token conversation, two answers of {plan.answer} and the next question need "
            f"{needed} positions, more than the model's {plan.shape.max_positions}"
        )


def benchmark(root: Path, plan: Plan, threads: int) -> dict:
    from bench.results import machine
    from client.text import TextModel

    checked(plan)
    load_before = os.getloadavg()[0]
    folder = root / plan.shape.name
    facts = {"build": prepare(folder, plan.shape, plan.seed)}
    keys = keys_for(plan)
    checkpoint = Path(facts["build"]["checkpoint"])
    text = TextModel.from_folder(facts["build"]["artifact"])
    with serving(Path(facts["build"]["artifact"]), folder, plan, threads, list(keys.values())) as (url, served):
        facts["serving"] = served
        measured = measure(url, keys, text, checkpoint, plan, threads)
    load = {"before": load_before, "after": os.getloadavg()[0]}
    return results_for(plan, facts, measured, **machine(threads, "onnxruntime"), load_average_1min=load)


def run(args: argparse.Namespace) -> int:
    plan = plan_from(args)
    with output.work_folder(args.work, "bench-conversation-") as root:
        results = benchmark(root, plan, args.threads)
    return output.report(results, args.out, "conversation", plot, table(results))
