"""`python -m bench sessions` end to end, bounded: the tiny model at two short lengths in process
and one through a real Triton, one round;
it writes its JSON, its plot and its table, and what it measured is coherent (timings are not
asserted: this is a smoke test)."""

import shutil

import pytest

from bench.__main__ import main
from bench.timing import Budget
from contract.config import preset

pytestmark = [pytest.mark.served, pytest.mark.slow, pytest.mark.timeout(600)]


def bench_jobs(root, artifact_dir) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs."""
    shutil.copytree(artifact_dir("tiny"), root / "work" / "artifact-tiny")  # reuse the session's build
    args = ["sessions", "--preset", "tiny", "--lengths", "16,64", "--rounds", "1", "--seconds", "0.05"]
    # one thread: on a busy 2-core machine two OpenMP threads stall (measured: a fifth of the tiny model's
    # prefills over 50 ms, none on one thread), and a warm-up call taken for a slow one gets 2 timed runs, not 3
    args += ["--served-lengths", "32", "--others-seconds", "0.1", "--threads", "1"]
    return {"sessions": lambda: main([*args, "--out", str(root / "results"), "--work", str(root / "work")])}


def test_the_sessions_benchmark_times_every_operation_and_sizes_each_blob(bench_runs):
    run = bench_runs["sessions"]
    _, results = run.written("sessions")
    cfg = preset("tiny")
    for row in results["lengths"]:
        raw = 2 * cfg.n_layers * cfg.n_kv_heads * row["length"] * cfg.head_dim * 4  # fp32 keys and values
        assert raw < row["blob_bytes"] < raw + 4096, row  # the tensors and a header of metadata
        for name in ("prefill_torch", "prefill_onnx", "snapshot", "restore", "fork", "rewind"):
            # a call whose warm-up outlasts --seconds (a prefill beside 5 other benchmarks: seen at 64 tokens) is
            # timed Budget.slow_runs times, the others Budget.min_runs times at least
            assert row["operations"][name]["runs"] >= Budget.slow_runs, (name, row["operations"][name])
            assert row["operations"][name]["median_ms"] > 0, name
        assert row["prefill_onnx_over_restore"] > 0 and row["floor_ms"] > 0
    assert [row["length"] for row in results["lengths"]] == [16, 64]
    cost = results["cost_to_others"]
    assert (
        cost["others"] == 8
        and cost["length"] == 64
        and set(cost["added_ms"]) == {"snapshot", "restore", "fork", "rewind"}
    )
    assert all(timing["runs"] >= 5 for timing in cost["steps_ms"].values())
    (through_triton,) = results["served"]  # a real Triton: cold prefill against a restored snapshot
    assert through_triton["length"] == 32 and through_triton["cold_over_restore"] > 0
    assert all(through_triton[name]["runs"] >= 3 for name in ("cold", "restore", "fork", "prefix", "snapshot"))
    assert "prefill/restore" in run.stdout
