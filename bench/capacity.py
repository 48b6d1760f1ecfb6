"""Sessions per GiB: the KV cache's values (fp32, int8, int4) and rows sized to the session against a
full row of max_seq_len per session, on the static engine that sessions runs.

Writes `capacity.json` and `capacity.png` and prints a table.

- Admitted: for each cache and both row policies, an engine with a `--budget-mib` budget (1 GiB)
  made by the serving factory (serving/engine/factory.py: what `python -m serving` loads, with
  `--min-row-positions` max_seq_len for full rows) takes sessions of `--session-tokens` (1,000)
  positions until it refuses one: each a restore of one such session's snapshot (what a prefill
  would leave, without computing it again). Reported: the count, the bytes the rows took, and
  the ratio to fp32 full rows.
- Decode step at past P (`--pasts`, 1,024 and 4,096): one session holding P positions steps one
  token (and is rewound to P, so every step reads P); per cache, `--rounds` rounds taking turns,
  against the PyTorch original's step at the same past (its cache fed back) and the floor: the
  cache's bytes at P read once at the copy bandwidth measured in the same run.
- 16 sessions at `--batch-past` (1,000) decode one token each in one execute(): steps per second
  per cache with sized reservations, and fp32 with the 16 at pasts of four sizes (one pool of one stride:
  they decode in one graph run whatever their lengths).
- Served: the same per cache as `sessions` in a real Triton (`--kv-dtype`, the bundled binary, one
  server per cache, all up at once, taking turns by round): 16 sessions prefilled to `--batch-past`
  stepping concurrently through the asyncio gRPC client, `--served-steps` steps each; steps per second.
- Conditions: the preset at `--max-seq-len` (8,192), its static graphs (`fp32-static`,
  `fp32-static-int8kv`, `fp32-static-int4kv`) on ONNX Runtime's CPU provider with `--threads`
  threads; the machines are shared and noisy, so candidates take turns within each round.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from bench import results as output
from bench.plot import save
from bench.timing import Budget, Timing, copy_bandwidth, measure

CACHES = {"fp32": "fp32-static", "int8": "fp32-static-int8kv", "int4": "fp32-static-int4kv"}
BATCH = 16
# pasts in rows of 256, 512, 1,024 and 2,048 positions (the default sizes), 900 on average
SPREAD_PASTS = (200, 400, 1000, 2000)


def artifact(root: Path, preset_name: str, max_seq_len: int, caches: list[str]) -> Path:
    from contract import files
    from contract.config import preset
    from export.build import build

    directory = root / f"artifact-{preset_name}-{max_seq_len}"
    variants = tuple(CACHES[cache] for cache in caches)
    if not all((directory / files.model_filename(v)).is_file() for v in variants):
        cfg = dataclasses.replace(preset(preset_name), max_seq_len=max_seq_len)
        build(cfg, directory, variants)
    return directory


def engine(directory: Path, cache: str, budget: int, sized: bool, threads: int):
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


def _prompt(cfg, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, length, cfg.d_model)).astype(np.float32)


def _step(served, sequence_id, hidden: np.ndarray, start: bool = False) -> np.ndarray:
    from serving.engine.steps import StepRequest

    (answer,) = served.execute([StepRequest(sequence_id, start, False, hidden)])
    if isinstance(answer, Exception):
        raise answer
    return answer


def admitted(served, tokens: int) -> dict:
    """Sessions of `tokens` positions the engine takes before it refuses one."""
    from serving.engine import errors

    _step(served, "model", _prompt(served.cfg, tokens), start=True)
    blob, count, started = served.snapshot("model"), 1, time.perf_counter()
    while True:
        try:
            served.restore(("copy", count), blob)
        except errors.CacheFull as full:
            refusal = str(full)
            break
        count += 1
    stats = served.stats()
    return {
        "sessions": count,
        "allocated_bytes": stats.allocated_bytes,
        "reserved_bytes": stats.reserved_bytes,
        "held_bytes": stats.held_bytes,
        "budget_bytes": stats.budget_bytes,
        "seconds": time.perf_counter() - started,
        "refusal": refusal,
    }


def decode_steps(
    directory: Path, caches: list[str], pasts: list[int], rounds: int, seconds: float, threads: int
) -> dict:
    """Per past: each cache's one-token step at that past, the PyTorch original's, and the floor."""
    import torch

    from contract import names
    from export.artifacts import load_model
    from export.runners import torch_runner

    original = load_model(directory)
    torch.set_num_threads(threads)
    forward, bandwidth = torch_runner(original), copy_bandwidth(threads)
    results = {}
    for past in pasts:
        engines = {cache: engine(directory, cache, 1 << 30, True, threads) for cache in caches}
        prompt, token = _prompt(original.cfg, past), _prompt(original.cfg, 1, seed=1)
        for served in engines.values():
            _step(served, "s", prompt, start=True)
        reference = forward({names.HIDDEN_STATES: prompt})
        past_feed = {
            names.past_name(i, kind): reference[names.present_name(i, kind)]
            for i in range(original.cfg.n_layers)
            for kind in names.KV_KINDS
        }
        calls = {cache: _decode_call(served, past, token) for cache, served in engines.items()}
        calls["torch"] = lambda token=token, past_feed=past_feed: forward({names.HIDDEN_STATES: token, **past_feed})
        timings = {name: Timing() for name in calls}
        for _ in range(rounds):
            for name, call in calls.items():
                measure(call, Budget(seconds=seconds, min_runs=5), into=timings[name])
        floors = {
            cache: served.cache.bytes_per_position * past / (bandwidth["gbps"] * 1e9) * 1e3
            for cache, served in engines.items()
        }
        results[str(past)] = {
            "timings": {name: timing.to_dict() for name, timing in timings.items()},
            "floor_ms": floors,
            "vs_fp32": {c: timings[c].median_ms / timings["fp32"].median_ms for c in caches if "fp32" in caches},
        }
    return {"bandwidth_gbps": bandwidth["gbps"], "pasts": results}


def _decode_call(served, past: int, token: np.ndarray):
    def call() -> None:
        _step(served, "s", token)
        served.rewind("s", past)

    return call


def batch_throughput(directory: Path, caches: list[str], past: int, rounds: int, seconds: float, threads: int) -> dict:
    """Steps per second of 16 sessions decoding together: at one past per cache, and fp32 at four pasts
    (SPREAD_PASTS), with the decode graph runs a step of the 16 took (one pool: one)."""
    from serving.engine.steps import StepRequest

    setups = {f"{cache}, one size": (cache, [past] * BATCH) for cache in caches}
    setups["fp32, four sizes"] = ("fp32", list(SPREAD_PASTS) * (BATCH // len(SPREAD_PASTS)))
    engines, calls = {}, {}
    for name, (cache, pasts) in setups.items():
        served = engines[name] = engine(directory, cache, 1 << 30, True, threads)
        for i, length in enumerate(pasts):
            _step(served, i, _prompt(served.cfg, length, seed=i), start=True)
        token = _prompt(served.cfg, 1, seed=99)
        steps = [StepRequest(i, False, False, token) for i in range(BATCH)]

        def call(served=served, steps=steps, pasts=pasts) -> None:
            served.execute(steps)
            for i, length in enumerate(pasts):
                served.rewind(i, length)

        calls[name] = call
    runs = {}
    for name, call in calls.items():
        before = engines[name].runs.decode_runs
        call()
        runs[name] = engines[name].runs.decode_runs - before
    timings = {name: Timing() for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            measure(call, Budget(seconds=seconds, min_runs=5), into=timings[name])
    return {
        name: {
            **timings[name].to_dict(),
            "steps_per_s": BATCH / timings[name].median_ms * 1e3,
            "decode_runs_per_step": runs[name],
        }
        for name in engines
    }


def served_throughput(
    root: Path, directory: Path, caches: list[str], past: int, steps: int, rounds: int, threads: int
) -> dict:
    """Per cache, steps per second of 16 concurrent sessions through a real Triton, by round."""
    import asyncio

    from bench.serving import concurrent_steps, start_servers, stop_all
    from contract.config import ModelConfig
    from serving.triton.config import SESSIONS, ServingSettings
    from serving.triton.repository import write_repository

    cfg = ModelConfig.load(directory)
    rates: dict[str, list[float]] = {cache: [] for cache in caches}
    repositories = []
    for cache in caches:
        kv_dtype = "float" if cache == "fp32" else cache
        settings = ServingSettings(threads=threads, kv_cache_bytes=1 << 30, kv_dtype=kv_dtype)
        repositories.append(write_repository(directory, root / f"repository-{cache}", settings, models=(SESSIONS,)))
    started = start_servers(repositories, [root / f"triton-{cache}.log" for cache in caches])
    try:
        servers = dict(zip(caches, started, strict=True))
        for round_index in range(rounds):
            for cache, server in servers.items():
                first_id = 1 + round_index * BATCH
                rate = asyncio.run(concurrent_steps(server.grpc_url, cfg, SESSIONS, BATCH, past, steps, first_id))
                rates[cache].append(rate)
    finally:
        stop_all(started)
    return {cache: {"steps_per_s": float(np.median(values)), "rounds": values} for cache, values in rates.items()}


def benchmark(args: argparse.Namespace, root: Path) -> dict:
    directory = artifact(root, args.preset, args.max_seq_len, args.caches)
    budget = int(args.budget_mib * (1 << 20))
    admission = {}
    for cache in args.caches:
        for sized in (False, True):
            served = engine(directory, cache, budget, sized, args.threads)
            admission[f"{cache}, {'sized' if sized else 'full'} rows"] = admitted(served, args.session_tokens)
            del served  # its pool's memory goes before the next engine's
    baseline = admission.get("fp32, full rows", {}).get("sessions")
    for entry in admission.values():
        entry["vs_fp32_full"] = entry["sessions"] / baseline if baseline else None
    return {
        "conditions": {
            "preset": args.preset,
            "max_seq_len": args.max_seq_len,
            "budget_mib": args.budget_mib,
            "session_tokens": args.session_tokens,
            "threads": args.threads,
            "rounds": args.rounds,
        },
        "admission": admission,
        "decode": decode_steps(directory, args.caches, args.pasts, args.rounds, args.seconds, args.threads),
        "batch": batch_throughput(directory, args.caches, args.batch_past, args.rounds, args.seconds, args.threads),
        "served": _with_ratios(
            served_throughput(
                root, directory, args.caches, args.batch_past, args.served_steps, args.rounds, args.threads
            )
        ),
    }


def _with_ratios(served: dict) -> dict:
    fp32 = served.get("fp32", {}).get("steps_per_s")
    for entry in served.values():
        entry["vs_fp32"] = entry["steps_per_s"] / fp32 if fp32 else None
    return served


def table(results: dict) -> str:
    conditions = results["conditions"]
    lines = [f"sessions of {conditions['session_tokens']} positions in {conditions['budget_mib']:g} MiB:"]
    for name, entry in results["admission"].items():
        ratio = entry["vs_fp32_full"]
        lines.append(f"  {name:18} {entry['sessions']:6d}  ({ratio:.1f}x fp32 full rows)" if ratio else f"  {name}")
    for past, entry in results["decode"]["pasts"].items():
        cells = ", ".join(f"{n} {t['median_ms']:.3f} ms" for n, t in entry["timings"].items())
        ratios = ", ".join(f"{c} {r:.2f}x" for c, r in entry["vs_fp32"].items())
        lines.append(f"decode at P{past}: {cells}; vs fp32-static: {ratios}")
    for name, entry in results["batch"].items():
        runs = entry["decode_runs_per_step"]
        lines.append(f"16 sessions, {name}: {entry['steps_per_s']:.0f} steps/s ({runs} decode graph run(s) a step)")
    for cache, entry in results["served"].items():
        ratio = f" ({entry['vs_fp32']:.2f}x fp32)" if entry["vs_fp32"] else ""
        lines.append(f"served, 16 sessions, {cache}: {entry['steps_per_s']:.0f} steps/s{ratio}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(results["admission"])
    left.barh(names, [results["admission"][n]["sessions"] for n in names])
    left.set_xlabel("sessions admitted")
    left.set_title(
        f"{results['conditions']['session_tokens']}-token sessions in {results['conditions']['budget_mib']:g} MiB"
    )
    pasts = list(results["decode"]["pasts"])
    candidates = list(results["decode"]["pasts"][pasts[0]]["timings"])
    width = 0.8 / len(candidates)
    for i, name in enumerate(candidates):
        values = [results["decode"]["pasts"][p]["timings"][name]["median_ms"] for p in pasts]
        right.bar(np.arange(len(pasts)) + i * width, values, width, label=name)
    right.set_xticks(np.arange(len(pasts)) + 0.4 - width / 2, [f"P{p}" for p in pasts])
    right.set_ylabel("decode step, median ms")
    right.legend()
    right.set_title("one session's decode step")
    figure.tight_layout()
    return save(figure, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    output.output_arguments(parser, served_preset=True)
    parser.add_argument("--max-seq-len", type=int, default=8192)
    parser.add_argument("--budget-mib", type=float, default=1024.0)
    parser.add_argument("--session-tokens", type=int, default=1000)
    parser.add_argument("--caches", type=lambda text: text.split(","), default=list(CACHES), help="fp32,int8,int4")
    parser.add_argument("--pasts", type=lambda text: [int(p) for p in text.split(",")], default=[1024, 4096])
    parser.add_argument("--batch-past", type=int, default=1000)
    parser.add_argument("--served-steps", type=int, default=50, help="decode steps per session per round, served")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5, help="timing per candidate per round")
    parser.add_argument("--threads", type=int, default=2)


def run(args: argparse.Namespace) -> int:
    with output.work_folder(args.work, "bench-capacity-") as root:
        results = benchmark(args, root)
    print(table(results))
    print(output.write(results, args.out, "capacity", plot))
    return 0
