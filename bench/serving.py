"""Serving: the two session engines and the stateless path, in-process and through Triton.

- One decode step's latency (batch 1, one new token) against the past length, p50 and p99: the sessions model's
  two engines in-process (`in-process/static`, `in-process/concat`, built from the repository as the model builds
  them), through Triton (`stateful/grpc`, `stateful/grpc/concat`: each step a gRPC stream of one request, the only
  way Triton takes a decoupled model's request), the stateless `forward` (`stateless/grpc`, `stateless/http`: the
  client sends the whole cache and gets the presents back) and `noop/grpc` (Triton's own cost of a session step);
  the bytes a step puts on the wire, request and response.
- Decode steps/s of each engine and of the no-op model (the ceiling Triton and the client set on this machine)
  against concurrent sessions at two past lengths (asyncio gRPC client), with each stub's resident memory before,
  at the peak of and after each of two identical load runs (bounded by the pool, nothing kept across runs).
Conditions: one bundled Triton on 127.0.0.1, the client on the same cores; the default preset with max_seq_len
8192, so that a session holds a long past. Each point is bounded; no point starts after `--time-limit` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import importlib
import itertools
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from bench import results as output
from bench.plot import figure, gridded, save
from bench.stack import triton
from bench.timing import Budget, measure, percentiles
from contract import files, names
from contract.config import DEFAULT_PRESET, ModelConfig, preset
from export.progress import Progress
from serving.triton.config import ServingSettings

STATIC_MODEL, CONCAT_MODEL, NOOP = "sessions", "concat_sessions", "noop"  # concat: the sessions model, prefixed
ENGINE_MODELS = {"static": STATIC_MODEL, "concat": CONCAT_MODEL}
# the no-op model too: the most steps/s Triton and the client reach here for the same calls, whatever the
# engine does (the ceiling the engines are read against)
THROUGHPUT_MODELS = {**ENGINE_MODELS, "noop": NOOP}
MODES = (
    *(f"in-process/{engine}" for engine in ENGINE_MODELS),
    *("stateful/grpc", "stateful/grpc/concat", "stateless/grpc", "stateless/http", "noop/grpc"),
)
VARIANTS = ("fp32", "fp32-fused", "fp32-static")
# The concat engine keeps copies of every cache it batches (stacked pasts, the graph's presents, the split-out
# caches, an arena that keeps what it grew): 32 sessions at past 4096 took its stub past 20 GB of a 24 GB
# machine and the kernel killed it (measured). Its points stop at this many cached positions; the static
# engine's memory is its pool.
CONCAT_MAX_POSITIONS = 16 * 4096
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Plan:
    pasts: tuple[int, ...] = (128, 1024, 4096, 8000)
    sessions: tuple[int, ...] = (1, 4, 16, 32)
    steps: int = 100  # timed decode steps per latency point
    throughput_steps: int = 40  # decode steps per session in a throughput point
    throughput_pasts: tuple[int, ...] = (1024, 4096)
    load_runs: int = 2  # identical throughput runs: memory must not grow from one to the next

    @classmethod
    def quick(cls) -> Plan:
        return cls(pasts=(128, 512), sessions=(1, 4), steps=10, throughput_steps=8, throughput_pasts=(32,))


def timed(call: Callable[[], object], runs: int) -> dict:
    """p50 and p99 of `runs` calls after 3 untimed ones."""
    return percentiles(measure(call, Budget(0.0, min_runs=runs, warmup=3, slow_runs=runs)).samples_ms)


def step_inputs(cfg: ModelConfig, past: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The stateless step's inputs: one token and the whole cache of `past` positions."""
    cache = (1, cfg.n_kv_heads, past, cfg.head_dim)
    return {
        names.HIDDEN_STATES: rng.standard_normal((1, 1, cfg.d_model)).astype(np.float32),
        names.ATTENTION_MASK: np.ones((1, past + 1), np.int64),
        **{name: rng.standard_normal(cache).astype(np.float32) for name in names.past_names(cfg.n_layers)},
    }


def infer_inputs(module, arrays: dict[str, np.ndarray]) -> list:
    from tritonclient.utils import np_to_triton_dtype

    return [
        module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype)).set_data_from_numpy(array)
        for name, array in arrays.items()
    ]


