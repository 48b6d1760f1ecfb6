"""The routes: health (open), models, stateless attention, attention maps, sessions and generation (behind an
API key).

/v1/attend and a session's step read their body themselves (validated.py: parsed and checked once,
into arrays) instead of through a pydantic body parameter; `body_documented` puts the schema their
body follows into the OpenAPI document (app.py adds the models to its components).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import re
from collections.abc import Iterator
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from client import ClientError, ModelInfo
from client.text import TextError
from contract import integrity, names
from contract.heads import head_roles, head_statistics
from contract.inputs import real_tokens
from contract.integrity import Keyring
from serving.gateway import generate, schemas, validated
from serving.gateway.auth import ANONYMOUS, api_key_scheme, bearer_scheme, identify
from serving.gateway.encoding import Encoding, encode, tensor_json
from serving.gateway.errors import (
    ApiError,
    InvalidInput,
    ModelNotFound,
    PrefixNotFound,
    SchemaViolation,
    SessionConflict,
    SessionLost,
    UnsupportedMediaType,
    UpstreamTimeout,
    UpstreamUnavailable,
    responses,
)
from serving.gateway.sessions import GatewaySession
from serving.gateway.state import GatewayState

# --- dependencies ---------------------------------------------------------------------------


def the_gateway(request: Request) -> GatewayState:
    return request.app.state.gateway


async def gateway_state(request: Request) -> GatewayState:
    return the_gateway(request)


async def caller(request: Request) -> str:
    """Who is calling, as sessions record it (a keyed hash of its key: auth.owner_of), or 401. The
    two schemes read the headers as FastAPI's security dependencies would; they are called here, not
    declared as dependencies, because solving them cost every request tens of microseconds (app.py
    documents them)."""
    gateway = the_gateway(request)
    if not gateway.keys:
        return ANONYMOUS
    bearer = await bearer_scheme(request)
    presented = bearer.credentials if bearer is not None else await api_key_scheme(request)
    return gateway.owner(identify(presented, gateway.keys))


State = Annotated[GatewayState, Depends(gateway_state)]
Caller = Annotated[str, Depends(caller)]
ResponseEncoding = Annotated[
    Encoding, Query(description="`b64`: tensors in the response as base64 tensor objects (see the description)")
]
SESSION_PATH = "/sessions/{session_id}"
SECURITY_SCHEMES = (bearer_scheme, api_key_scheme)  # either one: app.py puts them in the document

health = APIRouter(tags=["health"])
v1 = APIRouter(prefix="/v1", dependencies=[Depends(caller)])
# read by hand: app.py documents them
BODY_MODELS = (schemas.AttendRequest, schemas.StepBody, schemas.FromPrefix, schemas.InspectRequest)


def body_documented(model: type) -> dict[str, Any]:
    """The OpenAPI `requestBody` of a route that reads its body itself."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def json_answer(body: bytes) -> Response:
    return Response(body, media_type="application/json")


# --- health ---------------------------------------------------------------------------------


@health.get("/healthz", response_model=schemas.Status, summary="Liveness: the gateway process answers")
async def healthz() -> dict:
    return {"status": "ok"}


@health.get(
    "/readyz",
    response_model=schemas.Status,
    responses=responses(503),
    summary="Readiness: Triton is ready and every model the routes use (the stateless, the session model and each "
    "one that generates) answers a one-token request",
)
async def readyz(gw: State) -> dict:
    settings = gw.settings
    try:
        async with asyncio.timeout(settings.readiness_timeout_s):
            state = await gw.client.probe(also=gw.generating_models())
    except (ClientError, TimeoutError) as error:
        message = getattr(error, "message", None) or f"no answer within {settings.readiness_timeout_s:g} s"
        raise UpstreamUnavailable(f"Triton at {settings.triton_url} is not reachable: {message}") from None
    if not state.ok:
        raise UpstreamUnavailable(f"Triton at {settings.triton_url} is not ready: {state.problems()}")
    return {"status": "ready"}


@health.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"description": "Prometheus text exposition format"}},
    summary="Prometheus metrics",
)
async def metrics(gw: State) -> Response:
    await gw.metrics.refresh()  # Triton's KV cache usage, read before the registry is (its collectors are sync)
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# --- models ---------------------------------------------------------------------------------


