"""Partitions: a named group of streams with a meta stream holding its checkpoint (article 000).

A partition name maps through KV (`partition/<name>`) to its meta stream. Every record of the
meta stream is a full JSON snapshot: the data stream ids by role, the leader epoch, the
clean-shutdown flag and the data streams' start offsets. Opening a partition opens the meta
stream (epoch + 1), reads its last snapshot, opens the data streams and appends a snapshot with
leader epoch + 1 and clean = false; closing closes the data streams (force upload of their tails
only), appends a clean snapshot and closes the meta stream. Nothing here depends on the size of a
stream's history: the move of a partition costs its un-uploaded tail.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import S3StreamError, StreamClosedError, StreamFencedError, StreamNotFoundError
from .loadreport import SAMPLE_EVERY, TrafficMeter
from .recordbatch import AppendFuture, FetchResult, RecordBatch

if TYPE_CHECKING:
    from .client import StreamClient
    from .stream import Stream

#: Roles of a partition's data streams; "log" carries the records.
DATA_ROLES = ("log",)


class PartitionMovedError(S3StreamError):
    """The partition is closing or closed on this node (it is moving): retry the append on its
    new owner. Nothing acknowledged before this error is lost."""
    retriable = True

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.partition = name


@dataclass
class Checkpoint:
    streams: dict[str, int]
    leader_epoch: int = 0
    clean: bool = True
    start_offsets: dict[str, int] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(dict(streams=self.streams, leader_epoch=self.leader_epoch, clean=self.clean,
                               start_offsets=self.start_offsets), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> "Checkpoint":
        d = json.loads(bytes(raw))
        return cls(streams={k: int(v) for k, v in d["streams"].items()}, leader_epoch=d["leader_epoch"],
                   clean=d["clean"], start_offsets={k: int(v) for k, v in d.get("start_offsets", {}).items()})


def _kv_key(name: str) -> str:
    return f"partition/{name}"


@dataclass
class CloseReport:
    """What closing a partition cost: the un-uploaded tail it forced up, and how long."""
    tail_bytes: int
    seconds: float


class Partition:
    """A partition open on one node. `append`/`fetch` go to its log stream."""

    def __init__(self, client: "StreamClient", name: str, meta: "Stream", streams: dict[str, "Stream"],
                 checkpoint: Checkpoint) -> None:
        self._client = client
        self.name = name
        self.meta_stream = meta
        self.streams = streams
        self.checkpoint = checkpoint
        self._closing = False
        self._lock = threading.Lock()
        self.meter = TrafficMeter()      # traffic here, for the node's load reports

    @property
    def leader_epoch(self) -> int:
        return self.checkpoint.leader_epoch

    @property
    def log(self) -> "Stream":
        return self.streams["log"]

    @property
    def is_open(self) -> bool:
        return not self._closing

    def append(self, batch: RecordBatch) -> AppendFuture:
        if self._closing:
            raise PartitionMovedError(self.name, f"partition {self.name!r} is closing on node "
                                                 f"{self._client.node_id}: retry on its new owner")
        m = self.meter
        sample = m.appends % SAMPLE_EVERY == 0
        submitted = time.monotonic_ns() if sample else 0
        try:
            future = self.log.append(batch)
        except (StreamClosedError, StreamFencedError) as e:
            raise PartitionMovedError(self.name, f"partition {self.name!r} moved away from node "
                                                 f"{self._client.node_id}: {e}") from e
        m.appends += 1
        m.bytes_in += len(batch.payload)
        if sample:
            m.append_samples.append((submitted, future))
        return future

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

    def close(self) -> CloseReport:
        """Stop appends, force-upload the data streams' tails, checkpoint clean, close."""
        t0 = time.perf_counter()
        with self._lock:
            if self._closing:
                return CloseReport(0, 0.0)
            self._closing = True
        # The clean checkpoint goes into the meta stream first, so that one force upload carries
        # the data streams' tails and the checkpoint together.
        for s in self.streams.values():
            s._wait_confirmed(s.next_offset, None)
        tail = sum(self._client._unuploaded_bytes(s) for s in self.streams.values())
        done = Checkpoint(self.checkpoint.streams, self.checkpoint.leader_epoch, True,
                          {role: s.start_offset for role, s in self.streams.items()})
        _write_checkpoint(self.meta_stream, done)
        self._client.close_streams([*self.streams.values(), self.meta_stream])
        self.checkpoint = done
        self._client._forget_partition(self)
        return CloseReport(tail, time.perf_counter() - t0)


