"""Whole decoders (token ids in, logits out) through every form and its parity ladder: the build's
report for TEST_CONFIGS["whole"] (Llama's block, every variant) and ["whole-gpt2"] (learned positions,
a tied head), int8 weights in the MLPs and the head, and the static form through the KV pool, the
last position's logits alone included."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from contract import files, names
from export import build
from export import report as report_module
from export.artifacts import load_model
from export.choices import expand
from export.graph_stats import RMS_NORM_OP, SKIP_RMS_NORM, op_count
from export.parity import TOLERANCES
from export.weights_blockwise import MLP_PROJECTIONS, PROJECTIONS, projection_matmuls
from export.weights_int8 import NAME as INT8_WEIGHTS
from export.weights_int8 import STATIC_NAME as STATIC_INT8_WEIGHTS
from serving.engine.kv_pool import KVPool, last_logits_graph
from serving.engine.ort import CPU_PROVIDER, graph_sizes, ort_session
from tests.fixtures.builds import artifact_build

WHOLE = ("whole", "whole-gpt2")
FP32_VARIANTS = ("fp32", "fp32-fused", names.INSPECTION_VARIANT, "fp32-static", "fp32-trt")


@pytest.fixture(scope="module", params=WHOLE)
def whole(request, artifact_dir):
    directory = artifact_dir(request.param)
    return request.param, directory, json.loads((directory / files.REPORT_FILENAME).read_text())


def test_every_variant_passes_its_ladder_on_token_ids_and_logits(whole):
    name, directory, report = whole
    built = report["variants"]
    print(f"\n{name}:\n{report_module.summary_table(report)}")
    assert set(built) == set(expand(artifact_build(name)))
    assert not [variant for variant, entry in built.items() if "skipped" in entry]
    for variant, entry in built.items():
        assert entry["passed"], (variant, entry["problems"])
        assert (directory / entry["file"]).is_file()
        logits = entry["worst"][names.LOGITS]
        assert all(error["finite"] for error in entry["worst"].values()), variant
        if variant in FP32_VARIANTS:  # the same fp32 math: within 1e-5 of the logits' scale
            assert logits["max_rel"] <= 1e-5, (variant, logits)
        elif variant.startswith("fp16"):  # fp16's bound: 2e-3 of the scale, or 8x its precision floor
            tolerance = TOLERANCES[variant]
            assert logits["max_rel"] <= max(tolerance.scale, tolerance.floor * logits["floor_rel"]), (variant, logits)


def test_the_ladder_compares_logits_and_presents(whole):
    _, _, report = whole
    worst = report["variants"]["fp32-fused"]["worst"]
    cfg_layers = report["config"]["n_layers"]
    assert set(worst) == {names.LOGITS, *names.present_names(cfg_layers)}


@pytest.mark.parametrize(
    ("name", "variant"),
    [("whole", INT8_WEIGHTS), ("whole", STATIC_INT8_WEIGHTS), ("whole-gpt2", INT8_WEIGHTS)],  # as builds.py builds
)
def test_int8_weights_quantize_the_mlps_and_the_head(artifact_dir, name, variant):
    """Both forms of INT8 weights (the fused graph's, and the static cache's that sessions serve)."""
    directory = artifact_dir(name)
    cfg = load_model(directory).cfg
    graph = onnx.load(str(directory / files.model_filename(variant)))
    ops = [node.op_type for node in graph.graph.node]
    mlp = sum(1 for projection in MLP_PROJECTIONS if projection != "W_gate" or cfg.mlp == "gated")
    attention = 2 if variant == STATIC_INT8_WEIGHTS else len(PROJECTIONS)  # the static form packs q, k and v
    assert ops.count("MatMulInteger") == cfg.n_layers * (attention + mlp) + 1  # + the head
    assert projection_matmuls(graph) == []  # no MatMul left multiplying fp32 weights
    # the embedding's Gather still reads the fp32 table (a tied head's int8 copy is the head's own)
    gathered = {node.input[0] for node in graph.graph.node if node.op_type == "Gather"}
    fp32_tables = {t.name for t in graph.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    assert "model.embed.weight" in gathered & fp32_tables


def _reference_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids[None])).output[0].numpy()  # (T, vocab)


def test_the_static_form_through_the_pool_equals_the_original_and_its_last_logits_graph(whole):
    """Prefills into two rows, then a decode step beside a late prefill; the last-logits graph answers
    the full graph's last row, and only it."""
    _, directory, _ = whole
    model = load_model(directory).eval()
    path = directory / files.model_filename("fp32-static")
    session = ort_session(path)
    last = ort.InferenceSession(last_logits_graph(onnx.load(str(path))).SerializeToString(), providers=[CPU_PROVIDER])
    assert graph_sizes(session).vocab_size == model.cfg.vocab_size
    full = KVPool(session, model.cfg, rows=3, capacity=32)
    short = KVPool(ort_session(path), model.cfg, rows=3, capacity=32, last_logits_session=last)
    rng = np.random.default_rng(0)
    first = {0: rng.integers(0, model.cfg.vocab_size, 9), 1: rng.integers(0, model.cfg.vocab_size, 4)}
    second = {0: np.array([7]), 1: np.array([11]), 2: rng.integers(0, model.cfg.vocab_size, 6)}
    answered = [full.run(first), full.run(second)]
    lasts = [short.run(first, last_only=True), short.run(second, last_only=True)]
    for step, ids in enumerate((first, second)):
        for row in ids:
            sequence = np.concatenate([first[row], second[row]]) if step and row in first else ids[row]
            expected = _reference_logits(model, sequence)[-len(ids[row]) :]
            logits = answered[step][row]
            assert logits.shape == (len(ids[row]), model.cfg.vocab_size) and logits.dtype == np.float32
            assert np.abs(logits - expected).max() <= 1e-5 * np.abs(expected).max()
            assert lasts[step][row].shape == (1, model.cfg.vocab_size)
            np.testing.assert_allclose(lasts[step][row], logits[-1:], rtol=0, atol=1e-5 * np.abs(logits).max())
    for row in range(3):  # the caches the two pools hold are the same
        for cache, array in full.read(row).items():
            np.testing.assert_allclose(short.read(row)[cache], array, atol=1e-6)


