"""The gateway in process over a config no preset uses (TEST_CONFIGS["unseen"]): with
SERVING_API_KEYS=k it answers /v1/attend with 401 without the key and, with it, outputs equal to the
independent implementation (tests/reference.py). Then that Triton is stopped and /readyz follows it
down while /healthz stays up."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from contract.config import ModelConfig
from contract.files import WEIGHTS_FILENAME
from serving.gateway import Settings, run_gateway
from serving.triton.config import ServingSettings
from tests import reference
from tests.gateway.conftest import b64_tensor, from_b64

pytestmark = pytest.mark.served


@pytest.fixture(scope="module")
def unseen(artifact_dir, tmp_path_factory):
    """(artifact directory, a Triton serving a repository built from it); that Triton is this module's own."""
    from serving.host.launcher import start_triton
    from serving.triton.repository import write_repository

    artifact = artifact_dir("unseen")
    repository = write_repository(artifact, tmp_path_factory.mktemp("unseen-repository"), ServingSettings(threads=1))
    server = start_triton(repository, models=["forward", "sessions"])
    yield artifact, server
    server.stop()


def test_unseen_config_behind_an_api_key_matches_the_reference_then_readyz_follows_triton_down(unseen, monkeypatch):
    artifact, triton = unseen
    cfg = ModelConfig.load(artifact)
    monkeypatch.setenv("SERVING_API_KEYS", "k")
    gateway = run_gateway(Settings(port=0, triton_url=triton.grpc_url))  # the key comes from the environment
    try:
        url = f"{gateway.url}/v1/attend"
        rng = np.random.default_rng(11)
        hidden = rng.standard_normal((2, 4, cfg.d_model)).astype(np.float32)
        mask = np.array([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=np.int64)  # row 1: 2 padded past slots
        past = rng.standard_normal((cfg.n_layers, 2, 2, cfg.n_kv_heads, 2, cfg.head_dim)).astype(np.float32)
        body = {
            "hidden_states": hidden.tolist(),
            "attention_mask": mask.tolist(),
            "past_key_values": [{"key": b64_tensor(k), "value": b64_tensor(v)} for k, v in past],
        }
        assert httpx.post(url, json=body).status_code == 401
        assert httpx.post(url, json=body, headers={"X-API-Key": "wrong"}).status_code == 401
        answer = httpx.post(f"{url}?encoding=b64", json=body, headers={"Authorization": "Bearer k"}, timeout=60)
        assert answer.status_code == 200, answer.text

        weights = reference.load_weights(artifact / WEIGHTS_FILENAME)
        expected, presents = reference.forward(cfg, weights, hidden, mask, [tuple(pair) for pair in past])
        output = from_b64(answer.json()["output"])
        real = reference.real_rows(mask, new=4)
        np.testing.assert_allclose(output[real], expected[real], atol=1e-5, rtol=1e-5)
        assert len(answer.json()["present"]) == cfg.n_layers == 3
        for pair, (key, value) in zip(answer.json()["present"], presents, strict=True):
            np.testing.assert_allclose(from_b64(pair["key"]), key, atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(from_b64(pair["value"]), value, atol=1e-5, rtol=1e-5)

        assert httpx.get(f"{gateway.url}/readyz").status_code == 200
        triton.stop()
        assert httpx.get(f"{gateway.url}/readyz", timeout=30).status_code == 503
        assert httpx.post(url, json=body, headers={"X-API-Key": "k"}, timeout=30).status_code == 503
        assert httpx.get(f"{gateway.url}/healthz").status_code == 200
    finally:
        gateway.stop()
