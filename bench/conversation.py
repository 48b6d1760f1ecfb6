"""Conversations: the next turn's time to first token (TTFT) against a cold prefill, through the OpenAI-compatible
chat route served for real: Triton (`sessions`: its engine core generates) and the gateway with API keys, called
with the official `openai` SDK, streamed, temperature 0, `answer` tokens a reply (`ignore_eos`).

The model: transformers' `LlamaForCausalLM` of random weights (hidden 256, 4 layers, 4,608 positions: the longest
turn and its answers fit) beside a byte-level BPE tokenizer and Llama 3's chat template (tests/fixtures/text.py),
imported with the documented `python -m export build --weights DIR --layout hf`; both kept under `--work`.
A conversation of length L: `cold`, its first request, a user message rendering to about L tokens (a fresh random
first line, then the tokenizer's corpus), all prefilled; `warm`, its next turn (the answer and a short question
added), which takes over the row the first left, kept for its owner, and prefills only what it adds; `torch
prefill`, transformers' forward over the cold prompt's ids in this process. Each conversation has an API key of its
own, so its first request finds nothing kept to reuse. An untimed conversation per length, then `rounds` rounds,
the lengths' order reversed each; medians over rounds. Goal (issue 32): cold / warm >= 10 at 4,000 tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from bench import results as output
from bench import stack
from bench.plot import figure, gridded, grouped_bars, save
from bench.timing import SETTLE_S, interleaved
from client.text import TextModel
from contract import files
from contract.config import ModelConfig
from contract.deployment import ServingSettings
from export.progress import Progress

MODEL_ID = "bench-llama"  # the model's id on the OpenAI routes
VARIANTS = ("fp32-fused", "fp32-static")  # what the session model and the stateless one serve
TEMPLATE = "llama3"  # it trims each message's content: an answer re-sent parts from the prompt at no token
NEXT_QUESTION = "Thank you. In one sentence, what does the text above do?"
GOAL_LENGTH, GOAL_RATIO = 4000, 10.0  # issue 32: the next turn of a 4,000-token conversation, >= 10x faster
REQUEST_TIMEOUT_S = 300.0  # a cold 4k prefill on 2 cores takes seconds; the gateway's default is 30
VOCAB = 512  # the tokenizer's ids at most: the model's vocab_size is those it trained
# every request: greedy, streamed with its usage, never cut short by the random model's end-of-text token
STREAMED = dict(temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
QUESTION_ROOM = 64  # positions the next question and its template markers take, at most
# the build's progress lines ("fp32-static: parity ... done in 3.7 s"): where its time went
STAGE_DONE = re.compile(r"^(?P<variant>[\w-]+): (?P<stage>export|parity) \.\.\. done in (?P<seconds>[\d.]+) s$")


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (a build failed, a reply had no text or no usage)."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """The Llama-shaped checkpoint's size: transformers' LlamaConfig fields."""

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 704
    max_position_embeddings: int = 4608

    @property
    def name(self) -> str:
        """The work folder's name: a build of another shape is never reused for this one."""
        return f"llama-{self.hidden_size}x{self.num_hidden_layers}-{self.max_position_embeddings}"


@dataclasses.dataclass(frozen=True)
class Plan:
    lengths: tuple[int, ...] = (1000, 4000)  # the cold prompt's tokens, as rendered by the chat template
    rounds: int = 3
    answer: int = 16  # tokens each reply generates
    seed: int = 0  # the weights and the first lines
    shape: Shape = Shape()

    @classmethod
    def quick(cls) -> Plan:
        heads = {"num_attention_heads": 4, "num_key_value_heads": 2}
        small = Shape(hidden_size=64, num_hidden_layers=2, intermediate_size=176, max_position_embeddings=512, **heads)
        return cls(lengths=(128, 384), rounds=1, answer=8, shape=small)


@dataclasses.dataclass(frozen=True)
class Reply:
    """One streamed chat completion, as its caller saw it."""

    ttft_ms: float  # the request to the first chunk with text
    total_ms: float  # the request to the stream's end
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def make_checkpoint(folder: Path, shape: Shape, seed: int) -> None:
    """LlamaForCausalLM of random weights (seeded) beside a byte-level BPE tokenizer and Llama 3's chat template,
    saved as transformers saves a checkpoint."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from tests.fixtures.text import save_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    save_tokenizer(folder, VOCAB, template=TEMPLATE)
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    # the tokenizer's <pad>, <s>, </s>
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    config = transformers.LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, **ids, **dataclasses.asdict(shape))
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def import_command(checkpoint: Path, artifact: Path) -> list[str]:
    """The documented import (docs/importing.md) of the checkpoint's whole decoder."""
    command = [sys.executable, "-m", "export", "build", "--weights", str(checkpoint), "--layout", "hf"]
    return [*command, "--out", str(artifact), "--variants", ",".join(VARIANTS)]


