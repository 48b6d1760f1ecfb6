"""A recovery leaves no sequence behind on a server that lived through the fault. A durable session
(a directory store) reaches the shared Triton (tests/fixtures/triton.py) through a relay; the relay is
cut (every connection reset, as a dropped network does, tests/client/conftest.py `DelayedProxy.cut`)
and back a second later. The next step is served by a recovery under a new sequence id, within 1e-5 of
the PyTorch original over the real tokens (a padded step's padding never entered the replay log), and
the lost sequence, still alive in Triton, is ENDed: the session model's gauge of live sequences is
back to one for the session within seconds, not after the idle timeout (60 s on this Triton, 300 s by
default), and a step of the lost id is answered as one Triton does not hold. With the END left out,
the gauge still counts the lost sequence 5 s later (checked once by hand).

Why a relay and not SIGSTOP: a stopped Triton answers nothing, so the step times out
(RequestTimeoutError), which starts no recovery (the step may have been applied; the session reports
it); a connection that breaks is what reads as an unreachable server (ServerUnavailableError).
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from client import AsyncClient, Client, UnknownSessionError
from contract import names
from tests.client.conftest import DelayedProxy
from tests.fixtures.served import SEQUENCES, full_forward, hidden, live_sequences
from tests.fixtures.triton import TEST_SETTINGS, metric

BACK_AFTER_S = 1.0  # the relay's outage: within the client's recovery_timeout (30 s)
ENDED_WITHIN_S = 5.0  # the lost sequence's END, detached, arrives in well under this
EVERY = 4  # checkpoint interval: the first step (6 positions) is in the store, the second in the replay log
PADDED = np.array([[0, 1, 1]])  # the second step's mask: the replay log keeps its 2 real tokens only
assert TEST_SETTINGS.idle_timeout_seconds > 4 * ENDED_WITHIN_S  # the END, not the idle timeout, frees it


@pytest.fixture
def relay(triton):
    proxy = DelayedProxy(triton.grpc_url)
    proxy.open()
    yield proxy
    proxy.close()


def pieces(served_cfg) -> list[np.ndarray]:
    return [hidden(served_cfg, 1, 6, seed=40), hidden(served_cfg, 1, 3, seed=41), hidden(served_cfg, 1, 2, seed=42)]


def cut_for_a_while(relay: DelayedProxy) -> None:
    relay.cut()
    threading.Timer(BACK_AFTER_S, relay.open).start()


def assert_rebuilt(session, lost: int, output: np.ndarray, served_reference, steps: list[np.ndarray]) -> None:
    assert session.recoveries == 1 and session.id != lost, (session.recoveries, session.id, lost)
    # the sequence of the real tokens (the model has no positions: a padded token is as if never sent)
    real = [steps[0], steps[1][:, PADDED[0].astype(bool)], steps[2]]
    expected = full_forward(served_reference, real)[:, -steps[-1].shape[1] :]
    np.testing.assert_allclose(output, expected, rtol=0, atol=1e-5)


def assert_lost_sequence_ended(triton, lost: int, live: float) -> None:
    """The gauge reads `live` (the rebuilt session, not also the lost one), and Triton no longer holds
    the lost id: a step of it is refused, not served."""
    assert live_sequences(triton, live, ENDED_WITHIN_S) == live
    with Client(triton.grpc_url) as direct:
        token = np.zeros((1, 1, direct.metadata(names.SESSION_MODEL).d_model), np.float32)
        with pytest.raises(UnknownSessionError):
            direct.session(lost, replica="").step(token)


def test_a_recovery_ends_the_sequence_it_left_on_a_live_server(triton, served_cfg, served_reference, relay, tmp_path):
    steps, before = pieces(served_cfg), metric(triton, SEQUENCES, names.SESSION_MODEL)
    with Client(relay.url, session_store=tmp_path, checkpoint_every=EVERY) as client, client.session() as session:
        session.step(steps[0])
        session.step(steps[1], PADDED)
        assert live_sequences(triton, before + 1) == before + 1
        lost = session.id
        cut_for_a_while(relay)
        output = session.step(steps[2])
        assert_rebuilt(session, lost, output, served_reference, steps)
        assert_lost_sequence_ended(triton, lost, before + 1)
    assert live_sequences(triton, before) == before


def test_an_asyncio_recovery_ends_the_sequence_it_left_too(triton, served_cfg, served_reference, relay, tmp_path):
    """The END is a task of the client's event loop: the step returns before it is answered."""
    steps, before = pieces(served_cfg), metric(triton, SEQUENCES, names.SESSION_MODEL)

    async def run() -> None:
        client = AsyncClient(relay.url, session_store=tmp_path, checkpoint_every=EVERY)
        async with client, client.session() as session:
            await session.step(steps[0])
            await session.step(steps[1], PADDED)
            assert await asyncio.to_thread(live_sequences, triton, before + 1) == before + 1
            lost = session.id
            cut_for_a_while(relay)
            output = await session.step(steps[2])
            assert_rebuilt(session, lost, output, served_reference, steps)
            # the loop runs on while the test waits, so the detached END can go out
            await asyncio.to_thread(assert_lost_sequence_ended, triton, lost, before + 1)

    asyncio.run(run())
    assert live_sequences(triton, before) == before
