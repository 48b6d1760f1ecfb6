"""Generation on the server (a whole model's `sessions` model: its engine core), through the client's
gRPC stream, against the session's whole-model Triton (tests/fixtures/triton.py `whole_triton`): greedy
tokens are the PyTorch original's, a session keeps its text and goes on from it, a seeded sample repeats,
forks share a prompt, stopping early leaves the session exactly where the client saw it, the row's end and
bad parameters answer clearly. transformers' own `generate` is the oracle in tests/export/test_hf_families.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from client import AsyncClient, Client, InvalidInputError
from contract import generation
from export.artifacts import load_model
from tests.conftest import TEST_CONFIGS
from tests.fixtures.triton import WHOLE_ARTIFACT

pytestmark = pytest.mark.served


@pytest.fixture(scope="module")
def whole(artifact_dir, whole_triton):
    """(a client of the whole-model Triton, the PyTorch original)."""
    with Client(whole_triton.grpc_url) as client:
        yield client, load_model(artifact_dir(WHOLE_ARTIFACT)).eval()


def prompt(seed: int, length: int = 6) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, length, dtype=np.int64)


def assert_greedy(model, ids: np.ndarray, tokens: list[int]) -> None:
    """Each generated token is the original's greedy pick after everything before it (within fp32's rounding
    of the logits' scale, so that a near tie may go either way)."""
    sequence = torch.from_numpy(np.concatenate([ids, tokens]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(sequence).output[0].numpy()  # (L, vocab)
    for i, token in enumerate(tokens):
        row = logits[len(ids) + i - 1]
        assert row[token] >= row.max() - 1e-5 * np.abs(logits).max(), f"token {i}: {token} is not the greedy pick"


def test_greedy_tokens_are_the_originals_and_the_session_goes_on_from_them(whole):
    client, model = whole
    ids = prompt(0)
    with client.session() as session:
        first = session.generate(ids, max_new_tokens=6)
        tokens = list(first)
        assert first.finish_reason == generation.LENGTH and len(tokens) == 6
        assert session.length == first.held_length == len(ids) + 6
        more = session.generate(max_new_tokens=5)  # no ids: on from what the session holds
        tokens += list(more)
        assert more.held_length == len(ids) + 11
        logits = session.step(np.array([[tokens[-1]]]))  # the session holds the prompt and every token
    assert_greedy(model, ids, tokens)
    with torch.no_grad():
        expected = model(torch.from_numpy(np.concatenate([ids, tokens, [tokens[-1]]]))[None]).output.numpy()
    np.testing.assert_allclose(logits[0, -1], expected[0, -1], atol=1e-5 * np.abs(expected).max(), rtol=0)
    with client.session() as again:  # the same 11 tokens in one generation
        assert list(again.generate(ids, max_new_tokens=11)) == tokens


def test_a_seeded_sample_repeats_and_logprobs_come_with_it(whole):
    client, _ = whole
    ids = prompt(1)
    sampling = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 7, "logprobs": 3}
    first = client.generate(ids, max_new_tokens=10, **sampling)
    tokens = list(first)
    assert tokens == list(client.generate(ids, max_new_tokens=10, **sampling))
    assert tokens != list(client.generate(ids, max_new_tokens=10, **(sampling | {"seed": 8})))
    for token in first.logprobs:
        assert token.logprob <= 0 and len(token.top) == 3
        assert [logprob for _, logprob in token.top] == sorted((logprob for _, logprob in token.top), reverse=True)


def test_forks_share_a_prompt_and_sample_as_stateless_calls_do(whole):
    """n samples of one prompt: the prompt stepped once, forked n times; each fork generates from the
    prompt's last token what a stateless generation of the whole prompt does with the same seed."""
    client, _ = whole
    ids = prompt(2)
    with client.session() as parent:
        parent.step(ids[None, :-1])
        for seed in (1, 2):
            with parent.fork() as child:
                sampled = list(child.generate(ids[-1:], max_new_tokens=6, temperature=1.0, seed=seed))
            assert sampled == list(client.generate(ids, max_new_tokens=6, temperature=1.0, seed=seed))
        assert parent.length == len(ids) - 1  # the forks' tokens are theirs alone


def test_leaving_the_loop_stops_the_server_where_the_client_stands(whole):
    client, model = whole
    ids = prompt(3)
    with client.session() as session:
        generated = session.generate(ids, max_new_tokens=40)
        for i, _ in enumerate(generated):
            if i == 2:
                break
        kept = len(generated.tokens)  # the stop may come after the last token (tests/serving/test_core.py: exactly)
        assert generated.finish_reason == (generation.CANCELLED if kept < 40 else generation.LENGTH)
        assert kept >= 3 and session.length == generated.held_length == len(ids) + kept
        session.step(np.array([[5]]))
        assert session.length == len(ids) + kept + 1  # the server's own count, answered by the step
        assert_greedy(model, ids, generated.tokens)


def test_a_fork_a_stranger_and_a_restored_snapshot_go_on_without_ids_as_the_parent_does(whole):
    """The server knows the ids a session holds (a whole model's), so a generation without new ids goes on from
    the session's last token wherever it was generated: in a fork, through a client that resumed the session
    by id (it never saw its tokens), and in a session restored from a snapshot (which carries the ids)."""
    client, _ = whole
    with client.session() as parent:
        list(parent.generate(prompt(4), max_new_tokens=3))
        blob = parent.snapshot()
        with parent.fork() as child, client.session(restore=blob) as restored:
            stranger = client.session(child.id, replica="")  # not closed: it would end the child
            resumed = list(stranger.generate(max_new_tokens=4))
            child.rewind(child.length)  # what the stranger generated, undone (this client saw none of it)
            expected = list(parent.generate(max_new_tokens=4))
            assert resumed == expected
            assert list(child.generate(max_new_tokens=4)) == expected
            assert list(restored.generate(max_new_tokens=4)) == expected


def test_a_session_whose_ids_the_server_does_not_know_is_asked_for_one(whole):
    """A restored snapshot made without the ids (a blob of an older server) cannot go on without one: the
    answer says what to send."""
    from serving.engine import snapshots

    client, _ = whole
    with client.session() as parent:
        list(parent.generate(prompt(7), max_new_tokens=2))
        blob = parent.snapshot()
    tensors, metadata = snapshots_parts(blob)
    metadata.pop("token_ids")
    import safetensors.numpy

    bare = safetensors.numpy.save(tensors, metadata=metadata)
    assert snapshots.token_ids([bare]) is None
    with client.session(restore=bare) as restored:
        with pytest.raises(InvalidInputError, match="send at least one"):
            list(restored.generate(max_new_tokens=2))
        assert len(list(restored.generate([5], max_new_tokens=2))) == 2


def snapshots_parts(blob: bytes) -> tuple[dict, dict]:
    import json
    import struct

    import safetensors.numpy

    (size,) = struct.unpack("<Q", blob[:8])
    return safetensors.numpy.load(blob), json.loads(blob[8 : 8 + size])["__metadata__"]


def test_the_rows_end_and_bad_parameters_answer_clearly(whole):
    client, model = whole
    ids = prompt(5, length=model.cfg.max_seq_len - 3)
    full = client.generate(ids, max_new_tokens=10)
    assert len(list(full)) == 3 and full.finish_reason == generation.SESSION_FULL
    with pytest.raises(InvalidInputError, match="temperature"):
        client.generate(ids, temperature=-1.0)
    with pytest.raises(InvalidInputError, match="input_ids"):
        client.generate([0, TEST_CONFIGS["whole"].vocab_size])  # outside the vocabulary
    with pytest.raises(TypeError, match="unknown generation arguments"):
        client.generate(ids, top_q=0.5)


def test_the_asyncio_client_generates_the_same(whole, whole_triton):
    client, _ = whole
    ids = prompt(6)
    expected = list(client.generate(ids, max_new_tokens=5))

    async def generate() -> list[int]:
        async with AsyncClient(whole_triton.grpc_url) as aio, aio.session() as session:
            tokens = [token async for token in session.generate(ids, max_new_tokens=5)]
            left = session.generate(max_new_tokens=30)
            async for _ in left:
                break
            await left.aclose()  # the server stops, and says where the session stands
            # the server may finish all 30 before the stop reaches it (the engine core decodes this model's token
            # in a fraction of a millisecond): either way the session holds exactly what was answered
            stopped = left.finish_reason == generation.CANCELLED
            assert stopped or (left.finish_reason == generation.LENGTH and len(left.tokens) == 30)
            assert session.length == left.held_length == len(ids) + 5 + len(left.tokens)
            return tokens

    assert asyncio.run(generate()) == expected


def test_concurrent_generations_share_graph_runs_and_plain_steps_go_on_beside_them(whole, whole_triton):
    """Four sessions generating at once and a fifth stepping plainly: every generation gives its solo
    tokens, the plain steps their solo logits, and the engine core ran several sessions' tokens in one decode
    graph run (its `attention_engine_most_decode_rows` gauge)."""
    import concurrent.futures

    from tests.fixtures.triton import metric_reaches

    client, _ = whole
    prompts = [prompt(20 + k) for k in range(4)]
    solo = [list(client.generate(ids, max_new_tokens=24)) for ids in prompts]
    plain = prompt(30, length=12)
    with client.session() as alone:
        expected_plain = [alone.step(plain[None, t : t + 1]) for t in range(12)]

    def stepped() -> list[np.ndarray]:
        with client.session() as session:
            return [session.step(plain[None, t : t + 1]) for t in range(12)]

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        generated = [pool.submit(lambda ids=ids: list(client.generate(ids, max_new_tokens=24))) for ids in prompts]
        beside = pool.submit(stepped)
        assert [future.result() for future in generated] == solo
        for actual, expected in zip(beside.result(), expected_plain, strict=True):
            np.testing.assert_allclose(actual, expected, atol=1e-5 * np.abs(expected).max(), rtol=0)
    assert metric_reaches(whole_triton, "attention_engine_most_decode_rows", "sessions", 2)


def test_a_session_the_server_forgot_is_lost_in_our_words_not_tritons(whole):
    """A session resumed from another process (a gateway restarted with its signed id, no store here to
    rebuild it from) whose server no longer holds it: its generation says the session is lost and why."""
    from client import SessionLostError

    client, _ = whole
    held = client.session()
    list(held.generate(prompt(31), max_new_tokens=2))
    held.close()  # the server forgets it, as a restarted one has
    resumed = client.session(sequence_id=held.id, replica="")
    with pytest.raises(SessionLostError, match="the server held it and has forgotten it") as lost:
        list(resumed.generate(max_new_tokens=2))
    assert "START flag" in str(lost.value)  # Triton's words follow ours, for the logs
