"""Generation end to end: our engine core served and in-process against onnxruntime-genai, transformers, llama.cpp's
server and vLLM on the CPU, on one checkpoint (the llama-whole preset's as `python -m bench model` prepares it).

Each of `concurrency` generations prompts `prompt` random ids and takes `tokens` greedy tokens, no stop token. The
candidates (CANDIDATES), each alone, in interleaved rounds: Triton's `sessions` through `Client.generate` (and a
Triton of its own on the 4-bit weights), the gateway's SSE and OpenAI routes, the same engine core in this process,
a thread per generation; onnxruntime-genai (fp32, int4) and transformers' `generate`, the prompts as one batch;
llama.cpp's and vLLM's servers through the OpenAI route where `make bench-server-peers` built them. No row is kept
for reuse (the rounds repeat their prompts): every candidate prefills every prompt. Measured: tokens/s (median
round), TTFT p50, ITL p50/p99 as the caller received the tokens (a batch's: its decode steps), and the greedy ids
against transformers' (fp32 everywhere: they must agree, but the 4-bit weights'; the OpenAI route streams text).
Then a `joiner`-id prompt joining `concurrency[1]` gRPC streams (their p99 gap against one prefill chunk's time)
and each server's CPU over `idle_s` idle seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

from bench import results as output
from bench import server_peers, whole_model
from bench.timing import SETTLE_S, interleaved
from contract import files
from contract.config import ModelConfig, preset
from contract.deployment import WEIGHTS_FLOAT, WEIGHTS_INT4, ServingSettings
from contract.generation import TOKEN_ID, GenerationRequest
from export.progress import Progress

SERVED, GATEWAY, OPENAI, IN_PROCESS = "served-grpc", "gateway-sse", "gateway-openai", "in-process"
SERVED_INT4 = "served-grpc-int4w"  # Triton serving the artifact's fp32-static-int4w (`--weights-dtype int4`)
GENAI, GENAI_INT4, TORCH = "onnxruntime-genai", whole_model.GENAI_INT4, "transformers"
LLAMA_CPP, VLLM = server_peers.LLAMA_F32, server_peers.VLLM
CANDIDATES = (SERVED, SERVED_INT4, GATEWAY, OPENAI, IN_PROCESS, GENAI, GENAI_INT4, TORCH, LLAMA_CPP, VLLM)
# 4-bit weights compute other logits than transformers' fp32: their greedy tokens are reported, not required to agree
INT4_CANDIDATES = (SERVED_INT4, GENAI_INT4)
SERVER_PEERS = (LLAMA_CPP, VLLM)  # through their OpenAI routes, as OPENAI is ours
OURS = "ours (Triton and its stubs, the gateway)"
GENAI_MOST_BATCH = 32  # onnxruntime-genai 0.18's largest batch (seen: "batch_size (64) must be in [1, 32]")
WARMUP_TOKENS = 4
GOAL_COUNTS = (1, 16)  # the goals are at 1 and 16 generations at once; 64 is reported


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (a candidate answered an error or too few tokens)."""


class Unavailable(BenchError):
    """A candidate that cannot run here: left out of the run, the reason reported."""


class Unmeasurable(BenchError):
    """A candidate that cannot run one concurrency of the plan: that concurrency left out, the reason reported."""


@dataclasses.dataclass(frozen=True)
class Plan:
    prompt: int = 512  # random ids each generation's prompt holds
    tokens: int = 128  # greedy tokens each generation answers
    concurrency: tuple[int, ...] = (1, 16, 64)  # generations at once
    rounds: int = 3
    seed: int = 0  # the checkpoint's weights and the prompts
    server_peers: bool = True  # llama.cpp's server and vLLM, where built
    joiner: int = 2000  # the joiner's prompt ids (0: no joiner scenario)
    joiner_tokens: int = 8
    joiner_after: int = 32  # the running streams' tokens before the joiner is sent
    idle_s: float = 30.0  # how long each server's idle CPU is measured (0: not measured)

    @classmethod
    def quick(cls) -> Plan:
        return cls(16, 8, (1, 4), rounds=1, joiner=36, joiner_tokens=4, joiner_after=2, idle_s=2)

    @property
    def joined(self) -> int:
        """The generations running when the joiner comes: the second concurrency (16 by default)."""
        return self.concurrency[min(1, len(self.concurrency) - 1)]


