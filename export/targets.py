"""Does a graph fit the engine it is built for? Each GPU variant names a target; the build refuses
a variant whose graph does not fit it, as it refuses a "fused" graph without fused ops.

The op lists are the engines' own:

- `TENSORRT_OPS`: ONNX ops that TensorRT 10's parser imports (onnx-tensorrt `docs/operators.md` for
  TensorRT 10.15, "Y" rows), the ones an exported attention graph can contain. `Attention` is there
  since TensorRT 10.14, with one output only, no `past_key`/`past_value`, 4D Q, K, V and mask
  (the same file; `importAttention` in onnx-tensorrt `onnxOpImporters.cpp`; NVIDIA/TensorRT#4738).
  `RotaryEmbedding` and `RMSNormalization` (opset 23) since 10.15 (onnx-tensorrt's 10.15-GA release,
  PR #1048: "Added support for RotaryEmbedding, RMSNormalization and TensorScatter").
- `ORT_1_24_CUDA_KERNELS`: the CUDA kernels of ONNX Runtime 1.24.4, the runtime of NGC Triton 26.04's
  onnxruntime backend (server `build.py` on r26.04: ort_version 1.24.4), as (first, last) op versions,
  read from the kernel registrations of `libonnxruntime_providers_cuda.so` in the onnxruntime-gpu
  1.24.4 wheel. ONNX Runtime matches a node to a kernel by the node's schema since-version: an
  open-ended registration (last None) only when it starts exactly there, a closed one when it
  contains it (`VerifyKernelDef`, onnxruntime kernel_registry.cc). `Attention` has none in 1.24
  (onnxruntime#28025; its CUDA kernel came with PR #27542). A whole model's MLP activations (Sigmoid
  of SiLU, Tanh of GPT-2's tanh GELU, Erf of the exact GELU) were added from onnxruntime's sources
  (cuda/activations/activations.cc, cuda/math/unary_elementwise_ops.cc: versioned 6-12 (Erf 9-12) and
  13 on), not re-read from the 1.24.4 wheel; TensorRT's parser imports all three ("Y" rows).
"""

from __future__ import annotations

import onnx

from contract import names
from contract.config import ModelConfig
from export.forms import MICROSOFT_DOMAIN

STATIC = "onnxruntime static cache (CPU)"
STATIC_CUDA = "onnxruntime static cache (CUDA, fp16)"
TENSORRT = "TensorRT 10 parser"
ONNX_BACKEND = "forward_onnx: NGC 26.04 onnxruntime 1.24 CUDA and TensorRT 10"
TARGETS = (STATIC, STATIC_CUDA, TENSORRT, ONNX_BACKEND)

TENSORRT_OPS = frozenset(
    {
        "Add", "And", "Attention", "Cast", "Concat", "Constant", "ConstantOfShape", "Div", "Equal", "Erf",
        "Expand", "Gather", "Identity", "LayerNormalization", "Less", "LessOrEqual", "MatMul", "Mul", "Neg",
        "Not", "Pow", "Range", "ReduceMean", "Reshape", "RMSNormalization", "RotaryEmbedding", "Shape",
        "Sigmoid", "Slice", "Softmax", "Split", "Sqrt", "Squeeze", "Sub", "Tanh", "Transpose", "Trilu",
        "Unsqueeze", "Where",
    }
)  # fmt: skip

