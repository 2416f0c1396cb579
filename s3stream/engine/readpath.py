"""The read path: log cache first, then objects found through (cached) metadata.

For offsets the log cache no longer (or never) held, metadata names the committed objects holding
the stream's data, ordered by offset: StreamObjects and the ranges of StreamSetObjects alike. The
reader keeps those object refs per stream (they only change when compaction or retention swap
objects, which a missing object reveals: the refs are then looked up again), so a catch-up reader
queries metadata once per 64 objects, not once per fetch. Each object is read footer -> index ->
blocks with ranged GETs; the decoded blocks go to a size-capped LRU block cache.

Zero copy: a GET's buffer is checked (CRC-32C per block) and its payloads are handed out as
read-only memoryview slices of it. A payload keeps its GET's buffer alive: copy it (bytes(p)) to
keep a small part of a large fetch for long.

Readahead follows each reader. Every read from objects also schedules, on a pool of
`read_concurrency` threads, the GETs of the stream's next `window` bytes (across objects), so that
the reader finds its next blocks fetched or in flight. A stream's window starts at two GETs
(`read_fetch_size` each), doubles each time the reader catches up with it (it had to wait for a
block, or fetch one itself), up to `readahead_bytes`, returns to the start when the reader seeks,
and halves when read-ahead blocks are evicted unread (the reader is slower than the cache can
hold). A fetch larger than `read_fetch_size` is split into that many ranged GETs running at once.

Memory: the block cache holds at most `block_cache_size` bytes of blocks; GETs in flight hold at
most half of that more (read-ahead is skipped beyond it, a reader's own fetch is never refused);
object indexes at most INDEX_CACHE_BYTES; refs at most REF_CACHE_ENTRIES. Waits are bounded by
`read_timeout`.

An object that disappears between the metadata lookup and the GET (compaction or retention
swapped it) makes the read retry against fresh metadata, so a reader never sees a gap.
"""
from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Hashable, NamedTuple, Sequence

from ..config import Config
from ..errors import CorruptDataError, ObjectNotFoundError, ObjectStoreError, OffsetOutOfRangeError, OffsetsLostError
from ..latency import LatencyHistogram
from .logcache import LogCache
from ..metadata import MetadataStore, ObjectRef, ObjectType
from ..objectformat import (BATCH_HEADER_SIZE, BLOCK_HEADER_SIZE, Batch, IndexEntry, decode_blocks, entries_for,
                           index_from_tail, read_blocks, read_index)
from ..objectstore import ObjectStore
from ..threads import normal_priority

_RETRIES = 3
#: Object indexes kept (bytes, estimated): 64 MiB is about 1.2 million index entries.
INDEX_CACHE_BYTES = 64 * 1024 * 1024
#: Object refs kept, over all streams (about 200 bytes each).
REF_CACHE_ENTRIES = 64 * 1024
#: Refs looked up per metadata query.
REF_BATCH = 64
#: Bytes between two wanted blocks of one object that `read_points` reads rather than split the GET
#: (the checkpoints of many partitions lie in one StreamSetObject between their logs' blocks).
LOCATE_GAP = 256 * 1024
#: Streams whose reading position is followed for readahead.
TRACKED_READERS = 4096
_NO_END = (1 << 63) - 1
#: Seconds during which read-ahead does not ask metadata again for objects past a stream's last one.
PAST_END_RECHECK = 1.0
#: A StreamObject of at most this many read_fetch_size is read whole, index and blocks in one GET.
WHOLE_OBJECT_FETCHES = 4


