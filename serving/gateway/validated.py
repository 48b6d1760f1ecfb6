"""The gateway's edge: a request body in, one validated request out (as TGI's router validates into
`ValidGenerateRequest`).

`parse` reads the body once (orjson) and checks its fields against the schema (`schemas`, shallow);
`attend` and `step` decode every tensor into a numpy array (`encoding.decode`) and check the arrays
once with the checks of `contract/inputs.py`: names, ranks, sizes and dtypes against the
served model's metadata, the gateway's token cap, mask values, finite values. What comes out is
trusted by the rest of the gateway, which calls the client library with its own checks off; Triton's
models check again behind their own trust boundary.

422 `validation_error`: the body is not JSON or its fields do not match the document. 400
`invalid_input`: a tensor does not fit the served model (the message names the input, the expected
and the actual).

`body_bound` is the most bytes a valid request body can need for the served model, so that a larger
one is refused (413) before it is read.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import orjson
from pydantic import BaseModel, ValidationError

from client import ModelInfo
from contract import names
from contract.inputs import (
    InputError,
    check_finite,
    check_inputs,
    check_mask_values,
    check_one_sequence,
    check_request_tokens,
    check_token_values,
    named_inputs,
)
from serving.gateway.encoding import decode
from serving.gateway.errors import InvalidInput, SchemaViolation, describe_validation

# A JSON number as text, generously: "-1.2345678901234567e-308, " is 26 bytes; whitespace and brackets
# ride on the rest.
JSON_BYTES_PER_NUMBER = 32
BODY_OVERHEAD_BYTES = 64 << 10  # field names, tensor objects' dtype and shape
Pairs = list[tuple[np.ndarray, np.ndarray]]
MAX_MAP_VALUES = 1 << 21  # the weights one /v1/inspect answer holds: ~40 MB of JSON numbers


@dataclasses.dataclass(frozen=True)
class ValidAttend:
    """A /v1/attend request whose tensors fit the stateless model."""

    hidden_states: np.ndarray
    attention_mask: np.ndarray | None
    past: Pairs  # one (key, value) per layer; empty for an empty past
    position_ids: np.ndarray | None = None  # a rotary model's; None: the server counts them


@dataclasses.dataclass(frozen=True)
class ValidStep:
    """A session step whose tensors fit the session model: one sequence's new tokens (and mask)."""

    hidden_states: np.ndarray
    attention_mask: np.ndarray | None


@dataclasses.dataclass(frozen=True)
class Body:
    """A request body parsed, its fields as the schema has them (tensors not decoded yet)."""

    raw: bytes
    fields: Any  # a schemas.AttendRequest or schemas.StepBody


def parse(raw: bytes, schema: type[BaseModel]) -> Body:
    """The body parsed (orjson) and its fields validated against `schema`, or 422."""
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise SchemaViolation(f"body: not valid JSON: {_why_not_json(raw, error)}") from None
    try:
        return Body(raw, schema.model_validate(document))
    except ValidationError as error:
        located = [{**e, "loc": ("body", *e["loc"])} for e in error.errors()]
        raise SchemaViolation(describe_validation(located)) from None


def attend(body: Body, info: ModelInfo, max_request_tokens: int) -> ValidAttend:
    """A parsed /v1/attend body whose tensors fit the stateless model `info`, or 400."""
    tensors, past = _decode_inputs(body, info)
    try:
        batch, _, new = check_inputs(info.sizes, tensors, float_dtype=info.float_dtype)
        check_request_tokens(batch, new, max_request_tokens, "SERVING_MAX_REQUEST_TOKENS", info.new_tokens)
        _check_values(tensors)
        check_token_values(info.sizes, tensors)
    except InputError as error:
        raise InvalidInput(str(error)) from None
    return ValidAttend(
        tensors[info.new_tokens], tensors.get(names.ATTENTION_MASK), past, tensors.get(names.POSITION_IDS)
    )


def step(body: Body, info: ModelInfo) -> ValidStep:
    """A parsed session step whose tensors fit the session model `info`, or 400."""
    tensors, _ = _decode_inputs(body, info)
    try:
        batch, _, _ = check_inputs(info.sizes, tensors, float_dtype=info.float_dtype)
        check_one_sequence(batch, info.new_tokens)
        _check_values(tensors)
        check_token_values(info.sizes, tensors)
    except InputError as error:
        raise InvalidInput(str(error)) from None
    return ValidStep(tensors[info.new_tokens], tensors.get(names.ATTENTION_MASK))


@dataclasses.dataclass(frozen=True)
class ValidInspect:
    """A /v1/inspect request: one sequence's new tokens (1, T, d_model) (a whole model's ids (1, T)) and,
    stateless only, their mask (1, T); `session` names the session whose next step is inspected (None:
    stateless)."""

    hidden_states: np.ndarray
    attention_mask: np.ndarray | None
    session: str | None


