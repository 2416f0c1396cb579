"""Compaction with the real parts (WAL file, SQLite, local directory; S3 over moto's HTTP server
where marked): reads are unchanged by any compaction (hypothesis, against a model), memory stays
within the budget, trimmed and deleted data is freed, readers and appenders running during
compaction see consistent data, and the runner pauses, stops and reports."""
from __future__ import annotations

import os
import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import compaction
from compaction import CompactionConfig, Compactor, object_stats
from compaction.plan import plan_stream_merges, split_pieces, Piece
from s3stream import ConfigError, RecordBatch, StreamClient, StreamFencedError
from s3stream.engine.lifecycle import ObjectReclaimer
from s3stream.metadata import ObjectMeta, ObjectState, ObjectType, SqliteMetadataStore, StreamRange
from s3stream.objectformat import IndexEntry
from conftest import KiB, MiB, small_config
from test_engine import read_all

SECOND = 10 ** 9


def compaction_config(**overrides) -> CompactionConfig:
    """Scaled like small_config: objects of a few hundred KiB, a 1 MiB memory budget."""
    kw = dict(sso_interval=3600, so_interval=3600, force_split_age=3600, split_size=32 * KiB,
              small_object_size=32 * KiB, stream_object_max_size=256 * KiB, memory_budget=1 * MiB,
              read_chunk=64 * KiB, object_block_size=16 * KiB, throttle_bytes_per_s=None)
    kw.update(overrides)
    return CompactionConfig(**kw)


class Node:
    """One client plus what tests need around it: a compactor whose clock can jump ahead (to
    pass the force-split age), a reclaimer without delay, and the model of every stream."""

    def __init__(self, tmp_path, store_url=None, node_id=1, config=None, **engine):
        engine.setdefault("reclaim_interval", None)
        self.client = StreamClient(node_id, tmp_path / f"node{node_id}.wal",
                                   store_url or f"file://{tmp_path}/objects",
                                   f"sqlite:///{tmp_path}/meta.db", small_config(**engine))
        self.store, self.meta = self.client._store, self.client._meta
        self.skew = 0
        self.compactor = Compactor(self.store, self.meta, node_id, self.client.node_epoch,
                                   config or compaction_config(),
                                   clock=lambda: time.time_ns() + self.skew)
        self.reclaimer = ObjectReclaimer(self.store, self.meta, 0)
        self.model: dict[int, list] = {}
        self.streams = {}

    def create(self, n):
        """n new streams; returns their ids (handles change at each upload: use node.s(id))."""
        for _ in range(n):
            s = self.client.create_stream()
            self.streams[s.stream_id] = s
            self.model[s.stream_id] = []
        return list(self.streams)[-n:]

    def append(self, stream_id, sizes, rng):
        stream = self.streams[stream_id]
        futures = []
        for size in sizes:
            payload = rng.randbytes(size)
            count = 1 + size % 5
            futures.append((stream.append(RecordBatch(payload, count)), count, payload))
        for f, count, payload in futures:
            self.model[stream.stream_id].append((f.result(10).base_offset, count, payload))

    def upload(self):
        """Upload everything appended so far, as the background does (blocks into
        StreamSetObjects and split StreamObjects): StreamClient.force_upload."""
        self.client.force_upload(20)

    def flush(self, rng):
        """Wait until every block appended so far is committed, including blocks of streams
        deleted since: uploads commit in block order, so a new stream's one batch, closed, is a
        barrier."""
        (barrier,) = self.create(1)
        self.append(barrier, [1], rng)
        self.upload()

    def s(self, stream_id):
        return self.streams[stream_id]

    def trim(self, stream_id, offset):
        self.streams[stream_id].trim(offset)

    def destroy(self, stream_id):
        self.streams.pop(stream_id).destroy()

    def expected(self, stream):
        return [b for b in self.model[stream.stream_id] if b[0] + b[1] > stream.start_offset]

    def check_reads(self):
        for s in self.streams.values():
            assert read_all(s) == self.expected(s), f"stream {s.stream_id}"

    def check_metadata(self):
        """Committed ranges of every stream are disjoint and cover [start, committed end); every
        committed object is in the store."""
        keys = {info.key for info in self.store.list()}
        for o in self.meta.list_objects(state=ObjectState.COMMITTED):
            assert o.key in keys, f"committed object {o.object_id} missing from the store"
        for s in self.streams.values():
            m = self.meta.get_stream(s.stream_id)
            refs = self.meta.get_object_refs(s.stream_id, m.start_offset, m.end_offset, 1 << 20)
            pos = m.start_offset
            for r in refs:
                assert r.start_offset <= pos < r.end_offset, (s.stream_id, pos, refs)
                pos = r.end_offset
            assert pos >= m.end_offset or m.start_offset >= m.end_offset

    def store_bytes(self):
        return sum(info.size for info in self.store.list())

    def close(self):
        self.client.close()


