"""`python -m bench admission` end to end, bounded: a budget of 30 rows, 40 opens per slot setting;
it writes its JSON, its plot and its table, and what it measured is coherent (timings are not
asserted: this is a smoke test, the numbers are docs/reliability.md's)."""

import shutil

import pytest

from bench.__main__ import main

pytestmark = [pytest.mark.served, pytest.mark.slow, pytest.mark.timeout(600)]
# its run drives Triton processes through clients: no torch in this process (conftest.py)
TORCH_FREE_RUNS = ("admission",)


def bench_jobs(root, artifact_dir) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs."""
    shutil.copytree(artifact_dir("tiny"), root / "work" / "artifact-tiny")  # reuse the session's build
    args = ["admission", "--rows", "30", "--attempts", "40", "--memory-rounds", "1"]
    return {"admission": lambda: main([*args, "--out", str(root / "results"), "--work", str(root / "work")])}


def test_the_admission_benchmark_refuses_past_the_budget_under_both_slot_settings(bench_runs):
    run = bench_runs["admission"]
    _, results = run.written("admission")
    for name, setting in results["settings"].items():
        assert setting["opened"] == 30 and setting["attempted"] == 40, name  # 30 rows < either slot count
        first = setting["first_beyond"]
        assert first["index"] == 31 and first["outcome"] == "ServerBusyError" and first["kind"] == "cache_full"
        assert setting["outcomes"].count("ServerBusyError") == 10 and setting["refused_ms"]["runs"] == 10
        assert setting["steps_after"]["answered"] == setting["steps_after"]["sessions"] > 0
        assert setting["steps_after"]["max_abs_diff"] < 1e-5
    assert results["settings"]["fixed-1024"]["slots"] == 1024
    memory = results["slot_memory"]
    assert memory["slots"]["derived"] > memory["slots"]["fixed-1024"]
    assert all(len(values) == 1 and values[0] > 0 for values in memory["ready_rss_mib"].values())
    assert "budget of 30 rows" in run.stdout
