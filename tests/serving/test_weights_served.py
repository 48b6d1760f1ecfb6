"""Quantized weights served (`--weights-dtype int8`, `int4`): a whole model's sessions on `fp32-static-int8w`
(`-int4w`: the static cache, its projections, MLPs and head in 8 or 4 bits) and its stateless calls on
`fp32-fused-int8w` (`-int4w`), through a real Triton: every answer equal to the same graph driven in process,
and near the PyTorch original by what the weights' bits cost, not more. A deployment that asks for quantized
weights never gets the float graphs silently."""

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
from serving.triton.config import FORWARD, SESSIONS
from serving.triton.repository import RepositoryError, model_files
from tests.fixtures.engine import full_rows_engine
from tests.fixtures.triton import WEIGHT_SUFFIXES, WHOLE_ARTIFACT

PROMPT, STEPS = 7, 12
# The quantized weights' error against the original: the build holds each graph within 2x (int4: 1.5x) of what
# quantizing the same weights and activations costs the original itself (export/weights_int8.py, weights_int4.py),
# measured at 2e-2 to 6e-2 of the logits' scale for int8 and 0.1 to 0.3 for int4 on the ladders; a fault (a scale
# on the wrong channel or block, a weight left unquantized where its scale is applied) moves every logit by its
# whole size. These bounds hold the first and fail the second; the served path itself is held to the graph in
# process (1e-5).
ORIGINAL_SCALE_BOUND = {"int8": 0.2, "int4": 0.6}
GRAPHS = {  # the stateless and static graphs each weights dtype serves
    "int8": (choices.INT8_WEIGHTS, choices.STATIC_INT8_WEIGHTS),
    "int4": (choices.INT4_WEIGHTS, choices.STATIC_INT4_WEIGHTS),
}


@pytest.fixture(scope="module", params=sorted(GRAPHS))
def served(request, artifact_dir, whole_triton):
    """(the weights dtype, a client of its models in the session's whole-model Triton, the artifact, their
    repository)."""
    suffix = WEIGHT_SUFFIXES[request.param]
    models = {"model": f"{FORWARD}{suffix}", "session_model": f"{SESSIONS}{suffix}"}
    with Client(whole_triton.grpc_url, **models) as client:
        yield request.param, client, artifact_dir(WHOLE_ARTIFACT), whole_triton.repository


def served_graph(repository, model: str, dtype: str) -> str:
    """The ONNX file the `dtype`-weight copy of `model` serves on the CPU."""
    path = repository / f"{model}{WEIGHT_SUFFIXES[dtype]}" / triton_config.TRITON_CONFIG_FILENAME
    return triton_config.parameter(triton_config.parse(path.read_text()), triton_config.P_ONNX_FILE)


@pytest.mark.served
def test_the_repository_serves_the_quantized_weight_graphs(served):
    dtype, _, _, repository = served
    stateless, static = GRAPHS[dtype]
    assert served_graph(repository, FORWARD, dtype) == files.model_filename(stateless)
    assert served_graph(repository, SESSIONS, dtype) == files.model_filename(static)


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.mark.served
def test_a_session_and_stateless_calls_answer_as_the_graphs_in_process_and_near_the_original(served):
    dtype, client, artifact, _ = served
    stateless_graph, static_graph = GRAPHS[dtype]
    original = load_model(artifact)
    ids = np.random.default_rng(0).integers(0, original.cfg.vocab_size, (1, PROMPT + STEPS), dtype=np.int64)
    pieces = [ids[:, :PROMPT]] + [ids[:, t : t + 1] for t in range(PROMPT, PROMPT + STEPS)]
    with client.session() as session:
        served_logits = np.concatenate([session.step(piece) for piece in pieces], axis=1)
    stateless = client.infer(ids).output

    static = ort_session(artifact / files.model_filename(static_graph), threads=1)
    engine = full_rows_engine(static, original.cfg, rows=1, capacity=64)
    in_process = [engine.execute([StepRequest("s", i == 0, False, piece)])[0] for i, piece in enumerate(pieces)]
    np.testing.assert_allclose(served_logits, np.concatenate(in_process, axis=1), atol=1e-5, rtol=1e-5)
    fused = ort_runner(ort_session(artifact / files.model_filename(stateless_graph), threads=1))
    np.testing.assert_allclose(stateless, fused({names.INPUT_IDS: ids})[names.LOGITS], atol=1e-5, rtol=1e-5)

    with torch.no_grad():
        expected = original(torch.from_numpy(ids)).output.numpy()
    for what, answer in (("session", served_logits), ("stateless", stateless)):
        error = relative_error(answer, expected)
        print(f"{what}: {dtype} weights off the fp32 original by {error:.2e} of the logits' scale")
        assert 0 < error < ORIGINAL_SCALE_BOUND[dtype], (what, error)  # not fp32's result: the weights are quantized


def test_quantized_weights_are_never_given_up_for_the_float_graphs(artifact_dir):
    """An artifact built without them is refused naming the variants and the build command; a quantized
    cache beside quantized weights is refused (no graph holds both)."""
    artifact = artifact_dir("tiny")  # its build has no INT8-weight graph (tests/fixtures/builds.py)
    report = json.loads((artifact / files.REPORT_FILENAME).read_text())
    passing = {name for name, entry in report["variants"].items() if entry.get("passed")}
    assert choices.STATIC_INT8_WEIGHTS not in passing
    for dtype, (_, static_graph) in GRAPHS.items():
        with pytest.raises(
            RepositoryError, match=rf"weights_dtype {dtype} needs the {static_graph} variant.*--variants"
        ):
            model_files(passing, ServingSettings(weights_dtype=dtype))
    with pytest.raises(ValueError, match="weights_dtype int4 with kv_dtype int8: no graph holds both"):
        ServingSettings(weights_dtype="int4", kv_dtype="int8")
