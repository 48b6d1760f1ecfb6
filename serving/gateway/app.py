"""The gateway app: `create_app(settings)` wires settings, auth, limits, metrics and routes."""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import AsyncIterator
from pathlib import Path

import swagger_ui_bundle
from fastapi import FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic.json_schema import models_json_schema
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.gateway import openai_api, responses_api, routes
from serving.gateway.errors import install_handlers
from serving.gateway.hot_path import HotRoutes
from serving.gateway.limits import RequestLimitsMiddleware
from serving.gateway.metrics import MetricsMiddleware
from serving.gateway.settings import Settings
from serving.gateway.state import GatewayState

# the names a loopback gateway answers to without keys (another Host header: a page's script by DNS rebinding)
LOOPBACK_NAMES = ["127.0.0.1", "localhost", "[::1]", "*.localhost"]

DESCRIPTION = """
A gateway in front of Triton for the attention model (docs/design.md): stateless attention with a
client-side KV cache (`/v1/attend`), sessions whose KV cache the server keeps (`/v1/sessions`), and
every head's attention weights (`/v1/inspect`; drawn by the page `/inspect`).

**Auth.** Send `Authorization: Bearer <key>` or `X-API-Key: <key>`. `/healthz`, `/readyz` and
`/metrics` are open.

**Tensors.** Nested JSON lists, or `{"dtype": "float32", "shape": [...], "b64": "..."}` objects
(raw little-endian C-order bytes, base64) anywhere a tensor goes. Add `?encoding=b64` to get the
response's tensors in that form.

**Errors.** Always `{"error": {"code": ..., "message": ..., "type": ..., "param": ...}}`: OpenAI's shape (`type`
by status, as OpenAI names it; `param`: the offending field where known) with our stable `code`s.

**OpenAI.** `/v1/completions` and `/v1/chat/completions` take OpenAI's bodies (text through the served model's
own tokenizer and chat template); `GET /v1/models` answers OpenAI's list (`data`) beside ours (`models`).
"""


# the routes every token pays for: called without FastAPI's per-request work (hot_path.py)
HOT_ROUTES = frozenset(
    {
        ("POST", "/v1/sessions/{session_id}/step"),
        ("POST", "/v1/attend"),
        ("POST", "/v1/sessions/{session_id}/generate"),
        ("POST", "/v1/generate"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
    }
)


class GatewayApp(FastAPI):
    """FastAPI under the gateway's own middleware (metrics outermost, then the request limits), with the hot
    routes called directly beneath them; FastAPI's stack answers the rest and whatever a hot route declines."""

    edge: ASGIApp | None = None  # set by create_app once the routes are in

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.edge is not None:
            await self.edge(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _install_edge(app: GatewayApp) -> HotRoutes:
    gateway = app.state.gateway
    hot_keys = HOT_ROUTES if gateway.settings.hot_routes else frozenset()
    candidates = [route for route in (*routes.v1.routes, *openai_api.openai.routes) if _route_key(route) in hot_keys]
    hot = HotRoutes(app, functools.partial(FastAPI.__call__, app), candidates)
    # metrics outermost: they see every answer, the limits' too; the limits run before any parsing
    edge: ASGIApp = RequestLimitsMiddleware(hot, gateway=gateway)
    if not gateway.settings.auth_enabled:  # open on loopback: a page's script must not reach it by a name it owns
        edge = TrustedHostMiddleware(edge, allowed_hosts=LOOPBACK_NAMES)
    app.edge = MetricsMiddleware(edge, metrics=gateway.metrics)
    return hot


def _route_key(route) -> tuple[str, str]:
    return (next(iter(getattr(route, "methods", None) or {""})), getattr(route, "path", ""))


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    gateway: GatewayState = app.state.gateway
    await gateway.start()
    if gateway.settings.gc_freeze:
        # what start-up made lives as long as the process: left out of every later collection (off by default: it
        # did not pay here, and in a process not the gateway's alone, a test's, it would freeze the host's objects)
        gc.collect()
        gc.freeze()
    try:
        yield
    finally:
        await gateway.stop()


def create_app(settings: Settings | None = None) -> FastAPI:
    """The gateway as an ASGI app; `settings=None` reads them from the environment."""
    settings = settings or Settings()
    app = GatewayApp(
        title="attention-serving gateway",
        version="1.0.0",
        description=DESCRIPTION,
        lifespan=_lifespan,
        docs_url=None,  # FastAPI's page loads Swagger UI from a CDN: blank on an offline host
        redoc_url=None,
        # no OpenTelemetry (the gateway's metrics are Prometheus'): asking whether it is configured read
        # the environment on every request
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    _install_docs(app)
    _install_inspect_page(app)
    app.state.gateway = GatewayState(settings)
    install_handlers(app)
    app.include_router(routes.v1)  # first: the router tries routes in order, and these are the busy ones
    app.include_router(openai_api.openai)
    app.include_router(responses_api.responses_router)
    app.include_router(routes.health)
    app.state.hot_routes = _install_edge(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document, plus what the routes do by hand: the schemas of the bodies they read
    themselves (routes.BODY_MODELS) and the API-key schemes of every /v1 route (routes.caller)."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = document["components"]
        template = "#/components/schemas/{model}"
        read_by_hand = (*routes.BODY_MODELS, *openai_api.BODY_MODELS, responses_api.ResponsesBody)
        _, bodies = models_json_schema([(model, "validation") for model in read_by_hand], ref_template=template)
        components["schemas"] = dict(sorted((components["schemas"] | bodies["$defs"]).items()))
        schemes = routes.SECURITY_SCHEMES
        components["securitySchemes"] = {
            s.scheme_name: jsonable_encoder(s.model, by_alias=True, exclude_none=True) for s in schemes
        }
        for path, operations in document["paths"].items():
            if path.startswith(routes.v1.prefix):
                for operation in operations.values():
                    operation["security"] = [{s.scheme_name: []} for s in schemes]
        app.openapi_schema = document
    return app.openapi_schema


def _install_docs(app: FastAPI) -> None:
    """`/docs`: Swagger UI from the files the swagger-ui-bundle package ships, served here."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
        )


DOCS_ASSETS = "/docs-assets"
INSPECT_ASSETS = "/inspect-assets"
STATIC = Path(__file__).resolve().parent / "static"  # package data (pyproject.toml)


# The page and its files run only what they ship: a key typed into it cannot be read by an injected script
# (no inline script or style, nothing from elsewhere), nor the page framed by another site to click through it.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
}


class _PageFiles(StaticFiles):
    """The page's static files, served with PAGE_HEADERS."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(PAGE_HEADERS)
        return response


def _install_inspect_page(app: FastAPI) -> None:
    """`/inspect`: a page that draws `POST /v1/inspect`'s maps (its files ship in the package; no CDN).
    The page is open, as /docs is; its calls carry the key the user types, as any caller's do."""
    app.mount(INSPECT_ASSETS, _PageFiles(directory=STATIC), name="inspect-assets")

    @app.get("/inspect", include_in_schema=False)
    async def inspect_page() -> FileResponse:
        return FileResponse(STATIC / "inspect.html", media_type="text/html", headers=PAGE_HEADERS)
