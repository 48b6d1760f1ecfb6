"""A session's KV cache as bytes: a safetensors file of the sequence's keys and values up to its
length, with what it was made by in the file's metadata, so that it is only ever restored into the
same computation.

Tensors: one per past name (`past_key_values.{i}.key` / `.value`), each (n_kv_heads, length - start,
width) in the cache's dtype (width: head_dim, or head_dim / 2 bytes of two int4 codes for a uint8
cache; a quantized cache's codes as they are, its scales being the graph's): positions `start` to
`length` (a whole cache from 0; an increment, as a durable session's checkpoints write them, from
where the one before ended). Metadata
(safetensors keeps str -> str):

| key | what |
|---|---|
| `format` | `SNAPSHOT_FORMAT`; another one is refused |
| `config` | the model's config as JSON (contract/config.py, sorted keys) |
| `graph` | the file name of the graph the cache was made by (`model.fp32-static.onnx`) |
| `graph_sha256` | its sha256 (the weights are inside the graph): the build's, from `SHA256SUMS` |
| `dtype` | the cache's element type (`float32`, `float16`; `int8`, `uint8` for the int4 codes) |
| `length` | the positions held |
| `start` | the first position the blob holds (0: the whole cache; more: a checkpoint's increment) |
| `owner` | who may restore it (the gateway's keyed fingerprint of the caller's API key; empty: anyone) |
| `token_ids` | a whole model's ids at positions `start` to `length` (JSON), where the server knew them |
| `data_sha256` | the sha256 of the tensors' bytes in name order (blobs written before it carry none) |

A restored session whose blobs carry `token_ids` goes on from its last token like any other (a generation
without new ids), and its rows can be reused as a prefix; without them, the server asks for a token.

A blob is refused (`SnapshotError`, naming what differs, expected and actual) when it is not a
safetensors file, when its metadata is not this model's, graph or dtype, when its tensors do not
have the shapes its length and config say, or when a float cache holds a value that is not finite
(naming the tensor and the first such position), or when its data is not what its `data_sha256` says (a bit
flipped on a direct client's disk: the gateway's and the store's blobs carry a keyed tag besides); increments
are restored together (`decode_chunks`),
each starting where the one before ended.

The metadata says what a blob is for, not who made it: what is handed to users or kept in a store
carries a keyed tag (contract/integrity.py) that the gateway and the store check before a blob comes
here. Extra metadata (the gateway's `mac`) is ignored.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence

import numpy as np
import safetensors
import safetensors.numpy

from contract import names
from contract.config import ModelConfig
from serving.engine.errors import InvalidRequest

SNAPSHOT_FORMAT = "1"
# what must be the same for a cache to be restored into a pool (the length is the blob's own)
IDENTITY = ("format", "config", "graph", "graph_sha256", "dtype")


class SnapshotError(InvalidRequest):
    """A blob that cannot be restored here (INVALID_ARG); the message names what differs."""


def fingerprint(cfg: ModelConfig, dtype: str, graph: str = "", graph_sha256: str = "") -> dict[str, str]:
    """What a pool's snapshots carry and what a blob must carry to be restored into it."""
    return {
        "format": SNAPSHOT_FORMAT,
        "config": json.dumps(cfg.to_dict(), sort_keys=True),
        "graph": graph,
        "graph_sha256": graph_sha256,
        "dtype": str(np.dtype(dtype)),
    }


def encode(
    cache: Mapping[str, np.ndarray],
    identity: Mapping[str, str],
    length: int,
    owner: str = "",
    start: int = 0,
    token_ids: np.ndarray | None = None,
) -> bytes:
    """`cache`: past name -> (n_kv_heads, length - start, width), positions `start` to `length`; `token_ids`:
    the session's ids at positions 0 to `length` where known (the blob carries its positions')."""
    tensors = {name: np.ascontiguousarray(array[:, : length - start]) for name, array in cache.items()}
    metadata = {**identity, "length": str(length), "start": str(start), "owner": owner}
    metadata["data_sha256"] = _data_sha256(tensors)
    if token_ids is not None and len(token_ids) == length:
        metadata["token_ids"] = json.dumps([int(token) for token in token_ids[start:length]])
    return safetensors.numpy.save(tensors, metadata=metadata)


def token_ids(blobs: Sequence[bytes]) -> np.ndarray | None:
    """The token ids a snapshot's blobs (a whole cache, or its increments in order) carry, int32; None when any
    blob does not carry them (they were not known where it was made) or they do not cover its positions. Read
    once the blobs are restored (decode_chunks has checked them)."""
    found = []
    for blob in blobs:
        metadata = _metadata(blob)
        text = metadata.get("token_ids")
        if text is None:
            return None
        ids = json.loads(text)
        if len(ids) != int(metadata["length"]) - int(metadata.get("start", "0")):
            return None
        found += ids
    return np.asarray(found, np.int32)


