"""The concat engine's KV cache store on its own: lifecycle, precise errors, the budget (sequences and
prefixes), idle eviction."""

from __future__ import annotations

import gc
import weakref

import pytest

from serving.engine import errors
from serving.engine.concat import KVCacheStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Cache:
    """Stands in for a runner's device value: the store never looks inside."""


def store(capacity: int = 3, idle: float = 10.0, remember: int = 100) -> tuple[KVCacheStore, Clock]:
    clock = Clock()
    # 64 bytes a position, 100 positions a sequence: each sequence reserves 6400 bytes
    budget = capacity * 6400 + 1
    made = KVCacheStore(64, 100, budget, idle_timeout=idle, remember=remember, clock=clock)
    return made, clock


def test_start_update_end():
    cache, _ = store()
    entry = cache.start("a", [])
    assert entry.length == 0 and cache.stats().sequences == 1
    cache.update("a", [Cache()], length=5, nbytes=320)
    assert cache.get("a").length == 5
    assert cache.stats().held_bytes == 320 and cache.stats().reserved_bytes == 6400
    assert cache.end("a") is True
    assert cache.stats().sequences == 0 and cache.stats().held_bytes == 0
    assert cache.end("a") is False


def test_each_missing_sequence_gets_its_own_error():
    cache, clock = store(idle=10.0)
    with pytest.raises(errors.UnknownSequence, match="'nope' is unknown: start it with the START flag"):
        cache.get("nope")
    cache.start(1, [])
    cache.end(1)
    with pytest.raises(errors.SequenceEnded, match="1 has ended"):
        cache.get(1)
    cache.start(2, [])
    clock.now = 10.0
    assert cache.evict_idle() == [2]
    with pytest.raises(errors.SequenceEvicted, match="2 was evicted after 10 s idle"):
        cache.get(2)
    assert all(e.code == errors.INVALID_ARG for e in (errors.UnknownSequence(1), errors.SequenceEvicted(1, 1)))


def test_a_step_keeps_a_sequence_alive():
    cache, clock = store(idle=10.0)
    cache.start("a", [])
    clock.now = 9.0
    cache.get("a")
    clock.now = 15.0
    assert cache.evict_idle() == []
    clock.now = 19.0
    assert cache.evict_idle() == ["a"]
    assert cache.stats().evictions == 1


def test_a_full_budget_refuses_new_sequences_only():
    cache, _ = store(capacity=2)
    assert cache.capacity == 2
    cache.start("a", [])
    cache.start("b", [])
    with pytest.raises(errors.CacheFull, match=r"'c' cannot start: the KV cache budget .* is full: 2 live") as full:
        cache.start("c", [])
    assert full.value.code == errors.UNAVAILABLE
    cache.get("a"), cache.get("b")  # the others keep working
    cache.end("a")
    cache.start("c", [])  # room again


def test_idle_sequences_make_room_for_a_new_one():
    cache, clock = store(capacity=1, idle=5.0)
    cache.start("old", [])
    clock.now = 6.0
    cache.start("new", [])
    with pytest.raises(errors.SequenceEvicted):
        cache.get("old")


def test_start_again_restarts_and_forgets_the_old_end():
    cache, _ = store()
    cache.start("a", [])
    cache.update("a", [Cache()], 3, 192)
    assert cache.start("a", []).length == 0
    assert cache.stats().sequences == 1
    cache.end("a")
    cache.start("a", [])
    assert cache.get("a").length == 0


def test_too_long_names_the_limit():
    cache, _ = store()
    entry = cache.start("a", [])
    cache.check_length("a", entry, 100)
    with pytest.raises(errors.SequenceTooLong, match="would hold 101 positions, more than max_seq_len 100"):
        cache.check_length("a", entry, 101)


def test_remembered_ids_are_bounded():
    cache, _ = store(remember=2)
    for name in "abc":
        cache.start(name, [])
        cache.end(name)
    with pytest.raises(errors.UnknownSequence):  # the oldest one is forgotten
        cache.get("a")
    with pytest.raises(errors.SequenceEnded):
        cache.get("c")


def test_end_and_eviction_drop_the_last_reference():
    cache, clock = store(idle=1.0)
    values = {name: Cache() for name in "ab"}
    refs = {name: weakref.ref(value) for name, value in values.items()}
    for name in "ab":
        cache.start(name, [])
        cache.update(name, [values[name]], 1, 64)
    values.clear()
    cache.end("a")
    clock.now = 2.0
    cache.evict_idle()
    gc.collect()
    assert refs["a"]() is None and refs["b"]() is None


def test_prefixes_take_the_budget_and_are_never_evicted():
    cache, clock = store(capacity=2, idle=1.0)
    cache.check_prefix("alice", "system")
    cache.put_prefix("alice", "system", [Cache()], 4, 256)
    cache.start("a", [Cache()], 4, 256)
    with pytest.raises(errors.CacheFull, match="full: 1 live sequences and 1 prefixes reserve"):
        cache.start("b", [])
    with pytest.raises(errors.InvalidRequest, match="prefix 'system' exists and is immutable"):
        cache.check_prefix("alice", "system")
    assert cache.stats().reserved_bytes == 2 * 6400 and cache.stats().held_bytes == 512
    clock.now = 5.0
    assert cache.evict_idle() == ["a"]
    assert cache.prefixes("alice") == {"system": 4} and cache.prefixes("bob") == {}
    with pytest.raises(errors.UnknownPrefix, match="prefix 'system' is unknown here"):
        cache.prefix("bob", "system")  # another owner's name is not found
    cache.delete_prefix("alice", "system")
    with pytest.raises(errors.UnknownPrefix):
        cache.delete_prefix("alice", "system")
    assert cache.stats().reserved_bytes == 0
