"""`python -m bench structured` end to end, bounded: the session's `whole` artifact (its fp32-static graph and
byte-level tokenizer, 64 positions) in place of the trained model, a small schema whose answers fit the
positions, 32 tokens at most, 1 and 16 generations at once, two rounds. Timings are not asserted (a smoke test);
what they are made of is: both candidates at each concurrency, every constrained answer parsed and valid, the
grammar's stop ending each, masks timed on the constrained steps only, and the ratios and the goal computed
from the numbers measured."""

import json

import numpy as np
import pytest

from bench import structured
from bench.__main__ import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
# its run is ONNX Runtime and llguidance in this process: no torch (conftest.py)
TORCH_FREE_RUNS = ("structured",)
COUNTS, ROUNDS, TOKENS, REPEATS = (1, 16), 2, 32, 3
# `{"age": 120, "tag": "a"}` at most: a byte-level tokenizer's 24 ids or fewer, within 64 positions after the
# prompt's 13 (the default schema's string of 12 characters can take 4 bytes a character on random weights)
SCHEMA = {
    "type": "object",
    "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}, "tag": {"enum": ["a", "b", "c"]}},
    "required": ["age", "tag"],
}


def bench_jobs(root, artifact_dir) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs."""
    (root / "schema.json").write_text(json.dumps(SCHEMA))
    argv = ["structured", "--artifact", str(artifact_dir("whole")), "--schema", str(root / "schema.json")]
    argv += ["--tokens", str(TOKENS), "--concurrency", ",".join(map(str, COUNTS)), "--rounds", str(ROUNDS)]
    argv += ["--compile-repeats", str(REPEATS), "--threads", "1", "--out", str(root / "results")]
    return {"structured": lambda: main(argv)}


def test_both_candidates_measured_every_answer_valid_and_the_ratios_from_the_numbers(bench_runs):
    run = bench_runs["structured"]
    _, results = run.written("structured")
    assert results["schema"] == SCHEMA and results["model"]["end_ids"] == [2]
    assert [row["concurrency"] for row in results["rows"]] == list(COUNTS)

    for row in results["rows"]:
        count, candidates = row["concurrency"], row["candidates"]
        assert set(candidates) == set(structured.CANDIDATES)
        for name, entry in candidates.items():
            assert len(entry["tokens_per_s_rounds"]) == ROUNDS, name
            assert entry["tokens_per_s"] == pytest.approx(np.median(entry["tokens_per_s_rounds"])), name
            assert 1 <= entry["tokens_per_generation"] <= TOKENS and 1 <= entry["rows_per_step"] <= count, name
            assert sum(entry["finish_reasons"].values()) == count * ROUNDS, name
            assert entry["graph_ms"]["p50"] > 0, name
        free, bound = candidates[structured.UNCONSTRAINED], candidates[structured.CONSTRAINED]
        answers = bound["answers"]
        assert answers["answers"] == answers["parsed"] == answers["valid"] == count * ROUNDS, answers
        assert answers["refused"] == [] and set(json.loads(answers["example"])) == {"age", "tag"}
        assert bound["finish_reasons"] == {"stop": count * ROUNDS}  # the grammar ended each, not the budget
        # masks were filled for the constrained steps, and only for them
        assert free["mask_fill_ms"] is None and free["mask_wait_ms"] is None
        assert bound["mask_fill_ms"]["steps"] == bound["mask_wait_ms"]["steps"] > 0
        assert 0 < bound["mask_fill_ms"]["p50"] <= bound["mask_fill_ms"]["p99"]
        assert row["ratio"] == pytest.approx(bound["tokens_per_s"] / free["tokens_per_s"])
        if row["full_batch_ratio"] is not None:
            full = free["full_step_ms"]["p50"] / bound["full_step_ms"]["p50"]
            assert row["full_batch_ratio"] == pytest.approx(full)
    assert results["rows"][0]["full_batch_ratio"] is not None  # one generation: every step is a full batch

    at_16 = results["rows"][1]["ratio"]
    goal = results["targets"]["constrained_vs_unconstrained_C16"]
    assert goal["ratio"] == at_16 and goal["met"] == (at_16 >= structured.GOAL_RATIO)

    compiled = results["compile"]
    assert set(compiled["schemas"]) == {"bench", "any object"}
    assert all(timing["runs"] == REPEATS and timing["median_ms"] > 0 for timing in compiled["schemas"].values())
    assert compiled["first_compile_ms"] >= compiled["tokenizer_ms"] >= 0

    printed = run.stdout
    assert "parsed/valid/of" in printed and "compile: a fresh compiler's first" in printed
    assert "constrained_vs_unconstrained_C16" in printed and ("-> met" in printed or "-> MISSED" in printed)
