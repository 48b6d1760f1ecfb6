"""The OpenAI routes' small doors (issue 47, items 2 and 5), against the shipped fortunes model with a gateway
without keys (loopback only) in front: a message nested 900 deep and `chat_template_kwargs` that name the
request's own fields are 400s naming the field (they were 500s: a RecursionError, a TypeError); a body that is not
JSON by its Content-Type is a 415 (a web page may send a form or text/plain anywhere without asking first); and a
Host header that is not a loopback name is refused (a page's script reaching a keyless gateway by DNS rebinding).
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.fixtures.fortunes import FORTUNES_MODEL, running

pytestmark = pytest.mark.served

CHAT = {"model": FORTUNES_MODEL, "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def keyless(fortunes_served) -> Iterator[httpx.Client]:
    with (
        running(triton_url=fortunes_served.triton.grpc_url, served_model_name=FORTUNES_MODEL) as gateway,
        httpx.Client(base_url=gateway.url, timeout=60) as client,
    ):
        yield client


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def test_a_message_nested_900_deep_is_a_400_not_a_500(keyless):
    messages = [{"role": "user", "content": "hi", "extra": nested(900)}]
    answer = keyless.post("/v1/chat/completions", json=CHAT | {"messages": messages})
    assert answer.status_code == 400, answer.text
    assert "nested more than 64 deep" in answer.json()["error"]["message"]
    fine = keyless.post("/v1/chat/completions", json=CHAT | {"messages": [{"role": "user", "content": "hi"}]})
    assert fine.status_code == 200


@pytest.mark.parametrize("name", ["add_generation_prompt", "messages"])
def test_chat_template_kwargs_naming_the_requests_own_fields_are_a_400(keyless, name):
    body = CHAT | {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {name: True}}
    answer = keyless.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "chat_template_kwargs" and name in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_a_body_that_is_not_json_by_its_type_is_a_415(keyless, content_type):
    body = b'{"model": "fortunes", "prompt": "Love is", "max_tokens": 2}'
    for route in ("/v1/completions", "/v1/responses"):
        answer = keyless.post(route, content=body, headers={"Content-Type": content_type})
        assert answer.status_code == 415, answer.text
        assert "expected application/json" in answer.json()["error"]["message"]
    typed = keyless.post("/v1/completions", content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert typed.status_code == 200


def test_a_keyless_gateway_answers_loopback_names_only(keyless):
    assert keyless.get("/healthz", headers={"Host": "rebound.example.com"}).status_code == 400
    body = {"model": FORTUNES_MODEL, "prompt": "Love is", "max_tokens": 2}
    assert keyless.post("/v1/completions", json=body, headers={"Host": "rebound.example.com:8080"}).status_code == 400
    for host in ("localhost", "127.0.0.1:9", "[::1]:9"):
        assert keyless.get("/healthz", headers={"Host": host}).status_code == 200, host


def test_a_stateless_generation_counts_against_the_keys_sessions(fortunes_served):
    """POST /v1/generate holds a KV row while it runs: counted as one of the key's sessions (it escaped the
    per-key limits: one key's loops left another 503), so a key holding its limit gets 429, another key not."""
    settings = {"api_keys": ("one", "two"), "sessions_per_key": 2, "served_model_name": FORTUNES_MODEL}
    with running(triton_url=fortunes_served.triton.grpc_url, **settings) as gateway:
        one, two = ({"Authorization": f"Bearer {key}"} for key in ("one", "two"))
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            opened = [client.post("/v1/sessions", headers=one).json()["id"] for _ in range(2)]
            body = {"input_ids": [5, 6, 7], "max_new_tokens": 2}
            refused = client.post("/v1/generate", json=body, headers=one)
            assert refused.status_code == 429 and "the limit is 2" in refused.json()["error"]["message"]
            assert client.post("/v1/generate", json=body, headers=two).status_code == 200
            client.delete(f"/v1/sessions/{opened[0]}", headers=one)
            assert client.post("/v1/generate", json=body, headers=one).status_code == 200


