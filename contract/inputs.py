"""Checking a set of named input tensors against the graph contract (docs/design.md, "Tensor names").

Used at every edge that takes tensors from a user: the PyTorch original's eager entry, the
ONNX Runtime runner behind Triton, the client before it sends. `check_inputs` works on anything with
`.shape` and `.dtype` (numpy arrays, torch tensors); the value checks (`check_finite`,
`check_mask_values`) on numpy arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from contract import names


class InputError(ValueError):
    """A user's input does not fit the model: names the input, the expected and the actual value."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"input '{name}': {message}")
        self.input_name = name


def named_inputs(
    new_tokens: Any,
    attention_mask: Any | None = None,
    past: Sequence[tuple[Any, Any]] | None = None,
    position_ids: Any | None = None,
    first: str = names.HIDDEN_STATES,
) -> dict[str, Any]:
    """The graph's named inputs from positional ones; `past` is one (key, value) pair per layer; `first`
    names the new tokens (`names.model_input`: hidden states, or a whole model's token ids)."""
    tensors = {first: new_tokens}
    if attention_mask is not None:
        tensors[names.ATTENTION_MASK] = attention_mask
    if position_ids is not None:
        tensors[names.POSITION_IDS] = position_ids
    for layer, pair in enumerate(past or ()):
        for kind, array in zip(names.KV_KINDS, pair, strict=True):
            tensors[names.past_name(layer, kind)] = array
    return tensors


def with_defaults(cfg: names.Sizes, feeds: Mapping[str, Any], cache_dtype: Any = np.float32) -> dict[str, Any]:
    """`feeds` completed with what a caller may leave out, as the PyTorch original reads it: an empty
    past (zero-length caches of the hidden states' dtype), an all-ones attention mask, and for a
    model placing tokens by position the positions counted from the mask (`default_positions`). The
    caches' dtype is the hidden states' (a whole model's: `cache_dtype`)."""
    new_tokens = feeds[names.model_input(cfg)]
    batch, new = new_tokens.shape[:2]
    filled = dict(feeds)
    if names.past_name(0, names.KEY) not in filled:
        dtype = cache_dtype if cfg.vocab_size is not None else new_tokens.dtype
        empty = np.zeros((batch, cfg.n_kv_heads, 0, cfg.head_dim), dtype)
        filled.update(dict.fromkeys(names.past_names(cfg.n_layers), empty))
    if names.ATTENTION_MASK not in filled:
        past = filled[names.past_name(0, names.KEY)].shape[2]
        filled[names.ATTENTION_MASK] = np.ones((batch, past + new), np.int64)
    if cfg.positioned and names.POSITION_IDS not in filled:
        filled[names.POSITION_IDS] = default_positions(np.asarray(filled[names.ATTENTION_MASK]), new)
    return filled


def default_positions(attention_mask: np.ndarray, new: int) -> np.ndarray:
    """The new tokens' positions (B, T) when a caller gives none, as Hugging Face derives them for left
    padding: the count of attended positions before each one (a padded position gets 1). The same
    rule as export/model.py's, on numpy arrays."""
    positions = np.cumsum(attention_mask.astype(np.int64), axis=-1) - 1  # (B, P+T)
    positions[attention_mask == 0] = 1
    return positions[:, attention_mask.shape[1] - new :]


def _dtype_name(array: Any) -> str:
    return str(array.dtype).removeprefix("torch.")


