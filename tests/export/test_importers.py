"""Importers: a trained model's state dict in each layout, onto our weights, with the config the weights
determine, proven against the module it came from; every bad key named; nothing else ever unpickled."""

import json

import pytest
import torch
from safetensors.torch import save_file

from contract import files
from contract.config import ModelConfig
from export import artifacts, importers
from export.__main__ import main as export_main
from export.importers import SourceMismatchError, WeightsError, import_weights, prefill_and_decode
from export.model import AttentionModel
from tests import user_modules

D, HEADS = 32, 4


def save(path, state: dict) -> str:
    """A state dict as a user saves it: safetensors by name, else torch.save."""
    state = {key: tensor.detach().contiguous() for key, tensor in state.items()}
    if str(path).endswith(".safetensors"):
        save_file(state, str(path))
    else:
        torch.save(state, str(path))
    return str(path)


def their_outputs(module, x, steps_from: int = 0):
    """A teaching-text module over the whole sequence with their causal mask."""
    with torch.no_grad():
        return module(x, user_modules.causal_mask(x.shape[1]))[0]


def ours(model, x, prefill: int = 5):
    with torch.no_grad():
        return prefill_and_decode(model, x, prefill)


def tokens(length: int = 21, d_model: int = D, seed: int = 0):
    return torch.randn(2, length, d_model, generator=torch.Generator().manual_seed(seed))


# --- torch-mha ----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_torch_mha_is_bare_attention_proven_against_the_module(tmp_path, batch_first, bias):
    torch.manual_seed(1)
    module = torch.nn.MultiheadAttention(D, HEADS, bias=bias, batch_first=batch_first)
    imported = import_weights(save(tmp_path / "mha.pt", module.state_dict()), "torch-mha", {"n_heads": HEADS})
    cfg = imported.model.cfg
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.n_layers, cfg.bias) == (D, HEADS, HEADS, 1, bias)
    assert (cfg.norm, cfg.residual) == ("none", False)
    check = imported.source_check
    assert check["checked"] and check["passed"] and check["max_abs"] <= 1e-5, check
    assert "32 decode steps" in check["scenario"]
    x = tokens()  # and again here, with the module as built (batch_first or not)
    with torch.no_grad():
        theirs = module(*[x if batch_first else x.transpose(0, 1)] * 3, attn_mask=torch.ones(21, 21).triu(1).bool())[0]
    theirs = theirs if batch_first else theirs.transpose(0, 1)
    torch.testing.assert_close(ours(imported.model, x), theirs, atol=1e-5, rtol=1e-5)


def test_torch_mha_with_separate_projections_and_a_list_of_modules(tmp_path):
    torch.manual_seed(2)
    modules = [torch.nn.MultiheadAttention(D, HEADS, batch_first=True) for _ in range(2)]
    state = {}
    for i, module in enumerate(modules):
        layer = module.state_dict()
        q, k, v = layer.pop("in_proj_weight").chunk(3)
        state |= {f"attn.{i}.{name}": t for name, t in layer.items()}
        state |= {f"attn.{i}.q_proj_weight": q, f"attn.{i}.k_proj_weight": k, f"attn.{i}.v_proj_weight": v}
    imported = import_weights(save(tmp_path / "two.safetensors", state), "torch-mha", {"n_heads": HEADS})
    assert imported.model.cfg.n_layers == 2 and imported.source_check["passed"]
    x = tokens()
    with torch.no_grad():
        mask = torch.ones(21, 21).triu(1).bool()
        theirs = modules[1](*[modules[0](x, x, x, attn_mask=mask)[0]] * 3, attn_mask=mask)[0]
    torch.testing.assert_close(ours(imported.model, x), theirs, atol=1e-5, rtol=1e-5)


