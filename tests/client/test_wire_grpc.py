"""The gRPC wire made once per call (client/_wire.py): inputs described and encoded once, answers read in one pass;
tritonclient's own InferInput and InferResult are the oracle."""

from __future__ import annotations

import numpy as np
import tritonclient.grpc.aio as grpc_aio
from tritonclient.grpc import InferInput, InferResult, service_pb2
from tritonclient.grpc._utils import _get_inference_request

from client import _wire

ARRAYS = {
    "hidden_states": np.arange(12, dtype=np.float32).reshape(1, 3, 4),
    "attention_mask": np.array([[1, 1, 0]], dtype=np.int64),
    "half": np.linspace(-1, 1, 6, dtype=np.float16).reshape(2, 3),
    "flags": np.array([True, False]),
    "blob": np.array([[b"snapshot bytes"]], dtype=np.object_),
    "empty": np.zeros((1, 0, 4), np.float32),
}


def _request(inputs: list) -> bytes:
    options = {"sequence_id": 7, "sequence_start": True, "sequence_end": False, "priority": 0, "timeout": None}
    request = _get_inference_request("m", inputs, "", "", None, parameters=None, **options)
    return request.SerializeToString(deterministic=True)


def their_inputs(infer_input: type) -> list:
    """ARRAYS as tritonclient's own InferInputs (`infer_input`: the gRPC or the HTTP class) describe them."""
    theirs = []
    for name, array in ARRAYS.items():
        datatype = "BYTES" if array.dtype == object else _wire.TRITON_DTYPES[array.dtype]
        theirs.append(infer_input(name, list(array.shape), datatype))
        theirs[-1].set_data_from_numpy(array)
    return theirs


def test_inputs_made_once_build_the_request_tritonclients_inputs_build():
    assert _request(_wire.make_inputs(grpc_aio, ARRAYS)) == _request(their_inputs(InferInput))


def test_an_answer_read_once_holds_what_tritonclient_reads_per_name():
    response = service_pb2.ModelInferResponse()
    for name, array in ARRAYS.items():
        output = response.outputs.add(name=name, shape=array.shape)
        sent = _wire.GrpcInput.of(name, array)
        output.datatype = sent.tensor.datatype
        response.raw_output_contents.append(sent.content)
    theirs, ours = InferResult(response), _wire.decoded(InferResult(response))
    for name in ARRAYS:
        expected = theirs.as_numpy(name)
        found = ours.as_numpy(name)
        assert found.dtype == expected.dtype and found.shape == expected.shape, name
        assert np.array_equal(found, expected), name
    assert ours.as_numpy("absent") is None and theirs.as_numpy("absent") is None
