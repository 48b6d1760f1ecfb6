"""The fallback served: a model whose head_dim (12) is not a multiple of 8 has no static graph, so
its repository gets the concat engine (serving/engine/concat/), and `python -m serving` says so on
the console and in GET /v1/models with every session operation. Through the client library a session
on it snapshots, restores, forks and rewinds, each step within 1e-5 of the PyTorch original, and a
session with a directory store survives a kill -9 of the sessions stub: its next step (after the
supervisor reloads the model and the client restores the session from the store and replays the
steps since) is within 1e-5 of the original over everything it was given."""

from __future__ import annotations

import os
import signal

import httpx
import numpy as np
import pytest

from client import Client
from client.store import DirectoryStore
from contract import names
from contract.config import ModelConfig
from serving.triton.config import ServingSettings
from serving.triton.repository import write_repository
from tests.fixtures.serving_process import serving_process

pytestmark = [pytest.mark.served, pytest.mark.slow]

# head_dim 48 / 4 = 12: GroupQueryAttention takes no head_dim that is not a multiple of 8
CFG = ModelConfig(d_model=48, n_heads=4, n_kv_heads=4, n_layers=2, max_seq_len=64)
VARIANTS = ("fp32", "fp32-fused", names.INSPECTION_VARIANT)  # what this machine serves; no static form exists
EVERY = 8  # positions between checkpoints: the stub is killed past one, so recovery replays a few steps


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from export.build import build
    from export.progress import Progress

    out = tmp_path_factory.mktemp("artifact-head-dim-12")
    build(CFG, out, variants=VARIANTS, progress=Progress(enabled=False))
    return out


@pytest.fixture(scope="module")
def original(artifact):
    from export.artifacts import load_model
    from export.runners import torch_runner

    return torch_runner(load_model(artifact))


@pytest.fixture(scope="module")
def served(artifact, tmp_path_factory):
    work = tmp_path_factory.mktemp("concat-served")
    settings = ServingSettings(threads=1, kv_cache_bytes=64 << 20)
    repository = write_repository(artifact, work / "repository", settings)
    env = {"SERVING_REQUEST_TIMEOUT_S": "30"}
    with serving_process(repository, work, env=env, args=("--probe-interval", "0.5"), stop_later=True) as process:
        yield process


@pytest.fixture
def client(served):
    with Client(f"127.0.0.1:{served.grpc_port}") as client:
        yield client


def tokens(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, count, CFG.d_model)).astype(np.float32)


def expected(original, parts: list[np.ndarray]) -> np.ndarray:
    """The original's outputs for the last part, given every part before it as the past."""
    whole = original({names.HIDDEN_STATES: np.concatenate(parts, axis=1)})[names.OUTPUT]
    return whole[:, -parts[-1].shape[1] :]


def close(ours: np.ndarray, original, parts: list[np.ndarray]) -> None:
    np.testing.assert_allclose(ours, expected(original, parts), rtol=0, atol=1e-5)


def test_the_deployment_says_the_concat_engine_serves_with_every_operation(served):
    console = served.output()
    every = ", ".join(names.OPERATIONS)
    assert any(line.startswith("sessions") and "concat engine" in line for line in console.splitlines()), console
    assert f"session operations: {every}" in console, console
    with httpx.Client(base_url=served.gateway_url, timeout=30) as gateway:
        models = {model["name"]: model for model in gateway.get("/v1/models").json()["models"]}
    session = models["sessions"]
    assert (session["engine"], session["operations"], session["head_dim"]) == ("concat", list(names.OPERATIONS), 12)


def test_snapshot_restore_fork_and_rewind_each_match_the_original(client, original):
    prompt, after = tokens(1, 9), [tokens(10 + i, 1) for i in range(4)]
    with client.session() as trunk:
        close(trunk.step(prompt), original, [prompt])
        blob = trunk.snapshot()
        with client.session(restore=blob) as restored, trunk.fork() as branch:
            for i, piece in enumerate(after):
                for session in (trunk, restored, branch):
                    close(session.step(piece), original, [prompt, *after[: i + 1]])
            assert (trunk.length, restored.length, branch.length) == (13, 13, 13)
        assert trunk.rewind(10) == 10 == trunk.length  # the prompt and the first token
        resumed = tokens(20, 3)
        close(trunk.step(resumed), original, [prompt, after[0], resumed])
        assert trunk.length == 13


def test_a_session_with_a_directory_store_survives_a_killed_stub(served, original, tmp_path):
    store = DirectoryStore(tmp_path / "store")
    with Client(f"127.0.0.1:{served.grpc_port}", session_store=store, checkpoint_every=EVERY) as client:
        session, parts = client.session(), [tokens(30, 6)]
        close(session.step(parts[-1]), original, parts)
        for i in range(5):  # a checkpoint at 8, and 3 positions past it
            parts.append(tokens(31 + i, 1))
            close(session.step(parts[-1]), original, parts)
        before = session.id
        kill_stub(served)
        parts.append(tokens(40, 1))
        close(session.step(parts[-1]), original, parts)  # the client recovers once the model is reloaded
        assert session.recoveries == 1 and session.id != before
        parts.append(tokens(41, 2))
        close(session.step(parts[-1]), original, parts)
        session.close()


def kill_stub(served) -> None:
    """kill -9 of the sessions model's python backend stub under `python -m serving`."""
    stubs = [pid for pid, command in served.descendants().items() if "sessions_0_0" in command]
    assert len(stubs) == 1, served.descendants()
    os.kill(stubs[0], signal.SIGKILL)
