"""`python -m serving repository` and `python -m serving ensure`: a model repository from an artifact,
or from a config when the repository does not hold it yet (the export runs first, on the CPU).

python -m serving repository --artifacts build/artifacts/mine --repository my_repository
python -m serving ensure --repository /models --preset seed      build and fill unless it holds this model
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from contract import files
from contract.arguments import DefaultsHelp, comma_list, config_arguments, config_from
from contract.config import DEFAULT_PRESET, ModelConfig, preset
from contract.deployment import ENGINES, HOST_KINDS, KV_DTYPES, MODELS, PYTHON_MODELS, WEIGHT_DTYPES, ServingSettings
from contract.names import current_model_name

# The Triton configs and the repository (protobuf, tritonclient: half a second to import) are imported
# where they are used, so that a command's --help and usage errors answer at once.

DEFAULT_ARTIFACTS = files.DEFAULT_ARTIFACTS / DEFAULT_PRESET


def add_commands(commands) -> None:
    r = commands.add_parser(
        "repository", formatter_class=DefaultsHelp, help="fill a Triton model repository from an artifact directory"
    )
    r.add_argument("--artifacts", type=Path, required=True, help="an artifact directory (python -m export build)")
    r.add_argument("--repository", type=Path, required=True, help="the model repository to (over)write")
    _settings_arguments(r)
    e = commands.add_parser(
        "ensure", formatter_class=DefaultsHelp, help="build and fill a repository unless it already holds this model"
    )
    config_arguments(e, json_text=True)
    e.add_argument("--repository", type=Path, default=files.DEFAULT_REPOSITORY, help="default: %(default)s")
    e.add_argument("--artifacts", type=Path, help="where to build and keep the artifacts (default: a temporary dir)")
    e.add_argument(
        "--for",
        dest="host",
        choices=HOST_KINDS,
        help="build the graphs a host of this kind serves (an export container builds for the GPU host that "
        "serves them: tensorrt); default: this machine's kind",
    )
    _settings_arguments(e)


def model_names(text: str) -> tuple[str, ...]:
    """--models: comma-separated models of MODELS, their legacy names (`mha,mha_session`) taken as today's."""
    return comma_list(MODELS, "model")(",".join(current_model_name(name.strip()) for name in text.split(",")))


def _settings_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServingSettings()
    add = parser.add_argument
    add(
        "--models",
        type=model_names,
        default=MODELS,
        help=f"comma-separated (default: {','.join(MODELS)})",
    )
    add("--threads", type=int, default=defaults.threads, help="ONNX Runtime threads (0 = its default)")
    add(
        "--kv-cache-mib",
        type=float,
        default=defaults.kv_cache_bytes / (1 << 20),
        help="sessions: the KV cache budget of all sequences together (MiB)",
    )
    add(
        "--idle-timeout",
        type=float,
        default=defaults.idle_timeout_seconds,
        help="sessions: seconds after which an idle sequence loses its cache",
    )
    add(
        "--max-batch-size",
        type=int,
        default=defaults.max_batch_size,
        help="sessions (concat engine): the largest batch its TensorRT profile takes",
    )
    add(
        "--max-request-tokens",
        type=int,
        default=defaults.max_request_tokens,
        help="forward: batch x new tokens one request may compute (default: the config's max_seq_len)",
    )
    _engine_arguments(parser, defaults)


