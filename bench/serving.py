"""Serving: the two session engines and the stateless path, in-process and through Triton.

Writes `serving.json` and `serving.png` and prints tables and the targets.

- latency of one decode step (batch 1, one new token) against the past length, p50 and p99:
  `in-process/static` and `in-process/concat` (the sessions model's two engines built from the repository
  as the model builds them, without Triton), `stateful/grpc` (sessions: its engine core over the
  static cache, each step a gRPC stream of one request, the only way Triton takes a decoupled model's
  request), `stateful/grpc/concat` (the same model with per-sequence caches batched by padding),
  `stateless/grpc` and `stateless/http` (forward: the client sends the whole cache and gets the presents
  back), and `noop/grpc`: a decoupled Python model with the sessions model's sequence batching that answers
  its input, Triton's own cost for the same call;
- bytes a step puts on the wire, request and response;
- decode throughput of each engine, and of the no-op model (the ceiling Triton and the client set on
  this machine), against the number of concurrent sessions at two past lengths
  (asyncio gRPC client, every session stepping as fast as its answers come back);
- the resident memory of each sessions stub before, at the peak of and after each load run,
  over two identical runs (memory bounded by the pool, nothing kept from one run to the next).

Conditions: one Triton from the bundled binary on 127.0.0.1, ONNX Runtime with `--threads`
threads; the client runs on the same machine (on 2 cores it competes with the server). Each point
sends a bounded number of requests; the whole run stops adding points after `--time-limit` seconds.
The config is the default preset with max_seq_len 8192, so that a session holds a long past.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench import results as output
from bench.plot import save
from bench.timing import percentiles
from contract import files, names
from contract.config import DEFAULT_PRESET, ModelConfig, preset
from export.progress import Progress
from serving.triton.config import ServingSettings

STATIC_MODEL, CONCAT_MODEL, NOOP = "sessions", "sessions_concat", "noop"
ENGINE_MODELS = {"static": STATIC_MODEL, "concat": CONCAT_MODEL}
# throughput also runs the no-op model: the most steps/s Triton and the client reach on this machine
# for the same calls, whatever the engine does (the ceiling the engines are read against)
THROUGHPUT_MODELS = {**ENGINE_MODELS, "noop": NOOP}
MODES = (
    "in-process/static",
    "in-process/concat",
    "stateful/grpc",
    "stateful/grpc/concat",
    "stateless/grpc",
    "stateless/http",
    "noop/grpc",
)
VARIANTS = ("fp32", "fp32-fused", "fp32-static")
# The concat engine keeps copies of every cache it batches (stacked pasts, the graph's presents, the
# split-out caches, an arena that keeps what it grew): 32 sessions at past 4096 took its stub past
# 20 GB of this 24 GB machine and the kernel killed it (measured). Its points stop at this many
# cached positions; the static engine's memory is its pool.
CONCAT_MAX_POSITIONS = 16 * 4096


@dataclasses.dataclass(frozen=True)
class Plan:
    pasts: tuple[int, ...]
    sessions: tuple[int, ...]
    steps: int  # timed decode steps per latency point
    throughput_steps: int  # decode steps per session in a throughput point
    throughput_pasts: tuple[int, ...]
    load_runs: int = 2  # identical throughput runs: memory must not grow from one to the next

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls(pasts=(128, 512), sessions=(1, 4), steps=10, throughput_steps=8, throughput_pasts=(32,))
        pasts, sessions = (128, 1024, 4096, 8000), (1, 4, 16, 32)
        return cls(pasts, sessions, steps=100, throughput_steps=40, throughput_pasts=(1024, 4096))


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    @property
    def passed(self) -> bool:
        return time.monotonic() > self.end


def bench_config() -> ModelConfig:
    return dataclasses.replace(preset(DEFAULT_PRESET), max_seq_len=8192)


def timed(call: Callable[[], object], runs: int, warmup: int = 3) -> dict:
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e3)
    return percentiles(samples)


# --- what one decode step sends --------------------------------------------------------------------------


def step_inputs(cfg: ModelConfig, past: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    arrays = {
        names.HIDDEN_STATES: rng.standard_normal((1, 1, cfg.d_model)).astype(np.float32),
        names.ATTENTION_MASK: np.ones((1, past + 1), np.int64),
    }
    cache = (1, cfg.n_kv_heads, past, cfg.head_dim)
    arrays |= {name: rng.standard_normal(cache).astype(np.float32) for name in names.past_names(cfg.n_layers)}
    return arrays


def infer_inputs(module, arrays: dict[str, np.ndarray]) -> list:
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def grpc_request_bytes(model: str, arrays: dict[str, np.ndarray], sequence_id: int = 0) -> int:
    """The size of the ModelInferRequest protobuf tritonclient sends for these inputs."""
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype

    request = service_pb2.ModelInferRequest(model_name=model)
    for name, array in arrays.items():
        request.inputs.add(name=name, datatype=np_to_triton_dtype(array.dtype), shape=list(array.shape))
        request.raw_input_contents.append(array.tobytes())
    if sequence_id:
        request.parameters["sequence_id"].int64_param = sequence_id
    return request.ByteSize()


def http_request_bytes(arrays: dict[str, np.ndarray], sequence_id: int = 0) -> int:
    import tritonclient.http as httpclient

    sequence = {"sequence_id": sequence_id} if sequence_id else {}
    body, _ = httpclient.InferenceServerClient.generate_request_body(infer_inputs(httpclient, arrays), **sequence)
    return len(body)


def wire_bytes(cfg: ModelConfig, past: int) -> dict:
    """Bytes on the wire per step: requests exactly as the clients build them, responses as raw tensors."""
    inputs = step_inputs(cfg, past, np.random.default_rng(0))
    new_token = {names.HIDDEN_STATES: inputs[names.HIDDEN_STATES]}
    output_bytes = inputs[names.HIDDEN_STATES].nbytes
    return {
        "stateless_request_grpc": grpc_request_bytes("forward", inputs),
        "stateless_request_http": http_request_bytes(inputs),
        "stateful_request_grpc": grpc_request_bytes("sessions", new_token, sequence_id=1 << 40),
        "stateful_request_http": http_request_bytes(new_token, sequence_id=1 << 40),
        "stateless_response_tensors": output_bytes + cfg.kv_cache_bytes(1, past + 1),
        "stateful_response_tensors": output_bytes,
    }


# --- latency of one step --------------------------------------------------------------------------------


def session_engine(repository: Path, model: str, cfg: ModelConfig):
    """The session engine of `model` in the repository, built as the model builds it (no Triton)."""
    from serving.triton import engines

    return engines.session_engine(repository / model / "1", cfg, model_parameters(repository, model), f"bench-{model}")


def session_core(repository: Path, model: str, cfg: ModelConfig):
    """The engine core of `model` in the repository over its engine, as the model makes them (no Triton),
    started: stop it when done."""
    from serving.engine.core import EngineCore
    from serving.triton import engines

    settings = engines.session_settings(model_parameters(repository, model))
    return EngineCore(session_engine(repository, model, cfg), engines.core_settings(settings)).start()


def model_parameters(repository: Path, model: str) -> dict[str, str]:
    from serving.triton.config import parse

    config = parse((repository / model / "config.pbtxt").read_text())
    return {key: value.string_value for key, value in config.parameters.items()}


def in_process(engine, cfg: ModelConfig, past: int, runs: int) -> dict:
    """A session of `engine` prefilled to `past`, then `runs` timed one-token steps (then ended)."""
    from serving.engine.steps import StepRequest

    rng = np.random.default_rng(1)
    prompt = rng.standard_normal((1, past, cfg.d_model)).astype(np.float32)
    token = rng.standard_normal((1, 1, cfg.d_model)).astype(np.float32)
    sequence = 1 << 50

    def step(start: bool = False, end: bool = False, hidden: np.ndarray = token) -> np.ndarray:
        (result,) = engine.execute([StepRequest(sequence, start, end, hidden)])
        if isinstance(result, Exception):
            raise result
        return result

    step(start=True, hidden=prompt)
    try:
        return timed(step, runs)
    finally:
        step(end=True, hidden=np.zeros((1, 0, cfg.d_model), np.float32))


def stateless(server, protocol: str, cfg: ModelConfig, past: int, runs: int) -> dict:
    module = _module(protocol)
    client = module.InferenceServerClient(_url(server, protocol))
    try:
        inputs = infer_inputs(module, step_inputs(cfg, past, np.random.default_rng(2)))
        return timed(lambda: client.infer("forward", inputs), runs)
    finally:
        client.close()


def stateful(
    server, protocol: str, cfg: ModelConfig, past: int, runs: int, sequence_id: int, model: str = STATIC_MODEL
) -> dict:
    """A session prefilled with `past` tokens, then `runs` timed steps (its past grows by `runs`); each
    request a gRPC stream of one request, as client/affinity.py sends a session's (`protocol` is gRPC:
    Triton refuses a unary call to a decoupled model)."""
    from client import affinity

    module = _module(protocol)
    client = module.InferenceServerClient(_url(server, protocol))
    rng = np.random.default_rng(3)
    prefill = infer_inputs(
        module, {names.HIDDEN_STATES: rng.standard_normal((1, past, cfg.d_model)).astype(np.float32)}
    )
    token = infer_inputs(module, {names.HIDDEN_STATES: rng.standard_normal((1, 1, cfg.d_model)).astype(np.float32)})
    close = infer_inputs(module, {names.HIDDEN_STATES: np.zeros((1, 0, cfg.d_model), np.float32)})

    def step(inputs: list, **sequence) -> None:
        affinity.infer(client, model, inputs, headers={}, sequence_id=sequence_id, **sequence)

    try:
        step(prefill, sequence_start=True)
        return timed(lambda: step(token), runs)
    finally:
        step(close, sequence_end=True)
        client.close()


def _module(protocol: str):
    import importlib

    return importlib.import_module(f"tritonclient.{protocol}")  # http needs gevent, which a GPU host may lack


def _url(server, protocol: str) -> str:
    return server.grpc_url if protocol == "grpc" else server.http_url


# --- throughput and the stubs' memory -------------------------------------------------------------------


async def concurrent_steps(
    url: str, cfg: ModelConfig, model: str, count: int, past: int, steps: int, first_id: int
) -> float:
    """Steps per second of `count` sessions stepping concurrently (prefills and ends not counted)."""
    import tritonclient.grpc.aio as aioclient

    from client import affinity

    client = aioclient.InferenceServerClient(url)
    rng = np.random.default_rng(4)
    prefill = infer_inputs(
        aioclient, {names.HIDDEN_STATES: rng.standard_normal((1, past, cfg.d_model)).astype(np.float32)}
    )
    token = infer_inputs(aioclient, {names.HIDDEN_STATES: rng.standard_normal((1, 1, cfg.d_model)).astype(np.float32)})
    close = infer_inputs(aioclient, {names.HIDDEN_STATES: np.zeros((1, 0, cfg.d_model), np.float32)})
    ids = [first_id + k for k in range(count)]

    def step(sequence_id: int, inputs: list, **sequence):
        return affinity.infer(client, model, inputs, headers={}, sequence_id=sequence_id, **sequence)

    try:
        await asyncio.gather(*(step(i, prefill, sequence_start=True) for i in ids))

        async def decode(sequence_id: int) -> None:
            for _ in range(steps):
                await step(sequence_id, token)

        started = time.perf_counter()
        await asyncio.gather(*(decode(i) for i in ids))
        elapsed = time.perf_counter() - started
        await asyncio.gather(*(step(i, close, sequence_end=True) for i in ids))
    finally:
        await client.close()
    return count * steps / elapsed


def stub_memory(model: str) -> dict[str, int]:
    """Resident memory of the Python-backend stub(s) of `model` (instances named `<model>_<g>_<i>`), in
    bytes: `own` is the stub's private and file-backed pages (its Python, ONNX Runtime, the KV pool),
    `shared` the pages of Triton's shared-memory region that carries requests and responses."""
    instance = re.compile(rf"{re.escape(model)}_\d+_\d+")
    own = shared = 0
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            arguments = (proc / "cmdline").read_bytes().split(b"\0")
            if not arguments or not arguments[0].endswith(b"triton_python_backend_stub"):
                continue
            if any(instance.fullmatch(a.decode(errors="replace")) for a in arguments):
                status = (proc / "status").read_text()
                kib = {
                    k: int(re.search(rf"{k}:\s+(\d+) kB", status).group(1)) for k in ("RssAnon", "RssFile", "RssShmem")
                }
                own += (kib["RssAnon"] + kib["RssFile"]) * 1024
                shared += kib["RssShmem"] * 1024
    return {"own_bytes": own, "shared_bytes": shared}


