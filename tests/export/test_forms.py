"""The GPU forms: the static cache (GroupQueryAttention over a shared buffer) and the TensorRT form
(Concat outside, a single-output 4D Attention); each built, fitted to its target and climbed."""

from __future__ import annotations

import json

import onnx
import pytest

from contract import files, names
from contract.config import ModelConfig
from export import build, forms, targets
from export.graph_stats import op_histogram
from export.model import AttentionModel
from tests.conftest import TEST_CONFIGS

STATIC, TRT = ("fp32-static", "fp16-static"), ("fp32-trt", "fp16-trt")


def load(directory, variant) -> onnx.ModelProto:
    return onnx.load(str(directory / files.model_filename(variant)))


@pytest.fixture(scope="module", params=["tiny", "gqa", "unseen"])
def built(request, artifact_dir):
    return TEST_CONFIGS[request.param], artifact_dir(request.param)


@pytest.mark.parametrize("variant", STATIC)
def test_the_static_form_is_one_group_query_attention_per_layer_over_shared_buffers(built, variant):
    cfg, directory = built
    proto = load(directory, variant)
    assert [i.name for i in proto.graph.input] == [s.name for s in names.static_input_specs(cfg)]
    assert [o.name for o in proto.graph.output] == [s.name for s in names.static_output_specs(cfg)]
    gqa = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == cfg.n_layers and all(n.domain == forms.MICROSOFT_DOMAIN for n in gqa)
    for layer, node in enumerate(gqa):
        assert list(node.input[3:7]) == [
            *(names.past_name(layer, k) for k in names.KV_KINDS),
            names.SEQLENS_K,
            names.TOTAL_SEQUENCE_LENGTH,
        ]
        assert list(node.output[1:]) == [names.present_name(layer, k) for k in names.KV_KINDS]
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attributes["num_heads"], attributes["kv_num_heads"]) == (cfg.n_heads, cfg.n_kv_heads)
    cache = proto.graph.input[3].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in cache] == [
        names.BATCH,
        cfg.n_kv_heads,
        names.CACHE_LENGTH,
        cfg.head_dim,
    ]
    assert set(op_histogram(proto)) == {"Add", "MatMul", "LayerNormalization", "com.microsoft.GroupQueryAttention"}


@pytest.mark.parametrize("variant", TRT)
def test_the_tensorrt_form_has_the_cache_concat_outside_a_single_output_attention(built, variant):
    cfg, directory = built
    proto = load(directory, variant)
    attention = [n for n in proto.graph.node if n.op_type == "Attention"]
    assert len(attention) == cfg.n_layers
    assert all(len(n.output) == 1 and len(n.input) == 4 for n in attention)  # q, K, V, mask: no past, one output
    concats = [n for n in proto.graph.node if n.op_type == "Concat" and n.output[0].startswith("present.")]
    assert sorted(n.output[0] for n in concats) == sorted(names.present_names(cfg.n_layers))
    assert [i.name for i in proto.graph.input] == names.input_names(cfg)


@pytest.mark.parametrize("variant", [*STATIC, *TRT])
def test_the_report_names_the_target_and_the_variant_climbed_its_ladder(built, variant):
    _, directory = built
    entry = json.loads((directory / files.REPORT_FILENAME).read_text())["variants"][variant]
    assert entry["passed"] and entry["target"] == build.VARIANTS[variant].target and not entry["problems"]
    scenarios = set(entry["parity"])
    assert scenarios == ({build.POOL_SCENARIO} if variant in STATIC else set(build.SCENARIOS))
    worst = entry["worst"][names.OUTPUT]
    assert worst["finite"] and worst["max_abs"] < (1e-4 if variant.startswith("fp32") else 1e-1)


