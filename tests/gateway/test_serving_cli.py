"""`python -m serving` as a user runs it: with SERVING_API_KEYS=k,
`python -m serving --model-repository REPO --gateway-port P ...` on a repository built from a config
no preset uses answers /v1/attend with 401 without the key and, with it, outputs equal to the
independent implementation (tests/reference.py); Ctrl-C stops Triton and the gateway cleanly."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from contract import names
from contract.config import ModelConfig
from contract.files import WEIGHTS_FILENAME
from serving.triton.config import ServingSettings
from serving.triton.repository import write_repository
from tests import reference
from tests.fixtures.serving_process import serving_process

pytestmark = pytest.mark.served


@pytest.fixture(scope="module")
def served_unseen(artifact_dir, tmp_path_factory):
    """One `python -m serving` for the module, its temporary folder (TMPDIR) a folder of its own; the
    last test stops it with Ctrl-C (serving_process checks, on leaving, that it exited 0 and left no
    process)."""
    artifact = artifact_dir("unseen")
    work = tmp_path_factory.mktemp("serving-cli")
    repository = write_repository(artifact, work / "repository", ServingSettings(threads=1))
    (work / "tmp").mkdir()
    with serving_process(repository, work, env={"SERVING_API_KEYS": "k", "TMPDIR": str(work / "tmp")}) as served:
        yield artifact, served


def test_attend_needs_the_key_and_matches_the_independent_implementation(served_unseen):
    artifact, served = served_unseen
    cfg = ModelConfig.load(artifact)
    url = f"{served.gateway_url}/v1/attend"
    rng = np.random.default_rng(5)
    hidden = rng.standard_normal((3, 4, cfg.d_model)).astype(np.float32)
    mask = np.ones((3, 4), dtype=np.int64)
    mask[1, :1] = 0
    mask[2, :3] = 0
    body = {names.HIDDEN_STATES: hidden.tolist(), names.ATTENTION_MASK: mask.tolist()}

    assert httpx.post(url, json=body, timeout=60).status_code == 401
    answer = httpx.post(url, json=body, headers={"X-API-Key": "k"}, timeout=60)
    assert answer.status_code == 200, answer.text

    weights = reference.load_weights(artifact / WEIGHTS_FILENAME)
    expected, presents = reference.forward(cfg, weights, hidden, mask)
    real = reference.real_rows(mask, new=4)
    np.testing.assert_allclose(np.array(answer.json()["output"])[real], expected[real], atol=1e-5, rtol=1e-5)
    real_keys = mask == 1
    for pair, (key, value) in zip(answer.json()["present"], presents, strict=True):
        for served_cache, theirs in ((pair["key"], key), (pair["value"], value)):
            ours = np.array(served_cache).transpose(0, 2, 1, 3)[real_keys]
            np.testing.assert_allclose(ours, theirs.transpose(0, 2, 1, 3)[real_keys], atol=1e-5, rtol=1e-5)
    assert "gateway auth    enabled (1 key(s))" in served.output()


def test_a_second_serving_on_the_same_ports_names_the_holder_and_reads_nothing(served_unseen, tmp_path):
    """The second command fails before starting anything, naming the port and the process holding it;
    it never prints the first server's models or a curl line for its width."""
    import subprocess
    import sys

    _, served = served_unseen
    command = [
        sys.executable, "-m", "serving", "--model-repository", str(served.output_path.parent / "repository"),
        "--http-port", str(served.http_port), "--grpc-port", str(served.grpc_port),
        "--metrics-port", str(served.metrics_port), "--gateway-port", str(served.gateway_port),
    ]  # fmt: skip
    second = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert second.returncode == 1, second.stdout + second.stderr
    assert f"http port {served.http_port} on 127.0.0.1 is already in use (pid " in second.stderr
    assert "tritonserver" in second.stderr and "--http-port" in second.stderr
    assert "models" not in second.stdout and "curl" not in second.stdout
    assert httpx.get(f"{served.gateway_url}/readyz", timeout=30).status_code == 200  # the first one is untouched


def test_the_console_tells_each_models_runner_and_how_many_sessions_fit(served_unseen):
    """Read from what the models log once loaded: the stateless model's file and placement, the
    session model's capacity (the budget over one sequence's fp32 keys and values on the CPU)."""
    artifact, served = served_unseen
    cfg = ModelConfig.load(artifact)
    one_sequence = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * cfg.max_seq_len * 4
    sessions = ServingSettings(threads=1).kv_cache_bytes // one_sequence
    lines = served.output().splitlines()
    assert any(line.startswith("repository ") and line.endswith("/repository") for line in lines), lines
    assert any(line.startswith("forward ") and ".onnx on CPUExecutionProvider" in line for line in lines), lines
    assert any(line.startswith("sessions ") and "engine" in line for line in lines), lines
    assert any(f"= {sessions} sequences of up to {cfg.max_seq_len} positions" in line for line in lines), lines


def test_ctrl_c_with_a_direct_clients_session_open_is_a_clean_stop(served_unseen):
    """Triton counts an open sequence as an in-flight inference: a stop once waited its exit timeout,
    exited 1 and kept its temporary folder as if it had failed. Now: exit 0, a line saying what was
    dropped, nothing left in the temporary folder, no process left (serving_process checks).

    Last in the module: it stops the module's server."""
    import signal

    from client import Client

    _, served = served_unseen
    temporary = served.output_path.parent / "tmp"
    assert [p.name for p in temporary.iterdir() if p.name.startswith("triton-")], "Triton's folder is not under TMPDIR"
    triton = Client(f"127.0.0.1:{served.grpc_port}")
    triton.session().step(np.zeros((1, 2, triton.metadata().d_model), np.float32))  # never ended
    triton.close()
    served.process.send_signal(signal.SIGINT)
    assert served.process.wait(timeout=90) == 0, served.output()
    output = served.output()
    assert "Triton stopped with 1 session(s) still open" in output, output
    assert "its log is kept" not in output
    assert not [p.name for p in temporary.iterdir() if p.name.startswith("triton-")]
