"""The `fp32-fused` variant: each layer's attention, with its KV cache, as ONE ONNX `Attention` op.

The plain graph of the PyTorch original (`export_onnx`, every op decomposed) is raised to opset 23
by onnxscript's version converter, and an onnxscript rewrite rule replaces, per layer, the split-heads
Reshape/Transpose, the cache Concat, the GQA repeat_interleave, the scaled scores, the masked_fill,
the Softmax, the weighted sum and the combine-heads Transpose/Reshape with

    Attention(q, k, v, allowed, past_key, past_value) -> (context, present_key, present_value)

(3D q/k/v with `q_num_heads`/`kv_num_heads`: native GQA, no repeated cache; the boolean `allowed`
mask the model already computes). The rule checks every assumption it makes (cache along axis 2,
repeat_interleave rather than tile, 1/sqrt(head_dim) scaling, a fill value that zeroes a weight)
and leaves the graph alone when one fails; the build then refuses the variant for having fewer
fused ops than layers. `export/model.py` stays the math; no second copy of attention exists.
Why this op and this route, with the measurements: docs/design.md, "Choices and their evidence".
`fuse_qkv=True` merges the Q/K/V projections (off in the shipped variants; measured there too).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import common as common_passes
from onnxscript import optimizer
from onnxscript.rewriter import pattern
from onnxscript.version_converter import convert_version

from export.model import AttentionModel
from export.norm_rotary_fusion import constant_ints, constant_scalar, fuse_norms_and_rotations, fuse_skip_norms
from export.onnx_export import IR_VERSION, plain_graph, save_onnx

# The first ONNX opset with `Attention` (past/present, GQA, boolean masks).
ATTENTION_OPSET = 23
# Masked scores the op excludes must already weigh exp(fill - max) = 0 in the decomposed graph.
_MAX_FILL = -1e4
# Constant folding limit for the concatenated Q/K/V weights (elements); the large preset's is 6.3M.
_FOLD_LIMIT = 1 << 28


def _scaled_by_sqrt(divisor: ir.Value, head_dim: int) -> bool:
    """The scores are divided by sqrt(head_dim), the op's default scale."""
    value = constant_scalar(divisor)
    return value is not None and math.isclose(value, math.sqrt(head_dim), rel_tol=1e-6)


def _dims(value: ir.Value) -> list[int | str | None] | None:
    """Static dims as ints, symbolic ones as their names; None when the shape is unknown."""
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else d.value for d in value.shape]


