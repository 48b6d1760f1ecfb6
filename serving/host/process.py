"""The processes the host starts (tritonserver, Envoy): one life for all of them, and no orphans.

A `ManagedProcess` runs in a session of its own (a stop reaches its whole group: tritonserver's model
stubs too), in a private work directory, and dies with the process that started it: it is spawned
with PR_SET_PDEATHSIG (set by util-linux's setpriv, `dying_with_parent`), from one thread that lives
as long as this process (the kernel sends the signal when the *thread* that forked the child ends,
so a child started from a supervisor's or a pool's thread would otherwise die with that thread).
Triton's stubs are tritonserver's children and check every 300 ms that it still exists (the Python
backend's own watch), so they follow it.

Every work directory holds an owner record: the child's pid and start time, and those of the
process that started it. `reap_leftovers()` (run before every start) finds the records whose owner
is gone, a run killed before it could stop what it started, and removes what they name: the
child's process group if it is still there and still the recorded one, the shared-memory regions
under the record's prefix that no process maps, and the work directory. A record whose owner lives
belongs to a running server and is never touched.

A managed process gets no `SERVING_*` variable: those are the gateway's settings, its API keys and
session secret among them, and neither Triton, its stubs nor Envoy reads any of them.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ctypes
import functools
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

OWNER_FILE = ".attention-serving-owner.json"  # in each work directory: who started what
SHM_DIR = Path("/dev/shm")
GROUP_EXIT_TIMEOUT_S = 5.0  # how long a stop waits for a killed group's members to be gone
SETTLED_POLL_S = 0.1  # how often a stop asks whether what the process still waits for will ever come
# the gateway's settings (serving/gateway/settings.py): API keys, their file, the session secret, a store URL
# that may hold a password; a process that checks no key keeps none of them
GATEWAY_SETTINGS_PREFIX = "SERVING_"


class ProcessStartError(RuntimeError):
    """A managed process did not become ready; the message ends with the tail of its log."""


# --- dying with the parent ------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A preexec_fn: the child gets `sig` when the thread that forked it ends (with this process:
    see `_Spawner`), and ends at once if `parent` died before the request took effect. SIGKILL: a
    graceful stop is the owner's job; once the owner is gone what matters is that nothing holds the
    ports (a graceful Triton exit may take its exit timeout), and what a kill leaves (shared-memory
    regions, folders) the next start removes."""
    prctl = _libc.prctl  # looked up before the fork: the child only calls it

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


@functools.cache
def _death_signal_wrapper() -> str | None:
    """util-linux's setpriv where it takes --pdeathsig (2.33 and later: Debian's base, the NGC images)."""
    setpriv = shutil.which("setpriv")
    try:
        probe = subprocess.run([setpriv, "--pdeathsig", "KILL", "true"], timeout=10, check=False) if setpriv else None
    except (OSError, subprocess.SubprocessError):
        probe = None
    return setpriv if probe is not None and probe.returncode == 0 else None


# run by the child once its death signal is set: it ends there if the parent died before that, else runs the command
_UNLESS_ORPHANED = 'test "$PPID" = "$1" || exit 1; shift; exec "$@"'


def dying_with_parent(command: Sequence[str], sig: signal.Signals = signal.SIGKILL) -> tuple[list[str], dict]:
    """`command` and the Popen options under which it gets `sig` when the thread that forks it ends, and ends at
    once if this process died before the signal was set: setpriv sets it and execs a shell that checks its
    parent and execs the command, so that no Python runs in the forked child (a preexec_fn does, and in a
    process with threads the child can crash there: a segfault between fork and exec, seen under the benches'
    threads and torch's). Where setpriv cannot, the preexec_fn `die_with_parent`."""
    wrapper = _death_signal_wrapper()
    if wrapper:
        signal_name = sig.name.removeprefix("SIG")
        return [
            wrapper,
            "--pdeathsig",
            signal_name,
            "--",
            "/bin/sh",
            "-c",
            _UNLESS_ORPHANED,
            "sh",
            str(os.getpid()),
            *command,
        ], {}
    return list(command), {"preexec_fn": die_with_parent(os.getpid(), sig)}


class _Spawner:
    """One thread that starts every managed process and lives as long as this process, so the
    children's death signal comes when this process ends and never when a caller's thread does."""

    _instance: _Spawner | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> _Spawner:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        self._requests: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, name="process-spawner", daemon=True).start()

    def popen(self, command: Sequence[str], **options) -> subprocess.Popen:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._requests.put((command, options, done))
        return done.result()

    def _serve(self) -> None:
        while True:
            command, options, done = self._requests.get()
            try:
                command, dying = dying_with_parent(command)
                done.set_result(subprocess.Popen(command, **dying, **options))
            except BaseException as error:  # handed to the caller, who raises it
                done.set_exception(error)


