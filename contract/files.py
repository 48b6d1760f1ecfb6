"""The file names of an artifact directory and of a Triton model's version folder, and the checkout's
default places for them."""

from __future__ import annotations

import hashlib
from pathlib import Path

MODEL_CONFIG_FILENAME = "config.json"  # the ModelConfig an artifact was built from (contract/config.py)
WEIGHTS_FILENAME = "weights.safetensors"
REPORT_FILENAME = "report.json"  # per variant: parity, fused ops, target fit, the file's sha256 (export/build.py)
# a model version folder's files and their sha256 from the build's report, as `sha256sum -c` reads them
DIGESTS_FILENAME = "SHA256SUMS"


def model_filename(variant: str) -> str:
    """`model.<variant>.onnx`: one file per variant (fp32, fp32-fused, fp16-static, ...)."""
    return f"model.{variant}.onnx"


def sha256(path: str | Path) -> str:
    """The file's SHA-256 as hex."""
    with Path(path).open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


PROJECT_ROOT = Path(__file__).resolve().parent.parent  # the checkout (or the installed tree)
DEFAULT_REPOSITORY = PROJECT_ROOT / "model_repository"  # what `python -m serving` serves by default
DEFAULT_ARTIFACTS = PROJECT_ROOT / "build" / "artifacts"  # git-ignored; one folder per preset
