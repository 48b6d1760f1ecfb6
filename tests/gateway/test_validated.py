"""The gateway's edge without a server: a body in, one validated request out (or the error a caller
gets), for a model described by metadata in the form Triton gives it; and the largest body a valid
request can need. (The same over real HTTP in front of the real Triton: test_api.py.)"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from client.metadata import parse_metadata
from contract import names
from serving.gateway import schemas
from serving.gateway.errors import ApiError, InvalidInput, SchemaViolation
from serving.gateway.validated import attend as valid_attend
from serving.gateway.validated import body_bound, parse
from serving.gateway.validated import step as valid_step

D_MODEL, N_LAYERS, N_KV_HEADS, HEAD_DIM = 8, 2, 2, 4


def tensor(name: str, datatype: str, shape: list[int]) -> dict:
    return {"name": name, "datatype": datatype, "shape": [str(d) for d in shape]}  # gRPC's JSON: dims as text


STATELESS = parse_metadata(
    {
        "name": "forward",
        "inputs": [
            tensor(names.HIDDEN_STATES, "FP32", [-1, -1, D_MODEL]),
            tensor(names.ATTENTION_MASK, "INT64", [-1, -1]),
            *(tensor(n, "FP32", [-1, N_KV_HEADS, -1, HEAD_DIM]) for n in names.past_names(N_LAYERS)),
        ],
        "outputs": [tensor(names.OUTPUT, "FP32", [-1, -1, D_MODEL])],
    }
)
SESSION = parse_metadata(
    {
        "name": "sessions",
        "inputs": [
            tensor(names.HIDDEN_STATES, "FP32", [-1, -1, D_MODEL]),
            tensor(names.ATTENTION_MASK, "INT64", [-1, -1]),
        ],
    }
)
RNG = np.random.default_rng(0)


def b64(array: np.ndarray) -> dict:
    return {"dtype": str(array.dtype), "shape": list(array.shape), "b64": base64.b64encode(array.tobytes()).decode()}


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def attend(raw: bytes, max_request_tokens: int = 64):
    return valid_attend(parse(raw, schemas.AttendRequest), STATELESS, max_request_tokens)


def step(raw: bytes):
    return valid_step(parse(raw, schemas.StepBody), SESSION)


def error_of(read, raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as caught:
        read(raw)
    return caught.value


def test_json_lists_and_b64_objects_give_the_same_arrays():
    hidden = RNG.standard_normal((2, 3, D_MODEL)).astype(np.float32)
    mask = np.ones((2, 5), np.int64)
    past = [RNG.standard_normal((2, N_KV_HEADS, 2, HEAD_DIM)).astype(np.float32) for _ in range(2 * N_LAYERS)]
    pairs = [past[i : i + 2] for i in range(0, len(past), 2)]
    as_lists = attend(
        body(
            hidden_states=hidden.tolist(),
            attention_mask=mask.tolist(),
            past_key_values=[{"key": k.tolist(), "value": v.tolist()} for k, v in pairs],
        )
    )
    as_b64 = attend(
        body(
            hidden_states=b64(hidden),
            attention_mask=b64(mask),
            past_key_values=[{"key": b64(k), "value": b64(v)} for k, v in pairs],
        )
    )
    for valid in (as_lists, as_b64):
        np.testing.assert_array_equal(valid.hidden_states, hidden)  # bit-exact: float32 through JSON text and back
        assert valid.hidden_states.dtype == np.float32 and valid.attention_mask.dtype == np.int64
        np.testing.assert_array_equal(valid.attention_mask, mask)
        for (key, value), (k, v) in zip(valid.past, pairs, strict=True):
            np.testing.assert_array_equal(key, k)
            np.testing.assert_array_equal(value, v)


def test_a_step_is_one_sequence_and_leaves_out_the_mask_when_not_given():
    hidden = RNG.standard_normal((1, 4, D_MODEL)).astype(np.float32)
    valid = step(body(hidden_states=hidden.tolist()))
    np.testing.assert_array_equal(valid.hidden_states, hidden)
    assert valid.attention_mask is None
    error = error_of(step, body(hidden_states=np.zeros((2, 1, D_MODEL)).tolist()))
    assert isinstance(error, InvalidInput) and "batch_size must be 1, got 2" in error.message


@pytest.mark.parametrize(
    ("fields", "fragments"),
    [
        ({"hidden_states": [[[0.5] * 3]]}, ["input 'hidden_states'", f"axis 2 = {D_MODEL}", "got [1, 1, 3]"]),
        (
            {"hidden_states": [[[1e39] * D_MODEL]]},
            ["input 'hidden_states'", "finite float32", "inf at index [0, 0, 0]"],
        ),
        ({"hidden_states": b64(np.zeros((1, 1, D_MODEL), np.int64))}, ["expected dtype float32, got int64"]),
        (
            {"hidden_states": [[[0.5] * D_MODEL]], "attention_mask": [[3]]},
            ["input 'attention_mask'", "0 (padding) or 1 (attend), got 3 at index [0, 0]"],
        ),
        ({"hidden_states": np.zeros((5, 13, D_MODEL)).tolist()}, ["5 x 13 = 65 tokens", "SERVING_MAX_REQUEST_TOKENS"]),
        ({"hidden_states": [[["0.5"] * D_MODEL]]}, ["input 'hidden_states'", "expected numbers", "strings"]),
    ],
    ids=["d_model", "overflow", "b64-dtype", "mask-value", "token-cap", "strings"],
)
def test_tensors_that_do_not_fit_get_400_naming_the_input(fields, fragments):
    error = error_of(attend, body(**fields))
    assert isinstance(error, InvalidInput), error
    for fragment in fragments:
        assert fragment in error.message, error.message


def test_booleans_in_a_float_tensor_are_refused_naming_the_input_and_index():
    """JSON `true` is not a number: numpy would read it as 1.0."""
    row = [0.5] * D_MODEL
    row[5] = True
    error = error_of(attend, body(hidden_states=[[row]]))
    assert isinstance(error, InvalidInput)
    assert error.message == "input 'hidden_states': expected numbers, got a boolean at index [0, 0, 5]"
    mask = error_of(attend, body(hidden_states=[[[0.5] * D_MODEL] * 2], attention_mask=[[1, False]]))
    assert "input 'attention_mask'" in mask.message and "boolean at index [0, 1]" in mask.message


def test_the_words_true_and_false_inside_base64_are_not_booleans():
    hidden = np.frombuffer(base64.b64decode("truefalse" * 1000 + "AAA="), np.uint8)[: 4 * D_MODEL].copy()
    hidden = hidden.view(np.float32).reshape(1, 1, D_MODEL)
    hidden[~np.isfinite(hidden)] = 0.0
    valid = attend(body(hidden_states=b64(hidden)))
    assert b"true" in body(hidden_states=b64(hidden))
    np.testing.assert_array_equal(valid.hidden_states, hidden)


@pytest.mark.parametrize(
    ("raw", "fragments"),
    [
        (b'{"hidden_states": [[[NaN]]]}', ["not valid JSON", "NaN at char", "finite numbers"]),
        (b'{"hidden_states": [[[-Infinity]]]}', ["-Infinity at char", "finite numbers"]),
        (b"{not json", ["body: not valid JSON"]),
        (b'{"hidden_states": "abc"}', ["body.hidden_states"]),
        (b'{"hidden_states": [[[0.5]]], "extra": 1}', ["body.extra: Extra inputs are not permitted"]),
        (b"[1, 2]", ["body: Input should be"]),
    ],
)
def test_bodies_that_are_not_the_documented_json_get_422(raw, fragments):
    error = error_of(attend, raw)
    assert isinstance(error, SchemaViolation)
    for fragment in fragments:
        assert fragment in error.message, error.message


def test_the_body_bound_holds_the_largest_valid_body_and_little_more():
    """The largest valid request for the cap, written the way Python's json writes float32 values
    (17 significant digits, ", " between them: the longest common form), fits under the bound."""
    tokens, max_seq_len = 16, 32
    bound = body_bound(STATELESS, tokens, max_seq_len)
    past = max_seq_len - 1
    largest = {
        "hidden_states": np.full((1, 1, D_MODEL), -1.2345678e-30, np.float32).tolist(),
        "attention_mask": np.ones((1, past + 1), np.int64).tolist(),
        "past_key_values": [
            {
                kind: np.full((1, N_KV_HEADS, past, HEAD_DIM), -1.2345678e-30, np.float32).tolist()
                for kind in names.KV_KINDS
            }
            for _ in range(N_LAYERS)
        ],
    }
    wide = {"hidden_states": np.full((1, tokens, D_MODEL), -1.2345678e-30, np.float32).tolist()}
    for request in (largest, wide):
        assert len(json.dumps(request)) < bound
    assert bound < 4 * len(json.dumps(largest)) + (64 << 10)
    step = {"hidden_states": np.full((1, max_seq_len, D_MODEL), -1.2345678e-30, np.float32).tolist()}
    assert len(json.dumps(step)) < bound  # a session's prompt of max_seq_len tokens
