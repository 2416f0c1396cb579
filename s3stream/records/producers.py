"""Idempotent producers: Kafka's semantics (KIP-98, without transactions) on partitions.

A producer has an id and an epoch, allocated from metadata (`new_producer`), and numbers the
records it sends to each partition: a batch carries its producer id, epoch and the sequence of
its first record in its Kafka record batch header (`Producer.batch` builds it). The partition
(`ProducerTable`, kept by Partition) remembers per producer its epoch, the last sequence it took
and where its last RECENT batches went:

- a batch whose sequences are one of those RECENT is a duplicate, a retry whose first answer
  was lost: it is not appended again, and its answer is the original's offset;
- a batch that continues the last sequence is appended;
- a batch whose sequences come before the last one and is not one of the RECENT was taken
  already, too long ago to be answered with its offset: DuplicateSequenceError (an
  OutOfOrderSequenceError), nothing appended (Kafka's DUPLICATE_SEQUENCE_NUMBER);
- any other sequence is OutOfOrderSequenceError (records were lost between, or the producer
  skipped some), an older epoch ProducerFencedError (a newer incarnation of that id exists);
  a newer epoch starts again at sequence 0.

The table survives moves because it is in the partition's checkpoint (cluster.partition): a
close writes it whole; an open writes it too. While a partition takes producers' batches its
checkpoint says from which log offset the table may be behind (`scan_from`), and an open after
a crash (the last checkpoint is not a close's) rebuilds the table from the batch headers of the
log from there. A partition writes a snapshot when it takes the first producer batch after a
clean snapshot (before that batch, in the same WAL, so the snapshot is durable whenever the
batch is), and again every SNAPSHOT_BYTES of log while producers keep appending, so that the
scan reads at most about that much.
"""
from __future__ import annotations

import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from _native import appendpath
from _native.checksum import crc32c

from ..errors import (DuplicateSequenceError, InvalidArgumentError, NotIdempotentError, OutOfOrderSequenceError,
                      ProducerFencedError)
from ..batches import AppendResult, RecordBatch
from . import Record, encode_records

if TYPE_CHECKING:
    from ..metadata import MetadataStore

#: Batches per producer whose answers a partition keeps for retries (Kafka keeps 5, the most
#: in-flight requests an idempotent producer may have per partition).
RECENT = 5
#: Sequences wrap to 0 after this, as Kafka's do.
MAX_SEQUENCE = 2**31 - 1
#: Producers a partition remembers; the least recently seen is forgotten beyond this (its next
#: batch is taken as from a new producer).
MAX_PRODUCERS = 10_000
#: Log bytes between the producer snapshots of a partition its producers keep appending to: the
#: most an open after a crash reads back to rebuild the table.
SNAPSHOT_BYTES = 32 << 20

_KEY_NEXT = "producers/next-id"
_HEADER = struct.Struct(">qiiBIhiqqqhii")        # Kafka record batch v2 header, 61 bytes


def _producer_key(producer_id: int) -> str:
    return f"producers/{producer_id}"


def _bump(meta: "MetadataStore", key: str, first: int) -> int:
    """Compare-and-set the integer at `key` to one more (`first` if absent); the new value."""
    while True:
        raw = meta.get_kv(key)
        value = first if raw is None else int(raw) + 1
        if meta.replace_kv(key, raw, str(value).encode()):
            return value


class Producer:
    """An idempotent producer (`new_producer`): its id, its epoch and the next sequence for each
    partition. Thread-safe. Build a batch once with `batch` and append it; to retry after a lost
    answer (a timeout, the partition moved), append the same batch again, to the partition's
    owner now: a batch already taken returns the original offset."""

    def __init__(self, producer_id: int, epoch: int) -> None:
        self.producer_id = producer_id
        self.epoch = epoch
        self._next: dict[str, int] = {}
        self._lock = threading.Lock()

    def batch(self, partition: str, records: Iterable[Record], compression: str | None = None) -> "ProducedBatch":
        """`records` as the next batch of this producer to `partition` (sequences taken now)."""
        with self._lock:                # encoded under it: bad records take no sequence
            first = self._next.get(partition, 0)
            payload, count = encode_records(records, compression, (self.producer_id, self.epoch, first))
            self._next[partition] = (first + count) % (MAX_SEQUENCE + 1)
        return ProducedBatch.of(payload, count, partition, self.producer_id, self.epoch, first)

    def __repr__(self) -> str:
        return f"Producer(id={self.producer_id}, epoch={self.epoch})"


