"""Structured outputs and tool calls served (issue 44): the shipped fortunes model behind a real Triton and the
gateway, over plain HTTP and through real clients (the openai SDK, langchain-openai), at temperature 1.0:
every answer constrained by a JSON schema parses and validates, `tool_choice` "required" and a named function
answer calls whose arguments validate, whole and streamed; a schema the compiler refuses is a 400 naming the
field; the project's own API (`POST /v1/generate`, `Session.generate`) takes a grammar turn by turn."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import numpy as np
import pytest

from client import Client, Grammar
from tests.gateway.conftest import FORTUNES_KEY, FORTUNES_MODEL

pytestmark = pytest.mark.served

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "wise"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 12}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": CLOCK}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "Who are you? Answer in JSON."}]


@pytest.fixture
def api(fortunes_served) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {FORTUNES_KEY}"}
    with httpx.Client(base_url=fortunes_served.gateway.url, headers=headers, timeout=120) as client:
        yield client


def chat(api: httpx.Client, **body) -> httpx.Response:
    return api.post("/v1/chat/completions", json={"model": FORTUNES_MODEL, "messages": ASK, **body})


def streamed(api: httpx.Client, **body) -> list[dict]:
    """The chunks of a streamed chat answer, [DONE] seen at the end."""
    chunks, done = [], False
    payload = {"model": FORTUNES_MODEL, "messages": ASK, "stream": True, **body}
    with api.stream("POST", "/v1/chat/completions", json=payload) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line.removeprefix("data: ")))
    assert done and all("error" not in chunk for chunk in chunks), chunks[-1]
    return chunks


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_a_strict_json_schema_at_temperature_one_answers_n_valid_objects_whole_and_streamed(api):
    answer = chat(api, response_format=schema_format(PERSON), temperature=1.0, n=3, seed=7)
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    assert len(choices) == 3 and {choice["finish_reason"] for choice in choices} == {"stop"}
    objects = [json.loads(choice["message"]["content"]) for choice in choices]
    for found in objects:
        jsonschema.validate(found, PERSON)
    assert len({json.dumps(found) for found in objects}) > 1  # three draws, not one answer thrice

    texts, finished = {0: "", 1: "", 2: ""}, {}
    for chunk in streamed(api, response_format=schema_format(PERSON), temperature=1.0, n=3, seed=8):
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
            if choice["finish_reason"]:
                finished[choice["index"]] = choice["finish_reason"]
    assert finished == {0: "stop", 1: "stop", 2: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_json_mode_and_vllms_guided_fields_constrain_completions_too(api):
    body = {"model": FORTUNES_MODEL, "prompt": "Q: pick one\nA:", "temperature": 1.0, "max_tokens": 40}
    chosen = api.post("/v1/completions", json=body | {"guided_choice": ["heads", "tails"]}).json()
    assert chosen["choices"][0]["text"] in ("heads", "tails")
    pattern = api.post("/v1/completions", json=body | {"guided_regex": "[0-9]{3}-[A-Z]{2}"}).json()
    assert re.fullmatch("[0-9]{3}-[A-Z]{2}", pattern["choices"][0]["text"])
    structured = api.post("/v1/completions", json=body | {"structured_outputs": {"json": PERSON}, "max_tokens": 120})
    jsonschema.validate(json.loads(structured.json()["choices"][0]["text"]), PERSON)
    json_mode = chat(api, response_format={"type": "json_object"}, temperature=1.0, seed=3)
    choice = json_mode.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    if choice["finish_reason"] == "stop":  # any object: a small model may fill its budget with keys
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_a_budget_that_ends_the_json_early_finishes_with_length(api):
    answer = chat(api, response_format=schema_format(PERSON), max_completion_tokens=3, temperature=1.0).json()
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith('{"')


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in message["tool_calls"]]


def test_tool_choice_required_answers_calls_whose_arguments_validate_whole_and_streamed(api):
    one = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "temperature": 1.0}
    for seed in range(3):
        answer = chat(api, **one, seed=seed)
        assert answer.status_code == 200, answer.text
        (choice,) = answer.json()["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        ((name, arguments),) = calls_of(choice["message"])
        assert choice["message"]["tool_calls"][0]["id"].startswith("call_")
        jsonschema.validate(arguments, PARAMETERS[name])

    # parallel calls: the array goes on while the model adds calls, so a random one may reach its budget first
    parallel = chat(api, tools=TOOLS, tool_choice="required", temperature=1.0, seed=0).json()["choices"][0]
    assert parallel["finish_reason"] in ("tool_calls", "length")
    if parallel["finish_reason"] == "tool_calls":
        for name, arguments in calls_of(parallel["message"]):
            jsonschema.validate(arguments, PARAMETERS[name])
    else:
        assert parallel["message"]["content"].startswith('[{"name": ')  # the unfinished array, as text

    calls: dict[int, dict] = {}
    finish = None
    for chunk in streamed(api, **one, seed=5):
        for choice in chunk["choices"]:
            for delta in choice["delta"].get("tool_calls", []):
                call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
                call["name"] += delta.get("function", {}).get("name", "")
                call["arguments"] += delta.get("function", {}).get("arguments", "")
            finish = choice["finish_reason"] or finish
    assert finish == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMETERS[calls[0]["name"]])


def test_a_named_function_is_called_with_arguments_that_validate(api):
    choice = {"type": "function", "function": {"name": "get_time"}}
    answer = chat(api, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=1).json()
    (found,) = answer["choices"]
    ((name, arguments),) = calls_of(found["message"])
    assert name == "get_time" and found["finish_reason"] == "tool_calls"
    jsonschema.validate(arguments, CLOCK)
    # a tool's result goes back as a `tool` message with its call's id, the call's arguments as JSON text
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": found["message"]["tool_calls"]},
        {"role": "tool", "tool_call_id": found["message"]["tool_calls"][0]["id"], "content": "12:00"},
    ]
    follow = api.post("/v1/chat/completions", json={"model": FORTUNES_MODEL, "messages": turn, "max_tokens": 4})
    assert follow.status_code == 200, follow.text


@pytest.mark.parametrize(
    ("body", "param", "said"),
    [
        ({"response_format": schema_format({"type": "objekt"})}, "response_format", "Invalid type: objekt"),
        ({"guided_regex": "(?<=a)b"}, "guided_regex", "look-around"),
        ({"response_format": {"type": "yaml"}}, "response_format", "expected 'text', 'json_object' or"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "SERVING_TOOL_CALL_PARSER"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "a b"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "one constraint"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format", "ignore_eos"),
    ],
)
def test_a_constraint_refused_is_a_400_naming_its_field_and_the_gateway_goes_on(api, body, param, said):
    answer = chat(api, **body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and said in error["message"], error
    assert chat(api, max_completion_tokens=2).status_code == 200


def test_the_openai_sdk_parses_into_a_pydantic_model_and_streams_tool_calls(fortunes_served):
    import openai
    import pydantic

    class Person(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=16)
        age: int = pydantic.Field(ge=0, le=120)

    client = openai.OpenAI(base_url=f"{fortunes_served.gateway.url}/v1", api_key=FORTUNES_KEY, max_retries=0)
    parsed = client.chat.completions.parse(model=FORTUNES_MODEL, messages=ASK, response_format=Person, temperature=1.0)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120

    stream = client.chat.completions.create(
        model=FORTUNES_MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        stream=True,
        temperature=1.0,
    )
    arguments, names = {}, {}
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            names[delta.index] = names.get(delta.index, "") + (delta.function.name or "")
            arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
    assert names
    for index, name in names.items():
        jsonschema.validate(json.loads(arguments[index]), PARAMETERS[name])


def test_langchain_structured_output_and_bound_tools_against_the_gateway(fortunes_served):
    import pydantic
    from langchain_openai import ChatOpenAI

    class Mood(pydantic.BaseModel):
        """A mood."""

        mood: str = pydantic.Field(description="one word", max_length=10)
        sure: bool

    model = ChatOpenAI(
        model=FORTUNES_MODEL,
        base_url=f"{fortunes_served.gateway.url}/v1",
        api_key=FORTUNES_KEY,
        temperature=1.0,
        max_retries=0,
    )
    found = model.with_structured_output(Mood).invoke("How do you feel?")
    assert isinstance(found, Mood)

    # a tool in OpenAI's shape, its strings bounded: a small model left free in a string writes to its budget
    message = model.bind_tools([TOOLS[0]], tool_choice="required", parallel_tool_calls=False).invoke("Weather?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER)


def test_the_projects_own_api_takes_a_grammar_turn_by_turn(api, fortunes_served):
    body = {"input_ids": [40, 41], "max_new_tokens": 60, "stop_token_ids": [0], "temperature": 1.0, "seed": 2}
    answer = api.post("/v1/generate", json=body | {"grammar": {"json_schema": PERSON}})
    assert answer.status_code == 200, answer.text
    assert answer.json()["finish_reason"] == "stop"
    refused = api.post("/v1/generate", json=body | {"grammar": {"regex": "(?<=a)b"}})
    assert refused.status_code == 400 and "look-around" in refused.json()["error"]["message"]

    import tokenizers

    from contract.files import TOKENIZER_FILENAME, TRAINED_MODEL

    tokenizer = tokenizers.Tokenizer.from_file(str(TRAINED_MODEL / TOKENIZER_FILENAME))
    with Client(fortunes_served.triton.grpc_url) as client, client.session() as session:
        first = session.generate(
            np.array(tokenizer.encode("Yes or no?").ids), grammar=Grammar.choice(["yes", "no"]), stop_token_ids=[0]
        )
        assert tokenizer.decode(list(first)) in ("yes", "no") and first.finish_reason == "stop"
        second = session.generate(
            np.array(tokenizer.encode(" A number:").ids), grammar=Grammar.regex("[1-9][0-9]?"), stop_token_ids=[0]
        )
        assert 1 <= int(tokenizer.decode(list(second))) <= 99
        assert session.length == len(tokenizer.encode("Yes or no?").ids) + len(first.tokens) + len(
            tokenizer.encode(" A number:").ids
        ) + len(second.tokens)
