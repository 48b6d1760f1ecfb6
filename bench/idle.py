"""Idle sessions: what a control session's step and an open cost with 0 to 8,000 idle live sessions
beside them, through the real stack (the gateway over real Triton).

Writes `idle.json` and `idle.png` and prints a table.

Issue 34's probe measured a step's p50 at 2.4 / 9.1 / 13.5 / 18.8 ms with 0 / 1k / 2k / 4k idle sessions
and an open at 1.1 ms, then 20: a request walked every session. Here, per level of idle sessions:

- `step`: `POST /v1/sessions/{id}/step` of one token on a control session (JSON), p50 and p90;
- `open`: `POST /v1/sessions` (a START in Triton), p50 and p90; each opened one is deleted again,
  untimed;
- each one's p50 over the 0-idle figure.

The levels are visited going up (idle sessions opened, `--concurrency` at a time, by a key of their
own) and then coming down (deleted again), each level measured both ways: what drifts on the shared
machine over the run falls on every level alike. A level is measured once the session model holds
its sessions (the ENDs of the deleted ones done: its metrics say so) and after a few uncounted steps
and opens; a step and an open take turns within it.

Conditions: the tiny model (`--preset`), the `sessions` model's static engine on the CPU, one ONNX Runtime
thread, a KV budget of as many rows of the smallest size as the most idle sessions and some to spare
(an idle session holds a short row: its one START), every idle timeout (the gateway's, the model's,
Triton's) past the run; one Triton (the bundled binary) and one gateway (`python -m serving.gateway`,
a process of its own) on 127.0.0.1, the load generator in this process over HTTP/1.1 keep-alive.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from pathlib import Path

import numpy as np

from bench import results as output
from bench.plot import save
from bench.stack import Connection, gateway_process
from contract import files

VARIANTS = ("fp32-fused", "fp32-static")  # what forward and sessions serve on the CPU
CONTROL_KEY, IDLE_KEY = "bench-control-key", "bench-idle-key"
LEVELS = (0, 1000, 2000, 4000, 8000)
SPARE_ROWS = 64  # beyond the idle sessions: the control session, the opens measured
IDLE_S = 3600.0  # no session of the run goes idle for any timeout
WARM_UP = 20  # uncounted steps and opens at each level


def artifact(root: Path, preset_name: str) -> Path:
    """The preset's artifact (reused when it is there)."""
    from contract.config import preset
    from export.build import build

    directory = root / f"artifact-{preset_name}"
    if not all((directory / files.model_filename(v)).is_file() for v in VARIANTS):
        build(preset(preset_name), directory, VARIANTS)
    return directory


def repository(source: Path, where: Path, most_idle: int) -> tuple[Path, int]:
    """forward and sessions with a KV budget for `most_idle` short sessions and the spare rows; the budget."""
    from contract.config import ModelConfig
    from contract.deployment import MIN_ROW_POSITIONS
    from serving.triton.config import FORWARD, SESSIONS, ServingSettings
    from serving.triton.repository import write_repository

    cfg = ModelConfig.load(source)
    budget = (most_idle + SPARE_ROWS) * cfg.kv_cache_bytes(1, MIN_ROW_POSITIONS)
    settings = ServingSettings(threads=1, kv_cache_bytes=budget, idle_timeout_seconds=IDLE_S)
    return write_repository(source, where, settings, models=(FORWARD, SESSIONS)), budget


