"""The concat engine's copies of caches: left-padding pasts into one batch, slicing each sequence's
present back out of it (and a rewind's first positions out of a cache). On the GPU they run as two
tiny ONNX graphs where the caches are (`DeviceCopies`); on the CPU as numpy copies (`HostCopies`: a
CPU cache is host memory already, and a graph run per copy costs more than the copy). Tests run both
on the CPU (`copies_for(runner, on_device=True)`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from contract import names
from contract.config import ModelConfig
from serving.engine.ort import CPU_PROVIDER, CUDA, CUDA_PROVIDER, session_options
from serving.engine.runner import Runner
from serving.engine.side_graphs import kernel_model


def copies_for(runner: Runner, on_device: bool = False) -> HostCopies | DeviceCopies:
    """The copies for the runner's caches: graphs on its GPU, numpy on the CPU; `on_device` runs the
    graphs on the CPU too (tests of the GPU path)."""
    if runner.device != CUDA and not on_device:
        return HostCopies()
    # the copies run where the caches are; TensorRT would only build engines for them
    gpu = [(CUDA_PROVIDER, {"device_id": runner.device_id})] if runner.device == CUDA else []
    return DeviceCopies(runner.cfg, [*gpu, CPU_PROVIDER], runner.device, runner.device_id)


def nbytes(values: Sequence[ort.OrtValue]) -> int:
    return sum(value.tensor_size_in_bytes() for value in values)


class HostCopies:
    """The copies on the CPU, in numpy: a CPU cache is host memory, `OrtValue.numpy()` views it."""

    def stack(self, rows: Sequence[Sequence[ort.OrtValue]], left_pads: Sequence[int]) -> list[ort.OrtValue]:
        """rows[r][k]: row r's k-th past tensor (1, n_kv, P_r, hd); the k-th batched pasts, each row
        left-padded with zeros to P_max = P_r + left_pads[r]."""
        stacked = []
        for k in range(len(rows[0])):
            first = rows[0][k].numpy()
            batch = np.empty((len(rows), first.shape[1], first.shape[2] + left_pads[0], first.shape[3]), first.dtype)
            for r, (row, pad) in enumerate(zip(rows, left_pads, strict=True)):
                batch[r, :, :pad] = 0
                batch[r, :, pad:] = row[k].numpy()[0]
            stacked.append(ort.OrtValue.ortvalue_from_numpy(batch))
        return stacked

    def split(self, batched: Sequence[ort.OrtValue], starts: Sequence[int], ends: Sequence[int]) -> list[list]:
        """Per row r, each tensor's positions [starts[r], ends[r]) as its own (1, n_kv, len, hd) value."""
        arrays = [value.numpy() for value in batched]
        return [
            [ort.OrtValue.ortvalue_from_numpy(array[r : r + 1, :, start:end].copy()) for array in arrays]
            for r, (start, end) in enumerate(zip(starts, ends, strict=True))
        ]