def without_gateway_settings(env: Mapping[str, str]) -> dict[str, str]:
    """`env` less every gateway setting (`SERVING_*`), the secrets among them."""
    return {name: value for name, value in env.items() if not name.startswith(GATEWAY_SETTINGS_PREFIX)}


# --- the managed process ----------------------------------------------------------------------------


class ManagedProcess:
    """A child process in its own session and work directory, stopped by `stop()` (or leaving the
    `with` block, or this process's exit). Subclasses say how it stops and what it leaves behind."""

    name = "process"  # how messages name it

    def __init__(self, process: subprocess.Popen, work_dir: Path, log_path: Path) -> None:
        self.process, self.work_dir, self.log_path = process, work_dir, log_path
        self._stopping = False
        self._stop_lock = threading.Lock()
        atexit.register(self.stop)

    @classmethod
    def spawn(
        cls,
        command: Sequence[str],
        work_dir: Path,
        *,
        output: Path | None = None,
        env: dict[str, str] | None = None,
        shm_prefix: str | None = None,
        owns_work_dir: bool = True,
        gateway_settings: Mapping[str, str] | None = None,
    ) -> subprocess.Popen:
        """Start `command` in `work_dir` (stdout and stderr appended to `output`, or dropped) after
        removing what dead runs left, and record who started it. `gateway_settings`: the SERVING_*
        variables of a gateway process, which then shares this process's directory and output."""
        for removed in reap_leftovers():
            log.warning("removed what an earlier run left: %s", removed)
        base = without_gateway_settings(os.environ if env is None else env)
        with contextlib.ExitStack() as stack:
            sink = None if gateway_settings is not None else stack.enter_context(open(output or os.devnull, "ab"))
            process = _Spawner.get().popen(
                list(command),
                stdout=sink,
                stderr=subprocess.STDOUT if sink is not None else None,
                stdin=subprocess.DEVNULL,
                env=base | dict(gateway_settings or {}),
                cwd=work_dir if gateway_settings is None else None,  # a gateway reads paths as its user gave them
                start_new_session=True,  # its own process group: a stop reaches its children too
            )
        _write_owner_record(work_dir, process.pid, shm_prefix, owns_work_dir)
        return process

    def is_running(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_ready(self, ready: Callable[[], bool], timeout: float, error: type[Exception], poll_s: float) -> None:
        """Until `ready()`; `error` naming the exit code or the timeout, with the log's tail."""
        deadline = time.monotonic() + timeout
        while not ready():
            if not self.is_running():
                raise error(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise error(f"{self.name} not ready after {timeout:g} s:\n{self.log_tail()}")
            time.sleep(poll_s)

    def claim_stop(self) -> bool:
        """True for the first caller of a stop alone (a stop's cleanup runs once)."""
        with self._stop_lock:
            first, self._stopping = not self._stopping, True
            return first

    def end(self, grace: Sequence[tuple[signal.Signals, float]], settled: Callable[[], bool] | None = None) -> bool:
        """Each signal in turn while it runs, waiting its seconds, or until `settled()` says that what
        it still waits for will never come (asked every SETTLED_POLL_S); then SIGKILL of the whole group,
        and wait until no member is left (a stub that outlived its server). Idempotent. Returns
        whether it exited before the SIGKILL."""
        atexit.unregister(self.stop)
        for sig, wait in grace:
            if self.process.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)
            if self._wait(wait, settled):
                break
        graceful = self.process.poll() is not None
        kill_group(self.process.pid)
        self.process.wait(10)
        wait_group_gone(self.process.pid)
        with contextlib.suppress(FileNotFoundError):
            (self.work_dir / OWNER_FILE).unlink()
        return graceful

    def _wait(self, seconds: float, settled: Callable[[], bool] | None) -> bool:
        """Until the process exits or `seconds` pass; True, with the process still running, once `settled()`."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.process.wait(left if settled is None else min(left, SETTLED_POLL_S))
                return False
            except subprocess.TimeoutExpired:
                if settled is not None and settled():
                    return True
        return False

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL of the group after `timeout`; the work directory stays (a subclass
        says what it leaves)."""
        if self.claim_stop():
            self.end(((signal.SIGTERM, timeout),))
        return self.process.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- process groups and shared memory ---------------------------------------------------------------


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(stat.parent.name))
    return members


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def wait_group_gone(pgid: int, timeout: float = GROUP_EXIT_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def mapped_shm_names() -> set[str]:
    """Names of the /dev/shm regions that some process maps (one pass over every process's maps)."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            for line in maps.read_text().splitlines():
                if f" {SHM_DIR}/" in line:
                    names.add(line.rsplit("/", 1)[-1])
    return names


def remove_unmapped_shm(prefix: str, in_use: set[str] | None = None) -> list[Path]:
    """Remove the shared-memory regions under `prefix` that no process maps (`in_use`: the names
    `mapped_shm_names()` gave, when the caller removes several prefixes' regions); returns them."""
    if not SHM_DIR.is_dir():
        return []
    in_use, removed = mapped_shm_names() if in_use is None else in_use, []
    for region in SHM_DIR.glob(f"{prefix}*"):
        if region.name not in in_use:
            with contextlib.suppress(FileNotFoundError):
                region.unlink()
                removed.append(region)
    return removed


# --- owner records and leftovers ----------------------------------------------------------------------


# a record's start times are seconds since boot (BOOT_CLOCK); a record without it, written before, holds psutil's
# create_time, which follows the wall clock: a step of the clock between the record and a later look moves it, and a
# living owner read as gone has its server's folder removed (the likely cause of a test session's Triton losing its
# models: docs/reliability.md)
BOOT_CLOCK = "since boot"
WALL_CLOCK_SLACK_S = 2.0  # how far a clock step may have moved a record written before


def _start_time(pid: int) -> float | None:
    """When `pid` started, in seconds since boot: /proc/PID/stat's start in clock ticks, which no clock step moves
    (psutil's `create_time` adds the boot time as the wall clock tells it now); psutil's where /proc has none."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
    return _wall_start_time(pid)


def _wall_start_time(pid: int) -> float | None:
    import psutil

    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).create_time()
    return None


def _write_owner_record(work_dir: Path, pid: int | None, shm_prefix: str | None, owns_work_dir: bool) -> None:
    """`pid`: the child the folder belongs to (None: only the folder, no process of its own)."""
    record = {
        "pid": pid,
        "started": _start_time(pid) if pid is not None else None,
        "owner": os.getpid(),
        "owner_started": _start_time(os.getpid()),
        "clock": BOOT_CLOCK,
        "shm_prefix": shm_prefix,
        "owns_work_dir": owns_work_dir,
    }
    scratch = work_dir / f"{OWNER_FILE}.{pid}"
    scratch.write_text(json.dumps(record))
    scratch.replace(work_dir / OWNER_FILE)


def owned_folder(prefix: str) -> Path:
    """A temporary folder of this process's (a session store's): the process removes it when it ends;
    if it is killed first, the next start's `reap_leftovers` does (an owner record without a child)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    _write_owner_record(folder, None, shm_prefix=None, owns_work_dir=True)
    return folder


def _same_start(pid: int, started: float | None, record: dict) -> bool | None:
    """Whether `pid` is the process that started at `started` (None: no process `pid` now)."""
    if record.get("clock") == BOOT_CLOCK:
        now = _start_time(pid)
        return None if now is None else now == started
    now = _wall_start_time(pid)  # a record written before the boot clock
    return None if now is None else started is not None and abs(now - started) <= WALL_CLOCK_SLACK_S


def _alive(pid: int, started: float | None, record: dict) -> bool:
    return started is not None and bool(_same_start(pid, started, record))


def reap_leftovers(temp_dir: Path | None = None) -> list[str]:
    """Remove what runs whose owner died left in `temp_dir` (the system's by default); returns a
    line for each thing removed. Every group is ended before the shared memory is looked at, once
    for all of them (a kill of a launcher of many servers leaves many records)."""
    claimed = []
    for record_path in Path(temp_dir or tempfile.gettempdir()).glob(f"*/{OWNER_FILE}"):
        record = _claim(record_path)
        if record is not None:
            claimed.append((record_path.parent, record))
    removed = [line for _, record in claimed for line in _end_group(record)]
    in_use = mapped_shm_names() if any(record.get("shm_prefix") for _, record in claimed) else set()
    for work_dir, record in claimed:
        removed += _remove_files(work_dir, record, in_use)
    return removed


def _claim(record_path: Path) -> dict | None:
    """The record if its owner is gone, renamed first so that one reaper alone acts on it."""
    try:
        if record_path.stat().st_uid != os.getuid():
            return None
        record = json.loads(record_path.read_text())
        if _alive(record["owner"], record["owner_started"], record):
            return None
        claimed = record_path.with_name(f"{OWNER_FILE}.reaping-{os.getpid()}")
        record_path.rename(claimed)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record


def _end_group(record: dict) -> list[str]:
    pid, owner = record["pid"], record["owner"]
    same = _same_start(pid, record["started"], record) if pid is not None else None
    # the group is the recorded one while its leader is the recorded process, or gone (its stubs left)
    if pid is not None and same is not False and group_members(pid):
        kill_group(pid)
        wait_group_gone(pid)
        return [f"process group {pid} (started by pid {owner}, which is gone)"]
    return []


def _remove_files(work_dir: Path, record: dict, shm_in_use: set[str]) -> list[str]:
    removed = []
    if record.get("shm_prefix"):
        removed += [str(region) for region in remove_unmapped_shm(record["shm_prefix"], shm_in_use)]
    if record.get("owns_work_dir", True):
        shutil.rmtree(work_dir, ignore_errors=True)
        removed.append(str(work_dir))
    else:
        for leftover in work_dir.glob(f"{OWNER_FILE}*"):
            with contextlib.suppress(OSError):
                leftover.unlink()
    return removed
