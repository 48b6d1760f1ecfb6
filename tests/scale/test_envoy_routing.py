"""Real Envoy in front of real Triton replicas (the tiny model) on loopback: a session's steps all
reach one replica, sessions and stateless calls spread, a replica that joins moves no session, a
draining one keeps its sessions and takes no new ones, and a replica that leaves or dies fails its
sessions with `[sequence_lost]` in one request, never by moving them. Who served what comes from
Envoy's access log."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from client import errors
from contract import errors as kinds
from serving.host.envoy import ProxySettings, start_envoy
from tests.scale.conftest import replica_of
from tests.scale.helpers import (
    D_MODEL,
    address,
    client,
    end_all,
    http_infer_headers,
    new_session_id,
    new_sessions_go_to,
    served,
    sessions_on,
    start,
    step,
)

# the spare replicas start in the background from the first test on (conftest.py)
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("spare_replicas")]
# for a replica seen failing and back soon: a health check every 0.5 s, an ejection of 1 s (not 15)
FAST = ProxySettings(
    http_port=0, grpc_port=0, listen_address="127.0.0.1", health_interval_s=0.5, ejection_s=1.0, ejection_check_s=0.5
)


def _lost(error: InferenceServerException) -> errors.ClientError:
    return errors.from_exception(error, session=True)


@pytest.mark.parametrize("protocol", ["grpc"])  # a session's requests are gRPC streams (a decoupled model)
def test_each_session_stays_on_one_replica_and_sessions_use_several(proxy, replicas, protocol):
    """Outputs equal a twin session's run directly on one replica: through Envoy, each step reaches
    the cache it extends."""
    url = proxy.grpc_url if protocol == "grpc" else proxy.http_url
    direct_url = replicas[0].grpc_url if protocol == "grpc" else replicas[0].http_url
    stub, direct = client(url, protocol), client(direct_url, protocol)
    sessions = [new_session_id() for _ in range(8)]
    pins = {}
    try:
        for session in sessions:
            twin = new_session_id()
            for k in range(4):
                first, last = k == 0, k == 3
                tokens, seed = (3, session) if first else (1, session + k)
                output, named = step(stub, session, pins.get(session), start=first, end=last, tokens=tokens, seed=seed)
                expected, _ = step(direct, twin, None, start=first, end=last, tokens=tokens, seed=seed)
                np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-6)
                if first:
                    pins[session] = named
                else:
                    assert named is None, "only the first answer names the replica"
    finally:
        stub.close()
        direct.close()
    hosts = served(proxy, sessions, count=4 * len(sessions))
    assert all(len(set(h)) == 1 for h in hosts.values()), hosts
    assert {session: address(pin) for session, pin in pins.items()} == {s: h[0] for s, h in hosts.items()}
    assert len({h[0] for h in hosts.values()}) >= 2, "every session hashed to one replica"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_stateless_calls_go_to_every_replica_and_name_none(proxy, replicas, protocol):
    from client import affinity
    from tests.scale.helpers import hidden

    stub = client(proxy.grpc_url, "grpc")
    try:
        for seed in range(30):
            if protocol == "grpc":  # a stream of one request reads the answer's headers
                _, answer = affinity.infer(stub, "forward", hidden(protocol, 2, seed), headers={})
            else:
                array = np.random.default_rng(seed).standard_normal((1, 2, D_MODEL)).astype(np.float32)
                answer = http_infer_headers(proxy.http_url, "forward", array)
            assert affinity.replica_from(answer) is None
    finally:
        stub.close()
    deadline = time.monotonic() + 5  # until the access log (flushed every 0.2 s) has all 30
    while len(entries := _stateless_infers(proxy)) < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(entries) == 30, entries
    ports = {server.ports[protocol] for server in replicas}
    assert {int(e["upstream_host"].rsplit(":", 1)[1]) for e in entries} == ports


def _stateless_infers(envoy) -> list[dict]:
    return [e for e in envoy.access_log() if e["route"] == "stateless" and e["path"].lower().endswith("infer")]


def test_no_pinned_session_moves_when_a_replica_joins(replicas):
    """The hash alone moves some sessions to the newcomer, which never held them (Triton answers
    that the sequence was not started there); sent back, the pin keeps every one in place."""
    first_two = [replica_of(server) for server in replicas[:2]]
    envoy = start_envoy(first_two)
    stub = client(envoy.grpc_url, "grpc")
    try:
        pins = {session: start(stub, session) for session in [new_session_id() for _ in range(30)]}
        envoy.update([replica_of(server) for server in replicas])
        envoy.wait_for_hosts({replica_of(server): "healthy" for server in replicas})
        moved = {}
        for session in pins:
            try:
                step(stub, session, None)
            except InferenceServerException as error:
                moved[session] = _lost(error)
        assert moved, "no session hashed to the new replica: the pin was not put to the test"
        assert all(isinstance(error, errors.UnknownSessionError) for error in moved.values()), moved
        for session, pin in pins.items():
            step(stub, session, pin, end=True)
        pinned = served(envoy, pins, count=len(pins), route="pinned_step")
        assert pinned == {session: [address(pin)] for session, pin in pins.items()}
        assert replicas[2].grpc_url in new_sessions_go_to(stub, 30), "the new replica takes new sessions"
    finally:
        stub.close()
        envoy.stop()


def test_a_draining_replica_keeps_its_sessions_then_its_removal_loses_them(replicas):
    leaving = replicas[2]
    staying = [replica_of(server) for server in replicas[:2]]
    envoy = start_envoy([*staying, replica_of(leaving)])
    grpc = client(envoy.grpc_url, "grpc")
    try:
        pinned = sessions_on(grpc, leaving)
        envoy.update([*staying, replica_of(leaving, draining=True)])
        envoy.wait_for_hosts({**dict.fromkeys(staying, "healthy"), replica_of(leaving, draining=True): "draining"})
        for session, pin in pinned.items():
            step(grpc, session, pin)
        hosts = served(envoy, list(pinned), count=4)
        assert {h for host_list in hosts.values() for h in host_list} == {leaving.grpc_url}
        newcomers = new_sessions_go_to(grpc, 30)
        assert leaving.grpc_url not in newcomers and len(newcomers) == 2

        envoy.update(staying)
        envoy.wait_for_hosts(dict.fromkeys(staying, "healthy"))
        session, pin = next(iter(pinned.items()))
        with pytest.raises(InferenceServerException) as raised:
            step(grpc, session, pin)
        lost = _lost(raised.value)
        assert isinstance(lost, errors.UnknownSessionError) and lost.kind == kinds.SEQUENCE_LOST, lost
        assert f"session {session} was lost" in lost.message
        with client(leaving.grpc_url, "grpc") as direct:  # it still holds them: end them there
            end_all(direct, dict.fromkeys(pinned))
    finally:
        grpc.close()
        envoy.stop()


def test_a_dead_replica_fails_its_sessions_precisely_and_its_return_takes_new_ones(
    replicas, start_replica, spare_replica
):
    doomed = spare_replica
    ports = dict(doomed.ports)
    others = [replica_of(server) for server in replicas[:2]]
    envoy = start_envoy([*others, replica_of(doomed)], FAST)
    stub = client(envoy.grpc_url, "grpc")
    try:
        on_doomed = sessions_on(stub, doomed, at_least=1)
        elsewhere = {s: start(stub, s) for s in [new_session_id() for _ in range(6)]}
        doomed.process.send_signal(signal.SIGKILL)
        doomed.stop()  # reaps it and its stubs
        session, pin = next(iter(on_doomed.items()))
        began = time.monotonic()
        with pytest.raises(InferenceServerException) as raised:
            step(stub, session, pin)
        assert time.monotonic() - began < 1.0
        assert _lost(raised.value).kind == kinds.SEQUENCE_LOST
        for other, other_pin in elsewhere.items():
            if address(other_pin) != doomed.grpc_url:
                step(stub, other, other_pin, end=True)
        assert doomed.grpc_url not in new_sessions_go_to(stub, 20)

        returned = start_replica(http_port=ports["http"], grpc_port=ports["grpc"], metrics_port=ports["metrics"])
        # STARTs that reached the dead replica before its health checks failed (retried elsewhere) may
        # have ejected it as an outlier: it is back once the ejection (1 s here) is over and a check passes
        envoy.wait_for_hosts({**dict.fromkeys(others, "healthy"), replica_of(returned): "healthy"})
        with pytest.raises(InferenceServerException) as raised:  # a new process: it never held the session
            step(stub, session, pin)
        assert isinstance(_lost(raised.value), errors.UnknownSessionError)
        assert returned.grpc_url in new_sessions_go_to(stub, 30)
    finally:
        stub.close()
        envoy.stop()


def test_a_signalled_replica_drains_its_grpc_sessions(replicas, spare_replica):
    """Kubernetes' way: SIGTERM. Triton closes its HTTP port (Envoy's health check fails, no new
    sessions) and serves its open sequences over gRPC until they end (or its exit timeout, 5 s in
    tests), then exits."""
    leaving = spare_replica
    staying = [replica_of(server) for server in replicas[:2]]
    fast_checks = ProxySettings(http_port=0, grpc_port=0, listen_address="127.0.0.1", health_interval_s=0.5)
    envoy = start_envoy([*staying, replica_of(leaving)], fast_checks)
    stub = client(envoy.grpc_url, "grpc")
    try:
        pinned = sessions_on(stub, leaving)
        leaving.process.send_signal(signal.SIGTERM)
        envoy.wait_for_hosts(
            {**dict.fromkeys(staying, "healthy"), replica_of(leaving): "failed_active_health_check"}, timeout=4
        )
        assert leaving.grpc_url not in new_sessions_go_to(stub, 20)
        for session, pin in pinned.items():
            step(stub, session, pin)
            step(stub, session, pin, end=True)
        assert leaving.process.wait(5) == 0, "Triton exits cleanly once its sessions ended"
        hosts = served(envoy, pinned, count=3 * len(pinned))
        assert {h for host_list in hosts.values() for h in host_list} == {leaving.grpc_url}
    finally:
        stub.close()
        envoy.stop()
        leaving.stop()


def _stub_of(server, model: str) -> int:
    """The pid of `model`'s Python-backend stub under `server`."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            parent = int((cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[1])
            text = cmdline.read_bytes()
            if parent == server.process.pid and b"triton_python_backend_stub" in text and f"{model}_0".encode() in text:
                return int(cmdline.parent.name)
    raise AssertionError(f"no stub of {model} under {server.grpc_url}")


