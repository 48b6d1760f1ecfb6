"""Choosing the next token of every generation of a step at once, greedy or sampled: numpy only, float32.

The engine's loop calls `sample(logits, rows)` once per step: the step's logits (B, vocab), one row per
running generation, and each generation's `Sampler` (its params, its prompt's ids, what it generated so
far). The rules, and their order, are contract/sampling.py's (its module text); here they run over the
rows together: the penalties as a sparse update of the ids each row has seen, greedy rows as one argmax,
the draw (`draw`) per sampled row.

Determinism: with a seed, the i-th token of a sequence (i = how many it has generated before) uses
`np.random.default_rng([seed, i]).random()` and nothing else random, so a sampler rebuilt from (prompt,
generated so far) on another replica, after a restart or a recovery, continues as the original would have.

Why a batch, in float32: a step of 16 to 64 generations must sample in well under a millisecond a row, and
every pass over a batch's logits is bound by memory: float32 halves what each reads and writes (an exp over
(64, 32000) logits: 0.73 ms in float32, 1.27 ms in float64 on our machines). What reads the whole vocabulary
(the row maxima, the shift, the exp, the log-normalizers, the chosen tokens' and the alternatives' logprobs) is
one numpy operation over the batch; rows are looped over only for work of their own (their penalties, their
seeded draw). float32 moves a logprob by ~1e-6: a few roundings (2**-24 relative) of values under ~30, and the
normalizer's pairwise sum, whose relative error becomes an absolute one through the log, so the vocabulary's
size hardly counts. The draw's running sums (its CDF) stay in float64: a float32 cumsum along a 20,000-token
tail drifts by ~2e-6 of the mass, a tenth of a tail token's width (one tail draw in ~10 would move).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Sequence

import numpy as np

from contract import generation
from contract.inputs import InputError
from contract.sampling import LogitsError, SamplingParams

HEAD_FLOOR = 1e-3  # the draw's CDF runs in descending probability over tokens within this ratio of the top
_SORT_BELOW = 256  # a selection sorts what is left once this few remain (a stable argsort: 8 µs; of 2048, 55)
_BLOCK = 1024  # a tail's running sum is found block by block
_CHUNK_BYTES = 2**21  # a batch is worked through in chunks of rows about the size of a core's L2 cache
_SAMPLE = 1024  # values sampled to guess a threshold above which the n largest lie
_TOP_P_SLACK = 1e-12  # a prefix whose float64 sum misses top_p by rounding alone still reaches it
# a temperature that float32 would round to 0 (dividing 0 by it gives NaN) is its smallest positive number:
# the same limit, every token but the top at weight 0
_TINY = float(np.finfo(np.float32).smallest_subnormal)


@dataclasses.dataclass(frozen=True)
class Pick:
    """One picked token: its logprob and the most likely alternatives', all by log_softmax of the
    model's logits after penalties (before temperature and truncation, as OpenAI reports them)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the `logprobs` most likely (id, logprob), best first, ties by id


