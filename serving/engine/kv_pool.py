"""Driving a static-cache graph (`fp32-static`, `fp16-static`, the quantized `fp32-static-int8kv` and
`fp32-static-int4kv`): a pool of cache rows on the session's device, each row one sequence's keys and
values, appended in place.

Per past tensor the pool holds one buffer (rows, n_kv, capacity + 1, width), allocated once and
bound (by address, through IOBinding) as both the graph's past and its present, so a step moves no
cache: GroupQueryAttention reads each row's first `seqlens_k + 1` positions and writes the new keys
and values at the row's length. The buffers hold what the graph's past inputs declare (`cache_dtype`,
and `width` values a position: head_dim floats, head_dim int8 codes, or head_dim / 2 bytes of two
int4 codes each); hidden states and outputs stay in the graph's float (`dtype`). A quantized cache's
scales are inside the graph: the pool only moves its codes.

A step of several rows runs as few graph runs as the op allows (onnxruntime's
group_query_attention_helper.h): every row that adds one token shares one run over the window of
rows from the lowest to the highest of them; a row that adds several tokens onto a past runs alone
(the op takes such a "subsequent prompt" with batch 1 only), and so does a first prompt. A row inside
a decode window that is not stepping takes part with a zero token whose key lands at its length,
past its last real position, where the next real token overwrites it; the extra position at the end
of each row (`capacity + 1`) is where that lands for a full row. Its output is dropped and its
length is unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import numpy as np

from contract import names
from contract.config import ModelConfig
from serving.engine import snapshots
from serving.engine.ort import CPU, CUDA, run_options, session_device, session_float_dtype, uses_cuda_graphs

# Prefill chunk: a longer prompt runs as several runs of this many tokens (the op's subsequent-prompt
# mode), which bounds a run's attention scores (chunk x length per head) and so the memory it takes.
PREFILL_CHUNK = 512
# Without CUDA graphs, two runs of decoding rows share one graph run when the idle rows between them
# hold at most this many bytes of cache: reading those costs less than the fixed cost of another run
# (measured on our 2-core CPUs, 7 of 16 rows at past 1024 stepping: runs split at any idle row took
# 1.65 ms a step, merged over gaps of one 4 MB row 1.91 ms, one window over all 2.27 ms).
MERGE_BYTES = 1 << 20


class KVPool:
    """`rows` cache rows of up to `capacity` positions for the static graph of `session`."""

    def __init__(self, session, cfg: ModelConfig, rows: int, capacity: int, device_id: int = 0) -> None:
        import onnxruntime as ort

        assert rows > 0 and capacity > 0
        # decode windows then start at row 0 and are replayed as one CUDA graph per window size
        self.cuda_graphs = uses_cuda_graphs(session)
        if self.cuda_graphs:
            # a captured graph is the session's and holds this pool's addresses: a second pool on the
            # same session would replay the first one's graph over the first one's buffers
            if getattr(session, "_kv_pool_owned", False):
                raise ValueError("this session's CUDA graphs belong to another KVPool; open a session per pool")
            session._kv_pool_owned = True
        self._windows: dict[tuple[int, int], _DecodeWindow] = {}
        self.session, self.cfg, self.rows, self.capacity = session, cfg, rows, capacity
        self.device, self.device_id = session_device(session), device_id
        self.dtype = session_float_dtype(session)  # of hidden states and outputs
        self.cache_dtype, width = cache_layout(session)
        self.past_names = names.past_names(cfg.n_layers)
        self.present_names = names.present_names(cfg.n_layers)
        self.row_shape = (cfg.n_kv_heads, capacity + 1, width)
        shape = (rows, *self.row_shape)
        # zeros, not garbage: no kernel should read past a row's length, and if one did it must
        # not read NaN. On the CPU the pages of np.zeros are only touched as rows fill up.
        self._host = [np.zeros(shape, self.cache_dtype) for _ in self.past_names] if self.device == CPU else []
        self.buffers = [ort.OrtValue.ortvalue_from_numpy(array) for array in self._host] or [
            ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, self.cache_dtype), CUDA, device_id)
            for _ in self.past_names
        ]
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

    def run(self, steps: Mapping[int, np.ndarray]) -> dict[int, np.ndarray | Exception]:
        """Append each row's new tokens, steps[row] (T_row, d_model), and return each row's output
        (T_row, d_model) in the pool's float dtype, or the exception its graph run raised (its length
        then stays as it was: what the run wrote past it is never read). Rows not named keep their
        cache as it was."""
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
                    results[row] = self._prefill(row, hidden)
                except Exception as error:
                    results[row] = error
        return results

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
        key = (low, count)
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = _DecodeWindow(self, low, count, graph_id=len(self._windows) + 1)
        hidden = np.zeros((count, 1, self.cfg.d_model), self.dtype)  # (B, 1, d_model): idle rows step a zero token
        for row in rows:
            hidden[row - low] = steps[row]
        window.run(hidden, self.lengths[low : low + count].astype(np.int32))  # seqlens_k: length after - 1
        return self._advance(rows, [steps[row].shape[0] for row in rows], window.output(), low)

    def _prefill(self, row: int, hidden: np.ndarray) -> np.ndarray:
        """A row's several new tokens, in chunks of at most `PREFILL_CHUNK` (each chunk a run of its
        own: its attention scores, chunk x length, bound the run's memory). Afterwards the arena
        gives back what the scores took."""
        outputs = []
        for start in range(0, hidden.shape[0], PREFILL_CHUNK):
            chunk = hidden[start : start + PREFILL_CHUNK]
            outputs.append(self._run_rows(row, chunk))
        return outputs[0] if len(outputs) == 1 else np.concatenate(outputs)

    def _run_rows(self, row: int, chunk: np.ndarray) -> np.ndarray:
        new = chunk.shape[0]
        seqlens_k = np.array([self.lengths[row] + new - 1], np.int32)
        binding = self.session.io_binding()
        binding.bind_cpu_input(names.HIDDEN_STATES, np.ascontiguousarray(chunk[None], self.dtype))
        binding.bind_cpu_input(names.SEQLENS_K, seqlens_k)
        binding.bind_cpu_input(names.TOTAL_SEQUENCE_LENGTH, np.array(int(seqlens_k[0]) + 1, np.int32))
        binding.bind_output(names.OUTPUT, CPU)
        self.bind_caches(binding, row, 1)
        self.session.run_with_iobinding(binding, self._prefill_options)
        (output,) = self._advance([row], [new], binding.get_outputs()[0].numpy(), row).values()
        return output

    def _advance(self, rows: Sequence[int], added: Sequence[int], output: np.ndarray, low: int) -> dict:
        """The rows' outputs out of the window's (B, T, d_model), their lengths moved on."""
        results = {}
        for row, count in zip(rows, added, strict=True):
            self.lengths[row] += count
            results[row] = output[row - low, :count]
        return results

    def bind_caches(self, binding, low: int, count: int) -> None:
        """Rows [low, low + count) of every cache buffer as the graph's past and present."""
        window = (count, *self.row_shape)
        for past, present, buffer in zip(self.past_names, self.present_names, self.buffers, strict=True):
            address = buffer.data_ptr() + low * self.row_bytes
            binding.bind_input(past, self.device, self.device_id, self.cache_dtype, window, address)
            binding.bind_output(present, self.device, self.device_id, self.cache_dtype, window, address)

    def read(self, row: int, start: int = 0) -> dict[str, np.ndarray]:
        """Row `row`'s cache from position `start` to its length as host arrays (1, n_kv, length -
        start, width) in the cache dtype (a quantized cache's codes), by past name."""
        used = self._row_copy.to_host(row, int(self.lengths[row]), start)
        return {name: array[None] for name, array in used.items()}

    # --- a row as a whole: the session operations (snapshot, restore, fork, rewind) -------------------

    def write(self, row: int, cache: Mapping[str, np.ndarray], length: int) -> None:
        """Row `row` holds `cache` (past name -> (n_kv, length, width) in the cache dtype) from now on."""
        assert 0 <= length <= self.capacity, f"{length} positions do not fit a row of {self.capacity}"
        rows = {}
        for name in self.past_names:
            whole = np.zeros(self.row_shape, self.cache_dtype)
            whole[:, :length] = cache[name]
            rows[name] = whole
        self._row_copy.from_host(rows, row)
        self.lengths[row] = length

    def copy_row(self, source: int, target: int) -> None:
        """Row `target` holds what row `source` holds (on the pool's device: no bytes leave it)."""
        self._row_copy.within(source, target)
        self.lengths[target] = self.lengths[source]

    def rewind(self, row: int, length: int) -> None:
        """Row `row` keeps its first `length` positions: the next token is written at `length`, and
        what lay past it is never read again (GroupQueryAttention reads `seqlens_k + 1` positions)."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} positions: cannot rewind to {length}")
        self.lengths[row] = length

    @functools.cached_property
    def _row_copy(self) -> _RowCopy:
        return _RowCopy(self)


# the element types a static graph's cache may have (ONNX Runtime's type strings)
CACHE_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8}
CACHE_TYPES["tensor(uint8)"] = np.uint8  # int4 codes, two a byte


def cache_layout(session) -> tuple[type, int]:
    """(element type, values a position) of the cache buffers a static graph's past inputs declare."""
    past = next(i for i in session.get_inputs() if i.name == names.past_name(0, names.KEY))
    if past.type not in CACHE_TYPES or not isinstance(past.shape[-1], int):
        raise ValueError(f"{past.name}: a static cache of {past.type} {past.shape} is not one a KVPool holds")
    return CACHE_TYPES[past.type], past.shape[-1]


