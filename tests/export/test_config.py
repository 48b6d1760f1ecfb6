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
    classic = [cfg for name, cfg in PRESETS.items() if not name.startswith("llama")]  # llama: RMSNorm, as Llama ships
    assert all((cfg.norm, cfg.residual, cfg.rotary) == ("layernorm", True, False) for cfg in classic)
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
        ({"norm": "batchnorm"}, r"norm must be one of \['layernorm', 'rmsnorm', 'none'\], got 'batchnorm'"),
        ({"norm": None}, r"norm must be one of \['layernorm', 'rmsnorm', 'none'\], got None"),
        ({"norm_eps": 0}, "norm_eps must be a positive number"),
        ({"qk_norm": "layernorm"}, r"qk_norm must be one of \['none', 'rmsnorm'\], got 'layernorm'"),
        ({"head_dim": 0}, "head_dim must be positive, got 0"),
        ({"d_model": 100, "n_heads": 8, "head_dim": 0}, "head_dim must be positive"),
        ({"rope_theta": 0}, "rope_theta must be a positive number, got 0"),
        ({"rope_theta": "1e4"}, "rope_theta must be a positive number, got '1e4'"),
        ({"rope_theta": 1e4, "rotary_dim": 7}, "rotary_dim must be even and at most head_dim 64, got 7"),
        ({"rope_theta": 1e4, "rotary_dim": 66}, "rotary_dim must be even and at most head_dim 64, got 66"),
        ({"rope_theta": 1e4, "rope_pairing": "gptj"}, r"rope_pairing must be one of \['half', 'interleaved'\]"),
        ({"rope_theta": 1e4, "rope_scaling": "yarn"}, r"rope_scaling must be one of \['none', 'linear', 'llama3'\]"),
        ({"rope_theta": 1e4, "rope_scaling_factor": -8.0}, "rope_scaling_factor must be a positive number"),
        (
            {"rope_theta": 1e4, "rope_scaling": "llama3", "rope_low_freq_factor": 4.0, "rope_high_freq_factor": 1.0},
            r"rope_low_freq_factor \(4.0\) must be below rope_high_freq_factor \(1.0\)",
        ),
        ({"rotary_dim": 32}, "rotary_dim set without rope_theta: rotary embeddings are off"),
        ({"sliding_window": 0}, "sliding_window must be positive, got 0"),
        ({"sliding_window": 4, "sliding_window_pattern": 0}, "sliding_window_pattern must be positive"),
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
    with pytest.raises(
        ValueError,
        match=r"unknown preset 'huge'; choose one of \['gqa', 'large', 'llama', 'llama-whole', 'seed', 'tiny'\]",
    ):
        preset("huge")
