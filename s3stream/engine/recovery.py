"""Recovery of a node's WAL: the stream record format, and the replay that uploads and commits
what the WAL holds above each stream's committed end. Used by StreamClient at a node's start and
by failover on a dead node's behalf.

A stream record's body in the WAL is WAL_RECORD (stream id, stream epoch, base offset, record
count) followed by the batch payload: written natively by the append path
(_native/appendpath.pyx, WAL_PREFIX), read here and by `s3stream inspect wal`.
"""
from __future__ import annotations

import logging
import struct
from typing import Iterable, Sequence

import wal

from ..errors import CorruptDataError, StreamFencedError, StreamNotFoundError
from .logcache import LogCache
from ..metadata import CommitRequest, MetadataStore, StreamMeta, StreamState
from .upload import Uploader

log = logging.getLogger("s3stream")

#: Header of a stream record in the WAL: stream id, stream epoch, base offset, record count.
#: Written natively by the append path (_native/appendpath.pyx, WAL_PREFIX); read here.
WAL_RECORD = struct.Struct("<QQQI")


def replay_wal(records: Iterable[wal.Record], node_id: int, meta: MetadataStore, cache: LogCache, uploader: Uploader,
               gaps_below: int = 0, held: Sequence[StreamMeta] | None = None) -> dict:
    """Upload and commit the WAL records of `node_id` above each stream's committed end, through
    `cache` and `uploader` (whose node id and epoch are the ones committed under). Used at a
    node's restart and, on a dead node's behalf, by failover. Records of streams that have moved
    on (another owner or epoch) cannot be committed and are reported in the log. Below
    `gaps_below` (the WAL's salvaged_end: records there were salvaged past a corrupt span) a
    stream whose offsets stop at a gap keeps what precedes the gap; its records after it are
    dropped and reported (offsets cannot skip); elsewhere a gap is CorruptDataError. `held`:
    the streams the node holds open, if the caller listed them already. The result's `ends`
    are where the streams it committed records of end now."""
    # The streams the node holds open, in one read (a node with 10,000 partitions would
    # otherwise read 20,000 rows one by one); any other stream its WAL names is read alone.
    if held is None:
        held = meta.list_streams(owner_node_id=node_id, last_range=True)
    metas: dict[int, StreamMeta | None] = {m.stream_id: m for m in held}
    expected: dict[int, int] = {}
    broken: dict[int, list[int]] = {}          # stream -> [where it now ends, records dropped]
    count = replayed = 0
    last_end = None
    last_block = -1
    for rec in records:
        count += 1
        last_end = rec.end
        stream_id, epoch, base, n = WAL_RECORD.unpack_from(rec.data)
        if stream_id not in metas:
            try:
                metas[stream_id] = meta.get_stream(stream_id)
            except StreamNotFoundError:
                metas[stream_id] = None
        m = metas[stream_id]
        if m is None or m.state == StreamState.DELETED or base + n <= m.end_offset:
            continue
        if m.state != StreamState.OPENED or m.owner_node_id != node_id or m.epoch != epoch:
            log.error("stream %d: WAL of node %d holds offsets [%d, %d) above its committed end %d written at "
                      "epoch %d, but the stream is now %s on node %s at epoch %d: they cannot be committed",
                      stream_id, node_id, base, base + n, m.end_offset, epoch, m.state.value,
                      m.owner_node_id, m.epoch)
            continue
        want = expected.get(stream_id, m.end_offset)
        if stream_id in broken:
            broken[stream_id][1] += 1
            continue
        if base != want:
            if rec.offset >= gaps_below:
                raise CorruptDataError(f"WAL of node {node_id}: stream {stream_id} record at offset {base}, "
                                       f"expected {want}")
            broken[stream_id] = [want, 1]
            continue
        expected[stream_id] = base + n
        replayed += 1
        sealed = cache.put(stream_id, epoch, (base, n, memoryview(rec.data)[WAL_RECORD.size:]), rec.end, rec.offset)
        if sealed is not None:
            uploader.submit(sealed)
            last_block = sealed.block_id
            if last_block >= 2:        # bound memory: at most two blocks uploading behind the scan
                uploader.wait_committed(last_block - 2)
    sealed = cache.seal(reason="recovery")
    if sealed is not None:
        uploader.submit(sealed)
        last_block = sealed.block_id
    if last_block >= 0:
        uploader.wait_committed(last_block)
    for stream_id, (first, n) in sorted(broken.items()):
        log.error("stream %d: the salvaged WAL of node %d lost its records from offset %d on (a corrupt span); "
                  "%d later records of it are dropped: the stream ends at %d", stream_id, node_id, first, n, first)
    return dict(records=count, replayed=replayed, last_end=last_end, ends=expected,
                dropped={sid: dict(from_offset=first, records=n) for sid, (first, n) in broken.items()})


#: Streams one metadata transaction closes at a node's recovery or failover: a node holding
#: 10,000 partitions (20,000 streams) is closed in 20 writes, each a bounded transaction.
CLOSE_BATCH = 1000


def close_node_streams(meta: MetadataStore, node_id: int, node_epoch: int,
                       held: Sequence[StreamMeta] | None = None) -> int:
    """Close every stream `node_id` holds open (after its data was committed), as long as
    `node_epoch` is still its epoch: StreamFencedError once a newer incarnation registered (what
    it opened is its own; it recovers what the older ones held itself). CLOSE_BATCH streams per
    metadata transaction (a commit that only closes, as close_stream would each one). `held`:
    those streams, if the caller listed them already (before its replay): should one have been
    taken meanwhile (a failover of the node racing its restart), they are listed again."""
    listed = held is None
    if held is None:
        held = meta.list_streams(owner_node_id=node_id, last_range=True)
    closes = [(m.stream_id, m.epoch) for m in held]
    try:
        for i in range(0, len(closes), CLOSE_BATCH):
            meta.commit(CommitRequest(node_id, node_epoch, closes=tuple(closes[i:i + CLOSE_BATCH])))
    except StreamFencedError:
        if listed:
            raise
        return close_node_streams(meta, node_id, node_epoch)     # what it holds now; closed ones are not
    return len(closes)

