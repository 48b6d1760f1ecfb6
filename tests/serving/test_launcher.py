"""The launcher against the real bundled Triton, with a one-line Python-backend model."""

import logging
import os
import shlex
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from serving.host.launcher import (
    SHM_PREFIX,
    TritonStartError,
    backend_directory,
    bundled_triton,
    server_environment,
    start_triton,
)
from tests.fixtures.admin import cmdline, grpc_call, http_status, restrictions

pytestmark = pytest.mark.served

ECHO_CONFIG = """
name: "{name}"
backend: "{backend}"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }} ]
"""

ECHO_MODEL = textwrap.dedent(
    """
    import triton_python_backend_utils as pb_utils

    import contract.names  # our own packages import inside the stub

    {extra}


    class TritonPythonModel:
        def execute(self, requests):
            doubled = [2 * pb_utils.get_input_tensor_by_name(r, "X").as_numpy() for r in requests]
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]) for y in doubled]
    """
)


def add_model(repository: Path, name: str, backend: str = "python", extra: str = "") -> None:
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(ECHO_CONFIG.format(name=name, backend=backend))
    if backend == "python":
        (repository / name / "1" / "model.py").write_text(ECHO_MODEL.format(extra=extra))


def descendants(pid: int) -> set[int]:
    """Every process whose parent chain reaches `pid` (Triton's stubs are its children)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_serves_python_models_skips_missing_backends_and_leaves_nothing_behind(tmp_path, caplog):
    add_model(tmp_path, "echo")
    add_model(tmp_path, "gpu_only", backend="onnxruntime")
    shm_before = set(os.listdir("/dev/shm"))
    with caplog.at_level(logging.INFO, logger="serving.host.launcher"), start_triton(tmp_path) as server:
        assert server.models == ["echo"]
        pid, stubs = server.process.pid, descendants(server.process.pid)
        assert stubs, "the Python backend stub should run as Triton's child"
        client = httpclient.InferenceServerClient(server.http_url)
        x = httpclient.InferInput("X", [3], "FP32")
        x.set_data_from_numpy(np.array([1.0, 2.0, 3.0], dtype=np.float32))
        np.testing.assert_array_equal(client.infer("echo", [x]).as_numpy("Y"), [2.0, 4.0, 6.0])
        assert not client.is_model_ready("gpu_only")
        client.close()
    assert "not loading model 'gpu_only': backend 'onnxruntime' is not in this Triton build" in caplog.text
    assert server.process.returncode == 0
    assert not Path(f"/proc/{pid}").exists()
    assert not any(Path(f"/proc/{stub}").exists() for stub in stubs), "a backend stub outlived the server"
    assert not {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith(SHM_PREFIX)}


def test_a_model_that_fails_to_load_gives_the_log_tail_and_keeps_the_log(tmp_path):
    add_model(tmp_path, "broken", extra="raise RuntimeError('this model cannot load')")
    log_path = tmp_path / "triton.log"
    with pytest.raises(TritonStartError, match="this model cannot load"):
        start_triton(tmp_path, log_path=log_path, ready_timeout=60)
    assert "this model cannot load" in log_path.read_text()


def crashing_once(install: Path, marker: Path) -> Path:
    """A tritonserver that dies by SIGSEGV at its first start (as 2.51 once did in CI, its log
    empty) and is the wheel's server afterwards; laid out as an installed one, backends beside it."""
    bundle = bundled_triton()
    backend_directory(bundle, install)
    env = server_environment(bundle)
    exports = " ".join(f"{name}={shlex.quote(env[name])}" for name in ("LD_LIBRARY_PATH", "PATH", "PYTHONPATH"))
    binary = install / "bin" / "tritonserver"
    binary.parent.mkdir()
    binary.write_text(
        f"#!/bin/bash\nif [ ! -e {marker} ]; then touch {marker}; kill -SEGV $$; fi\n"
        f'export {exports}\nexec {bundle / "bin" / "tritonserver"} "$@"\n'
    )
    binary.chmod(0o755)
    return binary


def test_a_server_that_crashes_while_starting_is_started_once_more(tmp_path, caplog):
    add_model(tmp_path / "repository", "echo")
    marker = tmp_path / "crashed"
    binary = crashing_once(tmp_path / "install", marker)
    with (
        caplog.at_level(logging.WARNING, logger="serving.host.launcher"),
        start_triton(tmp_path / "repository", tritonserver=binary, ready_timeout=60) as server,
    ):
        assert marker.exists(), "the first start should have crashed"
        assert httpclient.InferenceServerClient(server.http_url).is_model_ready("echo")
    assert "tritonserver exited with -11; starting it again (attempt 2 of 2)" in caplog.text


