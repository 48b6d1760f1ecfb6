"""A version folder's SHA256SUMS (serving/triton/digests.py), on files made here: what the models
check before they load a graph. The repository writing it from a real build is in
test_triton_config.py; a served tampered repository in tests/faults/test_integrity.py."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from contract.files import DIGESTS_FILENAME, sha256
from serving.triton import digests


@pytest.fixture
def version(tmp_path):
    (tmp_path / "model.a.onnx").write_bytes(b"graph a" * 100)
    (tmp_path / "model.b.onnx").write_bytes(b"graph b" * 100)
    digests.write(tmp_path, {name: sha256(tmp_path / name) for name in ("model.a.onnx", "model.b.onnx")})
    return tmp_path


def test_the_files_as_written_pass(version):
    digests.verify(version, ["model.a.onnx", "model.b.onnx"])
    assert digests.read(version) == {
        "model.a.onnx": sha256(version / "model.a.onnx"),
        "model.b.onnx": sha256(version / "model.b.onnx"),
    }


def test_one_changed_byte_is_refused_naming_the_file_the_recorded_and_the_actual_digest(version):
    recorded = sha256(version / "model.b.onnx")
    data = bytearray((version / "model.b.onnx").read_bytes())
    data[-3] ^= 1
    (version / "model.b.onnx").write_bytes(bytes(data))
    with pytest.raises(digests.IntegrityError) as raised:
        digests.verify(version, ["model.a.onnx", "model.b.onnx"])
    message = str(raised.value)
    assert str(version / "model.b.onnx") in message and "changed after its build" in message
    assert f"the build recorded {recorded}" in message and f"sha256 {sha256(version / 'model.b.onnx')}" in message


def test_a_file_without_a_digest_or_a_folder_without_sha256sums_is_refused(version):
    (version / "model.c.onnx").write_bytes(b"not built")
    with pytest.raises(digests.IntegrityError, match=r"model\.c\.onnx: no sha256 recorded for it in SHA256SUMS"):
        digests.verify(version, ["model.a.onnx", "model.c.onnx"])
    (version / DIGESTS_FILENAME).unlink()
    with pytest.raises(digests.IntegrityError, match="SHA256SUMS is missing"):
        digests.verify(version, ["model.a.onnx"])


def test_a_garbled_line_is_refused_with_its_number(version):
    path = version / DIGESTS_FILENAME
    path.write_text(path.read_text() + "not a digest  model.x.onnx\n")
    with pytest.raises(digests.IntegrityError, match="SHA256SUMS, line 3: expected"):
        digests.read(version)


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="coreutils' sha256sum is not installed")
def test_sha256sum_reads_the_same_file(version):
    """An operator can check a deployed folder by hand: `cd <model>/1 && sha256sum -c SHA256SUMS`."""
    checked = subprocess.run(
        ["sha256sum", "-c", DIGESTS_FILENAME], cwd=version, capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0 and checked.stdout.count(": OK") == 2, checked


def test_the_tokenizer_travels_into_the_session_model_checked_and_a_changed_one_is_refused(artifact_dir, tmp_path):
    """A whole model's text files (the `whole` artifact carries a tokenizer): copied into its session model's
    version folder (the model that generates), listed in its SHA256SUMS with the build's digests beside its
    graphs, their one digest published in its config; a tokenizer.json changed in the artifact after the build
    fails the repository naming it."""
    import json

    from contract import generation
    from contract.files import REPORT_FILENAME, TEXT_FILES, TOKENIZER_FILENAME
    from serving.triton import config as triton_config
    from serving.triton.repository import RepositoryError, write_repository

    artifact = shutil.copytree(artifact_dir("whole"), tmp_path / "artifact")
    recorded = json.loads((artifact / REPORT_FILENAME).read_text())["text_files"]
    assert TOKENIZER_FILENAME in recorded and set(recorded) <= set(TEXT_FILES)
    models = (triton_config.FORWARD, triton_config.SESSIONS)
    repository = write_repository(artifact, tmp_path / "repository", models=models)
    version = repository / triton_config.SESSIONS / "1"
    assert {name: sha256(version / name) for name in recorded} == recorded
    assert {name: digests.read(version)[name] for name in recorded} == recorded
    digests.verify(version, recorded)
    config = triton_config.parse((repository / triton_config.SESSIONS / "config.pbtxt").read_text())
    graphs = [value.string_value for key, value in config.parameters.items() if key.startswith("onnx_file")]
    assert graphs and set(graphs) <= set(digests.read(version))  # the graphs' digests beside the text files'
    assert config.parameters[triton_config.P_TEXT_DIGEST].string_value == generation.text_digest(recorded)

    with (artifact / TOKENIZER_FILENAME).open("a") as tokenizer:
        tokenizer.write(" ")
    with pytest.raises(RepositoryError, match=f"{TOKENIZER_FILENAME} changed after its build"):
        write_repository(artifact, tmp_path / "again", models=models)
