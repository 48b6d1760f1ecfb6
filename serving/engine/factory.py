"""The engines the served models run, made from a model's ONNX files and typed settings: the
stateless runner of `mha` and the session engine of `mha_session` (static or concat). What Triton's
parameters say is read by the Triton adapter (serving/triton/engines.py), not here.

`files` maps a placement kind (placement.py: tensorrt, cuda, cpu) to the model's ONNX file for it;
the placement chosen at load (TensorRT, CUDA, CPU, whichever is usable here) picks the file.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from contract.config import ModelConfig
from contract.files import sha256
from serving.engine import snapshots, tensorrt
from serving.engine.concat_engine import ConcatSessionEngine
from serving.engine.errors import EngineError
from serving.engine.kv_cache import KVCacheStore
from serving.engine.kv_pool import KVPool
from serving.engine.ort import CUDA, session_float_dtype
from serving.engine.placement import Placement, choose_placement, model_file, open_session
from serving.engine.runner import Runner
from serving.engine.settings import ENGINE_STATIC, SessionSettings, most_sequences
from serving.engine.static_engine import StaticSessionEngine

SessionEngines = StaticSessionEngine | ConcatSessionEngine


def trt_cache(model_name: str) -> Path:
    return Path(tempfile.gettempdir()) / "attention-serving-trt" / model_name


def stateless_runner(files: Mapping[str, Path], cfg: ModelConfig, threads: int, model_name: str) -> Runner:
    placement = choose_placement(cfg, tensorrt.Limits(), trt_cache(model_name))
    return Runner(model_file(files, placement), cfg, threads=threads, placement=placement)


def session_engine(
    files: Mapping[str, Path], cfg: ModelConfig, settings: SessionSettings, model_name: str
) -> SessionEngines:
    """`mha_session`'s engine as `settings` ask."""
    idle, budget, threads = settings.idle_timeout_seconds, settings.kv_cache_bytes, settings.threads
    if settings.engine == ENGINE_STATIC:
        pool, notes = static_pool(files, cfg, budget, threads, model_name)
        description = "; ".join([f"static engine, {pool.description}", *notes])
        return StaticSessionEngine(pool, idle_timeout=idle, description=description)
    placement = choose_placement(cfg, tensorrt.Limits(max_batch=settings.max_batch), trt_cache(model_name))
    runner = Runner(model_file(files, placement), cfg, threads=threads, placement=placement)
    store = KVCacheStore(
        bytes_per_position=cfg.kv_cache_bytes(batch=1, length=1),
        max_positions=cfg.max_seq_len,
        budget_bytes=budget,
        idle_timeout=idle,
    )
    return ConcatSessionEngine(runner, store)


def static_pool(
    files: Mapping[str, Path], cfg: ModelConfig, budget: int, threads: int, model_name: str
) -> tuple[KVPool, list[str]]:
    """The slot pool on the best device; on CUDA with ONNX Runtime's CUDA graphs when a probe of them
    works (decode steps are launch-bound on a GPU), else without (the reason goes to the log)."""
    placement = choose_placement(cfg, tensorrt.Limits(), trt_cache(model_name), allow_tensorrt=False, cuda_graphs=True)
    if placement.kind == CUDA:
        try:
            return _probed(_pool(files, cfg, budget, threads, placement)), placement.notes
        except Exception as error:  # the plain CUDA session still serves
            placement = choose_placement(cfg, tensorrt.Limits(), trt_cache(model_name), allow_tensorrt=False)
            placement.notes.append(f"CUDA graphs off: their probe failed ({type(error).__name__}: {error})")
    return _pool(files, cfg, budget, threads, placement), placement.notes


def _pool(files: Mapping[str, Path], cfg: ModelConfig, budget: int, threads: int, placement: Placement) -> KVPool:
    path = model_file(files, placement)
    session = open_session(path, placement, threads)
    pool = KVPool(session, cfg, rows=pool_rows(cfg, budget, session), capacity=cfg.max_seq_len)
    pool.description = f"{path.name} on {session.get_providers()[0]} (caches on {pool.device})"
    pool.identity = snapshots.fingerprint(cfg, pool.dtype, path.name, sha256(path))
    return pool


def _probed(pool: KVPool) -> KVPool:
    """Three decode steps of row 0 (a plain run, the capture, a replay), then the row emptied again."""
    token = np.zeros((1, pool.cfg.d_model), pool.dtype)
    for _ in range(3):
        output = pool.run({0: token})[0]
        if isinstance(output, Exception):
            raise output
        if not np.isfinite(output).all():
            raise RuntimeError("a CUDA graph replay gave a non-finite output")
    pool.reset(0)
    return pool


def describe(engine: SessionEngines) -> str:
    """What an engine runs and where (the models log it at load)."""
    if isinstance(engine, StaticSessionEngine):
        return engine.description
    return f"concat engine, {engine.runner.description}"


def pool_rows(cfg: ModelConfig, budget_bytes: int, session) -> int:
    """Slots the KV budget holds: rows of max_seq_len positions in the graph's dtype (each row also
    has one scratch position, kv_pool.py, outside the budget's count)."""
    row = cfg.kv_cache_bytes(1, cfg.max_seq_len, np.dtype(session_float_dtype(session)).itemsize)
    rows = budget_bytes // row
    # Triton's sequence slots were sized from this bound before the placement was known (serving/triton/config.py)
    assert rows <= most_sequences(cfg, budget_bytes), f"a {row}-byte row is narrower than the bound assumes"
    if rows < 1:
        raise EngineError(
            f"the KV cache budget of {budget_bytes} bytes holds no sequence of max_seq_len {cfg.max_seq_len} "
            f"({row} bytes each); raise kv_cache_bytes"
        )
    return rows
