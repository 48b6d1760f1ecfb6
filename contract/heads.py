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
- `previous_token_share`: the weight on the real token just before the query;
- `induction_share`, only where the call's token ids are given (a whole model's; hidden states have
  none): for a query whose token occurred earlier (the latest earlier position j with the same id,
  j + 1 before the query), the weight on j + 1, the token that followed that occurrence. On a random
  sequence repeated twice it is the attention from the second copy to the token after the first
  occurrence: what an induction head does, reading "what came after this token last time".

Positions count real tokens only (the mask's ones), so left padding moves nothing. Each number is a
mean over the queries that have a choice: real queries with an earlier real key. A padded query's row
is unspecified (export/inspect_form.py), and the first real token can read only itself, which would
pull every head's mean toward the same trivial values (entropy 0, distance 0, first-position share 1).
A call with no such query gives None for every number. The induction share is a mean over its own
queries, those whose token repeats an earlier one (`induction_queries`): None when no token repeats.

`head_roles` names the heads whose statistic passes a stated threshold (ROLES), and `statistics_table`
prints them under the table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

STATISTICS = ("entropy", "mean_distance", "first_position_share", "previous_token_share")
INDUCTION = "induction_share"  # beside STATISTICS where the call's token ids are known


@dataclasses.dataclass(frozen=True)
class Role:
    """A head's role, named when its `statistic` is at least `threshold`."""

    name: str
    statistic: str
    threshold: float


# 0.5: a head named for one key puts the majority of its weight there, more than on all its other keys
# together; a head spread evenly gives the previous token 1/(i + 1) at query i, about 0.12 on average
# over 24 tokens. 0.3 for induction: the token after the earlier occurrence is one key among up to 2N,
# so a copying head stands apart well before it holds the majority, and 0.3 is still more than ten
# times what an even spread gives it on N = 32 ids repeated (about ln 2 / N: 0.022; 0.043 for N = 16).
# Measured on the fortunes model (4 x 8 heads, nine repeated random sequences of 16, 32 and 64 ids), no
# head's induction share exceeds 0.12, under three times the even spread: none is named, rightly.
ROLES = (
    Role("previous-token", "previous_token_share", 0.5),
    Role("first-position", "first_position_share", 0.5),
    Role("induction", INDUCTION, 0.3),
)


def real_positions(attention_mask: np.ndarray) -> np.ndarray:
    """(B, S) each position's index among its row's real tokens (padding: -1)."""
    real = attention_mask.astype(bool)
    return np.where(real, np.cumsum(real, axis=-1) - 1, -1)


def layer_statistics(weights: np.ndarray, attention_mask: np.ndarray, token_ids: np.ndarray | None = None) -> dict:
    """One layer's statistics: {"queries": how many each mean is over, "heads": [{"head": h, the four
    numbers}, ...]} from its weights (B, H, T, S) and the call's mask (B, S); with the call's token ids
    (B, S), also each head's `induction_share` and the layer's "induction_queries"."""
    batch, n_heads, new, total = weights.shape
    if attention_mask.shape != (batch, total):
        shapes = f"{list(attention_mask.shape)} for weights of shape {list(weights.shape)}"
        raise ValueError(f"attention mask of shape {shapes}; expected (batch, keys) = {[batch, total]}")
    if token_ids is not None and np.shape(token_ids) != (batch, total):
        shapes = f"{list(np.shape(token_ids))} for weights of shape {list(weights.shape)}"
        raise ValueError(f"token ids of shape {shapes}; expected (batch, keys) = {[batch, total]}")
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
    heads = [
        {"head": head, **{name: _mean(values[:, head], counted, queries) for name, values in per_query.items()}}
        for head in range(n_heads)
    ]
    if token_ids is None:
        return {"queries": queries, "heads": heads}
    followers = induction_keys(np.asarray(token_ids), attention_mask)[:, total - new :]  # (B, T)
    repeated = followers >= 0
    on_follower = np.take_along_axis(p, np.maximum(followers, 0)[:, None, :, None], axis=-1)[..., 0]  # (B, H, T)
    induction_queries = int(repeated.sum())
    for head, statistics in enumerate(heads):
        statistics[INDUCTION] = _mean(on_follower[:, head], repeated, induction_queries)
    return {"queries": queries, "induction_queries": induction_queries, "heads": heads}


def induction_keys(token_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """(B, S) for each real position i whose id occurred at an earlier real position: the key position
    of the real token after the latest such occurrence j, when that token is before i (else -1; -1 for
    padding and for a token seen first). Padding is skipped: j's follower is the next real token."""
    keys = np.full(token_ids.shape, -1, np.int64)
    for row, (ids, mask) in enumerate(zip(token_ids, attention_mask, strict=True)):
        real = np.flatnonzero(mask)  # key positions of the real tokens, in order
        latest: dict[int, int] = {}  # id -> its latest real index so far
        for index, token in enumerate(ids[real].tolist()):
            earlier = latest.get(token)
            if earlier is not None and earlier + 1 < index:
                keys[row, real[index]] = real[earlier + 1]
            latest[token] = index
    return keys


def _share_at(p: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """(B, H, T) the weight each query puts on the keys `keys` (B, T, S) marks for it (one per query)."""
    return np.sum(p * keys[:, None, :, :], axis=-1)


def _mean(values: np.ndarray, counted: np.ndarray, queries: int) -> float | None:
    return float(values[counted].sum() / queries) if queries else None


def head_statistics(
    maps: Sequence[np.ndarray], attention_mask: np.ndarray, token_ids: np.ndarray | None = None
) -> list[dict]:
    """Every layer's statistics, [{"layer": i, "queries": n, "heads": [...]}, ...]: plain lists, dicts,
    ints and floats (JSON as it is). With the call's token ids (B, P+T), the induction share too."""
    return [
        {"layer": layer, **layer_statistics(weights, attention_mask, token_ids)} for layer, weights in enumerate(maps)
    ]


def head_roles(statistics: list[dict]) -> list[dict]:
    """Per role of ROLES: {"role", "statistic", "threshold", "measured": whether any head has the statistic
    (the induction share needs token ids and a repeated token), "heads": [{"layer", "head", "share"}, ...]
    at or above the threshold, largest first}. Plain JSON, as the statistics."""
    roles = []
    for role in ROLES:
        measured = [
            {"layer": layer["layer"], "head": head["head"], "share": head[role.statistic]}
            for layer in statistics
            for head in layer["heads"]
            if head.get(role.statistic) is not None
        ]
        found = sorted((h for h in measured if h["share"] >= role.threshold), key=lambda h: -h["share"])
        named = {"role": role.name, "statistic": role.statistic, "threshold": role.threshold}
        roles.append(named | {"measured": bool(measured), "heads": found})
    return roles


def statistics_table(statistics: list[dict]) -> str:
    """The statistics as a table, a line per layer and head (the induction column where it was measured),
    then the heads each role names."""
    names = STATISTICS + ((INDUCTION,) if _has_induction(statistics) else ())
    titles = ("entropy", "mean distance", "first position", "previous token", "induction")[: len(names)]
    widths = tuple(len(title) for title in titles)
    header = f"{'layer':>5} {'head':>4}  " + "  ".join(titles)
    lines = [header, "-" * len(header)]
    for layer in statistics:
        for head in layer["heads"]:
            cells = [_cell(head.get(name), width) for name, width in zip(names, widths, strict=True)]
            lines.append(f"{layer['layer']:>5} {head['head']:>4}  " + "  ".join(cells))
    notes = ["entropy in nats; distance in tokens back; shares of the query's weight"]
    if INDUCTION in names:
        notes.append(f"induction: on the token after the current token's last occurrence, over {_repeats(statistics)}")
    return "\n".join([*lines, *notes, "heads found:", *(_found(role) for role in head_roles(statistics))])


def _has_induction(statistics: list[dict]) -> bool:
    return any(INDUCTION in head for layer in statistics for head in layer["heads"])


def _repeats(statistics: list[dict]) -> str:
    count = statistics[0].get("induction_queries", 0) if statistics else 0
    return f"{count} quer{'y' if count == 1 else 'ies'} whose token occurred before"


def _found(role: dict) -> str:
    what = f"  {role['role']} heads ({role['statistic']} >= {role['threshold']})"
    if not role["measured"]:
        return f"{what}: not measured" + (
            " (no token ids, or no repeated token)" if role["statistic"] == INDUCTION else ""
        )
    named = ", ".join(f"L{h['layer']}H{h['head']} ({h['share']:.2f})" for h in role["heads"])
    return f"{what}: {named or 'none found'}"


def _cell(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.3f}"
