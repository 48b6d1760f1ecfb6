"""The quantized KV caches of the static form (`fp32-static-int8kv`, `fp32-static-int4kv`): built and
climbing the pool rung, their precision floor the kernel itself on a step, calibration from a user's
file, and the KV pool holding int8 codes (round trips bit for bit, a quarter of fp32's bytes)."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest

from contract import files, names
from export import __main__ as cli
from export import build, forms, kv_quant
from export.artifacts import load_model
from export.onnx_export import save_onnx
from export.runners import quantized_cache_runner, torch_runner
from serving.engine import snapshots
from serving.engine.kv_pool import KVPool
from serving.engine.ort import ort_session
from tests.conftest import TEST_CONFIGS

INT8, INT4 = "fp32-static-int8kv", "fp32-static-int4kv"


@pytest.fixture(scope="module")
def tiny(artifact_dir):
    directory = artifact_dir("tiny")
    return directory, load_model(directory)


def int8_pool(directory, cfg, rows: int = 3, capacity: int = 32, variant: str = INT8) -> KVPool:
    return KVPool(ort_session(directory / files.model_filename(variant)), cfg, rows=rows, capacity=capacity)


def test_the_int8_variant_is_built_on_request_and_climbs_the_pool_rung(tiny):
    directory, model = tiny
    assert INT8 in build.VARIANTS and INT8 not in build.DEFAULT_VARIANTS  # a deployment asks for it by its kv_dtype
    entry = json.loads((directory / files.REPORT_FILENAME).read_text())["variants"][INT8]
    assert entry["passed"] and entry["parity"]["pool"]["passed"], entry["problems"]
    sequences = kv_quant.CALIBRATION_SEQUENCES
    assert entry["kv_cache"] | {"calibration_errors": None} == {
        "cache_dtype": "int8",
        "bits": 8,
        "layout": kv_quant.DEFAULT_LAYOUT,
        "calibration": {"generated": {"seed": kv_quant.CALIBRATION_SEED, "shape": [sequences, 128, model.cfg.d_model]}},
        "calibration_errors": None,
    }
    output = entry["worst"][names.OUTPUT]
    assert 0 < output["max_abs"] <= entry["tolerance"]["floor"] * output["floor_abs"]
    proto = onnx.load(str(directory / entry["file"]))
    assert [i.type.tensor_type.elem_type for i in proto.graph.input[3:]] == [onnx.TensorProto.INT8] * len(
        names.past_names(model.cfg.n_layers)
    )
    scales = {i.name for i in proto.graph.initializer if i.name.startswith("kv_scale.")}
    assert scales == {names.cache_scale_name(i, k) for i in range(model.cfg.n_layers) for k in names.KV_KINDS}


@pytest.mark.parametrize("bits", [8, 4])
def test_the_floor_is_what_the_kernel_computes_on_a_step(tiny, tmp_path, bits):
    """A prefill of 9 tokens: the pool's output is the fake-quantized original's to fp32 rounding, far
    closer than to the unquantized original; its codes are the floor's, bar a value on a half step."""
    directory, model = tiny
    quantization = kv_quant.calibrate(model, kv_quant.generated(model.cfg)).quantization(bits)
    if bits == 8:
        path = directory / files.model_filename(INT8)
    else:
        path = save_onnx(forms.quantized_static_proto(model, quantization), tmp_path / "int4.onnx")
    pool = KVPool(ort_session(path), model.cfg, rows=1, capacity=16)
    hidden = np.random.default_rng(11).standard_normal((1, 9, model.cfg.d_model)).astype(np.float32)
    output = pool.run({0: hidden[0]})[0]
    floor = quantized_cache_runner(model, quantization)({names.HIDDEN_STATES: hidden})
    reference = torch_runner(model)({names.HIDDEN_STATES: hidden})[names.OUTPUT][0]
    off_floor = np.abs(output - floor[names.OUTPUT][0]).max()
    assert off_floor < 1e-5 and off_floor < 1e-2 * np.abs(output - reference).max()
    for name, codes in pool.read(0).items():
        kernel = quantization.dequantize(name, codes)
        stored = floor[names.present_name(*name.split(".")[1:])]
        steps = np.abs(kernel - stored) / quantization.scales[name]  # in codes
        assert steps.max() <= 1.001 and (steps > 0.5).mean() < 1e-3, name