class Sampler:
    """One sequence's sampler: its params, the prompt's ids (for the repetition penalty) and what it generated.

    `seed` is the params' seed, or one drawn once here when they give none (the server reports it, so a
    client can repeat the sequence). The i-th draw's randomness comes from (seed, i), i = len(generated)
    before it: a sampler rebuilt with the prompt and the tokens generated so far continues the sequence."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (), generated: Sequence[int] = ()) -> None:
        params.check()
        self.params = params
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(63)
        self._seen = _SeenIds(_token_ids("prompt_ids", prompt_ids))
        self._prompt_largest = self._seen.largest
        self._counts = _Counts()
        self._generated: list[int] = []
        for token in _token_ids("generated", generated).tolist():
            self._append(token)

    @property
    def generated(self) -> list[int]:
        return list(self._generated)

    def pick(self, logits: np.ndarray) -> Pick:
        """The next token for `logits` (vocab,) float32 or float16 (float64 is rounded to float32); appends it
        to `generated`. A batch of one: `sample` is the whole rule."""
        return sample(_one_row(logits), [self])[0]

    def penalized(self, logits: np.ndarray) -> np.ndarray:
        """`logits` (vocab,) in float32 (a new array) after the repetition, frequency and presence penalties."""
        scores = _float32_copy(_one_row(logits))[0]
        self._penalize(scores)
        return scores

    @staticmethod
    def scored(logits: np.ndarray, token: int, top: int) -> Pick:
        """`token`'s logprob under `logits` (vocab,) as the model gives it (no penalties: a prompt token was
        not picked) and the `top` most likely (id, logprob): how a prompt is scored."""
        logprobs, ids, top_logprobs = _score_rows(_float32_copy(_one_row(logits)), [token], top)
        alternatives = tuple(zip(ids[0].tolist(), top_logprobs[0].tolist(), strict=True))
        return Pick(int(token), float(logprobs[0]), alternatives)

    def _penalize(self, scores: np.ndarray, note: str = "") -> None:
        """Applies the penalties to one row's float32 `scores` (vocab,) in place, at the ids it has seen only.
        Each penalty is worked in float64 on those few ids and rounded to float32 once: within a float32 step
        of the float64 rule's value. `note` says which row of a batch, for an error."""
        self._check_ids_fit(scores.size, note)
        params = self.params
        seen = self._seen.array()
        if params.repetition_penalty != 1 and seen.size:
            scores[seen] = _repetition_penalized(scores[seen], params.repetition_penalty, note)
        ids, counts = self._counts.arrays()
        if (params.frequency_penalty or params.presence_penalty) and ids.size:
            amounts = params.frequency_penalty * counts + params.presence_penalty
            scores[ids] = scores[ids].astype(np.float64) - amounts
        if params.logit_bias:
            self._bias(scores, note)

    def _bias(self, scores: np.ndarray, note: str) -> None:
        """OpenAI's logit_bias, added to its ids' scores (worked in float64, rounded once)."""
        ids = np.array([token for token, _ in self.params.logit_bias], np.int64)
        if ids.max() >= scores.size:
            raise InputError("logit_bias", f"token ids must lie in [0, {scores.size}), got {int(ids.max())}{note}")
        biases = np.array([bias for _, bias in self.params.logit_bias], np.float64)
        scores[ids] = scores[ids].astype(np.float64) + biases  # each id once (SamplingParams.check)

    def _draw(self, weights: np.ndarray) -> int:
        """The token that this row's own uniform, from (seed, position), draws from `weights` (vocab,)."""
        uniform = np.random.default_rng([self.seed, len(self._generated)]).random()
        return draw(weights, uniform, self.params)

    def _append(self, token: int) -> None:
        self._generated.append(token)
        self._counts.add(token)
        self._seen.add(token)

    def _check_ids_fit(self, vocab: int, note: str) -> None:
        # the prompt is checked against the vocabulary elsewhere too; a stray id here would penalize a wrong token
        if self._seen.largest >= vocab:
            name = "prompt_ids" if self._prompt_largest >= vocab else "generated"
            largest = self._seen.largest
            raise InputError(name, f"token ids must lie in [0, {vocab}) (the logits' vocabulary), got {largest}{note}")


def sample(
    logits: np.ndarray, rows: Sequence[Sampler], allowed: Sequence[np.ndarray | None] | None = None
) -> list[Pick]:
    """The next token of each generation: `logits` (B, vocab) float32 or float16, row b scored by `rows[b]`
    (its penalties, its params, its seed); each sampler's `generated` grows by its token. `allowed[b]`: the
    tokens row b may pick, (vocab,) bool (a grammar's mask, serving/engine/constraint.py; None: all). The
    others' logits become -inf after the penalties, before anything else: the mask is part of the
    distribution, so greedy is the argmax of what it allows (the unconstrained argmax whenever it allows that)
    and a logprob is the token's under the constrained distribution.

    Raises LogitsError for logits that cannot be sampled from (a server fault), InputError for a row whose
    ids or repetition penalty do not fit them; a batch's message names the row, and no sampler moves on."""
    logits = _float_rows(logits, len(rows))
    allowed = [None] * len(rows) if allowed is None else list(allowed)
    choices: list[Pick] = []
    for chunk in _chunks(*logits.shape):
        choices += _sample_rows(logits[chunk], rows[chunk], chunk.start, len(rows), allowed[chunk])
    for row, choice in zip(rows, choices, strict=True):
        row._append(choice.token)
    return choices