def session_inputs(module, cfg: ModelConfig, past: int, rng: np.random.Generator) -> list[list]:
    """A session's prefill of `past` tokens, its one-token step and its end (no token), as `module`'s inputs."""
    tokens = (rng.standard_normal((1, length, cfg.d_model)).astype(np.float32) for length in (past, 1, 0))
    return [infer_inputs(module, {names.HIDDEN_STATES: hidden}) for hidden in tokens]


def wire_bytes(cfg: ModelConfig, past: int) -> dict:
    """Bytes on the wire per step: requests exactly as the clients build them, responses as raw tensors."""
    import tritonclient.http as httpclient
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype

    def grpc_bytes(model: str, arrays: dict[str, np.ndarray], sequence_id: int = 0) -> int:
        request = service_pb2.ModelInferRequest(model_name=model)
        for name, array in arrays.items():
            request.inputs.add(name=name, datatype=np_to_triton_dtype(array.dtype), shape=list(array.shape))
            request.raw_input_contents.append(array.tobytes())
        if sequence_id:
            request.parameters["sequence_id"].int64_param = sequence_id
        return request.ByteSize()

    def http_bytes(arrays: dict[str, np.ndarray], sequence_id: int = 0) -> int:
        sequence = {"sequence_id": sequence_id} if sequence_id else {}
        inputs = infer_inputs(httpclient, arrays)
        return len(httpclient.InferenceServerClient.generate_request_body(inputs, **sequence)[0])

    inputs = step_inputs(cfg, past, np.random.default_rng(0))
    token = {names.HIDDEN_STATES: inputs[names.HIDDEN_STATES]}
    return {
        "stateless_request_grpc": grpc_bytes("forward", inputs),
        "stateless_request_http": http_bytes(inputs),
        "stateful_request_grpc": grpc_bytes(STATIC_MODEL, token, sequence_id=1 << 40),
        "stateful_request_http": http_bytes(token, sequence_id=1 << 40),
        "stateless_response_tensors": token[names.HIDDEN_STATES].nbytes + cfg.kv_cache_bytes(1, past + 1),
        "stateful_response_tensors": token[names.HIDDEN_STATES].nbytes,
    }


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

    prompt, token, end = (
        np.random.default_rng(1).standard_normal((1, n, cfg.d_model)).astype(np.float32) for n in (past, 1, 0)
    )

    def step(hidden: np.ndarray = token, start: bool = False, last: bool = False) -> np.ndarray:
        (result,) = engine.execute([StepRequest(1 << 50, start, last, hidden)])
        if isinstance(result, Exception):
            raise result
        return result

    step(prompt, start=True)
    try:
        return timed(step, runs)
    finally:
        step(end, last=True)


def stateless(server, protocol: str, cfg: ModelConfig, past: int, runs: int) -> dict:
    module = importlib.import_module(f"tritonclient.{protocol}")  # http needs gevent, which a GPU host may lack
    client = module.InferenceServerClient(server.grpc_url if protocol == "grpc" else server.http_url)
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

    module = importlib.import_module(f"tritonclient.{protocol}")
    client = module.InferenceServerClient(server.grpc_url)
    prefill, token, close = session_inputs(module, cfg, past, np.random.default_rng(3))

    def step(inputs: list, **sequence) -> None:
        affinity.infer(client, model, inputs, headers={}, sequence_id=sequence_id, **sequence)

    try:
        step(prefill, sequence_start=True)
        return timed(lambda: step(token), runs)
    finally:
        step(close, sequence_end=True)
        client.close()


