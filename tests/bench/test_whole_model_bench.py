"""`python -m bench model` of a whole model (token ids in, logits out) end to end, bounded: the session's
build of TEST_CONFIGS["whole"] (every form), its weights written as transformers' LlamaForCausalLM
checkpoint, a 16-token prompt and 8 greedy tokens at batches 1 and 2, one round, onnxruntime-genai
included (its venv made once, `.venv-genai`, if missing). Timings are not asserted (a smoke test); the
greedy tokens are: the fp32 forms and onnxruntime-genai choose transformers' tokens."""

import shutil

import pytest

from bench import whole_model
from bench.__main__ import main
from tests.conftest import TEST_CONFIGS

pytestmark = pytest.mark.slow

FP32 = (whole_model.TORCH_STATIC, whole_model.FUSED, whole_model.STATIC, whole_model.GENAI)


# onnxruntime-genai's builder runs in a process of its own (bench/whole_model.py's build_genai): its run uses
# no torch here, so it builds while the session's builds export (conftest.py)
TORCH_FREE_RUNS = ("whole-genai",)


def bench_jobs(root, artifact_dir, finished) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs. The folder the run prepares
    (bench/whole_model.py's `prepare`: the checkpoint, our artifact, onnxruntime-genai's model) is prepared
    by the same `prepare` ahead of it: the checkpoint here, onnxruntime-genai's model by the "whole-genai"
    run, which the generate run copies too (test_generate_bench.py); the model-whole run waits for it and
    finds every part there."""
    config = root / "whole.json"
    config.write_text(TEST_CONFIGS["whole"].to_json())
    folder = root / "artifacts" / "whole"
    shutil.copytree(artifact_dir("whole"), folder / "artifact")  # no import again
    whole_model.checkpoint_from_artifact(folder / "artifact", folder / "checkpoint")  # torch: here, not in a run
    argv = ["model", "--config", str(config), "--quick", "--threads", "1"]
    argv += ["--out", str(root / "results"), "--artifacts", str(root / "artifacts")]

    def model_whole() -> int:
        finished("whole-genai")  # built (or failed: then the run builds it and says why not)
        return main(argv)

    return {
        "whole-genai": lambda: whole_model.prepare(TEST_CONFIGS["whole"], folder, seed=0, genai=True),
        "model-whole": model_whole,
    }


def test_a_whole_model_generates_greedily_on_every_candidate_against_transformers(bench_runs):
    assert bench_runs["whole-genai"].result()["genai"]["used"]  # the model the run found built
    run = bench_runs["model-whole"]
    out, results = run.written("model_whole")
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
        "static_int4w_vs_genai_int4_decode_B1",
        "static_int4w_vs_genai_int4_decode_B2",
        "static_int4w_vs_static_int8w_decode_B1",
    }
    assert "greedy = torch" in run.stdout and "targets:" in run.stdout
