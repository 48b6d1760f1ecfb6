"""The FastAPI gateway in front of Triton (docs/design.md): auth, limits, metrics, OpenAPI.

    from serving.gateway import Settings, create_app, run_gateway, serve

`create_app(settings)` is the ASGI app; `serve(settings)` runs it with uvicorn in the foreground;
`run_gateway(settings)` runs it on a background thread and returns once it accepts connections;
`banner(gateway.settings, gateway.url)` is what to print then (URLs and a working curl line).
"""

from serving.gateway.app import create_app
from serving.gateway.server import RunningGateway, banner, run_gateway, serve
from serving.gateway.settings import Settings

__all__ = ["RunningGateway", "Settings", "banner", "create_app", "run_gateway", "serve"]
