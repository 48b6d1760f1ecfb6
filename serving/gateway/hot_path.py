"""The busy routes without the framework's per-request work (docs/design.md, "The gateway at the speed of gRPC").

FastAPI answers a session step through eight layers of middleware, a router that tries every route in turn
and a dependency solver; sampled under load, that was a fifth of the gateway's CPU per step, more than the
step's own checks. For the routes every token pays (a step, /v1/attend, the generations, the OpenAI routes),
`HotRoutes` does what FastAPI would do for the request and nothing more: it matches the route's own compiled
path, reads the body once, calls the same dependency functions and the same endpoint with the same arguments,
and sends the endpoint's `Response` as it is. Every check the route makes stays in the route: only how it is
called changes.

A route is hot only if every parameter it takes is one of the kinds below, checked once at start-up
(`HotRoute.of`); a route given a parameter of another kind later simply stays FastAPI's. A request that does
not take the common shape (an unexpected query, a body that is not JSON or does not fit its model) is handed
to FastAPI untouched, body replayed, so its answer, and its error's words, stay FastAPI's:

- path parameters, as the route's converters read them;
- `request: Request`;
- dependencies without parameters of their own, called here as FastAPI would call them (the API key check,
  the gateway state), once per request;
- query parameters of a `Literal` of strings (`?encoding=b64`), given at most once;
- one JSON body of a pydantic model, parsed by orjson and validated by the model, only with a JSON
  Content-Type.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qsl

import orjson
from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.gateway.limits import replay_body

Endpoint = Callable[..., Awaitable[Response]]
JSON_MEDIA_TYPE = "application/json"


class Declined(Exception):
    """The request is not in the shape the hot path takes: FastAPI answers it."""


class HotRoute:
    """One route called directly: how each of its endpoint's arguments is made from the request."""

    def __init__(self, route: APIRoute, dependencies: list[tuple[str | None, Callable]], queries: dict, body) -> None:
        self.route, self.endpoint, self.method = route, route.endpoint, next(iter(route.methods))
        self.match = route.path_regex.match
        self.convertors = route.param_convertors
        self.request_name = route.dependant.request_param_name
        self.dependencies = dependencies  # (argument name or None, dependency function(request))
        self.queries = queries  # argument name -> (default, accepted values)
        self.defaults = {name: default for name, (default, _) in queries.items()}
        # the queries callers send (`encoding=b64`), looked up whole rather than parsed
        self.common_queries = {
            f"{name}={value}".encode(): self.defaults | {name: value}
            for name, (_, accepted) in queries.items()
            for value in accepted
        }
        self.body = body  # (argument name, pydantic model) or None

    @classmethod
    def of(cls, route: APIRoute) -> HotRoute | None:
        """The hot form of `route`, or None when one of its parameters is of a kind not called here."""
        dependant = route.dependant
        if len(route.methods) != 1 or not _endpoint_returns_response(route):
            return None
        if dependant.header_params or dependant.cookie_params or _special_parameters(dependant):
            return None
        dependencies = [_plain_dependency(sub) for sub in dependant.dependencies]
        queries = {field.name: _literal_query(field) for field in dependant.query_params}
        body = _json_body(dependant)
        if None in dependencies or None in queries.values() or body is False:
            return None
        return cls(route, dependencies, queries, body)

    async def arguments(self, scope: Scope, request: Request, raw: bytes) -> dict:
        """The endpoint's arguments for this request, or Declined."""
        values = {name: self.convertors[name].convert(value) for name, value in scope["path_params"].items()}
        values |= self._query(scope["query_string"])
        solved: dict[Callable, object] = {}
        for name, dependency in self.dependencies:  # in FastAPI's order: the API key first, as its 401 comes first
            if dependency not in solved:
                solved[dependency] = await dependency(request)
            if name is not None:
                values[name] = solved[dependency]
        if self.body is not None:
            values[self.body[0]] = _parsed(request, raw, self.body[1])
        if self.request_name is not None:
            values[self.request_name] = request
        return values

    def _query(self, query_string: bytes) -> dict:
        if not query_string:
            return self.defaults
        common = self.common_queries.get(query_string)
        if common is not None:
            return common
        given = parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)
        names = [name for name, _ in given]
        if len(set(names)) != len(names) or not set(names) <= self.queries.keys():
            raise Declined
        values = dict(self.defaults)
        for name, value in given:
            if value not in self.queries[name][1]:
                raise Declined
            values[name] = value
        return values


