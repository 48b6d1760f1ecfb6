"""Keyed integrity (HMAC-SHA256) of what the serving stack hands out and reads back: a session snapshot
given to a user (the gateway signs it, and verifies it before a restore goes upstream) and a durable
session's store entries (client/store.py). A tag is over a domain label and the parts that say what
the bytes are for, each part length-prefixed, so that a tag made for one purpose, or over other parts
cut differently, never verifies for another.

A `Keyring` holds one secret or several: the first signs, every one verifies, so a secret is rotated
by adding the new one first everywhere, then dropping the old once nothing signed with it is needed.
`snapshot_signed` / `snapshot_verified` put a tag in a safetensors file's header (`__metadata__`'s
`mac`) over a canonical form of the file that does not depend on how its header is serialized.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Iterable, Sequence

SNAPSHOT_DOMAIN = b"attention-serving snapshot v1"
STORE_DOMAIN = b"attention-serving store entry v1"
DERIVED_DOMAIN = b"attention-serving integrity secret v1"  # the integrity secret made from the session secret
# the key of a store used without a secret (a direct client): entries are bound to their session, owner and
# positions and checked for changes, but anyone can forge one (the label is public)
PUBLIC_SECRET = b"attention-serving public store label"
TAG_KEY = "mac"  # the snapshot header's metadata entry holding the tag
_HEADER_ALIGNMENT = 8  # safetensors pads its header with spaces to a multiple of 8 bytes


class IntegrityError(ValueError):
    """Bytes whose tag is missing or does not verify, or that cannot be read to check one; the message says why."""


class Keyring:
    """Secrets to sign with (the first) and to verify with (any of them)."""

    def __init__(self, secrets: bytes | str | Sequence[bytes | str]) -> None:
        given = [secrets] if isinstance(secrets, bytes | str) else list(secrets)
        self.secrets = [secret.encode() if isinstance(secret, str) else bytes(secret) for secret in given]
        if not self.secrets or not all(self.secrets):
            empty = sum(not secret for secret in self.secrets)
            raise ValueError(f"a keyring needs one or more non-empty secrets, got {len(self.secrets)}, {empty} empty")

    def sign(self, domain: bytes, parts: Iterable[bytes | memoryview]) -> str:
        return _tag(self.secrets[0], domain, list(parts))

    def verifies(self, domain: bytes, parts: Iterable[bytes | memoryview], tag: str | bytes) -> bool:
        """Whether `tag` is the tag of `parts` under any of the secrets (compared in constant time, as bytes:
        a tag read from a file may be any text)."""
        parts, given = list(parts), tag if isinstance(tag, bytes) else tag.encode("utf-8", "replace")
        return any(hmac.compare_digest(_tag(secret, domain, parts).encode(), given) for secret in self.secrets)


def derived_secret(session_secret: str) -> bytes:
    """The integrity secret of gateways given only a session secret: its own, so that neither secret's
    uses tell anything of the other's."""
    return hmac.new(session_secret.encode(), DERIVED_DOMAIN, hashlib.sha256).digest()


def _tag(secret: bytes, domain: bytes, parts: list[bytes | memoryview]) -> str:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (domain, *parts):
        mac.update(struct.pack("<Q", len(part)))
        mac.update(part)
    return mac.hexdigest()


# --- snapshots: a tag in the safetensors header ------------------------------------------------------


def snapshot_signed(blob: bytes, keyring: Keyring) -> bytes:
    """`blob` (a safetensors file) with `mac` in its metadata: the tag of its canonical form. The data
    bytes are unchanged; the header is written anew."""
    header, data = _split(blob)
    metadata = {k: v for k, v in header.get("__metadata__", {}).items() if k != TAG_KEY}
    tag = keyring.sign(SNAPSHOT_DOMAIN, _canonical(header, metadata, data))
    return _joined({**header, "__metadata__": {**metadata, TAG_KEY: tag}}, data)


def snapshot_verified(blob: bytes, keyring: Keyring) -> None:
    """Nothing when `blob` carries a tag that verifies under `keyring`; IntegrityError saying why otherwise."""
    header, data = _split(blob)
    metadata = dict(header.get("__metadata__", {}))
    tag = metadata.pop(TAG_KEY, None)
    if not isinstance(tag, str):
        raise IntegrityError(
            f"the snapshot has no integrity tag ('{TAG_KEY}' in its metadata): only a snapshot this service "
            "handed out (GET /v1/sessions/{id}/snapshot) is restored"
        )
    if not keyring.verifies(SNAPSHOT_DOMAIN, _canonical(header, metadata, data), tag):
        raise IntegrityError(
            "the snapshot's integrity tag does not match: the snapshot was changed (its tensors or metadata, the "
            "owner included) or made under another secret"
        )


def _canonical(header: dict, metadata: dict, data: memoryview) -> list[bytes | memoryview]:
    """The parts a snapshot's tag is over: its metadata (without the tag) and tensor entries as sorted-key
    JSON, then its data bytes."""
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    return [_sorted_json(metadata), _sorted_json(tensors), data]


def _sorted_json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _split(blob: bytes) -> tuple[dict, memoryview]:
    """A safetensors file's header (parsed) and its data bytes (not copied)."""
    view = memoryview(blob)
    if len(view) < 8:
        raise IntegrityError(f"not a session snapshot (a safetensors file): {len(view)} bytes, short of its size field")
    (size,) = struct.unpack("<Q", view[:8])
    if size > len(view) - 8:
        raise IntegrityError(
            f"not a session snapshot (a safetensors file): its header is {size} bytes, the file only {len(view)}"
        )
    try:
        header = json.loads(bytes(view[8 : 8 + size]), object_pairs_hook=_no_repeats)
    except (UnicodeDecodeError, json.JSONDecodeError, IntegrityError) as error:
        raise IntegrityError(f"not a session snapshot (a safetensors file): its header: {error}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
        raise IntegrityError("not a session snapshot (a safetensors file): its header is not a JSON object of tensors")
    return header, view[8 + size :]


def _no_repeats(pairs: list[tuple[str, object]]) -> dict:
    # a key given twice would be read one way here and maybe another by the library that restores the file
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise IntegrityError(f"a key appears twice: {sorted({k for k in keys if keys.count(k) > 1})}")
    return dict(pairs)


def _joined(header: dict, data: memoryview) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _HEADER_ALIGNMENT)
    return b"".join((struct.pack("<Q", len(text)), text, data))  # one copy of the data
