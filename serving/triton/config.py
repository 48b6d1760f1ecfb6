"""Triton `config.pbtxt` for every model of docs/design.md, "Triton models", generated, never hand-written.

Each config is a `model_config_pb2.ModelConfig` built from a `ModelConfig` and the naming table
(`contract.names`), written with `text_format`; a test parses each one back and checks it against
the ONNX graph its model loads.

- `forward` (python backend): stateless, the graph's inputs and outputs exactly (docs/design.md, "Tensor names")
  with the batch axis in `dims` (`max_batch_size: 0`: Triton must not add a batch axis of its own, the
  graph already has one). The mask and the past are optional: a first call leaves the past out.
- `sessions` (python backend, decoupled): Triton sequence batching hands every request to the model's
  engine core (serving/engine/core.py), which keeps each session's cache, orders and batches its requests and
  answers them from its own thread. A step sends the new tokens only, `hidden_states` [1, T, d_model] (a whole
  model's `input_ids` [1, T] int64, answered by `logits` [1, T, vocab_size]) and optionally their
  `attention_mask` [1, T]; a whole model's generations are requests to it too (contract/generation.py),
  answered a token at a time. Strategy `oldest` (`direct` fills empty batch slots with null requests that need
  answers too); `allow_ragged_batch` lets requests with different T share one execute().
- `forward_onnx` (onnxruntime backend, GPU hosts): stateless like `forward`, with the TensorRT
  accelerator in FP16 with the TensorRT options of `contract.tensorrt_options` (the engine's own).

What a deployment tunes (`ServingSettings`) and its capacity arithmetic are contract/deployment.py's:
writing or reading a config loads no engine (the launcher does both).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from contract import generation, names
from contract.config import ModelConfig
from contract.deployment import (  # noqa: F401  (MODELS, PYTHON_MODELS: re-exported for the repository)
    CPU_CACHE_BITS,
    ENGINE_STATIC,
    FEW_SESSIONS,
    KV_FLOAT,
    MAX_LIVE_SEQUENCES,
    MODELS,
    PYTHON_MODELS,
    WEIGHTS_FLOAT,
    ServingSettings,
    most_sequences,
    sequences_fitting,
    weight_bytes,
)
from contract.names import TensorSpec
from contract.tensorrt_options import Limits, provider_options

FORWARD, SESSIONS, FORWARD_ONNX = names.MODEL, names.SESSION_MODEL, names.ONNX_MODEL
TRITON_CONFIG_FILENAME = "config.pbtxt"
ONNX_BACKEND_FILENAME = "model.onnx"  # the onnxruntime backend's default_model_filename

# The module that implements each python-backend model; the shim `model.py` imports it.
MODELS_PACKAGE = __name__.rpartition(".")[0] + ".models"  # serving.triton.models, beside this module
IMPLEMENTATIONS = {
    FORWARD: f"{MODELS_PACKAGE}.forward",
    SESSIONS: f"{MODELS_PACKAGE}.sessions",
}

# Parameter keys the python models read (serving/triton/models/*.py, serving/triton/engines.py).
P_IMPLEMENTATION = "implementation"
P_ONNX_FILE = "onnx_file"  # the graph for the CPU
P_ONNX_FILE_CUDA = "onnx_file_cuda"  # the graph for ONNX Runtime's CUDA provider
P_ONNX_FILE_TENSORRT = "onnx_file_tensorrt"  # the graph for its TensorRT provider
# the inspection graph (`fp32-fused-inspect`, on the CPU): run only for a request that asks for the
# attention maps (names.ATTENTION_MAPS, names.ATTENTION_MAPS_OPERATION)
P_ONNX_FILE_INSPECT = "onnx_file_inspect"
P_THREADS = "threads"
P_KV_CACHE_BYTES = "kv_cache_bytes"
P_IDLE_TIMEOUT = "idle_timeout_seconds"
P_ENGINE = "engine"  # sessions: ENGINE_STATIC or ENGINE_CONCAT
P_MIN_ROW_POSITIONS = "min_row_positions"  # sessions (static): the smallest row
P_MAX_REQUEST_TOKENS = "max_request_tokens"  # forward: batch x new tokens one request may compute
P_MAX_BATCH = "max_batch"  # sessions: the concat engine's largest batch (its TensorRT profile)
P_STEP_TOKENS = "step_tokens"  # sessions: the engine core's tokens a step
P_KEPT_PER_OWNER = "kept_per_owner"  # sessions: rows kept for prefix reuse per owner
P_GENERATIONS_PER_OWNER = "generations_per_owner"  # sessions: an owner's generations running at once
P_TEXT_DIGEST = generation.P_TEXT_DIGEST  # sessions: the digest of its text files (none: no tokenizer)
# The model's sizes and limits, published in both python models' configs so that any caller reads the
# facts from Triton's model-config API (the session model's IO does not show its layers or cache)
MODEL_FACTS = ("d_model", "n_heads", "n_kv_heads", "head_dim", "n_layers", "max_seq_len")
WHOLE_MODEL_FACTS = ("vocab_size",)  # a whole model's, beside MODEL_FACTS
FACT_PREFIX = names.FACT_PREFIX

_FLOAT_TYPES = {"float32": pb.TYPE_FP32, "float16": pb.TYPE_FP16}


def _dims(shape: tuple[str | int, ...]) -> list[int]:
    return [-1 if isinstance(axis, str) else axis for axis in shape]


def _data_type(spec: TensorSpec, float_dtype: str) -> int:
    return pb.TYPE_INT64 if spec.is_int64 else _FLOAT_TYPES[float_dtype]


def _add_stateless_io(config: pb.ModelConfig, cfg: ModelConfig, float_dtype: str, optional: bool) -> None:
    """Every graph input and output with its full shape; the mask and past optional when `optional`."""
    for spec in names.input_specs(cfg):
        config.input.add(
            name=spec.name,
            data_type=_data_type(spec, float_dtype),
            dims=_dims(spec.shape),
            optional=optional and spec.name != names.model_input(cfg),
        )
    for spec in names.output_specs(cfg):
        config.output.add(name=spec.name, data_type=_data_type(spec, float_dtype), dims=_dims(spec.shape))


def _python_model(name: str, cfg: ModelConfig, onnx_files: dict[str, str], settings: ServingSettings) -> pb.ModelConfig:
    """`onnx_files`: file parameter (P_ONNX_FILE, P_ONNX_FILE_CUDA, P_ONNX_FILE_TENSORRT) -> file name."""
    config = pb.ModelConfig(name=name, backend="python")
    # KIND_CPU: the runner picks the GPU itself when one exists; KIND_GPU would not load on a CPU host
    config.instance_group.add(kind=pb.ModelInstanceGroup.KIND_CPU, count=1)
    _set_parameters(config, {P_IMPLEMENTATION: IMPLEMENTATIONS[name], P_THREADS: settings.threads, **onnx_files})
    facts = MODEL_FACTS + (WHOLE_MODEL_FACTS if cfg.whole else ())
    _set_parameters(config, {FACT_PREFIX + fact: getattr(cfg, fact) for fact in facts})
    return config


def _set_parameters(config: pb.ModelConfig, values: dict[str, object]) -> None:
    for key, value in values.items():
        config.parameters[key].string_value = str(value)


def _add_attention_maps(config: pb.ModelConfig, cfg: ModelConfig, batch_axis: bool) -> None:
    """The outputs `attention.{i}` (B, n_heads, T, P+T), answered only to a request that asks for them
    (a Python model may leave a declared output out); `batch_axis`: the dims carry it (max_batch_size 0)."""
    dims = [-1] * batch_axis + [cfg.n_heads, -1, -1]
    for name in names.attention_map_names(cfg.n_layers):
        config.output.add(name=name, data_type=pb.TYPE_FP32, dims=dims)


def forward_config(cfg: ModelConfig, onnx_files: dict[str, str], settings: ServingSettings) -> pb.ModelConfig:
    config = _python_model(FORWARD, cfg, onnx_files, settings)
    config.max_batch_size = 0  # the batch axis is the graph's own, in dims as -1
    _add_stateless_io(config, cfg, "float32", optional=True)
    _add_attention_maps(config, cfg, batch_axis=True)
    _set_parameters(config, {P_MAX_REQUEST_TOKENS: settings.request_tokens(cfg)})
    return config


def sessions_config(
    cfg: ModelConfig,
    onnx_files: dict[str, str],
    settings: ServingSettings,
    engine: str | None = None,
    text_files: dict[str, str] | None = None,
) -> pb.ModelConfig:
    """`engine` overrides `settings.engine` (the repository falls back to `concat` when the static
    graph could not be built for the config). A whole model's config also declares the generation's outputs;
    `text_files` (name -> sha256): the tokenizer files in its version folder, which it answers a `text_files`
    request with; their digest is published (P_TEXT_DIGEST) so that a gateway knows the files it fetched."""
    config = _python_model(SESSIONS, cfg, onnx_files, settings)
    config.max_batch_size = settings.max_batch_size  # Triton's batch axis = one row per sequence
    config.model_transaction_policy.decoupled = True  # answered from the engine core's thread, a token at a time
    ragged = {"allow_ragged_batch": True}  # requests with different T share one execute()
    new_tokens, answer = names.model_input_spec(cfg), names.model_output_spec(cfg)  # without their batch axis
    # optional: a stop, a text files request, a generation that goes on carry none (a step without them is told so)
    config.input.add(
        name=new_tokens.name,
        data_type=_data_type(new_tokens, "float32"),
        dims=_dims(new_tokens.shape[1:]),
        optional=True,
        **ragged,
    )
    config.input.add(name=names.ATTENTION_MASK, data_type=pb.TYPE_INT64, dims=[-1], optional=True, **ragged)
    config.output.add(name=answer.name, data_type=pb.TYPE_FP32, dims=_dims(answer.shape[1:]))
    config.output.add(name=names.HELD_LENGTH, data_type=pb.TYPE_INT64, dims=[1])
    # the session operations' blob: restored from at START (one, or a checkpoint's increments in order),
    # answered by a snapshot (names.OPERATION)
    config.input.add(name=names.SNAPSHOT, data_type=pb.TYPE_STRING, dims=[-1], optional=True)
    config.output.add(name=names.SNAPSHOT, data_type=pb.TYPE_STRING, dims=[1])
    _add_attention_maps(config, cfg, batch_axis=False)  # the operation names.ATTENTION_MAPS_OPERATION
    if cfg.whole:
        _add_generation_outputs(config)
    # Triton's sequence batcher keeps each session's slot from START to END (a draining server serves them until
    # they end) and hands requests over as they come; the engine core orders, batches and answers them
    batching = config.sequence_batching
    batching.max_sequence_idle_microseconds = settings.triton_idle_microseconds
    batching.oldest.max_candidate_sequences = candidate_sequences(cfg, settings)
    batching.oldest.max_queue_delay_microseconds = settings.max_queue_delay_microseconds
    parameters = {
        P_KV_CACHE_BYTES: settings.kv_cache_bytes,
        P_IDLE_TIMEOUT: f"{settings.idle_timeout_seconds:g}",
        P_ENGINE: engine or settings.engine,
        P_MIN_ROW_POSITIONS: settings.min_row_positions,
        P_MAX_BATCH: settings.max_batch_size,
        P_STEP_TOKENS: settings.step_tokens,
        P_KEPT_PER_OWNER: settings.kept_per_owner,
        P_GENERATIONS_PER_OWNER: settings.generations_per_owner,
    }
    if text_files:
        parameters[P_TEXT_DIGEST] = generation.text_digest(text_files)
    _set_parameters(config, parameters)
    return config


def _add_generation_outputs(config: pb.ModelConfig) -> None:
    """A generation's responses (contract/generation.py): a token's, the prompt's scores, the final one's, the
    tokenizer files'."""
    for name, data_type, dims in (
        (generation.TOKEN_ID, pb.TYPE_INT64, [1]),
        (generation.LOGPROB, pb.TYPE_FP32, [1]),
        (generation.TOP_TOKEN_IDS, pb.TYPE_INT64, [-1]),
        (generation.TOP_LOGPROBS, pb.TYPE_FP32, [-1]),
        (generation.FINISH_REASON, pb.TYPE_STRING, [1]),
        (generation.CACHED_TOKENS, pb.TYPE_INT64, [1]),
        (generation.PROMPT_LOGPROB, pb.TYPE_FP32, [-1]),
        (generation.PROMPT_TOP_TOKEN_IDS, pb.TYPE_INT64, [-1, -1]),
        (generation.PROMPT_TOP_LOGPROBS, pb.TYPE_FP32, [-1, -1]),
        (generation.TEXT_FILE_NAMES, pb.TYPE_STRING, [-1]),
        (generation.TEXT_FILE_CONTENTS, pb.TYPE_STRING, [-1]),
    ):
        config.output.add(name=name, data_type=data_type, dims=dims)