async def concurrent_steps(
    url: str, cfg: ModelConfig, model: str, count: int, past: int, steps: int, first_id: int
) -> float:
    """Steps per second of `count` sessions stepping concurrently (prefills and ends not counted)."""
    import tritonclient.grpc.aio as aioclient

    from client import affinity

    client = aioclient.InferenceServerClient(url)
    prefill, token, close = session_inputs(aioclient, cfg, past, np.random.default_rng(4))
    ids = range(first_id, first_id + count)

    def step(sequence_id: int, inputs: list, **sequence):
        return affinity.infer(client, model, inputs, headers={}, sequence_id=sequence_id, **sequence)

    async def decode(sequence_id: int) -> None:
        for _ in range(steps):
            await step(sequence_id, token)

    try:
        await asyncio.gather(*(step(i, prefill, sequence_start=True) for i in ids))
        started = time.perf_counter()
        await asyncio.gather(*(decode(i) for i in ids))
        elapsed = time.perf_counter() - started
        await asyncio.gather(*(step(i, close, sequence_end=True) for i in ids))
    finally:
        await client.close()
    return count * steps / elapsed


def stub_memory(model: str) -> dict[str, int]:
    """Resident bytes of the Python-backend stub(s) of `model` (instances `<model>_<g>_<i>`): `own` its private
    and file-backed pages (its Python, ONNX Runtime, the KV pool), `shared` Triton's shared-memory region's
    pages that carry requests and responses."""
    instance = re.compile(rf"{re.escape(model)}_\d+_\d+")
    kib = dict.fromkeys(("RssAnon", "RssFile", "RssShmem"), 0)
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            arguments = (proc / "cmdline").read_bytes().split(b"\0")
            if arguments[0].endswith(b"triton_python_backend_stub") and any(
                instance.fullmatch(argument.decode(errors="replace")) for argument in arguments
            ):
                status = (proc / "status").read_text()
                for key in kib:
                    kib[key] += int(re.search(rf"{key}:\s+(\d+) kB", status).group(1))
    return {"own_bytes": (kib["RssAnon"] + kib["RssFile"]) * 1024, "shared_bytes": kib["RssShmem"] * 1024}


@contextlib.contextmanager
def peak_memory(model: str) -> Iterator[dict[str, int]]:
    """The largest `stub_memory(model)` while the block runs (sampled 10 times a second)."""
    peak, stop = {"own_bytes": 0, "shared_bytes": 0}, threading.Event()

    def sample() -> None:
        while True:
            for key, value in stub_memory(model).items():
                peak[key] = max(peak[key], value)
            if stop.wait(0.1):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        stop.set()
        sampler.join()


def prepare(root: Path, cfg: ModelConfig, progress: Progress) -> Path:
    """An artifact of `cfg` (reused when it is already there) and a repository with forward, sessions on each
    engine (the concat one as `concat_sessions`) and the no-op model."""
    from export.build import build
    from serving.engine.settings import ENGINE_CONCAT
    from serving.triton.repository import write_repository

    directory = root / "artifact"
    if not all((directory / files.model_filename(v)).is_file() for v in VARIANTS) or ModelConfig.load(directory) != cfg:
        build(cfg, directory, VARIANTS, progress=progress)
    settings = ServingSettings(threads=0, kv_cache_bytes=cfg.kv_cache_bytes(1, cfg.max_seq_len) * 40)
    repository = write_repository(directory, root / "repository", settings, models=("forward", STATIC_MODEL))
    concat = dataclasses.replace(settings, engine=ENGINE_CONCAT)
    write_repository(
        directory, repository, concat, models=(STATIC_MODEL,), prefix=CONCAT_MODEL.removesuffix(STATIC_MODEL)
    )
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
    """A Triton on each repository (its log at the `log_paths` entry when given), started at once (on 2 cores
    about half the wait of one after another); if one fails, those that started are stopped again."""
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


