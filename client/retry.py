"""Retries with exponential backoff and jitter, for calls that are safe to repeat: the one retry
loop of the package, written once as a step of a client operation (client/core.py) and run by the
blocking and the asyncio client alike.

Only health, metadata and stateless inference are retried, and only when the server was
unreachable or busy (errors.RETRYABLE): the request did not run, or running it again changes
nothing. A session step is never retried: the server may have appended to its cache already.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator
from typing import Any, TypeVar

from client import errors

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """`retries` extra attempts after the first; the n-th waits about `backoff * 2**n` seconds,
    capped at `max_backoff`, with jitter so that many clients do not retry in step."""

    retries: int = 3
    backoff: float = 0.1
    max_backoff: float = 2.0

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff < 0 or self.max_backoff < self.backoff:
            raise ValueError(f"need retries >= 0 and 0 <= backoff <= max_backoff, got {self}")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `attempt` (0-based): uniform in [base/2, base]."""
        base = min(self.max_backoff, self.backoff * 2**attempt)
        return base / 2 + (rng or random).uniform(0, base / 2)


@dataclasses.dataclass(frozen=True)
class Call:
    """One request to tritonclient: `fn(stub)` returns the answer (an awaitable in asyncio)."""

    fn: Callable[[Any], Any]
    what: str
    retry: bool = True  # safe to repeat
    session: bool = False  # a session step: its errors read as a session's


@dataclasses.dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclasses.dataclass(frozen=True)
class Local:
    """Blocking work of our own (a session store's read or write): run in this thread by the
    blocking client, on a worker thread by the asyncio one, so the event loop never waits on it."""

    fn: Callable[[], Any]


@dataclasses.dataclass(frozen=True)
class Detach:
    """An operation started on its own and not waited for; its answer and errors are dropped. For
    best-effort requests that must not delay or fail the operation that starts them (the END of a
    sequence a recovery left behind): the blocking client runs it on a daemon thread, the asyncio
    one as a task of the running loop."""

    operation: Operation[Any]


@dataclasses.dataclass(frozen=True)
class Emit:
    """A value for whoever iterates the operation (a generation's token), handed out by `emitted_blocking` and
    `emitted_async`. The operation is sent True for the next, or False once its caller has left (closed the
    iteration early): it must then come to its end without emitting again (a generation stops on the server)."""

    value: Any


Action = Call | Sleep | Local | Detach | Emit
# An operation yields actions; the driver sends back a Call's answer or throws in what it raised (an interrupt or a
# task's cancellation too: the operation may end what it started before it goes on).
Operation = Generator[Action, Any, T]


def retried(call: Call, policy: RetryPolicy) -> Operation[Any]:
    """`call`, its errors turned into ours and retried where `call.retry` allows."""
    for attempt in range(policy.retries + 1):
        try:
            return (yield call)
        except Exception as raw:
            error = errors.from_exception(raw, session=call.session)
            if error is None:
                raise
            if not (call.retry and isinstance(error, errors.RETRYABLE) and attempt < policy.retries):
                raise error from raw
        yield Sleep(_announce(policy, attempt, call.what, error))
    raise AssertionError("unreachable: the last attempt returns or raises")


def _announce(policy: RetryPolicy, attempt: int, what: str, error: errors.ClientError) -> float:
    delay = policy.delay(attempt)
    log.warning(
        "%s failed (%s: %s); retry %d/%d in %.3f s",
        what,
        type(error).__name__,
        error.message,
        attempt + 1,
        policy.retries,
        delay,
    )
    return delay


@dataclasses.dataclass(frozen=True)
class Done:
    value: Any


def _next(operation: Operation[Any], answer: Any, raised: BaseException | None) -> Action | Done:
    """The operation's next action, given the last one's answer or error; Done when it returned."""
    try:
        return operation.send(answer) if raised is None else operation.throw(raised)
    except StopIteration as done:
        return Done(done.value)


