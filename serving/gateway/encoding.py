"""Tensors in JSON: nested lists by default, base64 tensor objects for large ones.

Anywhere a request takes a tensor as nested lists it also takes

    {"dtype": "float32", "shape": [1, 4, 256], "b64": "<base64 of the raw little-endian C-order bytes>"}

and a response carries tensors in that form when the request says `?encoding=b64`.

Why this and not a whole-body binary format: it keeps one JSON schema for both forms (so the
OpenAPI document, the error messages and every JSON tool stay valid) and still removes what makes
JSON tensors slow. A float32 costs 5.33 base64 characters instead of ~11 decimal ones, and the
server decodes it with one `np.frombuffer` instead of building a Python float per element, which
is what dominates the time of a multi-megabyte KV cache in JSON. The raw bytes are exactly the
float32 values, so the round trip is bit-exact. The remaining base64 overhead (a third) is the price
of staying JSON; a client that needs the last third should use the gRPC client library.

This module turns one field into an array (`decode`: its structure, no judgement of the values) and
an array into a field (`encode`); what the arrays must be is checked once, by
`serving/gateway/validated.py`, with the checks of `contract/inputs.py`.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field

from contract.inputs import InputError

# Little-endian on the wire whatever the host: the format is defined by the bytes, not the machine.
WIRE_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "int64": np.dtype("<i8")}

MAX_DIM = 2**31 - 1
Encoding = Literal["json", "b64"]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
MaskBit = Literal[0, 1]
# what numpy makes of a JSON list's elements, by the kinds a tensor accepts: numbers (floats, and ints
# such as 0 or 1) for states and caches, integers for masks; strings, nulls, objects are refused
NUMBER_KINDS = {"f": "fiu", "i": "iu"}


class EncodedTensor(BaseModel):
    """A tensor as raw bytes: little-endian, C (row-major) order, base64 (RFC 4648, with padding)."""

    model_config = ConfigDict(extra="forbid")
    dtype: Literal["float32", "float16", "int64"] = Field(
        description="the served model's float type (GET /v1/models) for states and caches; int64 for masks"
    )
    shape: list[Annotated[int, Field(ge=0, le=MAX_DIM)]] = Field(
        max_length=8, description="dimensions, outermost first"
    )
    b64: str = Field(description="base64 of prod(shape) * itemsize bytes")


def decode(value: list[Any] | EncodedTensor, name: str, dtype: str) -> np.ndarray:
    """The array a request field holds. Nested lists become `dtype` (the model's; the lists carry
    none); a tensor object keeps the dtype it declares (checked against the model's later).

    Raises InputError naming the field for ragged lists, elements that are not numbers (integers for
    a mask), bad base64 or a byte count that does not match the shape. Booleans are found by the
    caller, which sees the whole body (`validated.first_boolean`).
    """
    if isinstance(value, EncodedTensor):
        return _from_encoded(value, name)
    return _from_lists(value, name, np.dtype(dtype))


def _from_lists(value: list[Any], name: str, dtype: np.dtype) -> np.ndarray:
    try:
        parsed = np.asarray(value)
    except ValueError:
        raise InputError(name, "ragged nested lists; all rows along an axis must have the same length") from None
    if parsed.dtype.kind not in NUMBER_KINDS[dtype.kind]:
        wanted = "integers 0 or 1" if dtype.kind == "i" else "numbers"
        raise InputError(name, f"expected {wanted} in nested lists, got {_kind_name(parsed)}")
    with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes inf: the finite check says so
        return parsed.astype(dtype)


def _kind_name(array: np.ndarray) -> str:
    """What a JSON list held that is not a number, in JSON's words."""
    if array.dtype.kind == "O":
        odd = next(item for item in array.flat if not isinstance(item, int | float))
        return {type(None): "null", dict: "an object", str: "a string"}.get(type(odd), type(odd).__name__)
    return {"U": "strings", "f": "numbers with a fraction or an exponent", "b": "booleans"}.get(
        array.dtype.kind, str(array.dtype)
    )


def _from_encoded(tensor: EncodedTensor, name: str) -> np.ndarray:
    try:
        raw = base64.b64decode(tensor.b64, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{name}.b64", "not valid base64 (RFC 4648 alphabet, with padding)") from None
    wire = WIRE_DTYPES[tensor.dtype]
    expected = math.prod(tensor.shape) * wire.itemsize
    if len(raw) != expected:
        raise InputError(
            name, f"shape {tensor.shape} of {tensor.dtype} needs {expected} bytes, b64 decodes to {len(raw)}"
        )
    try:
        array = np.frombuffer(raw, dtype=wire).reshape(tensor.shape)
    except ValueError:  # an empty tensor whose other axes overflow numpy's sizes
        raise InputError(name, f"shape {tensor.shape} is not a valid array shape") from None
    return array.astype(wire.newbyteorder("="))


def encode(array: np.ndarray, encoding: Encoding) -> np.ndarray | dict:
    """A response tensor for `tensor_json`: nested lists (float64, so the JSON text is each value's
    shortest round-trip form, exactly what Python's json writes), or an `EncodedTensor` dict for
    `encoding == "b64"`."""
    if encoding == "json":
        return np.ascontiguousarray(array, dtype=np.float64 if array.dtype.kind == "f" else array.dtype)
    dtype = np.dtype(array.dtype).name
    wire = WIRE_DTYPES[dtype]
    raw = np.ascontiguousarray(array, dtype=wire).tobytes()
    return {"dtype": dtype, "shape": list(array.shape), "b64": base64.b64encode(raw).decode("ascii")}


def tensor_json(content: Any) -> bytes:
    """`content` as JSON by orjson, numpy arrays (from `encode`) as nested lists: a step's answer in
    tens of microseconds, where `json.dumps` of the same lists took hundreds."""
    return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
