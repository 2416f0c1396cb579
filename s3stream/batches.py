"""RecordBatch, the unit of append and fetch, and the results returned to callers.

RecordBatch and AppendResult are native (the append path takes a batch without a Python-level
call); RecordBatch(payload, count=1) raises InvalidBatchError for a payload that is not
bytes-like or a count outside [1, 2**32).
"""
from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from _native import appendpath, kafkarecords
from _native.appendpath import AppendFuture, AppendResult, RecordBatch

from .errors import InvalidBatchError, InvalidRecordBatchError, RecordBatchLengthError, UnsupportedMagicError
from .records import HEADER_SIZE, MAX_DECOMPRESSED_BYTES, ConsumedRecord, DecodedBatch, Record, decode_batch, encode_records

appendpath.set_error_types(invalid_batch=InvalidBatchError)

__all__ = ["AppendFuture", "AppendResult", "FetchResult", "FetchedBatch", "RecordBatch", "encoded_batch", "records_batch"]


class FetchedBatch(NamedTuple):
    """A batch as stored and returned by fetch: records [base_offset, base_offset + count).

    `payload` is a read-only memoryview (compare it with bytes, hash it, or bytes() it): a slice
    of the buffer the fetch read, no copy. It keeps that buffer (one GET or one log-cache read)
    alive; copy it with bytes(payload) to keep a small payload for long."""
    base_offset: int
    # The field shadows tuple.count (mypy flags any such field); batch.count is the record count.
    count: int  # type: ignore[assignment]
    payload: memoryview

    @property
    def end_offset(self) -> int:
        return self.base_offset + self.count

    def as_record_batch(self) -> RecordBatch:
        """The RecordBatch that appends this batch again, to another stream (a mirror's copy): a
        Kafka record batch stored with its base offset (RecordBatch.kafka: its header's
        baseOffset is this batch's) stays one, so that its copy carries the offset it gets there;
        any other payload is copied byte for byte. (A Kafka batch stored before base offsets were
        written, with baseOffset 0, is copied as bytes, as it was stored: records() shifts it.)"""
        return RecordBatch(self.payload, self.count, _stored_as_kafka(self.payload, self.base_offset, self.count))

    def records(self, *, max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> Iterator[ConsumedRecord]:
        """The records of a batch appended with append_records (a Kafka record batch, v2), each
        with its offset in the stream: base_offset, base_offset + 1, ... InvalidRecordBatchError
        (or a subclass naming the cause) if the payload is not such a batch, or holds another
        number of records than the batch was appended with; DecompressionLimitError if its
        compressed records decompress to more than `max_decompressed_bytes`. A gap
        (records.encode_gap: no records over its offsets) yields nothing."""
        try:
            decoded = decode_batch(self.payload, max_decompressed_bytes=max_decompressed_bytes)
        except (RecordBatchLengthError, UnsupportedMagicError) as e:
            # Stored payloads are whole: a length that does not fit them is no cut batch.
            raise kafkarecords.not_a_record_batch(e, self.base_offset, self.count, len(self.payload)) from None
        if len(decoded.records) not in (0, self.count) or decoded.last_offset_delta != self.count - 1:
            raise InvalidRecordBatchError(
                f"the batch at offset {self.base_offset} was appended as {self.count} records, but its payload is a "
                f"record batch of {len(decoded.records)} (last offset delta {decoded.last_offset_delta}): it was not "
                f"appended with append_records; read it as bytes (payload)")
        shift = self.base_offset - decoded.base_offset
        for record in decoded.records:
            yield record._replace(offset=record.offset + shift)


_STORED_HEADER = struct.Struct(">qi4xbxxxxxxi")     # baseOffset, batchLength, magic, lastOffsetDelta


def _stored_as_kafka(payload: memoryview | bytes, base_offset: int, count: int) -> bool:
    """Whether a stored payload is a Kafka record batch the append path wrote its base offset
    into: its header gives its size, magic 2, `count` offsets and `base_offset`. No other
    payload matches all of them but by a coincidence of 16 bytes."""
    if len(payload) < HEADER_SIZE:
        return False
    stored_base, batch_length, magic, last_delta = _STORED_HEADER.unpack_from(payload, 0)
    return (stored_base == base_offset and batch_length == len(payload) - 12 and magic == 2
            and last_delta == count - 1)


def records_batch(records: Iterable[Record], compression: str | None = None) -> RecordBatch:
    """The RecordBatch that append_records appends: `records` as one Kafka record batch (v2,
    s3stream.records), one offset per record, stored with its base offset (RecordBatch.kafka).
    InvalidArgumentError for bad records or an unknown compression (nothing is appended)."""
    payload, count = encode_records(records, compression)
    return RecordBatch(payload, count, True)


def encoded_batch(raw: bytes | bytearray | memoryview, *,
                  max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> tuple[RecordBatch, "DecodedBatch"]:
    """A Kafka record batch (v2) built elsewhere (any Kafka client library), checked whole as a
    broker checks it before it is appended: (the RecordBatch to append, one offset per record,
    stored with its base offset as a broker stores it (RecordBatch.kafka);
    the decoded batch, whose producer fields say whether an idempotent producer sent it).
    InvalidRecordBatchError or a subclass naming the cause (magic, CRC, length, codec, size) for
    a batch that does not decode; InvalidRecordBatchError for one whose records are not dense
    (a compacted batch) or that is transactional or a control batch (no transactions here)."""
    data = bytes(raw)
    decoded = decode_batch(data, max_decompressed_bytes=max_decompressed_bytes)
    if decoded.is_transactional or decoded.is_control:
        raise InvalidRecordBatchError(
            f"this record batch is {'a control batch' if decoded.is_control else 'transactional'}: s3stream has no "
            "transactions; send it with an idempotent (not transactional) producer")
    if len(decoded.records) != decoded.last_offset_delta + 1:
        raise InvalidRecordBatchError(
            f"this record batch holds {len(decoded.records)} records over offset deltas 0..{decoded.last_offset_delta}: "
            "appended batches must number their records densely (it was compacted); re-encode its records")
    return RecordBatch(data, len(decoded.records), True), decoded


@dataclass(frozen=True)
class FetchResult:
    batches: list[FetchedBatch]

    @property
    def end_offset(self) -> int | None:
        return self.batches[-1].end_offset if self.batches else None

    @property
    def total_bytes(self) -> int:
        return sum(len(b.payload) for b in self.batches)
