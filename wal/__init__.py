"""The s3stream write-ahead log: a crash-safe ring of records on a file or raw block device.

Usable on its own; knows nothing about streams or object storage. See `WriteAheadLog` for the
contract and docs/wal-format.md for the on-disk format.
"""
from _native.walring import AppendHandle

from .config import WALConfig
from .errors import (
    ForeignWALError, RecordTooLargeError, WALClosedError, WALConfigError, WALCorruptError, WALError,
    WALFencedError, WALFullError, WALInUseError, WALIOError, WALMidLogCorruptError, WALVersionError,
)
from .log import Record, RecoveryResult, WriteAheadLog, salvage

__all__ = [
    "AppendHandle", "ForeignWALError", "Record", "RecordTooLargeError", "RecoveryResult", "WALClosedError",
    "WALConfig", "WALConfigError", "WALCorruptError", "WALError", "WALFencedError", "WALFullError",
    "WALInUseError", "WALIOError", "WALMidLogCorruptError", "WALVersionError", "WriteAheadLog", "salvage",
]