def _engine_arguments(parser: argparse.ArgumentParser, defaults: ServingSettings) -> None:
    """What the session model's engine and its graphs' forms are."""
    add = parser.add_argument
    add(
        "--engine",
        choices=ENGINES,
        default=defaults.engine,
        help="sessions: the slot pool over the static cache (default) or per-sequence caches batched by padding",
    )
    add(
        "--kv-dtype",
        choices=KV_DTYPES,
        default=defaults.kv_dtype,
        help="sessions (static): the cache's values: the graph's float (default), or int8/int4 (the quantized "
        "static graphs: 4x/8x the sessions of fp32 per byte, CPU only)",
    )
    add(
        "--weights-dtype",
        choices=WEIGHT_DTYPES,
        default=defaults.weights_dtype,
        help="both python models: the projections' weights: the graph's float (default), int8 (the INT8-weight "
        "graphs: a quarter of the weight bytes a step reads) or int4 (4 bits in blocks of 32: an eighth); CPU only, "
        "not with a quantized --kv-dtype",
    )
    add(
        "--min-row-positions",
        type=int,
        default=defaults.min_row_positions,
        help="sessions (static): the positions a session reserves at a time, from its START on, as it grows "
        "(max_seq_len: a full row per session)",
    )
    add(
        "--step-tokens",
        type=int,
        default=defaults.step_tokens,
        help="sessions: new tokens one step of the engine core runs: every decoding row's, then prompt chunks "
        "(a joining prompt holds the decoders up for at most one chunk)",
    )
    add(
        "--kept-per-owner",
        type=int,
        default=defaults.kept_per_owner,
        help="sessions: rows each owner (API key) keeps for prefix reuse after its stateless generations (0: none)",
    )
    add(
        "--generations-per-owner",
        type=int,
        default=defaults.generations_per_owner,
        help="sessions: an owner's generations running at once; more wait their turn (0: no cap)",
    )


def settings_from(args: argparse.Namespace) -> ServingSettings:
    return ServingSettings(
        threads=args.threads,
        kv_cache_bytes=int(args.kv_cache_mib * (1 << 20)),
        idle_timeout_seconds=args.idle_timeout,
        max_batch_size=args.max_batch_size,
        engine=args.engine,
        kv_dtype=args.kv_dtype,
        weights_dtype=args.weights_dtype,
        min_row_positions=args.min_row_positions,
        max_request_tokens=args.max_request_tokens,
        step_tokens=args.step_tokens,
        kept_per_owner=args.kept_per_owner,
        generations_per_owner=args.generations_per_owner,
    )


