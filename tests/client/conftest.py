"""Fixtures for the client tests: real loopback sockets standing in for a server that is down,
broken or silent (no mocks: the client's own transport meets each of them)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from concurrent import futures

import grpc
import pytest


class Listener:
    """A TCP server on a free loopback port that counts connections and then closes each at once
    (`mode="close"`) or holds it open without answering (`mode="silent"`)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self._sock.getsockname()[1]}"

    def _serve(self) -> None:
        self._sock.settimeout(0.05)  # wake up to notice close(): closing does not interrupt accept()
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            if self.mode == "close":
                conn.close()
            else:
                self._held.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        for conn in self._held:
            conn.close()


@pytest.fixture
def refusing_url():
    """A loopback port that refuses connections, like a stopped server: bound (so nothing else
    takes it meanwhile) but not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def closing_listener():
    listener = Listener("close")
    yield listener
    listener.close()


class SilentGrpcServer:
    """A gRPC server that takes every call and never answers it (until closed)."""

    def __init__(self) -> None:
        self.calls = 0
        self._released = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self._server.add_generic_rpc_handlers([self])
        self._port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self._port}"

    def service(self, handler_call_details):  # grpc.GenericRpcHandler
        return grpc.unary_unary_rpc_method_handler(self._hang)

    def _hang(self, request: bytes, context) -> bytes:
        self.calls += 1
        self._released.wait(30)
        return b""

    def close(self) -> None:
        self._released.set()
        self._server.stop(0)


@pytest.fixture(params=["grpc", "http"])
def silent_server(request):
    """(protocol, url) of a server that accepts requests and never answers them."""
    server = SilentGrpcServer() if request.param == "grpc" else Listener("silent")
    yield request.param, server.url
    server.close()


class DelayedProxy:
    """A server that is down, then comes up: its port refuses connections until `open()`, then
    forwards every connection to `target` ("host:port"), byte for byte. `cut()` takes it down again
    while the server behind it lives on (a network that drops it): every connection is reset, and new
    ones are reset on arrival, until `open()`."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        self._stop = threading.Event()
        self._cut = threading.Event()
        self._serving = False
        self._open: list[socket.socket] = []

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self._sock.getsockname()[1]}"

    def open(self) -> None:
        self._cut.clear()
        if self._serving:
            return
        self._serving = True
        self._sock.listen(16)
        self._sock.settimeout(0.05)
        threading.Thread(target=self._serve, daemon=True).start()

    def cut(self) -> None:
        self._cut.set()
        connections, self._open = self._open, []
        for conn in connections:
            _reset(conn)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._cut.is_set():
                _reset(client)
                continue
            upstream = socket.create_connection(self._target)
            self._open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        for conn in self._open:
            conn.close()


def _reset(conn: socket.socket) -> None:
    """Drop a connection as a broken network does: an RST (no lingering), its pumps woken."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.shutdown(socket.SHUT_RDWR)
    conn.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:  # the other side or close() ended it
        pass
