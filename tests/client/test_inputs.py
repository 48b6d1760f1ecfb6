"""Model metadata -> sizes, and the inputs check the client runs before sending (no server)."""

from __future__ import annotations

import numpy as np
import pytest

from client import _wire
from client.core import SessionCore, StepAnswer
from client.errors import ClientError, InvalidInputError
from client.metadata import parse_metadata, with_facts
from client.retry import run_blocking
from contract import names
from contract.config import ModelConfig
from tests.conftest import TEST_CONFIGS


def metadata(cfg: ModelConfig, as_grpc_json: bool = False, model: str = "forward") -> dict:
    """Triton's metadata for a stateless model of `cfg` (docs/design.md, "Tensor names"): dynamic axes are -1, and
    gRPC's JSON renders int64 dims as strings."""

    def entry(spec):
        dims = [-1 if isinstance(axis, str) else axis for axis in spec.shape]
        datatype = "INT64" if spec.is_int64 else "FP32"
        return {"name": spec.name, "datatype": datatype, "shape": [str(d) for d in dims] if as_grpc_json else dims}

    inputs = [entry(s) for s in names.input_specs(cfg)]
    outputs = [entry(s) for s in names.output_specs(cfg)]
    return {"name": model, "versions": ["1"], "platform": "python", "inputs": inputs, "outputs": outputs}


SESSION_METADATA = {
    "name": "sessions",
    "inputs": [
        {"name": names.HIDDEN_STATES, "datatype": "FP32", "shape": [-1, -1, 32]},
        {"name": names.ATTENTION_MASK, "datatype": "INT64", "shape": [-1, -1]},
    ],
    "outputs": [{"name": names.OUTPUT, "datatype": "FP32", "shape": [-1, -1, 32]}],
}


@pytest.mark.parametrize("as_grpc_json", [False, True])
@pytest.mark.parametrize("name", sorted(TEST_CONFIGS))
def test_metadata_gives_the_model_sizes(name, as_grpc_json):
    cfg = TEST_CONFIGS[name]
    info = parse_metadata(metadata(cfg, as_grpc_json))
    # a whole model's IO (ids in, logits out) does not show d_model: its config's fact gives it
    d_model = 0 if cfg.whole else cfg.d_model
    assert (info.n_layers, info.d_model, info.n_kv_heads, info.head_dim) == (
        cfg.n_layers,
        d_model,
        cfg.n_kv_heads,
        cfg.head_dim,
    )
    assert info.vocab_size == cfg.vocab_size
    assert (info.new_tokens, info.answer) == (names.model_input(cfg), names.model_output(cfg))
    assert with_facts(info, {"d_model": cfg.d_model}).d_model == cfg.d_model
    assert info.float_dtype == "float32"
    assert names.input_specs(info.sizes) == names.input_specs(cfg)  # what the inputs check runs on


def test_session_metadata_has_no_layers():
    info = parse_metadata(SESSION_METADATA)
    assert (info.n_layers, info.d_model) == (0, 32)