@dataclasses.dataclass
class Generated:
    """One candidate's generations of one round."""

    tokens: np.ndarray  # (generations, tokens) int64
    first_ms: list[float]  # per generation: its request to its first token
    gaps_ms: list[float]  # between a generation's consecutive tokens, every generation's
    wall_s: float  # the round: the first request to the last generation's end
    arrivals: list[list[float]] = dataclasses.field(default_factory=list)  # a stream's tokens' perf_counter()


Generate = Callable[[np.ndarray, int], Generated]  # (prompts (C, T) int64, tokens) -> Generated
# one generation on its caller's thread: (prompt (T,), tokens, received(token id) as each arrives)
Stream = Callable[[np.ndarray, int, Callable[[int], None]], None]


def concurrently(stream: Stream, prompts: np.ndarray, tokens: int, after: int = 0, meanwhile=None) -> Generated:
    """Each prompt's generation on a thread of its own, all released together; `meanwhile()` run on this thread once
    every generation has `after` tokens or has ended (the joiner)."""
    count = len(prompts)
    gate, ready = threading.Barrier(count + 1), threading.Semaphore(0)
    starts, ends = [0.0] * count, [0.0] * count
    arrivals: list[list[float]] = [[] for _ in range(count)]
    ids: list[list[int]] = [[] for _ in range(count)]

    def generation(row: int) -> None:
        def received(token: int) -> None:
            arrivals[row].append(time.perf_counter())
            ids[row].append(token)
            if len(ids[row]) == after:
                ready.release()

        gate.wait()
        starts[row] = time.perf_counter()
        try:
            stream(prompts[row], tokens, received)
        finally:
            ends[row] = time.perf_counter()
            if len(ids[row]) < after:  # ended early: the joiner does not wait for it
                ready.release()

    with ThreadPoolExecutor(count) as pool:
        generations = pool.map(generation, range(count))
        gate.wait()
        if meanwhile is not None:
            for _ in range(count):
                ready.acquire()
            meanwhile()
        list(generations)  # a generation's error raised here
    for row, answered in enumerate(ids):
        if len(answered) != tokens:
            raise BenchError(f"generation {row} answered {len(answered)} tokens, expected {tokens}")
    first_ms = [(times[0] - start) * 1e3 for times, start in zip(arrivals, starts, strict=True)]
    gaps_ms = [gap * 1e3 for times in arrivals for gap in np.diff(times)]
    return Generated(np.array(ids, np.int64), first_ms, gaps_ms, max(ends) - min(starts), arrivals)


def batched(tokens: np.ndarray, first_ms: float, steps_ms: list[float], wall_s: float) -> Generated:
    """A batch candidate's round: every row's first token at the prefill's end, a gap per decode step."""
    return Generated(np.asarray(tokens, np.int64), [first_ms] * len(tokens), list(steps_ms), wall_s)


def served_stream(client) -> Stream:
    """`Client.generate` streaming from Triton's `sessions`."""

    def stream(prompt: np.ndarray, tokens: int, received: Callable[[int], None]) -> None:
        for token in client.generate(prompt, max_new_tokens=tokens):
            received(token)

    return stream


def gateway_candidate(http, url: str) -> Generate:
    """`POST /v1/generate` with `stream: true`, its Server-Sent Events read as they come (httpx)."""
    from bench.stack import KEY

    def stream(prompt: np.ndarray, tokens: int, received: Callable[[int], None]) -> None:
        body = {"input_ids": prompt.tolist(), "max_new_tokens": tokens, "stream": True}
        with http.stream("POST", f"{url}/v1/generate", json=body, headers={"X-API-Key": KEY}) as response:
            if response.status_code == 404:
                raise Unavailable(f"the gateway at {url} answers POST /v1/generate with 404: {response.read()[:200]!r}")
            if response.status_code != 200:
                raise BenchError(f"POST /v1/generate answered {response.status_code}: {response.read()[:500]!r}")
            for data in server_peers.sse_data(response.iter_lines()):
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise BenchError(f"POST /v1/generate streamed an error: {event['error']}")
                if "token_id" in event:
                    received(event["token_id"])
        raise BenchError("POST /v1/generate's stream ended without `data: [DONE]`")

    return partial(concurrently, stream)


