"""`POST /v1/inspect` over real HTTP in front of the real Triton: the maps are the client library's for
the same input (stateless and a session's next step), the statistics come with them, a session is left
as it was, bad bodies get 4xx naming the field, and the route wants a key like the others. A whole model
with a tokenizer (tests/gateway/conftest.py `whole`) takes text: its maps are those of the ids the
tokenizer encodes it to, and the answer names those tokens."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from client import Client
from client.text import TextModel
from contract.heads import INDUCTION, ROLES, STATISTICS
from tests.fixtures.triton import WHOLE_ARTIFACT
from tests.gateway.conftest import b64_tensor, from_b64
from tests.gateway.test_api import assert_error


@pytest.fixture(scope="module")
def direct(triton):
    with Client(triton.grpc_url) as client:
        yield client


def tokens(served_cfg, count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, served_cfg.d_model)).astype(np.float32)


def test_stateless_maps_are_the_client_librarys_with_statistics(api, direct, served_cfg):
    hidden = tokens(served_cfg, 6, 0)
    mask = np.array([0, 1, 1, 1, 1, 1], np.int64)
    expected = direct.infer(hidden[None], mask[None], attention_maps=True).attention_maps
    for body, encoding in (
        ({"hidden_states": hidden.tolist(), "attention_mask": mask.tolist()}, "json"),
        ({"hidden_states": b64_tensor(hidden[None]), "attention_mask": b64_tensor(mask[None])}, "b64"),
    ):
        answer = api.post(f"/v1/inspect?encoding={encoding}", json=body)
        assert answer.status_code == 200, answer.text
        got = answer.json()
        sizes = (got["layers"], got["heads"], got["queries"], got["keys"])
        assert sizes == (served_cfg.n_layers, served_cfg.n_heads, 6, 6)
        decode = from_b64 if encoding == "b64" else (lambda m: np.asarray(m, np.float32))
        for layer, weights in enumerate(got["maps"]):
            np.testing.assert_array_equal(decode(weights)[:, 1:], expected[layer][0][:, 1:])  # query 0 is padding
        stats = got["statistics"]
        assert [s["layer"] for s in stats] == list(range(served_cfg.n_layers))
        assert all(len(s["heads"]) == served_cfg.n_heads and s["queries"] == 4 for s in stats)  # real with a choice
        assert all(isinstance(h[name], float) for s in stats for h in s["heads"] for name in STATISTICS)
        assert all(INDUCTION not in h for s in stats for h in s["heads"])  # hidden states: no ids to repeat
        induction = [role for role in got["roles"] if role["statistic"] == INDUCTION]
        assert [(role["measured"], role["heads"]) for role in induction] == [(False, [])]


def test_a_sessions_next_step_is_inspected_and_the_session_is_unchanged(api, served_cfg):
    created = api.post("/v1/sessions")
    assert created.status_code == 201, created.text
    session = created.json()["id"]
    try:
        step = api.post(f"/v1/sessions/{session}/step", json={"hidden_states": [tokens(served_cfg, 5, 1).tolist()]})
        assert step.json()["length"] == 5
        new = tokens(served_cfg, 3, 2)
        answer = api.post("/v1/inspect", json={"session": session, "hidden_states": new.tolist()})
        assert answer.status_code == 200, answer.text
        got = answer.json()
        assert (got["queries"], got["keys"]) == (3, 8)
        maps = np.asarray(got["maps"])
        np.testing.assert_allclose(maps.sum(-1), 1.0, atol=1e-5)
        assert np.all(maps[..., 0, 6:] == 0)  # the first new query sees no later key
        again = api.post("/v1/inspect", json={"session": session, "hidden_states": new.tolist()}).json()
        np.testing.assert_array_equal(np.asarray(again["maps"]), maps)  # nothing was taken
        after = api.post(f"/v1/sessions/{session}/step", json={"hidden_states": [new.tolist()]})
        assert after.json()["length"] == 8  # the inspection added nothing
    finally:
        api.delete(f"/v1/sessions/{session}")


WIDE = "WIDE"  # stands for zeros of (2, d_model) in the bodies below
BAD_BODIES = [
    (b"{not json", 422, ["body: not valid JSON"]),
    ({"hidden_states": "ONE_TOO_WIDE"}, 400, ["input 'hidden_states'", "expected shape", "got [1, 2, D+1]"]),
    ({"hidden_states": [[[[0.0]]]]}, 400, ["input 'hidden_states'", "expected one sequence", "got shape [1, 1, 1, 1]"]),
    ({"hidden_states": [[float("1e39")] * 4]}, 400, ["input 'hidden_states'"]),
    ({"tokens": 3}, 422, ["body.tokens"]),  # (hidden_states or a whole model's input_ids: which, the model says)
    ({}, 422, ["body.hidden_states: Field required"]),
    ({"hidden_states": "zeros"}, 422, ["body.hidden_states"]),
    ({"hidden_states": None, "session": "x"}, 422, ["body.hidden_states"]),
    ({"hidden_states": WIDE, "attention_mask": [1, 1], "session": "x"}, 422, ["attention_mask", "session"]),
    ({"hidden_states": WIDE, "attention_mask": [1, 2]}, 400, ["attention_mask"]),
    ({"hidden_states": WIDE, "session": "no-such-session"}, 404, ["session"]),
]


@pytest.mark.parametrize(("body", "status", "words"), BAD_BODIES)
def test_bad_bodies_get_4xx_naming_the_field(api, served_cfg, body, status, words):
    d = served_cfg.d_model
    if isinstance(body, dict):
        given = {"WIDE": np.zeros((2, d)).tolist(), "ONE_TOO_WIDE": np.zeros((2, d + 1)).tolist()}
        body = {key: given.get(value, value) if isinstance(value, str) else value for key, value in body.items()}
    sent = api.post("/v1/inspect", content=body) if isinstance(body, bytes) else api.post("/v1/inspect", json=body)
    assert sent.status_code == status, sent.text
    message = sent.json()["error"]["message"]
    assert all(word.replace("D+1", str(d + 1)) in message for word in words), message


def test_the_route_wants_a_key_like_the_others(gateway, served_cfg):
    body = {"hidden_states": np.zeros((2, served_cfg.d_model)).tolist()}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = httpx.post(f"{gateway.url}/v1/inspect", json=body, headers=headers, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    allowed = httpx.post(f"{gateway.url}/v1/inspect", json=body, headers={"X-API-Key": "key-two"}, timeout=30)
    assert allowed.status_code == 200, allowed.text


def test_the_route_is_in_the_openapi_document(api):
    document = api.get("/openapi.json").json()
    operation = document["paths"]["/v1/inspect"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/InspectRequest")
    assert "InspectRequest" in document["components"]["schemas"] and operation["security"]


# -- text, for a whole model with a tokenizer ---------------------------------------------------------------

# spaces, a newline, and characters the byte-level BPE splits into tokens of part of a character
TEXT = "the cat 你好\nsat"


@pytest.fixture(scope="module")
def tokenizer(artifact_dir) -> TextModel:
    """The `whole` artifact's own tokenizer, read from its folder: what its served model should encode with."""
    return TextModel.from_folder(artifact_dir(WHOLE_ARTIFACT))


