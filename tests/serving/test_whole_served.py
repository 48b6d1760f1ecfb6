"""Whole models served: token ids in, logits out, through a real Triton and the client library.

A Triton per whole config of tests/conftest.py: Llama's block (`whole`) on the session's whole-model Triton,
GPT-2's (`whole-gpt2`) on one of its own. Against the PyTorch original (export.artifacts.load_model):

- a session over a left-padded prefill and 16 greedy decode steps: the logits within 1e-5 of their scale
  and the same greedy token at every step;
- stateless calls sending the cache back: likewise;
- snapshot and restore, fork, rewind and a named prefix on a whole model's session: each continues as
  the original does over its own tokens;
- ids outside the vocabulary, or not int64, are refused naming `input_ids`, and the server keeps serving.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from client import Client
from client.errors import InvalidInputError
from contract import names
from export.artifacts import load_model
from serving.triton.config import ServingSettings
from serving.triton.repository import write_repository
from tests.fixtures.triton import WHOLE_ARTIFACT, selected, started_together
from tests.serving.helpers import Client as Triton

pytestmark = pytest.mark.served

CONFIGS = ("whole", "whole-gpt2")
PADDING, PROMPT, STEPS = 3, 6, 16  # a prefill of PROMPT real ids after PADDING padded ones
# fp32 through ONNX Runtime against the PyTorch original: float rounding only (docs/design.md, parity)
RELATIVE = 1e-5
SETTINGS = ServingSettings(threads=1, kv_cache_bytes=16 << 20, max_batch_size=4)


@pytest.fixture(scope="module")
def servers(request, artifact_dir, tmp_path_factory):
    """config name -> (a Future of its Triton, its PyTorch original) for the configs this run's tests take:
    `whole` on the session's whole-model Triton (tests/fixtures/triton.py), `whole-gpt2` on one of its own."""
    with started_together() as start:
        made = {}
        for name in (name for name in CONFIGS if name in selected(request, "name")):
            artifact = artifact_dir(name)
            if name == WHOLE_ARTIFACT:
                server = concurrent.futures.Future()
                server.set_result(request.getfixturevalue("whole_triton"))
            else:
                work = tmp_path_factory.mktemp(f"served-{name}")
                repository = write_repository(artifact, work / "repository", SETTINGS, models=("forward", "sessions"))
                server = start(repository, log_path=work / "triton.log")
            made[name] = server, load_model(artifact).eval()
        yield made


@pytest.fixture(scope="module", params=CONFIGS)
def name(request):
    return request.param


@pytest.fixture(scope="module")
def served(servers, name):
    """(the Triton serving the whole model `name`, its PyTorch original)."""
    server, model = servers[name]
    return server.result(), model