class Answers:
    """A core.Responder: each token the engine core picks handed to `received` (on the core's thread)."""

    def __init__(self, received: Callable[[int], None]) -> None:
        self.received, self.error, self.done = received, None, threading.Event()

    def send(self, outputs) -> None:
        if TOKEN_ID in outputs:
            self.received(int(outputs[TOKEN_ID][0]))

    def finish(self, outputs=None, error=None) -> None:
        self.error = error
        self.done.set()

    def cancelled(self) -> bool:
        return False


def in_process_candidate(engine_core) -> Generate:
    """The served model's engine core (serving/engine/core.py) built in this process: each generation a stateless
    request to it, as the served ones are."""
    from serving.engine import core

    sequences = itertools.count(1 << 40)

    def stream(prompt: np.ndarray, tokens: int, received: Callable[[int], None]) -> None:
        answers = Answers(received)
        asked = GenerationRequest(max_new_tokens=tokens, session_start=True, session_end=True)
        engine_core.submit(core.Generate(next(sequences), answers, prompt=prompt.astype(np.int64), asked=asked))
        answers.done.wait()
        if answers.error is not None:
            raise BenchError(f"in-process generation: {answers.error}") from answers.error

    return partial(concurrently, stream)


def transformers_candidate(checkpoint: Path, threads: int) -> Generate:
    """`LlamaForCausalLM.generate(do_sample=False)` over the prompts as one batch; a streamer times each pick."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    # no stop token, as the other candidates run
    greedy = {"do_sample": False, "eos_token_id": None, "pad_token_id": model.config.pad_token_id}

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
            # the mask given: without it transformers masks out every prompt id equal to the pad id
            mask = torch.ones_like(ids)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, streamer=arrivals, **greedy)
        wall_s, picked, generated = time.perf_counter() - started, arrivals.times[1:], out[:, prompts.shape[1] :]
        if generated.shape[1] != tokens or len(picked) != tokens:
            raise BenchError(f"transformers generated {generated.shape[1]} tokens, expected {tokens}")
        return batched(generated.numpy(), (picked[0] - started) * 1e3, list(np.diff(picked) * 1e3), wall_s)

    return generate


def genai_candidate(peer: whole_model.GenaiPeer) -> Generate:
    """onnxruntime-genai's Generator over the prompts as one batch, in its own process."""

    def generate(prompts: np.ndarray, tokens: int) -> Generated:
        if len(prompts) > GENAI_MOST_BATCH:
            raise Unmeasurable(f"onnxruntime-genai 0.18 takes batches of 1 to {GENAI_MOST_BATCH}, not {len(prompts)}")
        started = time.perf_counter()
        answer = peer(prompts, tokens)
        return batched(answer.tokens, answer.prefill_ms, answer.step_ms, time.perf_counter() - started)

    return generate


def repository_for(artifact: Path, root: Path, plan: Plan, threads: int, weights_dtype: str = WEIGHTS_FLOAT) -> Path:
    """`forward` and `sessions` sized for every concurrent generation's rows (and the joiner's); no rows kept for
    prefix reuse (the rounds repeat their prompts: a kept row would spare our prefill and no peer's), no cap on
    one owner's generations (the run's one API key); int4 weights: `sessions` alone, in a folder of its own."""
    from serving.triton import config
    from serving.triton.repository import write_repository

    cfg, generations = ModelConfig.load(artifact), max(plan.concurrency) + 1
    kv_cache_bytes = max(ServingSettings().kv_cache_bytes, cfg.kv_cache_bytes(generations, cfg.max_seq_len))
    sized = {"threads": threads, "max_batch_size": max(16, generations), "kv_cache_bytes": kv_cache_bytes}
    settings = ServingSettings(**sized, kept_per_owner=0, generations_per_owner=0, weights_dtype=weights_dtype)
    if weights_dtype != WEIGHTS_FLOAT:  # no gateway probes this one's `forward`
        return write_repository(artifact, root / f"repository-{weights_dtype}w", settings, models=(config.SESSIONS,))
    return write_repository(artifact, root / "repository", settings, models=(config.FORWARD, config.SESSIONS))