# ---- configuration and planning -----------------------------------------------------------------

def test_config_defaults_and_validation():
    c = CompactionConfig()
    assert c.max_output_size < c.memory_budget // 2 and c.merged_object_size <= c.max_output_size
    for bad in (dict(memory_budget=0), dict(sso_interval=0), dict(read_chunk=200 * MiB),
                dict(garbage_ratio=0), dict(merge_growth=1.0), dict(throttle_bytes_per_s=0),
                dict(small_object_size=2 * 1024 * MiB), dict(chunk_pause=-1),
                dict(split_size=1.5), dict(memory_budget=1 * MiB, object_block_size=512 * KiB)):
        with pytest.raises(ConfigError):
            CompactionConfig(**bad)
    with pytest.raises(ConfigError, match="max_batch_bytes"):
        compaction_config().check_engine(8 * MiB)


def _so(object_id, start, end, size):
    return ObjectMeta(object_id, f"k{object_id}", size, ObjectType.STREAM_OBJECT,
                      ObjectState.COMMITTED, None, None, 0, 0, 0, None,
                      (StreamRange(1, start, end),))


def test_stream_object_merge_plan_is_size_tiered():
    small = [_so(i, i * 10, i * 10 + 10, 100) for i in range(4)]
    groups = plan_stream_merges(small, small_size=1000, max_size=10_000, growth=2)
    assert [[o.object_id for o in g] for g in groups] == [[0, 1, 2, 3]]
    # A big object next to small ones: merged only once the small ones double it.
    mixed = [_so(0, 0, 10, 600)] + [_so(i, i * 10, i * 10 + 10, 100) for i in range(1, 4)]
    groups = plan_stream_merges(mixed, small_size=1000, max_size=10_000, growth=2)
    assert [[o.object_id for o in g] for g in groups] == [[1, 2, 3]]
    # Objects at or above the small size, gaps, and the size limit split the runs.
    objs = [_so(0, 0, 10, 100), _so(1, 10, 20, 1000), _so(2, 20, 30, 100), _so(3, 30, 40, 100),
            _so(4, 50, 60, 100), _so(5, 60, 70, 100)]
    groups = plan_stream_merges(objs, small_size=1000, max_size=10_000, growth=2)
    assert [[o.object_id for o in g] for g in groups] == [[2, 3], [4, 5]]
    groups = plan_stream_merges(small, small_size=1000, max_size=250, growth=2)
    assert [[o.object_id for o in g] for g in groups] == [[0, 1], [2, 3]]


def test_split_pieces_cuts_even_parts_of_whole_blocks():
    source = _so(9, 0, 100, 10_000)
    entries = tuple(IndexEntry(1, i, i + 1, 1, 100, i * 100, 1) for i in range(25))
    parts = split_pieces([Piece(source, entries)], 1000)
    sizes = [sum(p.nbytes for p in part) for part in parts]
    assert sum(sizes) == 2500 and max(sizes) <= 1000 and min(sizes) >= 800
    offsets = [e.start_offset for part in parts for p in part for e in p.entries]
    assert offsets == list(range(25))


# ---- reads are unchanged by compaction (property test against the model) -------------------------

