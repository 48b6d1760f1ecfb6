"""The blocking client: the core's operations (client/core.py) run in the calling thread."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from client._wire import Health, InferResult, grpc_channel_args
from client.core import ClientCore, SessionCore, generation_request
from client.errors import ClientError
from client.generation import Generation, Outcome
from client.metadata import ModelInfo
from client.retry import Operation, emitted_blocking, run_blocking
from contract import names
from contract.generation import DEFAULT_MAX_NEW_TOKENS, GenerationRequest

T = TypeVar("T")


class Client(ClientCore):
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
            return self._module.InferenceServerClient(self.url, channel_args=grpc_channel_args(self.policy))
        return self._module.InferenceServerClient(
            self.url, connection_timeout=self.timeout, network_timeout=self.timeout
        )

    def _run(self, operation: Operation[T]) -> T:
        return run_blocking(operation, self._stub)

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

    def health(self) -> Health:
        """Server liveness and readiness, and each model's readiness; ServerUnavailableError if the
        server cannot be reached."""
        return self._run(self._health())

    def ready(self) -> bool:
        """True when the server and both models are ready; False also when it cannot be reached."""
        return self._run(self._ready())

    def probe(self, also: Sequence[str] = ()) -> Health:
        """`health()`, then a real one-token request to each model, and to each session model of `also`
        (a model whose process died still reads ready; this finds it): `.ok`, and `.failures` per model."""
        return self._run(self._probe(also))

    def wait_ready(self, timeout: float = 30.0, interval: float = 0.2) -> Health:
        """Poll until the server and both models are ready; ServerUnavailableError after `timeout` s."""
        return self._run(self._wait_ready(timeout, interval))

    def metadata(self, model: str | None = None) -> ModelInfo:
        """The served model's tensors and sizes (n_layers, d_model, n_kv_heads, head_dim), fetched once."""
        return self._run(self._metadata(model))

    def infer(
        self,
        hidden_states: np.ndarray,
        attention_mask: np.ndarray | None = None,
        past: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
        position_ids: np.ndarray | None = None,
        attention_maps: bool = False,
    ) -> InferResult:
        """One stateless call: the output and the presents (feed them back as `past` to decode).
        `position_ids` (B, T) place the new tokens of a model with rotary embeddings (left out: the
        server counts them from the mask). `attention_maps=True`: the result's `.attention_maps` is a
        list per layer of the attention weights (B, n_heads, T, P+T) (None otherwise); a padded
        query's row is unspecified."""
        return self._run(self._infer(hidden_states, attention_mask, past, position_ids, attention_maps))

    def session(
        self,
        sequence_id: int | None = None,
        replica: str | None = None,
        *,
        restore: bytes | None = None,
        owner: str | None = None,
        prefix: str | None = None,
        store_key: str | None = None,
    ) -> Session:
        """A new server-side session (nothing is sent until its first step); with `replica`, one
        opened elsewhere, resumed (client/core.py's SessionCore); with `restore`, one that starts
        holding that snapshot's cache (`Session.snapshot()`) and goes on as the original would.
        `owner`: a tag kept in the session's snapshots and required to restore them. `prefix`: a named
        prefix (`put_prefix`) the session starts from, without a prefill. `store_key`: a resumed
        session's key in this client's session store (`Session.store_key` where it was opened)."""
        return Session(self, sequence_id, replica, restore=restore, owner=owner, prefix=prefix, store_key=store_key)

    def generate(
        self, ids: Any, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, stop_token_ids: Sequence[int] = (), **sampling
    ) -> Generation:
        """A stateless generation: `ids` (T,) or (1, T) prompt a new sequence the server ends afterwards.
        As `Session.generate`."""
        session = Session(self)
        session._key = None  # nothing to keep: the server ends it
        return session._generation(ids, generation_request(max_new_tokens, stop_token_ids, **sampling), end=True)

    def put_prefix(self, name: str, tokens: np.ndarray, owner: str | None = None) -> int:
        """Prefill `tokens` (1, T, d_model) once as the immutable prefix `name`; sessions then start
        from it (`session(prefix=name)`) with a copy of its cache instead of a prefill. Behind a proxy,
        a replica that lacks it gets it from this client when a session needs it there. Its length."""
        return self._run(self._put_prefix(name, tokens, owner))

    def delete_prefix(self, name: str, owner: str | None = None) -> None:
        """Delete the prefix wherever this client put it; sessions started from it go on."""
        self._run(self._delete_prefix(name, owner))

    def prefixes(self, owner: str | None = None) -> dict[str, int]:
        """The prefixes this client put: name -> positions."""
        return self._prefixes(owner)


