"""The attention maps of a session in process (serving/engine/static_engine.py `attention_maps`, the
inspection graph behind serving/engine/runner.py `InspectionRunner`): equal to the PyTorch original's
over the session's held tokens and the new ones (a rotary model's new tokens at the positions after
what it holds), the session untouched; a quantized cache's maps over its codes dequantized as the
kernel reads them; the clear refusal without an inspection graph."""

from __future__ import annotations

import numpy as np
import pytest

from contract import names
from contract.config import ModelConfig
from contract.files import model_filename
from export import forms, kv_quant
from export.artifacts import load_model, save_artifact
from export.build import attention_maps_runner
from export.inspect_form import make_inspection_graph
from export.model import AttentionModel
from export.onnx_export import save_onnx
from serving.engine import errors
from serving.engine.kv_pool import cache_scales
from serving.engine.ort import ort_session
from serving.engine.runner import InspectionRunner
from serving.engine.static_engine import StaticSessionEngine
from serving.engine.steps import StepRequest
from tests.conftest import TEST_CONFIGS
from tests.fixtures.engine import full_rows, full_rows_engine

# The maps of a quantized session against the fp32 session's, as a share of the latter's scale: an int8
# code's half step is 1/254 of its channel's peak, an int4 one's 1/14 (measured on this model: about
# 1% and 14-19% of the scale of the output and of the maps). Their exactness is the 1e-5 check beside it.
QUANTIZED_MAPS_BOUND = {8: 5e-2, 4: 0.3}


@pytest.fixture(scope="module")
def rotary_graphs(request, artifact_dir, tmp_path_factory):
    """The rotary test model's static and inspection graphs: those of the session's rotary artifact
    (the same model, seed 0) where another module of this run builds it anyway (tests/export,
    tests/serving/test_rotary.py) with both, else made here without the build's parity ladder (the
    build checks both; the whole rotary artifact costs half a minute and more here)."""
    graphs = [model_filename("fp32-static"), model_filename(names.INSPECTION_VARIANT)]
    others = {item.path for item in request.session.items if getattr(item, "module", None) is not request.module}
    built_anyway = any('artifact_dir("rotary")' in path.read_text() for path in others if path.suffix == ".py")
    if built_anyway and all((artifact_dir("rotary") / graph).is_file() for graph in graphs):
        return artifact_dir("rotary")
    directory = tmp_path_factory.mktemp("rotary-graphs")
    model = AttentionModel(TEST_CONFIGS["rotary"], seed=0).eval()
    save_artifact(model, directory)
    forms.make_fp32_static(model, directory / graphs[0])
    make_inspection_graph(model, directory / graphs[1])
    return directory


@pytest.fixture(scope="module")
def gqa_calibration(artifact_dir):
    """The gqa model and its KV cache calibration (the build's, on generated hidden states), for both
    bit widths."""
    model = load_model(artifact_dir("gqa"))
    return model, kv_quant.calibrate(model, kv_quant.generated(model.cfg))


def new_engine(artifact: str, static: str = "fp32-static", inspection: bool = True) -> StaticSessionEngine:
    cfg = ModelConfig.load(artifact)
    graph = artifact / model_filename(names.INSPECTION_VARIANT) if inspection else None
    session = ort_session(artifact / model_filename(static))
    return full_rows_engine(session, cfg, rows=2, capacity=128, inspection=InspectionRunner(graph, cfg))


def step(engine: StaticSessionEngine, tokens: np.ndarray, start: bool = False) -> np.ndarray:
    (result,) = engine.execute([StepRequest(7, start=start, end=False, hidden=tokens)])
    if isinstance(result, Exception):
        raise result
    return result


