"""The request body limit, enforced before any of the body is parsed.

A declared Content-Length over the limit is refused at once; a chunked body is read up to the limit
and refused as soon as it passes it, so a client cannot make the gateway buffer more than the limit.
The body is read here and replayed to the app: FastAPI would turn an error raised while it reads
the body into a 400.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.gateway.errors import BodyTooLarge, error_response


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await self._refuse(scope, receive, send, f"declared Content-Length {declared}")
            return
        body = await self._read(receive)
        if body is None:
            await self._refuse(scope, receive, send, "the body")
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away; the app will see it
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        error = BodyTooLarge(f"request body too large: {what} exceeds the limit of {self.limit} bytes")
        response = error_response(error.status, error.code, error.message, {"Connection": "close"})
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: disconnect notices come from the server

    return replay
