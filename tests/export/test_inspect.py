"""The inspection form (export/inspect_form.py): every layer's attention weights from the fused graph
that serves, equal to the PyTorch original's; the head statistics (contract/heads.py) on maps whose
numbers are known; and `python -m export inspect` end to end, with a text its maps are labelled with."""

from __future__ import annotations

import json
import math
import re
import struct
import types

import numpy as np
import onnx
import pytest
import torch

from contract import files, names
from contract.config import ModelConfig
from contract.heads import head_statistics, layer_statistics, real_positions
from contract.names import attention_map_name
from export import __main__ as cli
from export.artifacts import save_artifact
from export.fp16 import make_fp16_fused
from export.fusion import make_fp32_fused
from export.inspect_form import (
    FP16_FUSED,
    FP32_FUSED,
    inspect_artifact,
    inspection_proto,
    make_inspection_graph,
    maps_figure,
    run_maps,
    token_label,
)
from export.model import AttentionModel, attention_allowed
from tests.conftest import TEST_CONFIGS
from tests.fixtures.triton import WHOLE_ARTIFACT

TINY = TEST_CONFIGS["tiny"]  # 32 wide, 4 heads, 2 layers: the 3D Attention form
ROTARY = TEST_CONFIGS["rotary"]  # RoPE, q/k norms, GQA, a window of 24 in layer 0: the 4D form
FP32_BOUND = 1e-5  # the fp32 rungs' tolerance (export/parity.py): the same math, summed in another order


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model, its fp32 inspection graph, and an artifact holding its fused graphs as a build
    writes them (config, weights, model.fp32-fused.onnx, model.fp16-fused.onnx); one export for all."""
    model = AttentionModel(TINY).eval()
    artifact = save_artifact(model, tmp_path_factory.mktemp("tiny-artifact"))
    make_fp32_fused(model, artifact / files.model_filename(FP32_FUSED))
    make_fp16_fused(model, artifact / files.model_filename(FP16_FUSED))
    return types.SimpleNamespace(model=model, proto=inspection_proto(model), artifact=artifact)


def padded_call(cfg: ModelConfig, new: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Hidden states (2, new, d_model) and a mask whose second row is left-padded by 3."""
    hidden = np.random.default_rng(seed).standard_normal((2, new, cfg.d_model)).astype(np.float32)
    mask = np.ones((2, new), np.int64)
    mask[1, :3] = 0
    return hidden, mask


def original(model: AttentionModel, hidden: np.ndarray, mask: np.ndarray, past=None):
    with torch.no_grad():
        return model(torch.from_numpy(hidden), torch.from_numpy(mask), past, return_attention=True)


def past_feeds(present) -> dict[str, np.ndarray]:
    feeds = {}
    for layer, cache in enumerate(present):
        feeds[names.past_name(layer, names.KEY)] = cache.key.numpy()
        feeds[names.past_name(layer, names.VALUE)] = cache.value.numpy()
    return feeds


def assert_maps_match(maps, expected, mask, cfg: ModelConfig, new: int) -> float:
    """The graph's maps equal the original's on every real query within the fp32 bound; a key the mask
    excludes weighs exactly 0. Returns the largest error."""
    past = mask.shape[1] - new
    real_queries = mask[:, past:].astype(bool)[:, None, :, None]  # (B, 1, T, 1)
    worst = 0.0
    for layer, (graph, weights) in enumerate(zip(maps, expected, strict=True)):
        reference = weights.numpy()
        assert graph.shape == reference.shape == (mask.shape[0], cfg.n_heads, new, mask.shape[1])
        error = float(np.abs(np.where(real_queries, graph - reference, 0.0)).max())
        assert error <= FP32_BOUND, f"layer {layer}: {error}"
        allowed = attention_allowed(torch.from_numpy(mask), past, new, cfg.window(layer)).numpy()
        assert not np.where(real_queries, np.where(allowed, 0.0, graph), 0.0).any(), "weight on an excluded key"
        worst = max(worst, error)
    return worst


