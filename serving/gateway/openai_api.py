"""The OpenAI-compatible routes: `POST /v1/completions` and `POST /v1/chat/completions`, plain and streamed.

Text goes in and out through the model's own tokenizer and chat template (client/text.py), fetched once from
the generation model, which serves the files its checkpoint came with. Each choice is a generation on the
server (contract/generation.py) in a session of its own; its text is detokenized as the tokens come
(client.text.Detokenizer), so streamed pieces add up to exactly the text answered whole, stop strings left out.

Prefix reuse is the engine core's (serving/engine/core.py): each choice is a stateless generation with
`reuse_prefix`, so the server starts it from the longest kept row of the same key (owner) that shares its
prompt's beginning, prefills only the rest, and keeps its row for the next request; whichever gateway sent the
earlier one. `usage.prompt_tokens_details.cached_tokens` says how many prompt ids were reused. `n` choices
share one prefill: the prompt is generated with no new token first (its row kept), then each choice starts from
that row. A request naming a `session` the key holds goes on in that session.

Errors are OpenAI's shape (errors.py), 400 for a bad field with `param` naming it; a streamed answer that fails
after its first chunk ends with a `data:` error object, then `data: [DONE]`, as vLLM's server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ValidationError

from client.chat_template import TemplateFailed
from client.generation import Token
from client.text import Detokenizer, TextError, TextModel
from contract import generation
from contract.grammar import GRAMMAR, Grammar
from serving.gateway import openai_schemas as schemas
from serving.gateway import structured
from serving.gateway.errors import (
    ApiError,
    InvalidInput,
    SessionConflict,
    UnsupportedMediaType,
    UpstreamTimeout,
    error_body,
    responses,
)
from serving.gateway.generate import DONE, EventStream, Pull, event, logit_bias
from serving.gateway.routes import Caller, body_documented, caller, media_type_of, naming, the_gateway
from serving.gateway.sessions import GatewaySession
from serving.gateway.state import GatewayState, WholeModel
from serving.gateway.templates import TemplateLimit

log = logging.getLogger(__name__)
openai = APIRouter(prefix="/v1", dependencies=[Depends(caller)], tags=["openai"])
BODY_MODELS = (schemas.CompletionBody, schemas.ChatBody)
FINISH = {generation.STOP: "stop", generation.LENGTH: "length", generation.SESSION_FULL: "length"}


# --- what a request asks -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Asked:
    """A request checked against the served model: its prompts (ids), how many choices each, how to pick."""

    chat: bool
    prompts: list[np.ndarray]  # each (T,) int64
    echo_texts: list[str]  # each prompt as text (completions with echo; empty otherwise)
    n: int
    max_new: list[int]  # per prompt
    sampling: dict[str, Any]  # SamplingParams' fields
    stop_ids: tuple[int, ...]
    stops: list[str]
    logprobs: int | None  # the top N with each generated token's logprob; None: no logprobs
    prompt_logprobs: int | None  # echo with logprobs: the prompt's too
    stream: bool
    include_usage: bool
    session: str | None
    grammar: Grammar | None = None  # what the text must match (response_format, a tool choice)
    constrained_by: str | None = None  # the field that asked it (an error about it names that field)
    tools: structured.Tools | None = None


async def json_body(request: Request) -> bytes:
    """The body of a JSON route: JSON (or no Content-Type: read as JSON); anything else a 415. A web page may send
    a form or text/plain to any address without asking first, never application/json: these bodies are not
    taken as JSON."""
    media_type = media_type_of(request)
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise UnsupportedMediaType(
            f"Content-Type: expected application/json, got {request.headers['content-type'][:80]!r}"
        )
    return await request.body()


def parsed(raw: bytes, schema: type[BaseModel]) -> Any:
    """The body, or 400 in OpenAI's shape naming the first offending field."""
    try:
        body = schema.model_validate(orjson.loads(raw))
    except orjson.JSONDecodeError as error:
        raise InvalidInput(f"the body is not valid JSON: {error}") from None
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise InvalidInput(f"{where}: {first['msg']}", param=where) from None
    for name, why in body.refused():
        raise InvalidInput(f"{name}: {why}", param=name)
    return body


