"""The fp32-fused-int8w variant: int8 projection weights quantized by ONNX Runtime's own tool, inputs
quantized per row, one fused attention op per layer still, a smaller file, a bound that follows the int8
precision floor and still rejects a graph whose weights lost more precision (4 bits); and for both
quantized widths, a row's answer that does not depend on the rows batched beside it."""

import copy

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from contract import names
from export import graph_stats
from export.build import SCENARIOS, VARIANTS, check_variant
from export.fusion import make_fp32_fused
from export.model import AttentionModel
from export.parity import compare_rung
from export.progress import Progress
from export.runners import torch_runner
from export.weights_blockwise import PROJECTIONS, projection_matmuls
from export.weights_int4 import make_fp32_fused_int4w
from export.weights_int8 import (
    INT8_WEIGHTS_FLOOR_FACTOR,
    INT8_WEIGHTS_TOLERANCE,
    NAME,
    fake_quantize_activation,
    fake_quantize_weight,
    int8_weights_floor,
    make_fp32_fused_int8w,
    per_row_activations,
    quantize_projections,
)
from serving.engine.ort import ort_runner, ort_session
from tests.conftest import TEST_CONFIGS

CONFIG = "gqa"  # 256 wide: the weights outweigh the graph's structure, so the file size shows them


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """The PyTorch original, its int8w graph and its fp32-fused graph (made right after: one export)."""
    model = AttentionModel(TEST_CONFIGS[CONFIG], seed=0).eval()
    folder = tmp_path_factory.mktemp("int8w")
    int8w = make_fp32_fused_int8w(model, folder / "int8w.onnx")
    return model, int8w, make_fp32_fused(model, folder / "fused.onnx")


def rungs(model, path, floor, scenarios=tuple(SCENARIOS)) -> dict:
    """The ladder scenarios of export/build.py, driven beside `floor` (the int8 floor)."""
    candidate = ort_runner(ort_session(path))
    return {
        name: compare_rung(
            model.cfg, torch_runner(model), candidate, SCENARIOS[name], INT8_WEIGHTS_TOLERANCE, floor=floor
        )
        for name in scenarios
    }


def floor_ratio(results: dict) -> float:
    """The graph's largest error over its floor's, worst tensor of all scenarios."""
    return max(e.max_abs / e.floor_abs for result in results.values() for e in result.tensors.values())


def with_projections(model: AttentionModel, change) -> AttentionModel:
    """`model` with every projection weight changed (nn.Linear's, (out, in))."""
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for layer in changed.layers:
            for name in PROJECTIONS:
                weight = getattr(layer.attn, name).weight
                weight.copy_(change(weight))
    return changed


def quantized_with_projections(fused, cfg, change, path):
    """The int8w graph of the fp32-fused graph at `fused` with every projection weight changed (given
    as nn.Linear's (out, in); the graph holds it transposed): no second export."""
    proto = onnx.load(str(fused))
    weights = {
        proto.graph.node[i].input[1] for i, n in enumerate(proto.graph.node) if n.name in projection_matmuls(proto)
    }
    for tensor in proto.graph.initializer:
        if tensor.name in weights:
            changed = change(torch.from_numpy(numpy_helper.to_array(tensor).T.copy())).numpy().T
            tensor.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(changed), tensor.name))
    return quantize_projections(proto, cfg, path)


@pytest.mark.slow  # exports and checks variants of its own: seconds each
def test_the_variant_passes_its_rung(graphs):
    model, int8w, _ = graphs
    entry = check_variant(model, int8w, VARIANTS[NAME], Progress(enabled=False))
    worst = max(entry["worst"].values(), key=lambda error: error["max_rel"])
    print(f"{CONFIG}: worst {worst['name']} {worst['max_rel']:.2e} of its scale (bound {INT8_WEIGHTS_TOLERANCE.scale})")
    assert entry["passed"], entry["problems"]
    assert 1e-3 < worst["max_rel"] < INT8_WEIGHTS_TOLERANCE.scale  # quantized: not fp32's 1e-6