def fetch_end(stream_id: int, start_offset: int, end_offset: int | None, first: int, last: int, readable: str) -> int:
    """Where a fetch from `start_offset` towards `end_offset` ends, in a stream readable over
    [first, last) (`readable` names that range in the error): `end_offset` capped at `last`,
    None meaning `last`. The one rule of every fetch (Stream.fetch, fetch_committed, partitions'
    and s3stream.aio's): as Kafka's Fetch returns what exists below the high watermark, asking
    past the end is not an error; a start below `first` or past `last`, or past `end_offset`, is
    OffsetOutOfRangeError (Kafka's OFFSET_OUT_OF_RANGE)."""
    if not first <= start_offset <= last:
        raise OffsetOutOfRangeError(
            f"stream {stream_id}: fetch from {start_offset} is outside {readable} [{first}, {last}]: start at an "
            f"offset in it")
    end = last if end_offset is None else min(end_offset, last)
    if start_offset > end:
        raise OffsetOutOfRangeError(
            f"stream {stream_id}: fetch from {start_offset} towards {end_offset} starts past its end: give an end "
            f"offset at or after the start")
    return end


class LRUCache:
    """A thread-safe LRU bounded by the total `weight` of its values (object indexes, refs)."""

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

    def pop(self, key: Hashable) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._weight -= old[1]

    @property
    def weight(self) -> int:
        return self._weight


class _Block:
    """A decoded block in the block cache; `unread` while only read-ahead has touched it;
    `buffer` names the GET whose buffer its payloads are views of."""
    __slots__ = ("stream_id", "batches", "nbytes", "unread", "buffer")

    def __init__(self, stream_id: int, batches: list[Batch], nbytes: int, unread: bool) -> None:
        self.stream_id = stream_id
        self.batches = batches
        self.nbytes = nbytes
        self.unread = unread
        self.buffer = -1


class BlockCache:
    """Decoded blocks, kept and evicted a GET at a time (LRU): the blocks of one GET are views of
    its buffer, so the buffer's size is what they weigh and what evicting them frees.
    `on_evict(block)` is called for each block evicted. Not thread-safe: the Reader's lock
    guards it."""

    def __init__(self, capacity: int, on_evict: Callable[[_Block], None]) -> None:
        self.capacity = capacity
        self.weight = 0
        self._on_evict = on_evict
        self._blocks: dict[tuple[int, int], _Block] = {}
        self._buffers: OrderedDict[int, tuple[list[tuple[int, int]], int]] = OrderedDict()
        self._next = 0

    def get(self, key: tuple[int, int]) -> _Block | None:
        block = self._blocks.get(key)
        if block is not None:
            self._buffers.move_to_end(block.buffer)
        return block

    def put(self, blocks: list[tuple[tuple[int, int], _Block]], weight: int) -> None:
        """Cache the blocks of one GET of `weight` bytes (blocks already cached keep their copy)."""
        self._next += 1
        keys = []
        for key, block in blocks:
            if key not in self._blocks:
                block.buffer = self._next
                self._blocks[key] = block
                keys.append(key)
        if not keys:
            return
        self._buffers[self._next] = (keys, weight)
        self.weight += weight
        while self.weight > self.capacity and len(self._buffers) > 1:
            _, (evicted, w) = self._buffers.popitem(last=False)
            self.weight -= w
            for key in evicted:
                self._on_evict(self._blocks.pop(key))


class _Follow:
    """A stream's reader: where its next sequential read starts, where its last read from
    objects ended, its read-ahead window (bytes), and whether read-ahead is queued for it."""
    __slots__ = ("next_pos", "read_to", "window", "queued", "past_end", "past_end_at")

    def __init__(self, window: int) -> None:
        self.next_pos = -1
        self.read_to = 0
        self.window = window
        self.queued = False
        self.past_end = _NO_END          # metadata had no object at or past this offset...
        self.past_end_at = 0.0           # ...when last asked (time.monotonic())


class _ObjectIndex(list):
    """An object's index entries, and each stream's of them: a StreamSetObject holds the
    blocks of thousands of streams, and a read of one finds its own by a lookup, not a scan
    (a failover's partition opens read thousands of them out of one object)."""

    def __init__(self, entries: list[IndexEntry]) -> None:
        super().__init__(entries)
        self.by_stream: dict[int, list[IndexEntry]] = {}
        for e in entries:
            self.by_stream.setdefault(e.stream_id, []).append(e)


