"""The log cache: durable records batched per stream in blocks, until uploaded and beyond.

Records enter in WAL order (the WAL's callbacks run in offset order) into the *active* block,
grouped per stream. When the active block reaches the upload threshold (or an interval passes,
or a stream closes) it is *sealed* and handed to the uploader; blocks are uploaded and committed
in seal order. Committed blocks stay as a tail cache for readers until evicted by size, oldest
first; uncommitted blocks are never evicted (the WAL and the append backpressure bound them).
"""
from __future__ import annotations

import bisect
import threading
from collections import deque
from typing import Callable, Iterator

from .objectformat import Batch


class StreamSlice:
    """One stream's contiguous batches inside one block."""
    __slots__ = ("stream_id", "epoch", "bases", "batches", "size")

    def __init__(self, stream_id: int, epoch: int) -> None:
        self.stream_id = stream_id
        self.epoch = epoch
        self.bases: list[int] = []
        self.batches: list[Batch] = []
        self.size = 0

    @property
    def start_offset(self) -> int:
        return self.bases[0]

    @property
    def end_offset(self) -> int:
        return self.batches[-1].end_offset

    def append(self, batch: Batch) -> None:
        if self.batches and batch.base_offset != self.end_offset:
            raise AssertionError(
                f"stream {self.stream_id}: batch at {batch.base_offset} after {self.end_offset} in one block")
        self.bases.append(batch.base_offset)
        self.batches.append(batch)
        self.size += len(batch.payload)

    def from_offset(self, offset: int) -> list[Batch]:
        """Batches from the one containing `offset` on (empty if offset is past the end)."""
        i = max(bisect.bisect_right(self.bases, offset) - 1, 0)
        if self.batches[i].end_offset <= offset:
            i += 1
        return self.batches[i:]


class CacheBlock:
    ACTIVE, SEALED, COMMITTED = "active", "sealed", "committed"
    __slots__ = ("block_id", "streams", "size", "wal_end", "state", "created_ns")

    def __init__(self, block_id: int, created_ns: int) -> None:
        self.block_id = block_id
        self.streams: dict[int, StreamSlice] = {}
        self.size = 0
        self.wal_end = 0
        self.state = CacheBlock.ACTIVE
        self.created_ns = created_ns

    def __repr__(self) -> str:
        return f"<CacheBlock {self.block_id} {self.state} {len(self.streams)} streams {self.size} bytes>"


class LogCache:
    def __init__(self, upload_threshold: int, cache_size: int, clock: Callable[[], int]) -> None:
        self._threshold = upload_threshold
        self._cache_size = cache_size
        self._clock = clock
        self._lock = threading.Lock()
        self._next_id = 0
        self._blocks: deque[CacheBlock] = deque()   # sealed and committed, oldest first
        self._active = self._new_block()
        self._bytes = 0                             # all blocks, active included

    def _new_block(self) -> CacheBlock:
        block = CacheBlock(self._next_id, self._clock())
        self._next_id += 1
        return block

    def put(self, stream_id: int, epoch: int, batch: Batch, wal_end: int) -> CacheBlock | None:
        """Add a durable batch; returns the block it sealed if the threshold was reached."""
        with self._lock:
            block = self._active
            slice_ = block.streams.get(stream_id)
            if slice_ is None or slice_.epoch != epoch:
                if slice_ is not None:
                    raise AssertionError(f"stream {stream_id} changed epoch inside block {block.block_id}")
                slice_ = block.streams[stream_id] = StreamSlice(stream_id, epoch)
            slice_.append(batch)
            block.size += len(batch.payload)
            block.wal_end = max(block.wal_end, wal_end)
            self._bytes += len(batch.payload)
            if block.size >= self._threshold:
                return self._seal_locked()
            return None

    def seal(self, stream_id: int | None = None) -> CacheBlock | None:
        """Seal the active block if it holds anything (or, with `stream_id`, that stream)."""
        with self._lock:
            if not self._active.streams or (stream_id is not None and stream_id not in self._active.streams):
                return None
            return self._seal_locked()

    def seal_if_older(self, age_ns: int) -> CacheBlock | None:
        with self._lock:
            if self._active.streams and self._clock() - self._active.created_ns >= age_ns:
                return self._seal_locked()
            return None

    def _seal_locked(self) -> CacheBlock:
        block = self._active
        block.state = CacheBlock.SEALED
        self._blocks.append(block)
        self._active = self._new_block()
        return block

    def mark_committed(self, block: CacheBlock) -> None:
        with self._lock:
            block.state = CacheBlock.COMMITTED
            while self._bytes > self._cache_size and self._blocks and self._blocks[0].state == CacheBlock.COMMITTED:
                self._bytes -= self._blocks.popleft().size

    def drop_stream(self, stream_id: int) -> None:
        """Forget a stream's committed data (after trim past it or destroy); uncommitted stays."""
        with self._lock:
            for block in self._blocks:
                if block.state == CacheBlock.COMMITTED and stream_id in block.streams:
                    dropped = block.streams.pop(stream_id).size
                    block.size -= dropped
                    self._bytes -= dropped

    def pending_blocks_with(self, stream_id: int) -> list[CacheBlock]:
        """Uncommitted blocks holding the stream (the active one included)."""
        with self._lock:
            out = [b for b in self._blocks if b.state == CacheBlock.SEALED and stream_id in b.streams]
            if stream_id in self._active.streams:
                out.append(self._active)
            return out

    def read(self, stream_id: int, start: int, end: int, max_bytes: int) -> list[Batch]:
        """Cached batches of the stream from the one containing `start`, up to `end` or
        `max_bytes` (at least one batch). Empty if the cache does not hold `start`."""
        out: list[Batch] = []
        size = 0
        with self._lock:
            pos = start
            for slice_ in self._slices(stream_id):
                if slice_.end_offset <= pos:
                    continue
                if slice_.start_offset > pos:
                    break          # a hole: the data at `pos` is in objects, not here
                for batch in slice_.from_offset(pos):
                    if batch.base_offset >= end or (out and size + len(batch.payload) > max_bytes):
                        return out
                    out.append(batch)
                    size += len(batch.payload)
                    pos = batch.end_offset
        return out

    def _slices(self, stream_id: int) -> Iterator[StreamSlice]:
        for block in self._blocks:
            s = block.streams.get(stream_id)
            if s is not None:
                yield s
        s = self._active.streams.get(stream_id)
        if s is not None:
            yield s

    @property
    def size(self) -> int:
        return self._bytes

    def stats(self) -> dict:
        with self._lock:
            sealed = sum(1 for b in self._blocks if b.state == CacheBlock.SEALED)
            return dict(bytes=self._bytes, blocks=len(self._blocks) + 1, sealed_blocks=sealed,
                        active_bytes=self._active.size)
