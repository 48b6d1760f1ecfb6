"""The engine core served (issue 43), on a Triton of its own serving the model trained here (models/fortunes:
a whole Llama-shaped model with a tokenizer) with 16-position reservations, and two gateways in front of it that
share a session secret: sixteen generations of different lengths decode in one graph run a step (read from the
core's gauges), a client that leaves a stream is dropped within one step and its rows freed, and two gateways
share the core's prefix reuse while another key never reuses a key's rows."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from client import Client
from serving.host.launcher import start_triton
from serving.triton.config import FORWARD, SESSIONS
from serving.triton.repository import write_repository
from tests.fixtures.stops import stopped_later
from tests.fixtures.triton import WHOLE_SETTINGS, metric, metric_reaches, wait_for_metric
from tests.gateway.conftest import running

pytestmark = pytest.mark.served

KEYS = ("alice-key", "bob-key")
SECRET = "one secret for both gateways"
MODEL_ID = "fortunes"
SETTINGS = dataclasses.replace(WHOLE_SETTINGS, kv_cache_bytes=64 << 20, min_row_positions=16, step_tokens=64)


@dataclasses.dataclass
class Served:
    triton: object
    gateways: tuple[httpx.Client, httpx.Client]  # each sends KEYS[0]


@pytest.fixture(scope="module")
def served(trained_artifact, tmp_path_factory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("core-served")
    repository = write_repository(trained_artifact, work / "repository", SETTINGS, models=(FORWARD, SESSIONS))
    with contextlib.ExitStack() as stack:
        triton = stack.enter_context(stopped_later(start_triton(repository, log_path=work / "triton.log")))
        settings = {"triton_url": triton.grpc_url, "served_model_name": MODEL_ID, "session_secret": SECRET}
        clients = []
        for _ in range(2):
            gateway = stack.enter_context(running(api_keys=KEYS, **settings))
            headers = {"Authorization": f"Bearer {KEYS[0]}"}
            clients.append(stack.enter_context(httpx.Client(base_url=gateway.url, headers=headers, timeout=120)))
        yield Served(triton, tuple(clients))


def engine_gauge(served: Served, name: str) -> float:
    return metric(served.triton, f"attention_engine_{name}", SESSIONS)


def test_sixteen_sessions_of_different_lengths_decode_in_one_graph_run_a_step(served):
    """Prompts of 3 to 48 ids reserve 16, 32 and 48 positions: rows of one pool all the same, so every step
    decodes all of them in one graph run. Each generation's tokens are its solo run's."""
    prompts = [np.random.default_rng(k).integers(1, 2048, 3 + 3 * k, dtype=np.int64) for k in range(16)]
    with Client(served.triton.grpc_url) as client:
        solo = [list(client.generate(ids, max_new_tokens=60)) for ids in prompts[:2]]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda ids: list(client.generate(ids, max_new_tokens=60)), prompts))
    assert together[:2] == solo
    assert all(len(tokens) == 60 for tokens in together)
    assert metric_reaches(served.triton, "attention_engine_most_decode_rows", SESSIONS, 16)
    assert engine_gauge(served, "most_decode_runs") == 1


def test_a_client_that_leaves_a_stream_is_dropped_within_one_step_and_its_rows_freed(served):
    api = served.gateways[0]
    sequences = "attention_kv_cache_sequences"
    before = wait_for_metric(served.triton, sequences, SESSIONS, 0)
    generated = engine_gauge(served, "generated_tokens")
    body = {"input_ids": list(range(1, 17)), "max_new_tokens": 200, "stream": True}
    with api.stream("POST", "/v1/generate", json=body) as answer:
        assert answer.status_code == 200
        read = 0
        for line in answer.iter_lines():
            read += line.startswith("data: ") and "token_id" in line
            if read == 2:
                break  # the client leaves: the connection closes with the block
    assert wait_for_metric(served.triton, sequences, SESSIONS, before, timeout=10) == before  # its rows freed
    assert engine_gauge(served, "most_stop_steps") <= 1  # dropped at the step after its stop reached the core
    assert metric_reaches(served.triton, "attention_engine_generated_tokens", SESSIONS, generated + 2)
    assert engine_gauge(served, "generated_tokens") - generated < 200  # it did not run to its end


def test_two_gateways_share_the_cores_prefix_reuse_and_another_key_never_reuses(served):
    first, second = served.gateways
    opening = [{"role": "system", "content": "You answer in the words of old fortunes."}]
    turn = [*opening, {"role": "user", "content": "What is love?"}]
    answered = chat(first, turn)
    assert answered["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    reply = answered["choices"][0]["message"]["content"]
    following = [*turn, {"role": "assistant", "content": reply}, {"role": "user", "content": "And time?"}]

    again = chat(second, following)  # the other gateway, the same key: the core holds the first turn's row
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= answered["usage"]["prompt_tokens"], (cached, answered["usage"])

    stranger = chat(second, following, key=KEYS[1])  # another key: nothing of the first key's is reused
    assert stranger["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert stranger["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]


def chat(api: httpx.Client, messages: list[dict], key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": 12, "temperature": 0}
    answer = api.post("/v1/chat/completions", json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.json()
