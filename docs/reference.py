"""Writes docs/reference.md from the code: every model config field, every flag of `python -m export`,
`python -m serving` and `python -m client`, every gateway setting, each with its default and meaning.

    python docs/reference.py           write it (`make reference`)
    python docs/reference.py --check   exit 1 when the file differs from what the code says now
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

REFERENCE = Path(__file__).resolve().parent / "reference.md"
HELP_WIDTH = "100"  # argparse wraps to $COLUMNS: fixed, so the file is the same on every terminal


def config_section() -> list[str]:
    from contract.config import FIELD_HELP, ModelConfig

    rows = [
        f"| `{field.name}` | `{json.dumps(field.default)}` | {FIELD_HELP[field.name]} |"
        for field in dataclasses.fields(ModelConfig)
    ]
    return [
        "## Model config",
        "",
        "A model's `config.json` (shipped with every artifact), `--config FILE` or `--config-json TEXT`:",
        "a JSON object with any of these fields, the rest at their defaults (`contract/config.py`).",
        "",
        "| field | default | meaning |",
        "|---|---|---|",
        *rows,
        "",
    ]


def command_sections(prog: str, parser: argparse.ArgumentParser) -> list[str]:
    """`prog --help`, then each subcommand's, as text blocks."""
    lines = [f"### `{prog}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for action in parser._actions:  # argparse keeps its subcommands here and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                lines += command_sections(f"{prog} {name}", sub)
    return lines


def commands_section() -> list[str]:
    from client.__main__ import _parser as client_parser
    from export.__main__ import parser as export_parser
    from serving.__main__ import parser as serving_parser

    return [
        "## Commands",
        "",
        "Each command's `--help`, as it prints it (defaults in parentheses).",
        "",
        *command_sections("python -m export", export_parser()),
        *command_sections("python -m serving", serving_parser()),
        *command_sections("python -m client", client_parser()),
    ]


def gateway_section() -> list[str]:
    from serving.gateway.settings import Settings

    rows = []
    for name, field in Settings.model_fields.items():
        default = "(none)" if field.default in ((), None) else f"`{field.default}`"
        rows.append(f"| `SERVING_{name.upper()}` | {default} | {field.description} |")
    return [
        "## Gateway settings",
        "",
        "Environment variables read by the gateway (`python -m serving`, `python -m serving.gateway`,",
        "the compose and Kubernetes files), by pydantic-settings (`serving/gateway/settings.py`).",
        "",
        "| variable | default | meaning |",
        "|---|---|---|",
        *rows,
        "",
    ]


def openai_fields_section() -> list[str]:
    from serving.gateway.openai_schemas import REFUSED

    rows = [f"| `{name}` | {why} |" for name, why in REFUSED.items()]
    return [
        "## OpenAI fields refused",
        "",
        "The fields of OpenAI's `POST /v1/completions` and `POST /v1/chat/completions` that would change the",
        "answer and that the gateway does not do: a request giving one is a 400 naming it",
        "(`serving/gateway/openai_schemas.py` `REFUSED`). Every other field is taken, or accepted and ignored",
        "where OpenAI documents it as advisory (`user`, `metadata`, `store`, `service_tier`, ...).",
        "",
        "| field | why |",
        "|---|---|",
        *rows,
        "",
    ]


def reference() -> str:
    from contract.files import PROJECT_ROOT

    os.environ["COLUMNS"] = HELP_WIDTH
    header = [
        "# Reference",
        "",
        "Generated from the code by `make reference` (`docs/reference.py`); `tests/test_guide.py` fails when",
        "it is stale. The guide: [guide.md](guide.md).",
        "",
    ]
    text = (
        "\n".join(
            [*header, *config_section(), *commands_section(), *gateway_section(), *openai_fields_section()]
        ).rstrip()
        + "\n"
    )
    return text.replace(str(PROJECT_ROOT), "<checkout>")  # defaults under the checkout, wherever it is


def main(argv: list[str]) -> int:
    text = reference()
    if argv == ["--check"]:
        if REFERENCE.read_text() != text:
            print(f"{REFERENCE} is stale: run `make reference` and commit it", file=sys.stderr)
            return 1
        return 0
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