def test_a_missing_repository_is_a_clear_error(tmp_path):
    with pytest.raises(TritonStartError, match="no model repository at"):
        start_triton(tmp_path / "nowhere")


# --- what every server started here closes, and port conflicts ------------------------------------

ADMIN_CALLS = {
    # (what, call(client) for the HTTP and the gRPC tritonclient alike)
    "unload a model": lambda client, **kw: client.unload_model("sessions", **kw),
    "load a model": lambda client, **kw: client.load_model("forward", **kw),
    "list the repository": lambda client, **kw: client.get_model_repository_index(**kw),
    "register shared memory": lambda client, **kw: client.register_system_shared_memory("r", "/r", 64, **kw),
    "change the log settings": lambda client, **kw: client.update_log_settings({"log_verbose_level": 1}, **kw),
    "change the trace settings": lambda client, **kw: client.update_trace_settings(settings={"trace_rate": "1"}, **kw),
}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("call", ADMIN_CALLS)
def test_admin_apis_are_refused_to_every_caller(triton, protocol, call):
    """A local Triton is as closed as the compose one, and no key opens it: a call with the header
    its command line names (what any local user reads in /proc) is refused like a call without (an
    uploaded model.py would run arbitrary code as the server's user)."""
    from tritonclient.utils import InferenceServerException

    module = httpclient if protocol == "http" else pytest.importorskip("tritonclient.grpc")
    client = module.InferenceServerClient(triton.http_url if protocol == "http" else triton.grpc_url)
    named, value = restrictions(cmdline(triton.process.pid))["http"]  # the gRPC client adds Triton's prefix
    try:
        for headers in (None, {"admin-key": "a guess"}):
            with pytest.raises(InferenceServerException) as refused:
                ADMIN_CALLS[call](client, headers=headers)
            assert "restricted" in refused.value.message().lower(), refused.value
        # the client libraries will not even send it (what reaches the server: the raw test below)
        with pytest.raises((InferenceServerException, ValueError), match=r"(?i)header|metadata"):
            ADMIN_CALLS[call](client, headers={named: value})
        assert client.is_model_ready("sessions")  # nothing was unloaded
    finally:
        client.close()


# what each restricted API is over the wire: (HTTP method and path, gRPC method)
RESTRICTED_CALLS = {
    "list the repository": (("POST", "/v2/repository/index"), "RepositoryIndex"),
    "load a model": (("POST", "/v2/repository/models/forward/load"), "RepositoryModelLoad"),
    "unload a model": (("POST", "/v2/repository/models/forward/unload"), "RepositoryModelUnload"),
    "shared memory": (("GET", "/v2/systemsharedmemory/status"), "SystemSharedMemoryStatus"),
    "log settings": (("GET", "/v2/logging"), "LogSettings"),
    "trace settings": (("GET", "/v2/trace/setting"), "TraceSetting"),
}


def test_the_header_the_command_line_names_cannot_be_carried_by_any_request(triton):
    """Raw bytes, past every client library: the restriction header of the command line sent as it
    stands is refused over HTTP/1.1 (a field name ends at its first colon) and makes gRPC's HTTP/2
    parser reset the stream. The same raw clients reach the unrestricted APIs (so they work)."""
    closed = restrictions(cmdline(triton.process.pid))
    assert set(closed) == {"http", "grpc"} and all(":" in name for name, _ in closed.values()), closed
    http_header = [(closed["http"][0].encode(), closed["http"][1].encode())]
    for (method, path), grpc_method in RESTRICTED_CALLS.values():
        assert http_status(triton.http_url, method, path, http_header) == 403, path
        assert http_status(triton.http_url, method, path) == 403, path
        assert grpc_call(triton.grpc_url, grpc_method, [closed["grpc"]]) == "reset", grpc_method
        without = grpc_call(triton.grpc_url, grpc_method)
        assert without.startswith("status 14:") and "restricted" in without, (grpc_method, without)
    assert http_status(triton.http_url, "GET", "/v2/health/ready", http_header) == 200
    assert grpc_call(triton.grpc_url, "ServerReady").startswith("status 0")
    assert client_ready(triton)


def client_ready(server) -> bool:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        return client.is_model_ready("forward") and client.is_model_ready("sessions")
    finally:
        client.close()


def test_a_port_another_process_holds_is_named_before_anything_starts(tmp_path):
    import socket

    from serving.host.launcher import PortInUseError

    add_model(tmp_path, "echo")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PortInUseError) as raised:
            start_triton(tmp_path, grpc_port=port)
    message = str(raised.value)
    assert f"grpc port {port} on 127.0.0.1 is already in use" in message
    assert f"pid {os.getpid()}" in message and "--grpc-port" in message  # who holds it: this test
