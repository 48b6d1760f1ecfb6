"""The fallback engine in a room of its own: the `sessions` model's `concat` engine (engine.py), for configs
the static form cannot take (head_dim not a multiple of 8), with its batching by padding
(batching.py), its per-sequence store (store.py) and the copies of caches both make (copies.py). It
offers the static engine's session operations, with the same blobs."""

from serving.engine.concat.engine import ConcatSessionEngine
from serving.engine.concat.store import KVCacheStore

__all__ = ["ConcatSessionEngine", "KVCacheStore"]
