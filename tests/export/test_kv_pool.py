"""Driving a static-cache graph: the pool's windows, its bounds, a failed run, the CUDA-graph path
(its fixed buffers and window [0, rows) run here on the CPU, where ONNX Runtime ignores the graph id),
and rows moved between pools: as host arrays on the CPU, and by the device's row-copy kernel (run
here on host buffers), one kernel for the pools of a row shape."""

from __future__ import annotations

import numpy as np
import pytest

from contract.files import model_filename
from export.artifacts import load_model
from export.parity import POOL_ROWS, TOLERANCES, compare_pool_rung, pool_schedule
from export.runners import torch_runner
from serving.engine import kv_pool
from serving.engine.kv_pool import KVPool
from serving.engine.ort import ort_session


@pytest.fixture(scope="module")
def tiny(artifact_dir):
    directory = artifact_dir("tiny")
    return directory, load_model(directory)


def pool(tiny, rows: int = 4, capacity: int = 32, variant: str = "fp32-static", **options) -> KVPool:
    directory, model = tiny
    return KVPool(ort_session(directory / model_filename(variant)), model.cfg, rows=rows, capacity=capacity, **options)


def test_the_graph_path_climbs_the_pool_rung_like_the_plain_one(tiny):
    _, model = tiny
    results = []
    for graphs in (False, True):
        made = pool(tiny, rows=POOL_ROWS, capacity=model.cfg.max_seq_len)
        made.cuda_graphs = graphs  # the code path of a CUDA host; the CPU provider ignores the graph ids
        rung = compare_pool_rung(
            model.cfg, torch_runner(model), made, pool_schedule(model.cfg.max_seq_len, 64), TOLERANCES["fp32-static"]
        )
        assert rung.passed, rung.to_dict()
        results.append(made)
    plain, graphs = results
    assert all(low == 0 for low, _ in graphs._windows)  # with graphs every decode window starts at row 0
    for row in range(POOL_ROWS):
        for name, array in plain.read(row).items():
            np.testing.assert_array_equal(array, graphs.read(row)[name])


def test_a_step_past_the_capacity_is_refused_before_anything_runs(tiny):
    made = pool(tiny, capacity=8)
    d = made.cfg.d_model
    made.run({0: np.zeros((8, d), np.float32)})
    with pytest.raises(ValueError, match="row 0: 8 \\+ 1 positions exceed the capacity 8"):
        made.run({0: np.zeros((1, d), np.float32), 1: np.zeros((1, d), np.float32)})
    assert list(made.lengths) == [8, 0, 0, 0]


def test_a_failed_run_leaves_its_rows_as_they_were_and_the_others_advance(tiny):
    made = pool(tiny)
    d = made.cfg.d_model
    made.run({1: np.ones((2, d), np.float32)})
    results = made.run({0: np.ones((1, d), np.float32), 1: np.ones((3, d + 1), np.float32)})  # row 1: wrong width
    assert isinstance(results[0], np.ndarray) and isinstance(results[1], Exception)
    assert list(made.lengths[:2]) == [1, 2]


def test_a_reset_row_starts_empty_and_the_others_keep_their_cache(tiny):
    made = pool(tiny)
    d = made.cfg.d_model
    made.run({0: np.ones((3, d), np.float32), 2: np.ones((5, d), np.float32)})
    kept = made.read(2)
    made.reset(0)
    made.run({0: np.ones((1, d), np.float32)})
    assert made.lengths[0] == 1 and made.read(0)["past_key_values.0.key"].shape[2] == 1
    for name, array in kept.items():
        np.testing.assert_array_equal(made.read(2)[name], array)


def test_a_session_with_cuda_graphs_serves_one_pool_only(tiny, monkeypatch):
    directory, model = tiny
    monkeypatch.setattr(kv_pool, "uses_cuda_graphs", lambda session: True)
    session = ort_session(directory / model_filename("fp32-static"))
    KVPool(session, model.cfg, rows=2, capacity=16)
    with pytest.raises(ValueError, match="belong to another KVPool"):
        KVPool(session, model.cfg, rows=2, capacity=16)


def test_the_pool_holds_the_graphs_float_type(tiny):
    made = pool(tiny, variant="fp16-static")
    assert made.dtype is np.float16 and made.buffers[0].data_type() == "tensor(float16)"
    assert made.nbytes == 4 * made.cfg.kv_cache_bytes(1, 32 + 1, itemsize=2)


