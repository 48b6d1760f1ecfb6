"""What an inference gateway reads on the gateway's /metrics (serving/gateway/metrics.py, docs/scale-out.md "Metrics
an inference gateway reads"): generations waiting for their first token and running, prompt and generated tokens,
time to first token and between tokens, and the KV cache's utilization read from Triton's metrics endpoints.

The served tests run a real gateway in front of the session's whole-model Triton (`whole_triton`) through a TCP
relay that can stop relaying (tests/gateway/conftest.py `FreezableProxy`: a generation then waits for its first
token), and read Triton's own gauges directly (tests/fixtures/triton.py `metric`) for what the gateway should say."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serving.gateway.metrics import ENGINE_RUNNING, ENGINE_WAITING, KV_CACHE_USAGE, Metrics
from serving.gateway.model_server import read_kv_usage, usage_in
from tests.fixtures.triton import metric
from tests.gateway.conftest import FreezableProxy, running

KEY = "metrics-key"
PROMPT = [3, 14, 15, 92, 65]
NEW_TOKENS = 6
SESSION_MODEL = "sessions"
RESERVED, BUDGET = "attention_kv_cache_reserved_bytes", "attention_kv_cache_budget_bytes"
WAITING, RUNNING = "gateway_num_requests_waiting", "gateway_num_requests_running"
PROMPT_TOKENS, GENERATED = "gateway_prompt_tokens_total", "gateway_generation_tokens_total"
TTFT, ITL = "gateway_time_to_first_token_seconds", "gateway_inter_token_latency_seconds"
SCRAPE_ERRORS = 'gateway_upstream_errors_total{kind="metrics_scrape"}'


def samples(text: str) -> dict[str, float]:
    """Every sample of an exposition: `name` or `name{k="v",...}` (labels sorted) -> value."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


def scraped(api: httpx.Client) -> dict[str, float]:
    answer = api.get("/metrics")
    assert answer.status_code == 200, answer.text
    return samples(answer.text)


