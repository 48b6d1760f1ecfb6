"""The README's examples, run as written against `python -m serving` with the default model.

Blocks preceded by `<!-- readme-test -->` are run (sh with bash, python with this interpreter)
with the README's addresses pointed at this test's ports and `$WORK` at a folder of the test's own;
the `text` block after `<!-- output -->` is what they must print. In it, `...` stands for any text
within a line, a line of just `...` for any number of lines, and a decimal number for a measured one
close to it: a measured error (`1.94e-07`) is a bound, the printed one at most twice it (the same seeds
give other roundings on another CPU's kernels: an AVX-512 CPU printed exact zeros where ours printed
1e-6), a size or any other decimal within 10%.

The examples that call no server (the builds, single-threaded) run two at a time in the background
from the module's start, while the server starts; one that reads an earlier one's `--out` folder
runs after it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from client.text import TextModel
from contract.config import DEFAULT_PRESET, preset
from contract.files import HELD_OUT_FILENAME, TRAINED_MODEL
from contract.names import SESSION_MODEL
from export.build import build
from export.progress import Progress
from serving.triton.cli import TRAINED_PREFIX
from serving.triton.config import ServingSettings
from serving.triton.repository import write_repository
from tests.fixtures.prebuilds import Job
from tests.fixtures.serving_process import serving_process
from tests.fixtures.triton import selected

pytestmark = [pytest.mark.served, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- readme-test -->\n```(\w+)\n(.*?)```\n(?:<!-- output -->\n```text\n(.*?)```)?", re.DOTALL)


TIMEOUT = 300  # seconds an example may run
# of the trained model's sampled words (temperature 0.7, 8 completions of 40 tokens), the share its held-out text
# holds too: 0.78-0.89 over 10 such groups sampled from the PyTorch original
KNOWN_SHARE = 0.7
BACKGROUND_WORKERS = 2  # the builds are single-threaded: two at a time fill two cores


DECIMAL = re.compile(r"\d+\.\d+(?:e[-+]\d+)?")  # a measured error or size
ERROR_FACTOR, SIZE_TOLERANCE = 2.0, 0.10


def line_pattern(text: str) -> str:
    return f"({DECIMAL.pattern})".join(re.escape(piece) for piece in DECIMAL.split(text))


def number_is_close(shown: str, printed: str) -> bool:
    shown_value, printed_value = float(shown), float(printed)
    if "e" in shown:  # an error: a bound, not one CPU's value (AVX-512 kernels gave exact zeros where AVX2 did not)
        return 0 <= printed_value <= shown_value * ERROR_FACTOR
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


def calls_a_server(code: str) -> bool:
    return any(address in code for address in ("127.0.0.1:8080", "127.0.0.1:8001", "127.0.0.1:8000"))


def reads_from(index: int, blocks: list[tuple[str, str, str]]) -> set[int]:
    """The earlier examples whose `--out` folder example `index` reads (it runs after them)."""
    code = blocks[index][1]
    return {
        earlier
        for earlier in range(index)
        for out in re.findall(r"--out (\S+)", blocks[earlier][1])
        if re.search(re.escape(out) + r"(?![\w.-])", code.replace(f"--out {out}", ""))
    }


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """`$WORK`: the examples' folder (the one the examples run ahead write into)."""
    return work_folder(tmp_path_factory.mktemp)


@functools.cache
def work_folder(mktemp) -> Path:
    return mktemp("readme-work")


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory, trained_artifact, prebuilds):
    """`python -m serving` on a repository built from the default preset (built ahead in the background where
    the session has time: tests/fixtures/prebuilds.py), with the model trained here beside it under its own
    names, as `make serve` runs it."""
    stack = tmp_path_factory.mktemp("readme-stack")
    artifacts = prebuilds.wait(DEFAULT_KEY) or build_default(stack / "artifacts")
    repository = write_repository(artifacts, stack / "model_repository", ServingSettings(threads=1))
    write_repository(trained_artifact, repository, ServingSettings(threads=1), (SESSION_MODEL,), TRAINED_PREFIX)
    with serving_process(repository, stack, stop_later=True) as served:
        yield served


DEFAULT_KEY = "readme-default"


def build_default(out: Path) -> Path:
    """The default preset's artifact, as `make serve` builds it, in `out`."""
    assert build(preset(DEFAULT_PRESET), out, progress=Progress(enabled=False))["passed"]
    return out


