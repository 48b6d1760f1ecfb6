"""Serving: a decode step in-process against Triton stateless and stateful, over gRPC and HTTP.

Writes `serving.json` and `serving.png` and prints a table and the issue's targets.

- latency of one decode step (batch 1, one new token) against the past length, p50 and p99:
  `in-process` (serving.runner.Runner, the cache already in ONNX Runtime's memory, as the stateful
  model keeps it), `stateless` (model `mha`: the client sends the whole cache and gets the presents
  back) and `stateful` (model `mha_session`: the server keeps the cache), each over gRPC and HTTP;
- bytes a step puts on the wire, request and response (the protobuf or the HTTP body);
- decode throughput of the stateful model against the number of concurrent sessions (asyncio
  gRPC client, every session stepping as fast as its answers come back).

Conditions: one Triton from the bundled binary on 127.0.0.1, the same fused fp32 graph everywhere,
ONNX Runtime with `--threads` threads; the client runs on the same machine (on 2 cores it competes
with the server). Each point sends a bounded number of requests; the whole run stops adding points
after `--time-limit` seconds. The config is the default preset with max_seq_len 8192, so that a
session can hold a 4096-token past plus its steps.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from export import artifacts, names
from export.config import DEFAULT_PRESET, ModelConfig, preset
from export.progress import Progress
from export.triton_config import ServingSettings

RESULTS = Path(__file__).parent / "results"
MODES = ("in-process", "stateless/grpc", "stateless/http", "stateful/grpc", "stateful/http")
VARIANTS = ("fp32", "fp32-fused")


@dataclasses.dataclass(frozen=True)
class Plan:
    pasts: tuple[int, ...]
    sessions: tuple[int, ...]
    steps: int  # timed decode steps per latency point
    throughput_steps: int  # decode steps per session in a throughput point
    throughput_past: int

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls(pasts=(128, 512), sessions=(1, 4), steps=10, throughput_steps=8, throughput_past=32)
        pasts, sessions = (128, 512, 1024, 2048, 4096), (1, 2, 4, 8, 16, 32)
        return cls(pasts, sessions, steps=100, throughput_steps=150, throughput_past=128)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    @property
    def passed(self) -> bool:
        return time.monotonic() > self.end


def bench_config() -> ModelConfig:
    return dataclasses.replace(preset(DEFAULT_PRESET), max_seq_len=8192)


def percentiles(samples_ms: list[float]) -> dict:
    return {
        "p50_ms": float(np.percentile(samples_ms, 50)),
        "p99_ms": float(np.percentile(samples_ms, 99)),
        "runs": len(samples_ms),
    }


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
        "stateless_request_grpc": grpc_request_bytes("mha", inputs),
        "stateless_request_http": http_request_bytes(inputs),
        "stateful_request_grpc": grpc_request_bytes("mha_session", new_token, sequence_id=1 << 40),
        "stateful_request_http": http_request_bytes(new_token, sequence_id=1 << 40),
        "stateless_response_tensors": output_bytes + cfg.kv_cache_bytes(1, past + 1),
        "stateful_response_tensors": output_bytes,
    }


# --- latency of one step --------------------------------------------------------------------------------


def in_process(runner, cfg: ModelConfig, past: int, runs: int) -> dict:
    inputs = step_inputs(cfg, past, np.random.default_rng(1))
    cache = [runner.to_device(inputs[name]) for name in runner.past_names]
    hidden, mask = inputs[names.HIDDEN_STATES], inputs[names.ATTENTION_MASK]
    return timed(lambda: runner.run(hidden, mask, cache), runs)


def stateless(server, protocol: str, cfg: ModelConfig, past: int, runs: int) -> dict:
    module = _module(protocol)
    client = module.InferenceServerClient(_url(server, protocol))
    try:
        inputs = infer_inputs(module, step_inputs(cfg, past, np.random.default_rng(2)))
        return timed(lambda: client.infer("mha", inputs), runs)
    finally:
        client.close()


def stateful(
    server, protocol: str, cfg: ModelConfig, past: int, runs: int, sequence_id: int, model: str = "mha_session"
) -> dict:
    """A session prefilled with `past` tokens, then `runs` timed steps (its past grows by `runs`)."""
    module = _module(protocol)
    client = module.InferenceServerClient(_url(server, protocol))
    rng = np.random.default_rng(3)
    prefill = infer_inputs(
        module, {names.HIDDEN_STATES: rng.standard_normal((1, past, cfg.d_model)).astype(np.float32)}
    )
    token = infer_inputs(module, {names.HIDDEN_STATES: rng.standard_normal((1, 1, cfg.d_model)).astype(np.float32)})
    close = infer_inputs(module, {names.HIDDEN_STATES: np.zeros((1, 0, cfg.d_model), np.float32)})
    try:
        client.infer(model, prefill, sequence_id=sequence_id, sequence_start=True)
        return timed(lambda: client.infer(model, token, sequence_id=sequence_id), runs)
    finally:
        client.infer(model, close, sequence_id=sequence_id, sequence_end=True)
        client.close()


def _module(protocol: str):
    import importlib

    return importlib.import_module(f"tritonclient.{protocol}")  # http needs gevent, which a GPU host may lack


def _url(server, protocol: str) -> str:
    return server.grpc_url if protocol == "grpc" else server.http_url


# --- throughput -------------------------------------------------------------------------------------------


async def _sessions(url: str, cfg: ModelConfig, count: int, past: int, steps: int, first_id: int) -> float:
    """Steps per second of `count` sessions stepping concurrently (prefills and ends not counted)."""
    import tritonclient.grpc.aio as aioclient

    client = aioclient.InferenceServerClient(url)
    rng = np.random.default_rng(4)
    prefill = infer_inputs(
        aioclient, {names.HIDDEN_STATES: rng.standard_normal((1, past, cfg.d_model)).astype(np.float32)}
    )
    token = infer_inputs(aioclient, {names.HIDDEN_STATES: rng.standard_normal((1, 1, cfg.d_model)).astype(np.float32)})
    close = infer_inputs(aioclient, {names.HIDDEN_STATES: np.zeros((1, 0, cfg.d_model), np.float32)})
    ids = [first_id + k for k in range(count)]
    try:
        await asyncio.gather(*(client.infer("mha_session", prefill, sequence_id=i, sequence_start=True) for i in ids))

        async def decode(sequence_id: int) -> None:
            for _ in range(steps):
                await client.infer("mha_session", token, sequence_id=sequence_id)

        started = time.perf_counter()
        await asyncio.gather(*(decode(i) for i in ids))
        elapsed = time.perf_counter() - started
        await asyncio.gather(*(client.infer("mha_session", close, sequence_id=i, sequence_end=True) for i in ids))
    finally:
        await client.close()
    return count * steps / elapsed


def throughput(server, cfg: ModelConfig, count: int, plan: Plan, first_id: int) -> dict:
    rate = asyncio.run(_sessions(server.grpc_url, cfg, count, plan.throughput_past, plan.throughput_steps, first_id))
    return {"sessions": count, "steps_per_s": rate}


# --- the run ----------------------------------------------------------------------------------------------


def prepare(root: Path, progress: Progress) -> Path:
    """An artifact of the bench config (reused when it is already there) and its repository."""
    from export.build import build
    from export.repository import write_repository

    cfg, directory = bench_config(), root / "artifact"
    if not (directory / artifacts.model_filename("fp32-fused")).is_file() or ModelConfig.load(directory) != cfg:
        build(cfg, directory, VARIANTS, progress=progress)
    settings = ServingSettings(threads=0, kv_cache_bytes=cfg.kv_cache_bytes(1, cfg.max_seq_len) * 40)
    return write_repository(directory, root / "repository", settings, models=("mha", "mha_session"))


def benchmark(root: Path, plan: Plan, threads: int, deadline: Deadline, progress: Progress) -> dict:
    from serving.launcher import start_triton
    from serving.runner import Runner

    cfg = bench_config()
    repository = prepare(root, progress)
    runner = Runner(repository / "mha" / "1" / artifacts.model_filename("fp32-fused"), cfg, threads=threads)
    results = {"config": cfg.to_dict(), "plan": dataclasses.asdict(plan), "machine": _machine(threads)}
    with progress.stage("start Triton"):
        server = start_triton(repository, log_path=root / "triton.log")
    try:
        results["latency"] = latency_rows(server, runner, cfg, plan, deadline, progress)
        results["throughput"] = throughput_rows(server, cfg, plan, deadline, progress)
    finally:
        server.stop()
    results["targets"] = targets(results)
    return results


def latency_rows(server, runner, cfg: ModelConfig, plan: Plan, deadline: Deadline, progress: Progress) -> list:
    rows = []
    for k, past in enumerate(plan.pasts):
        if deadline.passed:
            break
        with progress.stage(f"decode step at past {past}"):
            row = {"past": past, "modes": {"in-process": in_process(runner, cfg, past, plan.steps)}}
            for protocol in ("grpc", "http"):
                row["modes"][f"stateless/{protocol}"] = stateless(server, protocol, cfg, past, plan.steps)
                sequence_id = (1 << 40) + 10 * k + len(protocol)
                row["modes"][f"stateful/{protocol}"] = stateful(server, protocol, cfg, past, plan.steps, sequence_id)
            row["bytes"] = wire_bytes(cfg, past)
            rows.append(row)
    return rows


def throughput_rows(server, cfg: ModelConfig, plan: Plan, deadline: Deadline, progress: Progress) -> list:
    rows = []
    for k, count in enumerate(plan.sessions):
        if deadline.passed:
            break
        with progress.stage(f"throughput with {count} sessions"):
            rows.append(throughput(server, cfg, count, plan, first_id=(1 << 41) + 1000 * k))
    return rows


def _p50(results: dict, past: int, mode: str) -> float | None:
    row = next((r for r in results["latency"] if r["past"] == past), None)
    return row["modes"][mode]["p50_ms"] if row else None


def targets(results: dict) -> dict:
    """The issue's targets, each with its measured numbers and whether it is met."""
    pasts = [r["past"] for r in results["latency"]]
    far, near = max(pasts), min(pasts)
    speedup = _p50(results, far, "stateless/grpc") / _p50(results, far, "stateful/grpc")
    request_bytes = [r["bytes"]["stateful_request_grpc"] for r in results["latency"]]
    rates = {r["sessions"]: r["steps_per_s"] for r in results["throughput"]}
    many = 16 if 16 in rates else max(rates)
    scaling = rates[many] / rates[1]
    added = _p50(results, near, "stateful/grpc") - _p50(results, near, "in-process")
    added_stateless = _p50(results, near, "stateless/grpc") - _p50(results, near, "in-process")
    return {
        "stateful_vs_stateless_grpc": {"past": far, "speedup": speedup, "target": 3.0, "met": speedup >= 3.0},
        "stateful_request_bytes": {"bytes": request_bytes, "met": len(set(request_bytes)) == 1},
        "throughput_scaling": {"sessions": many, "ratio": scaling, "target": 3.0, "met": scaling >= 3.0},
        "triton_grpc_added_ms": {
            "past": near,
            "stateful_ms": added,
            "stateless_ms": added_stateless,
            "target_ms": 1.0,
            "met": added <= 1.0,
        },
    }


