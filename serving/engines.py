"""What the Python-backend models run, built from their version folder and config parameters,
without Triton: the stateless runner of `mha` and the session engine of `mha_session`.

A model's folder holds one ONNX file per placement (parameters `onnx_file` for the CPU,
`onnx_file_cuda` and `onnx_file_tensorrt` where they differ); the placement chosen at load (TensorRT,
CUDA, CPU: `serving.runner.choose_placement`) picks the file. `mha_session` runs the engine its
`engine` parameter names: `static` (a slot pool over the static-cache graph, serving/static_engine.py)
or `concat` (per-sequence caches batched by padding, serving/session.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from contract.config import ModelConfig
from export.kv_pool import KVPool, session_float_dtype
from serving.kv_cache import KVCacheStore
from serving.runner import CPU, CUDA, TENSORRT, Placement, Runner, choose_placement, open_session
from serving.session import SessionEngine
from serving.static_engine import StaticSessionEngine
from serving.triton import config as triton_config
from serving.triton import tensorrt

_FILE_PARAMETERS = {
    TENSORRT: (triton_config.P_ONNX_FILE_TENSORRT, triton_config.P_ONNX_FILE_CUDA, triton_config.P_ONNX_FILE),
    CUDA: (triton_config.P_ONNX_FILE_CUDA, triton_config.P_ONNX_FILE),
    CPU: (triton_config.P_ONNX_FILE,),
}


class EngineError(RuntimeError):
    """The model's folder or parameters cannot make what it asks for (a load-time error)."""


def model_file(version: Path, parameters: dict[str, str], placement: Placement) -> Path:
    """The ONNX file for `placement`: the most specific file parameter the model has."""
    key = next((key for key in _FILE_PARAMETERS[placement.kind] if parameters.get(key)), None)
    if key is None:
        raise EngineError(f"{version}: no ONNX file parameter for {placement.kind} (parameters {sorted(parameters)})")
    path = version / parameters[key]
    if not path.is_file():
        raise EngineError(f"{version}: the parameter {key} names {path.name}, which is not there")
    return path


def trt_cache(model_name: str) -> Path:
    return Path(tempfile.gettempdir()) / "attention-serving-trt" / model_name


def stateless_runner(version: Path, cfg: ModelConfig, parameters: dict[str, str], model_name: str) -> Runner:
    placement = choose_placement(cfg, tensorrt.Limits(), trt_cache(model_name))
    return Runner(
        model_file(version, parameters, placement),
        cfg,
        threads=int(parameters.get(triton_config.P_THREADS, "0")),
        placement=placement,
    )


def session_engine(
    version: Path, cfg: ModelConfig, parameters: dict[str, str], max_batch: int, model_name: str
) -> SessionEngine | StaticSessionEngine:
    """`mha_session`'s engine as its parameters ask (the static one unless `engine` says `concat`)."""
    kind = parameters.get(triton_config.P_ENGINE, triton_config.ENGINE_CONCAT)
    idle = float(parameters[triton_config.P_IDLE_TIMEOUT])
    budget = int(parameters[triton_config.P_KV_CACHE_BYTES])
    threads = int(parameters.get(triton_config.P_THREADS, "0"))
    if kind == triton_config.ENGINE_STATIC:
        pool, notes = static_pool(version, cfg, parameters, budget, threads, model_name)
        description = "; ".join([f"static engine, {pool.description}", *notes])
        return StaticSessionEngine(pool, idle_timeout=idle, description=description)
    if kind != triton_config.ENGINE_CONCAT:
        raise EngineError(
            f"unknown engine {kind!r}; choose {triton_config.ENGINE_STATIC} or {triton_config.ENGINE_CONCAT}"
        )
    limits = tensorrt.Limits(max_batch=max_batch)
    placement = choose_placement(cfg, limits, trt_cache(model_name))
    runner = Runner(model_file(version, parameters, placement), cfg, threads=threads, placement=placement)
    store = KVCacheStore(
        bytes_per_position=cfg.kv_cache_bytes(batch=1, length=1),
        max_positions=cfg.max_seq_len,
        budget_bytes=budget,
        idle_timeout=idle,
    )
    return SessionEngine(runner, store)


def static_pool(
    version: Path, cfg: ModelConfig, parameters: dict[str, str], budget: int, threads: int, model_name: str
) -> tuple[KVPool, list[str]]:
    """The slot pool on the best device; on CUDA with ONNX Runtime's CUDA graphs when a probe of them
    works (decode steps are launch-bound on a GPU), else without (the reason goes to the log)."""
    placement = choose_placement(cfg, tensorrt.Limits(), trt_cache(model_name), allow_tensorrt=False, cuda_graphs=True)
    if placement.kind == CUDA:
        try:
            return _probed(_pool(version, cfg, parameters, budget, threads, placement)), placement.notes
        except Exception as error:  # the plain CUDA session still serves
            placement = choose_placement(cfg, tensorrt.Limits(), trt_cache(model_name), allow_tensorrt=False)
            placement.notes.append(f"CUDA graphs off: their probe failed ({type(error).__name__}: {error})")
    return _pool(version, cfg, parameters, budget, threads, placement), placement.notes


def _pool(version: Path, cfg: ModelConfig, parameters: dict, budget: int, threads: int, placement: Placement) -> KVPool:
    path = model_file(version, parameters, placement)
    session = open_session(path, placement, threads)
    pool = KVPool(session, cfg, rows=pool_rows(cfg, budget, session), capacity=cfg.max_seq_len)
    pool.description = f"{path.name} on {session.get_providers()[0]} (caches on {pool.device})"
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


def describe(engine: SessionEngine | StaticSessionEngine) -> str:
    """What an engine runs and where (the models log it at load)."""
    if isinstance(engine, StaticSessionEngine):
        return engine.description
    return f"concat engine, {engine.runner.description}"


def pool_rows(cfg: ModelConfig, budget_bytes: int, session) -> int:
    """Slots the KV budget holds: rows of max_seq_len positions in the graph's dtype (each row also
    has one scratch position, export/kv_pool.py, outside the budget's count)."""
    row = cfg.kv_cache_bytes(1, cfg.max_seq_len, np.dtype(session_float_dtype(session)).itemsize)
    rows = budget_bytes // row
    if rows < 1:
        raise EngineError(
            f"the KV cache budget of {budget_bytes} bytes holds no sequence of max_seq_len {cfg.max_seq_len} "
            f"({row} bytes each); raise kv_cache_bytes"
        )
    return rows
