"""The PyTorch peer the decode engines are measured against: gpt-fast's static KV cache in eager mode.

A preallocated buffer per layer, (B, n_kv, capacity, head_dim); a step writes the new key and value at its
position with `index_copy_` and attends over the filled part (its window's) with SDPA. The original's weights
(export/model.py), its math as a PyTorch user would deploy it; `check_peer` holds it to the original.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from export.model import AttentionModel


class StaticCacheDecoder:
    """Decode steps of `model` over a static cache of `capacity` positions for `batch` rows, every row
    at the same length (a benchmark's shape)."""

    def __init__(self, model: AttentionModel, batch: int, capacity: int) -> None:
        self.model, self.cfg = model, model.cfg
        parameter = next(model.parameters())
        shape = (batch, self.cfg.n_kv_heads, capacity, self.cfg.head_dim)
        # random, not zeros: a benchmark must read real memory (and the peer's first steps overwrite it)
        self.keys = [parameter.new_empty(shape).normal_() for _ in model.layers]
        self.values = [parameter.new_empty(shape).normal_() for _ in model.layers]
        self.length = 0

    @torch.inference_mode()
    def step(self, new_tokens: Tensor) -> Tensor:
        """new_tokens at position `length`: hidden states (B, 1, d_model), or a whole model's token ids
        (B, 1); returns the states (B, 1, d_model) or logits (B, 1, vocab) and advances by one."""
        position = torch.tensor([self.length], device=new_tokens.device)
        positions = position.expand(new_tokens.shape[0], 1)  # (B, 1)
        x = self.model.embed_tokens(new_tokens, positions) if self.cfg.whole else new_tokens
        for layer, keys, values in zip(self.model.layers, self.keys, self.values, strict=True):
            attn = layer.attn
            h = layer.norm(x)
            q = attn.split_heads(attn.W_q(h), attn.n_heads)  # (B, nh, 1, hs)
            k = attn.split_heads(attn.W_k(h), attn.n_kv_heads)  # (B, n_kv, 1, hs)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            if attn.rotary is not None:
                q, k = attn.rotary(q, positions), attn.rotary(k, positions)
            keys.index_copy_(2, position, k)  # (B, n_kv, cap, hs)
            values.index_copy_(2, position, attn.split_heads(attn.W_v(h), attn.n_kv_heads))
            filled = self.length + 1
            first = 0 if layer.window is None else max(0, filled - layer.window)  # a window: the last positions
            context = F.scaled_dot_product_attention(
                q,
                keys[:, :, first:filled],
                values[:, :, first:filled],
                scale=1 / math.sqrt(attn.head_dim),
                enable_gqa=True,
            )  # (B, nh, 1, hs): one query sees every filled position (in its window)
            x = layer.add_residual(x, attn.W_o(attn.combine_heads(context)))
            if hasattr(layer, "mlp"):
                x = x + layer.mlp(layer.mlp_norm(x))
        self.length += 1
        return self.model.head(x) if self.cfg.whole else x


def random_tokens(cfg, batch: int, length: int, generator: torch.Generator | None = None) -> Tensor:
    """What the model takes for `length` new tokens per row: token ids (B, T) of a whole model, hidden
    states (B, T, d_model) in fp32 otherwise."""
    if cfg.whole:
        return torch.randint(cfg.vocab_size, (batch, length), generator=generator)
    return torch.randn(batch, length, cfg.d_model, generator=generator)


def check_peer(model: AttentionModel, device: str, dtype: torch.dtype) -> float:
    """Prefill the peer token by token and compare its outputs with the original's; returns the worst
    error relative to the output's scale."""
    generator = torch.Generator().manual_seed(0)
    tokens = random_tokens(model.cfg, 2, 9, generator).to(device)
    if not model.cfg.whole:
        tokens = tokens.to(dtype)
    with torch.inference_mode():
        expected = model(tokens).output
    peer = StaticCacheDecoder(model, batch=2, capacity=16)
    actual = torch.cat([peer.step(tokens[:, t : t + 1]) for t in range(tokens.shape[1])], dim=1)
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())
