"""The read path (s3stream/engine/readpath.py) with the real parts: catch-up from objects on a cold node,
zero-copy payloads, fetch bounds, memory bounds under 100 concurrent readers, seeks, and object
stores that fail, corrupt, hang or lose a GET.

Data is written on node 1 and committed by closing it; a fresh node (new id, new WAL, cold
caches) then reads it from objects."""
from __future__ import annotations

import random
import threading
import time
import tracemalloc

import pytest

import s3stream
from s3stream import RecordBatch, StreamClient
from s3stream.errors import ObjectStoreError
from s3stream.metadata import ObjectMeta, ObjectState, ObjectType, open_metadata
from s3stream.objectformat import IndexEntry, read_index
from s3stream.objectstore import FaultInjectingObjectStore, LocalObjectStore, open_object_store
from conftest import KiB, MiB, small_config
from s3stream.cluster import open_partition, read_partition

Batches = list[tuple[int, int, bytes]]


def node(tmp_path, node_id, store, config):
    """A client with its own WAL; every node of a test shares its metadata database."""
    return StreamClient(node_id, tmp_path / f"node{node_id}.wal", store, f"sqlite:///{tmp_path}/meta.db", config)


def reader_config(**overrides):
    """small_config with reads scaled down: 64 KiB GETs, so the first window is 128 KiB."""
    kw = {"reclaim_interval": None, "read_fetch_size": 64 * KiB, "readahead_bytes": 512 * KiB,
          "block_cache_size": 2 * MiB}
    kw.update(overrides)
    return small_config(**kw)


def write_committed(tmp_path, store, plans, seed=0, config=None) -> dict[int, Batches]:
    """On node 1, create a stream per plan (a list of payload sizes) and append to all of them in
    turn, one batch each; then close the node so that everything is committed to objects."""
    rng = random.Random(seed)
    writer = node(tmp_path, 1, store, config or small_config(reclaim_interval=None))
    streams = [writer.create_stream() for _ in plans]
    pending = []
    for i in range(max(map(len, plans))):
        for stream, sizes in zip(streams, plans):
            if i < len(sizes):
                payload, count = rng.randbytes(sizes[i]), rng.randrange(1, 5)
                pending.append((stream.stream_id, stream.append(RecordBatch(payload, count)), payload, count))
    expected: dict[int, Batches] = {s.stream_id: [] for s in streams}
    for stream_id, future, payload, count in pending:
        expected[stream_id].append((future.result(30).base_offset, count, payload))
    writer.close()
    return expected


def as_tuples(batches) -> Batches:
    return [(b.base_offset, b.count, bytes(b.payload)) for b in batches]


def read_sequential(stream, max_bytes, start=None) -> tuple[Batches, list[int]]:
    """(every batch from `start` to the confirm offset, the offset of each fetch made), checking
    that each fetch begins with the batch holding its offset and that offsets are dense."""
    pos = stream.start_offset if start is None else start
    out: Batches = []
    fetches = []
    while pos < stream.confirm_offset:
        batches = stream.fetch(pos, max_bytes=max_bytes).batches
        fetches.append(pos)
        assert batches and batches[0].base_offset <= pos < batches[0].end_offset
        for b in as_tuples(batches):
            assert not out or b[0] == out[-1][0] + out[-1][1]
            out.append(b)
        pos = batches[-1].end_offset
    return out, fetches


def stored_objects(tmp_path, store_url, stream_ids) -> list[tuple[ObjectMeta, list[IndexEntry]]]:
    """The committed objects holding data of the streams, each with those streams' index entries
    (data blocks) in offset order."""
    meta = open_metadata(f"sqlite:///{tmp_path}/meta.db")
    store = open_object_store(store_url)
    try:
        out = []
        for o in meta.list_objects(state=ObjectState.COMMITTED):
            entries = [e for e in read_index(store, o.key, o.size) if e.stream_id in stream_ids]
            if entries:
                out.append((o, sorted(entries, key=lambda e: (e.stream_id, e.start_offset))))
    finally:
        store.close()
        meta.close()
    return out


def stored_entries(tmp_path, store_url, stream_ids) -> list[IndexEntry]:
    """The data blocks of the streams in committed objects, by stream and offset."""
    entries = [e for _, es in stored_objects(tmp_path, store_url, stream_ids) for e in es]
    return sorted(entries, key=lambda e: (e.stream_id, e.start_offset))


