"""The fused form of the modern block's parts: each RMSNorm (the block's and the per-head q/k norms) as
ONE opset-23 `RMSNormalization`, each rotation of q and k as ONE opset-23 `RotaryEmbedding` that reads
its angles from the model's cos/sin tables by `position_ids`.

The rules match the plain graph as `torch.onnx.export` writes export/model.py (`RMSNorm`, `Rotary`):

    RMSNorm:  Mul(Div(x, Sqrt(Add(ReduceMean(Pow(x, 2), [-1]), eps))), weight)
    Rotary:   cos = Unsqueeze(Gather(cos_table, position_ids), 1)   (sin alike)
              half:        x1, x2 = Split(x, axis=3)
              interleaved: x1, x2 = Slice(x, 0::2), Slice(x, 1::2) on the last axis
              r1 = x1 cos - x2 sin ; r2 = x2 cos + x1 sin
              half: Concat(r1, r2) ; interleaved: Reshape(Concat(Unsqueeze(r1, -1), Unsqueeze(r2, -1)))
              partial: the above on Slice(x, 0:width) and Concat with Slice(x, width:)

Each rule checks what it assumes (the tables' shape, halves of equal width, slices of step 2 from 0
and 1, unsqueeze on the head axis) and leaves the graph alone otherwise; the build then refuses a
"fused" variant whose counts fall short (export/build.py). The ops run in ONNX Runtime 1.31 on the
CPU (checked against the PyTorch original by the parity ladder) and parse in TensorRT 10.15+.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnxscript.rewriter import pattern

MAX_INT64 = 2**63 - 1
MICROSOFT_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops


def constant_ints(value: ir.Value | None) -> list[int] | None:
    """A small constant as a list of ints, None when it is not a known constant."""
    if value is None or value.const_value is None:
        return None
    return [int(v) for v in value.const_value.numpy().reshape(-1)]


def constant_scalar(value: ir.Value | None) -> float | None:
    """A one-element constant as a float, None when it is not one."""
    if value is None or value.const_value is None or value.const_value.numpy().size != 1:
        return None
    return float(value.const_value.numpy().reshape(-1)[0])


class FuseRMSNorm(pattern.RewriteRuleClassBase):
    """x / sqrt(mean(x^2, last axis) + eps) * weight -> RMSNormalization(x, weight, epsilon=eps)."""

    def __init__(self) -> None:
        super().__init__("FuseRMSNorm", remove_nodes=True)

    def pattern(self, op, x, two, axes, eps, weight):
        mean_square = op.ReduceMean(op.Pow(x, two), axes, _allow_other_attributes=True)
        return op.Mul(op.Div(x, op.Sqrt(op.Add(mean_square, eps))), weight)

    def check(self, context, x, two, axes, eps, weight, **_):
        result = pattern.MatchResult()
        if constant_scalar(two) != 2.0:
            return result.fail("not a square")
        if constant_ints(axes) != [-1] and constant_ints(axes) != [len(x.shape or ()) - 1]:
            return result.fail("the mean is not over the last axis")
        if constant_scalar(eps) is None or weight.const_value is None:
            return result.fail("epsilon or the weight is not a constant")
        return result

    def rewrite(self, op, x, eps, weight, **_):
        return op.RMSNormalization(x, weight, axis=-1, epsilon=constant_scalar(eps))


class FuseRotary(pattern.RewriteRuleClassBase):
    """One rotation of q or k (4D, (B, heads, T, head_dim)) -> RotaryEmbedding(x, cos, sin, positions)."""

    def __init__(self, interleaved: bool, partial: bool) -> None:
        name = f"FuseRotary{'Interleaved' if interleaved else 'Half'}{'Partial' if partial else ''}"
        super().__init__(name, remove_nodes=True)
        self.interleaved, self.partial = interleaved, partial

    def pattern(self, op, x, cos, sin):
        # cos and sin are the angles' rows, (B, 1, T, width/2): shared by the q and k rotations of a layer
        # (and by every layer), so they are inputs here, not nodes the rewrite would remove
        rotated = x
        if self.partial:
            rotated = op.Slice(
                x, pattern.Var("r_start"), pattern.Var("r_end"), _allow_other_inputs=True, _outputs=["rotated_part"]
            )
        if self.interleaved:
            x1 = op.Slice(
                rotated, pattern.Var("e_start"), pattern.ANY_VALUE, pattern.Var("e_axes"), pattern.Var("e_step")
            )
            x2 = op.Slice(
                rotated, pattern.Var("o_start"), pattern.ANY_VALUE, pattern.Var("o_axes"), pattern.Var("o_step")
            )
        else:
            x1, x2 = op.Split(rotated, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["x1", "x2"])
        r1 = op.Sub(op.Mul(x1, cos), op.Mul(x2, sin))
        r2 = op.Add(op.Mul(x2, cos), op.Mul(x1, sin))
        if self.interleaved:
            pairs = op.Concat(op.Unsqueeze(r1, pattern.Var("u1")), op.Unsqueeze(r2, pattern.Var("u2")), axis=-1)
            turned = op.Reshape(pairs, pattern.ANY_VALUE, _allow_other_attributes=True)
        else:
            turned = op.Concat(r1, r2, axis=-1)
        if not self.partial:
            return turned
        kept = op.Slice(
            x, pattern.Var("k_start"), pattern.Var("k_end"), _allow_other_inputs=True, _outputs=["kept_part"]
        )
        return op.Concat(turned, kept, axis=-1)

    def check(self, context, x, cos, sin, **values):
        result = pattern.MatchResult()
        tables = _angle_rows(cos, sin)
        if isinstance(tables, str):
            return result.fail(tables)
        if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[3], int):
            return result.fail("the rotated value is not 4D with a static head_dim")
        problem = self._pairs_problem(values) if self.interleaved else self._halves_problem(values)
        problem = problem or (self._partial_problem(values, tables[0]) if self.partial else None)
        return result.fail(problem) if problem else result

    @staticmethod
    def _pairs_problem(values) -> str | None:
        last = ([3], [-1])
        if constant_ints(values["e_start"]) != [0] or constant_ints(values["o_start"]) != [1]:
            return "the pairs are not the even and odd dims"
        if constant_ints(values["e_step"]) != [2] or constant_ints(values["o_step"]) != [2]:
            return "the pairs are not taken with step 2"
        if constant_ints(values["e_axes"]) not in last or constant_ints(values["o_axes"]) not in last:
            return "the pairs are not taken on the last axis"
        if constant_ints(values["u1"]) != [-1] or constant_ints(values["u2"]) != [-1]:
            return "the turned pairs are not stacked on a new last axis"
        return None

    @staticmethod
    def _halves_problem(values) -> str | None:
        split = values["x1"].producer()
        sizes = constant_ints(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] is not None else None
        if split.attributes.get_int("axis", 0) not in (3, -1):
            return "the halves are not split on the last axis"
        if sizes is not None and (len(sizes) != 2 or sizes[0] != sizes[1]):
            return f"the halves are not of equal width: {sizes}"
        return None

    @staticmethod
    def _partial_problem(values, cos_table: ir.Value) -> str | None:
        width = 2 * cos_table.const_value.shape[1]
        for name in ("rotated_part", "kept_part"):
            slicing = values[name].producer()
            axes = constant_ints(slicing.inputs[3]) if len(slicing.inputs) > 3 else None
            steps = (
                constant_ints(slicing.inputs[4]) if len(slicing.inputs) > 4 and slicing.inputs[4] is not None else [1]
            )
            if axes not in ([3], [-1]) or steps != [1]:
                return "the rotated and kept parts are not slices of the last axis"
        if constant_ints(values["r_start"]) != [0] or constant_ints(values["r_end"]) != [width]:
            return f"the rotated part is not the first {width} dims"
        if constant_ints(values["k_start"]) != [width] or (constant_ints(values["k_end"]) or [0])[0] < width:
            return f"the kept part is not the dims after {width}"
        return None

    def rewrite(self, op, x, cos, sin, **_):
        cos_table, sin_table, positions = _angle_rows(cos, sin)
        width = 2 * cos_table.const_value.shape[1]
        attributes = {"rotary_embedding_dim": width} if self.partial else {}
        return op.RotaryEmbedding(x, cos_table, sin_table, positions, interleaved=int(self.interleaved), **attributes)


def _angle_rows(cos: ir.Value, sin: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value] | str:
    """(cos table, sin table, positions) when cos and sin are Unsqueeze(Gather(table, positions), [1]),
    the same positions for both; else why not."""
    found = []
    for value in (cos, sin):
        unsqueeze = value.producer()
        if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or constant_ints(unsqueeze.inputs[1]) != [1]:
            return "the angles are not broadcast over the head axis"
        gather = unsqueeze.inputs[0].producer()
        if gather is None or gather.op_type != "Gather" or gather.attributes.get_int("axis", 0) != 0:
            return "the angles are not rows of a table"
        table, positions = gather.inputs
        if table.const_value is None or len(table.const_value.shape) != 2:
            return "the angles' table is not a constant (positions, width/2)"
        found.append((table, positions))
    (cos_table, positions), (sin_table, sin_positions) = found
    if positions is not sin_positions or cos_table.const_value.shape != sin_table.const_value.shape:
        return "cos and sin are not read at the same positions from tables of one shape"
    return cos_table, sin_table, positions


class FuseSkipRMSNorm(pattern.RewriteRuleClassBase):
    """The residual Add into an RMSNorm, where the stream goes on past the norm: sum = a + b, normed =
    RMSNormalization(sum, weight) -> normed, _, _, sum = SkipSimplifiedLayerNormalization(a, b, weight) (ONNX
    Runtime's contrib op, as onnxruntime-genai's graphs hold it: the row is read once for both). ONNX Runtime 1.31
    does not make it from `RMSNormalization` itself. A norm whose Add feeds nothing else (a whole model's final
    norm) is left alone: `serving/engine/kv_pool.py` slices the stream to its last position right before it."""

    def __init__(self) -> None:
        super().__init__("FuseSkipRMSNorm", remove_nodes=True)

    def pattern(self, op, a, b, weight):
        summed = op.Add(a, b, _outputs=["summed"])
        return summed, op.RMSNormalization(summed, weight, _allow_other_attributes=True, _outputs=["normed"])

    def check(self, context, a, b, weight, summed, normed, **_):
        result = pattern.MatchResult()
        norm = normed.producer()
        axis = norm.attributes.get("axis")
        if axis is not None and axis.as_int() not in (-1, len(a.shape or ()) - 1):
            return result.fail("the norm is not over the last axis")
        if weight.const_value is None:
            return result.fail("the norm's weight is not a constant")
        if a.const_value is not None or b.const_value is not None:
            return result.fail("a constant operand: a bias, not the residual stream")
        # the static form's shapes are not inferred past GroupQueryAttention (a contrib op): where both are
        # known they must agree; the parity ladder proves the rest
        if a.shape is not None and b.shape is not None and (a.shape != b.shape or len(a.shape) != 3):
            return result.fail("the Add's operands are not two (batch, positions, width) tensors of one shape")
        if len(summed.uses()) < 2 or summed.is_graph_output():
            return result.fail("the sum feeds only the norm (the final norm): left for the last-position slice")
        return result

    def rewrite(self, op, a, b, weight, normed, **_):
        epsilon = normed.producer().attributes.get("epsilon")
        normalized, _, _, summed = op.SkipSimplifiedLayerNormalization(
            a,
            b,
            weight,
            epsilon=epsilon.as_float() if epsilon is not None else 1e-5,  # RMSNormalization's default
            _domain=MICROSOFT_DOMAIN,
            _outputs=4,
        )
        return summed, normalized


# partial rotations first: the whole-head rule would otherwise take their inner half and leave the split
PARTIAL_ROTARY_RULES = pattern.RewriteRuleSet([FuseRotary.rule(interleaved=i, partial=True) for i in (False, True)])
ROTARY_RULES = pattern.RewriteRuleSet([FuseRotary.rule(interleaved=i, partial=False) for i in (False, True)])
NORM_RULES = pattern.RewriteRuleSet([FuseRMSNorm.rule()])
SKIP_NORM_RULES = pattern.RewriteRuleSet([FuseSkipRMSNorm.rule()])


def fuse_norms_and_rotations(model: ir.Model) -> tuple[int, int]:
    """Fuse in place; (RMSNormalization ops made, RotaryEmbedding ops made)."""
    norms = NORM_RULES.apply_to_model(model)
    rotations = PARTIAL_ROTARY_RULES.apply_to_model(model) + ROTARY_RULES.apply_to_model(model)
    return norms, rotations


def fuse_skip_norms(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` (a fused fp32 graph, fused or static) with each residual Add that feeds an RMSNorm and goes on
    folded into it (FuseSkipRMSNorm): for the graphs ONNX Runtime serves in fp32 only. TensorRT's parser knows
    no contrib op, and the fp16 forms keep their norms' statistics in fp32 by op type (export/fp16.py)."""
    model = ir.from_proto(proto)
    if SKIP_NORM_RULES.apply_to_model(model):
        model.opset_imports.setdefault(MICROSOFT_DOMAIN, 1)
    fused = ir.to_proto(model)
    fused.ir_version = proto.ir_version
    return fused
