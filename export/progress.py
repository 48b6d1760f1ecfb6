"""Progress for long commands: one line per stage with its duration, live step counts on a terminal."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import TextIO


class Progress:
    def __init__(self, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self._live = self.stream.isatty()
        self._label = ""

    @contextlib.contextmanager
    def stage(self, label: str) -> Iterator[None]:
        self._label = label
        self._write(f"{label} ...", final=not self._live)
        started = time.perf_counter()
        try:
            yield
        except BaseException:
            self._write(f"{label} ... failed after {time.perf_counter() - started:.1f} s")
            raise
        self._write(f"{label} ... done in {time.perf_counter() - started:.1f} s")

    def update(self, detail: str) -> None:
        """A transient detail (a step count); shown only on a terminal, where it is overwritten."""
        if self._live:
            self._write(f"{self._label} ... {detail}", final=False)

    def note(self, text: str) -> None:
        """A line that stays (a warning, a section that failed)."""
        self._write(text)

    def _write(self, text: str, final: bool = True) -> None:
        if not self.enabled:
            return
        if self._live:
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
        elif final:
            self.stream.write(text + "\n")
        self.stream.flush()
