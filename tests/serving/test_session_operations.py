"""The static engine's session operations, without Triton: snapshot and restore, fork and rewind over
the fp32-static graph on the CPU. What a sequence computes after each is held to the PyTorch
original (within 1e-5) and to the same graph's uninterrupted run (bit for bit); a blob that is not
this model's is refused naming what differs, and changes nothing."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from contract.config import ModelConfig
from contract.files import model_filename
from export.artifacts import load_model
from serving.engine import errors, snapshots
from serving.engine.ort import ort_session
from serving.engine.static_engine import StaticSessionEngine
from serving.engine.steps import StepRequest
from tests.fixtures.engine import Reference, cuda_missing, full_rows_engine, tokens

STEPS = 32


@pytest.fixture(scope="module")
def original(artifact_dir):
    return load_model(artifact_dir("gqa"))


def new_engine(artifact_dir, cfg: ModelConfig, rows: int = 4) -> StaticSessionEngine:
    session = ort_session(artifact_dir("gqa") / model_filename("fp32-static"))
    return full_rows_engine(session, cfg, rows=rows, capacity=128)


@pytest.fixture
def engine(artifact_dir, original):
    return new_engine(artifact_dir, original.cfg)


def step(engine, sequence_id, hidden: np.ndarray, start: bool = False) -> np.ndarray:
    (result,) = engine.execute([StepRequest(sequence_id, start, False, hidden)])
    assert isinstance(result, np.ndarray), result
    return result


def continue_both(engine, first, second, reference: Reference, rng) -> None:
    """STEPS decode steps of the same tokens through `first` and `second`: equal bit for bit, and to
    the PyTorch original (which has had the same past) within 1e-5."""
    d = engine.cfg.d_model
    for _ in range(STEPS):
        token = tokens(rng, 1, d)
        ours, theirs = step(engine, first, token), step(engine, second, token)
        np.testing.assert_array_equal(ours, theirs)
        np.testing.assert_allclose(ours, reference.step(token), atol=1e-5, rtol=1e-5)


def test_a_restored_session_continues_exactly_as_the_original(artifact_dir, engine, original):
    rng, d = np.random.default_rng(0), original.cfg.d_model
    reference = Reference(original)
    prompt = tokens(rng, 11, d)
    reference.step(prompt)
    step(engine, "a", prompt, start=True)
    for _ in range(3):
        token = tokens(rng, 1, d)
        step(engine, "a", token), reference.step(token)
    blob = engine.snapshot("a")
    assert engine.length("a") == 14  # a snapshot leaves the sequence as it was

    elsewhere = new_engine(artifact_dir, original.cfg)  # another process's pool, the same graph
    assert elsewhere.restore("b", blob) == 14 and elsewhere.length("b") == 14
    assert snapshots.decode(elsewhere.snapshot("b"), elsewhere.cache.identity)[1] == 14
    np.testing.assert_array_equal(_cache(elsewhere, "b"), _cache(engine, "a"))
    d_rng = np.random.default_rng(1)
    for _ in range(STEPS):
        token = tokens(d_rng, 1, d)
        ours = step(elsewhere, "b", token)
        np.testing.assert_array_equal(ours, step(engine, "a", token))
        np.testing.assert_allclose(ours, reference.step(token), atol=1e-5, rtol=1e-5)


def _cache(engine, sequence_id) -> np.ndarray:
    return np.concatenate([array.ravel() for array in engine.cache.read(sequence_id).values()])


def test_a_fork_gives_two_branches_that_each_continue_as_the_original(engine, original):
    rng, d = np.random.default_rng(2), original.cfg.d_model
    reference = Reference(original)
    prompt = tokens(rng, 7, d)
    reference.step(prompt)
    step(engine, "trunk", prompt, start=True)
    assert engine.fork("trunk", "branch") == 7
    branch_reference = Reference(original)
    branch_reference.past = dict(reference.past)
    # the two go different ways: each against the original with its own past
    for _ in range(8):
        left, right = tokens(rng, 1, d), tokens(rng, 1, d)
        np.testing.assert_allclose(step(engine, "trunk", left), reference.step(left), atol=1e-5, rtol=1e-5)
        right_out = step(engine, "branch", right)
        np.testing.assert_allclose(right_out, branch_reference.step(right), atol=1e-5, rtol=1e-5)
    assert engine.length("trunk") == engine.length("branch") == 15
    with pytest.raises(errors.InvalidRequest, match="cannot be forked into itself"):
        engine.fork("trunk", "trunk")


def test_a_rewind_then_new_tokens_equals_a_session_that_never_had_the_dropped_ones(engine, original):
    rng, d = np.random.default_rng(3), original.cfg.d_model
    prompt, dropped = tokens(rng, 9, d), [tokens(rng, 1, d) for _ in range(4)]
    step(engine, "rewound", prompt, start=True)
    for token in dropped:
        step(engine, "rewound", token)
    assert engine.rewind("rewound", 9) == 9 and engine.length("rewound") == 9
    step(engine, "never", prompt, start=True)
    reference = Reference(original)
    reference.step(prompt)
    continue_both(engine, "rewound", "never", reference, rng)
    with pytest.raises(errors.InvalidRequest, match="holds 41 positions: a rewind goes to 0 to 41, got 42"):
        engine.rewind("rewound", 42)
    with pytest.raises(errors.UnknownSequence):
        engine.rewind("nobody", 0)


def _edited(blob: bytes, **changes: str) -> bytes:
    """The blob with metadata entries replaced, the tensors as they were (what a hand edit does)."""
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + size])
    header["__metadata__"].update(changes)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob[8 + size :]


def test_a_blob_that_is_not_this_models_is_refused_naming_what_differs_and_changes_nothing(
    artifact_dir, engine, original
):
    rng, d = np.random.default_rng(4), original.cfg.d_model
    step(engine, "a", tokens(rng, 5, d), start=True)
    blob = engine.snapshot("a")
    other_cfg = json.loads(engine.cache.identity["config"]) | {"norm_eps": 1e-6}
    kv, hd = original.cfg.n_kv_heads, original.cfg.head_dim
    cases = {
        "truncated": (blob[: len(blob) // 2], "not a session snapshot (a safetensors file)"),
        "not a snapshot": (b"hello, world", "not a session snapshot (a safetensors file)"),
        "another model": (_edited(blob, config=json.dumps(other_cfg, sort_keys=True)), "another model: norm_eps 1e-06"),
        "another graph": (_edited(blob, graph_sha256="0" * 64), "graph (sha256) '0000"),
        "another dtype": (_edited(blob, dtype="float16"), "cache dtype 'float16', this model serves 'float32'"),
        "a longer length": (
            _edited(blob, length="6"),
            f"expected float32 [{kv}, 6, {hd}] (positions 0 to 6), got float32 [{kv}, 5, {hd}]",
        ),
        "no length": (_edited(blob, length="five"), "'length': expected a whole number of positions, got 'five'"),
        "another format": (_edited(blob, format="0"), "snapshot format '0'"),
    }
    before = engine.stats()
    for name, (bad, message) in cases.items():
        with pytest.raises(snapshots.SnapshotError, match=None) as refused:
            engine.restore("b", bad)
        assert message in str(refused.value), (name, str(refused.value))
        assert refused.value.code == errors.INVALID_ARG
    assert engine.stats() == before and engine.length("b") == -1  # no row taken, nothing started
    assert engine.restore("b", blob) == 5  # the unedited blob restores


def test_a_snapshot_of_a_sequence_the_engine_does_not_hold_names_why(engine, original):
    with pytest.raises(errors.UnknownSequence, match="'ghost' is unknown"):
        engine.snapshot("ghost")
    with pytest.raises(errors.UnknownSequence):
        engine.fork("ghost", "child")
    assert engine.stats().sequences == 0


@pytest.mark.gpu
@pytest.mark.skipif(cuda_missing() is not None, reason=cuda_missing() or "")
def test_on_a_gpu_the_operations_copy_rows_on_the_device_and_restore_exactly(artifact_dir, original, tmp_path):
    """The fp16 pool on CUDA (with CUDA graphs) as sessions builds it: the row copies are bound to
    device addresses; a restored and a forked session step bit for bit as the original does."""
    from serving.triton import engines
    from serving.triton.config import P_ENGINE, P_IDLE_TIMEOUT, P_KV_CACHE_BYTES, P_ONNX_FILE, P_ONNX_FILE_CUDA
    from serving.triton.repository import VERSION, write_repository

    parameters = {
        P_ENGINE: "static",
        P_ONNX_FILE: model_filename("fp32-static"),
        P_ONNX_FILE_CUDA: model_filename("fp16-static"),
        P_KV_CACHE_BYTES: str(original.cfg.kv_cache_bytes(4, original.cfg.max_seq_len)),
        P_IDLE_TIMEOUT: "60",
    }
    repository = write_repository(artifact_dir("gqa"), tmp_path, models=("sessions",))
    engine = engines.session_engine(repository / "sessions" / VERSION, original.cfg, parameters, 8, "test")
    assert engine.cache.device == "cuda" and engine.cache.identity["dtype"] == "float16"
    rng, d = np.random.default_rng(5), original.cfg.d_model
    step(engine, "a", tokens(rng, 9, d), start=True)
    engine.restore("b", engine.snapshot("a"))
    engine.fork("a", "c")
    for _ in range(8):
        token = tokens(rng, 1, d)
        first = step(engine, "a", token)
        np.testing.assert_array_equal(step(engine, "b", token), first)
        np.testing.assert_array_equal(step(engine, "c", token), first)


def test_a_prefix_takes_a_row_until_deleted_and_sessions_start_from_copies(engine, original):
    rng, d = np.random.default_rng(6), original.cfg.d_model
    prefix = tokens(rng, 10, d)
    assert engine.put_prefix("key", "doc", prefix[0]) == 10
    assert engine.prefixes("key") == {"doc": 10} and engine.prefixes("other") == {}
    with pytest.raises(errors.InvalidRequest, match="exists and is immutable"):
        engine.put_prefix("key", "doc", prefix[0])
    with pytest.raises(errors.UnknownPrefix, match="'doc' is unknown here"):
        engine.start_from_prefix("x", "other", "doc")  # scoped to its owner
    reference = Reference(original)
    reference.step(prefix)
    assert engine.start_from_prefix("s", "key", "doc") == 10
    engine.delete_prefix("key", "doc")  # the session holds its own copy
    token = tokens(rng, 1, d)
    np.testing.assert_allclose(step(engine, "s", token), reference.step(token), atol=1e-5, rtol=1e-5)
    # 4 rows: the prefix's row is back; three prefixes and the session fill the pool
    for name in ("a", "b", "c"):
        engine.put_prefix("key", name, prefix[0, :2])
    with pytest.raises(errors.CacheFull):
        engine.put_prefix("key", "d", prefix[0, :2])
    with pytest.raises(errors.InvalidRequest, match="expected 1 to 128 tokens"):
        engine.put_prefix("key", "e", prefix[0, :0])


def test_increments_since_each_checkpoint_restore_together_as_the_whole_cache(artifact_dir, engine, original):
    """A durable session's checkpoints: snapshots of the positions added since the one before, each
    holding only those, restored together into a cache equal to the whole one bit for bit."""
    rng, d = np.random.default_rng(7), original.cfg.d_model
    step(engine, "a", tokens(rng, 9, d), start=True)
    increments, since = [], 0
    for size in (1, 5, 1):
        step(engine, "a", tokens(rng, size, d))
        increments.append(engine.snapshot("a", since=since))
        since = engine.length("a")
    lengths = [snapshots.decode_chunks(increments[: i + 1], engine.cache.identity)[1] for i in range(3)]
    assert lengths == [10, 15, 16]
    whole = len(engine.snapshot("a"))
    assert sum(len(blob) for blob in increments) < whole + 3 * 2048  # each position once (plus headers)

    elsewhere = new_engine(artifact_dir, original.cfg)
    assert elsewhere.restore("b", increments) == 16
    np.testing.assert_array_equal(_cache(elsewhere, "b"), _cache(engine, "a"))
    token = tokens(rng, 1, d)
    np.testing.assert_array_equal(step(elsewhere, "b", token), step(engine, "a", token))


def test_increments_with_a_gap_or_out_of_order_are_refused_naming_the_positions(artifact_dir, engine, original):
    rng, d = np.random.default_rng(8), original.cfg.d_model
    step(engine, "a", tokens(rng, 4, d), start=True)
    first = engine.snapshot("a")
    step(engine, "a", tokens(rng, 3, d))
    middle = engine.snapshot("a", since=4)
    step(engine, "a", tokens(rng, 2, d))
    last = engine.snapshot("a", since=7)
    elsewhere = new_engine(artifact_dir, original.cfg)
    with pytest.raises(
        snapshots.SnapshotError, match=r"blob 1 starts at position 7: expected position 4, where blob 0"
    ):
        elsewhere.restore("b", [first, last])
    with pytest.raises(snapshots.SnapshotError, match=r"blob 0 starts at position 4: expected position 0"):
        elsewhere.restore("b", [middle, first])
    with pytest.raises(errors.InvalidRequest, match=r"holds 9 positions: a snapshot starts at 0 to 9, got 10"):
        engine.snapshot("a", since=10)
    assert elsewhere.restore("b", [first, middle, last]) == 9
