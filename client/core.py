"""The client's one core: settings, and every operation (health, waiting for readiness, metadata,
stateless inference, a session's steps) written once, as a generator of I/O actions (client/retry.py:
a Call on tritonclient, a Sleep). `Client` runs the actions blocking and `AsyncClient` awaits them;
they are the thin fronts (client/sync.py, client/aio.py) and hold no logic of their own.

Why this shape: the blocking and asyncio clients must behave identically (the same checks, errors,
retries, session bookkeeping), and Python has no way to write one function that both blocks and
awaits. Writing the logic as a sequence of actions leaves only "how to perform an action" to each
front: a few lines, where any other split would copy the logic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from client import _wire, affinity
from client._wire import Health, InferResult
from client.errors import (
    ClientError,
    InvalidInputError,
    RequestTimeoutError,
    ServerBusyError,
    ServerUnavailableError,
    SessionLostError,
    UnknownSessionError,
)
from client.metadata import ModelInfo, parse_facts, parse_metadata
from client.retry import Call, Operation, RetryPolicy, Sleep, retried
from contract import errors as kinds
from contract import names


@dataclasses.dataclass(frozen=True)
class StepAnswer:
    output: np.ndarray
    replica: str | None  # the replica holding the session, as the proxy named it (None: no proxy)
    held_length: int | None  # positions the server holds after the step (None: it does not say)
    snapshot: bytes | None = None  # a snapshot's blob


class ClientCore:
    """What `Client` and `AsyncClient` are made of; they differ only in how they run an operation."""

    _module_suffix = ""  # ".aio" for the asyncio twins of tritonclient's clients

    def __init__(
        self,
        url: str = "127.0.0.1",  # the port defaults to the protocol's: gRPC 8001, HTTP 8000
        protocol: str = "grpc",
        model: str = "mha",
        session_model: str = "mha_session",
        *,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.1,
        validate: bool = True,
    ) -> None:
        self.protocol = _wire.check_protocol(protocol)
        self.url = _wire.normalize_url(url, protocol)
        self.model, self.session_model = model, session_model
        self.timeout, self.validate = timeout, validate
        self.policy = RetryPolicy(retries=retries, backoff=backoff, max_backoff=max(backoff, 2.0))
        self._module = importlib.import_module(f"tritonclient.{protocol}{self._module_suffix}")
        self._timeout_kw = _wire.timeout_kwargs(protocol, timeout)
        self._infos: dict[str, ModelInfo] = {}
        # named prefixes put through this client: (owner, name) -> their tokens, to put one again on a
        # replica that lacks it, and the replicas that hold it ("" for a direct Triton)
        self._prefix_tokens: dict[tuple[str, str], np.ndarray] = {}
        self._prefix_replicas: dict[tuple[str, str], set[str]] = {}
        self._init_connections()

    def _init_connections(self) -> None:
        """The front's connection bookkeeping (connections themselves open on first use)."""

    def _call(self, what: str, fn, *, retry: bool = True, session: bool = False) -> Operation[Any]:
        return retried(Call(fn, f"{what} at {self.url}", retry, session), self.policy)

    # --- operations ------------------------------------------------------------------------------

    def _health(self) -> Operation[Health]:
        kw = self._timeout_kw
        live = yield from self._call("liveness check", lambda s: s.is_server_live(**kw))
        ready = yield from self._call("readiness check", lambda s: s.is_server_ready(**kw))
        models = {}
        for name in (self.model, self.session_model):
            check = self._call(f"readiness check of '{name}'", lambda s, name=name: s.is_model_ready(name, **kw))
            models[name] = yield from check
        return Health(self.url, live, ready, models)

    def _probe(self) -> Operation[Health]:
        """`_health`, then one real token through each model: the stateless one, and a session opened
        and ended in one request. A model whose process died still reads ready to Triton; this
        finds it. A full KV-cache budget is an answer (the model serves, just not one more session)."""
        state = yield from self._health()
        if not state.ok:
            return state
        failures = {}
        for model, request in ((self.model, self._probe_stateless), (self.session_model, self._probe_session)):
            try:
                yield from request()
            except ServerBusyError:
                pass
            except ClientError as error:
                failures[model] = error.message
        return dataclasses.replace(state, failures=failures)

    def _probe_stateless(self) -> Operation[Any]:
        info = yield from self._metadata(self.model)
        token = np.zeros((1, 1, info.d_model), info.float_dtype)
        inputs = _wire.make_inputs(self._module, {names.HIDDEN_STATES: token})
        return (
            yield from self._call(
                f"probe of '{self.model}'", lambda s: s.infer(self.model, inputs, **self._timeout_kw), retry=False
            )
        )

    def _probe_session(self) -> Operation[Any]:
        info = yield from self._metadata(self.session_model)
        token = {names.HIDDEN_STATES: np.zeros((1, 1, info.d_model), info.float_dtype)}
        answer = yield from self._send_step(_wire.new_sequence_id(), token, start=True, end=True)
        return answer.output

    def _ready(self) -> Operation[bool]:
        try:
            return (yield from self._health()).ok
        except (ServerUnavailableError, RequestTimeoutError):
            return False

    def _wait_ready(self, timeout: float, interval: float) -> Operation[Health]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                state = yield from self._health()
                if state.ok:
                    return state
                why = state.problems()
            except (ServerUnavailableError, RequestTimeoutError) as error:
                why = error.message
            if time.monotonic() >= deadline:
                raise ServerUnavailableError(f"{self.url} is not ready after {timeout:g} s: {why}")
            yield Sleep(interval)

    def _metadata(self, model: str | None = None) -> Operation[ModelInfo]:
        model = model or self.model
        if model not in self._infos:
            kw = {**_wire.metadata_kwargs(self.protocol), **self._timeout_kw}
            raw = yield from self._call(f"metadata of '{model}'", lambda s: s.get_model_metadata(model, **kw))
            config = yield from self._call(f"config of '{model}'", lambda s: s.get_model_config(model, **kw))
            self._infos[model] = dataclasses.replace(parse_metadata(raw), facts=parse_facts(config))
        return self._infos[model]

    def _infer(
        self, hidden_states: Any, attention_mask: Any = None, past: Sequence | None = None, position_ids: Any = None
    ) -> Operation[InferResult]:
        info = (yield from self._metadata()) if self.validate else None
        tensors = _wire.stateless_tensors(info, hidden_states, attention_mask, past, position_ids)
        inputs = _wire.make_inputs(self._module, tensors)
        result = yield from self._call(
            f"infer on '{self.model}'", lambda s: s.infer(self.model, inputs, **self._timeout_kw)
        )
        return _wire.read_stateless(result)

    def _send_step(
        self,
        sequence_id: int,
        tensors: dict,
        start: bool,
        end: bool,
        replica: str | None = None,
        parameters: dict | None = None,
        route_as: int | None = None,
    ) -> Operation[StepAnswer]:
        """The step carries the session's routing headers (contract/routing.py), and `replica` (from
        an earlier answer) pins it there when a proxy stands in front of several Triton replicas; a
        direct Triton ignores both. `parameters`: a session operation's (contract/names.py);
        `route_as`: the session whose replica the request must reach (a fork: the one forked)."""
        # never retried: the server may have appended to the session's cache before the failure
        inputs = _wire.make_inputs(self._module, tensors)
        kw = {**_wire.sequence_kwargs(sequence_id, start, end), **self._timeout_kw}
        if parameters:
            kw["parameters"] = parameters
        headers = affinity.step_headers(sequence_id if route_as is None else route_as, replica)
        result, headers = yield from self._call(
            f"step of session {sequence_id}",
            lambda s: affinity.infer(s, self.session_model, inputs, headers=headers, **kw),
            retry=False,
            session=True,
        )
        return StepAnswer(
            _wire.read_step(result),
            affinity.replica_from(headers) or replica,
            _wire.read_held_length(result),
            _wire.read_snapshot(result),
        )

    def _put_prefix(self, name: str, tokens: Any, owner: str | None = None) -> Operation[int]:
        """Prefill `tokens` (1, T, d_model) once as the prefix `name` (immutable; scoped to `owner`);
        sessions then start from it without a prefill (`session(prefix=name)`). Its length."""
        info = (yield from self._metadata(self.session_model)) if self.validate else None
        tokens = _wire.step_tensors(info, tokens, None)[names.HIDDEN_STATES]
        key = (owner or "", name)
        yield from self._send_prefix(key, names.PUT_PREFIX, tokens, _wire.new_sequence_id(), None)
        self._prefix_tokens[key] = tokens
        return tokens.shape[1]

    def _send_prefix(
        self, key: tuple[str, str], operation: str, tokens: np.ndarray, sequence_id: int, replica: str | None
    ) -> Operation[StepAnswer]:
        """One prefix operation as a sequence of its own (START and END in one request)."""
        parameters = {names.OPERATION: operation, names.PREFIX: key[1], **({names.OWNER: key[0]} if key[0] else {})}
        answer = yield from self._send_step(
            sequence_id, {names.HIDDEN_STATES: tokens}, True, True, replica=replica, parameters=parameters
        )
        if operation == names.PUT_PREFIX:
            self._prefix_replicas.setdefault(key, set()).add(answer.replica or "")
        return answer

    def _delete_prefix(self, name: str, owner: str | None = None) -> Operation[None]:
        """Delete the prefix on every replica this client put it on (sessions started from it keep
        their own copies)."""
        key = (owner or "", name)
        info = yield from self._metadata(self.session_model)
        empty = np.zeros((1, 0, info.d_model), info.float_dtype)
        replicas = self._prefix_replicas.pop(key, {""})
        self._prefix_tokens.pop(key, None)
        for replica in sorted(replicas):
            yield from self._send_prefix(key, names.DELETE_PREFIX, empty, _wire.new_sequence_id(), replica or None)

    def _prefixes(self, owner: str | None = None) -> dict[str, int]:
        """The prefixes put through this client for `owner`: name -> positions."""
        return {name: t.shape[1] for (who, name), t in self._prefix_tokens.items() if who == (owner or "")}


