"""Several sequences' steps as one padded batch equal each step run alone; the session engine answers
errors per request and never loses another sequence's state. ONNX Runtime on the CPU, no server:
both the CPU's numpy copies and the device copy graphs a GPU runs (OrtValues, IOBinding, pad and
slice graphs) are checked."""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort
import pytest

from contract import names
from contract.config import ModelConfig
from contract.files import model_filename
from contract.inputs import InputError
from serving.engine import errors, tensorrt
from serving.engine.concat import ConcatSessionEngine, KVCacheStore
from serving.engine.concat.batching import Step, layout, run_steps
from serving.engine.concat.copies import DeviceCopies, HostCopies, copies_for
from serving.engine.core import CoreSettings, EngineCore
from serving.engine.ort import CPU
from serving.engine.placement import choose_placement
from serving.engine.runner import Runner
from serving.engine.steps import StepRequest


@pytest.fixture(
    scope="module", params=[("fp32", "host"), ("fp32-fused", "host"), ("fp32-fused", "device")], ids="-".join
)
def runner_and_copies(request, artifact_dir) -> tuple[Runner, HostCopies | DeviceCopies]:
    directory = artifact_dir("gqa")
    variant, copies = request.param
    runner = Runner(directory / model_filename(variant), ModelConfig.load(directory), threads=1)
    return runner, copies_for(runner, on_device=copies == "device")


@pytest.fixture(scope="module")
def runner(runner_and_copies) -> Runner:
    return runner_and_copies[0]


@pytest.fixture(scope="module")
def copies(runner_and_copies) -> HostCopies | DeviceCopies:
    return runner_and_copies[1]


def random_step(runner: Runner, rng, past: int, new: int) -> Step:
    cfg = runner.cfg
    caches = [
        runner.to_device(rng.standard_normal((1, cfg.n_kv_heads, past, cfg.head_dim)).astype(np.float32))
        for _ in runner.past_names
    ]
    hidden = rng.standard_normal((new, cfg.d_model)).astype(np.float32)
    return Step(hidden, caches, past)


def test_the_copies_are_those_of_the_runners_device(runner, copies, request):
    on_device = request.node.callspec.id.endswith("device")
    assert isinstance(copies, DeviceCopies if on_device else HostCopies)
    assert not hasattr(runner, "copies")  # the stateless runner holds nothing of batching


