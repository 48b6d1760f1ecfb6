"""The fp16-fused variant: fp16 at the edges and in the cache, the sensitive parts kept safe, no
overflow at activations of magnitude 1e3, half the bytes; within its tolerance for weights of a
trained model's scale (up to 4x our init), where the precision floor sets the bound."""

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from contract import files, names
from contract.config import ModelConfig
from export import artifacts
from export.build import VARIANTS, check_variant
from export.fp16 import FP16Error, attention_needs_fp32, check_fp16
from export.model import AttentionModel
from export.parity import TOLERANCES, Scenario, compare_rung
from export.progress import Progress
from export.runners import rounded_runner, torch_runner
from serving.engine.ort import ort_runner, ort_session
from tests.conftest import TEST_CONFIGS


def load(directory, variant):
    return onnx.load(str(directory / files.model_filename(variant)))


@pytest.fixture(scope="module", params=["gqa", "unseen"])
def built(request, artifact_dir):
    return TEST_CONFIGS[request.param], artifact_dir(request.param)


def test_inputs_outputs_and_cache_are_fp16_the_mask_int64(built):
    cfg, directory = built
    proto = load(directory, "fp16-fused")
    types = {v.name: v.type.tensor_type.elem_type for v in [*proto.graph.input, *proto.graph.output]}
    assert types.pop(names.ATTENTION_MASK) == onnx.TensorProto.INT64
    assert set(types.values()) == {onnx.TensorProto.FLOAT16}
    assert set(types) >= {*names.past_names(cfg.n_layers), *names.present_names(cfg.n_layers), names.OUTPUT}


def test_the_sensitive_parts_stay_safe(built):
    cfg, directory = built
    proto = load(directory, "fp16-fused")
    check_fp16(proto)  # LayerNorm statistics in fp32, finite constants, no fp32 at the edges
    assert not attention_needs_fp32(cfg)  # a norm before attention: the scores stay in fp16's range
    for node in proto.graph.node:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Attention":
            assert attributes["softmax_precision"] == onnx.TensorProto.FLOAT
        if node.op_type == "LayerNormalization":
            assert attributes.get("stash_type", 1) == onnx.TensorProto.FLOAT
    weights = [t for t in proto.graph.initializer if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)]
    assert {t.data_type for t in weights} == {onnx.TensorProto.FLOAT16}
    assert all(np.isfinite(numpy_helper.to_array(t)).all() for t in weights)


def test_file_is_at_most_055_of_fp32_fused(built):
    """The tiny preset is left out: at 32 wide its weights weigh less than the graph structure."""
    _, directory = built
    sizes = {v: (directory / files.model_filename(v)).stat().st_size for v in ("fp32-fused", "fp16-fused")}
    assert sizes["fp16-fused"] <= 0.55 * sizes["fp32-fused"], sizes


def test_no_overflow_with_activations_of_magnitude_1e3(built):
    cfg, directory = built
    model = artifacts.load_model(directory)
    candidate = ort_runner(ort_session(directory / files.model_filename("fp16-fused")))
    scenario = Scenario(batch=3, prefill=7, steps=8, padding=(0, 2, 5), scale=1e3, seed=4)
    result = compare_rung(
        cfg, torch_runner(model), candidate, scenario, TOLERANCES["fp16-fused"], cast=lambda a: a.astype(np.float16)
    )
    worst = result.tensors[names.OUTPUT]
    print(f"{cfg}: fp16 at |x| ~ 1e3: output max abs {worst.max_abs:.2e}, {worst.max_rel:.2e} of its scale")
    assert all(error.finite for error in result.tensors.values())
    assert result.passed, result.to_dict()["tensors"]


@pytest.mark.parametrize("variant", ["fp32-fused", "fp16-fused"])
def test_a_row_of_padding_only_gives_finite_numbers(artifact_dir, variant):
    """Every query of row 0 is padding: nothing to attend (docs/design.md, "Model math": unspecified but finite)."""
    cfg, directory = TEST_CONFIGS["unseen"], artifact_dir("unseen")
    run = ort_runner(ort_session(directory / files.model_filename(variant)))
    dtype = np.float16 if variant == "fp16-fused" else np.float32
    mask = np.ones((2, 5), dtype=np.int64)
    mask[0] = 0
    hidden = np.random.default_rng(0).standard_normal((2, 5, cfg.d_model)).astype(dtype)
    outputs = run({names.HIDDEN_STATES: hidden, names.ATTENTION_MASK: mask})
    assert all(np.isfinite(array).all() for array in outputs.values())


def test_unsafe_graphs_are_refused(artifact_dir):
    directory = artifact_dir("gqa")
    with pytest.raises(FP16Error, match="inputs/outputs still fp32"):
        check_fp16(load(directory, "fp32-fused"))
    proto = load(directory, "fp16-fused")
    bias = next(t for t in proto.graph.initializer if t.name.endswith("norm.bias"))
    bias.CopyFrom(numpy_helper.from_array(np.full(numpy_helper.to_array(bias).shape, np.inf, np.float16), bias.name))
    with pytest.raises(FP16Error, match="is not finite in fp16"):
        check_fp16(proto)


