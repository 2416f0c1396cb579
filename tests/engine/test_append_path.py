"""The native write path: append futures and callbacks, append_many, failure in the completion
path, WAL pressure, pipelined uploads, and the planner and encoder against their twins."""
from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import s3stream
import wal
from _native import appendpath, objcodec
from s3stream import RecordBatch, StreamClient
from s3stream.engine.logcache import LogCache, encode_slices
from s3stream.metadata import SqliteMetadataStore
from s3stream.objectformat_reference import encode_object as reference_encode
from s3stream.objectstore import FaultInjectingObjectStore, LocalObjectStore
from s3stream.engine.upload_reference import plan_upload
from conftest import KiB, MiB, small_config


def client(tmp_path, node_id=1, config=None, store=None):
    return StreamClient(node_id, tmp_path / f"node{node_id}.wal", store or f"file://{tmp_path}/objects",
                        f"sqlite:///{tmp_path}/meta.db", config or small_config())


def read_all(stream):
    out, pos = [], stream.start_offset
    while pos < stream.confirm_offset:
        res = stream.fetch(pos)
        out += [(b.base_offset, b.payload) for b in res.batches]
        pos = res.end_offset
    return out


# ---- futures and callbacks -----------------------------------------------------------------------


def upload_all(c) -> None:
    """Seal the active block and wait until every block is committed: the background uploads
    (a stream's close uploads only its own tail, on its own thread, and leaves those out)."""
    c.force_upload(30)

def test_callback_that_appends_and_waits_does_not_stop_acknowledgements(tmp_path):
    """The old engine ran callbacks on the WAL's dispatcher: this one wedged the node for good."""
    c = client(tmp_path)
    try:
        s = c.create_stream()
        inner = []
        seen_threads = []

        def callback(fut):
            seen_threads.append(threading.current_thread().name)
            inner.append(s.append(RecordBatch(b"from-callback", 1)).result(10).base_offset)

        s.append(RecordBatch(b"first", 1)).add_done_callback(callback)
        # Acknowledgements keep coming while (and after) the callback waits on its own append.
        for i in range(50):
            assert s.append(RecordBatch(b"x%d" % i, 1)).result(10).base_offset >= 1
        deadline = time.monotonic() + 10
        while not inner and time.monotonic() < deadline:
            time.sleep(0.01)
        assert inner, "the callback's own append was never acknowledged"
        assert seen_threads == ["s3stream-callbacks"]
        assert (inner[0], b"from-callback") in read_all(s)
    finally:
        c.close()


def test_callbacks_run_in_offset_order_and_survive_a_raising_one(tmp_path, caplog):
    c = client(tmp_path)
    try:
        s = c.create_stream()
        order = []
        futs = [s.append(RecordBatch(b"r%d" % i, 1)) for i in range(200)]
        for i, f in enumerate(futs):
            if i == 7:
                f.add_done_callback(lambda _f: 1 / 0)
            f.add_done_callback(lambda f: order.append(f.base_offset))
        deadline = time.monotonic() + 10
        while len(order) < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert order == list(range(200))
        assert any("ZeroDivisionError" in r.getMessage() or r.exc_info for r in caplog.records)
    finally:
        c.close()


def test_future_and_await(tmp_path):
    c = client(tmp_path)
    try:
        s = c.create_stream()
        f = s.append(RecordBatch(b"a", 3)).future()
        assert f.result(10) == s3stream.AppendResult(0)

        async def produce():
            return [(await s.append(RecordBatch(b"b", 2))).base_offset for _ in range(3)]

        assert asyncio.run(produce()) == [3, 5, 7]
        fut = s.append(RecordBatch(b"c", 1))
        fut.result(10)
        assert fut.done() and fut.exception() is None
        assert fut.completed_ns is not None and fut.completed_ns >= fut.submitted_ns
    finally:
        c.close()


