"""`write_repository`: a Triton model repository from an artifact directory (docs/design.md, "Triton models").

    REPO/<model>/config.pbtxt          generated (serving/triton/config.py)
    REPO/<model>/1/model.py            python models: the shim that imports `serving` (copied verbatim)
    REPO/<model>/1/config.json         the ModelConfig the model was built from
    REPO/<model>/1/model.<variant>.onnx  python models: one passing graph per placement (PYTHON_FILES),
                                       and the inspection graph for attention maps (INSPECTION_FILES)
    REPO/forward_onnx/1/model.onnx     the onnxruntime backend's default file name
    REPO/<model>/1/SHA256SUMS          each graph's sha256 from the build's report (serving/triton/digests.py)
    REPO/sessions/1/tokenizer.json ... a whole model's text files (contract/files.py TEXT_FILES), listed too

Only variants that passed the parity ladder (report.json) are ever copied, and only when the file is
still the one the build checked (its sha256 as the report recorded it); the Python models check the
copies against SHA256SUMS again when they load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from contract import generation, names
from contract.config import ModelConfig
from contract.deployment import (
    ENGINE_CONCAT,
    ENGINE_OPERATIONS,
    ENGINE_STATIC,
    KV_INT4,
    KV_INT8,
    WEIGHTS_INT4,
    WEIGHTS_INT8,
)
from contract.files import DIGESTS_FILENAME, MODEL_CONFIG_FILENAME, REPORT_FILENAME, TEXT_FILES, model_filename
from serving.triton import config as triton_config
from serving.triton import digests
from serving.triton.config import ServingSettings

VERSION = "1"
SHIM_SOURCE = Path(__file__).resolve().parent / "shim.py"
SHIM_FILENAME = "model.py"

P_CPU, P_CUDA, P_TRT = triton_config.P_ONNX_FILE, triton_config.P_ONNX_FILE_CUDA, triton_config.P_ONNX_FILE_TENSORRT
P_INSPECT = triton_config.P_ONNX_FILE_INSPECT
# sessions: the session operations its engine offers, comma-separated (published, read by no model)
P_OPERATIONS = "operations"
# Both python models answer the attention maps from the inspection graph on the CPU, whatever else they
# run (export/inspect_form.py); an artifact without it serves the rest, and a request for maps is refused.
INSPECTION_FILES = {P_INSPECT: (names.INSPECTION_VARIANT,)}
# The python models' graphs per placement, best first; the first that passed is copied. The served IO
# is fp32 (the runner rounds to an fp16 graph's dtype and back). `forward`: the fused graph on the CPU (the
# fastest CPU decode step), fp16 on CUDA, the TensorRT form under TensorRT. `sessions`: the static
# cache (fp32 on the CPU, fp16 on CUDA) for the `static` engine, the fused fp32 graph for `concat`;
# with a quantized KV cache (`kv_dtype`) the static graph of that cache, on the CPU only (ONNX Runtime
# 1.31's CUDA GroupQueryAttention quantizes a cache too, but none of it has run on a GPU of ours).
PYTHON_FILES: dict[str, dict[str, tuple[str, ...]]] = {
    triton_config.FORWARD: {
        P_CPU: ("fp32-fused", "fp32"),
        P_CUDA: ("fp16-fused", "fp32-fused", "fp32"),
        P_TRT: ("fp16-trt", "fp32-trt"),
    },
    ENGINE_STATIC: {P_CPU: ("fp32-static",), P_CUDA: ("fp16-static",)},
    ENGINE_CONCAT: {P_CPU: ("fp32-fused", "fp32"), P_CUDA: ("fp32-fused", "fp32")},
}
QUANTIZED_STATIC_FILES = {KV_INT8: {P_CPU: ("fp32-static-int8kv",)}, KV_INT4: {P_CPU: ("fp32-static-int4kv",)}}
# With INT8 or 4-bit weights (`weights_dtype`): the graphs whose projections are int8 (int4), on the CPU only
# (ONNX Runtime's dynamic quantization and MatMulNBits are CPU kernels here): the fused one for `forward` and the
# concat engine, the static one for the static engine. Asked for by name, they are never given up silently for
# the float graphs.
QUANTIZED_WEIGHTS_FILES = {
    dtype: {
        triton_config.FORWARD: {P_CPU: (f"fp32-fused-{dtype}w",)},
        ENGINE_STATIC: {P_CPU: (f"fp32-static-{dtype}w",)},
        ENGINE_CONCAT: {P_CPU: (f"fp32-fused-{dtype}w",)},
    }
    for dtype in (WEIGHTS_INT8, WEIGHTS_INT4)
}


def session_choices(settings: ServingSettings, engine: str) -> dict[str, tuple[str, ...]]:
    """The sessions model's graphs per placement for `engine` and the deployment's KV cache and weights dtypes."""
    if settings.weights_dtype in QUANTIZED_WEIGHTS_FILES:
        return QUANTIZED_WEIGHTS_FILES[settings.weights_dtype][engine]
    if engine == ENGINE_STATIC and settings.kv_dtype in QUANTIZED_STATIC_FILES:
        return QUANTIZED_STATIC_FILES[settings.kv_dtype]
    return PYTHON_FILES[engine]


def stateless_choices(settings: ServingSettings) -> dict[str, tuple[str, ...]]:
    """The forward model's graphs per placement for the deployment's weights dtype."""
    quantized = QUANTIZED_WEIGHTS_FILES.get(settings.weights_dtype)
    return quantized[triton_config.FORWARD] if quantized else PYTHON_FILES[triton_config.FORWARD]


def asked_variants(settings: ServingSettings) -> tuple[str, ...]:
    """The variants a build makes only when asked for that these settings serve (a quantized cache, INT8
    weights): `python -m serving ensure` adds them to its build."""
    if settings.weights_dtype in QUANTIZED_WEIGHTS_FILES:
        chosen = QUANTIZED_WEIGHTS_FILES[settings.weights_dtype]
        return tuple(dict.fromkeys(v for files in chosen.values() for v in files[P_CPU]))
    return QUANTIZED_STATIC_FILES.get(settings.kv_dtype, {}).get(P_CPU, ())


# forward_onnx loads the plain fp32 graph: (1) every op of it has a CUDA kernel in the ONNX Runtime of
# the NGC image's onnxruntime backend (1.24.4 in 26.04), which has none for the ONNX `Attention` op;
# (2) TensorRT parses it whole (no attention node with a cache inside); (3) FP16 comes from the
# TensorRT accelerator's precision_mode, keeping the fp32 IO shared with `forward`. The build checks both
# (export/targets.py, ONNX_BACKEND).
ONNX_BACKEND_VARIANT = "fp32"


class RepositoryError(RuntimeError):
    """The artifact directory cannot fill a repository (no passing variant, missing files)."""


def _read_report(artifact_dir: Path) -> dict:
    report_path = artifact_dir / REPORT_FILENAME
    if not report_path.is_file():
        raise RepositoryError(f"{artifact_dir} has no {REPORT_FILENAME}; run `python -m export build` first")
    return json.loads(report_path.read_text())


def _passing_variants(artifact_dir: Path, report: dict) -> set[str]:
    return {
        name
        for name, entry in report.get("variants", {}).items()
        if entry.get("passed") and entry.get("file") and (artifact_dir / model_filename(name)).is_file()
    }


def checked_digest(path: Path, report: dict) -> str:
    """The sha256 the build recorded for the graph at `path`, once the file is seen to still have it."""
    entry = next(entry for entry in report["variants"].values() if entry.get("file") == path.name)
    recorded = entry.get("sha256")
    if recorded is None:
        raise RepositoryError(f"{path.parent / REPORT_FILENAME} records no sha256 for {path.name}; build it again")
    changed = digests.changed_since_build(path, recorded)
    if changed:
        raise RepositoryError(f"{changed}; build it again")
    return recorded


def _copy_graphs(artifact_dir: Path, report: dict, version: Path, copies: dict[str, str]) -> dict[str, str]:
    """Each graph (artifact file name -> its name in `version`), checked against the build's digest and
    copied; name in `version` -> sha256."""
    recorded = {}
    for source, target in sorted(copies.items()):
        recorded[target] = checked_digest(artifact_dir / source, report)
        shutil.copyfile(artifact_dir / source, version / target)
    return recorded


def python_files(choices: dict[str, tuple[str, ...]], passing: set[str]) -> dict[str, str]:
    """File parameter -> the first passing variant's file name (placements with none are left out)."""
    files = {}
    for key, variants in choices.items():
        chosen = next((v for v in variants if v in passing), None)
        if chosen:
            files[key] = model_filename(chosen)
    return files


