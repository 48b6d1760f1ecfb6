"""The batch sampler (serving/engine/sampler.py) against its written rules, as tests/contract/test_sampling.py
proves the per-row one: the penalties by hand and against transformers, greedy as the argmax, seeded draws
that repeat and resume, the inverse-CDF rule drawn exactly, the frequencies of many draws against the
truncated softmax by a chi-square test; then a batch against its rows one by one, the prompt's scores, and
the time of a 64-row step."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time

import numpy as np
import pytest

from contract import generation
from contract.inputs import InputError
from contract.sampling import LogitsError, SamplingParams
from serving.engine import sampler as sampler_module
from serving.engine.sampler import HEAD_FLOOR, Sampler, draw, sample, score_prompt

# float32's bound on a logprob: each float32 operation rounds to within 2**-24 (6e-8) relative; a logprob is
# a shift by the row's max, the log of a pairwise sum (~log2(vocab) roundings of the sum's relative size,
# which the log turns into an absolute error: the vocabulary's size hardly counts) and a subtraction, on values
# under ~30 here, so it moves by at most ~30 * 4 * 6e-8 ~ 7e-6 (measured: 5e-7 against the float64 sampler)
LOGPROB_TOLERANCE = 1e-5
# a penalized score is the float64 rule's value rounded to float32, twice at most (after the repetition
# penalty, after frequency and presence): within 2 float32 steps of values under 16, 4e-6
SCORE_TOLERANCE = 4e-6


def reference_penalized(logits, prompt=(), generated=(), repetition=1.0, presence=0.0, frequency=0.0):
    """The penalties from SamplingParams' field comments, one token at a time, in float64."""
    scores = np.asarray(logits, np.float64).copy()
    for token in set(prompt) | set(generated):
        scores[token] = scores[token] / repetition if scores[token] > 0 else scores[token] * repetition
    for token, count in collections.Counter(generated).items():
        scores[token] -= frequency * count + presence
    return scores


def log_softmax(scores):
    shifted = scores - scores.max()
    return shifted - math.log(np.exp(shifted).sum())


def reference_top(scores, n):
    """The n most likely ids by a full sort, descending, ties by id."""
    return np.lexsort((np.arange(scores.size), -scores))[:n]


def reference_kept(probabilities, top_k=None, top_p=None, min_p=None):
    """The kept tokens' mask by a full sort: top_k, then top_p over what top_k kept, then min_p."""
    order = reference_top(probabilities, probabilities.size)
    kept = np.zeros(probabilities.size, bool)
    kept[order[: top_k or probabilities.size]] = True
    if top_p is not None:
        ranked = probabilities[order] * kept[order]
        reached = np.cumsum(ranked) / ranked.sum() >= top_p - 1e-12  # 45 of 50 equal tokens reach 0.9
        kept[order[np.argmax(reached) + 1 :]] = False
    if min_p is not None:
        kept &= probabilities >= min_p * probabilities.max()
    return kept


def reference_draw(probabilities, kept, uniform):
    """The documented inverse CDF: kept tokens of at least HEAD_FLOOR x the top in descending probability
    (ties by id), then the other kept tokens in id order."""
    ids = np.arange(probabilities.size)
    head = kept & (probabilities >= HEAD_FLOOR * probabilities.max())
    head_ids = ids[head][np.lexsort((ids[head], -probabilities[head]))]
    order = np.concatenate([head_ids, ids[kept & ~head]])
    cumulative = np.cumsum(probabilities[order])
    return int(order[np.searchsorted(cumulative, uniform * cumulative[-1], "right")])


def softmax(scores, temperature=1.0):
    weights = np.exp((scores - scores.max()) / temperature)
    return weights / weights.sum()


# -- penalties and greedy ------------------------------------------------------------------------


