"""The stream engine end to end with real parts: WAL file, SQLite or PostgreSQL metadata, local
directory or S3 over HTTP (moto's server), two nodes."""
from __future__ import annotations

import random

import pytest

import s3stream
from s3stream import RecordBatch, StreamClient
from s3stream.metadata import ObjectState, ObjectType, open_metadata
from conftest import KiB, MiB, small_config


def client(tmp_path, node_id, store_url, metadata_url, config=None, **kw):
    return StreamClient(node_id, tmp_path / f"node{node_id}.wal", store_url, metadata_url,
                        config or small_config(), **kw)


def read_all(stream, start=None, max_bytes=64 * KiB):
    """Every batch from `start` (default: the start offset) to the confirm offset, by fetches."""
    pos = stream.start_offset if start is None else start
    out = []
    while pos < stream.confirm_offset:
        res = stream.fetch(pos, max_bytes=max_bytes)
        assert res.batches and res.batches[0].base_offset <= pos < res.batches[0].end_offset
        out += [(b.base_offset, b.count, b.payload) for b in res.batches]
        pos = res.end_offset
    return out


def write_random(streams, rng, n, hot=()):
    """Append n random batches; hot streams get a third of them (so they reach the split size)."""
    futures = []
    for _ in range(n):
        s = rng.choice(hot) if hot and rng.random() < 0.33 else rng.choice(streams)
        payload = rng.randbytes(rng.choice([1, 100, 1000, 5000, 20_000, 60_000]))
        count = rng.randrange(1, 10)
        futures.append((s.stream_id, s.append(RecordBatch(payload, count)), payload, count))
    expected: dict[int, list] = {s.stream_id: [] for s in streams}
    for sid, f, payload, count in futures:
        expected[sid].append((f.result(timeout=30).base_offset, count, payload))
    return expected


@pytest.mark.slow
def test_many_streams_close_reopen_on_second_node(tmp_path, store_url, metadata_url):
    rng = random.Random(7)
    a = client(tmp_path, 1, store_url, metadata_url)
    streams = [a.create_stream() for _ in range(40)]
    expected = write_random(streams, rng, 1500, hot=streams[:2])
    for sid, batches in expected.items():   # offsets are dense and in append order
        offs = [b for b, _, _ in batches]
        assert offs == sorted(offs)
    tail = streams[5]
    assert read_all(tail) == expected[tail.stream_id]          # from the cache and objects
    for s in streams:
        s.close()
    a.close()

    meta = open_metadata(metadata_url)
    kinds = {o.type for o in meta.list_objects(state=ObjectState.COMMITTED)}
    assert kinds == {ObjectType.STREAM_OBJECT, ObjectType.STREAM_SET_OBJECT}
    assert all(m.state.value == "CLOSED" for m in meta.list_streams())
    meta.close()

    b = client(tmp_path, 2, store_url, metadata_url)
    for sid, batches in expected.items():
        s = b.open_stream(sid)
        assert s.epoch == 1 and s.confirm_offset == (batches[-1][0] + batches[-1][1] if batches else 0)
        assert read_all(s) == batches
    # the new owner appends right after the old data
    s = b.streams()[0]
    end = s.confirm_offset
    assert s.append(RecordBatch(b"after", 3)).result(10).base_offset == end
    b.close()


def test_fetch_semantics(tmp_path, metadata_url):
    c = client(tmp_path, 1, f"file://{tmp_path}/objects", metadata_url)
    s = c.create_stream()
    futs = [s.append(RecordBatch(bytes([i]) * 100, 10)) for i in range(50)]
    assert [f.result(10).base_offset for f in futs] == list(range(0, 500, 10))
    # an offset inside a batch returns that whole batch first
    res = s.fetch(15, 45)
    assert [b.base_offset for b in res.batches] == [10, 20, 30, 40]
    # max_bytes bounds the result but never below one batch
    assert len(s.fetch(0, 500, max_bytes=250).batches) == 2
    assert len(s.fetch(0, 500, max_bytes=1).batches) == 1
    assert s.fetch(500, 500).batches == []
    assert s.fetch(490, 501).batches[-1].end_offset == 500      # an end past the confirm offset is capped
    with pytest.raises(s3stream.OffsetOutOfRangeError):
        s.fetch(501)
    s.trim(200)
    with pytest.raises(s3stream.OffsetOutOfRangeError, match="outside the readable range"):
        s.fetch(150)
    assert s.fetch(200, 210).batches[0].base_offset == 200
    with pytest.raises(s3stream.OffsetOutOfRangeError, match="backwards"):
        s.trim(100)
    with pytest.raises(s3stream.OffsetOutOfRangeError, match="beyond the confirm offset"):
        s.trim(600)
    s.close()
    # after close and reopen, the trim holds and reads come from objects
    s = c.open_stream(s.stream_id)
    assert s.start_offset == 200
    assert read_all(s) == [(i * 10, 10, bytes([i]) * 100) for i in range(20, 50)]
    c.close()


