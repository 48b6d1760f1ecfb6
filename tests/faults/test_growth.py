"""Issue 34, item 7 (the rest): a growing session was refused with half the budget free, 8/16 of it in
slabs' waste (documented at most 5/16), and told "cannot start" though it was growing.

In process, the static engine's cache manager over the tiny model's static graph (no Triton): rows
that sessions left behind in slabs of one size are packed into fewer slabs when another size needs
the room, a refused growth says it was growing and where the free bytes are, and over a random mix of
lengths no refusal leaves more of the budget unused than docs/design.md states ("Rows sized to the
session")."""

from __future__ import annotations

import numpy as np
import pytest

from contract.files import model_filename
from serving.engine import errors
from serving.engine.cache_manager import CacheManager, RowsFull
from serving.engine.ort import ort_session
from serving.engine.static_engine import StaticSessionEngine
from serving.engine.steps import StepRequest

SIZES = (16, 32, 64)
MIX_SIZES = (16, 32, 64, 128, 256, 512)  # six sizes, as the seed preset's 256 to 8192


@pytest.fixture(scope="module")
def served(artifact_dir):
    """The tiny model's static graph and its config."""
    from contract.config import ModelConfig

    directory = artifact_dir("tiny")
    return ort_session(directory / model_filename("fp32-static"), threads=1), ModelConfig.load(directory)


def engine_of(served, budget: int, sizes=SIZES) -> StaticSessionEngine:
    session, cfg = served
    return StaticSessionEngine(CacheManager(session, cfg, budget, sizes), idle_timeout=600.0)


def step(engine, sequence_id, count: int, start: bool = False, seed: int = 0):
    hidden = np.random.default_rng(seed).standard_normal((1, count, engine.cfg.d_model)).astype(np.float32)
    (result,) = engine.execute([StepRequest(sequence_id, start, False, hidden)])
    return result


def end(engine, sequence_id) -> None:
    engine.execute([StepRequest(sequence_id, False, True, np.zeros((1, 0, engine.cfg.d_model), np.float32))])


def test_a_session_growing_into_a_budget_left_in_sparse_slabs_gets_its_row_and_the_others_keep_theirs(served):
    cfg = served[1]
    row_16, row_64 = cfg.kv_cache_bytes(1, 16), cfg.kv_cache_bytes(1, 64)
    engine = engine_of(served, budget=4 * row_64)  # slabs of one row of 64: four rows of 16 each
    for k in range(16):  # the whole budget in rows of 16
        assert isinstance(step(engine, k, 5, start=True, seed=k), np.ndarray)
    for k in range(16):
        if k % 4:
            end(engine, k)  # each slab keeps one session: three quarters of the budget stand free in them
    kept = {k: engine.cache.read(k) for k in range(0, 16, 4)}
    assert engine.stats().reserved_bytes == 4 * row_16

    grown = step(engine, 0, 40, seed=99)  # 45 positions: a row of 64, which only packing makes room for

    assert isinstance(grown, np.ndarray), grown
    assert engine.length(0) == 45 and engine.cache.row_capacity(0) == 64
    for k, cache in kept.items():  # the moved rows hold what they held
        after = engine.cache.read(k)
        for name, array in cache.items():
            np.testing.assert_array_equal(after[name][:, :5], array[:, :5])
    assert engine.stats().reserved_bytes == 3 * row_16 + row_64


def test_a_refused_growth_says_growing_from_what_to_what_and_where_the_free_bytes_are(served):
    cfg = served[1]
    row_16, row_32, row_64 = (cfg.kv_cache_bytes(1, n) for n in (16, 32, 64))
    engine = engine_of(served, budget=2 * row_64)  # two slabs of four rows of 16
    for k in range(8):
        step(engine, k, 3, start=True, seed=k)
    end(engine, 7)  # one free row of 16: a quarter of a slab, which no move can empty

    refused = step(engine, 0, 20, seed=5)  # 23 positions: a row of 32

    assert isinstance(refused, errors.CacheFull)
    message = str(refused)
    assert "sequence 0 cannot grow" in message and "cannot start" not in message
    assert "growing from 3 to 23 positions" in message and f"a row of 32 positions ({row_32 / 1024:.1f} KiB)" in message
    assert f"{7 * row_16 / 1024:.1f} KiB of {2 * row_64 / 1024:.1f} KiB" in message  # what the live rows hold
    assert f"Free: 0.0 KiB outside any slab, {row_16 / 1024:.1f} KiB in free rows" in message
    assert engine.length(0) == 3 and engine.cache.row_capacity(0) == 16  # it goes on as it was
    assert isinstance(step(engine, 0, 1, seed=6), np.ndarray)


def test_over_a_random_mix_of_lengths_no_refusal_leaves_more_unused_than_the_documented_bound(served):
    """docs/design.md: a refusal leaves unused less than one slab per size other than the one asked for
    (5/16 of the budget with 6 sizes) plus the asked row; a slab is 4 rows of the largest size, or as many
    as a sixteenth of the budget holds (at least one). The mix: sessions start and grow by lengths drawn
    around 55 positions, and every 250 events three quarters of them end at once (what left the probe's
    slabs sparse: 7.2/16 of the budget unused at a refusal on this mix before rows were packed)."""
    session, cfg = served
    largest = cfg.kv_cache_bytes(1, MIX_SIZES[-1])
    budget = 64 * largest
    slab = largest * max(1, min(4, budget // 16 // largest))
    cache = CacheManager(session, cfg, budget, MIX_SIZES)
    rng, lengths, worst, refusals = np.random.default_rng(1), {}, 0.0, 0
    for event in range(3000):
        if event % 250 == 249:
            for holder in [holder for holder in lengths if rng.random() < 0.75]:
                cache.free(holder)
                del lengths[holder]
        holder, asked = int(rng.integers(0, 400)), int(rng.lognormal(4.0, 1.2)) + 1
        try:
            if holder in lengths:
                asked = min(MIX_SIZES[-1], lengths[holder] + asked)
                cache.grow(holder, asked)
            else:
                asked = min(MIX_SIZES[-1], asked)
                cache.allocate(holder, asked)
            lengths[holder] = asked
        except RowsFull as full:
            refusals += 1
            size = next(size for size in MIX_SIZES if size >= full.positions)
            unused = budget - sum(cfg.kv_cache_bytes(1, cache.row_capacity(h)) for h in lengths)
            bound = (len(MIX_SIZES) - 1) * slab + cfg.kv_cache_bytes(1, size)
            assert unused < bound, f"event {event}: {16 * unused / budget:.1f}/16 of the budget unused at a refusal"
            worst = max(worst, unused / budget)
    assert refusals > 20  # the budget was the limit often enough for the bound to mean something
    print(f"{refusals} refusals; the most of the budget unused at one: {16 * worst:.1f}/16 (bound 5/16 and a row)")
