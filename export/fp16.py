"""The `fp16-fused` variant: the fused graph in FP16, inputs, outputs and KV cache included.

FP16 IO halves the cache a decode step reads and returns. ONNX Runtime's float16 converter
(`keep_io_types=False`) does the conversion; what must stay safe and why it does:

* Norm statistics: the exporter writes `LayerNormalization` and the fusion `RMSNormalization` with
  `stash_type=1` (its default), so the mean and variance (mean square) are computed in fp32 even for
  fp16 inputs (ONNX Runtime honours it); a hidden state of magnitude 1e3 would otherwise overflow its
  square (1e6 > 65504).
* Rotary tables: cos and sin are held in fp16 like the weights; the precision floor the tolerance is
  measured against rounds them too (export/runners.py `rounded_runner`).
* Attention without a norm before it runs in fp32 (`attention_needs_fp32`, `_attention_in_fp32`):
  each `Attention` node's q, k, v and past are cast up and its context and presents cast back, so
  the graph's edges and caches stay fp16 while the scores q.k/sqrt(head_dim), the softmax and its
  weighted sum are fp32. Without a norm (torch.nn.MultiheadAttention, the teaching texts' module)
  nothing bounds the scores: they grow with the square of the hidden states and of the q and k
  projections. Measured (64 wide, head_dim 16, bare attention): projections 4x our init on hidden
  states of magnitude 100, or 1x on magnitude 1e3, gave inf/NaN outputs with fp16 scores (scaling q
  by 1/sqrt(head_dim) before the matmul would gain only 4x of the 1e3x needed); with fp32 scores the
  error is the precision floor's (export/parity.py) in every case. With LayerNorm before attention
  (the default block) q and k are projections of normalized tokens: at 4x our init the fp16 scores
  stay finite and within the floor's bound (tests/export/test_fp16.py), and the casts are not paid:
  they convert the whole cache each step, which made the seed preset's fp16-fused decode at B1 P4096
  2.8x slower on the CPU (2.19 against 0.79 ms, `python -m bench model`). The `softmax_precision=FLOAT`
  attribute stays for providers that take an fp16 node (fp16-static's GroupQueryAttention, whose
  CPU kernel accumulates in fp32: finite in the same cases).
* Mask: the fused graph masks with a boolean input of the op; no fill value such as
  finfo(float32).min is left to become -inf in fp16. The converter clips any other constant to
  the fp16 range; `to_fp16` checks that every float constant is finite.

Measured error (see TOLERANCES["fp16-fused"]): about 7e-4 of the output's largest magnitude, for
hidden states of magnitude 1 and 1e3 alike, at our init; trained weights' larger q and k make the
rounding of k (the fp16 cache) cost more, which export/parity.py bounds by the precision floor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from contract.config import ModelConfig
from export.fusion import fused_proto
from export.model import AttentionModel
from export.onnx_export import config_from_onnx, plain_graph, save_onnx


class FP16Error(ValueError):
    """The converted graph is not safe to ship in fp16."""


def attention_needs_fp32(cfg: ModelConfig) -> bool:
    """Whether the fp16 graph computes attention in fp32: when no norm bounds its inputs (above)."""
    return cfg.norm == "none"


def to_fp16(model_proto: onnx.ModelProto, cfg: ModelConfig) -> onnx.ModelProto:
    """An fp16 copy of a fused fp32 graph of `cfg`: fp16 weights, inputs, outputs and caches."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    converted = convert_float_to_float16(model_proto, keep_io_types=False)
    for node in converted.graph.node:
        if node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
            _set_attribute(node, "softmax_precision", onnx.TensorProto.FLOAT)
    if attention_needs_fp32(cfg):
        _attention_in_fp32(converted.graph)
    check_fp16(converted, attention_needs_fp32(cfg))
    return converted


ATTENTION_FLOAT_INPUTS = (0, 1, 2, 4, 5)  # q, k, v, past_key, past_value (3: the boolean mask)


