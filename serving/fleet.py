"""N supervised Triton replicas on one host with Envoy in front (`python -m serving --replicas N`).

Each replica is a tritonserver on ports of its own, kept serving by its supervisor
(serving/supervisor.py: a dead stub reloaded, a dead server restarted on the same ports). Envoy
(serving/envoy) listens where one Triton would (the HTTP and gRPC ports given) and routes a session's
steps to the replica holding it (docs/scale-out.md). `check()`, called by the caller's loop, keeps the
whole standing: a replica whose supervisor gave up leaves Envoy's list (its sessions get
`[sequence_lost]`, new ones go to the others), and an Envoy that died is started again on its ports.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from serving.envoy import Envoy, ProxySettings, Replica, start_envoy
from serving.supervisor import Supervisor

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Fleet:
    supervisors: list[Supervisor]
    envoy: Envoy
    proxy: ProxySettings
    failed: str | None = None  # why the fleet cannot serve at all (every replica gave up)
    _left: set[int] = dataclasses.field(default_factory=set)  # replicas taken out of Envoy's list

    @property
    def grpc_url(self) -> str:
        return self.envoy.grpc_url

    def replicas(self) -> list[Replica]:
        """The replicas Envoy routes to (those whose supervisor has not given up)."""
        return [replica_of(s) for i, s in enumerate(self.supervisors) if i not in self._left]

    def check(self, say: Callable[[str], None] = print) -> bool:
        """One look at every process; False once no replica is left to serve."""
        gave_up = [i for i, s in enumerate(self.supervisors) if i not in self._left and not s.running()]
        for index in gave_up:
            self._left.add(index)
            say(f"replica {index} left the fleet: {self.supervisors[index].failed}")
        if gave_up and len(self._left) < len(self.supervisors):
            self.envoy.update(self.replicas())
        if len(self._left) == len(self.supervisors):
            self.failed = "every Triton replica failed and could not be brought back"
            return False
        if not self.envoy.is_running():
            say(f"Envoy exited with {self.envoy.process.returncode}; starting it again")
            self.envoy.stop()
            self.envoy = start_envoy(self.replicas(), self.proxy)
        return True

    def layout(self) -> list[str]:
        lines = [f"Envoy HTTP      http://{self.envoy.http_url}", f"Envoy gRPC      {self.envoy.grpc_url}"]
        for index, supervisor in enumerate(self.supervisors):
            server = supervisor.server
            lines.append(
                f"replica {index}       HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}"
            )
        lines.append(f"Envoy's log     {self.envoy.work_dir} (access.log: which replica served each request)")
        return lines

    def stop(self) -> None:
        """Envoy first (no new requests), then every replica at once."""
        self.envoy.stop()
        with concurrent.futures.ThreadPoolExecutor(len(self.supervisors)) as pool:
            list(pool.map(Supervisor.stop, self.supervisors))


def replica_of(supervisor: Supervisor) -> Replica:
    server = supervisor.server
    return Replica(server.host, server.ports["http"], server.ports["grpc"])


def start_fleet(
    count: int, supervise: Callable[[int], Supervisor], proxy: ProxySettings, work_dir: Path | None = None
) -> Fleet:
    """`count` replicas started at once (`supervise(index)` starts and supervises one), then Envoy
    in front of them. Whatever started is stopped again if any part fails."""
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(supervise, index) for index in range(count)]
        concurrent.futures.wait(futures)
    started = [f.result() for f in futures if f.exception() is None]
    failures = [f.exception() for f in futures if f.exception() is not None]
    try:
        if failures:
            raise failures[0]
        envoy = start_envoy([replica_of(s) for s in started], proxy, work_dir=work_dir)
    except BaseException:
        for supervisor in started:
            supervisor.stop()
        raise
    return Fleet(started, envoy, proxy)
