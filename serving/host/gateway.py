"""The gateway as `python -m serving` runs it: `python -m serving.gateway` in a process of its own (its settings
passed as SERVING_* variables, its output the command's), started again when it dies, as the supervisor starts
Triton again. A gateway killed or crashed costs its clients the seconds of a restart, not the stack: Triton
and its sessions stay, and the next gateway takes the same session secret and store, so the session ids the
last one gave out still open what they opened.

A gateway that dies within `FLAPPING_S` of its start `FLAPPING_STARTS` times in a row, or does not start
again, is given up on (a setting that cannot serve): `python -m serving` then stops and exits 1.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from serving.host.launcher import answers_200
from serving.host.process import ManagedProcess, ProcessStartError

READY_TIMEOUT_S = 60.0  # a start imports the gateway's stack (tokenizers, gRPC) and loads the served text files
FLAPPING_S = 10.0
FLAPPING_STARTS = 3
STOP_TIMEOUT_S = 20.0  # a graceful stop: uvicorn ends its streams and closes its sessions' rows


class GatewayProcessError(ProcessStartError):
    """The gateway's process exited, or did not answer, before it was ready; or it died too often to go on."""


class GatewayProcess(ManagedProcess):
    name = "the gateway"

    def log_tail(self, lines: int = 40) -> str:
        return "(its output is above)"


class SupervisedGateway:
    """`python -m serving.gateway` with the settings `variables` make, ready once `url`/healthz answers;
    `check()` starts it again if it has died. The caller fixes what must stay the same from one start to the
    next: the port, the session secret."""

    def __init__(self, variables: dict[str, str], url: str) -> None:
        self.variables, self.url = variables, url
        self.work_dir = Path(tempfile.mkdtemp(prefix="serving-gateway-"))
        self.restarts, self._quick_deaths = 0, 0
        try:
            self.process = self._start()
        except GatewayProcessError:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            raise

    def _start(self) -> GatewayProcess:
        popen = GatewayProcess.spawn(
            [sys.executable, "-m", "serving.gateway"],
            self.work_dir,
            gateway_settings=self.variables,
        )
        process = GatewayProcess(popen, self.work_dir, self.work_dir / "no-log")
        self._started_at = time.monotonic()
        try:
            process.wait_ready(lambda: answers_200(f"{self.url}/healthz"), READY_TIMEOUT_S, GatewayProcessError, 0.1)
        except GatewayProcessError:
            process.stop()
            raise
        return process

    def check(self, say: Callable[[str], None] = print) -> bool:
        """True while the gateway serves, started again if it had died; GatewayProcessError once it is given
        up on."""
        if self.process.is_running():
            return True
        code = self.process.process.returncode
        self.process.stop()
        lived = time.monotonic() - self._started_at
        self._quick_deaths = self._quick_deaths + 1 if lived < FLAPPING_S else 0
        if self._quick_deaths >= FLAPPING_STARTS:
            raise GatewayProcessError(
                f"the gateway exited with {code} {FLAPPING_STARTS} times within {FLAPPING_S:g} s of its start"
            )
        say(f"the gateway exited with {code} after {lived:.1f} s; starting it again")
        self.process = self._start()
        self.restarts += 1
        say(f"the gateway serves again at {self.url} (restart {self.restarts})")
        return True

    def stop(self) -> None:
        self.process.stop(STOP_TIMEOUT_S)
        shutil.rmtree(self.work_dir, ignore_errors=True)
