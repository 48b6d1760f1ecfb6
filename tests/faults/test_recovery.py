"""The fault suite: `python -m serving` as a user runs it (supervised Triton and the gateway, real
processes), hit by what takes a serving stack down: kill -9 of each model's process and of
tritonserver, and the HTTP request whose shape Triton 2.51's front end dies on.

Each fault asserts what the user sees while it lasts (the status codes), that the stack serves again
within the supervision window (the measured time is printed; docs/reliability.md has the numbers),
that the same requests give the same outputs before and after, that the command keeps running, and
(serving_process, on leaving) that no process is left behind.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request

import httpx
import numpy as np
import pytest

from serving.triton.config import ServingSettings
from serving.triton.repository import write_repository
from tests.fixtures.admin import GRPC_PREFIX, cmdline, environ, grpc_call, http_status, restrictions
from tests.fixtures.faults import kill, wait_ready
from tests.fixtures.serving_process import serving_process

pytestmark = [pytest.mark.served, pytest.mark.slow]

REQUEST_TIMEOUT_S = 10.0  # the gateway's per-request timeout here (a dead stub takes Triton about 3 s to report)


@pytest.fixture(scope="module")
def stack(artifact_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("faults")
    repository = write_repository(artifact_dir("tiny"), work / "repository", ServingSettings(threads=1))
    with (
        serving_process(
            repository,
            work,
            env={"SERVING_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S)},
            args=("--probe-interval", "0.5", "--session-store", "none"),  # the sessions a fault loses: not durable here
        ) as served,
        httpx.Client(base_url=served.gateway_url, timeout=30) as gateway,
    ):
        yield served, gateway


def hidden(tokens: int, seed: int, width: int = 32) -> list:
    return np.random.default_rng(seed).standard_normal((1, tokens, width)).astype(np.float32).tolist()


def attend(gateway: httpx.Client) -> np.ndarray:
    answer = gateway.post("/v1/attend", json={"hidden_states": hidden(5, seed=1)})
    assert answer.status_code == 200, answer.text
    return np.array(answer.json()["output"])


def new_session(gateway: httpx.Client) -> tuple[str, np.ndarray]:
    """A session opened and stepped once; its id and that step's output."""
    created = gateway.post("/v1/sessions")
    assert created.status_code == 201, created.text
    session = created.json()["id"]
    return session, step(gateway, session, seed=2)


def step(gateway: httpx.Client, session: str, seed: int) -> np.ndarray:
    answer = gateway.post(f"/v1/sessions/{session}/step", json={"hidden_states": hidden(3, seed)})
    assert answer.status_code == 200, answer.text
    return np.array(answer.json()["output"])


