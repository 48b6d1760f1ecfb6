"""`sessions`: the session model, decoupled. Its `execute()` only reads each request into one of the engine
core's (serving/engine/core.py) and hands it over; the core's loop owns the batch and answers every request
from its own thread, through a sender thread of this model's (a response's trip to Triton overlaps the next
graph run). Triton's sequence batcher (oldest strategy) routes a session's requests to this instance and keeps
its slot until END; the core keeps each session's requests in order, and its engine (static or concat, the
`engine` parameter) knows which sessions live.

What a request is, by its parameters (contract/names.py, contract/generation.py):

- `text_files`: the tokenizer files this model serves with (answered here, at once);
- `stop_generation`: stop the session's generation before its next token;
- `generate`: a generation in the session (its correlation id): `input_ids` [1, T] (none: go on from what it
  holds), the generation's parameters; one response per token, then a final one;
- `session_operation`: a session operation (snapshot, restore, fork, rewind, prefixes, attention maps);
- otherwise a step: the new tokens (`hidden_states` [1, T, d_model], a whole model's `input_ids` [1, T]),
  an optional `attention_mask` [1, T], the START and END flags; answered `output` (a whole model's `logits`)
  and `held_length`, the positions the session holds after it.

Every request gets exactly one final response (an error names its kind, contract/errors.py). Decoupled models
take only streams: gRPC's ModelStreamInfer (Triton 2.51 answers a unary call to one "doesn't support models
with decoupled transaction policy"), which the client library uses for every session request.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
from typing import ClassVar

import numpy as np
import triton_python_backend_utils as pb_utils

from contract import generation, names
from contract.files import TEXT_FILES, TOKENIZER_FILENAME
from contract.inputs import InputError, check_token_values
from serving.engine import core, factory
from serving.engine.constraint import Grammars
from serving.engine.errors import InvalidRequest, ServingError
from serving.engine.settings import MAX_LIVE_SEQUENCES
from serving.engine.steps import StepRequest
from serving.triton import config as triton_config
from serving.triton import digests, engines
from serving.triton.models import common

START = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
END = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.model = common.Loaded(args)
        cfg, parameters = self.model.cfg, self.model.parameters
        settings = engines.session_settings(parameters)
        self.engine = engines.session_engine(self.model.version, cfg, parameters, self.model.name)
        self.new_tokens = names.model_input(cfg)
        self.sender = Sender(self.model.name, SessionGauges(self.model.name, self.engine.cache_kind))
        self.core = core.EngineCore(self.engine, engines.core_settings(settings), publish=self._published)
        self.text_files = _text_files(self.model.version, parameters.get(triton_config.P_TEXT_DIGEST))
        self.grammars = Grammars(self.text_files.get(TOKENIZER_FILENAME), cfg.vocab_size) if cfg.whole else None
        self.core.start()
        pb_utils.Logger.log_info(load_line(self.model.name, self.engine, settings, self.text_files))

    def finalize(self) -> None:
        self.core.stop()
        self.sender.stop()
        self.model.server_watch.stop()

    def execute(self, requests: list) -> None:
        for request in requests:
            responder = Responder(request, self.sender)
            try:
                handed = self._read(request, responder)
            except (InputError, ServingError) as error:  # a request the core never sees: answered here
                responder.finish(error=error)
                continue
            if handed is not None:
                self.core.submit(handed)

    def _published(self, stats: core.CoreStats) -> None:
        """The core's gauges and the engine's cache gauges, sent by the sender thread (each is a round trip to
        Triton)."""
        self.sender.gauges_changed(stats, self.engine.stats())

    # --- a request, read ---------------------------------------------------------------------------------

    def _read(self, request, responder: Responder) -> core.Request | None:
        parameters = json.loads(request.parameters() or "{}")
        sid, owner = request.correlation_id(), _owner(parameters)
        if generation.TEXT_FILES in parameters:
            responder.finish(self._text_file_outputs())
            return None
        if generation.STOP_GENERATION in parameters:
            return core.Stop(sid, responder)
        if parameters.get(generation.GENERATE):
            return self._generation(request, responder, parameters, owner)
        step = self._step(request, parameters)
        if names.OPERATION in parameters:
            snapshot = pb_utils.get_input_tensor_by_name(request, names.SNAPSHOT)
            parameters[names.SNAPSHOT] = None if snapshot is None else snapshot.as_numpy()
            return core.Operate(sid, responder, owner, step=step, parameters=parameters)
        return core.Step(sid, responder, owner, step=step)

    def _step(self, request, parameters: dict) -> StepRequest:
        """The request as the engine takes a step; its `last_only` as sent (the engine's check refuses a value
        that is not a bool as that request's own error)."""
        tokens = pb_utils.get_input_tensor_by_name(request, self.new_tokens)
        mask = pb_utils.get_input_tensor_by_name(request, names.ATTENTION_MASK)
        flags = request.flags()
        return StepRequest(
            sequence_id=request.correlation_id(),
            start=bool(flags & START),
            end=bool(flags & END),
            hidden=None if tokens is None else tokens.as_numpy(),
            mask=None if mask is None else mask.as_numpy(),
            last_only=parameters.get(names.LAST_ONLY, False),
        )

    def _generation(self, request, responder: Responder, parameters: dict, owner: str) -> core.Generate:
        cfg = self.model.cfg
        if not cfg.whole:
            raise InvalidRequest(
                f"'{self.model.name}' is an attention model (hidden states in and out): only a whole model "
                "(token ids in, logits out) generates"
            )
        asked = generation.GenerationRequest.from_parameters(parameters)
        asked.check(cfg.vocab_size, cfg.max_seq_len)
        tensor = pb_utils.get_input_tensor_by_name(request, names.INPUT_IDS)
        ids = np.zeros((1, 0), np.int64) if tensor is None else tensor.as_numpy()
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise InputError(names.INPUT_IDS, f"expected shape [1, T], got {list(ids.shape)}")
        check_token_values(cfg, {names.INPUT_IDS: ids})
        priority = parameters.get(generation.PRIORITY, 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InputError(generation.PRIORITY, f"expected an integer, got {priority!r}")
        prompt = ids[0].astype(np.int64)
        constraint = None if asked.grammar is None else self.grammars.compile(asked.grammar, asked.stop_token_ids)
        return core.Generate(
            request.correlation_id(), responder, owner, priority, prompt=prompt, asked=asked, constraint=constraint
        )

    def _text_file_outputs(self) -> dict[str, np.ndarray]:
        names_, contents = list(self.text_files), list(self.text_files.values())
        return {
            generation.TEXT_FILE_NAMES: np.array([name.encode() for name in names_], np.object_),
            generation.TEXT_FILE_CONTENTS: np.array(contents, np.object_),
        }


def _owner(parameters: dict) -> str:
    owner = parameters.get(names.OWNER, "")
    if not isinstance(owner, str):
        raise InputError(names.OWNER, f"expected a string, got {owner!r}")
    return owner


# --- answering ---------------------------------------------------------------------------------------------


class Responder:
    """One request's answers, handed to the sender thread. `cancelled` asks Triton whether the client went away
    (a round trip to its process), never after the final response was sent: Triton 2.51 frees the request's
    response factory then, and asking crashes the server (seen: SIGSEGV in
    TRITONBACKEND_ResponseFactoryIsCancelled)."""

    def __init__(self, request, sender: Sender) -> None:
        self._request, self._sender = request, sender
        self._response_sender = request.get_response_sender()
        self._lock = threading.Lock()
        self._final_sent = False

    def send(self, outputs) -> None:
        self._sender.put(self, outputs, None, final=False)

    def finish(self, outputs=None, error: Exception | None = None) -> None:
        self._sender.put(self, outputs, error, final=True)

    def cancelled(self) -> bool:
        with self._lock:
            return not self._final_sent and self._request.is_cancelled()

    def deliver(self, model_name: str, outputs, error: Exception | None, final: bool) -> None:
        """On the sender thread: the response built and sent (an empty final one for `{}`)."""
        if error is not None:
            response = common.error_response(model_name, error)
        elif outputs:
            response = common.response(outputs)
        else:
            response = None
        if not final:
            self._response_sender.send(response)
            return
        with self._lock:
            self._final_sent = True
        if response is None:
            self._response_sender.send(flags=FINAL)
        else:
            self._response_sender.send(response, flags=FINAL)


class Sender:
    """The thread that sends every response and gauge update: each is a round trip to the Triton process
    (tens to hundreds of microseconds), which it makes while the core's thread runs the next step."""

    def __init__(self, model_name: str, gauges: SessionGauges) -> None:
        self.model_name, self.gauges = model_name, gauges
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="responses", daemon=True)
        self._thread.start()

    def put(self, responder: Responder, outputs, error: Exception | None, final: bool) -> None:
        self._queue.put((responder, outputs, error, final))

    def gauges_changed(self, stats: core.CoreStats, cache) -> None:
        self._queue.put((None, (stats, cache), None, False))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        server = os.getppid()
        while (item := self._queue.get()) is not None:
            responder, outputs, error, final = item
            try:
                if responder is None:
                    if os.getppid() == server:  # the server is gone: an update would wait forever (No orphans)
                        self.gauges.publish(*outputs)
                    continue
                responder.deliver(self.model_name, outputs, error, final)
            except Exception as failed:  # a response that cannot be sent is logged; the others still go
                with contextlib.suppress(Exception):
                    pb_utils.Logger.log_error(f"{self.model_name}: a response could not be sent: {failed!r}")


class SessionGauges:
    """The engine core's and its cache's state on Triton's metrics endpoint (label model=<name>, kv_dtype).
    Only changed values are sent (each update is a round trip to the Triton process)."""

    GAUGES: ClassVar[dict[str, tuple[str, str]]] = {
        "sequences": ("attention_kv_cache_sequences", "Sequences holding a KV cache"),
        "held_bytes": ("attention_kv_cache_bytes", "Bytes the KV caches hold"),
        "reserved_bytes": ("attention_kv_cache_reserved_bytes", "Bytes of the budget reserved by live sequences"),
        "allocated_bytes": (
            "attention_kv_cache_allocated_bytes",
            "Bytes of memory the KV cache takes (the host: what sessions reserve; a device: the pool)",
        ),
        "budget_bytes": ("attention_kv_cache_budget_bytes", "The KV cache budget in bytes"),
        "evictions": ("attention_kv_cache_evictions", "Sequences evicted for idleness so far"),
        "running": ("attention_engine_running", "Generations and steps the engine core is running"),
        "waiting": ("attention_engine_waiting", "Requests waiting for their session's turn or their owner's"),
        "kept": ("attention_engine_kept_rows", "Rows kept for prefix reuse"),
        "decode_runs": ("attention_engine_decode_runs", "Decode graph runs of the core's last step"),
        "decode_rows": ("attention_engine_decode_rows", "Rows the core's last step decoded"),
        "most_decode_rows": ("attention_engine_most_decode_rows", "The most rows one decode graph run has stepped"),
        "most_decode_runs": ("attention_engine_most_decode_runs", "The most decode graph runs one step has taken"),
        "most_stop_steps": (
            "attention_engine_most_stop_steps",
            "The most steps a stopped generation ran after its stop arrived (its rows freed at its end)",
        ),
        "prefill_runs": ("attention_engine_prefill_runs", "Prefill chunks the core's last step ran"),
        "step_tokens": ("attention_engine_step_tokens", "New tokens the core's last step ran"),
        "step_seconds": ("attention_engine_step_seconds", "The engine time of the core's last step"),
        "prefill_chunk_seconds": (
            "attention_engine_prefill_chunk_seconds",
            "The engine time of the core's last step that ran a prefill chunk",
        ),
        "iterations": ("attention_engine_steps", "Steps of the core that ran the model, so far"),
        "tokens_generated": ("attention_engine_generated_tokens", "Tokens generated so far"),
        "prompt_tokens_reused": ("attention_engine_reused_prompt_tokens", "Prompt ids kept rows saved so far"),
        "masked_rows": ("attention_engine_masked_rows", "Rows the core's last step picked under a grammar's mask"),
        "mask_fill_seconds": (
            "attention_engine_mask_fill_seconds",
            "The time the last step's grammar masks took to fill (beside the graph run)",
        ),
        "mask_wait_seconds": (
            "attention_engine_mask_wait_seconds",
            "The time the core's last step waited for its grammar masks after the graph run",
        ),
    }

    def __init__(self, model_name: str, cache_kind: str) -> None:
        self._families, self._metrics = [], {}
        self._sent: dict[str, float] = {}
        for key, (name, description) in self.GAUGES.items():
            family = pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.GAUGE)
            self._families.append(family)  # a family must outlive its metrics
            self._metrics[key] = family.Metric(labels={"model": model_name, "kv_dtype": cache_kind})

    def publish(self, stats: core.CoreStats, cache) -> None:
        values = {
            "sequences": cache.sequences - stats.kept,  # the clients' sessions (kept rows are the core's own)
            "held_bytes": cache.held_bytes,
            "reserved_bytes": cache.reserved_bytes,
            "allocated_bytes": cache.allocated_bytes,
            "budget_bytes": cache.budget_bytes,
            "evictions": cache.evictions,
        }
        values |= {key: getattr(stats, key) for key in self.GAUGES if hasattr(stats, key)}
        for key, value in values.items():
            if self._sent.get(key) != value:
                self._metrics[key].set(value)
                self._sent[key] = value


