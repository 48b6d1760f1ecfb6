"""A small decode-latency probe behind `python -m client bench` (the full benchmark lives in bench/).

Prefills a random prompt (not timed), then times single-token decode steps until `steps` are done
or `time_limit` seconds have passed, whichever comes first: it never runs unbounded against a
server someone else may be using.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from client.sync import Client

MODES = ("session", "stateless")


@dataclasses.dataclass(frozen=True)
class BenchResult:
    mode: str
    protocol: str
    prompt: int
    latencies_ms: list[float]  # one per timed decode step

    @property
    def steps(self) -> int:
        return len(self.latencies_ms)

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    def summary(self) -> str:
        return (
            f"{self.mode} over {self.protocol}: {self.steps} decode steps after a {self.prompt}-token prompt, "
            f"p50 {self.percentile(50):.3f} ms, p99 {self.percentile(99):.3f} ms"
        )


def random_hidden(rng: np.random.Generator, batch: int, tokens: int, d_model: int, dtype: str) -> np.ndarray:
    return rng.standard_normal((batch, tokens, d_model)).astype(dtype)


def run_bench(
    client: Client, *, mode: str = "session", steps: int = 64, prompt: int = 16, time_limit: float = 30.0, seed: int = 0
) -> BenchResult:
    """Decode-step latencies of one sequence: stateful (the server keeps the cache) or stateless
    (the client sends it back every step)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    model = client.session_model if mode == "session" else client.model
    info = client.metadata(model)
    rng = np.random.default_rng(seed)
    tokens = [random_hidden(rng, 1, 1, info.d_model, info.float_dtype) for _ in range(steps)]
    prompt_hidden = random_hidden(rng, 1, prompt, info.d_model, info.float_dtype)
    deadline = time.monotonic() + time_limit
    if mode == "session":
        with client.session() as session:
            session.step(prompt_hidden)
            latencies = _timed(session.step, tokens, deadline)
    else:
        past = client.infer(prompt_hidden).present

        def decode(token: np.ndarray) -> None:
            nonlocal past
            past = client.infer(token, past=past).present

        latencies = _timed(decode, tokens, deadline)
    return BenchResult(mode, client.protocol, prompt, latencies)


def _timed(step, tokens: list[np.ndarray], deadline: float) -> list[float]:
    latencies = []
    for token in tokens:
        if time.monotonic() >= deadline:
            break
        start = time.perf_counter()
        step(token)
        latencies.append((time.perf_counter() - start) * 1e3)
    return latencies