def _endpoint_returns_response(route: APIRoute) -> bool:
    """FastAPI serializes anything else through the response model: only a `Response` is sent as it is."""
    returned = typing.get_type_hints(route.endpoint).get("return")
    return inspect.isclass(returned) and issubclass(returned, Response)


def _special_parameters(dependant: Dependant) -> bool:
    names = (
        dependant.websocket_param_name,
        dependant.http_connection_param_name,
        dependant.response_param_name,
        dependant.background_tasks_param_name,
        dependant.security_scopes_param_name,
    )
    return any(name is not None for name in names)


def _plain_dependency(sub: Dependant) -> tuple[str | None, Callable] | None:
    """(its argument name, its function of the request) for a dependency that takes only the request."""
    own = sub.path_params or sub.query_params or sub.header_params or sub.cookie_params or sub.body_params
    if own or sub.dependencies or _special_parameters(sub) or not inspect.iscoroutinefunction(sub.call):
        return None
    if list(inspect.signature(sub.call).parameters) != [sub.request_param_name]:
        return None
    return sub.name, sub.call


def _literal_query(field) -> tuple[str, frozenset[str]] | None:
    """(default, accepted values) of a query parameter that is a Literal of strings with a default."""
    annotation = field.field_info.annotation
    accepted = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else ()
    if not accepted or not all(isinstance(value, str) for value in accepted):
        return None
    if field.field_info.default not in accepted:
        return None
    return field.field_info.default, frozenset(accepted)


def _json_body(dependant: Dependant) -> tuple[str, type[BaseModel]] | bool | None:
    """(argument name, model) of a route's one JSON body; None without one; False for a body not taken here."""
    if not dependant.body_params:
        return None
    if len(dependant.body_params) != 1:
        return False
    field = dependant.body_params[0]
    model = field.field_info.annotation
    if not (inspect.isclass(model) and issubclass(model, BaseModel)) or field.field_info.embed:
        return False
    return field.name, model


def _parsed(request: Request, raw: bytes, model: type[BaseModel]) -> BaseModel:
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != JSON_MEDIA_TYPE:
        raise Declined
    try:
        return model.model_validate(orjson.loads(raw))
    except (orjson.JSONDecodeError, ValidationError):
        raise Declined from None


class HotRoutes:
    """The ASGI app under the gateway's own middleware: the hot routes called directly, everything else (and
    every request a hot route declines) handed to `fallback`, FastAPI's stack."""

    def __init__(self, app: FastAPI, fallback: ASGIApp, routes: list[APIRoute]) -> None:
        self.app, self.fallback = app, fallback
        self.hot = [hot for hot in map(HotRoute.of, routes) if hot is not None]

    @property
    def paths(self) -> list[tuple[str, str]]:
        """(method, path template) of every route called directly."""
        return [(hot.method, hot.route.path) for hot in self.hot]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = self._matched(scope)
        if hot is None:
            await self.fallback(scope, receive, send)
            return
        raw = await _whole_body(receive)
        replayed = replay_body(raw, receive)
        try:
            response = await self._answer(hot, scope, raw, replayed)
        except Declined:
            await self.fallback(scope, replay_body(raw, receive), send)
            return
        await response(scope, replayed, send)

    def _matched(self, scope: Scope) -> HotRoute | None:
        method, path = scope["method"], scope["path"]
        for hot in self.hot:
            if hot.method == method:
                found = hot.match(path)
                if found is not None:
                    scope["path_params"] = found.groupdict()
                    return hot
        return None

    async def _answer(self, hot: HotRoute, scope: Scope, raw: bytes, receive: Receive) -> Response:
        scope["app"], scope["route"], scope["endpoint"] = self.app, hot.route, hot.endpoint  # as the router sets them
        request = Request(scope, receive)
        try:
            return await hot.endpoint(**await hot.arguments(scope, request, raw))
        except Declined:
            raise
        except Exception as error:
            return await self._handled(request, error)

    async def _handled(self, request: Request, error: Exception) -> Response:
        """The answer the app's exception handlers give (the gateway's error body); the nearest class wins,
        as in Starlette. With none (not the case in the gateway: it handles Exception), the error goes on."""
        handlers = self.app.exception_handlers
        handler = next((handlers[kind] for kind in type(error).__mro__ if kind in handlers), None)
        if handler is None:
            raise error
        answer = handler(request, error)
        return await answer if inspect.isawaitable(answer) else answer


async def _whole_body(receive: Receive) -> bytes:
    """The request's body (the limits middleware has read and replays it: one message, as a rule)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
