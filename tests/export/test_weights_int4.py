"""The 4-bit weight variants (export/weights_int4.py): every MatMul of a constant weight becomes ONNX Runtime's
MatMulNBits in 4 bits, blocks of 32, symmetric (no zero points: ORT issue 29853's wrong M=1 results on AVX2 come
from asymmetric weights) at accuracy_level 4; the codes and scales the graph holds are exactly the floor's
quantization; each graph passes its rung and is its precision floor (within 1.1x on every tensor); the file
is under a fifth of fp32-fused's; a whole model's MLPs and head are in 4 bits too."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from export.build import SCENARIOS, VARIANTS, check_variant
from export.fusion import make_fp32_fused
from export.model import AttentionModel
from export.parity import compare_rung
from export.progress import Progress
from export.runners import torch_runner
from export.weights_blockwise import BLOCK, PROJECTIONS, fake_quantize_weight, projection_matmuls
from export.weights_int4 import (
    BITS,
    INT4_WEIGHTS_TOLERANCE,
    NAME,
    STATIC_NAME,
    int4_weights_floor,
    make_fp32_fused_int4w,
    make_fp32_static_int4w,
)
from serving.engine.ort import ort_runner, ort_session
from tests.conftest import TEST_CONFIGS

CONFIG = "gqa"  # 256 wide: the weights outweigh the graph's structure, so the file size shows them


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """The PyTorch original, its int4w graph and its fp32-fused graph."""
    model = AttentionModel(TEST_CONFIGS[CONFIG], seed=0).eval()
    folder = tmp_path_factory.mktemp("int4w")
    return model, make_fp32_fused_int4w(model, folder / "int4w.onnx"), make_fp32_fused(model, folder / "fused.onnx")


def nbits_widths(path) -> list[tuple[str, int]]:
    """(name, bits) of each MatMulNBits node of the graph at `path`."""
    bits = (next(a for a in node.attribute if a.name == "bits") for node in nbits_nodes(path))
    return [(node.name, helper.get_attribute_value(width)) for node, width in zip(nbits_nodes(path), bits, strict=True)]


def nbits_nodes(path) -> list[onnx.NodeProto]:
    return [node for node in onnx.load(str(path)).graph.node if node.op_type == "MatMulNBits"]


def test_every_projection_is_a_symmetric_4_bit_matmulnbits_at_accuracy_level_4(graphs):
    model, int4w, _ = graphs
    proto = onnx.load(str(int4w))
    nodes = nbits_nodes(int4w)
    assert len(nodes) == len(PROJECTIONS) * model.cfg.n_layers and not projection_matmuls(proto)
    for node in nodes:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert (attributes["bits"], attributes["block_size"], attributes["accuracy_level"]) == (4, BLOCK, 4)
        assert len(node.input) == 3  # A, B, scales: no zero points, i.e. symmetric codes
    assert sum(node.op_type == "Attention" for node in proto.graph.node) == model.cfg.n_layers  # still fused


def test_the_codes_and_scales_are_what_the_floor_quantizes(graphs):
    """The graph's 4-bit codes (two a byte, low nibble first, stored +8) times their block's scale are the
    floor's weights: blocks of 32 along the input, scale = the block's largest-magnitude weight / -8."""
    model, int4w, _ = graphs
    initializers = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(int4w)).graph.initializer}
    dequantized = []
    for node in nbits_nodes(int4w):
        packed, scales = initializers[node.input[1]], initializers[node.input[2]]
        out_features = packed.shape[0]
        codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(out_features, -1).astype(np.float64) - 8
        weight = codes * np.repeat(scales.reshape(out_features, -1).astype(np.float64), BLOCK, axis=1)
        dequantized.append(weight)  # (out, in) as nn.Linear's
    for layer in model.layers:
        for name in PROJECTIONS:
            expected = fake_quantize_weight(getattr(layer.attn, name).weight.detach().double(), BITS).numpy()
            assert any(w.shape == expected.shape and np.allclose(w, expected, rtol=1e-6, atol=0) for w in dequantized)


@pytest.mark.slow
def test_each_form_passes_its_rung_and_is_its_precision_floor(graphs, tmp_path):
    model, int4w, _ = graphs
    static = make_fp32_static_int4w(model, tmp_path / "static-int4w.onnx")
    for name, path in ((NAME, int4w), (STATIC_NAME, static)):
        entry = check_variant(model, path, VARIANTS[name], Progress(enabled=False))
        assert entry["passed"], (name, entry["problems"])
        ratios = [error["max_abs"] / error["floor_abs"] for error in entry["worst"].values() if error["floor_abs"]]
        print(f"{name}: graph / floor {min(ratios):.2f} to {max(ratios):.2f}")
        assert max(ratios) < 1.1 < INT4_WEIGHTS_TOLERANCE.floor  # ONNX Runtime computes what the floor says
    floor = int4_weights_floor(model)
    result = compare_rung(
        model.cfg, torch_runner(model), ort_runner(ort_session(int4w)), SCENARIOS["with_past"], INT4_WEIGHTS_TOLERANCE,
        floor=floor,
    )  # fmt: skip
    output = result.tensors["output"]
    assert 1e-2 < output.max_rel < 0.5  # 4 bits cost something (not fp32's 1e-6), and not everything


def test_the_file_is_under_a_fifth_of_fp32_fused(graphs):
    _, int4w, fused = graphs
    sizes = {"int4w": int4w.stat().st_size, "fp32-fused": fused.stat().st_size}
    assert sizes["int4w"] <= 0.2 * sizes["fp32-fused"], sizes


@torch.no_grad()
def test_a_whole_models_mlps_and_head_are_4_bit_too(tmp_path):
    model = AttentionModel(TEST_CONFIGS["whole"], seed=0).eval()
    path = make_fp32_fused_int4w(model, tmp_path / "whole-int4w.onnx")
    mlp = 3 if model.cfg.mlp == "gated" else 2
    assert len(nbits_nodes(path)) == model.cfg.n_layers * (len(PROJECTIONS) + mlp) + 1  # the head
    entry = check_variant(model, path, VARIANTS[NAME], Progress(enabled=False))
    assert entry["passed"], entry["problems"]


def test_a_whole_models_head_kept_at_8_bits_is_8_bit_and_its_error_a_tenth(tmp_path, capsys):
    """`--int4-head-bits 8` (onnxruntime-genai's last_matmul:int8): the head alone becomes an 8-bit MatMulNBits,
    every other projection stays 4-bit, and the graph passes against a floor whose head is 8-bit too. The head's
    own error (the original with only its head quantized, int8 inputs both ways) is a tenth of the 4-bit head's
    or less: what the option buys."""
    from export.__main__ import main as export_main
    from export.build import with_int4_head
    from export.weights_blockwise import _BlockQuantized, head_matmul, quantized_floor

    model = AttentionModel(TEST_CONFIGS["whole"], seed=0).eval()
    variant = with_int4_head(VARIANTS[NAME], 8)
    path = tmp_path / "whole-int4w-head8.onnx"
    variant.make(model, path)
    widths = dict(nbits_widths(path))
    assert widths.pop(head_matmul(onnx.load(str(path)))) == 8 and set(widths.values()) == {BITS}, widths
    static = tmp_path / "whole-static-int4w-head8.onnx"
    with_int4_head(VARIANTS[STATIC_NAME], 8).make(model, static)
    assert sorted(dict(nbits_widths(static)).values()).count(8) == 1  # the static form's head alone, too
    entry = check_variant(model, path, variant, Progress(enabled=False))
    assert entry["passed"], entry["problems"]

    ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 12))
    original = torch_runner(model)({"input_ids": ids})["logits"]
    error = {}
    for bits in (BITS, 8):
        in_bits = functools.partial(_BlockQuantized, bits=bits)
        head_only = quantized_floor(model, np.float32, lambda linear: linear, in_bits)
        error[bits] = np.abs(head_only({"input_ids": ids})["logits"] - original).max()
    assert error[8] <= error[BITS] / 10, error

    headless = ["build", "--preset", "tiny", "--out", str(tmp_path / "tiny"), "--int4-head-bits", "8"]
    assert export_main(headless) == 2  # an attention module has no head: refused before anything is built
    assert "this model has no head" in capsys.readouterr().err and not (tmp_path / "tiny").exists()
    no_int4 = ["build", "--preset", "llama-whole", "--out", str(tmp_path / "w"), "--int4-head-bits", "8"]
    assert export_main([*no_int4, "--variants", "fp32-fused"]) == 2  # nothing it would change is built
    assert "no 4-bit weights' variant is built" in capsys.readouterr().err and not (tmp_path / "w").exists()
