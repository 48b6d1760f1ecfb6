"""The concat engine's session operations, without Triton, on a model the static form cannot take
(head_dim 12): snapshot and restore (whole and by increments), fork, rewind and named prefixes over
the fp32-fused graph on the CPU. What a sequence computes after each is held to the PyTorch original
(within 1e-5) and to the same graph's uninterrupted run (bit for bit); a blob of another model is
refused naming what differs, and changes nothing. Padded tokens never enter a cache: with rotary
embeddings too, positions count real tokens, also in a batch of sessions of different lengths."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from contract import names
from contract.config import ModelConfig
from contract.files import model_filename, sha256
from export.artifacts import load_model
from export.build import build
from export.forms import static_problem
from export.progress import Progress
from export.runners import torch_runner
from serving.engine import errors, snapshots
from serving.engine.concat import ConcatSessionEngine, KVCacheStore
from serving.engine.concat.copies import copies_for
from serving.engine.ort import CPU_PROVIDER
from serving.engine.runner import InspectionRunner, Runner
from serving.engine.steps import StepRequest

STEPS = 8
# head_dim 12: GroupQueryAttention takes multiples of 8 only, so this model runs the concat engine
HEAD_DIM_12 = ModelConfig(d_model=48, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=256)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("artifact-head-dim-12")
    build(HEAD_DIM_12, out, variants=("fp32-fused", names.INSPECTION_VARIANT), progress=Progress(enabled=False))
    return out


@pytest.fixture(scope="module")
def original(artifact):
    return load_model(artifact)


def new_engine(artifact, cfg: ModelConfig, sequences: int = 8, on_device: bool = False) -> ConcatSessionEngine:
    """The engine as the factory makes it: the graph's name and sha256 in its snapshots' identity;
    `on_device`: its copies as the device graphs a GPU runs."""
    graph = artifact / model_filename("fp32-fused")
    runner = Runner(graph, cfg, threads=1, providers=[CPU_PROVIDER])
    store = KVCacheStore(cfg.kv_cache_bytes(1, 1), cfg.max_seq_len, cfg.kv_cache_bytes(sequences, cfg.max_seq_len), 60)
    identity = snapshots.fingerprint(cfg, "float32", graph.name, sha256(graph))
    inspection = InspectionRunner(artifact / model_filename(names.INSPECTION_VARIANT), cfg, threads=1)
    copies = copies_for(runner, on_device=on_device)
    return ConcatSessionEngine(runner, store, identity=identity, inspection=inspection, copies=copies)


@pytest.fixture(params=["host", "device"], ids=lambda copies: f"{copies}-copies")
def engine(request, artifact, original):
    return new_engine(artifact, original.cfg, on_device=request.param == "device")


class Original:
    """The PyTorch original as one session keeping its own cache, fed the session's real tokens."""

    def __init__(self, model, past: dict | None = None) -> None:
        self.model, self.run, self.past = model, torch_runner(model), dict(past or {})
        layers = model.cfg.n_layers
        self.names = dict(zip(names.present_names(layers), names.past_names(layers), strict=True))

    def step(self, hidden: np.ndarray) -> np.ndarray:
        result = self.run({names.HIDDEN_STATES: hidden, **self.past})
        self.past = {self.names[name]: array for name, array in result.items() if name != names.OUTPUT}
        return result[names.OUTPUT]

    def fork(self) -> Original:
        return Original(self.model, self.past)


def tokens(rng, count: int, d_model: int) -> np.ndarray:
    return rng.standard_normal((1, count, d_model)).astype(np.float32)


def step(engine, sequence_id, hidden: np.ndarray, start: bool = False, mask=None) -> np.ndarray:
    (result,) = engine.execute([StepRequest(sequence_id, start, False, hidden, mask)])
    assert isinstance(result, np.ndarray), result
    return result


def close(ours: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=1e-5)


def assert_same_cache(blob: bytes, expected: bytes, identity: dict) -> None:
    """Two snapshots hold the same positions, bit for bit (a header's key order may differ)."""
    (ours, length), (theirs, expected_length) = snapshots.decode(blob, identity), snapshots.decode(expected, identity)
    assert length == expected_length and sorted(ours) == sorted(theirs)
    for name, array in ours.items():
        np.testing.assert_array_equal(array, theirs[name])


