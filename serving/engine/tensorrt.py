"""TensorRT for the fused graphs in ONNX Runtime: the providers, the engine cache, and a check of a
built engine. The profiles and the EP's options are plain data shared with Triton's configs
(contract/tensorrt_options.py, re-exported here for the engine's users).

TensorRT's ONNX parser takes `Attention` only with a single output; our fused node also returns the
present cache, so ONNX Runtime runs that node on the CUDA provider and the rest in TensorRT
engines (it partitions the graph). The profiles cover every graph input either way.

Only `check_engine` needs a GPU; everything else is plain data and is unit-tested anywhere.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from contract import names
from contract.config import ModelConfig
from contract.tensorrt_options import (  # noqa: F401  (re-exported: the engine's users read them here)
    POINTS,
    Limits,
    LimitsError,
    axis_size,
    axis_sizes,
    profile,
    provider_options,
)
from serving.engine import placement
from serving.engine.ort import CPU_PROVIDER, CUDA_PROVIDER, TRT_PROVIDER, ort_runner, ort_session, session_float_dtype

# Where the python models' TensorRT engines are kept, one folder per model (an engine takes minutes to
# build: built once per GPU and machine, then read back)
TRT_CACHE_ROOT = "attention-serving-trt"


class TensorRTUnavailable(RuntimeError):
    """No GPU, no TensorRT, or no ONNX Runtime TensorRT provider on this machine."""


def trt_cache_dir(model_name: str = "") -> Path:
    """The TensorRT engine cache of `model_name` (all models' caches when empty), in the temp folder."""
    return Path(tempfile.gettempdir()) / TRT_CACHE_ROOT / model_name


def ort_providers(options: dict[str, Any], device_id: int = 0) -> list:
    """TensorRT first, CUDA for what TensorRT cannot parse (the 3-output Attention), CPU last."""
    return [
        (TRT_PROVIDER, {"device_id": device_id, **options}),
        (CUDA_PROVIDER, {"device_id": device_id}),
        CPU_PROVIDER,
    ]


# --- building and checking an engine (GPU hosts only) -------------------------------------------


@dataclasses.dataclass(frozen=True)
class EngineCheck:
    providers: list[str]  # what the session actually runs on, TensorRT first
    max_rel: dict[str, float]  # per profile point: worst output error relative to the CPU output's scale
    bound: float
    engine_files: list[str]  # what the engine cache holds after the build

    @property
    def passed(self) -> bool:
        return all(error <= self.bound for error in self.max_rel.values())


def check_engine(
    model_path: str | Path,
    cfg: ModelConfig,
    limits: Limits,
    cache_path: str | Path,
    max_rel: float = 1e-2,
) -> EngineCheck:
    """Build the engine for `model_path` and compare it with ONNX Runtime CPU at every profile point.

    Raises TensorRTUnavailable (with the reason) where no GPU or TensorRT exists. The check passes
    when every point is within `max_rel` of the output's scale (the fp16 bound of export/parity.py).
    """
    reason = placement.tensorrt_unavailable_reason()
    if reason:
        raise TensorRTUnavailable(reason)
    Path(cache_path).mkdir(parents=True, exist_ok=True)
    options = provider_options(cfg, limits, cache_path)
    session = ort_session(model_path, providers=ort_providers(options))
    if session.get_providers()[0] != TRT_PROVIDER:
        raise TensorRTUnavailable(f"the session fell back to {session.get_providers()}")
    gpu, cpu = ort_runner(session), ort_runner(ort_session(model_path))
    errors = {}
    for point, sizes in limits.points(cfg).items():
        inputs = random_inputs(cfg, sizes, session_float_dtype(session))
        expected, actual = cpu(inputs), gpu(inputs)
        scale = float(np.abs(expected[names.OUTPUT].astype(np.float64)).max())
        errors[point] = float(np.abs(actual[names.OUTPUT] - expected[names.OUTPUT].astype(np.float64)).max()) / scale
    files = sorted(p.name for p in Path(cache_path).iterdir())
    return EngineCheck(session.get_providers(), errors, max_rel, files)


def random_inputs(cfg: ModelConfig, sizes: dict[str, int], dtype: type = np.float32, seed: int = 0) -> dict:
    """Random inputs with the shapes of one profile point (an all-ones mask)."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for spec in names.input_specs(cfg):
        shape = tuple(axis_size(axis, sizes) for axis in spec.shape)
        if spec.is_mask:
            inputs[spec.name] = np.ones(shape, np.int64)
        elif spec.is_position:  # after a past of sizes[PAST_SEQUENCE] positions
            inputs[spec.name] = np.broadcast_to(np.arange(shape[1]) + sizes[names.PAST_SEQUENCE], shape).copy()
        else:
            inputs[spec.name] = rng.standard_normal(shape).astype(dtype)
    return inputs
