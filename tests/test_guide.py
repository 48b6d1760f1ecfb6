"""The user guide (docs/guide.md) and its reference (docs/reference.md, generated from the code by
docs/reference.py): the reference is what the code says now, it covers every setting, and every link
of the guide leads somewhere."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from contract.config import ModelConfig

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_the_reference_is_what_the_code_says_now():
    checked = subprocess.run(
        [sys.executable, str(DOCS / "reference.py"), "--check"], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stderr  # run `make reference` and commit docs/reference.md


def test_the_check_fails_on_a_stale_reference(tmp_path):
    """The --check compares the committed file: run on a copy of the generator beside an edited file."""
    (tmp_path / "reference.py").write_text((DOCS / "reference.py").read_text())
    (tmp_path / "reference.md").write_text((DOCS / "reference.md").read_text().replace("| `d_model` |", "| `width` |"))
    checked = subprocess.run(
        [sys.executable, str(tmp_path / "reference.py"), "--check"], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 1 and "is stale: run `make reference`" in checked.stderr


def _every_option(parser: argparse.ArgumentParser) -> set[str]:
    options = set()
    for action in parser._actions:
        options.update(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= _every_option(sub)
    return options


def test_the_reference_names_every_field_flag_and_setting():
    from client.__main__ import _parser as client_parser
    from export.__main__ import parser as export_parser
    from serving.__main__ import parser as serving_parser
    from serving.gateway.settings import Settings

    text = (DOCS / "reference.md").read_text()
    fields = [f"| `{field.name}` |" for field in dataclasses.fields(ModelConfig)]
    flags = [f for p in (export_parser(), serving_parser(), client_parser()) for f in sorted(_every_option(p))]
    settings = [f"`SERVING_{name.upper()}`" for name in Settings.model_fields]
    assert len(flags) > 40
    missing = [name for name in (*fields, *flags, *settings) if name not in text]
    assert not missing, missing
    assert "/work/" not in text and str(ROOT) not in text  # nothing of the machine that wrote it


def test_every_link_of_the_guide_leads_somewhere():
    guide = (DOCS / "guide.md").read_text()
    headings = {_anchor(line.lstrip("#").strip()) for line in guide.splitlines() if line.startswith("#")}
    reference_headings = {
        _anchor(line.lstrip("#").strip()) for line in (DOCS / "reference.md").read_text().splitlines()
        if line.startswith("#")
    }  # fmt: skip
    for target in re.findall(r"\]\(([^)\s]+)\)", guide):
        path, _, anchor = target.partition("#")
        if not path:
            assert anchor in headings, target
            continue
        assert (DOCS / path).exists(), target
        if path == "reference.md" and anchor:
            assert anchor in reference_headings, target


def _anchor(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_the_readme_sends_a_new_user_to_the_guide_first():
    readme = (ROOT / "README.md").read_text()
    first_link = re.search(r"\]\(([^)]+)\)", readme)
    assert first_link is not None and first_link.group(1) == "docs/guide.md"


def test_the_guides_blocks_said_to_be_run_are_the_readmes_run_blocks():
    """The guide's "Serve a Hugging Face checkpoint and call it with the OpenAI SDK" shows the README's
    examples: each block it marks as run by the README test is one the README test runs, as written."""
    from tests.test_readme import readme_blocks

    guide = (DOCS / "guide.md").read_text()
    marked = re.findall(r"<!-- run by the README test -->\n```\w+\n(.*?)```", guide, re.DOTALL)
    run = {code for _, code, _ in readme_blocks()}
    assert len(marked) >= 2
    assert all(code in run for code in marked), [code.splitlines()[0] for code in marked if code not in run]
