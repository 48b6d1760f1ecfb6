"""The static engine's cache manager (serving/engine/cache_manager.py) under the engine, without Triton:
a session moves to larger rows as it grows and its outputs stay the PyTorch original's, admission is
by bytes, a refused START or step changes nothing, an emptied slab is reused by its size and gives
its room to another size only when the budget needs it, and at most the live-sequence cap is held."""

from __future__ import annotations

import numpy as np
import pytest

from contract.files import model_filename
from export.artifacts import load_model
from serving.engine import errors
from serving.engine.cache_manager import CacheManager, row_sizes
from serving.engine.kv_pool import KVPool
from serving.engine.ort import ort_session
from serving.engine.static_engine import StaticSessionEngine
from serving.engine.steps import StepRequest
from tests.fixtures.engine import Reference, answer, tokens

SIZES = (16, 32, 64)


@pytest.fixture(scope="module")
def original(artifact_dir):
    return load_model(artifact_dir("gqa"))


@pytest.fixture(scope="module")
def session(artifact_dir):
    return ort_session(artifact_dir("gqa") / model_filename("fp32-static"))


def sized_engine(session, cfg, budget_rows_of_64: float, max_rows: int = 1000) -> StaticSessionEngine:
    """An engine whose budget is `budget_rows_of_64` rows of the largest size."""
    budget = int(budget_rows_of_64 * KVPool.row_bytes_for(session, cfg, SIZES[-1]))
    return StaticSessionEngine(CacheManager(session, cfg, budget, SIZES, max_rows=max_rows), idle_timeout=60.0)


def end(engine, sequence_id) -> None:
    answer(engine, StepRequest(sequence_id, False, True, np.zeros((1, 0, engine.cfg.d_model), np.float32)))


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
        sizes_seen.append(engine.cache.row_capacity("s"))
    assert sorted(set(sizes_seen)) == list(SIZES)  # it started small and moved twice
    assert engine.stats().held_bytes == engine.length("s") * engine.cache.bytes_per_position


def test_admission_is_by_bytes_and_a_refused_start_or_growth_changes_nothing(session, original):
    engine = sized_engine(session, original.cfg, budget_rows_of_64=2)
    cfg, d = original.cfg, original.cfg.d_model
    row_16, row_64 = (KVPool.row_bytes_for(session, cfg, size) for size in (16, 64))
    assert (row_16, row_64) == (cfg.kv_cache_bytes(1, 16), cfg.kv_cache_bytes(1, 64))  # fp32: 4 bytes a value
    token = np.zeros((1, 1, d), np.float32)
    fits = engine.stats().budget_bytes // row_16
    assert fits == 8  # two slabs of four rows of 16: many more short sessions than full rows
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
    assert engine.stats().reserved_bytes == fits * row_16 == engine.stats().budget_bytes
    # ending the others empties a slab, whose room then goes to the grown session's larger row
    for i in range(1, fits):
        end(engine, i)
    (grow,) = answer(engine, StepRequest(0, False, False, tokens(rng, 40, d)))
    assert isinstance(grow, np.ndarray) and engine.cache.row_capacity(0) == 64
    assert engine.stats().allocated_bytes == 2 * row_64 == engine.stats().budget_bytes
    end(engine, 0)  # both slabs stay open, empty, for the next sessions of their sizes
    assert engine.stats().allocated_bytes == 2 * row_64 and engine.cache.slab_count() == 2
    assert engine.stats().reserved_bytes == 0


