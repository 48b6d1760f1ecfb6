"""Per-key quotas (issue 34, item 4), against a real gateway and the session's real Triton: one key's named
prefixes or sessions cannot take the KV budget every key shares. Past a quota the key gets 429
`quota_exceeded` naming the limit and its setting, while another key (and the key's own other sessions) go
on; deleting a prefix or a session frees its share, and the refused request then succeeds.

On 45e04dd there were no quotas: every refused request below was answered 201 or 200."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from client import ModelInfo
from contract.config import ModelConfig
from serving.gateway.errors import QuotaExceeded
from serving.gateway.quotas import Held, Quotas
from serving.gateway.settings import Settings
from tests.fixtures.triton import WHOLE_ARTIFACT
from tests.gateway.conftest import b64_tensor, running

KEYS = ("quota-prefixes", "quota-bystander", "quota-sessions", "quota-other")
PREFIXES_PER_KEY = 2
KV_POSITIONS, PREFIX_POSITIONS = 20, 12  # the key's quotas, in positions of the served model


@pytest.fixture(scope="module")
def position_bytes(served_cfg) -> int:
    """A position's keys and values over every layer, float32: what the gateway counts a position as."""
    return served_cfg.kv_cache_bytes(batch=1, length=1, itemsize=4)


@pytest.fixture(scope="module")
def gateway(triton, position_bytes):
    settings = {
        "prefixes_per_key": PREFIXES_PER_KEY,
        "kv_bytes_per_key": KV_POSITIONS * position_bytes,
        "prefix_bytes_per_key": PREFIX_POSITIONS * position_bytes,
    }
    with running(api_keys=KEYS, triton_url=triton.grpc_url, **settings) as gateway:
        yield gateway


@contextlib.contextmanager
def client_of(gateway, key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, headers={"X-API-Key": key}, timeout=60) as client:
        assert client.get("/v1/models").status_code == 200  # the gateway knows the model's sizes from here on
        yield client


def tokens(count: int, d_model: int) -> dict:
    states = np.random.default_rng(count).standard_normal((1, count, d_model)).astype(np.float32)
    return {"hidden_states": b64_tensor(states)}


def assert_quota(answer: httpx.Response, *fragments: str) -> None:
    assert answer.status_code == 429, answer.text
    error = answer.json()["error"]
    assert error["code"] == "quota_exceeded", error
    for fragment in fragments:
        assert fragment in error["message"], error["message"]


def test_a_keys_prefixes_are_limited_in_count_and_bytes_and_others_go_on(gateway, served_cfg, position_bytes):
    d_model = served_cfg.d_model
    with client_of(gateway, KEYS[0]) as greedy, client_of(gateway, KEYS[1]) as bystander:
        for name in ("a", "b"):
            assert greedy.put(f"/v1/prefixes/{name}", json=tokens(2, d_model)).status_code == 201
        assert_quota(
            greedy.put("/v1/prefixes/c", json=tokens(2, d_model)),
            f"prefixes hold {PREFIXES_PER_KEY} of {PREFIXES_PER_KEY}",
            "SERVING_PREFIXES_PER_KEY",
        )
        opened = bystander.post("/v1/sessions")
        assert opened.status_code == 201, opened.text
        assert bystander.put("/v1/prefixes/mine", json=tokens(2, d_model)).status_code == 201

        assert greedy.delete("/v1/prefixes/a").status_code == 204  # its share is free: the refused PUT now fits
        assert greedy.put("/v1/prefixes/c", json=tokens(2, d_model)).status_code == 201
        assert greedy.delete("/v1/prefixes/b").status_code == 204
        too_long = PREFIX_POSITIONS - 2 + 1  # "c" holds 2 positions
        assert_quota(
            greedy.put("/v1/prefixes/long", json=tokens(too_long, d_model)),
            f"hold {2 * position_bytes:,} of {PREFIX_POSITIONS * position_bytes:,} bytes",
            "SERVING_PREFIX_BYTES_PER_KEY",
        )
        assert greedy.put("/v1/prefixes/long", json=tokens(too_long - 1, d_model)).status_code == 201

        for client, names in ((greedy, ("c", "long")), (bystander, ("mine",))):
            for name in names:
                assert client.delete(f"/v1/prefixes/{name}").status_code == 204
        assert bystander.delete(f"/v1/sessions/{opened.json()['id']}").status_code == 204


def test_a_step_past_the_keys_kv_bytes_is_refused_and_others_go_on(gateway, served_cfg, position_bytes):
    d_model = served_cfg.d_model
    with client_of(gateway, KEYS[2]) as greedy, client_of(gateway, KEYS[3]) as other:
        first, second, theirs = (client.post("/v1/sessions").json()["id"] for client in (greedy, greedy, other))
        assert greedy.post(f"/v1/sessions/{first}/step", json=tokens(10, d_model)).status_code == 200
        assert greedy.post(f"/v1/sessions/{second}/step", json=tokens(8, d_model)).status_code == 200
        refused = greedy.post(f"/v1/sessions/{second}/step", json=tokens(4, d_model))
        assert_quota(
            refused, "from 8 to 12 positions", f"of {KV_POSITIONS * position_bytes:,} bytes", "SERVING_KV_BYTES_PER_KEY"
        )
        # the key's other session, and another key's, go on; the refused step changed nothing
        assert greedy.post(f"/v1/sessions/{first}/step", json=tokens(2, d_model)).json()["length"] == 12
        assert other.post(f"/v1/sessions/{theirs}/step", json=tokens(KV_POSITIONS, d_model)).status_code == 200

        assert greedy.delete(f"/v1/sessions/{first}").status_code == 204  # its share is free
        assert greedy.post(f"/v1/sessions/{second}/step", json=tokens(4, d_model)).json()["length"] == 12
        # a rewind gives back what it drops; a prefix counts with the sessions
        assert greedy.post(f"/v1/sessions/{second}/rewind", json={"length": 2}).status_code == 200
        assert greedy.put("/v1/prefixes/p", json=tokens(PREFIX_POSITIONS, d_model)).status_code == 201
        from_prefix = greedy.post("/v1/sessions", json={"prefix": "p"})
        assert_quota(from_prefix, "the new session", "SERVING_KV_BYTES_PER_KEY")
        assert greedy.delete("/v1/prefixes/p").status_code == 204
        for client, session in ((greedy, second), (other, theirs)):
            assert client.delete(f"/v1/sessions/{session}").status_code == 204