def capacity_lines(cfg: ModelConfig, settings: ServingSettings) -> list[str]:
    """What the `sessions` model's KV budget holds, as the repository commands print it: sequences of
    max_seq_len in the deployment's cache on the CPU (and an fp16 one on a GPU), with rows sized to
    the session how many shorter ones, and a warning when few full-length ones fit; first, the memory
    the model's weights take beside the budget (a whole model's embeddings, MLPs and head are most of it)."""
    budget, dtype = settings.kv_cache_bytes, settings.kv_dtype
    weights = weight_bytes(cfg, settings.weights_dtype)
    form = "fp32" if settings.weights_dtype == WEIGHTS_FLOAT else f"{settings.weights_dtype} projections: about"
    held = (
        f"{SESSIONS}: weights {weights / (1 << 20):.2f} MiB ({cfg.n_params():,} parameters, {form}) held beside the "
        f"KV cache budget: {(weights + budget) / (1 << 20):.2f} MiB in all"
    )
    on_cpu = sequences_fitting(cfg, budget, CPU_CACHE_BITS[dtype])
    cache = "fp32" if dtype == KV_FLOAT else dtype
    lines = [
        held,
        f"{SESSIONS}: KV cache budget {budget / (1 << 20):.0f} MiB = {on_cpu} sequences of up to {cfg.max_seq_len} "
        f"positions on the CPU ({cache})"
        + (f", {most_sequences(cfg, budget)} on a GPU (fp16)" if dtype == KV_FLOAT else ""),
    ]
    smallest = min(settings.min_row_positions, cfg.max_seq_len)
    if settings.engine == ENGINE_STATIC and smallest < cfg.max_seq_len:
        short = most_sequences(cfg, budget, smallest_row=smallest, cache_bits=CPU_CACHE_BITS[dtype])
        capped = " (the hard cap on live sequences, whatever the budget)" if short == MAX_LIVE_SEQUENCES else ""
        lines.append(
            f"{SESSIONS}: reservations sized to the session: up to {short}{capped} sequences of up to {smallest} "
            f"positions on the CPU ({cache}) at once, each reserving {smallest} positions more as it grows"
        )
    if on_cpu < FEW_SESSIONS:
        lines.append(f"warning: only {on_cpu} sessions fit at once on the CPU; raise --kv-cache-mib to hold more")
    return lines


