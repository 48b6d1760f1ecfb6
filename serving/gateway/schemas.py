"""Request and response bodies; their JSON Schemas are the OpenAPI document's.

Tensors are nested lists of the stated rank, or an `EncodedTensor` (see `encoding`). The document
fixes ranks and element types; sizes depend on the served model (`GET /v1/models`). A request's
tensor fields are validated here only as "a list or a tensor object": what the elements are, the
ranks, the sizes, the dtypes and the values are checked once, on the arrays, by
`serving/gateway/validated.py` (a 400 that names the input, the expected and the actual), instead
of once per float by pydantic and again on the arrays.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, StrictBool, StrictFloat, StrictInt
from pydantic_core import core_schema

from contract import generation
from contract.sampling import LOGIT_BIAS_LIMIT, MAX_LOGPROBS, PENALTY_LIMIT, SamplingParams
from serving.gateway.encoding import EncodedTensor, FiniteFloat, MaskBit


class Documented:
    """A field validated as its own type (shallow: a list or a tensor object) and documented as
    `documented` (the nested lists and their elements). pydantic validates Python input with the
    `python_schema` of a json-or-python schema and writes the JSON Schema from its `json_schema`."""

    def __init__(self, documented: Any) -> None:
        self.documented = documented

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.json_or_python_schema(
            json_schema=handler.generate_schema(self.documented), python_schema=handler(source)
        )


Tensor = list[Any] | EncodedTensor
States = Annotated[Tensor, Documented(list[list[list[FiniteFloat]]] | EncodedTensor)]  # (batch, sequence, d_model)
Mask = Annotated[Tensor, Documented(list[list[MaskBit]] | EncodedTensor)]  # (batch, length) of 0/1
# (batch, sequence) int64: a whole model's token ids, each in [0, vocab_size)
Ids = Annotated[Tensor, Documented(list[list[Annotated[int, Field(ge=0)]]] | EncodedTensor)]
Logits = Annotated[Tensor, Documented(list[list[list[float]]] | EncodedTensor)]  # (batch, sequence, vocab_size)
Positions = Annotated[Tensor, Documented(list[list[Annotated[int, Field(ge=0)]]] | EncodedTensor)]  # (batch, sequence)
Cache = Annotated[Tensor, Documented(list[list[list[list[FiniteFloat]]]] | EncodedTensor)]
# (batch, n_kv_heads, length, head_dim)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KeyValue(Strict):
    key: Cache = Field(description="(batch, n_kv_heads, past_length, head_dim) float32")
    value: Cache = Field(description="(batch, n_kv_heads, past_length, head_dim) float32")


class AttendRequest(Strict):
    # the new tokens: hidden states for an attention model, token ids for a whole model (GET /v1/models says
    # which: its `vocab_size`); the one the model does not take is refused
    hidden_states: States | None = Field(default=None, description="(batch, sequence, d_model) float32: the new tokens")
    input_ids: Ids | None = Field(
        default=None, description="a whole model's: (batch, sequence) int64 token ids, the new tokens"
    )
    attention_mask: Mask | None = Field(
        default=None, description="(batch, past_length + sequence) of 1 (attend) / 0 (padding); default all ones"
    )
    past_key_values: list[KeyValue] | None = Field(
        default=None, description="one {key, value} per layer, as returned in `present`; omit for an empty past"
    )
    position_ids: Positions | None = Field(
        default=None,
        description="(batch, sequence) int64: the new tokens' positions, for a model with rotary embeddings; "
        "default counted from the mask (the attended positions before each token)",
    )


class AttendResponse(BaseModel):
    output: States | None = Field(default=None, description="(batch, sequence, d_model) float32")
    logits: Logits | None = Field(default=None, description="a whole model's: (batch, sequence, vocab_size) float32")
    present: list[KeyValue] = Field(description="per layer, the past extended by the new tokens: send it back as past")


class StepBody(Strict):
    hidden_states: States | None = Field(
        default=None, description="(1, sequence, d_model) float32: the session's new tokens"
    )
    input_ids: Ids | None = Field(default=None, description="a whole model's: (1, sequence) int64 token ids")
    attention_mask: Mask | None = Field(default=None, description="(1, sequence) of 1/0 for the new tokens only")


class StepResponse(BaseModel):
    output: States | None = Field(default=None, description="(1, sequence, d_model) float32")
    logits: Logits | None = Field(default=None, description="a whole model's: (1, sequence, vocab_size) float32")
    length: int = Field(description="tokens the server now holds for this session")


# one sequence, its batch axis optional: (sequence, d_model) or (1, sequence, d_model); its mask (sequence,) or (1, ...)
OneSequence = Annotated[Tensor, Documented(list[list[list[FiniteFloat]]] | list[list[FiniteFloat]] | EncodedTensor)]
OneMask = Annotated[Tensor, Documented(list[list[MaskBit]] | list[MaskBit] | EncodedTensor)]


# a whole model's one sequence of token ids: (sequence,) or (1, sequence)
OneSequenceIds = Annotated[
    Tensor, Documented(list[list[Annotated[int, Field(ge=0)]]] | list[Annotated[int, Field(ge=0)]] | EncodedTensor)
]


class InspectRequest(Strict):
    hidden_states: OneSequence | None = Field(
        default=None, description="(sequence, d_model) or (1, sequence, d_model) float32: one sequence's tokens"
    )
    input_ids: OneSequenceIds | None = Field(
        default=None, description="a whole model's: (sequence,) or (1, sequence) int64 token ids, one sequence"
    )
    text: str | None = Field(
        default=None,
        description="a whole model with a tokenizer's, instead of input_ids: the text its tokenizer encodes, with "
        "the special tokens it adds (as transformers' tokenizer(text)); with `session`, without them (the text "
        "goes on from what the session holds). The answer's `tokens` are what it encoded to",
    )
    attention_mask: OneMask | None = Field(
        default=None,
        description="stateless only: (sequence,) or (1, sequence) of 1 (attend) / 0 (padding); default all ones",
    )
    session: str | None = Field(
        default=None,
        description="a session of this key: the maps of its next step with these tokens (the session is not changed)",
    )


class InspectToken(BaseModel):
    id: int
    text: str = Field(
        description="the token's text; a token that is no whole UTF-8 character: 'bytes:' and its bytes' escapes "
        "('bytes:\\xe4\\xbd'), as OpenAI's logprobs write it"
    )


class NamedHead(BaseModel):
    layer: int
    head: int
    share: float = Field(description="its value of the role's statistic")


class HeadRole(BaseModel):
    role: str = Field(description="previous-token, first-position or induction")
    statistic: str = Field(description="the statistic the role is read from (a name in `statistics`' heads)")
    threshold: float = Field(description="a head is named when its statistic is at least this")
    measured: bool = Field(
        description="whether any head has the statistic: the induction share needs a whole model's stateless "
        "call with a token that occurred before"
    )
    heads: list[NamedHead] = Field(description="the heads at or above the threshold, largest first; [] when none")


class InspectResponse(BaseModel):
    layers: int
    heads: int = Field(description="query heads per layer")
    queries: int = Field(description="T: the new tokens")
    keys: int = Field(description="P + T: the session's past (0 stateless) and the new tokens")
    maps: list[Any] = Field(
        description="per layer (heads, queries, keys) attention weights: nested lists, or a tensor object with "
        "`?encoding=b64`; each query's row sums to 1"
    )
    statistics: list[dict[str, Any]] = Field(
        description="per layer {layer, queries, heads: [{head, entropy, mean_distance, first_position_share, "
        "previous_token_share}]}: means over the queries with an earlier real key (None when there is none). "
        "A whole model's stateless call (input_ids or text) adds the layer's induction_queries and each head's "
        "induction_share: the weight on the token after the latest earlier occurrence of the query's token, a "
        "mean over the queries whose token occurred before (None when none did); a session's step has none (its "
        "past's ids are not the gateway's). contract/heads.py defines each"
    )
    roles: list[HeadRole] = Field(
        description="the heads named by role from the statistics: previous-token, first-position and induction "
        "heads, each with its threshold"
    )
    tokens: list[InspectToken] | None = Field(
        default=None, description="with `text` only: the tokens it encoded to, the queries' (and the last keys')"
    )


class SessionCreated(BaseModel):
    id: str = Field(description="the session's id, for /v1/sessions/{id}/step and DELETE")
    idle_timeout_s: float = Field(description="the session is closed after this long without a step")


class FromPrefix(Strict):
    prefix: str | None = Field(
        default=None, description="a prefix of this key (PUT /v1/prefixes/{name}) the session starts from; none: empty"
    )


class Prefix(BaseModel):
    name: str
    length: int = Field(description="the positions it holds")


class PrefixList(BaseModel):
    prefixes: list[Prefix]


class RewindBody(BaseModel):
    length: int = Field(ge=0, description="the positions the session keeps; the next step continues after them")


class Rewound(BaseModel):
    length: int = Field(description="the positions the session holds now")


# --- generation (serving/gateway/generate.py) ---------------------------------------------------------------

SAMPLING = SamplingParams()  # the defaults: greedy, no truncation, no penalties


class GenerateBody(Strict):
    """A generation on the server. Pydantic checks the types; the ranges are checked once, by the contract's
    own checks (contract/generation.py, contract/sampling.py), which answer 400 naming the field."""

    input_ids: list[StrictInt] | list[list[StrictInt]] | None = Field(
        default=None,
        description="the prompt: (T,) or (1, T) token ids, each in [0, vocab_size). A session's may be left out "
        "(or empty) to go on after its last generation; a stateless generation needs one",
    )
    max_new_tokens: StrictInt = Field(
        default=generation.DEFAULT_MAX_NEW_TOKENS, description="at most this many new tokens, in [0, max_seq_len]"
    )
    stop_token_ids: list[StrictInt] = Field(
        default=[], description="ids that end the generation once generated (the stop token is answered and kept)"
    )
    temperature: StrictFloat = Field(
        default=SAMPLING.temperature, description="0: greedy (the argmax); > 0: sample from softmax(logits / T)"
    )
    top_k: StrictInt | None = Field(
        default=SAMPLING.top_k, description="keep the k most likely tokens (none or 0: all), in [0, 2**63)"
    )
    top_p: StrictFloat | None = Field(
        default=SAMPLING.top_p, description="nucleus: the smallest set whose probability reaches p, in (0, 1]"
    )
    min_p: StrictFloat | None = Field(
        default=SAMPLING.min_p, description="drop tokens less likely than min_p times the top token, in [0, 1]"
    )
    repetition_penalty: StrictFloat = Field(
        default=SAMPLING.repetition_penalty,
        description="> 0; over prompt and generated ids: a positive logit is divided by it, a negative multiplied",
    )
    presence_penalty: StrictFloat = Field(
        default=SAMPLING.presence_penalty,
        description=f"in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}]: subtracted from the logit of each generated id",
    )
    frequency_penalty: StrictFloat = Field(
        default=SAMPLING.frequency_penalty,
        description=f"in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}]: subtracted once per time an id was generated",
    )
    logit_bias: dict[str, StrictFloat | StrictInt] | None = Field(
        default=None,
        description=f"token id (as a string) -> a bias in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}] added to its logit "
        "after the penalties (OpenAI's logit_bias)",
    )
    grammar: dict[str, Any] | None = Field(
        default=None,
        description='what the text must match, one of {"json_schema": {...}}, {"regex": "..."}, {"lark": '
        '"..."}, {"choice": ["..."]}: each token is picked among those that keep it matchable, and the '
        "generation ends (finish reason stop) once it is complete; needs stop_token_ids (its end)",
    )
    seed: StrictInt | None = Field(
        default=SAMPLING.seed, description="in [0, 2**63): the same tokens for the same request, on any replica"
    )
    logprobs: StrictInt | None = Field(
        default=None,
        description=f"in [0, {MAX_LOGPROBS}]: answer each token's logprob and this many most likely alternatives' "
        "(`top`); none: no logprobs in the JSON answer",
    )
    stream: StrictBool = Field(
        default=False,
        description="true: `text/event-stream`, one `data:` event per token as it comes, then one with the "
        "finish reason, then `data: [DONE]`; false: one JSON answer at the end",
    )


class TopLogprob(BaseModel):
    token_id: int
    logprob: float


class TokenLogprob(BaseModel):
    token_id: int
    logprob: float = Field(description="log_softmax of the logits after the penalties, before temperature")
    top: list[TopLogprob] = Field(description="the `logprobs` most likely tokens at this position, best first")


class Generated(BaseModel):
    token_ids: list[int] = Field(description="the generated tokens, in order")
    finish_reason: Literal[generation.FINISH_REASONS] = Field(  # type: ignore[valid-type]
        description="`stop`: a stop token; `length`: max_new_tokens; `max_seq_len`: the session is full"
    )
    held_length: int = Field(
        description="the positions the session holds now, the prompt and the generated tokens included (0 for a "
        "stateless generation: its sequence is ended)"
    )
    logprobs: list[TokenLogprob] | None = Field(default=None, description="when `logprobs` was asked: per token")


class TensorDescription(BaseModel):
    name: str
    datatype: str = Field(description="Triton datatype, e.g. FP32, INT64")
    shape: list[int] = Field(description="-1 marks a dynamic axis")


class ModelDescription(BaseModel):
    name: str
    kind: Literal["stateless", "session", "generation"] = Field(
        description="`generation`: the session model the OpenAI-compatible routes and POST /v1/generate step, when "
        "it is not the session routes' (the repository serves a second model beside them)"
    )
    ready: bool
    d_model: int | None = None
    vocab_size: int | None = Field(default=None, description="a whole model's: input_ids in, logits out")
    n_heads: int | None = None
    n_layers: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    max_seq_len: int | None = Field(default=None, description="the longest past + new a sequence may hold")
    max_request_tokens: int | None = Field(default=None, description="stateless: batch x new tokens per request")
    engine: str | None = Field(
        default=None,
        description="session: the engine that serves it: `static` (a KV pool) or `concat` (per-sequence caches; "
        "what a model whose static graph could not be built gets)",
    )
    operations: list[str] | None = Field(
        default=None,
        description="session: the session operations its engine offers (snapshot, restore, fork, rewind, the "
        "prefixes, attention maps); a route needing another answers 400",
    )
    kv_cache_bytes: int | None = Field(default=None, description="session: the KV cache budget of all sessions")
    dtype: str | None = None
    inputs: list[TensorDescription] = []
    outputs: list[TensorDescription] = []


class ModelCard(BaseModel):
    """OpenAI's model object."""

    id: str = Field(description="what the OpenAI-compatible routes take as `model`")
    object: Literal["model"] = "model"
    created: int = Field(description="when this gateway started (Unix seconds)")
    owned_by: str
    max_model_len: int | None = Field(default=None, description="the context: prompt and completion, in tokens")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(description="OpenAI's list: the model the OpenAI-compatible routes serve")
    models: list[ModelDescription] = Field(description="the served Triton models, their readiness and tensors")


class Status(BaseModel):
    status: str