async def asked_of(body: schemas.Common, whole: WholeModel, chat: bool, gw: GatewayState) -> Asked:
    text, max_seq_len, settings = whole.text, whole.max_seq_len, gw.settings
    stops, most = body.stops(), settings.max_stop_strings
    if len(stops) > most or any(not stop for stop in stops):
        found = f"{len(stops)}" if len(stops) > most else f"{stops!r}"
        raise InvalidInput(
            f"stop: expected at most {most} non-empty strings (SERVING_MAX_STOP_STRINGS), got {found}", param="stop"
        )
    if body.session is not None and body.n != 1:
        raise InvalidInput(f"n: a request bound to a session makes one choice, got n={body.n}", param="n")
    grammar, constrained_by, tools = _constraint(body, text, chat, settings.tool_call_parser)
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if chat:
        prompts, echo_texts, logprobs, prompt_logprobs = await _chat_prompt(body, text, tools, gw)
    else:
        prompts, echo_texts, logprobs, prompt_logprobs = await _completion_prompts(body, text, gw)
    max_new = [_room(len(ids), limit, max_seq_len) for ids in prompts]
    if not chat and not body.echo and 0 in max_new and limit == 0:
        raise InvalidInput("max_tokens: 0 generates nothing; it goes with echo (the prompt scored)", param="max_tokens")
    sampling = {
        "temperature": float(body.temperature),
        "top_p": None if body.top_p >= 1 else float(body.top_p),
        "top_k": body.top_k if body.top_k and body.top_k > 0 else None,
        "min_p": None if body.min_p is None else float(body.min_p),
        "repetition_penalty": float(body.repetition_penalty),
        "presence_penalty": float(body.presence_penalty),
        "frequency_penalty": float(body.frequency_penalty),
        "seed": body.seed,
        "logprobs": logprobs or 0,
        "logit_bias": logit_bias(body.logit_bias, text.vocab_size),
    }
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Asked(
        chat=chat,
        prompts=prompts,
        echo_texts=echo_texts,
        n=body.n,
        max_new=max_new,
        sampling=sampling,
        stop_ids=() if body.ignore_eos else tuple(text.eos_token_ids),
        stops=stops,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stream=body.stream,
        include_usage=include_usage,
        session=body.session,
        grammar=grammar,
        constrained_by=constrained_by,
        tools=tools,
    )


def _constraint(
    body: schemas.Common, text: TextModel, chat: bool, tool_call_parser: str
) -> tuple[Grammar | None, str, structured.Tools | None]:
    """What the answer's text must match, the field that asks it, and the chat's tools."""
    extra = {**(body.model_extra or {}), **body.model_dump(include=CONSTRAINT_FIELDS, exclude_none=True)}
    grammar, constrained_by = structured.response_grammar(extra)
    tools = structured.tools_of(extra, _template_text(text), tool_call_parser) if chat else None
    if not chat and extra.get("tools"):
        raise InvalidInput("tools: tool calls are a chat's (POST /v1/chat/completions)", param="tools")
    if tools is not None and tools.grammar() is not None:
        if grammar is not None:
            raise InvalidInput(
                f"tool_choice: '{tools.choice}' constrains the text to tool calls; {constrained_by} asks another "
                "form: give one of them",
                param="tool_choice",
            )
        grammar, constrained_by = tools.grammar(), "tool_choice"
    if grammar is not None and (body.ignore_eos or not text.eos_token_ids):
        raise InvalidInput(
            f"{constrained_by}: a constrained answer ends at the end-of-text token, which "
            + ("ignore_eos leaves out" if body.ignore_eos else "this model's tokenizer does not name"),
            param=constrained_by,
        )
    return grammar, constrained_by, tools