def test_the_penalties_give_the_hand_computed_logits():
    # repetition 2 over prompt + generated {0, 1, 3}: 2.0 -> 1.0, -1.0 -> -2.0, 3.0 -> 1.5;
    # then generated counts {1: 1, 3: 2}: id 1 -= 0.25 * 1 + 0.5 -> -2.75, id 3 -= 0.25 * 2 + 0.5 -> 0.5
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, logprobs=6)
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 0.0], np.float32)
    sampler = Sampler(params, prompt_ids=[0, 1], generated=[1, 3, 3])
    expected = np.array([1.0, -2.75, 0.5, 0.5, -2.0, 0.0])
    penalized = sampler.penalized(logits)
    assert penalized.dtype == np.float32
    np.testing.assert_array_equal(penalized, expected)  # exact: each value is a float32 the rule reaches exactly

    choice = sampler.pick(logits)
    assert choice.token == 0  # 3.0 was the raw argmax: the penalties moved it
    expected_logprobs = log_softmax(expected)
    assert choice.logprob == pytest.approx(expected_logprobs[0], abs=LOGPROB_TOLERANCE)
    assert [token for token, _ in choice.top] == [0, 2, 3, 5, 4, 1]  # 2 and 3 tie at 0.5: lower id first
    np.testing.assert_allclose(
        [lp for _, lp in choice.top], expected_logprobs[[0, 2, 3, 5, 4, 1]], rtol=0, atol=LOGPROB_TOLERANCE
    )
    assert sampler.generated == [1, 3, 3, 0]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_greedy_picks_the_argmax_of_the_penalized_logits(dtype):
    rng = np.random.default_rng(3)
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.6, logprobs=3)
    for _ in range(20):
        logits = rng.normal(0, 2, 64).astype(dtype)
        prompt, generated = rng.integers(0, 64, 10).tolist(), rng.integers(0, 64, 6).tolist()
        choice = Sampler(params, prompt, generated).pick(logits)
        expected = reference_penalized(logits, prompt, generated, 1.3, 0.4, 0.6)
        assert choice.token == int(np.argmax(expected))
        assert choice.logprob == pytest.approx(log_softmax(expected)[choice.token], abs=LOGPROB_TOLERANCE)
        assert choice.top[0][0] == choice.token and len(choice.top) == 3


def test_greedy_ties_go_to_the_lowest_id_and_ignore_seed_and_truncation():
    logits = np.array([0.0, 5.0, 1.0, 5.0, 5.0], np.float32)
    for seed in range(5):
        params = SamplingParams(seed=seed, top_k=1, top_p=0.1, min_p=0.9)
        assert Sampler(params).pick(logits).token == 1


def test_greedy_rows_never_draw(monkeypatch):
    drawn = []
    monkeypatch.setattr(sampler_module, "draw", lambda *args: drawn.append(args) or 0)
    logits = np.random.default_rng(4).normal(0, 2, (3, 100)).astype(np.float32)
    rows = [Sampler(SamplingParams(seed=seed, top_p=0.5)) for seed in range(3)]
    assert [choice.token for choice in sample(logits, rows)] == np.argmax(logits, axis=1).tolist()
    assert not drawn


def test_the_repetition_penalty_matches_transformers():
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(5)
    logits = rng.normal(0, 3, 40).astype(np.float32)
    prompt = [3, 7, 7, 12, 39, 0]
    expected = RepetitionPenaltyLogitsProcessor(penalty=1.7)(torch.tensor([prompt]), torch.tensor(logits[None]))[0]
    sampler = Sampler(SamplingParams(repetition_penalty=1.7), prompt_ids=prompt)
    np.testing.assert_allclose(sampler.penalized(logits), expected.numpy(), rtol=1e-6, atol=1e-6)
    assert sampler.pick(logits).token == int(expected.argmax())


# -- seeds ----------------------------------------------------------------------------------------


def generate(sampler, steps):
    return [sampler.pick(logits).token for logits in steps]


