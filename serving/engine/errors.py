"""The engine's errors: what a request that cannot be served gets, as a Triton error code and the
contract's error kind (contract/errors.py), which the client library reads.

Each error is raised at an edge (input checks, the KV cache) and the Triton models turn it into one
`pb_utils.TritonError` for the one request it concerns (serving/triton/models/common.py); a model
never raises out of execute(). Codes as Triton maps them (measured on 2.51): INVALID_ARG -> HTTP 400 /
gRPC INVALID_ARGUMENT, UNAVAILABLE -> 503 / UNAVAILABLE, INTERNAL -> 500 / INTERNAL.
"""

from __future__ import annotations

from contract import errors as kinds

INVALID_ARG = "INVALID_ARG"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"


class EngineError(RuntimeError):
    """The model's files or settings cannot make what they ask for (a load-time error)."""


class ServingError(Exception):
    """Base class: `code` is the name of a `pb_utils.TritonError` code, `kind` the contract's kind."""

    code = INTERNAL
    kind: str | None = None


class InvalidRequest(ServingError):
    """The request itself is wrong (an input's dtype, shape or length, a missing input)."""

    code = INVALID_ARG
    kind = kinds.INVALID_INPUT


class SequenceError(InvalidRequest):
    """A step names a sequence the server cannot continue; carries the sequence id."""

    def __init__(self, sequence_id: int | str, message: str) -> None:
        super().__init__(f"sequence {sequence_id!r} {message}")
        self.sequence_id = sequence_id


class UnknownSequence(SequenceError):
    kind = kinds.SEQUENCE_UNKNOWN

    def __init__(self, sequence_id: int | str) -> None:
        super().__init__(sequence_id, "is unknown: start it with the START flag (sequence_start) first")


class SequenceEnded(SequenceError):
    kind = kinds.SEQUENCE_ENDED

    def __init__(self, sequence_id: int | str) -> None:
        super().__init__(sequence_id, "has ended (END flag) and its cache is freed; start a new sequence")


class SequenceEvicted(SequenceError):
    kind = kinds.SEQUENCE_EVICTED

    def __init__(self, sequence_id: int | str, idle_seconds: float) -> None:
        super().__init__(
            sequence_id,
            f"was evicted after {idle_seconds:g} s idle and its cache is freed; start a new sequence",
        )


class SequenceTooLong(SequenceError):
    kind = kinds.SEQUENCE_TOO_LONG

    def __init__(self, sequence_id: int | str, length: int, limit: int) -> None:
        super().__init__(sequence_id, f"would hold {length} positions, more than max_seq_len {limit}")


class UnknownPrefix(InvalidRequest):
    """A session started from a prefix this server does not hold (never put here, or deleted)."""

    kind = kinds.PREFIX_UNKNOWN

    def __init__(self, name: str) -> None:
        super().__init__(f"prefix {name!r} is unknown here: put it first")
        self.name = name


class CacheFull(ServingError):
    """The KV cache budget cannot take a new sequence now: retry later (UNAVAILABLE)."""

    code = UNAVAILABLE
    kind = kinds.CACHE_FULL

    def __init__(self, sequence_id: int | str, message: str, growing: bool = False) -> None:
        """`growing`: a live sequence's step needed more room (it goes on as it was), not a START."""
        super().__init__(f"sequence {sequence_id!r} cannot {'grow' if growing else 'start'}: {message}")
        self.sequence_id = sequence_id


def gone_error(gone, sequence_id: int | str) -> SequenceError:
    """The error for a step of a sequence the server does not hold: why it is gone, from the
    tombstones (`gone`, holding error makers), else unknown."""
    make = gone.get(sequence_id)
    return make() if make is not None else UnknownSequence(sequence_id)
