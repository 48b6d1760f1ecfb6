"""The GPU proof's code on this CPU host: every section runs (the build, which reuses the session's
build of the tiny preset, parity, latency with the peer, the served models), and the CPU placement it
finds is reported as the fallback it would be on a GPU host; `python -m bench gpu` itself refuses a
host without CUDA, with the reason."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest

from bench import gpu
from bench.timing import Budget
from contract import files, names
from export.progress import Progress

pytestmark = pytest.mark.slow

PLAN = gpu.Plan(
    grid=gpu.Grid(pasts=(8, 16), batches=(1, 2)),
    budget=Budget(0.005, min_runs=2),
    passes=1,
    parity_steps=8,
    served_pasts=(8,),
    served_runs=3,
    bandwidth_mib=16,
    bandwidth_runs=3,
    reuse_build=True,
)


# the refusal is `python -m bench gpu` in a process of its own: no torch in this process (conftest.py)
TORCH_FREE_RUNS = ("gpu-refusal",)

GENERATION = dataclasses.replace(
    PLAN, generation_prompt=8, generation_tokens=4, generation_batches=(1, 2), generation_rounds=1
)


def bench_jobs(root, artifact_dir) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs: the proof, and the command on
    a host without CUDA (on one with CUDA it would run the whole proof)."""
    import torch

    # the session's build of the tiny preset holds every form the proof builds: its build step reuses it
    shutil.copytree(artifact_dir("tiny"), root / "work" / "tiny")
    # (e) over the session's Llama-shaped whole build (the tiny preset has no vocabulary to generate from)
    shutil.copytree(artifact_dir("whole"), root / "whole")
    jobs = {
        "gpu-proof": lambda: gpu.benchmark(
            ("tiny",), root / "work", gpu.CPU, PLAN, Progress(enabled=False), root / "out"
        ),
        "gpu-generation": lambda: gpu.generation(root / "whole", gpu.CPU, GENERATION, Progress(enabled=False)),
    }
    if not torch.cuda.is_available():
        (root / "command").mkdir()
        command = [sys.executable, "-m", "bench", "gpu", "--out", str(root / "command")]
        jobs["gpu-refusal"] = lambda: subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    return jobs


@pytest.fixture(scope="module")
def proof(bench_runs):
    run = bench_runs["gpu-proof"]
    return run.result(), run.root / "out"


def test_every_section_ran_and_wrote_its_results(proof):
    results, out = proof
    assert results["errors"] == {}
    entry = results["presets"]["tiny"]
    assert set(entry["parity"]) == set(gpu.PARITY_VARIANTS)
    for variant, outcome in entry["parity"].items():
        assert outcome["passed"] and outcome["finite"], variant
        assert outcome["worst"][names.OUTPUT]["max_abs"] < (1e-4 if variant.startswith("fp32") else 1e-2)
    rows = entry["latency"]["rows"]
    assert [(r["batch"], r["past"]) for r in rows] == [(1, 8), (1, 16), (2, 8), (2, 16)]
    assert all(set(r["candidates"]) == set(gpu.candidates(gpu.preset("tiny"))) and r["floor_ms"] > 0 for r in rows)
    assert entry["latency"]["peer_error"] < gpu.PEER_BOUND  # the PyTorch static-cache peer is the original
    served = results["served"]
    assert [r["past"] for r in served["rows"]] == [8] and served["noop_grpc"]["p50_ms"] > 0
    assert {line.split(":")[0].strip('"') for line in served["runners"]} == {"forward", "sessions"}
    assert json.loads((out / "gpu.json").read_text())["presets"]["tiny"]["latency"]["rows"] == rows


def test_the_build_step_used_the_session_build_as_it_is(bench_runs, artifact_dir):
    used = bench_runs["gpu-proof"].root / "work" / "tiny" / files.REPORT_FILENAME
    assert used.read_bytes() == (artifact_dir("tiny") / files.REPORT_FILENAME).read_bytes()  # not built again


def test_a_run_on_the_cpu_is_reported_as_a_fallback(proof):
    results, _ = proof
    problems = results["problems"]
    assert any("fp16-static: ['" in p and "ran on the CPU" in p for p in problems)
    assert any(p.startswith("served models on the CPU") for p in problems)


def test_the_report_and_the_plots(proof, tmp_path):
    results, _ = proof
    text = gpu.report(results)
    assert "fp16-static+graphs" in text and "static/floor" in text and "no-op model" in text
    assert [p.name for p in gpu.write(results, tmp_path)] == ["gpu.json", "gpu_decode_tiny.png"]


def test_the_command_refuses_a_host_without_cuda(bench_runs):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the proof would run")
    run = bench_runs["gpu-refusal"]
    done = run.result()
    assert done.returncode == 2
    assert "error: PyTorch sees no CUDA device: the GPU proof needs a CUDA host" in done.stdout
    assert not list((run.root / "command").iterdir())  # nothing half-written


def test_greedy_generation_runs_the_engine_and_transformers_on_the_same_prompts(bench_runs):
    """(e) on the CPU, over the session's Llama-shaped whole artifact: every batch, both candidates (the
    engine's loop over the factory's engine, as on a GPU), the engine said, and the report's table."""
    result = bench_runs["gpu-generation"].result()
    assert [row["batch"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert set(row["candidates"]) == {gpu.ENGINE_LOOP, gpu.TRANSFORMERS}
        for summary in row["candidates"].values():
            assert summary["ttft_ms"] > 0 and summary["step_p50_ms"] > 0 and summary["tokens_per_s"] > 0
        assert len(row["agreement"]["per_row"]) == row["batch"]
        assert all(0 <= agreed <= 4 for agreed in row["agreement"]["per_row"])
    assert "static engine" in result["engine"]
    assert "greedy tokens agree" in gpu.generation_table({"presets": {"whole": {"generation": result}}})
