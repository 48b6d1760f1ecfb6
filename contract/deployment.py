"""What a deployment is made with, stated once for the rooms that read it: the repository commands and
Triton's config generator (serving/triton/), the launcher that reports capacity (serving/host/) and
the engine inside Triton (serving/engine/settings.py makes its load-time errors of these). Plain data
and arithmetic: reading them loads no engine.
"""

from __future__ import annotations

import dataclasses

from contract import names
from contract.config import ModelConfig

# Where a graph runs (serving/engine/placement.py) and what kind of host a build makes graphs for
# (export/choices.py): the CPU, CUDA, and TensorRT (with CUDA for what its engines leave out). "cpu" and
# "cuda" are also ONNX Runtime's device names, where tensors live (serving/engine/ort.py).
CPU, CUDA, TENSORRT = "cpu", "cuda", "tensorrt"
HOST_KINDS = (CPU, CUDA, TENSORRT)
# The models a repository holds: the stateless and session python models, and the onnxruntime backend's
MODELS = (names.MODEL, names.SESSION_MODEL, names.ONNX_MODEL)
PYTHON_MODELS = (names.MODEL, names.SESSION_MODEL)
ENGINE_STATIC, ENGINE_CONCAT = "static", "concat"
ENGINES = (ENGINE_STATIC, ENGINE_CONCAT)
# The session operations (contract.names.OPERATIONS) each engine offers: its class declares them from here
# (serving/engine/steps.py StepEngine.OPERATIONS), and a repository writes them into the sessions model's config
# without loading an engine. Both offer all of them: the concat engine's cache is host arrays it copies.
ENGINE_OPERATIONS = {ENGINE_STATIC: names.OPERATIONS, ENGINE_CONCAT: names.OPERATIONS}
# A session engine's cache values by the deployment's KV dtype: the graph's float (fp32 on the CPU,
# fp16 with the static graph on CUDA), int8, int4 (serving/triton/repository.py picks the graph)
KV_FLOAT, KV_INT8, KV_INT4 = "float", "int8", "int4"
KV_DTYPES = (KV_FLOAT, KV_INT8, KV_INT4)
# The projections' weights of the graphs served: the graph's float, or int8 (fp32-fused-int8w for `forward`,
# fp32-static-int8w for the `sessions` model's static engine, CPU only): a quarter of the bytes a decode step reads
WEIGHTS_FLOAT, WEIGHTS_INT8, WEIGHTS_INT4 = "float", "int8", "int4"
WEIGHT_DTYPES = (WEIGHTS_FLOAT, WEIGHTS_INT8, WEIGHTS_INT4)
# bits a quantized projection's weight takes with its scales: int8 per output channel (a scale a row: none a
# weight), int4 in blocks of 32 with an fp32 scale each (export/weights_int8.py, weights_int4.py)
WEIGHT_BITS = {WEIGHTS_INT8: 8.0, WEIGHTS_INT4: 4.0 + 32 / 32}
NARROWEST_CACHE_BITS = {KV_FLOAT: 16, KV_INT8: 8, KV_INT4: 4}  # on any placement
CPU_CACHE_BITS = {KV_FLOAT: 32, KV_INT8: 8, KV_INT4: 4}
# The static engine's reservation granule (serving/engine/cache_manager.py): what a session reserves at its
# start and adds each time it outgrows its reservation (a 2-layer, 8-head fp32 model at head_dim 64: 2 MiB).
MIN_ROW_POSITIONS = 256
# The most sequences one engine holds at once whatever its budget: Triton's sequence batcher keeps a
# slot per candidate sequence (serving/triton/config.py sizes them from this), and a budget of small
# rows of a small model would otherwise ask it for hundreds of thousands.
MAX_LIVE_SEQUENCES = 8192
# Fewer full-length sessions than this at once is worth a warning: the next caller is refused (503) behind them.
FEW_SESSIONS = 4


def weight_bytes(cfg: ModelConfig, weights_dtype: str = WEIGHTS_FLOAT) -> int:
    """About the bytes a served graph's weights take: fp32, or every projection (a whole model's MLPs and head too)
    in WEIGHT_BITS with the token table kept in fp32 for its Gather (a tied head is a quantized copy of it)."""
    if weights_dtype == WEIGHTS_FLOAT:
        return cfg.n_params() * 4
    table = cfg.vocab_size * cfg.d_model if cfg.whole else 0
    projections = cfg.n_params() - table + (table if cfg.tie_embeddings else 0)
    return int(table * 4 + projections * WEIGHT_BITS[weights_dtype] / 8)


def sequences_fitting(cfg: ModelConfig, kv_cache_bytes: int, cache_bits: int, positions: int | None = None) -> int:
    """How many rows of `positions` (None: max_seq_len) a KV budget holds in values of `cache_bits` bits."""
    row_bits = cfg.kv_cache_bytes(1, min(positions or cfg.max_seq_len, cfg.max_seq_len), 1) * cache_bits
    return kv_cache_bytes * 8 // row_bits


def most_sequences(
    cfg: ModelConfig,
    kv_cache_bytes: int,
    kv_dtype: str = KV_FLOAT,
    smallest_row: int | None = None,
    cache_bits: int | None = None,
) -> int:
    """The most sequences a KV budget holds at once: rows of `smallest_row` positions (the static
    engine's smallest; None: max_seq_len, as the concat engine reserves) in values of `cache_bits`
    (None: the narrowest cache of `kv_dtype` on any placement), at most MAX_LIVE_SEQUENCES. Known
    before the placement is, so a config written ahead can rely on it."""
    bits = cache_bits or NARROWEST_CACHE_BITS[kv_dtype]
    return min(MAX_LIVE_SEQUENCES, sequences_fitting(cfg, kv_cache_bytes, bits, smallest_row))