def test_a_pool_of_a_whole_model_refuses_hidden_states(artifact_dir):
    directory = artifact_dir("whole")
    model = load_model(directory)
    pool = KVPool(ort_session(directory / files.model_filename("fp32-static")), model.cfg, rows=1, capacity=8)
    (error,) = pool.run({0: np.zeros((2, model.cfg.d_model), np.float32)}).values()
    assert isinstance(error, ValueError) and "row 0: input_ids must be (T,) integer token ids" in str(error)
    assert list(pool.lengths) == [0]


def test_onnx_runtimes_fp32_forms_fold_each_residual_add_into_the_norm_after_it(whole):
    """Llama's block: every norm but the first layer's (it reads the embeddings) and the final one (its sum
    feeds nothing else: the last-position slice goes before it) holds its residual Add, in each fp32 form ONNX
    Runtime serves; the TensorRT and fp16 forms keep plain norms. The build's gate counts them: a fused graph
    without them falls short. GPT-2's LayerNorms are left as they are."""
    _, directory, report = whole
    cfg = load_model(directory).cfg
    folded = 2 * cfg.n_layers - 1 if cfg.norm == "rmsnorm" else 0
    for variant, entry in report["variants"].items():
        proto = onnx.load(str(directory / entry["file"]), load_external_data=False)
        expected = folded if build.VARIANTS[variant].skip_norms else 0
        assert op_count(proto, *SKIP_RMS_NORM) == expected, variant
    if not folded:
        return
    static = onnx.load(str(directory / files.model_filename("fp32-static")))
    producer = {output: node for node in static.graph.node for output in node.output}
    head_input = producer[names.LOGITS].input[0]
    assert producer[head_input].op_type == RMS_NORM_OP  # the final norm, where the last-position slice goes
    plain = onnx.load(str(directory / files.model_filename("fp16-static")), load_external_data=False)
    shortfalls = build.fusion_shortfalls(cfg, plain, rotations_inside=True, skip_norms=True)
    assert shortfalls == [f"0 {SKIP_RMS_NORM[0]} ops for {cfg.n_layers} layers (expected {folded})"], shortfalls