def check_inputs(
    cfg: names.Sizes,
    tensors: Mapping[str, Any],
    float_dtype: str | None = "float32",
    require_mask: bool = False,
) -> tuple[int, int, int]:
    """Check names, ranks, fixed sizes, dtypes and agreeing lengths; return (batch, past, new).

    `tensors` holds `hidden_states` (a whole model: `input_ids`), optionally `attention_mask`, and
    either every `past_key_values.*` or none of them (an empty past). `float_dtype=None` accepts any
    float dtype for the hidden states and caches as long as they agree. A whole model's token ids are
    checked against its vocabulary where `check_token_values` is called (numpy arrays).
    """
    expected = {spec.name: spec for spec in names.input_specs(cfg)}
    first = names.model_input(cfg)
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise InputError(unknown[0], f"unknown input; expected some of {list(expected)}")
    if first not in tensors:
        raise InputError(first, "missing")
    if require_mask and names.ATTENTION_MASK not in tensors:
        raise InputError(names.ATTENTION_MASK, "missing")
    past_given = [n for n in names.past_names(cfg.n_layers) if n in tensors]
    if past_given and len(past_given) != 2 * cfg.n_layers:
        missing = next(n for n in names.past_names(cfg.n_layers) if n not in tensors)
        raise InputError(missing, "missing; pass every past key and value, or none for an empty past")

    floats = tensors.get(names.past_name(0, names.KEY)) if first == names.INPUT_IDS else tensors[first]
    model_dtype = float_dtype or (_dtype_name(floats) if floats is not None else "float32")
    sizes: dict[str, int] = {}  # axis name -> size, filled by the first tensor that has it
    for name, array in tensors.items():
        spec = expected[name]
        _check_dtype(name, array, "int64" if spec.is_int64 else model_dtype)
        _check_shape(name, tuple(array.shape), spec.shape, sizes)

    batch, new = sizes[names.BATCH], sizes[names.SEQUENCE]
    past = sizes.get(names.PAST_SEQUENCE, 0)
    if batch < 1:
        raise InputError(first, f"{names.BATCH} must be at least 1, got {batch}")
    if new < 1:
        raise InputError(first, f"{names.SEQUENCE} must be at least 1, got 0")
    total = sizes.get(names.TOTAL_SEQUENCE, past + new)
    if total != past + new:
        raise InputError(
            names.ATTENTION_MASK,
            f"expected length past + new = {past} + {new} = {past + new}, got {total}",
        )
    return batch, past, new


def check_finite(tensors: Mapping[str, Any]) -> None:
    """Every float input holds finite values: one NaN or Inf in a step would poison every later step
    of its session (it lands in the cache). numpy arrays only (the serving edges and the client)."""
    for name, array in tensors.items():
        if array.dtype.kind == "f" and not _all_finite(array):
            where = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
            raise InputError(name, f"expected finite {array.dtype} values, got {array[where]} at index {list(where)}")


def check_token_values(cfg: names.Sizes, tensors: Mapping[str, Any]) -> None:
    """A whole model's token ids, where given, lie in [0, vocab_size): an id beyond the embeddings' table
    has no row to read. numpy arrays only."""
    ids = tensors.get(names.INPUT_IDS)
    if ids is None or cfg.vocab_size is None or not ids.size:
        return
    outside = (ids < 0) | (ids >= cfg.vocab_size)
    if outside.any():
        where = tuple(int(i) for i in np.argwhere(outside)[0])
        bad = f"got {ids[where]} at index {list(where)}"
        raise InputError(names.INPUT_IDS, f"token ids must lie in [0, {cfg.vocab_size}) (vocab_size), {bad}")


def check_one_sequence(batch: int, name: str = names.HIDDEN_STATES) -> None:
    """A session holds one sequence: its steps have batch_size 1."""
    if batch != 1:
        raise InputError(name, f"a session holds one sequence, so {names.BATCH} must be 1, got {batch}")


def check_mask_values(tensors: Mapping[str, Any]) -> None:
    """The attention mask, where given, holds only 1 (attend) and 0 (padding), the contract's two
    values. The graphs read any nonzero value as "attend", so a -1 meant as padding, or token ids sent
    as the mask, would be answered silently wrong: every edge refuses them alike. numpy arrays only."""
    mask = tensors.get(names.ATTENTION_MASK)  # None: left out (all ones)
    if mask is None or mask.size == 0:
        return
    outside = (mask < 0) | (mask > 1)
    if outside.any():
        where = tuple(int(i) for i in np.argwhere(outside)[0])
        raise InputError(
            names.ATTENTION_MASK, f"expected values 0 (padding) or 1 (attend), got {mask[where]} at index {list(where)}"
        )


