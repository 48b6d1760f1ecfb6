"""The benchmarks' smoke runs, all at once: `bench_runs[name]` is one run's outcome.

Each test module here that runs a benchmark defines `bench_jobs(root, artifact_dir)`: it lays out what
its runs need under `root` (a copy of the session's build, say) and returns {name: call}, each call a
whole run: `python -m bench ...` through `main`, the GPU proof's `benchmark`, or `python -m bench` in
a process of its own (the capacity run, which builds an artifact: its export and parity ladders do not
wait on the other runs' Python for the interpreter lock). A module whose `bench_jobs` also takes
`finished` may wait in a call for another run's outcome: `finished(name)` is that Run once it has ended,
or None where no run of that name is in this session (the model-whole and generate runs wait for the
onnxruntime-genai model of their checkpoint, built once by a run of its own).

The first test to ask for `bench_runs` runs the jobs of every test module selected in this session,
WORKERS at a time, and the tests then check what each run wrote and printed. A smoke run mostly waits
(Triton loading its stubs and polling once a second at shutdown, an exit timeout, Envoy, a gateway
process), so the runs overlap their waits and fill both cores. Each run still does all it does alone,
with servers of its own.

The layouts run one after another on this thread and build what the session has not built yet
(`artifact_dir`: torch's exporter), while the runs already started go on. A run that uses torch in this
process must not meet an export (torch.export's global state broke a transformers forward in another
thread: KeyError 'custom' in torch/fx/traceback.py): the runs a module names in `TORCH_FREE_RUNS` (they
drive Triton, Envoy, Redis, gateway and builder processes through clients, or run in a process of their
own) start as soon as they are laid out, the others once every module is, every build done.

What a run prints in this process goes to its own buffer (`Run.stdout`); bench/results.py's
PLOT_LOCK draws the plots one at a time (matplotlib's pyplot is not thread-safe). Timings are not
asserted anywhere here: the runs time each other too.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import io
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

# the order of the layouts (measured on 2 cores): the capacity and serving runs (processes of their own) from the start,
# through the session's builds; the whole model's build first, so that its onnxruntime-genai model (a
# builder process) is built through the tiny build; the runs without torch here once the tiny build is
# there; then the runs that use torch here, longest first (model-whole's wait for its genai model is over)
ORDER = (
    "test_capacity_bench",
    "test_serving_bench",
    "test_conversation_bench",
    "test_whole_model_bench",
    "test_durable_bench",
    "test_gateway_bench",
    "test_idle_bench",
    "test_admission_bench",
    "test_scale_bench",
    "test_gpu_proof",
    "test_generate_bench",
    "test_sessions_bench",
    "test_bench_smoke",
    "test_weights_int8_bench",
)
# the runs mostly wait, and past the builds they fill both cores (measured on 2 cores, tests/bench without
# its conversation run: 52 to 54 s five or six at a time, 60 s three at a time with the builds before any
# run but capacity's; 8 at a time made torch's timings of weights-int8 too slow); six: the conversation run,
# the longest, starts with the others once the layouts are done
WORKERS = 6


@dataclasses.dataclass
class Run:
    root: Path  # the folder the job laid out (its `--work` and `--out` are under it)
    value: object = None  # what the call returned: main's exit code, the GPU proof's results
    error: BaseException | None = None
    stdout: str = ""
    began: float = 0.0  # seconds from the first run's start to this one's
    seconds: float = 0.0
    ended: bool = False

    def result(self) -> object:
        """What the call returned; the exception it raised, raised again."""
        if self.error is not None:
            raise self.error
        return self.value

    def written(self, name: str, plot: str | None = None) -> tuple[Path, dict]:
        """A bench run that exited 0 having written `name`.json and a PNG plot (`plot`.png, by default
        `name`.png) into its results folder: that folder and the JSON read."""
        assert self.result() == 0, self.stdout[-3000:]
        out = self.root / "results"
        assert (out / f"{plot or name}.png").read_bytes().startswith(b"\x89PNG")
        return out, json.loads((out / f"{name}.json").read_text())


class ThreadStdout(io.TextIOBase):
    """sys.stdout that writes each registered thread's text to that thread's buffer."""

    def __init__(self, fallback) -> None:
        self.fallback, self.buffers = fallback, {}

    def write(self, text: str) -> int:
        return self.buffers.get(threading.get_ident(), self.fallback).write(text)

    def flush(self) -> None:
        self.fallback.flush()


class Smoke:
    """The session's runs, WORKERS at a time: started as their modules are laid out, or once every module
    is (those that use torch here); `finished(name)` waits for one to end."""

    def __init__(self, stdout: ThreadStdout) -> None:
        self.stdout, self.runs = stdout, {}
        self.pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="bench")
        self.futures: dict[int, concurrent.futures.Future] = {}  # by id(Run)
        self.laid_out = False  # every run is known
        self.changed = threading.Condition()
        self.started = time.perf_counter()

    def lay_out(self, modules: list, tmp_path_factory, artifact_dir) -> None:
        """Each module's layout in turn (one may build), its runs started, or held until every build is done."""
        after_builds = []
        for module in modules:
            root = tmp_path_factory.mktemp(module.__name__.rsplit(".", 1)[-1])
            takes_finished = "finished" in inspect.signature(module.bench_jobs).parameters
            jobs = module.bench_jobs(root, artifact_dir, **({"finished": self.finished} if takes_finished else {}))
            for name, call in jobs.items():
                with self.changed:
                    this = self.runs[name] = Run(root)
                if name in getattr(module, "TORCH_FREE_RUNS", ()):
                    self.start(this, call)
                else:
                    after_builds.append((this, call))
        for this, call in after_builds:  # no export is left to meet them
            self.start(this, call)
        self.all_laid_out()

    def start(self, this: Run, call: Callable[[], object]) -> None:
        self.futures[id(this)] = self.pool.submit(self.run, this, call)

    def run(self, this: Run, call: Callable[[], object]) -> None:
        buffer = self.stdout.buffers[threading.get_ident()] = io.StringIO()
        began = time.perf_counter()
        this.began = began - self.started
        try:
            this.value = call()
        except BaseException as error:  # SystemExit from argparse too: the test of this run raises it
            this.error = error
        finally:
            this.seconds = time.perf_counter() - began
            this.stdout = buffer.getvalue()
            del self.stdout.buffers[threading.get_ident()]
            self.end(this)

    def end(self, this: Run) -> None:
        with self.changed:
            this.ended = True
            self.changed.notify_all()

    def all_laid_out(self) -> None:
        with self.changed:
            self.laid_out = True
            self.changed.notify_all()

    def finished(self, name: str) -> Run | None:
        """Run `name` once it has ended; None once every module is laid out and no run has that name."""
        with self.changed:
            self.changed.wait_for(lambda: self.runs[name].ended if name in self.runs else self.laid_out)
            return self.runs.get(name)

    def cancel(self, why: BaseException) -> None:
        """The runs not started yet never start (each ended, for a run that waits on it)."""
        for this in self.runs.values():
            future = self.futures.get(id(this))
            if future is None or future.cancel():
                this.error = RuntimeError(f"not run: the smoke runs' layout failed ({why!r})")
                self.end(this)
        self.all_laid_out()

    def summary(self) -> str:
        return (
            f"benchmark smoke runs, {min(WORKERS, len(self.runs))} at a time: "
            f"{time.perf_counter() - self.started:.1f} s in all (name: start+seconds; "
            + ", ".join(f"{name}: {r.began:.1f}+{r.seconds:.1f}" for name, r in self.runs.items())
            + ")"
        )


