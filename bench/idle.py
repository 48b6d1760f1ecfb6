"""Idle sessions: what a control session's step and an open cost beside 0 to 8,000 idle live sessions.

Through the real stack (the gateway over real Triton). Issue 34's probe measured a step's p50 at 2.4 / 9.1 / 13.5 /
18.8 ms with 0 / 1k / 2k / 4k idle sessions and an open at 1.1 ms, then 20: a request walked every session. Per
level, a one-token JSON step and an open (deleted again, untimed) take turns. The levels go up (idle sessions opened
`--concurrency` at a time by a key of their own) and back down, measured both ways: the shared machine's drift falls
on every level alike. A level is measured once the session model holds its sessions (the deleted ones' ENDs done)
and after a few uncounted pairs.

Conditions: the tiny model, the `sessions` model's static engine on one ONNX Runtime thread, every idle timeout past
the run; one Triton and one gateway process on 127.0.0.1, the load from this process over HTTP/1.1 keep-alive.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from pathlib import Path

import numpy as np

from bench import results as output
from bench import stack
from bench.plot import figure, gridded, save
from contract.config import ModelConfig

VARIANTS = ("fp32-fused", "fp32-static")  # what forward and sessions serve on the CPU
CONTROL_KEY, IDLE_KEY = "bench-control-key", "bench-idle-key"
LEVELS = (0, 1000, 2000, 4000, 8000)
SPARE_ROWS = 64  # beyond the idle sessions: the control session, the opens measured
IDLE_S = 3600.0  # no session of the run goes idle for any timeout
WARM_UP = 20  # uncounted steps and opens at each level
KINDS = ("step", "open")
HELD = re.compile(r'^attention_kv_cache_sequences\{[^}]*model="sessions"[^}]*\} (\S+)$', re.MULTILINE)


class Front:
    """The gateway over keep-alive connections: the control session's (0), the idle sessions' (the others)."""

    def __init__(self, url: str, d_model: int) -> None:
        from serving.gateway.encoding import encode, tensor_json

        self.host, self.port = url.removeprefix("http://").rsplit(":", 1)
        token = np.random.default_rng(0).standard_normal((1, 1, d_model)).astype(np.float32)
        self.step_body = tensor_json({"hidden_states": encode(token, "json")})
        self.headers = {
            key: f"X-API-Key: {key}\r\nContent-Type: application/json\r\n".encode() for key in (CONTROL_KEY, IDLE_KEY)
        }
        self.connections: list[stack.Connection] = []
        self.idle: list[str] = []
        self.control = ""

    async def connect(self, concurrency: int) -> None:
        self.connections = [await self.connected() for _ in range(concurrency + 1)]
        self.control = await self.open(0, CONTROL_KEY)

    async def connected(self) -> stack.Connection:
        loop = asyncio.get_running_loop()
        return (await loop.create_connection(stack.Connection, self.host, int(self.port)))[1]

    async def request(self, index: int, key: str, method: str, path: str, body: bytes = b"") -> tuple[float, bytes]:
        """On connection `index`, opened again (untimed) where the gateway closed it (uvicorn closes one idle for
        5 s: the control connection's wait while thousands of sessions open); the ms to the answer, its body."""
        if self.connections[index].transport.is_closing():
            self.connections[index] = await self.connected()
        started = time.perf_counter()
        status, answer = await self.connections[index].request(method, path, body, self.headers[key])
        elapsed_ms = (time.perf_counter() - started) * 1e3
        if status // 100 != 2:
            raise RuntimeError(f"{method} {path}: {status} {answer[:300]!r}")
        return elapsed_ms, answer

    async def open(self, index: int, key: str) -> str:
        return json.loads((await self.request(index, key, "POST", "/v1/sessions"))[1])["id"]

    async def delete(self, index: int, key: str, session: str) -> None:
        await self.request(index, key, "DELETE", f"/v1/sessions/{session}")

    async def idle_to(self, level: int) -> None:
        """Idle sessions opened or deleted until `level` are live, a request per idle connection at a time."""
        doomed, self.idle = self.idle[level:], self.idle[:level]
        opens, workers = level - len(self.idle), len(self.connections) - 1

        async def worker(index: int) -> None:
            for session in doomed[index - 1 :: workers]:
                await self.delete(index, IDLE_KEY, session)
            for _ in range(index - 1, opens, workers):
                self.idle.append(await self.open(index, IDLE_KEY))

        await asyncio.gather(*(worker(index) for index in range(1, workers + 1)))

    async def pairs(self, count: int) -> dict[str, list[float]]:
        """`count` timed steps and opens taking turns; the control session rewound to no positions every 100
        (its steps stay short whatever the run's length)."""
        timed = {kind: [] for kind in KINDS}
        for turn in range(count):
            step = f"/v1/sessions/{self.control}/step"
            step_ms, _ = await self.request(0, CONTROL_KEY, "POST", step, self.step_body)
            open_ms, body = await self.request(0, CONTROL_KEY, "POST", "/v1/sessions")
            await self.delete(0, CONTROL_KEY, json.loads(body)["id"])
            timed["step"].append(step_ms)
            timed["open"].append(open_ms)
            if turn % 100 == 99:
                rewind = f"/v1/sessions/{self.control}/rewind"
                await self.request(0, CONTROL_KEY, "POST", rewind, b'{"length": 0}')
        return timed


async def settled(metrics_url: str, sequences: int, timeout_s: float = 60.0) -> None:
    """Until the session model holds `sequences`: a DELETE answers before the gateway's END reaches Triton."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while (held := HELD.search((await http.get(metrics_url)).text)) is None or float(held[1]) != sequences:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sessions did not settle at {sequences} sequences: {held and held[1]}")
            await asyncio.sleep(0.1)


async def drive(url: str, metrics_url: str, d_model: int, levels: list[int], samples: int, concurrency: int) -> dict:
    """Every level going up, then coming down: its samples of both passes, and each pass's p50s."""
    front = Front(url, d_model)
    await front.connect(concurrency)
    measured = {level: {"step": [], "open": [], "passes": []} for level in levels}
    await front.pairs(5 * WARM_UP)  # the gateway's first requests, the model's first runs
    for index, level in enumerate([*levels, *reversed(levels[:-1])]):
        started = time.perf_counter()
        await front.idle_to(level)
        reached_s = time.perf_counter() - started
        await settled(metrics_url, level + 1)  # the idle ones and the control session
        await front.pairs(WARM_UP)  # the first of a level pay for the connections opened again
        this_pass = {"direction": "up" if index < len(levels) else "down", "reached_in_s": reached_s}
        for kind, values in (await front.pairs(samples)).items():
            measured[level][kind] += values
            this_pass[f"{kind}_p50_ms"] = float(np.median(values))
        measured[level]["passes"].append(this_pass)
        shown = ", ".join(f"{kind} p50 {this_pass[f'{kind}_p50_ms']:.2f} ms" for kind in KINDS)
        print(f"{level:>5} idle ({this_pass['direction']}, reached in {reached_s:.1f} s): {shown}", flush=True)
    await front.idle_to(0)
    for connection in front.connections:
        connection.transport.close()
    return measured


def summary(measured: dict) -> dict:
    """Per level: each kind's p50, p90 and runs and its p50 over the fewest idle sessions' (0 by default)."""
    rows = {}
    for level, samples in measured.items():
        rows[str(level)] = {}
        for kind in KINDS:
            p50, p90 = np.percentile(samples[kind], [50, 90])
            rows[str(level)][kind] = {"p50_ms": float(p50), "p90_ms": float(p90), "runs": len(samples[kind])}
        rows[str(level)]["passes"] = samples["passes"]
    base = rows[str(min(measured))]
    for row in rows.values():
        for kind in KINDS:
            row[kind]["p50_vs_no_idle"] = row[kind]["p50_ms"] / base[kind]["p50_ms"]
    return rows


def benchmark(root: Path, preset_name: str, levels: list[int], samples: int, concurrency: int) -> dict:
    from contract.deployment import MIN_ROW_POSITIONS
    from serving.triton.config import FORWARD, SESSIONS, ServingSettings
    from serving.triton.repository import write_repository

    source = stack.artifact(root, preset_name, VARIANTS)
    cfg = ModelConfig.load(source)
    # a short row per idle session (it holds its START's) and the spare
    budget = (max(levels) + SPARE_ROWS) * cfg.kv_cache_bytes(1, MIN_ROW_POSITIONS)
    settings = ServingSettings(threads=1, kv_cache_bytes=budget, idle_timeout_seconds=IDLE_S)
    repository = write_repository(source, root / "repository", settings, models=(FORWARD, SESSIONS))
    gateway = {
        "api_keys": f"{CONTROL_KEY},{IDLE_KEY}",
        "sessions_per_key": max(levels) + SPARE_ROWS,
        "session_idle_s": IDLE_S,
        "kv_share_per_key": 1.0,  # one key holds every idle session: the budget is the limit
    }
    with (
        output.during(1) as machine,
        stack.triton(repository, log_path=root / "triton.log") as server,
        stack.gateway_process(server.grpc_url, root / "gateway.log", **gateway) as (url, _),
    ):
        measured = asyncio.run(drive(url, server.metrics_url, cfg.d_model, levels, samples, concurrency))
    conditions = {
        "preset": preset_name,
        "d_model": cfg.d_model,
        "levels": levels,
        "samples_per_level_per_pass": samples,
        "kv_budget_bytes": budget,
        "concurrency_of_idle_opens": concurrency,
    }
    return {"conditions": conditions, "machine": machine, "levels": summary(measured)}


def table(results: dict) -> str:
    conditions = results["conditions"]
    heading = (
        f"{conditions['preset']} (d_model {conditions['d_model']}), a control session's one-token step and an open "
        f"through the gateway; {conditions['samples_per_level_per_pass']} of each per level and pass (up and down)"
    )
    cells = (("p50_ms", "{:.2f}ms"), ("p90_ms", "{:.2f}ms"), ("p50_vs_no_idle", "{:.2f}x"))
    rows = [
        [level, *(shown.format(row[kind][key]) for kind in KINDS for key, shown in cells)]
        for level, row in results["levels"].items()
    ]
    return output.table(heading, ["idle", "step p50", "p90", "x", "open p50", "p90", "x"], rows)


def plot(results: dict, path: Path) -> Path:
    levels = [int(level) for level in results["levels"]]
    drawn, (axis,) = figure(1, (8, 4))
    for kind, color in (("step", "tab:blue"), ("open", "tab:orange")):
        for stat, style in (("p50", "-o"), ("p90", ":s")):
            values = [row[kind][f"{stat}_ms"] for row in results["levels"].values()]
            axis.plot(levels, values, style, color=color, label=f"{kind} {stat}")
    axis.set(xlabel="idle live sessions", ylabel="ms through the gateway", ylim=(0, None))
    axis.set_title("a request's cost beside idle sessions")
    gridded(axis, lines="both")
    return save(drawn, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    output.output_arguments(parser)
    parser.add_argument("--preset", default="tiny", help="the served model (default: %(default)s)")
    parser.add_argument(
        "--levels", type=int, nargs="+", default=list(LEVELS), help="idle sessions (default: %(default)s)"
    )
    parser.add_argument("--samples", type=int, default=200, help="steps and opens per level and pass (default 200)")
    parser.add_argument("--concurrency", type=int, default=8, help="idle sessions opened at once (default 8)")


def run(args: argparse.Namespace) -> int:
    with output.work_folder(args.work, "bench-idle-") as root:
        results = benchmark(root, args.preset, sorted(set(args.levels)), args.samples, args.concurrency)
    return output.report(results, args.out, "idle", plot, table(results))
