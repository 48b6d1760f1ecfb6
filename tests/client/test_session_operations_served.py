"""Session operations through the real Triton of tests/fixtures/triton.py and the client library,
over gRPC and HTTP, sync and asyncio: a restored session continues bit for bit as the uninterrupted
one and within 1e-5 of the PyTorch original over 32 further steps; a fork's branches each equal the
original's forward over their own tokens; a rewind then new tokens equals a session that never had
the dropped ones; a refused blob changes nothing and frees its START."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from client import AsyncClient, Client
from client.errors import InvalidInputError, UnknownSessionError
from tests.fixtures.served import (
    SESSION_PROTOCOLS,
    full_forward,
    hidden,
    live_sequences,
    settled_sequences,
    url,
)

STEPS = 32


@pytest.mark.parametrize("protocol", SESSION_PROTOCOLS)
def test_a_restored_session_continues_as_the_uninterrupted_one(triton, served_cfg, served_reference, protocol):
    pieces = [hidden(served_cfg, 1, 9, seed=20)] + [hidden(served_cfg, 1, 1, seed=21 + i) for i in range(STEPS + 1)]
    with Client(url(triton, protocol), protocol) as client, client.session() as original:
        original.step(pieces[0])
        original.step(pieces[1])
        blob = original.snapshot()
        assert original.length == 10 and isinstance(blob, bytes)
        with client.session(restore=blob) as restored:
            for piece in pieces[2:]:
                theirs, ours = original.step(piece), restored.step(piece)
                np.testing.assert_array_equal(ours, theirs)  # the same graph, the same cache
            assert restored.length == original.length == 10 + STEPS
    np.testing.assert_allclose(ours, full_forward(served_reference, pieces)[:, -1:], rtol=0, atol=1e-5)


def test_the_restored_steps_each_match_the_pytorch_original(triton, served_cfg, served_reference):
    pieces = [hidden(served_cfg, 1, 5, seed=40)] + [hidden(served_cfg, 1, 1, seed=41 + i) for i in range(STEPS)]
    with Client(triton.grpc_url) as client:
        with client.session() as original:
            original.step(pieces[0])
            blob = original.snapshot()
        with client.session(restore=blob) as restored:  # the original is gone: only the blob holds it
            outputs = [restored.step(piece) for piece in pieces[1:]]
    expected = full_forward(served_reference, pieces)[:, 5:]
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("protocol", SESSION_PROTOCOLS)
def test_a_forks_branches_each_equal_the_forward_over_their_own_tokens(triton, served_cfg, served_reference, protocol):
    trunk_tokens = hidden(served_cfg, 1, 7, seed=50)
    left = [hidden(served_cfg, 1, 1, seed=51 + i) for i in range(6)]
    right = [hidden(served_cfg, 1, 1, seed=71 + i) for i in range(6)]
    with Client(url(triton, protocol), protocol) as client, client.session() as trunk:
        trunk.step(trunk_tokens)
        with trunk.fork() as branch:
            assert branch.length == 7 and branch.id != trunk.id
            left_out = np.concatenate([trunk.step(piece) for piece in left], axis=1)
            right_out = np.concatenate([branch.step(piece) for piece in right], axis=1)
    np.testing.assert_allclose(left_out, full_forward(served_reference, [trunk_tokens, *left])[:, 7:], atol=1e-5)
    np.testing.assert_allclose(right_out, full_forward(served_reference, [trunk_tokens, *right])[:, 7:], atol=1e-5)


@pytest.mark.parametrize("protocol", SESSION_PROTOCOLS)
def test_a_rewind_then_new_tokens_equals_never_having_had_the_dropped_ones(
    triton, served_cfg, served_reference, protocol
):
    prompt, dropped = hidden(served_cfg, 1, 8, seed=60), hidden(served_cfg, 1, 3, seed=61)
    after = [hidden(served_cfg, 1, 1, seed=62 + i) for i in range(5)]
    with Client(url(triton, protocol), protocol) as client, client.session() as session:
        session.step(prompt)
        session.step(dropped)
        assert session.rewind(8) == 8 == session.length
        outputs = np.concatenate([session.step(piece) for piece in after], axis=1)
        with pytest.raises(InvalidInputError, match="holds 13 positions: a rewind goes to 0 to 13, got 14"):
            session.rewind(14)
        assert session.length == 13  # the refused rewind changed nothing
    np.testing.assert_allclose(outputs, full_forward(served_reference, [prompt, *after])[:, 8:], atol=1e-5)


def test_a_refused_blob_changes_nothing_and_gives_its_start_back(triton, served_cfg):
    with Client(triton.grpc_url) as client:
        with client.session() as session:
            session.step(hidden(served_cfg, 1, 4, seed=80))
            blob = session.snapshot()
        before = settled_sequences(triton)
        for bad, message in ((blob[:100], "not a session snapshot"), (b"nonsense", "not a session snapshot")):
            refused = client.session(restore=bad)
            with pytest.raises(InvalidInputError, match=message):
                refused.open()
        assert live_sequences(triton, before) == before
        with client.session(restore=blob) as good:  # and the server goes on restoring
            assert good.step(hidden(served_cfg, 1, 1, seed=81)).shape == (1, 1, served_cfg.d_model)
            assert good.length == 5


def test_operations_on_a_session_not_open_are_refused_before_sending(triton):
    with Client(triton.grpc_url) as client:
        fresh = client.session()
        with pytest.raises(UnknownSessionError, match="not open yet"):
            fresh.snapshot()
        with pytest.raises(UnknownSessionError, match="not open yet"):
            fresh.fork()


def test_async_snapshot_restore_and_fork(triton, served_cfg, served_reference):
    pieces = [hidden(served_cfg, 1, 6, seed=90), hidden(served_cfg, 1, 1, seed=91)]

    async def run() -> tuple[np.ndarray, np.ndarray]:
        async with AsyncClient(triton.grpc_url) as client:
            async with client.session() as original:
                await original.step(pieces[0])
                blob = await original.snapshot()
                async with await original.fork() as branch:
                    forked = await branch.step(pieces[1])
            async with client.session(restore=blob) as restored:
                return forked, await restored.step(pieces[1])

    forked, restored = asyncio.run(run())
    np.testing.assert_array_equal(forked, restored)
    np.testing.assert_allclose(restored, full_forward(served_reference, pieces)[:, 6:], atol=1e-5)


def test_sixteen_sessions_from_one_prefix_each_equal_a_session_that_prefilled_it(triton, served_cfg, served_reference):
    """The prefix is prefilled once; each session starts from a copy and goes its own way."""
    prefix = hidden(served_cfg, 1, 12, seed=100)
    with Client(triton.grpc_url) as client:
        assert client.put_prefix("system", prefix) == 12 and client.prefixes() == {"system": 12}
        with pytest.raises(InvalidInputError, match="exists and is immutable"):
            client.put_prefix("system", prefix)
        sessions = [client.session(prefix="system") for _ in range(16)]
        tokens = [hidden(served_cfg, 1, 1, seed=101 + i) for i in range(16)]
        outputs = [session.step(token) for session, token in zip(sessions, tokens, strict=True)]
        for session, token, output in zip(sessions, tokens, outputs, strict=True):
            assert session.length == 13
            np.testing.assert_allclose(output, full_forward(served_reference, [prefix, token])[:, 12:], atol=1e-5)
            session.close()
        with client.session() as prefilled:  # the same tokens the long way: bit for bit the same
            prefilled.step(prefix)
            np.testing.assert_array_equal(prefilled.step(tokens[0]), outputs[0])
        client.delete_prefix("system")
        assert client.prefixes() == {}
        with pytest.raises(InvalidInputError, match="prefix 'system' is unknown here"):
            client.session(prefix="system").open()
        # another owner's prefix of the same name is another prefix
        client.put_prefix("system", prefix, owner="a")
        with pytest.raises(InvalidInputError, match="unknown here"):
            Client(triton.grpc_url).session(prefix="system", owner="b").open()
        with client.session(prefix="system", owner="a") as session:
            assert session.step(tokens[1]).shape == (1, 1, served_cfg.d_model)
        client.delete_prefix("system", owner="a")


def test_a_prefix_a_server_lost_is_put_again_from_the_clients_copy(triton, served_cfg, served_reference):
    """What a replica that never saw the prefix (or restarted) does: it answers prefix_unknown, and
    the client puts the prefix there from its own copy, then starts the session."""
    prefix = hidden(served_cfg, 1, 6, seed=120)
    token = hidden(served_cfg, 1, 1, seed=121)
    with Client(triton.grpc_url) as owner_client, Client(triton.grpc_url) as other:
        owner_client.put_prefix("doc", prefix)
        other.delete_prefix("doc")  # the server forgets it behind owner_client's back
        with owner_client.session(prefix="doc") as session:
            output = session.step(token)
        np.testing.assert_allclose(output, full_forward(served_reference, [prefix, token])[:, 6:], atol=1e-5)
        owner_client.delete_prefix("doc")