WHOLE_KEY, GENERATED_POSITIONS = "quota-generates", 16


@pytest.fixture(scope="module")
def generating(whole_triton, artifact_dir) -> Iterator[httpx.Client]:
    """A gateway in front of the whole model's Triton whose key may hold 16 positions."""
    cfg = ModelConfig.load(artifact_dir(WHOLE_ARTIFACT))
    quota = GENERATED_POSITIONS * cfg.kv_cache_bytes(batch=1, length=1, itemsize=4)
    with (
        running(api_keys=(WHOLE_KEY,), triton_url=whole_triton.grpc_url, kv_bytes_per_key=quota) as gateway,
        client_of(gateway, WHOLE_KEY) as client,
    ):
        yield client


@pytest.mark.served
def test_a_generation_is_refused_when_its_prompt_and_new_tokens_pass_the_quota(generating):
    """A generation reserves its prompt and max_new_tokens before it starts: in a session, and in an OpenAI
    request's session; one that fits runs, and its session then counts what it holds."""
    session = generating.post("/v1/sessions").json()["id"]
    path = f"/v1/sessions/{session}/generate"
    prompt = [5, 6, 7, 8]
    assert_quota(
        generating.post(path, json={"input_ids": prompt, "max_new_tokens": GENERATED_POSITIONS}),
        "from 0 to 20 positions",
        "SERVING_KV_BYTES_PER_KEY",
    )
    fits = generating.post(path, json={"input_ids": prompt, "max_new_tokens": 4})
    assert fits.status_code == 200 and fits.json()["held_length"] == 8, fits.text
    completion = {"model": "sessions", "prompt": prompt, "temperature": 0}
    assert_quota(
        generating.post("/v1/completions", json=completion | {"max_tokens": 5}),
        "this API key's other sessions and prefixes hold",
        "SERVING_KV_BYTES_PER_KEY",
    )
    assert generating.delete(f"/v1/sessions/{session}").status_code == 204
    answered = generating.post("/v1/completions", json=completion | {"max_tokens": 5})
    assert answered.status_code == 200, answered.text


# --- the tallies in-process: what the routes above cannot reach cheaply ------------------------------------


class Stepped:
    """A client session as the tallies read one: its length and the session model it steps."""

    def __init__(self, model: str = "sessions") -> None:
        self.length = 0
        self.client = types.SimpleNamespace(session_model=model)


def tallies(**settings) -> tuple[Quotas, list[float]]:
    """Quotas of 10 positions a key over a model of 8 bytes a position (2 x 1 x 1 x 1 x 4), and their clock."""
    now = [0.0]
    quotas = Quotas(Settings(kv_bytes_per_key=80, **settings), clock=lambda: now[0])
    quotas.learn("sessions", session_model())
    return quotas, now


def session_model(**facts) -> ModelInfo:
    sizes = {"n_layers": 1, "n_kv_heads": 1, "head_dim": 1}
    return ModelInfo("sessions", {}, {}, d_model=4, float_dtype="float32", facts=sizes | facts)


def test_a_generation_reserves_its_most_and_gives_back_what_it_did_not_use():
    quotas, _ = tallies()
    session = Stepped()
    with quotas.growing("key", session, 8):  # a prompt and max_new_tokens
        with pytest.raises(QuotaExceeded, match="SERVING_KV_BYTES_PER_KEY"):
            quotas.opened("key", _opened(3))  # the reservation is held while it runs
        session.length = 5  # it stopped early
    assert quotas.held("key").nbytes == 5 * 8
    quotas.opened("key", _opened(5))
    quotas.release(session)
    assert quotas.held("key").nbytes == 5 * 8


def test_a_refused_step_reserves_nothing_and_another_model_counts_at_its_own_size():
    quotas, _ = tallies()
    session = Stepped()
    quotas.grow("key", session, 10)
    session.length = 10
    with pytest.raises(QuotaExceeded, match="growing from 10 to 11 positions"):
        quotas.grow("key", session, 1)
    assert quotas.held("key").nbytes == 80
    unknown = Stepped(model="another_session")  # sizes not learned yet: not counted until they are
    quotas.grow("key", unknown, 100)
    assert quotas.held("key").nbytes == 80


def test_idle_shares_are_forgotten_and_a_default_is_a_share_of_the_published_budget():
    quotas, now = tallies()
    session = Stepped()
    quotas.grow("key", session, 4)
    now[0] = 30.0
    quotas.forget_idle(idle_s=60.0)
    assert quotas.held("key").nbytes == 32
    now[0] = 61.0
    quotas.forget_idle(idle_s=60.0)
    assert quotas.held("key") == Held()
    shared = Quotas(Settings(kv_share_per_key=0.25))
    shared.learn("sessions", session_model(kv_cache_bytes=1000))
    assert (shared.kv_bytes, shared.prefix_bytes) == (250, 125)


def _opened(length: int) -> Stepped:
    session = Stepped()
    session.length = length
    return session
