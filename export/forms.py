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

**Quantized static cache** (`fp32-static-int8kv`, `fp32-static-int4kv`): the fp32 static form with
its buffers holding int8 codes, or int4 codes two a byte (uint8), which GroupQueryAttention quantizes
as it stores the new keys and values and dequantizes as it attends (`kv_cache_bit_width`,
`k_quant_type`/`v_quant_type`); each layer's scales are initializers of the graph (`k_scale`,
`v_scale`), calibrated at build time (export/kv_quant.py), so the artifact carries them.

**TensorRT** (`fp32-trt`, `fp16-trt`): TensorRT's ONNX parser takes `Attention` only with one output
and no past inputs, so the cache Concat moves out of the node and attention becomes the 4D
single-output `Attention(q, K, V, allowed)` (heads split by Reshape/Transpose, GQA from the head
counts of q and K). TensorRT then parses every node, and ONNX Runtime's CUDA provider runs the same
graph where TensorRT is absent.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime  # noqa: F401  (the float16 converter below comes from it; import errors show here)
from onnxscript.rewriter import pattern

from contract import names
from contract.config import ModelConfig
from export.fusion import clean_up, fused_proto
from export.kv_quant import CacheQuantization
from export.model import AttentionModel
from export.norm_rotary_fusion import MICROSOFT_DOMAIN, fuse_skip_norms
from export.onnx_export import IR_VERSION, name_axes, plain_graph, save_onnx

# GroupQueryAttention's inputs before its scales (0-based): ..., cos_cache 7, sin_cache 8, position_ids 9,
# attention_bias 10, head_sink 11, k_scale 12, v_scale 13
GQA_K_SCALE_INPUT = 12
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
    """Attention with past/present -> GroupQueryAttention over the shared cache buffer, attending
    through the layer's sliding window where it has one."""

    def __init__(self, seqlens_k: ir.Value, total_length: ir.Value, cfg: ModelConfig) -> None:
        super().__init__("ToGroupQueryAttention", remove_nodes=True)
        self.seqlens_k, self.total_length, self.cfg = seqlens_k, total_length, cfg

    def rewrite(self, op, q, k, v, past_k, past_v, out, present_k, **_):
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
            **window_attribute(self.cfg, present_k),
            _domain=MICROSOFT_DOMAIN,
            _outputs=3,
        )


def window_attribute(cfg: ModelConfig, present_k: ir.Value) -> dict[str, int]:
    """GroupQueryAttention's `local_window_size` for the layer of `present_k`: a query sees itself and
    the window - 1 keys before it, as the model's mask (measured on ONNX Runtime 1.31's CPU kernel)."""
    window = cfg.window(layer_of(present_k))
    return {} if window is None else {"local_window_size": window}


class _Attention4DRewrite(pattern.RewriteRuleClassBase):
    """Matches one fused layer whose q and k were normalized or rotated before attention: the 4D
    `Attention(q, k, v, allowed, past_key, past_value)` (B, heads, T, hs) and its context combined
    into (B, T, nh * hs) by Transpose and Reshape."""

    def pattern(self, op, q, k, v, allowed, past_k, past_v, combined_shape):
        attended, present_k, present_v = op.Attention(
            q,
            k,
            v,
            allowed,
            past_k,
            past_v,
            _allow_other_attributes=True,
            _outputs=["attended", "present_k", "present_v"],
        )
        out = op.Reshape(op.Transpose(attended, perm=[0, 2, 1, 3]), combined_shape, _allow_other_attributes=True)
        return out, present_k, present_v

    def check(self, context, q, present_k, **values):
        problem = _plain_4d_problem(values["attended"].producer())
        dims = [*(q.shape or ()), *(present_k.shape or ())]
        if problem is None and (len(dims) != 8 or not all(isinstance(d, int) for d in (dims[1], dims[3], dims[5]))):
            problem = "q or the cache lack static head counts and sizes"
        return pattern.MatchResult().fail(problem) if problem else pattern.MatchResult()

    @staticmethod
    def heads(q: ir.Value, present_k: ir.Value) -> tuple[int, int, int]:
        return q.shape[1], present_k.shape[1], q.shape[3]


