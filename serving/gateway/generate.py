"""Generation through the gateway: `POST /v1/sessions/{id}/generate` and `POST /v1/generate` (stateless).

The server generates (contract/generation.py: a whole model's session model, in its engine core). The
gateway checks a request once (`checked`: the contract's own checks, 400 naming the field), runs it
through the client library's `AsyncGeneration` and answers (`answer`) either one JSON object once it
ends, or, with `stream: true`, Server-Sent Events as the tokens come:

    data: {"token_id": 17, "logprob": -0.41}                 one per token (and `top` when logprobs are asked)
    data: {"finish_reason": "length", "held_length": 12}
    data: [DONE]                                             OpenAI's end marker

The stream starts only once the first token is in hand, so an error before it (a bad prompt Triton
refuses, a lost session, a full KV budget) answers with its status, as every route's errors do; an error
after it is an `event: error` whose data is the error body, and the stream ends there.

Time: the first token comes within the request's deadline (SERVING_REQUEST_TIMEOUT_S from its arrival),
each next one within that long of the one before: a long generation is not cut off by a deadline meant
for one step, and a stalled one still ends.

A client that leaves mid-stream cancels the generation (the server stops within one step; a session
keeps the prompt and the tokens answered). Each token is pulled by a task of its own: Starlette cancels
the response's body on a disconnect inside an anyio scope, which cancels every await made there again,
and would cut short the generation's own closing (its stream, its session's bookkeeping). The response
closes the generation after the body, outside that scope (`EventStream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import orjson
from fastapi import Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from client import ModelInfo
from client.generation import AsyncGeneration, Token
from contract import generation, names
from contract.grammar import Grammar
from contract.inputs import InputError
from contract.sampling import LOGIT_BIAS_LIMIT, SamplingParams
from serving.gateway import schemas, upstream
from serving.gateway.errors import ApiError, InvalidInput, SchemaViolation, error_body
from serving.gateway.state import GatewayState

log = logging.getLogger(__name__)
EVENT_STREAM = "text/event-stream"
DONE = b"data: [DONE]\n\n"
# proxies (nginx) buffer a response unless told not to: each token must reach the caller as it comes
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
INT64_LIMIT = 1 << 63  # integer request parameters travel to Triton as int64
UNPUBLISHED_MAX_SEQ_LEN = 1 << 62  # a model whose config does not say: the server's own check decides
OnError = Callable[[ApiError], ApiError]  # what a route makes of an upstream error (a session's: renamed, broken)


@dataclasses.dataclass(frozen=True)
class CheckedGenerate:
    """A generation request checked against the served model."""

    ids: np.ndarray | None  # the prompt (1, T) int64; None: go on after what the session holds
    arguments: dict[str, Any]  # AsyncSession.generate's keyword arguments
    logprobs: bool  # answer each token's logprob and its top alternatives
    stream: bool

    @property
    def positions(self) -> int:
        """The most positions it adds to its session: the prompt and every new token (the key's quota)."""
        return (0 if self.ids is None else self.ids.shape[1]) + self.arguments["max_new_tokens"]


def checked(body: schemas.GenerateBody, info: ModelInfo, model: str, *, stateless: bool) -> CheckedGenerate:
    """The request of a parsed body for the session model `info` (named `model`), or 400 naming the field."""
    if info.vocab_size is None:
        raise InvalidInput(
            f"input '{names.INPUT_IDS}': '{model}' is an attention model (hidden states in and out): only a whole "
            "model (token ids in, logits out) generates"
        )
    if stateless and body.input_ids is None:
        raise SchemaViolation("body.input_ids: Field required (a stateless generation starts from its prompt)")
    if body.top_k is not None and body.top_k >= INT64_LIMIT:  # the contract takes any size; Triton's int64 cannot
        raise InvalidInput(f"input 'top_k': expected None or an integer in [0, 2**63), got {body.top_k}")
    sampling = {name: getattr(body, name) for name in generation.SAMPLING_FIELDS}
    sampling["logprobs"] = body.logprobs or 0
    sampling["logit_bias"] = logit_bias(body.logit_bias, info.vocab_size)
    max_seq_len = int(info.facts.get("max_seq_len", UNPUBLISHED_MAX_SEQ_LEN))
    try:
        grammar = None if body.grammar is None else Grammar.of(body.grammar)
        request = generation.GenerationRequest(
            body.max_new_tokens, tuple(body.stop_token_ids), SamplingParams(**sampling), grammar=grammar
        )
        request.check(info.vocab_size, max_seq_len)
        ids = None if body.input_ids is None else prompt(body.input_ids, info.vocab_size, max_seq_len, stateless)
    except InputError as error:
        raise InvalidInput(str(error)) from None
    limits = {"max_new_tokens": request.max_new_tokens, "stop_token_ids": request.stop_token_ids, "grammar": grammar}
    return CheckedGenerate(ids, limits | sampling, body.logprobs is not None, body.stream)


def logit_bias(given: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as strings) to biases, checked against the vocabulary and the limit."""
    pairs = []
    for key, bias in (given or {}).items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise InvalidInput(f"logit_bias: keys are token ids in [0, {vocab_size}), got {key!r}", param="logit_bias")
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            limit = LOGIT_BIAS_LIMIT
            raise InvalidInput(f"logit_bias: biases lie in [-{limit}, {limit}], got {bias} for {key}", "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def prompt(given: list, vocab_size: int, max_seq_len: int, stateless: bool) -> np.ndarray:
    """The prompt (1, T) of `input_ids` as the body has them, (T,) or (1, T); raises InputError. The ids are
    checked as Python ints, before numpy could overflow on one past int64."""
    rows = given if given and isinstance(given[0], list) else [given]
    if len(rows) != 1:
        raise InputError(
            names.INPUT_IDS, f"a generation continues one sequence: expected (T,) or (1, T), got {len(rows)} rows"
        )
    row = rows[0]
    if len(row) > max_seq_len:  # a session's own length is the server's to check: its message names the session
        raise InputError(names.INPUT_IDS, f"expected at most max_seq_len = {max_seq_len} tokens, got {len(row)}")
    outside = next((at for at, token in enumerate(row) if not 0 <= token < vocab_size), None)
    if outside is not None:
        raise InputError(
            names.INPUT_IDS,
            f"token ids must lie in [0, {vocab_size}) (vocab_size), got {row[outside]} at index {outside}",
        )
    if stateless and not row:
        raise InputError(names.INPUT_IDS, "a stateless generation needs a prompt of at least one token, got none")
    return np.asarray(row, np.int64).reshape(1, -1)


class Pull:
    """A generation's tokens as the gateway answers them: each pulled by a task of its own (see the module),
    the first within the request's deadline and each next within the request timeout of the one before,
    errors as ApiErrors passed through the route's `on_error`."""

    def __init__(
        self, gw: GatewayState, tokens: AsyncGeneration, what: str, on_error: OnError, prompt_tokens: int = 0
    ) -> None:
        """`what`: the generation as error messages name it; `prompt_tokens`: what it prefills."""
        self.gw, self.tokens, self.what, self.on_error = gw, tokens, what, on_error
        self.timer = gw.metrics.generation(prompt_tokens)  # waiting until its first token, running until close()
        self._pending: asyncio.Future | None = None

    async def next(self) -> Token | None:
        """The next token; None once the generation ended (`tokens.outcome` says how)."""
        first = self._pending is None
        self._pending = asyncio.ensure_future(self._pulled(first))
        return await asyncio.shield(self._pending)

    async def _pulled(self, first: bool) -> Token | None:
        try:
            if first:
                return await self.gw.call(self._one(), self.what)
            timeout_s = self.gw.settings.request_timeout_s
            deadline = asyncio.get_running_loop().time() + timeout_s
            metrics = self.gw.metrics
            return await upstream.call(
                self._one(), deadline=deadline, timeout_s=timeout_s, metrics=metrics, what=self.what
            )
        except ApiError as error:
            raise self.on_error(error) from None

    async def _one(self) -> Token | None:
        try:
            await anext(self.tokens)
        except StopAsyncIteration:
            return None
        self.timer.token()
        return self.tokens.logprobs[-1]

    async def close(self) -> None:
        """Cancel the generation if it is still going (the server stops within one step) and close it."""
        self.timer.end()
        pending = self._pending
        if pending is not None:
            pending.cancel()  # none once it is done; else its own cancellation ends the generation, closing included
            await asyncio.wait([pending])
            if not pending.cancelled():
                pending.exception()  # seen: an error the caller left before is no "never retrieved" warning
        try:
            await self.tokens.aclose()
        except Exception:  # the answer is out already: what closing failed at is for the logs
            log.warning("closing %s failed", self.what, exc_info=True)


async def answer(
    gw: GatewayState,
    tokens: AsyncGeneration,
    asked: CheckedGenerate,
    what: str,
    on_error: OnError,
    held: contextlib.AsyncExitStack,
) -> Response:
    """The route's answer for `tokens`. It takes over `held` (what the route holds for the generation: its
    session), closed once the answer is written or the stream has ended."""
    pull = Pull(gw, tokens, what, on_error, 0 if asked.ids is None else asked.ids.shape[1])
    held.push_async_callback(pull.close)
    if not asked.stream:
        async with held:
            return Response(await _collected(pull, asked.logprobs), media_type="application/json")
    try:
        first = await pull.next()
    except BaseException:
        await held.aclose()
        raise
    return EventStream(_events(pull, first, asked.logprobs, held), held)


async def _collected(pull: Pull, logprobs: bool) -> bytes:
    while await pull.next() is not None:
        pass
    outcome = pull.tokens.outcome
    answered: dict[str, Any] = {"token_ids": outcome.tokens} | _final(pull.tokens)
    if logprobs:
        answered["logprobs"] = [_token(token, logprobs) for token in outcome.logprobs]
    return orjson.dumps(answered)


def _final(tokens: AsyncGeneration) -> dict[str, Any]:
    # the final response carries both; a stateless generation's sequence is ended with it: -1, nothing held
    return {"finish_reason": tokens.finish_reason, "held_length": max(tokens.held_length, 0)}


def _token(token: Token, logprobs: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"token_id": token.id, "logprob": token.logprob}
    if logprobs:
        entry["top"] = [{"token_id": top_id, "logprob": top_logprob} for top_id, top_logprob in token.top]
    return entry


async def _events(
    pull: Pull, first: Token | None, logprobs: bool, held: contextlib.AsyncExitStack
) -> AsyncIterator[bytes]:
    token = first
    try:
        while token is not None:
            yield event(_token(token, logprobs))
            token = await pull.next()
        last = [event(_final(pull.tokens)), DONE]
    except ApiError as error:
        last = [event(error_body(error.status, error.code, error.message, error.param), "error")]
    except Exception:  # as the app's handler answers one: logged with its traceback, the caller told no more
        log.exception("unexpected error in %s", pull.what)
        last = [event(error_body(500, "internal", "internal error; it is logged on the server"), "error")]
    # the generation has ended: its session is let go before the caller reads the end, so that a request
    # sent on [DONE] finds it free
    await held.aclose()
    for chunk in last:
        yield chunk


def event(data: dict[str, Any], name: str | None = None) -> bytes:
    """One Server-Sent Event: its JSON on one `data:` line (orjson writes no newlines), and its name if any."""
    named = f"event: {name}\n".encode() if name else b""
    return named + b"data: " + orjson.dumps(data) + b"\n\n"


class EventStream(StreamingResponse):
    """A Server-Sent Events response that closes what it holds (`held`: the generation, its session) once
    it is done, whatever ended it: the body closes it first when the generation ends; a disconnect cancels
    the body, and then it is closed here, after Starlette's cancel scope, so that the closing's awaits are
    not cancelled in turn."""

    def __init__(self, events: AsyncIterator[bytes], held: contextlib.AsyncExitStack) -> None:
        super().__init__(events, media_type=EVENT_STREAM, headers=STREAM_HEADERS)
        self.held = held

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.held.aclose()
