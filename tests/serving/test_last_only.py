"""A session step that asks for its last position only (the request parameter `last_only`), as a
generation loop's prompt chunks do: each session engine without Triton over the whole Llama-shaped test
model (TEST_CONFIGS["whole"]), then once through Triton.

The engines: the static one as the factory makes it (a whole model's prefills through the last-logits
graph), the static one over a cache without that graph (the full logits sliced), and the concat one
(sliced). Each answers (1, 1, vocab): the last row of what the same step answers in full, or of the
PyTorch original's logits; fp32 against fp32, so within 1e-5 of the logits' scale (float rounding only,
docs/design.md, parity).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from contract import names
from contract.files import model_filename
from contract.inputs import InputError
from export.artifacts import load_model
from serving.engine import factory
from serving.engine.ort import CPU, CPU_PROVIDER, ort_session
from serving.engine.placement import Placement
from serving.engine.settings import ENGINE_CONCAT, ENGINE_STATIC, SessionSettings
from serving.engine.steps import StepRequest
from tests.fixtures.engine import full_rows_engine
from tests.serving.helpers import Client as Triton
from tests.serving.helpers import new_sequence_id

RELATIVE = 1e-5
STATIC, SLICED, CONCAT = "static", "static without the last-logits graph", "concat"
# the graph each engine runs: the static cache's, or the fused one the concat engine batches
GRAPHS = {STATIC: "fp32-static", SLICED: "fp32-static", CONCAT: "fp32-fused"}


@pytest.fixture(scope="module")
def artifact(artifact_dir):
    return artifact_dir("whole")


@pytest.fixture(scope="module")
def original(artifact):
    return load_model(artifact)


@pytest.fixture(params=[STATIC, SLICED, CONCAT])
def engine(request, artifact, original):
    path, cfg = artifact / model_filename(GRAPHS[request.param]), original.cfg
    if request.param == SLICED:
        return full_rows_engine(ort_session(path, threads=1), cfg, rows=4, capacity=cfg.max_seq_len)
    kind = ENGINE_CONCAT if request.param == CONCAT else ENGINE_STATIC
    settings = SessionSettings(engine=kind, kv_cache_bytes=1 << 20, idle_timeout_seconds=60.0, threads=1)
    return factory.session_engine({CPU: path}, cfg, settings, "last-only")


def ids(original, seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, original.cfg.vocab_size, (1, count), dtype=np.int64)


def step(sequence_id, tokens, mask=None, start=False, end=False, last_only=False) -> StepRequest:
    return StepRequest(sequence_id, start, end, tokens, mask, last_only)


@torch.no_grad()
def forward(original, tokens: np.ndarray) -> np.ndarray:
    """The original's logits over a whole unpadded sequence (1, T, vocab)."""
    return original(torch.from_numpy(tokens)).output.numpy()


def assert_close(answered: np.ndarray, expected: np.ndarray) -> None:
    assert answered.shape == expected.shape, (answered.shape, expected.shape)
    scale = float(np.abs(expected).max())
    assert float(np.abs(answered - expected).max()) <= RELATIVE * scale


def test_a_prompt_asking_for_its_last_position_answers_the_last_row_of_its_full_answer(engine, original):
    vocab = original.cfg.vocab_size
    prompt, chunk, token = ids(original, 0, 9), ids(original, 1, 5), ids(original, 2, 1)
    full, last = engine.execute([step("full", prompt, start=True), step("last", prompt, start=True, last_only=True)])
    assert last.shape == (1, 1, vocab) and last.dtype == np.float32 and full.shape == (1, 9, vocab)
    assert_close(last, full[:, -1:])
    assert engine.length("last") == engine.length("full") == 9
    # a chunk onto what the sequence holds, then a decode step (the same either way): one cache underneath
    full, last = engine.execute([step("full", chunk), step("last", chunk, last_only=True)])
    assert_close(last, full[:, -1:])
    full, last = engine.execute([step("full", token), step("last", token, last_only=True)])
    assert_close(last, full)
    assert engine.length("last") == engine.length("full") == 15


def test_a_padded_prompt_answers_its_last_real_tokens_logits(engine, original):
    tokens = ids(original, 3, 7)
    mask = np.array([[0, 1, 1, 0, 1, 1, 0]], np.int64)  # the last real token is the sixth
    full, last = engine.execute(
        [step("full", tokens, mask, start=True), step("last", tokens, mask, start=True, last_only=True)]
    )
    assert_close(last, full[:, 5:6])
    assert_close(last, forward(original, tokens[:, mask[0].astype(bool)])[:, -1:])
    assert engine.length("last") == engine.length("full") == 4


