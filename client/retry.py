"""Retries with exponential backoff and jitter, for calls that are safe to repeat.

Only health, metadata and stateless inference are retried, and only when the server was
unreachable or busy (errors.RETRYABLE): the request did not run, or running it again changes
nothing. A session step is never retried: the server may have appended to its cache already.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

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


def call(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    what: str,
    retry: bool = True,
    session: bool = False,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`fn()`, with tritonclient's errors turned into ours and retried where `retry` allows."""
    for attempt in range(policy.retries + 1):
        try:
            return fn()
        except Exception as raw:
            error = errors.from_exception(raw, session=session)
            if error is None:
                raise
            if not _should_retry(error, attempt, policy, retry):
                raise error from raw
        sleep(_announce(policy, attempt, what, error))
    raise AssertionError("unreachable: the last attempt returns or raises")


async def acall(
    fn: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    what: str,
    retry: bool = True,
    session: bool = False,
) -> T:
    """The asyncio twin of `call`."""
    for attempt in range(policy.retries + 1):
        try:
            return await fn()
        except Exception as raw:
            error = errors.from_exception(raw, session=session)
            if error is None:
                raise
            if not _should_retry(error, attempt, policy, retry):
                raise error from raw
        await asyncio.sleep(_announce(policy, attempt, what, error))
    raise AssertionError("unreachable: the last attempt returns or raises")


def _should_retry(error: errors.ClientError, attempt: int, policy: RetryPolicy, retry: bool) -> bool:
    return retry and isinstance(error, errors.RETRYABLE) and attempt < policy.retries


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
