"""A Python-backend stub that ends with its tritonserver, whatever holds its threads.

The Python backend's own exit path can wait forever: a gauge update or a log line on its way when
the server dies waits for an answer while holding the GIL and the stub's message lock, and the
backend's exit needs both (docs/reliability.md, "No orphans"). Nothing inside the stub can act
then, so a small process beside it watches: `ParentWatchdog` starts this file as a script (standard
library only, `python3 -I -S`), which checks every `INTERVAL_S` whether the stub still has its
server as parent. Once the server is gone (the stub was handed to init), the stub gets `GRACE_S` to
end on its own and is then killed. A server that is alive but slow or stopped (SIGSTOP) is not
gone: its stub is left alone, its sessions kept. The watcher ends with the stub.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

INTERVAL_S = 1.0  # an idle server's watchers wake once a second (0.13% of a core each at 0.25 s, measured)
GRACE_S = 2.0


class ParentWatchdog:
    """The watcher process of this stub (started in `initialize`, stopped in `finalize`)."""

    def __init__(self) -> None:
        python = shutil.which("python3") or sys.executable  # the launcher puts the serving venv first on PATH
        command = [python, "-I", "-S", str(Path(__file__).resolve()), str(os.getpid()), str(server_of_this_stub())]
        self._watcher = subprocess.Popen(command, stdin=subprocess.DEVNULL, close_fds=True)

    def stop(self) -> None:
        """An orderly unload: the watcher ends first, so that no process outlives the stub."""
        self._watcher.kill()
        self._watcher.wait()


def server_of_this_stub() -> int:
    """The server this stub should have as parent: the pid the Python backend gave the stub on its command
    line (its 6th argument) where this is the backend's stub, else the parent; 0 (none) when the parent is
    init already. A server that died while its stub was loading (its port already in use) left the stub to
    init before `initialize` ran, and a watcher told to wait on init's pid would wait forever (seen: an
    orphan stub)."""
    parent = os.getppid()
    arguments = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    if arguments[0].endswith(b"triton_python_backend_stub") and len(arguments) > 5 and arguments[5].isdigit():
        given = int(arguments[5])
        return given if given == parent else 0
    return 0 if parent == 1 else parent


def parent_and_start(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, or None once it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def watch(stub: int, server: int) -> str:
    """Wait until the stub ends (returns "ended") or its server is gone (kills a stub still there
    after GRACE_S: returns "killed" or "ended")."""
    first = parent_and_start(stub)
    if first is None:
        return "ended"
    started = first[1]
    while (now := parent_and_start(stub)) is not None and now == (server, started):
        time.sleep(INTERVAL_S)
    if now is None or now[1] != started:
        return "ended"
    deadline = time.monotonic() + GRACE_S
    while (now := parent_and_start(stub)) is not None and now[1] == started and time.monotonic() < deadline:
        time.sleep(0.05)
    if now is None or now[1] != started:
        return "ended"
    os.kill(stub, signal.SIGKILL)
    print(f"stub watchdog: the server {server} is gone and stub {stub} did not end in {GRACE_S:g} s: killed it")
    return "killed"


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group; the stub's end ends this
    watch(int(sys.argv[1]), int(sys.argv[2]))
