"""Issue 10, cases 8 and 9: a closed or destroyed handle serves no reads, and offsets and ids of
the wrong type (floats, bools, strings, out of range) are refused by name, changing nothing."""
from __future__ import annotations

import pytest

import s3stream
from s3stream import InvalidArgumentError, RecordBatch, StreamClient, StreamClosedError

from conftest import small_config


def node(tmp_path, n: int) -> StreamClient:
    return StreamClient(n, tmp_path / f"n{n}.wal", f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db",
                        small_config())


def test_a_closed_handle_serves_no_reads_after_another_node_trims_and_appends(tmp_path):
    a = node(tmp_path, 1)
    old = a.create_stream()
    for i in range(10):
        old.append(RecordBatch(b"r%d" % i)).result(10)
    old.close()
    b = node(tmp_path, 2)
    new = b.open_stream(old.stream_id)
    new.trim(5)
    new.append(RecordBatch(b"r10")).result(10)
    for start in (0, 5):
        with pytest.raises(StreamClosedError, match=f"stream {old.stream_id} is closed"):
            old.fetch(start)
    # The open handle sees the trim and the new record.
    assert [bytes(x.payload) for x in new.fetch(5).batches] == [b"r5", b"r6", b"r7", b"r8", b"r9", b"r10"]
    b.close()
    a.close()


def test_a_destroyed_handle_serves_no_reads(tmp_path):
    a = node(tmp_path, 1)
    s = a.create_stream()
    s.append(RecordBatch(b"x")).result(10)
    assert bytes(s.fetch(0).batches[0].payload) == b"x"
    s.destroy()
    with pytest.raises(StreamClosedError):
        s.fetch(0)
    with pytest.raises(s3stream.StreamNotFoundError):
        a.open_stream(s.stream_id)
    a.close()


@pytest.mark.parametrize("bad", [5.5, 5.0, True, "5", None, -1, 1 << 63])
def test_trim_refuses_offsets_that_are_not_ints_and_changes_nothing(tmp_path, bad):
    a = node(tmp_path, 1)
    s = a.create_stream()
    for i in range(10):
        s.append(RecordBatch(b"%d" % i)).result(10)
    with pytest.raises(InvalidArgumentError, match="new_start_offset"):
        s.trim(bad)
    assert s.start_offset == 0
    s.close()
    b = node(tmp_path, 2)
    again = b.open_stream(s.stream_id)
    assert again.start_offset == 0 and len(again.fetch(0, max_bytes=1 << 20).batches) == 10
    b.close()
    a.close()


@pytest.mark.parametrize("args, name", [
    ((0.5, 5), "start_offset"), ((True, 5), "start_offset"), (("0",), "start_offset"),
    ((0, 5.0), "end_offset"), ((0, False), "end_offset"), ((0, 1 << 64), "end_offset"),
])
def test_fetch_refuses_offsets_that_are_not_ints(tmp_path, args, name):
    a = node(tmp_path, 1)
    s = a.create_stream()
    for i in range(10):
        s.append(RecordBatch(b"%d" % i)).result(10)
    with pytest.raises(InvalidArgumentError, match=name):
        s.fetch(*args)
    a.close()


@pytest.mark.parametrize("max_bytes", [0, -1, 1.5, True])
def test_fetch_refuses_a_max_bytes_that_is_not_a_positive_int(tmp_path, max_bytes):
    a = node(tmp_path, 1)
    s = a.create_stream()
    s.append(RecordBatch(b"x")).result(10)
    with pytest.raises(InvalidArgumentError, match="max_bytes") as info:
        s.fetch(0, max_bytes=max_bytes)
    assert isinstance(info.value, ValueError)          # what callers caught before
    a.close()


@pytest.mark.parametrize("bad", [True, 1.0, "1", 1 << 64, -1])
def test_open_stream_refuses_ids_that_are_not_ints_and_opens_nothing(tmp_path, bad):
    a = node(tmp_path, 1)
    s = a.create_stream()
    s.close()
    with pytest.raises(InvalidArgumentError, match="stream_id"):
        a.open_stream(bad)
    assert a.streams() == []                            # nothing was opened
    b = node(tmp_path, 2)
    assert b.open_stream(s.stream_id).stream_id == s.stream_id    # still closed, so another node opens it
    b.close()
    a.close()


