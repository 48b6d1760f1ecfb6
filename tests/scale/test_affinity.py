"""client/affinity.py with tritonclient's gRPC clients, blocking and asyncio, through a real Envoy (a session's
requests are streams of one request: the session model is decoupled, which Triton takes on streams only): the
first answer of a session names its replica, the pin sent back keeps it there, errors come back as tritonclient
raises them; straight to Triton nothing is named; an HTTP client is told to use gRPC before anything is sent."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from client import affinity
from contract import names
from contract.routing import REPLICA_HEADER, SESSION_HEADER
from tests.scale.helpers import D_MODEL, address, client, new_session_id, step

pytestmark = pytest.mark.timeout(120)


def test_step_headers_carry_the_session_and_once_known_its_replica():
    assert affinity.step_headers(42) == {SESSION_HEADER: "42"}
    assert affinity.step_headers(42, "MTI3LjAuMC4xOjgwMDE=") == {
        SESSION_HEADER: "42",
        REPLICA_HEADER: "MTI3LjAuMC4xOjgwMDE=",
    }
    assert affinity.replica_from({"X-Session-Replica": "abc", "date": "now"}) == "abc"
    assert affinity.replica_from({"server": "envoy"}) is None


@pytest.mark.parametrize("protocol", ["grpc"])
def test_a_blocking_client_keeps_its_session_on_one_replica(proxy, protocol):
    with client(proxy.grpc_url if protocol == "grpc" else proxy.http_url, protocol) as stub:
        session = new_session_id()
        output, pin = step(stub, session, None, start=True, tokens=2)
        assert output.shape == (1, 2, D_MODEL) and pin
        for k in range(3):
            _, named = step(stub, session, pin, end=k == 2)
            assert named is None
        with pytest.raises(InferenceServerException, match="START"):  # ended: Triton's own answer
            step(stub, session, pin)
    assert address(pin).startswith("127.0.0.1:")


async def _async_session(url: str, protocol: str) -> tuple[list, list, str]:
    if protocol == "grpc":
        import tritonclient.grpc.aio as module
    else:
        import tritonclient.http.aio as module
    stub = module.InferenceServerClient(url)
    session, pin, named, shapes = new_session_id(), None, [], []
    try:
        for k in range(3):
            array = np.ones((1, 2 if k == 0 else 1, D_MODEL), np.float32)
            tensor = module.InferInput(names.HIDDEN_STATES, list(array.shape), "FP32")
            tensor.set_data_from_numpy(array)
            result, answer = await affinity.infer(
                stub,
                "sessions",
                [tensor],
                headers=affinity.step_headers(session, pin),
                sequence_id=session,
                sequence_start=k == 0,
                sequence_end=k == 2,
            )
            shapes.append(result.as_numpy(names.OUTPUT).shape)
            named.append(affinity.replica_from(answer))
            pin = pin or named[-1]
        with pytest.raises(InferenceServerException, match="START"):
            await affinity.infer(
                stub, "sessions", [tensor], headers=affinity.step_headers(session, pin), sequence_id=session
            )
    finally:
        await stub.close()
    return shapes, named, pin


@pytest.mark.parametrize("protocol", ["grpc"])
def test_an_asyncio_client_keeps_its_session_on_one_replica(proxy, protocol):
    url = proxy.grpc_url if protocol == "grpc" else proxy.http_url
    shapes, named, pin = asyncio.run(_async_session(url, protocol))
    assert shapes == [(1, 2, D_MODEL), (1, 1, D_MODEL), (1, 1, D_MODEL)]
    assert named[0] == pin and named[1:] == [None, None]
    assert address(pin).startswith("127.0.0.1:")


def test_an_http_client_is_refused_before_anything_is_sent(proxy):
    from client.errors import ClientError

    with client(proxy.http_url, "http") as stub, pytest.raises(ClientError, match="gRPC streams only"):
        step(stub, new_session_id(), None, start=True)


@pytest.mark.parametrize("protocol", ["grpc"])
def test_straight_to_triton_no_replica_is_named(replicas, protocol):
    server = replicas[0]
    with client(server.grpc_url if protocol == "grpc" else server.http_url, protocol) as stub:
        session = new_session_id()
        _, named = step(stub, session, None, start=True, end=True)
    assert named is None