def decode_chunks(
    blobs: Sequence[bytes], identity: Mapping[str, str], owner: str = ""
) -> tuple[dict[str, np.ndarray], int]:
    """`decode` of a whole cache given as increments, in order: the first from position 0, each
    next one from where the one before ended."""
    if not blobs:
        raise SnapshotError("no snapshot given: expected 1 or more blobs, got 0")
    parts, length = [], 0
    for index, blob in enumerate(blobs):
        cache, start, end = _decode_part(blob, identity, owner)
        if start != length:
            where = "position 0" if index == 0 else f"position {length}, where blob {index - 1} ends"
            raise SnapshotError(f"snapshot blob {index} starts at position {start}: expected {where}")
        parts.append(cache)
        length = end
    if len(parts) == 1:
        return parts[0], length
    return {name: np.concatenate([part[name] for part in parts], axis=1) for name in parts[0]}, length


def decode(blob: bytes, identity: Mapping[str, str], owner: str = "") -> tuple[dict[str, np.ndarray], int]:
    """The cache (past name -> (n_kv_heads, length, width)) and its length, from a blob made by the
    pool `identity` describes for `owner`; SnapshotError otherwise."""
    return decode_chunks([blob], identity, owner)


def _decode_part(blob: bytes, identity: Mapping[str, str], owner: str) -> tuple[dict[str, np.ndarray], int, int]:
    """One blob's positions (past name -> (n_kv_heads, length - start, width)), start and length."""
    try:
        tensors = safetensors.numpy.load(bytes(blob))
    except (safetensors.SafetensorError, ValueError) as error:
        raise SnapshotError(f"not a session snapshot (a safetensors file): {error}") from None
    metadata = _metadata(blob)
    written = metadata.get("data_sha256")
    if written is not None and written != _data_sha256(tensors):
        raise SnapshotError(
            "snapshot data: its sha256 is not the one it was written with: the blob was changed or corrupted after "
            "it was made (it is not restored)"
        )
    for key in IDENTITY:
        if metadata.get(key) != identity[key]:
            raise SnapshotError(_differs(key, identity[key], metadata.get(key)))
    if metadata.get("owner", "") != owner:  # which owner it is stays unsaid
        raise SnapshotError("the snapshot belongs to another owner (API key): it is not restored here")
    length = _length(metadata.get("length"), "length")
    start = _length(metadata.get("start", "0"), "start")
    if start > length:
        raise SnapshotError(f"snapshot metadata: 'start' {start} is past 'length' {length}")
    cfg = ModelConfig.from_dict(json.loads(identity["config"]))
    expected = (cfg.n_kv_heads, length - start, cache_width(cfg, identity["dtype"]))
    wanted = names.past_names(cfg.n_layers)
    if sorted(tensors) != sorted(wanted):
        raise SnapshotError(f"snapshot tensors: expected {wanted}, got {sorted(tensors)}")
    for name in wanted:
        if tensors[name].shape != expected or tensors[name].dtype != np.dtype(identity["dtype"]):
            raise SnapshotError(
                f"snapshot tensor {name}: expected {identity['dtype']} {list(expected)} (positions {start} to "
                f"{length}), got "
                f"{tensors[name].dtype} {list(tensors[name].shape)}"
            )
        _check_finite(name, tensors[name], start)
    return tensors, start, length


def _data_sha256(tensors: Mapping[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(np.ascontiguousarray(tensors[name]).data)
    return digest.hexdigest()


def _check_finite(name: str, values: np.ndarray, start: int) -> None:
    """A float cache's values are all finite: a NaN or an infinity restored would make every answer after it
    NaN or far off. Integer codes (a quantized cache) are any byte."""
    if values.dtype.kind != "f" or np.isfinite(values).all():
        return
    head, position, index = (int(i) for i in np.argwhere(~np.isfinite(values))[0])
    raise SnapshotError(
        f"snapshot tensor {name}: expected finite values, got {values[head, position, index]} at kv head {head}, "
        f"position {start + position}, index {index}"
    )


def cache_width(cfg: ModelConfig, dtype: str) -> int:
    """Values a position of a cache of `dtype` holds per kv head: a uint8 cache is int4 codes, two a byte."""
    quantized = next((kind for kind, element in names.CACHE_ELEMENT.items() if element == dtype), None)
    return names.cache_width(cfg.head_dim, quantized)


def _metadata(blob: bytes) -> dict[str, str]:
    # The safetensors header (8 bytes of little-endian length, then JSON) as its format defines it:
    # the library reads metadata only from a file on disk. safetensors.numpy.load has checked the header.
    (size,) = struct.unpack("<Q", bytes(blob[:8]))
    return json.loads(bytes(blob[8 : 8 + size])).get("__metadata__") or {}


def _length(text: str | None, key: str) -> int:
    if text is None or not text.isdigit():
        raise SnapshotError(f"snapshot metadata '{key}': expected a whole number of positions, got {text!r}")
    return int(text)


def _differs(key: str, here: str, blob: str | None) -> str:
    if blob is None:
        return f"not a session snapshot: its metadata has no '{key}' (expected {here!r})"
    if key == "config":
        ours, theirs = json.loads(here), json.loads(blob)
        fields = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        changes = ", ".join(f"{k} {theirs.get(k)!r} (here {ours.get(k)!r})" for k in fields)
        return f"the snapshot is of another model: {changes}"
    what = {"format": "snapshot format", "graph": "graph", "graph_sha256": "graph (sha256)", "dtype": "cache dtype"}
    return f"the snapshot was made with {what[key]} {blob!r}, this model serves {here!r}"
