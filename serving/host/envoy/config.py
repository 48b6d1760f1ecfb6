"""The Envoy bootstrap in front of N Triton replicas, generated: one function from a typed description
of the upstreams and the listeners to the config as a dict, rendered to YAML by pyyaml.

How a request is routed (docs/scale-out.md):

- a request with REPLICA_HEADER (a session step after its first) goes to the replica that header
  names and to no other: Envoy's header-based stateful session filter in strict mode. If that
  replica has left the cluster the answer is a `[sequence_lost]` error, never another replica;
- a request with SESSION_HEADER and no REPLICA_HEADER (a session's first step) is hashed on the
  session id over the healthy replicas; the answer names the replica in REPLICA_HEADER. A START
  that never reached a replica (unreachable, a refused stream) is retried on another; a replica's own
  refusal (stopping, cache full) travels inside the stream (the session model is decoupled: its requests
  are gRPC streams), which Envoy does not read, and reaches the client as a busy server;
- anything else (stateless inference, metadata, health) goes to the least loaded healthy replica.

The replicas come from files Envoy watches (file-based EDS: membership and drain change without a
restart) or from one DNS name resolving to every replica (STRICT_DNS: a Kubernetes headless Service).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from contract.routing import REPLICA_HEADER, SESSION_HEADER

PROTOCOLS = ("grpc", "http")
UNIX_PATH_MAX = 108  # sun_path's size on Linux, its final NUL included
HEALTH_PATH = "/v2/health/ready"  # Triton's readiness, on its HTTP port
READY_PATH = "/ready"  # the optional health listener's answer for Kubernetes probes
STATEFUL_SESSION_FILTER = "envoy.filters.http.stateful_session"
# A pinned step may reach its replica in any health state: it fails health checks while Triton
# drains after SIGTERM (its HTTP port closes, its gRPC port serves open sequences), an outlier
# ejection says nothing about the cache it holds, and a dead replica answers a connection failure,
# which becomes a precise `[sequence_lost]`. Only leaving the cluster ends a pin.
OVERRIDE_HOST_STATUSES = ("UNKNOWN", "HEALTHY", "UNHEALTHY", "DRAINING", "TIMEOUT", "DEGRADED")
# Envoy's local replies for a pinned step whose replica is gone or unreachable: no healthy upstream
# (the replica left the cluster), connection failure, connection termination, reset before answer.
LOST_FLAGS = ("UH", "UF", "UC", "UR", "NC")
HTTP_IDLE_TIMEOUT = "2s"  # Envoy's idle connections to Triton's HTTP port (see _protocol)
SESSION_LOST_STATUS = 410  # HTTP Gone; gRPC clients get UNKNOWN (Envoy's mapping) and the same message
SESSION_LOST_MESSAGE = (
    f"[sequence_lost] session %REQ({SESSION_HEADER})% was lost with the replica that held its KV cache "
    "(%RESPONSE_CODE_DETAILS%); start a new session"
)
ACCESS_LOG_FIELDS = {
    "start_time": "%START_TIME%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "protocol": "%PROTOCOL%",
    "route": "%ROUTE_NAME%",
    "session_id": f"%REQ({SESSION_HEADER})%",
    "pinned_to": f"%REQ({REPLICA_HEADER})%",
    "upstream_cluster": "%UPSTREAM_CLUSTER%",
    "upstream_host": "%UPSTREAM_HOST%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "response_code": "%RESPONSE_CODE%",
    "grpc_status": "%GRPC_STATUS_NUMBER%",
    "response_flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "duration_ms": "%DURATION%",
    "bytes_received": "%BYTES_RECEIVED%",
    "bytes_sent": "%BYTES_SENT%",
}


@dataclasses.dataclass(frozen=True)
class Replica:
    """One Triton process. `draining`: it takes no new session and serves the ones pinned to it."""

    host: str  # an IP address: EDS endpoints are not resolved
    http_port: int = 8000
    grpc_port: int = 8001
    draining: bool = False

    def __post_init__(self) -> None:
        ipaddress.ip_address(self.host)  # ValueError names the bad address
        _check_ports(self.http_port, self.grpc_port)

    def port(self, protocol: str) -> int:
        return self.grpc_port if protocol == "grpc" else self.http_port


@dataclasses.dataclass(frozen=True)
class EndpointFiles:
    """Replicas listed in files under `directory` that Envoy watches (write them with
    `write_endpoints`): adding, draining and removing a replica needs no restart."""

    directory: Path


@dataclasses.dataclass(frozen=True)
class DnsName:
    """Every address `name` resolves to is a replica (a Kubernetes headless Service), re-resolved
    every `refresh_s` seconds."""

    name: str
    http_port: int = 8000
    grpc_port: int = 8001
    refresh_s: float = 5.0

    def __post_init__(self) -> None:
        _check_ports(self.http_port, self.grpc_port)


Upstreams = EndpointFiles | DnsName


@dataclasses.dataclass(frozen=True)
class ProxySettings:
    """Where Envoy listens and how it treats the replicas. A port of 0 is picked by the system
    (`Envoy` reads the ports back from the admin API)."""

    http_port: int = 8000  # Triton's HTTP/REST protocol, HTTP/1.1 both sides
    grpc_port: int = 8001  # Triton's gRPC protocol, h2c both sides
    listen_address: str = "0.0.0.0"
    # the admin API can stop Envoy and shows every replica: a unix socket only its user may open
    # (mode 0600), never a TCP port any local process reaches; None: no admin API (Kubernetes probes
    # use the health listener)
    admin_socket: str | None = None
    health_port: int | None = None  # a listener answering READY_PATH for Kubernetes probes
    access_log: str = "/dev/stdout"  # one JSON object per request
    request_timeout_s: float = 300.0  # a long prefill on a busy replica must not be cut
    connect_timeout_s: float = 2.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    # an outlier (five 5xx answers in a row) is ejected this long, longer at each further ejection;
    # Envoy looks for ejections that are over every `ejection_check_s`
    ejection_s: float = 15.0
    ejection_check_s: float = 5.0
    retries: int = 2  # for stateless calls and session starts that never ran
    max_connections: int = 10_000  # client connections, all listeners together

    def __post_init__(self) -> None:
        timings = (
            self.request_timeout_s,
            self.connect_timeout_s,
            self.health_interval_s,
            self.health_timeout_s,
            self.ejection_s,
            self.ejection_check_s,
        )
        if min(timings) <= 0:
            raise ValueError(f"timeouts and intervals must be positive: {self}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")


def _check_ports(*ports: int) -> None:
    if not all(0 < port < 65536 for port in ports):
        raise ValueError(f"ports must be in 1..65535, got {ports}")


def cluster_name(protocol: str, sessions: bool) -> str:
    """`triton_grpc_sessions` (hashed, pinned) and `triton_grpc` (least request), same for HTTP."""
    return f"triton_{protocol}_sessions" if sessions else f"triton_{protocol}"


def endpoints_path(directory: Path, protocol: str) -> Path:
    return Path(directory) / f"triton_{protocol}.yaml"


# --- the bootstrap ---------------------------------------------------------------------------------


def bootstrap(upstreams: Upstreams, settings: ProxySettings | None = None) -> dict[str, Any]:
    """The whole Envoy config: a listener per protocol, two clusters per protocol, the admin API on a
    unix socket if `settings` names one."""
    settings = settings or ProxySettings()
    listeners = [_listener(protocol, settings) for protocol in PROTOCOLS]
    if settings.health_port is not None:
        listeners.append(_health_listener(settings))
    clusters = [_cluster(p, sessions, upstreams, settings) for p in PROTOCOLS for sessions in (True, False)]
    return {
        "node": {"id": "attention-serving", "cluster": "attention-serving"},
        **_admin(settings.admin_socket),
        "static_resources": {"listeners": listeners, "clusters": clusters},
        "overload_manager": {"resource_monitors": [_connection_limit(settings.max_connections)]},
    }


def _admin(socket_path: str | None) -> dict[str, Any]:
    if socket_path is None:
        return {}
    if len(os.fsencode(socket_path)) >= UNIX_PATH_MAX:
        raise ValueError(f"admin socket path: at most {UNIX_PATH_MAX - 1} bytes, got {socket_path!r}")
    return {"admin": {"address": {"pipe": {"path": socket_path, "mode": 0o600}}}}


def _connection_limit(connections: int) -> dict[str, Any]:
    return {
        "name": "envoy.resource_monitors.global_downstream_max_connections",
        "typed_config": _typed(
            "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
            max_active_downstream_connections=connections,
        ),
    }


def render(config: dict[str, Any], header: str = "") -> str:
    """YAML text of `config` (keys in the order built), after `header` made into comment lines."""
    import yaml  # not at the top: `python -m serving` loads this module in images without pyyaml

    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comment + yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=120)


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _typed(type_name: str, **fields: Any) -> dict[str, Any]:
    return {"@type": f"type.googleapis.com/{type_name}", **fields}


def _listener(protocol: str, settings: ProxySettings) -> dict[str, Any]:
    port = settings.grpc_port if protocol == "grpc" else settings.http_port
    manager = _typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix=f"triton_{protocol}",
        codec_type="HTTP2" if protocol == "grpc" else "HTTP1",
        stream_idle_timeout=_seconds(settings.request_timeout_s),
        access_log=[_access_log(settings.access_log)],
        local_reply_config={"mappers": [_session_lost_reply(protocol)]},
        route_config=_routes(protocol, settings),
        http_filters=[_stateful_session_filter(), _router_filter()],
    )
    return _http_listener(f"triton_{protocol}", _address(settings.listen_address, port), manager)


def _http_listener(name: str, address: dict[str, Any], manager: dict[str, Any]) -> dict[str, Any]:
    chain = {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
    return {"name": name, "address": address, "filter_chains": [chain]}


def _access_log(path: str) -> dict[str, Any]:
    return {
        "name": "envoy.access_loggers.file",
        "typed_config": _typed(
            "envoy.extensions.access_loggers.file.v3.FileAccessLog",
            path=path,
            log_format={"json_format": dict(ACCESS_LOG_FIELDS)},
        ),
    }


def _session_lost_reply(protocol: str) -> dict[str, Any]:
    """A pinned step whose replica is gone: the client library reads the kind tag (contract/errors.py);
    Triton's HTTP clients read a JSON body's "error", gRPC clients the grpc-message."""
    body = (
        {"json_format": {"error": SESSION_LOST_MESSAGE}}
        if protocol == "http"
        else {"text_format_source": {"inline_string": SESSION_LOST_MESSAGE}}
    )
    return {
        "filter": {
            "and_filter": {
                "filters": [
                    {"header_filter": {"header": {"name": REPLICA_HEADER, "present_match": True}}},
                    {"response_flag_filter": {"flags": list(LOST_FLAGS)}},
                ]
            }
        },
        "status_code": SESSION_LOST_STATUS,
        "body_format_override": body,
    }


def _stateful_session_filter() -> dict[str, Any]:
    state = _typed("envoy.extensions.http.stateful_session.header.v3.HeaderBasedSessionState", name=REPLICA_HEADER)
    return {
        "name": STATEFUL_SESSION_FILTER,
        "typed_config": _typed(
            "envoy.extensions.filters.http.stateful_session.v3.StatefulSession",
            session_state={"name": "envoy.http.stateful_session.header", "typed_config": state},
            strict=True,  # the named replica or an error: never a silent move to another replica
        ),
    }


def _router_filter() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.router",
        "typed_config": _typed("envoy.extensions.filters.http.router.v3.Router"),
    }


def _routes(protocol: str, settings: ProxySettings) -> dict[str, Any]:
    sessions, stateless = cluster_name(protocol, True), cluster_name(protocol, False)
    timeout = _seconds(settings.request_timeout_s)
    hashed = {"cluster": sessions, "timeout": timeout, "hash_policy": [{"header": {"header_name": SESSION_HEADER}}]}
    not_stateful = {
        STATEFUL_SESSION_FILTER: _typed(
            "envoy.extensions.filters.http.stateful_session.v3.StatefulSessionPerRoute", disabled=True
        )
    }
    routes = [
        # never retried: the step may have appended to the session's cache before it failed
        {"name": "pinned_step", "match": _has_header(REPLICA_HEADER), "route": hashed},
        {
            "name": "session_start",
            "match": _has_header(SESSION_HEADER),
            "route": {**hashed, "retry_policy": _retry_policy(protocol, settings.retries, stateless=False)},
        },
        {
            "name": "stateless",
            "match": {"prefix": "/"},
            "route": {
                "cluster": stateless,
                "timeout": timeout,
                "retry_policy": _retry_policy(protocol, settings.retries, stateless=True),
            },
            "typed_per_filter_config": not_stateful,
        },
    ]
    return {"name": f"triton_{protocol}", "virtual_hosts": [{"name": "triton", "domains": ["*"], "routes": routes}]}


def _has_header(name: str) -> dict[str, Any]:
    return {"prefix": "/", "headers": [{"name": name, "present_match": True}]}


def _retry_policy(protocol: str, retries: int, stateless: bool) -> dict[str, Any]:
    """Retries of requests that did not run: never sent, or (a stateless call) refused by Triton before
    running (UNAVAILABLE / 503: stopping). A stateless call is pure, so a reset retries it too. A session's
    START is a stream whose refusal comes in its messages with an OK status: nothing for Envoy to read."""
    conditions = ["connect-failure", "refused-stream"] + (["reset"] if stateless else [])
    policy: dict[str, Any] = {"num_retries": retries}
    if stateless and protocol == "grpc":
        conditions.append("unavailable")
    elif stateless:
        conditions.append("retriable-status-codes")
        policy["retriable_status_codes"] = [503]
    policy["retry_on"] = ",".join(conditions)
    policy["retry_host_predicate"] = [
        {
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": _typed("envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"),
        }
    ]
    # a retry re-picks a host until one it has not tried comes up; with Maglev each pick after the
    # first is a fresh hash, so with three replicas and one dead, 3 picks sent a start back to the
    # dead one 1 time in 9 (seen in CI before its health checks failed); 6 picks: 1 in 243
    policy["host_selection_retry_max_attempts"] = 6
    return policy


def _health_listener(settings: ProxySettings) -> dict[str, Any]:
    """READY_PATH answers 200 while Envoy is not draining (Kubernetes' probes), 404 elsewhere."""
    health_check = _typed(
        "envoy.extensions.filters.http.health_check.v3.HealthCheck",
        pass_through_mode=False,
        headers=[{"name": ":path", "string_match": {"exact": READY_PATH}}],
    )
    manager = _typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="health",
        route_config={
            "name": "health",
            "virtual_hosts": [
                {
                    "name": "health",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "direct_response": {"status": 404}}],
                }
            ],
        },
        http_filters=[{"name": "envoy.filters.http.health_check", "typed_config": health_check}, _router_filter()],
    )
    return _http_listener("health", _address(settings.listen_address, settings.health_port), manager)


