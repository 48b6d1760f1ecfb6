"""Durable sessions (client/store.py, docs/reliability.md): `python -m serving` as a user runs it,
hit by kill -9 of the session model's stub, of tritonserver and of the gateway, with sessions held by a direct client
(a directory store, and a real redis-server restarted mid-run) and by the gateway (its default
store, a folder of the run's). The step after each fault is served, and every step of every session
equals the uninterrupted PyTorch original within 1e-5; a store entry that was changed, or that is
another owner's, is refused and the session reported lost, never served wrong."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from client import Client, SessionLostError
from client.store import RedisStore
from contract import names
from serving.triton.config import ServingSettings
from serving.triton.repository import write_repository
from tests.fixtures.faults import kill, wait_ready
from tests.fixtures.serving_process import serving_process

pytestmark = [pytest.mark.served, pytest.mark.slow]
EVERY = 8  # positions between checkpoints: small, so that each session has both a store and a replay log


@pytest.fixture(scope="module")
def stack(artifact_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("durable")
    repository = write_repository(artifact_dir("tiny"), work / "repository", ServingSettings(threads=1))
    env = {"SERVING_REQUEST_TIMEOUT_S": "30", "SERVING_CHECKPOINT_EVERY": str(EVERY)}
    with (
        serving_process(repository, work, env=env, args=("--probe-interval", "0.5")) as served,
        httpx.Client(base_url=served.gateway_url, timeout=60) as gateway,
    ):
        yield served, gateway


@pytest.fixture(scope="module")
def original(artifact_dir):
    from export.artifacts import load_model
    from export.runners import torch_runner

    return torch_runner(load_model(artifact_dir("tiny")))


class Sequence:
    """The tokens a session was given, and the original's answer for its latest step."""

    def __init__(self, original, seed: int) -> None:
        self.original, self.rng, self.parts = original, np.random.default_rng(seed), []

    def next(self, tokens: int) -> np.ndarray:
        self.parts.append(self.rng.standard_normal((1, tokens, 32)).astype(np.float32))
        return self.parts[-1]

    def expected(self) -> np.ndarray:
        whole = self.original({names.HIDDEN_STATES: np.concatenate(self.parts, axis=1)})[names.OUTPUT]
        return whole[:, -self.parts[-1].shape[1] :]


def gateway_step(gateway: httpx.Client, session: str, tokens: np.ndarray) -> np.ndarray:
    answer = gateway.post(f"/v1/sessions/{session}/step", json={"hidden_states": tokens.tolist()})
    assert answer.status_code == 200, answer.text
    return np.asarray(answer.json()["output"], np.float32)


