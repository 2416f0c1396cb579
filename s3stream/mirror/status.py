"""What the mirror looks like from the target's metadata alone (no store, no client, nothing written):
the report behind `s3stream mirror status`.

Per flow: its source alias; per target partition, the source partition it mirrors, its offset
map's segment count, the mirrored end (the target log stream's committed end, downstream, and the
upstream offset it stands for), and its lease (holder, epoch, valid); the workers' records (live
or not, what each runs or waits for); the leader lease; and the leader's last heartbeats per
source with the replication latency they imply (now - mirrored_as_of). The heartbeats come from
the leader's KV copy (worker.heartbeat_summary_key), since the `heartbeats` partition itself needs
the target's object store to read.
"""
from __future__ import annotations

import time
from typing import Any

from ..cluster.lease import read_lease
from ..errors import S3StreamError, StreamNotFoundError
from ..metadata import MetadataStore
from .errors import MirrorError
from .offsets import OffsetMap
from .policy import check_name
from .flowstate import list_flows, load_flow
from .worker import decode_json, heartbeat_summary_key, leader_key, leases_prefix, workers_prefix


def _lease(record: dict | None, now: float) -> dict | None:
    if record is None:
        return None
    expires_in = round(record["expires_ns"] / 1e9 - now, 3)
    return {"holder": record.get("holder"), "epoch": record.get("epoch"), "expires_in_s": expires_in,
            "valid": expires_in > 0}


def flow_status(meta: MetadataStore, flow_id: str, now: float | None = None) -> dict:
    """One flow's report (see the module docstring). MirrorError if the target has no record of it."""
    check_name("flow id", flow_id, "A->B")
    now = time.time() if now is None else now
    state = load_flow(meta, flow_id)
    leases_at = leases_prefix(flow_id)
    leases = {key[len(leases_at):]: _lease(read_lease(raw), now) for key, raw in meta.list_kv(leases_at).items()}
    workers_at = workers_prefix(flow_id)
    workers: list[dict[str, Any]] = []
    for key, raw in meta.list_kv(workers_at).items():
        if not key[len(workers_at):].isdigit():
            continue
        record = decode_json(raw)
        record = record if isinstance(record, dict) else {}
        at = record.get("at")
        age = round(now - at, 3) if isinstance(at, (int, float)) else None
        timeout = record.get("timeout")
        live = age is not None and isinstance(timeout, (int, float)) and age < timeout
        flows = record.get("flows")
        flows = flows if isinstance(flows, dict) else {}
        workers.append({"worker": int(key[len(workers_at):]), "live": live, "age_s": age,
                        "leader": bool(record.get("leader")), "flows": sorted(flows), "pending": record.get("pending") or {},
                        "waiting": record.get("waiting") or {}, "wal_path": record.get("wal_path")})
    if state.source_alias is None and not leases and not workers:
        known = list_flows(meta)
        raise MirrorError(f"the target's metadata has no record of flow {flow_id!r} (KV mirror/{flow_id}/); "
                          f"flows recorded there: {known or 'none'}")
    running = {}
    for w in workers:
        if w["live"]:
            for target in w["flows"]:
                running[target] = w["worker"]
    partitions = []
    for target in sorted(set(state.partitions) | set(leases)):
        record = state.partitions.get(target)
        segments = state.segments.get(target) or []
        end = upstream_end = None
        if record is not None:
            try:
                end = meta.get_stream(record.log_stream_id).end_offset
            except StreamNotFoundError:
                end = None
            if segments and end is not None:
                try:
                    upstream_end = OffsetMap(segments, end).upstream_end
                except S3StreamError:
                    upstream_end = None
        lease = leases.get(target)
        partitions.append({"target_partition": target,
                           "source_partition": None if record is None else record.source_partition,
                           "segments": len(segments), "mirrored_end": end, "mirrored_upstream_end": upstream_end,
                           "lease_holder": lease["holder"] if lease and lease["valid"] else None,
                           "lease_epoch": None if lease is None else lease["epoch"],
                           "running_on": running.get(target)})
    summary = decode_json(meta.get_kv(heartbeat_summary_key(flow_id)))
    heartbeats = {}
    if isinstance(summary, dict) and isinstance(summary.get("heartbeats"), dict):
        for source, hb in sorted(summary["heartbeats"].items()):
            if not isinstance(hb, dict):
                continue
            at, mark = hb.get("at"), hb.get("mirrored_as_of")
            heartbeats[source] = {
                "at": at, "age_s": round(now - at, 3) if isinstance(at, (int, float)) else None,
                "flows": hb.get("flows"), "lag_records": hb.get("lag_records"), "mirrored_as_of": mark,
                "replication_latency_s": round(max(0.0, now - mark), 3) if isinstance(mark, (int, float)) else None,
                "leader": summary.get("leader")}
    return {"flow_id": flow_id, "source_alias": state.source_alias,
            "leader": _lease(read_lease(meta.get_kv(leader_key(flow_id))), now),
            "live_workers": sorted(w["worker"] for w in workers if w["live"]),
            "workers": sorted(workers, key=lambda w: w["worker"]),
            "partitions": partitions, "heartbeats": heartbeats}


def mirror_status(meta: MetadataStore, flow_id: str | None = None, now: float | None = None) -> dict:
    """{"flows": [flow_status of each flow recorded in the target, or of `flow_id` only]}."""
    now = time.time() if now is None else now
    ids = list_flows(meta) if flow_id is None else [flow_id]
    return {"at": now, "flows": [flow_status(meta, f, now) for f in ids]}
