"""The session operations as `mha_session` takes them (docs/design.md, "Session operations"): a
request on a session's sequence whose parameter `session_operation` names one of
`contract.names.OPERATIONS`, carrying no tokens:

| operation | flags | parameters, inputs | answer |
|---|---|---|---|
| `snapshot` | none | `owner` (optional): who may restore it | `snapshot`: the blob (serving/engine/snapshots.py) |
| `restore` | START | input `snapshot`: a blob; `owner` (optional): the caller | the restored length in `held_length` |
| `fork` | START (of the new sequence) | `fork_of`: the sequence forked | its length |
| `rewind` | none | `rewind_to`: the positions kept | the length |

Each is checked here and refused (INVALID_ARG, naming the parameter, expected and actual) before the
engine is touched. Only the static engine has them."""

from __future__ import annotations

from typing import Any

import numpy as np

from contract import names
from serving.engine.errors import InvalidRequest
from serving.engine.steps import StepRequest

NEEDS_START = (names.RESTORE, names.FORK)


def run(engine: Any, step: StepRequest, operation: dict) -> bytes | None:
    """Do `operation` (the request's parameters, with its `snapshot` input) on `step`'s sequence;
    the snapshot's blob for a snapshot, else None."""
    name = _check(engine, step, operation)
    sequence = step.sequence_id
    owner = _parameter(operation, names.OWNER, (str,)) if names.OWNER in operation else ""
    if name == names.SNAPSHOT_OPERATION:
        return engine.snapshot(sequence, owner)
    if name == names.RESTORE:
        engine.restore(sequence, _blob(operation.get(names.SNAPSHOT)), owner)
    elif name == names.FORK:
        engine.fork(_parameter(operation, names.FORK_OF, (int, str)), sequence)
    else:
        engine.rewind(sequence, _parameter(operation, names.REWIND_TO, (int,)))
    return None


def _check(engine: Any, step: StepRequest, operation: dict) -> str:
    name = operation[names.OPERATION]
    if name not in names.OPERATIONS:
        raise InvalidRequest(f"parameter '{names.OPERATION}': expected one of {list(names.OPERATIONS)}, got {name!r}")
    if not hasattr(engine, "snapshot"):
        raise InvalidRequest(f"'{name}' needs the static engine; this model runs the concat engine")
    if step.end:
        raise InvalidRequest(f"'{name}' cannot END the sequence: send END in a request of its own")
    if step.start != (name in NEEDS_START):
        wanted = "with" if name in NEEDS_START else "without"
        raise InvalidRequest(f"'{name}' is sent {wanted} the START flag (sequence_start)")
    tokens = 0 if step.hidden is None else step.hidden.shape[1]
    if tokens:
        raise InvalidRequest(f"'{name}' carries no tokens: expected hidden_states of 0 tokens, got {tokens}")
    if name != names.RESTORE and operation.get(names.SNAPSHOT) is not None:
        raise InvalidRequest(f"input '{names.SNAPSHOT}' goes with '{names.RESTORE}' only, not with '{name}'")
    return name


def _blob(array: np.ndarray | None) -> bytes:
    if array is None or array.size != 1:
        got = "none" if array is None else f"{array.size} elements"
        raise InvalidRequest(f"'{names.RESTORE}' needs input '{names.SNAPSHOT}': one blob, got {got}")
    blob = array.reshape(-1)[0]
    return blob if isinstance(blob, bytes) else bytes(blob)


def _parameter(operation: dict, key: str, types: tuple[type, ...]) -> Any:
    value = operation.get(key)
    if isinstance(value, bool) or not isinstance(value, types):
        kinds = " or ".join(t.__name__ for t in types)
        raise InvalidRequest(f"parameter '{key}': expected {kinds}, got {value!r}")
    return value
