"""`forward` over HTTP and gRPC equals the PyTorch original: a left-padded batch-3 prefill, then 32
decode steps, each feeding the served presents back (the parity ladder's served rung)."""

from __future__ import annotations

import pytest

from contract.config import ModelConfig
from export.parity import TOLERANCES, Scenario, compare_rung
from serving.engine.ort import Forward
from tests.serving.helpers import PROTOCOLS, Client


def triton_runner(client: Client, model: str = "forward") -> Forward:
    """The served model as a parity-ladder runner, through tritonclient."""
    return lambda inputs: client.infer(model, dict(inputs))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_prefill_and_32_decode_steps_match_pytorch(clients, triton_artifact, served_reference, protocol):
    cfg = ModelConfig.load(triton_artifact)
    scenario = Scenario(batch=3, prefill=7, steps=32, padding=(0, 2, 5))  # the past starts empty (left out)
    result = compare_rung(cfg, served_reference, triton_runner(clients[protocol]), scenario, TOLERANCES["fp32"])
    worst = {name: (error.max_abs, error.step, error.index) for name, error in result.tensors.items()}
    assert result.passed, worst
    assert max(error.max_abs for error in result.tensors.values()) <= 1e-5, worst
    assert len(result.step_errors) == 33


def test_prefill_onto_a_given_cache_matches_pytorch(clients, triton_artifact, served_reference):
    cfg = ModelConfig.load(triton_artifact)
    scenario = Scenario(batch=3, prefill=5, steps=4, padding=(0, 1, 3), past=33, seed=1)
    result = compare_rung(cfg, served_reference, triton_runner(clients["grpc"]), scenario, TOLERANCES["fp32"])
    assert result.passed, {name: error.max_abs for name, error in result.tensors.items()}
