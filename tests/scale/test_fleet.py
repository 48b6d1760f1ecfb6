"""`python -m serving --replicas 3` as a user runs it: three supervised Triton replicas (the tiny
model), Envoy in front on the HTTP and gRPC ports, the gateway on Envoy. Sessions through the client
library (gRPC streams: a decoupled session model) each stay on one replica and equal the PyTorch original; two gateway
processes serve one session; a replica killed mid-run loses exactly its sessions, in one request,
while the others go on, and takes new sessions once its supervisor has brought it back. Ctrl-C
leaves no process behind (tests/fixtures/serving_process.py)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from bench.stack import gateway_process
from client import Client, SessionLostError
from contract import errors as kinds
from contract import names
from serving.host.launcher import EXIT_TIMEOUT_S
from tests.fixtures.serving_process import serving_process

pytestmark = [pytest.mark.served, pytest.mark.timeout(300)]
SECRET = "fleet-test-secret-" + "x" * 16
PREFILL, DECODES = 5, 4


@pytest.fixture(scope="module")
def fleet(tiny_repository, tmp_path_factory):
    work = tmp_path_factory.mktemp("fleet")
    args = ("--replicas", "3", "--probe-interval", "0.5", "--ejection-seconds", "1")
    # gateways that share a secret share a session store too (second_gateway); a replica killed here
    # is ejected as an outlier for 1 s, not 15, before it may take new sessions again
    env = {
        "SERVING_SESSION_SECRET": SECRET,
        "SERVING_SESSION_STORE": str(work / "sessions"),
    }
    with serving_process(tiny_repository, work, env=env, args=args, stop_later=True) as served:
        yield served


@pytest.fixture(scope="module")
def original(artifact_dir):
    from export.artifacts import load_model
    from export.runners import torch_runner

    return torch_runner(load_model(artifact_dir("tiny")))


def layout(fleet) -> tuple[dict[int, int], Path]:
    """({replica's gRPC port: its index}, Envoy's work directory) from what the command printed."""
    output = fleet.output()
    replicas = {int(port): int(i) for i, port in re.findall(r"replica (\d+) .*gRPC [\d.]+:(\d+)", output)}
    envoy_dir = Path(re.search(r"Envoy's log\s+(\S+)", output).group(1))
    return replicas, envoy_dir


def replica_index(fleet, pin: str) -> int:
    """The replica a pin names (Envoy's pin is the base64 of host:port; a gRPC step names the gRPC port,
    an HTTP one the HTTP port)."""
    port = int(base64.b64decode(pin).decode().rsplit(":", 1)[1])
    grpc_ports, _ = layout(fleet)
    http_ports = {int(p): int(i) for i, p in re.findall(r"replica (\d+) +HTTP [\d.]+:(\d+)", fleet.output())}
    return {**grpc_ports, **http_ports}[port]


def upstream_hosts(fleet, session_ids: set[int], wait_for: int) -> dict[int, set[str]]:
    """{session: the upstream hosts Envoy's access log shows for its requests}."""
    _, envoy_dir = layout(fleet)
    deadline = time.monotonic() + 10
    while True:
        # the last line may be half written (Envoy flushes as it goes): only whole lines count
        lines = (envoy_dir / "access.log").read_text().split("\n")[:-1]
        entries = [json.loads(line) for line in lines if line.startswith("{")]
        entries = [e for e in entries if e.get("session_id") and int(e["session_id"]) in session_ids]
        if len(entries) >= wait_for or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    hosts: dict[int, set[str]] = {}
    for entry in entries:
        hosts.setdefault(int(entry["session_id"]), set()).add(entry["upstream_host"])
    return hosts


def chunks(seed: int, d_model: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = [PREFILL] + [1] * DECODES
    return [rng.standard_normal((1, size, d_model)).astype(np.float32) for size in sizes]


def expected(original, parts: list[np.ndarray]) -> np.ndarray:
    """The PyTorch original over the whole sequence at once (causal): what the steps must return."""
    return original({names.HIDDEN_STATES: np.concatenate(parts, axis=1)})[names.OUTPUT]


def test_24_sessions_of_two_clients_each_stay_on_one_replica_and_equal_the_original(fleet, original):
    clients = [Client(f"127.0.0.1:{fleet.grpc_port}", "grpc"), Client(f"127.0.0.1:{fleet.grpc_port}", "grpc")]
    d_model = clients[0].metadata("sessions").d_model
    sessions = [clients[i % 2].session() for i in range(24)]
    inputs = [chunks(i, d_model) for i in range(24)]
    outputs: list[list[np.ndarray]] = [[] for _ in sessions]
    try:
        for k in range(1 + DECODES):  # every session live at once, their steps interleaved
            for session, parts, out in zip(sessions, inputs, outputs, strict=True):
                out.append(session.step(parts[k]))
        for session, parts, out in zip(sessions, inputs, outputs, strict=True):
            np.testing.assert_allclose(np.concatenate(out, axis=1), expected(original, parts), rtol=1e-5, atol=1e-5)
            assert session.length == PREFILL + DECODES  # as the server counts it
    finally:
        for session in sessions:
            session.close()
    hosts = upstream_hosts(fleet, {s.id for s in sessions}, wait_for=24 * (2 + DECODES))
    assert set(hosts) == {s.id for s in sessions}
    assert all(len(h) == 1 for h in hosts.values()), {s: h for s, h in hosts.items() if len(h) > 1}
    used = {replica_index(fleet, s.replica) for s in sessions}
    assert len(used) >= 2, f"all 24 sessions on replica {used}"
    for client in clients:
        client.close()


@contextlib.contextmanager
def second_gateway(fleet):
    """`python -m serving.gateway` on Envoy, with the first gateway's session secret and store (and, as it,
    no keys)."""
    triton, store = f"127.0.0.1:{fleet.grpc_port}", fleet.output_path.parent / "sessions"
    with gateway_process(triton, Path(os.devnull), api_keys="", session_secret=SECRET, session_store=store) as (url, _):
        yield url


def step_on(url: str, session_id: str, hidden: np.ndarray) -> httpx.Response:
    return httpx.post(f"{url}/v1/sessions/{session_id}/step", json={"hidden_states": hidden.tolist()}, timeout=60)


def test_a_session_opened_on_one_gateway_is_stepped_on_another(fleet, original):
    d_model = Client(f"127.0.0.1:{fleet.grpc_port}", "grpc").metadata("sessions").d_model
    parts = chunks(100, d_model)
    with second_gateway(fleet) as other:
        created = httpx.post(f"{fleet.gateway_url}/v1/sessions", timeout=60)
        assert created.status_code == 201, created.text
        session_id = created.json()["id"]
        gateways = [fleet.gateway_url, other] * 3
        out = []
        for k, part in enumerate(parts):
            answer = step_on(gateways[k], session_id, part)
            assert answer.status_code == 200, (gateways[k], answer.text)
            out.append(np.asarray(answer.json()["output"], np.float32))
            assert answer.json()["length"] == sum(p.shape[1] for p in parts[: k + 1])  # the server's count
        np.testing.assert_allclose(np.concatenate(out, axis=1), expected(original, parts), rtol=1e-5, atol=1e-5)
        assert httpx.delete(f"{other}/v1/sessions/{session_id}", timeout=30).status_code == 204
        gone = step_on(fleet.gateway_url, session_id, parts[0][:, :1])  # ended upstream by the other gateway
        assert gone.status_code in (404, 409), gone.text
        forged = session_id[:-3] + ("AAA" if not session_id.endswith("AAA") else "BBB")
        assert step_on(other, forged, parts[0]).status_code == 404


def gateway_sessions(fleet, hidden: np.ndarray, victim: int) -> dict[str, int]:
    """Sessions opened and stepped through the gateway until 2 are on `victim` and 6 in all:
    {session id: the replica holding it} (the id is a claim signed with the secret this test gave
    the gateway)."""
    from serving.gateway.sessions import SessionIds

    held: dict[str, int] = {}
    for _ in range(40):
        on_victim = list(held.values()).count(victim)
        if on_victim == 2 and len(held) == 6:
            return held
        opened = httpx.post(f"{fleet.gateway_url}/v1/sessions", timeout=60)
        assert "id" in opened.json(), (opened.status_code, opened.text)  # what the gateway said, if it refused
        session_id = opened.json()["id"]
        assert step_on(fleet.gateway_url, session_id, hidden).status_code == 200
        replica = replica_index(fleet, SessionIds(SECRET).read(session_id).replica)
        if (on_victim if replica == victim else len(held) - on_victim) < (2 if replica == victim else 4):
            held[session_id] = replica
        else:  # not needed: ended, so that the key's 16 sessions are never the limit of the search
            assert httpx.delete(f"{fleet.gateway_url}/v1/sessions/{session_id}", timeout=30).status_code == 204
    raise AssertionError(f"40 gateway sessions and not 2 on replica {victim} and 4 elsewhere: {held}")


def replica_pid(grpc_port: int) -> int:
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if cmdline and cmdline[0].endswith("tritonserver") and f"--grpc-port={grpc_port}" in cmdline:
            return process.pid
    raise AssertionError(f"no tritonserver on gRPC port {grpc_port}")


def durable_sessions(fleet, client: Client, d_model: int, victim: int) -> list:
    """24 (session, its inputs) opened through a client with a session store and prefilled; at least
    2 on `victim` (24 over 3 replicas: all elsewhere has odds of (2/3)**24, 6e-5)."""
    opened = [(client.session(), chunks(500 + i, d_model)) for i in range(24)]
    for session, parts in opened:
        session.step(parts[0])
    assert sum(replica_index(fleet, s.replica) == victim for s, _ in opened) >= 2
    return opened


def step_durable_sessions(fleet, kept: list, victim: int, original) -> None:
    """The store-keeping client's sessions decode on, interleaved: none lost, each equal to the original."""
    on_victim = [replica_index(fleet, s.replica) == victim for s, _ in kept]
    outputs = [[] for _ in kept]
    for k in range(1, 1 + DECODES):
        for (session, parts), out in zip(kept, outputs, strict=True):
            out.append(session.step(parts[k]))
    for (session, parts), out, moved in zip(kept, outputs, on_victim, strict=True):
        reference = expected(original, parts)[:, PREFILL:]
        np.testing.assert_allclose(np.concatenate(out, axis=1), reference, rtol=1e-5, atol=1e-5)
        assert session.recoveries == moved
        session.close()
    print(f"{len(kept)} durable sessions, {sum(on_victim)} on the killed replica: 0 lost")


def test_a_killed_replica_loses_only_its_sessions_and_serves_again_once_restarted(fleet, original, tmp_path):
    """Sessions of a client without a session store on the killed replica are lost (SessionLostError
    at their next step, at once); those with one (a client's directory, the gateway's own) are
    rebuilt on a survivor at their next step and go on as the original; the others are untouched."""
    client = Client(f"127.0.0.1:{fleet.grpc_port}", "grpc")
    d_model = client.metadata("sessions").d_model
    sessions = [client.session() for _ in range(9)]
    inputs = [chunks(200 + i, d_model) for i in range(9)]
    for session, parts in zip(sessions, inputs, strict=True):
        session.step(parts[0])
    on = {s.id: replica_index(fleet, s.replica) for s in sessions}
    victim = max(set(on.values()), key=list(on.values()).count)
    victim_port = next(port for port, index in layout(fleet)[0].items() if index == victim)
    through_gateway = gateway_sessions(fleet, inputs[0][0], victim)
    durable = Client(f"127.0.0.1:{fleet.grpc_port}", "grpc", session_store=tmp_path / "store", checkpoint_every=4)
    kept = durable_sessions(fleet, durable, d_model, victim)
    os.kill(replica_pid(victim_port), signal.SIGKILL)

    for session_id in through_gateway:  # the gateway's sessions are durable: all served, the lost ones rebuilt
        answer = step_on(fleet.gateway_url, session_id, inputs[0][1])
        assert answer.status_code == 200, answer.text
        reference = expected(original, inputs[0][:2])[:, -1:]
        np.testing.assert_allclose(np.asarray(answer.json()["output"]), reference, rtol=1e-5, atol=1e-5)
        httpx.delete(f"{fleet.gateway_url}/v1/sessions/{session_id}", timeout=30)
    step_durable_sessions(fleet, kept, victim, original)
    durable.close()

    for session, parts in zip(sessions, inputs, strict=True):
        if on[session.id] == victim:
            began = time.monotonic()
            with pytest.raises(SessionLostError) as lost:
                session.step(parts[1])
            assert lost.value.kind == kinds.SEQUENCE_LOST and time.monotonic() - began < 5
            assert session.closed
        else:  # untouched: the rest of its sequence still equals the original
            out = [session.step(part) for part in parts[1:]]
            reference = expected(original, parts)[:, PREFILL:]
            np.testing.assert_allclose(np.concatenate(out, axis=1), reference, rtol=1e-5, atol=1e-5)
            session.close()
    fresh = client.session()  # a new session starts on a survivor, or on the victim once it is back
    fresh.step(inputs[0][0])
    fresh.close()

    deadline = time.monotonic() + 60  # the supervisor restarts it on the same ports; then it takes sessions
    while True:
        session = client.session()
        session.step(inputs[0][0])
        session.close()
        if replica_index(fleet, session.replica) == victim:
            break
        assert time.monotonic() < deadline, f"no new session reached replica {victim} within 60 s"
        time.sleep(0.2)
    client.close()


def test_replicas_retired_by_migration_by_drain_and_at_a_deadline_leave_the_last_one_serving(
    tiny_repository, original, tmp_path
):
    """`Fleet.retire` on one fleet of four, one replica after another (a fleet started once, not per mode):

    - by migration (`migrate=True`) while 16 durable sessions step: the replica stops without waiting
      for them (Triton's own drain of its open sessions included: well within its exit timeout), each
      of its sessions moves at its next step (rebuilt from the store on another replica), and every
      step of every session equals the original;
    - by drain: one session held on the leaving replica keeps stepping (and equals the original)
      while new sessions go elsewhere; once it ends the replica stops at once, long before the deadline;
    - by drain with a session still open: it ends at its deadline (without Triton's own drain after it)
      and the session is then lost;
    - the last one serving is not retired."""
    from serving.host.envoy import ProxySettings
    from serving.host.fleet import start_fleet
    from serving.host.launcher import start_triton
    from serving.host.supervisor import Supervisor

    proxy = ProxySettings(http_port=0, grpc_port=0, listen_address="127.0.0.1", health_interval_s=0.5)
    fleet = start_fleet(4, lambda _: Supervisor(lambda: start_triton(tiny_repository), interval=0.5), proxy)
    try:
        ports = {s.server.grpc_url: i for i, s in enumerate(fleet.supervisors)}
        gone = [_drain_by_migration(fleet, ports, original, tmp_path)]
        serving = [i for i in range(4) if i not in gone]
        with Client(fleet.envoy.grpc_url, "grpc") as client:
            _drain_until_the_session_ends(fleet, client, ports, serving[0], original)
            kept, parts = _held_on(client, ports, serving[1], seed=301)
            began = time.monotonic()
            assert fleet.retire(serving[1], deadline_s=1.0, poll_s=0.1) == 1  # the deadline passed with one held
            assert time.monotonic() - began < 1.0 + EXIT_TIMEOUT_S
            with pytest.raises(SessionLostError):
                kept.step(parts[1])
            with pytest.raises(ValueError, match="last one serving"):
                fleet.retire(serving[2], deadline_s=1.0)
    finally:
        fleet.stop()


def _held_on(client: Client, ports: dict[str, int], index: int, seed: int):
    """A session prefilled on replica `index` (new ones opened until one lands there), and its inputs."""
    d_model = client.metadata("sessions").d_model
    for _ in range(60):
        session = client.session()
        parts = chunks(seed, d_model)
        session.step(parts[0])
        if ports[base64.b64decode(session.replica).decode()] == index:
            return session, parts
        session.close()
    raise AssertionError(f"60 sessions and none on replica {index}")


def _drain_by_migration(fleet, ports: dict[str, int], original, tmp_path) -> int:
    """`Fleet.retire(migrate=True)` of the replica holding most of 16 durable sessions while they step
    (the drain begins and ends between their rounds); returns that replica."""
    import threading

    client = Client(fleet.envoy.grpc_url, "grpc", session_store=tmp_path / "store", checkpoint_every=4)
    try:
        d_model = client.metadata("sessions").d_model
        rng = np.random.default_rng(400)
        parts = [[rng.standard_normal((1, 5, d_model)).astype(np.float32)] for _ in range(16)]
        sessions = [client.session() for _ in parts]
        outputs: list[list[np.ndarray]] = [[] for _ in sessions]
        for session, sequence in zip(sessions, parts, strict=True):
            session.step(sequence[0])
        on = [ports[base64.b64decode(s.replica).decode()] for s in sessions]
        victim = max(set(on), key=on.count)
        retiring: dict[str, float] = {}

        def retire() -> None:
            began = time.monotonic()
            retiring["held"] = fleet.retire(victim, deadline_s=300, migrate=True)
            retiring["seconds"] = time.monotonic() - began

        thread = threading.Thread(target=retire)
        for k in range(10):
            if k == 2:
                thread.start()  # the drain begins while the sessions are being stepped
            if k == 8:
                thread.join(60)  # stopped: the last rounds reach the moved sessions
                assert not thread.is_alive() and not fleet.supervisors[victim].server.is_running()
            began = time.monotonic()
            for session, sequence, out in zip(sessions, parts, outputs, strict=True):
                sequence.append(rng.standard_normal((1, 1, d_model)).astype(np.float32))
                out.append(session.step(sequence[-1]))
            if k == 8:
                print(
                    f"drain of replica {victim}: stopped {retiring['seconds']:.1f} s after retire(); the 16 "
                    f"sessions' next round {1000 * (time.monotonic() - began):.0f} ms"
                )
        for sequence, out in zip(parts, outputs, strict=True):  # every step, as the original over the whole
            reference = expected(original, sequence)[:, sequence[0].shape[1] :]
            np.testing.assert_allclose(np.concatenate(out, axis=1), reference, rtol=1e-5, atol=1e-5)
        assert retiring["held"] == on.count(victim) and retiring["seconds"] < EXIT_TIMEOUT_S
        assert [s.recoveries for s in sessions] == [int(i == victim) for i in on]
        assert all(ports.get(base64.b64decode(s.replica).decode()) != victim for s in sessions)
        for session in sessions:
            session.close()
    finally:
        client.close()
    return victim


def _drain_until_the_session_ends(fleet, client: Client, ports: dict[str, int], index: int, original) -> None:
    """`Fleet.retire(index)` with a session held there: new sessions go elsewhere while it steps to its
    end, then the replica stops at once."""
    import threading

    session, parts = _held_on(client, ports, index, seed=300)
    leaving = fleet.supervisors[index].server.grpc_url
    retiring = {}
    thread = threading.Thread(target=lambda: retiring.setdefault("lost", fleet.retire(index, 60, poll_s=0.1)))
    began = time.monotonic()
    thread.start()
    deadline = time.monotonic() + 10
    while fleet.envoy.hosts("triton_grpc_sessions").get(leaving) != "draining":  # Envoy read the mark
        assert time.monotonic() < deadline, fleet.envoy.hosts("triton_grpc_sessions")
        time.sleep(0.05)
    for _ in range(10):
        fresh = client.session()
        fresh.open()
        assert ports[base64.b64decode(fresh.replica).decode()] != index, "a new session reached the draining replica"
        fresh.close()
    out = [session.step(part) for part in parts[1:]]
    np.testing.assert_allclose(
        np.concatenate(out, axis=1), expected(original, parts)[:, PREFILL:], rtol=1e-5, atol=1e-5
    )
    assert thread.is_alive()  # still draining: its session is open
    session.close()
    thread.join(30)
    assert retiring == {"lost": 0} and time.monotonic() - began < 30
    assert not fleet.supervisors[index].server.is_running()


def test_a_snapshot_restores_on_another_replica_and_a_fork_stays_on_its_sessions(fleet, original):
    """Through Envoy: a restored session starts wherever its id hashes (until one lands on another
    replica than the original) and goes on bit for bit as the original; a fork reaches the replica
    holding the session it copies, and its branch equals the original's forward."""
    with Client(f"127.0.0.1:{fleet.grpc_port}") as client:
        d_model = client.metadata("sessions").d_model
        parts = chunks(40, d_model)
        with client.session() as source:
            source.step(parts[0])
            blob = source.snapshot()
            for _ in range(20):
                restored = client.session(restore=blob)
                restored.open()
                if replica_index(fleet, restored.replica) != replica_index(fleet, source.replica):
                    break
                restored.close()
            assert replica_index(fleet, restored.replica) != replica_index(fleet, source.replica)
            with restored, source.fork() as branch:
                assert branch.replica == source.replica
                for part in parts[1:]:
                    ours = restored.step(part)
                    np.testing.assert_array_equal(ours, source.step(part))
                    np.testing.assert_array_equal(branch.step(part), ours)
                np.testing.assert_allclose(ours, expected(original, parts)[:, -1:], rtol=1e-5, atol=1e-5)


def test_a_prefix_reaches_each_replica_a_session_needs_it_on_and_is_deleted_from_all(fleet, original):
    """Put once through Envoy (one replica); sessions that hash elsewhere get it put there from the
    client's copy; every session equals the original over prefix + its token; a delete reaches every
    replica that got it."""
    from client import InvalidInputError

    with Client(f"127.0.0.1:{fleet.grpc_port}") as client:
        d_model = client.metadata("sessions").d_model
        rng = np.random.default_rng(50)
        prefix = rng.standard_normal((1, 6, d_model)).astype(np.float32)
        client.put_prefix("shared", prefix)
        sessions = [client.session(prefix="shared") for _ in range(9)]
        for i, session in enumerate(sessions):
            token = np.random.default_rng(60 + i).standard_normal((1, 1, d_model)).astype(np.float32)
            np.testing.assert_allclose(
                session.step(token), expected(original, [prefix, token])[:, -1:], rtol=1e-5, atol=1e-5
            )
            session.close()
        holders = {replica_index(fleet, pin) for pin in client._prefix_replicas[("", "shared")]}
        used = {replica_index(fleet, s.replica) for s in sessions}
        assert used <= holders and len(used) >= 2, (used, holders)
        client.delete_prefix("shared")
        with Client(f"127.0.0.1:{fleet.grpc_port}") as stranger:  # holds no copy to put again
            for _ in range(6):
                with pytest.raises(InvalidInputError, match="unknown here"):
                    stranger.session(prefix="shared").open()
