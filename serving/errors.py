"""What the served models answer when a request cannot be served, as Triton error codes.

Each error is raised at an edge (input checks, the KV cache store) and turned into one
`pb_utils.TritonError` for the one request it concerns; the model never raises out of execute().
Codes as Triton maps them (measured, /tmp/team/TRITON_FACTS.md): INVALID_ARG -> HTTP 400 / gRPC
INVALID_ARGUMENT, UNAVAILABLE -> 503 / UNAVAILABLE, INTERNAL -> 500 / INTERNAL.
"""

from __future__ import annotations

from contract.inputs import InputError

INVALID_ARG = "INVALID_ARG"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"


class ServingError(Exception):
    """Base class: `code` is the name of a `pb_utils.TritonError` code."""

    code = INTERNAL


class InvalidRequest(ServingError):
    """The request itself is wrong (an input's dtype, shape or length, a missing input)."""

    code = INVALID_ARG


class SequenceError(InvalidRequest):
    """A step names a sequence the cache store cannot continue; carries the sequence id."""

    def __init__(self, sequence_id: int | str, message: str) -> None:
        super().__init__(f"sequence {sequence_id!r} {message}")
        self.sequence_id = sequence_id


class UnknownSequence(SequenceError):
    def __init__(self, sequence_id: int | str) -> None:
        super().__init__(sequence_id, "is unknown: start it with the START flag (sequence_start) first")


class SequenceEnded(SequenceError):
    def __init__(self, sequence_id: int | str) -> None:
        super().__init__(sequence_id, "has ended (END flag) and its cache is freed; start a new sequence")


class SequenceEvicted(SequenceError):
    def __init__(self, sequence_id: int | str, idle_seconds: float) -> None:
        super().__init__(
            sequence_id,
            f"was evicted after {idle_seconds:g} s idle and its cache is freed; start a new sequence",
        )


class SequenceTooLong(SequenceError):
    def __init__(self, sequence_id: int | str, length: int, limit: int) -> None:
        super().__init__(sequence_id, f"would hold {length} positions, more than max_seq_len {limit}")


class CacheFull(ServingError):
    """The KV cache budget cannot take a new sequence now: retry later (UNAVAILABLE)."""

    code = UNAVAILABLE

    def __init__(self, sequence_id: int | str, message: str) -> None:
        super().__init__(f"sequence {sequence_id!r} cannot start: {message}")
        self.sequence_id = sequence_id


def triton_error(error: Exception, pb_utils):
    """The `pb_utils.TritonError` for `error`: its own code for ours, INTERNAL for anything else."""
    if isinstance(error, ServingError):
        return pb_utils.TritonError(str(error), getattr(pb_utils.TritonError, error.code))
    if isinstance(error, InputError):  # names the input, the expected and the actual value
        return pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG)
    return pb_utils.TritonError(f"internal error: {type(error).__name__}: {error}", pb_utils.TritonError.INTERNAL)
