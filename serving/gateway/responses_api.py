"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed as its typed events), `GET` and `DELETE
/v1/responses/{id}`, over the chat machinery (openai_api.py): a response is a chat completion of the
conversation its `previous_response_id` chain holds, plus its `input`, under its own `instructions`.

A stored response (`store`, the default) keeps its conversation (the messages, its own answer last) under the
caller's key: in the session store when the gateway has one (SERVING_SESSION_STORE: Redis or a directory,
each entry tagged as the sessions' are), so any gateway, after a restart too, continues it; else in this
gateway's memory (the last RECORDS_IN_MEMORY). Another key's response ids are 404.

A continuation prefills only what its turn adds: each turn is a generation with prefix reuse, whose row the
engine core keeps for the key (serving/engine/core.py, "Prefix reuse"), and the next turn's prompt, the whole
conversation re-rendered by the chat template, begins with what that row holds (`usage.input_tokens_details.
cached_tokens` says how much). Where the row is gone (the core's per-key rows give way, least recent first, or
its replica died), the turn prefills the stored conversation whole and answers the same.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import secrets
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from client.store import SessionStore, StoreError, StoreKey
from serving.gateway import openai_api
from serving.gateway import openai_schemas as schemas
from serving.gateway.errors import ApiError, InvalidInput, UpstreamUnavailable, responses
from serving.gateway.generate import EventStream
from serving.gateway.generate import event as server_sent
from serving.gateway.routes import Caller, body_documented, caller, the_gateway
from serving.gateway.state import WholeModel

responses_router = APIRouter(prefix="/v1", dependencies=[Depends(caller)], tags=["openai"])
RECORDS_IN_MEMORY = 10_000
# fields of OpenAI's request that would change the answer and that this route does not do
REFUSED = {
    "tools": "tools are not supported on /v1/responses (use /v1/chat/completions)",
    "background": "background responses are not supported",
    "conversation": "conversations objects are not supported: chain responses by previous_response_id",
    "prompt": "prompt templates are not supported",
}
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponseNotFound(ApiError):
    status, code = 404, "response_not_found"


class ResponsesBody(BaseModel):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    input: StrictStr | list[dict[str, Any]] = Field(description="text, or message items (role and content)")
    instructions: StrictStr | None = Field(default=None, description="a system message for this response only")
    previous_response_id: StrictStr | None = Field(default=None, description="the stored response this continues")
    max_output_tokens: StrictInt | None = Field(default=None, ge=1, description="new tokens at most")
    temperature: StrictFloat | StrictInt = Field(default=1.0, ge=0, le=2)
    top_p: StrictFloat | StrictInt = Field(default=1.0, gt=0, le=1)
    stream: StrictBool = False
    store: StrictBool = Field(default=True, description="keep it, to be read and continued (its key's only)")
    text: dict[str, Any] | None = Field(default=None, description="`format`: text, json_object or json_schema")
    metadata: dict[str, StrictStr] | None = None
    seed: StrictInt | None = Field(default=None, ge=0, lt=1 << 63)

    def refused(self) -> list[tuple[str, str]]:
        """(field, why) for each field given that this route does not do."""
        extra = self.model_extra or {}
        return [(name, why) for name, why in REFUSED.items() if extra.get(name) not in (None, [], {}, "")]


@dataclasses.dataclass
class Record:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation through this response's answer, without instructions


class Records:
    """Stored responses by key: in the session store (a one-entry log under the response's id) or in memory."""

    def __init__(self, store: SessionStore | None) -> None:
        self.store = store
        self._memory: collections.OrderedDict[tuple[str, str], Record] = collections.OrderedDict()

    async def put(self, owner: str, record: Record) -> None:
        if self.store is None:
            self._memory[(owner, record.response["id"])] = record
            while len(self._memory) > RECORDS_IN_MEMORY:
                self._memory.popitem(last=False)
            return
        blob = orjson.dumps(dataclasses.asdict(record))
        await self._call(self.store.append, StoreKey(owner, record.response["id"]), 0, 1, blob)

    async def get(self, owner: str, response_id: str) -> Record | None:
        if self.store is None:
            return self._memory.get((owner, response_id))
        key = _key(owner, response_id)
        chunks = [] if key is None else await self._call(self.store.chunks, key)
        return Record(**orjson.loads(chunks[-1].blob)) if chunks else None

    async def delete(self, owner: str, response_id: str) -> bool:
        if self.store is None:
            return self._memory.pop((owner, response_id), None) is not None
        key = _key(owner, response_id)
        if key is None or not await self._call(self.store.chunks, key):
            return False
        await self._call(self.store.delete, key)
        return True

    @staticmethod
    async def _call(function, *arguments):
        try:
            return await asyncio.to_thread(function, *arguments)
        except StoreError as error:
            raise UpstreamUnavailable(f"the session store: {error}") from None


def _key(owner: str, response_id: str) -> StoreKey | None:
    try:
        return StoreKey(owner, response_id)
    except ValueError:  # not a name this gateway gives: no such response
        return None


# --- the routes ----------------------------------------------------------------------------------------------


@responses_router.post(
    "/responses",
    responses=openai_api.ANSWERED | responses(400, 401, 404, 409, 413, 429, 502, 503, 504),
    summary="OpenAI's Responses: a conversation continued by `previous_response_id`, its KV reused on the server",
    openapi_extra=body_documented(ResponsesBody),
)
async def create_response(request: Request, owner: Caller) -> Response:
    gw = the_gateway(request)
    body = openai_api.parsed(await openai_api.json_body(request), ResponsesBody)
    whole = await gw.whole_model(body.model)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = await records_of(gw).get(owner, body.previous_response_id)
        if previous is None:
            raise ResponseNotFound(
                f"previous_response_id: no stored response '{body.previous_response_id}' for this key",
                param="previous_response_id",
            )
        history = previous.messages
    conversation = [*history, *input_messages(body.input)]
    run = await _run(gw, owner, body, conversation, whole)
    if not body.stream:
        async with run.held:
            await asyncio.gather(*(openai_api.drain(run, choice) for choice in run.choices))
            answer = await _finished(gw, owner, body, run, conversation)
        return Response(orjson.dumps(answer), media_type="application/json")
    return EventStream(_events(gw, owner, body, run, conversation), run.held)


@responses_router.get("/responses/{response_id}", responses=responses(401, 404, 503))
async def get_response(response_id: str, request: Request, owner: Caller) -> dict:
    """A stored response of this key."""
    record = await records_of(the_gateway(request)).get(owner, response_id)
    if record is None:
        raise ResponseNotFound(f"response_id: no stored response '{response_id}' for this key", param="response_id")
    return record.response


@responses_router.delete("/responses/{response_id}", responses=responses(401, 404, 503))
async def delete_response(response_id: str, request: Request, owner: Caller) -> dict:
    """Forget a stored response of this key (the responses that continued it keep their own conversation)."""
    if not await records_of(the_gateway(request)).delete(owner, response_id):
        raise ResponseNotFound(f"response_id: no stored response '{response_id}' for this key", param="response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def records_of(gw) -> Records:
    if gw.responses is None:
        gw.responses = Records(gw.client.store)
    return gw.responses


# --- a response --------------------------------------------------------------------------------------------


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a response's `input`: text is the user's message; message items keep their role,
    their content's text parts joined (a part that is not text is a 400 naming it)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages = []
    for at, item in enumerate(given):
        kind = item.get("type", "message")
        role, content = item.get("role"), item.get("content")
        if kind != "message" or role not in ("user", "assistant", "system", "developer"):
            raise InvalidInput(
                f"input[{at}]: expected a message item (role user, assistant, system or developer), got type "
                f"{kind!r} role {role!r}",
                param="input",
            )
        if isinstance(content, list):
            texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") in TEXT_PARTS]
            if len(texts) != len(content) or not all(isinstance(text, str) for text in texts):
                raise InvalidInput(f"input[{at}].content: expected text parts only ({TEXT_PARTS})", param="input")
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise InvalidInput(f"input[{at}].content: expected text or text parts, got {content!r}", param="input")
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    if not messages:
        raise InvalidInput("input: expected text or at least one message, got none", param="input")
    return messages


async def _run(
    gw, owner: str, body: ResponsesBody, conversation: list[dict[str, Any]], whole: WholeModel
) -> openai_api.Run:
    """The turn as a chat completion (its sessions leased, its generation started)."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat = {
        "model": body.model,
        "messages": [*system, *conversation],
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        **_response_format(body.text),
    }
    try:
        parsed = schemas.ChatBody.model_validate(chat)
    except ValueError as error:
        raise InvalidInput(f"input: {error}", param="input") from None
    asked = await openai_api.asked_of(parsed, whole, True, gw)
    run = openai_api.Run(gw, owner, asked, whole)
    run.id = "resp_" + secrets.token_hex(24)
    try:
        await run.lease()
        run.start()
    except BaseException:
        await run.held.aclose()
        raise
    return run


def _response_format(given: dict[str, Any] | None) -> dict[str, Any]:
    """`text.format` as chat's response_format (the Responses API names the schema's fields flat)."""
    form = (given or {}).get("format")
    if form is None or form.get("type") == "text":
        return {}
    if form.get("type") == "json_schema":
        schema = {"name": form.get("name", "answer"), "schema": form.get("schema", {}), "strict": form.get("strict")}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    return {"response_format": form}


def _response(body: ResponsesBody, run: openai_api.Run, status: str, text: str | None) -> dict[str, Any]:
    """OpenAI's response object; `text` None: not generated yet (the stream's first events)."""
    choice = run.choices[0]
    output = [] if text is None else [_message(run, text, "completed")]
    usage = None
    if text is not None:
        used = run.usage()
        usage = {
            "input_tokens": used["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": used["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": used["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": used["total_tokens"],
        }
    incomplete = {"reason": "max_output_tokens"} if choice.finish_reason == "length" else None
    return {
        "id": run.id,
        "object": "response",
        "created_at": run.created,
        "status": status,
        "model": body.model,
        "output": output,
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "store": body.store,
        "metadata": body.metadata or {},
        "text": body.text or {"format": {"type": "text"}},
        "incomplete_details": incomplete if text is not None else None,
        "error": None,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "truncation": "disabled",
        "usage": usage,
    }


def _message(run: openai_api.Run, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    item_id = "msg_" + run.id.removeprefix("resp_")
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


async def _finished(gw, owner: str, body: ResponsesBody, run: openai_api.Run, conversation: list) -> dict[str, Any]:
    """The whole response, stored with its conversation where asked."""
    text = "".join(run.choices[0].text)
    status = "incomplete" if run.choices[0].finish_reason == "length" else "completed"
    answer = _response(body, run, status, text)
    if body.store:
        messages = [*conversation, {"role": "assistant", "content": text}]
        await records_of(gw).put(owner, Record(answer, messages))
    return answer


async def _events(gw, owner: str, body: ResponsesBody, run: openai_api.Run, conversation: list) -> AsyncIterator[bytes]:
    """The typed events of a streamed response, as OpenAI sends them: created, in progress, the message and its
    text part added, the text's deltas, then each done, and completed (or incomplete)."""
    numbers = iter(range(1 << 62))

    def event(kind: str, **fields) -> bytes:
        return server_sent({"type": kind, "sequence_number": next(numbers), **fields}, kind)

    started = _response(body, run, "in_progress", None)
    at = {"item_id": _message(run, "", "in_progress")["id"], "output_index": 0, "content_index": 0}
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    yield event("response.output_item.added", output_index=0, item=_message(run, "", "in_progress") | {"content": []})
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    yield event("response.content_part.added", **at, part=part)
    try:
        choice = run.choices[0]
        while (piece := await run.next_piece(choice)) is not None:
            if piece.text:
                yield event("response.output_text.delta", **at, delta=piece.text, logprobs=[])
        answer = await _finished(gw, owner, body, run, conversation)
    except ApiError as error:
        failed = started | {"status": "failed", "error": {"code": error.code, "message": error.message}}
        yield event("error", code=error.code, message=error.message, param=error.param)
        yield event("response.failed", response=failed)
        await run.held.aclose()
        return
    text = answer["output"][0]["content"][0]["text"]
    yield event("response.output_text.done", **at, text=text, logprobs=[])
    yield event("response.content_part.done", **at, part=part | {"text": text})
    yield event("response.output_item.done", output_index=0, item=answer["output"][0])
    await run.held.aclose()
    kind = "response.incomplete" if answer["status"] == "incomplete" else "response.completed"
    yield event(kind, response=answer)
