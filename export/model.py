"""The PyTorch original: multi-head attention layers with an explicit KV cache, each in a pre-norm
residual block unless its config drops the norm or the residual; with a vocabulary (`vocab_size`), a
whole decoder: token embeddings, each block's attention followed by its MLP, a final norm, the LM head.

Everything the product serves is judged against this file (docs/design.md, "Model math"). It reads like the math:
normalize (LayerNorm or RMSNorm); project to queries, keys and values; split heads; normalize q and k
per head (QK-norm) and rotate them by position (RoPE) where the config says so; append the new keys
and values to the cache; scaled dot products; causal, sliding-window and padding masks; softmax;
weighted sum of values; combine heads; output projection; residual. A whole model adds token (and
learned position) embeddings before the blocks, normalize + MLP + residual after each attention, and
the final norm and LM head after the last block. No export, device or serving code lives here.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from contract import names
from contract.config import GATED, GELU, GELU_TANH, HALF, LAYERNORM, NO_MLP, RMSNORM, ModelConfig
from contract.inputs import check_inputs, check_positions, check_token_values, default_positions, named_inputs


class KVCache(NamedTuple):
    """One layer's keys and values, each (B, n_kv_heads, P, head_dim). Immutable: `append` returns
    the longer cache, which is the layer's `present`."""

    key: Tensor
    value: Tensor

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, like: Tensor) -> KVCache:
        """A zero-length cache with the dtype and device of `like`."""
        shape = (batch, cfg.n_kv_heads, 0, cfg.head_dim)
        return cls(like.new_zeros(shape), like.new_zeros(shape))

    @property
    def length(self) -> int:
        return self.key.shape[2]

    def append(self, k: Tensor, v: Tensor) -> KVCache:
        """Concatenate T new positions along the sequence axis."""
        return KVCache(
            torch.cat([self.key, k], dim=2),  # (B, n_kv, P+T, hs)
            torch.cat([self.value, v], dim=2),  # (B, n_kv, P+T, hs)
        )


class ModelOutput(NamedTuple):
    output: Tensor  # (B, T, d_model); a whole model's logits (B, T, vocab_size)
    present: list[KVCache]  # per layer, (B, n_kv, P+T, hs) each
    attention_weights: list[Tensor] | None  # per layer, (B, n_heads, T, P+T), when asked for


def attention_allowed(attention_mask: Tensor, past_length: int, new_length: int, window: int | None = None) -> Tensor:
    """Which keys each query may attend: (B, 1, T, P+T), True = attend.

    Query t sits at absolute position P+t; it may see key j iff j <= P+t (causal), P+t - j < window
    (a sliding window, when the layer has one) and attention_mask[b, j] == 1 (not padding).
    """
    query_position = torch.arange(new_length, device=attention_mask.device) + past_length  # (T,)
    key_position = torch.arange(past_length + new_length, device=attention_mask.device)  # (P+T,)
    causal = key_position[None, :] <= query_position[:, None]  # (T, P+T)
    if window is not None:
        causal = causal & (query_position[:, None] - key_position[None, :] < window)
    not_padding = attention_mask[:, None, None, :].bool()  # (B, 1, 1, P+T)
    return causal[None, None, :, :] & not_padding  # (B, 1, T, P+T)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, over the last axis (no mean subtracted, no bias)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    """Rotary position embeddings: the first `rotated_width` dims of each head, taken as pairs (x1, x2),
    turn by angle position * frequency_i: (x1 cos - x2 sin, x2 cos + x1 sin). The angles' cos and sin
    are a table of max_seq_len positions (a position past it has no angle: refused at the edges)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.width, self.pairing = cfg.rotated_width, cfg.rope_pairing
        # one row past max_seq_len: the static pool rotates its scratch position too (serving/engine/kv_pool.py)
        positions = torch.arange(cfg.max_seq_len + 1, dtype=torch.float32)  # (S + 1,)
        # in fp32 as Hugging Face computes them, so that the table is the trained model's
        angles = positions[:, None] * rope_frequencies(cfg)[None, :]  # (S + 1, width/2)
        self.register_buffer("cos", angles.cos(), persistent=False)  # not weights: derived from the config
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        cos = F.embedding(position_ids, self.cos)[:, None]  # the table's row per position: (B, 1, T, width/2)
        sin = F.embedding(position_ids, self.sin)[:, None]
        rotated, kept = x[..., : self.width], x[..., self.width :]  # (B, h, T, width), (B, h, T, hs - width)
        if self.pairing == HALF:  # x1 = first half, x2 = second half
            x1, x2 = rotated.chunk(2, dim=-1)  # (B, h, T, width/2) each
            turned = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:  # interleaved: x1 = even dims, x2 = odd dims
            x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
            turned = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([turned, kept], dim=-1)  # (B, h, T, hs)


