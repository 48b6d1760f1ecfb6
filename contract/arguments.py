"""Command-line argument types the export and serving commands share. Pure Python."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection
from pathlib import Path

from contract.config import DEFAULT_PRESET, PRESETS, ModelConfig, preset


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, where it has one the help does not already name."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return help_text
        if "(default" in help_text or "default:" in help_text:
            return help_text
        return super()._get_help_string(action)


def comma_list(choices: Collection[str], what: str) -> Callable[[str], tuple[str, ...]]:
    """An argparse `type`: comma-separated names, each one of `choices` (`what` names them in the error)."""

    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(name.strip() for name in text.split(",") if name.strip())
        unknown = [name for name in chosen if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {unknown}; choose from {list(choices)}")
        return chosen

    return parse


def config_arguments(parser: argparse.ArgumentParser, json_text: bool = False) -> None:
    """--config FILE | --preset NAME (| --config-json TEXT): which model config a command builds."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--config",
        type=Path,
        help="a config.json (fields: contract/config.py); with --weights, the fields the weights do not determine",
    )
    if json_text:
        source.add_argument("--config-json", help="the config as JSON text (compose: an environment variable)")
    source.add_argument("--preset", choices=sorted(PRESETS), help=f"a named config (default: {DEFAULT_PRESET})")


def config_from(args: argparse.Namespace) -> ModelConfig:
    """The config `--config-json`, `--config` or `--preset` names (the default preset without any)."""
    if getattr(args, "config_json", None):
        return ModelConfig.from_json(args.config_json)
    if getattr(args, "config", None):
        return ModelConfig.load(args.config)
    return preset(getattr(args, "preset", None) or DEFAULT_PRESET)
