"""A model folder is untrusted input (issue 47, items 2 and 4): its config.json's sizes are checked against its
weights before transformers or the exporter builds anything (`num_hidden_layers` 10^6 ran a build past 180 s
and 5 GB; `hidden_size` 10^9 was a transformers traceback), each refusal naming the field; its tokenizer.json is
refused past the size a tokenizer is taken at and when it names ids the model lacks (167 MB and 8M ids for a
320-id model cost a gateway 40 s and 3.6 GB) and when it fails on a text a prompt may hold (a pre-tokenizer regex
that backtracks past its limit), at the build and at the load; a text it fails on past those probes is a typed
error on that text, not the tokenizer's panic (a plain-text 500)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
import transformers
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from client.text import EncodeFailed, TextFileInvalid, TextModel
from contract.files import MAX_TOKENIZER_BYTES
from export.importers import WeightsError, import_weights
from tests.fixtures.text import save_tokenizer

VOCAB = 320


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("untrusted") / "tiny"
    config = transformers.LlamaConfig(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    save_tokenizer(folder, VOCAB)
    return folder


@pytest.fixture
def folder(checkpoint, tmp_path):
    """A copy of the checkpoint to spoil."""
    copy = tmp_path / "tiny"
    copy.mkdir()
    for path in checkpoint.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    return copy


def spoil_config(folder, **fields) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("num_hidden_layers", 10**6, "num_hidden_layers: the config gives 1000000, the weights 1"),
        ("hidden_size", 10**9, "hidden_size: the config gives 1000000000, the weights 32"),
        ("num_attention_heads", 10**6, "num_attention_heads: the config gives 1000000, the weights 2"),
        ("num_key_value_heads", 10**6, "num_key_value_heads: the config gives 1000000, the weights 1"),
        ("intermediate_size", 10**9, "intermediate_size: the config gives 1000000000, the weights 64"),
        ("vocab_size", 10**8, "vocab_size: the config gives 100000000, the weights 320"),
        ("max_position_embeddings", 10**9, "max_position_embeddings 1000000000: more than 2097152 positions"),
    ],
)
def test_a_config_size_the_weights_do_not_have_is_refused_before_anything_is_built(folder, field, value, said):
    spoil_config(folder, **{field: value})
    began = time.monotonic()
    with pytest.raises(WeightsError) as refused:
        import_weights(folder, "hf", {})
    assert said in str(refused.value)
    assert time.monotonic() - began < 30  # refused from the headers and the config, not after building


def test_a_tokenizer_past_the_size_taken_is_refused_at_the_build_and_at_the_load(folder):
    data = json.loads((folder / "tokenizer.json").read_text())
    padded = json.dumps(data | {"padding_note": "x" * (MAX_TOKENIZER_BYTES + 1)})
    (folder / "tokenizer.json").write_text(padded)
    with pytest.raises(WeightsError, match="MiB, more than the 64 MiB taken"):
        import_weights(folder, "hf", {})
    began = time.monotonic()
    with pytest.raises(TextFileInvalid, match="more than the 64 MiB a tokenizer is taken at"):
        TextModel.from_files({"tokenizer.json": padded.encode()})
    assert time.monotonic() - began < 1.0  # refused by its size, not parsed


def test_a_tokenizer_with_ids_past_the_models_vocabulary_is_refused(folder):
    data = json.loads((folder / "tokenizer.json").read_text())
    data["added_tokens"].append({**data["added_tokens"][-1], "id": 8_000_000, "content": "<|far|>"})
    (folder / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(WeightsError, match=r"ids run to 8000000, the model.s vocabulary \(vocab_size\) has 320"):
        import_weights(folder, "hf", {})


def backtracking(vocab: dict[str, int]) -> Tokenizer:
    """A tokenizer whose pre-tokenizer regex backtracks past onig's retry limit on a long run of "a"."""
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("(a+)+$"), behavior="isolated")
    return tokenizer


def test_a_backtracking_pre_tokenizer_is_refused_at_the_build_and_at_the_load(folder):
    data = json.loads((folder / "tokenizer.json").read_text())
    spoiled = json.loads(backtracking({"a": 0, "!": 1, "[UNK]": 2}).to_str())
    spoiled["added_tokens"] = data["added_tokens"]  # the model's special tokens, ids within its vocabulary
    (folder / "tokenizer.json").write_text(json.dumps(spoiled))
    with pytest.raises(WeightsError, match=r"fails on 'a' x 4096 then '!'.*retry-limit"):
        import_weights(folder, "hf", {})
    with pytest.raises(TextFileInvalid, match=r"tokenizer.json fails on 'a' x 4096 then '!'.*retry-limit"):
        TextModel.from_files({"tokenizer.json": json.dumps(spoiled).encode()})


def test_a_tokenizer_that_fails_on_a_text_past_the_probes_is_a_typed_error_on_that_text(checkpoint):
    """The probes cannot find every text a regex fails on: encode's failure is then EncodeFailed, not the
    tokenizer's panic (a plain-text 500), and the model keeps serving other texts."""
    text = TextModel.from_folder(checkpoint)
    text.tokenizer = backtracking({"a": 0, "!": 1, "[UNK]": 2})  # past the load's probes, as an unprobed text
    assert text.encode("aaa!")  # a short text encodes
    with pytest.raises(EncodeFailed, match="retry-limit"):
        text.encode("a" * 5000 + "!")
    assert text.encode("aa!")


def test_a_checkpoint_that_fails_half_written_leaves_no_file_behind(tmp_path):
    """A full disk (here: a file-size limit, the same EFBIG/ENOSPC to the writer) fails the write with the
    store's error and leaves no `.incoming-*` file in the session's folder."""
    script = f"""
import resource, signal
from client.store import DirectoryStore, StoreError, StoreKey
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
store = DirectoryStore({str(tmp_path)!r}, b"s" * 32)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    store.append(StoreKey("owner", "session"), 0, 1, b"x" * 100_000)
except StoreError as error:
    print("refused:", error)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert "refused:" in run.stdout and "File too large" in run.stdout, run.stdout + run.stderr
    assert not list(tmp_path.rglob(".incoming-*"))
