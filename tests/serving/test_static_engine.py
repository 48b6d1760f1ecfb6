"""The static engine behind sessions, without Triton: a cache of full rows over the fp32-static graph
on the CPU, driven with the requests Triton would send; every output against the PyTorch original."""

from __future__ import annotations

import numpy as np
import pytest

from contract import names
from contract.files import model_filename
from contract.inputs import InputError
from export.artifacts import load_model
from serving.engine import errors
from serving.engine.ort import ort_session
from serving.engine.steps import SESSION_OPERATIONS, StepRequest
from tests.fixtures.engine import Reference, answer, cuda_missing, full_rows_engine, tokens


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def original(artifact_dir):
    return load_model(artifact_dir("gqa"))


@pytest.fixture
def engine(artifact_dir, original):
    session = ort_session(artifact_dir("gqa") / model_filename("fp32-static"))
    return full_rows_engine(session, original.cfg, rows=3, capacity=64, idle_timeout=10.0, clock=Clock())


def test_interleaved_sessions_of_different_lengths_match_the_original(engine, original):
    rng, d = np.random.default_rng(0), original.cfg.d_model
    references = {sid: Reference(original) for sid in ("a", "b", "c")}
    prefills = {"a": 9, "b": 1, "c": 4}
    first = answer(engine, *(StepRequest(sid, True, False, tokens(rng, n, d)) for sid, n in prefills.items()))
    # the inputs of each step are drawn again in the same order for the reference
    rng = np.random.default_rng(0)
    for sid, n in prefills.items():
        expected = references[sid].step(tokens(rng, n, d))
        np.testing.assert_allclose(first[list(prefills).index(sid)], expected, atol=1e-5, rtol=1e-5)
    for step in range(12):
        new = {"a": 1, "b": 1 if step % 3 else 5, "c": 1}  # b takes a chunked prefill every third step
        hidden = {sid: tokens(rng, n, d) for sid, n in new.items()}
        outputs = answer(engine, *(StepRequest(sid, False, False, h) for sid, h in hidden.items()))
        for (sid, h), output in zip(hidden.items(), outputs, strict=True):
            np.testing.assert_allclose(output, references[sid].step(h), atol=1e-5, rtol=1e-5)
    assert engine.largest_batch == 3  # the three decode steps shared one graph run
    assert engine.length("b") == 1 + 4 * 5 + 8


def test_a_masked_token_never_enters_the_cache_and_the_real_ones_are_unchanged(engine, original):
    rng, d = np.random.default_rng(1), original.cfg.d_model
    hidden = tokens(rng, 4, d)
    mask = np.array([[1, 0, 1, 1]], np.int64)
    (output,) = answer(engine, StepRequest("m", True, False, hidden, mask))
    assert engine.length("m") == 3
    reference = Reference(original)
    expected = reference.step(hidden[:, mask[0].astype(bool)])
    np.testing.assert_allclose(output[:, mask[0].astype(bool)], expected, atol=1e-5, rtol=1e-5)
    assert not output[0, 1].any()  # a padded query's output: zeros
    after = tokens(rng, 1, d)
    (next_output,) = answer(engine, StepRequest("m", False, False, after))
    np.testing.assert_allclose(next_output, reference.step(after), atol=1e-5, rtol=1e-5)


def test_the_pool_full_refuses_a_start_and_end_gives_the_slot_back(engine, original):
    d = original.cfg.d_model
    token = np.zeros((1, 1, d), np.float32)
    assert all(
        isinstance(r, np.ndarray) for r in answer(engine, *(StepRequest(i, True, False, token) for i in range(3)))
    )
    (refused,) = answer(engine, StepRequest(99, True, False, token))
    assert isinstance(refused, errors.CacheFull) and refused.code == errors.UNAVAILABLE
    assert "is full: 3 live sequences reserve" in str(refused) and "a new one needs" in str(refused)
    answer(engine, StepRequest(1, False, True, np.zeros((1, 0, d), np.float32)))  # END without tokens
    (started,) = answer(engine, StepRequest(99, True, False, token))
    assert isinstance(started, np.ndarray) and engine.stats().sequences == 3
    assert engine.length(99) == 1  # the freed row went to the new sequence, emptied first


