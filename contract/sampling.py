"""Choosing the next token from a model's logits, greedy or sampled: written once, numpy only.

The server's generation loop calls `Sampler.pick` once per generated token per sequence (the Triton
Python stub does not import torch). The steps, in the order transformers and vLLM apply them:

1. penalties on the logits: repetition (transformers' rule, over prompt + generated ids), then
   frequency and presence (OpenAI's, over generated ids);
2. greedy (temperature 0): the argmax, ties to the lowest id. Otherwise softmax(logits / T), truncated
   by top_k, then top_p (over what top_k kept, renormalized), then min_p (relative to the top token);
3. one uniform draw, inverted over the kept tokens: those within HEAD_FLOOR of the top token's probability
   in descending probability (ties by id), then the rest in id order (`draw`).

Determinism: with a seed, the i-th token of a sequence (i = how many it has generated before) uses
`np.random.default_rng([seed, i]).random()` and nothing else random, so a sampler rebuilt from (prompt,
generated so far) on another replica, after a restart or a recovery, continues as the original would
have: the same tokens for the same logits.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from collections.abc import Sequence

import numpy as np

from contract.inputs import InputError

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
PENALTY_LIMIT = 2  # OpenAI's presence and frequency penalties lie in [-2, 2]
SEED_LIMIT = 2**63  # seeds are non-negative int64s: every client language can carry one
HEAD_FLOOR = 1e-3  # the draw's CDF runs in descending probability over tokens within this ratio of the top
_SORT_BELOW = 2048  # a selection sorts what is left once this few remain
_SAMPLE = 1024  # values sampled to guess a threshold above which the k largest lie
_TOP_P_SLACK = 1e-12  # a prefix whose float sum misses top_p by rounding alone still reaches it


class LogitsError(ValueError):
    """The model's logits cannot be sampled from (not (vocab,), not float, NaN or Inf): a server fault."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one sequence chooses its tokens; OpenAI's names and ranges where it has them."""

    temperature: float = 0.0  # 0: greedy (argmax); > 0: sample from softmax(logits / T)
    top_k: int | None = None  # keep the k most likely (None or 0: all)
    top_p: float | None = None  # nucleus: the smallest set whose probability reaches p (None or 1: all)
    min_p: float | None = None  # drop tokens whose probability < min_p * the top token's
    repetition_penalty: float = 1.0  # transformers' rule over prompt + generated ids: logit > 0 -> / p, else * p
    presence_penalty: float = 0.0  # OpenAI's: logit -= presence * (count > 0) over generated ids
    frequency_penalty: float = 0.0  # OpenAI's: logit -= frequency * count over generated ids
    seed: int | None = None  # the same tokens on any replica, after a restart, after a recovery
    logprobs: int = 0  # how many top alternatives' logprobs to report (0: only the chosen's)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check(self) -> None:
        """Raise InputError naming the first field outside its range, the range and the value."""
        for name, fits, expected in self._rules():
            if not fits:
                raise InputError(name, f"expected {expected}, got {getattr(self, name)!r}")

    def _rules(self) -> tuple[tuple[str, bool, str], ...]:
        # each test short-circuits on the type first, so a string never meets a comparison
        t, k, p, m, r = self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty
        presence, frequency, n, seed = self.presence_penalty, self.frequency_penalty, self.logprobs, self.seed
        limit, in_limit = PENALTY_LIMIT, f"a number in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}]"
        return (
            ("temperature", _real(t) and 0 <= t < math.inf, "a finite number >= 0"),
            ("top_k", k is None or (_integer(k) and k >= 0), "None or an integer >= 0"),
            ("top_p", p is None or (_real(p) and 0 < p <= 1), "None or a number in (0, 1]"),
            ("min_p", m is None or (_real(m) and 0 <= m <= 1), "None or a number in [0, 1]"),
            ("repetition_penalty", _real(r) and 0 < r < math.inf, "a finite number > 0"),
            ("presence_penalty", _real(presence) and -limit <= presence <= limit, in_limit),
            ("frequency_penalty", _real(frequency) and -limit <= frequency <= limit, in_limit),
            ("logprobs", _integer(n) and 0 <= n <= MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]"),
            ("seed", seed is None or (_integer(seed) and 0 <= seed < SEED_LIMIT), "None or an integer in [0, 2**63)"),
        )


@dataclasses.dataclass(frozen=True)
class Choice:
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
        self._counts: dict[int, int] = {}  # generated id -> how often
        self._generated: list[int] = []
        for token in _token_ids("generated", generated).tolist():
            self._append(token)

    @property
    def generated(self) -> list[int]:
        return list(self._generated)

    def pick(self, logits: np.ndarray) -> Choice:
        """The next token for `logits` (vocab,) float16/32/64; appends it to `generated`."""
        # in place where it can be: on our VMs a fresh 1 MiB temporary costs as much as the exp over it
        shifted = self.penalized(logits)
        shifted -= shifted.max()  # <= 0, so exp cannot overflow; the top token's weight is exactly 1
        weights = np.exp(shifted)
        log_norm = math.log(weights.sum())  # a token's logprob: its shifted score minus this
        # greedy: argmax returns the first maximum, so ties go to the lowest id
        token = int(np.argmax(shifted)) if self.params.greedy else self._sample(shifted, weights)
        top = tuple((int(i), float(shifted[i]) - log_norm) for i in _top_ids(shifted, self.params.logprobs))
        self._append(token)
        return Choice(token, float(shifted[token]) - log_norm, top)

    @staticmethod
    def scored(logits: np.ndarray, token: int, top: int) -> Choice:
        """`token`'s logprob under `logits` (vocab,) as the model gives it (no penalties: a prompt token was
        not picked) and the `top` most likely (id, logprob): how a prompt is scored."""
        shifted = logits.astype(np.float64) - logits.max()
        log_norm = math.log(np.exp(shifted).sum())
        alternatives = tuple((int(i), float(shifted[i]) - log_norm) for i in _top_ids(shifted, top))
        return Choice(token, float(shifted[token]) - log_norm, alternatives)

    def _sample(self, shifted: np.ndarray, weights: np.ndarray) -> int:
        """Draws with this token's own randomness; overwrites `weights` with their tempered values."""
        temperature = self.params.temperature
        if temperature != 1:
            # dividing the shifted scores keeps a tiny temperature finite: the top stays 0, the rest go to -inf
            np.exp(np.divide(shifted, temperature, out=weights), out=weights)
        uniform = np.random.default_rng([self.seed, len(self._generated)]).random()
        return draw(weights, uniform, self.params)

    def penalized(self, logits: np.ndarray) -> np.ndarray:
        """`logits` in float64 (a new array) after the repetition, frequency and presence penalties."""
        scores = _finite_float64(logits)
        self._check_ids_fit(scores.size)
        params = self.params
        seen = self._seen.array()
        if params.repetition_penalty != 1 and seen.size:
            before = scores[seen]
            penalty = params.repetition_penalty
            after = np.where(before > 0, before / penalty, before * penalty)
            if not np.isfinite(after).all():  # a penalty near 0 divides a finite logit past float64's range
                raise InputError("repetition_penalty", f"expected a penalty that keeps logits finite, got {penalty!r}")
            scores[seen] = after
        if (params.frequency_penalty or params.presence_penalty) and self._counts:
            ids = np.fromiter(self._counts, np.int64, len(self._counts))
            counts = np.fromiter(self._counts.values(), np.float64, len(self._counts))
            scores[ids] -= params.frequency_penalty * counts + params.presence_penalty
        return scores

    def _append(self, token: int) -> None:
        self._generated.append(token)
        self._counts[token] = self._counts.get(token, 0) + 1
        self._seen.add(token)

    def _check_ids_fit(self, vocab: int) -> None:
        # the prompt is checked against the vocabulary elsewhere too; a stray id here would penalize a wrong token
        if self._seen.largest >= vocab:
            name = "prompt_ids" if self._prompt_largest >= vocab else "generated"
            largest = self._seen.largest
            raise InputError(name, f"token ids must lie in [0, {vocab}) (the logits' vocabulary), got {largest}")


