"""How the OpenAI routes read what a request asks of its text and read tool calls back (serving/gateway/
structured.py), without a server: the constraint each field asks, the calls' grammar, the readers fed text in
pieces of every size (what a stream sends adds up to the whole answer), each model format's parser."""

from __future__ import annotations

import json

import pytest

from contract.grammar import Grammar
from serving.gateway.errors import InvalidInput
from serving.gateway.structured import (
    CallArray,
    NamedCall,
    ParsedCalls,
    response_grammar,
    template_messages,
    tools_of,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]


def test_each_field_asks_its_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_grammar({"response_format": {"type": "text"}}) == (None, "response_format")
    assert response_grammar({"response_format": {"type": "json_object"}}) == (Grammar.json_object(), "response_format")
    given = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert response_grammar({"response_format": given}) == (Grammar.json_schema(schema), "response_format")
    assert response_grammar({"guided_json": json.dumps(schema)}) == (Grammar.json_schema(schema), "guided_json")
    assert response_grammar({"guided_regex": "[a-z]+"}) == (Grammar.regex("[a-z]+"), "guided_regex")
    assert response_grammar({"guided_choice": ["a", "b"]}) == (Grammar.choice(["a", "b"]), "guided_choice")
    assert response_grammar({"guided_grammar": "start: /x/"}) == (Grammar.lark("start: /x/"), "guided_grammar")
    assert response_grammar({"structured_outputs": {"regex": "[0-9]"}}) == (
        Grammar.regex("[0-9]"),
        "structured_outputs",
    )
    assert response_grammar({"structured_outputs": {"json_object": True}}) == (
        Grammar.json_object(),
        "structured_outputs",
    )
    with pytest.raises(InvalidInput, match="guided_json: expected a JSON schema"):
        response_grammar({"guided_json": "{not json"})
    with pytest.raises(InvalidInput, match="structured_outputs: expected one of"):
        response_grammar({"structured_outputs": {"regex": "a", "choice": ["b"]}})


def test_required_constrains_to_an_array_of_named_calls_and_a_named_choice_to_its_arguments():
    required = tools_of({"tools": TOOLS, "tool_choice": "required"}, None, "template")
    array = required.grammar().value
    assert array["minItems"] == 1 and "maxItems" not in array
    names = [option["properties"]["name"]["const"] for option in array["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert array["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER
    single = tools_of({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, None, "template")
    assert single.grammar().value["maxItems"] == 1
    named = tools_of(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, None, ""
    )
    assert named.grammar() == Grammar.json_schema(WEATHER)
    assert tools_of({"tools": TOOLS, "tool_choice": "none"}, None, "template").grammar() is None


def test_auto_reads_the_format_the_template_names_or_the_setting_and_else_says_what_to_set():
    qwen = "{%- if tools %}<tools>{{ tools }}</tools> <tool_call>{%- endif %}"
    assert tools_of({"tools": TOOLS}, qwen, "template").parser == "hermes"
    assert tools_of({"tools": TOOLS}, "[TOOL_CALLS]", "template").parser == "mistral"
    assert tools_of({"tools": TOOLS}, "plain", "llama3_json").parser == "llama3_json"
    with pytest.raises(InvalidInput, match="SERVING_TOOL_CALL_PARSER"):
        tools_of({"tools": TOOLS}, "{{ messages }}", "template")
    with pytest.raises(InvalidInput, match="needs tools"):
        tools_of({"tool_choice": "required"}, None, "template")
    with pytest.raises(InvalidInput, match="each function's name once"):
        tools_of({"tools": [TOOLS[0], TOOLS[0]]}, None, "template")


def pieces(text: str, size: int) -> list[str]:
    return [text[at : at + size] for at in range(0, len(text), size)]


def read(reader, text: str, size: int) -> tuple[str, dict[int, dict]]:
    """What a stream of `text` in pieces of `size` characters answers: its content and its calls, assembled
    from the deltas as an OpenAI client assembles them."""
    content, calls = "", {}
    answered = [reader.push(piece) for piece in pieces(text, size)] + [reader.finish()]
    for piece, deltas in answered:
        content += piece
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.get("id", call["id"])
            call["name"] += delta.get("function", {}).get("name", "")
            call["arguments"] += delta.get("function", {}).get("arguments", "")
    return content, calls


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_a_call_array_streams_each_calls_arguments_as_they_come_and_they_add_up(size):
    text = '[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}"}}, {"name": "get_time", "parameters": {}}]'
    reader = CallArray()
    content, calls = read(reader, text, size)
    assert content == ""
    assert [(call["name"], json.loads(call["arguments"])) for call in calls.values()] == [
        ("get_weather", {"city": 'Pa"ris}'}),
        ("get_time", {}),
    ]
    assert [call.whole()["function"] for call in reader.calls] == [
        {"name": call["name"], "arguments": call["arguments"]} for call in calls.values()
    ]
    assert all(call["id"].startswith("call_") for call in calls.values())


def test_a_named_call_is_its_whole_text():
    content, calls = read(NamedCall("get_time"), '{"zone": "UTC"}', 4)
    assert content == "" and calls == {0: {"id": calls[0]["id"], "name": "get_time", "arguments": '{"zone": "UTC"}'}}


@pytest.mark.parametrize("size", [1, 5, 1000])
@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [
        (
            "hermes",
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "Let me look.\n",
        ),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', ""),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', ""),
        ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', ""),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris; Texas"}}', ""),
    ],
)
def test_auto_parsers_read_each_models_format(parser, text, content, size):
    found, calls = read(ParsedCalls(parser), text, size)
    assert found == content
    assert [(call["name"], json.loads(call["arguments"])["city"][:5]) for call in calls.values()] == [
        ("get_weather", "Paris")
    ]


@pytest.mark.parametrize("parser", ["hermes", "mistral", "llama3_json"])
def test_text_that_is_no_call_is_content_whole(parser):
    text = "The weather is <tool fine> [TOOL today, {not json."
    found, calls = read(ParsedCalls(parser), text, 3)
    assert found == text and calls == {}
    broken = {"hermes": "<tool_call>{oops", "mistral": "[TOOL_CALLS][{oops", "llama3_json": "{oops"}[parser]
    found, calls = read(ParsedCalls(parser), broken, 2)
    assert found == broken and calls == {}


def test_tool_calls_given_back_reach_the_template_with_arguments_as_objects():
    messages = [
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "2"},
    ]
    fixed = template_messages(messages)
    assert fixed[0]["content"] == "" and fixed[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert fixed[1] == messages[1]