def real_tokens(hidden: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """The tokens of one sequence's step (1, T, d), or its token ids (1, T), that its mask (1, T) marks
    real, (1, T_real, ...): what a session keeps of a step (its padded tokens never enter the cache). The
    one place padding is dropped."""
    if mask is None:
        return hidden
    keep = np.asarray(mask)[0].astype(bool)
    return hidden if keep.all() else hidden[:, keep]


def _all_finite(array: Any) -> bool:
    # a sum is finite iff every term is, unless finite terms overflow it: only then look at each value
    # (the sum reads the array once and allocates nothing; a 16 MiB past takes about a millisecond)
    if array.size == 0 or np.isfinite(array.sum(dtype=np.float64 if array.dtype.itemsize > 4 else np.float32)):
        return True
    return bool(np.isfinite(array).all())


def check_length(cfg: names.Sizes, past: int, new: int, name: str = names.HIDDEN_STATES) -> None:
    """past + new within the model's max_seq_len (a config's; GraphSizes read from a server do not
    know it and pass)."""
    limit = getattr(cfg, "max_seq_len", None)
    if limit is not None and past + new > limit:
        raise InputError(name, f"past + new = {past} + {new} = {past + new} positions, more than max_seq_len {limit}")


def check_positions(cfg: names.Sizes, tensors: Mapping[str, Any]) -> None:
    """Given positions lie in [0, max_seq_len): the rotation's table holds no angle beyond it (a
    config's limit; GraphSizes read from a server do not know it and pass)."""
    positions, limit = tensors.get(names.POSITION_IDS), getattr(cfg, "max_seq_len", None)
    if positions is None or limit is None or not _size(positions):
        return
    low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise InputError(
            names.POSITION_IDS,
            f"positions must lie in [0, {limit}) (max_seq_len: the rotary table's length), got {bad}",
        )


def _size(array: Any) -> int:
    return int(np.prod(tuple(array.shape)))


def check_request_tokens(
    batch: int, new: int, limit: int, setting: str | None = None, name: str = names.HIDDEN_STATES
) -> None:
    """batch x new within the deployment's cap on the tokens one stateless request computes; `setting`
    names the knob that sets `limit`, for the message."""
    if batch * new > limit:
        knob = f" ({setting})" if setting else ""
        raise InputError(
            name,
            f"batch x new = {batch} x {new} = {batch * new} tokens, more than this server's {limit} per request{knob}",
        )


def _check_dtype(name: str, array: Any, expected: str) -> None:
    if isinstance(array, np.ndarray) and array.dtype == np.dtype(expected):
        return  # numpy's dtype names are written in Python: str() of one costs more than the rest of the check
    actual = _dtype_name(array)
    if actual != expected:
        raise InputError(name, f"expected dtype {expected}, got {actual}")


def _check_shape(name: str, shape: tuple[int, ...], spec: tuple[str | int, ...], sizes: dict[str, int]) -> None:
    if len(shape) != len(spec):
        raise InputError(name, f"expected rank {len(spec)} {_show(spec)}, got shape {list(shape)}")
    for axis, (size, want) in enumerate(zip(shape, spec, strict=True)):
        if isinstance(want, int):
            if size != want:
                raise InputError(name, f"expected shape {_show(spec)} (axis {axis} = {want}), got {list(shape)}")
        elif sizes.setdefault(want, size) != size:
            raise InputError(
                name,
                f"axis {axis} ({want}) is {size} but other inputs give {sizes[want]}; got shape {list(shape)}",
            )


def _show(spec: tuple[str | int, ...]) -> str:
    return "[" + ", ".join(str(axis) for axis in spec) + "]"