# --- the clusters ----------------------------------------------------------------------------------


def _cluster(protocol: str, sessions: bool, upstreams: Upstreams, settings: ProxySettings) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": cluster_name(protocol, sessions),
        "connect_timeout": _seconds(settings.connect_timeout_s),
        # Maglev, not a ring: measured with 3 replicas and a 4th added, 69 of 300 session ids
        # hashed elsewhere with Maglev (1/4 is the least possible) and 116 with RING_HASH (its ring
        # gives every host fewer points as hosts join). Only a session whose client does not send
        # REPLICA_HEADER back depends on that; pinned steps do not hash at all.
        "lb_policy": "MAGLEV" if sessions else "LEAST_REQUEST",
        "common_lb_config": {
            "healthy_panic_threshold": {"value": 0},  # never send to a replica that is not ready
            "override_host_status": {"statuses": list(OVERRIDE_HOST_STATUSES)},
            # a health change reaches the worker threads at once, not merged over Envoy's default
            # second: a replica the admin API shows as healthy (or draining) is one the workers use
            # (or avoid); a few replicas make few updates
            "update_merge_window": "0s",
        },
        # a replica removed from the list leaves now, healthy or not: removal ends its sessions
        "ignore_health_on_host_removal": True,
        "health_checks": [_health_check(settings)],
        # a replica whose model stub died answers every unary request INTERNAL while Triton's readiness
        # stays 200 (measured on 2.51): five in a row eject it, and a passing health check must not
        # bring it back (Envoy's default does). Stateless calls only: a session's requests are streams,
        # whose errors come inside them with an OK status (the supervisor reloads a dead session model)
        "outlier_detection": {
            "consecutive_5xx": 5,
            "interval": _seconds(settings.ejection_check_s),
            "base_ejection_time": _seconds(settings.ejection_s),
            "max_ejection_percent": 50,
            "successful_active_health_check_uneject_host": False,
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _protocol(protocol)
        },
    }
    cluster.update(_discovery(protocol, sessions, upstreams))
    return cluster


