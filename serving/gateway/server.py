"""Running the gateway with uvicorn: in the foreground (`serve`) or on a thread (`run_gateway`).

Without API keys the gateway binds to 127.0.0.1 whatever `host` says, and says so in the log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.supervisors import Multiprocess

from serving.gateway.app import create_app
from serving.gateway.settings import Settings

log = logging.getLogger(__name__)


def _bind_host(settings: Settings) -> str:
    """Where to listen, saying whether auth is on (and so whether `host` is honoured)."""
    host = settings.bind_host()
    if not settings.auth_enabled:
        ignored = f" (SERVING_HOST={settings.host} ignored)" if settings.host != host else ""
        log.warning(
            "auth is DISABLED: no SERVING_API_KEYS or SERVING_API_KEYS_FILE; serving on %s only%s", host, ignored
        )
    else:
        log.info("auth is enabled: %d API key(s)", len(settings.accepted_keys()))
    return host


class CoalescedTransport:
    """A transport whose writes within one turn of the event loop leave as one: uvicorn writes an answer's
    status line and headers, then its body, and each write was a system call and a TCP segment of its own
    (an eighth of the gateway's CPU per step went to the two). A large write goes out at once, after what is
    pending, rather than be copied into one buffer with it."""

    LARGE_WRITE_BYTES = 64 << 10

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop, self._pending = transport, loop, []

    def write(self, data: bytes) -> None:
        if len(data) >= self.LARGE_WRITE_BYTES:
            self._flush()
            self._transport.write(data)
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:  # everything else is the transport's own
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a `CoalescedTransport`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescedTransport(transport, self.loop))  # type: ignore[arg-type]


def _config(settings: Settings) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(settings),
        host=_bind_host(settings),
        http=CoalescingHttpToolsProtocol if settings.http_server == "uvicorn" else "httptools",
        loop="uvloop",
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=10,
        server_header=False,  # no version banner for scanners
        # no line per request: it cost a tenth of a step's time, and a path holds the session's id; the
        # metrics count requests by route and status, and errors are logged
        access_log=False,
        proxy_headers=False,  # nothing here reads the client's address: no X-Forwarded-For to rewrite it from
    )


def serve(settings: Settings | None = None) -> None:
    """Serve in the foreground until SIGINT/SIGTERM (uvicorn then re-raises the signal it caught)."""
    settings = settings or Settings()
    log.info("gateway for Triton gRPC at %s", settings.triton_url)
    if settings.http_server == "granian":
        _serve_granian(settings)
        return
    if settings.workers > 1:
        _serve_workers(settings)
        return
    uvicorn.Server(_config(settings)).run()


def _serve_workers(settings: Settings) -> None:
    """`settings.workers` processes accepting on one socket, each building its app from the environment
    (SERVING_*). A session id is a claim signed with the session secret, so the workers need the same
    one: without SERVING_SESSION_SECRET they get a random one made here, and sessions then belong to
    this gateway (its workers), as they belong to one process otherwise."""
    os.environ.setdefault("SERVING_SESSION_SECRET", secrets.token_urlsafe(32))
    config = _config(settings)
    config.app, config.factory, config.workers = f"{create_app.__module__}:create_app", True, settings.workers
    Multiprocess(config, sockets=[config.bind_socket()]).run()


def _serve_granian(settings: Settings) -> None:
    """`settings.workers` granian worker processes, each building its app from the environment, as
    `_serve_workers` does."""
    from granian.constants import HTTPModes, Interfaces, Loops
    from granian.server import Server

    os.environ.setdefault("SERVING_SESSION_SECRET", secrets.token_urlsafe(32))
    Server(
        f"{create_app.__module__}:create_app",
        address=_bind_host(settings),
        port=settings.port,
        interface=Interfaces.ASGI,
        workers=settings.workers,
        factory=True,
        loop=Loops.uvloop,
        http=HTTPModes.http1,
        log_access=False,
        workers_kill_timeout=15,
    ).serve()


class GatewayStartError(RuntimeError):
    """The gateway did not start listening (a taken port, a bad address)."""


class RunningGateway:
    """A gateway serving on a background thread; `stop()` (or leaving `with`) shuts it down."""

    def __init__(self, settings: Settings, ready_timeout: float = 30.0) -> None:
        self.settings = settings
        self._server = uvicorn.Server(_config(settings))
        # off the main thread uvicorn installs no signal handlers: the caller owns Ctrl-C
        self._thread = threading.Thread(target=self._server.run, name="gateway", daemon=True)
        self._thread.start()
        self._wait_started(ready_timeout)

    def _wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise GatewayStartError(
                    f"the gateway did not start on {self.settings.bind_host()}:{self.settings.port} "
                    "(is the port taken? see the log above)"
                )
            time.sleep(0.02)

    @property
    def port(self) -> int:
        """The bound port (the real one when settings.port is 0)."""
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.settings.bind_host()}:{self.port}"

    def stop(self, timeout: float = 15.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> RunningGateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _durability(settings) -> str:
    if not settings.session_store:
        return "not durable: a session whose Triton replica dies is lost (no session store)"
    from client.store import open_store

    return (
        f"durable: checkpoints every {settings.checkpoint_every} positions in {open_store(settings.session_store)!r}; "
        "a session whose replica dies is rebuilt at its next step"
    )


def banner(settings: Settings, url: str) -> str:
    """What `python -m serving` prints once the gateway is up at `url`: its URLs and a curl line that works."""
    auth = ' -H "X-API-Key: $SERVING_API_KEY"' if settings.auth_enabled else ""
    state = (
        f"enabled ({len(settings.accepted_keys())} key(s)); set SERVING_API_KEY to one for the curl line"
        if settings.auth_enabled
        else "disabled (no SERVING_API_KEYS or SERVING_API_KEYS_FILE): listening on 127.0.0.1 only"
    )
    return "\n".join(
        [
            f"gateway         {url}   (API docs: {url}/docs, OpenAPI: {url}/openapi.json)",
            f"gateway auth    {state}",
            f"sessions        {_durability(settings)}",
            f"try             {_attend_line(settings, url, auth)}",
            *_completion_line(settings, url, auth),
        ]
    )


def _attend_line(settings: Settings, url: str, auth: str) -> str:
    """A stateless call that works on the served model: token ids for a whole model, hidden states otherwise."""
    d_model, whole = _served_shape(settings)
    curl = f"curl -s {url}/v1/attend -H 'Content-Type: application/json'{auth}"
    if whole:
        return f"{curl} -d '{{\"input_ids\": [[1, 2, 3]]}}' | head -c 300; echo"
    hidden = f'{{"hidden_states": [[[0.1] * {d_model}]]}}'
    return f"python3 -c 'import json; print(json.dumps({hidden}))' | {curl} -d @- | head -c 300; echo"


def _completion_line(settings: Settings, url: str, auth: str) -> list[str]:
    """A text completion to try and a chat through the openai SDK, when the OpenAI-compatible routes serve a named
    model (the trained one, a served folder)."""
    model = settings.served_model_name
    if model is None:
        return []
    body = f'{{"model": "{model}", "prompt": "Q: Why", "max_tokens": 40, "temperature": 0.7}}'
    key = "os.environ['SERVING_API_KEY']" if settings.auth_enabled else "'none'"
    sdk = (
        f"import os; from openai import OpenAI; print(OpenAI(base_url='{url}/v1', api_key={key}).chat.completions"
        f".create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello'}}]).choices[0].message.content)"
    )
    more = [name for name in settings.more_served_models if name != model]
    return [
        *([f"models          {', '.join([model, *more])} (the `model` of a request names one)"] if more else []),
        f"text            curl -s {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'",
        f'sdk             .venv/bin/python -c "{sdk}"',
    ]


def _served_shape(settings: Settings) -> tuple[int | str, bool]:
    """d_model of the served model and whether it is a whole one (token ids in), for the curl line (a
    placeholder if Triton does not say)."""
    from client import Client, ClientError

    try:
        with Client(settings.triton_url, model=settings.model, timeout=5, retries=1) as triton:
            info = triton.metadata()
            return info.d_model, info.vocab_size is not None
    except ClientError:
        return "D_MODEL", False


def run_gateway(settings: Settings | None = None, ready_timeout: float = 30.0) -> RunningGateway:
    """Start the gateway on a background thread; return once it accepts connections."""
    return RunningGateway(settings or Settings(), ready_timeout)
