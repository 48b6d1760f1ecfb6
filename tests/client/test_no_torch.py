"""The client runs where torch (and onnxruntime, fastapi) cannot be imported at all."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: an import hook makes the heavy packages unimportable, then the
# client is imported and its public API used, the CLI included, against a port that refuses.
SCRIPT = textwrap.dedent(
    """
    import asyncio, runpy, socket, sys
    BLOCKED = {"torch", "onnxruntime", "fastapi"}

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked in this test")

    sys.meta_path.insert(0, Blocker())
    try:
        import torch
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker failed")

    import numpy as np
    import client
    from client import AsyncClient, Client, InferResult, InvalidInputError, ServerUnavailableError
    from client.metadata import parse_metadata

    down = socket.socket(); down.bind(("127.0.0.1", 0)); url = f"127.0.0.1:{down.getsockname()[1]}"
    for protocol in ("grpc", "http"):
        with Client(url, protocol, retries=1, backoff=0.01) as c:
            assert c.ready() is False
            try:
                c.infer(np.zeros((1, 1, 8), np.float32))
            except ServerUnavailableError as error:
                assert error.message
        async def probe():
            async with AsyncClient(url, protocol, retries=0) as c:
                return await c.ready()
        assert asyncio.run(probe()) is False
    hidden = {"name": "hidden_states", "datatype": "FP32", "shape": [-1, -1, 8]}
    info = parse_metadata({"name": "m", "inputs": [hidden]})
    try:
        info.check({"hidden_states": np.zeros((1, 1, 8), np.float64)})
    except InvalidInputError as error:
        assert error.input_name == "hidden_states"
    InferResult(np.zeros((1, 1, 8), np.float32), [])
    sys.argv = ["client", "health", "--url", url, "--retries", "0"]
    try:
        runpy.run_module("client", run_name="__main__")
    except SystemExit as done:
        assert done.code == 1, done.code
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    assert "tritonclient.grpc" in sys.modules and "tritonclient.http" in sys.modules
    print("ok")
    """
)


def test_client_imports_and_works_without_torch():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("ok")