def score_prompt(logits: np.ndarray, following: np.ndarray, top: int) -> dict[str, np.ndarray]:
    """The prompt's response: `logits` (T-1, vocab) at each prompt position but the last scoring the id that
    follows it (`following`, (T-1,)), and the `top` most likely ids there; the first prompt token's entry is
    NaN (and no alternatives: ids -1 and logprobs NaN, as in the columns past the vocabulary's size)."""
    logits, following = _float_rows(logits, len(following)), np.asarray(following, np.int64).reshape(-1)
    logprob = np.full(len(following) + 1, np.nan, np.float32)
    top_ids = np.full((len(following) + 1, top), -1, np.int64)
    top_logprobs = np.full((len(following) + 1, top), np.nan, np.float32)
    for chunk in _chunks(*logits.shape):
        scores = _float32_copy(logits[chunk], chunk.start, len(following))
        scored, ids, alternatives = _score_rows(scores, following[chunk], top)
        positions, width = slice(chunk.start + 1, chunk.stop + 1), ids.shape[1]  # position 0: nothing before it
        logprob[positions] = scored
        top_ids[positions, :width] = ids
        top_logprobs[positions, :width] = alternatives
    return {
        generation.PROMPT_LOGPROB: logprob,
        generation.PROMPT_TOP_TOKEN_IDS: top_ids,
        generation.PROMPT_TOP_LOGPROBS: top_logprobs,
    }


# -- the batch's operations ------------------------------------------------------------------------------


