"""RecordBatch, the unit of append and fetch, and the results returned to callers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .errors import InvalidBatchError


@dataclass(frozen=True)
class RecordBatch:
    """`count` records carried as one opaque payload; they occupy offsets [base, base + count)."""
    payload: bytes
    count: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count <= 0:
            raise InvalidBatchError(f"a record batch needs count >= 1, got {self.count!r}")
        if not isinstance(self.payload, (bytes, bytearray, memoryview)):
            raise InvalidBatchError(f"payload must be bytes-like, got {type(self.payload).__name__}")


@dataclass(frozen=True)
class AppendResult:
    base_offset: int


class FetchedBatch(NamedTuple):
    """A batch as stored and returned by fetch: records [base_offset, base_offset + count)."""
    base_offset: int
    count: int
    payload: bytes

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
