"""The small ONNX graphs the engines run beside the model, and the bound runs of the model itself that
a static cache needs: the kernel-model helper every small graph goes through (copies of cache rows,
batching's pads and slices), a row copy, and a decode window. They take buffers (addresses, shapes,
dtypes, devices) and sessions, never an engine or a pool, so this module imports nothing of the
engine's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from contract import names

KERNEL_OPSET = 18
HOST = "cpu"  # ONNX Runtime's name of the host device (serving/engine/ort.py's CPU)


def kernel_model(nodes, inputs, outputs, initializers=()):
    """A one-graph ONNX model of `nodes` at `KERNEL_OPSET`, in the IR version ONNX Runtime 1.31 loads."""
    from onnx import helper

    graph = helper.make_graph(nodes, "cache_kernel", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", KERNEL_OPSET)])
    model.ir_version = 10  # what ONNX Runtime 1.31 loads (measured)
    return model


@dataclasses.dataclass(frozen=True)
class CacheRows:
    """Consecutive rows of every cache buffer, by address: `shape` (rows, n_kv, positions, width) of
    `dtype` from `addresses[i]` in buffer i, on `device` (number `device_id`)."""

    addresses: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: type
    device: str
    device_id: int

    def bind(self, binding, inputs: Sequence[str] = (), outputs: Sequence[str] = ()) -> None:
        """These rows as the inputs `inputs` and the outputs `outputs` (a name per buffer, in order)."""
        for bind, bound in ((binding.bind_input, inputs), (binding.bind_output, outputs)):
            for name, address in zip(bound, self.addresses, strict=True) if bound else ():
                bind(name, self.device, self.device_id, self.dtype, self.shape, address)


class RowCopy:
    """A row of `buffers` cache buffers (each row `row_shape`, of `dtype`) copied by two small graphs
    on the device of `providers`, bound by address: positions `start` to `length` to the host
    (Slice), and a whole row from the host or from another row (Identity). It holds no buffer, so
    one serves every slab of rows of this shape. A row's first positions are strided inside it (n_kv,
    positions, width): what comes from the host is a whole row."""

    def __init__(self, buffers: int, row_shape: tuple[int, ...], dtype: type, providers: list, options) -> None:
        import onnxruntime as ort
        from onnx import helper

        self.buffers, self.row_shape = buffers, tuple(row_shape)
        element = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        shape = [1, *row_shape]
        self.inputs = [f"in.{i}" for i in range(buffers)]
        self.outputs = [f"out.{i}" for i in range(buffers)]
        inputs = [helper.make_tensor_value_info(name, element, shape) for name in self.inputs]
        whole = [helper.make_tensor_value_info(name, element, shape) for name in self.outputs]
        copy = [helper.make_node("Identity", [i], [o]) for i, o in zip(self.inputs, self.outputs, strict=True)]
        # the used positions: axis 2 from `start` to `length` (inputs: one graph for every range)
        bounds = [helper.make_tensor_value_info(name, helper.TensorProto.INT64, [1]) for name in ("start", "length")]
        axis = helper.make_tensor("axis", helper.TensorProto.INT64, [1], [2])
        cut = [
            helper.make_node("Slice", [i, "start", "length", "axis"], [o])
            for i, o in zip(self.inputs, self.outputs, strict=True)
        ]
        used = [helper.make_tensor_value_info(o, element, [1, shape[1], "positions", shape[3]]) for o in self.outputs]

        def open_graph(model):
            return ort.InferenceSession(model.SerializeToString(), sess_options=options, providers=providers)

        self.copy = open_graph(kernel_model(copy, inputs, whole))
        self.cut = open_graph(kernel_model(cut, [*inputs, *bounds], used, [axis]))

    def to_host(self, row: CacheRows, length: int, start: int = 0) -> list[np.ndarray]:
        """Positions `start` to `length` of `row` in every buffer: (n_kv, length - start, width) each."""
        binding = self.cut.io_binding()
        row.bind(binding, inputs=self.inputs)
        binding.bind_cpu_input("start", np.array([start], np.int64))
        binding.bind_cpu_input("length", np.array([length], np.int64))
        for name in self.outputs:
            binding.bind_output(name, HOST)
        self.cut.run_with_iobinding(binding)
        return [value.numpy()[0] for value in binding.get_outputs()]

    def from_host(self, arrays: Sequence[np.ndarray], row: CacheRows) -> None:
        """`row` of every buffer holds `arrays` (whole rows, `row_shape` each) from now on."""
        binding = self.copy.io_binding()
        for name, array in zip(self.inputs, arrays, strict=True):
            binding.bind_cpu_input(name, np.ascontiguousarray(array[None], row.dtype))
        row.bind(binding, outputs=self.outputs)
        self.copy.run_with_iobinding(binding)

    def within(self, source: CacheRows, target: CacheRows) -> None:
        """`target` holds what `source` holds (both rows of this shape, on the device)."""
        assert source.addresses != target.addresses
        binding = self.copy.io_binding()
        source.bind(binding, inputs=self.inputs)
        target.bind(binding, outputs=self.outputs)
        self.copy.run_with_iobinding(binding)


class DecodeWindow:
    """Rows `caches` of a static graph's cache for one-token steps of `session`: input and output buffers
    of their own, bound once with the caches' addresses; each step copies its tokens and lengths in
    and runs. With CUDA graphs (`run_options` naming a graph id) ONNX Runtime captures the window on
    its second run and replays it from then on (the same addresses every time, which is what a
    replay needs).

    The new tokens are what the graph's first input takes: hidden states (count, 1, d_model) in the
    graph's float, or a whole model's token ids (count, 1) int64; its first output (`output` (count, 1,
    d_model) or `logits` (count, 1, vocab)) is in `dtype`. A graph that takes `position_ids` (GPT-2's
    learned positions) is given each row's (count, 1) as well.

    `total_sequence_length` is the rows' length, the same every step: in token generation (one new
    token, fewer than the total) the op reads each row's length from `seqlens_k` only, so a captured
    graph stays right whatever the lengths (the CPU and GPU parity rungs prove it)."""

    def __init__(self, session, caches: CacheRows, dtype: type, run_options=None) -> None:
        import onnxruntime as ort

        self.session, self.run_options = session, run_options
        count, device, device_id = caches.shape[0], caches.device, caches.device_id
        self.on_host = device == HOST
        first_input, first_output = session.get_inputs()[0], session.get_outputs()[0]
        self.input_name, self.output_name = first_input.name, first_output.name
        if first_input.name == names.INPUT_IDS:
            new_shape, new_dtype = (count, 1), np.int64
        else:
            new_shape, new_dtype = (count, 1, first_input.shape[-1]), dtype
        out_shape = (count, 1, first_output.shape[-1])
        self.positioned = any(i.name == names.POSITION_IDS for i in session.get_inputs())
        values = [(new_shape, new_dtype), ((count,), np.int32), (out_shape, dtype)]
        values += [((count, 1), np.int64)] if self.positioned else []
        self.dtypes = [value_dtype for _, value_dtype in values]
        if self.on_host:  # host arrays the bound values share: writing them is the copy in
            self.arrays = [np.zeros(shape, value_dtype) for shape, value_dtype in values]
            self.values = [ort.OrtValue.ortvalue_from_numpy(array) for array in self.arrays]
        else:
            self.values = [
                ort.OrtValue.ortvalue_from_shape_and_type(shape, value_dtype, device, device_id)
                for shape, value_dtype in values
            ]
        self.new_tokens, self.seqlens_k, self.output_value = self.values[:3]
        self.positions = self.values[3] if self.positioned else None
        # a CPU input of the op: read when a graph is captured, so it must not change (it does not)
        self.total = ort.OrtValue.ortvalue_from_numpy(np.array(caches.shape[2], np.int32))
        self.binding = session.io_binding()
        self.binding.bind_ortvalue_input(self.input_name, self.new_tokens)
        if self.positioned:
            self.binding.bind_ortvalue_input(names.POSITION_IDS, self.positions)
        self.binding.bind_ortvalue_input(names.SEQLENS_K, self.seqlens_k)
        self.binding.bind_ortvalue_input(names.TOTAL_SEQUENCE_LENGTH, self.total)
        self.binding.bind_ortvalue_output(self.output_name, self.output_value)
        layers = len(caches.addresses) // 2
        caches.bind(self.binding, inputs=names.past_names(layers), outputs=names.present_names(layers))

    def run(self, new_tokens: np.ndarray, seqlens_k: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
        """One step of `new_tokens` (count, 1, d_model) or ids (count, 1) at lengths `seqlens_k` (count,)
        and, for a graph that takes them, `positions` (count, 1); the first output (count, 1, width), a
        fresh array."""
        inputs = [new_tokens, seqlens_k] + ([positions] if self.positioned else [])
        targets = [0, 1] + ([3] if self.positioned else [])
        if self.on_host:
            for index, array in zip(targets, inputs, strict=True):
                self.arrays[index][...] = array
        else:
            for index, array in zip(targets, inputs, strict=True):
                self.values[index].update_inplace(np.ascontiguousarray(array, self.dtypes[index]))
        self.session.run_with_iobinding(self.binding, self.run_options)
        return self.arrays[2].copy() if self.on_host else self.output_value.numpy()