def stage_seconds(log: str) -> dict[str, dict[str, float]]:
    """variant -> {"export": s, "parity": s} from the build's progress lines."""
    stages: dict[str, dict[str, float]] = {}
    for found in filter(None, (STAGE_DONE.match(line.strip()) for line in log.splitlines())):
        if found["variant"] in VARIANTS:
            stages.setdefault(found["variant"], {})[found["stage"]] = float(found["seconds"])
    return stages


def prepare(folder: Path, shape: Shape, seed: int) -> dict:
    """The checkpoint and our artifact of it under `folder`, each kept when there (the import's wall time and
    stages recorded in build.json for later runs); what was built, how long it took, each form's parity."""
    progress = Progress()
    checkpoint, artifact, record = folder / "checkpoint", folder / "artifact", folder / "build.json"
    command = import_command(checkpoint, artifact)
    if not (checkpoint / "config.json").is_file():
        with progress.stage(f"a LlamaForCausalLM checkpoint of random weights ({shape.name})"):
            make_checkpoint(checkpoint, shape, seed)
    report_file = artifact / files.REPORT_FILENAME
    reused = record.is_file() and report_file.is_file()
    reused = reused and set(VARIANTS) <= set(json.loads(report_file.read_text())["variants"])
    if not reused:
        with progress.stage(f"export build --weights {checkpoint.name} --layout hf ({', '.join(VARIANTS)})"):
            started = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            seconds, log = time.perf_counter() - started, done.stdout + done.stderr
            (folder / "build.log").write_text(log)
            if done.returncode != 0:
                raise BenchError(f"`{' '.join(command)}` failed ({done.returncode}):\n{log[-3000:]}")
            record.write_text(json.dumps({"seconds": seconds, "stages_s": stage_seconds(log)}, indent=2) + "\n")
    report = json.loads(report_file.read_text())["variants"]
    return {
        "checkpoint": str(checkpoint),
        "artifact": str(artifact),
        "command": " ".join(["python", *command[1:]]),
        "reused": reused,
        "import": json.loads(record.read_text()),
        "variants": {name: {key: report[name][key] for key in ("passed", "build_seconds")} for name in VARIANTS},
    }


@contextlib.contextmanager
def serving(artifact: Path, root: Path, sessions: int, threads: int, keys: list[str]) -> Iterator[tuple[str, dict]]:
    """Triton serving the artifact and the gateway in front of it (on a thread), with room for `sessions` full
    rows: the gateway's URL and what the servers were given."""
    from serving.gateway import Settings
    from serving.gateway.server import run_gateway
    from serving.triton import config as triton_config
    from serving.triton.repository import write_repository

    cfg = ModelConfig.load(artifact)
    settings = ServingSettings(threads=threads, kv_cache_bytes=cfg.kv_cache_bytes(sessions, cfg.max_seq_len))
    models = (triton_config.FORWARD, triton_config.SESSIONS)
    repository = write_repository(artifact, root / "repository", settings, models=models)
    parameters = triton_config.parse((repository / triton_config.SESSIONS / "config.pbtxt").read_text()).parameters
    facts = {
        "kv_cache_bytes": settings.kv_cache_bytes,
        "kv_budget_sessions_of_max_seq_len": sessions,
        "max_seq_len": cfg.max_seq_len,
        "threads": threads,
        "step_tokens": int(parameters[triton_config.P_STEP_TOKENS].string_value),
    }
    with stack.triton(repository, log_path=root / "triton.log") as server:
        named = {"served_model_name": MODEL_ID, "request_timeout_s": REQUEST_TIMEOUT_S, "log_level": "warning"}
        with run_gateway(Settings(port=0, api_keys=tuple(keys), triton_url=server.grpc_url, **named)) as running:
            yield running.url, facts


def chat(client, messages: list[dict], answer: int) -> Reply:
    """A streamed chat completion at temperature 0: its time to the first text, its text and its usage."""
    started = time.perf_counter()
    stream = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=answer, **STREAMED)
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
    cached = (usage.prompt_tokens_details and usage.prompt_tokens_details.cached_tokens) or 0
    ttft_ms, total_ms = (first - started) * 1e3, (ended - started) * 1e3
    return Reply(ttft_ms, total_ms, "".join(pieces), usage.prompt_tokens, cached, usage.completion_tokens)


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
            if take > len(self.ids):
                raise BenchError(f"the corpus has {len(self.ids)} tokens, fewer than the {take} a prompt needs")
            start = self.at % (len(self.ids) - take + 1)
            body = self.text.decode(self.ids[start : start + take])
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


