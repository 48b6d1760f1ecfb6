"""INT8 weights served (`--weights-dtype int8`): a whole model's sessions on `fp32-static-int8w` (the static
cache, its projections, MLPs and head int8) and its stateless calls on `fp32-fused-int8w`, through a real
Triton: every answer equal to the same graph driven in process, and near the PyTorch original by what int8
weights cost, not more. A deployment that asks for int8 weights never gets the float graphs silently."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from client import Client
from contract import files, names
from contract.deployment import ServingSettings
from export import choices
from export.artifacts import load_model
from serving.engine.ort import ort_runner, ort_session
from serving.engine.steps import StepRequest
from serving.triton import config as triton_config
from serving.triton.config import MHA, MHA_SESSION
from serving.triton.repository import RepositoryError, model_files
from tests.fixtures.engine import full_rows_engine
from tests.fixtures.triton import INT8_WEIGHTS, WHOLE_ARTIFACT

PROMPT, STEPS = 7, 12
# The int8 weights' error against the original: the build holds each graph within 2x of what quantizing
# the same weights and activations costs the original itself (export/weights_int8.py), measured at 2e-2 to
# 6e-2 of the logits' scale on this model's ladder; a fault (a scale on the wrong channel, a weight left
# unquantized where its scale is applied) moves every logit by its whole size. 0.2 of the scale holds the
# first and fails the second; the served path itself is held to the graph in process (1e-5).
ORIGINAL_SCALE_BOUND = 0.2
SETTINGS = ServingSettings(weights_dtype="int8")


@pytest.fixture(scope="module")
def served(artifact_dir, whole_triton):
    """(a client of the INT8-weight models of the session's whole-model Triton, the artifact, their repository)."""
    models = {"model": f"{MHA}{INT8_WEIGHTS}", "session_model": f"{MHA_SESSION}{INT8_WEIGHTS}"}
    with Client(whole_triton.grpc_url, **models) as client:
        yield client, artifact_dir(WHOLE_ARTIFACT), whole_triton.repository


def served_graph(repository, model: str) -> str:
    """The ONNX file the INT8-weight copy of `model` serves on the CPU."""
    path = repository / f"{model}{INT8_WEIGHTS}" / triton_config.TRITON_CONFIG_FILENAME
    return triton_config.parameter(triton_config.parse(path.read_text()), triton_config.P_ONNX_FILE)


@pytest.mark.served
def test_the_repository_serves_the_int8_weight_graphs(served):
    _, _, repository = served
    assert served_graph(repository, MHA) == files.model_filename(choices.INT8_WEIGHTS)
    assert served_graph(repository, MHA_SESSION) == files.model_filename(choices.STATIC_INT8_WEIGHTS)


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.mark.served
def test_a_session_and_stateless_calls_answer_as_the_int8_graphs_in_process_and_near_the_original(served):
    client, artifact, _ = served
    original = load_model(artifact)
    ids = np.random.default_rng(0).integers(0, original.cfg.vocab_size, (1, PROMPT + STEPS), dtype=np.int64)
    pieces = [ids[:, :PROMPT]] + [ids[:, t : t + 1] for t in range(PROMPT, PROMPT + STEPS)]
    with client.session() as session:
        served_logits = np.concatenate([session.step(piece) for piece in pieces], axis=1)
    stateless = client.infer(ids).output

    static = ort_session(artifact / files.model_filename(choices.STATIC_INT8_WEIGHTS), threads=1)
    engine = full_rows_engine(static, original.cfg, rows=1, capacity=64)
    in_process = [engine.execute([StepRequest("s", i == 0, False, piece)])[0] for i, piece in enumerate(pieces)]
    np.testing.assert_allclose(served_logits, np.concatenate(in_process, axis=1), atol=1e-5, rtol=1e-5)
    fused = ort_runner(ort_session(artifact / files.model_filename(choices.INT8_WEIGHTS), threads=1))
    np.testing.assert_allclose(stateless, fused({names.INPUT_IDS: ids})[names.LOGITS], atol=1e-5, rtol=1e-5)

    with torch.no_grad():
        expected = original(torch.from_numpy(ids)).output.numpy()
    for what, answer in (("session", served_logits), ("stateless", stateless)):
        error = relative_error(answer, expected)
        print(f"{what}: int8 weights off the fp32 original by {error:.2e} of the logits' scale")
        assert 0 < error < ORIGINAL_SCALE_BOUND, (what, error)  # not fp32's result either: the weights are int8


def test_int8_weights_are_never_given_up_for_the_float_graphs(artifact_dir):
    """An artifact built without them is refused naming the variants and the build command; a quantized
    cache beside int8 weights is refused (no graph holds both)."""
    artifact = artifact_dir("tiny")  # its build has no INT8-weight graph (tests/fixtures/builds.py)
    report = json.loads((artifact / files.REPORT_FILENAME).read_text())
    passing = {name for name, entry in report["variants"].items() if entry.get("passed")}
    assert choices.STATIC_INT8_WEIGHTS not in passing
    with pytest.raises(RepositoryError, match=r"weights_dtype int8 needs the fp32-static-int8w variant.*--variants"):
        model_files(passing, SETTINGS)
    with pytest.raises(ValueError, match="weights_dtype int8 with kv_dtype int8: no graph holds both"):
        ServingSettings(weights_dtype="int8", kv_dtype="int8")