@v1.get("/models", response_model=schemas.ModelList, responses=responses(401, 502, 503, 504))
async def list_models(gw: State) -> dict:
    """OpenAI's list (`object`, `data[].id`: the models the OpenAI-compatible routes serve, each whole model's
    once ready) and ours beside it (`models`: the served models, their readiness and their tensors: the
    stateless and session models, and each session model that generates when it is another one)."""
    client = gw.client
    ready = (await gw.call(client.health(), "readiness of the models")).models
    kinds = {client.model: "stateless", client.session_model: "session"}
    generators = gw.generators()
    for generating in {c.session_model: c for c in generators.values()}.values():
        if generating.session_model not in kinds:
            ready |= (await gw.call(generating.health(), "readiness of the generation's model")).models
            kinds[generating.session_model] = "generation"
    models = []
    for name, kind in kinds.items():
        entry = {"name": name, "kind": kind, "ready": ready.get(name, False)}
        if entry["ready"]:
            entry |= _describe(await gw.model_info(name))
        models.append(entry)
    entries = {entry["name"]: entry for entry in models}
    cards = []
    for model_id, generating in generators.items():
        generation = entries[generating.session_model]
        if generation["ready"] and generation.get("vocab_size"):
            cards.append(_card(gw, model_id, generation.get("max_seq_len")))
    return {"object": "list", "data": cards, "models": models}


def _card(gw: GatewayState, model_id: str, max_seq_len: int | None) -> dict:
    """OpenAI's model object of a model the OpenAI-compatible routes serve."""
    card = {"id": model_id, "object": "model", "created": gw.started, "owned_by": "attention-serving"}
    return card | {"max_model_len": max_seq_len}


@v1.get("/models/{model:path}", response_model=schemas.ModelCard, responses=responses(401, 404, 502, 503, 504))
async def retrieve_model(model: str, gw: State) -> dict:
    """OpenAI's `models.retrieve`: a model the OpenAI-compatible routes serve, by its id (404 for another)."""
    info = await gw.model_info(gw.generator(model).session_model)
    if info.vocab_size is None:
        raise ModelNotFound(f"model: '{model}' is an attention model: only a whole model takes text", param="model")
    return _card(gw, model, info.facts.get("max_seq_len"))


def _describe(info: ModelInfo) -> dict:
    tensors = [
        [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in group.values()]
        for group in (info.inputs, info.outputs)
    ]
    sizes = {"d_model": info.d_model or None, "dtype": info.float_dtype, "inputs": tensors[0], "outputs": tensors[1]}
    sizes["vocab_size"] = info.vocab_size
    if info.n_layers:
        sizes |= {"n_layers": info.n_layers, "n_kv_heads": info.n_kv_heads, "head_dim": info.head_dim}
    # what the model's config publishes: its sizes and limits for both models (the session model's IO has no
    # cache to read them from), the engine, the session operations it offers and the KV budget of the session model
    return sizes | {key: value for key, value in info.facts.items() if key in schemas.ModelDescription.model_fields}


# --- stateless attention --------------------------------------------------------------------


@v1.post(
    "/attend",
    response_model=schemas.AttendResponse,
    responses=responses(400, 401, 413, 422, 429, 502, 503, 504),
    summary="One stateless forward pass: new tokens plus the past the caller holds",
    openapi_extra=body_documented(schemas.AttendRequest),
)
async def attend(request: Request, encoding: ResponseEncoding = "json") -> Response:
    gw = the_gateway(request)  # not a dependency: solving one costs the busiest routes each request
    async with gw.attend_slot():
        raw = await request.body()
        body = await gw.offload(len(raw), validated.parse, raw, schemas.AttendRequest)
        info = await gw.model_info(gw.settings.model)
        valid = await gw.offload(len(raw), validated.attend, body, info, gw.request_tokens)
        del raw, body  # megabytes, perhaps: not kept while Triton works
        call = gw.client.infer(valid.hidden_states, valid.attention_mask, valid.past or None, valid.position_ids)
        result = await gw.call(call, "stateless attention")
        present = [{"key": k, "value": v} for k, v in result.present]
        answer = {info.answer: result.output, "present": present}  # a whole model's logits, else output
        return json_answer(await gw.offload(_nbytes(result.present), _render, answer, encoding))


