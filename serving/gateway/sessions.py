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

No request walks the table (issue 34: an open through the stack took 1.1 ms beside no idle session,
20 ms beside 4,000): the working sessions are counted, in all and per key, as they come, break and
go, and the table is kept in the order the sessions were last used, so the idle sweep reads the idle
ones and stops at the first that is not.

Any gateway replica serves any session (docs/scale-out.md, "Gateways"): a session's id is a claim
signed with the gateway's secret (itsdangerous) naming the Triton sequence, the owner (a keyed hash
of its API key, auth.owner_of) and the Triton replica holding it, so a gateway that has not seen the session resumes it
from its id alone; nothing is shared between gateways. With a secret shared by several gateways
(`shared`), what this table holds is only this process's view, so it never ends a session upstream on
its own: an idle one is forgotten here and the model's own idle timeout frees its cache, and a
shutdown leaves every session to the others. The per-key limit and the busy rule hold per gateway
process.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from itsdangerous import BadSignature, URLSafeSerializer

from contract.tombstones import Tombstones
from serving.gateway.errors import SessionConflict, SessionNotFound, TooManySessions

log = logging.getLogger(__name__)
TOMBSTONES = 10_000  # how many gone sessions we remember, to say why they are gone


def tag(session_id: str) -> str:
    """A short name of a session for the logs: a session id is a credential (with its key), so logs
    carry this one-way tag instead."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:12]


@dataclasses.dataclass
class GatewaySession:
    id: str
    owner: str
    upstream: Any  # client.AsyncSession
    last_used: float
    busy: bool = False
    broken: str | None = None  # why its server-side state is lost
    # the token ids it holds, where this gateway knows them (its text came through the OpenAI routes): a request
    # bound to it (`session`) then sends only what its prompt adds; None: unknown here
    tokens: Any = None


@dataclasses.dataclass(frozen=True)
class Gone:
    owner: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Claim:
    """What a session id says, signed: the Triton sequence, who owns it, the replica holding it, its
    key in the session store."""

    sequence_id: int
    owner: str
    replica: str  # "" when no proxy named one (a single Triton)
    store_key: str = ""  # the session's key in the session store ("": not durable)


class SessionIds:
    """Session ids as signed claims. Not encrypted: a caller may read its own session's sequence id
    and replica name, neither of which lets it reach Triton (only the gateway and Envoy do)."""

    def __init__(self, secret: str) -> None:
        signer = {"digest_method": hashlib.sha256}
        self._serializer = URLSafeSerializer(secret, salt="attention-serving/session", signer_kwargs=signer)

    def issue(self, claim: Claim) -> str:
        return self._serializer.dumps([claim.sequence_id, claim.owner, claim.replica, claim.store_key])

    def read(self, session_id: str) -> Claim | None:
        """The claim of an id this gateway's secret signed; None for any other string."""
        try:
            sequence_id, owner, replica, store_key = self._serializer.loads(session_id)
        except (BadSignature, ValueError, TypeError):
            return None
        return Claim(int(sequence_id), str(owner), str(replica), str(store_key))


