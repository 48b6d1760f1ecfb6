"""No orphans and no leftovers, with real processes: a child dies with the process that started it
(even when the thread that started it is long gone); a start removes what a dead owner's run left
(its process group, its shared-memory regions, its work directory) and nothing of a living one's;
and a Triton that was killed, or whose model was reloaded after its stub died, or that logged
elsewhere, is stopped without leaving a region, a stub or a folder behind."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from serving.host.launcher import EXIT_TIMEOUT_S, POLL_SECONDS, start_triton
from serving.host.process import (
    BOOT_CLOCK,
    OWNER_FILE,
    SHM_DIR,
    ManagedProcess,
    dying_with_parent,
    group_members,
    reap_leftovers,
)

SHM_REGION_BYTES = 16 << 20  # the launcher's shm-default-byte-size


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(predicate, timeout: float) -> float:
    """Seconds until `predicate()`; fails after `timeout`."""
    began = time.monotonic()
    while not predicate():
        assert time.monotonic() - began < timeout, f"not within {timeout:g} s"
        time.sleep(0.02)
    return time.monotonic() - began


# --- the owner's death, and what a dead owner left ---------------------------------------------------

OWNER = textwrap.dedent(
    """
    import os, subprocess, sys, threading
    from pathlib import Path
    from serving.host.process import ManagedProcess, _write_owner_record

    work, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "managed":  # started from a thread that ends at once, as the supervisor's restarts are
        started = []
        thread = threading.Thread(target=lambda: started.append(ManagedProcess.spawn(["sleep", "300"], work)))
        thread.start()
        thread.join()
        pid = started[0].pid
    else:  # as a run before the death signal existed left it: a group of its own, nothing tying it to us
        pid = subprocess.Popen(["sleep", "300"], start_new_session=True).pid
        _write_owner_record(work, pid, "triton_python_backend_shm_region_test-leftover_", True)
        Path("/dev/shm/triton_python_backend_shm_region_test-leftover_x").write_bytes(b"0" * 4096)
    print(pid, flush=True)
    if mode == "managed":
        sys.stdin.read()  # until the test kills us
    """
)


def run_owner(work: Path, mode: str) -> tuple[subprocess.Popen, int]:
    work.mkdir()
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(work), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return owner, int(owner.stdout.readline())


def test_a_child_dies_with_its_owner_even_when_the_thread_that_started_it_ended(tmp_path):
    owner, child = run_owner(tmp_path / "run", "managed")
    try:
        time.sleep(0.5)
        assert running(child), "the child died with the thread that started it"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        print(f"the child ended {wait_until(lambda: not running(child), timeout=5.0):.2f} s after its owner's kill -9")
    finally:
        owner.kill()
        if running(child):
            os.kill(child, signal.SIGKILL)


def test_no_python_runs_between_fork_and_exec_and_an_orphan_before_its_signal_ends_at_once(tmp_path):
    """setpriv sets the death signal (Debian's base has it): no preexec_fn, whose Python in a forked child of a
    process with threads crashed there once; the shell after it ends the child whose parent died before the
    signal was set (its parent is then another process), and runs the command otherwise."""
    command, options = dying_with_parent(["touch", str(tmp_path / "ran")])
    assert options == {} and Path(command[0]).name == "setpriv", (command, options)
    assert subprocess.run(command, check=False).returncode == 0 and (tmp_path / "ran").exists()
    (tmp_path / "ran").unlink()
    orphaned = [str(os.getppid()) if part == str(os.getpid()) else part for part in command]  # a parent not its own
    assert orphaned != command and subprocess.run(orphaned, check=False).returncode == 1
    assert not (tmp_path / "ran").exists()


def test_a_living_owner_is_known_by_its_start_since_boot_and_a_record_written_before_survives_a_clock_step(tmp_path):
    """psutil's create_time adds the boot time as the wall clock tells it now: a step of the clock moves it, and a
    reaper that read a living owner as gone removed a running Triton's folder under a test session (its models
    unloaded). A record holds its owner's start since boot; one written before (the wall clock's) is read with a
    second or two of slack."""
    import psutil

    now = _mkdir(tmp_path / "now")
    ManagedProcess.spawn(["true"], now).wait()  # its record: this process the owner, the child ended
    record = json.loads((now / OWNER_FILE).read_text())
    ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
    assert record["clock"] == BOOT_CLOCK and record["owner_started"] == ticks / os.sysconf("SC_CLK_TCK")
    before = _mkdir(tmp_path / "before")  # as written before, then the wall clock stepped by a second
    stepped = psutil.Process().create_time() + 1.0
    fields = {"pid": None, "started": None, "owner": os.getpid(), "owner_started": stepped, "shm_prefix": None}
    (before / OWNER_FILE).write_text(json.dumps(fields | {"owns_work_dir": True}))
    assert reap_leftovers(tmp_path) == []
    assert (now / OWNER_FILE).exists() and (before / OWNER_FILE).exists()


def test_a_start_removes_what_a_dead_owner_left_and_nothing_of_a_living_one(tmp_path):
    owner, orphan = run_owner(tmp_path / "dead", "orphan")
    owner.wait(10)
    dead_region = SHM_DIR / "triton_python_backend_shm_region_test-leftover_x"
    living_dir = _mkdir(tmp_path / "living")
    living = ManagedProcess(ManagedProcess.spawn(["sleep", "300"], living_dir), living_dir, living_dir / "log")
    living_region = SHM_DIR / "triton_python_backend_shm_region_test-living_x"
    living_region.write_bytes(b"0" * 4096)  # no one maps it, but its owner (this test) lives
    try:
        assert running(orphan) and dead_region.exists()
        removed = reap_leftovers(tmp_path)
        assert not running(orphan), "the dead owner's process was left running"
        assert not dead_region.exists() and not (tmp_path / "dead").exists()
        assert removed == [
            f"process group {orphan} (started by pid {owner.pid}, which is gone)",
            str(dead_region),
            str(tmp_path / "dead"),
        ]
        assert living.is_running() and living_region.exists() and (tmp_path / "living" / OWNER_FILE).exists()
        assert reap_leftovers(tmp_path) == []  # nothing twice
    finally:
        living.stop()
        living_region.unlink(missing_ok=True)
        dead_region.unlink(missing_ok=True)
        if running(orphan):
            os.kill(orphan, signal.SIGKILL)


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


# --- a real Triton's stops ------------------------------------------------------------------------------


def stubs(server) -> dict[str, int]:
    """{model instance: pid} of a server's stubs (the members of its process group but itself)."""
    found = {}
    for pid in group_members(server.process.pid):
        with contextlib.suppress(OSError):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"triton_python_backend_stub" in command[0] and len(command) > 8:  # not yet exec'd: bash -c
                found[command[8].decode()] = pid
    return found


