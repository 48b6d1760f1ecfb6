"""N supervised Triton replicas on one host with Envoy in front (`python -m serving --replicas N`).

Each replica is a tritonserver on ports of its own, kept serving by its supervisor
(serving/host/supervisor.py: a dead stub reloaded, a dead server restarted on the same ports). Envoy
(serving/host/envoy) listens where one Triton would (the HTTP and gRPC ports given) and routes a session's
steps to the replica holding it (docs/scale-out.md). `check()`, called by the caller's loop, keeps the
whole standing: a replica whose supervisor gave up leaves Envoy's list (its sessions get
`[sequence_lost]`, new ones go to the others), and an Envoy that died is started again on its ports.
`retire(index, deadline_s)` takes a replica out gracefully: no new sessions, its open ones served
until they end or the deadline passes, then it leaves the list and stops.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from serving.host.envoy import Envoy, ProxySettings, Replica, start_envoy
from serving.host.launcher import serving_lines
from serving.host.supervisor import Supervisor

log = logging.getLogger(__name__)
SEQUENCES_METRIC = "attention_kv_cache_sequences"  # the sessions model's gauge (serving/triton/models/sessions.py)


@dataclasses.dataclass
class Fleet:
    supervisors: list[Supervisor]
    envoy: Envoy
    proxy: ProxySettings
    failed: str | None = None  # why the fleet cannot serve at all (every replica gave up)
    _left: set[int] = dataclasses.field(default_factory=set)  # replicas taken out of Envoy's list
    _draining: set[int] = dataclasses.field(default_factory=set)  # replicas that take no new session

    @property
    def grpc_url(self) -> str:
        return self.envoy.grpc_url

    def replicas(self) -> list[Replica]:
        """The replicas Envoy routes to (those whose supervisor has not given up)."""
        return [
            replica_of(s, draining=i in self._draining) for i, s in enumerate(self.supervisors) if i not in self._left
        ]

    def retire(self, index: int, deadline_s: float, poll_s: float = 0.5, migrate: bool = False) -> int:
        """Drain replica `index`, then stop it: marked draining in Envoy's list (new sessions go to
        the others, its own are still served) until it holds no sequence or `deadline_s` has passed;
        then out of the list and stopped without Triton's own drain of what it still holds (a drain
        that would only wait its exit timeout). Returns how many sequences it still held (lost).

        With `migrate`, its sessions are not waited for: it leaves Envoy's list and stops at once, and
        each session of a client with a session store (every gateway session) moves at its next step,
        rebuilt on another replica from its checkpoints (docs/design.md, "Durable sessions"). Returns
        how many it held: moved, or lost for clients without a store."""
        if index in self._left or len(self._left) + 1 >= len(self.supervisors):
            raise ValueError(f"replica {index} cannot be retired: it is gone or the last one serving")
        self._draining.add(index)
        self.envoy.update(self.replicas())
        server, deadline = self.supervisors[index].server, time.monotonic() + (0 if migrate else deadline_s)
        while (held := open_sequences(server.metrics_url)) != 0 and time.monotonic() < deadline:
            time.sleep(poll_s)
        self._left.add(index)
        self.envoy.update(self.replicas())
        self.supervisors[index].stop(drain=False)
        return max(held, 0)

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
        lines.append("each replica:")
        return lines + serving_lines(self.supervisors[0].server.log_text())

    def stop(self) -> None:
        """Envoy first (no new requests), then every replica at once."""
        self.envoy.stop()
        with concurrent.futures.ThreadPoolExecutor(len(self.supervisors)) as pool:
            list(pool.map(Supervisor.stop, self.supervisors))


def replica_of(supervisor: Supervisor, draining: bool = False) -> Replica:
    server = supervisor.server
    return Replica(server.host, server.ports["http"], server.ports["grpc"], draining=draining)


def open_sequences(metrics_url: str) -> int:
    """Sequences a replica's session model holds, from its metrics endpoint; -1 when unreadable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return -1
    families = text_string_to_metric_families(text)
    return int(sum(sample.value for family in families if family.name == SEQUENCES_METRIC for sample in family.samples))


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