def assert_code(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code, response.text


def test_a_killed_session_model_is_reloaded_and_its_sessions_are_lost(stack):
    served, gateway = stack
    before, (session, first) = attend(gateway), new_session(gateway)

    killed_at = time.monotonic()
    kill(served, "sessions_0_0")
    assert gateway.get("/readyz").status_code == 503  # readiness tells the truth at once
    # the session's KV cache died with the process: a precise 409, never another sequence's data
    assert_code(gateway.post(f"/v1/sessions/{session}/step", json={"hidden_states": hidden(1, 3)}), 409, "session_lost")
    recovered = wait_ready(gateway, killed_at)
    print(f"session model reloaded: serving {recovered:.1f} s after kill -9")

    again, (_, first_again) = attend(gateway), new_session(gateway)
    np.testing.assert_array_equal(again, before)
    np.testing.assert_array_equal(first_again, first)
    served.wait_for_output("reloading sessions", "serving again")
    assert served.process.poll() is None


def test_opening_a_session_while_the_session_model_is_dead_answers_503_with_retry_after(stack):
    """Nothing was held, so nothing is lost: the model cannot serve now, which is 503 and a retry, as
    the README promises (it was 409 session_lost)."""
    served, gateway = stack
    killed_at = time.monotonic()
    kill(served, "sessions_0_0")
    opened = gateway.post("/v1/sessions")
    assert_code(opened, 503, "upstream_unavailable")
    assert opened.headers["retry-after"] == "1"
    assert "opening a session" in opened.json()["error"]["message"]
    recovered = wait_ready(gateway, killed_at)
    print(f"session model reloaded: serving {recovered:.1f} s after kill -9")
    new_session(gateway)  # and sessions open again


def test_a_stopped_session_stub_is_slow_not_dead_and_the_stack_serves_again_after_sigcont(stack):
    """SIGSTOP of the session model's stub for 5 s. Triton calls it "not healthy", but its process runs (slow or
    stopped, not dead): the supervisor does not reload it (a reload of a live stub aborted Triton 2.51 under
    load). At SIGCONT the stub answers requests Triton failed meanwhile, and tritonserver may die of it
    (SIGSEGV in TRITONBACKEND_ResponseNewFromFactory, Triton's own); then the supervisor restarts it at once.
    Either way the stack serves again within seconds, and the session held is either unchanged or lost
    (409), never answered wrong."""
    served, gateway = stack
    wait_ready(gateway, time.monotonic())
    session, _ = new_session(gateway)
    expected = step(gateway, session, seed=5)  # what the next step answers once more, after a rewind
    assert gateway.post(f"/v1/sessions/{session}/rewind", json={"length": 3}).status_code == 200
    stub = next(pid for pid, command in served.descendants().items() if " sessions_0_0 " in f"{command} ")
    os.kill(stub, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        served.wait_for_output("its process runs (slow, or stopped)", timeout=10)
        while time.monotonic() - stopped_at < 5:
            time.sleep(0.2)
        during = served.output().rpartition("its process runs (slow, or stopped)")[2]
        assert "reloading sessions" not in during and "restarting Triton" not in during, during
    finally:
        os.kill(stub, signal.SIGCONT)
    resumed_at = time.monotonic()
    print(f"serving again {wait_ready(gateway, resumed_at):.1f} s after SIGCONT")
    answer = gateway.post(f"/v1/sessions/{session}/step", json={"hidden_states": hidden(3, 5)})
    if answer.status_code == 200:
        np.testing.assert_array_equal(np.array(answer.json()["output"]), expected)
    else:
        assert_code(answer, 409, "session_lost")
    new_session(gateway)


def test_no_request_outlives_the_request_timeout_while_tritonserver_hangs(stack):
    """SIGSTOP of tritonserver: it accepts connections and answers nothing. Opening a session (START,
    refused, then END) and a step each answer 504 within SERVING_REQUEST_TIMEOUT_S (plus the time to
    send the answer), not the START's timeout plus the END's. Both are sent at once (each is timed
    on its own), so the test waits one timeout, not two."""
    served, gateway = stack
    session, _ = new_session(gateway)
    (triton,) = [pid for pid, command in served.descendants().items() if "bin/tritonserver" in command]

    def timed(method: str, path: str, body) -> tuple[httpx.Response, float]:
        started = time.monotonic()
        answer = gateway.request(method, path, json=body)
        return answer, time.monotonic() - started

    requests = [
        ("POST", "/v1/sessions", None),
        ("POST", f"/v1/sessions/{session}/step", {"hidden_states": hidden(1, 3)}),
    ]
    os.kill(triton, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            answers = list(pool.map(lambda request: timed(*request), requests))
    finally:
        os.kill(triton, signal.SIGCONT)
    for (method, path, _), (answer, took) in zip(requests, answers, strict=True):
        print(f"{method} {path.split('/')[-1]} with tritonserver stopped: 504 after {took:.2f} s")
        assert_code(answer, 504, "upstream_timeout")
        assert took < REQUEST_TIMEOUT_S + 1.0, took
    wait_ready(gateway, time.monotonic())
    new_session(gateway)


def test_a_killed_stateless_model_is_reloaded(stack):
    served, gateway = stack
    before = attend(gateway)
    killed_at = time.monotonic()
    kill(served, "forward_0_0")
    # a stateless call is safe to repeat: the gateway's retries may reach the reloaded model (a
    # late, correct answer); otherwise 503 with Retry-After. Never a wrong answer, never a 5xx of ours.
    during = gateway.post("/v1/attend", json={"hidden_states": hidden(5, seed=1)})
    if during.status_code == 200:
        np.testing.assert_array_equal(np.array(during.json()["output"]), before)
    else:
        assert_code(during, 503, "upstream_unavailable")
        assert during.headers["retry-after"] == "1"
    recovered = wait_ready(gateway, killed_at)
    print(f"stateless model reloaded: serving {recovered:.1f} s after kill -9")
    np.testing.assert_array_equal(attend(gateway), before)
    served.wait_for_output("reloading forward")


def test_a_killed_tritonserver_is_started_again(stack):
    served, gateway = stack
    before, (session, first) = attend(gateway), new_session(gateway)
    killed_at = time.monotonic()
    kill(served, "bin/tritonserver")
    assert gateway.get("/readyz").status_code == 503
    assert gateway.get("/healthz").status_code == 200  # the gateway itself lives on
    recovered = wait_ready(gateway, killed_at)
    print(f"tritonserver restarted: serving {recovered:.1f} s after kill -9")
    # the restarted server never held the session: lost, said precisely
    assert_code(gateway.post(f"/v1/sessions/{session}/step", json={"hidden_states": hidden(1, 3)}), 409, "session_lost")
    np.testing.assert_array_equal(attend(gateway), before)
    np.testing.assert_array_equal(new_session(gateway)[1], first)
    served.wait_for_output("tritonserver exited with -9")


def test_the_shape_that_kills_triton_2_51s_http_front_end_costs_seconds_not_the_stack(stack):
    """Triton allocates a request's declared shape before reading its data: 10^9 x 32 floats abort
    it (std::bad_alloc, signal 6) before any model sees the request, so no check of ours can refuse
    it there. The gateway refuses it (its body holds 1 value); Triton is only on loopback; the
    supervisor starts it again."""
    served, gateway = stack
    before = attend(gateway)
    body = {"inputs": [{"name": "hidden_states", "shape": [1, 10**9, 32], "datatype": "FP32", "data": [0.1]}]}
    refused = gateway.post(
        "/v1/attend", json={"hidden_states": {"dtype": "float32", "shape": [1, 10**9, 32], "b64": ""}}
    )
    assert refused.status_code in (400, 422), refused.text  # the gateway never forwards it

    sent_at = time.monotonic()
    request = urllib.request.Request(
        f"http://127.0.0.1:{served.http_port}/v2/models/forward/infer", data=json.dumps(body).encode()
    )
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(request, timeout=30)
    recovered = wait_ready(gateway, sent_at)
    print(f"huge-shape request: serving {recovered:.1f} s after it")
    np.testing.assert_array_equal(attend(gateway), before)
    assert served.process.poll() is None


def test_nothing_a_local_user_reads_in_proc_opens_a_restricted_api(stack):
    """Every command line and environment of what the product starts (tritonserver, its stubs, Envoy)
    as any local user reads them in /proc: no string there, tried as the value of every header name
    they suggest, opens a restricted API over HTTP or gRPC; the restriction header itself cannot be
    carried (refused over HTTP/1.1, the stream reset over HTTP/2); without it, refused. The
    supervisor needs none of it: the recoveries above reload a model without any API."""
    served, gateway = stack
    from serving.host.envoy import Replica, start_envoy

    triton = next(pid for pid, command in served.descendants().items() if "bin/tritonserver" in command)
    with start_envoy([Replica("127.0.0.1", served.http_port, served.grpc_port)]) as envoy:
        pids = [*served.descendants(), envoy.process.pid]
        assert sum("triton_python_backend_stub" in " ".join(cmdline(pid)) for pid in pids) == 2
        readable = [text for pid in pids for text in [*cmdline(pid), *environ(pid).values()]]
    closed = restrictions(cmdline(triton))
    values = {piece for text in readable for piece in re.split(r"[\s=:,;]", text) if len(piece) >= 8}
    names = {"admin-key", *closed["http"][0].split(":")}
    http, grpc = f"127.0.0.1:{served.http_port}", f"127.0.0.1:{served.grpc_port}"
    assert http_status(http, "POST", "/v2/repository/index") == 403
    assert "restricted" in grpc_call(grpc, "RepositoryIndex")
    assert http_status(http, "POST", "/v2/repository/index", [tuple(v.encode() for v in closed["http"])]) == 403
    assert grpc_call(grpc, "RepositoryIndex", [closed["grpc"]]) == "reset"
    for name in names:
        for value in values:
            assert http_status(http, "POST", "/v2/repository/index", [(name.encode(), value.encode())]) == 403
            answer = grpc_call(grpc, "RepositoryIndex", [(GRPC_PREFIX + name, value)])
            assert answer.startswith("status 14:") and "restricted" in answer, (name, value, answer)
    print(f"{len(values)} strings from {len(pids)} processes' command lines and environments, {len(names)} names")
    assert gateway.get("/readyz").status_code == 200
