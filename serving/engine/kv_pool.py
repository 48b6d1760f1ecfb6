"""Driving a static-cache graph (`fp32-static`, `fp16-static`, the quantized `fp32-static-int8kv` and
`fp32-static-int4kv`): a pool of cache rows on the session's device, each row one sequence's keys and
values, appended in place.

Per past tensor the pool holds one buffer (rows, n_kv, capacity + 1, width), allocated once and
bound (by address, through IOBinding) as both the graph's past and its present, so a step moves no
cache: GroupQueryAttention reads each row's first `seqlens_k + 1` positions and writes the new keys
and values at the row's length. The buffers hold what the graph's past inputs declare (`cache_dtype`,
and `width` values a position: head_dim floats, head_dim int8 codes, or head_dim / 2 bytes of two
int4 codes each); hidden states and outputs stay in the graph's float (`dtype`). A whole model's graph
(`ModelConfig.whole`) takes each row's token ids instead of hidden states and answers logits, in the
same float; GPT-2's (learned positions) also takes each new token's position, which is the row's length
before it plus its place among the new tokens. A quantized cache's
scales are inside the graph: the pool only moves its codes.

A step of several rows runs as few graph runs as the op allows (onnxruntime's
group_query_attention_helper.h): every row that adds one token shares one run over the window of
rows from the lowest to the highest of them; a row that adds several tokens onto a past runs alone
(the op takes such a "subsequent prompt" with batch 1 only), and so does a first prompt. A row inside
a decode window that is not stepping takes part with a zero token whose key lands at its length,
past its last real position, where the next real token overwrites it; the extra position at the end
of each row (`capacity + 1`) is where that lands for a full row. Its output is dropped and its
length is unchanged.

A row as a whole (a snapshot, a restore, a fork, a move to a row of another pool) moves as array
copies of its used positions where the buffers are host memory (the CPU: a graph run per copy would
cost more than the copy), and through the row-copy kernel on a device (serving/engine/side_graphs.py:
bound by address, no bytes leave the device when both rows have one shape). The pool is a slab of
the static engine's cache manager (serving/engine/cache_manager.py); the export's pool rung drives
one directly.
"""

from __future__ import annotations

import dataclasses
import errno
import mmap
from collections.abc import Mapping, Sequence

import numpy as np

from contract import names
from contract.config import ModelConfig
from serving.engine import snapshots
from serving.engine.ort import (
    CPU,
    CPU_PROVIDER,
    CUDA,
    run_options,
    session_device,
    session_float_dtype,
    session_options,
    uses_cuda_graphs,
)
from serving.engine.side_graphs import CacheRows, DecodeWindow, RowCopy

# Prefill chunk: a longer prompt runs as several runs of this many tokens (the op's subsequent-prompt
# mode), which bounds a run's attention scores (chunk x length per head) and so the memory it takes.
PREFILL_CHUNK = 512
# Without CUDA graphs, two runs of decoding rows share one graph run when the idle rows between them
# hold at most this many bytes of cache: reading those costs less than the fixed cost of another run
# (measured on our 2-core CPUs, 7 of 16 rows at past 1024 stepping: runs split at any idle row took
# 1.65 ms a step, merged over gaps of one 4 MB row 1.91 ms, one window over all 2.27 ms).
MERGE_BYTES = 1 << 20


@dataclasses.dataclass
class GraphRuns:
    """The graph runs of a cache since it opened (shared by a cache manager's slabs): what the engine core's
    gauges read a step's runs from (how many decode runs a step of its decoding rows took)."""

    decode_runs: int = 0  # decode windows run (one graph run each)
    decode_rows: int = 0  # rows that stepped a token in them (idle rows inside a window not counted)
    prefill_runs: int = 0  # prefill chunks run (one graph run each)
    most_decode_rows: int = 0  # the most rows one decode run has stepped

    def decoded(self, rows: int) -> None:
        self.decode_runs += 1
        self.decode_rows += rows
        self.most_decode_rows = max(self.most_decode_rows, rows)


MAP_NORESERVE = 0x4000  # Linux's (asm-generic): Python 3.11's mmap module does not name it