ORT_1_24_CUDA_KERNELS: dict[str, list[tuple[int, int | None]]] = {
    "Add": [(7, 12), (13, 13), (14, None)],
    "And": [(7, None)],
    "Cast": [(6, 8), (9, 12), (13, 18), (19, 20), (21, 22), (23, None)],
    "Concat": [(4, 10), (11, 12), (13, None)],
    "ConstantOfShape": [(9, None)],
    "Div": [(7, 12), (13, 13), (14, None)],
    "Equal": [(7, 10), (11, 12), (13, None)],
    "Erf": [(9, 12), (13, None)],
    "Expand": [(8, 12), (13, None)],
    "Gather": [(1, 10), (11, 12), (13, None)],
    "Identity": [(1, 12), (13, 13), (14, 18), (19, None)],
    "LayerNormalization": [(1, 16), (17, None)],
    "Less": [(7, 8), (9, 12), (13, None)],
    "LessOrEqual": [(12, 15), (16, None)],
    "MatMul": [(1, 8), (9, 12), (13, None)],
    "Mul": [(7, 12), (13, 13), (14, None)],
    "Neg": [(6, 12), (13, None)],
    "Not": [(1, None)],
    "Pow": [(7, 11), (12, 12), (13, 14), (15, None)],
    "Range": [(11, None)],
    "ReduceMean": [(1, 17), (18, None)],
    "Reshape": [(1, 4), (5, 12), (13, 13), (14, 18), (19, 20), (21, 22), (23, None)],
    "Shape": [(1, 12), (13, 14), (15, 18), (19, 20), (21, 22), (23, None)],
    "Sigmoid": [(6, 12), (13, None)],
    "Slice": [(1, 9), (10, 10), (11, 12), (13, None)],
    "Softmax": [(1, 10), (11, 12), (13, None)],
    "Split": [(2, 10), (11, 12), (13, 17), (18, None)],
    "Sqrt": [(6, 12), (13, None)],
    "Squeeze": [(1, 10), (11, 12), (13, 20), (21, 22), (23, None)],
    "Sub": [(7, 12), (13, 13), (14, None)],
    "Tanh": [(6, 12), (13, None)],
    "Transpose": [(1, 12), (13, 20), (21, 22), (23, None)],
    "Trilu": [(14, None)],
    "Unsqueeze": [(1, 10), (11, 12), (13, 20), (21, 22), (23, None)],
    "Where": [(9, 15), (16, None)],
}
# folded into initializers when a session loads: never a kernel of its own
_NO_KERNEL_NEEDED = frozenset({"Constant"})

_FLOAT16 = onnx.TensorProto.FLOAT16


def problems(target: str, proto: onnx.ModelProto, cfg: ModelConfig) -> list[str]:
    """What in `proto` keeps it from running whole on `target` (empty when it fits)."""
    checks = {
        STATIC: lambda: _static_problems(proto, cfg),
        STATIC_CUDA: lambda: _static_problems(proto, cfg) + _fp16_cache_problems(proto),
        TENSORRT: lambda: _tensorrt_problems(proto),
        ONNX_BACKEND: lambda: _tensorrt_problems(proto) + _ort_1_24_cuda_problems(proto),
    }
    return checks[target]()


def _domain(node: onnx.NodeProto) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


def _static_problems(proto: onnx.ModelProto, cfg: ModelConfig) -> list[str]:
    found = []
    gqa = [n for n in proto.graph.node if (_domain(n), n.op_type) == (MICROSOFT_DOMAIN, "GroupQueryAttention")]
    if len(gqa) != cfg.n_layers:
        found.append(f"{len(gqa)} GroupQueryAttention ops for {cfg.n_layers} layers")
    for node in gqa:
        layer = [
            names.past_name(i, k)
            for i in range(cfg.n_layers)
            for k in names.KV_KINDS
            if names.past_name(i, k) in node.input
        ]
        present = [name for name in node.output[1:3] if name.startswith("present.")]
        if len(layer) != 2 or len(present) != 2:
            found.append(f"{node.name}: its past and present are not graph inputs and outputs")
            continue
        found += _gqa_attribute_problems(node, cfg, int(present[0].split(".")[1]))
        found += _quantized_cache_problems(proto, node, int(present[0].split(".")[1]))
    expected = [spec.name for spec in names.static_input_specs(cfg)]
    actual = [value.name for value in proto.graph.input]
    if actual != expected:
        found.append(f"graph inputs {actual}, expected {expected}")
    pasts = set(names.past_names(cfg.n_layers))
    leftover = [
        n.op_type
        for n in proto.graph.node
        if n.op_type in ("Attention", "Softmax", "RotaryEmbedding") or (n.op_type == "Concat" and pasts & set(n.input))
    ]
    if leftover:
        found.append(f"attention left outside GroupQueryAttention: {sorted(set(leftover))}")
    return found


def _gqa_attribute_problems(node: onnx.NodeProto, cfg: ModelConfig, layer: int) -> list[str]:
    """The op rotates q and k when the model does, and attends through the layer's window."""
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    found = []
    if attributes.get("do_rotary", 0) != int(cfg.rotary):
        found.append(
            f"layer {layer}: GroupQueryAttention do_rotary={attributes.get('do_rotary', 0)}, the model "
            f"{'rotates' if cfg.rotary else 'does not rotate'} q and k"
        )
    if attributes.get("local_window_size", -1) != (cfg.window(layer) or -1):
        found.append(
            f"layer {layer}: GroupQueryAttention local_window_size={attributes.get('local_window_size', -1)}, "
            f"the layer's window is {cfg.window(layer)}"
        )
    return found


