"""The kinds of error the served models answer with, carried in the error's message as a tag
(`[sequence_ended] sequence 7 has ended ...`) so that a client reads the kind, not the prose.

Triton passes a Python model's error to the caller as a status code and a message, nothing else;
the tag is the one structured field that survives both protocols. serving/engine/errors.py writes it,
client/errors.py reads it.
"""

from __future__ import annotations

import re

INVALID_INPUT = "invalid_input"  # an input's name, dtype, shape or value (the message names it)
SEQUENCE_UNKNOWN = "sequence_unknown"  # never started
SEQUENCE_ENDED = "sequence_ended"  # ended by its END flag
SEQUENCE_EVICTED = "sequence_evicted"  # idle past the timeout, its cache freed
SEQUENCE_LOST = "sequence_lost"  # its cache died with the process that held it
SEQUENCE_TOO_LONG = "sequence_too_long"  # the step would pass max_seq_len
CACHE_FULL = "cache_full"  # no room for another sequence now: retry later
PREFIX_UNKNOWN = "prefix_unknown"  # a session started from a prefix this server does not hold
KINDS = frozenset(
    {
        INVALID_INPUT,
        SEQUENCE_UNKNOWN,
        SEQUENCE_ENDED,
        SEQUENCE_EVICTED,
        SEQUENCE_LOST,
        SEQUENCE_TOO_LONG,
        CACHE_FULL,
        PREFIX_UNKNOWN,
    }
)
GONE_SEQUENCE = frozenset({SEQUENCE_UNKNOWN, SEQUENCE_ENDED, SEQUENCE_EVICTED, SEQUENCE_LOST})
# the gRPC status each kind's error has where it travels as a unary answer (Triton maps the model's
# TritonError code to it); a stream's answer carries the message only, and the client gives it this status
GRPC_STATUS = {
    INVALID_INPUT: "INVALID_ARGUMENT",
    SEQUENCE_UNKNOWN: "INVALID_ARGUMENT",
    SEQUENCE_ENDED: "INVALID_ARGUMENT",
    SEQUENCE_EVICTED: "INVALID_ARGUMENT",
    SEQUENCE_TOO_LONG: "INVALID_ARGUMENT",
    PREFIX_UNKNOWN: "INVALID_ARGUMENT",
    CACHE_FULL: "UNAVAILABLE",
    SEQUENCE_LOST: "UNAVAILABLE",
}

_TAG = re.compile(r"\[(\w+)\] ")


def tag(kind: str, message: str) -> str:
    assert kind in KINDS, kind
    return f"[{kind}] {message}"


def read(message: str) -> tuple[str | None, str]:
    """(kind, message without its tag); the kind is None when the message has no known tag (an
    error of Triton's own, or of an older server). The tag may follow a prefix Triton adds."""
    found = _TAG.search(message)
    if found is None or found.group(1) not in KINDS:
        return None, message
    return found.group(1), message[: found.start()] + message[found.end() :]
