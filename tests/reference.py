"""An independent implementation of docs/design.md, "Model math", written from the math with loops over batch
rows, heads and queries, in float64 numpy. It shares no code with `export.model`: tests at every
layer (ONNX, Triton, gateway) compare against it."""

from __future__ import annotations

import math

import numpy as np
from safetensors.numpy import load_file


def load_weights(path) -> dict[str, np.ndarray]:
    return {name: array.astype(np.float64) for name, array in load_file(str(path)).items()}


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def linear(x: np.ndarray, weights: dict, name: str) -> np.ndarray:
    y = x @ weights[f"{name}.weight"].T
    return y + weights[f"{name}.bias"] if f"{name}.bias" in weights else y


def attend_one_query(q: np.ndarray, keys: np.ndarray, values: np.ndarray, allowed: list[bool]) -> np.ndarray:
    """One head, one query: softmax over the allowed keys of q.k / sqrt(d), then the weighted values."""
    if not any(allowed):  # a padded query: unspecified but finite; zeros here
        return np.zeros_like(q)
    scores = np.array([q @ k / math.sqrt(q.shape[0]) if ok else -np.inf for k, ok in zip(keys, allowed, strict=True)])
    weights = np.exp(scores - scores.max())
    weights /= weights.sum()
    return weights @ values


def forward(cfg, weights, hidden, mask=None, past=None):
    """hidden (B, T, d); mask (B, P+T) of 1/0 or None; past: per layer (key, value) of
    (B, n_kv, P, hd) or None. Returns (output, presents)."""
    hidden = np.asarray(hidden, dtype=np.float64)
    B, T, _ = hidden.shape
    hd, group = cfg.d_model // cfg.n_heads, cfg.n_heads // cfg.n_kv_heads
    P = 0 if past is None else past[0][0].shape[2]
    mask = np.ones((B, P + T)) if mask is None else np.asarray(mask)
    x, presents = hidden.copy(), []
    for i in range(cfg.n_layers):
        prefix = f"layers.{i}"
        h = x
        if cfg.norm == "layernorm":
            h = layer_norm(x, weights[f"{prefix}.norm.weight"], weights[f"{prefix}.norm.bias"], cfg.norm_eps)
        q = linear(h, weights, f"{prefix}.attn.W_q").reshape(B, T, cfg.n_heads, hd)
        k = linear(h, weights, f"{prefix}.attn.W_k").reshape(B, T, cfg.n_kv_heads, hd).transpose(0, 2, 1, 3)
        v = linear(h, weights, f"{prefix}.attn.W_v").reshape(B, T, cfg.n_kv_heads, hd).transpose(0, 2, 1, 3)
        if past is not None:
            k = np.concatenate([np.asarray(past[i][0], dtype=np.float64), k], axis=2)
            v = np.concatenate([np.asarray(past[i][1], dtype=np.float64), v], axis=2)
        presents.append((k, v))
        context = np.zeros((B, T, cfg.n_heads, hd))
        for b in range(B):
            for head in range(cfg.n_heads):
                kv_head = head // group
                for t in range(T):
                    allowed = [j <= P + t and mask[b, j] == 1 for j in range(P + T)]
                    context[b, t, head] = attend_one_query(q[b, t, head], k[b, kv_head], v[b, kv_head], allowed)
        attended = linear(context.reshape(B, T, cfg.d_model), weights, f"{prefix}.attn.W_o")
        x = x + attended if cfg.residual else attended
    return x, presents


def real_rows(mask: np.ndarray, new: int) -> np.ndarray:
    """(B, T) True where the query is a real token (its own mask entry is 1)."""
    return np.asarray(mask)[:, -new:] == 1