def test_a_seeded_sampler_repeats_and_one_rebuilt_midway_continues_identically():
    rng = np.random.default_rng(11)
    steps = [rng.normal(0, 2, 500).astype(np.float32) for _ in range(30)]
    params = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.2, frequency_penalty=0.3, seed=1234)
    prompt = [4, 8, 15, 16, 23, 42]
    original = generate(Sampler(params, prompt), steps)
    assert generate(Sampler(params, prompt), steps) == original

    rebuilt = Sampler(params, prompt, generated=original[:12])  # recovery on another replica
    assert generate(rebuilt, steps[12:]) == original[12:]
    assert rebuilt.generated == original
    # the penalties' state, grown token by token, is what the rule gives over the whole sequence
    expected = reference_penalized(steps[0], prompt, original, repetition=1.2, frequency=0.3)
    np.testing.assert_allclose(rebuilt.penalized(steps[0]), expected, rtol=0, atol=SCORE_TOLERANCE)

    other_seed = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.2, frequency_penalty=0.3, seed=99)
    assert generate(Sampler(other_seed, prompt), steps) != original


def test_without_a_seed_a_sampler_draws_one_and_reports_it():
    rng = np.random.default_rng(12)
    steps = [rng.normal(0, 2, 300).astype(np.float32) for _ in range(20)]
    unseeded = Sampler(SamplingParams(temperature=1.0))
    assert 0 <= unseeded.seed < 2**63
    assert Sampler(SamplingParams(temperature=1.0)).seed != unseeded.seed
    tokens = generate(unseeded, steps)
    assert generate(Sampler(SamplingParams(temperature=1.0, seed=unseeded.seed)), steps) == tokens


TRUNCATIONS = {
    "plain": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.3, top_k=300),
    "top_p": SamplingParams(temperature=1.0, top_p=0.9),
    "min_p": SamplingParams(temperature=0.8, min_p=0.01),
    "all": SamplingParams(temperature=1.1, top_k=2500, top_p=0.97, min_p=0.002),
}


def vocabulary_logits(shape):
    """20,000 logits, past the sampler's shortcuts (sampled thresholds, selection instead of a sort).
    `spiked`: a few likely tokens over a long tail, so that draws land in both the descending head and
    the id-ordered tail; `flat`: thousands of tokens near the top, so that the head is selected, not sorted."""
    rng = np.random.default_rng(13)
    if shape == "flat":
        return rng.normal(0, 1.0, 20_000)
    logits = rng.normal(0, 1.5, 20_000)
    logits[rng.choice(20_000, 5, replace=False)] += 8.0
    return logits


@pytest.mark.parametrize("shape", ["spiked", "flat"])
@pytest.mark.parametrize("name", TRUNCATIONS)
def test_a_draw_is_the_documented_inverse_cdf_of_its_seed_and_position(name, shape):
    # the reference is float64 and the sampler float32: they agree unless a uniform lands within ~1e-6 of
    # the mass of a token's CDF boundary, or a truncation's threshold that close to a token (none here)
    logits = vocabulary_logits(shape)
    params = TRUNCATIONS[name]
    probabilities = softmax(logits, params.temperature)
    kept = reference_kept(probabilities, params.top_k, params.top_p, params.min_p)
    for seed in range(25):
        position = seed % 3
        sampler = Sampler(dataclasses.replace(params, seed=seed), generated=[0] * position)
        uniform = np.random.default_rng([seed, position]).random()
        assert sampler.pick(logits.astype(np.float32)).token == reference_draw(probabilities, kept, uniform)


# -- frequencies ----------------------------------------------------------------------------------

# chi-square critical values at p = 0.001 by degrees of freedom, from the standard table (NIST/SEMATECH
# e-Handbook 1.3.6.7.4; checked against mpmath's regularized upper incomplete gamma to 4 digits)
CHI_SQUARE_CRITICAL = {
    1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458,
    7: 24.322, 8: 26.124, 9: 27.877, 10: 29.588, 11: 31.264,
}  # fmt: skip


def chi_square(counts, expected_probabilities):
    expected = expected_probabilities * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 12 tokens whose ids do not follow their order, none below 80 expected draws; no truncation cuts near a
