"""The live sequences of a session engine's store, for both engines (serving/engine/concat/store.py,
serving/engine/static_engine.py): id -> entry (anything with a `last_used` time), the tombstones of the
ids that are gone (to answer a late step precisely), idle eviction, and the count of evictions.

Not locked: the store that owns it holds its own lock around every call (execute() and the idle
sweeper both use it). `release(entry)` gives an entry's memory back (the static engine's row).

The entries are kept in the order they were last used (a touch moves one to the end), so finding the
idle ones reads only them and the first that is not: a START's sweep and the sweeper's cost the
sequences they evict, not the thousands that stay (issue 34: a step's cost grew with the idle sessions).
An owner that sets an entry's `last_used` itself (the concat store, after the step that touched it) keeps
the order to within that step.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar

from contract.tombstones import Tombstones
from serving.engine import errors
from serving.engine.errors import gone_error

SequenceId = Hashable  # Triton's correlation id: an int, or a str


class Entry(Protocol):
    last_used: float


E = TypeVar("E", bound=Entry)


class LiveSequences(Generic[E]):
    def __init__(
        self,
        idle_timeout: float,
        clock: Callable[[], float],
        remember: int = 4096,
        release: Callable[[E], None] = lambda entry: None,
    ) -> None:
        assert idle_timeout > 0
        self.idle_timeout, self._clock, self._release = idle_timeout, clock, release
        self.entries: dict[SequenceId, E] = {}
        self._gone: Tombstones[Callable[[], errors.SequenceError]] = Tombstones(remember)
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def restart(self, sequence_id: SequenceId) -> None:
        """Make room for a START: a repeated START restarts the sequence (as Triton does), and the
        idle ones are evicted first so that they do not count against the budget."""
        previous = self.entries.pop(sequence_id, None)
        if previous is not None:
            self._release(previous)
        self._gone.revive(sequence_id)
        self.evict_idle()

    def add(self, sequence_id: SequenceId, entry: E) -> E:
        self.entries[sequence_id] = entry
        return entry

    def touch(self, sequence_id: SequenceId) -> E:
        """A live sequence's entry, marked used now; raises the precise error for any other id."""
        entry = self.entries.get(sequence_id)
        if entry is None:
            raise gone_error(self._gone, sequence_id)
        entry.last_used = self._clock()
        self.entries[sequence_id] = self.entries.pop(sequence_id)  # the most recently used: last
        return entry

    def rename(self, sequence_id: SequenceId, into: SequenceId) -> E:
        """The live sequence's entry goes on as `into` (what it holds unchanged); `sequence_id` has ended."""
        entry = self.touch(sequence_id)
        del self.entries[sequence_id]
        self._gone.revive(into)
        self.entries[into] = entry
        self._gone.bury(sequence_id, functools.partial(errors.SequenceEnded, sequence_id))
        return entry

    def end(self, sequence_id: SequenceId) -> bool:
        """Free a sequence (END); False if it held nothing."""
        entry = self.entries.pop(sequence_id, None)
        if entry is not None:
            self._release(entry)
        self._gone.bury(sequence_id, functools.partial(errors.SequenceEnded, sequence_id))
        return entry is not None

    def evict_idle(self) -> list[SequenceId]:
        deadline = self._clock() - self.idle_timeout
        idle = list(itertools.takewhile(lambda sid: self.entries[sid].last_used <= deadline, self.entries))
        for sid in idle:
            self._release(self.entries.pop(sid))  # the last reference: the memory is the next sequences'
            self._gone.bury(sid, functools.partial(errors.SequenceEvicted, sid, self.idle_timeout))
        self.evictions += len(idle)
        return idle