def test_a_model_without_hidden_states_is_refused():
    with pytest.raises(ClientError, match="no float input 'hidden_states'"):
        parse_metadata({"name": "echo", "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1]}]})


@pytest.fixture(scope="module")
def tiny():
    cfg = TEST_CONFIGS["tiny"]  # d_model 32, 4 heads, 4 kv heads, 2 layers
    return cfg, parse_metadata(metadata(cfg))


def arrays(cfg, batch=2, past=3, new=1):
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((batch, new, cfg.d_model)).astype(np.float32)
    mask = np.ones((batch, past + new), np.int64)
    pairs = [
        tuple(np.zeros((batch, cfg.n_kv_heads, past, cfg.head_dim), np.float32) for _ in names.KV_KINDS)
        for _ in range(cfg.n_layers)
    ]
    return hidden, mask, pairs


def test_good_inputs_are_named_by_the_table(tiny):
    cfg, info = tiny
    hidden, mask, pairs = arrays(cfg)
    assert list(_wire.stateless_tensors(info, hidden, mask, pairs)) == names.input_names(cfg)
    assert list(_wire.stateless_tensors(info, hidden)) == [names.HIDDEN_STATES]  # empty past: left out
    assert list(_wire.stateless_tensors(info, hidden, past=[])) == [names.HIDDEN_STATES]


@pytest.mark.parametrize(
    ("change", "input_name", "says"),
    [
        (lambda h, m, p: (h.astype(np.float64), m, p), names.HIDDEN_STATES, "expected dtype float32, got float64"),
        (lambda h, m, p: (h[0], m, p), names.HIDDEN_STATES, "expected rank 3"),
        (lambda h, m, p: (h[..., :16], m, p), names.HIDDEN_STATES, "axis 2 = 32"),
        (lambda h, m, p: (h, m[:, 1:], p), names.ATTENTION_MASK, "past + new = 3 + 1 = 4, got 3"),
        (lambda h, m, p: (h, m.astype(np.int32), p), names.ATTENTION_MASK, "expected dtype int64"),
        (lambda h, m, p: (h, m, p[:1]), names.past_name(1, names.KEY), "pass every past key and value"),
        (lambda h, m, p: (h, m, [(k[:, :2], v) for k, v in p]), names.past_name(0, names.KEY), "axis 1 = 4"),
        (lambda h, m, p: (h, m, [(k, v[:, :, :2]) for k, v in p]), names.past_name(0, names.VALUE), "past_sequence"),
        (lambda h, m, p: (h[:1], m, p), names.ATTENTION_MASK, "batch_size"),
        (lambda h, m, p: (h, m, [k for k, _ in p]), "past", "(key, value) pairs"),
    ],
)
def test_bad_inputs_name_the_input_before_sending(tiny, change, input_name, says):
    cfg, info = tiny
    hidden, mask, pairs = change(*arrays(cfg))
    with pytest.raises(InvalidInputError, match=r"input|past") as caught:
        _wire.stateless_tensors(info, hidden, mask, pairs)
    assert caught.value.input_name == input_name
    assert says in caught.value.message
    assert caught.value.status is None  # nothing was sent


def test_lists_are_arrays_but_not_silently_cast(tiny):
    cfg, info = tiny
    with pytest.raises(InvalidInputError, match="float64"):
        _wire.stateless_tensors(info, [[[0.0] * cfg.d_model]])


def test_session_steps_hold_one_sequence():
    info = parse_metadata(SESSION_METADATA)
    hidden = np.zeros((1, 3, 32), np.float32)
    assert list(_wire.step_tensors(info, hidden, np.ones((1, 3), np.int64))) == [
        names.HIDDEN_STATES,
        names.ATTENTION_MASK,
    ]
    with pytest.raises(InvalidInputError, match="batch_size must be 1") as caught:
        _wire.step_tensors(info, np.zeros((2, 3, 32), np.float32))
    assert caught.value.input_name == names.HIDDEN_STATES
    with pytest.raises(InvalidInputError, match=r"0 \+ 3 = 3, got 4") as caught:  # the mask covers new tokens only
        _wire.step_tensors(info, hidden, np.ones((1, 4), np.int64))
    assert caught.value.input_name == names.ATTENTION_MASK


class Recorder:
    """The core's client side for a session: records what the session sends."""

    store, checkpoint_every = None, 256  # no session store: not durable

    def __init__(self) -> None:
        self.sent = []

    def _send_step(self, sequence_id, tensors, start, end, replica=None):
        self.sent.append((sequence_id, tensors, start, end))
        return StepAnswer(np.zeros((1, 0, 48), np.float16), replica, None)
        yield  # an operation: a generator that performs nothing here


def test_a_session_ends_with_a_zero_token_request_of_its_own_width():
    recorder = Recorder()
    session = SessionCore(recorder, sequence_id=5)
    run_blocking(session._close(), stub=lambda: None)
    assert recorder.sent == [] and session.closed  # nothing went out: nothing to end
    session = SessionCore(recorder, sequence_id=6)
    session._sent = np.zeros((1, 5, 48), np.float16)  # a step went out (and may have failed)
    run_blocking(session._close(), stub=lambda: None)
    ((sequence_id, tensors, start, end),) = recorder.sent
    assert (sequence_id, start, end) == (6, False, True)
    assert tensors[names.HIDDEN_STATES].shape == (1, 0, 48) and tensors[names.HIDDEN_STATES].dtype == np.float16


def test_sequence_ids_are_random_nonzero_and_fit_grpc_int64():
    ids = {_wire.new_sequence_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(0 < i < 2**63 for i in ids)
    assert _wire.check_sequence_id(7) == 7
    for bad in (0, -1, 2**63, True, "7", 1.0):
        with pytest.raises(ValueError, match="sequence id"):
            _wire.check_sequence_id(bad)


@pytest.mark.parametrize(
    ("url", "protocol", "expected"),
    [
        ("127.0.0.1:9000", "grpc", "127.0.0.1:9000"),
        ("http://localhost:8000/", "http", "localhost:8000"),
        ("grpc://example", "grpc", "example:8001"),
        ("example", "http", "example:8000"),
    ],
)
def test_urls_are_what_tritonclient_wants(url, protocol, expected):
    assert _wire.normalize_url(url, protocol) == expected


def test_unknown_protocols_and_tls_are_refused():
    with pytest.raises(ValueError, match="protocol must be one of"):
        _wire.check_protocol("websocket")
    with pytest.raises(ValueError, match="TLS"):
        _wire.normalize_url("https://example:443", "http")


@pytest.mark.parametrize("name", ["whole", "whole-gpt2"])
def test_a_whole_models_token_ids_are_checked_before_sending(name):
    cfg = TEST_CONFIGS[name]
    info = parse_metadata(metadata(cfg))
    ids = np.array([[1, 2, cfg.vocab_size - 1]], np.int64)
    assert list(_wire.stateless_tensors(info, ids)) == [names.INPUT_IDS]
    assert list(_wire.step_tensors(info, ids)) == [names.INPUT_IDS]
    bad = [
        (ids.astype(np.float32), "expected dtype int64, got float32"),
        (ids + 1, f"token ids must lie in [0, {cfg.vocab_size})"),
        (-ids, f"token ids must lie in [0, {cfg.vocab_size})"),
        (ids[0], "expected rank 2"),
    ]
    for tokens, says in bad:
        with pytest.raises(InvalidInputError) as caught:
            _wire.stateless_tensors(info, tokens)
        assert caught.value.input_name == names.INPUT_IDS
        assert says in caught.value.message
    assert list(_wire.no_tokens_like(ids)) == [names.INPUT_IDS]
    (empty,) = _wire.no_tokens_like(ids).values()
    assert (empty.shape, empty.dtype) == ((1, 0), np.int64) == (info.no_tokens().shape, info.no_tokens().dtype)
