"""When bytes are PUT (issue 51): a stream that reaches the split size uploads alone as its own
StreamObject while the other streams keep filling (a cut, not a seal of the whole block); the
WAL is trimmed only up to the oldest record still to commit, since a cut leaves older records
behind it; a close commits the StreamObjects blocks in flight have PUT instead of PUTting them
again; every commit is counted under its trigger."""
from __future__ import annotations

import pytest

import os
import time

from s3stream import RecordBatch, StreamClient
from s3stream.objectstore import LocalObjectStore
from conftest import KiB, MiB, small_config
from test_engine import read_all
from test_engine_model import crash


def client(tmp_path, store=None, **overrides):
    cfg = small_config(reclaim_interval=None, **overrides)
    return StreamClient(1, tmp_path / "node1.wal", store or f"file://{tmp_path}/objects",
                        f"sqlite:///{tmp_path}/meta.db", cfg)


def wait_for(condition, timeout=10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_stream_at_the_split_size_uploads_alone_and_the_others_keep_filling(tmp_path):
    """A hot stream crosses the split size again and again while two slow ones trickle: each
    time only the hot stream's slice goes up (one StreamObject of about the split size); the
    slow streams' slices stay in the active block and grow, and go up together in one
    StreamSetObject at the end. Before, the first cut sealed the whole block: every slow
    stream's object was cut short with it."""
    c = client(tmp_path, upload_threshold=4 * MiB, split_size=256 * KiB, cache_size=16 * MiB,
               stream_tail_limit=4 * MiB)
    try:
        hot, slow1, slow2 = c.create_stream(), c.create_stream(), c.create_stream()
        for i in range(200):                       # 200 x 8 KiB = 1.6 MB into the hot stream
            hot.append(RecordBatch(os.urandom(8 * KiB), 1))
            if i % 20 == 0:
                slow1.append(RecordBatch(b"s1-%d" % i, 1))
                slow2.append(RecordBatch(b"s2-%d" % i, 1))
        hot.append(RecordBatch(b"last", 1)).result(10)
        wait_for(lambda: c.stats()["upload"]["triggers"].get("cut", {}).get("objects", 0) >= 6)
        stats = c.stats()["upload"]
        cut = stats["triggers"]["cut"]
        assert cut["objects"] == cut["blocks"], "each cut carried one slice: the hot stream's"
        assert cut["bytes"] / cut["objects"] >= 256 * KiB, "each cut object is at least the split size"
        assert stats["stream_set_objects"] == 0, "the slow streams' slices were not sealed with the cuts"
        c.force_upload(10)
        assert c.stats()["upload"]["stream_set_objects"] == 1     # both slow streams, one object
        assert [bytes(p) for _, _, p in read_all(slow1)] == [b"s1-%d" % i for i in range(0, 200, 20)]
        assert [bytes(p) for _, _, p in read_all(slow2)] == [b"s2-%d" % i for i in range(0, 200, 20)]
    finally:
        c.close()


def test_records_a_cut_left_behind_stay_in_the_wal_until_committed(tmp_path):
    """A cut commits a block whose records come after the slow stream's in the WAL: a crash
    then must find the slow stream's records in the WAL. Before trim_point the WAL was trimmed
    to the cut block's end, past them, and they were lost with the crash."""
    c = client(tmp_path, upload_threshold=4 * MiB, split_size=256 * KiB, cache_size=16 * MiB,
               stream_tail_limit=4 * MiB)
    slow, hot = c.create_stream(), c.create_stream()
    slow_payloads = [b"slow-%d" % i for i in range(5)]
    for p in slow_payloads:
        slow.append(RecordBatch(p, 1)).result(10)
    for _ in range(40):                            # 320 KiB: the hot stream is cut
        hot.append(RecordBatch(os.urandom(8 * KiB), 1)).result(10)
    wait_for(lambda: c.stats()["upload"]["blocks"] >= 1)
    assert c.metadata.get_stream(slow.stream_id).end_offset == 0      # the slow records are not up
    crash(c)
    again = client(tmp_path, upload_threshold=4 * MiB, split_size=256 * KiB, cache_size=16 * MiB,
                   stream_tail_limit=4 * MiB)
    try:
        assert [bytes(p) for _, _, p in read_all(again.open_stream(slow.stream_id))] == slow_payloads
    finally:
        again.close()


class FirstPutSlow:
    """A store whose first PUT from the upload pool takes `seconds`: the blocks after it are PUT
    and wait for it to commit (commits are in block order)."""

    def __init__(self, inner, seconds: float) -> None:
        self.inner, self.seconds, self.slowed = inner, seconds, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key, data) -> None:
        import threading
        if not self.slowed and threading.current_thread().name.startswith("s3stream-put"):
            self.slowed = True
            time.sleep(self.seconds)
        self.inner.put(key, data)


