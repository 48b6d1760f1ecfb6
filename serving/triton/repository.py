"""`write_repository`: a Triton model repository from an artifact directory (docs/design.md, "Triton models").

    REPO/<model>/config.pbtxt          generated (serving/triton/config.py)
    REPO/<model>/1/model.py            python models: the shim that imports `serving` (copied verbatim)
    REPO/<model>/1/config.json         the ModelConfig the model was built from
    REPO/<model>/1/model.<variant>.onnx  python models: one passing graph per placement (PYTHON_FILES)
    REPO/mha_onnx/1/model.onnx         the onnxruntime backend's default file name

Only variants that passed the parity ladder (report.json) are ever copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from contract.config import ModelConfig
from contract.files import MODEL_CONFIG_FILENAME, REPORT_FILENAME, model_filename
from serving.engine.settings import ENGINE_CONCAT, ENGINE_STATIC
from serving.triton import config as triton_config
from serving.triton.config import ServingSettings

VERSION = "1"
SHIM_SOURCE = Path(__file__).resolve().parent / "shim.py"
SHIM_FILENAME = "model.py"

P_CPU, P_CUDA, P_TRT = triton_config.P_ONNX_FILE, triton_config.P_ONNX_FILE_CUDA, triton_config.P_ONNX_FILE_TENSORRT
# The python models' graphs per placement, best first; the first that passed is copied. The served IO
# is fp32 (the runner rounds to an fp16 graph's dtype and back). `mha`: the fused graph on the CPU (the
# fastest CPU decode step), fp16 on CUDA, the TensorRT form under TensorRT. `mha_session`: the static
# cache (fp32 on the CPU, fp16 on CUDA) for the `static` engine, the fused fp32 graph for `concat`.
PYTHON_FILES: dict[str, dict[str, tuple[str, ...]]] = {
    triton_config.MHA: {
        P_CPU: ("fp32-fused", "fp32"),
        P_CUDA: ("fp16-fused", "fp32-fused", "fp32"),
        P_TRT: ("fp16-trt", "fp32-trt"),
    },
    ENGINE_STATIC: {P_CPU: ("fp32-static",), P_CUDA: ("fp16-static",)},
    ENGINE_CONCAT: {P_CPU: ("fp32-fused", "fp32"), P_CUDA: ("fp32-fused", "fp32")},
}

# mha_onnx loads the plain fp32 graph: (1) every op of it has a CUDA kernel in the ONNX Runtime of
# the NGC image's onnxruntime backend (1.24.4 in 26.04), which has none for the ONNX `Attention` op;
# (2) TensorRT parses it whole (no attention node with a cache inside); (3) FP16 comes from the
# TensorRT accelerator's precision_mode, keeping the fp32 IO shared with `mha`. The build checks both
# (export/targets.py, ONNX_BACKEND).
ONNX_BACKEND_VARIANT = "fp32"


class RepositoryError(RuntimeError):
    """The artifact directory cannot fill a repository (no passing variant, missing files)."""


def _passing_variants(artifact_dir: Path) -> set[str]:
    report_path = artifact_dir / REPORT_FILENAME
    if not report_path.is_file():
        raise RepositoryError(f"{artifact_dir} has no {REPORT_FILENAME}; run `python -m export build` first")
    report = json.loads(report_path.read_text())
    return {
        name
        for name, entry in report.get("variants", {}).items()
        if entry.get("passed") and entry.get("file") and (artifact_dir / model_filename(name)).is_file()
    }


def python_files(choices: dict[str, tuple[str, ...]], passing: set[str]) -> dict[str, str]:
    """File parameter -> the first passing variant's file name (placements with none are left out)."""
    files = {}
    for key, variants in choices.items():
        chosen = next((v for v in variants if v in passing), None)
        if chosen:
            files[key] = model_filename(chosen)
    return files


def session_engine(settings: ServingSettings, passing: set[str]) -> str:
    """The engine mha_session runs: the one asked for, or `concat` where the static graph is missing
    (a config GroupQueryAttention cannot take)."""
    if settings.engine == ENGINE_STATIC and P_CPU not in python_files(PYTHON_FILES[settings.engine], passing):
        return ENGINE_CONCAT
    return settings.engine


def model_files(passing: set[str], settings: ServingSettings | None = None) -> dict[str, dict[str, str]]:
    """Each python model's file parameters, given the variants that passed."""
    engine = session_engine(settings or ServingSettings(), passing)
    return {
        triton_config.MHA: python_files(PYTHON_FILES[triton_config.MHA], passing),
        triton_config.MHA_SESSION: python_files(PYTHON_FILES[engine], passing),
    }


def model_configs(cfg: ModelConfig, passing: set[str], settings: ServingSettings | None = None) -> dict:
    """Every model's Triton config for an artifact whose `passing` variants are there."""
    settings = settings or ServingSettings()
    files = model_files(passing, settings)
    return triton_config.model_configs(cfg, files, settings, session_engine(settings, passing))


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
    files = model_files(passing, settings)
    for name in triton_config.PYTHON_MODELS:
        if name in models and P_CPU not in files[name]:
            raise RepositoryError(
                f"{artifact_dir}: no passing variant for {name} on the CPU; passing: {sorted(passing)}"
            )
    if triton_config.MHA_ONNX in models and ONNX_BACKEND_VARIANT not in passing:
        raise RepositoryError(f"{artifact_dir}: {triton_config.MHA_ONNX} needs the passing `{ONNX_BACKEND_VARIANT}`")
    configs = model_configs(cfg, passing, settings)
    for name in models:
        version = _fresh_version_dir(repository / name)
        (repository / name / triton_config.TRITON_CONFIG_FILENAME).write_text(triton_config.to_text(configs[name]))
        shutil.copyfile(artifact_dir / MODEL_CONFIG_FILENAME, version / MODEL_CONFIG_FILENAME)
        if name in triton_config.PYTHON_MODELS:
            shutil.copyfile(SHIM_SOURCE, version / SHIM_FILENAME)
            for onnx_file in sorted(set(files[name].values())):
                shutil.copyfile(artifact_dir / onnx_file, version / onnx_file)
        else:
            source = artifact_dir / model_filename(ONNX_BACKEND_VARIANT)
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
    """Whether each of `models` has its config, its config.json and every ONNX file its config names
    (what serving needs). Reads the configs only: no torch, no onnx."""
    repository = Path(repository_dir)
    for name in models:
        version = repository / name / VERSION
        config_path = repository / name / triton_config.TRITON_CONFIG_FILENAME
        if not config_path.is_file() or not (version / MODEL_CONFIG_FILENAME).is_file():
            return False
        config = triton_config.parse(config_path.read_text())
        needed = [value.string_value for key, value in config.parameters.items() if key.startswith(P_CPU)]
        if not needed or not all((version / name).is_file() for name in [*needed, SHIM_FILENAME]):
            return False
    return True