def test_append_many_assigns_contiguous_offsets(tmp_path):
    c = client(tmp_path)
    try:
        s = c.create_stream()
        futs = s.append_many([RecordBatch(b"p%d" % i, i + 1) for i in range(10)])
        bases = [f.result(10).base_offset for f in futs]
        assert bases == [sum(range(1, i + 1)) for i in range(10)]
        assert s.next_offset == sum(range(1, 11))
        with pytest.raises(s3stream.InvalidBatchError, match="RecordBatch"):
            s.append_many([RecordBatch(b"ok", 1), b"not a batch"])
        assert s.next_offset == sum(range(1, 11)) + 1       # the batch before the bad one went in
    finally:
        c.close()


@pytest.mark.parametrize("payload, count, match", [
    ("text", 1, "bytes-like"), (b"x", 0, "count"), (b"x", True, "count"), (b"x", 2 ** 32, "count"),
    (b"x", 1.0, "count"),
])
def test_bad_batches_are_refused(payload, count, match):
    with pytest.raises(s3stream.InvalidBatchError, match=match):
        RecordBatch(payload, count)


def test_oversized_batch_is_refused_and_nothing_is_written(tmp_path):
    c = client(tmp_path)
    try:
        s = c.create_stream()
        with pytest.raises(s3stream.InvalidBatchError, match="max_batch_bytes"):
            s.append(RecordBatch(bytes(c.config.max_batch_bytes + 1)))
        with pytest.raises(s3stream.InvalidBatchError, match="RecordBatch"):
            s.append(b"raw bytes")
        assert s.next_offset == 0 and c.stats()["wal"]["records"] == 0
    finally:
        c.close()


def test_confirm_queue_stays_bounded_without_readers(tmp_path):
    """Each append queues (WAL end, end offset) for the confirm offset. Only reads drained that
    queue, so a stream nobody read grew it by an entry per append, for good."""
    c = client(tmp_path)
    try:
        s = c.create_stream()
        window = []
        for i in range(20_000):
            window.append(s.append(RecordBatch(b"r", 1)))
            if len(window) == 64:
                window.pop(0).result(10)
        for f in window:
            f.result(10)
        assert s._pending_entries() <= 256
        assert s.confirm_offset == 20_000           # a read drains the rest
        assert s._pending_entries() == 0
    finally:
        c.close()


# ---- a failure in the completion path ------------------------------------------------------------

def test_failure_after_the_wal_fails_the_append_clearly_and_close_does_not_hang(tmp_path):
    c = client(tmp_path)
    s, other = c.create_stream(), c.create_stream()
    acked = [s.append(RecordBatch(b"before%d" % i, 1)).result(10).base_offset for i in range(5)]
    appendpath.set_failpoint("cache_insert", True)
    try:
        fut = s.append(RecordBatch(b"doomed", 1))
    finally:
        appendpath.set_failpoint("cache_insert", False)
    assert fut.done()
    with pytest.raises(s3stream.AppendFailedError, match="reached the WAL but not the log cache"):
        fut.result(1)
    with pytest.raises(s3stream.AppendFailedError):
        s.append(RecordBatch(b"after", 1))
    # Other streams are unaffected.
    assert other.append(RecordBatch(b"fine", 1)).result(10).base_offset == 0
    # Closing uploads what came before the failed append and lets the stream go.
    t0 = time.monotonic()
    s.close(timeout=10)
    assert time.monotonic() - t0 < 5
    c2 = client(tmp_path, node_id=2)
    try:
        s2 = c2.open_stream(s.stream_id)
        assert read_all(s2) == [(o, b"before%d" % i) for i, o in enumerate(acked)]
        assert s2.append(RecordBatch(b"next", 1)).result(10).base_offset == 5
    finally:
        c2.close()
        c.close(timeout=10)


# ---- WAL pressure ----------------------------------------------------------------------------------

