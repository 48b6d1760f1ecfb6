"""The settings an engine is made with, typed and checked (the Triton adapter reads them from a
model's parameters, serving/triton/engines.py)."""

from __future__ import annotations

import dataclasses

from contract.config import ModelConfig
from serving.engine.errors import EngineError

ENGINE_STATIC, ENGINE_CONCAT = "static", "concat"
ENGINES = (ENGINE_STATIC, ENGINE_CONCAT)
# Bits of the narrowest value a session engine's cache holds, by the deployment's KV dtype: fp16 (the
# static graph on CUDA; fp32 on the CPU), int8, int4 (serving/triton/repository.py picks the graph)
KV_FLOAT, KV_INT8, KV_INT4 = "float", "int8", "int4"
KV_DTYPES = (KV_FLOAT, KV_INT8, KV_INT4)
NARROWEST_CACHE_BITS = {KV_FLOAT: 16, KV_INT8: 8, KV_INT4: 4}
# The smallest row of the static engine (serving/engine/sized_pool.py): a session's first row (a 2-layer,
# 8-head fp32 model at head_dim 64: 2 MiB). Smaller rows would move short sessions more often for little gain.
MIN_ROW_POSITIONS = 256
# The most sequences one engine holds at once whatever its budget: Triton's sequence batcher keeps a
# slot per candidate sequence (serving/triton/config.py sizes them from this), and a budget of small
# rows of a small model would otherwise ask it for hundreds of thousands.
MAX_LIVE_SEQUENCES = 8192


def most_sequences(
    cfg: ModelConfig, kv_cache_bytes: int, kv_dtype: str = KV_FLOAT, smallest_row: int | None = None
) -> int:
    """The most sequences a KV budget holds at once on any placement: rows of `smallest_row` positions
    (the static engine's smallest; None: max_seq_len, as the concat engine reserves) in the narrowest
    cache of `kv_dtype`, at most MAX_LIVE_SEQUENCES. Known before the placement is, so a config
    written ahead can rely on it."""
    positions = min(smallest_row or cfg.max_seq_len, cfg.max_seq_len)
    row_bits = cfg.kv_cache_bytes(1, positions, 1) * NARROWEST_CACHE_BITS[kv_dtype]
    return min(MAX_LIVE_SEQUENCES, kv_cache_bytes * 8 // row_bits)


@dataclasses.dataclass(frozen=True)
class SessionSettings:
    """What `mha_session`'s engine is made with (its repository parameters, typed)."""

    engine: str = ENGINE_STATIC  # the slot pool over the static-cache graph, or per-sequence caches
    kv_cache_bytes: int = 2 << 30  # all sequences' caches together
    idle_timeout_seconds: float = 300.0  # a sequence idle this long loses its cache
    threads: int = 0  # ONNX Runtime intra-op threads; 0 = its default
    max_batch: int = 32  # most sequences in one execute() (the concat engine's TensorRT profile)
    # the static engine's smallest row (max_seq_len: every session reserves a full row from START)
    min_row_positions: int = MIN_ROW_POSITIONS

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise EngineError(f"unknown engine {self.engine!r}; choose {ENGINE_STATIC} or {ENGINE_CONCAT}")
        if (
            self.kv_cache_bytes <= 0
            or self.idle_timeout_seconds <= 0
            or self.threads < 0
            or self.max_batch < 1
            or self.min_row_positions < 1
        ):
            raise EngineError(f"invalid session settings: {self}")
