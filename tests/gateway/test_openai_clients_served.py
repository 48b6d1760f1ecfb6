"""What stock clients send by default, against the gateway serving the shipped fortunes model (issue 45): chat
content as a list of text parts (the openai SDK's and LangChain's multimodal shape), more than four stop
strings, `best_of` equal to `n`, `logit_bias`, `max_completion_tokens` on completions, harmless forms of
refused fields, advisory fields, `models.retrieve`; and LiteLLM's completion through its OpenAI provider."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.conftest import FORTUNES_KEY, FORTUNES_MODEL

pytestmark = pytest.mark.served

PROMPT = "Love is"


@pytest.fixture
def api(fortunes_served) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {FORTUNES_KEY}"}
    with httpx.Client(base_url=fortunes_served.gateway.url, headers=headers, timeout=120) as client:
        yield client


@pytest.fixture
def sdk(fortunes_served):
    import openai

    return openai.OpenAI(base_url=f"{fortunes_served.gateway.url}/v1", api_key=FORTUNES_KEY, max_retries=0)


def greedy_chat(sdk, content, **extra) -> str:
    messages = [{"role": "user", "content": content}]
    answer = sdk.chat.completions.create(model=FORTUNES_MODEL, messages=messages, max_tokens=12, temperature=0, **extra)
    return answer.choices[0].message.content


def test_text_parts_are_joined_by_newlines_and_answer_what_the_joined_text_does(sdk):
    parts = [{"type": "text", "text": "Love"}, {"type": "text", "text": "is"}]
    assert greedy_chat(sdk, parts) == greedy_chat(sdk, "Love\nis")


def test_a_part_that_is_not_text_is_a_400_naming_it(sdk):
    import openai

    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(openai.BadRequestError) as refused:
        greedy_chat(sdk, parts)
    assert refused.value.body["param"] == "messages"
    assert "messages[0].content[1]" in refused.value.body["message"] and "image_url" in refused.value.body["message"]


def test_more_than_four_stop_strings_are_taken_up_to_the_setting(api):
    body = {"model": FORTUNES_MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    free = api.post("/v1/completions", json=body).json()["choices"][0]["text"]
    word = free.split()[1]  # a word the greedy text holds past its first
    stops = ["<|endoftext|>", "zzz1", "zzz2", "zzz3", "zzz4", word]
    cut = api.post("/v1/completions", json=body | {"stop": stops}).json()["choices"][0]
    assert cut["text"] == free[: free.index(word)] and cut["finish_reason"] == "stop"
    many = api.post("/v1/completions", json=body | {"stop": [f"s{i}" for i in range(65)]})
    assert many.status_code == 400 and "SERVING_MAX_STOP_STRINGS" in many.json()["error"]["message"]


def test_logit_bias_bans_and_forces_tokens(api):
    import tokenizers

    from contract.files import TOKENIZER_FILENAME, TRAINED_MODEL

    tokenizer = tokenizers.Tokenizer.from_file(str(TRAINED_MODEL / TOKENIZER_FILENAME))
    ids = tokenizer.encode(PROMPT).ids
    greedy = api.post("/v1/generate", json={"input_ids": ids, "max_new_tokens": 1}).json()["token_ids"][0]
    body = {"model": FORTUNES_MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0}
    assert api.post("/v1/completions", json=body).json()["choices"][0]["text"] == tokenizer.decode([greedy])
    banned = api.post("/v1/completions", json=body | {"logit_bias": {str(greedy): -100}}).json()["choices"][0]
    assert banned["text"] != tokenizer.decode([greedy])
    forced = api.post("/v1/completions", json=body | {"logit_bias": {"1000": 100}}).json()["choices"][0]
    assert forced["text"] == tokenizer.decode([1000])
    bad = api.post("/v1/completions", json=body | {"logit_bias": {"5": 101}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_completions_take_max_completion_tokens_best_of_n_and_advisory_fields(api):
    body = {"model": FORTUNES_MODEL, "prompt": PROMPT, "temperature": 0, "max_completion_tokens": 3}
    answer = api.post("/v1/completions", json=body | {"best_of": 1, "user": "u", "metadata": {"a": "b"}}).json()
    assert answer["usage"]["completion_tokens"] == 3
    refused = api.post("/v1/completions", json=body | {"best_of": 3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of"
    chat = {"model": FORTUNES_MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": 2}
    harmless = {
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "modalities": ["text"],
        "service_tier": "auto",
    }
    assert api.post("/v1/chat/completions", json=chat | harmless).status_code == 200


def test_models_retrieve_answers_the_served_model_and_404_for_another(sdk):
    import openai

    assert sdk.models.retrieve(FORTUNES_MODEL).id == FORTUNES_MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("gpt-4o")


def test_langchain_sends_content_parts_and_gets_the_text(fortunes_served, sdk):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        model=FORTUNES_MODEL, base_url=f"{fortunes_served.gateway.url}/v1", api_key=FORTUNES_KEY, temperature=0,
        max_tokens=12, max_retries=0,
    )  # fmt: skip
    parts = [{"type": "text", "text": "Love"}, {"type": "text", "text": "is"}]
    assert model.invoke([HumanMessage(content=parts)]).content == greedy_chat(sdk, "Love\nis")
    assert "".join(chunk.content for chunk in model.stream([HumanMessage(content=parts)])) == greedy_chat(sdk, parts)


def test_litellm_completes_through_its_openai_provider(fortunes_served, sdk, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read at import: no fetch from GitHub (offline)
    import litellm

    answer = litellm.completion(
        model=f"openai/{FORTUNES_MODEL}", api_base=f"{fortunes_served.gateway.url}/v1", api_key=FORTUNES_KEY,
        messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0,
        stop=["a", "b", "c", "d", "e"],
    )  # fmt: skip
    expected = sdk.chat.completions.create(
        model=FORTUNES_MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0,
        stop=["a", "b", "c", "d", "e"],
    )  # fmt: skip
    assert answer.choices[0].message.content == expected.choices[0].message.content
