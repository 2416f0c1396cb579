"""A node's identity is bound to its WAL (issue 10, case 2): a second instance of a node id with
another WAL neither fences a running one nor loses what the old WAL holds."""
from __future__ import annotations

import os

import pytest

import s3stream
from s3stream import RecordBatch, StreamClient
from conftest import MiB, small_config
from test_engine import read_all
from test_engine_model import crash

CONFIG = small_config(upload_threshold=4 * MiB, cache_size=16 * MiB, reclaim_interval=None)


def read_on(tmp_path, metadata_url: str, wal_name: str, stream_id: int) -> list[bytes]:
    """Start node 1 with WAL `wal_name` and read the stream back."""
    store, meta = f"file://{tmp_path}/objects", metadata_url
    client = StreamClient(1, str(tmp_path / wal_name), store, meta, CONFIG)
    try:
        return [bytes(p) for _, _, p in read_all(client.open_stream(stream_id))]
    finally:
        client.close()


def test_second_instance_with_another_wal_is_refused_while_the_first_runs(tmp_path, metadata_url):
    store, meta = f"file://{tmp_path}/objects", metadata_url
    a = StreamClient(1, str(tmp_path / "a.wal"), store, meta, CONFIG)
    try:
        s = a.create_stream()
        for i in range(10):
            s.append(RecordBatch(b"r%d" % i, 1)).result()
        with pytest.raises(s3stream.NodeConflictError) as e:
            StreamClient(1, str(tmp_path / "b.wal"), store, meta, CONFIG)
        assert "a.wal" in str(e.value) and "b.wal" in str(e.value)
        assert not os.path.exists(tmp_path / "b.wal")
        # A was not fenced: it still takes appends and commits them.
        assert s.append(RecordBatch(b"after", 1)).result().base_offset == 10
    finally:
        a.close()


def test_second_instance_recovers_the_old_wal_first(tmp_path, metadata_url):
    store, meta = f"file://{tmp_path}/objects", metadata_url
    a = StreamClient(1, str(tmp_path / "a.wal"), store, meta, CONFIG)
    s = a.create_stream()
    sid = s.stream_id
    for i in range(10):
        s.append(RecordBatch(b"r%d" % i, 1)).result()
    crash(a)                                   # the 10 records are only in a.wal
    assert read_on(tmp_path, metadata_url, "b.wal", sid) == [b"r%d" % i for i in range(10)]


def test_old_wal_unreadable_here_is_refused_by_name(tmp_path, metadata_url):
    store, meta = f"file://{tmp_path}/objects", metadata_url
    a = StreamClient(1, str(tmp_path / "a.wal"), store, meta, CONFIG)
    s = a.create_stream()
    s.append(RecordBatch(b"x", 1)).result()
    crash(a)
    os.rename(tmp_path / "a.wal", tmp_path / "moved.wal")
    with pytest.raises(s3stream.NodeConflictError) as e:
        StreamClient(1, str(tmp_path / "b.wal"), store, meta, CONFIG)
    assert "a.wal" in str(e.value) and "fail_over" in str(e.value)
    # With the WAL back where the node left it, the node starts and nothing was lost.
    os.rename(tmp_path / "moved.wal", tmp_path / "a.wal")
    assert read_on(tmp_path, metadata_url, "a.wal", s.stream_id) == [b"x"]


def test_a_node_with_no_open_streams_may_take_a_new_wal(tmp_path, metadata_url):
    store, meta = f"file://{tmp_path}/objects", metadata_url
    a = StreamClient(1, str(tmp_path / "a.wal"), store, meta, CONFIG)
    s = a.create_stream()
    s.append(RecordBatch(b"x", 1)).result()
    a.close()                                  # clean: everything uploaded, streams closed
    os.unlink(tmp_path / "a.wal")
    assert read_on(tmp_path, metadata_url, "b.wal", s.stream_id) == [b"x"]
