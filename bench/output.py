"""Where a benchmark works and what it leaves: a work folder (given, or a temporary one) and its
results as `<name>.json`, `<name>.png` and a table on stdout."""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def add_folder_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where to write results (default {RESULTS})")
    parser.add_argument("--work", type=Path, help="artifact and repository folder (default: a temporary one)")


@contextlib.contextmanager
def work_folder(work: Path | None, prefix: str) -> Iterator[Path]:
    """`work` (made if missing), or a temporary folder removed on leaving."""
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        root = work or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        yield root


def write_results(
    out: Path, name: str, results: dict, plot: Callable[[dict, Path], Path], table: Callable[[dict], str]
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out / f"{name}.png")
    print(table(results))
    print(f"wrote {out / f'{name}.json'} and {out / f'{name}.png'}")
