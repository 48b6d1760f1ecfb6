"""What a constrained generation's text must match: a JSON schema, a regular expression, a Lark grammar or one of
a few strings. The server's engine turns it into a token mask before each token (serving/engine/constraint.py,
llguidance); here it is only the request's field, read the same way by the client, the gateway and the server.

On the wire it is one Triton request parameter (`grammar`), a JSON object of one key, the kind, whose value is
the grammar: `{"json_schema": {...}}`, `{"regex": "[a-z]+"}`, `{"lark": "start: ..."}`, `{"choice": ["a", "b"]}`.

A JSON schema's text is written compactly: no whitespace between tokens but ", " after an item and ": " after
a key (Python's `json.dumps`), so a small model cannot spend its budget on blank space and two answers of the
same values are the same text. A schema may say otherwise under llguidance's own key, `x-guidance`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from contract.inputs import InputError

GRAMMAR = "grammar"  # the Triton request parameter
KINDS = ("json_schema", "regex", "lark", "choice")
# how a JSON schema's text is laid out unless the schema says otherwise (llguidance's JSON compile options)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_BYTES = 1 << 20  # a grammar larger than this is refused before anything is compiled


@dataclasses.dataclass(frozen=True)
class Grammar:
    """One constraint: `kind` (KINDS) and its grammar (a schema as a dict, a pattern, a grammar's text, or the
    strings of a choice)."""

    kind: str
    value: Any

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> Grammar:
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's JSON mode)."""
        return cls("json_schema", {"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """A Lark grammar (llguidance's dialect; a GBNF grammar, llama.cpp's, is read too)."""
        return cls("lark", grammar)

    @classmethod
    def choice(cls, options: list[str]) -> Grammar:
        return cls("choice", list(options))

    def check(self) -> None:
        """InputError naming `grammar` when the kind is unknown or the value is not of the kind's type."""
        expected = {"json_schema": (dict, bool), "regex": str, "lark": str, "choice": list}.get(self.kind)
        if expected is None:
            raise InputError(GRAMMAR, f"expected one of the kinds {list(KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, expected):
            shape = {"json_schema": "a JSON schema (an object)", "choice": "a list of strings"}.get(self.kind, "text")
            raise InputError(GRAMMAR, f"{self.kind}: expected {shape}, got {type(self.value).__name__}")
        if self.kind == "choice" and (not self.value or not all(isinstance(o, str) and o for o in self.value)):
            raise InputError(GRAMMAR, f"choice: expected a list of non-empty strings, got {self.value!r}")
        if isinstance(self.value, str) and not self.value:
            raise InputError(GRAMMAR, f"{self.kind}: expected a non-empty {self.kind}, got ''")

    def to_parameter(self) -> str:
        return json.dumps({self.kind: self.value}, separators=(",", ":"))

    @classmethod
    def from_parameter(cls, text: Any) -> Grammar:
        """The grammar of its request parameter; InputError naming `grammar` for anything else."""
        if not isinstance(text, str):
            raise InputError(GRAMMAR, f"expected a JSON object as a string, got {type(text).__name__}")
        size = len(text.encode())
        if size > MAX_GRAMMAR_BYTES:
            raise InputError(GRAMMAR, f"expected at most {MAX_GRAMMAR_BYTES} bytes, got {size}")
        try:
            parsed = json.loads(text)
        except ValueError as error:
            raise InputError(GRAMMAR, f"expected a JSON object, got text that does not parse: {error}") from None
        return cls.of(parsed)

    @classmethod
    def of(cls, given: Any) -> Grammar:
        """The grammar of its JSON form, `{kind: grammar}`; InputError naming `grammar` for anything else."""
        if not isinstance(given, dict) or len(given) != 1:
            raise InputError(GRAMMAR, f"expected an object of one key, one of {list(KINDS)}, got {str(given)[:200]}")
        ((kind, value),) = given.items()
        grammar = cls(kind, value)
        grammar.check()
        return grammar