# -- the graph and its parity ------------------------------------------------------------------------


def test_every_layer_returns_its_weights_as_a_graph_output(tiny, tmp_path):
    saved = onnx.load_model(str(make_inspection_graph(tiny.model, tmp_path / "inspect.onnx")))
    assert [value.name for value in saved.graph.output] == [value.name for value in tiny.proto.graph.output]
    outputs = {value.name: value for value in tiny.proto.graph.output}
    for layer in range(TINY.n_layers):
        weights = outputs[attention_map_name(layer)].type.tensor_type
        assert weights.elem_type == onnx.TensorProto.FLOAT
        dims = [d.dim_param or d.dim_value for d in weights.shape.dim]
        assert dims == [names.BATCH, TINY.n_heads, names.SEQUENCE, names.TOTAL_SEQUENCE]
    modes = [
        attribute.i
        for node in tiny.proto.graph.node
        if node.op_type == "Attention"
        for attribute in node.attribute
        if attribute.name == "qk_matmul_output_mode"
    ]
    assert modes == [3] * TINY.n_layers  # the softmax's output


def test_stateless_maps_equal_the_original_with_left_padding(tiny):
    hidden, mask = padded_call(TINY, new=7)
    _, maps = run_maps(tiny.proto, TINY, {names.HIDDEN_STATES: hidden, names.ATTENTION_MASK: mask})
    expected = original(tiny.model, hidden, mask)
    print(f"tiny, stateless: {assert_maps_match(maps, expected.attention_weights, mask, TINY, 7):.2e}")
    # a padded query (nothing to attend): the op gives zeros where the original spreads evenly; the
    # contract leaves those rows unspecified, and the statistics never read them
    for graph, reference in zip(maps, expected.attention_weights, strict=True):
        assert not graph[1, :, :3].any()
        assert np.allclose(reference[1, :, :3].numpy(), 1 / 7)


def test_maps_with_a_past_equal_the_original(tiny):
    hidden, mask = padded_call(TINY, new=7)
    prefill = original(tiny.model, hidden, mask)
    step = np.random.default_rng(1).standard_normal((2, 1, TINY.d_model)).astype(np.float32)
    held = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)  # (2, 8): the padding stays held
    feeds = {names.HIDDEN_STATES: step, names.ATTENTION_MASK: held, **past_feeds(prefill.present)}
    _, maps = run_maps(tiny.proto, TINY, feeds)
    expected = original(tiny.model, step, held, prefill.present)
    print(f"tiny, one step over a past of 7: {assert_maps_match(maps, expected.attention_weights, held, TINY, 1):.2e}")


def test_fp16_maps_are_fp16_and_near_fp32(tiny):
    proto = inspection_proto(tiny.model, FP16_FUSED)
    hidden, mask = padded_call(TINY, new=7)
    _, maps = run_maps(proto, TINY, {names.HIDDEN_STATES: hidden.astype(np.float16), names.ATTENTION_MASK: mask})
    _, reference = run_maps(tiny.proto, TINY, {names.HIDDEN_STATES: hidden, names.ATTENTION_MASK: mask})
    real = mask.astype(bool)[:, None, :, None]
    for graph, fp32 in zip(maps, reference, strict=True):
        assert graph.dtype == np.float16
        difference = np.abs(np.where(real, graph.astype(np.float32) - fp32, 0.0)).max()
        assert 0 < difference < 5e-3  # fp16's rounding of q and k, passed on by the softmax


# -- the statistics on maps whose numbers are known --------------------------------------------------


def causal_maps(total: int, rows) -> np.ndarray:
    """(1, 1, total, total): query i's weights are rows(i) (a vector over keys 0..i)."""
    weights = np.zeros((1, 1, total, total))
    for query in range(total):
        weights[0, 0, query, : query + 1] = rows(query)
    return weights


def only(key: int, length: int) -> np.ndarray:
    row = np.zeros(length)
    row[key] = 1.0
    return row


