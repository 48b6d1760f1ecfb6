"""The static engine's one face onto its KV cache: everything it asks of the cache is asked here, by
holder (a session's sequence id, or a named prefix's key `("prefix", owner, name)`): allocate, grow,
free, rename, run a step ({holder: tokens} -> {holder: output or error}), read and write (snapshot and
restore), copy (fork), rewind, a holder's length, and the numbers of the engine's stats. Rows and their
memory are this module's own business (the shape of onnxruntime-genai's `KeyValueCache` and vLLM v1's
`kv_cache_manager`, whose blocks the scheduler never sees).

One pool, one stride. Every holder has a row of the one KVPool (serving/engine/kv_pool.py), each row
`capacity` (max_seq_len) positions long: GroupQueryAttention reads a batch of rows of one stride only, so
rows of one buffer are what lets every decoding row step in one graph run (the engine core's step,
serving/engine/core.py). What a holder costs is what it reserves: its positions rounded up to a granule
(`min_row_positions`, 256 by default), grown a granule at a time as it holds more, never moved. On the host
the pool's buffers are reserved address space whose pages the kernel commits as rows fill
(kv_pool.host_buffer: an anonymous MAP_NORESERVE mapping) and takes back when a row is freed (madvise
MADV_DONTNEED), so the memory a row takes follows what it holds, and the budget counts reservations: a
1,000-token session reserves 1,024 positions, not max_seq_len. On a device (CUDA) the buffers are memory
the device commits at once, so every holder reserves a full row (`full_rows`), as CUDA graphs need anyway (a
captured graph holds its buffers' addresses).

Admission is by bytes: a holder's allocation or growth is refused (`RowsFull`, saying what was asked and
what the budget holds) when its reservation would pass the budget, or when every row is taken; a refused one
changes nothing. Nothing a request asks walks the holders: the reserved and held totals are counted as they
change, and the free rows are a heap (the lowest first, so live rows cluster and decode windows stay short; a row kept
idle moves to the highest free row, `rename(..., aside=True)`).
"""

from __future__ import annotations

import functools
import heapq
import threading
from collections.abc import Hashable, Mapping

import numpy as np

from contract import names
from contract.config import ModelConfig
from serving.engine import snapshots
from serving.engine.kv_pool import GraphRuns, KVPool, cache_layout, dequantized
from serving.engine.ort import CPU, session_device, session_float_dtype, uses_cuda_graphs
from serving.engine.settings import MAX_LIVE_SEQUENCES, MIN_ROW_POSITIONS

Holder = Hashable  # a sequence id, or a named prefix's key (`prefix_holder`)
PREFIX = "prefix"


def prefix_holder(owner: str, name: str) -> tuple[str, str, str]:
    """The holder of the named prefix `name` of `owner` (a tuple: never a Triton sequence id)."""
    return (PREFIX, owner, name)


class RowsFull(Exception):
    """The budget has no room for a reservation of `positions` positions (what is live holds it)."""

    def __init__(self, positions: int, message: str) -> None:
        super().__init__(message)
        self.positions = positions


def row_sizes(max_seq_len: int, smallest: int = MIN_ROW_POSITIONS) -> tuple[int, ...]:
    """The reservations a holder of a pool of `max_seq_len` rows grows through, smallest first: `smallest` (the
    granule, at most max_seq_len), then each next multiple of it, up to max_seq_len (the last may be shorter)."""
    granule = min(smallest, max_seq_len)
    return (*range(granule, max_seq_len, granule), max_seq_len)


def cache_kind(cache_dtype: type, width: int, head_dim: int) -> str:
    """What a cache of `cache_dtype` and `width` values a position holds: float32, float16, int8, or
    int4 (two values a byte: its rows are half as wide as a head)."""
    dtype = np.dtype(cache_dtype)
    return names.INT4_CACHE if width * 2 == head_dim and dtype == np.uint8 else dtype.name


