"""The servers and artifacts the benches stand up: a preset's artifact built once, a Triton on a repository
stopped afterwards, a gateway process in front of it, and the keep-alive HTTP connection their load
generators send prepared requests on."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from contract import files
from contract.config import preset

KEY = "bench-key"  # the gateways' API key unless a bench gives its own


def artifact(
    root: Path, preset_name: str, variants: Iterable[str] | None, max_seq_len: int | None = None, **build
) -> Path:
    """`root/artifact-<preset_name>[-<max_seq_len>]` holding the preset's `variants` (None: every one the build
    passes), at `max_seq_len` where given, built where one is missing (a folder kept with `--work` is reused);
    `build`: export.build.build's other arguments."""
    from export.build import build as build_artifact

    cfg, directory = preset(preset_name), root / f"artifact-{preset_name}"
    if max_seq_len is not None:
        cfg = dataclasses.replace(cfg, max_seq_len=max_seq_len)
        directory = root / f"artifact-{preset_name}-{max_seq_len}"
    wanted = [files.REPORT_FILENAME] if variants is None else [files.model_filename(variant) for variant in variants]
    if not all((directory / name).is_file() for name in wanted):
        build_artifact(cfg, directory, None if variants is None else tuple(variants), **build)
    return directory


@contextlib.contextmanager
def triton(repository: Path, **start) -> Iterator:
    """A Triton (the bundled binary) on `repository` while the block runs, stopped after it;
    `start`: serving.host.launcher.start_triton's other arguments (log_path, models, ready_timeout)."""
    from serving.host.launcher import start_triton

    server = start_triton(repository, **start)
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def gateway_process(triton_grpc_url: str, log_path: Path, **settings: object) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m serving.gateway` on a free port in front of `triton_grpc_url`, with API key `KEY` and
    `settings` (Settings fields, passed as SERVING_* variables); its URL and process, once ready."""
    import httpx

    from serving.host.launcher import free_port
    from serving.host.process import dying_with_parent

    port = free_port()
    env = {"api_keys": KEY, "sessions_per_key": 256, "log_level": "warning", **settings}
    env = {**os.environ, **{f"SERVING_{k.upper()}": str(v) for k, v in env.items()}}
    env |= {"SERVING_TRITON_URL": triton_grpc_url, "SERVING_PORT": str(port)}
    with log_path.open("wb") as log:
        # dies with this process even where it is killed before the `finally` below (a bench run cut off)
        command, dying = dying_with_parent([sys.executable, "-m", "serving.gateway"])
        process = subprocess.Popen(command, env=env, stdout=log, stderr=log, **dying)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not become ready; see {log_path}")
            time.sleep(0.2)
        yield url, process
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Connection(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection that sends prepared requests and reads each answer with
    httptools' C parser: the load generator's cost per step stays a few tens of microseconds (aiohttp's
    client took about 250), so the machine's cores go to what is measured."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.answer: asyncio.Future | None = None
        self.chunks: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        body, self.chunks = b"".join(self.chunks), []
        self.answer.set_result((self.parser.get_status_code(), body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(ConnectionError(f"the gateway closed the connection: {exc!r}"))

    async def request(self, method: str, path: str, body: bytes = b"", headers: bytes = b"") -> tuple[int, bytes]:
        self.answer = asyncio.get_running_loop().create_future()
        head = f"{method} {path} HTTP/1.1\r\nHost: gateway\r\nContent-Length: {len(body)}\r\n".encode()
        self.transport.write(head + headers + b"\r\n" + body)
        return await self.answer


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes and all their descendants, now."""
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    times = process.cpu_times()
                    total += times.user + times.system
    return total
