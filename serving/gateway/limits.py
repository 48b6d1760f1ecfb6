"""What every request is held to before the app sees it: its deadline, the body limit, and the cap on
large bodies in flight.

- The deadline (`request_deadline`): `SERVING_REQUEST_TIMEOUT_S` from the request's arrival; every
  upstream call of the request ends by then (state.GatewayState.call), so no request outlives it.
- The body limit: the smaller of `SERVING_MAX_BODY_BYTES` and the most a valid body can need for the
  served model (validated.body_bound, once its sizes are known); for a restore (POST /v1/sessions), the
  largest snapshot the session model can produce (`restore_bound`); for the routes that take text
  (`TEXT_ROUTES`), the most text the served models' contexts hold (validated.text_body_bound, once every
  served model's tokenizer is known). A declared Content-Length over it is
  refused at once; a chunked body is read up to it and refused as soon as it passes it, so a client
  cannot make the gateway buffer more than the limit.
- Large bodies: a body over `LARGE_BODY_BYTES` (declared, or once that much of a chunked one has come)
  takes one of `SERVING_LARGE_BODY_CONCURRENCY` places for its whole request, or gets 429 with
  Retry-After at once: megabytes of JSON numbers are several times their size as Python objects while
  they are decoded, and four at once took the gateway from 96 MiB to 1.6 GB. When the last large
  request in flight ends, or the last with a body over `TRIM_BODY_BYTES` (a restore's snapshot), the
  memory it freed is given back to the system (`malloc_trim`), so that a burst does not leave the
  process at its peak.

The body is read here and replayed to the app: FastAPI would turn an error raised while it reads the
body into a 400.
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import ctypes.util
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.gateway.errors import ApiError, BodyTimeout, BodyTooLarge, Overloaded, error_response
from serving.gateway.settings import Settings

# a body over this takes a place among SERVING_LARGE_BODY_CONCURRENCY: JSON numbers this size are about
# 3x it as Python objects while decoded (a base64 body, 1x: 8 MiB carries the seed model's past of 1,500
# positions, which stateless callers send every step and must not queue for)
LARGE_BODY_BYTES = 8 << 20
# when the last request in flight with a body over this ends, the memory freed is given back to the system: a
# burst of 12 restores of 4 MiB snapshots (below LARGE_BODY_BYTES) left the gateway 24 MiB larger without it
TRIM_BODY_BYTES = 1 << 20
# a snapshot's safetensors header: 2 x n_layers tensor entries of about 100 bytes and the metadata (the model's
# config as JSON, the graph's name and sha256, the integrity tag): 1,368 bytes for the 2-layer test model
SNAPSHOT_HEADER_BYTES = 64 << 10
# the cache dtype is not in what the session model publishes: a float32 cache, the widest, bounds them all
WIDEST_CACHE_ELEMENT_BYTES = 4
RESTORE_ROUTE = ("POST", "/v1/sessions")
# the routes that take text, each bound by the served models' contexts (validated.text_body_bound): how many
# prompts one body may carry, by the key's session limit (each prompt runs as a session)
TEXT_ROUTES: dict[str, Callable[[Settings], int]] = {
    "/v1/completions": lambda settings: settings.sessions_per_key,
    "/v1/chat/completions": lambda settings: 1,
    "/v1/responses": lambda settings: 1,
}
# when the request being handled must be answered by, on the event loop's clock (None outside a request)
request_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("request_deadline", default=None)


class RequestLimitsMiddleware:
    def __init__(self, app: ASGIApp, gateway) -> None:  # gateway: state.GatewayState
        self.app, self.gateway = app, gateway
        self._sized_bodies = 0  # requests with a body over TRIM_BODY_BYTES in flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.gateway.settings.request_timeout_s
        request_deadline.set(deadline)
        limit = _Limit.of(scope, self.gateway)
        declared = _content_length(scope)
        if declared is not None and declared > limit.bytes:
            await _refuse(scope, receive, send, limit.exceeded(f"declared Content-Length {declared}"))
            return
        large = _LargeBody(self.gateway)
        try:
            if declared is not None and declared > LARGE_BODY_BYTES:
                large.take()
            async with asyncio.timeout_at(deadline):  # a body trickling in holds a connection no longer than that
                body = await self._read(receive, limit, large)
        except TimeoutError:
            large.release()
            timeout_s = self.gateway.settings.request_timeout_s
            body_late = BodyTimeout(
                f"the request's body did not arrive within {timeout_s:g} s (SERVING_REQUEST_TIMEOUT_S)"
            )
            await _refuse(scope, receive, send, body_late)
            return
        except ApiError as error:
            large.release()
            await _refuse(scope, receive, send, error)
            return
        sized = len(body) > TRIM_BODY_BYTES
        self._sized_bodies += sized
        try:
            await self.app(scope, replay_body(body, receive), send)
        finally:
            large.release()
            self._sized_bodies -= sized
            if sized and not self._sized_bodies:
                give_back_memory()

    async def _read(self, receive: Receive, limit: _Limit, large: _LargeBody) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away; the app will see it
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit.bytes:
                raise limit.exceeded("the body")
            if size > LARGE_BODY_BYTES and not large.taken:
                large.take()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _LargeBody:
    """One request's place among the large bodies in flight (taken at most once, released once)."""

    def __init__(self, gateway) -> None:
        self.gateway, self.taken = gateway, False

    def take(self) -> None:
        cap = self.gateway.settings.large_body_concurrency
        if self.gateway.large_bodies >= cap:
            raise Overloaded(
                f"{self.gateway.large_bodies} requests with bodies over {LARGE_BODY_BYTES >> 20} MiB are in flight, "
                f"the most this gateway takes at once (SERVING_LARGE_BODY_CONCURRENCY); retry shortly"
            )
        self.gateway.large_bodies += 1
        self.taken = True

    def release(self) -> None:
        if self.taken:
            self.taken = False
            self.gateway.large_bodies -= 1
            if self.gateway.large_bodies == 0:
                give_back_memory()


