"""kill -9 of `python -m serving` itself (the gateway, the supervisors and the Envoy manager share its
process): every process it started ends with it (tritonserver, the stubs, Envoy), so nothing keeps
its ports, and the same command started again serves at once, after removing and naming what the
killed run left (its work folders, shared-memory regions nobody maps).

And the 20-run check of issue 34 (item 6): kill -9 of a process that started Triton as `python -m
serving` does (`start_triton`), with a session open and being stepped, open and idle, or none (stateless
requests in flight instead), leaves no stub running 5 s after, in every one of the runs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from serving.host.launcher import shm_prefix
from serving.host.process import OWNER_FILE, SHM_DIR, reap_leftovers
from tests.fixtures.serving_process import (
    LEFT_GRACE_S,
    descendants,
    new_ports,
    start_serving,
    still_running,
    still_running_after,
)

pytestmark = [pytest.mark.served, pytest.mark.slow, pytest.mark.timeout(600)]
LEFT_AFTER_S = 5.0  # the bound: what runs this long after the kill -9


def work_dirs_of(pid: int) -> list[Path]:
    """The work folders whose owner record names `pid` (its Tritons', Envoy's, its session store's)."""
    return [
        record.parent
        for record in Path("/tmp").glob(f"*/{OWNER_FILE}")
        if re.search(rf'"owner": {pid}\b', record.read_text())
    ]


def stop(served) -> None:
    served.process.send_signal(signal.SIGINT)
    assert served.process.wait(90) == 0, served.output()
    assert not still_running_after(served.seen, LEFT_GRACE_S)


@pytest.mark.parametrize("replicas", [1, 3])
def test_kill_9_of_python_m_serving_leaves_nothing_running_and_the_same_command_starts_again(
    tiny_repository, tmp_path, replicas
):
    ports = new_ports()
    args = ("--replicas", str(replicas), "--probe-interval", "0.5")
    first = start_serving(tiny_repository, _mkdir(tmp_path / "first"), args=args, ports=ports)
    started = first.descendants()
    try:
        names = " ".join(started.values())
        assert names.count("bin/tritonserver") == replicas and names.count("triton_python_backend_stub") >= 2 * replicas
        assert ("envoy" in names) == (replicas > 1)
        folders = work_dirs_of(first.process.pid)
        # a folder per Triton, Envoy's, the gateway process's and its session store
        assert len(folders) == replicas + (replicas > 1) + 2
        assert sum(folder.name.startswith(("serving-sessions-", "serving-gateway-")) for folder in folders) == 2
        regions = [region for folder in folders for region in SHM_DIR.glob(f"{shm_prefix(folder)}*")]
        assert len(regions) >= 2 * replicas

        killed_at = time.monotonic()
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(10)
        while still_running(started) and time.monotonic() - killed_at < LEFT_AFTER_S:
            time.sleep(0.05)
        gone_after = time.monotonic() - killed_at
        # a process that ended stays gone: nothing is learned by waiting out the rest of the bound
        left = still_running(started)
        unmapped = [region.name for region in regions if region.exists()]
        print(f"{replicas} replica(s): {len(started)} processes, all gone {gone_after:.2f} s after kill -9")
        print(f"left then: {len(folders)} folders, {len(unmapped)} of {len(regions)} regions")
        assert not left, f"running {LEFT_AFTER_S:g} s after kill -9 of python -m serving: {left}"

        second = start_serving(tiny_repository, _mkdir(tmp_path / "second"), args=args, ports=ports)
        try:
            assert httpx.get(f"{second.gateway_url}/readyz", timeout=30).status_code == 200
            output = second.output()
            removed = [line for line in output.splitlines() if line.startswith("removed what an earlier run left")]
            print("\n".join(removed))
            for folder in folders:
                assert not folder.exists() and f"removed what an earlier run left: {folder}" in output, folder
            assert not [r for r in regions if r.exists()], "a region of the killed run is still there"
        finally:
            stop(second)
    finally:
        if first.process.poll() is None:  # a check failed before the kill: the launcher too
            first.process.kill()
            first.process.wait(10)
        for line in still_running(started):  # whatever failed, none of its processes stays
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


# --- issue 34 item 6: the 20-run check ---------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
# What each killed launcher holds: a session stepped until the kill (at 45e04dd a gauge update then on
# its way to the dead server held the stub 8 s, 12 s, over a minute in 3 of 5 runs), a session open
# and idle, or no session and a stateless model's requests in flight (whose stub, before it had a
# watcher of its own, was held 18 s and over a minute in 2 of 40 runs).
RUNS = {"stepping": 12, "open": 4, "none": 4}
STEP_EVERY_S = 0.1  # under the sweeper's 0.25 s: some gauge has changed whenever the kill comes
IN_USE_S = 0.4  # how long the sessions are stepped (the stateless model asked) before the kills
# One process imports the launcher once and forks a launcher per run (20 imports cost 5 s of CPU).
# Each starts Triton as `python -m serving` does (`start_triton`), prints a line once it holds what it
# was told to, and once told to go (SIGUSR1: every launcher has started) steps its session or asks
# its stateless model until it is killed.
LAUNCHERS = textwrap.dedent(
    """
    import json, os, signal, sys, time, traceback, urllib.request
    import numpy as np
    import tritonclient.grpc as grpcclient
    from client import affinity
    from serving.host.launcher import TritonStartError, start_triton

    repository, d_model, every, runs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), json.loads(sys.argv[4])
    told = []
    signal.signal(signal.SIGUSR1, lambda *_: told.append(True))  # not inherited through tritonserver's exec

    def say(line):
        # one write of a whole line (under PIPE_BUF: atomic): 20 launchers share the pipe, and print's text and
        # newline once left as two writes, two launchers' lines joined on one
        os.write(1, (json.dumps(line) + "\\n").encode())

    def launch(holds, http, grpc, metrics):
        models = ["forward", "sessions"] if holds == "none" else ["sessions"]
        # what is checked is the kill, not twenty starts at once on two cores: a start that failed (once, in a
        # suite run beside a benchmark: the Python backend's "boost::interprocess::lock_exception") is tried again
        try:
            server = start_triton(repository, models=models, http_port=http, grpc_port=grpc, metrics_port=metrics)
        except TritonStartError:
            server = start_triton(repository, models=models, http_port=http, grpc_port=grpc, metrics_port=metrics)

        def infer(model, tokens, **parameters):
            values = {"data": [0.5] * tokens * d_model, "shape": [1, tokens, d_model], "datatype": "FP32"}
            body = json.dumps({"inputs": [{"name": "hidden_states", **values}], "parameters": parameters})
            url = f"http://{server.http_url}/v2/models/{model}/infer"
            post = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
            urllib.request.urlopen(post, timeout=60).read()

        stub = grpcclient.InferenceServerClient(server.grpc_url)  # made after the fork: a channel of its own

        def step(tokens, **sequence):  # the session model is decoupled: a stream of one request (client/affinity.py)
            tensor = grpcclient.InferInput("hidden_states", [1, tokens, d_model], "FP32")
            tensor.set_data_from_numpy(np.full((1, tokens, d_model), 0.5, np.float32))
            affinity.infer(stub, "sessions", [tensor], headers={}, sequence_id=1, **sequence)

        if holds != "none":
            step(4, sequence_start=True)
        say({"launcher": os.getpid(), "holds": holds, "server": server.process.pid})
        while not told:
            time.sleep(0.02)
        while holds == "stepping":
            step(1)
            time.sleep(every)
        while holds == "none":
            infer("forward", 64)  # one request after another: one is in flight at the kill
        time.sleep(600)

    for run in runs:
        if os.fork() == 0:
            try:
                launch(*run)
            except BaseException:
                say({"launcher": os.getpid(), "failed": traceback.format_exc()})
            os._exit(1)
    for _ in runs:
        os.wait()  # the killed launchers
    """
)


def distinct_ports(count: int) -> list[int]:
    """`count` ports free now and distinct: held together while picked (launchers starting at once each
    picking its own could pick the same one)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def start_launchers(repository: Path, d_model: int, log: Path) -> subprocess.Popen:
    """The process that forks the launchers; each prints a line of JSON once started."""
    kinds = [holds for holds, runs in RUNS.items() for _ in range(runs)]
    ports = iter(distinct_ports(3 * len(kinds)))
    runs = [[holds, next(ports), next(ports), next(ports)] for holds in kinds]
    command = [sys.executable, "-c", LAUNCHERS, str(repository), str(d_model), str(STEP_EVERY_S), json.dumps(runs)]
    with open(log, "wb") as output:  # a group of their own: a failed test ends them all with one kill
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=output, cwd=ROOT, start_new_session=True)


def started_runs(forker: subprocess.Popen, log: Path) -> list[tuple[str, int, dict[int, str]]]:
    """(what it holds, the launcher's pid, its descendants: pid -> command line) for each run once all
    have started."""
    runs = []
    for _ in range(sum(RUNS.values())):
        line = forker.stdout.readline()
        assert line, f"the launchers' process exited with {forker.poll()}:\n{log.read_text()[-3000:]}"
        started = json.loads(line)
        assert "failed" not in started, started["failed"]
        processes = descendants(started["launcher"], {})
        assert started["server"] in processes, processes
        runs.append((started["holds"], started["launcher"], processes))
    return runs


@pytest.mark.timeout(180)
def test_20_runs_kill_9_of_a_launcher_with_a_session_open_or_not_leaves_no_stub_after_5_s(tiny_repository, tmp_path):
    """Issue 34 item 6, the 20-run check: the launchers killed one right after the other, each run's
    processes timed from its own kill."""
    from contract.config import ModelConfig

    d_model = ModelConfig.load(tiny_repository / "sessions" / "1").d_model
    forker = start_launchers(tiny_repository, d_model, tmp_path / "launchers.log")
    runs: list[tuple[str, int, dict[int, str]]] = []
    try:
        runs = started_runs(forker, tmp_path / "launchers.log")
        stubs = [c for _, _, started in runs for c in started.values() if "triton_python_backend_stub" in c]
        assert len(stubs) == sum(RUNS.values()) + RUNS["none"], stubs
        for _, launcher, _ in runs:
            os.kill(launcher, signal.SIGUSR1)
        time.sleep(IN_USE_S)
        failed = [f"run {number} ({holds})" for number, (holds, launcher, _) in enumerate(runs) if not alive(launcher)]
        assert not failed, f"launchers ended before their kill: {failed}\n{(tmp_path / 'launchers.log').read_text()}"
        killed_at = []
        for _, launcher, _ in runs:
            os.kill(launcher, signal.SIGKILL)
            killed_at.append(time.monotonic())
        gone_after = ends_of_runs([started for _, _, started in runs], killed_at)
        print("all of a run's processes gone after kill -9 (s):", by_kind(runs, gone_after))
        late = {
            f"run {number} ({holds})": still_running(started)
            for number, ((holds, _, started), gone) in enumerate(zip(runs, gone_after, strict=True))
            if gone is None
        }
        assert not late, f"running {LEFT_AFTER_S:g} s after kill -9 of their launcher: {late}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(forker.pid, signal.SIGKILL)  # it and every launcher still running
        forker.wait(10)
        for _, _, started in runs:
            for line in still_running(started):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        forker.stdout.close()
        reap_leftovers()  # what the kills left (work folders, shared memory), as the next start removes it


def ends_of_runs(started: list[dict[int, str]], killed_at: list[float]) -> list[float | None]:
    """For each run, the seconds from its kill until none of its processes ran (None: still running
    LEFT_AFTER_S after)."""
    ends: list[float | None] = [None] * len(started)
    while True:
        now = time.monotonic()
        for run, processes in enumerate(started):
            if ends[run] is None and now - killed_at[run] <= LEFT_AFTER_S and not still_running(processes):
                ends[run] = round(now - killed_at[run], 2)
        if all(end is not None or now - kill > LEFT_AFTER_S for end, kill in zip(ends, killed_at, strict=True)):
            return ends
        time.sleep(0.05)


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def by_kind(runs: list[tuple[str, int, dict[int, str]]], seconds: list[float | None]) -> dict[str, list]:
    found: dict[str, list] = {holds: [] for holds in RUNS}
    for (holds, _, _), value in zip(runs, seconds, strict=True):
        found[holds].append(value)
    return {holds: sorted(values, key=lambda v: float("inf") if v is None else v) for holds, values in found.items()}
