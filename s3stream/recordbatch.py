"""RecordBatch, the unit of append and fetch, and the results returned to callers.

RecordBatch and AppendResult are native (the append path takes a batch without a Python-level
call); RecordBatch(payload, count=1) raises InvalidBatchError for a payload that is not
bytes-like or a count outside [1, 2**32).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from _native import appendpath, kafkarecords
from _native.appendpath import AppendFuture, AppendResult, RecordBatch

from .errors import InvalidBatchError, InvalidRecordBatchError, RecordBatchLengthError, UnsupportedMagicError
from .records import MAX_DECOMPRESSED_BYTES, ConsumedRecord, DecodedBatch, Record, decode_batch, encode_records

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


def records_batch(records: Iterable[Record], compression: str | None = None) -> RecordBatch:
    """The RecordBatch that append_records appends: `records` as one Kafka record batch (v2,
    s3stream.records), one offset per record. InvalidArgumentError for bad records or an unknown
    compression (nothing is appended)."""
    return RecordBatch(*encode_records(records, compression))


def encoded_batch(raw: bytes | bytearray | memoryview, *,
                  max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES) -> tuple[RecordBatch, "DecodedBatch"]:
    """A Kafka record batch (v2) built elsewhere (any Kafka client library), checked whole as a
    broker checks it before it is appended: (the RecordBatch to append, one offset per record;
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
    return RecordBatch(data, len(decoded.records)), decoded


@dataclass(frozen=True)
class FetchResult:
    batches: list[FetchedBatch]

    @property
    def end_offset(self) -> int | None:
        return self.batches[-1].end_offset if self.batches else None

    @property
    def total_bytes(self) -> int:
        return sum(len(b.payload) for b in self.batches)
