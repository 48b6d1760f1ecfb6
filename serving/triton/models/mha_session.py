"""`mha_session`: the stateful model under Triton's sequence batcher. A step carries the new tokens
of one sequence (`hidden_states` [1, T, d_model], a whole model's `input_ids` [1, T] answered by its
`logits` [1, T, vocab_size]; optional `attention_mask` [1, T]); the server keeps
each sequence's KV cache from START to END or eviction, in the engine the `engine` parameter names:
by default the static one (serving/engine/static_engine.py: one row of a KV pool per sequence, the
decode steps of one execute() in one graph run, new keys written in place), or `concat`
(serving/engine/concat/; what a model whose static graph could not be built gets). A request may ask
for a session operation instead of a step: those the engine offers (serving/triton/operations.py),
which the load line names. A step with the request parameter `last_only` true is answered its last
real position's output only (1, 1, width). Errors are answered per request; the answer carries
`held_length`, the positions the sequence holds after the step."""

from __future__ import annotations

import json
import os
import threading
from typing import ClassVar

import numpy as np
import triton_python_backend_utils as pb_utils

from contract import names
from serving.engine import factory
from serving.engine.settings import MAX_LIVE_SEQUENCES
from serving.engine.steps import StepRequest, Sweeper, no_result
from serving.triton import config as triton_config
from serving.triton import engines, operations
from serving.triton.models import common

START = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
END = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.model = common.Loaded(args)
        cfg, parameters = self.model.cfg, self.model.parameters
        max_batch = int(self.model.model_config["max_batch_size"])
        self.engine = engines.session_engine(self.model.version, cfg, parameters, max_batch, self.model.name)
        # a whole model's steps carry input_ids and answer logits; an attention model's hidden_states, output
        self.new_tokens, self.answer = names.model_input(cfg), names.model_output(cfg)
        idle = float(parameters[triton_config.P_IDLE_TIMEOUT])
        self.metrics = SessionGauges(self.model.name, self.engine.cache_kind)
        self.sweeper = Sweeper(self.engine, self._publish, interval=min(0.25, idle / 4))
        pb_utils.Logger.log_info(load_line(self.model.name, self.engine, idle))

    def execute(self, requests: list) -> list:
        parameters = [json.loads(request.parameters() or "{}") for request in requests]  # read once each
        steps = [_step_request(request, self.new_tokens, p) for request, p in zip(requests, parameters, strict=True)]
        asked = {i: _operation(request, p) for i, (request, p) in enumerate(zip(requests, parameters, strict=True))}
        answers: list = [None] * len(requests)
        for i, operation in asked.items():  # before the steps: a fork copies the state they start from
            if operation is not None:
                answers[i] = self._operate(steps[i], operation)
        plain = [i for i, operation in asked.items() if operation is None]
        for i, result in zip(plain, self.engine.execute([steps[i] for i in plain]), strict=True):
            answers[i] = (
                common.error_response(self.model.name, result)
                if isinstance(result, Exception)
                else common.response({self.answer: result, names.HELD_LENGTH: self._held(steps[i].sequence_id)})
            )
        self._publish(every_value=False)
        return answers

    def _held(self, sequence_id) -> np.ndarray:
        return np.array([[self.engine.length(sequence_id)]], np.int64)

    def _operate(self, step: StepRequest, operation: dict):
        """A session operation (names.OPERATIONS) on the request's sequence: its answer, or its error."""
        try:
            answered = operations.run(self.engine, step, operation)
        except Exception as error:  # the request's own answer; the others go on
            return common.error_response(self.model.name, error)
        outputs = {
            self.answer: no_result(self.model.cfg),
            names.HELD_LENGTH: self._held(step.sequence_id),
        }
        return common.response(outputs | answered)

    def _publish(self, every_value: bool = True) -> None:
        """Gauges to Triton. After a request only what START and END change (each update is a round
        trip to the Triton process); the sweeper publishes the per-step byte count 4 times a second.
        What a request asks is one count (`engine.sequences()`), whatever the engine holds: the rest is
        read only when that count changed."""
        if not every_value and not self.metrics.changed("sequences", self.engine.sequences()):
            self.metrics.publish({"largest_batch": self.engine.largest_batch})
            return
        stats = self.engine.stats()
        values = {
            "sequences": stats.sequences,
            "held_bytes": stats.held_bytes,
            "reserved_bytes": stats.reserved_bytes,
            "allocated_bytes": stats.allocated_bytes,
            "budget_bytes": stats.budget_bytes,
            "evictions": stats.evictions,
            "largest_batch": self.engine.largest_batch,
        }
        self.metrics.publish(values)

    def finalize(self) -> None:
        self.sweeper.stop()
        self.model.server_watch.stop()


