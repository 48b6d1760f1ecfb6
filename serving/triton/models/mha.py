"""`mha`: the stateless model. A request carries the hidden states, the mask and the whole past;
the answer is the output and the presents (DESIGN.md 3.2). Each request is checked on its own and a
bad one gets its own INVALID_ARG answer naming the input; execute() never raises."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from contract.inputs import check_inputs
from serving import engines
from serving.triton.models import common


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.model = common.Loaded(args)
        self.runner = engines.stateless_runner(
            self.model.version, self.model.cfg, self.model.parameters, self.model.name
        )
        pb_utils.Logger.log_info(f"{self.model.name}: runner {self.runner.description}")

    def execute(self, requests: list) -> list:
        return [self._answer(request) for request in requests]

    def _answer(self, request):
        try:
            arrays = common.request_arrays(request)
            check_inputs(self.model.cfg, arrays, float_dtype="float32")
            return common.response(self.runner.run_arrays(arrays))
        except Exception as error:  # answered, never raised: the server keeps serving
            return common.error_response(self.model.name, error)
