"""The gateway's cost: sessions stepping through its HTTP API against the gRPC client library direct.

One Triton (the bundled binary, the served preset) and one gateway process (`python -m serving.gateway`, auth
on) on 127.0.0.1. `--sessions` sessions step concurrently, one token a step, in modes that take turns round by
round: `gateway/json` (`POST /v1/sessions/{id}/step`, nested JSON lists both ways), `gateway/b64` (base64
tensor objects, `?encoding=b64`) and `grpc/client` (`client.AsyncClient` straight to Triton's gRPC port,
`validate=True` as a direct caller uses it). Per mode: steps/s, its ratio to `grpc/client`, and CPU per step
of the load generator (this process), of the gateway (its workers included) and of Triton: everything shares
the cores, so the CPU says where the time goes. The load generator is a keep-alive HTTP/1.1 client on
httptools' parser, its requests encoded once, so that its own cost stays small. `--compare NAME:SETTING=VALUE,...`
adds a gateway of other SERVING_* settings in front of the same Triton, stepped in the same rounds as
`NAME/json` and `NAME/b64`: choices are measured side by side, never across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import time
from pathlib import Path

import numpy as np

from bench import results as output
from bench.plot import figure, gridded, save
from bench.stack import KEY, Connection, cpu_seconds, gateway_process, triton
from bench.timing import interleaved
from contract import files

DEFAULT_GATEWAY = "gateway"  # the gateway of the default settings (and --workers): the target is its
ENCODINGS = ("json", "b64")
MODES = (*(f"{DEFAULT_GATEWAY}/{encoding}" for encoding in ENCODINGS), "grpc/client")  # without --compare
CPU_GROUPS = ("load_generator", "gateway", "triton")


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


class HttpSessions:
    """Sessions stepped through the gateway, one keep-alive connection each."""

    def __init__(self, url: str, token: np.ndarray, b64: bool) -> None:
        from serving.gateway.encoding import encode, tensor_json

        self.host, self.port = url.removeprefix("http://").rsplit(":", 1)
        self.b64, self.width = b64, token.shape[-1]
        self.body = tensor_json({"hidden_states": encode(token, "b64" if b64 else "json")})
        self.query = "?encoding=b64" if b64 else ""
        self.headers = f"X-API-Key: {KEY}\r\nContent-Type: application/json\r\n".encode()

    async def run(self, count: int, steps: int) -> float:
        """Seconds `count` sessions took for `steps` steps each (opening and closing them not counted)."""
        loop = asyncio.get_running_loop()
        connections = [(await loop.create_connection(Connection, self.host, int(self.port)))[1] for _ in range(count)]
        try:
            ids = await asyncio.gather(*(self._open(connection) for connection in connections))
            try:
                started = time.perf_counter()
                await asyncio.gather(
                    *(self._steps(c, session, steps) for c, session in zip(connections, ids, strict=True))
                )
                return time.perf_counter() - started
            finally:
                for connection, session in zip(connections, ids, strict=True):
                    await connection.request("DELETE", f"/v1/sessions/{session}", headers=self.headers)
        finally:
            for connection in connections:
                connection.transport.close()

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
        answer = json.loads(body)["output"]  # the last one, checked whole
        shape = answer["shape"] if self.b64 else list(np.asarray(answer).shape)
        if shape != [1, 1, self.width]:
            raise RuntimeError(f"step answered an output of shape {shape}")


async def grpc_sessions(url: str, token: np.ndarray, count: int, steps: int) -> float:
    """Seconds `count` sessions of the asyncio client library, straight to Triton's gRPC port, took for `steps`
    steps each."""
    from client import AsyncClient

    async def stepping(session) -> None:
        for _ in range(steps):
            await session.step(token)

    async with AsyncClient(url, "grpc") as client:
        sessions = [client.session() for _ in range(count)]
        await asyncio.gather(*(session.open() for session in sessions))
        try:
            started = time.perf_counter()
            await asyncio.gather(*(stepping(session) for session in sessions))
            return time.perf_counter() - started
        finally:
            await asyncio.gather(*(session.close() for session in sessions))


def cpu_now(gateway: list[int], triton_pids: list[int]) -> list[float]:
    """CPU seconds so far of this process (the load generator), the gateway and Triton, as CPU_GROUPS."""
    return [time.process_time(), cpu_seconds(gateway), cpu_seconds(triton_pids)]


def measure(fronts: dict, pids: dict[str, list[int]], sessions: int, steps: int, rounds: int) -> dict:
    """Interleaved rounds of every mode: steps/s and CPU per step of the load generator, of the gateway serving
    the mode (`pids[name]` for a mode `name/...`) and of Triton (`pids["triton"]`)."""
    cpu = {mode: dict.fromkeys(CPU_GROUPS, 0.0) for mode in fronts}
    seconds = dict.fromkeys(fronts, 0.0)
    for mode, front in fronts.items():  # warm-up: connections, metadata, each gateway's first requests
        if not mode.endswith("/b64"):
            asyncio.run(front(sessions, 3))
    for _, mode in interleaved(rounds, list(fronts)):
        gateway = pids.get(mode.split("/")[0], [])
        before = cpu_now(gateway, pids["triton"])
        seconds[mode] += asyncio.run(fronts[mode](sessions, steps))
        for group, start, end in zip(CPU_GROUPS, before, cpu_now(gateway, pids["triton"]), strict=True):
            cpu[mode][group] += end - start
    done = rounds * sessions * steps
    rows = {
        mode: {"steps": done, "steps_per_s": done / seconds[mode]}
        | {f"{group}_cpu_us_per_step": cpu[mode][group] * 1e6 / done for group in CPU_GROUPS}
        for mode in fronts
    }
    for row in rows.values():
        row["ratio_to_grpc"] = row["steps_per_s"] / rows["grpc/client"]["steps_per_s"]
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


def benchmark(root: Path, args: argparse.Namespace, compared: dict) -> dict:
    from client import Client

    gateways = {DEFAULT_GATEWAY: {"workers": args.workers}} | compared
    with output.during(1) as machine, triton(prepare(root, args.preset), log_path=root / "triton.log") as server:
        with Client(server.grpc_url, "grpc") as client:
            d_model = client.metadata("sessions").d_model
        token = np.random.default_rng(0).standard_normal((1, 1, d_model)).astype(np.float32)
        with contextlib.ExitStack() as running:
            fronts, pids = {}, {"triton": [server.process.pid]}
            for name, settings in gateways.items():
                log_path = root / f"{name}.log"
                url, gateway = running.enter_context(gateway_process(server.grpc_url, log_path, **settings))
                fronts |= {
                    f"{name}/{encoding}": HttpSessions(url, token, encoding == "b64").run for encoding in ENCODINGS
                }
                pids[name] = [gateway.pid]
            fronts["grpc/client"] = functools.partial(grpc_sessions, server.grpc_url, token)
            rows = measure(fronts, pids, args.sessions, args.steps, args.rounds)
    conditions = {"preset": args.preset, "d_model": d_model, "sessions": args.sessions, "rounds": args.rounds}
    conditions |= {"steps_per_session_per_round": args.steps, "gateway_workers": args.workers, "compared": compared}
    worst = min(rows[f"{DEFAULT_GATEWAY}/{encoding}"]["ratio_to_grpc"] for encoding in ENCODINGS)
    what = "gateway steps/s >= 60% of the gRPC client's, JSON and b64"
    target = output.goal(worst, least=0.6, kind="worst_ratio", what=what)
    return {"conditions": conditions, "machine": machine, "modes": rows, "target": target}


def table(results: dict) -> str:
    given = results["conditions"]
    compared = "".join(f"; {name}: {settings}" for name, settings in given["compared"].items())
    heading = (
        f"{given['sessions']} sessions, one-token steps, {given['preset']} (d_model {given['d_model']}), "
        f"{given['rounds']} rounds x {given['steps_per_session_per_round']} steps each, "
        f"gateway workers {given['gateway_workers']}{compared}"
    )
    header = ["mode", "steps/s", "vs gRPC", "CPU us/step: load gen", "gateway", "triton"]
    rows = [
        [mode, f"{row['steps_per_s']:.0f}", f"{row['ratio_to_grpc']:.0%}"]
        + [f"{row[f'{group}_cpu_us_per_step']:.0f}" for group in CPU_GROUPS]
        for mode, row in results["modes"].items()
    ]
    target = results["target"]
    verdict = f"target: {target['what']}: worst {target['worst_ratio']:.0%}, {'met' if target['met'] else 'MISSED'}"
    return output.table(heading, header, rows) + "\n" + verdict


def plot(results: dict, path: Path) -> Path:
    drawn, (rate, cpu) = figure(2, (11, 4))
    modes, rows = list(results["modes"]), list(results["modes"].values())
    rate.bar(modes, [row["steps_per_s"] for row in rows])
    for x, row in enumerate(rows):
        rate.annotate(f"{row['ratio_to_grpc']:.0%}", (x, row["steps_per_s"]), ha="center", va="bottom")
    rate.set(title=f"{results['conditions']['sessions']} sessions stepping", ylabel="decode steps / s")
    bottom = np.zeros(len(rows))
    for group in CPU_GROUPS:
        values = np.array([row[f"{group}_cpu_us_per_step"] for row in rows])
        cpu.bar(modes, values, bottom=bottom, label=group.replace("_", " "))
        bottom += values
    cpu.set(title="CPU per step", ylabel="microseconds")
    for axis in (rate, cpu):
        axis.tick_params(axis="x", labelrotation=30)
    gridded(cpu)
    return save(drawn, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=16, help="concurrent sessions (default 16)")
    parser.add_argument("--steps", type=int, default=100, help="steps per session per mode and round (default 100)")
    output.rounds_argument(parser, 5)
    parser.add_argument("--workers", type=int, default=1, help="gateway worker processes (default 1)")
    another = "another gateway (SERVING_* settings, lowercase, without the prefix) stepped in the same rounds"
    parser.add_argument("--compare", action="append", default=[], metavar="NAME:SETTING=VALUE,...", help=another)
    output.output_arguments(parser, served_preset=True)


def run(args: argparse.Namespace) -> int:
    compared = parse_compared(args.compare)
    with output.work_folder(args.work, "bench-gateway-") as root:
        results = benchmark(root, args, compared)
    return output.report(results, args.out, "gateway", plot, table(results))
