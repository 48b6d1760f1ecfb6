"""A Python-backend stub that ends with its tritonserver, whatever holds its threads."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading


class ParentWatchdog:
    """Ends this stub `deadline_s` after its tritonserver is gone, whatever holds its threads.

    The Python backend's own exit path can wait forever: a gauge update or a log line on its way
    when the server dies waits for an answer while holding the GIL and the stub's message lock,
    which the backend's exit needs (docs/reliability.md, "No orphans"). So a thread of ours pets
    faulthandler's watchdog, a C thread that needs neither, every `interval_s` while the parent
    lives; once it is gone (or a blocked update starves the petting) the watchdog prints every
    thread's stack to stderr and calls _exit(1). A live stub pets it every 0.25 s: only a GIL held
    for `deadline_s` would starve it, which no step, operation or gauge update does."""

    def __init__(self, deadline_s: float = 3.0, interval_s: float = 0.25) -> None:
        self.deadline_s, self.interval_s = deadline_s, interval_s
        self._parent = os.getppid()
        self._stop = threading.Event()
        self._pet()
        self._thread = threading.Thread(target=self._loop, name="parent-watchdog", daemon=True)
        self._thread.start()

    def _pet(self) -> None:
        faulthandler.dump_traceback_later(self.deadline_s, exit=True, file=sys.stderr)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s) and os.getppid() == self._parent:
            self._pet()

    def stop(self) -> None:
        """An orderly unload: the watchdog stands down."""
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
