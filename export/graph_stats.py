"""What an ONNX graph contains: an op histogram and the fused attention ops that prove a fusion
happened (ORT's `get_fused_operator_statistics` in spirit)."""

from __future__ import annotations

from collections import Counter

import onnx

# (domain, op_type) of every op that computes attention in one kernel; "" is the ONNX domain.
FUSED_ATTENTION_OPS = frozenset(
    {
        ("", "Attention"),
        ("com.microsoft", "Attention"),
        ("com.microsoft", "MultiHeadAttention"),
        ("com.microsoft", "GroupQueryAttention"),
    }
)


def _op_key(node: onnx.NodeProto) -> str:
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    return f"{domain}.{node.op_type}" if domain else node.op_type


def op_histogram(model_proto: onnx.ModelProto) -> dict[str, int]:
    """Node count per op over the main graph, most frequent first; contrib ops keep their domain."""
    counts = Counter(_op_key(node) for node in model_proto.graph.node)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def fused_attention_count(model_proto: onnx.ModelProto) -> int:
    return sum(
        ("" if node.domain in ("", "ai.onnx") else node.domain, node.op_type) in FUSED_ATTENTION_OPS
        for node in model_proto.graph.node
    )


# the modern block's parts as one op each (export/norm_rotary_fusion.py)
ROTARY_OP, RMS_NORM_OP = "RotaryEmbedding", "RMSNormalization"
# a residual Add and the RMSNorm after it as one op, in ONNX Runtime's fp32 forms: (op, domain) for `op_count`
SKIP_RMS_NORM_OP = "SkipSimplifiedLayerNormalization"
SKIP_RMS_NORM = (SKIP_RMS_NORM_OP, "com.microsoft")


def op_count(model_proto: onnx.ModelProto, op_type: str, domain: str = "") -> int:
    return sum(
        node.op_type == op_type and ("" if node.domain in ("", "ai.onnx") else node.domain) == domain
        for node in model_proto.graph.node
    )


def opset_of(model_proto: onnx.ModelProto, domain: str = "") -> int | None:
    for entry in model_proto.opset_import:
        if entry.domain in ((domain,) if domain else ("", "ai.onnx")):
            return int(entry.version)
    return None
