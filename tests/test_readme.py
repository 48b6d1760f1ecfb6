"""The README's examples, run as written against `python -m serving` with the default model.

Blocks preceded by `<!-- readme-test -->` are run (sh with bash, python with this interpreter)
with the README's addresses pointed at this test's ports and `$WORK` at a folder of the test's own;
the `text` block after `<!-- output -->` is what they must print. In it, `...` stands for any text
within a line, a line of just `...` for any number of lines, and a decimal number for a measured one
close to it: a measured error (`1.94e-07`) within a factor of 2 (the same seeds give other roundings
on another CPU's kernels, never another order), a size or any other decimal within 10%.
"""

from __future__ import annotations

import os
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
ERROR_FACTOR, SIZE_TOLERANCE = 2.0, 0.10


def line_pattern(text: str) -> str:
    return f"({DECIMAL.pattern})".join(re.escape(piece) for piece in DECIMAL.split(text))


def number_is_close(shown: str, printed: str) -> bool:
    shown_value, printed_value = float(shown), float(printed)
    if "e" in shown:
        return shown_value / ERROR_FACTOR <= printed_value <= shown_value * ERROR_FACTOR
    return abs(printed_value - shown_value) <= SIZE_TOLERANCE * abs(shown_value)


def stale_numbers(expected: str, printed: str) -> list[str]:
    """The README's numbers that the run printed far from (`shown -> printed`)."""
    found = expected_pattern(expected).fullmatch(printed)
    assert found is not None
    shown = [number for line in expected.splitlines() if line != "..." for number in DECIMAL.findall(line)]
    return [f"{a} -> {b}" for a, b in zip(shown, found.groups(), strict=True) if not number_is_close(a, b)]


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
        code.replace("127.0.0.1:8080", f"127.0.0.1:{served.gateway_port}")
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
        [*command, localize(code, served, work)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False, env={**os.environ, "WORK": str(work)},
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert expected_pattern(expected).fullmatch(proc.stdout), (
        f"README shows:\n{expected}\nbut it printed:\n{proc.stdout}"
    )
    assert not stale_numbers(expected, proc.stdout), f"README numbers stale: {stale_numbers(expected, proc.stdout)}"


def test_the_examples_write_under_a_folder_of_the_users_own():
    """Two users on one machine must not collide in a fixed /tmp path."""
    assert "/tmp/" not in README.read_text()
    assert "export WORK=$(mktemp -d)" in README.read_text()


def test_a_stale_number_is_caught_and_a_close_one_passes():
    table = "fp32 0.50 2.15e-06 pass\n"
    assert stale_numbers(table, "fp32 0.52 3.90e-06 pass\n") == []
    assert stale_numbers(table, "fp32 0.50 2.15e-05 pass\n") == ["2.15e-06 -> 2.15e-05"]
    assert stale_numbers(table, "fp32 0.80 1.20e-06 pass\n") == ["0.50 -> 0.80"]


def test_the_curl_line_serving_prints_works(default_stack):
    served, _ = default_stack
    try_line = next(line for line in served.output().splitlines() if line.startswith("try "))
    proc = subprocess.run(
        ["bash", "-c", try_line.removeprefix("try").strip()],  # `| head -c 300` may cut curl short: no pipefail
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith('{"output":[[['), proc.stdout
