"""Chat templates rendered out of the gateway's process, bounded in time and memory.

A chat template comes with a model folder: code written by whoever made the checkpoint, run on every chat
request. jinja2's sandbox keeps it from Python's internals, not from looping 10^10 times or building a 3 GB
string, and in the event loop either would stop every key's requests (a template of two nested `range(99999)`
held /healthz for 25 s). So each render runs in a worker process: a pool of SERVING_TEMPLATE_WORKERS, started
fresh (spawned: never a fork of the gateway's threads) with the renderer alone (client/chat_template.py), each
under an address-space limit (SERVING_TEMPLATE_MEMORY_MIB). A render past SERVING_TEMPLATE_TIMEOUT_S has its
pool's processes killed (a process's work cannot be stopped otherwise) and the next renders go to a new pool;
the request gets a 400 naming the limit, and the renders that shared the killed pool are sent again once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import resource
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from client import chat_template

log = logging.getLogger(__name__)


class TemplateLimit(Exception):
    """A render went past a limit of the workers (the message names it and its setting)."""


class TemplateWorkers:
    def __init__(self, workers: int, timeout_s: float, memory_mib: int) -> None:
        self.workers, self.timeout_s, self.memory_mib = workers, timeout_s, memory_mib
        self._pool: ProcessPoolExecutor | None = None

    async def render(self, source: str, variables: dict[str, Any]) -> str:
        """`client.chat_template.render(source, variables)` in a worker; TemplateFailed as it raises it,
        TemplateLimit past the time or memory limit. A render whose pool broke under it (a worker killed for
        another render's time, or out of memory) is sent once more, to a new pool."""
        try:
            return await self._render_once(source, variables)
        except BrokenProcessPool:
            try:
                return await self._render_once(source, variables)
            except BrokenProcessPool:
                raise TemplateLimit(f"the chat template's worker died rendering it ({self._memory_limit()})") from None

    async def _render_once(self, source: str, variables: dict[str, Any]) -> str:
        pool = self._current()
        try:
            future = asyncio.get_running_loop().run_in_executor(pool, chat_template.render, source, variables)
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            self._discard(pool, "a chat template ran past its time limit")
            raise TemplateLimit(
                f"the chat template ran past its {self.timeout_s:g} s limit (SERVING_TEMPLATE_TIMEOUT_S)"
            ) from None
        except MemoryError:
            raise TemplateLimit(self._memory_limit()) from None
        except BrokenProcessPool:
            self._discard(pool, "a template worker died")
            raise

    def close(self) -> None:
        """Every worker stopped and reaped (a render in flight is cut short: the gateway is stopping)."""
        pool = self._pool
        if pool is not None:
            self._discard(pool, None)
            pool.shutdown(wait=True)

    def _memory_limit(self) -> str:
        return f"the chat template needed more than its {self.memory_mib} MiB (SERVING_TEMPLATE_MEMORY_MIB)"

    def _current(self) -> ProcessPoolExecutor:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")  # never a fork of the gateway's threads (gRPC's)
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=context, initializer=_start_worker, initargs=(self.memory_mib << 20,)
            )
        return self._pool

    def _discard(self, pool: ProcessPoolExecutor, why: str | None) -> None:
        """Kill `pool`'s processes (a render cannot be stopped otherwise) and let the next render start another."""
        if why:
            log.warning("%s: its worker processes are killed and replaced", why)
        # the executor offers no kill of its own; a pool that broke has already let go of its processes (None)
        processes = list((getattr(pool, "_processes", None) or {}).values())
        for process in processes:
            with contextlib.suppress(OSError):
                process.kill()
        for process in processes:  # reaped now: a killed process exits at once
            process.join(timeout=1.0)
        pool.shutdown(wait=False, cancel_futures=True)
        if self._pool is pool:
            self._pool = None


def _start_worker(nbytes: int) -> None:
    import client.chat_template  # noqa: F401  (imported before the limit: it bounds a render, not the start)

    resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))
