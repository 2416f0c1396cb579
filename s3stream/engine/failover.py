"""Failover: recover a dead node's WAL on its behalf (articles 000 and 002).

1. Fence the node: its epoch + 1 in metadata, so the old instance, if it is only paused (a
   "zombie"), can no longer commit or open streams; its next commit fails and it stops.
2. Open its WAL for recovery and replay the records above each stream's committed end: upload
   and commit them under the dead node's id and its new epoch, exactly as the node itself would
   have at restart. A WAL file is opened read-only and must be reachable from here, as a shared
   EBS volume is; a WAL of objects (s3://..., s3stream.engine.walopen) is read from the store by any
   host, and opening it writes a fence there, so a paused node's next PUT fails.
3. Close the streams it held, so that other nodes can open them (epoch + 1).
Nothing acknowledged by the dead node before it was fenced is lost: it was durable in its WAL.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import wal

from ..config import Config
from ..errors import S3StreamError, WALCorruptError, WALError
from .logcache import new_log_cache
from ..metadata import MetadataStore
from ..objectstore import ObjectStore
from .recovery import close_node_streams, replay_wal
from .upload import Uploader
from .walopen import open_node_wal, opened_before_fence

log = logging.getLogger("s3stream.failover")

def _open_for_recovery(path: str, node_id: int) -> wal.WAL:
    try:
        return open_node_wal(path, node_id=node_id, recovery=True)
    except (wal.WALError, OSError, S3StreamError) as e:
        raise WALError(f"failover of node {node_id}: cannot open its WAL {path!r}: {e}") from e


@dataclass
class ReplayedStream:
    """A stream the failed node held: committed up to `committed_end` when it was fenced, up to
    `end` once its WAL was replayed (the offsets [committed_end, end) were committed on its
    behalf)."""
    stream_id: int
    committed_end: int
    end: int

    @property
    def replayed(self) -> int:
        return self.end - self.committed_end


@dataclass
class FailoverReport:
    node_id: int
    fenced_epoch: int
    records: int
    replayed: int
    streams_closed: int
    seconds: float
    streams: list[ReplayedStream] = field(default_factory=list)    # per stream it held


def fail_over(node_id: int, *, store: ObjectStore, metadata: MetadataStore, config: Config | None = None,
              wal_path: str | None = None, settle: float = 0.0,
              sleep: Callable[[float], None] = time.sleep,
              if_unchanged: tuple[int, int] | None = None) -> FailoverReport:
    """Fence `node_id`, commit what its WAL holds, close its streams (see module docstring).

    `settle`: seconds to wait after the fence before reading the WAL, when the node may still
    hold a lease (docs/migration.md): a node that is alive acknowledges until its lease runs
    out, which after the fence (no more renewals) is within one lease; every record it
    acknowledged is then in the WAL read here. 0 when the node's lease is known to be over (a
    judge counted heartbeat_timeout of its silence) or it is not running (a restart's own
    recovery of an old WAL). `if_unchanged`: fence only if the node's (epoch, heartbeat) is
    still what its judge saw (MetadataStore.fence_node; NodeAliveError otherwise)."""
    config = config or Config()
    t0 = time.perf_counter()
    path = wal_path or metadata.get_node(node_id).wal_path
    # A WAL file is opened before the fence, a WAL of objects after it (walopen says why).
    w = _open_for_recovery(path, node_id) if opened_before_fence(path) else None
    try:
        node = metadata.fence_node(node_id, failover=True, if_unchanged=if_unchanged)
        if settle > 0:
            log.info("failover of node %d: fenced; waiting %.2f s for its lease to run out before reading its WAL",
                     node_id, settle)
            sleep(settle)
        if w is None:
            w = _open_for_recovery(path, node_id)
    except BaseException:
        if w is not None:
            w.close()
        raise
    # What it held once fenced (it commits nothing more): the figures of the report per stream.
    held = metadata.list_streams(owner_node_id=node_id, last_range=True)
    cache = new_log_cache(config, time.monotonic_ns)
    uploader = Uploader(node_id=node_id, node_epoch=node.node_epoch, store=store, metadata=metadata, cache=cache,
                        trim_wal=lambda offset: None, config=config, on_committed=lambda block, result: None,
                        on_fenced=lambda streams: None)
    try:
        try:
            result = replay_wal(w.recover(), node_id, metadata, cache, uploader, w.salvaged_end, held)
        except wal.WALCorruptError as e:
            raise WALCorruptError.from_wal(e, f"failover of node {node_id}: ") from e
    finally:
        uploader.close()
        w.close()
    closed = close_node_streams(metadata, node_id, node.node_epoch, held)
    ends = result["ends"]
    streams = [ReplayedStream(m.stream_id, m.end_offset, ends.get(m.stream_id, m.end_offset))
               for m in sorted(held, key=lambda m: m.stream_id)]
    report = FailoverReport(node_id, node.node_epoch, result["records"], result["replayed"], closed,
                            time.perf_counter() - t0, streams)
    log.warning("failed over node %d: %d WAL records (%d committed on its behalf), %d streams closed in %.3f s",
                node_id, report.records, report.replayed, closed, report.seconds)
    return report
