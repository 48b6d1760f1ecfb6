"""Session operations on the static engine against the session's length: snapshot, restore, fork and rewind, next
to what a server without them does instead (prefill the same tokens again: the served ONNX graph, the PyTorch
original) and the floor (the blob read and written once at the copy bandwidth measured in the same run).

- In process: the preset's fp32-static graph on ONNX Runtime's CPU provider, a cache of 4 full rows of max_seq_len,
  one session at a time, `--rounds` interleaved rounds (the machines are shared and noisy).
- Cost to the others: 8 sessions at `--others-past` decode one token each in one execute(), alone and after an
  operation on a session of the longest length (the engine runs a batch's operations before its steps).
- Served (`--served-lengths`): in a real Triton with the gRPC client, the time to the first token of a prompt
  prefilled (cold), restored from its snapshot (the blob sent with the START), forked from a live session holding
  it (a row copy in the server) and started from it as a named prefix; a snapshot's time.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench import results as output
from bench.plot import figure, gridded, save
from bench.stack import artifact, triton
from bench.timing import Budget, copy_bandwidth, timed
from contract import files

VARIANT = "fp32-static"
OPERATIONS = ("prefill_torch", "prefill_onnx", "snapshot", "restore", "fork", "rewind")
SERVED = ("cold", "restore", "fork", "prefix", "snapshot")
OTHERS = 8


def hidden(rng: np.random.Generator, length: int, d_model: int) -> np.ndarray:
    return rng.standard_normal((1, length, d_model)).astype(np.float32)


def against(entries: dict[str, dict], key: str, baseline: str, ratio: str) -> dict[str, dict]:
    """Each entry's `key` over the `baseline` entry's, as its `ratio` (None without that entry)."""
    base = entries[baseline][key] if baseline in entries else None
    for entry in entries.values():
        entry[ratio] = entry[key] / base if base else None
    return entries


def engine(directory: Path, threads: int, rows: int = 4):
    """The static engine over `rows` full rows of max_seq_len positions."""
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


def start(served, sequence_id: object, prompt: np.ndarray) -> None:
    """A session started on the engine with `prompt`; the engine's error raised."""
    from serving.engine.steps import StepRequest

    (answer,) = served.execute([StepRequest(sequence_id, True, False, prompt)])
    if isinstance(answer, Exception):
        raise answer


def stepping(served, pasts: Sequence[int], rng: np.random.Generator) -> Callable[..., None]:
    """Sessions 0, 1, ... started at `pasts`; a call that runs `before` (an operation, if given), then steps them
    one token each in one execute() and rewinds them to their pasts, so that every call steps the same lengths."""
    from serving.engine.steps import StepRequest

    for index, past in enumerate(pasts):
        start(served, index, hidden(rng, past, served.cfg.d_model))
    tokens = [StepRequest(index, False, False, hidden(rng, 1, served.cfg.d_model)) for index in range(len(pasts))]

    def step(before: Callable[[], object] | None = None) -> None:
        if before:
            before()
        served.execute(tokens)
        for index, past in enumerate(pasts):
            served.rewind(index, past)

    return step


def operations(served, sequence_id: object, length: int) -> tuple[bytes, dict[str, Callable[[], object]]]:
    """The snapshot of a session holding `length` positions, and each operation on it as a call."""
    blob = served.snapshot(sequence_id)
    return blob, {
        "snapshot": lambda: served.snapshot(sequence_id),
        "restore": lambda: served.restore("restored", blob),
        "fork": lambda: served.fork(sequence_id, "forked"),
        "rewind": lambda: served.rewind(sequence_id, length),  # as costly however far: it sets the row's length
    }


