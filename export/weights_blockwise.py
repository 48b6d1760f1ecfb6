"""Quantized weights: what the int8 (export/weights_int8.py) and int4 (export/weights_int4.py) weight
variants share (the projections found, a tied head folded into a constant, the tool kept quiet, the
precision floor's frame), and the int4 variants' blockwise scheme, ONNX Runtime's `MatMulNBits`.

ONNX Runtime's own tool quantizes the graph (`MatMulNBitsQuantizer`): each MatMul whose weight is a
constant (the attention projections, a whole model's MLP and LM head) becomes `MatMulNBits`: blocks of
`BLOCK` (32) weights along the input dimension, one fp32 scale each, **symmetric** codes (-8..7 in 4 bits;
scale = the block's weight of largest magnitude / the lowest code, read back from the tool's output).
Symmetric, because ONNX Runtime's M=1 int8-compute kernel on AVX2 without AVX-512 returned wrong results
for asymmetric 4-bit weights (microsoft/onnxruntime issue 29853): a decode step is M=1. `accuracy_level`
4: the activations are quantized to int8 per row and block at each call and the products run in int8.

A tied head reads the embedding table transposed (`Transpose(embed)`): that is folded into a constant
of its own first, so the head is quantized while the embedding Gather keeps reading the fp32 table (a
Gather reads one row a token: its bytes cost a decode step nothing, and quantizing it would round every
token's hidden state before the first layer). The tied model then carries the table twice.

Nothing else changes: the attention op, the norms, fp32 inputs, outputs and caches.

The precision floor (`blockwise_floor`) is the PyTorch original in fp64 with each such weight quantized
blockwise as the tool does and each input quantized to int8 per row and block as `accuracy_level` 4
does, both dequantized: what the scheme costs this model before any kernel computes anything. Driven
beside the graph, its own presents fed back, it sets the scale of the graph's tolerance.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import Tensor, nn

from contract.config import ModelConfig
from contract.names import LOGITS
from export.model import AttentionModel
from export.onnx_export import attach_config, save_onnx
from serving.engine.ort import Arrays, Forward

PROJECTIONS = ("W_q", "W_k", "W_v", "W_o")
MLP_PROJECTIONS = ("W_gate", "W_up", "W_down")  # a whole model's MLP (W_gate: gated MLPs only)
QUANTIZED_OPS = ("MatMul", "Gemm")
BLOCK = 32  # weights per scale along the input dimension (genai's and llama.cpp's default)
ACCURACY_LEVEL = 4  # int8 activations and int8 products (ONNX Runtime's fastest CPU path)
ACTIVATION_LEVELS = 127  # int8, symmetric per row and block


class QuantizedWeightsError(ValueError):
    """The quantized graph is not what its variant promises (a projection left in fp32)."""


def code_range(bits: int) -> tuple[int, int]:
    """The signed codes of `bits`-bit symmetric weights: (-8, 7) for 4, (-128, 127) for 8."""
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def projection_matmuls(model_proto: onnx.ModelProto) -> list[str]:
    """The MatMul and Gemm nodes whose weight is a constant: the projections. The attention op's own
    products are inside the fused op, never quantized."""
    constants = {tensor.name for tensor in model_proto.graph.initializer}
    return [
        node.name
        for node in model_proto.graph.node
        if node.op_type in QUANTIZED_OPS and len(node.input) > 1 and node.input[1] in constants
    ]


def quantize_projections(
    graph: onnx.ModelProto, cfg: ModelConfig, path: Path, bits: int, head_bits: int | None = None
) -> Path:
    """`graph` (an `fp32-fused` graph of `cfg`, or its static form) with every MatMul of a constant weight as
    MatMulNBits (`bits`, blocks of BLOCK, symmetric, accuracy_level 4), a whole model's head in `head_bits`
    where given (onnxruntime-genai's `last_matmul:int8`: the logits' error is the head's), written to `path`
    with the config attached as every variant carries it, checked."""
    graph = constant_transposed_weights(graph)
    matmuls = [name for name in projection_matmuls(graph) if _op(graph, name) == "MatMul"]
    head = head_matmul(graph) if head_bits else None
    if head_bits and head is None:
        raise QuantizedWeightsError(f"a head in {head_bits} bits was asked for, but no MatMul answers {LOGITS}")
    if head:  # the head first, in its own width, the others left for the pass in `bits`
        graph = _matmul_nbits(graph, [head], head_bits, leave=[m for m in matmuls if m != head])
    graph = _matmul_nbits(graph, matmuls, bits)
    attach_config(graph, cfg)
    check_quantized_weights(graph, len(matmuls), bits, head_bits)
    return save_onnx(graph, path)


def _matmul_nbits(graph: onnx.ModelProto, nodes: list[str], bits: int, leave: list[str] = ()) -> onnx.ModelProto:
    """`nodes` as `bits`-bit MatMulNBits. The tool also takes every other MatMul (`nodes_to_include` adds to the
    op types it quantizes, ONNX Runtime 1.31): those in `leave` are excluded by name."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        graph,
        bits=bits,
        block_size=BLOCK,
        is_symmetric=True,
        accuracy_level=ACCURACY_LEVEL,
        nodes_to_include=nodes,
        nodes_to_exclude=list(leave),
    )
    with quiet_quantizer():
        quantizer.process()
    return quantizer.model.model


