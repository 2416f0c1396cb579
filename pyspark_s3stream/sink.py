"""The sink: `df.write.format("s3stream")` and `df.writeStream.format("s3stream")`, exactly once.

Why objects and not appends. A partition is appended to by the one node that has it open, and
nodes take no appends from other processes (they share only metadata and the object store). So a
Spark task does not append: it writes objects, as a node's uploader does, and the driver commits
them, as Spark's protocol asks (tasks write, the driver commits a batch or aborts it):

- **A task** encodes its rows as Kafka record batches (s3stream.records), one run per output
  partition, and, every OBJECT_BYTES of a partition and at its end, reserves that many offsets
  of the partition's log stream (a compare-and-set on the KV key `sink/next/<stream id>`,
  starting no lower than the stream's committed end), writes one StreamObject at those offsets
  (an object id prepared in metadata, a PUT) and reports (object id, size, stream, start, end)
  to the driver. It keeps nothing: no WAL, no open stream, no lease. A task that dies leaves
  prepared objects that expire (Config.prepared_ttl) and offsets it reserved and never reported.
- **The driver's commit** opens the log streams of the batch's partitions as a WAL-less node of
  its own (NodeMeta.walless: no judge fails it over, there is nothing to recover), then commits
  every reported object, plus a gap (records.encode_gap: a batch of no records, as Kafka's
  compaction leaves) over each run of offsets reserved by a task attempt that did not report,
  and closes the streams: one metadata transaction. Offsets stay dense and each holds at most
  one record, whoever reserved it; readers skip gaps as Kafka's consumers skip compacted offsets.
- **Exactly once.** Spark gives the commit one message per task, from the attempt it let commit,
  so a retried task or a lost executor writes its rows once. A micro-batch's commit writes
  `sink/writer/<writer id>` = the batch id in the same transaction, guarded (CommitRequest.kv_guard)
  by the value it read: a batch Spark runs again after a driver crash (its commit landed, Spark's
  commit log did not) is found committed and not written twice, and a second driver committing the
  same batch at the same time fails without writing. The writer id is the option `writerId`,
  else derived from the query's checkpointLocation (the same across restarts of one query).

A partition that does not exist is created by the first task that writes to it, as Kafka
brokers create a topic on its first write (`auto.create.topics.enable`, true by default):
option `createPartitions` (default true; false refuses it). Its streams and first checkpoint
are committed before its KV key is published with put-if-absent (_Context.create_partition),
so racing tasks and batches create it once and no one sees it half made. A partition named but without a committed checkpoint
(a node is creating it) is refused until that node uploads. The sink writes only partitions no
node holds open (a node's open fences the sink: its commit fails and Spark retries the batch; a
sink's commit closes what it opened). Rows name their partition in a `partition` column, else
the option `partition` names one for all.
Columns: `value` (binary or string, required), `key` (binary or string), `headers`
(array<struct<key: string, value: binary>>), `timestamp` (else the time of encoding), `partition`.
Options: `metadata`, `object_store` (URLs), `partition`, `compression` (None, gzip, snappy, lz4,
zstd), `writerId`, `objectBytes` (default 16 MiB), `createPartitions` (default true).
"""
from __future__ import annotations

# First: a worker without the dependencies says what to set (PYSPARK_PYTHON), not just what is missing.
from . import _dependencies  # noqa: F401

import atexit
import hashlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage

from _native import arrowrecords
from s3stream import Config, Record, open_reader
from s3stream.cluster.partition import DATA_ROLES, Checkpoint, partition_kv_key
from s3stream.errors import ConfigError, MetadataError, S3StreamError, StreamNotClosedError, StreamNotFoundError
from s3stream.metadata import MetadataStore, StreamState
from s3stream.metadata.base import WALLESS, CommitRange, CommitRequest, CommitStreamObject, object_key
from s3stream.objectformat import encode_object
from s3stream.records import COMPRESSION_CODECS, encode_gap, encode_records, with_base_offset
from s3stream.cluster import read_partition

