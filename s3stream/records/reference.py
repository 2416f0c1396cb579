"""The pure-Python twin of s3stream.records (Kafka record batches v2): the same encode_batch,
decode_batch and iter_batches, byte for byte and error for error, over the same Record,
ConsumedRecord and DecodedBatch (defined in s3stream.records, imported here).

Slow and plain on purpose: tests compare the native codec (_native/kafkarecords.pyx) with it, and
the records benchmark shows what the native core buys. Only the bytes-level work is its own (the
varints, records, header and decoding checks); argument checks, compression (cramjam) and the
CRC-32C (_native.checksum) are the ones s3stream.records uses. The format is documented there.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator

from _native.checksum import crc32c

from ..errors import InvalidArgumentError, RecordBatchChecksumError, RecordBatchLengthError, UnsupportedCompressionError, \
    UnsupportedMagicError
from . import (
    _CODEC_MASK, _CRC_AT, _CRC_FROM, _LENGTH_END, _MAGIC_AT, _MAX_INT32, _MIN_BATCH_LENGTH, _TIMESTAMP_TYPE_BIT,
    COMPRESSION_CODECS, CREATE_TIME, HEADER_SIZE, LOG_APPEND_TIME, MAGIC, MAX_DECOMPRESSED_BYTES, ConsumedRecord,
    DecodedBatch, Record, as_view, check_limit, compress_payload, decompress_payload, iterate_batches, malformed,
    prepare_batch,
)

__all__ = [
    "COMPRESSION_CODECS", "ConsumedRecord", "DecodedBatch", "LOG_APPEND_TIME", "CREATE_TIME", "MAGIC",
    "MAX_DECOMPRESSED_BYTES", "Record", "decode_batch", "encode_batch", "iter_batches",
]

_HEADER = struct.Struct(">qiibIhiqqqhii")
assert _HEADER.size == HEADER_SIZE
_INT32 = struct.Struct(">i")
_UINT32 = struct.Struct(">I")


# ---- encoding -------------------------------------------------------------------------------

def _put_varint(out: bytearray, value: int) -> None:
    """Append `value` zigzag-encoded as a varint (varlong for int64 values: same encoding)."""
    zigzag = value << 1 if value >= 0 else (-value << 1) - 1
    while zigzag >= 0x80:
        out.append((zigzag & 0x7F) | 0x80)
        zigzag >>= 7
    out.append(zigzag)


def _put_bytes(out: bytearray, data: bytes | None) -> None:
    if data is None:
        out.append(1)  # zigzag(-1)
    else:
        _put_varint(out, len(data))
        out += data


def _encode_record(out: bytearray, record: Record, timestamp_delta: int, offset_delta: int) -> None:
    body = bytearray(b"\x00")  # record attributes: unused, always 0
    _put_varint(body, timestamp_delta)
    _put_varint(body, offset_delta)
    _put_bytes(body, record.key)
    _put_bytes(body, record.value)
    _put_varint(body, len(record.headers))
    for header_key, header_value in record.headers:
        key = header_key.encode("utf-8")
        _put_varint(body, len(key))
        body += key
        _put_bytes(body, header_value)
    _put_varint(out, len(body))
    out += body


def encode_batch(records: Iterable[Record], *, base_offset: int = 0, compression: str | None = None,
                 producer_id: int = -1, producer_epoch: int = -1, base_sequence: int = -1,
                 is_transactional: bool = False, timestamp_type: int = CREATE_TIME,
                 partition_leader_epoch: int = -1, now_ms: int | None = None) -> bytes:
    """records.encode_batch, in Python."""
    records, attributes, now_ms = prepare_batch(records, compression, base_offset, producer_id, producer_epoch,
                                                base_sequence, is_transactional, timestamp_type, partition_leader_epoch,
                                                now_ms)
    timestamps = []
    for record in records:
        if not isinstance(record, Record):
            raise InvalidArgumentError(
                f"records must be s3stream.records.Record instances, got {type(record).__name__} {record!r:.60}")
        timestamps.append(now_ms if record.timestamp is None else record.timestamp)
    base_timestamp = timestamps[0]

    body = bytearray()
    for offset_delta, record in enumerate(records):
        _encode_record(body, record, timestamps[offset_delta] - base_timestamp, offset_delta)
    codec = attributes & _CODEC_MASK
    payload = compress_payload(codec, body) if codec else body

    batch_length = HEADER_SIZE - _LENGTH_END + len(payload)
    if batch_length > _MAX_INT32:
        raise InvalidArgumentError(
            f"the batch would be {batch_length + _LENGTH_END} bytes, over the format's 2 GiB; split the records "
            f"over several batches")
    out = bytearray(HEADER_SIZE)
    _HEADER.pack_into(out, 0, base_offset, batch_length, partition_leader_epoch, MAGIC, 0, attributes,
                      len(records) - 1, base_timestamp, max(timestamps), producer_id, producer_epoch, base_sequence,
                      len(records))
    out += payload
    _UINT32.pack_into(out, _CRC_AT, crc32c(memoryview(out)[_CRC_FROM:]))
    return bytes(out)


# ---- decoding -------------------------------------------------------------------------------

def _read_varint(buf: memoryview, pos: int, end: int, max_bytes: int, batch_at: int) -> tuple[int, int]:
    """(value, next position) of the zigzag varint at `pos`, at most `max_bytes` long (5: int32,
    10: int64), ending before `end`, its value within 32 (64) bits."""
    result = 0
    shift = 0
    limit = min(end, pos + max_bytes)
    while pos < limit:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            if result >> (32 if max_bytes == 5 else 64):
                raise malformed(batch_at, f"a varint's value does not fit {32 if max_bytes == 5 else 64} bits")
            return (result >> 1) ^ -(result & 1), pos
        shift += 7
    if pos >= end:
        raise malformed(batch_at, "a record ends in the middle of a varint")
    raise malformed(batch_at, f"a varint is longer than {max_bytes} bytes")


def _read_nullable_bytes(buf: memoryview, pos: int, end: int, batch_at: int,
                         what: str) -> tuple[bytes | None, int]:
    length, pos = _read_varint(buf, pos, end, 5, batch_at)
    if length < 0:
        if length != -1:
            raise malformed(batch_at, f"{what} length is {length} (only -1, null, may be negative)")
        return None, pos
    if length > end - pos:
        raise malformed(batch_at, f"{what} of {length} bytes runs past its record ({end - pos} bytes left)")
    return bytes(buf[pos:pos + length]), pos + length


def _decode_records(buf: memoryview, pos: int, end: int, count: int, base_offset: int, base_timestamp: int,
                    log_append_time: int | None, batch_at: int) -> list[ConsumedRecord]:
    records: list[ConsumedRecord] = []
    append = records.append
    for _ in range(count):
        if pos >= end:
            raise malformed(batch_at, f"it says {count} records but its records end after {len(records)}")
        length, pos = _read_varint(buf, pos, end, 5, batch_at)
        if length < 0 or length > end - pos:
            raise malformed(batch_at, f"record {len(records)} claims {length} bytes, {end - pos} are left")
        record_end = pos + length
        if pos >= record_end:
            raise malformed(batch_at, f"record {len(records)} is empty")
        pos += 1  # record attributes: unused
        timestamp_delta, pos = _read_varint(buf, pos, record_end, 10, batch_at)
        offset_delta, pos = _read_varint(buf, pos, record_end, 5, batch_at)
        key, pos = _read_nullable_bytes(buf, pos, record_end, batch_at, "a key")
        value, pos = _read_nullable_bytes(buf, pos, record_end, batch_at, "a value")
        header_count, pos = _read_varint(buf, pos, record_end, 5, batch_at)
        if header_count < 0 or header_count > record_end - pos:
            raise malformed(batch_at, f"record {len(records)} claims {header_count} headers in "
                                       f"{record_end - pos} bytes")
        headers = []
        for _ in range(header_count):
            key_length, pos = _read_varint(buf, pos, record_end, 5, batch_at)
            if key_length < 0 or key_length > record_end - pos:
                raise malformed(batch_at, f"a header key of {key_length} bytes does not fit its record "
                                           f"({record_end - pos} bytes left)")
            try:
                header_key = str(buf[pos:pos + key_length], "utf-8")
            except UnicodeDecodeError as e:
                raise malformed(batch_at, f"a header key is not UTF-8 ({e})") from None
            header_value, pos = _read_nullable_bytes(buf, pos + key_length, record_end, batch_at, "a header value")
            headers.append((header_key, header_value))
        if pos != record_end:
            raise malformed(batch_at, f"record {len(records)} says {length} bytes but its fields take "
                                       f"{length - (record_end - pos)}")
        timestamp = base_timestamp + timestamp_delta if log_append_time is None else log_append_time
        append(ConsumedRecord(base_offset + offset_delta, timestamp, key, value, tuple(headers)))
    if pos != end:
        raise malformed(batch_at, f"{end - pos} bytes follow its {count} records")
    return records


def _decode_at(buf: memoryview, at: int, whole: bool, partial_ok: bool, limit: int) -> DecodedBatch | None:
    """The batch starting at byte `at` of `buf`; with `whole`, it must end where `buf` does. With
    `partial_ok`, None if `buf` ends inside it (after checking what its bytes show: its length and
    magic byte). A compressed records section may decompress to `limit` bytes at most."""
    available = len(buf) - at
    if available < _LENGTH_END:
        if partial_ok:
            return None
        raise RecordBatchLengthError(
            f"record batch at byte {at}: the buffer ends after {available} bytes, inside the batch's first 12 "
            f"(baseOffset, batchLength); pass the whole batch (it was truncated)")
    (batch_length,) = _INT32.unpack_from(buf, at + 8)
    if batch_length < _MAGIC_AT + 1 - _LENGTH_END:
        raise RecordBatchLengthError(
            f"record batch at byte {at}: batchLength is {batch_length}, too small for any batch (a v2 batch has "
            f"{_MIN_BATCH_LENGTH} or more); these bytes are not a record batch or its length was damaged")
    end = at + _LENGTH_END + batch_length
    partial = end > len(buf)
    if partial:
        if not partial_ok:
            raise RecordBatchLengthError(
                f"record batch at byte {at}: batchLength {batch_length} says the batch is "
                f"{batch_length + _LENGTH_END} bytes but the buffer holds {available}; the batch was truncated: pass "
                f"all of it")
        if available <= _MAGIC_AT:
            return None
    elif whole and end != len(buf):
        raise RecordBatchLengthError(
            f"record batch at byte {at}: batchLength {batch_length} says the batch is {batch_length + _LENGTH_END} "
            f"bytes but the buffer holds {available}; pass exactly one batch, or several to iter_batches")
    magic = buf[at + _MAGIC_AT]
    if magic != MAGIC:
        raise UnsupportedMagicError(
            f"record batch at byte {at}: magic byte is {magic if magic < 128 else magic - 256}, only 2 (record batch "
            f"v2, Kafka 0.11+) is read; upgrade the producer or have it use message format v2")
    if batch_length < _MIN_BATCH_LENGTH:
        raise RecordBatchLengthError(
            f"record batch at byte {at}: batchLength is {batch_length}, shorter than the v2 header "
            f"({_MIN_BATCH_LENGTH}); its length was damaged: have the producer resend the batch")
    if partial:
        return None
    (base_offset, _, leader_epoch, _, stored_crc, attributes, last_offset_delta, base_timestamp, max_timestamp,
     producer_id, producer_epoch, base_sequence, count) = _HEADER.unpack_from(buf, at)
    actual_crc = crc32c(buf[at + _CRC_FROM:end])
    if actual_crc != stored_crc:
        raise RecordBatchChecksumError(
            f"record batch at byte {at}: CRC-32C of its {end - at - _CRC_FROM} bytes after the CRC is "
            f"{actual_crc:#010x}, the batch says {stored_crc:#010x}; it was damaged after it was written: "
            f"have the producer resend it (or read another copy)")
    codec = attributes & _CODEC_MASK
    if codec >= len(COMPRESSION_CODECS):
        raise UnsupportedCompressionError(
            f"record batch at byte {at}: compression codec id {codec} (attributes {attributes:#06x}) is not one of "
            f"0 none, 1 gzip, 2 snappy, 3 lz4, 4 zstd; have the producer use one of those")
    if count < 0:
        raise malformed(at, f"its record count is {count}")
    log_append_time = max_timestamp if attributes & _TIMESTAMP_TYPE_BIT else None
    if count == 0:  # emptied by compaction, kept for its producer state: Kafka reads no payload
        records = []
    elif codec:
        records_buf = decompress_payload(codec, buf[at + HEADER_SIZE:end], at, limit)
        records = _decode_records(records_buf, 0, len(records_buf), count, base_offset, base_timestamp,
                                  log_append_time, at)
    else:
        records = _decode_records(buf, at + HEADER_SIZE, end, count, base_offset, base_timestamp, log_append_time, at)
    return DecodedBatch(base_offset, batch_length, leader_epoch, stored_crc, attributes, last_offset_delta,
                        base_timestamp, max_timestamp, producer_id, producer_epoch, base_sequence, records)


def decode_batch(buf: bytes | bytearray | memoryview, *,
                 max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> DecodedBatch:
    """records.decode_batch, in Python."""
    return _decode_at(as_view(buf), 0, True, False, check_limit(max_decompressed_bytes))  # type: ignore[return-value]


def iter_batches(buf: bytes | bytearray | memoryview, *, skip_partial_tail: bool = False,
                 max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> Iterator[DecodedBatch]:
    """records.iter_batches, in Python."""
    return iterate_batches(buf, _decode_at, skip_partial_tail, max_decompressed_bytes)
