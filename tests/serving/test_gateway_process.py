"""The gateway as `python -m serving` runs it (serving/host/gateway.py): a process of its own, started again
when it dies, given up on when it dies as fast as it starts, and refused with the reason when it cannot start.
(`tests/faults/test_durable_sessions.py` kills one under a served model: its sessions go on.)"""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import httpx
import pytest

from serving.gateway import Settings
from serving.gateway.settings import settings_environment
from serving.host.gateway import FLAPPING_STARTS, GatewayProcessError, SupervisedGateway
from serving.host.launcher import free_port


def gateway_settings(**fields) -> tuple[dict[str, str], str]:
    port = free_port()
    settings = Settings(port=port, triton_url="127.0.0.1:1", log_level="warning", session_store="none", **fields)
    return settings_environment(settings), f"http://127.0.0.1:{port}"


def test_a_killed_gateway_is_started_again_until_it_dies_as_fast_as_it_starts():
    gateway = SupervisedGateway(*gateway_settings())
    said: list[str] = []
    try:
        assert httpx.get(f"{gateway.url}/healthz").status_code == 200
        for restart in range(1, FLAPPING_STARTS):
            os.kill(gateway.process.process.pid, signal.SIGKILL)
            gateway.process.process.wait(10)
            assert gateway.check(said.append)
            assert gateway.restarts == restart and httpx.get(f"{gateway.url}/healthz").status_code == 200
        assert said[0].startswith("the gateway exited with -9 after") and said[1].endswith("(restart 1)")
        os.kill(gateway.process.process.pid, signal.SIGKILL)
        gateway.process.process.wait(10)
        with pytest.raises(GatewayProcessError, match=rf"exited with -9 {FLAPPING_STARTS} times within 10 s"):
            gateway.check(said.append)
    finally:
        gateway.stop()
    assert not gateway.work_dir.exists()


def test_a_gateway_that_cannot_start_is_refused_naming_its_exit(tmp_path):
    variables, url = gateway_settings(api_keys_file=tmp_path / "missing")
    before = set(Path(tempfile.gettempdir()).glob("serving-gateway-*"))
    with pytest.raises(GatewayProcessError, match=r"the gateway exited with 2:\n\(its output is above\)"):
        SupervisedGateway(variables, url)
    assert set(Path(tempfile.gettempdir()).glob("serving-gateway-*")) == before  # its folder removed