def _amount(nbytes: int) -> str:
    """Bytes as people read them: in MiB from one MiB up, else in KiB."""
    return f"{nbytes / (1 << 20):.2f} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:.1f} KiB"


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
        """`sizes`: the reservations a holder grows through (`row_sizes`; default: `row_sizes(cfg.max_seq_len)`):
        the first is the granule, the last a row's positions. At most `max_rows` holders at once. `full_rows`:
        every holder reserves a whole row (forced on a device, whose memory is committed at once). `graph` and
        its `graph_sha256`: what its snapshots name (snapshots.fingerprint). `scales`: a quantized cache's
        (kv_pool.cache_scales), what `read_floats` dequantizes with. `last_logits_session`: a whole model's
        graph answering the last position's logits only (kv_pool.last_logits_graph): `run(..., last_only=True)`
        prefills through it."""
        sizes = tuple(sizes or row_sizes(cfg.max_seq_len))
        assert list(sizes) == sorted(set(sizes)) and sizes[-1] <= cfg.max_seq_len, sizes
        self.session, self.cfg, self.budget_bytes, self.max_rows = session, cfg, budget_bytes, max_rows
        self.cache_dtype, width = cache_layout(session)
        self.cache_kind = cache_kind(self.cache_dtype, width, cfg.head_dim)
        self.dtype, self.device = session_float_dtype(session), session_device(session)
        self.cuda_graphs = uses_cuda_graphs(session)
        self.full_rows = full_rows or self.device != CPU
        self.capacity = sizes[-1]
        self.granule = self.capacity if self.full_rows else sizes[0]
        self.sizes = (self.capacity,) if self.full_rows else sizes
        self.scales = dict(scales or {})
        self.identity = snapshots.fingerprint(cfg, self.cache_dtype, graph, graph_sha256)
        self.bytes_per_position = KVPool.row_bytes_for(session, cfg, 1)
        self.pool = self._pool(last_logits_session)
        rows = self.pool.rows
        self.runs: GraphRuns = self.pool.runs
        self._free = list(range(rows))  # a heap: the lowest free row first
        self._rows: dict[Holder, int] = {}
        self._reserved_positions: dict[Holder, int] = {}
        self._reserved = 0  # bytes all holders reserve
        self._held_positions = 0  # positions every holder holds; `run` changes it outside the engine's lock
        self._held_lock = threading.Lock()
        mib = budget_bytes / (1 << 20)
        memory = "committed as they fill" if self.pool.lazy else "committed"
        reserve = f"reserved {self.granule} positions at a time" if not self.full_rows else "reserved whole"
        self.description = (
            f"caches on {self.device}, {self.cache_kind}: {rows} rows of {self.capacity} positions ({memory}, "
            f"{reserve}) from a {mib:.0f} MiB budget"
        )

    def _pool(self, last_logits_session) -> KVPool:
        """As many rows as the budget holds: reserved a granule at a time in a pool whose pages are committed as
        rows fill, or, where the kernel gives no address space beyond memory (strict overcommit), whole rows."""
        smallest = self.granule * self.bytes_per_position
        if self.budget_bytes < smallest:
            raise ValueError(f"a KV budget of {self.budget_bytes} bytes holds no row ({smallest} bytes the smallest)")
        rows = max(1, min(self.max_rows, self.budget_bytes // smallest))
        pool = functools.partial(
            KVPool, self.session, self.cfg, capacity=self.capacity, last_logits_session=last_logits_session
        )
        try:
            return pool(rows=rows, lazy=True)
        except MemoryError as refused:
            self.full_rows, self.granule, self.sizes = True, self.capacity, (self.capacity,)
            full = self.row_bytes(self.capacity)
            if self.budget_bytes < full:
                raise ValueError(
                    f"{refused}; and a KV budget of {self.budget_bytes} bytes holds no whole row"
                ) from None
            return pool(rows=min(self.max_rows, self.budget_bytes // full))

    # --- what the budget holds -----------------------------------------------------------------------

    def row_bytes(self, size: int) -> int:
        """Bytes a reservation of `size` positions takes of the budget (every buffer; not the scratch
        position each row also has, kv_pool.py)."""
        return size * self.bytes_per_position

    @property
    def allocated_bytes(self) -> int:
        """Bytes of memory the rows take: what holders reserve where pages are committed as rows fill (the
        host), the whole pool where memory is committed at once (a device)."""
        return self._reserved if self.pool.lazy else self.pool.nbytes

    @property
    def reserved_total(self) -> int:
        """Bytes of the budget the reservations of every holder (sequences and named prefixes) take."""
        return self._reserved

    @property
    def held_total(self) -> int:
        """Bytes the positions of every holder hold."""
        return self._held_positions * self.bytes_per_position

    @property
    def most_rows(self) -> int:
        """The most holders the budget holds at once: each reserving one granule."""
        return self.most_rows_of(self.granule)

    def most_rows_of(self, size: int) -> int:
        """The most holders of `size` positions the budget holds at once (at most the pool's rows)."""
        return min(self.pool.rows, self.budget_bytes // self.row_bytes(self._reservation(size)))

    def holders(self) -> list[Holder]:
        return list(self._rows)

    def holds(self, holder: Holder) -> bool:
        return holder in self._rows

    def length(self, holder: Holder) -> int:
        """Positions `holder` holds."""
        return int(self.pool.lengths[self._rows[holder]])

    def row_capacity(self, holder: Holder) -> int:
        """The positions `holder` reserves now (it reserves more, a granule at a time, as it grows)."""
        return self._reserved_positions[holder]

    # --- holders -------------------------------------------------------------------------------------

    def allocate(self, holder: Holder, positions: int) -> None:
        """An empty row for `holder`, reserving `positions` positions; RowsFull when there is no room."""
        assert holder not in self._rows, f"{holder!r} holds a row already"
        reservation = self._reservation(positions)
        self._check_room(positions, self.row_bytes(reservation), None)
        if not self._free:
            raise RowsFull(positions, f"the engine holds its most sequences at once ({self.pool.rows})")
        row = heapq.heappop(self._free)
        self.pool.reset(row)
        self._rows[holder] = row
        self._reserve(holder, reservation)

    def free(self, holder: Holder) -> None:
        """`holder`'s row goes back (its memory with it, where the pool commits pages as rows fill)."""
        self._add_held(-self.length(holder))
        row = self._rows.pop(holder)
        self._reserved -= self.row_bytes(self._reserved_positions.pop(holder))
        self.pool.release(row)
        heapq.heappush(self._free, row)

    def rename(self, holder: Holder, into: Holder, aside: bool = False) -> None:
        """`holder`'s row and reservation are `into`'s from now on. `aside`: the row moves to the highest free
        row where that is above it (a copy of its used positions), away from the live rows, which take the
        lowest: a row kept idle among the decoding rows would split their decode window in two graph runs, or
        be read by it every step."""
        assert into not in self._rows, f"{into!r} holds a row already"
        row = self._rows.pop(holder)
        self._reserved_positions[into] = self._reserved_positions.pop(holder)
        top = max(self._free, default=-1)
        if aside and top > row:
            self._free.remove(top)
            self.pool.copy_row(row, top)
            self.pool.release(row)
            self._free.append(row)
            heapq.heapify(self._free)
            row = top
        self._rows[into] = row

    def grow(self, holder: Holder, positions: int) -> None:
        """`holder` holds up to `positions` positions from now on: its reservation grows where it is too small
        (RowsFull when there is no room; it then stays as it was). Nothing moves."""
        reservation = self._reservation(positions)
        now = self._reserved_positions[holder]
        if reservation <= now:
            return
        self._check_room(positions, self.row_bytes(reservation - now), holder)
        self._reserve(holder, reservation)

    def _reservation(self, positions: int) -> int:
        if positions > self.capacity:
            raise ValueError(f"{positions} positions exceed a row ({self.capacity})")
        granules = -(-max(positions, 1) // self.granule)
        return min(self.capacity, granules * self.granule)

    def _reserve(self, holder: Holder, positions: int) -> None:
        self._reserved += self.row_bytes(positions - self._reserved_positions.get(holder, 0))
        self._reserved_positions[holder] = positions

    def _check_room(self, positions: int, more: int, growing: Holder | None) -> None:
        if self._reserved + more <= self.budget_bytes:
            return
        if growing is None:
            wanted = f"a new one needs {_amount(more)} for {positions} position{'s' * (positions != 1)}"
        else:
            held = self.length(growing)
            wanted = f"growing from {held} to {positions} positions needs {_amount(more)} more"
        raise RowsFull(
            positions,
            f"the KV cache budget is full: {len(self._rows)} live sequences reserve {_amount(self._reserved)} of "
            f"{_amount(self.budget_bytes)}; {wanted}; retry later or end a sequence",
        )

    def _add_held(self, positions: int) -> None:
        with self._held_lock:
            self._held_positions += positions

    # --- steps and whole rows, by holder ---------------------------------------------------------------

    def run(self, steps: Mapping[Holder, np.ndarray], last_only: bool = False) -> dict[Holder, np.ndarray | Exception]:
        """Append each holder's new tokens steps[holder] (T, d_model), or a whole model's ids (T,) int64,
        and return its output (T, d_model) (logits (T, vocab)) in the graph's float dtype, or the
        exception its graph run raised (it then holds what it held). `last_only`: every holder's last
        position's only, (1, width) (KVPool.run). Every holder stepping one token in as few graph runs as the
        pool's decode windows make (one, unless idle rows between them hold much). Each holder must have room
        for its new length (`grow` first)."""
        rows = {self._rows[holder]: holder for holder in steps}
        before = sum(self.length(holder) for holder in steps)
        outputs = self.pool.run({row: steps[holder] for row, holder in rows.items()}, last_only)
        self._add_held(sum(self.length(holder) for holder in steps) - before)  # a failed run may have added some
        return {rows[row]: output for row, output in outputs.items()}

    def read(self, holder: Holder, start: int = 0) -> dict[str, np.ndarray]:
        """What `holder` holds from position `start`: past name -> (n_kv, length - start, width) in the
        cache dtype (a quantized cache's codes), fresh host arrays."""
        return {name: array[0] for name, array in self.pool.read(self._rows[holder], start).items()}

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
        before = self.length(holder)
        self.pool.write(self._rows[holder], cache, length)
        self._add_held(length - before)

    def copy(self, source: Holder, target: Holder) -> None:
        """`target` holds what `source` holds (on the device when it has one)."""
        self.grow(target, self.length(source))
        before = self.length(target)
        self.pool.copy_row(self._rows[source], self._rows[target])
        self._add_held(self.length(target) - before)

    def rewind(self, holder: Holder, length: int) -> None:
        """`holder` keeps its first `length` positions (0 to its length); its reservation stays (it goes on)."""
        before = self.length(holder)
        self.pool.rewind(self._rows[holder], length)
        self._add_held(length - before)
