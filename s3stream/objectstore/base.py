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
- `list(prefix)` yields ObjectInfo(key, size) of every object under the prefix, keys ascending:
  in byte order, except on SeaweedFS, which orders them path segment by path segment ("a/1"
  before "a-b"); the two agree among keys of equal length in one "directory".
- All methods are thread-safe. Implementations bound their own concurrency and retry transient
  failures with backoff before raising ObjectStoreError.
- `data` is bytes-like, or a Gathered object (the uploader's objects whose large payloads were
  not copied into one buffer). A store that knows Gathered writes it from its pieces
  (`write_to(fd)`, `read(start, end)` per part); any other may use it as a buffer
  (`memoryview(data)`), which joins it once. Use `data_size(data)` for its length.
- `put` keeps no view of `data` once it returns or raises, not even in the frames of the error it
  raises (a traceback outlives the call for as long as anyone keeps the error): the caller reuses
  its buffer, and a live view of a bytearray keeps it from being resized (BufferError).

Conditional create, `put_if_absent(key, data) -> bool` (for objects that fence: a write-ahead
log's objects, fence objects):
- It stores the whole object only if no object has that key, atomically against every other
  creator of the key: of concurrent calls with one key, at most one returns True. True: this call
  created the object, durable as a put's. False: an object had that key (its bytes unchanged).
- One request: `data` (bytes-like) is at most the store's `multipart_threshold` bytes, else
  InvalidArgumentError before anything is sent. It keeps no view of `data`, as `put`.
- A raise leaves the outcome unknown: the object may have been created and the answer lost.
  Within one call the store settles that itself: when a request was retried after an answer it
  never got (a timeout, a 5xx) and the retry is refused, it reads the object back and returns
  True if its bytes equal `data`. So a writer's objects must be unique to it (its id, its
  epoch in the bytes): a retried call cannot tell its own object from another writer's identical
  one. A caller that retries after a raise should do the same (False, then `get(key) == data`).
- On S3 it is PutObject with If-None-Match: * (412 PreconditionFailed: False; 409
  ConditionalRequestConflict, another conditional write of the key in flight: retried, bounded).
  Some S3-compatible servers ignore the header and overwrite (rclone's serve s3 does):
  `probe_conditional_put(store)` tells whether a store honours it; probe before relying on it.
- A plain `put` of the same key overwrites unconditionally: do not mix them on one key.
"""
from __future__ import annotations

import contextlib
import uuid
from typing import Iterable, Iterator, NamedTuple, Protocol, Union, runtime_checkable

from ..errors import InvalidArgumentError, ObjectStoreError


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
#: What put_if_absent takes: one buffer, sent in one request.
BytesLike = Union[bytes, bytearray, memoryview]


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


def check_conditional_size(size: int, multipart_threshold: int, url: str) -> None:
    """Raise InvalidArgumentError if `size` bytes cannot go in one conditional PUT."""
    if size > multipart_threshold:
        raise InvalidArgumentError(
            f"put_if_absent of {size} bytes to {url}: a conditional create is one PUT of at most "
            f"multipart_threshold ({multipart_threshold}) bytes; write smaller objects or raise the "
            f"store's multipart_threshold")


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

    def put_if_absent(self, key: str, data: BytesLike) -> bool:
        """Store `data` under `key` only if no object has that key: True if this call created
        it, False if the key was taken (see the module's contract)."""
        ...

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes: ...

    def size(self, key: str) -> int:
        """Size in bytes; ObjectNotFoundError if missing."""
        ...

    def delete(self, keys: Iterable[str]) -> None: ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]: ...

    def close(self) -> None: ...


def cpu_bound_puts(store: ObjectStore) -> bool:
    """Whether a PUT to `store` is work on this machine's cores (a local directory's copy)
    rather than a wait on a network: its optional `cpu_bound_puts` attribute, False if absent.
    The uploader keeps Config.put_concurrency PUTs in flight only where they wait."""
    return bool(getattr(store, "cpu_bound_puts", False))


#: Keys of probe_conditional_put's objects start with this (after its key_prefix).
PROBE_KEY_PREFIX = "s3stream-probe-"


def probe_conditional_put(store: ObjectStore, key_prefix: str = "") -> bool:
    """Whether `store` honours put_if_absent: creates a fresh probe key (under `key_prefix`)
    with it, tries again with other bytes, and deletes the key. True if the second was refused;
    False if it was accepted (a store that ignores If-None-Match silently overwrites: no fencing
    can rest on it). Raises ObjectStoreError if the store fails, or if the first call was refused
    (something else holds the fresh key: the answer would be a guess)."""
    key = f"{key_prefix}{PROBE_KEY_PREFIX}{uuid.uuid4().hex}"
    try:
        if not store.put_if_absent(key, b"first " + key.encode()):
            raise ObjectStoreError(
                f"probing conditional puts in {store.url}: the fresh key {key!r} was refused as if it "
                f"existed; the store's answers to If-None-Match cannot be trusted")
        honoured = not store.put_if_absent(key, b"second " + key.encode())
    except BaseException:
        with contextlib.suppress(ObjectStoreError):
            store.delete([key])
        raise
    store.delete([key])
    return honoured
