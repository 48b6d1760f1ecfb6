"""The induction share and the heads named by role (contract/heads.py) on hand-built weights whose answer
is known by construction: a head that reads the token after the current one's earlier occurrence scores
1, a previous-token head 0 unless the two keys coincide, padding is skipped, a sequence without a repeat
gives None; and the roles and the table name exactly the heads at or above their thresholds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from contract.heads import INDUCTION, ROLES, head_roles, head_statistics, layer_statistics, statistics_table


def one_hot_maps(keys_per_query: list[list[int]], total: int) -> np.ndarray:
    """(1, heads, queries, total) weights: head h's query q puts all its weight on key keys_per_query[h][q]."""
    heads, queries = len(keys_per_query), len(keys_per_query[0])
    weights = np.zeros((1, heads, queries, total))
    for head, keys in enumerate(keys_per_query):
        weights[0, head, np.arange(queries), keys] = 1.0
    return weights


def after_earlier_occurrence(ids: list[int]) -> list[int]:
    """Per query, by a scan written out here: the key after the latest earlier occurrence of its id (itself
    when there is none, or when that key is the query itself)."""
    keys = []
    for query, token in enumerate(ids):
        latest = max((j for j in range(query) if ids[j] == token), default=None)
        keys.append(latest + 1 if latest is not None and latest + 1 < query else query)
    return keys


REPEATED = [7, 3, 9, 4, 7, 3, 9, 4]  # four ids, then the same four


def test_a_head_on_the_token_after_the_earlier_occurrence_scores_one_a_previous_token_head_zero():
    total = len(REPEATED)
    induction = after_earlier_occurrence(REPEATED)
    assert induction == [0, 1, 2, 3, 1, 2, 3, 4]
    previous = [max(q - 1, 0) for q in range(total)]
    first = [0] * total
    weights = one_hot_maps([induction, previous, first], total)
    layer = layer_statistics(weights, np.ones((1, total), np.int64), np.array([REPEATED]))
    assert layer["induction_queries"] == 4  # the second copy
    assert [head[INDUCTION] for head in layer["heads"]] == [1.0, 0.0, 0.0]


def test_an_evenly_spread_head_scores_its_share_of_the_keys():
    count = 16
    ids = list(range(1, count + 1)) * 2
    total = 2 * count
    weights = np.tril(np.ones((total, total))) / np.arange(1, total + 1)[:, None]  # query i: 1 / (i + 1) each
    (layer,) = head_statistics([weights[None, None]], np.ones((1, total), np.int64), np.array([ids]))
    expected = np.mean([1 / (query + 1) for query in range(count, total)])
    assert layer["heads"][0][INDUCTION] == pytest.approx(expected)
    assert expected < 0.05  # what the induction threshold is measured against (contract/heads.py ROLES)


def test_a_previous_token_head_scores_where_the_two_keys_coincide():
    """In a-b-a-b the token after a's earlier occurrence is b, the query's previous token."""
    ids = [1, 2, 1, 2, 1, 2]
    previous = [max(q - 1, 0) for q in range(len(ids))]
    layer = layer_statistics(one_hot_maps([previous], len(ids)), np.ones((1, len(ids)), np.int64), np.array([ids]))
    assert layer["induction_queries"] == 4 and layer["heads"][0][INDUCTION] == 1.0


def test_a_token_right_after_its_own_occurrence_has_no_key_to_read():
    """In 5-5 the token after the earlier 5 is the query itself: not counted."""
    ids = [8, 5, 5]
    layer = layer_statistics(one_hot_maps([[0, 1, 2]], 3), np.ones((1, 3), np.int64), np.array([ids]))
    assert layer["induction_queries"] == 0 and layer["heads"][0][INDUCTION] is None


def test_padding_is_skipped_and_its_rows_and_ids_move_nothing():
    real = [3, 9, 4, 3, 9, 4]
    unpadded = layer_statistics(
        one_hot_maps([after_earlier_occurrence(real)], 6), np.ones((1, 6), np.int64), np.array([real])
    )
    # behind 2 padded positions whose ids (9, 4) match real ones: a scan that did not skip them would
    # count the first 9 and 4 as repeats, their followers padding
    ids = np.array([[9, 4, *real]])
    mask = np.array([[0, 0, 1, 1, 1, 1, 1, 1]])
    weights = np.full((1, 1, 8, 8), 0.5)  # padded queries' rows: anything
    weights[0, 0, 2:] = 0.0
    weights[0, 0, 2:, 2:] = one_hot_maps([after_earlier_occurrence(real)], 6)[0, 0]
    padded = layer_statistics(weights, mask, ids)
    assert padded["induction_queries"] == unpadded["induction_queries"] == 3
    assert padded["heads"] == unpadded["heads"] and padded["heads"][0][INDUCTION] == 1.0


