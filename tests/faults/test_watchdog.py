"""The stub's watchdog (serving/triton/watchdog.py), in plain processes standing in for a
tritonserver and its stub: a stub whose server died while one of its threads holds the GIL (as a
gauge update on its way to the dead server does) is ended, a stub whose server is stopped (SIGSTOP)
is left alone, and the watcher ends with an orderly unload."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from serving.triton.watchdog import GRACE_S, INTERVAL_S

ROOT = Path(__file__).resolve().parents[2]

STUB = textwrap.dedent(
    """
    import ctypes, sys
    from serving.triton.watchdog import ParentWatchdog
    watchdog = ParentWatchdog()
    print(watchdog._watcher.pid, flush=True)
    if sys.argv[1] == "unload":
        watchdog.stop()
        print("stopped", flush=True)
    ctypes.PyDLL(None).sleep(60)  # libc's sleep called without releasing the GIL
    """
)
SERVER = textwrap.dedent(
    """
    import subprocess, sys, time
    stub = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
    print(stub.pid, stub.stdout.readline().strip(), flush=True)
    print(stub.stdout.readline().strip(), flush=True) if sys.argv[2] == "unload" else None
    time.sleep(60)
    """
)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start(stub_does: str) -> tuple[subprocess.Popen, int, int]:
    """A "server" and its "stub" holding the GIL: (server, stub pid, watcher pid)."""
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, STUB, stub_does], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    stub, watcher = map(int, server.stdout.readline().split())
    return server, stub, watcher


def end(*pids: int) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_stub_holding_the_gil_is_ended_once_its_server_is_killed():
    server, stub, watcher = start("hold-gil")
    try:
        time.sleep(2 * INTERVAL_S)  # the watcher has looked at least once with the server alive
        assert alive(stub) and alive(watcher)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        killed_at = time.monotonic()
        while (alive(stub) or alive(watcher)) and time.monotonic() - killed_at < 3 * GRACE_S:
            time.sleep(0.02)
        gone_after = time.monotonic() - killed_at
        assert not alive(stub), f"the stub outlived its server by {gone_after:.1f} s"
        assert not alive(watcher), "the watcher outlived the stub"
        assert gone_after < GRACE_S + 2 * INTERVAL_S + 0.5, gone_after
    finally:
        end(stub, watcher)
        server.kill()


def test_a_stub_whose_server_is_stopped_is_left_alone():
    server, stub, watcher = start("hold-gil")
    try:
        server.send_signal(signal.SIGSTOP)
        time.sleep(GRACE_S + 4 * INTERVAL_S)
        assert alive(stub) and alive(watcher), "a stopped server's stub was ended"
        server.send_signal(signal.SIGCONT)
    finally:
        end(stub, watcher)
        server.kill()


def test_an_orderly_unload_ends_the_watcher():
    server, stub, watcher = start("unload")
    try:
        assert server.stdout.readline().strip() == "stopped"
        assert not alive(watcher) and alive(stub)
    finally:
        end(stub, watcher)
        server.kill()


ORPHANED_STUB = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from serving.triton.watchdog import ParentWatchdog
    while os.getppid() != 1:  # its server dies before it is loaded
        time.sleep(0.01)
    Path(sys.argv[1] + ".part").write_text(str(ParentWatchdog()._watcher.pid))
    os.replace(sys.argv[1] + ".part", sys.argv[1])
    time.sleep(60)
    """
)


def test_a_stub_whose_server_died_before_it_loaded_is_ended(tmp_path):
    """Seen: a tritonserver that exits at start (its port taken) while its stub loads leaves the stub to init
    before `initialize` makes the watcher; the watcher must not take init for the server."""
    told = tmp_path / "watcher"
    launch = "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]]).pid)"
    server = subprocess.run(
        [sys.executable, "-c", launch, ORPHANED_STUB, str(told)], capture_output=True, text=True, cwd=ROOT, check=True
    )
    stub = int(server.stdout.split()[0])  # (the watcher's own line about the kill may follow)
    started, watcher = time.monotonic(), None
    try:
        while not told.is_file() and time.monotonic() - started < 10:
            time.sleep(0.02)
        watcher = int(told.read_text())
        while (alive(stub) or alive(watcher)) and time.monotonic() - started < 10 + 3 * GRACE_S:
            time.sleep(0.02)
        assert not alive(stub), "the orphaned stub was left running"
        assert not alive(watcher), "the watcher outlived the stub"
    finally:
        end(stub, *([watcher] if watcher else []))
