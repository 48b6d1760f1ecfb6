"""Driving a static-cache graph (`fp32-static`, `fp16-static`): a pool of cache rows on the session's
device, each row one sequence's keys and values, appended in place.

Per past tensor the pool holds one buffer (rows, n_kv, capacity + 1, head_dim), allocated once and
bound (by address, through IOBinding) as both the graph's past and its present, so a step moves no
cache: GroupQueryAttention reads each row's first `seqlens_k + 1` positions and writes the new keys
and values at the row's length.

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

from collections.abc import Mapping, Sequence

import numpy as np

from export import names
from export.config import ModelConfig

CPU, CUDA = "cpu", "cuda"


def session_device(session) -> str:
    """Where a session keeps its tensors: CUDA when its first provider is a GPU one."""
    return CUDA if session.get_providers()[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider") else CPU


def uses_cuda_graphs(session) -> bool:
    """Whether the session was made with ONNX Runtime's CUDA graphs on (CUDA provider option)."""
    options = session.get_provider_options().get("CUDAExecutionProvider", {})
    return options.get("enable_cuda_graph") == "1"


def session_float_dtype(session) -> type:
    hidden = next(i for i in session.get_inputs() if i.name == names.HIDDEN_STATES)
    return np.float16 if hidden.type == "tensor(float16)" else np.float32


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
        self._graphs: dict[int, _DecodeGraph] = {}
        self.session, self.cfg, self.rows, self.capacity = session, cfg, rows, capacity
        self.device, self.device_id = session_device(session), device_id
        self.dtype = session_float_dtype(session)
        self.past_names = names.past_names(cfg.n_layers)
        self.present_names = names.present_names(cfg.n_layers)
        self.row_shape = (cfg.n_kv_heads, capacity + 1, cfg.head_dim)
        shape = (rows, *self.row_shape)
        # zeros, not garbage: no kernel should read past a row's length, and if one did it must
        # not read NaN. On the CPU the pages of np.zeros are only touched as rows fill up.
        self._host = [np.zeros(shape, self.dtype) for _ in self.past_names] if self.device == CPU else []
        self.buffers = [ort.OrtValue.ortvalue_from_numpy(array) for array in self._host] or [
            ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, self.dtype), CUDA, device_id) for _ in self.past_names
        ]
        self.row_bytes = int(np.prod(self.row_shape)) * np.dtype(self.dtype).itemsize
        self.lengths = np.zeros(rows, np.int64)
        self.description = f"{rows} rows of {capacity} positions on {self.device}"

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
        decode = sorted(row for row, hidden in steps.items() if hidden.shape[0] == 1)
        windows = ([decode] if decode else []) + [[row] for row, hidden in steps.items() if hidden.shape[0] > 1]
        results: dict[int, np.ndarray | Exception] = {}
        for rows in windows:
            try:
                results.update(self._run_window(rows, steps))
            except Exception as error:  # the next windows still run; these rows answer with the error
                results.update(dict.fromkeys(rows, error))
        return results

    def _run_window(self, rows: Sequence[int], steps: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
        low, high = rows[0], rows[-1] + 1
        new = max(steps[row].shape[0] for row in rows)
        if new == 1 and self.cuda_graphs:
            return self._run_graph(rows, steps)
        hidden = np.zeros((high - low, new, self.cfg.d_model), self.dtype)  # (B, T, d_model)
        for row in rows:
            hidden[row - low, : steps[row].shape[0]] = steps[row]
        seqlens_k = (self.lengths[low:high] + new - 1).astype(np.int32)  # (B,): length after the step - 1
        binding = self.session.io_binding()
        binding.bind_cpu_input(names.HIDDEN_STATES, hidden)
        binding.bind_cpu_input(names.SEQLENS_K, seqlens_k)
        binding.bind_cpu_input(names.TOTAL_SEQUENCE_LENGTH, np.array(self._total_length(seqlens_k, new), np.int32))
        binding.bind_output(names.OUTPUT, CPU)
        self.bind_caches(binding, low, high - low)
        self.session.run_with_iobinding(binding, _run_options(-1) if self.cuda_graphs else None)
        return self._advance(rows, steps, binding.get_outputs()[0].numpy(), low)

    def _advance(self, rows: Sequence[int], steps: Mapping[int, np.ndarray], output: np.ndarray, low: int) -> dict:
        """The rows' outputs out of the window's (B, T, d_model), their lengths moved on."""
        results = {}
        for row in rows:
            added = steps[row].shape[0]
            self.lengths[row] += added
            results[row] = output[row - low, :added]
        return results

    def _run_graph(self, rows: Sequence[int], steps: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
        """A decode window [0, high) through its CUDA graph: inputs copied into the graph's own
        buffers, the caches bound at the pool's base address, the same for every step."""
        high = rows[-1] + 1
        graph = self._graphs.get(high) or self._graphs.setdefault(high, _DecodeGraph(self, high))
        hidden = np.zeros((high, 1, self.cfg.d_model), self.dtype)  # (B, 1, d_model)
        for row in rows:
            hidden[row] = steps[row]
        graph.hidden.update_inplace(hidden)
        graph.seqlens_k.update_inplace(self.lengths[:high].astype(np.int32))  # one new token: length - 1 after
        self.session.run_with_iobinding(graph.binding, graph.run_options)
        return self._advance(rows, steps, graph.output.numpy(), 0)

    def bind_caches(self, binding, low: int, count: int) -> None:
        """Rows [low, low + count) of every cache buffer as the graph's past and present."""
        window = (count, *self.row_shape)
        for past, present, buffer in zip(self.past_names, self.present_names, self.buffers, strict=True):
            address = buffer.data_ptr() + low * self.row_bytes
            binding.bind_input(past, self.device, self.device_id, self.dtype, window, address)
            binding.bind_output(present, self.device, self.device_id, self.dtype, window, address)

    def _total_length(self, seqlens_k: np.ndarray, new: int) -> int:
        """GroupQueryAttention's `total_sequence_length`. A decode step (one token per row) passes the
        buffer's length, the same every step: the op then reads each row's length from `seqlens_k` only
        (token generation: sequence length 1 differs from the total), so a captured CUDA graph stays
        valid whatever the lengths. A prompt passes its real total (a first prompt is told apart by
        sequence length == total)."""
        return self.row_shape[1] if new == 1 else int(seqlens_k.max()) + 1

    def read(self, row: int) -> dict[str, np.ndarray]:
        """Row `row`'s cache as host arrays (1, n_kv, length, head_dim), by past name (for checks)."""
        length = int(self.lengths[row])
        arrays = self._host or [buffer.numpy() for buffer in self.buffers]
        return {
            name: np.array(array[row : row + 1, :, :length])
            for name, array in zip(self.past_names, arrays, strict=True)
        }


def _run_options(graph_id: int):
    """ONNX Runtime's CUDA graph annotation: which captured graph a run replays (-1: none)."""
    import onnxruntime as ort

    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(graph_id))
    return options


class _DecodeGraph:
    """The fixed buffers and binding of one decode window size [0, rows) of a pool: ONNX Runtime
    captures the graph on its second run with an id and replays it from then on."""

    def __init__(self, pool: KVPool, rows: int) -> None:
        import onnxruntime as ort

        device, device_id, d_model = pool.device, pool.device_id, pool.cfg.d_model

        def on_device(shape, dtype):
            return ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device, device_id)

        self.hidden = on_device((rows, 1, d_model), pool.dtype)
        self.seqlens_k = on_device((rows,), np.int32)
        self.output = on_device((rows, 1, d_model), pool.dtype)
        # a CPU input of the op: read when the graph is captured, so it must not change (it does not)
        self.total = ort.OrtValue.ortvalue_from_numpy(np.array(pool.row_shape[1], np.int32))
        self.binding = pool.session.io_binding()
        self.binding.bind_ortvalue_input(names.HIDDEN_STATES, self.hidden)
        self.binding.bind_ortvalue_input(names.SEQLENS_K, self.seqlens_k)
        self.binding.bind_ortvalue_input(names.TOTAL_SEQUENCE_LENGTH, self.total)
        self.binding.bind_ortvalue_output(names.OUTPUT, self.output)
        pool.bind_caches(self.binding, 0, rows)
        self.run_options = _run_options(rows)
