"""What the gateway refuses up front, in front of the real Triton: stateless requests past its
concurrency cap (429 at once, with Retry-After), requests with more tokens than it lets through,
sessions when Triton's KV-cache budget is full (503 at creation, not at the first step). And /docs,
served without a CDN."""

from __future__ import annotations

import concurrent.futures
import logging
import time

import httpx
import numpy as np

from tests.fixtures.triton import TEST_SETTINGS
from tests.gateway.conftest import b64_tensor, from_b64, running

CAP = 2


def big_request(served_cfg, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((1, 1024, served_cfg.d_model)).astype(np.float32)  # tens of ms each
    return {"hidden_states": b64_tensor(hidden)}


def test_attend_past_the_concurrency_cap_gets_429_at_once_and_the_rest_are_right(triton, served_cfg):
    """4x the cap at once: some wait for nothing (429 with Retry-After, in well under a second), the
    others get exactly the answer the same request gets alone."""
    with running(triton_url=triton.grpc_url, attend_concurrency=CAP) as gateway:
        url = f"{gateway.url}/v1/attend?encoding=b64"
        bodies = [big_request(served_cfg, seed) for seed in range(4 * CAP)]
        alone = [from_b64(httpx.post(url, json=body, timeout=60).json()["output"]) for body in bodies]

        def send(body: dict) -> tuple[httpx.Response, float]:
            started = time.perf_counter()
            response = httpx.post(url, json=body, timeout=60)
            return response, time.perf_counter() - started

        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(send, bodies))
        refused = [(r, seconds) for r, seconds in answers if r.status_code == 429]
        assert refused, [r.status_code for r, _ in answers]
        assert all(r.status_code in (200, 429) for r, _ in answers), [r.text[:200] for r, _ in answers]
        for response, seconds in refused:
            assert response.json()["error"]["code"] == "overloaded" and response.headers["retry-after"] == "1"
            assert seconds < 1.0, seconds
        for (response, _), expected in zip(answers, alone, strict=True):
            if response.status_code == 200:
                np.testing.assert_array_equal(from_b64(response.json()["output"]), expected)
        assert httpx.post(url, json=bodies[0], timeout=60).status_code == 200  # the cap frees up


def test_attend_with_more_tokens_than_the_gateway_lets_through_gets_400(triton, served_cfg, caplog):
    """A cap below the model's own is honoured, and said once in the log (the model takes more)."""
    with caplog.at_level(logging.WARNING), running(triton_url=triton.grpc_url, max_request_tokens=16) as gateway:
        hidden = np.zeros((3, 6, served_cfg.d_model), np.float32)
        answer = httpx.post(f"{gateway.url}/v1/attend", json={"hidden_states": b64_tensor(hidden)}, timeout=60)
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert "hidden_states" in message and "3 x 6 = 18 tokens" in message and "16 per request" in message
    assert "SERVING_MAX_REQUEST_TOKENS=16 is below the model's own cap of" in caplog.text


def test_a_session_is_refused_at_creation_when_the_kv_budget_is_full(triton, served_cfg):
    """The shared Triton's budget holds 64 sequences of max_seq_len (tests/fixtures/triton.py), and a
    session starts in a row of 256 positions (rows sized to the session): one more than the budget
    holds of those is refused when it is created, with Retry-After, and is not kept."""
    fits = TEST_SETTINGS.kv_cache_bytes // served_cfg.kv_cache_bytes(1, TEST_SETTINGS.min_row_positions)
    with (
        running(triton_url=triton.grpc_url, sessions_per_key=fits + 10) as gateway,
        httpx.Client(base_url=gateway.url, timeout=60) as api,
    ):
        opened = []
        try:
            while len(opened) < fits + 10:
                created = api.post("/v1/sessions")
                if created.status_code != 201:
                    break
                opened.append(created.json()["id"])
            assert len(opened) == fits, (len(opened), fits)
            assert created.status_code == 503, created.text
            assert created.json()["error"]["code"] == "upstream_busy" and created.headers["retry-after"] == "5"
            assert "cannot start" in created.json()["error"]["message"]
            assert api.get("/metrics").text.count(f"gateway_active_sessions {fits}.0") == 1
            api.delete(f"/v1/sessions/{opened.pop()}")
            assert api.post("/v1/sessions").status_code == 201  # room again
        finally:
            for session in opened:
                api.delete(f"/v1/sessions/{session}")


def test_docs_are_served_from_the_package_not_a_cdn(gateway):
    page = httpx.get(f"{gateway.url}/docs", timeout=10)
    assert page.status_code == 200 and "swagger-ui" in page.text
    assert "cdn" not in page.text.lower() and "https://" not in page.text
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        served = httpx.get(f"{gateway.url}/docs-assets/{asset}", timeout=10)
        assert served.status_code == 200 and len(served.content) > 10_000, asset
