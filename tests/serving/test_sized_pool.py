"""Rows sized to the session (serving/engine/sized_pool.py) under the static engine, without Triton:
a session moves to larger rows as it grows and its outputs stay the PyTorch original's, admission is
by bytes, a refused START or step changes nothing, and an emptied slab gives its memory back."""

from __future__ import annotations

import numpy as np
import pytest

from contract.files import model_filename
from export.artifacts import load_model
from serving.engine import errors
from serving.engine.kv_pool import KVPool
from serving.engine.ort import ort_session
from serving.engine.sized_pool import SizedPool, row_sizes
from serving.engine.static_engine import StaticSessionEngine
from serving.engine.steps import StepRequest
from tests.serving.test_static_engine import Reference, answer, tokens

SIZES = (16, 32, 64)


@pytest.fixture(scope="module")
def original(artifact_dir):
    return load_model(artifact_dir("gqa"))


@pytest.fixture(scope="module")
def session(artifact_dir):
    return ort_session(artifact_dir("gqa") / model_filename("fp32-static"))


def sized_engine(session, cfg, budget_rows_of_64: float) -> StaticSessionEngine:
    """An engine whose budget is `budget_rows_of_64` rows of the largest size."""
    budget = int(budget_rows_of_64 * KVPool.row_bytes_for(session, cfg, SIZES[-1]))
    pool = SizedPool(
        cfg,
        budget,
        SIZES,
        open_slab=lambda rows, size: KVPool(session, cfg, rows=rows, capacity=size),
        row_bytes=lambda size: KVPool.row_bytes_for(session, cfg, size),
        max_rows=1000,
    )
    return StaticSessionEngine(pool, idle_timeout=60.0)


def test_the_sizes_halve_from_max_seq_len_down_to_the_smallest():
    assert row_sizes(8192) == (256, 512, 1024, 2048, 4096, 8192)
    assert row_sizes(1000, smallest=200) == (250, 500, 1000)
    assert row_sizes(128) == (128,)


def test_a_growing_session_moves_up_the_sizes_and_matches_the_original(session, original):
    engine = sized_engine(session, original.cfg, budget_rows_of_64=4)
    rng, d = np.random.default_rng(0), original.cfg.d_model
    reference, sizes_seen = Reference(original), []
    hidden = tokens(rng, 5, d)
    (output,) = answer(engine, StepRequest("s", True, False, hidden))
    np.testing.assert_allclose(output, reference.step(hidden), atol=1e-5, rtol=1e-5)
    while engine.length("s") + 7 <= SIZES[-1]:
        hidden = tokens(rng, 7 if engine.length("s") % 2 else 1, d)  # prefills and decode steps across the moves
        (output,) = answer(engine, StepRequest("s", False, False, hidden))
        np.testing.assert_allclose(output, reference.step(hidden), atol=1e-5, rtol=1e-5)
        sizes_seen.append(engine.pool.row_capacity(engine._row("s")))
    assert sorted(set(sizes_seen)) == list(SIZES)  # it started small and moved twice
    assert engine.stats().held_bytes == engine.length("s") * engine.pool.bytes_per_position