def test_an_emptied_slab_is_reused_by_its_size_and_closed_only_for_the_room_of_another(session, original):
    engine = sized_engine(session, original.cfg, budget_rows_of_64=2)
    rng, d = np.random.default_rng(3), original.cfg.d_model
    answer(engine, StepRequest("a", True, False, tokens(rng, 3, d)))
    engine.fork("a", "b")  # a free row of the same slab
    assert engine.cache.slabs_opened == 1
    end(engine, "a"), end(engine, "b")
    prompt, reference = tokens(rng, 40, d), Reference(original)
    np.testing.assert_allclose(
        answer(engine, StepRequest("c", True, False, prompt))[0], reference.step(prompt), atol=1e-5, rtol=1e-5
    )
    assert engine.cache.slabs_opened == 2 and engine.cache.slab_count() == 2  # the empty slab of 16 kept
    engine.fork("c", "d")  # no room for a second row of 64 but the empty slab's: it is closed for it
    assert engine.cache.slabs_opened == 3 and engine.cache.slab_count() == 2
    end(engine, "d")
    engine.fork("c", "e")  # d's slab, open and empty: no slab opened
    assert engine.cache.slabs_opened == 3 and engine.cache.row_capacity("e") == 64
    token = tokens(rng, 1, d)
    np.testing.assert_allclose(
        answer(engine, StepRequest("e", False, False, token))[0], reference.step(token), atol=1e-5, rtol=1e-5
    )


def test_rows_of_two_sizes_step_together_and_forks_and_restores_take_the_size_they_need(session, original):
    engine = sized_engine(session, original.cfg, budget_rows_of_64=4)
    rng, d = np.random.default_rng(2), original.cfg.d_model
    references = {"short": Reference(original), "long": Reference(original)}
    prompts = {"short": tokens(rng, 3, d), "long": tokens(rng, 40, d)}
    for sid, hidden in prompts.items():
        (output,) = answer(engine, StepRequest(sid, True, False, hidden))
        np.testing.assert_allclose(output, references[sid].step(hidden), atol=1e-5, rtol=1e-5)
    assert {engine.cache.row_capacity(sid) for sid in prompts} == {16, 64}
    for _ in range(3):
        hidden = {sid: tokens(rng, 1, d) for sid in prompts}
        outputs = answer(engine, *(StepRequest(sid, False, False, h) for sid, h in hidden.items()))
        for (sid, h), output in zip(hidden.items(), outputs, strict=True):
            np.testing.assert_allclose(output, references[sid].step(h), atol=1e-5, rtol=1e-5)
    assert engine.fork("long", "copy") == 43 and engine.cache.row_capacity("copy") == 64
    blob = engine.snapshot("short")
    assert engine.restore("back", blob) == 6 and engine.cache.row_capacity("back") == 16
    hidden = tokens(rng, 1, d)
    (forked, restored) = answer(
        engine, StepRequest("copy", False, False, hidden), StepRequest("back", False, False, hidden)
    )
    np.testing.assert_allclose(forked, references["long"].step(hidden), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(restored, references["short"].step(hidden), atol=1e-5, rtol=1e-5)


def test_the_engine_admits_at_most_its_most_sequences_whatever_the_budget(session, original):
    engine = sized_engine(session, original.cfg, budget_rows_of_64=64, max_rows=3)
    token = np.zeros((1, 1, original.cfg.d_model), np.float32)
    assert engine.capacity == 3
    *started, refused = answer(engine, *(StepRequest(i, True, False, token) for i in range(4)))
    assert all(isinstance(result, np.ndarray) for result in started)
    assert isinstance(refused, errors.CacheFull) and "its most sequences at once (3)" in str(refused)


def test_full_rows_are_one_slab_opened_at_the_start_and_never_another(session, original):
    cfg = original.cfg
    row_64 = KVPool.row_bytes_for(session, cfg, 64)
    cache = CacheManager(session, cfg, 3 * row_64 + row_64 // 2, SIZES, full_rows=True)
    assert (cache.sizes, cache.slab_count(), cache.allocated_bytes, cache.most_rows) == ((64,), 1, 3 * row_64, 3)
    for holder in range(3):
        cache.allocate(holder, 1)
        cache.free(holder) if holder == 0 else None
    cache.allocate("again", 5)
    with pytest.raises(Exception, match="a row of 64 positions"):
        cache.allocate("more", 1)
    assert (cache.slab_count(), cache.slabs_opened) == (1, 1)
