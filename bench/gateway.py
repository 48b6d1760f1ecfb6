"""The gateway's cost: sessions stepping through its HTTP API against the gRPC client library direct.

Writes `gateway.json` and `gateway.png` and prints a table.

One Triton (the bundled binary, the served default preset) and one gateway (`python -m
serving.gateway`, a process of its own, auth on) on 127.0.0.1. `--sessions` sessions step
concurrently, one token per step, in three modes that take turns round by round (the machine's noise
falls on all of them alike):

- `gateway/json`: `POST /v1/sessions/{id}/step` with the token as nested JSON lists, the answer too;
- `gateway/b64`: the same with base64 tensor objects both ways (`?encoding=b64`);
- `grpc/client`: `client.AsyncClient` straight to Triton's gRPC port (the library as a direct caller
  uses it: `validate=True`).

Per mode: steps/s over the rounds, the ratio to `grpc/client`, and CPU per step of the load
generator (this process: the HTTP client, or the gRPC client library itself), of the gateway
process serving it (its worker processes included) and of Triton (its server and model processes).
Everything shares the machine's cores, so the CPU columns say where the time goes. Bounded: the number
of steps is fixed by the arguments.

`--compare NAME:SETTING=VALUE,...` adds a gateway of other settings (SERVING_* variables, e.g.
`granian:http_server=granian` or `w2:workers=2`) in front of the same Triton, stepped in the same rounds as
modes `NAME/json` and `NAME/b64`: choices are measured side by side, never across runs. Every gateway sends a
session's requests to Triton's gRPC port, each a stream of one request (the session model is decoupled:
client/affinity.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np

from bench import results as output
from bench.plot import save
from bench.stack import KEY, Connection, cpu_seconds, gateway_process
from contract import files

DEFAULT_GATEWAY = "gateway"  # the gateway of the default settings (and --workers): the target is its
ENCODINGS = ("json", "b64")
MODES = (*(f"{DEFAULT_GATEWAY}/{encoding}" for encoding in ENCODINGS), "grpc/client")  # without --compare


def prepare(root: Path, preset_name: str) -> Path:
    """The preset's repository under `root`, from its artifact there (built when missing or stale)."""
    from contract.config import ModelConfig, preset
    from contract.deployment import ServingSettings
    from serving.triton.cli import export_to
    from serving.triton.repository import write_repository

    cfg, artifacts, settings = preset(preset_name), root / "artifacts", ServingSettings(threads=1)
    if (artifacts / files.MODEL_CONFIG_FILENAME).is_file() and ModelConfig.load(artifacts) == cfg:
        return write_repository(artifacts, root / "repository", settings)
    export_to(cfg, root / "repository", artifacts, settings)
    return root / "repository"


# --- the three ways to step a session -----------------------------------------------------------------------


class HttpSessions:
    """Sessions stepped through the gateway over HTTP/1.1 keep-alive, one connection each."""

    def __init__(self, url: str, token: np.ndarray, b64: bool) -> None:
        from serving.gateway.encoding import encode, tensor_json

        self.host, self.port = url.removeprefix("http://").rsplit(":", 1)
        self.b64, self.width = b64, token.shape[-1]
        # encoded once: the load generator's own cost stays low
        self.body = tensor_json({"hidden_states": encode(token, "b64" if b64 else "json")})
        self.query = "?encoding=b64" if b64 else ""
        self.headers = f"X-API-Key: {KEY}\r\nContent-Type: application/json\r\n".encode()

    async def run(self, count: int, steps: int) -> float:
        loop = asyncio.get_running_loop()
        connections = [(await loop.create_connection(Connection, self.host, int(self.port)))[1] for _ in range(count)]
        try:
            ids = await asyncio.gather(*(self._open(c) for c in connections))
            try:
                started = time.perf_counter()
                await asyncio.gather(
                    *(self._steps(c, session, steps) for c, session in zip(connections, ids, strict=True))
                )
                return time.perf_counter() - started
            finally:
                for c, session in zip(connections, ids, strict=True):
                    await c.request("DELETE", f"/v1/sessions/{session}", headers=self.headers)
        finally:
            for c in connections:
                c.transport.close()

    async def _open(self, connection: Connection) -> str:
        status, body = await connection.request("POST", "/v1/sessions", headers=self.headers)
        if status != 201:
            raise RuntimeError(f"opening a session: {status} {body[:300]!r}")
        return json.loads(body)["id"]

    async def _steps(self, connection: Connection, session: str, steps: int) -> None:
        path = f"/v1/sessions/{session}/step{self.query}"
        for _ in range(steps):
            status, body = await connection.request("POST", path, self.body, self.headers)
            if status != 200:
                raise RuntimeError(f"step: {status} {body[:300]!r}")
        output = json.loads(body)["output"]  # the last answer, checked whole
        shape = output["shape"] if self.b64 else list(np.asarray(output).shape)
        if shape != [1, 1, self.width]:
            raise RuntimeError(f"step answered an output of shape {shape}")


