"""The `fp32-fused-int4w` and `fp32-static-int4w` variants: the fused (static) graph with every projection's
weight in 4 bits, as onnxruntime-genai's `-p int4 -e cpu` and llama.cpp's Q4_0 store them.

ONNX Runtime's own tool quantizes the graph (`MatMulNBitsQuantizer`): each MatMul whose weight is a
constant (the attention projections, a whole model's MLP and LM head; a tied head's transposed table
folded into a constant of its own first, as for int8) becomes `MatMulNBits`: blocks of `BLOCK` (32) weights
along the input dimension, one fp32 scale each, **symmetric** codes -8..7 (scale = the block's weight of
largest magnitude / -8, read back from the tool's output). Symmetric, because ONNX Runtime's M=1 int8-compute
kernel on AVX2 without AVX-512 returned wrong results for asymmetric 4-bit weights (microsoft/onnxruntime
issue 29853): a decode step is M=1. `accuracy_level` 4: the activations are quantized to int8 per block at
each call and the products run in int8; level 0 keeps them fp32. Measured on the 20M-parameter Llama
(`--preset llama-whole`, ONNX Runtime 1.31, 2 threads on the AVX512-VNNI AMD EPYC, best of 3, the machine
shared with a test run): one token 0.80 ms at level 4 against 1.19 ms at level 0; a 128-token prefill 25.5
ms against 21.3 ms. A decode step is one token: level 4.
Nothing else changes: the attention op, the norms, fp32 inputs, outputs and caches.

A decode step reads every weight once: 4 bits read half the bytes of int8 and an eighth of fp32.

The precision floor (`int4_weights_floor`) is the PyTorch original in fp64 with each such weight quantized
blockwise as the tool does and each input quantized to int8 per block of `BLOCK` as `accuracy_level` 4
does, both dequantized: what the scheme costs this model before any kernel computes anything.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from torch import Tensor, nn

from contract.config import ModelConfig
from export.fusion import fused_proto
from export.model import AttentionModel
from export.onnx_export import attach_config, plain_graph, save_onnx
from export.parity import Tolerance
from export.weights_int8 import constant_transposed_weights, projection_matmuls, quantized_floor, quiet_quantizer
from serving.engine.ort import Forward

NAME = "fp32-fused-int4w"
STATIC_NAME = "fp32-static-int4w"  # the sessions' form: what `--weights-dtype int4` serves
BLOCK = 32  # weights per scale along the input dimension (genai's and llama.cpp's default)
ACCURACY_LEVEL = 4  # int8 activations and int8 products (ONNX Runtime's fastest CPU path)
CODE_LOW, CODE_HIGH = -8, 7  # signed 4-bit codes
ACTIVATION_LEVELS = 127  # int8, symmetric per block


class Int4WeightsError(ValueError):
    """The quantized graph is not what this variant promises (a projection left in fp32)."""


def make_fp32_fused_int4w(model: AttentionModel, path: Path) -> Path:
    """The `fp32-fused-int4w` variant at `path`: the `fp32-fused` graph of `model`, its projections in 4 bits."""
    fused, _ = fused_proto(plain_graph(model))
    return quantize_projections(fused, model.cfg, path)


def make_fp32_static_int4w(model: AttentionModel, path: Path) -> Path:
    """The `fp32-static-int4w` variant at `path`: the `fp32-static` graph of `model`, its projections in 4 bits
    as `fp32-fused-int4w`'s."""
    from export.forms import static_proto

    return quantize_projections(static_proto(model), model.cfg, path)


