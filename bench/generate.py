"""Generation end to end: the server's engine core served (gRPC, the gateway's SSE and OpenAI routes) and
in-process, against onnxruntime-genai, transformers, llama.cpp's server and vLLM on the CPU, on one
checkpoint. `python -m bench generate` runs it.

Writes `generate.json` and `generate.png` and prints a table and the goals.

The checkpoint is the llama-whole preset's, as `python -m bench model` prepares it (bench/whole_model.py:
transformers' LlamaForCausalLM of random weights, our artifact imported from it, onnxruntime-genai's model
built from it; all in one folder, kept with `--work`). Each of `concurrency` generations prompts `prompt`
random ids and generates `tokens` greedy tokens (no stop token: an end-of-sequence id is a token as any
other). The candidates, each run alone, in `rounds` rounds with the order reversed every round:

- `served-grpc`: Triton serving the artifact (`sessions`: its engine core generates), the client's
  `Client.generate` streaming, one thread per concurrent generation;
- `gateway-sse`: the gateway in front of that Triton, `POST /v1/generate` with `stream: true` through httpx,
  one thread per concurrent generation (left out, with the reason, where the route answers 404);
- `gateway-openai`: the same gateway's `POST /v1/completions`, streamed, the prompt as token ids, driven by
  the one client that drives the server peers (bench/server_peers.py);
- `in-process`: the same engine core (serving/engine/core.py) over the `sessions` model's engine built in this
  process from the same repository and settings, a generation a request to it;
- `served-grpc-int4w`: a Triton of its own serving the artifact's 4-bit weights (`fp32-static-int4w`, as
  `--weights-dtype int4` serves them), through the client as `served-grpc`;
- `onnxruntime-genai` and `onnxruntime-genai-int4`: its Generator on its model builder's fp32 and int4 (`-p int4
  -e cpu`) CPU graphs (bench/genai_peer.py), the concurrent prompts as one batch;
- `transformers`: `LlamaForCausalLM.generate(do_sample=False)`, the concurrent prompts as one batch;
- `llama.cpp-f32` and `vllm`: llama.cpp's `llama-server` (F32 GGUF, fp32 cache, `--parallel` the most
  generations at once, continuous batching) and vLLM CPU (fp32, `--max-num-seqs` as many) on the same
  checkpoint, each through its OpenAI route (bench/server_peers.py: built once into `.peers/` by `make
  bench-server-peers`; a peer not built is left out with the reason). Neither reuses prompts, and our
  session model keeps no rows for reuse in this run: every candidate prefills every prompt.

Measured per candidate and concurrency: tokens/s (every generated token over the round's wall time, from
the first request to the last generation's end; the median over the rounds), the time to the first token
(p50 over the generations) and the inter-token latency (p50, p99 over the gaps between a generation's
tokens as its caller received them). A batch candidate's first token is its prefill and first pick, and
its gaps are its decode steps. Every candidate's tokens are checked against transformers' (fp32
everywhere: they must agree), but the OpenAI route's of ours, which streams text, not ids, and the 4-bit
weights' (`INT4_CANDIDATES`), whose agreement is reported: they compute other logits.

Then two measures of our stack alone:
- the joiner: `concurrency[1]` generations streaming (gRPC) when a `joiner`-id prompt arrives; the running
  streams' p99 gap before it and while it is prefilled (its request to its first token), against one
  chunk's time (the joiner's prefill time over its chunks: the core runs a prompt in chunks of the step's
  token budget left by the decoders), `rounds` times;
- idle CPU: the processes of each server (Triton with its stubs and the gateway; each peer server) over
  `idle_s` seconds with nothing asked of them, in CPU seconds and in percent of a core.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from bench import results as output
from bench import server_peers, whole_model
from bench.timing import SETTLE_S, interleaved
from contract import files
from contract.config import ModelConfig, preset

SERVED, GATEWAY, OPENAI, IN_PROCESS = "served-grpc", "gateway-sse", "gateway-openai", "in-process"
SERVED_INT4 = "served-grpc-int4w"  # Triton serving the artifact's fp32-static-int4w (`--weights-dtype int4`)
GENAI, GENAI_INT4, TORCH = "onnxruntime-genai", whole_model.GENAI_INT4, "transformers"
LLAMA_CPP, VLLM = server_peers.LLAMA_F32, server_peers.VLLM
CANDIDATES = (SERVED, SERVED_INT4, GATEWAY, OPENAI, IN_PROCESS, GENAI, GENAI_INT4, TORCH, LLAMA_CPP, VLLM)
# 4-bit weights compute other logits than transformers' fp32: their greedy tokens are compared and reported, not
# required to agree (every other candidate's must, fp32 everywhere)
INT4_CANDIDATES = (SERVED_INT4, GENAI_INT4)
SERVER_PEERS = (LLAMA_CPP, VLLM)  # through their OpenAI routes, as OPENAI is ours
DEFAULT_PRESET = "llama-whole"
GATEWAY_KEY = "bench-generate-key"
GENAI_MOST_BATCH = 32  # onnxruntime-genai 0.18's largest batch (seen: "batch_size (64) must be in [1, 32]")
WARMUP_TOKENS = 4


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (a candidate answered an error or too few tokens)."""