@dataclasses.dataclass
class Lineup:
    """The candidates, ready, and what the measures beyond them need."""

    generators: dict[str, Generate]
    servers: dict[str, list[int]]  # a server's name -> the pids whose trees are its processes
    served: Stream  # our gRPC stream (the joiner scenario)
    step_tokens: int  # the engine core's token budget a step
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # candidate -> why it cannot run here
    versions: dict[str, str] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def candidates(cfg: ModelConfig, root: Path, facts: dict, plan: Plan, threads: int) -> Iterator[Lineup]:
    """Every candidate ready (the servers started); stopped and closed afterwards."""
    import httpx

    from bench.serving import STATIC_MODEL, model_parameters, session_core
    from bench.stack import KEY, gateway_process, triton
    from client import Client
    from serving.triton.config import P_STEP_TOKENS

    artifact = Path(facts["artifact"])
    repository = repository_for(artifact, root, plan, threads)
    with contextlib.ExitStack() as stack:
        with Progress().stage("start Triton and the gateway"):
            server = stack.enter_context(triton(repository, log_path=root / "triton.log"))
            url, gateway = stack.enter_context(gateway_process(server.grpc_url, root / "gateway.log"))
        client = stack.enter_context(Client(server.grpc_url))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(plan.concurrency))
        http = stack.enter_context(httpx.Client(timeout=600, limits=limits))
        models = http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).raise_for_status().json()
        ours = server_peers.PeerServer(OPENAI, url, models["data"][0]["id"], {}, root / "gateway.log", api_key=KEY)
        engine_core = session_core(repository, STATIC_MODEL, cfg)
        stack.callback(engine_core.stop)
        lineup = Lineup(
            {
                SERVED: partial(concurrently, served_stream(client)),
                GATEWAY: gateway_candidate(http, url),
                OPENAI: partial(concurrently, server_peers.server_stream(ours, http)),
                IN_PROCESS: in_process_candidate(engine_core),
                TORCH: transformers_candidate(Path(facts["checkpoint"]), threads),
            },
            {OURS: [server.process.pid, gateway.pid]},
            served_stream(client),
            int(model_parameters(repository, STATIC_MODEL)[P_STEP_TOKENS]),
        )
        report = json.loads((artifact / files.REPORT_FILENAME).read_text())
        if report["variants"].get(whole_model.STATIC_INT4W, {}).get("passed"):
            int4 = repository_for(artifact, root, plan, threads, weights_dtype=WEIGHTS_INT4)
            with Progress().stage("start Triton (4-bit weights)"):
                int4_server = stack.enter_context(triton(int4, log_path=root / "triton-int4w.log"))
            lineup.servers["ours, 4-bit weights (Triton and its stubs)"] = [int4_server.process.pid]
            int4_client = stack.enter_context(Client(int4_server.grpc_url))
            lineup.generators[SERVED_INT4] = partial(concurrently, served_stream(int4_client))
        else:
            lineup.skipped[SERVED_INT4] = f"the artifact has no {whole_model.STATIC_INT4W} that passed its ladder"
        peers(stack, lineup, cfg, root, facts, plan, threads, http)
        lineup.generators = {name: lineup.generators[name] for name in CANDIDATES if name in lineup.generators}
        yield lineup


def peers(stack, lineup: Lineup, cfg: ModelConfig, root: Path, facts: dict, plan: Plan, threads: int, http) -> None:
    """onnxruntime-genai (fp32, and int4 where built) and the server peers that are built, started; a server peer
    not built in `lineup.skipped` with the reason. llama.cpp serves the checkpoint's F32 GGUF (made beside it)."""
    genai = facts["genai"]
    for name, model in genai["models"].items() if genai["used"] else ():
        peer = whole_model.GenaiPeer(Path(genai["python"]), Path(model), threads)
        stack.callback(peer.close)
        lineup.versions[GENAI] = genai["version"] = peer.version
        lineup.generators[name] = genai_candidate(peer)
    checkpoint, most, length = Path(facts["checkpoint"]), max(plan.concurrency), cfg.max_seq_len
    for name in SERVER_PEERS if plan.server_peers else ():
        try:
            with Progress().stage(f"start {name}'s server"):
                server_peers.require(name, build=False)
                if name == LLAMA_CPP:
                    gguf = server_peers.gguf_of(checkpoint, checkpoint.parent / "gguf", "f32")
                    started = server_peers.llama_server(gguf, most, threads, length, root / "llama-server.log")
                else:
                    started = server_peers.vllm_server(checkpoint, most, max_model_len=length, log=root / "vllm.log")
                started = stack.enter_context(started)
        except server_peers.Unavailable as reason:
            lineup.skipped[name] = str(reason)
            continue
        lineup.generators[name] = partial(concurrently, server_peers.server_stream(started, http))
        lineup.servers[name] = [started.pid]
        lineup.versions[name] = started.version