__all__ = ["BatchWriter", "StreamWriter", "SinkMessage", "SinkError"]

#: Bytes of encoded records a task gathers for one partition before it writes them as an object.
OBJECT_BYTES = 16 << 20
#: Encoded bytes a task holds at most over all its partitions before it writes the largest.
TASK_BYTES = 64 << 20
#: Records, and bytes, of one Kafka record batch the sink encodes.
BATCH_RECORDS = 4096
BATCH_BYTES = 1 << 20
#: The sink's committers take node ids from here up (KV `sink/next-node-id`).
SINK_NODE_BASE = 1 << 40
#: Compare-and-set attempts on a KV counter before giving up (each fails only if another writer
#: moved the counter in between).
CAS_ATTEMPTS = 1000
#: Data block size of the objects the sink writes, and how long their ids stay PREPARED: the
#: engine's defaults (Config.object_block_size, Config.prepared_ttl).
BLOCK_SIZE = Config().object_block_size
PREPARED_TTL = Config().prepared_ttl


class SinkError(S3StreamError):
    """A write through the sink that cannot be committed as asked (the message says why)."""


@dataclass(frozen=True)
class Piece:
    """One object a task wrote: a stream's records at offsets [start, end)."""
    object_id: int
    size: int
    stream_id: int
    start: int
    end: int


@dataclass
class SinkMessage(WriterCommitMessage):
    """What a task reports to the driver: the objects it wrote, and its row count."""
    pieces: list
    rows: int


# ---- options -----------------------------------------------------------------------------------

def _option(options: dict, name: str, default: Any = None) -> Any:
    return options.get(name.lower(), options.get(name, default))


def _required(options: dict, name: str) -> str:
    value = _option(options, name)
    if not value:
        raise ConfigError(f"the s3stream sink needs the option {name!r} (a URL, as StreamClient takes it): "
                          f".option({name!r}, ...)")
    return str(value)


def _flag(options: dict, name: str, default: bool) -> bool:
    raw = _option(options, name, default)
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text not in ("true", "false", "1", "0", "yes", "no"):
        raise ConfigError(f"option {name}={raw!r} must be true or false (default {str(default).lower()})")
    return text in ("true", "1", "yes")


class _Options:
    def __init__(self, options: dict) -> None:
        self.metadata = _required(options, "metadata")
        self.object_store = _required(options, "object_store")
        self.partition = _option(options, "partition")
        self.compression = _option(options, "compression")
        if self.compression in ("", "none"):
            self.compression = None
        if self.compression is not None and self.compression not in COMPRESSION_CODECS:
            raise ConfigError(f"option compression={self.compression!r} is not a codec: use one of "
                              f"{sorted(c for c in COMPRESSION_CODECS if c)} or leave it out")
        raw = _option(options, "objectBytes", OBJECT_BYTES)
        try:
            self.object_bytes = int(raw)
        except (TypeError, ValueError):
            self.object_bytes = 0
        if self.object_bytes < 1:
            raise ConfigError(f"option objectBytes={raw!r} must be a positive number of bytes (default {OBJECT_BYTES})")
        self.writer_id = _option(options, "writerId")
        self.create_partitions = _flag(options, "createPartitions", True)
        # Testing only: a task's first attempt raises once it has written this many objects.
        self.fail_after_objects = int(_option(options, "_failFirstAttemptAfterObjects", 0))
        self.checkpoint = _option(options, "checkpointLocation")


# ---- per-process connections ---------------------------------------------------------------------