def head_matmul(model_proto: onnx.ModelProto) -> str | None:
    """The name of the MatMul that answers a whole model's logits (its head), None where there is none."""
    producer = {output: node for node in model_proto.graph.node for output in node.output}
    node = producer.get(LOGITS)
    return node.name if node is not None and node.op_type in ("MatMul", "MatMulNBits") else None


def _op(graph: onnx.ModelProto, name: str) -> str:
    return next(node.op_type for node in graph.graph.node if node.name == name)


def check_quantized_weights(
    model_proto: onnx.ModelProto, projections: int, bits: int, head_bits: int | None = None
) -> None:
    """Every projection became a `bits`-bit MatMulNBits (the head a `head_bits`-bit one where given), and none is
    left multiplying fp32 weights."""
    left = projection_matmuls(model_proto)
    nbits = [node for node in model_proto.graph.node if node.op_type == "MatMulNBits"]
    widths = {node.name: next(a.i for a in node.attribute if a.name == "bits") for node in nbits}
    head = head_matmul(model_proto) if head_bits else None
    wrong = {name: width for name, width in widths.items() if width != (head_bits if name == head else bits)}
    if left or len(nbits) != projections or wrong:
        raise QuantizedWeightsError(
            f"{len(nbits)} of {projections} projections in MatMulNBits, of other widths than {bits} bits"
            f"{f' (the head {head_bits})' if head_bits else ''}: {wrong}; left in fp32: {left}"
        )


