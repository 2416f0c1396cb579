"""The s3stream write-ahead log: a crash-safe ring of records on a file or raw block device
(`WriteAheadLog`), or kept as objects on an object store (`ObjectWAL`); `WAL` is the interface
both implement.

Usable on its own; knows nothing about streams. See `WriteAheadLog` for the contract,
wal.objectlog for the WAL of objects, `read_header` to look at a WAL file's header without
opening it, and docs/wal-format.md for both formats.
"""
from _native.walring import AppendHandle

from .config import WALConfig
from .errors import (
    ForeignWALError, RecordTooLargeError, WALClosedError, WALConfigError, WALCorruptError, WALError,
    WALFencedError, WALFullError, WALInUseError, WALIOError, WALMidLogCorruptError, WALVersionError,
)
from .header import Header, SlotState
from .interface import WAL
from .log import Record, RecoveryResult, WriteAheadLog, read_header, salvage
from .objectlog import ObjectWAL, WALStore

__all__ = [
    "AppendHandle", "ForeignWALError", "Header", "Record", "RecordTooLargeError", "RecoveryResult", "SlotState",
    "WALClosedError", "WALConfig", "WALConfigError", "WALCorruptError", "WALError", "WALFencedError", "WALFullError",
    "WALInUseError", "WALIOError", "WALMidLogCorruptError", "WALVersionError", "WriteAheadLog", "read_header",
    "salvage", "WAL", "ObjectWAL", "WALStore",
]
