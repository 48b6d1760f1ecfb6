"""Generated Triton configs: each parses as Triton's schema, fits the ONNX graph its model loads, and
the committed model_repository/ is exactly what the generator makes for the default preset."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as pb

from contract import files, names
from contract.config import DEFAULT_PRESET, ModelConfig, preset
from contract.deployment import ENGINE_CONCAT, ENGINE_STATIC, ENGINES, weight_bytes
from export import choices
from serving.triton import config as triton_config
from serving.triton import digests, engines, repository
from serving.triton.config import FORWARD, FORWARD_ONNX, SESSIONS, ServingSettings
from tests.fixtures.configs import assert_fits, graph_io, loaded_onnx, model_filename_of, read_config
from tests.serving.helpers import change_one_weight

PROJECT_ROOT = Path(__file__).resolve().parents[2]
COMMITTED = PROJECT_ROOT / "model_repository"


@pytest.fixture(scope="module")
def built(artifact_dir, tmp_path_factory) -> Path:
    return repository.write_repository(artifact_dir("gqa"), tmp_path_factory.mktemp("repo"))


@pytest.mark.parametrize("model", [FORWARD, FORWARD_ONNX])
def test_stateless_configs_are_the_graphs_io_exactly(built, model):
    config = read_config(built, model)
    graph = graph_io(loaded_onnx(built, config))
    cfg = ModelConfig.load(built / model / repository.VERSION)
    maps = names.attention_map_names(cfg.n_layers) if model == FORWARD else []  # the inspection graph's, when asked
    assert [t.name for t in config.input] == names.input_names(cfg)
    assert [t.name for t in config.output] == names.output_names(cfg) + maps
    assert config.max_batch_size == 0
    served = [t for t in [*config.input, *config.output] if t.name not in maps]
    assert_fits(served, graph, batch_axis_added=False)
    assert set(graph) == {t.name for t in served}
    if maps:
        inspection = graph_io(built / FORWARD / repository.VERSION / model_filename_of(config))
        assert_fits([*config.input, *config.output], inspection, batch_axis_added=False)
        assert set(inspection) == {t.name for t in [*config.input, *config.output]}


def test_mha_leaves_mask_and_past_optional_forward_onnx_requires_them(built):
    optional = {t.name: t.optional for t in read_config(built, FORWARD).input}
    assert optional.pop(names.HIDDEN_STATES) is False and all(optional.values())
    assert not any(t.optional for t in read_config(built, FORWARD_ONNX).input)


@pytest.mark.parametrize("engine", ENGINES)
def test_session_config_takes_new_tokens_only_and_fits_the_graph(artifact_dir, tmp_path, engine):
    settings = ServingSettings(engine=engine)
    repo = repository.write_repository(artifact_dir("gqa"), tmp_path, settings, models=(SESSIONS,))
    config = read_config(repo, SESSIONS)
    assert triton_config.parameter(config, triton_config.P_ENGINE) == engine
    graph = graph_io(loaded_onnx(repo, config))
    assert [t.name for t in config.input] == [names.HIDDEN_STATES, names.ATTENTION_MASK, names.SNAPSHOT]
    # the model's, not the graph's: the length it holds, and a snapshot's blob (session operations);
    # the attention maps of the `attention_maps` operation, from the inspection graph
    maps = names.attention_map_names(ModelConfig.load(repo / SESSIONS / repository.VERSION).n_layers)
    assert [t.name for t in config.output] == [names.OUTPUT, names.HELD_LENGTH, names.SNAPSHOT, *maps]
    assert_fits(config.output[3:], graph_io(repo / SESSIONS / "1" / model_filename_of(config)), True)
    assert list(config.output[1].dims) == [1]
    # decoupled: the engine core answers from its own thread (a generation a token at a time); Triton's sequence
    # batcher keeps the sessions' slots. Every input is optional: a stop or a text files request carries none
    assert config.model_transaction_policy.decoupled and config.HasField("sequence_batching")
    assert [t.allow_ragged_batch for t in config.input] == [True, True, False]
    assert all(t.optional for t in config.input)
    blob_in, blob_out = config.input[2], config.output[2]
    # in: one blob, or a durable session's increments in order; out: a snapshot's one blob
    assert (blob_in.data_type, list(blob_in.dims), blob_out.data_type) == (pb.TYPE_STRING, [-1], pb.TYPE_STRING)
    assert config.max_batch_size > 0
    if engine == ENGINE_STATIC:
        # the step's mask is the engine's (padded tokens never enter the cache); the graph takes lengths
        assert names.ATTENTION_MASK not in graph and names.SEQLENS_K in graph
        assert_fits([config.input[0], config.output[0]], graph, batch_axis_added=True)
    else:
        assert_fits([*config.input[:2], config.output[0]], graph, batch_axis_added=True)


def test_a_whole_models_session_config_answers_generations(artifact_dir, tmp_path):
    """The session model of a whole model generates: its config declares a generation's outputs (a token's,
    the prompt's scores, the final one's, the tokenizer files') and publishes the digest of its text files."""
    from contract import generation

    repo = repository.write_repository(artifact_dir("whole"), tmp_path, models=(SESSIONS,))
    config = read_config(repo, SESSIONS)
    declared = {t.name for t in config.output}
    assert {generation.TOKEN_ID, generation.FINISH_REASON, generation.CACHED_TOKENS, names.LOGITS} <= declared
    assert {generation.TEXT_FILE_NAMES, generation.PROMPT_LOGPROB} <= declared
    assert triton_config.parameter(config, triton_config.P_TEXT_DIGEST)
    assert [p.name for p in tmp_path.iterdir()] == [SESSIONS]  # no model beside it


