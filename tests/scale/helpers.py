"""Session steps and stateless calls through Envoy with tritonclient (client/affinity.py keeps the
answer's headers), and who served them, read from Envoy's access log."""

from __future__ import annotations

import base64
import itertools
import random
import time

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from client import affinity
from contract import names
from contract.config import preset

MODULES = {"grpc": grpcclient, "http": httpclient}
D_MODEL = preset("tiny").d_model
_ids = itertools.count(random.randrange(1 << 50, 1 << 51))  # apart from other tests' sequence ids


def new_session_id() -> int:
    return next(_ids)


def client(url: str, protocol: str):
    return MODULES[protocol].InferenceServerClient(url)


def hidden(protocol: str, tokens: int = 1, seed: int = 0) -> list:
    array = np.random.default_rng(seed).standard_normal((1, tokens, D_MODEL)).astype(np.float32)
    tensor = MODULES[protocol].InferInput(names.HIDDEN_STATES, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return [tensor]


def http_infer_headers(url: str, model: str, array: np.ndarray) -> dict[str, str]:
    """The headers of the answer to one stateless call over HTTP (KServe v2 JSON; tritonclient's HTTP client
    drops them), the call answered 200."""
    import httpx

    tensor = {
        "name": names.HIDDEN_STATES,
        "shape": list(array.shape),
        "datatype": "FP32",
        "data": array.ravel().tolist(),
    }
    answer = httpx.post(f"http://{url}/v2/models/{model}/infer", json={"inputs": [tensor]}, timeout=30)
    assert answer.status_code == 200, answer.text
    return {name.lower(): value for name, value in answer.headers.items()}


def protocol_of(stub) -> str:
    return "grpc" if type(stub).__module__.startswith("tritonclient.grpc") else "http"


def step(stub, session_id: int, pin: str | None, *, start=False, end=False, tokens=1, seed=0):
    """One step of a session: (output, the replica the answer names or None)."""
    result, answer = affinity.infer(
        stub,
        "sessions",
        hidden(protocol_of(stub), tokens, seed),
        headers=affinity.step_headers(session_id, pin),
        sequence_id=session_id,
        sequence_start=start,
        sequence_end=end,
    )
    return result.as_numpy(names.OUTPUT), affinity.replica_from(answer)


def start(stub, session_id: int, end: bool = False) -> str:
    """A session's first step (and last, with `end`); returns its pin (the replica the answer names)."""
    _, pin = step(stub, session_id, None, start=True, end=end, tokens=2)
    assert pin, "the answer to a session's first step names no replica"
    return pin


def new_sessions_go_to(stub, count: int) -> set[str]:
    """The replicas `count` new sessions reach (each started and ended in one request)."""
    return {address(start(stub, new_session_id(), end=True)) for _ in range(count)}


def sessions_on(stub, server, at_least: int = 2, tries: int = 60) -> dict[int, str]:
    """Sessions started until `at_least` are pinned to `server` (the others are ended): {session: pin}."""
    mine = {}
    for _ in range(tries):
        session = new_session_id()
        pin = start(stub, session)
        if address(pin) in (server.grpc_url, server.http_url):
            mine[session] = pin
            if len(mine) == at_least:
                return mine
        else:
            step(stub, session, pin, end=True)
    raise AssertionError(f"{tries} sessions and fewer than {at_least} on {server.grpc_url}")


def end_all(stub, pins: dict[int, str | None]) -> None:
    """End sessions (an empty END step each), so that their replica has none open when it stops."""
    for session, pin in pins.items():
        _, _ = affinity.infer(
            stub,
            "sessions",
            hidden(protocol_of(stub), tokens=0),
            headers=affinity.step_headers(session, pin),
            sequence_id=session,
            sequence_end=True,
        )


def address(pin: str) -> str:
    """The replica a pin names: Envoy's header-based session state is the base64 of host:port."""
    return base64.b64decode(pin).decode()


def served(envoy, session_ids, count: int, route: str | None = None, timeout: float = 5.0) -> dict[int, list[str]]:
    """{session id: [upstream host of each of its requests]} once `count` of them are logged (those
    of one route of the config if given: "pinned_step", "session_start")."""
    wanted = {str(i) for i in session_ids}
    deadline = time.monotonic() + timeout
    while True:
        entries = [e for e in envoy.access_log() if e["session_id"] in wanted and route in (None, e["route"])]
        if len(entries) >= count or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(entries) == count, f"{len(entries)} of {count} requests in Envoy's access log"
    hosts: dict[int, list[str]] = {}
    for entry in entries:
        hosts.setdefault(int(entry["session_id"]), []).append(entry["upstream_host"])
    return hosts
