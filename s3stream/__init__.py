"""s3stream: append-only streams on object storage behind a write-ahead log.

Start with StreamClient (one per node), Stream, RecordBatch and Config; every error is an
S3StreamError.
"""
from .client import StreamClient
from .config import Config
from .records.consumer import ConsumerGroups, StaleGenerationError
from .errors import (
    AppendFailedError, ConfigError, CorruptDataError, FencedLeaderError, InvalidArgumentError, InvalidBatchError, LeaseExpiredError,
    KVConflictError, MetadataBusyError, MetadataError, NodeConflictError, ObjectNotFoundError, ObjectStoreError, ObjectStorePermanentError,
    OffsetOutOfRangeError, OffsetsLostError, OperationTimeoutError, S3StreamError, StreamClosedError, StreamFencedError, StreamNotClosedError,
    StreamNotFoundError, UnsupportedFormatError, WALCorruptError, WALError, WALFullError, InvalidRecordBatchError,
    RecordBatchChecksumError, RecordBatchLengthError, UnsupportedCompressionError, UnsupportedMagicError,
    DecompressionLimitError, DuplicateSequenceError, NotIdempotentError, OutOfOrderSequenceError, ProducerFencedError,
)
from .records.producers import DuplicateAppend, ProducedBatch, Producer, new_producer
from .reader import StreamReader, open_reader
from .batches import AppendFuture, AppendResult, FetchedBatch, FetchResult, RecordBatch
from .records import ConsumedRecord, Record
from .stream import Stream

__all__ = [
    "AppendFailedError", "AppendFuture", "AppendResult", "Config", "ConfigError", "ConsumerGroups", "CorruptDataError",
    "FencedLeaderError", "FetchResult", "KVConflictError", "FetchedBatch", "InvalidArgumentError", "InvalidBatchError", "LeaseExpiredError", "MetadataBusyError",
    "MetadataError", "NodeConflictError", "ObjectNotFoundError", "ObjectStoreError",
    "ObjectStorePermanentError", "OffsetOutOfRangeError", "OffsetsLostError", "OperationTimeoutError", "RecordBatch",
    "S3StreamError", "StaleGenerationError", "Stream", "StreamClient", "StreamClosedError", "StreamFencedError", "StreamNotClosedError",
    "StreamNotFoundError", "UnsupportedFormatError", "WALCorruptError", "WALError", "WALFullError",
    "Record", "ConsumedRecord", "StreamReader", "open_reader", "InvalidRecordBatchError", "RecordBatchChecksumError", "RecordBatchLengthError",
    "UnsupportedCompressionError", "UnsupportedMagicError", "DecompressionLimitError",
    "Producer", "ProducedBatch", "DuplicateAppend", "new_producer", "OutOfOrderSequenceError", "DuplicateSequenceError",
    "NotIdempotentError", "ProducerFencedError",
]
