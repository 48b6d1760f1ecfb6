"""`python -m bench generate` end to end, bounded: the session's build of TEST_CONFIGS["whole"] (its weights
written as transformers' checkpoint, not imported again), a 16-token prompt and 8 greedy tokens at 1 and 4
generations at once, one round, every candidate but the server peers (built outside the suite): Triton's
`sessions` through the client (and another Triton's on the 4-bit weights), the gateway's `POST /v1/generate`
as Server-Sent Events and its `POST /v1/completions`, the same engine core in-process, onnxruntime-genai (fp32 and
int4) and transformers; then a 36-id joiner among 4 streams and 2 s of idle CPU. Timings are not asserted (a smoke
test); the tokens are: fp32 everywhere, each candidate answers exactly transformers' greedy tokens, but the 4-bit
weights' (counted, not required to agree). And a gateway without the route: the candidate is left out, the
reason said."""

import contextlib
import http.server
import re
import shutil
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from bench import generate
from bench.__main__ import main
from tests.conftest import TEST_CONFIGS

# a gap per token of each
STREAMED = (generate.SERVED, generate.SERVED_INT4, generate.GATEWAY, generate.OPENAI, generate.IN_PROCESS)
BATCHED = (generate.GENAI, generate.GENAI_INT4, generate.TORCH)  # a gap per decode step of the one batch


def bench_jobs(root, artifact_dir, finished) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs. onnxruntime-genai's model of this
    checkpoint is the "whole-genai" run's where that run is in the session (test_whole_model_bench.py: its
    builder takes seconds): the run waits for it, and builds its own otherwise."""
    config = root / "whole.json"
    config.write_text(TEST_CONFIGS["whole"].to_json())
    work = root / "work"
    shutil.copytree(artifact_dir("whole"), work / "whole" / "artifact")  # no import again
    argv = ["generate", "--config", str(config), "--quick", "--threads", "1", "--no-server-peers"]

    def run() -> int:
        built = finished("whole-genai")
        facts = built.value["genai"] if built and built.error is None else {}
        if facts.get("used"):  # bench/whole_model.py's prepare keeps them
            shutil.copytree(facts["model"], work / "whole" / "genai")
            shutil.copytree(facts["models"][generate.GENAI_INT4], work / "whole" / "genai-int4")
        return main([*argv, "--out", str(root / "results"), "--work", str(work)])

    return {"generate": run}


@pytest.mark.served
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_candidate_generates_transformers_greedy_tokens_and_is_measured(bench_runs):
    run = bench_runs["generate"]
    _, results = run.written("generate")
    assert results["skipped"] == {}  # the gateway's route answered
    assert results["build"]["genai"]["used"], results["build"]["genai"]
    assert re.fullmatch(r"[0-9a-f]{7,}", results["measured_at"]["commit"])

    plan = results["plan"]
    assert [row["concurrency"] for row in results["rows"]] == [1, 4] and plan["tokens"] == 8
    for row in results["rows"]:
        count = row["concurrency"]
        assert set(row["candidates"]) == set(STREAMED + BATCHED)
        for name, entry in row["candidates"].items():
            steps = count * (plan["tokens"] - 1) if name in STREAMED else plan["tokens"] - 1
            assert entry["ttft_ms"]["generations"] == count and entry["itl_ms"]["gaps"] == steps, name
            assert entry["tokens_per_s"] > 0 and entry["ttft_ms"]["p50"] > 0, name
            assert 0 < entry["itl_ms"]["p50"] <= entry["itl_ms"]["p99"], name
            greedy = entry["greedy"]
            if name == generate.OPENAI:  # it streams text: its ids are not checked here
                assert greedy is None
                continue
            assert greedy["of"] == count * plan["tokens"], name
            if name in generate.INT4_CANDIDATES:  # 4-bit weights: reported, not required to agree
                assert 0 <= greedy["agree_before_first_difference"] <= plan["tokens"], (name, greedy)
                continue
            assert greedy["agree_before_first_difference"] == plan["tokens"], (name, greedy)
    # (the OpenAI route runs the generation /v1/generate runs, whose ids are checked above)
    joiner = results["joiner"]
    assert joiner["running"] == 4 and joiner["joiner_ids"] == 36 and joiner["gaps"]["during"] > 0, joiner
    assert joiner["chunk_ms"] > 0 and len(joiner["joiner_ttft_ms"]) == 1
    idle = results["idle"]["ours (Triton and its stubs, the gateway)"]
    assert idle["seconds"] == 2 and idle["cpu_s"] >= 0
    assert set(results["targets"]) == {
        "served_vs_in_process_C1",
        "served_C4_vs_C1",
        f"served_vs_{generate.GENAI}_C1",
        f"served_int4w_vs_{generate.GENAI_INT4}_C1",
        "joiner_raises_p99_itl_by_at_most_a_chunk",
        "idle_cpu_under_1_percent",
    }
    assert results["targets"]["served_C4_vs_C1"]["prefill_ceiling"] > 1
    assert "greedy = transformers" in run.stdout and "goals:" in run.stdout and "joiner: 36 ids" in run.stdout


class NoRoutes(http.server.BaseHTTPRequestHandler):
    """A gateway that has not got `POST /v1/generate` (yet): every path answers 404."""

    def do_POST(self) -> None:
        body = b'{"error": {"code": "not_found", "message": "Not Found"}}'
        self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serving(handler) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_gateway_without_the_route_is_left_out_with_the_reason():
    plan = generate.Plan(prompt=4, tokens=2, concurrency=(1, 2), rounds=1)
    prompts = {count: np.zeros((count, plan.prompt), np.int64) for count in plan.concurrency}
    with serving(NoRoutes) as url, httpx.Client(timeout=10) as client:
        candidates = {generate.GATEWAY: generate.gateway_candidate(client, url)}
        measured, skipped = generate.measure_all(candidates, prompts, plan)
    assert measured == {} and list(skipped) == [generate.GATEWAY]
    assert f"the gateway at {url} answers POST /v1/generate with 404" in skipped[generate.GATEWAY]


def test_a_concurrency_a_candidate_cannot_run_is_left_out_with_the_reason_and_the_others_measured():
    plan = generate.Plan(prompt=4, tokens=2, concurrency=(1, 2), rounds=2)
    prompts = {count: np.zeros((count, plan.prompt), np.int64) for count in plan.concurrency}

    def one_at_a_time(batch: np.ndarray, tokens: int) -> generate.Generated:
        if len(batch) > 1:
            raise generate.Unmeasurable(f"takes batches of 1, not {len(batch)}")
        return generate.batched(np.zeros((1, tokens), np.int64), 1.0, [1.0] * (tokens - 1), 0.01)

    measured, skipped = generate.measure_all({"peer": one_at_a_time}, prompts, plan)
    assert list(measured) == [("peer", 1)] and len(measured["peer", 1]) == 2
    assert skipped == {"peer at 2": "takes batches of 1, not 2"}
