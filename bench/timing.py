"""Timing and memory bandwidth, shared by the benchmarks.

Latencies are wall-clock medians and 90th percentiles over repeated calls after a warm-up call.
Each candidate runs alone (the others' thread pools idle): on a 2-core machine an ONNX Runtime pool
and PyTorch's OpenMP threads spinning at the same time would time each other, not themselves.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")

# Let the last candidate's spinning worker threads go to sleep before the next one is timed.
SETTLE_S = 0.2


def interleaved(rounds: int, names: Sequence[T]) -> Iterator[tuple[int, T]]:
    """(round, name) for every candidate in every round, the order reversed each other round: no candidate
    always runs first (on a cold cache) or last (beside the previous one's threads), and a slow drift of the
    machine's load falls on every candidate alike. Every bench's rounds go this way."""
    for turn in range(rounds):
        for name in names if turn % 2 == 0 else names[::-1]:
            yield turn, name


@dataclasses.dataclass(frozen=True)
class Budget:
    """How long to time one call: at least `min_runs` calls, then more until `seconds` are spent.
    A call whose warm-up alone outlasts `seconds` (a big prefill: seconds per call) is timed only
    `slow_runs` times."""

    seconds: float
    min_runs: int = 3
    max_runs: int = 1000
    warmup: int = 1
    slow_runs: int = 2


@dataclasses.dataclass
class Timing:
    samples_ms: list[float] = dataclasses.field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return float(np.median(self.samples_ms))

    @property
    def p90_ms(self) -> float:
        return float(np.percentile(self.samples_ms, 90))

    def to_dict(self) -> dict:
        return {"median_ms": self.median_ms, "p90_ms": self.p90_ms, "runs": len(self.samples_ms)}


def percentiles(samples_ms: list[float]) -> dict:
    """p50, p99 and the count of latency samples in milliseconds."""
    return {
        "p50_ms": float(np.percentile(samples_ms, 50)),
        "p99_ms": float(np.percentile(samples_ms, 99)),
        "runs": len(samples_ms),
    }


def measure(call: Callable[[], object], budget: Budget, into: Timing | None = None) -> Timing:
    """Time `call` after `budget.warmup` untimed calls; add the samples to `into` when given."""
    timing = into if into is not None else Timing()
    started = time.perf_counter()
    for _ in range(budget.warmup):
        call()
    slow = budget.warmup and time.perf_counter() - started > budget.seconds * budget.warmup
    min_runs = min(budget.min_runs, budget.slow_runs) if slow else budget.min_runs
    started, runs = time.perf_counter(), 0
    while runs < budget.max_runs and (runs < min_runs or time.perf_counter() - started < budget.seconds):
        t0 = time.perf_counter()
        call()
        timing.samples_ms.append((time.perf_counter() - t0) * 1e3)
        runs += 1
    return timing


def timed(calls: dict[str, Callable[[], object]], rounds: int, budget: Budget) -> dict[str, Timing]:
    """Each call measured for `budget` in each of `rounds` interleaved rounds."""
    timings = {name: Timing() for name in calls}
    for _, name in interleaved(rounds, list(calls)):
        measure(calls[name], budget, into=timings[name])
    return timings


def copy_bandwidth(threads: int, megabytes: int = 256, repeats: int = 10) -> dict[str, float]:
    """Memory bandwidth in GB/s from copying a buffer far larger than the caches, counting the bytes
    read and the bytes written: numpy (one thread) and torch (`threads` threads); the best is used."""
    import torch

    n = megabytes * (1 << 20) // 4
    source, target = np.ones(n, np.float32), np.empty(n, np.float32)
    numpy_gbps = _copy_rate(lambda: np.copyto(target, source), 2 * source.nbytes, repeats)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t_source, t_target = torch.ones(n), torch.empty(n)
        torch_gbps = _copy_rate(lambda: t_target.copy_(t_source), 2 * source.nbytes, repeats)
    finally:
        torch.set_num_threads(previous)
    return {"numpy_copy_gbps": numpy_gbps, "torch_copy_gbps": torch_gbps, "gbps": max(numpy_gbps, torch_gbps)}


def _copy_rate(copy: Callable[[], object], nbytes: int, repeats: int) -> float:
    timing = measure(copy, Budget(seconds=0.0, min_runs=repeats, warmup=2))
    return nbytes / (timing.median_ms / 1e3) / 1e9