def test_torch_mha_what_it_cannot_express_is_refused_with_the_reason(tmp_path):
    kv = torch.nn.MultiheadAttention(D, HEADS, add_bias_kv=True).state_dict()
    with pytest.raises(WeightsError, match="bias_k: add_bias_kv appends a learned key and value"):
        import_weights(save(tmp_path / "kv.pt", kv), "torch-mha", {"n_heads": HEADS})
    cross = torch.nn.MultiheadAttention(D, HEADS, kdim=16, vdim=16).state_dict()
    with pytest.raises(WeightsError) as raised:
        import_weights(save(tmp_path / "cross.pt", cross), "torch-mha", {"n_heads": HEADS})
    assert "wrong shape: k_proj_weight is [32, 16], expected [32, 32]" in raised.value.problems
    assert "wrong shape: v_proj_weight is [32, 16], expected [32, 32]" in raised.value.problems


def test_a_module_that_does_not_match_fails_the_proof(tmp_path, monkeypatch):
    """The proof is real: a slip in the mapping (q and k swapped) is caught before anything is built."""
    module = torch.nn.MultiheadAttention(D, HEADS, batch_first=True)
    swap = importers.TorchMHALayout.convert

    def swapped(self, tensors, cfg, layer):
        converted = swap(self, tensors, cfg, layer)
        converted["attn.W_q.weight"], converted["attn.W_k.weight"] = (
            converted["attn.W_k.weight"],
            converted["attn.W_q.weight"],
        )
        return converted

    monkeypatch.setattr(importers.TorchMHALayout, "convert", swapped)
    with pytest.raises(SourceMismatchError, match=r"differs from torch.nn.MultiheadAttention\(embed_dim=32"):
        import_weights(save(tmp_path / "mha.pt", module.state_dict()), "torch-mha", {"n_heads": HEADS})


# --- seeds --------------------------------------------------------------------------------------


def test_seeds_mha_and_gqa_match_the_teaching_modules(tmp_path):
    torch.manual_seed(3)
    for module, given in [
        (user_modules.MultiHeadAttention(D, HEADS), {"n_heads": HEADS}),
        (user_modules.GroupedQueryAttention(D, HEADS, 2), {"n_kv_heads": 2}),
    ]:
        imported = import_weights(save(tmp_path / "seeds.pt", module.state_dict()), "seeds", given)
        cfg = imported.model.cfg
        assert (cfg.n_heads, cfg.norm, cfg.residual) == (HEADS, "none", False)
        assert (cfg.n_kv_heads, cfg.bias) == ((HEADS, True) if given.get("n_heads") else (2, False))
        assert not imported.source_check["checked"] and "teaching code" in imported.source_check["reason"]
        x = tokens(37)
        torch.testing.assert_close(ours(imported.model, x), their_outputs(module, x), atol=1e-5, rtol=1e-5)


def test_seeds_layers_under_a_numbered_prefix_are_a_stack(tmp_path):
    modules = [user_modules.MultiHeadAttention(D, HEADS) for _ in range(3)]
    state = {f"blocks.{i}.attn.{k}": t for i, m in enumerate(modules) for k, t in m.state_dict().items()}
    imported = import_weights(save(tmp_path / "stack.safetensors", state), "seeds", {"n_heads": HEADS})
    assert imported.model.cfg.n_layers == 3
    x = tokens()
    theirs = x
    for module in modules:
        theirs = their_outputs(module, theirs)
    torch.testing.assert_close(ours(imported.model, x), theirs, atol=1e-5, rtol=1e-5)


