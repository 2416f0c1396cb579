"""RecordBatch, the unit of append and fetch, and the results returned to callers.

RecordBatch and AppendResult are native (the append path takes a batch without a Python-level
call); RecordBatch(payload, count=1) raises InvalidBatchError for a payload that is not
bytes-like or a count outside [1, 2**32).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from _native import appendpath
from _native.appendpath import AppendFuture, AppendResult, RecordBatch

from .errors import InvalidBatchError

appendpath.set_error_types(invalid_batch=InvalidBatchError)

__all__ = ["AppendFuture", "AppendResult", "FetchResult", "FetchedBatch", "RecordBatch"]


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


@dataclass(frozen=True)
class FetchResult:
    batches: list[FetchedBatch]

    @property
    def end_offset(self) -> int | None:
        return self.batches[-1].end_offset if self.batches else None

    @property
    def total_bytes(self) -> int:
        return sum(len(b.payload) for b in self.batches)
