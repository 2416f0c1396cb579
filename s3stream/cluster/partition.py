"""Partitions: a named group of streams with a meta stream holding its checkpoint (article 000).

A partition name maps through KV (`partition/<name>`) to its meta stream. Every record of the
meta stream is a full JSON snapshot: the data stream ids by role, the leader epoch, the
clean-shutdown flag and the data streams' start offsets. Opening a partition opens the meta
stream (epoch + 1), reads its last snapshot, opens the data streams and appends a snapshot with
leader epoch + 1 and clean = false; closing closes the data streams (force upload of their tails
only), appends a clean snapshot and closes the meta stream. Nothing here depends on the size of a
stream's history: the move of a partition costs its un-uploaded tail.

A close says only what happened: it returns once every stream is CLOSED in metadata; if a step
fails it raises, and the partition serves again where it still can (its streams still open), or
keeps refusing appends until a later `close()` finishes the steps left. A closed partition's
`close()` returns the report of the close that did it.

This layer wraps the engine: the engine knows streams only. The partitions open on a client are
its add-on (`PartitionTable`, `partition_table(client)`); `open_partition(client, name)` opens one,
`read_partition(client_or_reader, name)` reads one's committed records without opening it, and
`partitions_on(client)` / `partition_on(client, name)` list what is open.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..client import StreamClient
from ..errors import (
    InvalidArgumentError, LeaseExpiredError, OffsetsLostError, S3StreamError, StreamClosedError, StreamFencedError, StreamNotClosedError,
    StreamNotFoundError,
)
from ..metadata import StreamMeta, StreamState
from ..batches import AppendFuture, FetchedBatch, FetchResult, RecordBatch, encoded_batch, records_batch
from ..records import Record
from .hold import AppendHold
from .loadreport import SAMPLE_EVERY, TrafficMeter
from ..records.producers import SNAPSHOT_BYTES, ProducedBatch, Producer, ProducerTable, producer_header

if TYPE_CHECKING:
    from ..stream import Stream
    from ..metadata import MetadataStore

#: Checkpoints a partition's meta stream may hold before an open trims them (an open and a
#: close each append one): its ranges, and so its metadata, stay bounded by this many moves.
CHECKPOINTS_KEPT = 8
#: Partitions a client's close closes together (PartitionTable.close).
CLOSE_BATCH = 500

#: Roles of a partition's data streams; "log" carries the records.
DATA_ROLES = ("log",)

#: A close record carries the open hint (the checkpoint) only while the partition knows at most
#: this many idempotent producers: their table is in the checkpoint.
HINT_PRODUCERS = 64


class PartitionMovedError(S3StreamError):
    """The partition is closing or closed on this node (it is moving): retry the append on its
    new owner. Nothing acknowledged before this error is lost."""
    retriable = True

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.partition = name


@dataclass
class Checkpoint:
    """A snapshot in the meta stream. `producers`: the idempotent producers' table
    (ProducerTable.snapshot); `scan_from`: the log offset from which producers' batches may be
    missing from it (None: none are), which an open reads back (s3stream.records.producers)."""
    streams: dict[str, int]
    leader_epoch: int = 0
    clean: bool = True
    start_offsets: dict[str, int] = field(default_factory=dict)
    producers: dict = field(default_factory=dict)
    scan_from: int | None = None

    def encode(self) -> bytes:
        d = dict(streams=self.streams, leader_epoch=self.leader_epoch, clean=self.clean,
                 start_offsets=self.start_offsets)
        if self.producers or self.scan_from is not None:
            d.update(producers=self.producers, scan_from=self.scan_from)
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> "Checkpoint":
        return cls.from_dict(json.loads(bytes(raw)))

    @classmethod
    def from_dict(cls, d: dict) -> "Checkpoint":
        """The checkpoint `encode` wrote, once parsed (a close record's hint carries it so)."""
        return cls(streams={k: int(v) for k, v in d["streams"].items()}, leader_epoch=d["leader_epoch"],
                   clean=d["clean"], start_offsets={k: int(v) for k, v in d.get("start_offsets", {}).items()},
                   producers=d.get("producers", {}), scan_from=d.get("scan_from"))


#: The prefix of every partition's KV key (partition_kv_key): list_kv(PARTITION_KV_PREFIX) lists them.
PARTITION_KV_PREFIX = "partition/"


def partition_kv_key(name: str) -> str:
    """The metadata KV key naming partition `name`'s meta stream (its id, as text)."""
    return PARTITION_KV_PREFIX + name


@dataclass
class CloseReport:
    """What closing a partition cost: the un-uploaded tail it forced up, and how long; `phases`
    (seconds): "flush" (its pending appends acknowledged), "checkpoint" (the clean checkpoint
    appended; the close's commit makes it durable, not the WAL's ack), "upload" (its streams'
    tails PUT and committed with their close), and of the upload "upload.put", "upload.gate",
    "upload.commit" (Uploader.upload_and_close).
    `record`: what the close wrote at `closed_key(name)` in its commit (Partition.close), if it
    was asked to."""
    tail_bytes: int
    seconds: float
    phases: dict = field(default_factory=dict)
    record: dict | None = None


def closed_key(name: str) -> str:
    """The KV key of a partition's last close record (Partition.close's `record`)."""
    return f"closed/{name}"


class Partition:
    """A partition open on one node. `append`/`fetch` go to its log stream."""

    def __init__(self, client: StreamClient, table: "PartitionTable", name: str, meta: "Stream",
                 streams: dict[str, "Stream"], checkpoint: Checkpoint, producers: ProducerTable | None = None) -> None:
        self._client = client
        self._table = table
        self.name = name
        self.meta_stream = meta
        self.streams = streams
        self.checkpoint = checkpoint
        self._closing = False
        self._closed: CloseReport | None = None
        self.close_error: BaseException | None = None     # why the last close failed, if it did
        self._close_lock = threading.Lock()
        self.meter = TrafficMeter()      # traffic here, for the node's load reports
        #: Seconds the open that made this took, by step: "read" (the partition's key, its meta
        #: stream and last committed checkpoint), "streams" (opening them), "checkpoint" (the
        #: open's checkpoint appended and durable; only appended in a node agent's open, which
        #: does not wait for it: `open_checkpoint`).
        self.open_phases: dict[str, float] = {}
        #: The open's checkpoint while a node agent's open has not waited for it to be durable
        #: (_opened); `trim_checkpoints` waits for it.
        self.open_checkpoint: AppendFuture | None = None
        # Idempotent producers (s3stream.records.producers): their appends are serialised here.
        self.producers = producers if producers is not None else ProducerTable()
        self._producer_lock = threading.Lock()
        self._scan_from: int | None = checkpoint.scan_from   # as the newest snapshot says
        self._snapshot_bytes = 0           # log bytes appended since that snapshot
        self._produced_since = 0           # producers' batches appended since it
        #: Older checkpoints piled up and a hinted open left their trim to `trim_checkpoints`.
        self.trim_due = False

    @property
    def hold(self) -> AppendHold | None:
        """The hold of this node's moves on its appends, if a node agent runs it."""
        return self._table.hold

    @property
    def leader_epoch(self) -> int:
        return self.checkpoint.leader_epoch

    def trim_checkpoints(self, timeout: float | None = None) -> None:
        """Trim the meta stream's older checkpoints if the open left that to later (`trim_due`:
        a node agent's open, which calls this once it has said the partition is served, so
        that a move does not wait for the trim's metadata reads and writes). First waits for
        the open's checkpoint to be durable (`open_checkpoint`), up to `timeout`."""
        if self.open_checkpoint is not None:
            self.open_checkpoint.result(timeout)
            self.open_checkpoint = None
        if self.trim_due and self.meta_stream.is_open:
            _trim_checkpoints(self.meta_stream)
            self.trim_due = False

    @property
    def log(self) -> "Stream":
        return self.streams["log"]

    @property
    def is_open(self) -> bool:
        """Serving: not closing or closed, and every stream open here (none fenced or closed)."""
        return (not self._closing and self._closed is None
                and all(s.is_open for s in (self.meta_stream, *self.streams.values())))

    @property
    def closed(self) -> bool:
        """Closed for good here (every stream CLOSED in metadata)."""
        return self._closed is not None

    def append(self, batch: RecordBatch, *, wait_for_moves: bool = True, copied: bool = False) -> AppendFuture:
        """Append one batch to the log. A ProducedBatch (Producer.batch) is taken idempotently:
        a batch this partition took already returns its original answer (module
        s3stream.records.producers); OutOfOrderSequenceError / ProducerFencedError refuse it.
        So is any batch whose payload is a Kafka record batch from an idempotent producer (a
        producer id and a base sequence in its header, its CRC valid), as a Kafka broker reads
        a batch's producer from its header: a ProducedBatch kept as a plain RecordBatch, a batch
        another client built. `copied`: the batch is a copy of another log's (a mirror's), whose
        producers are that cluster's: appended as it is, its producer fields neither checked nor
        remembered.
        While this node's agent closes or opens a partition, it first waits for that move, at
        most ClusterConfig.move_hold (s3stream.cluster.hold), unless `wait_for_moves` is false
        (s3stream.aio waits its own way, without blocking the loop: `hold`)."""
        if wait_for_moves:
            hold = self._table.hold
            if hold is not None:
                hold.wait()           # a move on this node goes first (s3stream.cluster.hold)
        if not copied:
            if isinstance(batch, ProducedBatch):
                return self._append_produced(batch)
            header = producer_header(batch.payload, batch.count)
            if header is not None:
                return self._append_produced(ProducedBatch.of(batch.payload, batch.count, self.name, *header))
        elif isinstance(batch, ProducedBatch):
            batch = RecordBatch(batch.payload, batch.count, True)      # streams refuse a ProducedBatch
        future = self._append(batch)
        if self._scan_from is not None:
            self._snapshot_bytes += len(batch.payload)
            if self._snapshot_bytes >= SNAPSHOT_BYTES:
                with self._producer_lock:
                    self._maybe_snapshot()
        return future

    def _append_produced(self, batch: ProducedBatch) -> Any:
        if batch.partition != self.name:
            raise InvalidArgumentError(
                f"this batch was built for partition {batch.partition!r}, not {self.name!r}: a producer numbers its "
                f"batches per partition; build it with producer.batch({self.name!r}, records)")
        with self._producer_lock:
            original = self.producers.check(batch.producer_id, batch.epoch, batch.base_sequence, batch.count, self.name)
            if original is not None:
                return original
            if self._scan_from is None:
                # The first producer batch since a snapshot that said "nothing to read back":
                # say where to read back from first, in the same WAL ahead of it.
                self._refuse_if_moving()
                try:
                    self._write_snapshot(self.log.next_offset)
                except (StreamClosedError, StreamFencedError) as e:
                    raise PartitionMovedError(self.name, f"partition {self.name!r} moved away from node "
                                                         f"{self._client.node_id}: {e}") from e
            # The stream appends the bytes; the sequences were this partition's to check.
            future = self._append(RecordBatch(batch.payload, batch.count, True))
            self.producers.record(batch.producer_id, batch.epoch, batch.base_sequence, batch.count,
                                  future.base_offset, future)
            self._produced_since += 1
            self._snapshot_bytes += len(batch.payload)
            self._maybe_snapshot()
            return future

    def _maybe_snapshot(self) -> None:
        """Every SNAPSHOT_BYTES of log while the snapshot says producers may be behind: a new
        snapshot, to read back from here if producers appended since the last one, else to
        read nothing back. Under the producer lock."""
        if self._snapshot_bytes >= SNAPSHOT_BYTES and self._scan_from is not None:
            self._write_snapshot(self.log.next_offset if self._produced_since else None)

    def _write_snapshot(self, scan_from: int | None) -> None:
        """Append a checkpoint holding the producers' table as of the log's end now and
        `scan_from` (not waited for: the WAL keeps it ahead of later appends). Under the
        producer lock."""
        cp = self.checkpoint
        snapshot = Checkpoint(cp.streams, cp.leader_epoch, False, cp.start_offsets, self.producers.snapshot(), scan_from)
        self.meta_stream.append(RecordBatch(snapshot.encode(), 1))
        self._scan_from, self._snapshot_bytes, self._produced_since = scan_from, 0, 0

    def _refuse_if_moving(self) -> None:
        if self._closing or self._closed is not None:
            raise PartitionMovedError(self.name, f"partition {self.name!r} is closing on node "
                                                 f"{self._client.node_id}: retry on its new owner")

    def _append(self, batch: RecordBatch) -> AppendFuture:
        self._refuse_if_moving()
        m = self.meter
        sample = m.appends % SAMPLE_EVERY == 0
        submitted = time.monotonic_ns() if sample else 0
        try:
            future = self.log.append(batch)
        except LeaseExpiredError:
            raise
        except (StreamClosedError, StreamFencedError) as e:
            raise PartitionMovedError(self.name, f"partition {self.name!r} moved away from node "
                                                 f"{self._client.node_id}: {e}") from e
        m.appends += 1
        m.bytes_in += len(batch.payload)
        if sample:
            m.append_samples.append((submitted, future))
        return future

    def append_records(self, records: Iterable[Record], *, compression: str | None = None,
                       producer: Producer | None = None) -> AppendFuture:
        """Append `records` as one Kafka record batch, one offset per record (Stream.append_records).
        With a `producer`, the batch carries its id, epoch and next sequences here, and is taken
        idempotently (append). To retry it after a lost answer, keep the batch instead:
        `batch = producer.batch(name, records)`, then append(batch) as often as needed."""
        if producer is not None:
            return self.append(producer.batch(self.name, records, compression))
        return self.append(records_batch(records, compression))

    def append_encoded(self, raw: bytes | bytearray | memoryview) -> Any:
        """Append a Kafka record batch (v2) built elsewhere (any Kafka client library), checked
        whole first (batches.encoded_batch: a bad one raises InvalidRecordBatchError or a
        subclass and appends nothing). One sent by an idempotent producer (a producer id and a
        base sequence in its header) is taken idempotently, as append takes any such batch."""
        return self.append(encoded_batch(raw)[0])

    def fetch(self, start_offset: int, end_offset: int | None = None, max_bytes: int = 1 << 20) -> FetchResult:
        m = self.meter
        sample = m.fetches % SAMPLE_EVERY == 0
        t0 = time.perf_counter() if sample else 0.0
        result = self.log.fetch(start_offset, end_offset, max_bytes)
        m.fetches += 1
        m.bytes_out += result.total_bytes
        if sample:
            m.fetch_ms.append((time.perf_counter() - t0) * 1e3)
        return result

    def close(self, timeout: float | None = None, record: dict | None = None) -> CloseReport:
        """Stop appends, force-upload the data streams' tails with a clean checkpoint, and mark
        every stream CLOSED. Returns once that is all true (see the module docstring: a failed
        close raises, a later call finishes it; calls wait for each other). `timeout` bounds
        each wait (pending appends, the force upload).

        `record` (a JSON object): written at `closed_key(name)` by the very commit that closes
        the streams, with the tail's size and an open hint added ("tail_bytes"; "hint": the meta
        stream, every stream's epoch, the clean checkpoint), so that the next owner wakes at the
        close's commit and opens without reading the checkpoint back (open_partition's `hint`).
        Not written if that commit closed none of them (all were closed already)."""
        with self._close_lock:
            if self._closed is not None:
                return self._closed
            step = self._begin_close(timeout, record)
            try:
                timing: dict = {}
                self._client.close_streams(step.streams, timeout, timing, step.kv, not_durable=(self.meta_stream,))
            except BaseException as e:
                self._close_failed(e)
                raise
            report = self._end_close(step, timing)
        self._table.forget(self)
        return report

    def _begin_close(self, timeout: float | None, record: dict | None) -> "_Closing":
        """A close up to its commit: appends stopped and flushed, the clean checkpoint appended
        (not waited for: the close's commit makes it durable), the close record built."""
        t0 = time.perf_counter()
        self._closing = True
        try:
            open_streams = [s for s in (*self.streams.values(), self.meta_stream) if s.is_open]
            for s in self.streams.values():
                if s.is_open:
                    s.flush(timeout)
            t1 = time.perf_counter()
            tail = sum(self._client.unuploaded_bytes(s) for s in self.streams.values())
            if self.meta_stream.is_open:
                # Into the meta stream first, so that one force upload carries the data
                # streams' tails and the checkpoint together. Not waited for in the WAL:
                # that upload's commit makes it durable (close_streams' not_durable).
                with self._producer_lock:      # appends stopped: the table is whole
                    done = Checkpoint(self.checkpoint.streams, self.checkpoint.leader_epoch, True,
                                      {role: s.start_offset for role, s in self.streams.items()},
                                      self.producers.snapshot())
                _write_checkpoint(self.meta_stream, done, timeout, trim=False, wait=False)
                self.checkpoint = done
            kv: tuple[tuple[str, bytes], ...] = ()
            if record is not None:
                record = dict(record, tail_bytes=tail)
                if len(self.producers) <= HINT_PRODUCERS:       # else the record would be large
                    record["hint"] = dict(
                        meta=self.meta_stream.stream_id, checkpoint=json.loads(self.checkpoint.encode()),
                        epochs={str(s.stream_id): s.epoch for s in (self.meta_stream, *self.streams.values())})
                kv = ((closed_key(self.name), json.dumps(record, sort_keys=True).encode()),)
        except BaseException as e:
            self._close_failed(e)
            raise
        return _Closing(open_streams, kv, record, tail, t0, t1, time.perf_counter())

    def _close_failed(self, e: BaseException) -> None:
        self.close_error = e
        # Serve again if every stream still can; else keep refusing until a close finishes.
        self._closing = not all(s.is_open for s in (self.meta_stream, *self.streams.values()))

    def _end_close(self, step: "_Closing", timing: dict) -> CloseReport:
        t3 = time.perf_counter()
        report = self._closed = CloseReport(step.tail, t3 - step.t0, dict(
            flush=step.t1 - step.t0, checkpoint=step.t2 - step.t1, upload=t3 - step.t2,
            **{f"upload.{k}": v for k, v in timing.items()}), step.record)
        self._closing = False
        self.close_error = None
        return report


@dataclass
class _Closing:
    """A partition's close between its first steps and its commit (Partition._begin_close)."""
    streams: list["Stream"]
    kv: tuple[tuple[str, bytes], ...]
    record: dict | None
    tail: int
    t0: float
    t1: float
    t2: float


def close_partitions(partitions: Sequence[Partition], records: Sequence[dict | None] | None = None,
                     timeout: float | None = None) -> dict[str, "CloseReport | Exception"]:
    """Close many partitions of one client together (a node agent's batch of moves away, a
    drain): each as Partition.close does, but their tails uploaded by one force upload and
    all their streams closed, their close records written, by ONE metadata commit. `records`:
    each partition's close record (Partition.close's `record`), or None. Returns each name's
    CloseReport, or the exception its close raised: one whose first steps fail is left out of
    the commit; if the commit fails, each partition of it is left as a failed close is (it
    serves again where it can) and a later close of it, alone, finishes it."""
    out: dict[str, CloseReport | Exception] = {}
    records = list(records) if records is not None else [None] * len(partitions)
    if not partitions:
        return out
    client = partitions[0]._client
    locked: list[Partition] = []
    steps: dict[str, _Closing] = {}
    try:
        for p, record in sorted(zip(partitions, records), key=lambda pr: pr[0].name):
            p._close_lock.acquire()        # in name order: two batches never wait for each other
            locked.append(p)
            if p._closed is not None:
                out[p.name] = p._closed
                continue
            try:
                steps[p.name] = p._begin_close(timeout, record)
            except Exception as e:        # noqa: BLE001 - this partition's, handed to the caller
                out[p.name] = e
        if steps:
            timing: dict = {}
            closing = [p for p in locked if p.name in steps]
            try:
                client.close_streams([s for p in closing for s in steps[p.name].streams], timeout, timing,
                                     tuple(kv for p in closing for kv in steps[p.name].kv),
                                     not_durable=tuple(p.meta_stream for p in closing))
            except Exception as e:        # noqa: BLE001 - sorted out per partition below
                failure: Exception | None = e
            else:
                failure = None
            for p in closing:
                if failure is not None:
                    # As a single close that failed: it serves again if it can, and a later
                    # close (alone) finishes what this one left.
                    p._close_failed(failure)
                    out[p.name] = failure
                else:
                    out[p.name] = p._end_close(steps[p.name], timing)
    finally:
        for p in locked:
            p._close_lock.release()
    for p in partitions:
        if isinstance(out.get(p.name), CloseReport):
            p._table.forget(p)
    return out


class CommittedSource(Protocol):
    """What reads committed records without opening anything: a StreamClient, or a reader
    that is not a node (s3stream.reader.StreamReader)."""

    @property
    def metadata(self) -> "MetadataStore": ...

    def fetch_committed(self, stream_id: int, start_offset: int, end_offset: int | None = None,
                        max_bytes: int = 1 << 20, known: StreamMeta | None = None) -> FetchResult: ...

    def fetch_committed_at(self, points: Sequence[tuple[int, int]]) -> dict[tuple[int, int], FetchedBatch]: ...

    def check_usable(self) -> None: ...


class PartitionReader:
    """A partition's committed records, read without opening it (read_partition).

    The meta stream's last committed checkpoint names the log stream; `start_offset` and
    `end_offset` are the log's committed range, read from metadata at each call (the owner
    keeps appending and uploading). A partition created moments ago whose first checkpoint is
    still in its owner's WAL is not readable yet (StreamNotFoundError says so)."""

    def __init__(self, client: CommittedSource, name: str) -> None:
        self._client = client
        self.name = name
        raw = client.metadata.get_kv(partition_kv_key(name))
        if raw is None:
            raise StreamNotFoundError(f"there is no partition {name!r} (no KV key {partition_kv_key(name)!r})")
        self.meta_stream_id = int(raw)
        checkpoint = _committed_checkpoint(client, client.metadata.get_stream(self.meta_stream_id))
        if checkpoint is None:
            raise StreamNotFoundError(
                f"partition {name!r} has no committed checkpoint yet (its owner has not uploaded it): "
                "retry after the owner's next upload")
        self.checkpoint = checkpoint
        self.log_stream_id = self.checkpoint.streams["log"]

    @property
    def start_offset(self) -> int:
        return self._client.metadata.get_stream(self.log_stream_id).start_offset

    @property
    def end_offset(self) -> int:
        """The log's committed end (records below it are readable here)."""
        return self._client.metadata.get_stream(self.log_stream_id).end_offset

    def fetch(self, start_offset: int, end_offset: int | None = None, max_bytes: int = 1 << 20) -> FetchResult:
        return self._client.fetch_committed(self.log_stream_id, start_offset, end_offset, max_bytes)


class PartitionTable:
    """The partitions open on one client (a client add-on: StreamClient.addon). The client
    closes it first when it closes: each partition closes (clean checkpoint), then the streams."""

    def __init__(self, client: StreamClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._partitions: dict[str, Partition] = {}
        #: Set by the node's agent: its moves hold this node's appends (s3stream.cluster.hold).
        self.hold: AppendHold | None = None

    def open(self, name: str, hinted: bool = False, version: int | None = None) -> Partition:
        """Create the named partition or open it on this node (see the module docstring);
        `hinted`, `version`: as open_partition's."""
        with self._lock:
            if name in self._partitions:
                return self._partitions[name]
        partition = _open(self._client, self, name, hinted, version)
        with self._lock:
            self._partitions[name] = partition
        return partition

    def open_many(self, wanted: Sequence[tuple[str, int | None]]) -> dict[str, "Partition | Exception"]:
        """Open many partitions (name, assignment version) in a bounded number of metadata
        transactions (`_open_batch`): each name's Partition or the exception its open raised."""
        return _open_batch(self._client, self, wanted)

    def add(self, partition: Partition) -> Partition:
        with self._lock:
            self._partitions[partition.name] = partition
        return partition

    def reader(self, name: str) -> "PartitionReader":
        """A read-only view of a partition's committed records (read_partition)."""
        return PartitionReader(self._client, name)

    def get(self, name: str) -> Partition | None:
        with self._lock:
            return self._partitions.get(name)

    def all(self) -> list[Partition]:
        with self._lock:
            return list(self._partitions.values())

    def forget(self, partition: Partition) -> None:
        with self._lock:
            if self._partitions.get(partition.name) is partition:
                del self._partitions[partition.name]

    def close(self, timeout: float | None = None) -> list[BaseException]:
        """Close every partition (the client's close calls this before closing its streams),
        CLOSE_BATCH at a time (close_partitions: one upload and one metadata commit each, not
        one per partition: a node of 10,000 partitions stops in seconds); the errors of those
        that failed."""
        errors: list[BaseException] = []
        partitions = self.all()
        for i in range(0, len(partitions), CLOSE_BATCH):
            batch = partitions[i:i + CLOSE_BATCH]
            if len(batch) == 1:
                try:
                    batch[0].close(timeout)
                except (S3StreamError, TimeoutError) as e:
                    errors.append(e)
                continue
            errors += [r for r in close_partitions(batch, timeout=timeout).values() if isinstance(r, BaseException)]
        return errors


def _open(client: StreamClient, table: PartitionTable, name: str, hinted: bool = False,
          version: int | None = None) -> Partition:
    """Create the partition if it is new, else open it on this node (see module docstring).

    `hinted` (node agents): read the hint of the partition's last close first (`closed_key`,
    written by the commit that closed it): when it still holds (no stream was opened since),
    the open is one read and one write, its streams' open, and the close's checkpoint is the
    last one. Otherwise the usual open follows. A hinted open leaves the trim of older
    checkpoints to `Partition.trim_checkpoints` (`trim_due`), which the agent calls after it
    has published the open.

    `version` (with `hinted`): the assignment version this open is for. While the last close's
    record is of an older version, the source may still hold the partition (an agent tries as
    soon as the assignment changes, before the source's close): its meta stream's state is read
    first, without a lock, and StreamNotClosedError raised if another node holds it. The
    locking transaction of a failing open would otherwise run beside the source's close, and
    could hold the rows that close's commit waits for."""
    if not name or "/" in name:
        raise ValueError(f"partition names must be non-empty and contain no '/', got {name!r}")
    timing: dict[str, float] = {"started": time.perf_counter()}
    if hinted:
        raw = client.metadata.get_kv(closed_key(name))
        if version is not None:
            _check_let_go(client, raw, version)
        together = _open_hinted(client, raw, timing)
        if together is not None:
            return _opened(client, table, name, *together, trim_later=True, timing=timing, defer_trim=True)
    meta_kv = client.metadata.get_kv(partition_kv_key(name))
    if meta_kv is None:
        # Create a meta stream and race to publish it; the loser destroys its own.
        candidate = client.create_stream()
        winner = int(client.metadata.put_kv_if_absent(partition_kv_key(name), str(candidate.stream_id).encode()))
        if winner == candidate.stream_id:
            meta = candidate
        else:
            candidate.destroy()
            meta = client.opened(winner) or client.open_stream(winner)
    else:
        together = _open_all(client, int(meta_kv), timing)
        if together is not None:
            return _opened(client, table, name, *together, trim_later=True, timing=timing, defer_trim=hinted)
        meta = client.opened(int(meta_kv)) or client.open_stream(int(meta_kv))
    streams: dict[str, Stream] = {}
    try:
        last = _last_checkpoint(meta)
        if last is None:
            streams = {role: client.create_stream() for role in DATA_ROLES}
            checkpoint = Checkpoint({role: s.stream_id for role, s in streams.items()})
        else:
            checkpoint = last
            for role, sid in checkpoint.streams.items():
                # A handle left open here by an open that failed half-way is reused.
                streams[role] = client.opened(sid) or client.open_stream(sid)
    except BaseException:
        _let_go(client, meta, streams)
        raise
    return _opened(client, table, name, meta, streams, checkpoint, trim_later=False, timing=timing)


def _let_go(client: StreamClient, meta: "Stream", streams: dict[str, "Stream"]) -> None:
    """An open failed: nothing was acknowledged through these handles; closing them (not just
    dropping them) leaves the streams CLOSED for the next try, here or on another node."""
    try:
        client.close_streams([meta, *streams.values()])
    except S3StreamError:
        pass


def _open_all(client: StreamClient, meta_id: int,
              timing: dict[str, float]) -> tuple["Stream", dict[str, "Stream"], Checkpoint] | None:
    """The usual open of a partition that exists, closed elsewhere: its last committed
    checkpoint names its streams, which are opened together in ONE metadata transaction. None
    when that does not apply (a handle already open here, no committed checkpoint): the caller
    opens them one by one. StreamNotClosedError while another node holds it."""
    plan = _committed_plan(client, client.metadata.get_stream(meta_id))
    if plan is None:
        return None
    timing["read"] = time.perf_counter()
    handles = client.open_streams(plan.stream_ids)
    return handles[0], dict(zip(plan.roles, handles[1:])), plan.checkpoint


def _held_elsewhere(client: StreamClient, meta: StreamMeta) -> bool:
    """Whether the partition's meta stream (`meta`, its row) is open on another node."""
    return meta.state == StreamState.OPENED and meta.owner_node_id != client.node_id


def _check_free(client: StreamClient, meta: StreamMeta) -> None:
    """StreamNotClosedError if the partition's meta stream (`meta`, its row) is open on another
    node: its source has not let it go."""
    if _held_elsewhere(client, meta):
        raise StreamNotClosedError.held(meta.stream_id, meta.owner_node_id, meta.epoch)


def _committed_plan(client: StreamClient, meta: StreamMeta, found: FetchedBatch | None = None) -> "_Hint | None":
    """What the last committed checkpoint in meta stream `meta` (its row) says: the streams to
    open together; None if a handle of them is open here or none is committed. `found`: that
    checkpoint's batch, if the caller read it already (a batch of opens reads them together).
    StreamNotClosedError while another node holds it."""
    _check_free(client, meta)
    if client.opened(meta.stream_id) is not None:
        return None
    checkpoint = _committed_checkpoint(client, meta, found)
    if checkpoint is None or any(client.opened(sid) is not None for sid in checkpoint.streams.values()):
        return None
    roles = list(checkpoint.streams)
    return _Hint(checkpoint, roles, [meta.stream_id, *(checkpoint.streams[r] for r in roles)], None)


def _check_let_go(client: StreamClient, raw: bytes | None, version: int) -> None:
    """StreamNotClosedError if the last close (`raw`, its record) was for an assignment older
    than `version` and the partition's meta stream is open on another node (open_partition)."""
    record = None if raw is None else json.loads(raw)
    if not record or record.get("version", 0) >= version or not record.get("hint"):
        return
    meta_id = int(record["hint"]["meta"])
    try:
        meta = client.metadata.get_stream(meta_id)
    except StreamNotFoundError:
        return                            # the usual open finds out what happened
    _check_free(client, meta)


def _open_hinted(client: StreamClient, raw: bytes | None,
                 timing: dict[str, float]) -> tuple["Stream", dict[str, "Stream"], Checkpoint] | None:
    """The open of a partition its last close describes (`raw`: its close record, see
    Partition.close): its streams opened together in ONE metadata transaction, as `_open_all`
    does, without reading the checkpoint back. The hint holds when every stream is at the epoch
    the close left it (none was opened since, so the close's checkpoint is the meta stream's
    last record); else the checkpoint is read from the meta stream, now open here. None when it
    does not apply (no record or no hint, a handle already open here, a stream gone): the
    caller opens the usual way. StreamNotClosedError while another node holds it."""
    plan = _hint(client, raw)
    if plan is None:
        return None
    timing["read"] = time.perf_counter()
    try:
        handles = client.open_streams(plan.stream_ids)
    except StreamNotFoundError:
        return None
    return _from_hint(client, plan, handles)


@dataclass
class _Hint:
    """What a close record's hint says of the partition: its checkpoint, its streams (the meta
    stream first, then the data streams by `roles`) and the epoch the close left each at. Or
    (`epochs` None) what its last committed checkpoint says, read from its meta stream."""
    checkpoint: Checkpoint
    roles: list[str]
    stream_ids: list[int]
    epochs: dict[int, int] | None


def _hint(client: StreamClient, raw: bytes | None) -> _Hint | None:
    """The hint of close record `raw`, if it has a whole one and none of its streams is open here."""
    hint = None if raw is None else json.loads(raw).get("hint")
    if not hint:
        return None
    checkpoint = Checkpoint.from_dict(hint["checkpoint"])
    roles = list(checkpoint.streams)
    ids = [int(hint["meta"]), *(checkpoint.streams[r] for r in roles)]
    epochs = {int(sid): int(epoch) for sid, epoch in hint["epochs"].items()}
    if set(epochs) != set(ids) or any(client.opened(sid) is not None for sid in ids):
        return None
    return _Hint(checkpoint, roles, ids, epochs)


def _from_hint(client: StreamClient, plan: _Hint, handles: list["Stream"],
               lasts: dict[tuple[int, int], FetchedBatch] | None = None
               ) -> tuple["Stream", dict[str, "Stream"], Checkpoint] | None:
    """The partition's streams, opened here (`handles`, in `plan.stream_ids`' order), and its
    checkpoint: the hint's if no stream was opened since that close, else the meta stream's
    last one (read now, unless in `lasts`: batches read together, by (stream, offset)). None
    (the handles let go) if the meta stream names other streams."""
    meta, streams = handles[0], dict(zip(plan.roles, handles[1:]))
    checkpoint = plan.checkpoint
    if not _hint_holds(plan, handles):
        # Opened since that close (a failover closed it, or a close without a record): the last
        # checkpoint is in the meta stream, open here now.
        try:
            found = (lasts or {}).get((meta.stream_id, meta.confirm_offset - 1))
            last = Checkpoint.decode(found.payload) if found is not None else _last_checkpoint(meta)
        except BaseException:
            _let_go(client, meta, streams)
            raise
        if last is None or last.streams != checkpoint.streams:
            _let_go(client, meta, streams)
            return None
        checkpoint = last
    return meta, streams, checkpoint


def _hint_holds(plan: _Hint, handles: list["Stream"]) -> bool:
    """Whether no stream of the plan was opened since the close its hint describes (each is
    one epoch past it): the hint's checkpoint is then the meta stream's last record. A plan
    read from the meta stream (no epochs) holds."""
    return plan.epochs is None or all(h.epoch == plan.epochs[h.stream_id] + 1 for h in handles)


def _fetch_together(client: CommittedSource, points: list[tuple[int, int]]) -> dict[tuple[int, int], FetchedBatch]:
    """client.fetch_committed_at(points), or nothing if that read fails: each partition then
    reads its own checkpoint, and its open says what went wrong."""
    if not points:
        return {}
    try:
        return client.fetch_committed_at(points)
    except Exception:                     # noqa: BLE001 - a shortcut only; see the docstring
        return {}


def _plan_committed(client: StreamClient, names: list[str], plans: dict[str, _Hint],
                    out: dict[str, "Partition | Exception"]) -> list[str]:
    """`_open_all` of many partitions up to their streams' open: their meta streams found in
    two reads (the partitions' keys, the streams' rows), then each one's `_committed_plan` (a
    read of its last committed checkpoint) added to `plans`. One another node holds gets
    StreamNotClosedError in `out`; the rest are left to the one-by-one open. Returns the names
    that have no partition key: new partitions (`_create_batch`)."""
    keys = client.metadata.get_kvs([partition_kv_key(name) for name in names])
    meta_ids = {name: int(keys[partition_kv_key(name)]) for name in names if partition_kv_key(name) in keys}
    rows = client.metadata.get_streams(list(meta_ids.values())) if meta_ids else {}
    # Each one's last committed checkpoint, read together: one metadata read, a few GETs. Not
    # of those still held elsewhere (a target retrying until its source lets go) or open here.
    lasts = {row.stream_id: last for row in rows.values()
             if not _held_elsewhere(client, row) and client.opened(row.stream_id) is None
             and (last := _last_committed(row)) is not None}
    found = _fetch_together(client, list(lasts.items()))
    for name, meta_id in meta_ids.items():
        if meta_id not in rows:
            continue
        try:
            last = lasts.get(meta_id)
            plan = _committed_plan(client, rows[meta_id], None if last is None else found.get((meta_id, last)))
        except StreamNotClosedError as e:
            out[name] = e
            continue
        except S3StreamError:
            continue                      # the one-by-one open tries again and says why
        if plan is not None:
            plans[name] = plan
    return [name for name in names if name not in meta_ids]


def _create_batch(client: StreamClient, table: "PartitionTable", names: list[str],
                  started: float) -> dict[str, "Partition | Exception"]:
    """Create new partitions (`names`: no partition key found) together, as `_open` creates one:
    the streams of them all in ONE metadata transaction (client.create_streams), their keys
    published in ONE more (replace_kvs: a compare-and-set each, the key absent), then each one's
    first checkpoint appended (`_opened`, as a node agent's open: not waited for, no trim).

    One whose key another node published first (a race of two opens) destroys the streams it
    made here and is left out, to the one-by-one open, which opens the winner's. If either
    transaction fails, every name gets its error (the agent tries again) and the streams made
    here are closed, best effort: a key the failed publish may have written names a stream that
    the next open finds and opens again."""
    out: dict[str, Partition | Exception] = {}
    per = 1 + len(DATA_ROLES)
    try:
        made = client.create_streams(per * len(names))
    except S3StreamError as e:
        return {name: e for name in names}
    groups = {name: made[i * per:(i + 1) * per] for i, name in enumerate(names)}
    try:
        won = client.metadata.replace_kvs([(partition_kv_key(name), None, str(group[0].stream_id).encode())
                                           for name, group in groups.items()])
    except S3StreamError as e:
        try:
            client.close_streams(made)
        except S3StreamError:
            pass
        return {name: e for name in names}
    timing = {"started": started, "read": time.perf_counter()}
    for (name, group), published in zip(groups.items(), won):
        if not published:
            for stream in group:
                try:
                    stream.destroy()
                except S3StreamError:
                    pass                  # an empty stream nothing names; the open goes on
            continue
        streams = dict(zip(DATA_ROLES, group[1:]))
        checkpoint = Checkpoint({role: stream.stream_id for role, stream in streams.items()})
        try:
            out[name] = table.add(_opened(client, table, name, group[0], streams, checkpoint, trim_later=True,
                                          timing=timing, defer_trim=True))
        except Exception as e:            # noqa: BLE001 - this partition's, handed to the caller
            out[name] = e
    return out


def _open_batch(client: StreamClient, table: "PartitionTable",
                wanted: Sequence[tuple[str, int | None]]) -> dict[str, "Partition | Exception"]:
    """Open many partitions on this node (`wanted`: name and assignment version, as a hinted
    `_open` of each), with a bounded number of metadata transactions for all of them: one read
    of their close records, one of the meta streams a version check needs, two more (and a
    read of each one's last committed checkpoint) for those without a close record, and ONE
    transaction opening the streams of them all. New partitions are created together, in two
    (`_create_batch`). Any the plan does not cover (a handle open here already, a hint that
    does not hold, a creation another node won) opens one by one (`_open`, hinted). If the
    shared transaction is refused (one stream held by another node, or gone), each opens alone,
    so one partition never stops the others. Returns each name's Partition, or the exception
    its open raised (StreamNotClosedError: another node still holds it)."""
    out: dict[str, Partition | Exception] = {}
    todo = []
    for name, version in wanted:
        already = table.get(name)
        if already is not None:
            out[name] = already
        else:
            todo.append((name, version))
    started = time.perf_counter()
    raws = client.metadata.get_kvs([closed_key(name) for name, _ in todo])
    plans: dict[str, _Hint] = {}
    check: dict[str, int] = {}
    valid = {name for name, _ in todo if name and "/" not in name}     # others: _open says why
    for name, version in todo:
        raw = raws.get(closed_key(name))
        plan = _hint(client, raw) if name in valid else None
        if plan is None:
            continue
        plans[name] = plan
        record = json.loads(raw) if raw is not None else {}
        if version is not None and record.get("version", 0) < version:
            check[name] = plan.stream_ids[0]
    unhinted = [name for name, _ in todo if name in valid and name not in plans]
    new = _plan_committed(client, unhinted, plans, out) if unhinted else []
    if new:
        out.update(_create_batch(client, table, list(dict.fromkeys(new)), started))
    if check:
        # _check_let_go of all of them in one read: the source may still hold some.
        metas = client.metadata.get_streams(list(check.values()))
        for name, meta_id in check.items():
            try:
                if meta_id in metas:
                    _check_free(client, metas[meta_id])
            except StreamNotClosedError as e:
                out[name] = e
                del plans[name]
    handles: dict[str, list[Stream]] = {}
    t_read = time.perf_counter()
    if plans:
        try:
            opened = client.open_streams([sid for plan in plans.values() for sid in plan.stream_ids])
        except (StreamNotClosedError, StreamNotFoundError):
            opened = []                   # one of them is held or gone: each opens alone below
        for name, plan in plans.items():
            if opened:
                handles[name], opened = opened[:len(plan.stream_ids)], opened[len(plan.stream_ids):]
    # Those opened since their close (a failover closed them) take their meta stream's last
    # checkpoint, read for all of them together.
    stale = [handles[name][0] for name, plan in plans.items()
             if name in handles and not _hint_holds(plan, handles[name])]
    lasts = _fetch_together(client, [(m.stream_id, m.confirm_offset - 1) for m in stale
                                     if m.confirm_offset > m.start_offset])
    for name, version in todo:
        if name in out:
            continue
        try:
            together = _from_hint(client, plans[name], handles[name], lasts) if name in handles else None
            if together is None:
                out[name] = table.open(name, True, version)
                continue
            timing = {"started": started, "read": t_read}
            out[name] = table.add(_opened(client, table, name, *together, trim_later=True, timing=timing,
                                          defer_trim=True))
        except Exception as e:            # noqa: BLE001 - this partition's, handed to the caller
            out[name] = e
    return out


def _opened(client: StreamClient, table: "PartitionTable", name: str, meta: "Stream", streams: dict[str, "Stream"],
            checkpoint: Checkpoint, trim_later: bool, timing: dict[str, float],
            defer_trim: bool = False) -> Partition:
    """Append the open's checkpoint (leader epoch + 1) and serve. `trim_later`: older
    checkpoints are trimmed only once CHECKPOINTS_KEPT of them piled up (one open in a few
    trims), so that the usual open writes metadata once (its streams' open). `defer_trim`:
    not even then, here: the partition is returned with `trim_due` set."""
    t_streams = time.perf_counter()
    try:
        producers = ProducerTable.restore(checkpoint.producers)
        if checkpoint.scan_from is not None and "log" in streams:
            _read_back_producers(streams["log"], checkpoint.scan_from, producers)
        opened = Checkpoint(checkpoint.streams, checkpoint.leader_epoch + 1, False,
                            {role: s.start_offset for role, s in streams.items()}, producers.snapshot())
        trim = not trim_later or meta.confirm_offset - meta.start_offset >= CHECKPOINTS_KEPT
        # A node agent's open (defer_trim) serves, and says so, once its checkpoint is appended,
        # without waiting for it to be durable: the appends it takes queue behind it in the WAL,
        # which acknowledges in order, so none is acknowledged before it is durable; should the
        # node die first, nothing was acknowledged under this open and the last durable
        # checkpoint (the close's) still says all. That wait was the open's share of a move's
        # fsyncs on a disk where they stall (0.5 ms typical, up to 8 ms at half load).
        written = _write_checkpoint(meta, opened, trim=trim and not defer_trim, wait=not defer_trim)
    except BaseException:
        _let_go(client, meta, streams)
        raise
    partition = Partition(client, table, name, meta, streams, opened, producers)
    partition.trim_due = trim and defer_trim
    partition.open_checkpoint = written if defer_trim else None
    t_read = timing.get("read", timing["started"])      # one by one (a new partition): all "streams"
    partition.open_phases = dict(read=t_read - timing["started"], streams=t_streams - t_read,
                                 checkpoint=time.perf_counter() - t_streams)
    return partition


def _read_back_producers(log: "Stream", start: int, producers: ProducerTable) -> None:
    """Take the producers' batches of the log from `start` to its end into `producers` (an
    open after a crash: the last snapshot was not a close's). Given-up offsets are skipped."""
    pos, end = max(start, log.start_offset), log.next_offset
    while pos < end:
        try:
            batches = log.fetch(pos, end, 8 << 20).batches
        except OffsetsLostError as e:
            pos = e.end
            continue
        if not batches:
            break
        producers.replay(batches)
        pos = batches[-1].end_offset


def _write_checkpoint(meta: "Stream", checkpoint: Checkpoint, timeout: float | None = None,
                      trim: bool = True, wait: bool = True) -> AppendFuture:
    """Append a snapshot, wait for it to be durable (unless not `wait`) and (`trim`) trim the
    older ones (`_trim_checkpoints`). A close does not trim (its one metadata transaction is its
    commit): the next open trims what it left. Returns the append's future."""
    written = meta.append(RecordBatch(checkpoint.encode(), 1))
    if wait or written.done():
        # Not waiting still raises what is known already: an append that reached the WAL but
        # not the log cache fails at once, and a close must not commit without its checkpoint.
        written.result(timeout)
    if trim:
        assert wait, "a trim keeps the newest durable checkpoint: wait for this one first"
        _trim_checkpoints(meta)
    return written


def _trim_checkpoints(meta: "Stream") -> None:
    """Trim the meta stream below its newest checkpoint, keeping the newest committed one too:
    if this node dies with its WAL (`node forget --wal-lost`), a committed checkpoint stays
    readable."""
    newest = meta.confirm_offset - 1
    committed = _last_committed(meta.metadata())
    keep = newest if committed is None else min(newest, committed)
    if keep > meta.start_offset:
        meta.trim(keep)


def _last_checkpoint(meta: "Stream") -> Checkpoint | None:
    """The newest readable snapshot: the last record, or the last before offsets given up with
    a lost WAL."""
    end = meta.confirm_offset
    while end > meta.start_offset:
        try:
            res = meta.fetch(end - 1, end)
        except OffsetsLostError as e:
            end = e.start
            continue
        return Checkpoint.decode(res.batches[-1].payload)
    return None


def _committed_checkpoint(client: CommittedSource, meta: StreamMeta,
                          found: FetchedBatch | None = None) -> Checkpoint | None:
    """The newest checkpoint committed to objects in meta stream `meta` (read without opening
    it, unless the caller did: `found`, the batch holding it), or None if none is."""
    last = _last_committed(meta)
    if last is None:
        return None
    if found is not None and found.base_offset <= last < found.end_offset:
        return Checkpoint.decode(found.payload)
    res = client.fetch_committed(meta.stream_id, last, last + 1, known=meta)
    return Checkpoint.decode(res.batches[-1].payload)


def _last_committed(meta: StreamMeta) -> int | None:
    """The offset of the stream's last committed record (not in a lost range), if any."""
    for r in reversed(meta.ranges):
        if not r.lost and r.end_offset > max(r.start_offset, meta.start_offset):
            return r.end_offset - 1
    return None


# ---- the layer's entry points: functions of a client --------------------------------------------

def partition_table(client: StreamClient) -> PartitionTable:
    """The client's table of open partitions, made on first use (the client closes it first when
    it closes: each partition with a clean checkpoint, then the streams)."""
    return client.addon("partitions", PartitionTable)


def open_partition(client: StreamClient, name: str, *, hinted: bool = False, version: int | None = None) -> Partition:
    """Create the named partition or open it on the client's node; the one already open there
    if it is. `hinted` and `version` are for node agents: open from the hint the last close
    recorded, if it holds, for that assignment version (see _open)."""
    client.check_usable()
    return partition_table(client).open(name, hinted, version)


def open_partitions(client: StreamClient, wanted: Sequence[tuple[str, int | None]]) -> dict[str, "Partition | Exception"]:
    """Open many partitions on the client's node at once, as node agents do (`wanted`: name and
    assignment version, None if unversioned): a bounded number of metadata transactions for the
    whole batch, not a few per partition. Returns each name's Partition, or the exception its
    open raised: one partition failing does not stop the others."""
    client.check_usable()
    return partition_table(client).open_many(wanted)


def read_partition(source: CommittedSource, name: str) -> PartitionReader:
    """A read-only view of the named partition's committed records, from a StreamClient or a
    reader that is not a node (s3stream.open_reader): it does not open the partition, so its
    owner keeps it. StreamNotFoundError if there is no such partition or its first checkpoint
    is not committed yet."""
    source.check_usable()
    return PartitionReader(source, name)


def partitions_on(client: StreamClient) -> list[Partition]:
    """The partitions open on the client's node (never opens one)."""
    table = client.find_addon("partitions")
    return [] if table is None else table.all()


def partition_on(client: StreamClient, name: str) -> Partition | None:
    """The partition `name` if it is open on the client's node, else None (never opens it)."""
    table = client.find_addon("partitions")
    return None if table is None else table.get(name)