def test_a_replica_whose_model_died_answers_new_sessions_by_name(replicas, spare_replica):
    """Triton's readiness stays 200 when a stub dies, and a session's requests are streams, whose errors travel in
    their messages (the stream's own status is OK): Envoy's outlier detection, which reads statuses, does not eject
    the replica (the supervisor reloads the model: docs/reliability.md). Each START that reaches it is answered,
    naming the dead stub, and the other replicas take theirs."""
    broken = spare_replica
    envoy = start_envoy([*(replica_of(server) for server in replicas[:2]), replica_of(broken)])
    stub = client(envoy.grpc_url, "grpc")
    try:
        os.kill(_stub_of(broken, "sessions"), signal.SIGKILL)
        failures, served_elsewhere = [], 0
        for _ in range(30):  # a third of them hash to it
            try:
                start(stub, new_session_id(), end=True)
                served_elsewhere += 1
            except InferenceServerException as error:
                failures.append(error.message())
        assert failures and served_elsewhere, (failures, served_elsewhere)
        assert all("is not healthy" in message for message in failures), failures
        lost = errors.from_server(failures[0], "StatusCode.UNKNOWN", session=True)
        assert isinstance(lost, errors.SessionLostError)  # the client reads a session lost with the process
    finally:
        stub.close()
        envoy.stop()
        # a graceful stop would wait out Triton's exit timeout for the model whose stub died
        broken.process.send_signal(signal.SIGKILL)
        broken.stop()  # reaps it and its stubs
