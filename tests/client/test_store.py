"""The session store's two backends (client/store.py), a local directory and a real redis-server:
increments kept and given back in order, each position once; a rewind's truncation; owners apart;
a changed or missing entry refused naming it, never given back; what a Redis restart keeps."""

from __future__ import annotations

import pytest

from client.store import DirectoryStore, RedisStore, StoreError, StoreKey, open_store


@pytest.fixture(params=["directory", "redis"])
def store(request, tmp_path):
    if request.param == "directory":
        return DirectoryStore(tmp_path / "sessions")
    server = request.getfixturevalue("redis_server")
    return RedisStore(server.url)


def test_increments_come_back_in_order_and_a_rewind_drops_those_past_it(store):
    key = StoreKey("", "s1")
    for start, end in ((0, 9), (9, 10), (10, 265)):
        store.append(key, start, end, f"blob {start}-{end}".encode())
    assert [(c.start, c.end, c.blob) for c in store.chunks(key)] == [
        (0, 9, b"blob 0-9"),
        (9, 10, b"blob 9-10"),
        (10, 265, b"blob 10-265"),
    ]
    assert store.truncate(key, 12) == 10  # [10, 265) ends past 12: gone; the kept ones end at 10
    assert [c.end for c in store.chunks(key)] == [9, 10]
    store.delete(key)
    assert store.chunks(key) == []


def test_owners_and_sessions_are_apart(store):
    alice, bob = StoreKey("key-fingerprint-a", "same"), StoreKey("key-fingerprint-b", "same")
    store.append(alice, 0, 3, b"alice's")
    assert store.chunks(bob) == []
    assert store.chunks(StoreKey("key-fingerprint-a", "other")) == []
    assert [c.blob for c in store.chunks(alice)] == [b"alice's"]
    store.delete(alice)


def test_a_missing_increment_is_refused_naming_the_positions(store):
    key = StoreKey("", "gap")
    store.append(key, 0, 4, b"a")
    store.append(key, 7, 9, b"c")
    with pytest.raises(StoreError, match=r"gap: positions 4 to 7 are missing"):
        store.chunks(key)
    store.delete(key)


def test_a_changed_entry_is_refused_with_both_digests(tmp_path):
    store = DirectoryStore(tmp_path)
    key = StoreKey("owner", "changed")
    store.append(key, 0, 5, b"the cache's bytes")
    (entry,) = [p for p in (tmp_path / key.parts[0] / "changed").iterdir()]
    entry.write_bytes(entry.read_bytes()[:-1] + b"!")
    with pytest.raises(
        StoreError, match=r"changed \[0, 5\) is corrupt: sha256 expected [0-9a-f]{64}, got [0-9a-f]{64}"
    ):
        store.chunks(key)


def test_a_changed_redis_entry_is_refused(redis_server):
    import redis

    store = RedisStore(redis_server.url)
    key = StoreKey("", "changed")
    store.append(key, 0, 2, b"xy")
    name = RedisStore._name(key)
    redis.Redis.from_url(redis_server.url).hset(name, f"{0:012d}-{2:012d}", b"0" * 64 + b"xy")
    with pytest.raises(StoreError, match="is corrupt"):
        store.chunks(key)
    store.delete(key)


def test_what_a_redis_restart_keeps_and_the_error_while_it_is_down(redis_server):
    store = RedisStore(redis_server.url)
    key = StoreKey("", "restarted")
    store.append(key, 0, 4, b"kept")
    redis_server.stop()
    with pytest.raises(StoreError, match=r"session store redis://127\.0\.0\.1:\d+/0: cannot write restarted"):
        store.append(key, 4, 5, b"lost")
    redis_server.start()
    store.append(key, 4, 5, b"after")  # the client reconnects by itself
    assert [c.blob for c in store.chunks(key)] == [b"kept", b"after"]  # the append-only file kept the first
    store.delete(key)


def test_the_setting_names_the_backend(tmp_path):
    assert open_store(None) is None and open_store("") is None and open_store("none") is None
    assert isinstance(open_store(tmp_path / "s"), DirectoryStore) and (tmp_path / "s").is_dir()
    remote = open_store("redis://user:secret@127.0.0.1:1/0")
    assert isinstance(remote, RedisStore) and "secret" not in repr(remote)
    with pytest.raises(ValueError, match="store session key"):
        StoreKey("", "../escape")