def session_engine(settings: ServingSettings, passing: set[str]) -> str:
    """The engine sessions runs: the one asked for, or `concat` where the static graph is missing
    (a config GroupQueryAttention cannot take)."""
    if settings.engine == ENGINE_STATIC and P_CPU not in python_files(
        session_choices(settings, ENGINE_STATIC), passing
    ):
        quantized_weights = settings.weights_dtype in QUANTIZED_WEIGHTS_FILES
        if settings.kv_dtype in QUANTIZED_STATIC_FILES or quantized_weights:
            (wanted,) = session_choices(settings, ENGINE_STATIC)[P_CPU]  # asked for by name: never given up silently
            setting = (
                f"weights_dtype {settings.weights_dtype}" if quantized_weights else f"kv_dtype {settings.kv_dtype}"
            )
            raise RepositoryError(
                f"{setting} needs the {wanted} variant, which the artifact does not have "
                f"(passing: {sorted(passing)}); build it: python -m export build --variants {wanted}"
            )
        return ENGINE_CONCAT
    return settings.engine


def model_files(passing: set[str], settings: ServingSettings | None = None) -> dict[str, dict[str, str]]:
    """Each python model's file parameters, given the variants that passed."""
    settings = settings or ServingSettings()
    engine = session_engine(settings, passing)
    return {
        triton_config.FORWARD: python_files(stateless_choices(settings) | INSPECTION_FILES, passing),
        triton_config.SESSIONS: python_files(session_choices(settings, engine) | INSPECTION_FILES, passing),
    }