def test_small_synchronous_appends_never_fill_the_wal(tmp_path):
    """Each synchronous 100-byte append takes a whole 4 KiB WAL block: 16 MiB hold 4,094 of them,
    long before 512 KiB of payload reaches the upload threshold. The old engine wedged there."""
    cfg = small_config(upload_threshold=512 * KiB, split_size=128 * KiB, cache_size=2 * MiB,
                       wal=wal.WALConfig(capacity=16 * MiB, full_timeout=5))
    c = client(tmp_path, config=cfg)
    s = c.create_stream()
    acked = []
    for i in range(6000):
        payload = b"%06d" % i + bytes(94)
        acked.append((s.append(RecordBatch(payload, 1)).result(10).base_offset, payload))
    assert c.stats()["upload"]["blocks"] >= 1          # sealed by pressure, not by size
    c._wal.close()                                      # crash-like: no force upload, no clean close
    c._uploader.abort()
    c2 = client(tmp_path, config=cfg)
    try:
        s2 = c2.open_stream(s.stream_id)
        assert read_all(s2) == acked
    finally:
        c2.close()


@settings(max_examples=int(__import__("os").environ.get("WAL_FILL_EXAMPLES", "6")), deadline=None)
@given(threshold_kib=st.sampled_from([64, 256, 1024, 4096]), cache_blocks=st.integers(2, 8),
       wal_blocks=st.integers(2, 8), pressure=st.sampled_from([0.1, 0.3, 0.5, 0.7, 0.9]),
       size=st.sampled_from([1, 100, 1000, 4000]), batch_kib=st.sampled_from([8, 64, 1024]))
@pytest.mark.slow
def test_no_config_wedges_on_small_synchronous_appends(tmp_path_factory, threshold_kib, cache_blocks, wal_blocks,
                                                       pressure, size, batch_kib):
    """Any Config that Config accepts: synchronous appends (each a WAL batch of its own, padded
    to 4 KiB) through twice the WAL's capacity never fail, whatever the upload threshold, cache
    size, WAL size, pressure fraction or WAL batch size."""
    threshold = threshold_kib * KiB
    capacity = max(wal_blocks * threshold, 2 * MiB) + 8 * KiB
    cfg = small_config(upload_threshold=threshold, split_size=threshold // 4, cache_size=cache_blocks * threshold,
                       max_batch_bytes=min(threshold, 128 * KiB), wal_pressure=pressure, append_timeout=20,
                       wal=wal.WALConfig(capacity=capacity, batch_bytes=batch_kib * KiB, full_timeout=20))
    tmp = tmp_path_factory.mktemp("fill")
    c = client(tmp, config=cfg)
    try:
        s = c.create_stream()
        appends = 2 * capacity // 4096 + 1
        for i in range(appends):
            assert s.append(RecordBatch(bytes(size), 1)).result(30).base_offset == i
    finally:
        c.close()


# ---- pipelined uploads -------------------------------------------------------------------------

@pytest.mark.slow
def test_slow_puts_keep_several_blocks_in_flight_and_commit_in_order(tmp_path):
    store = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    store.hang_puts(0.2)
    cfg = small_config(upload_threshold=256 * KiB, split_size=64 * KiB, cache_size=4 * MiB, upload_pipeline=3)
    c = client(tmp_path, config=cfg, store=store)
    try:
        streams = [c.create_stream() for _ in range(3)]
        expected = {s.stream_id: [] for s in streams}
        futs = []
        for i in range(300):
            s = streams[i % 3]
            payload = bytes([i % 256]) * 4000
            futs.append((s.stream_id, s.append(RecordBatch(payload, 1)), payload))
        for sid, f, payload in futs:
            expected[sid].append((f.result(10).base_offset, payload))
        upload_all(c)
        for s in streams:
            s.close(timeout=30)
        assert c._uploader.stats["max_inflight"] >= 2
        meta = SqliteMetadataStore(str(tmp_path / "meta.db"))
        ssos = meta.node_stream_set_objects(1)
        assert [o.object_id for o in ssos] == sorted(o.object_id for o in ssos)
        meta.close()
    finally:
        c.close()
    c2 = client(tmp_path, node_id=2)
    try:
        for sid, want in expected.items():
            assert read_all(c2.open_stream(sid)) == want
    finally:
        c2.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("nice", [0, 7])