class GrpcSessions:
    """Sessions stepped by the asyncio client library straight to Triton's gRPC port."""

    def __init__(self, url: str, token: np.ndarray) -> None:
        self.url, self.token = url, token

    async def run(self, count: int, steps: int) -> float:
        from client import AsyncClient

        async with AsyncClient(self.url, "grpc") as triton:
            sessions = [triton.session() for _ in range(count)]
            await asyncio.gather(*(s.open() for s in sessions))
            try:
                started = time.perf_counter()
                await asyncio.gather(*(self._steps(s, steps) for s in sessions))
                return time.perf_counter() - started
            finally:
                await asyncio.gather(*(s.close() for s in sessions))

    async def _steps(self, session, steps: int) -> None:
        for _ in range(steps):
            await session.step(self.token)


# --- the run -----------------------------------------------------------------------------------------------


def measure(fronts: dict, pids: dict[str, list[int]], sessions: int, steps: int, rounds: int) -> dict:
    """`rounds` interleaved rounds of every mode: steps/s and CPU per step of the load generator, of the
    gateway serving the mode (`pids[name]` for a mode `name/...`) and of Triton (`pids["triton"]`)."""
    samples = {mode: {"seconds": 0.0, "steps": 0, "gateway": 0.0, "triton": 0.0, "load_cpu": 0.0} for mode in fronts}
    for mode, front in fronts.items():  # warm-up: connections, metadata, each gateway's first requests
        if not mode.endswith("/b64"):
            asyncio.run(front.run(sessions, 3))
    for _ in range(rounds):
        for mode, front in fronts.items():
            groups = {"gateway": pids.get(mode.split("/")[0], []), "triton": pids["triton"]}
            before = {group: cpu_seconds(group_pids) for group, group_pids in groups.items()}
            own = time.process_time()
            elapsed = asyncio.run(front.run(sessions, steps))
            sample = samples[mode]
            sample["load_cpu"] += time.process_time() - own
            for group, group_pids in groups.items():
                sample[group] += cpu_seconds(group_pids) - before[group]
            sample["seconds"] += elapsed
            sample["steps"] += sessions * steps
    return summarize(samples)


def summarize(samples: dict) -> dict:
    rows = {}
    for mode, sample in samples.items():
        per_step = 1e6 / sample["steps"]
        rows[mode] = {
            "steps": sample["steps"],
            "steps_per_s": sample["steps"] / sample["seconds"],
            "load_generator_cpu_us_per_step": sample["load_cpu"] * per_step,
            "gateway_cpu_us_per_step": sample["gateway"] * per_step,
            "triton_cpu_us_per_step": sample["triton"] * per_step,
        }
    direct = rows["grpc/client"]["steps_per_s"]
    for row in rows.values():
        row["ratio_to_grpc"] = row["steps_per_s"] / direct
    return rows


def parse_compared(specs: list[str]) -> dict[str, dict[str, str]]:
    """`NAME:SETTING=VALUE,...` -> {NAME: {SETTING: VALUE}}; a name is a mode's prefix, so not the default's."""
    compared = {}
    for spec in specs:
        name, _, given = spec.partition(":")
        pairs = [pair.partition("=") for pair in given.split(",") if pair]
        if not name or name in (DEFAULT_GATEWAY, "grpc") or name in compared or any(not eq for _, eq, _ in pairs):
            raise ValueError(f"--compare: expected a new NAME:SETTING=VALUE,... (not gateway or grpc), got {spec!r}")
        compared[name] = {setting: value for setting, _, value in pairs}
    return compared


