"""The session store's two backends (client/store.py), a local directory and a real redis-server:
increments kept and given back in order, each position once; a rewind's truncation; owners apart;
a changed or missing entry, or one moved from its place (session, owner, positions), refused naming it,
never given back; secrets and their rotation; what a Redis restart keeps."""

from __future__ import annotations

import hashlib
from pathlib import Path

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


def entry_file(store: DirectoryStore, key: StoreKey, start: int, end: int) -> Path:
    return store.root.joinpath(*key.parts) / f"{start:012d}-{end:012d}"


def test_a_changed_entry_is_refused_naming_why(tmp_path):
    store = DirectoryStore(tmp_path, secret=b"gateway secret")
    key = StoreKey("owner", "changed")
    store.append(key, 0, 5, b"the cache's bytes")
    entry = entry_file(store, key, 0, 5)
    entry.write_bytes(entry.read_bytes()[:-1] + b"!")
    with pytest.raises(StoreError, match=r"changed \[0, 5\) is refused: its integrity tag does not match"):
        store.chunks(key)


def test_an_entry_of_another_session_owner_or_positions_is_refused(tmp_path):
    """An entry copied from its place into another is refused though its bytes are unchanged: its tag binds
    the owner, the session key and the positions it was written for."""
    store = DirectoryStore(tmp_path)  # no secret: the public label still binds each entry to its place
    alice = StoreKey("owner-a", "alice")
    store.append(alice, 0, 4, b"alice's first four")
    written = entry_file(store, alice, 0, 4).read_bytes()
    for place, start, end in [
        (StoreKey("owner-a", "other"), 0, 4),  # another session of the same owner
        (StoreKey("owner-b", "alice"), 0, 4),  # another owner's session of the same key
        (alice, 4, 8),  # other positions of the same session
    ]:
        target = entry_file(store, place, start, end)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(written)
        with pytest.raises(StoreError, match="integrity tag does not match"):
            store.chunks(place)
        target.unlink()


def test_entries_verify_under_the_secret_they_were_written_with_or_one_rotated_in_before(tmp_path):
    old, new = b"old secret", b"new secret"
    key = StoreKey("owner", "rotated")
    DirectoryStore(tmp_path, secret=old).append(key, 0, 3, b"under the old")
    with pytest.raises(StoreError, match="integrity tag does not match"):
        DirectoryStore(tmp_path, secret=new).chunks(key)
    with pytest.raises(StoreError, match="integrity tag does not match"):
        DirectoryStore(tmp_path).chunks(key)  # nor the public label
    rotating = DirectoryStore(tmp_path, secret=[new, old])  # the new one signs, both verify
    rotating.append(key, 3, 5, b"under the new")
    assert [c.blob for c in rotating.chunks(key)] == [b"under the old", b"under the new"]
    with pytest.raises(StoreError, match=r"\[0, 3\) is refused"):  # once the old secret is dropped
        DirectoryStore(tmp_path, secret=new).chunks(key)


def test_an_entry_in_the_old_unkeyed_format_is_refused_naming_it(redis_server):
    """An entry rewritten as entries were before they were keyed (the sha256 of the blob, then the blob):
    a fresh digest no longer makes an entry pass."""
    import redis

    store = RedisStore(redis_server.url)
    key = StoreKey("", "changed")
    store.append(key, 0, 2, b"xy")
    forged = hashlib.sha256(b"zz").hexdigest().encode() + b"zz"
    redis.Redis.from_url(redis_server.url).hset(RedisStore._name(key), f"{0:012d}-{2:012d}", forged)
    with pytest.raises(
        StoreError, match=r"\[0, 2\) is refused: it was written in the old format \(an unkeyed sha256\)"
    ):
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