def test_upload_threads_run_at_the_configured_lower_priority(tmp_path, nice):
    """The encode-and-PUT threads run `upload_nice` below the process, and only they do."""
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    cfg = small_config(upload_threshold=128 * KiB, split_size=32 * KiB, cache_size=1 * MiB, upload_nice=nice)
    c = client(tmp_path, config=cfg)
    try:
        s = c.create_stream()
        for i in range(40):
            s.append(RecordBatch(bytes([i]) * 4000, 1))
        upload_all(c)
        s.close(timeout=30)
        puts = list(c._uploader._pool._threads)       # this client's (other tests' may linger)
        assert puts, "no upload thread ran"
        assert {os.getpriority(os.PRIO_PROCESS, t.native_id) for t in puts} == {min(19, base + nice)}
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
        assert c._uploader.stats["objects"] > 0
    finally:
        c.close()


def _policies(threads) -> set:
    return {os.sched_getscheduler(t.native_id) for t in threads}


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_upload_threads_idle_while_uploads_keep_up(tmp_path):
    """With upload_idle (and the right to leave SCHED_IDLE, which root has), the encode-and-PUT
    threads run under SCHED_IDLE while uploads keep up and return to SCHED_OTHER at upload_nice
    once the client reports them behind; nothing else changes policy. Switches are counted for
    the pool as a whole (odd: idle now)."""
    from s3stream.engine.upload import may_switch_idle
    if not may_switch_idle(7):
        pytest.skip("this process may not leave SCHED_IDLE (needs CAP_SYS_NICE)")
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    cfg = small_config(upload_threshold=128 * KiB, split_size=32 * KiB, cache_size=8 * MiB, upload_nice=7,
                       upload_concurrency=1)
    c = client(tmp_path, config=cfg)
    try:
        assert c._uploader.idle_ok
        s = c.create_stream()
        for i in range(40):
            s.append(RecordBatch(bytes([i]) * 4000, 1)).result()
        upload_all(c)
        s.close(timeout=30)
        puts = list(c._uploader._pool._threads)
        assert puts and _policies(puts) == {os.SCHED_IDLE}
        assert c._uploader._idle and c._uploader.stats["priority_switches"] % 2 == 1
        assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
        assert os.sched_getscheduler(c._uploader._thread.native_id) == os.SCHED_OTHER

        c._uploader._behind = lambda: True          # as when half of cache_size is uncommitted
        s2 = c.create_stream()
        for i in range(200):
            s2.append(RecordBatch(bytes([i]) * 4000, 1))
        s2.close(timeout=30)
        assert _policies(puts) == {os.SCHED_OTHER}
        assert {os.getpriority(os.PRIO_PROCESS, t.native_id) for t in puts} == {min(19, base + 7)}
        assert not c._uploader._idle and c._uploader.stats["priority_switches"] % 2 == 0
    finally:
        c.close()