class _Limit:
    """The most bytes a request's body may have, and what that figure is."""

    def __init__(self, size: int, meaning: str) -> None:
        self.bytes, self.meaning = size, meaning

    @classmethod
    def of(cls, scope: Scope, gateway) -> _Limit:
        if (scope.get("method"), scope.get("path")) == RESTORE_ROUTE:
            return cls(gateway.restore_limit, "the largest snapshot the served session model can produce")
        text_limit = gateway.text_limits.get(scope.get("path")) if scope.get("method") == "POST" else None
        if text_limit is not None:
            return cls(text_limit, "the most a valid request can need for the served models' contexts")
        return cls(gateway.body_limit, "the most a valid request can need for the served model")

    def exceeded(self, what: str) -> BodyTooLarge:
        return BodyTooLarge(
            f"request body too large: {what} exceeds the limit of {self.bytes} bytes ({self.meaning}, or "
            "SERVING_MAX_BODY_BYTES)"
        )


def restore_bound(facts: dict, max_seq_len: int) -> int | None:
    """The most bytes a snapshot of the session model whose config published `facts` can take: every position
    up to `max_seq_len` of every layer's keys and values, in the widest cache dtype, and its header; None while
    the facts lack a size."""
    sizes = [facts.get(fact) for fact in ("n_layers", "n_kv_heads", "head_dim")]
    if not all(isinstance(size, int) and size > 0 for size in sizes):
        return None
    n_layers, n_kv_heads, head_dim = sizes
    cache = max_seq_len * n_layers * 2 * n_kv_heads * head_dim * WIDEST_CACHE_ELEMENT_BYTES
    return cache + SNAPSHOT_HEADER_BYTES


async def _refuse(scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
    # the rest of the body may still be on its way: close rather than read it
    headers = {**(error.headers or {}), "Connection": "close"}
    await error_response(error.status, error.code, error.message, headers)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def replay_body(body: bytes, receive: Receive) -> Receive:
    """`receive` that first hands out `body` whole, then what the server says (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: disconnect notices come from the server

    return replay


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, where there is one: it returns the heap's free pages to the system, which
    free() alone leaves to the process (the decoded lists of a large body are many small blocks)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def give_back_memory() -> None:
    if _TRIM is not None:
        _TRIM(0)