def inspect(body: Body, info: ModelInfo, max_request_tokens: int) -> ValidInspect:
    """A parsed /v1/inspect body whose tokens fit `info` (the stateless model, or the session model
    with `session`), or 400 (422 for a mask beside a session: a session's past has no padding)."""
    fields = body.fields
    if fields.session is not None and fields.attention_mask is not None:
        raise SchemaViolation(
            "body.attention_mask: not taken with `session` (a session's positions are all real tokens); send "
            "only the real new tokens"
        )
    tensors, _ = _decode_inputs(body, info)
    first = info.new_tokens
    new_tokens = tensors[first]
    whole = first == names.INPUT_IDS  # ids (T,) or (1, T); hidden states (T, d) or (1, T, d)
    if new_tokens.ndim not in ((1, 2) if whole else (2, 3)):
        one = (
            "(sequence,) or (1, sequence) = (T,) or (1, T)"
            if whole
            else (f"(sequence, d_model) or (1, sequence, d_model) = (T, {info.d_model}) or (1, T, {info.d_model})")
        )
        raise InvalidInput(f"input '{first}': expected one sequence, {one}, got shape {list(new_tokens.shape)}")
    if new_tokens.ndim == (1 if whole else 2):  # one sequence, its batch axis left out (and its mask's)
        tensors[first] = new_tokens[None]
        mask = tensors.get(names.ATTENTION_MASK)
        if mask is not None and mask.ndim == 1:
            tensors[names.ATTENTION_MASK] = mask[None]
    try:
        batch, _, new = check_inputs(info.sizes, tensors, float_dtype=info.float_dtype)
        check_one_sequence(batch, first)
        check_request_tokens(batch, new, max_request_tokens, setting="SERVING_MAX_REQUEST_TOKENS", name=first)
        if new == 0:
            raise InputError(first, "no tokens: the maps need at least one query")
        _check_values(tensors)
        check_token_values(info.sizes, tensors)
    except InputError as error:
        raise InvalidInput(str(error)) from None
    return ValidInspect(tensors[first], tensors.get(names.ATTENTION_MASK), fields.session)


def check_map_size(info: ModelInfo, past: int, new: int) -> None:
    """The maps of `new` queries over `past + new` keys in every layer and head within MAX_MAP_VALUES,
    or 400: an answer of that many numbers is tens of megabytes of JSON. Known only with the model's
    published sizes (n_layers, n_heads)."""
    layers, heads = info.facts.get("n_layers"), info.facts.get("n_heads")
    if not isinstance(layers, int) or not isinstance(heads, int):
        return
    values = layers * heads * new * (past + new)
    if values > MAX_MAP_VALUES:
        raise InvalidInput(
            f"input '{names.HIDDEN_STATES}': {layers} layers x {heads} heads x {new} queries x {past + new} keys = "
            f"{values} weights, more than the {MAX_MAP_VALUES} one /v1/inspect answer holds; send fewer tokens"
        )


def _check_values(tensors: dict[str, np.ndarray]) -> None:
    check_mask_values(tensors)
    check_finite(tensors)


# --- the body's fields --------------------------------------------------------------------------------------

_NOT_JSON_NUMBERS = re.compile(rb"-?(NaN|Infinity)")


def _why_not_json(raw: bytes, error: orjson.JSONDecodeError) -> str:
    start = error.pos - 1 if raw[error.pos - 1 : error.pos] == b"-" else error.pos  # orjson points past a sign
    found = _NOT_JSON_NUMBERS.match(raw, start)
    if found is not None:  # what Python's json.dumps writes for float("nan"): say so plainly
        return (
            f"{found.group().decode()} at char {error.pos}: JSON has no NaN or Infinity, values must be finite numbers"
        )
    return str(error)


def _decode_inputs(body: Body, info: ModelInfo) -> tuple[dict[str, np.ndarray], Pairs]:
    """The graph's named inputs from the body's tensor fields (and the past as pairs), or 400 naming
    the field. The new tokens are the model's (`info.new_tokens`): a whole model's int64 ids, else
    hidden states in its float dtype; the other field is refused."""
    fields, dtype, first = _fields(body), info.float_dtype, info.new_tokens
    other = names.HIDDEN_STATES if first == names.INPUT_IDS else names.INPUT_IDS
    if fields.get(other) is not None:
        raise InvalidInput(f"input '{other}': this model takes '{first}' as its new tokens, not '{other}'")
    if fields.get(first) is None:  # as the schema words a missing field (both are optional there)
        raise SchemaViolation(f"body.{first}: Field required")
    try:
        hidden = decode(fields[first], first, "int64" if first == names.INPUT_IDS else dtype)
        given = fields.get(names.ATTENTION_MASK)
        mask = None if given is None else decode(given, names.ATTENTION_MASK, "int64")
        given = fields.get(names.POSITION_IDS)
        positions = None if given is None else decode(given, names.POSITION_IDS, "int64")
        past = [
            (
                decode(pair.key, names.past_name(layer, names.KEY), dtype),
                decode(pair.value, names.past_name(layer, names.VALUE), dtype),
            )
            for layer, pair in enumerate(fields.get("past_key_values") or ())
        ]
    except InputError as error:
        raise InvalidInput(str(error)) from None
    _refuse_booleans(body)
    return named_inputs(hidden, mask, past, positions, first), past


