"""The gateway's HTTP contract over real HTTP, in front of the real Triton: auth, limits, every
error status with its JSON body, the binary encoding, sessions, metrics."""

from __future__ import annotations

import re
import threading
import time

import httpx
import numpy as np
import pytest

from contract import names
from tests.gateway.conftest import KEYS, SESSIONS_PER_KEY, FreezableProxy, b64_tensor, from_b64, running

D_MODEL, N_LAYERS, N_KV_HEADS, HEAD_DIM = 256, 2, 4, 32  # the `gqa` test config the fixture serves
RNG = np.random.default_rng(0)
ONE_PAST = [[[[0.0] * HEAD_DIM] * 2] * N_KV_HEADS]  # (1, n_kv_heads, 2, head_dim)


def states(batch: int = 1, new: int = 3) -> np.ndarray:
    return RNG.standard_normal((batch, new, D_MODEL)).astype(np.float32)


def assert_error(response: httpx.Response, status: int, code: str, *fragments: str) -> str:
    """The status, our error body and no trace of a traceback; returns the message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    message = body["error"]["message"]
    for fragment in fragments:
        assert fragment in message, message
    assert "Traceback" not in response.text and 'File "' not in response.text
    return message


# --- health and auth ------------------------------------------------------------------------


def test_health_and_metrics_are_open(gateway):
    with httpx.Client(base_url=gateway.url) as anonymous:
        assert anonymous.get("/healthz").json() == {"status": "ok"}
        assert anonymous.get("/readyz").json() == {"status": "ready"}
        assert anonymous.get("/metrics").status_code == 200
        assert anonymous.get("/openapi.json").status_code == 200


@pytest.mark.parametrize(
    ("headers", "fragment"),
    [
        ({}, "an API key is required"),
        ({"Authorization": "Bearer wrong"}, "not valid"),
        ({"X-API-Key": "wrong"}, "not valid"),
        ({"X-API-Key": KEYS[0][:-1]}, "not valid"),  # a prefix of a real key
        ({"X-API-Key": "clé-non-ascii".encode()}, "not valid"),  # compare_digest refuses non-ASCII str
        ({"Authorization": f"Basic {KEYS[0]}"}, "an API key is required"),
    ],
)
def test_requests_without_a_valid_key_get_401(gateway, headers, fragment):
    with httpx.Client(base_url=gateway.url, headers=headers) as client:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/attend"), ("POST", "/v1/sessions")]:
            response = client.request(method, path, json={"hidden_states": states().tolist()})
            assert_error(response, 401, "unauthorized", fragment)
            assert response.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize("header", ["Authorization", "X-API-Key"])
@pytest.mark.parametrize("key", KEYS)
def test_either_header_with_any_configured_key_is_accepted(gateway, header, key):
    value = f"Bearer {key}" if header == "Authorization" else key
    response = httpx.get(f"{gateway.url}/v1/models", headers={header: value})
    assert response.status_code == 200, response.text


def test_models_describe_the_served_tensors(api):
    models = {m["name"]: m for m in api.get("/v1/models").json()["models"]}
    stateless, session = models["forward"], models["sessions"]
    assert stateless["kind"] == "stateless" and stateless["ready"]
    assert (stateless["d_model"], stateless["n_layers"], stateless["n_kv_heads"], stateless["head_dim"]) == (
        D_MODEL,
        N_LAYERS,
        N_KV_HEADS,
        HEAD_DIM,
    )
    assert {"name": "past_key_values.1.value", "datatype": "FP32", "shape": [-1, N_KV_HEADS, -1, HEAD_DIM]} in (
        stateless["inputs"]
    )
    assert session["kind"] == "session" and session["ready"] and session["dtype"] == "float32"
    # the engine its repository chose and the session operations it offers (its config publishes them)
    assert (session["engine"], session["operations"]) == ("static", list(names.OPERATIONS))
    assert stateless["operations"] is None and stateless["engine"] is None


# --- stateless attention and the binary encoding --------------------------------------------


def test_attend_returns_output_and_presents_and_b64_is_bit_exact_with_json(api):
    hidden = states(batch=2, new=5)
    as_json = api.post("/v1/attend", json={"hidden_states": hidden.tolist()}).json()
    as_b64 = api.post("/v1/attend?encoding=b64", json={"hidden_states": b64_tensor(hidden)}).json()
    output = np.asarray(as_json["output"], dtype=np.float32)
    assert output.shape == (2, 5, D_MODEL)
    assert as_b64["output"]["dtype"] == "float32" and as_b64["output"]["shape"] == [2, 5, D_MODEL]
    np.testing.assert_array_equal(from_b64(as_b64["output"]), output)  # bit-exact both ways
    assert len(as_json["present"]) == N_LAYERS
    for json_pair, b64_pair in zip(as_json["present"], as_b64["present"], strict=True):
        for kind in ("key", "value"):
            cache = np.asarray(json_pair[kind], dtype=np.float32)
            assert cache.shape == (2, N_KV_HEADS, 5, HEAD_DIM)
            np.testing.assert_array_equal(from_b64(b64_pair[kind]), cache)
    # nested lists and tensor objects mix freely within one request
    mixed = {"hidden_states": hidden[:, -1:].tolist(), "attention_mask": b64_tensor(np.ones((2, 6), np.int64))}
    mixed["past_key_values"] = as_b64["present"]
    assert api.post("/v1/attend", json=mixed).status_code == 200


@pytest.mark.parametrize(
    ("body", "fragments"),
    [
        ({"hidden_states": [[[0.5] * 3]]}, ["hidden_states", f"axis 2 = {D_MODEL}", "[1, 1, 3]"]),
        ({"hidden_states": [[[0.5] * D_MODEL], [[0.5] * 7]]}, ["hidden_states", "ragged"]),
        ({"hidden_states": [[[1e39] * D_MODEL]]}, ["hidden_states", "finite float32", "inf"]),
        (
            {"hidden_states": [[[0.5] * D_MODEL]], "attention_mask": [[1, 1]]},
            ["attention_mask", "past + new = 0 + 1 = 1, got 2"],
        ),
        (
            {"hidden_states": {"dtype": "int64", "shape": [1, 1, D_MODEL], "b64": "AAAA"}},
            ["hidden_states", "needs 2048 bytes", "decodes to 3"],
        ),
        (
            {"hidden_states": b64_tensor(np.zeros((1, 1, D_MODEL), np.int64))},
            ["hidden_states", "expected dtype float32, got int64"],
        ),
        ({"hidden_states": {"dtype": "float32", "shape": [1], "b64": "!!!"}}, ["hidden_states.b64", "base64"]),
        (
            {"hidden_states": [[[0.5] * D_MODEL]], "attention_mask": b64_tensor(np.array([[2]], np.int64))},
            ["attention_mask", "0 (padding) or 1 (attend)", "got 2"],
        ),
        (
            {"hidden_states": [[[0.5] * D_MODEL]], "attention_mask": [[3]]},
            ["attention_mask", "0 (padding) or 1 (attend)", "got 3"],
        ),
        ({"hidden_states": [[[0.5] * (D_MODEL - 1) + [True]]]}, ["hidden_states", "boolean", f"[0, 0, {D_MODEL - 1}]"]),
        (
            {
                "hidden_states": [[[0.5] * D_MODEL]],
                "past_key_values": [{"key": [[[[0.0] * HEAD_DIM]]], "value": [[[[0.0] * HEAD_DIM]]]}] * N_LAYERS,
            },
            ["past_key_values.0.key", f"axis 1 = {N_KV_HEADS}", "[1, 1, 1, 32]"],
        ),
        (
            {"hidden_states": [[[0.5] * D_MODEL]], "past_key_values": [{"key": ONE_PAST, "value": ONE_PAST}]},
            ["past_key_values.1.key", "missing"],
        ),
    ],
    ids=[
        "d_model",
        "ragged",
        "overflow",
        "mask-length",
        "b64-size",
        "b64-dtype",
        "b64-alphabet",
        "mask-value",
        "mask-list-value",
        "boolean",
        "kv-heads",
        "layers",
    ],
)
def test_bad_input_gets_400_naming_the_input_expected_and_actual(api, body, fragments):
    assert_error(api.post("/v1/attend", json=body), 400, "invalid_input", *fragments)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"hidden_states": "abc"}', "body.hidden_states"),
        ("{}", "body.hidden_states: Field required"),
        ('{"hidden_states": [[[0.5]]], "extra": 1}', "body.extra: Extra inputs are not permitted"),
        ('{"hidden_states": [[[NaN]]]}', "finite number"),
        ('{"hidden_states": [[[0.5]]], "attention_mask": "all"}', "body.attention_mask"),
        ('{"hidden_states": [[[0.5]]], "past_key_values": [{"key": [[[[0.5]]]]}]}', "past_key_values.0.value"),
        ("{not json", "JSON"),
        ("[1, 2]", "body"),
    ],
)
def test_schema_violations_get_422(api, content, fragment):
    response = api.post("/v1/attend", content=content, headers={"Content-Type": "application/json"})
    assert_error(response, 422, "validation_error", fragment)


def test_unknown_routes_and_methods_get_json_errors(api):
    assert_error(api.get("/v2/nothing"), 404, "not_found")
    assert_error(api.put("/v1/attend"), 405, "method_not_allowed")
    assert_error(api.post("/v1/attend?encoding=hex", json={"hidden_states": [[[0.5]]]}), 422, "validation_error")


def test_bodies_over_the_limit_get_413_declared_or_streamed(triton):
    with running(api_keys=KEYS, triton_url=triton.grpc_url, max_body_bytes=4096) as small:
        headers = {"X-API-Key": KEYS[0], "Content-Type": "application/json"}
        big = b'{"hidden_states": [[[' + b"0.5," * 2000 + b"0.5]]]}"
        response = httpx.post(f"{small.url}/v1/attend", content=big, headers=headers)
        assert_error(response, 413, "body_too_large", "Content-Length 8", "4096 bytes")
        streamed = httpx.post(f"{small.url}/v1/attend", content=iter([big[:3000], big[3000:]]), headers=headers)
        assert "content-length" not in streamed.request.headers  # chunked: no length declared up front
        assert_error(streamed, 413, "body_too_large", "4096 bytes")
        assert httpx.post(f"{small.url}/v1/attend", content=big[:4000], headers=headers).status_code == 422


# --- sessions -------------------------------------------------------------------------------


def test_session_lifecycle(api, gateway):
    created = api.post("/v1/sessions")
    assert created.status_code == 201
    session = created.json()["id"]
    assert created.headers["location"] == f"/v1/sessions/{session}"
    first = api.post(f"/v1/sessions/{session}/step", json={"hidden_states": states(new=4).tolist()})
    assert first.status_code == 200, first.text
    assert np.asarray(first.json()["output"]).shape == (1, 4, D_MODEL) and first.json()["length"] == 4
    second = api.post(f"/v1/sessions/{session}/step?encoding=b64", json={"hidden_states": b64_tensor(states(new=1))})
    assert from_b64(second.json()["output"]).shape == (1, 1, D_MODEL) and second.json()["length"] == 5
    # another key cannot see it
    other = {"X-API-Key": KEYS[1]}
    assert_error(httpx.delete(f"{gateway.url}/v1/sessions/{session}", headers=other), 404, "session_not_found")
    # a step that does not fit is a 400 and leaves the session as it was
    bad = api.post(f"/v1/sessions/{session}/step", json={"hidden_states": states(batch=2, new=1).tolist()})
    assert_error(bad, 400, "invalid_input", "batch_size must be 1, got 2")
    assert (
        api.post(f"/v1/sessions/{session}/step", json={"hidden_states": states(new=1).tolist()}).json()["length"] == 6
    )
    assert api.delete(f"/v1/sessions/{session}").status_code == 204
    step = api.post(f"/v1/sessions/{session}/step", json={"hidden_states": states().tolist()})
    assert_error(step, 404, "session_not_found", "closed by DELETE")
    assert_error(api.delete(f"/v1/sessions/{session}"), 404, "session_not_found")
    assert_error(api.delete("/v1/sessions/never-was"), 404, "session_not_found", "never-was")


def test_snapshot_restore_fork_and_rewind_through_the_gateway(api, gateway):
    """A snapshot (bytes) POSTed as application/octet-stream opens a session that goes on bit for
    bit as the original; a fork copies it; a rewind drops positions; another key can neither read
    the session nor restore its snapshot, and a bad blob is a 400 that opens nothing."""
    session = api.post("/v1/sessions").json()["id"]
    prompt, tokens = states(new=5), [states(new=1) for _ in range(4)]
    api.post(f"/v1/sessions/{session}/step", json={"hidden_states": b64_tensor(prompt)})
    snapshot = api.get(f"/v1/sessions/{session}/snapshot")
    assert snapshot.status_code == 200 and snapshot.headers["content-type"] == "application/octet-stream"
    blob = snapshot.content
    restored = api.post("/v1/sessions", content=blob, headers={"Content-Type": "application/octet-stream"})
    assert restored.status_code == 201, restored.text
    forked = api.post(f"/v1/sessions/{session}/fork")
    assert forked.status_code == 201, forked.text
    ids = [session, restored.json()["id"], forked.json()["id"]]
    firsts = []
    for token in tokens:
        answers = [
            api.post(f"/v1/sessions/{i}/step?encoding=b64", json={"hidden_states": b64_tensor(token)}).json()
            for i in ids
        ]
        outputs = [from_b64(answer["output"]) for answer in answers]
        np.testing.assert_array_equal(outputs[1], outputs[0])
        np.testing.assert_array_equal(outputs[2], outputs[0])
        firsts = firsts or outputs
    assert [answer["length"] for answer in answers] == [9, 9, 9]
    rewound = api.post(f"/v1/sessions/{ids[2]}/rewind", json={"length": 5})
    assert rewound.status_code == 200 and rewound.json() == {"length": 5}
    # back at the prompt: the first token again gives the first token's answer again
    again = api.post(f"/v1/sessions/{ids[2]}/step?encoding=b64", json={"hidden_states": b64_tensor(tokens[0])})
    np.testing.assert_array_equal(from_b64(again.json()["output"]), firsts[0])
    # the message names the session as the caller knows it, never Triton's sequence id
    refused = api.post(f"/v1/sessions/{ids[2]}/rewind", json={"length": 99})
    message = assert_error(refused, 400, "invalid_input", f"session '{ids[2]}' holds 6 positions", "got 99")
    assert "sequence" not in message, message
    assert_error(api.post(f"/v1/sessions/{ids[2]}/rewind", json={"length": -1}), 422, "validation_error")
    other = {"X-API-Key": KEYS[1]}
    assert_error(httpx.get(f"{gateway.url}/v1/sessions/{session}/snapshot", headers=other), 404, "session_not_found")
    assert_error(httpx.post(f"{gateway.url}/v1/sessions/{session}/fork", headers=other), 404, "session_not_found")
    for i in ids:
        assert api.delete(f"/v1/sessions/{i}").status_code == 204
    octet = {"Content-Type": "application/octet-stream"}
    foreign = httpx.post(f"{gateway.url}/v1/sessions", content=blob, headers={**other, **octet})
    assert_error(foreign, 400, "invalid_input", "belongs to another owner")
    assert_error(api.post("/v1/sessions", content=blob[:64], headers=octet), 400, "invalid_input", "not a session")
    with httpx.Client(base_url=gateway.url, headers=other) as client:  # the refusals left no session open
        opened = [client.post("/v1/sessions") for _ in range(SESSIONS_PER_KEY)]
        assert [answer.status_code for answer in opened] == [201] * SESSIONS_PER_KEY
        for answer in opened:
            client.delete(f"/v1/sessions/{answer.json()['id']}")


def test_prefixes_through_the_gateway_are_the_keys_own(api, gateway):
    """PUT a prefix once; sessions opened from it (a JSON body naming it) step as a session that
    prefilled the same tokens; it is listed for its key only, and deleted (404 after)."""
    prefix, token = states(new=6), states(new=1)
    put = api.put("/v1/prefixes/system", json={"hidden_states": b64_tensor(prefix)})
    assert put.status_code == 201 and put.json() == {"name": "system", "length": 6}, put.text
    assert api.get("/v1/prefixes").json() == {"prefixes": [{"name": "system", "length": 6}]}
    assert api.get("/v1/prefixes/system").json() == {"name": "system", "length": 6}
    other = {"X-API-Key": KEYS[1]}
    assert httpx.get(f"{gateway.url}/v1/prefixes", headers=other).json() == {"prefixes": []}
    assert_error(httpx.get(f"{gateway.url}/v1/prefixes/system", headers=other), 404, "prefix_not_found", "'system'")
    refused = httpx.post(f"{gateway.url}/v1/sessions", json={"prefix": "system"}, headers=other)
    assert_error(refused, 404, "prefix_not_found", "'system'")
    from_prefix = api.post("/v1/sessions", json={"prefix": "system"})
    assert from_prefix.status_code == 201, from_prefix.text
    prefilled = api.post("/v1/sessions").json()["id"]
    api.post(f"/v1/sessions/{prefilled}/step", json={"hidden_states": b64_tensor(prefix)})
    answers = [
        api.post(f"/v1/sessions/{i}/step?encoding=b64", json={"hidden_states": b64_tensor(token)}).json()
        for i in (from_prefix.json()["id"], prefilled)
    ]
    np.testing.assert_array_equal(from_b64(answers[0]["output"]), from_b64(answers[1]["output"]))
    assert answers[0]["length"] == answers[1]["length"] == 7
    again = api.put("/v1/prefixes/system", json={"hidden_states": b64_tensor(prefix)})
    assert_error(again, 400, "invalid_input", "immutable")
    assert api.delete("/v1/prefixes/system").status_code == 204
    assert_error(api.delete("/v1/prefixes/system"), 404, "prefix_not_found")
    assert_error(api.get("/v1/prefixes/system"), 404, "prefix_not_found", "'system'")
    assert_error(api.post("/v1/sessions", json={"prefix": 7}), 422, "validation_error")
    for i in (from_prefix.json()["id"], prefilled):
        assert api.delete(f"/v1/sessions/{i}").status_code == 204


def test_sessions_per_key_are_limited_to_429(gateway):
    with httpx.Client(base_url=gateway.url, headers={"X-API-Key": KEYS[1]}) as client:
        opened = [client.post("/v1/sessions").json()["id"] for _ in range(SESSIONS_PER_KEY)]
        assert_error(client.post("/v1/sessions"), 429, "too_many_sessions", f"limit is {SESSIONS_PER_KEY}")
        other = httpx.post(f"{gateway.url}/v1/sessions", headers={"X-API-Key": KEYS[0]})
        assert other.status_code == 201  # the limit is per key
        httpx.delete(f"{gateway.url}/v1/sessions/{other.json()['id']}", headers={"X-API-Key": KEYS[0]})
        assert client.delete(f"/v1/sessions/{opened.pop()}").status_code == 204
        opened.append(client.post("/v1/sessions").json()["id"])  # a freed slot can be used again
        for session in opened:
            assert client.delete(f"/v1/sessions/{session}").status_code == 204


def test_idle_sessions_expire(triton):
    with running(api_keys=KEYS, triton_url=triton.grpc_url, session_idle_s=0.5) as short:
        client = httpx.Client(base_url=short.url, headers={"X-API-Key": KEYS[0]})
        session = client.post("/v1/sessions").json()["id"]
        assert client.post(f"/v1/sessions/{session}/step", json={"hidden_states": states().tolist()}).status_code == 200
        time.sleep(0.8)
        step = client.post(f"/v1/sessions/{session}/step", json={"hidden_states": states().tolist()})
        assert_error(step, 404, "session_not_found", "closed after 0.5 s without a step")
        assert "gateway_active_sessions 0.0" in client.get("/metrics").text
        client.close()


# --- Triton hung or down ----------------------------------------------------------------------


@pytest.fixture
def hung(triton):
    """A gateway whose way to Triton can be frozen (a hung upstream), with a 2 s request timeout."""
    proxy = FreezableProxy(triton.grpc_url)
    settings = {"triton_url": proxy.address, "request_timeout_s": 2.0, "readiness_timeout_s": 0.5}
    with running(api_keys=KEYS, **settings) as gateway:
        client = httpx.Client(base_url=gateway.url, headers={"X-API-Key": KEYS[0]}, timeout=30)
        yield proxy, client
        proxy.thaw()
        client.close()
    proxy.close()


def test_a_hung_triton_gives_504_and_409_and_readyz_follows_it(hung):
    proxy, client = hung
    session = client.post("/v1/sessions").json()["id"]
    step = f"/v1/sessions/{session}/step"
    assert client.post(step, json={"hidden_states": states().tolist()}).status_code == 200
    proxy.freeze()
    assert_error(client.get("/readyz"), 503, "upstream_unavailable", "not reachable")
    in_flight = threading.Thread(
        target=client.post, args=(step,), kwargs={"json": {"hidden_states": states().tolist()}}
    )
    in_flight.start()
    time.sleep(0.5)  # the first step is now waiting on the frozen Triton
    assert_error(client.post(step, json={"hidden_states": states().tolist()}), 409, "session_conflict", "in flight")
    assert_error(client.delete(f"/v1/sessions/{session}"), 409, "session_conflict", "in flight")
    in_flight.join()
    assert_error(client.post("/v1/attend", json={"hidden_states": states().tolist()}), 504, "upstream_timeout", "2 s")
    proxy.thaw()
    assert client.get("/readyz").status_code == 200
    # the timed-out step may or may not have reached Triton: the session cannot go on
    again = client.post(step, json={"hidden_states": states().tolist()})
    assert_error(again, 409, "session_conflict", "timed out", "DELETE it")
    assert client.delete(f"/v1/sessions/{session}").status_code == 204
    assert client.post("/v1/attend", json={"hidden_states": states().tolist()}).status_code == 200
    metrics = client.get("/metrics").text
    assert re.search(r'gateway_upstream_errors_total\{kind="timeout"\} [1-9]', metrics), metrics


def test_triton_down_gives_503_and_liveness_stays(triton):
    from serving.host.launcher import free_port

    with running(api_keys=KEYS, triton_url=f"127.0.0.1:{free_port()}", readiness_timeout_s=2.0) as orphan:
        client = httpx.Client(base_url=orphan.url, headers={"X-API-Key": KEYS[0]})
        assert client.get("/healthz").status_code == 200
        assert_error(client.get("/readyz"), 503, "upstream_unavailable", "not reachable")
        response = client.post("/v1/attend", json={"hidden_states": states().tolist()})
        assert_error(response, 503, "upstream_unavailable")
        assert response.headers["retry-after"] == "1"
        assert_error(client.get("/v1/models"), 503, "upstream_unavailable")
        # admission at creation: the session is refused now, not at its first step, and not kept
        created = client.post("/v1/sessions")
        assert_error(created, 503, "upstream_unavailable", "opening a session")
        assert created.headers["retry-after"] == "1"
        assert re.search(r"^gateway_active_sessions 0.0$", client.get("/metrics").text, flags=re.MULTILINE)
        metrics = client.get("/metrics").text
        assert re.search(r'gateway_upstream_errors_total\{kind="ServerUnavailableError"\} [1-9]', metrics), metrics
        client.close()


# --- metrics --------------------------------------------------------------------------------


def test_metrics_count_requests_by_route_and_status(api, gateway):
    api.post("/v1/attend", json={"hidden_states": states().tolist()})
    api.post("/v1/attend", json={"hidden_states": [[[0.5]]]})
    session = api.post("/v1/sessions").json()["id"]
    api.post(f"/v1/sessions/{session}/step", json={"hidden_states": states().tolist()})
    text = httpx.get(f"{gateway.url}/metrics").text
    assert "gateway_active_sessions 1.0" in text
    api.delete(f"/v1/sessions/{session}")
    text = httpx.get(f"{gateway.url}/metrics").text
    for fragment in [
        'gateway_requests_total{method="POST",route="/v1/attend",status="200"}',
        'gateway_requests_total{method="POST",route="/v1/attend",status="400"}',
        'gateway_requests_total{method="POST",route="/v1/sessions/{session_id}/step",status="200"}',
        'gateway_request_duration_seconds_bucket{le="0.25",method="POST",route="/v1/attend",status="200"}',
        "gateway_active_sessions 0.0",
    ]:
        assert fragment in text, fragment


def test_the_openai_routes_refuse_an_attention_model_by_name(api):
    """The OpenAI-compatible routes take text: an attention model (hidden states in and out) is told so, 400 in
    OpenAI's error shape naming `model`, and the gateway goes on serving. The id the session model had before the
    models' names said what they serve (`mha_session`) is still that model."""
    for route, body in (
        ("/v1/completions", {"model": "sessions", "prompt": "hello"}),
        ("/v1/chat/completions", {"model": "sessions", "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"model": "mha_session", "prompt": "hello"}),
    ):
        answer = api.post(route, json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "model"
        assert "attention model" in error["message"]
    assert api.get("/v1/models").json()["data"] == []  # nothing the OpenAI routes serve: no card