def request_tokens(cfg: ModelConfig, max_request_tokens: int | None = None) -> int:
    """The stateless model's cap on batch x new tokens of one request: the setting, else max_seq_len. A
    request's attention scores grow with its tokens times its length: 12,000 tokens took a stub to 6.6 GB."""
    return max_request_tokens or cfg.max_seq_len


@dataclasses.dataclass(frozen=True)
class SessionSettings:
    """What the `sessions` model's engine is made with (its repository parameters, typed); a wrong value is a
    ValueError naming it."""

    engine: str = ENGINE_STATIC  # the slot pool over the static-cache graph, or per-sequence caches
    kv_cache_bytes: int = 2 << 30  # all sequences' caches together
    idle_timeout_seconds: float = 300.0  # a sequence idle this long loses its cache
    threads: int = 0  # ONNX Runtime intra-op threads; 0 = its default
    max_batch: int = 32  # most sequences in one execute() (the concat engine's TensorRT profile)
    # the static engine's smallest row (max_seq_len: every session reserves a full row from START)
    min_row_positions: int = MIN_ROW_POSITIONS
    # the engine core's (serving/engine/core.py): new tokens one step of the loop runs (every decoding row's,
    # then prompt chunks: a joining prompt holds the decoders up for at most one chunk of what is left), rows
    # kept for prefix reuse per owner, and an owner's generations running at once (more wait their turn)
    step_tokens: int = 256
    kept_per_owner: int = 8
    generations_per_owner: int = 16

    def __post_init__(self) -> None:
        if self.step_tokens < 1 or self.kept_per_owner < 0 or self.generations_per_owner < 0:
            raise ValueError(f"need step_tokens >= 1, kept_per_owner >= 0 and generations_per_owner >= 0, got {self}")
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; choose {ENGINE_STATIC} or {ENGINE_CONCAT}")
        if (
            self.kv_cache_bytes <= 0
            or self.idle_timeout_seconds <= 0
            or self.threads < 0
            or self.max_batch < 1
            or self.min_row_positions < 1
        ):
            raise ValueError(f"invalid session settings: {self}")


_SESSION = SessionSettings()


@dataclasses.dataclass(frozen=True)
class ServingSettings:
    """What a deployment tunes; everything else in Triton's configs follows from the ModelConfig."""

    # the engine's (SessionSettings): threads (0 = ONNX Runtime's default), the KV budget of all
    # sequences together, the idle timeout after which a sequence loses its cache (Triton forgets the
    # sequence after twice this, so a late step first meets our precise "evicted" error rather than
    # Triton's generic one), the most sequences stepped in one execute()
    threads: int = _SESSION.threads
    kv_cache_bytes: int = _SESSION.kv_cache_bytes
    idle_timeout_seconds: float = _SESSION.idle_timeout_seconds
    max_batch_size: int = _SESSION.max_batch
    max_queue_delay_microseconds: int = 0  # batch what queued while the model was busy; never wait
    trt_cache_dir: str = "/tmp/triton-trt-cache"  # forward_onnx: TensorRT engine cache (must be writable)
    engine: str = _SESSION.engine  # sessions: the static slot pool, or per-sequence caches
    max_request_tokens: int | None = None  # forward: see `request_tokens` (None: the config's max_seq_len)
    # sessions (static): the cache's values, float (the graph's float: fp32 on the CPU, fp16 on CUDA)
    # or int8/int4 (the quantized static graphs, CPU), and the smallest row a session starts in
    kv_dtype: str = KV_FLOAT
    min_row_positions: int = _SESSION.min_row_positions
    weights_dtype: str = WEIGHTS_FLOAT  # both python models: the projections' weights (WEIGHT_DTYPES)
    step_tokens: int = _SESSION.step_tokens  # sessions: the engine core's (SessionSettings)
    kept_per_owner: int = _SESSION.kept_per_owner
    generations_per_owner: int = _SESSION.generations_per_owner

    def __post_init__(self) -> None:
        self.session()  # the engine's checks, once
        if self.max_request_tokens is not None and self.max_request_tokens < 1:
            raise ValueError(f"max_request_tokens must be at least 1, got {self.max_request_tokens}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {list(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.weights_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weights_dtype must be one of {list(WEIGHT_DTYPES)}, got {self.weights_dtype!r}")
        if self.weights_dtype != WEIGHTS_FLOAT and self.kv_dtype != KV_FLOAT:
            raise ValueError(
                f"weights_dtype {self.weights_dtype} with kv_dtype {self.kv_dtype}: no graph holds both quantized "
                "weights and a quantized cache; choose one"
            )

    def session(self) -> SessionSettings:
        """The settings the `sessions` model's engine is made with from these."""
        return SessionSettings(
            self.engine,
            self.kv_cache_bytes,
            self.idle_timeout_seconds,
            self.threads,
            self.max_batch_size,
            self.min_row_positions,
            self.step_tokens,
            self.kept_per_owner,
            self.generations_per_owner,
        )

    def request_tokens(self, cfg: ModelConfig) -> int:
        return request_tokens(cfg, self.max_request_tokens)

    @property
    def triton_idle_microseconds(self) -> int:
        return int(2 * self.idle_timeout_seconds * 1e6)