def quantize_projections(graph: onnx.ModelProto, cfg: ModelConfig, path: Path) -> Path:
    """`graph` with every MatMul of a constant weight as MatMulNBits (4 bits, blocks of BLOCK, symmetric,
    accuracy_level 4), the config attached as every variant carries it, checked by onnx.checker."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    graph = constant_transposed_weights(graph)
    matmuls = [name for name in projection_matmuls(graph) if _op(graph, name) == "MatMul"]
    quantizer = MatMulNBitsQuantizer(
        graph, bits=4, block_size=BLOCK, is_symmetric=True, accuracy_level=ACCURACY_LEVEL, nodes_to_include=matmuls
    )
    with quiet_quantizer():
        quantizer.process()
    quantized = quantizer.model.model
    attach_config(quantized, cfg)
    check_int4_weights(quantized, len(matmuls))
    return save_onnx(quantized, path)


def _op(graph: onnx.ModelProto, name: str) -> str:
    return next(node.op_type for node in graph.graph.node if node.name == name)


def check_int4_weights(model_proto: onnx.ModelProto, projections: int) -> None:
    """Every projection became a 4-bit MatMulNBits, and none is left multiplying fp32 weights."""
    left = projection_matmuls(model_proto)
    nbits = [node for node in model_proto.graph.node if node.op_type == "MatMulNBits"]
    bits = {attribute.i for node in nbits for attribute in node.attribute if attribute.name == "bits"}
    if left or len(nbits) != projections or bits - {4}:
        raise Int4WeightsError(f"{len(nbits)} of {projections} projections in 4 bits {bits}; left in fp32: {left}")


# --- the precision floor ------------------------------------------------------------------------


def fake_quantize_weight(weight: Tensor, block: int = BLOCK) -> Tensor:
    """nn.Linear's weight (out, in) quantized as the tool does, dequantized: per output row, blocks of `block`
    along `in` (the last one padded with zeros), scale = the block's weight of largest magnitude / -8, codes
    round(w / scale) clamped to -8..7."""
    out_features, in_features = weight.shape
    padded = nn.functional.pad(weight, (0, -in_features % block))
    blocks = padded.reshape(out_features, -1, block)
    largest = torch.gather(blocks, 2, blocks.abs().argmax(dim=2, keepdim=True))
    scale = largest / CODE_LOW
    safe = torch.where(scale != 0, scale, torch.ones_like(scale))  # an all-zero block: codes 0
    codes = torch.clamp(torch.round(blocks / safe), CODE_LOW, CODE_HIGH)
    return (codes * scale).reshape(out_features, -1)[:, :in_features]


def fake_quantize_activation(x: Tensor, block: int = BLOCK) -> Tensor:
    """An input quantized to int8 as accuracy_level 4 does at each call, dequantized: per row, blocks of `block`
    along the last axis, symmetric, scale = the block's largest magnitude / 127."""
    features = x.shape[-1]
    padded = nn.functional.pad(x, (0, -features % block))
    blocks = padded.reshape(*x.shape[:-1], -1, block)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / ACTIVATION_LEVELS
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.clamp(torch.round(blocks / safe), -ACTIVATION_LEVELS, ACTIVATION_LEVELS)
    return (codes * scale).reshape(*x.shape[:-1], -1)[..., :features]


class _BlockQuantized(nn.Module):
    """A projection as MatMulNBits computes it at accuracy_level 4: its input and weight quantized per block."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(fake_quantize_weight(linear.weight.detach()), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(fake_quantize_activation(x), self.weight, self.bias)


def int4_weights_floor(model: AttentionModel, dtype: type = np.float32) -> Forward:
    """The precision floor of the int4-weights graph of `model` (this module's doc); the same signature as
    `runners.rounded_runner` (`dtype`: the graph's float, fp32 here)."""
    return quantized_floor(model, dtype, _BlockQuantized)


INT4_WEIGHTS_FLOOR_FACTOR = 1.5
INT4_WEIGHTS_TOLERANCE = Tolerance(
    atol=0.0,
    rtol=0.0,
    scale=0.2,
    floor=INT4_WEIGHTS_FLOOR_FACTOR,
    why="weights in 4 bits per block of 32 and inputs in int8 per block: measured 0.1-0.3 of a tensor's scale "
    "(tiny to a 4-layer Llama). The bound is 0.2 of the scale, or 1.5x the error of the int4 precision floor "
    "(export/weights_int4.py, `int4_weights_floor`: the scheme computed exactly, in fp64), which the graphs match "
    "to 0.97-1.02x",
)
