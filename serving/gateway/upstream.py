"""Calls to Triton through the client library: one deadline per request, typed errors mapped to HTTP.

| client error            | HTTP | why                                                          |
|-------------------------|------|--------------------------------------------------------------|
| InvalidInputError       | 400  | the caller's tensors do not fit the model (message names it) |
| SessionLostError        | 409  | the session's cache died with a Triton process (session_lost)|
| UnknownSessionError     | 409  | Triton no longer holds the session's state (evicted, expired)|
| ServerBusyError         | 503  | Triton is up but its KV-cache budget is full: retry later    |
| ServerUnavailableError  | 503  | Triton cannot be reached or is not ready                     |
| ModelNotFoundError      | 503  | the model is not loaded (yet)                                |
| RequestTimeoutError     | 504  | no answer within the per-request timeout                     |
| ServerError, other      | 502  | Triton failed on a request it accepted                       |
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from client import errors as client_errors
from serving.gateway.errors import (
    ApiError,
    InvalidInput,
    SessionConflict,
    SessionLost,
    UpstreamBusy,
    UpstreamFailed,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from serving.gateway.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")

_BY_TYPE: list[tuple[type[client_errors.ClientError], type[ApiError]]] = [
    (client_errors.InvalidInputError, InvalidInput),
    (client_errors.SessionLostError, SessionLost),  # before its base class
    (client_errors.UnknownSessionError, SessionConflict),
    (client_errors.ServerBusyError, UpstreamBusy),
    (client_errors.ServerUnavailableError, UpstreamUnavailable),
    (client_errors.ModelNotFoundError, UpstreamUnavailable),
    (client_errors.RequestTimeoutError, UpstreamTimeout),
]


def to_api_error(error: client_errors.ClientError, what: str) -> ApiError:
    """The answer for a failed upstream call; the message says which call (`what`) and Triton's
    words, except for a caller's mistake, whose message names the input already."""
    for client_type, api_type in _BY_TYPE:
        if isinstance(error, client_type):
            return api_type(error.message if api_type is InvalidInput else f"{what}: Triton: {error.message}")
    return UpstreamFailed(f"{what}: Triton failed on the request: {error.message}")


async def call(awaitable: Awaitable[T], *, deadline: float, timeout_s: float, metrics: Metrics, what: str) -> T:
    """Await an upstream call until `deadline` (the event loop's clock: the request's, `timeout_s` after
    it arrived), with its errors as ApiErrors."""
    try:
        async with asyncio.timeout_at(deadline):
            return await awaitable
    except TimeoutError:
        metrics.upstream_errors.labels("timeout").inc()
        raise UpstreamTimeout(f"{what}: no answer within {timeout_s:g} s (SERVING_REQUEST_TIMEOUT_S)") from None
    except client_errors.ClientError as error:
        if not isinstance(error, client_errors.InvalidInputError):  # a caller's mistake is no upstream failure
            metrics.upstream_errors.labels(type(error).__name__).inc()
        raise to_api_error(error, what) from None
