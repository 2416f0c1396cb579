"""The mirror's records in the TARGET cluster's metadata KV (JSON values).

- `mirror/<flow-id>/flow`: {"source_alias": "A"}: the source cluster this flow copies from,
  written once (if absent) by the flow's first partition; a flow id is one source -> target pair,
  like MirrorMaker 2's "A->B" flow, and `MirrorFlow` objects copy its partitions one each.
- `mirror/<flow-id>/partition/<target-partition>`: {"source_partition": "orders", "log_stream_id": n}:
  which source partition the target partition mirrors, and the target's log stream (so that
  a checkpointer with only the target's metadata reads the mirrored end: the stream's committed
  end). Written once, if absent, before the first segment.
- `mirror/<flow-id>/map/<target-partition>`: [[upstream_start, downstream_start], ...]: the offset
  map's segments (s3stream/mirror/offsets.py), replaced by compare-and-set.

Everything of a flow is under `mirror/<flow-id>/`, so one `list_kv` reads a flow whole and
deleting that prefix forgets it. The records live with the target because the target is what
they describe (its offsets), and a failover of the source must not lose them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..errors import CorruptDataError
from ..metadata import MetadataStore
from .errors import MirrorConflictError
from .offsets import Segment, add_segment, decode_segments, encode_segments
from .policy import check_name

PREFIX = "mirror/"


def flow_prefix(flow_id: str) -> str:
    return f"{PREFIX}{check_name('flow id', flow_id, 'A-to-B')}/"


def flow_key(flow_id: str) -> str:
    return flow_prefix(flow_id) + "flow"


def partition_key(flow_id: str, target_partition: str) -> str:
    return flow_prefix(flow_id) + "partition/" + check_name("target partition", target_partition)


def map_key(flow_id: str, target_partition: str) -> str:
    return flow_prefix(flow_id) + "map/" + check_name("target partition", target_partition)


@dataclass(frozen=True)
class PartitionRecord:
    """What a target partition of a flow mirrors (see the module docstring)."""
    target_partition: str
    source_partition: str
    log_stream_id: int

    def encode(self) -> bytes:
        return json.dumps({"source_partition": self.source_partition, "log_stream_id": self.log_stream_id},
                          sort_keys=True).encode()

    @classmethod
    def decode(cls, target_partition: str, raw: bytes, key: str) -> "PartitionRecord":
        try:
            d = json.loads(bytes(raw))
            return cls(target_partition, str(d["source_partition"]), int(d["log_stream_id"]))
        except (ValueError, TypeError, KeyError) as e:
            raise CorruptDataError(f"{key}: not a mirror partition record ({e}): {bytes(raw)[:200]!r}") from e


@dataclass
class FlowState:
    """A flow as its records describe it: the source alias (None: never started), and per target
    partition its record and its segments (empty: no segment yet)."""
    flow_id: str
    source_alias: str | None
    partitions: dict[str, PartitionRecord] = field(default_factory=dict)
    segments: dict[str, list[Segment]] = field(default_factory=dict)


def _decode_flow(raw: bytes, key: str) -> str:
    """The source alias in a flow record."""
    try:
        return str(json.loads(bytes(raw))["source_alias"])
    except (ValueError, TypeError, KeyError) as e:
        raise CorruptDataError(f"{key}: not a mirror flow record ({e}): {bytes(raw)[:200]!r}") from e


def register_flow(meta: MetadataStore, flow_id: str, source_alias: str) -> None:
    """Record the flow's source alias if it is new; MirrorConflictError if the flow id is taken
    by another source (two sources must not share a flow id: their maps would collide)."""
    check_name("source alias", source_alias, "A")
    key = flow_key(flow_id)
    value = json.dumps({"source_alias": source_alias}).encode()
    stored = _decode_flow(meta.put_kv_if_absent(key, value), key)
    if stored != source_alias:
        raise MirrorConflictError(
            f"flow {flow_id!r} copies from source alias {stored!r} ({key}), not {source_alias!r}; "
            f"give this source its own flow id (e.g. {source_alias + '-to-target'!r})")


def register_partition(meta: MetadataStore, flow_id: str, record: PartitionRecord) -> None:
    """Record what the target partition mirrors if it is new; MirrorConflictError if the flow
    already mirrors another source partition into it, or the target partition was recreated
    (another log stream) since the flow first wrote it."""
    key = partition_key(flow_id, record.target_partition)
    stored = PartitionRecord.decode(record.target_partition, meta.put_kv_if_absent(key, record.encode()), key)
    if stored.source_partition != record.source_partition:
        raise MirrorConflictError(
            f"flow {flow_id!r} already mirrors source partition {stored.source_partition!r} into "
            f"{record.target_partition!r} ({key}), not {record.source_partition!r}: two sources in one target "
            f"partition would break its offset map; pick another target name")
    if stored.log_stream_id != record.log_stream_id:
        raise MirrorConflictError(
            f"target partition {record.target_partition!r} was recreated: flow {flow_id!r} wrote log stream "
            f"{stored.log_stream_id}, it is now stream {record.log_stream_id}; its offset map no longer applies. "
            f"Delete the flow's records of it (KV {key!r} and {map_key(flow_id, record.target_partition)!r}) to "
            f"mirror into the new partition from scratch")


def load_segments(meta: MetadataStore, flow_id: str, target_partition: str) -> tuple[bytes | None, list[Segment]]:
    """The stored map value (for compare-and-set) and its segments."""
    key = map_key(flow_id, target_partition)
    raw = meta.get_kv(key)
    return raw, ([] if raw is None else decode_segments(raw, key))


def record_segment(meta: MetadataStore, flow_id: str, target_partition: str, upstream: int,
                   downstream: int) -> list[Segment]:
    """Add the segment of a (re)start at (`upstream`, `downstream`) by compare-and-set (see
    offsets.add_segment; nothing is written for a continuation) and return the segments.
    MirrorConflictError if the map changed since it was read: another instance of the flow took
    the target partition over in between, and this one must stop."""
    key = map_key(flow_id, target_partition)
    raw, segments = load_segments(meta, flow_id, target_partition)
    updated = add_segment(segments, upstream, downstream)
    if updated == segments:
        return segments
    if not meta.replace_kv(key, raw, encode_segments(updated)):
        raise MirrorConflictError(
            f"the offset map {key!r} changed while flow {flow_id!r} was starting on {target_partition!r}: another "
            f"instance of the flow took the partition over; this one stops (start it again to take over)")
    return updated


def load_flow(meta: MetadataStore, flow_id: str) -> FlowState:
    """Everything recorded of a flow, in one KV read."""
    prefix = flow_prefix(flow_id)
    state = FlowState(flow_id, None)
    for key, raw in meta.list_kv(prefix).items():
        rest = key[len(prefix):]
        if rest == "flow":
            state.source_alias = _decode_flow(raw, key)
        elif rest.startswith("partition/"):
            name = rest[len("partition/"):]
            state.partitions[name] = PartitionRecord.decode(name, raw, key)
        elif rest.startswith("map/"):
            state.segments[rest[len("map/"):]] = decode_segments(raw, key)
    return state


def list_flows(meta: MetadataStore) -> list[str]:
    """The ids of every flow recorded in this (target) cluster, ascending."""
    return sorted({key[len(PREFIX):].split("/", 1)[0] for key in meta.list_kv(PREFIX)})