def benchmark(root: Path, plan: Plan, threads: int, deadline: float, progress: Progress) -> dict:
    cfg = dataclasses.replace(preset(DEFAULT_PRESET), max_seq_len=8192)
    repository = prepare(root, cfg, progress)
    engines = {engine: session_engine(repository, model, cfg) for engine, model in ENGINE_MODELS.items()}
    results = {"config": cfg.to_dict(), "plan": dataclasses.asdict(plan)}
    results |= {"pool_bytes": engines["static"].stats().budget_bytes, "weight_bytes": cfg.n_params() * 4}
    with output.during(threads, "onnxruntime") as machine, triton(repository, log_path=root / "triton.log") as server:
        results["latency"] = []
        for k, past in enumerate(plan.pasts):
            if time.monotonic() > deadline:
                break
            sequence, steps = (1 << 40) + 10 * k, plan.steps
            with progress.stage(f"decode step at past {past}"):
                modes = {f"in-process/{e}": in_process(engine, cfg, past, steps) for e, engine in engines.items()}
                modes["stateful/grpc"] = stateful(server, "grpc", cfg, past, steps, sequence)
                modes["stateful/grpc/concat"] = stateful(server, "grpc", cfg, past, steps, sequence + 1, CONCAT_MODEL)
                modes |= {f"stateless/{p}": stateless(server, p, cfg, past, steps) for p in ("grpc", "http")}
                modes["noop/grpc"] = stateful(server, "grpc", cfg, 1, steps, sequence + 3, NOOP)
            results["latency"].append({"past": past, "modes": modes, "bytes": wire_bytes(cfg, past)})
        del engines  # the in-process pools: GBs
        results["memory"] = {
            engine: {"engine": engine, "before": stub_memory(model), "after": []}
            for engine, model in THROUGHPUT_MODELS.items()
        }
        results["throughput"] = throughput_rows(server, cfg, plan, deadline, progress, results["memory"])
    return results | {"machine": machine, "targets": targets(results)}


def throughput_rows(server, cfg: ModelConfig, plan: Plan, deadline: float, progress: Progress, memory: dict) -> list:
    """Each model at each point, over `plan.load_runs` identical runs, its stub's memory after each run. A point
    that fails (the concat engine's stub can run out of memory on this machine) is recorded with its error, and
    that engine's later points are left out."""
    rows, broken = [], set()
    for run, (engine, model) in itertools.product(range(1, plan.load_runs + 1), THROUGHPUT_MODELS.items()):
        for past, (k, count) in itertools.product(plan.throughput_pasts, enumerate(plan.sessions)):
            if time.monotonic() > deadline or engine in broken:
                break
            if engine == "concat" and count * past > CONCAT_MAX_POSITIONS:
                continue
            point = {"run": run, "engine": engine, "sessions": count, "past": past}
            first = (1 << 41) + ((run - 1) << 30) + 100_000 * k + past
            stage = progress.stage(f"run {run}: {engine} engine, {count} sessions at past {past}")
            try:
                with stage, peak_memory(model) as peak:
                    steps = concurrent_steps(server.grpc_url, cfg, model, count, past, plan.throughput_steps, first)
                    point["steps_per_s"] = asyncio.run(steps)
                rows.append(point | {f"peak_{key}": value for key, value in peak.items()})
            except Exception as error:  # recorded: what failed
                broken.add(engine)
                rows.append(point | {"error": f"{type(error).__name__}: {error}"})
        time.sleep(0.5)  # let the sweeper publish and the stub settle after its sessions ended
        memory[engine]["after"].append(stub_memory(model))
    return rows


def rates(results: dict) -> dict[tuple, float]:
    """Each throughput point's steps/s by (engine, sessions, past, run), failed points left out."""
    return {
        (row["engine"], row["sessions"], row["past"], row["run"]): row["steps_per_s"]
        for row in results["throughput"]
        if "error" not in row
    }


def peak_bytes(results: dict, engine: str, key: str) -> int:
    return max((row.get(f"peak_{key}", 0) for row in results["throughput"] if row["engine"] == engine), default=0)


def targets(results: dict) -> dict:
    """The targets, each with its measured numbers and whether it is met (reported, never asserted)."""
    p50 = {row["past"]: {mode: row["modes"][mode]["p50_ms"] for mode in MODES} for row in results["latency"]}
    far = 4096 if 4096 in p50 else max(p50)
    served, budget = p50[far]["stateful/grpc"], p50[far]["in-process/static"] + p50[far]["noop/grpc"] + 0.3
    measured = {"served_static_step": {"past": far, "served_ms": served, "budget_ms": budget, "met": served <= budget}}
    rate, pasts = rates(results), {row["past"] for row in results["throughput"]}
    near, runs = 1024 if 1024 in pasts else min(pasts), sorted({row["run"] for row in results["throughput"]})

    def scaling(engine: str) -> list[float]:
        """16 sessions' steps/s over one session's, in each run."""
        pairs = [(rate.get((engine, 16, near, run)), rate.get((engine, 1, near, run))) for run in runs]
        return [many / one for many, one in pairs if many and one]

    one, many = rate.get(("static", 1, near, 1)), rate.get(("static", 16, near, 1))
    if one and many:
        each = {"ratio_each_run": scaling("static"), "noop_ratio_each_run": scaling("noop")}
        measured["throughput_16_sessions"] = output.goal(many / one, least=3.0, past=near, **each)
    return measured | memory_targets(results) | {"static_wins_everywhere": engine_comparison(results, rate)}


