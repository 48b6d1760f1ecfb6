"""The PyTorch original against the math (tests/reference.py) and against itself (the cache)."""

import numpy as np
import pytest
import torch

from contract import files
from contract.config import ModelConfig
from contract.inputs import InputError
from export import artifacts
from export.model import AttentionModel, KVCache
from tests import reference

MHA = ModelConfig(d_model=48, n_heads=4, n_kv_heads=4, n_layers=2, max_seq_len=256)
GQA = ModelConfig(d_model=48, n_heads=6, n_kv_heads=2, n_layers=2, max_seq_len=256)
MQA_NO_BIAS = ModelConfig(d_model=32, n_heads=4, n_kv_heads=1, n_layers=1, bias=False)
# the block's parts: bare attention (torch.nn.MultiheadAttention, the teaching texts'), and each part alone
BARE = ModelConfig(d_model=48, n_heads=6, n_kv_heads=2, n_layers=2, norm="none", residual=False)
NORM_ONLY = ModelConfig(d_model=48, n_heads=4, n_kv_heads=4, n_layers=2, residual=False)
RESIDUAL_ONLY = ModelConfig(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, norm="none")
# the attention people ship: Llama (RMSNorm, RoPE, no biases), partial and interleaved rotary with linear
# scaling (Phi, GPT-J), Qwen3 (q/k norms, a head_dim of its own), Mistral and Gemma (sliding windows,
# here every other layer) with Llama 3's frequency scaling (its original context small, so it bites)
LLAMA = ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, bias=False, norm="rmsnorm", rope_theta=1e4)
PARTIAL = ModelConfig(
    d_model=64,
    n_heads=4,
    n_kv_heads=4,
    n_layers=1,
    rope_theta=1e4,
    rotary_dim=8,
    rope_pairing="interleaved",
    rope_scaling="linear",
    rope_scaling_factor=2.0,
)
QWEN3 = ModelConfig(
    d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, head_dim=24, norm="rmsnorm", qk_norm="rmsnorm", rope_theta=1e6
)
WINDOWED = ModelConfig(
    d_model=48,
    n_heads=4,
    n_kv_heads=2,
    n_layers=2,
    norm="rmsnorm",
    rope_theta=500.0,
    sliding_window=4,
    sliding_window_pattern=2,
    rope_scaling="llama3",
    rope_scaling_factor=8.0,
    rope_original_max_position=32,
)
MODERN = {"llama": LLAMA, "partial-interleaved": PARTIAL, "qwen3": QWEN3, "windowed": WINDOWED}


def weights_of(model: AttentionModel) -> dict[str, np.ndarray]:
    return {name: t.detach().double().numpy() for name, t in model.state_dict().items()}


def left_padded_mask(batch: int, length: int, padding: list[int]) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.int64)
    for row, pad in enumerate(padding):
        mask[row, :pad] = 0
    return mask