def host_buffer(shape: tuple[int, ...], dtype: type) -> tuple[np.ndarray, mmap.mmap]:
    """Zeros of `shape`, as address space whose pages the kernel commits only as they are written: an anonymous
    private mapping with MAP_NORESERVE, so that a pool of many long rows costs the memory its rows fill, not its
    size (the kernel's heuristic overcommit refuses a plain mapping larger than the machine's memory: seen with
    64 GiB on a 24 GiB machine, which MAP_NORESERVE maps). MemoryError where the kernel refuses even that (its
    strict overcommit, vm.overcommit_memory 2)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    try:
        mapping = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    except OSError as error:
        if error.errno == errno.ENOMEM:
            raise MemoryError(f"the kernel refused {size} bytes of address space for a KV cache: {error}") from None
        raise
    return np.frombuffer(mapping, dtype, count=int(np.prod(shape))).reshape(shape), mapping


def _claimed_cuda_graphs(session) -> bool:
    """Whether the session replays CUDA graphs, claimed for one pool: a captured graph is the session's and holds
    its pool's addresses, so a second pool on the same session would replay the first one's graph over the first
    one's buffers."""
    if not uses_cuda_graphs(session):
        return False
    if getattr(session, "_kv_pool_owned", False):
        raise ValueError("this session's CUDA graphs belong to another KVPool; open a session per pool")
    session._kv_pool_owned = True
    return True


