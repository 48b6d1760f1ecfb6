"""The fp32 ONNX export against the PyTorch original on ONNX Runtime."""

import numpy as np
import onnx
import pytest

from contract import files, names
from export import artifacts
from export.graph_stats import fused_attention_count, op_histogram
from export.onnx_export import IR_VERSION, PLAIN_OPSET, config_from_onnx
from export.parity import TOLERANCES, Scenario, compare_rung
from export.runners import torch_runner
from serving.engine.ort import ort_runner, ort_session

GRID = [(past, new) for past in (0, 1, 17, 300) for new in (1, 7)]


@pytest.fixture(scope="module", params=["tiny", "gqa"])
def built(request, artifact_dir):
    directory = artifact_dir(request.param)
    model = artifacts.load_model(directory)
    path = directory / files.model_filename("fp32")
    return model, path, ort_session(path)


def make_inputs(cfg, batch, past, new, seed=0):
    rng = np.random.default_rng(seed)
    inputs = {names.HIDDEN_STATES: rng.standard_normal((batch, new, cfg.d_model)).astype(np.float32)}
    mask = np.ones((batch, past + new), dtype=np.int64)
    for row, pad in enumerate([0, 1, 3][:batch]):
        mask[row, : min(pad, past + new - 1)] = 0  # left padding; every row keeps its last token
    inputs[names.ATTENTION_MASK] = mask
    for name in names.past_names(cfg.n_layers):
        inputs[name] = rng.standard_normal((batch, cfg.n_kv_heads, past, cfg.head_dim)).astype(np.float32)
    return inputs


@pytest.mark.parametrize(("past", "new"), GRID)
def test_onnx_matches_pytorch_for_every_output(built, past, new):
    model, _, session = built
    cfg = model.cfg
    inputs = make_inputs(cfg, 3, past, new)
    expected = torch_runner(model)(inputs)
    actual = ort_runner(session)(inputs)
    assert set(actual) == set(names.output_names(cfg))
    real_queries = inputs[names.ATTENTION_MASK][:, -new:] == 1
    np.testing.assert_allclose(
        actual[names.OUTPUT][real_queries], expected[names.OUTPUT][real_queries], rtol=1e-5, atol=1e-5
    )
    real_keys = inputs[names.ATTENTION_MASK] == 1
    for name in names.present_names(cfg.n_layers):
        assert actual[name].shape == (3, cfg.n_kv_heads, past + new, cfg.head_dim)
        ours, theirs = actual[name].transpose(0, 2, 1, 3), expected[name].transpose(0, 2, 1, 3)
        np.testing.assert_allclose(ours[real_keys], theirs[real_keys], rtol=1e-5, atol=1e-5, err_msg=name)


def test_graph_is_valid_named_and_carries_its_config(built):
    model, path, _ = built
    cfg = model.cfg
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    assert proto.ir_version == IR_VERSION
    assert {o.domain: o.version for o in proto.opset_import}.get("") == PLAIN_OPSET
    assert config_from_onnx(proto) == cfg
    expected = {spec.name: spec.shape for spec in [*names.input_specs(cfg), *names.output_specs(cfg)]}
    for value in [*proto.graph.input, *proto.graph.output]:
        shape = tuple(d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim)
        assert shape == expected.pop(value.name), value.name
    assert not expected, f"graph lacks {sorted(expected)}"
    assert [i.name for i in proto.graph.input] == names.input_names(cfg)
    assert [o.name for o in proto.graph.output] == names.output_names(cfg)
    assert fused_attention_count(proto) == 0, "the plain variant must stay decomposed"
    assert op_histogram(proto)["Softmax"] == cfg.n_layers


def test_empty_past_is_a_valid_first_call(built):
    model, _, session = built
    cfg = model.cfg
    inputs = make_inputs(cfg, 2, 0, 4)
    outputs = ort_runner(session)(inputs)
    assert outputs[names.present_name(0, names.KEY)].shape == (2, cfg.n_kv_heads, 4, cfg.head_dim)
    # leaving the past out entirely means the same thing
    no_past = {k: v for k, v in inputs.items() if not k.startswith("past_key_values")}
    np.testing.assert_array_equal(ort_runner(session)(no_past)[names.OUTPUT], outputs[names.OUTPUT])


def test_128_decode_steps_do_not_drift(built, record_property):
    model, _, session = built
    scenario = Scenario(batch=3, prefill=5, steps=128, padding=(0, 2, 4))
    result = compare_rung(model.cfg, torch_runner(model), ort_runner(session), scenario, TOLERANCES["fp32"])
    errors = result.step_errors
    record_property("output_error_per_step", errors)
    print(f"{model.cfg}: output error per step, first {errors[0]:.2e}, max {max(errors):.2e}, last {errors[-1]:.2e}")
    assert len(errors) == 129
    assert result.passed, result.to_dict()["tensors"]
    assert errors[-1] <= 1e-5
    assert max(errors[-16:]) <= 4 * max(*errors[:16], 1e-6), "the error grows with the number of steps"
