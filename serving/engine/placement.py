"""Where a graph runs: TensorRT, else CUDA, else the CPU, whichever is usable on this machine, and
which of a model's ONNX files that placement runs.

A model ships one ONNX file per placement where they differ (fp16 on CUDA, a TensorRT form under
TensorRT, fp32 on the CPU); the most specific file a placement has is the one it opens.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

import onnxruntime as ort

from contract.config import ModelConfig
from contract.deployment import TENSORRT  # a placement kind: TensorRT engines, CUDA for what they leave out
from contract.tensorrt_options import Limits, provider_options
from serving.engine.errors import EngineError
from serving.engine.ort import CPU, CPU_PROVIDER, CUDA, CUDA_PROVIDER, TRT_PROVIDER, session_options

log = logging.getLogger(__name__)

PLACEMENTS = (TENSORRT, CUDA, CPU)
# The files a placement may run, most specific first: a TensorRT host without a TensorRT form runs the
# CUDA graph (on the CUDA provider), and any host can run the CPU graph.
FILE_FALLBACK = {TENSORRT: (TENSORRT, CUDA, CPU), CUDA: (CUDA, CPU), CPU: (CPU,)}


@dataclasses.dataclass(frozen=True)
class Placement:
    """The providers a session asks for, best first, and why the better ones were left out.
    `kind` (TENSORRT, CUDA or CPU) says which of a model's ONNX files it runs."""

    kind: str
    providers: list
    notes: list[str]


def cuda_device_count() -> int:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def cuda_usable() -> bool:
    return CUDA_PROVIDER in ort.get_available_providers() and cuda_device_count() > 0


def tensorrt_unavailable_reason() -> str | None:
    """Why a TensorRT engine cannot be built here, or None when it can."""
    available = ort.get_available_providers()
    if TRT_PROVIDER not in available:
        return f"onnxruntime {ort.__version__} has no {TRT_PROVIDER} (it offers {', '.join(available)})"
    if cuda_device_count() < 1:
        return "no CUDA GPU: the CUDA driver (libcuda.so.1) is missing or reports no device"
    if not _loadable("libnvinfer.so.10"):
        return "TensorRT 10 (libnvinfer.so.10) is not installed"
    return None


def host_kind() -> str:
    """The kind of host this is (contract/deployment.py's HOST_KINDS), by what ONNX Runtime offers here and the
    devices it finds: TensorRT, else CUDA, else the CPU. The build makes the variants such a host serves; the
    server asks for them by this name (`python -m export build --variants KIND`)."""
    if tensorrt_unavailable_reason() is None:
        return TENSORRT
    return CUDA if cuda_usable() else CPU


def _loadable(library: str) -> bool:
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    return True


def choose_placement(
    cfg: ModelConfig,
    limits: Limits,
    trt_cache: Path,
    device_id: int = 0,
    allow_tensorrt: bool = True,
    cuda_graphs: bool = False,
) -> Placement:
    """TensorRT, else CUDA, else the CPU, whichever is usable here; `allow_tensorrt=False` for graphs
    TensorRT cannot take whole (the static cache's GroupQueryAttention); `cuda_graphs` turns on ONNX
    Runtime's CUDA graphs (for fixed-address decode steps, serving/engine/kv_pool.py)."""
    available = ort.get_available_providers()
    notes = []
    trt_missing = tensorrt_unavailable_reason() if allow_tensorrt else "not for this graph"
    if trt_missing is None:
        options = provider_options(cfg, limits, trt_cache)
        notes.append(f"TensorRT options {options}")
        providers = [(TRT_PROVIDER, {"device_id": device_id, **options}), _cuda(device_id), CPU_PROVIDER]
        return Placement(TENSORRT, providers, notes)
    notes.append(f"no TensorRT: {trt_missing}")
    if cuda_usable():
        preload_cuda_libraries()
        provider = _cuda(device_id, enable_cuda_graph="1") if cuda_graphs else _cuda(device_id)
        return Placement(CUDA, [provider, CPU_PROVIDER], notes + (["CUDA graphs on"] if cuda_graphs else []))
    if CUDA_PROVIDER in available:
        notes.append("no CUDA: the CUDA provider is installed but no CUDA device answers")
    else:
        notes.append(f"no CUDA: onnxruntime {ort.__version__} offers {', '.join(available)}")
    return Placement(CPU, [CPU_PROVIDER], notes)


def _cuda(device_id: int, **options: str) -> tuple[str, dict]:
    return (CUDA_PROVIDER, {"device_id": device_id, **options})


def preload_cuda_libraries() -> None:
    """CUDA and cuDNN from the nvidia-* pip packages, where the CUDA provider finds them (a Triton stub
    has not imported torch, which would have loaded them)."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        try:
            preload()
        except Exception as error:  # the session still tries the system's libraries
            log.warning("onnxruntime.preload_dlls failed: %s", error)


def model_file(files: Mapping[str, Path], placement: Placement) -> Path:
    """The ONNX file for `placement` from `files` (placement kind -> path): the most specific one."""
    kind = next((kind for kind in FILE_FALLBACK[placement.kind] if files.get(kind)), None)
    if kind is None:
        raise EngineError(f"no ONNX file for {placement.kind}: the model has files for {sorted(files)}")
    path = Path(files[kind])
    if not path.is_file():
        raise EngineError(f"the {kind} ONNX file {path} is not there")
    return path


def open_session(model: str | Path | bytes, placement: Placement, threads: int = 0) -> ort.InferenceSession:
    """A serving session. Idle pool threads sleep: the model and the cache kernels run one after the
    other, and a spinning pool of one session steals the cores the next session needs. The arena
    recycles what a run allocates, the presents a sequence keeps included: fresh pages fault in on
    every allocation otherwise (measured: a 4096-position step from 3 to 8-14 ms p50 until the
    allocator settles); the budget bounds what the live caches hold."""
    options = session_options(threads, spinning=False)
    model = model if isinstance(model, bytes) else str(model)  # a path, or a serialized graph
    return ort.InferenceSession(model, sess_options=options, providers=placement.providers)
