"""Session operations on the static engine, in process: snapshot, restore, fork and rewind of a
session against its length, next to what a server without them does instead (prefill the same
tokens again: the served ONNX graph, and the PyTorch original) and the memory-bandwidth floor.

Writes `sessions.json` and `sessions.png` and prints a table.

- per length: the blob's bytes; the median and p90 of each operation; the floor (the session's
  used positions read once and written once, the blob's bytes twice, at the copy bandwidth
  measured in the same run); the ratios prefill / restore, snapshot / floor and restore / floor (a
  restore on the CPU copies the used positions into the row, as kv_pool.py does).
- Conditions: the preset's fp32-static graph on ONNX Runtime's CPU provider with `--threads`
  threads, a cache of 4 full rows of max_seq_len positions, one session at a time; `--rounds` rounds, the
  operations taking turns within each round (the machines are shared and noisy).
- Served (`--served-lengths`): the same model as `sessions` in a real Triton (the bundled
  binary, the static engine on the CPU), called with the gRPC client: the time to the first token
  of a session whose prompt is `length` tokens, prefilled (`cold`: START with the prompt) against
  started from that prompt's snapshot (`restore`, the blob sent with the START, then one token)
  forked from a live session holding it (`fork`: a row copy inside the server), and started from
  it as a named prefix (`prefix`: put once, each session a copy of its row); and a snapshot's time
  and bytes. Rounds interleaved as above.
- What an operation costs the other sessions: 8 sessions of `--others-past` positions decode one
  token each in one execute(), alone, and after an operation on a session of the longest length
  (sessions runs a batch's operations before its steps, so the steps wait for it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench import results as output
from bench.plot import save
from bench.timing import Budget, Timing, copy_bandwidth, measure
from contract import files
from contract.config import preset

VARIANT = "fp32-static"
OPERATIONS = ("prefill_torch", "prefill_onnx", "snapshot", "restore", "fork", "rewind")


def artifact(root: Path, preset_name: str) -> Path:
    from export.build import build

    directory = root / f"artifact-{preset_name}"
    if not (directory / files.model_filename(VARIANT)).is_file():
        build(preset(preset_name), directory, (VARIANT,))
    return directory


def engine(directory: Path, threads: int, rows: int = 4):
    """The static engine over `rows` full rows of max_seq_len positions, opened at the start."""
    from contract.config import ModelConfig
    from serving.engine.cache_manager import CacheManager
    from serving.engine.kv_pool import KVPool
    from serving.engine.ort import ort_session
    from serving.engine.static_engine import StaticSessionEngine

    cfg = ModelConfig.load(directory)
    session = ort_session(directory / files.model_filename(VARIANT), threads=threads)
    budget = rows * KVPool.row_bytes_for(session, cfg, cfg.max_seq_len)
    cache = CacheManager(session, cfg, budget, sizes=(cfg.max_seq_len,), full_rows=True)
    return StaticSessionEngine(cache, idle_timeout=3600.0)


def operations(served, original, length: int) -> dict:
    """Each operation as a call; the session `base` holds `length` positions throughout."""
    from contract import names
    from export.runners import torch_runner
    from serving.engine.steps import StepRequest

    d = served.cfg.d_model
    prompt = np.random.default_rng(0).standard_normal((1, length, d)).astype(np.float32)
    (answer,) = served.execute([StepRequest("base", True, False, prompt)])
    assert not isinstance(answer, Exception), answer
    blob = served.snapshot("base")
    row_bytes = served.stats().reserved_bytes  # the one live session's row, all of max_seq_len
    torch_forward = torch_runner(original)

    def rewind() -> None:  # what a rewind costs does not depend on how far: it sets the row's length
        served.rewind("base", length)

    return {
        "calls": {
            "prefill_torch": lambda: torch_forward({names.HIDDEN_STATES: prompt}),
            "prefill_onnx": lambda: served.execute([StepRequest("cold", True, False, prompt)]),
            "snapshot": lambda: served.snapshot("base"),
            "restore": lambda: served.restore("restored", blob),
            "fork": lambda: served.fork("base", "forked"),
            "rewind": rewind,
        },
        "blob_bytes": len(blob),
        "row_bytes": row_bytes,
    }


def benchmark(
    root: Path,
    preset_name: str,
    lengths: list[int],
    rounds: int,
    seconds: float,
    threads: int,
    others_past: int,
    others_seconds: float = 0.3,
) -> dict:
    import torch

    from export.artifacts import load_model

    directory = artifact(root, preset_name)
    original = load_model(directory)
    torch.set_num_threads(threads)  # the PyTorch original on as many threads as ONNX Runtime
    bandwidth = copy_bandwidth(threads)
    rows = []
    for length in lengths:
        served = engine(directory, threads)
        measured = operations(served, original, length)
        timings = {name: Timing() for name in OPERATIONS}
        for _ in range(rounds):
            for name in OPERATIONS:
                measure(measured["calls"][name], Budget(seconds=seconds, min_runs=3), into=timings[name])
        floor_ms = 2 * measured["blob_bytes"] / (bandwidth["gbps"] * 1e9) * 1e3  # the used positions read, written
        rows.append(
            {
                "length": length,
                "blob_bytes": measured["blob_bytes"],
                "row_bytes": measured["row_bytes"],
                "floor_ms": floor_ms,
                "operations": {name: timing.to_dict() for name, timing in timings.items()},
                "prefill_onnx_over_restore": timings["prefill_onnx"].median_ms / timings["restore"].median_ms,
                "prefill_torch_over_restore": timings["prefill_torch"].median_ms / timings["restore"].median_ms,
                "snapshot_over_floor": timings["snapshot"].median_ms / floor_ms,
                "restore_over_floor": timings["restore"].median_ms / floor_ms,
            }
        )
    return {
        "preset": preset_name,
        "variant": VARIANT,
        "threads": threads,
        "rounds": rounds,
        "bandwidth": bandwidth,
        "lengths": rows,
        "cost_to_others": cost_to_others(directory, threads, rounds, others_past, max(lengths), others_seconds),
    }


OTHERS = 8


def cost_to_others(directory: Path, threads: int, rounds: int, past: int, length: int, seconds: float = 0.3) -> dict:
    """The decode step of OTHERS sessions alone and after each operation on a `length`-position one,
    each timed for `seconds` a round."""
    from serving.engine.steps import StepRequest

    served = engine(directory, threads, rows=OTHERS + 4)
    d, past = served.cfg.d_model, min(past, served.cfg.max_seq_len - 1)
    rng = np.random.default_rng(7)
    for i in range(OTHERS):
        served.execute([StepRequest(i, True, False, rng.standard_normal((1, past, d)).astype(np.float32))])
    served.execute([StepRequest("big", True, False, rng.standard_normal((1, length, d)).astype(np.float32))])
    blob = served.snapshot("big")
    tokens = [StepRequest(i, False, False, rng.standard_normal((1, 1, d)).astype(np.float32)) for i in range(OTHERS)]

    def steps() -> None:
        served.execute(tokens)
        for i in range(OTHERS):  # back to `past`: every run steps the same lengths
            served.rewind(i, past)

    before = {
        "alone": lambda: None,
        "snapshot": lambda: served.snapshot("big"),
        "restore": lambda: served.restore("restored", blob),
        "fork": lambda: served.fork("big", "forked"),
        "rewind": lambda: served.rewind("big", length),
    }
    timings = {name: Timing() for name in before}
    for _ in range(rounds):
        for name, operation in before.items():

            def call(operation=operation) -> None:
                operation()
                steps()

            measure(call, Budget(seconds=seconds, min_runs=5), into=timings[name])
    alone = timings["alone"].median_ms
    return {
        "others": OTHERS,
        "past": past,
        "length": length,
        "steps_ms": {name: t.to_dict() for name, t in timings.items()},
        "added_ms": {name: t.median_ms - alone for name, t in timings.items() if name != "alone"},
    }


def served(root: Path, preset_name: str, lengths: list[int], rounds: int, threads: int) -> list[dict]:
    """Time to first token, cold against restored, and snapshots, through Triton (see the module's doc)."""
    from client import Client
    from serving.host.launcher import start_triton
    from serving.triton.config import SESSIONS, ServingSettings
    from serving.triton.repository import write_repository

    directory = artifact(root, preset_name)
    settings = ServingSettings(threads=threads, kv_cache_bytes=8 * preset(preset_name).kv_cache_bytes(1, 4096))
    repository = write_repository(directory, root / "repository", settings, models=(SESSIONS,))
    server = start_triton(repository)
    try:
        with Client(server.grpc_url, timeout=300) as client:
            return [_served_length(client, length, rounds) for length in lengths]
    finally:
        server.stop()


def _served_length(client, length: int, rounds: int) -> dict:
    d = client.metadata("sessions").d_model
    rng = np.random.default_rng(length)
    prompt = rng.standard_normal((1, length, d)).astype(np.float32)
    with client.session() as source:
        source.step(prompt[:, :-1])
        blob = source.snapshot()
        timings = {name: Timing() for name in ("cold", "restore", "fork", "prefix", "snapshot")}
        client.put_prefix("bench", prompt[:, :-1])

        def cold() -> None:
            with client.session() as session:
                session.step(prompt)  # its answer holds the prompt's last token: the first token out

        def restored() -> None:  # the snapshot holds all but the prompt's last token, which gives the first out
            with client.session(restore=blob) as session:
                session.step(prompt[:, -1:])

        def forked() -> None:  # what a prefix kept in the server gives: a row copy, no bytes sent
            with source.fork() as session:
                session.step(prompt[:, -1:])

        def from_prefix() -> None:  # the named prefix: prefilled once, each session a copy of its row
            with client.session(prefix="bench") as session:
                session.step(prompt[:, -1:])

        calls = {"cold": cold, "restore": restored, "fork": forked, "prefix": from_prefix, "snapshot": source.snapshot}
        for _ in range(rounds):
            for name, call in calls.items():
                measure(call, Budget(seconds=0.0, min_runs=3, slow_runs=3), into=timings[name])
        client.delete_prefix("bench")
    row = {"length": length, "blob_bytes": len(blob), **{name: t.to_dict() for name, t in timings.items()}}
    row["cold_over_restore"] = timings["cold"].median_ms / timings["restore"].median_ms
    row["cold_over_fork"] = timings["cold"].median_ms / timings["fork"].median_ms
    row["cold_over_prefix"] = timings["cold"].median_ms / timings["prefix"].median_ms
    return row


def table(results: dict) -> str:
    lines = [
        f"session operations, {results['preset']} {results['variant']} on the CPU, {results['threads']} thread(s), "
        f"{results['bandwidth']['gbps']:.1f} GB/s copy bandwidth (medians, ms)",
        f"{'length':>7} {'blob MB':>8} " + " ".join(f"{name:>13}" for name in OPERATIONS) + f" {'floor':>7}"
        f" {'prefill/restore':>16} {'snapshot/floor':>15} {'restore/floor':>14}",
    ]
    for row in results["lengths"]:
        ops = " ".join(f"{row['operations'][name]['median_ms']:>13.3f}" for name in OPERATIONS)
        lines.append(
            f"{row['length']:>7} {row['blob_bytes'] / 1e6:>8.2f} {ops} {row['floor_ms']:>7.3f}"
            f" {row['prefill_onnx_over_restore']:>15.1f}x {row['snapshot_over_floor']:>14.1f}x"
            f" {row['restore_over_floor']:>13.1f}x"
        )
    cost = results["cost_to_others"]
    lines.append(
        f"the decode step of {cost['others']} other sessions at past {cost['past']}: "
        f"{cost['steps_ms']['alone']['median_ms']:.2f} ms alone; added by an operation on a {cost['length']}-position "
        "session before it: " + ", ".join(f"{name} {ms:+.2f} ms" for name, ms in cost["added_ms"].items())
    )
    if results.get("served"):
        lines += [
            "served (Triton, gRPC): time to first token, cold prefill vs from the prompt's snapshot (medians, ms)",
            f"{'length':>7} {'blob MB':>8} {'cold':>10} {'restore':>10} {'cold/restore':>13} {'fork':>8}"
            f" {'cold/fork':>10} {'prefix':>8} {'cold/prefix':>12} {'snapshot':>10}",
        ]
        for row in results["served"]:
            lines.append(
                f"{row['length']:>7} {row['blob_bytes'] / 1e6:>8.2f} {row['cold']['median_ms']:>10.1f}"
                f" {row['restore']['median_ms']:>10.1f} {row['cold_over_restore']:>12.1f}x"
                f" {row['fork']['median_ms']:>8.1f} {row['cold_over_fork']:>9.1f}x"
                f" {row['prefix']['median_ms']:>8.1f} {row['cold_over_prefix']:>11.1f}x"
                f" {row['snapshot']['median_ms']:>10.1f}"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    lengths = [row["length"] for row in results["lengths"]]
    for name in OPERATIONS:
        axis.plot(lengths, [row["operations"][name]["median_ms"] for row in results["lengths"]], marker="o", label=name)
    axis.plot(lengths, [row["floor_ms"] for row in results["lengths"]], "k--", label="floor (blob read + written)")
    axis.set(xscale="log", yscale="log", xlabel="session length (positions)", ylabel="median ms")
    axis.set_title(f"session operations, {results['preset']} {results['variant']} (CPU)")
    axis.legend(fontsize=8)
    return save(figure, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lengths", default="256,1024,4096", help="session lengths, comma-separated (default: %(default)s)"
    )
    output.rounds_argument(parser, 3)
    parser.add_argument("--seconds", type=float, default=0.5, help="per operation per round (default: %(default)s)")
    output.threads_argument(parser, "ONNX Runtime threads", 2)
    parser.add_argument("--others-past", type=int, default=1024, help="the other sessions' past (default: %(default)s)")
    parser.add_argument(
        "--others-seconds",
        type=float,
        default=0.3,
        help="per operation per round, the other sessions' steps after it (default: %(default)s)",
    )
    parser.add_argument(
        "--served-lengths",
        default="1024,4096",
        help="prompt lengths through Triton, comma-separated; empty: none (default: %(default)s)",
    )
    output.output_arguments(parser, served_preset=True)


def run(args: argparse.Namespace) -> int:
    lengths = [int(text) for text in args.lengths.split(",")]
    served_lengths = [int(text) for text in args.served_lengths.split(",") if text]
    with output.work_folder(args.work, "bench-sessions-") as root:
        results = benchmark(
            root, args.preset, lengths, args.rounds, args.seconds, args.threads, args.others_past, args.others_seconds
        )
        results["served"] = (
            served(root, args.preset, served_lengths, args.rounds, args.threads) if served_lengths else []
        )
    wrote = output.write(results, args.out, "sessions", plot)
    print(table(results))
    print(wrote)
    return 0
