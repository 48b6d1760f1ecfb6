"""The Triton models' names before they said what they serve (`mha`, `mha_session`, `mha_onnx`) are accepted
where a deployment may still hold them: a repository written then (renamed in place by `ensure` and
`python -m serving`, no build; loaded as it is by a Triton started by hand), settings, a client's arguments,
`--models`, and an OpenAI model id that was the session model's name."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from client import Client, ModelNotFoundError
from contract import names
from contract.config import ModelConfig
from serving.gateway.settings import Settings
from serving.triton import config as triton_config
from serving.triton.cli import model_names
from serving.triton.repository import is_complete, rename_legacy_models
from tests.serving.helpers import LEGACY, as_written_before


def test_a_legacy_name_is_todays_and_any_other_name_is_left_alone():
    assert [names.current_model_name(n) for n in ("mha", "mha_session", "mha_onnx")] == [
        names.MODEL,
        names.SESSION_MODEL,
        names.ONNX_MODEL,
    ]
    assert names.current_model_name("fortunes_mha_session") == f"fortunes_{names.SESSION_MODEL}"
    for kept in ("sessions", "forward", "noop", "mhax", "mha-llama", "my_model", "bert_mha"):
        assert names.current_model_name(kept) == kept
    settings = Settings(model="mha", session_model="mha_session", more_served_models={"qwen": "qwen_mha_session"})
    assert (settings.model, settings.session_model) == (names.MODEL, names.SESSION_MODEL)
    assert settings.more_served_models == {"qwen": f"qwen_{names.SESSION_MODEL}"}
    assert Settings(generate_model="fortunes_mha_session").generate_model == f"fortunes_{names.SESSION_MODEL}"
    client = Client("127.0.0.1:1", "grpc", "mha", "mha_session")  # connects on first use only
    assert (client.model, client.session_model) == (names.MODEL, names.SESSION_MODEL)
    assert model_names("mha, mha_session") == (names.MODEL, names.SESSION_MODEL)


def test_a_repository_of_the_legacy_names_is_renamed_in_place(triton_repository, tmp_path):
    repository = shutil.copytree(triton_repository, tmp_path / "repository", symlinks=True)
    as_written_before(repository)
    assert not is_complete(repository)
    done = rename_legacy_models(repository)
    assert len(done) == len(list(repository.iterdir())) and all("renamed" in line for line in done), done
    assert is_complete(repository)
    for current in LEGACY:
        config = triton_config.parse((repository / current / triton_config.TRITON_CONFIG_FILENAME).read_text())
        assert config.name == current
        if current in triton_config.IMPLEMENTATIONS:  # the python models'; forward_onnx has none
            implementation = config.parameters[triton_config.P_IMPLEMENTATION].string_value
            assert implementation == triton_config.IMPLEMENTATIONS[current]
    # written again beside today's (an older tool run after a newer one): the legacy folder goes
    shutil.copytree(repository / names.SESSION_MODEL, repository / "mha_session")
    assert rename_legacy_models(repository) == [
        f"{repository / 'mha_session'}: removed, the old name of {names.SESSION_MODEL}, which {repository} holds"
    ]
    assert not (repository / "mha_session").exists() and rename_legacy_models(repository) == []
    # somebody's own models of names like ours are never touched
    for theirs in ("bert_mha_session", "bert_mha"):
        config = triton_config.parse(
            (repository / names.SESSION_MODEL / triton_config.TRITON_CONFIG_FILENAME).read_text()
        )
        config.name = theirs
        config.parameters[triton_config.P_IMPLEMENTATION].string_value = "their_package.model"
        (repository / theirs).mkdir()
        (repository / theirs / triton_config.TRITON_CONFIG_FILENAME).write_text(triton_config.to_text(config))
    assert rename_legacy_models(repository) == []
    assert (repository / "bert_mha_session").is_dir() and (repository / "bert_mha").is_dir()


def test_the_repository_command_renames_what_it_writes_over(triton_artifact, triton_repository, tmp_path, capsys):
    """`python -m serving repository` into a repository written before: the old folders become today's (and are
    written anew), none is left for Triton to load twice."""
    from serving import __main__ as serving_cli

    repository = shutil.copytree(triton_repository, tmp_path / "repository", symlinks=True)
    as_written_before(repository)
    command = ["repository", "--artifacts", str(triton_artifact), "--repository", str(repository)]
    assert serving_cli.main([*command, "--models", "mha,mha_session"]) == 0
    assert capsys.readouterr().out.count("renamed") == len(LEGACY)
    assert sorted(p.name for p in repository.iterdir()) == sorted(LEGACY) and is_complete(repository)


def test_a_checkouts_built_files_left_under_the_old_names_join_the_renamed_configs(triton_repository, tmp_path):
    """A checkout's default repository after the rename: git moved the configs it tracks to today's folders, and
    the files it ignores (each model's version folder, the build's) stayed under the old names."""
    repository = shutil.copytree(triton_repository, tmp_path / "repository", symlinks=True)
    for current, legacy in LEGACY.items():
        (repository / legacy).mkdir()
        (repository / current / "1").rename(repository / legacy / "1")
    assert not is_complete(repository)
    done = rename_legacy_models(repository)
    assert sorted(done) == sorted(
        f"{repository / legacy / '1'}: moved to {repository / current / '1'}, beside its renamed config"
        for current, legacy in LEGACY.items()
    )
    assert is_complete(repository) and not any((repository / legacy).exists() for legacy in LEGACY.values())


@pytest.mark.slow
def test_a_triton_started_by_hand_loads_a_repository_written_before(triton_artifact, triton_repository, tmp_path):
    """Its configs name the implementations' old modules (serving/triton/models/mha.py, mha_session.py), which
    load today's; a client asking for today's names is told where the old ones are and what renames them."""
    from serving.host.launcher import start_triton

    repository = shutil.copytree(triton_repository, tmp_path / "repository", symlinks=True)
    shutil.rmtree(repository / names.ONNX_MODEL)  # the onnxruntime backend's: GPU hosts only
    as_written_before(repository)
    server = start_triton(repository, models=["mha", "mha_session"], log_path=tmp_path / "triton.log")
    try:
        import tritonclient.grpc as grpcclient

        raw = grpcclient.InferenceServerClient(server.grpc_url)
        assert raw.is_model_ready("mha") and raw.is_model_ready("mha_session")
        d_model = ModelConfig.load(triton_artifact).d_model
        hidden = grpcclient.InferInput(names.HIDDEN_STATES, [1, 2, d_model], "FP32")
        hidden.set_data_from_numpy(np.ones((1, 2, d_model), np.float32))
        assert np.isfinite(raw.infer("mha", [hidden]).as_numpy(names.OUTPUT)).all()
        with Client(server.grpc_url, "grpc") as client, pytest.raises(ModelNotFoundError) as refused:
            client.metadata(names.SESSION_MODEL)
        assert f"holds '{names.SESSION_MODEL}' as 'mha_session'" in refused.value.message, refused.value.message
        assert "python -m serving ensure --repository DIR" in refused.value.message
    finally:
        server.stop()
