"""Generation on the server: what a generation request of the session model carries and what its responses
answer.

A whole model's session model (`sessions`, decoupled: serving/triton/models/sessions.py) generates in its
engine core (serving/engine/core.py): a request with the parameter `generate` names a session (its sequence id,
Triton's correlation id), brings new token ids (or none, to continue after what the session holds) and the
sampling parameters; the core decodes it with every other running generation, a token each step, until
`max_new_tokens`, a stop token, the session's end (max_seq_len) or cancellation, and answers one response per
token, then a final one with the finish reason. The session keeps every token it was given and generated: the
prompt and each generated token are in its KV cache when the generation ends, so snapshot, fork, rewind and a
next generation go on from there.

One table of names and one parser, used by the server, the client and the gateway alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from contract.grammar import GRAMMAR, Grammar
from contract.inputs import InputError
from contract.sampling import MAX_LOGPROBS, SamplingParams

# --- request parameters (Triton request parameters: bool, int or string values) ---------------------------
GENERATE = "generate"  # true: the request is a generation (not a step)
PRIORITY = "priority"  # an integer, lower first among generations waiting for their turn (default 0)
MAX_NEW_TOKENS = "max_new_tokens"
STOP_TOKEN_IDS = "stop_token_ids"  # a string: the ids, comma-separated ("" for none)
SESSION_START = "session_start"  # START the sequence before the prompt (a new session, or a stateless call)
SESSION_END = "session_end"  # END it after the generation (a stateless call: nothing kept)
# start from the longest prefix of the prompt that a kept row of the same owner holds (a copy of it, rewound to
# where the two part), and keep this generation's row for the next request when it ends with its session
# (the engine core's prefix reuse: the owner is the request's `owner` parameter, names.OWNER)
REUSE_PREFIX = "reuse_prefix"
# a request of its own on the generation's stream: stop the session's generation before its next token; it
# then answers its final response (the finish reason `cancelled` and the positions held), so the client
# that stops knows exactly what the session keeps (a dropped stream stops it too, unanswered)
STOP_GENERATION = "stop_generation"
# the log-probability of each prompt token given the ones before it (and the top N there): an int N >= 0
# (absent: none). The prompt is then prefilled with every position's logits, and one response before the
# tokens answers PROMPT_LOGPROB and the top N (how perplexity is measured: OpenAI's `echo` with `logprobs`)
PROMPT_LOGPROBS = "prompt_logprobs"
# a request of its own: answer the tokenizer files this model serves with (TEXT_FILE_NAMES and
# TEXT_FILE_CONTENTS in one response); nothing is generated and no session is touched
TEXT_FILES = "text_files"
P_TEXT_DIGEST = "text_digest"  # the model config's parameter: `text_digest` of those files (absent: none)
# the sampling parameters, by SamplingParams' own field names; floats travel as strings (Triton's request
# parameters have no float type)
SAMPLING_FIELDS = tuple(field.name for field in dataclasses.fields(SamplingParams))
LOGIT_BIAS = "logit_bias"  # travels as "id:bias,id:bias" (Triton's request parameters have no maps)
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")

# --- outputs ----------------------------------------------------------------------------------------------
TOKEN_ID = "token_id"  # [1] int64: the generated token of this response
LOGPROB = "logprob"  # [1] float32: its log-probability (contract/sampling.py says of what)
TOP_TOKEN_IDS = "top_token_ids"  # [N] int64: the N most likely ids at this position (N = logprobs)
TOP_LOGPROBS = "top_logprobs"  # [N] float32: theirs
FINISH_REASON = "finish_reason"  # [1] bytes, on the final response only
CACHED_TOKENS = "cached_tokens"  # [1] int64, on the final response: prompt ids a kept row saved (REUSE_PREFIX)
PROMPT_LOGPROB = "prompt_logprob"  # [T] float32: each prompt token's logprob (NaN: the first, nothing before it)
PROMPT_TOP_TOKEN_IDS = "prompt_top_token_ids"  # [T, N] int64: the N most likely ids at each prompt position
PROMPT_TOP_LOGPROBS = "prompt_top_logprobs"  # [T, N] float32: theirs
TEXT_FILE_NAMES = "text_file_names"  # [F] bytes: contract.files.TEXT_FILES the model has
TEXT_FILE_CONTENTS = "text_file_contents"  # [F] bytes: each one's content
# the final response also answers names.HELD_LENGTH: the positions the session holds afterwards

# --- finish reasons ---------------------------------------------------------------------------------------
STOP = "stop"  # a stop token was generated (it is answered, and kept in the session)
LENGTH = "length"  # max_new_tokens generated
SESSION_FULL = "max_seq_len"  # the session holds max_seq_len positions: no room for another token
CANCELLED = "cancelled"  # the client left (closed the stream): what was answered is kept
FINISH_REASONS = (STOP, LENGTH, SESSION_FULL, CANCELLED)

DEFAULT_MAX_NEW_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One generation: how many tokens at most, which ids stop it, how to pick them, and whether the
    session starts with it (START) and ends after it (END: a stateless generation)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    session_start: bool = False
    session_end: bool = False
    prompt_logprobs: int | None = None  # N: each prompt token's logprob and the top N there (None: not asked)
    reuse_prefix: bool = False  # REUSE_PREFIX
    # what the text must match (contract/grammar.py): each token is picked among those that keep it matchable,
    # and the generation stops (finish reason `stop`) at a stop token the grammar allowed, or once the grammar
    # allows nothing more (a JSON object closed: no stop token is then generated)
    grammar: Grammar | None = None

    def check(self, vocab_size: int, max_seq_len: int) -> None:
        """Raises InputError naming the parameter, what it takes and what it got."""
        # 0 new tokens: the prompt only (scored with prompt_logprobs, or kept in the session)
        if not isinstance(self.max_new_tokens, int) or not 0 <= self.max_new_tokens <= max_seq_len:
            raise InputError(MAX_NEW_TOKENS, f"expected an integer in [0, {max_seq_len}], got {self.max_new_tokens!r}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InputError(PROMPT_LOGPROBS, f"expected an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        bad = [token for token in self.stop_token_ids if not 0 <= token < vocab_size]
        if bad:
            raise InputError(STOP_TOKEN_IDS, f"expected ids in [0, {vocab_size}), got {bad}")
        self.sampling.check()
        biased = [token for token, _ in self.sampling.logit_bias if token >= vocab_size]
        if biased:
            raise InputError("logit_bias", f"expected ids in [0, {vocab_size}), got {biased[:5]}")
        if self.grammar is not None:
            self.grammar.check()
            if not self.stop_token_ids:
                raise InputError(
                    GRAMMAR, "a constrained generation needs stop_token_ids: the grammar's end is one of them"
                )

    def to_parameters(self) -> dict[str, bool | int | str]:
        """Triton request parameters (what `from_parameters` reads back)."""
        values: dict[str, bool | int | str] = {
            GENERATE: True,
            MAX_NEW_TOKENS: self.max_new_tokens,
            STOP_TOKEN_IDS: ",".join(map(str, self.stop_token_ids)),
            SESSION_START: self.session_start,
            SESSION_END: self.session_end,
        }
        if self.reuse_prefix:
            values[REUSE_PREFIX] = True
        if self.prompt_logprobs is not None:
            values[PROMPT_LOGPROBS] = self.prompt_logprobs
        if self.grammar is not None:
            values[GRAMMAR] = self.grammar.to_parameter()
        for name in SAMPLING_FIELDS:
            value = getattr(self.sampling, name)
            if name == LOGIT_BIAS:
                if value:
                    values[name] = ",".join(f"{token}:{bias!r}" for token, bias in value)
            elif value is not None:
                values[name] = repr(float(value)) if name in FLOAT_FIELDS else value
        return values

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, Any] | str | None) -> GenerationRequest:
        """The request of Triton request parameters (a dict, or the JSON a Python model reads); raises
        InputError naming a parameter of the wrong type."""
        if isinstance(parameters, str) or parameters is None:
            parameters = json.loads(parameters or "{}")
        sampling = {name: _sampling_value(name, parameters[name]) for name in SAMPLING_FIELDS if name in parameters}
        return cls(
            max_new_tokens=_integer(MAX_NEW_TOKENS, parameters.get(MAX_NEW_TOKENS, DEFAULT_MAX_NEW_TOKENS)),
            stop_token_ids=_ids(parameters.get(STOP_TOKEN_IDS, "")),
            sampling=SamplingParams(**sampling),
            session_start=_boolean(SESSION_START, parameters.get(SESSION_START, False)),
            session_end=_boolean(SESSION_END, parameters.get(SESSION_END, False)),
            prompt_logprobs=_optional_integer(PROMPT_LOGPROBS, parameters.get(PROMPT_LOGPROBS)),
            reuse_prefix=_boolean(REUSE_PREFIX, parameters.get(REUSE_PREFIX, False)),
            grammar=None if parameters.get(GRAMMAR) is None else Grammar.from_parameter(parameters[GRAMMAR]),
        )


def text_digest(text_files: Mapping[str, str]) -> str:
    """One sha256 over the text files' names and sha256s (name -> hex digest): what a gateway compares the
    files it fetched with, and keys its cache by."""
    listing = "".join(f"{digest}  {name}\n" for name, digest in sorted(text_files.items()))
    return hashlib.sha256(listing.encode()).hexdigest()


def _optional_integer(name: str, value: Any) -> int | None:
    return None if value is None else _integer(name, value)


def _sampling_value(name: str, value: Any) -> Any:
    if name == LOGIT_BIAS:
        try:
            return tuple((int(token), float(bias)) for token, bias in (pair.split(":") for pair in value.split(",")))
        except (AttributeError, ValueError):
            raise InputError(name, f"expected comma-separated id:bias pairs, got {value!r}") from None
    if name in FLOAT_FIELDS:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise InputError(name, f"expected a number, got {value!r}") from None
    return None if value is None else _integer(name, value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(name, f"expected an integer, got {value!r}")
    return value


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InputError(name, f"expected true or false, got {value!r}")
    return value


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(_integer(STOP_TOKEN_IDS, token) for token in value)
    try:
        return tuple(int(token) for token in str(value).split(",") if token.strip())
    except ValueError:
        raise InputError(STOP_TOKEN_IDS, f"expected comma-separated integer ids, got {value!r}") from None
