"""How a generation picks its tokens: the request's sampling parameters, their ranges and their checks, read by
the client, the gateway and the server alike. The server's sampler (serving/engine/sampler.py) picks every
running generation's token of a step at once by these rules, in the order transformers and vLLM apply them:

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

(`LogitsError` lives here with the parameters: what the server's sampler raises for logits it cannot sample
from, a server fault the client library never sees by type.)
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from contract.inputs import InputError

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
LOGIT_BIAS_LIMIT = 100  # OpenAI's logit_bias values lie in [-100, 100]
PENALTY_LIMIT = 2  # OpenAI's presence and frequency penalties lie in [-2, 2]
SEED_LIMIT = 2**63  # seeds are non-negative int64s: every client language can carry one


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
    # OpenAI's logit_bias: (id, bias) pairs added to those ids' logits after the penalties (-100: never picked)
    logit_bias: tuple[tuple[int, float], ...] = ()

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
            (
                "logit_bias",
                _biases(self.logit_bias),
                f"(id >= 0, bias in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}]) pairs, each id once",
            ),
        )


def _biases(pairs: object) -> bool:
    """Whether `pairs` are (id, bias) pairs of distinct ids >= 0 and biases within the limit."""
    if not isinstance(pairs, tuple) or not all(isinstance(pair, tuple) and len(pair) == 2 for pair in pairs):
        return False
    ids = [token for token, _ in pairs]
    return (
        all(_integer(token) and token >= 0 for token in ids)
        and len(set(ids)) == len(ids)
        and all(_real(bias) and -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT for _, bias in pairs)
    )


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