def benchmark(
    root: Path, preset_name: str, sessions: int, steps: int, rounds: int, workers: int, compared: dict | None = None
) -> dict:
    from client import Client
    from serving.host.launcher import start_triton

    repository = prepare(root, preset_name)
    server = start_triton(repository, log_path=root / "triton.log")
    gateways = {DEFAULT_GATEWAY: {"workers": workers}} | dict(compared or {})
    try:
        with Client(server.grpc_url, "grpc") as triton:
            d_model = triton.metadata("sessions").d_model
        token = np.random.default_rng(0).standard_normal((1, 1, d_model)).astype(np.float32)
        with contextlib.ExitStack() as running:
            fronts, pids = {}, {"triton": [server.process.pid]}
            for name, settings in gateways.items():
                log_path = root / f"{name}.log"
                url, gateway = running.enter_context(gateway_process(server.grpc_url, log_path, **settings))
                fronts |= {f"{name}/{e}": HttpSessions(url, token, b64=e == "b64") for e in ENCODINGS}
                pids[name] = [gateway.pid]
            fronts["grpc/client"] = GrpcSessions(server.grpc_url, token)
            rows = measure(fronts, pids, sessions, steps, rounds)
    finally:
        server.stop()
    conditions = {
        "preset": preset_name,
        "d_model": d_model,
        "sessions": sessions,
        "steps_per_session_per_round": steps,
        "rounds": rounds,
        "gateway_workers": workers,
        "compared": compared or {},
        "cpus": os.cpu_count(),
    }
    return {"conditions": conditions, "modes": rows, "target": target(rows)}


def target(rows: dict) -> dict:
    worst = min(rows["gateway/json"]["ratio_to_grpc"], rows["gateway/b64"]["ratio_to_grpc"])
    return {
        "what": "gateway steps/s >= 60% of the gRPC client's, JSON and b64",
        "worst_ratio": worst,
        "met": worst >= 0.6,
    }


def table(results: dict) -> str:
    c = results["conditions"]
    compared = "".join(f"; {name}: {settings}" for name, settings in c.get("compared", {}).items())
    lines = [
        f"{c['sessions']} sessions, one-token steps, {c['preset']} (d_model {c['d_model']}), "
        f"{c['rounds']} rounds x {c['steps_per_session_per_round']} steps each, gateway workers {c['gateway_workers']}"
        f"{compared}",
        f"{'mode':<16} {'steps/s':>8} {'vs gRPC':>8} {'CPU us/step: load gen':>22} {'gateway':>8} {'triton':>8}",
    ]
    for mode, row in results["modes"].items():
        lines.append(
            f"{mode:<16} {row['steps_per_s']:>8.0f} {row['ratio_to_grpc']:>7.0%} "
            f"{row['load_generator_cpu_us_per_step']:>22.0f} {row['gateway_cpu_us_per_step']:>8.0f} "
            f"{row['triton_cpu_us_per_step']:>8.0f}"
        )
    t = results["target"]
    lines.append(f"target: {t['what']}: worst {t['worst_ratio']:.0%}, {'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    modes = list(results["modes"])
    rows = [results["modes"][m] for m in modes]
    figure, (rate, cpu) = plt.subplots(1, 2, figsize=(11, 4))
    rate.bar(modes, [r["steps_per_s"] for r in rows])
    for x, row in enumerate(rows):
        rate.annotate(f"{row['ratio_to_grpc']:.0%}", (x, row["steps_per_s"]), ha="center", va="bottom")
    rate.set(title=f"{results['conditions']['sessions']} sessions stepping", ylabel="decode steps / s")
    bottom = np.zeros(len(rows))
    for group in ("load_generator", "gateway", "triton"):
        values = np.array([r[f"{group}_cpu_us_per_step"] for r in rows])
        cpu.bar(modes, values, bottom=bottom, label=group.replace("_", " "))
        bottom += values
    cpu.set(title="CPU per step", ylabel="microseconds")
    for axes in (rate, cpu):
        axes.tick_params(axis="x", labelrotation=30)
    cpu.legend()
    return save(figure, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=16, help="concurrent sessions (default 16)")
    parser.add_argument("--steps", type=int, default=100, help="steps per session per mode and round (default 100)")
    output.rounds_argument(parser, 5)
    parser.add_argument("--workers", type=int, default=1, help="gateway worker processes (default 1)")
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="NAME:SETTING=VALUE,...",
        help="another gateway (SERVING_* settings, lowercase, without the prefix) stepped in the same rounds",
    )
    output.output_arguments(parser, served_preset=True)


def run(args: argparse.Namespace) -> int:
    with output.work_folder(args.work, "bench-gateway-") as root:
        compared = parse_compared(args.compare)
        results = benchmark(root, args.preset, args.sessions, args.steps, args.rounds, args.workers, compared)
    print(table(results))
    print(output.write(results, args.out, "gateway", plot))
    return 0