def test_every_gpu_graph_fits_its_target_and_not_the_others(built):
    cfg, directory = built
    fits = {
        variant: {t for t in targets.TARGETS if not targets.problems(t, load(directory, variant), cfg)}
        for variant in ("fp32", "fp32-fused", *STATIC, *TRT)
    }
    # the plain graph: ONNX Runtime 1.24's CUDA kernels and TensorRT's parser take it whole (forward_onnx)
    assert {targets.ONNX_BACKEND, targets.TENSORRT} <= fits["fp32"]
    # the fused node has its cache inside and three outputs: TensorRT would split the graph
    assert targets.TENSORRT not in fits["fp32-fused"] and targets.ONNX_BACKEND not in fits["fp32-fused"]
    assert fits["fp32-static"] == {targets.STATIC}
    assert fits["fp16-static"] == {targets.STATIC, targets.STATIC_CUDA}  # GQA on CUDA takes fp16 only
    for variant in TRT:
        assert targets.TENSORRT in fits[variant]
        assert targets.ONNX_BACKEND not in fits[variant]  # no CUDA Attention kernel in onnxruntime 1.24


def test_the_target_checks_say_what_does_not_fit(built):
    cfg, directory = built
    fused = targets.problems(targets.TENSORRT, load(directory, "fp32-fused"), cfg)
    assert any("one output only" in p for p in fused) and any("without past_key/past_value" in p for p in fused)
    on_ngc = targets.problems(targets.ONNX_BACKEND, load(directory, "fp32-trt"), cfg)
    assert on_ngc == ["Attention-23 (opset 23) has no CUDA kernel in onnxruntime 1.24"]
    static = targets.problems(targets.TENSORRT, load(directory, "fp16-static"), cfg)
    assert any("GroupQueryAttention (com.microsoft) is not an op TensorRT's parser imports" in p for p in static)


def test_onnx_runtimes_kernel_matching_rule():
    """An open-ended registration matches its first version only; a closed one its whole range
    (onnxruntime kernel_registry.cc): Equal 13+ runs Equal-13 on CUDA, not Equal-19."""
    equal = targets.ORT_1_24_CUDA_KERNELS["Equal"]
    assert targets.has_kernel(equal, 13) and not targets.has_kernel(equal, 19)
    assert targets.has_kernel(targets.ORT_1_24_CUDA_KERNELS["Reshape"], 14)  # inside 14-18
    assert not targets.has_kernel([], 1)


@pytest.mark.slow  # a whole build
def test_a_build_refuses_a_graph_that_does_not_fit_its_target(monkeypatch, tmp_path):
    fused_as_trt = build.Variant("fp32-trt", build.make_fp32_fused, build.TOLERANCES["fp32-trt"], fused=True)
    fused_as_trt = build.dataclasses.replace(fused_as_trt, target=targets.TENSORRT)
    monkeypatch.setitem(build.VARIANTS, "fp32-trt", fused_as_trt)
    with pytest.raises(build.BuildError, match="does not fit TensorRT 10 parser"):
        build.build(TEST_CONFIGS["tiny"], tmp_path, ("fp32-trt",))
    assert not (tmp_path / files.model_filename("fp32-trt")).exists()


@pytest.mark.slow  # a whole build
def test_a_config_the_static_form_cannot_take_is_reported_and_refused_when_asked(tmp_path):
    odd = ModelConfig(d_model=36, n_heads=3, n_kv_heads=3, n_layers=1, max_seq_len=64)  # head_dim 12
    assert "head_dim 12" in forms.static_problem(odd) and "multiple of 8" in forms.static_problem(odd)
    report = build.build(odd, tmp_path / "default", progress=build.Progress(enabled=False))
    entry = report["variants"]["fp32-static"]
    assert report["passed"] and entry["file"] is None and "head_dim 12" in entry["skipped"]
    with pytest.raises(build.BuildError, match="head_dim 12"):
        build.build(odd, tmp_path / "asked", ("fp32-static",), progress=build.Progress(enabled=False))
    with pytest.raises(forms.FormError, match="head_dim 12"):
        forms.static_proto(AttentionModel(odd))