@pytest.mark.slow
def test_the_projections_hold_int8_weights_and_attention_stays_one_fused_op_per_layer(graphs):
    model, int8w, fused = graphs
    proto, n_layers = onnx.load(str(int8w)), model.cfg.n_layers
    assert graph_stats.op_count(proto, "MatMulInteger") == len(PROJECTIONS) * n_layers
    assert graph_stats.op_count(proto, "MatMul") == 0  # no projection left in fp32
    int8_weights = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 2]
    assert len(int8_weights) == len(PROJECTIONS) * n_layers
    assert graph_stats.fused_attention_count(proto) == n_layers
    attention_inputs = {name for node in proto.graph.node if node.op_type == "Attention" for name in node.input}
    quantized = {out for node in proto.graph.node if node.op_type == "Cast" for out in node.output}
    assert not attention_inputs & quantized  # attention itself reads fp32
    assert graph_stats.op_count(proto, "DynamicQuantizeLinear") == 0  # no input quantized per tensor
    added = graph_stats.op_histogram(proto).keys() - graph_stats.op_histogram(onnx.load(str(fused))).keys()
    per_row = {"Abs", "ReduceMax", "Max", "Div", "Round", "Identity"}
    assert added <= {"MatMulInteger", "Cast", "Mul", "Add", *per_row}, added  # the projections' only


@pytest.mark.slow
def test_the_weights_are_what_the_floor_quantizes(graphs):
    """The tool's int8 codes times their scales are the floor's weights: per output channel, symmetric."""
    model, int8w, _ = graphs
    initializers = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(int8w)).graph.initializer}
    floor_weights = [
        fake_quantize_weight(getattr(layer.attn, name).weight.detach().double()).numpy().T  # (in, out) as MatMul's
        for layer in model.layers
        for name in PROJECTIONS
    ]
    dequantized = [
        codes.astype(np.float64) * initializers[name.removesuffix("_quantized") + "_scale"]
        for name, codes in initializers.items()
        if codes.dtype == np.int8 and codes.ndim == 2
    ]
    for weight in floor_weights:  # each graph weight matches one floor weight of its shape
        assert any(w.shape == weight.shape and np.allclose(w, weight, rtol=1e-6, atol=0) for w in dequantized)


@pytest.mark.slow
def test_the_file_is_under_a_third_of_fp32_fused(graphs):
    _, int8w, fused = graphs
    sizes = {"int8w": int8w.stat().st_size, "fp32-fused": fused.stat().st_size}
    print(sizes)
    assert sizes["int8w"] <= 0.33 * sizes["fp32-fused"], sizes


@pytest.mark.slow
def test_the_graph_is_its_precision_floor(graphs):
    """Driven beside the int8 floor: within the floor factor everywhere, and in fact within 1.2x."""
    model, int8w, _ = graphs
    results = rungs(model, int8w, int8_weights_floor(model))
    print(f"{CONFIG}: graph / floor {floor_ratio(results):.2f}")
    assert all(result.passed for result in results.values())
    assert floor_ratio(results) < 1.2 < INT8_WEIGHTS_FLOOR_FACTOR


@pytest.mark.slow
def test_trained_scale_weights_pass_by_the_floor_alone(graphs, tmp_path):
    """Projections 4x our init: attention amplifies the quantization of q and k past the fixed bound;
    the floor (what the scheme costs the original itself) is as far off, and the graph within it."""
    model, _, fused = graphs
    scaled = with_projections(model, lambda weight: 4 * weight)
    path = quantized_with_projections(fused, model.cfg, lambda weight: 4 * weight, tmp_path / "x4.onnx")
    results = rungs(scaled, path, int8_weights_floor(scaled), scenarios=("with_past",))  # the shorter one
    output = results["with_past"].tensors[names.OUTPUT]
    print(f"{CONFIG} x4: output {output.max_rel:.2e} of its scale, floor {output.floor_rel:.2e}")
    assert output.max_rel > INT8_WEIGHTS_TOLERANCE.scale  # beyond the fixed bound
    assert all(result.passed for result in results.values()) and floor_ratio(results) < 1.2


