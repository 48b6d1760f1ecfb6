"""Session affinity through the proxy in front of several Triton replicas (serving/host/envoy, and
docs/scale-out.md), and the one way a session's request travels: what a session request sends, and the
request itself with the answer's headers.

Every request of a session sends SESSION_HEADER (its sequence id); once an answer has named the replica
holding the session (REPLICA_HEADER, in the first answer's headers), every later request sends that name
back and the proxy delivers it to that replica only. Without a proxy nothing changes: Triton ignores both
headers and sends neither back.

The session model is decoupled (its engine core answers from its own thread, a generation a token at a
time), and Triton takes a decoupled model's requests only on gRPC's ModelStreamInfer: a unary call, gRPC's or
HTTP's, is refused ("doesn't support models with decoupled transaction policy", Triton 2.51). So `infer`
below sends each session request as a stream of one request and reads its one final response: per call, as a
unary call is, so the proxy routes each by its own headers, and the stream's initial metadata names the
replica. tritonclient builds the request and reads the answer (its request builder, its InferResult, its
error conversion); tritonclient is pinned (pyproject.toml), and tests/scale runs both fronts through a real
Envoy.

How a session uses it (client/core.py's `_send_step`), where `replica` starts as None per session:

    headers = affinity.step_headers(sequence_id, replica)
    result, answer = yield Call(lambda s: affinity.infer(s, model, inputs, headers=headers, **kw), ...)
    replica = affinity.replica_from(answer) or replica

`affinity.infer` returns (result, headers) from the blocking client and an awaitable of it from the asyncio
one, so the same Call works in both fronts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from client.errors import ClientError
from contract import errors as kinds
from contract.routing import REPLICA_HEADER, SESSION_HEADER

__all__ = ["REPLICA_HEADER", "SESSION_HEADER", "infer", "replica_from", "result", "send", "step_headers", "stream"]

# Triton's own checks of a request (its inputs, its sequence), as a stream answers them (a message only, no
# status code): they are the caller's mistakes, as INVALID_ARGUMENT says of a unary call's
_TRITON_INPUT_CHECKS = (
    "must specify the START flag",
    "must specify batch-size 1",
    "unexpected shape for input",
    "unexpected datatype",
    "data-type is",
    "unexpected inference input",
    "unexpected inference output",
    "expected number of inputs",
    "inputs but got",
    "unable to find input",
)


def step_headers(sequence_id: int, replica: str | None = None) -> dict[str, str]:
    """The headers of one request of session `sequence_id`, pinned to `replica` once an answer named it."""
    headers = {SESSION_HEADER: str(sequence_id)}
    if replica:
        headers[REPLICA_HEADER] = replica
    return headers


def replica_from(headers: Mapping[str, str]) -> str | None:
    """The replica an answer names (None when it names none: a direct Triton)."""
    for name, value in headers.items():
        if name.lower() == REPLICA_HEADER:
            return value
    return None


def infer(stub: Any, model_name: str, inputs: list, *, headers: Mapping[str, str], **options: Any) -> Any:
    """One request of a session to `model_name` on tritonclient gRPC client `stub`, as a stream of one request:
    (InferResult, {header: value} of the answer); for the asyncio client, an awaitable of that pair.

    `options`: sequence_id, sequence_start, sequence_end, parameters (the request's), client_timeout (the
    stream's deadline). Errors are tritonclient's InferenceServerException, as from `stub.infer`: a stream
    carries an error's message only, so its status is the one a unary answer would have had (`_status`).
    """
    _check_grpc(stub, model_name)
    call = _stream_aio if type(stub).__module__.endswith(".aio") else _stream
    return call(stub, model_name, inputs, dict(headers), **options)


def stream(stub: Any, model_name: str, inputs: list, *, headers: Mapping[str, str], **options: Any) -> Any:
    """A request of many answers (a generation) as a stream of one request, on the client's own channel: the gRPC
    call, whose responses (ModelStreamInferResponse) the blocking client iterates and the asyncio one `read()`s;
    `result(response)` reads each. `cancel()` it to leave early (the server drops the request within a step).
    `options` as `infer`'s."""
    _check_grpc(stub, model_name)
    request = _grpc_request(model_name, inputs, options)
    metadata = stub._get_metadata(dict(headers))
    return _one_request_stream(stub)(request, metadata=metadata, timeout=options.get("client_timeout"))


def result(response: Any) -> Any:
    """One response of a `stream`: tritonclient's InferResult, or its error raised as `infer` raises one."""
    return _answer(response)


def send(stub: Any, model_name: str, inputs: list, *, headers: Mapping[str, str], **options: Any) -> Any:
    """A request answered with nothing but its end (a generation's stop): its stream read to the end, the first
    error raised as `infer` raises one; for the asyncio client, an awaitable of that."""
    call = stream(stub, model_name, inputs, headers=headers, **options)
    return _drained_aio(call) if type(stub).__module__.endswith(".aio") else _drained(call)


def _drained(call) -> None:
    import grpc
    from tritonclient.grpc._utils import raise_error_grpc

    try:
        for response in call:
            if response.error_message:
                _answer(response)
    except grpc.RpcError as error:
        raise_error_grpc(error)


async def _drained_aio(call) -> None:
    import grpc
    from tritonclient.grpc._utils import raise_error_grpc

    try:
        while (response := await call.read()) is not grpc.aio.EOF:
            if response.error_message:
                _answer(response)
    except grpc.RpcError as error:
        raise_error_grpc(error)


def _check_grpc(stub: Any, model_name: str) -> None:
    if not type(stub).__module__.startswith("tritonclient.grpc"):
        raise ClientError(
            f"'{model_name}' takes session requests on gRPC streams only (a decoupled model: Triton refuses a unary "
            "call to it): open the client with protocol='grpc'"
        )


def _grpc_request(model_name: str, inputs: list, options: dict[str, Any]):
    from tritonclient.grpc._utils import _get_inference_request

    return _get_inference_request(
        model_name=model_name,
        inputs=inputs,
        model_version="",
        request_id="",
        outputs=None,
        sequence_id=options.get("sequence_id", 0),
        sequence_start=options.get("sequence_start", False),
        sequence_end=options.get("sequence_end", False),
        priority=0,
        timeout=None,
        parameters=options.get("parameters"),
    )


def _answer(response) -> Any:
    """A stream's response as tritonclient's InferResult, or its error raised as tritonclient raises one."""
    from tritonclient.grpc import InferResult
    from tritonclient.utils import InferenceServerException

    if response is None:
        raise InferenceServerException(
            msg="the server closed the stream without an answer", status="StatusCode.UNKNOWN"
        )
    if response.error_message:
        raise InferenceServerException(
            msg=response.error_message, status=f"StatusCode.{_status(response.error_message)}"
        )
    return InferResult(response.infer_response)


# Triton's streaming method, called with one request (unary-stream: the request goes with the call and the
# stream half-closes behind it). On the wire this is the bidirectional ModelStreamInfer a stream of one request
# is; grpcio's blocking bidirectional call starts a thread for its request iterator and one to spin the channel
# (2 to 3 ms each under load, measured), its unary-stream call neither
_STREAM_PATH = "/inference.GRPCInferenceService/ModelStreamInfer"


def _one_request_stream(stub) -> Any:
    """The channel's unary-stream callable of ModelStreamInfer, made once per client."""
    method = getattr(stub, "_one_request_stream", None)
    if method is None:
        from tritonclient.grpc import service_pb2

        method = stub._one_request_stream = stub._channel.unary_stream(
            _STREAM_PATH,
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
    return method


# Triton's answer to a new request once it is shutting down (a unary call's status: UNAVAILABLE), as a stream
# carries it (seen, Triton 2.51, a START after SIGTERM: "Server is stopping, scheduler for model has stopped
# accepting new inference requests")
_TRITON_STOPPING = "stopped accepting new inference requests"


def _status(message: str) -> str:
    """The gRPC status a stream's error would have had as a unary answer: by its kind (contract/errors.py),
    INVALID_ARGUMENT for Triton's own input checks, UNAVAILABLE for a server shutting down; UNKNOWN otherwise."""
    kind, _ = kinds.read(message)
    if kind is not None:
        return kinds.GRPC_STATUS.get(kind, "UNKNOWN")
    if _TRITON_STOPPING in message:
        return "UNAVAILABLE"
    return "INVALID_ARGUMENT" if any(check in message for check in _TRITON_INPUT_CHECKS) else "UNKNOWN"


def _stream(stub, model_name: str, inputs: list, headers: dict[str, str], **options: Any):
    """The blocking client's call: the stream's first response, then its end read (the server ends it once
    the final response is out)."""
    import grpc
    from tritonclient.grpc._utils import raise_error_grpc

    request = _grpc_request(model_name, inputs, options)
    try:
        call = _one_request_stream(stub)(
            request, metadata=stub._get_metadata(headers), timeout=options.get("client_timeout")
        )
        response = next(call, None)
        answer = dict(call.initial_metadata() or ())
        for _ in call:  # the end of the stream: nothing more comes for one request
            pass
    except grpc.RpcError as error:
        raise_error_grpc(error)
    return _answer(response), answer


async def _stream_aio(stub, model_name: str, inputs: list, headers: dict[str, str], **options: Any):
    """The asyncio client's call, as `_stream`."""
    import grpc
    from tritonclient.grpc._utils import raise_error_grpc

    request = _grpc_request(model_name, inputs, options)
    try:
        call = _one_request_stream(stub)(
            request, metadata=stub._get_metadata(headers), timeout=options.get("client_timeout")
        )
        response = await call.read()
        metadata = await call.initial_metadata()
        if response is not grpc.aio.EOF:
            while await call.read() is not grpc.aio.EOF:  # the end of the stream
                pass
    except grpc.RpcError as error:
        raise_error_grpc(error)
    return _answer(None if response is grpc.aio.EOF else response), dict(metadata or ())
