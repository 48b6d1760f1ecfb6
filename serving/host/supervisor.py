"""Keep a Triton serving: a dead tritonserver is started again, a model whose process died is
reloaded (or the server restarted when that fails), each with a log line saying what happened.

Triton's own readiness stays green while a Python-backend model's process (its stub) is dead, so the
supervisor watches what a user would see: every `interval` it sends one real token through each
model (`client.Client.probe`). A failed probe is acted on at once when its cause is certain (the
server exited, a stub's process is gone) and after `patience` probes otherwise (a model not ready, no
answer). A stub Triton calls unhealthy whose process still runs is slow (starved of CPU, stopped), not
dead: its model is reloaded only once nothing has answered for `hang_timeout`, as a server that answers
nothing is restarted then (a reload of a stopped stub aborted Triton 2.51, server#8882).

Sessions held by a process that died are lost with it: their next step gets the client's
SessionLostError (the gateway's 409 `session_lost`); new sessions work once the model is back.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable

from client import Client, ClientError
from serving.host.launcher import TritonServer, TritonStartError

log = logging.getLogger(__name__)

# Triton's python backend: "Stub process '<instance>' is not healthy." It says so of a stub that did not answer
# its health check within a second: a dead one, or one starved of CPU or stopped
UNHEALTHY_STUB = re.compile(r"Stub process '([^']+)' is not healthy")


@dataclasses.dataclass(frozen=True)
class Finding:
    """Why the server does not serve; `certain` when waiting will not help (acted on at once)."""

    problem: str
    certain: bool
    dead_models: tuple[str, ...] = ()
    slow: bool = False  # every stub said not to be healthy still runs: given until `hang_timeout`


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One thing the supervisor did: when, what it saw, what it did, and how long until serving."""

    at: float  # time.time() when the failure was seen
    problem: str
    action: str  # "reload <model>" or "restart"
    seconds: float  # from the failure seen to the probe answering again
    ok: bool


