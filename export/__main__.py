"""`python -m export`: build artifacts and fill the Triton model repository.

python -m export                      build the default preset into build/artifacts/seed, fill model_repository/
python -m export build --preset seed --out artifacts/seed
python -m export build --config my_config.json --out artifacts/mine
python -m export repository --artifacts artifacts/mine --repository my_repository
python -m export ensure --repository /models --preset seed    build and fill only if the repository lacks this model
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from export.build import DEFAULT_VARIANTS, VARIANTS, BuildError, build
from export.config import DEFAULT_PRESET, PRESETS, ModelConfig, preset
from export.report import summary_table
from export.repository import ONNX_BACKEND_VARIANT, RepositoryError, is_complete, model_configs, write_repository
from export.triton_config import CONFIG_FILENAME, ENGINES, MHA_ONNX, MODELS, PYTHON_MODELS, ServingSettings, to_text

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARTIFACTS = PROJECT_ROOT / "build" / "artifacts" / DEFAULT_PRESET  # git-ignored
DEFAULT_REPOSITORY = PROJECT_ROOT / "model_repository"


def _config(args: argparse.Namespace) -> ModelConfig:
    if getattr(args, "config_json", None):
        return ModelConfig.from_json(args.config_json)
    if args.config:
        return ModelConfig.load(args.config)
    return preset(args.preset or DEFAULT_PRESET)


def _variants(text: str) -> tuple[str, ...]:
    chosen = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    return chosen


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="python -m export", description=__doc__.splitlines()[0])
    commands = root.add_subparsers(dest="command")
    b = commands.add_parser("build", help="export the ONNX variants of a config and check them against PyTorch")
    source = b.add_mutually_exclusive_group()
    source.add_argument("--config", type=Path, help="a config.json (see export/config.py for the fields)")
    source.add_argument("--preset", choices=sorted(PRESETS), help=f"a named config (default: {DEFAULT_PRESET})")
    b.add_argument("--out", type=Path, required=True, help="the artifact directory to write")
    b.add_argument(
        "--variants",
        type=_variants,
        help=f"comma-separated (default: every variant the config can have, of {','.join(DEFAULT_VARIANTS)})",
    )
    b.add_argument("--seed", type=int, default=0, help="weight initialization seed")
    r = commands.add_parser("repository", help="fill a Triton model repository from an artifact directory")
    r.add_argument("--artifacts", type=Path, required=True, help="an artifact directory from `build`")
    r.add_argument("--repository", type=Path, required=True, help="the model repository to (over)write")
    _serving_arguments(r)
    e = commands.add_parser("ensure", help="build and fill a repository unless it already holds this model")
    source = e.add_mutually_exclusive_group()
    source.add_argument("--config", type=Path, help="a config.json")
    source.add_argument("--config-json", help="the config as JSON text (compose: an environment variable)")
    source.add_argument("--preset", choices=sorted(PRESETS), help=f"a named config (default: {DEFAULT_PRESET})")
    e.add_argument("--repository", type=Path, required=True, help="the model repository to fill")
    e.add_argument("--artifacts", type=Path, help="where to build and keep the artifacts (default: a temporary dir)")
    _serving_arguments(e)
    return root


def _serving_arguments(r) -> None:
    defaults = ServingSettings()
    r.add_argument("--models", type=_models, default=MODELS, help=f"comma-separated, default {','.join(MODELS)}")
    r.add_argument("--threads", type=int, default=defaults.threads, help="ONNX Runtime threads (0 = its default)")
    r.add_argument(
        "--kv-cache-mib",
        type=float,
        default=defaults.kv_cache_bytes / (1 << 20),
        help="mha_session: the KV cache budget of all sequences together (MiB)",
    )
    r.add_argument(
        "--idle-timeout",
        type=float,
        default=defaults.idle_timeout_seconds,
        help="mha_session: seconds after which an idle sequence loses its cache",
    )
    r.add_argument(
        "--max-batch-size", type=int, default=defaults.max_batch_size, help="mha_session: sequences per execute()"
    )
    r.add_argument(
        "--engine",
        choices=ENGINES,
        default=defaults.engine,
        help="mha_session: the slot pool over the static cache (default) or per-sequence caches batched by padding",
    )


def _models(text: str) -> tuple[str, ...]:
    chosen = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in chosen if m not in MODELS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    return chosen


def _settings(args: argparse.Namespace) -> ServingSettings:
    return ServingSettings(
        threads=args.threads,
        kv_cache_bytes=int(args.kv_cache_mib * (1 << 20)),
        idle_timeout_seconds=args.idle_timeout,
        max_batch_size=args.max_batch_size,
        engine=args.engine,
    )


def export_default(repository: Path = DEFAULT_REPOSITORY, artifacts: Path = DEFAULT_ARTIFACTS) -> Path:
    """Build the default preset and fill `repository` with it (what `python -m export` does)."""
    return export_to(preset(DEFAULT_PRESET), repository, artifacts)


def export_to(
    cfg: ModelConfig,
    repository: Path,
    artifacts: Path,
    settings: ServingSettings | None = None,
    models: tuple[str, ...] = MODELS,
) -> Path:
    """Build `cfg` into `artifacts` and fill `repository` from it.

    A failing variant still fails the command (BuildError), but the repository is filled from the
    variants that passed: a failed fp16 graph must not keep `python -m serving` from starting.
    """
    try:
        report = build(cfg, artifacts)
    except BuildError:
        print(summary_table(_read_report(artifacts)))
        write_repository(artifacts, repository, settings, models)
        raise
    print(summary_table(report))
    write_repository(artifacts, repository, settings, models)
    print(f"model repository: {repository}")
    return repository


def up_to_date(
    repository: Path, cfg: ModelConfig, models: tuple[str, ...] = MODELS, settings: ServingSettings | None = None
) -> bool:
    """Whether `repository` holds every model of `models` built from `cfg` with these settings, i.e.
    the configs it would write now (nothing to do)."""
    python_models = tuple(m for m in models if m in PYTHON_MODELS)
    if not is_complete(repository, python_models):
        return False
    if any(ModelConfig.load(repository / m / "1") != cfg for m in models if (repository / m / "1").is_dir()):
        return False
    present = {
        p.name.removeprefix("model.").removesuffix(".onnx")
        for m in models
        for p in (repository / m / "1").glob("model.*.onnx")
    }
    if MHA_ONNX in models:
        present.add(ONNX_BACKEND_VARIANT)
    expected = model_configs(cfg, present, settings)
    return all((repository / m / CONFIG_FILENAME).read_text() == to_text(expected[m]) for m in models)


def _ensure(args: argparse.Namespace) -> int:
    """`ensure`: the one-shot export of a deployment (compose's `export` service)."""
    try:
        cfg = _config(args)
        settings = _settings(args)
        if up_to_date(args.repository, cfg, args.models, settings):
            print(f"model repository {args.repository} already holds this model; nothing to build")
            return 0
        if args.artifacts:
            export_to(cfg, args.repository, args.artifacts, settings, args.models)
        else:
            with tempfile.TemporaryDirectory(prefix="export-") as scratch:
                export_to(cfg, args.repository, Path(scratch), settings, args.models)
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (OSError, ValueError, RepositoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _repository(args: argparse.Namespace) -> int:
    try:
        settings = _settings(args)
        write_repository(args.artifacts, args.repository, settings, args.models)
    except (OSError, ValueError, RepositoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"model repository: {args.repository} ({', '.join(args.models)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    commands = {None: _default, "build": _build, "repository": _repository, "ensure": _ensure}
    return commands[args.command](args)


def _default(args: argparse.Namespace) -> int:
    try:
        export_default()
    except (BuildError, RepositoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def _build(args: argparse.Namespace) -> int:
    try:
        cfg = _config(args)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        report = build(cfg, args.out, args.variants, seed=args.seed)
    except BuildError as error:
        print(summary_table(_read_report(args.out)))
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(summary_table(report))
    return 0


def _read_report(out: Path) -> dict:
    import json

    from export.artifacts import REPORT_FILENAME

    return json.loads((out / REPORT_FILENAME).read_text())


if __name__ == "__main__":
    sys.exit(main())