class PeakMemory:
    """The largest memory of a model's stub while the `with` block runs (sampled 10x a second)."""

    def __init__(self, model: str) -> None:
        self.model, self.peak = model, {"own_bytes": 0, "shared_bytes": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            now = stub_memory(self.model)
            self.peak = {key: max(self.peak[key], now[key]) for key in now}
            if self._stop.wait(0.1):
                return

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def throughput(server, cfg: ModelConfig, engine: str, count: int, past: int, plan: Plan, first_id: int) -> dict:
    model = THROUGHPUT_MODELS[engine]
    coroutine = concurrent_steps(server.grpc_url, cfg, model, count, past, plan.throughput_steps, first_id)
    with PeakMemory(model) as memory:
        rate = asyncio.run(coroutine)
    peak = {f"peak_{key}": value for key, value in memory.peak.items()}
    return {"engine": engine, "sessions": count, "past": past, "steps_per_s": rate, **peak}


# --- the run ----------------------------------------------------------------------------------------------


def prepare(root: Path, progress: Progress) -> Path:
    """An artifact of the bench config (reused when it is already there) and a repository with forward,
    sessions on each engine (the concat one as `sessions_concat`) and the no-op model."""
    from export.build import build
    from serving.engine.settings import ENGINE_CONCAT
    from serving.triton.config import P_ENGINE, parse, to_text
    from serving.triton.repository import write_repository

    cfg, directory = bench_config(), root / "artifact"
    if not all((directory / files.model_filename(v)).is_file() for v in VARIANTS) or ModelConfig.load(directory) != cfg:
        build(cfg, directory, VARIANTS, progress=progress)
    settings = ServingSettings(threads=0, kv_cache_bytes=cfg.kv_cache_bytes(1, cfg.max_seq_len) * 40)
    repository = write_repository(directory, root / "repository", settings, models=("forward", STATIC_MODEL))
    concat = dataclasses.replace(settings, engine=ENGINE_CONCAT)
    staged = write_repository(directory, root / "concat", concat, models=(STATIC_MODEL,))
    shutil.rmtree(repository / CONCAT_MODEL, ignore_errors=True)
    shutil.move(staged / STATIC_MODEL, repository / CONCAT_MODEL)
    config = parse((repository / CONCAT_MODEL / "config.pbtxt").read_text())
    config.name = CONCAT_MODEL
    assert config.parameters[P_ENGINE].string_value == ENGINE_CONCAT
    (repository / CONCAT_MODEL / "config.pbtxt").write_text(to_text(config))
    write_noop_model(repository)
    return repository


def write_noop_model(repository: Path) -> None:
    """`noop`: the sessions model's Triton config (decoupled, sequence batching and all) on a Python model that
    answers its input: Triton's own cost of a session step, measured beside ours."""
    from serving.triton.config import parse, to_text

    config = parse((repository / STATIC_MODEL / "config.pbtxt").read_text())
    config.name = NOOP
    config.parameters.clear()
    (repository / NOOP / "1").mkdir(parents=True, exist_ok=True)
    (repository / NOOP / "config.pbtxt").write_text(to_text(config))
    (repository / NOOP / "1" / "model.py").write_text(_NOOP_SOURCE)


_NOOP_SOURCE = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):  # decoupled: each answer goes through its request's sender
        for request in requests:
            hidden = pb_utils.get_input_tensor_by_name(request, "hidden_states").as_numpy()
            held = np.array([[hidden.shape[1]]], np.int64)  # as sessions answers both outputs
            outputs = [pb_utils.Tensor("output", hidden), pb_utils.Tensor("held_length", held)]
            request.get_response_sender().send(
                pb_utils.InferenceResponse(outputs), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            )
        return None
