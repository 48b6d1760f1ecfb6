"""The asyncio client's session requests over Triton's HTTP port (`session_http_url`, client/keepalive.py):
against the real Triton of tests/fixtures/triton.py they answer what the same requests answer over gRPC, bit
for bit and within 1e-5 of the PyTorch original, with the server's errors typed and named as over gRPC;
against sockets that misbehave (refuse, hang up, answer garbage, never answer, never accept, answer unasked) each
request fails with a typed error within its deadline and its connection is never used again; a header that would
break the request's head is refused before anything is sent."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from client import AsyncClient, affinity
from client.errors import InvalidInputError, RequestTimeoutError, ServerUnavailableError
from client.keepalive import KeepAlivePool
from contract import errors as kinds
from tests.fixtures.served import full_forward, hidden


def over_http(triton, **kwargs) -> AsyncClient:
    return AsyncClient(triton.grpc_url, "grpc", session_http_url=triton.http_url, **kwargs)


def test_a_session_over_http_steps_as_one_over_grpc_and_as_the_original(triton, served_cfg, served_reference):
    pieces = [hidden(served_cfg, 1, 6, seed=300)] + [hidden(served_cfg, 1, 1, seed=301 + i) for i in range(8)]

    async def both() -> tuple:
        async with (
            AsyncClient(triton.grpc_url, "grpc") as grpc_client,
            over_http(triton) as http_client,
            grpc_client.session() as by_grpc,
            http_client.session() as by_http,
        ):
            theirs = [await by_grpc.step(piece) for piece in pieces]
            ours = [await by_http.step(piece) for piece in pieces]
            blob = await by_http.snapshot()
            assert await by_http.rewind(5) == 5
            rewound = await by_http.step(pieces[-1])
            async with grpc_client.session(restore=blob) as restored:  # an HTTP snapshot, restored over gRPC
                again = await restored.step(pieces[-1])
            return theirs, ours, by_http.length, rewound, again

    theirs, ours, length, rewound, again = asyncio.run(both())
    for mine, other in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(mine, other)
    assert length == 6  # rewound to 5, then one more
    expected = full_forward(served_reference, pieces)
    np.testing.assert_allclose(np.concatenate(ours, axis=1), expected, rtol=0, atol=1e-5)
    rewound_expected = full_forward(served_reference, [pieces[0][:, :5], pieces[-1]])[:, -1:]  # the prompt's first 5
    np.testing.assert_allclose(rewound, rewound_expected, rtol=0, atol=1e-5)
    appended = full_forward(served_reference, [*pieces, pieces[-1]])[:, -1:]
    np.testing.assert_allclose(again, appended, rtol=0, atol=1e-5)


def test_the_servers_errors_over_http_are_typed_and_named_as_over_grpc(triton, served_cfg):
    wrong_width = np.zeros((1, 2, served_cfg.d_model + 1), np.float32)

    too_long = hidden(served_cfg, 1, served_cfg.max_seq_len + 1, seed=2)

    async def refused() -> tuple[Exception, Exception]:
        async with over_http(triton, validate=False) as client:  # the server's own checks answer
            with pytest.raises(InvalidInputError) as bad:  # Triton's own check of the input's shape
                async with client.session() as session:
                    await session.step(wrong_width)
            with pytest.raises(InvalidInputError) as long:  # the model's, with its kind
                async with client.session() as session:
                    await session.step(too_long)
            return bad.value, long.value

    bad, long = asyncio.run(refused())
    assert bad.status == "400" and "'hidden_states'" in bad.message and f"[1,2,{served_cfg.d_model + 1}]" in bad.message
    assert (long.status, long.kind) == ("400", kinds.SEQUENCE_TOO_LONG)
    assert f"would hold {served_cfg.max_seq_len + 1} positions" in long.message


@contextlib.asynccontextmanager
async def misbehaving(answer: bytes | None, close: bool):
    """A TCP server on a free loopback port that reads a request, then writes `answer` (None: nothing) and hangs
    up when `close`; its address and the number of connections it accepted."""
    accepted = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await reader.read(1)
        if answer is not None:
            writer.write(answer)
            await writer.drain()
        if close:
            writer.close()
        else:
            await asyncio.sleep(30)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}", accepted
    finally:
        for writer in accepted:
            writer.close()
        server.close()


@pytest.mark.parametrize(
    ("answer", "close", "error", "words"),
    [
        (None, True, ServerUnavailableError, "closed the connection before answering"),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", False, ServerUnavailableError, "answered what is not HTTP/1.1"),
        (None, False, RequestTimeoutError, "no answer in time"),
    ],
    ids=["hangs-up", "not-http", "never-answers"],
)
def test_a_request_that_fails_on_the_wire_is_typed_and_its_connection_never_reused(answer, close, error, words):
    steps = np.zeros((1, 1, 8), np.float32)

    async def twice() -> tuple[list, list]:
        async with misbehaving(answer, close) as (address, accepted):
            client = AsyncClient("127.0.0.1:1", "grpc", session_http_url=address, timeout=0.5, validate=False)
            raised = []
            for _ in range(2):
                with pytest.raises(error) as failed:
                    await client.session().step(steps)
                raised.append(failed.value)
            await client.close()
            return raised, accepted

    raised, accepted = asyncio.run(twice())
    assert all(words in failure.message for failure in raised), [failure.message for failure in raised]
    assert len(accepted) == 2  # the second request did not reuse the first's connection


def test_a_refused_address_is_unavailable_and_a_bad_one_is_refused_at_once():
    async def refused() -> ServerUnavailableError:
        async with AsyncClient("127.0.0.1:1", "grpc", session_http_url="127.0.0.1:1", validate=False) as client:
            with pytest.raises(ServerUnavailableError) as failed:
                await client.session().step(np.zeros((1, 1, 8), np.float32))
            return failed.value

    assert "(Triton's HTTP address 127.0.0.1:1)" in asyncio.run(refused()).message
    with pytest.raises(ValueError, match="host:port"):
        KeepAlivePool("triton")
    with pytest.raises(ValueError, match="for a gRPC client"):
        AsyncClient("127.0.0.1:8000", "http", session_http_url="127.0.0.1:8000")


def test_a_session_goes_on_over_the_transport_its_pin_was_made_on(triton, served_cfg):
    """A proxy's pin names a replica on one of its listeners: a session pinned over gRPC goes on over gRPC even in
    a client of HTTP session requests, and one pinned over HTTP is refused by a gRPC-only client and by a generation
    (a gRPC stream), by name."""
    from serving.host.launcher import free_port

    token = hidden(served_cfg, 1, 1, seed=3)
    closed = f"127.0.0.1:{free_port()}"  # nothing listens: a request sent there fails

    async def pinned() -> tuple:
        async with (
            AsyncClient(triton.grpc_url, "grpc") as grpc_only,
            AsyncClient(triton.grpc_url, "grpc", session_http_url=closed) as client,
        ):
            async with grpc_only.session() as opened:
                await opened.step(token)
                # the same session in the other client, pinned as a proxy's gRPC listener would (Triton ignores it)
                output = await client.session(opened.id, replica="Z3JwYy1yZXBsaWNh").step(token)
                over_http_pin = affinity.HTTP_PIN + "aHR0cC1yZXBsaWNh"
                with pytest.raises(ServerUnavailableError) as refused:
                    await grpc_only.session(opened.id, replica=over_http_pin).step(token)
                with pytest.raises(ServerUnavailableError) as not_streamed:
                    async for _ in client.session(opened.id, replica=over_http_pin).generate([1, 2]):
                        pass
                await opened.step(token)
                length = opened.length  # as the server counts it
            with pytest.raises(ServerUnavailableError) as unpinned:
                await client.session().step(token)
        return output, length, unpinned.value, refused.value, not_streamed.value

    output, length, unpinned, refused, not_streamed = asyncio.run(pinned())
    assert output.shape == (1, 1, served_cfg.d_model) and length == 3  # the refused step never left
    assert closed in unpinned.message
    assert "through the proxy's HTTP port" in refused.message and "session_http_url" in refused.message
    assert "generation streams over gRPC" in not_streamed.message and "SERVING_TRITON_HTTP_URL" in not_streamed.message


def test_the_deadline_covers_connecting_to_an_address_that_never_accepts():
    """A listener whose backlog is full drops new connection attempts, as a black-holed address does: the request
    ends at its timeout, not after the kernel's minutes of retries."""
    import socket
    import time

    with contextlib.ExitStack() as held:
        listener = held.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        address = listener.getsockname()
        for _ in range(4):  # fill the backlog; never accepted
            filler = held.enter_context(socket.socket())
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(address)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"within 0\.5 s"):
            asyncio.run(KeepAlivePool(f"127.0.0.1:{address[1]}").post("v2/models/m/infer", b"", {}, timeout=0.5))
        assert time.monotonic() - started < 5


