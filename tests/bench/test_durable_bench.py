"""`python -m bench durable` end to end, bounded: the tiny model at a short past through a real Triton,
one round, all three stores (none, a directory, a real redis-server), and a drain by migration of 3
sessions over 3 replicas behind Envoy; it writes its JSON, its plot
and its table, and what it measured is coherent (timings are not asserted: this is a smoke test)."""

import shutil

import pytest

from bench.__main__ import main

pytestmark = [pytest.mark.served, pytest.mark.slow, pytest.mark.timeout(600)]
# its run drives Triton, Envoy and Redis processes through clients: no torch in this process (conftest.py)
TORCH_FREE_RUNS = ("durable",)


def bench_jobs(root, artifact_dir) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs."""
    # 64 + 20 positions fit the tiny preset's 512: the bench serves the preset as it is, the session's build
    shutil.copytree(artifact_dir("tiny"), root / "work" / "artifact-tiny-512")
    args = ["durable", "--preset", "tiny", "--past", "64", "--steps", "20", "--rounds", "1", "--every", "8"]
    args += ["--drain-sessions", "3", "--threads", "1"]  # one thread: see test_sessions_bench
    return {"durable": lambda: main([*args, "--out", str(root / "results"), "--work", str(root / "work")])}


def test_the_durable_benchmark_times_each_store_sizes_what_it_holds_and_times_a_recovery(bench_runs):
    run = bench_runs["durable"]
    _, results = run.written("durable")
    assert set(results["steps_ms"]) == {"none", "directory", "redis"}
    assert all(row["runs"] == 20 and row["p50_ms"] > 0 for row in results["steps_ms"].values())
    # a checkpoint at 64, 72, 80 of 84: the store holds the first 80 (the last 4 are in the replay log),
    # each once: just under the whole cache's snapshot (84 positions), plus a header per increment
    cache = results["cache_bytes_at_end"]
    for name in ("directory", "redis"):
        assert 0.9 * cache < results["store_bytes"][name] < cache + 11 * 4096, results["store_bytes"]
    recovery = results["recovery"]
    assert recovery["recovering_ms"]["runs"] == 1 and recovery["replayed_positions"] == [5]
    drain = results["drain"]  # 3 sessions over 3 replicas: the retired one held at least one, each moved
    assert drain["sessions"] == 3 and 1 <= drain["moved"] == drain["moved_step_ms"]["runs"] <= 3
    assert drain["replica_stopped_s"] > 0 and drain["all_served_s"] > 0
    printed = run.stdout
    assert "recovering step" in printed and "drain by migration" in printed
