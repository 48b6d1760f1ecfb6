"""The asyncio client: the same API as `client.Client`, the core's operations (client/core.py)
awaited over tritonclient's grpc.aio / http.aio."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from client._wire import Health, InferResult, grpc_channel_args
from client.core import ClientCore, SessionCore, generation_request
from client.errors import ClientError
from client.generation import AsyncGeneration, Outcome, fetch_text_files
from client.metadata import ModelInfo
from client.retry import Operation, emitted_async, run_async
from contract import names
from contract.generation import DEFAULT_MAX_NEW_TOKENS, GenerationRequest, text_digest

T = TypeVar("T")


class AsyncClient(ClientCore):
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
                channel_args = grpc_channel_args(self.policy)
                self._stub_instance = self._module.InferenceServerClient(self.url, channel_args=channel_args)
            else:
                self._stub_instance = self._module.InferenceServerClient(self.url, conn_timeout=self.timeout)
        return self._stub_instance

    async def _run(self, operation: Operation[T]) -> T:
        return await run_async(operation, self._stub)

    async def close(self) -> None:
        stub, self._stub_instance = self._stub_instance, None
        if stub is not None:
            with contextlib.suppress(Exception):  # closing a broken connection has nothing to report
                await stub.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def health(self) -> Health:
        """Server liveness and readiness, and each model's readiness; ServerUnavailableError if the
        server cannot be reached."""
        return await self._run(self._health())

    async def ready(self) -> bool:
        """True when the server and both models are ready; False also when it cannot be reached."""
        return await self._run(self._ready())

    async def probe(self, also: Sequence[str] = ()) -> Health:
        """`Client.probe` for asyncio."""
        return await self._run(self._probe(also))

    async def wait_ready(self, timeout: float = 30.0, interval: float = 0.2) -> Health:
        """Poll until the server and both models are ready; ServerUnavailableError after `timeout` s."""
        return await self._run(self._wait_ready(timeout, interval))

    async def metadata(self, model: str | None = None) -> ModelInfo:
        """The served model's tensors and sizes (n_layers, d_model, n_kv_heads, head_dim), fetched once."""
        return await self._run(self._metadata(model))

    async def infer(
        self,
        hidden_states: np.ndarray,
        attention_mask: np.ndarray | None = None,
        past: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
        position_ids: np.ndarray | None = None,
        attention_maps: bool = False,
    ) -> InferResult:
        """As `Client.infer`: with `attention_maps=True` the result's `.attention_maps` is a list per
        layer of the attention weights (B, n_heads, T, P+T)."""
        return await self._run(self._infer(hidden_states, attention_mask, past, position_ids, attention_maps))

    def session(
        self,
        sequence_id: int | None = None,
        replica: str | None = None,
        *,
        restore: bytes | None = None,
        owner: str | None = None,
        prefix: str | None = None,
        store_key: str | None = None,
    ) -> AsyncSession:
        """As `Client.session`."""
        return AsyncSession(
            self, sequence_id, replica, restore=restore, owner=owner, prefix=prefix, store_key=store_key
        )

    def generate(
        self, ids: Any, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, stop_token_ids: Sequence[int] = (), **sampling
    ) -> AsyncGeneration:
        """As `Client.generate`: `async for token in client.generate(...)`."""
        session = AsyncSession(self)
        session._key = None  # nothing to keep: the server ends it
        return session._generation(ids, generation_request(max_new_tokens, stop_token_ids, **sampling), end=True)

    async def text_files(self) -> tuple[str, dict[str, bytes]] | None:
        """The tokenizer files the session model serves, as (their digest, name -> content), each checked
        against the digest its config publishes; None when it serves none (no tokenizer: token ids only)."""
        digest = await self._run(self._text_digest())
        if digest is None:
            return None
        files = await fetch_text_files(self._stub(), self.session_model, self.timeout)
        found = text_digest({name: hashlib.sha256(data).hexdigest() for name, data in files.items()})
        if found != digest:
            model = self.session_model
            raise ClientError(f"'{model}' answered text files of digest {found}, its config says {digest}")
        return digest, files

    async def put_prefix(self, name: str, tokens: np.ndarray, owner: str | None = None) -> int:
        """As `Client.put_prefix`."""
        return await self._run(self._put_prefix(name, tokens, owner))

    async def delete_prefix(self, name: str, owner: str | None = None) -> None:
        """As `Client.delete_prefix`."""
        await self._run(self._delete_prefix(name, owner))

    def prefixes(self, owner: str | None = None) -> dict[str, int]:
        """As `Client.prefixes`."""
        return self._prefixes(owner)


class AsyncSession(SessionCore):
    """`client.Session` for asyncio: `await session.step(...)`, `async with client.session() as s`."""

    client: AsyncClient

    async def open(self, *, fork_of: AsyncSession | None = None) -> AsyncSession:
        """`Session.open` for asyncio: START now, without tokens, so admission fails here."""
        await self.client._run(self._open(fork_of))
        return self

    def generate(
        self,
        ids: Any = None,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        stop_token_ids: Sequence[int] = (),
        end: bool = False,
        **sampling,
    ) -> AsyncGeneration:
        """As `Session.generate`: `async for token in session.generate(...)`; a bad input is raised at
        the first iteration."""
        return self._generation(ids, generation_request(max_new_tokens, stop_token_ids, **sampling), end=end)

    def _generation(self, ids: Any, request: GenerationRequest, end: bool = False) -> AsyncGeneration:
        request = dataclasses.replace(request, session_end=end)
        if end:  # nothing to keep: the server ends it
            self._key = None
        outcome = Outcome()
        return AsyncGeneration(emitted_async(self._generate(ids, request, outcome), self.client._stub), outcome)

    async def step(self, hidden_states: Any, attention_mask: Any = None, *, end: bool = False) -> np.ndarray:
        """Send new tokens (1, T, d_model) (and their (1, T) mask); return their output (1, T, d_model).
        A whole model's new tokens are int64 ids (1, T) and its answer their logits (1, T, vocab_size)."""
        return await self.client._run(self._step(hidden_states, attention_mask, end))

    async def close(self) -> None:
        """End the session on the server (idempotent; a session the server already forgot is fine)."""
        await self.client._run(self._close())

    async def snapshot(self) -> bytes:
        """As `Session.snapshot`."""
        return await self.client._run(self._snapshot())

    async def fork(self, sequence_id: int | None = None) -> AsyncSession:
        """As `Session.fork`."""
        child = AsyncSession(self.client, sequence_id, owner=self._owner.get(names.OWNER))
        return await child.open(fork_of=self)

    async def rewind(self, length: int) -> int:
        """As `Session.rewind`."""
        return await self.client._run(self._rewind(length))

    async def attention_maps(self, hidden_states: Any) -> list[np.ndarray]:
        """As `Session.attention_maps`: the maps of a step of `hidden_states`, the session unchanged."""
        return await self.client._run(self._attention_maps(hidden_states))

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, exc_type, *exc: object) -> None:
        if exc_type is None:
            await self.close()
            return
        with contextlib.suppress(ClientError):  # don't hide the error that is already on its way out
            await self.close()
