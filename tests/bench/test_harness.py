"""What every bench shares (bench/timing.py, bench/results.py): the rounds' interleaving, the goals' verdicts,
the plan a command's flags change and what a run prints at its end."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from bench import results as output
from bench.timing import interleaved


def test_each_round_reverses_the_candidates_order():
    assert list(interleaved(3, ("a", "b", "c"))) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (2, "c"),
    ]  # fmt: skip
    assert list(interleaved(0, ["a"])) == []


def test_a_goal_is_met_only_on_its_side_of_the_bound():
    assert output.goal(1.0, least=1) == {"ratio": 1.0, "target": ">= 1", "met": True}
    assert output.goal(0.99, least=1)["met"] is False
    assert output.goal(1.2, most=1.1, kind="speedup", where="seed") == {
        "speedup": 1.2, "target": "<= 1.1", "met": False, "where": "seed",
    }  # fmt: skip
    assert output.goal(0.5, least=0.8, target="at most 20% slower")["target"] == "at most 20% slower"
    with pytest.raises(ValueError, match="bounded below"):
        output.goal(1.0)
    with pytest.raises(ValueError, match="bounded below"):
        output.goal(1.0, least=1, most=2)


@dataclasses.dataclass(frozen=True)
class Plan:
    rounds: int = 3
    lengths: tuple[int, ...] = (1000, 4000)

    @classmethod
    def quick(cls) -> Plan:
        return cls(rounds=1, lengths=(128,))


def test_the_flags_given_change_the_plan_and_the_others_keep_its_values():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lengths")
    output.rounds_argument(parser, None, "default 3; --quick 1")
    args = parser.parse_args(["--lengths", "256,512"])
    assert output.planned(args, Plan, "rounds", lengths=output.counts(args.lengths)) == Plan(3, (256, 512))
    args = parser.parse_args(["--quick", "--rounds", "2"])
    assert output.planned(args, Plan, "rounds", lengths=output.counts(args.lengths)) == Plan(2, (128,))


def test_a_run_writes_its_json_and_plot_and_says_after_its_table_when_the_machine_was_busy(tmp_path, capsys):
    def plot(results, path):
        path.write_bytes(b"png")
        return path

    results = {"rows": [1], "machine": {"load_average_1min": {"before": 1.5, "after": 0.3}}}
    assert output.report(results, tmp_path, "x", plot, "the table", png="x_plot") == 0
    assert capsys.readouterr().out.splitlines() == [
        "the table",
        "note: the machine was busy when the run began (1-minute load average 1.5): expect noise",
        f"wrote {tmp_path / 'x.json'} and {tmp_path / 'x_plot.png'}",
    ]
    assert json.loads((tmp_path / "x.json").read_text()) == results
    results["machine"]["load_average_1min"]["before"] = 0.2
    output.report(results, tmp_path, "x", plot, "the table")
    assert "busy" not in capsys.readouterr().out and (tmp_path / "x.png").read_bytes() == b"png"


def test_target_lines_say_each_verdict_or_why_none_was_measured():
    targets = {"fast": output.goal(1.2, least=1), "slow": output.goal(0.5, least=1)}
    assert output.target_lines("goal:", targets, "ratio") == [
        "goal:",
        "  fast: 1.20x (target >= 1) -> met",
        "  slow: 0.50x (target >= 1) -> MISSED",
    ]
    assert output.target_lines("goal:", {}, "ratio", "goal: not measured (16 at once not run)") == [
        "goal: not measured (16 at once not run)"
    ]


def test_a_table_lines_up_its_columns_by_their_widest_cells():
    text = output.table("heading", ("name", "ms", "x"), [("served", "12.50", "1.00x"), ("in-process", "3.1", "4.03x")])
    assert text.splitlines() == [
        "heading",
        "name          ms     x",
        "served     12.50 1.00x",
        "in-process   3.1 4.03x",
    ]


def test_during_records_the_load_before_and_after_and_the_machine():
    with output.during(2, "numpy") as facts:
        assert "after" not in facts["load_average_1min"]
    assert facts["threads"] == 2 and facts["numpy"] and facts["cores"] >= 1
    assert set(facts["load_average_1min"]) == {"before", "after"}
