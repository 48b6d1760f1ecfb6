"""TensorRT's optimization profiles and ONNX Runtime's TensorRT EP options for the fused graphs: plain
data, written into an engine's ONNX Runtime sessions (serving/engine/placement.py) and into Triton's
`optimization` block of the onnxruntime-backend model (serving/triton/config.py), from one definition.

A TensorRT engine is built for shape ranges (profiles): min, opt (where kernels are tuned) and max
for every dynamic input. The points come from a `ModelConfig` and `Limits` and are shared by all
inputs, so `attention_mask`'s length is past + sequence at each point and the cache inputs agree
with it; the min point has an empty past (a first call) and one new token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from contract import names
from contract.config import ModelConfig

DEFAULT_WORKSPACE_BYTES = 1 << 30  # Triton's default; TensorRT may use less
POINTS = ("min", "opt", "max")


class LimitsError(ValueError):
    """Limits that no engine could serve, or that exceed what the config is sized for."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a deployment serves: batch rows, new tokens per call, cached tokens before the call.

    `max_sequence=None` is 512 new tokens, or half of max_seq_len when that is shorter;
    `max_past=None` sizes the cache to the config (`max_seq_len - max_sequence`); the opt point is
    a decode step (one new token) halfway into the cache unless given.
    """

    max_batch: int = 8
    max_sequence: int | None = None
    max_past: int | None = None
    opt_batch: int = 1
    opt_sequence: int = 1
    opt_past: int | None = None

    def points(self, cfg: ModelConfig) -> dict[str, dict[str, int]]:
        """Axis sizes (naming-table axis names) at the min, opt and max points."""
        max_sequence = self.sequence_limit(cfg)
        max_past = cfg.max_seq_len - max_sequence if self.max_past is None else self.max_past
        opt_past = max_past // 2 if self.opt_past is None else self.opt_past
        self._check(cfg, max_past, opt_past, max_sequence)
        corners = {
            "min": (1, 1, 0),  # one row, one token, empty past: the smallest valid call
            "opt": (self.opt_batch, self.opt_sequence, opt_past),
            "max": (self.max_batch, max_sequence, max_past),
        }
        return {point: axis_sizes(*corner) for point, corner in corners.items()}

    def sequence_limit(self, cfg: ModelConfig) -> int:
        """New tokens per call at the max point."""
        return self.max_sequence if self.max_sequence is not None else max(1, min(512, cfg.max_seq_len // 2))

    def _check(self, cfg: ModelConfig, max_past: int, opt_past: int, max_sequence: int) -> None:
        for name, value, low, high in [
            ("max_batch", self.max_batch, 1, None),
            ("max_sequence", max_sequence, 1, cfg.max_seq_len),
            ("max_past", max_past, 0, cfg.max_seq_len - max_sequence),
            ("opt_batch", self.opt_batch, 1, self.max_batch),
            ("opt_sequence", self.opt_sequence, 1, max_sequence),
            ("opt_past", opt_past, 0, max_past),
        ]:
            if value < low or (high is not None and value > high):
                bound = f"between {low} and {high}" if high is not None else f"at least {low}"
                raise LimitsError(f"{name} must be {bound} (max_seq_len {cfg.max_seq_len}), got {value}")


def axis_sizes(batch: int, sequence: int, past: int) -> dict[str, int]:
    return {
        names.BATCH: batch,
        names.SEQUENCE: sequence,
        names.PAST_SEQUENCE: past,
        names.TOTAL_SEQUENCE: past + sequence,  # attention_mask covers the cache and the new tokens
    }


@dataclasses.dataclass(frozen=True)
class ShapeRange:
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


def profile(cfg: ModelConfig, limits: Limits) -> dict[str, ShapeRange]:
    """One optimization profile: a shape range for every graph input, in graph order."""
    points = limits.points(cfg)
    return {
        spec.name: ShapeRange(*(tuple(axis_size(axis, points[p]) for axis in spec.shape) for p in POINTS))
        for spec in names.input_specs(cfg)
    }


def axis_size(axis: str | int, sizes: dict[str, int]) -> int:
    return sizes[axis] if isinstance(axis, str) else axis


def shapes_option(shape_ranges: dict[str, ShapeRange], point: str) -> str:
    """ONNX Runtime's profile format: "name:1x1x512,name2:1x8x0x64"."""
    return ",".join(f"{name}:{'x'.join(str(d) for d in getattr(r, point))}" for name, r in shape_ranges.items())


def provider_options(
    cfg: ModelConfig,
    limits: Limits,
    cache_path: str | Path,
    fp16: bool = True,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
) -> dict[str, Any]:
    """Options for ONNX Runtime's TensorRT execution provider (Python bools, as ORT documents)."""
    shape_ranges = profile(cfg, limits)
    return {
        "trt_fp16_enable": fp16,
        "trt_max_workspace_size": workspace_bytes,
        "trt_engine_cache_enable": True,  # an engine takes minutes to build: build once per GPU
        "trt_engine_cache_path": str(cache_path),
        "trt_timing_cache_enable": True,
        "trt_layer_norm_fp32_fallback": True,  # LayerNorm statistics overflow fp16 at |x| ~ 1e3
        **{f"trt_profile_{point}_shapes": shapes_option(shape_ranges, point) for point in POINTS},
    }
