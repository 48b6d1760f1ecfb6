"""`python -m export`: build artifacts and fill the Triton model repository.

python -m export                      build the default preset into build/artifacts/seed, fill model_repository/
python -m export build --preset seed --out artifacts/seed
python -m export build --config my_config.json --out artifacts/mine
python -m export repository --artifacts artifacts/mine --repository my_repository
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from export.build import DEFAULT_VARIANTS, VARIANTS, BuildError, build
from export.config import DEFAULT_PRESET, PRESETS, ModelConfig, preset
from export.report import summary_table
from export.repository import RepositoryError, write_repository
from export.triton_config import MODELS, ServingSettings

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARTIFACTS = PROJECT_ROOT / "build" / "artifacts" / DEFAULT_PRESET  # git-ignored
DEFAULT_REPOSITORY = PROJECT_ROOT / "model_repository"


def _config(args: argparse.Namespace) -> ModelConfig:
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
    _repository_parser(commands)
    return root


def _repository_parser(commands) -> None:
    defaults = ServingSettings()
    r = commands.add_parser("repository", help="fill a Triton model repository from an artifact directory")
    r.add_argument("--artifacts", type=Path, required=True, help="an artifact directory from `build`")
    r.add_argument("--repository", type=Path, required=True, help="the model repository to (over)write")
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
    )


def export_default(repository: Path = DEFAULT_REPOSITORY, artifacts: Path = DEFAULT_ARTIFACTS) -> Path:
    """Build the default preset and fill `repository` with it (what `python -m export` does).

    A failing variant still fails the command (BuildError), but the repository is filled from the
    variants that passed: a failed fp16 graph must not keep `python -m serving` from starting.
    """
    try:
        report = build(preset(DEFAULT_PRESET), artifacts)
    except BuildError:
        print(summary_table(_read_report(artifacts)))
        write_repository(artifacts, repository)
        raise
    print(summary_table(report))
    write_repository(artifacts, repository)
    print(f"model repository: {repository}")
    return repository


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
    if args.command is None:
        try:
            export_default()
        except (BuildError, RepositoryError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        return 0
    if args.command == "repository":
        return _repository(args)
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