OPS = st.one_of(
    st.tuples(st.just("append"), st.integers(0, 3), st.lists(
        st.sampled_from([10, 300, 3000, 9000, 30_000]), min_size=1, max_size=12)),
    st.tuples(st.just("upload")),
    st.tuples(st.just("trim"), st.integers(0, 3), st.floats(0, 1)),
    st.tuples(st.just("delete"), st.integers(0, 3)),
    st.tuples(st.just("compact"), st.booleans()),
    st.tuples(st.just("merge")),
    st.tuples(st.just("reclaim")),
)


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("COMPACTION_EXAMPLES", "60")), deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(OPS, min_size=4, max_size=18), seed=st.integers(0, 1000))
def test_reads_unchanged_by_any_compaction(tmp_path_factory, ops, seed):
    rng = random.Random(seed)
    node = Node(tmp_path_factory.mktemp("model"))
    try:
        streams = node.create(4)
        for op in ops + [("flush",), ("compact", False), ("compact", True), ("merge",),
                         ("reclaim",)]:
            if op[0] == "append" and streams[op[1]] in node.streams:
                node.append(streams[op[1]], op[2], rng)
            elif op[0] == "upload":
                node.upload()
            elif op[0] == "flush":
                node.flush(rng)
            elif op[0] == "trim" and streams[op[1]] in node.streams:
                s = node.s(streams[op[1]])
                node.trim(s.stream_id,
                          s.start_offset + int((s.confirm_offset - s.start_offset) * op[2]))
            elif op[0] == "delete" and streams[op[1]] in node.streams:
                node.destroy(streams[op[1]])
            elif op[0] == "compact":
                # force split: jump the compactor's clock past the force-split age
                node.skew = 7200 * SECOND if op[1] else 0
                node.compactor.compact_stream_sets()
            elif op[0] == "merge":
                node.compactor.compact_stream_objects()
            elif op[0] == "reclaim":
                node.reclaimer.run_once()
            node.check_reads()
        node.check_metadata()
        # Data of deleted streams and below start offsets left no committed object behind
        live = {s.stream_id: s.start_offset for s in node.streams.values()}
        for o in node.meta.list_objects(state=ObjectState.COMMITTED):
            assert any(r.stream_id in live and r.end_offset > live[r.stream_id] for r in o.ranges), o
        assert node.compactor.memory.peak <= node.compactor.config.memory_budget
    finally:
        node.close()


# ---- memory budget, several commits ---------------------------------------------------------------

def test_backlog_larger_than_budget_takes_several_commits_within_budget(tmp_path):
    node = Node(tmp_path, upload_threshold=512 * KiB, split_size=256 * KiB)
    rng = random.Random(3)
    streams = node.create(12)
    for round_ in range(8):
        for i, s in enumerate(streams):
            node.append(s, [2000 + 500 * i] * (4 + round_ % 3), rng)
        node.upload()
    ssos = node.meta.node_stream_set_objects(1)
    total = sum(o.size for o in ssos)
    assert total > 2 * node.compactor.config.memory_budget
    result = node.compactor.compact_stream_sets()
    assert result.commits >= 2 and result.objects_compacted == len(ssos)
    assert node.compactor.memory.peak <= node.compactor.config.memory_budget
    limit = node.compactor.config.max_output_size
    assert all(o.size <= limit * 1.01 for o in node.meta.list_objects(state=ObjectState.COMMITTED)
               if o.committed_ns and o.object_id > max(x.object_id for x in ssos))
    node.reclaimer.run_once()
    node.check_reads()
    node.check_metadata()
    # Compacted SSOs are not rewritten again until they are old (no write amplification)
    again = node.compactor.compact_stream_sets()
    assert again.commits == 0 and again.bytes_written == 0
    node.close()


@pytest.mark.parametrize("store_url", ["local", "s3"], indirect=True)
def test_force_split_and_merges_on_every_store(tmp_path, store_url):
    node = Node(tmp_path, store_url)
    rng = random.Random(5)
    streams = node.create(6)
    for _ in range(3):
        for s in streams:
            node.append(s, [700] * 6, rng)
        node.upload()
        node.compactor.compact_stream_sets()
    # a lone fresh SSO waits for the next one; two fresh ones merge into one compacted SSO
    assert len(node.meta.node_stream_set_objects(1)) == 2
    assert len(node.compactor.compacted_stream_set_objects()) == 1
    node.skew = 7200 * SECOND                      # every SSO is now old: split entirely
    node.compactor.compact_stream_sets()
    assert object_stats(node.meta)["stream_set_objects"]["count"] == 0
    for _ in range(5):                              # uploads split at once: small SOs pile up
        for s in streams:
            node.append(s, [700] * 6, rng)
        node.upload()
        node.compactor.compact_stream_sets()
    after_split = object_stats(node.meta)
    assert after_split["stream_set_objects"]["count"] == 0
    assert after_split["max_stream_objects_per_stream"] == 6
    node.reclaimer.run_once()
    node.check_reads()
    merged = node.compactor.compact_stream_objects()
    # every stream's six SOs merge, all in one commit
    assert merged.objects_compacted == 6 * len(streams) and merged.commits == 1
    after_merge = object_stats(node.meta)
    assert after_merge["max_stream_objects_per_stream"] <= 2
    node.reclaimer.run_once()
    node.check_reads()
    node.check_metadata()
    assert {i.key for i in node.store.list()} == {
        o.key for o in node.meta.list_objects(state=ObjectState.COMMITTED)}
    node.close()