def measure(url: str, keys: dict[tuple[int, int], str], artifact: Path, checkpoint: Path, plan: Plan, threads: int):
    """length -> each round's (cold Reply, warm Reply, torch prefill ms): an untimed conversation per length
    first, then the rounds, the lengths' order reversed every round."""
    import openai
    import torch
    import transformers

    progress, text = Progress(), TextModel.from_folder(artifact)
    openings = Openings(text, plan.seed)
    torch.set_num_threads(threads)
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    base = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=REQUEST_TIMEOUT_S)

    def conversation(turn: int, length: int) -> tuple[Reply, Reply, float]:
        client = base.with_options(api_key=keys[(turn, length)])
        opening = openings.messages(length, f"{turn + 1}-{length}")
        cold = chat(client, opening, plan.answer)
        answered = [*opening, {"role": "assistant", "content": cold.text}]
        warm = chat(client, [*answered, {"role": "user", "content": NEXT_QUESTION}], plan.answer)
        ids = text.chat_ids(opening, add_generation_prompt=True)
        if len(ids) != cold.prompt_tokens:
            raise BenchError(f"the gateway counted {cold.prompt_tokens} prompt tokens, the bench renders {len(ids)}")
        time.sleep(SETTLE_S)  # the servers' spinning threads go to sleep before PyTorch runs
        with torch.inference_mode():  # the PyTorch original's prefill: its cache filled, the last position's logits
            started = time.perf_counter()
            model(input_ids=torch.tensor([ids], dtype=torch.int64), logits_to_keep=1)
            torch_ms = (time.perf_counter() - started) * 1e3
        time.sleep(SETTLE_S)
        return cold, warm, torch_ms

    with progress.stage("warm-up: a conversation at every length"):
        for length in plan.lengths:
            conversation(-1, length)
    measured: dict[int, list] = {length: [] for length in plan.lengths}
    for turn, length in interleaved(plan.rounds, plan.lengths):
        with progress.stage(f"round {turn + 1}/{plan.rounds}: a {length}-token conversation"):
            measured[length].append(conversation(turn, length))
    return measured


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


def row_of(length: int, rounds: list[tuple[Reply, Reply, float]]) -> dict:
    cold, warm, torch_ms = (list(each) for each in zip(*rounds, strict=True))
    first, then = side(cold), side(warm) | {"prefilled_tokens": [r.prompt_tokens - r.cached_tokens for r in warm]}
    return {
        "length": length,
        "cold": first,
        "warm": then,
        "torch_prefill_ms": {"median": float(np.median(torch_ms)), "rounds": torch_ms},
        "cold_over_warm": first["ttft_ms"]["median"] / then["ttft_ms"]["median"],
        "cold_over_warm_rounds": [c.ttft_ms / w.ttft_ms for c, w in zip(cold, warm, strict=True)],
    }


def checked(plan: Plan) -> None:
    if plan.rounds < 1 or plan.answer < 1 or not plan.lengths or min(plan.lengths) < 1:
        raise BenchError(f"rounds, answer and every length must be at least 1, got {plan}")
    needed = max(plan.lengths) + 2 * plan.answer + QUESTION_ROOM
    if needed > plan.shape.max_position_embeddings:
        raise BenchError(
            f"a {max(plan.lengths)}-token conversation, two answers of {plan.answer} and the next question need "
            f"{needed} positions, more than the model's {plan.shape.max_position_embeddings}"
        )


def benchmark(root: Path, plan: Plan, threads: int) -> dict:
    checked(plan)
    # a key of its own for each conversation (round -1: the untimed ones): the engine core keeps an owner's
    # finished rows, and a first request must find none to reuse
    keys = {
        (turn, length): f"bench-conversation-{turn + 1}-{length}-{secrets.token_hex(4)}"
        for turn in range(-1, plan.rounds)
        for length in plan.lengths
    }
    # every session the run keeps (two a conversation, kept until idle) in full rows: no measured request waits
    # for kept conversations to be ended to make room
    sessions = 2 * len(keys)
    with output.during(threads, "onnxruntime") as conditions:
        folder = root / plan.shape.name
        build = prepare(folder, plan.shape, plan.seed)
        artifact, checkpoint = Path(build["artifact"]), Path(build["checkpoint"])
        with serving(artifact, folder, sessions, threads, list(keys.values())) as (url, served):
            measured = measure(url, keys, artifact, checkpoint, plan, threads)
    rows = [row_of(length, measured[length]) for length in plan.lengths]
    return {
        "model": ModelConfig.load(artifact).to_dict() | {"shape": plan.shape.name},
        "plan": dataclasses.asdict(plan),
        "measured_at": output.commit(),
        "conditions": conditions,
        "build": build,
        "serving": served,
        "rows": rows,
        "targets": {
            f"cold_over_warm_ttft_{row['length']}": output.goal(row["cold_over_warm"], least=GOAL_RATIO)
            for row in rows
            if row["length"] >= GOAL_LENGTH
        },
    }


