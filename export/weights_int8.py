"""The `fp32-fused-int8w` variant: `fp32-fused` with its projections' weights stored in int8.

ONNX Runtime's own tool quantizes the graph (`onnxruntime.quantization.quantize_dynamic`): each
projection (W_q, W_k, W_v, W_o: the MatMuls whose weight is a constant) becomes a quantization of its
input to uint8 -> MatMulInteger with the int8 weight (one scale per output channel, zero point 0) -> the
int32 product cast and scaled back to fp32 (ONNX Runtime fuses the last three at load into
MatMulIntegerToFloat, its bias added inside; q, k and v quantize their shared input once). Nothing else
changes: one fused `Attention` op per layer, fp32 inputs, outputs and caches.
The weights take a quarter of the bytes; the projections' arithmetic is int8.

The input is quantized **per row** (`per_row_activations`): the tool's DynamicQuantizeLinear takes one
scale for the whole tensor, so each row was rounded by the range of the rows batched beside it. The
sessions' pool batches rows of different sequences: a sequence's answer depended on its batchmates, and
the 20M-parameter Llama's `fp32-static-int8w` missed its pool rung at 2.0-2.6x its per-row floor (logits
5.8% of scale) where the one-row form stayed at 1.02x. Each DynamicQuantizeLinear is replaced by the
same quantization per row: scale = the row's largest magnitude / 127, codes round(x / scale) + 128 as
uint8, zero point 128; the row's scale is applied after the weight's (`_row_scales_applied_last`). Its cost
against one scale per tensor, measured on the 20M-parameter Llama's fused graph (`--preset llama-whole`,
ONNX Runtime 1.31, 2 threads on a 2-core AMD EPYC with AVX2 and no VNNI, 10 interleaved rounds, medians, two
runs with other work on the machine): a decode step at past 128 0.87-1.39x at B1, 1.06-1.18x at B8, a
128-token prefill 1.22-1.30x (seven small ops per quantized input, and no fused MatMulIntegerToFloat).
ONNX Runtime's other per-row path, 8-bit MatMulNBits (int8 inputs per block of 32), measured 1.07x, 1.15x
and 2.32x in the same run.

A whole model's bytes are mostly outside attention: its MLPs (W_gate, W_up, W_down) and its LM head
are MatMuls with constant weights too, quantized the same way (the head per vocabulary row). A tied
head reads the embedding table transposed (`Transpose(embed)`): that is folded into a constant of its
own first, so the head is int8 while the embedding Gather keeps reading the fp32 table (a Gather
reads one row a token: its bytes cost a decode step nothing, and quantizing it would round every
token's hidden state before the first layer). The tied model then carries the table twice: fp32 for
the Gather and int8 for the head (a quarter more than the fp32 table alone).

The options, measured on the seed preset with one input scale per tensor (ONNX Runtime 1.31 on a shared
2-core CPU with AVX512-VNNI; 4 interleaved rounds, prefill B1 T512 and decode B1 P1024) and on the parity ladder
(largest error relative to the tensor's scale, and its ratio to the precision floor below):

* weight type QInt8 (signed, symmetric): prefill 5.2 ms against 7.3 ms with QUInt8 (fp32-fused: 8.8
  ms; decode 0.13-0.15 ms for all three), at the same error (seed output 1.06e-2 against 1.03e-2).
  Activations are uint8 either way: dynamic quantization supports nothing else.
* per channel: the same speed as one scale per tensor (5.2 against 5.3 ms), and per tensor costs
  1.1-1.6x the error (tiny output 1.61e-2 against 1.00e-2): a row whose weights are small no
  longer shares the largest row's step.
* reduce_range off: 7-bit weights cost 1.2-1.9x the error at the same speed. The option exists for
  x86 CPUs without VNNI, whose u8 x s8 instruction (vpmaddubsw) saturates sums of two products in
  int16; VNNI accumulates in int32 and does not, and the graph matches its floor to 1.00-1.18x here.
  A CPU without VNNI would serve this graph less accurately than the build measured it: measured on
  an AMD EPYC without AVX-512 (AVX2 only), the 8-bit graph missed its floor's bound on the tiny, gqa
  and trained-scale configs. So a build on an x86 CPU without VNNI quantizes with `reduce_range`
  (weights in 7 bits: codes -64..64, whose u8 x s8 pair sums fit int16) and its floor with the same
  levels (`WEIGHT_LEVELS`, chosen once per process by `saturating_int8_products`).
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import Tensor, nn

from contract.config import ModelConfig
from export.fusion import fp32_fused_proto
from export.model import AttentionModel
from export.onnx_export import attach_config, save_onnx
from export.parity import Tolerance
from export.weights_blockwise import (
    QUANTIZED_OPS,
    constant_transposed_weights,
    projection_matmuls,
    quantized_floor,
    quiet_quantizer,
)
from serving.engine.ort import Forward

NAME = "fp32-fused-int8w"
# the static-cache form with the same int8 weights: what a session serves with `--weights-dtype int8`
STATIC_NAME = "fp32-static-int8w"


INT8_FEATURES = ("avx512_vnni", "avx_vnni", "amx_int8")  # x86 flags of int8 products accumulated in int32


def int8_features() -> tuple[str, ...] | None:
    """This x86 CPU's flags among INT8_FEATURES (from /proc/cpuinfo); None off x86 or off Linux."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return None
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # not Linux: assume a current CPU
        return None
    return tuple(flag for flag in INT8_FEATURES if flag in flags)