def test_uniform_over_n_keys_has_entropy_ln_n():
    n, past, new = 4, 6, 5  # each new query spreads evenly over itself and the 3 keys before it
    weights = np.zeros((1, 1, new, past + new))
    for query in range(new):
        weights[0, 0, query, past + query - n + 1 : past + query + 1] = 1 / n
    (head,) = layer_statistics(weights, np.ones((1, past + new), np.int64))["heads"]
    assert head["entropy"] == pytest.approx(math.log(n))
    assert head["mean_distance"] == pytest.approx((n - 1) / 2)
    assert head["previous_token_share"] == pytest.approx(1 / n)
    assert head["first_position_share"] == 0.0


def test_all_on_the_previous_token():
    weights = causal_maps(6, lambda query: only(max(query - 1, 0), query + 1))
    statistics = layer_statistics(weights, np.ones((1, 6), np.int64))
    assert statistics["queries"] == 5  # the first token can only read itself: not counted
    (head,) = statistics["heads"]
    assert head == {
        "head": 0,
        "entropy": 0.0,
        "mean_distance": 1.0,
        "first_position_share": pytest.approx(1 / 5),  # query 1's previous token is the first
        "previous_token_share": 1.0,
    }


def test_all_on_the_first_position_and_left_padding_moves_nothing():
    weights = causal_maps(6, lambda query: only(0, query + 1))
    (head,) = layer_statistics(weights, np.ones((1, 6), np.int64))["heads"]
    assert head["first_position_share"] == 1.0
    assert head["mean_distance"] == pytest.approx(np.mean([1, 2, 3, 4, 5]))
    # the same sequence behind 3 padded positions: padded queries hold anything (their rows are
    # unspecified), and positions count real tokens only
    padded = np.full((1, 1, 9, 9), 0.25)
    padded[0, 0, 3:] = 0.0
    padded[0, 0, 3:, 3:] = weights[0, 0]
    mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    assert real_positions(mask).tolist() == [[-1, -1, -1, 0, 1, 2, 3, 4, 5]]
    assert layer_statistics(padded, mask)["heads"] == [head]


def test_statistics_per_layer_and_head_are_plain_json():
    weights = np.stack([causal_maps(4, lambda q: np.full(q + 1, 1 / (q + 1)))[0, 0]] * 3)[None]  # (1, 3, 4, 4)
    statistics = head_statistics([weights, weights], np.ones((1, 4), np.int64))
    assert [layer["layer"] for layer in statistics] == [0, 1]
    assert [head["head"] for head in statistics[1]["heads"]] == [0, 1, 2]
    assert json.loads(json.dumps(statistics)) == statistics
    only_first = head_statistics([weights[:, :, :1, :1]], np.ones((1, 1), np.int64))  # no query has a choice
    assert only_first[0]["queries"] == 0 and only_first[0]["heads"][0]["entropy"] is None


# -- python -m export inspect ------------------------------------------------------------------------


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk's width and height


