"""The PyTorch original: multi-head attention layers with an explicit KV cache, each in a pre-norm
residual block unless its config drops the norm or the residual.

Everything the product serves is judged against this file (docs/design.md, "Model math"). It reads like the math:
project to queries, keys and values; split heads; append the new keys and values to the cache;
scaled dot products; causal and padding masks; softmax; weighted sum of values; combine heads;
output projection; residual. No export, device or serving code lives here.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from contract.config import LAYERNORM, ModelConfig
from contract.inputs import check_inputs, named_inputs


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
    output: Tensor  # (B, T, d_model)
    present: list[KVCache]  # per layer, (B, n_kv, P+T, hs) each
    attention_weights: list[Tensor] | None  # per layer, (B, n_heads, T, P+T), when asked for


def attention_allowed(attention_mask: Tensor, past_length: int, new_length: int) -> Tensor:
    """Which keys each query may attend: (B, 1, T, P+T), True = attend.

    Query t sits at absolute position P+t; it may see key j iff j <= P+t (causal) and
    attention_mask[b, j] == 1 (not padding).
    """
    query_position = torch.arange(new_length, device=attention_mask.device) + past_length  # (T,)
    key_position = torch.arange(past_length + new_length, device=attention_mask.device)  # (P+T,)
    causal = key_position[None, :] <= query_position[:, None]  # (T, P+T)
    not_padding = attention_mask[:, None, None, :].bool()  # (B, 1, 1, P+T)
    return causal[None, None, :, :] & not_padding  # (B, 1, T, P+T)


class MultiHeadAttention(nn.Module):
    """Attention with W_q, W_k, W_v, W_o; query head h reads kv head h // n_rep (GQA)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.n_rep = cfg.n_rep
        self.W_q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.W_k = nn.Linear(cfg.d_model, cfg.kv_dim, bias=cfg.bias)
        self.W_v = nn.Linear(cfg.d_model, cfg.kv_dim, bias=cfg.bias)
        self.W_o = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def split_heads(self, x: Tensor, n_heads: int) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n_heads, self.head_dim).transpose(1, 2)  # (B, n_heads, T, hs)

    def combine_heads(self, x: Tensor) -> Tensor:
        B, _, T, _ = x.shape
        return x.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, d_model)

    def forward(self, h: Tensor, allowed: Tensor, past: KVCache) -> tuple[Tensor, KVCache, Tensor]:
        q = self.split_heads(self.W_q(h), self.n_heads)  # (B, nh, T, hs)
        k = self.split_heads(self.W_k(h), self.n_kv_heads)  # (B, n_kv, T, hs)
        v = self.split_heads(self.W_v(h), self.n_kv_heads)  # (B, n_kv, T, hs)

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


class Layer(nn.Module):
    """One block: x + Attention(LayerNorm(x)) by default (pre-norm, residual); `norm: none` drops the
    LayerNorm and `residual: false` the skip connection, down to bare Attention(x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps) if cfg.norm == LAYERNORM else nn.Identity()
        self.attn = MultiHeadAttention(cfg)
        self.residual = cfg.residual

    def forward(self, x: Tensor, allowed: Tensor, past: KVCache) -> tuple[Tensor, KVCache, Tensor]:
        attended, present, weights = self.attn(self.norm(x), allowed, past)
        return self.add_residual(x, attended), present, weights

    def add_residual(self, x: Tensor, attended: Tensor) -> Tensor:
        return x + attended if self.residual else attended  # (B, T, d_model)


class AttentionModel(nn.Module):
    """A stack of `n_layers` attention layers over hidden states, each with its own KV cache."""

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic: the same seed gives the same weights on every machine."""
        generator = torch.Generator().manual_seed(seed)
        for name, parameter in self.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.1 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith("bias"):
                parameter.copy_(0.02 * torch.randn(parameter.shape, generator=generator))
            else:  # a projection: unit-variance outputs for unit-variance inputs
                fan_in = parameter.shape[1]
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(fan_in))

    def empty_cache(self, batch: int, like: Tensor) -> list[KVCache]:
        return [KVCache.empty(self.cfg, batch, like) for _ in self.layers]

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        past: list[KVCache] | None = None,
        return_attention: bool = False,
    ) -> ModelOutput:
        if not torch.compiler.is_compiling():  # eager callers get named errors; a traced graph's runtime checks its own
            check_inputs(self.cfg, named_inputs(hidden_states, attention_mask, past), float_dtype=None)
        B, T, _ = hidden_states.shape  # (B, T, d_model)
        past = self.empty_cache(B, hidden_states) if past is None else past
        P = past[0].length
        if attention_mask is None:
            attention_mask = torch.ones(B, P + T, dtype=torch.int64, device=hidden_states.device)  # (B, P+T)
        allowed = attention_allowed(attention_mask, P, T)  # (B, 1, T, P+T)

        x, present, attention = hidden_states, [], []
        for layer, layer_past in zip(self.layers, past, strict=True):
            x, layer_present, weights = layer(x, allowed, layer_past)
            present.append(layer_present)
            attention.append(weights)
        return ModelOutput(x, present, attention if return_attention else None)