def _attention_in_fp32(graph: onnx.GraphProto) -> None:
    """Each Attention node computes in fp32 between Casts: its fp16 inputs widened, its outputs (context,
    present key and value) rounded back, so the graph's edges and caches stay fp16."""
    nodes = []
    for node in graph.node:
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        for i in ATTENTION_FLOAT_INPUTS:
            if i < len(node.input) and node.input[i]:
                wide = f"{node.name}_in{i}_fp32"
                nodes.append(
                    onnx.helper.make_node("Cast", [node.input[i]], [wide], name=wide, to=onnx.TensorProto.FLOAT)
                )
                node.input[i] = wide
        nodes.append(node)
        for i, name in enumerate(node.output):
            if name:
                wide = f"{node.name}_out{i}_fp32"
                node.output[i] = wide
                nodes.append(
                    onnx.helper.make_node("Cast", [wide], [name], name=f"{wide}_to_fp16", to=onnx.TensorProto.FLOAT16)
                )
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [v for v in graph.value_info if not any(v.name in n.output for n in nodes if n.op_type == "Attention")]
    del graph.value_info[:]
    graph.value_info.extend(kept)


def _set_attribute(node: onnx.NodeProto, name: str, value: int) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend([*kept, onnx.helper.make_attribute(name, value)])


def check_fp16(model_proto: onnx.ModelProto, attention_in_fp32: bool | None = None) -> None:
    """No fp32 left at the graph's edges, every float constant finite, LayerNorm stats in fp32, and
    attention in fp32 where `attention_in_fp32` (by default: as the config the graph carries needs;
    a graph without one must have it)."""
    if attention_in_fp32 is None:
        attention_in_fp32 = _carried_config_needs_fp32(model_proto)
    edges = [*model_proto.graph.input, *model_proto.graph.output]
    fp32 = [v.name for v in edges if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT]
    if fp32:
        raise FP16Error(f"graph inputs/outputs still fp32: {fp32}")
    for tensor in _float_constants(model_proto):
        if not np.isfinite(numpy_helper.to_array(tensor)).all():
            raise FP16Error(f"constant '{tensor.name}' is not finite in fp16")
    if attention_in_fp32:
        _check_attention_widened(model_proto.graph)
    for node in model_proto.graph.node:
        if node.op_type in ("LayerNormalization", "RMSNormalization"):
            stash = next((a.i for a in node.attribute if a.name == "stash_type"), 1)  # 1 is the default
            if stash != onnx.TensorProto.FLOAT:
                raise FP16Error(f"{node.name}: {node.op_type} statistics would be computed in fp16")


def _carried_config_needs_fp32(model_proto: onnx.ModelProto) -> bool:
    try:
        return attention_needs_fp32(config_from_onnx(model_proto))
    except ValueError:  # no config in the graph: the safe answer
        return True


def _check_attention_widened(graph: onnx.GraphProto) -> None:
    widened = {n.output[0] for n in graph.node if n.op_type == "Cast" and _cast_to(n) == onnx.TensorProto.FLOAT}
    for node in graph.node:
        if node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
            narrow = [node.input[i] for i in ATTENTION_FLOAT_INPUTS if i < len(node.input) and node.input[i]]
            if any(name not in widened for name in narrow):
                raise FP16Error(f"{node.name}: attention scores would be computed in fp16 (inputs {narrow})")


def _cast_to(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "to"), 0)


def _float_constants(model_proto: onnx.ModelProto):
    floats = (onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT)
    yield from (t for t in model_proto.graph.initializer if t.data_type in floats)
    for node in model_proto.graph.node:
        if node.op_type == "Constant":
            yield from (a.t for a in node.attribute if a.name == "value" and a.t.data_type in floats)


def make_fp16_fused(model: AttentionModel, path: Path) -> Path:
    """The `fp16-fused` variant at `path`: the plain export, fused, converted, checked."""
    fused, _ = fused_proto(plain_graph(model))
    return save_onnx(to_fp16(fused, model.cfg), path)