class DeviceCopies:
    """The copies as tiny ONNX graphs on the runner's device.

    `stack`: each row's past (1, n_kv, P_r, hd) left-padded with zeros to P_max, rows concatenated
    into the batch's past. Rows that need no padding (P_r = P_max) come first and skip the Pad, a
    copy: decoding in near lockstep, many rows have the longest past. One graph per (batch size,
    rows without padding).
    `split`: row r's present positions [start_r, end_r) cut out of the batch's (B, n_kv, S, hd) into
    a value of its own (the cache the sequence keeps), so that the batch's buffer is freed.
    """

    MAX_GRAPHS = 128  # stack graphs kept (a few kB and one small session each); least recent go first

    def __init__(self, cfg: ModelConfig, providers: list, device: str, device_id: int) -> None:
        self.cfg, self.providers, self.device, self.device_id = cfg, providers, device, device_id
        self.tensor_names = names.past_names(cfg.n_layers)
        self._stack: collections.OrderedDict[tuple[int, int], ort.InferenceSession] = collections.OrderedDict()
        self._split: dict[int, ort.InferenceSession] = {}

    def _session(self, model, temporary_outputs: bool) -> ort.InferenceSession:
        # copies are memory-bound: no thread pool to wake. The stacked past lives for one graph run:
        # an arena reuses its memory; split outputs are kept caches and must be freed for real
        options = session_options(threads=1, arena=temporary_outputs, spinning=False)
        return ort.InferenceSession(model.SerializeToString(), sess_options=options, providers=self.providers)

    def _stack_session(self, batch: int, unpadded: int) -> ort.InferenceSession:
        key = (batch, unpadded)
        if key in self._stack:
            self._stack.move_to_end(key)
        else:
            self._stack[key] = self._session(_stack_graph(self.cfg, self.tensor_names, batch, unpadded), True)
            if len(self._stack) > self.MAX_GRAPHS:
                self._stack.popitem(last=False)
        return self._stack[key]

    def stack(self, rows: Sequence[Sequence[ort.OrtValue]], left_pads: Sequence[int]) -> list[ort.OrtValue]:
        """rows[r][k]: row r's k-th past tensor, rows without padding first; the k-th batched pasts."""
        unpadded = next((r for r, pad in enumerate(left_pads) if pad), len(left_pads))
        assert all(left_pads[unpadded:]), "rows without padding must lead"
        session = self._stack_session(len(rows), unpadded)
        binding = session.io_binding()
        for r, (row, pad) in enumerate(zip(rows, left_pads, strict=True)):
            if r >= unpadded:
                pads = np.array([0, 0, pad, 0, 0, 0, 0, 0], np.int64)  # (begin per axis, end per axis)
                binding.bind_ortvalue_input(f"pads.{r}", ort.OrtValue.ortvalue_from_numpy(pads))
            for name, value in zip(self.tensor_names, row, strict=True):
                binding.bind_ortvalue_input(f"{name}.{r}", value)
        for name in self.tensor_names:
            binding.bind_output(name, self.device, self.device_id)
        session.run_with_iobinding(binding)
        return list(binding.get_outputs())

    def split(self, batched: Sequence[ort.OrtValue], starts: Sequence[int], ends: Sequence[int]) -> list[list]:
        """Per row r, each tensor's positions [starts[r], ends[r]) as its own (1, n_kv, len, hd) value."""
        batch = len(starts)
        if batch not in self._split:
            self._split[batch] = self._session(_split_graph(self.cfg, self.tensor_names, batch), False)
        session = self._split[batch]
        binding = session.io_binding()
        for name, value in zip(self.tensor_names, batched, strict=True):
            binding.bind_ortvalue_input(name, value)
        for r, (start, end) in enumerate(zip(starts, ends, strict=True)):
            binding.bind_ortvalue_input(f"starts.{r}", ort.OrtValue.ortvalue_from_numpy(np.array([r, start])))
            binding.bind_ortvalue_input(f"ends.{r}", ort.OrtValue.ortvalue_from_numpy(np.array([r + 1, end])))
        for r in range(batch):
            for name in self.tensor_names:
                binding.bind_output(f"{name}.{r}", self.device, self.device_id)
        session.run_with_iobinding(binding)
        values = binding.get_outputs()
        width = len(self.tensor_names)
        return [list(values[r * width : (r + 1) * width]) for r in range(batch)]


def _cache_info(name: str, cfg: ModelConfig, batch: int | str, length: str):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [batch, cfg.n_kv_heads, length, cfg.head_dim])


def _stack_graph(cfg: ModelConfig, tensor_names: list[str], batch: int, unpadded: int):
    from onnx import TensorProto, helper

    padded = [r >= unpadded for r in range(batch)]
    inputs = [helper.make_tensor_value_info(f"pads.{r}", TensorProto.INT64, [8]) for r in range(unpadded, batch)]
    nodes, outputs = [], []
    for name in tensor_names:
        pieces = []
        for r in range(batch):
            inputs.append(_cache_info(f"{name}.{r}", cfg, 1, f"past_{r}"))
            pieces.append(f"{name}.{r}.padded" if padded[r] else f"{name}.{r}")
            if padded[r]:
                nodes.append(helper.make_node("Pad", [f"{name}.{r}", f"pads.{r}"], [pieces[-1]]))
        nodes.append(helper.make_node("Concat", pieces, [name], axis=0))
        outputs.append(_cache_info(name, cfg, batch, "max_past"))
    return kernel_model(nodes, inputs, outputs)


def _split_graph(cfg: ModelConfig, tensor_names: list[str], batch: int):
    from onnx import TensorProto, helper

    axes = helper.make_tensor("axes", TensorProto.INT64, [2], [0, 2])  # batch row, sequence positions
    inputs = [_cache_info(name, cfg, batch, "total") for name in tensor_names]
    for r in range(batch):
        inputs.append(helper.make_tensor_value_info(f"starts.{r}", TensorProto.INT64, [2]))
        inputs.append(helper.make_tensor_value_info(f"ends.{r}", TensorProto.INT64, [2]))
    nodes, outputs = [], []
    for r in range(batch):
        for name in tensor_names:
            nodes.append(helper.make_node("Slice", [name, f"starts.{r}", f"ends.{r}", "axes"], [f"{name}.{r}"]))
            outputs.append(_cache_info(f"{name}.{r}", cfg, 1, f"length_{r}"))
    return kernel_model(nodes, inputs, outputs, [axes])
