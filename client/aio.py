"""The asyncio client: the same API as `client.Client`, over tritonclient's grpc.aio / http.aio."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from client import _wire, retry
from client._wire import Health, InferResult
from client.errors import ClientError, RequestTimeoutError, ServerUnavailableError, UnknownSessionError
from client.metadata import ModelInfo, parse_metadata

T = TypeVar("T")


class AsyncClient(_wire.ClientSettings):
    """`client.Client` for asyncio: same arguments, awaitable methods, `async with`.

    The tritonclient underneath is made on first use, inside the running event loop (aiohttp and
    grpc.aio bind to the loop that creates them); use one AsyncClient per event loop.
    """

    _module_suffix = ".aio"

    def _init_connections(self) -> None:
        self._stub_instance = None

    def _stub(self):
        if self._stub_instance is None:
            if self.protocol == "grpc":
                channel_args = _wire.grpc_channel_args(self.policy)
                self._stub_instance = self._module.InferenceServerClient(self.url, channel_args=channel_args)
            else:
                self._stub_instance = self._module.InferenceServerClient(self.url, conn_timeout=self.timeout)
        return self._stub_instance

    async def _call(
        self, what: str, fn: Callable[[Any], Awaitable[T]], *, retry_ok: bool = True, session: bool = False
    ) -> T:
        return await retry.acall(
            lambda: fn(self._stub()), self.policy, what=f"{what} at {self.url}", retry=retry_ok, session=session
        )

    async def close(self) -> None:
        stub, self._stub_instance = self._stub_instance, None
        if stub is not None:
            with contextlib.suppress(Exception):  # closing a broken connection has nothing to report
                await stub.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- health and metadata -----------------------------------------------------------------

    async def health(self) -> Health:
        """Server liveness and readiness, and each model's readiness; ServerUnavailableError if the
        server cannot be reached."""
        kw = self._timeout_kw
        live = await self._call("liveness check", lambda s: s.is_server_live(**kw))
        ready = await self._call("readiness check", lambda s: s.is_server_ready(**kw))
        names = (self.model, self.session_model)
        checks = [self._call(f"readiness check of '{n}'", lambda s, n=n: s.is_model_ready(n, **kw)) for n in names]
        models = dict(zip(names, await asyncio.gather(*checks), strict=True))
        return Health(self.url, live, ready, models)

    async def ready(self) -> bool:
        """True when the server and both models are ready; False also when it cannot be reached."""
        try:
            return (await self.health()).ok
        except (ServerUnavailableError, RequestTimeoutError):
            return False

    async def wait_ready(self, timeout: float = 30.0, interval: float = 0.2) -> Health:
        """Poll until the server and both models are ready; ServerUnavailableError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                state = await self.health()
                if state.ok:
                    return state
                why = state.problems()
            except (ServerUnavailableError, RequestTimeoutError) as error:
                why = error.message
            if time.monotonic() >= deadline:
                raise ServerUnavailableError(f"{self.url} is not ready after {timeout:g} s: {why}")
            await asyncio.sleep(interval)

    async def metadata(self, model: str | None = None) -> ModelInfo:
        """The served model's tensors and sizes (n_layers, d_model, n_kv_heads, head_dim), fetched once."""
        model = model or self.model
        if model not in self._infos:
            kw = {**_wire.metadata_kwargs(self.protocol), **self._timeout_kw}
            raw = await self._call(f"metadata of '{model}'", lambda s: s.get_model_metadata(model, **kw))
            self._infos[model] = parse_metadata(raw)
        return self._infos[model]

    # --- inference ---------------------------------------------------------------------------

    async def infer(
        self,
        hidden_states: np.ndarray,
        attention_mask: np.ndarray | None = None,
        past: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> InferResult:
        """One stateless call: the output and the presents (feed them back as `past` to decode)."""
        info = (await self.metadata()) if self.validate else None
        tensors = _wire.stateless_tensors(info, hidden_states, attention_mask, past)
        inputs = _wire.make_inputs(self._module, tensors)
        result = await self._call(f"infer on '{self.model}'", lambda s: s.infer(self.model, inputs, **self._timeout_kw))
        return _wire.read_stateless(result)

    def session(self, sequence_id: int | None = None) -> AsyncSession:
        """A new server-side session (nothing is sent until its first step)."""
        return AsyncSession(self, sequence_id)

    async def _send_step(self, sequence_id: int, tensors: dict, start: bool, end: bool) -> np.ndarray:
        # never retried: the server may have appended to the session's cache before the failure
        inputs = _wire.make_inputs(self._module, tensors)
        kw = {**_wire.sequence_kwargs(sequence_id, start, end), **self._timeout_kw}
        result = await self._call(
            f"step of session {sequence_id}",
            lambda s: s.infer(self.session_model, inputs, **kw),
            retry_ok=False,
            session=True,
        )
        return _wire.read_step(result)


class AsyncSession(_wire.SessionState):
    """`client.Session` for asyncio: `await session.step(...)`, `async with client.session() as s`."""

    async def step(self, hidden_states: np.ndarray, attention_mask: np.ndarray | None = None, *, end: bool = False):
        """Send new tokens (1, T, d_model) (and their (1, T) mask); return their output (1, T, d_model)."""
        self._check_open()
        client = self.client
        info = (await client.metadata(client.session_model)) if client.validate else None
        tensors = _wire.step_tensors(info, hidden_states, attention_mask)
        self._sending(tensors)
        try:
            output = await client._send_step(self.id, tensors, start=not self.started, end=end)
        except UnknownSessionError:
            self._forgotten()
            raise
        return self._stepped(output, end)

    async def close(self) -> None:
        """End the session on the server (idempotent; a session the server already forgot is fine)."""
        if self._closing():
            with contextlib.suppress(UnknownSessionError):
                await self.client._send_step(self.id, self._end_tensors(), start=False, end=True)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, exc_type, *exc: object) -> None:
        if exc_type is None:
            await self.close()
            return
        with contextlib.suppress(ClientError):  # don't hide the error that is already on its way out
            await self.close()
