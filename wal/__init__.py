"""The s3stream write-ahead log: a crash-safe ring of records on a file or raw block device.

Usable on its own; knows nothing about streams or object storage. See `WriteAheadLog` for the
contract, `read_header` to look at a WAL's header without opening it, and docs/wal-format.md
for the on-disk format.
"""
from _native.walring import AppendHandle

from .config import WALConfig
from .errors import (
    ForeignWALError, RecordTooLargeError, WALClosedError, WALConfigError, WALCorruptError, WALError,
    WALFencedError, WALFullError, WALInUseError, WALIOError, WALMidLogCorruptError, WALVersionError,
)
from .header import Header, SlotState
from .log import Record, RecoveryResult, WriteAheadLog, read_header, salvage

__all__ = [
    "AppendHandle", "ForeignWALError", "Header", "Record", "RecordTooLargeError", "RecoveryResult", "SlotState",
    "WALClosedError", "WALConfig", "WALConfigError", "WALCorruptError", "WALError", "WALFencedError", "WALFullError",
    "WALInUseError", "WALIOError", "WALMidLogCorruptError", "WALVersionError", "WriteAheadLog", "read_header",
    "salvage",
]