def random_past(cfg: ModelConfig, batch: int, length: int, seed: int = 1) -> list[KVCache]:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, cfg.n_kv_heads, length, cfg.head_dim)
    return [KVCache(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(cfg.n_layers)]


@pytest.mark.parametrize(
    "cfg",
    [MHA, GQA, MQA_NO_BIAS, BARE, NORM_ONLY, RESIDUAL_ONLY, *MODERN.values()],
    ids=["mha", "gqa", "mqa-no-bias", "bare", "norm-only", "residual-only", *MODERN],
)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("past_length", [0, 5])
def test_model_matches_the_naive_loop(cfg, padded, past_length):
    model = AttentionModel(cfg, seed=3).eval()
    B, T = 3, 6
    x = torch.randn(B, T, cfg.d_model, generator=torch.Generator().manual_seed(0))
    past = random_past(cfg, B, past_length) if past_length else None
    mask = left_padded_mask(B, past_length + T, [0, 2, 4] if padded else [0, 0, 0])

    with torch.no_grad():
        result = model(x, mask, past)
    expected, presents = reference.forward(
        cfg, weights_of(model), x.numpy(), mask.numpy(), [(k.numpy(), v.numpy()) for k, v in past] if past else None
    )

    # a padded query's output, and so what later layers cache at its position, is unspecified
    real = reference.real_rows(mask.numpy(), T)
    np.testing.assert_allclose(result.output.numpy()[real], expected[real], atol=1e-5, rtol=1e-5)
    real_keys = mask.numpy() == 1  # (B, P+T)
    for cache, (key, value) in zip(result.present, presents, strict=True):
        for ours, theirs in [(cache.key.numpy(), key), (cache.value.numpy(), value)]:
            np.testing.assert_allclose(
                ours.transpose(0, 2, 1, 3)[real_keys], theirs.transpose(0, 2, 1, 3)[real_keys], atol=1e-5, rtol=1e-5
            )


@pytest.mark.parametrize("cfg", list(MODERN.values()), ids=list(MODERN))
def test_given_positions_place_the_tokens_and_a_cache_continues_them(cfg):
    """A prefill at explicit positions, then one token at a time at the next positions, equals the
    reference at those positions, and the cached keys are the rotated ones."""
    model = AttentionModel(cfg, seed=5).eval()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, cfg.d_model, generator=g)
    positions = torch.tensor([list(range(3, 12)), list(range(20, 29))])  # two rows at different offsets
    with torch.no_grad():
        whole = model(x, position_ids=positions)
        cache, outputs = None, []
        for t in range(9):
            step = model(x[:, t : t + 1], past=cache, position_ids=positions[:, t : t + 1])
            cache = step.present
            outputs.append(step.output)
    expected, _ = reference.forward(cfg, weights_of(model), x.numpy(), positions=positions.numpy())
    np.testing.assert_allclose(whole.output.numpy(), expected, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(torch.cat(outputs, dim=1).numpy(), expected, atol=1e-5, rtol=1e-5)


def test_positions_beyond_the_rotary_table_are_refused():
    model = AttentionModel(LLAMA).eval()
    with pytest.raises(InputError, match=r"input 'position_ids': positions must lie in \[0, 4096\).*got 4096"):
        model(torch.zeros(1, 1, LLAMA.d_model), position_ids=torch.tensor([[4096]]))
    with pytest.raises(InputError, match=r"input 'position_ids': positions must lie in .*got -1"):
        model(torch.zeros(1, 2, LLAMA.d_model), position_ids=torch.tensor([[-1, 0]]))
    with pytest.raises(InputError, match=r"position_ids.*expected dtype int64, got float32"):
        model(torch.zeros(1, 1, LLAMA.d_model), position_ids=torch.tensor([[1.0]]))
    with pytest.raises(InputError, match="unknown input"):  # a model without rotary takes no positions
        AttentionModel(GQA)(torch.zeros(1, 1, GQA.d_model), position_ids=torch.tensor([[1]]))


def test_padded_queries_give_finite_outputs():
    model = AttentionModel(GQA).eval()
    x = torch.randn(2, 5, GQA.d_model)
    mask = left_padded_mask(2, 5, [4, 0])  # row 0: four padded queries see nothing
    with torch.no_grad():
        result = model(x, mask, return_attention=True)
    assert torch.isfinite(result.output).all()
    assert all(torch.isfinite(w).all() for w in result.attention_weights)


def test_attention_weights_are_causal_ignore_padding_and_sum_to_one():
    cfg, B, P, T = GQA, 3, 4, 6
    model = AttentionModel(cfg).eval()
    mask = left_padded_mask(B, P + T, [0, 3, 6])
    mask[1, 7] = 0  # a hole in the middle of row 1 as well
    with torch.no_grad():
        result = model(torch.randn(B, T, cfg.d_model), mask, random_past(cfg, B, P), return_attention=True)
    for weights in result.attention_weights:
        assert weights.shape == (B, cfg.n_heads, T, P + T)
        query_real = mask[:, P:].bool()  # (B, T)
        sums = weights.sum(-1)  # (B, nh, T)
        torch.testing.assert_close(sums, torch.ones_like(sums))
        for b, t in query_real.nonzero().tolist():  # a padded query's row is unspecified
            assert (weights[b, :, t, P + t + 1 :] == 0).all(), "a query attended a later key"
        on_padding = weights.masked_select(
            ~mask.bool()[:, None, None, :].expand_as(weights) & query_real[:, None, :, None]
        )
        assert (on_padding == 0).all(), "a real query attended padding"


@pytest.mark.parametrize("cfg", [MHA, GQA], ids=["mha", "gqa"])
def test_prefill_plus_64_single_token_steps_equals_one_full_forward(cfg):
    model = AttentionModel(cfg, seed=5).eval()
    B, P, steps = 2, 9, 64
    x = torch.randn(B, P + steps, cfg.d_model, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(x)
        step = model(x[:, :P])
        outputs, cache = [step.output], step.present
        for t in range(P, P + steps):
            step = model(x[:, t : t + 1], past=cache)
            outputs.append(step.output)
            cache = step.present
    torch.testing.assert_close(torch.cat(outputs, dim=1), full.output, atol=1e-5, rtol=1e-5)
    for incremental, whole in zip(cache, full.present, strict=True):
        torch.testing.assert_close(incremental.key, whole.key, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(incremental.value, whole.value, atol=1e-6, rtol=1e-6)


def test_initialization_is_deterministic_per_seed():
    a, b, c = AttentionModel(GQA, seed=7), AttentionModel(GQA, seed=7), AttentionModel(GQA, seed=8)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name])
        assert not torch.equal(tensor, c.state_dict()[name])


def test_weights_round_trip_through_safetensors_with_the_design_keys(tmp_path):
    model = AttentionModel(GQA, seed=4)
    artifacts.save_artifact(model, tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / files.WEIGHTS_FILENAME), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("layers.1.attn.W_k.weight").shape == (GQA.kv_dim, GQA.d_model)
    for i in range(GQA.n_layers):
        for name in ["norm.weight", "norm.bias"] + [
            f"attn.W_{p}.{kind}" for p in "qkvo" for kind in ("weight", "bias")
        ]:
            assert f"layers.{i}.{name}" in keys
    assert len(keys) == GQA.n_layers * 10
    loaded = artifacts.load_model(tmp_path)
    assert loaded.cfg == GQA
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name])


