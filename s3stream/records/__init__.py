"""Kafka record batches, format v2 (magic 2): the encoder and decoder.

Not to be confused with `batches.RecordBatch`, the opaque unit s3stream appends: this module
reads and writes the bytes a Kafka producer sends and a Kafka consumer fetches, byte for byte as
Kafka 0.11+ does (the protocol's "Record Batch" section, KIP-98's producer fields).

The room holds Kafka's semantics over streams: this codec (its pure-Python twin: reference.py),
idempotent producers (producers.py) and consumer group offsets (consumer.py). None needs a node.

Batch (big-endian; offsets in bytes)::

     0 baseOffset int64          first record's offset
     8 batchLength int32         bytes after this field (a batch is batchLength + 12 bytes)
    12 partitionLeaderEpoch int32  -1 from producers; the leader stamps it (not under the CRC)
    16 magic int8 = 2
    17 crc uint32                CRC-32C of bytes 21..end (attributes to the end of the batch)
    21 attributes int16          bits 0-2 codec (0 none, 1 gzip, 2 snappy, 3 lz4, 4 zstd),
                                 bit 3 timestamp type (0 CreateTime, 1 LogAppendTime),
                                 bit 4 transactional, bit 5 control, bit 6 delete horizon
    23 lastOffsetDelta int32     offset delta of the last record
    27 baseTimestamp int64       first record's timestamp (ms since the epoch)
    35 maxTimestamp int64        largest record timestamp
    43 producerId int64, 51 producerEpoch int16, 53 baseSequence int32   (-1: none)
    57 recordsCount int32
    61 records                   compressed as one payload when the codec is not none

Record (varints are zigzag, as in protobuf): length varint (bytes after it), attributes int8
(0), timestampDelta varlong, offsetDelta varint, keyLength varint (-1: null) + key,
valueLength varint (-1: null) + value, headerCount varint, then per header a keyLength varint +
UTF-8 key and a valueLength varint (-1: null) + value.

Compression (cramjam, as Kafka's Java client frames it): gzip is a gzip stream; snappy is
xerial-framed on encode ("\\x82SNAPPY\\x00", two int32s, then 32 KiB blocks each as an int32
length and a raw snappy block), and decoding reads xerial or raw snappy; lz4 is an LZ4 frame with
independent 64 KiB blocks and no checksums; zstd is a zstd frame (level 3, Kafka's default).

Decoding never trusts a length: every read is checked against the end of the batch (a cursor
over the buffer), the batchLength against the buffer, the CRC before anything else is parsed,
each record's length against what its fields took, the record count against the payload (no
byte may be left over), varints against their maximal size and their type (5 bytes of an int32
hold at most 32 bits, 10 bytes of an int64 64). A batch of 0 records (compaction keeps such
batches for their producer state) has its payload left unread, as Kafka does. Nor does it trust a
compressed payload: its records may decompress to max_decompressed_bytes at most
(MAX_DECOMPRESSED_BYTES, 64 MiB, by default), found out without allocating more (snappy states its
sizes up front; gzip, lz4 and zstd are decompressed into bounded buffers). It raises
InvalidRecordBatchError or one of its subclasses (UnsupportedMagicError, RecordBatchChecksumError,
RecordBatchLengthError, UnsupportedCompressionError, DecompressionLimitError) and returns nothing
of a bad batch. iter_batches raises at a batch the buffer ends inside (stored bytes were
truncated), unless told to skip it as Kafka's consumers skip the partial last batch of a fetch.
Encoding checks its arguments (types, int ranges, at least one record, the batch under 2 GiB)
and raises InvalidArgumentError naming the value.

The per-record work (varints, keys, values, headers), the 61-byte header and the CRC are native
(_native/kafkarecords.pyx); compression is cramjam's, called from here, so the native core only
sees uncompressed record sections. s3stream/records/reference.py is the pure-Python twin: tests
compare the two byte for byte and error for error, as they do the WAL's and the object codec's.
"""
from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import cramjam

from _native import checksum, kafkarecords

from ..errors import (
    DecompressionLimitError, InvalidArgumentError, InvalidRecordBatchError, RecordBatchChecksumError, RecordBatchLengthError,
    UnsupportedCompressionError, UnsupportedMagicError, check_int,
)

