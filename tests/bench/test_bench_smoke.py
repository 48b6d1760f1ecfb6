"""`python -m bench model` end to end on the tiny preset in quick mode: it runs and writes its
results. Timings are not asserted (this is a smoke test, not a benchmark)."""

import shutil

import pytest

from bench import model
from bench.__main__ import COMMANDS, DEFAULT_COMMANDS, main
from contract import files

pytestmark = pytest.mark.slow


def bench_jobs(root, artifact_dir) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs."""
    shutil.copytree(artifact_dir("tiny"), root / "artifacts" / "tiny")  # reuse the session's build
    argv = ["model", "--quick", "--presets", "tiny", "--threads", "1"]  # one thread: see test_sessions_bench
    argv += ["--out", str(root / "results"), "--artifacts", str(root / "artifacts")]
    return {"model": lambda: main(argv)}


def test_quick_model_benchmark_writes_json_png_and_a_table(bench_runs):
    run = bench_runs["model"]
    _, results = run.written("model", plot="model_decode")
    assert results["bandwidth"]["gbps"] > 0 and results["quick"] is True
    rows = results["presets"]["tiny"]["rows"]
    assert [row["label"] for row in rows] == [shape.label for shape in model.shapes(quick=True)]
    for row in rows:
        assert set(row["candidates"]) == set(model.CANDIDATES)
        assert all(
            c["runs"] >= 2 and c["median_ms"] > 0 and c["p90_ms"] >= c["median_ms"] for c in row["candidates"].values()
        )
        assert (row["phase"] == "decode") == ("floor_ms" in row)
    assert set(results["targets"]) >= {"fused_vs_fp32_worst", "tiny_fp16_file_vs_fused"}
    assert (run.root / "artifacts" / "tiny" / files.model_filename(model.QKV)).is_file()

    printed = run.stdout
    assert "decode B1 P1024" in printed and "fused/floor" in printed and "targets:" in printed


def test_no_command_runs_every_cpu_benchmark_and_not_the_gpu_proof(monkeypatch):
    ran = []
    for name, module in COMMANDS.items():
        monkeypatch.setattr(module, "run", lambda args, name=name: ran.append((name, args.command)) or 0)
    assert main([]) == 0
    assert ran == [(name, name) for name in DEFAULT_COMMANDS] and ("model", "model") in ran
    assert "gpu" in COMMANDS and ("gpu", "gpu") not in ran  # it needs a CUDA host: run only when asked