def test_bare_attention_fed_fp16_is_refused_and_the_normed_one_keeps_its_fp16_cache(artifact_dir, tmp_path):
    """The converter alone leaves Attention in fp16: refused where no norm bounds its scores. With
    LayerNorm before it, the node reads the fp16 cache as it is (casting it would convert the whole
    cache every step)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from export.fusion import fused_proto
    from export.onnx_export import plain_graph

    bare, _ = fused_proto(plain_graph(AttentionModel(SCALED_BLOCKS["bare"], seed=0).eval()))
    with pytest.raises(FP16Error, match="attention scores would be computed in fp16"):
        check_fp16(convert_float_to_float16(bare, keep_io_types=False))
    normed = load(artifact_dir("gqa"), "fp16-fused")
    check_fp16(normed)
    assert past_inputs_of_attention(normed) == {n.name for n in normed.graph.input if n.name.startswith("past")}
    path = VARIANTS["fp16-fused"].make(AttentionModel(SCALED_BLOCKS["bare"], seed=0).eval(), tmp_path / "bare.onnx")
    fp16_bare = onnx.load(str(path))
    check_fp16(fp16_bare)
    assert not past_inputs_of_attention(fp16_bare) & {n.name for n in fp16_bare.graph.input}  # widened first


def past_inputs_of_attention(proto: onnx.ModelProto) -> set[str]:
    return {name for node in proto.graph.node if node.op_type == "Attention" for name in node.input[4:6]}


# --- weights of a trained model's scale ---------------------------------------------------------------

# A pre-norm residual stack, and bare attention as the importers bring it (torch.nn.MultiheadAttention)
SCALED_BLOCKS = {
    "pre-norm-residual": ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=64),
    "bare": ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, n_layers=1, max_seq_len=64, norm="none", residual=False),
}


def scaled(cfg: ModelConfig, factor: float) -> AttentionModel:
    """Our init with the projections (weights and biases) `factor` times larger: their outputs no longer
    unit-variance, as training leaves them; LayerNorm gains stay near 1."""
    model = AttentionModel(cfg, seed=0).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".attn." in name:
                parameter.mul_(factor)
    return model


@pytest.mark.slow  # builds and checks variants of its own: seconds each
@pytest.mark.parametrize("factor", [1.0, 4.0])  # our init and the largest: what lies between passes if these do
@pytest.mark.parametrize("block", list(SCALED_BLOCKS))
def test_fp16_passes_with_weights_up_to_4x_our_init(tmp_path, block, factor):
    model = scaled(SCALED_BLOCKS[block], factor)
    variants = ["fp16-fused", "fp16-static"] if factor == 4.0 else ["fp16-fused"]
    for name in variants:
        path = VARIANTS[name].make(model, tmp_path / f"{name}.onnx")
        entry = check_variant(model, path, VARIANTS[name], Progress(enabled=False))
        output = entry["worst"][names.OUTPUT]
        print(f"{block} x{factor} {name}: output {output['max_rel']:.2e} of its scale, floor {output['floor_abs']:.2e}")
        assert entry["passed"], entry["problems"]


@pytest.mark.slow  # builds and checks variants of its own: seconds each
def test_the_floor_is_what_fp16_costs_the_original_itself():
    """Rounding only the weights, inputs, caches and outputs: less error than the graph, more than none,
    and it grows with the weights' scale (the softmax amplifies the rounding of q and k)."""
    errors = []
    for factor in (1.0, 4.0):
        cfg, model = SCALED_BLOCKS["pre-norm-residual"], scaled(SCALED_BLOCKS["pre-norm-residual"], factor)
        scenario = Scenario(steps=4)
        result = compare_rung(
            cfg, torch_runner(model), rounded_runner(model), scenario, TOLERANCES["fp16-fused"], cast=np.float16
        )
        errors.append(result.tensors[names.OUTPUT].max_rel)
    assert 1e-4 < errors[0] < 2e-3 < errors[1], errors


@pytest.mark.slow  # builds and checks variants of its own: seconds each
def test_a_wrong_weight_in_an_fp16_graph_still_fails(tmp_path):
    """The floor widens the bound only as far as rounding reaches: a slip in the graph shows through."""
    model = scaled(SCALED_BLOCKS["pre-norm-residual"], 1.0)
    path = VARIANTS["fp16-fused"].make(model, tmp_path / "broken.onnx")
    proto = onnx.load(str(path))  # the slip made in the graph: no export of a second model
    w_v = model.layers[0].attn.W_v.weight.detach().numpy().T.astype(np.float16)  # the graph holds (in, out)
    (weight,) = [t for t in proto.graph.initializer if np.array_equal(numpy_helper.to_array(t), w_v)]
    wrong = numpy_helper.to_array(weight).copy()
    wrong[:, 0] *= 1.05  # W_v.weight[0] (its first output channel) 5% off
    weight.CopyFrom(numpy_helper.from_array(wrong, weight.name))
    onnx.save(proto, str(path))
    entry = check_variant(model, path, VARIANTS["fp16-fused"], Progress(enabled=False))
    assert not entry["passed"] and "parity failed" in entry["problems"][0]


@pytest.mark.slow  # builds and checks variants of its own: seconds each
def test_no_overflow_in_the_scores_of_a_bare_module_with_trained_weights(tmp_path):
    """Bare attention (no norm) with projections 4x our init on hidden states of magnitude 100: scores
    beyond fp16's 65504. Computed in fp16 they were inf and the output NaN; in fp32 the output is as
    close as the precision floor allows."""
    cfg, model = SCALED_BLOCKS["bare"], scaled(SCALED_BLOCKS["bare"], 4.0)
    path = VARIANTS["fp16-fused"].make(model, tmp_path / "fp16-fused.onnx")
    scenario = Scenario(steps=8, scale=100.0, seed=4)
    result = compare_rung(
        cfg, torch_runner(model), ort_runner(ort_session(path)), scenario, TOLERANCES["fp16-fused"],
        cast=np.float16, floor=rounded_runner(model),
    )  # fmt: skip
    output = result.tensors[names.OUTPUT]
    print(f"bare x4 at |x| ~ 100: output {output.max_rel:.2e} of its scale, floor {output.floor_rel:.2e}")
    assert all(error.finite for error in result.tensors.values())
    assert result.passed, result.to_dict()["tensors"]