def test_bad_input(tmp_path, metadata_url):
    with pytest.raises(s3stream.ConfigError, match="split_size"):
        small_config(split_size=2 * MiB)
    with pytest.raises(s3stream.ConfigError, match="cache_size"):
        small_config(cache_size=1 * MiB)
    with pytest.raises(s3stream.ConfigError, match=r"put_concurrency \(2\) < upload_concurrency \(3\)"):
        small_config(upload_concurrency=3, put_concurrency=2)
    with pytest.raises(s3stream.ConfigError, match="put_concurrency must be a positive integer"):
        small_config(put_concurrency=0)
    assert s3stream.Config(upload_concurrency=12).put_concurrency == 12
    with pytest.raises(s3stream.ConfigError, match="node_id"):
        client(tmp_path, -1, f"file://{tmp_path}/o", metadata_url)
    with pytest.raises(s3stream.ConfigError, match="scheme"):
        client(tmp_path, 1, "ftp://nowhere", metadata_url)
    c = client(tmp_path, 1, f"file://{tmp_path}/objects", metadata_url)
    s = c.create_stream()
    with pytest.raises(s3stream.InvalidBatchError, match="count"):
        RecordBatch(b"x", 0)
    with pytest.raises(s3stream.InvalidBatchError, match="count"):
        RecordBatch(b"x", -3)
    with pytest.raises(s3stream.InvalidBatchError, match="max_batch_bytes"):
        s.append(RecordBatch(bytes(128 * KiB + 1), 1))
    with pytest.raises(s3stream.InvalidBatchError, match="RecordBatch"):
        s.append(b"raw bytes")
    assert s.next_offset == 0                       # nothing was appended by the bad calls
    s.append(RecordBatch(b"ok", 1)).result(10)
    with pytest.raises(s3stream.StreamNotFoundError):
        c.open_stream(12345)
    with pytest.raises(s3stream.StreamNotClosedError):
        c.open_stream(s.stream_id)
    c.close()


def test_other_node_cannot_open_an_open_stream(tmp_path, metadata_url):
    a = client(tmp_path, 1, f"file://{tmp_path}/objects", metadata_url)
    b = client(tmp_path, 2, f"file://{tmp_path}/objects", metadata_url)
    s = a.create_stream()
    s.append(RecordBatch(b"a", 1)).result(10)
    with pytest.raises(s3stream.StreamNotClosedError, match=r"open on node 1 .*`s3stream node fail-over 1`"):
        b.open_stream(s.stream_id)
    s.close()
    s2 = b.open_stream(s.stream_id)
    assert s2.epoch == s.epoch + 1
    with pytest.raises(s3stream.StreamClosedError):
        s.append(RecordBatch(b"stale", 1))
    assert [p for _, _, p in read_all(s2)] == [b"a"]
    a.close()
    b.close()


def test_destroy(tmp_path, metadata_url):
    c = client(tmp_path, 1, f"file://{tmp_path}/objects", metadata_url)
    s = c.create_stream()
    s.append(RecordBatch(b"x" * 1000, 1)).result(10)
    sid = s.stream_id
    s.destroy()
    with pytest.raises(s3stream.StreamNotFoundError):
        c.open_stream(sid)
    with pytest.raises(s3stream.StreamClosedError):
        s.append(RecordBatch(b"y", 1))
    c.close()