@pytest.mark.slow
def test_a_close_commits_the_objects_blocks_in_flight_have_put(tmp_path):
    """A stream is cut several times while the first of its blocks is slow to PUT (so the
    others, PUT already, wait to commit behind it): its close commits those StreamObjects
    itself, PUTting only the rest of its tail (the slow block's slice and the active one), and
    every record reads back once."""
    store = FirstPutSlow(LocalObjectStore(str(tmp_path / "objects")), 3.0)
    c = client(tmp_path, store, upload_threshold=4 * MiB, split_size=256 * KiB, cache_size=16 * MiB,
               stream_tail_limit=4 * MiB, upload_idle=False, upload_concurrency=4)
    try:
        s = c.create_stream()
        written = []
        for i in range(100):                       # 800 KiB: three cuts, and 32 KiB left active
            payload = os.urandom(8 * KiB)
            written.append((s.append(RecordBatch(payload, 1)).result(10).base_offset, payload))
        time.sleep(0.3)                            # the later cuts' PUTs are done
        s.close(timeout=30)
        stats = c.stats()["upload"]
        assert stats["close_objects_reused"] == 2, stats
        assert stats["close_bytes"] < 300 * KiB, "the close PUT only what no block had PUT"
        assert [(b, bytes(p)) for b, _, p in read_all(c.open_stream(s.stream_id))] == written
    finally:
        c.close()


def test_closing_two_streams_whose_slices_a_cut_moved_lets_every_block_commit(tmp_path):
    """Two streams close together while an older block is slow to PUT: the close's cuts seal
    one block with the first stream's slice and move the second's into the next block. Both
    blocks go up with nothing left to upload (the close committed those tails). The close's
    record of the second tail must last until the block now holding it commits: dropped with
    the first block, the second block's commit request came out empty and was retried until
    close_timeout (MetadataError: no objects)."""
    store = FirstPutSlow(LocalObjectStore(str(tmp_path / "objects")), 1.0)
    c = client(tmp_path, store, upload_threshold=4 * MiB, split_size=256 * KiB, cache_size=16 * MiB,
               stream_tail_limit=4 * MiB, upload_idle=False)
    try:
        hot, a, b = c.create_stream(), c.create_stream(), c.create_stream()
        for s in (a, b):
            s.append(RecordBatch(b"tail of %d" % s.stream_id, 1)).result(10)
        for _ in range(40):                        # a cut whose PUT takes 1 s
            hot.append(RecordBatch(os.urandom(8 * KiB), 1)).result(10)
        c.close_streams([a, b], timeout=10)
        c.force_upload(10)                         # OperationTimeoutError before the fix
        assert c.stats()["upload"]["commit_retries"] == 0
    finally:
        c.close()


# ---- the visibility deadline (upload_interval) ----------------------------------------------------

def committed_ends(c, streams) -> list[int]:
    return [c.metadata.get_stream(s.stream_id).end_offset for s in streams]


