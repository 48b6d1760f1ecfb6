"""What both session engines share (the static one, static_engine.py, and the concat one,
concat/engine.py): a step request, its check, one execute() worth of steps in and one output or
one error per step out, and the idle sweeper.

Each request is checked and matched with its sequence's cache on its own, so one bad request gets
its own error and nothing else changes; the good ones then run together, and only after their run
succeeded do their caches advance. A request with the END flag frees its sequence whatever else
happens to it (Triton has ended the sequence either way).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import numpy as np

from contract import names
from contract.config import ModelConfig
from contract.inputs import InputError, check_finite, check_inputs, check_mask_values, check_token_values
from serving.engine import errors


@dataclasses.dataclass(frozen=True)
class StepRequest:
    """What a Triton request carries: the sequence, its flags and the new tokens."""

    sequence_id: Hashable
    start: bool
    end: bool
    # the new tokens: hidden states (1, T, d_model) float32, or a whole model's token ids (1, T) int64
    # (names.model_input); T = 0 computes nothing: a START or END alone, or a live sequence's length asked
    hidden: np.ndarray | None
    mask: np.ndarray | None = None  # (1, T) int64; all ones when left out
    # names.LAST_ONLY: answer only the last real position's output (1, 1, width). As the request sent it:
    # check_step refuses anything but a bool, so a bad value is that request's own error
    last_only: bool = False
    # the positions the sequence will hold once the work this step begins is done (a prompt stepped in chunks,
    # a generation's prompt and its tokens): room for them is taken now, so that a later chunk or token is never
    # refused for room (0: only this step's)
    reserve: int = 0


@dataclasses.dataclass(frozen=True)
class CacheStats:
    sequences: int
    held_bytes: int  # what the caches hold now (the named prefixes' too)
    reserved_bytes: int  # what the budget counts: one reservation per live sequence and named prefix
    budget_bytes: int
    evictions: int
    allocated_bytes: int  # memory the cache takes now (static: the reservations on the host, the pool on a device)


@dataclasses.dataclass(frozen=True)
class Operation:
    """A session operation (contract.names.OPERATIONS): the engine method that does it, and how a
    request asking for it is sent (its START and END flags, whether it carries tokens)."""

    method: str
    start: bool
    end: bool
    tokens: bool


# Every session operation an engine may offer; an engine lists the ones it offers in `OPERATIONS`
SESSION_OPERATIONS = {
    names.SNAPSHOT_OPERATION: Operation("snapshot", start=False, end=False, tokens=False),
    names.RESTORE: Operation("restore", start=True, end=False, tokens=False),
    names.FORK: Operation("fork", start=True, end=False, tokens=False),
    names.REWIND: Operation("rewind", start=False, end=False, tokens=False),
    names.PUT_PREFIX: Operation("put_prefix", start=True, end=True, tokens=True),
    names.FROM_PREFIX: Operation("start_from_prefix", start=True, end=False, tokens=False),
    names.DELETE_PREFIX: Operation("delete_prefix", start=True, end=True, tokens=False),
    names.ATTENTION_MAPS_OPERATION: Operation("attention_maps", start=False, end=False, tokens=True),
}


# the output (1, T, d_model) (a whole model's logits (1, T, vocab_size)), or what to answer instead
Result = np.ndarray | Exception


def result_width(cfg: ModelConfig) -> int:
    """The last axis of a step's result: vocab_size for a whole model's logits, d_model for the output."""
    return names.model_output_spec(cfg).shape[-1]


def no_result(cfg: ModelConfig, new: int = 0) -> np.ndarray:
    """The result of a step that computed nothing (or of `new` padded queries): zeros (1, new, width)."""
    return np.zeros((1, new, result_width(cfg)), np.float32)


def step_tokens(cfg: ModelConfig, tokens: np.ndarray, float_dtype: Any = np.float32) -> np.ndarray:
    """One sequence's new tokens in the dtype its graph takes: a whole model's ids int64 (never a float:
    an id is an index), hidden states in the graph's `float_dtype`."""
    return tokens.astype(np.int64 if cfg.whole else float_dtype, copy=False)


