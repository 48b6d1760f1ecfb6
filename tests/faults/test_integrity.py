"""A model file changed after its build (one weight moved by 1e-3: the graph still loads and would
serve answers a little off): the Python models check each graph against the digest its build
recorded (the version folder's SHA256SUMS) and refuse to load it, and the reason, naming the file
and both digests, is in Triton's model status and log, so in what `python -m serving` prints.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from client import Client
from contract.files import sha256
from serving.host.launcher import free_port, start_triton
from serving.triton.config import ServingSettings
from serving.triton.repository import write_repository
from tests.serving.helpers import change_one_weight

pytestmark = [pytest.mark.served, pytest.mark.slow]


@pytest.fixture
def repository(artifact_dir, tmp_path) -> Path:
    return write_repository(artifact_dir("tiny"), tmp_path / "repository", ServingSettings(threads=1))


def changed(path: Path) -> tuple[str, str]:
    """Move one weight of the graph at `path`; its digest before and after."""
    before = sha256(path)
    change_one_weight(path)
    return before, sha256(path)


def logged(path: Path, text: str, timeout: float = 120.0) -> str:
    """The log at `path` once it holds `text` (read every 0.1 s; fails after `timeout`)."""
    deadline = time.monotonic() + timeout
    while text not in (log := path.read_text()):
        assert time.monotonic() < deadline, f"{text!r} not in {path} within {timeout:g} s:\n{log[-3000:]}"
        time.sleep(0.1)
    return log


def processes_using(path: Path) -> list[str]:
    """Command lines of the running processes that name `path` (a tritonserver, a model's stub)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in command and "pytest" not in command:
            found.append(command)
    return found


def test_serving_a_changed_graph_fails_at_start_naming_the_file_and_both_digests(repository, tmp_path):
    graph = repository / "forward" / "1" / "model.fp32-fused.onnx"
    recorded, actual = changed(graph)
    ports = [str(free_port()) for _ in range(3)]
    command = [sys.executable, "-m", "serving", "--model-repository", str(repository), "--no-gateway"]
    command += ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]]
    finished = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False)
    output = finished.stdout + finished.stderr
    assert finished.returncode == 1, output
    # Triton's model status, in its log and in what `python -m serving` prints, names the user's file
    assert f"UNAVAILABLE: Internal: IntegrityError: {graph.resolve()} changed after its build" in output, output
    assert f"sha256 {actual}, the build recorded {recorded}" in output
    assert not processes_using(repository)  # Triton and the other model's stub are gone too


def test_a_running_model_refuses_to_reload_a_changed_graph_and_keeps_serving_the_checked_one(repository, tmp_path):
    server = start_triton(repository, log_path=tmp_path / "triton.log")
    try:
        client = Client(server.grpc_url, retries=0)
        width = client.metadata("sessions").d_model
        token = np.random.default_rng(0).standard_normal((1, 3, width)).astype(np.float32)
        with client.session() as session:
            before = session.step(token)
        graph = repository / "sessions" / "1" / "model.fp32-static.onnx"
        recorded, actual = changed(graph)
        # as the supervisor reloads a model whose process died: Triton's next poll loads it anew and
        # fails; the log says when it has (no fixed wait for a reload that never comes)
        with pytest.raises(TimeoutError, match="did not load sessions again"):
            server.reload(["sessions"], timeout=1)
        log = logged(tmp_path / "triton.log", "failed to load 'sessions' version 1")
        assert "failed to load 'sessions' version 1: Internal: IntegrityError" in log, server.log_tail()
        assert f"IntegrityError: {graph.resolve()} changed after its build: sha256 {actual}" in log
        assert f"the build recorded {recorded}" in log
        # Triton keeps the version it had, whose graph was checked when it loaded
        with client.session() as session:
            np.testing.assert_array_equal(session.step(token), before)
        client.close()
    finally:
        server.stop()
