"""What every Python-backend model shares: its config, its parameters, its error answers, and a stub
that ends with its server."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from contract import errors as kinds
from contract.config import ModelConfig
from contract.inputs import InputError
from serving.engine.errors import ServingError
from serving.triton.watchdog import ParentWatchdog


class Loaded:
    """A model instance's name, Triton config, parameters, version folder and ModelConfig, and the
    watcher that ends its stub once its server is gone (`server_watch`)."""

    def __init__(self, args: dict) -> None:
        # first: a stub whose server dies while it loads or serves can be held forever by a call that
        # waits for the dead server's answer (docs/reliability.md, "No orphans"), whatever the model
        self.server_watch = ParentWatchdog()
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
    if not isinstance(error, ServingError | InputError):
        trace = "".join(traceback.format_exception(error))
        pb_utils.Logger.log_error(f"{model_name}: unexpected error: {trace}")
    return pb_utils.InferenceResponse(error=triton_error(error))


def triton_error(error: Exception):
    """The `pb_utils.TritonError` for `error`: its own code and kind for ours, INTERNAL for anything else."""
    if isinstance(error, ServingError):
        message = kinds.tag(error.kind, str(error)) if error.kind else str(error)
        return pb_utils.TritonError(message, getattr(pb_utils.TritonError, error.code))
    if isinstance(error, InputError):  # names the input, the expected and the actual value
        return pb_utils.TritonError(kinds.tag(kinds.INVALID_INPUT, str(error)), pb_utils.TritonError.INVALID_ARG)
    return pb_utils.TritonError(f"internal error: {type(error).__name__}: {error}", pb_utils.TritonError.INTERNAL)


def response(outputs: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse([pb_utils.Tensor(name, array) for name, array in outputs.items()])
