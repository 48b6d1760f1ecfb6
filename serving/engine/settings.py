"""The settings an engine is made with, typed and checked (the Triton adapter reads them from a
model's parameters, serving/triton/engines.py)."""

from __future__ import annotations

import dataclasses

from contract.config import ModelConfig
from serving.engine.errors import EngineError

ENGINE_STATIC, ENGINE_CONCAT = "static", "concat"
ENGINES = (ENGINE_STATIC, ENGINE_CONCAT)
# Bytes of the narrowest float a session engine's cache holds: fp16 (the static graph on CUDA); fp32 on the CPU
NARROWEST_CACHE_ITEMSIZE = 2


def most_sequences(cfg: ModelConfig, kv_cache_bytes: int) -> int:
    """The most sequences a KV budget holds at once on any placement: rows of max_seq_len positions
    in the narrowest cache float (fp16 on CUDA holds twice the rows of fp32 on the CPU; the concat
    engine counts fp32). Known before the placement is, so a config written ahead can rely on it."""
    return kv_cache_bytes // cfg.kv_cache_bytes(1, cfg.max_seq_len, NARROWEST_CACHE_ITEMSIZE)


@dataclasses.dataclass(frozen=True)
class SessionSettings:
    """What `mha_session`'s engine is made with (its repository parameters, typed)."""

    engine: str = ENGINE_STATIC  # the slot pool over the static-cache graph, or per-sequence caches
    kv_cache_bytes: int = 2 << 30  # all sequences' caches together
    idle_timeout_seconds: float = 300.0  # a sequence idle this long loses its cache
    threads: int = 0  # ONNX Runtime intra-op threads; 0 = its default
    max_batch: int = 32  # most sequences in one execute() (the concat engine's TensorRT profile)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise EngineError(f"unknown engine {self.engine!r}; choose {ENGINE_STATIC} or {ENGINE_CONCAT}")
        if self.kv_cache_bytes <= 0 or self.idle_timeout_seconds <= 0 or self.threads < 0 or self.max_batch < 1:
            raise EngineError(f"invalid session settings: {self}")
