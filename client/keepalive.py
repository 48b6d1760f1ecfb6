"""Requests to Triton's HTTP/REST endpoint over HTTP/1.1 keep-alive connections, each answer read with
httptools' parser: the transport of the asyncio client's session requests when it is given Triton's HTTP
address (`AsyncClient(session_http_url=...)`; the gateway's `SERVING_TRITON_HTTP_URL`).

Why its own transport: a session step cost the calling process about 165 us of CPU over grpc.aio, about 80
over one of these connections and 270 to 310 over tritonclient.http.aio's aiohttp session (the same Triton,
16 sessions stepping, docs/design.md "The gateway at the speed of gRPC"). The protocol stays tritonclient's:
client/affinity.py builds the request with its request builder and reads a failed answer with its error reader
(a good one with client/_wire.py's HttpResult, tested against its InferResult); this module only carries bytes.
A connection serves one request at a time; one cut short (a timeout, a cancelled request, a broken answer) is
closed, never reused, so a late answer cannot be read as the next request's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

# idle connections kept for reuse: one per request in flight at the busiest moment, up to this (a gateway of 16
# keys' 16 sessions each); more may be open meanwhile, each closed when its answer finds the pool full
KEPT_IDLE = 256


class Answer:
    """An HTTP answer: status, headers (lower-case names) and body; `status_code` and `read()` as tritonclient's
    error reader asks of a response."""

    __slots__ = ("body", "headers", "status_code")

    def __init__(self, status_code: int, headers: dict[str, str], body: bytes) -> None:
        self.status_code, self.headers, self.body = status_code, headers, body

    def read(self) -> bytes:
        return self.body


def _httptools() -> Any:
    try:
        import httptools
    except ImportError:  # the client package alone does not bring it; the serving extra does (uvicorn's parser)
        raise ImportError(
            "session_http_url needs httptools (pip install httptools, or attention-serving[serving])"
        ) from None
    return httptools


class _Connection(asyncio.Protocol):
    def __init__(self, address: str, httptools: Any) -> None:
        self.address = address
        self.parser = httptools.HttpResponseParser(self)
        self.parse_error = httptools.HttpParserError
        self.transport: asyncio.Transport | None = None
        self.answer: asyncio.Future | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.open = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.answer is None or self.answer.done():  # bytes nobody asked for: not to be read as the next answer
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except self.parse_error as error:
            self._fail(ConnectionError(f"Triton at {self.address} answered what is not HTTP/1.1: {error}"))
            self.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        answer = Answer(self.parser.get_status_code(), self.headers, b"".join(self.chunks))
        self.headers, self.chunks = {}, []
        if answer.status_code < 200:  # an interim answer (100 Continue): the answer follows
            return
        if not self.parser.should_keep_alive():
            self.open = False
        if self.answer is None or self.answer.done():  # an answer nobody asked for: the connection is not ours
            self.close()
            return
        self.answer.set_result(answer)

    def eof_received(self) -> None:
        self.open = False  # closing: connection_lost comes a loop turn later, too late for a request taken meanwhile

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._fail(ConnectionResetError(f"Triton at {self.address} closed the connection before answering ({exc!r})"))

    def _fail(self, error: Exception) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(error)

    async def exchange(self, head: bytes, body: bytes, timeout: float | None) -> Answer:
        loop = asyncio.get_running_loop()
        self.answer = loop.create_future()
        self.transport.writelines((head, body))
        # a timer, not asyncio.timeout: the same end at a fraction of its cost on every request
        timer = None if timeout is None else loop.call_later(timeout, self._timed_out, timeout)
        try:
            return await self.answer
        finally:
            if timer is not None:
                timer.cancel()

    def _timed_out(self, timeout: float) -> None:
        self._fail(TimeoutError(f"no answer from Triton at {self.address} within {timeout:g} s"))

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()


class KeepAlivePool:
    """POSTs to one Triton HTTP address, each on an idle connection of the pool or a new one. `url`: host:port
    (an `http://` prefix is dropped)."""

    def __init__(self, url: str) -> None:
        self.address = url.removeprefix("http://").rstrip("/")
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"Triton's HTTP address must be host:port, got {url!r}")
        self.host, self.port = host.strip("[]"), int(port)
        self._httptools = _httptools()
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self._closed = False

    async def post(self, uri: str, body: bytes, headers: Mapping[str, str], timeout: float | None = None) -> Answer:
        """The answer to `POST /uri`; OSError when Triton cannot be reached or drops the connection, TimeoutError
        past `timeout` seconds, connecting included (the connection is closed then: its answer may still come);
        ValueError for a header that would break the request's head (a line break, a NUL, not latin-1)."""
        head = self._head(uri, len(body), headers)
        connection = await self._connection(timeout)
        self._busy.add(connection)
        finished = False
        try:
            answer = await connection.exchange(head, body, timeout)
            finished = True
            return answer
        finally:
            self._busy.discard(connection)
            if finished and connection.open and not self._closed and len(self._idle) < KEPT_IDLE:
                self._idle.append(connection)
            else:
                connection.close()

    def _head(self, uri: str, length: int, headers: Mapping[str, str]) -> bytes:
        lines = [f"POST /{uri} HTTP/1.1\r\nHost: {self.address}\r\nContent-Length: {length}\r\n"]
        for name, value in headers.items():
            if any(mark in f"{name}{value}" for mark in "\r\n\0"):
                raise ValueError(f"header {name!r}: {value!r} holds a line break or a NUL")
            lines.append(f"{name}: {value}\r\n")
        return "".join(lines).encode("latin-1") + b"\r\n"

    async def _connection(self, timeout: float | None) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if connection.open and not connection.transport.is_closing():  # Triton may have closed it while idle
                return connection
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):  # a new connection only: the deadline covers connecting too
                _, connection = await loop.create_connection(self._new_connection, self.host, self.port)
        except TimeoutError:
            raise TimeoutError(f"no connection to Triton at {self.address} within {timeout:g} s") from None
        except OSError as error:  # named: uvloop's words do not say where
            named = f"{error.strerror or error} (Triton's HTTP address {self.address})"
            raise type(error)(error.errno, named) from None
        return connection

    def _new_connection(self) -> _Connection:
        return _Connection(self.address, self._httptools)

    async def close(self) -> None:
        """Close every connection, idle or in use (a request in flight fails with ConnectionResetError; one still
        connecting is closed when its answer comes)."""
        self._closed = True
        for connection in [*self._idle, *self._busy]:
            with contextlib.suppress(Exception):
                connection.close()
        self._idle.clear()