def test_every_bad_key_is_listed_with_its_shapes_and_nothing_is_written(tmp_path, capsys):
    state = user_modules.MultiHeadAttention(D, HEADS).state_dict()
    del state["W_v.bias"]
    state["W_o.weight"] = torch.randn(D, 16)
    state["norm1.weight"] = torch.ones(D)
    path = save(tmp_path / "bad.pt", state)
    with pytest.raises(WeightsError) as raised:
        import_weights(path, "seeds", {"n_heads": HEADS})
    assert raised.value.problems[:3] == [
        "missing: W_v.bias (expected shape [32])",
        "wrong shape: W_o.weight is [32, 16], expected [32, 32]",
        "unexpected: norm1.weight (shape [32])",
    ]
    out = tmp_path / "out"
    assert export_main(["build", "--weights", path, "--layout", "seeds", "--n-heads", "4", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "missing: W_v.bias (expected shape [32])" in err and "Traceback" not in err
    assert not out.exists()


# --- hf -----------------------------------------------------------------------------------------


def hf_checkpoint(n_layers=2, d=D, heads=HEADS, kv_heads=2, qkv_bias=False, norm=False, seed=4) -> dict:
    g = torch.Generator().manual_seed(seed)
    hd = d // heads
    widths = {"q": heads * hd, "k": kv_heads * hd, "v": kv_heads * hd, "o": d}
    state = {}
    for i in range(n_layers):
        prefix = f"model.layers.{i}."
        for p, rows in widths.items():
            state[f"{prefix}self_attn.{p}_proj.weight"] = torch.randn(rows, d, generator=g) / d**0.5
            if qkv_bias and p != "o":
                state[f"{prefix}self_attn.{p}_proj.bias"] = 0.1 * torch.randn(rows, generator=g)
        if norm:
            state[f"{prefix}input_layernorm.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
            state[f"{prefix}input_layernorm.bias"] = 0.1 * torch.randn(d, generator=g)
    return state


def test_hf_gqa_without_a_norm_is_a_stack_of_bare_attention(tmp_path):
    imported = import_weights(
        save(tmp_path / "model.safetensors", hf_checkpoint()), "hf", {"n_heads": HEADS}, attention_only=True
    )
    cfg = imported.model.cfg
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.n_layers, cfg.bias, cfg.norm, cfg.residual) == (
        4,
        2,
        2,
        False,
        "none",
        False,
    )


def test_hf_decoder_matches_the_module_it_came_from(tmp_path):
    torch.manual_seed(5)
    module = user_modules.HuggingFaceStyle(D, HEADS, 2, num_layers=2).eval()
    imported = import_weights(
        save(tmp_path / "model.safetensors", module.state_dict()), "hf", {"n_kv_heads": 2}, attention_only=True
    )
    cfg = imported.model.cfg
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.norm, cfg.residual, cfg.bias) == (HEADS, 2, "layernorm", True, True)
    x = tokens(39)
    with torch.no_grad():
        torch.testing.assert_close(ours(imported.model, x), module(x), atol=1e-5, rtol=1e-5)


def test_hf_with_input_layernorm_and_qwen_style_biases(tmp_path):
    state = hf_checkpoint(norm=True, qkv_bias=True)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "tiny", "num_attention_heads": 4, "num_key_value_heads": 2, "layer_norm_eps": 1e-6})
    )
    imported = import_weights(save(tmp_path / "model.safetensors", state), "hf", attention_only=True)
    cfg = imported.model.cfg
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.norm, cfg.residual, cfg.bias, cfg.norm_eps) == (
        4,
        2,
        "layernorm",
        True,
        True,
        1e-6,
    )
    assert imported.weights["zero_biases"] == ["W_o"]
    weights = imported.model.state_dict()
    assert torch.equal(weights["layers.1.attn.W_o.bias"], torch.zeros(D))
    assert torch.equal(weights["layers.1.norm.bias"], state["model.layers.1.input_layernorm.bias"])
    assert torch.equal(weights["layers.0.attn.W_k.bias"], state["model.layers.0.self_attn.k_proj.bias"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda s, d: d.write_text(
                json.dumps({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}})
            ),
            "rope scaling 'yarn': this model scales rotary frequencies as",
        ),
        (
            lambda s, d: d.write_text(
                json.dumps({"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]})
            ),
            "layer_types .*: this model windows all layers but every N-th",
        ),
        (
            lambda s, d: s.pop("model.layers.1.input_layernorm.bias"),
            r"missing: model.layers.1.input_layernorm.bias \(expected shape \[32\]\)",
        ),
        (
            lambda s, d: s.update({"model.layers.0.self_attn.q_prj.weight": torch.ones(D, D)}),
            r"unexpected: model.layers.0.self_attn.q_prj.weight \(shape \[32, 32\]\)",
        ),
    ],
    ids=["rope-yarn", "window-pattern", "norm-mixed", "typo"],
)
def test_hf_what_this_model_cannot_express_is_refused_with_the_reason(tmp_path, change, message):
    state = hf_checkpoint(norm=True)
    change(state, tmp_path / "config.json")
    with pytest.raises(WeightsError, match=message):
        import_weights(save(tmp_path / "model.safetensors", state), "hf", {"n_heads": HEADS}, attention_only=True)


