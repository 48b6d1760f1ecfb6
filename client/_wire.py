"""The wire side of the client core: tensors to send, results to read, per-protocol options.

tritonclient's four clients (grpc, http, and their aio twins) have the same method names; they
differ in where the timeout goes and in how metadata comes back. Nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from client.errors import ClientError, InvalidInputError
from client.metadata import ModelInfo
from client.retry import RetryPolicy
from contract import names
from contract.inputs import named_inputs

PROTOCOLS = ("grpc", "http")
DEFAULT_PORTS = {"http": 8000, "grpc": 8001}
Pairs = list[tuple[np.ndarray, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class InferResult:
    """A stateless call's answer: the output and one (key, value) pair per layer to pass back as `past`."""

    output: np.ndarray  # (batch, new, d_model); a whole model's logits (batch, new, vocab_size)
    present: Pairs  # each (batch, n_kv_heads, past + new, head_dim)
    # per layer the attention weights (batch, n_heads, new, past + new) when the call asked for them, else
    # None; a padded query's row is unspecified (the server's are zeros)
    attention_maps: list[np.ndarray] | None = None

    @property
    def past_length(self) -> int:
        """Positions the presents hold (what the next call's mask must cover before its new tokens)."""
        return self.present[0][0].shape[2] if self.present else 0


@dataclasses.dataclass(frozen=True)
class Health:
    """Liveness and readiness of the server and of each model the client uses."""

    url: str
    live: bool
    ready: bool
    models: dict[str, bool]
    # a probe's findings: model -> why a real request to it failed (Triton's flags stay green while a
    # model's process is dead; only an answer shows that it serves). Empty when not probed.
    failures: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.live and self.ready and all(self.models.values()) and not self.failures

    def problems(self) -> str:
        """What is not ready, in words ("" when everything is)."""
        found = [what for what, fine in (("server not live", self.live), ("server not ready", self.ready)) if not fine]
        found += [f"model '{name}' not ready" for name, ready in self.models.items() if not ready]
        found += [f"model '{name}' does not answer: {why}" for name, why in self.failures.items()]
        return "; ".join(found)


def check_sequence_id(sequence_id: int | None) -> int:
    if sequence_id is None:
        return new_sequence_id()
    if isinstance(sequence_id, bool) or not isinstance(sequence_id, int) or not 0 < sequence_id < 2**63:
        raise ValueError(f"a sequence id is an integer in [1, 2**63), got {sequence_id!r}")
    return sequence_id


def check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    return protocol


def normalize_url(url: str, protocol: str) -> str:
    """`host:port` as tritonclient wants it; a plain scheme is dropped, a missing port is the default one."""
    if url.startswith("https://"):
        raise ValueError(f"TLS is not supported by this client: {url}")
    for scheme in ("http://", "grpc://"):
        url = url.removeprefix(scheme)
    url = url.rstrip("/")
    return url if ":" in url else f"{url}:{DEFAULT_PORTS[protocol]}"


def new_sequence_id() -> int:
    """A random non-zero sequence id below 2**63: tritonclient's gRPC request carries it as an int64."""
    return secrets.randbelow(2**63 - 1) + 1


def grpc_channel_args(policy: RetryPolicy) -> list[tuple[str, Any]]:
    """tritonclient's defaults (no message size limit: a KV cache is megabytes) plus a reconnect
    backoff no slower than ours; gRPC's own 1 s would make our first retries fail without trying."""
    unlimited = 2**31 - 1
    reconnect_ms = max(10, int(policy.backoff * 500))
    return [
        ("grpc.max_send_message_length", unlimited),
        ("grpc.max_receive_message_length", unlimited),
        ("grpc.initial_reconnect_backoff_ms", reconnect_ms),
        ("grpc.min_reconnect_backoff_ms", reconnect_ms),
        ("grpc.max_reconnect_backoff_ms", max(reconnect_ms, int(policy.max_backoff * 1000))),
    ]


def as_array(value: Any, name: str) -> np.ndarray:
    if value is None or isinstance(value, np.ndarray):
        return value
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as error:
        raise InvalidInputError(f"input '{name}': not an array: {error}", input_name=name) from None


def stateless_tensors(
    info: ModelInfo | None,
    hidden_states: Any,
    attention_mask: Any = None,
    past: Sequence | None = None,
    position_ids: Any = None,
) -> dict[str, np.ndarray]:
    """Named inputs of a stateless call, checked against `info` when given; an omitted past, mask or
    positions are left out (the model's inputs are optional: an empty past, all ones, counted)."""
    positions = as_array(position_ids, names.POSITION_IDS)
    first = tokens_name(info, hidden_states)
    tensors = named_inputs(as_array(hidden_states, first), _mask(attention_mask), _pairs(past), positions, first)
    if info is not None:
        info.check(tensors)
    return tensors


