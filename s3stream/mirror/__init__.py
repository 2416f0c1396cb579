"""The mirror: copy partitions from one cluster into another with exact offset translation
(issue 13; article 004, Kafka MirrorMaker 2).

Pieces, one module each:
- policy.py: how a source partition is named on the target ("A" + "orders" -> "A.orders").
- offsets.py: the offset map, a few segments (upstream_start, downstream_start) that translate
  every mirrored upstream offset to the downstream offset of the same record, exactly.
- records.py: the flow's records in the target's metadata KV, under `mirror/<flow-id>/`.
- flow.py: MirrorFlow, the copy of one partition, exactly once across crashes and handovers.
- checkpoint.py: sync_checkpoints, consumer groups' offsets translated onto the target.
- heartbeat.py: liveness and replication latency, readable on the target alone.
- worker.py: MirrorWorker, a flow's partitions shared out over workers by leases, rebalanced
  incrementally (a join or leave moves only what the quotas demand); one leader writes the
  heartbeats and syncs checkpoints.
- status.py: mirror_status, the flows, leases, workers and heartbeats read from the target's KV.

Why exact, where MM2 is not: MM2 writes the copied records through a producer, which may
duplicate them on retries and assigns offsets it does not control, so it can only sample the
(upstream, downstream) relation and round consumer offsets down. Here the mirror owns both ends:
it appends each source batch unchanged as one target batch, as the target's only writer, so the
relation is a constant delta between restarts, and the target's own end is the flow's progress.

Invariants (each module states its own in detail):
1. Nothing but the flow appends to a mirrored target partition; the flow holds it open (one
   writer per partition is the engine's rule, fenced by epochs).
2. Target records [d_i, d_{i+1}) are exactly the source records [u_i, u_i + d_{i+1} - d_i), batch
   for batch, for every segment i of the map.
3. A segment is recorded before the first append it covers; a flow resumes at
   u_last + (target end - d_last), so every record the target acknowledged is kept, none is
   appended twice, and none is skipped (unless the source's retention dropped it first and the
   flow was told to skip: a gap, recorded as a new segment).
4. A translated consumer offset is never ahead of what the target holds (checkpoint.py).

KV layout (target cluster): `mirror/<flow-id>/flow`, `mirror/<flow-id>/partition/<target>`,
`mirror/<flow-id>/map/<target>` (records.py); consumer offsets under the target's
`consumer/<group>/...` (s3stream.records.consumer). Heartbeats are records of the target partition
`heartbeats`.
"""
from __future__ import annotations

from .checkpoint import CheckpointEntry, CheckpointReport, sync_checkpoints
from .errors import MirrorConflictError, MirrorError, MirrorNameError, OffsetNotMirroredError, SourceTrimmedError
from .flow import FlowMetrics, MirrorFlow
from .heartbeat import HEARTBEATS, Heartbeat, Heartbeater, latest_heartbeats, replication_latency
from .offsets import OffsetMap, Position, add_segment
from .policy import DefaultReplicationPolicy, IdentityReplicationPolicy, ReplicationPolicy
from .flowstate import FlowState, PartitionRecord, list_flows, load_flow
from .status import flow_status, mirror_status
from .worker import MirrorWorker, WorkerConfig

__all__ = [
    "CheckpointEntry", "CheckpointReport", "DefaultReplicationPolicy", "FlowMetrics", "FlowState", "HEARTBEATS",
    "Heartbeat", "Heartbeater", "IdentityReplicationPolicy", "MirrorConflictError", "MirrorError", "MirrorFlow",
    "MirrorNameError", "MirrorWorker", "OffsetMap", "OffsetNotMirroredError", "PartitionRecord", "Position",
    "ReplicationPolicy", "SourceTrimmedError", "WorkerConfig", "add_segment", "flow_status", "latest_heartbeats",
    "list_flows", "load_flow", "mirror_status", "replication_latency", "sync_checkpoints",
]