CONSTRAINT_FIELDS = {
    "response_format",
    *structured.GUIDED,
    "structured_outputs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}


TEMPLATE_ARGUMENTS = frozenset({"messages", "add_generation_prompt"})  # the request's own fields give these


def _template_text(text: TextModel) -> str | None:
    template = text.chat_template
    return "\n".join(template.values()) if isinstance(template, dict) else template


async def _chat_ids(
    body: schemas.ChatBody, text: TextModel, tools: structured.Tools | None, gw: GatewayState
) -> np.ndarray:
    given = [message.model_dump(exclude_none=True) for message in body.messages]
    messages = structured.template_messages([_text_content(at, message) for at, message in enumerate(given)])
    extra = body.chat_template_kwargs or {}
    taken = sorted(TEMPLATE_ARGUMENTS & extra.keys())
    if taken:
        raise InvalidInput(
            f"chat_template_kwargs: {', '.join(taken)}: given by the request's own field of that name, not here",
            param="chat_template_kwargs",
        )
    try:
        if tools is not None:
            extra = {**extra, "tools": tools.tools}
        source, variables = text.chat_call(messages, add_generation_prompt=body.add_generation_prompt, **extra)
        rendered = await gw.templates.render(source, variables)  # in a worker process, bounded
    except (TextError, TemplateFailed, TemplateLimit) as error:
        raise InvalidInput(f"messages: {error}", param="messages") from None
    # the template writes the special tokens, so none is added around it (transformers' apply_chat_template)
    return np.asarray(await gw.encode(text, rendered, add_special_tokens=False), np.int64)


def _text_content(at: int, message: dict[str, Any]) -> dict[str, Any]:
    """The message with its content as text: a list of content parts (OpenAI's multimodal shape, which the SDK
    and LangChain send) joined by newlines, as vLLM gives a template that takes text; a part that is not text is
    a 400 naming it."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            where = f"messages[{at}].content[{index}]"
            raise InvalidInput(
                f"{where}: expected a text part ({{'type': 'text', 'text': ...}}), got type {kind!r}: this model "
                "reads text only",
                param="messages",
            )
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


async def _chat_prompt(body: Any, text: TextModel, tools: Any, gw: GatewayState) -> tuple:
    """A chat's prompt ids (its messages rendered), no echo, its logprobs and no prompt logprobs."""
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidInput("top_logprobs: needs logprobs: true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return [await _chat_ids(body, text, tools, gw)], [], logprobs, None


async def _completion_prompts(body: Any, text: TextModel, gw: GatewayState) -> tuple:
    """A completion's prompts' ids, their texts when echoed, its logprobs and its prompts' logprobs."""
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidInput(
            f"best_of: only best_of equal to n (every choice answered) is supported, got best_of={body.best_of} "
            f"and n={body.n}",
            param="best_of",
        )
    prompts = await _completion_ids(_prompts(body.prompt, body.n, gw.settings.sessions_per_key), text, gw)
    if len(prompts) > 1 and body.session is not None:
        raise InvalidInput("prompt: a request bound to a session takes one prompt", param="prompt")
    echo_texts = [text.decode(ids.tolist(), skip_special_tokens=False) for ids in prompts] if body.echo else []
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    return prompts, echo_texts, body.logprobs, prompt_logprobs


def _prompts(prompt: Any, n: int, sessions_per_key: int) -> list:
    """A completion's prompts as a list: at least one, and no more than a key may run at once (each choice of
    each prompt is a session while it runs), checked before any is tokenized."""
    one = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
    prompts = [prompt] if one else list(prompt)
    if not prompts:
        raise InvalidInput("prompt: expected at least one prompt, got none", param="prompt")
    if len(prompts) * n > sessions_per_key:
        raise InvalidInput(
            f"prompt: {len(prompts)} prompts of n={n} choices each run {len(prompts) * n} sessions at once, more than "
            f"the {sessions_per_key} an API key may hold (SERVING_SESSIONS_PER_KEY)",
            param="prompt",
        )
    return prompts


async def _completion_ids(prompts: list, text: TextModel, gw: GatewayState) -> list[np.ndarray]:
    """Each prompt's ids: texts are encoded (with the tokenizer's special tokens, as transformers does),
    ids are taken as given (checked against the vocabulary)."""
    found = []
    for at, given in enumerate(prompts):
        try:
            ids = await gw.encode(text, given) if isinstance(given, str) else list(given)
        except TextError as error:
            raise InvalidInput(f"prompt[{at}]: {error}", param="prompt") from None
        if not ids:
            raise InvalidInput(f"prompt[{at}]: encodes to no tokens; give at least one", param="prompt")
        outside = [token for token in ids if not 0 <= token < text.vocab_size]
        if outside:
            vocab = text.vocab_size
            raise InvalidInput(f"prompt[{at}]: token ids must lie in [0, {vocab}), got {outside[:3]}", "prompt")
        found.append(np.asarray(ids, np.int64))
    return found


def _room(prompt: int, limit: int | None, max_seq_len: int) -> int:
    """New tokens a prompt of `prompt` tokens may get: `limit`, or all the room left (None); 400 past it."""
    room = max_seq_len - prompt
    if room < 0 or (limit is None and room == 0):
        raise InvalidInput(
            f"the prompt is {prompt} tokens; this model's context is {max_seq_len} (max_seq_len), so it leaves no room "
            "for a completion",
            param="messages" if limit is None else "prompt",
        )
    if limit is not None and limit > room:
        raise InvalidInput(
            f"max_tokens: the prompt ({prompt} tokens) and {limit} new tokens exceed this model's context of "
            f"{max_seq_len} (max_seq_len); ask for at most {room}",
            param="max_tokens",
        )
    return room if limit is None else limit


# --- one choice --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Lease:
    """A session a choice generates in: the ids it still has to send, and what it does afterwards."""

    upstream: Any  # client.AsyncSession
    send: np.ndarray  # the prompt ids the session does not hold yet (>= 1)
    held_before: np.ndarray  # the prompt ids it holds already (a bound session's)
    bound: GatewaySession | None = None  # the caller's own session; None: a stateless generation


def shared_prefix(held: np.ndarray, prompt: np.ndarray) -> int:
    """How many leading ids `held` and `prompt` share."""
    n = min(len(held), len(prompt))
    differ = np.flatnonzero(held[:n] != prompt[:n])
    return int(differ[0]) if differ.size else n


@dataclasses.dataclass
class Choice:
    index: int
    prompt: int  # which prompt
    lease: Lease
    detokenizer: Detokenizer
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Token] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    prompt_scores: list[Token | None] = dataclasses.field(default_factory=list)
    calls: structured.CallReader | None = None  # its text read for tool calls (a chat with tools)


class Run:
    """One request's choices: their sessions, generations, text and the sessions kept afterwards."""

    def __init__(self, gw: GatewayState, owner: str, asked: Asked, whole: WholeModel) -> None:
        self.gw, self.owner, self.asked = gw, owner, asked
        self.text, self.model, self.client = whole.text, whole.id, whole.client
        self.choices: list[Choice] = []
        self.cached = 0  # prompt tokens reused from a kept row
        self.created = int(time.time())
        self.id = ("chatcmpl-" if asked.chat else "cmpl-") + secrets.token_hex(12)
        self.held = contextlib.AsyncExitStack()
        self._pulls: list[Pull] = []
        self._owned: list[Any] = []  # the stateless generations' sessions (counted in the key's quota meanwhile)
        self._bound: GatewaySession | None = None
        self._scores: list[Token | None] = []  # n choices: the prompt's scores from its one prefill

    # sessions ------------------------------------------------------------------------------------------------

    async def lease(self) -> None:
        """A session for every choice (opened, forked, or the caller's own), each prompt prefilled once."""
        if self.asked.session is not None:
            if self.client is not self.gw.client:
                raise InvalidInput(
                    f"session: '{self.model}' is '{self.client.session_model}', and the sessions of /v1/sessions are "
                    f"'{self.gw.settings.session_model}''s: a session cannot be bound across models",
                    param="session",
                )
            self._bound = await self.held.enter_async_context(self.gw.sessions.using(self.asked.session, self.owner))
        else:
            self.held.enter_context(self.gw.in_flight(self.owner, self.asked.n * len(self.asked.prompts)))
        # ended before the caller's session is let go (the stack unwinds in reverse), whatever ends the request
        self.held.push_async_callback(self.end)
        if self._bound is not None:
            lease = await self._bound_lease(self._bound, self.asked.prompts[0])
            self._add_choices(0, [lease])
            return
        for at, ids in enumerate(self.asked.prompts):
            if self.asked.n > 1:
                await self._prefill_once(ids)
            self._add_choices(at, [Lease(await self._stateless(), ids, ids[:0]) for _ in range(self.asked.n)])

    def _add_choices(self, prompt: int, leases: list[Lease]) -> None:
        for lease in leases:
            context = np.concatenate([lease.held_before, lease.send])
            detokenizer = Detokenizer(self.text, context.tolist(), stop=self.asked.stops)
            calls = None if self.asked.tools is None else self.asked.tools.reader()
            self.choices.append(Choice(len(self.choices), prompt, lease, detokenizer, calls=calls))

    async def _bound_lease(self, session: GatewaySession, ids: np.ndarray) -> Lease:
        upstream = session.upstream
        if upstream.length == 0:
            return Lease(upstream, ids, ids[:0], session)
        if session.tokens is None or len(session.tokens) != upstream.length:  # stepped elsewhere since
            raise SessionConflict(
                f"session '{self.asked.session}' holds {upstream.length} positions this gateway did not see as text; "
                "only a session whose text came through these routes (or an empty one) can be extended by a prompt"
            )
        keep = min(shared_prefix(session.tokens, ids), len(ids) - 1)
        if keep < upstream.length:
            with naming(session):
                await self.gw.call(upstream.rewind(keep), "rewinding the session to where the prompt parts")
        self.cached = keep
        return Lease(upstream, ids[keep:], ids[:keep], session)

    async def _stateless(self) -> Any:
        """A new session of the key for one stateless generation (sent with its first request), counted in the
        key's quota while it runs."""
        session = self.client.session(owner=self.owner)
        self._owned.append(session)
        self.gw.quotas.opened(self.owner, session)
        return session

    async def _prefill_once(self, ids: np.ndarray) -> None:
        """`n` choices of one prompt: the prompt generated once with no new token, its row kept by the server,
        so that each choice starts from it (scored here if asked)."""
        session = await self._stateless()
        self.gw.metrics.prompt_tokens.inc(len(ids))  # the choices' own generations each send one token more
        self.gw.quotas.grow(self.owner, session, len(ids))
        generated = session.generate(
            ids, max_new_tokens=0, prompt_logprobs=self.asked.prompt_logprobs, end=True, reuse_prefix=True
        )
        await self.gw.call(_drained(generated), "prefilling the prompt of n choices")
        self._scores = generated.prompt_logprobs
        self.cached = max(self.cached, generated.cached_tokens)

    # generations ---------------------------------------------------------------------------------------------

    def start(self) -> list[Pull]:
        """Each choice's generation, started (the first token pulled by the caller)."""
        for choice in self.choices:
            lease = choice.lease
            arguments = dict(self.asked.sampling)
            if arguments["seed"] is not None:
                arguments["seed"] = (arguments["seed"] + choice.index) % (1 << 63)  # n choices: n draws
            forked = self.asked.n > 1
            prompt_logprobs = None if forked else self.asked.prompt_logprobs
            self.gw.quotas.grow(self.owner, lease.upstream, len(lease.send) + self.asked.max_new[choice.prompt])
            stateless = lease.bound is None
            tokens = lease.upstream.generate(
                lease.send,
                max_new_tokens=self.asked.max_new[choice.prompt],
                stop_token_ids=self.asked.stop_ids,
                prompt_logprobs=prompt_logprobs,
                end=stateless,
                reuse_prefix=stateless,
                grammar=self.asked.grammar,
                **arguments,
            )
            what = f"choice {choice.index} of {self.id}"
            self._pulls.append(Pull(self.gw, tokens, what, self._on_error(lease), len(lease.send)))
        return self._pulls

    def _on_error(self, lease: Lease):
        def named(error: ApiError) -> ApiError:
            if lease.bound is not None and isinstance(error, SessionConflict | UpstreamTimeout):
                self.gw.sessions.break_(lease.bound, f"a generation failed: {error.message}")
            if isinstance(error, InvalidInput) and f"'{GRAMMAR}'" in error.message and self.asked.constrained_by:
                field = self.asked.constrained_by  # the server's compiler refused what the field asked
                return InvalidInput(f"{field}: {error.message.split(': ', 1)[-1]}", param=field)
            return error

        return named

    async def next_piece(self, choice: Choice) -> Piece | None:
        """The choice's next text (possibly empty while a character or a stop string is incomplete), the
        tokens it came from and its tool calls' deltas; None once the choice ended (`finish_reason` set)."""
        if choice.finish_reason is not None:
            return None
        pull = self._pulls[choice.index]
        token = await pull.next()
        if token is None:
            outcome = pull.tokens.outcome
            choice.finish_reason = FINISH.get(outcome.finish_reason, "stop")
            rest = choice.detokenizer.finish()
            choice.text.append(rest)
            return self._read_calls(choice, rest, [], last=True)
        choice.tokens.append(token.id)
        piece = choice.detokenizer.push(token.id)
        last = choice.detokenizer.stopped
        if last:
            choice.finish_reason = "stop"
            await pull.close()  # the server stops within one step; the session keeps what it stepped
            piece += choice.detokenizer.finish()
        choice.text.append(piece)
        choice.logprobs.append(token)
        return self._read_calls(choice, piece, [token], last)

    @staticmethod
    def _read_calls(choice: Choice, piece: str, tokens: list[Token], last: bool) -> Piece:
        """The piece as the answer gives it: its text, or the content and tool-call deltas read from it."""
        if choice.calls is None:
            return Piece(piece, tokens)
        content, deltas = choice.calls.push(piece)
        if last:
            more, more_deltas = choice.calls.finish()
            content, deltas = content + more, deltas + more_deltas
            if choice.calls.calls and choice.finish_reason == "stop":
                choice.finish_reason = "tool_calls"
        return Piece(content, tokens, deltas)

    def prompt_scores(self, choice: Choice) -> list[Token | None]:
        """Each prompt token's score (None where there is none: the first, and what a session held already)."""
        if self.asked.prompt_logprobs is None:
            return []
        scored = self._scores if self.asked.n > 1 else self._pulls[choice.index].tokens.prompt_logprobs
        return [None] * len(choice.lease.held_before) + list(scored)

    async def end(self) -> None:
        """Each generation closed (its stateless session ends with it on the server, its row kept there for the
        next request); a bound session's ids noted; the key's quota released of the stateless ones."""
        for pull in self._pulls:
            await pull.close()
        for choice in self.choices:
            lease, finished = choice.lease, choice.finish_reason is not None and choice.index < len(self._pulls)
            if lease.bound is not None:
                held = None
                if finished:
                    answered = self._pulls[choice.index].tokens.tokens
                    held = np.asarray([*lease.held_before.tolist(), *lease.send.tolist(), *answered], np.int64)
                lease.bound.tokens = held  # None: failed or cut off, what it holds is unknown here
                self.gw.quotas.settle(self.owner, lease.upstream)
        self.gw.quotas.release(*self._owned)

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(self.asked.prompts[choice.prompt]) for choice in self.choices[:: self.asked.n])
        completion = sum(len(choice.tokens) for choice in self.choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        return usage | {"prompt_tokens_details": {"cached_tokens": self.cached_tokens()}}

    def cached_tokens(self) -> int:
        """Prompt ids the server reused: a bound session's, the one prefill's of n choices, or the most any
        choice's generation reused (its final response says)."""
        if self.asked.n > 1 or self._bound is not None:
            return self.cached
        return max([self.cached, *(pull.tokens.cached_tokens for pull in self._pulls)])


# --- answers -----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Piece:
    """What one step of a choice adds to its answer."""

    text: str
    tokens: list[Token]
    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # tool-call deltas (OpenAI's shape)


class Renderer:
    """OpenAI's objects for a run: completions' `text_completion` or chat's `chat.completion(.chunk)`."""

    def __init__(self, run: Run) -> None:
        self.run, self.text, self.chat = run, run.text, run.asked.chat

    def head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.run.id, "object": kind, "created": self.run.created, "model": self.run.model}

    def whole(self) -> dict[str, Any]:
        choices = []
        for choice in self.run.choices:
            text = "".join(choice.text)
            entry: dict[str, Any] = {"index": choice.index, "finish_reason": choice.finish_reason}
            if self.chat:
                entry["message"] = self._message(choice, text)
                entry["logprobs"] = self.chat_logprobs(choice.logprobs)
            else:
                echo = self.run.asked.echo_texts[choice.prompt] if self.run.asked.echo_texts else ""
                entry["text"] = echo + text
                entry["logprobs"] = self.completion_logprobs(choice, choice.logprobs, with_prompt=True)
            choices.append(entry)
        return self.head(chunk=False) | {"choices": choices, "usage": self.run.usage()}

    @staticmethod
    def _message(choice: Choice, text: str) -> dict[str, Any]:
        """The assistant's message: its text, or (tools) the content beside its calls."""
        reader = choice.calls
        if reader is None or not reader.calls or choice.finish_reason != "tool_calls":
            return {"role": "assistant", "content": text}
        calls = [call.whole() for call in reader.calls]
        return {"role": "assistant", "content": reader.content or None, "tool_calls": calls}

    def chunk(self, choice: Choice, piece: Piece, first: bool) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": choice.index}
        tokens = piece.tokens
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if piece.text or (first and not piece.calls):
                delta["content"] = piece.text
            if piece.calls:
                delta["tool_calls"] = piece.calls
            entry["delta"] = delta
            entry["logprobs"] = self.chat_logprobs(tokens) if tokens else None
        else:
            echo = self.run.asked.echo_texts[choice.prompt] if first and self.run.asked.echo_texts else ""
            entry["text"] = echo + piece.text
            entry["logprobs"] = self.completion_logprobs(choice, tokens, with_prompt=first) if tokens or first else None
        entry["finish_reason"] = choice.finish_reason
        return self.head(chunk=True) | {"choices": [entry]}

    def usage_chunk(self) -> dict[str, Any]:
        return self.head(chunk=True) | {"choices": [], "usage": self.run.usage()}

    def completion_logprobs(self, choice: Choice, tokens: list[Token], with_prompt: bool) -> dict[str, Any] | None:
        if self.run.asked.logprobs is None:
            return None
        entries: list[tuple[int, float | None, tuple]] = []
        if with_prompt and self.run.asked.prompt_logprobs is not None:
            prompt = self.run.asked.prompts[choice.prompt].tolist()
            scores = self.run.prompt_scores(choice)
            for at, token in enumerate(prompt):
                score = scores[at] if at < len(scores) else None
                entries.append((token, None if score is None else score.logprob, () if score is None else score.top))
        entries += [(token.id, token.logprob, token.top) for token in tokens]
        strings = [self.text.token_text(token) for token, _, _ in entries]
        tops = [
            None if logprob is None else {self.text.token_text(i): value for i, value in top}
            for _, logprob, top in entries
        ]
        offsets, at = [], 0
        for string in strings:
            offsets.append(at)
            at += len(string)
        return {
            "tokens": strings,
            "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat_logprobs(self, tokens: list[Token]) -> dict[str, Any] | None:
        if self.run.asked.logprobs is None:
            return None
        return {
            "content": [
                self._chat_token(token.id, token.logprob)
                | {"top_logprobs": [self._chat_token(i, value) for i, value in token.top]}
                for token in tokens
            ]
        }

    def _chat_token(self, token: int, logprob: float) -> dict[str, Any]:
        string = self.text.token_text(token)
        return {"token": string, "logprob": logprob, "bytes": list(self.text.token_bytes(token))}


# --- the routes --------------------------------------------------------------------------------------------

ANSWERED = {
    200: {
        "description": "`stream: false`: the completion (OpenAI's object). `stream: true`: Server-Sent Events, one "
        "chunk object per piece of text, then `data: [DONE]`",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


@openai.post(
    "/completions",
    responses=ANSWERED | responses(400, 401, 404, 409, 413, 429, 502, 503, 504),
    summary="OpenAI's Completions: text (or token ids) in, text out, generated on the server",
    openapi_extra=body_documented(schemas.CompletionBody),
)
async def completions(request: Request, owner: Caller) -> Response:
    return await _answer(request, owner, schemas.CompletionBody, chat=False)


@openai.post(
    "/chat/completions",
    responses=ANSWERED | responses(400, 401, 404, 409, 413, 429, 502, 503, 504),
    summary="OpenAI's Chat Completions: messages rendered by the model's chat template, the reply generated on "
    "the server; a conversation's next turn starts from the KV cache its last turn left there",
    openapi_extra=body_documented(schemas.ChatBody),
)
async def chat_completions(request: Request, owner: Caller) -> Response:
    return await _answer(request, owner, schemas.ChatBody, chat=True)


async def _answer(request: Request, owner: str, schema: type[schemas.Common], chat: bool) -> Response:
    gw = the_gateway(request)
    body = parsed(await json_body(request), schema)
    whole = await gw.whole_model(body.model)
    asked = await asked_of(body, whole, chat, gw)
    run = Run(gw, owner, asked, whole)
    try:
        await run.lease()
        run.start()
        if not asked.stream:
            return await _whole(run)
        first = await _first_pieces(run)
    except BaseException:
        await run.held.aclose()
        raise
    return EventStream(_events(run, first), run.held)


async def _whole(run: Run) -> Response:
    async with run.held:
        await asyncio.gather(*(drain(run, choice) for choice in run.choices))
        return Response(orjson.dumps(Renderer(run).whole()), media_type="application/json")


async def _drained(generated) -> None:
    async for _ in generated:
        pass


async def drain(run: Run, choice: Choice) -> None:
    while await run.next_piece(choice) is not None:
        pass


async def _first_pieces(run: Run) -> dict[int, Piece | None]:
    """Each choice's first piece: an error before any is the request's status, as every route's errors are."""
    pieces = await asyncio.gather(*(run.next_piece(choice) for choice in run.choices))
    return dict(enumerate(pieces))


async def _events(run: Run, first: dict[int, Piece | None]) -> AsyncIterator[bytes]:
    renderer = Renderer(run)
    try:
        for choice in run.choices:
            piece = first[choice.index]
            if piece is not None:
                yield event(renderer.chunk(choice, piece, first=True))
        async for choice, piece in _merged(run):
            yield event(renderer.chunk(choice, piece, first=False))
        if run.asked.include_usage:
            yield event(renderer.usage_chunk())
    except ApiError as error:
        yield event(error_body(error.status, error.code, error.message, error.param))
    except Exception:
        log.exception("unexpected error in %s", run.id)
        yield event(error_body(500, "internal", "internal error; it is logged on the server"))
    await run.held.aclose()
    yield DONE


async def _merged(run: Run) -> AsyncIterator[tuple[Choice, Piece]]:
    """The choices' next pieces as they come, interleaved; a choice's last one carries its finish reason."""
    pending = {
        asyncio.ensure_future(run.next_piece(choice)): choice for choice in run.choices if choice.finish_reason is None
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                choice = pending.pop(future)
                piece = future.result()
                if piece is None:
                    continue
                yield choice, piece
                if choice.finish_reason is None:
                    pending[asyncio.ensure_future(run.next_piece(choice))] = choice
    finally:
        for future in pending:
            future.cancel()
