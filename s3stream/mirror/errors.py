"""Errors of the mirror, all under MirrorError (itself an S3StreamError). Each message names the
value that was wrong and what to do about it."""
from __future__ import annotations

from ..errors import InvalidArgumentError, OffsetOutOfRangeError, S3StreamError


class MirrorError(S3StreamError):
    """Base class of the mirror's own errors."""


class MirrorNameError(MirrorError, InvalidArgumentError):
    """A cluster alias, flow id, separator or partition name the mirror cannot use (empty, holding
    '/', NUL or the policy's separator, or naming a cycle). Nothing was read or written."""


class OffsetNotMirroredError(MirrorError, OffsetOutOfRangeError):
    """An upstream offset outside what the flow has mirrored (before its first segment, beyond the
    mirrored end, or in a gap the source's retention made): it has no downstream counterpart.
    `offset` is the offset asked for; `mirrored` the upstream range [start, end] that translates
    (end None: unbounded)."""

    def __init__(self, message: str, offset: int, mirrored: tuple[int, int | None] | None) -> None:
        super().__init__(message)
        self.offset = offset
        self.mirrored = mirrored


class MirrorConflictError(MirrorError):
    """The target does not hold what this flow's records say it wrote (another writer appended to
    the target partition, the target was recreated, the map was edited), or another instance of the
    flow took the partition over. The flow stops without writing: appending more would make the
    offset map wrong. The message says what differed and how to start over."""


class SourceTrimmedError(MirrorError):
    """The source's retention removed records the flow had not mirrored yet (the flow was down
    longer than the source keeps data). Nothing was appended; restart the flow with
    skip_trimmed=True to accept the gap (it is recorded in the offset map), or raise the source's
    retention."""

    def __init__(self, message: str, position: int, source_start: int) -> None:
        super().__init__(message)
        self.position = position
        self.source_start = source_start