def saturating_int8_products() -> bool:
    """Whether ONNX Runtime's u8 x s8 products saturate here: an x86 CPU without VNNI (its vpmaddubsw
    sums two products in int16). Elsewhere (VNNI, ARM's dot products) they accumulate in int32."""
    features = int8_features()
    return features is not None and not {"avx512_vnni", "avx_vnni"} & set(features)


def int8_weights_report() -> dict:
    """What this build's int8 weights are, and why (report.json's `int8_weights` of each int8w variant): the
    bits the build quantized to, reduce_range, and the CPU features that chose them."""
    features = int8_features()
    if features is None:
        why = f"not an x86 CPU ({platform.machine()}) or no /proc/cpuinfo: products accumulate in int32"
    elif REDUCE_RANGE:
        why = "x86 without VNNI: vpmaddubsw sums two u8 x s8 products in int16, which 8-bit weights can saturate"
    else:
        why = f"{', '.join(features)}: u8 x s8 products accumulate in int32, no saturation"
    return {
        "bits": 7 if REDUCE_RANGE else 8,
        "reduce_range": REDUCE_RANGE,
        "cpu_features": list(features or ()),
        "why": why,
    }


REDUCE_RANGE = saturating_int8_products()
# QInt8 symmetric: codes -127..127, scale = max|w| / 127 per output channel; with reduce_range -64..64
# (onnxruntime.quantization's get_qmin_qmax_for_qType)
WEIGHT_LEVELS = 64 if REDUCE_RANGE else 127
ACTIVATION_LEVELS = 127  # uint8 codes 1..255 around the zero point 128: symmetric per row
ACTIVATION_ZERO = 128


class Int8WeightsError(ValueError):
    """The quantized graph is not what this variant promises (a projection left in fp32)."""


def make_fp32_fused_int8w(model: AttentionModel, path: Path) -> Path:
    """The `fp32-fused-int8w` variant at `path`: the `fp32-fused` graph of `model`, its projections quantized."""
    return quantize_projections(fp32_fused_proto(model), model.cfg, path)


def make_fp32_static_int8w(model: AttentionModel, path: Path) -> Path:
    """The `fp32-static-int8w` variant at `path`: the `fp32-static` graph of `model` (GroupQueryAttention over
    the shared cache buffers), its projections quantized as `fp32-fused-int8w`'s: the sessions' form of INT8
    weights. The attention op and the caches stay fp32."""
    from export.forms import fp32_static_proto

    return quantize_projections(fp32_static_proto(model), model.cfg, path)


