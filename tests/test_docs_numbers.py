"""Every number docs/ claims names where it came from: each section (a heading to the next) that states a
measurement (a figure in ms, µs, tokens/s, steps/s, GB/s) names a commit and the machine, so that a reader can
tell what was measured where, and a later session which figures a change made stale. docs/reference.md is
generated from the code and holds defaults, not measurements."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
MEASUREMENT = re.compile(r"\d[\d.,]*\s?(ms|µs|us|tok/s|tokens/s|steps/s|GB/s|GiB/s|MB/s)\b")
# a short or full sha: hex with a letter, or all digits where the word "commit" says so
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b|\bcommits? [0-9]{7,40}\b")
# a named CPU or GPU, or a core count ("engine core" or "the machine" alone name none)
MACHINE = re.compile(r"EPYC|Xeon|H100|H200|AVX|VNNI|\b\d+[- ]cores?\b")
HEADING = re.compile(r"^#{1,4} ", re.MULTILINE)
FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)  # a `# comment` in a code block is no heading


def unnamed_measurements(text: str) -> list[str]:
    """The headings of the sections that state a measurement without a commit or without a machine."""
    text = FENCED.sub(lambda block: block.group().replace("#", "_"), text)
    starts = [0, *(match.start() for match in HEADING.finditer(text)), len(text)]
    found = []
    for start, end in itertools.pairwise(starts):
        section = text[start:end]
        if MEASUREMENT.search(section) and not (COMMIT.search(section) and MACHINE.search(section)):
            found.append(section.strip().splitlines()[0] if section.strip() else "(the top)")
    return found


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md") if p.name != "reference.md"))
def test_each_measured_section_names_its_commit_and_machine(page):
    assert not unnamed_measurements((DOCS / page).read_text()), unnamed_measurements((DOCS / page).read_text())


def test_the_check_sees_a_figure_with_no_commit_or_no_machine():
    named = "## Decode\n\nMeasured at 3a95856 on the 2-core AVX2 EPYC: 3.81 ms a step.\n"
    assert unnamed_measurements(named) == []
    assert unnamed_measurements("## Decode\n\n3.81 ms a step on the AVX2 EPYC.\n") == ["## Decode"]
    assert unnamed_measurements("## Decode\n\nAt 3a95856: 3.81 ms a step.\n") == ["## Decode"]
    assert unnamed_measurements("## Words\n\nNo figure here, 3 steps.\n") == []
    assert unnamed_measurements("## Decode\n\nWith commit 3479407 on the H200: 0.9 ms.\n") == []  # all digits
    assert unnamed_measurements("## Decode\n\nAt 3a95856, the engine core: 3.81 ms a step.\n") == ["## Decode"]
    fenced = "## Decode\n\nAt 3a95856 on the H100:\n\n```bash\n# a comment, not a heading\nrun\n```\n\n3.81 ms.\n"
    assert unnamed_measurements(fenced) == []