class _RowCopy:
    """Rows of every cache buffer copied by two small graphs on the pool's device, bound by address
    like the decode windows: a row's first positions to the host (Slice), and a whole row from the
    host or from another row (Identity). A row's first positions are strided inside it (n_kv,
    capacity + 1, head_dim): what comes from the host is padded to the whole row first."""

    def __init__(self, pool: KVPool) -> None:
        import onnxruntime as ort
        from onnx import helper

        from serving.engine.kernels import kernel_model
        from serving.engine.ort import session_options

        self.pool = pool
        element = helper.np_dtype_to_tensor_dtype(np.dtype(pool.cache_dtype))
        shape = [1, *pool.row_shape]
        inputs = [helper.make_tensor_value_info(f"in.{name}", element, shape) for name in pool.past_names]
        outputs = [helper.make_tensor_value_info(f"out.{name}", element, shape) for name in pool.past_names]
        copy = [helper.make_node("Identity", [f"in.{n}"], [f"out.{n}"]) for n in pool.past_names]
        # the used positions: axis 2 from `start` to `length` (inputs: one graph for every range)
        bounds = [helper.make_tensor_value_info(name, helper.TensorProto.INT64, [1]) for name in ("start", "length")]
        axis = helper.make_tensor("axis", helper.TensorProto.INT64, [1], [2])
        cut = [helper.make_node("Slice", [f"in.{n}", "start", "length", "axis"], [f"out.{n}"]) for n in pool.past_names]
        used_shape = [1, shape[1], "positions", shape[3]]
        used = [helper.make_tensor_value_info(f"out.{n}", element, used_shape) for n in pool.past_names]
        providers = pool.session.get_providers()[:1]
        if providers[0] != "CPUExecutionProvider":
            providers = [(providers[0], {"device_id": str(pool.device_id)}), "CPUExecutionProvider"]
        options = session_options(threads=1, arena=False, spinning=False)

        def open_graph(model):
            return ort.InferenceSession(model.SerializeToString(), sess_options=options, providers=providers)

        self.copy = open_graph(kernel_model(copy, inputs, outputs))
        self.cut = open_graph(kernel_model(cut, [*inputs, *bounds], used, [axis]))

    def _bind(self, binding, prefix: str, row: int) -> None:
        pool, shape = self.pool, (1, *self.pool.row_shape)
        for name, buffer in zip(pool.past_names, pool.buffers, strict=True):
            address = buffer.data_ptr() + row * pool.row_bytes
            bind = binding.bind_input if prefix == "in" else binding.bind_output
            bind(f"{prefix}.{name}", pool.device, pool.device_id, pool.cache_dtype, shape, address)

    def to_host(self, row: int, length: int, start: int = 0) -> dict[str, np.ndarray]:
        """Positions `start` to `length` of row `row` of every buffer: past name -> (n_kv, length -
        start, width) on the host."""
        binding = self.cut.io_binding()
        self._bind(binding, "in", row)
        binding.bind_cpu_input("start", np.array([start], np.int64))
        binding.bind_cpu_input("length", np.array([length], np.int64))
        for name in self.pool.past_names:
            binding.bind_output(f"out.{name}", CPU)
        self.cut.run_with_iobinding(binding)
        return {name: value.numpy()[0] for name, value in zip(self.pool.past_names, binding.get_outputs(), strict=True)}

    def from_host(self, rows: Mapping[str, np.ndarray], row: int) -> None:
        binding = self.copy.io_binding()
        for name in self.pool.past_names:
            binding.bind_cpu_input(f"in.{name}", np.ascontiguousarray(rows[name][None], self.pool.cache_dtype))
        self._bind(binding, "out", row)
        self.copy.run_with_iobinding(binding)

    def within(self, source: int, target: int) -> None:
        assert source != target
        binding = self.copy.io_binding()
        self._bind(binding, "in", source)
        self._bind(binding, "out", target)
        self.copy.run_with_iobinding(binding)


