"""The benchmarks' smoke runs, all at once: `bench_runs[name]` is one run's outcome.

Each test module here that runs a benchmark defines `bench_jobs(root, artifact_dir)`: it lays out what
its runs need under `root` (a copy of the session's build, say) and returns {name: call}, each call a
whole run: `python -m bench ...` through `main`, the GPU proof's `benchmark`, or `python -m bench` in
a process of its own (the capacity run, which builds an artifact: its export and parity ladders do not
wait on the other runs' Python for the interpreter lock). The first test to ask for `bench_runs` runs
the jobs of every test module selected in this session, WORKERS at a time, and the tests then check
what each run wrote and printed. A smoke run mostly waits (Triton loading its stubs and polling once a
second at shutdown, Envoy, a gateway process), so the runs overlap their waits and fill both cores
(measured on 2 cores, the session's tiny build included: tests/bench in 44 s three at a time, 86 s one
at a time). Each run still does all it does alone, with servers of its own.

What a run prints in this process goes to its own buffer (`Run.stdout`); bench/results.py's
PLOT_LOCK draws the plots one at a time (matplotlib's pyplot is not thread-safe). Timings are not
asserted anywhere here: the runs time each other too.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

# the modules, longest runs first (measured on 2 cores): the capacity run builds its own artifact and
# needs nothing of the session's, so it starts before the session's tiny build; others after these
ORDER = ("test_capacity_bench", "test_gpu_proof", "test_durable_bench", "test_admission_bench", "test_bench_smoke")
WORKERS = 3  # 2 leaves a core idle while runs wait; 4 only adds contention on 2 cores


@dataclasses.dataclass
class Run:
    root: Path  # the folder the job laid out (its `--work` and `--out` are under it)
    value: object = None  # what the call returned: main's exit code, the GPU proof's results
    error: BaseException | None = None
    stdout: str = ""
    seconds: float = 0.0

    def result(self) -> object:
        """What the call returned; the exception it raised, raised again."""
        if self.error is not None:
            raise self.error
        return self.value


class ThreadStdout(io.TextIOBase):
    """sys.stdout that writes each registered thread's text to that thread's buffer."""

    def __init__(self, fallback) -> None:
        self.fallback, self.buffers = fallback, {}

    def write(self, text: str) -> int:
        return self.buffers.get(threading.get_ident(), self.fallback).write(text)

    def flush(self) -> None:
        self.fallback.flush()


@pytest.fixture(scope="session")
def bench_runs(request, tmp_path_factory, artifact_dir) -> dict[str, Run]:
    def rank(module) -> tuple[int, str]:
        name = module.__name__.rsplit(".", 1)[-1]
        return (ORDER.index(name) if name in ORDER else len(ORDER), name)

    modules = sorted({item.module for item in request.session.items if "bench_runs" in item.fixturenames}, key=rank)
    runs: dict[str, Run] = {}
    stdout = ThreadStdout(sys.stdout)

    def run(name: str, call: Callable[[], object]) -> None:
        buffer = stdout.buffers[threading.get_ident()] = io.StringIO()
        started = time.perf_counter()
        try:
            runs[name].value = call()
        except BaseException as error:  # SystemExit from argparse too: the test of this run raises it
            runs[name].error = error
        finally:
            runs[name].seconds = time.perf_counter() - started
            runs[name].stdout = buffer.getvalue()
            del stdout.buffers[threading.get_ident()]

    # transformers loads its classes lazily, and two threads loading one class at once may see a module
    # half-loaded ("module 'transformers' has no attribute 'LlamaForCausalLM'"): loaded here, before the runs
    import transformers

    for name in ("LlamaForCausalLM", "PreTrainedTokenizerFast", "DynamicCache", "StaticCache"):
        getattr(transformers, name)
    started = time.perf_counter()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stdout", stdout)
        pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="bench")
        try:
            for module in modules:  # each module's runs start once it has laid them out (the first may build)
                root = tmp_path_factory.mktemp(module.__name__.rsplit(".", 1)[-1])
                for name, call in module.bench_jobs(root, artifact_dir).items():
                    runs[name] = Run(root)
                    pool.submit(run, name, call)
            pool.shutdown(wait=True)
        except BaseException:  # a failed layout, an interrupt: the runs not started yet never start
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    _SUMMARY.append(
        f"benchmark smoke runs, {min(WORKERS, len(runs))} at a time: {time.perf_counter() - started:.1f} s in all ("
        + ", ".join(f"{name} {r.seconds:.1f} s" for name, r in runs.items())
        + ")"
    )
    return runs


_SUMMARY: list[str] = []


def pytest_terminal_summary(terminalreporter) -> None:
    for line in _SUMMARY:
        terminalreporter.write_line(line)
