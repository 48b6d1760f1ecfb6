"""The session engine's settings as the Triton adapter reads them from a model's parameters: the
defaults the docs promise, and a clear error for a parameter that is missing or wrong."""

from __future__ import annotations

import pytest

from contract.files import sha256
from serving.engine.errors import EngineError
from serving.engine.settings import ENGINE_CONCAT, ENGINE_STATIC, SessionSettings
from serving.triton import config as triton_config
from serving.triton import digests, engines

PARAMETERS = {
    triton_config.P_KV_CACHE_BYTES: "1048576",
    triton_config.P_IDLE_TIMEOUT: "60",
    triton_config.P_MIN_ROW_POSITIONS: "256",
}


def test_the_static_engine_is_the_default_everywhere():
    assert SessionSettings().engine == ENGINE_STATIC
    assert triton_config.ServingSettings().engine == ENGINE_STATIC
    assert engines.session_settings(PARAMETERS).engine == ENGINE_STATIC


def test_the_repository_defaults_are_the_engines():
    served, engine = triton_config.ServingSettings(), SessionSettings()
    assert (
        served.kv_cache_bytes,
        served.idle_timeout_seconds,
        served.threads,
        served.max_batch_size,
        served.min_row_positions,
        served.step_tokens,
        served.kept_per_owner,
        served.generations_per_owner,
    ) == (
        engine.kv_cache_bytes,
        engine.idle_timeout_seconds,
        engine.threads,
        engine.max_batch,
        engine.min_row_positions,
        engine.step_tokens,
        engine.kept_per_owner,
        engine.generations_per_owner,
    )


def test_parameters_are_read_typed():
    given = {triton_config.P_ENGINE: ENGINE_CONCAT, triton_config.P_THREADS: "2", triton_config.P_MAX_BATCH: "4"}
    given |= {triton_config.P_STEP_TOKENS: "64", triton_config.P_KEPT_PER_OWNER: "0"}
    settings = engines.session_settings(PARAMETERS | given)
    assert settings == SessionSettings(
        ENGINE_CONCAT, 1048576, 60.0, threads=2, max_batch=4, step_tokens=64, kept_per_owner=0
    )
    core = engines.core_settings(settings)
    assert (core.step_tokens, core.kept_per_owner, core.generations_per_owner) == (
        64,
        0,
        settings.generations_per_owner,
    )


@pytest.mark.parametrize(
    "make", [lambda: SessionSettings(engine="bogus"), lambda: triton_config.ServingSettings(engine="bogus")]
)
def test_an_unknown_engine_is_refused_naming_the_choices(make):
    with pytest.raises((EngineError, ValueError), match="bogus") as error:
        make()
    assert ENGINE_STATIC in str(error.value) and ENGINE_CONCAT in str(error.value)


def test_an_unknown_engine_parameter_is_refused_at_load():
    with pytest.raises(EngineError, match="unknown engine 'bogus'"):
        engines.session_settings({**PARAMETERS, triton_config.P_ENGINE: "bogus"})


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({triton_config.P_IDLE_TIMEOUT: "60"}, "no parameter 'kv_cache_bytes'"),
        ({**PARAMETERS, triton_config.P_KV_CACHE_BYTES: "two gigabytes"}, "'kv_cache_bytes' must be int"),
        ({**PARAMETERS, triton_config.P_THREADS: "-1"}, "invalid session settings"),
        ({**PARAMETERS, triton_config.P_MIN_ROW_POSITIONS: "0"}, "invalid session settings"),
        ({**PARAMETERS, triton_config.P_STEP_TOKENS: "0"}, "need step_tokens >= 1"),
    ],
)
def test_a_missing_or_wrong_parameter_is_named(parameters, message):
    with pytest.raises(EngineError, match=message):
        engines.session_settings(parameters)


def test_model_files_map_to_their_placements(tmp_path):
    for name in ("a.onnx", "b.onnx"):
        (tmp_path / name).write_bytes(name.encode())
    digests.write(tmp_path, {name: sha256(tmp_path / name) for name in ("a.onnx", "b.onnx")})
    parameters = {triton_config.P_ONNX_FILE: "a.onnx", triton_config.P_ONNX_FILE_CUDA: "b.onnx"}
    assert engines.onnx_files(tmp_path, parameters) == {"cpu": tmp_path / "a.onnx", "cuda": tmp_path / "b.onnx"}


def test_a_placement_runs_its_most_specific_file_and_names_what_is_missing(tmp_path):
    from serving.engine.placement import CPU, CUDA, TENSORRT, Placement, model_file

    for name in ("cpu.onnx", "cuda.onnx"):
        (tmp_path / name).write_bytes(b"")
    files = {CPU: tmp_path / "cpu.onnx", CUDA: tmp_path / "cuda.onnx"}
    assert model_file(files, Placement(TENSORRT, [], [])) == tmp_path / "cuda.onnx"  # no TensorRT form: CUDA's
    assert model_file(files, Placement(CPU, [], [])) == tmp_path / "cpu.onnx"
    with pytest.raises(EngineError, match="no ONNX file for cuda"):
        model_file({}, Placement(CUDA, [], []))
    with pytest.raises(EngineError, match="is not there"):
        model_file({CPU: tmp_path / "gone.onnx"}, Placement(CPU, [], []))