class Unavailable(BenchError):
    """A candidate that cannot run here, and why: left out of the run, the reason reported."""


class Unmeasurable(BenchError):
    """A candidate that cannot run one concurrency of the plan, and why: that concurrency left out."""


@dataclasses.dataclass(frozen=True)
class Plan:
    prompt: int = 512  # random ids each generation's prompt holds
    tokens: int = 128  # greedy tokens each generation answers
    concurrency: tuple[int, ...] = (1, 16, 64)  # generations at once
    rounds: int = 3
    seed: int = 0  # the checkpoint's weights and the prompts
    server_peers: bool = True  # llama.cpp's server and vLLM, where built
    joiner: int = 2000  # the joiner's prompt ids (0: no joiner scenario)
    joiner_tokens: int = 8  # the joiner's tokens
    joiner_after: int = 32  # the running streams' tokens before the joiner is sent
    idle_s: float = 30.0  # how long each server's idle CPU is measured (0: not measured)

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            prompt=16, tokens=8, concurrency=(1, 4), rounds=1, joiner=36, joiner_tokens=4, joiner_after=2, idle_s=2
        )

    @property
    def joined(self) -> int:
        """The generations running when the joiner comes: the second concurrency (16 by default)."""
        return self.concurrency[1] if len(self.concurrency) > 1 else self.concurrency[0]


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


def served_stream(client) -> Stream:
    """`Client.generate` streaming from Triton's `sessions`."""

    def stream(prompt: np.ndarray, tokens: int, received: Callable[[int], None]) -> None:
        for token in client.generate(prompt, max_new_tokens=tokens):
            received(token)

    return stream


def served_candidate(client) -> Generate:
    """`served_stream`, one thread per generation."""
    return lambda prompts, tokens: concurrently(served_stream(client), prompts, tokens)


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
            for data in server_peers.sse_data(response.iter_lines()):
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise BenchError(f"POST /v1/generate streamed an error: {event['error']}")
                if "token_id" in event:
                    received(event["token_id"])
        raise BenchError("POST /v1/generate's stream ended without `data: [DONE]`")

    return lambda prompts, tokens: concurrently(stream, prompts, tokens)