def prebuild_jobs(item) -> dict:
    """For a test that serves the default stack, its build; for an example that only builds, it and the examples
    it reads from, run ahead (tests/fixtures/prebuilds.py)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    index = params.get("index")
    if "default_stack" in item.fixturenames or (index is not None and calls_a_server(readme_blocks()[index][1])):
        return {DEFAULT_KEY: default_job}
    if index is not None and builds_only(index, readme_blocks()):
        root = chain_root(index, readme_blocks())
        return {chain_key(root): functools.partial(chain_job, root)}
    return {}


def builds_only(index: int, blocks: list[tuple[str, str, str]]) -> bool:
    """Whether example `index` starts no server, calls none, and reads only from examples that do the same: one
    that can run any time before its test (ahead, in the background)."""
    code = blocks[index][1]
    if calls_a_server(code) or any(port in code for port in OWN_SERVER_PORTS):
        return False
    return all(builds_only(earlier, blocks) for earlier in reads_from(index, blocks))


def chain_root(index: int, blocks: list[tuple[str, str, str]]) -> int:
    """The first example of the chain `index` reads along (itself where it reads from none)."""
    earlier = reads_from(index, blocks)
    return chain_root(min(earlier), blocks) if earlier else index


def chain_key(root: int) -> str:
    return f"readme-examples-{root}"


def chain_job(root: int, mktemp) -> Job:
    """Example `root` and those that read along it, in README order, each's outcome in a file of its own."""
    blocks = readme_blocks()
    chain = [index for index in range(len(blocks)) if builds_only(index, blocks) and chain_root(index, blocks) == root]
    work = work_folder(mktemp)
    return Job(run_ahead, (chain, work), outcomes_folder(work))


def outcomes_folder(work: Path) -> Path:
    return work.with_name(f"{work.name}-outcomes")