MIN_CANDIDATE_SEQUENCES = 1024


def candidate_sequences(cfg: ModelConfig, settings: ServingSettings) -> int:
    """The sessions model's candidate sequence slots (`oldest` strategy), from the KV budget, so that the
    budget and never Triton is what turns a session away.

    Triton's sequence batcher gives a sequence a slot from its START until its END or Triton's idle
    timeout, whatever the model answered; with every slot taken it answers nothing and keeps a new
    START in a backlog until one frees (nothing else in the batcher bounds sequences). The slots held
    at once are at most: the live sequences (at most `most`, the rows the budget holds on any
    placement: contract/deployment.py), those the model evicted for idleness that Triton holds
    until its own timeout, twice the model's (they were all live one model timeout ago: at most
    `most` again), and STARTs the model refused, until their END (client/core.py sends it at once;
    a client that does not is covered up to `most` more). Three times `most`, then.
    """
    smallest = settings.min_row_positions if settings.engine == ENGINE_STATIC else None
    most = most_sequences(cfg, settings.kv_cache_bytes, settings.kv_dtype, smallest)
    return max(MIN_CANDIDATE_SEQUENCES, 4 * settings.max_batch_size, 3 * most)


def forward_onnx_config(cfg: ModelConfig, settings: ServingSettings) -> pb.ModelConfig:
    """The onnxruntime backend on a GPU: CUDA EP plus the TensorRT accelerator in FP16.

    It loads the plain `fp32` graph (see `repository.onnx_backend_variant` for why). Every input is
    required: the backend feeds the graph only what a request carries, so a first call sends a
    zero-length past and the full mask.
    """
    config = pb.ModelConfig(name=FORWARD_ONNX, backend="onnxruntime", max_batch_size=0)
    config.default_model_filename = ONNX_BACKEND_FILENAME
    _add_stateless_io(config, cfg, "float32", optional=False)
    config.instance_group.add(kind=pb.ModelInstanceGroup.KIND_GPU, count=1)
    cache = f"{settings.trt_cache_dir.rstrip('/')}/{FORWARD_ONNX}"
    options = provider_options(cfg, Limits(), cache_path=cache, fp16=True)
    config.optimization.CopyFrom(triton_optimization(options))
    return config