def test_each_request_gets_its_own_precise_error_and_the_others_run(engine, original):
    rng, d = np.random.default_rng(2), original.cfg.d_model
    answer(engine, StepRequest("long", True, False, tokens(rng, 60, d)))
    answer(engine, StepRequest("ended", True, True, tokens(rng, 2, d)))
    results = answer(
        engine,
        StepRequest("long", False, False, tokens(rng, 5, d)),  # 65 > 64 positions
        StepRequest("nobody", False, False, tokens(rng, 1, d)),
        StepRequest("ended", False, False, tokens(rng, 1, d)),
        StepRequest("bad", True, False, rng.standard_normal((1, 2, d + 1)).astype(np.float32)),
        StepRequest("fine", True, False, tokens(rng, 2, d)),
    )
    assert isinstance(results[0], errors.SequenceTooLong) and "65 positions, more than max_seq_len 64" in str(
        results[0]
    )
    assert isinstance(results[1], errors.UnknownSequence)
    assert isinstance(results[2], errors.SequenceEnded)
    assert isinstance(results[3], InputError) and "hidden_states" in str(results[3])
    assert isinstance(results[4], np.ndarray) and results[4].shape == (1, 2, d)
    assert engine.length("long") == 60  # the refused step left it as it was


def test_an_idle_sequence_is_evicted_and_says_so(engine, original):
    token = np.zeros((1, 1, original.cfg.d_model), np.float32)
    answer(engine, StepRequest("idle", True, False, token))
    engine._clock.now = 10.0
    assert engine.evict_idle() == ["idle"] and engine.stats().evictions == 1
    (late,) = answer(engine, StepRequest("idle", False, False, token))
    assert isinstance(late, errors.SequenceEvicted) and "evicted after 10 s idle" in str(late)
    assert engine.stats().sequences == 0 and engine.stats().held_bytes == 0


def test_stats_count_what_the_slots_hold(engine, original):
    cfg = original.cfg
    answer(engine, StepRequest("s", True, False, np.zeros((1, 5, cfg.d_model), np.float32)))
    stats = engine.stats()
    assert stats.sequences == 1 and stats.held_bytes == cfg.kv_cache_bytes(1, 5)
    assert stats.reserved_bytes == cfg.kv_cache_bytes(1, 64)  # a slot: its positions (not its scratch one)
    assert stats.budget_bytes == 3 * stats.reserved_bytes


def test_a_restart_empties_the_sequence(engine, original):
    rng, d = np.random.default_rng(3), original.cfg.d_model
    answer(engine, StepRequest("r", True, False, tokens(rng, 7, d)))
    again = tokens(rng, 2, d)
    (output,) = answer(engine, StepRequest("r", True, False, again))
    assert engine.length("r") == 2
    np.testing.assert_allclose(output, Reference(original).step(again), atol=1e-5, rtol=1e-5)


def test_the_engine_offers_every_session_operation_through_the_method_the_table_names(engine):
    assert engine.OPERATIONS == names.OPERATIONS and list(engine.operations()) == list(names.OPERATIONS)
    methods = {name: getattr(engine, operation.method).__name__ for name, operation in engine.operations().items()}
    assert methods == {name: operation.method for name, operation in SESSION_OPERATIONS.items()}


@pytest.mark.gpu
@pytest.mark.skipif(cuda_missing() is not None, reason=cuda_missing() or "")
def test_on_a_gpu_the_pool_runs_fp16_with_cuda_graphs_and_matches_the_original(artifact_dir, original, tmp_path):
    """The engine as sessions builds it on a CUDA host (docs/gpu.md has the proof's numbers)."""
    from serving.engine.settings import ENGINE_STATIC
    from serving.triton import engines
    from serving.triton.config import P_ENGINE, P_IDLE_TIMEOUT, P_KV_CACHE_BYTES, P_ONNX_FILE, P_ONNX_FILE_CUDA
    from serving.triton.repository import VERSION, write_repository

    parameters = {
        P_ENGINE: ENGINE_STATIC,
        P_ONNX_FILE: model_filename("fp32-static"),
        P_ONNX_FILE_CUDA: model_filename("fp16-static"),
        P_KV_CACHE_BYTES: str(original.cfg.kv_cache_bytes(4, original.cfg.max_seq_len)),
        P_IDLE_TIMEOUT: "60",
    }
    repository = write_repository(artifact_dir("gqa"), tmp_path, models=("sessions",))  # with the digests
    engine = engines.session_engine(repository / "sessions" / VERSION, original.cfg, parameters, 8, "test")
    assert engine.cache.device == "cuda" and engine.cache.dtype is np.float16
    assert engine.cache.cuda_graphs and engine.cache.full_rows, engine.description
    rng, reference = np.random.default_rng(4), Reference(original)
    for count in [6, *[1] * 20]:
        hidden = tokens(rng, count, original.cfg.d_model)
        (output,) = engine.execute([StepRequest("g", count == 6, False, hidden)])
        expected = reference.step(hidden)
        # fp16 (export/parity.py): 2e-3 of the output's scale
        assert np.abs(output - expected).max() <= 2e-3 * np.abs(expected).max()
