"""The sampler (contract/sampling.py) against its written rules: the penalties by hand and against
transformers, greedy as the argmax, seeded draws that repeat and resume, the inverse-CDF rule drawn
exactly, and the frequencies of many draws against the truncated softmax by a chi-square test."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import numpy as np
import pytest

from contract.inputs import InputError
from contract.sampling import HEAD_FLOOR, LogitsError, Sampler, SamplingParams, draw


def reference_penalized(logits, prompt=(), generated=(), repetition=1.0, presence=0.0, frequency=0.0):
    """The penalties from SamplingParams' field comments, one token at a time."""
    scores = np.asarray(logits, np.float64).copy()
    for token in set(prompt) | set(generated):
        scores[token] = scores[token] / repetition if scores[token] > 0 else scores[token] * repetition
    for token, count in collections.Counter(generated).items():
        scores[token] -= frequency * count + presence
    return scores


def log_softmax(scores):
    shifted = scores - scores.max()
    return shifted - math.log(np.exp(shifted).sum())


def reference_kept(probabilities, top_k=None, top_p=None, min_p=None):
    """The kept tokens' mask by a full sort: top_k, then top_p over what top_k kept, then min_p."""
    order = np.lexsort((np.arange(probabilities.size), -probabilities))  # descending, ties by id
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
    np.testing.assert_allclose(sampler.penalized(logits), expected, rtol=0, atol=1e-12)

    choice = sampler.pick(logits)
    assert choice.token == 0  # 3.0 was the raw argmax: the penalties moved it
    expected_logprobs = log_softmax(expected)
    assert choice.logprob == pytest.approx(expected_logprobs[0], abs=1e-12)
    assert [token for token, _ in choice.top] == [0, 2, 3, 5, 4, 1]  # 2 and 3 tie at 0.5: lower id first
    np.testing.assert_allclose([lp for _, lp in choice.top], expected_logprobs[[0, 2, 3, 5, 4, 1]], atol=1e-12)
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
        assert choice.logprob == pytest.approx(log_softmax(expected)[choice.token], abs=1e-9)
        assert choice.top[0][0] == choice.token and len(choice.top) == 3


def test_greedy_ties_go_to_the_lowest_id_and_ignore_seed_and_truncation():
    logits = np.array([0.0, 5.0, 1.0, 5.0, 5.0], np.float32)
    for seed in range(5):
        params = SamplingParams(seed=seed, top_k=1, top_p=0.1, min_p=0.9)
        assert Sampler(params).pick(logits).token == 1


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
    np.testing.assert_allclose(rebuilt.penalized(steps[0]), expected, rtol=0, atol=1e-12)

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
    # `draw` is what Sampler.pick calls once the uniform is derived from (seed, position), which the
    # inverse-CDF test above pins; called here directly, 20,000 draws take ~0.5 s instead of ~2.5 s
    params = FREQUENCIES[name]
    probabilities = softmax(FREQUENCY_LOGITS.astype(np.float64), params.temperature)
    kept = reference_kept(probabilities, params.top_k, params.top_p, params.min_p)
    expected = np.where(kept, probabilities, 0.0) / probabilities[kept].sum()
    weights = probabilities / probabilities.max()  # draw's input: unnormalized, the top token's weight 1
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


def test_ties_at_the_top_k_boundary_keep_the_lowest_ids():
    logits = np.array([1.0, 0.0, 1.0, 1.0, 1.0], np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=7))
    assert {sampler.pick(logits).token for _ in range(200)} == {0, 2}


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
def test_check_names_the_field_the_range_and_the_value(field, value, message):
    params = dataclasses.replace(SamplingParams(), **{field: value})
    with pytest.raises(InputError) as raised:
        params.check()
    assert raised.value.input_name == field
    assert str(raised.value) == f"input '{field}': {message}"
    with pytest.raises(InputError):
        Sampler(params)


def test_the_defaults_and_openai_limits_pass():
    SamplingParams().check()
    SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=-2, frequency_penalty=2).check()
    SamplingParams(repetition_penalty=1e-3, logprobs=20, seed=2**63 - 1).check()


def test_non_finite_logits_are_refused_naming_how_many():
    logits = np.zeros(10, np.float32)
    logits[[2, 7]] = [np.nan, np.inf]
    with pytest.raises(LogitsError, match="got 2 NaN or Inf of 10") as raised:
        Sampler(SamplingParams(temperature=1.0, seed=0)).pick(logits)
    assert isinstance(raised.value, ValueError)


def test_a_prompt_id_outside_the_vocabulary_is_refused():
    with pytest.raises(InputError, match=r"input 'prompt_ids': token ids must lie in \[0, 8\).*got 8"):
        Sampler(SamplingParams(), prompt_ids=[1, 8]).pick(np.zeros(8, np.float32))
    with pytest.raises(InputError, match="input 'prompt_ids': expected token ids >= 0, got -3 at index 1"):
        Sampler(SamplingParams(), prompt_ids=[1, -3])
