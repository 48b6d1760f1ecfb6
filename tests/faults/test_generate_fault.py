"""Generation on the server hit by kill -9 of the session model's stub mid-generation (a supervised Triton, as
`python -m serving` runs it, a whole model, a durable session: a directory store). What the client was answered
before the kill is the PyTorch original's greedy text; the generation then fails with a clear error, never a
wrong token; the session, rebuilt from its store and replay log (the generated tokens in it), goes on with the
original's greedy continuation of the whole text.

The Triton runs under serving.host.supervisor.Supervisor in this process, not under `python -m serving`: the
fault needs the supervisor's reload of the killed model and nothing of the gateway; the CLI itself under the
same kill (its output, its exit, no process left) is tests/faults/test_recovery.py's."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
import torch

from client import Client, ClientError
from export.artifacts import load_model
from serving.host.launcher import free_port, start_triton
from serving.host.supervisor import Supervisor
from serving.triton.repository import write_repository
from tests.fixtures.faults import kill
from tests.fixtures.serving_process import descendants
from tests.fixtures.triton import WHOLE_ARTIFACT, WHOLE_SETTINGS

pytestmark = [pytest.mark.served, pytest.mark.slow]
EVERY = 8  # positions between checkpoints: the generated tokens reach both the store and the replay log
PROBE_INTERVAL_S = 0.5  # as `python -m serving --probe-interval 0.5`: the dead stub is found within a second
SESSION_STUB = "sessions_0_0"


def greedy(model, ids: np.ndarray, tokens: int) -> list[int]:
    """The original's greedy continuation of `ids`, a full forward per token (short sequences)."""
    sequence = list(ids)
    with torch.no_grad():
        for _ in range(tokens):
            sequence.append(int(model(torch.tensor([sequence])).output[0, -1].argmax()))
    return sequence[len(ids) :]


def kill_stub(supervisor: Supervisor, stub: str) -> int:
    """kill -9 of the one process under the supervised tritonserver whose command line has `stub`."""
    pid = supervisor.server.process.pid
    return kill(types.SimpleNamespace(descendants=lambda: descendants(pid, {})), stub)


def test_a_killed_stub_mid_generation_gives_the_right_prefix_a_clear_error_then_the_same_text(artifact_dir, tmp_path):
    model = load_model(artifact_dir(WHOLE_ARTIFACT)).eval()
    repository = write_repository(artifact_dir(WHOLE_ARTIFACT), tmp_path / "repository", WHOLE_SETTINGS)
    ids = np.random.default_rng(11).integers(0, 256, 6, dtype=np.int64)
    expected = greedy(model, ids, 50)
    # fixed ports, as `python -m serving` has them: a server the supervisor restarts answers where it did
    ports = {f"{name}_port": free_port() for name in ("http", "grpc", "metrics")}
    start = lambda: start_triton(repository, log_path=tmp_path / "triton.log", **ports)  # noqa: E731
    with Supervisor(start, interval=PROBE_INTERVAL_S) as supervisor:
        # a request that reaches the killed stub waits out the client's deadline (a checkpoint after a generation
        # that outran the kill: 30 s at the default); 10 s is still ample for a token here
        store = tmp_path / "store"
        client = Client(supervisor.server.grpc_url, session_store=store, checkpoint_every=EVERY, timeout=10)
        with client.session() as session:
            answered, failure = [], None
            generation = session.generate(ids, max_new_tokens=40)
            killer = threading.Timer(0, lambda: kill_stub(supervisor, SESSION_STUB))
            try:
                for token in generation:
                    answered.append(token)
                    if len(answered) == 5:
                        killer.start()  # the stub dies while the server is generating
            except ClientError as error:
                failure = error
            killer.join()
            assert answered == expected[: len(answered)]  # never a wrong token
            assert failure is not None or answered == expected[:40], "a full generation, or a clear error"
            print(f"{len(answered)} tokens before the error: {failure}")

            more = list(session.generate(max_new_tokens=50 - len(answered)))  # rebuilt, then on from the text
            assert answered + more == expected
            assert session.recoveries == 1
        client.close()
        # the supervisor brought the killed model back once: by loading it again in the same server, or by
        # restarting a server that died of the kill itself (Triton 2.51's Python backend aborts the whole server
        # when a stub killed while it held their shared-memory lock is unloaded: "terminate called after throwing
        # an instance of 'boost::interprocess::lock_exception'", seen here; triton-inference-server/server#8882)
        assert len(supervisor.recoveries) == 1, supervisor.recoveries
        assert supervisor.recoveries[0].action in ("reload sessions", "restart"), supervisor.recoveries
        assert all(recovery.ok for recovery in supervisor.recoveries)