def test_a_header_that_would_break_the_requests_head_is_refused_before_anything_is_sent():
    pool = KeepAlivePool("127.0.0.1:1")  # nothing listens: a request that left would fail otherwise
    for value in ("pin\r\nX-Injected: 1", "pin\n", "pin\0", "pin\u2028"):
        with pytest.raises(ValueError, match=r"line break or a NUL|latin-1"):  # or what latin-1 cannot write
            asyncio.run(pool.post("v2/models/m/infer", b"", {"x-session-replica": value}))


def test_an_interim_answer_is_skipped_and_bytes_nobody_asked_for_close_the_connection():
    """`100 Continue` then the answer: the answer is the request's; a stray answer after it closes the connection,
    so it is never read as the next request's."""
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    stray = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray"

    async def twice() -> tuple[list, list]:
        accepted = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer)
            while await reader.read(65536):
                writer.write(interim + answer)
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(stray)  # after the answer, with no request waiting

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        pool = KeepAlivePool(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            answers = []
            for _ in range(2):
                answers.append(await pool.post("v2/models/m/infer", b"{}", {}, timeout=5))
                await asyncio.sleep(0.2)  # the stray answer arrives meanwhile
            return answers, accepted
        finally:
            await pool.close()
            for writer in accepted:
                writer.close()
            server.close()

    answers, accepted = asyncio.run(twice())
    assert [(a.status_code, a.body) for a in answers] == [(200, b"ok"), (200, b"ok")]
    assert len(accepted) == 2  # the connection that received the stray answer was closed, not reused