# token: top_p 0.8 (T = 1.3) is reached at a cumulative 0.848 (0.793 before it), min_p 0.1 (T = 0.7)
# falls between ratios 0.135 and 0.088 to the top, top_k 5 (T = 1) between probabilities 0.080 and 0.059
FREQUENCY_LOGITS = np.array([0.3, 1.9, -0.6, 1.2, 0.9, -1.0, 1.5, 0.1, 2.0, -0.3, 0.6, -0.8], np.float32)
FREQUENCIES = {
    "plain T=0.7": SamplingParams(temperature=0.7),
    "top_k=5": SamplingParams(temperature=1.0, top_k=5),
    "top_p=0.8": SamplingParams(temperature=1.3, top_p=0.8),
    "min_p=0.1": SamplingParams(temperature=0.7, min_p=0.1),
}


@functools.cache
def seeded_uniforms():
    """The uniforms of 20,000 seeds at position 0, as Sampler derives them."""
    return [np.random.default_rng([seed, 0]).random() for seed in range(20_000)]


@pytest.mark.parametrize("name", FREQUENCIES)
def test_draw_frequencies_match_the_truncated_softmax(name):
    # `draw` is what `sample` calls for a sampled row once the uniform is derived from (seed, position),
    # which the inverse-CDF test above pins; called here directly on float32 weights, as `sample` gives them
    params = FREQUENCIES[name]
    probabilities = softmax(FREQUENCY_LOGITS.astype(np.float64), params.temperature)
    kept = reference_kept(probabilities, params.top_k, params.top_p, params.min_p)
    expected = np.where(kept, probabilities, 0.0) / probabilities[kept].sum()
    weights = (probabilities / probabilities.max()).astype(np.float32)  # draw's input: the top token's weight 1
    counts = np.bincount([draw(weights, u, params) for u in seeded_uniforms()], minlength=FREQUENCY_LOGITS.size)

    assert counts[~kept].sum() == 0, f"masked tokens drawn: {np.flatnonzero(counts * ~kept)}"
    statistic = chi_square(counts[kept], expected[kept])
    assert statistic < CHI_SQUARE_CRITICAL[kept.sum() - 1], (statistic, counts, expected)
    # the test can tell: the untruncated softmax at T = 1 is rejected by the same counts
    untruncated = softmax(FREQUENCY_LOGITS.astype(np.float64))
    assert chi_square(counts, untruncated) > CHI_SQUARE_CRITICAL[FREQUENCY_LOGITS.size - 1]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5)])
def test_tied_logits_are_ordered_by_id(params):
    # 300 tokens on three values: the draw's order within a tie, and where top_p cuts one, go by id
    logits = np.random.default_rng(17).choice([0.0, 0.5, 1.0], 300)
    probabilities = softmax(logits)
    kept = reference_kept(probabilities, top_p=params.top_p)
    for seed in range(40):
        uniform = np.random.default_rng([seed, 0]).random()
        token = Sampler(dataclasses.replace(params, seed=seed)).pick(logits.astype(np.float32)).token
        assert token == reference_draw(probabilities, kept, uniform)


