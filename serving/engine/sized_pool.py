"""Rows sized to the session: the static engine's KV budget in bytes, spent on rows as long as each
session needs, not on one row of `max_seq_len` per session from its START.

A row's size is one of a few capacities, `max_seq_len` halved down to `MIN_ROW_POSITIONS` (4096, 2048,
1024, 512, 256). Rows of one size live in slabs: a slab is a `KVPool` (serving/engine/kv_pool.py) of
rows of that size, its buffers allocated when the slab is opened and freed when its last row is. A
session starts in the smallest row that holds its first step and moves up one size at a time as it
grows, by one copy of what it holds, so a row is at most twice what its session holds (a 1,000-token
session in a 1,024-position row). Admission is by bytes: a row comes from a slab of its size with a
free row, else from a new slab while the budget has room for it; else the START (or the step that
outgrows its row) is refused, and a refused step changes nothing.

Why slabs and not one buffer per size or one per row: a decode step of several rows is one graph run
only over rows of one buffer (GroupQueryAttention reads a batch of rows of one stride), so rows of a
size share slabs of several rows; a slab of its own per size would fix how the budget splits between
sizes before any session came. A decode step therefore costs one graph run per slab with stepping
rows (bench/capacity.py measures what that costs against one pool).

Row ids are the engine's handles: a row keeps its id for its life, also when it moves to a larger
size. With CUDA graphs a session's pool is one slab of full rows (`SizedPool.whole`): a captured
graph holds its buffers' addresses, which a slab opened or freed later would not keep.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from contract.config import ModelConfig
from serving.engine.kv_pool import KVPool
from serving.engine.settings import MIN_ROW_POSITIONS

# A slab holds 1 to 4 rows of the largest size, as many as a sixteenth of the budget holds (and as
# many bytes of rows of a smaller one). Larger slabs step more sessions in one graph run; smaller ones
# waste less: a slab is given back only when its last row is, so a size's last open slab can stand
# mostly empty, at most one per size (5 of 6 sizes at most 5/16 of the budget, less as sessions come).
# On the CPU a run more costs little (kv_pool.py's MERGE_BYTES: a split run 1.65 ms against 1.91 ms
# merged); bench/capacity.py measures 16 sessions in one slab against spread over several.
SLAB_LARGEST_ROWS = 4
SLAB_BUDGET_SHARE = 16


class RowsFull(Exception):
    """The budget has no room for a row of `positions` positions (what is live holds it)."""

    def __init__(self, positions: int, message: str) -> None:
        super().__init__(message)
        self.positions = positions


def cache_kind(pool: KVPool) -> str:
    """What a pool's cache holds: float32, float16, int8, or int4 (two values a byte: its rows are
    half as wide as a head)."""
    dtype = np.dtype(pool.cache_dtype)
    return "int4" if pool.row_shape[-1] * 2 == pool.cfg.head_dim and dtype == np.uint8 else dtype.name


def row_sizes(max_seq_len: int, smallest: int = MIN_ROW_POSITIONS) -> tuple[int, ...]:
    """The row capacities for `max_seq_len`, smallest first: it halved while at least `smallest`."""
    sizes = [max_seq_len]
    while sizes[-1] // 2 >= smallest:
        sizes.append(sizes[-1] // 2)
    return tuple(reversed(sizes))


@dataclasses.dataclass
class _Slab:
    pool: KVPool
    free: list[int]  # a heap: the lowest free row first, so live rows cluster and windows stay short
    fixed: bool = False  # opened with the engine and kept (SizedPool.whole)

    @property
    def size(self) -> int:
        return self.pool.capacity

    @property
    def empty(self) -> bool:
        return len(self.free) == self.pool.rows


@dataclasses.dataclass(frozen=True)
class _Place:
    slab: _Slab
    row: int  # the row inside the slab's pool


class SizedPool:
    """Rows of the sizes `sizes` for the static graph of `session`, from a budget of `budget_bytes`."""

    def __init__(
        self,
        cfg: ModelConfig,
        budget_bytes: int,
        sizes: tuple[int, ...],
        open_slab: Callable[[int, int], KVPool],
        row_bytes: Callable[[int], int],
        max_rows: int,
    ) -> None:
        """`open_slab(rows, size)` makes a KVPool of `rows` rows of `size` positions; `row_bytes(size)`
        is what one such row takes of the budget (every buffer, its `size` positions); at most `max_rows`
        rows are live at once."""
        assert sizes and list(sizes) == sorted(set(sizes)) and sizes[-1] <= cfg.max_seq_len, sizes
        self.cfg, self.budget_bytes, self.sizes, self.max_rows = cfg, budget_bytes, sizes, max_rows
        self._open_slab, self._row_bytes = open_slab, row_bytes
        largest = row_bytes(sizes[-1])
        self._slab_bytes = largest * max(1, min(SLAB_LARGEST_ROWS, budget_bytes // SLAB_BUDGET_SHARE // largest))
        self._slabs: list[_Slab] = []
        self._places: dict[int, _Place] = {}
        self._free_ids: list[int] = []  # a heap of ids given back; past them, ids are new
        self._next_id = 0
        if budget_bytes < row_bytes(sizes[0]):
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds no row ({row_bytes(sizes[0])} bytes the smallest)"
            )
        first = self._open(sizes[0])  # the graph's dtype and device, known before any session comes
        self.identity, self.description = first.pool.identity, ""  # the factory names the graph in both
        self.dtype, self.device, self.cuda_graphs = first.pool.dtype, first.pool.device, first.pool.cuda_graphs
        self.cache_dtype, self.cache_kind = first.pool.cache_dtype, cache_kind(first.pool)
        self._close_if_empty(first)

    @classmethod
    def whole(cls, pool: KVPool) -> SizedPool:
        """The rows of one pool of full rows, and no more: the budget is that pool."""

        def no_more(rows: int, size: int) -> KVPool:
            raise AssertionError("a whole pool opens no slab")

        row_bytes = KVPool.row_bytes_for(pool.session, pool.cfg, pool.capacity)
        sized = cls.__new__(cls)
        sized.cfg, sized.sizes, sized.max_rows = pool.cfg, (pool.capacity,), pool.rows
        sized.budget_bytes = sized._slab_bytes = pool.rows * row_bytes
        sized._open_slab, sized._row_bytes = no_more, lambda size: row_bytes
        sized._slabs, sized._places, sized._free_ids, sized._next_id = [], {}, [], 0
        sized._slabs.append(_Slab(pool, list(range(pool.rows)), fixed=True))
        sized.identity, sized.description = pool.identity, pool.description
        sized.dtype, sized.device, sized.cuda_graphs = pool.dtype, pool.device, pool.cuda_graphs
        sized.cache_dtype, sized.cache_kind = pool.cache_dtype, cache_kind(pool)
        return sized

    # --- what the budget holds -----------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """The most positions a row holds: max_seq_len."""
        return self.sizes[-1]

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the budget the open slabs take (their rows' positions: the scratch position each row
        also has, kv_pool.py, is outside the budget's count)."""
        return sum(slab.pool.rows * self._row_bytes(slab.size) for slab in self._slabs)

    @property
    def most_rows(self) -> int:
        """The most rows the budget holds at once: all of the smallest size (at most `max_rows`)."""
        return self.most_rows_of(self.sizes[0])

    def most_rows_of(self, size: int) -> int:
        """The most rows of `size` positions the budget holds at once (at most `max_rows`)."""
        return min(self.max_rows, self.budget_bytes // self._row_bytes(size))

    @property
    def bytes_per_position(self) -> int:
        """Bytes one cached position takes in every buffer."""
        return self._row_bytes(self.sizes[0]) // self.sizes[0]

    @property
    def _fixed(self) -> bool:
        return bool(self._slabs) and self._slabs[0].fixed

    def length(self, row: int) -> int:
        place = self._places[row]
        return int(place.slab.pool.lengths[place.row])

    def row_capacity(self, row: int) -> int:
        return self._places[row].slab.size

    def reserved_bytes(self, rows: Iterable[int]) -> int:
        """What the rows `rows` take of the budget."""
        return sum(self._row_bytes(self._places[row].slab.size) for row in rows)

    # --- rows ----------------------------------------------------------------------------------------

    def allocate(self, positions: int) -> int:
        """A new empty row that holds `positions` positions; RowsFull when the budget has no room."""
        if len(self._places) >= self.max_rows and not self._fixed:  # a fixed pool's rows are its bound
            raise RowsFull(positions, f"the engine holds its most sequences at once ({self.max_rows})")
        place = self._place(self._size_for(positions), positions)
        row = heapq.heappop(self._free_ids) if self._free_ids else self._take_new_id()
        self._places[row] = place
        return row

    def free(self, row: int) -> None:
        """Row `row` goes back to its slab (and the slab's memory to the budget when it was its last)."""
        place = self._places.pop(row)
        heapq.heappush(place.slab.free, place.row)
        heapq.heappush(self._free_ids, row)
        self._close_if_empty(place.slab)

    def reserve(self, row: int, positions: int) -> None:
        """Row `row` holds `positions` positions from now on: moved, with what it holds, to a larger
        row when its own is too small (RowsFull when the budget has no room; the row stays as it was)."""
        place = self._places[row]
        if positions <= place.slab.size:
            return
        target = self._place(self._size_for(positions), positions)
        length = int(place.slab.pool.lengths[place.row])
        cache = {name: array[0] for name, array in place.slab.pool.read(place.row).items()}
        target.slab.pool.write(target.row, cache, length)
        self._places[row] = target
        heapq.heappush(place.slab.free, place.row)
        self._close_if_empty(place.slab)

    def _size_for(self, positions: int) -> int:
        size = next((size for size in self.sizes if size >= positions), None)
        if size is None:
            raise ValueError(f"{positions} positions exceed the largest row ({self.sizes[-1]}, max_seq_len)")
        return size

    def _place(self, size: int, positions: int) -> _Place:
        """A free row of `size`: in an open slab of that size, else in a new one."""
        for slab in self._slabs:
            if slab.size == size and slab.free:
                return self._taken(slab)
        room = self.budget_bytes - self.allocated_bytes
        row_bytes = self._row_bytes(size)
        if self._fixed or room < row_bytes:
            raise RowsFull(positions, self._full_message(size))
        rows = max(1, min(self._slab_bytes, room) // row_bytes)
        return self._taken(self._open(size, rows))

    def _taken(self, slab: _Slab) -> _Place:
        row = heapq.heappop(slab.free)
        slab.pool.reset(row)
        return _Place(slab, row)

    def _open(self, size: int, rows: int = 1) -> _Slab:
        pool = self._open_slab(rows, size)
        slab = _Slab(pool, list(range(pool.rows)))
        self._slabs.append(slab)
        return slab

    def _close_if_empty(self, slab: _Slab) -> None:
        if slab.empty and not slab.fixed:
            self._slabs.remove(slab)  # its buffers' memory goes with the pool's last reference

    def _take_new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _full_message(self, size: int) -> str:
        mib = 1 << 20
        return (
            f"the KV cache budget is full: {len(self._places)} rows hold live sequences in "
            f"{self.allocated_bytes / mib:.1f} of {self.budget_bytes / mib:.1f} MiB; a row of {size} positions "
            f"({self._row_bytes(size) / mib:.2f} MiB) does not fit; retry later or end a sequence"
        )

    # --- steps and whole rows, by row id ---------------------------------------------------------------

    def run(self, steps: Mapping[int, np.ndarray]) -> dict[int, np.ndarray | Exception]:
        """KVPool.run for rows of any slab: one KVPool.run per slab with rows stepping (each of its
        decode rows then shares one graph run). Rows must hold their new length (`reserve` first)."""
        by_slab: dict[int, dict[int, int]] = {}  # id(slab) -> {row in the slab: row id}
        slabs = {}
        for row in steps:
            place = self._places[row]
            by_slab.setdefault(id(place.slab), {})[place.row] = row
            slabs[id(place.slab)] = place.slab
        results: dict[int, np.ndarray | Exception] = {}
        for key, rows in by_slab.items():
            outputs = slabs[key].pool.run({local: steps[row] for local, row in rows.items()})
            results.update({rows[local]: output for local, output in outputs.items()})
        return results

    def read(self, row: int, start: int = 0) -> dict[str, np.ndarray]:
        place = self._places[row]
        return place.slab.pool.read(place.row, start)

    def write(self, row: int, cache: Mapping[str, np.ndarray], length: int) -> None:
        self.reserve(row, length)
        place = self._places[row]
        place.slab.pool.write(place.row, cache, length)

    def copy_row(self, source: int, target: int) -> None:
        """Row `target` holds what row `source` holds: on the device within a slab of one size, else
        through the host (rows of two sizes have two strides)."""
        length = self.length(source)
        self.reserve(target, length)
        (source_place, target_place) = self._places[source], self._places[target]
        if source_place.slab is target_place.slab:
            source_place.slab.pool.copy_row(source_place.row, target_place.row)
            return
        cache = {name: array[0] for name, array in self.read(source).items()}
        target_place.slab.pool.write(target_place.row, cache, length)

    def rewind(self, row: int, length: int) -> None:
        place = self._places[row]
        place.slab.pool.rewind(place.row, length)

    def slab_count(self) -> int:
        return len(self._slabs)
