"""The drop-in end to end, as a user runs it (issue 45): `python -m serving LLAMA QWEN` on two checkpoint folders
transformers made (each with a tokenizer and a chat template) builds each once (here ahead, in the background, as
the server builds it: tests/serving/test_serve_folder.py has the server's own build) and serves both under their
folders' names; then the stock clients' default requests: the openai SDK, LangChain's ChatOpenAI with content
parts, LiteLLM, and lm-eval's `local-completions` (`generate_until` with 6 stop strings, `loglikelihood`) and
`local-chat-completions`. Every answer is checked against transformers: its greedy generation, cut where the
first stop string begins, and its log-probabilities."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import transformers

from contract import files
from serving.triton.cli import export_folder, folder_artifacts
from tests.fixtures.faults import kill, wait_ready
from tests.fixtures.prebuilds import folder_job
from tests.fixtures.serving_process import ServingProcess, serving_process
from tests.fixtures.text import save_tokenizer

pytestmark = pytest.mark.served

VOCAB = 320
SHAPE = {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64}
CONFIGS = {  # the folder's name (the model's id) -> its transformers config
    "tiny-llama": transformers.LlamaConfig(num_hidden_layers=2, **SHAPE, vocab_size=VOCAB, max_position_embeddings=256),
    "tiny-qwen": transformers.Qwen3Config(
        num_hidden_layers=1, **SHAPE, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256
    ),
}
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # tests/fixtures/text.py's ids
PROMPT = "def main(args):"
CHAT = [{"role": "user", "content": "Write a function."}]
NEW_TOKENS = 24


def make_checkpoint(folder: Path, config) -> Path:
    torch.manual_seed(0)
    for name, value in SPECIAL.items():
        setattr(config, name, value)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    save_tokenizer(folder, VOCAB)
    return folder


def saved(root: Path) -> dict[str, Path]:
    return {name: make_checkpoint(root / name, config) for name, config in CONFIGS.items()}


def saved_and_built(root: Path) -> None:
    """The checkpoints, each built as `python -m serving FOLDER` builds it (by its digest: the server reuses it)."""
    for folder in saved(root).values():
        export_folder(folder, artifacts=folder_artifacts(folder))


CHECKPOINTS_KEY = "drop-in-checkpoints"


def prebuild_jobs(item) -> dict:
    """The checkpoints saved and built ahead in the background (tests/fixtures/prebuilds.py)."""
    return {CHECKPOINTS_KEY: folder_job(CHECKPOINTS_KEY, saved_and_built)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, prebuilds) -> dict[str, Path]:
    """Saved and built ahead (`prebuild_jobs`), or saved here: `python -m serving` then builds them."""
    ahead = prebuilds.wait(CHECKPOINTS_KEY)
    return {name: ahead / name for name in CONFIGS} if ahead else saved(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory) -> Iterator[ServingProcess]:
    built = [folder_artifacts(folder) for folder in checkpoints.values()]
    try:
        with serving_process(list(checkpoints.values()), tmp_path_factory.mktemp("serving")) as process:
            yield process
    finally:  # what `python -m serving FOLDER` writes under build/: this module's own, by the folders' digests
        for folder in [*built, files.PROJECT_ROOT / "build" / "served" / "+".join(checkpoints)]:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def original(checkpoints):
    """transformers' model and tokenizer of the first folder: what the server must compute."""
    folder = checkpoints["tiny-llama"]
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval(), transformers.AutoTokenizer.from_pretrained(
        folder
    )


def greedy_text(original, ids: list[int], stops: tuple[str, ...] = ()) -> str:
    """transformers' greedy continuation of `ids`, decoded, cut where the first stop string begins."""
    model, tokenizer = original
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids) :]
    text = tokenizer.decode(out.tolist(), skip_special_tokens=True)
    cut = min((text.find(stop) for stop in stops if stop in text), default=len(text))
    return text[:cut]


def sdk(served: ServingProcess):
    import openai

    return openai.OpenAI(base_url=f"{served.gateway_url}/v1", api_key="none", max_retries=0)


