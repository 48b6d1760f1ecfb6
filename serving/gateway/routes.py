"""The routes: health (open), models, stateless attention and sessions (behind an API key)."""

from __future__ import annotations

import asyncio
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from client import ClientError, ModelInfo
from contract import names
from serving.gateway import schemas
from serving.gateway.auth import ANONYMOUS, api_key_scheme, bearer_scheme, identify
from serving.gateway.encoding import Encoding, decode, encode
from serving.gateway.errors import (
    ApiError,
    InvalidInput,
    SessionConflict,
    UpstreamTimeout,
    UpstreamUnavailable,
    responses,
)
from serving.gateway.sessions import GatewaySession
from serving.gateway.state import GatewayState

# --- dependencies ---------------------------------------------------------------------------


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway


def caller(
    request: Request,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
    api_key: Annotated[str | None, Depends(api_key_scheme)],
) -> str:
    """The caller's identity (a fingerprint of its key), or 401."""
    keys = gateway_state(request).keys
    if not keys:
        return ANONYMOUS
    return identify(bearer.credentials if bearer is not None else api_key, keys)


State = Annotated[GatewayState, Depends(gateway_state)]
Caller = Annotated[str, Depends(caller)]
ResponseEncoding = Annotated[
    Encoding, Query(description="`b64`: tensors in the response as base64 tensor objects (see the description)")
]
SESSION_PATH = "/sessions/{session_id}"

health = APIRouter(tags=["health"])
v1 = APIRouter(prefix="/v1", dependencies=[Depends(caller)])


# --- health ---------------------------------------------------------------------------------


@health.get("/healthz", response_model=schemas.Status, summary="Liveness: the gateway process answers")
async def healthz() -> dict:
    return {"status": "ok"}


@health.get(
    "/readyz",
    response_model=schemas.Status,
    responses=responses(503),
    summary="Readiness: Triton is ready and both models answer a one-token request",
)
async def readyz(gw: State) -> dict:
    settings = gw.settings
    try:
        async with asyncio.timeout(settings.readiness_timeout_s):
            state = await gw.client.probe()
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
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# --- models ---------------------------------------------------------------------------------


@v1.get("/models", response_model=schemas.ModelList, responses=responses(401, 502, 503, 504))
async def list_models(gw: State) -> dict:
    """The two served models, their readiness and their tensors."""
    client = gw.client
    state = await gw.call(client.health(), "readiness of the models")
    kinds = {client.model: "stateless", client.session_model: "session"}
    models = []
    for name, kind in kinds.items():
        entry = {"name": name, "kind": kind, "ready": state.models.get(name, False)}
        if entry["ready"]:
            entry |= _describe(await gw.call(client.metadata(name), f"metadata of '{name}'"))
        models.append(entry)
    return {"models": models}


def _describe(info: ModelInfo) -> dict:
    tensors = [
        [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in group.values()]
        for group in (info.inputs, info.outputs)
    ]
    sizes = {"d_model": info.d_model, "dtype": info.float_dtype, "inputs": tensors[0], "outputs": tensors[1]}
    if info.n_layers:
        sizes |= {"n_layers": info.n_layers, "n_kv_heads": info.n_kv_heads, "head_dim": info.head_dim}
    return sizes


# --- stateless attention --------------------------------------------------------------------


@v1.post(
    "/attend",
    response_model=schemas.AttendResponse,
    responses=responses(400, 401, 413, 422, 429, 502, 503, 504),
    summary="One stateless forward pass: new tokens plus the past the caller holds",
)
async def attend(body: schemas.AttendRequest, gw: State, encoding: ResponseEncoding = "json") -> JSONResponse:
    async with gw.attend_slot():
        return await _attend(body, gw, encoding)


async def _attend(body: schemas.AttendRequest, gw: State, encoding: Encoding) -> JSONResponse:
    info = await gw.call(gw.client.metadata(), "model metadata")
    dtype = info.float_dtype
    hidden = decode(body.hidden_states, names.HIDDEN_STATES, dtype)
    check_request_tokens(hidden, gw.settings.max_request_tokens)
    mask = None if body.attention_mask is None else decode(body.attention_mask, names.ATTENTION_MASK, "int64")
    past = [
        tuple(decode(getattr(pair, kind), names.past_name(layer, kind), dtype) for kind in names.KV_KINDS)
        for layer, pair in enumerate(body.past_key_values or ())
    ]
    result = await gw.call(gw.client.infer(hidden, mask, past or None), "stateless attention")
    present = [{"key": encode(key, encoding), "value": encode(value, encoding)} for key, value in result.present]
    # built by hand, not through response_model: validating megabytes of floats again buys nothing
    return JSONResponse({"output": encode(result.output, encoding), "present": present})


def check_request_tokens(hidden: np.ndarray, limit: int) -> None:
    batch, new = hidden.shape[:2] if hidden.ndim >= 2 else (1, hidden.size)
    if batch * new > limit:
        raise InvalidInput(
            f"input '{names.HIDDEN_STATES}': batch x new = {batch} x {new} = {batch * new} tokens, more than the "
            f"gateway's {limit} per request (SERVING_MAX_REQUEST_TOKENS)"
        )


# --- sessions -------------------------------------------------------------------------------


@v1.post(
    "/sessions",
    status_code=201,
    response_model=schemas.SessionCreated,
    responses=responses(401, 413, 429, 502, 503, 504),
    summary="Open a session: the server keeps its KV cache between steps",
)
async def create_session(gw: State, owner: Caller, response: Response) -> dict:
    session = gw.sessions.reserve(owner, gw.client.session())
    try:  # START now: a full KV budget or a Triton that cannot serve answers here, not at the first step
        await gw.call(session.upstream.open(), "opening a session")
    except ApiError:
        gw.sessions.remove(session.id, owner, "refused when opened")
        await gw.end_upstream(session)  # Triton's batcher may hold the sequence
        raise
    gw.sessions.name(session)
    response.headers["Location"] = f"/v1/sessions/{session.id}"
    return {"id": session.id, "idle_timeout_s": gw.settings.session_idle_s}


@v1.post(
    SESSION_PATH + "/step",
    response_model=schemas.StepResponse,
    responses=responses(400, 401, 404, 409, 413, 422, 502, 503, 504),
    summary="Append new tokens to a session and return their output",
)
async def step(
    session_id: str, body: schemas.StepBody, gw: State, owner: Caller, encoding: ResponseEncoding = "json"
) -> JSONResponse:
    async with gw.sessions.using(session_id, owner) as session:
        info = await gw.call(gw.client.metadata(gw.client.session_model), "session model metadata")
        hidden = decode(body.hidden_states, names.HIDDEN_STATES, info.float_dtype)
        mask = None if body.attention_mask is None else decode(body.attention_mask, names.ATTENTION_MASK, "int64")
        output = await _step(gw, session, hidden, mask)
        return JSONResponse({"output": encode(output, encoding), "length": session.upstream.length})


async def _step(gw: State, session: GatewaySession, hidden: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """One upstream step; a session whose server-side state is lost or unknown is marked broken."""
    try:
        return await gw.call(session.upstream.step(hidden, mask), f"step of session '{session.id}'")
    except SessionConflict as error:
        gw.sessions.break_(session, f"Triton no longer holds its KV cache ({error.message})")
        raise
    except UpstreamTimeout:
        gw.sessions.break_(session, "a step timed out, so whether Triton applied it is unknown")
        raise


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
