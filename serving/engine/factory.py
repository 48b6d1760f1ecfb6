"""The engines the served models run, made from a model's ONNX files and typed settings: the
stateless runner of `forward` and the session engine of `sessions` (static or concat). What Triton's
parameters say is read by the Triton adapter (serving/triton/engines.py), not here.

`files` maps a placement kind (placement.py: tensorrt, cuda, cpu) to the model's ONNX file for it;
the placement chosen at load (TensorRT, CUDA, CPU, whichever is usable here) picks the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from contract.config import ModelConfig
from contract.files import sha256
from serving.engine import snapshots, tensorrt
from serving.engine.cache_manager import CacheManager, row_sizes
from serving.engine.concat import ConcatSessionEngine, KVCacheStore
from serving.engine.errors import EngineError
from serving.engine.kv_pool import KVPool, cache_layout, cache_scales, last_logits_graph
from serving.engine.ort import CUDA, CUDA_PROVIDER
from serving.engine.placement import Placement, choose_placement, model_file, open_session
from serving.engine.runner import InspectionRunner, Runner
from serving.engine.settings import ENGINE_STATIC, MAX_LIVE_SEQUENCES, SessionSettings
from serving.engine.static_engine import StaticSessionEngine

SessionEngines = StaticSessionEngine | ConcatSessionEngine


def stateless_runner(files: Mapping[str, Path], cfg: ModelConfig, threads: int, model_name: str) -> Runner:
    placement = choose_placement(cfg, tensorrt.Limits(), tensorrt.trt_cache_dir(model_name))
    return Runner(model_file(files, placement), cfg, threads=threads, placement=placement)


def session_engine(
    files: Mapping[str, Path],
    cfg: ModelConfig,
    settings: SessionSettings,
    model_name: str,
    inspection: Path | None = None,
) -> SessionEngines:
    """the `sessions` model's engine as `settings` ask; `inspection`: the graph its attention maps come from."""
    idle, budget, threads = settings.idle_timeout_seconds, settings.kv_cache_bytes, settings.threads
    maps = InspectionRunner(inspection, cfg, threads)  # opened at its first use
    if settings.engine == ENGINE_STATIC:
        cache, notes = static_cache(files, cfg, settings, model_name)
        description = "; ".join([f"static engine, {cache.description}", *notes])
        return StaticSessionEngine(cache, idle_timeout=idle, description=description, inspection=maps)
    placement = choose_placement(cfg, tensorrt.Limits(max_batch=settings.max_batch), tensorrt.trt_cache_dir(model_name))
    path = model_file(files, placement)
    runner = Runner(path, cfg, threads=threads, placement=placement)
    store = KVCacheStore(
        bytes_per_position=cfg.kv_cache_bytes(batch=1, length=1),
        max_positions=cfg.max_seq_len,
        budget_bytes=budget,
        idle_timeout=idle,
    )
    identity = snapshots.fingerprint(cfg, np.dtype(runner.dtype).name, path.name, sha256(path))
    return ConcatSessionEngine(runner, store, identity=identity, inspection=maps)


def static_cache(
    files: Mapping[str, Path], cfg: ModelConfig, settings: SessionSettings, model_name: str
) -> tuple[CacheManager, list[str]]:
    """The cache on the best device; on CUDA with ONNX Runtime's CUDA graphs when a probe of them works
    (decode steps are launch-bound on a GPU), else without (the reason goes to the log). On a device every
    session reserves a full row (its memory is committed at once); on the host a granule at a time."""
    placement = choose_placement(
        cfg, tensorrt.Limits(), tensorrt.trt_cache_dir(model_name), allow_tensorrt=False, cuda_graphs=True
    )
    if placement.kind == CUDA:
        try:
            return _probed(_cache(files, cfg, settings, placement, full_rows=True)), placement.notes
        except Exception as error:  # the plain CUDA session still serves
            placement = choose_placement(
                cfg, tensorrt.Limits(), tensorrt.trt_cache_dir(model_name), allow_tensorrt=False
            )
            placement.notes.append(f"CUDA graphs off: their probe failed ({type(error).__name__}: {error})")
    return _cache(files, cfg, settings, placement), placement.notes


