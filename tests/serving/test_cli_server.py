"""The serving commands end to end, as a user runs them:

    python -m serving repository --artifacts <unseen config's artifacts> --repository R \
        --kv-cache-mib 3 --idle-timeout 2
    python -m serving --no-gateway --model-repository R --http-port .. --grpc-port .. --metrics-port ..

then plain KServe v2 JSON over HTTP (urllib, no tritonclient) to the stateless model and tritonclient's gRPC
streams to the session model (decoupled: Triton serves it on streams only, and says so over HTTP) against the
independent float64 implementation in tests/reference.py; the small KV budget and the short idle timeout of
that repository for the budget and eviction errors; and SIGINT leaves no process behind.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from client import Client as ProductClient
from client import ServerBusyError
from contract import names
from contract.config import ModelConfig
from serving.host.launcher import answers_200, free_port
from tests import reference
from tests.fixtures.serving_process import LEFT_GRACE_S, descendants, still_running_after
from tests.fixtures.triton import metric, wait_for_metric
from tests.serving.helpers import Client, new_sequence_id

pytestmark = pytest.mark.served

IDLE_SECONDS = 2.0  # the engine evicts an idle session after this
# 3 MiB of budget: 4 sequences of max_seq_len 1024 (768 bytes a position), 16 in rows of 256 positions,
# where a session starts (rows sized to the session)
CAPACITY = 16


@dataclasses.dataclass
class Served:
    process: subprocess.Popen
    repository: Path
    http_url: str
    grpc_url: str
    metrics_url: str
    cfg: ModelConfig
    weights: dict
    output_path: Path


def _run(command: list[str], timeout: float) -> None:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr


def _wait_ready(served: Served, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    for path in ("/v2/health/ready", "/v2/models/forward/ready", "/v2/models/sessions/ready"):
        while True:
            assert served.process.poll() is None, served.output_path.read_text()
            assert time.monotonic() < deadline, f"not ready: {path}\n{served.output_path.read_text()}"
            if answers_200(f"http://{served.http_url}{path}"):
                break
            time.sleep(0.2)


def stop(served: Served) -> int:
    if served.process.poll() is None:
        served.process.send_signal(signal.SIGINT)
    return served.process.wait(timeout=60)


@pytest.fixture(scope="module")
def served(artifact_dir, tmp_path_factory):
    artifacts = artifact_dir("unseen")
    repository = tmp_path_factory.mktemp("unseen-repository")
    command = [sys.executable, "-m", "serving", "repository", "--artifacts", str(artifacts)]
    command += ["--repository", str(repository), "--kv-cache-mib", "3", "--idle-timeout", str(IDLE_SECONDS)]
    _run([*command, "--threads", "1"], timeout=120)
    ports = {name: free_port() for name in ("http", "grpc", "metrics")}
    output_path = tmp_path_factory.mktemp("serving") / "output.txt"
    command = [sys.executable, "-m", "serving", "--no-gateway", "--model-repository", str(repository)]
    command += [f"--{name}-port={port}" for name, port in ports.items()]
    with open(output_path, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    cfg = ModelConfig.load(artifacts)
    weights = reference.load_weights(artifacts / "weights.safetensors")
    served = Served(
        process,
        repository,
        f"127.0.0.1:{ports['http']}",
        f"127.0.0.1:{ports['grpc']}",
        f"http://127.0.0.1:{ports['metrics']}/metrics",
        cfg,
        weights,
        output_path,
    )
    try:
        _wait_ready(served)
        yield served
    finally:
        stop(served)


def post(served: Served, model: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{served.http_url}/v2/models/{model}/infer", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def tensor(name: str, array: np.ndarray) -> dict:
    datatype = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}[array.dtype]
    return {"name": name, "shape": list(array.shape), "datatype": datatype, "data": array.ravel().tolist()}


def outputs(body: dict) -> dict[str, np.ndarray]:
    return {o["name"]: np.array(o["data"], np.float64).reshape(o["shape"]) for o in body["outputs"]}


def session_body(sequence_id: int, hidden: np.ndarray, start=False, end=False, mask=None) -> dict:
    inputs = [tensor(names.HIDDEN_STATES, hidden)]
    if mask is not None:
        inputs.append(tensor(names.ATTENTION_MASK, mask))
    parameters = {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}
    return {"parameters": parameters, "inputs": inputs}


# --- plain JSON, an unseen config, an independent implementation --------------------------


def test_stateless_json_matches_the_independent_implementation(served):
    cfg, rng = served.cfg, np.random.default_rng(0)
    past, new = 4, 3
    hidden = rng.standard_normal((2, new, cfg.d_model)).astype(np.float32)
    mask = np.ones((2, past + new), np.int64)
    mask[1, :2] = 0  # row 1 is left-padded
    caches = [
        tuple(rng.standard_normal((2, cfg.n_kv_heads, past, cfg.head_dim)).astype(np.float32) for _ in range(2))
        for _ in range(cfg.n_layers)
    ]
    inputs = [tensor(names.HIDDEN_STATES, hidden), tensor(names.ATTENTION_MASK, mask)]
    for layer, pair in enumerate(caches):
        inputs += [
            tensor(names.past_name(layer, kind), array) for kind, array in zip(names.KV_KINDS, pair, strict=True)
        ]
    status, body = post(served, "forward", {"inputs": inputs})
    assert status == 200, body
    got = outputs(body)
    expected, presents = reference.forward(cfg, served.weights, hidden, mask, caches)
    real = reference.real_rows(mask, new)
    np.testing.assert_allclose(got[names.OUTPUT][real], expected[real], atol=1e-5, rtol=1e-5)
    for layer, pair in enumerate(presents):
        for kind, array in zip(names.KV_KINDS, pair, strict=True):
            np.testing.assert_allclose(got[names.present_name(layer, kind)], array, atol=1e-5, rtol=1e-5)


def test_a_session_over_grpc_streams_matches_the_independent_implementation_and_http_is_told_why_not(served):
    cfg, sequence_id = served.cfg, new_sequence_id()
    hidden = np.random.default_rng(1).standard_normal((1, 6, cfg.d_model)).astype(np.float32)
    pieces = [(0, 3, True, False), (3, 4, False, False), (4, 6, False, True)]  # prefill, decode, decode + END
    with Client(served, "grpc") as grpc:
        got = [
            grpc.step(sequence_id, hidden[:, begin:end], start=start, end=last) for begin, end, start, last in pieces
        ]
    expected, _ = reference.forward(cfg, served.weights, hidden)
    np.testing.assert_allclose(np.concatenate(got, axis=1), expected, atol=1e-5, rtol=1e-5)
    status, answer = post(served, "sessions", session_body(new_sequence_id(), hidden[:, :1], start=True))
    assert status == 501 and "decoupled" in answer["error"], answer  # Triton's own answer: streams only


def _hidden_json(served: Served, shape: list[int], datatype: str = "FP32") -> dict:
    return {"name": names.HIDDEN_STATES, "shape": shape, "datatype": datatype, "data": [0.5] * int(np.prod(shape))}


@pytest.mark.parametrize(
    ("model", "case"),
    [
        ("forward", "wrong shape"),
        ("forward", "wrong dtype"),
        ("forward", "missing input"),
        ("forward", "mask length"),
    ],
)
def test_a_wrong_json_request_gets_400_naming_the_input(served, model, case):
    d = served.cfg.d_model
    if case == "wrong shape":
        inputs, named = [_hidden_json(served, [1, 2, d - 1])], names.HIDDEN_STATES
    elif case == "wrong dtype":
        inputs, named = [_hidden_json(served, [1, 2, d], "FP64")], names.HIDDEN_STATES
    elif case == "missing input":
        inputs, named = [tensor(names.ATTENTION_MASK, np.ones((1, 2), np.int64))], names.HIDDEN_STATES
    else:
        inputs, named = (
            [_hidden_json(served, [1, 2, d]), tensor(names.ATTENTION_MASK, np.ones((1, 3), np.int64))],
            names.ATTENTION_MASK,
        )
    status, answer = post(served, model, {"inputs": inputs})
    assert status == 400, answer
    assert named in answer["error"], answer


def test_json_that_does_not_parse_gets_triton_cores_500(served):
    """A known Triton limitation (TRITON_FACTS.md): the core, not our model, parses the JSON and
    answers 500 for a body it cannot parse or whose data does not fill its shape. The gateway turns
    these into 4xx; here we record what Triton itself does."""
    status, answer = post(served, "forward", b'{"inputs": [{"name": }]}')
    assert status == 500 and "failed to parse the request JSON buffer" in answer["error"]
    short = {"inputs": [{**_hidden_json(served, [1, 2, served.cfg.d_model]), "data": [0.5]}]}
    status, answer = post(served, "forward", short)
    assert status == 500 and "Shape does not match true shape of 'data'" in answer["error"]


# --- the cache budget and idle eviction ----------------------------------------------------------------


def one_token(served: Served, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 1, served.cfg.d_model)).astype(np.float32)


def test_a_full_budget_refuses_new_sessions_and_the_others_keep_working(served):
    assert metric(served, "attention_kv_cache_sequences", "sessions") == 0
    d, ids = served.cfg.d_model, [new_sequence_id() for _ in range(CAPACITY)]
    with Client(served, "grpc") as grpc:
        firsts = {sid: one_token(served, k) for k, sid in enumerate(ids)}
        for sid, hidden in firsts.items():
            grpc.step(sid, hidden, start=True)
        refused_grpc = new_sequence_id()
        with pytest.raises(InferenceServerException) as refused:
            grpc.step(refused_grpc, one_token(served, 9), start=True)
        assert refused.value.status() == "StatusCode.UNAVAILABLE" and "retry later" in refused.value.message()
        assert "KV cache budget" in refused.value.message() and str(refused_grpc) in refused.value.message()

        for k, sid in enumerate(ids):  # the admitted sessions go on, with the right numbers
            second = one_token(served, 100 + k)
            got = grpc.step(sid, second)
            expected, _ = reference.forward(served.cfg, served.weights, np.concatenate([firsts[sid], second], axis=1))
            np.testing.assert_allclose(got, expected[:, 1:], atol=1e-5, rtol=1e-5)
        held = CAPACITY * served.cfg.kv_cache_bytes(1, 2)
        assert wait_for_metric(served, "attention_kv_cache_bytes", "sessions", held) == held

        grpc.end(ids[0], d)  # memory comes back, and with it room for one more
        sequences = "attention_kv_cache_sequences"  # the engine core publishes it within a quarter second
        assert wait_for_metric(served, sequences, "sessions", CAPACITY - 1) == CAPACITY - 1
        held = (CAPACITY - 1) * served.cfg.kv_cache_bytes(1, 2)
        assert wait_for_metric(served, "attention_kv_cache_bytes", "sessions", held) == held
        grpc.step(refused_grpc, one_token(served, 9), start=True)
        for sid in [*ids[1:], refused_grpc]:
            grpc.end(sid, d)
    assert wait_for_metric(served, "attention_kv_cache_sequences", "sessions", 0) == 0
    assert wait_for_metric(served, "attention_kv_cache_bytes", "sessions", 0) == 0


def test_an_idle_session_is_evicted_its_memory_freed_and_its_next_step_says_so(served):
    d, evictions = served.cfg.d_model, metric(served, "attention_kv_cache_evictions", "sessions")
    sessions = [new_sequence_id(), new_sequence_id()]
    with Client(served, "grpc") as grpc:
        for sid in sessions:
            grpc.step(sid, one_token(served, 0), start=True)
        assert wait_for_metric(served, "attention_kv_cache_sequences", "sessions", 2) == 2
        deadline = time.monotonic() + 3 * IDLE_SECONDS  # the engine core looks 4 times a second
        while metric(served, "attention_kv_cache_evictions", "sessions") < evictions + 2:
            assert time.monotonic() < deadline, "no eviction"
            time.sleep(0.1)
        assert metric(served, "attention_kv_cache_bytes", "sessions") == 0  # no request needed to free it
        for sid in sessions:
            with pytest.raises(InferenceServerException) as evicted:
                grpc.step(sid, one_token(served, 1))
            assert evicted.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert f"sequence {sid} was evicted after 2 s idle" in evicted.value.message()
            np.testing.assert_array_equal(grpc.end(sid, d), np.zeros((1, 0, d)))  # close still works


# --- last: stopping leaves nothing behind --------------------------------------------------------------


def open_sessions_until_refused(client, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        client.session().open().close()
        time.sleep(0.05)


def test_sigint_drains_refusing_new_sessions_as_busy_and_leaves_no_process(served):
    """Triton serves an open session until it ends, and answers a new one's START (in a stream, a message
    only) with "stopped accepting new inference requests", which the client reads as a busy server: a
    caller retries elsewhere."""
    started: dict[int, str] = {}  # Triton serves a private copy of the repository: found as descendants
    descendants(served.process.pid, started)
    commands = " ".join(started.values())
    assert "bin/tritonserver" in commands and commands.count("triton_python_backend_stub") == 2, started
    with ProductClient(served.grpc_url, retries=0) as client:
        held = client.session().open()
        served.process.send_signal(signal.SIGINT)
        with pytest.raises(ServerBusyError, match="stopped accepting new inference requests"):
            open_sessions_until_refused(client, seconds=10)  # until Triton has taken the signal
        held.close()
    assert stop(served) == 0, served.output_path.read_text()
    assert still_running_after(started, LEFT_GRACE_S) == []
    assert "SIGINT: shutting down" in served.output_path.read_text()