class _DecodeWindow:
    """Rows [low, low + count) for one-token steps: input and output buffers of their own, bound
    once with the caches' addresses; each step copies its tokens and lengths in and runs. With CUDA
    graphs the window has a graph id: ONNX Runtime captures it on its second run and replays it from
    then on (the same addresses every time, which is what a replay needs).

    `total_sequence_length` is the buffer's length, the same every step: in token generation (one
    new token, fewer than the total) the op reads each row's length from `seqlens_k` only, so a
    captured graph stays right whatever the lengths (the CPU and GPU parity rungs prove it)."""

    def __init__(self, pool: KVPool, low: int, count: int, graph_id: int) -> None:
        import onnxruntime as ort

        self.pool = pool
        self.on_cpu = pool.device == CPU
        shape, d_model = (count, 1, pool.cfg.d_model), pool.cfg.d_model
        if self.on_cpu:  # host arrays the bound values share: writing them is the copy in
            self.hidden_array = np.zeros(shape, pool.dtype)
            self.seqlens_array = np.zeros(count, np.int32)
            self.output_array = np.zeros((count, 1, d_model), pool.dtype)
            values = [ort.OrtValue.ortvalue_from_numpy(a) for a in (self.hidden_array, self.seqlens_array)]
            self.output_value = ort.OrtValue.ortvalue_from_numpy(self.output_array)
        else:
            values = [
                ort.OrtValue.ortvalue_from_shape_and_type(s, t, pool.device, pool.device_id)
                for s, t in ((shape, pool.dtype), ((count,), np.int32))
            ]
            self.output_value = ort.OrtValue.ortvalue_from_shape_and_type(
                shape, pool.dtype, pool.device, pool.device_id
            )
        self.hidden, self.seqlens_k = values
        # a CPU input of the op: read when a graph is captured, so it must not change (it does not)
        self.total = ort.OrtValue.ortvalue_from_numpy(np.array(pool.row_shape[1], np.int32))
        self.binding = pool.session.io_binding()
        self.binding.bind_ortvalue_input(names.HIDDEN_STATES, self.hidden)
        self.binding.bind_ortvalue_input(names.SEQLENS_K, self.seqlens_k)
        self.binding.bind_ortvalue_input(names.TOTAL_SEQUENCE_LENGTH, self.total)
        self.binding.bind_ortvalue_output(names.OUTPUT, self.output_value)
        pool.bind_caches(self.binding, low, count)
        self.run_options = run_options({"gpu_graph_id": str(graph_id)}) if pool.cuda_graphs else None

    def run(self, hidden: np.ndarray, seqlens_k: np.ndarray) -> None:
        if self.on_cpu:
            self.hidden_array[...] = hidden
            self.seqlens_array[...] = seqlens_k
        else:
            self.hidden.update_inplace(hidden)
            self.seqlens_k.update_inplace(seqlens_k)
        self.pool.session.run_with_iobinding(self.binding, self.run_options)

    def output(self) -> np.ndarray:
        return self.output_array.copy() if self.on_cpu else self.output_value.numpy()