class ProducedBatch(RecordBatch):
    """A RecordBatch a Producer built for one partition: a Kafka record batch carrying the
    producer's id, epoch and first sequence. Partition.append takes it idempotently; a stream
    refuses it (NotIdempotentError): it keeps no sequences. Pickled or copied, it stays a
    ProducedBatch, so a batch kept for a retry across a crash is retried idempotently."""
    __slots__ = ("partition", "producer_id", "epoch", "base_sequence")
    partition: str
    producer_id: int
    epoch: int
    base_sequence: int

    @classmethod
    def of(cls, payload: bytes | bytearray | memoryview, count: int, partition: str, producer_id: int, epoch: int,
           base_sequence: int) -> "ProducedBatch":
        batch = cls(payload, count, True)
        batch.partition, batch.producer_id, batch.epoch, batch.base_sequence = (
            partition, producer_id, epoch, base_sequence)
        return batch

    def __reduce__(self) -> tuple:
        # RecordBatch's would make a RecordBatch of it, whose retry a stream takes as new records.
        return (ProducedBatch.of, (self.payload, self.count, self.partition, self.producer_id, self.epoch,
                                   self.base_sequence))

    def __repr__(self) -> str:
        return (f"ProducedBatch(partition={self.partition!r}, producer_id={self.producer_id}, epoch={self.epoch}, "
                f"base_sequence={self.base_sequence}, count={self.count}, payload=<{len(self.payload)} bytes>)")


def _refuse_on_stream(stream: Any, batch: ProducedBatch) -> NotIdempotentError:
    return NotIdempotentError(
        f"stream {stream.stream_id} keeps no producer sequences: appended here, this batch of producer "
        f"{batch.producer_id} (epoch {batch.epoch}, sequence {batch.base_sequence}) would be appended again by each "
        f"retry. Nothing was appended: append it to its partition, s3stream.cluster.open_partition(client, {batch.partition!r})"
        f".append(batch), which takes it once")


# Stream.append is native: it asks this of the RecordBatch subclasses it is given.
appendpath.set_refused_batches((ProducedBatch,), _refuse_on_stream)


def new_producer(metadata: Any, producer_id: int | None = None) -> Producer:
    """A producer with an id allocated from `metadata` (a MetadataStore, or anything with a
    `metadata` attribute: a StreamClient, a reader), at epoch 0; or, given `producer_id`, that
    producer at its next epoch, which fences every older incarnation of it (their batches get
    ProducerFencedError once a partition has seen the new epoch)."""
    meta = getattr(metadata, "metadata", metadata)
    if producer_id is None:
        producer_id = _bump(meta, _KEY_NEXT, 0)
        meta.put_kv(_producer_key(producer_id), b"0")
        return Producer(producer_id, 0)
    if type(producer_id) is not int or producer_id < 0:
        raise InvalidArgumentError(f"producer_id must be an int >= 0 (one new_producer allocated), got {producer_id!r}")
    known = meta.get_kv(_KEY_NEXT)
    if known is None or producer_id > int(known):
        raise InvalidArgumentError(
            f"producer id {producer_id} was never allocated here (the last one is {known and int(known)}): "
            "call new_producer() without an id for a new producer")
    epoch = _bump(meta, _producer_key(producer_id), 0)
    if epoch > 0x7FFF:
        raise InvalidArgumentError(f"producer {producer_id} has used every epoch (32767): allocate a new producer")
    return Producer(producer_id, epoch)


class DuplicateAppend:
    """The answer to a batch a partition had taken already: its original offset. Behaves as a
    completed AppendFuture (done, result, exception, add_done_callback, future, await); its
    callbacks run at once, on the calling thread."""

    def __init__(self, base_offset: int, count: int) -> None:
        self.base_offset = base_offset
        self.count = count
        self.completed_ns = None

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> AppendResult:
        return AppendResult(self.base_offset)

    def exception(self, timeout: float | None = None) -> None:
        return None

    def add_done_callback(self, fn) -> None:
        fn(self)

    def future(self):
        import concurrent.futures
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(AppendResult(self.base_offset))
        return fut

    def __await__(self):
        import asyncio
        return asyncio.wrap_future(self.future()).__await__()

    def __repr__(self) -> str:
        return f"<DuplicateAppend base_offset={self.base_offset} count={self.count}>"


class _State:
    __slots__ = ("epoch", "last_seq", "recent")

    def __init__(self, epoch: int, last_seq: int, recent: deque) -> None:
        self.epoch = epoch
        self.last_seq = last_seq
        self.recent = recent            # deque of (first_seq, last_seq, base_offset, future or None), oldest first