class Session(SessionCore):
    """One sequence whose KV cache the server keeps: START goes with the first step, END with
    `step(..., end=True)` or `close()` (a zero-token request). Use it as a context manager."""

    client: Client

    def open(self, *, fork_of: Session | None = None) -> Session:
        """Start the session now, without tokens: the server reserves its KV cache, so a full budget
        (ServerBusyError) or an unready server fails here instead of at the first step. Optional.
        `fork_of`: start as a copy of that open session (as `fork_of.fork()`)."""
        self.client._run(self._open(fork_of))
        return self

    def step(self, hidden_states: Any, attention_mask: Any = None, *, end: bool = False) -> np.ndarray:
        """Send new tokens (1, T, d_model) (and their (1, T) mask); return their output (1, T, d_model).
        A whole model's new tokens are int64 ids (1, T) and its answer their logits (1, T, vocab_size)."""
        return self.client._run(self._step(hidden_states, attention_mask, end))

    def generate(
        self,
        ids: Any = None,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        stop_token_ids: Sequence[int] = (),
        end: bool = False,
        **sampling,
    ) -> Generation:
        """Generate on the server after `ids` (T,) or (1, T) (None: after what the session holds): iterate the
        result for the token ids as they come; then its `finish_reason`, `tokens`, `logprobs`. `sampling`:
        contract.sampling.SamplingParams' fields (temperature 0.0 greedy by default, top_k, top_p, min_p, the
        penalties, seed, logprobs). The session keeps the prompt and every token answered; leaving the loop
        early stops the server within one step (`close()` does too). `prompt_logprobs=N`: each prompt token's
        logprob given the ones before it and the top N there (the result's `prompt_logprobs`, before the first
        token). `end=True`: the session ends with the generation (a new session's only request: stateless).
        `reuse_prefix=True` with `end=True`: the server starts from its longest kept row of this session's
        owner that shares the prompt's beginning, and keeps this one's for the next (the result's
        `cached_tokens`). `grammar=Grammar.json_schema(schema)` (or `.regex`, `.lark`, `.choice`): the text
        matches it, token by token, and ends (finish reason "stop") at a stop token or once the grammar allows
        nothing more; it needs
        `stop_token_ids`, the grammar's end (a grammar the server refuses is an InvalidInputError naming why).
        gRPC only."""
        return self._generation(ids, generation_request(max_new_tokens, stop_token_ids, **sampling), end=end)

    def _generation(self, ids: Any, request: GenerationRequest, end: bool = False) -> Generation:
        request = dataclasses.replace(request, session_end=end)
        if end:  # nothing to keep: the server ends it
            self._key = None
        prepared = self.client._run(self._prepare_generation(ids, request))  # bad input fails here, not when iterated
        outcome = Outcome()
        return Generation(emitted_blocking(self._generate(ids, request, outcome, prepared), self.client._stub), outcome)

    def close(self) -> None:
        """End the session on the server (idempotent; a session the server already forgot is fine)."""
        self.client._run(self._close())

    def snapshot(self) -> bytes:
        """The session's KV cache as bytes (a safetensors file with the model's fingerprint): give it
        to `client.session(restore=...)`, here or on another server of the same model."""
        return self.client._run(self._snapshot())

    def fork(self, sequence_id: int | None = None) -> Session:
        """A new open session holding a copy of this one's cache (copied inside the server); the two
        go on independently."""
        child = Session(self.client, sequence_id, owner=self._owner.get(names.OWNER))
        return child.open(fork_of=self)

    def rewind(self, length: int) -> int:
        """Keep the first `length` positions and drop the rest; the next step continues from there."""
        return self.client._run(self._rewind(length))

    def attention_maps(self, hidden_states: Any) -> list[np.ndarray]:
        """Per layer the attention weights (1, n_heads, T, length + T) a step of `hidden_states`
        (1, T, d_model) would have over what the session holds and the new tokens, without taking the
        step: the session's cache and length are unchanged."""
        return self.client._run(self._attention_maps(hidden_states))

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(ClientError):  # don't hide the error that is already on its way out
            self.close()
