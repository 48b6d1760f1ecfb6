"""Large JSON bodies against a real gateway process (`python -m serving.gateway`) in front of the
session's real Triton, over HTTP: a body larger than any valid request for the served model is
refused from its Content-Length or while it streams; a burst of large bodies is capped (429 with
Retry-After), /healthz answers throughout, and the gateway's memory comes back after it; so does it
after a burst of restores of the largest snapshot the model can produce (the restore route's bound).

The measured numbers are printed (docs/reliability.md has them)."""

from __future__ import annotations

import concurrent.futures
import json
import struct
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import psutil
import pytest

from bench.stack import KEY, gateway_process
from contract import names
from contract.integrity import Keyring, snapshot_signed
from serving.engine import snapshots
from serving.gateway.limits import LARGE_BODY_BYTES

pytestmark = [pytest.mark.served, pytest.mark.slow]
MIB = 1 << 20
HEADERS = {"X-API-Key": KEY, "Content-Type": "application/json"}
INTEGRITY_SECRET = "large-bodies-integrity-secret"


def json_states(tokens: int, width: int, seed: int = 0) -> bytes:
    """{"hidden_states": <(1, tokens, width) float32 normals>} as json.dumps writes it, its rows
    repeating after the first 64 (the gateway decodes each number all the same; writing 9,000
    distinct rows took 5 s here)."""
    rows = np.random.default_rng(seed).standard_normal((min(tokens, 64), width)).astype(np.float32)
    texts = [json.dumps(row.tolist()) for row in rows]
    return ('{"hidden_states": [[' + ", ".join(texts[i % len(texts)] for i in range(tokens)) + "]]}").encode()


def test_a_body_larger_than_the_model_can_need_gets_413_declared_or_streamed(triton, served_cfg, tmp_path):
    """16 tokens over a past of 64 positions need about 1.2 MB as JSON on the test model: a 2.5 MB body
    is refused though it is far under SERVING_MAX_BODY_BYTES."""
    settings = {"max_request_tokens": 16, "max_seq_len": 64}
    with gateway_process(triton.grpc_url, tmp_path / "gateway.log", **settings) as (url, _):
        big = json_states(500, served_cfg.d_model)
        assert 2 * MIB < len(big) < 64 * MIB
        declared = httpx.post(f"{url}/v1/attend", content=big, headers=HEADERS, timeout=30)
        assert declared.status_code == 413, declared.text
        message = declared.json()["error"]["message"]
        assert f"declared Content-Length {len(big)}" in message and "the most a valid request can need" in message
        chunks = [big[i : i + 256 << 10] for i in range(0, len(big), 256 << 10)]
        streamed = httpx.post(f"{url}/v1/attend", content=iter(chunks), headers=HEADERS, timeout=30)
        assert "content-length" not in streamed.request.headers
        assert streamed.status_code == 413, streamed.text
        # a body within the bound is read and checked as usual: 17 tokens are one too many
        over_cap = httpx.post(f"{url}/v1/attend", content=json_states(17, served_cfg.d_model), headers=HEADERS)
        assert over_cap.status_code == 400 and "17 tokens" in over_cap.json()["error"]["message"]
        assert httpx.get(f"{url}/healthz").status_code == 200