def settle(client, timeout=10.0, poll=0.05) -> dict:
    """Read stats once read-ahead has gone quiet (nothing in flight, no new read-ahead for a few
    polls); gives up after `timeout` and returns the latest stats (the callers' bounds are upper
    bounds, which a later read-ahead could only make harder to meet)."""
    deadline = time.monotonic() + timeout
    last, quiet = None, 0
    while time.monotonic() < deadline and quiet < 4:
        time.sleep(poll)
        stats = client.stats()["read"]
        key = (stats["readahead_bytes"], stats["object_reads"], stats["inflight_bytes"], stats["metadata_lookups"])
        quiet = quiet + 1 if key == last and stats["inflight_bytes"] == 0 else 0
        last = key
    return client.stats()["read"]


def wait_until(predicate, what, timeout=10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting ({timeout} s) until {what}")
        time.sleep(0.01)


class GatedStore:
    """A local store whose block GETs (every GET but the one of an object's tail, which holds its
    index) can be made to fail, or to wait for `release` when they start at or past `hold_from`
    (or read the whole object).
    FaultInjectingObjectStore fails the next GETs, whichever thread makes them; these faults aim
    at the GETs of blocks, not indexes."""

    def __init__(self, root) -> None:
        self.inner = LocalObjectStore(str(root))
        self.url = self.inner.url
        self.part_size = self.inner.part_size
        self.fail_blocks = False
        self.hold_from: int | None = None
        self.release = threading.Event()

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        if end is None or start == 0 or end < self.inner.size(key):      # not a read of the tail only
            if self.fail_blocks:
                raise ObjectStoreError(f"injected failure of get {key!r} [{start}, {end})")
            if self.hold_from is not None and (start >= self.hold_from or end is None):
                self.release.wait(30)
        return self.inner.get(key, start, end)

    def put(self, key, data) -> None:
        self.inner.put(key, data)

    def size(self, key) -> int:
        return self.inner.size(key)

    def delete(self, keys) -> None:
        self.inner.delete(keys)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def close(self) -> None:
        self.inner.close()


def one_stream(tmp_path, sizes, seed=0, config=None) -> tuple[str, int, Batches]:
    """Write one stream of `sizes` payloads to a local store: (store URL, stream id, batches)."""
    store = f"file://{tmp_path}/objects"
    expected = write_committed(tmp_path, store, [sizes], seed, config)
    (stream_id, batches), = expected.items()
    return store, stream_id, batches


# ---- catch-up ----------------------------------------------------------------------------------

def test_catch_up_from_objects_reads_every_byte_with_readahead(tmp_path, store_url):
    rng = random.Random(1)
    plans = [
        [rng.randrange(5 * KiB, 20 * KiB) for _ in range(200)],     # its own StreamObjects
        [rng.randrange(1, 64) for _ in range(1500)],                 # tiny: many batches a block
        [rng.randrange(65 * KiB, 128 * KiB) for _ in range(12)],     # each batch larger than a block
        [rng.choice([1, 100, 5000, 60 * KiB, 128 * KiB]) for _ in range(60)],
        [1],
    ]
    expected = write_committed(tmp_path, store_url, plans)
    config = reader_config()
    max_bytes = 16 * KiB
    reader = node(tmp_path, 2, store_url, config)
    fetches = tail_fetches = 0
    for stream_id, batches in expected.items():
        got, starts = read_sequential(reader.open_stream(stream_id), max_bytes=max_bytes)
        assert got == batches
        fetches += len(starts)
        # Fetches whose read-ahead may reach past the stream's last object (the window, the
        # fetch, and a block of 128 KiB at either end).
        tail = config.readahead_bytes + max_bytes + 2 * (128 * KiB + 64)
        tail_fetches += sum(1 for pos in starts if sum(len(p) for b, c, p in batches if b + c > pos) <= tail)
    stats = settle(reader)
    reader.close()

    objects = stored_objects(tmp_path, store_url, set(expected))
    entries = [e for _, es in objects for e in es]
    block_bytes = sum(e.block_size for e in entries)
    # A small StreamObject may be read whole: its index and footer too.
    whole_extra = sum(o.size - sum(e.block_size for e in es) for o, es in objects if o.type == ObjectType.STREAM_OBJECT)
    assert stats["readahead_used_bytes"] > 0
    # The reader fetched few blocks itself: read-ahead had most of them cached or in flight.
    assert stats["block_fetches"] < len(entries)
    # The cache (2 MiB) holds the largest window (512 KiB): every block was read once, none twice.
    assert block_bytes <= stats["object_bytes"] <= block_bytes + whole_extra
    assert stats["readahead_wasted_bytes"] == 0
    assert stats["inflight_bytes"] == 0
    # Object refs are cached per stream (64 a lookup, fewer than 64 objects here): metadata is
    # asked once per stream, and by read-ahead past the stream's end (at most once per fetch
    # there, see test_reader_near_the_committed_end_does_not_query_metadata_per_fetch).
    assert len(objects) < 64 and fetches > 200 and tail_fetches < fetches // 2
    streams = len(expected)
    assert stats["metadata_lookups"] <= 2 * streams + tail_fetches


# ---- zero copy ---------------------------------------------------------------------------------

def test_a_read_that_reaches_the_committed_end_looks_up_nothing_past_it(tmp_path):
    """fetch_committed of a stream's last batch (a partition's open reads its last checkpoint,
    thousands at a node's restart) queues no read-ahead: one object lookup, not two; given the
    stream's row (`known`), no read of the stream either (reads short of the end read ahead:
    test_catch_up_from_objects_reads_every_byte_with_readahead)."""
    store, stream_id, batches = one_stream(tmp_path, [3000] * 40, config=reader_config())
    reader = node(tmp_path, 2, store, reader_config())
    try:
        meta = reader.metadata
        calls: list[str] = []
        for name in ("get_object_refs", "get_stream"):
            real = getattr(meta, name)
            setattr(meta, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
        row = meta.get_stream(stream_id)
        calls.clear()
        base, count, payload = batches[-1]
        got = reader.fetch_committed(stream_id, base, base + count, known=row)
        assert as_tuples(got.batches) == [batches[-1]]
        time.sleep(0.3)                                   # read-ahead, if queued, has run by now
        assert calls == ["get_object_refs"], calls
        with pytest.raises(s3stream.InvalidArgumentError, match="known describes stream"):
            reader.fetch_committed(stream_id + 1, 0, 1, known=row)
    finally:
        reader.close()


def test_fetch_committed_at_reads_many_streams_points_in_one_lookup_and_few_gets(tmp_path):
    """fetch_committed_at (a batch of partition opens reading each one's last checkpoint): the
    batch holding each (stream, offset) point, the same as fetch_committed returns there, with
    ONE metadata lookup for all of them and a few ranged GETs (blocks of one object share one),
    not a lookup and a GET each. Points no object holds (past the end, an unknown stream) are
    absent; a point whose object is gone from the store is absent too, the rest still read."""
    store = open_object_store(f"file://{tmp_path}/objects")
    expected = write_committed(tmp_path, store, [[200] * 3 for _ in range(30)], seed=5)
    expected.update(write_committed(tmp_path, store, [[200] * 3 for _ in range(30)], seed=6))   # other objects
    reader = node(tmp_path, 2, store, reader_config())
    try:
        meta = reader.metadata
        calls: list[str] = []
        for name in ("get_object_refs", "get_object_refs_at", "get_stream"):
            real = getattr(meta, name)
            setattr(meta, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
        points = {}
        for stream_id, batches in expected.items():
            base, count, payload = batches[-1]
            points[(stream_id, base + count - 1)] = batches[-1]
            points[(stream_id, batches[0][0])] = batches[0]
        reads_before = reader._reader.stats["object_reads"]
        got = reader.fetch_committed_at([*points, (999_999, 0), (next(iter(expected)), 10_000)])
        assert {p: as_tuples([b])[0] for p, b in got.items()} == points
        assert calls == ["get_object_refs_at"], calls
        gets = reader._reader.stats["object_reads"] - reads_before
        objects = {r.object_id for sid in expected for r in meta.get_object_refs(sid, 0, 1 << 40)}
        assert gets <= 2 * len(objects), (gets, len(objects))     # not one per point (120)
        # The same as fetch_committed, point by point.
        for (stream_id, pos), batch in list(got.items())[:5]:
            assert as_tuples(reader.fetch_committed(stream_id, pos, pos + 1).batches)[:1] == as_tuples([batch])
    finally:
        reader.close()
    # An object gone from the store: its points are absent, fetch_committed says why.
    reader = node(tmp_path, 3, store, reader_config())
    try:
        victim = reader.metadata.get_object_refs(next(iter(expected)), 0, 1 << 40)[0].key
        store.delete([victim])
        gone = {(r.stream_id, pos) for (sid, pos) in points
                for r in reader.metadata.get_object_refs(sid, pos, pos + 1) if r.key == victim}
        got = reader.fetch_committed_at(list(points))
        assert gone and len(gone) < len(points)
        assert {p: as_tuples([b])[0] for p, b in got.items()} == {p: b for p, b in points.items() if p not in gone}
        with pytest.raises(s3stream.CorruptDataError, match="missing from the store"):
            reader.fetch_committed(*next(iter(gone)), next(iter(gone))[1] + 1)
    finally:
        reader.close()


def test_fetch_committed_at_reads_points_of_one_stream_in_several_objects(tmp_path):
    """Many points of each stream, in several StreamSetObjects (what a reader warming its cache
    for many partitions asks): every one found, a few GETs per object, and the blocks they
    read serve the streams' fetches after it without another GET. (Each point's ref once
    replaced the stream's cached refs: only the last point of each stream was read.)"""
    store = open_object_store(f"file://{tmp_path}/objects")
    expected = write_committed(tmp_path, store, [[2000] * 100 for _ in range(30)], seed=7)
    reader = node(tmp_path, 2, store, reader_config(block_cache_size=64 * MiB, read_fetch_size=None))
    try:
        meta = reader.metadata
        objects = {r.object_id: r for sid in expected for r in meta.get_object_refs(sid, 0, 1 << 40)}
        assert len(objects) >= 3 and all(r.type == ObjectType.STREAM_SET_OBJECT for r in objects.values())
        points = {(sid, base): (base, count, payload) for sid, batches in expected.items()
                  for base, count, payload in batches}
        got = reader.fetch_committed_at(list(points))
        assert {p: as_tuples([b])[0] for p, b in got.items()} == points
        reads = reader._reader.stats["object_reads"]
        assert reads <= 2 * len(objects), (reads, len(objects))
        for sid, batches in expected.items():
            assert as_tuples(reader.fetch_committed(sid, 0, batches[-1][0] + batches[-1][1],
                                                    max_bytes=64 * MiB).batches) == batches
        assert reader._reader.stats["object_reads"] == reads
    finally:
        reader.close()


def test_payloads_are_read_only_views_of_one_buffer_per_get_or_cache_read(tmp_path):
    store, stream_id, batches = one_stream(tmp_path, [500] * 2000)       # ~120 batches a block
    config = reader_config(block_cache_size=256 * KiB)
    reader = node(tmp_path, 2, store, config)
    stream = reader.open_stream(stream_id)

    first = stream.fetch(0, max_bytes=16 * KiB).batches                  # from the first block
    assert len(first) > 1
    assert as_tuples(first) == batches[:len(first)]
    for b, (_, _, payload) in zip(first, batches):
        assert isinstance(b.payload, memoryview) and b.payload.readonly
        assert b.payload == payload and bytes(b.payload) == payload
        assert b.payload.obj is first[0].payload.obj                     # one GET's buffer
    # A ranged GET, not the whole object (1 MiB here, too large to be read whole).
    assert len(first[0].payload.obj) <= config.read_fetch_size
    with pytest.raises(TypeError):
        first[0].payload[0] = 0

    # Views keep their buffer alive after the block cache dropped it: read 4x the cache past it.
    assert read_sequential(stream, 16 * KiB)[0] == batches
    assert reader.stats()["read"]["block_cache_bytes"] <= config.block_cache_size
    assert [bytes(b.payload) for b in first] == [p for _, _, p in batches[:len(first)]]

    # The tail on the writing node comes from the log cache: views of one buffer per read.
    object_reads = settle(reader)["object_reads"]
    tail = [bytes([i]) * (100 + i) for i in range(40)]
    futures = [stream.append(RecordBatch(p, 2)) for p in tail]
    start = futures[0].result(10).base_offset
    assert [f.result(10).base_offset for f in futures] == list(range(start, start + 80, 2))
    cache_reads = reader.stats()["read"]["cache_reads"]
    got = stream.fetch(start, max_bytes=1 * MiB).batches
    assert [bytes(b.payload) for b in got] == tail
    assert all(isinstance(b.payload, memoryview) and b.payload.readonly for b in got)
    assert all(b.payload.obj is got[0].payload.obj for b in got)
    assert all(b.payload == p for b, p in zip(got, tail))
    stats = reader.stats()["read"]
    assert stats["cache_reads"] > cache_reads and stats["object_reads"] == object_reads
    reader.close()


# ---- fetch bounds --------------------------------------------------------------------------------

def test_fetch_stops_at_its_end_offset_and_at_the_trim_offset_with_blocks_cached(tmp_path):
    rng = random.Random(3)
    store, stream_id, batches = one_stream(tmp_path, [rng.choice([1, 300, 4000, 20_000, 70_000]) for _ in range(300)])
    reader = node(tmp_path, 2, store, reader_config(block_cache_size=16 * MiB))
    stream = reader.open_stream(stream_id)

    # Cold: read up to `mid` (inside a batch) while read-ahead runs past it.
    mid = batches[len(batches) // 2][0] + 1
    got: Batches = []
    pos = 0
    while pos < mid:
        res = stream.fetch(pos, end_offset=mid, max_bytes=8 * KiB).batches
        assert res and all(b.base_offset < mid for b in res)
        got += as_tuples(res)
        pos = res[-1].end_offset
    assert got == [b for b in batches if b[0] < mid]
    assert stream.fetch(mid, end_offset=mid).batches == []
    rest, _ = read_sequential(stream, 64 * KiB, start=pos)
    assert got + rest == batches

    # Warm: the whole stream is cached (16 MiB holds it), blocks past each end offset too.
    object_reads = settle(reader)["object_reads"]
    end = stream.confirm_offset
    for _ in range(60):
        start, stop = sorted(rng.sample(range(end + 1), 2))
        res = stream.fetch(start, end_offset=stop, max_bytes=64 * MiB).batches
        assert as_tuples(res) == [b for b in batches if b[0] + b[1] > start and b[0] < stop]
    assert reader.stats()["read"]["object_reads"] == object_reads

    # Trimmed offsets are out of range, though their blocks are still cached.
    first_kept = 100
    trim_offset = batches[first_kept][0]
    stream.trim(trim_offset)
    for below in (0, trim_offset - 1):
        with pytest.raises(s3stream.OffsetOutOfRangeError):
            stream.fetch(below)
        with pytest.raises(s3stream.OffsetOutOfRangeError):
            stream.fetch(below, end_offset=trim_offset)
    assert read_sequential(stream, 64 * KiB)[0] == batches[first_kept:]
    reader.close()

    # And on the next owner, cold.
    third = node(tmp_path, 3, store, reader_config())
    stream = third.open_stream(stream_id)
    assert stream.start_offset == trim_offset
    with pytest.raises(s3stream.OffsetOutOfRangeError):
        stream.fetch(trim_offset - 1)
    assert read_sequential(stream, 64 * KiB)[0] == batches[first_kept:]
    third.close()


def test_an_end_past_what_exists_is_capped_a_start_past_it_is_out_of_range(tmp_path):
    """Issue 50, item 7: fetch(0, 100) of a stream ending at 10 returns [0, 10), as Kafka's fetch
    returns what exists below the high watermark; a start past the end still raises. One rule
    (read.fetch_end) for a stream (log cache and objects), fetch_cached, a partition, a
    partition's reader, fetch_committed of a node and of a reader that is not a node."""
    store = f"file://{tmp_path}/objects"
    one = node(tmp_path, 1, store, small_config())
    try:
        s = one.create_stream()
        for i in range(10):
            s.append(RecordBatch(b"%d" % i)).result(10)
        p = open_partition(one, "p")
        for i in range(10):
            p.append(RecordBatch(b"%d" % i)).result(10)

        def offsets(result):
            return [b.base_offset for b in result.batches]

        for fetch in (s.fetch, s.fetch_cached, p.fetch):
            assert offsets(fetch(0, 100)) == list(range(10))
            assert offsets(fetch(7, 11)) == [7, 8, 9]
            assert fetch(10, 100).batches == []
            for start, end in ((11, 100), (11, None), (5, 4)):
                with pytest.raises(s3stream.OffsetOutOfRangeError):
                    fetch(start, end)
        one.force_upload(30)
        assert offsets(s.fetch(3, 1 << 40)) == list(range(3, 10))          # from objects now
        with s3stream.open_reader(f"sqlite:///{tmp_path}/meta.db", store) as reader:
            part = read_partition(reader, "p")
            for fetch in (lambda a, b: one.fetch_committed(s.stream_id, a, b),
                          lambda a, b: reader.fetch_committed(s.stream_id, a, b), part.fetch):
                for _ in range(2):                  # the reader's second call is served from what it knows
                    assert offsets(fetch(0, 100)) == list(range(10))
                assert fetch(10, 11).batches == []
                with pytest.raises(s3stream.OffsetOutOfRangeError, match="committed range"):
                    fetch(11, 100)
        s.trim(4)
        with pytest.raises(s3stream.OffsetOutOfRangeError, match="readable range"):
            s.fetch(3, 100)
    finally:
        one.close()


# ---- memory bounds -------------------------------------------------------------------------------

def test_hundred_concurrent_readers_stay_within_cache_and_inflight_bounds(tmp_path):
    rng = random.Random(4)
    block = 32 * KiB
    plans = [[rng.choice([1, 200, 2000, 8000, 16_000]) for _ in range(40)] for _ in range(100)]
    store = f"file://{tmp_path}/objects"
    expected = write_committed(tmp_path, store, plans, config=small_config(reclaim_interval=None,
                                                                          object_block_size=block))
    config = reader_config(block_cache_size=1 * MiB, readahead_bytes=256 * KiB)
    max_bytes = 4 * KiB
    reader = node(tmp_path, 2, store, config)
    streams = [reader.open_stream(stream_id) for stream_id in expected]
    # Read-ahead is capped at half the block cache; each reader's own fetch (never refused) at
    # max_bytes plus the block that crosses it.
    inflight_bound = config.block_cache_size // 2 + len(streams) * (max_bytes + block)

    checked: dict[int, int] = {}
    errors: list[BaseException] = []
    seen = {"block_cache_bytes": 0, "inflight_bytes": 0, "samples": 0}
    start = threading.Barrier(len(streams))
    done = threading.Event()

    def read(stream):
        # Checks each batch as it comes and keeps none, so that memory is the read path's.
        try:
            start.wait()
            want = expected[stream.stream_id]
            i = pos = 0
            while pos < stream.confirm_offset:
                for b in stream.fetch(pos, max_bytes=max_bytes).batches:
                    assert (b.base_offset, b.count) == want[i][:2] and b.payload == want[i][2]
                    i += 1
                    pos = b.end_offset
            checked[stream.stream_id] = i
        except BaseException as e:        # noqa: BLE001 - reported by the test's thread
            errors.append(e)

    def sample():
        while not done.is_set():
            stats = reader.stats()["read"]
            for name in ("block_cache_bytes", "inflight_bytes"):
                seen[name] = max(seen[name], stats[name])
            seen["samples"] += 1
            time.sleep(0.002)

    threads = [threading.Thread(target=read, args=(s,)) for s in streams]
    sampler = threading.Thread(target=sample)
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        sampler.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        done.set()
        sampler.join()
        peak = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    final = settle(reader)
    reader.close()

    assert not errors, errors[:3]
    assert checked == {stream_id: len(batches) for stream_id, batches in expected.items()}
    assert seen["samples"] > 10
    assert max(seen["block_cache_bytes"], final["block_cache_bytes"]) <= config.block_cache_size
    assert seen["inflight_bytes"] <= final["max_inflight_bytes"] <= inflight_bound
    assert final["readahead_used_bytes"] > 0
    assert final["inflight_bytes"] == 0
    # Python memory at its peak (blocks, GETs in flight, indexes, a fetch per reader): within
    # twice what the cache and the in-flight bound allow (about 4 MiB of 10 measured).
    assert peak <= 2 * (config.block_cache_size + inflight_bound), peak


# ---- seeks --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_random_access_reader_resets_the_window_at_each_seek(tmp_path):
    rng = random.Random(5)
    block = 16 * KiB
    store, stream_id, batches = one_stream(tmp_path, [rng.randrange(1 * KiB, 8 * KiB) for _ in range(600)],
                                           config=small_config(reclaim_interval=None, object_block_size=block))
    config = reader_config(read_fetch_size=16 * KiB, readahead_bytes=1 * MiB, block_cache_size=1 * MiB)
    reader = node(tmp_path, 2, store, config)
    stream = reader.open_stream(stream_id)

    # Sequential over a third of the stream, a batch a fetch: the window grows towards 1 MiB.
    got: Batches = []
    while len(got) < len(batches) // 3:
        got += as_tuples(stream.fetch(got[-1][0] + got[-1][1] if got else 0, max_bytes=1).batches)
    assert got == batches[:len(got)]
    before = settle(reader)
    # A seek starts a window of two GETs again, whatever the window had grown to: read-ahead
    # per seek is one such window plus the block crossing its end.
    per_seek = 2 * config.read_fetch_size + block
    far = 2 * len(batches) // 3                  # past anything read or read ahead so far
    assert as_tuples(stream.fetch(batches[far][0], max_bytes=1).batches) == batches[far:far + 1]
    after = settle(reader, poll=0.02)
    assert after["readahead_bytes"] - before["readahead_bytes"] <= per_seek

    before = after
    seeks = 20
    for _ in range(seeks):
        i = rng.randrange(len(batches))
        base, count, _ = batches[i]
        res = stream.fetch(base + rng.randrange(count), max_bytes=1).batches
        assert as_tuples(res) == batches[i:i + 1]
        after = settle(reader, poll=0.02)        # each seek's read-ahead runs on its own
    assert after["readahead_bytes"] - before["readahead_bytes"] <= 2 * seeks * per_seek
    assert after["readahead_wasted_bytes"] - before["readahead_wasted_bytes"] <= 2 * seeks * per_seek
    reader.close()


# ---- failing stores -----------------------------------------------------------------------------

def test_failed_or_corrupt_get_raises_and_is_not_remembered(tmp_path):
    rng = random.Random(6)
    _, stream_id, batches = one_stream(tmp_path, [rng.randrange(1 * KiB, 20 * KiB) for _ in range(200)])
    config = reader_config(read_timeout=5)       # a stuck in-flight GET fails the test in 5 s

    # The first GET of a cold reader (its index read) fails; then everything reads.
    faulty = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    reader = node(tmp_path, 2, faulty, config)
    stream = reader.open_stream(stream_id)
    faulty.fail_next_gets(1)
    with pytest.raises(ObjectStoreError, match="injected failure"):
        stream.fetch(0)
    assert read_sequential(stream, 32 * KiB)[0] == batches
    reader.close()

    # Every GET returns a flipped byte: fetches fail, never return wrong bytes; then all reads.
    reader = node(tmp_path, 3, faulty, config)
    stream = reader.open_stream(stream_id)
    faulty.corrupt_gets(lambda key: True)
    for pos in (0, batches[50][0], batches[150][0]):
        with pytest.raises(s3stream.CorruptDataError):
            stream.fetch(pos)
    faulty.clear()
    assert read_sequential(stream, 32 * KiB)[0] == batches
    reader.close()

    # Block GETs fail (the indexes read): the demand fetch and read-ahead alike; then all reads.
    gated = GatedStore(tmp_path / "objects")
    reader = node(tmp_path, 4, gated, config)
    stream = reader.open_stream(stream_id)
    gated.fail_blocks = True
    for pos in (0, batches[1][0], batches[100][0]):
        with pytest.raises(ObjectStoreError, match="injected failure"):
            stream.fetch(pos)
    wait_until(lambda: reader.stats()["read"]["inflight_bytes"] == 0, "failed GETs leave nothing in flight")
    gated.fail_blocks = False
    assert read_sequential(stream, 32 * KiB)[0] == batches
    assert reader.stats()["read"]["inflight_bytes"] == 0
    reader.close()


def test_get_slower_than_read_timeout_fails_the_wait_then_recovers(tmp_path):
    rng = random.Random(7)
    store, stream_id, batches = one_stream(tmp_path, [rng.randrange(4 * KiB, 20 * KiB) for _ in range(200)])
    entries = stored_entries(tmp_path, store, {stream_id})
    gated = GatedStore(tmp_path / "objects")
    gated.hold_from = 1                          # every block GET but the first of each object hangs
    reader = node(tmp_path, 2, gated, reader_config(read_timeout=0.5))
    try:
        stream = reader.open_stream(stream_id)
        assert as_tuples(stream.fetch(0, max_bytes=1).batches) == batches[:1]
        # Read-ahead claimed the next blocks; their GETs hang on the pool.
        wait_until(lambda: reader.stats()["read"]["inflight_bytes"] > 0, "read-ahead is in flight")
        second = entries[1].start_offset
        with pytest.raises(ObjectStoreError, match="read_timeout"):
            stream.fetch(second, max_bytes=1)        # that block only: its GET is read-ahead's
    finally:
        gated.release.set()
    # The hung GET completes once released: the same fetch reads, then the whole stream.
    i = next(i for i, b in enumerate(batches) if b[0] == second)
    res = stream.fetch(second, max_bytes=1).batches
    assert as_tuples(res) == batches[i:i + 1]
    assert read_sequential(stream, 32 * KiB)[0] == batches
    reader.close()


@pytest.mark.slow
def test_reader_near_the_committed_end_does_not_query_metadata_per_fetch(tmp_path):
    store, stream_id, batches = one_stream(tmp_path, [4 * KiB] * 300)         # 1.2 MB: two objects
    reader = node(tmp_path, 2, store, reader_config())
    stream = reader.open_stream(stream_id)
    last = len(batches) - 20                     # the last 20 batches: inside the first window (128 KiB)
    got: Batches = []
    while len(got) < last:
        got += as_tuples(stream.fetch(got[-1][0] + got[-1][1] if got else 0, end_offset=batches[last][0]).batches)
    lookups = settle(reader, poll=0.02)["metadata_lookups"]
    for base, count, payload in batches[last:]:
        assert as_tuples(stream.fetch(base, max_bytes=1).batches) == [(base, count, payload)]
        settle(reader, poll=0.02)                # each fetch's read-ahead runs before the next fetch
    extra = reader.stats()["read"]["metadata_lookups"] - lookups
    reader.close()
    assert extra <= 2, f"{extra} metadata lookups for {len(batches) - last} fetches at the committed end"


def test_fetch_filled_by_one_block_does_not_wait_for_the_next(tmp_path):
    store, stream_id, batches = one_stream(tmp_path, [40 * KiB] * 30)         # a batch a 64 KiB block
    first_block, second_block = stored_entries(tmp_path, store, {stream_id})[:2]
    assert second_block.start_offset == batches[1][0]
    gated = GatedStore(tmp_path / "objects")
    gated.hold_from = second_block.block_position            # its GET (and every later one) hangs
    reader = node(tmp_path, 2, gated, reader_config(read_timeout=0.5))
    stream = reader.open_stream(stream_id)
    # More than the first batch, less than the first block: that block alone fills the fetch.
    max_bytes = 40 * KiB + 10
    assert max_bytes < first_block.block_size
    outcome: list = []

    def fetch_first():
        try:
            outcome.append(as_tuples(stream.fetch(0, max_bytes=max_bytes).batches))
        except Exception as e:        # noqa: BLE001 - checked below
            outcome.append(e)
        outcome.append(gated.release.is_set())

    fetcher = threading.Thread(target=fetch_first)
    try:
        fetcher.start()
        fetcher.join(5)
    finally:
        gated.release.set()
        fetcher.join()
        reader.close()
    assert outcome == [batches[:1], False], "the fetch failed, or returned only once the next block's GET did"


def test_own_gets_in_flight_stay_within_max_bytes_plus_a_block(tmp_path):
    store, stream_id, batches = one_stream(tmp_path, [4 * KiB] * 250)          # 1 MB: StreamObjects
    # 512 KiB GETs (StreamObjects up to 2 MiB read whole); read-ahead one 64 KiB window.
    config = reader_config(read_fetch_size=512 * KiB, readahead_bytes=64 * KiB, block_cache_size=8 * MiB)
    reader = node(tmp_path, 2, store, config)
    stream = reader.open_stream(stream_id)
    max_bytes = 1
    assert as_tuples(stream.fetch(0, max_bytes=max_bytes).batches) == batches[:1]
    stats = settle(reader)
    reader.close()
    block = small_config().object_block_size
    own, readahead = max_bytes + block, config.readahead_bytes + block
    assert stats["max_inflight_bytes"] <= own + readahead, stats


def test_missing_object_raises_corrupt_data_naming_the_offset(tmp_path):
    rng = random.Random(9)
    store, stream_id, batches = one_stream(tmp_path, [rng.randrange(8 * KiB, 20 * KiB) for _ in range(250)])
    meta = open_metadata(f"sqlite:///{tmp_path}/meta.db")
    refs = meta.get_object_refs(stream_id, 0, 1 << 62)
    meta.close()
    assert len(refs) >= 3
    reader = node(tmp_path, 2, store, reader_config(read_timeout=5))
    stream = reader.open_stream(stream_id)
    assert as_tuples(stream.fetch(0, max_bytes=1).batches) == batches[:1]     # refs cached
    settle(reader)
    lost = refs[-1]                              # beyond the read-ahead of the first read
    LocalObjectStore(str(tmp_path / "objects")).delete([lost.key])
    with pytest.raises(s3stream.CorruptDataError, match=f"offset {lost.start_offset} is missing"):
        stream.fetch(lost.start_offset)
    # The objects still there read as before.
    got = []
    pos = 0
    while pos < lost.start_offset:
        res = stream.fetch(pos, end_offset=lost.start_offset, max_bytes=64 * KiB).batches
        got += as_tuples(res)
        pos = res[-1].end_offset
    assert got == [b for b in batches if b[0] < lost.start_offset]
    reader.close()


# ---- closing ------------------------------------------------------------------------------------

def test_close_stops_the_read_pool(tmp_path):
    rng = random.Random(10)
    store, stream_id, batches = one_stream(tmp_path, [rng.randrange(4 * KiB, 20 * KiB) for _ in range(100)])
    before = set(threading.enumerate())
    reader = node(tmp_path, 2, store, reader_config())
    assert read_sequential(reader.open_stream(stream_id), 16 * KiB)[0] == batches
    pool = [t for t in threading.enumerate() if t.name.startswith("s3stream-read") and t not in before]
    assert pool                                  # read-ahead ran there
    reader.close()
    assert not [t for t in pool if t.is_alive()]
    assert not [t for t in threading.enumerate() if t.name.startswith("s3stream-read") and t not in before]
