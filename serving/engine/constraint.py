"""Constrained decoding: a generation whose text must match a grammar (contract/grammar.py) picks each token
among those that keep the text matchable. llguidance does the work (MIT; Microsoft's Guidance team; what vLLM,
SGLang and llama.cpp use too): it reads the model's tokenizer.json, compiles a JSON schema, a regular
expression or a Lark grammar into an Earley parser over lexemes, and answers the allowed tokens as a bitmask
in tens of microseconds a token, with no torch (docs/design.md, "Structured outputs", says why this one).

`Grammars` is one model's compiler (its tokenizer); `Constraint` is one generation's matcher: the core asks for
its mask before each token (`masks_soon`: a batch's masks filled together by llguidance's executor, on a thread
of their own with the GIL released, while the graph runs) and feeds it the token picked. A generation's constraint lives
as long as the generation: its session may be rewound, forked or snapshotted between generations, and each
generation brings its own grammar, so no matcher ever needs rolling back.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from contract.grammar import GRAMMAR, JSON_LAYOUT, Grammar
from contract.inputs import InputError
from serving.engine import errors

if TYPE_CHECKING:
    import llguidance


class Constraint:
    """One generation's grammar state: which tokens may come next, and the text so far matched."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size

    def consume(self, token: int) -> None:
        """The token picked (one the mask allowed); a ServingError if the matcher refuses it (a bug of ours)."""
        if not self.matcher.consume_token(token):
            raise errors.ServingError(f"the grammar refused token {token}, which its mask allowed: {self._error()}")

    @property
    def stopped(self) -> bool:
        """Nothing more may come: its end token was picked where the grammar could go on, or the grammar is
        complete (a JSON object's closing brace): the generation ends there, without the end token."""
        return self.matcher.is_stopped()

    def _error(self) -> str:
        return self.matcher.get_error() or "no reason given"


class Grammars:
    """A model's grammar compiler: its tokenizer.json read once per set of end ids."""

    def __init__(self, tokenizer_json: bytes | str | None, vocab_size: int) -> None:
        self._tokenizer_json = tokenizer_json.decode() if isinstance(tokenizer_json, bytes) else tokenizer_json
        self.vocab_size = vocab_size
        self._tokenizers: dict[tuple[int, ...], llguidance.LLTokenizer] = {}
        self._lock = threading.Lock()

    def compile(self, grammar: Grammar, end_ids: Sequence[int]) -> Constraint:
        """`grammar`'s matcher for a generation that ends at `end_ids`; InputError naming `grammar` and the
        compiler's reason when the grammar is refused (before anything is generated)."""
        grammar.check()
        if not end_ids:
            raise InputError(GRAMMAR, "a constrained generation needs stop_token_ids: the grammar's end is one of them")
        matcher = _llguidance().LLMatcher(self._tokenizer(tuple(end_ids)), _llguidance_grammar(grammar), log_level=0)
        if matcher.is_error():
            raise InputError(GRAMMAR, f"{grammar.kind}: the grammar is refused: {matcher.get_error().strip()}")
        return Constraint(matcher, self.vocab_size)

    def _tokenizer(self, end_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
        if self._tokenizer_json is None:
            raise InputError(
                GRAMMAR, "this model serves no tokenizer (token ids only): a grammar is read through its tokenizer.json"
            )
        with self._lock:
            found = self._tokenizers.get(end_ids)
            if found is None:
                outside = [token for token in end_ids if not 0 <= token < self.vocab_size]
                if outside:
                    raise InputError(GRAMMAR, f"end ids must lie in [0, {self.vocab_size}), got {outside}")
                tokenizer = _llguidance().LLTokenizer
                found = tokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=list(end_ids))
                self._tokenizers[end_ids] = found
            return found


def _llguidance_grammar(grammar: Grammar) -> str:
    """llguidance's grammar text of ours; InputError naming `grammar` for text its converters refuse."""
    llguidance = _llguidance()
    try:
        if grammar.kind == "json_schema":
            schema = json.dumps(closed(grammar.value))
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if grammar.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(grammar.value)
        if grammar.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(grammar.value))
        return llguidance.grammar_from("grammar", grammar.value)  # Lark, or GBNF converted to Lark
    except ValueError as error:
        raise InputError(GRAMMAR, f"{grammar.kind}: the grammar is refused: {error}") from None


def masks(constraints: Sequence[Constraint]) -> list[np.ndarray]:
    """The tokens each constraint allows next, (vocab,) bool each, filled together (llguidance's executor, in
    parallel where there are cores)."""
    if not constraints:
        return []
    vocab = max(constraint.vocab_size for constraint in constraints)
    words = np.zeros((len(constraints), (vocab + 31) // 32), np.int32)
    pairs = [(constraint.matcher, row) for row, constraint in enumerate(constraints)]
    _llguidance().numpy.fill_next_token_bitmask_par(_executor(), pairs, words)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").view(np.bool_)
    return [bits[row, : constraint.vocab_size] for row, constraint in enumerate(constraints)]


def _timed_masks(constraints: Sequence[Constraint]) -> tuple[list[np.ndarray], float]:
    """`masks(constraints)` and the seconds they took."""
    started = time.perf_counter()
    filled = masks(constraints)
    return filled, time.perf_counter() - started


def masks_soon(constraints: Sequence[Constraint]) -> Future:
    """`_timed_masks(constraints)`, filled on a thread of its own while the caller runs the graph."""
    return _filler().submit(_timed_masks, list(constraints))


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return _llguidance().LLExecutor()


def _llguidance():
    """llguidance, imported when a grammar first needs it: a server that constrains nothing runs without it
    (an image built before it was a dependency), and says what is missing when one does."""
    try:
        import llguidance
        import llguidance.numpy
    except ImportError as error:
        raise errors.ServingError(
            f"constrained decoding needs llguidance, which this server's Python lacks ({error}): pip install "
            "llguidance==1.9.1 (pyproject.toml's serving extra)"
        ) from None
    return llguidance


@functools.cache
def _filler() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")


OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
SCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "additionalItems")


def closed(schema: Any) -> Any:
    """The schema with every object that lists its `properties` and says nothing of others closed to them
    (`additionalProperties: false`), as OpenAI's strict mode asks and xgrammar's strict mode does: JSON
    Schema lets an object carry any other key by default, and a model left free to add keys may write them
    until its budget ends. Every text the closed schema admits, the original admits too."""
    if not isinstance(schema, dict):
        return schema
    inner = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            inner[key] = {name: closed(value) for name, value in schema[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            inner[key] = [closed(value) for value in schema[key]]
    for key in SCHEMAS:
        if key in schema:
            inner[key] = closed(schema[key])
    if isinstance(schema.get("properties"), dict) and not any(key in schema for key in OPEN_KEYS):
        inner["additionalProperties"] = False
    return inner