def quantize_projections(fused: onnx.ModelProto, cfg: ModelConfig, path: Path) -> Path:
    """`fused` (an `fp32-fused` graph of `cfg`, or its static form) with its projections quantized by ONNX
    Runtime, written to `path` with the config attached as every variant carries it, checked by onnx.checker."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fused = constant_transposed_weights(fused)
    projections = projection_matmuls(fused)
    with quiet_quantizer():
        quantize_dynamic(
            fused,
            path,
            op_types_to_quantize=list(QUANTIZED_OPS),
            nodes_to_quantize=projections,  # the projections only, never the attention op
            weight_type=QuantType.QInt8,  # the options and why: this module's doc
            per_channel=True,
            reduce_range=REDUCE_RANGE,  # 7-bit weights only where 8-bit products would saturate
            # the static form's GroupQueryAttention (com.microsoft) leaves shape inference without the
            # types after it: every weight quantized here is fp32
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
    quantized = per_row_activations(onnx.load(str(path)))
    attach_config(quantized, cfg)  # the tool adds metadata of its own; keep fp32-fused's
    check_int8_weights(quantized, len(projections))
    return save_onnx(quantized, path)


def per_row_activations(model_proto: onnx.ModelProto) -> onnx.ModelProto:
    """`model_proto` with each DynamicQuantizeLinear (one scale per tensor) replaced by the same uint8
    quantization per row (this module's doc): the rows of a batch no longer round each other."""
    from onnx import helper, numpy_helper

    graph = model_proto.graph
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array(-1, np.int64).reshape(1), "per_row.last_axis"),
            numpy_helper.from_array(np.array(1.0 / ACTIVATION_LEVELS, np.float32), "per_row.step"),
            # the smallest normal fp32: an all-zero row gets codes 128, i.e. zeros, instead of 0 / 0
            numpy_helper.from_array(np.array(np.finfo(np.float32).tiny, np.float32), "per_row.least"),
            numpy_helper.from_array(np.array(ACTIVATION_ZERO, np.float32), "per_row.zero_float"),
            numpy_helper.from_array(np.array(ACTIVATION_ZERO, np.uint8), "per_row.zero"),
        ]
    )
    nodes, row_scales = [], set()
    for node in graph.node:
        if node.op_type != "DynamicQuantizeLinear":
            nodes.append(node)
            continue
        (x,), (codes, scale, zero) = node.input, node.output
        row_scales.add(scale)
        name = node.name or codes

        def step(op: str, inputs: list[str], suffix: str, name: str = name, **attributes) -> onnx.NodeProto:
            return helper.make_node(op, inputs, [f"{name}.{suffix}"], **attributes)

        nodes += [
            step("Abs", [x], "abs"),
            step("ReduceMax", [f"{name}.abs", "per_row.last_axis"], "largest", keepdims=1),
            step("Max", [f"{name}.largest", "per_row.least"], "nonzero"),
            helper.make_node("Mul", [f"{name}.nonzero", "per_row.step"], [scale]),
            step("Div", [x, scale], "scaled"),
            step("Round", [f"{name}.scaled"], "rounded"),  # half to even, as DynamicQuantizeLinear rounds
            step("Add", [f"{name}.rounded", "per_row.zero_float"], "shifted"),
            helper.make_node("Cast", [f"{name}.shifted"], [codes], to=onnx.TensorProto.UINT8),
            helper.make_node("Identity", ["per_row.zero"], [zero]),
        ]
    del graph.node[:]
    graph.node.extend(_row_scales_applied_last(nodes, row_scales))
    return model_proto


def _row_scales_applied_last(nodes: list[onnx.NodeProto], row_scales: set[str]) -> list[onnx.NodeProto]:
    """The tool scales a product as Mul(Cast(MatMulInteger), Mul(input_scale, weight_scale)); here the
    weight's scale is applied first and the row's after it: Mul(Mul(Cast(...), weight_scale), row_scale).
    ONNX Runtime 1.31 fuses the tool's shape into MatMulIntegerToFloat without checking that the input's
    scale is one number, and that kernel reads one: every row then took row 0's scale (measured: 3% of the
    output's scale off, against 0 with the graph unoptimized). This shape is left unfused."""
    from onnx import helper

    products = {node.output[0]: node for node in nodes if node.op_type == "Mul" and set(node.input) & row_scales}
    rewired = []
    for node in nodes:
        if node.output[0] in products:
            continue
        scaled_by = [name for name in node.input if name in products] if node.op_type == "Mul" else []
        if not scaled_by:
            rewired.append(node)
            continue
        (product_name,), (integer,) = scaled_by, [name for name in node.input if name != scaled_by[0]]
        product = products[product_name]
        (row,), (column,) = (
            [n for n in product.input if n in row_scales],
            [n for n in product.input if n not in row_scales],
        )
        by_column = f"{node.output[0]}.by_weight_scale"
        rewired += [
            helper.make_node("Mul", [integer, column], [by_column]),
            helper.make_node("Mul", [by_column, row], list(node.output)),
        ]
    left = {name for node in rewired for name in node.input} & set(products)
    if left:
        raise Int8WeightsError(f"scale products used other than by a product's Mul: {sorted(left)}")
    return rewired


def check_int8_weights(model_proto: onnx.ModelProto, projections: int) -> None:
    """Every projection became a MatMulInteger, none is left multiplying fp32 weights, and no input is
    quantized per tensor."""
    left = projection_matmuls(model_proto)
    integer = sum(node.op_type == "MatMulInteger" for node in model_proto.graph.node)
    per_tensor = sum(node.op_type == "DynamicQuantizeLinear" for node in model_proto.graph.node)
    if left or integer != projections or per_tensor:
        raise Int8WeightsError(
            f"{integer} of {projections} projections quantized, {per_tensor} inputs per tensor; left in fp32: {left}"
        )


# --- the precision floor ------------------------------------------------------------------------


def fake_quantize_weight(weight: Tensor, levels: int = WEIGHT_LEVELS) -> Tensor:
    """Per output channel (a row of nn.Linear's weight), symmetric: codes round(w / scale) in
    [-levels, levels] with scale = max|w| / levels, as the tool quantizes them, dequantized."""
    scale = weight.abs().amax(dim=1, keepdim=True) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: the tool's scale 1
    return torch.clamp(torch.round(weight / scale), -levels, levels) * scale


