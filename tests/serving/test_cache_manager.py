"""The static engine's cache manager (serving/engine/cache_manager.py) under the engine, without Triton: one
pool of rows of one stride, a session reserving its positions a granule at a time as it grows (never moved)
with its outputs the PyTorch original's, rows of any length decoding in one graph run, admission by bytes, a
refused START or growth changing nothing, at most the live-sequence cap held, and a freed row's memory given
back to the kernel."""

from __future__ import annotations

import numpy as np
import psutil
import pytest

from contract.files import model_filename
from export.artifacts import load_model
from serving.engine import errors, kv_pool
from serving.engine.cache_manager import CacheManager, row_sizes
from serving.engine.kv_pool import KVPool
from serving.engine.ort import ort_session
from serving.engine.static_engine import StaticSessionEngine
from serving.engine.steps import StepRequest
from tests.fixtures.engine import Reference, answer, tokens

SIZES = (16, 32, 48, 64)  # granules of 16 up to rows of 64 positions


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


def test_the_reservations_grow_a_granule_at_a_time_up_to_a_row():
    assert row_sizes(1024) == (256, 512, 768, 1024)
    assert row_sizes(1000, smallest=256) == (256, 512, 768, 1000)
    assert row_sizes(128) == (128,)


def test_a_growing_session_reserves_more_in_place_and_matches_the_original(session, original):
    engine = sized_engine(session, original.cfg, budget_rows_of_64=4)
    rng, d = np.random.default_rng(0), original.cfg.d_model
    reference, reserved = Reference(original), []
    hidden = tokens(rng, 5, d)
    (output,) = answer(engine, StepRequest("s", True, False, hidden))
    np.testing.assert_allclose(output, reference.step(hidden), atol=1e-5, rtol=1e-5)
    row = engine.cache._rows["s"]
    while engine.length("s") + 7 <= SIZES[-1]:
        hidden = tokens(rng, 7 if engine.length("s") % 2 else 1, d)  # prefills and decode steps across granules
        (output,) = answer(engine, StepRequest("s", False, False, hidden))
        np.testing.assert_allclose(output, reference.step(hidden), atol=1e-5, rtol=1e-5)
        reserved.append(engine.cache.row_capacity("s"))
    assert sorted(set(reserved)) == list(SIZES) and engine.cache._rows["s"] == row  # grew, never moved
    assert engine.stats().held_bytes == engine.length("s") * engine.cache.bytes_per_position
    assert engine.stats().reserved_bytes == engine.cache.row_bytes(64)


def test_admission_is_by_bytes_and_a_refused_start_or_growth_changes_nothing(session, original):
    engine = sized_engine(session, original.cfg, budget_rows_of_64=2)
    cfg, d = original.cfg, original.cfg.d_model
    row_16, row_64 = (KVPool.row_bytes_for(session, cfg, size) for size in (16, 64))
    assert (row_16, row_64) == (cfg.kv_cache_bytes(1, 16), cfg.kv_cache_bytes(1, 64))  # fp32: 4 bytes a value
    token = np.zeros((1, 1, d), np.float32)
    fits = engine.stats().budget_bytes // row_16
    assert fits == 8  # many more short sessions than full rows
    started = answer(engine, *(StepRequest(i, True, False, token) for i in range(fits)))
    assert all(isinstance(result, np.ndarray) for result in started)
    (refused,) = answer(engine, StepRequest("one more", True, False, token))
    assert isinstance(refused, errors.CacheFull) and f"a new one needs {row_16 / 1024:.1f} KiB for 1 position;" in str(
        refused
    )
    # a session that outgrows its reservation with no room left is refused and keeps what it holds
    rng = np.random.default_rng(1)
    (grow,) = answer(engine, StepRequest(0, False, False, tokens(rng, 20, d)))
    assert isinstance(grow, errors.CacheFull) and "growing from 1 to 21 positions" in str(grow)
    assert engine.length(0) == 1
    (step,) = answer(engine, StepRequest(0, False, False, tokens(rng, 1, d)))
    assert isinstance(step, np.ndarray) and engine.length(0) == 2
    assert engine.stats().reserved_bytes == fits * row_16 == engine.stats().budget_bytes
    # ending the others gives the grown session its room
    for i in range(1, fits):
        end(engine, i)
    (grow,) = answer(engine, StepRequest(0, False, False, tokens(rng, 40, d)))
    assert isinstance(grow, np.ndarray) and engine.cache.row_capacity(0) == 48
    end(engine, 0)
    assert engine.stats().reserved_bytes == 0 == engine.stats().allocated_bytes