# ORT option -> Triton onnxruntime-backend parameter, where Triton names it differently.
_TRITON_KEYS = {"trt_max_workspace_size": "max_workspace_size_bytes"}


def triton_optimization(options: dict[str, Any]) -> pb.ModelOptimizationPolicy:
    """ONNX Runtime's TensorRT options as a Triton `ModelOptimizationPolicy` (onnxruntime backend)."""
    policy = pb.ModelOptimizationPolicy()
    accelerator = policy.execution_accelerators.gpu_execution_accelerator.add(name="tensorrt")
    for key, value in options.items():
        if key == "trt_fp16_enable":
            accelerator.parameters["precision_mode"] = "FP16" if value else "FP32"
        else:
            accelerator.parameters[_TRITON_KEYS.get(key, key)] = _triton_value(value)
    return policy


def _triton_value(value: Any) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def model_configs(
    cfg: ModelConfig, onnx_files: dict[str, dict[str, str]], settings: ServingSettings, engine: str | None = None
) -> dict[str, pb.ModelConfig]:
    """Every model's config; `onnx_files[model]` are the python models' file parameters."""
    return {
        FORWARD: forward_config(cfg, onnx_files[FORWARD], settings),
        SESSIONS: sessions_config(cfg, onnx_files[SESSIONS], settings, engine),
        FORWARD_ONNX: forward_onnx_config(cfg, settings),
    }


def to_text(config: pb.ModelConfig) -> str:
    return text_format.MessageToString(config)


def parse(text: str) -> pb.ModelConfig:
    """A config.pbtxt as Triton reads it (raises text_format.ParseError on anything Triton would refuse)."""
    return text_format.Parse(text, pb.ModelConfig())


def parameter(config: pb.ModelConfig, key: str) -> str:
    return config.parameters[key].string_value
