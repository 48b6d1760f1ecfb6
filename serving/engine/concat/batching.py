"""Several sequences' decode steps as ONE graph run.

Triton's sequence batcher may hand `sessions` one execute() with steps of different sequences,
each with its own past length P_r and number of new tokens T_r (real tokens only: the engine drops
a step's padded tokens before they get here, so a cache holds real positions only). They run as
one batch:

    row r = [ left padding (P_max - P_r) | past (P_r) | new (T_r) | right padding (T_max - T_r) ]

The padding has mask 0, so no real query attends it. A padded query (right padding) only produces
an output nobody reads, and a real query at position P_max + t sees keys j <= P_max + t, which never
include padded new tokens (they sit after every real one). Rotary positions are counted from the
mask (the runner's default), so row r's new tokens sit at P_r + t, as if it had run alone. Each
sequence then takes back its own output rows [:T_r] and its present positions
[P_max - P_r, P_max + T_r), so the cache it keeps holds exactly its past and new tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from serving.engine.concat.copies import DeviceCopies, HostCopies, nbytes
from serving.engine.runner import Runner


@dataclasses.dataclass
class Step:
    """One sequence's step: the new (real) tokens, and the sequence's cache before them."""

    hidden: np.ndarray  # (T, d_model) float32, or a whole model's token ids (T,) int64
    past: list[Any]  # runner values, (1, n_kv, P, hd) each, naming-table order
    past_length: int  # P

    @property
    def new_length(self) -> int:
        return int(self.hidden.shape[0])


@dataclasses.dataclass
class StepResult:
    output: np.ndarray  # (T, d_model), or a whole model's logits (T, vocab)
    present: list[Any]  # (1, n_kv, P+T, hd) each, on the runner's device
    length: int  # P+T
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each step sits in the padded batch."""

    hidden: np.ndarray  # (B, T_max, d_model), or token ids (B, T_max)
    mask: np.ndarray  # (B, P_max + T_max)
    starts: list[int]  # row r's left padding P_max - P_r, which is where its present starts
    ends: list[int]  # one past its last: P_max + T_r
    max_past: int
    max_new: int


def layout(steps: Sequence[Step]) -> Layout:
    max_past = max(step.past_length for step in steps)
    max_new = max(step.new_length for step in steps)
    first = steps[0].hidden  # (T, d_model) states, or (T,) ids: padded by zeros (id 0), which the mask hides
    hidden = np.zeros((len(steps), max_new, *first.shape[1:]), first.dtype)  # (B, T_max, d) or (B, T_max)
    mask = np.zeros((len(steps), max_past + max_new), np.int64)  # (B, P_max + T_max)
    starts, ends = [], []
    for r, step in enumerate(steps):
        pad, new = max_past - step.past_length, step.new_length
        hidden[r, :new] = step.hidden
        mask[r, pad : max_past + new] = 1
        starts.append(pad)
        ends.append(max_past + new)
    return Layout(hidden, mask, starts, ends, max_past, max_new)


def run_steps(runner: Runner, copies: HostCopies | DeviceCopies, steps: Sequence[Step]) -> list[StepResult]:
    """Every step in one graph run; results in the order of `steps`."""
    if len(steps) == 1:  # alone: no padding, the present is kept as it comes out of the graph
        return [_run_one(runner, steps[0])]
    # longest pasts first: the rows that need no padding lead, which is what the stack kernel expects
    order = sorted(range(len(steps)), key=lambda r: -steps[r].past_length)
    ordered = [steps[r] for r in order]
    plan = layout(ordered)
    past = copies.stack([step.past for step in ordered], plan.starts)
    output, presents = runner.run(plan.hidden, plan.mask, past)
    per_row = copies.split(presents, plan.starts, plan.ends)
    results: list[StepResult | None] = [None] * len(steps)
    for row, (r, step) in enumerate(zip(order, ordered, strict=True)):
        length = step.past_length + step.new_length
        results[r] = StepResult(output[row, : step.new_length].copy(), per_row[row], length, nbytes(per_row[row]))
    return results  # type: ignore[return-value]


def _run_one(runner: Runner, step: Step) -> StepResult:
    length = step.past_length + step.new_length
    output, present = runner.run(step.hidden[None], np.ones((1, length), np.int64), step.past)
    return StepResult(output[0], present, length, nbytes(present))
