"""Object counts and bytes by kind, from metadata alone."""
from __future__ import annotations

from collections import Counter
from typing import Any

from s3stream.metadata import MetadataStore, ObjectState, ObjectType


def object_stats(metadata: MetadataStore) -> dict[str, Any]:
    """Counts and bytes of objects by kind: committed StreamSetObjects and StreamObjects, objects
    waiting for deletion (MARK_DESTROYED) and uploads or compactions in flight or abandoned
    (PREPARED); the most SSOs of one node and the most StreamObjects of one stream."""
    out: dict[str, Any] = {kind: {"count": 0, "bytes": 0} for kind in
                           ("stream_set_objects", "stream_objects", "mark_destroyed", "prepared")}
    per_node: Counter[int | None] = Counter()     # an SSO's node id (None: never in a committed SSO)
    per_stream: Counter[int] = Counter()
    for o in metadata.list_objects():
        if o.state == ObjectState.COMMITTED:
            kind = "stream_set_objects" if o.type == ObjectType.STREAM_SET_OBJECT else "stream_objects"
            if o.type == ObjectType.STREAM_SET_OBJECT:
                per_node[o.node_id] += 1
            elif o.ranges:
                per_stream[o.ranges[0].stream_id] += 1
        else:
            kind = "mark_destroyed" if o.state == ObjectState.MARK_DESTROYED else "prepared"
        out[kind]["count"] += 1
        out[kind]["bytes"] += o.size
    out["committed"] = {
        "count": out["stream_set_objects"]["count"] + out["stream_objects"]["count"],
        "bytes": out["stream_set_objects"]["bytes"] + out["stream_objects"]["bytes"]}
    out["max_stream_set_objects_per_node"] = max(per_node.values(), default=0)
    out["max_stream_objects_per_stream"] = max(per_stream.values(), default=0)
    return out
