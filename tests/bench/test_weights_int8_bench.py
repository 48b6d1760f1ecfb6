"""`python -m bench weights-int8` end to end, bounded: the tiny model, one prefill and one decode
shape, one round; it writes its JSON, its plot and its table, and what it measured is coherent
(timings are not asserted: this is a smoke test). The int8w graph is made from the session's build of
the tiny preset (its fp32-fused graph), as the bench reuses a build in its work folder."""

import math
import shutil

import pytest

from bench.__main__ import main
from bench.weights_int8 import CANDIDATES

pytestmark = pytest.mark.slow


def bench_jobs(root, artifact_dir) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs."""
    shutil.copytree(artifact_dir("tiny"), root / "artifact-tiny")  # its fp32-fused graph: no export again
    args = ["weights-int8", "--preset", "tiny", "--prefill", "32", "--pasts", "64", "--rounds", "1"]
    # 0.1 s a candidate: a warm-up call longer than that is taken for a slow one, timed twice, not 3 times
    # (torch-int8's prefill takes 20 ms here, beside the other smoke runs: 0.02 s made it "slow")
    args += ["--seconds", "0.1", "--threads", "1", "--out", str(root / "results"), "--work", str(root)]
    return {"weights-int8": lambda: main(args)}


def test_the_int8_weights_benchmark_times_errors_and_sizes_every_candidate(bench_runs):
    run = bench_runs["weights-int8"]
    _, results = run.written("weights_int8")

    assert results["preset"] == "tiny" and results["candidates"] == list(CANDIDATES)
    assert [row["label"] for row in results["shapes"]] == ["prefill B1 T32", "decode B1 P64"]
    for row in results["shapes"]:
        for name in CANDIDATES:
            timing, error = row["candidates"][name], row["errors"][name]
            assert timing["runs"] >= 3 and 0 < timing["median_ms"] <= timing["p90_ms"], (name, timing)
            assert all(math.isfinite(value) and value >= 0 for value in error.values()), (name, error)
        assert row["errors"]["torch"]["max_abs"] == 0  # the reference itself
        assert row["errors"]["fp32-fused"]["max_rel"] < 1e-5 < row["errors"]["fp32-fused-int8w"]["max_rel"] < 5e-2
        assert all(ratio > 0 and math.isfinite(ratio) for ratio in row["ratios"].values())
    sizes = results["file_bytes"]
    assert set(sizes) == set(CANDIDATES) and all(size > 0 for size in sizes.values())
    assert sizes["fp32-fused-int8w"] < sizes["fp32-fused"] and results["parity"]["passed"]
    assert all(ratio > 0 for ratio in results["file_ratios"].values())
    assert "vs torch-int8" in run.stdout
