"""The gateway over real HTTP (uvicorn on a free loopback port, in a thread) in front of the
session's real Triton (tests/fixtures/triton.py); the fortunes model served (tests/fixtures/fortunes.py)."""

from __future__ import annotations

import base64
import contextlib
import socket
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from contract import names
from serving.engine.ort import Arrays
from serving.gateway import RunningGateway
from tests.fixtures.fortunes import FORTUNES_KEY, FORTUNES_MODEL, FORTUNES_OTHER_KEY, Served, running

KEYS = ("key-one", "key-two")
SESSIONS_PER_KEY = 3
__all__ = ["FORTUNES_KEY", "FORTUNES_MODEL", "FORTUNES_OTHER_KEY", "Served", "running"]  # where tests import them


@pytest.fixture(scope="session")
def gateway(triton) -> Iterator[RunningGateway]:
    settings = {"triton_url": triton.grpc_url}
    with running(api_keys=KEYS, sessions_per_key=SESSIONS_PER_KEY, **settings) as gateway:
        yield gateway


@pytest.fixture
def api(gateway) -> Iterator[httpx.Client]:
    """An HTTP client that sends the first key."""
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=60) as client:
        yield client


def b64_tensor(array: np.ndarray) -> dict:
    return {"dtype": str(array.dtype), "shape": list(array.shape), "b64": base64.b64encode(array.tobytes()).decode()}


def from_b64(tensor: dict) -> np.ndarray:
    raw = base64.b64decode(tensor["b64"])
    return np.frombuffer(raw, dtype=np.dtype(tensor["dtype"]).newbyteorder("<")).reshape(tensor["shape"])


def attend_body(inputs: Arrays, n_layers: int, binary: bool) -> dict:
    """The /v1/attend body for the graph's named inputs."""
    encode = b64_tensor if binary else (lambda a: a.tolist())
    body = {"hidden_states": encode(inputs[names.HIDDEN_STATES])}
    if names.ATTENTION_MASK in inputs:
        body["attention_mask"] = encode(inputs[names.ATTENTION_MASK])
    if names.past_name(0, names.KEY) in inputs:
        body["past_key_values"] = [
            {kind: encode(inputs[names.past_name(i, kind)]) for kind in names.KV_KINDS} for i in range(n_layers)
        ]
    return body


def attend_outputs(answer: dict, binary: bool) -> Arrays:
    """The graph's named outputs from a /v1/attend answer."""
    decode = from_b64 if binary else (lambda t: np.asarray(t, dtype=np.float32))
    outputs = {names.OUTPUT: decode(answer["output"])}
    for i, pair in enumerate(answer["present"]):
        for kind in names.KV_KINDS:
            outputs[names.present_name(i, kind)] = decode(pair[kind])
    return outputs


class FreezableProxy:
    """A TCP relay to a real server that can stop relaying: a hung upstream, made on demand.

    While frozen, bytes wait in the relay (both ways) instead of being forwarded, so calls through
    it stall as they would against a Triton that stopped answering; `thaw()` delivers them.
    """

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.running = threading.Event()
        self.running.set()  # set = relaying
        self.closed = False
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        self.running.clear()

    def thaw(self) -> None:
        self.running.set()

    def close(self) -> None:
        self.closed = True
        self.running.set()
        for sock in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                self.running.wait()
                sink.sendall(chunk)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


WHOLE_KEY = "whole-key"


@pytest.fixture(scope="module")
def whole(artifact_dir, whole_triton):
    """(an HTTP client of a gateway in front of the session's whole-model Triton, with an API key; the
    PyTorch original): a whole model's gateway tests (steps, attend, generation)."""
    from export.artifacts import load_model
    from tests.fixtures.triton import WHOLE_ARTIFACT

    settings = {"triton_url": whole_triton.grpc_url}
    with running(api_keys=(WHOLE_KEY,), **settings) as gateway:
        headers = {"Authorization": f"Bearer {WHOLE_KEY}"}
        with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as api:
            yield api, load_model(artifact_dir(WHOLE_ARTIFACT)).eval()
