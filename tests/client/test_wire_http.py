"""The HTTP wire made once per call (client/_wire.py): inputs described and encoded once; tritonclient's own
InferInput and request builder are the oracle."""

from __future__ import annotations

from tritonclient import http
from tritonclient.http import InferInput
from tritonclient.http._utils import _get_inference_request

from client import _wire
from tests.client.test_wire_grpc import ARRAYS, their_inputs


def _request(inputs: list) -> tuple[bytes, int | None]:
    options = {"sequence_id": 7, "sequence_start": True, "sequence_end": False, "priority": 0, "timeout": None}
    return _get_inference_request(inputs=inputs, request_id="", outputs=None, custom_parameters=None, **options)


def test_inputs_made_once_build_the_request_tritonclients_inputs_build():
    assert _request(_wire.make_inputs(http, ARRAYS)) == _request(their_inputs(InferInput))