def test_each_python_model_gets_a_graph_per_placement(built):
    forward, session = read_config(built, FORWARD), read_config(built, SESSIONS)
    assert {k: triton_config.parameter(forward, k) for k in repository.PYTHON_FILES[FORWARD]} == {
        triton_config.P_ONNX_FILE: "model.fp32-fused.onnx",
        triton_config.P_ONNX_FILE_CUDA: "model.fp16-fused.onnx",  # the fastest stateless form on CUDA (docs/gpu.md)
        triton_config.P_ONNX_FILE_TENSORRT: "model.fp16-trt.onnx",
    }
    assert triton_config.parameter(session, triton_config.P_ENGINE) == ENGINE_STATIC
    assert triton_config.parameter(session, triton_config.P_ONNX_FILE) == "model.fp32-static.onnx"
    assert triton_config.parameter(session, triton_config.P_ONNX_FILE_CUDA) == "model.fp16-static.onnx"
    for model, config in ((FORWARD, forward), (SESSIONS, session)):
        graphs = sorted(p.name for p in (built / model / "1").glob("*.onnx"))
        assert graphs == sorted({v.string_value for k, v in config.parameters.items() if k.startswith("onnx_file")})


def test_a_config_the_static_form_cannot_take_gets_the_concat_engine(artifact_dir, tmp_path):
    source = tmp_path / "artifact"
    shutil.copytree(artifact_dir("gqa"), source)
    for variant in ("fp32-static", "fp16-static"):
        (source / files.model_filename(variant)).unlink()
    repo = repository.write_repository(source, tmp_path / "repo", models=(SESSIONS,))
    config = read_config(repo, SESSIONS)
    assert triton_config.parameter(config, triton_config.P_ENGINE) == ENGINE_CONCAT
    assert triton_config.parameter(config, triton_config.P_ONNX_FILE) == "model.fp32-fused.onnx"


def test_session_batching_is_oldest_and_the_timeouts_and_the_cores_settings_come_from_the_settings(
    artifact_dir, tmp_path
):
    settings = ServingSettings(idle_timeout_seconds=7.5, kv_cache_bytes=123 << 20, step_tokens=64, kept_per_owner=3)
    repo = repository.write_repository(artifact_dir("gqa"), tmp_path, settings, models=(SESSIONS,))
    config = read_config(repo, SESSIONS)
    assert config.sequence_batching.WhichOneof("strategy_choice") == "oldest"  # `direct` injects null requests
    assert config.sequence_batching.max_sequence_idle_microseconds == 15_000_000  # Triton forgets after 2x
    assert triton_config.parameter(config, triton_config.P_IDLE_TIMEOUT) == "7.5"
    assert triton_config.parameter(config, triton_config.P_KV_CACHE_BYTES) == str(123 << 20)
    assert triton_config.parameter(config, triton_config.P_STEP_TOKENS) == "64"
    assert triton_config.parameter(config, triton_config.P_KEPT_PER_OWNER) == "3"