def _protocol(protocol: str) -> dict[str, Any]:
    """h2c to Triton's gRPC port; HTTP/1.1 to its HTTP port, where an idle connection closes soon:
    Triton, once signalled to stop, waits for its HTTP connections to close before it lets the open
    sequences finish, out of the same exit timeout (measured on 2.51: Envoy's default of an hour
    spent all of it)."""
    if protocol == "grpc":
        return _typed(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            explicit_http_config={"http2_protocol_options": {}},
        )
    return _typed(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        common_http_protocol_options={"idle_timeout": HTTP_IDLE_TIMEOUT},
        explicit_http_config={"http_protocol_options": {}},
    )


def _health_check(settings: ProxySettings) -> dict[str, Any]:
    """Triton's readiness over HTTP/1.1 on its HTTP port, for the gRPC clusters too (their endpoints
    name that port). `no_traffic_interval` as `interval`: Envoy's default of 60 s for a cluster that
    has had no traffic would leave a dead replica in the ring for a minute."""
    interval = _seconds(settings.health_interval_s)
    return {
        "timeout": _seconds(settings.health_timeout_s),
        "interval": interval,
        "no_traffic_interval": interval,
        "unhealthy_threshold": 2,
        "healthy_threshold": 1,
        "http_health_check": {"path": HEALTH_PATH, "codec_client_type": "HTTP1"},
        # a connection per check: on SIGTERM Triton refuses new connections at once but waits for
        # open ones to close before it drains its sequences (measured on 2.51)
        "reuse_connection": False,
    }


