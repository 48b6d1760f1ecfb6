"""Structured outputs and tool calls on the OpenAI routes: what a request's `response_format`, vLLM's
`guided_*` / `structured_outputs`, `tools` and `tool_choice` ask, as the grammar the server constrains the text
by (contract/grammar.py), and the tool calls read back from the text.

Tool calls, as vLLM makes them:

- `tool_choice: "required"`: the text is constrained to a JSON array of calls, `[{"name": N, "parameters":
  {...}}, ...]`, each call's `parameters` by its function's JSON schema (one call unless `parallel_tool_calls`);
- a named function: the text is constrained to its parameters' schema and is the call's `arguments`;
- `"auto"` (the default when tools are given): the model decides; its text is read by the tool-call parser of
  its own format (`hermes`: `<tool_call>{...}</tool_call>`, Qwen2.5/3 and Hermes; `llama3_json`: a JSON
  object of `name` and `parameters`, Llama 3.x; `mistral`: `[TOOL_CALLS][...]`), named by the setting
  SERVING_TOOL_CALL_PARSER or found in the model's chat template;
- `"none"`: the text is the answer.

The tools are given to the chat template as transformers gives them (`tools=`), so a template that describes
them to the model does. A streamed answer's tool calls come as OpenAI streams them: a delta naming the call
(its index, id, type and name), then pieces of its arguments; pieces add up to the whole answer's.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import re
import secrets
from typing import Any

from contract.grammar import Grammar
from serving.gateway.errors import InvalidInput

PARSERS = ("hermes", "llama3_json", "mistral")
# how a chat template that takes tools asks the model to call them: its parser (the first marker found wins)
TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "lark"}
STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}


# --- what the text must match --------------------------------------------------------------------------------


def response_grammar(extra: dict[str, Any]) -> tuple[Grammar | None, str]:
    """The grammar a request's `response_format` or vLLM's extensions ask (None: free text) and the field that
    asks it (an error about the grammar names it); 400 naming the field for a form these routes do not know, or
    for two of them at once."""
    asked = []
    response_format = extra.get("response_format")
    if response_format is not None:
        found = _response_format(response_format)
        if found is not None:
            asked.append(("response_format", found))
    for field, kind in GUIDED.items():
        if extra.get(field) is not None:
            asked.append((field, _grammar(field, kind, extra[field])))
    structured = extra.get("structured_outputs")
    if structured is not None:
        asked.append(("structured_outputs", _structured_outputs(structured)))
    if len(asked) > 1:
        fields = [field for field, _ in asked]
        raise InvalidInput(f"{fields[1]}: one constraint per request, got {fields}", param=fields[1])
    field, grammar = asked[0] if asked else ("response_format", None)
    return grammar, field


def _response_format(given: Any) -> Grammar | None:
    kind = given.get("type") if isinstance(given, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        inner = given.get("json_schema")
        schema = inner.get("schema", {}) if isinstance(inner, dict) else None
        if not isinstance(schema, dict | bool):
            raise InvalidInput(
                f"response_format.json_schema: expected an object with `name` and `schema` (a JSON schema), "
                f"got {str(inner)[:200]}",
                param="response_format",
            )
        return Grammar.json_schema(schema)
    raise InvalidInput(
        f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {str(kind)[:100]!r}",
        param="response_format",
    )


def _structured_outputs(given: Any) -> Grammar | None:
    if not isinstance(given, dict):
        raise InvalidInput(f"structured_outputs: expected an object, got {str(given)[:100]}", "structured_outputs")
    if given.get("json_object"):
        return Grammar.json_object()
    asked = [(key, kind) for key, kind in STRUCTURED.items() if given.get(key) is not None]
    if len(asked) != 1:
        expected = [*STRUCTURED, "json_object"]
        raise InvalidInput(f"structured_outputs: expected one of {expected}, got {sorted(given)}", "structured_outputs")
    key, kind = asked[0]
    return _grammar(f"structured_outputs.{key}", kind, given[key])


def _grammar(field: str, kind: str, value: Any) -> Grammar:
    if kind == "json_schema" and isinstance(value, str):  # vLLM takes a schema as its JSON text too
        try:
            value = json.loads(value)
        except ValueError as error:
            why = f"expected a JSON schema, got text that does not parse: {error}"
            raise InvalidInput(f"{field}: {why}", param=field) from None
    grammar = Grammar(kind, value)
    try:
        grammar.check()
    except ValueError as error:
        raise InvalidInput(f"{field}: {str(error).split(': ', 1)[-1]}", param=field.split(".", maxsplit=1)[0]) from None
    return grammar


# --- tools ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tools:
    """A request's tools and how it lets the model call them."""

    tools: list[dict[str, Any]]  # OpenAI's tool objects, as given (the chat template's `tools`)
    choice: str  # "none", "auto", "required", or "named"
    named: str | None  # the function a named choice calls
    parallel: bool  # more than one call allowed
    parser: str | None  # how "auto" reads calls from the text

    @property
    def functions(self) -> dict[str, dict[str, Any]]:
        return {tool["function"]["name"]: tool["function"] for tool in self.tools}

    def grammar(self) -> Grammar | None:
        """What the text must match: the calls' form for "required" and a named function (None otherwise)."""
        if self.choice == "named":
            return Grammar.json_schema(_parameters(self.functions[self.named]))
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": _parameters(function)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, function in self.functions.items()
        ]
        return Grammar.json_schema(
            {"type": "array", "items": {"anyOf": calls}, "minItems": 1} | ({} if self.parallel else {"maxItems": 1})
        )

    def reader(self) -> CallReader | None:
        """How one choice's text is read for calls (None: it is the answer)."""
        if self.choice == "none":
            return None
        if self.choice == "named":
            return NamedCall(self.named)
        if self.choice == "required":
            return CallArray()
        return ParsedCalls(self.parser)


