"""Exceptions of the WAL. Each message says what was wrong and what to do about it."""


class WALError(Exception):
    """Base class of every error the WAL raises on purpose."""


class WALConfigError(WALError, ValueError):
    """The configuration or the path cannot work (bad capacity, a directory, unaligned device)."""


class RecordTooLargeError(WALError, ValueError):
    """A record is larger than the WAL's maximum record size."""


class WALFullError(WALError):
    """The ring stayed full (nothing trimmed) or the device stayed backlogged for `full_timeout`."""


class WALClosedError(WALError):
    """The WAL was closed, or is open read-only for recovery, and takes no appends."""


class WALIOError(WALError):
    """A write or flush failed; records not yet durable will never be. Reopen the WAL to recover."""


class WALCorruptError(WALError):
    """The header is corrupt or not a WAL's, or a clean-shutdown WAL lost records."""


class WALVersionError(WALError):
    """The WAL was written in a format version this build does not read (version 1 used zlib's
    CRC-32; this build uses CRC-32C)."""


class ForeignWALError(WALError):
    """The WAL belongs to another node. Open it with `recovery=True` to recover it on that
    node's behalf (failover), or use a path of your own."""


class WALFencedError(WALError):
    """The WAL was taken over by a newer epoch of this node; this opener is stale."""


class WALInUseError(WALError):
    """Another open WAL object (this or another process) is writing this WAL."""


class WALMidLogCorruptError(WALCorruptError):
    """The scan stopped at a damaged record, but more valid records of the same writer session
    follow it than a crash can leave behind a torn write: acknowledged data lies beyond the
    damage. Nothing was trimmed or overwritten. `salvage()` keeps the records after it."""

    def __init__(self, message: str, *, path: str, bad_offset: int, resync_offset: int, end: int,
                 records_after: int) -> None:
        super().__init__(message)
        self.path = path
        self.bad_offset = bad_offset
        self.resync_offset = resync_offset
        self.end = end
        self.records_after = records_after