__all__ = [
    "COMPRESSION_CODECS", "ConsumedRecord", "DecodedBatch", "LOG_APPEND_TIME", "CREATE_TIME", "MAGIC",
    "MAX_DECOMPRESSED_BYTES", "Record", "decode_batch", "encode_batch", "encode_gap", "encode_records", "iter_batches",
    "with_base_offset",
]

MAGIC = 2
#: The most a compressed batch's records section may decompress to, by default
#: (max_decompressed_bytes of decode_batch, iter_batches, FetchedBatch.records): 64 MiB. A batch
#: appended here is at most Config.max_batch_bytes (8 MiB by default), a Kafka producer's at most
#: the broker's message.max.bytes (1 MiB by default); 64 MiB is 8x the former, room for text that
#: compresses well, and bounds what a hostile batch of a few KiB can make a reader allocate. (Kafka
#: itself bounds the compressed bytes only, as most of its clients do; newer ones add such a cap:
#: franz-go's MaxDecompressedBatchBytes, the broker's max.decompressed.message.bytes.)
MAX_DECOMPRESSED_BYTES = 64 * 1024 * 1024
#: Timestamp types (attributes bit 3).
CREATE_TIME = 0
LOG_APPEND_TIME = 1
#: Codec names by id (attributes bits 0-2); None is no compression.
COMPRESSION_CODECS: tuple[str | None, ...] = (None, "gzip", "snappy", "lz4", "zstd")

HEADER_SIZE = kafkarecords.HEADER_SIZE  # 61
_LENGTH_END = 12           # baseOffset + batchLength: not counted by batchLength
_MAGIC_AT = 16
_CRC_AT = 17
_CRC_FROM = 21             # the CRC covers attributes to the end
_MIN_BATCH_LENGTH = HEADER_SIZE - _LENGTH_END
_INT32 = struct.Struct(">i")

_CODEC_MASK = 0x07
_TIMESTAMP_TYPE_BIT = 0x08
_TRANSACTIONAL_BIT = 0x10
_CONTROL_BIT = 0x20
_DELETE_HORIZON_BIT = 0x40

_MAX_INT16 = (1 << 15) - 1
_MAX_INT32 = (1 << 31) - 1
_MAX_INT64 = (1 << 63) - 1

_XERIAL_MAGIC = b"\x82SNAPPY\x00"
# Version 1, compatible with version 1, as xerial's SnappyOutputStream (Kafka's Java client) writes.
_XERIAL_HEADER = _XERIAL_MAGIC + struct.pack(">ii", 1, 1)
_XERIAL_BLOCK = 32 * 1024
_ZSTD_LEVEL = 3
# LZ4 frame: magic, FLG 0x60 (version 1, independent blocks, no checksums, no content size), BD
# 0x40 (64 KiB blocks), and the descriptor's checksum (second byte of its xxh32), a constant here.
_LZ4_FRAME_HEADER = b"\x04\x22\x4d\x18\x60\x40\x82"
_LZ4_BLOCK = 64 * 1024
_LZ4_BLOCK_SIZE = struct.Struct("<I")
_LZ4_UNCOMPRESSED = 0x80000000

_BYTES_LIKE = (bytes, bytearray, memoryview)


def _as_bytes(name: str, value: object) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise InvalidArgumentError(
        f"record {name} must be bytes (or bytearray, memoryview) or None, got {type(value).__name__} {value!r:.60}; "
        f"serialise it first, e.g. {name}.encode() for a str")