class _Context:
    """The metadata store, object store and partition names one process writes with."""

    def __init__(self, metadata: str, object_store: str) -> None:
        self.reader = open_reader(metadata, object_store)
        self.meta: MetadataStore = self.reader.metadata
        self.store = self.reader.object_store
        self._logs: dict[str, int] = {}
        self._lock = threading.Lock()
        self._node: tuple[int, int] | None = None

    def log_stream(self, name: str, create: bool = False) -> int:
        """The log stream of partition `name`; `create`: a partition that does not exist is
        created (create_partition)."""
        with self._lock:
            if name in self._logs:
                return self._logs[name]
        try:
            stream_id = read_partition(self.reader, name).log_stream_id
        except StreamNotFoundError as e:
            if not create:
                raise SinkError(f"cannot write to partition {name!r}: {e}. Create it with a node "
                                "(s3stream.cluster.open_partition) and let it upload, or let the sink create it "
                                "(option createPartitions=true)") from None
            if self.meta.get_kv(partition_kv_key(name)) is not None:
                # Named but not readable yet: a node is creating it, and its first upload makes it so.
                raise SinkError(f"cannot write to partition {name!r}: {e}") from None
            stream_id = self.create_partition(name)
        with self._lock:
            self._logs[name] = stream_id
        return stream_id

    def create_partition(self, name: str) -> int:
        """Create partition `name` as a node's first open would, without a WAL, and return its
        log stream's id. Its streams are made and its first checkpoint committed as an object
        (the streams closed in the same transaction) before its KV key is published with
        put_kv_if_absent: once the key names it, it is readable. Of creators racing (tasks of a
        batch, batches, queries, a node), the first to publish wins; a loser deletes the streams
        it made and writes to the winner's partition. A creator that dies before publishing
        leaves closed streams that nothing names."""
        if not name or "/" in name:
            raise SinkError(f"cannot create partition {name!r}: partition names must be non-empty and contain no '/'")
        node_id, node_epoch = self.node()
        streams = [self.meta.create_stream(node_id, node_epoch) for _ in (None, *DATA_ROLES)]
        meta_stream, data = streams[0], dict(zip(DATA_ROLES, streams[1:]))
        checkpoint = Checkpoint({role: stream.stream_id for role, stream in data.items()})
        piece = self.write_object(meta_stream.stream_id, 0, [(1, checkpoint.encode())], kafka=False)
        self.meta.commit(CommitRequest(
            node_id, node_epoch,
            stream_objects=(CommitStreamObject(piece.object_id, piece.size,
                                               CommitRange(meta_stream.stream_id, meta_stream.epoch, 0, 1)),),
            closes=tuple((stream.stream_id, stream.epoch) for stream in streams)))
        # Not kv_guard=(key, None) in that commit: on PostgreSQL a guard on an absent key locks
        # no row, so racing commits could all pass it. put_kv_if_absent has one winner.
        winner = int(self.meta.put_kv_if_absent(partition_kv_key(name), str(meta_stream.stream_id).encode()))
        if winner == meta_stream.stream_id:
            return data["log"].stream_id
        for stream in streams:
            try:
                self.meta.delete_stream(stream.stream_id, stream.epoch)
            except S3StreamError:
                pass                              # closed, empty and named by nothing: harmless
        return read_partition(self.reader, name).log_stream_id

    def reserve(self, stream_id: int, count: int) -> int:
        """Offsets [start, start + count) of the stream, reserved for this caller alone."""
        key = f"sink/next/{stream_id}"
        for _ in range(CAS_ATTEMPTS):
            raw = self.meta.get_kv(key)
            end = self.meta.get_stream(stream_id).end_offset
            start = max(int(raw) if raw is not None else 0, end)
            if self.meta.replace_kv(key, raw, str(start + count).encode()):
                return start
        raise SinkError(f"could not reserve offsets of stream {stream_id}: {CAS_ATTEMPTS} compare-and-sets on "
                        f"{key!r} lost to other writers")

    def write_object(self, stream_id: int, start: int, batches: list[tuple[int, bytes]], kafka: bool = True) -> Piece:
        """A StreamObject of `batches` ((record count, payload)) at offsets from `start`. With
        `kafka`, each payload is a Kafka batch, stored with its offset in the stream in its
        header as a broker (and the engine's append path) stores one; this writer knows the
        offsets only here. Without, payloads are stored as they are (a partition's checkpoint)."""
        items, offset = [], start
        for count, payload in batches:
            items.append((offset, count, with_base_offset(payload, offset) if kafka else payload))
            offset += count
        data = encode_object([(stream_id, items)], BLOCK_SIZE).data
        object_id = self.meta.prepare_objects(1, int(PREPARED_TTL * 1e9))[0]
        self.store.put(object_key(object_id), data)
        return Piece(object_id, len(data), stream_id, start, offset)

    def node(self) -> tuple[int, int]:
        """This process's committer: a WAL-less node (id, epoch), registered on first use."""
        with self._lock:
            if self._node is not None:
                return self._node
            key = "sink/next-node-id"
            for _ in range(CAS_ATTEMPTS):
                raw = self.meta.get_kv(key)
                node_id = int(raw) if raw is not None else SINK_NODE_BASE
                if self.meta.replace_kv(key, raw, str(node_id + 1).encode()):
                    break
            else:
                raise SinkError(f"could not allocate a committer node id: {CAS_ATTEMPTS} compare-and-sets on {key!r} lost")
            node = self.meta.register_node(node_id, f"{WALLESS}spark sink on {socket.gethostname()} pid {os.getpid()}")
            self._node = (node_id, node.node_epoch)
            return self._node