class KVPool:
    """`rows` cache rows of up to `capacity` positions for the static graph of `session`.

    `row_copy`: the kernel that moves its rows on a device (serving/engine/side_graphs.py), shared by the
    pools of one row shape (a cache manager passes one; made at first use otherwise). On the CPU the
    buffers are host arrays, and rows move as array copies of their used positions.

    `last_logits_session`: a whole model's same static graph answering only each run's last position's
    logits (`last_logits_graph`), on the same device; `run(..., last_only=True)` prefills through it, so a
    long prompt never writes (T, vocab) logits nobody reads."""

    def __init__(
        self,
        session,
        cfg: ModelConfig,
        rows: int,
        capacity: int,
        device_id: int = 0,
        row_copy: RowCopy | None = None,
        last_logits_session=None,
        runs: GraphRuns | None = None,
        lazy: bool = False,
    ) -> None:
        """`runs`: where its graph runs are counted. `lazy`: on the host, buffers whose pages are committed as rows
        fill and given back as rows are released (`host_buffer`, `release`): the memory follows what the rows
        hold, whatever the pool's size; MemoryError where the kernel refuses the address space."""

        assert rows > 0 and capacity > 0
        # decode windows then start at row 0 and are replayed as one CUDA graph per window size
        self.cuda_graphs = _claimed_cuda_graphs(session)
        self._windows: dict[tuple[int, int], DecodeWindow] = {}
        self.session, self.cfg, self.rows, self.capacity = session, cfg, rows, capacity
        self.device, self.device_id = session_device(session), device_id
        self.dtype = session_float_dtype(session)  # of hidden states, outputs and logits
        self.new_tokens_name, self.output_name = names.model_input(cfg), names.model_output(cfg)
        self.positioned = any(i.name == names.POSITION_IDS for i in session.get_inputs())  # learned positions
        self.last_logits_session = last_logits_session
        self.runs = runs or GraphRuns()
        self.cache_dtype, width = cache_layout(session)
        self.past_names = names.past_names(cfg.n_layers)
        self.present_names = names.present_names(cfg.n_layers)
        self.row_shape = (cfg.n_kv_heads, capacity + 1, width)
        shape = (rows, *self.row_shape)
        self.lazy = lazy and self.device == CPU
        self._host, self._mappings, self.buffers = self._allocated(shape)
        assert row_copy is None or row_copy.row_shape == self.row_shape, "a row copy of another row shape"
        self._row_copy = row_copy
        self.row_bytes = int(np.prod(self.row_shape)) * np.dtype(self.cache_dtype).itemsize
        self.lengths = np.zeros(rows, np.int64)
        self.description = f"{rows} rows of {capacity} positions on {self.device}"
        # what a snapshot of a row carries and what a restored one must (the factory adds the graph's name and sha256)
        self.identity = snapshots.fingerprint(cfg, self.cache_dtype)
        # a prefill's scores are chunk x length: the CPU arena gives that memory back after it (decode runs
        # need little). The GPU arena is left alone: captured graphs keep using what they were given.
        self._prefill_options = run_options(
            {"memory.enable_memory_arena_shrinkage": "cpu:0"} | ({"gpu_graph_id": "-1"} if self.cuda_graphs else {})
        )

    def _allocated(self, shape: tuple[int, ...]) -> tuple[list[np.ndarray], list[mmap.mmap], list]:
        """Each layer's cache buffer: (the host arrays, their lazy mappings, the OrtValues over them or on the GPU).
        Zeros, not garbage: no kernel should read past a row's length, and if one did it must not read NaN. On
        the CPU the pages of np.zeros are only touched as rows fill up."""
        import onnxruntime as ort

        host: list[np.ndarray] = []
        mappings: list[mmap.mmap] = []
        if self.lazy:
            made = [host_buffer(shape, self.cache_dtype) for _ in self.past_names]
            host, mappings = [array for array, _ in made], [mapping for _, mapping in made]
        elif self.device == CPU:
            host = [np.zeros(shape, self.cache_dtype) for _ in self.past_names]
        buffers = [ort.OrtValue.ortvalue_from_numpy(array) for array in host] or [
            ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, self.cache_dtype), CUDA, self.device_id)
            for _ in self.past_names
        ]
        return host, mappings, buffers

    @property
    def identity(self) -> dict[str, str]:
        return self._identity

    @identity.setter
    def identity(self, identity: Mapping[str, str]) -> None:
        """What a snapshot carries; its `dtype` is always this pool's cache's (the caller says which graph
        made it): an int8 row's codes are never restored into a float pool, nor the other way."""
        self._identity = {**identity, "dtype": str(np.dtype(self.cache_dtype))}

    @classmethod
    def row_bytes_for(cls, session, cfg: ModelConfig, capacity: int) -> int:
        """Bytes `capacity` positions of one row take in all the cache buffers of `session`'s graph (the
        scratch position a pool adds to each row is not counted, as a KV budget does not count it)."""
        cache_dtype, width = cache_layout(session)
        return 2 * cfg.n_layers * cfg.n_kv_heads * capacity * width * np.dtype(cache_dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.row_bytes * self.rows * len(self.buffers)

    def reset(self, row: int) -> None:
        """Row `row` holds nothing from now on (its old positions are never read again)."""
        self.lengths[row] = 0

    def release(self, row: int) -> None:
        """Row `row` holds nothing from now on, and a lazy pool gives its pages back to the kernel (madvise
        MADV_DONTNEED: they read as zeros again, committed anew only when written)."""
        self.reset(row)
        if not self._mappings:
            return
        page = mmap.PAGESIZE
        start, end = row * self.row_bytes, (row + 1) * self.row_bytes
        first, last = -(-start // page) * page, end // page * page  # the pages wholly inside the row
        if last > first:
            for mapping in self._mappings:
                mapping.madvise(mmap.MADV_DONTNEED, first, last - first)

    def rows_at(self, low: int, count: int = 1) -> CacheRows:
        """Rows [low, low + count) of every cache buffer, by address."""
        addresses = tuple(buffer.data_ptr() + low * self.row_bytes for buffer in self.buffers)
        return CacheRows(addresses, (count, *self.row_shape), self.cache_dtype, self.device, self.device_id)

    def run(self, steps: Mapping[int, np.ndarray], last_only: bool = False) -> dict[int, np.ndarray | Exception]:
        """Append each row's new tokens and return each row's output in the pool's float dtype, or the
        exception its graph run raised (its length then stays as it was: what the run wrote past it is
        never read). Rows not named keep their cache as it was.

        An attention model's rows take hidden states steps[row] (T_row, d_model) and return (T_row,
        d_model). A whole model's rows take token ids steps[row] (T_row,) int64, each in [0, vocab)
        (the caller checks them: `contract.inputs.check_token_values`), and return logits (T_row,
        vocab); GPT-2's positions are the pool's to feed (row length + t). `last_only`: each row returns
        its last position's only, (1, width), prefills through `last_logits_session` where given."""
        for row, hidden in steps.items():
            assert 0 <= row < self.rows, f"row {row} outside the pool of {self.rows}"
            if self.lengths[row] + hidden.shape[0] > self.capacity:
                raise ValueError(
                    f"row {row}: {self.lengths[row]} + {hidden.shape[0]} positions exceed the capacity {self.capacity}"
                )
        results: dict[int, np.ndarray | Exception] = {}
        decode = sorted(row for row, hidden in steps.items() if hidden.shape[0] == 1)
        for low, count in self.decode_windows(decode):
            rows = [row for row in decode if low <= row < low + count]
            try:
                results.update(self._decode(low, count, rows, steps))
            except Exception as error:  # the next windows still run; these rows answer with the error
                results.update(dict.fromkeys(rows, error))
        for row, hidden in steps.items():
            if hidden.shape[0] > 1:
                try:
                    results[row] = self._prefill(row, hidden, last_only)
                except Exception as error:
                    results[row] = error
        return results

    @property
    def _token_shape(self) -> tuple[int, ...]:
        """A new token's shape in a row's steps: () for an id, (d_model,) for hidden states."""
        return () if self.cfg.whole else (self.cfg.d_model,)

    def _check_ids(self, row: int, tokens: np.ndarray) -> None:
        """A whole model's row takes integer ids (T,): floats would otherwise be cast to ids silently."""
        if self.cfg.whole and (tokens.dtype.kind not in "iu" or tokens.ndim != 1):
            raise ValueError(
                f"row {row}: {self.new_tokens_name} must be (T,) integer token ids, got {tokens.dtype} "
                f"of shape {tokens.shape}"
            )

    def decode_windows(self, rows: Sequence[int]) -> list[tuple[int, int]]:
        """(first row, row count) of each graph run for the decode rows `rows` (sorted).

        With CUDA graphs: one window from row 0, so that each size is one captured graph (a bounded
        number of them); an idle row inside it costs its length at the GPU's bandwidth. Without: runs
        of adjacent rows, two runs merged when the idle rows between them hold at most `MERGE_BYTES`
        of cache (reading them costs less than another run's fixed cost)."""
        if not rows:
            return []
        if self.cuda_graphs:
            return [(0, rows[-1] + 1)]
        windows = [[rows[0], rows[0]]]
        per_position = self.row_bytes * len(self.buffers) // self.row_shape[1]
        for row in rows[1:]:
            gap = int(self.lengths[windows[-1][1] + 1 : row].sum()) * per_position
            if gap <= MERGE_BYTES:
                windows[-1][1] = row
            else:
                windows.append([row, row])
        return [(low, high - low + 1) for low, high in windows]

    def _decode(self, low: int, count: int, rows: Sequence[int], steps: Mapping[int, np.ndarray]) -> dict:
        """One decode window through its fixed buffers and binding (and CUDA graph, where on)."""
        window = self._windows.get((low, count))
        if window is None:
            graph = run_options({"gpu_graph_id": str(len(self._windows) + 1)}) if self.cuda_graphs else None
            window = DecodeWindow(self.session, self.rows_at(low, count), self.dtype, graph)
            self._windows[low, count] = window
        # (B, 1, d_model) or ids (B, 1): idle rows step a zero token (id 0) at position 0, whose key lands
        # past their length and is never read (position 0: a full row's scratch position has no table row)
        hidden = np.zeros((count, 1, *self._token_shape), np.int64 if self.cfg.whole else self.dtype)
        positions = np.zeros((count, 1), np.int64)
        for row in rows:
            self._check_ids(row, steps[row])
            hidden[row - low] = steps[row]
            positions[row - low] = self.lengths[row]
        lengths = self.lengths[low : low + count].astype(np.int32)  # seqlens_k: length after - 1
        output = window.run(hidden, lengths, positions)
        self.runs.decoded(len(rows))
        return self._advance(rows, [steps[row].shape[0] for row in rows], output, low)

    def _prefill(self, row: int, hidden: np.ndarray, last_only: bool = False) -> np.ndarray:
        """A row's several new tokens, in chunks of at most `PREFILL_CHUNK` (each chunk a run of its
        own: its attention scores, chunk x length, bound the run's memory). Afterwards the arena
        gives back what the scores took. `last_only`: the last position's output only (1, width),
        every chunk through `last_logits_session` where there is one (its logits are (1, vocab))."""
        self._check_ids(row, hidden)
        session = self.last_logits_session if last_only and self.last_logits_session is not None else self.session
        outputs = []
        for start in range(0, hidden.shape[0], PREFILL_CHUNK):
            chunk = hidden[start : start + PREFILL_CHUNK]
            outputs.append(self._run_rows(row, chunk, session))
        if last_only:
            return outputs[-1][-1:]
        return outputs[0] if len(outputs) == 1 else np.concatenate(outputs)

    def _run_rows(self, row: int, chunk: np.ndarray, session) -> np.ndarray:
        new = chunk.shape[0]
        seqlens_k = np.array([self.lengths[row] + new - 1], np.int32)
        binding = session.io_binding()
        new_tokens = np.ascontiguousarray(chunk[None], np.int64 if self.cfg.whole else self.dtype)  # (1, T[, d])
        binding.bind_cpu_input(self.new_tokens_name, new_tokens)
        if self.positioned:  # each new token's position: the row's length before it plus its place
            binding.bind_cpu_input(names.POSITION_IDS, (self.lengths[row] + np.arange(new, dtype=np.int64))[None])
        binding.bind_cpu_input(names.SEQLENS_K, seqlens_k)
        binding.bind_cpu_input(names.TOTAL_SEQUENCE_LENGTH, np.array(int(seqlens_k[0]) + 1, np.int32))
        binding.bind_output(self.output_name, CPU)
        self.rows_at(row).bind(binding, inputs=self.past_names, outputs=self.present_names)
        session.run_with_iobinding(binding, self._prefill_options)
        self.runs.prefill_runs += 1
        (output,) = self._advance([row], [new], binding.get_outputs()[0].numpy(), row).values()
        return output

    def _advance(self, rows: Sequence[int], added: Sequence[int], output: np.ndarray, low: int) -> dict:
        """The rows' outputs out of the window's (B, T, width), their lengths moved on (a row's output is
        its `count` new tokens', or the one last position's where the graph answers only that)."""
        results = {}
        for row, count in zip(rows, added, strict=True):
            self.lengths[row] += count
            results[row] = output[row - low, :count]
        return results

    # --- a row as a whole: the session operations (snapshot, restore, fork, rewind) -------------------

    def read(self, row: int, start: int = 0) -> dict[str, np.ndarray]:
        """Row `row`'s cache from position `start` to its length as fresh host arrays (1, n_kv, length -
        start, width) in the cache dtype (a quantized cache's codes), by past name."""
        length = int(self.lengths[row])
        if self._host:
            used = [array[row, :, start:length].copy() for array in self._host]
        else:
            used = self.row_copy.to_host(self.rows_at(row), length, start)
        return {name: array[None] for name, array in zip(self.past_names, used, strict=True)}

    def write(self, row: int, cache: Mapping[str, np.ndarray], length: int) -> None:
        """Row `row` holds `cache` (past name -> (n_kv, length, width) in the cache dtype) from now on."""
        assert 0 <= length <= self.capacity, f"{length} positions do not fit a row of {self.capacity}"
        if self._host:
            for name, array in zip(self.past_names, self._host, strict=True):
                array[row, :, :length] = cache[name]
        else:
            wholes = [np.zeros(self.row_shape, self.cache_dtype) for _ in self.past_names]
            for name, whole in zip(self.past_names, wholes, strict=True):
                whole[:, :length] = cache[name]
            self.row_copy.from_host(wholes, self.rows_at(row))
        self.lengths[row] = length

    def copy_row(self, source: int, target: int, source_pool: KVPool | None = None) -> None:
        """Row `target` holds what row `source` of `source_pool` (this pool if None) holds: on the host an
        array copy of its used positions, on a device a row copy (no bytes leave it) when both rows have
        one shape, else through the host (rows of two sizes have two strides)."""
        pool = source_pool or self
        length = int(pool.lengths[source])
        assert length <= self.capacity, f"{length} positions do not fit a row of {self.capacity}"
        if self._host:
            for mine, theirs in zip(self._host, pool._host, strict=True):
                mine[target, :, :length] = theirs[source, :, :length]
        elif pool.row_shape == self.row_shape:
            self.row_copy.within(pool.rows_at(source), self.rows_at(target))
        else:
            self.write(target, {name: array[0] for name, array in pool.read(source).items()}, length)
            return
        self.lengths[target] = length

    def rewind(self, row: int, length: int) -> None:
        """Row `row` keeps its first `length` positions: the next token is written at `length`, and
        what lay past it is never read again (GroupQueryAttention reads `seqlens_k + 1` positions)."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} positions: cannot rewind to {length}")
        self.lengths[row] = length

    @property
    def row_copy(self) -> RowCopy:
        """The kernel that moves this pool's rows on its device (made at first use unless given)."""
        if self._row_copy is None:
            providers = self.session.get_providers()[:1]
            if providers[0] != CPU_PROVIDER:
                providers = [(providers[0], {"device_id": str(self.device_id)}), CPU_PROVIDER]
            options = session_options(threads=1, arena=False, spinning=False)
            self._row_copy = RowCopy(len(self.buffers), self.row_shape, self.cache_dtype, providers, options)
        return self._row_copy


# the element types a static graph's cache may have (ONNX Runtime's type strings)
CACHE_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8}
CACHE_TYPES["tensor(uint8)"] = np.uint8  # int4 codes, two a byte


def cache_layout(session) -> tuple[type, int]:
    """(element type, values a position) of the cache buffers a static graph's past inputs declare."""
    past = next(i for i in session.get_inputs() if i.name == names.past_name(0, names.KEY))
    if past.type not in CACHE_TYPES or not isinstance(past.shape[-1], int):
        raise ValueError(f"{past.name}: a static cache of {past.type} {past.shape} is not one a KVPool holds")
    return CACHE_TYPES[past.type], past.shape[-1]


def cache_scales(path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """A quantized static graph's scales, initializers of the graph (`names.cache_scale_name`), by past
    name: float32 (1,) per tensor or (n_kv, 1, head_dim) per channel; {} for a float cache."""
    import onnx
    from onnx import numpy_helper

    wanted = {
        names.cache_scale_name(i, kind): names.past_name(i, kind)
        for i in range(cfg.n_layers)
        for kind in names.KV_KINDS
    }
    graph = onnx.load(str(path), load_external_data=False).graph
    return {wanted[init.name]: numpy_helper.to_array(init) for init in graph.initializer if init.name in wanted}


def dequantized(codes: np.ndarray, scale: np.ndarray, kind: str) -> np.ndarray:
    """A quantized cache's codes (..., n_kv, T, width) as the kernel reads them, float32 (..., n_kv, T,
    head_dim): int8 code x scale; int4 two codes a byte, stored + 8, the even channel in the low nibble."""
    if kind == names.INT4_CACHE:
        nibbles = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
        codes = nibbles.astype(np.int8) - 8
    return codes.astype(np.float32) * scale


# what a whole model's final norm may be in its graphs (fused forms: RMSNormalization; GPT-2: LayerNormalization)
NORMALIZATIONS = {"RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization"}


def last_logits_graph(model):
    """A whole model's graph (an `onnx.ModelProto`, any form whose final norm is one op) rewritten to
    answer only the last position's logits (B, 1, vocab): the residual stream is sliced to its last
    position before the final norm, so the norm and the head (the largest matmul of a prefill) read one
    position instead of T. Norm and head act on each position alone, so the answer is the full graph's
    last row. The caches are untouched. Raises ValueError when the graph has no such norm before
    `logits`."""
    import onnx
    from onnx import helper

    model = copy_model(model)
    graph = model.graph
    producer = {output: node for node in graph.node for output in node.output}
    node = producer.get(names.LOGITS)
    while node is not None and node.op_type not in NORMALIZATIONS:  # the data path is each node's first input
        node = producer.get(node.input[0]) if node.input else None
    if node is None:
        raise ValueError(f"no final norm ({', '.join(sorted(NORMALIZATIONS))}) found before {names.LOGITS}")
    states, last = node.input[0], "last_position.states"
    bounds = {"last_position.starts": -1, "last_position.ends": np.iinfo(np.int64).max, "last_position.axes": 1}
    graph.initializer.extend(helper.make_tensor(n, onnx.TensorProto.INT64, [1], [v]) for n, v in bounds.items())
    slice_node = helper.make_node("Slice", [states, *bounds], [last], name="last_position")
    node.input[0] = last
    graph.node.insert(list(graph.node).index(node), slice_node)
    logits = next(output for output in graph.output if output.name == names.LOGITS)
    logits.type.tensor_type.shape.dim[1].Clear()
    logits.type.tensor_type.shape.dim[1].dim_value = 1
    del graph.value_info[:]  # shapes inferred for T positions after the norm no longer hold
    return model


def copy_model(model):
    import onnx

    copied = onnx.ModelProto()
    copied.CopyFrom(model)
    return copied