def memory_targets(results: dict) -> dict:
    """The static stub's own memory (its Python, ONNX Runtime, the pool) against the pool, and from one load run
    to the next; Triton's shared-memory region (requests and responses) is reported beside."""
    after = results["memory"]["static"]["after"]
    own, shared = [entry["own_bytes"] for entry in after], [entry["shared_bytes"] for entry in after]
    peak = peak_bytes(results, "static", "own_bytes")
    bound = results["pool_bytes"] + results["weight_bytes"] + 300 * MIB
    growth = own[-1] - own[0] if len(own) > 1 else None
    # the sessions are gone after each run: what one run leaves, the next must reuse (32 MiB of allocator noise)
    flat = growth is not None and growth <= 32 * MIB
    shared_peak = peak_bytes(results, "static", "shared_bytes")
    return {
        "static_stub_memory_bounded": {"peak_bytes": peak, "bound_bytes": bound, "met": 0 < peak <= bound},
        "static_stub_memory_no_growth": {"after_each_run_bytes": own, "growth_bytes": growth, "met": flat},
        "static_stub_shared_memory": {"peak_bytes": shared_peak, "after_each_run_bytes": shared},
    }


def engine_comparison(results: dict, rate: dict[tuple, float]) -> dict:
    """Where the static engine loses to the concat one (p50 latency, the first run's steps/s)."""
    pairs = (("in-process/static", "in-process/concat"), ("stateful/grpc", "stateful/grpc/concat"))
    losses = [
        f"{static} at past {row['past']}"
        for row in results["latency"]
        for static, concat in pairs
        if row["modes"][static]["p50_ms"] > row["modes"][concat]["p50_ms"]
    ]
    for row in (row for row in results["throughput"] if (row["engine"], row["run"]) == ("static", 1)):
        point = f"throughput with {row['sessions']} sessions at past {row['past']}"
        concat = rate.get(("concat", row["sessions"], row["past"], 1))
        if "error" in row:
            losses.append(f"{point} failed: {row['error']}")
        elif concat and row["steps_per_s"] < concat:
            losses.append(point)
    return {"losses": losses, "met": not losses}


def table(results: dict) -> str:
    latency = [
        [row["past"], *(f"{row['modes'][m]['p50_ms']:.2f} / {row['modes'][m]['p99_ms']:.2f}" for m in MODES)]
        for row in results["latency"]
    ]
    lines = [output.table("decode step latency, p50 / p99 ms (batch 1, one new token)", ["past", *MODES], latency)]
    lines += ["", "decode steps/s by concurrent sessions (gRPC, asyncio client), run 1 [run 2]:"]
    rate, points = rates(results), sorted({(row["past"], row["sessions"]) for row in results["throughput"]})
    for engine, past in itertools.product(THROUGHPUT_MODELS, sorted({past for past, _ in points})):
        cells = []
        for count in (count for at, count in points if at == past and (engine, count, past, 1) in rate):
            again = rate.get((engine, count, past, 2))
            cells.append(f"{count}: {rate[engine, count, past, 1]:.0f}" + (f" [{again:.0f}]" if again else ""))
        lines.append(f"  {engine:<7} past {past:<5} " + ", ".join(cells))
    for failed in (row for row in results["throughput"] if "error" in row):
        point = f"{failed['engine']} run {failed['run']}, {failed['sessions']} sessions at past {failed['past']}"
        lines.append(f"  {point}: {failed['error']}")
    for engine, memory in results["memory"].items():
        for key, what in (("own_bytes", "own"), ("shared_bytes", "Triton shared memory")):
            after = ", ".join(f"{entry[key] / MIB:.0f}" for entry in memory["after"])
            before, peak = memory["before"][key] / MIB, peak_bytes(results, engine, key) / MIB
            lines.append(f"{engine} stub {what} MiB: before {before:.0f}, peak {peak:.0f}, after each run {after}")
    return "\n".join(lines)


