"""`python -m bench gateway` end to end on the tiny model, bounded: a real Triton, a real gateway
process, a few steps per mode; it writes its JSON, its plot and its table, and what it measured is
coherent. Rates are not asserted (this is a smoke test, not a benchmark)."""

import shutil

import pytest

from bench.__main__ import main
from bench.gateway import MODES

pytestmark = [pytest.mark.served, pytest.mark.slow, pytest.mark.timeout(300)]
# its run drives Triton and a gateway process through clients: no torch in this process (conftest.py)
TORCH_FREE_RUNS = ("gateway",)


def bench_jobs(root, artifact_dir) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs."""
    shutil.copytree(artifact_dir("tiny"), root / "work" / "artifacts")  # reuse the session's build
    # 72 steps a mode: Triton's CPU for them is counted in 10 ms clock ticks (24 could show none)
    args = ["gateway", "--preset", "tiny", "--sessions", "3", "--rounds", "2", "--steps", "12"]
    return {"gateway": lambda: main([*args, "--out", str(root / "results"), "--work", str(root / "work")])}


def test_the_gateway_benchmark_measures_the_three_ways_side_by_side(bench_runs):
    run = bench_runs["gateway"]
    _, results = run.written("gateway")
    assert set(results["modes"]) == set(MODES)
    for mode, row in results["modes"].items():
        assert row["steps"] == 2 * 3 * 12 and row["steps_per_s"] > 0, mode
        assert row["load_generator_cpu_us_per_step"] > 0 and row["triton_cpu_us_per_step"] > 0, mode
    assert results["modes"]["grpc/client"]["ratio_to_grpc"] == 1.0
    assert results["modes"]["gateway/json"]["gateway_cpu_us_per_step"] > 0
    target = results["target"]
    assert target["worst_ratio"] == min(results["modes"][m]["ratio_to_grpc"] for m in ("gateway/json", "gateway/b64"))
    printed = run.stdout
    assert "gateway/b64" in printed and "target:" in printed