def load_line(model_name: str, engine: factory.SessionEngines, idle: float) -> str:
    """What the model says once loaded, parts split by "; " (serving/host/launcher.py's `serving_lines`
    prints each on a line of the console): the engine and where it runs, what its KV budget holds, the
    session operations it offers, the idle timeout."""
    budget_mib = engine.stats().budget_bytes / (1 << 20)
    holds = (
        f"KV cache budget {budget_mib:.0f} MiB = {_capped(engine.full_length_capacity)} sequences of up to "
        f"{engine.cfg.max_seq_len} positions ({engine.cache_kind})"
    )
    if engine.capacity != engine.full_length_capacity:  # rows sized to the session
        holds += f", {_capped(engine.capacity)} shorter ones at once"
    return (
        f"{model_name}: runner {factory.describe(engine)}; {holds}; "
        f"session operations: {operations.offered(engine)}; idle timeout {idle:g} s"
    )


def _capped(sequences: int) -> str:
    """The count, said to be the cap where it is MAX_LIVE_SEQUENCES (the budget would hold more)."""
    if sequences != MAX_LIVE_SEQUENCES:
        return str(sequences)
    return f"{sequences} (a hard cap on live sequences, whatever the budget)"


def _operation(request, parameters: dict) -> dict | None:
    """The request's parameters when they ask for a session operation, else None."""
    if names.OPERATION not in parameters:
        return None
    snapshot = pb_utils.get_input_tensor_by_name(request, names.SNAPSHOT)
    return {**parameters, names.SNAPSHOT: None if snapshot is None else snapshot.as_numpy()}


def _step_request(request, new_tokens: str, parameters: dict) -> StepRequest:
    """The request as the engine takes it; its `last_only` parameter as sent (the engine's check_step
    refuses a value that is not a bool as that request's own INVALID_ARG)."""
    hidden = pb_utils.get_input_tensor_by_name(request, new_tokens)
    mask = pb_utils.get_input_tensor_by_name(request, names.ATTENTION_MASK)
    flags = request.flags()
    return StepRequest(
        sequence_id=request.correlation_id(),
        start=bool(flags & START),
        end=bool(flags & END),
        hidden=None if hidden is None else hidden.as_numpy(),
        mask=None if mask is None else mask.as_numpy(),
        last_only=parameters.get(names.LAST_ONLY, False),
    )


class SessionGauges:
    """The cache store and the batching on Triton's metrics endpoint (label model=<name>).

    Triton's own nv_inference_exec_count against nv_inference_request_success shows how many
    requests an execute() took; `largest_batch` shows that steps really shared a graph run. Each
    update is a round trip to the Triton process (40 to 200 us), so only changed values are sent.
    """

    GAUGES: ClassVar[dict[str, tuple[str, str]]] = {
        "sequences": ("attention_kv_cache_sequences", "Sequences holding a KV cache"),
        "held_bytes": ("attention_kv_cache_bytes", "Bytes the KV caches hold"),
        "reserved_bytes": ("attention_kv_cache_reserved_bytes", "Bytes of the budget reserved by live sequences"),
        "allocated_bytes": ("attention_kv_cache_allocated_bytes", "Bytes of the budget taken by the open row slabs"),
        "budget_bytes": ("attention_kv_cache_budget_bytes", "The KV cache budget in bytes"),
        "evictions": ("attention_kv_cache_evictions", "Sequences evicted for idleness so far"),
        "largest_batch": ("attention_session_largest_batch", "Most sequence steps in one graph run so far"),
    }

    def __init__(self, model_name: str, cache_kind: str) -> None:
        self._families, self._metrics = [], {}
        self._sent: dict[str, float] = {}
        self._lock = threading.Lock()  # execute() and the sweeper both publish
        self._server = os.getppid()  # the tritonserver whose stub this is
        for key, (name, description) in self.GAUGES.items():
            family = pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.GAUGE)
            self._families.append(family)  # a family must outlive its metrics
            self._metrics[key] = family.Metric(labels={"model": model_name, "kv_dtype": cache_kind})

    def changed(self, key: str, value: float) -> bool:
        return self._sent.get(key) != value

    def publish(self, values: dict[str, float]) -> None:
        with self._lock:
            for key, value in values.items():
                if os.getppid() != self._server:
                    # the server is gone: an update would wait for its answer forever, holding the GIL
                    # the stub needs to exit (docs/reliability.md, "No orphans")
                    return
                if self._sent.get(key) != value:
                    self._metrics[key].set(value)
                    self._sent[key] = value
