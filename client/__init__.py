"""Client library for the served attention model (docs/design.md): numpy and tritonclient only.

    from client import Client

    with Client("127.0.0.1:8001") as triton:           # gRPC; Client(url, protocol="http") for HTTP
        first = triton.infer(hidden)                    # (B, T, d_model) float32, empty past
        step = triton.infer(token, mask, past=first.present)
        maps = triton.infer(hidden, attention_maps=True).attention_maps  # per layer (B, heads, T, P+T)
        with triton.session() as session:               # the server keeps this sequence's cache
            out = session.step(prompt)                  # START
            out = session.step(next_token)              # ... END when the block ends
            maps = session.attention_maps(next_token)   # its next step's maps; the session unchanged

`AsyncClient` has the same API with `await`. Errors are the types in `client.errors`.
"""

from client._wire import Health, InferResult
from client.aio import AsyncClient, AsyncSession
from client.errors import (
    ClientError,
    InvalidInputError,
    ModelNotFoundError,
    RequestTimeoutError,
    ServerBusyError,
    ServerError,
    ServerUnavailableError,
    SessionLostError,
    UnknownSessionError,
)
from client.metadata import ModelInfo
from client.retry import RetryPolicy
from client.sync import Client, Session
from contract.grammar import Grammar

__all__ = [
    "AsyncClient",
    "AsyncSession",
    "Client",
    "ClientError",
    "Grammar",
    "Health",
    "InferResult",
    "InvalidInputError",
    "ModelInfo",
    "ModelNotFoundError",
    "RequestTimeoutError",
    "RetryPolicy",
    "ServerBusyError",
    "ServerError",
    "ServerUnavailableError",
    "Session",
    "SessionLostError",
    "UnknownSessionError",
]