def length_row(served, forward, length: int, rounds: int, seconds: float, gbps: float) -> dict:
    """Each operation on a session holding `length` positions, and the prefills they spare."""
    from contract import names
    from serving.engine.steps import StepRequest

    prompt = hidden(np.random.default_rng(0), length, served.cfg.d_model)
    start(served, "base", prompt)
    blob, calls = operations(served, "base", length)
    calls["prefill_torch"] = lambda: forward({names.HIDDEN_STATES: prompt})
    calls["prefill_onnx"] = lambda: served.execute([StepRequest("cold", True, False, prompt)])
    timings = timed({name: calls[name] for name in OPERATIONS}, rounds, Budget(seconds))
    median = {name: timing.median_ms for name, timing in timings.items()}
    floor_ms = 2 * len(blob) / gbps / 1e6
    return {
        "length": length,
        "blob_bytes": len(blob),
        "floor_ms": floor_ms,
        "operations": {name: timing.to_dict() for name, timing in timings.items()},
        "prefill_onnx_over_restore": median["prefill_onnx"] / median["restore"],
        "prefill_torch_over_restore": median["prefill_torch"] / median["restore"],
        "snapshot_over_floor": median["snapshot"] / floor_ms,
        "restore_over_floor": median["restore"] / floor_ms,
    }


def cost_to_others(directory: Path, args: argparse.Namespace, length: int) -> dict:
    """The decode step of OTHERS sessions, alone and after each operation on a `length`-position one."""
    served = engine(directory, args.threads, rows=OTHERS + 4)
    past = min(args.others_past, served.cfg.max_seq_len - 1)
    rng = np.random.default_rng(7)
    steps = stepping(served, [past] * OTHERS, rng)
    start(served, "big", hidden(rng, length, served.cfg.d_model))
    before = {"alone": None, **operations(served, "big", length)[1]}
    calls = {name: functools.partial(steps, operation) for name, operation in before.items()}
    timings = timed(calls, args.rounds, Budget(args.others_seconds, min_runs=5))
    alone = timings["alone"].median_ms
    return {
        "others": OTHERS,
        "past": past,
        "length": length,
        "steps_ms": {name: timing.to_dict() for name, timing in timings.items()},
        "added_ms": {name: timing.median_ms - alone for name, timing in timings.items() if name != "alone"},
    }


def served_length(client, length: int, rounds: int) -> dict:
    """The time to the first token of a `length`-token prompt through Triton: cold, restored, forked, from a prefix."""
    prompt = hidden(np.random.default_rng(length), length, client.metadata("sessions").d_model)
    held, last = prompt[:, :-1], prompt[:, -1:]  # the last token's answer is the first token out

    def first_token(opened: Callable, tokens: np.ndarray = last) -> Callable[[], None]:
        def call() -> None:
            with opened() as session:
                session.step(tokens)

        return call

    with client.session() as source:
        source.step(held)
        blob = source.snapshot()
        client.put_prefix("bench", held)
        calls = {
            "cold": first_token(client.session, prompt),
            "restore": first_token(lambda: client.session(restore=blob)),
            "fork": first_token(source.fork),
            "prefix": first_token(lambda: client.session(prefix="bench")),
            "snapshot": source.snapshot,
        }
        timings = timed(calls, rounds, Budget(seconds=0.0, min_runs=3, slow_runs=3))
        client.delete_prefix("bench")
    cold = timings["cold"].median_ms
    return {
        "length": length,
        "blob_bytes": len(blob),
        **{name: timing.to_dict() for name, timing in timings.items()},
        **{f"cold_over_{name}": cold / timings[name].median_ms for name in ("restore", "fork", "prefix")},
    }


def benchmark(root: Path, args: argparse.Namespace) -> dict:
    import torch

    from client import Client
    from contract.config import preset
    from export.artifacts import load_model
    from export.runners import torch_runner
    from serving.triton.config import SESSIONS, ServingSettings
    from serving.triton.repository import write_repository

    lengths, served_lengths = output.counts(args.lengths), output.counts(args.served_lengths)
    directory = artifact(root, args.preset, (VARIANT,))
    torch.set_num_threads(args.threads)  # the PyTorch original on as many threads as ONNX Runtime
    forward, bandwidth = torch_runner(load_model(directory)), copy_bandwidth(args.threads)
    results = {
        "preset": args.preset,
        "variant": VARIANT,
        "rounds": args.rounds,
        "bandwidth": bandwidth,
        "lengths": [
            length_row(engine(directory, args.threads), forward, length, args.rounds, args.seconds, bandwidth["gbps"])
            for length in lengths
        ],
        "cost_to_others": cost_to_others(directory, args, max(lengths)),
        "served": [],
    }
    if served_lengths:
        settings = ServingSettings(threads=args.threads, kv_cache_bytes=8 * preset(args.preset).kv_cache_bytes(1, 4096))
        repository = write_repository(directory, root / "repository", settings, models=(SESSIONS,))
        with triton(repository) as server, Client(server.grpc_url, timeout=300) as client:
            results["served"] = [served_length(client, length, args.rounds) for length in served_lengths]
    return results