def regions(server) -> list[Path]:
    return sorted(SHM_DIR.glob(f"{server.shm_prefix}*"))


def assert_nothing_left(server, stub_pids, log_kept: bool = False) -> None:
    assert not regions(server), "a shared-memory region outlived its server"
    if log_kept:  # after a failure the log alone is kept, in the work directory
        assert [entry.name for entry in server.work_dir.iterdir()] == [server.log_path.name]
        shutil.rmtree(server.work_dir)
    assert not server.work_dir.exists(), f"{server.work_dir} outlived its server"
    assert not [pid for pid in stub_pids if running(pid)], "a stub outlived its server"


def test_a_killed_tritonserver_leaves_no_region_stub_or_folder(tiny_repository):
    server = start_triton(tiny_repository)
    wait_until(lambda: sorted(stubs(server)) == ["forward_0_0", "sessions_0_0"], timeout=10.0)
    stub_pids = list(stubs(server).values())
    sizes = [region.stat().st_size for region in regions(server)]  # each stub's
    assert len(sizes) >= 2 and set(sizes) == {SHM_REGION_BYTES}, sizes
    os.kill(server.process.pid, signal.SIGKILL)
    server.stop()
    assert server.process.returncode == -signal.SIGKILL
    assert_nothing_left(server, stub_pids, log_kept=True)