def prompt(model, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A left-padded prompt (1, PADDING + PROMPT) of random ids (the padded ones too) and its mask."""
    ids = np.random.default_rng(seed).integers(0, model.cfg.vocab_size, (1, PADDING + PROMPT), dtype=np.int64)
    mask = np.concatenate([np.zeros((1, PADDING), np.int64), np.ones((1, PROMPT), np.int64)], axis=1)
    return ids, mask


@torch.no_grad()
def greedy(model, ids: np.ndarray, mask: np.ndarray, steps: int = STEPS) -> tuple[np.ndarray, np.ndarray]:
    """The PyTorch original over the prompt then `steps` greedy tokens, one at a time with its cache:
    (the real positions' logits (1, PROMPT + steps, vocab), the greedy tokens (steps,))."""
    out = model(torch.from_numpy(ids), torch.from_numpy(mask))
    real = mask[0].astype(bool)
    logits, past, tokens = [out.output.numpy()[:, real]], out.present, []
    for _ in range(steps):
        tokens.append(int(logits[-1][0, -1].argmax()))
        mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
        out = model(torch.tensor([[tokens[-1]]]), torch.from_numpy(mask), past)
        logits.append(out.output.numpy())
        past = out.present
    return np.concatenate(logits, axis=1), np.array(tokens)


def assert_close(served: np.ndarray, expected: np.ndarray, what: str) -> None:
    scale = float(np.abs(expected).max())
    error = float(np.abs(served - expected).max())
    print(f"{what}: max abs error {error:.2e} of scale {scale:.2f}")
    assert error <= RELATIVE * scale, f"{what}: {error:.3e} > {RELATIVE} x {scale:.3f}"


def test_a_session_over_a_left_padded_prefill_and_greedy_steps_equals_the_original(served, name):
    server, model = served
    ids, mask = prompt(model, seed=1)
    expected, expected_tokens = greedy(model, ids, mask)
    with Client(server.grpc_url) as client, client.session() as session:
        first = session.step(ids, mask)  # (1, PADDING + PROMPT, vocab): padded queries answer zeros
        assert first.shape == (1, PADDING + PROMPT, model.cfg.vocab_size) and first.dtype == np.float32
        assert not first[:, :PADDING].any()
        logits, tokens = [first[:, PADDING:]], []
        for _ in range(STEPS):
            tokens.append(int(logits[-1][0, -1].argmax()))  # the served logits choose the next token
            logits.append(session.step(np.array([[tokens[-1]]], np.int64)))
        assert session.length == PROMPT + STEPS
    np.testing.assert_array_equal(tokens, expected_tokens)
    assert_close(np.concatenate(logits, axis=1), expected, f"{name}: session, prefill {PROMPT} + {STEPS} steps")


def test_stateless_calls_sending_the_cache_back_equal_the_original(served, name):
    server, model = served
    ids, mask = prompt(model, seed=2)
    expected, expected_tokens = greedy(model, ids, mask)
    with Client(server.http_url, "http") as client:
        result = client.infer(ids, mask)
        logits, tokens = [result.output[:, PADDING:]], []
        for _ in range(STEPS):
            tokens.append(int(logits[-1][0, -1].argmax()))
            mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
            result = client.infer(np.array([[tokens[-1]]], np.int64), mask, past=result.present)
            logits.append(result.output)
    np.testing.assert_array_equal(tokens, expected_tokens)
    assert_close(np.concatenate(logits, axis=1), expected, f"{name}: stateless, prefill {PROMPT} + {STEPS} steps")


def ids_of(model, seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.cfg.vocab_size, (1, count), dtype=np.int64)


@torch.no_grad()
def forward(model, ids: np.ndarray) -> np.ndarray:
    """The original's logits over a whole unpadded sequence (1, T, vocab)."""
    return model(torch.from_numpy(ids)).output.numpy()


def test_session_operations_on_a_whole_model_equal_the_original(served, name):
    server, model = served
    trunk, left, right = ids_of(model, 10, 5), ids_of(model, 11, 3), ids_of(model, 12, 3)
    with Client(server.grpc_url) as client, client.session() as session:
        session.step(trunk)
        blob = session.snapshot()
        with session.fork() as branch:
            ours_left, ours_right = session.step(left), branch.step(right)
        with client.session(restore=blob) as restored:
            ours_restored = restored.step(right)
        assert session.rewind(5) == 5  # drops `left`: the next step continues after the trunk
        ours_rewound = session.step(right)
        client.put_prefix(f"trunk-{name}", trunk)
        with client.session(prefix=f"trunk-{name}") as from_prefix:
            ours_prefixed = from_prefix.step(right)
        client.delete_prefix(f"trunk-{name}")
    expected_left = forward(model, np.concatenate([trunk, left], axis=1))[:, 5:]
    expected_right = forward(model, np.concatenate([trunk, right], axis=1))[:, 5:]
    assert_close(ours_left, expected_left, f"{name}: the forked trunk")
    for ours, what in [
        (ours_right, "fork"),
        (ours_restored, "restore"),
        (ours_rewound, "rewind"),
        (ours_prefixed, "prefix"),
    ]:
        assert_close(ours, expected_right, f"{name}: {what}")


def step_once(client, tokens: np.ndarray) -> np.ndarray:
    with client.session() as session:
        return session.step(tokens)


def test_bad_ids_are_refused_naming_the_input_and_the_server_keeps_serving(served, name):
    server, model = served
    vocab = model.cfg.vocab_size
    ids = ids_of(model, 20, 4)
    outside = [np.array([[1, vocab]], np.int64), np.array([[-1]], np.int64)]
    with Client(server.grpc_url, validate=False) as unchecked, Client(server.grpc_url) as checked:
        for client, bad in [(unchecked, outside[0]), (unchecked, outside[1]), (checked, outside[0])]:
            for call in (client.infer, lambda tokens, client=client: step_once(client, tokens)):
                with pytest.raises(InvalidInputError, match=rf"input_ids.*token ids must lie in \[0, {vocab}\)"):
                    call(bad)
        with pytest.raises(InvalidInputError, match=r"input_ids.*expected dtype int64, got float32") as caught:
            checked.infer(ids.astype(np.float32))
        assert caught.value.status is None  # refused before sending
        with Triton(server, "grpc") as raw, pytest.raises(InferenceServerException, match="input_ids"):
            raw.infer(names.MODEL, {names.INPUT_IDS: ids.astype(np.float32)})  # Triton's own check of the type
        assert_close(unchecked.infer(ids).output, forward(model, ids), f"{name}: after refusals, stateless")
        with unchecked.session() as session:
            assert_close(session.step(ids), forward(model, ids), f"{name}: after refusals, a session")
