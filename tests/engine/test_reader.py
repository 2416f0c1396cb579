"""Issue 29, a reader that is not a node (s3stream.open_reader): it reads what a node committed,
over both metadata stores and both object stores, from another process too; it never sees an
offset that is not committed and never changes metadata or the store; tail() follows commits."""
from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from s3stream import OffsetOutOfRangeError, Record, RecordBatch, StreamClient, StreamNotFoundError, open_reader
from s3stream.objectstore import open_object_store

from conftest import is_postgres, small_config
from s3stream.cluster import open_partition, read_partition


def snapshot_metadata(url: str) -> list:
    """Every row of every table of the metadata database, in a stable order."""
    if is_postgres(url):
        import psycopg
        with psycopg.connect(url) as conn:
            tables = [r[0] for r in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema() "
                "ORDER BY table_name")]
            return [(t, sorted(map(repr, conn.execute(f"SELECT * FROM {t}").fetchall()))) for t in tables]
    conn = sqlite3.connect(url.removeprefix("sqlite:///"))
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def snapshot_store(url: str) -> list:
    store = open_object_store(url)
    try:
        return sorted((o.key, o.size) for o in store.list(""))
    finally:
        store.close()


@pytest.fixture
def node(tmp_path, store_url, metadata_url):
    c = StreamClient(1, tmp_path / "node1.wal", store_url, metadata_url, small_config(reclaim_interval=None))
    yield c
    c.close()


def test_reader_reads_what_a_node_committed_and_changes_nothing(node, store_url, metadata_url):
    s = node.create_stream()
    payloads = [b"%d-" % i + bytes(100 * i) for i in range(50)]
    for p in payloads:
        s.append(RecordBatch(p, 1))
    s.flush(10)
    node.force_upload(30)
    p = open_partition(node, "p1")
    p.append_records([Record(b"k", b"v")]).result(10)
    node.force_upload(30)
    s.append(RecordBatch(b"acknowledged, not uploaded", 1)).result(10)   # offset 50: in the WAL only
    meta_before, store_before = snapshot_metadata(metadata_url), snapshot_store(store_url)
    with open_reader(metadata_url, store_url) as reader:
        got, pos = [], 0
        while pos < 50:
            res = reader.fetch_committed(s.stream_id, pos)
            got += [bytes(b.payload) for b in res.batches]
            pos = res.end_offset
        assert got == payloads
        assert reader.fetch_committed(s.stream_id, 49, 51).end_offset == 50    # not committed: not readable
        with pytest.raises(OffsetOutOfRangeError):
            reader.fetch_committed(s.stream_id, 51)
        assert reader.fetch_committed(s.stream_id, 50).batches == []
        part = read_partition(reader, "p1")
        records = [r for b in part.fetch(part.start_offset).batches for r in b.records()]
        assert [(r.key, r.value) for r in records] == [(b"k", b"v")]
        with pytest.raises(StreamNotFoundError):
            read_partition(reader, "no-such-partition")
    assert snapshot_metadata(metadata_url) == meta_before
    assert snapshot_store(store_url) == store_before


READER_CHILD = """
import hashlib, sys
from s3stream import open_reader
meta, store, sid, end = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
h, pos = hashlib.sha256(), 0
with open_reader(meta, store) as r:
    while pos < end:
        res = r.fetch_committed(sid, pos, end)
        for b in res.batches:
            h.update(bytes(b.payload))
        pos = res.end_offset
print(h.hexdigest())
"""


