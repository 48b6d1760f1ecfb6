"""The quality ladder (export/quality.py): held-out bits per byte through the PyTorch original and each form
of an artifact, on a stand-in trained here in seconds (export/train.py, a tiny TrainSettings, on fortunes
written by the test). The original's score is checked against a plain whole-window cross-entropy, the
build's quality section against each form's bound, and a form made worse on purpose against its bound."""

from __future__ import annotations

import math
import platform
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from tokenizers import Tokenizer

from contract import files
from export import quality
from export.build import BuildError, build_model, quality_ladder
from export.model import AttentionModel
from export.progress import Progress
from export.report import summary_table
from export.runners import torch_runner
from export.train import SEPARATOR, Corpus, TrainSettings, train, write_folder

# head_dim 16: the static forms' GroupQueryAttention rotates a multiple of 16 channels. A context of 34 makes
# a window's inputs 49 ids: chunks of 16, 16, 16 and 1, so a static form's window ends with a decode step.
STANDIN = TrainSettings(
    vocab_size=300,
    d_model=32,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    mlp_width=64,
    context=50,
    batch=8,
    steps=60,
    warmup=6,
    held_out_every=5,
    threads=1,
)
VOCABULARY = "the cat dog sat ran on under a mat log and then slept ate quietly loudly sun moon rose fell"
WORDS = VOCABULARY.split()
# the shipped model's quantized caches are scored by the `trained_artifact` fixture (tests/export/test_train.py)
FORMS = ("fp32", "fp32-fused", "fp32-static", "fp16-fused", "fp32-fused-int8w")
BUDGET = 250  # held-out ids: a few windows, several fortunes


def write_fortunes(folder: Path, files_: int = 3, per_file: int = 40) -> Path:
    """Fortune files of short sentences from a small vocabulary, seeded (a corpus whose bigrams a tiny model
    learns in a few dozen steps)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(files_):
        entries = [
            " ".join(rng.choice(WORDS, rng.integers(4, 14))).capitalize() + "." + ("\n\t-- Anon" if i % 3 else "")
            for i in range(per_file)
        ]
        (folder / f"file{index}").write_text(SEPARATOR.join(entries) + SEPARATOR)
    return folder


def train_standin(work: Path) -> tuple[Path, AttentionModel]:
    """A checkpoint folder (config, weights, tokenizer, held_out.txt) trained on `write_fortunes`'s corpus,
    and the trained model."""
    corpus = Corpus.read(write_fortunes(work / "corpus"), STANDIN.held_out_every)
    model, tokenizer, report = train(STANDIN, corpus, Progress(enabled=False))
    write_folder(work / "checkpoint", model, tokenizer, report, corpus.held_out)
    return work / "checkpoint", model


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    """(the checkpoint folder, the PyTorch original) of the stand-in."""
    return train_standin(tmp_path_factory.mktemp("quality-standin"))


@pytest.fixture(scope="module")
def built(standin, tmp_path_factory):
    """The stand-in's artifact with FORMS, scored on its held-out text: (artifact dir, report)."""
    folder, model = standin
    out = tmp_path_factory.mktemp("quality-artifact") / "artifact"
    text = tuple(folder / name for name in files.TEXT_FILES if (folder / name).is_file())
    report = build_model(
        model, out, FORMS, Progress(enabled=False), text_files=text, held_out=folder / files.HELD_OUT_FILENAME
    )
    return out, report


def held_out_of(folder: Path, budget: int = BUDGET) -> quality.HeldOut:
    tokenizer = Tokenizer.from_file(str(folder / files.TOKENIZER_FILENAME))
    return quality.held_out_ids(tokenizer, quality.read_entries(folder / files.HELD_OUT_FILENAME), budget)


@torch.no_grad()
def whole_window_nats(model, ids: np.ndarray, length: int) -> float:
    """Windows of `length` ids stepping by length - 1, each read at once from an empty cache: summed
    next-token cross-entropy of each window's ids after its first."""
    total = 0.0
    for start in range(0, len(ids) - 1, length - 1):
        window = torch.from_numpy(ids[start : start + length])
        logits = model(window[None, :-1]).output[0]
        total += float(F.cross_entropy(logits.double(), window[1:], reduction="sum"))
    return total


def test_held_out_ids_are_the_training_stream_of_the_first_entries_within_the_budget(standin):
    folder, _ = standin
    held = held_out_of(folder)
    entries = (folder / files.HELD_OUT_FILENAME).read_text().split(SEPARATOR)[: held.entries]
    tokenizer = Tokenizer.from_file(str(folder / files.TOKENIZER_FILENAME))
    end = tokenizer.token_to_id("<|endoftext|>")
    expected = [end]
    for entry in entries:
        expected += [*tokenizer.encode(entry, add_special_tokens=False).ids, end]
    assert held.ids.tolist() == expected
    assert held.bytes == sum(len(entry.encode()) + 1 for entry in entries)
    next_entry = quality.read_entries(folder / files.HELD_OUT_FILENAME)[held.entries]
    following = len(tokenizer.encode(next_entry, add_special_tokens=False).ids) + 1
    assert len(held.ids) <= BUDGET < len(held.ids) + following  # the next entry would not fit
    assert held.of_entries > held.entries > 1


def test_original_bits_per_byte_chunked_with_a_cache_equals_whole_window_cross_entropy(standin):
    """The ladder reads each window 16 ids a run, its cache growing; read at once without a cache, the same
    windows give the same loss (to fp32 rounding), and bits/byte is that loss over the bytes in bits."""
    folder, model = standin
    held = held_out_of(folder)
    length = model.cfg.max_seq_len
    scored = quality.score(quality.runner_logits(torch_runner(model), model.cfg), held, length)
    expected = whole_window_nats(model, held.ids, length) / math.log(2) / held.bytes
    assert scored.bits_per_byte == pytest.approx(expected, rel=1e-6)
    assert 1.0 < scored.bits_per_byte < 8.0  # some learning: below a byte's 8 bits, above zero