def rope_frequencies(cfg: ModelConfig) -> Tensor:
    """The rotation frequency of each pair, theta^(-2i / width), with the config's scaling (fp32)."""
    width = cfg.rotated_width
    frequencies = 1.0 / (cfg.rope_theta ** (torch.arange(0, width, 2, dtype=torch.int64).float() / width))
    if cfg.rope_scaling == "linear":
        return frequencies / cfg.rope_scaling_factor
    if cfg.rope_scaling == "llama3":
        return llama3_frequencies(frequencies, cfg)
    return frequencies


def llama3_frequencies(frequencies: Tensor, cfg: ModelConfig) -> Tensor:
    """Llama 3's scaling: wavelengths longer than original / low_freq_factor are divided by the factor,
    shorter than original / high_freq_factor kept, those between blended smoothly."""
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_max_position
    wavelength = 2 * math.pi / frequencies
    scaled = torch.where(wavelength > original / low, frequencies / factor, frequencies)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = ~(wavelength < original / high) & ~(wavelength > original / low)
    return torch.where(between, blended, scaled)


class MultiHeadAttention(nn.Module):
    """Attention with W_q, W_k, W_v, W_o; query head h reads kv head h // n_rep (GQA); q and k
    normalized per head (`qk_norm`) and rotated by position (`rope_theta`) where the config says so."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.n_rep = cfg.n_rep
        self.W_q = nn.Linear(cfg.d_model, cfg.q_dim, bias=cfg.bias)
        self.W_k = nn.Linear(cfg.d_model, cfg.kv_dim, bias=cfg.bias)
        self.W_v = nn.Linear(cfg.d_model, cfg.kv_dim, bias=cfg.bias)
        self.W_o = nn.Linear(cfg.q_dim, cfg.d_model, bias=cfg.bias)
        if cfg.qk_norm == RMSNORM:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.rotary = Rotary(cfg) if cfg.rotary else None

    def split_heads(self, x: Tensor, n_heads: int) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n_heads, self.head_dim).transpose(1, 2)  # (B, n_heads, T, hs)

    def combine_heads(self, x: Tensor) -> Tensor:
        B, _, T, _ = x.shape
        return x.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, d_model)

    def forward(
        self, h: Tensor, allowed: Tensor, past: KVCache, position_ids: Tensor | None
    ) -> tuple[Tensor, KVCache, Tensor]:
        q = self.split_heads(self.W_q(h), self.n_heads)  # (B, nh, T, hs)
        k = self.split_heads(self.W_k(h), self.n_kv_heads)  # (B, n_kv, T, hs)
        v = self.split_heads(self.W_v(h), self.n_kv_heads)  # (B, n_kv, T, hs)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)  # per head, over hs
        if self.rotary is not None:
            q, k = self.rotary(q, position_ids), self.rotary(k, position_ids)  # keys are cached rotated

        present = past.append(k, v)  # (B, n_kv, P+T, hs) each
        K = present.key.repeat_interleave(self.n_rep, dim=1)  # (B, nh, P+T, hs)
        V = present.value.repeat_interleave(self.n_rep, dim=1)  # (B, nh, P+T, hs)

        scores = q @ K.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, nh, T, P+T)
        # the most negative finite number, not -inf: a query with nothing to attend (padding)
        # then gets a uniform row instead of NaN
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        weights = F.softmax(scores, dim=-1)  # (B, nh, T, P+T)
        context = weights @ V  # (B, nh, T, hs)
        return self.W_o(self.combine_heads(context)), present, weights


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The config's norm over d_model: LayerNorm, RMSNorm, or none (identity)."""
    norms = {
        LAYERNORM: lambda: nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps),
        RMSNORM: lambda: RMSNorm(cfg.d_model, cfg.norm_eps),
    }
    return norms.get(cfg.norm, nn.Identity)()


ACTIVATION_FUNCTIONS = {
    "silu": F.silu,
    GELU: F.gelu,
    GELU_TANH: lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's gelu_new
}


class MLP(nn.Module):
    """dense: W_down(act(W_up x)) (GPT-2); gated: W_down(act(W_gate x) * W_up x) (Llama, Qwen, Phi-3)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.mlp == GATED:
            self.W_gate = nn.Linear(cfg.d_model, cfg.mlp_width, bias=cfg.mlp_bias)
        self.W_up = nn.Linear(cfg.d_model, cfg.mlp_width, bias=cfg.mlp_bias)
        self.W_down = nn.Linear(cfg.mlp_width, cfg.d_model, bias=cfg.mlp_bias)
        self.activation = ACTIVATION_FUNCTIONS[cfg.mlp_activation]

    def forward(self, x: Tensor) -> Tensor:
        if hasattr(self, "W_gate"):
            return self.W_down(self.activation(self.W_gate(x)) * self.W_up(x))  # (B, T, d_model)
        return self.W_down(self.activation(self.W_up(x)))  # (B, T, d_model)


class Layer(nn.Module):
    """One block: x + Attention(Norm(x)) by default (pre-norm, residual; LayerNorm or RMSNorm);
    `norm: none` drops the norm and `residual: false` the skip connection, down to bare Attention(x).
    A whole model's block goes on with x + MLP(Norm(x)), its own norm of the same kind."""

    def __init__(self, cfg: ModelConfig, window: int | None) -> None:
        super().__init__()
        self.norm = make_norm(cfg)
        self.attn = MultiHeadAttention(cfg)
        if cfg.mlp != NO_MLP:
            self.mlp_norm = make_norm(cfg)
            self.mlp = MLP(cfg)
        self.residual, self.window = cfg.residual, window

    def forward(
        self, x: Tensor, allowed: Tensor, past: KVCache, position_ids: Tensor | None
    ) -> tuple[Tensor, KVCache, Tensor]:
        attended, present, weights = self.attn(self.norm(x), allowed, past, position_ids)
        x = self.add_residual(x, attended)
        if hasattr(self, "mlp"):
            x = x + self.mlp(self.mlp_norm(x))  # (B, T, d_model)
        return x, present, weights

    def add_residual(self, x: Tensor, attended: Tensor) -> Tensor:
        return x + attended if self.residual else attended  # (B, T, d_model)


