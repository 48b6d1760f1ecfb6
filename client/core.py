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
import functools
import importlib
import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any, Self

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
from client.generation import Outcome, opened_stream, stop_request, stream_request
from client.metadata import ModelInfo, parse_facts, parse_metadata, with_facts
from client.retry import Call, Detach, Emit, Local, Operation, RetryPolicy, Sleep, retried
from client.store import SessionStore, StoreError, StoreKey, open_store
from contract import errors as kinds
from contract import generation, names
from contract.grammar import Grammar
from contract.inputs import InputError, check_token_values, real_tokens
from contract.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepAnswer:
    output: np.ndarray
    replica: str | None  # the replica holding the session, as the proxy named it (None: no proxy)
    held_length: int | None  # positions the server holds after the step (None: it does not say)
    snapshot: bytes | None = None  # a snapshot's blob
    result: Any = None  # the raw answer, for what only some operations carry (the attention maps)

    def length_or(self, otherwise: int) -> int:
        """The positions the server says it holds, or `otherwise` when it says none (-1 once ended)."""
        return self.held_length if self.held_length is not None and self.held_length >= 0 else otherwise


def _store(session_store: SessionStore | str | None, secret) -> SessionStore | None:
    """The store a client writes its sessions' checkpoints to: as given, or opened from a path or URL."""
    if isinstance(session_store, SessionStore) and secret is not None:
        raise ValueError(f"store_secret is for a store named by a path or URL; {session_store!r} has its own")
    if isinstance(session_store, SessionStore | None):
        return session_store
    return open_store(session_store, secret=secret)


