"""The settings an engine is made with, typed and checked (the Triton adapter reads them from a
model's parameters, serving/triton/engines.py). The facts are the deployment's (contract/deployment.py,
re-exported here for the engine's users); a wrong value is the engine's load-time error."""

from __future__ import annotations

import dataclasses

from contract import deployment
from contract.deployment import (  # noqa: F401  (re-exported: the engine's users read them here)
    ENGINE_CONCAT,
    ENGINE_STATIC,
    ENGINES,
    KV_INT4,
    KV_INT8,
    MAX_LIVE_SEQUENCES,
    MIN_ROW_POSITIONS,
)
from serving.engine.errors import EngineError


@dataclasses.dataclass(frozen=True)
class SessionSettings(deployment.SessionSettings):
    """What the `sessions` model's engine is made with; a value the deployment's checks refuse is an
    EngineError naming it (the model does not load)."""

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except ValueError as error:
            raise EngineError(str(error)) from None
