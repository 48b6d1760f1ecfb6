"""Generation through the gateway over HTTP (`POST /v1/sessions/{id}/generate`, `POST /v1/generate`), as one
JSON answer and as Server-Sent Events: greedy tokens equal the PyTorch original's greedy loop, a session holds
the prompt and every token answered, bad parameters answer 400 naming them, and a stream the client leaves
early leaves its session usable.

In front of the session's whole-model Triton (tests/fixtures/triton.py `whole_triton`, whose `sessions` model
generates); the shared gateway in front of the main Triton's attention model
answers 400: it has no logits to pick from."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch

from tests.gateway.test_api import assert_error

pytestmark = pytest.mark.served
PROMPT = np.random.default_rng(3).integers(0, 256, 5).tolist()  # within the `whole` config's vocabulary (320)
# the logprobs are log_softmax of the same logits, computed by ONNX Runtime instead of PyTorch: fp32 rounding
LOGPROB_TOLERANCE = 1e-4


@torch.no_grad()
def logits(model, ids: list[int]) -> np.ndarray:
    """The original's logits (T, vocab_size) over one sequence."""
    return model(torch.tensor([ids])).output[0].numpy()


@torch.no_grad()
def greedy(model, ids: list[int], count: int) -> list[int]:
    """The original's greedy loop: the argmax of the last position's logits, fed back through its own KV cache,
    `count` times (a step of one token: a new sequence length each time would cost PyTorch new kernels)."""
    answer, generated = model(torch.tensor([ids])), []
    for _ in range(count):
        generated.append(int(answer.output[0, -1].argmax()))
        answer = model(torch.tensor([generated[-1:]]), past=answer.present)
    return generated


