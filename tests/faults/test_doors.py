"""Small doors in the host (issue 34, item 7): the gateway's secrets reach no process that does not
check keys (tritonserver, its stubs, Envoy); the session store's folders are the owner's alone; and
Envoy's admin API, which can stop Envoy, is on a 0600 unix socket, never on a TCP port."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import pytest
import yaml

from client.store import DirectoryStore, StoreKey
from serving.host.envoy.config import DnsName, bootstrap
from serving.host.envoy.process import start_envoy
from serving.host.launcher import start_triton
from serving.host.process import group_members

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# every secret the gateway's settings hold (serving/gateway/settings.py), and a store URL with a password
SECRETS = {
    "SERVING_API_KEYS": "door-test-key-1,door-test-key-2",
    "SERVING_API_KEYS_FILE": "/run/secrets/door-test-keys",
    "SERVING_SESSION_SECRET": "door-test-session-secret",
    "SERVING_SESSION_STORE": "redis://:door-test-password@127.0.0.1:6379/0",
    "SERVING_INTEGRITY_SECRETS": "door-test-integrity-new,door-test-integrity-old",
}


@pytest.fixture(scope="module")
def secrets_in_environment():
    """The secrets in this process's environment while the module's servers start, as a gateway
    started by `python -m serving` has them."""
    before = {name: os.environ.get(name) for name in SECRETS}
    os.environ.update(SECRETS)
    try:
        yield SECRETS
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def environment_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)


def leaked(pid: int, secrets: dict[str, str]) -> list[str]:
    """The secrets' names or values found in a process's environment."""
    environment = environment_of(pid)
    text = "\0".join(f"{name}={value}" for name, value in environment.items())
    return sorted({name for name, value in secrets.items() if name in environment or value in text})


# --- the secrets stay with the gateway --------------------------------------------------------------


def test_tritonserver_and_its_stubs_hold_none_of_the_gateways_secrets(secrets_in_environment, tiny_repository):
    with start_triton(tiny_repository) as server:
        members = group_members(server.process.pid)
        stubs = [pid for pid in members if b"triton_python_backend_stub" in _command(pid)]
        assert stubs, f"no Python stub among tritonserver's group {members}: nothing to check"
        for pid in [server.process.pid, *stubs]:
            assert leaked(pid, secrets_in_environment) == [], f"{_command(pid)[:80]!r} holds the gateway's secrets"
        assert "PATH" in environment_of(server.process.pid), "the scrubbed environment lost what Triton needs"


def _command(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


# --- Envoy: no secrets, and its admin API on a private socket -----------------------------------------


@pytest.fixture(scope="module")
def envoy(secrets_in_environment):
    with start_envoy([]) as running:
        yield running


def test_envoy_holds_none_of_the_gateways_secrets(envoy, secrets_in_environment):
    assert leaked(envoy.process.pid, secrets_in_environment) == []


def test_envoy_listens_on_its_two_listeners_alone_and_its_admin_api_on_a_0600_unix_socket(envoy):
    assert listening_tcp_ports(envoy.process.pid) == {envoy.http_port, envoy.grpc_port}
    mode = os.stat(envoy.admin_socket).st_mode
    assert stat.S_ISSOCK(mode), f"{envoy.admin_socket} is not a socket"
    assert stat.S_IMODE(mode) == 0o600, f"admin socket mode {oct(stat.S_IMODE(mode))}, expected 0o600"
    assert envoy.hosts("triton_grpc") == {}, "the admin API does not answer on its socket"


def listening_tcp_ports(pid: int) -> set[int]:
    """The TCP ports a process listens on: its socket inodes matched against the kernel's tables."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            listening = fields[3] == "0A"
            if listening and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_no_rendered_envoy_config_opens_the_admin_api_on_tcp():
    generated = yaml.safe_load((PROJECT_ROOT / "deploy" / "kubernetes" / "envoy.yaml").read_text())
    rendered = bootstrap(DnsName("triton.example"))
    for config in (generated, rendered):
        admin = config.get("admin", {}).get("address", {})
        assert "socket_address" not in admin, f"the admin API on TCP: {admin}"


# --- the session store ---------------------------------------------------------------------------------


def test_every_folder_of_the_session_store_is_its_owners_alone(tmp_path):
    root = tmp_path / "store"
    umask = os.umask(0o022)  # the common default, which leaves folders made without a mode readable by all
    try:
        store = DirectoryStore(root)
        store.append(StoreKey("caller-key-fingerprint", "session-1"), 0, 4, b"cache")
        store.end(StoreKey("another-caller", "session-2"))
    finally:
        os.umask(umask)
    folders = [root, *(path for path in root.rglob("*") if path.is_dir())]
    assert len(folders) == 5, f"expected the root, two owners and two sessions, got {folders}"
    opened = {str(f.relative_to(tmp_path)): oct(stat.S_IMODE(f.stat().st_mode)) for f in folders}
    assert all(mode == "0o700" for mode in opened.values()), f"folders not 0700: {opened}"