class FuseAttention(pattern.RewriteRuleClassBase):
    """The decomposed attention of one layer (as `torch.onnx.export` writes export/model.py) with its
    cache Concat, folded into one `Attention` node that takes the past and returns the present."""

    def __init__(self) -> None:
        super().__init__("FuseAttentionWithCache", remove_nodes=True)

    def pattern(self, op, q3, k3, v3, q_shape, k_shape, v_shape, past_k, past_v, disallowed, divisor, fill):
        q = op.Transpose(op.Reshape(q3, q_shape, _allow_other_attributes=True), perm=[0, 2, 1, 3], _outputs=["q"])
        k = op.Transpose(op.Reshape(k3, k_shape, _allow_other_attributes=True), perm=[0, 2, 1, 3])
        v = op.Transpose(op.Reshape(v3, v_shape, _allow_other_attributes=True), perm=[0, 2, 1, 3])
        context, present_k, present_v = self._attention(op, q, k, v, past_k, past_v, disallowed, divisor, fill)
        combined = op.Transpose(context, perm=[0, 2, 1, 3])  # (B, T, nh, hs)
        out = op.Reshape(combined, pattern.ANY_VALUE, _allow_other_attributes=True, _outputs=["out"])
        return out, present_k, present_v

    def _attention(self, op, q, k, v, past_k, past_v, disallowed, divisor, fill):
        """The cache Concat, the GQA repeat, the scaled and masked scores, the softmax and the weighted
        sum, over 4D q (B, nh, T, hs), k and v (B, n_kv, T, hs)."""
        present_k = op.Concat(past_k, k, _allow_other_attributes=True, _outputs=["present_k"])  # (B, n_kv, P+T, hs)
        present_v = op.Concat(past_v, v, _allow_other_attributes=True, _outputs=["present_v"])
        keys = self._repeat_heads(op, present_k, "k")  # (B, nh, P+T, hs)
        values = self._repeat_heads(op, present_v, "v")
        scores = op.Div(op.MatMul(q, op.Transpose(keys, perm=[0, 1, 3, 2])), divisor)  # (B, nh, T, P+T)
        weights = op.Softmax(op.Where(disallowed, fill, scores), axis=-1)
        context = op.MatMul(weights, values)  # (B, nh, T, hs)
        return context, present_k, present_v

    @staticmethod
    def _repeat_heads(op, cache, kind: str):
        """repeat_interleave over the head axis: Unsqueeze(2) -> Expand -> Reshape."""
        unsqueezed = op.Unsqueeze(cache, pattern.Var(f"{kind}_axes"), _outputs=[f"{kind}_unsqueezed"])
        expanded = op.Expand(unsqueezed, pattern.ANY_VALUE)
        return op.Reshape(expanded, pattern.ANY_VALUE, _allow_other_attributes=True, _outputs=[f"{kind}_repeated"])

    def check(self, context, disallowed, divisor, fill, **values):
        problem = self._mask_problem(disallowed, fill, values) or self._scale_problem(divisor, values)
        return pattern.MatchResult().fail(problem) if problem else pattern.MatchResult()

    @staticmethod
    def _mask_problem(disallowed, fill, values) -> str | None:
        if disallowed.producer() is None or disallowed.producer().op_type != "Not":
            return "the masked_fill condition is not Not(allowed)"
        if constant_scalar(fill) is None or constant_scalar(fill) > _MAX_FILL:
            return "the masked_fill value does not zero a masked weight"
        if any(values[c].producer().attributes.get_int("axis") not in (2, -2) for c in ("present_k", "present_v")):
            return "the cache is not concatenated along the sequence axis"
        # Unsqueeze at axis 1 would tile (head h reads kv head h % n_kv), not repeat_interleave
        if any(constant_ints(values[f"{kind}_axes"]) not in ([2], [-3]) for kind in ("k", "v")):
            return "the kv heads are not repeated with repeat_interleave"
        return None

    def _scale_problem(self, divisor, values) -> str | None:
        names = ("q3", "q", "present_k", "out", "k_repeated", "v_repeated")
        shapes = self._shapes(*(values[n] for n in names))
        if shapes is None:
            return "q, k, v or the output lack the static head counts the op needs"
        if not _scaled_by_sqrt(divisor, shapes["head_dim"]):
            return "the scores are not scaled by 1/sqrt(head_dim)"
        return None

    @staticmethod
    def _shapes(q3, q, present_k, out, k_repeated, v_repeated) -> dict[str, int] | None:
        """Head counts and sizes, when the graph's shapes say q is (B, nh, T, hs) from (B, T, nh*hs),
        the cache (B, n_kv, S, hs) and the repeated cache (B, nh, S, hs)."""
        q_dims, kv_dims, q3_dims, out_dims = _dims(q), _dims(present_k), _dims(q3), _dims(out)
        if not (q_dims and kv_dims and q3_dims and out_dims) or len(q_dims) != 4 or len(kv_dims) != 4:
            return None
        n_heads, head_dim, n_kv_heads = q_dims[1], q_dims[3], kv_dims[1]
        if not all(isinstance(d, int) for d in (n_heads, head_dim, n_kv_heads)) or n_heads % n_kv_heads:
            return None
        width = n_heads * head_dim
        repeated_ok = all((_dims(r) or [None] * 4)[1] == n_heads for r in (k_repeated, v_repeated))
        if kv_dims[3] != head_dim or q3_dims[-1] != width or out_dims[-1] != width or not repeated_ok:
            return None
        return {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim}

    def rewrite(self, op, q3, k3, v3, past_k, past_v, disallowed, q, present_k, **_):
        allowed = disallowed.producer().inputs[0]  # (B, 1, T, P+T) bool, True = may attend
        return op.Attention(
            q3,
            k3,
            v3,
            allowed,
            past_k,
            past_v,
            q_num_heads=q.shape[1],
            kv_num_heads=present_k.shape[1],
            _outputs=3,
        )