def _plain_4d_problem(node: ir.Node) -> str | None:
    attributes = _attention_attributes(node)
    if attributes.get("is_causal", 0) or attributes.get("softcap", 0.0) or attributes.get("qk_matmul_output_mode", 0):
        return "the Attention node is causal by attribute, has a softcap or returns its scores"
    if attributes.get("scale") is not None:
        return "the Attention node has a scale of its own"
    return None


def _rotation(value: ir.Value) -> tuple[ir.Value, ir.Node | None]:
    """(the unrotated value, the RotaryEmbedding node) of a value a RotaryEmbedding made; else (it, None)."""
    node = value.producer()
    if node is not None and node.op_type == "RotaryEmbedding" and node.domain in ("", "ai.onnx"):
        return node.inputs[0], node
    return value, None


def _heads_to_3d(op, value: ir.Value, heads: int, head_dim: int) -> ir.Value:
    """(B, heads, T, hs) -> (B, T, heads * hs), the packed layout GroupQueryAttention takes."""
    return op.Reshape(op.Transpose(value, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, heads * head_dim]))


class ToGroupQueryAttention4D(_Attention4DRewrite):
    """4D Attention with past/present (q and k rotated by RotaryEmbedding, or not) -> GroupQueryAttention
    over the shared cache buffer, rotating q and k itself (`do_rotary`, the model's cos/sin tables,
    positions from each row's length) and attending through the layer's sliding window
    (`local_window_size`: a query sees itself and the window - 1 keys before it, as the model's mask)."""

    def __init__(self, seqlens_k: ir.Value, total_length: ir.Value, cfg: ModelConfig) -> None:
        super().__init__("ToGroupQueryAttention4D", remove_nodes=True)
        self.seqlens_k, self.total_length, self.cfg = seqlens_k, total_length, cfg

    def check(self, context, q, k, present_k, **values):
        result = super().check(context, q, present_k=present_k, **values)
        if result:
            (_, q_rotation), (_, k_rotation) = _rotation(q), _rotation(k)
            if (q_rotation is None) != (k_rotation is None):
                return result.fail("q and k are not rotated alike")
            if q_rotation is not None and _rotary_attributes(q_rotation) != _rotary_attributes(k_rotation):
                return result.fail("q and k are rotated differently")
        return result

    def rewrite(self, op, q, k, v, past_k, past_v, present_k, **_):
        n_heads, n_kv_heads, head_dim = self.heads(q, present_k)
        (q, rotation), (k, _) = _rotation(q), _rotation(k)
        attributes = {"num_heads": n_heads, "kv_num_heads": n_kv_heads}
        tables = []
        if rotation is not None:
            cos_table, sin_table = rotation.inputs[1], rotation.inputs[2]
            tables = [cos_table, sin_table]
            attributes |= {"do_rotary": 1, "rotary_interleaved": _rotary_attributes(rotation)["interleaved"]}
        attributes |= window_attribute(self.cfg, present_k)
        out, new_k, new_v = op.GroupQueryAttention(
            _heads_to_3d(op, q, n_heads, head_dim),
            _heads_to_3d(op, k, n_kv_heads, head_dim),
            _heads_to_3d(op, v, n_kv_heads, head_dim),
            past_k,
            past_v,
            self.seqlens_k,
            self.total_length,
            *tables,
            **attributes,
            _domain=MICROSOFT_DOMAIN,
            _outputs=3,
        )
        return out, new_k, new_v


def _rotary_attributes(node: ir.Node) -> dict:
    attributes = _attention_attributes(node)
    return {"interleaved": attributes.get("interleaved", 0), "width": attributes.get("rotary_embedding_dim", 0)}


def layer_of(present: ir.Value) -> int:
    """The layer a present key belongs to, from its graph output name (`present.{i}.key`)."""
    return layer_of_name(present.name)


