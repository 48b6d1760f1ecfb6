"""The HTTP wire made once per call (client/_wire.py): inputs described and encoded once, answers read in one pass;
tritonclient's own InferInput, request builder and InferResult are the oracle."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from tritonclient import http
from tritonclient.http import InferInput, InferResult
from tritonclient.http._utils import _get_inference_request

from client import _wire
from tests.client.test_wire_grpc import ARRAYS, their_inputs


def _request(inputs: list) -> tuple[bytes, int | None]:
    options = {"sequence_id": 7, "sequence_start": True, "sequence_end": False, "priority": 0, "timeout": None}
    return _get_inference_request(inputs=inputs, request_id="", outputs=None, custom_parameters=None, **options)


def test_inputs_made_once_build_the_request_tritonclients_inputs_build():
    assert _request(_wire.make_inputs(http, ARRAYS)) == _request(their_inputs(InferInput))


def answer(arrays: dict[str, np.ndarray], binary: bool = True) -> tuple[bytes, int]:
    """A Triton answer holding `arrays` as outputs, binary after its JSON (or in it), as Triton writes one."""
    outputs, contents = [], []
    for name, array in arrays.items():
        sent = _wire.HttpInput.of(name, array)
        output = {"name": name, "datatype": sent.tensor["datatype"], "shape": list(array.shape)}
        if binary:
            output["parameters"] = {"binary_data_size": len(sent.content)}
            contents.append(sent.content)
        else:
            output["data"] = array.ravel().tolist()
        outputs.append(output)
    header = json.dumps({"model_name": "m", "model_version": "1", "outputs": outputs}).encode()
    return header + b"".join(contents), len(header)


def test_an_answer_read_once_holds_what_tritonclient_reads_per_name():
    body, length = answer(ARRAYS)
    theirs, ours = InferResult.from_response_body(body, False, length), _wire.HttpResult.of(body, length)
    assert isinstance(ours, _wire.HttpResult)
    for name in ARRAYS:
        expected, found = theirs.as_numpy(name), ours.as_numpy(name)
        assert found.dtype == expected.dtype and found.shape == expected.shape, name
        assert np.array_equal(found, expected), name
        assert ours.get_output(name) == theirs.get_output(name), name
    assert ours.as_numpy("absent") is None and theirs.as_numpy("absent") is None
    assert ours.get_response() == theirs.get_response()


@pytest.mark.parametrize("form", ["outputs-in-json", "compressed", "bf16"])
def test_an_answer_not_all_binary_is_read_by_tritonclient(form):
    arrays = {"hidden_states": ARRAYS["hidden_states"]}
    body, length, encoding = *answer(arrays, binary=form != "outputs-in-json"), None
    if form == "outputs-in-json":
        length = None
    elif form == "compressed":
        body, encoding = gzip.compress(body), "gzip"
    else:
        header = json.loads(body[:length])
        header["outputs"][0]["datatype"] = "BF16"
        header["outputs"][0]["parameters"]["binary_data_size"] = 24
        text = json.dumps(header).encode()
        body, length = text + np.zeros(12, np.uint16).tobytes(), len(text)
    read = _wire.HttpResult.of(body, length, encoding)
    assert isinstance(read, InferResult)  # tritonclient's own reading of what this one does not read
    if form != "bf16":
        np.testing.assert_array_equal(read.as_numpy("hidden_states"), arrays["hidden_states"])