class FuseAttention4D(FuseAttention):
    """The same, where q and k are not straight head splits of a projection (they were normalized per
    head or rotated by position first): `Attention` on the 4D q, k, v (B, heads, T, hs), its 4D context
    combined into heads by the graph's own Transpose and Reshape as before."""

    def __init__(self) -> None:
        pattern.RewriteRuleClassBase.__init__(self, "FuseAttention4DWithCache", remove_nodes=True)

    def pattern(self, op, q, k, v, past_k, past_v, disallowed, divisor, fill):
        return self._attention(op, q, k, v, past_k, past_v, disallowed, divisor, fill)

    def _scale_problem(self, divisor, values) -> str | None:
        q, present_k = values["q"], values["present_k"]
        q_dims, kv_dims = _dims(q), _dims(present_k)
        if not q_dims or not kv_dims or len(q_dims) != 4 or len(kv_dims) != 4:
            return "q or the cache lack a 4D shape"
        n_heads, head_dim, n_kv_heads = q_dims[1], q_dims[3], kv_dims[1]
        if not all(isinstance(d, int) for d in (n_heads, head_dim, n_kv_heads)) or n_heads % n_kv_heads:
            return "q or the cache lack static head counts"
        if not all((_dims(values[r]) or [None] * 4)[1] == n_heads for r in ("k_repeated", "v_repeated")):
            return "the repeated cache does not have the query's head count"
        if not _scaled_by_sqrt(divisor, head_dim):
            return "the scores are not scaled by 1/sqrt(head_dim)"
        return None

    def rewrite(self, op, q, k, v, past_k, past_v, disallowed, **_):
        allowed = disallowed.producer().inputs[0]  # (B, 1, T, P+T) bool, True = may attend
        return op.Attention(q, k, v, allowed, past_k, past_v, _outputs=3)


class FuseQKVProjections(pattern.RewriteRuleClassBase):
    """Three projections of the same input feeding one `Attention` -> one MatMul and a Split.

    The weights are concatenated with a Concat of constants, which constant folding turns into one
    initializer: no hand-built tensors."""

    def __init__(self, bias: bool) -> None:
        super().__init__(f"FuseQKVProjections{'WithBias' if bias else ''}", remove_nodes=True)
        self.bias = bias

    def _project(self, op, h, weight, bias):
        projected = op.MatMul(h, weight)
        return op.Add(projected, bias) if self.bias else projected

    def pattern(self, op, h, w_q, w_k, w_v, b_q, b_k, b_v, mask, past_k, past_v):
        q = self._project(op, h, w_q, b_q)
        k = self._project(op, h, w_k, b_k)
        v = self._project(op, h, w_v, b_v)
        return op.Attention(
            q, k, v, mask, past_k, past_v, _allow_other_attributes=True, _outputs=["attended", "present_k", "present_v"]
        )

    def check(self, context, w_q, w_k, w_v, **values):
        result = pattern.MatchResult()
        constants = [w_q, w_k, w_v] + ([values["b_q"], values["b_k"], values["b_v"]] if self.bias else [])
        if any(c.const_value is None for c in constants):
            return result.fail("a projection weight is not a constant")
        if len({c.const_value.shape[0] for c in (w_q, w_k, w_v)}) != 1:
            return result.fail("the projections do not share their input width")
        return result

    def rewrite(self, op, h, w_q, w_k, w_v, mask, past_k, past_v, **values):
        widths = op.Constant(value=ir.tensor(np.array([w.const_value.shape[1] for w in (w_q, w_k, w_v)], np.int64)))
        projected = op.MatMul(h, op.Concat(w_q, w_k, w_v, axis=1))  # (B, T, (nh + 2 n_kv) hs)
        if self.bias:
            projected = op.Add(projected, op.Concat(values["b_q"], values["b_k"], values["b_v"], axis=0))
        q, k, v = op.Split(projected, widths, axis=-1, _outputs=3)
        attributes = values["attended"].producer().attributes  # heads, scale, precision: unchanged
        return op.Attention(q, k, v, mask, past_k, past_v, **attributes, _outputs=3)