@dataclass(frozen=True, slots=True)
class Record:
    """A record to encode. `timestamp` is in ms since the epoch; None takes the batch's time of
    encoding. Keys and values are bytes or None (bytearray and memoryview are copied to bytes);
    `headers` are (str key, bytes-or-None value) pairs, a list is kept as a tuple; a mapping
    (`{"h": b"v"}`) is taken as its items, in its order."""
    key: bytes | None = None
    value: bytes | None = None
    timestamp: int | None = None
    headers: tuple[tuple[str, bytes | None], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", _as_bytes("key", self.key))
        object.__setattr__(self, "value", _as_bytes("value", self.value))
        if self.timestamp is not None:
            check_int("record timestamp (ms since the epoch)", self.timestamp, 0, _MAX_INT64)
        headers: tuple[tuple[object, ...], ...] = self.headers
        if isinstance(headers, Mapping):
            # Kafka's headers are an ordered list of pairs that may repeat a key; a mapping's
            # items are such a list, with no key twice (confluent-kafka takes either too).
            headers = tuple(headers.items())
        if type(headers) is not tuple or any(type(h) is not tuple for h in headers):
            try:
                headers = tuple(tuple(h) for h in headers)
            except TypeError:
                raise InvalidArgumentError(
                    f"record headers must be a sequence of (str, bytes or None) pairs, got {self.headers!r:.80}") from None
        checked = []
        for header in headers:
            if len(header) != 2:
                raise InvalidArgumentError(
                    f"a record header must be a (str key, bytes or None value) pair, got {header!r:.80} in headers "
                    f"{self.headers!r:.80}; give them as pairs: headers=[(\"h\", b\"v\")]")
            if not isinstance(header[0], str):
                raise InvalidArgumentError(
                    f"a record header must be a (str key, bytes or None value) pair, got {header!r:.80}; "
                    f"decode a bytes key first (header keys are UTF-8 strings)")
            try:
                header[0].encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidArgumentError(
                    f"record header key {header[0]!r:.80} is not valid UTF-8 text ({e.reason}); header keys are "
                    f"UTF-8 strings: remove lone surrogates") from None
            checked.append((header[0], _as_bytes(f"header {header[0]!r} value", header[1])))
        object.__setattr__(self, "headers", tuple(checked))


class ConsumedRecord(NamedTuple):
    """A decoded record: its absolute offset (the batch's base offset + its offset delta) and
    timestamp (with LogAppendTime, the batch's maxTimestamp, as Kafka's consumers read it)."""
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]


@dataclass(frozen=True)
class DecodedBatch:
    """A decoded batch: its header fields as stored and its records. `size` is the batch's size
    in bytes (batch_length + 12)."""
    base_offset: int
    batch_length: int
    partition_leader_epoch: int
    crc: int
    attributes: int
    last_offset_delta: int
    base_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    records: list[ConsumedRecord]

    @property
    def magic(self) -> int:
        return MAGIC

    @property
    def size(self) -> int:
        return self.batch_length + _LENGTH_END

    @property
    def compression(self) -> str | None:
        return COMPRESSION_CODECS[self.attributes & _CODEC_MASK]

    @property
    def timestamp_type(self) -> int:
        return LOG_APPEND_TIME if self.attributes & _TIMESTAMP_TYPE_BIT else CREATE_TIME

    @property
    def is_transactional(self) -> bool:
        return bool(self.attributes & _TRANSACTIONAL_BIT)

    @property
    def is_control(self) -> bool:
        return bool(self.attributes & _CONTROL_BIT)

    @property
    def has_delete_horizon(self) -> bool:
        """KIP-534: base_timestamp holds the delete horizon a compaction set."""
        return bool(self.attributes & _DELETE_HORIZON_BIT)

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.last_offset_delta

    @property
    def next_offset(self) -> int:
        return self.last_offset + 1


# ---- shared with the pure-Python twin (records.reference) -------------------------------------
# Arguments, compression and the batch-by-batch walk are the same for both codecs; only the
# bytes-level work differs.


def _xerial_snappy(data: bytes | bytearray) -> bytes:
    view = memoryview(data)
    parts = [_XERIAL_HEADER]
    for start in range(0, len(view), _XERIAL_BLOCK):
        block = bytes(cramjam.snappy.compress_raw(view[start:start + _XERIAL_BLOCK]))
        parts.append(_INT32.pack(len(block)))
        parts.append(block)
    return b"".join(parts)


def _lz4_frame(data: bytes | bytearray) -> bytes:
    """An LZ4 frame as Kafka's Java client writes one: independent 64 KiB blocks, no block or
    content checksum, no content size (its reader requires independent blocks)."""
    view = memoryview(data)
    parts = [_LZ4_FRAME_HEADER]
    for start in range(0, len(view), _LZ4_BLOCK):
        chunk = view[start:start + _LZ4_BLOCK]
        block = bytes(cramjam.lz4.compress_block(chunk, store_size=False))
        if len(block) < len(chunk):
            parts += (_LZ4_BLOCK_SIZE.pack(len(block)), block)
        else:  # incompressible: stored as is, flagged by the size's high bit
            parts += (_LZ4_BLOCK_SIZE.pack(len(chunk) | _LZ4_UNCOMPRESSED), bytes(chunk))
    parts.append(_LZ4_BLOCK_SIZE.pack(0))  # end mark
    return b"".join(parts)


