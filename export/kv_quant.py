"""Quantized KV caches for the static form (`fp32-static-int8kv`, `fp32-static-int4kv`): the scales,
calibrated at build time on the PyTorch original's keys and values, and the kernel's rounding as the
precision floor models it.

What ONNX Runtime 1.31's CPU `GroupQueryAttention` does with a quantized cache (measured by feeding it
keys of known values, scale 1): it stores code = clip(round(x / scale), lowest, highest) with no zero
point, rounding half to even (0.5 -> 0, 1.5 -> 2, 2.5 -> 2, 3.51 -> 4, 126.5 -> 126) and clipping to
[-128, 127] for int8 (200 -> 127, -128.4 -> -128) and [-8, 7] for int4, whose codes it keeps + 8 in a
nibble, two a byte, the even channel in the low nibble. It attends over the dequantized cache, the
new tokens' keys and values included: on 5 tokens its output matched attention over fake-quantized k
and v to 2e-7, and was 1.6e-2 (int8) and 3.1e-1 (int4) off attention over the unquantized ones.

The scales: scale = max|x| / highest (127 for int8, 7 for int4) over the calibration's keys (after the
rotation, where the model rotates k: the op stores what it rotated) and values, per layer, either one
per tensor (PER_TENSOR) or one per kv head and channel (PER_CHANNEL, (n_kv, 1, head_dim)).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

from contract import names
from contract.config import ModelConfig

PER_TENSOR, PER_CHANNEL = "PER_TENSOR", "PER_CHANNEL"  # GroupQueryAttention's k_quant_type / v_quant_type
LAYOUTS = (PER_TENSOR, PER_CHANNEL)
# Per tensor, by measurement (the default calibration of 16 x 128 tokens, seed 0 weights; the report
# records the first pair for every build, `calibration_errors`). On the calibration data itself per
# channel stores less error: relative RMS error of the keys / values, per tensor vs per channel, int8
# tiny 1.04e-2 / 9.9e-3 vs 7.6e-3 / 7.7e-3, seed 1.25e-2 / 1.08e-2 vs 8.3e-3 / 8.2e-3; int4 tiny
# 1.9e-1 / 1.8e-1 vs 1.4e-1 / 1.4e-1, seed 2.3e-1 / 2.0e-1 vs 1.5e-1 / 1.5e-1. But a channel's scale
# is the largest of only N x T of its values, and a value the rung meets beyond it is clipped: on the
# pool rung (other hidden states, up to 4 x 270 positions a channel) the worst output error was, per
# tensor vs per channel, int8 tiny 5.4e-2 vs 1.2e-1 (of the output's scale 9.9e-3 vs 6.8e-2), seed
# 4.3e-2 vs 1.3e-1 (7.7e-3 vs 2.7e-2); int4 tiny 7.9e-1 vs 8.2e-1; a cache value was clipped by up to
# 0.70 (tiny) and 2.0 (seed) per channel against 0.13 and 0.58 per tensor, whose one scale is the largest
# of N x T x n_kv x head_dim values. The served error is the rung's, so per tensor is the default.
DEFAULT_LAYOUT = PER_TENSOR

# The default calibration: hidden states at the model's scale (unit variance, as the parity scenarios
# and the init assume), from a seed no parity scenario uses (they use 0 to 2), in sequences long enough
# for the rotation to turn each pair of channels through much of its range.
CALIBRATION_SEED = 7919
CALIBRATION_SEQUENCES = 16  # 4 clipped more on the rung: int8 tiny per tensor 6.5e-2 against 5.4e-2
CALIBRATION_LENGTH = 128


class CalibrationError(ValueError):
    """A calibration file that cannot be used (the message names the file, what was expected and found)."""


def highest_code(bits: int) -> int:
    return 2 ** (bits - 1) - 1  # 127, 7: a symmetric range, so -max maps to -highest


def lowest_code(bits: int) -> int:
    return -(2 ** (bits - 1))  # -128, -8: what the kernel clips to


@dataclasses.dataclass(frozen=True)
class CalibrationData:
    """Hidden states (N, T, d_model) fp32 to calibrate on, or a whole model's token ids (N, T) int64, and
    where they came from (for the report)."""

    hidden: np.ndarray
    source: dict


def generated(
    cfg: ModelConfig, seed: int = CALIBRATION_SEED, sequences: int = CALIBRATION_SEQUENCES
) -> CalibrationData:
    """`sequences` of CALIBRATION_LENGTH (at most max_seq_len) unit-variance hidden states from `seed`, or
    for a whole model token ids uniform over its vocabulary (its embeddings make the hidden states)."""
    length = min(CALIBRATION_LENGTH, cfg.max_seq_len)
    rng = np.random.default_rng(seed)
    if cfg.whole:
        hidden = rng.integers(0, cfg.vocab_size, (sequences, length), dtype=np.int64)
    else:
        hidden = rng.standard_normal((sequences, length, cfg.d_model)).astype(np.float32)
    return CalibrationData(hidden, {"generated": {"seed": seed, "shape": list(hidden.shape)}})


def from_file(path: str | Path, cfg: ModelConfig) -> CalibrationData:
    """A user's hidden states: a `.npy` file of (N, T, d_model) floats, T at most max_seq_len; for a
    whole model its token ids, (N, T) integers in [0, vocab_size)."""
    path = Path(path)
    if cfg.whole:
        return _ids_from_file(path, cfg)
    expected = f"a .npy array of float (N, T, {cfg.d_model}) with 1 <= T <= {cfg.max_seq_len}"
    hidden = _read_npy(path, expected)
    shape_ok = hidden.ndim == 3 and hidden.shape[0] >= 1 and 1 <= hidden.shape[1] <= cfg.max_seq_len
    if not (shape_ok and hidden.shape[-1] == cfg.d_model and hidden.dtype.kind == "f"):
        raise CalibrationError(f"calibration file {path}: expected {expected}, got {hidden.dtype} {list(hidden.shape)}")
    if not np.isfinite(hidden).all():
        raise CalibrationError(f"calibration file {path}: expected {expected}, got non-finite values")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return CalibrationData(hidden.astype(np.float32), {"file": path.name, "sha256": digest})


def _read_npy(path: Path, expected: str) -> np.ndarray:
    """The array of a `.npy` calibration file (never a pickle), or a CalibrationError saying what was expected."""
    if path.suffix != ".npy":
        raise CalibrationError(f"calibration file {path}: expected {expected}, got a '{path.suffix}' file")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise CalibrationError(f"calibration file {path}: expected {expected}, cannot read it ({error})") from None


def _ids_from_file(path: Path, cfg: ModelConfig) -> CalibrationData:
    expected = f"a .npy array of integer token ids (N, T) in [0, {cfg.vocab_size}) with 1 <= T <= {cfg.max_seq_len}"
    ids = _read_npy(path, expected)
    shape_ok = ids.ndim == 2 and ids.shape[0] >= 1 and 1 <= ids.shape[1] <= cfg.max_seq_len
    if not (shape_ok and ids.dtype.kind in "iu" and ids.size and ids.min() >= 0 and ids.max() < cfg.vocab_size):
        raise CalibrationError(f"calibration file {path}: expected {expected}, got {ids.dtype} {list(ids.shape)}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return CalibrationData(ids.astype(np.int64), {"file": path.name, "sha256": digest})


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The PyTorch original's keys and values on the calibration data: past name -> (N, n_kv, T, hd)."""

    caches: dict[str, np.ndarray]
    source: dict

    def quantization(self, bits: int, layout: str = DEFAULT_LAYOUT) -> CacheQuantization:
        """Scales for a `bits`-bit cache: max|x| / highest code, per tensor or per kv head and channel."""
        axes = (0, 1, 2, 3) if layout == PER_TENSOR else (0, 2)
        scales = {}
        for name, cache in self.caches.items():
            peak = np.abs(cache).max(axis=axes, keepdims=layout == PER_CHANNEL)  # (1, n_kv, 1, hd) or ()
            scale = np.where(peak > 0, peak / highest_code(bits), 1.0)  # a channel always 0 stays 0 at any scale
            scales[name] = scale.reshape(-1, *scale.shape[2:]) if layout == PER_CHANNEL else scale.reshape(1)
        return CacheQuantization(bits, layout, {n: s.astype(np.float32) for n, s in scales.items()}, self.source)

    def errors(self, bits: int) -> dict[str, dict[str, float]]:
        """Per layout and kind, the relative RMS error that quantizing the calibration's keys and values
        costs (rms(fake-quantized - x) / rms(x), over all layers): the report records both layouts."""
        import torch

        found: dict[str, dict[str, float]] = {}
        for layout in LAYOUTS:
            quantization, squares = self.quantization(bits, layout), {}
            for name, cache in self.caches.items():
                quantized = quantization.fake_quantize(name, torch.from_numpy(cache)).numpy()
                error, total = squares.get(name.rsplit(".", 1)[1], (0.0, 0.0))
                squares[name.rsplit(".", 1)[1]] = (
                    error + float(np.square(quantized - cache).sum()),
                    total + float(np.square(cache).sum()),
                )
            found[layout] = {kind: float(np.sqrt(e / t)) if t else 0.0 for kind, (e, t) in squares.items()}
        return found