def test_a_draw_in_the_light_tail_follows_id_order_across_its_blocks():
    # 5 heavy tokens over 19,995 below HEAD_FLOOR that weigh ~40% together: many uniforms land in the tail,
    # whose running sum the sampler finds block by block (1024 ids a block) instead of in one cumsum
    rng = np.random.default_rng(19)
    logits = np.log(1e-4) + rng.normal(0, 0.5, 20_000)
    logits[rng.choice(20_000, 5, replace=False)] = 0.0
    probabilities = softmax(logits)
    kept = np.ones(logits.size, bool)
    weights = np.exp(logits - logits.max()).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    uniforms = np.random.default_rng(20).random(300)
    tokens = [draw(weights, u, params) for u in uniforms]
    assert tokens == [reference_draw(probabilities, kept, u) for u in uniforms]
    assert len({token // 1024 for token in tokens}) > 10  # draws in many of the tail's blocks


def test_ties_at_the_top_k_boundary_keep_the_lowest_ids():
    logits = np.array([1.0, 0.0, 1.0, 1.0, 1.0], np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=7))
    assert {sampler.pick(logits).token for _ in range(200)} == {0, 2}


# -- the batch ------------------------------------------------------------------------------------

# every path a row can take: greedy with and without penalties, each truncation, T = 1 (the exp's own
# weights) and a T too small for float32 (only the top remains), logprobs 0, 5 and 20
MIXED = [
    SamplingParams(),
    SamplingParams(logprobs=5, repetition_penalty=1.3, frequency_penalty=0.4),
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.3, top_k=300, seed=2, logprobs=5),
    SamplingParams(temperature=1.0, top_p=0.9, seed=3, frequency_penalty=0.5, presence_penalty=0.3),
    SamplingParams(temperature=0.8, min_p=0.01, seed=4, logprobs=5),
    SamplingParams(temperature=1.1, top_k=2500, top_p=0.97, min_p=0.002, seed=5, repetition_penalty=1.2, logprobs=20),
    SamplingParams(temperature=1e-50, seed=6, logprobs=5),
]


def mixed_rows(vocab):
    """Samplers of MIXED with prompts of their own and 0 to 7 tokens generated (each at its own position),
    and their prompts."""
    rng = np.random.default_rng(21)
    prompts = [rng.integers(0, vocab, 20).tolist() for _ in MIXED]
    generated = [rng.integers(0, vocab, at).tolist() for at in range(len(MIXED))]
    return [Sampler(*row) for row in zip(MIXED, prompts, generated, strict=True)], prompts


def penalized(logits, sampler, prompt):
    """The float64 rule's penalized logits for `sampler` now."""
    params = sampler.params
    penalties = params.repetition_penalty, params.presence_penalty, params.frequency_penalty
    return reference_penalized(logits, prompt, sampler.generated, *penalties)


def test_a_batch_picks_what_its_rows_pick_one_by_one():
    vocab = 20_000
    (batch, prompts), (alone, _) = mixed_rows(vocab), mixed_rows(vocab)
    rng = np.random.default_rng(22)
    for _ in range(4):  # each step moves every row's position and penalties on
        logits = rng.normal(0, 2, (len(MIXED), vocab)).astype(np.float32)
        expected = [penalized(*row) for row in zip(logits, alone, prompts, strict=True)]
        together = sample(logits, batch)
        for choice, row, sampler, scores in zip(together, logits, alone, expected, strict=True):
            one = sampler.pick(row)
            assert choice.token == one.token
            assert choice.logprob == pytest.approx(one.logprob, abs=LOGPROB_TOLERANCE)
            assert [token for token, _ in choice.top] == [token for token, _ in one.top]
            np.testing.assert_allclose([lp for _, lp in choice.top], [lp for _, lp in one.top], atol=LOGPROB_TOLERANCE)
            # and both are the float64 rule's logprobs of the penalized logits, the top ones by a full sort
            logprobs, top = log_softmax(scores), reference_top(scores, sampler.params.logprobs)
            assert choice.logprob == pytest.approx(logprobs[choice.token], abs=LOGPROB_TOLERANCE)
            assert [token for token, _ in choice.top] == top.tolist()
            np.testing.assert_allclose([lp for _, lp in choice.top], logprobs[top], atol=LOGPROB_TOLERANCE)
    assert [sampler.generated for sampler in batch] == [sampler.generated for sampler in alone]
    assert batch[0].generated[-4:] != batch[2].generated[-4:]  # the rows went their own ways


