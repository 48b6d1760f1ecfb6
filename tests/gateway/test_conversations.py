"""The index of kept conversations (serving/gateway/conversations.py): the longest shared prefix of a key's kept
sessions, least recently used beyond the per-key cap and idle ones ended, a busy one (being forked) kept."""

from __future__ import annotations

import time

import numpy as np
import pytest

from serving.gateway.conversations import MIN_SHARED, Conversations, shared_prefix

pytestmark = pytest.mark.unit


def test_shared_prefix_counts_leading_equal_ids():
    held = np.array([5, 6, 7, 8])
    assert shared_prefix(held, np.array([5, 6, 9])) == 2
    assert shared_prefix(held, np.array([5, 6, 7, 8, 9, 10])) == 4  # the prompt extends what is held
    assert shared_prefix(held, np.array([5, 6])) == 2  # what is held extends the prompt
    assert shared_prefix(held, np.array([1])) == 0


def test_the_longest_match_of_the_callers_own_sessions_is_found_from_min_shared_on():
    opening = list(range(100, 100 + MIN_SHARED))  # a chat template's opening, and a system prompt
    kept = Conversations(per_key=4, idle_s=60)
    kept.keep("alice", "short", [*opening, 1, 2, 3])
    kept.keep("alice", "long", [*opening, 1, 2, 3, 4, 5, 6])
    kept.keep("bob", "bobs", [*opening, 1, 2, 3, 4, 5, 6, 7])
    entry, length = kept.longest("alice", np.array([*opening, 1, 2, 3, 4, 5, 9]))
    assert (entry.upstream, length) == ("long", MIN_SHARED + 5)
    assert kept.longest("alice", np.array([8, 1])) == (None, 0)
    assert kept.longest("alice", np.array(opening[:-1])) == (None, 0)  # too few shared to be worth a fork
    assert kept.longest("carol", np.array(opening)) == (None, 0)  # another key's sessions are never found


def test_beyond_the_cap_the_least_recently_used_go_and_a_busy_one_stays():
    kept = Conversations(per_key=2, idle_s=60)
    assert kept.keep("alice", "a", [1]) == []
    assert kept.keep("alice", "b", [2]) == []
    # "a" used after "b" was kept: "b" is now the least recent
    kept.used(next(e for e in kept._kept["alice"] if e.upstream == "a"))
    assert kept.keep("alice", "c", [3]) == ["b"]
    entry = next(e for e in kept._kept["alice"] if e.upstream == "a")
    entry.busy = 1  # a fork is reading it
    time.sleep(0.001)
    kept.keep("alice", "d", [4])
    kept.keep("alice", "e", [5])
    assert "a" in [e.upstream for e in kept._kept["alice"]]
    assert Conversations(per_key=0, idle_s=60).keep("alice", "x", [1]) == ["x"]  # none kept: ended at once


def test_idle_ones_are_swept_and_everything_is_drained_at_the_end():
    kept = Conversations(per_key=4, idle_s=0.05)
    kept.keep("alice", "old", [1])
    time.sleep(0.1)
    kept.keep("alice", "new", [2])
    assert kept.sweep() == ["old"] and len(kept) == 1
    kept.forget("new")
    assert len(kept) == 0
    kept.keep("bob", "b", [1])
    assert kept.drain() == ["b"] and len(kept) == 0
