"""export/train.py and the model it trained (models/fortunes): seeded training, a Hugging Face folder the importer
proves against transformers, and the shipped checkpoint's report."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from contract.files import HELD_OUT_FILENAME, TRAINED_MODEL
from export.importers import import_weights
from export.progress import Progress
from export.train import train, write_folder
from export.training import REPORT_FILE, SEPARATOR, WEIGHTS_FILE, Corpus, TrainingError, TrainSettings

TINY = TrainSettings(
    vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_width=48, context=32, batch=4, steps=12,
    warmup=2, held_out_every=4, threads=1,
)  # fmt: skip
LINES = (
    "A fool and his money are soon parted.",
    "Never put off till tomorrow what you can do the day after tomorrow.",
    "The early bird gets the worm, but the second mouse gets the cheese.",
    "Q: How many programmers does it take to change a light bulb?\nA: None, that's a hardware problem.",
    "He who laughs last thinks slowest.",
    "A day without sunshine is like night.",
)


@pytest.fixture(scope="module")
def corpus_folder(tmp_path_factory):
    """Two fortune files (entries between lines of `%`), plus the index files fortune keeps beside them."""
    folder = tmp_path_factory.mktemp("fortunes")
    (folder / "wisdom").write_text(SEPARATOR.join(LINES[:3] * 6) + SEPARATOR)
    (folder / "jokes").write_text(SEPARATOR.join(LINES[3:] * 6) + SEPARATOR)
    (folder / "jokes.dat").write_bytes(b"\x00\x02 not text")
    return folder


def trained(folder, out=None):
    corpus = Corpus.read(folder, TINY.held_out_every)
    model, tokenizer, report = train(TINY, corpus, Progress(enabled=False))
    if out is not None:
        write_folder(out, model, tokenizer, report, corpus.held_out)
    return model, report


def test_train_is_seeded_and_repeatable(corpus_folder):
    first, report = trained(corpus_folder)
    second, _ = trained(corpus_folder)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert report["tokens_seen"] == TINY.steps * TINY.batch * TINY.context
    assert report["corpus"]["held_out_fortunes"] == 9  # every 4th of 36 entries, the .dat file left out


def test_train_writes_a_checkpoint_that_imports_and_matches_transformers(corpus_folder, tmp_path):
    """The importer reads the folder as any Llama checkpoint and proves it against transformers' LlamaForCausalLM:
    the names written (export/importers.py's table backwards) are the ones transformers loads."""
    model, _ = trained(corpus_folder, tmp_path)
    imported = import_weights(tmp_path, "hf", {})
    assert imported.source_check["passed"], imported.source_check
    assert imported.model.cfg == model.cfg
    for name, tensor in model.state_dict().items():
        assert torch.equal(imported.model.state_dict()[name], tensor), name
    assert {path.name for path in imported.text_files} >= {"tokenizer.json", "chat_template.jinja"}
    held_out = (tmp_path / HELD_OUT_FILENAME).read_text().split(SEPARATOR)
    assert held_out[:-1] == Corpus.read(corpus_folder, TINY.held_out_every).held_out


def test_train_refuses_a_missing_corpus_naming_the_package(tmp_path):
    with pytest.raises(TrainingError, match="apt-get install fortunes"):
        Corpus.read(tmp_path / "absent", 20)
    result = subprocess.run(
        [sys.executable, "-m", "export", "train", "--out", str(tmp_path / "out"), "--corpus", str(tmp_path / "absent")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2 and "install Debian's fortunes package" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_train_shipped_model_has_learned_beyond_ngrams():
    """The shipped checkpoint's own report: under 16 MB, every weight finite, and its held-out loss below a bigram
    model's and a unigram model's of the same tokens (bits per byte, so the numbers compare across tokenizers)."""
    size = sum(path.stat().st_size for path in TRAINED_MODEL.iterdir())
    assert size <= 16 * 1024 * 1024, size
    report = json.loads((TRAINED_MODEL / REPORT_FILE).read_text())
    held, baselines = report["held_out"], report["baselines"]
    assert held["bits_per_byte"] < baselines["bigram"]["bits_per_byte"] < baselines["unigram"]["bits_per_byte"]
    assert math.isclose(held["perplexity"], math.exp(held["nats_per_token"]), rel_tol=1e-9)
    weights = load_file(TRAINED_MODEL / WEIGHTS_FILE)
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    config = json.loads((TRAINED_MODEL / "config.json").read_text())
    assert config["num_hidden_layers"] == report["settings"]["n_layers"]


def test_train_shipped_model_keeps_its_loss_through_the_served_and_quantized_forms(trained_artifact):
    """The quality ladder on the shipped model, as `make serve` builds it: the held-out bits per byte of the fp32
    served form within 0.1% of the PyTorch original's, and each quantized cache's cost within its stated bound
    (export/quality.py BOUNDS): int8 0.1%, int4 1%."""
    quality = json.loads((trained_artifact / "report.json").read_text())["quality"]
    forms = quality["variants"]
    assert set(forms) == {"fp32-fused", "fp32-static", "fp32-static-int8kv", "fp32-static-int4kv"}
    assert abs(forms["fp32-static"]["relative"]) <= 1e-3 and abs(forms["fp32-fused"]["relative"]) <= 1e-3
    assert forms["fp32-static-int8kv"]["bound"] == 1e-3 and forms["fp32-static-int4kv"]["bound"] == 1e-2
    assert all(entry["passed"] and abs(entry["relative"]) <= entry["bound"] for entry in forms.values()), forms
    assert 1.5 < quality["original"]["bits_per_byte"] < 2.5  # the training report's 2.14 on all of held_out.txt