# ---- trim, retention, deleted streams ---------------------------------------------------------------

def test_trim_and_retention_free_storage_down_to_retained_data(tmp_path):
    node = Node(tmp_path)
    rng = random.Random(9)
    streams = node.create(8)
    for _ in range(10):
        for i, s in enumerate(streams):
            node.append(s, [1500 * (1 + i)] * 5, rng)
        node.upload()
        node.compactor.compact_stream_sets()
    full = node.store_bytes()
    # Retention: keep the last ~10% of every stream; delete one stream altogether
    for sid in streams[1:]:
        s = node.s(sid)
        node.trim(sid, s.confirm_offset - (s.confirm_offset - s.start_offset) // 10)
    node.destroy(streams[0])
    retained = sum(len(b[2]) for s in node.streams.values() for b in node.expected(s))
    node.compactor.run_once()                   # garbage-heavy compacted SSOs are rewritten
    node.skew = 7200 * SECOND
    node.compactor.run_once()                   # and old ones split
    node.reclaimer.run_once()
    node.check_reads()
    used = node.store_bytes()
    assert used < full / 4
    # What is left above the retained payload: per-object headers, and a trimmed head that is
    # less than garbage_ratio of a stream's stored bytes (so stored <= retained / (1 - ratio))
    ratio = node.compactor.config.garbage_ratio
    assert used <= retained / (1 - ratio) + 64 * KiB, (used, retained)
    node.close()


def test_deleted_stream_data_is_dropped_and_reclaimed(tmp_path):
    node = Node(tmp_path)
    rng = random.Random(2)
    keep, gone = node.create(2)
    for _ in range(3):
        node.append(keep, [500] * 3, rng)
        node.append(gone, [4000] * 20, rng)   # big enough for StreamObjects too
        node.upload()
    node.destroy(gone)
    result = node.compactor.compact_stream_sets()
    assert result.bytes_dropped > 0
    node.reclaimer.run_once()
    for o in node.meta.list_objects():
        assert all(r.stream_id != gone for r in o.ranges if o.state != ObjectState.MARK_DESTROYED)
    # Every object is COMMITTED but the ids the uploader prepared ahead for its next objects.
    ahead = {object_id for object_id, _ in node.client._uploader._spare_ids}
    assert ahead
    assert not [o for o in node.meta.list_objects() if o.state != ObjectState.COMMITTED and o.object_id not in ahead]
    node.check_reads()
    node.close()
    meta = SqliteMetadataStore(str(tmp_path / "meta.db"))
    assert not meta.list_objects(state=ObjectState.PREPARED)               # let go by the close
    meta.close()


# ---- concurrency --------------------------------------------------------------------------------

@pytest.mark.slow
def test_readers_and_appenders_during_compaction_see_consistent_data(tmp_path):
    """Appenders, catch-up readers and a runner compacting (and a reclaimer deleting replaced
    objects after 50 ms) all at once: every read returns exactly what was appended."""
    node = Node(tmp_path, reclaim_interval=0.05, destroy_delay=0.05, upload_threshold=256 * KiB,
                split_size=64 * KiB, cache_size=1 * MiB, block_cache_size=64 * KiB)
    cfg = compaction_config(sso_interval=0.05, so_interval=0.1, force_split_age=0.5)
    node.compactor.config = cfg
    runner = compaction.CompactionRunner(node.compactor)
    streams = [node.s(sid) for sid in node.create(6)]
    stop = threading.Event()
    errors: list = []
    written: dict[int, dict[int, bytes]] = {s.stream_id: {} for s in streams}

    def payload(stream_id, seq):
        size = (100, 2000, 9000)[seq % 3]
        return seq.to_bytes(8, "little") + random.Random(stream_id * 1_000_003 + seq).randbytes(size)

    def appender(s):
        try:
            seq = 0
            while not stop.is_set():
                base = s.append(RecordBatch(payload(s.stream_id, seq), 2)).result(10).base_offset
                assert base == 2 * seq
                written[s.stream_id][base] = payload(s.stream_id, seq)
                seq += 1
        except Exception as e:   # noqa: BLE001
            errors.append(e)

    def reader(s):
        try:
            while not stop.is_set():
                pos = s.start_offset
                while pos < s.confirm_offset and not stop.is_set():
                    for b in s.fetch(pos, max_bytes=32 * KiB).batches:
                        # no gap, no duplicate, the very bytes appended at that offset
                        assert b.base_offset == pos, (s.stream_id, b.base_offset, pos)
                        assert b.payload == payload(s.stream_id, pos // 2), (s.stream_id, pos)
                        pos = b.end_offset
        except Exception as e:   # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=appender, args=(s,)) for s in streams]
    threads += [threading.Thread(target=reader, args=(s,)) for s in streams[:3]]
    runner.start()
    for t in threads:
        t.start()
    time.sleep(3.0)
    stop.set()
    for t in threads:
        t.join(30)
    runner.stop(10)
    assert not errors, errors[:3]
    totals = node.compactor.totals
    assert totals.commits >= 3 and totals.objects_compacted >= 3, totals
    assert runner.errors == 0, runner.last_error
    node.upload()
    for s in streams:
        got = read_all(node.s(s.stream_id))
        assert [(b, p) for b, _, p in got] == sorted(written[s.stream_id].items())
    node.close()


# ---- runner, attach, metrics, fencing -------------------------------------------------------------

def test_attach_pause_resume_stop_and_client_metrics(tmp_path):
    client = StreamClient(1, tmp_path / "n1.wal", f"file://{tmp_path}/objects",
                          f"sqlite:///{tmp_path}/meta.db", small_config(reclaim_interval=0.05,
                                                                          destroy_delay=0.01))
    runner = compaction.attach(client, compaction_config(sso_interval=0.05, so_interval=0.05),
                               start=False)
    runner.pause()
    runner.start()
    rng = random.Random(4)
    streams = [client.create_stream() for _ in range(5)]
    for _ in range(4):
        for s in streams:
            for _ in range(5):
                s.append(RecordBatch(rng.randbytes(900))).result(10)
        client.force_upload(10)                   # one StreamSetObject of the five tails
    time.sleep(0.3)
    assert runner.compactor.totals.commits == 0          # paused
    runner.resume()
    deadline = time.time() + 10
    while runner.compactor.totals.commits == 0 and time.time() < deadline:
        time.sleep(0.02)
    runner.stop(10)
    stats = client.stats()["compaction"]
    assert stats["totals"]["commits"] >= 1 and stats["totals"]["bytes_written"] > 0
    assert 1.0 < stats["write_amplification"] < 3.0
    assert stats["objects"]["stream_set_objects"]["count"] >= 1
    assert stats["peak_memory"] <= stats["memory_budget"]
    time.sleep(0.2)
    assert client.stats()["compaction"]["objects_deleted"] >= 1
    with pytest.raises(ValueError):
        client.add_stats_source("upload", lambda engine: {})
    client.close()


def test_restarted_node_fences_its_old_compactor(tmp_path):
    node = Node(tmp_path)
    rng = random.Random(1)
    streams = node.create(3)
    for _ in range(2):
        for s in streams:
            node.append(s, [1000] * 3, rng)
        node.upload()
    node.meta.fence_node(1)
    runner = compaction.CompactionRunner(node.compactor)
    node.compactor.config = compaction_config(sso_interval=0.01)
    runner.start()
    runner._thread.join(10)
    assert runner.fenced and isinstance(runner.last_error, StreamFencedError)
    # The outputs it wrote stay PREPARED: the lifecycle deletes them after their expiry
    assert all(o.state == ObjectState.PREPARED
               for o in node.meta.list_objects() if o.state != ObjectState.COMMITTED)
    node.close()


def test_throttle_limits_the_byte_rate(tmp_path):
    rate = 2 * MiB
    node = Node(tmp_path, config=compaction_config(throttle_bytes_per_s=rate, read_chunk=64 * KiB))
    rng = random.Random(6)
    streams = node.create(4)
    for _ in range(3):
        for s in streams:
            node.append(s, [3000] * 40, rng)
        node.upload()
    result = node.compactor.compact_stream_sets()
    moved = result.bytes_read + result.bytes_written
    assert moved > 3 * MiB // 2
    # only a burst of one read chunk is free; the rest is paid at the rate
    assert result.seconds >= (moved - 64 * KiB) / rate * 0.9
    assert result.throttled_seconds > 0.5
    node.check_reads()
    node.close()
