"""The `fp16-fused` variant: the fused graph in FP16, inputs, outputs and KV cache included.

FP16 IO halves the cache a decode step reads and returns. ONNX Runtime's float16 converter
(`keep_io_types=False`) does the conversion; what must stay safe and why it does:

* LayerNorm statistics: the exporter writes `LayerNormalization` with `stash_type=1`, so the
  mean and variance are computed in fp32 even for fp16 inputs (ONNX Runtime honours it); a hidden
  state of magnitude 1e3 would otherwise overflow its square (1e6 > 65504).
* Softmax: the fused `Attention` op gets `softmax_precision=FLOAT`, asking every execution
  provider to accumulate the softmax in fp32 (ONNX Runtime CPU already does).
* Mask: the fused graph masks with a boolean input of the op; no fill value such as
  finfo(float32).min is left to become -inf in fp16. The converter clips any other constant to
  the fp16 range; `to_fp16` checks that every float constant is finite.

Measured error (see TOLERANCES["fp16-fused"]): about 7e-4 of the output's largest magnitude, for
hidden states of magnitude 1 and 1e3 alike.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from export.fusion import fused_proto
from export.model import AttentionModel
from export.onnx_export import plain_graph, save_onnx


class FP16Error(ValueError):
    """The converted graph is not safe to ship in fp16."""


def to_fp16(model_proto: onnx.ModelProto) -> onnx.ModelProto:
    """An fp16 copy of a fused fp32 graph: fp16 weights, inputs, outputs and caches."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    converted = convert_float_to_float16(model_proto, keep_io_types=False)
    for node in converted.graph.node:
        if node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
            _set_attribute(node, "softmax_precision", onnx.TensorProto.FLOAT)
    check_fp16(converted)
    return converted


def _set_attribute(node: onnx.NodeProto, name: str, value: int) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend([*kept, onnx.helper.make_attribute(name, value)])


def check_fp16(model_proto: onnx.ModelProto) -> None:
    """No fp32 left at the graph's edges, every float constant finite, LayerNorm stats in fp32."""
    edges = [*model_proto.graph.input, *model_proto.graph.output]
    fp32 = [v.name for v in edges if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT]
    if fp32:
        raise FP16Error(f"graph inputs/outputs still fp32: {fp32}")
    for tensor in _float_constants(model_proto):
        if not np.isfinite(numpy_helper.to_array(tensor)).all():
            raise FP16Error(f"constant '{tensor.name}' is not finite in fp16")
    for node in model_proto.graph.node:
        if node.op_type == "LayerNormalization":
            stash = next((a.i for a in node.attribute if a.name == "stash_type"), 1)  # 1 is the default
            if stash != onnx.TensorProto.FLOAT:
                raise FP16Error(f"{node.name}: LayerNorm statistics would be computed in fp16")


def _float_constants(model_proto: onnx.ModelProto):
    floats = (onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT)
    yield from (t for t in model_proto.graph.initializer if t.data_type in floats)
    for node in model_proto.graph.node:
        if node.op_type == "Constant":
            yield from (a.t for a in node.attribute if a.name == "value" and a.t.data_type in floats)


def make_fp16_fused(model: AttentionModel, path: Path) -> Path:
    """The `fp16-fused` variant at `path`: the plain export, fused, converted, checked."""
    fused, _ = fused_proto(plain_graph(model))
    return save_onnx(to_fp16(fused), path)