def run_blocking(operation: Operation[T], stub: Callable[[], Any], sleep: Callable[[float], None] = time.sleep) -> T:
    """Drive `operation` in this thread: each Call once on `stub()`, each Sleep a sleep."""
    action = _next(operation, None, None)
    while not isinstance(action, Done):
        action = _next(operation, *_performed(action, stub, sleep))
    return action.value


def emitted_blocking(operation: Operation[T], stub: Callable[[], Any]) -> Generator[Any, None, T]:
    """Drive `operation` as `run_blocking` does, yielding each Emit's value; closed early, the operation is told so
    and driven to its end here."""
    action, more = _next(operation, None, None), True
    while not isinstance(action, Done):
        if isinstance(action, Emit):
            if more:
                try:
                    yield action.value
                except GeneratorExit:  # the caller left: what the operation still does runs here, unyielded
                    more = False
            action = _next(operation, more, None)
        else:
            action = _next(operation, *_performed(action, stub, time.sleep))
    return action.value


def _performed(action: Action, stub: Callable[[], Any], sleep: Callable[[float], None]) -> tuple[Any, Any]:
    """(the answer, None) or (None, what it raised) of one action, blocking."""
    try:
        if isinstance(action, Sleep):
            return sleep(action.seconds), None
        if isinstance(action, Local):
            return action.fn(), None
        if isinstance(action, Detach):
            work = functools.partial(run_blocking, action.operation, stub, sleep)
            threading.Thread(target=_dropped, args=(work,), name="client-detached", daemon=True).start()
            return None, None
        return action.fn(stub()), None
    except BaseException as error:  # handed to the operation, which decides
        return None, error


async def run_async(operation: Operation[T], stub: Callable[[], Any]) -> T:
    """Drive `operation` on the running event loop: each Call awaited, each Sleep an asyncio sleep."""
    action = _next(operation, None, None)
    while not isinstance(action, Done):
        action = _next(operation, *await _performed_async(action, stub))
    return action.value


async def emitted_async(operation: Operation[Any], stub: Callable[[], Any]) -> AsyncGenerator[Any, None]:
    """As `emitted_blocking`, on the running event loop (closed early: `aclose()`)."""
    action, more = _next(operation, None, None), True
    while not isinstance(action, Done):
        if isinstance(action, Emit):
            if more:
                try:
                    yield action.value
                except GeneratorExit:
                    more = False
            action = _next(operation, more, None)
        else:
            action = _next(operation, *await _performed_async(action, stub))


async def _performed_async(action: Action, stub: Callable[[], Any]) -> tuple[Any, Any]:
    """As `_performed`, awaited."""
    import asyncio

    try:
        if isinstance(action, Sleep):
            return await asyncio.sleep(action.seconds), None
        if isinstance(action, Local):
            return await asyncio.to_thread(action.fn), None
        if isinstance(action, Detach):
            task = asyncio.get_running_loop().create_task(run_async(action.operation, stub))
            _DETACHED.add(task)  # the loop keeps only a weak reference to a task
            task.add_done_callback(_forget_task)
            return None, None
        return await action.fn(stub()), None
    except BaseException as error:  # handed to the operation, which decides
        return None, error


_DETACHED: set = set()  # the asyncio driver's detached tasks still running


def _forget_task(task) -> None:
    _DETACHED.discard(task)
    if not task.cancelled():
        _dropped(task.result)


def _dropped(fn: Callable[[], Any]) -> None:
    """`fn()` whose errors are only logged: a detached operation has no caller to tell."""
    try:
        fn()
    except Exception as error:
        log.debug("a detached operation failed: %r", error)


def call(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    what: str,
    retry: bool = True,
    session: bool = False,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`fn()` through the retry loop, blocking (for callers outside a client)."""
    return run_blocking(retried(Call(lambda _: fn(), what, retry, session), policy), lambda: None, sleep)