def _chunks(rows: int, vocab: int) -> list[slice]:
    """The batch's rows in chunks of ~2 MiB of float32 logits, so that the ~8 passes over a chunk read the
    cache, not memory (greedy with 5 logprobs, 64 rows of 152,064 logits: 22 ms at once, 14 ms in chunks)."""
    step = max(1, _CHUNK_BYTES // (4 * vocab))
    return [slice(start, start + step) for start in range(0, rows, step)]


def _sample_rows(
    logits: np.ndarray, rows: Sequence[Sampler], first: int, total: int, allowed: Sequence[np.ndarray | None]
) -> list[Pick]:
    """`sample` over a chunk of its batch, `rows` being its rows `first`.. of `total`; no sampler moves on."""
    scores = _float32_copy(logits, first, total)
    for at, row in enumerate(rows):
        row._penalize(scores[at], _row_note(first + at, total))
        if allowed[at] is not None:
            _mask(scores[at], allowed[at], _row_note(first + at, total))
    best, weights, log_norms = _softmax_parts(scores)  # `scores` is now shifted: each row's top is 0
    tokens = best  # greedy rows keep the argmax, never drawn
    sampled = [at for at, row in enumerate(rows) if not row.params.greedy]
    _temper(scores, weights, {at: rows[at].params.temperature for at in sampled})
    for at in sampled:
        tokens[at] = rows[at]._draw(weights[at])
    return _choices(scores, log_norms, tokens, [row.params.logprobs for row in rows])


def _softmax_parts(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shifts each row of `scores` (R, vocab) in place by its max, and returns each row's argmax (the first
    maximum: the lowest id on ties), exp of the shifted scores (R, vocab) and each row's log-normalizer (R,):
    a token's logprob is its shifted score minus its row's."""
    best = np.argmax(scores, axis=1)
    scores -= scores[np.arange(len(scores)), best][:, None]  # <= 0, so exp cannot overflow; each top is exactly 0
    weights = np.exp(scores)
    log_norms = np.log(weights.sum(axis=1))  # numpy's pairwise sum along a row: ~log2(vocab) roundings, not vocab
    return best, weights, log_norms


def _temper(shifted: np.ndarray, weights: np.ndarray, temperatures: dict[int, float]) -> None:
    """Overwrites the weights of the rows (of `temperatures`: row -> T) whose T is not 1 with exp(shifted / T),
    once the log-normalizers (of T = 1) are taken. Dividing the shifted scores keeps a tiny T finite: the top
    stays 0, the rest go to -inf."""
    tempered = {at: t for at, t in temperatures.items() if t != 1}
    if not tempered:
        return
    rows = np.fromiter(tempered, np.int64, len(tempered))
    divisors = np.array([max(t, _TINY) for t in tempered.values()], np.float32)[:, None]
    with np.errstate(over="ignore"):  # a score / tiny T past float32's range is -inf: weight 0, as meant
        if rows.size == len(weights):  # every row (the rows ascend): in place, no copy of the batch
            np.exp(np.divide(shifted, divisors, out=weights), out=weights)
        else:
            weights[rows] = np.exp(shifted[rows] / divisors)


def _choices(shifted: np.ndarray, log_norms: np.ndarray, tokens: np.ndarray, wanted: list[int]) -> list[Pick]:
    """Each row's Pick: its token's logprob and its `wanted[row]` most likely alternatives', the batch at once."""
    logprobs = (shifted[np.arange(len(tokens)), tokens] - log_norms).tolist()
    top_ids = _top_ids(shifted, max(wanted, default=0), np.array(wanted, np.int64) > 0)
    top_logprobs = np.take_along_axis(shifted, np.maximum(top_ids, 0), axis=1) - log_norms[:, None]
    return [
        Pick(token, logprob, _possible(ids[:n].tolist(), alternatives[:n].tolist()))
        for token, logprob, ids, alternatives, n in zip(
            tokens.tolist(), logprobs, top_ids, top_logprobs, wanted, strict=True
        )
    ]


def _possible(ids: list[int], logprobs: list[float]) -> tuple[tuple[int, float], ...]:
    """The alternatives a row could have picked: a mask leaves fewer than asked where it allows fewer."""
    return tuple((token, logprob) for token, logprob in zip(ids, logprobs, strict=True) if logprob != -math.inf)


def _score_rows(scores: np.ndarray, following: Sequence[int], top: int) -> tuple[np.ndarray, ...]:
    """Under `scores` (R, vocab) float32 (overwritten): each row's logprob of its `following` id (R,), its `top`
    most likely ids (R, min(top, vocab)) and their logprobs."""
    following = np.asarray(following, np.int64).reshape(-1)
    vocab = scores.shape[1]
    if following.size and not 0 <= following.min() <= following.max() < vocab:
        outside = following[(following < 0) | (following >= vocab)]
        raise InputError("prompt_ids", f"token ids must lie in [0, {vocab}) (the logits' vocabulary), got {outside[0]}")
    _, _, log_norms = _softmax_parts(scores)
    logprobs = scores[np.arange(len(scores)), following] - log_norms
    ids = _top_ids(scores, top)
    return logprobs, ids, np.take_along_axis(scores, ids, axis=1) - log_norms[:, None]


def _top_ids(values: np.ndarray, n: int, asking: np.ndarray | None = None) -> np.ndarray:
    """The ids of each row's n largest `values` (R, vocab), largest first, ties by lower id: (R, min(n, vocab)),
    -1 in the rows not `asking` (a mask; None: every row).

    No row is sorted whole: the values at or above a threshold that a row's n largest reach are its candidates
    (a few times n), a partition of them finds the row's n-th largest, and the few at or above it are ordered."""
    rows, vocab = values.shape
    n = min(n, vocab)
    asking = np.ones(rows, bool) if asking is None else asking
    top = np.full((rows, n), -1, np.int64)
    if n == 0 or not asking.any():
        return top
    at = np.flatnonzero(asking)
    flat, counts = _candidates(values, n, at)
    candidates = values.reshape(-1)[flat]
    # every value tied with a row's n-th largest is still a candidate, so ordering them settles ties by id
    nth = _nth_largest_of(candidates, counts, n)
    flat = flat[candidates >= nth[flat // vocab]]
    counts = np.bincount(flat // vocab, minlength=rows)
    order = np.lexsort((flat, -values.reshape(-1)[flat], flat // vocab))  # by row, descending value, id
    firsts = np.cumsum(counts) - counts  # where each row's candidates begin in `order`
    top[at] = flat[order[firsts[at][:, None] + np.arange(n)]] % vocab
    return top


def _candidates(values: np.ndarray, n: int, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The flat indices (ascending) of the values of rows `at` that reach a threshold their row's n largest
    reach, and how many each row has (none in the other rows).

    A partition costs ~8 ns a value on our machines (0.25 ms a row of 32,000), a comparison ~0.06 ns: where the
    vocabulary is large next to n, the threshold is guessed from a sorted sample of 1024 of the row's values:
    the one ~4n of the row reach, 4 sample steps lower, so that a row reaches it with fewer than n in ~1e-5 of
    cases (counted; such a row takes its exact n-th largest)."""
    rows, vocab = values.shape
    thresholds = np.full(rows, np.inf, values.dtype)  # no finite value reaches it: a row not asking
    if vocab < 4 * _SAMPLE or 16 * n > vocab:  # a guess would not pay
        thresholds[at] = _nth_largest(values[at], n)
        return _at_least(values, thresholds)
    sample = np.sort(values[at, :: vocab // _SAMPLE], axis=1)  # ascending; numpy's sort is vectorized
    rank = math.ceil(4 * n * sample.shape[1] / vocab) + 4
    thresholds[at] = sample[:, -min(rank, sample.shape[1])]
    flat, counts = _at_least(values, thresholds)
    short = at[counts[at] < n]
    if short.size:
        thresholds[short] = _nth_largest(values[short], n)
        flat, counts = _at_least(values, thresholds)
    return flat, counts


def _at_least(values: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The flat indices (ascending) of the values at or above their row's threshold, and how many each row has."""
    flat = np.flatnonzero(values >= thresholds[:, None])
    return flat, np.bincount(flat // values.shape[1], minlength=len(values))


def _nth_largest(values: np.ndarray, n: int) -> np.ndarray:
    return np.partition(values, values.shape[1] - n, axis=1)[:, values.shape[1] - n]


def _nth_largest_of(candidates: np.ndarray, counts: np.ndarray, n: int) -> np.ndarray:
    """Each row's n-th largest candidate (-inf in a row with fewer): `candidates` are the rows' in turn,
    `counts[row]` of them each. One partition of a (rows, most candidates) table padded with -inf (numpy's
    vectorized sort is slower on so many equal values)."""
    rows, width = len(counts), max(int(counts.max()), n)
    firsts = np.cumsum(counts) - counts
    table = np.full((rows, width), -np.inf, candidates.dtype)
    row_of = np.repeat(np.arange(rows), counts)
    table[row_of, np.arange(candidates.size) - firsts[row_of]] = candidates
    return _nth_largest(table, n)


# -- one row's draw --------------------------------------------------------------------------------------


def draw(weights: np.ndarray, uniform: float, params: SamplingParams) -> int:
    """The token that `uniform` in [0, 1) picks by inverse CDF over the tokens top_k, top_p and min_p keep.

    `weights` (vocab,) float32 are unnormalized probabilities whose largest is 1 (exp of the scores shifted by
    their max). The CDF's order: the kept tokens weighing at least HEAD_FLOOR in descending weight (ties
    by lower id), then the other kept tokens in id order. Descending order keeps a draw stable when the
    likely tokens' logits move by rounding (another replica's GPU); the light tail in id order spares
    ranking most of the vocabulary whenever the draw lands there. Sums are float64 (see the module's doc)."""
    kept, mass = _kept(weights, params)
    target = uniform * mass
    floor = _float_at_least(HEAD_FLOOR, weights.dtype)
    light = weights < floor if kept is None else weights[kept] < floor
    head = np.flatnonzero(~light) if kept is None else kept[~light]  # never empty: it holds the top token
    head_mass = float(weights[head].sum(dtype=np.float64))
    if target < head_mass:
        return _crossing(weights, head, target, inclusive=False)
    tail = np.flatnonzero(light) if kept is None else kept[light]
    at = _first_passing(weights[tail], head_mass, target)
    if at is None:  # rounding carried the target just past the head's mass, and the tail weighs nothing
        return _crossing(weights, head, head_mass, inclusive=False)
    return int(tail[at])


def _first_passing(values: np.ndarray, before: float, target: float) -> int | None:
    """The index of the first of `values` (>= 0) at which `before` plus their running sum passes `target` (never
    a weightless one); the last with weight when rounding leaves `target` out of reach; None when none has any.

    A running sum is a sequential loop (~3 ns a value on our machines, 0.1 ms over a 30,000-token tail): whole
    blocks are summed first, and only the block that holds the crossing is run through."""
    starts = np.arange(0, values.size, _BLOCK)
    ends = before + np.cumsum(np.add.reduceat(values, starts, dtype=np.float64)) if starts.size else starts
    block = int(np.searchsorted(ends, target, "right"))
    if block == starts.size:
        weighted = np.flatnonzero(values)
        return int(weighted[-1]) if weighted.size else None
    inside = values[starts[block] : starts[block] + _BLOCK]
    sums = (ends[block - 1] if block else before) + np.cumsum(inside, dtype=np.float64)
    at = int(np.searchsorted(sums, target, "right"))
    if at == inside.size:  # the block's sum and its running sum rounded apart: its last token with weight
        at = int(np.flatnonzero(inside)[-1])
    return int(starts[block]) + at


def _kept(weights: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, float]:
    """The ids (ascending; None: every token) that top_k, then top_p, then min_p keep, and their total
    weight. top_p renormalizes over what top_k kept, as transformers and vLLM do; min_p's ratio to the top
    needs no renormalizing."""
    kept = None
    if params.top_k and params.top_k < weights.size:
        kept = np.sort(_top_ids(weights[None], params.top_k)[0])
    if params.top_p is not None and params.top_p < 1:
        last = _crossing(weights, kept, _mass(weights, kept) * (params.top_p - _TOP_P_SLACK), inclusive=True)
        kept = _heavier_than(weights, kept, last)
    if params.min_p:
        floor = _float_at_least(params.min_p, weights.dtype)  # the top weighs 1
        heavy = weights >= floor if kept is None else weights[kept] >= floor
        if not heavy.all():
            kept = np.flatnonzero(heavy) if kept is None else kept[heavy]
    return kept, _mass(weights, kept)


def _mass(weights: np.ndarray, ids: np.ndarray | None) -> float:
    return float((weights if ids is None else weights[ids]).sum(dtype=np.float64))


def _float_at_least(value: float, dtype: np.dtype) -> np.floating:
    """The smallest `dtype` number not below `value`: for an array of that dtype, `array >= it` is exactly
    `array >= value` (a plain comparison rounds `value` to the array's dtype first, up or down)."""
    rounded = np.asarray(value, dtype)[()]
    return rounded if float(rounded) >= value else np.nextafter(rounded, dtype.type(np.inf))


def _heavier_than(weights: np.ndarray, ids: np.ndarray | None, last: int) -> np.ndarray:
    """The ids (of `ids`; None: all) that come no later than `last` in descending weight, ties by lower id."""
    boundary = weights[last]
    if ids is None:
        first = weights > boundary
        tied = np.flatnonzero(weights == boundary)
        first[tied[tied <= last]] = True
        return np.flatnonzero(first)
    values = weights[ids]
    return ids[(values > boundary) | ((values == boundary) & (ids <= last))]


def _crossing(weights: np.ndarray, ids: np.ndarray | None, target: float, inclusive: bool) -> int:
    """The token of `ids` (ascending; None: all) at which, in descending weight order (ties by lower id),
    the running sum of weights first reaches `target` (passes it unless `inclusive`); the last token when
    rounding leaves the target out of reach.

    A selection, not a sort: split the window of tokens still in question at a pivot weight, keep the side
    that holds the crossing (adding the heavy side's weight when passing it), until few enough remain to
    sort. The first pivot is HEAD_FLOOR (most of a vocabulary lies below it, and a sample, missing the few
    heavy tokens, would misjudge their weight), then a sample's guess just beside the crossing. A full sort
    of 150,000 weights costs ~18 ms on our 2-core machines."""
    values = weights if ids is None else weights[ids]
    window = _Window(None, values.size, float(values.sum(dtype=np.float64)))
    before = 0.0  # the weight of the tokens known to come earlier
    pivot, pivot_from_values = HEAD_FLOOR, False
    while window.count > _SORT_BELOW:
        split = window.split(values, pivot)
        if split is None and pivot_from_values:
            break  # every weight left is the same: the sort below orders them by id
        if split is not None:
            window, before = window.side(values, split, (before, target, inclusive))
            if window.inside is not None and 8 * window.count < values.size:  # few left: gather them
                chosen = window.ids()
                ids, values = (chosen if ids is None else ids[chosen]), values[chosen]
                window = _Window(None, values.size, window.mass)
        pivot, pivot_from_values = _pivot_near(values, window, target - before), True
    chosen = window.ids()
    order = np.argsort(-values[chosen], kind="stable")  # `chosen` ascends: ties go to the lower id
    sums = before + np.cumsum(values[chosen[order]], dtype=np.float64)
    at = min(int(np.searchsorted(sums, target, "left" if inclusive else "right")), chosen.size - 1)
    token = chosen[order[at]]
    return int(token if ids is None else ids[token])


@dataclasses.dataclass(frozen=True)
class _Window:
    """The tokens a selection still looks among, as a mask over its values (None: all), how many, and their
    weight. A mask spares gathering the many tokens of a large side: each split gathers its smaller side only
    (numpy's gathers and masked sums cost ~1 ns a value, a comparison ~0.06); once few are left, they are
    gathered (`_crossing`), so that a split no longer reads the whole vocabulary."""

    inside: np.ndarray | None
    count: int
    mass: float

    def split(self, values: np.ndarray, pivot: float) -> tuple[np.ndarray, int] | None:
        """The mask of the window's values that come before the rest at `pivot` (those at least it, or above
        it when that takes all) and how many; None when neither splits them. Whatever float32 makes of
        `pivot`, the masks and the weights taken from them agree."""
        for compare in (np.greater_equal, np.greater):
            heavy = compare(values, pivot)
            if self.inside is not None:
                heavy &= self.inside
            count = int(np.count_nonzero(heavy))
            if count < self.count:
                return (heavy, count) if count else None
        return None

    def side(
        self, values: np.ndarray, split: tuple[np.ndarray, int], search: tuple[float, float, bool]
    ) -> tuple[_Window, float]:
        """The side of `split` (the heavy side's mask and count) that holds the crossing of the `search` (the
        weight before the window, the target, inclusive), and the weight before it."""
        (heavy, heavy_count), (before, target, inclusive) = split, search
        light = ~heavy if self.inside is None else self.inside & ~heavy
        light_count = self.count - heavy_count
        if heavy_count <= light_count:  # the smaller side is summed; the other weighs the rest of the window
            heavy_mass = float(values[heavy].sum(dtype=np.float64))
        else:
            heavy_mass = self.mass - float(values[light].sum(dtype=np.float64))
        if (before + heavy_mass >= target) if inclusive else (before + heavy_mass > target):
            return _Window(heavy, heavy_count, heavy_mass), before
        return _Window(light, light_count, self.mass - heavy_mass), before + heavy_mass

    def ids(self) -> np.ndarray:
        """The window's positions in its values, ascending."""
        return np.arange(self.count) if self.inside is None else np.flatnonzero(self.inside)

    def sample(self, values: np.ndarray, size: int) -> np.ndarray:
        """About `size` of the window's values, evenly spread over their positions."""
        stride = max(1, self.count // size)
        if self.inside is None:
            return values[::stride]
        sample = values[::stride][self.inside[::stride]]
        return sample if sample.size else values[self.inside]  # a stride that misses the window: all of it


def _pivot_near(values: np.ndarray, window: _Window, need: float) -> float:
    """A weight of the `window` of `values` a little beside where, heaviest first, their running sum reaches
    `need`, as a sample of ~256 estimates it: on the side that leaves fewer values to keep looking at. The
    sample's sums are scaled to the window's exact weight, so that a crossing among the window's lightest
    tokens is estimated there, not past the end of a sample that happens to weigh too little."""
    sample = np.sort(window.sample(values, 256))[::-1]
    estimated = np.cumsum(sample, dtype=np.float64)
    if estimated[-1] > 0:
        estimated *= window.mass / estimated[-1]
    at = int(np.searchsorted(estimated, need))
    margin = 3  # sample steps: the estimate's error, which a wrong side costs one more pass to recover
    if at < sample.size // 2:
        return float(sample[min(at + margin, sample.size - 1)])
    return float(sample[max(at - margin, 0)])


# -- a sequence's state ----------------------------------------------------------------------------------


class _Growing:
    """An array appended to in place (its capacity doubles), read as a view of what it holds: a step reads a
    long sequence's ids without rebuilding them (np.fromiter over 4,000 ids and counts: ~0.2 ms a row a step)."""

    def __init__(self, initial: np.ndarray, dtype: type) -> None:
        self._data = np.empty(max(16, 2 * initial.size), dtype)
        self._data[: initial.size] = initial
        self._size = initial.size

    def __len__(self) -> int:
        return self._size

    def append(self, value: int) -> None:
        if self._size == self._data.size:
            self._data = np.concatenate([self._data, np.empty_like(self._data)])
        self._data[self._size] = value
        self._size += 1

    def view(self) -> np.ndarray:
        return self._data[: self._size]


class _SeenIds:
    """The distinct ids of prompt + generated (the repetition penalty's set), grown one token at a time
    without re-reading a long prompt."""

    def __init__(self, prompt: np.ndarray) -> None:
        unique = np.unique(prompt)
        self._members = set(unique.tolist())
        self._ids = _Growing(unique, np.int64)
        self.largest = _largest_id(unique)

    def add(self, token: int) -> None:
        if token not in self._members:
            self._members.add(token)
            self._ids.append(token)
            self.largest = max(self.largest, token)

    def array(self) -> np.ndarray:
        return self._ids.view()


class _Counts:
    """How often each generated id occurs: the ids (first seen first) and their counts, as the arrays the
    frequency and presence penalties' one sparse update reads."""

    def __init__(self) -> None:
        self._slots: dict[int, int] = {}
        self._ids = _Growing(np.empty(0, np.int64), np.int64)
        self._counts = _Growing(np.empty(0, np.int64), np.int64)

    def add(self, token: int) -> None:
        slot = self._slots.setdefault(token, len(self._ids))
        if slot == len(self._ids):
            self._ids.append(token)
            self._counts.append(0)
        self._counts.view()[slot] += 1

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self._ids.view(), self._counts.view()


# -- checks at the edges ---------------------------------------------------------------------------------


def _one_row(logits: np.ndarray) -> np.ndarray:
    """`logits` (vocab,) as a batch of one (1, vocab)."""
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0 or logits.dtype.kind != "f":
        raise LogitsError(f"expected logits of shape (vocab,) and a float dtype, got {logits.dtype} {logits.shape}")
    return logits[None]


def _float_rows(logits: np.ndarray, rows: int) -> np.ndarray:
    """`logits` as an array (rows, vocab) of a float dtype, else LogitsError."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[0] != rows or logits.shape[1] == 0 or logits.dtype.kind != "f":
        found = f"{logits.dtype} {logits.shape}"
        raise LogitsError(f"expected logits of shape ({rows}, vocab) and a float dtype, got {found}")
    return logits


def _float32_copy(logits: np.ndarray, first: int = 0, total: int = 1) -> np.ndarray:
    """`logits` (rows, vocab) as a new float32 array (the sampler works in it in place); LogitsError for a NaN or
    Inf, naming how many a row has (and which row it is of a batch of `total` whose rows begin at `first`)."""
    with np.errstate(over="ignore"):  # float64 logits past float32's range become Inf, refused below
        scores = logits.astype(np.float32)
    unfit = np.flatnonzero(~np.isfinite(scores).all(axis=1))
    if unfit.size:
        at, vocab = int(unfit[0]), scores.shape[1]
        bad = vocab - int(np.count_nonzero(np.isfinite(scores[at])))
        raise LogitsError(f"expected finite logits, got {bad} NaN or Inf of {vocab}{_row_note(first + at, total)}")
    return scores


def _mask(scores: np.ndarray, allowed: np.ndarray, note: str) -> None:
    """Sets the scores of the tokens `allowed` (vocab,) bool leaves out to -inf, in place."""
    if allowed.shape != scores.shape or not allowed.any():
        found = f"shape {allowed.shape}" if allowed.shape != scores.shape else "none allowed"
        raise LogitsError(f"expected a mask of shape {scores.shape} allowing at least one token, got {found}{note}")
    np.copyto(scores, -np.inf, where=~allowed)


def _repetition_penalized(before: np.ndarray, penalty: float, note: str) -> np.ndarray:
    """transformers' rule on the float32 `before`, worked in float64 and rounded to float32 once."""
    wide = before.astype(np.float64)
    with np.errstate(over="ignore"):  # a result past float32's range becomes Inf, refused below
        after = np.where(wide > 0, wide / penalty, wide * penalty).astype(np.float32)
    if not np.isfinite(after).all():  # a penalty near 0 (or huge) sends a finite logit past float32's range
        raise InputError("repetition_penalty", f"expected a penalty that keeps logits finite, got {penalty!r}{note}")
    return after


def _row_note(at: int, rows: int) -> str:
    """Which row of a batch an error is about (nothing for a batch of one)."""
    return f" (row {at} of the batch)" if rows > 1 else ""


def _token_ids(name: str, ids: Sequence[int]) -> np.ndarray:
    array = np.asarray(ids)
    if array.size == 0:
        return np.empty(0, np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        shape = list(array.shape)
        raise InputError(name, f"expected a flat sequence of integer token ids, got {array.dtype} of shape {shape}")
    if array.min() < 0:
        at = int(np.argmin(array))
        raise InputError(name, f"expected token ids >= 0, got {array[at]} at index {at}")
    return array.astype(np.int64, copy=False)


def _largest_id(ids: np.ndarray) -> int:
    return int(ids.max()) if ids.size else -1
