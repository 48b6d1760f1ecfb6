"""Attention forms for the engines that cannot take the fused graph as it is, each made from the
fused graph (`export/fusion.py`) by rewriting every layer's

    Attention(q, k, v, allowed, past_key, past_value) -> (context, present_key, present_value)

so that the fusion that the `fp32-fused` rung proved is the only statement of where attention is.

**Static cache** (`fp32-static`, `fp16-static`): `com.microsoft.GroupQueryAttention` over one buffer
per layer of `cache_length` positions per row, bound as both the past and the present, the new keys
and values written in place at each row's length (`seqlens_k`), the form of onnxruntime-genai and of
gpt-fast's static `KVCache`. The graph's mask input goes: causality is the op's own and a row's
padding is its length (right padding only), so `attention_mask` leaves the graph and `seqlens_k` and
`total_sequence_length` come in. ONNX Runtime runs the op on the CPU (fp32 and fp16) and on CUDA
(fp16/bf16, flash and XQA decode kernels); see docs/gpu.md for what the GPU measured.

**TensorRT** (`fp32-trt`, `fp16-trt`): TensorRT's ONNX parser takes `Attention` only with one output
and no past inputs, so the cache Concat moves out of the node and attention becomes the 4D
single-output `Attention(q, K, V, allowed)` (heads split by Reshape/Transpose, GQA from the head
counts of q and K). TensorRT then parses every node, and ONNX Runtime's CUDA provider runs the same
graph where TensorRT is absent.
"""

from __future__ import annotations

import math

import onnx
import onnx_ir as ir
import onnxruntime  # noqa: F401  (the float16 converter below comes from it; import errors show here)
from onnxscript.rewriter import pattern

from contract import names
from contract.config import ModelConfig
from export.fusion import clean_up, fused_proto
from export.model import AttentionModel
from export.onnx_export import IR_VERSION, name_axes, plain_graph, save_onnx

MICROSOFT_DOMAIN = "com.microsoft"
# GroupQueryAttention's kernels need head_dim % 8 == 0 (onnxruntime group_query_attention_helper.h)
GQA_HEAD_DIM_MULTIPLE = 8


class FormError(ValueError):
    """The model cannot take this form (the reason says which requirement it misses)."""


def _attention_attributes(node: ir.Node) -> dict:
    attributes = node.attributes
    return {name: attributes[name].value for name in attributes}


def _plain_attention_problem(node: ir.Node) -> str | None:
    """What in the fused node's attributes a rewrite here would not carry over."""
    attributes = _attention_attributes(node)
    if attributes.get("is_causal", 0):
        return "the Attention node is causal by attribute; the rewrites expect the explicit mask"
    if attributes.get("softcap", 0.0):
        return "the Attention node has a softcap"
    if attributes.get("qk_matmul_output_mode", 0):
        return "the Attention node returns its scores"
    nh = attributes.get("q_num_heads")
    if not nh or not attributes.get("kv_num_heads"):
        return "the Attention node has no head counts (3D inputs expected)"
    return None


class _AttentionRewrite(pattern.RewriteRuleClassBase):
    """Matches one fused layer; subclasses say what replaces it."""

    def pattern(self, op, q, k, v, allowed, past_k, past_v):
        return op.Attention(
            q, k, v, allowed, past_k, past_v, _allow_other_attributes=True, _outputs=["out", "present_k", "present_v"]
        )

    def check(self, context, q, out, **_):
        problem = _plain_attention_problem(out.producer())
        if problem is None:
            attributes = _attention_attributes(out.producer())
            width = (q.shape or [None])[-1]
            if not isinstance(width, int):
                problem = "the query width is not static"
            else:
                head_dim = width // attributes["q_num_heads"]
                scale = attributes.get("scale")
                if scale is not None and not math.isclose(scale, 1 / math.sqrt(head_dim), rel_tol=1e-6):
                    problem = f"the Attention scale {scale} is not 1/sqrt(head_dim)"
        return pattern.MatchResult().fail(problem) if problem else pattern.MatchResult()

    @staticmethod
    def heads(q: ir.Value, out: ir.Value) -> tuple[int, int, int]:
        attributes = _attention_attributes(out.producer())
        n_heads, n_kv_heads = attributes["q_num_heads"], attributes["kv_num_heads"]
        return n_heads, n_kv_heads, q.shape[-1] // n_heads


class ToGroupQueryAttention(_AttentionRewrite):
    """Attention with past/present -> GroupQueryAttention over the shared cache buffer."""

    def __init__(self, seqlens_k: ir.Value, total_length: ir.Value) -> None:
        super().__init__("ToGroupQueryAttention", remove_nodes=True)
        self.seqlens_k, self.total_length = seqlens_k, total_length

    def rewrite(self, op, q, k, v, past_k, past_v, out, **_):
        n_heads, n_kv_heads, _ = self.heads(q, out)
        return op.GroupQueryAttention(
            q,
            k,
            v,
            past_k,
            past_v,
            self.seqlens_k,
            self.total_length,
            num_heads=n_heads,
            kv_num_heads=n_kv_heads,
            _domain=MICROSOFT_DOMAIN,
            _outputs=3,
        )