@pytest.mark.parametrize("rows_at_once", [1, 5])
def test_a_batch_in_chunks_of_rows_gives_what_it_gives_at_once(monkeypatch, rows_at_once):
    vocab = 3000
    rng = np.random.default_rng(26)
    logits = rng.normal(0, 2, (12, vocab)).astype(np.float32)
    following = rng.integers(0, vocab, 12)

    def run():
        rows = [Sampler(dataclasses.replace(MIXED[at % len(MIXED)], seed=at), [at]) for at in range(12)]
        return sample(logits, rows), score_prompt(logits, following, 4)

    monkeypatch.setattr(sampler_module, "_CHUNK_BYTES", 2**30)
    whole, whole_scores = run()
    monkeypatch.setattr(sampler_module, "_CHUNK_BYTES", 4 * vocab * rows_at_once)
    assert len(sampler_module._chunks(12, vocab)) == math.ceil(12 / rows_at_once)
    chunked, chunked_scores = run()
    assert chunked == whole
    for name in generation_outputs():
        np.testing.assert_array_equal(chunked_scores[name], whole_scores[name])


def test_an_error_in_a_later_chunk_names_its_row_and_moves_no_sampler(monkeypatch):
    monkeypatch.setattr(sampler_module, "_CHUNK_BYTES", 4 * 10 * 2)  # 2 rows of 10 logits a chunk
    logits = np.random.default_rng(27).normal(0, 1, (6, 10)).astype(np.float32)
    rows = [Sampler(SamplingParams(temperature=1.0, seed=at)) for at in range(6)]
    logits[5, 4] = np.nan
    with pytest.raises(LogitsError, match=r"got 1 NaN or Inf of 10 \(row 5 of the batch\)$"):
        sample(logits, rows)
    logits[5, 4] = 0.0
    rows[3] = Sampler(SamplingParams(repetition_penalty=1e-38), prompt_ids=[2])
    logits[3, 2] = 10.0
    with pytest.raises(InputError, match=r"input 'repetition_penalty': .*got 1e-38 \(row 3 of the batch\)$"):
        sample(logits, rows)
    assert all(not row.generated for row in rows)


def test_the_alternatives_are_the_top_by_a_full_sort_where_the_sampled_guess_misses():
    # 20,000 logits on few values (ties at the boundary), and a row whose only large values sit where the
    # threshold's sample looks (every 19th id): the guess lets 5 through where 20 are asked, and is redone
    rng = np.random.default_rng(23)
    logits = rng.choice(np.linspace(-3, 3, 40), (3, 20_000)).astype(np.float32)
    logits[2] = rng.normal(0, 0.1, 20_000)
    logits[2, ::19] += 10 + np.arange(logits[2, ::19].size) * 0.01
    rows = [Sampler(SamplingParams(logprobs=20)) for _ in range(3)]
    for row, choice in zip(logits, sample(logits, rows), strict=True):
        assert [token for token, _ in choice.top] == reference_top(row.astype(np.float64), 20).tolist()


def test_a_batch_of_64_rows_of_32000_tokens(capsys):
    rng = np.random.default_rng(24)
    logits = rng.normal(0, 3, (64, 32_000)).astype(np.float32)
    greedy = [Sampler(SamplingParams(logprobs=5), rng.integers(0, 32_000, 50).tolist()) for _ in range(32)]
    nucleus = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1)
    sampled = [Sampler(dataclasses.replace(nucleus, seed=seed), rng.integers(0, 32_000, 50)) for seed in range(32)]
    sample(logits, greedy + sampled)  # warm
    started = time.perf_counter()
    choices = sample(logits, greedy + sampled)
    seconds = time.perf_counter() - started
    assert len(choices) == 64 and all(0 <= choice.token < 32_000 for choice in choices)
    with capsys.disabled():
        print(f"\nsample(): 64 rows x 32,000 tokens (32 greedy, 32 top_p 0.9): {seconds * 1e3:.2f} ms")


# -- the prompt's scores --------------------------------------------------------------------------


