"""`python -m bench idle` end to end on the tiny model, bounded: a real Triton, a real gateway process, 0 and 40 idle
sessions, a few steps and opens per level and pass; it writes its JSON, its plot and its table, and what it measured
is coherent (timings are not asserted: this is a smoke test)."""

import shutil

import pytest

from bench.__main__ import main

pytestmark = [pytest.mark.served, pytest.mark.slow, pytest.mark.timeout(300)]
# its run drives Triton and a gateway process through HTTP: no torch in this process (conftest.py)
TORCH_FREE_RUNS = ("idle",)


def bench_jobs(root, artifact_dir) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs."""
    shutil.copytree(artifact_dir("tiny"), root / "work" / "artifact-tiny")  # reuse the session's build
    args = ["idle", "--preset", "tiny", "--levels", "40", "0", "--samples", "5", "--concurrency", "4"]
    return {"idle": lambda: main([*args, "--out", str(root / "results"), "--work", str(root / "work")])}


def test_the_idle_benchmark_measures_each_level_going_up_and_down(bench_runs):
    run = bench_runs["idle"]
    _, results = run.written("idle")
    assert results["conditions"]["levels"] == [0, 40]  # sorted
    assert list(results["levels"]) == ["0", "40"]
    for level, row in results["levels"].items():
        passes = row["passes"]
        # the top level is measured once (up), every other one on the way up and back down
        assert [one["direction"] for one in passes] == (["up"] if level == "40" else ["up", "down"]), level
        for kind in ("step", "open"):
            assert row[kind]["runs"] == 5 * len(passes), (level, kind)
            assert 0 < row[kind]["p50_ms"] <= row[kind]["p90_ms"], (level, kind)
            assert row[kind]["p50_vs_no_idle"] > 0
            assert all(one[f"{kind}_p50_ms"] > 0 for one in passes)
    assert all(row["p50_vs_no_idle"] == 1.0 for row in (results["levels"]["0"]["step"], results["levels"]["0"]["open"]))
    assert "load_average_1min" in results["machine"]
    assert "5 of each per level and pass" in run.stdout
    assert "   40 idle (up, reached in" in run.stdout
