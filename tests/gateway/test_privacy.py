"""What a session id and the gateway's log give away, with a real gateway process (`python -m
serving.gateway`, log level info) in front of the real Triton: the id's owner is a keyed hash of the
API key (an unsalted hash could be tested against guessed keys by anyone holding an id), and the log
carries no session id (an id and its key step the session), nor a line per request."""

from __future__ import annotations

import hashlib
import time

import httpx
import numpy as np
from itsdangerous import URLSafeSerializer

from bench.stack import KEY, gateway_process
from serving.gateway.auth import owner_of
from serving.gateway.sessions import tag


def test_session_ids_carry_a_keyed_owner_and_stay_out_of_the_log(triton, served_cfg, tmp_path):
    log_path = tmp_path / "gateway.log"
    settings = {"log_level": "info", "session_idle_s": 1}
    token = {"hidden_states": np.zeros((1, 1, served_cfg.d_model), np.float32).tolist()}
    with (
        gateway_process(triton.grpc_url, log_path, **settings) as (url, _),
        httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=30) as api,
    ):
        ids = []
        for _ in range(2):
            created = api.post("/v1/sessions")
            assert created.status_code == 201, created.text
            ids.append(created.json()["id"])
        first, idle = ids
        assert api.post(f"/v1/sessions/{first}/step", json=token).status_code == 200
        assert api.post(f"/v1/sessions/{first}/step", json={"hidden_states": [[[0.5]]]}).status_code == 400
        assert api.delete(f"/v1/sessions/{first}").status_code == 204
        assert api.post(f"/v1/sessions/{first}/step", json=token).status_code == 404
        time.sleep(2.0)  # the second expires: the sweeper closes it and says so
        gone = api.post(f"/v1/sessions/{idle}/step", json=token)
        assert gone.status_code == 404 and "without a step" in gone.json()["error"]["message"]
    log = log_path.read_text()
    assert "closing 1 idle session(s)" in log  # the log is on, at info
    for session in ids:
        assert session not in log and session.split(".")[0] not in log
    assert "POST /v1/sessions" not in log and "/step" not in log  # no access lines (metrics count requests)

    _, (_, owner, _, _) = URLSafeSerializer("").loads_unsafe(first)  # signed, not encrypted: anyone can read it
    unsalted = hashlib.sha256(KEY.encode()).hexdigest()
    assert owner and KEY not in first and unsalted[:16] not in owner and owner not in unsalted
    assert owner_of(KEY, "one-secret") != owner_of(KEY, "another")  # keyed: without the secret, no key can be tested
    assert len(tag(first)) == 12 and tag(first) != tag(idle)