def measure_all(generators: dict[str, Generate], prompts: dict[int, np.ndarray], plan: Plan) -> tuple[dict, dict]:
    """((candidate, concurrency) -> its rounds' Generated, what was left out -> why): a short warm-up generation of
    each candidate at each concurrency first, where one that cannot run says so (the whole candidate, or that
    concurrency of it), then the rounds."""
    progress, skipped, runs = Progress(), {}, []
    with progress.stage(f"warm-up: every candidate, {WARMUP_TOKENS} tokens"):
        for name, count in itertools.product(list(generators), prompts):
            if name not in generators:
                continue
            try:
                generators[name](prompts[count], min(WARMUP_TOKENS, plan.tokens))
            except Unavailable as reason:
                skipped[name] = str(reason)
                del generators[name]
            except Unmeasurable as reason:
                skipped[f"{name} at {count}"] = str(reason)
            else:
                runs.append((name, count))
    measured: dict = {}
    for turn, name in interleaved(plan.rounds, list(generators)):
        with progress.stage(f"round {turn + 1}/{plan.rounds}: {name}"):
            for count, batch in prompts.items():
                if (name, count) in runs:
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
        # each row against transformers' tokens for its prompt; None: a route that streams text, not ids (-1)
        "greedy": None if (tokens < 0).any() else whole_model.agreement(tokens, np.tile(reference, (len(rounds), 1))),
    }