"""


def start_servers(repositories: list[Path], log_paths: list[Path] | None = None) -> list:
    """A Triton on each repository (its log at the `log_paths` entry when given), started at once (on
    2 cores about half the wait of one after another); if one fails, those that started are stopped
    again."""
    from serving.host.launcher import start_triton

    logs = log_paths or [None] * len(repositories)
    with concurrent.futures.ThreadPoolExecutor(len(repositories)) as pool:
        starting = [
            pool.submit(start_triton, repository, log_path=log)
            for repository, log in zip(repositories, logs, strict=True)
        ]
    servers = [future.result() for future in starting if future.exception() is None]
    failures = [future.exception() for future in starting if future.exception() is not None]
    if failures:
        stop_all(servers)
        raise failures[0]
    return servers


def stop_all(servers: list) -> None:
    """Every server stopped at once (a stop mostly waits for Triton to unload its models)."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(servers))) as pool:
        list(pool.map(lambda server: server.stop(), servers))


def benchmark(root: Path, plan: Plan, threads: int, deadline: Deadline, progress: Progress) -> dict:
    from serving.host.launcher import start_triton

    cfg = bench_config()
    repository = prepare(root, progress)
    engines = {engine: session_engine(repository, model, cfg) for engine, model in ENGINE_MODELS.items()}
    results = {
        "config": cfg.to_dict(),
        "plan": dataclasses.asdict(plan),
        "machine": output.machine(threads, "onnxruntime"),
    }
    results["pool_bytes"] = engines["static"].stats().budget_bytes
    results["weight_bytes"] = cfg.n_params() * 4
    with progress.stage("start Triton"):
        server = start_triton(repository, log_path=root / "triton.log")
    try:
        results["latency"] = latency_rows(server, engines, cfg, plan, deadline, progress)
        del engines  # the in-process pools: GBs
        results["memory"] = {engine: memory_row(server, engine) for engine in THROUGHPUT_MODELS}
        results["throughput"] = throughput_rows(server, cfg, plan, deadline, progress, results["memory"])
    finally:
        server.stop()
    results["targets"] = targets(results)
    return results