ATTENTION_RULES = pattern.RewriteRuleSet([FuseAttention.rule()])
# after the 3D rule has taken every layer it can (the 4D pattern is part of the 3D one)
ATTENTION_4D_RULES = pattern.RewriteRuleSet([FuseAttention4D.rule()])
QKV_RULES = pattern.RewriteRuleSet([FuseQKVProjections.rule(bias=True), FuseQKVProjections.rule(bias=False)])


@dataclasses.dataclass(frozen=True)
class FusionCounts:
    attention: int  # Attention ops made (one per layer when all went well)
    qkv: int  # Q/K/V projection groups merged
    norms: int = 0  # RMSNormalization ops made (the block's, q's and k's)
    rotations: int = 0  # RotaryEmbedding ops made (q's and k's per layer)


def fuse(model: ir.Model, *, fuse_qkv: bool = False) -> FusionCounts:
    """Fuse `model` (the plain graph, as `ir.Model`) in place and clean it up."""
    convert_version(model, ATTENTION_OPSET)
    common_passes.ShapeInferencePass()(model)  # the rule reads head counts from shapes
    norms, rotations = fuse_norms_and_rotations(model)
    attention = ATTENTION_RULES.apply_to_model(model) + ATTENTION_4D_RULES.apply_to_model(model)
    qkv = QKV_RULES.apply_to_model(model) if fuse_qkv else 0
    clean_up(model, fold_limit=_FOLD_LIMIT if qkv else None)
    return FusionCounts(attention, qkv, norms, rotations)


def clean_up(model: ir.Model, fold_limit: int | None = None) -> None:
    """Constant folding and dead-node removal (onnxscript's optimizer), and no exporter debug info:
    the per-node stack traces and FX names would otherwise outweigh a small model's weights."""
    limits = {"input_size_limit": fold_limit, "output_size_limit": fold_limit} if fold_limit else {}
    optimizer.optimize(model, **limits)
    for node in model.graph:
        node.metadata_props.clear()


def fused_proto(plain: onnx.ModelProto, *, fuse_qkv: bool = False) -> tuple[onnx.ModelProto, FusionCounts]:
    model = ir.from_proto(plain)
    counts = fuse(model, fuse_qkv=fuse_qkv)
    proto = ir.to_proto(model)
    proto.ir_version = IR_VERSION  # what ONNX Runtime 1.31 loads (see onnx_export)
    return proto, counts


def make_fp32_fused(model: AttentionModel, path: Path, fuse_qkv: bool = False) -> Path:
    """The `fp32-fused` variant at `path`: the plain export, fused, checked by onnx.checker."""
    return save_onnx(fp32_fused_proto(model, fuse_qkv), path)


def fp32_fused_proto(model: AttentionModel, fuse_qkv: bool = False) -> onnx.ModelProto:
    """The fused graph as ONNX Runtime serves it in fp32: its residual Adds in their norms (fuse_skip_norms)."""
    fused, _ = fused_proto(plain_graph(model), fuse_qkv=fuse_qkv)
    return fuse_skip_norms(fused)