def test_each_folder_is_served_under_its_name_and_another_id_is_a_404(served):
    import openai

    client = sdk(served)
    assert sorted(model.id for model in client.models.list().data) == sorted(CONFIGS)
    assert "models          tiny-llama, tiny-qwen" in served.output()
    for name in CONFIGS:
        assert client.models.retrieve(name).id == name
        answer = client.completions.create(model=name, prompt=PROMPT, max_tokens=4, temperature=0)
        assert answer.model == name and answer.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    assert "'tiny-llama', 'tiny-qwen'" in missing.value.body["message"]


def test_the_sdks_greedy_chat_and_completion_are_transformers(served, original):
    client, (_, tokenizer) = sdk(served), original
    chat = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=NEW_TOKENS, temperature=0)
    prompt_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat.choices[0].message.content == greedy_text(original, list(prompt_ids))
    text = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert text.choices[0].text == greedy_text(original, tokenizer(PROMPT)["input_ids"])


def test_langchain_sends_content_parts_and_litellm_completes(served, original, monkeypatch):
    from langchain_openai import ChatOpenAI

    expected = sdk(served).chat.completions.create(
        model="tiny-llama", messages=CHAT, max_tokens=NEW_TOKENS, temperature=0
    )
    chat = ChatOpenAI(
        model="tiny-llama", base_url=f"{served.gateway_url}/v1", api_key="none", temperature=0, max_tokens=NEW_TOKENS
    )
    parts = [{"type": "text", "text": "Write a function."}]  # its multimodal shape, one text part
    assert chat.invoke([("user", parts)]).content == expected.choices[0].message.content

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read at import: no fetch from GitHub (offline)
    monkeypatch.setenv("OPENAI_API_KEY", "none")
    import litellm

    answer = litellm.completion(
        model="openai/tiny-llama", api_base=f"{served.gateway_url}/v1", messages=CHAT, max_tokens=NEW_TOKENS,
        temperature=0,
    )  # fmt: skip
    assert answer.choices[0].message.content == expected.choices[0].message.content


def lm_eval_model(served: ServingProcess, folder: Path, chat: bool):
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    if chat:
        return LocalChatCompletion(model="tiny-llama", base_url=f"{served.gateway_url}/v1/chat/completions")
    return LocalCompletionsAPI(
        model="tiny-llama", base_url=f"{served.gateway_url}/v1/completions", tokenizer_backend="huggingface",
        tokenizer=str(folder), max_length=256,
    )  # fmt: skip


def test_lm_eval_generates_until_six_stop_strings_and_scores_as_transformers(served, checkpoints, original):
    from lm_eval.api.instance import Instance

    _, tokenizer = original
    free = greedy_text(original, tokenizer(PROMPT)["input_ids"])
    word = free.split()[len(free.split()) // 2]  # a word past the start of the greedy text
    assert free.index(word) > 0, f"the greedy text {free!r} must hold a word past its start"
    until = ["\n\nQ:", "zzz1", "zzz2", "zzz3", word]  # lm-eval adds the tokenizer's end of text: 6 strings
    model = lm_eval_model(served, checkpoints["tiny-llama"], chat=False)
    asked = Instance("generate_until", {}, (PROMPT, {"until": until, "max_gen_toks": NEW_TOKENS}), 0)
    (generated,) = model.generate_until([asked], disable_tqdm=True)
    assert generated == greedy_text(original, tokenizer(PROMPT)["input_ids"], (*until, tokenizer.eos_token))
    assert len(generated) < len(free)

    continuation = " return args"
    scored = Instance("loglikelihood", {}, (PROMPT, continuation), 0)
    ((logprob, _),) = model.loglikelihood([scored], disable_tqdm=True)
    context, whole = tokenizer(PROMPT)["input_ids"], tokenizer(PROMPT + continuation)["input_ids"]
    with torch.no_grad():
        logits = original[0](torch.tensor([whole])).logits[0].double()
    picked = torch.log_softmax(logits, -1)[np.arange(len(context) - 1, len(whole) - 1), whole[len(context) :]]
    # fp32 parity holds each logit within 1e-5 of the logits' scale; a log-softmax moves by at most twice that
    bound = 2e-5 * float(logits.abs().max()) * len(picked)
    assert abs(logprob - float(picked.sum())) <= bound


def test_lm_eval_chat_generates_what_the_sdk_answers(served, checkpoints):
    from lm_eval.api.instance import Instance
    from lm_eval.models.api_models import JsonChatStr

    model = lm_eval_model(served, checkpoints["tiny-llama"], chat=True)
    asked = Instance("generate_until", {}, (JsonChatStr(json.dumps(CHAT)), {"until": ["zzz"], "max_gen_toks": 8}), 0)
    (generated,) = model.generate_until([asked], disable_tqdm=True)
    expected = sdk(served).chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=8, temperature=0)
    assert generated == expected.choices[0].message.content


