"""`python -m export`: build artifacts and fill the Triton model repository.

python -m export build --preset seed --out artifacts/seed
python -m export build --config my_config.json --out artifacts/mine
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from export.build import DEFAULT_VARIANTS, VARIANTS, BuildError, build
from export.config import DEFAULT_PRESET, PRESETS, ModelConfig, preset
from export.report import summary_table


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
        default=DEFAULT_VARIANTS,
        help=f"comma-separated, default {','.join(DEFAULT_VARIANTS)}",
    )
    b.add_argument("--seed", type=int, default=0, help="weight initialization seed")
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command != "build":
        parser().print_help()
        return 2
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