def latency_rows(server, engines: dict, cfg: ModelConfig, plan: Plan, deadline: Deadline, progress: Progress) -> list:
    rows = []
    for k, past in enumerate(plan.pasts):
        if deadline.passed:
            break
        with progress.stage(f"decode step at past {past}"):
            modes = {f"in-process/{e}": in_process(engine, cfg, past, plan.steps) for e, engine in engines.items()}
            sequence = (1 << 40) + 10 * k
            modes["stateful/grpc"] = stateful(server, "grpc", cfg, past, plan.steps, sequence)
            modes["stateful/grpc/concat"] = stateful(server, "grpc", cfg, past, plan.steps, sequence + 1, CONCAT_MODEL)
            for protocol in ("grpc", "http"):
                modes[f"stateless/{protocol}"] = stateless(server, protocol, cfg, past, plan.steps)
            modes["noop/grpc"] = stateful(server, "grpc", cfg, 1, plan.steps, sequence + 3, NOOP)
            rows.append({"past": past, "modes": modes, "bytes": wire_bytes(cfg, past)})
    return rows


def memory_row(server, engine: str) -> dict:
    return {"engine": engine, "before": stub_memory(THROUGHPUT_MODELS[engine]), "after": []}


def throughput_rows(server, cfg: ModelConfig, plan: Plan, deadline: Deadline, progress: Progress, memory: dict) -> list:
    """Each engine at each point, over `plan.load_runs` identical runs. A point that fails (the concat
    engine's stub can run out of memory on this machine) is recorded with its error, and that
    engine's later points are left out."""
    rows, broken = [], {}
    for run in range(plan.load_runs):
        for engine, model in THROUGHPUT_MODELS.items():
            for past, (k, count) in itertools.product(plan.throughput_pasts, enumerate(plan.sessions)):
                if deadline.passed or engine in broken:
                    break
                if engine == "concat" and count * past > CONCAT_MAX_POSITIONS:
                    continue
                label = f"run {run + 1}: {engine} engine, {count} sessions at past {past}"
                first = (1 << 41) + (run << 30) + 100_000 * k + past
                try:
                    with progress.stage(label):
                        rows.append({"run": run + 1} | throughput(server, cfg, engine, count, past, plan, first))
                except Exception as error:  # recorded: what failed and how much memory the stub held
                    broken[engine] = f"{type(error).__name__}: {error}"
                    rows.append(
                        {"run": run + 1, "engine": engine, "sessions": count, "past": past, "error": broken[engine]}
                    )
            time.sleep(0.5)  # let the sweeper publish and the stub settle after its sessions ended
            memory[engine]["after"].append(stub_memory(model))
    return rows