def test_text_is_inspected_as_the_ids_its_tokenizer_encodes_it_to(whole, tokenizer):
    api, _ = whole
    ids = tokenizer.encode(TEXT)
    assert any(tokenizer.token_text(token).startswith("bytes:") for token in ids)  # the case the labels escape
    as_text = api.post("/v1/inspect", json={"text": TEXT})
    assert as_text.status_code == 200, as_text.text
    got, expected = as_text.json(), api.post("/v1/inspect", json={"input_ids": ids}).json()
    assert got["tokens"] == [{"id": token, "text": tokenizer.token_text(token)} for token in ids]
    assert got["queries"] == got["keys"] == len(ids)
    np.testing.assert_array_equal(np.asarray(got["maps"]), np.asarray(expected["maps"]))
    assert got["statistics"] == expected["statistics"] and "tokens" not in expected

    session = api.post("/v1/sessions").json()["id"]
    try:  # a session's next step: the text goes on from what it holds, no special token added
        assert api.post(f"/v1/sessions/{session}/step", json={"input_ids": [ids]}).json()["length"] == len(ids)
        more = tokenizer.encode(" and the dog", add_special_tokens=False)
        step = api.post("/v1/inspect?encoding=b64", json={"text": " and the dog", "session": session}).json()
        same = api.post("/v1/inspect?encoding=b64", json={"input_ids": more, "session": session}).json()
        assert [token["id"] for token in step["tokens"]] == more
        assert (step["queries"], step["keys"]) == (len(more), len(ids) + len(more))
        for text_maps, id_maps in zip(step["maps"], same["maps"], strict=True):
            np.testing.assert_array_equal(from_b64(text_maps), from_b64(id_maps))
    finally:
        api.delete(f"/v1/sessions/{session}")


