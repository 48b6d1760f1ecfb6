"""The blocking client: stateless inference on `mha`, sessions on `mha_session` (DESIGN.md 3.4)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from client import _wire, retry
from client._wire import Health, InferResult
from client.errors import ClientError, RequestTimeoutError, ServerUnavailableError, UnknownSessionError
from client.metadata import ModelInfo, parse_metadata

T = TypeVar("T")


class Client(_wire.ClientSettings):
    """A Triton client for the attention model, over gRPC (default) or HTTP.

    `timeout` (seconds) bounds every call; calls that are safe to repeat (health, metadata,
    stateless infer) are retried `retries` times with exponential backoff from `backoff` seconds
    when the server is unreachable or busy. Inputs are checked against the served model's metadata
    before they are sent (`validate=False` leaves that to the server). Thread-safe.
    """

    def _init_connections(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._stubs: list = []

    # --- the tritonclient underneath ---------------------------------------------------------

    def _stub(self):
        """gRPC: one channel for all threads. HTTP: one connection per thread (geventhttpclient's
        sockets belong to the thread that made them)."""
        if self.protocol == "grpc":
            with self._lock:
                if not self._stubs:
                    self._stubs.append(self._new_stub())
                return self._stubs[0]
        stub = getattr(self._local, "stub", None)
        if stub is None:
            stub = self._local.stub = self._new_stub()
            with self._lock:
                self._stubs.append(stub)
        return stub

    def _new_stub(self):
        if self.protocol == "grpc":
            return self._module.InferenceServerClient(self.url, channel_args=_wire.grpc_channel_args(self.policy))
        return self._module.InferenceServerClient(
            self.url, connection_timeout=self.timeout, network_timeout=self.timeout
        )

    def _call(self, what: str, fn: Callable[[Any], T], *, retry_ok: bool = True, session: bool = False) -> T:
        return retry.call(
            lambda: fn(self._stub()), self.policy, what=f"{what} at {self.url}", retry=retry_ok, session=session
        )

    def close(self) -> None:
        with self._lock:
            stubs, self._stubs = self._stubs, []
            self._local = threading.local()
        for stub in stubs:
            with contextlib.suppress(Exception):  # closing a broken connection has nothing to report
                stub.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- health and metadata -----------------------------------------------------------------

    def health(self) -> Health:
        """Server liveness and readiness, and each model's readiness; ServerUnavailableError if the
        server cannot be reached."""
        kw = self._timeout_kw
        live = self._call("liveness check", lambda s: s.is_server_live(**kw))
        ready = self._call("readiness check", lambda s: s.is_server_ready(**kw))
        models = {
            name: self._call(f"readiness check of '{name}'", lambda s, name=name: s.is_model_ready(name, **kw))
            for name in (self.model, self.session_model)
        }
        return Health(self.url, live, ready, models)

    def ready(self) -> bool:
        """True when the server and both models are ready; False also when it cannot be reached."""
        try:
            return self.health().ok
        except (ServerUnavailableError, RequestTimeoutError):
            return False

    def wait_ready(self, timeout: float = 30.0, interval: float = 0.2) -> Health:
        """Poll until the server and both models are ready; ServerUnavailableError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                state = self.health()
                if state.ok:
                    return state
                why = state.problems()
            except (ServerUnavailableError, RequestTimeoutError) as error:
                why = error.message
            if time.monotonic() >= deadline:
                raise ServerUnavailableError(f"{self.url} is not ready after {timeout:g} s: {why}")
            time.sleep(interval)

    def metadata(self, model: str | None = None) -> ModelInfo:
        """The served model's tensors and sizes (n_layers, d_model, n_kv_heads, head_dim), fetched once."""
        model = model or self.model
        if model not in self._infos:
            kw = {**_wire.metadata_kwargs(self.protocol), **self._timeout_kw}
            raw = self._call(f"metadata of '{model}'", lambda s: s.get_model_metadata(model, **kw))
            self._infos[model] = parse_metadata(raw)
        return self._infos[model]

    # --- inference ---------------------------------------------------------------------------

    def infer(
        self,
        hidden_states: np.ndarray,
        attention_mask: np.ndarray | None = None,
        past: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> InferResult:
        """One stateless call: the output and the presents (feed them back as `past` to decode)."""
        info = self.metadata() if self.validate else None
        tensors = _wire.stateless_tensors(info, hidden_states, attention_mask, past)
        inputs = _wire.make_inputs(self._module, tensors)
        result = self._call(f"infer on '{self.model}'", lambda s: s.infer(self.model, inputs, **self._timeout_kw))
        return _wire.read_stateless(result)

    def session(self, sequence_id: int | None = None) -> Session:
        """A new server-side session (nothing is sent until its first step)."""
        return Session(self, sequence_id)

    def _send_step(self, sequence_id: int, tensors: dict, start: bool, end: bool) -> np.ndarray:
        # never retried: the server may have appended to the session's cache before the failure
        inputs = _wire.make_inputs(self._module, tensors)
        kw = {**_wire.sequence_kwargs(sequence_id, start, end), **self._timeout_kw}
        result = self._call(
            f"step of session {sequence_id}",
            lambda s: s.infer(self.session_model, inputs, **kw),
            retry_ok=False,
            session=True,
        )
        return _wire.read_step(result)


class Session(_wire.SessionState):
    """One sequence whose KV cache the server keeps: START goes with the first step, END with
    `step(..., end=True)` or `close()` (a zero-token request). Use it as a context manager."""

    def step(self, hidden_states: np.ndarray, attention_mask: np.ndarray | None = None, *, end: bool = False):
        """Send new tokens (1, T, d_model) (and their (1, T) mask); return their output (1, T, d_model)."""
        self._check_open()
        client = self.client
        info = client.metadata(client.session_model) if client.validate else None
        tensors = _wire.step_tensors(info, hidden_states, attention_mask)
        self._sending(tensors)
        try:
            output = client._send_step(self.id, tensors, start=not self.started, end=end)
        except UnknownSessionError:
            self._forgotten()
            raise
        return self._stepped(output, end)

    def close(self) -> None:
        """End the session on the server (idempotent; a session the server already forgot is fine)."""
        if self._closing():
            with contextlib.suppress(UnknownSessionError):
                self.client._send_step(self.id, self._end_tensors(), start=False, end=True)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(ClientError):  # don't hide the error that is already on its way out
            self.close()