def measure_joiner(lineup: Lineup, cfg: ModelConfig, plan: Plan) -> dict | None:
    """`plan.rounds` rounds of `plan.joined` gRPC streams, the joiner sent once each has `plan.joiner_after` tokens:
    the streams' p99 gap before it was sent (once every stream decodes) and while it was prefilled (the gaps ending
    after its request and starting before its first token), over the rounds; one chunk's time: its prefill time
    over its chunks (the core gives a waiting prompt the step's token budget the decoders leave)."""
    if not plan.joiner:
        return None
    rng = np.random.default_rng(plan.seed + 1)
    running = rng.integers(0, cfg.vocab_size, (plan.joined, plan.prompt), dtype=np.int64)
    joiner = rng.integers(0, cfg.vocab_size, plan.joiner, dtype=np.int64)
    chunk, times = max(lineup.step_tokens - plan.joined, 1), []
    before, during, ttft_ms = [], [], []

    def send() -> None:  # `times`: its request's time, then each of its tokens'
        times[:] = [time.perf_counter()]
        lineup.served(joiner, plan.joiner_tokens, lambda _token: times.append(time.perf_counter()))

    for turn in range(plan.rounds):
        with Progress().stage(f"joiner round {turn + 1}/{plan.rounds}: {plan.joiner} ids join {plan.joined} streams"):
            streams = concurrently(lineup.served, running, plan.tokens, plan.joiner_after, send)
        sent, first = times[:2]
        steady = max(arrived[0] for arrived in streams.arrivals)  # every stream decoding: their prompts are in
        for start, end in (pair for arrived in streams.arrivals for pair in itertools.pairwise(arrived)):
            if steady <= start and end < sent:
                before.append((end - start) * 1e3)
            elif end >= sent and start < first:
                during.append((end - start) * 1e3)
        ttft_ms.append((first - sent) * 1e3)
        time.sleep(SETTLE_S)
    if not before or not during:
        return {"error": f"the running streams ended before the joiner was prefilled ({len(during)} gaps while it was)"}
    p99_before, p99_during = (float(np.percentile(gaps, 99)) for gaps in (before, during))
    return {
        "running": plan.joined,
        "joiner_ids": plan.joiner,
        "chunk_ids": chunk,
        "itl_p99_before_ms": p99_before,
        "itl_p99_during_ms": p99_during,
        "itl_max_during_ms": max(during),
        "raise_ms": p99_during - p99_before,
        "chunk_ms": float(np.median(ttft_ms)) / -(-plan.joiner // chunk),
        "joiner_ttft_ms": ttft_ms,
        "gaps": {"before": len(before), "during": len(during)},
    }


def idle_cpu(servers: dict[str, list[int]], seconds: float) -> dict:
    """Each server's CPU over the same `seconds` with nothing asked of it."""
    from bench.stack import cpu_seconds

    if seconds <= 0:
        return {}
    time.sleep(SETTLE_S)
    before = {name: cpu_seconds(pids) for name, pids in servers.items()}
    time.sleep(seconds)
    used = {name: cpu_seconds(pids) - before[name] for name, pids in servers.items()}
    return {
        name: {"cpu_s": cpu, "seconds": seconds, "percent_of_a_core": 100 * cpu / seconds} for name, cpu in used.items()
    }


def rate(results: dict, count: int, name: str) -> float | None:
    row = next((row for row in results["rows"] if row["concurrency"] == count), {"candidates": {}})
    return row["candidates"].get(name, {}).get("tokens_per_s")


def targets(results: dict) -> dict:
    """The issue's goals, measured (reported, never asserted): tokens/s ratios, the joiner's raise of the running
    streams' p99 gap against one chunk's time, our idle CPU."""
    out: dict = {}

    def ratio(key: str, numerator: float | None, denominator: float | None, least: float, **more) -> None:
        if numerator is not None and denominator is not None:
            out[key] = output.goal(numerator / denominator, least=least, **more)

    counts = [row["concurrency"] for row in results["rows"]]
    ratio("served_vs_in_process_C1", rate(results, 1, SERVED), rate(results, 1, IN_PROCESS), 0.95)
    for count in (count for count in counts if count in GOAL_COUNTS):
        ratio(f"served_vs_{GENAI}_C{count}", rate(results, count, SERVED), rate(results, count, GENAI), 1.0)
        int4 = rate(results, count, SERVED_INT4), rate(results, count, GENAI_INT4)
        ratio(f"served_int4w_vs_{GENAI_INT4}_C{count}", *int4, 1.0)  # issue 48: ahead of genai's int4 too
        for peer in SERVER_PEERS:
            ratio(f"{OPENAI}_vs_{peer}_C{count}", rate(results, count, OPENAI), rate(results, count, peer), 1.0)
    for count in (count for count in counts if count > 1):
        ceiling = {"prefill_ceiling": prefill_ceiling(results, count)} if rate(results, 1, SERVED) else {}
        ratio(f"served_C{count}_vs_C1", rate(results, count, SERVED), rate(results, 1, SERVED), 2.5, **ceiling)
    joiner = results["joiner"] or {}
    if "raise_ms" in joiner:
        out["joiner_raises_p99_itl_by_at_most_a_chunk"] = output.goal(
            joiner["raise_ms"], most=joiner["chunk_ms"], kind="raise_ms", target="raise <= one chunk's time"
        ) | {"chunk_ms": joiner["chunk_ms"]}
    if OURS in results["idle"]:
        percent = results["idle"][OURS]["percent_of_a_core"]
        out["idle_cpu_under_1_percent"] = {"percent_of_a_core": percent, "target": "< 1% of a core", "met": percent < 1}
    return out


def prefill_ceiling(results: dict, count: int) -> float:
    """The most `count` generations at once could give over one, on served-grpc's own C=1 measures, if `count`
    decoding rows cost a step what one does and only the prompts' prefill grows: `count` prefills of one prompt
    each (`p`, the time to the first token at C=1) and the steps of one generation (`d`, its ITL p50):
    (count T / (count p + (T - 1) d)) / (T / (p + (T - 1) d))."""
    entry = next(row for row in results["rows"] if row["concurrency"] == 1)["candidates"][SERVED]
    tokens, p, d = results["plan"]["tokens"], entry["ttft_ms"]["p50"], entry["itl_ms"]["p50"]
    return count * (p + (tokens - 1) * d) / (count * p + (tokens - 1) * d)


def table(results: dict) -> str:
    plan = results["plan"]
    heading = (
        f"{results['preset']}: a {plan['prompt']}-token prompt then {plan['tokens']} greedy tokens per generation, "
        f"{plan['rounds']} interleaved rounds, {results['conditions']['threads']} threads, "
        f"{results['measured_at']['text']}"
    )
    header = ("conc.", "candidate", "tokens/s", "vs served", "TTFT p50", "ITL p50", "ITL p99", "greedy = transformers")
    rows = []
    for row in results["rows"]:
        served = row["candidates"].get(SERVED, {}).get("tokens_per_s")
        for name, entry in row["candidates"].items():
            greedy, itl = entry["greedy"], entry["itl_ms"]
            rate_cells = f"{entry['tokens_per_s']:.1f}", f"{entry['tokens_per_s'] / served:.2f}x" if served else "-"
            times = f"{entry['ttft_ms']['p50']:.1f} ms", f"{itl['p50']:.2f} ms", f"{itl['p99']:.2f} ms"
            agreed = f"{greedy['agree_before_first_difference']} of {plan['tokens']}" if greedy else "n/a"
            rows.append((row["concurrency"], name, *rate_cells, *times, agreed))
    lines = [output.table(heading, header, rows)]
    lines.append(
        "tokens/s: every generated token over the round's wall time (median round); TTFT: request to first token; "
        "ITL: gaps between a generation's tokens as its caller received them (a batch's: its decode step); greedy: "
        "ids equal to transformers' before the first difference, the fewest (n/a: the route streams text)"
    )
    joiner = results["joiner"] or {}
    if "error" in joiner:
        lines.append(f"joiner: {joiner['error']}")
    elif joiner:
        ttft = ", ".join(f"{ms:.0f}" for ms in joiner["joiner_ttft_ms"])
        lines.append(
            f"joiner: {joiner['joiner_ids']} ids join {joiner['running']} streams (chunks of {joiner['chunk_ids']} "
            f"ids): their p99 gap {joiner['itl_p99_before_ms']:.1f} ms before, {joiner['itl_p99_during_ms']:.1f} ms "
            f"while it is prefilled (max {joiner['itl_max_during_ms']:.1f} ms): +{joiner['raise_ms']:.1f} ms; one "
            f"chunk {joiner['chunk_ms']:.1f} ms; its TTFT {ttft} ms"
        )
    for name, entry in results["idle"].items():
        cpu = f"{entry['cpu_s']:.2f} CPU s = {entry['percent_of_a_core']:.2f}% of a core"
        lines.append(f"idle {entry['seconds']:g} s, {name}: {cpu}")
    lines += [f"{name} left out: {reason}" for name, reason in results["skipped"].items()]
    if not results["build"]["genai"]["used"]:
        lines.append(f"{GENAI} left out: {results['build']['genai'].get('reason', 'not asked for (--no-genai)')}")
    return "\n".join(lines + goal_lines(results["targets"]))


def goal_lines(goals: dict) -> list[str]:
    lines = ["goals:"]
    for name, entry in goals.items():
        if "ratio" in entry:
            ceiling = entry.get("prefill_ceiling")
            bound = f"target {entry['target']}" + (f", the prefill-bound ceiling {ceiling:.1f}x" if ceiling else "")
            measured = f"{entry['ratio']:.2f}x ({bound})"
        elif "raise_ms" in entry:
            measured = f"+{entry['raise_ms']:.1f} ms, a chunk {entry['chunk_ms']:.1f} ms"
        else:
            measured = f"{entry['percent_of_a_core']:.2f}% of a core (target {entry['target']})"
        lines.append(f"  {name}: {measured} -> {'met' if entry['met'] else 'MISSED'}")
    return lines


def plot(results: dict, path: Path) -> Path:
    """tokens/s and ITL (bars p50, marks p99) per candidate, a bar per concurrency."""
    from bench.plot import figure, gridded, grouped_bars, save

    rows = results["rows"]
    names = [name for name in CANDIDATES if any(name in row["candidates"] for row in rows)]

    def series(value: Callable[[dict], float], label: str = "") -> dict[str, list[float]]:
        return {
            f"{row['concurrency']} at once{label}": [
                value(row["candidates"][name]) if name in row["candidates"] else np.nan for name in names
            ]
            for row in rows
        }

    drawn, (rates, latency) = figure(2, (13, 4.5))
    grouped_bars(rates, names, series(lambda entry: entry["tokens_per_s"]), ylabel="generated tokens / s")
    at = grouped_bars(
        latency, names, series(lambda entry: entry["itl_ms"]["p50"], ", p50"), ylabel="inter-token latency, ms"
    )
    for k, p99 in enumerate(series(lambda entry: entry["itl_ms"]["p99"]).values()):
        marks = [x + k * 0.8 / len(rows) for x in at]
        latency.scatter(marks, p99, color="black", marker="_", s=200, zorder=3, label=None if k else "p99")
    for axis in (rates, latency):
        axis.set_yscale("log")
        for label in axis.get_xticklabels():
            label.set(rotation=20, ha="right", fontsize=8)
    gridded(rates, latency)
    plan = results["plan"]
    drawn.suptitle(
        f"{results['preset']}: {plan['prompt']}-token prompts, {plan['tokens']} greedy tokens each (CPU, "
        f"{results['measured_at']['text']})"
    )
    return save(drawn, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--preset", default="llama-whole", help="a whole model's preset (default: %(default)s)")
    chosen.add_argument("--config", type=Path, help="a whole model's config JSON instead of a preset")
    quick = "16-token prompts, 8 tokens, 1 and 4 at once, 1 round, a 36-id joiner"
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--prompt", type=int, help="prompt ids per generation (default 512; --quick 16)")
    parser.add_argument("--tokens", type=int, help="greedy tokens per generation (default 128; --quick 8)")
    parser.add_argument("--concurrency", help="comma-separated generations at once (default 1,16,64; --quick 1,4)")
    output.rounds_argument(parser, None, "default 3; --quick 1")
    parser.add_argument("--joiner", type=int, help="the joiner's prompt ids (default 2000; --quick 36; 0: none)")
    parser.add_argument("--idle-seconds", type=float, help="each server's idle CPU over this long (default 30; 0: not)")
    output.threads_argument(parser, "threads per candidate and server")
    parser.add_argument("--no-genai", action="store_true", help="leave onnxruntime-genai out")
    peers_help = "leave llama.cpp's server and vLLM out (even where built)"
    parser.add_argument("--no-server-peers", action="store_true", help=peers_help)
    output.output_arguments(parser)


def checked(cfg: ModelConfig, plan: Plan) -> None:
    if not whole_model.llama_shaped(cfg):
        raise BenchError(f"generation needs a Llama-shaped whole model (token ids in, logits out), got {cfg}")
    if min(plan.prompt, plan.tokens, plan.rounds, *plan.concurrency) < 1:
        raise BenchError(f"prompt, tokens, rounds and concurrency must be at least 1, got {plan}")
    if plan.prompt + plan.tokens > cfg.max_seq_len:
        raise BenchError(f"a {plan.prompt}-id prompt and {plan.tokens} tokens exceed max_seq_len {cfg.max_seq_len}")
    if plan.joiner and plan.joiner + plan.joiner_tokens > cfg.max_seq_len:
        raise BenchError(f"the joiner's ids and tokens exceed it: give --joiner {cfg.max_seq_len - plan.joiner_tokens}")
    if plan.joiner and plan.tokens <= plan.joiner_after:
        raise BenchError(f"the joiner comes after {plan.joiner_after} tokens: give --tokens above that")


def benchmark(cfg: ModelConfig, name: str, folder: Path, plan: Plan, threads: int, genai: bool) -> dict:
    checked(cfg, plan)
    every = np.random.default_rng(plan.seed).integers(cfg.vocab_size, size=(max(plan.concurrency), plan.prompt))
    prompts = {count: every[:count] for count in plan.concurrency}
    with output.during(threads, *whole_model.RUNTIMES) as conditions:
        facts = whole_model.prepare(cfg, folder, plan.seed, genai)
        with candidates(cfg, folder, facts, plan, threads) as lineup:
            measured, skipped = measure_all(lineup.generators, prompts, plan)
            joiner = measure_joiner(lineup, cfg, plan)
            idle = idle_cpu(lineup.servers, plan.idle_s)
    rows = []
    for count in plan.concurrency:
        reference = measured[TORCH, count][0].tokens
        present = [candidate for candidate in CANDIDATES if (candidate, count) in measured]
        rows.append({"concurrency": count, "candidates": {c: summary(measured[c, count], reference) for c in present}})
    results = {
        "preset": name,
        "config": cfg.to_dict(),
        "plan": dataclasses.asdict(plan),
        "measured_at": output.commit(),
        "conditions": conditions,
        "build": facts,
        "rows": rows,
        "skipped": lineup.skipped | skipped,
        "versions": lineup.versions,
        "joiner": joiner,
        "idle": idle,
    }
    return results | {"targets": targets(results)}


def run(args: argparse.Namespace) -> int:
    given = {"concurrency": output.counts(args.concurrency), "idle_s": args.idle_seconds}
    peers = False if args.no_server_peers else None
    plan = output.planned(args, Plan, "prompt", "tokens", "rounds", "joiner", server_peers=peers, **given)
    cfg, name = (ModelConfig.load(args.config), args.config.stem) if args.config else (preset(args.preset), args.preset)
    with output.work_folder(args.work, "bench-generate-") as root:
        results = benchmark(cfg, name, root / name, plan, args.threads, genai=not args.no_genai)
    return output.report(results, args.out, "generate", plot, table(results))