def test_a_long_prompt_runs_in_chunks_with_the_same_result(tiny, monkeypatch):
    _, model = tiny
    rng = np.random.default_rng(5)
    prompt = rng.standard_normal((19, model.cfg.d_model)).astype(np.float32)
    whole = pool(tiny)
    expected = whole.run({1: prompt})[1]
    monkeypatch.setattr(kv_pool, "PREFILL_CHUNK", 4)  # 19 tokens: chunks of 4, 4, 4, 4, 3
    chunked = pool(tiny)
    np.testing.assert_allclose(chunked.run({1: prompt})[1], expected, atol=1e-5, rtol=1e-5)
    assert chunked.lengths[1] == 19
    for name, array in whole.read(1).items():
        np.testing.assert_allclose(chunked.read(1)[name], array, atol=1e-6)
    reference = torch_runner(model)({"hidden_states": prompt[None]})["output"][0]
    np.testing.assert_allclose(expected, reference, atol=1e-5, rtol=1e-5)


def test_decode_windows_skip_long_idle_rows_and_merge_short_gaps(tiny, monkeypatch):
    made = pool(tiny, rows=6, capacity=512)
    per_position = made.cfg.kv_cache_bytes(1, 1)
    monkeypatch.setattr(kv_pool, "MERGE_BYTES", 128 * per_position)  # 128 positions' worth of this model
    made.lengths[:] = [10, 0, 400, 3, 10, 10]
    assert made.decode_windows([0, 4, 5]) == [(0, 1), (4, 2)]  # rows 1-3 hold 403 positions: two runs
    assert made.decode_windows([0, 2]) == [(0, 3)]  # only row 1 (empty) between them: one run
    assert made.decode_windows([3, 5]) == [(3, 3)]  # row 4's 10 positions cost less than a run
    made.cuda_graphs = True
    assert made.decode_windows([4, 5]) == [(0, 6)]  # with graphs: from row 0, one graph per size


def test_a_row_moves_between_pools_of_two_sizes_and_steps_on_as_it_would_have(tiny):
    _, model = tiny
    d, rng = model.cfg.d_model, np.random.default_rng(6)
    small, large = pool(tiny, rows=2, capacity=16), pool(tiny, rows=2, capacity=64)
    small.run({1: rng.standard_normal((9, d)).astype(np.float32)})
    large.copy_row(1, 0, small)  # host buffers: an array copy of the 9 used positions
    assert large.lengths[0] == 9
    for name, array in small.read(1).items():
        np.testing.assert_array_equal(large.read(0)[name], array)
    token = rng.standard_normal((1, d)).astype(np.float32)
    np.testing.assert_array_equal(large.run({0: token})[0], small.run({1: token})[1])


def test_the_row_copy_kernel_serves_every_pool_of_its_row_shape(tiny):
    _, model = tiny
    d, rng = model.cfg.d_model, np.random.default_rng(7)
    first = pool(tiny, rows=2)
    kernel = first.row_copy
    second = pool(tiny, rows=3, row_copy=kernel)
    assert second.row_copy is kernel
    with pytest.raises(AssertionError, match="a row copy of another row shape"):
        pool(tiny, rows=1, capacity=16, row_copy=kernel)
    first.run({1: rng.standard_normal((5, d)).astype(np.float32)})
    kernel.within(first.rows_at(1), second.rows_at(2))  # the device path's copy, bound to host addresses
    second.lengths[2] = 5
    held = first.read(1)
    for name, array in second.read(2).items():
        np.testing.assert_array_equal(array, held[name])
    cut = kernel.to_host(first.rows_at(1), 5, start=2)
    for array, name in zip(cut, first.past_names, strict=True):
        np.testing.assert_array_equal(array, held[name][0, :, 2:])
    wholes = [np.full(first.row_shape, i + 1, first.cache_dtype) for i in range(len(first.past_names))]
    kernel.from_host(wholes, second.rows_at(0))
    second.lengths[0] = first.capacity
    for i, array in enumerate(second.read(0).values()):
        assert array.shape == (1, *first.row_shape[:1], first.capacity, first.row_shape[2]) and (array == i + 1).all()