def compress_payload(codec: int, data: bytes | bytearray) -> bytes:
    """The records section `data` compressed with codec id `codec` (1-4), framed as Kafka's Java
    client frames it."""
    if codec == 1:
        return bytes(cramjam.gzip.compress(data))
    if codec == 2:
        return _xerial_snappy(data)
    if codec == 3:
        return _lz4_frame(data)
    return bytes(cramjam.zstd.compress(data, level=_ZSTD_LEVEL))


def _codec_id(compression: object) -> int:
    if compression is None:
        return 0
    if isinstance(compression, str) and compression in COMPRESSION_CODECS:
        return COMPRESSION_CODECS.index(compression)
    raise InvalidArgumentError(
        f"compression must be None or one of 'gzip', 'snappy', 'lz4', 'zstd', got {compression!r}")


def _records_and_codec(records: Iterable[Record],
                       compression: str | None) -> tuple[list[Record] | tuple[Record, ...], int]:
    """(records as a list or tuple, the codec id), checked: 1 to 2**31 records, a known codec."""
    records = records if isinstance(records, (list, tuple)) else list(records)
    if not records:
        raise InvalidArgumentError("a record batch needs at least one record; got none (send nothing instead)")
    if len(records) - 1 > _MAX_INT32:
        raise InvalidArgumentError(f"a record batch holds at most {_MAX_INT32 + 1} records, got {len(records)}; split it")
    return records, _codec_id(compression)


def prepare_batch(records: Iterable[Record], compression: str | None, base_offset: int, producer_id: int,
                  producer_epoch: int, base_sequence: int, is_transactional: bool, timestamp_type: int,
                  partition_leader_epoch: int, now_ms: int | None) -> tuple[list[Record] | tuple[Record, ...], int, int]:
    """encode_batch's arguments checked: (records as a list or tuple, the batch's attributes,
    now_ms). The records themselves are checked by the codec, after these."""
    records, codec = _records_and_codec(records, compression)
    check_int("base_offset", base_offset, 0, _MAX_INT64 - (len(records) - 1))
    check_int("producer_id", producer_id, -1, _MAX_INT64)
    check_int("producer_epoch", producer_epoch, -1, _MAX_INT16)
    check_int("base_sequence", base_sequence, -1, _MAX_INT32)
    check_int("partition_leader_epoch", partition_leader_epoch, -1, _MAX_INT32)
    check_int("timestamp_type (0 CreateTime, 1 LogAppendTime)", timestamp_type, CREATE_TIME, LOG_APPEND_TIME)
    if is_transactional and producer_id < 0:
        raise InvalidArgumentError(
            f"a transactional batch needs the producer id of its transaction, got producer_id={producer_id}")
    if now_ms is None:
        now_ms = int(time.time() * 1000)
    else:
        check_int("now_ms", now_ms, 0, _MAX_INT64)
    attributes = codec | (_TIMESTAMP_TYPE_BIT if timestamp_type == LOG_APPEND_TIME else 0)
    attributes |= _TRANSACTIONAL_BIT if is_transactional else 0
    return records, attributes, now_ms


def malformed(batch_at: int, what: str) -> InvalidRecordBatchError:
    """The error of a batch at byte `batch_at` whose CRC matched but whose contents do not
    decode: `what` says why."""
    return InvalidRecordBatchError(
        f"record batch at byte {batch_at}: {what}; its CRC matched, so its producer wrote it so: refuse the batch "
        f"and fix or replace that producer")


def _too_large(batch_at: int, name: str | None, payload: memoryview, size: int | None, limit: int) -> DecompressionLimitError:
    grows = f"to {size} bytes" if size is not None else f"to more than {limit} bytes"
    return DecompressionLimitError(
        f"record batch at byte {batch_at}: its {name} payload of {len(payload)} bytes decompresses {grows}, over "
        f"max_decompressed_bytes={limit}; nothing past the limit was decompressed. If the batch is genuine, pass a "
        f"larger max_decompressed_bytes (decode_batch, iter_batches, FetchedBatch.records); if not, refuse it: its "
        f"producer sent a decompression bomb")


