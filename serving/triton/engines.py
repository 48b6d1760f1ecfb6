"""The engines of the Python-backend models from what Triton gives them: the model's version folder
and its config parameters (serving/triton/config.py writes them), read into the engine's typed
settings (serving/engine/factory.py). A parameter that is missing or wrong is an EngineError naming
it, a graph that is not the one its build checked an IntegrityError naming it, at load.
"""

from __future__ import annotations

from pathlib import Path

from contract.config import ModelConfig
from serving.engine import factory
from serving.engine.core import CoreSettings
from serving.engine.errors import EngineError
from serving.engine.ort import CPU, CUDA
from serving.engine.placement import TENSORRT
from serving.engine.runner import InspectionRunner, Runner
from serving.engine.settings import ENGINE_STATIC, SessionSettings
from serving.triton import config as triton_config
from serving.triton import digests

# file parameter -> the placement that runs it
FILE_PLACEMENTS = {
    triton_config.P_ONNX_FILE: CPU,
    triton_config.P_ONNX_FILE_CUDA: CUDA,
    triton_config.P_ONNX_FILE_TENSORRT: TENSORRT,
}


def onnx_files(version: Path, parameters: dict[str, str]) -> dict[str, Path]:
    """Placement kind -> the ONNX file its parameter names in the version folder, each checked against
    the folder's SHA256SUMS first (digests.IntegrityError: the model does not load, and says why)."""
    files = {kind: version / parameters[key] for key, kind in FILE_PLACEMENTS.items() if parameters.get(key)}
    digests.verify(version, [path.name for path in files.values()])
    return files


def inspection_file(version: Path, parameters: dict[str, str]) -> Path | None:
    """The inspection graph its parameter names (checked against SHA256SUMS like the others), or None
    when the repository has none: the model loads, and a request for attention maps is refused."""
    name = parameters.get(triton_config.P_ONNX_FILE_INSPECT)
    if not name:
        return None
    digests.verify(version, [name])
    return version / name


def threads(parameters: dict[str, str]) -> int:
    return _number(parameters, triton_config.P_THREADS, int, "0")


def session_settings(parameters: dict[str, str]) -> SessionSettings:
    defaults = SessionSettings()
    return SessionSettings(
        engine=parameters.get(triton_config.P_ENGINE, ENGINE_STATIC),
        kv_cache_bytes=_number(parameters, triton_config.P_KV_CACHE_BYTES, int),
        idle_timeout_seconds=_number(parameters, triton_config.P_IDLE_TIMEOUT, float),
        threads=threads(parameters),
        max_batch=_number(parameters, triton_config.P_MAX_BATCH, int, str(defaults.max_batch)),
        min_row_positions=_number(parameters, triton_config.P_MIN_ROW_POSITIONS, int),
        step_tokens=_number(parameters, triton_config.P_STEP_TOKENS, int, str(defaults.step_tokens)),
        kept_per_owner=_number(parameters, triton_config.P_KEPT_PER_OWNER, int, str(defaults.kept_per_owner)),
        generations_per_owner=_number(
            parameters, triton_config.P_GENERATIONS_PER_OWNER, int, str(defaults.generations_per_owner)
        ),
    )


def core_settings(settings: SessionSettings) -> CoreSettings:
    """The engine core's settings of the session model's (serving/engine/core.py)."""
    return CoreSettings(
        step_tokens=settings.step_tokens,
        min_chunk=min(CoreSettings.min_chunk, settings.step_tokens),
        kept_per_owner=settings.kept_per_owner,
        generations_per_owner=settings.generations_per_owner,
    )


def _number(parameters: dict[str, str], key: str, kind: type, default: str | None = None) -> int | float:
    text = parameters.get(key, default)
    if text is None:
        raise EngineError(f"the model's config has no parameter '{key}'")
    try:
        return kind(text)
    except ValueError:
        raise EngineError(f"parameter '{key}' must be {kind.__name__}, got {text!r}") from None


def stateless_runner(version: Path, cfg: ModelConfig, parameters: dict[str, str], model_name: str) -> Runner:
    return factory.stateless_runner(onnx_files(version, parameters), cfg, threads(parameters), model_name)


def inspection_runner(version: Path, cfg: ModelConfig, parameters: dict[str, str]) -> InspectionRunner:
    return InspectionRunner(inspection_file(version, parameters), cfg, threads(parameters))


def session_engine(
    version: Path, cfg: ModelConfig, parameters: dict[str, str], model_name: str
) -> factory.SessionEngines:
    settings = session_settings(parameters)
    inspection = inspection_file(version, parameters)
    return factory.session_engine(onnx_files(version, parameters), cfg, settings, model_name, inspection)