def test_repeated_ids_get_each_heads_induction_share_and_the_heads_named(whole):
    """N ids twice: each head's induction share is the mean weight the answer's own maps put, from the
    second copy's query N + k, on key k + 1; the roles name the heads at or above their thresholds. A
    session's step has no induction share: its past's ids are not the gateway's."""
    api, model = whole
    count = 10
    first = np.random.default_rng(4).choice(np.arange(1, model.cfg.vocab_size), count, replace=False).tolist()
    answer = api.post("/v1/inspect", json={"input_ids": first + first})
    assert answer.status_code == 200, answer.text
    got = answer.json()
    maps = np.asarray(got["maps"])  # (layers, heads, queries, keys)
    expected = maps[:, :, count + np.arange(count), np.arange(count) + 1].mean(axis=-1)
    shares = np.array([[head[INDUCTION] for head in layer["heads"]] for layer in got["statistics"]])
    np.testing.assert_allclose(shares, expected, rtol=1e-6)
    assert all(layer["induction_queries"] == count for layer in got["statistics"])
    for role in got["roles"]:
        threshold = next(r.threshold for r in ROLES if r.name == role["role"])
        passing = [
            (layer["layer"], head["head"])
            for layer in got["statistics"]
            for head in layer["heads"]
            if head[role["statistic"]] >= threshold
        ]
        assert sorted((h["layer"], h["head"]) for h in role["heads"]) == passing
        assert role["measured"] is True and role["threshold"] == threshold

    session = api.post("/v1/sessions").json()["id"]
    try:
        assert api.post(f"/v1/sessions/{session}/step", json={"input_ids": [first]}).json()["length"] == count
        step = api.post("/v1/inspect", json={"input_ids": first, "session": session}).json()
        assert all(INDUCTION not in head for layer in step["statistics"] for head in layer["heads"])
    finally:
        api.delete(f"/v1/sessions/{session}")


def test_text_is_refused_where_it_cannot_be_read(whole, api, tokenizer):
    whole_api, model = whole
    inspect = "/v1/inspect"
    for beside in ({"input_ids": [1, 2]}, {"attention_mask": [1, 1]}):
        assert_error(whole_api.post(inspect, json={"text": "a b", **beside}), 422, "validation_error", "body.text")
    assert_error(whole_api.post(inspect, json={"text": ""}), 400, "invalid_input", "body.text", "no tokens")
    longer = "word " * model.cfg.max_seq_len
    count = len(tokenizer.encode(longer))
    refused = whole_api.post(inspect, json={"text": longer})
    assert_error(refused, 400, "invalid_input", f"body.text (encoded to {count} tokens)", "input_ids")
    assert refused.json()["error"]["param"] == "text"
    # a model of hidden states reads no text
    assert_error(api.post(inspect, json={"text": "a b"}), 400, "invalid_input", "body.text", "not text")