class PartitionReader:
    """A partition's committed records, read without opening it (StreamClient.read_partition).

    The meta stream's last committed checkpoint names the log stream; `start_offset` and
    `end_offset` are the log's committed range, read from metadata at each call (the owner
    keeps appending and uploading). A partition created moments ago whose first checkpoint is
    still in its owner's WAL is not readable yet (StreamNotFoundError says so)."""

    def __init__(self, client: "StreamClient", name: str) -> None:
        self._client = client
        self.name = name
        raw = client._meta.get_kv(_kv_key(name))
        if raw is None:
            raise StreamNotFoundError(f"there is no partition {name!r} (no KV key {_kv_key(name)!r})")
        self.meta_stream_id = int(raw)
        meta = client._meta.get_stream(self.meta_stream_id)
        if meta.end_offset == meta.start_offset:
            raise StreamNotFoundError(
                f"partition {name!r} has no committed checkpoint yet (its owner has not uploaded it): "
                "retry after the owner's next upload")
        res = client.fetch_committed(self.meta_stream_id, meta.end_offset - 1, meta.end_offset)
        self.checkpoint = Checkpoint.decode(res.batches[-1].payload)
        self.log_stream_id = self.checkpoint.streams["log"]

    @property
    def start_offset(self) -> int:
        return self._client._meta.get_stream(self.log_stream_id).start_offset

    @property
    def end_offset(self) -> int:
        """The log's committed end (records below it are readable here)."""
        return self._client._meta.get_stream(self.log_stream_id).end_offset

    def fetch(self, start_offset: int, end_offset: int | None = None, max_bytes: int = 1 << 20) -> FetchResult:
        return self._client.fetch_committed(self.log_stream_id, start_offset, end_offset, max_bytes)


def open_partition(client: "StreamClient", name: str) -> Partition:
    """Create the partition if it is new, else open it on this node (see module docstring)."""
    if not name or "/" in name:
        raise ValueError(f"partition names must be non-empty and contain no '/', got {name!r}")
    meta_kv = client._meta.get_kv(_kv_key(name))
    if meta_kv is None:
        # Create a meta stream and race to publish it; the loser destroys its own.
        candidate = client.create_stream()
        winner = int(client._meta.put_kv_if_absent(_kv_key(name), str(candidate.stream_id).encode()))
        if winner == candidate.stream_id:
            meta = candidate
        else:
            candidate.destroy()
            meta = client.open_stream(winner)
    else:
        meta = client.open_stream(int(meta_kv))
    try:
        checkpoint = _last_checkpoint(meta)
        if checkpoint is None:
            checkpoint = Checkpoint({role: client.create_stream().stream_id for role in DATA_ROLES})
            streams = {role: client._stream(sid) for role, sid in checkpoint.streams.items()}
        else:
            streams = {role: client.open_stream(sid) for role, sid in checkpoint.streams.items()}
        opened = Checkpoint(checkpoint.streams, checkpoint.leader_epoch + 1, False,
                            {role: s.start_offset for role, s in streams.items()})
        _write_checkpoint(meta, opened)
    except BaseException:
        meta.close()
        raise
    partition = Partition(client, name, meta, streams, opened)
    client._remember_partition(partition)
    return partition


def _write_checkpoint(meta: "Stream", checkpoint: Checkpoint) -> None:
    """Append a snapshot and trim the older ones: the meta stream holds one record."""
    base = meta.append(RecordBatch(checkpoint.encode(), 1)).result().base_offset
    meta.trim(base)


def _last_checkpoint(meta: "Stream") -> Checkpoint | None:
    if meta.confirm_offset == meta.start_offset:
        return None
    res = meta.fetch(meta.confirm_offset - 1, meta.confirm_offset)
    return Checkpoint.decode(res.batches[-1].payload)
