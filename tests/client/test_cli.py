"""`python -m client` without a server: its bounds and its answer when the server is down."""

from __future__ import annotations

import pytest

from client.__main__ import MAX_SECONDS, MAX_STEPS, main


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--steps", "0"],
        ["bench", "--steps", str(MAX_STEPS + 1)],
        ["bench", "--time-limit", str(MAX_SECONDS + 1)],
        ["bench", "--mode", "forever"],
        ["infer", "--protocol", "websocket"],
        ["frobnicate"],
    ],
)
def test_unbounded_or_unknown_requests_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["health", "infer", "bench"])
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_stopped_server_is_reported_not_raised(command, protocol, refusing_url, capsys):
    code = main([command, "--url", refusing_url, "--protocol", protocol, "--retries", "0"])
    assert code == 1
    assert "ServerUnavailableError" in capsys.readouterr().err


def test_a_missing_input_file_is_reported(tmp_path, refusing_url, capsys):
    # the file is read after the metadata, so point at a server that is down to keep this offline
    code = main(["infer", "--url", refusing_url, "--hidden", str(tmp_path / "nope.npy"), "--retries", "0"])
    assert code == 1
    assert "error:" in capsys.readouterr().err


def test_a_mistyped_flag_gets_its_commands_usage(capsys):
    """The command's own usage (its flags), not the top-level one's."""
    with pytest.raises(SystemExit) as done:
        main(["health", "--retry", "2"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.startswith("usage: python -m client health [-h] [--url URL]"), err
    assert err.endswith("python -m client health: error: unrecognized arguments: --retry 2\n"), err