def _p50(results: dict, past: int, mode: str) -> float | None:
    row = next((r for r in results["latency"] if r["past"] == past), None)
    return row["modes"][mode]["p50_ms"] if row else None


def _rate(results: dict, engine: str, sessions: int, past: int, run: int = 1) -> float | None:
    rates = [
        r["steps_per_s"]
        for r in results["throughput"]
        if (r["engine"], r["sessions"], r["past"], r["run"]) == (engine, sessions, past, run) and "error" not in r
    ]
    return rates[0] if rates else None


def _scaling(results: dict, engine: str, past: int) -> list[float]:
    """16 sessions' steps/s over one session's, in each run."""
    runs = sorted({r["run"] for r in results["throughput"]})
    rates = [(_rate(results, engine, 16, past, run), _rate(results, engine, 1, past, run)) for run in runs]
    return [many / one for many, one in rates if many and one]


def targets(results: dict) -> dict:
    """The targets, each with its measured numbers and whether it is met (reported, never asserted)."""
    out: dict = {}
    pasts = [r["past"] for r in results["latency"]]
    far = 4096 if 4096 in pasts else max(pasts)
    served, local, noop = (_p50(results, far, m) for m in ("stateful/grpc", "in-process/static", "noop/grpc"))
    budget = local + noop + 0.3
    out["served_static_step"] = {"past": far, "served_ms": served, "budget_ms": budget, "met": served <= budget}
    near = 1024 if 1024 in {r["past"] for r in results["throughput"]} else min(r["past"] for r in results["throughput"])
    one, many = _rate(results, "static", 1, near), _rate(results, "static", 16, near)
    if one and many:
        out["throughput_16_sessions"] = {
            "past": near,
            "ratio": many / one,
            "target": 3.0,
            "met": many / one >= 3.0,
            "ratio_each_run": _scaling(results, "static", near),
            "noop_ratio_each_run": _scaling(results, "noop", near),
        }
    out |= _memory_targets(results)
    out["static_wins_everywhere"] = _engine_comparison(results)
    return out