def draw(weights: np.ndarray, uniform: float, params: SamplingParams) -> int:
    """The token that `uniform` in [0, 1) picks by inverse CDF over the tokens top_k, top_p and min_p keep.

    `weights` (vocab,) are unnormalized probabilities whose largest is 1 (exp of the scores shifted by
    their max). The CDF's order: the kept tokens weighing at least HEAD_FLOOR in descending weight (ties
    by lower id), then the other kept tokens in id order. Descending order keeps a draw stable when the
    likely tokens' logits move by rounding (another replica's GPU); the light tail in id order spares
    ranking most of the vocabulary whenever the draw lands there."""
    kept, mass = _kept(weights, params)
    target = uniform * mass
    light = weights < HEAD_FLOOR if kept is None else weights[kept] < HEAD_FLOOR
    head = np.flatnonzero(~light) if kept is None else kept[~light]  # never empty: it holds the top token
    head_mass = float(weights[head].sum())
    if target < head_mass:
        return _crossing(weights, head, target, inclusive=False)
    tail = np.flatnonzero(light) if kept is None else kept[light]
    tail = tail[weights[tail] > 0]  # never a weightless token
    if not tail.size:  # rounding carried the target just past the head's mass: its lightest token
        return _crossing(weights, head, head_mass, inclusive=False)
    ends = head_mass + np.cumsum(weights[tail])
    return int(tail[min(int(np.searchsorted(ends, target, "right")), tail.size - 1)])


