"""A model folder's chat template is someone else's code (issue 47, item 2): the gateway renders it in worker
processes (serving/gateway/templates.py) bounded in time and memory, never on its event loop. A template of
two nested `range(99999)` (it held /healthz for 25 s) is cut at the time limit while the event loop goes on and
a render beside it is answered; `'a' * 3000000000` (3 GB, then a 500) is refused at the memory limit; an
ordinary template renders as in-process; the workers are gone once closed."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from client import chat_template
from serving.gateway.templates import TemplateLimit, TemplateWorkers

RUNAWAY = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
HUGE = "{{ 'a' * 3000000000 }}"
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
VARIABLES = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}


def workers_of(pid: int) -> set[int]:
    return {
        child.pid
        for child in psutil.Process(pid).children(recursive=True)
        if "spawn_main" in " ".join(child.cmdline())  # the workers, not the resource tracker (it lives with us)
    }


async def ticking(gaps: list[float], stop: asyncio.Event) -> None:
    last = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.01)
        now = time.monotonic()
        gaps.append(now - last)
        last = now


def test_a_runaway_template_is_cut_at_its_time_limit_and_the_loop_goes_on():
    async def scenario() -> tuple[float, str, list[float]]:
        workers = TemplateWorkers(workers=2, timeout_s=2.0, memory_mib=512)
        gaps: list[float] = []
        stop = asyncio.Event()
        ticker = asyncio.create_task(ticking(gaps, stop))
        try:
            assert await workers.render(CHATML, VARIABLES) == chat_template.render(CHATML, VARIABLES)
            began = time.monotonic()
            runaway = asyncio.create_task(workers.render(RUNAWAY, VARIABLES))
            await asyncio.sleep(0.5)
            beside = asyncio.create_task(workers.render(CHATML, VARIABLES))  # on the pool the runaway's kill ends
            with pytest.raises(TemplateLimit) as limited:
                await runaway
            took = time.monotonic() - began
            return took, str(limited.value), [await beside, *gaps]
        finally:
            stop.set()
            await ticker
            workers.close()

    before = workers_of(psutil.Process().pid)  # other gateways' of this process (the session's fortunes one)
    took, message, (beside, *gaps) = asyncio.run(scenario())
    assert 2.0 <= took < 4.0 and "2 s limit (SERVING_TEMPLATE_TIMEOUT_S)" in message
    assert beside == chat_template.render(CHATML, VARIABLES)
    assert max(gaps) < 0.5  # the event loop was never held
    assert not workers_of(psutil.Process().pid) - before


def test_a_template_that_needs_gigabytes_is_refused_at_the_memory_limit():
    async def scenario() -> str:
        workers = TemplateWorkers(workers=1, timeout_s=10.0, memory_mib=512)
        try:
            with pytest.raises(TemplateLimit) as limited:
                await workers.render(HUGE, VARIABLES)
            assert await workers.render(CHATML, VARIABLES) == chat_template.render(CHATML, VARIABLES)  # still serves
            return str(limited.value)
        finally:
            workers.close()

    assert "more than its 512 MiB (SERVING_TEMPLATE_MEMORY_MIB)" in asyncio.run(scenario())
