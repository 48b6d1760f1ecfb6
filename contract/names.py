"""The one naming table: graph tensor names and axis names (docs/design.md, "Tensor names").

Export, Triton config generation, the runner, the client and the tests all import these; nobody
spells a tensor name by hand. Pure Python, no third-party dependencies.
"""

from __future__ import annotations

import dataclasses

from contract.config import ModelConfig

# The Triton models of a repository (docs/design.md, "Triton models"): the stateless one (one forward pass
# a request), the session one (the sessions it keeps, and what it generates for them), and the native
# onnxruntime one of GPU hosts. Every default that names a model names these.
MODEL, SESSION_MODEL, ONNX_MODEL = "forward", "sessions", "forward_onnx"
# What they were called until the names said what they serve (they served whole decoders as `mha`):
# a repository, a setting or a client may still hold these, and is taken to mean the new ones
LEGACY_MODEL_NAMES = {"mha": MODEL, "mha_session": SESSION_MODEL, "mha_onnx": ONNX_MODEL}


def current_model_name(name: str) -> str:
    """`name` with a legacy model name (LEGACY_MODEL_NAMES) replaced by today's, a model set's prefix kept
    (`fortunes_mha_session` is `fortunes_sessions`); any other name as it is. A prefix is read before the two
    names no one else's model ends in (`_mha_session`, `_mha_onnx`), never before `_mha` (`bert_mha` may be
    somebody's own model)."""
    if name in LEGACY_MODEL_NAMES:
        return LEGACY_MODEL_NAMES[name]
    for legacy in ("mha_session", "mha_onnx"):
        if name.endswith(f"_{legacy}"):
            return name.removesuffix(legacy) + LEGACY_MODEL_NAMES[legacy]
    return name


def legacy_model_name(name: str) -> str | None:
    """The name a repository written before held today's model `name` under (`fortunes_sessions`:
    `fortunes_mha_session`); None for a name `current_model_name` gives no legacy name of."""
    for legacy, current in LEGACY_MODEL_NAMES.items():
        old = name.removesuffix(current) + legacy
        if name.endswith(current) and current_model_name(old) == name:
            return old
    return None


# Triton config parameters that carry a model fact (`model.d_model`, ...): written by the config
# generator, read by the client's metadata
FACT_PREFIX = "model."

HIDDEN_STATES = "hidden_states"
# A whole decoder's (ModelConfig.whole): token ids (B, T) int64 in, logits (B, T, vocab_size) out, where an
# attention model takes hidden states and answers `output`
INPUT_IDS = "input_ids"
LOGITS = "logits"
ATTENTION_MASK = "attention_mask"
# the new tokens' positions (B, T) int64, for models that rotate q and k by position (RoPE); optional
# for a caller: counted from the attention mask when left out
POSITION_IDS = "position_ids"
OUTPUT = "output"
# the session model's second output: positions the sequence holds after the step (-1 once it ended),
# so that whoever steps a session learns its length from the server, not from its own count
HELD_LENGTH = "held_length"
# The session model's operations on a whole session (docs/design.md, "Session operations"): asked by
# a request parameter on the session's sequence; `SNAPSHOT` is the blob, a BYTES input to restore at
# START (one blob, or a checkpoint's increments in order) and a BYTES output of a snapshot.
SNAPSHOT = "snapshot"
OPERATION = "session_operation"  # request parameter: one of OPERATIONS
# request parameter (a bool) of an `sessions` step: true answers only the last real position's output
# (1, 1, width), as a prompt chunk of a generation loop needs; a whole model's static engine then computes
# no logits but that position's (kv_pool.last_logits_graph). Absent or false: every position's (1, T, width)
LAST_ONLY = "last_only"
SNAPSHOT_OPERATION, RESTORE, FORK, REWIND = "snapshot", "restore", "fork", "rewind"
# named prefixes: put (its tokens prefilled once), a session started from one, delete
PUT_PREFIX, FROM_PREFIX, DELETE_PREFIX = "put_prefix", "from_prefix", "delete_prefix"
# the attention maps of a session's next step, the session unchanged (its tokens are not kept)
ATTENTION_MAPS_OPERATION = "attention_maps"
OPERATIONS = (
    SNAPSHOT_OPERATION,
    RESTORE,
    FORK,
    REWIND,
    PUT_PREFIX,
    FROM_PREFIX,
    DELETE_PREFIX,
    ATTENTION_MAPS_OPERATION,
)
PREFIX = "prefix"  # request parameter of the prefix operations: its name
FORK_OF = "fork_of"  # request parameter of a fork: the sequence id forked (the request STARTs the new one)
REWIND_TO = "rewind_to"  # request parameter of a rewind: the positions the session keeps
# request parameter of a snapshot: its first position (a durable session's checkpoint writes only the
# positions added since the one before; 0 or absent: the whole cache)
SNAPSHOT_SINCE = "snapshot_since"
# request parameter of `forward` (stateless) and `sessions` (the operation ATTENTION_MAPS_OPERATION): true
# asks for each layer's attention weights as the outputs `attention.{i}` (attention_map_name)
ATTENTION_MAPS = "attention_maps"
OWNER = "owner"  # request parameter of a snapshot and a restore: who may restore the blob (the gateway's)