_contexts: dict[tuple[str, str], _Context] = {}
_contexts_lock = threading.Lock()


def close_contexts() -> None:
    """Close this process's connections (at exit, or once a test is done with its stores)."""
    with _contexts_lock:
        contexts = list(_contexts.values())
        _contexts.clear()
    for ctx in contexts:
        ctx.reader.close()


atexit.register(close_contexts)


def _context(opts: _Options) -> _Context:
    key = (opts.metadata, opts.object_store)
    with _contexts_lock:
        ctx = _contexts.get(key)
        if ctx is None:
            ctx = _contexts[key] = _Context(opts.metadata, opts.object_store)
        return ctx


# ---- tasks -------------------------------------------------------------------------------------------

def _text_or_bytes(value: Any) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def _bytes_column(batch, name: str):
    """The named binary or string column as an Arrow array with 32-bit offsets, or None."""
    if name not in batch.schema.names:
        return None
    column = batch.column(name)
    kind = column.type
    if pa.types.is_large_binary(kind) or pa.types.is_large_string(kind):
        column = column.cast(pa.binary())
    elif not (pa.types.is_binary(kind) or pa.types.is_string(kind)):
        raise SinkError(f"the s3stream sink's `{name}` column must be binary or string, got {kind}")
    return column


def _encode_arrow(batch, now_ms: int, max_records: int, max_bytes: int) -> list[tuple[bytes, int]]:
    """The rows of an Arrow batch without headers as Kafka batches (_native.arrowrecords)."""
    value = _bytes_column(batch, "value")
    key = _bytes_column(batch, "key")
    vb = value.buffers()
    kb = key.buffers() if key is not None else (None, None, None)
    stamps, per_ms = None, 1
    if "timestamp" in batch.schema.names:
        stamps = batch.column("timestamp")
        if pa.types.is_timestamp(stamps.type):
            stamps = stamps.cast(pa.timestamp("us"))
            per_ms = 1000
        elif not pa.types.is_integer(stamps.type):
            raise SinkError(f"the s3stream sink's `timestamp` column must be a timestamp (or ms since the epoch as an "
                            f"integer), got {stamps.type}")
        else:
            stamps = stamps.cast(pa.int64())
    tb = stamps.buffers() if stamps is not None else (None, None)
    return arrowrecords.encode_columns(vb[0], vb[1], vb[2], value.offset, kb[0], kb[1], kb[2],
                                       key.offset if key is not None else 0,
                                       tb[0], tb[1], stamps.offset if stamps is not None else 0, per_ms,
                                       batch.num_rows, now_ms, max_records, max_bytes)


