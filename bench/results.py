"""What the benchmarks' commands share: where they write (`--out`) and work (`--work`), their common
arguments and the plan a command's flags change, writing their JSON and plot, and what they print after."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def output_arguments(parser: argparse.ArgumentParser, served_preset: bool = False) -> None:
    """--out and --work; with `served_preset`, --preset (the served model) too."""
    if served_preset:
        from contract.config import DEFAULT_PRESET

        parser.add_argument("--preset", default=DEFAULT_PRESET, help="the served model (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where to write results (default {RESULTS})")
    parser.add_argument("--work", type=Path, help="artifact and repository folder (default: a temporary one)")


def rounds_argument(parser: argparse.ArgumentParser, default: int | None, text: str | None = None) -> None:
    """--rounds: the interleaved rounds (None: the plan's, said in `text`)."""
    said = text or f"default {default}"
    parser.add_argument("--rounds", type=int, default=default, help=f"interleaved rounds ({said})")


def threads_argument(parser: argparse.ArgumentParser, whose: str, default: int | None = None) -> None:
    """--threads: each candidate's threads (`whose`: what they run), by default as many as the cores."""
    default = default or os.cpu_count() or 1
    parser.add_argument("--threads", type=int, default=default, help=f"{whose} (default {default})")


def planned(args: argparse.Namespace, plan_class, *flags: str, **given):
    """The plan (a dataclass: its `quick()` with --quick) with what the command's flags gave: `flags` named as the
    plan's fields, `given` the others' values, None where a flag was not given (the plan's value stays)."""
    plan = plan_class.quick() if args.quick else plan_class()
    given |= {flag: getattr(args, flag) for flag in flags}
    return dataclasses.replace(plan, **{k: v for k, v in given.items() if v is not None})


def counts(text: str | None) -> tuple[int, ...] | None:
    """A comma-separated list of whole numbers (`--lengths 1000,4000`), None when the flag was not given."""
    return tuple(int(item) for item in text.split(",")) if text else None


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


def write(results: dict, out: Path, name: str, plot: Callable[[dict, Path], Path], png: str | None = None) -> str:
    """`<name>.json` and its plot, `<png or name>.png`, in `out`; the line that says so."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    with PLOT_LOCK:
        plot(results, out / f"{png or name}.png")
    return f"wrote {out / f'{name}.json'} and {out / f'{png or name}.png'}"


def report(
    results: dict, out: Path, name: str, plot: Callable[[dict, Path], Path], text: str, png: str | None = None
) -> int:
    """What every bench does at its end: `<name>.json` and `.png` written, `text` (its table) printed, a note where
    the machine was busy as the run began (the results' `load_average_1min`, `during` measures it: our machines
    are shared), where it wrote; the command's exit code."""
    wrote = write(results, out, name, plot, png)
    print(text)
    load = _found(results, "load_average_1min")
    if load is not None and load["before"] > 0.5:
        busy = f"1-minute load average {load['before']:.1f}"
        print(f"note: the machine was busy when the run began ({busy}): expect noise")
    print(wrote)
    return 0


@contextlib.contextmanager
def during(threads: int, *packages: str) -> Iterator[dict]:
    """`machine(threads, *packages)` and the 1-minute load average before the block and after it."""
    facts = machine(threads, *packages) | {"load_average_1min": {"before": os.getloadavg()[0]}}
    yield facts
    facts["load_average_1min"]["after"] = os.getloadavg()[0]


def _found(results: dict, key: str):
    """`results[key]`, or the first found one level down (a bench's `machine` or `conditions`)."""
    if key in results:
        return results[key]
    return next((value[key] for value in results.values() if isinstance(value, dict) and key in value), None)


def table(heading: str, header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """`heading`, then `header` and `rows` in columns, each as wide as its widest cell: the first column
    left-aligned, the others right; a cell is printed as given (format numbers before)."""
    cells = [[str(cell) for cell in row] for row in [header, *rows]]
    widths = [max(len(row[k]) for row in cells if k < len(row)) for k in range(len(header))]

    def line(row: list[str]) -> str:
        first, *rest = row
        rest = [cell.rjust(width) for cell, width in zip(rest, widths[1 : len(row)], strict=True)]
        return " ".join([first.ljust(widths[0]), *rest])

    return "\n".join([heading, *(line(row).rstrip() for row in cells)])


def goal(value: float, least: float | None = None, most: float | None = None, kind: str = "ratio", **more) -> dict:
    """One of an issue's goals, measured (reported, never asserted): `value` (a `kind`: ratio, speedup) against
    its bound, at `least` or at `most`, and whether it was met; `more`: what else the entry says."""
    if (least is None) == (most is None):
        raise ValueError("a goal is bounded below (least) or above (most)")
    met = value >= least if least is not None else value <= most
    target = f">= {least:g}" if least is not None else f"<= {most:g}"
    return {kind: value, "target": more.pop("target", target), "met": met, **more}


def target_lines(heading: str, targets: dict, value_key: str, unmeasured: str | None = None) -> list[str]:
    """`heading`, then a line per target: its ratio (the entry's `value_key`), the target, met or MISSED; where no
    target was measured (the run too small) and `unmeasured` says why, that line alone."""
    if not targets and unmeasured is not None:
        return [unmeasured]
    lines = [heading]
    for name, entry in targets.items():
        verdict = "met" if entry["met"] else "MISSED"
        lines.append(f"  {name}: {entry[value_key]:.2f}x (target {entry['target']}) -> {verdict}")
    return lines


def commit() -> dict:
    """The commit measured (`git rev-parse --short HEAD`), and whether the tree had uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=False
    )
    changes = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, check=False
    )
    sha = head.stdout.strip() if head.returncode == 0 else "unknown"
    dirty = bool(changes.stdout.strip())
    return {"commit": sha, "uncommitted_changes": dirty, "text": f"measured at {sha}" + (" + changes" * dirty)}
