"""API keys: `Authorization: Bearer <key>` or `X-API-Key: <key>`, compared in constant time.

A request's identity is a fingerprint of its key (never the key itself): sessions belong to it and
the per-key session limit counts by it. Without configured keys auth is off and everyone is
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


def fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def key_matches(candidate: str, keys: Sequence[bytes]) -> bool:
    """Compare with every key, always: the time taken says neither which key matched nor how much
    of one did. Bytes, because compare_digest refuses non-ASCII str."""
    presented = candidate.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key)
    return matched


def identify(presented: str | None, keys: Sequence[bytes]) -> str:
    """The fingerprint of a valid presented key; 401 for a missing or wrong one."""
    if not presented:
        raise Unauthorized("an API key is required: send `Authorization: Bearer <key>` or `X-API-Key: <key>`")
    if not key_matches(presented, keys):
        raise Unauthorized("the API key is not valid")
    return fingerprint(presented)
