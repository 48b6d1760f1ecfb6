"""API keys: `Authorization: Bearer <key>` or `X-API-Key: <key>`, compared in constant time.

A request's identity is its key (checked here); sessions record their owner as a keyed hash of it
(`owner_of`: HMAC-SHA256 with the gateway's session secret), which a session id carries, signed but
readable: without the secret nobody can test guessed keys against it. The per-key session limit
counts by that owner. Without configured keys auth is off and everyone is
`anonymous` (the gateway then binds to loopback only; see `Settings.bind_host`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from fastapi.security import APIKeyHeader, HTTPBearer

from serving.gateway.errors import Unauthorized

ANONYMOUS = "anonymous"

# auto_error=False: a missing header must reach our handler, which answers 401 in our error format
bearer_scheme = HTTPBearer(auto_error=False, description="`Authorization: Bearer <key>`")
api_key_scheme = APIKeyHeader(name="X-API-Key", auto_error=False, description="`X-API-Key: <key>`")


def owner_of(key: str, secret: str) -> str:
    """The owner sessions record for `key`: a keyed hash, the same on every gateway sharing `secret`."""
    return hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()[:32]


def key_matches(candidate: str, keys: Sequence[bytes]) -> bool:
    """Compare with every key, always: the time taken says neither which key matched nor how much
    of one did. Bytes, because compare_digest refuses non-ASCII str."""
    presented = candidate.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key)
    return matched


def identify(presented: str | None, keys: Sequence[bytes]) -> str:
    """A valid presented key; 401 for a missing or wrong one."""
    if not presented:
        raise Unauthorized("an API key is required: send `Authorization: Bearer <key>` or `X-API-Key: <key>`")
    if not key_matches(presented, keys):
        raise Unauthorized("the API key is not valid")
    return presented
