"""`mha_session`'s `concat` engine: each sequence's cache is its own value (the graph's present),
kept in a KVCacheStore (kv_cache.py); the steps of one execute() run as one graph run, batched by
padding (batching.py). For configs the static form cannot take (head_dim not a multiple of 8).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from serving.engine import errors
from serving.engine.batching import Step, run_steps
from serving.engine.kv_cache import KVCacheStore
from serving.engine.runner import Runner
from serving.engine.steps import StepEngine, StepRequest, check_step


class ConcatSessionEngine(StepEngine):
    """The `concat` engine: each sequence's cache is its own value, batched by padding per execute()."""

    def __init__(self, runner: Runner, store: KVCacheStore) -> None:
        self.runner, self.store, self.cfg = runner, store, runner.cfg
        self.largest_batch = 0  # most steps one graph run has taken (proof that batching happens)

    @property
    def cache_kind(self) -> str:
        return "float32"

    @property
    def capacity(self) -> int:
        return self.store.capacity

    @property
    def full_length_capacity(self) -> int:  # every sequence reserves max_seq_len
        return self.store.capacity

    def stats(self):
        return self.store.stats()

    def evict_idle(self) -> list:
        return self.store.evict_idle()

    def _end(self, sequence_id: Hashable) -> None:
        self.store.end(sequence_id)

    def length(self, sequence_id: Hashable) -> int:
        return self.store.length(sequence_id)

    def _prepare(self, request: StepRequest) -> tuple[StepRequest, Step] | None:
        """The request's step with its sequence's cache; None when there is nothing to compute."""
        new = check_step(self.cfg, request)
        if new == 0 and not request.start:
            # closing: whatever the store knows, the sequence is gone afterwards (Triton ends it too),
            # so a client's close() succeeds also after an eviction or a refused START
            return None
        if request.start:
            if new > self.store.max_positions:
                raise errors.SequenceTooLong(request.sequence_id, new, self.store.max_positions)
            entry = self.store.start(request.sequence_id, self.runner.empty_past())
        else:
            entry = self.store.get(request.sequence_id)
            self.store.check_length(request.sequence_id, entry, new)
        if new == 0:
            return None
        new_mask = np.ones(new, np.int64) if request.mask is None else request.mask[0].astype(np.int64)
        return request, Step(request.hidden[0], new_mask, entry.caches, entry.mask)

    def _run(self, runnable: dict[int, tuple[StepRequest, Step]], results: list) -> None:
        try:
            outcomes = run_steps(self.runner, [step for _, step in runnable.values()])
        except Exception as error:  # not the requests' fault; their caches stay as they were
            for index in runnable:
                results[index] = error
            return
        self.largest_batch = max(self.largest_batch, len(runnable))
        for (index, (request, _)), outcome in zip(runnable.items(), outcomes, strict=True):
            self.store.update(request.sequence_id, outcome.present, outcome.mask, outcome.nbytes)
            results[index] = outcome.output[None]  # (1, T, d_model)