def fake_quantize_activation(x: Tensor) -> Tensor:
    """`per_row_activations`' quantization, dequantized: per row (the last axis), scale = the row's largest
    magnitude / 127, codes round(x / scale), rounding half to even (torch.round's and the graph's Round)."""
    scale = x.abs().amax(dim=-1, keepdim=True) / ACTIVATION_LEVELS
    return torch.round(x / torch.where(scale > 0, scale, torch.ones_like(scale))) * scale


class _DynamicallyQuantized(nn.Module):
    """A projection as the quantized graph computes it: its input quantized per call, its weight once."""

    def __init__(self, linear: nn.Linear, levels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(fake_quantize_weight(linear.weight.detach(), levels), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(fake_quantize_activation(x), self.weight, self.bias)


def int8_weights_floor(model: AttentionModel, dtype: type = np.float32, weight_levels: int = WEIGHT_LEVELS) -> Forward:
    """The precision floor of the int8-weights graph of `model`: the PyTorch original computed in
    fp64 with each projection's weight quantized per output channel to int8 and its input per row
    to uint8 (as `per_row_activations` does at every call), both dequantized. Its difference from the
    fp32 original is what the quantization scheme costs this model before any kernel computes
    anything; driven beside the graph, its own presents fed back, it sets the scale of the graph's
    tolerance (INT8_WEIGHTS_TOLERANCE). The same signature as `runners.rounded_runner` (`dtype`: the
    graph's float, fp32 here)."""
    return quantized_floor(model, dtype, lambda linear: _DynamicallyQuantized(linear, weight_levels))


# --- the bound ----------------------------------------------------------------------------------

# Why the bound is what it is. The graph computes exactly what its floor computes, up to fp32 in its
# scales and the order of its sums: the int8 x uint8 products are summed in int32 without error.
# Measured on the ladder (export/build.py SCENARIOS, both scenarios; largest error relative to the
# tensor's scale, output and worst tensor, and the graph's error over the floor's, worst tensor), with
# inputs per row (2026-12-02 at 091f64d, 7-bit weights on a 2-core AMD EPYC with AVX2 only):
#
#     config          our init: output   worst tensor   graph / floor
#     tiny            1.60e-2            2.22e-2        1.00
#     gqa             1.93e-2            2.38e-2        1.00
#     unseen          2.69e-2            2.69e-2        1.00
#     rotary          1.78e-2            3.14e-2        1.00
#
# and earlier with one input scale per tensor (8-bit weights on the AVX512-VNNI EPYC):
#
#     config          our init: output   worst tensor   graph / floor   4-bit weights: worst   / floor
#     tiny            1.00e-2            1.59e-2        1.01            1.69e-1                12-13x
#     gqa             1.53e-2            1.54e-2        1.00            1.96e-1                15x
#     unseen          1.56e-2            2.22e-2        1.00            2.49e-1                13-15x
#     rotary          1.33e-2            1.71e-2        1.09            1.97e-1                11-13x
#     seed            1.06e-2            1.55e-2        1.00            1.73e-1                13-14x
#     large, llama    1.83e-2            2.51e-2        1.06-1.18       3.29e-1                13-14x
#
# So at our init the error is 1-3.1e-2 of a tensor's scale (a few of the input's quantization steps,
# summed over a row): 5e-2 is 1.6x the largest, and weights rounded to 4 bits (7 levels a side)
# land at 1.1e-1 or more, beyond it everywhere. Trained weights (projections 4x our init) make logits
# larger and attention amplifies the error of q and k: 8e-2 to 6.3e-1 of the output's scale, the
# floor's too (graph / floor 1.00-1.10); no fixed bound tells that from a fault. There the bound is
# INT8_WEIGHTS_FLOOR_FACTOR times the floor's error: 2x leaves room over the 1.18x measured, and
# 4-bit weights sit at 11-17x their floor.
INT8_WEIGHTS_FLOOR_FACTOR = 2.0

INT8_WEIGHTS_TOLERANCE = Tolerance(
    atol=0.0,
    rtol=0.0,
    scale=5e-2,
    floor=INT8_WEIGHTS_FLOOR_FACTOR,
    why="projection weights in int8 per output channel and their inputs in uint8 per row: each product "
    "moves by a few of the input's quantization steps, measured 1-3.1e-2 of a tensor's scale at our init (tiny "
    "to large); 5e-2 is 1.6x that, and weights in 4 bits give 1.1e-1 or more. For larger (trained) weights "
    f"the bound is {INT8_WEIGHTS_FLOOR_FACTOR:g}x the error of the int8 precision floor "
    "(export/weights_int8.py, `int8_weights_floor`), which the graph matches to 1.00-1.18x",
)
