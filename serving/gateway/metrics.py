"""Prometheus metrics: requests and latency by route and status, active sessions, upstream errors.

Each app has its own registry, so several gateways in one process (the tests) do not collide.
Routes are labelled by their template (`/v1/sessions/{session_id}/step`), never by the raw path, and
unknown methods as `other`: a label value per session id or per invented method would grow without
bound.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Decode steps take milliseconds, prefills and big caches over JSON seconds.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
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
            labels = (method_of(scope), route_of(scope), str(status))
            self.metrics.requests.labels(*labels).inc()
            self.metrics.latency.labels(*labels).observe(time.perf_counter() - started)


def method_of(scope: Scope) -> str:
    # any token is a valid HTTP method on the wire: only the standard ones become label values
    method = scope["method"]
    return method if method in METHODS else "other"


def route_of(scope: Scope) -> str:
    route = scope.get("route")  # set by the router once a route matched
    return getattr(route, "path", None) or "unmatched"
