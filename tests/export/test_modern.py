"""The modern block's variants: every form built for rotary, RMSNorm, q/k-norm and windowed models,
each proven against the PyTorch original by the build's ladder (report.json), each showing the fused
ops that make it what it says: RotaryEmbedding and RMSNormalization in the fused and TensorRT forms,
GroupQueryAttention rotating q and k and attending through each layer's window in the static form."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from contract import files, names
from export import build, fusion
from export.graph_stats import RMS_NORM_OP, ROTARY_OP, SKIP_RMS_NORM, op_count
from export.model import AttentionModel
from export.norm_rotary_fusion import fuse_norms_and_rotations
from export.onnx_export import plain_graph
from serving.engine.ort import ort_runner, ort_session
from tests import reference
from tests.conftest import TEST_CONFIGS
from tests.fixtures.builds import FULL_VARIANTS

MODERN = ("rotary", "rotary-partial")


@pytest.fixture(scope="module", params=MODERN)
def built(request, artifact_dir):
    return TEST_CONFIGS[request.param], artifact_dir(request.param)


def load(directory, variant):
    return onnx.load(str(directory / files.model_filename(variant)))


def test_every_variant_is_built_and_passes(built):
    _, directory = built
    report = json.loads((directory / files.REPORT_FILENAME).read_text())
    assert report["passed"] and set(report["variants"]) == set(FULL_VARIANTS)
    for name, entry in report["variants"].items():
        assert entry["passed"] and (directory / entry["file"]).is_file(), (name, entry["problems"])


@pytest.mark.parametrize("variant", ["fp32-fused", "fp16-fused", "fp32-trt", "fp16-trt"])
def test_the_fused_forms_rotate_and_normalize_in_one_op_each(built, variant):
    cfg, directory = built
    proto = load(directory, variant)
    norms = (cfg.norm == "rmsnorm") + 2 * (cfg.qk_norm == "rmsnorm")
    assert op_count(proto, ROTARY_OP) == 2 * cfg.n_layers  # q and k of every layer
    # ONNX Runtime's fp32 form folds each residual Add into the norm after it: every layer's but the first
    skipped = cfg.n_layers - 1 if variant == "fp32-fused" else 0
    assert op_count(proto, *SKIP_RMS_NORM) == skipped
    assert op_count(proto, RMS_NORM_OP) == norms * cfg.n_layers - skipped
    for node in proto.graph.node:
        if node.op_type == ROTARY_OP:
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attributes.get("interleaved", 0) == int(cfg.rope_pairing == "interleaved")
            assert attributes.get("rotary_embedding_dim", 0) == (cfg.rotary_dim or 0)
            assert node.input[3] == names.POSITION_IDS  # the angles are read at the graph's positions


@pytest.mark.parametrize("variant", ["fp32-static", "fp16-static"])
def test_the_static_form_rotates_inside_group_query_attention_through_each_window(built, variant):
    cfg, directory = built
    proto = load(directory, variant)
    assert op_count(proto, ROTARY_OP) == 0 and names.POSITION_IDS not in [v.name for v in proto.graph.input]
    layers = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(layers) == cfg.n_layers
    for layer, node in enumerate(layers):
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["do_rotary"] == 1
        assert attributes.get("rotary_interleaved", 0) == int(cfg.rope_pairing == "interleaved")
        assert attributes.get("local_window_size", -1) == (cfg.window(layer) or -1)
        cos_cache = next(t for t in proto.graph.initializer if t.name == node.input[7])
        # the model's table, one row past max_seq_len for the pool's scratch position
        assert list(cos_cache.dims) == [cfg.max_seq_len + 1, cfg.rotated_width // 2]


def test_the_fused_graph_matches_the_independent_reference_with_given_positions(built):
    cfg, directory = built
    run = ort_runner(ort_session(directory / files.model_filename("fp32-fused")))
    weights = reference.load_weights(directory / files.WEIGHTS_FILENAME)
    rng = np.random.default_rng(4)
    hidden = rng.standard_normal((2, 5, cfg.d_model)).astype(np.float32)
    positions = np.array([[0, 1, 2, 3, 4], [40, 41, 42, 43, 44]])  # the second row well into its context
    got = run({names.HIDDEN_STATES: hidden, names.POSITION_IDS: positions})
    expected, _ = reference.forward(cfg, weights, hidden, positions=positions)
    np.testing.assert_allclose(got[names.OUTPUT], expected, atol=1e-5, rtol=1e-5)


def test_a_rotation_the_rule_does_not_know_is_left_alone_and_the_build_says_so():
    """The halves split along another axis: not a rotation of the last axis, so nothing is fused, and
    the build's check names the missing ops instead of shipping an unfused "fused" graph."""
    cfg = TEST_CONFIGS["rotary"]
    model = ir.from_proto(plain_graph(AttentionModel(cfg).eval()))
    for node in model.graph:
        if node.op_type == "Split":
            node.attributes["axis"] = ir.AttrInt64("axis", 1)
    _, rotations = fuse_norms_and_rotations(model)
    assert rotations == 0
    proto = ir.to_proto(model)
    shortfalls = build.fusion_shortfalls(cfg, proto)
    assert f"0 {ROTARY_OP} ops for {cfg.n_layers} layers (expected {2 * cfg.n_layers})" in shortfalls
    assert any("fused attention ops" in s for s in shortfalls)  # nothing was fused here


def test_the_plain_graph_takes_positions_named_as_the_table_says():
    cfg = TEST_CONFIGS["rotary"]
    proto = plain_graph(AttentionModel(cfg).eval())
    inputs = [v.name for v in proto.graph.input]
    assert inputs == names.input_names(cfg)
    position_ids = proto.graph.input[inputs.index(names.POSITION_IDS)]
    assert [d.dim_param for d in position_ids.type.tensor_type.shape.dim] == [names.BATCH, names.SEQUENCE]
    assert position_ids.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert fusion.ATTENTION_OPSET == 23