# a static cache's element type -> GroupQueryAttention's kv_cache_bit_width for it (0: not quantized)
_CACHE_BITS = {
    onnx.TensorProto.FLOAT: 0,
    onnx.TensorProto.FLOAT16: 0,
    onnx.TensorProto.INT8: names.CACHE_BITS[names.INT8_CACHE],
    onnx.TensorProto.UINT8: names.CACHE_BITS[names.INT4_CACHE],
}


def _quantized_cache_problems(proto: onnx.ModelProto, node: onnx.NodeProto, layer: int) -> list[str]:
    """A quantized cache (export/kv_quant.py) is one the op quantizes: int8 codes at 8 bits, or int4
    codes two a byte (uint8, head_dim / 2 wide) at 4, with the layer's scales as initializers."""
    types = {v.name: v.type.tensor_type for v in proto.graph.input}
    caches = [types[name] for name in node.input[3:5]]
    element = caches[0].elem_type
    if element not in _CACHE_BITS or any(cache.elem_type != element for cache in caches):
        return [f"layer {layer}: caches of {[onnx.TensorProto.DataType.Name(c.elem_type) for c in caches]}"]
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    bits = attributes.get("kv_cache_bit_width", 0) if attributes.get("k_quant_type", b"NONE") != b"NONE" else 0
    if bits != _CACHE_BITS[element]:
        kind = onnx.TensorProto.DataType.Name(element)
        return [f"layer {layer}: a {kind} cache with GroupQueryAttention quantizing to {bits or 'no'} bits"]
    if not bits:
        return []
    initializers = {i.name for i in proto.graph.initializer}
    scales = list(node.input[12:14])
    wanted = [names.cache_scale_name(layer, kind) for kind in names.KV_KINDS]
    if scales != wanted or not set(wanted) <= initializers:
        return [f"layer {layer}: GroupQueryAttention's k_scale, v_scale are {scales}, expected initializers {wanted}"]
    return []


def _fp16_cache_problems(proto: onnx.ModelProto) -> list[str]:
    """GroupQueryAttention's CUDA kernels take fp16 or bf16 only."""
    caches = [v for v in proto.graph.input if v.name.startswith("past_key_values.")]
    wrong = [v.name for v in caches if v.type.tensor_type.elem_type != _FLOAT16]
    return [f"caches not fp16 (CUDA GroupQueryAttention): {wrong}"] if wrong else []


def _tensorrt_problems(proto: onnx.ModelProto) -> list[str]:
    found = []
    for node in proto.graph.node:
        if _domain(node) or node.op_type not in TENSORRT_OPS:
            found.append(f"{node.op_type} ({_domain(node) or 'ai.onnx'}) is not an op TensorRT's parser imports")
        elif node.op_type == "Attention":
            if len([o for o in node.output if o]) != 1:
                found.append(f"{node.name}: TensorRT imports Attention with one output only")
            if len([i for i in node.input if i]) > 4:
                found.append(f"{node.name}: TensorRT imports Attention without past_key/past_value")
    return found


def _ort_1_24_cuda_problems(proto: onnx.ModelProto) -> list[str]:
    """`forward_onnx` must run whole on the GPU with or without TensorRT: every node needs a CUDA kernel in
    ONNX Runtime 1.24 for its op version (a node without one runs on the CPU, with copies each way)."""
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    found = set()
    for node in proto.graph.node:
        if node.op_type in _NO_KERNEL_NEEDED:
            continue
        if _domain(node):
            found.add(f"{node.op_type} ({node.domain}): a contrib op, not an ai.onnx kernel forward_onnx may use")
            continue
        version = onnx.defs.get_schema(node.op_type, opset).since_version
        if not has_kernel(ORT_1_24_CUDA_KERNELS.get(node.op_type, []), version):
            found.add(f"{node.op_type}-{version} (opset {opset}) has no CUDA kernel in onnxruntime 1.24")
    return sorted(found)


def has_kernel(registrations: list[tuple[int, int | None]], since_version: int) -> bool:
    """ONNX Runtime's rule: an open-ended registration matches its first version only."""
    return any(
        first == since_version or (last is not None and first <= since_version <= last) for first, last in registrations
    )