class ToSingleOutputAttention(_AttentionRewrite):
    """Attention with past/present -> Concat outside and a 4D, single-output Attention."""

    def __init__(self) -> None:
        super().__init__("ToSingleOutputAttention", remove_nodes=True)

    def rewrite(self, op, q, k, v, allowed, past_k, past_v, out, **_):
        n_heads, n_kv_heads, head_dim = self.heads(q, out)

        def split_heads(x, heads):  # (B, T, heads*hd) -> (B, heads, T, hd)
            shape = op.Constant(value_ints=[0, 0, heads, head_dim])
            return op.Transpose(op.Reshape(x, shape), perm=[0, 2, 1, 3])

        present_k = op.Concat(past_k, split_heads(k, n_kv_heads), axis=2)  # (B, n_kv, P+T, hd)
        present_v = op.Concat(past_v, split_heads(v, n_kv_heads), axis=2)
        context = op.Attention(split_heads(q, n_heads), present_k, present_v, allowed)  # (B, nh, T, hd)
        combined = op.Transpose(context, perm=[0, 2, 1, 3])  # (B, T, nh, hd)
        width = op.Constant(value_ints=[0, 0, n_heads * head_dim])
        return op.Reshape(combined, width), present_k, present_v


def _rewrite_fused(model: AttentionModel, rule: pattern.RewriteRule) -> ir.Model:
    fused = ir.from_proto(fused_proto(plain_graph(model))[0])
    count = pattern.RewriteRuleSet([rule]).apply_to_model(fused)
    if count != model.cfg.n_layers:
        raise FormError(f"{rule.name}: rewrote {count} of {model.cfg.n_layers} layers' Attention nodes")
    return fused


def static_problem(cfg: ModelConfig) -> str | None:
    """Why `cfg` cannot have the static-cache form, or None."""
    from export.parity import MIN_POOL_LENGTH

    if cfg.max_seq_len < MIN_POOL_LENGTH:
        return (
            f"max_seq_len {cfg.max_seq_len} is below the {MIN_POOL_LENGTH} positions "
            "the static form's parity rung needs"
        )
    if cfg.head_dim % GQA_HEAD_DIM_MULTIPLE:
        return (
            f"head_dim {cfg.head_dim} (d_model {cfg.d_model} / n_heads {cfg.n_heads}) is not a multiple of "
            f"{GQA_HEAD_DIM_MULTIPLE}, which GroupQueryAttention requires"
        )
    return None


def static_proto(model: AttentionModel) -> onnx.ModelProto:
    """The static-cache graph of `model` in fp32."""
    cfg = model.cfg
    problem = static_problem(cfg)
    if problem:
        raise FormError(problem)
    seqlens_k = ir.Value(name=names.SEQLENS_K, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([names.BATCH]))
    total = ir.Value(name=names.TOTAL_SEQUENCE_LENGTH, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([]))
    graph_model = _rewrite_fused(model, ToGroupQueryAttention.rule(seqlens_k, total))
    graph = graph_model.graph
    clean_up(graph_model)
    by_name = {value.name: value for value in graph.inputs}
    mask = by_name[names.ATTENTION_MASK]
    assert not mask.uses(), "the attention mask still feeds a node after the rewrite"
    graph.inputs.clear()
    graph.inputs.extend([by_name[names.HIDDEN_STATES], seqlens_k, total])
    graph.inputs.extend(by_name[name] for name in names.past_names(cfg.n_layers))
    graph_model.opset_imports.setdefault(MICROSOFT_DOMAIN, 1)
    proto = ir.to_proto(graph_model)
    proto.ir_version = IR_VERSION
    del proto.graph.value_info[:]  # shapes inferred for the concat form; the buffers keep their length now
    name_axes(proto, cfg, names.static_input_specs(cfg) + names.static_output_specs(cfg))
    return proto


def tensorrt_proto(model: AttentionModel) -> onnx.ModelProto:
    """The TensorRT form of `model` in fp32: cache Concat outside, a single-output Attention."""
    graph_model = _rewrite_fused(model, ToSingleOutputAttention.rule())
    clean_up(graph_model)
    proto = ir.to_proto(graph_model)
    proto.ir_version = IR_VERSION
    return proto


def make_fp32_static(model: AttentionModel, path) -> object:
    return save_onnx(static_proto(model), path)


def make_fp16_static(model: AttentionModel, path) -> object:
    from export.fp16 import to_fp16

    return save_onnx(to_fp16(static_proto(model), model.cfg), path)


def make_fp32_trt(model: AttentionModel, path) -> object:
    return save_onnx(tensorrt_proto(model), path)


def make_fp16_trt(model: AttentionModel, path) -> object:
    from export.fp16 import to_fp16

    return save_onnx(to_fp16(tensorrt_proto(model), model.cfg), path)
