"""What each attention head does, read off its weights: the four numbers the teaching texts read off
their heatmaps (a local head, a positional one, one that rests on the first token, a long-range one),
computed here once so that the CLI (`python -m export inspect`) and, later, a server report the same
numbers. numpy only: it lives in `contract/`, the room every other room (the gateway, the client)
may import.

Per layer and head, from the weights (B, n_heads, T, P+T) of one call and its attention mask (B, P+T):

- `entropy`: -sum_j p_ij ln p_ij of each query's distribution, in nats (ln n for a query spread
  evenly over n keys, 0 for one that reads a single key);
- `mean_distance`: sum_j p_ij (pos_i - pos_j), how far back a query reads on average (0: itself;
  1: the token before);
- `first_position_share`: the weight on the row's first real position (an attention sink);
- `previous_token_share`: the weight on the real token just before the query.

Positions count real tokens only (the mask's ones), so left padding moves nothing. Each number is a
mean over the queries that have a choice: real queries with an earlier real key. A padded query's row
is unspecified (export/inspect_form.py), and the first real token can read only itself, which would
pull every head's mean toward the same trivial values (entropy 0, distance 0, first-position share 1).
A call with no such query gives None for every number.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

STATISTICS = ("entropy", "mean_distance", "first_position_share", "previous_token_share")


def real_positions(attention_mask: np.ndarray) -> np.ndarray:
    """(B, S) each position's index among its row's real tokens (padding: -1)."""
    real = attention_mask.astype(bool)
    return np.where(real, np.cumsum(real, axis=-1) - 1, -1)


def layer_statistics(weights: np.ndarray, attention_mask: np.ndarray) -> dict:
    """One layer's statistics: {"queries": how many each mean is over, "heads": [{"head": h, the four
    numbers}, ...]} from its weights (B, H, T, S) and the call's mask (B, S)."""
    batch, n_heads, new, total = weights.shape
    if attention_mask.shape != (batch, total):
        shapes = f"{list(attention_mask.shape)} for weights of shape {list(weights.shape)}"
        raise ValueError(f"attention mask of shape {shapes}; expected (batch, keys) = {[batch, total]}")
    p = weights.astype(np.float64)  # an fp16 map's logarithms and sums in full precision
    key_position = real_positions(attention_mask)  # (B, S)
    query_position = key_position[:, total - new :]  # (B, T)
    counted = query_position > 0  # (B, T): a real query with an earlier real key
    per_query = {
        "entropy": -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1),
        "mean_distance": np.sum(p * (query_position[:, None, :, None] - key_position[:, None, None, :]), axis=-1),
        "first_position_share": _share_at(p, key_position[:, None, :] == 0),
        "previous_token_share": _share_at(p, key_position[:, None, :] == query_position[:, :, None] - 1),
    }  # each (B, H, T)
    queries = int(counted.sum())
    heads = []
    for head in range(n_heads):
        means = {name: _mean(values[:, head], counted, queries) for name, values in per_query.items()}
        heads.append({"head": head, **means})
    return {"queries": queries, "heads": heads}


def _share_at(p: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """(B, H, T) the weight each query puts on the keys `keys` (B, T, S) marks for it (one per query)."""
    return np.sum(p * keys[:, None, :, :], axis=-1)


def _mean(values: np.ndarray, counted: np.ndarray, queries: int) -> float | None:
    return float(values[counted].sum() / queries) if queries else None


def head_statistics(maps: Sequence[np.ndarray], attention_mask: np.ndarray) -> list[dict]:
    """Every layer's statistics, [{"layer": i, "queries": n, "heads": [...]}, ...]: plain lists, dicts,
    ints and floats (JSON as it is)."""
    return [{"layer": layer, **layer_statistics(weights, attention_mask)} for layer, weights in enumerate(maps)]


def statistics_table(statistics: list[dict]) -> str:
    """The statistics as a table, a line per layer and head."""
    titles = ("entropy", "mean distance", "first position", "previous token")
    widths = tuple(len(title) for title in titles)
    header = f"{'layer':>5} {'head':>4}  " + "  ".join(f"{title:>{len(title)}}" for title in titles)
    lines = [header, "-" * len(header)]
    for layer in statistics:
        for head in layer["heads"]:
            cells = [_cell(head[name], width) for name, width in zip(STATISTICS, widths, strict=True)]
            lines.append(f"{layer['layer']:>5} {head['head']:>4}  " + "  ".join(cells))
    return "\n".join([*lines, "entropy in nats; distance in tokens back; shares of the query's weight"])


def _cell(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.3f}"