def _kept(weights: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, float]:
    """The ids (ascending; None: every token) that top_k, then top_p, then min_p keep, and their total
    weight. top_p renormalizes over what top_k kept, as transformers and vLLM do; min_p's ratio to the top
    needs no renormalizing."""
    kept = None
    if params.top_k and params.top_k < weights.size:
        kept = np.sort(_top_ids(weights, params.top_k))
    if params.top_p is not None and params.top_p < 1:
        mass = float(weights.sum() if kept is None else weights[kept].sum())
        last = _crossing(weights, kept, mass * (params.top_p - _TOP_P_SLACK), inclusive=True)
        kept = _heavier_than(weights, kept, last)
    if params.min_p:
        heavy = weights >= params.min_p if kept is None else weights[kept] >= params.min_p  # the top weighs 1
        if not heavy.all():
            kept = np.flatnonzero(heavy) if kept is None else kept[heavy]
    return kept, float(weights.sum() if kept is None else weights[kept].sum())


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

    A selection, not a sort: split at a pivot weight, keep the side that holds the crossing (adding the
    heavy side's weight when passing it), until few enough remain to sort. The first pivot is HEAD_FLOOR
    (most of a vocabulary lies below it), then a sample's guess just beside the crossing. A full sort of
    150,000 weights costs ~18 ms on our 2-core machines."""
    values = weights if ids is None else weights[ids]
    before = 0.0  # the weight of the tokens known to come earlier
    pivot, pivot_from_values = HEAD_FLOOR, False
    while values.size > _SORT_BELOW:
        heavy = _split(values, pivot)
        if heavy is None and pivot_from_values:
            break  # every weight left is the same: the sort below orders them by id
        if heavy is not None:
            heavy_mass = float(np.sum(values, where=heavy))
            if (before + heavy_mass >= target) if inclusive else (before + heavy_mass > target):
                side = heavy
            else:
                before, side = before + heavy_mass, ~heavy
            chosen = np.flatnonzero(side)
            ids, values = (chosen if ids is None else ids[chosen]), values[chosen]
        pivot, pivot_from_values = _pivot_near(values, target - before), True
    order = np.argsort(-values, kind="stable")  # values are in ascending id order: ties go to the lower id
    sums = before + np.cumsum(values[order])
    at = min(int(np.searchsorted(sums, target, "left" if inclusive else "right")), values.size - 1)
    return int(order[at] if ids is None else ids[order[at]])


def _split(values: np.ndarray, pivot: float) -> np.ndarray | None:
    """The mask of the values that come before the rest at `pivot` (those at least it, or above it when
    that takes all); None when neither splits them."""
    heavy = values >= pivot
    if heavy.all():
        heavy = values > pivot
    return heavy if heavy.any() and not heavy.all() else None


def _pivot_near(values: np.ndarray, need: float) -> float:
    """A weight among `values` a little beside where, heaviest first, their running sum reaches `need`, as a
    sample of 256 estimates it: on the side that leaves fewer values to keep looking at."""
    stride = max(1, values.size // 256)
    sample = np.sort(values[::stride])[::-1]
    estimated = np.cumsum(sample) * (values.size / sample.size)
    at = int(np.searchsorted(estimated, need))
    margin = 3  # sample steps: the estimate's error, which a wrong side costs one more pass to recover
    if at < sample.size // 2:
        return float(sample[min(at + margin, sample.size - 1)])
    return float(sample[max(at - margin, 0)])


def _top_ids(values: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest values, largest first, ties by lower id, without sorting the rest."""
    if k <= 0:
        return np.empty(0, np.int64)
    candidates = _likely_top(values, k)
    if candidates is None:
        return _top_ids_of_all(values, k)
    return candidates[_top_ids_of_all(values[candidates], k)]


def _likely_top(values: np.ndarray, k: int) -> np.ndarray | None:
    """The ids (ascending) of the values above a threshold that a 1024-value sample puts near the 4k-th
    largest, when at least k pass it and they are few: a partition of 150,000 values costs ~1.5 ms on our
    machines, a comparison ~0.1 ms. None when the shortcut would not pay."""
    n = values.size
    if n <= _SAMPLE * 8 or 16 * k > n:
        return None
    sample = values[:: n // _SAMPLE]
    nth = math.ceil(4 * k * sample.size / n)
    threshold = sample[np.argpartition(sample, sample.size - nth)[sample.size - nth]]
    candidates = np.flatnonzero(values >= threshold)
    # at least k pass: nothing below the threshold outranks them
    return candidates if k <= candidates.size <= n // 2 else None


def _top_ids_of_all(values: np.ndarray, k: int) -> np.ndarray:
    n = values.size
    if k >= n:
        return np.argsort(-values, kind="stable")
    kth = np.partition(values, n - k)[n - k]  # the k-th largest
    above = np.flatnonzero(values > kth)
    tied = np.flatnonzero(values == kth)[: k - above.size]  # the lowest ids among those tied at the boundary
    ids = np.sort(np.concatenate([above, tied]))
    return ids[np.argsort(-values[ids], kind="stable")]


class _SeenIds:
    """The distinct ids of prompt + generated (the repetition penalty's set), grown one token at a time
    without re-reading a long prompt."""

    def __init__(self, prompt: np.ndarray) -> None:
        self._prompt = np.unique(prompt)
        self._members = set(self._prompt.tolist())
        self._added: list[int] = []
        self._array: np.ndarray | None = self._prompt
        self.largest = _largest_id(self._prompt)

    def add(self, token: int) -> None:
        if token not in self._members:
            self._members.add(token)
            self._added.append(token)
            self._array = None
            self.largest = max(self.largest, token)

    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.concatenate([self._prompt, np.asarray(self._added, np.int64)])
        return self._array


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


def _finite_float64(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0 or logits.dtype.kind != "f":
        raise LogitsError(f"expected logits of shape (vocab,) and a float dtype, got {logits.dtype} {logits.shape}")
    scores = logits.astype(np.float64)
    # a float64 sum of float16/32 logits cannot overflow, so only a NaN or Inf makes it non-finite
    if not np.isfinite(scores.sum()) and (bad := scores.size - int(np.count_nonzero(np.isfinite(scores)))):
        raise LogitsError(f"expected finite logits, got {bad} NaN or Inf of {scores.size}")
    return scores


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