BATCH = "batch_size"
SEQUENCE = "sequence_length"
PAST_SEQUENCE = "past_sequence_length"
TOTAL_SEQUENCE = "past_sequence_length + sequence_length"

# The static-cache graphs (`fp32-static`, `fp16-static`): per layer one buffer of `CACHE_LENGTH`
# positions per row that is both the past and the present (written in place at each row's length).
# The two length inputs are the ones `com.microsoft.GroupQueryAttention` takes, named as
# onnxruntime-genai names them: SEQLENS_K[b] = row b's length after the step minus one, and
# TOTAL_SEQUENCE_LENGTH = the longest row's length after the step (a scalar).
SEQLENS_K = "seqlens_k"
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"
CACHE_LENGTH = "cache_length"

KEY = "key"
VALUE = "value"
KV_KINDS = (KEY, VALUE)

# A static form's caches may be quantized (`fp32-static-int8kv`, `fp32-static-int4kv`): GroupQueryAttention
# stores int8 codes, or int4 codes two a byte in uint8 (so a position is head_dim / 2 bytes wide), and
# reads each layer's scales from the graph's initializers `kv_scale.{i}.key` / `.value`.
INT8_CACHE, INT4_CACHE = "int8", "int4"
CACHE_BITS = {INT8_CACHE: 8, INT4_CACHE: 4}
CACHE_ELEMENT = {INT8_CACHE: "int8", INT4_CACHE: "uint8"}  # the element type a quantized cache is stored in


def past_name(layer: int, kind: str) -> str:
    """`past_key_values.{i}.key` / `.value`: the cache a caller passes in."""
    assert kind in KV_KINDS, kind
    return f"past_key_values.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    """`present.{i}.key` / `.value`: the cache the model returns, one position longer per token."""
    assert kind in KV_KINDS, kind
    return f"present.{layer}.{kind}"


def attention_map_name(layer: int) -> str:
    """`attention.{i}`: one layer's attention weights (B, n_heads, T, P+T), an output of the inspection
    graph (`fp32-fused-inspect`) that `forward` and `sessions` answer when a request asks for the maps
    (`ATTENTION_MAPS`)."""
    return f"attention.{layer}"


def attention_map_names(n_layers: int) -> list[str]:
    return [attention_map_name(i) for i in range(n_layers)]


# the build variant whose graph returns the maps (export/build.py), served beside the others
INSPECTION_VARIANT = "fp32-fused-inspect"


def past_names(n_layers: int) -> list[str]:
    return [past_name(i, kind) for i in range(n_layers) for kind in KV_KINDS]


def present_names(n_layers: int) -> list[str]:
    return [present_name(i, kind) for i in range(n_layers) for kind in KV_KINDS]


def cache_scale_name(layer: int, kind: str) -> str:
    """`kv_scale.{i}.key` / `.value`: the scales of a quantized static cache, initializers of its graph."""
    assert kind in KV_KINDS, kind
    return f"kv_scale.{layer}.{kind}"


def cache_width(head_dim: int, quantized: str | None = None) -> int:
    """The last axis of a static cache: head_dim values, or head_dim / 2 bytes of two int4 codes each."""
    return head_dim // 2 if quantized == INT4_CACHE else head_dim


def model_input(cfg: Sizes) -> str:
    """The graph's first input: `input_ids` of a whole model, `hidden_states` of an attention model."""
    return INPUT_IDS if cfg.vocab_size is not None else HIDDEN_STATES


def model_output(cfg: Sizes) -> str:
    """The graph's first output: `logits` of a whole model, `output` of an attention model."""
    return LOGITS if cfg.vocab_size is not None else OUTPUT


def input_names(cfg: Sizes) -> list[str]:
    """Stateless graph inputs, in graph order (`position_ids` only for a model that places tokens by it)."""
    return [spec.name for spec in input_specs(cfg)]


def output_names(cfg: Sizes) -> list[str]:
    """Stateless graph outputs, in graph order."""
    return [model_output(cfg), *present_names(cfg.n_layers)]


