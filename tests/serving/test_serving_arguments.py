"""`python -m serving`'s arguments for several replicas, without starting anything."""

from pathlib import Path

import pytest

from serving.__main__ import parser
from serving.host.front import replica_log


def test_each_replica_logs_to_a_file_of_its_own_and_a_stream_is_shared():
    assert replica_log(Path("/var/log/triton.log"), 2) == Path("/var/log/triton-2.log")
    assert replica_log(Path("/dev/stdout"), 1) == Path("/dev/stdout")  # compose's --log=/dev/stdout
    assert replica_log(None, 0) is None  # a temporary file each, kept on failure


def test_replicas_must_be_at_least_one(capsys):
    assert parser().parse_args(["--replicas", "3"]).replicas == 3
    assert parser().parse_args([]).replicas == 1  # the default: one Triton, no Envoy
    with pytest.raises(SystemExit):
        parser().parse_args(["--replicas", "0"])
    assert "must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["missing", "empty", "incomplete"])
def test_a_named_repository_without_the_models_is_an_error_and_stays_as_it_was(tmp_path, kind, capsys):
    """Only the default repository is filled with the default model; a mistyped or empty path the user
    named is refused naming what it lacks and the commands that fill it."""
    from serving.__main__ import main

    repository = tmp_path / "repo"
    if kind != "missing":
        repository.mkdir()
    if kind == "incomplete":
        (repository / "forward").mkdir()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["--no-gateway", "--model-repository", str(repository)]) == 1
    err = capsys.readouterr().err
    assert f"error: {repository} does not hold the served models" in err
    assert "no such folder" in err if kind == "missing" else "forward: no config.pbtxt" in err
    assert f"python -m serving ensure --repository {repository}" in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_budget_holding_few_sessions_is_a_console_warning_naming_the_option():
    from serving.host.launcher import serving_lines

    said = 'I1124 sessions.py:38] "s: runner static engine; KV cache budget 8 MiB = 2 sequences of up to 512 positions"'
    lines = serving_lines(said + "\nI1124 other.cc:1] unrelated")
    assert lines[0].split() == ["s", "static", "engine"]
    assert "only 2 sessions fit at once" in lines[-1] and "--kv-cache-mib" in lines[-1]
    roomy = said.replace("= 2 sequences", "= 64 sequences")
    assert not any("warning" in line for line in serving_lines(roomy))