def test_cli_writes_the_heatmaps_and_prints_the_table(tiny, tmp_path, capsys):
    out = tmp_path / "maps.png"
    assert cli.main(["inspect", str(tiny.artifact), "--tokens", "12", "--seed", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    width, height = png_size(out)
    assert 800 < width < 2000 and 300 < height < 1200  # 2 layers x 4 heads of 12 x 12
    assert 10_000 < out.stat().st_size < 1_000_000
    rows = [line.split() for line in printed.out.splitlines() if line[:1] == " " and line.split()[0].isdigit()]
    assert [(int(row[0]), int(row[1])) for row in rows] == [(layer, head) for layer in range(2) for head in range(4)]
    entropies = [float(row[2]) for row in rows]
    assert all(0 < entropy < math.log(12) for entropy in entropies)
    assert f"graph: {tiny.artifact / files.model_filename(FP32_FUSED)}" in printed.err  # the built graph itself
    assert "attention maps of 12 tokens ... done" in printed.err  # progress, as the build shows it


def test_cli_diff_of_fp16_against_fp32_is_small_but_not_zero(tiny, tmp_path, capsys):
    out = tmp_path / "diff.png"
    argv = ["inspect", str(tiny.artifact), "--tokens", "12", "--variant", FP16_FUSED, "--diff", "--out", str(out)]
    assert cli.main(argv) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("largest")]
    assert 0 < float(line.split(": ")[1].split()[0]) < 5e-3, line
    png_size(out)


def test_cli_reads_hidden_states_from_a_file(tiny, tmp_path, capsys):
    hidden = tmp_path / "hidden.npy"
    np.save(hidden, np.random.default_rng(0).standard_normal((9, TINY.d_model)).astype(np.float32))
    assert cli.main(["inspect", str(tiny.artifact), "--input", str(hidden), "--out", str(tmp_path / "m.png")]) == 0
    assert "9 tokens ... done" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--input", "{bad}"],
            "{bad}: expected a float array of shape (1, T, 32) or (T, 32), got int64 of shape (2, 5, 32)",
        ),
        (["--input", "{tmp}/absent.npy"], "{tmp}/absent.npy: cannot read it as a .npy array"),
        (["--tokens", "513"], "--tokens: 513 tokens, more than the model's max_seq_len 512"),
        (["--diff"], "--diff compares a variant with fp32-fused: choose --variant fp16-fused"),
        (["--text", "hello"], "--text: {artifact} is an attention model (hidden states in): only a whole model"),
        (["--repeat", "4"], "--repeat: an attention model (hidden states in) reads no token ids; give --tokens"),
    ],
)
def test_cli_refuses_bad_input_clearly(tiny, tmp_path, capsys, argv, message):
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((2, 5, TINY.d_model), np.int64))
    fill = {"bad": bad, "tmp": tmp_path, "artifact": tiny.artifact}
    argv = [arg.format(**fill) for arg in argv]
    out = tmp_path / "maps.png"
    assert cli.main(["inspect", str(tiny.artifact), *argv, "--out", str(out)]) == 2
    assert f"error: {message.format(**fill)}" in capsys.readouterr().err
    assert not out.exists()


def test_cli_refuses_a_missing_artifact(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path / "nothing"), "--out", str(tmp_path / "m.png")]) == 2
    assert f"error: {tmp_path / 'nothing'}: no artifact there (no config.json)" in capsys.readouterr().err


def test_cli_makes_the_graph_from_an_artifact_without_it(tiny, tmp_path, capsys):
    """An artifact built without the fused variants: its graph is made from its config and weights."""
    bare = save_artifact(tiny.model, tmp_path / "bare")
    assert cli.main(["inspect", str(bare), "--tokens", "5", "--out", str(tmp_path / "m.png")]) == 0
    assert "made from its config and weights" in capsys.readouterr().err


# -- python -m export inspect --text: a whole model's tokens on the axes -----------------------------------

TEXT = "the cat 你好\nsat"  # spaces, a newline, and characters the byte-level BPE splits inside


def text_of_labels(labels: list[str]) -> bytes:
    """The bytes the labels stand for, read by the labels' documented rule: an open box is a space, \\n a
    newline, \\xNN one byte, any other character its UTF-8."""
    readable = {"\u2423": b" ", "\\n": b"\n"}
    pieces = []
    for label in labels:
        for piece in re.findall(r"\\x[0-9a-f]{2}|\\n|.", label, flags=re.DOTALL):
            if piece.startswith("\\x"):
                pieces.append(bytes([int(piece[2:], 16)]))
            else:
                pieces.append(readable.get(piece, piece.encode("utf-8")))
    return b"".join(pieces)