def continue_both(first: tuple, second: tuple, reference: Original, rng) -> None:
    """STEPS decode steps of the same tokens through (engine, id) `first` and `second`: equal bit
    for bit, and to the PyTorch original (which has had the same past) within 1e-5."""
    d = reference.model.cfg.d_model
    for _ in range(STEPS):
        token = tokens(rng, 1, d)
        ours, theirs = step(*first, token), step(*second, token)
        np.testing.assert_array_equal(ours, theirs)
        close(ours, reference.step(token))


def test_the_model_is_one_the_static_form_cannot_take(original):
    assert original.cfg.head_dim == 12
    assert "head_dim 12 is not a multiple of 8" in static_problem(original.cfg)


def test_the_engine_offers_every_session_operation(engine):
    assert engine.OPERATIONS == names.OPERATIONS
    assert {name: op.method for name, op in engine.operations().items()} == {
        names.SNAPSHOT_OPERATION: "snapshot",
        names.RESTORE: "restore",
        names.FORK: "fork",
        names.REWIND: "rewind",
        names.PUT_PREFIX: "put_prefix",
        names.FROM_PREFIX: "start_from_prefix",
        names.DELETE_PREFIX: "delete_prefix",
        names.ATTENTION_MAPS_OPERATION: "attention_maps",
    }
    assert all(callable(getattr(engine, op.method)) for op in engine.operations().values())
    assert engine.description.startswith("concat engine, model.fp32-fused.onnx on CPUExecutionProvider")


def test_a_restored_session_continues_exactly_as_the_original(artifact, engine, original):
    rng, d = np.random.default_rng(0), original.cfg.d_model
    reference = Original(original)
    prompt = tokens(rng, 11, d)
    close(step(engine, "a", prompt, start=True), reference.step(prompt))
    for _ in range(3):
        token = tokens(rng, 1, d)
        close(step(engine, "a", token), reference.step(token))
    blob = engine.snapshot("a")
    assert engine.length("a") == 14  # a snapshot leaves the sequence as it was
    elsewhere = new_engine(artifact, original.cfg)  # another process's engine, the same graph
    assert elsewhere.restore("b", blob) == 14 and elsewhere.length("b") == 14
    assert_same_cache(elsewhere.snapshot("b"), blob, engine.identity)
    continue_both((elsewhere, "b"), (engine, "a"), reference, rng)


def test_a_session_restored_from_its_increments_continues_as_the_original(artifact, engine, original):
    """What a durable session's checkpoints write: the whole cache first, then each increment since."""
    rng, d = np.random.default_rng(1), original.cfg.d_model
    reference = Original(original)
    prompt = tokens(rng, 6, d)
    close(step(engine, "a", prompt, start=True), reference.step(prompt))
    increments = [engine.snapshot("a", since=0)]
    for since in (6, 8):
        for _ in range(2):
            token = tokens(rng, 1, d)
            close(step(engine, "a", token), reference.step(token))
        increments.append(engine.snapshot("a", since=since))
    elsewhere = new_engine(artifact, original.cfg)
    assert elsewhere.restore("b", increments) == 10
    assert_same_cache(elsewhere.snapshot("b"), engine.snapshot("a"), engine.identity)
    continue_both((elsewhere, "b"), (engine, "a"), reference, rng)
    with pytest.raises(snapshots.SnapshotError, match="blob 1 starts at position 8: expected position 6"):
        elsewhere.restore("c", [increments[0], increments[2]])
    with pytest.raises(errors.InvalidRequest, match="holds 18 positions: a snapshot starts at 0 to 18, got 19"):
        engine.snapshot("a", since=19)


def test_a_fork_gives_two_branches_that_each_continue_as_the_original(engine, original):
    rng, d = np.random.default_rng(2), original.cfg.d_model
    trunk_reference = Original(original)
    prompt = tokens(rng, 7, d)
    close(step(engine, "trunk", prompt, start=True), trunk_reference.step(prompt))
    assert engine.fork("trunk", "branch") == 7
    branch_reference = trunk_reference.fork()
    for _ in range(STEPS):  # the two go different ways: each against the original with its own past
        left, right = tokens(rng, 1, d), tokens(rng, 1, d)
        # one execute(), as Triton's batcher would send them: one batched graph run
        ours = engine.execute([StepRequest("trunk", False, False, left), StepRequest("branch", False, False, right)])
        close(ours[0], trunk_reference.step(left))
        close(ours[1], branch_reference.step(right))
    assert engine.length("trunk") == engine.length("branch") == 7 + STEPS
    assert engine.largest_batch == 2
    with pytest.raises(errors.InvalidRequest, match="cannot be forked into itself"):
        engine.fork("trunk", "trunk")
    with pytest.raises(errors.UnknownSequence, match="'ghost' is unknown"):
        engine.fork("ghost", "child")


