"""The file names of an artifact directory and of a Triton model's version folder."""

from __future__ import annotations

MODEL_CONFIG_FILENAME = "config.json"  # the ModelConfig an artifact was built from (contract/config.py)
WEIGHTS_FILENAME = "weights.safetensors"
REPORT_FILENAME = "report.json"  # per variant: parity, fused ops, target fit (export/build.py)


def model_filename(variant: str) -> str:
    """`model.<variant>.onnx`: one file per variant (fp32, fp32-fused, fp16-static, ...)."""
    return f"model.{variant}.onnx"
