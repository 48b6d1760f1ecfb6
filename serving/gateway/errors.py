"""Errors the gateway answers with: always `{"error": {"code": ..., "message": ..., "type": ..., "param": ...}}`,
OpenAI's error shape (its SDK reads `message`, `type`, `param` and `code`) with our stable `code`s; `type` says
the kind by status as OpenAI's do (`invalid_request_error`, `authentication_error`, ...), `param` names the
offending request field where one is known (else null).

Routes raise a typed `ApiError`; the handlers installed by `install_handlers` turn it, FastAPI's
validation errors, Starlette's HTTP errors (unknown route, wrong method) and anything unexpected
into that JSON body. An unexpected exception is logged with its traceback and answered with a
bare 500: the client never sees a stack trace.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class ErrorDetail(BaseModel):
    code: str = Field(description="stable machine-readable code, e.g. `invalid_input`")
    message: str = Field(description="what is wrong, naming the input and the expected and actual value")
    type: str = Field(description="the kind of error as OpenAI's API names it, by status: `invalid_request_error`...")
    param: str | None = Field(default=None, description="the offending request field, where one is known")


class ErrorBody(BaseModel):
    error: ErrorDetail


class ApiError(Exception):
    status = 500
    code = "internal"
    headers: ClassVar[dict[str, str] | None] = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


class InvalidInput(ApiError):
    status, code = 400, "invalid_input"


class SchemaViolation(ApiError):
    """The body is not JSON, or its fields do not match the OpenAPI document."""

    status, code = 422, "validation_error"


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"
    headers: ClassVar[dict[str, str] | None] = {"WWW-Authenticate": 'Bearer realm="attention-serving"'}


class SessionNotFound(ApiError):
    status, code = 404, "session_not_found"


class ModelNotFound(ApiError):
    status, code = 404, "model_not_found"


class PrefixNotFound(ApiError):
    status, code = 404, "prefix_not_found"


class SessionConflict(ApiError):
    status, code = 409, "session_conflict"


class SessionLost(SessionConflict):
    """Its KV cache died with the Triton process that held it: open a new session."""

    status, code = 409, "session_lost"


class BodyTooLarge(ApiError):
    status, code = 413, "body_too_large"


class BodyTimeout(ApiError):
    """The body did not arrive within the request's time (a client that sends a byte now and then)."""

    status, code = 408, "body_timeout"


class UnsupportedMediaType(ApiError):
    """A body of a Content-Type the route does not read: refused rather than read as another kind, or ignored."""

    status, code = 415, "unsupported_media_type"


class TooManySessions(ApiError):
    status, code = 429, "too_many_sessions"


class QuotaExceeded(ApiError):
    """This API key holds as much as its quota lets it (named prefixes, or KV cache bytes of its sessions and
    prefixes, serving/gateway/quotas.py); the message names the limit, its setting, the figure asked and held."""

    status, code = 429, "quota_exceeded"


class Overloaded(ApiError):
    """As many stateless requests are in flight as the gateway lets through: retry shortly."""

    status, code = 429, "overloaded"
    headers: ClassVar[dict[str, str] | None] = {"Retry-After": "1"}


class UpstreamFailed(ApiError):
    status, code = 502, "upstream_error"


class UpstreamUnavailable(ApiError):
    status, code = 503, "upstream_unavailable"
    headers: ClassVar[dict[str, str] | None] = {"Retry-After": "1"}


class UpstreamBusy(ApiError):
    """Triton serves but cannot take this now (its KV-cache budget is full)."""

    status, code = 503, "upstream_busy"
    headers: ClassVar[dict[str, str] | None] = {"Retry-After": "5"}


class UpstreamTimeout(ApiError):
    status, code = 504, "upstream_timeout"


# Statuses each kind of route can answer with, for the OpenAPI document.
DESCRIPTIONS = {
    400: "invalid input: the message names the input with the expected and actual shape, dtype or value",
    401: "missing or wrong API key (`Authorization: Bearer <key>` or `X-API-Key: <key>`)",
    404: "no such session or prefix (or it belongs to another key)",
    409: "the session cannot go on: lost with a Triton process (`session_lost`), evicted, or a step in flight",
    413: "request body larger than any valid request for the served model can be, or than the configured limit",
    415: "a body of a Content-Type the route does not read (the message names the type sent and those it reads)",
    422: "the body does not match the schema",
    429: "this API key holds as many open sessions, named prefixes or bytes of KV cache as its quotas let it "
    "(`too_many_sessions`, `quota_exceeded`: the message names the limit), or the gateway is at its cap on "
    "stateless requests or on large bodies in flight (`overloaded`, see Retry-After)",
    502: "Triton failed on a request it accepted",
    503: "Triton is unavailable, not ready, or its KV-cache budget is full (see Retry-After)",
    504: "the request took longer than the per-request timeout",
}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorBody, "description": DESCRIPTIONS[status]} for status in statuses}


# OpenAI's error types by status (its API reference, "Error codes"); anything else of 5xx is a server error
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"code": code, "message": message, "type": kind, "param": param}}


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None, param: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, code, message, param), status_code=status, headers=headers)


def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return error_response(error.status, error.code, error.message, error.headers, error.param)


def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    return error_response(422, "validation_error", describe_validation(error.errors()))


def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    codes = {404: "not_found", 405: "method_not_allowed"}
    return error_response(error.status_code, codes.get(error.status_code, "http_error"), str(error.detail))


def _unexpected(request: Request, error: Exception) -> JSONResponse:
    # the route's template, not the path: a path can hold a session id, which logs must not
    route = getattr(request.scope.get("route"), "path", "an unmatched route")
    log.error("unexpected error on %s %s", request.method, route, exc_info=error)
    return error_response(500, "internal", "internal error; it is logged on the server")


def describe_validation(errors: Any) -> str:
    """One line per problem, at most five: `body.hidden_states.0.1: Input should be a valid number (got 'x')`.
    The input itself is echoed only when short: a tensor can be megabytes."""
    lines = []
    for error in list(errors)[:5]:
        location = ".".join(str(part) for part in error.get("loc", ()))
        line = f"{location}: {error.get('msg', 'invalid')}"
        value = repr(error.get("input"))
        if "input" in error and len(value) <= 40:
            line += f" (got {value})"
        lines.append(line)
    more = len(list(errors)) - len(lines)
    return "; ".join(lines) + (f"; and {more} more" if more > 0 else "")


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
