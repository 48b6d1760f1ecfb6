"""`python -m export`: build artifacts (the ONNX variants, each checked against the PyTorch original).

python -m export                      build the default preset into build/artifacts/seed
python -m export build --preset seed --out artifacts/seed
python -m export build --config my_config.json --out artifacts/mine

A Triton model repository is filled from an artifact by `python -m serving repository` (or built and
filled in one go by `python -m serving ensure`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from contract.config import DEFAULT_PRESET, PRESETS, ModelConfig, preset
from contract.files import REPORT_FILENAME
from export.build import DEFAULT_VARIANTS, VARIANTS, BuildError, build
from export.report import summary_table

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARTIFACTS = PROJECT_ROOT / "build" / "artifacts" / DEFAULT_PRESET  # git-ignored


def config_from(args: argparse.Namespace) -> ModelConfig:
    """The config `--config-json`, `--config` or `--preset` names (the default preset without any)."""
    if getattr(args, "config_json", None):
        return ModelConfig.from_json(args.config_json)
    if getattr(args, "config", None):
        return ModelConfig.load(args.config)
    return preset(getattr(args, "preset", None) or DEFAULT_PRESET)


def config_arguments(parser: argparse.ArgumentParser, json_text: bool = False) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", type=Path, help="a config.json (see contract/config.py for the fields)")
    if json_text:
        source.add_argument("--config-json", help="the config as JSON text (compose: an environment variable)")
    source.add_argument("--preset", choices=sorted(PRESETS), help=f"a named config (default: {DEFAULT_PRESET})")


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
    config_arguments(b)
    b.add_argument("--out", type=Path, required=True, help="the artifact directory to write")
    b.add_argument(
        "--variants",
        type=_variants,
        help=f"comma-separated (default: every variant the config can have, of {','.join(DEFAULT_VARIANTS)})",
    )
    b.add_argument("--seed", type=int, default=0, help="weight initialization seed")
    return root


def build_and_report(cfg: ModelConfig, out: Path, variants: tuple[str, ...] | None = None, seed: int = 0) -> dict:
    """Build `cfg` into `out` and print the variants' table; raises BuildError (after printing the
    table) when a variant failed."""
    try:
        report = build(cfg, out, variants, seed=seed)
    except BuildError:
        print(summary_table(json.loads((out / REPORT_FILENAME).read_text())))
        raise
    print(summary_table(report))
    return report


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = config_from(args)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = args.out if args.command == "build" else DEFAULT_ARTIFACTS
    try:
        build_and_report(cfg, out, getattr(args, "variants", None), seed=getattr(args, "seed", 0))
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.command is None:
        print(f"artifacts: {out}; serve them: python -m serving repository --artifacts {out} --repository R")
    return 0


if __name__ == "__main__":
    sys.exit(main())