def test_a_calls_new_queries_read_their_past_keys():
    """Two new queries over eight keys (six of them past): only the new queries count."""
    weights = one_hot_maps([after_earlier_occurrence(REPEATED)], len(REPEATED))[:, :, -2:]
    layer = layer_statistics(weights, np.ones((1, 8), np.int64), np.array([REPEATED]))
    assert layer["induction_queries"] == 2 and layer["heads"][0][INDUCTION] == 1.0


def test_no_ids_keep_the_old_statistics_and_no_repeat_gives_none():
    ids = [1, 2, 3, 4]
    weights = one_hot_maps([[max(q - 1, 0) for q in range(4)]], 4)
    without = head_statistics([weights], np.ones((1, 4), np.int64))
    assert "induction_queries" not in without[0] and INDUCTION not in without[0]["heads"][0]
    unrepeated = head_statistics([weights], np.ones((1, 4), np.int64), np.array([ids]))
    assert unrepeated[0]["induction_queries"] == 0 and unrepeated[0]["heads"][0][INDUCTION] is None
    assert json.loads(json.dumps(unrepeated)) == unrepeated
    with pytest.raises(ValueError, match=r"token ids of shape \[1, 3\] .* expected \(batch, keys\) = \[1, 4\]"):
        head_statistics([weights], np.ones((1, 4), np.int64), np.array([[1, 2, 3]]))


def statistics_of(shares: dict[tuple[int, int], dict[str, float | None]]) -> list[dict]:
    """Statistics of 2 layers x 3 heads, every share 0.1 but those given per (layer, head)."""
    return [
        {
            "layer": layer,
            "queries": 10,
            "heads": [
                {
                    "head": head,
                    "entropy": 1.0,
                    "mean_distance": 2.0,
                    "first_position_share": 0.1,
                    "previous_token_share": 0.1,
                    **shares.get((layer, head), {}),
                }
                for head in range(3)
            ],
        }
        for layer in range(2)
    ]


def test_roles_name_the_heads_at_or_above_their_thresholds_largest_first():
    bounds = {role.statistic: role.threshold for role in ROLES}
    previous, first = bounds["previous_token_share"], bounds["first_position_share"]
    statistics = statistics_of(
        {
            (0, 1): {"previous_token_share": previous},  # at the threshold: named
            (1, 2): {"previous_token_share": 0.91},
            (1, 0): {"previous_token_share": previous - 0.01},  # just under: not
        }
    )
    roles = {role["role"]: role for role in head_roles(statistics)}
    assert roles["previous-token"]["heads"] == [
        {"layer": 1, "head": 2, "share": 0.91},
        {"layer": 0, "head": 1, "share": previous},
    ]
    assert roles["first-position"] == {
        "role": "first-position",
        "statistic": "first_position_share",
        "threshold": first,
        "measured": True,
        "heads": [],
    }
    assert roles["induction"]["measured"] is False and roles["induction"]["heads"] == []
    table = statistics_table(statistics)
    assert f"previous-token heads (previous_token_share >= {previous}): L1H2 (0.91), L0H1 ({previous:.2f})" in table
    assert f"first-position heads (first_position_share >= {first}): none found" in table
    assert "induction heads (induction_share >= " in table and "): not measured" in table
    assert "induction" not in table.splitlines()[0]  # no column where no ids were given


def test_the_table_has_the_induction_column_and_names_the_induction_heads():
    induction = next(role.threshold for role in ROLES if role.statistic == INDUCTION)
    statistics = statistics_of({(layer, head): {INDUCTION: 0.02} for layer in range(2) for head in range(3)})
    statistics[1]["heads"][1][INDUCTION] = 0.64
    for layer in statistics:
        layer["induction_queries"] = 7
    table = statistics_table(statistics).splitlines()
    assert table[0].split()[-1] == "induction"
    rows = {(int(line.split()[0]), int(line.split()[1])): line.split()[-1] for line in table[2:8]}
    assert rows[(1, 1)] == "0.640" and rows[(0, 0)] == "0.020"
    assert any("over 7 queries whose token occurred before" in line for line in table)
    assert f"  induction heads (induction_share >= {induction}): L1H1 (0.64)" in table
