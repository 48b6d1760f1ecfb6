import json

import pytest

from contract.config import PRESETS, ModelConfig, preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid_and_round_trip_through_json(name, tmp_path):
    cfg = preset(name)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    cfg.save(tmp_path)
    assert ModelConfig.load(tmp_path) == cfg
    assert ModelConfig.load(tmp_path / "config.json") == cfg


def test_the_required_presets_have_their_shapes():
    assert (preset("seed").d_model, preset("seed").n_heads, preset("seed").n_kv_heads, preset("seed").n_layers) == (
        512,
        8,
        8,
        1,
    )
    assert preset("gqa").n_kv_heads < preset("gqa").n_heads
    large = preset("large")
    assert large.d_model >= 2048 and large.n_kv_heads < large.n_heads and large.n_layers >= 4


def test_derived_sizes():
    cfg = ModelConfig(d_model=96, n_heads=6, n_kv_heads=2, n_layers=3)
    assert (cfg.head_dim, cfg.kv_dim, cfg.n_rep) == (16, 32, 3)
    # W_q and W_o are 96x96, W_k and W_v 32x96, plus biases and the LayerNorm, per layer
    assert cfg.n_params() == 3 * (2 * 96 + 2 * 96 * 96 + 2 * 32 * 96 + 2 * 96 + 2 * 32)
    assert cfg.kv_cache_bytes(batch=2, length=10) == 2 * 3 * 2 * 2 * 10 * 16 * 4


def test_the_block_defaults_to_pre_norm_residual_and_ships_with_the_config(tmp_path):
    assert all((cfg.norm, cfg.residual) == ("layernorm", True) for cfg in PRESETS.values())
    bare = ModelConfig(d_model=96, n_heads=6, n_kv_heads=2, n_layers=3, norm="none", residual=False)
    assert bare.n_params() == ModelConfig(d_model=96, n_heads=6, n_kv_heads=2, n_layers=3).n_params() - 3 * 2 * 96
    bare.save(tmp_path)
    assert ModelConfig.load(tmp_path) == bare
    assert json.loads((tmp_path / "config.json").read_text())["norm"] == "none"
    # a config written before these fields existed still reads, as the block it described
    old = {k: v for k, v in bare.to_dict().items() if k not in ("norm", "residual")}
    assert (ModelConfig.from_dict(old).norm, ModelConfig.from_dict(old).residual) == ("layernorm", True)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"d_model": 100, "n_heads": 8}, r"n_heads \(8\) must divide d_model \(100\)"),
        ({"n_heads": 8, "n_kv_heads": 3}, r"n_kv_heads \(3\) must divide n_heads \(8\)"),
        ({"d_model": 0}, "d_model must be positive, got 0"),
        ({"n_heads": -2}, "n_heads must be positive, got -2"),
        ({"n_kv_heads": 0}, "n_kv_heads must be positive"),
        ({"n_layers": 0}, "n_layers must be positive"),
        ({"max_seq_len": -1}, "max_seq_len must be positive"),
        ({"d_model": 512.0}, "d_model must be an integer"),
        ({"n_layers": True}, "n_layers must be an integer"),
        ({"bias": "yes"}, "bias must be true or false"),
        ({"residual": 1}, "residual must be true or false, got 1"),
        ({"norm": "rmsnorm"}, r"norm must be one of \['layernorm', 'none'\], got 'rmsnorm'"),
        ({"norm": None}, r"norm must be one of \['layernorm', 'none'\], got None"),
        ({"norm_eps": 0}, "norm_eps must be a positive number"),
    ],
)
def test_invalid_configs_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


def test_unknown_fields_and_bad_json_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['heads'\]"):
        ModelConfig.from_dict({"d_model": 64, "heads": 4})
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_json("{d_model: 64")
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"d_model": 10, "n_heads": 4}))
    with pytest.raises(ValueError, match=r"config.json: n_heads \(4\) must divide d_model \(10\)"):
        ModelConfig.load(bad)
    with pytest.raises(FileNotFoundError, match="no model config"):
        ModelConfig.load(tmp_path / "missing")


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown preset 'huge'; choose one of \['gqa', 'large', 'seed', 'tiny'\]"):
        preset("huge")
