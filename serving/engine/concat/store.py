"""The concat engine's per-sequence KV caches: START creates, each step replaces, END frees; and the
named prefixes, kept until deleted.

The store is device-agnostic: a sequence's cache is whatever the runner returns (ONNX Runtime
values on the CPU or the GPU), all of it real positions (a step's padded tokens never enter it), so
its length is the cache's. A cache is never written in place (a step's presents are new values), so
a fork or a session started from a prefix holds the same values as its source until either steps.

Budget: each live sequence and each prefix reserves room for `max_positions` positions (the
model's max_seq_len) when it starts, so a sequence that started never fails later because others
grew; a START that does not fit gets `CacheFull` (UNAVAILABLE). Idle sequences are evicted after
`idle_timeout` seconds (prefixes never are). Ended and evicted ids are remembered (boundedly) to
answer precisely.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from contract.deployment import MAX_LIVE_SEQUENCES
from serving.engine import errors
from serving.engine.sequences import LiveSequences, SequenceId
from serving.engine.steps import CacheStats


@dataclasses.dataclass
class SequenceCache:
    caches: list[Any]  # one runner value per past tensor, in naming-table order, (1, n_kv, length, hd) each
    length: int  # positions held, every one a real token
    nbytes: int  # bytes the caches hold
    last_used: float


class KVCacheStore:
    def __init__(
        self,
        bytes_per_position: int,
        max_positions: int,
        budget_bytes: int,
        idle_timeout: float,
        remember: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert bytes_per_position > 0 and max_positions > 0 and idle_timeout > 0
        self.max_positions = max_positions
        self.reservation = bytes_per_position * max_positions
        self.budget = budget_bytes
        self.idle_timeout = idle_timeout
        self._clock = clock
        # dropping an entry drops the last reference to its caches: the memory is the next sequences'
        self._live: LiveSequences[SequenceCache] = LiveSequences(idle_timeout, clock, remember)
        self._prefixes: dict[tuple[str, str], SequenceCache] = {}  # (owner, name) -> its cache
        self._lock = threading.Lock()  # execute() and the idle sweeper both use the store

    @property
    def capacity(self) -> int:
        """How many sequences and prefixes fit the budget at once (at most MAX_LIVE_SEQUENCES, as Triton's
        sequence slots are sized: contract.deployment.most_sequences)."""
        return min(MAX_LIVE_SEQUENCES, self.budget // self.reservation)

    def start(self, sequence_id: SequenceId, caches: list[Any], length: int = 0, nbytes: int = 0) -> SequenceCache:
        """A new sequence holding `caches` (empty ones, or a copy's); a repeated START restarts the
        sequence (as Triton does)."""
        with self._lock:
            self._live.restart(sequence_id)
            self._check_room(sequence_id)
            return self._live.add(sequence_id, SequenceCache(caches, length, nbytes, self._clock()))

    def _check_room(self, name: SequenceId | str) -> None:
        if len(self._live) + len(self._prefixes) >= self.capacity:
            mib = 1 << 20
            raise errors.CacheFull(
                name,
                f"the KV cache budget of {self.budget / mib:.1f} MiB is full: {len(self._live)} live sequences "
                f"and {len(self._prefixes)} prefixes reserve {self.reservation / mib:.1f} MiB each (max_seq_len "
                f"{self.max_positions} positions); retry later or end a sequence",
            )

    def get(self, sequence_id: SequenceId) -> SequenceCache:
        """A live sequence's cache, marked used now; raises the precise error for any other id."""
        with self._lock:
            return self._live.touch(sequence_id)

    def length(self, sequence_id: SequenceId) -> int:
        """Positions the sequence holds; -1 when it is not live."""
        with self._lock:
            entry = self._live.entries.get(sequence_id)
            return -1 if entry is None else entry.length

    def check_length(self, sequence_id: SequenceId, entry: SequenceCache, new: int) -> None:
        if entry.length + new > self.max_positions:
            raise errors.SequenceTooLong(sequence_id, entry.length + new, self.max_positions)

    def update(self, sequence_id: SequenceId, caches: list[Any], length: int, nbytes: int) -> None:
        """Replace a live sequence's cache (a step's presents, a rewind's cut); a no-op if it is gone
        meanwhile."""
        with self._lock:
            entry = self._live.entries.get(sequence_id)
            if entry is not None:
                entry.caches, entry.length, entry.nbytes, entry.last_used = caches, length, nbytes, self._clock()

    def rename(self, sequence_id: SequenceId, into: SequenceId) -> None:
        """The live sequence's cache goes on as `into`; `sequence_id` has ended."""
        with self._lock:
            self._live.rename(sequence_id, into)

    def end(self, sequence_id: SequenceId) -> bool:
        """Free a sequence's cache; False if it held none."""
        with self._lock:
            return self._live.end(sequence_id)

    def evict_idle(self) -> list[SequenceId]:
        with self._lock:
            return self._live.evict_idle()

    # --- named prefixes ------------------------------------------------------------------------------

    def check_prefix(self, owner: str, name: str) -> None:
        """Raises unless a prefix `name` of `owner` could be put now: the name is free and the budget has room."""
        with self._lock:
            self._check_new_prefix(owner, name)

    def _check_new_prefix(self, owner: str, name: str) -> None:
        if (owner, name) in self._prefixes:
            raise errors.InvalidRequest(f"prefix {name!r} exists and is immutable: delete it first")
        self._check_room(name)

    def put_prefix(self, owner: str, name: str, caches: list[Any], length: int, nbytes: int) -> None:
        with self._lock:
            self._check_new_prefix(owner, name)
            self._prefixes[owner, name] = SequenceCache(caches, length, nbytes, self._clock())

    def prefix(self, owner: str, name: str) -> SequenceCache:
        with self._lock:
            entry = self._prefixes.get((owner, name))
        if entry is None:
            raise errors.UnknownPrefix(name)
        return entry

    def delete_prefix(self, owner: str, name: str) -> None:
        """Free the prefix; sessions started from it keep their caches."""
        with self._lock:
            if self._prefixes.pop((owner, name), None) is None:
                raise errors.UnknownPrefix(name)

    def prefixes(self, owner: str) -> dict[str, int]:
        """The owner's prefixes: name -> positions."""
        with self._lock:
            return {name: entry.length for (who, name), entry in self._prefixes.items() if who == owner}

    def stats(self) -> CacheStats:
        """`sequences` counts live sequences; the bytes count the prefixes too (they take the budget),
        and a cache a fork shares once per holder."""
        with self._lock:
            entries = [*self._live.entries.values(), *self._prefixes.values()]
            held = sum(entry.nbytes for entry in entries)
            return CacheStats(
                sequences=len(self._live),
                held_bytes=held,
                reserved_bytes=len(entries) * self.reservation,
                budget_bytes=self.budget,
                evictions=self._live.evictions,
                allocated_bytes=held,
            )
