"""What a served model is, read from Triton's model metadata through the naming table.

The stateless model's inputs say everything the client needs: `hidden_states` gives d_model and
the float dtype, the `past_key_values.{i}.*` names give n_layers, and a past tensor's fixed axes
give n_kv_heads and head_dim (docs/design.md, "Tensor names"). The session model has only hidden_states and the
mask, so for it n_layers is 0. A whole model takes `input_ids` (int64) instead and answers `logits`,
whose last axis gives vocab_size and whose datatype the float dtype (its d_model is its config's fact).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from client.errors import ClientError, InvalidInputError
from contract import names
from contract.inputs import InputError, check_finite, check_inputs, check_one_sequence, check_token_values

# Triton datatypes of the model's float tensors, as numpy names (what check_inputs compares).
_FLOAT_DTYPES = {"FP32": "float32", "FP16": "float16", "FP64": "float64"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    datatype: str  # Triton's name: FP32, INT64, ...
    shape: tuple[int, ...]  # -1 for a dynamic axis


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """A served model's tensors and the sizes they imply."""

    name: str
    inputs: dict[str, TensorInfo] = dataclasses.field(repr=False)
    outputs: dict[str, TensorInfo] = dataclasses.field(repr=False)
    d_model: int
    float_dtype: str  # numpy name, e.g. "float32"
    n_layers: int = 0  # 0 for the session model, which takes no past
    n_kv_heads: int | None = None
    head_dim: int | None = None
    rotary: bool = False  # the model takes position_ids (rotary or learned positions)
    vocab_size: int | None = None  # a whole model's: input_ids in, logits (..., vocab_size) out
    # what the model's config publishes (serving/triton/config.py): its sizes and max_seq_len for any
    # model, the token cap of the stateless one, the engine, its session operations and the KV budget
    # of the session one
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def sizes(self) -> names.GraphSizes:
        """What the inputs check needs; a session model (no past inputs) has no cache sizes."""
        return names.GraphSizes(
            self.d_model, self.n_layers, self.n_kv_heads or 0, self.head_dim or 0, self.rotary, self.vocab_size
        )

    @property
    def new_tokens(self) -> str:
        """The input carrying the new tokens: `input_ids` of a whole model, else `hidden_states`."""
        return names.model_input(self.sizes)

    @property
    def answer(self) -> str:
        """The output answering them: `logits` of a whole model, else `output`."""
        return names.model_output(self.sizes)

    def no_tokens(self) -> np.ndarray:
        """New tokens of one sequence, none of them: what opens, ends or operates on a session."""
        if self.vocab_size is not None:
            return np.zeros((1, 0), np.int64)
        return np.zeros((1, 0, self.d_model), self.float_dtype)

    def check(self, tensors: Mapping[str, Any], *, session: bool = False) -> tuple[int, int, int]:
        """(batch, past, new) of named inputs with finite values (a session's: one sequence), or
        InvalidInputError naming the input at fault. The server knows its own limits (max_seq_len)
        and says so."""
        try:
            sizes = check_inputs(self.sizes, tensors, float_dtype=self.float_dtype)
            if session:
                check_one_sequence(sizes[0], self.new_tokens)
            check_finite(tensors)
            check_token_values(self.sizes, tensors)
            return sizes
        except InputError as error:
            raise InvalidInputError(str(error), input_name=error.input_name) from None


def parse_metadata(metadata: Mapping[str, Any]) -> ModelInfo:
    """ModelInfo from Triton's model metadata, as HTTP or gRPC (as_json) returns it."""
    inputs = _tensors(metadata.get("inputs", ()))
    outputs = _tensors(metadata.get("outputs", ()))
    model = str(metadata.get("name", "?"))
    info = _whole_model(model, inputs, outputs) if names.INPUT_IDS in inputs else None
    hidden = inputs.get(names.HIDDEN_STATES)
    if info is None and (hidden is None or hidden.datatype not in _FLOAT_DTYPES or len(hidden.shape) < 2):
        raise ClientError(f"model '{model}' has no float input '{names.HIDDEN_STATES}'; inputs are {list(inputs)}")
    if info is None:
        info = ModelInfo(model, inputs, outputs, d_model=hidden.shape[-1], float_dtype=_FLOAT_DTYPES[hidden.datatype])
    n_layers = names.layer_count(list(inputs))
    if not n_layers:
        return info
    past = inputs[names.past_name(0, names.KEY)].shape  # (batch, n_kv_heads, past, head_dim)
    rotary = names.POSITION_IDS in inputs
    return dataclasses.replace(info, n_layers=n_layers, n_kv_heads=past[-3], head_dim=past[-1], rotary=rotary)


def with_facts(info: ModelInfo, facts: dict[str, Any]) -> ModelInfo:
    """`info` with what its config publishes; a whole model's d_model, which its IO does not show, from there."""
    d_model = info.d_model or int(facts.get("d_model") or 0)
    return dataclasses.replace(info, facts=facts, d_model=d_model)


def _whole_model(model: str, inputs: dict[str, TensorInfo], outputs: dict[str, TensorInfo]) -> ModelInfo:
    """A whole model's info: int64 ids in, float logits (..., vocab_size) out; d_model 0 (not in its IO)."""
    ids, logits = inputs[names.INPUT_IDS], outputs.get(names.LOGITS)
    if ids.datatype != "INT64" or logits is None or logits.datatype not in _FLOAT_DTYPES or logits.shape[-1] < 1:
        raise ClientError(
            f"model '{model}' takes '{names.INPUT_IDS}' ({ids.datatype}) but has no float output '{names.LOGITS}' "
            f"of a fixed vocabulary; outputs are {list(outputs)}"
        )
    dtype = _FLOAT_DTYPES[logits.datatype]
    return ModelInfo(model, inputs, outputs, d_model=0, float_dtype=dtype, vocab_size=logits.shape[-1])


def _tensors(entries) -> dict[str, TensorInfo]:
    # gRPC's JSON renders int64 dims as strings; HTTP gives numbers
    return {e["name"]: TensorInfo(e["name"], e["datatype"], tuple(int(d) for d in e.get("shape", ()))) for e in entries}


# parameters of a served model's config that say what it is (serving/triton/config.py and
# repository.py write them)
SETTING_FACTS = (
    "max_request_tokens",
    "engine",
    "operations",
    "kv_cache_bytes",
    "idle_timeout_seconds",
    "text_digest",
    "session_model",  # the generation model's: the session model it steps
)
LIST_FACTS = ("operations",)  # comma-separated in the config: the session operations the engine offers


def parse_facts(config: Mapping[str, Any]) -> dict[str, Any]:
    """The facts a model's config publishes, from Triton's model config as HTTP or gRPC (as_json, under
    "config") returns it: numbers as numbers, LIST_FACTS as lists of names."""
    parameters = (config.get("config", config) or {}).get("parameters", {})
    facts = {}
    for key, value in parameters.items():
        name = key.removeprefix(names.FACT_PREFIX)
        if key.startswith(names.FACT_PREFIX) or key in SETTING_FACTS:
            text = value.get("string_value", "")
            facts[name] = [part for part in text.split(",") if part] if name in LIST_FACTS else _number(text)
    return facts


def _number(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