def rounds(count: int, kind: str = "") -> str:
    return f"{count} {kind}round{'s' * (count != 1)}"


def table(results: dict) -> str:
    plan, build = results["plan"], results["build"]
    heading = (
        f"{results['model']['shape']}: {rounds(plan['rounds'], 'interleaved ')}, answers of {plan['answer']} tokens, "
        f"{results['conditions']['threads']} threads, {results['measured_at']['text']}"
    )
    header = ["length", "prompt", "cold TTFT", "warm TTFT", "cold/warm", "cached", "new", "torch prefill"]
    cells = []
    for row in results["rows"]:
        cold, warm = row["cold"], row["warm"]
        ttfts = [f"{side['ttft_ms']['median']:.1f}ms" for side in (cold, warm)]
        tokens = [int(np.median(warm[key])) for key in ("cached_tokens", "prefilled_tokens")]
        prompt, prefill = int(np.median(cold["prompt_tokens"])), f"{row['torch_prefill_ms']['median']:.1f}ms"
        cells.append([row["length"], prompt, *ttfts, f"{row['cold_over_warm']:.1f}x", *tokens, prefill])
    stages = build["import"]["stages_s"].get("fp32-static", {})
    seconds = f"{build['import']['seconds']:.1f} s"
    built = f"reused (built earlier: {seconds})" if build["reused"] else f"built in {seconds}"
    lines = [
        output.table(heading, header, cells),
        "TTFT: the request to the first streamed chunk with text (median over rounds); cold: a conversation's first "
        "request (nothing kept to reuse); warm: its next turn (the row the first left, kept by the engine core, taken "
        "over: `cached` ids reused, `new` prefilled); torch prefill: transformers' forward over the cold prompt",
        f"import {built}; fp32-static's export {stages.get('export', float('nan')):.1f} s, its pool parity rung "
        f"{stages.get('parity', float('nan')):.1f} s at max_seq_len {results['serving']['max_seq_len']}",
    ]
    missing = f"goal: cold / warm >= {GOAL_RATIO:g} at {GOAL_LENGTH} tokens: no length that long measured"
    return "\n".join(lines + output.target_lines("goal:", results["targets"], "ratio", missing))


def plot(results: dict, path: Path) -> Path:
    rows = results["rows"]
    lengths = [str(row["length"]) for row in rows]
    drawn, (ttft, ratio) = figure(2, (12, 4.5))
    bars = {
        "cold: first request": [row["cold"]["ttft_ms"]["median"] for row in rows],
        "warm: next turn": [row["warm"]["ttft_ms"]["median"] for row in rows],
        "torch prefill": [row["torch_prefill_ms"]["median"] for row in rows],
    }
    axis_label = "conversation length (prompt tokens)"
    grouped_bars(ttft, lengths, bars, xlabel=axis_label, ylabel="time to first token, ms (median)", yscale="log")
    ratios = {"cold / warm TTFT": [row["cold_over_warm"] for row in rows]}
    grouped_bars(ratio, lengths, ratios, xlabel=axis_label, ylabel="cold TTFT / warm TTFT")
    ratio.axhline(GOAL_RATIO, color="black", linestyle="--", label=f"goal at {GOAL_LENGTH}: {GOAL_RATIO:g}x")
    gridded(ttft, ratio)
    drawn.suptitle(
        f"{results['model']['shape']}: the next turn against a cold prefill, {rounds(results['plan']['rounds'])} "
        f"(CPU, {results['measured_at']['text']})"
    )
    return save(drawn, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a 512-position model, 128 and 384 tokens, 1 round")
    parser.add_argument("--lengths", help="comma-separated conversation lengths in tokens (default 1000,4000)")
    output.rounds_argument(parser, None, "default 3; --quick 1")
    parser.add_argument("--answer", type=int, help="tokens each reply generates (default 16; --quick 8)")
    output.threads_argument(parser, "threads for Triton and PyTorch")
    output.output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    plan = output.planned(args, Plan, "rounds", "answer", lengths=output.counts(args.lengths))
    with output.work_folder(args.work, "bench-conversation-") as root:
        results = benchmark(root, plan, args.threads)
    return output.report(results, args.out, "conversation", plot, table(results))