def test_uploads_behind_follows_the_cache(tmp_path):
    """The hook that takes upload threads out of SCHED_IDLE: false on an idle client, true once
    half of cache_size is uncommitted (here with the PUTs held), false again once committed.
    (No per-stream tail bound here: that one would hold the third append.)"""
    cfg = small_config(upload_threshold=1 * MiB, split_size=1 * MiB, cache_size=4 * MiB, max_batch_bytes=1 * MiB,
                       stream_tail_limit=0)
    c = client(tmp_path, config=cfg)
    release = threading.Event()
    put = c._uploader._put
    c._uploader._put = lambda key, data: release.wait(30) and put(key, data)
    try:
        assert not c._uploads_behind()
        s = c.create_stream()
        futures = [s.append(RecordBatch(b"x" * (700 * KiB), 1)) for _ in range(3)]
        for f in futures:
            f.result(timeout=30)
        assert c._append_path.uncommitted > cfg.cache_size // 2
        assert c._uploads_behind()
        release.set()
        s.close(timeout=30)
        # The close uploaded the stream's tail itself; the blocks that held it commit after.
        deadline = time.monotonic() + 30
        while c._uploader.pending_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c._append_path.uncommitted == 0 and not c._uploads_behind()
    finally:
        release.set()
        c.close()


def test_upload_threads_stay_at_nice_without_the_right_to_leave_idle(tmp_path, monkeypatch):
    """Where a thread could enter SCHED_IDLE but not leave it (no CAP_SYS_NICE, RLIMIT_NICE 0),
    the probe says so and no upload thread is ever put into SCHED_IDLE."""
    import s3stream.engine.upload as upload
    real = upload.set_thread_idle
    monkeypatch.setattr(upload, "set_thread_idle", lambda idle: real(idle) if idle else False)
    c = client(tmp_path, config=small_config(upload_threshold=128 * KiB, split_size=32 * KiB, cache_size=8 * MiB))
    try:
        assert not c._uploader.idle_ok
        s = c.create_stream()
        for i in range(40):
            s.append(RecordBatch(bytes([i]) * 4000, 1))
        upload_all(c)
        s.close(timeout=30)
        puts = list(c._uploader._pool._threads)
        assert puts and _policies(puts) <= {os.SCHED_OTHER}
        assert c._uploader.stats["priority_switches"] == 0
    finally:
        c.close()


@pytest.mark.parametrize("value", [1, "yes", None])
def test_bad_upload_idle_is_refused(value):
    with pytest.raises(s3stream.ConfigError, match="upload_idle"):
        s3stream.Config(upload_idle=value)


@pytest.mark.parametrize("nice", [-1, 20, 1.5, True, "10"])
def test_bad_upload_nice_is_refused(nice):
    with pytest.raises(s3stream.ConfigError, match="upload_nice"):
        s3stream.Config(upload_nice=nice)


@pytest.mark.slow
def test_admission_waits_are_counted(tmp_path):
    """Appends that meet a full cache (slow PUTs) are counted with the time they waited."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    store = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    cfg = small_config(upload_threshold=128 * KiB, split_size=32 * KiB, cache_size=256 * KiB, stream_tail_limit=0)
    registry = CollectorRegistry()
    c = StreamClient(1, tmp_path / "node1.wal", store, f"sqlite:///{tmp_path}/meta.db", cfg, metrics=registry)
    try:
        s = c.create_stream()
        s.append(RecordBatch(b"x" * 4000, 1)).result(10)
        assert c.stats()["append"]["admission_waits"] == 0
        store.hang_puts(0.2)
        futs = [s.append(RecordBatch(bytes([i % 256]) * 8000, 1)) for i in range(100)]   # ~3 caches
        for f in futs:
            f.result(30)
        st = c.stats()["append"]
        assert st["admission_waits"] > 0
        assert st["admission_wait_seconds"] >= 0.1
        exported = {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
                    for s in f.samples if s.name.startswith("s3stream_append_admission")}
        assert exported["s3stream_append_admission_waits_total"] == st["admission_waits"]
        assert exported["s3stream_append_admission_wait_seconds_total"] == pytest.approx(st["admission_wait_seconds"])
        s.close(timeout=30)
    finally:
        c.close()


def test_upload_stats_count_the_write_requests_s3_would_bill(tmp_path):
    """stats()['upload']['write_requests'] counts multipart parts as the store's settings imply,
    the same figure as the committed objects' sizes give (and it stays once they are deleted)."""
    from s3stream.objectstore.base import write_requests
    cfg = small_config(upload_threshold=256 * KiB, split_size=64 * KiB, cache_size=1 * MiB)
    url = f"file://{tmp_path}/objects?part_size={32 * KiB}&multipart_threshold={64 * KiB}"
    c = client(tmp_path, config=cfg, store=url)
    try:
        streams = [c.create_stream() for _ in range(3)]
        for i in range(120):
            streams[i % 3].append(RecordBatch(bytes([i]) * (2000 if i % 3 else 9000), 1))
        upload_all(c)
        for s in streams:
            s.close(timeout=30)
        from s3stream.metadata import ObjectState
        objects = c._meta.list_objects(state=ObjectState.COMMITTED)    # not the ids prepared ahead
        expected = sum(write_requests(o.size, 32 * KiB, 64 * KiB) for o in objects)
        assert expected > len(objects)                  # some were multipart
        assert c.stats()["upload"]["write_requests"] == expected
    finally:
        c.close()


