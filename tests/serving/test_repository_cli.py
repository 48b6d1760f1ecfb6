"""`python -m serving ensure`: the one-shot export of a deployment (compose's `export` service)
builds once, again only for another model or other settings, and refuses what is not a config."""

from __future__ import annotations

import json

import pytest

from contract.config import ModelConfig, preset
from contract.deployment import ServingSettings
from serving import __main__ as serving_cli
from serving.triton.cli import print_capacity
from tests.serving.helpers import as_written_before

pytestmark = pytest.mark.slow  # the first test builds artifacts


def test_ensure_builds_once_and_again_only_for_another_model_or_settings(tmp_path, capsys):
    repository = tmp_path / "models"
    command = ["ensure", "--repository", str(repository), "--preset", "tiny", "--models", "forward,sessions"]
    assert serving_cli.main(command) == 0
    assert "model repository:" in capsys.readouterr().out
    built = (repository / "sessions" / "config.pbtxt").stat().st_mtime_ns
    assert serving_cli.main(command) == 0
    assert "already holds this model; nothing to build" in capsys.readouterr().out
    assert (repository / "sessions" / "config.pbtxt").stat().st_mtime_ns == built
    as_written_before(repository)  # the models' names of before: renamed in place, nothing built
    assert serving_cli.main([*command[:-1], "mha,mha_session"]) == 0
    out = capsys.readouterr().out
    assert out.count("renamed") == 2 and "already holds this model; nothing to build" in out, out
    assert serving_cli.main([*command, "--kv-cache-mib", "8"]) == 0  # other settings: the configs are rewritten
    out = capsys.readouterr().out
    assert "model repository:" in out
    tiny = preset("tiny")  # k and v, per layer, per kv head: max_seq_len positions of head_dim floats
    row_fp32 = 2 * tiny.n_layers * tiny.n_kv_heads * tiny.max_seq_len * (tiny.d_model // tiny.n_heads) * 4
    fit = (8 << 20) // row_fp32
    assert (
        f"sessions: KV cache budget 8 MiB = {fit} sequences of up to {tiny.max_seq_len} positions on the CPU "
        f"(fp32), {(8 << 20) // (row_fp32 // 2)} on a GPU (fp16)"
    ) in out, out
    assert ("warning: only" in out) == (fit < 4)
    as_json = ["--config-json", '{"d_model": 32, "n_heads": 4, "n_kv_heads": 2, "n_layers": 1, "max_seq_len": 64}']
    assert serving_cli.main([*command[:3], *as_json]) == 0  # another model, and every model (forward_onnx too)
    assert "model repository:" in capsys.readouterr().out
    assert json.loads((repository / "forward" / "1" / "config.json").read_text())["n_kv_heads"] == 2
    # max_seq_len below 512: the TensorRT profile of forward_onnx follows the config
    profile = (repository / "forward_onnx" / "config.pbtxt").read_text()
    assert "hidden_states:8x32x32,attention_mask:8x64,past_key_values.0.key:8x2x32x8" in profile, profile


def test_ensure_refuses_a_config_that_is_not_one(tmp_path, capsys):
    bad = ["ensure", "--repository", str(tmp_path / "m"), "--config-json", '{"d_model": 64, "n_heads": 5}']
    assert serving_cli.main(bad) == 2
    assert "n_heads (5) must divide d_model (64)" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_a_budget_holding_few_sessions_is_a_warning_naming_the_option(capsys):
    """What ensure and repository print after their build (print_capacity; the build itself: the first test)."""
    # 16 MiB a sequence in fp32: 2 (k, v) x 4 heads x 32768 positions x 16 floats x 4 bytes
    long = ModelConfig(d_model=64, n_heads=4, n_kv_heads=4, n_layers=1, max_seq_len=32768)
    print_capacity(long, ServingSettings(kv_cache_bytes=48 << 20), ("forward", "sessions"))
    out = capsys.readouterr().out
    assert "KV cache budget 48 MiB = 3 sequences of up to 32768 positions on the CPU (fp32), 6 on a GPU" in out
    assert "warning: only 3 sessions fit at once on the CPU; raise --kv-cache-mib to hold more" in out
    print_capacity(long, ServingSettings(kv_cache_bytes=48 << 20), ("forward",))
    assert capsys.readouterr().out == ""  # no session model, no budget
