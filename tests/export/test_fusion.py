"""The fused variants: one `Attention` op per layer, past and present inside it, proven against
PyTorch (the build's ladder) and against the independent implementation on a config never seen."""

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from contract import files, names
from export import build, fusion
from export.__main__ import main as export_main
from export.choices import CPU, CUDA, variants_for
from export.graph_stats import fused_attention_count, op_histogram, opset_of
from export.onnx_export import config_from_onnx
from export.parity import TOLERANCES, Scenario, compare_rung
from serving.engine.ort import ort_runner, ort_session
from tests import reference
from tests.conftest import TEST_CONFIGS

FUSED = ("fp32-fused", "fp16-fused")


def load(directory, variant):
    return onnx.load(str(directory / files.model_filename(variant)))


@pytest.fixture(scope="module", params=["tiny", "gqa", "unseen"])
def built(request, artifact_dir):
    return TEST_CONFIGS[request.param], artifact_dir(request.param)


def test_the_fused_variants_are_registered_built_for_a_cuda_host_and_must_fuse():
    assert {"fp32", *FUSED} <= set(variants_for(CUDA)) and FUSED[0] in variants_for(CPU)
    assert all(build.VARIANTS[v].fused for v in FUSED) and not build.VARIANTS["fp32"].fused
    assert build.VARIANTS["fp16-fused"].float_dtype is np.float16


@pytest.mark.parametrize("variant", FUSED)
def test_one_attention_op_per_layer_holds_the_cache(built, variant):
    cfg, directory = built
    proto = load(directory, variant)
    attention = [n for n in proto.graph.node if n.op_type == "Attention"]
    assert fused_attention_count(proto) == len(attention) == cfg.n_layers
    assert opset_of(proto) == fusion.ATTENTION_OPSET
    # fp16-fused computes attention in fp32 between Casts (export/fp16.py): look through them
    cast_from = {n.output[0]: n.input[0] for n in proto.graph.node if n.op_type == "Cast"}
    cast_to = {n.input[0]: n.output[0] for n in proto.graph.node if n.op_type == "Cast"}
    for layer, node in enumerate(attention):
        past = [cast_from.get(name, name) for name in node.input[4:]]
        present = [cast_to.get(name, name) for name in node.output[1:]]
        assert past == [names.past_name(layer, k) for k in names.KV_KINDS]
        assert present == [names.present_name(layer, k) for k in names.KV_KINDS]
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attributes["q_num_heads"], attributes["kv_num_heads"]) == (cfg.n_heads, cfg.n_kv_heads)
        assert "is_causal" not in attributes  # the explicit mask carries causality and padding
    histogram = op_histogram(proto)
    for decomposed in ("Softmax", "Where", "Transpose", "Expand", "Concat", "Div"):
        assert decomposed not in histogram, f"{decomposed} left outside the fused op"


@pytest.mark.parametrize("variant", FUSED)
def test_report_records_the_histogram_the_fused_count_and_parity_on_the_fp32_ladder(built, variant):
    cfg, directory = built
    report = json.loads((directory / files.REPORT_FILENAME).read_text())
    entry = report["variants"][variant]
    assert entry["passed"] and entry["file"] == files.model_filename(variant)
    assert entry["fused_attention_ops"] == cfg.n_layers == entry["op_histogram"]["Attention"]
    assert set(entry["parity"]) == set(build.SCENARIOS)
    assert set(entry["worst"]) == set(names.output_names(cfg))  # every present, every step
    assert entry["tolerance"]["why"] == TOLERANCES[variant].why


def test_the_fused_graph_keeps_the_contract(built):
    cfg, directory = built
    proto = load(directory, "fp32-fused")
    onnx.checker.check_model(proto, full_check=True)
    assert config_from_onnx(proto) == cfg
    expected = {s.name: s.shape for s in [*names.input_specs(cfg), *names.output_specs(cfg)]}
    edges = [*proto.graph.input, *proto.graph.output]
    assert [v.name for v in edges] == [*names.input_names(cfg), *names.output_names(cfg)]
    for value in edges:
        assert tuple(d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim) == expected[value.name]
    assert not any(node.metadata_props for node in proto.graph.node), "exporter debug info is stripped"


def test_fusing_is_smaller_than_the_plain_graph(built):
    _, directory = built
    plain, fused = (len(load(directory, v).graph.node) for v in ("fp32", "fp32-fused"))
    assert fused < plain / 2


def unseen_steps(cfg, rng):
    """A left-padded prefill (rows padded by 0, 2 and 5 tokens) then 16 single-token steps."""
    B, prefill = 3, 6
    mask = np.ones((B, prefill), dtype=np.int64)
    mask[1, :2], mask[2, :5] = 0, 0
    hidden = rng.standard_normal((B, prefill, cfg.d_model))
    for _ in range(17):
        yield hidden, mask
        hidden = rng.standard_normal((B, 1, cfg.d_model))
        mask = np.concatenate([mask, np.ones((B, 1), dtype=np.int64)], axis=1)