def test_rows_of_any_length_decode_in_one_graph_run_and_forks_and_restores_reserve_what_they_need(session, original):
    engine = sized_engine(session, original.cfg, budget_rows_of_64=4)
    rng, d = np.random.default_rng(2), original.cfg.d_model
    references = {"short": Reference(original), "long": Reference(original)}
    prompts = {"short": tokens(rng, 3, d), "long": tokens(rng, 40, d)}
    for sid, hidden in prompts.items():
        (output,) = answer(engine, StepRequest(sid, True, False, hidden))
        np.testing.assert_allclose(output, references[sid].step(hidden), atol=1e-5, rtol=1e-5)
    assert {engine.cache.row_capacity(sid) for sid in prompts} == {16, 48}
    for _ in range(3):
        hidden = {sid: tokens(rng, 1, d) for sid in prompts}
        runs = engine.runs.decode_runs
        outputs = answer(engine, *(StepRequest(sid, False, False, h) for sid, h in hidden.items()))
        assert engine.runs.decode_runs == runs + 1  # both lengths in one decode run
        for (sid, h), output in zip(hidden.items(), outputs, strict=True):
            np.testing.assert_allclose(output, references[sid].step(h), atol=1e-5, rtol=1e-5)
    assert engine.fork("long", "copy") == 43 and engine.cache.row_capacity("copy") == 48
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


def test_full_rows_reserve_a_whole_row_each(session, original):
    cfg = original.cfg
    row_64 = KVPool.row_bytes_for(session, cfg, 64)
    cache = CacheManager(session, cfg, 3 * row_64 + row_64 // 2, SIZES, full_rows=True)
    assert (cache.sizes, cache.most_rows, cache.pool.rows) == ((64,), 3, 3)
    for holder in range(3):
        cache.allocate(holder, 1)
        cache.free(holder) if holder == 0 else None
    cache.allocate("again", 5)
    with pytest.raises(Exception, match=f"a new one needs {row_64 / 1024:.1f} KiB for 1 position;"):
        cache.allocate("more", 1)
    assert cache.reserved_total == 3 * row_64


def test_a_rows_memory_is_committed_as_it_fills_and_given_back_when_it_is_freed(session, original):
    """The pool's buffers are address space (8,192 rows of max_seq_len here, more than this machine's memory),
    and memory only where rows hold positions: filling rows takes memory, freeing them gives it back."""
    cfg = original.cfg
    position, filled, length = KVPool.row_bytes_for(session, cfg, 1), 128, 1024
    cache = CacheManager(session, cfg, 2 * filled * length * position, (16, cfg.max_seq_len), max_rows=8192)
    assert cache.pool.lazy and cache.pool.rows == 8192
    assert cache.pool.nbytes > psutil.virtual_memory().total  # reserved, not committed
    process, values = psutil.Process(), np.ones((cfg.n_kv_heads, length, cfg.head_dim), np.float32)
    before = process.memory_info().rss
    for holder in range(filled):
        cache.allocate(holder, length)
        cache.write(holder, dict.fromkeys(cache.pool.past_names, values), length)
    expected = filled * length * position
    grown = process.memory_info().rss - before
    assert grown > 0.8 * expected, (grown, expected)
    for holder in range(filled):
        cache.free(holder)
    assert process.memory_info().rss - before < 0.2 * expected


def test_a_row_renamed_aside_leaves_the_live_rows_one_decode_window_and_keeps_what_it_held(
    session, original, monkeypatch
):
    """The engine core keeps a finished generation's row (renamed aside): it moves to the highest free row, so
    an idle kept row never sits between decoding rows (no idle row is worth merging over here)."""
    monkeypatch.setattr(kv_pool, "MERGE_BYTES", 0)
    engine = sized_engine(session, original.cfg, budget_rows_of_64=8, max_rows=8)
    rng, d = np.random.default_rng(5), original.cfg.d_model
    references = {sid: Reference(original) for sid in "abc"}
    for sid in "abc":
        hidden = tokens(rng, 5, d)
        answer(engine, StepRequest(sid, True, False, hidden))
        references[sid].step(hidden)
    assert [engine.cache._rows[sid] for sid in "abc"] == [0, 1, 2]
    engine.rename("b", ("kept", 0))
    assert engine.cache._rows[("kept", 0)] == 7 and engine.length(("kept", 0)) == 5
    hidden = {sid: tokens(rng, 1, d) for sid in "ac"}
    runs = engine.runs.decode_runs
    outputs = answer(engine, *(StepRequest(sid, False, False, h) for sid, h in hidden.items()))
    assert engine.runs.decode_runs == runs + 1  # rows 0 and 2: the freed row between them holds nothing
    for (sid, h), output in zip(hidden.items(), outputs, strict=True):
        np.testing.assert_allclose(output, references[sid].step(h), atol=1e-5, rtol=1e-5)
    assert engine.fork(("kept", 0), "again") == 5 and engine.cache._rows["again"] == 1  # the lowest free row
    h = tokens(rng, 1, d)
    (output,) = answer(engine, StepRequest("again", False, False, h))
    np.testing.assert_allclose(output, references["b"].step(h), atol=1e-5, rtol=1e-5)