def polled(read: Callable[[], dict[str, float]], until: Callable[[dict[str, float]], bool], timeout_s: float = 5.0):
    """`read()` until `until` holds of it or `timeout_s` passes; the last read."""
    deadline = time.monotonic() + timeout_s
    while not until(seen := read()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def tritons_ratio(server) -> float:
    return metric(server, RESERVED, SESSION_MODEL) / metric(server, BUDGET, SESSION_MODEL)


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def relayed(whole_triton) -> Iterator[tuple[httpx.Client, FreezableProxy]]:
    """(an HTTP client of a gateway that reaches the whole-model Triton through a relay and reads its metrics
    endpoint, the relay)."""
    proxy = FreezableProxy(whole_triton.grpc_url)
    settings = {"triton_url": proxy.address, "triton_metrics_urls": (whole_triton.metrics_url,)}
    with running(api_keys=(KEY,), **settings) as gateway:
        with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as api:
            yield api, proxy
        proxy.thaw()
    proxy.close()


@pytest.mark.served
def test_each_generation_counts_its_tokens_and_times_them(relayed):
    """One generation answered at once and one streamed: prompt and generated tokens counted, one first-token
    latency each and one gap per later token, none left waiting or running once they ended."""
    api, _ = relayed
    body = {"input_ids": PROMPT, "max_new_tokens": NEW_TOKENS, "temperature": 0.0}
    before, started = scraped(api), time.perf_counter()
    answer = api.post("/v1/generate", json=body)
    assert answer.status_code == 200, answer.text
    with api.stream("POST", "/v1/generate", json=body | {"stream": True}) as stream:
        streamed = sum(1 for line in stream.iter_lines() if line.startswith('data: {"token_id"'))
    elapsed = time.perf_counter() - started
    after = scraped(api)
    added = {name: after[name] - before.get(name, 0.0) for name in after}

    generated = len(answer.json()["token_ids"]) + streamed
    assert generated == 2 * NEW_TOKENS  # no stop token asked: both run to max_new_tokens
    assert added[PROMPT_TOKENS] == 2 * len(PROMPT)
    assert added[GENERATED] == generated
    assert added[f"{TTFT}_count"] == 2
    assert added[f"{ITL}_count"] == generated - 2
    # the server's clock inside the client's: seconds, not milliseconds, and no gap counted twice
    assert 0 < added[f"{TTFT}_sum"] + added[f"{ITL}_sum"] <= elapsed
    assert after[WAITING] == after[RUNNING] == 0


@pytest.mark.served
def test_a_generation_is_waiting_until_its_first_token_comes(relayed):
    """Triton stops answering: the generation waits (counted) and its first token's latency covers the wait."""
    api, proxy = relayed
    before = scraped(api)
    proxy.freeze()
    answers: list[httpx.Response] = []
    body = {"input_ids": PROMPT, "max_new_tokens": 2, "temperature": 0.0}
    waiter = threading.Thread(target=lambda: answers.append(api.post("/v1/generate", json=body)))
    try:
        waiter.start()
        during = polled(lambda: scraped(api), lambda seen: seen[WAITING] == 1)
        assert during[WAITING] == 1 and during[RUNNING] == 0, during
        time.sleep(0.3)
    finally:
        proxy.thaw()
        waiter.join()
    assert answers[0].status_code == 200, answers[0].text
    after = scraped(api)
    assert after[WAITING] == after[RUNNING] == 0
    assert after[f"{TTFT}_count"] - before[f"{TTFT}_count"] == 1
    assert after[f"{TTFT}_sum"] - before[f"{TTFT}_sum"] >= 0.3


@pytest.mark.served
def test_the_kv_cache_usage_is_what_tritons_live_sequences_reserve_of_its_budget(relayed, whole_triton):
    api, _ = relayed
    session = api.post("/v1/sessions").json()["id"]
    try:
        assert api.post(f"/v1/sessions/{session}/step", json={"input_ids": [PROMPT]}).status_code == 200
        held = tritons_ratio(whole_triton)
        assert 0 < held < 1
        seen = polled(lambda: scraped(api), lambda seen: seen.get(KV_CACHE_USAGE) == held)
        assert seen.get(KV_CACHE_USAGE) == held
    finally:
        api.delete(f"/v1/sessions/{session}")
    freed = polled(lambda: {"ratio": tritons_ratio(whole_triton)}, lambda seen: seen["ratio"] < held)["ratio"]
    assert freed < held
    assert polled(lambda: scraped(api), lambda seen: seen.get(KV_CACHE_USAGE) == freed).get(KV_CACHE_USAGE) == freed


@pytest.mark.served
def test_the_engine_cores_load_is_tritons_own_gauges(relayed, whole_triton):
    """The queue an endpoint picker reads is the engine core's, every gateway's requests: what Triton publishes,
    once the generations ended 0 running and 0 waiting."""
    api, _ = relayed
    body = {"input_ids": PROMPT, "max_new_tokens": NEW_TOKENS, "temperature": 0.0}
    assert api.post("/v1/generate", json=body).status_code == 200
    triton = {name: metric(whole_triton, f"attention_engine_{name}", SESSION_MODEL) for name in ("running", "waiting")}
    seen = polled(lambda: scraped(api), lambda seen: seen.get(ENGINE_RUNNING) == triton["running"])
    assert (seen.get(ENGINE_RUNNING), seen.get(ENGINE_WAITING)) == (triton["running"], triton["waiting"]) == (0, 0)


@pytest.mark.served
def test_the_kv_cache_usage_sums_every_replica_and_names_the_one_that_did_not_answer(whole_triton, triton):
    """Two real Tritons (the whole model's, the attention model's) and a closed port, read as one fleet."""
    dead = f"http://127.0.0.1:{closed_port()}/metrics"
    servers = (whole_triton, triton)
    reserved_before = sum(metric(server, RESERVED, SESSION_MODEL) for server in servers)
    read = asyncio.run(read_kv_usage([whole_triton.metrics_url, triton.metrics_url, dead], SESSION_MODEL, 2.0))
    reserved_after = sum(metric(server, RESERVED, SESSION_MODEL) for server in servers)
    assert read.usage is not None
    # a sequence another test left may be evicted meanwhile: the read is one of the two states
    assert read.usage.reserved_bytes in (reserved_before, reserved_after)
    assert read.usage.budget_bytes == sum(metric(server, BUDGET, SESSION_MODEL) for server in servers) > 0
    ((where, why),) = read.failed
    assert where == f"{dead} at 127.0.0.1" and "refused" in why


@pytest.mark.served
def test_without_a_readable_triton_the_kv_cache_usage_is_left_out():
    """Unset: no gauge and nothing tried; set to an endpoint that refuses: no gauge, the failure counted."""
    triton_url = f"127.0.0.1:{closed_port()}"  # these gateways never reach a Triton: none is needed
    for urls, failures in (((), 0), ((f"http://127.0.0.1:{closed_port()}/metrics",), 1)):
        with running(triton_url=triton_url, triton_metrics_urls=urls) as gateway:
            seen = samples(httpx.get(f"{gateway.url}/metrics", timeout=30).text)
        assert not {KV_CACHE_USAGE, ENGINE_RUNNING, ENGINE_WAITING} & set(seen), seen
        assert seen.get(SCRAPE_ERRORS, 0) == failures


def test_a_generation_timer_moves_from_waiting_to_running_and_ends_once():
    metrics = Metrics()
    abandoned, finished = metrics.generation(4), metrics.generation(3)
    assert [exposed(metrics)[name] for name in (WAITING, RUNNING)] == [2, 0]
    finished.token()
    finished.token()
    assert [exposed(metrics)[name] for name in (WAITING, RUNNING)] == [1, 1]
    for timer in (abandoned, finished, abandoned, finished):  # each twice: the second is nothing
        timer.end()
    finished.token()  # let go: not counted
    seen = exposed(metrics)
    assert [seen[name] for name in (WAITING, RUNNING, PROMPT_TOKENS, GENERATED)] == [0, 0, 7, 2]
    assert [seen[f"{TTFT}_count"], seen[f"{ITL}_count"]] == [1, 1]
    with metrics.generation(1) as timer:
        timer.token()
    assert exposed(metrics)[RUNNING] == 0


def exposed(metrics: Metrics) -> dict[str, float]:
    return samples(generate_latest(metrics.registry).decode())


def test_the_usage_is_the_session_models_reserved_bytes_over_its_budget():
    """An exposition as Triton writes one: other models and Triton's own families are not counted; a model that
    has published no budget yet has no usage."""
    exposition = "\n".join(
        [
            "# HELP nv_inference_count Number of inferences performed",
            "# TYPE nv_inference_count counter",
            'nv_inference_count{model="sessions",version="1"} 12',
            "# HELP attention_kv_cache_reserved_bytes Bytes of the budget reserved by live sequences",
            "# TYPE attention_kv_cache_reserved_bytes gauge",
            'attention_kv_cache_reserved_bytes{kv_dtype="float32",model="sessions"} 1048576',
            'attention_kv_cache_reserved_bytes{kv_dtype="int8",model="sessions-int8w"} 4096',
            'attention_kv_cache_reserved_bytes{kv_dtype="float32",model="fortunes_sessions"} 3145728',
            "# HELP attention_kv_cache_budget_bytes The KV cache budget in bytes",
            "# TYPE attention_kv_cache_budget_bytes gauge",
            'attention_kv_cache_budget_bytes{kv_dtype="float32",model="sessions"} 4194304',
            'attention_kv_cache_budget_bytes{kv_dtype="int8",model="sessions-int8w"} 0',
            'attention_kv_cache_budget_bytes{kv_dtype="float32",model="fortunes_sessions"} 4194304',
            "# HELP attention_engine_running Generations and steps the engine core is running",
            "# TYPE attention_engine_running gauge",
            'attention_engine_running{kv_dtype="float32",model="sessions"} 3',
            'attention_engine_running{kv_dtype="int8",model="sessions-int8w"} 9',
            "# HELP attention_engine_waiting Requests waiting for their session's turn or their owner's",
            "# TYPE attention_engine_waiting gauge",
            'attention_engine_waiting{kv_dtype="float32",model="sessions"} 2',
        ]
    )
    usage = usage_in(exposition, "sessions")
    assert usage is not None and usage.ratio == 0.25
    assert (usage.running, usage.waiting) == (3, 2)  # the engine core's load, its model's only
    assert usage_in(exposition, "sessions-int8w") is None
    assert usage_in(exposition, "absent") is None
    # every model set the gateway sends to, summed: the OpenAI routes' model's usage is not left out
    assert usage_in(exposition, ["sessions", "fortunes_sessions"]).ratio == 0.5