def step_tensors(info: ModelInfo | None, hidden_states: Any, attention_mask: Any = None) -> dict:
    """Named inputs of one session step (one sequence's new tokens and, optionally, their mask),
    checked against `info` when given."""
    first = tokens_name(info, hidden_states)
    tensors = named_inputs(as_array(hidden_states, first), _mask(attention_mask), first=first)
    if info is not None:
        info.check(tensors, session=True)
    return tensors


def tokens_name(info: ModelInfo | None, tokens: Any) -> str:
    """The input the new tokens go in: the model's (`input_ids` of a whole model, `hidden_states`
    otherwise); without its metadata, what the tokens are (integers: ids)."""
    if info is not None:
        return info.new_tokens
    try:
        kind = np.asarray(tokens).dtype.kind
    except (TypeError, ValueError):  # not an array: as_array names the input at fault
        return names.HIDDEN_STATES
    return names.INPUT_IDS if kind in "iu" else names.HIDDEN_STATES


def no_tokens_like(sent: np.ndarray) -> dict[str, np.ndarray]:
    """The new tokens, none of them, of the kind `sent` is (ids (1, 0), or hidden states (1, 0, d)): what
    ends a session."""
    empty = np.zeros((1, 0, *sent.shape[2:]), sent.dtype)
    return {tokens_name(None, empty): empty}


def _pairs(past: Sequence | None) -> Pairs:
    pairs = list(past or ())
    # an array would unpack along its batch axis: ask for pairs explicitly
    if not all(isinstance(pair, tuple | list) and len(pair) == 2 for pair in pairs):
        raise InvalidInputError("past: expected a list of (key, value) pairs, one per layer", input_name="past")
    return [(as_array(key, "past key"), as_array(value, "past value")) for key, value in pairs]


def _mask(attention_mask: Any) -> np.ndarray | None:
    return as_array(attention_mask, names.ATTENTION_MASK)


def make_inputs(module, tensors: Mapping[str, np.ndarray]) -> list:
    """Inputs for tritonclient's request builders from named arrays, each described and encoded once: `GrpcInput`
    on gRPC, `HttpInput` (binary) on HTTP."""
    kind = GrpcInput if module.__name__.startswith("tritonclient.grpc") else HttpInput
    return [kind.of(name, array) for name, array in tensors.items()]


# Triton's datatypes by numpy dtype, and back: a dict lookup, where tritonclient's converters compare a dtype
# with each numpy type in turn (about 70 us of a session step's client time went to building its input)
TRITON_DTYPES = {
    np.dtype(dtype): name
    for dtype, name in (
        (np.bool_, "BOOL"),
        (np.int8, "INT8"),
        (np.int16, "INT16"),
        (np.int32, "INT32"),
        (np.int64, "INT64"),
        (np.uint8, "UINT8"),
        (np.uint16, "UINT16"),
        (np.uint32, "UINT32"),
        (np.uint64, "UINT64"),
        (np.float16, "FP16"),
        (np.float32, "FP32"),
        (np.float64, "FP64"),
        (np.object_, "BYTES"),
    )
}
NUMPY_DTYPES = {name: dtype for dtype, name in TRITON_DTYPES.items() if name != "BYTES"}


def _encoded(name: str, array: np.ndarray) -> tuple[str, bytes]:
    """An input's Triton datatype and its bytes as tritonclient's InferInputs send them (binary)."""
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    datatype = TRITON_DTYPES.get(array.dtype) or np_to_triton_dtype(array.dtype)  # bytes_, bfloat16: rare
    if datatype is None:
        raise InvalidInputError(f"input '{name}': dtype {array.dtype} cannot be sent", input_name=name)
    if datatype != "BYTES":
        return datatype, np.ascontiguousarray(array).tobytes()
    serialized = serialize_byte_tensor(array)
    return datatype, serialized.item() if serialized.size > 0 else b""


@dataclasses.dataclass(frozen=True)
class GrpcInput:
    """One gRPC input as tritonclient's request builder reads an InferInput (`_get_tensor`, `_get_content`):
    its description and its bytes, made once from the array."""

    tensor: Any  # service_pb2.ModelInferRequest.InferInputTensor
    content: bytes

    @classmethod
    def of(cls, name: str, array: np.ndarray) -> GrpcInput:
        datatype, content = _encoded(name, array)
        return cls(_input_tensor_type()(name=name, datatype=datatype, shape=array.shape), content)

    def _get_tensor(self) -> Any:
        return self.tensor

    def _get_content(self) -> bytes:
        return self.content


