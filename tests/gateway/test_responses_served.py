"""OpenAI's Responses API served (serving/gateway/responses_api.py), against the shipped fortunes model through
the openai SDK's `client.responses`: a conversation of three turns chained by `previous_response_id` answers
what a chat of the whole conversation does (greedy) and prefills only what each turn adds; streamed, its typed
events add up to the same text; stored responses are read and deleted by their key only, kept in Redis across
a gateway's restart, and a continuation whose kept row is gone prefills the stored conversation whole."""

from __future__ import annotations

import itertools

import httpx
import pytest

from tests.gateway.conftest import FORTUNES_KEY, FORTUNES_MODEL, FORTUNES_OTHER_KEY, running

pytestmark = pytest.mark.served

TURNS = ("Tell me a joke.", "Another one?", "Why is that funny?")
GREEDY = {"temperature": 0, "max_output_tokens": 12}


def sdk(url: str, key: str = FORTUNES_KEY):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def converse(client, turns=TURNS, **extra) -> list:
    """Each turn a response continuing the one before."""
    answers, previous = [], None
    for turn in turns:
        previous = client.responses.create(
            model=FORTUNES_MODEL, input=turn, previous_response_id=previous, **GREEDY, **extra
        ).id
        answers.append(client.responses.retrieve(previous))
    return answers


def whole_chat(client, answers, turns=TURNS) -> str:
    messages = []
    for turn, answer in zip(turns, answers[:-1], strict=False):
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer.output_text}]
    messages.append({"role": "user", "content": turns[len(answers) - 1]})
    chat = client.chat.completions.create(model=FORTUNES_MODEL, messages=messages, max_tokens=12, temperature=0)
    return chat.choices[0].message.content


def test_a_chained_conversation_answers_the_whole_chat_and_prefills_only_each_turn(fortunes_served):
    client = sdk(fortunes_served.gateway.url)
    answers = converse(client)
    assert all(answer.status in ("completed", "incomplete") and answer.output_text for answer in answers)
    assert answers[-1].output_text == whole_chat(client, answers)
    for before, after in itertools.pairwise(answers):
        # the turn before's prompt and answer are held: only this turn's new ids were prefilled
        assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens
        assert after.previous_response_id == before.id
    assert answers[0].usage.output_tokens <= GREEDY["max_output_tokens"]


def test_a_streamed_response_sends_openais_typed_events_adding_up_to_the_text(fortunes_served):
    client = sdk(fortunes_served.gateway.url)
    whole = client.responses.create(model=FORTUNES_MODEL, input=TURNS[0], **GREEDY)
    events = list(client.responses.create(model=FORTUNES_MODEL, input=TURNS[0], stream=True, **GREEDY))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == whole.output_text
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_stored_responses_are_the_keys_own_and_deleted_on_request(fortunes_served):
    import openai

    client = sdk(fortunes_served.gateway.url)
    kept = client.responses.create(model=FORTUNES_MODEL, input="Hello", **GREEDY)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    other = sdk(fortunes_served.gateway.url, key=FORTUNES_OTHER_KEY)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=FORTUNES_MODEL, input="and?", previous_response_id=kept.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    unkept = client.responses.create(model=FORTUNES_MODEL, input="Hello", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_a_json_schema_format_and_refused_fields(fortunes_served):
    import json

    import openai

    client = sdk(fortunes_served.gateway.url)
    schema = {"type": "object", "properties": {"mood": {"enum": ["glad", "sad"]}}, "required": ["mood"]}
    form = {"format": {"type": "json_schema", "name": "mood", "schema": schema, "strict": True}}
    answer = client.responses.create(model=FORTUNES_MODEL, input="How are you?", text=form, temperature=1.0)
    assert json.loads(answer.output_text)["mood"] in ("glad", "sad")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=FORTUNES_MODEL, input="hi", tools=[{"type": "web_search"}])
    assert refused.value.body["param"] == "tools"
    parts = [{"type": "input_image", "image_url": "data:,"}]
    with pytest.raises(openai.BadRequestError) as image:
        client.responses.create(model=FORTUNES_MODEL, input=[{"role": "user", "content": parts}])
    assert "input[0].content" in image.value.body["message"]


def test_a_continuation_survives_the_gateways_restart_and_its_rows_loss(fortunes_served, redis_server):
    """Kept in Redis, a response is continued through another gateway after the first one stopped; its
    conversation's kept rows pushed out (the key's other conversations), the turn prefills it whole and
    answers the same."""
    settings = {
        "api_keys": (FORTUNES_KEY,),
        "triton_url": fortunes_served.triton.grpc_url,
        "served_model_name": FORTUNES_MODEL,
        "session_store": redis_server.url,
        "session_secret": "responses-test-secret",
    }
    with running(**settings) as first:
        started = converse(sdk(first.url), turns=TURNS[:2])
    with running(**settings) as second:
        client = sdk(second.url)
        for other in range(9):  # the core keeps 8 rows per key: this conversation's is pushed out
            client.responses.create(model=FORTUNES_MODEL, input=f"Unrelated {other} " * 4, **GREEDY)
        last = client.responses.create(
            model=FORTUNES_MODEL, input=TURNS[2], previous_response_id=started[-1].id, **GREEDY
        )
        assert last.usage.input_tokens_details.cached_tokens < started[-1].usage.input_tokens
        assert last.output_text == whole_chat(client, [*started, last])
        assert httpx.get(f"{second.url}/v1/responses/{last.id}", headers=_auth()).status_code == 200


def _auth() -> dict:
    return {"Authorization": f"Bearer {FORTUNES_KEY}"}