@pytest.mark.parametrize("top", [0, 3, 12])
def test_score_prompt_is_each_positions_score(top):
    rng = np.random.default_rng(25)
    vocab = 10 if top == 12 else 5000  # 12 > vocab: the columns past it are padded
    logits = rng.normal(0, 3, (7, vocab)).astype(np.float32)
    following = rng.integers(0, vocab, 7)
    scored = score_prompt(logits, following, top)
    logprob, ids, top_logprobs = (scored[name] for name in generation_outputs())
    assert logprob.shape == (8,) and ids.shape == top_logprobs.shape == (8, top)
    assert logprob.dtype == top_logprobs.dtype == np.float32 and ids.dtype == np.int64
    assert np.isnan(logprob[0]) and (ids[0] == -1).all() and np.isnan(top_logprobs[0]).all()
    for at, (row, token) in enumerate(zip(logits, following, strict=True), start=1):
        one = Sampler.scored(row, int(token), top)
        assert logprob[at] == pytest.approx(one.logprob, abs=LOGPROB_TOLERANCE)
        assert logprob[at] == pytest.approx(log_softmax(row.astype(np.float64))[token], abs=LOGPROB_TOLERANCE)
        kept = min(top, vocab)
        assert ids[at, :kept].tolist() == [token for token, _ in one.top]
        np.testing.assert_allclose(top_logprobs[at, :kept], [lp for _, lp in one.top], atol=LOGPROB_TOLERANCE)
        assert (ids[at, kept:] == -1).all() and np.isnan(top_logprobs[at, kept:]).all()


def generation_outputs():
    return generation.PROMPT_LOGPROB, generation.PROMPT_TOP_TOKEN_IDS, generation.PROMPT_TOP_LOGPROBS


def test_a_one_token_prompt_scores_nothing_but_its_first_entry():
    scored = score_prompt(np.zeros((0, 50), np.float32), np.zeros(0, np.int64), 2)
    logprob, ids, top_logprobs = (scored[name] for name in generation_outputs())
    assert np.isnan(logprob).all() and logprob.shape == (1,)
    assert ids.tolist() == [[-1, -1]] and np.isnan(top_logprobs).all()


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.5, "expected a finite number >= 0, got -0.5"),
        ("temperature", math.inf, "expected a finite number >= 0, got inf"),
        ("top_k", -1, "expected None or an integer >= 0, got -1"),
        ("top_p", 0.0, "expected None or a number in (0, 1], got 0.0"),
        ("min_p", 1.5, "expected None or a number in [0, 1], got 1.5"),
        ("repetition_penalty", 0.0, "expected a finite number > 0, got 0.0"),
        ("presence_penalty", 2.5, "expected a number in [-2, 2], got 2.5"),
        ("frequency_penalty", math.nan, "expected a number in [-2, 2], got nan"),
        ("logprobs", 21, "expected an integer in [0, 20], got 21"),
        ("seed", 2**63, "expected None or an integer in [0, 2**63), got 9223372036854775808"),
        ("seed", "7", "expected None or an integer in [0, 2**63), got '7'"),
    ],
)
def test_a_sampler_refuses_params_naming_the_field_the_range_and_the_value(field, value, message):
    params = dataclasses.replace(SamplingParams(), **{field: value})
    with pytest.raises(InputError) as raised:
        Sampler(params)
    assert raised.value.input_name == field
    assert str(raised.value) == f"input '{field}': {message}"


def test_the_defaults_and_openai_limits_pass():
    Sampler(SamplingParams())
    Sampler(SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=-2, frequency_penalty=2))
    Sampler(SamplingParams(repetition_penalty=1e-3, logprobs=20, seed=2**63 - 1))


def test_non_finite_logits_are_refused_naming_how_many_and_the_row():
    logits = np.zeros(10, np.float32)
    logits[[2, 7]] = [np.nan, -np.inf]
    with pytest.raises(LogitsError, match=r"got 2 NaN or Inf of 10$") as raised:
        Sampler(SamplingParams(temperature=1.0, seed=0)).pick(logits)
    assert isinstance(raised.value, ValueError)
    batch = np.zeros((4, 10), np.float32)
    batch[1, 3], batch[3] = np.inf, np.nan
    rows = [Sampler(SamplingParams()) for _ in range(4)]
    with pytest.raises(LogitsError, match=r"got 1 NaN or Inf of 10 \(row 1 of the batch\)$"):
        sample(batch, rows)
    assert all(not row.generated for row in rows)  # nothing advanced


