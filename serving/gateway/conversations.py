"""Conversations that never prefill twice: the sessions of a key's ended OpenAI requests, kept with the token
ids each holds, so that a next request whose prompt extends one of them forks its KV cache and prefills only
the rest (what prefix caching does in vLLM and SGLang; here the cache is a session's, exactly).

A chat client re-sends the whole conversation every turn: turn N's prompt is turn N-1's prompt, its answer
and the new message. The index finds, among the key's kept sessions, the one sharing the longest prefix of
token ids with the new prompt; the route forks it (a copy of its rows inside the server), rewinds the fork to
where the two part and steps only the rest. The kept session stays for other branches (a regenerated answer,
an edited message) until it is the key's least recently used beyond `per_key`, or idle `idle_s`; then it is
ended and its KV cache freed. Kept sessions are the gateway's own: they do not count against the key's
`sessions_per_key` and are never visible to the caller.

Everything runs on the event loop: plain dicts suffice. An entry is taken (`busy`) while a fork reads it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

# the fewest shared ids worth a fork: a fork and a rewind are two round trips to the server, about what a
# prefill of this many tokens costs on the CPU (chosen, not tuned); every chat template's opening markers are
# shared by all of a key's conversations and would otherwise fork an unrelated one
MIN_SHARED = 16


@dataclasses.dataclass
class Kept:
    upstream: Any  # client.AsyncSession holding `tokens`
    tokens: np.ndarray  # (T,) int64: every id the session holds, in order
    last_used: float
    busy: int = 0  # forks reading it now


def shared_prefix(held: np.ndarray, prompt: np.ndarray) -> int:
    """How many leading ids `held` and `prompt` share."""
    n = min(len(held), len(prompt))
    differ = np.flatnonzero(held[:n] != prompt[:n])
    return int(differ[0]) if differ.size else n


class Conversations:
    """Per key, at most `per_key` kept sessions, each ended once idle `idle_s` (`sweep`)."""

    def __init__(self, per_key: int, idle_s: float) -> None:
        self.per_key, self.idle_s = per_key, idle_s
        self._kept: dict[str, list[Kept]] = {}

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._kept.values())

    def longest(self, owner: str, prompt: np.ndarray) -> tuple[Kept | None, int]:
        """The key's kept session sharing the longest prefix with `prompt`, and its length (none sharing at
        least MIN_SHARED ids: (None, 0))."""
        best, best_length = None, MIN_SHARED - 1
        for entry in self._kept.get(owner, ()):
            length = shared_prefix(entry.tokens, prompt)
            if length > best_length:
                best, best_length = entry, length
        return (best, best_length) if best is not None else (None, 0)

    def keep(self, owner: str, upstream: Any, tokens: Sequence[int] | np.ndarray) -> list[Any]:
        """Keep `upstream` holding `tokens`; returns the sessions that no longer fit (to be ended)."""
        if self.per_key == 0:
            return [upstream]
        entries = self._kept.setdefault(owner, [])
        entries.append(Kept(upstream, np.asarray(tokens, np.int64), time.monotonic()))
        return self._trim(owner, entries)

    def _trim(self, owner: str, entries: list[Kept]) -> list[Any]:
        entries.sort(key=lambda entry: entry.last_used, reverse=True)
        dropped = [entry for entry in entries[self.per_key :] if not entry.busy]
        for entry in dropped:
            entries.remove(entry)
        if not entries:
            del self._kept[owner]
        return [entry.upstream for entry in dropped]

    def used(self, entry: Kept) -> None:
        entry.last_used = time.monotonic()

    def sweep(self) -> list[Any]:
        """The sessions idle for `idle_s`, forgotten here (to be ended)."""
        cutoff = time.monotonic() - self.idle_s
        ended = []
        for owner in list(self._kept):
            entries = self._kept[owner]
            idle = [entry for entry in entries if entry.last_used < cutoff and not entry.busy]
            for entry in idle:
                entries.remove(entry)
            ended += [entry.upstream for entry in idle]
            if not entries:
                del self._kept[owner]
        return ended

    def forget(self, upstream: Any) -> None:
        """A kept session found broken (its server lost it): never forked again."""
        for owner in list(self._kept):
            self._kept[owner] = [entry for entry in self._kept[owner] if entry.upstream is not upstream]
            if not self._kept[owner]:
                del self._kept[owner]

    def drain(self) -> list[Any]:
        """Every kept session, forgotten here (the gateway stops)."""
        ended = [entry.upstream for entries in self._kept.values() for entry in entries]
        self._kept.clear()
        return ended