def _nbytes(present: list[tuple[np.ndarray, np.ndarray]]) -> int:
    return sum(key.nbytes + value.nbytes for key, value in present)


def _render(answer: dict, encoding: Encoding) -> bytes:
    """The answer as JSON, tensors encoded; built by hand, not through response_model: validating
    megabytes of floats again buys nothing."""
    return tensor_json(_encoded(answer, encoding))


def _encoded(value: Any, encoding: Encoding) -> Any:
    if isinstance(value, np.ndarray):
        return encode(value, encoding)
    if isinstance(value, dict):
        return {key: _encoded(item, encoding) for key, item in value.items()}
    if isinstance(value, list):
        return [_encoded(item, encoding) for item in value]
    return value


# --- attention maps -------------------------------------------------------------------------


@v1.post(
    "/inspect",
    response_model=schemas.InspectResponse,
    responses=responses(400, 401, 404, 409, 413, 422, 429, 502, 503, 504),
    summary="Every layer's and head's attention weights for one sequence (stateless, or a session's next step, "
    "which is not taken), with each head's statistics",
    openapi_extra=body_documented(schemas.InspectRequest),
)
async def inspect(request: Request, owner: Caller, encoding: ResponseEncoding = "json") -> Response:
    gw = the_gateway(request)
    raw = await request.body()
    body = await gw.offload(len(raw), validated.parse, raw, schemas.InspectRequest)
    if body.fields.session is None:
        async with gw.attend_slot():
            info = await gw.model_info(gw.settings.model)
            body, tokens = await _text_as_ids(gw, body, info)
            valid = await _valid_inspect(gw, len(raw), body, info, tokens)
            validated.check_map_size(info, 0, valid.hidden_states.shape[1])
            call = gw.client.infer(valid.hidden_states, valid.attention_mask, attention_maps=True)
            maps = (await gw.call(call, "attention maps")).attention_maps
            mask = valid.attention_mask
            # a whole model's ids are every key's here (no past): the induction share can be read
            token_ids = valid.hidden_states if info.new_tokens == names.INPUT_IDS else None
    else:
        info = await gw.model_info(gw.settings.session_model)
        body, tokens = await _text_as_ids(gw, body, info)
        valid = await _valid_inspect(gw, len(raw), body, info, tokens)
        async with gw.sessions.using(valid.session, owner) as session:
            past = session.upstream.length
            validated.check_map_size(info, past, valid.hidden_states.shape[1])
            call = session.upstream.attention_maps(valid.hidden_states)
            with naming(session):
                maps = await gw.call(call, f"attention maps of session '{session.id}'")
            mask = None  # a session holds real tokens only
            token_ids = None  # its past's ids are Triton's to keep, not the gateway's: no induction share
    answer = await gw.offload(sum(m.nbytes for m in maps), _inspection, maps, mask, encoding, tokens, token_ids)
    return json_answer(answer)


async def _text_as_ids(
    gw: GatewayState, body: validated.Body, info: ModelInfo
) -> tuple[validated.Body, list[dict[str, Any]] | None]:
    """The body with its `text` as the ids the served tokenizer encodes it to (special tokens added for a
    stateless call, not for a session's next step), and those tokens (None without a text); 422 for a text
    beside the tensors it stands for, 400 for a model that reads no text."""
    fields = body.fields
    if fields.text is None:
        return body, None
    beside = [name for name in ("input_ids", "hidden_states", "attention_mask") if getattr(fields, name) is not None]
    if beside:
        raise SchemaViolation(f"body.text: not taken beside {', '.join(beside)} (the text is the tokens, unpadded)")
    if info.new_tokens != names.INPUT_IDS:
        raise InvalidInput(
            f"body.text: '{info.name}' takes {info.new_tokens} (an attention model), not text: only a whole model "
            "with a tokenizer reads text",
            param="text",
        )
    tokenizer = await gw.text()  # 400 naming the missing tokenizer.json where the model serves none
    try:
        ids = await gw.encode(tokenizer, fields.text, fields.session is None)
    except TextError as error:
        raise InvalidInput(f"body.text: {error}", param="text") from None
    if not ids:
        raise InvalidInput(f"body.text: {fields.text[:40]!r} encodes to no tokens", param="text")
    tokens = [{"id": token, "text": tokenizer.token_text(token)} for token in ids]
    return dataclasses.replace(body, fields=fields.model_copy(update={"text": None, "input_ids": ids})), tokens


