"""Prometheus metrics: requests and latency by route and status, active sessions, upstream errors, and
what an inference gateway reads to pick a replica (the Gateway API Inference Extension's model-server
protocol; docs/scale-out.md, "Metrics an inference gateway reads"): generations waiting for their first
token and running, the KV cache's utilization, tokens in and out, time to first token and between tokens.

Each app has its own registry, so several gateways in one process (the tests) do not collide.
Routes are labelled by their template (`/v1/sessions/{session_id}/step`), never by the raw path, and
unknown methods as `other`: a label value per session id or per invented method would grow without
bound.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contract import names
from serving.gateway import model_server
from serving.gateway.model_server import KvCacheUsage

log = logging.getLogger(__name__)

# Decode steps take milliseconds, prefills and big caches over JSON seconds.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# a decode step of a small model on a GPU takes about a millisecond, a long prefill on a CPU seconds
TOKEN_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
KV_CACHE_USAGE = "gateway_kv_cache_usage_ratio"
# the engine core's own counts (every gateway's requests, summed over the Triton replicas read): what an endpoint
# picker's queue scorer reads (deploy/kubernetes-overlays/inference-pool/epp-config.yaml)
ENGINE_WAITING, ENGINE_RUNNING = "gateway_engine_requests_waiting", "gateway_engine_requests_running"
ENGINE_WAITING_HELP = (
    "requests the session model's engine core holds waiting for their session's or their owner's turn, every "
    "gateway's (read from Triton)"
)
ENGINE_RUNNING_HELP = "generations and steps the session model's engine core runs, every gateway's (read from Triton)"
KV_CACHE_HELP = "fraction of the KV cache budget the session model's live sequences reserve, 0 to 1 (read from Triton)"
# an endpoint picker reads /metrics every 50 ms: Triton is read at most twice a second per gateway, and its stub
# publishes the bytes 4 times a second anyway
KV_READ_CACHE_S = 0.5
KV_READ_TIMEOUT_S = 1.0
SCRAPE_ERROR = "metrics_scrape"  # gateway_upstream_errors' kind for a Triton metrics endpoint that did not answer


class Metrics:
    def __init__(
        self, triton_metrics: Sequence[str] = (), session_models: str | Sequence[str] = names.SESSION_MODEL
    ) -> None:
        """`triton_metrics`: Triton's Prometheus endpoints, where the KV cache usage of `session_models` (every
        model set's that the gateway sends to, summed) is read (none: the utilization is not exported)."""
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "gateway_requests", "HTTP requests answered", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "gateway_request_duration_seconds",
            "time from request to response",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.active_sessions = Gauge("gateway_active_sessions", "open sessions", registry=self.registry)
        self.upstream_errors = Counter(
            "gateway_upstream_errors", "failed calls to Triton, by error kind", ["kind"], registry=self.registry
        )
        self.waiting = Gauge(
            "gateway_num_requests_waiting",
            "generations waiting for their first token (queued or in their prefill)",
            registry=self.registry,
        )
        self.running = Gauge(
            "gateway_num_requests_running", "generations past their first token, not ended", registry=self.registry
        )
        self.prompt_tokens = Counter("gateway_prompt_tokens", "prompt tokens of generations", registry=self.registry)
        self.generation_tokens = Counter("gateway_generation_tokens", "tokens generated", registry=self.registry)
        self.time_to_first_token = Histogram(
            "gateway_time_to_first_token_seconds",
            "time from a generation's start to its first token",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "gateway_inter_token_latency_seconds",
            "time between a generation's consecutive tokens",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.kv_cache = KvCacheGauge(triton_metrics, session_models, self.upstream_errors)
        # each (method, route, status)'s counter and histogram, looked up once: `labels()` checks and locks per call
        self._answered: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        if triton_metrics:  # else left out: a made-up 0 would read as an empty cache
            self.registry.register(self.kv_cache)

    def answered(self, method: str, route: str, status: str, seconds: float) -> None:
        """One HTTP request answered: counted and timed by method, route and status (a bounded set: methods and
        routes are the known ones or `other` and `unmatched`)."""
        labels = (method, route, status)
        series = self._answered.get(labels)
        if series is None:
            series = self._answered[labels] = (self.requests.labels(*labels), self.latency.labels(*labels))
        series[0].inc()
        series[1].observe(seconds)

    def generation(self, prompt_tokens: int) -> GenerationTimer:
        """A generation starting now with `prompt_tokens` to prefill: waiting until its first `token()`."""
        return GenerationTimer(self, prompt_tokens)

    async def refresh(self) -> None:
        """Read what the metrics take from elsewhere (the KV cache's usage, from Triton) before an exposition:
        the registry's collectors run synchronously on the event loop, where a read would stall every request."""
        await self.kv_cache.refresh()


class GenerationTimer:
    """One generation's part in the metrics: waiting from its start to its first token, running from then until
    `end()`, the first token's latency and each next one's. `end()` once it is over, however it ended; again is
    nothing. As a context manager it ends on exit."""

    def __init__(self, metrics: Metrics, prompt_tokens: int) -> None:
        self.metrics = metrics
        self.started = self.last = time.perf_counter()
        self.tokens = 0
        self.ended = False
        metrics.prompt_tokens.inc(prompt_tokens)
        metrics.waiting.inc()

    def token(self) -> None:
        """One more token has arrived (after `end()`: not counted, the generation was let go)."""
        if self.ended:
            return
        now, metrics = time.perf_counter(), self.metrics
        if self.tokens == 0:
            metrics.time_to_first_token.observe(now - self.started)
            metrics.waiting.dec()
            metrics.running.inc()
        else:
            metrics.inter_token_latency.observe(now - self.last)
        metrics.generation_tokens.inc()
        self.tokens, self.last = self.tokens + 1, now

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        (self.metrics.running if self.tokens else self.metrics.waiting).dec()

    def __enter__(self) -> GenerationTimer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.end()


class KvCacheGauge(Collector):
    """gateway_kv_cache_usage_ratio and the engine core's waiting and running requests, from what Triton's endpoints
    last said (model_server.py); left out of the exposition while none has answered: no value rather than a
    made-up one."""

    def __init__(self, urls: Sequence[str], models: str | Sequence[str], upstream_errors: Counter) -> None:
        self.urls, self.models, self.upstream_errors = tuple(urls), models, upstream_errors
        self.usage: KvCacheUsage | None = None
        self._read_at = -math.inf
        self._lock = asyncio.Lock()  # concurrent expositions share one read
        self._failing: set[str] = set()  # logged once until they answer again

    async def refresh(self) -> None:
        """Read Triton again unless it was read within KV_READ_CACHE_S."""
        if not self.urls:
            return
        async with self._lock:
            if time.monotonic() - self._read_at < KV_READ_CACHE_S:
                return
            read = await model_server.read_kv_usage(self.urls, self.models, KV_READ_TIMEOUT_S)
            self.usage, self._read_at = read.usage, time.monotonic()
        self._record(read.failed)

    def _record(self, failed: Iterable[tuple[str, str]]) -> None:
        failing = set()
        for where, why in failed:
            self.upstream_errors.labels(SCRAPE_ERROR).inc()
            failing.add(where)
            if where not in self._failing:
                log.warning("Triton's metrics at %s cannot be read (%s): the KV cache usage leaves it out", where, why)
        self._failing = failing

    def describe(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(KV_CACHE_USAGE, KV_CACHE_HELP),
            GaugeMetricFamily(ENGINE_WAITING, ENGINE_WAITING_HELP),
            GaugeMetricFamily(ENGINE_RUNNING, ENGINE_RUNNING_HELP),
        ]

    def collect(self) -> list[GaugeMetricFamily]:
        if self.usage is None:
            return []
        return [
            GaugeMetricFamily(KV_CACHE_USAGE, KV_CACHE_HELP, value=self.usage.ratio),
            GaugeMetricFamily(ENGINE_WAITING, ENGINE_WAITING_HELP, value=self.usage.waiting),
            GaugeMetricFamily(ENGINE_RUNNING, ENGINE_RUNNING_HELP, value=self.usage.running),
        ]


class MetricsMiddleware:
    """Outermost layer: it also sees the answers of the layers inside it (413, 401, 422...)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.answered(method_of(scope), route_of(scope), str(status), time.perf_counter() - started)


def method_of(scope: Scope) -> str:
    # any token is a valid HTTP method on the wire: only the standard ones become label values
    method = scope["method"]
    return method if method in METHODS else "other"


def route_of(scope: Scope) -> str:
    route = scope.get("route")  # set by the router once a route matched
    return getattr(route, "path", None) or "unmatched"
