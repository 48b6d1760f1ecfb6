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
from serving.engine.ort import CUDA
from serving.engine.placement import Placement, choose_placement, model_file, open_session
from serving.engine.runner import InspectionRunner, Runner
from serving.engine.settings import ENGINE_STATIC, MAX_LIVE_SEQUENCES, SessionSettings
from serving.engine.sized_pool import SizedPool, row_sizes
from serving.engine.static_engine import StaticSessionEngine

SessionEngines = StaticSessionEngine | ConcatSessionEngine


def trt_cache(model_name: str) -> Path:
    return Path(tempfile.gettempdir()) / "attention-serving-trt" / model_name


def stateless_runner(files: Mapping[str, Path], cfg: ModelConfig, threads: int, model_name: str) -> Runner:
    placement = choose_placement(cfg, tensorrt.Limits(), trt_cache(model_name))
    return Runner(model_file(files, placement), cfg, threads=threads, placement=placement)


def inspection_runner(path: Path | None, cfg: ModelConfig, threads: int) -> InspectionRunner:
    """The graph that answers attention maps (None: the deployment has none); opened at first use."""
    return InspectionRunner(path, cfg, threads)


def session_engine(
    files: Mapping[str, Path],
    cfg: ModelConfig,
    settings: SessionSettings,
    model_name: str,
    inspection: Path | None = None,
) -> SessionEngines:
    """`mha_session`'s engine as `settings` ask; `inspection`: the graph its attention maps come from."""
    idle, budget, threads = settings.idle_timeout_seconds, settings.kv_cache_bytes, settings.threads
    if settings.engine == ENGINE_STATIC:
        pool, notes = static_pool(files, cfg, settings, model_name)
        description = "; ".join([f"static engine, {pool.description}", *notes])
        maps = inspection_runner(inspection, cfg, threads)
        return StaticSessionEngine(pool, idle_timeout=idle, description=description, inspection=maps)
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
    files: Mapping[str, Path], cfg: ModelConfig, settings: SessionSettings, model_name: str
) -> tuple[SizedPool, list[str]]:
    """The rows on the best device; on CUDA with ONNX Runtime's CUDA graphs when a probe of them works
    (decode steps are launch-bound on a GPU; the pool is then one slab of full rows), else without
    (the reason goes to the log) and sized to the session as on the CPU."""
    placement = choose_placement(cfg, tensorrt.Limits(), trt_cache(model_name), allow_tensorrt=False, cuda_graphs=True)
    if placement.kind == CUDA:
        try:
            whole = _probed(_whole_pool(files, cfg, settings, placement))
            return SizedPool.whole(whole), placement.notes
        except Exception as error:  # the plain CUDA session still serves
            placement = choose_placement(cfg, tensorrt.Limits(), trt_cache(model_name), allow_tensorrt=False)
            placement.notes.append(f"CUDA graphs off: their probe failed ({type(error).__name__}: {error})")
    return _sized_pool(files, cfg, settings, placement), placement.notes


def _sized_pool(
    files: Mapping[str, Path], cfg: ModelConfig, settings: SessionSettings, placement: Placement
) -> SizedPool:
    path = model_file(files, placement)
    session = open_session(path, placement, settings.threads)
    sizes = row_sizes(cfg.max_seq_len, min(settings.min_row_positions, cfg.max_seq_len))
    _check_budget(
        cfg, settings.kv_cache_bytes, settings.kv_cache_bytes // KVPool.row_bytes_for(session, cfg, sizes[0]), sizes[0]
    )
    pool = SizedPool(
        cfg,
        settings.kv_cache_bytes,
        sizes,
        open_slab=lambda rows, size: KVPool(session, cfg, rows=rows, capacity=size),
        row_bytes=lambda size: KVPool.row_bytes_for(session, cfg, size),
        max_rows=MAX_LIVE_SEQUENCES,
    )
    mib = settings.kv_cache_bytes / (1 << 20)
    sizes_text = ", ".join(map(str, sizes))
    pool.description = (
        f"{path.name} on {session.get_providers()[0]} (caches on {pool.device}, {pool.cache_kind}): "
        f"rows of {sizes_text} positions from a {mib:.0f} MiB budget"
    )
    pool.identity = snapshots.fingerprint(cfg, pool.cache_dtype, path.name, sha256(path))
    return pool


def _whole_pool(files: Mapping[str, Path], cfg: ModelConfig, settings: SessionSettings, placement: Placement) -> KVPool:
    path = model_file(files, placement)
    session = open_session(path, placement, settings.threads)
    rows = settings.kv_cache_bytes // KVPool.row_bytes_for(session, cfg, cfg.max_seq_len)
    _check_budget(cfg, settings.kv_cache_bytes, rows, cfg.max_seq_len)
    pool = KVPool(session, cfg, rows=min(rows, MAX_LIVE_SEQUENCES), capacity=cfg.max_seq_len)
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


def _check_budget(cfg: ModelConfig, budget_bytes: int, rows: int, positions: int) -> None:
    if rows < 1:
        raise EngineError(
            f"the KV cache budget of {budget_bytes} bytes holds no row of {positions} positions of this "
            f"model's cache; raise kv_cache_bytes"
        )
