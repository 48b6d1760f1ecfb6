"""The parser of a command line's subcommands (`python -m serving repository`, `python -m client
infer`, ...): `add_subparsers(parser_class=CommandParser)`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser. An argument it does not know is its own usage error: argparse otherwise
    hands it up to the top-level parser, whose usage shows none of the subcommand's flags."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)  # `--weights` must not pass for `--weights-dtype`
        super().__init__(*args, **kwargs)

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras
