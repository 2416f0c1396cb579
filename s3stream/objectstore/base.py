"""The object store interface.

Contract (every implementation, every wrapper):
- `put(key, data)` stores the whole object atomically: a reader sees either no object or all of
  it, never a prefix. Objects larger than the store's part size are uploaded in parts (multipart
  upload) and become visible only when complete; a failed multipart upload is aborted.
- Objects are immutable: a key is written once by the engine (ids are never reused). A repeated
  put of the same key with the same bytes (a retry) succeeds.
- `get(key, start, end)` returns bytes [start, end) of the object (end=None: to the end); a range
  past the end is clipped as HTTP ranges are. A missing key raises ObjectNotFoundError.
- `delete(keys)` is idempotent: deleting a missing key is not an error.
- `list(prefix)` yields ObjectInfo(key, size) of every object under the prefix, keys ascending.
- All methods are thread-safe. Implementations bound their own concurrency and retry transient
  failures with backoff before raising ObjectStoreError.
- `data` is bytes-like, or a Gathered object (the uploader's objects whose large payloads were
  not copied into one buffer). A store that knows Gathered writes it from its pieces
  (`write_to(fd)`, `read(start, end)` per part); any other may use it as a buffer
  (`memoryview(data)`), which joins it once. Use `data_size(data)` for its length.
- `put` keeps no view of `data` once it returns or raises, not even in the frames of the error it
  raises (a traceback outlives the call for as long as anyone keeps the error): the caller reuses
  its buffer, and a live view of a bytearray keeps it from being resized (BufferError).
"""
from __future__ import annotations

from typing import Iterable, Iterator, NamedTuple, Protocol, Union, runtime_checkable


@runtime_checkable
class Gathered(Protocol):
    """An object in pieces (_native.objcodec.GatheredObject): its bytes in order, written or
    copied from the pieces; it is also a read-only buffer, joined on first use."""

    def __len__(self) -> int: ...

    def write_to(self, fd: int) -> int:
        """Write every byte at the descriptor's position (short writes resumed)."""
        ...

    def read(self, start: int, end: int) -> bytes:
        """A copy of bytes [start, end)."""
        ...

    def tobytes(self) -> bytes: ...


PutData = Union[bytes, bytearray, memoryview, Gathered]


def data_size(data: PutData) -> int:
    """Bytes in `data` (a memoryview's nbytes whatever its format)."""
    return data.nbytes if isinstance(data, memoryview) else len(data)


def write_requests(size: int, part_size: int | None, multipart_threshold: int | None) -> int:
    """Write requests an S3 store makes for one object of `size` bytes: one PUT up to the
    multipart threshold, else create + floor(size / part_size) parts (the last one takes the
    remainder) + complete. The threshold sits above the part size so that an object just over a
    part (an upload block plus its index) is still one request."""
    if part_size is None or size <= (multipart_threshold or part_size):
        return 1
    return max(1, size // part_size) + 2


def default_multipart_threshold(part_size: int) -> int:
    return 2 * part_size


class ObjectInfo(NamedTuple):
    key: str
    size: int


@runtime_checkable
class ObjectStore(Protocol):
    @property
    def url(self) -> str:
        """Human-readable location, e.g. "file:///data/objects" or "s3://bucket/prefix" (a
        wrapper's is its inner store's)."""
        ...

    def put(self, key: str, data: PutData) -> None: ...

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes: ...

    def size(self, key: str) -> int:
        """Size in bytes; ObjectNotFoundError if missing."""
        ...

    def delete(self, keys: Iterable[str]) -> None: ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]: ...

    def close(self) -> None: ...
