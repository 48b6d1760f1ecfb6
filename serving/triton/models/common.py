"""What both Python-backend models share: their config, their runner, their error answers."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from contract.config import ModelConfig
from serving import errors


class Loaded:
    """A model instance's name, Triton config, parameters, version folder and ModelConfig."""

    def __init__(self, args: dict) -> None:
        self.name = args["model_name"]
        self.model_config = json.loads(args["model_config"])
        self.parameters = {key: value["string_value"] for key, value in self.model_config["parameters"].items()}
        self.version = _version_dir(args)
        self.cfg = ModelConfig.load(self.version)


def _version_dir(args: dict) -> Path:
    """args["model_repository"] is the model's folder; the version folder holds its files."""
    model_dir = Path(args["model_repository"])
    version = model_dir / str(args["model_version"])
    return version if version.is_dir() else model_dir


def request_arrays(request) -> dict[str, np.ndarray]:
    """The inputs a request carries, by name (zero-copy views of Triton's shared memory)."""
    return {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}


def error_response(model_name: str, error: Exception):
    """One request's error answer; an unexpected error is logged with its traceback too."""
    if not isinstance(error, errors.ServingError | errors.InputError):
        trace = "".join(traceback.format_exception(error))
        pb_utils.Logger.log_error(f"{model_name}: unexpected error: {trace}")
    return pb_utils.InferenceResponse(error=errors.triton_error(error, pb_utils))


def response(outputs: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse([pb_utils.Tensor(name, array) for name, array in outputs.items()])