def test_admission_is_by_bytes_and_a_refused_start_or_growth_changes_nothing(session, original):
    engine = sized_engine(session, original.cfg, budget_rows_of_64=2)
    cfg, d = original.cfg, original.cfg.d_model
    row_16, row_64 = (KVPool.row_bytes_for(session, cfg, size) for size in (16, 64))
    token = np.zeros((1, 1, d), np.float32)
    fits = engine.stats().budget_bytes // row_16
    assert fits > 2 * (64 // 16) - 1  # many more short sessions than full rows
    started = answer(engine, *(StepRequest(i, True, False, token) for i in range(fits)))
    assert all(isinstance(result, np.ndarray) for result in started)
    (refused,) = answer(engine, StepRequest("one more", True, False, token))
    assert isinstance(refused, errors.CacheFull) and "a row of 16 positions" in str(refused)
    # a session that outgrows its row with no room left is refused and keeps what it holds
    rng = np.random.default_rng(1)
    (grow,) = answer(engine, StepRequest(0, False, False, tokens(rng, 20, d)))
    assert isinstance(grow, errors.CacheFull) and engine.length(0) == 1
    (step,) = answer(engine, StepRequest(0, False, False, tokens(rng, 1, d)))
    assert isinstance(step, np.ndarray) and engine.length(0) == 2
    assert engine.stats().reserved_bytes == fits * row_16 <= engine.stats().budget_bytes
    # ending the others frees whole slabs: the grown session then gets its larger row
    for i in range(1, fits):
        answer(engine, StepRequest(i, False, True, np.zeros((1, 0, d), np.float32)))
    (grow,) = answer(engine, StepRequest(0, False, False, tokens(rng, 40, d)))
    assert isinstance(grow, np.ndarray) and engine.pool.row_capacity(engine._row(0)) == 64
    assert engine.stats().allocated_bytes <= engine.stats().budget_bytes
    answer(engine, StepRequest(0, False, True, np.zeros((1, 0, d), np.float32)))
    assert engine.stats().allocated_bytes == 0 and row_64 > row_16  # the last END closed every slab


def test_rows_of_two_sizes_step_together_and_forks_and_restores_take_the_size_they_need(session, original):
    engine = sized_engine(session, original.cfg, budget_rows_of_64=4)
    rng, d = np.random.default_rng(2), original.cfg.d_model
    references = {"short": Reference(original), "long": Reference(original)}
    prompts = {"short": tokens(rng, 3, d), "long": tokens(rng, 40, d)}
    for sid, hidden in prompts.items():
        (output,) = answer(engine, StepRequest(sid, True, False, hidden))
        np.testing.assert_allclose(output, references[sid].step(hidden), atol=1e-5, rtol=1e-5)
    assert {engine.pool.row_capacity(engine._row(sid)) for sid in prompts} == {16, 64}
    for _ in range(3):
        hidden = {sid: tokens(rng, 1, d) for sid in prompts}
        outputs = answer(engine, *(StepRequest(sid, False, False, h) for sid, h in hidden.items()))
        for (sid, h), output in zip(hidden.items(), outputs, strict=True):
            np.testing.assert_allclose(output, references[sid].step(h), atol=1e-5, rtol=1e-5)
    assert engine.fork("long", "copy") == 43 and engine.pool.row_capacity(engine._row("copy")) == 64
    blob = engine.snapshot("short")
    assert engine.restore("back", blob) == 6 and engine.pool.row_capacity(engine._row("back")) == 16
    hidden = tokens(rng, 1, d)
    (forked, restored) = answer(
        engine, StepRequest("copy", False, False, hidden), StepRequest("back", False, False, hidden)
    )
    np.testing.assert_allclose(forked, references["long"].step(hidden), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(restored, references["short"].step(hidden), atol=1e-5, rtol=1e-5)


def test_the_engine_admits_at_most_its_most_sequences_whatever_the_budget(session, original):
    cfg = original.cfg
    pool = SizedPool(
        cfg,
        64 * KVPool.row_bytes_for(session, cfg, SIZES[-1]),
        SIZES,
        open_slab=lambda rows, size: KVPool(session, cfg, rows=rows, capacity=size),
        row_bytes=lambda size: KVPool.row_bytes_for(session, cfg, size),
        max_rows=3,
    )
    engine, token = StaticSessionEngine(pool, idle_timeout=60.0), np.zeros((1, 1, cfg.d_model), np.float32)
    assert engine.capacity == 3
    *started, refused = answer(engine, *(StepRequest(i, True, False, token) for i in range(4)))
    assert all(isinstance(result, np.ndarray) for result in started)
    assert isinstance(refused, errors.CacheFull) and "its most sequences at once (3)" in str(refused)
