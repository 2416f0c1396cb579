"""MirrorFlow: copy one source partition into one target partition, exactly once.

A flow reads the source partition's COMMITTED batches (read_partition of an s3stream.open_reader,
or of a StreamClient: no epoch change on the source, whichever node owns it there) and appends
each, unchanged (same payload, same record count), as one batch to the target partition, which
the flow holds open as its only writer. The offset map (offsets.py) then translates every
upstream offset exactly.

Exactly once across crashes. The flow keeps no progress of its own: the target is the progress.
1. `start()` opens the target partition on the target client (epoch + 1: an earlier holder is
   fenced, and a node that died holding it must have been restarted on its WAL or failed over
   first, which commits every append it acknowledged; StreamNotClosedError otherwise).
2. The resume point is derived from the target's end D and the map's last segment (u, d):
   upstream u + (D - d), the record after the last one the target holds. First start: the
   configured `start_offset` or the source's start offset, rounded down to its batch's base.
3. That segment (resume point, D) is recorded by compare-and-set BEFORE the first append. A
   continuation has the same delta as the last segment and is merged (no write).
4. The loop appends batch after batch; the target assigns downstream offsets in append order, so
   whatever prefix of them survives a crash (acknowledged ones always do: they are in the target's
   WAL) is exactly the mirrored prefix, and step 2 continues right after it.
Crash points: before 3 nothing was appended; between 3 and the first acknowledged append the
segment is empty and the next start replaces it; after, the target's end says where to resume.
A resume also compares the target's last batch with the source batch the map says it came from
(count and payload); a mismatch means something else wrote the target and the flow refuses
(MirrorConflictError) rather than make the map wrong.

Memory is bounded: at most `max_in_flight_bytes` appended but not yet acknowledged (plus one batch
when a single batch is larger), and one source fetch of at most `fetch_bytes` held at a time (the
target's append copies the payload; a fetched payload may keep the ranged GET it came from, at most
the source client's read_fetch_size, alive until the next fetch). `stop()` returns within its timeout plus the target
partition's close (a force upload of its tail), and releases the partition so another worker
(another node of the target cluster) can take the flow over by starting it there.

Latency: a source record becomes visible to the flow only once its owner uploads it
(Config.upload_interval on the source), so replication latency is at least that; `lag_records` is
the source's committed end minus the mirrored (acknowledged) upstream position.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

from ..errors import (InvalidArgumentError, OffsetOutOfRangeError, S3StreamError, StreamClosedError,
                      StreamFencedError, StreamNotFoundError, check_int)
from ..metadata import MetadataStore
from ..cluster.partition import PartitionMovedError, open_partition, partitions_on, read_partition
from ..batches import AppendFuture, FetchedBatch, RecordBatch
from .errors import MirrorConflictError, MirrorError, MirrorNameError, SourceTrimmedError
from .offsets import OffsetMap, Segment
from .policy import DefaultReplicationPolicy, ReplicationPolicy, check_name
from .flowstate import PartitionRecord, load_segments, record_segment, register_flow, register_partition

if TYPE_CHECKING:
    from ..client import StreamClient
    from ..reader import StreamReader
    from ..cluster.partition import Partition, PartitionReader

log = logging.getLogger("s3stream.mirror")

MiB = 1 << 20

#: Flow states.
NEW, STARTING, RUNNING, STOPPED, FAILED = "new", "starting", "running", "stopped", "failed"


def client_metadata(client: "StreamClient") -> MetadataStore:
    """The metadata store of a client's cluster."""
    return client.metadata


@dataclass(frozen=True)
class FlowMetrics:
    """A snapshot of a flow. Positions are upstream offsets unless named downstream;
    `upstream_position` is the mirrored end: every source record below it is acknowledged by the
    target. `lag_records` = `source_end` (the source's committed end, as last read) minus it.
    `last_append_latency`: seconds from the last acknowledged append's call to its durability in
    the target's WAL. `mirrored_as_of`: a unix time t such that every record the source had
    committed at t is mirrored (None: not yet known); now - t bounds the replication latency
    (plus the source's upload interval, before which a record is not committed)."""
    flow_id: str
    source_alias: str
    source_partition: str
    target_partition: str
    state: str
    upstream_position: int | None
    downstream_position: int | None
    source_end: int | None
    lag_records: int | None
    records: int
    bytes: int
    batches: int
    in_flight_bytes: int
    peak_in_flight_bytes: int
    last_append_latency: float | None
    mirrored_as_of: float | None
    segments: int
    error: str | None


