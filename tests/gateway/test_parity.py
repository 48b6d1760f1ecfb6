"""What the gateway returns equals the PyTorch original of the artifact Triton serves: stateless
prefill and decode steps over JSON and over the binary encoding, and a session's steps."""

from __future__ import annotations

import numpy as np
import pytest

from contract import names
from contract.config import ModelConfig
from export.parity import TOLERANCES, Scenario, compare_rung
from serving.engine.ort import Forward
from tests.gateway.conftest import attend_body, attend_outputs, b64_tensor, from_b64


def gateway_runner(api, served_cfg: ModelConfig, binary: bool) -> Forward:
    """/v1/attend as a parity-ladder runner: named arrays in, named arrays out, through HTTP."""
    path = "/v1/attend?encoding=b64" if binary else "/v1/attend"

    def run(inputs):
        response = api.post(path, json=attend_body(inputs, served_cfg.n_layers, binary))
        assert response.status_code == 200, response.text
        return attend_outputs(response.json(), binary)

    return run


@pytest.mark.parametrize("binary", [False, True], ids=["json", "b64"])
def test_attend_prefill_and_decode_steps_match_pytorch(api, served_cfg, served_reference, binary):
    scenario = Scenario(batch=3, prefill=6, steps=12, padding=(0, 2, 4), past=5, seed=3)
    result = compare_rung(
        served_cfg, served_reference, gateway_runner(api, served_cfg, binary), scenario, TOLERANCES["fp32"]
    )
    worst = {name: (error.max_abs, error.step, error.index) for name, error in result.tensors.items()}
    assert result.passed, worst
    assert max(error.max_abs for error in result.tensors.values()) <= 1e-5, worst


def test_session_steps_match_the_pytorch_full_forward(api, served_cfg, served_reference):
    rng = np.random.default_rng(7)
    chunks = [rng.standard_normal((1, t, served_cfg.d_model)).astype(np.float32) for t in (5, 1, 1, 3, *[1] * 8)]
    session = api.post("/v1/sessions").json()["id"]
    outputs = []
    for i, chunk in enumerate(chunks):
        binary = i % 2 == 1  # alternate the encodings within one session
        body = {names.HIDDEN_STATES: b64_tensor(chunk) if binary else chunk.tolist()}
        response = api.post(f"/v1/sessions/{session}/step" + ("?encoding=b64" if binary else ""), json=body)
        assert response.status_code == 200, response.text
        output = response.json()["output"]
        outputs.append(from_b64(output) if binary else np.asarray(output, dtype=np.float32))
    assert api.delete(f"/v1/sessions/{session}").status_code == 204
    expected = served_reference({names.HIDDEN_STATES: np.concatenate(chunks, axis=1)})[names.OUTPUT]
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), expected, atol=1e-5, rtol=1e-5)