def openai_candidate(server: server_peers.PeerServer, http) -> Generate:
    """`POST /v1/completions` streamed, by bench/server_peers.py's client: ours (the gateway) and the server
    peers alike, one thread per generation. A chunk's token whose server does not say its id reads -1."""
    return lambda prompts, tokens: concurrently(server_peers.server_stream(server, http), prompts, tokens)


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
    """The served model's engine core (serving/engine/core.py) over the `sessions` model's engine built in this process
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
        if len(prompts) > GENAI_MOST_BATCH:
            raise Unmeasurable(
                f"onnxruntime-genai 0.18 takes batches of 1 to {GENAI_MOST_BATCH} (its answer to "
                f"{len(prompts)}: 'batch_size ({len(prompts)}) must be in [1, {GENAI_MOST_BATCH}]')"
            )
        started = time.perf_counter()
        answer = peer(prompts, tokens)
        return batched(answer.tokens, answer.prefill_ms, answer.step_ms, time.perf_counter() - started)

    return generate


# --- the servers ------------------------------------------------------------------------------------------


def repository_for(artifact: Path, root: Path, plan: Plan, threads: int, weights_dtype: str | None = None) -> Path:
    """`forward` and `sessions` (which generates) of the artifact, sized for the machine's threads and for every
    concurrent generation's rows at once (and the joiner's); no rows kept for prefix reuse (the rounds repeat
    their prompts: a kept row would spare our prefill and no peer's), no cap on one owner's generations (the
    run's one API key is one tenant); `weights_dtype` int4: the 4-bit weights' forms, in a folder of its own."""
    from contract.deployment import ServingSettings
    from serving.triton import config as triton_config
    from serving.triton.repository import write_repository

    cfg = ModelConfig.load(artifact)
    generations = max(plan.concurrency) + 1
    default = ServingSettings()
    settings = ServingSettings(
        threads=threads,
        max_batch_size=max(16, generations),
        kv_cache_bytes=max(default.kv_cache_bytes, cfg.kv_cache_bytes(generations, cfg.max_seq_len)),
        kept_per_owner=0,
        generations_per_owner=0,
        **({"weights_dtype": weights_dtype} if weights_dtype else {}),
    )
    if weights_dtype is not None:  # the session model alone: it generates, and no gateway probes this one
        folder = root / f"repository-{weights_dtype}w"
        return write_repository(artifact, folder, settings, models=(triton_config.SESSIONS,))
    models = (triton_config.FORWARD, triton_config.SESSIONS)  # the gateway's readiness probes both
    return write_repository(artifact, root / "repository", settings, models=models)


@dataclasses.dataclass
class Lineup:
    """The candidates, ready, and what the measures beyond them need."""

    generators: dict[str, Generate]
    skipped: dict[str, str]  # candidate -> why it cannot run here
    servers: dict[str, list[int]]  # a server's name -> the pids whose trees are its processes
    served: Stream  # our gRPC stream (the joiner scenario)
    step_tokens: int  # the core's token budget a step
    versions: dict[str, str]


@contextlib.contextmanager
def candidates(cfg: ModelConfig, root: Path, facts: dict, plan: Plan, threads: int) -> Iterator[Lineup]:
    """Every candidate, ready (the servers started); stopped and closed afterwards."""
    import httpx

    from bench.serving import STATIC_MODEL, model_parameters, session_core
    from bench.stack import gateway_process
    from client import Client
    from export.progress import Progress
    from serving.host.launcher import start_triton
    from serving.triton.config import P_STEP_TOKENS

    progress = Progress()
    repository = repository_for(Path(facts["artifact"]), root, plan, threads)
    with contextlib.ExitStack() as stack:
        with progress.stage("start Triton"):
            server = start_triton(repository, log_path=root / "triton.log")
        stack.callback(server.stop)
        with progress.stage("start the gateway"):
            url, gateway = stack.enter_context(
                gateway_process(server.grpc_url, root / "gateway.log", api_keys=GATEWAY_KEY)
            )
        client = stack.enter_context(Client(server.grpc_url))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(plan.concurrency))
        http = stack.enter_context(httpx.Client(timeout=600, limits=limits))
        engine_core = session_core(repository, STATIC_MODEL, cfg)
        stack.callback(engine_core.stop)
        ours = server_peers.PeerServer(
            OPENAI, url, served_model(http, url), {}, root / "gateway.log", api_key=GATEWAY_KEY
        )
        made: dict[str, Generate] = {
            SERVED: served_candidate(client),
            GATEWAY: gateway_candidate(http, url),
            OPENAI: openai_candidate(ours, http),
            IN_PROCESS: in_process_candidate(engine_core),
            TORCH: transformers_candidate(Path(facts["checkpoint"]), threads),
        }
        lineup = Lineup(
            {},
            {},
            {"ours (Triton and its stubs, the gateway)": [server.process.pid, gateway.pid]},
            served_stream(client),
            int(model_parameters(repository, STATIC_MODEL)[P_STEP_TOKENS]),
            {},
        )
        made |= int4_served(stack, lineup, Path(facts["artifact"]), root, plan, threads, progress)
        made |= peers(stack, lineup, cfg, root, facts, plan, threads, http, progress)
        lineup.generators = {name: made[name] for name in CANDIDATES if name in made}
        yield lineup


def int4_served(stack, lineup: Lineup, artifact: Path, root: Path, plan: Plan, threads: int, progress) -> dict:
    """A Triton of its own serving the artifact's 4-bit weights (fp32-static-int4w), generating through the client;
    left out, with the reason, where the artifact has no such form."""
    from client import Client
    from serving.host.launcher import start_triton

    report = json.loads((artifact / files.REPORT_FILENAME).read_text())
    if not report["variants"].get(whole_model.STATIC_INT4W, {}).get("passed"):
        lineup.skipped[SERVED_INT4] = f"the artifact has no {whole_model.STATIC_INT4W} that passed its ladder"
        return {}
    repository = repository_for(artifact, root, plan, threads, weights_dtype="int4")
    with progress.stage("start Triton (4-bit weights)"):
        server = start_triton(repository, log_path=root / "triton-int4w.log")
    stack.callback(server.stop)
    lineup.servers["ours, 4-bit weights (Triton and its stubs)"] = [server.process.pid]
    return {SERVED_INT4: served_candidate(stack.enter_context(Client(server.grpc_url)))}


def peers(stack, lineup: Lineup, cfg, root: Path, facts: dict, plan: Plan, threads: int, http, progress) -> dict:
    """onnxruntime-genai's candidate and the server peers' that are built, started; those not, in
    `lineup.skipped` with the reason."""
    made: dict[str, Generate] = {}
    genai = facts["genai"]
    for name, model in genai.get("models", {GENAI: genai.get("model")}).items() if genai["used"] else ():
        peer = whole_model.GenaiPeer(Path(genai["python"]), Path(model), threads)  # fp32, and int4 where built
        stack.callback(peer.close)
        lineup.versions[GENAI] = genai["version"] = peer.version
        made[name] = genai_candidate(peer)
    for name in SERVER_PEERS if plan.server_peers else ():
        try:
            with progress.stage(f"start {name}'s server"):
                started = stack.enter_context(server_peer(name, cfg, root, facts, plan, threads))
        except server_peers.Unavailable as reason:
            lineup.skipped[name] = str(reason)
            continue
        made[name] = openai_candidate(started, http)
        lineup.servers[name] = [started.pid]
        lineup.versions[name] = started.version
    return made


def served_model(http, url: str) -> str:
    """The model id the gateway's OpenAI routes answer to (its first in `GET /v1/models`)."""
    answer = http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {GATEWAY_KEY}"})
    answer.raise_for_status()
    return answer.json()["data"][0]["id"]


def server_peer(name: str, cfg: ModelConfig, root: Path, facts: dict, plan: Plan, threads: int):
    """A server peer's context (bench/server_peers.py) on the checkpoint, sized for the most generations at
    once: llama.cpp on the checkpoint's F32 GGUF (made beside it, kept), vLLM on the checkpoint itself."""
    checkpoint, most = Path(facts["checkpoint"]), max(plan.concurrency)
    server_peers.require(name, build=False)
    if name == LLAMA_CPP:
        gguf = server_peers.gguf_of(checkpoint, checkpoint.parent / "gguf", "f32")
        return server_peers.llama_server(gguf, most, threads, cfg.max_seq_len, log=root / "llama-server.log")
    return server_peers.vllm_server(checkpoint, most, max_model_len=cfg.max_seq_len, log=root / "vllm.log")


# --- measuring --------------------------------------------------------------------------------------------


def prompts_for(cfg: ModelConfig, plan: Plan) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(plan.seed)
    every = rng.integers(0, cfg.vocab_size, (max(plan.concurrency), plan.prompt), dtype=np.int64)
    return {count: np.ascontiguousarray(every[:count]) for count in plan.concurrency}


def measure_all(generators: dict[str, Generate], prompts: dict[int, np.ndarray], plan: Plan) -> tuple[dict, dict]:
    """((candidate, concurrency) -> its Generated of each round, what was left out -> why): a short warm-up
    generation of each candidate at each concurrency first (where one that cannot run says so: the whole
    candidate, or that concurrency of it), then the rounds."""
    from export.progress import Progress

    progress = Progress()
    skipped: dict[str, str] = {}
    runs = [(name, count) for name in generators for count in prompts]
    with progress.stage(f"warm-up: every candidate, {WARMUP_TOKENS} tokens"):
        for name, count in list(runs):
            if name not in generators:
                runs.remove((name, count))
                continue
            try:
                generators[name](prompts[count], min(WARMUP_TOKENS, plan.tokens))
            except Unavailable as reason:
                skipped[name] = str(reason)
                del generators[name]
                runs.remove((name, count))
            except Unmeasurable as reason:
                skipped[f"{name} at {count}"] = str(reason)
                runs.remove((name, count))
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
        # every round's tokens, each row against transformers' tokens for the same prompt (None: a route that
        # streams text, not ids)
        "greedy": None
        if (tokens < 0).any()
        else whole_model.agreement(tokens, np.concatenate([reference] * len(rounds))),
    }


# --- the joiner: a long prompt arriving while generations stream --------------------------------------------


@dataclasses.dataclass
class Joined:
    """One joiner round: every running stream's tokens' arrival times, and the joiner's request and first
    token."""

    arrivals: list[list[float]]
    sent: float
    first: float


def joined(stream: Stream, running: np.ndarray, tokens: int, joiner: np.ndarray, plan: Plan) -> Joined:
    """`running`'s generations streaming on threads; once each has `plan.joiner_after` tokens, the joiner's
    generation (`plan.joiner_tokens`) sent on one more."""
    arrivals: list[list[float]] = [[] for _ in running]
    started = threading.Barrier(len(running) + 1)
    ready = threading.Semaphore(0)
    failures: list[BaseException] = []

    def generation(row: int) -> None:
        def received(_token: int) -> None:
            arrivals[row].append(time.perf_counter())
            if len(arrivals[row]) == plan.joiner_after:
                ready.release()

        started.wait()
        try:
            stream(running[row], tokens, received)
        except BaseException as error:  # raised again below, on the caller's thread
            failures.append(error)
            ready.release()

    threads = [threading.Thread(target=generation, args=(row,), name=f"running-{row}") for row in range(len(running))]
    for thread in threads:
        thread.start()
    started.wait()
    for _ in running:
        ready.acquire()
    first: list[float] = []
    sent = time.perf_counter()
    try:
        stream(joiner, plan.joiner_tokens, lambda _token: first.append(time.perf_counter()))
    finally:
        for thread in threads:
            thread.join()
    if failures:
        raise failures[0]
    return Joined(arrivals, sent, first[0])


def joiner_summary(rounds: list[Joined], plan: Plan, step_tokens: int) -> dict:
    """The running streams' gaps before the joiner was sent (once every stream decodes) and while it was
    prefilled (those ending between its request and its first token, and the one in flight then), p99 each over
    the rounds; one chunk's time: the
    joiner's prefill time over its chunks (the core gives a waiting prompt what the step's token budget leaves
    after the decoders: `step_tokens` - the running streams)."""
    before, during, chunk_ms = [], [], []
    chunk = max(step_tokens - plan.joined, 1)
    for one in rounds:
        steady = max(times[0] for times in one.arrivals)  # every stream decoding: their prompts are in
        for times in one.arrivals:
            for start, end in itertools.pairwise(times):
                if steady <= start and end < one.sent:
                    before.append((end - start) * 1e3)
                elif end >= one.sent and start < one.first:
                    during.append((end - start) * 1e3)
        chunk_ms.append((one.first - one.sent) * 1e3 / -(-plan.joiner // chunk))
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
        "chunk_ms": float(np.median(chunk_ms)),
        "joiner_ttft_ms": [(one.first - one.sent) * 1e3 for one in rounds],
        "gaps": {"before": len(before), "during": len(during)},
    }


def measure_joiner(lineup: Lineup, cfg: ModelConfig, plan: Plan) -> dict | None:
    """`plan.rounds` joiner rounds on our gRPC stream (None when the plan has no joiner)."""
    from export.progress import Progress

    if not plan.joiner:
        return None
    rng = np.random.default_rng(plan.seed + 1)
    running = rng.integers(0, cfg.vocab_size, (plan.joined, plan.prompt), dtype=np.int64)
    joiner = rng.integers(0, cfg.vocab_size, plan.joiner, dtype=np.int64)
    rounds, progress = [], Progress()
    for turn in range(plan.rounds):
        with progress.stage(f"joiner round {turn + 1}/{plan.rounds}: {plan.joiner} ids join {plan.joined} streams"):
            rounds.append(joined(lineup.served, running, plan.tokens, joiner, plan))
        time.sleep(SETTLE_S)
    return joiner_summary(rounds, plan, lineup.step_tokens)


# --- idle CPU ---------------------------------------------------------------------------------------------------


def idle_cpu(servers: dict[str, list[int]], seconds: float) -> dict:
    """Each server's CPU over `seconds` with nothing asked of it (all measured over the same window)."""
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


# --- results ----------------------------------------------------------------------------------------------


def results_for(cfg: ModelConfig, name: str, plan: Plan, facts: dict, measured: dict, extra: dict, **conditions):
    """`extra`: skipped (candidate -> why), versions, joiner (joiner_summary's), idle (idle_cpu's)."""
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
        "measured_at": output.commit(),
        "conditions": conditions,
        "build": facts,
        "rows": rows,
        **extra,
    }
    results["targets"] = targets(results)
    return results


def rate(results: dict, count: int, name: str) -> float | None:
    row = next((row for row in results["rows"] if row["concurrency"] == count), None)
    entry = row["candidates"].get(name) if row else None
    return entry["tokens_per_s"] if entry else None


GOAL_COUNTS = (1, 16)  # the goals are at 1 and 16 generations at once; 64 is reported


def targets(results: dict) -> dict:
    """The issue's goals, measured (reported, never asserted): tokens/s ratios, the joiner's raise of the
    running streams' p99 gap against one chunk's time, our idle CPU."""
    out: dict = {}

    def goal(key: str, numerator: float | None, denominator: float | None, least: float, **more) -> None:
        if numerator is not None and denominator is not None:
            out[key] = output.goal(numerator / denominator, least=least, **more)

    counts = [row["concurrency"] for row in results["rows"]]
    goal("served_vs_in_process_C1", rate(results, 1, SERVED), rate(results, 1, IN_PROCESS), 0.95)
    for count in (c for c in counts if c in GOAL_COUNTS):
        goal(f"served_vs_{GENAI}_C{count}", rate(results, count, SERVED), rate(results, count, GENAI), 1.0)
        int4 = rate(results, count, SERVED_INT4), rate(results, count, GENAI_INT4)
        goal(f"served_int4w_vs_{GENAI_INT4}_C{count}", *int4, 1.0)  # issue 48: ahead of genai's int4 too
        for peer in SERVER_PEERS:
            goal(f"{OPENAI}_vs_{peer}_C{count}", rate(results, count, OPENAI), rate(results, count, peer), 1.0)
    for count in (c for c in counts if c > 1):
        ceiling = prefill_ceiling(results, count)
        more = {"prefill_ceiling": ceiling} if ceiling else {}
        goal(f"served_C{count}_vs_C1", rate(results, count, SERVED), rate(results, 1, SERVED), 2.5, **more)
    joiner = results.get("joiner") or {}
    if "raise_ms" in joiner:
        out["joiner_raises_p99_itl_by_at_most_a_chunk"] = {
            "raise_ms": joiner["raise_ms"],
            "chunk_ms": joiner["chunk_ms"],
            "target": "raise <= one chunk's time",
            "met": joiner["raise_ms"] <= joiner["chunk_ms"],
        }
    ours = next((entry for name, entry in (results.get("idle") or {}).items() if name.startswith("ours")), None)
    if ours:
        out["idle_cpu_under_1_percent"] = {
            "percent_of_a_core": ours["percent_of_a_core"],
            "target": "< 1% of a core",
            "met": ours["percent_of_a_core"] < 1.0,
        }
    return out


def prefill_ceiling(results: dict, count: int) -> float | None:
    """The most `count` generations at once could give over one, on served-grpc's own C=1 measures, if `count`
    decoding rows cost a step what one does and only the prompts' prefill grows: `count` prefills of one prompt
    each (`p`, the time to the first token at C=1) and the steps of one generation (`d`, its ITL p50):
    (count T / (count p + (T - 1) d)) / (T / (p + (T - 1) d))."""
    row = next((row for row in results["rows"] if row["concurrency"] == 1), None)
    entry = row["candidates"].get(SERVED) if row else None
    if entry is None:
        return None
    tokens = results["plan"]["tokens"]
    p, d = entry["ttft_ms"]["p50"], entry["itl_ms"]["p50"]
    return count * (p + (tokens - 1) * d) / (count * p + (tokens - 1) * d)


def table(results: dict) -> str:
    plan, conditions = results["plan"], results["conditions"]
    lines = [
        f"{results['preset']}: a {plan['prompt']}-token prompt then {plan['tokens']} greedy tokens per generation, "
        f"{plan['rounds']} interleaved rounds, {conditions['threads']} threads, {results['measured_at']['text']}",
        f"{'conc.':<6}{'candidate':<23}{'tokens/s':>9}{'vs served':>10}{'TTFT p50':>10}{'ITL p50':>9}{'ITL p99':>9}"
        f"{'greedy = transformers':>23}",
    ]
    for row in results["rows"]:
        served = row["candidates"].get(SERVED, {}).get("tokens_per_s")
        for name, entry in row["candidates"].items():
            versus = f"{entry['tokens_per_s'] / served:>9.2f}x" if served else f"{'-':>10}"
            greedy = entry["greedy"]
            agreed = f"{greedy['agree_before_first_difference']:>14} of {plan['tokens']}" if greedy else f"{'n/a':>20}"
            lines.append(
                f"{row['concurrency']:<6}{name:<23}{entry['tokens_per_s']:>9.1f}{versus}"
                f"{entry['ttft_ms']['p50']:>8.1f}ms{entry['itl_ms']['p50']:>7.2f}ms{entry['itl_ms']['p99']:>7.2f}ms"
                f"{agreed}"
            )
    lines.append(
        "tokens/s: every generated token over the round's wall time (median over rounds); TTFT: request to first "
        "token; ITL: gaps between a generation's tokens as its caller received them (a batch peer's: its decode "
        "step); greedy = transformers: tokens equal to transformers' before the first difference, the fewest over "
        "generations and rounds (fp32 everywhere: all of them must agree, but the 4-bit weights'; n/a: the route "
        "streams text, not ids)"
    )
    lines += joiner_lines(results.get("joiner"))
    for name, entry in (results.get("idle") or {}).items():
        cpu = f"{entry['cpu_s']:.2f} CPU s = {entry['percent_of_a_core']:.2f}% of a core"
        lines.append(f"idle {entry['seconds']:g} s, {name}: {cpu}")
    for name, reason in results["skipped"].items():
        lines.append(f"{name} left out: {reason}")
    if not results["build"]["genai"]["used"]:
        lines.append(f"{GENAI} left out: {results['build']['genai'].get('reason', 'not asked for (--no-genai)')}")
    lines += goal_lines(results["targets"])
    return "\n".join(lines)


def joiner_lines(joiner: dict | None) -> list[str]:
    if not joiner:
        return []
    if "error" in joiner:
        return [f"joiner: {joiner['error']}"]
    return [
        f"joiner: {joiner['joiner_ids']} ids join {joiner['running']} streams (chunks of {joiner['chunk_ids']} ids): "
        f"their p99 gap {joiner['itl_p99_before_ms']:.1f} ms before, {joiner['itl_p99_during_ms']:.1f} ms while it "
        f"is prefilled (max {joiner['itl_max_during_ms']:.1f} ms): +{joiner['raise_ms']:.1f} ms; one chunk "
        f"{joiner['chunk_ms']:.1f} ms; its TTFT " + ", ".join(f"{ms:.0f}" for ms in joiner["joiner_ttft_ms"]) + " ms"
    ]


def goal_lines(goals: dict) -> list[str]:
    lines = ["goals:"]
    for name, entry in goals.items():
        verdict = "met" if entry["met"] else "MISSED"
        if "ratio" in entry:
            ceiling = (
                f", the prefill-bound ceiling {entry['prefill_ceiling']:.1f}x" if "prefill_ceiling" in entry else ""
            )
            lines.append(f"  {name}: {entry['ratio']:.2f}x (target {entry['target']}{ceiling}) -> {verdict}")
        elif "raise_ms" in entry:
            lines.append(f"  {name}: +{entry['raise_ms']:.1f} ms, a chunk {entry['chunk_ms']:.1f} ms -> {verdict}")
        else:
            lines.append(
                f"  {name}: {entry['percent_of_a_core']:.2f}% of a core (target {entry['target']}) -> {verdict}"
            )
    return lines


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    from bench.plot import gridded, save

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
    gridded(rates, latency)
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
    parser.add_argument(
        "--quick", action="store_true", help="16-token prompts, 8 tokens, 1 and 4 at once, 1 round, a 36-id joiner"
    )
    parser.add_argument("--prompt", type=int, help="prompt ids per generation (default 512; --quick 16)")
    parser.add_argument("--tokens", type=int, help="greedy tokens per generation (default 128; --quick 8)")
    parser.add_argument("--concurrency", help="comma-separated generations at once (default 1,16,64; --quick 1,4)")
    output.rounds_argument(parser, None, "default 3; --quick 1")
    parser.add_argument("--joiner", type=int, help="the joiner's prompt ids (default 2000; --quick 36; 0: none)")
    parser.add_argument("--idle-seconds", type=float, help="each server's idle CPU over this long (default 30; 0: not)")
    output.threads_argument(parser, "threads per candidate and server")
    parser.add_argument("--no-genai", action="store_true", help="leave onnxruntime-genai out")
    parser.add_argument(
        "--no-server-peers", action="store_true", help="leave llama.cpp's server and vLLM out (even where built)"
    )
    output.output_arguments(parser)


def plan_from(args: argparse.Namespace) -> Plan:
    return output.planned(
        args,
        Plan,
        "prompt",
        "tokens",
        "rounds",
        "joiner",
        concurrency=output.counts(args.concurrency),
        idle_s=args.idle_seconds,
        server_peers=False if args.no_server_peers else None,
    )


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
    if plan.joiner and plan.joiner + plan.joiner_tokens > cfg.max_seq_len:
        raise BenchError(
            f"the joiner's {plan.joiner} ids and {plan.joiner_tokens} tokens exceed the model's max_seq_len "
            f"{cfg.max_seq_len}: give --joiner {cfg.max_seq_len - plan.joiner_tokens} or fewer"
        )
    if plan.joiner and plan.tokens <= plan.joiner_after:
        raise BenchError(f"the joiner comes after {plan.joiner_after} tokens: give --tokens above that")


def benchmark(cfg: ModelConfig, name: str, folder: Path, plan: Plan, threads: int, genai: bool) -> dict:
    checked(cfg, plan)
    load_before = os.getloadavg()[0]
    facts = whole_model.prepare(cfg, folder, plan.seed, genai)
    with candidates(cfg, folder, facts, plan, threads) as lineup:
        measured, skipped = measure_all(lineup.generators, prompts_for(cfg, plan), plan)
        joiner = measure_joiner(lineup, cfg, plan)
        idle = idle_cpu(lineup.servers, plan.idle_s)
    load = {"before": load_before, "after": os.getloadavg()[0]}
    machine = output.machine(threads, *whole_model.RUNTIMES)
    extra = {"skipped": lineup.skipped | skipped, "versions": lineup.versions, "joiner": joiner, "idle": idle}
    return results_for(cfg, name, plan, facts, measured, extra, **machine, load_average_1min=load)


def run(args: argparse.Namespace) -> int:
    plan = plan_from(args)
    cfg, name = (ModelConfig.load(args.config), args.config.stem) if args.config else (preset(args.preset), args.preset)
    with output.work_folder(args.work, "bench-generate-") as root:
        results = benchmark(cfg, name, root / name, plan, args.threads, genai=not args.no_genai)
    return output.report(results, args.out, "generate", plot, table(results))
