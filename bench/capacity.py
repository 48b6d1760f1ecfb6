"""Sessions per GiB: the KV cache's values (fp32, int8, int4) and rows sized to the session against a full row of
max_seq_len each, on the static engine the serving factory makes (what `python -m serving` loads) for the preset at
`--max-seq-len`, on ONNX Runtime's CPU provider; candidates take turns in each round (the machines are shared).

- Admitted: per cache and row policy, an engine of `--budget-mib` takes sessions of `--session-tokens` positions
  until it refuses one, each a restore of one session's snapshot (a prefill's result without computing it again).
- Decode at past P (`--pasts`): one session steps a token and is rewound to P, per cache, against the PyTorch
  original (its cache fed back) and the floor: the cache's bytes at P read once at the copy bandwidth of the run.
- 16 sessions at `--batch-past` decode in one execute() per cache, and fp32 at pasts in rows of four sizes (one pool
  of one stride: one graph run whatever their lengths); served: a real Triton per cache (`--kv-dtype`, all up at
  once), 16 sessions stepping concurrently through the asyncio gRPC client, `--served-steps` steps each.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from bench import results as output
from bench import stack
from bench.plot import figure, gridded, grouped_bars, save
from bench.sessions import against, hidden, start, stepping
from bench.timing import Budget, copy_bandwidth, interleaved, timed

CACHES = {"fp32": "fp32-static", "int8": "fp32-static-int8kv", "int4": "fp32-static-int4kv"}
BATCH = 16
# pasts in rows of 256, 512, 1,024 and 2,048 positions (the default sizes), 900 on average
SPREAD_PASTS = (200, 400, 1000, 2000)


def engine(directory: Path, cache: str, threads: int, budget: int = 1 << 30, sized: bool = True):
    """The static engine as the serving factory makes it (on this host: the CPU)."""
    from contract import files
    from contract.config import ModelConfig
    from serving.engine.factory import session_engine
    from serving.engine.placement import CPU
    from serving.engine.settings import MIN_ROW_POSITIONS, SessionSettings

    cfg = ModelConfig.load(directory)
    minimum = MIN_ROW_POSITIONS if sized else cfg.max_seq_len
    settings = SessionSettings(
        kv_cache_bytes=budget, threads=threads, idle_timeout_seconds=3600.0, min_row_positions=minimum
    )
    return session_engine({CPU: directory / files.model_filename(CACHES[cache])}, cfg, settings, "capacity")


def admitted(directory: Path, cache: str, sized: bool, args: argparse.Namespace) -> dict:
    """Sessions of `--session-tokens` positions an engine of `--budget-mib` takes before it refuses one."""
    from serving.engine import errors

    served = engine(directory, cache, args.threads, int(args.budget_mib * (1 << 20)), sized)
    start(served, "model", hidden(np.random.default_rng(0), args.session_tokens, served.cfg.d_model))
    blob, count, began = served.snapshot("model"), 1, time.perf_counter()
    while True:
        try:
            served.restore(("copy", count), blob)
        except errors.CacheFull as full:
            stats = dataclasses.asdict(served.stats())
            return {"sessions": count, **stats, "seconds": time.perf_counter() - began, "refusal": str(full)}
        count += 1


def decode_at(directory: Path, original, past: int, args: argparse.Namespace, gbps: float) -> dict:
    """Each cache's one-token step at `past`, the PyTorch original's (its cache fed back), and the floor."""
    from contract import names
    from export.runners import torch_runner

    engines = {cache: engine(directory, cache, args.threads) for cache in args.caches}
    calls = {cache: stepping(served, [past], np.random.default_rng(0)) for cache, served in engines.items()}
    rng, layers, forward = np.random.default_rng(0), original.cfg.n_layers, torch_runner(original)
    prompt, token = hidden(rng, past, original.cfg.d_model), hidden(rng, 1, original.cfg.d_model)  # as stepping's
    present = forward({names.HIDDEN_STATES: prompt})
    fed_back = dict(zip(names.past_names(layers), (present[name] for name in names.present_names(layers)), strict=True))
    calls["torch"] = lambda: forward({names.HIDDEN_STATES: token, **fed_back})
    timings = timed(calls, args.rounds, Budget(args.seconds, min_runs=5))
    fp32 = timings["fp32"].median_ms if "fp32" in timings else None
    return {
        "timings": {name: timing.to_dict() for name, timing in timings.items()},
        "floor_ms": {cache: served.cache.bytes_per_position * past / gbps / 1e6 for cache, served in engines.items()},
        "vs_fp32": {cache: timings[cache].median_ms / fp32 for cache in engines if fp32},
    }


def batch_throughput(directory: Path, args: argparse.Namespace) -> dict:
    """Steps per second of 16 sessions in one execute(), and the decode graph runs a step of them took."""
    setups = {f"{cache}, one size": (cache, [args.batch_past] * BATCH) for cache in args.caches}
    setups["fp32, four sizes"] = ("fp32", list(SPREAD_PASTS) * (BATCH // len(SPREAD_PASTS)))
    calls, runs = {}, {}
    for name, (cache, pasts) in setups.items():
        served = engine(directory, cache, args.threads)
        calls[name] = stepping(served, pasts, np.random.default_rng(0))
        before = served.runs.decode_runs
        calls[name]()
        runs[name] = served.runs.decode_runs - before
    timings = timed(calls, args.rounds, Budget(args.seconds, min_runs=5))
    return {
        name: timing.to_dict() | {"steps_per_s": BATCH / timing.median_ms * 1e3, "decode_runs_per_step": runs[name]}
        for name, timing in timings.items()
    }


def served_throughput(root: Path, directory: Path, args: argparse.Namespace) -> dict:
    """Per cache, steps per second of 16 sessions stepping at once through a real Triton, by round."""
    import asyncio

    from bench.serving import concurrent_steps, start_servers, stop_all
    from contract.config import ModelConfig
    from serving.triton.config import SESSIONS, ServingSettings
    from serving.triton.repository import write_repository

    repositories = []
    for cache in args.caches:
        settings = ServingSettings(
            threads=args.threads, kv_cache_bytes=1 << 30, kv_dtype="float" if cache == "fp32" else cache
        )
        repositories.append(write_repository(directory, root / f"repository-{cache}", settings, models=(SESSIONS,)))
    servers = start_servers(repositories, [root / f"triton-{cache}.log" for cache in args.caches])
    cfg, rates = ModelConfig.load(directory), {cache: [] for cache in args.caches}
    try:
        for turn, cache in interleaved(args.rounds, args.caches):
            url, first_id = servers[args.caches.index(cache)].grpc_url, 1 + turn * BATCH
            steps = concurrent_steps(url, cfg, SESSIONS, BATCH, args.batch_past, args.served_steps, first_id)
            rates[cache].append(asyncio.run(steps))
    finally:
        stop_all(servers)
    served = {cache: {"steps_per_s": float(np.median(values)), "rounds": values} for cache, values in rates.items()}
    return against(served, "steps_per_s", "fp32", "vs_fp32")


def benchmark(root: Path, args: argparse.Namespace) -> dict:
    import torch

    from export.artifacts import load_model

    caches = [CACHES[cache] for cache in args.caches]
    directory = stack.artifact(root, args.preset, caches, max_seq_len=args.max_seq_len)
    admission = {  # one engine at a time: its pool's memory goes before the next one's
        f"{cache}, {rows} rows": admitted(directory, cache, rows == "sized", args)
        for cache in args.caches
        for rows in ("full", "sized")
    }
    original = load_model(directory)
    torch.set_num_threads(args.threads)  # the PyTorch original on as many threads as ONNX Runtime
    gbps = copy_bandwidth(args.threads)["gbps"]
    conditions = ("preset", "max_seq_len", "budget_mib", "session_tokens", "rounds")
    return {
        "conditions": {name: getattr(args, name) for name in conditions},
        "admission": against(admission, "sessions", "fp32, full rows", "vs_fp32_full"),
        "decode": {
            "bandwidth_gbps": gbps,
            "pasts": {str(past): decode_at(directory, original, past, args, gbps) for past in args.pasts},
        },
        "batch": batch_throughput(directory, args),
        "served": served_throughput(root, directory, args),
    }


def table(results: dict) -> str:
    conditions = results["conditions"]
    lines = [
        output.table(
            f"sessions of {conditions['session_tokens']} positions in {conditions['budget_mib']:g} MiB:",
            ["cache, rows", "sessions", "vs fp32 full rows"],
            [[name, row["sessions"], f"{row['vs_fp32_full'] or 0:.1f}x"] for name, row in results["admission"].items()],
        )
    ]
    for past, entry in results["decode"]["pasts"].items():
        cells = ", ".join(f"{name} {timing['median_ms']:.3f} ms" for name, timing in entry["timings"].items())
        floors = ", ".join(f"{cache} {ms:.3f} ms" for cache, ms in entry["floor_ms"].items())
        ratios = ", ".join(f"{cache} {ratio:.2f}x" for cache, ratio in entry["vs_fp32"].items())
        lines.append(f"decode at P{past}: {cells}; vs fp32-static: {ratios}; floors: {floors}")
    for name, entry in results["batch"].items():
        runs = entry["decode_runs_per_step"]
        lines.append(f"16 sessions, {name}: {entry['steps_per_s']:.0f} steps/s ({runs} decode graph run(s) a step)")
    for cache, entry in results["served"].items():
        ratio = f" ({entry['vs_fp32']:.2f}x fp32)" if entry["vs_fp32"] else ""
        lines.append(f"served, 16 sessions, {cache}: {entry['steps_per_s']:.0f} steps/s{ratio}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    drawn, (left, right) = figure(2, (12, 4.5))
    conditions, admission, pasts = results["conditions"], results["admission"], results["decode"]["pasts"]
    left.barh(list(admission), [entry["sessions"] for entry in admission.values()])
    title = f"{conditions['session_tokens']}-token sessions in {conditions['budget_mib']:g} MiB"
    left.set(xlabel="sessions admitted", title=title)
    candidates = next(iter(pasts.values()))["timings"]
    medians = {name: [entry["timings"][name]["median_ms"] for entry in pasts.values()] for name in candidates}
    groups = [f"P{past}" for past in pasts]
    grouped_bars(right, groups, medians, ylabel="decode step, median ms", title="one session's decode step")
    gridded(right)
    return save(drawn, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    output.output_arguments(parser, served_preset=True)
    parser.add_argument("--max-seq-len", type=int, default=8192)
    parser.add_argument("--budget-mib", type=float, default=1024.0)
    parser.add_argument("--session-tokens", type=int, default=1000)
    parser.add_argument("--caches", type=lambda text: text.split(","), default=list(CACHES), help="fp32,int8,int4")
    parser.add_argument("--pasts", type=output.counts, default=[1024, 4096])
    parser.add_argument("--batch-past", type=int, default=1000)
    parser.add_argument("--served-steps", type=int, default=50, help="decode steps per session per round, served")
    output.rounds_argument(parser, 5)
    parser.add_argument("--seconds", type=float, default=0.5, help="timing per candidate per round")
    output.threads_argument(parser, "ONNX Runtime threads", 2)


def run(args: argparse.Namespace) -> int:
    with output.work_folder(args.work, "bench-capacity-") as root, output.during(args.threads, "onnxruntime") as facts:
        results = benchmark(root, args) | {"machine": facts}
    return output.report(results, args.out, "capacity", plot, table(results))