def _unsnappy(payload: memoryview, batch_at: int, limit: int) -> bytearray | cramjam.Buffer:
    """A snappy payload, raw or xerial-framed: each raw block states its length up front, so
    the total is known (and refused over `limit`) before anything is allocated or decompressed."""
    if not (payload[:len(_XERIAL_MAGIC)] == _XERIAL_MAGIC and len(payload) >= len(_XERIAL_HEADER)):
        size = cramjam.snappy.decompress_raw_len(payload)
        if size > limit:
            raise _too_large(batch_at, "snappy", payload, size, limit)
        return cramjam.snappy.decompress_raw(payload)
    blocks = []
    size = 0
    pos, end = len(_XERIAL_HEADER), len(payload)
    while pos < end:
        if end - pos < 4:
            raise malformed(batch_at, f"the xerial snappy payload ends inside a block length ({end - pos} bytes left)")
        (length,) = _INT32.unpack_from(payload, pos)
        pos += 4
        if length < 0 or length > end - pos:
            raise malformed(batch_at, f"a xerial snappy block of {length} bytes does not fit the payload "
                                       f"({end - pos} bytes left)")
        block = payload[pos:pos + length]
        block_size = cramjam.snappy.decompress_raw_len(block)
        blocks.append((block, size, block_size))
        size += block_size
        pos += length
    if size > limit:
        raise _too_large(batch_at, "snappy", payload, size, limit)
    out = bytearray(size)
    view = memoryview(out)
    for block, at, block_size in blocks:
        if cramjam.snappy.decompress_raw_into(block, view[at:at + block_size]) != block_size:
            raise malformed(batch_at, f"a xerial snappy block decompresses to fewer bytes than the {block_size} it "
                                       f"states")
    return out


# What cramjam's decompress_into raises when the output buffer is full and the payload has more
# (Rust's io::ErrorKind::WriteZero): the buffer was too small, the payload is not malformed.
# test_records' decompression bombs pin it: were it reworded, they would fail.
_OUTPUT_FULL = "failed to write whole buffer"
_DECOMPRESS_INTO = {1: cramjam.gzip.decompress_into, 3: cramjam.lz4.decompress_into, 4: cramjam.zstd.decompress_into}
_FIRST_OUTPUT = 64 * 1024     # the first output buffer when the payload states no size: 64 KiB ...
_FIRST_RATIO = 4              # ... or 4x the payload (text compresses 3-10x); then 4x more each try
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _stated_size(codec: int, payload: memoryview) -> int | None:
    """The decompressed size the payload states, where its format carries one (untrusted: a
    first guess): gzip's ISIZE trailer (mod 2**32), a zstd frame's content size."""
    if codec == 1 and len(payload) >= 18:
        return int.from_bytes(payload[-4:], "little")
    if codec == 4 and len(payload) >= 6 and payload[:4] == _ZSTD_MAGIC:
        descriptor = payload[4]
        single_segment = descriptor >> 5 & 1
        size_bytes = (1 if single_segment else 0, 2, 4, 8)[descriptor >> 6]
        at = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[descriptor & 3]
        if size_bytes and len(payload) >= at + size_bytes:
            return int.from_bytes(payload[at:at + size_bytes], "little") + (256 if size_bytes == 2 else 0)
    return None


def _decompress_bounded(codec: int, payload: memoryview, batch_at: int, limit: int) -> memoryview:
    """gzip, lz4 or zstd: decompressed into buffers of bounded size, a larger one each time one
    fills, up to `limit` + 1 bytes; filling that one means the payload expands past the limit.
    Memory stays within about `limit`, whatever the payload claims; the work wasted on the
    smaller tries is at most a third of the last one's."""
    decompress_into = _DECOMPRESS_INTO[codec]
    stated = _stated_size(codec, payload)
    size = stated if stated is not None else max(_FIRST_OUTPUT, _FIRST_RATIO * len(payload))
    size = min(max(size, 1), limit + 1)
    while True:
        out = bytearray(size)
        try:
            got = decompress_into(payload, out)
        except cramjam.DecompressionError as e:
            if str(e) != _OUTPUT_FULL:
                raise
            if size > limit:
                raise _too_large(batch_at, COMPRESSION_CODECS[codec], payload, None, limit) from None
            size = min(max(size * _FIRST_RATIO, _FIRST_OUTPUT), limit + 1)
            continue
        if got > limit:
            raise _too_large(batch_at, COMPRESSION_CODECS[codec], payload, None, limit)
        return memoryview(out)[:got]


