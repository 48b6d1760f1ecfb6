"""The stub's parent watchdog (serving/triton/watchdog.py), in plain processes standing in for a
tritonserver and its stub: a stub whose server died while one of its threads holds the GIL (as a
gauge update on its way to the dead server does) still ends, and a stub whose server lives is left
alone past the deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

DEADLINE_S = 1.0
ROOT = Path(__file__).resolve().parents[2]

STUB = textwrap.dedent(
    f"""
    import ctypes, sys, time
    from serving.triton.watchdog import ParentWatchdog
    ParentWatchdog(deadline_s={DEADLINE_S}, interval_s=0.1)
    print("armed", flush=True)
    if sys.argv[1] == "hold-gil":
        ctypes.PyDLL(None).sleep(60)  # libc's sleep called without releasing the GIL
    else:
        time.sleep(60)
    """
)
SERVER = textwrap.dedent(
    """
    import subprocess, sys, time
    stub = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
    assert stub.stdout.readline().strip() == "armed"
    print(stub.pid, flush=True)
    time.sleep(60)
    """
)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("stub_does", ["hold-gil", "idle"])
def test_a_stub_ends_within_the_deadline_once_its_server_is_killed(stub_does):
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, STUB, stub_does], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    stub = int(server.stdout.readline())
    try:
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        killed_at = time.monotonic()
        while alive(stub) and time.monotonic() - killed_at < 10 * DEADLINE_S:
            time.sleep(0.02)
        gone_after = time.monotonic() - killed_at
        assert not alive(stub), f"the stub outlived its server by {gone_after:.1f} s"
        # holding the GIL, the last pet came before the kill; idle, within an interval after it
        assert gone_after < DEADLINE_S + 0.5, gone_after
    finally:
        if alive(stub):
            os.kill(stub, signal.SIGKILL)


def test_a_stub_whose_server_lives_is_left_alone_past_the_deadline():
    stub = subprocess.Popen([sys.executable, "-c", STUB, "idle"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert stub.stdout.readline().strip() == "armed"
        time.sleep(3 * DEADLINE_S)
        assert stub.poll() is None, "the watchdog ended a stub whose parent lives"
    finally:
        stub.kill()
        stub.wait()
