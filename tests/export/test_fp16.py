"""The fp16-fused variant: fp16 at the edges and in the cache, the sensitive parts kept safe, no
overflow at activations of magnitude 1e3, half the bytes."""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from contract import files, names
from export import artifacts
from export.fp16 import FP16Error, check_fp16
from export.parity import TOLERANCES, Scenario, compare_rung
from export.runtime import ort_runner, ort_session, torch_runner
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
    _, directory = built
    proto = load(directory, "fp16-fused")
    check_fp16(proto)  # LayerNorm statistics in fp32, finite constants, no fp32 at the edges
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
    """Every query of row 0 is padding: nothing to attend (DESIGN 3.1: unspecified but finite)."""
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
