"""`write_repository`: a Triton model repository from an artifact directory (DESIGN.md 3.4).

    REPO/<model>/config.pbtxt          generated (export/triton_config.py)
    REPO/<model>/1/model.py            python models: the shim that imports `serving` (copied verbatim)
    REPO/<model>/1/config.json         the ModelConfig the model was built from
    REPO/<model>/1/model.<variant>.onnx  python models: the best passing fp32 variant
    REPO/mha_onnx/1/model.onnx         the onnxruntime backend's default file name

Only variants that passed the parity ladder (report.json) are ever copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from export import artifacts, triton_config
from export.config import CONFIG_FILENAME, ModelConfig
from export.triton_config import ServingSettings

VERSION = "1"
SHIM_SOURCE = Path(__file__).resolve().parents[1] / "serving" / "triton_models" / "shim.py"
SHIM_FILENAME = "model.py"

# The python models run ONNX Runtime in the stub: the fused graph when it passed (the fastest CPU
# decode step, DESIGN.md 4), else the plain one. Both are fp32: the served IO is fp32 (DESIGN 3.2).
PYTHON_VARIANTS = ("fp32-fused", "fp32")
DEFAULT_PYTHON_VARIANT = PYTHON_VARIANTS[0]

# mha_onnx loads the plain fp32 graph: (1) the onnxruntime backend of a Triton image bundles its own,
# often older, ONNX Runtime, and the fused graph needs opset 23 (`Attention`); the plain graph is
# opset 18 and loads anywhere; (2) TensorRT's ONNX parser takes `Attention` only with one output,
# ours has three (context and the present cache), so that node would leave TensorRT anyway, while
# the plain graph's MatMul/Softmax chain goes into TensorRT whole; (3) FP16 comes from the TensorRT
# accelerator's precision_mode, not from the fp16 graph, whose FP16 inputs would break the fp32 IO
# shared with `mha`.
ONNX_BACKEND_VARIANT = "fp32"


class RepositoryError(RuntimeError):
    """The artifact directory cannot fill a repository (no passing variant, missing files)."""


def _passing_variants(artifact_dir: Path) -> set[str]:
    report_path = artifact_dir / artifacts.REPORT_FILENAME
    if not report_path.is_file():
        raise RepositoryError(f"{artifact_dir} has no {artifacts.REPORT_FILENAME}; run `python -m export build` first")
    report = json.loads(report_path.read_text())
    return {
        name
        for name, entry in report.get("variants", {}).items()
        if entry.get("passed") and (artifact_dir / artifacts.model_filename(name)).is_file()
    }


def python_variant(artifact_dir: str | Path, passing: set[str] | None = None) -> str:
    """The variant the python-backend models load: `fp32-fused` if it passed, else `fp32`."""
    passing = _passing_variants(Path(artifact_dir)) if passing is None else passing
    for name in PYTHON_VARIANTS:
        if name in passing:
            return name
    raise RepositoryError(f"{artifact_dir}: none of {list(PYTHON_VARIANTS)} passed; passing: {sorted(passing)}")


def write_repository(
    artifact_dir: str | Path,
    repository_dir: str | Path,
    settings: ServingSettings | None = None,
    models: tuple[str, ...] = triton_config.MODELS,
) -> Path:
    """Fill `repository_dir` with `models` built from `artifact_dir`; return the repository path."""
    artifact_dir, repository = Path(artifact_dir), Path(repository_dir)
    settings = settings or ServingSettings()
    unknown = [m for m in models if m not in triton_config.MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from {list(triton_config.MODELS)}")
    cfg = ModelConfig.load(artifact_dir)
    passing = _passing_variants(artifact_dir)
    variant = python_variant(artifact_dir, passing)
    if triton_config.MHA_ONNX in models and ONNX_BACKEND_VARIANT not in passing:
        raise RepositoryError(f"{artifact_dir}: {triton_config.MHA_ONNX} needs the passing `{ONNX_BACKEND_VARIANT}`")
    configs = triton_config.model_configs(cfg, artifacts.model_filename(variant), settings)
    for name in models:
        version = _fresh_version_dir(repository / name)
        (repository / name / triton_config.CONFIG_FILENAME).write_text(triton_config.to_text(configs[name]))
        shutil.copyfile(artifact_dir / CONFIG_FILENAME, version / CONFIG_FILENAME)
        if name in triton_config.PYTHON_MODELS:
            shutil.copyfile(SHIM_SOURCE, version / SHIM_FILENAME)
            onnx_file = artifacts.model_filename(variant)
            shutil.copyfile(artifact_dir / onnx_file, version / onnx_file)
        else:
            source = artifact_dir / artifacts.model_filename(ONNX_BACKEND_VARIANT)
            shutil.copyfile(source, version / triton_config.ONNX_BACKEND_FILENAME)
    return repository


def _fresh_version_dir(model_dir: Path) -> Path:
    """The version folder, without the ONNX files of an earlier build (another variant may win now)."""
    version = model_dir / VERSION
    version.mkdir(parents=True, exist_ok=True)
    for stale in version.glob("model*.onnx"):
        stale.unlink()
    return version


def is_complete(repository_dir: str | Path, models: tuple[str, ...] = triton_config.PYTHON_MODELS) -> bool:
    """Whether each of `models` has its config, its config.json and an ONNX file (what serving needs)."""
    repository = Path(repository_dir)
    for name in models:
        version = repository / name / VERSION
        if not (repository / name / triton_config.CONFIG_FILENAME).is_file():
            return False
        if not (version / CONFIG_FILENAME).is_file() or not any(version.glob("model*.onnx")):
            return False
    return True
