"""An independent implementation of docs/design.md, "Model math", written from the math with loops over batch
rows, heads, queries and rotated pairs, in float64 numpy. It shares no code with `export.model`: tests at every
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


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps) * weight


def block_norm(cfg, x: np.ndarray, weights: dict, norm: str) -> np.ndarray:
    """The config's norm whose weights are `{norm}.weight` (and `.bias`)."""
    if cfg.norm == "layernorm":
        return layer_norm(x, weights[f"{norm}.weight"], weights[f"{norm}.bias"], cfg.norm_eps)
    if cfg.norm == "rmsnorm":
        return rms_norm(x, weights[f"{norm}.weight"], cfg.norm_eps)
    return x


def frequencies(cfg) -> np.ndarray:
    """Each rotated pair's frequency as the contract fixes it: theta^(-2i/width) in float32 (the table
    a Hugging Face model was trained with), scaled linearly or as Llama 3 does."""
    width = cfg.rotary_dim or cfg.head_dim
    exponents = np.arange(0, width, 2).astype(np.float32) / np.float32(width)
    base = np.float32(1.0) / np.power(np.float32(cfg.rope_theta), exponents)
    if cfg.rope_scaling == "linear":
        return base / np.float32(cfg.rope_scaling_factor)
    if cfg.rope_scaling != "llama3":
        return base
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_max_position
    result = []
    for f in base.astype(np.float64):  # one frequency at a time, as the Llama 3 paper writes it
        wavelength = 2 * math.pi / f
        if wavelength < original / high:
            result.append(f)
        elif wavelength > original / low:
            result.append(f / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            result.append((1 - smooth) * f / factor + smooth * f)
    return np.array(result, np.float32)


def rotate(cfg, x: np.ndarray, position: int) -> np.ndarray:
    """One head's vector x (hd,) at `position`: each pair (x1, x2) of the rotated width turned by
    position * frequency (the angle in float32, as the table holds it)."""
    width = cfg.rotary_dim or cfg.head_dim
    angles = (np.float32(position) * frequencies(cfg)).astype(np.float64)
    if cfg.rope_pairing == "half":
        first, second = list(range(width // 2)), list(range(width // 2, width))
    else:
        first, second = list(range(0, width, 2)), list(range(1, width, 2))
    out = x.copy()
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        out[a] = x[a] * math.cos(angles[i]) - x[b] * math.sin(angles[i])
        out[b] = x[b] * math.cos(angles[i]) + x[a] * math.sin(angles[i])
    return out


def positions_of(mask: np.ndarray, new: int) -> np.ndarray:
    """The new tokens' positions when none are given: attended positions before each (padding: 1)."""
    counts = np.cumsum(mask, axis=-1) - 1
    return np.where(mask == 1, counts, 1)[:, -new:].astype(np.int64)


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


def forward(cfg, weights, hidden, mask=None, past=None, positions=None):
    """hidden (B, T, d), or a whole model's token ids (B, T); mask (B, P+T) of 1/0 or None; past: per
    layer (key, value) of (B, n_kv, P, hd) or None; positions (B, T) for a model with rotary embeddings or
    learned positions (None: counted from the mask). Returns (output, presents): a whole model's output
    is its logits (B, T, vocab_size)."""
    B, T = np.shape(hidden)[:2]
    hd, group = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    P = 0 if past is None else past[0][0].shape[2]
    mask = np.ones((B, P + T)) if mask is None else np.asarray(mask)
    positions = positions_of(mask, T) if positions is None else np.asarray(positions)
    if cfg.vocab_size is None:
        x = np.asarray(hidden, dtype=np.float64).copy()
    else:  # each token's row of the embeddings (and of its position's, when learned)
        ids = np.asarray(hidden)
        x = np.array([[weights["embed.weight"][ids[b, t]] for t in range(T)] for b in range(B)])
        if cfg.learned_positions:
            x = x + np.array([[weights["position_embed.weight"][positions[b, t]] for t in range(T)] for b in range(B)])
    presents = []
    for i in range(cfg.n_layers):
        prefix = f"layers.{i}"
        h = block_norm(cfg, x, weights, f"{prefix}.norm")
        q = linear(h, weights, f"{prefix}.attn.W_q").reshape(B, T, cfg.n_heads, hd)
        k = linear(h, weights, f"{prefix}.attn.W_k").reshape(B, T, cfg.n_kv_heads, hd)
        v = linear(h, weights, f"{prefix}.attn.W_v").reshape(B, T, cfg.n_kv_heads, hd).transpose(0, 2, 1, 3)
        q, k = place(cfg, weights, prefix, q, k, positions)
        k = k.transpose(0, 2, 1, 3)
        if past is not None:
            k = np.concatenate([np.asarray(past[i][0], dtype=np.float64), k], axis=2)
            v = np.concatenate([np.asarray(past[i][1], dtype=np.float64), v], axis=2)
        presents.append((k, v))
        window = cfg.window(i)
        context = np.zeros((B, T, cfg.n_heads, hd))
        for b in range(B):
            for head in range(cfg.n_heads):
                kv_head = head // group
                for t in range(T):
                    allowed = [
                        j <= P + t and mask[b, j] == 1 and (window is None or P + t - j < window) for j in range(P + T)
                    ]
                    context[b, t, head] = attend_one_query(q[b, t, head], k[b, kv_head], v[b, kv_head], allowed)
        attended = linear(context.reshape(B, T, cfg.n_heads * hd), weights, f"{prefix}.attn.W_o")
        x = x + attended if cfg.residual else attended
        if cfg.vocab_size is not None and cfg.mlp != "none":
            x = x + mlp(cfg, weights, f"{prefix}.mlp", block_norm(cfg, x, weights, f"{prefix}.mlp_norm"))
    if cfg.vocab_size is None:
        return x, presents
    head = weights["embed.weight"] if cfg.tie_embeddings else weights["lm_head.weight"]
    return block_norm(cfg, x, weights, "final_norm") @ head.T, presents


ACTIVATIONS = {
    "silu": lambda x: x / (1 + np.exp(-x)),
    "gelu": lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
}


def mlp(cfg, weights, prefix, h):
    """dense: W_down act(W_up h); gated: W_down (act(W_gate h) * W_up h)."""
    act = ACTIVATIONS[cfg.mlp_activation]
    inner = act(linear(h, weights, f"{prefix}.W_up"))
    if cfg.mlp == "gated":
        inner = act(linear(h, weights, f"{prefix}.W_gate")) * linear(h, weights, f"{prefix}.W_up")
    return linear(inner, weights, f"{prefix}.W_down")


def place(cfg, weights, prefix, q, k, positions):
    """q (B, T, nh, hd) and k (B, T, n_kv, hd) normalized per head (qk_norm) and rotated by position."""
    if cfg.qk_norm == "rmsnorm":
        q = rms_norm(q, weights[f"{prefix}.attn.q_norm.weight"], cfg.norm_eps)
        k = rms_norm(k, weights[f"{prefix}.attn.k_norm.weight"], cfg.norm_eps)
    if cfg.rope_theta is None:
        return q, k
    q, k = q.copy(), k.copy()
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            for head in range(q.shape[2]):
                q[b, t, head] = rotate(cfg, q[b, t, head], int(positions[b, t]))
            for head in range(k.shape[2]):
                k[b, t, head] = rotate(cfg, k[b, t, head], int(positions[b, t]))
    return q, k


def real_rows(mask: np.ndarray, new: int) -> np.ndarray:
    """(B, T) True where the query is a real token (its own mask entry is 1)."""
    return np.asarray(mask)[:, -new:] == 1