def test_cli_labels_the_maps_with_the_tokens_of_a_text(artifact_dir, tmp_path, capsys):
    """The whole artifact carries its checkpoint's byte-level BPE: the text's ids are transformers' own for
    that folder, and the labels spell the text back, a token of part of a character as its bytes."""
    from transformers import PreTrainedTokenizerFast

    artifact, out = artifact_dir(WHOLE_ARTIFACT), tmp_path / "text.png"
    assert cli.main(["inspect", str(artifact), "--text", TEXT, "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    (ids,) = [[int(i) for i in line.split()[1:]] for line in printed if line.startswith("ids: ")]
    (labels,) = [line.split()[1:] for line in printed if line.startswith("tokens: ")]
    transformers_ids = PreTrainedTokenizerFast.from_pretrained(artifact)(TEXT)["input_ids"]
    assert ids == transformers_ids and len(labels) == len(ids)
    assert text_of_labels(labels) == TEXT.encode("utf-8")  # the chatml tokenizer adds no special token
    assert any(re.fullmatch(r"(\\x[0-9a-f]{2})+", label) for label in labels)  # a piece of a character
    png_size(out)

    inspection = inspect_artifact(artifact, np.array([ids]))
    cfg = ModelConfig.load(artifact)
    figure = maps_figure(inspection, cfg, "labelled", labels)
    corner = figure.axes[(cfg.n_layers - 1) * cfg.n_heads]  # the last layer's first head: both axes labelled
    assert [tick.get_text() for tick in corner.get_xticklabels()] == labels
    assert [tick.get_text() for tick in corner.get_yticklabels()] == labels


def test_cli_refuses_text_for_a_whole_model_without_a_tokenizer(tmp_path, capsys):
    bare = save_artifact(AttentionModel(TEST_CONFIGS[WHOLE_ARTIFACT]), tmp_path / "no-tokenizer")
    out = tmp_path / "m.png"
    assert cli.main(["inspect", str(bare), "--text", TEXT, "--out", str(out)]) == 2
    assert f"error: --text: {bare} has no tokenizer.json: the model was built without a tokenizer" in (
        capsys.readouterr().err
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("token_text", "label"),
    [
        ("bytes:\\xe4\\xbd", "\\xe4\\xbd"),  # part of a character: its bytes, without token_text's mark
        (" cat", "\u2423cat"),
        ("\n\t", "\\n\\t"),
        ("a\u00a0b\u200b", "a\\u00a0b\\u200b"),  # a no-break space, a zero-width one
        ("你🙂", "你🙂"),  # whole characters stay as they are
        ("<s>", "<s>"),
    ],
)
def test_a_token_label_has_no_blank_and_names_every_byte(token_text, label):
    assert token_label(token_text) == label


# -- the 4D form (rotary, q/k norms, GQA, a window) and attention in fp32 inside an fp16 graph ----------


def test_rotary_maps_equal_the_original_stateless_and_with_a_past():
    model = AttentionModel(ROTARY).eval()
    proto = inspection_proto(model)
    hidden, mask = padded_call(ROTARY, new=30)  # past the window of 24: layer 0 excludes the oldest keys
    _, maps = run_maps(proto, ROTARY, {names.HIDDEN_STATES: hidden, names.ATTENTION_MASK: mask})
    prefill = original(model, hidden, mask)
    print(f"rotary, stateless: {assert_maps_match(maps, prefill.attention_weights, mask, ROTARY, 30):.2e}")
    step = np.random.default_rng(1).standard_normal((2, 1, ROTARY.d_model)).astype(np.float32)
    held = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    feeds = {names.HIDDEN_STATES: step, names.ATTENTION_MASK: held, **past_feeds(prefill.present)}
    _, maps = run_maps(proto, ROTARY, feeds)
    expected = original(model, step, held, prefill.present).attention_weights
    print(f"rotary, one step over a past of 30: {assert_maps_match(maps, expected, held, ROTARY, 1):.2e}")


def test_fp16_graph_whose_attention_runs_in_fp32_gives_fp16_maps():
    """Without a norm, the fp16 graph computes attention in fp32 between Casts (export/fp16.py): its
    maps are cast back to the graph's fp16 like its context."""
    cfg = ModelConfig(d_model=16, n_heads=2, n_kv_heads=1, n_layers=1, max_seq_len=64, norm="none")
    model = AttentionModel(cfg).eval()
    proto = inspection_proto(model, FP16_FUSED)
    (weights,) = [value for value in proto.graph.output if value.name == attention_map_name(0)]
    assert weights.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    hidden, mask = padded_call(cfg, new=6)
    _, (maps,) = run_maps(proto, cfg, {names.HIDDEN_STATES: hidden.astype(np.float16), names.ATTENTION_MASK: mask})
    (expected,) = original(model, hidden, mask).attention_weights
    real = mask.astype(bool)[:, None, :, None]
    assert maps.dtype == np.float16
    assert np.abs(np.where(real, maps.astype(np.float32) - expected.numpy(), 0.0)).max() < 5e-3


def test_the_build_checks_the_inspection_variants_maps_against_the_originals(artifact_dir):
    """`fp32-fused-inspect` (what the served maps come from) climbs fp32-fused's stateless ladder, and
    its maps are compared with the original's attention weights on real queries: the report keeps
    their worst error, the table's columns only the outputs and presents."""
    report = json.loads((artifact_dir("gqa") / files.REPORT_FILENAME).read_text())
    entry = report["variants"][names.INSPECTION_VARIANT]
    assert entry["passed"] and entry["file"] == files.model_filename(names.INSPECTION_VARIANT)
    maps = entry["attention_maps"]
    assert maps["passed"] and 0 < maps["max_abs"] <= 1e-5
    cfg = ModelConfig.from_dict(report["config"])
    assert sorted(maps["layers"]) == names.attention_map_names(cfg.n_layers)
    assert sorted(entry["worst"]) == sorted(names.output_names(cfg))  # no map among them
    assert entry["worst"][names.OUTPUT]["max_abs"] <= 1e-5


# -- python -m export inspect --repeat: a whole model's induction share ------------------------------------


def test_cli_repeats_random_ids_and_tables_their_induction_share(artifact_dir, tmp_path, capsys):
    """N random ids twice: the table's induction column is, per head, the mean weight the second copy's
    query N + k puts on key k + 1, read here off the PyTorch original's own weights."""
    from export.artifacts import load_model

    artifact, out, count = artifact_dir(WHOLE_ARTIFACT), tmp_path / "repeat.png", 12
    assert cli.main(["inspect", str(artifact), "--repeat", str(count), "--seed", "5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    (ids,) = [[int(i) for i in line.split()[1:]] for line in printed if line.startswith("ids: ")]
    first = ids[:count]
    assert ids == first + first and 0 not in ids
    assert len(set(first)) == count, "seed 5's ids repeat inside the first copy: the reference below assumes not"
    assert any(line.startswith("induction: ") and f"over {count} queries" in line for line in printed)
    model = load_model(artifact)
    with torch.no_grad():
        weights = model(torch.tensor([ids]), return_attention=True).attention_weights
    cfg = model.cfg
    rows = [line.split() for line in printed if line[:1] == " " and line.split()[0].isdigit()]
    assert len(rows) == cfg.n_layers * cfg.n_heads
    for row in rows:
        layer, head = int(row[0]), int(row[1])
        expected = np.mean([weights[layer][0, head, count + k, k + 1].item() for k in range(count)])
        assert float(row[-1]) == pytest.approx(expected, abs=6e-4), (layer, head)
    assert any(line.startswith("  induction heads (induction_share >= ") for line in printed)
    png_size(out)


def test_cli_refuses_a_repeat_longer_than_the_model(artifact_dir, tmp_path, capsys):
    artifact = artifact_dir(WHOLE_ARTIFACT)
    limit = ModelConfig.load(artifact).max_seq_len
    argv = ["inspect", str(artifact), "--repeat", str(limit // 2 + 1), "--out", str(tmp_path / "m.png")]
    assert cli.main(argv) == 2
    expected = (
        f"--repeat {limit // 2 + 1} (twice {limit // 2 + 1}): {limit + 2} tokens, more than the model's max_seq_len"
    )
    assert expected in capsys.readouterr().err