class AttentionModel(nn.Module):
    """A stack of `n_layers` attention layers over hidden states, each with its own KV cache; with a
    vocabulary, the whole decoder around them: embeddings in, final norm and LM head out."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.whole:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            if cfg.learned_positions:
                self.position_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg, cfg.window(i)) for i in range(cfg.n_layers))
        if cfg.whole:
            self.final_norm = make_norm(cfg)
            if not cfg.tie_embeddings:
                self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic: the same seed gives the same weights on every machine."""
        generator = torch.Generator().manual_seed(seed)
        for name, parameter in self.named_parameters():
            if name.endswith("norm.weight"):  # the block's norm and the per-head q/k norms
                parameter.copy_(1.0 + 0.1 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith("bias"):
                parameter.copy_(0.02 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith("embed.weight"):  # unit-variance states going in, as the projections expect
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
            else:  # a projection: unit-variance outputs for unit-variance inputs
                fan_in = parameter.shape[1]
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(fan_in))

    def empty_cache(self, batch: int, like: Tensor) -> list[KVCache]:
        return [KVCache.empty(self.cfg, batch, like) for _ in self.layers]

    def float_like(self) -> Tensor:
        """A tensor of the weights' dtype and device (what a whole model's empty cache is made like)."""
        return self.embed.weight

    def embed_tokens(self, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
        """Token ids (B, T) -> hidden states (B, T, d_model), with their positions' embeddings if learned."""
        x = self.embed(input_ids)  # (B, T, d_model)
        if hasattr(self, "position_embed"):
            x = x + self.position_embed(position_ids)
        return x

    def head(self, x: Tensor) -> Tensor:
        """The last block's states (B, T, d_model) -> logits (B, T, vocab_size)."""
        x = self.final_norm(x)
        return F.linear(x, self.embed.weight) if self.cfg.tie_embeddings else self.lm_head(x)

    def forward(
        self,
        new_tokens: Tensor,
        attention_mask: Tensor | None = None,
        past: list[KVCache] | None = None,
        return_attention: bool = False,
        position_ids: Tensor | None = None,
    ) -> ModelOutput:
        """`new_tokens`: hidden states (B, T, d_model), or a whole model's token ids (B, T) int64.
        `position_ids` (B, T) int64 place the new tokens for the rotation (or the learned positions);
        left out, they are counted from the attention mask (`default_positions`)."""
        if not torch.compiler.is_compiling():  # eager callers get named errors; a traced graph's runtime checks its own
            tensors = named_inputs(new_tokens, attention_mask, past, position_ids, names.model_input(self.cfg))
            check_inputs(self.cfg, tensors, float_dtype=None)
            check_positions(self.cfg, tensors)
            if self.cfg.whole:
                check_token_values(self.cfg, {names.INPUT_IDS: new_tokens.cpu().numpy()})
        B, T = new_tokens.shape[:2]
        floats = self.float_like() if self.cfg.whole else new_tokens
        past = self.empty_cache(B, floats) if past is None else past
        P = past[0].length
        if attention_mask is None:
            attention_mask = torch.ones(B, P + T, dtype=torch.int64, device=new_tokens.device)  # (B, P+T)
        if self.cfg.positioned and position_ids is None:  # counted from the mask, as Hugging Face does (B, T)
            position_ids = torch.from_numpy(default_positions(attention_mask.cpu().numpy(), T)).to(
                attention_mask.device
            )
        # one mask per distinct window: (B, 1, T, P+T) each
        allowed = {w: attention_allowed(attention_mask, P, T, w) for w in {layer.window for layer in self.layers}}

        x = self.embed_tokens(new_tokens, position_ids) if self.cfg.whole else new_tokens  # (B, T, d_model)
        present, attention = [], []
        for layer, layer_past in zip(self.layers, past, strict=True):
            x, layer_present, weights = layer(x, allowed[layer.window], layer_past, position_ids)
            present.append(layer_present)
            attention.append(weights)
        output = self.head(x) if self.cfg.whole else x
        return ModelOutput(output, present, attention if return_attention else None)