def test_the_int8_weights_say_which_path_this_cpu_took(built):
    """8 bits where the CPU's int8 products accumulate in int32 (VNNI, AMX, not x86), 7 (reduce_range) where
    vpmaddubsw would saturate them: in report.json and the console's table, from /proc/cpuinfo's flags."""
    _, report = built
    chosen = report["variants"]["fp32-fused-int8w"]["int8_weights"]
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").is_file() else set()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    saturating = x86 and not {"avx512_vnni", "avx_vnni"} & flags
    assert (chosen["bits"], chosen["reduce_range"]) == ((7, True) if saturating else (8, False))
    assert set(chosen["cpu_features"]) == ({"avx512_vnni", "avx_vnni", "amx_int8"} & flags if x86 else set())
    assert f"int8 weights: {chosen['bits']}-bit" in summary_table(report)


def test_every_built_form_is_scored_within_its_bound(standin, built):
    folder, model = standin
    out, report = built
    section = report["quality"]
    assert sorted(section["variants"]) == sorted(FORMS)
    held = held_out_of(out, quality.DEFAULT_BUDGET)
    assert section["held_out"]["ids"] == len(held.ids) and section["held_out"]["bytes"] == held.bytes
    assert (out / files.HELD_OUT_FILENAME).read_bytes() == (folder / files.HELD_OUT_FILENAME).read_bytes()
    assert section["held_out"]["sha256"] == files.sha256(folder / files.HELD_OUT_FILENAME)
    original = whole_window_nats(model, held.ids, model.cfg.max_seq_len) / math.log(2) / held.bytes
    assert section["original"]["bits_per_byte"] == pytest.approx(original, rel=1e-6)
    for name, entry in section["variants"].items():
        relative = entry["bits_per_byte"] / original - 1
        assert abs(relative) <= entry["bound"] == quality.bound_for(name).relative, name
        assert entry["passed"] and report["variants"][name]["passed"], name
    for fp32 in ("fp32", "fp32-fused", "fp32-static"):
        assert abs(section["variants"][fp32]["relative"]) < 1e-3  # issue 33: within 0.1% of the original
    table = summary_table(report).split("quality on held_out.txt: ")[1].splitlines()
    rows = {line.split()[0]: line.split() for line in table[3:]}
    assert table[0].startswith(f"{len(held.ids):,} ids, {held.bytes:,} bytes")
    assert rows["PyTorch"][3] == f"{original:.4f}"
    assert all(
        rows[name][-1] == "pass" and rows[name][-2] == f"{entry['bound']:.2%}"
        for name, entry in section["variants"].items()
    )


def sharpened(source: Path, target: Path, factor: float) -> None:
    """`source`'s graph with its final norm's weight times `factor`: every logit scaled (a temperature)."""
    proto = onnx.load(str(source))
    for initializer in proto.graph.initializer:
        if initializer.name.endswith("final_norm.weight"):
            initializer.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(initializer) * factor, initializer.name))
    onnx.save(proto, str(target))


def test_a_form_made_worse_fails_its_bound_and_loses_its_file(standin, built, tmp_path):
    """fp32-fused with its logits scaled by 1.05 (a wrong final norm): parity's 1e-5 would catch it too, but the
    quality ladder must on its own: beyond its 0.1%, the variant fails with the reason and its file goes."""
    import shutil

    folder, model = standin
    out, report = built
    work = shutil.copytree(out, tmp_path / "artifact")
    sharpened(out / "model.fp32-fused.onnx", work / "model.fp32-fused.onnx", 1.05)
    entries = {name: dict(report["variants"][name]) for name in ("fp32", "fp32-fused")}
    section = quality_ladder(model, work, entries, folder / files.HELD_OUT_FILENAME, Progress(enabled=False))
    worse, untouched = section["variants"]["fp32-fused"], section["variants"]["fp32"]
    assert untouched["passed"] and entries["fp32"]["passed"]
    assert not worse["passed"] and abs(worse["relative"]) > worse["bound"] == 1e-3
    assert entries["fp32-fused"]["passed"] is False and entries["fp32-fused"]["file"] is None
    assert (
        "quality:" in entries["fp32-fused"]["problems"][-1]
        and "beyond its bound of 0.10%" in (entries["fp32-fused"]["problems"][-1])
    )
    assert not (work / "model.fp32-fused.onnx").exists() and (work / "model.fp32.onnx").exists()


def test_a_model_without_a_tokenizer_is_not_scored(standin, tmp_path):
    folder, model = standin
    report = build_model(
        model, tmp_path / "artifact", ("fp32",), Progress(enabled=False), held_out=folder / files.HELD_OUT_FILENAME
    )
    assert report["quality"] == {"skipped": f"no {files.TOKENIZER_FILENAME} among its text files"}
    assert not (tmp_path / "artifact" / files.HELD_OUT_FILENAME).exists()


def test_an_unreadable_held_out_text_fails_the_build_before_anything_is_built(standin, tmp_path):
    _, model = standin
    empty = tmp_path / "held_out.txt"
    empty.write_text("\n\n")
    with pytest.raises(BuildError, match=f"{empty}: no entries"):
        build_model(model, tmp_path / "artifact", ("fp32",), Progress(enabled=False), held_out=empty)
    assert not (tmp_path / "artifact").exists()