def model_configs(cfg: ModelConfig, passing: set[str], settings: ServingSettings | None = None) -> dict:
    """Every model's Triton config for an artifact whose `passing` variants are there; the sessions model's
    publishes the engine chosen (`engine`) and the session operations it offers (P_OPERATIONS), which
    the gateway's GET /v1/models reads back."""
    settings = settings or ServingSettings()
    files = model_files(passing, settings)
    engine = session_engine(settings, passing)
    configs = triton_config.model_configs(cfg, files, settings, engine)
    configs[triton_config.SESSIONS].parameters[P_OPERATIONS].string_value = ",".join(ENGINE_OPERATIONS[engine])
    return configs


def write_repository(
    artifact_dir: str | Path,
    repository_dir: str | Path,
    settings: ServingSettings | None = None,
    models: tuple[str, ...] = triton_config.MODELS,
    prefix: str = "",
) -> Path:
    """Fill `repository_dir` with `models` built from `artifact_dir`; return the repository path. `prefix` names
    a second model set of the same repository (`fortunes_sessions`): its models are written under the
    prefixed names. A whole model's session model carries the checkpoint's text files (the tokenizer, its special
    tokens, the chat template), checked against the build's digests and listed in its SHA256SUMS, which the
    model checks again when it loads."""
    artifact_dir, repository = Path(artifact_dir), Path(repository_dir)
    settings = settings or ServingSettings()
    models = tuple(names.current_model_name(m) for m in models)
    unknown = [m for m in models if m not in triton_config.MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from {list(triton_config.MODELS)}")
    cfg = ModelConfig.load(artifact_dir)
    report = _read_report(artifact_dir)
    passing = _passing_variants(artifact_dir, report)
    files = model_files(passing, settings)
    for name in triton_config.PYTHON_MODELS:
        if name in models and P_CPU not in files[name]:
            build = ""
            if settings.weights_dtype in QUANTIZED_WEIGHTS_FILES:  # asked for by name: say how to build it
                variants = ",".join(asked_variants(settings))
                build = f" (weights_dtype {settings.weights_dtype}: python -m export build --variants {variants})"
            raise RepositoryError(
                f"{artifact_dir}: no passing variant for {name} on the CPU{build}; passing: {sorted(passing)}"
            )
    if triton_config.FORWARD_ONNX in models and ONNX_BACKEND_VARIANT not in passing:
        needs = f"{triton_config.FORWARD_ONNX} needs the passing `{ONNX_BACKEND_VARIANT}`"
        raise RepositoryError(f"{artifact_dir}: {needs}")
    configs = model_configs(cfg, passing, settings)
    for name in models:
        version = _fresh_version_dir(repository / f"{prefix}{name}")
        configs[name].name = f"{prefix}{name}"
        shutil.copyfile(artifact_dir / MODEL_CONFIG_FILENAME, version / MODEL_CONFIG_FILENAME)
        if name in triton_config.PYTHON_MODELS:
            shutil.copyfile(SHIM_SOURCE, version / SHIM_FILENAME)
            copies = {onnx_file: onnx_file for onnx_file in files[name].values()}
        else:
            copies = {model_filename(ONNX_BACKEND_VARIANT): triton_config.ONNX_BACKEND_FILENAME}
        recorded = _copy_graphs(artifact_dir, report, version, copies)
        if name == triton_config.SESSIONS and cfg.whole:  # its text travels with the model that generates
            text = _copy_text_files(artifact_dir, report, version)
            if text:
                digest = generation.text_digest(text)
                configs[name].parameters[triton_config.P_TEXT_DIGEST].string_value = digest
            recorded |= text
        digests.write(version, recorded)
        (repository / configs[name].name / triton_config.TRITON_CONFIG_FILENAME).write_text(
            triton_config.to_text(configs[name])
        )
    return repository


def _copy_text_files(artifact_dir: Path, report: dict, version: Path) -> dict[str, str]:
    """The artifact's text files (report.json `text_files`: name -> sha256) copied into `version`, each seen to
    still have its recorded digest first; name -> sha256."""
    recorded = report.get("text_files", {})
    for file_name, digest in sorted(recorded.items()):
        if not (artifact_dir / file_name).is_file():
            raise RepositoryError(f"{artifact_dir / file_name} is missing (report.json lists it); build it again")
        changed = digests.changed_since_build(artifact_dir / file_name, digest)
        if changed:
            raise RepositoryError(f"{changed}; build it again")
        shutil.copyfile(artifact_dir / file_name, version / file_name)
    return dict(recorded)


def _fresh_version_dir(model_dir: Path) -> Path:
    """The version folder, without the ONNX files of an earlier build (another variant may win now) nor its
    text files (this artifact may have none)."""
    version = model_dir / VERSION
    version.mkdir(parents=True, exist_ok=True)
    for stale in [*version.glob("model*.onnx"), version / DIGESTS_FILENAME, *(version / name for name in TEXT_FILES)]:
        stale.unlink(missing_ok=True)
    return version


def is_complete(repository_dir: str | Path, models: tuple[str, ...] = triton_config.PYTHON_MODELS) -> bool:
    """Whether each of `models` has its config, its config.json, every ONNX file its config names and
    their digests (what serving needs). Reads the configs only: no torch, no onnx, no hashing."""
    return not lacks(repository_dir, models)


def lacks(repository_dir: str | Path, models: tuple[str, ...] = triton_config.PYTHON_MODELS) -> list[str]:
    """What `repository_dir` lacks to serve `models`, one line a model (empty when nothing)."""
    repository = Path(repository_dir)
    found = []
    for name in models:
        version = repository / name / VERSION
        config_path = repository / name / triton_config.TRITON_CONFIG_FILENAME
        if not config_path.is_file() or not (version / MODEL_CONFIG_FILENAME).is_file():
            found.append(f"{name}: no {triton_config.TRITON_CONFIG_FILENAME} or {VERSION}/{MODEL_CONFIG_FILENAME}")
            continue
        config = triton_config.parse(config_path.read_text())
        needed = [value.string_value for key, value in config.parameters.items() if key.startswith(P_CPU)]
        absent = [file for file in [*needed, SHIM_FILENAME] if not (version / file).is_file()]
        if not needed or absent:
            found.append(f"{name}: missing {', '.join(absent) or 'its ONNX file parameter'}")
            continue
        try:
            unrecorded = sorted(set(needed) - set(digests.read(version)))
        except digests.IntegrityError:  # none recorded: written before digests were
            unrecorded = needed
        if unrecorded:
            found.append(f"{name}: no digest recorded for {', '.join(unrecorded)} ({DIGESTS_FILENAME})")
    return found


def rename_legacy_models(repository_dir: str | Path) -> list[str]:
    """The model folders of `repository_dir` under the names they had before the names said what they serve
    (contract/names.py LEGACY_MODEL_NAMES: `mha_session`, `fortunes_mha_session`, ...) moved to today's names,
    their configs' names and implementations with them, so that a repository written before serves as it is,
    with no build. A legacy folder beside a folder of today's name is removed: Triton would load both, two KV
    budgets for one model. A legacy folder without its config (a checkout's default repository, whose configs
    git moved while the built files it ignores stayed) gives today's folder the versions it lacks. Says what it
    did, a line a folder."""
    repository = Path(repository_dir)
    done = []
    for folder in sorted(p for p in repository.iterdir() if p.is_dir()) if repository.is_dir() else ():
        current = names.current_model_name(folder.name)
        config_path = folder / triton_config.TRITON_CONFIG_FILENAME
        if current == folder.name:
            continue
        if not config_path.is_file():
            done += _versions_left_behind(folder, repository / current)
            continue
        config = triton_config.parse(config_path.read_text())
        if not _written_here(config):
            continue  # somebody's own model of a name like ours: never touched
        if (repository / current).exists():
            shutil.rmtree(folder)
            done.append(f"{folder}: removed, the old name of {current}, which {repository} holds")
        else:
            _rename_config(config, config_path, current)
            folder.rename(repository / current)
            done.append(f"{folder}: renamed {current} (the model's name since the names say what they serve)")
    return done


def _written_here(config) -> bool:
    """Whether a config is one `write_repository` wrote: a python model of ours (its implementation in this
    package, under today's module names or the old ones), or the onnxruntime backend's model."""
    if config.backend == "onnxruntime":
        return True
    implementation = config.parameters.get(triton_config.P_IMPLEMENTATION)
    return implementation is not None and implementation.string_value.startswith(triton_config.MODELS_PACKAGE + ".")


def _rename_config(config, config_path: Path, current: str) -> None:
    config.name = current
    if triton_config.P_IMPLEMENTATION in config.parameters:
        served = next(model for model in triton_config.IMPLEMENTATIONS if current.endswith(model))
        config.parameters[triton_config.P_IMPLEMENTATION].string_value = triton_config.IMPLEMENTATIONS[served]
    config_path.write_text(triton_config.to_text(config))


def _versions_left_behind(folder: Path, target: Path) -> list[str]:
    """`folder`'s version folders moved into `target` where it has a config and lacks them; `folder` removed once
    empty."""
    if not (target / triton_config.TRITON_CONFIG_FILENAME).is_file():
        return []
    moved = [
        version
        for version in sorted(folder.iterdir())
        if version.name.isdigit() and not (target / version.name).exists()
    ]
    for version in moved:
        version.rename(target / version.name)
    if not any(folder.iterdir()):
        folder.rmdir()
    return [f"{version}: moved to {target / version.name}, beside its renamed config" for version in moved]


def other_session_models(repository_dir: str | Path) -> tuple[str, ...]:
    """The session models of `repository_dir` beside `sessions`: those of its other model sets (the trained
    model's, a second served folder's), which the supervisor and /readyz probe too."""
    found = []
    for config_path in sorted(Path(repository_dir).glob(f"*/{triton_config.TRITON_CONFIG_FILENAME}")):
        config = triton_config.parse(config_path.read_text())
        if config.HasField("sequence_batching") and config.name != names.SESSION_MODEL:
            found.append(config.name)
    return tuple(found)
