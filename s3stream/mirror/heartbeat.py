"""Heartbeats: small records on the target that say a source is being mirrored, and how recently.

A Heartbeater (one per worker) appends, every `interval` seconds and for each source alias its
flows copy from, one JSON record (one batch of one record) to the target partition `heartbeats`:

    {"source": "A", "target": "B", "at": 1712564822.02, "flows": 3, "lag_records": 120,
     "mirrored_as_of": 1712564821.50}

`at` is when it was written (unix seconds), `lag_records` the sum of its flows' lags, and
`mirrored_as_of` the oldest of its flows' watermarks: every record the source had committed at
that time is on the target. So on the target, without access to the source:
- `now - at` says whether the mirror is alive (a dead worker stops beating);
- `now - mirrored_as_of` bounds the replication latency (plus the source's upload interval).
MirrorMaker 2 writes its heartbeats to the source and measures them arriving through the mirror;
writing them on the target from the flows' own watermarks gives the same answer without writing
to the source cluster, which a mirror should only read.

The partition is an ordinary partition with one writer at a time: the Heartbeater holds it open on
its target node (created if missing). A second worker on another node cannot open it while the
first holds it: its beats fail with StreamNotClosedError, are counted in `errors`, and are retried
each interval (the worker leases coming later pick one writer per cluster). It keeps the
partition bounded by trimming it to the latest `retain_records` records.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from ..errors import InvalidArgumentError, S3StreamError, StreamNotFoundError, check_int
from ..batches import RecordBatch
from ..cluster.partition import open_partition, partitions_on, read_partition
from .policy import check_name

if TYPE_CHECKING:
    from ..client import StreamClient
    from ..cluster.partition import Partition
    from .flow import MirrorFlow

log = logging.getLogger("s3stream.mirror")

HEARTBEATS = "heartbeats"


@dataclass(frozen=True)
class Heartbeat:
    """One heartbeat record (see the module docstring); `offset` is its place in the partition."""
    source: str
    target: str | None
    at: float
    flows: int
    lag_records: int | None
    mirrored_as_of: float | None
    offset: int | None = None

    def encode(self) -> bytes:
        return json.dumps({"source": self.source, "target": self.target, "at": self.at, "flows": self.flows,
                           "lag_records": self.lag_records, "mirrored_as_of": self.mirrored_as_of},
                          sort_keys=True).encode()

    @classmethod
    def decode(cls, raw, offset: int | None = None) -> "Heartbeat | None":
        """The heartbeat in `raw`, None if it is not one (the partition is ordinary: skip others)."""
        try:
            d = json.loads(bytes(raw))
            return cls(str(d["source"]), d.get("target"), float(d["at"]), int(d.get("flows", 0)),
                       d.get("lag_records"), d.get("mirrored_as_of"), offset)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None

    def age(self, now: float | None = None) -> float:
        """Seconds since it was written."""
        return (time.time() if now is None else now) - self.at

    def replication_latency(self, now: float | None = None) -> float | None:
        """Seconds the target may lag the source's committed records: now - mirrored_as_of
        (None: no flow of the source has mirrored what it saw yet)."""
        if self.mirrored_as_of is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.mirrored_as_of)


class Heartbeater:
    """Writes a heartbeat per source alias of `flows` (MirrorFlows, or a callable returning the
    worker's current ones) to partition `partition` of the target every `interval` seconds,
    in a background thread after `start()`, or on demand with `beat()`."""

    def __init__(self, target_client: "StreamClient",
                 flows: "Iterable[MirrorFlow] | Callable[[], Iterable[MirrorFlow]]", *, target_alias: str | None = None,
                 interval: float = 1.0, partition: str = HEARTBEATS, retain_records: int = 10_000,
                 append_timeout: float = 10.0, clock: Callable[[], float] = time.time) -> None:
        if target_alias is not None:
            check_name("target alias", target_alias, "B")
        for name, value in (("interval", interval), ("append_timeout", append_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidArgumentError(f"{name} must be positive seconds, got {value!r}; e.g. 1.0")
        check_int("retain_records", retain_records, minimum=1)
        self.target_client = target_client
        self._flows = flows if callable(flows) else (lambda fixed=list(flows): fixed)
        self.target_alias = target_alias
        self.interval = float(interval)
        self.partition_name = check_name("heartbeat partition", partition, HEARTBEATS)
        self.retain_records = retain_records
        self.append_timeout = float(append_timeout)
        self.clock = clock
        self._partition: Partition | None = None
        self._opened_here = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats = 0
        self.errors: deque[str] = deque(maxlen=100)      # the latest failures, bounded

    def _open(self) -> "Partition":
        if self._partition is None or not self._partition.is_open:
            already = any(p.name == self.partition_name for p in partitions_on(self.target_client))
            self._partition = open_partition(self.target_client, self.partition_name)
            self._opened_here = not already
        return self._partition

    def heartbeats(self) -> list[Heartbeat]:
        """The heartbeats a beat now would write: one per source alias of the current flows."""
        by_source: dict[str, list] = {}
        for flow in self._flows():
            by_source.setdefault(flow.source_alias, []).append(flow.metrics())
        now = self.clock()
        out = []
        for source, metrics in sorted(by_source.items()):
            lags = [m.lag_records for m in metrics]
            marks = [m.mirrored_as_of for m in metrics]
            out.append(Heartbeat(source, self.target_alias, now, len(metrics),
                                 None if None in lags else sum(lags), None if None in marks else min(marks)))
        return out

    def beat(self) -> list[Heartbeat]:
        """Append the current heartbeats and wait until they are durable; returns them with their
        offsets. Raises what stopped it (StreamNotClosedError: another node holds the partition)."""
        partition = self._open()
        written = []
        for hb in self.heartbeats():
            base = partition.append(RecordBatch(hb.encode(), 1)).result(self.append_timeout).base_offset
            written.append(Heartbeat(hb.source, hb.target, hb.at, hb.flows, hb.lag_records, hb.mirrored_as_of, base))
        self.beats += 1
        stream = partition.log
        if stream.confirm_offset - stream.start_offset > 2 * self.retain_records:
            stream.trim(stream.confirm_offset - self.retain_records)
        return written

    def start(self) -> "Heartbeater":
        self._thread = threading.Thread(target=self._run, name="mirror-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except S3StreamError as e:
                log.warning("heartbeat to %s failed: %s", self.partition_name, e)
                self.errors.append(str(e))
                self._partition = None if self._partition is not None and not self._partition.is_open \
                    else self._partition
            self._stop.wait(self.interval)

    def stop(self, timeout: float = 10.0, release: bool = True) -> None:
        """Stop beating; with `release`, close the heartbeat partition if this Heartbeater opened it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if release and self._opened_here and self._partition is not None and self._partition.is_open:
            try:
                self._partition.close()
            except S3StreamError as e:
                log.warning("closing heartbeat partition %s: %s", self.partition_name, e)


def latest_heartbeats(client: "StreamClient", partition: str = HEARTBEATS,
                      window: int = 10_000) -> dict[str, Heartbeat]:
    """The latest heartbeat per source alias among the last `window` records of the heartbeat
    partition, read through `client` (any node of the target cluster: through the partition if
    it is open there, which includes records not uploaded yet; else its committed records).
    Empty if the partition does not exist (or has no committed checkpoint yet)."""
    check_name("heartbeat partition", partition, HEARTBEATS)
    check_int("window", window, minimum=1)
    open_here = next((p for p in partitions_on(client) if p.name == partition), None)
    if open_here is not None:
        start, end, fetch = open_here.log.start_offset, open_here.log.confirm_offset, open_here.fetch
    else:
        try:
            reader = read_partition(client, partition)
        except StreamNotFoundError:
            return {}
        start, end, fetch = reader.start_offset, reader.end_offset, reader.fetch
    latest: dict[str, Heartbeat] = {}
    position = max(start, end - window)
    while position < end:
        batches = fetch(position, end, 1 << 20).batches
        for batch in batches:
            hb = Heartbeat.decode(batch.payload, batch.base_offset)
            if hb is not None:
                latest[hb.source] = hb
        position = batches[-1].end_offset
    return latest


def replication_latency(client: "StreamClient", now: float | None = None,
                        partition: str = HEARTBEATS) -> dict[str, float | None]:
    """{source alias: seconds the target may lag it} from the latest heartbeats (see Heartbeat)."""
    return {source: hb.replication_latency(now) for source, hb in latest_heartbeats(client, partition).items()}