class BuildFailed(Exception):
    """`python -m export build` failed. `status`: its exit status (2: the input it was given, a config or weights;
    1: a variant that failed, whose passing siblings stay in the artifacts)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def cannot_build() -> str | None:
    """Why this environment cannot run the build (a serving-only one, the Triton image, lacks the export extra),
    or None when it can. Found without importing anything."""
    missing = [name for name in ("torch", "onnxscript", "export") if importlib.util.find_spec(name) is None]
    return f"it lacks {', '.join(missing)}; install the export extra" if missing else None


def export_build(arguments: list[str], out: Path, shown: bool = False) -> dict:
    """`python -m export build ARGUMENTS --out OUT` run as a process of its own, so that no server process ever
    imports the build (torch, the exporter), and the build's report. `shown`: its stages and table go to this
    process's output, else they are kept and the last lines of what it said are the error's (BuildFailed)."""
    reason = cannot_build()
    if reason:
        raise BuildFailed(f"this environment cannot build ({reason})", status=2)
    command = [sys.executable, "-m", "export", "build", *arguments, "--out", str(out)]
    done = subprocess.run(command, capture_output=not shown, text=True, check=False)
    if done.returncode != 0:
        said = "" if shown else "; it said:\n" + "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
        raise BuildFailed(f"`python -m export build` exited {done.returncode} building {out}{said}", done.returncode)
    return json.loads((out / files.REPORT_FILENAME).read_text())


def export_to(
    cfg: ModelConfig,
    repository: Path,
    artifacts: Path,
    settings: ServingSettings | None = None,
    models: tuple[str, ...] = MODELS,
    shown: bool = False,
    host: str | None = None,
) -> dict:
    """Build `cfg` into `artifacts` (export, on the CPU) with the variants a `host` of that kind serves
    (export/choices.py: cpu, cuda, tensorrt; None: this machine's kind), fill `repository` from it and
    return the build's report (`shown`: as `export_build`).

    A failing variant still fails (BuildFailed), but the repository is filled from the variants that
    passed: a failed fp16 graph must not keep `python -m serving` from starting on the CPU. A KV dtype
    whose graph is built only when asked for (int8, int4) adds it to the build.
    """
    from serving.engine.placement import host_kind
    from serving.triton.repository import asked_variants, write_repository

    variants = (host or host_kind(), *asked_variants(settings or ServingSettings()))
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="config-") as where:
        given = cfg.save(where)
        try:
            report = export_build(["--config", str(given), "--variants", ",".join(variants)], artifacts, shown)
        except BuildFailed:
            if _built_now(artifacts, cfg, started):  # a variant failed: the variants that passed are served
                write_repository(artifacts, repository, settings, models)
            raise
    write_repository(artifacts, repository, settings, models)
    return report


def _built_now(artifacts: Path, cfg: ModelConfig, since: float) -> bool:
    """Whether `artifacts` holds a build of `cfg` that ended after `since` (a build whose variant failed puts its
    report and the passing variants in place; one that failed otherwise leaves the folder as it was, which may
    hold another model's build)."""
    report = artifacts / files.REPORT_FILENAME
    try:
        return report.stat().st_mtime >= since and ModelConfig.load(artifacts) == cfg
    except (OSError, ValueError):
        return False


def export_default(
    repository: Path = files.DEFAULT_REPOSITORY, artifacts: Path = DEFAULT_ARTIFACTS, shown: bool = False
) -> dict:
    """The default preset into `repository` (what `python -m serving` does when the repository lacks
    it); the build's report, as `export_to`."""
    return export_to(preset(DEFAULT_PRESET), repository, artifacts, shown=shown)


TRAINED_PREFIX = f"{files.TRAINED_MODEL_NAME}_"  # the trained model's Triton models: fortunes_sessions, ...


def trained_model() -> str:
    """The Triton model of the model trained here (files.TRAINED_MODEL): its session model, which generates."""
    from serving.triton.config import SESSIONS

    return f"{TRAINED_PREFIX}{SESSIONS}"


def has_trained(repository: Path) -> bool:
    """Whether `repository` holds the trained model's session model."""
    from serving.triton.repository import is_complete

    return is_complete(repository, (trained_model(),))


def export_checkpoint(folder: Path, artifacts: Path, variants: tuple[str, ...] = (), shown: bool = False) -> dict:
    """A Hugging Face checkpoint folder imported, proven and built with `variants` (none named: those this machine
    serves) into `artifacts`, its held-out text (held_out.txt beside it) scored through each (export/quality.py);
    the build's report."""
    arguments = ["--weights", str(folder), "--layout", "hf"]
    return export_build([*arguments, "--variants", ",".join(variants)] if variants else arguments, artifacts, shown)


def export_trained(
    repository: Path = files.DEFAULT_REPOSITORY,
    artifacts: Path = files.TRAINED_ARTIFACTS,
    shown: bool = False,
    folder: Path = files.TRAINED_MODEL,
    variants: tuple[str, ...] = (),
) -> dict:
    """The model trained here (a Hugging Face folder in the checkout) built as `export_checkpoint` and written
    into `repository` beside the default model under its own names (TRAINED_PREFIX); the build's report."""
    from serving.triton.config import SESSIONS
    from serving.triton.repository import write_repository

    report = export_checkpoint(folder, artifacts, variants, shown)
    write_repository(artifacts, repository, models=(SESSIONS,), prefix=TRAINED_PREFIX)
    return report


def export_folder(
    folder: Path, shown: bool = False, root: Path = files.DEFAULT_ARTIFACTS, artifacts: Path | None = None
) -> Path:
    """A Hugging Face checkpoint folder built as `export_checkpoint` with the variants this machine serves into
    artifacts named by the digest of its files (`folder_artifacts`, unless the caller has it already: the digest
    reads every byte of the checkpoint): built once, reused while the folder is the same (another checkpoint in
    the same folder builds anew). The artifacts' folder."""
    artifacts = artifacts or folder_artifacts(folder, root)
    report = artifacts / files.REPORT_FILENAME
    if report.is_file() and json.loads(report.read_text()).get("passed"):
        return artifacts
    export_checkpoint(folder, artifacts, shown=shown)
    return artifacts


def folder_artifacts(folder: Path, root: Path = files.DEFAULT_ARTIFACTS) -> Path:
    """Where `export_folder` builds `folder`: under its name and the digest of its files."""
    return root / f"{folder.resolve().name}-{folder_digest(folder)[:16]}"


def served_folders_repository(served: list[tuple[Path, str]]) -> tuple[Path, dict[str, str]]:
    """One repository for served folders' artifacts (`python -m serving FOLDER ...`), each (artifacts, model id),
    rewritten from them each time (it is cheap: configs and links): the first as the repository's own models, each
    other as a session model of its own. The repository, and the other ids -> their Triton session models."""
    from serving.triton.config import FORWARD, SESSIONS
    from serving.triton.repository import write_repository

    repository = files.PROJECT_ROOT / "build" / "served" / "+".join(name for _, name in served)
    (first, _), more = served[0], {}
    write_repository(first, repository, models=(FORWARD, SESSIONS))
    for artifacts, name in served[1:]:
        prefix = re.sub(r"[^A-Za-z0-9_.-]", "_", name) + "_"  # what Triton takes in a model's name
        write_repository(artifacts, repository, models=(SESSIONS,), prefix=prefix)
        more[name] = f"{prefix}{SESSIONS}"
    return repository, more


def folder_digest(folder: Path) -> str:
    """One sha256 over the names and sha256s of a folder's files (hidden ones left out), as the text files'."""
    from contract.generation import text_digest  # numpy with it: `python -m serving --help` loads neither

    found = sorted(path for path in folder.rglob("*") if path.is_file() and not path.name.startswith("."))
    return text_digest({str(path.relative_to(folder)): files.sha256(path) for path in found})


def up_to_date(
    repository: Path, cfg: ModelConfig, models: tuple[str, ...] = MODELS, settings: ServingSettings | None = None
) -> bool:
    """Whether `repository` holds every model of `models` built from `cfg` with these settings, i.e.
    the configs it would write now (nothing to do)."""
    from serving.triton.config import FORWARD_ONNX, TRITON_CONFIG_FILENAME, to_text
    from serving.triton.repository import ONNX_BACKEND_VARIANT, is_complete, model_configs

    if not is_complete(repository, tuple(m for m in models if m in PYTHON_MODELS)):
        return False
    if not all((repository / m / TRITON_CONFIG_FILENAME).is_file() for m in models):
        return False  # a model asked for now that an earlier run left out
    if any(ModelConfig.load(repository / m / "1") != cfg for m in models if (repository / m / "1").is_dir()):
        return False
    graphs = (path.name for model in models for path in (repository / model / "1").glob("model.*.onnx"))
    present = {name.removeprefix("model.").removesuffix(".onnx") for name in graphs}
    if FORWARD_ONNX in models:
        present.add(ONNX_BACKEND_VARIANT)
    expected = model_configs(cfg, present, settings)
    return all((repository / m / TRITON_CONFIG_FILENAME).read_text() == to_text(expected[m]) for m in models)


def run_repository(args: argparse.Namespace) -> int:
    from serving.triton.repository import RepositoryError, rename_legacy_models, write_repository

    try:
        for line in rename_legacy_models(args.repository):
            print(line)
        write_repository(args.artifacts, args.repository, settings_from(args), args.models)
    except (OSError, ValueError, RepositoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"model repository: {args.repository} ({', '.join(args.models)})")
    print_capacity(ModelConfig.load(args.artifacts), settings_from(args), args.models)
    return 0


def print_capacity(cfg: ModelConfig, settings: ServingSettings | None, models: tuple[str, ...]) -> None:
    """What the session model's KV budget holds (config.capacity_lines), when the repository has it."""
    from serving.triton.config import SESSIONS, capacity_lines

    if SESSIONS in models:
        for line in capacity_lines(cfg, settings or ServingSettings()):
            print(line)


def _artifacts_folder(given: Path | None) -> contextlib.AbstractContextManager:
    """Where `ensure` builds: the folder given (kept), else a temporary one."""
    return contextlib.nullcontext(given) if given else tempfile.TemporaryDirectory(prefix="export-")


def run_ensure(args: argparse.Namespace) -> int:
    """The one-shot export of a deployment (compose's `export` service): the build's table, the
    repository and what its KV budget holds."""
    from serving.triton.repository import RepositoryError, rename_legacy_models

    try:
        cfg, settings = config_from(args), settings_from(args)
        for line in rename_legacy_models(args.repository):
            print(line)
        if up_to_date(args.repository, cfg, args.models, settings):
            print(f"model repository {args.repository} already holds this model; nothing to build")
            return 0
        with _artifacts_folder(args.artifacts) as where:
            export_to(cfg, args.repository, Path(where), settings, args.models, shown=True, host=args.host)
        print(f"model repository: {args.repository}")
        print_capacity(cfg, settings, args.models)
    except BuildFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return error.status if error.status in (1, 2) else 1  # a build killed by a signal: a failed build
    except (OSError, ValueError, RepositoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