# The tiny preset's row of 512 positions is 2 x 2 layers x 4 heads x 8 x 512 = 65,536 values: 256 KiB in
# fp32, 128 KiB in fp16, 64 KiB in int8, 32 KiB in int4 (and half of each at 256 positions).
@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            ServingSettings(kv_cache_bytes=64 << 20),
            [
                "sessions: KV cache budget 64 MiB = 256 sequences of up to 512 positions on the CPU (fp32), "
                "512 on a GPU (fp16)",
                "sessions: reservations sized to the session: up to 512 sequences of up to 256 positions on the CPU "
                "(fp32) at once, each reserving 256 positions more as it grows",
            ],
        ),
        (
            ServingSettings(kv_cache_bytes=1 << 20, kv_dtype="int8"),
            [
                "sessions: KV cache budget 1 MiB = 16 sequences of up to 512 positions on the CPU (int8)",
                "sessions: reservations sized to the session: up to 32 sequences of up to 256 positions on the CPU "
                "(int8) at once, each reserving 256 positions more as it grows",
            ],
        ),
        (  # 65,536 rows of 256 positions fit: the engine holds MAX_LIVE_SEQUENCES at most
            ServingSettings(kv_cache_bytes=1 << 30, kv_dtype="int4"),
            [
                "sessions: KV cache budget 1024 MiB = 32768 sequences of up to 512 positions on the CPU (int4)",
                "sessions: reservations sized to the session: up to 8192 (the hard cap on live sequences, "
                "whatever the budget) sequences of up to 256 positions on the CPU (int4) at once, each reserving 256 "
                "positions more as it grows",
            ],
        ),
        (
            ServingSettings(kv_cache_bytes=768 << 10, engine=ENGINE_CONCAT),
            [
                "sessions: KV cache budget 1 MiB = 3 sequences of up to 512 positions on the CPU (fp32), "
                "6 on a GPU (fp16)",
                "warning: only 3 sessions fit at once on the CPU; raise --kv-cache-mib to hold more",
            ],
        ),
    ],
)
def test_the_capacity_lines_count_what_the_budget_holds(settings, expected):
    # tiny's weights: per layer a LayerNorm (64), W_q, W_k, W_v, W_o (4 x 32 x 32) and their biases (4 x 32): 4,288
    # parameters, 8,576 in its two layers, 34,304 bytes in fp32
    budget = settings.kv_cache_bytes
    weights = "sessions: weights 0.03 MiB (8,576 parameters, fp32) held beside the KV cache budget: "
    weights += f"{(budget + 34_304) / (1 << 20):.2f} MiB in all"
    assert triton_config.capacity_lines(preset("tiny"), settings) == [weights, *expected]


def test_a_whole_models_capacity_counts_its_embeddings_mlps_and_head():
    """llama-whole: 512 wide, 4 layers, MLP 1408, vocab 8192, its own head: about 20M parameters, 80 MiB."""
    cfg = preset("llama-whole")
    attention = 4 * (512 + 2 * 512 * 512 + 2 * 256 * 512)  # RMSNorm, W_q, W_o, W_k, W_v (4 kv heads of 64)
    mlps = 4 * (512 + 3 * 512 * 1408)  # its norm, W_gate, W_up, W_down
    embeddings = 2 * 8192 * 512 + 512  # token embeddings, the head, the final norm
    assert cfg.n_params() == attention + mlps + embeddings == 20_189_696
    (first, *_) = triton_config.capacity_lines(cfg, ServingSettings(kv_cache_bytes=64 << 20))
    assert first.startswith("sessions: weights 77.02 MiB (20,189,696 parameters, fp32)"), first


