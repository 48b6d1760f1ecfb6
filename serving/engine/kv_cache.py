"""The per-sequence KV cache store of `mha_session`: START creates, each step replaces, END frees.

The store is device-agnostic: a sequence's cache is whatever the runner returns (ONNX Runtime
values on the CPU or the GPU), plus the mask of its positions kept on the host, since later steps
must keep ignoring positions that were padding when they were cached.

Budget: each live sequence reserves room for `max_positions` positions (its ModelConfig's
max_seq_len) when it starts, so a sequence that started never fails later because others grew;
a START that does not fit gets `CacheFull` (UNAVAILABLE). Idle sequences are evicted after
`idle_timeout` seconds. Ended and evicted ids are remembered (boundedly) to answer precisely.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from serving.engine import errors
from serving.engine.sequences import LiveSequences, SequenceId
from serving.engine.steps import CacheStats


@dataclasses.dataclass
class SequenceCache:
    caches: list[Any]  # one runner value per past tensor, in naming-table order, (1, n_kv, P, hd) each
    mask: np.ndarray  # (P,) int64: 1 where the cached position is a real token
    nbytes: int  # bytes the caches hold
    last_used: float

    @property
    def length(self) -> int:
        return int(self.mask.shape[0])


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
        self._lock = threading.Lock()  # execute() and the idle sweeper both use the store

    @property
    def capacity(self) -> int:
        """How many sequences fit the budget at once."""
        return self.budget // self.reservation

    def start(self, sequence_id: SequenceId, empty_caches: list[Any]) -> SequenceCache:
        """A new, empty sequence; a repeated START restarts the sequence (as Triton does)."""
        with self._lock:
            self._live.restart(sequence_id)
            if len(self._live) >= self.capacity:
                raise errors.CacheFull(sequence_id, self._full_message())
            return self._live.add(sequence_id, SequenceCache(empty_caches, np.zeros(0, np.int64), 0, self._clock()))

    def _full_message(self) -> str:
        mib = 1 << 20
        return (
            f"the KV cache budget of {self.budget / mib:.1f} MiB is full: {len(self._live)} live sequences "
            f"reserve {self.reservation / mib:.1f} MiB each (max_seq_len {self.max_positions} positions); "
            "retry later or end a sequence"
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

    def update(self, sequence_id: SequenceId, caches: list[Any], mask: np.ndarray, nbytes: int) -> None:
        """Replace a live sequence's cache with the step's presents (a no-op if it is gone meanwhile)."""
        with self._lock:
            entry = self._live.entries.get(sequence_id)
            if entry is not None:
                entry.caches, entry.mask, entry.nbytes, entry.last_used = caches, mask, nbytes, self._clock()

    def end(self, sequence_id: SequenceId) -> bool:
        """Free a sequence's cache; False if it held none."""
        with self._lock:
            return self._live.end(sequence_id)

    def evict_idle(self) -> list[SequenceId]:
        with self._lock:
            return self._live.evict_idle()

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                sequences=len(self._live),
                held_bytes=sum(entry.nbytes for entry in self._live.entries.values()),
                reserved_bytes=len(self._live) * self.reservation,
                budget_bytes=self.budget,
                evictions=self._live.evictions,
                allocated_bytes=sum(entry.nbytes for entry in self._live.entries.values()),
            )
