"""Public exceptions of s3stream, all under S3StreamError. Each message says what was wrong
and what to do. Errors of the layers below (WAL, object stores) are mapped here, once."""
from __future__ import annotations

import wal


class S3StreamError(Exception):
    """Base class of every error s3stream raises on purpose."""


class ConfigError(S3StreamError, ValueError):
    """A configuration or URL that cannot work."""


class StreamNotFoundError(S3StreamError, KeyError):
    """No stream with that id (or it was destroyed)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class StreamNotClosedError(S3StreamError):
    """The stream is open on another node; close it there first, or, if that node is dead, fail
    it over (`s3stream node fail-over NODE`)."""

    @classmethod
    def held(cls, stream_id: int, node_id: int | None, epoch: int) -> "StreamNotClosedError":
        """The error for stream `stream_id` held open by node `node_id` at `epoch`."""
        return cls(f"stream {stream_id} is open on node {node_id} at epoch {epoch}; close it there (its agent does "
                   f"once the partition is assigned elsewhere), or if node {node_id} is dead fail it over: "
                   f"`s3stream node fail-over {node_id}`")


class StreamFencedError(S3StreamError):
    """This holder's epoch is stale: the stream was opened elsewhere with a newer epoch, or this
    node was fenced. The holder stops writing; reopen the stream to continue."""


class StreamClosedError(S3StreamError):
    """The stream handle was closed on this node."""


class OffsetOutOfRangeError(S3StreamError, IndexError):
    """A fetch or trim outside [start_offset, confirm_offset] of the stream."""


class InvalidBatchError(S3StreamError, ValueError):
    """A record batch that cannot be appended (count <= 0, too large, wrong type)."""


class OperationTimeoutError(S3StreamError, TimeoutError):
    """A wait given a timeout ran out (an append's result, a close waiting for uploads). Nothing
    is lost by it: the data stays where it was (the WAL, the log cache) and the wait may be
    repeated. Also a TimeoutError, as concurrent.futures callers expect."""


class InvalidArgumentError(S3StreamError, TypeError, ValueError):
    """An offset, id or size of the wrong type (a float, a bool, a string) or out of its range
    (negative, beyond 2**63 - 1, max_bytes <= 0). Nothing was read or changed."""


#: Offsets and ids are stored as signed 64-bit integers.
MAX_INT64 = (1 << 63) - 1


def check_int(name: str, value, minimum: int = 0, maximum: int = MAX_INT64) -> int:
    """`value` if it is an int (not a bool) in [minimum, maximum]; else InvalidArgumentError
    naming it. Floats are refused even when whole: an offset is a count of records."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(
            f"{name} must be an int, got {value!r} ({type(value).__name__}); pass a whole number of records/bytes, "
            f"e.g. int(...) of a value you computed")
    if not minimum <= value <= maximum:
        raise InvalidArgumentError(f"{name} must be between {minimum} and {maximum}, got {value}")
    return value


class CorruptDataError(S3StreamError):
    """An object or WAL record failed its checksum or format checks; no bytes were returned."""


class UnsupportedFormatError(CorruptDataError):
    """An object written in a format version this build does not read (another release wrote
    it); no bytes were returned."""


class ObjectStoreError(S3StreamError):
    """The object store failed (after retries)."""


class ObjectStorePermanentError(ObjectStoreError):
    """The object store refused in a way that retrying cannot fix (access denied, bad
    credentials, no such bucket, a read-only file system). Uploads stop at once with this error
    instead of retrying forever; what they held stays in the WAL, replayed at the next start."""


class ObjectNotFoundError(ObjectStoreError, KeyError):
    """The object store has no object under that key."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class MetadataError(S3StreamError):
    """A metadata operation failed its preconditions in a way no other error describes."""


class KVConflictError(MetadataError):
    """A commit's `kv_guard` did not hold: the key's value changed since the caller read it
    (another writer committed first). Nothing was committed."""


class MetadataBusyError(MetadataError):
    """The metadata store was busy past its own timeout (SQLite: another connection held the
    write lock past busy_timeout_s). Transient: the uploader retries it with backoff."""


class WALFullError(S3StreamError, wal.WALFullError):
    """The WAL stayed full: uploads are not keeping up or are failing."""


class WALError(S3StreamError):
    """The WAL failed (I/O error, foreign or corrupt WAL); the client stops accepting appends."""


class NodeConflictError(S3StreamError):
    """Another instance of this node id holds (or held) the node with another WAL, and starting
    here would fence it and lose what that WAL holds. The message names both WALs and the fix."""


class OffsetsLostError(S3StreamError):
    """The offsets [start, end) of a stream were given up: the node that held them was forgotten
    with its WAL lost (`s3stream node forget NODE --wal-lost`), and nothing it had not uploaded
    survived. Nothing there can be read; continue at `end`. No record was ever written at those
    offsets by anyone else."""

    def __init__(self, stream_id: int, start: int, end: int, node_id: int | None = None) -> None:
        by = f" with node {node_id}'s lost WAL" if node_id is not None else ""
        super().__init__(f"stream {stream_id}: offsets [{start}, {end}) were given up{by} (`s3stream node forget "
                         f"--wal-lost`); nothing there can be read: continue at offset {end}")
        self.stream_id = stream_id
        self.start = start
        self.end = end


class LeaseExpiredError(S3StreamError):
    """This node's lease ran out (it could not renew it through the metadata store in time), so
    it acknowledges nothing: an append is refused before it takes an offset, and one already
    written waits for a renewal (then it is acknowledged) or for the fence (then it fails). Retry
    the append: it goes through once the lease is renewed, or on the partition's new owner if
    this node was failed over. Nothing acknowledged is lost."""
    retriable = True


class NodeAliveError(MetadataError):
    """A failover's fence was refused: the node heartbeated since its judge saw it silent (it is
    alive, and may hold a fresh lease). Nothing changed; the failover does not happen."""


class FencedLeaderError(S3StreamError):
    """A leader (the balancer's) acted after its lease passed to another: the write was refused,
    nothing changed. The deposed leader stops; the new one plans from the current state."""


class WALCorruptError(WALError):
    """The WAL cannot be recovered as it is: damage in the middle of the log with acknowledged
    records after it (`bad_offset`, `resync_offset`, `end`, `records_after` are set, and the
    message says how to salvage), or a cleanly closed WAL that lost records. Nothing was trimmed."""

    def __init__(self, message: str, *, bad_offset: int | None = None, resync_offset: int | None = None,
                 end: int | None = None, records_after: int | None = None) -> None:
        super().__init__(message)
        self.bad_offset = bad_offset
        self.resync_offset = resync_offset
        self.end = end
        self.records_after = records_after

    @classmethod
    def from_wal(cls, e: wal.WALCorruptError, context: str = "") -> "WALCorruptError":
        return cls(context + str(e), **{k: getattr(e, k, None) for k in
                                        ("bad_offset", "resync_offset", "end", "records_after")})


__all__ = [
    "ConfigError", "CorruptDataError", "FencedLeaderError", "InvalidArgumentError", "InvalidBatchError",
    "LeaseExpiredError", "MetadataBusyError", "MetadataError", "NodeAliveError", "NodeConflictError", "ObjectNotFoundError", "ObjectStoreError",
    "ObjectStorePermanentError", "OffsetOutOfRangeError", "OffsetsLostError", "OperationTimeoutError",
    "DuplicateSequenceError", "NotIdempotentError", "OutOfOrderSequenceError", "ProducerFencedError", "S3StreamError",
    "StreamClosedError", "StreamFencedError", "StreamNotClosedError", "StreamNotFoundError", "WALCorruptError",
    "WALError", "WALFullError",
]


class AppendFailedError(S3StreamError):
    """An append reached the WAL but could not enter the log cache (out of memory): the stream
    takes no more appends on this node. Close it and open it again; the WAL record is recovered
    by the node's restart or failover."""


class InvalidRecordBatchError(InvalidBatchError):
    """A Kafka record batch (s3stream.records) that does not decode: malformed records, a bad
    varint, a payload that does not decompress. Nothing was returned from it.

    An InvalidBatchError rather than a CorruptDataError: these bytes come from a producer (or a
    fetch of Kafka data), not from s3stream's own storage, whose objects and WAL records carry
    checksums of their own; the remedy is to refuse the batch (Kafka's CORRUPT_MESSAGE) and have
    its producer send it again, as for any other batch that cannot be appended. The subclasses
    name the common causes."""


class UnsupportedMagicError(InvalidRecordBatchError):
    """A record batch whose magic byte is not 2: an older message format (magic 0 or 1) or not a
    record batch at all. Only record batch format v2 (Kafka 0.11 and later) is read."""


class RecordBatchChecksumError(InvalidRecordBatchError):
    """A record batch whose CRC-32C (over attributes to the end of the batch) does not match the
    one it carries: it was damaged after its producer wrote it. Have the producer resend it."""


class RecordBatchLengthError(InvalidRecordBatchError):
    """A record batch whose batchLength disagrees with the buffer: the buffer ends before the
    batch does (truncated), the length is too small for a batch header, or bytes follow the
    batch where decode_batch expects exactly one (use iter_batches for several)."""


class UnsupportedCompressionError(InvalidRecordBatchError):
    """A record batch whose attributes name a compression codec other than none, gzip, snappy,
    lz4 and zstd (ids 0-4): written by a newer or broken client. Nothing was decompressed."""


class DecompressionLimitError(InvalidRecordBatchError):
    """A compressed record batch whose records decompress to more than the reader's
    max_decompressed_bytes (s3stream.records.MAX_DECOMPRESSED_BYTES by default): a decompression
    bomb, or a genuine batch bigger than the limit. Found without allocating the expansion; pass
    a larger max_decompressed_bytes to read a genuine one."""


class ProducerFencedError(S3StreamError):
    """An idempotent producer's batch at an epoch older than one the partition has seen from
    the same producer id: a newer incarnation of that producer exists (new_producer(id) made
    it). Nothing was appended; this incarnation must stop (Kafka's INVALID_PRODUCER_EPOCH)."""


class OutOfOrderSequenceError(S3StreamError):
    """An idempotent producer's batch whose sequence neither continues the producer's last one
    on that partition nor repeats one of its recent batches: batches between were lost (their
    appends failed for good) or never sent. Nothing was appended; start a new producer
    (Kafka's OUT_OF_ORDER_SEQUENCE_NUMBER)."""


class NotIdempotentError(InvalidBatchError):
    """An idempotent producer's batch (a ProducedBatch) appended to a stream, which keeps no
    producer sequences: each retry of it would append its records again. Nothing was appended;
    append it to its partition (Partition.append), which takes it once. (Kafka has no
    such write: every produce goes to a partition.)"""


class DuplicateSequenceError(OutOfOrderSequenceError):
    """An idempotent producer's batch whose sequences lie before the next one the partition
    expects from it: the partition took that batch already, too long ago to answer it with its
    offset (it keeps a producer's last 5 batches). Nothing was appended again. The batch is in
    the log: treat it as appended (Kafka's DUPLICATE_SEQUENCE_NUMBER, which its producer counts
    as a success without an offset). An OutOfOrderSequenceError, as such retries were before."""
