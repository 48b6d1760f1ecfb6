"""Ids that are gone, each with what to say about it: a sequence that ended or was evicted answers a
late step precisely ("has ended", "was evicted after 300 s idle") instead of "unknown", and a gateway
session says why it is gone. One registry for the session engines' live sequences (serving/engine/sequences.py)
and the gateway's sessions (serving/gateway/sessions.py).

Bounded: past `remember` ids the oldest are forgotten (and answer as unknown).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class Tombstones(Generic[V]):
    def __init__(self, remember: int = 4096) -> None:
        assert remember > 0
        self._remember = remember
        self._gone: collections.OrderedDict[Hashable, V] = collections.OrderedDict()

    def bury(self, key: Hashable, what: V) -> None:
        """`key` is gone; `what` says why (an error to raise, a reason to give)."""
        self._gone[key] = what
        self._gone.move_to_end(key)
        while len(self._gone) > self._remember:
            self._gone.popitem(last=False)

    def revive(self, key: Hashable) -> None:
        """`key` is in use again (a new session or sequence with the same id)."""
        self._gone.pop(key, None)

    def get(self, key: Hashable) -> V | None:
        return self._gone.get(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._gone

    def __len__(self) -> int:
        return len(self._gone)