class Front:
    """The gateway seen from HTTP/1.1 keep-alive connections: a control session, opens, idle sessions."""

    def __init__(self, url: str, d_model: int, concurrency: int) -> None:
        from serving.gateway.encoding import encode, tensor_json

        self.host, self.port = url.removeprefix("http://").rsplit(":", 1)
        token = np.random.default_rng(0).standard_normal((1, 1, d_model)).astype(np.float32)
        self.step_body = tensor_json({"hidden_states": encode(token, "json")})
        self.control_headers = f"X-API-Key: {CONTROL_KEY}\r\nContent-Type: application/json\r\n".encode()
        self.idle_headers = f"X-API-Key: {IDLE_KEY}\r\n".encode()
        self.concurrency = concurrency
        self.idle: list[str] = []
        self.opening = 0  # idle sessions being opened now
        self.connections: list[Connection] = []
        self.control = ""

    async def connect(self) -> None:
        self.connections = [await self._connected() for _ in range(self.concurrency + 1)]
        self.control = await self.open(await self.connection(0), self.control_headers)

    async def _connected(self) -> Connection:
        loop = asyncio.get_running_loop()
        return (await loop.create_connection(Connection, self.host, int(self.port)))[1]

    async def connection(self, index: int) -> Connection:
        """Connection `index`, opened again where the gateway closed it (uvicorn closes one idle for 5 s:
        the control connection waits that long while thousands of sessions open)."""
        if self.connections[index].transport.is_closing():
            self.connections[index] = await self._connected()
        return self.connections[index]

    def close(self) -> None:
        for connection in self.connections:
            connection.transport.close()

    async def open(self, connection: Connection, headers: bytes) -> str:
        status, body = await connection.request("POST", "/v1/sessions", headers=headers)
        if status != 201:
            raise RuntimeError(f"opening a session: {status} {body[:300]!r}")
        return json.loads(body)["id"]

    async def delete(self, connection: Connection, session: str, headers: bytes) -> None:
        status, body = await connection.request("DELETE", f"/v1/sessions/{session}", headers=headers)
        if status != 204:
            raise RuntimeError(f"deleting a session: {status} {body[:300]!r}")

    async def idle_to(self, level: int) -> None:
        """Open or delete idle sessions until `level` are live, `concurrency` requests at a time."""

        async def worker(index: int) -> None:
            connection = await self.connection(index)
            while len(self.idle) + self.opening < level:
                self.opening += 1  # counted before the await: the other workers see it
                session = await self.open(connection, self.idle_headers)
                self.opening -= 1
                self.idle.append(session)
            while len(self.idle) > level:
                await self.delete(connection, self.idle.pop(), self.idle_headers)

        await asyncio.gather(*(worker(index) for index in range(1, len(self.connections))))

    async def timed_step(self) -> float:
        connection, path = await self.connection(0), f"/v1/sessions/{self.control}/step"
        started = time.perf_counter()
        status, body = await connection.request("POST", path, self.step_body, self.control_headers)
        elapsed = time.perf_counter() - started
        if status != 200:
            raise RuntimeError(f"step: {status} {body[:300]!r}")
        return elapsed * 1e3

    async def timed_open(self) -> float:
        connection = await self.connection(0)
        started = time.perf_counter()
        session = await self.open(connection, self.control_headers)
        elapsed = time.perf_counter() - started
        await self.delete(connection, session, self.control_headers)
        return elapsed * 1e3

    async def rewind_control(self) -> None:
        """Back to no positions: the control session's steps stay short whatever the run's length."""
        path = f"/v1/sessions/{self.control}/rewind"
        status, body = await (await self.connection(0)).request(
            "POST", path, json.dumps({"length": 0}).encode(), self.control_headers
        )
        if status != 200:
            raise RuntimeError(f"rewind: {status} {body[:300]!r}")


async def measure_level(front: Front, samples: int, into: dict) -> None:
    """`samples` steps and opens, taking turns; the control session rewound now and then."""
    for k in range(samples):
        into["step"].append(await front.timed_step())
        into["open"].append(await front.timed_open())
        if k % 100 == 99:
            await front.rewind_control()