def test_the_deadline_uploads_every_streams_tail_in_one_object(tmp_path):
    """Five quiet streams, one small record each: upload_interval after the first record, one
    StreamSetObject carries all five tails (one PUT, one commit), counted as a deadline."""
    c = client(tmp_path, upload_interval=0.3)
    try:
        streams = [c.create_stream() for _ in range(5)]
        for f in [s.append(RecordBatch(b"quiet %d" % s.stream_id, 1)) for s in streams]:
            f.result(10)
        wait_for(lambda: committed_ends(c, streams) == [1] * 5)
        # the cache learns of the commit just after the metadata does
        wait_for(lambda: c.stats()["visibility_lag_s"] == 0.0)
        stats = c.stats()
        assert stats["upload"]["triggers"]["deadline"]["objects"] == 1
        assert stats["upload"]["stream_set_objects"] == 1 and stats["upload"]["stream_objects"] == 0
    finally:
        c.close()


def test_light_traffic_makes_at_most_one_upload_per_deadline(tmp_path):
    """Three streams at ~30 records/s each for 1.5 s: each deadline upload takes every stream's
    tail, and a block's deadline counts from its oldest record, so there are at most
    elapsed / upload_interval + 1 of them (fewer if the machine is slow), never one per stream
    or per record."""
    interval = 0.25
    c = client(tmp_path, upload_interval=interval)
    try:
        streams = [c.create_stream() for _ in range(3)]
        started = time.monotonic()
        futures = []
        while time.monotonic() - started < 1.5:
            futures += [(s, s.append(RecordBatch(os.urandom(1 * KiB), 1))) for s in streams]
            time.sleep(0.03)
        ends = {}
        for s, f in futures:
            ends[s.stream_id] = f.result(10).base_offset + 1
        appended = [ends[s.stream_id] for s in streams]
        wait_for(lambda: committed_ends(c, streams) == appended)
        elapsed = time.monotonic() - started
        deadline = c.stats()["upload"]["triggers"]["deadline"]
        assert 2 <= deadline["blocks"] <= elapsed / interval + 1, (deadline, elapsed)
        assert deadline["objects"] == deadline["blocks"], "one StreamSetObject per deadline upload"
    finally:
        c.close()


class SlowStore:
    """A store whose PUTs from the upload pool take `seconds` while `slow` is set (they wait, as
    a network store's do)."""

    cpu_bound_puts = False

    def __init__(self, inner, seconds: float) -> None:
        import threading
        self.inner, self.seconds, self.slow = inner, seconds, threading.Event()
        self.slow.set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key, data) -> None:
        import threading
        if self.slow.is_set() and threading.current_thread().name.startswith("s3stream-put"):
            time.sleep(self.seconds)
        self.inner.put(key, data)


class CountingSlowStore(SlowStore):
    """A SlowStore that notes the most PUTs in flight at once."""

    def __init__(self, inner, seconds: float) -> None:
        import threading
        super().__init__(inner, seconds)
        self.lock, self.now, self.most = threading.Lock(), 0, 0

    def put(self, key, data) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            super().put(key, data)
        finally:
            with self.lock:
                self.now -= 1


def test_one_stream_keeps_put_concurrency_puts_in_flight_behind_a_slow_store(tmp_path):
    """One hot stream behind 200 ms PUTs, one encoding thread and put_concurrency 4: its tail
    bound (twice the split size) counts only bytes no PUT has started on, so its cuts go up
    four at a time, and the bound still holds once each append returns. Before, the bound
    counted bytes until their PUT ended and the pool had one thread: one PUT at a time, the
    stream capped at the bound per PUT round trip (0.49 of the WAL alone behind S3-like PUTs)."""
    store = CountingSlowStore(LocalObjectStore(str(tmp_path / "objects")), 0.2)
    limit = 512 * KiB
    c = client(tmp_path, store, upload_threshold=4 * MiB, split_size=256 * KiB, cache_size=16 * MiB,
               stream_tail_limit=limit, upload_idle=False, upload_concurrency=1, put_concurrency=4)
    try:
        s = c.create_stream()
        written = []
        for _ in range(384):                       # 3 MiB: twelve cuts
            payload = os.urandom(8 * KiB)
            written.append((s.append(RecordBatch(payload, 1)).result(10).base_offset, payload))
            assert c.unuploaded_bytes(s) <= limit
        c.force_upload(30)
        assert store.most >= 3, f"at most {store.most} PUT(s) in flight"
        assert store.most <= 4, "put_concurrency bounds the PUTs in flight"
        assert [(b, bytes(p)) for b, _, p in read_all(s)] == written
    finally:
        c.close()


