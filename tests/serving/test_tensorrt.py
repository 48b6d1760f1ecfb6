"""TensorRT settings derived from a config and limits: profiles, ORT provider options, Triton config."""

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from contract import files, names
from contract.config import ModelConfig, preset
from serving.engine import placement, tensorrt
from serving.engine.tensorrt import Limits, LimitsError
from serving.triton.config import triton_optimization
from tests.conftest import TEST_CONFIGS

SEED = preset("seed")  # 512 wide, 8 heads of 64, 1 layer, max_seq_len 4096
GQA = TEST_CONFIGS["unseen"]  # 96 wide, 6 heads of 16, 2 kv heads, 3 layers, max_seq_len 1024


def test_every_input_gets_min_opt_max_in_graph_order():
    shapes = tensorrt.profile(GQA, Limits())
    assert list(shapes) == names.input_names(GQA)
    for name, shape_range in shapes.items():
        for point in tensorrt.POINTS:
            assert len(getattr(shape_range, point)) == (
                2 if name == names.ATTENTION_MASK else 3 if name == names.HIDDEN_STATES else 4
            )
        assert all(
            lo <= mid <= hi for lo, mid, hi in zip(shape_range.min, shape_range.opt, shape_range.max, strict=True)
        )


def test_the_seed_profile_by_default():
    shapes = tensorrt.profile(SEED, Limits())
    hidden, mask, key = shapes[names.HIDDEN_STATES], shapes[names.ATTENTION_MASK], shapes[names.past_name(0, "key")]
    assert (hidden.min, hidden.opt, hidden.max) == ((1, 1, 512), (1, 1, 512), (8, 512, 512))
    # past: 0 (an empty past) .. max_seq_len - max_sequence; opt: a decode step halfway in
    assert (key.min, key.opt, key.max) == ((1, 8, 0, 64), (1, 8, 1792, 64), (8, 8, 3584, 64))
    assert (mask.min, mask.opt, mask.max) == ((1, 1), (1, 1793), (8, 4096))


@pytest.mark.parametrize(
    "limits",
    [
        Limits(),
        Limits(max_batch=2, max_sequence=7, max_past=100, opt_batch=2, opt_sequence=3, opt_past=50),
        Limits(max_past=0),
    ],
)
def test_the_mask_is_past_plus_sequence_at_every_point_and_the_caches_agree(limits):
    shapes = tensorrt.profile(GQA, limits)
    for point in tensorrt.POINTS:
        batch, sequence, _ = getattr(shapes[names.HIDDEN_STATES], point)
        mask = getattr(shapes[names.ATTENTION_MASK], point)
        for name in names.past_names(GQA.n_layers):
            cache = getattr(shapes[name], point)
            assert cache == (batch, GQA.n_kv_heads, cache[2], GQA.head_dim)
            assert mask == (batch, cache[2] + sequence), point
    assert shapes[names.past_name(0, "value")].min[2] == 0, "an empty past must be covered"


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (Limits(max_batch=0), "max_batch must be at least 1"),
        (Limits(max_sequence=2000), r"max_sequence must be between 1 and 1024"),
        (Limits(max_sequence=512, max_past=600), r"max_past must be between 0 and 512"),
        (Limits(opt_batch=9), r"opt_batch must be between 1 and 8"),
        (Limits(opt_past=-1), r"opt_past must be between 0"),
    ],
)
def test_impossible_limits_name_the_limit(limits, message):
    with pytest.raises(LimitsError, match=message):
        tensorrt.profile(GQA, limits)