def test_logits_of_the_wrong_shape_or_dtype_are_refused():
    with pytest.raises(LogitsError, match=r"expected logits of shape \(vocab,\) and a float dtype, got int64 \(3,\)"):
        Sampler(SamplingParams()).pick(np.arange(3))
    with pytest.raises(LogitsError, match=r"expected logits of shape \(2, vocab\).*got float32 \(3, 5\)"):
        sample(np.zeros((3, 5), np.float32), [Sampler(SamplingParams()), Sampler(SamplingParams())])


def test_an_id_outside_the_vocabulary_is_refused_naming_its_input_and_row():
    with pytest.raises(InputError, match=r"input 'prompt_ids': token ids must lie in \[0, 8\).*got 8$"):
        Sampler(SamplingParams(), prompt_ids=[1, 8]).pick(np.zeros(8, np.float32))
    with pytest.raises(InputError, match="input 'prompt_ids': expected token ids >= 0, got -3 at index 1"):
        Sampler(SamplingParams(), prompt_ids=[1, -3])
    rows = [Sampler(SamplingParams()), Sampler(SamplingParams(), prompt_ids=[1], generated=[9])]
    with pytest.raises(InputError, match=r"input 'generated': .*\[0, 8\).*got 9 \(row 1 of the batch\)"):
        sample(np.zeros((2, 8), np.float32), rows)
    with pytest.raises(InputError, match=r"input 'prompt_ids': token ids must lie in \[0, 8\).*got 8"):
        score_prompt(np.zeros((2, 8), np.float32), np.array([3, 8]), 1)


def test_a_repetition_penalty_that_leaves_float32s_range_is_refused():
    # 10 / 1e-38 = 1e39: finite in float64, past float32's 3.4e38; the penalty passes the params' own check
    sampler = Sampler(SamplingParams(repetition_penalty=1e-38), prompt_ids=[1])
    with pytest.raises(InputError, match=r"input 'repetition_penalty': .*keeps logits finite, got 1e-38"):
        sampler.pick(np.array([0.0, 10.0, 1.0], np.float32))


def test_logit_bias_is_added_after_the_penalties_and_travels_as_a_parameter():
    logits = np.random.default_rng(3).standard_normal(50).astype(np.float32)
    best = int(np.argmax(logits))
    banned = Sampler(SamplingParams(logit_bias=((best, -100.0),))).pick(logits)
    assert banned.token != best and banned.token == int(np.argsort(logits)[-2])
    forced = Sampler(SamplingParams(logit_bias=((7, 100.0),), logprobs=1)).pick(logits)
    biased = logits.astype(np.float64)
    biased[7] += 100
    expected = biased[7] - np.log(np.exp(biased - biased.max()).sum()) - biased.max()
    assert forced.token == 7 and forced.logprob == pytest.approx(expected, abs=1e-5)
    asked = generation.GenerationRequest(sampling=SamplingParams(logit_bias=((7, 2.5), (3, -1.0))))
    assert generation.GenerationRequest.from_parameters(asked.to_parameters()) == asked
    with pytest.raises(InputError, match="logit_bias"):
        SamplingParams(logit_bias=((7, 101.0),)).check()
    with pytest.raises(InputError, match="each id once"):
        SamplingParams(logit_bias=((7, 1.0), (7, 2.0))).check()
    outside = generation.GenerationRequest(sampling=SamplingParams(logit_bias=((60, 1.0),)))
    with pytest.raises(InputError, match=r"logit_bias.*\[0, 50\)"):
        outside.check(vocab_size=50, max_seq_len=64)
