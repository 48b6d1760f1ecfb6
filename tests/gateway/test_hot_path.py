"""The busy routes called without FastAPI's per-request work (serving/gateway/hot_path.py): which routes are hot,
that a route with a parameter the hot path does not make stays FastAPI's, and that requests the hot path declines
get FastAPI's own answer through the real gateway; and the transport that writes an answer in one piece
(serving/gateway/server.py), over a real socket pair."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
from fastapi import APIRouter, FastAPI, Header, Request, Response

from serving.gateway import Settings, create_app
from serving.gateway.app import HOT_ROUTES
from serving.gateway.hot_path import HotRoute, HotRoutes
from serving.gateway.server import CoalescedTransport
from serving.gateway.validated import holds_word
from tests.gateway.conftest import b64_tensor, from_b64


def test_every_busy_route_is_called_directly():
    """A route given a parameter of a kind the hot path does not make would silently go back to FastAPI's
    stack: this says which ones did."""
    app = create_app(Settings(api_keys=("k",)))
    assert set(app.state.hot_routes.paths) == HOT_ROUTES
    plain = create_app(Settings(api_keys=("k",), hot_routes=False))  # the bench's FastAPI-only gateway
    assert plain.state.hot_routes.paths == []


def _route(router: APIRouter, path: str):
    return next(route for route in router.routes if route.path == path)


def test_a_route_with_a_parameter_not_made_here_stays_fastapis():
    router = APIRouter()

    @router.post("/plain")
    async def plain(request: Request) -> Response:
        return Response(b"plain")

    @router.post("/header")
    async def with_header(request: Request, x_trace: str = Header()) -> Response:
        return Response(x_trace.encode())

    @router.post("/dict")
    async def returns_a_dict(request: Request) -> dict:
        return {}

    assert HotRoute.of(_route(router, "/plain")) is not None
    assert HotRoute.of(_route(router, "/header")) is None  # a header parameter: FastAPI reads it
    assert HotRoute.of(_route(router, "/dict")) is None  # FastAPI serializes it through the response model
    app = FastAPI()
    hot = HotRoutes(app, app, [_route(router, path) for path in ("/plain", "/header", "/dict")])
    assert hot.paths == [("POST", "/plain")]


def test_a_query_the_hot_path_declines_is_answered_by_fastapi(api):
    """An unknown query parameter is FastAPI's to ignore: the step still runs, and answers in the encoding asked."""
    session = api.post("/v1/sessions").json()["id"]
    try:
        models = api.get("/v1/models").json()["models"]
        width = next(model["d_model"] for model in models if model["kind"] == "session")
        token = np.full((1, 1, width), 0.25, np.float32)
        body = {"hidden_states": b64_tensor(token)}
        answer = api.post(f"/v1/sessions/{session}/step?encoding=b64&trace=1", json=body)
        assert answer.status_code == 200, answer.text
        assert from_b64(answer.json()["output"]).shape == token.shape and answer.json()["length"] == 1
    finally:
        api.delete(f"/v1/sessions/{session}")


def test_a_body_that_does_not_fit_its_model_gets_fastapis_error(api):
    """The hot path declines what its model refuses; FastAPI's validation names the field, as it always did."""
    answer = api.post("/v1/generate", json={"input_ids": [1, 2], "max_new_tokens": "many"})
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "validation_error" and "max_new_tokens" in error["message"], error


# --- one write per answer -----------------------------------------------------------------------------------


def _coalesced_pair() -> tuple[asyncio.AbstractEventLoop, CoalescedTransport, socket.socket]:
    loop = asyncio.new_event_loop()
    ours, peer = socket.socketpair()
    transport, _ = loop.run_until_complete(loop.create_connection(asyncio.Protocol, sock=ours))
    return loop, CoalescedTransport(transport, loop), peer


def _received(peer: socket.socket) -> bytes:
    peer.settimeout(5)
    chunks = []
    while chunk := peer.recv(1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def test_writes_of_one_turn_leave_together_in_order_and_close_sends_what_is_pending():
    loop, transport, peer = _coalesced_pair()
    try:
        transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        transport.write(b"body")
        assert transport.get_write_buffer_size() == len(b"HTTP/1.1 200 OK\r\n\r\nbody")  # held until the turn ends
        loop.run_until_complete(asyncio.sleep(0))
        large = bytes(range(256)) * 1024  # past LARGE_WRITE_BYTES: written at once, after what is pending
        transport.write(b"next")
        transport.write(large)
        transport.write(b"last")
        transport.close()  # before the turn ends: what is pending still goes
        received = loop.run_until_complete(loop.run_in_executor(None, _received, peer))  # the loop sends meanwhile
        assert received == b"HTTP/1.1 200 OK\r\n\r\nbody" + b"next" + large + b"last"
    finally:
        peer.close()
        loop.close()


# --- the edge's scan for booleans ---------------------------------------------------------------------------


def test_a_word_is_found_past_many_candidates_and_not_found_where_it_is_not():
    numbers = b'{"hidden_states": [[[0.5, -1e-05, 2.0]]], "attention_mask": [[1, 1, 1]]}'
    assert not holds_word(numbers, b"true") and not holds_word(numbers, b"false")
    assert holds_word(numbers.replace(b"2.0", b"true"), b"true")
    letters = b'{"b64": "' + b"tftftrufals" * 50 + b'"}'  # candidates past the first 64: searched whole
    assert not holds_word(letters, b"true") and not holds_word(letters, b"false")
    assert holds_word(letters + b"true", b"true") and holds_word(b"false" + letters, b"false")