def test_calibration_from_a_file_and_a_bad_file_is_named(tmp_path, capsys):
    cfg = TEST_CONFIGS["tiny"]
    hidden = np.random.default_rng(3).standard_normal((2, 24, cfg.d_model)).astype(np.float32)
    np.save(tmp_path / "hidden.npy", hidden)
    data = kv_quant.from_file(tmp_path / "hidden.npy", cfg)
    assert data.source == {"file": "hidden.npy", "sha256": files.sha256(tmp_path / "hidden.npy")}
    np.testing.assert_array_equal(data.hidden, hidden)
    np.save(tmp_path / "wide.npy", np.zeros((2, 24, cfg.d_model + 1), np.float32))
    np.save(tmp_path / "ints.npy", np.zeros((2, 24, cfg.d_model), np.int64))
    wanted = f"expected a .npy array of float (N, T, {cfg.d_model}) with 1 <= T <= {cfg.max_seq_len}"
    for name, got in (("wide.npy", f"got float32 [2, 24, {cfg.d_model + 1}]"), ("ints.npy", "got int64")):
        with pytest.raises(kv_quant.CalibrationError, match=re.escape(f"{tmp_path / name}: {wanted}, {got}")):
            kv_quant.from_file(tmp_path / name, cfg)
    argv = ["build", "--preset", "tiny", "--out", str(tmp_path / "out"), "--calibration", str(tmp_path / "wide.npy")]
    assert cli.main(argv) == 2
    assert f"wide.npy: {wanted}, got float32" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_the_pool_holds_int8_codes_and_moves_them_bit_for_bit(tiny):
    directory, model = tiny
    cfg, d = model.cfg, model.cfg.d_model
    pool = int8_pool(directory, cfg)
    fp32 = int8_pool(directory, cfg, variant="fp32-static")
    assert (pool.dtype, pool.cache_dtype, pool.row_shape) == (np.float32, np.int8, fp32.row_shape)
    assert pool.nbytes * 4 == fp32.nbytes and pool.buffers[0].data_type() == "tensor(int8)"
    session = ort_session(directory / files.model_filename(INT8))
    assert KVPool.row_bytes_for(session, cfg, 32) == cfg.kv_cache_bytes(1, 32, itemsize=1)
    rng = np.random.default_rng(4)
    pool.run({0: rng.standard_normal((6, d)).astype(np.float32)})
    pool.run({0: rng.standard_normal((1, d)).astype(np.float32)})
    held = pool.read(0)
    assert all(a.dtype == np.int8 and a.shape == (1, cfg.n_kv_heads, 7, cfg.head_dim) for a in held.values())
    pool.copy_row(0, 1)
    blob = snapshots.encode({n: a[0] for n, a in held.items()}, pool.identity, 7)
    cache, length = snapshots.decode(blob, pool.identity)
    pool.write(2, cache, length)
    for row in (1, 2):
        assert all(np.array_equal(pool.read(row)[n], a) for n, a in held.items())
    token = rng.standard_normal((1, d)).astype(np.float32)
    outputs = pool.run({row: token for row in range(3)})
    assert all(np.array_equal(outputs[row], outputs[0]) for row in (1, 2))  # the same codes, the same step
    with pytest.raises(snapshots.SnapshotError, match="cache dtype 'int8', this model serves 'float32'"):
        snapshots.decode(blob, fp32.identity)


def test_the_rotary_windowed_model_climbs_with_an_int8_cache(artifact_dir):
    cfg, directory = TEST_CONFIGS["rotary"], artifact_dir("rotary")
    entry = json.loads((directory / files.REPORT_FILENAME).read_text())["variants"][INT8]
    assert entry["passed"], entry["problems"]
    proto = onnx.load(str(directory / entry["file"]))
    for layer, node in enumerate(n for n in proto.graph.node if n.op_type == "GroupQueryAttention"):
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["do_rotary"] == 1 and attributes["kv_cache_bit_width"] == 8
        assert attributes.get("local_window_size", -1) == (cfg.window(layer) or -1)
        assert list(node.input[7:9]) != ["", ""] and list(node.input[12:14]) == [
            names.cache_scale_name(layer, k) for k in names.KV_KINDS
        ]
