"""Stream: an append-only sequence of record batches, open on this node at one epoch."""
from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from _native import appendpath
from _native.appendpath import StreamWriter

from .errors import OffsetOutOfRangeError, StreamClosedError, StreamFencedError, check_int
from .metadata import StreamMeta
from .engine.readpath import fetch_end
from .batches import AppendFuture, FetchResult, encoded_batch, records_batch
from .records import Record

if TYPE_CHECKING:
    from .client import StreamClient

_STATE_NAMES = {appendpath.OPEN: "open", appendpath.CLOSING: "closing", appendpath.CLOSED: "closed",
                appendpath.FENCED: "fenced"}


class Stream(StreamWriter):
    """A stream opened by a StreamClient. Offsets:

    - start_offset: first offset still readable (raised by trim);
    - next_offset: offset the next append gets;
    - confirm_offset: every offset below it is durable (acknowledged, readable);
    - committed offsets (below the metadata end offset) are in objects.

    `append(batch)` (native, see _native/appendpath.pyx) returns an AppendFuture whose
    `result()` is an AppendResult once the batch is durable in the WAL; `append_many(batches)`
    appends several in one call; `append_records(records)` appends Records as one Kafka record
    batch (read back with FetchedBatch.records()). Appends complete in offset order. Thread-safe.
    """

    OPEN, CLOSING, CLOSED, FENCED = "open", "closing", "closed", "fenced"

    def __init__(self, client: "StreamClient", meta: StreamMeta) -> None:
        # Offsets [end, reserved_end) are this node's in metadata; none reserved (older
        # metadata): the first append reserves them before it takes one.
        reserved = max(meta.reserved_end, meta.end_offset)
        self._init_writer(client._appends(), meta.stream_id, meta.epoch, meta.end_offset, reserved,
                          reserved - client.config.offset_reservation // 2)
        self._reserve_lock = threading.Lock()
        self._client = client
        self._start_offset = meta.start_offset
        self._committed_offset = meta.end_offset
        # Orders trim, destroy and close against each other (appends use the native lock).
        self._lock = threading.Lock()

    # ---- offsets ------------------------------------------------------------------------------

    @property
    def start_offset(self) -> int:
        return self._start_offset

    @property
    def committed_offset(self) -> int:
        return self._committed_offset

    def metadata(self) -> StreamMeta:
        """The stream's record in metadata now (committed end, ranges, reservation)."""
        return self._client._meta_call(self._client.metadata.get_stream, self.stream_id, stream=self)

    @property
    def _state(self) -> str:
        return _STATE_NAMES[self._writer_state()]

    @property
    def is_open(self) -> bool:
        return self._writer_state() == appendpath.OPEN

    def append_records(self, records: Iterable[Record], *, compression: str | None = None) -> AppendFuture:
        """Append `records` (s3stream.Record) as one Kafka record batch (v2, compressed with
        `compression`: None, "gzip", "snappy", "lz4" or "zstd"), one offset per record; the
        AppendResult's base offset is the first record's. InvalidArgumentError for a bad record
        or codec, before anything is appended."""
        return self.append(records_batch(records, compression))

    def append_encoded(self, raw: bytes | bytearray | memoryview) -> AppendFuture:
        """Append a Kafka record batch (v2) built elsewhere, after checking it whole
        (batches.encoded_batch: InvalidRecordBatchError or a subclass for a bad one, nothing
        appended), one offset per record. Its producer fields are kept but not checked here:
        idempotence is a partition's (Partition.append_encoded)."""
        return self.append(encoded_batch(raw)[0])

    # ---- fetch --------------------------------------------------------------------------------

    def fetch(self, start_offset: int, end_offset: int | None = None, max_bytes: int = 1 << 20) -> FetchResult:
        """Batches from the one containing `start_offset` towards `end_offset` (default, and at
        most: the confirm offset), up to `max_bytes` (at least one batch if any is in range).
        OffsetOutOfRangeError for a start below start_offset or past the confirm offset (or past
        `end_offset`); an `end_offset` past the confirm offset is capped there, as Kafka's fetch
        returns what exists (s3stream.engine.readpath.fetch_end).

        Reads need an open handle: a closed or destroyed one raises StreamClosedError (another
        node may have trimmed or appended since), a fenced one StreamFencedError. Offsets and
        max_bytes must be ints (InvalidArgumentError)."""
        end = self._fetch_end(start_offset, end_offset, max_bytes)
        if start_offset == end:
            return FetchResult([])
        return FetchResult(self._client._reader.read(self.stream_id, start_offset, end, max_bytes))

    def fetch_cached(self, start_offset: int, end_offset: int | None = None,
                     max_bytes: int = 1 << 20) -> FetchResult | None:
        """What `fetch` answers, if the log cache holds `start_offset`: a memory copy, never
        I/O, so an event loop may call it inline (s3stream.aio does). None when that batch is
        only in objects (`fetch` reads them). Raises as `fetch` does."""
        end = self._fetch_end(start_offset, end_offset, max_bytes)
        if start_offset == end:
            return FetchResult([])
        got = self._client._reader.read_cached(self.stream_id, start_offset, end, max_bytes)
        return FetchResult(got) if got else None

    def _fetch_end(self, start_offset: int, end_offset: int | None, max_bytes: int) -> int:
        """The end of a fetch's range, checked (see fetch)."""
        check_int("start_offset", start_offset)
        if end_offset is not None:
            check_int("end_offset", end_offset)
        check_int("max_bytes", max_bytes, minimum=1)
        self._check_readable()
        return fetch_end(self.stream_id, start_offset, end_offset, self._start_offset, self.confirm_offset,
                         "the readable range")

    # ---- trim, close, destroy -------------------------------------------------------------------

    def trim(self, new_start_offset: int) -> None:
        """Discard offsets below `new_start_offset`, which must lie in [start_offset,
        confirm_offset]; trimming to the current start offset does nothing."""
        check_int("new_start_offset", new_start_offset)
        with self._lock:
            self._check_writable()
            confirm = self.confirm_offset
            if new_start_offset > confirm:
                raise OffsetOutOfRangeError(
                    f"stream {self.stream_id}: cannot trim to {new_start_offset}, beyond the confirm offset "
                    f"{confirm}")
            if new_start_offset < self._start_offset:
                raise OffsetOutOfRangeError(
                    f"stream {self.stream_id}: cannot trim backwards to {new_start_offset}; the start offset "
                    f"is already {self._start_offset}")
            if new_start_offset == self._start_offset:
                return
            self._client._meta_call(self._client._meta.trim_stream, self.stream_id, self.epoch, new_start_offset,
                                    stream=self)
            self._start_offset = new_start_offset

    def flush(self, timeout: float | None = None) -> None:
        """Block until every append made so far is acknowledged; OperationTimeoutError after
        `timeout`, or the error that keeps them from ever being acknowledged."""
        self._wait_confirmed(self.next_offset, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Wait for pending appends, force-upload this stream's un-uploaded tail (only that:
        nothing older moves), commit, and mark the stream CLOSED so another node may open it.
        If that fails the stream stays open here (a later close tries again)."""
        self._client.close_streams([self], timeout)

    def _begin_close(self, timeout: float | None, wait: bool = True) -> bool:
        """Refuse new appends and (`wait`) wait until the pending ones are durable. False if
        there is nothing to close (already closed or fenced)."""
        with self._lock:
            if self._writer_state() in (appendpath.CLOSED, appendpath.FENCED):
                self._client._forget(self)
                return False
            self._set_writer_state(appendpath.CLOSING)
            target = self.next_offset
        if not wait:
            return True
        try:
            self._wait_confirmed(target, timeout)
        except BaseException:
            self._end_close(False)
            raise
        return True

    def _end_close(self, closed: bool) -> None:
        """The close ended: CLOSED in metadata (`closed`: the handle closes and is forgotten),
        or not (it serves again, unless it was fenced meanwhile)."""
        with self._lock:
            if self._writer_state() == appendpath.CLOSING:
                self._set_writer_state(appendpath.CLOSED if closed else appendpath.OPEN)
            state = self._writer_state()
        if state != appendpath.OPEN:
            self._client._forget(self)

    def destroy(self) -> None:
        """Delete the stream: it can no longer be opened; its objects are reclaimed."""
        with self._lock:
            self._check_writable()
            self._set_writer_state(appendpath.CLOSING)
        try:
            self._client._meta_call(self._client._meta.delete_stream, self.stream_id, self.epoch, stream=self)
            self._client._cache.drop_stream(self.stream_id)
            self._client._reader.forget_stream(self.stream_id)
        finally:
            with self._lock:
                self._set_writer_state(appendpath.CLOSED)
            self._client._forget(self)

    def _check_readable(self) -> None:
        """Raise why this handle serves no reads: closed or destroyed (StreamClosedError), fenced
        (StreamFencedError). A closing handle still reads (its data is all here)."""
        state = self._writer_state()
        if state == appendpath.FENCED:
            raise StreamFencedError(
                f"stream {self.stream_id} epoch {self.epoch} was fenced: it was opened elsewhere with a newer epoch; "
                "reopen it to read what that holder wrote")
        if state == appendpath.CLOSED:
            raise StreamClosedError(
                f"stream {self.stream_id} is closed on this node (closed or destroyed); another node may have "
                "trimmed or appended since: open it again to read")

    def _fence(self) -> None:
        self._mark_fenced()

    def _committed(self, end_offset: int) -> None:
        # Only the uploader's thread moves it, forward; no lock (the client's is held here).
        if end_offset > self._committed_offset:
            self._committed_offset = end_offset

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        if self._writer_state() in (appendpath.OPEN, appendpath.CLOSING):
            self.close()

    def __repr__(self) -> str:
        return (f"<Stream {self.stream_id} epoch={self.epoch} {self._state} "
                f"[{self._start_offset}, {self.confirm_offset}) next={self.next_offset}>")
