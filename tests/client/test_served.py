"""The client against the real Triton of tests/fixtures/triton.py (the `gqa` test artifact served
as `forward` and `sessions`): sync and asyncio, HTTP and gRPC, compared with the PyTorch original."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import numpy as np
import pytest
import tritonclient.http as httpclient

from client import AsyncClient, Client, retry
from client.errors import (
    ClientError,
    InvalidInputError,
    ModelNotFoundError,
    RequestTimeoutError,
    ServerBusyError,
    ServerUnavailableError,
    UnknownSessionError,
)
from contract import names
from export.parity import TOLERANCES, Scenario, compare_rung
from serving.engine.ort import Forward
from tests.client.conftest import DelayedProxy
from tests.fixtures.served import (
    PROTOCOLS,
    SESSION_PROTOCOLS,
    full_forward,
    hidden,
    live_sequences,
    settled_sequences,
    url,
)


def client_runner(infer) -> Forward:
    """`infer(hidden, mask, past)` (our client's, or a sync wrapper of the async one) as a
    parity-ladder runner over named arrays."""

    def run(inputs):
        n_layers = names.layer_count(list(inputs))
        past = [tuple(inputs[names.past_name(i, kind)] for kind in names.KV_KINDS) for i in range(n_layers)]
        result = infer(inputs[names.HIDDEN_STATES], inputs.get(names.ATTENTION_MASK), past or None)
        arrays = {names.OUTPUT: result.output}
        for layer, (key, value) in enumerate(result.present):
            arrays[names.present_name(layer, names.KEY)] = key
            arrays[names.present_name(layer, names.VALUE)] = value
        return arrays

    return run


def assert_parity(served_cfg, served_reference, runner) -> None:
    scenario = Scenario(batch=3, prefill=7, steps=12, padding=(0, 2, 5))  # left-padded; the past starts empty
    result = compare_rung(served_cfg, served_reference, runner, scenario, TOLERANCES["fp32"])
    worst = {name: (error.max_abs, error.step) for name, error in result.tensors.items()}
    assert result.passed and max(error.max_abs for error in result.tensors.values()) <= 1e-5, worst
    assert len(result.step_errors) == scenario.steps + 1


# --- stateless parity -----------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_infer_matches_pytorch_over_prefill_and_decode(triton, served_cfg, served_reference, protocol):
    with Client(url(triton, protocol), protocol) as client:
        info = client.metadata()
        assert (info.n_layers, info.d_model, info.n_kv_heads, info.head_dim) == (
            served_cfg.n_layers,
            served_cfg.d_model,
            served_cfg.n_kv_heads,
            served_cfg.head_dim,
        )
        assert_parity(served_cfg, served_reference, client_runner(client.infer))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_async_infer_matches_pytorch_over_prefill_and_decode(triton, served_cfg, served_reference, protocol):
    with asyncio.Runner() as loop:  # one loop for the whole scenario: the client belongs to it
        client = AsyncClient(url(triton, protocol), protocol)
        assert loop.run(client.metadata()).n_layers == served_cfg.n_layers
        assert_parity(served_cfg, served_reference, client_runner(lambda *args: loop.run(client.infer(*args))))
        loop.run(client.close())


# --- sessions -------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", SESSION_PROTOCOLS)
def test_a_session_equals_the_full_causal_forward_and_ends_on_exit(triton, served_cfg, served_reference, protocol):
    pieces = [hidden(served_cfg, 1, 6, seed=1)] + [hidden(served_cfg, 1, 1, seed=2 + i) for i in range(10)]
    before = settled_sequences(triton)
    with Client(url(triton, protocol), protocol) as client:
        with client.session() as session:
            outputs = [session.step(pieces[0])]
            assert live_sequences(triton, before + 1) == before + 1  # START made the server's cache
            outputs += [session.step(piece) for piece in pieces[1:]]
            assert session.length == 16
        assert session.closed
        assert live_sequences(triton, before) == before  # END (a zero-token request) freed it
    served = np.concatenate(outputs, axis=1)
    np.testing.assert_allclose(served, full_forward(served_reference, pieces), rtol=0, atol=1e-5)


def test_a_session_with_padding_and_end_on_the_last_step(triton, served_cfg, served_reference):
    pieces = [hidden(served_cfg, 1, 5, seed=3), hidden(served_cfg, 1, 1, seed=4), hidden(served_cfg, 1, 2, seed=5)]
    masks = [np.array([[0, 0, 1, 1, 1]]), np.ones((1, 1), np.int64), np.ones((1, 2), np.int64)]
    with Client(triton.grpc_url) as client:
        session = client.session()
        outputs = [session.step(pieces[0], masks[0]), session.step(pieces[1], masks[1])]
        outputs.append(session.step(pieces[2], masks[2], end=True))
        assert session.closed
        with pytest.raises(UnknownSessionError, match="closed"):
            session.step(pieces[1])
    served = np.concatenate(outputs, axis=1)
    expected = full_forward(served_reference, pieces, np.concatenate(masks, axis=1))
    np.testing.assert_allclose(served[:, 2:], expected[:, 2:], rtol=0, atol=1e-5)  # padded rows: unspecified


def fail_inside(session, x) -> None:
    with session:
        session.step(x)
        raise KeyError("the caller's own error")


def test_a_session_is_ended_even_when_the_block_fails(triton, served_cfg):
    before = settled_sequences(triton)
    with Client(triton.grpc_url) as client:
        session = client.session()
        with pytest.raises(KeyError, match="the caller's own error"):
            fail_inside(session, hidden(served_cfg, 1, 2, seed=6))
    assert session.closed
    assert live_sequences(triton, before) == before


@pytest.mark.parametrize("protocol", SESSION_PROTOCOLS)
def test_concurrent_async_sessions_each_equal_their_own_forward(triton, served_cfg, served_reference, protocol):
    async def drive(client, seed):
        pieces = [hidden(served_cfg, 1, 3 + seed % 3, seed=100 + seed)] + [
            hidden(served_cfg, 1, 1, seed + 200 + i) for i in range(6)
        ]
        async with client.session() as session:
            outputs = [await session.step(piece) for piece in pieces]
        return pieces, np.concatenate(outputs, axis=1)

    async def run():
        async with AsyncClient(url(triton, protocol), protocol) as client:
            return await asyncio.gather(*(drive(client, seed) for seed in range(8)))

    for pieces, served in asyncio.run(run()):
        np.testing.assert_allclose(served, full_forward(served_reference, pieces), rtol=0, atol=1e-5)


@pytest.mark.parametrize("protocol", SESSION_PROTOCOLS)
def test_one_client_serves_sessions_from_several_threads(triton, served_cfg, served_reference, protocol):
    results = {}

    def drive(client, seed):
        pieces = [hidden(served_cfg, 1, 4, seed=300 + seed)] + [
            hidden(served_cfg, 1, 1, seed=400 + 10 * seed + i) for i in range(4)
        ]
        with client.session() as session:
            results[seed] = pieces, np.concatenate([session.step(piece) for piece in pieces], axis=1)

    with Client(url(triton, protocol), protocol) as client:
        threads = [threading.Thread(target=drive, args=(client, seed)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert sorted(results) == [0, 1, 2, 3]
    for pieces, served in results.values():
        np.testing.assert_allclose(served, full_forward(served_reference, pieces), rtol=0, atol=1e-5)


# --- errors ---------------------------------------------------------------------------------


def request_count(triton, model: str) -> int:
    """Requests the model has answered so far, successes and failures (Triton's statistics)."""
    stats = httpclient.InferenceServerClient(triton.http_url).get_inference_statistics(model)
    inference = stats["model_stats"][0]["inference_stats"]
    return inference["success"]["count"] + inference["fail"]["count"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_inputs_are_refused_before_sending(triton, served_cfg, protocol):
    with Client(url(triton, protocol), protocol) as client:
        client.metadata()
        before = request_count(triton, "forward")
        with pytest.raises(InvalidInputError, match="hidden_states") as caught:
            client.infer(hidden(served_cfg, 1, 2, seed=0).astype(np.float64))
        assert caught.value.status is None
        poisoned = hidden(served_cfg, 1, 2, seed=0)
        poisoned[0, 1, 5] = np.nan
        with pytest.raises(InvalidInputError, match=r"expected finite float32 values, got nan at index \[0, 1, 5\]"):
            client.infer(poisoned)
        with pytest.raises(InvalidInputError, match="finite"), client.session() as session:
            session.step(poisoned)
        assert request_count(triton, "forward") == before  # no round trip


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_server_rejections_are_typed_and_the_server_keeps_serving(triton, served_cfg, protocol):
    x = hidden(served_cfg, 2, 3, seed=7)
    with (
        Client(url(triton, protocol), protocol) as client,
        Client(url(triton, protocol), protocol, validate=False) as raw,
    ):
        before = client.infer(x).output
        bad = {
            "dtype": ((x.astype(np.float64),), ["hidden_states", "FP64"]),  # Triton core's own check
            "width": ((x[..., :128],), ["hidden_states"]),  # Triton core's shape check
            "mask": ((x, np.ones((2, 5), np.int64)), ["attention_mask"]),  # our model's check
            "inf": ((np.where(x > 2.5, np.inf, x),), ["hidden_states", "finite", "inf"]),  # our model's check
        }
        for args, words in bad.values():
            with pytest.raises(InvalidInputError) as caught:
                raw.infer(*args)
            assert caught.value.status in ("400", "StatusCode.INVALID_ARGUMENT")
            assert all(word in caught.value.message for word in words), caught.value.message
        np.testing.assert_array_equal(client.infer(x).output, before)


@pytest.mark.parametrize("protocol", SESSION_PROTOCOLS)
def test_a_session_the_server_forgot_is_unknown(triton, served_cfg, protocol):
    x = hidden(served_cfg, 1, 2, seed=8)
    with Client(url(triton, protocol), protocol) as client:
        with client.session() as session:
            session.step(x)
            client.session(sequence_id=session.id).step(x, end=True)  # someone else restarts and ends the id
            with pytest.raises(UnknownSessionError, match="START") as caught:
                session.step(x)
            assert caught.value.status in ("400", "StatusCode.INVALID_ARGUMENT")
            assert session.closed  # nothing left to end
        with client.session() as fresh:  # and the server goes on
            assert fresh.step(x).shape == (1, 2, served_cfg.d_model)


def test_an_http_client_is_told_that_sessions_go_over_grpc(triton, served_cfg):
    """The session model is decoupled, which Triton serves on gRPC streams only: an HTTP client's stateless
    calls work, and a session is refused before anything is sent, naming what to do."""
    x = hidden(served_cfg, 1, 2, seed=8)
    with Client(triton.http_url, "http") as client:
        assert client.infer(x).output.shape == (1, 2, served_cfg.d_model)
        with pytest.raises(ClientError, match="protocol='grpc'"):
            client.session().step(x)


def fill_budget(client, sessions: list, token: np.ndarray) -> None:
    for _ in range(1024):  # far more sessions than TEST_SETTINGS' budget holds
        sessions.append(client.session())
        sessions[-1].step(token)


@pytest.mark.parametrize("protocol", SESSION_PROTOCOLS)
def test_a_full_kv_cache_budget_is_server_busy(triton, served_cfg, protocol):
    token = hidden(served_cfg, 1, 1, seed=9)
    with Client(url(triton, protocol), protocol) as client:
        sessions = []
        try:
            with pytest.raises(ServerBusyError, match="budget") as caught:
                fill_budget(client, sessions, token)
            assert caught.value.status in ("503", "StatusCode.UNAVAILABLE")
            assert sessions[0].step(token).shape == (1, 1, served_cfg.d_model)  # the live ones keep working
            with pytest.raises(ServerBusyError, match="budget"):  # admission: refused when opened, not later
                client.session().open()
        finally:
            for session in sessions:
                session.close()
        with client.session() as session:  # the budget came back
            session.step(token)


@pytest.mark.parametrize("protocol", SESSION_PROTOCOLS)
def test_a_session_opened_before_its_first_step_computes_the_same(triton, served_cfg, protocol):
    steps = [hidden(served_cfg, 1, n, seed=20 + n) for n in (4, 1, 1)]
    with Client(url(triton, protocol), protocol) as client:
        with client.session() as lazy:
            expected = [lazy.step(x) for x in steps]
        with client.session().open() as opened:
            assert opened.started and opened.length == 0
            for x, want in zip(steps, expected, strict=True):
                np.testing.assert_array_equal(opened.step(x), want)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_waiting_for_readiness(triton, protocol):
    with Client(url(triton, protocol), protocol) as client:
        assert client.wait_ready(timeout=10).ok
    with Client(url(triton, protocol), protocol, session_model="nope") as client:
        assert client.health().models == {"forward": True, "nope": False}
        assert client.ready() is False
        with pytest.raises(ServerUnavailableError, match="model 'nope' not ready"):
            client.wait_ready(timeout=0.2, interval=0.05)

    async def run():
        async with AsyncClient(url(triton, protocol), protocol) as client:
            return await client.wait_ready(timeout=10)

    assert asyncio.run(run()).ok


def test_an_unknown_model_is_named(triton, served_cfg):
    with Client(triton.grpc_url, model="nope", retries=0) as client, pytest.raises(ModelNotFoundError, match="nope"):
        client.infer(hidden(served_cfg, 1, 1, seed=0))


# --- timeouts and retries -------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_request_slower_than_the_timeout_times_out(triton, served_cfg, protocol):
    long_prefill = hidden(served_cfg, 1, 1024, seed=10)  # tens of milliseconds of work
    hasty = Client(url(triton, protocol), protocol, timeout=0.001, validate=False)
    with hasty, pytest.raises(RequestTimeoutError):
        hasty.infer(long_prefill)
    with Client(url(triton, protocol), protocol) as client:
        assert client.infer(hidden(served_cfg, 1, 2, seed=11)).output.shape == (1, 2, served_cfg.d_model)


@pytest.mark.parametrize("protocol", SESSION_PROTOCOLS)
def test_async_a_step_slower_than_the_timeout_times_out(triton, served_cfg, protocol):
    async def run():
        async with AsyncClient(url(triton, protocol), protocol, timeout=0.001, validate=False) as hasty:
            session = hasty.session()
            with pytest.raises(RequestTimeoutError):
                await session.step(hidden(served_cfg, 1, 1024, seed=12))
            with contextlib.suppress(RequestTimeoutError):  # its END may not make it in 1 ms either
                await session.close()
            assert session.closed
        async with AsyncClient(url(triton, protocol), protocol) as client:
            # whether the timed-out START ran is unknown: restart and end the id to free its cache
            await client.session(sequence_id=session.id).step(hidden(served_cfg, 1, 1, seed=13), end=True)
            return await client.ready()

    assert asyncio.run(run()) is True


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_retries_ride_out_a_server_that_comes_up(triton, protocol, caplog):
    caplog.set_level(logging.WARNING, logger=retry.__name__)
    proxy = DelayedProxy(url(triton, protocol))
    opener = threading.Timer(0.3, proxy.open)
    opener.start()
    try:
        with Client(proxy.url, protocol, retries=8, backoff=0.05) as client:
            assert client.ready() is True
            assert client.metadata().n_layers == 2
    finally:
        opener.cancel()
        proxy.close()
    assert any("retry 1/8" in record.getMessage() for record in caplog.records)


# --- the command line -----------------------------------------------------------------------


def test_cli_health_infer_and_bench(triton, served_cfg, tmp_path, capsys):
    from client.__main__ import main

    assert main(["health", "--url", triton.grpc_url]) == 0
    assert "model sessions: serving" in capsys.readouterr().out  # it answered a real token
    np.save(tmp_path / "hidden.npy", hidden(served_cfg, 2, 3, seed=13))
    assert (
        main(["infer", "--url", triton.http_url, "--protocol", "http", "--hidden", str(tmp_path / "hidden.npy")]) == 0
    )
    out = capsys.readouterr().out
    assert f"output (2, 3, {served_cfg.d_model}) float32" in out and "present.1: key (2, 4, 3, 32)" in out
    assert main(["infer", "--url", triton.grpc_url, "--session", "--tokens", "4"]) == 0
    assert f"output (1, 4, {served_cfg.d_model})" in capsys.readouterr().out
    for protocol, mode in (("grpc", "session"), ("http", "stateless")):
        argv = ["bench", "--url", url(triton, protocol), "--protocol", protocol, "--mode", mode, "--steps", "5"]
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert f"{mode} over {protocol}: 5 decode steps" in out and "p50" in out and "p99" in out