@pytest.mark.slow
def test_weights_in_4_bits_are_rejected(graphs, tmp_path):
    """The graph made from weights rounded to 4 bits (7 levels a side, per channel): the fixed bound
    fails it in the build's rung, and the floor factor by far."""
    model, _, fused = graphs
    four_bits = quantized_with_projections(
        fused, model.cfg, lambda weight: fake_quantize_weight(weight, levels=7), tmp_path / "4bit.onnx"
    )
    entry = check_variant(model, four_bits, VARIANTS[NAME], Progress(enabled=False))
    assert not entry["passed"] and "parity failed" in entry["problems"][0]
    results = rungs(model, four_bits, int8_weights_floor(model), scenarios=("with_past",))
    print(f"{CONFIG} in 4 bits: graph / floor {floor_ratio(results):.1f}")
    assert not any(result.passed for result in results.values())
    assert floor_ratio(results) > 4 * INT8_WEIGHTS_FLOOR_FACTOR


def test_the_floor_quantizes_activations_as_the_graph_does_per_row():
    """The graph's per-row quantization (`per_row_activations` in place of a DynamicQuantizeLinear), run by
    ONNX Runtime and dequantized from its codes and row scales, against the floor's fake quantization: rows of
    normal values, an all-positive row, a wide one and an all-zero one (zeros, not 0 / 0)."""
    from onnxruntime import InferenceSession

    graph = helper.make_graph(
        [helper.make_node("DynamicQuantizeLinear", ["x"], ["codes", "scale", "zero"], name="quantize")],
        "quantize_rows",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, None])],
        [
            helper.make_tensor_value_info("codes", onnx.TensorProto.UINT8, [None, None]),
            helper.make_tensor_value_info("scale", onnx.TensorProto.FLOAT, [None, 1]),
        ],
    )
    proto = per_row_activations(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10))
    session = InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    rows = np.stack([rng.standard_normal(256), 0.5 + rng.random(256), 100 * rng.standard_normal(256), np.zeros(256)])
    x = rows.astype(np.float32)
    codes, scale = session.run(["codes", "scale"], {"x": x})
    dequantized = (codes.astype(np.float64) - 128) * scale
    actual = fake_quantize_activation(torch.from_numpy(x).double()).numpy()
    for row in range(len(x)):  # each row's own steps: fp32's rounding of the scale, far below a step
        assert np.abs(actual[row] - dequantized[row]).max() <= 1e-6 * max(np.abs(x[row]).max(), 1e-30), row
    assert np.all(dequantized[3] == 0) and codes.min() >= 1  # zeros stay zeros; codes 1..255 around 128


@pytest.mark.parametrize("bits", [8, 4])
def test_a_rows_answer_does_not_depend_on_its_batchmates(graphs, bits, tmp_path):
    """Row 0 alone and beside a row 1000x larger: the same answer to fp32's rounding. Inputs quantized per
    row (int8: this module's graph; int4: MatMulNBits' blocks); DynamicQuantizeLinear's one scale per tensor
    rounded row 0 by its batchmate's range, so a session's answer depended on the sessions batched with it."""
    model, int8w, _ = graphs
    session = ort_session(int8w if bits == 8 else make_fp32_fused_int4w(model, tmp_path / "int4w.onnx"))
    rng = np.random.default_rng(0)
    cfg, positions = model.cfg, 5
    alone = {names.HIDDEN_STATES: rng.standard_normal((1, 3, cfg.d_model), np.float32)}
    alone[names.ATTENTION_MASK] = np.ones((1, positions + 3), np.int64)
    for name in names.past_names(cfg.n_layers):
        alone[name] = rng.standard_normal((1, cfg.n_kv_heads, positions, cfg.head_dim), np.float32)
    beside = {
        name: 1000 * rng.standard_normal(a.shape, np.float32) if a.dtype == np.float32 else a
        for name, a in alone.items()
    }
    batched = {name: np.concatenate([a, beside[name]]) for name, a in alone.items()}
    one, both = session.run(None, alone), session.run(None, batched)
    for output, a, b in zip(session.get_outputs(), one, both, strict=True):
        assert np.abs(b[:1] - a).max() <= 1e-5 * np.abs(a).max(), output.name
