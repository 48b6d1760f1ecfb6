"""The KV cache's utilization and the engine core's load, read from Triton's Prometheus endpoints for the
gateway's own /metrics (serving/gateway/metrics.py): what the session model's stub publishes there
(serving/triton/models/sessions.py `SessionGauges`): the bytes live sequences reserve of the budget over
the budget, and the requests its engine core runs and holds waiting (every gateway's, not this one's only).

Reserved, not held or allocated: the budget admits a new sequence by its reservations (one row per live
sequence), so reserved / budget is how full the cache is for the next request, as vLLM's fraction of KV
blocks in use is.

Every address a URL's host name resolves to is read: a Kubernetes headless Service's name (`triton`) is
every Triton replica, as Envoy finds them. The utilization sums what the replicas that answered reserve
over the sum of their budgets; one that does not answer counts in neither and is named in `failed`
(a replica that is gone holds no cache; one that is up but unreachable makes the ratio the others').
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import ipaddress
import socket
import urllib.parse
from collections.abc import Collection, Iterable, Sequence

from prometheus_client.parser import text_string_to_metric_families

RESERVED = "attention_kv_cache_reserved_bytes"
BUDGET = "attention_kv_cache_budget_bytes"
RUNNING = "attention_engine_running"
WAITING = "attention_engine_waiting"
FAMILY_PREFIXES = ("attention_kv_cache_", "attention_engine_")
DEFAULT_PORT = 80
# what an endpoint that cannot tell raises: unreachable or timed out, not 200, not an exposition (ValueError)
UNANSWERED = (OSError, http.client.HTTPException, ValueError)


@dataclasses.dataclass(frozen=True)
class KvCacheUsage:
    reserved_bytes: float
    budget_bytes: float
    running: float = 0.0  # the engine core's running generations and steps
    waiting: float = 0.0  # requests the engine core holds for their session's or their owner's turn

    @property
    def ratio(self) -> float:
        """The fraction of the budget reserved, 0 to 1."""
        return self.reserved_bytes / self.budget_bytes


@dataclasses.dataclass(frozen=True)
class KvCacheRead:
    usage: KvCacheUsage | None  # None: no replica answered with the model's gauges
    failed: tuple[tuple[str, str], ...]  # (where, why) of each endpoint that did not answer: ("URL at ADDRESS", ...)


@dataclasses.dataclass(frozen=True)
class Endpoint:
    url: str  # as configured: its host names the Host header and the messages
    address: str  # one IP address the URL's host resolves to
    port: int
    path: str


def checked_url(url: str) -> str:
    """`url` if it is an http:// URL with a host (Triton's metrics endpoint is plain HTTP); ValueError naming it."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"expected an http://host:port/metrics URL, got {url!r}")
    try:
        _ = parts.port
    except ValueError:
        raise ValueError(f"expected an http://host:port/metrics URL with a port in [0, 65535], got {url!r}") from None
    return url


async def read_kv_usage(urls: Sequence[str], models: str | Collection[str], timeout_s: float) -> KvCacheRead:
    """The KV cache usage of `models` (the server's model sets' session models) summed over them and over every
    address of every URL, each read within `timeout_s`."""
    resolved = await asyncio.gather(*(endpoints_of(url) for url in urls), return_exceptions=True)
    found: list[Endpoint] = []
    failed: list[tuple[str, str]] = []
    for url, result in zip(urls, resolved, strict=True):
        if isinstance(result, UNANSWERED):
            failed.append((url, f"cannot resolve its host ({result})"))
        elif isinstance(result, BaseException):
            raise result
        else:
            found += result
    answers = await asyncio.gather(
        *(asyncio.to_thread(read_endpoint, endpoint, models, timeout_s) for endpoint in found), return_exceptions=True
    )
    usages = []
    for endpoint, answer in zip(found, answers, strict=True):
        if isinstance(answer, UNANSWERED):
            failed.append((f"{endpoint.url} at {endpoint.address}", str(answer) or type(answer).__name__))
        elif isinstance(answer, BaseException):
            raise answer
        elif answer is not None:
            usages.append(answer)
    return KvCacheRead(total(usages), tuple(failed))


async def endpoints_of(url: str) -> list[Endpoint]:
    """One endpoint per address the URL's host resolves to (an IP address: itself); OSError when none."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or DEFAULT_PORT
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        addresses = [str(ipaddress.ip_address(host))]
    except ValueError:
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
    return [Endpoint(url, address, port, path) for address in addresses]


def read_endpoint(endpoint: Endpoint, models: str | Collection[str], timeout_s: float) -> KvCacheUsage | None:
    """`models`' usage at one endpoint (blocking: run on a worker thread); one of UNANSWERED when it cannot tell."""
    return usage_in(scrape(endpoint, timeout_s), models)


def scrape(endpoint: Endpoint, timeout_s: float) -> str:
    """The exposition text at `endpoint`; OSError or HTTPException when it does not answer 200."""
    host = urllib.parse.urlsplit(endpoint.url).netloc
    connection = http.client.HTTPConnection(endpoint.address, endpoint.port, timeout=timeout_s)
    try:
        connection.request("GET", endpoint.path, headers={"Host": host})
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    if response.status != http.client.OK:
        raise http.client.HTTPException(f"HTTP {response.status}")
    return body.decode()


def usage_in(text: str, models: str | Collection[str]) -> KvCacheUsage | None:
    """The reserved and budget bytes and the engine cores' load of `models` (one name, or several summed) in a
    Prometheus exposition; None when they publish no budget yet."""
    models = {models} if isinstance(models, str) else set(models)
    # Triton's exposition is mostly its own nv_* families: only ours are parsed
    ours = "\n".join(line for line in text.splitlines() if any(prefix in line for prefix in FAMILY_PREFIXES))
    values = {RESERVED: 0.0, BUDGET: 0.0, RUNNING: 0.0, WAITING: 0.0}
    for family in text_string_to_metric_families(ours + "\n"):
        for sample in family.samples:
            if sample.name in values and sample.labels.get("model") in models:
                values[sample.name] += sample.value
    if values[BUDGET] <= 0:
        return None
    return KvCacheUsage(values[RESERVED], values[BUDGET], values[RUNNING], values[WAITING])


def total(usages: Iterable[KvCacheUsage]) -> KvCacheUsage | None:
    usages = list(usages)
    if not usages:
        return None
    return KvCacheUsage(
        sum(u.reserved_bytes for u in usages),
        sum(u.budget_bytes for u in usages),
        sum(u.running for u in usages),
        sum(u.waiting for u in usages),
    )
