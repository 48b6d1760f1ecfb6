"""`python -m serving FOLDER` (serving/__main__.py, serving/triton/cli.py `export_folder`): a checkpoint folder is
built once, into artifacts named by the digest of its files, and reused while it is unchanged; what is not a
checkpoint, a command given beside a folder and an abbreviated flag are refused with the reason. (Serving a
folder end to end: the README's Hugging Face example, run by tests/test_readme.py.)"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from contract import files
from serving.__main__ import main
from serving.triton.cli import BuildFailed, export_folder, folder_digest

VOCAB = 2048  # the fortunes tokenizer's, copied beside the weights (no tokenizer trained here)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoint") / "tiny-llama"
    config = transformers.LlamaConfig(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=48, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    for name in (files.TOKENIZER_FILENAME, files.TOKENIZER_CONFIG_FILENAME, files.CHAT_TEMPLATE_FILENAME):
        shutil.copy(files.TRAINED_MODEL / name, folder / name)
    return folder


def test_a_checkpoint_is_built_once_and_anew_when_a_file_changes(checkpoint, tmp_path):
    built = export_folder(checkpoint, root=tmp_path)
    report = built / files.REPORT_FILENAME
    assert report.is_file() and (built / files.TOKENIZER_FILENAME).is_file()
    written = report.stat().st_mtime_ns
    assert export_folder(checkpoint, root=tmp_path) == built and report.stat().st_mtime_ns == written
    before = folder_digest(checkpoint)
    (checkpoint / files.GENERATION_CONFIG_FILENAME).write_text('{"eos_token_id": [0, 3]}')
    assert folder_digest(checkpoint) != before  # another build's name: the changed folder is built anew


def test_what_is_not_a_checkpoint_and_a_command_beside_a_folder_are_refused(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "holds no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main([str(tmp_path), "repository"]) == 2
    assert "served on its own" in capsys.readouterr().err


def test_a_folder_the_build_refuses_is_an_error_with_the_builds_own_words(tmp_path, capsys):
    """The build runs as `python -m export build` (no server process imports it): what it said reaches the
    caller, its exit status too, and `python -m serving FOLDER` answers with it instead of starting."""
    folder = tmp_path / "weightless"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(BuildFailed, match=r"(?s)exited 2 building .*a folder without one checkpoint") as refused:
        export_folder(folder, root=tmp_path / "artifacts")
    assert refused.value.status == 2
    assert main([str(folder)]) == 1
    assert f"error: {folder} could not be built" in capsys.readouterr().err


def test_an_abbreviated_flag_is_not_taken_for_another(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["ensure", "--weights", "folder"])  # --weights-dtype exists: argparse would take --weights for it
    assert refused.value.code == 2 and "unrecognized arguments: --weights folder" in capsys.readouterr().err


def test_several_folders_need_distinct_names_and_no_one_name_for_all(tmp_path, capsys):
    twins = [tmp_path / "a" / "model", tmp_path / "b" / "model"]
    for folder in twins:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    assert main([str(folder) for folder in twins]) == 2
    assert "two FOLDERs are named model" in capsys.readouterr().err
    assert main([str(twins[0]), str(tmp_path / "a"), "--served-model-name", "x"]) == 2
    assert "names one FOLDER's model" in capsys.readouterr().err


def test_a_failed_build_refills_the_repository_only_from_a_build_it_wrote(tmp_path):
    """`export_to` serves the variants that passed when a variant failed (the build put its report and those
    variants in place); a build that failed otherwise (a folder it could not write, a killed process) left the
    folder as it was, which may hold an older build or another model's: that one is not served."""
    import os
    import time

    from contract.config import preset
    from serving.triton.cli import _built_now

    artifacts, cfg = tmp_path / "artifacts", preset("tiny")
    artifacts.mkdir()
    cfg.save(artifacts)
    report = artifacts / files.REPORT_FILENAME
    report.write_text("{}")
    started = time.time()
    os.utime(report, (started - 60, started - 60))  # written by an earlier build
    assert not _built_now(artifacts, cfg, started)
    report.write_text("{}")  # this build's
    assert _built_now(artifacts, cfg, started)
    assert not _built_now(artifacts, preset("gqa"), started)  # another model's build
    assert not _built_now(tmp_path / "nothing", cfg, started)