@dataclasses.dataclass(frozen=True)
class GraphSizes:
    """The sizes a graph's tensors are made of: all the specs below need. A ModelConfig has them too;
    a client that reads a served model's metadata has these and no more (the head count is not in
    the graph's IO)."""

    d_model: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    rotary: bool = False  # the graph takes position_ids
    vocab_size: int | None = None  # a whole model's: input_ids in, logits out

    @property
    def positioned(self) -> bool:
        return self.rotary


Sizes = GraphSizes | ModelConfig


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A graph tensor: its name, its shape (axis names for dynamic axes, ints for fixed ones),
    and whether it carries the model's float dtype or int64."""

    name: str
    shape: tuple[str | int, ...]
    is_mask: bool = False
    is_length: bool = False  # an int32 length of the static-cache graphs
    is_position: bool = False  # int64 positions
    is_token: bool = False  # int64 token ids
    quantized: str | None = None  # a static cache stored as INT8_CACHE or INT4_CACHE codes, not the model's float

    @property
    def is_int64(self) -> bool:
        return self.is_mask or self.is_position or self.is_token

    @property
    def dynamic_axes(self) -> dict[int, str]:
        return {i: axis for i, axis in enumerate(self.shape) if isinstance(axis, str)}


def model_input_spec(cfg: Sizes) -> TensorSpec:
    """The new tokens: their ids (B, T) for a whole model, their hidden states (B, T, d_model) otherwise."""
    if cfg.vocab_size is not None:
        return TensorSpec(INPUT_IDS, (BATCH, SEQUENCE), is_token=True)
    return TensorSpec(HIDDEN_STATES, (BATCH, SEQUENCE, cfg.d_model))


def model_output_spec(cfg: Sizes) -> TensorSpec:
    """The new tokens' logits (B, T, vocab_size) for a whole model, hidden states (B, T, d_model) otherwise."""
    if cfg.vocab_size is not None:
        return TensorSpec(LOGITS, (BATCH, SEQUENCE, cfg.vocab_size))
    return TensorSpec(OUTPUT, (BATCH, SEQUENCE, cfg.d_model))


def input_specs(cfg: Sizes) -> list[TensorSpec]:
    """Stateless graph inputs, in graph order."""
    cache_shape = (BATCH, cfg.n_kv_heads, PAST_SEQUENCE, cfg.head_dim)
    positions = [TensorSpec(POSITION_IDS, (BATCH, SEQUENCE), is_position=True)] if cfg.positioned else []
    return [
        model_input_spec(cfg),
        TensorSpec(ATTENTION_MASK, (BATCH, TOTAL_SEQUENCE), is_mask=True),
        *positions,
        *(TensorSpec(name, cache_shape) for name in past_names(cfg.n_layers)),
    ]


def output_specs(cfg: Sizes) -> list[TensorSpec]:
    """Stateless graph outputs, in graph order."""
    cache_shape = (BATCH, cfg.n_kv_heads, TOTAL_SEQUENCE, cfg.head_dim)
    return [model_output_spec(cfg), *(TensorSpec(name, cache_shape) for name in present_names(cfg.n_layers))]


def static_input_specs(cfg: ModelConfig, quantized: str | None = None) -> list[TensorSpec]:
    """Static-cache graph inputs, in graph order: the new tokens, the lengths, the cache buffers (in the
    model's float, or `quantized` codes)."""
    cache_shape = (BATCH, cfg.n_kv_heads, CACHE_LENGTH, cache_width(cfg.head_dim, quantized))
    positions = [TensorSpec(POSITION_IDS, (BATCH, SEQUENCE), is_position=True)] if cfg.learned_positions else []
    return [
        model_input_spec(cfg),
        *positions,
        TensorSpec(SEQLENS_K, (BATCH,), is_length=True),
        TensorSpec(TOTAL_SEQUENCE_LENGTH, (), is_length=True),
        *(TensorSpec(name, cache_shape, quantized=quantized) for name in past_names(cfg.n_layers)),
    ]


def static_output_specs(cfg: ModelConfig, quantized: str | None = None) -> list[TensorSpec]:
    """Static-cache graph outputs: each present is its past's buffer, updated in place."""
    cache_shape = (BATCH, cfg.n_kv_heads, CACHE_LENGTH, cache_width(cfg.head_dim, quantized))
    return [
        model_output_spec(cfg),
        *(TensorSpec(name, cache_shape, quantized=quantized) for name in present_names(cfg.n_layers)),
    ]


def layer_count(names: list[str] | tuple[str, ...]) -> int:
    """Number of layers implied by a list of tensor names (counts past or present keys)."""
    keys = {n for n in names if n.endswith(f".{KEY}") and n.startswith(("past_key_values.", "present."))}
    layers = {int(n.split(".")[1]) for n in keys}
    assert layers == set(range(len(layers))), f"layers are not numbered 0..n-1: {sorted(layers)}"
    return len(layers)