# ---- the twins ----------------------------------------------------------------------------------

blocks = st.lists(st.tuples(st.integers(1, 6), st.binary(max_size=300), st.integers(1, 5), st.booleans()),
                  min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(blocks, st.integers(1, 2000), st.integers(64, 1024))
def test_native_planner_and_encoder_match_their_twins(records, split_size, block_size):
    cache = LogCache(1 << 30, 1 << 31, time.monotonic_ns, s3stream.FetchedBatch)
    offsets: dict[int, int] = {}
    batches: dict[int, list] = {}
    wal_end = 0
    for stream_id, payload, count, hold in records:
        base = offsets.get(stream_id, 0)
        wal_end += 64 + len(payload)
        # held by reference or copied into chunks, in any mix: the same object either way
        assert cache.put(stream_id, 1, (base, count, payload), wal_end, hold=hold) is None
        offsets[stream_id] = base + count
        batches.setdefault(stream_id, []).append((base, count, payload))
    block = cache.seal()
    stream_set, stream_objects = block.plan(split_size)
    sizes = {sid: sum(len(p) for _, _, p in b) for sid, b in batches.items()}
    assert ([s.stream_id for s in stream_set], [s.stream_id for s in stream_objects]) == plan_upload(sizes, split_size)
    slices = [block.streams[sid] for sid in sorted(batches)]
    data, entries = encode_slices(slices, block_size)
    want = [(sid, batches[sid]) for sid in sorted(batches)]
    assert (data, entries) == reference_encode(want, block_size)
    assert (data, entries) == objcodec.encode_object(want, block_size)


def test_cache_reads_only_what_it_holds(tmp_path):
    cache = LogCache(1 << 20, 1 << 22, time.monotonic_ns, s3stream.FetchedBatch)
    for i in range(10):
        cache.put(5, 1, (10 + i * 2, 2, b"p%d" % i), 100 * (i + 1))
    assert cache.read(5, 0, 100, 1 << 20) == []                       # below what it holds
    got = cache.read(5, 13, 17, 1 << 20)
    assert [(b.base_offset, b.payload) for b in got] == [(12, b"p1"), (14, b"p2"), (16, b"p3")]
    assert [b.base_offset for b in cache.read(5, 10, 30, 5)] == [10, 12]  # max_bytes, at least one
    assert cache.read(6, 0, 10, 100) == []
    last = cache.read(5, 10, 1 << 40, 1 << 30)[-1]
    # Nothing sealed yet: the stream's un-uploaded tail is the active block's slice, to its last batch.
    assert [s.end_offset for s in cache.uncommitted_slices(5, 1)] == [last.base_offset + last.count]
    assert cache.uncommitted_slices(5, 2) == [] and cache.uncommitted_slices(6, 1) == []


def test_large_bytes_payloads_are_held_not_copied_and_released_on_eviction():
    """A bytes payload from HOLD_MIN_BYTES (8 KiB) on is kept by reference: the cache takes no
    chunk for it, reads and encodes it like a copied one, and lets it go when the block is
    evicted. A smaller one, or any other buffer type, is copied (a bytearray may change later)."""
    cache = LogCache(64 * KiB, 128 * KiB, time.monotonic_ns, s3stream.FetchedBatch)
    big, small, mutable = os.urandom(8 * KiB), os.urandom(8 * KiB - 1), bytearray(os.urandom(8 * KiB))
    before = sys.getrefcount(big)
    cache.put(1, 1, (0, 1, big), 100)
    cache.put(1, 1, (1, 1, small), 200)
    cache.put(1, 1, (2, 1, mutable), 300)
    assert sys.getrefcount(big) == before + 1
    assert cache.stats()["pool"]["allocated"] == 1          # one chunk, for the two copied payloads
    original = bytes(mutable)
    mutable[:] = bytes(len(mutable))                        # copied when put: the change is not seen
    got = cache.read(1, 0, 3, 1 << 20)
    assert [bytes(b.payload) for b in got] == [big, small, original]
    block = cache.seal()
    data, _ = encode_slices([block.streams[1]], 1 << 20)
    assert big in data and small in data
    cache.mark_committed(block)
    for i in range(3, 40):                                  # evict the block: the reference goes
        sealed = cache.put(2, 1, (i, 1, os.urandom(8 * KiB)), 100 * i)
        if sealed is not None:
            cache.mark_committed(sealed)
    assert cache.read(1, 0, 3, 1 << 20) == []
    del block, got, data
    assert sys.getrefcount(big) == before


def test_appends_hold_large_bytes_and_copy_other_buffers(tmp_path):
    """Through the engine: a large bytes payload is held by the cache (one more reference while
    cached), a bytearray is copied, so changing it after the append changes nothing stored."""
    c = client(tmp_path)
    try:
        s = c.create_stream()
        big, buf = os.urandom(16 * KiB), bytearray(os.urandom(16 * KiB))
        original, before = bytes(buf), sys.getrefcount(big)
        batch = RecordBatch(big, 1)
        s.append(batch).result(10)
        s.append(RecordBatch(buf, 1)).result(10)
        del batch
        assert sys.getrefcount(big) == before + 1
        buf[:] = bytes(len(buf))
        assert read_all(s) == [(0, big), (1, original)]
        s.close()                                           # uploaded: the objects hold the same bytes
        reopened = c.open_stream(s.stream_id)
        upload_all(c)
        c._cache.drop_stream(s.stream_id)                  # read back from the object store
        assert read_all(reopened) == [(0, big), (1, original)]
        assert c.stats()["read"]["object_reads"] > 0
    finally:
        c.close()


def test_cache_memory_is_recycled_and_bounded():
    """Evicted blocks give their chunks back; new blocks take them instead of fresh memory, and
    the pool keeps at most half the cache size free."""
    cache = LogCache(1 * MiB, 4 * MiB, time.monotonic_ns, s3stream.FetchedBatch)
    payload = bytes(50 * KiB)
    offset = wal_end = 0
    for _ in range(40):                                  # 40 blocks of ~1 MiB through a 4 MiB cache
        sealed = None
        while sealed is None:
            wal_end += len(payload) + 64
            sealed = cache.put(1, 1, (offset, 1, payload), wal_end, hold=False)     # copied into chunks
            offset += 1
        cache.mark_committed(sealed)
    pool = cache.stats()["pool"]
    assert pool["reused"] > 5 * pool["allocated"]        # steady state runs on recycled chunks
    assert pool["free_bytes"] <= 2 * MiB
    assert cache.size <= 4 * MiB + 1 * MiB + len(payload)
    got = cache.read(1, offset - 3, offset, 1 << 20)      # the newest data is still readable
    assert [b.base_offset for b in got] == [offset - 3, offset - 2, offset - 1]