class ToSingleOutputAttention4D(_Attention4DRewrite):
    """4D Attention with past/present -> the cache Concat outside and a 4D, single-output Attention."""

    def __init__(self) -> None:
        super().__init__("ToSingleOutputAttention4D", remove_nodes=True)

    def rewrite(self, op, q, k, v, allowed, past_k, past_v, combined_shape, **_):
        present_k = op.Concat(past_k, k, axis=2)  # (B, n_kv, P+T, hd)
        present_v = op.Concat(past_v, v, axis=2)
        context = op.Attention(q, present_k, present_v, allowed)  # (B, nh, T, hd)
        return op.Reshape(op.Transpose(context, perm=[0, 2, 1, 3]), combined_shape), present_k, present_v


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


def _rewrite_fused(model: AttentionModel, rules: list[pattern.RewriteRule]) -> ir.Model:
    """The fused graph with each layer's Attention rewritten by the first of `rules` that takes it."""
    fused = ir.from_proto(fused_proto(plain_graph(model))[0])
    count = sum(pattern.RewriteRuleSet([rule]).apply_to_model(fused) for rule in rules)
    if count != model.cfg.n_layers:
        names = ", ".join(rule.name for rule in rules)
        raise FormError(f"{names}: rewrote {count} of {model.cfg.n_layers} layers' Attention nodes")
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
            f"head_dim {cfg.head_dim} is not a multiple of {GQA_HEAD_DIM_MULTIPLE}, which GroupQueryAttention requires"
        )
    if cfg.rotary and (cfg.rotated_width // 2) % GQA_HEAD_DIM_MULTIPLE:
        return (
            f"the rotated width {cfg.rotated_width} (rotary_dim) is not a multiple of {2 * GQA_HEAD_DIM_MULTIPLE}, "
            "which GroupQueryAttention's rotation requires"
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
    rules = [ToGroupQueryAttention.rule(seqlens_k, total, cfg), ToGroupQueryAttention4D.rule(seqlens_k, total, cfg)]
    graph_model = _rewrite_fused(model, rules)
    graph = graph_model.graph
    clean_up(graph_model)
    by_name = {value.name: value for value in graph.inputs}
    mask = by_name[names.ATTENTION_MASK]
    new_tokens = by_name[names.model_input(cfg)]
    _batch_from(new_tokens, mask)
    assert not mask.uses(), "the attention mask still feeds a node after the rewrite"
    positions = by_name.get(names.POSITION_IDS)
    if cfg.rotary:
        assert not positions.uses(), "the positions still feed a node: GQA counts them itself"
    kept_positions = [positions] if cfg.learned_positions else []  # the learned table still reads them
    graph.inputs.clear()
    graph.inputs.extend([new_tokens, *kept_positions, seqlens_k, total])
    graph.inputs.extend(by_name[name] for name in names.past_names(cfg.n_layers))
    graph_model.opset_imports.setdefault(MICROSOFT_DOMAIN, 1)
    proto = ir.to_proto(graph_model)
    proto.ir_version = IR_VERSION
    del proto.graph.value_info[:]  # shapes inferred for the concat form; the buffers keep their length now
    pack_qkv(proto)
    name_axes(proto, cfg, names.static_input_specs(cfg) + names.static_output_specs(cfg))
    return proto


# --- q, k and v in one MatMul ------------------------------------------------------------------------
#
# GroupQueryAttention takes q, k and v packed in its query input ((B, T, (n_heads + 2 n_kv) hd), key and
# value left empty), as onnxruntime-genai's graphs feed it: one MatMul of the normalized states with the
# three weights side by side instead of three, a third of the projections' kernel launches of a decode
# step. Where a layer's q, k and v are the three MatMuls of one input with constant weights (a bias
# each, or none), reshaped only (no transpose, no per-head norm: Qwen3's q/k norms keep them apart), they
# become one MatMul (and one Add) of the concatenated weights, the same numbers in another order of the
# output axis, which is the order the op unpacks.
LAYOUT_OPS = ("Reshape", "Identity")


def pack_qkv(proto: onnx.ModelProto) -> int:
    """Pack each GroupQueryAttention's q, k and v projections into one MatMul where they allow it (above),
    in place; the number of layers packed."""
    graph = proto.graph
    producer = {output: node for node in graph.node for output in node.output}
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    packed = 0
    for node in [n for n in graph.node if (n.domain, n.op_type) == (MICROSOFT_DOMAIN, "GroupQueryAttention")]:
        projections = [_projection(name, producer, initializers) for name in node.input[:3]]
        if None in projections or len({p[0].input[0] for p in projections}) != 1:
            continue
        if len({add is None for _, add in projections}) != 1:
            continue  # some biased, some not: never exported so (the importer zero-fills a missing bias)
        _pack(graph, node, projections, initializers)
        packed += 1
    _drop_unused(graph)
    return packed


def _projection(value: str, producer: dict, initializers: dict):
    """(the MatMul, its bias Add or None) whose output reaches `value` through reshapes only, when the
    MatMul's weight (and the Add's bias) are 2D (1D) initializers; else None."""
    node = producer.get(value)
    while node is not None and node.op_type in LAYOUT_OPS:
        node = producer.get(node.input[0])
    add = None
    if node is not None and node.op_type == "Add":
        add, bias = node, next((name for name in node.input if name in initializers), None)
        others = [i for i in node.input if i != bias]
        if bias is None or len(others) != 1 or len(initializers[bias].dims) != 1:
            return None
        node = producer.get(others[0])
    if node is None or node.op_type != "MatMul" or node.input[1] not in initializers:
        return None
    return (node, add) if len(initializers[node.input[1]].dims) == 2 else None


def _pack(graph, attention, projections, initializers) -> None:
    from onnx import helper, numpy_helper

    layer = layer_of_name(attention.output[1])
    weights = [numpy_helper.to_array(initializers[matmul.input[1]]) for matmul, _ in projections]
    weight = numpy_helper.from_array(np.concatenate(weights, axis=1), f"packed_qkv.{layer}.weight")
    graph.initializer.append(weight)
    packed = f"packed_qkv.{layer}"
    nodes = [helper.make_node("MatMul", [projections[0][0].input[0], weight.name], [packed], name=packed)]
    if projections[0][1] is not None:
        biases = [numpy_helper.to_array(initializers[_bias_of(add, initializers)]) for _, add in projections]
        bias = numpy_helper.from_array(np.concatenate(biases), f"packed_qkv.{layer}.bias")
        graph.initializer.append(bias)
        nodes.append(helper.make_node("Add", [packed, bias.name], [f"{packed}.biased"], name=f"{packed}.bias"))
    first = min(list(graph.node).index(matmul) for matmul, _ in projections)
    for offset, new in enumerate(nodes):
        graph.node.insert(first + offset, new)
    attention.input[0] = nodes[-1].output[0]
    attention.input[1] = attention.input[2] = ""  # packed: the op reads k and v from the query input


def layer_of_name(present: str) -> int:
    """The layer of a present key's graph output name (`present.{i}.key`)."""
    return int(present.split(".")[1])


def _bias_of(add, initializers) -> str:
    return next(name for name in add.input if name in initializers)


def _drop_unused(graph) -> None:
    """Nodes none of whose outputs is read (and initializers nothing reads), until none is left."""
    while True:
        used = {name for node in graph.node for name in node.input} | {value.name for value in graph.output}
        dead = [node for node in graph.node if not any(output in used for output in node.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    used = {name for node in graph.node for name in node.input}
    for tensor in [t for t in graph.initializer if t.name not in used]:
        graph.initializer.remove(tensor)


def quantized_static_proto(model: AttentionModel, quantization: CacheQuantization) -> onnx.ModelProto:
    """The static-cache graph of `model` in fp32 with its caches quantized as `quantization` says: the
    buffers int8 (or uint8, two int4 codes a byte, head_dim / 2 wide), the scales initializers."""
    cfg = model.cfg
    graph_model = ir.from_proto(static_proto(model))
    graph = graph_model.graph
    element = ir.DataType.INT8 if quantization.kind == names.INT8_CACHE else ir.DataType.UINT8
    width = names.cache_width(cfg.head_dim, quantization.kind)
    for value in [*graph.inputs, *graph.outputs]:
        if value.name in names.past_names(cfg.n_layers) + names.present_names(cfg.n_layers):
            value.type = ir.TensorType(element)
            value.shape = ir.Shape([*value.shape[:-1], width])
    attention = [node for node in graph if (node.domain, node.op_type) == (MICROSOFT_DOMAIN, "GroupQueryAttention")]
    for node in attention:
        layer = layer_of(node.outputs[1])
        scales = []
        for kind in names.KV_KINDS:
            scale = ir.Value(
                name=names.cache_scale_name(layer, kind),
                const_value=ir.tensor(quantization.scales[names.past_name(layer, kind)]),
            )
            graph.register_initializer(scale)
            scales.append(scale)
        node.resize_inputs(GQA_K_SCALE_INPUT + 2)  # the inputs between the tables and the scales stay empty
        for offset, scale in enumerate(scales):
            node.replace_input_with(GQA_K_SCALE_INPUT + offset, scale)
        for kind in ("k_quant_type", "v_quant_type"):
            node.attributes[kind] = ir.AttrString(kind, quantization.layout)
        node.attributes["kv_cache_bit_width"] = ir.AttrInt64("kv_cache_bit_width", quantization.bits)
    proto = ir.to_proto(graph_model)
    proto.ir_version = IR_VERSION
    specs = names.static_input_specs(cfg, quantization.kind) + names.static_output_specs(cfg, quantization.kind)
    name_axes(proto, cfg, specs)
    return proto


def _batch_from(hidden: ir.Value, mask: ir.Value) -> None:
    """The exporter may read the batch size off the mask's shape (`Shape(mask, end=1)`, both share the
    axis); where the mask leaves the graph, read it off the hidden states' instead."""
    for use in list(mask.uses()):
        node = use.node
        attributes = {name: node.attributes[name].value for name in node.attributes}
        if node.op_type == "Shape" and attributes.get("start", 0) == 0 and attributes.get("end") == 1:
            node.replace_input_with(use.idx, hidden)


def tensorrt_proto(model: AttentionModel) -> onnx.ModelProto:
    """The TensorRT form of `model` in fp32: cache Concat outside, a single-output Attention."""
    graph_model = _rewrite_fused(model, [ToSingleOutputAttention.rule(), ToSingleOutputAttention4D.rule()])
    clean_up(graph_model)
    proto = ir.to_proto(graph_model)
    proto.ir_version = IR_VERSION
    return proto


def fp32_static_proto(model: AttentionModel) -> onnx.ModelProto:
    """The static-cache graph as ONNX Runtime serves it in fp32: its residual Adds in their norms."""
    return fuse_skip_norms(static_proto(model))


def make_fp32_static(model: AttentionModel, path) -> object:
    return save_onnx(fp32_static_proto(model), path)


def make_fp16_static(model: AttentionModel, path) -> object:
    from export.fp16 import to_fp16

    return save_onnx(to_fp16(static_proto(model), model.cfg), path)


def make_fp32_static_quantized(model: AttentionModel, path, quantization: CacheQuantization) -> object:
    return save_onnx(fuse_skip_norms(quantized_static_proto(model, quantization)), path)


def make_fp32_trt(model: AttentionModel, path) -> object:
    return save_onnx(tensorrt_proto(model), path)


def make_fp16_trt(model: AttentionModel, path) -> object:
    from export.fp16 import to_fp16

    return save_onnx(to_fp16(tensorrt_proto(model), model.cfg), path)