def _fields(body: Body) -> dict[str, Any]:
    """The body's fields by name, those its schema has (a step's has no past): a pydantic model answers a
    `getattr` of a field it lacks through its slow path, about 2 us each."""
    return vars(body.fields)


def _refuse_booleans(body: Body) -> None:
    """numpy reads `true` in a list of numbers as 1.0; no field of a body is a boolean, so a body with
    no tensor as lists (base64 tensor objects hold none), or without the words `true` and `false` (the
    common case, checked on the bytes), holds none; otherwise the lists are walked to name the input and
    the index."""
    fields = _fields(body)
    tensors = {name: fields.get(name) for name in (names.HIDDEN_STATES, names.INPUT_IDS)}
    tensors[names.ATTENTION_MASK] = fields.get(names.ATTENTION_MASK)
    tensors[names.POSITION_IDS] = fields.get(names.POSITION_IDS)
    for layer, pair in enumerate(fields.get("past_key_values") or ()):
        tensors |= {names.past_name(layer, kind): getattr(pair, kind) for kind in names.KV_KINDS}
    lists = {name: value for name, value in tensors.items() if isinstance(value, list)}
    if not lists or not any(holds_word(body.raw, word) for word in (b"true", b"false")):
        return
    for name, value in lists.items():
        where = first_boolean(value)
        if where is not None:
            raise InvalidInput(f"input '{name}': expected numbers, got a boolean at index {list(where)}")


def holds_word(raw: bytes, word: bytes, candidates: int = 64) -> bool:
    """Whether `word` is in `raw`: its first letter found by memchr (a JSON number has no `t` or `f`, so in a
    body of numbers only the field names hold a few), then the word checked there; past `candidates` of them
    (letters in a base64 string, say), the rest searched whole. A 10 KB step body: 0.2 µs for each word,
    where `word in raw` took 15."""
    at = raw.find(word[:1])
    for _ in range(candidates):
        if at == -1:
            return False
        if raw.startswith(word, at):
            return True
        at = raw.find(word[:1], at + 1)
    return at != -1 and word in raw[at:]


def first_boolean(value: Any, index: tuple[int, ...] = ()) -> tuple[int, ...] | None:
    """The index of the first boolean in nested lists, or None."""
    if isinstance(value, bool):
        return index
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = first_boolean(item, (*index, i))
            if found is not None:
                return found
    return None


# --- the largest body -------------------------------------------------------------------------------------


# a text request's body (text_body_bound): a token's bytes as JSON escapes them at worst (\u00XX: 6 bytes a byte),
# and what a chat message wraps around its text (its keys, its role), at most one message a token
JSON_ESCAPED_BYTES = 6
MESSAGE_BYTES = 128
# the fields that are not prompt text: a response format's schema, tools (in the prompt too, once rendered), stop
# strings; and logit_bias, an entry per vocabulary id at most
TEXT_FIELDS_BYTES = 4 << 20
LOGIT_BIAS_ENTRY_BYTES = 24


def text_body_bound(max_seq_len: int, longest_token_bytes: int, vocab_size: int, prompts: int) -> int:
    """The most bytes a valid text request's body can need: `prompts` prompts (or conversations), each at most
    `max_seq_len` tokens of at most `longest_token_bytes` of text (or ids, shorter), escaped and wrapped in
    messages; and the other fields."""
    per_token = JSON_ESCAPED_BYTES * max(longest_token_bytes, 2) + MESSAGE_BYTES
    others = TEXT_FIELDS_BYTES + vocab_size * LOGIT_BIAS_ENTRY_BYTES
    return BODY_OVERHEAD_BYTES + others + prompts * max_seq_len * per_token


def body_bound(info: ModelInfo, max_request_tokens: int, max_seq_len: int) -> int:
    """The most bytes a valid body can need for the stateless model `info`: `max_request_tokens` new
    tokens (with their positions) over a past of `max_seq_len` positions (with its mask), or a session
    step of `max_seq_len` tokens, every number written as JSON text (the longer of the two forms;
    base64 takes 5.33 bytes a float32)."""
    cache = 2 * info.n_layers * (info.n_kv_heads or 0) * (info.head_dim or 0)
    token = 1 if info.vocab_size is not None else info.d_model  # numbers a new token takes: an id, or a state
    attend = max_request_tokens * (token + 1) + (max_request_tokens + max_seq_len) + cache * max_seq_len
    step = max_seq_len * (token + 1)
    return JSON_BYTES_PER_NUMBER * max(attend, step) + BODY_OVERHEAD_BYTES
