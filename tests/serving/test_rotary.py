"""A model with the modern block (RMSNorm, q/k norms, its own head_dim, RoPE with Llama 3's scaling, a
sliding window in every other layer: TEST_CONFIGS["rotary"]) served by a real Triton with each session
engine: sessions place their tokens after what they hold, stateless calls at the positions given or
counted from the mask, every answer equal to the independent reference within 1e-5 (fp32), and a
position beyond the rotary table refused naming it."""

from __future__ import annotations

import numpy as np
import pytest

from client import Client, InvalidInputError
from contract import files
from serving.engine.settings import ENGINE_CONCAT, ENGINE_STATIC
from serving.triton.config import ServingSettings
from serving.triton.repository import write_repository
from tests import reference
from tests.conftest import TEST_CONFIGS
from tests.fixtures.triton import selected, started_together

CFG = TEST_CONFIGS["rotary"]
PREFILL, STEPS = 7, 24  # past the window of 24 in the windowed layer


ENGINES = [ENGINE_STATIC, ENGINE_CONCAT]


@pytest.fixture(scope="module")
def tritons(request, artifact_dir, tmp_path_factory):
    """engine -> a Future of a Triton serving the rotary artifact with that session engine, for the
    engines this run tests: started at once, stopped together at the end."""
    artifact = artifact_dir("rotary")
    runs = selected(request, "served")
    with started_together() as start:
        started = {}
        for engine in (engine for engine in ENGINES if engine in runs):
            work = tmp_path_factory.mktemp(f"rotary-{engine}")
            settings = ServingSettings(threads=1, kv_cache_bytes=8 << 20, max_batch_size=4, engine=engine)
            repository = write_repository(artifact, work / "repository", settings, models=("forward", "sessions"))
            started[engine] = start(repository, log_path=work / "triton.log")
        yield started


@pytest.fixture(scope="module", params=ENGINES)
def served(request, artifact_dir, tritons):
    with Client(tritons[request.param].result().grpc_url) as client:
        yield client, reference.load_weights(artifact_dir("rotary") / files.WEIGHTS_FILENAME)


def tokens(count: int, seed: int, batch: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, count, CFG.d_model)).astype(np.float32)


def test_a_session_places_its_tokens_after_what_it_holds(served):
    client, weights = served
    hidden = tokens(PREFILL + STEPS, seed=1)
    with client.session() as session:
        outputs = [session.step(hidden[:, :PREFILL])]
        outputs += [session.step(hidden[:, t : t + 1]) for t in range(PREFILL, PREFILL + STEPS)]
        assert session.length == PREFILL + STEPS
    expected, _ = reference.forward(CFG, weights, hidden)  # positions 0, 1, 2, ...
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), expected, atol=1e-5, rtol=1e-5)


def test_stateless_calls_at_given_positions_and_a_cache_continued_from_them(served):
    client, weights = served
    hidden = tokens(6, seed=2, batch=2)
    positions = np.array([[0, 1, 2, 3, 4, 5], [100, 101, 102, 103, 104, 105]])
    first = client.infer(hidden[:, :4], position_ids=positions[:, :4])
    second = client.infer(hidden[:, 4:], past=first.present, position_ids=positions[:, 4:])
    expected, _ = reference.forward(CFG, weights, hidden, positions=positions)
    np.testing.assert_allclose(np.concatenate([first.output, second.output], axis=1), expected, atol=1e-5, rtol=1e-5)


def test_left_out_positions_are_counted_from_the_mask_as_hugging_face_does(served):
    client, weights = served
    hidden = tokens(5, seed=3, batch=2)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # row 0 left-padded: its tokens at positions 0, 1, 2
    result = client.infer(hidden, mask)
    expected, _ = reference.forward(CFG, weights, hidden, mask)
    real = reference.real_rows(mask, 5)
    np.testing.assert_allclose(result.output[real], expected[real], atol=1e-5, rtol=1e-5)


def test_a_position_beyond_the_rotary_table_is_refused_naming_it(served):
    client, _ = served
    with pytest.raises(InvalidInputError, match=rf"position_ids.*\[0, {CFG.max_seq_len}\).*got {CFG.max_seq_len}"):
        client.infer(tokens(1, seed=4), position_ids=np.array([[CFG.max_seq_len]]))
