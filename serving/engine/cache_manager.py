"""The static engine's one face onto its KV cache: everything it asks of the cache is asked here, by
holder (a session's sequence id, or a named prefix's key `("prefix", owner, name)`): allocate, grow,
free, run a step ({holder: tokens} -> {holder: output or error}), read and write (snapshot and
restore), copy (fork), rewind, a holder's length, and the numbers of the engine's stats. Slabs, rows
and their moves are this module's own business (the shape of onnxruntime-genai's `KeyValueCache`
and vLLM v1's `kv_cache_manager`, whose blocks the scheduler never sees).

Rows are sized to the holder. A row is one of a few sizes (`row_sizes`: max_seq_len halved down to
the smallest); rows of a size live in slabs, a `KVPool` each (serving/engine/kv_pool.py) of rows of
that size. A holder starts in the smallest row that holds its first step and moves up one size at
a time as it grows, by one copy of what it holds, so a row is at most twice what its holder holds
(a 1,000-token session in a 1,024-position row). Admission is by bytes: a row comes from an open
slab of its size with a free row, else from a new slab while the budget has room for it, made by
closing empty slabs and then by packing the rows of other sizes into fewer slabs (`_packing`); else
the allocation (or the growth) is refused (`RowsFull`, saying what was asked and where the free bytes
are), and a refused one changes nothing. Nothing a request asks walks the holders or the slabs: the
slabs with a free row and the empty ones are indexed, the bytes counted as they change.

Why slabs and not one buffer per size or one per row: a decode step of several rows is one graph run
only over rows of one buffer (GroupQueryAttention reads a batch of rows of one stride), so rows of a
size share slabs of several rows; a slab of its own per size would fix how the budget splits between
sizes before any session came. A decode step therefore costs one graph run per slab with stepping
rows (bench/capacity.py measures what that costs against one pool).

A slab whose last row is freed stays open, with its decode windows, for the next holder of its size:
opening one per fork or prefix start (its buffers' pages faulted in again, its windows bound again)
was most of what such a start cost (issue 29, point 10). Empty slabs are closed only when the budget
needs their room for a slab of another size. The slabs of one size on a device share one row-copy
kernel (serving/engine/kernels.py).

With `full_rows` (what ONNX Runtime's CUDA graphs need) the cache is one slab of rows of the largest
size, opened with the manager and never another: a captured graph holds its buffers' addresses,
which a slab opened or closed later would not keep.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import threading
from collections.abc import Hashable, Iterable, Mapping

import numpy as np

from contract import names
from contract.config import ModelConfig
from serving.engine import snapshots
from serving.engine.kernels import RowCopy
from serving.engine.kv_pool import KVPool, cache_layout, dequantized
from serving.engine.ort import CPU, session_device, session_float_dtype, uses_cuda_graphs
from serving.engine.settings import MAX_LIVE_SEQUENCES, MIN_ROW_POSITIONS

Holder = Hashable  # a sequence id, or a named prefix's key (`prefix_holder`)
PREFIX = "prefix"

# A slab holds 1 to 4 rows of the largest size, as many as a sixteenth of the budget holds (and as
# many bytes of rows of a smaller one). Larger slabs step more sessions in one graph run; smaller ones
# waste less: an empty slab stays open until the budget needs its room, so a size's open slabs can
# stand mostly empty. On the CPU a run more costs little (kv_pool.py's MERGE_BYTES: a split run 1.65 ms
# against 1.91 ms merged); bench/capacity.py measures 16 sessions in one slab against spread over several.
SLAB_LARGEST_ROWS = 4
SLAB_BUDGET_SHARE = 16


def prefix_holder(owner: str, name: str) -> tuple[str, str, str]:
    """The holder of the named prefix `name` of `owner` (a tuple: never a Triton sequence id)."""
    return (PREFIX, owner, name)


class RowsFull(Exception):
    """The budget has no room for a row of `positions` positions (what is live holds it)."""

    def __init__(self, positions: int, message: str) -> None:
        super().__init__(message)
        self.positions = positions


def row_sizes(max_seq_len: int, smallest: int = MIN_ROW_POSITIONS) -> tuple[int, ...]:
    """The row capacities for `max_seq_len`, smallest first: it halved while at least `smallest`."""
    sizes = [max_seq_len]
    while sizes[-1] // 2 >= smallest:
        sizes.append(sizes[-1] // 2)
    return tuple(reversed(sizes))


def cache_kind(cache_dtype: type, width: int, head_dim: int) -> str:
    """What a cache of `cache_dtype` and `width` values a position holds: float32, float16, int8, or
    int4 (two values a byte: its rows are half as wide as a head)."""
    dtype = np.dtype(cache_dtype)
    return names.INT4_CACHE if width * 2 == head_dim and dtype == np.uint8 else dtype.name


@dataclasses.dataclass(eq=False)  # hashed by identity: the manager's indexes are sets of slabs
class _Slab:
    pool: KVPool
    free: list[int]  # a heap: the lowest free row first, so live rows cluster and windows stay short
    holders: dict[int, Holder] = dataclasses.field(default_factory=dict)  # live row -> its holder

    @property
    def size(self) -> int:
        return self.pool.capacity

    @property
    def live(self) -> int:
        return self.pool.rows - len(self.free)

    @property
    def empty(self) -> bool:
        return len(self.free) == self.pool.rows


@dataclasses.dataclass(frozen=True)
class _Place:
    slab: _Slab
    row: int  # the row inside the slab's pool


def _amount(nbytes: int) -> str:
    """Bytes as people read them: in MiB from one MiB up, else in KiB."""
    return f"{nbytes / (1 << 20):.2f} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:.1f} KiB"


def _live(slab: _Slab) -> int:
    return slab.live


class CacheManager:
    """The KV cache of the static graph of `session` within `budget_bytes`, by holder."""

    def __init__(
        self,
        session,
        cfg: ModelConfig,
        budget_bytes: int,
        sizes: tuple[int, ...] | None = None,
        max_rows: int = MAX_LIVE_SEQUENCES,
        full_rows: bool = False,
        graph: str = "",
        graph_sha256: str = "",
        scales: Mapping[str, np.ndarray] | None = None,
        last_logits_session=None,
    ) -> None:
        """`sizes`: the row sizes (default: `row_sizes(cfg.max_seq_len)`); the largest is the most
        positions a holder holds. At most `max_rows` holders at once. `full_rows`: one slab of rows of
        the largest size, as many as the budget holds, opened now and never another. `graph` and its
        `graph_sha256`: what its snapshots name (snapshots.fingerprint). `scales`: a quantized cache's
        (kv_pool.cache_scales), what `read_floats` dequantizes with. `last_logits_session`: a whole model's
        graph answering the last position's logits only (kv_pool.last_logits_graph), given to every slab:
        `run(..., last_only=True)` prefills through it."""
        sizes = sizes or row_sizes(cfg.max_seq_len)
        assert list(sizes) == sorted(set(sizes)) and sizes[-1] <= cfg.max_seq_len, sizes
        self.session, self.cfg, self.budget_bytes, self.max_rows = session, cfg, budget_bytes, max_rows
        self.sizes = sizes[-1:] if full_rows else tuple(sizes)
        self.full_rows = full_rows
        self.cache_dtype, width = cache_layout(session)
        self.cache_kind = cache_kind(self.cache_dtype, width, cfg.head_dim)
        self.dtype, self.device = session_float_dtype(session), session_device(session)
        self.cuda_graphs = uses_cuda_graphs(session)
        self.scales = dict(scales or {})
        self.last_logits_session = last_logits_session
        self.identity = snapshots.fingerprint(cfg, self.cache_dtype, graph, graph_sha256)
        self._row_bytes: dict[int, int] = {}  # size -> bytes, known once (each reads the session's inputs)
        largest = self.row_bytes(self.sizes[-1])
        self._slab_bytes = largest * max(1, min(SLAB_LARGEST_ROWS, budget_bytes // SLAB_BUDGET_SHARE // largest))
        # Kept as they change, never summed on a request: a request's cost must not grow with the holders
        # and slabs the budget holds (issue 34, item 5)
        self._slabs: dict[_Slab, None] = {}  # ordered sets, by opening
        self._with_room: dict[int, dict[_Slab, None]] = {size: {} for size in self.sizes}  # open slabs with a free row
        self._empty: dict[_Slab, None] = {}  # open slabs with no live row: closed when the budget needs their room
        self._allocated = 0  # bytes of the open slabs
        self._reserved = 0  # bytes of the rows holders hold
        self._held_positions = 0  # positions every holder holds; `run` changes it outside the engine's lock
        self._held_lock = threading.Lock()
        self._places: dict[Holder, _Place] = {}
        self._row_copies: dict[int, RowCopy] = {}  # size -> the kernel its slabs share (on a device)
        self.slabs_opened = 0  # since the start: what a fork or a prefix start costs shows here
        self.rows_moved = 0  # by packing rows into fewer slabs (`_compact`), since the start
        smallest = self.row_bytes(self.sizes[0])
        if budget_bytes < smallest:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no row ({smallest} bytes the smallest)")
        if full_rows:
            self._open(self.sizes[-1], min(max_rows, budget_bytes // largest))
        mib = budget_bytes / (1 << 20)
        rows = (
            f"{next(iter(self._slabs)).pool.rows} full rows of {self.sizes[-1]}"
            if full_rows
            else "rows of " + ", ".join(map(str, self.sizes))
        )
        self.description = f"caches on {self.device}, {self.cache_kind}: {rows} positions from a {mib:.0f} MiB budget"

    # --- what the budget holds -----------------------------------------------------------------------

    def row_bytes(self, size: int) -> int:
        """Bytes a row of `size` positions takes of the budget (every buffer; not the scratch position
        each row also has, kv_pool.py)."""
        known = self._row_bytes.get(size)
        if known is None:
            known = self._row_bytes[size] = KVPool.row_bytes_for(self.session, self.cfg, size)
        return known

    @property
    def capacity(self) -> int:
        """The most positions a holder holds (the largest row)."""
        return self.sizes[-1]

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the budget the open slabs take."""
        return self._allocated

    @property
    def reserved_total(self) -> int:
        """Bytes of the budget the rows of every holder (sequences and named prefixes) take."""
        return self._reserved

    @property
    def held_total(self) -> int:
        """Bytes the positions of every holder hold."""
        return self._held_positions * self.bytes_per_position

    @property
    def most_rows(self) -> int:
        """The most holders the budget holds at once: each in a row of the smallest size."""
        return self.most_rows_of(self.sizes[0])

    def most_rows_of(self, size: int) -> int:
        """The most rows of `size` positions the budget holds at once (at most `max_rows`)."""
        if self.full_rows:
            return next(iter(self._slabs)).pool.rows
        return min(self.max_rows, self.budget_bytes // self.row_bytes(size))

    @property
    def bytes_per_position(self) -> int:
        """Bytes one cached position takes in every buffer."""
        return self.row_bytes(1)

    def slab_count(self) -> int:
        return len(self._slabs)

    def waste(self) -> dict[str, int]:
        """Where the budget is not holders' rows: `free` (no slab), `empty_slabs` (open, no live row: given
        back when needed) and `free_rows` (free rows of slabs with live rows: given back only by moving them,
        `_compact`), in bytes. Walks the slabs: for reports and tests, not for requests."""
        free_rows = sum(len(slab.free) * self.row_bytes(slab.size) for slab in self._slabs if not slab.empty)
        empty = sum(slab.pool.rows * self.row_bytes(slab.size) for slab in self._empty)
        return {"free": self.budget_bytes - self._allocated, "empty_slabs": empty, "free_rows": free_rows}

    def holders(self) -> list[Holder]:
        return list(self._places)

    def holds(self, holder: Holder) -> bool:
        return holder in self._places

    def length(self, holder: Holder) -> int:
        """Positions `holder` holds."""
        place = self._places[holder]
        return int(place.slab.pool.lengths[place.row])

    def row_capacity(self, holder: Holder) -> int:
        """The positions `holder`'s row holds now (it moves to a larger one as it grows)."""
        return self._places[holder].slab.size

    def reserved_bytes(self, holders: Iterable[Holder]) -> int:
        """What the rows of `holders` take of the budget."""
        return sum(self.row_bytes(self._places[holder].slab.size) for holder in holders)

    # --- holders -------------------------------------------------------------------------------------

    def allocate(self, holder: Holder, positions: int) -> None:
        """An empty row for `holder` that holds `positions` positions; RowsFull when there is no room."""
        assert holder not in self._places, f"{holder!r} holds a row already"
        if len(self._places) >= self.max_rows:
            raise RowsFull(positions, f"the engine holds its most sequences at once ({self.max_rows})")
        self._places[holder] = self._place(holder, self._size_for(positions), positions)

    def free(self, holder: Holder) -> None:
        """`holder`'s row goes back to its slab (which stays open for the next holder of its size)."""
        self._add_held(-self.length(holder))
        self._give(self._places.pop(holder))

    def grow(self, holder: Holder, positions: int) -> None:
        """`holder` holds `positions` positions from now on: moved, with what it holds, to a larger row
        when its own is too small (RowsFull when there is no room; it then stays as it was)."""
        place = self._places[holder]
        if positions <= place.slab.size:
            return
        target = self._place(holder, self._size_for(positions), positions, growing=place)
        place = self._places[holder]  # packing the slabs for its room may have moved it
        target.slab.pool.copy_row(place.row, target.row, place.slab.pool)
        self._places[holder] = target
        self._give(place)

    def _size_for(self, positions: int) -> int:
        size = next((size for size in self.sizes if size >= positions), None)
        if size is None:
            raise ValueError(f"{positions} positions exceed the largest row ({self.sizes[-1]})")
        return size

    def _place(self, holder: Holder, size: int, positions: int, growing: _Place | None = None) -> _Place:
        """A free row of `size` for `holder`: in an open slab of that size, else in a new one (closing empty
        slabs, then packing other sizes' rows into fewer slabs, when the budget needs their room).
        `growing`: where the holder is now, for what a refusal says."""
        with_room = self._with_room[size]
        if with_room:
            return self._take(next(iter(with_room)), holder)
        row_bytes = self.row_bytes(size)
        if self.full_rows or not self._make_room(row_bytes, size):
            raise RowsFull(positions, self._full_message(size, positions, growing))
        rows = max(1, min(self._slab_bytes, self.budget_bytes - self._allocated) // row_bytes)
        return self._take(self._open(size, rows), holder)

    def _make_room(self, needed: int, size: int) -> bool:
        """Whether the budget has `needed` bytes free, after closing empty slabs and then, where that is
        not enough, packing the rows of other sizes into fewer slabs (`_compact`)."""
        room = self.budget_bytes - self._allocated
        empty_bytes = sum(slab.pool.rows * self.row_bytes(slab.size) for slab in self._empty)
        if room + empty_bytes < needed:
            moves = self._packing(needed - room - empty_bytes, size)
            if moves is None:
                return False
            self._compact(moves)
        for slab in list(self._empty):
            if self.budget_bytes - self._allocated >= needed:
                break
            self._close(slab)
        return True

    def _packing(self, short: int, size: int) -> list[tuple[_Slab, _Slab]] | None:
        """Moves (from slab, into slab) of live rows of sizes other than `size` that leave slabs empty
        worth at least `short` bytes, None when packing every size cannot give that much. Only the plan:
        nothing moves.

        Per size, a slab is emptied when the free rows of the others hold its live ones, the emptiest
        first, into the fullest. A slab that cannot be emptied then had more rows than the size's free
        rows in all, and those only fall as slabs empty: what packing leaves of a size's free rows is
        less than one slab (the bound docs/design.md states)."""
        moves: list[tuple[_Slab, _Slab]] = []
        gained = 0
        for other in self.sizes:
            if other == size:
                continue  # every slab of it is full, or it would not be asked for room
            slabs = sorted((slab for slab in self._slabs if slab.size == other and not slab.empty), key=_live)
            live = {slab: slab.live for slab in slabs}
            free = sum(len(slab.free) for slab in slabs)
            receivers = collections.deque(slab for slab in reversed(slabs) if slab.free)  # the fullest first
            for donor in slabs:
                if free < donor.pool.rows:
                    continue  # the others' free rows cannot hold its live ones
                while live[donor]:
                    receiver = receivers[0] if receivers[0] is not donor else receivers[1]
                    taken = min(live[donor], receiver.pool.rows - live[receiver])
                    moves += [(donor, receiver)] * taken
                    live[receiver] += taken
                    live[donor] -= taken
                    if live[receiver] == receiver.pool.rows:
                        receivers.remove(receiver)
                if donor in receivers:
                    receivers.remove(donor)
                live[donor] = donor.pool.rows  # emptied: it takes no row back
                free -= donor.pool.rows
                gained += donor.pool.rows * self.row_bytes(other)
                if gained >= short:
                    return moves
        return None

    def _compact(self, moves: list[tuple[_Slab, _Slab]]) -> None:
        """Each move: a live row of the first slab to a free row of the second (one size), its holder's
        place with it; what a holder holds is unchanged. The emptied slabs join the empty ones."""
        for donor, receiver in moves:
            row, holder = next(iter(donor.holders.items()))
            source, target = _Place(donor, row), self._take(receiver, holder)
            receiver.pool.copy_row(row, target.row, donor.pool)
            self._places[holder] = target
            self._give(source)
        self.rows_moved += len(moves)

    def _take(self, slab: _Slab, holder: Holder) -> _Place:
        row = heapq.heappop(slab.free)
        slab.pool.reset(row)
        slab.holders[row] = holder
        if not slab.free:
            del self._with_room[slab.size][slab]
        self._empty.pop(slab, None)
        self._reserved += self.row_bytes(slab.size)
        return _Place(slab, row)

    def _give(self, place: _Place) -> None:
        """A row back to its slab, holding nothing (what it held was counted off, or moved)."""
        slab = place.slab
        del slab.holders[place.row]
        slab.pool.reset(place.row)  # a free row's length 0: decode windows read nothing of it
        heapq.heappush(slab.free, place.row)
        self._with_room[slab.size][slab] = None
        if slab.empty:
            self._empty[slab] = None
        self._reserved -= self.row_bytes(slab.size)

    def _open(self, size: int, rows: int) -> _Slab:
        pool = KVPool(
            self.session,
            self.cfg,
            rows=rows,
            capacity=size,
            row_copy=self._row_copies.get(size),
            last_logits_session=self.last_logits_session,
        )
        if pool.device != CPU:  # on the host rows move as array copies: no kernel
            self._row_copies[size] = pool.row_copy
        slab = _Slab(pool, list(range(rows)))
        self._slabs[slab] = None
        self._with_room[size][slab] = None
        self._empty[slab] = None
        self._allocated += rows * self.row_bytes(size)
        self.slabs_opened += 1
        return slab

    def _close(self, slab: _Slab) -> None:
        """An empty slab closed: its buffers' memory goes with the pool's last reference."""
        assert slab.empty
        del self._slabs[slab], self._with_room[slab.size][slab], self._empty[slab]
        self._allocated -= slab.pool.rows * self.row_bytes(slab.size)

    def _add_held(self, positions: int) -> None:
        with self._held_lock:
            self._held_positions += positions

    def _full_message(self, size: int, positions: int, growing: _Place | None) -> str:
        """Why a row of `size` is refused: what was asked (a growing holder: from what length to what), and
        where the budget's free bytes are (none of them is room for the row)."""
        row = f"a row of {size} positions ({_amount(self.row_bytes(size))})"
        if growing is None:
            wanted = f"{row} does not fit"
        else:
            held = int(growing.slab.pool.lengths[growing.row])
            wanted = f"growing from {held} to {positions} positions, it needs {row} for its row of {growing.slab.size}"
        waste = self.waste()
        return (
            f"the KV cache budget is full: {len(self._places)} rows hold live sequences in "
            f"{_amount(self._reserved)} of {_amount(self.budget_bytes)}; {wanted}. Free: {_amount(waste['free'])} "
            f"outside any slab, {_amount(waste['free_rows'])} in free rows of other sizes' slabs, too few to empty "
            f"a slab by moving rows; retry later or end a sequence"
        )

    # --- steps and whole rows, by holder ---------------------------------------------------------------

    def run(self, steps: Mapping[Holder, np.ndarray], last_only: bool = False) -> dict[Holder, np.ndarray | Exception]:
        """Append each holder's new tokens steps[holder] (T, d_model), or a whole model's ids (T,) int64,
        and return its output (T, d_model) (logits (T, vocab)) in the graph's float dtype, or the
        exception its graph run raised (it then holds what it held). `last_only`: every holder's last
        position's only, (1, width) (KVPool.run).
        One graph run per slab with holders stepping one token (KVPool.run). Each holder must have
        room for its new length (`grow` first)."""
        by_slab: dict[int, tuple[_Slab, dict[int, Holder]]] = {}  # id(slab) -> (slab, {row: holder})
        for holder in steps:
            place = self._places[holder]
            by_slab.setdefault(id(place.slab), (place.slab, {}))[1][place.row] = holder
        before = sum(self.length(holder) for holder in steps)
        results: dict[Holder, np.ndarray | Exception] = {}
        for slab, rows in by_slab.values():
            outputs = slab.pool.run({row: steps[holder] for row, holder in rows.items()}, last_only)
            results.update({rows[row]: output for row, output in outputs.items()})
        self._add_held(sum(self.length(holder) for holder in steps) - before)  # a failed run may have added some
        return results

    def read(self, holder: Holder, start: int = 0) -> dict[str, np.ndarray]:
        """What `holder` holds from position `start`: past name -> (n_kv, length - start, width) in the
        cache dtype (a quantized cache's codes), fresh host arrays."""
        place = self._places[holder]
        return {name: array[0] for name, array in place.slab.pool.read(place.row, start).items()}

    def read_floats(self, holder: Holder) -> dict[str, np.ndarray]:
        """What `holder` holds as float32 (n_kv, length, head_dim) by past name: a quantized cache's codes
        dequantized on the host as the kernel reads them (with the graph's scales)."""
        cache = self.read(holder)
        if self.cache_kind not in (names.INT8_CACHE, names.INT4_CACHE):
            return {name: array.astype(np.float32, copy=False) for name, array in cache.items()}
        assert set(self.scales) == set(cache), f"a {self.cache_kind} cache read as floats needs its graph's scales"
        return {name: dequantized(array, self.scales[name], self.cache_kind) for name, array in cache.items()}

    def write(self, holder: Holder, cache: Mapping[str, np.ndarray], length: int) -> None:
        """`holder` holds `cache` (as `read` gives it, `length` positions) from now on."""
        self.grow(holder, length)
        place, before = self._places[holder], self.length(holder)
        place.slab.pool.write(place.row, cache, length)
        self._add_held(length - before)

    def copy(self, source: Holder, target: Holder) -> None:
        """`target` holds what `source` holds (on the device when it has one)."""
        self.grow(target, self.length(source))
        (source_place, target_place) = self._places[source], self._places[target]
        before = self.length(target)
        target_place.slab.pool.copy_row(source_place.row, target_place.row, source_place.slab.pool)
        self._add_held(self.length(target) - before)

    def rewind(self, holder: Holder, length: int) -> None:
        """`holder` keeps its first `length` positions (0 to its length)."""
        place, before = self._places[holder], self.length(holder)
        place.slab.pool.rewind(place.row, length)
        self._add_held(length - before)