def events(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """(event name or None, data) of each Server-Sent Event of a streaming response."""
    name, data = None, []
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data.append(line.removeprefix("data: "))
        elif not line and data:
            yield name, "\n".join(data)
            name, data = None, []


def streamed(api: httpx.Client, path: str, body: dict) -> tuple[list[dict], dict]:
    """(the token events, the final event) of a generation streamed to the end."""
    with api.stream("POST", path, json=body | {"stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        received = list(events(response))
    assert received[-1] == (None, "[DONE]"), received[-1]
    assert all(name is None for name, _ in received), received
    parsed = [json.loads(data) for _, data in received[:-1]]
    return parsed[:-1], parsed[-1]


def test_greedy_generation_answers_the_originals_greedy_tokens(whole):
    """Both routes, JSON and SSE; the logprobs are the original's log_softmax, the top alternative the token."""
    api, model = whole
    expected = greedy(model, PROMPT, 6)
    log_softmax = torch.log_softmax(torch.from_numpy(logits(model, PROMPT + expected)), dim=-1).numpy()
    body = {"input_ids": PROMPT, "max_new_tokens": 6, "temperature": 0.0}

    answer = api.post("/v1/generate", json=body | {"logprobs": 2}).json()
    assert answer["token_ids"] == expected and answer["finish_reason"] == "length"
    for position, entry in enumerate(answer["logprobs"]):
        row = log_softmax[len(PROMPT) - 1 + position]
        assert entry["token_id"] == expected[position] and len(entry["top"]) == 2
        assert entry["top"][0]["token_id"] == expected[position]  # greedy: the most likely
        np.testing.assert_allclose(entry["logprob"], row[expected[position]], atol=LOGPROB_TOLERANCE)
        second = entry["top"][1]
        np.testing.assert_allclose(second["logprob"], row[second["token_id"]], atol=LOGPROB_TOLERANCE)
        assert second["logprob"] <= entry["logprob"]

    tokens, final = streamed(api, "/v1/generate", body)
    assert [t["token_id"] for t in tokens] == expected and "top" not in tokens[0]
    assert final == {"finish_reason": "length", "held_length": 0}  # a stateless sequence is ended: nothing held
    assert "logprobs" not in api.post("/v1/generate", json=body).json()  # only when asked


def test_a_session_holds_the_prompt_and_every_generated_token(whole):
    """A generation (the prompt as one row), then one that goes on after what the session holds (streamed,
    no input_ids), then a step: its logits are the original's over the whole sequence."""
    api, model = whole
    expected = greedy(model, PROMPT, 9)
    session = api.post("/v1/sessions").json()["id"]
    path = f"/v1/sessions/{session}/generate"

    first = api.post(path, json={"input_ids": [PROMPT], "max_new_tokens": 5}).json()
    assert first["token_ids"] == expected[:5] and first["held_length"] == len(PROMPT) + 5
    tokens, final = streamed(api, path, {"max_new_tokens": 4})
    assert [t["token_id"] for t in tokens] == expected[5:]
    assert final == {"finish_reason": "length", "held_length": len(PROMPT) + 9}

    whole_sequence = PROMPT + expected + [7]
    stepped = api.post(f"/v1/sessions/{session}/step", json={"input_ids": [[7]]}).json()
    assert stepped["length"] == len(whole_sequence)
    assert_logits_equal(stepped["logits"][0], logits(model, whole_sequence)[-1:])
    assert api.delete(f"/v1/sessions/{session}").status_code == 204


def assert_logits_equal(served: list, original: np.ndarray) -> None:
    tolerance = 1e-5 * float(np.abs(original).max())  # fp32 rounding, relative to the logits' scale
    np.testing.assert_allclose(np.asarray(served, np.float32), original, rtol=0, atol=tolerance)


def test_bad_parameters_answer_400_naming_them_and_leave_the_session_as_it_was(whole):
    """Errors before the first token answer a status and the error body, streamed or not: 400 naming the
    field, 404 for an unknown session, 422 for a body off the schema."""
    api, model = whole
    session = api.post("/v1/sessions").json()["id"]
    path = f"/v1/sessions/{session}/generate"
    vocab, max_seq_len = model.cfg.vocab_size, model.cfg.max_seq_len
    refused = {
        "temperature": ({"temperature": -1}, ">= 0"),
        "top_p": ({"top_p": 2, "stream": True}, "(0, 1]"),
        "stop_token_ids": ({"stop_token_ids": [vocab]}, str(vocab)),
        "max_new_tokens": ({"max_new_tokens": -1}, f"[0, {max_seq_len}]"),  # 0: the prompt only (scored, kept)
        "input_ids": ({"input_ids": [[1, vocab]]}, f"[0, {vocab})"),
    }
    for field, (body, fragment) in refused.items():
        for route in (path, "/v1/generate"):
            answer = api.post(route, json={"input_ids": [1]} | body)
            assert_error(answer, 400, "invalid_input", f"'{field}'", fragment)
    assert_error(api.post(path, json={"input_ids": [[1], [2]]}), 400, "invalid_input", "input_ids", "2 rows")
    too_long = list(range(max_seq_len + 1))
    assert_error(api.post("/v1/generate", json={"input_ids": too_long}), 400, "invalid_input", "input_ids")
    assert_error(api.post("/v1/generate", json={}), 422, "validation_error", "input_ids")
    assert_error(api.post(path, json={"best_of": 2}), 422, "validation_error", "best_of")
    for stream in (False, True):
        unknown = api.post("/v1/sessions/no-such-session/generate", json={"input_ids": [1], "stream": stream})
        assert_error(unknown, 404, "session_not_found", "no-such-session")

    answer = api.post(path, json={"input_ids": PROMPT, "max_new_tokens": 2}).json()
    assert answer["token_ids"] == greedy(model, PROMPT, 2) and answer["held_length"] == len(PROMPT) + 2
    overflowing = api.post(path, json={"input_ids": list(range(max_seq_len - 2))})  # the server's check
    assert_error(overflowing, 400, "invalid_input", f"session '{session}'", f"max_seq_len {max_seq_len}")
    assert api.post(f"/v1/sessions/{session}/step", json={"input_ids": [[7]]}).json()["length"] == len(PROMPT) + 3
    api.delete(f"/v1/sessions/{session}")


def test_a_stream_closed_early_leaves_the_session_usable(whole):
    """The client leaves after the first token: the gateway closes the generation (the server stops within a
    step) and lets the session go; it holds the prompt and a greedy prefix, and steps on from there."""
    api, model = whole
    session = api.post("/v1/sessions").json()["id"]
    asked = model.cfg.max_seq_len - len(PROMPT) - 1  # all the room there is, but for the step after
    body = {"input_ids": PROMPT, "max_new_tokens": asked, "stream": True}
    with api.stream("POST", f"/v1/sessions/{session}/generate", json=body) as response:
        name, data = next(events(response))
    expected = greedy(model, PROMPT, asked)
    assert name is None and json.loads(data)["token_id"] == expected[0]

    stepped = step_when_free(api, session, [[7]])
    kept = stepped["length"] - len(PROMPT) - 1  # what the server generated before it saw the client leave
    # cancelled: 1 to 3 kept of 58 on a quiet machine (a whole generation takes the server ~80 ms, the
    # gateway's notice of the disconnect and the server's of the cancellation a few ms); on a loaded one the
    # generation may end first: either way the session holds exactly a greedy prefix
    assert 1 <= kept <= asked
    assert_logits_equal(stepped["logits"][0], logits(model, PROMPT + expected[:kept] + [7])[-1:])
    assert api.delete(f"/v1/sessions/{session}").status_code == 204


def step_when_free(api: httpx.Client, session: str, ids: list, within_s: float = 15.0) -> dict:
    """A step of the session once the gateway has let it go (409 while the left stream still holds it)."""
    deadline = time.monotonic() + within_s
    while True:
        answer = api.post(f"/v1/sessions/{session}/step", json={"input_ids": ids})
        if answer.status_code != 409 or time.monotonic() > deadline:
            assert answer.status_code == 200, answer.text
            return answer.json()
        time.sleep(0.01)


def test_an_attention_model_answers_400(api):
    """The main Triton serves an attention model (hidden states in and out): nothing to pick tokens from."""
    session = api.post("/v1/sessions").json()["id"]
    for route in (f"/v1/sessions/{session}/generate", "/v1/generate"):
        assert_error(api.post(route, json={"input_ids": [1], "stream": True}), 400, "invalid_input", "attention model")
    api.delete(f"/v1/sessions/{session}")