@pytest.mark.parametrize("artifact", ["gqa", "rotary"])
def test_a_sessions_maps_are_the_originals_over_what_it_holds_and_change_nothing(artifact_dir, rotary_graphs, artifact):
    directory = rotary_graphs if artifact == "rotary" else artifact_dir(artifact)
    engine, model = new_engine(directory), load_model(directory)
    rng = np.random.default_rng(0)
    prompt, asked, after = (rng.standard_normal((1, t, model.cfg.d_model)).astype(np.float32) for t in (6, 3, 1))
    step(engine, prompt, start=True)
    answer = engine.attention_maps(7, asked[0])
    assert engine.length(7) == 6  # the asked tokens were not kept
    expected = attention_maps_runner(model)({names.HIDDEN_STATES: np.concatenate([prompt, asked], axis=1)})
    np.testing.assert_allclose(answer[names.OUTPUT], expected[names.OUTPUT][:, -3:], rtol=0, atol=1e-5)
    for name in names.attention_map_names(model.cfg.n_layers):
        assert answer[name].shape == (1, model.cfg.n_heads, 3, 9)
        np.testing.assert_allclose(answer[name], expected[name][:, :, -3:], rtol=0, atol=1e-5)
    full = attention_maps_runner(model)({names.HIDDEN_STATES: np.concatenate([prompt, after], axis=1)})
    np.testing.assert_allclose(step(engine, after), full[names.OUTPUT][:, -1:], rtol=0, atol=1e-5)


def test_without_the_inspection_graph_a_request_for_maps_is_refused_naming_it(artifact_dir):
    engine = new_engine(artifact_dir("gqa"), inspection=False)
    step(engine, np.ones((1, 2, engine.cfg.d_model), np.float32), start=True)
    with pytest.raises(errors.InvalidRequest, match="need the inspection graph fp32-fused-inspect") as refused:
        engine.attention_maps(7, np.ones((1, engine.cfg.d_model), np.float32))
    assert refused.value.code == "INVALID_ARG" and engine.length(7) == 2


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_sessions_maps_are_the_originals_over_its_cache_as_the_kernel_reads_it(
    artifact_dir, gqa_calibration, tmp_path, bits
):
    """An int8 or int4 cache is dequantized on the host with the graph's own scales (int4: two codes a
    byte, + 8, the even channel low), as export's quantization reads the codes; the maps are then the
    PyTorch original's over that cache, and near the fp32 session's."""
    directory = artifact_dir("gqa")
    model, calibration = gqa_calibration
    cfg = model.cfg
    quantization = calibration.quantization(bits)
    path = save_onnx(forms.quantized_static_proto(model, quantization), tmp_path / f"int{bits}.onnx")
    scales = cache_scales(path, cfg)
    assert sorted(scales) == sorted(names.past_names(cfg.n_layers))
    assert all(np.array_equal(scales[name], quantization.scales[name]) for name in scales)
    inspection = InspectionRunner(directory / model_filename(names.INSPECTION_VARIANT), cfg)
    cache = full_rows(ort_session(path), cfg, rows=2, capacity=128, scales=scales)
    engine, fp32 = StaticSessionEngine(cache, idle_timeout=60.0, inspection=inspection), new_engine(directory)
    rng = np.random.default_rng(1)
    prompt, asked = (rng.standard_normal((1, t, cfg.d_model)).astype(np.float32) for t in (6, 3))
    step(engine, prompt, start=True), step(fp32, prompt, start=True)
    answer = engine.attention_maps(7, asked[0])
    assert engine.length(7) == 6 and engine.cache_kind == f"int{bits}"
    floats = engine.cache.read_floats(7)
    for name, codes in engine.cache.read(7).items():
        np.testing.assert_array_equal(floats[name], quantization.dequantize(name, codes))
    expected = attention_maps_runner(model)({names.HIDDEN_STATES: asked, **{n: a[None] for n, a in floats.items()}})
    unquantized = fp32.attention_maps(7, asked[0])
    for name in [names.OUTPUT, *names.attention_map_names(cfg.n_layers)]:
        np.testing.assert_allclose(answer[name], expected[name], rtol=0, atol=1e-5)
        # what quantizing the cache costs, not fp32's result and not garbage (QUANTIZED_MAPS_BOUND)
        error = np.abs(answer[name] - unquantized[name]).max() / np.abs(unquantized[name]).max()
        assert 0 < error < QUANTIZED_MAPS_BOUND[bits], (name, error)


def test_an_unknown_session_is_refused_as_a_step_is(artifact_dir):
    engine = new_engine(artifact_dir("gqa"))
    with pytest.raises(errors.UnknownSequence):
        engine.attention_maps(99, np.ones((1, engine.cfg.d_model), np.float32))