def decompress_payload(codec: int, payload: memoryview, batch_at: int, limit: int) -> memoryview:
    """The records section of a batch at byte `batch_at` whose payload, compressed with codec id
    `codec` (1-4), is `payload`; InvalidRecordBatchError if it does not decompress, and
    DecompressionLimitError if it decompresses to more than `limit` bytes (found without
    allocating more than about `limit`)."""
    try:
        if codec == 2:
            return memoryview(_unsnappy(payload, batch_at, limit)).cast("B")
        return _decompress_bounded(codec, payload, batch_at, limit)
    except cramjam.DecompressionError as e:
        raise malformed(batch_at, f"its {COMPRESSION_CODECS[codec]} payload ({len(payload)} bytes) does not "
                                  f"decompress ({e})") from e


def as_view(buf: bytes | bytearray | memoryview) -> memoryview:
    """`buf` as a flat memoryview of bytes; InvalidArgumentError if it is not bytes-like."""
    if not isinstance(buf, _BYTES_LIKE):
        raise InvalidArgumentError(f"a record batch is bytes, bytearray or memoryview, got {type(buf).__name__}")
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def check_limit(max_decompressed_bytes: int) -> int:
    """max_decompressed_bytes, checked: an int of 1 or more."""
    return check_int("max_decompressed_bytes", max_decompressed_bytes, 1, _MAX_INT64 - 1)


DecodeAt = Callable[[memoryview, int, bool, bool, int], "DecodedBatch | None"]


def iterate_batches(buf: bytes | bytearray | memoryview, decode_at: DecodeAt, skip_partial_tail: bool,
                    max_decompressed_bytes: int) -> Iterator[DecodedBatch]:
    """iter_batches over `decode_at(view, at, whole, partial_ok, limit)`, the batch at byte `at`
    of `view`, or None if `partial_ok` and the view ends inside it."""
    view = as_view(buf)
    check_limit(max_decompressed_bytes)
    at = 0
    while at < len(view):
        batch = decode_at(view, at, False, skip_partial_tail, max_decompressed_bytes)
        if batch is None:
            if at == 0:
                raise _no_whole_batch(view)
            return
        yield batch
        at += batch.size


def _no_whole_batch(view: memoryview) -> RecordBatchLengthError:
    """The error of a buffer that ends inside its first batch, with skip_partial_tail: as a Kafka
    consumer does, for a fetch that returned part of one batch and nothing else cannot progress."""
    if len(view) < _LENGTH_END:
        size = "its batchLength is not even in them"
    else:
        size = f"batchLength says it is {_INT32.unpack_from(view, 8)[0] + _LENGTH_END} bytes"
    return RecordBatchLengthError(
        f"record batch at byte 0: the buffer's {len(view)} bytes end inside its first batch ({size}), so there is "
        f"no whole batch to read; fetch again with a max_bytes of at least the batch's size")


# ---- the native codec -----------------------------------------------------------------------

kafkarecords.set_record_types(record=Record, consumed=ConsumedRecord)
kafkarecords.set_error_types(invalid_argument=InvalidArgumentError, invalid=InvalidRecordBatchError,
                             magic=UnsupportedMagicError, checksum=RecordBatchChecksumError,
                             length=RecordBatchLengthError, compression=UnsupportedCompressionError)


def encode_batch(records: Iterable[Record], *, base_offset: int = 0, compression: str | None = None,
                 producer_id: int = -1, producer_epoch: int = -1, base_sequence: int = -1,
                 is_transactional: bool = False, timestamp_type: int = CREATE_TIME,
                 partition_leader_epoch: int = -1, now_ms: int | None = None) -> bytes:
    """One record batch (magic 2) of `records`, at offsets base_offset, base_offset + 1, ...

    Records without a timestamp take `now_ms` (default: the wall clock at this call). The
    batch's baseTimestamp is the first record's timestamp, maxTimestamp the largest. With a
    `compression` ("gzip", "snappy", "lz4", "zstd") the records are compressed as one payload,
    even when that does not make them smaller. Raises InvalidArgumentError for an empty batch,
    a record that is not a Record, a value out of its field's range, or a batch of 2 GiB or more."""
    records, attributes, now_ms = prepare_batch(records, compression, base_offset, producer_id, producer_epoch,
                                                base_sequence, is_transactional, timestamp_type, partition_leader_epoch,
                                                now_ms)
    return kafkarecords.encode_batch(records, now_ms, base_offset, attributes, partition_leader_epoch, producer_id,
                                     producer_epoch, base_sequence, compress_payload)