def test_one_execute_mixes_last_position_and_full_answers(engine, original):
    """A last-position prefill and a plain one starting, a plain decode step and a last-position chunk
    onto held tokens, in one execute(): each as the original answers its whole sequence."""
    held = {"decoding": ids(original, 4, 4), "chunked": ids(original, 5, 4)}
    engine.execute([step(sequence_id, tokens, start=True) for sequence_id, tokens in held.items()])
    new = {
        "last": ids(original, 6, 6),
        "plain": ids(original, 7, 3),
        "decoding": ids(original, 8, 1),
        "chunked": ids(original, 9, 3),
    }
    answers = engine.execute(
        [
            step("last", new["last"], start=True, last_only=True),
            step("plain", new["plain"], start=True),
            step("decoding", new["decoding"]),
            step("chunked", new["chunked"], last_only=True),
        ]
    )
    for answer, (sequence_id, tokens), width in zip(answers, new.items(), (1, 3, 1, 1), strict=True):
        whole = np.concatenate([held[sequence_id], tokens], axis=1) if sequence_id in held else tokens
        assert_close(answer, forward(original, whole)[:, -width:])


@pytest.mark.parametrize("value", ["true", 1, None])
def test_a_last_only_that_is_not_a_boolean_is_refused_and_end_still_frees_the_sequence(engine, original, value):
    tokens = ids(original, 10, 3)
    engine.execute([step("refused", tokens, start=True)])
    refused, served = engine.execute(
        [step("refused", tokens, end=True, last_only=value), step("other", tokens, start=True, last_only=True)]
    )
    assert isinstance(refused, InputError) and refused.input_name == names.LAST_ONLY
    assert f"expected a boolean (true or false), got {value!r}" in str(refused)
    assert engine.length("refused") == -1  # its END freed it all the same
    assert served.shape == (1, 1, original.cfg.vocab_size)


def test_a_start_without_tokens_asking_for_the_last_position_answers_no_position(engine, original):
    (opened,) = engine.execute([step("opened", np.zeros((1, 0), np.int64), start=True, last_only=True)])
    assert opened.shape == (1, 0, original.cfg.vocab_size) and engine.length("opened") == 0


def test_the_factory_gives_a_whole_models_static_cache_a_graph_of_the_last_position_only(artifact, original):
    settings = SessionSettings(kv_cache_bytes=1 << 20, idle_timeout_seconds=60.0, threads=1)
    engine = factory.session_engine({CPU: artifact / model_filename("fp32-static")}, original.cfg, settings, "built")
    logits = engine.cache.pool.last_logits_session.get_outputs()[0]
    assert logits.name == names.LOGITS and logits.shape[1:] == [1, original.cfg.vocab_size]


def test_a_whole_graph_without_a_final_norm_gets_no_last_logits_graph_and_the_notes_say_why(tmp_path):
    """Such prefills then slice the full logits (the `static without the last-logits graph` engine above)."""
    ids_in = helper.make_tensor_value_info(names.INPUT_IDS, TensorProto.INT64, [1, None])
    logits_out = helper.make_tensor_value_info(names.LOGITS, TensorProto.FLOAT, [1, None, 4])
    head = helper.make_tensor("head", TensorProto.FLOAT, [4], [1.0, 2.0, 3.0, 4.0])
    nodes = [
        helper.make_node("Cast", [names.INPUT_IDS], ["as_float"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["as_float", "last_axis"], ["column"]),
        helper.make_node("Mul", ["column", "head"], [names.LOGITS]),
    ]
    axis = helper.make_tensor("last_axis", TensorProto.INT64, [1], [-1])
    graph = helper.make_graph(nodes, "no-norm", [ids_in], [logits_out], initializer=[head, axis])
    path = tmp_path / "no-norm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    placement = Placement(CPU, [CPU_PROVIDER], [])
    assert factory._last_logits_session(path, placement, threads=1) is None
    (note,) = placement.notes
    assert note.startswith(
        "last-position prefills slice the full logits: no last-logits graph (ValueError: no final norm"
    )


@pytest.mark.served
def test_through_triton_a_step_asking_for_its_last_position_answers_it_and_a_bad_value_is_refused(
    whole_triton, original
):
    prompt = ids(original, 11, 8)
    sequence = {"sequence_id": new_sequence_id(), "sequence_start": True}
    with Triton(whole_triton, "grpc") as raw:
        answered = raw.infer(
            names.SESSION_MODEL, {names.INPUT_IDS: prompt}, **sequence, parameters={names.LAST_ONLY: True}
        )
        assert_close(answered[names.LOGITS], forward(original, prompt)[:, -1:])
        assert answered[names.HELD_LENGTH].tolist() == [[8]]
        with pytest.raises(InferenceServerException, match=r"last_only.*expected a boolean.*got 'yes'") as refused:
            raw.infer(names.SESSION_MODEL, {names.INPUT_IDS: prompt}, **sequence, parameters={names.LAST_ONLY: "yes"})
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        raw.infer(
            names.SESSION_MODEL,
            {names.INPUT_IDS: prompt[:, :0]},
            sequence_id=sequence["sequence_id"],
            sequence_end=True,
        )