@pytest.mark.parametrize("store_url", ["local"], indirect=True)
def test_readers_in_other_processes(node, store_url, metadata_url, tmp_path):
    s = node.create_stream()
    expected = hashlib.sha256()
    for i in range(200):
        data = bytes([i % 256]) * 1000
        s.append(RecordBatch(data, 1))
        expected.update(data)
    s.flush(10)
    node.force_upload(30)
    children = [subprocess.Popen([sys.executable, "-c", READER_CHILD, metadata_url, store_url, str(s.stream_id), "200"],
                                 stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [c.communicate(timeout=120)[0].strip() for c in children]
    assert [c.returncode for c in children] == [0, 0, 0]
    assert outs == [expected.hexdigest()] * 3
    assert [n.node_id for n in node.metadata.list_nodes()] == [1]         # no reader registered


@pytest.mark.parametrize("store_url", ["local"], indirect=True)
def test_tail_follows_commits_in_order(node, store_url, metadata_url):
    s = node.create_stream()
    seen: list[tuple[int, bytes]] = []
    delays: list[float] = []
    committed_at: dict[int, float] = {}
    with open_reader(metadata_url, store_url) as reader:
        def follow() -> None:
            for batch in reader.tail(s.stream_id, 0, idle_timeout=5.0):
                seen.append((batch.base_offset, bytes(batch.payload)))
                if batch.base_offset in committed_at:
                    delays.append(time.monotonic() - committed_at[batch.base_offset])
                if len(seen) == 30:
                    return

        t = threading.Thread(target=follow)
        t.start()
        for round_ in range(3):
            for i in range(10):
                s.append(RecordBatch(b"r%d-%d" % (round_, i), 1))
            s.flush(10)
            node.force_upload(30)
            committed_at[round_ * 10] = time.monotonic()
            time.sleep(0.2)
        t.join(30)
        assert not t.is_alive()
    assert [o for o, _ in seen] == list(range(30))
    assert [p for _, p in seen] == [b"r%d-%d" % (r, i) for r in range(3) for i in range(10)]
    print(f"tail visibility after force_upload returned: {[round(d * 1000, 1) for d in delays]} ms")


@pytest.mark.parametrize("store_url", ["local"], indirect=True)
def test_consumer_groups_work_with_a_reader(node, store_url, metadata_url):
    """A consumer that is not a node: reads a partition through a reader, commits its position
    in a consumer group (the only thing written, by the caller, through the reader's metadata),
    and a second reader resumes from it."""
    from s3stream import ConsumerGroups
    p = open_partition(node, "events")
    for i in range(6):
        p.append_records([Record(b"%d" % i)]).result(10)
    node.force_upload(30)
    with open_reader(metadata_url, store_url) as reader:
        groups = ConsumerGroups(reader.metadata)
        generation = groups.join("g", "consumer-1")
        part = read_partition(reader, "events")
        first = [r for b in part.fetch(part.start_offset, part.start_offset + 3).batches for r in b.records()][:3]
        groups.commit("g", "events", first[-1].offset + 1, generation)
    with open_reader(metadata_url, store_url) as reader:
        position = ConsumerGroups(reader.metadata).offsets("g")["events"]
        part = read_partition(reader, "events")
        rest = [r for b in part.fetch(position).batches for r in b.records()]
    assert [r.key for r in first + rest] == [b"%d" % i for i in range(6)]


@pytest.mark.parametrize("store_url", ["local"], indirect=True)
def test_fetches_inside_the_known_range_do_not_ask_metadata(node, store_url, metadata_url):
    """A catch-up reader reads the stream's committed range from metadata once per RANGE_RECHECK,
    not once per fetch (a node never asks), yet a fetch past that range sees a new commit at once."""
    from s3stream.metadata import open_metadata
    s = node.create_stream()
    for i in range(40):
        s.append(RecordBatch(b"%d" % i + bytes(2000), 1))
    s.flush(10)
    node.force_upload(30)
    meta = open_metadata(metadata_url)
    asked = []
    get_stream = meta.get_stream
    meta.get_stream = lambda stream_id: asked.append(stream_id) or get_stream(stream_id)
    try:
        with open_reader(meta, store_url) as reader:
            pos = 0
            while pos < 40:
                pos = reader.fetch_committed(s.stream_id, pos, max_bytes=4000).end_offset
            assert len(asked) == 1
            assert reader.fetch_committed(s.stream_id, 40).batches == []
            s.append(RecordBatch(b"new", 1))
            s.flush(10)
            node.force_upload(30)
            assert [bytes(b.payload) for b in reader.fetch_committed(s.stream_id, 40).batches] == [b"new"]
            with pytest.raises(OffsetOutOfRangeError):
                reader.fetch_committed(s.stream_id, 42, 43)
    finally:
        meta.close()