def test_a_block_without_a_norm_has_no_norm_weights(tmp_path):
    keys = set(AttentionModel(BARE).state_dict())
    assert keys == {f"layers.{i}.attn.W_{p}.{kind}" for i in range(2) for p in "qkvo" for kind in ("weight", "bias")}
    artifacts.save_artifact(AttentionModel(BARE, seed=2), tmp_path)
    assert artifacts.load_model(tmp_path).cfg == BARE


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path):
    artifacts.save_artifact(AttentionModel(GQA), tmp_path)
    other = AttentionModel(MHA)
    with pytest.raises(ValueError, match=r"layers.0.attn.W_k.weight has shape \[16, 48\], expected \[48, 48\]"):
        artifacts.load_weights(other, tmp_path / files.WEIGHTS_FILENAME)


@pytest.mark.parametrize(
    ("make_inputs", "message"),
    [
        (lambda: (torch.randn(2, 3, 40), None, None), r"input 'hidden_states': expected shape .* \(axis 2 = 48\)"),
        (lambda: (torch.randn(3, 48), None, None), r"input 'hidden_states': expected rank 3"),
        (
            lambda: (torch.randn(2, 3, 48), torch.ones(2, 4, dtype=torch.int64), None),
            r"input 'attention_mask': expected length past \+ new = 0 \+ 3 = 3, got 4",
        ),
        (
            lambda: (torch.randn(2, 3, 48), torch.ones(3, 3, dtype=torch.int64), None),
            r"input 'attention_mask': axis 0 \(batch_size\) is 3 but other inputs give 2",
        ),
        (
            lambda: (torch.randn(2, 3, 48), torch.ones(2, 3), None),
            r"input 'attention_mask': expected dtype int64, got float32",
        ),
        (
            lambda: (torch.randn(2, 1, 48), None, random_past(MHA, 2, 4)[:1]),
            r"input 'past_key_values.1.key': missing",
        ),
        (
            lambda: (torch.randn(2, 1, 48), None, [KVCache(torch.randn(2, 4, 5, 12), torch.randn(2, 4, 6, 12))] * 2),
            r"input 'past_key_values.0.value': axis 2 \(past_sequence_length\) is 6 but other inputs give 5",
        ),
        (
            lambda: (torch.randn(2, 1, 48).double(), None, random_past(MHA, 2, 4)),
            r"input 'past_key_values.0.key': expected dtype float64, got float32",
        ),
    ],
    ids=["width", "rank", "mask-length", "mask-batch", "mask-dtype", "missing-layer", "past-lengths", "dtypes"],
)
def test_mismatched_inputs_name_the_input_and_the_expected_value(make_inputs, message):
    model = AttentionModel(MHA)
    hidden, mask, past = make_inputs()
    with pytest.raises(InputError, match=message):
        model(hidden, mask, past)


