"""`python -m bench model` of a whole model (token ids in, logits out) end to end, bounded: the session's
build of TEST_CONFIGS["whole"] (every form), its weights written as transformers' LlamaForCausalLM
checkpoint, a 16-token prompt and 8 greedy tokens at batches 1 and 2, one round, onnxruntime-genai
included (its venv made once, `.venv-genai`, if missing). Timings are not asserted (a smoke test); the
greedy tokens are: the fp32 forms and onnxruntime-genai choose transformers' tokens."""

import json
import shutil

import pytest

from bench import whole_model
from bench.__main__ import main
from tests.conftest import TEST_CONFIGS

pytestmark = pytest.mark.slow

FP32 = (whole_model.TORCH_STATIC, whole_model.FUSED, whole_model.STATIC, whole_model.GENAI)


def bench_jobs(root, artifact_dir) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs."""
    config = root / "whole.json"
    config.write_text(TEST_CONFIGS["whole"].to_json())
    shutil.copytree(artifact_dir("whole"), root / "artifacts" / "whole" / "artifact")  # no import again
    argv = ["model", "--config", str(config), "--quick", "--threads", "1"]
    argv += ["--out", str(root / "results"), "--artifacts", str(root / "artifacts")]
    return {"model-whole": lambda: main(argv)}


def test_a_whole_model_generates_greedily_on_every_candidate_against_transformers(bench_runs):
    run = bench_runs["model-whole"]
    assert run.result() == 0
    out = run.root / "results"
    results = json.loads((out / "model_whole.json").read_text())
    assert (out / "model_whole.png").read_bytes().startswith(b"\x89PNG")
    assert not (out / "model.json").exists()  # the attention bench did not run: no preset named

    assert results["build"]["genai"]["used"], results["build"]["genai"]
    assert results["build"]["genai"]["version"].startswith("0.18")
    assert all(rung["passed"] for rung in results["build"]["parity"].values())
    plan = results["plan"]
    assert [row["batch"] for row in results["rows"]] == [1, 2] and plan["tokens"] == 8
    for row in results["rows"]:
        assert set(row["candidates"]) == set(whole_model.CANDIDATES)
        for name, entry in row["candidates"].items():
            assert entry["prefill"]["runs"] == 1 and entry["decode_step"]["runs"] == plan["tokens"] - 1, name
            assert 0 < entry["decode_step"]["median_ms"] <= entry["decode_step"]["p90_ms"], name
            assert entry["floor_ms"] > 0 and entry["greedy"]["of"] == row["batch"] * plan["tokens"]
        for name in FP32:  # fp32 logits within 1e-5 of their scale: the same greedy tokens
            assert row["candidates"][name]["greedy"]["agree_before_first_difference"] == plan["tokens"], name
    assert set(results["targets"]) == {
        "static_vs_genai_decode_B1",
        "static_vs_genai_decode_B2",
        "int8w_vs_fused_decode_B1",
        "static_int8w_vs_genai_decode_B1",
    }
    assert "greedy = torch" in run.stdout and "targets:" in run.stdout