def _by_partition(batch, default: str | None) -> list[tuple[str, Any]]:
    """The batch's rows grouped by their `partition` column (null: the option's partition)."""
    groups: list[tuple[str | None, Any]]
    if "partition" not in batch.schema.names or batch.column("partition").null_count == batch.num_rows:
        groups = [(default, batch)]
    else:
        column = batch.column("partition")
        names = pc.unique(column).to_pylist()
        if len(names) == 1:
            groups = [(names[0], batch)]
        else:
            groups = [(name, batch.filter(pc.is_null(column) if name is None else pc.equal(column, name)))
                      for name in names]
    out = []
    for name, rows in groups:
        name = default if name is None else name
        if name is None:
            raise SinkError("a row names no partition: give the rows a `partition` column or the sink the option "
                            "partition=NAME")
        out.append((name, rows))
    return out


def _records(batch) -> Iterator[tuple[str | None, Record]]:
    """(partition or None, Record) of each row of an Arrow batch."""
    names = batch.schema.names
    n = batch.num_rows
    values = batch.column("value").to_pylist()
    keys = batch.column("key").to_pylist() if "key" in names else [None] * n
    parts = batch.column("partition").to_pylist() if "partition" in names else [None] * n
    stamps = batch.column("timestamp").cast("int64").to_pylist() if "timestamp" in names else None
    headers = batch.column("headers").to_pylist() if "headers" in names else None
    for i in range(n):
        ts = stamps[i] // 1000 if stamps is not None and stamps[i] is not None else None
        hs = () if headers is None or headers[i] is None else tuple(
            (h["key"], _text_or_bytes(h["value"])) for h in headers[i])
        yield parts[i], Record(key=_text_or_bytes(keys[i]), value=_text_or_bytes(values[i]), timestamp=ts, headers=hs)


class _TaskWriter:
    """One task's rows, gathered per partition and written as objects."""

    def __init__(self, opts: _Options) -> None:
        self.opts = opts
        self.ctx = _context(opts)
        self.pending: dict[int, list[Record]] = {}       # stream -> records not yet encoded
        self.pending_bytes: dict[int, int] = {}
        self.encoded: dict[int, list[tuple[int, bytes]]] = {}
        self.encoded_bytes: dict[int, int] = {}
        self.pieces: list[Piece] = []
        self.rows = 0
        self.batch_bytes = min(BATCH_BYTES, opts.object_bytes)

    def add_batch(self, batch) -> None:
        """An Arrow batch of rows: natively encoded unless it has headers or a codec is asked for."""
        if "value" not in batch.schema.names:
            raise SinkError(f"the s3stream sink needs a `value` column (binary or string); the columns are "
                            f"{batch.schema.names}")
        for name, rows in _by_partition(batch, self.opts.partition):
            native = self.opts.compression is None and (
                "headers" not in rows.schema.names or rows.column("headers").null_count == rows.num_rows)
            if not native:
                for _, record in _records(rows):
                    self.add(name, record)
                continue
            stream_id = self.ctx.log_stream(name, self.opts.create_partitions)
            self._encode(stream_id)                     # records gathered before, in order
            for payload, count in _encode_arrow(rows, int(time.time() * 1000), BATCH_RECORDS, self.batch_bytes):
                self.rows += count
                self._add_encoded(stream_id, count, payload)

    def add(self, partition: str | None, record: Record) -> None:
        name = partition if partition is not None else self.opts.partition
        if name is None:
            raise SinkError("a row names no partition: give the rows a `partition` column or the sink the option "
                            "partition=NAME")
        stream_id = self.ctx.log_stream(name, self.opts.create_partitions)
        records = self.pending.setdefault(stream_id, [])
        records.append(record)
        size = self.pending_bytes.get(stream_id, 0) + len(record.value or b"") + len(record.key or b"") + 16
        self.pending_bytes[stream_id] = size
        self.rows += 1
        if len(records) >= BATCH_RECORDS or size >= self.batch_bytes:
            self._encode(stream_id)

    def _encode(self, stream_id: int) -> None:
        records = self.pending.pop(stream_id, None)
        self.pending_bytes.pop(stream_id, None)
        if not records:
            return
        payload, count = encode_records(records, self.opts.compression)
        self._add_encoded(stream_id, count, payload)

    def _add_encoded(self, stream_id: int, count: int, payload: bytes) -> None:
        self.encoded.setdefault(stream_id, []).append((count, payload))
        total = self.encoded_bytes.get(stream_id, 0) + len(payload)
        self.encoded_bytes[stream_id] = total
        if total >= self.opts.object_bytes:
            self._flush(stream_id)
        elif sum(self.encoded_bytes.values()) >= TASK_BYTES:
            # Many partitions each under objectBytes: write the largest, so that a task holds at
            # most about TASK_BYTES (plus a batch per partition) whatever it writes to.
            self._flush(max(self.encoded_bytes, key=self.encoded_bytes.__getitem__))

    def _flush(self, stream_id: int) -> None:
        batches = self.encoded.pop(stream_id, None)
        self.encoded_bytes.pop(stream_id, None)
        if not batches:
            return
        start = self.ctx.reserve(stream_id, sum(count for count, _ in batches))
        self.pieces.append(self.ctx.write_object(stream_id, start, batches))
        if self.opts.fail_after_objects and len(self.pieces) >= self.opts.fail_after_objects:
            from pyspark import TaskContext
            context = TaskContext.get()
            if context is not None and context.attemptNumber() == 0:
                raise SinkError(f"injected failure (option _failFirstAttemptAfterObjects) after {len(self.pieces)} objects")

    def finish(self) -> SinkMessage:
        for stream_id in list(self.pending):
            self._encode(stream_id)
        for stream_id in list(self.encoded):
            self._flush(stream_id)
        return SinkMessage([p.__dict__ for p in self.pieces], self.rows)


