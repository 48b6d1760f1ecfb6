"""Command-line argument types the export and serving commands share. Pure Python."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection


def comma_list(choices: Collection[str], what: str) -> Callable[[str], tuple[str, ...]]:
    """An argparse `type`: comma-separated names, each one of `choices` (`what` names them in the error)."""

    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(name.strip() for name in text.split(",") if name.strip())
        unknown = [name for name in chosen if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {unknown}; choose from {list(choices)}")
        return chosen

    return parse