def infer_forward(server) -> np.ndarray:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        x = httpclient.InferInput("hidden_states", [1, 2, 32], "FP32")
        x.set_data_from_numpy(np.ones((1, 2, 32), np.float32))
        return client.infer("forward", [x]).as_numpy("output")
    finally:
        client.close()


def reload_dead_forward(server, during=None) -> None:
    """kill -9 of the forward stub, then `server.reload` (as the supervisor does), `during(reloading)`
    called meanwhile if given (`reloading`: the thread reloading); asserts that a new stub answers as
    the old one did."""
    before = infer_forward(server)
    dead = stubs(server)["forward_0_0"]
    os.kill(dead, signal.SIGKILL)
    reloading = threading.Thread(target=server.reload, args=(["forward"],))
    reloading.start()
    if during is not None:
        during(reloading)
    reloading.join(60)
    assert stubs(server)["forward_0_0"] != dead
    np.testing.assert_array_equal(infer_forward(server), before)


def stop_and_check(server, caplog) -> tuple[int, float]:
    """The stop's exit code and seconds, once nothing is left."""
    stub_pids = list(stubs(server).values())
    began = time.monotonic()
    with caplog.at_level(logging.WARNING):
        returncode = server.stop()
    seconds = time.monotonic() - began
    print(f"stopped in {seconds:.1f} s, tritonserver's exit code {returncode}")
    assert "kept" not in caplog.text, caplog.text  # neither the log nor any file is kept as after a failure
    assert_nothing_left(server, stub_pids)
    return returncode, seconds


def test_a_server_whose_stub_died_and_was_reloaded_stops_cleanly_and_logging_elsewhere_leaves_no_folder(
    tiny_repository, tmp_path, caplog
):
    """One server for both (a start costs seconds): its log is outside its work directory, which the
    stop removes all the same; its polls load nothing but the model reloaded."""
    log_path = tmp_path / "triton.log"
    server = start_triton(tiny_repository, log_path=log_path)
    started = time.monotonic()
    reload_dead_forward(server)
    time.sleep(max(0.0, 3 * POLL_SECONDS - (time.monotonic() - started)))  # at least 3 of Triton's polls
    assert stop_and_check(server, caplog)[0] == 0
    log = log_path.read_text()
    # each model loaded once at the start, and forward once more by the reload: nothing is loaded twice
    assert log.count("successfully loaded 'sessions'") == 1, log
    assert log.count("successfully loaded 'forward'") == 2, log


def test_requests_that_reach_the_dead_model_during_its_reload_leave_nothing_behind(tiny_repository, caplog):
    """Triton 2.51 keeps a request that reaches the replaced model while it is swapped out, and with
    it that model, which then never unloads: the stop ends Triton once every model it serves has
    unloaded (kill -9: nothing is left in flight), not at its exit timeout; nothing is kept or left."""
    server = start_triton(tiny_repository)

    def knock(reloading: threading.Thread) -> None:
        """Requests until the model is swapped in: refused, or stuck until the client gives up."""
        x = httpclient.InferInput("hidden_states", [1, 2, 32], "FP32")
        x.set_data_from_numpy(np.ones((1, 2, 32), np.float32))
        knocked = 0
        while reloading.is_alive() or not knocked:
            client = httpclient.InferenceServerClient(server.http_url, network_timeout=2.0)
            with contextlib.suppress(Exception):
                client.infer("forward", [x])
            client.close()
            knocked += 1
            time.sleep(0.05)

    reload_dead_forward(server, during=knock)
    returncode, seconds = stop_and_check(server, caplog)
    assert returncode in (0, -signal.SIGKILL) and seconds < EXIT_TIMEOUT_S
