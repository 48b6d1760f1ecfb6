"""`python -m export`: build artifacts (the ONNX variants, each checked against the PyTorch original).

python -m export                      build the default preset into build/artifacts/seed
python -m export build --preset seed --out artifacts/seed
python -m export build --config my_config.json --out artifacts/mine
python -m export build --weights mha.pt --layout torch-mha --n-heads 8 --out artifacts/trained

With --weights the weights are a trained model's state dict in one of the layouts of
export/importers.py (seeds, torch-mha, hf, native); --config then gives only the fields the weights
do not determine (max_seq_len, norm_eps, residual). See docs/importing.md.

A Triton model repository is filled from an artifact by `python -m serving repository` (or built and
filled in one go by `python -m serving ensure`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from contract.arguments import comma_list
from contract.config import DEFAULT_PRESET, PRESETS, ModelConfig, preset
from contract.files import REPORT_FILENAME
from export.build import DEFAULT_VARIANTS, VARIANTS, BuildError, build, build_model
from export.importers import LAYOUTS, SourceMismatchError, import_weights
from export.report import origin_summary, summary_table

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
    source.add_argument(
        "--config",
        type=Path,
        help="a config.json (fields: contract/config.py); with --weights, the fields the weights do not determine",
    )
    if json_text:
        source.add_argument("--config-json", help="the config as JSON text (compose: an environment variable)")
    source.add_argument("--preset", choices=sorted(PRESETS), help=f"a named config (default: {DEFAULT_PRESET})")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="python -m export", description=__doc__.splitlines()[0])
    commands = root.add_subparsers(dest="command")
    b = commands.add_parser("build", help="export the ONNX variants of a config and check them against PyTorch")
    config_arguments(b)
    b.add_argument("--out", type=Path, required=True, help="the artifact directory to write")
    b.add_argument(
        "--variants",
        type=comma_list(VARIANTS, "variant"),
        help=f"comma-separated (default: every variant the config can have, of {','.join(DEFAULT_VARIANTS)})",
    )
    b.add_argument("--seed", type=int, help="weight initialization seed for random weights (default 0)")
    own = b.add_argument_group("a trained model's weights (docs/importing.md)")
    own.add_argument("--weights", type=Path, help="its state dict: .safetensors, or a torch.save'd state_dict")
    own.add_argument("--layout", choices=sorted(LAYOUTS), help="how its keys are named (export/importers.py)")
    own.add_argument("--n-heads", type=int, help="attention heads (the weights cannot tell)")
    own.add_argument("--n-kv-heads", type=int, help="key/value heads, instead of --n-heads (GQA)")
    return root


def build_and_report(cfg: ModelConfig, out: Path, variants: tuple[str, ...] | None = None, seed: int = 0) -> dict:
    """Build `cfg` into `out` and print the variants' table; raises BuildError (after printing the
    table) when a variant failed."""
    return _printing(lambda: build(cfg, out, variants, seed=seed), out)


def _printing(run: Callable[[], dict], out: Path) -> dict:
    try:
        report = run()
    except BuildError:
        print(summary_table(json.loads((out / REPORT_FILENAME).read_text())))
        raise
    print(summary_table(report))
    return report


def _misuse(args: argparse.Namespace) -> str | None:
    """Flags that do not go together (argparse cannot say so)."""
    weights, layout = getattr(args, "weights", None), getattr(args, "layout", None)
    if layout and not weights:
        return "--layout goes with --weights"
    if weights and not layout:
        return f"--weights needs --layout (one of {sorted(LAYOUTS)})"
    if weights and (args.preset or args.seed is not None):
        return "--preset and --seed make random weights; --weights brings its own"
    if not weights and (getattr(args, "n_heads", None) or getattr(args, "n_kv_heads", None)):
        return "--n-heads and --n-kv-heads go with --weights (a config gives n_heads)"
    return None


def given_fields(args: argparse.Namespace) -> dict:
    """What the caller says about a trained model: --config (any fields) and --n-heads/--n-kv-heads."""
    fields = {}
    if args.config:
        data = json.loads(args.config.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{args.config}: a config must be a JSON object, got {type(data).__name__}")
        fields.update(data)
    fields |= {name: getattr(args, name) for name in ("n_heads", "n_kv_heads") if getattr(args, name) is not None}
    return fields


def import_and_report(args: argparse.Namespace) -> int:
    """`build --weights`: import, prove against the source module, build; nothing is written when the
    weights do not fit or do not match their module."""
    try:
        imported = import_weights(args.weights, args.layout, given_fields(args))
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except SourceMismatchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    origin = {"weights": imported.weights, "source_check": imported.source_check}
    try:
        report = _printing(lambda: build_model(imported.model, args.out, args.variants, origin=origin), args.out)
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(origin_summary(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    misuse = _misuse(args) if args.command == "build" else None
    if misuse:
        print(f"error: {misuse}", file=sys.stderr)
        return 2
    if getattr(args, "weights", None):
        return import_and_report(args)
    try:
        cfg = config_from(args)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = args.out if args.command == "build" else DEFAULT_ARTIFACTS
    try:
        build_and_report(cfg, out, getattr(args, "variants", None), seed=getattr(args, "seed", None) or 0)
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.command is None:
        print(f"artifacts: {out}; serve them: python -m serving repository --artifacts {out} --repository R")
    return 0


if __name__ == "__main__":
    sys.exit(main())
