"""The gateway's sessions: who owns each, how many a key holds, which are idle, which are busy.

A session is the gateway's handle on one client-library session (one Triton sequence whose KV
cache the server keeps). Its id is random and unguessable; it is visible only to the key that
opened it (another key gets 404, as if it did not exist).

Statuses, so a caller can tell what happened:
- 404: never existed for this key, or gone: closed by DELETE or after `idle_s` without a step
  (the message says which);
- 409: it exists but cannot take this request: a step of it is in flight, or its server-side
  state is lost (Triton evicted it, or a step timed out and may or may not have been applied).
  Such a broken session no longer counts against the key's limit; DELETE forgets it.
Everything runs on the event loop, so plain dicts suffice; the only awaits are upstream calls, and
a session's `busy` flag (set before them) keeps a second request out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from serving.gateway.errors import SessionConflict, SessionNotFound, TooManySessions
from serving.tombstones import Tombstones

log = logging.getLogger(__name__)
TOMBSTONES = 10_000  # how many gone sessions we remember, to say why they are gone


@dataclasses.dataclass
class GatewaySession:
    id: str
    owner: str
    upstream: Any  # client.AsyncSession
    last_used: float
    busy: bool = False
    broken: str | None = None  # why its server-side state is lost


@dataclasses.dataclass(frozen=True)
class Gone:
    owner: str
    reason: str


class SessionStore:
    def __init__(self, per_key: int, idle_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_key, self.idle_s, self.clock = per_key, idle_s, clock
        self._open: dict[str, GatewaySession] = {}
        self._gone: Tombstones[Gone] = Tombstones(TOMBSTONES)
        self._unclosed: list[GatewaySession] = []  # expired on access, still to be ended upstream

    def __len__(self) -> int:
        """Open, working sessions (what the active-sessions gauge shows)."""
        return sum(1 for s in self._open.values() if s.broken is None)

    def create(self, owner: str, upstream: Any) -> GatewaySession:
        held = sum(1 for s in self._open.values() if s.owner == owner and s.broken is None)
        if held >= self.per_key:
            raise TooManySessions(
                f"this API key holds {held} open sessions, the limit is {self.per_key}; DELETE one or let it "
                f"expire ({self.idle_s:g} s idle)"
            )
        session = GatewaySession(secrets.token_urlsafe(16), owner, upstream, self.clock())
        self._open[session.id] = session
        return session

    def get(self, session_id: str, owner: str) -> GatewaySession:
        session = self._open.get(session_id)
        if session is not None and self._expired(session):  # exact expiry, whenever the sweeper runs
            self._unclosed.append(self._forget(session, self._idle_reason()))
            session = None
        if session is None or session.owner != owner:
            gone = self._gone.get(session_id)
            why = f": {gone.reason}" if gone is not None and gone.owner == owner else ""
            raise SessionNotFound(f"no session '{session_id}'{why}")
        return session

    @contextlib.asynccontextmanager
    async def using(self, session_id: str, owner: str) -> AsyncIterator[GatewaySession]:
        """Hold a session for one step: 409 if it is busy or broken."""
        session = self.get(session_id, owner)
        if session.broken is not None:
            raise SessionConflict(f"session '{session_id}' cannot go on: {session.broken}; DELETE it, open a new one")
        if session.busy:
            raise SessionConflict(f"session '{session_id}' has a step in flight; send its steps one at a time")
        session.busy = True
        try:
            yield session
        finally:
            session.busy = False
            session.last_used = self.clock()

    def break_(self, session: GatewaySession, reason: str) -> None:
        session.broken = reason

    def remove(self, session_id: str, owner: str, reason: str) -> GatewaySession:
        session = self.get(session_id, owner)
        if session.busy:
            raise SessionConflict(f"session '{session_id}' has a step in flight; DELETE it once the step returns")
        return self._forget(session, reason)

    def idle(self) -> list[GatewaySession]:
        """Remove and return the sessions idle past `idle_s` (busy ones are not idle), to be ended
        upstream by the caller."""
        expired = [self._forget(s, self._idle_reason()) for s in list(self._open.values()) if self._expired(s)]
        expired += self._unclosed
        self._unclosed = []
        return expired

    def _expired(self, session: GatewaySession) -> bool:
        return not session.busy and session.last_used < self.clock() - self.idle_s

    def _idle_reason(self) -> str:
        return f"closed after {self.idle_s:g} s without a step"

    def drain(self) -> list[GatewaySession]:
        """Remove and return every session (shutdown)."""
        sessions = [self._forget(s, "the gateway shut down") for s in list(self._open.values())]
        sessions += self._unclosed
        self._unclosed = []
        return sessions

    def _forget(self, session: GatewaySession, reason: str) -> GatewaySession:
        del self._open[session.id]
        self._gone.bury(session.id, Gone(session.owner, reason))
        return session