@pytest.fixture(scope="session")
def bench_runs(request, tmp_path_factory, artifact_dir) -> dict[str, Run]:
    def rank(module) -> tuple[int, str]:
        name = module.__name__.rsplit(".", 1)[-1]
        return (ORDER.index(name) if name in ORDER else len(ORDER), name)

    modules = sorted({item.module for item in request.session.items if "bench_runs" in item.fixturenames}, key=rank)
    # transformers loads its classes lazily, and two threads loading one class at once may see a module
    # half-loaded ("module 'transformers' has no attribute 'LlamaForCausalLM'"): loaded here, before the runs
    import transformers

    for name in ("LlamaForCausalLM", "PreTrainedTokenizerFast", "DynamicCache", "StaticCache"):
        getattr(transformers, name)
    stdout = ThreadStdout(sys.stdout)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stdout", stdout)
        smoke = Smoke(stdout)
        try:
            smoke.lay_out(modules, tmp_path_factory, artifact_dir)
        except BaseException as error:  # a failed layout, an interrupt
            smoke.cancel(error)
            raise
        finally:
            smoke.pool.shutdown(wait=True)
    _SUMMARY.append(smoke.summary())
    return smoke.runs


_SUMMARY: list[str] = []


def pytest_terminal_summary(terminalreporter) -> None:
    for line in _SUMMARY:
        terminalreporter.write_line(line)
