"""Ids that are gone, each with the error that answers a later request for it.

A session or sequence that ended, was evicted or was lost answers a late step precisely ("has
ended", "was evicted after 300 s idle") instead of "unknown". The registry is bounded: past
`remember` ids the oldest are forgotten and answer as unknown.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable


class Tombstones:
    def __init__(self, remember: int = 4096) -> None:
        assert remember > 0
        self._remember = remember
        self._gone: collections.OrderedDict[Hashable, Callable[[], Exception]] = collections.OrderedDict()

    def bury(self, key: Hashable, answer: Callable[[], Exception]) -> None:
        """`key` is gone; `answer()` makes the error a later request for it gets."""
        self._gone[key] = answer
        self._gone.move_to_end(key)
        while len(self._gone) > self._remember:
            self._gone.popitem(last=False)

    def revive(self, key: Hashable) -> None:
        """`key` is in use again (a new session or sequence with the same id)."""
        self._gone.pop(key, None)

    def answer(self, key: Hashable, unknown: Callable[[], Exception]) -> Exception:
        """The error for a request about `key`: why it is gone, else `unknown()`."""
        return self._gone.get(key, unknown)()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._gone

    def __len__(self) -> int:
        return len(self._gone)