@pytest.mark.parametrize("kw", [dict(buffers=2.5), dict(batch_bytes=True), dict(capacity="1G"), dict(writer_threads=1.0),
                                dict(max_record_bytes=2.0 ** 20), dict(full_timeout="30"), dict(direct_io=1)])
def test_wal_config_refuses_wrongly_typed_fields(kw):
    import wal
    with pytest.raises(wal.WALConfigError, match=next(iter(kw))):
        wal.WALConfig(**kw)


@pytest.mark.parametrize("kw", [dict(cache_size=True), dict(upload_threshold=64.0 * 2 ** 20), dict(append_timeout="3"),
                                dict(upload_interval="1"), dict(wal="x"), dict(wal_pressure=True),
                                dict(read_fetch_size=1.5), dict(read_timeout=None)])
def test_config_refuses_wrongly_typed_fields_by_name(kw):
    with pytest.raises(s3stream.ConfigError, match=next(iter(kw))):
        s3stream.Config(**kw)


@pytest.mark.parametrize("store, meta", [("", None), ("   ", None), (12345, None), (None, None),
                                         (None, ""), (None, 3.5), (None, object())])
def test_client_refuses_store_and_metadata_arguments_that_are_neither_url_nor_store(tmp_path, monkeypatch, store,
                                                                                  meta):
    monkeypatch.chdir(tmp_path)
    store = f"file://{tmp_path}/objects" if store is None and meta is not None else store
    meta = f"sqlite:///{tmp_path}/meta.db" if meta is None else meta
    with pytest.raises(s3stream.ConfigError, match="object_store|metadata"):
        StreamClient(1, tmp_path / "n1.wal", store, meta, small_config())
    assert sorted(p.name for p in tmp_path.iterdir()) == []      # nothing written: no WAL, no objects, no db


@pytest.mark.parametrize("node_id", [True, 1.0, -1, 1 << 64])
def test_client_refuses_node_ids_that_are_not_ints(tmp_path, node_id):
    with pytest.raises(s3stream.ConfigError, match="node_id"):
        StreamClient(node_id, tmp_path / "n.wal", f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db")


def test_a_second_instance_on_a_wal_in_use_is_refused_without_fencing_the_first(tmp_path):
    """Issue 10, case 3: the refused start changes nothing: the node epoch stays, and the running
    instance keeps appending and closes cleanly."""
    from s3stream.metadata import open_metadata
    a = node(tmp_path, 1)
    s = a.create_stream()
    s.append(RecordBatch(b"before")).result(10)
    with pytest.raises(s3stream.NodeConflictError, match="node 1 is already running on this host.*in use"):
        node(tmp_path, 1)
    meta = open_metadata(f"sqlite:///{tmp_path}/meta.db")
    assert meta.get_node(1).node_epoch == a.node_epoch
    meta.close()
    s.append(RecordBatch(b"after")).result(10)             # not fenced
    s.close()
    a.close()
    b = node(tmp_path, 2)
    assert [bytes(x.payload) for x in b.open_stream(s.stream_id).fetch(0).batches] == [b"before", b"after"]
    b.close()


def test_a_wal_path_that_cannot_be_created_is_refused_before_registering(tmp_path):
    from s3stream.metadata import SqliteMetadataStore
    meta = SqliteMetadataStore(str(tmp_path / "meta.db"))
    try:
        with pytest.raises(s3stream.ConfigError, match="does not exist"):
            StreamClient(5, str(tmp_path / "missing" / "n.wal"), f"file://{tmp_path}/objects", meta, small_config())
        assert meta.list_nodes() == []                  # nothing registered, no epoch bumped
    finally:
        meta.close()


def test_a_wal_that_the_os_refuses_is_a_wal_error(tmp_path):
    with pytest.raises(s3stream.WALError, match="cannot open or create the WAL"):
        StreamClient(5, "/proc/s3stream-test.wal", f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/m.db",
                     small_config())
