"""`mha_session`'s static engine: every live sequence owns one row (a slot) of a KV pool, and a step
appends its tokens in place (serving/engine/kv_pool.py).

Rows are sized to the session (serving/engine/sized_pool.py): START takes a row that holds its first
step, a step that outgrows its row moves the sequence to a larger one (one copy), END and idle
eviction give it back; the KV budget is bytes, and a START or a step it has no room for is refused
(`cache_full`) and changes nothing. The steps of one execute() run as few graph runs as
GroupQueryAttention allows: the decode steps of all sequences in rows of one slab in one.

A step's `attention_mask` marks which of its new tokens are real. The static form has no mask input,
so padded tokens are dropped before they enter the cache and their output rows are zeros (a padded
query's output is unspecified by the contract). Outputs of the real tokens are unchanged by this:
the model has no positional encoding, so a key's position only matters through causality, which
dropping a masked key does not alter. `length` counts cached (real) tokens only.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from contract import names
from serving.engine import errors, snapshots
from serving.engine.kv_pool import KVPool
from serving.engine.runner import InspectionRunner
from serving.engine.sequences import LiveSequences, SequenceId
from serving.engine.sized_pool import RowsFull, SizedPool
from serving.engine.steps import CacheStats, StepEngine, StepRequest, check_step

FP32_CACHE = "float32"  # the cache kind the inspection graph's past takes as it is


@dataclasses.dataclass
class Slot:
    row: int
    last_used: float


@dataclasses.dataclass(frozen=True)
class _Work:
    index: int  # the request's place in execute()'s answers
    tokens: np.ndarray  # (T_real, d_model) in the pool's dtype
    keep: np.ndarray | None  # (T,) bool: which of the request's tokens are real; None: all of them


class StaticSessionEngine(StepEngine):
    def __init__(
        self,
        pool: SizedPool | KVPool,
        idle_timeout: float,
        remember: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        description: str = "",
        inspection: InspectionRunner | None = None,
    ) -> None:
        """`inspection`: the graph a session's attention maps come from (`attention_maps`)."""
        assert idle_timeout > 0
        # a KVPool: its rows are the engine's, all of max_seq_len (tests and benches that size it)
        pool = SizedPool.whole(pool) if isinstance(pool, KVPool) else pool
        self.pool, self.cfg, self.description = pool, pool.cfg, description
        self.max_positions = pool.capacity
        self.idle_timeout = idle_timeout
        self._clock = clock
        self._slots: LiveSequences[Slot] = LiveSequences(idle_timeout, clock, remember, self._give_back)
        self._lock = threading.Lock()  # execute() and the idle sweeper both change the slots
        self.largest_batch = 0  # most decode steps one graph run has taken
        # named prefixes: (owner, name) -> the row holding its cache, never evicted; a session starts
        # from one as a copy of that row, so a prefix can go whenever it is deleted
        self._prefixes: dict[tuple[str, str], int] = {}
        self.inspection = inspection or InspectionRunner(None, self.cfg)

    @property
    def capacity(self) -> int:
        """The most sequences that fit at once: each in a row of the smallest size."""
        return self.pool.most_rows

    @property
    def full_length_capacity(self) -> int:
        """The most sequences of max_seq_len positions that fit at once."""
        return self.pool.most_rows_of(self.max_positions)

    @property
    def cache_kind(self) -> str:
        """What the cache holds: float32, float16, int8 or int4."""
        return self.pool.cache_kind

    def length(self, sequence_id: SequenceId) -> int:
        with self._lock:
            slot = self._slots.entries.get(sequence_id)
            return -1 if slot is None else self.pool.length(slot.row)

    # --- one execute() ------------------------------------------------------------------------------

    def _prepare(self, request: StepRequest) -> tuple[int, np.ndarray, np.ndarray | None] | None:
        """The request's slot and real tokens; None when there is nothing to compute."""
        new = check_step(self.cfg, request)
        if new == 0 and not request.start:
            return None  # closing: the sequence is gone afterwards whatever the slots know
        keep = None if request.mask is None or request.mask.all() else request.mask[0].astype(bool)
        tokens = request.hidden[0] if keep is None else request.hidden[0][keep]  # (T_real, d_model)
        if request.start:
            if len(tokens) > self.max_positions:
                raise errors.SequenceTooLong(request.sequence_id, len(tokens), self.max_positions)
            row = self._start(request.sequence_id, len(tokens))
        else:
            row = self._grown(request.sequence_id, len(tokens))
        if len(tokens) == 0:
            return None
        return row, tokens.astype(self.pool.dtype, copy=False), keep

    def _run(self, prepared: dict[int, tuple[int, np.ndarray, np.ndarray | None]], results: list) -> None:
        work = {row: _Work(index, tokens, keep) for index, (row, tokens, keep) in prepared.items()}
        outputs = self.pool.run({row: item.tokens for row, item in work.items()})
        decoding = sum(len(item.tokens) == 1 for item in work.values())
        self.largest_batch = max(self.largest_batch, decoding)
        for row, item in work.items():
            output = outputs[row]
            if isinstance(output, Exception):  # not the request's fault; its cache length is unchanged
                results[item.index] = output
                continue
            if item.keep is None:
                results[item.index] = output.astype(np.float32, copy=False)[None]  # (1, T, d_model)
            else:
                full = np.zeros((1, len(item.keep), self.cfg.d_model), np.float32)
                full[0, item.keep] = output
                results[item.index] = full

    # --- slots --------------------------------------------------------------------------------------

    def _start(self, sequence_id: SequenceId, positions: int = 1) -> int:
        """A fresh slot for the sequence that holds `positions`; a repeated START restarts it (as
        Triton does)."""
        with self._lock:
            self._slots.restart(sequence_id)
            row = self._allocate(sequence_id, positions)
            return self._slots.add(sequence_id, Slot(row, self._clock())).row

    def _grown(self, sequence_id: SequenceId, new: int) -> int:
        """The live sequence's row, holding `new` more positions (moved to a larger row if need be)."""
        with self._lock:
            row = self._slots.touch(sequence_id).row
            length = self.pool.length(row) + new
            if length > self.max_positions:
                raise errors.SequenceTooLong(sequence_id, length, self.max_positions)
            try:
                self.pool.reserve(row, length)
            except RowsFull as full:
                raise errors.CacheFull(sequence_id, str(full)) from None
            return row

    def _allocate(self, name: SequenceId | str, positions: int) -> int:
        try:
            return self.pool.allocate(max(positions, 1))
        except RowsFull as full:
            raise errors.CacheFull(name, str(full)) from None

    # --- session operations: snapshot, restore, fork, rewind ------------------------------------------

    def snapshot(self, sequence_id: SequenceId, owner: str = "", since: int = 0) -> bytes:
        """The live sequence's cache from position `since` (0: all of it; more: the increment since a
        checkpoint) as a blob (snapshots.py) only `owner` restores; the sequence goes on unchanged."""
        with self._lock:
            row = self._slots.touch(sequence_id).row
            length = self.pool.length(row)
            if not 0 <= since <= length:
                held = f"sequence {sequence_id!r} holds {length} positions"
                raise errors.InvalidRequest(f"{held}: a snapshot starts at 0 to {length}, got {since}")
            cache = {name: array[0] for name, array in self.pool.read(row, since).items()}
        return snapshots.encode(cache, self.pool.identity, length, owner, since)

    def restore(self, sequence_id: SequenceId, blob: bytes | Sequence[bytes], owner: str = "") -> int:
        """Start `sequence_id` holding the cache of `blob` (or of several: a snapshot's increments, in
        order) (a START: a live sequence of that id restarts); its length. A blob of another model,
        graph, dtype or owner, or increments that leave a gap, change nothing."""
        blobs = [blob] if isinstance(blob, bytes | bytearray | memoryview) else list(blob)
        cache, length = snapshots.decode_chunks(blobs, self.pool.identity, owner)
        if length > self.max_positions:
            raise errors.SequenceTooLong(sequence_id, length, self.max_positions)
        row = self._start(sequence_id, length)
        with self._lock:
            self.pool.write(row, cache, length)
        return length

    def fork(self, sequence_id: SequenceId, into: SequenceId) -> int:
        """Start `into` holding a copy of the live sequence's cache (a row copy on the pool's device);
        both go on independently. Its length."""
        if into == sequence_id:
            raise errors.InvalidRequest(f"sequence {sequence_id!r} cannot be forked into itself: give a new id")
        source = self._row(sequence_id)
        row = self._start(into, self.pool.length(source))
        with self._lock:
            self.pool.copy_row(source, row)
            return self.pool.length(row)

    def rewind(self, sequence_id: SequenceId, length: int) -> int:
        """The live sequence keeps its first `length` positions; the next step continues from there."""
        with self._lock:
            row = self._slots.touch(sequence_id).row
            held = self.pool.length(row)
            if not 0 <= length <= held:
                raise errors.InvalidRequest(
                    f"sequence {sequence_id!r} holds {held} positions: a rewind goes to 0 to {held}, got {length}"
                )
            self.pool.rewind(row, length)
            return length

    def attention_maps(self, sequence_id: SequenceId, tokens: np.ndarray) -> dict[str, np.ndarray]:
        """The output (1, T, d_model) and each layer's attention weights `attention.{i}` (1, n_heads, T,
        length + T) of a step of `tokens` (T, d_model) on the live sequence, computed by the inspection
        graph over a copy of its cache: the row, its length and its cache are untouched."""
        if self.cache_kind != FP32_CACHE:
            raise errors.InvalidRequest(
                f"attention maps of a session need an fp32 cache; this deployment's is {self.cache_kind}"
            )
        with self._lock:
            row = self._slots.touch(sequence_id).row
            length = self.pool.length(row)
            if length + len(tokens) > self.max_positions:
                raise errors.SequenceTooLong(sequence_id, length + len(tokens), self.max_positions)
            past = self.pool.read(row)  # fresh host arrays (the pool's Slice): later steps do not move them
        feeds = {
            names.HIDDEN_STATES: tokens[None].astype(np.float32, copy=False),
            names.ATTENTION_MASK: np.ones((1, length + len(tokens)), np.int64),  # the cache holds real tokens only
            **past,
        }
        if self.cfg.rotary:  # the new tokens sit after what the session holds, as its next step's would
            feeds[names.POSITION_IDS] = length + np.arange(len(tokens), dtype=np.int64)[None]
        outputs = self.inspection.run_arrays(feeds)
        return {name: outputs[name] for name in [names.OUTPUT, *names.attention_map_names(self.cfg.n_layers)]}

    # --- named prefixes ------------------------------------------------------------------------------

    def put_prefix(self, owner: str, name: str, tokens: np.ndarray) -> int:
        """Prefill `tokens` (T, d_model) once into a row of its own, kept as the prefix `name` of
        `owner` until deleted (it takes a row of the budget); its length. A prefix is immutable: an
        existing name is refused."""
        if len(tokens) == 0 or len(tokens) > self.max_positions:
            raise errors.InvalidRequest(
                f"prefix {name!r}: expected 1 to {self.max_positions} tokens (max_seq_len), got {len(tokens)}"
            )
        with self._lock:
            if (owner, name) in self._prefixes:
                raise errors.InvalidRequest(f"prefix {name!r} exists and is immutable: delete it first")
            row = self._allocate(name, len(tokens))
            self._prefixes[owner, name] = row
        output = self.pool.run({row: tokens.astype(self.pool.dtype, copy=False)})[row]
        if isinstance(output, Exception):
            self.delete_prefix(owner, name)
            raise output
        return self.pool.length(row)

    def start_from_prefix(self, sequence_id: SequenceId, owner: str, name: str) -> int:
        """START `sequence_id` holding a copy of the prefix's cache; its length."""
        source = self._prefix_row(owner, name)
        row = self._start(sequence_id, self.pool.length(source))
        with self._lock:
            self.pool.copy_row(source, row)
            return self.pool.length(row)

    def delete_prefix(self, owner: str, name: str) -> None:
        """Free the prefix's row; sessions started from it keep their own copies."""
        row = self._prefix_row(owner, name)
        with self._lock:
            del self._prefixes[owner, name]
            self.pool.free(row)

    def prefixes(self, owner: str) -> dict[str, int]:
        """The owner's prefixes: name -> positions."""
        with self._lock:
            return {name: self.pool.length(row) for (who, name), row in self._prefixes.items() if who == owner}

    def _prefix_row(self, owner: str, name: str) -> int:
        with self._lock:
            row = self._prefixes.get((owner, name))
        if row is None:
            raise errors.UnknownPrefix(name)
        return row

    def _give_back(self, slot: Slot) -> None:
        self.pool.free(slot.row)

    def _row(self, sequence_id: SequenceId) -> int:
        with self._lock:
            return self._slots.touch(sequence_id).row

    def _end(self, sequence_id: SequenceId) -> None:
        with self._lock:
            self._slots.end(sequence_id)

    def evict_idle(self) -> list[SequenceId]:
        with self._lock:
            return self._slots.evict_idle()

    def stats(self) -> CacheStats:
        with self._lock:
            rows = [slot.row for slot in self._slots.entries.values()]
            return CacheStats(
                sequences=len(rows),
                held_bytes=sum(self.pool.length(row) for row in rows) * self.pool.bytes_per_position,
                reserved_bytes=self.pool.reserved_bytes(rows),
                budget_bytes=self.pool.budget_bytes,
                evictions=self._slots.evictions,
                allocated_bytes=self.pool.allocated_bytes,
            )