class Watch:
    """/healthz polled and the gateway's resident memory sampled on threads while the `with` runs."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.process = url, psutil.Process(pid)
        self.peak_rss, self.health_s, self.statuses = 0, [], []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._memory), threading.Thread(target=self._health)]

    def _memory(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)

    def _health(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.wait(0.1):
                started = time.perf_counter()
                self.statuses.append(client.get(f"{self.url}/healthz").status_code)
                self.health_s.append(time.perf_counter() - started)

    def __enter__(self) -> Watch:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def rss_settled(pid: int, seconds: float = 5.0, steady: int = 2) -> int:
    """The process's resident memory once it has stopped falling for `steady` samples half a second apart
    (at most `seconds`): the answers may come back while the requests' memory is still being freed, and
    given back to the system (malloc_trim) only when the last large one ends."""
    process, last, flat = psutil.Process(pid), None, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = process.memory_info().rss
        flat = flat + 1 if last is not None and now >= last else 0
        if flat >= steady:
            return now
        last = min(now, last) if last is not None else now
        time.sleep(0.5)
    return process.memory_info().rss


@pytest.fixture(scope="module")
def default_gateway(triton, tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen]]:
    """One gateway process with the default limits (2 large bodies at once) for the burst tests, with an
    integrity secret the test knows, to sign the snapshots it makes."""
    log = tmp_path_factory.mktemp("large-bodies") / "gateway.log"
    with gateway_process(triton.grpc_url, log, large_body_concurrency=2, integrity_secrets=INTEGRITY_SECRET) as running:
        yield running


def test_a_burst_of_large_bodies_is_capped_healthz_answers_and_memory_comes_back(default_gateway, served_cfg):
    """Four concurrent 55 MiB /v1/attend bodies (then under the 64 MiB body limit; 11,000 tokens, past
    the token cap, which only the parsed body shows) once took the gateway from 96 MiB to 1.59 GB and
    stalled /healthz 4 s. The body limit is now also the most a valid request for the served model can
    need (48 MiB for the test model): 9,000 tokens, 45 MiB, pass it and only the parsed body is refused."""
    body = json_states(9_000, served_cfg.d_model)
    assert 40 * MIB < len(body) < 48 * MIB
    url, gateway = default_gateway
    small = json_states(3, served_cfg.d_model)
    for _ in range(3):  # warm: the model's metadata, the first request's allocations
        assert httpx.post(f"{url}/v1/attend", content=small, headers=HEADERS, timeout=30).status_code == 200
    before = rss_settled(gateway.pid)

    def send(_: int) -> httpx.Response:
        return httpx.post(f"{url}/v1/attend", content=body, headers=HEADERS, timeout=120)

    with Watch(url, gateway.pid) as watch, concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, range(4)))
    # a small request after the burst, as a server sees one: without it, 3 runs of 14 (on this code and on the
    # one before whole models alike) measured about one 45 MiB body more, none of 6 with it: what the last
    # large request leaves is gone by the next one
    assert httpx.post(f"{url}/v1/attend", content=small, headers=HEADERS, timeout=30).status_code == 200
    after = rss_settled(gateway.pid)

    statuses = sorted(a.status_code for a in answers)
    print(
        f"4 x {len(body) / MIB:.0f} MiB: answers {statuses}; gateway RSS before {before / MIB:.0f} MiB, "
        f"peak {watch.peak_rss / MIB:.0f} MiB, after {after / MIB:.0f} MiB; /healthz {len(watch.health_s)} "
        f"answers, slowest {max(watch.health_s) * 1e3:.0f} ms"
    )
    for answer in answers:
        if answer.status_code == 429:
            assert answer.json()["error"]["code"] == "overloaded" and answer.headers["retry-after"] == "1"
            assert f"over {LARGE_BODY_BYTES >> 20} MiB" in answer.json()["error"]["message"]
        else:
            assert answer.status_code == 400, answer.text[:300]
            assert "9000 tokens" in answer.json()["error"]["message"]
    assert 429 in statuses  # two at once are decoded; the others are told to come back
    assert watch.statuses and set(watch.statuses) == {200}
    assert max(watch.health_s) < 2.0, watch.health_s  # it stalled 4 s before the cap and the threads
    # what came back, within two bodies of it: the burst once kept 1.5 GB; alone this test measures about 31 MiB
    # kept, and once in a whole suite's run (beside other processes) 59 MiB, one body more than a bound of one
    assert after - before <= 2 * len(body), (before / MIB, after / MIB)
    assert httpx.post(f"{url}/v1/attend", content=small, headers=HEADERS, timeout=30).status_code == 200


def test_memory_comes_back_after_a_burst_of_restores_of_the_largest_snapshot(default_gateway, served_cfg):
    """Two concurrent 60 MiB restore bodies once took the gateway to 1.6-2.0 GB, 1.3 GB still held 10 s
    later: the restore bound was the JSON-derived one. It is now the largest snapshot the session model
    can produce (4 MiB and a header for the test model): a burst of restores of a snapshot of every
    position, at that bound, leaves the gateway's memory where it was."""
    (url, gateway), cfg, burst = default_gateway, served_cfg, 12
    octet = {**HEADERS, "Content-Type": "application/octet-stream"}
    with httpx.Client(base_url=url, headers=HEADERS, timeout=120) as api:
        full = full_snapshot(api, cfg)
        cache = cfg.max_seq_len * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 4
        assert cache < len(full) < cache + (64 << 10)  # every position, as float32: at the restore bound

        def restore(_: int) -> httpx.Response:
            return httpx.post(f"{url}/v1/sessions", content=full, headers=octet, timeout=120)

        warm = restore(0)  # the first restore's allocations
        assert warm.status_code == 201, warm.text
        api.delete(f"/v1/sessions/{warm.json()['id']}")
        before = rss_settled(gateway.pid)
        with Watch(url, gateway.pid) as watch, concurrent.futures.ThreadPoolExecutor(burst) as pool:
            answers = list(pool.map(restore, range(burst)))
        for answer in answers:
            assert answer.status_code == 201, answer.text
            api.delete(f"/v1/sessions/{answer.json()['id']}")
        after = rss_settled(gateway.pid)
    print(
        f"{burst} x {len(full) / MIB:.1f} MiB restores at once: gateway RSS before {before / MIB:.0f} MiB, "
        f"peak {watch.peak_rss / MIB:.0f} MiB, after {after / MIB:.0f} MiB; /healthz slowest "
        f"{max(watch.health_s) * 1e3:.0f} ms"
    )
    assert set(watch.statuses) == {200}
    assert after - before <= 4 * len(full), (before / MIB, after / MIB)


def full_snapshot(api: httpx.Client, cfg) -> bytes:
    """A snapshot of all max_seq_len positions of the served model, signed as the gateway signs: its identity
    and owner from a real snapshot of a one-position session."""
    session = api.post("/v1/sessions").json()["id"]
    assert api.post(f"/v1/sessions/{session}/step", content=json_states(1, cfg.d_model)).status_code == 200
    real = api.get(f"/v1/sessions/{session}/snapshot").content
    api.delete(f"/v1/sessions/{session}")
    (size,) = struct.unpack("<Q", real[:8])
    metadata = json.loads(real[8 : 8 + size])["__metadata__"]
    identity = {key: metadata[key] for key in snapshots.IDENTITY}
    shape = (cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim)
    values = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    cache = dict.fromkeys(names.past_names(cfg.n_layers), values)
    return snapshot_signed(
        snapshots.encode(cache, identity, cfg.max_seq_len, metadata["owner"]), Keyring(INTEGRITY_SECRET)
    )