def _peak(results: dict, engine: str, key: str) -> int:
    return max((r.get(f"peak_{key}", 0) for r in results["throughput"] if r["engine"] == engine), default=0)


def _memory_targets(results: dict) -> dict:
    """The static stub's own memory (its Python, ONNX Runtime, the pool) against the pool, and from one
    load run to the next; Triton's shared-memory region (requests and responses) is reported beside."""
    after = results["memory"]["static"]["after"]
    peak = _peak(results, "static", "own_bytes")
    bound = results["pool_bytes"] + results["weight_bytes"] + (300 << 20)
    own = [a["own_bytes"] for a in after]
    growth = own[-1] - own[0] if len(own) > 1 else None
    shared = [a["shared_bytes"] for a in after]
    return {
        "static_stub_memory_bounded": {"peak_bytes": peak, "bound_bytes": bound, "met": 0 < peak <= bound},
        "static_stub_memory_no_growth": {
            "after_each_run_bytes": own,
            "growth_bytes": growth,
            # the sessions are gone after each run: what one run leaves, the next must reuse (32 MiB of slack
            # for allocator noise)
            "met": growth is not None and growth <= (32 << 20),
        },
        "static_stub_shared_memory": {
            "peak_bytes": _peak(results, "static", "shared_bytes"),
            "after_each_run_bytes": shared,
        },
    }