def constant_transposed_weights(model_proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy where a MatMul weight made by `Transpose(initializer)` (a tied head: the embedding table
    transposed) is an initializer of its own, so the tool sees a constant weight and quantizes it."""
    from onnx import numpy_helper

    folded = onnx.ModelProto()
    folded.CopyFrom(model_proto)
    graph = folded.graph
    constants = {tensor.name: tensor for tensor in graph.initializer}
    producer = {output: node for node in graph.node for output in node.output}
    for node in [n for n in graph.node if n.op_type in QUANTIZED_OPS and len(n.input) > 1]:
        transpose = producer.get(node.input[1])
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in constants:
            continue
        perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), None)
        weight = numpy_helper.to_array(constants[transpose.input[0]]).transpose(perm)
        name = f"{transpose.input[0]}.transposed"
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight), name))
        node.input[1] = name
    used = {name for node in graph.node for name in node.input}
    unused = [n for n in graph.node if n.op_type == "Transpose" and not set(n.output) & used]
    for node in unused:
        graph.node.remove(node)
    return folded


@contextlib.contextmanager
def quiet_quantizer() -> Iterator[None]:
    """The tool logs on the root logger, per node and about a graph not "pre-processed" (ONNX Runtime's
    optimizer run first): the fused graph is already optimized, and that pass would replace standard ops
    with ONNX Runtime's own."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


# --- the precision floor ------------------------------------------------------------------------


def fake_quantize_weight(weight: Tensor, bits: int, block: int = BLOCK) -> Tensor:
    """nn.Linear's weight (out, in) quantized as the tool does, dequantized: per output row, blocks of `block`
    along `in` (the last one padded with zeros), scale = the block's weight of largest magnitude / the lowest
    code, codes round(w / scale) clamped to the `bits`-bit range."""
    low, high = code_range(bits)
    out_features, in_features = weight.shape
    padded = nn.functional.pad(weight, (0, -in_features % block))
    blocks = padded.reshape(out_features, -1, block)
    largest = torch.gather(blocks, 2, blocks.abs().argmax(dim=2, keepdim=True))
    scale = largest / low
    safe = torch.where(scale != 0, scale, torch.ones_like(scale))  # an all-zero block: codes 0
    codes = torch.clamp(torch.round(blocks / safe), low, high)
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

    def __init__(self, linear: nn.Linear, bits: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(fake_quantize_weight(linear.weight.detach(), bits), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(fake_quantize_activation(x), self.weight, self.bias)


def blockwise_floor(
    model: AttentionModel, bits: int, dtype: type = np.float32, head_bits: int | None = None
) -> Forward:
    """The precision floor of the `bits`-bit weights graph of `model` (this module's doc), its head in `head_bits`
    where given, as a `runners.rounded_runner` (`dtype`: the graph's float, fp32 here)."""
    head = (lambda linear: _BlockQuantized(linear, head_bits)) if head_bits else None
    return quantized_floor(model, dtype, lambda linear: _BlockQuantized(linear, bits), head)


def quantized_floor(
    model: AttentionModel,
    dtype: type,
    quantized: Callable[[nn.Linear], nn.Module],
    quantized_head: Callable[[nn.Linear], nn.Module] | None = None,
) -> Forward:
    """The PyTorch original in fp64 with every MatMul of a constant weight a graph quantizes (the projections,
    a whole model's MLPs and head; the embedding's Gather stays fp32) replaced by `quantized(linear)`, the head
    by `quantized_head(linear)` where given."""
    from export.runners import torch_runner

    floored = copy.deepcopy(model).double()
    for layer in floored.layers:
        for name in PROJECTIONS:
            setattr(layer.attn, name, quantized(getattr(layer.attn, name)))
        for name in MLP_PROJECTIONS if hasattr(layer, "mlp") else ():
            if hasattr(layer.mlp, name):
                setattr(layer.mlp, name, quantized(getattr(layer.mlp, name)))
    if floored.cfg.whole:  # the head, tied or not
        head = floored.lm_head if hasattr(floored, "lm_head") else tied_head(floored)
        floored_head = (quantized_head or quantized)(head)
        floored.head = lambda x: floored_head(floored.final_norm(x))  # this copy's head only
    run = torch_runner(floored)

    def forward(inputs: Mapping[str, np.ndarray]) -> Arrays:
        widened = {name: a.astype(np.float64) if a.dtype.kind == "f" else a for name, a in inputs.items()}
        return {name: array.astype(dtype) for name, array in run(widened).items()}

    return forward


def tied_head(model: AttentionModel) -> nn.Linear:
    """The head a tied model computes (F.linear with the embedding table) as a Linear of its own."""
    head = nn.Linear(model.cfg.d_model, model.cfg.vocab_size, bias=False).double()
    head.weight = nn.Parameter(model.embed.weight.detach().clone(), requires_grad=False)
    return head
