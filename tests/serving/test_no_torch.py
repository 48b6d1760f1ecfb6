"""`python -m serving`, the gateway, the supervisor and the Triton models run where torch, onnxscript
and onnx_ir cannot be imported at all (the Triton and gateway images have none of them)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A fresh interpreter with the export's heavy packages made unimportable: the serving side's modules
# import, its CLI parses every command, a complete repository reads as complete, the gateway app is
# built, and nothing of torch or onnxscript got loaded on the way.
SCRIPT = textwrap.dedent(
    """
    import sys
    BLOCKED = {"torch", "onnxscript", "onnx_ir"}  # safetensors is the serving side's too: a snapshot is one

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked in this test")

    sys.meta_path.insert(0, Blocker())

    from serving import __main__ as serving_cli
    import serving.engine.factory, serving.engine.concat, serving.engine.static_engine
    import serving.host.launcher, serving.host.supervisor, serving.host.fleet
    from serving.gateway import create_app, Settings
    from serving.triton import config, engines, repository
    for argv in ([], ["--no-gateway"], ["repository", "--artifacts", "a", "--repository", "r"],
                 ["ensure", "--repository", "r", "--preset", "tiny"]):
        serving_cli.parser().parse_args(argv)
    assert repository.is_complete(sys.argv[1])
    create_app(Settings())
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("ok")
    """
)


def test_the_serving_side_imports_and_runs_without_torch(triton_repository):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(triton_repository)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("ok")
