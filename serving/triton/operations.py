"""The session operations as `mha_session` takes them (docs/design.md, "Session operations"): a
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
| `attention_maps` | none | a next step's, unpadded | none | its `output` and maps `attention.{i}`; the length |

`owner` is optional (empty: anyone); the blob is serving/engine/snapshots.py's. `attention_maps`
computes what a step of its tokens would and keeps nothing: the session's cache and length are as before.

Each is checked here and refused (INVALID_ARG, naming the parameter, expected and actual) before the
engine is touched. Only the static engine has them."""

from __future__ import annotations

from typing import Any

import numpy as np

from contract import names
from serving.engine.errors import InvalidRequest
from serving.engine.steps import StepRequest, check_step

# operation -> (START, END, tokens) it is sent with
FLAGS = {
    names.SNAPSHOT_OPERATION: (False, False, False),
    names.RESTORE: (True, False, False),
    names.FORK: (True, False, False),
    names.REWIND: (False, False, False),
    names.PUT_PREFIX: (True, True, True),
    names.FROM_PREFIX: (True, False, False),
    names.DELETE_PREFIX: (True, True, False),
    names.ATTENTION_MAPS_OPERATION: (False, False, True),
}


def run(engine: Any, step: StepRequest, operation: dict) -> dict[str, np.ndarray]:
    """Do `operation` (the request's parameters, with its `snapshot` input) on `step`'s sequence; the
    outputs it answers beside `held_length` (a snapshot's blob, the attention maps; none: {})."""
    name = _check(engine, step, operation)
    sequence = step.sequence_id
    owner = _parameter(operation, names.OWNER, (str,)) if names.OWNER in operation else ""
    if name == names.SNAPSHOT_OPERATION:
        since = _parameter(operation, names.SNAPSHOT_SINCE, (int,)) if names.SNAPSHOT_SINCE in operation else 0
        return {names.SNAPSHOT: np.array([[engine.snapshot(sequence, owner, since)]], dtype=np.object_)}
    if name == names.ATTENTION_MAPS_OPERATION:
        check_step(engine.cfg, step)  # as a step's tokens are checked: shape, finite values, the mask
        if step.mask is not None and not step.mask.all():
            raise InvalidRequest(f"'{name}' takes the next step's real tokens: expected no padding in its mask")
        return engine.attention_maps(sequence, step.hidden[0])
    if name == names.RESTORE:
        engine.restore(sequence, _blobs(operation.get(names.SNAPSHOT)), owner)
    elif name in (names.PUT_PREFIX, names.FROM_PREFIX, names.DELETE_PREFIX):
        _prefix(engine, step, name, owner, _parameter(operation, names.PREFIX, (str,)))
    elif name == names.FORK:
        engine.fork(_parameter(operation, names.FORK_OF, (int, str)), sequence)
    else:
        engine.rewind(sequence, _parameter(operation, names.REWIND_TO, (int,)))
    return {}


def _check(engine: Any, step: StepRequest, operation: dict) -> str:
    name = operation[names.OPERATION]
    if name not in names.OPERATIONS:
        raise InvalidRequest(f"parameter '{names.OPERATION}': expected one of {list(names.OPERATIONS)}, got {name!r}")
    if not hasattr(engine, "snapshot"):
        raise InvalidRequest(f"'{name}' needs the static engine; this model runs the concat engine")
    start, end, carries_tokens = FLAGS[name]
    for flag, wanted, given in (("START", start, step.start), ("END", end, step.end)):
        if given != wanted:
            raise InvalidRequest(f"'{name}' is sent {'with' if wanted else 'without'} the {flag} flag")
    tokens = 0 if step.hidden is None else step.hidden.shape[1]
    if tokens and not carries_tokens:
        raise InvalidRequest(f"'{name}' carries no tokens: expected hidden_states of 0 tokens, got {tokens}")
    if carries_tokens and not tokens:
        raise InvalidRequest(f"'{name}' carries tokens: expected hidden_states of 1 or more, got 0")
    if name != names.RESTORE and operation.get(names.SNAPSHOT) is not None:
        raise InvalidRequest(f"input '{names.SNAPSHOT}' goes with '{names.RESTORE}' only, not with '{name}'")
    return name


def _prefix(engine: Any, step: StepRequest, name: str, owner: str, prefix: str) -> None:
    if name == names.PUT_PREFIX:
        tokens = step.hidden[0] if step.mask is None else step.hidden[0][step.mask[0].astype(bool)]
        engine.put_prefix(owner, prefix, tokens)
    elif name == names.FROM_PREFIX:
        engine.start_from_prefix(step.sequence_id, owner, prefix)
    else:
        engine.delete_prefix(owner, prefix)


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
