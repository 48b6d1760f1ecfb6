"""A whole model behind the gateway over HTTP: `{"input_ids": [[...]]}` in (JSON or b64 int64), `logits` out,
stateless and in a session, equal to the PyTorch original; bad ids answer 400 naming `input_ids`.

In front of the session's whole-model Triton (tests/fixtures/triton.py `whole_triton`: tests/conftest.py's
`whole` artifact; the session's main Triton serves an attention model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gateway.conftest import b64_tensor, from_b64
from tests.gateway.test_api import assert_error

pytestmark = pytest.mark.served


@torch.no_grad()
def original(model, ids: np.ndarray) -> np.ndarray:
    return model(torch.from_numpy(ids)).output.numpy()


def test_input_ids_over_http_answer_the_originals_logits(whole):
    api, model = whole
    ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (1, 5), dtype=np.int64)
    expected = original(model, ids)
    tolerance = 1e-5 * float(np.abs(expected).max())  # fp32 rounding, relative to the logits' scale
    described = {m["kind"]: m for m in api.get("/v1/models").json()["models"]}
    assert described["stateless"]["vocab_size"] == model.cfg.vocab_size

    as_json = api.post("/v1/attend", json={"input_ids": ids.tolist()}).json()
    as_b64 = api.post("/v1/attend?encoding=b64", json={"input_ids": b64_tensor(ids)}).json()
    np.testing.assert_allclose(np.asarray(as_json["logits"], np.float32), expected, rtol=0, atol=tolerance)
    np.testing.assert_allclose(from_b64(as_b64["logits"]), expected, rtol=0, atol=tolerance)
    assert "output" not in as_json and len(as_json["present"]) == model.cfg.n_layers

    session = api.post("/v1/sessions").json()["id"]
    first = api.post(f"/v1/sessions/{session}/step", json={"input_ids": ids[:, :4].tolist()}).json()
    second = api.post(f"/v1/sessions/{session}/step?encoding=b64", json={"input_ids": b64_tensor(ids[:, 4:])}).json()
    served = np.concatenate([np.asarray(first["logits"], np.float32), from_b64(second["logits"])], axis=1)
    np.testing.assert_allclose(served, expected, rtol=0, atol=tolerance)
    assert second["length"] == 5
    assert api.delete(f"/v1/sessions/{session}").status_code in (200, 204)


def test_bad_ids_answer_400_naming_the_input(whole):
    api, model = whole
    vocab = model.cfg.vocab_size
    assert_error(
        api.post("/v1/attend", json={"input_ids": [[1, vocab]]}), 400, "invalid_input", "input_ids", f"[0, {vocab})"
    )
    assert_error(api.post("/v1/attend", json={"input_ids": [[-1]]}), 400, "invalid_input", "input_ids", "got -1")
    assert_error(api.post("/v1/attend", json={"hidden_states": [[[0.5] * 64]]}), 400, "invalid_input", "input_ids")
    floats = b64_tensor(np.ones((1, 2), np.float32))
    assert_error(api.post("/v1/attend", json={"input_ids": floats}), 400, "invalid_input", "input_ids", "int64")
    session = api.post("/v1/sessions").json()["id"]
    step = f"/v1/sessions/{session}/step"
    assert_error(api.post(step, json={"input_ids": [[vocab + 7]]}), 400, "invalid_input", "input_ids", str(vocab + 7))
    assert api.post(step, json={"input_ids": [[1, 2]]}).json()["length"] == 2  # the session goes on
    api.delete(f"/v1/sessions/{session}")


def test_inspect_answers_a_whole_models_attention_maps_for_token_ids(whole):
    """/v1/inspect with `input_ids` (one sequence, its batch axis optional): every layer's maps equal the
    original's attention weights, stateless and for a session's next step (the session unchanged)."""
    api, model = whole
    ids = np.random.default_rng(1).integers(0, model.cfg.vocab_size, (1, 6), dtype=np.int64)
    with torch.no_grad():
        expected = [w.numpy()[0] for w in model(torch.from_numpy(ids), return_attention=True).attention_weights]
    stateless = api.post("/v1/inspect", json={"input_ids": ids[0].tolist()}).json()
    assert stateless["layers"] == model.cfg.n_layers and stateless["queries"] == stateless["keys"] == 6
    for layer, weights in enumerate(expected):
        np.testing.assert_allclose(np.asarray(stateless["maps"][layer], np.float32), weights, atol=1e-5)

    session = api.post("/v1/sessions").json()["id"]
    assert api.post(f"/v1/sessions/{session}/step", json={"input_ids": ids[:, :4].tolist()}).json()["length"] == 4
    inspected = api.post("/v1/inspect", json={"input_ids": ids[:, 4:].tolist(), "session": session}).json()
    assert (inspected["queries"], inspected["keys"]) == (2, 6)
    for layer, weights in enumerate(expected):
        np.testing.assert_allclose(np.asarray(inspected["maps"][layer], np.float32), weights[:, 4:], atol=1e-5)
    assert api.post(f"/v1/sessions/{session}/step", json={"input_ids": ids[:, 4:].tolist()}).json()["length"] == 6
    assert_error(api.post("/v1/inspect", json={"input_ids": [[1, 99999]]}), 400, "invalid_input", "input_ids")
    api.delete(f"/v1/sessions/{session}")


def test_the_consoles_try_line_for_a_whole_model_sends_token_ids_and_gets_logits(whole_triton):
    import subprocess

    from serving.gateway.server import banner
    from tests.gateway.conftest import running

    with running(triton_url=whole_triton.grpc_url) as gateway:
        (line,) = [line for line in banner(gateway.settings, gateway.url).splitlines() if line.startswith("try ")]
        command = line.removeprefix("try").strip()
        assert "input_ids" in command and "hidden_states" not in command
        shown = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True, timeout=60)
    assert shown.stdout.startswith('{"logits"'), shown.stdout[:300]