def encode_records(records: Iterable[Record], compression: str | None = None,
                   producer: tuple[int, int, int] = (-1, -1, -1)) -> tuple[bytes, int]:
    """(batch, number of records): encode_batch(records, compression=compression) with every
    other field at its default (base offset 0, no producer, CreateTime, the wall clock for records
    without a timestamp), which need no checking: the batch append_records appends. `producer`:
    (producer id, epoch, base sequence), already checked by the caller (a Producer). The same
    errors as encode_batch for bad records or an unknown compression."""
    records, codec = _records_and_codec(records, compression)
    return kafkarecords.encode_batch(records, int(time.time() * 1000), 0, codec, -1, *producer,
                                     compress_payload), len(records)


def encode_gap(count: int, now_ms: int | None = None, base_offset: int = 0) -> bytes:
    """A batch of no records over `count` offsets (lastOffsetDelta count - 1), as Kafka's
    compaction leaves one: it takes offsets and yields no record when read. The Spark sink
    (pyspark_s3stream.sink) commits one over offsets a failed task had reserved and never wrote,
    at `base_offset` (written into the batch, as the append path writes it: with_base_offset)."""
    check_int("count", count)
    check_int("base_offset", base_offset)
    if not 0 < count <= 0x7FFFFFFF:
        raise InvalidArgumentError(f"a gap covers 1 to 2**31 - 1 offsets, got {count}")
    now = int(time.time() * 1000) if now_ms is None else now_ms
    tail = struct.pack(">hiqqqhii", 0, count - 1, now, now, -1, -1, -1, 0)
    crc = checksum.crc32c(tail)
    return struct.pack(">qiibI", base_offset, len(tail) + 9, -1, MAGIC, crc) + tail


_BASE_OFFSET = struct.Struct(">q")


def with_base_offset(batch: bytes | bytearray | memoryview, base_offset: int) -> bytes:
    """`batch` (a Kafka record batch) with its baseOffset (its first 8 bytes, outside the CRC,
    which stays valid) set to `base_offset`, as a broker sets it when it appends the batch. The
    append path does so itself for the batches it knows are Kafka batches (RecordBatch.kafka);
    this is for writers of objects that bypass it (the Spark sink), which know the offsets only
    once reserved. InvalidArgumentError for a buffer too short for a batch header."""
    check_int("base_offset", base_offset)
    if len(batch) < HEADER_SIZE:
        raise InvalidArgumentError(
            f"a record batch is at least {HEADER_SIZE} bytes, got {len(batch)}: pass a whole batch")
    return _BASE_OFFSET.pack(base_offset) + bytes(memoryview(batch)[8:])


def _decode_at(view: memoryview, at: int, whole: bool, partial_ok: bool, limit: int) -> DecodedBatch | None:
    fields = kafkarecords.decode_batch(view, at, whole, partial_ok, decompress_payload, limit)
    return None if fields is None else DecodedBatch(*fields)


def decode_batch(buf: bytes | bytearray | memoryview, *,
                 max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> DecodedBatch:
    """The one record batch that `buf` holds, checked (see the module docstring); raises
    InvalidRecordBatchError or a subclass of it if it is malformed, RecordBatchLengthError if
    bytes follow it (iter_batches reads several), and DecompressionLimitError if its compressed
    records decompress to more than `max_decompressed_bytes` (found without allocating them)."""
    return _decode_at(as_view(buf), 0, True, False, check_limit(max_decompressed_bytes))  # type: ignore[return-value]


def iter_batches(buf: bytes | bytearray | memoryview, *, skip_partial_tail: bool = False,
                 max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> Iterator[DecodedBatch]:
    """Every batch of `buf`, batches back to back, in order; each decoded as decode_batch does.
    A bad batch raises when it is reached (the ones before it were yielded).

    A buffer that ends inside a batch raises RecordBatchLengthError there: bytes stored whole (a
    stream's payloads, a file) that end so were truncated. With `skip_partial_tail`, for the
    records of a Kafka fetch response (which a broker cuts at the fetch's max bytes, mid-batch),
    the partial last batch is skipped as a Kafka consumer skips it: iteration ends after the last
    whole batch; fetch again from its next_offset. What the partial batch's bytes do show is still
    checked (a batchLength too small for any batch, a magic byte other than 2), and a buffer that
    holds no whole batch at all raises RecordBatchLengthError naming the size to fetch (as Kafka's
    consumer fails a fetch that cannot progress)."""
    return iterate_batches(buf, _decode_at, skip_partial_tail, max_decompressed_bytes)