def _discovery(protocol: str, sessions: bool, upstreams: Upstreams) -> dict[str, Any]:
    if isinstance(upstreams, EndpointFiles):
        path = endpoints_path(upstreams.directory, protocol).resolve()
        return {
            "type": "EDS",
            "eds_cluster_config": {
                "service_name": f"triton_{protocol}",  # both clusters of a protocol read one file
                "eds_config": {"path_config_source": {"path": str(path)}, "resource_api_version": "V3"},
            },
        }
    port = upstreams.grpc_port if protocol == "grpc" else upstreams.http_port
    endpoint = {
        "endpoint": {
            "address": _address(upstreams.name, port),
            "health_check_config": {"port_value": upstreams.http_port},
        }
    }
    # STRICT_DNS: every address the name resolves to is a host (`all_addresses_in_single_endpoint`
    # false); the cluster_type form, as Envoy deprecated the Cluster's own DNS fields
    dns = _typed(
        "envoy.extensions.clusters.dns.v3.DnsCluster",
        dns_refresh_rate=_seconds(upstreams.refresh_s),
        dns_lookup_family="V4_ONLY",
        all_addresses_in_single_endpoint=False,
    )
    return {
        "cluster_type": {"name": "envoy.clusters.dns", "typed_config": dns},
        "load_assignment": {
            "cluster_name": cluster_name(protocol, sessions),
            "endpoints": [{"lb_endpoints": [endpoint]}],
        },
    }