async def _valid_inspect(
    gw: GatewayState, size: int, body: validated.Body, info: ModelInfo, tokens: list | None
) -> validated.ValidInspect:
    """`validated.inspect`; a refusal of the ids a text encoded to says so: the caller sent text, not ids."""
    try:
        return await gw.offload(size, validated.inspect, body, info, gw.request_tokens)
    except InvalidInput as error:
        if tokens is None:
            raise
        raise InvalidInput(f"body.text (encoded to {len(tokens)} tokens): {error.message}", param="text") from None


def _inspection(
    maps: list[np.ndarray],
    mask: np.ndarray | None,
    encoding: Encoding,
    tokens: list[dict[str, Any]] | None = None,
    token_ids: np.ndarray | None = None,
) -> bytes:
    """The /v1/inspect answer from the maps (per layer (1, H, T, P+T)), the new tokens' mask, for a text its
    tokens and, where every key's id is known (a whole model, stateless), those ids (1, P+T) for the
    induction share."""
    _, heads, queries, keys = maps[0].shape
    full = np.ones((1, keys), np.int64)
    if mask is not None:
        full[:, keys - queries :] = mask
    statistics = head_statistics(maps, full, token_ids)
    layers = [encode(m[0], encoding) for m in maps]
    sizes = {"layers": len(maps), "heads": heads, "queries": queries, "keys": keys}
    found = {"maps": layers, "statistics": statistics, "roles": head_roles(statistics)}
    return tensor_json(sizes | found | ({"tokens": tokens} if tokens else {}))


# --- sessions -------------------------------------------------------------------------------


SNAPSHOT_TYPE = "application/octet-stream"
SNAPSHOT_BODY = {
    "requestBody": {
        "required": False,
        "description": "none: an empty session; a snapshot (GET /v1/sessions/{id}/snapshot) as "
        "application/octet-stream, or a prefix of this key as JSON (application/json, or no Content-Type), for a "
        "session that starts from it. Media types are read case-insensitively, parameters allowed; a body of "
        "another type is refused (415), never read as an empty session. A snapshot is restored only as it was "
        "handed out: its integrity tag (HMAC) is checked first, and a changed one is refused (400)",
        "content": {
            SNAPSHOT_TYPE: {"schema": {"type": "string", "format": "binary"}},
            "application/json": {"schema": {"$ref": "#/components/schemas/FromPrefix"}},
        },
    }
}


@v1.post(
    "/sessions",
    status_code=201,
    response_model=schemas.SessionCreated,
    responses=responses(400, 401, 404, 413, 415, 422, 429, 502, 503, 504),
    summary="Open a session (empty, from a snapshot or from a prefix): the server keeps its KV cache between steps",
    openapi_extra=SNAPSHOT_BODY,
)
async def create_session(request: Request, gw: State, owner: Caller, response: Response) -> dict:
    media_type = media_type_of(request)
    raw = await request.body()
    blob = raw if media_type == SNAPSHOT_TYPE else b""
    if blob:  # before anything goes upstream: only what this service handed out, unchanged, is restored
        await gw.offload(len(blob), _verified, blob, gw.keyring)
    prefix = None
    if media_type != SNAPSHOT_TYPE and raw.strip():
        if media_type not in ("application/json", ""):
            raise _not_a_session_body(request.headers["content-type"])
        prefix = _prefix_asked(raw, media_type)
        if prefix is not None and prefix not in gw.client.prefixes(owner):
            raise PrefixNotFound(f"no prefix {prefix!r} (PUT /v1/prefixes/{{name}} first)")
    upstream = gw.client.session(restore=blob or None, owner=owner, prefix=prefix)
    return await _open(gw, gw.sessions.reserve(owner, upstream), response, upstream.open())


def _verified(blob: bytes, keyring: Keyring) -> None:
    try:
        integrity.snapshot_verified(blob, keyring)
    except integrity.IntegrityError as error:
        raise InvalidInput(str(error), param="body") from None