def test_the_weights_the_capacity_counts_are_what_the_quantized_graphs_hold(artifact_dir):
    """The capacity line's weights follow the deployment's weights dtype: each served graph's file holds them and a
    little more (its constants: the rotary tables, the quantizers'), never less."""
    artifact = artifact_dir("whole")
    cfg = ModelConfig.load(artifact)
    for variant, dtype in (("fp32-static", "float"), ("fp32-static-int8w", "int8"), ("fp32-static-int4w", "int4")):
        size = (artifact / files.model_filename(variant)).stat().st_size
        assert 0.8 * size <= weight_bytes(cfg, dtype) <= size, (variant, weight_bytes(cfg, dtype), size)
    (first, *_) = triton_config.capacity_lines(cfg, ServingSettings(weights_dtype="int4"))
    assert f"MiB ({cfg.n_params():,} parameters, int4 projections: about)" in first, first


def test_forward_onnx_runs_on_the_gpu_with_tensorrt_in_fp16(built):
    config = read_config(built, FORWARD_ONNX)
    assert config.backend == "onnxruntime" and config.default_model_filename == "model.onnx"
    assert [g.kind for g in config.instance_group] == [pb.ModelInstanceGroup.KIND_GPU]
    (accelerator,) = config.optimization.execution_accelerators.gpu_execution_accelerator
    assert accelerator.name == "tensorrt" and accelerator.parameters["precision_mode"] == "FP16"
    assert "trt_profile_min_shapes" in accelerator.parameters


def test_the_version_folders_hold_what_each_model_loads(built, artifact_dir):
    for model in triton_config.MODELS:
        version = built / model / repository.VERSION
        assert ModelConfig.load(version) == ModelConfig.load(artifact_dir("gqa"))
        assert loaded_onnx(built, read_config(built, model)).is_file()
    assert (built / FORWARD / "1" / "model.fp32-fused.onnx").is_file()  # the fused graph passed: it is served
    assert (built / FORWARD / "1" / "model.py").read_text() == repository.SHIM_SOURCE.read_text()


def test_a_repository_is_complete_only_with_configs_and_models(built, tmp_path):
    assert repository.is_complete(built)
    shutil.copytree(built, tmp_path / "repo")
    (tmp_path / "repo" / SESSIONS / "1" / "model.fp32-static.onnx").unlink()
    assert not repository.is_complete(tmp_path / "repo")  # `python -m serving` would export first
    assert not repository.is_complete(tmp_path / "empty")
    shutil.copytree(built, tmp_path / "unchecked")
    (tmp_path / "unchecked" / FORWARD / "1" / files.DIGESTS_FILENAME).unlink()  # written before digests were
    assert not repository.is_complete(tmp_path / "unchecked")


def test_each_version_folder_records_the_builds_digest_of_every_graph_it_holds(built, artifact_dir):
    report = json.loads((artifact_dir("gqa") / files.REPORT_FILENAME).read_text())
    built_digests = {entry["file"]: entry["sha256"] for entry in report["variants"].values() if entry["file"]}
    for model in triton_config.MODELS:
        version = built / model / repository.VERSION
        recorded = digests.read(version)
        assert sorted(recorded) == sorted(path.name for path in version.glob("*.onnx")), model
        for name, digest in recorded.items():
            source = files.model_filename(repository.ONNX_BACKEND_VARIANT) if model == FORWARD_ONNX else name
            assert digest == built_digests[source] == files.sha256(version / name), (model, name)


def test_a_graph_changed_in_the_repository_is_refused_when_the_model_loads(built, tmp_path):
    repo = shutil.copytree(built, tmp_path / "repo")
    version = repo / SESSIONS / repository.VERSION
    parameters = {key: value.string_value for key, value in read_config(repo, SESSIONS).parameters.items()}
    assert engines.onnx_files(version, parameters)  # as written: every graph checks out
    changed = version / parameters[triton_config.P_ONNX_FILE]
    recorded = files.sha256(changed)
    change_one_weight(changed)
    with pytest.raises(digests.IntegrityError) as raised:
        engines.onnx_files(version, parameters)
    assert f"{changed} changed after its build: sha256 {files.sha256(changed)}, the build recorded {recorded}" in str(
        raised.value
    )