def test_a_rewind_then_new_tokens_equals_a_session_that_never_had_the_dropped_ones(engine, original):
    rng, d = np.random.default_rng(3), original.cfg.d_model
    prompt, dropped = tokens(rng, 9, d), [tokens(rng, 1, d) for _ in range(4)]
    step(engine, "rewound", prompt, start=True)
    engine.fork("rewound", "sibling")  # shares the cache the rewind cuts: the sibling keeps all of it
    for token in dropped:
        step(engine, "rewound", token)
    assert engine.rewind("rewound", 9) == 9 and engine.length("rewound") == 9
    step(engine, "never", prompt, start=True)
    reference = Original(original)
    reference.step(prompt)
    sibling = reference.fork()
    continue_both((engine, "rewound"), (engine, "never"), reference, rng)
    close(step(engine, "sibling", dropped[0]), sibling.step(dropped[0]))
    with pytest.raises(errors.InvalidRequest, match=f"holds {9 + STEPS} positions: a rewind goes to 0 to 17, got 18"):
        engine.rewind("rewound", 9 + STEPS + 1)
    with pytest.raises(errors.UnknownSequence):
        engine.rewind("nobody", 0)


def test_a_session_from_a_named_prefix_continues_as_the_original(engine, original):
    rng, d = np.random.default_rng(4), original.cfg.d_model
    prefix = tokens(rng, 6, d)
    assert engine.put_prefix("alice", "system", prefix[0]) == 6
    assert engine.prefixes("alice") == {"system": 6} and engine.prefixes("bob") == {}
    with pytest.raises(errors.InvalidRequest, match="prefix 'system' exists and is immutable"):
        engine.put_prefix("alice", "system", prefix[0])
    with pytest.raises(errors.UnknownPrefix, match="prefix 'system' is unknown here"):
        engine.start_from_prefix("s", "bob", "system")  # another owner's prefix is not found
    assert engine.start_from_prefix("s", "alice", "system") == 6
    step(engine, "cold", prefix, start=True)  # the same tokens prefilled by the session itself
    reference = Original(original)
    reference.step(prefix)
    engine.delete_prefix("alice", "system")  # the session keeps its cache
    assert engine.prefixes("alice") == {}
    continue_both((engine, "s"), (engine, "cold"), reference, rng)
    with pytest.raises(errors.UnknownPrefix):
        engine.start_from_prefix("t", "alice", "system")


def test_a_prefix_and_each_session_take_one_reservation_of_the_budget(artifact, original):
    engine = new_engine(artifact, original.cfg, sequences=2)
    d = original.cfg.d_model
    engine.put_prefix("", "p", np.ones((3, d), np.float32))
    engine.start_from_prefix("a", "", "p")
    with pytest.raises(errors.CacheFull, match="1 live sequences and 1 prefixes reserve"):
        engine.fork("a", "b")
    with pytest.raises(errors.CacheFull):
        engine.put_prefix("", "q", np.ones((3, d), np.float32))
    assert engine.stats().reserved_bytes == 2 * original.cfg.kv_cache_bytes(1, original.cfg.max_seq_len)


def test_a_blob_of_another_model_is_refused_naming_what_differs_and_changes_nothing(engine, original):
    rng, d = np.random.default_rng(5), original.cfg.d_model
    step(engine, "a", tokens(rng, 5, d), start=True)
    blob = engine.snapshot("a")
    cache, length = snapshots.decode(blob, engine.identity)
    other = dataclasses.replace(original.cfg, norm_eps=1e-6)
    graph = engine.identity["graph"], engine.identity["graph_sha256"]
    theirs = {
        "another model": snapshots.fingerprint(other, "float32", *graph),
        "another graph": engine.identity | {"graph_sha256": "0" * 64},
    }
    expected = {
        "another model": "the snapshot is of another model: norm_eps 1e-06 (here 1e-05)",
        "another graph": "the snapshot was made with graph (sha256) '0000",
    }
    before = engine.stats()
    for name, identity in theirs.items():
        with pytest.raises(snapshots.SnapshotError) as refused:
            engine.restore("b", snapshots.encode(cache, identity, length))
        assert expected[name] in str(refused.value), (name, str(refused.value))
        assert refused.value.code == errors.INVALID_ARG
    with pytest.raises(snapshots.SnapshotError, match="another owner"):
        engine.restore("b", engine.snapshot("a", owner="alice"), owner="bob")
    flipped = bytearray(blob)
    flipped[-3] ^= 0x01  # one bit of the last tensor's data: still finite, still the right shape
    with pytest.raises(snapshots.SnapshotError, match="changed or corrupted after it was made"):
        engine.restore("b", bytes(flipped))
    assert engine.stats() == before and engine.length("b") == -1  # nothing started
    assert engine.restore("b", blob) == 5


