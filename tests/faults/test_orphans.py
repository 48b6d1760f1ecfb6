"""kill -9 of `python -m serving` itself (the gateway, the supervisors and the Envoy manager share its
process): every process it started ends with it (tritonserver, the stubs, Envoy), so nothing keeps
its ports, and the same command started again serves at once, after removing and naming what the
killed run left (its work folders, shared-memory regions nobody maps)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from serving.host.launcher import shm_prefix
from serving.host.process import OWNER_FILE, SHM_DIR
from tests.fixtures.serving_process import new_ports, start_serving, still_running

pytestmark = [pytest.mark.served, pytest.mark.slow, pytest.mark.timeout(600)]
LEFT_AFTER_S = 5.0  # the bound: what runs this long after the kill -9


@pytest.fixture(scope="module")
def tiny_repository(artifact_dir, tmp_path_factory):
    from serving.triton.config import ServingSettings
    from serving.triton.repository import write_repository

    return write_repository(artifact_dir("tiny"), tmp_path_factory.mktemp("repository"), ServingSettings(threads=1))


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
    assert not still_running(served.seen)


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
        # a folder per Triton, Envoy's, and the gateway's session store
        assert len(folders) == replicas + (replicas > 1) + 1
        assert sum(folder.name.startswith("serving-sessions-") for folder in folders) == 1
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
        for line in still_running(started):  # whatever failed, none of its processes stays
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path