# whole decoders: token ids in, logits out (Llama's block with its own head; GPT-2's with learned positions, a
# dense tanh-GELU MLP with biases and a tied head; a gated GELU MLP without biases, Gemma's kind)
WHOLE = {
    "llama": ModelConfig(**{**LLAMA.to_dict(), "vocab_size": 50, "mlp": "gated", "mlp_width": 80, "max_seq_len": 64}),
    "gpt2": ModelConfig(
        d_model=32,
        n_heads=4,
        n_kv_heads=4,
        n_layers=2,
        max_seq_len=64,
        vocab_size=50,
        mlp="dense",
        mlp_width=64,
        mlp_activation="gelu_tanh",
        mlp_bias=True,
        learned_positions=True,
        tie_embeddings=True,
    ),
    "gated-gelu": ModelConfig(
        **{**QWEN3.to_dict(), "vocab_size": 40, "mlp": "gated", "mlp_width": 48, "mlp_activation": "gelu"}
    ),
}


@pytest.mark.parametrize("cfg", list(WHOLE.values()), ids=list(WHOLE))
@pytest.mark.parametrize("past_length", [0, 4])
def test_a_whole_model_matches_the_naive_loop(cfg, past_length):
    """Token ids through embeddings, blocks with their MLPs, the final norm and the head: the logits and the
    caches equal the reference's on real rows, over a left-padded batch and onto a past."""
    model = AttentionModel(cfg, seed=4).eval()
    B, T = 3, 5
    ids = torch.randint(cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    past = random_past(cfg, B, past_length) if past_length else None
    mask = left_padded_mask(B, past_length + T, [0, 1, 3])
    with torch.no_grad():
        result = model(ids, mask, past)
    expected, presents = reference.forward(
        cfg, weights_of(model), ids.numpy(), mask.numpy(), [(k.numpy(), v.numpy()) for k, v in past] if past else None
    )
    assert result.output.shape == (B, T, cfg.vocab_size)
    real = reference.real_rows(mask.numpy(), T)
    scale = np.abs(expected[real]).max()
    np.testing.assert_allclose(result.output.numpy()[real], expected[real], atol=1e-5 * scale, rtol=1e-5)
    real_keys = mask.numpy() == 1
    for cache, (key, _) in zip(result.present, presents, strict=True):
        np.testing.assert_allclose(
            cache.key.numpy().transpose(0, 2, 1, 3)[real_keys], key.transpose(0, 2, 1, 3)[real_keys], atol=1e-5
        )


def test_a_whole_model_refuses_ids_outside_its_vocabulary_and_hidden_states():
    model = AttentionModel(WHOLE["llama"]).eval()
    with pytest.raises(InputError, match=r"input 'input_ids': expected dtype int64, got float32"):
        model(torch.zeros(1, 2))
    with pytest.raises(InputError, match=r"input 'input_ids': expected rank 2"):
        model(torch.zeros(1, 2, 64, dtype=torch.int64))
    with pytest.raises(
        InputError, match=r"input 'input_ids': token ids must lie in \[0, 50\).*got 50 at index \[0, 1\]"
    ):
        model(torch.tensor([[3, 50]]))


def test_the_attention_model_is_unchanged_by_the_whole_models_fields():
    """The defaults keep today's model: no whole-model field in its state dict, and every field of a whole
    model refused without a vocabulary."""
    assert not any(
        key.startswith(("embed", "lm_head", "final_norm")) or ".mlp" in key
        for key in AttentionModel(LLAMA).state_dict()
    )
    with pytest.raises(ValueError, match="mlp, mlp_width set without vocab_size"):
        ModelConfig(mlp="gated", mlp_width=8)
    with pytest.raises(ValueError, match="learned_positions and rope_theta"):
        ModelConfig(vocab_size=8, rope_theta=1e4, learned_positions=True)
