"""The `fp32-fused-int4w` and `fp32-static-int4w` variants: the fused (static) graph with every projection's
weight in 4 bits, as onnxruntime-genai's `-p int4 -e cpu` and llama.cpp's Q4_0 store them: ONNX Runtime's
`MatMulNBits`, blocks of 32, symmetric codes -8..7, int8 activations per row and block (the scheme and
its precision floor: export/weights_blockwise.py).

`accuracy_level` 4 against 0 (fp32 activations), measured on the 20M-parameter Llama (`--preset
llama-whole`, ONNX Runtime 1.31, 2 threads on the AVX512-VNNI AMD EPYC, best of 3, the machine shared
with a test run): one token 0.80 ms at level 4 against 1.19 ms at level 0; a 128-token prefill 25.5 ms
against 21.3 ms. A decode step is one token: level 4.

A decode step reads every weight once: 4 bits read half the bytes of int8 and an eighth of fp32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from export.fusion import fp32_fused_proto
from export.model import AttentionModel
from export.parity import Tolerance
from export.weights_blockwise import blockwise_floor, quantize_projections
from serving.engine.ort import Forward

NAME = "fp32-fused-int4w"
STATIC_NAME = "fp32-static-int4w"  # the sessions' form: what `--weights-dtype int4` serves
BITS = 4


def make_fp32_fused_int4w(model: AttentionModel, path: Path, head_bits: int | None = None) -> Path:
    """The `fp32-fused-int4w` variant at `path`: the `fp32-fused` graph of `model`, its projections in 4 bits."""
    return quantize_projections(fp32_fused_proto(model), model.cfg, path, BITS, head_bits)


def make_fp32_static_int4w(model: AttentionModel, path: Path, head_bits: int | None = None) -> Path:
    """The `fp32-static-int4w` variant at `path`: the `fp32-static` graph of `model`, its projections in 4 bits
    as `fp32-fused-int4w`'s."""
    from export.forms import fp32_static_proto

    return quantize_projections(fp32_static_proto(model), model.cfg, path, BITS, head_bits)


def int4_weights_floor(model: AttentionModel, dtype: type = np.float32, head_bits: int | None = None) -> Forward:
    """The precision floor of the int4-weights graph of `model`; the same signature as `runners.rounded_runner`."""
    return blockwise_floor(model, BITS, dtype, head_bits)


INT4_WEIGHTS_FLOOR_FACTOR = 1.5
INT4_WEIGHTS_TOLERANCE = Tolerance(
    atol=0.0,
    rtol=0.0,
    scale=0.2,
    floor=INT4_WEIGHTS_FLOOR_FACTOR,
    why="weights in 4 bits per block of 32 and inputs in int8 per block: measured 0.1-0.3 of a tensor's scale "
    "(tiny to a 4-layer Llama). The bound is 0.2 of the scale, or 1.5x the error of the int4 precision floor "
    "(export/weights_blockwise.py, `blockwise_floor`: the scheme computed exactly, in fp64), which the graphs "
    "match to 0.97-1.02x",
)
