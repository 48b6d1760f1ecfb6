"""the `sessions` model's `concat` engine, for configs the static form cannot take (head_dim not a multiple
of 8): each sequence's cache is its own value (the graph's present), kept in a KVCacheStore
(store.py); the steps of one execute() run as one graph run, batched by padding (batching.py).

A step's padded tokens are dropped before they run (`contract.inputs.real_tokens`), as the static
engine drops them, so a cache holds real positions only: rotary positions count real tokens, as
Hugging Face's mask-derived positions do, and a padded query's output is zeros. A step that asks for
its last position only (`StepRequest.last_only`) is answered the last real token's output (1, 1,
width), sliced from the run's: the batched graph computes every position's anyway.

The session operations are the static engine's, with the same blobs (serving/engine/snapshots.py):
the cache is values on the runner's device (host arrays on the CPU), never written in place, so a
snapshot reads them, a restore makes them, a fork or a session from a prefix shares them, and a
rewind cuts a copy of their first positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from contract.deployment import ENGINE_CONCAT, ENGINE_OPERATIONS
from contract.inputs import real_tokens
from serving.engine import errors, snapshots
from serving.engine.concat.batching import Step, run_steps
from serving.engine.concat.copies import DeviceCopies, HostCopies, copies_for, nbytes
from serving.engine.concat.store import KVCacheStore
from serving.engine.kv_pool import GraphRuns
from serving.engine.runner import InspectionRunner, Runner
from serving.engine.sequences import SequenceId
from serving.engine.steps import StepEngine, StepRequest, check_step, no_result, step_tokens

# a prepared request: the request, its step, which of its tokens are real (None: all)
Prepared = tuple[StepRequest, Step, np.ndarray | None]


class ConcatSessionEngine(StepEngine):
    """The `concat` engine: each sequence's cache is its own value, batched by padding per execute()."""

    OPERATIONS = ENGINE_OPERATIONS[ENGINE_CONCAT]

    def __init__(
        self,
        runner: Runner,
        store: KVCacheStore,
        identity: Mapping[str, str] | None = None,
        inspection: InspectionRunner | None = None,
        copies: HostCopies | DeviceCopies | None = None,
    ) -> None:
        """`identity`: what its snapshots carry (snapshots.fingerprint; None: the config and the
        runner's dtype, no graph named); `inspection`: the graph attention maps come from; `copies`:
        the batching copies (None: those of the runner's device)."""
        self.runner, self.store, self.cfg = runner, store, runner.cfg
        self.identity = identity or snapshots.fingerprint(self.cfg, self.cache_kind)
        self.inspection = inspection or InspectionRunner(None, self.cfg)
        self.copies = copies or copies_for(runner)
        self.largest_batch = 0  # most steps one graph run has taken (proof that batching happens)
        self.runs = GraphRuns()  # one padded run per execute(), counted as a decode run of all its steps

    @property
    def description(self) -> str:
        return f"concat engine, {self.runner.description}"

    @property
    def cache_kind(self) -> str:
        return np.dtype(self.runner.dtype).name

    @property
    def capacity(self) -> int:
        return self.store.capacity

    @property
    def full_length_capacity(self) -> int:  # every sequence reserves max_seq_len
        return self.store.capacity

    @property
    def max_positions(self) -> int:
        return self.store.max_positions

    def stats(self):
        return self.store.stats()

    def evict_idle(self) -> list:
        return self.store.evict_idle()

    def _end(self, sequence_id: SequenceId) -> None:
        self.store.end(sequence_id)

    def length(self, sequence_id: SequenceId) -> int:
        return self.store.length(sequence_id)

    # --- one execute() ------------------------------------------------------------------------------

    def _prepare(self, request: StepRequest) -> Prepared | None:
        """The request's step with its sequence's cache; None when there is nothing to compute."""
        new = check_step(self.cfg, request)
        if new == 0 and not request.start:
            if not request.end:  # a live sequence's length asked: an unknown one is told so
                self.store.get(request.sequence_id)
            # closing: whatever the store knows, the sequence is gone afterwards (Triton ends it too),
            # so a client's close() succeeds also after an eviction or a refused START
            return None
        tokens = real_tokens(request.hidden, request.mask)[0]  # (T_real, d_model), or ids (T_real,)
        if request.start:  # every sequence reserves max_seq_len here: `reserve` is only checked against it
            if max(len(tokens), request.reserve) > self.max_positions:
                positions = max(len(tokens), request.reserve)
                raise errors.SequenceTooLong(request.sequence_id, positions, self.max_positions)
            entry = self.store.start(request.sequence_id, self.runner.empty_past())
        else:
            entry = self.store.get(request.sequence_id)
            self.store.check_length(request.sequence_id, entry, max(len(tokens), request.reserve - entry.length))
        if len(tokens) == 0:
            return None
        keep = None if len(tokens) == new else request.mask[0].astype(bool)
        return request, Step(tokens, entry.caches, entry.length), keep

    def _run(self, runnable: dict[int, Prepared], results: list) -> None:
        try:
            outcomes = run_steps(self.runner, self.copies, [step for _, step, _ in runnable.values()])
        except Exception as error:  # not the requests' fault; their caches stay as they were
            for index in runnable:
                results[index] = error
            return
        self.largest_batch = max(self.largest_batch, len(runnable))
        self.runs.decoded(len(runnable))
        for (index, (request, _, keep)), outcome in zip(runnable.items(), outcomes, strict=True):
            self.store.update(request.sequence_id, outcome.present, outcome.length, outcome.nbytes)
            if request.last_only:
                results[index] = outcome.output[-1:][None]
            elif keep is None:
                results[index] = outcome.output[None]  # (1, T, d_model), or logits (1, T, vocab)
            else:  # a padded query's output is zeros
                results[index] = no_result(self.cfg, len(keep))
                results[index][0, keep] = outcome.output

    # --- session operations: snapshot, restore, fork, rewind ------------------------------------------

    def snapshot(
        self, sequence_id: SequenceId, owner: str = "", since: int = 0, token_ids: np.ndarray | None = None
    ) -> bytes:
        """The live sequence's cache from position `since` (0: all of it; more: the increment since a
        checkpoint) as a blob (snapshots.py) only `owner` restores, carrying `token_ids` where known; the
        sequence goes on unchanged."""
        entry = self.store.get(sequence_id)
        caches, length = entry.caches, entry.length
        if not 0 <= since <= length:
            held = f"sequence {sequence_id!r} holds {length} positions"
            raise errors.InvalidRequest(f"{held}: a snapshot starts at 0 to {length}, got {since}")
        cache = {name: value.numpy()[0, :, since:] for name, value in zip(self.runner.past_names, caches, strict=True)}
        return snapshots.encode(cache, self.identity, length, owner, since, token_ids)

    def restore(self, sequence_id: SequenceId, blob: bytes | Sequence[bytes], owner: str = "") -> int:
        """Start `sequence_id` holding the cache of `blob` (or of several: a snapshot's increments, in
        order) (a START: a live sequence of that id restarts); its length. A blob of another model,
        graph, dtype or owner, or increments that leave a gap, change nothing."""
        blobs = [blob] if isinstance(blob, bytes | bytearray | memoryview) else list(blob)
        cache, length = snapshots.decode_chunks(blobs, self.identity, owner)
        if length > self.max_positions:
            raise errors.SequenceTooLong(sequence_id, length, self.max_positions)
        caches = [self.runner.to_device(cache[name][None]) for name in self.runner.past_names]
        self.store.start(sequence_id, caches, length, nbytes(caches))
        return length

    def fork(self, sequence_id: SequenceId, into: SequenceId) -> int:
        """Start `into` holding the live sequence's cache (the same values: neither writes them, a
        step of either makes its own); both go on independently. Its length."""
        if into == sequence_id:
            raise errors.InvalidRequest(f"sequence {sequence_id!r} cannot be forked into itself: give a new id")
        entry = self.store.get(sequence_id)
        self.store.start(into, entry.caches, entry.length, entry.nbytes)
        return entry.length

    def rename(self, sequence_id: SequenceId, into: SequenceId, aside: bool = True) -> None:
        """The live sequence goes on as `into` (its cache unmoved: values, not rows, so nothing lies aside or
        not); `sequence_id` has ended."""
        self.store.rename(sequence_id, into)

    def rewind(self, sequence_id: SequenceId, length: int) -> int:
        """The live sequence keeps its first `length` positions; the next step continues from there."""
        entry = self.store.get(sequence_id)
        if not 0 <= length <= entry.length:
            raise errors.InvalidRequest(
                f"sequence {sequence_id!r} holds {entry.length} positions: a rewind goes to 0 to {entry.length}, "
                f"got {length}"
            )
        if length < entry.length:  # a copy: a fork may share the values cut
            (caches,) = self.copies.split(entry.caches, [0], [length])
            self.store.update(sequence_id, caches, length, nbytes(caches))
        return length

    def attention_maps(self, sequence_id: SequenceId, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """The output (1, T, d_model) and each layer's attention weights `attention.{i}` (1, n_heads, T,
        length + T) of a step of `tokens` (T, d_model) (ids (T,)) on the live sequence, computed by the inspection
        graph over its cache: its length and cache are untouched."""
        entry = self.store.get(sequence_id)
        self.store.check_length(sequence_id, entry, len(tokens))
        past = {
            name: value.numpy().astype(np.float32, copy=False)
            for name, value in zip(self.runner.past_names, entry.caches, strict=True)
        }
        return self.inspection.session_step(past, tokens)

    # --- named prefixes ------------------------------------------------------------------------------

    def put_prefix(self, owner: str, name: str, tokens: np.ndarray) -> int:
        """Prefill `tokens` (T, d_model) (a whole model's ids (T,)) once, kept as the prefix `name` of
        `owner` until deleted (it
        reserves max_seq_len positions of the budget, as a sequence does); its length. A prefix is
        immutable: an existing name is refused."""
        if len(tokens) == 0 or len(tokens) > self.max_positions:
            raise errors.InvalidRequest(
                f"prefix {name!r}: expected 1 to {self.max_positions} tokens (max_seq_len), got {len(tokens)}"
            )
        self.store.check_prefix(owner, name)  # before the prefill: a refused prefix costs no compute
        step = Step(step_tokens(self.cfg, tokens), self.runner.empty_past(), 0)
        (outcome,) = run_steps(self.runner, self.copies, [step])
        self.store.put_prefix(owner, name, outcome.present, outcome.length, outcome.nbytes)
        return outcome.length

    def start_from_prefix(self, sequence_id: SequenceId, owner: str, name: str) -> int:
        """START `sequence_id` holding the prefix's cache; its length."""
        entry = self.store.prefix(owner, name)
        self.store.start(sequence_id, entry.caches, entry.length, entry.nbytes)
        return entry.length

    def delete_prefix(self, owner: str, name: str) -> None:
        """Free the prefix; sessions started from it keep their caches."""
        self.store.delete_prefix(owner, name)

    def prefixes(self, owner: str) -> dict[str, int]:
        """The owner's prefixes: name -> positions."""
        return self.store.prefixes(owner)