def continued_as_the_whole_chat(client, model: str, first):
    """The Responses turn after `first` ("Hello there."), which must answer as a greedy chat of the whole
    conversation does; the response."""
    second = client.responses.create(
        model=model, input="And now?", previous_response_id=first.id, temperature=0, max_output_tokens=8
    )
    chat = [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And now?"},
    ]
    whole = client.chat.completions.create(model=model, messages=chat, max_tokens=8, temperature=0)
    assert second.output_text == whole.choices[0].message.content
    return second


def test_a_served_folders_dead_model_is_reloaded_and_its_conversation_goes_on(served):
    """kill -9 of the process serving the second folder's model (its session model's stub): /readyz says which
    model is down, a request meanwhile is a 503 (never a 504 after the request's timeout, never `session_lost`),
    the supervisor reloads it within seconds, and a Responses conversation begun before the kill goes on from
    the stored responses (its kept rows died with the process: the history is prefilled) as the whole chat."""
    client, greedy = sdk(served), {"temperature": 0, "max_output_tokens": 8}
    first = client.responses.create(model="tiny-qwen", input="Hello there.", **greedy)
    killed_at = time.monotonic()
    kill(served, "tiny-qwen_sessions_0_0")
    with httpx.Client(base_url=served.gateway_url, timeout=60) as gateway:
        down = gateway.get("/readyz")
        assert down.status_code == 503 and "tiny-qwen_sessions" in down.json()["error"]["message"]
        body = {"model": "tiny-qwen", "prompt": PROMPT, "max_tokens": 2}
        during = gateway.post("/v1/completions", json=body)
        assert during.status_code in (503, 200)  # 200: the reload was already done
        if during.status_code == 503:
            assert during.headers.get("retry-after") and during.json()["error"]["code"] == "upstream_unavailable"
        assert time.monotonic() - killed_at < 10  # not a request that waited for its timeout
        recovered_in = wait_ready(gateway, killed_at)
    second = continued_as_the_whole_chat(client, "tiny-qwen", first)
    assert second.usage.input_tokens_details.cached_tokens == 0  # its rows died with the process
    print(f"tiny-qwen's model reloaded {recovered_in:.1f} s after the kill")


def test_a_killed_gateway_is_started_again_and_a_responses_conversation_goes_on(served):
    """kill -9 of the gateway's process: `python -m serving` starts another on the same port, with the run's
    store, where the responses were kept: a conversation begun before goes on as the whole chat."""
    client, greedy = sdk(served), {"temperature": 0, "max_output_tokens": 8}
    first = client.responses.create(model="tiny-llama", input="Hello there.", **greedy)
    killed_at = time.monotonic()
    kill(served, "-m serving.gateway")
    with httpx.Client(base_url=served.gateway_url, timeout=60) as gateway:
        print(f"the gateway served again {wait_ready(gateway, killed_at):.1f} s after its kill")
    continued_as_the_whole_chat(client, "tiny-llama", first)
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_a_stream_cut_by_a_killed_tritonserver_ends_with_a_typed_error(served):
    """kill -9 of tritonserver while a completion streams: the stream's last event is an error of a kind the
    client can act on (Triton is unavailable: retry), not an untyped internal error; the supervisor brings
    the server back and the same request streams whole."""
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=served.gateway_url, timeout=60) as gateway:
        with gateway.stream("POST", "/v1/completions", json=body) as answer:
            assert answer.status_code == 200
            lines = answer.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            killed_at = time.monotonic()
            kill(served, "bin/tritonserver")
            events = [first, *(line for line in lines if line.startswith("data: "))]
        assert events[-1] == "data: [DONE]", events[-3:]
        last = json.loads(events[-2].removeprefix("data: "))
        assert "error" in last, events[-3:]
        assert last["error"]["code"] in ("upstream_unavailable", "session_lost"), last
        print(f"the stream ended with {last['error']['code']}: {last['error']['message'][:120]}")
        wait_ready(gateway, killed_at)
        again = gateway.post("/v1/completions", json=body | {"stream": False})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 200