def _write(opts: _Options, iterator) -> SinkMessage:
    task = _TaskWriter(opts)
    for batch in iterator:
        task.add_batch(batch)
    return task.finish()


# ---- the driver's commit -------------------------------------------------------------------------

def _open(ctx: _Context, stream_ids: list[int], node: tuple[int, int]):
    """Open the streams as the committer; a stream a crashed committer left open is closed
    first (a WAL-less node holds nothing un-uploaded); one a node holds open is refused."""
    meta = ctx.meta
    for _ in range(3):
        try:
            return meta.open_streams(stream_ids, node[0], node[1])
        except StreamNotClosedError:
            nodes = {n.node_id: n for n in meta.list_nodes()}
            for stream in meta.get_streams(stream_ids).values():
                if (stream.state != StreamState.OPENED or stream.owner_node_id is None
                        or stream.owner_node_id == node[0]):
                    continue
                owner = nodes.get(stream.owner_node_id)
                if owner is None or not owner.walless:
                    raise SinkError(f"stream {stream.stream_id} (a partition's log) is open on node {stream.owner_node_id}: "
                                    "the sink writes only partitions no node holds open; close or move that partition "
                                    "off the node first") from None
                try:
                    meta.close_stream(stream.stream_id, stream.epoch, stream.owner_node_id)
                except S3StreamError:
                    pass                         # it moved on since: the next attempt sees how
    raise SinkError(f"could not open streams {stream_ids} for the sink's commit: other committers kept taking them")


def _gap_object(ctx: _Context, stream_id: int, epoch: int, start: int, end: int) -> list[CommitStreamObject]:
    out = []
    while start < end:
        count = min(end - start, 0x7FFFFFFF)
        piece = ctx.write_object(stream_id, start, [(count, encode_gap(count, base_offset=start))])
        out.append(CommitStreamObject(piece.object_id, piece.size, CommitRange(stream_id, epoch, start, start + count)))
        start += count
    return out