def check_step(cfg: ModelConfig, request: StepRequest) -> int:
    """The number of new tokens; raises InputError naming the input, expected and actual."""
    hidden, name = request.hidden, names.model_input(cfg)
    if hidden is None:
        raise InputError(name, "missing")
    rank = len(names.model_input_spec(cfg).shape)
    if hidden.ndim == rank and hidden.shape[1] == 0:
        # opening a session (its cache reserved) or closing one without computing; in between, a step of
        # no tokens changes nothing and answers the positions held (the generation model asks so)
        new = 0
    else:
        check_inputs(cfg, {name: hidden})
        check_finite({name: hidden})  # a NaN in the cache would poison every later step
        check_token_values(cfg, {name: hidden})  # an id outside the vocabulary has no embedding
        new = hidden.shape[1]
    if hidden.shape[0] != 1:
        raise InputError(name, f"one sequence per step: expected batch 1, got {list(hidden.shape)}")
    if request.mask is not None and tuple(request.mask.shape) != (1, new):
        raise InputError(
            names.ATTENTION_MASK,
            f"a step's mask covers its new tokens only: expected shape [1, {new}], got {list(request.mask.shape)}",
        )
    check_mask_values({names.ATTENTION_MASK: request.mask})
    if not isinstance(request.last_only, bool):
        raise InputError(names.LAST_ONLY, f"expected a boolean (true or false), got {request.last_only!r}")
    return new


class StepEngine(abc.ABC):
    """What both session engines share: one execute() as rounds (each sequence at most once per
    round, its steps in order), each request prepared on its own (a bad one gets its error and
    nothing else changes), the prepared ones run together, and END frees the sequence whatever else
    happened to its request (Triton has ended it either way)."""

    cfg: ModelConfig
    # the session operations this engine offers (names of SESSION_OPERATIONS); Triton's dispatch reads them
    OPERATIONS: ClassVar[tuple[str, ...]] = ()

    def sequences(self) -> int:
        """Live sequences, as `stats().sequences`: what a request's gauge update asks (an engine whose
        stats walk its sequences answers it without them)."""
        return self.stats().sequences  # type: ignore[attr-defined]  # every engine has its stats

    def operations(self) -> dict[str, Operation]:
        """The session operations this engine offers, by name."""
        return {name: SESSION_OPERATIONS[name] for name in self.OPERATIONS}

    def execute(self, requests: Sequence[StepRequest]) -> list[Result]:
        results: list[Result | None] = [None] * len(requests)
        for indices in rounds(requests):
            self._round([requests[i] for i in indices], indices, results)
        return results  # type: ignore[return-value]

    def _round(self, requests: list[StepRequest], indices: list[int], results: list) -> None:
        prepared: dict[int, Any] = {}
        for index, request in zip(indices, requests, strict=True):
            try:
                item = self._prepare(request)
            except (errors.ServingError, InputError) as error:
                results[index] = error
                continue
            if item is None:  # nothing to compute (END without tokens, START without tokens)
                new = 0 if request.hidden is None or request.hidden.ndim < 2 else request.hidden.shape[1]
                results[index] = no_result(self.cfg, min(new, 1) if request.last_only else new)
            else:
                prepared[index] = item
        if prepared:
            self._run(prepared, results)
        for request in requests:
            if request.end:
                self._end(request.sequence_id)

    @abc.abstractmethod
    def length(self, sequence_id: Hashable) -> int:
        """Positions the sequence holds now; -1 when it is not live (never started, ended, evicted)."""

    @abc.abstractmethod
    def _prepare(self, request: StepRequest) -> Any:
        """What `_run` needs for this request; None when there is nothing to compute."""

    @abc.abstractmethod
    def _run(self, prepared: dict[int, Any], results: list) -> None:
        """Run the prepared requests (by their index in execute()) and put each one's result."""

    @abc.abstractmethod
    def _end(self, sequence_id: Hashable) -> None:
        """Free the sequence (its END arrived, whatever happened to the rest of its request)."""


def rounds(requests: Sequence[StepRequest]) -> list[list[int]]:
    """Indices grouped so that each sequence appears at most once per round, its steps in order.

    Triton's sequence batcher sends one step per sequence per execute(); this keeps the caches right
    even if it did not.
    """
    rounds: list[list[int]] = []
    last_round: dict[Hashable, int] = {}
    for index, request in enumerate(requests):
        k = last_round.get(request.sequence_id, -1) + 1
        last_round[request.sequence_id] = k
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(index)
    return rounds