def advance(sessions, gateway, gateway_sessions, steps: int) -> None:
    """Each session a few steps, each answer against the original."""
    for _ in range(steps):
        for session, sequence in sessions:
            np.testing.assert_allclose(session.step(sequence.next(1)), sequence.expected(), rtol=1e-5, atol=1e-5)
        for session, sequence in gateway_sessions:
            out = gateway_step(gateway, session, sequence.next(1))
            np.testing.assert_allclose(out, sequence.expected(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fault", ["sessions_0_0", "bin/tritonserver"])
def test_sessions_survive_a_killed_process_and_go_on_as_the_original(stack, original, tmp_path, fault):
    served, gateway = stack
    wait_ready(gateway, time.monotonic())
    client = Client(f"127.0.0.1:{served.grpc_port}", session_store=tmp_path / "store", checkpoint_every=EVERY)
    sessions = [(client.session(), Sequence(original, seed)) for seed in range(3)]
    opened = [gateway.post("/v1/sessions").json()["id"] for _ in range(2)]
    gateway_sessions = [(session, Sequence(original, 10 + i)) for i, session in enumerate(opened)]
    for (session, sequence), prompt in zip(sessions, (5, 11, 17), strict=True):  # checkpoints at 8, 16, ...
        session.step(sequence.next(prompt))
    for session, sequence in gateway_sessions:
        gateway_step(gateway, session, sequence.next(5))
    advance(sessions, gateway, gateway_sessions, steps=6)
    before = [session.id for session, _ in sessions]

    kill(served, fault)
    began = time.monotonic()
    advance(sessions, gateway, gateway_sessions, steps=1)  # the step after the fault: served, and right
    recovered_in = time.monotonic() - began
    print(f"{fault}: 5 sessions' next steps served {recovered_in:.2f} s after the kill")
    assert [session.recoveries for session, _ in sessions] == [1, 1, 1]
    assert all(session.id != old for (session, _), old in zip(sessions, before, strict=True))
    advance(sessions, gateway, gateway_sessions, steps=10)  # and they go on, checkpointing again

    for session, _ in sessions:
        session.close()
    for session, _ in gateway_sessions:
        assert gateway.delete(f"/v1/sessions/{session}").status_code == 204
    assert not any((tmp_path / "store").rglob("0*")), "a closed session's checkpoints are forgotten"
    client.close()


def test_a_killed_gateway_is_started_again_and_its_sessions_go_on_as_the_original(stack, original):
    """kill -9 of the gateway's process: `python -m serving` starts another within seconds, with the run's
    session secret and store, so the ids the dead one gave out go on (their rows never left Triton)."""
    served, gateway = stack
    wait_ready(gateway, time.monotonic())
    opened = [gateway.post("/v1/sessions").json()["id"] for _ in range(2)]
    gateway_sessions = [(session, Sequence(original, 70 + i)) for i, session in enumerate(opened)]
    for session, sequence in gateway_sessions:
        gateway_step(gateway, session, sequence.next(5))
    advance([], gateway, gateway_sessions, steps=3)

    killed_at = time.monotonic()
    kill(served, "-m serving.gateway")
    print(f"the gateway served again {wait_ready(gateway, killed_at):.2f} s after its kill")
    advance([], gateway, gateway_sessions, steps=3)
    for session, _ in gateway_sessions:
        assert gateway.delete(f"/v1/sessions/{session}").status_code == 204
    served.wait_for_output("the gateway exited with -9", "the gateway serves again")


def test_one_killed_stub_a_redis_session_goes_on_changed_or_foreign_entries_are_refused_rewinds_are_kept(
    stack, original, redis_server, tmp_path
):
    """Three cases, one kill -9 of the session model's stub (each kill costs seconds of reload):

    - a Redis store keeps a session across a restart of redis-server and across the kill;
    - a store entry that was changed, or that is another owner's, is refused and the session reported
      lost, never served wrong;
    - a rewind below the last checkpoint truncates the store and checkpoints again; one within the
      replay log trims the log. Rebuilt after the kill, each session goes on as one that never had
      the dropped positions.
    """
    served, gateway = stack
    wait_ready(gateway, time.monotonic())
    checks = [  # the refusals first: they come while the stub is dead, as the others' recoveries begin
        changed_and_foreign_entries(served, original, tmp_path / "store"),
        redis_session(served, original, redis_server),
        rewound_sessions(served, original, tmp_path / "rewound"),
    ]
    kill(served, "sessions_0_0")
    for check in checks:
        check()


def redis_session(served, original, redis_server):
    """A session whose checkpoints went to Redis across its restart; the check after the kill."""
    client = Client(f"127.0.0.1:{served.grpc_port}", session_store=redis_server.url, checkpoint_every=EVERY)
    session, sequence = client.session(), Sequence(original, 30)
    session.step(sequence.next(6))
    advance([(session, sequence)], None, [], steps=5)  # a checkpoint at 8 went to Redis
    redis_server.restart()  # the append-only file keeps it; the client reconnects
    advance([(session, sequence)], None, [], steps=9)  # checkpoints resume: one at 16
    assert [c.end for c in RedisStore(redis_server.url).chunks(session._key)] == [8, 16]

    def check() -> None:
        advance([(session, sequence)], None, [], steps=3)
        assert session.recoveries == 1
        session.close()
        client.close()

    return check


def changed_and_foreign_entries(served, original, store: Path):
    """alice's session with its store entry changed by a byte, bob's with alice's entry in its place,
    and another of alice's untouched; the check after the kill."""
    client = Client(f"127.0.0.1:{served.grpc_port}", session_store=store, checkpoint_every=EVERY)
    changed, sequence = client.session(owner="alice"), Sequence(original, 40)
    foreign = client.session(owner="bob")
    changed.step(sequence.next(9))
    foreign.step(sequence.next(9))
    (entry,) = (store / changed._key.parts[0] / changed._key.parts[1]).iterdir()
    entry.write_bytes(entry.read_bytes()[:-1] + b"\0")
    # bob's session's entry replaced by alice's: the right digest, the wrong owner in the blob
    (theirs,) = (store / foreign._key.parts[0] / foreign._key.parts[1]).iterdir()
    other = client.session(owner="alice")
    other.step(sequence.next(9))
    (good,) = (store / other._key.parts[0] / other._key.parts[1]).iterdir()
    shutil.copyfile(good, theirs)

    def check() -> None:
        with pytest.raises(
            SessionLostError,
            match=r"cannot be recovered: session store entry \w+ \[0, 9\) is refused: its integrity tag does not match",
        ):
            changed.step(sequence.next(1))
        with pytest.raises(SessionLostError, match=r"\[0, 9\) is refused: its integrity tag does not match"):
            foreign.step(sequence.next(1))
        assert client.store.chunks(other._key)  # untouched by the refusals
        for session in (changed, foreign, other):
            session.close()
        client.close()

    return check


def rewound_sessions(served, original, store: Path):
    """Two sessions rewound, below their last checkpoint and within their replay log; the check
    after the kill."""
    client = Client(f"127.0.0.1:{served.grpc_port}", session_store=store, checkpoint_every=EVERY)
    below, within = (client.session(), Sequence(original, 50)), (client.session(), Sequence(original, 60))
    for (session, sequence), keep in ((below, 12), (within, 22)):
        session.step(sequence.next(20))  # a checkpoint at 20
        for _ in range(5):
            session.step(sequence.next(1))  # 5 positions in the replay log
        assert session.rewind(keep) == keep
        whole = np.concatenate(sequence.parts, axis=1)[:, :keep]
        sequence.parts = [whole]  # the original never saw the dropped positions
    assert [c.end for c in client.store.chunks(below[0]._key)] == [12]  # truncated, then checkpointed again
    assert [c.end for c in client.store.chunks(within[0]._key)] == [20]

    def check() -> None:
        advance([below, within], None, [], steps=3)
        assert below[0].recoveries == within[0].recoveries == 1
        for session, _ in (below, within):
            session.close()
        client.close()

    return check
