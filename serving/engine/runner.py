"""ONNX Runtime behind the Python-backend models: the graph's session, its execution provider chosen
by availability (TensorRT, then CUDA, then CPU), and the caches kept on that provider's device.

Inputs and caches are `OrtValue`s bound with IOBinding: the graph's presents stay on the device as
the next step's past, so on a GPU the caches never travel to the host. The copies batching needs
(left-padding pasts into one batch, slicing each sequence's present back out) run as two tiny ONNX
graphs on the GPU (`DeviceCopies`), and as numpy copies on the CPU (`HostCopies`: a CPU cache is
host memory already, and a graph run per copy costs more than the copy). Tests run both on the CPU.
"""

from __future__ import annotations

import collections
import logging
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from contract import names
from contract.config import ModelConfig
from contract.inputs import default_positions, with_defaults
from serving.engine import tensorrt
from serving.engine.errors import InvalidRequest
from serving.engine.kernels import kernel_model
from serving.engine.ort import (
    CPU,
    CPU_PROVIDER,
    CUDA,
    CUDA_PROVIDER,
    run_options,
    session_device,
    session_float_dtype,
    session_options,
)
from serving.engine.placement import Placement, choose_placement, open_session

log = logging.getLogger(__name__)

# A run this many tokens long gives the arena's memory back after it: its attention scores grow
# with tokens x length (measured on the seed model: a 4,096-token request left the stateless stub
# at 716 MiB of its own memory, against 42 MiB before it). Shorter runs keep the arena's speed.
LARGE_RUN_TOKENS = 256


