"""The parts that need no Triton: settings from the environment, the loopback rule without keys,
key comparison, and the binary tensor encoding (what the arrays must be: test_validated.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import orjson
import pytest

from contract.inputs import InputError
from serving.gateway import Settings, run_gateway
from serving.gateway.auth import key_matches
from serving.gateway.encoding import EncodedTensor, decode, encode, tensor_json
from serving.gateway.settings import settings_environment


def test_settings_come_from_serving_variables(monkeypatch, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# rotated 2024-06\nfrom-file\n\n  other  \nshared\n")
    monkeypatch.setenv("SERVING_API_KEYS", " a, b ,,shared")
    monkeypatch.setenv("SERVING_API_KEYS_FILE", str(keys_file))
    monkeypatch.setenv("SERVING_TRITON_URL", "triton:8001")
    monkeypatch.setenv("SERVING_SESSIONS_PER_KEY", "2")
    settings = Settings()
    assert settings.accepted_keys() == ("a", "b", "shared", "from-file", "other")
    assert (settings.triton_url, settings.sessions_per_key, settings.port) == ("triton:8001", 2, 8080)
    assert Settings(sessions_per_key=5).sessions_per_key == 5  # arguments win over the environment


def test_settings_made_again_from_their_variables_are_the_same(monkeypatch, tmp_path):
    """What `python -m serving` hands its gateway process: every kind of field (keys, a secret, a JSON map,
    a path, a flag, a number, an empty store) read back from the variables equals what was given."""
    given = Settings(
        api_keys=("a", "b"),
        api_keys_file=tmp_path / "keys",
        session_secret="s" * 40,
        more_served_models={"tiny-qwen": "tiny-qwen_sessions"},
        session_store="none",
        gc_freeze=False,
        sessions_per_key=3,
        template_timeout_s=2.5,
        triton_metrics_urls=("http://127.0.0.1:8002/metrics",),
        max_request_tokens=None,
    )
    for name in [name for name in os.environ if name.startswith("SERVING_")]:
        monkeypatch.delenv(name)
    for name, value in settings_environment(given).items():
        monkeypatch.setenv(name, value)
    assert Settings() == given


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({}, None),
        ({"SERVING_SESSION_STORE": "none"}, ""),
        ({"SERVING_SESSION_STORE": " None "}, ""),
        ({"SERVING_SESSION_STORE": "redis://127.0.0.1:6379/0"}, "redis://127.0.0.1:6379/0"),
    ],
)
def test_the_session_store_is_read_once_from_its_setting(monkeypatch, environment, expected):
    """Unset: python -m serving gives its gateway a folder of its own; `none`: no store; else the store."""
    monkeypatch.delenv("SERVING_SESSION_STORE", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert Settings().session_store == expected


def test_without_keys_the_gateway_binds_loopback_only_and_says_so(monkeypatch, caplog):
    monkeypatch.delenv("SERVING_API_KEYS", raising=False)
    monkeypatch.delenv("SERVING_API_KEYS_FILE", raising=False)
    assert Settings(host="0.0.0.0", api_keys="k").bind_host() == "0.0.0.0"
    with caplog.at_level(logging.WARNING), run_gateway(Settings(host="0.0.0.0", port=0)) as gateway:
        assert gateway._server.servers[0].sockets[0].getsockname()[0] == "127.0.0.1"
    assert "auth is DISABLED" in caplog.text and "SERVING_HOST=0.0.0.0 ignored" in caplog.text


def test_bad_settings_stop_the_cli_with_a_message(tmp_path):
    env = {"SERVING_API_KEYS_FILE": str(tmp_path / "missing"), "SERVING_PORT": "8080", "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-m", "serving.gateway"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 2 and "SERVING_API_KEYS_FILE" in run.stderr and "cannot read it" in run.stderr
    env = {"SERVING_PORT": "eighty", "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-m", "serving.gateway"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 2 and "port" in run.stderr


def test_keys_are_compared_as_bytes_against_every_key():
    keys = [b"alpha", b"beta"]
    assert key_matches("beta", keys) and not key_matches("bet", keys) and not key_matches("béta", keys)
    assert not key_matches("alpha", [])


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
def test_b64_tensors_round_trip_bit_exact(dtype):
    rng = np.random.default_rng(0)
    array = (rng.standard_normal((2, 3, 5)) * 100).astype(dtype)
    if dtype == "int64":
        array = (array > 0).astype(dtype)
    encoded = encode(array, "b64")
    assert encoded["dtype"] == dtype and encoded["shape"] == [2, 3, 5]
    decoded = decode(EncodedTensor(**encoded), "x", dtype)
    assert decoded.dtype == np.dtype(dtype) and decoded.flags.writeable
    np.testing.assert_array_equal(decoded, array)
    as_lists = orjson.loads(tensor_json(encode(array, "json")))  # nested lists too, through their JSON text
    np.testing.assert_array_equal(decode(as_lists, "x", dtype), array)


def test_b64_bytes_are_little_endian_c_order():
    encoded = encode(np.array([[1.0, 2.0]], dtype=np.float32), "b64")
    assert encoded["b64"] == "AACAPwAAAEA="  # 0x3f800000, 0x40000000 little-endian
    assert encode(np.array([[1, 0]], dtype=np.int64), "b64")["b64"] == "AQAAAAAAAAAAAAAAAAAAAA=="


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        ({"dtype": "float32", "shape": [2], "b64": "AACAPw=="}, "shape [2] of float32 needs 8 bytes"),
        ({"dtype": "float32", "shape": [0, 2**31 - 1, 2**31 - 1, 2**31 - 1], "b64": ""}, "not a valid"),
    ],
)
def test_b64_tensors_that_do_not_fit_are_named_errors(tensor, message):
    with pytest.raises(InputError, match=r"^input 'x': ") as error:
        decode(EncodedTensor(**tensor), "x", "float32")
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("lists", "dtype", "message"),
    [
        ([[0.5, 1.0], [0.5]], "float32", "ragged nested lists"),
        ([["0.5", 1.0]], "float32", "expected numbers in nested lists, got strings"),
        ([[None, 1.0]], "float32", "expected numbers in nested lists, got null"),
        ([[1, 0.5]], "int64", "expected integers 0 or 1 in nested lists, got numbers with a fraction"),
        ([[True, False]], "int64", "got booleans"),
    ],
)
def test_nested_lists_that_are_not_numbers_are_named_errors(lists, dtype, message):
    with pytest.raises(InputError, match=r"^input 'x': ") as error:
        decode(lists, "x", dtype)
    assert message in str(error.value)


def test_the_gateway_command_prints_every_setting_for_help_and_starts_nothing():
    done = subprocess.run(
        [sys.executable, "-m", "serving.gateway", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    for name in Settings.model_fields:
        assert f"SERVING_{name.upper()}  default" in done.stdout
    assert ": None" not in done.stdout  # every setting explained