class Supervisor:
    """Owns the running server (`.server` changes on a restart) and a thread that keeps it serving: its
    stateless and session models and the session models of `also` (the repository's other model sets).

    `start()` starts a server (the same ports, the same log, every time); `on_change(server)` is
    called after a restart. `stop()` stops the thread and the server.
    """

    def __init__(
        self,
        start: Callable[[], TritonServer],
        *,
        interval: float = 1.0,
        patience: int = 3,
        hang_timeout: float = 30.0,
        probe_timeout: float = 10.0,
        max_restarts: int = 5,
        also: tuple[str, ...] = (),
    ) -> None:
        self._start, self.interval, self.patience, self.also = start, interval, patience, also
        self.hang_timeout, self.probe_timeout, self.max_restarts = hang_timeout, probe_timeout, max_restarts
        self.server = start()
        self.recoveries: list[Recovery] = []
        self.serving = threading.Event()  # set while the last probe answered
        self.serving.set()
        self.failed: str | None = None  # why the supervisor gave up (too many restarts in a row)
        self._stop = threading.Event()
        self._restarts_in_a_row = 0
        self._client: Client | None = None  # the probe's, for the current server
        self._thread = threading.Thread(target=self._loop, name="triton-supervisor", daemon=True)
        self._thread.start()

    # --- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        misses, last_answer = 0, time.monotonic()
        while not self._stop.wait(self.interval):
            finding = self._check()
            if finding is None:
                misses, last_answer = 0, time.monotonic()
                self._restarts_in_a_row = 0
                self.serving.set()
                continue
            self.serving.clear()
            misses += 1
            hung = time.monotonic() - last_answer > self.hang_timeout
            if finding.slow and misses == 1:
                log.warning(
                    "supervisor: %s; its process runs (slow, or stopped): reloaded only if nothing answers for %g s",
                    finding.problem,
                    self.hang_timeout,
                )
            if finding.certain or (misses >= self.patience and not finding.slow) or hung:
                if not self._recover(finding):
                    return
                misses, last_answer = 0, time.monotonic()

    def _check(self) -> Finding | None:
        """What keeps the server from serving, or None when every model answers."""
        server = self.server
        if not server.is_running():
            return Finding(f"tritonserver exited with {server.process.returncode}", certain=True)
        if self._client is None or self._client.url != server.grpc_url:
            self._client = Client(server.grpc_url, timeout=self.probe_timeout, retries=0)
        try:
            state = self._client.probe(self.also)
        except ClientError as error:
            return Finding(f"Triton does not answer: {error.message}", certain=False)
        if state.ok:
            return None
        unhealthy = {model: found[1] for model, why in state.failures.items() if (found := UNHEALTHY_STUB.search(why))}
        running = server.running_stubs() if unhealthy else set()  # the process table read only when it tells
        gone = [instance for instance in unhealthy.values() if instance not in running]
        slow = bool(unhealthy) and not gone
        return Finding(state.problems(), certain=bool(gone), dead_models=tuple(unhealthy), slow=slow)

    # --- recovery ---------------------------------------------------------------------------

    def _recover(self, finding: Finding) -> bool:
        """Reload the models whose process died, else restart the server; False when giving up."""
        seen, problem, dead = time.time(), finding.problem, finding.dead_models
        if dead and self.server.is_running():
            log.warning("supervisor: %s; reloading %s", problem, ", ".join(dead))
            if self._reload(dead) and self._wait_serving(timeout=30.0):
                self._record(seen, problem, f"reload {', '.join(dead)}", ok=True)
                return True
            if self._stop.is_set():  # stopping: what is left to do is the stop's
                return False
            died = "" if self.server.is_running() else f" (tritonserver exited with {self.server.process.returncode})"
            log.warning("supervisor: reloading %s did not bring it back%s; restarting Triton", ", ".join(dead), died)
        else:
            log.warning("supervisor: %s; restarting Triton", problem)
        return self._restart(seen, problem)

    def _reload(self, models: tuple[str, ...]) -> bool:
        """Load anew through Triton's private repository (`TritonServer.reload`, which returns once
        Triton serves the new models): no restricted API is involved."""
        try:
            self.server.reload(models, timeout=30.0)
            return True
        except (OSError, TimeoutError) as error:
            log.warning("supervisor: reload failed: %s", error)
            return False

    def _restart(self, seen: float, problem: str) -> bool:
        self._restarts_in_a_row += 1
        if self._restarts_in_a_row > self.max_restarts:
            self.failed = f"{self.max_restarts} restarts in a row did not bring Triton back; last problem: {problem}"
            log.error("supervisor: giving up: %s", self.failed)
            return False
        self.server.stop(timeout=5.0)
        while not self._stop.is_set():
            try:
                self.server = self._start()
                break
            except TritonStartError as error:
                self._restarts_in_a_row += 1
                if self._restarts_in_a_row > self.max_restarts:
                    self.failed = f"Triton does not start again: {error}"
                    log.error("supervisor: giving up: %s", self.failed)
                    return False
                log.warning("supervisor: Triton did not start (%s); trying again", str(error).splitlines()[0])
                self._stop.wait(1.0)
        ok = self._wait_serving(timeout=30.0)
        self._record(seen, problem, "restart", ok)
        return True

    def _wait_serving(self, timeout: float) -> bool:
        """Until every model answers (True), `timeout` passes or the server exits (False: a reload that took
        it down is not waited out)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stop.is_set() and self.server.is_running():
            if self._check() is None:
                self.serving.set()
                return True
            time.sleep(0.2)
        return False

    def _record(self, seen: float, problem: str, action: str, ok: bool) -> None:
        recovery = Recovery(seen, problem, action, time.time() - seen, ok)
        self.recoveries.append(recovery)
        verdict = "serving again" if ok else "NOT serving yet"
        log.warning("supervisor: %s done, %s %.1f s after the failure was seen", action, verdict, recovery.seconds)

    # --- lifetime -----------------------------------------------------------------------------

    def running(self) -> bool:
        """The supervision goes on (False once stopped or given up)."""
        return self._thread.is_alive()

    def stop(self, drain: bool = True) -> int | None:
        """The supervision ended, then the server stopped (`drain`: see `TritonServer.stop`)."""
        self._stop.set()
        self._thread.join(timeout=60.0)
        if self._client is not None:
            self._client.close()
        return self.server.stop(drain=drain)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