def load_line(model_name: str, engine: factory.SessionEngines, settings, text_files: dict[str, bytes]) -> str:
    """What the model says once loaded, parts split by "; " (serving/host/launcher.py's `serving_lines`
    prints each on a line of the console): the engine and where it runs, what its KV budget holds, the
    session operations it offers, the core's step budget, the idle timeout, the tokenizer it serves."""
    from serving.engine import operations

    budget_mib = engine.stats().budget_bytes / (1 << 20)
    holds = (
        f"KV cache budget {budget_mib:.0f} MiB = {_capped(engine.full_length_capacity)} sequences of up to "
        f"{engine.cfg.max_seq_len} positions ({engine.cache_kind})"
    )
    if engine.capacity != engine.full_length_capacity:  # rows sized to the session
        holds += f", {_capped(engine.capacity)} shorter ones at once"
    text = f"text files {', '.join(text_files)}" if text_files else "no tokenizer (token ids only)"
    parts = [
        f"{model_name}: runner {engine.description}",
        holds,
        f"session operations: {operations.offered(engine)}",
        f"engine core: {settings.step_tokens} tokens a step, prompts in chunks of what is left",
        f"idle timeout {settings.idle_timeout_seconds:g} s",
    ]
    if engine.cfg.whole:
        parts.append(text)
    return "; ".join(parts)


def _capped(sequences: int) -> str:
    """The count, said to be the cap where it is MAX_LIVE_SEQUENCES (the budget would hold more)."""
    if sequences != MAX_LIVE_SEQUENCES:
        return str(sequences)
    return f"{sequences} (a hard cap on live sequences, whatever the budget)"


def _text_files(version, published: str | None) -> dict[str, bytes]:
    """The tokenizer files in the version folder (those its SHA256SUMS lists), checked against it and
    against the digest the config publishes; name -> content."""
    recorded = {name: digest for name, digest in digests.read(version).items() if name in TEXT_FILES}
    digests.verify(version, recorded)  # each file has its recorded digest: the one digest over them follows
    contents = {name: (version / name).read_bytes() for name in recorded}
    found = generation.text_digest(recorded)
    if contents and found != published:
        raise digests.IntegrityError(
            f"{version}: the text files' digest is {found}, the model config publishes {published}; {digests.REWRITE}"
        )
    return contents