class _InFlight(NamedTuple):
    future: AppendFuture
    # The field shadows tuple.count (mypy flags any such field); entry.count is the record count.
    count: int  # type: ignore[assignment]
    nbytes: int
    upstream_end: int
    downstream_end: int


class MirrorFlow:
    """The copy of `source_partition` (read through `source_client`, a StreamReader or a
    StreamClient of the source cluster) into `target_partition` (written through
    `target_client`, a node of the target cluster) under flow `flow_id` (one source -> target
    pair; see records.py for its KV).

    start_offset: where the first start begins (default: the source's start offset); rounded
        down to the base of its batch. Once the flow has a map it is ignored: a resume continues
        exactly where the target ends.
    max_in_flight_bytes: appended but unacknowledged bytes at most (one larger batch may pass alone).
    fetch_bytes: bytes per source fetch at most (at least one batch).
    poll_interval: seconds between looks at the source's committed end once caught up.
    skip_trimmed: when the source's retention removed records not yet mirrored, continue after
        the gap (recorded as a new segment; position() maps consumers inside it to the next
        mirrored record) instead of failing with SourceTrimmedError.
    verify_resume: compare the target's last batch with its source batch on resume (two small reads).
    clock: unix time in seconds, for mirrored_as_of.
    """

    def __init__(self, source_client: "StreamReader | StreamClient", target_client: "StreamClient",
                 source_partition: str,
                 target_partition: str, flow_id: str, *, source_alias: str, start_offset: int | None = None,
                 max_in_flight_bytes: int = 8 * MiB, fetch_bytes: int = 1 * MiB, poll_interval: float = 0.05,
                 skip_trimmed: bool = False, verify_resume: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        self.source_partition = check_name("source partition", source_partition)
        self.target_partition = check_name("target partition", target_partition)
        self.flow_id = check_name("flow id", flow_id, "A-to-B")
        self.source_alias = check_name("source alias", source_alias, "A")
        if source_client is target_client and source_partition == target_partition:
            raise MirrorNameError(f"flow {flow_id!r} would mirror partition {source_partition!r} into itself; "
                                  f"name another target partition (e.g. {source_alias + '.' + source_partition!r})")
        if start_offset is not None:
            check_int("start_offset", start_offset)
        check_int("max_in_flight_bytes", max_in_flight_bytes, minimum=1)
        check_int("fetch_bytes", fetch_bytes, minimum=1)
        if isinstance(poll_interval, bool) or not isinstance(poll_interval, (int, float)) or not poll_interval > 0:
            raise InvalidArgumentError(f"poll_interval must be positive seconds, got {poll_interval!r}; e.g. 0.05")
        self.source_client = source_client
        self.target_client = target_client
        self.start_offset = start_offset
        self.max_in_flight_bytes = max_in_flight_bytes
        self.fetch_bytes = fetch_bytes
        self.poll_interval = float(poll_interval)
        self.skip_trimmed = bool(skip_trimmed)
        self.verify_resume = bool(verify_resume)
        self.clock = clock
        self._target_meta = client_metadata(target_client)
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._partition: Partition | None = None
        self._reader: PartitionReader | None = None
        self._inflight: deque[_InFlight] = deque()
        self._inflight_bytes = 0
        self._peak_inflight = 0
        self._segments: list[Segment] = []
        self.state = NEW
        self.error: BaseException | None = None
        # Positions: next to append (upstream, downstream; set by start, read by the copy loop
        # only) and acknowledged (the mirrored end; None before start).
        self._next_up = self._next_down = 0
        self._acked_up: int | None = None
        self._acked_down: int | None = None
        self._source_end: int | None = None
        self._records = self._bytes = self._batches = 0
        self._last_latency: float | None = None
        self._mirrored_as_of: float | None = None
        # (source end, unix time it was read), ends ascending: once the acknowledged position
        # passes an end, the source as of that time is mirrored. Bounded: dropping the oldest
        # only makes mirrored_as_of later to advance (latency over- never under-estimated).
        self._watermarks: deque[tuple[int, float]] = deque(maxlen=1024)

    @classmethod
    def for_source(cls, source_client: "StreamReader | StreamClient", target_client: "StreamClient",
                   source_partition: str,
                   flow_id: str, *, source_alias: str, target_alias: str | None = None,
                   policy: ReplicationPolicy | None = None, **kw) -> "MirrorFlow":
        """A flow whose target partition is named by `policy` (default: "<alias>.<name>").
        MirrorNameError if the source partition came from `target_alias` (a cycle)."""
        policy = policy or DefaultReplicationPolicy()
        if target_alias is not None and getattr(policy, "is_cycle", lambda *a: False)(target_alias, source_partition):
            raise MirrorNameError(
                f"source partition {source_partition!r} was mirrored from cluster {target_alias!r} already: "
                f"mirroring it back there would copy the flow's own output forever; leave it out of flow {flow_id!r}")
        target = policy.target_name(source_alias, source_partition)
        return cls(source_client, target_client, source_partition, target, flow_id, source_alias=source_alias, **kw)

    @property
    def key(self) -> tuple[str, str]:
        """(flow id, target partition): what identifies this flow's work across workers."""
        return self.flow_id, self.target_partition

    # ---- start ----------------------------------------------------------------------------------

    def start(self) -> "MirrorFlow":
        """Open the target partition, compute the resume point, record the segment, then copy in
        a background thread. Raises what stops it from starting (nothing is appended then):
        StreamNotClosedError (another node holds the target partition: stop the flow there, or
        fail that node over), MirrorConflictError, SourceTrimmedError."""
        with self._lock:
            if self.state != NEW:
                raise MirrorError(f"flow {self.flow_id!r} on {self.target_partition!r} was started already "
                                  f"(state {self.state}); create a new MirrorFlow to start it again")
            self.state = STARTING
        try:
            self._open_target()
        except BaseException as e:
            with self._lock:
                self.state, self.error = FAILED, e
            raise
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"mirror-{self.flow_id}-{self.target_partition}")
        with self._lock:
            self.state = RUNNING
        self._thread.start()
        return self

    def _open_target(self) -> None:
        if any(p.name == self.target_partition for p in partitions_on(self.target_client)):
            raise MirrorConflictError(
                f"target partition {self.target_partition!r} is already open on node {self.target_client.node_id} "
                f"(another flow or a producer writes it there); a mirrored partition must have the flow as its only "
                f"writer: stop the other writer, or mirror into another partition")
        register_flow(self._target_meta, self.flow_id, self.source_alias)
        partition = open_partition(self.target_client, self.target_partition)
        try:
            register_partition(self._target_meta, self.flow_id,
                               PartitionRecord(self.target_partition, self.source_partition, partition.log.stream_id))
            down = partition.log.next_offset
            _, segments = load_segments(self._target_meta, self.flow_id, self.target_partition)
            self._partition = partition
            if segments:
                up = OffsetMap(segments).resume_position(down)
                if self.verify_resume:
                    self._verify_tail(segments, down)
            else:
                up = self._first_position()
            self._begin_segment(self._check_trimmed(up), down)
        except BaseException:
            self._partition = None
            try:
                partition.close()
            except S3StreamError:
                log.exception("flow %s: closing target partition %s after a failed start", self.flow_id,
                              self.target_partition)
            raise
        log.info("flow %s: %s -> %s resumes at upstream %d (downstream %d), segments %s", self.flow_id,
                 self.source_partition, self.target_partition, up, down, self._segments)

    def _source(self) -> "PartitionReader | None":
        """The source reader, None while the source partition has no committed checkpoint."""
        if self._reader is None:
            try:
                self._reader = read_partition(self.source_client, self.source_partition)
            except StreamNotFoundError:
                return None
        return self._reader

    def _target(self) -> "Partition":
        """The target partition, open from start() on."""
        partition = self._partition
        if partition is None:
            raise MirrorError(f"flow {self.flow_id!r} has no open target partition (not started)")
        return partition

    def _batch_base(self, reader: "PartitionReader", offset: int) -> int:
        """The base offset of the source batch holding `offset` (a batch boundary stays itself)."""
        batches = reader.fetch(offset, None, 1).batches
        return batches[0].base_offset if batches else offset

    def _first_position(self) -> int:
        reader = self._source()
        start, end = (reader.start_offset, reader.end_offset) if reader is not None else (0, 0)
        first = start if self.start_offset is None else self.start_offset
        if not start <= first <= end:
            raise OffsetOutOfRangeError(
                f"flow {self.flow_id!r}: start_offset {first} is outside source partition {self.source_partition!r}'s "
                f"committed range [{start}, {end}]; pick an offset in it, or leave start_offset None to begin at "
                f"its start")
        return self._batch_base(reader, first) if reader is not None and first < end else first

    def _check_trimmed(self, up: int) -> int:
        """`up`, or where to continue if the source's retention removed [up, ...) already:
        SourceTrimmedError unless skip_trimmed (then the first readable batch's base)."""
        reader = self._source()
        if reader is None:
            return up
        start, end = reader.start_offset, reader.end_offset
        if up >= start:
            return up
        first = self._batch_base(reader, start) if start < end else start
        if first <= up:
            return up
        if not self.skip_trimmed:
            raise self._trimmed_error(up, first)
        log.warning("flow %s: source %s lost upstream [%d, %d) to retention before they were mirrored: skipping them",
                    self.flow_id, self.source_partition, up, first)
        return first

    def _trimmed_error(self, up: int, first: int) -> SourceTrimmedError:
        return SourceTrimmedError(
            f"flow {self.flow_id!r}: source partition {self.source_partition!r} no longer holds upstream "
            f"[{up}, {first}) (its retention removed them before they were mirrored); restart the flow with "
            f"skip_trimmed=True to continue at {first} (the gap is recorded in the offset map), or raise the "
            f"source's retention", up, first)

    def _begin_segment(self, up: int, down: int) -> None:
        self._segments = record_segment(self._target_meta, self.flow_id, self.target_partition, up, down)
        with self._lock:
            self._next_up = self._acked_up = up
            self._next_down = self._acked_down = down

    def _verify_tail(self, segments: list[Segment], down: int) -> None:
        """The target's last batch must be the source batch the map says it copied."""
        offsets = OffsetMap(segments, down)
        if down <= offsets.downstream_start:
            return                          # nothing mirrored yet: the tail predates the flow
        try:
            tail = self._target().fetch(down - 1, down, 1).batches[-1]
        except OffsetOutOfRangeError:
            return                          # the target's retention trimmed it
        if tail.base_offset < offsets.downstream_start:
            raise MirrorConflictError(
                f"target partition {self.target_partition!r}: its last batch [{tail.base_offset}, {tail.end_offset}) "
                f"straddles the start {offsets.downstream_start} of flow {self.flow_id!r}'s map: the map does not "
                f"describe this partition")
        up = offsets.upstream_of(tail.base_offset)
        reader = self._source()
        if reader is None:
            return
        try:
            found = reader.fetch(up, None, 1).batches
        except OffsetOutOfRangeError:
            return                          # the source's retention trimmed it: nothing to compare
        if not found:
            raise MirrorConflictError(
                f"target partition {self.target_partition!r}: flow {self.flow_id!r}'s map puts its last batch "
                f"(downstream {tail.base_offset}) at upstream {up}, at or beyond the end of source partition "
                f"{self.source_partition!r}: the target holds records the source never had: something else wrote the "
                f"target. Appending more would make every translation wrong; mirror into a fresh partition (or "
                f"delete the flow's records)")
        source = found[0]
        if source.base_offset != up or source.count != tail.count or source.payload != tail.payload:
            bytes_differ = ", other bytes" if source.count == tail.count else ""
            raise MirrorConflictError(
                f"target partition {self.target_partition!r}: its last batch (downstream {tail.base_offset}, "
                f"{tail.count} records) is not the source batch at upstream {up} of {self.source_partition!r} "
                f"(base {source.base_offset}, {source.count} records{bytes_differ}) "
                f"that flow {self.flow_id!r}'s map says it copied: something else wrote the target. Appending more "
                f"would make every translation wrong; mirror into a fresh partition (or delete the flow's records)")

    # ---- the copy loop --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except (PartitionMovedError, StreamClosedError, StreamFencedError) as e:
            if not self._stop.is_set():
                self._fail(e)
        except BaseException as e:   # noqa: BLE001 - kept as the flow's error, the flow stops
            self._fail(e)
        finally:
            try:
                self._reap(block=True, drain=True)
            except BaseException as e:   # noqa: BLE001 - an append that never became durable
                if self.error is None and not self._stop.is_set():
                    self._fail(e)
            with self._lock:
                if self.state != FAILED:
                    self.state = STOPPED
                self._progress.notify_all()

    def _fail(self, error: BaseException) -> None:
        log.error("flow %s: %s -> %s failed: %s", self.flow_id, self.source_partition, self.target_partition, error)
        with self._lock:
            self.state, self.error = FAILED, error
            self._progress.notify_all()

    def _loop(self) -> None:
        # The source's committed range is read again (two metadata reads) only once the flow has
        # copied up to the end it knows, a fetch finds the range moved, or poll_interval passed
        # (for lag and watermarks); a catch-up costs one metadata read per fetch, not three.
        start = 0
        end: int | None = None
        refreshed = 0.0
        while not self._stop.is_set():
            self._reap(block=False)
            reader = self._source()
            if reader is None:
                self._stop.wait(self.poll_interval)
                continue
            if end is None or self._next_up >= end or time.monotonic() - refreshed >= self.poll_interval:
                start, end, refreshed = reader.start_offset, reader.end_offset, time.monotonic()
                self._saw_source_end(end)
                if self._next_up >= end:
                    self._stop.wait(self.poll_interval)
                    continue
            budget = self.max_in_flight_bytes - self._inflight_bytes
            if budget <= 0:
                self._reap(block=True)
                continue
            try:
                batches = reader.fetch(max(self._next_up, start), end, min(self.fetch_bytes, budget)).batches \
                    if start < end else []
            except OffsetOutOfRangeError:
                end = None                  # trimmed since we looked: look again
                continue
            first = batches[0].base_offset if batches else end
            if first > self._next_up:
                self._skip_gap(first)
                continue
            for batch in batches:
                if self._stop.is_set():
                    return
                self._append(batch)

    def _saw_source_end(self, end: int) -> None:
        now = self.clock()
        with self._lock:
            self._source_end = end
            if self._watermarks and self._watermarks[-1][0] == end:
                self._watermarks[-1] = (end, now)
            else:
                self._watermarks.append((end, now))
            self._advance_watermark()

    def _skip_gap(self, first: int) -> None:
        """The source's retention removed [next, first) before it was mirrored."""
        if not self.skip_trimmed:
            raise self._trimmed_error(self._next_up, first)
        self._reap(block=True, drain=True)          # the new segment starts at the target's end
        log.warning("flow %s: source %s lost upstream [%d, %d) to retention before they were mirrored: skipping them",
                    self.flow_id, self.source_partition, self._next_up, first)
        self._begin_segment(first, self._next_down)

    def _append(self, batch: FetchedBatch) -> None:
        if batch.base_offset != self._next_up:
            raise MirrorConflictError(
                f"flow {self.flow_id!r}: the source batch read at upstream {self._next_up} of "
                f"{self.source_partition!r} "
                f"starts at {batch.base_offset}: the map or the target does not end at a source batch boundary; the "
                f"target was written by something else")
        nbytes = len(batch.payload)
        while self._inflight and self._inflight_bytes + nbytes > self.max_in_flight_bytes:
            self._reap(block=True)
        # A copy: the target takes it as it is, producers and all (they are the source cluster's,
        # and a retention gap would look like lost sequences), and a Kafka batch is stored with
        # its offset in the target (as_record_batch), as a broker stores what MirrorMaker sends.
        future = self._target().append(batch.as_record_batch(), copied=True)
        if future.base_offset != self._next_down:
            raise MirrorConflictError(
                f"flow {self.flow_id!r}: target partition {self.target_partition!r} placed the batch of upstream "
                f"{batch.base_offset} at {future.base_offset}, not {self._next_down}: something else appends to it on "
                f"node {self.target_client.node_id}; the flow must be its only writer")
        with self._lock:
            self._next_up = batch.end_offset
            self._next_down += batch.count
            self._inflight.append(_InFlight(future, batch.count, nbytes, self._next_up, self._next_down))
            self._inflight_bytes += nbytes
            self._peak_inflight = max(self._peak_inflight, self._inflight_bytes)

    def _reap(self, block: bool, drain: bool = False) -> None:
        """Account the acknowledged appends, oldest first; with `block`, wait for the oldest one
        (`drain`: for all). An append that failed raises its error."""
        while self._inflight:
            head = self._inflight[0]
            if not (block or head.future.done()):
                return
            head.future.result(None)
            completed = head.future.completed_ns
            with self._lock:
                self._inflight.popleft()
                self._inflight_bytes -= head.nbytes
                self._acked_up, self._acked_down = head.upstream_end, head.downstream_end
                self._records += head.count
                self._bytes += head.nbytes
                self._batches += 1
                if completed is not None:
                    self._last_latency = max(0, completed - head.future.submitted_ns) / 1e9
                self._advance_watermark()
                self._progress.notify_all()
            if not drain:
                block = False

    def _advance_watermark(self) -> None:
        acked = self._acked_up
        if acked is None:
            return
        while self._watermarks and acked >= self._watermarks[0][0]:
            self._mirrored_as_of = self._watermarks.popleft()[1]

    # ---- control and observation ----------------------------------------------------------------

    def stop(self, timeout: float = 10.0, release: bool = True) -> FlowMetrics:
        """Stop copying: the loop ends after its current fetch or append, within `timeout`
        seconds unless a source read is stuck longer (then it appends nothing more). Appends in
        flight are acknowledged or failed first. With `release`, the target partition is closed
        (force upload of its tail, CLOSED), so another node can take the flow over. Returns the
        final metrics; the flow cannot be started again (create a new MirrorFlow)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("flow %s: the copy loop did not end within %.1f s (a source read is slow); it appends "
                            "nothing more", self.flow_id, timeout)
        if release and self._partition is not None:
            try:
                self._partition.close()
            except S3StreamError as e:
                log.warning("flow %s: closing target partition %s: %s", self.flow_id, self.target_partition, e)
        with self._lock:
            if self.state in (NEW, STARTING, RUNNING):
                self.state = STOPPED
            self._progress.notify_all()
        return self.metrics()

    def wait_position(self, upstream: int, timeout: float | None = None) -> bool:
        """Wait until every source record below `upstream` is mirrored (acknowledged by the
        target). False on timeout; the flow's error if it failed or stopped short."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._acked_up is None or self._acked_up < upstream:
                if self.state == FAILED:
                    raise self.error if self.error is not None else MirrorError(f"flow {self.flow_id!r} failed")
                if self.state == STOPPED:
                    raise MirrorError(f"flow {self.flow_id!r} stopped at upstream {self._acked_up}, before {upstream}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._progress.wait(0.1 if left is None else min(left, 0.1))
            return True

    def wait_caught_up(self, timeout: float | None = None) -> bool:
        """Wait until the flow has mirrored the source's committed end as it is now."""
        reader = self._source()
        return self.wait_position(0 if reader is None else reader.end_offset, timeout)

    def offset_map(self) -> OffsetMap:
        """The offset map up to what the target has acknowledged (OffsetNotMirroredError before
        the first segment is recorded)."""
        with self._lock:
            return OffsetMap(self._segments, self._acked_down)

    def metrics(self) -> FlowMetrics:
        with self._lock:
            lag = None
            if self._source_end is not None and self._acked_up is not None:
                lag = max(0, self._source_end - self._acked_up)
            return FlowMetrics(
                flow_id=self.flow_id, source_alias=self.source_alias, source_partition=self.source_partition,
                target_partition=self.target_partition, state=self.state, upstream_position=self._acked_up,
                downstream_position=self._acked_down, source_end=self._source_end, lag_records=lag,
                records=self._records, bytes=self._bytes, batches=self._batches, in_flight_bytes=self._inflight_bytes,
                peak_in_flight_bytes=self._peak_inflight,
                last_append_latency=self._last_latency, mirrored_as_of=self._mirrored_as_of,
                segments=len(self._segments), error=None if self.error is None else str(self.error))

    def __repr__(self) -> str:
        return (f"<MirrorFlow {self.flow_id} {self.source_partition} -> {self.target_partition} {self.state} "
                f"upstream={self._acked_up}>")