def _commit(opts: _Options, messages, batch_id: int | None, writer_id: str | None) -> dict:
    """Commit the tasks' objects (module docstring): returns what was committed."""
    pieces = [Piece(**p) for m in messages if m is not None for p in m.pieces]
    ctx = _context(opts)
    meta = ctx.meta
    guard_key = guard = None
    if batch_id is not None:
        guard_key = f"sink/writer/{writer_id}"
        guard = meta.get_kv(guard_key)
        if guard is not None and json.loads(guard)["batch"] >= batch_id:
            return {"skipped": True, "batch": batch_id, "committed_batch": json.loads(guard)["batch"]}
    if not pieces:
        return {"objects": 0, "rows": 0}
    node = ctx.node()
    stream_ids = sorted({p.stream_id for p in pieces})
    opened = {s.stream_id: s for s in _open(ctx, stream_ids, node)}
    try:
        objects: list[CommitStreamObject] = []
        gaps = 0
        for stream_id in stream_ids:
            stream = opened[stream_id]
            end = stream.end_offset
            for piece in sorted((p for p in pieces if p.stream_id == stream_id), key=lambda p: p.start):
                if piece.start < end:
                    raise SinkError(f"stream {stream_id}: offsets [{piece.start}, {piece.end}) this batch reserved were "
                                    f"committed by another writer (end offset {end}): the batch must run again")
                if piece.start > end:
                    objects += _gap_object(ctx, stream_id, stream.epoch, end, piece.start)
                    gaps += piece.start - end
                objects.append(CommitStreamObject(piece.object_id, piece.size,
                                                  CommitRange(stream_id, stream.epoch, piece.start, piece.end)))
                end = piece.end
        kv: tuple = ()
        kv_guard = None
        if guard_key is not None:
            kv = ((guard_key, json.dumps({"batch": batch_id, "at": time.time()}).encode()),)
            kv_guard = (guard_key, guard)
        meta.commit(CommitRequest(node[0], node[1], stream_objects=tuple(objects),
                                  closes=tuple((s, opened[s].epoch) for s in stream_ids), kv=kv, kv_guard=kv_guard))
    except BaseException:
        for stream_id in stream_ids:
            try:
                meta.close_stream(stream_id, opened[stream_id].epoch, node[0])
            except S3StreamError:
                pass
        raise
    return {"objects": len(objects), "gap_offsets": gaps, "streams": len(stream_ids)}


def _writer_id(opts: _Options) -> str:
    if opts.writer_id:
        return str(opts.writer_id)
    if not opts.checkpoint:
        raise ConfigError("a streaming write to s3stream needs an identity that survives restarts: set "
                          ".option('checkpointLocation', DIR) on the query or .option('writerId', NAME)")
    return hashlib.sha256(str(opts.checkpoint).encode()).hexdigest()[:32]


class BatchWriter(DataSourceArrowWriter):
    """`df.write.format("s3stream")`: each task writes objects; the driver commits them all at once."""

    def __init__(self, options: dict, schema, overwrite: bool) -> None:
        if overwrite:
            raise ConfigError("the s3stream sink appends: use mode('append') (partitions are append-only; trim them "
                              "with a node to drop old records)")
        self.opts = _Options(options)
        self.last_commit: dict = {}

    def write(self, iterator) -> SinkMessage:
        return _write(self.opts, iterator)

    def commit(self, messages) -> None:
        self.last_commit = _commit(self.opts, messages, None, None)

    def abort(self, messages) -> None:
        """Nothing to undo: the tasks' objects were never committed and expire."""


class StreamWriter(DataSourceStreamArrowWriter):
    """`df.writeStream.format("s3stream")`: each micro-batch commits once (module docstring)."""

    def __init__(self, options: dict, schema, overwrite: bool) -> None:
        self.opts = _Options(options)
        self.writer_id = _writer_id(self.opts)

    def write(self, iterator) -> SinkMessage:
        return _write(self.opts, iterator)

    def commit(self, messages, batchId: int) -> None:  # noqa: N803 - Spark's name
        _commit(self.opts, messages, batchId, self.writer_id)

    def abort(self, messages, batchId: int) -> None:  # noqa: N803
        """Nothing to undo: the tasks' objects were never committed and expire."""
