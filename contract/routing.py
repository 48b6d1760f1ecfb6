"""The two headers that route a session's steps through the proxy in front of the Triton replicas
(serving/host/envoy): the client library and the gateway send them, the proxy's config reads them.

A step of a session carries SESSION_HEADER (its sequence id, decimal): the proxy hashes it to choose
a replica for the session's first step. The answer to that step carries REPLICA_HEADER (an opaque
token naming the replica that now holds the session's KV cache); every later step sends it back, and
the proxy then sends the step to that replica and to no other (docs/scale-out.md).
"""

from __future__ import annotations

SESSION_HEADER = "x-session-id"
REPLICA_HEADER = "x-session-replica"