class ClientCore:
    """What `Client` and `AsyncClient` are made of; they differ only in how they run an operation."""

    _module_suffix = ""  # ".aio" for the asyncio twins of tritonclient's clients

    def __init__(
        self,
        url: str = "127.0.0.1",  # the port defaults to the protocol's: gRPC 8001, HTTP 8000
        protocol: str = "grpc",
        model: str = names.MODEL,
        session_model: str = names.SESSION_MODEL,
        *,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.1,
        validate: bool = True,
        session_store: SessionStore | str | None = None,
        store_secret: bytes | str | Sequence[bytes | str] | None = None,
        checkpoint_every: int = 256,
        recovery_timeout: float = 30.0,
    ) -> None:
        """`session_store` (a SessionStore, a directory, a `redis://` URL): sessions become durable:
        every `checkpoint_every` positions a session writes what it added since the last checkpoint
        there, and a session whose server lost it (a replica, a server or its model process died) is
        rebuilt on a server that answers, for up to `recovery_timeout` s, from the store and the steps
        since its last checkpoint (client/store.py; docs/design.md, "Durable sessions").
        `store_secret`: what a store named by a directory or URL tags its entries with (several: the
        first tags, any verifies); None: a public label, which binds each entry to its session and
        positions and catches changes, but does not stop whoever can write the store from forging one.
        A SessionStore given as such has its own."""
        if checkpoint_every < 1 or recovery_timeout < 0:
            raise ValueError(
                f"need checkpoint_every >= 1 and recovery_timeout >= 0, got {checkpoint_every}, {recovery_timeout}"
            )
        self.store = _store(session_store, store_secret)
        self.checkpoint_every, self.recovery_timeout = checkpoint_every, recovery_timeout
        self.protocol = _wire.check_protocol(protocol)
        self.url = _wire.normalize_url(url, protocol)
        # a caller may hold the models' names of before (`mha`, `mha_session`): they are today's
        self.model, self.session_model = names.current_model_name(model), names.current_model_name(session_model)
        self.timeout, self.validate = timeout, validate
        self._settings = {
            "timeout": timeout,
            "retries": retries,
            "backoff": backoff,
            "validate": validate,
            "session_store": self.store,
            "checkpoint_every": checkpoint_every,
            "recovery_timeout": recovery_timeout,
        }
        self.policy = RetryPolicy(retries=retries, backoff=backoff, max_backoff=max(backoff, 2.0))
        self._module = importlib.import_module(f"tritonclient.{protocol}{self._module_suffix}")
        self._timeout_kw = _wire.timeout_kwargs(protocol, timeout)
        self._infos: dict[str, ModelInfo] = {}
        # named prefixes put through this client: (owner, name) -> their tokens, to put one again on a
        # replica that lacks it, and the replicas that hold it ("" for a direct Triton). Held without a cap
        # here: the gateway bounds them per key (serving/gateway/quotas.py: SERVING_PREFIXES_PER_KEY, and the
        # prefixes' positions by SERVING_PREFIX_BYTES_PER_KEY); a direct caller holds what it puts
        self._prefix_tokens: dict[tuple[str, str], np.ndarray] = {}
        self._prefix_replicas: dict[tuple[str, str], set[str]] = {}
        self._init_connections()

    def _init_connections(self) -> None:
        """The front's connection bookkeeping (connections themselves open on first use)."""

    def _session_module(self) -> Any:
        """The tritonclient module a session request's inputs are made with: gRPC's (the session model is
        decoupled and takes streams only, client/affinity.py); an HTTP client is told so."""
        if self.protocol != "grpc":
            raise ClientError(
                f"sessions and generations go over gRPC streams ('{self.session_model}' is a decoupled model, which "
                f"Triton serves on streams only): open the client with protocol='grpc' (stateless calls, health "
                f"and metadata work over HTTP too)"
            )
        return self._module

    def sibling(self, session_model: str) -> Self:
        """A client of the same server, models and settings but the session model `session_model` (another model
        set of the same repository: its sessions are opened there)."""
        return type(self)(self.url, self.protocol, self.model, session_model, **self._settings)

    def _call(self, what: str, fn, *, retry: bool = True, session: bool = False) -> Operation[Any]:
        return retried(Call(fn, f"{what} at {self.url}", retry, session), self.policy)

    # --- operations ------------------------------------------------------------------------------

    def _health(self, also: Sequence[str] = ()) -> Operation[Health]:
        kw = self._timeout_kw
        live = yield from self._call("liveness check", lambda s: s.is_server_live(**kw))
        ready = yield from self._call("readiness check", lambda s: s.is_server_ready(**kw))
        models = {}
        for name in dict.fromkeys((self.model, self.session_model, *also)):
            check = self._call(f"readiness check of '{name}'", lambda s, name=name: s.is_model_ready(name, **kw))
            models[name] = yield from check
        return Health(self.url, live, ready, models)

    def _probe(self, also: Sequence[str] = ()) -> Operation[Health]:
        """`_health`, then one real token through each model: the stateless one, and a session opened
        and ended in one request of the session model and of each of `also` (other session models of the
        server: the models that generate for other model ids). A model whose process died still reads ready to
        Triton; this finds it. A full KV-cache budget is an answer (the model serves, just not one more
        session)."""
        state = yield from self._health(also)
        if not state.ok:
            return state
        failures = {}
        probes = {self.model: self._probe_stateless}
        probes |= {model: functools.partial(self._probe_session, model) for model in (self.session_model, *also)}
        for model, request in probes.items():
            try:
                yield from request()
            except ServerBusyError:
                pass
            except ClientError as error:
                failures[model] = error.message
        return dataclasses.replace(state, failures=failures)

    def _probe_stateless(self) -> Operation[Any]:
        info = yield from self._metadata(self.model)
        token = _one_token(info)
        inputs = _wire.make_inputs(self._module, {info.new_tokens: token})
        return (
            yield from self._call(
                f"probe of '{self.model}'", lambda s: s.infer(self.model, inputs, **self._timeout_kw), retry=False
            )
        )

    def _probe_session(self, model: str) -> Operation[Any]:
        info = yield from self._metadata(model)
        token = {info.new_tokens: _one_token(info)}
        answer = yield from self._send_step(_wire.new_sequence_id(), token, start=True, end=True, model=model)
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
        model = names.current_model_name(model) if model else self.model
        if model not in self._infos:
            kw = {**_wire.metadata_kwargs(self.protocol), **self._timeout_kw}
            raw = yield from self._call(f"metadata of '{model}'", lambda s: s.get_model_metadata(model, **kw))
            config = yield from self._call(f"config of '{model}'", lambda s: s.get_model_config(model, **kw))
            self._infos[model] = with_facts(parse_metadata(raw), parse_facts(config))
        return self._infos[model]

    def _text_digest(self) -> Operation[str | None]:
        """The digest of the tokenizer files the session model serves (contract.generation.text_digest); None
        when it has none (a model imported without a tokenizer.json, or not a whole model)."""
        kw = {**_wire.metadata_kwargs(self.protocol), **self._timeout_kw}
        model = self.session_model
        config = yield from self._call(f"config of '{model}'", lambda s: s.get_model_config(model, **kw))
        digest = parse_facts(config).get(generation.P_TEXT_DIGEST)
        return str(digest) if digest else None

    def _infer(
        self,
        hidden_states: Any,
        attention_mask: Any = None,
        past: Sequence | None = None,
        position_ids: Any = None,
        attention_maps: bool = False,
    ) -> Operation[InferResult]:
        """With `attention_maps`, the answer carries every layer's attention weights too (the request
        parameter `attention_maps`: the server runs its inspection graph for this call)."""
        info = (yield from self._metadata()) if self.validate else None
        tensors = _wire.stateless_tensors(info, hidden_states, attention_mask, past, position_ids)
        inputs = _wire.make_inputs(self._module, tensors)
        kw = {**self._timeout_kw, **({"parameters": {names.ATTENTION_MAPS: True}} if attention_maps else {})}
        result = yield from self._call(f"infer on '{self.model}'", lambda s: s.infer(self.model, inputs, **kw))
        return _wire.read_stateless(_wire.decoded(result), maps=attention_maps)

    def _send_step(
        self,
        sequence_id: int,
        tensors: dict,
        start: bool,
        end: bool,
        replica: str | None = None,
        parameters: dict | None = None,
        route_as: int | None = None,
        model: str | None = None,
    ) -> Operation[StepAnswer]:
        """The step carries the session's routing headers (contract/routing.py), and `replica` (from
        an earlier answer) pins it there when a proxy stands in front of several Triton replicas; a
        direct Triton ignores both. `parameters`: a session operation's (contract/names.py);
        `route_as`: the session whose replica the request must reach (a fork: the one forked); `model`: another
        session model than the client's (a probe's)."""
        # never retried: the server may have appended to the session's cache before the failure
        inputs = _wire.make_inputs(self._session_module(), tensors)
        kw = {**_wire.sequence_kwargs(sequence_id, start, end), **self._timeout_kw}
        if parameters:
            kw["parameters"] = parameters
        headers = affinity.step_headers(sequence_id if route_as is None else route_as, replica)
        result, headers = yield from self._call(
            f"step of session {sequence_id}",
            lambda s: affinity.infer(s, model or self.session_model, inputs, headers=headers, **kw),
            retry=False,
            session=True,
        )
        result = _wire.decoded(result)  # its outputs read in one pass, not one walk of them per name
        return StepAnswer(
            _wire.read_step(result),
            affinity.replica_from(headers) or replica,
            _wire.read_held_length(result),
            _wire.read_snapshot(result),
            result,
        )

    def _put_prefix(self, name: str, tokens: Any, owner: str | None = None) -> Operation[int]:
        """Prefill `tokens` (1, T, d_model) (a whole model's ids (1, T)) once as the prefix `name`
        (immutable; scoped to `owner`);
        sessions then start from it without a prefill (`session(prefix=name)`). Its length."""
        info = (yield from self._metadata(self.session_model)) if self.validate else None
        tokens = _wire.step_tensors(info, tokens, None)[_wire.tokens_name(info, tokens)]
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
            sequence_id, {_wire.tokens_name(None, tokens): tokens}, True, True, replica=replica, parameters=parameters
        )
        if operation == names.PUT_PREFIX:
            self._prefix_replicas.setdefault(key, set()).add(answer.replica or "")
        return answer

    def _delete_prefix(self, name: str, owner: str | None = None) -> Operation[None]:
        """Delete the prefix on every replica this client put it on (sessions started from it keep
        their own copies)."""
        key = (owner or "", name)
        info = yield from self._metadata(self.session_model)
        empty = info.no_tokens()
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
        store_key: str | None = None,
    ) -> None:
        """`replica` resumes a session opened elsewhere (another process, another gateway replica):
        `sequence_id` is then the server's, already started, and `replica` the pin its answers named
        ("" when they named none). `restore`: a snapshot the session starts from (sent with its
        START: at `open()` or before its first step). `owner`: a tag the server writes into this
        session's snapshots and requires to restore one (the gateway passes its caller's key
        fingerprint); None: anyone holding the blob may restore it. `prefix`: a named prefix the
        session starts from (`put_prefix`), sent with its START. `store_key`: a resumed session's key in
        the session store (its `store_key` where it was opened): its close marks it ended there, so that
        the process that opened it does not rebuild it."""
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
        # durable (a client with a session store; not a session resumed from elsewhere, whose past
        # this process never saw): positions [0, _checkpointed) are in the store, the tokens of the
        # steps since are in _since; _replayable is False while they are not (a restored, forked or
        # prefixed start, or a rewind, until its checkpoint is written)
        self._key = StoreKey(owner or "", uuid.uuid4().hex) if client.store is not None and replica is None else None
        # a resumed session: ended through this process, it is marked ended in the store
        self._ends = StoreKey(owner or "", store_key) if client.store is not None and store_key else None
        self._checkpointed, self._since, self._replayable = 0, [], True
        self._next_checkpoint = client.checkpoint_every
        self.recoveries = 0  # times this session was rebuilt after its server lost it

    @property
    def store_key(self) -> str | None:
        """This session's key in the session store (None: not durable)."""
        return self._key.session if self._key is not None else None

    def _step(self, hidden_states: Any, attention_mask: Any = None, end: bool = False) -> Operation[np.ndarray]:
        if self.closed:
            raise UnknownSessionError(f"session {self.id} is closed", status=None)
        client = self.client
        if (self._restore is not None or self._prefix is not None) and not self.started:
            yield from self._open()
        info = (yield from client._metadata(client.session_model)) if client.validate else None
        tensors = _wire.step_tensors(info, hidden_states, attention_mask)
        self._sent = tensors[_wire.tokens_name(info, hidden_states)]  # its kind makes the END request
        try:
            answer = yield from self._send(tensors, end)
        except (SessionLostError, ServerUnavailableError) as error:
            if self._key is None or not self.started:
                raise
            yield from self._recover(error)
            answer = yield from self._send(tensors, end)
        self.started, self.closed, self.replica = True, end, answer.replica
        self.length = answer.length_or(self.length + answer.output.shape[1])
        if self._key is not None:
            yield from self._keep(tensors, end)
        return answer.output

    def _send(self, tensors: dict, end: bool) -> Operation[StepAnswer]:
        """One step on the server; SessionLostError when the server held the session and lost it."""
        try:
            return (
                yield from self.client._send_step(
                    self.id, tensors, start=not self.started, end=end, replica=self.replica
                )
            )
        except UnknownSessionError as error:
            self.closed = True  # the server does not know it: there is nothing left to end
            if not self.started and isinstance(error, SessionLostError):
                raise _not_opened(error) from None
            if self.started and error.kind == kinds.SEQUENCE_UNKNOWN:  # it held it: the process that did is gone
                raise SessionLostError(
                    f"session {self.id} is lost: the server held it and has forgotten it; {error.message}",
                    status=error.status,
                    kind=kinds.SEQUENCE_LOST,
                ) from None
            raise

    # --- durable sessions: checkpoints in the store, recovery from them --------------------------------

    def _keep(self, tensors: dict, end: bool) -> Operation[None]:
        """After a step: its kept tokens join the replay log; past the checkpoint interval, a
        checkpoint; at the end, the session's entry is forgotten."""
        if end:
            yield from self._forget()
            return
        new_tokens = next(tensors[name] for name in (names.INPUT_IDS, names.HIDDEN_STATES) if name in tensors)
        kept = real_tokens(new_tokens, tensors.get(names.ATTENTION_MASK))
        if kept.shape[1]:
            self._since.append(kept)
        if self.length >= self._next_checkpoint:
            yield from self._checkpoint()

    def _checkpoint(self) -> Operation[None]:
        """Write the positions added since the last checkpoint to the store (a snapshot of them,
        taken by the server); the replay log starts afresh. A failure keeps the log and waits
        `checkpoint_every` positions to try again: the session goes on either way."""
        client, since, length = self.client, self._checkpointed, self.length
        self._next_checkpoint = length + client.checkpoint_every
        if length == since:
            return
        try:
            blob = yield from self._snapshot(since)
            yield Local(lambda: client.store.append(self._key, since, length, blob))
        except ClientError as error:
            log.warning(
                "session %s: checkpoint of positions %d to %d not written (%s); until one is, a loss replays "
                "%d positions%s",
                self.id,
                since,
                length,
                error.message,
                length - since,
                "" if self._replayable else " it does not hold: the session could not be recovered",
            )
            return
        self._checkpointed, self._since, self._replayable = length, [], True

    def _recover(self, error: ClientError) -> Operation[None]:
        """Rebuild the lost session where a server answers: a START of a new sequence id (a proxy
        routes it to a live replica) restoring the store's increments, then the steps since the last
        checkpoint as one prefill. SessionLostError when the store cannot give the session back.
        Once rebuilt, the lost sequence is ENDed where it was, detached (Detach): a server that was
        unreachable but alive still holds it, and would hold its cache until its idle timeout."""
        client, lost, lost_replica, began = self.client, self.id, self.replica, time.monotonic()

        def gone(why: str) -> SessionLostError:
            return SessionLostError(
                f"session {lost} is lost ({error.message}) and cannot be recovered: {why}", kind=kinds.SEQUENCE_LOST
            )

        if not self._replayable:
            raise gone("the positions since its last checkpoint were never written to the store")
        try:
            ended, chunks = yield Local(lambda: (client.store.ended(self._key), client.store.chunks(self._key)))
        except StoreError as failure:
            raise gone(failure.message) from None
        if ended:
            self.closed, self._key = True, None
            raise UnknownSessionError(
                f"session {lost} was ended through another process (gateway); it is not rebuilt",
                kind=kinds.SEQUENCE_ENDED,
            )
        held = chunks[-1].end if chunks else 0
        if held != self._checkpointed:
            raise gone(f"the store holds positions 0 to {held} of the {self._checkpointed} checkpointed")
        info = yield from client._metadata(client.session_model)
        yield from self._restart([chunk.blob for chunk in chunks], info, began + client.recovery_timeout, gone)
        replayed = sum(tokens.shape[1] for tokens in self._since)
        for piece in _pieces(self._since, int(info.facts.get("max_request_tokens") or 0) or replayed):
            try:
                answer = yield from self._send({info.new_tokens: piece}, end=False)
            except ClientError as failure:
                raise gone(f"replaying the steps since its last checkpoint failed: {failure.message}") from None
            self.replica, self.length = answer.replica, answer.length_or(self.length)
        self.recoveries += 1
        yield Detach(self._end_abandoned(lost, lost_replica, info))
        log.warning(
            "session %s was lost (%s); recovered as session %s%s in %.0f ms: %d positions from the store, %d replayed",
            lost,
            error.message,
            self.id,
            f" on {self.replica}" if self.replica else "",
            1000 * (time.monotonic() - began),
            held,
            replayed,
        )

    def _end_abandoned(self, sequence_id: int, replica: str | None, info: ModelInfo) -> Operation[None]:
        """A best-effort END of a sequence this session no longer uses (a dead server's is unknown
        there: any answer will do)."""
        end = {info.new_tokens: info.no_tokens()}
        with contextlib.suppress(ClientError):
            yield from self.client._send_step(sequence_id, end, start=False, end=True, replica=replica)

    def _restart(self, blobs: list[bytes], info: ModelInfo, deadline: float, gone) -> Operation[None]:
        """START a new sequence holding `blobs` (none: empty), trying until `deadline` while no
        server can take it (a restarting replica, a model being reloaded). Every try STARTs the same
        new id: a START Triton's sequence batcher took holds a slot of the model until its END, and a
        model being reloaded is not let go while its slots are held (a new id a try kept it reloading
        past 30 s); a START of a live id restarts that sequence."""
        empty = info.no_tokens()
        self.id, self.replica, self.started, self.closed = _wire.new_sequence_id(), None, False, False
        tensors, parameters = {info.new_tokens: empty}, None
        if blobs:
            tensors[names.SNAPSHOT] = np.array([blobs], dtype=np.object_)
            parameters = {names.OPERATION: names.RESTORE, **self._owner}
        for attempt in itertools.count():
            self._sent = empty
            try:
                answer = yield from self._start(tensors, parameters, None, None)
                break
            except (ServerUnavailableError, ServerBusyError, SessionLostError, RequestTimeoutError) as failure:
                if time.monotonic() >= deadline:
                    raise gone(
                        f"no server took it within {self.client.recovery_timeout:g} s: {failure.message}"
                    ) from None
                yield Sleep(min(0.25 * 2**attempt, 1.0))  # a server coming back is not hurried
            except ClientError as failure:  # a refused restore: the store's entry is not this model's
                raise gone(failure.message) from None
        self.started, self.replica = True, answer.replica
        self.length = answer.length_or(0)

    def _after_rewind(self, length: int) -> Operation[None]:
        """The store and the replay log keep what the session keeps: the first `length` positions."""
        if length >= self._checkpointed:
            kept = np.concatenate(self._since, axis=1)[:, : length - self._checkpointed] if self._since else None
            self._since = [kept] if kept is not None and kept.shape[1] else []
            return
        try:
            self._checkpointed = yield Local(lambda: self.client.store.truncate(self._key, length))
        except StoreError as error:
            log.warning("session %s: its store entry could not follow a rewind (%s)", self.id, error.message)
            self._replayable = False
            return
        self._since, self._replayable = [], False  # [checkpointed, length) is only on the server now
        yield from self._checkpoint()

    def _forget(self) -> Operation[None]:
        """The session ended: its checkpoints go; a resumed one's are marked ended for its opener."""
        key, ends, self._key, self._ends = self._key, self._ends, None, None
        store = self.client.store
        with contextlib.suppress(StoreError):
            if key is not None:
                yield Local(lambda: store.delete(key))
            if ends is not None:
                yield Local(lambda: store.end(ends))

    def _open(self, fork_of: SessionCore | None = None) -> Operation[None]:
        """START the session without tokens: the server reserves its KV cache now, so a full budget
        (ServerBusyError) or a server that is down answers here rather than at the first step. With
        `restore`, the session starts holding that snapshot's cache; with `fork_of`, a copy of that
        live session's (on its replica)."""
        if self.started or self.closed:
            raise UnknownSessionError(f"session {self.id} is already {'closed' if self.closed else 'open'}")
        info = yield from self.client._metadata(self.client.session_model)
        self._sent = info.no_tokens()
        tensors, parameters, route_as, replica = {info.new_tokens: self._sent}, None, None, None
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
        self.length = answer.length_or(0)
        if self._key is not None and self.length:  # its start is in no log: only a checkpoint keeps it
            self._replayable = False
            yield from self._checkpoint()

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
                yield from self.client._send_step(self.id, _wire.no_tokens_like(self._sent), start=False, end=True)
            if not isinstance(error, InvalidInputError) or error.kind != kinds.PREFIX_UNKNOWN:
                self._sent = None
            raise

    def _snapshot(self, since: int = 0) -> Operation[bytes]:
        """The session's KV cache (from position `since`) as a blob; the session goes on unchanged."""
        parameters = {names.OPERATION: names.SNAPSHOT_OPERATION, **self._owner}
        if since:
            parameters[names.SNAPSHOT_SINCE] = since
        answer = yield from self._operate(parameters)
        if answer.snapshot is None:
            raise ClientError(f"the server's answer to the snapshot of session {self.id} has no '{names.SNAPSHOT}'")
        return answer.snapshot

    def _rewind(self, length: int) -> Operation[int]:
        """Keep the first `length` positions; the next step continues from there. The new length."""
        yield from self._operate({names.OPERATION: names.REWIND, names.REWIND_TO: int(length)})
        if self._key is not None:
            yield from self._after_rewind(self.length)
        return self.length

    def _attention_maps(self, hidden_states: Any) -> Operation[list[np.ndarray]]:
        """Per layer the attention weights (1, n_heads, T, length + T) that a step of `hidden_states`
        (1, T, d_model) would have, over what the session holds and the new tokens; the session is
        unchanged (its length, its cache: the tokens are not kept)."""
        client = self.client
        info = yield from client._metadata(client.session_model)
        tensors = _wire.step_tensors(info if client.validate else None, hidden_states)
        answer = yield from self._operate({names.OPERATION: names.ATTENTION_MAPS_OPERATION}, tensors)
        return _wire.read_attention_maps(answer.result)

    def _operate(self, parameters: dict, tensors: dict | None = None) -> Operation[StepAnswer]:
        """An operation on the open session; `tensors`: what it carries (none: hidden states of 0 tokens)."""
        self._check_open()
        info = yield from self.client._metadata(self.client.session_model)
        tensors = tensors or {info.new_tokens: info.no_tokens()}
        answer = yield from self.client._send_step(
            self.id, tensors, start=False, end=False, replica=self.replica, parameters=parameters
        )
        self.length = answer.length_or(self.length)
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
        yield from self._forget()
        if needs_end:
            if self._sent is None:  # resumed: the model says the width
                info = yield from self.client._metadata(self.client.session_model)
                self._sent = info.no_tokens()
            end = _wire.no_tokens_like(self._sent)
            with contextlib.suppress(UnknownSessionError):
                yield from self.client._send_step(self.id, end, start=False, end=True, replica=self.replica)

    # --- generation on the server (contract/generation.py, client/generation.py) -----------------------

    def _prepare_generation(self, ids: Any, request: generation.GenerationRequest) -> Operation[tuple]:
        """A generation's stream request and headers, checked against the served model; a session that
        starts from a snapshot or a prefix is opened first. Only gRPC streams (the gateway streams over
        HTTP as Server-Sent Events)."""
        if self.closed:
            raise UnknownSessionError(f"session {self.id} is closed", status=None)
        client = self.client
        client._session_module()  # gRPC only: an HTTP client is told so
        if (self._restore is not None or self._prefix is not None) and not self.started:
            yield from self._open()
        info = yield from client._metadata(client.session_model)
        if info.vocab_size is None:
            raise InvalidInputError(
                f"'{client.session_model}' is an attention model (hidden states in and out): only a whole model "
                "(token ids in, logits out) generates",
                input_name=names.INPUT_IDS,
            )
        prompt = _wire.as_array([] if ids is None else ids, names.INPUT_IDS)
        prompt = prompt.reshape(1, -1).astype(np.int64) if prompt.ndim <= 1 else prompt
        request = dataclasses.replace(request, session_start=not self.started)
        try:
            request.check(info.vocab_size, int(info.facts.get("max_seq_len", 1 << 62)))
            if prompt.ndim != 2 or prompt.shape[0] != 1:
                raise InputError(names.INPUT_IDS, f"expected shape [1, T] or [T], got {list(prompt.shape)}")
            check_token_values(info.sizes, {names.INPUT_IDS: prompt})
        except InputError as error:
            raise InvalidInputError(str(error), input_name=error.input_name) from None
        stream = stream_request(client.session_model, self.id, prompt, request, client._module, self._owner)
        self._sent = prompt
        return stream, affinity.step_headers(self.id, self.replica), prompt

    def _generate(
        self, ids: Any, request: generation.GenerationRequest, outcome: Outcome, prepared: tuple | None = None
    ) -> Operation[None]:
        """A generation on the server, for both clients (client/generation.py): each token an `Emit`, the session's
        bookkeeping at the end (`_generated`; an `end` generation's END after it). Sent again from the start where
        a loss before any token was recovered; the caller leaving (an Emit answered False) or an interrupt stops
        it on the server, its tokens answered meanwhile kept. `prepared`: the first `_prepare_generation`'s."""
        stream, prompt, timeout = None, np.zeros((1, 0), np.int64), self.client.timeout
        try:
            while True:
                try:
                    _leave(stream, outcome)
                    sent, headers, prompt = prepared or (yield from self._prepare_generation(ids, request))
                    prepared = None
                    opening = functools.partial(opened_stream, request=sent, headers=headers)
                    stream = yield Call(opening, "generate", retry=False)
                    while outcome.finish_reason is None:
                        token = yield from _received(stream, outcome, timeout)
                        if token is not None and not (yield Emit(token)):
                            with contextlib.suppress(Exception):  # a stream broken meanwhile holds what it held
                                yield from _stopped(stream, sent, headers, outcome, timeout)
                            return
                    return
                except ClientError as error:
                    if outcome.tokens or not (yield from self._recover_for_generation(error)):
                        raise
        except BaseException as error:  # an interrupt, a task cancelled: stopped on the server as a caller leaving
            if not isinstance(error, Exception) and stream is not None and outcome.finish_reason is None:
                with contextlib.suppress(Exception):
                    yield from _stopped(stream, sent, headers, outcome, timeout)
            raise
        finally:
            _leave(stream, outcome)
            yield from self._generated(prompt, outcome.tokens, outcome.held_length)
            if request.session_end:  # the server ended the session with the generation: Triton's slot goes with END
                with contextlib.suppress(ClientError):  # best effort: Triton's idle timeout frees it otherwise
                    yield from self._close()

    def _recover_for_generation(self, error: ClientError) -> Operation[bool]:
        """Before any token: a durable session its server lost is rebuilt, and the generation is then sent
        again. Anything else is the generation's error."""
        held_and_forgotten = isinstance(error, UnknownSessionError) and error.kind == kinds.SEQUENCE_UNKNOWN
        lost = isinstance(error, SessionLostError | ServerUnavailableError) or held_and_forgotten
        if not self.started and isinstance(error, SessionLostError):
            raise _not_opened(error) from None
        if self._key is None or not self.started or not lost:
            if held_and_forgotten and self.started:  # as a step says it (`_send`), not in Triton's words
                raise SessionLostError(
                    f"session {self.id} is lost: the server held it and has forgotten it (it restarted, or the "
                    f"replica holding it died) and this client keeps no log to rebuild it from; {error.message}",
                    status=error.status,
                    kind=kinds.SEQUENCE_LOST,
                ) from None
            return False
        yield from self._recover(error)
        return True

    def _generated(self, prompt: np.ndarray, answered: list[int], held: int | None) -> Operation[None]:
        """After a generation (whole, stopped early or failed): the session holds the prompt and every
        token the server answered (each was stepped in before it was answered); a durable session's log
        keeps them, so that a rebuilt session continues the same text."""
        if not self.started and held is None and not answered:
            return  # nothing reached the server's session: it may not even have started
        self.started = True
        self.length = held if held is not None and held >= 0 else self.length + prompt.shape[1] + len(answered)
        if self._key is not None:
            kept = np.concatenate([prompt, np.array([answered], np.int64).reshape(1, -1)], axis=1)
            yield from self._keep({names.INPUT_IDS: kept}, end=False)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open" if self.started else "new"
        return f"<{type(self).__name__} {self.id} {state}, {self.length} tokens>"