class GatewaySessions:
    """The gateway's table of live sessions (not client.store.SessionStore, which keeps sessions durable
    across servers)."""

    def __init__(
        self,
        per_key: int,
        idle_s: float,
        ids: SessionIds,
        resume: Callable[[Claim], Any],
        *,
        shared: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`resume(claim)` makes the upstream session (client.AsyncSession) of a session opened by
        another gateway process; `shared`: other gateways serve these sessions too."""
        self.per_key, self.idle_s, self.clock = per_key, idle_s, clock
        self.ids, self._resume, self.shared = ids, resume, shared
        self._open: dict[str, GatewaySession] = {}  # least recently used first
        self._working: collections.Counter[str] = collections.Counter()  # owner -> open, working sessions
        self._working_total = 0
        self._gone: Tombstones[Gone] = Tombstones(TOMBSTONES)
        self._unclosed: list[GatewaySession] = []  # expired on access, still to be ended upstream

    def __len__(self) -> int:
        """Open, working sessions (what the active-sessions gauge shows)."""
        return self._working_total

    def held_by(self, owner: str) -> int:
        """The key's open, working sessions (what its limit counts)."""
        return self._working[owner]

    def _insert(self, session: GatewaySession) -> None:
        """Into the table, as the most recently used."""
        self._open[session.id] = session
        if session.broken is None:
            self._count(session.owner, 1)

    def _delete(self, session: GatewaySession) -> None:
        del self._open[session.id]
        if session.broken is None:
            self._count(session.owner, -1)

    def _count(self, owner: str, change: int) -> None:
        self._working[owner] += change
        self._working_total += change
        if not self._working[owner]:
            del self._working[owner]  # a key that held sessions once keeps no entry

    def reserve(self, owner: str, upstream: Any) -> GatewaySession:
        """A place for a new session, counted against the key's limit; its id is provisional until
        `name` (the replica that holds it is known once it is opened)."""
        held = self.held_by(owner)
        if held >= self.per_key:
            raise TooManySessions(
                f"this API key holds {held} open sessions, the limit is {self.per_key}; DELETE one or let it "
                f"expire ({self.idle_s:g} s idle)"
            )
        session = GatewaySession(secrets.token_urlsafe(16), owner, upstream, self.clock())
        self._insert(session)
        return session

    def name(self, session: GatewaySession) -> str:
        """Give an opened session its signed id."""
        upstream = session.upstream
        self._delete(session)
        session.id = self.ids.issue(Claim(upstream.id, session.owner, upstream.replica or "", upstream.store_key or ""))
        self._insert(session)
        return session.id

    def get(self, session_id: str, owner: str) -> GatewaySession:
        session = self._open.get(session_id)
        if session is not None and self._expired(session):  # exact expiry, whenever the sweeper runs
            self._unclosed += self._expire([session])
            session = None
        if session is None and session_id not in self._gone:
            session = self._resumed(session_id, owner)
        if session is None or session.owner != owner:
            gone = self._gone.get(session_id)
            why = f": {gone.reason}" if gone is not None and gone.owner == owner else ""
            raise SessionNotFound(f"no session '{session_id}'{why}")
        return session

    def _resumed(self, session_id: str, owner: str) -> GatewaySession | None:
        """A session another gateway process opened (or this one, before it forgot it)."""
        claim = self.ids.read(session_id)
        if claim is None or claim.owner != owner:
            return None
        session = GatewaySession(session_id, owner, self._resume(claim), self.clock())
        self._insert(session)
        return session

    @contextlib.asynccontextmanager
    async def using(self, session_id: str, owner: str) -> AsyncIterator[GatewaySession]:
        """Hold a session for one step: 409 if it is busy or broken."""
        session = self.get(session_id, owner)
        if session.broken is not None:
            raise SessionConflict(f"session '{session_id}' cannot go on: {session.broken}; DELETE it, open a new one")
        if session.busy:
            raise SessionConflict(
                f"session '{session_id}' has a request in flight (a step or a generation); send them one at a time"
            )
        session.busy = True
        try:
            yield session
        finally:
            session.busy = False
            session.last_used = self.clock()
            if self._open.get(session.id) is session:  # the most recently used now: last
                self._open[session.id] = self._open.pop(session.id)

    def break_(self, session: GatewaySession, reason: str) -> None:
        if session.broken is None and self._open.get(session.id) is session:
            self._count(session.owner, -1)  # no longer counts against its key's limit
        session.broken = reason

    def remove(self, session_id: str, owner: str, reason: str) -> GatewaySession:
        session = self.get(session_id, owner)
        if session.busy:
            raise SessionConflict(f"session '{session_id}' has a step in flight; DELETE it once the step returns")
        return self._forget(session, reason)

    def idle(self) -> list[GatewaySession]:
        """Remove and return the sessions idle past `idle_s` (busy ones are not idle), to be ended
        upstream by the caller."""
        expired = self._expire(list(self._idle_ones()))
        expired += self._unclosed
        self._unclosed = []
        return expired

    def _idle_ones(self) -> Iterator[GatewaySession]:
        """The sessions idle past `idle_s`, from the least recently used to the first that is not idle
        (a busy one, whose last use is its last answer, is passed over: it is not idle)."""
        deadline = self.clock() - self.idle_s
        for session in self._open.values():
            if session.busy:
                continue
            if session.last_used >= deadline:
                return
            yield session

    def _expired(self, session: GatewaySession) -> bool:
        return not session.busy and session.last_used < self.clock() - self.idle_s

    def _expire(self, sessions: list[GatewaySession]) -> list[GatewaySession]:
        """Idle sessions out of the table; those to be ended upstream (none when `shared`: another
        gateway may be stepping them, and the model's idle timeout frees their caches)."""
        if self.shared:
            for session in sessions:
                self._delete(session)
            return []
        return [self._forget(s, f"closed after {self.idle_s:g} s without a step") for s in sessions]

    def drain(self) -> list[GatewaySession]:
        """Remove and return every session (shutdown)."""
        if self.shared:  # the other gateways go on serving them
            for session in list(self._open.values()):
                self._delete(session)
            return self._unclosed
        sessions = [self._forget(s, "the gateway shut down") for s in list(self._open.values())]
        sessions += self._unclosed
        self._unclosed = []
        return sessions

    def _forget(self, session: GatewaySession, reason: str) -> GatewaySession:
        self._delete(session)
        self._gone.bury(session.id, Gone(session.owner, reason))
        return session