def _engine_comparison(results: dict) -> dict:
    """Where the static engine loses to the concat one (p50 latency, steps/s)."""
    losses = []
    for row in results["latency"]:
        for static, concat in (("in-process/static", "in-process/concat"), ("stateful/grpc", "stateful/grpc/concat")):
            if row["modes"][static]["p50_ms"] > row["modes"][concat]["p50_ms"]:
                losses.append(f"{static} at past {row['past']}")
    for row in results["throughput"]:
        if row["engine"] == "static" and row["run"] == 1 and "error" in row:
            losses.append(f"throughput with {row['sessions']} sessions at past {row['past']} failed: {row['error']}")
        elif row["engine"] == "static" and row["run"] == 1:
            concat = _rate(results, "concat", row["sessions"], row["past"])
            if concat and row["steps_per_s"] < concat:
                losses.append(f"throughput with {row['sessions']} sessions at past {row['past']}")
    return {"losses": losses, "met": not losses}


def table(results: dict) -> str:
    header = f"{'past':>6} " + " ".join(f"{mode:>22}" for mode in MODES)
    lines = ["decode step latency, p50 / p99 ms (batch 1, one new token)", header, "-" * len(header)]
    for row in results["latency"]:
        cells = " ".join(f"{row['modes'][m]['p50_ms']:>10.2f} /{row['modes'][m]['p99_ms']:>9.2f}" for m in MODES)
        lines.append(f"{row['past']:>6} {cells}")
    lines += ["", "decode steps/s by concurrent sessions (gRPC, asyncio client), run 1 [run 2]:"]
    by_point = {
        (r["engine"], r["past"], r["sessions"], r["run"]): r["steps_per_s"]
        for r in results["throughput"]
        if "error" not in r
    }
    for engine in THROUGHPUT_MODELS:
        for past in sorted({r["past"] for r in results["throughput"]}):
            points = []
            for (e, p, sessions, run), steps_per_s in by_point.items():
                if (e, p, run) == (engine, past, 1):
                    again = by_point.get((engine, past, sessions, 2))
                    points.append(f"{sessions}: {steps_per_s:.0f}" + (f" [{again:.0f}]" if again else ""))
            lines.append(f"  {engine:<7} past {past:<5} " + ", ".join(points))
    for failed in (r for r in results["throughput"] if "error" in r):
        point = f"{failed['engine']} run {failed['run']}, {failed['sessions']} sessions at past {failed['past']}"
        lines.append(f"  {point}: {failed['error']}")
    mib = 1 << 20
    for engine, memory in results["memory"].items():
        for key, what in (("own_bytes", "own"), ("shared_bytes", "Triton shared memory")):
            peak = _peak(results, engine, key) / mib
            after = ", ".join(f"{a[key] / mib:.0f}" for a in memory["after"])
            before = memory["before"][key] / mib
            lines.append(f"{engine} stub {what} MiB: before {before:.0f}, peak {peak:.0f}, after each run {after}")
    return "\n".join(lines)