@pytest.mark.slow
def test_a_node_behind_its_deadline_says_so(tmp_path):
    """With PUTs slower than the deadline, records wait longer than upload_interval to be
    readable: the node's visibility lag (stats, s3stream_visibility_lag_seconds) tells at least
    the age of the oldest record not yet committed, never less; once the store is fast again
    it falls back to 0."""
    store = SlowStore(LocalObjectStore(str(tmp_path / "objects")), 2.0)
    c = client(tmp_path, store, upload_interval=0.1)
    try:
        s = c.create_stream()
        acked = time.monotonic()
        s.append(RecordBatch(b"late", 1)).result(10)
        time.sleep(0.8)
        lag = c.stats()["visibility_lag_s"]
        uncommitted = c.metadata.get_stream(s.stream_id).end_offset == 0
        truth = time.monotonic() - acked
        if uncommitted:                              # the 2 s PUT has not returned
            assert lag >= 0.8 and lag <= truth + 0.05, (lag, truth)
        store.slow.clear()
        wait_for(lambda: c.metadata.get_stream(s.stream_id).end_offset == 1)
        wait_for(lambda: c.stats()["visibility_lag_s"] == 0.0)
    finally:
        c.close()


@pytest.mark.slow
def test_a_reader_in_another_process_sees_a_quiet_stream_before_it_closes(tmp_path):
    """A stream at 10 records/s of 1 KiB with the default deadline: a reader that is not a node,
    in another process (`open_reader(...).tail`), sees every record while the writer still has
    the stream open. Before issue 51 (upload_interval None) it saw none until the close.
    Prints the lag from acknowledgement to seen (the visibility bench measures it properly)."""
    import json
    import subprocess
    import sys
    c = StreamClient(1, tmp_path / "node1.wal", f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db",
                     small_config(upload_interval=0.5, reclaim_interval=None))
    child = None
    try:
        s = c.create_stream()
        code = (
            "import json, sys, time\n"
            "import s3stream\n"
            f"with s3stream.open_reader(metadata={f'sqlite:///{tmp_path}/meta.db'!r}, "
            f"object_store={f'file://{tmp_path}/objects'!r}) as r:\n"
            "    print('ready', flush=True)\n"
            f"    for b in r.tail({s.stream_id}, 0, idle_timeout=30):\n"
            "        print(json.dumps([b.base_offset, b.count, time.time()]), flush=True)\n")
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        acked = {}
        for i in range(20):
            offset = s.append(RecordBatch(os.urandom(1 * KiB), 1)).result(10).base_offset
            acked[offset] = time.time()
            time.sleep(0.1)
        seen = {}
        while len(seen) < len(acked):
            line = child.stdout.readline()
            assert line, "the reader ended before it saw every record"
            base, count, at = json.loads(line)
            for o in range(base, base + count):
                seen[o] = at
        assert sorted(seen) == list(range(20)) and s.is_open
        lags = sorted(seen[o] - acked[o] for o in acked)
        print(f"append to seen in another process: p50 {lags[len(lags) // 2]:.3f} s, max {lags[-1]:.3f} s")
    finally:
        if child is not None:
            child.kill()
            child.wait()
        c.close()


# ---- the policy's invariants under random traffic ------------------------------------------------

