"""Stream: an append-only sequence of record batches, open on this node at one epoch."""
from __future__ import annotations

import functools
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

from .errors import (
    InvalidBatchError, OffsetOutOfRangeError, S3StreamError, StreamClosedError, StreamFencedError,
)
from .metadata import StreamMeta
from .objectformat import Batch
from .recordbatch import AppendResult, FetchResult, RecordBatch

if TYPE_CHECKING:
    from .client import StreamClient


class Stream:
    """A stream opened by a StreamClient. Offsets:

    - start_offset: first offset still readable (raised by trim);
    - next_offset: offset the next append gets;
    - confirm_offset: every offset below it is durable (acknowledged, readable);
    - committed offsets (below the metadata end offset) are in objects.
    Appends complete in offset order. Thread-safe.
    """

    OPEN, CLOSING, CLOSED, FENCED = "open", "closing", "closed", "fenced"

    def __init__(self, client: "StreamClient", meta: StreamMeta) -> None:
        self._client = client
        self.stream_id = meta.stream_id
        self.epoch = meta.epoch
        self._start_offset = meta.start_offset
        self._next_offset = meta.end_offset
        self._confirm_offset = meta.end_offset
        self._committed_offset = meta.end_offset
        self._state = Stream.OPEN
        # _lock orders appends and is held across the WAL append, which may wait for space;
        # WAL callbacks therefore never take it: they use _durable's own lock.
        self._lock = threading.Lock()
        self._durable = threading.Condition(threading.Lock())
        self._error: S3StreamError | None = None

    # ---- offsets ------------------------------------------------------------------------------

    @property
    def start_offset(self) -> int:
        return self._start_offset

    @property
    def next_offset(self) -> int:
        return self._next_offset

    @property
    def confirm_offset(self) -> int:
        return self._confirm_offset

    @property
    def committed_offset(self) -> int:
        return self._committed_offset

    @property
    def is_open(self) -> bool:
        return self._state == Stream.OPEN

    # ---- append -------------------------------------------------------------------------------

    def append(self, batch: RecordBatch) -> "Future[AppendResult]":
        """Append a batch; the future completes with its base offset once it is durable in the
        WAL. Raises at once for an invalid batch or a stream that is closed or fenced."""
        if not isinstance(batch, RecordBatch):
            raise InvalidBatchError(f"append takes a RecordBatch, got {type(batch).__name__}")
        payload = bytes(batch.payload) if not isinstance(batch.payload, bytes) else batch.payload
        limit = self._client.config.max_batch_bytes
        if len(payload) > limit:
            raise InvalidBatchError(
                f"batch payload of {len(payload)} bytes exceeds max_batch_bytes ({limit}); split it")
        self._client._admit(len(payload))
        future: Future = Future()
        try:
            with self._lock:
                self._check_writable()
                base = self._next_offset
                self._client._wal_append(self, base, batch.count, payload,
                                         functools.partial(self._on_durable, future, base, batch.count, payload))
                self._next_offset = base + batch.count
        except BaseException:
            self._client._release(len(payload))
            raise
        return future

    def _on_durable(self, future: Future, base: int, count: int, payload: bytes, handle) -> None:
        """WAL callback (offset order): publish to the log cache, then complete the future."""
        error = handle.exception()
        if error is not None:
            mapped = self._client._map_wal_error(error)
            with self._durable:
                if self._error is None:
                    self._error = mapped
            future.set_exception(mapped)
            return
        self._client._on_durable(self, Batch(base, count, payload), handle.end)
        with self._durable:
            self._confirm_offset = base + count
            self._durable.notify_all()
        future.set_result(AppendResult(base))

    def _check_writable(self) -> None:
        if self._state == Stream.FENCED:
            raise StreamFencedError(
                f"stream {self.stream_id} epoch {self.epoch} was fenced: it was opened elsewhere with a newer "
                "epoch (or this node was fenced). Stop writing; reopen the stream to continue.")
        if self._state != Stream.OPEN:
            raise StreamClosedError(f"stream {self.stream_id} is {self._state} on this node")
        if self._error is not None:
            raise self._error

    def _wait_confirmed(self, offset: int, timeout: float | None) -> None:
        with self._durable:
            if not self._durable.wait_for(
                    lambda: self._confirm_offset >= offset or self._error is not None or self._state == Stream.FENCED,
                    timeout):
                raise TimeoutError(f"stream {self.stream_id}: appends below {offset} not durable after {timeout} s")
            if self._confirm_offset < offset:
                raise self._error or StreamFencedError(f"stream {self.stream_id} was fenced while closing")

    # ---- fetch --------------------------------------------------------------------------------

    def fetch(self, start_offset: int, end_offset: int | None = None, max_bytes: int = 1 << 20) -> FetchResult:
        """Batches from the one containing `start_offset` towards `end_offset` (default: the
        confirm offset), up to `max_bytes` (at least one batch if any is in range)."""
        confirm = self._confirm_offset
        end = confirm if end_offset is None else end_offset
        if start_offset < self._start_offset or end > confirm or start_offset > end:
            raise OffsetOutOfRangeError(
                f"stream {self.stream_id}: fetch [{start_offset}, {end}) is outside the readable range "
                f"[{self._start_offset}, {confirm}]")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if start_offset == end:
            return FetchResult([])
        return FetchResult(self._client._reader.read(self.stream_id, start_offset, end, max_bytes))

    # ---- trim, close, destroy -------------------------------------------------------------------

    def trim(self, new_start_offset: int) -> None:
        """Discard offsets below `new_start_offset`, which must lie in [start_offset,
        confirm_offset]; trimming to the current start offset does nothing."""
        with self._lock:
            self._check_writable()
            if new_start_offset > self._confirm_offset:
                raise OffsetOutOfRangeError(
                    f"stream {self.stream_id}: cannot trim to {new_start_offset}, beyond the confirm offset "
                    f"{self._confirm_offset}")
            if new_start_offset < self._start_offset:
                raise OffsetOutOfRangeError(
                    f"stream {self.stream_id}: cannot trim backwards to {new_start_offset}; the start offset "
                    f"is already {self._start_offset}")
            if new_start_offset == self._start_offset:
                return
            self._client._meta_call(self._client._meta.trim_stream, self.stream_id, self.epoch, new_start_offset,
                                    stream=self)
            self._start_offset = new_start_offset

    def close(self, timeout: float | None = None) -> None:
        """Wait for pending appends, force-upload this stream's un-uploaded tail (only that:
        nothing older moves), commit, and mark the stream CLOSED so another node may open it."""
        self._client.close_streams([self], timeout)

    def _begin_close(self, timeout: float | None) -> bool:
        """Refuse new appends and wait until the pending ones are durable. False if there is
        nothing to close (already closed or fenced)."""
        with self._lock:
            if self._state in (Stream.CLOSED, Stream.FENCED):
                self._client._forget(self)
                return False
            self._state = Stream.CLOSING
            target = self._next_offset
        try:
            self._wait_confirmed(target, timeout)
        except BaseException:
            self._end_close()
            raise
        return True

    def _end_close(self) -> None:
        with self._lock:
            if self._state == Stream.CLOSING:
                self._state = Stream.CLOSED
        self._client._forget(self)

    def destroy(self) -> None:
        """Delete the stream: it can no longer be opened; its objects are reclaimed."""
        with self._lock:
            self._check_writable()
            self._state = Stream.CLOSING
        try:
            self._client._meta_call(self._client._meta.delete_stream, self.stream_id, self.epoch, stream=self)
            self._client._cache.drop_stream(self.stream_id)
        finally:
            with self._lock:
                self._state = Stream.CLOSED
            self._client._forget(self)

    def _fence(self) -> None:
        with self._durable:
            self._state = Stream.FENCED
            self._durable.notify_all()

    def _committed(self, end_offset: int) -> None:
        with self._durable:
            self._committed_offset = max(self._committed_offset, end_offset)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        if self._state in (Stream.OPEN, Stream.CLOSING):
            self.close()

    def __repr__(self) -> str:
        return (f"<Stream {self.stream_id} epoch={self.epoch} {self._state} "
                f"[{self._start_offset}, {self._confirm_offset}) next={self._next_offset}>")
