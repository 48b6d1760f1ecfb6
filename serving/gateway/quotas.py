"""Per-key quotas: how much of the server's KV cache one API key's sessions and named prefixes may hold, so
that one key cannot take the budget every key shares (a key's prefixes filled the whole budget once, and
no other key could open a session).

Counted per key, as running tallies updated where a session or prefix changes (never a walk over the
sessions: a request's cost must not grow with the idle sessions of other keys):
- named prefixes: how many (SERVING_PREFIXES_PER_KEY) and the KV bytes their positions take
  (SERVING_PREFIX_BYTES_PER_KEY): prefixes never expire, sessions do, so they get a share of their own;
- KV bytes of everything the key holds, its sessions' positions and its prefixes' together
  (SERVING_KV_BYTES_PER_KEY, by default SERVING_KV_SHARE_PER_KEY of the session model's budget);
- open sessions: GatewaySessions' own count (SERVING_SESSIONS_PER_KEY).
Past one: 429 `quota_exceeded`, naming the limit, its setting, what was asked and what the key holds.

A position's bytes: keys and values of every layer, 2 x n_layers x n_kv_heads x head_dim x 4 bytes. The
session model's config publishes its sizes but not its cache's dtype, so it is counted as float32, the
widest the engine keeps: a quantized or fp16 cache holds more positions than the quota counts, never
fewer. The server rounds a session's row up (design.md, "Sessions per GiB"); the gateway counts the
positions held, and SERVING_SESSIONS_PER_KEY bounds what the rounding adds.

When: a session is charged its length once open (a start from a snapshot, a prefix or a fork holds its
positions at once; one that takes the key past its quota is ended at once and refused); a step or a
generation reserves the most it can add before it goes upstream and is settled to the session's length
after (a step's is settled at the session's next operation: its length is exact then); a rewind settles;
an ended session (DELETE, idle, refused) is released. The tallies are this gateway process's, as
SERVING_SESSIONS_PER_KEY's are: with several gateways (or SERVING_WORKERS) each holds a key to its quota.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

from client import ModelInfo
from serving.gateway.errors import QuotaExceeded
from serving.gateway.settings import Settings

CACHE_ITEMSIZE = 4  # float32: the cache's dtype is not published (see the module)
# a model whose config does not publish its KV budget: a key gets its share of the serving default
# (contract/deployment.py, 2 GiB)
UNPUBLISHED_BUDGET_BYTES = 2 << 30
KV_SETTING = "SERVING_KV_BYTES_PER_KEY"


@dataclasses.dataclass
class Held:
    """What one key holds, in bytes of KV cache: its sessions' and prefixes' together, and its prefixes by name."""

    nbytes: int = 0
    prefixes: dict[str, int] = dataclasses.field(default_factory=dict)  # name -> bytes (reserved or put)
    sessions: int = 0  # sessions charged (some may hold no positions yet)

    @property
    def prefix_bytes(self) -> int:
        return sum(self.prefixes.values())  # at most SERVING_PREFIXES_PER_KEY entries


@dataclasses.dataclass
class Charge:
    """A session's share of its key's tally."""

    owner: str
    nbytes: int
    touched: float


class Quotas:
    """The per-key tallies and their checks. Sessions are the client library's (AsyncSession), by identity; a
    session's positions are counted at its own model's bytes (the OpenAI routes may step another model set's)."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.clock = settings, clock
        self._position_bytes: dict[str, int] = {}  # model -> a position's bytes, once its sizes are learned
        self.kv_bytes = settings.kv_bytes_per_key or int(settings.kv_share_per_key * UNPUBLISHED_BUDGET_BYTES)
        self.prefix_bytes = settings.prefix_bytes_per_key or self.kv_bytes // 2
        self._held: dict[str, Held] = {}
        self._charges: dict[Any, Charge] = {}

    def learn(self, model: str, info: ModelInfo) -> None:
        """A served model's sizes: a position's bytes; the session routes' model's budget sets the defaults."""
        facts = info.facts
        sizes = [facts.get(name) or getattr(info, name) for name in ("n_layers", "n_kv_heads", "head_dim")]
        if not all(isinstance(size, int) and size > 0 for size in sizes):
            return
        n_layers, n_kv_heads, head_dim = sizes
        self._position_bytes[model] = 2 * n_layers * n_kv_heads * head_dim * CACHE_ITEMSIZE
        budget = facts.get("kv_cache_bytes")
        if model != self.settings.session_model or not isinstance(budget, int) or budget <= 0:
            return
        self.kv_bytes = self.settings.kv_bytes_per_key or int(self.settings.kv_share_per_key * budget)
        self.prefix_bytes = self.settings.prefix_bytes_per_key or self.kv_bytes // 2

    def position_bytes(self, model: str) -> int | None:
        return self._position_bytes.get(model)

    def held(self, owner: str) -> Held:
        return self._held.get(owner) or Held()

    # --- prefixes -----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def putting_prefix(self, owner: str, name: str, positions: int) -> Iterator[None]:
        """Reserve a new prefix of `positions` (the session routes' model's) for the PUT inside, or 429; given
        back if the PUT fails. A name the key holds already is left to the server, which refuses it (prefixes
        are immutable)."""
        held = self.held(owner)
        if name in held.prefixes:
            yield
            return
        self._check_prefix(held, positions)
        held = self._held.setdefault(owner, held)
        nbytes = positions * (self.position_bytes(self.settings.session_model) or 0)
        held.prefixes[name], held.nbytes = nbytes, held.nbytes + nbytes
        try:
            yield
        except BaseException:
            self.prefix_deleted(owner, name)
            raise

    def _check_prefix(self, held: Held, positions: int) -> None:
        count, limit = len(held.prefixes), self.settings.prefixes_per_key
        if count >= limit:
            raise QuotaExceeded(
                f"this API key's prefixes hold {count} of {limit} (SERVING_PREFIXES_PER_KEY); DELETE one first"
            )
        model = self.settings.session_model
        prefixes = Limit(self.prefix_bytes, "SERVING_PREFIX_BYTES_PER_KEY", "prefixes")
        self._check("a new prefix", held.prefix_bytes, positions, model, prefixes)
        self._check("a new prefix", held.nbytes, positions, model)

    def prefix_deleted(self, owner: str, name: str) -> None:
        held = self._held.get(owner)
        if held is not None and name in held.prefixes:
            held.nbytes -= held.prefixes.pop(name)
            self._drop_if_empty(owner, held)

    # --- sessions -----------------------------------------------------------------------------------------

    def opened(self, owner: str, session: Any) -> None:
        """Charge a session just opened its length (a start from a snapshot, a prefix or a fork holds some);
        429 without charging it when that takes the key past its quota (the caller ends it)."""
        self._check("the new session", self.held(owner).nbytes, session.length, _model(session))
        self._charge(owner, session, session.length)

    def grow(self, owner: str, session: Any, positions: int) -> None:
        """Before a step or a generation: reserve the `positions` it can add beyond the session's length now
        (exact: no other request of the session is in flight), or 429."""
        charge = self._charges.get(session)
        held = self.held(owner).nbytes - (charge.nbytes if charge is not None else 0)  # the session re-counted
        grown = session.length + positions
        what = f"a session growing from {session.length} to {grown} positions"
        others = Limit(self.kv_bytes, KV_SETTING, "other sessions and prefixes")
        self._check(what, held, grown, _model(session), others)
        self._charge(owner, session, session.length + positions)

    @contextlib.contextmanager
    def growing(self, owner: str, session: Any, positions: int) -> Iterator[None]:
        """`grow`, then the session settled to its length once what is inside (a generation) is done."""
        self.grow(owner, session, positions)
        try:
            yield
        finally:
            self.settle(owner, session)

    def settle(self, owner: str, session: Any) -> None:
        """The session charged its length as it is now (after a rewind, a generation)."""
        self._charge(owner, session, session.length)

    def release(self, *sessions: Any) -> None:
        """Sessions ended or handed over (an OpenAI request's, kept or ended at its end): no longer counted."""
        for session in sessions:
            charge = self._charges.pop(session, None)
            if charge is not None:
                held = self._held[charge.owner]
                held.nbytes, held.sessions = held.nbytes - charge.nbytes, held.sessions - 1
                self._drop_if_empty(charge.owner, held)

    def forget_idle(self, idle_s: float) -> None:
        """Release the sessions untouched for `idle_s`: with gateways sharing sessions, an idle one is forgotten
        here without an END (another gateway may go on with it, and counts it there)."""
        before = self.clock() - idle_s
        self.release(*[session for session, charge in self._charges.items() if charge.touched < before])

    # --- the tallies ----------------------------------------------------------------------------------------

    def _charge(self, owner: str, session: Any, positions: int) -> None:
        """The session counted as holding `positions` (re-counted from its length each time: a charge made
        before its model's sizes were known is right from its next operation on)."""
        held = self._held.setdefault(owner, Held())
        charge = self._charges.get(session)
        if charge is None:
            charge = self._charges[session] = Charge(owner, 0, self.clock())
            held.sessions += 1
        nbytes = positions * (self.position_bytes(_model(session)) or 0)
        held.nbytes += nbytes - charge.nbytes
        charge.nbytes, charge.touched = nbytes, self.clock()

    def _drop_if_empty(self, owner: str, held: Held) -> None:
        if not held.sessions and not held.prefixes:
            self._held.pop(owner, None)

    def _check(self, what: str, held: int, positions: int, model: str, limit: Limit | None = None) -> None:
        """429 when `positions` of `model` over the `held` bytes pass the limit (the key's KV bytes unless
        told); unchecked until the model's sizes are known (they come with its metadata, at start)."""
        limit = limit or Limit(self.kv_bytes, KV_SETTING, "sessions and prefixes")
        position_bytes = self.position_bytes(model)
        if position_bytes is None or positions <= 0:
            return
        asked = positions * position_bytes
        if held + asked > limit.nbytes:
            raise QuotaExceeded(
                f"{what}: this API key's {limit.of} hold {held:,} of {limit.nbytes:,} bytes of KV cache "
                f"({limit.setting}) and it needs {asked:,} ({positions} positions of {position_bytes:,} bytes); "
                "DELETE or rewind a session, or DELETE a prefix"
            )


@dataclasses.dataclass(frozen=True)
class Limit:
    nbytes: int
    setting: str
    of: str  # what it counts, as the refusal names it


def _model(session: Any) -> str:
    """The session model a client session steps."""
    return session.client.session_model
