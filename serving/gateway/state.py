"""What the routes of one app share: the `GatewayState` (settings, accepted keys, the asyncio Triton
client, the session store, the metrics), kept on `app.state.gateway`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from client import AsyncClient, ClientError
from serving.gateway import upstream
from serving.gateway.errors import Overloaded
from serving.gateway.metrics import Metrics
from serving.gateway.sessions import GatewaySession, SessionIds, SessionStore
from serving.gateway.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")
CLOSE_TIMEOUT_S = 5.0  # ending a session upstream is best effort: Triton's own idle timeout is the backstop


class GatewayState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = [key.encode() for key in settings.accepted_keys()]
        self.metrics = Metrics()
        secret = settings.session_secret.get_secret_value() if settings.session_secret else None
        self.sessions = SessionStore(
            settings.sessions_per_key,
            settings.session_idle_s,
            SessionIds(secret or secrets.token_urlsafe(32)),
            lambda claim: self.client.session(claim.sequence_id, claim.replica),
            shared=secret is not None,
        )
        self.metrics.active_sessions.set_function(lambda: len(self.sessions))
        self._client: AsyncClient | None = None
        self._sweeper: asyncio.Task | None = None
        self._attending = 0  # /v1/attend requests in flight (everything runs on the event loop)

    @property
    def client(self) -> AsyncClient:
        assert self._client is not None, "the gateway is not started"
        return self._client

    async def start(self) -> None:
        s = self.settings
        # few retries: the caller is waiting, and the deadline below bounds the whole call anyway
        self._client = AsyncClient(
            s.triton_url, "grpc", s.model, s.session_model, timeout=s.request_timeout_s, retries=2, backoff=0.05
        )
        self._sweeper = asyncio.create_task(self._sweep(), name="session-sweeper")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await asyncio.gather(*(self.end_upstream(s) for s in self.sessions.drain()))
        await self.client.close()

    @contextlib.asynccontextmanager
    async def attend_slot(self) -> AsyncIterator[None]:
        """One of `attend_concurrency` places for a stateless request, or 429 at once: a queue here
        would only turn overload into timeouts (a 4,096-token request holds the model for seconds)."""
        if self._attending >= self.settings.attend_concurrency:
            raise Overloaded(
                f"{self._attending} stateless requests are in flight, the most this gateway lets through "
                f"(SERVING_ATTEND_CONCURRENCY); retry shortly"
            )
        self._attending += 1
        try:
            yield
        finally:
            self._attending -= 1

    async def call(self, awaitable: Awaitable[T], what: str) -> T:
        timeout_s = self.settings.request_timeout_s
        return await upstream.call(awaitable, timeout_s=timeout_s, metrics=self.metrics, what=what)

    async def end_upstream(self, session: GatewaySession) -> None:
        """Send the session's END to Triton; failures are logged, not raised (the caller is done with it)."""
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await session.upstream.close()
        except (ClientError, TimeoutError) as error:
            log.warning("ending session %s upstream failed (Triton will expire it): %r", session.id, error)

    async def _sweep(self) -> None:
        interval = min(self.settings.session_idle_s / 2, 10.0)
        while True:
            await asyncio.sleep(interval)
            expired = self.sessions.idle()
            if expired:
                log.info("closing %d idle session(s)", len(expired))
                await asyncio.gather(*(self.end_upstream(s) for s in expired))