def test_a_long_prompt_is_tokenized_off_the_event_loop(keyless):
    """A prompt of 3 MB (a 10 MB one stalled /healthz for seconds, tokenized on the loop) is tokenized on a worker
    thread that lets go of the GIL: /healthz answers within a fraction of a second meanwhile; the prompt is a 400."""
    prompt = "hello world, this is a test. " * 100_000
    answered: list[httpx.Response] = []
    body = {"model": FORTUNES_MODEL, "prompt": prompt, "max_tokens": 2}
    sender = threading.Thread(target=lambda: answered.append(keyless.post("/v1/completions", json=body)))
    sender.start()
    waits = []
    while sender.is_alive():
        began = time.monotonic()
        assert keyless.get("/healthz").status_code == 200
        waits.append(time.monotonic() - began)
        time.sleep(0.05)
    sender.join()
    assert answered[0].status_code == 400 and "context" in answered[0].json()["error"]["message"]
    assert len(waits) >= 5 and max(waits) < 1.0, waits  # the tokenizer's seconds did not hold the loop


def test_a_body_that_trickles_in_is_cut_at_the_requests_deadline(fortunes_served):
    """A client that declares a body and sends it a few bytes at a time held a connection 75 s past the 30 s
    request timeout: the body's reading is bounded by the request's deadline, then a 408 and the connection
    closed."""
    with running(triton_url=fortunes_served.triton.grpc_url, request_timeout_s=2.0) as gateway:
        port = int(gateway.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
            began = time.monotonic()
            head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            connection.sendall(f"{head}Content-Length: 1000\r\n\r\n{{".encode())
            answer = b""
            with contextlib.suppress(OSError):  # the server closes once it has answered
                while time.monotonic() - began < 8 and b"\r\n\r\n" not in answer:
                    connection.sendall(b" ")  # a byte now and then: never done
                    connection.settimeout(0.5)
                    with contextlib.suppress(TimeoutError):
                        answer += connection.recv(4096)
            took = time.monotonic() - began
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"SERVING_REQUEST_TIMEOUT_S" in answer or b"body_timeout" in answer
    assert 1.9 <= took < 4.0


def declared_limit(client: httpx.Client, route: str) -> str:
    """The 413 a body declared at 60 MB gets on `route` (refused before it is read: none is sent)."""
    port = int(str(client.base_url).rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        head = f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        connection.sendall(f"{head}Content-Length: 60000000\r\n\r\n".encode())
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := connection.recv(65536):
                answer += chunk
    status, _, body = answer.decode().partition("\r\n\r\n")
    assert " 413 " in status.splitlines()[0], answer
    return body


def text_route_limit(client: httpx.Client, route: str) -> int:
    """The body limit of a text route once the gateway has learned the served model's tokenizer."""
    deadline = time.monotonic() + 30
    while "contexts" not in (message := declared_limit(client, route)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "the served models' contexts" in message, message
    return int(re.search(r"exceeds the limit of (\d+) bytes", message)[1])


def test_the_text_routes_bodies_are_bound_by_the_served_contexts_and_a_completions_prompts(keyless, trained_artifact):
    """The OpenAI routes took 64 MiB, a bound made for the stateless attention model, whatever the 256-token model
    they serve can hold: now a chat or a response takes what that context holds (its longest token, escaped,
    256 times, in messages) and completions that for each prompt a key may run; more prompts than that is a 400
    before any is tokenized. The longest text that context holds, escaped as JSON at worst, is still taken."""
    from client.text import TextModel

    chat, completions = (text_route_limit(keyless, route) for route in ("/v1/chat/completions", "/v1/completions"))
    assert text_route_limit(keyless, "/v1/responses") == chat
    assert chat < 8 << 20 and chat < completions <= 64 << 20, (chat, completions)

    text = TextModel.from_folder(trained_artifact)
    longest = max(range(text.tokenizer.get_vocab_size()), key=lambda token: len(text.decode([token])))
    word = text.decode([longest])
    content = "".join(f"\\u{ord(char):04x}" for char in word * 256)  # every character escaped: 6 bytes each
    body = '{"model": "fortunes", "max_tokens": 1, "messages": [{"role": "user", "content": "' + content + '"}]}'
    answer = keyless.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and "context" in answer.json()["error"]["message"], answer.text

    began = time.monotonic()
    many = keyless.post("/v1/completions", json={"model": FORTUNES_MODEL, "prompt": ["Love is"] * 17, "max_tokens": 1})
    assert many.status_code == 400 and "17 prompts of n=1 choices each run 17 sessions" in many.text, many.text
    two = keyless.post(
        "/v1/completions", json={"model": FORTUNES_MODEL, "prompt": ["Love is"] * 8, "n": 2, "max_tokens": 1}
    )
    assert two.status_code == 200, two.text
    print(f"text routes' limits: chat {chat} bytes, completions {completions}; 17 prompts refused in ", end="")
    print(f"{time.monotonic() - began:.2f} s")
