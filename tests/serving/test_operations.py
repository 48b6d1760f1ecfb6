"""Triton's dispatch of the session operations (serving/engine/operations.py) reads the engine's table
(`StepEngine.operations()`): an operation the engine does not offer is refused naming the engine and
what it offers, the flags are checked against the table, the method the table names is called with
the request's parameters, and a put_prefix gets its real tokens only. Without Triton: the engine here
offers two operations and records what it was called with; both served engines' tables name methods
they have."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import pytest

from contract import names
from contract.config import ModelConfig
from serving.engine import operations
from serving.engine.errors import InvalidRequest
from serving.engine.steps import SESSION_OPERATIONS, StepEngine, StepRequest

CFG = ModelConfig(d_model=16, n_heads=2, n_kv_heads=2, n_layers=1, max_seq_len=32)


class TwoOperations(StepEngine):
    """Offers rewind and put_prefix only; each call is recorded."""

    OPERATIONS = (names.REWIND, names.PUT_PREFIX)

    def __init__(self) -> None:
        self.cfg, self.calls = CFG, []

    def rewind(self, sequence_id: Hashable, length: int) -> int:
        self.calls.append(("rewind", sequence_id, length))
        return length

    def put_prefix(self, owner: str, name: str, tokens: np.ndarray) -> int:
        self.calls.append(("put_prefix", owner, name, tokens))
        return len(tokens)

    def length(self, sequence_id: Hashable) -> int:
        return 0

    def _prepare(self, request: StepRequest) -> None:
        return None

    def _run(self, prepared: dict, results: list) -> None:
        pass

    def _end(self, sequence_id: Hashable) -> None:
        pass


def request(start: bool = False, end: bool = False, tokens: int = 0, mask: list[int] | None = None) -> StepRequest:
    hidden = np.arange(tokens * CFG.d_model, dtype=np.float32).reshape(1, tokens, CFG.d_model)
    return StepRequest(7, start, end, hidden, None if mask is None else np.array([mask], np.int64))


def test_an_operation_the_engine_does_not_offer_is_refused_naming_the_engine_and_what_it_offers():
    engine = TwoOperations()
    for name in (names.SNAPSHOT_OPERATION, names.FORK, names.ATTENTION_MAPS_OPERATION):
        flags = SESSION_OPERATIONS[name]
        step = request(start=flags.start, end=flags.end, tokens=int(flags.tokens))
        assert refusal(engine, step, {names.OPERATION: name}) == (
            f"'{name}' is not an operation of this model's TwoOperations: it offers rewind, put_prefix"
        )
    assert engine.calls == []
    assert refusal(engine, request(), {names.OPERATION: "undo"}) == (
        f"parameter '{names.OPERATION}': expected one of {list(names.OPERATIONS)}, got 'undo'"
    )


def refusal(engine: StepEngine, step: StepRequest, parameters: dict) -> str:
    with pytest.raises(InvalidRequest) as refused:
        operations.run(engine, step, parameters)
    return str(refused.value)


def test_the_flags_come_from_the_table_and_the_method_it_names_is_called():
    engine = TwoOperations()
    rewind = {names.OPERATION: names.REWIND, names.REWIND_TO: 3}
    assert refusal(engine, request(start=True), rewind) == "'rewind' is sent without the START flag"
    assert refusal(engine, request(tokens=2), rewind) == (
        "'rewind' carries no tokens: expected hidden_states of 0 tokens, got 2"
    )
    put = {names.OPERATION: names.PUT_PREFIX, names.PREFIX: "p"}
    assert refusal(engine, request(start=True, tokens=2), put) == "'put_prefix' is sent with the END flag"
    assert refusal(engine, request(start=True, end=True), put) == (
        "'put_prefix' carries tokens: expected hidden_states of 1 or more, got 0"
    )
    assert refusal(engine, request(), rewind | {names.REWIND_TO: "3"}) == "parameter 'rewind_to': expected int, got '3'"
    assert engine.calls == []
    assert operations.run(engine, request(), rewind) == {}
    assert engine.calls == [("rewind", 7, 3)]


def test_a_put_prefix_gets_its_real_tokens_only():
    engine = TwoOperations()
    step = request(start=True, end=True, tokens=3, mask=[1, 0, 1])
    parameters = {names.OPERATION: names.PUT_PREFIX, names.PREFIX: "doc", names.OWNER: "alice"}
    assert operations.run(engine, step, parameters) == {}
    (call,) = engine.calls
    assert call[:3] == ("put_prefix", "alice", "doc")
    np.testing.assert_array_equal(call[3], step.hidden[0, [0, 2]])


def test_every_operation_has_its_arguments_and_both_engines_offer_each_by_a_method_they_have():
    from serving.engine.concat import ConcatSessionEngine
    from serving.engine.static_engine import StaticSessionEngine

    assert set(operations.ARGUMENTS) == set(SESSION_OPERATIONS) == set(names.OPERATIONS)
    for engine in (StaticSessionEngine, ConcatSessionEngine):  # keeping a session does not depend on head_dim
        assert engine.OPERATIONS == names.OPERATIONS, engine
        for name in engine.OPERATIONS:
            assert callable(getattr(engine, SESSION_OPERATIONS[name].method, None)), (engine, name)
