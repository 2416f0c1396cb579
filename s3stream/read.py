"""The read path: log cache first, then objects found through metadata.

For offsets the log cache no longer (or never) held, metadata names the committed objects holding
the stream's data from the wanted offset on, ordered by offset: StreamObjects and the ranges of
StreamSetObjects alike (an index range scan on (stream, offset), which is what AutoMQ's
"binary-search the ranges, then scan the node's SSOs" computes). Each object is read footer ->
index -> blocks with ranged GETs; decoded blocks go to a size-capped LRU block cache, and a read
fetches at least `readahead_bytes` of the stream's consecutive blocks in one GET so that a
catch-up reader's next fetches hit the cache.

An object that disappears between the metadata lookup and the GET (compaction or retention
swapped it) makes the read retry against fresh metadata, so a reader never sees a gap.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable

from .errors import CorruptDataError, ObjectNotFoundError
from .logcache import LogCache
from .metadata import MetadataStore, ObjectRef
from .objectformat import Batch, IndexEntry, entries_for, read_blocks, read_index
from .objectstore import ObjectStore

_RETRIES = 3


class LRUCache:
    """A thread-safe LRU bounded by the total `weight` of its values."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable):
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: Hashable, value: object, weight: int) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._weight -= old[1]
            self._items[key] = (value, weight)
            self._weight += weight
            while self._weight > self._capacity and len(self._items) > 1:
                _, (_, w) = self._items.popitem(last=False)
                self._weight -= w

    @property
    def weight(self) -> int:
        return self._weight


class Reader:
    def __init__(self, store: ObjectStore, metadata: MetadataStore, cache: LogCache,
                 block_cache_size: int, readahead_bytes: int) -> None:
        self._store = store
        self._meta = metadata
        self._cache = cache
        self._readahead = readahead_bytes
        self.blocks = LRUCache(block_cache_size)
        self.indexes = LRUCache(64 * 1024 * 1024)
        self.stats = dict(object_reads=0, object_bytes=0, cache_reads=0)

    def read(self, stream_id: int, start: int, end: int, max_bytes: int) -> list[Batch]:
        """Batches covering [start, end) from the one containing `start`, up to `max_bytes`
        (always at least one batch when start < end)."""
        out: list[Batch] = []
        size = 0
        pos = start
        while pos < end:
            budget = max_bytes - size
            if out and budget <= 0:
                break
            got = self._cache.read(stream_id, pos, end, max(budget, 1))
            if got:
                self.stats["cache_reads"] += 1
            else:
                got = self._read_objects(stream_id, pos, end, max(budget, 1))
            if not got:
                raise CorruptDataError(
                    f"stream {stream_id}: no cached or committed data holds offset {pos} "
                    f"(reading [{start}, {end})); metadata and objects disagree")
            for batch in got:
                if out and size + len(batch.payload) > max_bytes:
                    return out
                out.append(batch)
                size += len(batch.payload)
            pos = out[-1].end_offset
        return out

    def _read_objects(self, stream_id: int, pos: int, end: int, budget: int) -> list[Batch]:
        last_error: Exception | None = None
        for _ in range(_RETRIES):
            refs = self._meta.get_object_refs(stream_id, pos, end, limit=8)
            if not refs or refs[0].start_offset > pos:
                # Maybe just committed from the cache's view, or swapped by compaction: look again.
                cached = self._cache.read(stream_id, pos, end, budget)
                if cached:
                    return cached
                continue
            try:
                return self._read_refs(stream_id, refs, pos, end, budget)
            except ObjectNotFoundError as e:
                last_error = e
        if last_error is not None:
            raise CorruptDataError(
                f"stream {stream_id}: object for offset {pos} is missing from the store: {last_error}")
        return []

    def _read_refs(self, stream_id: int, refs: list[ObjectRef], pos: int, end: int, budget: int) -> list[Batch]:
        out: list[Batch] = []
        size = 0
        for ref in refs:
            if ref.start_offset > pos or size >= budget:
                break
            entries = entries_for(self._index(ref), stream_id, pos, min(end, ref.end_offset))
            for block in self._blocks(ref, entries, max(budget - size, self._readahead)):
                for batch in block:
                    if batch.end_offset <= pos:
                        continue
                    if batch.base_offset >= end or (out and size + len(batch.payload) > budget):
                        return out
                    out.append(batch)
                    size += len(batch.payload)
                    pos = batch.end_offset
        return out

    def _index(self, ref: ObjectRef) -> list[IndexEntry]:
        index = self.indexes.get(ref.object_id)
        if index is None:
            index = read_index(self._store, ref.key, ref.size)
            self.indexes.put(ref.object_id, index, 64 + 56 * len(index))
        return index

    def _blocks(self, ref: ObjectRef, entries: list[IndexEntry], want_bytes: int) -> list[list[Batch]]:
        """Decoded blocks for `entries`, fetching (with readahead) those not cached in one GET."""
        chosen: list[IndexEntry] = []
        total = 0
        for e in entries:
            if chosen and total >= want_bytes:
                break
            chosen.append(e)
            total += e.block_size
        cached = [self.blocks.get((ref.object_id, e.block_position)) for e in chosen]
        missing = [e for e, c in zip(chosen, cached) if c is None]
        if missing:
            fetched = read_blocks(self._store, ref.key, missing)
            self.stats["object_reads"] += 1
            self.stats["object_bytes"] += sum(e.block_size for e in missing)
            by_pos = {}
            for e, batches in zip(missing, fetched):
                self.blocks.put((ref.object_id, e.block_position), batches, e.block_size)
                by_pos[e.block_position] = batches
            cached = [c if c is not None else by_pos[e.block_position] for e, c in zip(chosen, cached)]
        return cached
