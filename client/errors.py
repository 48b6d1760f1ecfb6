"""The client's exceptions, and the one place that maps tritonclient's errors onto them.

Every exception carries the server's message (`.message`, without its kind tag), the protocol status
it came with (`.status`: "400", "StatusCode.INVALID_ARGUMENT", ...; None when nothing came back) and
the kind the served model gave it (`.kind`, contract/errors.py; None for Triton's own errors). The
kind decides the type; without one, the status does (docs/design.md, "Errors").
"""

from __future__ import annotations

import http.client
import re
import sys

from contract import errors as kinds
from contract import names


class ClientError(Exception):
    """Base of every error this package raises."""

    def __init__(self, message: str, *, status: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind


class InvalidInputError(ClientError, ValueError):
    """The inputs do not fit the model (checked here before sending, or rejected by the server)."""

    def __init__(
        self, message: str, *, status: str | None = None, kind: str | None = None, input_name: str | None = None
    ) -> None:
        super().__init__(message, status=status, kind=kind)
        self.input_name = input_name


class UnknownSessionError(ClientError):
    """The server does not know the session: never started, already ended, evicted, or lost with the
    process that held it (`.kind` says which)."""


class SessionLostError(UnknownSessionError):
    """The session's KV cache died with the process that held it (a crashed model, a restarted
    server): open a new session and send its tokens again. The server works again once it has
    recovered (`Client.wait_ready`)."""


class ServerBusyError(ClientError):
    """The server is up but refuses the work for now (its KV-cache budget is full)."""


class ServerUnavailableError(ClientError):
    """The server cannot be reached, or is not ready."""


class RequestTimeoutError(ClientError, TimeoutError):
    """No answer within the client's timeout (or the server's deadline passed)."""


class ModelNotFoundError(ClientError):
    """The server has no such model loaded."""


class ServerError(ClientError):
    """The server failed on a request it accepted (500 / INTERNAL and the like)."""


# Safe-to-repeat calls retry only on these: the request never ran, or ran into a momentary limit.
RETRYABLE = (ServerUnavailableError, ServerBusyError)

# HTTP answers mapped to gRPC's names, so one table serves both protocols.
_HTTP_CODES = {
    "400": "INVALID_ARGUMENT",
    "404": "NOT_FOUND",
    "408": "DEADLINE_EXCEEDED",
    "429": "RESOURCE_EXHAUSTED",
    "501": "UNIMPLEMENTED",
    "503": "UNAVAILABLE",
    "504": "DEADLINE_EXCEEDED",
}
_BY_CODE: dict[str, type[ClientError]] = {
    "INVALID_ARGUMENT": InvalidInputError,
    "UNAVAILABLE": ServerBusyError,
    "RESOURCE_EXHAUSTED": ServerBusyError,
    "DEADLINE_EXCEEDED": RequestTimeoutError,
}
# The served models' kinds (contract/errors.py) and the type each becomes.
_BY_KIND: dict[str, type[ClientError]] = {
    kinds.INVALID_INPUT: InvalidInputError,
    kinds.SEQUENCE_TOO_LONG: InvalidInputError,
    kinds.PREFIX_UNKNOWN: InvalidInputError,
    kinds.CACHE_FULL: ServerBusyError,
    **dict.fromkeys(kinds.GONE_SEQUENCE, UnknownSessionError),
    kinds.SEQUENCE_LOST: SessionLostError,
}
# Triton core's own answer to a step of a sequence it does not hold (no kind: it is not our model's)
_TRITON_NO_SEQUENCE = "must specify the START flag"
# Triton's python backend when a model's process died (until the model is reloaded)
_DEAD_STUB = re.compile(r"Stub process '[^']*' is not healthy")
_UNKNOWN_MODEL = re.compile(r"unknown model|has no available versions", re.IGNORECASE)
# gRPC reports transport failures as UNAVAILABLE too; these words tell them from a busy server.
_TRANSPORT = re.compile(
    r"failed to connect|socket closed|connection (refused|reset|closed)|broken pipe|goaway|dns resolution|"
    r"endpoint closing|transport",
    re.IGNORECASE,
)


def _renamed_hint(message: str) -> str:
    """Where Triton does not know one of today's model names: the name a repository written before may hold it
    under (contract/names.py LEGACY_MODEL_NAMES), and what renames that repository's folders."""
    for quoted in re.findall(r"'([^']+)'", message):
        old = names.legacy_model_name(quoted)
        if old is not None:
            return (
                f" (a repository written before the models' names said what they serve holds '{quoted}' as "
                f"'{old}': `python -m serving ensure --repository DIR` or `python -m serving` renames it)"
            )
    return ""


def code_of(status: str | None) -> str | None:
    """gRPC-style code name of a tritonclient status ("404" -> NOT_FOUND, "StatusCode.X" -> X)."""
    if status is None:
        return None
    if status.startswith("StatusCode."):
        return status.removeprefix("StatusCode.")
    return _HTTP_CODES.get(status, "INTERNAL" if status.startswith("5") else status)


def from_server(message: str, status: str | None, *, session: bool = False) -> ClientError:
    """The typed error for a server's answer; `session` says the request was a session step."""
    if status is None:  # raised inside tritonclient before anything was sent
        return ClientError(message)
    kind, message = kinds.read(message)
    if kind is not None:
        return _BY_KIND[kind](message, status=status, kind=kind)
    return _untagged(message, status, code_of(status), session)


def _untagged(message: str, status: str, code: str | None, session: bool) -> ClientError:
    """An error of Triton's own (no kind): its code and a few of its messages tell what happened."""
    if _UNKNOWN_MODEL.search(message) and code in ("NOT_FOUND", "UNAVAILABLE", "INVALID_ARGUMENT"):
        return ModelNotFoundError(message + _renamed_hint(message), status=status)
    if _DEAD_STUB.search(message):  # a session's cache died with it; a stateless call can be repeated
        if session:
            return SessionLostError(message, status=status, kind=kinds.SEQUENCE_LOST)
        return ServerUnavailableError(message, status=status)
    if session and (code == "NOT_FOUND" or _TRITON_NO_SEQUENCE in message):
        return UnknownSessionError(message, status=status, kind=kinds.SEQUENCE_UNKNOWN)
    if code == "UNAVAILABLE" and _TRANSPORT.search(message):
        return ServerUnavailableError(message, status=status)
    return _BY_CODE.get(code, ServerError)(message, status=status)


def from_exception(error: BaseException, *, session: bool = False) -> ClientError | None:
    """The typed error for anything a tritonclient call raised; None for our own bugs (re-raise those)."""
    from tritonclient.utils import InferenceServerException

    if isinstance(error, ClientError):
        return error
    if isinstance(error, InferenceServerException):
        return from_server(str(error.message()), error.status(), session=session)
    if isinstance(error, TimeoutError):  # socket and asyncio timeouts (one class since Python 3.11)
        return RequestTimeoutError(f"no answer in time: {str(error) or 'the client timeout passed'}")
    if isinstance(error, OSError | http.client.HTTPException) or _is_aiohttp_connection_error(error):
        return ServerUnavailableError(f"cannot reach the server: {error!r}")
    return None


def _is_aiohttp_connection_error(error: BaseException) -> bool:
    # aiohttp is loaded only by the asyncio HTTP client; if it is not loaded, this is not its error
    aiohttp = sys.modules.get("aiohttp")
    return aiohttp is not None and isinstance(error, aiohttp.ClientConnectionError)
