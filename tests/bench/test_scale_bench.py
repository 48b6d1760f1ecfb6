"""`python -m bench scale` end to end on the tiny model, bounded: three real replicas, real Envoy,
a few steps per mode; it writes its JSON, its plot and its table, and what it measured is coherent."""

import shutil

import pytest

from bench.__main__ import main

pytestmark = [pytest.mark.served, pytest.mark.slow, pytest.mark.timeout(300)]
# its run drives Triton and Envoy processes through clients: no torch in this process (conftest.py)
TORCH_FREE_RUNS = ("scale",)


def bench_jobs(root, artifact_dir) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs."""
    shutil.copytree(artifact_dir("tiny"), root / "work" / "artifacts")  # reuse the session's build
    args = ["scale", "--preset", "tiny", "--past", "8", "--rounds", "2", "--steps", "3", "--sessions", "9"]
    return {"scale": lambda: main([*args, "--out", str(root / "results"), "--work", str(root / "work")])}


def test_the_scale_benchmark_measures_both_paths_and_the_spread(bench_runs):
    run = bench_runs["scale"]
    _, results = run.written("scale")
    for mode, row in results["latency"].items():
        assert row["runs"] == 2 * 3 and 0 < row["p50_ms"] <= row["p99_ms"], mode
    assert results["latency"]["envoy/noop"]["p50_ratio_to_direct"] > 0
    spread = results["spread"]
    assert sum(spread["per_replica"]) == 9 and len(spread["per_replica"]) == 3
    assert "spread of 9 sessions over 3 replicas" in run.stdout