def _stream_entries(index: _ObjectIndex, stream_id: int, start: int, end: int) -> list[IndexEntry]:
    """entries_for, by the index's per-stream lookup."""
    return entries_for(index.by_stream.get(stream_id, ()), stream_id, start, end)


class _Unit(NamedTuple):
    """Consecutive blocks of one stream in one object: one ranged GET."""
    ref: ObjectRef
    entries: list[IndexEntry]
    nbytes: int


class Reader:
    def __init__(self, store: ObjectStore, metadata: MetadataStore, cache: LogCache, config: Config) -> None:
        self._store = store
        self._meta = metadata
        self._cache = cache
        fetch_size = config.read_fetch_size
        assert fetch_size is not None       # Config.__post_init__ resolves None
        self._fetch_size = fetch_size
        self._max_window = config.readahead_bytes
        self._min_window = min(config.readahead_bytes, 2 * fetch_size)
        self._timeout = config.read_timeout
        self._inflight_cap = config.block_cache_size // 2      # Config: read_fetch_size <= a quarter of it
        self._whole_object = WHOLE_OBJECT_FETCHES * fetch_size
        self.blocks = BlockCache(config.block_cache_size, on_evict=self._evicted)
        self.indexes = LRUCache(INDEX_CACHE_BYTES)
        self._refs = LRUCache(REF_CACHE_ENTRIES)
        self._pool = ThreadPoolExecutor(config.read_concurrency, thread_name_prefix="s3stream-read",
                                        initializer=normal_priority)
        self._lock = threading.Lock()
        self._inflight: dict[tuple[int, int], Future] = {}
        self._inflight_bytes = 0
        self._demanded: set[tuple[int, int]] = set()    # in flight as read-ahead, now awaited
        self._index_loads: dict[int, Future] = {}
        self._reserved: set[int] = set()                # whole objects queued for read-ahead
        self._follow: OrderedDict[int, _Follow] = OrderedDict()
        self._closed = False
        self.stats = dict(object_reads=0, object_bytes=0, cache_reads=0, block_hits=0, block_waits=0,
                          block_fetches=0, readahead_bytes=0, readahead_used_bytes=0, readahead_wasted_bytes=0,
                          readahead_skipped=0, metadata_lookups=0, max_inflight_bytes=0,
                          whole_object_reads=0)
        self.fetch_latency = LatencyHistogram()

    def close(self) -> None:
        """Stop read-ahead: queued GETs are dropped, running ones end within the store's timeouts."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.stats, inflight_bytes=self._inflight_bytes, block_cache_bytes=self.blocks.weight,
                        index_cache_bytes=self.indexes.weight, followed_streams=len(self._follow),
                        fetch_latency=self.fetch_latency.snapshot())

    # ---- the read -----------------------------------------------------------------------------

    def read(self, stream_id: int, start: int, end: int, max_bytes: int, stream_end: int | None = None) -> list[Batch]:
        """Batches covering [start, end) from the one containing `start`, up to `max_bytes`
        (always at least one batch when start < end). Its seconds go to `fetch_latency` (a
        microsecond per fetch; read_cached, the event loop's inline path, is not timed).
        `stream_end`: the stream's committed end, if the caller knows it: a read that reaches it
        queues no read-ahead (there is nothing past it to look up: a partition's open reads
        its last checkpoint, thousands of them at a node's restart)."""
        t0 = time.perf_counter()
        try:
            return self._read(stream_id, start, end, max_bytes, stream_end)
        finally:
            self.fetch_latency.observe(time.perf_counter() - t0)

    def _read(self, stream_id: int, start: int, end: int, max_bytes: int, stream_end: int | None = None) -> list[Batch]:
        out: list[Batch] = []
        size = 0
        pos = start
        while pos < end:
            budget = max_bytes - size
            if out and budget <= 0:
                break
            got = self.read_cached(stream_id, pos, end, max(budget, 1))
            if not got:
                got = self._read_objects(stream_id, pos, end, max(budget, 1), first=not out, stream_end=stream_end)
                if not got and out:
                    break                        # the next block does not fit what is left
            if not got:
                lost = self._meta.get_stream(stream_id).lost_range_at(pos)
                if lost is not None:
                    raise OffsetsLostError(stream_id, lost.start_offset, lost.end_offset, lost.node_id)
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

    def read_cached(self, stream_id: int, start: int, end: int, max_bytes: int) -> list[Batch]:
        """The log cache's batches from the one containing `start` towards `end`, up to
        `max_bytes`: a copy under the cache's lock, no I/O. Empty if the cache does not hold
        `start` (its batches are only in objects)."""
        got = self._cache.read(stream_id, start, end, max_bytes)
        if got:
            self.stats["cache_reads"] += 1
        return got

    def _read_objects(self, stream_id: int, pos: int, end: int, budget: int, first: bool = True,
                      stream_end: int | None = None) -> list[Batch]:
        last_error: Exception | None = None
        for attempt in range(_RETRIES):
            ref = self._ref_at(stream_id, pos, end, fresh=attempt > 0)
            if ref is None:
                # Maybe just committed from the cache's view, or swapped by compaction: look again.
                cached = self._cache.read(stream_id, pos, end, budget)
                if cached:
                    return cached
                continue
            try:
                return self._read_from(stream_id, ref, pos, end, budget, first, stream_end)
            except ObjectNotFoundError as e:
                last_error = e
                self.indexes.pop(ref.object_id)
        if last_error is not None:
            raise CorruptDataError(
                f"stream {stream_id}: object for offset {pos} is missing from the store: {last_error}")
        return []

    def _read_from(self, stream_id: int, first_ref: ObjectRef, pos: int, end: int, budget: int,
                   first: bool, stream_end: int | None = None) -> list[Batch]:
        """Read from `first_ref` (and the objects after it) up to `budget` bytes; read ahead past it.
        A `first` read returns at least one batch; a later part of the same fetch claims only
        blocks whose payloads all fit its budget (it never waits for a block it would drop), and
        may return nothing."""
        wanted: list[tuple[ObjectRef, IndexEntry]] = []
        total = 0
        at = pos
        ref: ObjectRef | None = first_ref
        while ref is not None and total < budget and at < end:
            for e in _stream_entries(self._index(ref, budget), stream_id, at, min(end, ref.end_offset)):
                if wanted and total >= budget:
                    break
                if not first and not wanted and _payload_bytes(e) > budget:
                    return []
                wanted.append((ref, e))
                total += e.block_size
                at = e.end_offset
            if total >= budget or at >= end or at < ref.end_offset:
                break
            ref = self._ref_at(stream_id, at, end, cached_only=True)
        if not wanted:
            raise CorruptDataError(
                f"stream {stream_id}: object {first_ref.key} is listed for offset {pos} but its index has no block "
                f"there")
        futures, waited = self._claim(stream_id, wanted, demand=True)
        if stream_end is None or at < stream_end:
            self._follow_reader(stream_id, pos, at, waited)
        out: list[Batch] = []
        try:
            self._collect(futures, wanted, out, pos, end, budget)
        finally:
            if out:
                self._reader_at(stream_id, out[-1].end_offset)
        return out

    def _collect(self, futures: list[Future], wanted: list[tuple[ObjectRef, IndexEntry]], out: list[Batch],
                 pos: int, end: int, budget: int) -> None:
        size = 0
        for (ref, e), fut in zip(wanted, futures):
            batches = self._wait(fut, f"read of object {ref.key} bytes [{e.block_position}, "
                                      f"{e.block_position + e.block_size})")
            for batch in batches:
                if batch.end_offset <= pos:
                    continue
                if batch.base_offset >= end or (out and size + len(batch.payload) > budget):
                    return
                out.append(batch)
                size += len(batch.payload)
                pos = batch.end_offset

    def _wait(self, fut: Future, what: str):
        """The result of a GET running on another thread, waited for at most read_timeout."""
        try:
            return fut.result(self._timeout)
        except FutureTimeout:
            raise ObjectStoreError(
                f"{what} did not complete within read_timeout={self._timeout}s; the object store is slow or "
                "unreachable") from None

    # ---- blocks: cached, in flight, or fetched ----------------------------------------------------

    def _claim(self, stream_id: int, wanted: list[tuple[ObjectRef, IndexEntry]],
               demand: bool, gap: int = 0) -> tuple[list[Future], bool]:
        """A future per wanted block: done if cached, the in-flight GET's if one is running, else
        a new GET's (grouped into units: blocks of one object at most `gap` bytes apart, in
        position order, up to the fetch size, share a GET). Read-ahead (demand=False) skips what
        is cached or in flight and stops at the in-flight byte cap; it gets futures for the GETs
        it started only. Returns (futures, whether any block was not cached yet)."""
        futures: list[Future] = []
        units: list[tuple[_Unit, list[Future]]] = []
        waited = False
        with self._lock:
            if self._closed:
                raise ObjectStoreError("the stream client is closed; its reader takes no more reads")
            for ref, e in wanted:
                key = (ref.object_id, e.block_position)
                fut = self._inflight.get(key)
                if fut is not None:
                    waited = True
                    if demand:
                        self.stats["block_waits"] += 1
                        self._demanded.add(key)
                        futures.append(fut)
                    continue
                block = self.blocks.get(key)
                if block is not None:
                    if demand:
                        self.stats["block_hits"] += 1
                        if block.unread:
                            block.unread = False
                            self.stats["readahead_used_bytes"] += e.block_size
                        fut = Future()
                        fut.set_result(block.batches)
                        futures.append(fut)
                    continue
                if not demand and self._inflight_bytes + e.block_size > self._inflight_cap:
                    self.stats["readahead_skipped"] += 1
                    break
                waited = True
                fut = Future()
                self._inflight[key] = fut
                self._inflight_bytes += e.block_size
                futures.append(fut)
                last = units[-1][0] if units else None
                last_end = last.entries[-1].block_position + last.entries[-1].block_size if last else 0
                if (last is not None and last.ref.object_id == ref.object_id
                        and last_end <= e.block_position <= last_end + gap
                        and last.nbytes + (e.block_position - last_end) + e.block_size <= self._fetch_size):
                    # The bytes between the blocks are read too (and weigh in the cache with them).
                    self._inflight_bytes += e.block_position - last_end
                    last.entries.append(e)
                    units[-1] = (_Unit(ref, last.entries, last.nbytes + e.block_position - last_end + e.block_size),
                                 units[-1][1] + [fut])
                else:
                    units.append((_Unit(ref, [e], e.block_size), [fut]))
            self.stats["max_inflight_bytes"] = max(self.stats["max_inflight_bytes"], self._inflight_bytes)
            if demand:
                self.stats["block_fetches"] += sum(len(u.entries) for u, _ in units)
            else:
                self.stats["readahead_bytes"] += sum(u.nbytes for u, _ in units)
        # A reader's own first GET runs on its thread (it would wait for it anyway); the rest run
        # on the pool, at once.
        for i, (unit, futs) in enumerate(units):
            if demand and i == 0:
                continue
            self._pool.submit(self._fetch, stream_id, unit, futs, not demand)
        if demand and units:
            self._fetch(stream_id, units[0][0], units[0][1], False)
        return futures, waited

    def _fetch(self, stream_id: int, unit: _Unit, futures: list[Future], readahead: bool) -> None:
        """One ranged GET: decode, cache and hand out its blocks (or its error to every waiter)."""
        keys = [(unit.ref.object_id, e.block_position) for e in unit.entries]
        try:
            decoded = read_blocks(self._store, unit.ref.key, unit.entries)
        except BaseException as error:
            with self._lock:
                for key in keys:
                    self._inflight.pop(key, None)
                    self._demanded.discard(key)
                self._inflight_bytes -= unit.nbytes
            for fut in futures:
                fut.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        with self._lock:
            blocks = []
            for key, e, batches in zip(keys, unit.entries, decoded):
                unread = readahead
                if key in self._demanded:
                    self._demanded.discard(key)
                    unread = False
                    self.stats["readahead_used_bytes"] += e.block_size
                blocks.append((key, _Block(e.stream_id, batches, e.block_size, unread)))
                self._inflight.pop(key, None)
            self.blocks.put(blocks, unit.nbytes)
            self._inflight_bytes -= unit.nbytes
            self.stats["object_reads"] += 1
            self.stats["object_bytes"] += unit.nbytes
        for fut, batches in zip(futures, decoded):
            fut.set_result(batches)

    def _evicted(self, block: _Block) -> None:
        # Called under self._lock (the block cache is only used while it is held).
        if block.unread:
            self.stats["readahead_wasted_bytes"] += block.nbytes
            follow = self._follow.get(block.stream_id)
            if follow is not None:
                follow.window = max(self._min_window, follow.window // 2)

    # ---- readahead ------------------------------------------------------------------------------

    def _follow_reader(self, stream_id: int, pos: int, read_to: int, caught_up: bool) -> None:
        """A read of the stream at `pos` is fetching up to offset `read_to`: grow or reset the
        stream's window, and queue read-ahead of the `window` bytes past `read_to`."""
        with self._lock:
            follow = self._follow.get(stream_id)
            if follow is None or follow.next_pos != pos:
                follow = _Follow(self._min_window)       # a new reader, or one that sought
                self._follow[stream_id] = follow
                if len(self._follow) > TRACKED_READERS:
                    self._follow.popitem(last=False)
            elif caught_up:
                follow.window = min(self._max_window, follow.window * 2)
            self._follow.move_to_end(stream_id)
            follow.read_to = read_to
            if follow.queued or self._closed:
                return
            follow.queued = True
        try:
            self._pool.submit(self._readahead, stream_id)
        except RuntimeError:
            pass                                         # closing: no more read-ahead

    def _reader_at(self, stream_id: int, pos: int) -> None:
        """The read returned up to `pos`: a read starting there is sequential."""
        with self._lock:
            follow = self._follow.get(stream_id)
            if follow is not None:
                follow.next_pos = pos

    def _readahead(self, stream_id: int) -> None:
        """Claim (fetch) the stream's blocks in the window past its reader's latest read:
        those already cached or in flight cost a lookup."""
        with self._lock:
            follow = self._follow.get(stream_id)
            if follow is None:
                return
            follow.queued = False
            at, window = follow.read_to, follow.window
        try:
            wanted: list[tuple[ObjectRef, IndexEntry]] = []
            total = 0
            while total < window:
                # Past the last committed object, ask metadata again only now and then: a reader
                # near the stream's end would otherwise query it on every fetch.
                known_past = at >= follow.past_end and time.monotonic() - follow.past_end_at < PAST_END_RECHECK
                ref = self._ref_at(stream_id, at, _NO_END, cached_only=known_past)
                if ref is None:
                    if not known_past:
                        follow.past_end, follow.past_end_at = at, time.monotonic()
                    break                        # past what is committed: the log cache has it
                if self._is_whole(ref) and self.indexes.get(ref.object_id) is None:
                    # Read the small StreamObject whole, on its own thread.
                    with self._lock:
                        if ref.object_id in self._index_loads or ref.object_id in self._reserved:
                            pass
                        elif self._inflight_bytes + ref.size > self._inflight_cap:
                            self.stats["readahead_skipped"] += 1
                            break
                        else:
                            # Counted in flight from now; _read_whole takes the reservation over.
                            self._reserved.add(ref.object_id)
                            self._inflight_bytes += ref.size
                            self.stats["readahead_bytes"] += ref.size
                            self._pool.submit(self._prefetch_whole, ref)
                    total += ref.size
                    at = ref.end_offset
                    continue
                for e in _stream_entries(self._index(ref), stream_id, at, ref.end_offset):
                    if total >= window:
                        break
                    wanted.append((ref, e))
                    total += e.block_size
                at = ref.end_offset
            if wanted:
                self._claim(stream_id, wanted, demand=False)
        except Exception:
            pass          # a hint only: the reader fetches these blocks itself and sees any error

    # ---- metadata: refs and indexes -----------------------------------------------------------

    def _ref_at(self, stream_id: int, pos: int, end: int, fresh: bool = False,
                cached_only: bool = False) -> ObjectRef | None:
        """The committed object holding `pos` of the stream, from the per-stream ref cache (looked
        up in metadata when missing, when `pos` is past the cached refs, or when `fresh`)."""
        refs = None if fresh else self._refs.get(stream_id)
        if refs is not None:
            i = bisect.bisect_right(refs, pos, key=_end_offset)
            if i < len(refs) and refs[i].start_offset <= pos:
                return refs[i]
        if cached_only:
            return None
        with self._lock:
            self.stats["metadata_lookups"] += 1
        # Look ahead: the refs after `pos` are what a catch-up reader needs next.
        refs = self._meta.get_object_refs(stream_id, pos, _NO_END, limit=REF_BATCH)
        if not refs or refs[0].start_offset > pos or refs[0].start_offset >= end:
            return None                          # not committed (yet), or trimmed
        self._refs.put(stream_id, refs, len(refs))
        return refs[0]

    def read_points(self, points: Sequence[tuple[int, int]]) -> dict[tuple[int, int], Batch]:
        """The committed batch holding each (stream_id, offset) point, read together: the
        objects not in the ref cache looked up in ONE metadata read, their indexes read in
        parallel, their blocks in a few ranged GETs (blocks of one object up to LOCATE_GAP bytes
        apart share one). What a batch of partition opens needs: each one's last checkpoint,
        thousands of them after a failover, most in one StreamSetObject. A point no committed
        object holds, or whose read failed, is absent: the caller reads it alone (and sees why)."""
        points = list(dict.fromkeys(points))
        missing = [(sid, pos) for sid, pos in points if self._ref_at(sid, pos, pos + 1, cached_only=True) is None]
        if missing:
            with self._lock:
                self.stats["metadata_lookups"] += 1
            found: dict[int, dict[int, ObjectRef]] = {}
            for (sid, _), got in self._meta.get_object_refs_at(missing).items():
                found.setdefault(sid, {})[got.start_offset] = got
            for sid, refs in found.items():
                # Several points of one stream: all their refs, beside those cached already.
                for ref in self._refs.get(sid) or ():
                    refs.setdefault(ref.start_offset, ref)
                merged = sorted(refs.values(), key=_end_offset)
                self._refs.put(sid, merged, len(merged))
        by_object: dict[int, tuple[ObjectRef, list[tuple[int, int]]]] = {}
        for sid, pos in points:
            ref = self._ref_at(sid, pos, pos + 1, cached_only=True)
            if ref is not None:
                by_object.setdefault(ref.object_id, (ref, []))[1].append((sid, pos))
        try:
            loads = {oid: self._pool.submit(self._index, ref) for oid, (ref, _) in by_object.items()
                     if self.indexes.get(oid) is None}
        except RuntimeError:
            raise ObjectStoreError("the stream client is closed; its reader takes no more reads") from None
        blocks: dict[tuple[int, int], tuple[ObjectRef, IndexEntry]] = {}
        block_of: dict[tuple[int, int], tuple[int, int]] = {}
        for oid, (ref, at) in by_object.items():
            try:
                index = self._wait(loads[oid], f"reading the index of object {ref.key}") if oid in loads \
                    else self._index(ref)
            except Exception:     # noqa: BLE001 - those points are read alone, which says why
                continue
            for sid, pos in at:
                for e in _stream_entries(index, sid, pos, pos + 1):
                    blocks[(oid, e.block_position)] = (ref, e)
                    block_of[(sid, pos)] = (oid, e.block_position)
        keys = sorted(blocks)
        futures, _ = self._claim(0, [blocks[k] for k in keys], demand=True, gap=LOCATE_GAP) if keys else ([], False)
        decoded: dict[tuple[int, int], list[Batch]] = {}
        for key, fut in zip(keys, futures):
            try:
                decoded[key] = self._wait(fut, f"read of object {blocks[key][0].key} block {key[1]}")
            except Exception:     # noqa: BLE001 - as above
                continue
        out: dict[tuple[int, int], Batch] = {}
        for point, key in block_of.items():
            for batch in decoded.get(key, ()):
                if batch.base_offset <= point[1] < batch.end_offset:
                    out[point] = batch
                    break
        return out

    def forget_stream(self, stream_id: int) -> None:
        """Drop the cached refs and the followed position of a stream (trimmed, destroyed)."""
        self._refs.pop(stream_id)
        with self._lock:
            self._follow.pop(stream_id, None)

    def _is_whole(self, ref: ObjectRef) -> bool:
        return ref.type == ObjectType.STREAM_OBJECT and ref.size <= self._whole_object

    def _index(self, ref: ObjectRef, budget: int = 0) -> _ObjectIndex:
        """The object's index, cached; one GET per object however many threads want it. A small
        StreamObject is read whole if read-ahead asks (`budget` 0) or if the reader's fetch
        wants at least a quarter of it: a point read does not pull 16 MiB."""
        index = self.indexes.get(ref.object_id)
        if index is not None:
            return index
        with self._lock:
            loading = self._index_loads.get(ref.object_id)
            if loading is None:
                mine: Future[list[IndexEntry]] = Future()
                self._index_loads[ref.object_id] = mine
        if loading is not None:
            return self._wait(loading, f"reading the index of object {ref.key}")
        try:
            whole = self._is_whole(ref) and (budget == 0 or WHOLE_OBJECT_FETCHES * budget >= ref.size)
            index = _ObjectIndex(self._read_whole(ref, budget == 0) if whole
                                 else read_index(self._store, ref.key, ref.size))
            self.indexes.put(ref.object_id, index, 64 + 96 * len(index))
        except BaseException as e:
            mine.set_exception(e)
            raise
        else:
            mine.set_result(index)
            return index
        finally:
            with self._lock:
                del self._index_loads[ref.object_id]

    def _prefetch_whole(self, ref: ObjectRef) -> None:
        try:
            self._index(ref)
        except Exception:
            pass          # a hint only: the reader reads this object itself and sees any error
        finally:
            with self._lock:
                if ref.object_id in self._reserved:       # cached meanwhile: never read
                    self._reserved.discard(ref.object_id)
                    self._inflight_bytes -= ref.size

    def _read_whole(self, ref: ObjectRef, readahead: bool) -> list[IndexEntry]:
        """A small StreamObject in one GET: its index, and all its blocks into the cache (the
        stream's reader wants all of them), instead of a GET of the tail and one of the blocks."""
        with self._lock:
            if ref.object_id in self._reserved:
                self._reserved.discard(ref.object_id)     # read-ahead counted it already
            else:
                self._inflight_bytes += ref.size
            self.stats["max_inflight_bytes"] = max(self.stats["max_inflight_bytes"], self._inflight_bytes)
        try:
            raw = self._store.get(ref.key)
            index = index_from_tail(None, ref.key, ref.size, raw, 0)
            decoded = decode_blocks(ref.key, raw, 0, index)
        finally:
            with self._lock:
                self._inflight_bytes -= ref.size
        with self._lock:
            self.stats["object_reads"] += 1
            self.stats["object_bytes"] += ref.size
            self.stats["whole_object_reads"] += 1
            self.blocks.put([((ref.object_id, e.block_position), _Block(e.stream_id, batches, e.block_size, readahead))
                             for e, batches in zip(index, decoded) if (ref.object_id, e.block_position) not in self._inflight],
                            ref.size)
        return index


def _end_offset(ref: ObjectRef) -> int:
    return ref.end_offset


def _payload_bytes(e: IndexEntry) -> int:
    """The payload bytes of an index entry's block (its size less the block and batch headers)."""
    return e.block_size - BLOCK_HEADER_SIZE - BATCH_HEADER_SIZE * e.batch_count