def table(results: dict) -> str:
    header = f"{'past':>6} " + " ".join(f"{mode:>22}" for mode in MODES) + f" {'req bytes less/ful':>20}"
    lines = ["decode step latency, p50 / p99 ms (batch 1, one new token)", header, "-" * len(header)]
    for row in results["latency"]:
        cells = " ".join(f"{row['modes'][m]['p50_ms']:>10.2f} /{row['modes'][m]['p99_ms']:>9.2f}" for m in MODES)
        sizes = f"{row['bytes']['stateless_request_grpc']:>11} /{row['bytes']['stateful_request_grpc']:>6}"
        lines.append(f"{row['past']:>6} {cells} {sizes}")
    lines.append("")
    rates = ", ".join(f"{r['sessions']}: {r['steps_per_s']:.0f}" for r in results["throughput"])
    lines.append(f"stateful gRPC throughput, decode steps/s by concurrent sessions (asyncio client): {rates}")
    return "\n".join(lines)


def targets_text(measured: dict) -> str:
    a, b = measured["stateful_vs_stateless_grpc"], measured["stateful_request_bytes"]
    c, d = measured["throughput_scaling"], measured["triton_grpc_added_ms"]
    mark = {True: "met", False: "MISSED"}
    lines = [
        "targets:",
        f"  stateful gRPC step at past {a['past']} {a['speedup']:.1f}x faster than stateless (>= 3x): {mark[a['met']]}",
        f"  stateful request bytes per step {sorted(set(b['bytes']))} independent of past: {mark[b['met']]}",
        f"  throughput at {c['sessions']} sessions {c['ratio']:.1f}x one session (>= 3x): {mark[c['met']]}",
        f"  Triton gRPC adds {d['stateful_ms']:.2f} ms p50 to an in-process step at past {d['past']} "
        f"(stateful; stateless adds {d['stateless_ms']:.2f} ms) (<= 1 ms): {mark[d['met']]}",
    ]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    figure, (latency, rate) = plt.subplots(1, 2, figsize=(11, 4))
    pasts = [r["past"] for r in results["latency"]]
    for mode in MODES:
        latency.plot(pasts, [r["modes"][mode]["p50_ms"] for r in results["latency"]], marker="o", label=mode)
    latency.set(title="decode step p50", xlabel="past length (tokens)", ylabel="ms", xscale="log", yscale="log")
    latency.set_xticks(pasts, [str(p) for p in pasts])
    latency.minorticks_off()
    latency.legend(fontsize=7)
    sessions = [r["sessions"] for r in results["throughput"]]
    rate.plot(sessions, [r["steps_per_s"] for r in results["throughput"]], marker="o")
    rate.set(title="stateful gRPC throughput", xlabel="concurrent sessions", ylabel="decode steps / s", xscale="log")
    rate.set_xticks(sessions, [str(s) for s in sessions])
    rate.minorticks_off()
    for axis in (latency, rate):
        axis.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _machine(threads: int) -> dict:
    import onnxruntime

    return {
        "cpus": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="two past lengths, few steps, few sessions")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="ONNX Runtime threads in-process")
    parser.add_argument("--time-limit", type=float, default=900.0, help="stop adding points after this many seconds")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where to write results (default {RESULTS})")
    parser.add_argument("--work", type=Path, help="artifact and repository folder (default: a temporary one)")


def run(args: argparse.Namespace) -> int:
    progress = Progress()
    deadline = Deadline(args.time_limit)
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as scratch:
        root = args.work or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        results = benchmark(root, Plan.make(args.quick), args.threads, deadline, progress)
    results["quick"] = args.quick
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / "serving.png")
    print(table(results))
    print(targets_text(results["targets"]))
    print(f"wrote {args.out / 'serving.json'} and {args.out / 'serving.png'}")
    return 0
