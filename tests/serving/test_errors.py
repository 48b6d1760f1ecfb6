"""The bad-input matrix of both models, the stateless one over HTTP and gRPC, the session model over gRPC streams
(the only way to a decoupled model) (part of the fault suite, docs/reliability.md):
a 4xx-class answer whose message names the input (or the sequence) and what was expected; then a
correct request gets the same output as before the error, so the server kept serving and no state
changed.

Triton core answers some of these itself before our model sees the request (wrong dtype, rank or
fixed size; a step for a sequence it does not know): those checks are part of the served contract
too. The cache budget and idle eviction are in test_cli_server.py, on a server with a small budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from contract import names
from contract.config import ModelConfig
from tests.serving.helpers import PROTOCOLS, SESSION_PROTOCOLS, new_sequence_id

INVALID = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}


def good_inputs(served_cfg: ModelConfig, past: int = 4, new: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    arrays = {
        names.HIDDEN_STATES: rng.standard_normal((1, new, served_cfg.d_model)).astype(np.float32),
        names.ATTENTION_MASK: np.ones((1, past + new), np.int64),
    }
    for name in names.past_names(served_cfg.n_layers):
        arrays[name] = rng.standard_normal((1, served_cfg.n_kv_heads, past, served_cfg.head_dim)).astype(np.float32)
    return arrays


@dataclasses.dataclass(frozen=True)
class Case:
    change: Callable[[dict, ModelConfig], dict]  # the good inputs -> the bad ones
    says: tuple[str, ...]  # what the message must contain


def _replace(name: str, make: Callable[[dict, ModelConfig], np.ndarray]) -> Callable[[dict, ModelConfig], dict]:
    return lambda arrays, served_cfg: {**arrays, name: make(arrays, served_cfg)}


def _drop(name: str) -> Callable[[dict, ModelConfig], dict]:
    return lambda arrays, served_cfg: {k: v for k, v in arrays.items() if k != name}


H, M, K0, V0 = names.HIDDEN_STATES, names.ATTENTION_MASK, names.past_name(0, "key"), names.past_name(0, "value")
STATELESS_CASES = {
    "wrong dtype": Case(_replace(H, lambda a, c: a[H].astype(np.float64)), (H, "FP64", "FP32")),
    "wrong rank": Case(_replace(H, lambda a, c: a[H][0]), (H, "[-1,-1,256]")),
    "wrong size": Case(_replace(H, lambda a, c: a[H][:, :, :255].copy()), (H, "[-1,-1,256]")),
    "mask dtype": Case(_replace(M, lambda a, c: a[M].astype(np.int32)), (M, "INT32", "INT64")),
    "cache heads": Case(_replace(K0, lambda a, c: a[K0][:, :3].copy()), (K0, "[-1,4,-1,32]")),
    "mask and past lengths disagree": Case(
        _replace(M, lambda a, c: np.ones((1, 6), np.int64)), (M, "past + new = 4 + 3 = 7", "got 6")
    ),
    "mask batch": Case(_replace(M, lambda a, c: np.ones((2, 7), np.int64)), (M, "batch_size", "2", "1")),
    "cache batch": Case(_replace(K0, lambda a, c: np.repeat(a[K0], 2, axis=0)), (K0, "batch_size", "2", "1")),
    "cache length": Case(_replace(K0, lambda a, c: a[K0][:, :, :3].copy()), ("past_sequence_length", "4", "3")),
    "half the past": Case(_drop(V0), (V0, "missing", "every past key and value")),
    "no hidden states": Case(_drop(H), (H, "missing")),
    "batch 0": Case(lambda a, c: {n: v[:0] for n, v in a.items()}, (H, "batch_size must be at least 1, got 0")),
    "NaN": Case(_replace(H, lambda a, c: _poke(a[H], np.nan)), (H, "finite", "nan at index [0, 1, 2]")),
    "Inf in the past": Case(_replace(V0, lambda a, c: _poke(a[V0], -np.inf)), (V0, "finite", "-inf at index")),
    "longer than max_seq_len": Case(
        lambda a, c: good_inputs(c, past=c.max_seq_len - 2, new=3),
        (H, "past + new = 2046 + 3 = 2049 positions", "max_seq_len 2048"),
    ),
    # the graphs read any nonzero value as "attend": a -1 meant as padding would be answered silently wrong
    "mask value 5": Case(_replace(M, lambda a, c: _mask_with(a[M], 5)), (M, "0 (padding) or 1", "5 at index [0, 2]")),
    "mask value -1": Case(_replace(M, lambda a, c: _mask_with(a[M], -1)), (M, "0 (padding) or 1", "got -1 at index")),
    "more tokens than a request may carry": Case(
        lambda a, c: _batched(good_inputs(c, past=0, new=1025), 2), (H, "2 x 1025 = 2050 tokens", "2048 per request")
    ),
}


def _poke(array: np.ndarray, value: float) -> np.ndarray:
    poked = array.copy()
    poked[(0,) * (array.ndim - 2) + (1, 2)] = value
    return poked


def _mask_with(mask: np.ndarray, value: int) -> np.ndarray:
    changed = mask.copy()
    changed[0, 2] = value
    return changed


def _batched(arrays: dict[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
    return {name: np.repeat(array, batch, axis=0) for name, array in arrays.items()}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", STATELESS_CASES)
def test_stateless_error_names_the_input_and_the_server_goes_on(clients, served_cfg, protocol, case):
    client, good = clients[protocol], good_inputs(served_cfg)
    before = client.infer("forward", good)
    with pytest.raises(InferenceServerException) as raised:
        client.infer("forward", STATELESS_CASES[case].change(good, served_cfg))
    assert raised.value.status() == INVALID[protocol], raised.value
    for fragment in STATELESS_CASES[case].says:
        assert fragment in raised.value.message(), raised.value.message()
    after = client.infer("forward", good)
    for name, array in before.items():
        np.testing.assert_array_equal(after[name], array)


# --- the stateful model ---------------------------------------------------------------------------

SESSION_CASES = {
    # (hidden (1, T, d) maker, mask maker or None, what the message says)
    "wrong dtype": (lambda d: np.ones((1, 2, d), np.float64), None, (H, "FP64", "FP32")),
    "wrong size": (lambda d: np.ones((1, 2, d - 1), np.float32), None, (H, "[-1,-1,256]")),
    "two rows": (lambda d: np.ones((2, 2, d), np.float32), None, ("sessions", "batch-size 1")),  # Triton core
    "mask length": (lambda d: np.ones((1, 2, d), np.float32), np.ones((1, 3), np.int64), (M, "[1, 2]", "[1, 3]")),
    "mask value 5": (
        lambda d: np.ones((1, 2, d), np.float32),
        np.array([[1, 5]], np.int64),
        (M, "0 (padding) or 1", "got 5"),
    ),
    "mask value -1": (
        lambda d: np.ones((1, 2, d), np.float32),
        np.array([[-1, 1]], np.int64),
        (M, "0 (padding) or 1", "got -1"),
    ),
    "too long": (lambda d: np.ones((1, 2048, d), np.float32), None, ("would hold 2051 positions", "max_seq_len 2048")),
    # one NaN in a step would sit in the cache and poison every later step of the session
    "NaN": (lambda d: _poke(np.ones((1, 2, d), np.float32), np.nan), None, (H, "finite", "nan at index [0, 1, 2]")),
    "Inf": (lambda d: _poke(np.ones((1, 2, d), np.float32), np.inf), None, (H, "finite", "inf at index")),
}


@pytest.mark.parametrize("protocol", SESSION_PROTOCOLS)
@pytest.mark.parametrize("case", SESSION_CASES)
def test_a_bad_step_leaves_the_sequence_as_it_was(clients, served_cfg, protocol, case):
    """The same steps on two sequences, one of them with a bad step in between: same outputs after."""
    stepper = clients[protocol]
    rng = np.random.default_rng(3)
    steps = [rng.standard_normal((1, n, served_cfg.d_model)).astype(np.float32) for n in (3, 1)]
    twin, tested = new_sequence_id(), new_sequence_id()
    for sequence_id in (twin, tested):
        stepper.step(sequence_id, steps[0], start=True)
    make_hidden, mask, says = SESSION_CASES[case]
    try:
        with pytest.raises(InferenceServerException) as raised:
            stepper.step(tested, make_hidden(served_cfg.d_model), mask)
        assert raised.value.status() == INVALID[protocol], raised.value
        for fragment in says:
            assert fragment in raised.value.message(), raised.value.message()
        expected = stepper.step(twin, steps[1])
        np.testing.assert_array_equal(stepper.step(tested, steps[1]), expected)
    finally:
        for sequence_id in (twin, tested):
            stepper.end(sequence_id, served_cfg.d_model)


@pytest.mark.parametrize("protocol", SESSION_PROTOCOLS)
def test_a_step_of_no_tokens_computes_nothing_and_changes_nothing(clients, served_cfg, protocol):
    """Between START and END, a step of no tokens answers no output (it asks the length): the sequence goes on
    as its twin does."""
    stepper = clients[protocol]
    rng = np.random.default_rng(4)
    steps = [rng.standard_normal((1, n, served_cfg.d_model)).astype(np.float32) for n in (3, 1)]
    twin, tested = new_sequence_id(), new_sequence_id()
    try:
        for sequence_id in (twin, tested):
            stepper.step(sequence_id, steps[0], start=True)
        assert stepper.step(tested, np.ones((1, 0, served_cfg.d_model), np.float32)).shape == (1, 0, served_cfg.d_model)
        np.testing.assert_array_equal(stepper.step(tested, steps[1]), stepper.step(twin, steps[1]))
    finally:
        for sequence_id in (twin, tested):
            stepper.end(sequence_id, served_cfg.d_model)


@pytest.mark.parametrize("protocol", SESSION_PROTOCOLS)
def test_a_step_for_an_unknown_or_ended_sequence_names_it(clients, served_cfg, protocol):
    stepper, sequence_id = clients[protocol], new_sequence_id()
    hidden = np.ones((1, 1, served_cfg.d_model), np.float32)
    with pytest.raises(InferenceServerException) as unknown:
        stepper.step(sequence_id, hidden)
    first = stepper.step(sequence_id, hidden, start=True)
    stepper.end(sequence_id, served_cfg.d_model)
    with pytest.raises(InferenceServerException) as ended:
        stepper.step(sequence_id, hidden)
    for raised in (unknown, ended):  # Triton core answers: it knows which sequences are live
        assert raised.value.status() == INVALID[protocol]
        assert f"sequence {sequence_id}" in raised.value.message() and "START" in raised.value.message()
    np.testing.assert_array_equal(stepper.step(sequence_id, hidden, start=True, end=True), first)
