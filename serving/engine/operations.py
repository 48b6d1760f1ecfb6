"""The session operations as the engine core takes them (docs/design.md, "Session operations"): a
request on a session's sequence whose parameter `session_operation` names one of
`contract.names.OPERATIONS`:

| operation | flags | tokens | parameters, inputs | answer |
|---|---|---|---|---|
| `snapshot` | none | none | `owner`: who may restore it; `snapshot_since`: its first position | the blob |
| `restore` | START | none | input `snapshot`: a blob, or increments in order; `owner`: the caller | the length |
| `fork` | START (of the new sequence) | none | `fork_of`: the sequence forked | its length |
| `rewind` | none | none | `rewind_to`: the positions kept | the length |
| `put_prefix` | START and END (its own sequence) | the prefix's | `prefix`: its name; `owner` | -1 |
| `from_prefix` | START | none | `prefix`; `owner` | the session's length |
| `delete_prefix` | START and END | none | `prefix`; `owner` | -1 |
| `attention_maps` | none | a next step's, unpadded | none | its output (logits) and maps `attention.{i}`; the length |

`owner` is optional (empty: anyone); the blob is serving/engine/snapshots.py's. `attention_maps`
computes what a step of its tokens would and keeps nothing: the session's cache and length are as before.

The engine says which it offers and how each is sent (`StepEngine.operations()`, from the table
`serving.engine.steps.SESSION_OPERATIONS`): the flags are checked against that, and the method it
names is called. Each request is checked here and refused (INVALID_ARG, naming the parameter,
expected and actual; an operation the engine does not offer, naming the engine and those it does)
before the engine is touched."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from contract import names
from contract.inputs import real_tokens
from serving.engine import snapshots
from serving.engine.errors import InvalidRequest
from serving.engine.steps import Operation, StepEngine, StepRequest, check_step


def run(engine: StepEngine, step: StepRequest, operation: dict) -> dict[str, np.ndarray]:
    """Do `operation` (the request's parameters, with its `snapshot` input) on `step`'s sequence; the
    outputs it answers beside `held_length` (a snapshot's blob, the attention maps; none: {})."""
    name, table_entry = _check(engine, step, operation)
    answer = getattr(engine, table_entry.method)(*ARGUMENTS[name](engine, step, operation))
    if name == names.SNAPSHOT_OPERATION:
        return {names.SNAPSHOT: np.array([[answer]], dtype=np.object_)}
    if name == names.ATTENTION_MAPS_OPERATION:
        return answer
    return {}


def offered(engine: StepEngine) -> str:
    """The operations `engine` offers, as the model's load line says them."""
    return ", ".join(engine.operations()) or "none"


def _check(engine: StepEngine, step: StepRequest, operation: dict) -> tuple[str, Operation]:
    name = operation[names.OPERATION]
    if name not in names.OPERATIONS:
        raise InvalidRequest(f"parameter '{names.OPERATION}': expected one of {list(names.OPERATIONS)}, got {name!r}")
    table = engine.operations()
    if name not in table:
        served_by = type(engine).__name__
        raise InvalidRequest(f"'{name}' is not an operation of this model's {served_by}: it offers {offered(engine)}")
    wanted = table[name]
    for flag, sent_with, given in (("START", wanted.start, step.start), ("END", wanted.end, step.end)):
        if given != sent_with:
            raise InvalidRequest(f"'{name}' is sent {'with' if sent_with else 'without'} the {flag} flag")
    tokens, carried = 0 if step.hidden is None else step.hidden.shape[1], names.model_input(engine.cfg)
    if tokens and not wanted.tokens:
        raise InvalidRequest(f"'{name}' carries no tokens: expected {carried} of 0 tokens, got {tokens}")
    if wanted.tokens and not tokens:
        raise InvalidRequest(f"'{name}' carries tokens: expected {carried} of 1 or more, got 0")
    if name != names.RESTORE and operation.get(names.SNAPSHOT) is not None:
        raise InvalidRequest(f"input '{names.SNAPSHOT}' goes with '{names.RESTORE}' only, not with '{name}'")
    return name, wanted


def _maps_arguments(engine: StepEngine, step: StepRequest, parameters: dict) -> tuple:
    check_step(engine.cfg, step)  # as a step's tokens are checked: shape, finite values, the mask
    if step.mask is not None and not step.mask.all():
        raise InvalidRequest(
            f"'{names.ATTENTION_MAPS_OPERATION}' takes the next step's real tokens: expected no padding in its mask"
        )
    return step.sequence_id, step.hidden[0]


def _prefix_arguments(engine: StepEngine, step: StepRequest, parameters: dict) -> tuple:
    check_step(engine.cfg, step)  # as a step's tokens are checked (a whole model's ids within the vocabulary)
    return _owner(parameters), _prefix(parameters), real_tokens(step.hidden, step.mask)[0]


def _owner(parameters: dict) -> str:
    return _parameter(parameters, names.OWNER, (str,)) if names.OWNER in parameters else ""


def _since(parameters: dict) -> int:
    return _parameter(parameters, names.SNAPSHOT_SINCE, (int,)) if names.SNAPSHOT_SINCE in parameters else 0


def _prefix(parameters: dict) -> str:
    return _parameter(parameters, names.PREFIX, (str,))


# the core's own key among a snapshot's parameters: the session's token ids where it knows them (never a client's)
TOKEN_IDS = "_token_ids"

# operation -> the arguments of the engine's method for it, from (engine, step, the request's parameters)
ARGUMENTS: dict[str, Callable[[StepEngine, StepRequest, dict], tuple]] = {
    names.SNAPSHOT_OPERATION: lambda _, step, p: (step.sequence_id, _owner(p), _since(p), p.get(TOKEN_IDS)),
    names.RESTORE: lambda _, step, p: (step.sequence_id, _blobs(p.get(names.SNAPSHOT)), _owner(p)),
    names.FORK: lambda _, step, p: (_parameter(p, names.FORK_OF, (int, str)), step.sequence_id),
    names.REWIND: lambda _, step, p: (step.sequence_id, _parameter(p, names.REWIND_TO, (int,))),
    names.PUT_PREFIX: _prefix_arguments,
    names.FROM_PREFIX: lambda _, step, p: (step.sequence_id, _owner(p), _prefix(p)),
    names.DELETE_PREFIX: lambda _, step, p: (_owner(p), _prefix(p)),
    names.ATTENTION_MAPS_OPERATION: _maps_arguments,
}


def snapshot_token_ids(array: np.ndarray | None) -> np.ndarray | None:
    """The token ids a restore's blobs carry (snapshots.token_ids); None when they carry none or are not
    blobs (the restore itself says what is wrong with them)."""
    try:
        return snapshots.token_ids(_blobs(array))
    except (InvalidRequest, ValueError, KeyError, TypeError):
        return None


def _blobs(array: np.ndarray | None) -> list[bytes]:
    if array is None or array.size == 0:
        got = "none" if array is None else "0 elements"
        raise InvalidRequest(f"'{names.RESTORE}' needs input '{names.SNAPSHOT}': one blob or more, got {got}")
    return [blob if isinstance(blob, bytes) else bytes(blob) for blob in array.reshape(-1)]


def _parameter(operation: dict, key: str, types: tuple[type, ...]) -> Any:
    value = operation.get(key)
    if isinstance(value, bool) or not isinstance(value, types):
        kinds = " or ".join(t.__name__ for t in types)
        raise InvalidRequest(f"parameter '{key}': expected {kinds}, got {value!r}")
    return value