def test_layout_pads_pasts_left_and_new_tokens_right():
    d = 2
    steps = [
        Step(np.ones((1, d), np.float32), [], 3),
        Step(np.full((2, d), 2, np.float32), [], 1),
    ]
    plan = layout(steps)
    assert (plan.max_past, plan.max_new) == (3, 2)
    np.testing.assert_array_equal(plan.mask, [[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert plan.starts == [0, 2] and plan.ends == [4, 5]  # each row's left padding and where its present ends
    np.testing.assert_array_equal(plan.hidden[:, :, 0], [[1, 0], [2, 2]])


def test_a_padded_batch_equals_each_step_alone(runner, copies):
    rng = np.random.default_rng(0)
    # different past lengths (one empty), different numbers of new tokens
    steps = [
        random_step(runner, rng, 0, 3),
        random_step(runner, rng, 5, 1),
        random_step(runner, rng, 9, 4),
        random_step(runner, rng, 2, 2),
    ]
    together = run_steps(runner, copies, steps)
    for step, batched in zip(steps, together, strict=True):
        (alone,) = run_steps(runner, copies, [step])
        assert batched.output.shape == (step.new_length, runner.cfg.d_model)
        np.testing.assert_allclose(batched.output, alone.output, atol=1e-5, rtol=1e-5)
        assert batched.length == alone.length == step.past_length + step.new_length
        assert batched.nbytes == alone.nbytes == runner.cfg.kv_cache_bytes(1, alone.length)
        for mine, theirs in zip(batched.present, alone.present, strict=True):
            assert mine.shape() == theirs.shape() == [1, runner.cfg.n_kv_heads, alone.length, runner.cfg.head_dim]
            np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=1e-5, rtol=1e-5)
            # the cached past comes back bit for bit: batching moved it, nothing recomputed it
            np.testing.assert_array_equal(
                mine.numpy()[:, :, : step.past_length], theirs.numpy()[:, :, : step.past_length]
            )


def test_the_runner_picks_the_cpu_here_and_says_why(tmp_path):
    placement = choose_placement(ModelConfig(), tensorrt.Limits(), trt_cache=tmp_path)
    assert placement.providers[-1] == "CPUExecutionProvider"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        assert placement.providers == ["CPUExecutionProvider"]
        assert any(note.startswith("no TensorRT") for note in placement.notes)
        assert any(note.startswith("no CUDA") for note in placement.notes)


def test_the_stateless_path_fills_an_empty_past_and_an_all_ones_mask(runner):
    hidden = np.random.default_rng(1).standard_normal((2, 3, runner.cfg.d_model)).astype(np.float32)
    implicit = runner.run_arrays({names.HIDDEN_STATES: hidden})
    empty = np.zeros((2, runner.cfg.n_kv_heads, 0, runner.cfg.head_dim), np.float32)
    explicit = runner.run_arrays(
        {names.HIDDEN_STATES: hidden, names.ATTENTION_MASK: np.ones((2, 3), np.int64)}
        | dict.fromkeys(runner.past_names, empty)
    )
    for name, array in implicit.items():
        np.testing.assert_array_equal(array, explicit[name])


# --- the engine: one execute() worth of requests ---------------------------------------------------


@pytest.fixture
def engine(runner, copies) -> ConcatSessionEngine:
    store = KVCacheStore(runner.cfg.kv_cache_bytes(1, 1), runner.cfg.max_seq_len, 1 << 30, idle_timeout=60)
    return ConcatSessionEngine(runner, store, copies=copies)


def tokens(cfg: ModelConfig, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, n, cfg.d_model)).astype(np.float32)


def test_bad_requests_get_their_own_errors_and_the_rest_runs_as_one_batch(engine):
    cfg = engine.cfg
    first = engine.execute(
        [StepRequest("a", True, False, tokens(cfg, 3, 0)), StepRequest("b", True, False, tokens(cfg, 2, 1))]
    )
    assert all(isinstance(r, np.ndarray) for r in first)
    batch = [
        StepRequest("a", False, False, tokens(cfg, 1, 2)),
        StepRequest("b", False, False, tokens(cfg, 2, 3), mask=np.ones((1, 3), np.int64)),  # wrong mask length
        StepRequest("ghost", False, False, tokens(cfg, 1, 4)),  # never started
        StepRequest("c", True, False, tokens(cfg, 4, 5)),
        StepRequest("d", False, False, None),  # no hidden states
    ]
    results = engine.execute(batch)
    assert isinstance(results[0], np.ndarray) and isinstance(results[3], np.ndarray)
    assert isinstance(results[1], InputError) and "attention_mask" in str(results[1])
    assert isinstance(results[2], errors.UnknownSequence)
    assert isinstance(results[4], InputError) and "hidden_states" in str(results[4])
    assert engine.largest_batch == 2  # a and c together
    assert engine.store.get("b").length == 2  # the bad step changed nothing


def test_steps_equal_the_same_steps_alone(engine, runner):
    cfg = engine.cfg
    engine.execute([StepRequest(k, True, False, tokens(cfg, 1 + k, 10 + k)) for k in range(3)])
    together = engine.execute([StepRequest(k, False, False, tokens(cfg, 1, 20 + k)) for k in range(3)])
    for k in range(3):
        solo = ConcatSessionEngine(runner, KVCacheStore(cfg.kv_cache_bytes(1, 1), cfg.max_seq_len, 1 << 30, 60))
        solo.execute([StepRequest("x", True, False, tokens(cfg, 1 + k, 10 + k))])
        (alone,) = solo.execute([StepRequest("x", False, False, tokens(cfg, 1, 20 + k))])
        np.testing.assert_allclose(together[k], alone, atol=1e-5, rtol=1e-5)


def test_end_frees_even_a_failing_step_and_zero_tokens_just_end(engine):
    cfg = engine.cfg
    engine.execute([StepRequest("a", True, False, tokens(cfg, 2, 0)), StepRequest("b", True, False, tokens(cfg, 2, 1))])
    bad_end = StepRequest("a", False, True, tokens(cfg, 2, 2), mask=np.ones((1, 5), np.int64))
    quiet_end = StepRequest("b", False, True, np.zeros((1, 0, cfg.d_model), np.float32))
    results = engine.execute([bad_end, quiet_end])
    assert isinstance(results[0], InputError)
    assert results[1].shape == (1, 0, cfg.d_model)
    assert engine.store.stats().sequences == 0
    # START without tokens opens the sequence (its cache reserved: admission at session creation);
    # a later step without tokens and without END computes nothing (the length asked: the generation
    # model does) and an unknown sequence's is refused
    (opened,) = engine.execute([StepRequest("c", True, False, np.zeros((1, 0, cfg.d_model), np.float32))])
    assert opened.shape == (1, 0, cfg.d_model) and engine.stats().sequences == 1
    (no_tokens,) = engine.execute([StepRequest("c", False, False, np.zeros((1, 0, cfg.d_model), np.float32))])
    assert no_tokens.shape == (1, 0, cfg.d_model) and engine.length("c") == 0
    (unknown,) = engine.execute([StepRequest("nobody", False, False, np.zeros((1, 0, cfg.d_model), np.float32))])
    assert isinstance(unknown, errors.ServingError) and "nobody" in str(unknown)
    (first,) = engine.execute([StepRequest("c", False, True, tokens(cfg, 2, 3))])
    expected = engine.runner.run_arrays({names.HIDDEN_STATES: tokens(cfg, 2, 3)})[names.OUTPUT]
    np.testing.assert_allclose(first, expected, atol=1e-5, rtol=1e-5)
    assert engine.stats().sequences == 0
    # closing a sequence the store no longer holds (evicted, refused) succeeds: it is gone either way
    (closed,) = engine.execute([StepRequest("ghost", False, True, np.zeros((1, 0, cfg.d_model), np.float32))])
    assert closed.shape == (1, 0, cfg.d_model)


def test_two_steps_of_one_sequence_in_one_execute_run_in_order(engine, runner):
    cfg = engine.cfg
    pieces = [tokens(cfg, 2, 30), tokens(cfg, 1, 31), tokens(cfg, 1, 32)]
    both = engine.execute([StepRequest("s", True, False, pieces[0]), StepRequest("s", False, False, pieces[1])])
    (last,) = engine.execute([StepRequest("s", False, True, pieces[2])])
    full = runner.run_arrays({names.HIDDEN_STATES: np.concatenate(pieces, axis=1)})[names.OUTPUT]
    np.testing.assert_allclose(np.concatenate([*both, last], axis=1), full, atol=1e-5, rtol=1e-5)


def test_the_engine_core_evicts_idle_sequences_in_the_background(runner):
    """No request comes: the core's loop wakes a few times a second and evicts what went idle (memory comes
    back without traffic), and publishes what it holds."""
    store = KVCacheStore(runner.cfg.kv_cache_bytes(1, 1), runner.cfg.max_seq_len, 1 << 30, idle_timeout=0.2)
    engine = ConcatSessionEngine(runner, store)
    engine.execute([StepRequest("idle", True, False, tokens(runner.cfg, 2, 0))])
    published = []
    core = EngineCore(engine, CoreSettings(tick_s=0.05), publish=published.append).start()
    try:
        deadline = time.monotonic() + 5
        while store.stats().sequences and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        core.stop()
    stats = store.stats()
    assert stats.sequences == 0 and stats.held_bytes == 0 and stats.evictions == 1
    assert published, "the core published its stats"
    (late,) = engine.execute([StepRequest("idle", False, False, tokens(runner.cfg, 1, 1))])
    assert isinstance(late, errors.SequenceEvicted)


CUDA_MISSING = (
    None
    if "CUDAExecutionProvider" in ort.get_available_providers()
    else f"onnxruntime {ort.__version__} here has no CUDAExecutionProvider (no GPU build / no GPU)"
)


@pytest.mark.gpu
@pytest.mark.skipif(CUDA_MISSING is not None, reason=CUDA_MISSING or "")
def test_on_a_gpu_the_caches_stay_on_the_device_and_match_the_cpu(artifact_dir):
    directory = artifact_dir("gqa")
    cfg = ModelConfig.load(directory)
    gpu = Runner(directory / model_filename("fp32"), cfg)
    if gpu.device == CPU:
        pytest.skip(f"CUDA did not start here: {gpu.description}")
    cpu = Runner(directory / model_filename("fp32"), cfg, providers=["CPUExecutionProvider"])
    rng_gpu, rng_cpu = np.random.default_rng(5), np.random.default_rng(5)
    on_gpu = run_steps(gpu, copies_for(gpu), [random_step(gpu, rng_gpu, 4, 1), random_step(gpu, rng_gpu, 7, 2)])
    on_cpu = run_steps(cpu, copies_for(cpu), [random_step(cpu, rng_cpu, 4, 1), random_step(cpu, rng_cpu, 7, 2)])
    for g, c in zip(on_gpu, on_cpu, strict=True):
        assert all(value.device_name() == "cuda" for value in g.present)
        np.testing.assert_allclose(g.output, c.output, atol=1e-4, rtol=1e-4)