def targets_text(measured: dict) -> str:
    mark = {True: "met", False: "MISSED"}
    served, bounded = measured["served_static_step"], measured["static_stub_memory_bounded"]
    no_growth, shared = measured["static_stub_memory_no_growth"], measured["static_stub_shared_memory"]
    growth = "n/a" if no_growth["growth_bytes"] is None else f"{no_growth['growth_bytes'] / MIB:+.0f} MiB"
    lines = [
        "targets:",
        f"  served static step at past {served['past']} {served['served_ms']:.2f} ms <= in-process + no-op + 0.3 ms "
        f"= {served['budget_ms']:.2f} ms: {mark[served['met']]}",
    ]
    if scaling := measured.get("throughput_16_sessions"):
        each, noop = (", ".join(f"{r:.1f}x" for r in scaling[key]) for key in ("ratio_each_run", "noop_ratio_each_run"))
        ratio = f"{scaling['ratio']:.1f}x one session (>= 3x): {mark[scaling['met']]}"
        lines += [
            f"  16 sessions at past {scaling['past']} {ratio}",
            f"  (each run: {each or 'n/a'}; the no-op model, Triton's ceiling here: {noop or 'n/a'})",
        ]
    wins = measured["static_wins_everywhere"]
    lines += [
        f"  static stub's own memory at its peak {bounded['peak_bytes'] / MIB:.0f} MiB <= pool + weights + 300 MiB "
        f"= {bounded['bound_bytes'] / MIB:.0f} MiB: {mark[bounded['met']]}",
        f"  static stub's own memory from one load run to the next {growth} (<= 32 MiB): {mark[no_growth['met']]}",
        f"  (Triton's shared memory of the stub: peak {shared['peak_bytes'] / MIB:.0f} MiB, after each run "
        + ", ".join(f"{size / MIB:.0f}" for size in shared["after_each_run_bytes"])
        + ")",
        f"  static engine no slower than concat everywhere: {mark[wins['met']]}"
        + (f" (loses: {', '.join(wins['losses'])})" if wins["losses"] else ""),
    ]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    drawn, (latency, rate) = figure(2, (12, 4.5))
    pasts = [row["past"] for row in results["latency"]]
    for mode in MODES:
        latency.plot(pasts, [row["modes"][mode]["p50_ms"] for row in results["latency"]], marker="o", label=mode)
    latency.set(title="decode step p50", xlabel="past length (tokens)", ylabel="ms", xscale="log", yscale="log")
    latency.set_xticks(pasts, [str(past) for past in pasts])
    points, counts = rates(results), sorted({row["sessions"] for row in results["throughput"]})
    for engine, past in itertools.product(THROUGHPUT_MODELS, sorted({row["past"] for row in results["throughput"]})):
        first = {sessions: value for (e, sessions, p, run), value in points.items() if (e, p, run) == (engine, past, 1)}
        rate.plot(list(first), list(first.values()), marker="o", label=f"{engine} past {past}")
    rate.set(title="stateful gRPC throughput", xlabel="concurrent sessions", ylabel="decode steps / s", xscale="log")
    rate.set_xticks(counts, [str(count) for count in counts])
    for axis in (latency, rate):
        axis.minorticks_off()
    gridded(latency, rate, lines="both")
    return save(drawn, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="two past lengths, few steps, few sessions")
    output.threads_argument(parser, "ONNX Runtime threads in-process")
    parser.add_argument("--time-limit", type=float, default=900.0, help="stop adding points after this many seconds")
    output.output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.time_limit
    with output.work_folder(args.work, "bench-serving-") as root:
        results = benchmark(root, output.planned(args, Plan), args.threads, deadline, Progress())
    return output.report(results, args.out, "serving", plot, table(results) + "\n" + targets_text(results["targets"]))
