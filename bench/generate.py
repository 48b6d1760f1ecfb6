"""Generation end to end: the server's own loop served, behind the gateway and in-process, against
onnxruntime-genai and transformers, on one checkpoint. `python -m bench generate` runs it.

Writes `generate.json` and `generate.png` and prints a table and the goals.

The checkpoint is the llama-whole preset's, as `python -m bench model` prepares it (bench/whole_model.py:
transformers' LlamaForCausalLM of random weights, our artifact imported from it, onnxruntime-genai's model
built from it; all in one folder, kept with `--work`). Each of `concurrency` generations prompts `prompt`
random ids and generates `tokens` greedy tokens (no stop token: an end-of-sequence id is a token as any
other). The candidates, each run alone, in `rounds` rounds with the order reversed every round:

- `served-grpc`: Triton serving the artifact (`mha_session` and `mha_generate` beside it), the client's
  `Client.generate` streaming, one thread per concurrent generation;
- `gateway-sse`: the gateway in front of that Triton, `POST /v1/generate` with `stream: true` through httpx,
  one thread per concurrent generation (left out, with the reason, where the route answers 404);
- `in-process`: the same loop (serving/engine/generation.py) over `mha_session`'s engine built in this
  process from the same repository, each step `engine.execute([StepRequest(..., last_only=True)])`; with
  more than one generation, a thread each, and a gatherer that runs the steps waiting together in one
  `execute`, as Triton's sequence batcher does for the served path;
- `onnxruntime-genai`: its Generator on its model builder's fp32 CPU graph (bench/genai_peer.py), the
  concurrent prompts as one batch;
- `transformers`: `LlamaForCausalLM.generate(do_sample=False)`, the concurrent prompts as one batch.

Measured per candidate and concurrency: tokens/s (every generated token over the round's wall time, from
the first request to the last generation's end; the median over the rounds), the time to the first token
(p50 over the generations) and the inter-token latency (p50, p99 over the gaps between a generation's
tokens as its caller received them). A batch candidate's first token is its prefill and first pick, and
its gaps are its decode steps. Every candidate's tokens are checked against transformers' (fp32
everywhere: they must agree).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from bench import results as output
from bench import whole_model
from bench.timing import SETTLE_S
from contract.config import ModelConfig, preset

SERVED, GATEWAY, IN_PROCESS = "served-grpc", "gateway-sse", "in-process"
GENAI, TORCH = "onnxruntime-genai", "transformers"
CANDIDATES = (SERVED, GATEWAY, IN_PROCESS, GENAI, TORCH)
PEERS = (GENAI, TORCH)
DEFAULT_PRESET = "llama-whole"
GATEWAY_KEY = "bench-generate-key"
WARMUP_TOKENS = 4


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (a candidate answered an error or too few tokens)."""


class Unavailable(BenchError):
    """A candidate that cannot run here, and why: left out of the run, the reason reported."""


@dataclasses.dataclass(frozen=True)
class Plan:
    prompt: int = 512  # random ids each generation's prompt holds
    tokens: int = 128  # greedy tokens each generation answers
    concurrency: tuple[int, ...] = (1, 16)  # generations at once
    rounds: int = 3
    seed: int = 0  # the checkpoint's weights and the prompts

    @classmethod
    def quick(cls) -> Plan:
        return cls(prompt=16, tokens=8, concurrency=(1, 4), rounds=1)


@dataclasses.dataclass
class Generated:
    """One candidate's generations of one round."""

    tokens: np.ndarray  # (generations, tokens) int64
    first_ms: list[float]  # per generation: its request to its first token
    gaps_ms: list[float]  # between a generation's consecutive tokens, every generation's
    wall_s: float  # the round: the first request to the last generation's end


Generate = Callable[[np.ndarray, int], Generated]  # (prompts (C, T) int64, tokens) -> Generated
# one generation on its caller's thread: (prompt (T,), tokens, received(token id) as each arrives)
Stream = Callable[[np.ndarray, int, Callable[[int], None]], None]


