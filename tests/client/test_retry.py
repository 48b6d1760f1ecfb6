"""Retries, backoff and timeouts against real loopback sockets: a port that refuses connections
(a stopped server), one that accepts and hangs up (a broken one), one that never answers."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import threading
import time

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from client import AsyncClient, Client, RetryPolicy, retry
from client.errors import RequestTimeoutError, ServerBusyError, ServerUnavailableError

PROTOCOLS = ["grpc", "http"]
HIDDEN = np.zeros((1, 1, 8), np.float32)


def retry_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == retry.__name__ and "retry" in r.getMessage()]


# --- the policy ----------------------------------------------------------------------------


def test_delays_grow_exponentially_with_jitter_and_a_cap():
    policy = RetryPolicy(retries=8, backoff=0.1, max_backoff=1.0)
    rng = random.Random(0)
    for attempt in range(8):
        base = min(1.0, 0.1 * 2**attempt)
        delays = [policy.delay(attempt, rng) for _ in range(200)]
        assert base / 2 <= min(delays) and max(delays) <= base
        assert max(delays) - min(delays) > base / 4  # jittered, not one fixed value


def test_a_nonsense_policy_is_refused():
    for bad in ({"retries": -1}, {"backoff": -0.1}, {"backoff": 2.0, "max_backoff": 1.0}):
        with pytest.raises(ValueError, match="retries"):
            RetryPolicy(**bad)


def failing(*raised):
    """A call that raises each of `raised` in turn, then returns "ok"; counts its calls."""
    calls = []

    def fn():
        calls.append(time.monotonic())
        if len(calls) <= len(raised):
            raise raised[len(calls) - 1]
        return "ok"

    return fn, calls


def test_unavailable_and_busy_are_retried_then_succeed():
    busy = InferenceServerException(msg="the KV cache budget is full", status="StatusCode.UNAVAILABLE")
    fn, calls = failing(ConnectionRefusedError(111, "Connection refused"), busy)
    slept = []
    assert retry.call(fn, RetryPolicy(retries=3), what="test", sleep=slept.append) == "ok"
    assert len(calls) == 3 and len(slept) == 2


def test_other_errors_and_unsafe_calls_are_not_retried():
    invalid = InferenceServerException(msg="input 'hidden_states': bad", status="400")
    fn, calls = failing(invalid)
    with pytest.raises(Exception, match="input 'hidden_states'"):
        retry.call(fn, RetryPolicy(retries=3), what="test", sleep=lambda _: None)
    assert len(calls) == 1
    fn, calls = failing(ConnectionRefusedError(111, "Connection refused"))
    with pytest.raises(ServerUnavailableError):
        retry.call(fn, RetryPolicy(retries=3), what="test", retry=False, sleep=lambda _: None)
    assert len(calls) == 1
    fn, calls = failing(KeyError("a bug of ours"))
    with pytest.raises(KeyError):
        retry.call(fn, RetryPolicy(retries=3), what="test", sleep=lambda _: None)


def test_giving_up_raises_the_last_error():
    busy = InferenceServerException(msg="budget full", status="503")
    fn, calls = failing(*[busy] * 10)
    with pytest.raises(ServerBusyError, match="budget full"):
        retry.call(fn, RetryPolicy(retries=2), what="test", sleep=lambda _: None)
    assert len(calls) == 3


# --- detached operations (a best-effort request: the END of a sequence a recovery left behind) ---


def starting_a_detached_one(started: threading.Event, release: threading.Event):
    """An operation that starts a detached one and returns "ok" at once; the detached one says it
    started, waits for `release`, then fails as an unreachable server does."""

    def detached():
        yield retry.Local(started.set)
        yield retry.Local(lambda: release.wait(5))
        raise ServerUnavailableError("the detached END found no server")

    yield retry.Detach(detached())
    return "ok"


def detached_failures(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "a detached operation failed" in r.getMessage()]


def test_a_detached_operation_neither_delays_nor_fails_the_one_that_started_it(caplog):
    started, release = threading.Event(), threading.Event()
    with caplog.at_level(logging.DEBUG, logger=retry.__name__):
        assert retry.run_blocking(starting_a_detached_one(started, release), lambda: None) == "ok"
        assert started.wait(5) and not release.is_set()  # it runs on, on a thread of its own
        release.set()
        deadline = time.monotonic() + 5
        while not detached_failures(caplog) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert detached_failures(caplog) == [
        "a detached operation failed: ServerUnavailableError('the detached END found no server')"
    ]


def test_an_asyncio_detached_operation_is_a_task_of_the_running_loop(caplog):
    async def run() -> None:
        started, release = threading.Event(), threading.Event()
        assert await retry.run_async(starting_a_detached_one(started, release), lambda: None) == "ok"
        assert await asyncio.to_thread(started.wait, 5) and len(retry._DETACHED) == 1
        release.set()
        while retry._DETACHED:
            await asyncio.sleep(0.01)

    with caplog.at_level(logging.DEBUG, logger=retry.__name__):
        asyncio.run(asyncio.wait_for(run(), 10))
    assert len(detached_failures(caplog)) == 1, caplog.text


def counting(limit: int, log: list) -> retry.Operation[str]:
    """Emits 0, 1, ... up to `limit`, each after an action; a caller that leaves gets an action that says so (as a
    generation's stop), and every end a last one (as its bookkeeping). Local actions: both drivers run them."""
    try:
        for value in range(limit):
            yield retry.Local(functools.partial(log.append, ("computed", value)))
            if not (yield retry.Emit(value)):
                yield retry.Local(functools.partial(log.append, "told to stop"))
                return "left"
        return "whole"
    except BaseException as error:
        yield retry.Local(functools.partial(log.append, ("interrupted", type(error).__name__)))
        raise
    finally:
        yield retry.Local(functools.partial(log.append, "ended"))


def test_an_operation_s_emitted_values_are_iterated_and_a_caller_that_leaves_is_told_and_the_end_still_runs():
    log: list = []
    assert list(retry.emitted_blocking(counting(3, log), lambda: None)) == [0, 1, 2]
    assert log == [("computed", 0), ("computed", 1), ("computed", 2), "ended"]
    log.clear()
    for value in retry.emitted_blocking(counting(5, log), lambda: None):
        if value == 1:
            break  # the loop's iterator dropped: closed, and the operation told so at its next Emit
    assert log == [("computed", 0), ("computed", 1), "told to stop", "ended"]

    async def in_asyncio() -> list:
        seen, log[:] = [], []
        tokens = retry.emitted_async(counting(5, log), lambda: None)
        async for value in tokens:
            seen.append(value)
            if value == 0:
                break
        await tokens.aclose()
        return seen

    assert asyncio.run(in_asyncio()) == [0]
    assert log == [("computed", 0), "told to stop", "ended"]


def test_an_interrupt_while_an_action_runs_is_thrown_into_the_operation_which_ends_what_it_started():
    log: list = []

    def interrupted(stub):
        raise KeyboardInterrupt

    def operation():
        try:
            yield retry.Call(interrupted, "compute")
        except BaseException as error:
            yield retry.Local(functools.partial(log.append, ("interrupted", type(error).__name__)))
            raise

    with pytest.raises(KeyboardInterrupt):
        retry.run_blocking(operation(), lambda: None)
    assert log == [("interrupted", "KeyboardInterrupt")]


# --- a stopped server: connections refused -------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_safe_calls_retry_with_backoff_against_a_stopped_server(protocol, refusing_url, caplog):
    caplog.set_level(logging.WARNING, logger=retry.__name__)
    policy = RetryPolicy(retries=3, backoff=0.05)
    started = time.monotonic()
    with Client(refusing_url, protocol, retries=3, backoff=0.05) as client, pytest.raises(ServerUnavailableError):
        client.metadata()
    elapsed = time.monotonic() - started
    assert len(retry_warnings(caplog)) == 3
    assert elapsed >= sum(policy.backoff * 2**n / 2 for n in range(3))  # each wait at least half its base
    with Client(refusing_url, protocol, retries=1, backoff=0.01) as client:
        assert client.ready() is False  # a probe answers, it does not raise


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_async_safe_calls_retry_against_a_stopped_server(protocol, refusing_url, caplog):
    caplog.set_level(logging.WARNING, logger=retry.__name__)

    async def run():
        async with AsyncClient(refusing_url, protocol, retries=2, backoff=0.02, validate=False) as client:
            with pytest.raises(ServerUnavailableError):
                await client.infer(HIDDEN)
            return await client.ready()

    assert asyncio.run(run()) is False
    assert len(retry_warnings(caplog)) >= 2


# --- a broken server: each retry really goes back to the network ---------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_each_retry_reconnects(protocol, closing_listener, caplog):
    caplog.set_level(logging.WARNING, logger=retry.__name__)
    client = Client(closing_listener.url, protocol, retries=3, backoff=0.1, validate=False)
    with client, pytest.raises(ServerUnavailableError):
        client.infer(HIDDEN)
    assert len(retry_warnings(caplog)) == 3
    # HTTP opens a connection per attempt; gRPC's channel reconnects on its own backoff, which we
    # set no slower than ours (its default 1 s would leave every retry to fail without trying)
    assert closing_listener.connections >= (4 if protocol == "http" else 2)


@pytest.mark.parametrize("protocol", ["grpc"])  # the session model takes gRPC streams only
def test_session_steps_are_never_retried(protocol, closing_listener, caplog):
    caplog.set_level(logging.WARNING, logger=retry.__name__)
    # backoff 1 s: gRPC's channel would connect again on its own after half of it (a reconnect, not a retry)
    with Client(closing_listener.url, protocol, retries=3, backoff=1.0, validate=False) as client:
        session = client.session()
        with pytest.raises(ServerUnavailableError):
            session.step(HIDDEN)
    assert retry_warnings(caplog) == []
    assert closing_listener.connections == 1


@pytest.mark.parametrize("protocol", ["grpc"])
def test_async_session_steps_are_never_retried(protocol, closing_listener, caplog):
    caplog.set_level(logging.WARNING, logger=retry.__name__)

    async def run():
        async with AsyncClient(closing_listener.url, protocol, retries=3, backoff=1.0, validate=False) as client:
            with pytest.raises(ServerUnavailableError):
                await client.session().step(HIDDEN)

    asyncio.run(run())
    assert retry_warnings(caplog) == []
    assert closing_listener.connections == 1


# --- a silent server: timeouts -------------------------------------------------------------


def test_a_silent_server_times_out_once(silent_server, caplog):
    protocol, url = silent_server
    caplog.set_level(logging.WARNING, logger=retry.__name__)
    started = time.monotonic()
    client = Client(url, protocol, timeout=0.3, validate=False)
    with client, pytest.raises(RequestTimeoutError):
        client.infer(HIDDEN)
    assert 0.25 <= time.monotonic() - started < 2.0
    assert retry_warnings(caplog) == []  # the request may be running: a timeout is not retried


def test_async_a_silent_server_times_out(silent_server):
    protocol, url = silent_server

    async def run():
        async with AsyncClient(url, protocol, timeout=0.3, validate=False) as client:
            with pytest.raises(RequestTimeoutError):  # a session over gRPC; HTTP takes stateless calls only
                await (client.session().step(HIDDEN) if protocol == "grpc" else client.infer(HIDDEN))

    started = time.monotonic()
    asyncio.run(run())
    assert 0.25 <= time.monotonic() - started < 2.0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_waiting_for_a_server_that_stays_down_gives_up(protocol, refusing_url):
    started = time.monotonic()
    with Client(refusing_url, protocol, retries=0) as client, pytest.raises(ServerUnavailableError, match="not ready"):
        client.wait_ready(timeout=0.3, interval=0.05)
    assert time.monotonic() - started < 3.0

    async def run():
        async with AsyncClient(refusing_url, protocol, retries=0) as client:
            await client.wait_ready(timeout=0.3, interval=0.05)

    with pytest.raises(ServerUnavailableError, match="not ready"):
        asyncio.run(run())