class SessionCore:
    """A session's bookkeeping and operations, shared by the blocking and the asyncio session."""

    def __init__(
        self,
        client: ClientCore,
        sequence_id: int | None = None,
        replica: str | None = None,
        restore: bytes | None = None,
        owner: str | None = None,
        prefix: str | None = None,
    ) -> None:
        """`replica` resumes a session opened elsewhere (another process, another gateway replica):
        `sequence_id` is then the server's, already started, and `replica` the pin its answers named
        ("" when they named none). `restore`: a snapshot the session starts from (sent with its
        START: at `open()` or before its first step). `owner`: a tag the server writes into this
        session's snapshots and requires to restore one (the gateway passes its caller's key
        fingerprint); None: anyone holding the blob may restore it. `prefix`: a named prefix the
        session starts from (`put_prefix`), sent with its START."""
        if sum(x is not None for x in (restore, replica, prefix)) > 1:
            raise ValueError("a session resumes one open elsewhere (replica), or starts from a snapshot or a prefix")
        self._restore, self._prefix = restore, prefix
        # who may restore this session's snapshots, and who restores one (the gateway sets its caller's
        # key fingerprint; empty: anyone holding the blob)
        self._owner: dict[str, str] = {} if owner is None else {names.OWNER: owner}
        self.client = client  # the Client or AsyncClient that runs this session's steps
        self.id = _wire.check_sequence_id(sequence_id)
        self.started = replica is not None  # the server has answered a step (START went through)
        self.closed = False
        self.length = 0  # tokens the server holds for this session
        self.replica = replica or None  # the replica holding it, as the proxy named it (None: no proxy)
        # the last step sent: once one went out, the server may hold the sequence even if it failed
        self._sent: np.ndarray | None = None

    def _step(self, hidden_states: Any, attention_mask: Any = None, end: bool = False) -> Operation[np.ndarray]:
        if self.closed:
            raise UnknownSessionError(f"session {self.id} is closed", status=None)
        client = self.client
        if (self._restore is not None or self._prefix is not None) and not self.started:
            yield from self._open()
        info = (yield from client._metadata(client.session_model)) if client.validate else None
        tensors = _wire.step_tensors(info, hidden_states, attention_mask)
        self._sent = tensors[names.HIDDEN_STATES]  # its width and dtype make the END request
        try:
            answer = yield from client._send_step(
                self.id, tensors, start=not self.started, end=end, replica=self.replica
            )
        except UnknownSessionError as error:
            self.closed = True  # the server does not know it: there is nothing left to end
            if self.started and error.kind == kinds.SEQUENCE_UNKNOWN:  # it held it: the process that did is gone
                raise SessionLostError(
                    f"session {self.id} is lost: the server held it and has forgotten it; {error.message}",
                    status=error.status,
                    kind=kinds.SEQUENCE_LOST,
                ) from None
            raise
        self.started, self.closed, self.replica = True, end, answer.replica
        held = answer.held_length
        self.length = held if held is not None and held >= 0 else self.length + answer.output.shape[1]
        return answer.output

    def _open(self, fork_of: SessionCore | None = None) -> Operation[None]:
        """START the session without tokens: the server reserves its KV cache now, so a full budget
        (ServerBusyError) or a server that is down answers here rather than at the first step. With
        `restore`, the session starts holding that snapshot's cache; with `fork_of`, a copy of that
        live session's (on its replica)."""
        if self.started or self.closed:
            raise UnknownSessionError(f"session {self.id} is already {'closed' if self.closed else 'open'}")
        info = yield from self.client._metadata(self.client.session_model)
        self._sent = np.zeros((1, 0, info.d_model), info.float_dtype)
        tensors, parameters, route_as, replica = {names.HIDDEN_STATES: self._sent}, None, None, None
        if self._restore is not None:
            tensors[names.SNAPSHOT] = np.array([[bytes(self._restore)]], dtype=np.object_)
            parameters = {names.OPERATION: names.RESTORE, **self._owner}
        if fork_of is not None:
            fork_of._check_open()
            parameters = {names.OPERATION: names.FORK, names.FORK_OF: fork_of.id}
            route_as, replica = fork_of.id, fork_of.replica
        if self._prefix is not None:
            parameters = {names.OPERATION: names.FROM_PREFIX, names.PREFIX: self._prefix, **self._owner}
        try:
            answer = yield from self._start(tensors, parameters, route_as, replica)
        except InvalidInputError as error:
            key = (self._owner.get(names.OWNER, ""), self._prefix or "")
            if error.kind != kinds.PREFIX_UNKNOWN or key not in self.client._prefix_tokens:
                raise
            # put here, then start from it: this session's id routes both to the replica it hashes to
            tokens = self.client._prefix_tokens[key]
            yield from self.client._send_prefix(key, names.PUT_PREFIX, tokens, self.id, None)
            answer = yield from self._start(tensors, parameters, route_as, replica)
        self.replica, self._restore, self._prefix = answer.replica, None, None
        self.started = True
        self.length = answer.held_length if answer.held_length is not None and answer.held_length >= 0 else 0

    def _start(
        self, tensors: dict, parameters: dict | None, route_as: int | None, replica: str | None
    ) -> Operation[StepAnswer]:
        """The session's START (with an operation's parameters); a refused one is ENDed again."""
        try:
            return (
                yield from self.client._send_step(
                    self.id, tensors, start=True, end=False, replica=replica, parameters=parameters, route_as=route_as
                )
            )
        except (ServerBusyError, InvalidInputError) as error:
            if isinstance(error, InvalidInputError) and parameters is None:
                raise
            # a refused START (a full budget, a blob or fork refused) still holds a slot in Triton's
            # sequence batcher until END (or its idle timeout): give it back now, so that refusals
            # cannot fill the slots; open() may be tried again
            with contextlib.suppress(ClientError):
                yield from self.client._send_step(self.id, {names.HIDDEN_STATES: self._sent}, start=False, end=True)
            if not isinstance(error, InvalidInputError) or error.kind != kinds.PREFIX_UNKNOWN:
                self._sent = None
            raise

    def _snapshot(self) -> Operation[bytes]:
        """The session's KV cache as a blob; the session goes on unchanged."""
        answer = yield from self._operate({names.OPERATION: names.SNAPSHOT_OPERATION, **self._owner})
        if answer.snapshot is None:
            raise ClientError(f"the server's answer to the snapshot of session {self.id} has no '{names.SNAPSHOT}'")
        return answer.snapshot

    def _rewind(self, length: int) -> Operation[int]:
        """Keep the first `length` positions; the next step continues from there. The new length."""
        yield from self._operate({names.OPERATION: names.REWIND, names.REWIND_TO: int(length)})
        return self.length

    def _operate(self, parameters: dict) -> Operation[StepAnswer]:
        self._check_open()
        info = yield from self.client._metadata(self.client.session_model)
        empty = {names.HIDDEN_STATES: np.zeros((1, 0, info.d_model), info.float_dtype)}
        answer = yield from self.client._send_step(
            self.id, empty, start=False, end=False, replica=self.replica, parameters=parameters
        )
        if answer.held_length is not None and answer.held_length >= 0:
            self.length = answer.held_length
        return answer

    def _check_open(self) -> None:
        if self.closed or not self.started:
            state = "closed" if self.closed else "not open yet"
            raise UnknownSessionError(f"session {self.id} is {state}", status=None)

    def _close(self) -> Operation[None]:
        """Mark closed and, once a step went out, END it on the server. A failed first step may have
        opened the sequence in Triton's batcher, so it is ended too; one the server already forgot
        is fine."""
        needs_end = (self._sent is not None or self.started) and not self.closed
        self.closed = True
        if needs_end:
            if self._sent is None:  # resumed: the model says the width
                info = yield from self.client._metadata(self.client.session_model)
                self._sent = np.zeros((1, 0, info.d_model), info.float_dtype)
            end = {names.HIDDEN_STATES: np.zeros((1, 0, self._sent.shape[-1]), dtype=self._sent.dtype)}
            with contextlib.suppress(UnknownSessionError):
                yield from self.client._send_step(self.id, end, start=False, end=True, replica=self.replica)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open" if self.started else "new"
        return f"<{type(self).__name__} {self.id} {state}, {self.length} tokens>"