def targets_text(measured: dict) -> str:
    mark = {True: "met", False: "MISSED"}
    a = measured["served_static_step"]
    lines = [
        "targets:",
        f"  served static step at past {a['past']} {a['served_ms']:.2f} ms <= in-process + no-op + 0.3 ms "
        f"= {a['budget_ms']:.2f} ms: {mark[a['met']]}",
    ]
    if "throughput_16_sessions" in measured:
        b = measured["throughput_16_sessions"]
        lines.append(f"  16 sessions at past {b['past']} {b['ratio']:.1f}x one session (>= 3x): {mark[b['met']]}")
        runs = ", ".join(f"{r:.1f}x" for r in b.get("ratio_each_run", []))
        noop = ", ".join(f"{r:.1f}x" for r in b.get("noop_ratio_each_run", []))
        lines.append(f"  (each run: {runs or 'n/a'}; the no-op model, Triton's ceiling here: {noop or 'n/a'})")
    c, d = measured["static_stub_memory_bounded"], measured["static_stub_memory_no_growth"]
    mib = 1 << 20
    peak, bound = c["peak_bytes"] / mib, c["bound_bytes"] / mib
    lines.append(
        f"  static stub's own memory at its peak {peak:.0f} MiB <= pool + weights + 300 MiB = {bound:.0f} MiB: "
        f"{mark[c['met']]}"
    )
    growth = "n/a" if d["growth_bytes"] is None else f"{d['growth_bytes'] / mib:+.0f} MiB"
    lines.append(f"  static stub's own memory from one load run to the next {growth} (<= 32 MiB): {mark[d['met']]}")
    shared = measured["static_stub_shared_memory"]
    runs = ", ".join(f"{a / mib:.0f}" for a in shared["after_each_run_bytes"])
    lines.append(
        f"  (Triton's shared memory of the stub: peak {shared['peak_bytes'] / mib:.0f} MiB, after each run {runs})"
    )
    e = measured["static_wins_everywhere"]
    lines.append(
        f"  static engine no slower than concat everywhere: {mark[e['met']]}"
        + (f" (loses: {', '.join(e['losses'])})" if e["losses"] else "")
    )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    figure, (latency, rate) = plt.subplots(1, 2, figsize=(12, 4.5))
    pasts = [r["past"] for r in results["latency"]]
    for mode in MODES:
        latency.plot(pasts, [r["modes"][mode]["p50_ms"] for r in results["latency"]], marker="o", label=mode)
    latency.set(title="decode step p50", xlabel="past length (tokens)", ylabel="ms", xscale="log", yscale="log")
    latency.set_xticks(pasts, [str(p) for p in pasts])
    latency.minorticks_off()
    latency.legend(fontsize=7)
    for engine in THROUGHPUT_MODELS:
        for past in sorted({r["past"] for r in results["throughput"]}):
            points = [
                r
                for r in results["throughput"]
                if (r["engine"], r["past"], r["run"]) == (engine, past, 1) and "error" not in r
            ]
            rate.plot(
                [r["sessions"] for r in points],
                [r["steps_per_s"] for r in points],
                marker="o",
                label=f"{engine} past {past}",
            )
    rate.set(title="stateful gRPC throughput", xlabel="concurrent sessions", ylabel="decode steps / s", xscale="log")
    rate.legend(fontsize=7)
    rate.minorticks_off()
    for axis in (latency, rate):
        axis.grid(True, alpha=0.3)
    return save(figure, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="two past lengths, few steps, few sessions")
    output.threads_argument(parser, "ONNX Runtime threads in-process")
    parser.add_argument("--time-limit", type=float, default=900.0, help="stop adding points after this many seconds")
    output.output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    progress = Progress()
    deadline = Deadline(args.time_limit)
    with output.work_folder(args.work, "bench-serving-") as root:
        results = benchmark(root, Plan.make(args.quick), args.threads, deadline, progress)
    results["quick"] = args.quick
    wrote = output.write(results, args.out, "serving", plot)
    print(table(results))
    print(targets_text(results["targets"]))
    print(wrote)
    return 0