def _cache(
    files: Mapping[str, Path], cfg: ModelConfig, settings: SessionSettings, placement: Placement, full_rows=False
) -> CacheManager:
    """Reservations of `min_row_positions` at a time; `full_rows`: a whole row each. A whole model's prefills
    that ask for the last position only run its last-logits graph."""
    path = model_file(files, placement)
    session = open_session(path, placement, settings.threads)
    last_logits = _last_logits_session(path, placement, settings.threads) if cfg.whole else None
    sizes = row_sizes(cfg.max_seq_len, min(settings.min_row_positions, cfg.max_seq_len))
    smallest = cfg.max_seq_len if full_rows else sizes[0]
    _check_budget(settings.kv_cache_bytes, KVPool.row_bytes_for(session, cfg, smallest), smallest)
    quantized = np.issubdtype(cache_layout(session)[0], np.integer)  # its scales dequantize it for attention maps
    cache = CacheManager(
        session,
        cfg,
        settings.kv_cache_bytes,
        sizes,
        max_rows=MAX_LIVE_SEQUENCES,
        full_rows=full_rows,
        graph=path.name,
        graph_sha256=sha256(path),
        scales=cache_scales(path, cfg) if quantized else None,
        last_logits_session=last_logits,
    )
    cache.description = f"{path.name} on {session.get_providers()[0]} ({cache.description})"
    return cache


def _last_logits_session(path: Path, placement: Placement, threads: int):
    """`path`'s graph answering only the last position's logits (kv_pool.last_logits_graph), opened as
    open_session opens the main one but without CUDA graphs (it runs prefills only, never a captured
    decode); None when it cannot be built (the reason in the placement's notes: such prefills then slice
    the full logits)."""
    import onnx

    try:
        graph = last_logits_graph(onnx.load(str(path))).SerializeToString()
        plain = dataclasses.replace(placement, providers=_without_cuda_graphs(placement.providers))
        return open_session(graph, plain, threads)
    except Exception as error:  # the full graph still answers them, sliced
        placement.notes.append(
            f"last-position prefills slice the full logits: no last-logits graph ({type(error).__name__}: {error})"
        )
        return None


def _without_cuda_graphs(providers: list) -> list:
    """`providers` with the CUDA provider's `enable_cuda_graph` option left out."""
    return [_without_cuda_graph(entry) for entry in providers]


def _without_cuda_graph(provider):
    if isinstance(provider, tuple) and provider[0] == CUDA_PROVIDER:
        name, options = provider
        return name, {key: value for key, value in options.items() if key != "enable_cuda_graph"}
    return provider


PROBE = ("probe",)  # the holder of the CUDA-graph probe's row (a tuple: never a sequence id)


def _probed(cache: CacheManager) -> CacheManager:
    """Three decode steps of one row (a plain run, the capture, a replay), then the row freed again."""
    cache.allocate(PROBE, 1)
    try:
        # one token: a whole model's id 0, or a hidden state of zeros
        token = np.zeros(1, np.int64) if cache.cfg.whole else np.zeros((1, cache.cfg.d_model), cache.dtype)
        for _ in range(3):
            output = cache.run({PROBE: token})[PROBE]
            if isinstance(output, Exception):
                raise output
            if not np.isfinite(output).all():
                raise RuntimeError("a CUDA graph replay gave a non-finite output")
    finally:
        cache.free(PROBE)
    return cache


def _check_budget(budget_bytes: int, row_bytes: int, positions: int) -> None:
    if budget_bytes < row_bytes:
        raise EngineError(
            f"the KV cache budget of {budget_bytes} bytes holds no row of {positions} positions of this "
            f"model's cache; raise kv_cache_bytes"
        )