class JitteryStore:
    """A store whose PUTs from the upload pool each take a random 0 to `most` seconds."""

    def __init__(self, inner, most: float, seed: int) -> None:
        import random
        import threading
        self.inner, self.most = inner, most
        self.random, self.lock = random.Random(seed), threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key, data) -> None:
        import threading
        if threading.current_thread().name.startswith("s3stream-put"):
            with self.lock:
                delay = self.random.uniform(0, self.most)
            time.sleep(delay)
        self.inner.put(key, data)


def _ops():
    from hypothesis import strategies as st
    append = st.tuples(st.just("append"), st.integers(0, 3), st.sampled_from([100, 2 * KiB, 24 * KiB, 100 * KiB]),
                       st.integers(1, 12))
    spread = st.tuples(st.just("spread"), st.just(0), st.sampled_from([2 * KiB, 24 * KiB]), st.integers(1, 8))
    close = st.tuples(st.just("close"), st.integers(0, 3), st.just(0), st.just(0))
    pause = st.tuples(st.just("pause"), st.just(0), st.just(0), st.integers(1, 100))
    return st.lists(st.one_of(append, append, spread, close, pause), min_size=5, max_size=25)


@pytest.mark.slow
def test_policy_invariants_under_random_traffic(tmp_path_factory):
    """Random streams, sizes, bursts, closes and pauses over a store whose PUTs take a random
    0-60 ms, with a visibility deadline: (1) no stream's tail not yet PUT (what its close would
    PUT) ever passes stream_tail_limit once its append returned; (2) no object is smaller than the policy
    allows unless a trigger that may make small ones made it: every object of a cut is at least
    3/4 of split_size, every block sealed at size at least upload_threshold, and the counters
    name a trigger for every committed object; (3) every acknowledged record reads back once,
    in order; (4) once everything is committed, the node reports no visibility lag."""
    from hypothesis import HealthCheck, given, settings
    from s3stream.engine.uploadpolicy import TRIGGERS

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(ops=_ops())
    def run(ops):
        tmp = tmp_path_factory.mktemp("policy")
        limit = 512 * KiB
        store = JitteryStore(LocalObjectStore(str(tmp / "objects")), 0.06, len(ops))
        c = client(tmp, store, upload_threshold=512 * KiB, split_size=256 * KiB, cache_size=4 * MiB,
                   stream_tail_limit=limit, upload_interval=0.05, upload_idle=False)
        try:
            streams = [c.create_stream() for _ in range(4)]
            written: dict[int, list] = {s.stream_id: [] for s in streams}
            for kind, i, size, n in ops:
                s = streams[i]
                if kind in ("append", "spread"):
                    for s in [s] * n if kind == "append" else streams * n:
                        payload = os.urandom(size)
                        future = s.append(RecordBatch(payload, 1))
                        assert c.unuploaded_bytes(s) <= limit, (c.unuploaded_bytes(s), s.tail, limit)
                        written[s.stream_id].append((future, payload))
                elif kind == "close":
                    s.close(timeout=30)
                    streams[i] = c.open_stream(s.stream_id)
                else:
                    time.sleep(n / 1000)
            for stream_id, items in written.items():
                written[stream_id] = [(f.result(20).base_offset, p) for f, p in items]
            c.force_upload(30)
            stats = c.stats()
            triggers = stats["upload"]["triggers"]
            assert set(triggers) <= set(TRIGGERS), triggers
            seen.update(triggers)
            assert sum(t["objects"] for t in triggers.values()) == stats["upload"]["objects"]
            if "cut" in triggers:
                assert triggers["cut"]["min_object"] >= 192 * KiB, triggers["cut"]
            if "size" in triggers:
                assert triggers["size"]["min_block"] >= 512 * KiB, triggers["size"]
            wait_for(lambda: c.stats()["visibility_lag_s"] == 0.0)
            for s in streams:
                got = [(b, bytes(p)) for b, _, p in read_all(s)]
                assert got == written[s.stream_id]
        finally:
            c.close()

    seen: set[str] = set()
    run()
    # The examples reach the rules checked above (derandomized: the same examples every run).
    assert {"cut", "size", "deadline", "close"} <= seen, seen
