"""The first zero-fill of a WAL file created with preallocate="background" (docs/wal-format.md).

A new file is only `posix_fallocate`d, which is instant but leaves unwritten extents: every
O_DIRECT write into one converts it, which slows the first lap of the ring. The filler writes
zeros over the data area once, in order from the start, in a thread of its own (the writes
release the GIL), while the WAL already takes appends.

Contract with the WAL (the safety of the scheme):
- The filler writes only at or above the fill mark; the ring places records only below it.
- After each chunk, `advance(mark)` persists the new mark in the header and only then raises the
  ring's limit to it. So after a crash the persisted mark is at least every byte the ring may
  have written, and a reopened WAL resumes filling there without touching a record.
- A lost zero write (a crash before the header's fdatasync) leaves unwritten extents, which read
  as zeros too: the mark needs no flush of its own before it.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from _native.walio import AlignedBuffer

log = logging.getLogger("wal")

MiB = 1024 * 1024


class ZeroFiller:
    """Zero-fills physical [start, data_capacity) of a WAL's data area in `chunk_bytes` writes.

    `advance(mark)` is called after each chunk with the new mark (None once the area is filled)
    and returns False when the WAL is closing; `stop()` makes the thread return within one chunk.
    A write that fails abandons the fill: `advance(None)` (records may then go anywhere; only the
    speed of the first lap is lost), and the error is kept in `error`.
    """

    #: Bytes per write: large enough for the disk's sequential rate, small enough that `close`
    #: and an append waiting at the mark wait for at most one of them.
    chunk_bytes = 8 * MiB
    #: Test hook: called with the offset before each chunk (to slow the filler down or hold it).
    before_chunk: Callable[[int], None] | None = None

    def __init__(self, fd: int, header_area: int, data_capacity: int, start: int,
                 advance: Callable[[int | None], bool], name: str = "wal-filler") -> None:
        self._fd = fd
        self._header_area = header_area
        self._data_capacity = data_capacity
        self._start = start
        self._advance = advance
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop after the chunk being written (if any) and wait for the thread."""
        self._stopping.set()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        chunk = self.chunk_bytes
        buf = AlignedBuffer(chunk)          # zeroed
        pos = self._start
        try:
            while pos < self._data_capacity:
                if self._stopping.is_set():
                    return
                hook = type(self).before_chunk
                if hook is not None:
                    hook(pos)
                    if self._stopping.is_set():
                        return
                n = min(chunk, self._data_capacity - pos)
                buf.pwrite(self._fd, n, self._header_area + pos)
                pos += n
                if not self._advance(pos if pos < self._data_capacity else None):
                    return
        except BaseException as e:     # noqa: BLE001 - kept and reported through stats
            if self._stopping.is_set():
                return
            self.error = e
            log.error("WAL first fill failed at data offset %d (%s); abandoning it: records may now go "
                      "anywhere, the rest of the first lap is written into unfilled extents", pos, e)
            try:
                self._advance(None)
            except BaseException:     # noqa: BLE001
                log.exception("WAL could not record the abandoned fill; appends stop at offset %d", pos)