def _received(stream: Any, outcome: Outcome, timeout: float) -> Operation[int | None]:
    """A generation's next response read into `outcome`: its token, None for the final one and the prompt's scores."""
    try:
        response, failure = yield Call(lambda _: stream.receive(timeout), "generate", retry=False)
    except TimeoutError:
        raise RequestTimeoutError(f"no token from the server in {timeout:g} s") from None
    return outcome.read(response, failure)


def _stopped(stream: Any, sent: dict, headers: dict, outcome: Outcome, timeout: float) -> Operation[None]:
    """Ask the server to stop the generation before its next token, and read what it still answers up to its final
    response: the tokens it stepped in meanwhile are the session's too (kept in `outcome`)."""
    yield Call(lambda stub: affinity.send(stub, headers=headers, **stop_request(sent)), "stop", retry=False)
    while outcome.finish_reason is None:
        yield from _received(stream, outcome, timeout)


def _leave(stream: Any, outcome: Outcome) -> None:
    """A generation's stream left: cancelled where the server may still answer (it drops the request within a step)."""
    if stream is not None and not outcome.answered:
        stream.cancel()


def generation_request(
    max_new_tokens: int = generation.DEFAULT_MAX_NEW_TOKENS,
    stop_token_ids: Sequence[int] = (),
    prompt_logprobs: int | None = None,
    reuse_prefix: bool = False,
    grammar: Grammar | None = None,
    **sampling: Any,
) -> generation.GenerationRequest:
    """The request of `generate`'s keyword arguments (SamplingParams' fields besides these five)."""
    unknown = sorted(set(sampling) - set(generation.SAMPLING_FIELDS))
    if unknown:
        raise TypeError(f"unknown generation arguments {unknown}; sampling takes {list(generation.SAMPLING_FIELDS)}")
    return generation.GenerationRequest(
        max_new_tokens=max_new_tokens,
        stop_token_ids=tuple(stop_token_ids),
        sampling=SamplingParams(**sampling),
        prompt_logprobs=prompt_logprobs,
        reuse_prefix=reuse_prefix,
        grammar=grammar,
    )


def _pieces(steps: list[np.ndarray], cap: int) -> list[np.ndarray]:
    """The tokens of `steps` (each (1, T, d)) as one sequence, in pieces of at most `cap` tokens."""
    if not steps:
        return []
    tokens = np.concatenate(steps, axis=1)
    return [tokens[:, begin : begin + cap] for begin in range(0, tokens.shape[1], cap)]


def _one_token(info: ModelInfo) -> np.ndarray:
    """One sequence's one new token, what a probe sends: id 0 of a whole model, else a zero hidden state."""
    if info.vocab_size is not None:
        return np.zeros((1, 1), np.int64)
    return np.zeros((1, 1, info.d_model), info.float_dtype)


def _not_opened(error: SessionLostError) -> ServerUnavailableError:
    """A session whose first request met a dead model process: nothing was lost (it never started); the model
    is unavailable until it is reloaded."""
    return ServerUnavailableError(
        f"the session model cannot open a session now (its process died; it is being reloaded): {error.message}",
        status=error.status,
    )