def run_ahead(chain: list[int], work: Path) -> None:
    """Each example of `chain` run as its test would, in turn (a later one may read an earlier one's build)."""
    folder = outcomes_folder(work)
    folder.mkdir(exist_ok=True)
    runs = Runs(work, own_session=False)
    for index in chain:
        proc = runs.run(index)
        outcome = {"args": proc.args, "returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
        (folder / f"example-{index}.json").write_text(json.dumps(outcome))


def default_job(mktemp) -> Job:
    out = mktemp("readme-default")
    return Job(build_default, (out,), out)


# An example that starts a server of its own (a whole model's) names ports 8100-8103: each run gives them
# free ports of its own, as it gives the default stack's
OWN_SERVER_PORTS = ("8100", "8101", "8102", "8103")
_own_ports: dict[str, str] = {}


def own_server_ports() -> dict[str, str]:
    """Ports below the kernel's ephemeral range, from which every other server of the session draws its own
    (`free_port`: port 0): chosen here (in a prebuild worker, maybe minutes before the example binds them), one
    of them was once handed to another test's Triton meanwhile, and the example's client read that server."""
    while len(set(_own_ports.values())) < len(OWN_SERVER_PORTS):  # distinct ones
        _own_ports.update({port: str(unassigned_port()) for port in OWN_SERVER_PORTS})
    return _own_ports


def unassigned_port() -> int:
    """A free loopback port the kernel never hands out for port 0 (below net.ipv4.ip_local_port_range)."""
    lowest = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    below = lowest if lowest > 11_000 else 65_536  # a range set that low leaves no room: any free port
    while True:
        port = random.randrange(10_000, below)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def localize(code: str, served) -> str:
    for shown, free in own_server_ports().items():
        code = re.sub(rf"(?<![\d.]){shown}(?!\d)", free, code)
    if served is not None:
        code = (
            code.replace("127.0.0.1:8080", f"127.0.0.1:{served.gateway_port}")
            .replace("127.0.0.1:8001", f"127.0.0.1:{served.grpc_port}")
            .replace("127.0.0.1:8000", f"127.0.0.1:{served.http_port}")
        )
    return code.replace(".venv/bin/python", sys.executable)


class Runs:
    """Examples run as subprocesses (each in a process group of its own, killed if it outlives its
    TIMEOUT or the module)."""

    def __init__(self, work: Path, own_session: bool = True) -> None:
        self.work, self.lock, self.running, self.closed = work, threading.Lock(), set(), False
        # run ahead (tests/fixtures/prebuilds.py), an example keeps its worker's session: its scheduling group
        # at the lowest priority; a process group of its own still lets `kill` reach its children
        self.group = {"start_new_session": True} if own_session else {"process_group": 0}

    def run(
        self, index: int, served=None, after: tuple[concurrent.futures.Future, ...] = ()
    ) -> subprocess.CompletedProcess:
        for earlier in after:
            earlier.result()  # a failed one fails this one too
        lang, code, _ = readme_blocks()[index]
        command = ["bash", "-eo", "pipefail", "-c"] if lang == "sh" else [sys.executable, "-c"]
        with self.lock:
            if self.closed:
                raise RuntimeError("the module ended before this example started")
            proc = subprocess.Popen(
                [*command, localize(code, served)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                cwd=ROOT, env={**os.environ, "WORK": str(self.work)}, **self.group,
            )  # fmt: skip
            self.running.add(proc)
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
        finally:
            self.kill(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    def kill(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:  # past its TIMEOUT, or the module ended: its children too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        with self.lock:
            self.running.discard(proc)

    def close(self) -> None:
        with self.lock:
            self.closed, running = True, list(self.running)
        for proc in running:
            self.kill(proc)


@pytest.fixture(scope="module")
def examples(request, work, prebuilds):
    """(the runner, index -> the Future of each example this run needs that calls no server nor reads
    from one that does: run ahead (tests/fixtures/prebuilds.py) or started in the background now)."""
    blocks = readme_blocks()
    seen, pending = set(), list(selected(request, "index"))
    while pending:  # the selected ones and those they read from
        index = pending.pop()
        if index not in seen:
            seen.add(index)
            pending += reads_from(index, blocks)
    runs, futures = Runs(work), {}
    pool = concurrent.futures.ThreadPoolExecutor(BACKGROUND_WORKERS, thread_name_prefix="readme-example")
    chains: dict[str, concurrent.futures.Future] = {}  # run ahead: each chain's wait, once
    for index in sorted(seen):  # in README order: what an example waits for is started before it
        earlier = sorted(reads_from(index, blocks))
        key = chain_key(chain_root(index, blocks))
        if builds_only(index, blocks) and (prebuilds.scheduled(key) or key in chains):
            if key not in chains:
                chains[key] = pool.submit(prebuilds.wait, key)
            futures[index] = outcome_of(chains[key], index)
        elif not calls_a_server(blocks[index][1]) and all(e in futures for e in earlier):
            futures[index] = pool.submit(runs.run, index, None, tuple(futures[e] for e in earlier))
    try:
        yield runs, futures
    finally:
        runs.close()
        pool.shutdown(wait=True, cancel_futures=True)


def outcome_of(chain: concurrent.futures.Future, index: int) -> concurrent.futures.Future:
    """A Future of example `index`'s CompletedProcess, read once `chain` (its run ahead) is done."""
    outcome: concurrent.futures.Future = concurrent.futures.Future()

    def read(done: concurrent.futures.Future) -> None:
        try:
            folder = done.result()
            outcome.set_result(
                subprocess.CompletedProcess(**json.loads((folder / f"example-{index}.json").read_text()))
            )
        except Exception as error:  # the chain's failure is each of its examples'
            outcome.set_exception(error)

    chain.add_done_callback(read)
    return outcome


def test_the_readme_has_runnable_examples():
    langs = [lang for lang, _, _ in readme_blocks()]
    assert langs.count("sh") >= 2 and langs.count("python") >= 2, langs


def test_the_example_reading_anothers_build_runs_after_it():
    blocks = readme_blocks()
    native = next(i for i, (_, code, _) in enumerate(blocks) if "--layout native" in code)
    mha = next(i for i, (_, code, _) in enumerate(blocks) if "--out $WORK/artifacts/mha " in code)
    assert reads_from(native, blocks) == {mha}


@pytest.mark.parametrize("index", range(len(readme_blocks())))
def test_readme_example(index, examples, request):
    runs, background = examples
    if index in background:
        proc = background[index].result()
    else:
        after = tuple(background[e] for e in sorted(reads_from(index, readme_blocks())) if e in background)
        proc = runs.run(index, request.getfixturevalue("default_stack"), after)
    _, _, expected = readme_blocks()[index]
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
    # an error is a bound: any CPU's smaller one passes, exact zeros included (AVX-512 kernels print them)
    assert stale_numbers(table, "fp32 0.50 0.00e+00 pass\n") == []


def test_the_curl_line_serving_prints_works(default_stack):
    served = default_stack
    try_line = next(line for line in served.output().splitlines() if line.startswith("try "))
    proc = subprocess.run(
        ["bash", "-c", try_line.removeprefix("try").strip()],  # `| head -c 300` may cut curl short: no pipefail
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith('{"output":[[['), proc.stdout


def test_the_text_line_serving_prints_completes_in_the_corpus_words(default_stack):
    """`make serve`'s text line, asked for 8 sampled completions: most of their words are words of the trained
    model's held-out text (a random model's are byte soup); and a greedy completion's tokens are the ones the
    tokenizer gives back when it encodes the text."""
    text_line = next(line for line in default_stack.output().splitlines() if line.startswith("text "))
    command = text_line.removeprefix("text").strip().replace('"max_tokens": 40', '"max_tokens": 40, "n": 8')
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    completions = [choice["text"] for choice in json.loads(proc.stdout)["choices"]]
    known = set(re.findall(r"[a-z]+", (TRAINED_MODEL / HELD_OUT_FILENAME).read_text().lower()))
    words = [word for completion in completions for word in re.findall(r"[a-z]+", completion.lower())]
    assert len(words) >= 40 and sum(word in known for word in words) >= KNOWN_SHARE * len(words), completions

    body = {"model": "fortunes", "prompt": "Love is", "max_tokens": 24, "temperature": 0, "logprobs": 0}
    answer = httpx.post(f"{default_stack.gateway_url}/v1/completions", json=body, timeout=60).json()
    completion, tokens = answer["choices"][0]["text"], answer["choices"][0]["logprobs"]["tokens"]
    text = TextModel.from_folder(TRAINED_MODEL)
    assert "".join(tokens) == completion
    assert [text.token_text(i) for i in text.encode(completion)] == tokens, (completion, tokens)
