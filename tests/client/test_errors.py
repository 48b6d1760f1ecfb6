"""The error mapping: what tritonclient raises (its own exception type with the status strings and
messages our Triton 2.51 was measured to send; our models' carry their kind, serving/engine/errors.py)
becomes our typed exceptions, with the server's message kept (without its kind tag)."""

from __future__ import annotations

import aiohttp
import pytest
from geventhttpclient.response import HTTPConnectionClosed
from tritonclient.utils import InferenceServerException

from client import errors
from client.errors import (
    ClientError,
    InvalidInputError,
    ModelNotFoundError,
    RequestTimeoutError,
    ServerBusyError,
    ServerError,
    ServerUnavailableError,
    SessionLostError,
    UnknownSessionError,
)
from contract import errors as kinds

START_REQUIRED = (
    "inference request for sequence 1077 to model 'sessions' must specify the START flag on the first "
    "request of the sequence"
)
BUDGET_FULL = kinds.tag(
    kinds.CACHE_FULL,
    "sequence 77 cannot start: the KV cache budget is full: all 4 slots of 2048 positions (64.0 MiB) hold live "
    "sequences; retry later or end a sequence",
)
DEAD_STUB = "Stub process 'sessions_0_0' is not healthy."
REFUSED = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: "
    "Connection refused"
)

# (HTTP status, gRPC status, message, sent as a session step, expected type)
CASES = [
    ("400", "INVALID_ARGUMENT",
     "inference input 'hidden_states' data-type is 'FP64', but model 'forward' expects 'FP32'", False,
     InvalidInputError),
    ("400", "INVALID_ARGUMENT", "unexpected shape for input 'hidden_states' for model 'forward'. Expected [-1,-1,256], "
     "got [1,2]. ", False, InvalidInputError),
    ("400", "INVALID_ARGUMENT", kinds.tag(kinds.INVALID_INPUT, "input 'attention_mask': expected length past + new "
     "= 4 + 1 = 5, got 4"), False, InvalidInputError),
    ("400", "INVALID_ARGUMENT", START_REQUIRED, True, UnknownSessionError),  # Triton core's own, untagged
    ("400", "INVALID_ARGUMENT", kinds.tag(kinds.SEQUENCE_UNKNOWN, "sequence 42 is unknown: start it with the START "
     "flag (sequence_start) first"), True, UnknownSessionError),
    ("400", "INVALID_ARGUMENT", kinds.tag(kinds.SEQUENCE_ENDED, "sequence 42 has ended (END flag) and its cache is "
     "freed; start a new sequence"), True, UnknownSessionError),
    ("400", "INVALID_ARGUMENT", kinds.tag(kinds.SEQUENCE_EVICTED, "sequence 42 was evicted after 2 s idle and its "
     "cache is freed; start a new sequence"), True, UnknownSessionError),
    # a step that is too long is the input's fault, not a lost session
    ("400", "INVALID_ARGUMENT", kinds.tag(kinds.SEQUENCE_TOO_LONG, "sequence 42 would hold 4097 positions, more than "
     "max_seq_len 4096"), True, InvalidInputError),
    ("400", "INVALID_ARGUMENT", kinds.tag(kinds.INVALID_INPUT, "input 'hidden_states': a step carries one sequence: "
     "expected batch 1, got [2, 1, 8]"), True, InvalidInputError),
    # the prose without a kind is not read: an untagged 400 is an input's fault
    ("400", "INVALID_ARGUMENT", "sequence 42 was evicted after 2 s idle", True, InvalidInputError),
    ("404", "NOT_FOUND", "sequence 42 not found", True, UnknownSessionError),
    ("404", "NOT_FOUND", "Request for unknown model: 'nope' is not found", False, ModelNotFoundError),
    ("404", "NOT_FOUND", "Request for unknown model: 'nope' is not found", True, ModelNotFoundError),
    ("503", "UNAVAILABLE", BUDGET_FULL, True, ServerBusyError),
    ("500", "INTERNAL", "Failed to process the request(s) for model 'forward_0_0', message: ValueError: boom",
     False, ServerError),
    ("501", "UNIMPLEMENTED", "not supported", False, ServerError),
    ("504", "DEADLINE_EXCEEDED", "Deadline Exceeded", False, RequestTimeoutError),
    # a model's process died (measured: INTERNAL on 2.51): a session's cache died with it; a stateless
    # call can be repeated once the supervisor has reloaded the model
    ("500", "INTERNAL", DEAD_STUB, True, SessionLostError),
    ("500", "INTERNAL", DEAD_STUB, False, ServerUnavailableError),
    ("400", "INVALID_ARGUMENT", kinds.tag(kinds.SEQUENCE_LOST, "sequence 42 is lost"), True, SessionLostError),
]  # fmt: skip


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize(("http_status", "grpc_code", "message", "session", "expected"), CASES)
def test_server_answers_map_to_types_and_keep_the_message(protocol, http_status, grpc_code, message, session, expected):
    status = http_status if protocol == "http" else f"StatusCode.{grpc_code}"
    raised = InferenceServerException(msg=message, status=status)
    error = errors.from_exception(raised, session=session)
    kind, text = kinds.read(message)
    assert type(error) is expected
    assert error.message == text and str(error) == text and "[" not in text[:1]
    # Triton's own untagged answers get the kind they mean: a sequence it does not hold, a dead process's
    untagged = {UnknownSessionError: kinds.SEQUENCE_UNKNOWN, SessionLostError: kinds.SEQUENCE_LOST}.get(expected)
    assert error.status == status and error.kind == (kind or untagged)


@pytest.mark.parametrize(
    "message", [REFUSED, "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:5: Socket closed"]
)
def test_grpc_transport_failures_are_unavailable_not_busy(message):
    raised = InferenceServerException(msg=message, status="StatusCode.UNAVAILABLE")
    assert type(errors.from_exception(raised)) is ServerUnavailableError


def test_an_error_raised_inside_tritonclient_is_a_plain_client_error():
    error = errors.from_exception(InferenceServerException(msg="url should not include the scheme"))
    assert type(error) is ClientError and error.status is None


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (ConnectionRefusedError(111, "Connection refused"), ServerUnavailableError),  # HTTP, server down
        (HTTPConnectionClosed("connection closed."), ServerUnavailableError),  # HTTP, server hung up
        (aiohttp.ServerDisconnectedError(), ServerUnavailableError),  # asyncio HTTP
        (aiohttp.ClientOSError(None, "Can not write request body"), ServerUnavailableError),
        (TimeoutError("timed out"), RequestTimeoutError),  # geventhttpclient's network timeout
        (TimeoutError(), RequestTimeoutError),  # aiohttp's total timeout (asyncio's is the same class)
    ],
)
def test_transport_exceptions_map_to_types(raised, expected):
    error = errors.from_exception(raised)
    assert type(error) is expected
    assert error.message


def test_our_own_bugs_are_not_disguised():
    assert errors.from_exception(KeyError("oops")) is None
    assert errors.from_exception(TypeError("oops")) is None


def test_types_fit_standard_handlers_too():
    """`except ValueError` / `except TimeoutError` in callers' code catch the matching errors."""
    assert issubclass(InvalidInputError, ValueError)
    assert issubclass(RequestTimeoutError, TimeoutError)
    for kind in (InvalidInputError, UnknownSessionError, ServerBusyError, ServerUnavailableError, RequestTimeoutError):
        assert issubclass(kind, ClientError)
    assert set(errors.RETRYABLE) == {ServerUnavailableError, ServerBusyError}