def media_type_of(request: Request) -> str:
    """The body's media type, lowercased and without parameters ("" without a Content-Type): RFC 9110 makes
    the type and subtype case-insensitive and lets parameters follow."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _prefix_asked(raw: bytes, media_type: str) -> str | None:
    """The prefix a JSON open body names; a body without a Content-Type is read as JSON, and one that is not
    JSON is refused as an unknown type (it may be a snapshot sent without its type: never an empty session)."""
    try:
        return validated.parse(raw, schemas.FromPrefix).fields.prefix
    except SchemaViolation:
        if media_type:
            raise
        raise _not_a_session_body("none") from None


def _not_a_session_body(content_type: str) -> UnsupportedMediaType:
    return UnsupportedMediaType(
        f"Content-Type: a session opens from {SNAPSHOT_TYPE} (a snapshot) or application/json (a prefix), "
        f"got {content_type[:80]!r} with a body"
    )


@v1.post(
    SESSION_PATH + "/fork",
    status_code=201,
    response_model=schemas.SessionCreated,
    responses=responses(401, 404, 409, 429, 502, 503, 504),
    summary="Open a new session holding a copy of this one's KV cache (copied inside the server)",
)
async def fork_session(session_id: str, gw: State, owner: Caller, response: Response) -> dict:
    async with gw.sessions.using(session_id, owner) as parent:
        child = gw.sessions.reserve(owner, gw.client.session(owner=owner))
        with naming(parent):
            return await _open(gw, child, response, child.upstream.open(fork_of=parent.upstream))


async def _open(gw: State, session: GatewaySession, response: Response, opening) -> dict:
    try:  # START now: a full KV budget or a Triton that cannot serve answers here, not at the first step
        with naming(session, "the new session"):  # its id is the caller's only once it is open
            await gw.call(opening, "opening a session")
            gw.quotas.opened(session.owner, session.upstream)  # a restored, prefixed or forked start holds some
    except ApiError as error:
        gw.sessions.remove(session.id, session.owner, "refused when opened")
        gw.end_later(session)  # Triton's batcher may hold the sequence; the answer does not wait for it
        if isinstance(error, SessionLost):  # nothing was held, so nothing is lost: the model cannot serve now
            raise UpstreamUnavailable(error.message) from None
        raise
    gw.sessions.name(session)
    response.headers["Location"] = f"/v1/sessions/{session.id}"
    return {"id": session.id, "idle_timeout_s": gw.settings.session_idle_s}


@v1.post(
    SESSION_PATH + "/step",
    response_model=schemas.StepResponse,
    responses=responses(400, 401, 404, 409, 413, 422, 429, 502, 503, 504),
    summary="Append new tokens to a session and return their output",
    openapi_extra=body_documented(schemas.StepBody),
)
async def step(session_id: str, request: Request, owner: Caller, encoding: ResponseEncoding = "json") -> Response:
    gw = the_gateway(request)
    raw = await request.body()
    body = await gw.offload(len(raw), validated.parse, raw, schemas.StepBody)  # 422 before 404, as documented
    async with gw.sessions.using(session_id, owner) as session:
        info = await gw.model_info(gw.settings.session_model)
        output = await _step(gw, session, await gw.offload(len(raw), validated.step, body, info))
        answer = {info.answer: encode(output, encoding), "length": session.upstream.length}  # logits or output
        return json_answer(tensor_json(answer))


async def _step(gw: State, session: GatewaySession, valid: validated.ValidStep) -> np.ndarray:
    """One upstream step; a session whose server-side state is lost or unknown is marked broken."""
    gw.quotas.grow(session.owner, session.upstream, valid.hidden_states.shape[1])  # 429 before it goes upstream
    try:
        call = session.upstream.step(valid.hidden_states, valid.attention_mask)
        return await gw.call(call, f"step of session '{session.id}'")
    except ApiError as error:
        raise _session_failed(gw, session, "a step timed out, so whether Triton applied it is unknown", error) from None


def _session_failed(gw: State, session: GatewaySession, timed_out: str, error: ApiError) -> ApiError:
    """An upstream error of a session's step or generation, naming the session; one that leaves its
    server-side state lost or unknown marks it broken (`timed_out`: why, for a timeout)."""
    error = renamed(session, error)
    if isinstance(error, SessionConflict):
        gw.sessions.break_(session, f"Triton no longer holds its KV cache ({error.message})")
        gw.quotas.release(session.upstream)  # nothing held: no share (a timed-out one may hold some: kept)
    elif isinstance(error, UpstreamTimeout):
        gw.sessions.break_(session, timed_out)
    return error


@contextlib.contextmanager
def naming(session: GatewaySession, name: str | None = None) -> Iterator[None]:
    """An upstream error raised inside, named as `renamed` names it."""
    try:
        yield
    except ApiError as error:
        raise renamed(session, error, name) from None


def renamed(session: GatewaySession, error: ApiError, name: str | None = None) -> ApiError:
    """The error, naming the session as the caller knows it (`name`, default its id) where Triton's or the
    client's words name its sequence id ("sequence 123", "session 123"); its type, and so its status and
    code, stay."""
    said = re.escape(str(session.upstream.id))
    message = re.sub(rf"\b(?:sequence|session) '?{said}'?(?!\w)", name or f"session '{session.id}'", error.message)
    if message == error.message:
        return error
    named = copy.copy(error)
    named.message, named.args = message, (message,)
    return named


# --- generation -----------------------------------------------------------------------------

GENERATED = {
    200: {
        "description": "`stream: false`: the generation, once it ended. `stream: true`: Server-Sent Events, one "
        '`data: {"token_id", "logprob"}` per token as it comes (`top` too when logprobs are asked), then '
        '`data: {"finish_reason", "held_length"}`, then `data: [DONE]`; an error after the first token is an '
        "`event: error` with the error body, and the stream ends",
        "content": {generate.EVENT_STREAM: {"schema": {"type": "string"}}},
    }
}


@v1.post(
    SESSION_PATH + "/generate",
    response_model=schemas.Generated,
    responses=GENERATED | responses(400, 401, 404, 409, 413, 422, 429, 502, 503, 504),
    summary="Generate tokens on the server after the prompt (or after what the session holds); the session keeps "
    "the prompt and every token answered",
)
async def generate_in_session(session_id: str, body: schemas.GenerateBody, gw: State, owner: Caller) -> Response:
    async with contextlib.AsyncExitStack() as held:
        session = await held.enter_async_context(gw.sessions.using(session_id, owner))  # busy until the answer ends
        model = gw.settings.session_model
        generating = gw.generate_model
        if generating != model:
            raise InvalidInput(
                f"'{generating}' generates, and this session is '{model}''s: POST /v1/generate, or the "
                "OpenAI-compatible routes, generate with it"
            )
        asked = generate.checked(body, await gw.model_info(model), model, stateless=False)
        held.enter_context(gw.quotas.growing(owner, session.upstream, asked.positions))  # settled once it ends
        tokens = session.upstream.generate(asked.ids, **asked.arguments)
        timed_out = "a generation timed out, so how many tokens Triton holds for it is unknown"
        on_error = functools.partial(_session_failed, gw, session, timed_out)
        what = f"generation of session '{session.id}'"
        return await generate.answer(gw, tokens, asked, what, on_error, held.pop_all())


@v1.post(
    "/generate",
    response_model=schemas.Generated,
    responses=GENERATED | responses(400, 401, 413, 422, 502, 503, 504),
    summary="Generate tokens after a prompt in a sequence of its own, ended afterwards (nothing is kept)",
)
async def generate_stateless(body: schemas.GenerateBody, gw: State, owner: Caller) -> Response:
    client = await gw.generation_client()
    model = client.session_model  # the generating session model, in a sequence of its own
    asked = generate.checked(body, await gw.model_info(model), model, stateless=True)
    held = contextlib.AsyncExitStack()
    try:  # counted as one of the key's sessions, and its KV bytes in the key's quota, while it runs
        held.enter_context(gw.in_flight(owner, 1))
        session = client.session(owner=owner)
        gw.quotas.opened(owner, session)
        held.callback(gw.quotas.release, session)
        gw.quotas.grow(owner, session, asked.positions)
        tokens = session.generate(asked.ids, end=True, **asked.arguments)
    except BaseException:
        await held.aclose()
        raise
    return await generate.answer(gw, tokens, asked, "stateless generation", _as_is, held)


def _as_is(error: ApiError) -> ApiError:
    return error


@v1.get(
    SESSION_PATH + "/snapshot",
    response_class=Response,
    responses={
        200: {"content": {SNAPSHOT_TYPE: {"schema": {"type": "string", "format": "binary"}}}},
        **responses(401, 404, 409, 502, 503, 504),
    },
    summary="The session's KV cache as bytes (safetensors): POST it to /v1/sessions to go on from here",
)
async def snapshot(session_id: str, gw: State, owner: Caller) -> Response:
    async with gw.sessions.using(session_id, owner) as session:
        with naming(session):
            blob = await gw.call(session.upstream.snapshot(), f"snapshot of session '{session.id}'")
    signed = await gw.offload(len(blob), integrity.snapshot_signed, blob, gw.keyring)
    return Response(signed, media_type=SNAPSHOT_TYPE)


@v1.post(
    SESSION_PATH + "/rewind",
    response_model=schemas.Rewound,
    responses=responses(400, 401, 404, 409, 422, 502, 503, 504),
    summary="Keep the session's first `length` positions; the next step continues after them",
)
async def rewind(session_id: str, body: schemas.RewindBody, gw: State, owner: Caller) -> dict:
    if body.length >= generate.INT64_LIMIT:  # the length travels to Triton as int64: a larger one cannot be sent
        raise InvalidInput(f"body.length: expected an integer in [0, 2**63), got {body.length}", param="length")
    async with gw.sessions.using(session_id, owner) as session:
        with naming(session):
            length = await gw.call(session.upstream.rewind(body.length), f"rewind of session '{session.id}'")
        gw.quotas.settle(owner, session.upstream)
    return {"length": length}


# --- prefixes -------------------------------------------------------------------------------


@v1.put(
    "/prefixes/{name}",
    status_code=201,
    response_model=schemas.Prefix,
    responses=responses(400, 401, 413, 422, 429, 502, 503, 504),
    summary="Prefill tokens once as a named prefix of this key; sessions then start from it without a prefill",
    openapi_extra=body_documented(schemas.StepBody),
)
async def put_prefix(name: str, request: Request, owner: Caller) -> dict:
    gw = the_gateway(request)
    raw = await request.body()
    body = await gw.offload(len(raw), validated.parse, raw, schemas.StepBody)
    info = await gw.model_info(gw.settings.session_model)
    valid = await gw.offload(len(raw), validated.step, body, info)
    tokens = real_tokens(valid.hidden_states, valid.attention_mask)
    with gw.quotas.putting_prefix(owner, name, tokens.shape[1]):  # 429 past the key's prefix quotas
        length = await gw.call(gw.client.put_prefix(name, tokens, owner=owner), f"prefix '{name}'")
    return {"name": name, "length": length}


@v1.get("/prefixes", response_model=schemas.PrefixList, responses=responses(401), summary="This key's prefixes")
async def list_prefixes(gw: State, owner: Caller) -> dict:
    return {"prefixes": [{"name": n, "length": length} for n, length in sorted(gw.client.prefixes(owner).items())]}


@v1.get(
    "/prefixes/{name}",
    response_model=schemas.Prefix,
    responses=responses(401, 404),
    summary="One prefix of this key: its name and the positions it holds",
)
async def get_prefix(name: str, gw: State, owner: Caller) -> dict:
    held = gw.client.prefixes(owner)
    if name not in held:
        raise PrefixNotFound(f"no prefix {name!r} (PUT /v1/prefixes/{{name}} first)")
    return {"name": name, "length": held[name]}


@v1.delete(
    "/prefixes/{name}",
    status_code=204,
    response_class=Response,
    responses=responses(401, 404, 502, 503, 504),
    summary="Delete a prefix; sessions started from it go on with their own copies",
)
async def delete_prefix(name: str, gw: State, owner: Caller) -> Response:
    if name not in gw.client.prefixes(owner):
        raise PrefixNotFound(f"no prefix {name!r}")
    gw.quotas.prefix_deleted(owner, name)  # the client forgets it before its DELETEs go out, whatever they answer
    await gw.call(gw.client.delete_prefix(name, owner=owner), f"deleting prefix '{name}'")
    return Response(status_code=204)


@v1.delete(
    SESSION_PATH,
    status_code=204,
    response_class=Response,
    responses=responses(401, 404, 409),
    summary="Close a session and free its server-side KV cache",
)
async def delete_session(session_id: str, gw: State, owner: Caller) -> Response:
    session = gw.sessions.remove(session_id, owner, "closed by DELETE")
    await gw.end_upstream(session)
    return Response(status_code=204)