def concurrently(stream: Stream, prompts: np.ndarray, tokens: int) -> Generated:
    """Each prompt's generation on a thread of its own, all released together."""
    count = len(prompts)
    gate = threading.Barrier(count)
    starts, ends = [0.0] * count, [0.0] * count
    arrivals: list[list[float]] = [[] for _ in range(count)]
    ids: list[list[int]] = [[] for _ in range(count)]
    failures: list[BaseException] = []

    def generation(row: int) -> None:
        gate.wait()
        starts[row] = time.perf_counter()

        def received(token: int) -> None:
            arrivals[row].append(time.perf_counter())
            ids[row].append(token)

        try:
            stream(prompts[row], tokens, received)
        except BaseException as error:  # raised again below, on the caller's thread
            failures.append(error)
        ends[row] = time.perf_counter()

    threads = [threading.Thread(target=generation, args=(row,), name=f"generation-{row}") for row in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    for row, answered in enumerate(ids):
        if len(answered) != tokens:
            raise BenchError(f"generation {row} answered {len(answered)} tokens, expected {tokens}")
    return Generated(
        tokens=np.array(ids, np.int64),
        first_ms=[(times[0] - start) * 1e3 for times, start in zip(arrivals, starts, strict=True)],
        gaps_ms=[gap * 1e3 for times in arrivals for gap in np.diff(times)],
        wall_s=max(ends) - min(starts),
    )


def batched(tokens: np.ndarray, first_ms: float, steps_ms: list[float], wall_s: float) -> Generated:
    """A batch candidate's round: every row's first token at the prefill's end, a gap per decode step."""
    return Generated(np.asarray(tokens, np.int64), [first_ms] * len(tokens), list(steps_ms), wall_s)


# --- candidates -------------------------------------------------------------------------------------------


def served_candidate(client) -> Generate:
    """`Client.generate` streaming from Triton's `mha_generate`, one thread per generation."""

    def stream(prompt: np.ndarray, tokens: int, received: Callable[[int], None]) -> None:
        for token in client.generate(prompt, max_new_tokens=tokens):
            received(token)

    return lambda prompts, tokens: concurrently(stream, prompts, tokens)


def gateway_candidate(http, url: str) -> Generate:
    """`POST /v1/generate` with `stream: true`, its Server-Sent Events read as they come (httpx)."""
    headers = {"X-API-Key": GATEWAY_KEY}

    def stream(prompt: np.ndarray, tokens: int, received: Callable[[int], None]) -> None:
        body = {"input_ids": prompt.tolist(), "max_new_tokens": tokens, "stream": True}
        with http.stream("POST", f"{url}/v1/generate", json=body, headers=headers) as response:
            if response.status_code == 404:
                raise Unavailable(f"the gateway at {url} answers POST /v1/generate with 404: {response.read()[:200]!r}")
            if response.status_code != 200:
                raise BenchError(f"POST /v1/generate answered {response.status_code}: {response.read()[:500]!r}")
            for data in sse_data(response.iter_lines()):
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise BenchError(f"POST /v1/generate streamed an error: {event['error']}")
                if "token_id" in event:
                    received(event["token_id"])
        raise BenchError("POST /v1/generate's stream ended without `data: [DONE]`")

    return lambda prompts, tokens: concurrently(stream, prompts, tokens)


def sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The `data:` of each Server-Sent Event (the gateway writes one data line an event)."""
    for line in lines:
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


class Answers:
    """An in-process generation's answers from the engine core (a core.Responder): each token handed to
    `received` as the core picks it (on the core's thread), the final answer or error kept."""

    def __init__(self, received: Callable[[int], None]) -> None:
        self.received, self.error, self.done = received, None, threading.Event()

    def send(self, outputs) -> None:
        from contract.generation import TOKEN_ID

        if TOKEN_ID in outputs:
            self.received(int(outputs[TOKEN_ID][0]))

    def finish(self, outputs=None, error=None) -> None:
        self.error = error
        self.done.set()

    def cancelled(self) -> bool:
        return False


def in_process_candidate(engine_core) -> Generate:
    """The served model's engine core (serving/engine/core.py) over `mha_session`'s engine built in this process
    from the same repository and settings: each generation a request to it, stateless as the served ones."""
    from contract.generation import GenerationRequest
    from serving.engine import core

    sequences = itertools.count(1 << 40)

    def stream(prompt: np.ndarray, tokens: int, received: Callable[[int], None]) -> None:
        answers = Answers(received)
        asked = GenerationRequest(max_new_tokens=tokens, session_start=True, session_end=True)
        engine_core.submit(core.Generate(next(sequences), answers, prompt=prompt.astype(np.int64), asked=asked))
        answers.done.wait()
        if answers.error is not None:
            raise BenchError(f"in-process generation: {answers.error}") from answers.error

    return lambda prompts, tokens: concurrently(stream, prompts, tokens)


def transformers_candidate(checkpoint: Path, threads: int) -> Generate:
    """`LlamaForCausalLM.generate(do_sample=False)` over the prompts as one batch; a streamer times each
    token's pick."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    class Arrivals(transformers.generation.BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:  # the prompt first, then each step's picked tokens
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def generate(prompts: np.ndarray, tokens: int) -> Generated:
        ids, arrivals = torch.from_numpy(prompts), Arrivals()
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                # given: without it, transformers masks out every prompt id equal to the pad id
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=tokens,
                eos_token_id=None,  # no stop token, as the other candidates run
                pad_token_id=model.config.pad_token_id,
                streamer=arrivals,
            )
        wall_s = time.perf_counter() - started
        picked = arrivals.times[1:]
        if out.shape[1] - prompts.shape[1] != tokens or len(picked) != tokens:
            raise BenchError(f"transformers generated {out.shape[1] - prompts.shape[1]} tokens, expected {tokens}")
        steps_ms = [gap * 1e3 for gap in np.diff(picked)]
        return batched(out[:, prompts.shape[1] :].numpy(), (picked[0] - started) * 1e3, steps_ms, wall_s)

    return generate


def genai_candidate(peer: whole_model.GenaiPeer) -> Generate:
    """onnxruntime-genai's Generator over the prompts as one batch, in its own process."""

    def generate(prompts: np.ndarray, tokens: int) -> Generated:
        started = time.perf_counter()
        answer = peer(prompts, tokens)
        return batched(answer.tokens, answer.prefill_ms, answer.step_ms, time.perf_counter() - started)

    return generate


# --- the servers ------------------------------------------------------------------------------------------


def repository_for(artifact: Path, root: Path, plan: Plan, threads: int) -> Path:
    """`mha` and `mha_session` (which generates) of the artifact, sized for the machine's threads and for every
    concurrent generation's rows at once."""
    from contract.deployment import ServingSettings
    from serving.triton import config as triton_config
    from serving.triton.repository import write_repository

    cfg = ModelConfig.load(artifact)
    generations = max(plan.concurrency)
    default = ServingSettings()
    settings = ServingSettings(
        threads=threads,
        max_batch_size=max(16, generations),
        kv_cache_bytes=max(default.kv_cache_bytes, cfg.kv_cache_bytes(generations, cfg.max_seq_len)),
    )
    models = (triton_config.MHA, triton_config.MHA_SESSION)  # the gateway's readiness probes both
    return write_repository(artifact, root / "repository", settings, models=models)


@contextlib.contextmanager
def candidates(cfg: ModelConfig, root: Path, facts: dict, plan: Plan, threads: int) -> Iterator[dict[str, Generate]]:
    """Every candidate, ready (the servers started); stopped and closed afterwards."""
    import httpx

    from bench.gateway import gateway_process
    from bench.serving import STATIC_MODEL, session_core
    from client import Client
    from export.progress import Progress
    from serving.host.launcher import start_triton

    progress = Progress()
    repository = repository_for(Path(facts["artifact"]), root, plan, threads)
    with contextlib.ExitStack() as stack:
        with progress.stage("start Triton"):
            server = start_triton(repository, log_path=root / "triton.log")
        stack.callback(server.stop)
        with progress.stage("start the gateway"):
            url, _ = stack.enter_context(gateway_process(server.grpc_url, root / "gateway.log", api_keys=GATEWAY_KEY))
        client = stack.enter_context(Client(server.grpc_url))
        http = stack.enter_context(httpx.Client(timeout=120, limits=httpx.Limits(max_connections=None)))
        engine_core = session_core(repository, STATIC_MODEL, cfg)
        stack.callback(engine_core.stop)
        made: dict[str, Generate] = {
            SERVED: served_candidate(client),
            GATEWAY: gateway_candidate(http, url),
            IN_PROCESS: in_process_candidate(engine_core),
            TORCH: transformers_candidate(Path(facts["checkpoint"]), threads),
        }
        if facts["genai"]["used"]:
            peer = whole_model.GenaiPeer(Path(facts["genai"]["python"]), Path(facts["genai"]["model"]), threads)
            stack.callback(peer.close)
            facts["genai"]["version"] = peer.version
            made[GENAI] = genai_candidate(peer)
        yield {name: made[name] for name in CANDIDATES if name in made}


# --- measuring --------------------------------------------------------------------------------------------


def prompts_for(cfg: ModelConfig, plan: Plan) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(plan.seed)
    every = rng.integers(0, cfg.vocab_size, (max(plan.concurrency), plan.prompt), dtype=np.int64)
    return {count: np.ascontiguousarray(every[:count]) for count in plan.concurrency}


def measure_all(generators: dict[str, Generate], prompts: dict[int, np.ndarray], plan: Plan) -> tuple[dict, dict]:
    """((candidate, concurrency) -> its Generated of each round, candidate -> why it was left out): a short
    warm-up generation each first (where a candidate that cannot run says so), then the rounds."""
    from export.progress import Progress

    progress = Progress()
    skipped: dict[str, str] = {}
    with progress.stage(f"warm-up: every candidate, {WARMUP_TOKENS} tokens"):
        for name in list(generators):
            try:
                for batch in prompts.values():
                    generators[name](batch, min(WARMUP_TOKENS, plan.tokens))
            except Unavailable as reason:
                skipped[name] = str(reason)
                del generators[name]
    measured: dict = {}
    order = list(generators)
    for turn in range(plan.rounds):
        for name in order if turn % 2 == 0 else order[::-1]:
            with progress.stage(f"round {turn + 1}/{plan.rounds}: {name}"):
                for count, batch in prompts.items():
                    measured.setdefault((name, count), []).append(generators[name](batch, plan.tokens))
            time.sleep(SETTLE_S)  # its spinning threads go to sleep before the next candidate
    return measured, skipped


def summary(rounds: list[Generated], reference: np.ndarray) -> dict:
    rates = [generated.tokens.size / generated.wall_s for generated in rounds]
    first = [ms for generated in rounds for ms in generated.first_ms]
    gaps = [ms for generated in rounds for ms in generated.gaps_ms]
    tokens = np.concatenate([generated.tokens for generated in rounds])
    return {
        "tokens_per_s": float(np.median(rates)),
        "tokens_per_s_rounds": rates,
        "ttft_ms": {"p50": float(np.percentile(first, 50)), "generations": len(first)},
        "itl_ms": {"p50": float(np.percentile(gaps, 50)), "p99": float(np.percentile(gaps, 99)), "gaps": len(gaps)},
        # every round's tokens, each row against transformers' tokens for the same prompt
        "greedy": whole_model.agreement(tokens, np.concatenate([reference] * len(rounds))),
    }


# --- results ----------------------------------------------------------------------------------------------


def commit() -> dict:
    """The commit measured (`git rev-parse --short HEAD`), and whether the tree had uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=False
    )
    changes = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, check=False
    )
    sha = head.stdout.strip() if head.returncode == 0 else "unknown"
    dirty = bool(changes.stdout.strip())
    return {"commit": sha, "uncommitted_changes": dirty, "text": f"measured at {sha}" + (" + changes" * dirty)}


def results_for(cfg: ModelConfig, name: str, plan: Plan, facts: dict, measured: dict, skipped: dict, **conditions):
    rows = []
    for count in plan.concurrency:
        reference = measured[(TORCH, count)][0].tokens
        present = [candidate for candidate in CANDIDATES if (candidate, count) in measured]
        rows.append(
            {
                "concurrency": count,
                "candidates": {candidate: summary(measured[(candidate, count)], reference) for candidate in present},
            }
        )
    results = {
        "preset": name,
        "config": cfg.to_dict(),
        "plan": dataclasses.asdict(plan),
        "measured_at": commit(),
        "conditions": conditions,
        "build": facts,
        "skipped": skipped,
        "rows": rows,
    }
    results["targets"] = targets(results)
    return results


def rate(results: dict, count: int, name: str) -> float | None:
    row = next((row for row in results["rows"] if row["concurrency"] == count), None)
    entry = row["candidates"].get(name) if row else None
    return entry["tokens_per_s"] if entry else None


def targets(results: dict) -> dict:
    """The issue's goals, measured (reported, never asserted): tokens/s ratios."""
    out: dict = {}

    def goal(key: str, numerator: float | None, denominator: float | None, target: str, least: float, strict=False):
        if numerator is not None and denominator is not None:
            ratio = numerator / denominator
            out[key] = {"ratio": ratio, "target": target, "met": ratio > least if strict else ratio >= least}

    counts = [row["concurrency"] for row in results["rows"]]
    if 1 in counts:
        goal("served_vs_in_process_C1", rate(results, 1, SERVED), rate(results, 1, IN_PROCESS), ">= 0.9", 0.9)
        for count in (c for c in counts if c > 1):
            goal(f"served_C{count}_vs_C1", rate(results, count, SERVED), rate(results, 1, SERVED), ">= 4", 4.0)
    for count in counts:
        for peer in PEERS:
            goal(f"served_vs_{peer}_C{count}", rate(results, count, SERVED), rate(results, count, peer), "> 1", 1, True)
    return out


def table(results: dict) -> str:
    plan, conditions = results["plan"], results["conditions"]
    lines = [
        f"{results['preset']}: a {plan['prompt']}-token prompt then {plan['tokens']} greedy tokens per generation, "
        f"{plan['rounds']} interleaved rounds, {conditions['threads']} threads, {results['measured_at']['text']}",
        f"{'conc.':<6}{'candidate':<19}{'tokens/s':>9}{'vs served':>10}{'TTFT p50':>10}{'ITL p50':>9}{'ITL p99':>9}"
        f"{'greedy = transformers':>23}",
    ]
    for row in results["rows"]:
        served = row["candidates"].get(SERVED, {}).get("tokens_per_s")
        for name, entry in row["candidates"].items():
            versus = f"{entry['tokens_per_s'] / served:>9.2f}x" if served else f"{'-':>10}"
            greedy = entry["greedy"]
            lines.append(
                f"{row['concurrency']:<6}{name:<19}{entry['tokens_per_s']:>9.1f}{versus}"
                f"{entry['ttft_ms']['p50']:>8.1f}ms{entry['itl_ms']['p50']:>7.2f}ms{entry['itl_ms']['p99']:>7.2f}ms"
                f"{greedy['agree_before_first_difference']:>14} of {plan['tokens']}"
            )
    lines.append(
        "tokens/s: every generated token over the round's wall time (median over rounds); TTFT: request to first "
        "token; ITL: gaps between a generation's tokens as its caller received them (a batch peer's: its decode "
        "step); greedy = transformers: tokens equal to transformers' before the first difference, the fewest over "
        "generations and rounds (fp32 everywhere: all of them must agree)"
    )
    for name, reason in results["skipped"].items():
        lines.append(f"{name} left out: {reason}")
    if not results["build"]["genai"]["used"]:
        lines.append(f"{GENAI} left out: {results['build']['genai'].get('reason', 'not asked for (--no-genai)')}")
    lines += output.target_lines("goals:", results["targets"], "ratio")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    from bench.plot import save

    rows = results["rows"]
    names = [name for name in CANDIDATES if any(name in row["candidates"] for row in rows)]
    width = 0.8 / len(rows)
    figure, (rates, latency) = plt.subplots(1, 2, figsize=(13, 4.5))
    for k, row in enumerate(rows):
        at = [i + k * width for i, name in enumerate(names) if name in row["candidates"]]
        present = [row["candidates"][name] for name in names if name in row["candidates"]]
        label = f"{row['concurrency']} at once"
        rates.bar(at, [entry["tokens_per_s"] for entry in present], width, label=label)
        latency.bar(at, [entry["itl_ms"]["p50"] for entry in present], width, label=f"{label}, p50")
        p99 = [entry["itl_ms"]["p99"] for entry in present]
        latency.scatter(at, p99, color="black", marker="_", s=200, zorder=3, label="p99" if k == 0 else None)
    centers = [i + width * (len(rows) - 1) / 2 for i in range(len(names))]
    for axis, label in ((rates, "generated tokens / s"), (latency, "inter-token latency, ms")):
        axis.set_xticks(centers, names, rotation=20, ha="right", fontsize=8)
        axis.set(ylabel=label, yscale="log")
        axis.grid(True, axis="y", which="both", alpha=0.3)
        axis.legend(fontsize=8)
    plan = results["plan"]
    figure.suptitle(
        f"{results['preset']}: {plan['prompt']}-token prompts, {plan['tokens']} greedy tokens each (CPU, "
        f"{results['measured_at']['text']})"
    )
    return save(figure, path)


# --- command (`python -m bench generate`) -----------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--preset", default=DEFAULT_PRESET, help="a whole model's preset (default: %(default)s)")
    chosen.add_argument("--config", type=Path, help="a whole model's config JSON instead of a preset")
    parser.add_argument("--quick", action="store_true", help="16-token prompts, 8 tokens, 1 and 4 at once, 1 round")
    parser.add_argument("--prompt", type=int, help="prompt ids per generation (default 512; --quick 16)")
    parser.add_argument("--tokens", type=int, help="greedy tokens per generation (default 128; --quick 8)")
    parser.add_argument("--concurrency", help="comma-separated generations at once (default 1,16; --quick 1,4)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; --quick 1)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads per candidate and server")
    parser.add_argument("--no-genai", action="store_true", help="leave onnxruntime-genai out")
    output.output_arguments(parser)


def plan_from(args: argparse.Namespace) -> Plan:
    plan = Plan.quick() if args.quick else Plan()
    given = {
        "prompt": args.prompt,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "concurrency": tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else None,
    }
    return dataclasses.replace(plan, **{k: v for k, v in given.items() if v is not None})


def checked(cfg: ModelConfig, plan: Plan) -> None:
    if not whole_model.llama_shaped(cfg):
        raise BenchError(f"generation needs a Llama-shaped whole model (token ids in, logits out), got {cfg}")
    if plan.prompt < 1 or plan.tokens < 1 or plan.rounds < 1 or min(plan.concurrency) < 1:
        raise BenchError(f"prompt, tokens, rounds and concurrency must be at least 1, got {plan}")
    if plan.prompt + plan.tokens > cfg.max_seq_len:
        raise BenchError(
            f"a {plan.prompt}-token prompt and {plan.tokens} tokens need {plan.prompt + plan.tokens} positions, "
            f"more than the model's max_seq_len {cfg.max_seq_len}"
        )


def benchmark(cfg: ModelConfig, name: str, folder: Path, plan: Plan, threads: int, genai: bool) -> dict:
    checked(cfg, plan)
    load_before = os.getloadavg()[0]
    facts = whole_model.prepare(cfg, folder, plan.seed, genai)
    with candidates(cfg, folder, facts, plan, threads) as generators:
        measured, skipped = measure_all(generators, prompts_for(cfg, plan), plan)
    load = {"before": load_before, "after": os.getloadavg()[0]}
    machine = whole_model._machine(threads)
    return results_for(cfg, name, plan, facts, measured, skipped, **machine, load_average_1min=load)


def run(args: argparse.Namespace) -> int:
    plan = plan_from(args)
    cfg, name = (ModelConfig.load(args.config), args.config.stem) if args.config else (preset(args.preset), args.preset)
    with output.work_folder(args.work, "bench-generate-") as root:
        results = benchmark(cfg, name, root / name, plan, args.threads, genai=not args.no_genai)
    wrote = output.write(results, args.out, "generate", plot)
    print(table(results))
    if results["conditions"]["load_average_1min"]["before"] > 0.5:
        load = results["conditions"]["load_average_1min"]["before"]
        print(f"note: the machine was busy when the run began (1-minute load average {load:.1f}): expect noise")
    print(wrote)
    return 0
