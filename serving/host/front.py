"""What `python -m serving` puts in front of the gateway and the clients: one supervised Triton, or
Envoy in front of N of them (serving/host/fleet.py), started on the ports asked for and kept serving
until `stop()`; `watch` runs until a signal or until nothing is left to serve."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from serving.host.envoy import ProxySettings
from serving.host.fleet import Fleet, start_fleet
from serving.host.launcher import check_ports_free, free_port, serving_lines, start_triton
from serving.host.process import reap_leftovers
from serving.host.supervisor import Supervisor
from serving.triton.repository import other_session_models


@dataclasses.dataclass(frozen=True)
class TritonOptions:
    """How every Triton of the front starts (the same at every restart)."""

    repository: Path
    address: str = "127.0.0.1"
    log: Path | None = None  # with several replicas, NAME-<i>.EXT each (`replica_log`)
    tritonserver: Path | None = None  # an installed binary instead of the wheel's
    probe_interval: float = 1.0


@dataclasses.dataclass(frozen=True)
class FrontPorts:
    http: int
    grpc: int
    metrics: int  # with several replicas, each takes a free port of its own


def start_front(
    options: TritonOptions,
    ports: FrontPorts,
    replicas: int,
    gateway: tuple[str, int] | None = None,
    say: Callable[[str], None] = print,
    ejection_s: float = ProxySettings.ejection_s,
):
    """One supervised Triton on `ports`, or Envoy on the HTTP and gRPC ports in front of `replicas`
    of them. What a run killed before it could stop left is removed first (and named); then every
    port, the gateway's (address, port) too, is checked before anything starts."""
    for removed in reap_leftovers():
        say(f"removed what an earlier run left: {removed}")
    front_ports = {"http": ports.http, "grpc": ports.grpc}
    if replicas == 1:
        front_ports["metrics"] = ports.metrics
    check_ports_free(options.address, {k: v for k, v in front_ports.items() if v})
    if gateway is not None:
        check_ports_free(gateway[0], {"gateway": gateway[1]})
    if replicas == 1:
        return OneTriton(supervise(options, front_ports, options.log))
    proxy = proxy_settings(ports, options.address, ejection_s)
    say(f"starting {replicas} Triton replicas and Envoy in front of them")
    # the replicas' own ports are picked before Envoy binds the front's: never one of those, nor another's
    taken = {port for port in (ports.http, ports.grpc, gateway[1] if gateway else 0) if port}
    return start_fleet(replicas, lambda index: supervise(options, {}, replica_log(options.log, index), taken), proxy)


def proxy_settings(ports: FrontPorts, address: str, ejection_s: float = ProxySettings.ejection_s) -> ProxySettings:
    """Envoy on the front's HTTP and gRPC ports, ejecting an outlier for `ejection_s` (and looking for
    ejections that are over at least that often)."""
    return ProxySettings(
        http_port=ports.http,
        grpc_port=ports.grpc,
        listen_address=address,
        ejection_s=ejection_s,
        ejection_check_s=min(ProxySettings.ejection_check_s, ejection_s),
    )


def replica_log(log: Path | None, index: int) -> Path | None:
    """A file of its own per replica (NAME-<i>.EXT); a stream such as /dev/stdout is shared."""
    if log is None or log.parts[:2] == ("/", "dev") or (log.exists() and not log.is_file()):
        return log
    return log.with_name(f"{log.stem}-{index}{log.suffix}")


def supervise(
    options: TritonOptions, ports: dict[str, int], log: Path | None, taken: set[int] | None = None
) -> Supervisor:
    """Triton started and kept serving (serving/host/supervisor.py): the same ports and log at every
    restart, so the gateway and the clients find it again. A port not given is picked now, once, and
    never one of `taken` (ports promised to others that may not be bound yet), which it joins."""
    taken = set() if taken is None else taken
    ports = {name: ports.get(name) or free_port_but(options.address, taken) for name in ("http", "grpc", "metrics")}

    def start():
        return start_triton(
            options.repository,
            host=options.address,
            http_port=ports["http"],
            grpc_port=ports["grpc"],
            metrics_port=ports["metrics"],
            log_path=log,
            tritonserver=options.tritonserver,
        )

    return Supervisor(start, interval=options.probe_interval, also=other_session_models(options.repository))


_PICKING = threading.Lock()  # the replicas pick their ports in threads of their own (start_fleet)


def free_port_but(address: str, taken: set[int]) -> int:
    """A free port that is not in `taken`, added to it."""
    with _PICKING:
        port = free_port(address)
        while port in taken:
            port = free_port(address)
        taken.add(port)
        return port


class Checked(Protocol):
    def check(self, say: Callable[[str], None]) -> bool:
        """True while it serves (brought back if it had died); False once it cannot."""


class OneTriton:
    """One supervised Triton, with the face of a Fleet (serving/host/fleet.py)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    @property
    def grpc_url(self) -> str:
        return self.supervisor.server.grpc_url

    @property
    def http_url(self) -> str:
        return self.supervisor.server.http_url

    @property
    def failed(self) -> str | None:
        return self.supervisor.failed

    def check(self, say: Callable[[str], None] = print) -> bool:
        if self.supervisor.running():
            return True
        say(f"error: {self.supervisor.failed}; Triton's log: {self.supervisor.server.log_path}")
        return False

    def layout(self) -> list[str]:
        server = self.supervisor.server
        return [
            f"Triton HTTP     http://{server.http_url}",
            f"Triton gRPC     {server.grpc_url}",
            f"Triton metrics  {server.metrics_url}",
            f"models          {', '.join(server.models)}",
            *serving_lines(server.log_text()),
        ]

    def stop(self) -> None:
        self.supervisor.stop()


def metrics_urls(front: OneTriton | Fleet) -> list[str]:
    """Every replica's metrics endpoint: the gateway reads the KV cache's usage there."""
    supervisors = front.supervisors if isinstance(front, Fleet) else [front.supervisor]
    return [supervisor.server.metrics_url for supervisor in supervisors]


def watch(front: OneTriton | Fleet, stop: threading.Event, say: Callable[[str], None], *more: Checked) -> None:
    """Until `stop` is set or the front, or one of `more` (the gateway), has nothing left to serve (said
    through `say`)."""
    while not stop.wait(0.5):
        if not all(watched.check(say) for watched in (front, *more)):
            return