def test_an_artifact_changed_after_its_build_is_not_copied_into_a_repository(artifact_dir, tmp_path):
    source = shutil.copytree(artifact_dir("gqa"), tmp_path / "artifact")
    change_one_weight(source / "model.fp32-static.onnx")
    with pytest.raises(repository.RepositoryError, match=r"model\.fp32-static\.onnx changed after its build: sha256"):
        repository.write_repository(source, tmp_path / "repo")


def test_fp32_is_served_when_the_fused_variant_failed(artifact_dir, tmp_path):
    source = tmp_path / "artifact"
    shutil.copytree(artifact_dir("gqa"), source)
    report_path = source / files.REPORT_FILENAME
    report = json.loads(report_path.read_text())
    report["variants"]["fp32-fused"]["passed"] = False
    report_path.write_text(json.dumps(report))
    repo = repository.write_repository(source, tmp_path / "repo")
    served = read_config(repo, FORWARD)
    assert triton_config.parameter(served, triton_config.P_ONNX_FILE) == "model.fp32.onnx"
    assert "model.fp32-fused.onnx" not in {p.name for p in (repo / FORWARD / "1").glob("*.onnx")}


def test_no_passing_variant_is_a_clear_error(artifact_dir, tmp_path):
    source = tmp_path / "artifact"
    shutil.copytree(artifact_dir("gqa"), source)
    for variant in repository.PYTHON_FILES[FORWARD][repository.P_CPU]:
        (source / files.model_filename(variant)).unlink()
    with pytest.raises(repository.RepositoryError, match="no passing variant for forward on the CPU"):
        repository.write_repository(source, tmp_path / "repo")


def test_the_committed_repository_is_what_the_generator_makes_for_the_default_preset():
    # what `make export` builds on a CPU host (the committed configs are this machine's; a GPU host writes its own)
    every_variant = set(choices.variants_for(choices.CPU))
    configs = repository.model_configs(preset(DEFAULT_PRESET), every_variant)
    for name, config in configs.items():
        committed = (COMMITTED / name / triton_config.TRITON_CONFIG_FILENAME).read_text()
        assert committed == triton_config.to_text(config), f"regenerate with `make export` ({name})"
    # the shim copies (`1/model.py`) are written with the binaries by `python -m serving ensure`, not committed


def test_the_repository_command(artifact_dir, tmp_path):
    command = [sys.executable, "-m", "serving", "repository", "--artifacts", str(artifact_dir("gqa"))]
    command += ["--repository", str(tmp_path), "--models", "sessions", "--kv-cache-mib", "64", "--idle-timeout", "9"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    config = read_config(tmp_path, SESSIONS)
    assert triton_config.parameter(config, triton_config.P_KV_CACHE_BYTES) == str(64 << 20)
    assert config.sequence_batching.max_sequence_idle_microseconds == 18_000_000
    assert [p.name for p in tmp_path.iterdir()] == [SESSIONS]
    bad_command = [*command[:4], "--artifacts", str(tmp_path / "nothing"), "--repository", str(tmp_path)]
    bad = subprocess.run(bad_command, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "error:" in bad.stderr


def test_a_mistyped_flag_gets_its_commands_usage(capsys):
    """`python -m serving repository` answers a flag it does not know with its own usage (its flags)."""
    from serving.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["repository", "--artifacts", "a", "--repository", "r", "--threds", "2"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.startswith("usage: python -m serving repository [-h] --artifacts ARTIFACTS"), err
    assert err.endswith("python -m serving repository: error: unrecognized arguments: --threds 2\n"), err


def test_the_commands_parse_without_loading_the_configs_protobuf():
    """`python -m serving repository|ensure --help` answers at once: the Triton config and repository
    modules (protobuf, tritonclient) load only when a command runs."""
    script = (
        "import argparse, sys\n"
        "from serving.triton import cli\n"
        "cli.add_commands(argparse.ArgumentParser().add_subparsers())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'tritonclient', 'google', 'numpy', 'export'}))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]", done.stdout
