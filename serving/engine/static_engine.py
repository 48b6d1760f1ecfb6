"""the `sessions` model's static engine: every live sequence holds its KV cache in the cache manager
(serving/engine/cache_manager.py), and a step appends its tokens in place (serving/engine/kv_pool.py).

The engine speaks to its cache by holder only (the sequence id; a named prefix's key): START takes
room for its first step, a step that outgrows what its sequence has is given more (the manager
moves it), END and idle eviction give it back; the KV budget is bytes, and a START or a step it has
no room for is refused (`cache_full`) and changes nothing. The steps of one execute() run as one
step of the manager, as few graph runs as GroupQueryAttention allows.

A step's `attention_mask` marks which of its new tokens are real. The static form has no mask input,
so padded tokens are dropped before they enter the cache (contract.inputs.real_tokens) and their
output rows are zeros (a padded query's output is unspecified by the contract). Outputs of the real
tokens are unchanged by this: the static form rotates (where the model does) at positions counted
from its row's length, and with the padded tokens dropped those are the positions Hugging Face
counts from the mask (each real token's place among the real ones); causality is unchanged too.
`length` counts cached (real) tokens only.

A step that asks for its last position only (`StepRequest.last_only`) is answered (1, 1, width): the
last real token's output. The manager runs such prefills through the last-logits graph where the
factory gave it one (a whole model: no (T, vocab) logits computed), else slices the full output.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from contract.deployment import ENGINE_OPERATIONS, ENGINE_STATIC
from contract.inputs import real_tokens
from serving.engine import errors, snapshots
from serving.engine.cache_manager import PREFIX, CacheManager, Holder, RowsFull, prefix_holder
from serving.engine.runner import InspectionRunner
from serving.engine.sequences import LiveSequences, SequenceId
from serving.engine.steps import CacheStats, StepEngine, StepRequest, check_step, no_result, step_tokens


@dataclasses.dataclass
class Slot:
    sequence_id: SequenceId
    last_used: float


@dataclasses.dataclass(frozen=True)
class _Work:
    sequence_id: SequenceId
    tokens: np.ndarray  # (T_real, d_model) in the graph's float dtype, or a whole model's ids (T_real,) int64
    keep: np.ndarray | None  # (T,) bool: which of the request's tokens are real; None: all of them
    last_only: bool  # answered (1, 1, width): the last real token's output

    @property
    def runs_last_only(self) -> bool:
        """Whether the cache may run it for its last position only: asked so, or one token (a decode
        step answers its one position either way, so decodes share a run whatever their requests asked)."""
        return self.last_only or len(self.tokens) == 1


class StaticSessionEngine(StepEngine):
    OPERATIONS = ENGINE_OPERATIONS[ENGINE_STATIC]

    def __init__(
        self,
        cache: CacheManager,
        idle_timeout: float,
        remember: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        description: str = "",
        inspection: InspectionRunner | None = None,
    ) -> None:
        """`inspection`: the graph a session's attention maps come from (`attention_maps`)."""
        assert idle_timeout > 0
        self.cache, self.cfg = cache, cache.cfg
        self.description = description or f"static engine, {cache.description}"
        self.max_positions = cache.capacity
        self.idle_timeout = idle_timeout
        self._clock = clock
        self._slots: LiveSequences[Slot] = LiveSequences(idle_timeout, clock, remember, self._give_back)
        self._lock = threading.Lock()  # execute() and the idle sweeper both change the slots
        self.largest_batch = 0  # most decode steps one execute() has taken
        self.inspection = inspection or InspectionRunner(None, self.cfg)

    @property
    def capacity(self) -> int:
        """The most sequences that fit at once: each in a row of the smallest size."""
        return self.cache.most_rows

    @property
    def full_length_capacity(self) -> int:
        """The most sequences of max_seq_len positions that fit at once."""
        return self.cache.most_rows_of(self.max_positions)

    @property
    def cache_kind(self) -> str:
        """What the cache holds: float32, float16, int8 or int4."""
        return self.cache.cache_kind

    @property
    def runs(self):
        """The graph runs of its cache so far (kv_pool.GraphRuns)."""
        return self.cache.runs

    def length(self, sequence_id: SequenceId) -> int:
        with self._lock:
            held = sequence_id in self._slots.entries
            return self.cache.length(sequence_id) if held else -1

    # --- one execute() ------------------------------------------------------------------------------

    def _prepare(self, request: StepRequest) -> _Work | None:
        """The request's real tokens, with room made for them; None when there is nothing to compute."""
        new = check_step(self.cfg, request)
        if new == 0 and not request.start:
            if not request.end:  # a live sequence's length asked: an unknown one is told so
                with self._lock:
                    self._touched(request.sequence_id)
            return None  # closing: the sequence is gone afterwards whatever the slots know
        tokens = real_tokens(request.hidden, request.mask)[0]  # (T_real, d_model), or ids (T_real,)
        keep = None if len(tokens) == new else request.mask[0].astype(bool)
        if request.start:
            positions = max(len(tokens), request.reserve)
            if positions > self.max_positions:
                raise errors.SequenceTooLong(request.sequence_id, positions, self.max_positions)
            self._start(request.sequence_id, positions)
        else:
            self._grown(request.sequence_id, len(tokens), request.reserve)
        if len(tokens) == 0:
            return None
        return _Work(request.sequence_id, step_tokens(self.cfg, tokens, self.cache.dtype), keep, request.last_only)

    def _run(self, prepared: dict[int, _Work], results: list) -> None:
        groups: dict[bool, dict[int, _Work]] = {}  # a round may mix steps asking for every position and not
        for index, item in prepared.items():
            groups.setdefault(item.runs_last_only, {})[index] = item
        for last_only, group in groups.items():
            # a round holds each sequence at most once (steps.rounds): its id keys its step
            outputs = self.cache.run({item.sequence_id: item.tokens for item in group.values()}, last_only)
            for index, item in group.items():
                results[index] = self._answer(item, outputs[item.sequence_id])
        self.largest_batch = max(self.largest_batch, sum(len(item.tokens) == 1 for item in prepared.values()))

    def _answer(self, item: _Work, output: np.ndarray | Exception) -> np.ndarray | Exception:
        """The request's answer from the cache's output of its real tokens (T_real, width), or (1, width)
        where it ran for its last position only: (1, 1, width) where it asked so, else (1, T, width)."""
        if isinstance(output, Exception):  # not the request's fault; its cache length is unchanged
            return output
        if item.last_only:
            return output[-1:].astype(np.float32, copy=False)[None]
        if item.keep is None:
            return output.astype(np.float32, copy=False)[None]  # (1, T, d_model) or (1, T, vocab)
        full = no_result(self.cfg, len(item.keep))  # a padded query's output: zeros
        full[0, item.keep] = output
        return full

    # --- slots --------------------------------------------------------------------------------------

    def _start(self, sequence_id: SequenceId, positions: int = 1) -> None:
        """A fresh slot for the sequence that holds `positions`; a repeated START restarts it (as
        Triton does)."""
        with self._lock:
            self._slots.restart(sequence_id)
            self._allocate(sequence_id, sequence_id, positions)
            self._slots.add(sequence_id, Slot(sequence_id, self._clock()))

    def _grown(self, sequence_id: SequenceId, new: int, reserve: int = 0) -> None:
        """The live sequence holding `new` more positions, with room for `reserve` in all (moved to a larger
        row if need be)."""
        with self._lock:
            self._slots.touch(sequence_id)
            length = max(self.cache.length(sequence_id) + new, reserve)
            if length > self.max_positions:
                raise errors.SequenceTooLong(sequence_id, length, self.max_positions)
            try:
                self.cache.grow(sequence_id, length)
            except RowsFull as full:
                raise errors.CacheFull(sequence_id, str(full), growing=True) from None

    def _allocate(self, holder: Holder, name: SequenceId | str, positions: int) -> None:
        try:
            self.cache.allocate(holder, max(positions, 1))
        except RowsFull as full:
            raise errors.CacheFull(name, str(full)) from None

    def _touched(self, sequence_id: SequenceId) -> int:
        """The live sequence's length, the sequence marked used now (the caller holds the lock)."""
        self._slots.touch(sequence_id)
        return self.cache.length(sequence_id)

    # --- session operations: snapshot, restore, fork, rewind ------------------------------------------

    def snapshot(
        self, sequence_id: SequenceId, owner: str = "", since: int = 0, token_ids: np.ndarray | None = None
    ) -> bytes:
        """The live sequence's cache from position `since` (0: all of it; more: the increment since a
        checkpoint) as a blob (snapshots.py) only `owner` restores, carrying `token_ids` (its ids, where the
        caller knows them); the sequence goes on unchanged."""
        with self._lock:
            length = self._touched(sequence_id)
            if not 0 <= since <= length:
                held = f"sequence {sequence_id!r} holds {length} positions"
                raise errors.InvalidRequest(f"{held}: a snapshot starts at 0 to {length}, got {since}")
            cache = self.cache.read(sequence_id, since)
        return snapshots.encode(cache, self.cache.identity, length, owner, since, token_ids)

    def restore(self, sequence_id: SequenceId, blob: bytes | Sequence[bytes], owner: str = "") -> int:
        """Start `sequence_id` holding the cache of `blob` (or of several: a snapshot's increments, in
        order) (a START: a live sequence of that id restarts); its length. A blob of another model,
        graph, dtype or owner, or increments that leave a gap, change nothing."""
        blobs = [blob] if isinstance(blob, bytes | bytearray | memoryview) else list(blob)
        cache, length = snapshots.decode_chunks(blobs, self.cache.identity, owner)
        if length > self.max_positions:
            raise errors.SequenceTooLong(sequence_id, length, self.max_positions)
        self._start(sequence_id, length)
        with self._lock:
            self.cache.write(sequence_id, cache, length)
        return length

    def fork(self, sequence_id: SequenceId, into: SequenceId) -> int:
        """Start `into` holding a copy of the live sequence's cache (on the cache's device); both go on
        independently. Its length."""
        if into == sequence_id:
            raise errors.InvalidRequest(f"sequence {sequence_id!r} cannot be forked into itself: give a new id")
        with self._lock:
            length = self._touched(sequence_id)
        return self._start_copy(into, sequence_id, length)

    def rename(self, sequence_id: SequenceId, into: SequenceId, aside: bool = True) -> None:
        """The live sequence goes on as `into` (the engine core keeps a finished generation's row for prefix
        reuse this way, and a next turn takes a kept row over), with `aside` its row moved aside from the live
        ones (CacheManager.rename); `sequence_id` has ended."""
        with self._lock:
            self._slots.rename(sequence_id, into).sequence_id = into
            self.cache.rename(sequence_id, into, aside=aside)

    def rewind(self, sequence_id: SequenceId, length: int) -> int:
        """The live sequence keeps its first `length` positions; the next step continues from there."""
        with self._lock:
            held = self._touched(sequence_id)
            if not 0 <= length <= held:
                raise errors.InvalidRequest(
                    f"sequence {sequence_id!r} holds {held} positions: a rewind goes to 0 to {held}, got {length}"
                )
            self.cache.rewind(sequence_id, length)
            return length

    def attention_maps(self, sequence_id: SequenceId, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """The output (1, T, d_model) and each layer's attention weights `attention.{i}` (1, n_heads, T,
        length + T) of a step of `tokens` (T, d_model) (ids (T,)) on the live sequence, computed by the
        inspection graph (fp32) over a copy of its cache as floats (a quantized cache dequantized as its kernel
        reads it): its length and its cache are untouched."""
        with self._lock:
            length = self._touched(sequence_id)
            if length + len(tokens) > self.max_positions:
                raise errors.SequenceTooLong(sequence_id, length + len(tokens), self.max_positions)
            past = {name: array[None] for name, array in self.cache.read_floats(sequence_id).items()}
        return self.inspection.session_step(past, tokens)

    # --- named prefixes ------------------------------------------------------------------------------

    def put_prefix(self, owner: str, name: str, tokens: np.ndarray) -> int:
        """Prefill `tokens` (T, d_model) (a whole model's ids (T,)) once into a row of its own, kept as
        the prefix `name` of
        `owner` until deleted (it takes a row of the budget); its length. A prefix is immutable: an
        existing name is refused."""
        if len(tokens) == 0 or len(tokens) > self.max_positions:
            raise errors.InvalidRequest(
                f"prefix {name!r}: expected 1 to {self.max_positions} tokens (max_seq_len), got {len(tokens)}"
            )
        holder = prefix_holder(owner, name)
        with self._lock:
            if self.cache.holds(holder):
                raise errors.InvalidRequest(f"prefix {name!r} exists and is immutable: delete it first")
            self._allocate(holder, name, len(tokens))
        # nobody reads a prefix's output: its last position's only is the least to compute
        output = self.cache.run({holder: step_tokens(self.cfg, tokens, self.cache.dtype)}, last_only=True)[holder]
        if isinstance(output, Exception):
            self.delete_prefix(owner, name)
            raise output
        return self.cache.length(holder)

    def start_from_prefix(self, sequence_id: SequenceId, owner: str, name: str) -> int:
        """START `sequence_id` holding a copy of the prefix's cache; its length."""
        holder = prefix_holder(owner, name)
        with self._lock:
            if not self.cache.holds(holder):
                raise errors.UnknownPrefix(name)
            length = self.cache.length(holder)
        return self._start_copy(sequence_id, holder, length)

    def delete_prefix(self, owner: str, name: str) -> None:
        """Free the prefix's row; sessions started from it keep their own copies."""
        holder = prefix_holder(owner, name)
        with self._lock:
            if not self.cache.holds(holder):
                raise errors.UnknownPrefix(name)
            self.cache.free(holder)

    def prefixes(self, owner: str) -> dict[str, int]:
        """The owner's prefixes: name -> positions."""
        with self._lock:
            held = [
                holder for holder in self.cache.holders() if isinstance(holder, tuple) and holder[:2] == (PREFIX, owner)
            ]
            return {holder[2]: self.cache.length(holder) for holder in held}

    def _start_copy(self, sequence_id: SequenceId, source: Holder, length: int) -> int:
        """START `sequence_id` holding a copy of what `source` holds (`length` positions); its length."""
        self._start(sequence_id, length)
        with self._lock:
            self.cache.copy(source, sequence_id)
            return self.cache.length(sequence_id)

    def _give_back(self, slot: Slot) -> None:
        self.cache.free(slot.sequence_id)

    def _end(self, sequence_id: SequenceId) -> None:
        with self._lock:
            self._slots.end(sequence_id)

    def evict_idle(self) -> list[SequenceId]:
        with self._lock:
            return self._slots.evict_idle()

    def sequences(self) -> int:
        return len(self._slots)

    def stats(self) -> CacheStats:
        """The manager's running counts: reading them walks no sequence (they include the named prefixes'
        rows, which take the budget as a sequence's do)."""
        with self._lock:
            return CacheStats(
                sequences=len(self._slots),
                held_bytes=self.cache.held_total,
                reserved_bytes=self.cache.reserved_total,
                budget_bytes=self.cache.budget_bytes,
                evictions=self._slots.evictions,
                allocated_bytes=self.cache.allocated_bytes,
            )