async def settled(metrics_url: str, sequences: int, timeout_s: float = 60.0) -> None:
    """Until the session model holds `sequences`: a DELETE answers before the gateway's END reaches
    Triton, and a level is measured once those ENDs are done, not beside them."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while True:
            text = (await http.get(metrics_url)).text
            held = re.search(r'^attention_kv_cache_sequences\{[^}]*model="sessions"[^}]*\} (\S+)$', text, re.M)
            if held is not None and float(held.group(1)) == sequences:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sessions did not settle at {sequences} sequences: {held and held.group(1)}")
            await asyncio.sleep(0.1)


async def warm_up(front: Front, pairs: int = WARM_UP) -> None:
    """Steps and opens not counted: the first of a level pay for the connections opened again."""
    for _ in range(pairs):
        await front.timed_step()
        await front.timed_open()


async def drive(url: str, metrics_url: str, d_model: int, levels: list[int], samples: int, concurrency: int) -> dict:
    front = Front(url, d_model, concurrency)
    await front.connect()
    try:
        measured = {level: {"step": [], "open": [], "passes": []} for level in levels}
        await warm_up(front, 5 * WARM_UP)  # the gateway's first requests, the model's first runs
        going = [*levels, *reversed(levels[:-1])]
        for index, level in enumerate(going):
            started = time.perf_counter()
            await front.idle_to(level)
            opened_s = time.perf_counter() - started
            await settled(metrics_url, level + 1)  # the idle ones and the control session
            await warm_up(front)
            before = {kind: len(measured[level][kind]) for kind in ("step", "open")}
            await measure_level(front, samples, measured[level])
            this_pass = {kind: measured[level][kind][before[kind] :] for kind in ("step", "open")}
            measured[level]["passes"].append(
                {
                    "direction": "up" if index < len(levels) else "down",
                    "reached_in_s": opened_s,
                    **{f"{kind}_p50_ms": float(np.median(values)) for kind, values in this_pass.items()},
                }
            )
            print(
                f"{level:>5} idle ({measured[level]['passes'][-1]['direction']}, reached in {opened_s:.1f} s): "
                f"step p50 {np.median(this_pass['step']):.2f} ms, open p50 {np.median(this_pass['open']):.2f} ms",
                flush=True,
            )
        await front.idle_to(0)
        return measured
    finally:
        front.close()


def summarize(measured: dict) -> dict:
    rows = {}
    for level, samples in measured.items():
        rows[str(level)] = {
            kind: {
                "p50_ms": float(np.percentile(samples[kind], 50)),
                "p90_ms": float(np.percentile(samples[kind], 90)),
                "runs": len(samples[kind]),
            }
            for kind in ("step", "open")
        } | {"passes": samples["passes"]}
    base = rows[str(min(measured))]
    for row in rows.values():
        for kind in ("step", "open"):
            row[kind]["p50_vs_no_idle"] = row[kind]["p50_ms"] / base[kind]["p50_ms"]
    return rows


def benchmark(root: Path, preset_name: str, levels: list[int], samples: int, concurrency: int) -> dict:
    from contract.config import ModelConfig
    from serving.host.launcher import start_triton

    source = artifact(root, preset_name)
    cfg = ModelConfig.load(source)
    repository_dir, budget = repository(source, root / "repository", max(levels))
    server = start_triton(repository_dir, log_path=root / "triton.log")
    try:
        settings = {
            "api_keys": f"{CONTROL_KEY},{IDLE_KEY}",
            "sessions_per_key": max(levels) + SPARE_ROWS,
            "session_idle_s": IDLE_S,
            "kv_share_per_key": 1.0,  # one key holds every idle session: the budget is the limit
        }
        with gateway_process(server.grpc_url, root / "gateway.log", **settings) as (url, _):
            measured = asyncio.run(drive(url, server.metrics_url, cfg.d_model, levels, samples, concurrency))
    finally:
        server.stop()
    conditions = {
        "preset": preset_name,
        "d_model": cfg.d_model,
        "levels": levels,
        "samples_per_level_per_pass": samples,
        "kv_budget_bytes": budget,
        "concurrency_of_idle_opens": concurrency,
        "cpus": os.cpu_count(),
    }
    return {"conditions": conditions, "levels": summarize(measured)}


def table(results: dict) -> str:
    c = results["conditions"]
    lines = [
        f"{c['preset']} (d_model {c['d_model']}), a control session's one-token step and an open through the "
        f"gateway; {c['samples_per_level_per_pass']} of each per level and pass (up and down)",
        f"{'idle':>6} {'step p50':>9} {'p90':>7} {'x':>6} {'open p50':>9} {'p90':>7} {'x':>6}",
    ]
    for level, row in results["levels"].items():
        step, opened = row["step"], row["open"]
        lines.append(
            f"{int(level):>6} {step['p50_ms']:>7.2f}ms {step['p90_ms']:>5.2f}ms {step['p50_vs_no_idle']:>5.2f}x "
            f"{opened['p50_ms']:>7.2f}ms {opened['p90_ms']:>5.2f}ms {opened['p50_vs_no_idle']:>5.2f}x"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    levels = [int(level) for level in results["levels"]]
    figure, axis = plt.subplots(figsize=(8, 4))
    for kind, color in (("step", "tab:blue"), ("open", "tab:orange")):
        for stat, style in (("p50_ms", "-o"), ("p90_ms", ":s")):
            values = [row[kind][stat] for row in results["levels"].values()]
            axis.plot(levels, values, style, color=color, label=f"{kind} {stat.removesuffix('_ms')}")
    axis.set(
        xlabel="idle live sessions", ylabel="ms through the gateway", title="a request's cost beside idle sessions"
    )
    axis.set_ylim(bottom=0)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    return save(figure, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    output.output_arguments(parser)
    parser.add_argument("--preset", default="tiny", help="the served model (default: %(default)s)")
    parser.add_argument(
        "--levels", type=int, nargs="+", default=list(LEVELS), help="idle sessions, ascending (default: %(default)s)"
    )
    parser.add_argument("--samples", type=int, default=200, help="steps and opens per level and pass (default 200)")
    parser.add_argument("--concurrency", type=int, default=8, help="idle sessions opened at once (default 8)")


def run(args: argparse.Namespace) -> int:
    levels = sorted(set(args.levels))
    with output.work_folder(args.work, "bench-idle-") as root:
        results = benchmark(root, args.preset, levels, args.samples, args.concurrency)
    print(table(results))
    print(output.write(results, args.out, "idle", plot))
    return 0