def test_hf_a_whole_checkpoint_is_taken_for_its_attention_and_the_rest_listed(tmp_path):
    """Embeddings, MLPs, other norms, the head and old rotary buffers are left out by group, not refused."""
    state = hf_checkpoint(norm=True)
    state |= {
        "model.embed_tokens.weight": torch.ones(10, D),
        "model.norm.weight": torch.ones(D),
        "lm_head.weight": torch.ones(10, D),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4),
    }
    for i in range(2):
        state |= {
            f"model.layers.{i}.mlp.{name}.weight": torch.ones(8, D) for name in ("gate_proj", "up_proj", "down_proj")
        }
        state[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(D)
    imported = import_weights(
        save(tmp_path / "model.safetensors", state), "hf", {"n_heads": HEADS}, attention_only=True
    )
    assert imported.weights["left_out"] == {
        "lm_head": "1 key",
        "model.embed_tokens": "1 key",
        "model.layers.{i}.mlp": "3 keys per layer x 2 layers",
        "model.layers.{i}.post_attention_layernorm": "1 key per layer x 2 layers",
        "model.layers.{i}.self_attn": "1 key per layer x 1 layers",
        "model.norm": "1 key",
    }
    assert imported.model.cfg.n_layers == 2


# --- hf, whole: what a whole import cannot represent is refused before anything is written -----------
# (the six families' whole imports, proven against transformers: tests/export/test_hf_families.py)


def whole_llama(tmp_path, config: dict) -> dict:
    """A whole Llama-shaped checkpoint's keys (2 layers, vocab 10, MLP 8 wide) with its config.json."""
    state = hf_checkpoint()
    state |= {"model.embed_tokens.weight": torch.ones(10, D), "model.norm.weight": torch.ones(D)}
    state["lm_head.weight"] = torch.ones(10, D)
    for i in range(2):
        state |= {f"model.layers.{i}.{n}_layernorm.weight": torch.ones(D) for n in ("input", "post_attention")}
        state |= {f"model.layers.{i}.mlp.{n}_proj.weight": torch.ones(8, D) for n in ("gate", "up")}
        state[f"model.layers.{i}.mlp.down_proj.weight"] = torch.ones(D, 8)
    defaults = {"model_type": "llama", "num_attention_heads": HEADS, "num_key_value_heads": 2, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(defaults | config))
    return state


@pytest.mark.parametrize(
    ("config", "change", "message"),
    [
        ({"num_local_experts": 8}, None, "num_local_experts 8: a mixture of experts"),
        ({"use_parallel_residual": True}, None, "use_parallel_residual True: a parallel residual"),
        ({"hidden_act": "relu"}, None, "hidden_act 'relu': this model's MLP activations are"),
        ({"model_type": "gemma"}, None, "model_type 'gemma': Gemma scales the embeddings"),
        ({"attn_logit_softcapping": 50.0}, None, "attention softcapping"),
        ({"scale_attn_by_inverse_layer_idx": True}, None, "scores divided by the layer's number"),
        ({"vocab_size": 12}, None, "vocab_size: the config gives 12, the weights 10"),
        ({}, lambda s: s.update({"model.layers.0.mlp.experts.0.w1.weight": torch.ones(8, D)}), "a mixture of experts"),
        ({}, lambda s: s.update({"model.extra.weight": torch.ones(D)}), r"(?s)unexpected: model.extra.weight .*nothin"),
        ({}, lambda s: s.pop("model.norm.weight"), r"missing: model.norm.weight \(expected shape \[32\]\)"),
        ({}, lambda s: s.pop("model.embed_tokens.weight"), "no token embeddings .*--attention-only imports"),
    ],
    ids=[
        "moe",
        "parallel",
        "relu",
        "gemma",
        "softcap",
        "gpt2-inverse",
        "vocab",
        "experts",
        "unknown",
        "no-norm",
        "no-embed",
    ],
)
def test_hf_whole_what_this_model_cannot_represent_is_refused_with_the_reason(tmp_path, config, change, message):
    state = whole_llama(tmp_path, config)
    if change:
        change(state)
    weights = save(tmp_path / "model.safetensors", state)
    with pytest.raises(WeightsError, match=message):
        import_weights(weights, "hf")
    assert export_main(["build", "--weights", weights, "--layout", "hf", "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_attention_only_goes_with_the_hf_layout(tmp_path, capsys):
    weights = save(tmp_path / "mha.pt", torch.nn.MultiheadAttention(D, HEADS).state_dict())
    argv = ["build", "--weights", weights, "--layout", "torch-mha", "--attention-only", "--out", str(tmp_path / "o")]
    assert export_main(argv) == 2
    assert "--attention-only goes with --layout hf" in capsys.readouterr().err


# --- native and the config ----------------------------------------------------------------------


def test_a_file_in_another_layout_is_told_which_layout_it_is(tmp_path):
    hf_file = save(tmp_path / "model.safetensors", hf_checkpoint())
    mha_file = save(tmp_path / "mha.pt", torch.nn.MultiheadAttention(D, HEADS).state_dict())
    for path, given, fits in (
        (hf_file, "torch-mha", "hf"),
        (hf_file, "native", "hf"),
        (mha_file, "seeds", "torch-mha"),
    ):
        with pytest.raises(WeightsError) as raised:
            import_weights(path, given, {"n_heads": HEADS})
        message = str(raised.value)
        assert f"not the `{given}` layout" in message and f"give --layout {fits}" in message, message
    with pytest.raises(WeightsError) as raised:  # keys no layout knows: no layout is suggested
        import_weights(save(tmp_path / "other.pt", {"encoder.weight": torch.zeros(4, 4)}), "hf", {"n_heads": 2})
    assert "not the `hf` layout" in str(raised.value) and "give --layout" not in str(raised.value)


def test_native_round_trips_an_artifact(tmp_path):
    cfg = ModelConfig(d_model=48, n_heads=6, n_kv_heads=2, n_layers=2, max_seq_len=300, norm_eps=1e-6)
    model = AttentionModel(cfg, seed=9)
    artifacts.save_artifact(model, tmp_path)
    imported = import_weights(tmp_path / files.WEIGHTS_FILENAME, "native")
    assert imported.model.cfg == cfg  # n_heads, max_seq_len and norm_eps from the config.json beside it
    for name, tensor in model.state_dict().items():
        assert torch.equal(imported.model.state_dict()[name], tensor)
    bare = AttentionModel(ModelConfig(d_model=32, n_heads=4, n_kv_heads=4, norm="none", residual=False), seed=1)
    (tmp_path / "alone").mkdir()  # no config.json beside it: the heads come from the caller
    save(tmp_path / "alone" / "bare.safetensors", bare.state_dict())
    assert import_weights(tmp_path / "alone" / "bare.safetensors", "native", {"n_heads": 4}).model.cfg == bare.cfg


def test_the_heads_and_conflicting_fields_are_named(tmp_path):
    path = save(tmp_path / "gqa.pt", user_modules.GroupedQueryAttention(D, HEADS, 2).state_dict())
    with pytest.raises(
        WeightsError,
        match=r"do not tell the number of heads: give --n-heads \(the query width 32: one of \[2, 4, 8, 16, 32\]\)",
    ):
        import_weights(path, "seeds")
    with pytest.raises(WeightsError, match="d_model: the config gives 64, the weights 32"):
        import_weights(path, "seeds", {"n_heads": 4, "d_model": 64})
    with pytest.raises(WeightsError, match="n_kv_heads: the config gives 4, the weights 2"):
        import_weights(path, "seeds", {"n_heads": 4, "n_kv_heads": 4})
    with pytest.raises(WeightsError, match=r"unknown config field\(s\) \['heads'\]"):
        import_weights(path, "seeds", {"n_heads": 4, "heads": 4})
    assert import_weights(path, "seeds", {"n_heads": 4, "max_seq_len": 100, "residual": True}).model.cfg.residual


def test_files_are_read_without_unpickling_anything(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (marker.write_text, ("arbitrary code ran",))

    torch.save({"W_q.weight": Payload()}, str(tmp_path / "evil.pt"))
    with pytest.raises(WeightsError, match=r"torch.load\(weights_only=True\)"):
        import_weights(tmp_path / "evil.pt", "seeds", {"n_heads": 4})
    assert not marker.exists()
    torch.save(
        user_modules.MultiHeadAttention(D, HEADS), str(tmp_path / "module.pt")
    )  # a whole module, not a state dict
    with pytest.raises(WeightsError, match="weights_only"):
        import_weights(tmp_path / "module.pt", "seeds", {"n_heads": 4})
    torch.save({"state_dict": user_modules.MultiHeadAttention(D, HEADS).state_dict()}, str(tmp_path / "nested.pt"))
    with pytest.raises(
        WeightsError, match=r"state_dict: a OrderedDict, not a tensor: save module.state_dict\(\) itself"
    ):
        import_weights(tmp_path / "nested.pt", "seeds", {"n_heads": 4})


# --- the CLI ------------------------------------------------------------------------------------


def test_build_from_weights_records_where_they_came_from(tmp_path, capsys):
    module = torch.nn.MultiheadAttention(D, HEADS, batch_first=True)
    path = save(tmp_path / "mha.pt", module.state_dict())
    out = tmp_path / "out"
    argv = [
        "build",
        "--weights",
        path,
        "--layout",
        "torch-mha",
        "--n-heads",
        "4",
        "--out",
        str(out),
        "--variants",
        "fp32",
    ]
    assert export_main(argv) == 0
    printed = capsys.readouterr().out
    assert "checked against torch.nn.MultiheadAttention(embed_dim=32, num_heads=4" in printed
    report = json.loads((out / files.REPORT_FILENAME).read_text())
    assert "seed" not in report
    assert report["weights"]["layout"] == "torch-mha" and report["weights"]["file"] == path
    assert report["weights"]["sha256"] == files.sha256(tmp_path / "mha.pt")
    assert report["source_check"]["passed"] and report["config"]["norm"] == "none"
    assert artifacts.load_model(out).cfg == ModelConfig.from_dict(report["config"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--weights", "w.pt"], "--weights needs --layout"),
        (["--layout", "seeds"], "--layout goes with --weights"),
        (["--weights", "w.pt", "--layout", "seeds", "--preset", "tiny"], "--weights brings its own"),
        (["--weights", "w.pt", "--layout", "seeds", "--seed", "3"], "--weights brings its own"),
        (["--n-heads", "4"], "go with --weights"),
    ],
)
def test_flags_that_do_not_go_together(tmp_path, capsys, argv, message):
    assert export_main(["build", "--out", str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err
