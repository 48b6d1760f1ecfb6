"""Small tritonclient helpers shared by the serving tests (not our client library: these tests
check the server through Triton's own client)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

from client import affinity
from contract import names
from serving.triton import config as triton_config

PROTOCOLS = {"http": httpclient, "grpc": grpcclient}
# the session model is decoupled: Triton takes its requests on gRPC streams only (client/affinity.py)
SESSION_PROTOCOLS = ["grpc"]
_ids = itertools.count(random.randrange(1 << 40, 1 << 41))  # apart from other tests' sequence ids


def new_sequence_id() -> int:
    return next(_ids)


class Client:
    """One protocol's tritonclient, for `forward` calls and `sessions` steps (gRPC: each a stream of one request,
    tritonclient's request and answer); close() it (Triton waits for open connections when it shuts down)."""

    def __init__(self, server, protocol: str) -> None:
        self.module = PROTOCOLS[protocol]
        self.client = self.module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)

    def infer(self, model: str, arrays: dict[str, np.ndarray], **sequence) -> dict[str, np.ndarray]:
        inputs = []
        for name, array in arrays.items():
            tensor = self.module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(np.ascontiguousarray(array))
            inputs.append(tensor)
        if model == names.SESSION_MODEL:
            result, _ = affinity.infer(self.client, model, inputs, headers={}, **sequence)
        else:
            result = self.client.infer(model, inputs, **sequence)
        response = result.get_response()
        if isinstance(response, dict):  # HTTP
            outputs = [output["name"] for output in response["outputs"]]
        else:
            outputs = [output.name for output in response.outputs]
        return {name: result.as_numpy(name) for name in outputs}

    def step(self, sequence_id, hidden: np.ndarray, mask=None, start=False, end=False) -> np.ndarray:
        arrays = {names.HIDDEN_STATES: hidden}
        if mask is not None:
            arrays[names.ATTENTION_MASK] = mask
        sequence = {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}
        return self.infer("sessions", arrays, **sequence)[names.OUTPUT]

    def end(self, sequence_id, d_model: int) -> np.ndarray:
        """END with no new tokens: how a client ends a session without computing."""
        return self.step(sequence_id, np.zeros((1, 0, d_model), np.float32), end=True)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def change_one_weight(path, by: float = 1e-3) -> None:
    """Move one value of the graph's first float initializer by `by`: a file changed after its build
    that still loads and serves, a little off (what the digests must catch)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    initializer = next(i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and i.dims)
    values = numpy_helper.to_array(initializer).copy()
    values.flat[0] += by
    initializer.CopyFrom(numpy_helper.from_array(values, initializer.name))
    onnx.save(model, str(path))


LEGACY = {current: legacy for legacy, current in names.LEGACY_MODEL_NAMES.items()}


def as_written_before(repository, prefix: str = "") -> None:
    """`repository`'s models as a repository written before the rename holds them: folders, config names and
    the implementations they load under the legacy names."""
    for current, legacy in LEGACY.items():
        folder = repository / f"{prefix}{current}"
        if not folder.is_dir():
            continue
        config_path = folder / triton_config.TRITON_CONFIG_FILENAME
        config = triton_config.parse(config_path.read_text())
        config.name = f"{prefix}{legacy}"
        if triton_config.P_IMPLEMENTATION in config.parameters:
            implementation = config.parameters[triton_config.P_IMPLEMENTATION]
            implementation.string_value = implementation.string_value.rpartition(".")[0] + f".{legacy}"
        config_path.write_text(triton_config.to_text(config))
        folder.rename(repository / f"{prefix}{legacy}")