def tools_of(extra: dict[str, Any], chat_template: str | None, parser_setting: str) -> Tools | None:
    """The tools a chat request gives (None: none); 400 naming the field for a malformed tool or choice."""
    tools, choice = extra.get("tools"), extra.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidInput(f"tool_choice: {str(choice)[:100]!r} needs tools, got none", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidInput(f"tools: expected a list of tools, got {type(tools).__name__}", param="tools")
    for at, tool in enumerate(tools):
        _check_tool(at, tool)
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise InvalidInput(f"tools: each function's name once, got {names}", param="tools")
    parallel = extra.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidInput(f"parallel_tool_calls: expected true or false, got {parallel!r}", "parallel_tool_calls")
    mode, named = _tool_choice(choice, names)
    parser = None
    if mode == "auto":
        parser = _parser(parser_setting, chat_template)
    return Tools(tools, mode, named, parallel, parser)


def _check_tool(at: int, tool: Any) -> None:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
        raise InvalidInput(
            f"tools[{at}]: expected {{'type': 'function', 'function': {{'name', 'parameters'}}}}, got "
            f"{str(tool)[:200]}",
            param="tools",
        )
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        expected = "1 to 64 of a-z, A-Z, 0-9, _ . -"
        raise InvalidInput(f"tools[{at}].function.name: expected {expected}, got {name!r}", param="tools")
    parameters = function.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput(f"tools[{at}].function.parameters: expected a JSON schema, got {parameters!r}", "tools")


def _tool_choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if named is None:
        raise InvalidInput(
            f"tool_choice: expected 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, "
            f"got {str(choice)[:200]}",
            param="tool_choice",
        )
    if named not in names:
        raise InvalidInput(f"tool_choice: no tool named {named!r}; the tools are {names}", param="tool_choice")
    return "named", named


def _parser(setting: str, chat_template: str | None) -> str:
    if setting in PARSERS:
        return setting
    found = next((parser for marker, parser in TEMPLATE_MARKERS if marker in (chat_template or "")), None)
    if found is None:
        raise InvalidInput(
            "tool_choice: 'auto' reads the calls in the model's own format, and this model's chat template names "
            f"none; set SERVING_TOOL_CALL_PARSER to one of {list(PARSERS)}, or ask tool_choice 'required' or a "
            "named function (the text is then constrained to the calls)",
            param="tool_choice",
        )
    return found


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as chat templates read them: an assistant's tool calls with their `arguments` as an object
    (OpenAI's clients send JSON text; templates write `arguments | tojson`), as vLLM gives them, and its
    missing content (null beside its calls) as empty text, which every template can write."""
    return [
        {**message, "content": message.get("content") or "", "tool_calls": [_call_for_template(call) for call in calls]}
        if isinstance(calls := message.get("tool_calls"), list)
        else message
        for message in messages
    ]


def _call_for_template(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


# --- reading calls back --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Call:
    id: str
    name: str
    arguments: str = ""

    def whole(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


class CallReader(abc.ABC):
    """One choice's text read for tool calls as it comes: `push(piece)` answers the content the piece adds
    and the tool-call deltas (OpenAI's chunk shape); `finish()` the same for what was held back. `calls` and
    `content` are the whole answer's."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.content = ""

    @abc.abstractmethod
    def push(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool-call deltas `piece` adds."""

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return "", []

    def _named(self, name: str) -> dict[str, Any]:
        call = Call(call_id(), name)
        self.calls.append(call)
        index = len(self.calls) - 1
        return {"index": index, "id": call.id, "type": "function", "function": {"name": name, "arguments": ""}}

    def _arguments(self, piece: str) -> dict[str, Any]:
        self.calls[-1].arguments += piece
        return {"index": len(self.calls) - 1, "function": {"arguments": piece}}


class NamedCall(CallReader):
    """A named function: the whole text is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def push(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        deltas = [] if self.calls else [self._named(self.name)]
        if piece:
            deltas.append(self._arguments(piece))
        return "", deltas


class CallArray(CallReader):
    """ "required": the text is `[{"name": N, "parameters": ARGS}, ...]` (the grammar's compact form), read a
    character at a time: a call is named once its `parameters` begin, and its arguments stream as they come."""

    HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "parameters": $')

    def __init__(self) -> None:
        super().__init__()
        self.depth, self.in_string, self.escaped = 0, False, False
        self.head = ""  # the current call's text before its arguments
        self.in_arguments = False

    def push(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        deltas: list[dict[str, Any]] = []
        arguments = ""
        for char in piece:
            if self.in_arguments:
                arguments += char
                if self._scan(char) and self.depth == 2:  # the arguments' object closed
                    self.in_arguments = False
                    deltas.append(self._arguments(arguments))
                    arguments = ""
                continue
            self._scan(char)
            if self.depth >= 2:
                self.head += char
                named = self.HEAD.search(self.head)
                if named:
                    deltas.append(self._named(json.loads(named.group(1))))
                    self.head, self.in_arguments = "", True
            else:
                self.head = ""
        if arguments:
            deltas.append(self._arguments(arguments))
        return "", deltas

    def _scan(self, char: str) -> bool:
        """Moves the JSON state past `char`; whether it closed an object or array."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
            return False
        if char == '"':
            self.in_string = True
        elif char in "[{":
            self.depth += 1
        elif char in "]}":
            self.depth -= 1
            return True
        return False


class ParsedCalls(CallReader):
    """ "auto": the model's own format, read by its parser. Text before a call streams as content; from the
    call's marker on it is held, and parsed when the answer ends (text that does not parse is content)."""

    def __init__(self, parser: str) -> None:
        super().__init__()
        self.parser, self.marker = parser, {name: marker for marker, name in TEMPLATE_MARKERS}[parser]
        self.held = ""
        self.calling = False

    def push(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        self.held += piece
        if self.calling:
            return "", []
        start = self._call_start()
        if start is not None:
            self.calling = True
            content, self.held = self.held[:start], self.held[start:]
            self.content += content
            return content, []
        keep = _partial_suffix(self.held, self.marker)
        content, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        if self.parser == "llama3_json" and not self.content and not content.strip():  # a JSON call may start yet
            self.held = content + self.held
            return "", []
        self.content += content
        return content, []

    def _call_start(self) -> int | None:
        at = self.held.find(self.marker)
        if at >= 0:
            return at
        if self.parser == "llama3_json" and not self.content and self.held.lstrip().startswith("{"):
            return 0
        return None

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        text, self.held = self.held, ""
        found = _parse_calls(self.parser, text) if self.calling else None
        if found is None:
            self.content += text
            return text, []
        before, calls = found
        self.content += before
        deltas = []
        for name, arguments in calls:
            deltas.append(self._named(name) | {"function": {"name": name, "arguments": arguments}})
            self.calls[-1].arguments = arguments
        return before, deltas


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _parse_calls(parser: str, text: str) -> tuple[str, list[tuple[str, str]]] | None:
    """(content outside the calls, [(name, arguments as JSON text)]) of the text from a call's start; None when
    it does not parse as the format's calls."""
    try:
        if parser == "hermes":
            found = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S)
            rest = re.sub(r"<tool_call>.*?(?:</tool_call>|$)", "", text, flags=re.S).strip()
            objects = [json.loads(body) for body in found]
        elif parser == "mistral":
            rest, objects = "", json.loads(text.split("[TOOL_CALLS]", 1)[1].strip())
        else:  # one JSON object, or several joined by ";" (Llama 3.x's parallel calls)
            body = text.strip().removeprefix("<|python_tag|>").strip()
            rest, objects = "", [json.loads(part) for part in _objects(body)]
        objects = objects if isinstance(objects, list) else [objects]
        calls = []
        for found_call in objects:
            arguments = found_call.get("arguments", found_call.get("parameters", {}))
            calls.append((str(found_call["name"]), json.dumps(arguments, ensure_ascii=False)))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None
    return rest, calls


def _objects(body: str) -> list[str]:
    """The JSON objects of `body`: the whole of it when it parses, else its parts between top-level ";"."""
    try:
        json.loads(body)
    except ValueError:
        return [part for part in body.split(";") if part.strip()]
    return [body]
