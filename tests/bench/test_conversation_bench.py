"""`python -m bench conversation --quick` end to end: its own checkpoint (a 512-position Llama of random weights
beside a byte-level BPE tokenizer and Llama 3's chat template) imported by `python -m export build`, Triton and
the gateway serving it, conversations of about 128 and 384 tokens through the openai SDK, one round. Timings
are not asserted (a smoke test); what the requests answered is: a conversation's first request forks nothing,
its next turn reuses every id of the first's prompt, every reply has text. And, without servers: the openings
render to the length asked, the build's stage times are read from its progress lines, a plan that does not
fit the model is refused."""

import contextlib
import io
import json
import re
import time

import pytest

from bench import conversation
from bench.__main__ import main


def bench_jobs(root, artifact_dir) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs. Its own build (the session's whole
    model holds 64 positions, too few for these conversations), made as the bench's `prepare` makes it, ahead
    of the run on the setup thread with the session's builds: the checkpoint, then the documented import in
    this process, where torch's exporter is warm (in a process of its own it paid ~25 s of CPU starting it);
    the run then finds it built."""
    plan = conversation.Plan.quick()
    folder = root / "work" / plan.shape.name
    conversation.make_checkpoint(folder / "checkpoint", plan.shape, plan.seed)
    imported_here(folder)
    argv = ["conversation", "--quick", "--threads", "1", "--out", str(root / "results"), "--work", str(root / "work")]
    return {"conversation": lambda: main(argv)}


def imported_here(folder) -> None:
    """`python -m export build --weights CHECKPOINT --layout hf ...` through its `main`, its progress lines kept
    and its time recorded as the bench's own import records them (bench/conversation.py `prepare`)."""
    from export.__main__ import main as export_main

    checkpoint, artifact = folder / "checkpoint", folder / "artifact"
    log = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stderr(log):  # the progress lines; the variants' table goes to the test's output
        code = export_main(conversation.import_command(checkpoint, artifact)[3:])
    seconds = time.perf_counter() - started
    assert code == 0, log.getvalue()[-3000:]
    (folder / "build.log").write_text(log.getvalue())
    record = {"seconds": seconds, "stages_s": conversation.stage_seconds(log.getvalue())}
    (folder / "build.json").write_text(json.dumps(record, indent=2) + "\n")


@pytest.mark.served
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_next_turn_reuses_its_first_request_and_every_reply_has_text(bench_runs):
    run = bench_runs["conversation"]
    _, results = run.written("conversation")
    assert re.fullmatch(r"[0-9a-f]{7,}", results["measured_at"]["commit"])

    build = results["build"]
    assert build["reused"] and build["import"]["seconds"] > 0  # imported ahead of the run, timed
    assert all(form["passed"] for form in build["variants"].values()), build["variants"]
    assert set(build["import"]["stages_s"]) == set(conversation.VARIANTS)
    assert results["model"]["max_seq_len"] == 512 == results["serving"]["max_seq_len"]

    answer = results["plan"]["answer"]
    assert [row["length"] for row in results["rows"]] == [128, 384]
    for row in results["rows"]:
        cold, warm, length = row["cold"], row["warm"], row["length"]
        assert cold["cached_tokens"] == [0], row  # a key of its own: nothing kept to fork
        assert length - 8 <= cold["prompt_tokens"][0] <= length, row
        # the next turn forked the first request's session: its whole prompt reused, the turn's own ids prefilled
        assert cold["prompt_tokens"][0] <= warm["cached_tokens"][0] < warm["prompt_tokens"][0], row
        assert cold["completion_tokens"] == warm["completion_tokens"] == [answer]  # ignore_eos: never cut short
        assert all(text.strip() for text in cold["answers"] + warm["answers"]), row
        assert cold["ttft_ms"]["median"] > 0 and warm["ttft_ms"]["median"] > 0 and row["cold_over_warm"] > 0
        assert row["torch_prefill_ms"]["median"] > 0
    assert results["targets"] == {}  # the goal is at 4,000 tokens: not in a quick run
    assert "cold/warm" in run.stdout and "goal:" in run.stdout


def test_openings_render_to_the_length_asked_and_each_begins_afresh(tmp_path):
    from client.text import TextModel
    from tests.fixtures.text import save_tokenizer

    save_tokenizer(tmp_path, 512, template=conversation.TEMPLATE)
    text = TextModel.from_folder(tmp_path)
    openings = conversation.Openings(text, seed=0)
    beginnings = set()
    for length in (100, 300, 300):
        ids = text.chat_ids(openings.messages(length, "same label"), add_generation_prompt=True)
        assert length - 8 <= len(ids) <= length
        beginnings.add(text.decode(ids[:32]))
    assert len(beginnings) == 3, beginnings  # a fresh random first line each: no two share their beginning


def test_the_builds_stage_times_are_read_from_its_progress_lines():
    log = "\n".join(
        [
            "config and weights -> out ... done in 0.1 s",
            "fp32-fused: export ...",
            "fp32-fused: export ... done in 13.3 s",
            "fp32-fused: parity ... done in 0.2 s",
            "fp32-static: export ... done in 0.4 s",
            "fp32-static: parity ... done in 3.7 s",
            "fp16-fused: export ... done in 9.9 s",
        ]
    )
    assert conversation.stage_seconds(log) == {
        "fp32-fused": {"export": 13.3, "parity": 0.2},
        "fp32-static": {"export": 0.4, "parity": 3.7},
    }


def test_a_plan_longer_than_the_model_is_refused_naming_what_it_needs():
    plan = conversation.Plan.quick()
    too_long = conversation.Plan(lengths=(128, 500), rounds=1, answer=8, shape=plan.shape)
    with pytest.raises(conversation.BenchError, match=r"a 500-token conversation.* more than the model's 512"):
        conversation.checked(too_long)
    conversation.checked(plan)  # the quick plan fits its own model