# --- the endpoint files ----------------------------------------------------------------------------


def endpoints(protocol: str, replicas: Sequence[Replica], version: str = "0") -> dict[str, Any]:
    """The EDS file of one protocol: every replica's address, draining ones marked DRAINING, each
    health-checked on its HTTP port."""
    lb_endpoints = []
    for replica in replicas:
        endpoint: dict[str, Any] = {
            "endpoint": {
                "address": _address(replica.host, replica.port(protocol)),
                "health_check_config": {"port_value": replica.http_port},
            }
        }
        if replica.draining:
            endpoint["health_status"] = "DRAINING"
        lb_endpoints.append(endpoint)
    assignment = _typed(
        "envoy.config.endpoint.v3.ClusterLoadAssignment",
        cluster_name=f"triton_{protocol}",
        endpoints=[{"lb_endpoints": lb_endpoints}],
    )
    return {"version_info": version, "resources": [assignment]}


def write_endpoints(directory: Path, replicas: Sequence[Replica], version: str = "0") -> None:
    """Both protocols' EDS files, each replaced by a rename: Envoy reloads a watched file when one is
    moved onto it, and never reads a half-written one."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for protocol in PROTOCOLS:
        target = endpoints_path(directory, protocol)
        fd, scratch = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.")
        with os.fdopen(fd, "w") as out:
            out.write(render(endpoints(protocol, replicas, version)))
        os.replace(scratch, target)