def calibrate(model, data: CalibrationData) -> Calibration:
    """Run the PyTorch original over each calibration sequence from an empty past and keep the keys
    (rotated, where it rotates them) and values it caches."""
    import torch

    caches: dict[str, list[np.ndarray]] = {name: [] for name in names.past_names(model.cfg.n_layers)}
    with torch.no_grad():
        for sequence in data.hidden:
            result = model(torch.from_numpy(np.ascontiguousarray(sequence[None])))
            for layer, cache in enumerate(result.present):
                caches[names.past_name(layer, names.KEY)].append(cache.key.numpy())
                caches[names.past_name(layer, names.VALUE)].append(cache.value.numpy())
    return Calibration({name: np.concatenate(arrays) for name, arrays in caches.items()}, data.source)


@dataclasses.dataclass(frozen=True)
class CacheQuantization:
    """A quantized cache's bit width, scale layout and scales (past name -> float32 (1,) per tensor,
    (n_kv, 1, head_dim) per channel, as GroupQueryAttention takes them), and the calibration's source."""

    bits: int
    layout: str
    scales: dict[str, np.ndarray]
    source: dict

    @property
    def kind(self) -> str:
        return names.INT8_CACHE if self.bits == 8 else names.INT4_CACHE

    def fake_quantize(self, name: str, x):
        """`x` (a torch tensor (B, n_kv, T, hd)) as the kernel stores and reads it back."""
        import torch

        scale = torch.from_numpy(self.scales[name]).to(x.dtype)
        return torch.clamp(torch.round(x / scale), lowest_code(self.bits), highest_code(self.bits)) * scale

    def dequantize(self, name: str, codes: np.ndarray) -> np.ndarray:
        """A cache read from the pool, (..., n_kv, T, width) codes, as floats (..., n_kv, T, head_dim)."""
        if self.bits == 4:  # two codes a byte, + 8, the even channel in the low nibble
            nibbles = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
            codes = nibbles.astype(np.int8) - 8
        return codes.astype(np.float32) * self.scales[name]

    def to_report(self) -> dict:
        return {
            "cache_dtype": names.CACHE_ELEMENT[self.kind],
            "bits": self.bits,
            "layout": self.layout,
            "calibration": self.source,
        }
