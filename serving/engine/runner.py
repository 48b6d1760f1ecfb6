"""ONNX Runtime behind the Python-backend models: the graph's session, its execution provider chosen
by availability (TensorRT, then CUDA, then CPU), and the caches kept on that provider's device; and
the inspection graph that answers attention maps (`InspectionRunner`).

Inputs and caches are `OrtValue`s bound with IOBinding: the graph's presents stay on the device as
the next step's past, so on a GPU the caches never travel to the host. The runner is stateless: what
keeps and batches caches (the concat engine, serving/engine/concat/) holds them, and its copies.
"""

from __future__ import annotations

import logging
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
from serving.engine.ort import (
    CPU,
    CPU_PROVIDER,
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
        placement: Placement | None = None,
    ) -> None:
        """Placement: `placement` when given, else `providers` when given, else the best usable here."""
        self.cfg = cfg
        self.device_id = device_id
        if placement is None and providers is None:
            trt_cache = Path(trt_cache or tensorrt.trt_cache_dir())
            placement = choose_placement(cfg, limits or tensorrt.Limits(), trt_cache, device_id)
        elif placement is None:
            placement = Placement(CPU, list(providers), ["providers given by the caller"])
        self.session = open_session(model_path, placement, threads)
        self.device = session_device(self.session)
        self.dtype = session_float_dtype(self.session)
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
        tokens: np.ndarray,
        mask: np.ndarray,
        past: Sequence[ort.OrtValue],
        presents_on_host: bool = False,
        positions: np.ndarray | None = None,
    ) -> tuple[np.ndarray, list[ort.OrtValue]]:
        """One graph run: the new tokens (hidden states (B, T, d), or a whole model's ids (B, T) int64) and
        mask (B, P+T) from the host, past on the device; for a model placing tokens by position (rotary or
        learned positions) the new tokens' positions (B, T), counted from the mask when None (so a batch
        left-padded by the concat engine places each row's tokens after its own past).

        Returns the output (a whole model's logits (B, T, vocab)) on the host and the presents on the
        device (or the host if asked).
        """
        binding = self.session.io_binding()
        binding.bind_ortvalue_input(names.model_input(self.cfg), self.to_device(tokens))
        binding.bind_ortvalue_input(names.ATTENTION_MASK, self.to_device(mask))
        if self.cfg.positioned:
            positions = default_positions(mask, tokens.shape[1]) if positions is None else positions
            binding.bind_ortvalue_input(names.POSITION_IDS, self.to_device(positions))
        for name, value in zip(self.past_names, past, strict=True):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(names.model_output(self.cfg), CPU)
        present_device = CPU if presents_on_host else self.device
        for name in self.present_names:
            binding.bind_output(name, present_device, self.device_id)
        large = self.device == CPU and tokens.shape[0] * tokens.shape[1] >= LARGE_RUN_TOKENS
        self.session.run_with_iobinding(binding, self._give_back if large else None)
        values = binding.get_outputs()  # in binding order: output, then the presents
        return values[0].numpy(), list(values[1:])

    def run_arrays(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Stateless: named host arrays in and out (an omitted mask is all ones, an omitted past empty)."""
        feeds = with_defaults(self.cfg, feeds)
        past = [self.to_device(feeds[name]) for name in self.past_names]
        output, presents = self.run(
            feeds[names.model_input(self.cfg)],
            feeds[names.ATTENTION_MASK],
            past,
            presents_on_host=True,
            positions=feeds.get(names.POSITION_IDS),
        )
        outputs = {names.model_output(self.cfg): output}
        arrays = outputs | {n: v.numpy() for n, v in zip(self.present_names, presents, strict=True)}
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

    def session_step(self, past: Mapping[str, np.ndarray], tokens: np.ndarray) -> dict[str, np.ndarray]:
        """The output (1, T, d_model) (a whole model's logits (1, T, vocab)) and each layer's maps
        `attention.{i}` (1, n_heads, T, length + T) of a session's next step of `tokens` (T, d_model) (a
        whole model's ids (T,)) over its cache `past` (past name -> (1, n_kv, length, hd) fp32, real
        positions only, as a session's cache holds them)."""
        length = next(iter(past.values())).shape[2]
        new_tokens = tokens[None].astype(np.int64 if self.cfg.whole else np.float32, copy=False)
        feeds = {
            names.model_input(self.cfg): new_tokens,
            names.ATTENTION_MASK: np.ones((1, length + len(tokens)), np.int64),
            **past,
        }
        if self.cfg.positioned:  # the new tokens sit after what the session holds, as its next step's would
            feeds[names.POSITION_IDS] = length + np.arange(len(tokens), dtype=np.int64)[None]
        outputs = self.run_arrays(feeds)
        answered = [names.model_output(self.cfg), *names.attention_map_names(self.cfg.n_layers)]
        return {name: outputs[name] for name in answered}