@pytest.mark.parametrize(("variant", "bound"), [("fp32-fused", 1e-4), ("fp16-fused", 1e-2)])
def test_unseen_config_matches_the_independent_implementation(artifact_dir, variant, bound):
    """Done-when: fp32-fused within 1e-4 (absolute), fp16-fused within 1e-2 of the output scale, no
    NaN or Inf anywhere, over a left-padded prefill and 16 decode steps fed their own presents."""
    cfg, directory = TEST_CONFIGS["unseen"], artifact_dir("unseen")
    assert fused_attention_count(load(directory, variant)) == cfg.n_layers
    weights = reference.load_weights(directory / files.WEIGHTS_FILENAME)
    run, dtype = (
        ort_runner(ort_session(directory / files.model_filename(variant))),
        build.VARIANTS[variant].float_dtype,
    )
    past, worst_abs, worst_rel = None, 0.0, 0.0
    for hidden, mask in unseen_steps(cfg, np.random.default_rng(11)):
        feeds = {names.HIDDEN_STATES: hidden.astype(dtype), names.ATTENTION_MASK: mask}
        for i, pair in enumerate(past or ()):
            feeds.update({names.past_name(i, kind): array for kind, array in zip(names.KV_KINDS, pair, strict=True)})
        outputs = run(feeds)
        assert all(np.isfinite(array).all() for array in outputs.values()), "NaN or Inf in an output or present"
        expected, _ = reference.forward(cfg, weights, feeds[names.HIDDEN_STATES], mask, past)
        real = reference.real_rows(mask, hidden.shape[1])
        error = float(np.abs(outputs[names.OUTPUT][real].astype(np.float64) - expected[real]).max())
        worst_abs, worst_rel = max(worst_abs, error), max(worst_rel, error / float(np.abs(expected[real]).max()))
        past = [tuple(outputs[names.present_name(i, kind)] for kind in names.KV_KINDS) for i in range(cfg.n_layers)]
    print(f"unseen config, {variant} vs the independent implementation: max abs {worst_abs:.2e}, rel {worst_rel:.2e}")
    assert (worst_abs if variant == "fp32-fused" else worst_rel) <= bound


@pytest.mark.slow  # a whole build
def test_a_graph_without_the_pattern_is_left_alone_and_the_build_fails(tmp_path, capsys, monkeypatch):
    """A 'fused' variant with nothing fused fails the command and is not kept (docs/design.md,
    "Artifacts and variants")."""
    for rules in (fusion.ATTENTION_RULES, fusion.ATTENTION_4D_RULES):  # a graph neither rule knows
        monkeypatch.setattr(rules, "apply_to_model", lambda model: 0)
    assert export_main(["build", "--preset", "tiny", "--out", str(tmp_path), "--variants", "fp32-fused"]) == 1
    assert "0 fused attention ops for 2 layers" in capsys.readouterr().err
    assert not (tmp_path / files.model_filename("fp32-fused")).exists()


def test_tiling_kv_heads_is_not_mistaken_for_grouped_query_attention(artifact_dir):
    """Unsqueeze at axis 1 repeats the kv heads as a tile (head h reads h % n_kv): not what the op
    does, so the rule must refuse it."""
    model = ir.from_proto(load(artifact_dir("gqa"), "fp32"))
    for node in model.graph:
        if node.op_type == "Unsqueeze" and node.inputs[0].name.startswith("present."):
            node.replace_input_with(1, ir.Value(name=f"{node.name}_axis1", const_value=ir.tensor(np.array([1]))))
            model.graph.initializers[f"{node.name}_axis1"] = node.inputs[1]
    assert fusion.fuse(model).attention == 0


def test_qkv_projections_fuse_into_one_matmul_and_still_match(artifact_dir):
    directory = artifact_dir("gqa")
    cfg = TEST_CONFIGS["gqa"]
    proto, counts = fusion.fused_proto(load(directory, "fp32"), fuse_qkv=True)
    assert counts == fusion.FusionCounts(attention=cfg.n_layers, qkv=cfg.n_layers)
    assert op_histogram(proto)["MatMul"] == 2 * cfg.n_layers and op_histogram(proto)["Split"] == cfg.n_layers
    path = directory / "qkv.onnx"
    onnx.save(proto, str(path))
    shipped = ort_runner(ort_session(directory / files.model_filename("fp32-fused")))
    result = compare_rung(cfg, shipped, ort_runner(ort_session(path)), Scenario(steps=3), TOLERANCES["fp32-fused"])
    assert result.passed, result.to_dict()["tensors"]