class Runner:
    """The graph of `model_path` on the best available device, with device-resident caches."""

    def __init__(
        self,
        model_path: str | Path,
        cfg: ModelConfig,
        threads: int = 0,
        limits: tensorrt.Limits | None = None,
        trt_cache: str | Path | None = None,
        providers: Sequence | None = None,
        device_id: int = 0,
        copies: str | None = None,
        placement: Placement | None = None,
    ) -> None:
        """`copies="device"` runs batching's copies as device graphs even on the CPU (tests of the GPU path).
        Placement: `placement` when given, else `providers` when given, else the best usable here."""
        self.cfg = cfg
        self.device_id = device_id
        if placement is not None:
            pass
        elif providers is None:
            trt_cache = Path(trt_cache or Path(tempfile.gettempdir()) / "attention-serving-trt")
            placement = choose_placement(cfg, limits or tensorrt.Limits(), trt_cache, device_id)
        else:
            placement = Placement(CPU, list(providers), ["providers given by the caller"])
        self.session = open_session(model_path, placement, threads)
        self.device = session_device(self.session)
        self.dtype = session_float_dtype(self.session)
        if self.device == CUDA or copies == "device":
            # the copies run where the caches are; TensorRT would only build engines for them
            on_device = [(CUDA_PROVIDER, {"device_id": device_id})] if self.device == CUDA else []
            self.copies: HostCopies | DeviceCopies = DeviceCopies(
                cfg, [*on_device, CPU_PROVIDER], self.device, device_id
            )
        else:
            self.copies = HostCopies()
        self.past_names = names.past_names(cfg.n_layers)
        self.present_names = names.present_names(cfg.n_layers)
        self._give_back = run_options({"memory.enable_memory_arena_shrinkage": "cpu:0"})
        self.description = (
            f"{Path(model_path).name} on {self.session.get_providers()[0]} (caches on {self.device}); "
            + "; ".join(placement.notes)
        )
        log.info("runner: %s", self.description)

    def to_device(self, array: np.ndarray) -> ort.OrtValue:
        """A host array as a value on the runner's device (no copy on the CPU), floats in the graph's
        float dtype (an fp16 graph takes the served fp32 values rounded)."""
        if array.dtype.kind == "f" and array.dtype != self.dtype:
            array = array.astype(self.dtype)
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device, self.device_id)

    def empty_past(self, batch: int = 1) -> list[ort.OrtValue]:
        shape = (batch, self.cfg.n_kv_heads, 0, self.cfg.head_dim)
        return [self.to_device(np.zeros(shape, self.dtype)) for _ in self.past_names]

    def run(
        self,
        hidden: np.ndarray,
        mask: np.ndarray,
        past: Sequence[ort.OrtValue],
        presents_on_host: bool = False,
        positions: np.ndarray | None = None,
    ) -> tuple[np.ndarray, list[ort.OrtValue]]:
        """One graph run: hidden (B, T, d) and mask (B, P+T) from the host, past on the device; for a
        model with rotary embeddings the new tokens' positions (B, T), counted from the mask when None
        (so a batch left-padded by the concat engine places each row's tokens after its own past).

        Returns the output on the host and the presents on the device (or the host if asked).
        """
        binding = self.session.io_binding()
        binding.bind_ortvalue_input(names.HIDDEN_STATES, self.to_device(hidden))
        binding.bind_ortvalue_input(names.ATTENTION_MASK, self.to_device(mask))
        if self.cfg.rotary:
            positions = default_positions(mask, hidden.shape[1]) if positions is None else positions
            binding.bind_ortvalue_input(names.POSITION_IDS, self.to_device(positions))
        for name, value in zip(self.past_names, past, strict=True):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(names.OUTPUT, CPU)
        present_device = CPU if presents_on_host else self.device
        for name in self.present_names:
            binding.bind_output(name, present_device, self.device_id)
        large = self.device == CPU and hidden.shape[0] * hidden.shape[1] >= LARGE_RUN_TOKENS
        self.session.run_with_iobinding(binding, self._give_back if large else None)
        values = binding.get_outputs()  # in binding order: output, then the presents
        return values[0].numpy(), list(values[1:])

    def run_arrays(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Stateless: named host arrays in and out (an omitted mask is all ones, an omitted past empty)."""
        feeds = with_defaults(self.cfg, feeds)
        past = [self.to_device(feeds[name]) for name in self.past_names]
        output, presents = self.run(
            feeds[names.HIDDEN_STATES],
            feeds[names.ATTENTION_MASK],
            past,
            presents_on_host=True,
            positions=feeds.get(names.POSITION_IDS),
        )
        arrays = {names.OUTPUT: output} | {n: v.numpy() for n, v in zip(self.present_names, presents, strict=True)}
        return {name: array.astype(np.float32, copy=False) for name, array in arrays.items()}  # served IO is fp32


class InspectionRunner:
    """The inspection graph (`fp32-fused-inspect`: the fused graph that also returns each layer's
    attention weights, `attention.{i}`) on the CPU, for the requests that ask for the maps. Its session
    opens on the first such request, so a server whose callers never ask pays nothing for it; `path`
    None: the artifact has no such graph, and a request for maps is refused naming it."""

    def __init__(self, path: Path | None, cfg: ModelConfig, threads: int = 0) -> None:
        self.path, self.cfg, self.threads = path, cfg, threads
        self._session: ort.InferenceSession | None = None
        self._lock = threading.Lock()

    def _opened(self) -> ort.InferenceSession:
        if self.path is None:
            wanted = names.INSPECTION_VARIANT
            raise InvalidRequest(
                f"attention maps need the inspection graph {wanted} (model.{wanted}.onnx), which this deployment "
                f"does not have; build it (python -m export build --variants ... {wanted}) and write the "
                "repository again"
            )
        with self._lock:
            if self._session is None:
                options = session_options(self.threads, spinning=False)
                self._session = ort.InferenceSession(str(self.path), sess_options=options, providers=[CPU_PROVIDER])
                log.info("inspection runner: %s on %s, opened for a request of attention maps", self.path.name, CPU)
            return self._session

    def run_arrays(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Stateless, as `Runner.run_arrays`: the output, the presents and the maps `attention.{i}`
        (B, n_heads, T, P+T), fp32 host arrays."""
        session = self._opened()
        feeds = with_defaults(self.cfg, feeds)
        wanted = [value.name for value in session.get_inputs()]
        outputs = [value.name for value in session.get_outputs()]
        arrays = session.run(outputs, {name: feeds[name] for name in wanted})
        return {name: array.astype(np.float32, copy=False) for name, array in zip(outputs, arrays, strict=True)}


def nbytes(values: Sequence[ort.OrtValue]) -> int:
    return sum(value.tensor_size_in_bytes() for value in values)


class HostCopies:
    """Batching's copies on the CPU, in numpy: a CPU cache is host memory, `OrtValue.numpy()` views it."""

    def stack(self, rows: Sequence[Sequence[ort.OrtValue]], left_pads: Sequence[int]) -> list[ort.OrtValue]:
        """rows[r][k]: row r's k-th past tensor (1, n_kv, P_r, hd); the k-th batched pasts, each row
        left-padded with zeros to P_max = P_r + left_pads[r]."""
        stacked = []
        for k in range(len(rows[0])):
            first = rows[0][k].numpy()
            batch = np.empty((len(rows), first.shape[1], first.shape[2] + left_pads[0], first.shape[3]), np.float32)
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
    """Batching's device-side copies as tiny ONNX graphs on the runner's device.

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