def test_provider_options_in_onnx_runtime_format(tmp_path):
    cfg = ModelConfig(d_model=32, n_heads=4, n_kv_heads=2, n_layers=1, max_seq_len=64)
    options = tensorrt.provider_options(cfg, Limits(max_batch=4, max_sequence=16), tmp_path / "engines")
    assert options["trt_fp16_enable"] is True and options["trt_engine_cache_enable"] is True
    assert options["trt_engine_cache_path"] == str(tmp_path / "engines")
    assert options["trt_profile_min_shapes"] == (
        "hidden_states:1x1x32,attention_mask:1x1,past_key_values.0.key:1x2x0x8,past_key_values.0.value:1x2x0x8"
    )
    assert options["trt_profile_opt_shapes"] == (
        "hidden_states:1x1x32,attention_mask:1x25,past_key_values.0.key:1x2x24x8,past_key_values.0.value:1x2x24x8"
    )
    assert options["trt_profile_max_shapes"] == (
        "hidden_states:4x16x32,attention_mask:4x64,past_key_values.0.key:4x2x48x8,past_key_values.0.value:4x2x48x8"
    )
    providers = tensorrt.ort_providers(options, device_id=1)
    assert [p if isinstance(p, str) else p[0] for p in providers] == [
        "TensorrtExecutionProvider",
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]
    assert providers[0][1]["device_id"] == 1 and providers[0][1]["trt_fp16_enable"] is True


def test_triton_accelerator_matches_the_provider_options(tmp_path):
    options = tensorrt.provider_options(SEED, Limits(), "/engines", workspace_bytes=1 << 31)
    policy = triton_optimization(options)
    assert isinstance(policy, model_config_pb2.ModelOptimizationPolicy)
    (accelerator,) = policy.execution_accelerators.gpu_execution_accelerator
    parameters = dict(accelerator.parameters)
    assert accelerator.name == "tensorrt"
    assert parameters["precision_mode"] == "FP16"
    assert parameters["max_workspace_size_bytes"] == str(1 << 31)
    assert parameters["trt_engine_cache_enable"] == "1" and parameters["trt_engine_cache_path"] == "/engines"
    for point in tensorrt.POINTS:
        key = f"trt_profile_{point}_shapes"
        assert parameters[key] == options[key]
    # it parses as the `optimization` field of a Triton model config
    text = "optimization {" + text_format.MessageToString(policy) + "}"
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert (
        config.optimization.execution_accelerators.gpu_execution_accelerator[0].parameters["precision_mode"] == "FP16"
    )


def test_fp32_precision_mode_when_fp16_is_off():
    policy = triton_optimization(tensorrt.provider_options(SEED, Limits(), "/e", fp16=False))
    assert policy.execution_accelerators.gpu_execution_accelerator[0].parameters["precision_mode"] == "FP32"


def test_without_a_gpu_the_engine_check_raises_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(placement, "tensorrt_unavailable_reason", lambda: "no CUDA GPU")
    with pytest.raises(tensorrt.TensorRTUnavailable, match="no CUDA GPU"):
        tensorrt.check_engine(tmp_path / "model.onnx", GQA, Limits(), tmp_path / "engines")


def test_unavailable_reasons_say_what_is_missing(monkeypatch):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert placement.tensorrt_unavailable_reason() == (
        f"onnxruntime {onnxruntime.__version__} has no TensorrtExecutionProvider (it offers CPUExecutionProvider)"
    )
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["TensorrtExecutionProvider"])
    monkeypatch.setattr(placement, "cuda_device_count", lambda: 0)
    assert "no CUDA GPU" in placement.tensorrt_unavailable_reason()


TENSORRT_MISSING = placement.tensorrt_unavailable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(TENSORRT_MISSING is not None, reason=str(TENSORRT_MISSING))
def test_engine_builds_and_matches_cpu(artifact_dir, tmp_path):
    directory = artifact_dir("unseen")
    limits = Limits(max_batch=2, max_sequence=32, max_past=64)
    check = tensorrt.check_engine(directory / files.model_filename("fp16-trt"), GQA, limits, tmp_path)
    assert check.providers[0] == "TensorrtExecutionProvider"
    assert check.engine_files, "the engine cache is empty"
    assert check.passed and check.bound == 1e-2, check.max_rel
