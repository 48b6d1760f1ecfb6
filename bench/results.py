"""What the served benchmarks' commands share: where they write (`--out`) and work (`--work`), and
writing their JSON and plot."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def output_arguments(parser: argparse.ArgumentParser, served_preset: bool = False) -> None:
    """--out and --work; with `served_preset`, --preset (the served model) too."""
    if served_preset:
        from contract.config import DEFAULT_PRESET

        parser.add_argument("--preset", default=DEFAULT_PRESET, help="the served model (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where to write results (default {RESULTS})")
    parser.add_argument("--work", type=Path, help="artifact and repository folder (default: a temporary one)")


@contextlib.contextmanager
def work_folder(work: Path | None, prefix: str) -> Iterator[Path]:
    """`work` (made if needed), or a temporary folder removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        root = work or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        yield root


def machine(threads: int, *packages: str) -> dict:
    """Where a bench ran: the CPU, its cores, the threads used, Python's and `packages`' versions (every bench's
    results say it the same way)."""
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        **{package: importlib.metadata.version(package) for package in packages},
    }


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo's, "AMD EPYC"), or the architecture where none is told."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


# pyplot keeps one global figure state: benchmarks run side by side in threads (the tests' smoke
# runs) draw one plot at a time
PLOT_LOCK = threading.Lock()


def write(results: dict, out: Path, name: str, plot: Callable[[dict, Path], Path]) -> str:
    """`<name>.json` and `<name>.png` in `out`; the line that says so."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    with PLOT_LOCK:
        plot(results, out / f"{name}.png")
    return f"wrote {out / f'{name}.json'} and {out / f'{name}.png'}"


def target_lines(heading: str, targets: dict, value_key: str) -> list[str]:
    """`heading`, then a line per target: its ratio (the entry's `value_key`), the target, met or MISSED."""
    lines = [heading]
    for name, entry in targets.items():
        verdict = "met" if entry["met"] else "MISSED"
        lines.append(f"  {name}: {entry[value_key]:.2f}x (target {entry['target']}) -> {verdict}")
    return lines
