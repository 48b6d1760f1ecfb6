"""Where a durable session's checkpoints live, so that it outlives the replica holding its cache
(docs/design.md, "Durable sessions").

A checkpoint is an increment: the session's snapshot (serving/engine/snapshots.py) of the positions
added since the one before, so the store holds each position once and the increments, restored
together in order, make the whole cache. Entries are scoped to an owner (the gateway's keyed
fingerprint of the caller's API key; "" for a direct client) and a session key (random, made by the
session), and each carries a tag (HMAC-SHA256, contract/integrity.py) under the store's secret over its
owner, session key, positions and bytes: an entry that was changed, or that is another session's, another
owner's or of other positions, is refused when read, never sent to a server (the server checks again that
the blobs are its model's and the owner's, and that their values are finite). A store opened without a
secret (a direct client's) tags under a public label: that binds each entry to its place and catches a
changed byte, but anyone who can write the store can forge an entry; give the gateways that share a store
one secret (SERVING_INTEGRITY_SECRETS, or the session secret it is derived from).

Two backends behind `SessionStore`: a local directory (the default of `python -m serving`: nothing to
install; one host's replicas share it) and Redis (several hosts). `open_store` picks one from a
setting: a path, or a `redis://` URL.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from client.errors import ClientError
from contract.integrity import PUBLIC_SECRET, STORE_DOMAIN, Keyring

_TAGGED = b"mac1:"  # an entry: this, the tag's 64 hex characters, then the blob
_TAG = len(_TAGGED) + 64
_OLD_DIGEST = 64  # hex characters of the unkeyed sha256 entries were written with before the tag
_ENDED = "ended"  # the entry that marks a session ended through another process
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class StoreError(ClientError):
    """The store cannot be read or written, or one of its entries is not what was written."""


@dataclasses.dataclass(frozen=True)
class StoreKey:
    """A session's place in the store: its owner and its own key."""

    owner: str
    session: str

    def __post_init__(self) -> None:
        if not _NAME.match(self.session):
            raise ValueError(f"store session key: expected 1 to 128 of [A-Za-z0-9_-], got {self.session!r}")

    @property
    def parts(self) -> tuple[str, str]:
        """The owner (any text: hashed into a name) and the session key, as the store names them."""
        return hashlib.sha256(self.owner.encode()).hexdigest()[:32] if self.owner else "_", self.session


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One increment: the snapshot of positions [start, end)."""

    start: int
    end: int
    blob: bytes


class SessionStore(abc.ABC):
    """A session's increments: each covers positions [start, end); `chunks` returns them in order.
    `secret`: what entries are tagged with (several: the first tags, any one verifies, for a rotation);
    None: a public label (see the module's docstring)."""

    def __init__(self, secret: bytes | str | Sequence[bytes | str] | None = None) -> None:
        self._keyring = Keyring(PUBLIC_SECRET if secret is None else secret)

    @abc.abstractmethod
    def append(self, key: StoreKey, start: int, end: int, blob: bytes) -> None:
        """Keep `blob` (the positions [start, end)) after the increments already kept."""

    @abc.abstractmethod
    def _spans(self, key: StoreKey) -> list[tuple[int, int]]:
        """The increments' (start, end), from their names alone (no blob is read)."""

    @abc.abstractmethod
    def _entries(self, key: StoreKey) -> dict[tuple[int, int], bytes]:
        """(start, end) -> the entry as written (digest, then the blob)."""

    @abc.abstractmethod
    def _drop(self, key: StoreKey, spans: list[tuple[int, int]]) -> None:
        """Forget the increments of these spans."""

    @abc.abstractmethod
    def delete(self, key: StoreKey) -> None:
        """Forget the session (nothing kept is fine)."""

    @abc.abstractmethod
    def end(self, key: StoreKey) -> None:
        """Forget the session and leave a mark that it was ended, so that a process still holding it
        (another gateway) does not rebuild it (`ended`)."""

    @abc.abstractmethod
    def ended(self, key: StoreKey) -> bool:
        """Whether the session was ended through another process (`end`)."""

    def chunks(self, key: StoreKey) -> list[Chunk]:
        """The session's increments in order, each checked against its tag; they cover 0 to the last
        one's end without a gap. StoreError naming the entry otherwise."""
        chunks, position = [], 0
        for (start, end), entry in sorted(self._entries(key).items()):
            if start != position:
                raise StoreError(f"session store entry {key.parts[1]}: positions {position} to {start} are missing")
            chunks.append(Chunk(start, end, self._checked(key, start, end, entry)))
            position = end
        return chunks

    def truncate(self, key: StoreKey, length: int) -> int:
        """Forget the increments that end past `length` (a rewound session); where the kept ones end."""
        spans = sorted(self._spans(key))
        dropped = [span for span in spans if span[1] > length]
        if dropped:
            self._drop(key, dropped)
        return max((end for start, end in spans if end <= length), default=0)

    def _entry(self, key: StoreKey, start: int, end: int, blob: bytes) -> bytes:
        """The entry as written: `_TAGGED`, the tag of the blob in its place, the blob."""
        tag = self._keyring.sign(STORE_DOMAIN, _bound(key, start, end, blob))
        return b"".join((_TAGGED, tag.encode(), blob))

    def _checked(self, key: StoreKey, start: int, end: int, entry: bytes) -> bytes:
        """The blob of an entry whose tag verifies for this place; StoreError saying why otherwise."""
        what = f"session store entry {key.parts[1]} [{start}, {end})"
        if not entry.startswith(_TAGGED):
            raise StoreError(f"{what} is refused: {_untagged(entry)}; it is not restored")
        tag, blob = entry[len(_TAGGED) : _TAG], entry[_TAG:]
        if not self._keyring.verifies(STORE_DOMAIN, _bound(key, start, end, blob), tag):
            raise StoreError(
                f"{what} is refused: its integrity tag does not match (the entry was changed, is another session's, "
                "owner's or position range's, or was written under another secret); it is not restored"
            )
        return blob


def _bound(key: StoreKey, start: int, end: int, blob: bytes) -> list[bytes]:
    """What an entry's tag is over: the blob and the place it was written for."""
    return [key.owner.encode(), key.session.encode(), str(start).encode(), str(end).encode(), blob]


def _untagged(entry: bytes) -> str:
    head = entry[:_OLD_DIGEST]
    if len(head) == _OLD_DIGEST and all(c in b"0123456789abcdef" for c in head):
        return "it was written in the old format (an unkeyed sha256), which is no longer trusted"
    return f"it does not start with its integrity tag ({_TAGGED.decode()!r})"


class DirectoryStore(SessionStore):
    """Increments as files `<root>/<owner>/<session>/<start>-<end>`, each written to a temporary file
    and renamed into place (a crash leaves no half entry). Folders are 0700."""

    def __init__(self, root: str | os.PathLike, secret: bytes | str | Sequence[bytes | str] | None = None) -> None:
        super().__init__(secret)
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)

    def _make_folder(self, key: StoreKey) -> Path:
        """The session's folder, every level made 0700: `mkdir(parents=True)` gives the levels above
        the last the default mode, which would leave each owner's folder listable by every user."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # removed under a running store: made anew
        folder = self.root
        for part in key.parts:
            folder = folder / part
            folder.mkdir(mode=0o700, exist_ok=True)
        return folder

    def __repr__(self) -> str:
        return f"DirectoryStore({str(self.root)!r})"

    def _folder(self, key: StoreKey) -> Path:
        return self.root.joinpath(*key.parts)

    def append(self, key: StoreKey, start: int, end: int, blob: bytes) -> None:
        temporary = None
        try:
            folder = self._make_folder(key)
            handle, temporary = tempfile.mkstemp(dir=folder, prefix=".incoming-")
            with os.fdopen(handle, "wb") as file:
                file.write(self._entry(key, start, end, blob))
            os.replace(temporary, folder / f"{start:012d}-{end:012d}")
        except OSError as error:
            if temporary is not None:  # a write that failed half way (a full disk) leaves nothing behind
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
            raise StoreError(f"session store {self.root}: cannot write {key.parts[1]}: {error}") from None

    def _files(self, key: StoreKey) -> list[Path]:
        folder = self._folder(key)
        try:
            return [p for p in folder.iterdir() if p.name[0] != "." and p.name != _ENDED] if folder.exists() else []
        except OSError as error:
            raise StoreError(f"session store {self.root}: cannot read {key.parts[1]}: {error}") from None

    def _spans(self, key: StoreKey) -> list[tuple[int, int]]:
        return [_span(path.name) for path in self._files(key)]

    def _entries(self, key: StoreKey) -> dict[tuple[int, int], bytes]:
        try:
            return {_span(path.name): path.read_bytes() for path in self._files(key)}
        except OSError as error:
            raise StoreError(f"session store {self.root}: cannot read {key.parts[1]}: {error}") from None

    def _drop(self, key: StoreKey, spans: list[tuple[int, int]]) -> None:
        for start, end in spans:
            (self._folder(key) / f"{start:012d}-{end:012d}").unlink(missing_ok=True)

    def delete(self, key: StoreKey) -> None:
        shutil.rmtree(self._folder(key), ignore_errors=True)

    def end(self, key: StoreKey) -> None:
        self.delete(key)
        try:
            (self._make_folder(key) / _ENDED).touch()
        except OSError as error:
            raise StoreError(f"session store {self.root}: cannot mark {key.parts[1]} ended: {error}") from None

    def ended(self, key: StoreKey) -> bool:
        return (self._folder(key) / _ENDED).exists()


class RedisStore(SessionStore):
    """Increments as fields `<start>-<end>` of one Redis hash per session, `attention-serving:<owner>:
    <session>`, kept `ttl_s` after the last write (a session nobody closes is forgotten)."""

    def __init__(
        self, url: str, ttl_s: int = 86_400, secret: bytes | str | Sequence[bytes | str] | None = None
    ) -> None:
        super().__init__(secret)
        import redis  # the server's optional dependency: only a Redis store needs it

        self.url, self.ttl_s = url, ttl_s
        self._redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        self._errors = (redis.RedisError, OSError)

    def __repr__(self) -> str:
        return f"RedisStore({_without_password(self.url)!r})"

    @staticmethod
    def _name(key: StoreKey) -> str:
        return "attention-serving:{}:{}".format(*key.parts)

    def _do(self, what: str, key: StoreKey, fn) -> Any:
        try:
            return fn(self._redis)
        except self._errors as error:
            where = _without_password(self.url)
            raise StoreError(f"session store {where}: cannot {what} {key.parts[1]}: {error}") from None

    def append(self, key: StoreKey, start: int, end: int, blob: bytes) -> None:
        name = self._name(key)

        def write(redis):
            with redis.pipeline() as pipe:  # MULTI/EXEC: the field and the expiry together
                pipe.hset(name, f"{start:012d}-{end:012d}", self._entry(key, start, end, blob))
                pipe.expire(name, self.ttl_s)
                pipe.execute()

        self._do("write", key, write)

    def _spans(self, key: StoreKey) -> list[tuple[int, int]]:
        fields = self._do("read", key, lambda redis: redis.hkeys(self._name(key)))
        return [_span(field.decode()) for field in fields if field != _ENDED.encode()]

    def _entries(self, key: StoreKey) -> dict[tuple[int, int], bytes]:
        fields = self._do("read", key, lambda redis: redis.hgetall(self._name(key)))
        return {_span(field.decode()): entry for field, entry in fields.items() if field != _ENDED.encode()}

    def _drop(self, key: StoreKey, spans: list[tuple[int, int]]) -> None:
        fields = [f"{start:012d}-{end:012d}" for start, end in spans]
        self._do("trim", key, lambda redis: redis.hdel(self._name(key), *fields))

    def delete(self, key: StoreKey) -> None:
        self._do("delete", key, lambda redis: redis.delete(self._name(key)))

    def end(self, key: StoreKey) -> None:
        name = self._name(key)

        def mark(redis):
            with redis.pipeline() as pipe:
                pipe.delete(name)
                pipe.hset(name, _ENDED, b"1")
                pipe.expire(name, self.ttl_s)
                pipe.execute()

        self._do("mark ended", key, mark)

    def ended(self, key: StoreKey) -> bool:
        return bool(self._do("read", key, lambda redis: redis.hexists(self._name(key), _ENDED)))


def _span(name: str) -> tuple[int, int]:
    start, _, end = name.partition("-")
    if not (start.isdigit() and end.isdigit()):
        raise StoreError(f"session store: an entry named {name!r} is not an increment (<start>-<end>)")
    return int(start), int(end)


def _without_password(url: str) -> str:
    return re.sub(r"//[^@/]*@", "//***@", url)


def open_store(
    setting: str | os.PathLike | None, secret: bytes | str | Sequence[bytes | str] | None = None
) -> SessionStore | None:
    """The store a setting names: None or "" or "none": no store (sessions are not durable); a
    `redis://` or `rediss://` URL: Redis; anything else: a local directory (made if missing). Its
    entries are tagged with `secret` (SessionStore)."""
    text = "" if setting is None else str(setting).strip()
    if text in ("", "none"):
        return None
    if text.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(text, secret=secret)
    return DirectoryStore(text, secret=secret)