def test_attention_maps_are_the_next_steps_and_change_nothing(engine, original):
    rng, d = np.random.default_rng(6), original.cfg.d_model
    step(engine, "a", tokens(rng, 5, d), start=True)
    before = engine.snapshot("a")
    following = tokens(rng, 2, d)
    maps = engine.attention_maps("a", following[0])
    assert_same_cache(engine.snapshot("a"), before, engine.identity)  # the session holds what it held
    close(maps[names.OUTPUT], step(engine, "a", following))
    for name in names.attention_map_names(original.cfg.n_layers):
        weights = maps[name]
        assert weights.shape == (1, original.cfg.n_heads, 2, 7)
        close(weights.sum(axis=-1), np.ones((1, original.cfg.n_heads, 2)))
        assert (weights[:, :, 0, 6] == 0).all()  # causal: the first new token does not see the second


def test_padded_tokens_never_enter_the_cache_and_answer_zeros(engine, original):
    rng, d = np.random.default_rng(7), original.cfg.d_model
    prompt = tokens(rng, 5, d)
    mask = np.array([[0, 0, 1, 1, 1]], np.int64)  # a left-padded prompt
    reference = Original(original)
    out = step(engine, "a", prompt, start=True, mask=mask)
    np.testing.assert_array_equal(out[0, :2], 0)
    close(out[:, 2:], reference.step(prompt[:, 2:]))
    assert engine.length("a") == 3
    token = tokens(rng, 2, d)
    out = step(engine, "a", token, mask=np.array([[1, 0]], np.int64))  # a right-padded step
    close(out[:, :1], reference.step(token[:, :1]))
    np.testing.assert_array_equal(out[0, 1], 0)
    assert engine.length("a") == 4


def test_with_rotary_embeddings_positions_count_real_tokens_also_in_a_batch(artifact_dir):
    """Sessions of different lengths, one with a padded prompt, stepping in one execute() (a left-padded
    batch): each at its own real positions, as the original alone; after a fork and a rewind too."""
    directory = artifact_dir("rotary")
    model = load_model(directory)
    cfg = model.cfg
    runner = Runner(directory / model_filename("fp32-fused"), cfg, threads=1, providers=[CPU_PROVIDER])
    engine = ConcatSessionEngine(runner, KVCacheStore(cfg.kv_cache_bytes(1, 1), cfg.max_seq_len, 1 << 30, 60))
    rng, d = np.random.default_rng(8), cfg.d_model
    references = {"long": Original(model), "short": Original(model)}
    long_prompt, short_prompt = tokens(rng, 30, d), tokens(rng, 6, d)
    padded = np.array([[0, 0, 0, 1, 1, 1]], np.int64)
    first = engine.execute(
        [StepRequest("long", True, False, long_prompt), StepRequest("short", True, False, short_prompt, padded)]
    )
    close(first[0], references["long"].step(long_prompt))
    close(first[1][:, 3:], references["short"].step(short_prompt[:, 3:]))
    engine.fork("long", "fork")
    at_fork = references["long"].fork()
    references["fork"] = at_fork.fork()
    for k in range(STEPS):
        if k == 4:
            engine.rewind("fork", 30)  # drops the fork's steps so far: it goes on from the prompt again
            references["fork"] = at_fork.fork()
        hidden = {sid: tokens(rng, 1, d) for sid in references}
        outputs = engine.execute([StepRequest(sid, False, False, h) for sid, h in hidden.items()])
        for (sid, h), output in zip(hidden.items(), outputs, strict=True):
            close(output, references[sid].step(h))
    assert engine.largest_batch == 3
    assert (engine.length("long"), engine.length("short"), engine.length("fork")) == (38, 11, 34)
