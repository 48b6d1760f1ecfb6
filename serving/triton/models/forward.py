"""`forward`: the stateless model. A request carries the hidden states (a whole model's token ids), the
mask and the whole past; the answer is the output (a whole model's logits) and the presents
(docs/design.md, "Contracts"). Each request is checked on its own (shapes, dtypes, finite values, a
mask of 0 and 1, token ids within the vocabulary, past + new within max_seq_len, batch x new within
the repository's `max_request_tokens`) and a bad one gets its own INVALID_ARG answer naming
the input; execute() never raises. A request with the parameter `attention_maps` = true is answered
by the inspection graph on the CPU (serving/engine/runner.py `InspectionRunner`, opened at the first
such request): the output, the presents and each layer's attention weights `attention.{i}`."""

from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from contract import names
from contract.deployment import request_tokens
from contract.inputs import (
    check_finite,
    check_inputs,
    check_length,
    check_mask_values,
    check_positions,
    check_request_tokens,
    check_token_values,
)
from serving.engine.errors import InvalidRequest
from serving.triton import config as triton_config
from serving.triton import engines
from serving.triton.models import common


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.model = common.Loaded(args)
        self.runner = engines.stateless_runner(
            self.model.version, self.model.cfg, self.model.parameters, self.model.name
        )
        self.inspection = engines.inspection_runner(self.model.version, self.model.cfg, self.model.parameters)
        given = self.model.parameters.get(triton_config.P_MAX_REQUEST_TOKENS)
        self.max_request_tokens = request_tokens(self.model.cfg, int(given) if given else None)
        pb_utils.Logger.log_info(
            f"{self.model.name}: runner {self.runner.description}; at most {self.max_request_tokens} tokens a request"
        )

    def finalize(self) -> None:
        self.model.server_watch.stop()

    def execute(self, requests: list) -> list:
        return [self._answer(request) for request in requests]

    def _answer(self, request):
        try:
            arrays = common.request_arrays(request)
            batch, past, new = check_inputs(self.model.cfg, arrays, float_dtype="float32")
            check_length(self.model.cfg, past, new)
            check_positions(self.model.cfg, arrays)
            check_request_tokens(batch, new, self.max_request_tokens, name=names.model_input(self.model.cfg))
            check_finite(arrays)
            check_mask_values(arrays)
            check_token_values(self.model.cfg, arrays)
            runner = self.inspection if _asks_for_maps(request) else self.runner
            return common.response(runner.run_arrays(arrays))
        except Exception as error:  # answered, never raised: the server keeps serving
            return common.error_response(self.model.name, error)


def _asks_for_maps(request) -> bool:
    """Whether the request's parameter `attention_maps` is true (absent: false)."""
    asked = json.loads(request.parameters() or "{}").get(names.ATTENTION_MAPS, False)
    if not isinstance(asked, bool):
        raise InvalidRequest(f"parameter '{names.ATTENTION_MAPS}': expected true or false, got {asked!r}")
    return asked
