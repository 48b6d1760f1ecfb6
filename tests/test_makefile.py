"""The Makefile's install: ONNX Runtime's GPU build where an NVIDIA GPU answers `nvidia-smi -L`, the CPU
build elsewhere, `ORT=` to choose, never both (read from `make -n`: what it would run, run by nothing)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent


def planned_install(
    tmp_path: Path, *args: str, gpu_answers: bool | None = None, target: str = "install"
) -> subprocess.CompletedProcess:
    """`make -n -B TARGET` with a PATH whose only `nvidia-smi` (if any) answers as a GPU host's does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpu_answers is not None:  # the driver's tool: lists the GPUs, or fails where the driver has none
        tool = bin_dir / "nvidia-smi"
        said = 'echo "GPU 0: NVIDIA H100 80GB HBM3"; exit 0' if gpu_answers else "echo 'No devices were found'; exit 6"
        tool.write_text(f"#!/bin/sh\n{said}\n")
        tool.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), *(p for p in os.environ["PATH"].split(os.pathsep) if not _has_smi(p))])
    env = {**os.environ, "PATH": path}
    env.pop("ORT", None)
    return subprocess.run(
        ["make", "-n", "-B", target, *args], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )


def _has_smi(folder: str) -> bool:
    return (Path(folder) / "nvidia-smi").exists()


def install_lines(plan: str) -> list[str]:
    return [line for line in plan.splitlines() if "pip install" in line and " -e " in line]


@pytest.mark.parametrize(
    ("gpu_answers", "args", "build", "removed"),
    [
        (None, (), "cpu", "onnxruntime-gpu"),  # no driver tool at all
        (False, (), "cpu", "onnxruntime-gpu"),  # the tool, but no device
        (True, (), "gpu", "onnxruntime"),
        (True, ("ORT=cpu",), "cpu", "onnxruntime-gpu"),  # the user's choice wins
        (None, ("ORT=gpu",), "gpu", "onnxruntime"),
    ],
)
def test_the_onnxruntime_build_follows_the_gpu_and_the_other_is_removed(tmp_path, gpu_answers, args, build, removed):
    planned = planned_install(tmp_path, *args, gpu_answers=gpu_answers)
    assert planned.returncode == 0, planned.stderr
    runtime, everything = install_lines(planned.stdout)
    assert runtime.endswith(f'-e ".[export,serving,{build}]"'), planned.stdout
    assert everything.endswith(f'-e ".[export,serving,dev,{build}]"'), planned.stdout
    assert f"pip uninstall --yes --quiet {removed} " in planned.stdout
    assert f"ONNX Runtime's {build} build" in planned.stdout  # said before pip's progress starts
    assert "--quiet -e" not in planned.stdout  # the long install shows its progress


def test_an_unknown_build_is_refused_naming_the_choices(tmp_path):
    planned = planned_install(tmp_path, "ORT=rocm")
    assert planned.returncode != 0
    assert "ORT must be cpu or gpu, got 'rocm'" in planned.stderr


def test_serve_installs_the_runtime_only(tmp_path):
    """`make serve` installs what serving needs, not the test tooling (pytest, the clients, chromium)."""
    planned = planned_install(tmp_path, target="serve")
    assert planned.returncode == 0, planned.stderr
    (runtime,) = install_lines(planned.stdout)
    assert runtime.endswith('-e ".[export,serving,cpu]"') and "apt-get" not in planned.stdout
    assert "-m serving" in planned.stdout