def table(results: dict) -> str:
    ratios = ("prefill_onnx_over_restore", "snapshot_over_floor", "restore_over_floor")
    in_process = output.table(
        f"session operations, {results['preset']} {VARIANT} on the CPU, {results['machine']['threads']} thread(s), "
        f"{results['bandwidth']['gbps']:.1f} GB/s copy bandwidth (medians, ms)",
        ["length", "blob MB", *OPERATIONS, "floor", "prefill/restore", "snapshot/floor", "restore/floor"],
        [
            [row["length"], f"{row['blob_bytes'] / 1e6:.2f}"]
            + [f"{row['operations'][name]['median_ms']:.3f}" for name in OPERATIONS]
            + [f"{row['floor_ms']:.3f}", *(f"{row[ratio]:.1f}x" for ratio in ratios)]
            for row in results["lengths"]
        ],
    )
    cost = results["cost_to_others"]
    added = ", ".join(f"{name} {ms:+.2f} ms" for name, ms in cost["added_ms"].items())
    lines = [
        in_process,
        f"the decode step of {cost['others']} other sessions at past {cost['past']}: "
        f"{cost['steps_ms']['alone']['median_ms']:.2f} ms alone; added by an operation on a {cost['length']}-position "
        f"session before it: {added}",
    ]
    if results["served"]:
        faster = ("restore", "fork", "prefix")
        lines.append(
            output.table(
                "served (Triton, gRPC): time to the first token, cold prefill vs started from the prompt (medians, ms)",
                ["length", "blob MB", *SERVED, *(f"cold/{name}" for name in faster)],
                [
                    [row["length"], f"{row['blob_bytes'] / 1e6:.2f}"]
                    + [f"{row[name]['median_ms']:.1f}" for name in SERVED]
                    + [f"{row[f'cold_over_{name}']:.1f}x" for name in faster]
                    for row in results["served"]
                ],
            )
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    drawn, (axis,) = figure()
    rows = results["lengths"]
    lengths = [row["length"] for row in rows]
    for name in OPERATIONS:
        axis.plot(lengths, [row["operations"][name]["median_ms"] for row in rows], marker="o", label=name)
    axis.plot(lengths, [row["floor_ms"] for row in rows], "k--", label="floor (blob read + written)")
    title = f"session operations, {results['preset']} {VARIANT} (CPU)"
    axis.set(xscale="log", yscale="log", xlabel="session length (positions)", ylabel="median ms", title=title)
    gridded(axis)
    return save(drawn, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", default="256,1024,4096", help="session lengths (default: %(default)s)")
    output.rounds_argument(parser, 3)
    parser.add_argument("--seconds", type=float, default=0.5, help="per operation per round (default: %(default)s)")
    output.threads_argument(parser, "ONNX Runtime threads", 2)
    parser.add_argument("--others-past", type=int, default=1024, help="the other sessions' past (default: %(default)s)")
    others = "per operation and the others' steps after it, per round (default: %(default)s)"
    parser.add_argument("--others-seconds", type=float, default=0.3, help=others)
    parser.add_argument(
        "--served-lengths", default="1024,4096", help="through Triton, empty: none (default: %(default)s)"
    )
    output.output_arguments(parser, served_preset=True)


def run(args: argparse.Namespace) -> int:
    with output.work_folder(args.work, "bench-sessions-") as root, output.during(args.threads, "onnxruntime") as facts:
        results = benchmark(root, args) | {"machine": facts}
    return output.report(results, args.out, "sessions", plot, table(results))