@dataclasses.dataclass(frozen=True)
class HttpInput:
    """One HTTP input as tritonclient's request builder reads an InferInput (`_get_tensor`, `_get_binary_data`): its
    description and its bytes, sent binary after the request's JSON, made once (tritonclient's InferInput checks the
    array against the dtype it was told, comparing the dtype with each numpy type in turn)."""

    tensor: dict
    content: bytes

    @classmethod
    def of(cls, name: str, array: np.ndarray) -> HttpInput:
        datatype, content = _encoded(name, array)
        parameters = {"binary_data_size": len(content)}
        return cls({"name": name, "shape": list(array.shape), "datatype": datatype, "parameters": parameters}, content)

    def _get_tensor(self) -> dict:
        return self.tensor

    def _get_binary_data(self) -> bytes:
        return self.content


@functools.cache
def _input_tensor_type() -> type:
    """tritonclient's gRPC input message, imported on first use: an HTTP-only caller never loads grpc."""
    from tritonclient.grpc import service_pb2

    return service_pb2.ModelInferRequest.InferInputTensor


class DecodedResult:
    """A gRPC answer's outputs as arrays, read in one pass over the answer, with tritonclient InferResult's
    `as_numpy(name)` (which walks every output for each name asked) and `get_response()`."""

    def __init__(self, result: Any) -> None:
        self._result = result
        response = result.get_response()
        raw = response.raw_output_contents
        self._arrays = {
            output.name: _decoded(output, raw[index] if index < len(raw) else None, result)
            for index, output in enumerate(response.outputs)
        }

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self._arrays.get(name)

    def get_response(self, *args: Any, **kwargs: Any) -> Any:
        return self._result.get_response(*args, **kwargs)

    def get_output(self, *args: Any, **kwargs: Any) -> Any:
        return self._result.get_output(*args, **kwargs)


def _decoded(output: Any, raw: bytes | None, result: Any) -> np.ndarray:
    dtype = NUMPY_DTYPES.get(output.datatype)
    if raw is None or dtype is None:  # contents in the message's fields, or BYTES: tritonclient's own reading
        return result.as_numpy(output.name)
    return np.frombuffer(raw, dtype=dtype).reshape(tuple(output.shape))


def decoded(result: Any) -> Any:
    """The answer with its outputs read once (`DecodedResult`) where it is a gRPC one; an HTTP one as it is."""
    return DecodedResult(result) if type(result).__module__.startswith("tritonclient.grpc") else result


def read_stateless(result, maps: bool = False) -> InferResult:
    """The output and every layer's present in the answer (counted from the answer itself, so
    that no metadata is needed to read it), and with `maps` every layer's attention weights."""
    output = _answer(result)
    present = []
    while (key := result.as_numpy(names.present_name(len(present), names.KEY))) is not None:
        present.append((key, _output(result, names.present_name(len(present), names.VALUE))))
    return InferResult(output, present, read_attention_maps(result, len(present)) if maps else None)


def read_attention_maps(result, n_layers: int | None = None) -> list[np.ndarray]:
    """Each layer's attention weights `attention.{i}` in an answer that was asked for them (`n_layers`
    of them; None: as many as it carries, at least one)."""
    if n_layers is None:
        n_layers = 0
        while result.as_numpy(names.attention_map_name(n_layers)) is not None:
            n_layers += 1
    return [_output(result, name) for name in names.attention_map_names(max(n_layers, 1))]


def read_step(result) -> np.ndarray:
    return _answer(result)


def _answer(result) -> np.ndarray:
    """The answer to the new tokens, by its name in the answer: a whole model's `logits`, else `output`."""
    logits = result.as_numpy(names.LOGITS)
    return logits if logits is not None else _output(result, names.OUTPUT)


def read_held_length(result) -> int | None:
    """Positions the server holds for the session after the step; None from a server that does not
    say (a repository written before it did)."""
    held = result.as_numpy(names.HELD_LENGTH)
    return None if held is None else int(held.reshape(-1)[0])


def read_snapshot(result) -> bytes | None:
    """A snapshot's blob; None in the answer of anything else."""
    blob = result.as_numpy(names.SNAPSHOT)
    return None if blob is None else bytes(blob.reshape(-1)[0])


def _output(result, name: str) -> np.ndarray:
    array = result.as_numpy(name)
    if array is None:
        raise ClientError(f"the server's answer has no output '{name}'")
    return array


def sequence_kwargs(sequence_id: int, start: bool, end: bool) -> dict[str, Any]:
    return {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}


def timeout_kwargs(protocol: str, timeout: float | None) -> dict[str, Any]:
    """gRPC takes a deadline per call; the HTTP clients take their timeouts when built."""
    return {"client_timeout": timeout} if protocol == "grpc" else {}


def metadata_kwargs(protocol: str) -> dict[str, Any]:
    return {"as_json": True} if protocol == "grpc" else {}