class ProducerTable:
    """What a partition knows of its producers (module docstring). Not thread-safe: the
    partition serialises producers' appends."""

    def __init__(self, limit: int = MAX_PRODUCERS) -> None:
        self._limit = limit
        self._states: OrderedDict[int, _State] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def check(self, producer_id: int, epoch: int, first_seq: int, count: int, partition: str) -> Any:
        """The original answer (a future, or a DuplicateAppend) if this batch was taken already;
        None if it is to be appended; OutOfOrderSequenceError / ProducerFencedError else."""
        state = self._states.get(producer_id)
        if state is None:
            return None                  # a new producer (or one forgotten): any first sequence
        if epoch == state.epoch and first_seq == state.last_seq + 1:
            return None                  # the usual case: the next batch (a recent one starts lower)
        last_seq = (first_seq + count - 1) % (MAX_SEQUENCE + 1)
        if epoch < state.epoch:
            raise ProducerFencedError(
                f"producer {producer_id} epoch {epoch} is fenced on partition {partition!r}: epoch {state.epoch} of it "
                f"appended since; this incarnation must stop (new_producer({producer_id}) makes a newer one)")
        if epoch > state.epoch:
            if first_seq != 0:
                raise OutOfOrderSequenceError(
                    f"producer {producer_id} epoch {epoch} starts partition {partition!r} at sequence {first_seq}: a "
                    f"new epoch starts at sequence 0 (use the Producer that new_producer returned)")
            return None
        for first, last, offset, future in state.recent:
            if first == first_seq and last == last_seq:
                return future if future is not None else DuplicateAppend(offset, count)
        expected = (state.last_seq + 1) % (MAX_SEQUENCE + 1)
        if _before(first_seq, expected) and _before(last_seq, expected):
            # Sequences are taken once and a partition takes them only in order: the batch was
            # taken, before the RECENT whose answers are kept.
            where = f" before offset {state.recent[0][2]}" if state.recent else ""
            raise DuplicateSequenceError(
                f"producer {producer_id} epoch {epoch} sent sequences {first_seq}-{last_seq} to partition "
                f"{partition!r} again: it took them already (it expects {expected} next), too long ago to answer "
                f"with their offset (it keeps a producer's last {RECENT} batches). Nothing was appended again; the "
                f"batch is in the log{where}: count it as appended, and drop it from what you retry")
        if first_seq != expected:
            raise OutOfOrderSequenceError(
                f"producer {producer_id} epoch {epoch} sent sequence {first_seq} to partition {partition!r}, which "
                f"expects {expected} (its last batch ended at {state.last_seq}): batches between were lost or "
                "never sent; nothing was appended. Start a new producer (new_producer) to go on")
        return None

    def record(self, producer_id: int, epoch: int, first_seq: int, count: int, base_offset: int,
               future: Any = None) -> None:
        """A batch appended (or found in the log) at `base_offset`."""
        last_seq = first_seq + count - 1
        if last_seq > MAX_SEQUENCE:
            last_seq -= MAX_SEQUENCE + 1
        states = self._states
        state = states.get(producer_id)
        if state is None or epoch != state.epoch:
            state = states[producer_id] = _State(epoch, last_seq, deque(maxlen=RECENT))
            if len(states) > self._limit:
                states.popitem(last=False)
        else:
            states.move_to_end(producer_id)
        state.last_seq = last_seq
        state.recent.append((first_seq, last_seq, base_offset, future))

    def snapshot(self) -> dict:
        """The table as JSON-able data (futures dropped: what a snapshot holds is durable)."""
        return {str(pid): [s.epoch, s.last_seq, [list(r[:3]) for r in s.recent]] for pid, s in self._states.items()}

    @classmethod
    def restore(cls, data: dict | None, limit: int = MAX_PRODUCERS) -> "ProducerTable":
        table = cls(limit)
        for pid, (epoch, last_seq, recent) in (data or {}).items():
            table._states[int(pid)] = _State(int(epoch), int(last_seq),
                                             deque(((*map(int, r), None) for r in recent), maxlen=RECENT))
        return table

    def replay(self, batches: Iterable[Any]) -> int:
        """Take the producer batches among `batches` (FetchedBatch: base_offset, count, payload)
        into the table; the number taken. A payload that is not a Kafka record batch with a
        producer id and a valid CRC is not a producer's batch and is skipped."""
        taken = 0
        for b in batches:
            header = producer_header(b.payload, b.count)
            if header is not None:
                self.record(header[0], header[1], header[2], b.count, b.base_offset)
                taken += 1
        return taken


def _before(sequence: int, expected: int) -> bool:
    """Whether `sequence` comes before `expected`, sequences wrapping after MAX_SEQUENCE: within
    half their range behind it."""
    behind = (expected - sequence) % (MAX_SEQUENCE + 1)
    return 0 < behind <= (MAX_SEQUENCE + 1) // 2


def producer_header(payload: Any, count: int) -> tuple[int, int, int] | None:
    """(producer id, epoch, base sequence) of a stored batch appended by a producer, else None:
    the payload is a whole Kafka record batch v2 of `count` records, with a producer id and a
    base sequence, and its CRC-32C holds."""
    if len(payload) < _HEADER.size:
        return None
    if type(payload) is not memoryview and (payload[16] != 2 or payload[43] & 0x80):
        # The usual answers, found without unpacking: not a v2 batch (magic), or a batch
        # without a producer (its producerId, at 43, is negative: -1).
        return None
    (_, length, _, magic, crc, _, last_delta, _, _, producer_id, epoch, base_sequence,
     records) = _HEADER.unpack_from(payload, 0)
    if (magic != 2 or length != len(payload) - 12 or producer_id < 0 or base_sequence < 0
            or last_delta != count - 1 or records != count):
        return None
    if crc32c(memoryview(payload)[21:]) != crc:
        return None
    return producer_id, epoch, base_sequence


__all__ = ["DuplicateAppend", "ProducedBatch", "Producer", "ProducerTable", "new_producer", "producer_header"]
