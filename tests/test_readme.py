"""The README's examples, run as written against `python -m serving` with the default model.

Blocks preceded by `<!-- readme-test -->` are run (sh with bash, python with this interpreter)
with the README's addresses pointed at this test's ports; the `text` block after
`<!-- output -->` is what they must print. In it, `...` stands for any text within a line, a line
of just `...` for any number of lines, and a decimal number (a measured error or size) for any.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from contract.config import DEFAULT_PRESET, preset
from export.build import build
from export.progress import Progress
from serving.triton.config import ServingSettings
from serving.triton.repository import write_repository
from tests.fixtures.serving_process import serving_process

pytestmark = [pytest.mark.served, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- readme-test -->\n```(\w+)\n(.*?)```\n(?:<!-- output -->\n```text\n(.*?)```)?", re.DOTALL)


DECIMAL = re.compile(r"\d+\.\d+(?:e[-+]\d+)?")  # a measured error or size


def line_pattern(text: str) -> str:
    return DECIMAL.pattern.join(re.escape(piece) for piece in DECIMAL.split(text))


def readme_blocks() -> list[tuple[str, str, str]]:
    return [(lang, code, expected or "") for lang, code, expected in BLOCK.findall(README.read_text())]


def expected_pattern(expected: str) -> re.Pattern:
    lines = []
    for line in expected.rstrip("\n").splitlines():
        if line == "...":
            lines.append(r"(?:.*\n)*?")
        else:
            lines.append(".*".join(line_pattern(part) for part in line.split("...")) + r"\n")
    return re.compile("".join(lines))


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory):
    """`python -m serving` on a repository built from the default preset, as `make serve` runs it."""
    work = tmp_path_factory.mktemp("readme")
    artifacts = build(preset(DEFAULT_PRESET), work / "artifacts", progress=Progress(enabled=False))
    assert artifacts["passed"]
    repository = write_repository(work / "artifacts", work / "model_repository", ServingSettings(threads=1))
    with serving_process(repository, work) as served:
        yield served, work


def localize(code: str, served, work: Path) -> str:
    return (
        code.replace("/tmp/", f"{work}/")  # first: the interpreter's own path may be under /tmp
        .replace("127.0.0.1:8080", f"127.0.0.1:{served.gateway_port}")
        .replace("127.0.0.1:8001", f"127.0.0.1:{served.grpc_port}")
        .replace("127.0.0.1:8000", f"127.0.0.1:{served.http_port}")
        .replace(".venv/bin/python", sys.executable)
    )


def test_the_readme_has_runnable_examples():
    langs = [lang for lang, _, _ in readme_blocks()]
    assert langs.count("sh") >= 2 and langs.count("python") >= 2, langs


@pytest.mark.parametrize("index", range(len(readme_blocks())))
def test_readme_example(index, default_stack):
    served, work = default_stack
    lang, code, expected = readme_blocks()[index]
    command = ["bash", "-eo", "pipefail", "-c"] if lang == "sh" else [sys.executable, "-c"]
    proc = subprocess.run(
        [*command, localize(code, served, work)], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert expected_pattern(expected).fullmatch(proc.stdout), (
        f"README shows:\n{expected}\nbut it printed:\n{proc.stdout}"
    )


def test_the_curl_line_serving_prints_works(default_stack):
    served, _ = default_stack
    try_line = next(line for line in served.output().splitlines() if line.startswith("try "))
    proc = subprocess.run(
        ["bash", "-c", try_line.removeprefix("try").strip()],  # `| head -c 300` may cut curl short: no pipefail
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith('{"output":[[['), proc.stdout
