"""Session affinity through the proxy in front of several Triton replicas (serving/host/envoy, and
docs/scale-out.md): what a session step sends, and a step that returns the answer's headers too.

Every step of a session sends SESSION_HEADER (its sequence id); once an answer has named the replica
holding the session (REPLICA_HEADER, in the first step's answer), every later step sends that name
back and the proxy delivers the step to that replica only. Without a proxy nothing changes: Triton
ignores both headers and sends neither back.

tritonclient's `infer` returns the decoded result and drops the answer's headers (gRPC initial
metadata, HTTP response headers), so `infer` below is tritonclient's own request path with the
headers kept: the same request builder and error conversion, on the same connection, one function
per client kind. tritonclient is pinned (pyproject.toml), and tests/scale runs all four through a
real Envoy.

How a session uses it (client/core.py's `_send_step`), where `replica` starts as None per session:

    headers = affinity.step_headers(sequence_id, replica)
    result, answer = yield Call(lambda s: affinity.infer(s, model, inputs, headers=headers, **kw), ...)
    replica = affinity.replica_from(answer) or replica

`affinity.infer` returns (result, headers) from the blocking clients and an awaitable of it from the
asyncio ones, so the same Call works in both fronts.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from client._wire import HttpResult
from client.keepalive import KeepAlivePool
from contract.routing import REPLICA_HEADER, SESSION_HEADER

__all__ = ["REPLICA_HEADER", "SESSION_HEADER", "infer", "replica_from", "step_headers"]


# A pin an answer over HTTP keep-alive named (client/keepalive.py), as the client keeps it: Envoy names a replica by
# the host:port of the listener's cluster, so a pin made over its HTTP listener means nothing to its gRPC one and
# the session's later requests must go the same way. Sent without the mark; a pin without it was made over gRPC
# (or by an HTTP client, whose every request is HTTP).
HTTP_PIN = "http:"


def pinned_over_http(replica: str | None) -> bool:
    """Whether `replica` is a pin made over HTTP keep-alive (HTTP_PIN)."""
    return replica is not None and replica.startswith(HTTP_PIN)


def step_headers(sequence_id: int, replica: str | None = None) -> dict[str, str]:
    """The headers of one step of session `sequence_id`, pinned to `replica` once an answer named it."""
    headers = {SESSION_HEADER: str(sequence_id)}
    if replica:
        headers[REPLICA_HEADER] = replica.removeprefix(HTTP_PIN)
    return headers


def replica_from(headers: Mapping[str, str]) -> str | None:
    """The replica an answer names (None when it names none: a direct Triton, or a later step)."""
    for name, value in headers.items():
        if name.lower() == REPLICA_HEADER:
            return value
    return None


def infer(stub: Any, model_name: str, inputs: list, *, headers: Mapping[str, str], **options: Any) -> Any:
    """`stub.infer(model_name, inputs, headers=headers, **options)` that returns (InferResult,
    {header: value} of the answer); for the asyncio clients, an awaitable of that pair.

    `options`: sequence_id, sequence_start, sequence_end, parameters (the request's), and
    client_timeout (gRPC only, as for tritonclient). Errors are tritonclient's
    InferenceServerException, as from `stub.infer`.
    """
    if isinstance(stub, KeepAlivePool):  # the asyncio client's session requests over HTTP keep-alive
        return _http_keepalive(stub, model_name, inputs, dict(headers), **options)
    module = type(stub).__module__
    protocol = "grpc" if module.startswith("tritonclient.grpc") else "http"
    asynchronous = module.endswith(".aio")
    call = _CALLS[protocol, asynchronous]
    return call(stub, model_name, inputs, dict(headers), **options)


def _sequence(options: dict[str, Any]) -> dict[str, Any]:
    return {
        "sequence_id": options.get("sequence_id", 0),
        "sequence_start": options.get("sequence_start", False),
        "sequence_end": options.get("sequence_end", False),
    }


def _grpc_request(model_name: str, inputs: list, options: dict[str, Any]):
    from tritonclient.grpc._utils import _get_inference_request

    return _get_inference_request(
        model_name=model_name,
        inputs=inputs,
        model_version="",
        request_id="",
        outputs=None,
        priority=0,
        timeout=None,
        parameters=options.get("parameters"),
        **_sequence(options),
    )


def _grpc(stub, model_name: str, inputs: list, headers: dict[str, str], **options: Any):
    """`ModelInfer.with_call` instead of tritonclient's plain call: the call object has the answer's
    initial metadata."""
    import grpc
    from tritonclient.grpc import InferResult
    from tritonclient.grpc._utils import raise_error_grpc

    request = _grpc_request(model_name, inputs, options)
    try:
        response, call = stub._client_stub.ModelInfer.with_call(
            request=request, metadata=stub._get_metadata(headers), timeout=options.get("client_timeout")
        )
    except grpc.RpcError as error:
        raise_error_grpc(error)
    return InferResult(response), dict(call.initial_metadata() or ())


async def _grpc_aio(stub, model_name: str, inputs: list, headers: dict[str, str], **options: Any):
    """grpc.aio's call object is awaited for the answer and asked for its initial metadata."""
    import grpc
    from tritonclient.grpc import InferResult
    from tritonclient.grpc._utils import raise_error_grpc

    request = _grpc_request(model_name, inputs, options)
    try:
        call = stub._client_stub.ModelInfer(
            request=request, metadata=stub._get_metadata(headers), timeout=options.get("client_timeout")
        )
        response = await call
        metadata = await call.initial_metadata()
    except grpc.RpcError as error:
        raise_error_grpc(error)
    return InferResult(response), dict(metadata or ())


def _http_request(model_name: str, inputs: list, headers: dict[str, str], options: dict[str, Any]):
    """(uri, body, headers) as tritonclient's HTTP `infer` builds them (binary tensors, no compression)."""
    from tritonclient.http._utils import _get_inference_request

    body, json_size = _get_inference_request(
        inputs=inputs,
        request_id="",
        outputs=None,
        priority=0,
        timeout=None,
        custom_parameters=options.get("parameters"),
        **_sequence(options),
    )
    if json_size is not None:
        headers = {**headers, "Inference-Header-Content-Length": json_size}
    return _infer_uri(model_name), body, headers


@functools.cache
def _infer_uri(model_name: str) -> str:
    return f"v2/models/{quote(model_name)}/infer"


def _http(stub, model_name: str, inputs: list, headers: dict[str, str], **options: Any):
    from tritonclient.http import InferResult
    from tritonclient.http._utils import _raise_if_error

    uri, body, headers = _http_request(model_name, inputs, headers, options)
    response = stub._post(request_uri=uri, request_body=body, headers=headers, query_params=None)
    _raise_if_error(response)
    answer = {name.lower(): value for name, value in response.items()}
    return InferResult(response, stub._verbose), answer


async def _http_aio(stub, model_name: str, inputs: list, headers: dict[str, str], **options: Any):
    from tritonclient.http.aio import _raise_if_error

    uri, body, headers = _http_request(model_name, inputs, headers, options)
    response = await stub._post(request_uri=uri, request_body=body, headers=headers, query_params=None)
    await _raise_if_error(response)
    answer = {name.lower(): value for name, value in response.headers.items()}
    return _read_answer(await response.read(), answer), answer


async def _http_keepalive(pool: KeepAlivePool, model_name: str, inputs: list, headers: dict[str, str], **options: Any):
    """tritonclient's HTTP request and answer over client/keepalive.py's connections; its error reader names a
    failed answer's status and message as tritonclient.http does."""
    from tritonclient.http._utils import _get_error

    uri, body, headers = _http_request(model_name, inputs, headers, options)
    answer = await pool.post(uri, body, headers, timeout=options.get("client_timeout"))
    error = _get_error(answer)
    if error is not None:
        raise error
    return _read_answer(answer.body, answer.headers), answer.headers


def _read_answer(body: bytes, headers: Mapping[str, str]) -> Any:
    """An HTTP answer's result, from its body and its headers (lower-case names)."""
    length = headers.get("inference-header-content-length")
    return HttpResult.of(body, None if length is None else int(length), headers.get("content-encoding"))


_CALLS = {("grpc", False): _grpc, ("grpc", True): _grpc_aio, ("http", False): _http, ("http", True): _http_aio}
