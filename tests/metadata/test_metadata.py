"""The MetadataStore implementations with a fake clock, every test body on SQLite (real files)
and PostgreSQL (a throwaway server, one database per test): nodes, streams, commits (fencing,
contiguity, retries, compaction), reads, the object lifecycle, KV, several threads and processes,
URLs. Tests about SQLite files and PostgreSQL servers as such run on their own backend only."""
from __future__ import annotations

import dataclasses
import os
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from s3stream.errors import (ConfigError, KVConflictError, MetadataBusyError, MetadataError, StreamFencedError,
                             StreamNotClosedError, StreamNotFoundError)
from s3stream.metadata import (CommitRange, CommitRequest, CommitSSO, CommitStreamObject,
                               ObjectState, ObjectType, Range, SqliteMetadataStore, StreamRange,
                               StreamState, commit_key, object_key, open_metadata, tailing_key)

SECOND = 1_000_000_000
TTL = 60 * SECOND
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeClock:
    def __init__(self, now: int = 1_000 * SECOND) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now

    def advance(self, ns: int) -> None:
        self.now += ns


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def db_path(tmp_path):
    return str(tmp_path / "meta.db")


@pytest.fixture
def meta_url(metadata_url):
    """The URL of a fresh metadata database: an SQLite file, or a PostgreSQL database (conftest)."""
    return metadata_url


@pytest.fixture
def open_same(open_same_metadata):
    """Open another store on the test's database (open_metadata keywords); closed at the end."""
    return open_same_metadata


@pytest.fixture
def store(open_same, clock):
    return open_same(clock=clock)


def count_rows(store, table):
    """Rows of `table` in the store's database, read behind the store's back."""
    if isinstance(store, SqliteMetadataStore):
        return store._conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    import psycopg
    with psycopg.connect(store.url) as conn:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def snapshot(store):
    """Everything the store holds, to check that a failed operation changed nothing."""
    return (store.list_nodes(), store.list_streams(include_deleted=True), store.list_objects())


def rng(stream, start, end, epoch=0):
    return CommitRange(stream.stream_id if hasattr(stream, "stream_id") else stream, epoch,
                       start, end)


def upload(store, node, sso_ranges=(), sos=(), compacted=(), size=100):
    """Prepare and build a commit request: an SSO with `sso_ranges` (if any) plus one SO per
    range in `sos`."""
    count = (1 if sso_ranges else 0) + len(sos)
    ids = store.prepare_objects(count, TTL) if count else []
    sso = CommitSSO(ids.pop(0), size, tuple(sso_ranges)) if sso_ranges else None
    stream_objects = tuple(CommitStreamObject(object_id, size, r) for object_id, r in zip(ids, sos))
    return CommitRequest(node.node_id, node.node_epoch, sso=sso, stream_objects=stream_objects,
                         compacted_ids=tuple(compacted))


def refs(store, stream_id, start=0, end=1 << 62, limit=64):
    return [(r.object_id, r.type, r.start_offset, r.end_offset)
            for r in store.get_object_refs(stream_id, start, end, limit)]


# ---- file, schema, configuration ---------------------------------------------------------------

def test_schema_pragmas_and_reopen(db_path, clock):
    s = SqliteMetadataStore(db_path, clock=clock)
    node = s.register_node(1, "/wal/1")
    s.put_kv("k", b"v")
    assert s._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    s.close()
    s.close()  # idempotent
    with pytest.raises(MetadataError, match="closed"):
        s.get_kv("k")
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("SELECT value FROM schema_info WHERE name = 'schema_version'"
                       ).fetchone()[0] == 2
    raw.close()
    s = SqliteMetadataStore(db_path, clock=clock)  # reopening is idempotent
    assert s.get_node(1) == node and s.get_kv("k") == b"v"
    s.close()


def test_newer_schema_version_is_refused(db_path):
    SqliteMetadataStore(db_path).close()
    raw = sqlite3.connect(db_path)
    with raw:
        raw.execute("UPDATE schema_info SET value = 99 WHERE name = 'schema_version'")
    raw.close()
    with pytest.raises(ConfigError, match="schema version 99"):
        SqliteMetadataStore(db_path)


def test_foreign_or_corrupt_file_is_refused(tmp_path):
    other = str(tmp_path / "other.db")
    raw = sqlite3.connect(other)
    raw.execute("CREATE TABLE t (x)")
    raw.commit()
    raw.close()
    with pytest.raises(ConfigError, match="something else"):
        SqliteMetadataStore(other)
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ConfigError, match="garbage.db"):
        SqliteMetadataStore(str(garbage))


def test_unusable_paths_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="is a directory") as e:
        SqliteMetadataStore(str(tmp_path))
    assert str(tmp_path) in str(e.value)
    missing = str(tmp_path / "no" / "such" / "dir" / "m.db")
    with pytest.raises(ConfigError, match="cannot open") as e:
        SqliteMetadataStore(missing)
    assert missing in str(e.value)
    with pytest.raises(ConfigError):
        SqliteMetadataStore(":memory:")


@pytest.mark.parametrize("url", ["sqlite:///data/meta.db", "data/meta.db"])
def test_a_missing_directory_is_named_with_the_url_forms(url, tmp_path, monkeypatch):
    """`sqlite:///data/meta.db` written for /data/meta.db is relative: the error names the path it
    became, its missing directory, and the four-slash form; nothing is created."""
    monkeypatch.chdir(tmp_path)
    for create in (True, False):
        with pytest.raises(ConfigError) as e:
            open_metadata(url, create=create)
        message = str(e.value)
        assert f"'data/meta.db' ({tmp_path}/data/meta.db, relative to the working directory)" in message
        assert f"its directory {tmp_path}/data does not exist" in message
        assert "sqlite:////absolute/path/meta.db" in message and "sqlite:///relative.db" in message
    assert os.listdir(tmp_path) == []


def test_two_slashes_name_no_file_and_say_how_many(tmp_path):
    with pytest.raises(ConfigError) as e:
        open_metadata(f"sqlite:/{tmp_path}/meta.db")               # sqlite://tmp/...: two slashes
    assert "three slashes" in str(e.value) and "sqlite:////absolute/path.db" in str(e.value)
    assert not (tmp_path / "meta.db").exists()


def test_create_false_refuses_a_missing_file_and_opens_an_existing_one(tmp_path):
    path = tmp_path / "meta.db"
    with pytest.raises(ConfigError, match="no metadata database at .*the file does not exist") as e:
        open_metadata(f"sqlite:///{path}", create=False)
    assert str(path) in str(e.value) and "sqlite:////absolute/path/meta.db" in str(e.value)
    assert not path.exists()
    open_metadata(f"sqlite:///{path}").close()
    open_metadata(f"sqlite:///{path}", create=False).close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to any directory")
def test_an_unwritable_directory_is_named(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=f"its directory {locked} is not writable"):
        open_metadata(f"sqlite:///{locked}/meta.db")


def test_open_metadata_urls(tmp_path, monkeypatch, clock):
    absolute = str(tmp_path / "abs.db")
    s = open_metadata("sqlite:///" + absolute, clock=clock)  # sqlite:////tmp/... (4 slashes)
    assert isinstance(s, SqliteMetadataStore) and s.path == absolute
    assert s.register_node(1, "w").heartbeat_ns == clock.now
    s.close()
    monkeypatch.chdir(tmp_path)
    s = open_metadata("sqlite:///rel.db")
    assert s.path == "rel.db" and (tmp_path / "rel.db").exists()
    s.close()
    s = open_metadata(str(tmp_path / "plain.db"))
    assert s.path == str(tmp_path / "plain.db")
    s.close()
    for bad in ("mysql://host/db", "metadata.txt", "sqlite://", "sqlite:///", "sqlite://host/x.db"):
        with pytest.raises(ConfigError, match="sqlite:///"):
            open_metadata(bad)


# ---- nodes -------------------------------------------------------------------------------------

def test_nodes_register_fence_heartbeat(store, clock):
    a = store.register_node(1, "/wal/a")
    assert (a.node_epoch, a.failover, a.wal_path, a.heartbeat_ns) == (0, False, "/wal/a", clock.now)
    fenced = store.fence_node(1)
    assert (fenced.node_epoch, fenced.failover) == (1, True)
    with pytest.raises(StreamFencedError, match=r"node 1 epoch 0 is fenced \(current 1\)"):
        store.heartbeat(1, 0)
    clock.advance(SECOND)
    again = store.register_node(1, "/wal/b")
    assert (again.node_epoch, again.failover, again.wal_path) == (2, False, "/wal/b")
    clock.advance(SECOND)
    store.heartbeat(1, 2)
    assert store.get_node(1).heartbeat_ns == clock.now
    store.register_node(7, "/wal/7")
    assert [n.node_id for n in store.list_nodes()] == [1, 7]
    with pytest.raises(MetadataError, match="node 3 is not registered"):
        store.get_node(3)
    with pytest.raises(MetadataError):
        store.fence_node(3)


# ---- streams -----------------------------------------------------------------------------------

def test_create_open_close_reopen_epochs_and_ranges(store):
    n1 = store.register_node(1, "w1")
    n2 = store.register_node(2, "w2")
    s = store.create_stream(1, n1.node_epoch)
    assert (s.epoch, s.state, s.owner_node_id, s.start_offset, s.end_offset) == (
        0, StreamState.OPENED, 1, 0, 0)
    assert s.ranges == (Range(0, 1, 0, 0, 0),)
    # Same node reopens (a restart): allowed; the empty range is replaced, not appended.
    s = store.open_stream(s.stream_id, 1, n1.node_epoch)
    assert s.epoch == 1 and s.ranges == (Range(0, 1, 1, 0, 0),)
    store.commit(upload(store, n1, [rng(s, 0, 10, epoch=1)]))
    assert store.get_stream(s.stream_id).ranges == (Range(0, 1, 1, 0, 10),)
    s = store.close_stream(s.stream_id, 1, 1)
    assert (s.state, s.owner_node_id) == (StreamState.CLOSED, None)
    assert store.close_stream(s.stream_id, 1, 1) == s  # closing again at that epoch: no-op
    s = store.open_stream(s.stream_id, 2, n2.node_epoch)
    assert (s.epoch, s.state, s.owner_node_id) == (2, StreamState.OPENED, 2)
    assert s.ranges == (Range(0, 1, 1, 0, 10), Range(1, 2, 2, 10, 10))
    s = store.open_stream(s.stream_id, 2, n2.node_epoch)
    assert s.epoch == 3 and s.ranges == (Range(0, 1, 1, 0, 10), Range(1, 2, 3, 10, 10))
    store.commit(upload(store, n2, [rng(s, 10, 15, epoch=3)]))
    s = store.open_stream(s.stream_id, 2, n2.node_epoch)
    assert s.ranges[-1] == Range(2, 2, 4, 15, 15) and s.end_offset == 15
    assert [x.stream_id for x in store.list_streams()] == [s.stream_id]


def test_create_streams_makes_many_in_one_call_as_create_stream_would(store):
    """create_streams: `count` streams as create_stream makes them (OPENED on the node, epoch 0,
    one empty range, the reservation), ids ascending and new; what it returns is what is stored;
    a fenced node creates none; a count of 0 creates nothing."""
    n1 = store.register_node(1, "w1")
    first = store.create_stream(1, n1.node_epoch, 5)
    made = store.create_streams(600, 1, n1.node_epoch, 5)
    ids = [s.stream_id for s in made]
    assert len(ids) == 600 and ids == sorted(set(ids)) and first.stream_id not in ids
    assert all(dataclasses.replace(s, stream_id=first.stream_id) == first for s in made)
    assert store.get_streams(ids) == {s.stream_id: s for s in made}
    assert store.create_streams(0, 1, n1.node_epoch) == []
    assert len(store.list_streams()) == 601
    store.fence_node(1)
    before = snapshot(store)
    with pytest.raises(StreamFencedError):
        store.create_streams(3, 1, n1.node_epoch)
    assert snapshot(store) == before


def test_list_streams_with_their_last_range_only(store):
    """list_streams(last_range=True), what a restart and a failover read: each stream as it is,
    with its last range alone, however many owners it had; the others untouched."""
    n1 = store.register_node(1, "w1")
    store.register_node(2, "w2")
    a, b = store.create_stream(1, n1.node_epoch), store.create_stream(1, n1.node_epoch)
    for i in range(3):                         # a: closed and opened again, a range per open
        store.commit(upload(store, n1, [rng(a, 10 * i, 10 * i + 10, epoch=a.epoch)]))
        store.close_stream(a.stream_id, a.epoch, 1)
        a = store.open_stream(a.stream_id, 1, n1.node_epoch)
    assert len(a.ranges) == 4 and len(b.ranges) == 1
    whole = {m.stream_id: m for m in store.list_streams(owner_node_id=1)}
    last = {m.stream_id: m for m in store.list_streams(owner_node_id=1, last_range=True)}
    assert set(last) == set(whole) == {a.stream_id, b.stream_id}
    for sid, m in whole.items():
        assert last[sid] == dataclasses.replace(m, ranges=m.ranges[-1:])
    assert [m.ranges for m in store.list_streams(last_range=True)] == [(a.ranges[-1],), b.ranges]
    assert store.list_streams(owner_node_id=2, last_range=True) == []


def test_commit_closes_streams_in_the_same_transaction(store):
    """A partition's close: its tails' objects committed and its streams CLOSED at once; a
    retry is a no-op; a fenced close changes nothing, objects included."""
    n1 = store.register_node(1, "w1")
    n2 = store.register_node(2, "w2")
    a = store.create_stream(1, n1.node_epoch)
    b = store.create_stream(1, n1.node_epoch)
    c = store.create_stream(1, n1.node_epoch)
    request = upload(store, n1, sos=[rng(a, 0, 10)])
    request = CommitRequest(request.node_id, request.node_epoch, stream_objects=request.stream_objects,
                            closes=((a.stream_id, 0), (b.stream_id, 0)))
    result = store.commit(request)
    assert result.end_offsets[a.stream_id] == 10 and not result.already_committed
    for sid, end in ((a.stream_id, 10), (b.stream_id, 0)):
        m = store.get_stream(sid)
        assert (m.state, m.owner_node_id, m.end_offset) == (StreamState.CLOSED, None, end)
    assert store.get_stream(c.stream_id).state == StreamState.OPENED
    assert store.commit(request).already_committed          # a retry after a timeout
    assert store.get_stream(a.stream_id).state == StreamState.CLOSED
    # Closes alone (no tail to upload).
    store.commit(CommitRequest(1, n1.node_epoch, closes=((c.stream_id, 0),)))
    assert store.get_stream(c.stream_id).state == StreamState.CLOSED
    # Fenced: b moved to node 2; node 1's commit of a tail for it with its close changes nothing.
    store.open_stream(b.stream_id, 2, n2.node_epoch)
    stale = upload(store, n1, sos=[rng(b, 0, 5)])
    before = snapshot(store)
    with pytest.raises(StreamFencedError):
        store.commit(CommitRequest(1, n1.node_epoch, stream_objects=stale.stream_objects,
                                   closes=((b.stream_id, 0),)))
    with pytest.raises(StreamFencedError):
        store.commit(CommitRequest(1, n1.node_epoch, closes=((b.stream_id, 1),)))
    assert snapshot(store) == before
    with pytest.raises(MetadataError, match="closes a stream twice"):
        store.commit(CommitRequest(1, n1.node_epoch, closes=((a.stream_id, 0), (a.stream_id, 0))))


def test_a_commit_that_only_closes_reads_no_ranges(store):
    """A commit of closes alone (a failover closes 20,000 streams, 1,000 to a commit) checks
    each stream's state and epoch, not its ranges: no statement reads them (SQLite's statements
    are traced; PostgreSQL's commit shares the code that decides). A commit with ranges reads
    the last range of each of its streams, which its append check needs."""
    if not isinstance(store, SqliteMetadataStore):
        pytest.skip("statements are traced on SQLite's connection")
    n1 = store.register_node(1, "w1")
    a, b = store.create_stream(1, n1.node_epoch), store.create_stream(1, n1.node_epoch)
    statements: list[str] = []
    store._conn.set_trace_callback(statements.append)
    try:
        store.commit(upload(store, n1, sso_ranges=[rng(a, 0, 10)]))
        with_ranges = [s for s in statements if "FROM ranges" in s]
        statements.clear()
        store.commit(CommitRequest(1, n1.node_epoch, closes=((a.stream_id, 0), (b.stream_id, 0))))
        closing = [s for s in statements if "FROM ranges" in s]
    finally:
        store._conn.set_trace_callback(None)
    assert with_ranges and not closing
    assert [(m.state, m.end_offset) for m in (store.get_stream(a.stream_id), store.get_stream(b.stream_id))] == [
        (StreamState.CLOSED, 10), (StreamState.CLOSED, 0)]


def test_open_refused_while_another_node_holds_it(store):
    n1 = store.register_node(1, "w1")
    n2 = store.register_node(2, "w2")
    s = store.create_stream(1, n1.node_epoch)
    before = snapshot(store)
    with pytest.raises(StreamNotClosedError, match="open on node 1"):
        store.open_stream(s.stream_id, 2, n2.node_epoch)
    with pytest.raises(StreamFencedError):
        store.open_stream(s.stream_id, 1, n1.node_epoch + 1)
    with pytest.raises(StreamFencedError):
        store.close_stream(s.stream_id, 0, 2)  # not the owner
    with pytest.raises(StreamFencedError):
        store.close_stream(s.stream_id, 5, 1)  # not the epoch
    with pytest.raises(StreamNotFoundError):
        store.open_stream(999, 1, n1.node_epoch)
    with pytest.raises(StreamNotFoundError):
        store.get_stream(999)
    assert snapshot(store) == before


def test_fenced_node_can_no_longer_commit_or_open(store):
    n1 = store.register_node(1, "w1")
    s = store.create_stream(1, n1.node_epoch)
    store.close_stream(s.stream_id, 0, 1)
    request = upload(store, n1, [rng(s, 0, 10)])
    store.fence_node(1)
    before = snapshot(store)
    with pytest.raises(StreamFencedError, match=r"node 1 epoch 0 is fenced \(current 1\)"):
        store.commit(request)
    with pytest.raises(StreamFencedError):
        store.open_stream(s.stream_id, 1, n1.node_epoch)
    with pytest.raises(StreamFencedError):
        store.create_stream(1, n1.node_epoch)
    assert snapshot(store) == before
    assert store.get_object(request.sso.object_id).state == ObjectState.PREPARED


def test_trim_marks_stream_objects_below_start(store, clock):
    n1 = store.register_node(1, "w1")
    s = store.create_stream(1, n1.node_epoch)
    request = upload(store, n1, [rng(s, 0, 5)], sos=[rng(s, 5, 10), rng(s, 10, 20),
                                                     rng(s, 20, 30)])
    store.commit(request)
    so_ids = [so.object_id for so in request.stream_objects]
    with pytest.raises(StreamFencedError):
        store.trim_stream(s.stream_id, 1, 20)
    clock.advance(SECOND)
    t = store.trim_stream(s.stream_id, 0, 20)
    assert t.start_offset == 20 and t.end_offset == 30
    states = [store.get_object(i) for i in so_ids]
    assert [o.state for o in states] == [ObjectState.MARK_DESTROYED] * 2 + [ObjectState.COMMITTED]
    assert states[0].mark_destroyed_ns == clock.now
    assert states[0].ranges == (StreamRange(s.stream_id, 5, 10),)  # history kept
    # The SSO held nothing else: it went with its last live range. Lower trims are no-ops.
    assert store.get_object(request.sso.object_id).state == ObjectState.MARK_DESTROYED
    assert store.trim_stream(s.stream_id, 0, 15).start_offset == 20
    assert refs(store, s.stream_id) == [(so_ids[2], ObjectType.STREAM_OBJECT, 20, 30)]
    # No upper bound here: the engine checks trims against its confirm offset.
    assert store.trim_stream(s.stream_id, 0, 1000).start_offset == 1000


def test_stream_set_object_is_destroyed_with_its_last_live_range(store, clock):
    n1 = store.register_node(1, "w1")
    a, b, c = (store.create_stream(1, n1.node_epoch) for _ in range(3))
    first = upload(store, n1, [rng(a, 0, 10), rng(b, 0, 10), rng(c, 0, 10)])
    second = upload(store, n1, [rng(a, 10, 20), rng(b, 10, 20)])
    store.commit(first)
    store.commit(second)

    def state(request):
        return store.get_object(request.sso.object_id).state

    store.trim_stream(a.stream_id, 0, 20)           # a's ranges die in both; b and c hold them
    store.trim_stream(b.stream_id, 0, 5)            # cuts into b's first range: still live
    assert (state(first), state(second)) == (ObjectState.COMMITTED, ObjectState.COMMITTED)
    clock.advance(SECOND)
    store.trim_stream(b.stream_id, 0, 10)           # second still holds b's [10, 20)
    assert (state(first), state(second)) == (ObjectState.COMMITTED, ObjectState.COMMITTED)
    store.delete_stream(c.stream_id, 0)             # c's range was first's last live one
    assert (state(first), state(second)) == (ObjectState.MARK_DESTROYED, ObjectState.COMMITTED)
    assert store.get_object(first.sso.object_id).mark_destroyed_ns == clock.now
    store.trim_stream(b.stream_id, 0, 20)
    assert state(second) == ObjectState.MARK_DESTROYED
    assert [o.object_id for o in store.objects_to_delete(0)] == [first.sso.object_id, second.sso.object_id]
    # A retried commit of an object a trim destroyed meanwhile is recognised, not refused.
    assert store.commit(second).already_committed
    assert refs(store, b.stream_id) == []


def test_delete_stream(store):
    n1 = store.register_node(1, "w1")
    s = store.create_stream(1, n1.node_epoch)
    request = upload(store, n1, [rng(s, 0, 5)], sos=[rng(s, 5, 10)])
    store.commit(request)
    with pytest.raises(StreamFencedError):
        store.delete_stream(s.stream_id, 3)
    d = store.delete_stream(s.stream_id, 0)
    assert (d.state, d.owner_node_id) == (StreamState.DELETED, None)
    assert store.delete_stream(s.stream_id, 0) == d
    assert store.get_stream(s.stream_id).state == StreamState.DELETED
    assert store.list_streams() == [] and store.list_streams(include_deleted=True) == [d]
    so = store.get_object(request.stream_objects[0].object_id)
    assert so.state == ObjectState.MARK_DESTROYED
    for call in (lambda: store.open_stream(s.stream_id, 1, 0),
                 lambda: store.close_stream(s.stream_id, 0, 1),
                 lambda: store.trim_stream(s.stream_id, 0, 3)):
        with pytest.raises(StreamNotFoundError, match="deleted"):
            call()
    with pytest.raises(StreamNotFoundError):
        store.delete_stream(12345, 0)


# ---- commit ------------------------------------------------------------------------------------

def test_commit_sso_and_stream_objects(store, clock):
    n1 = store.register_node(1, "w1")
    a, b, c = (store.create_stream(1, n1.node_epoch) for _ in range(3))
    request = upload(store, n1, [rng(a, 0, 10), rng(b, 0, 20), rng(c, 0, 5)],
                     sos=[rng(a, 10, 15), rng(b, 20, 40)], size=1234)
    clock.advance(SECOND)
    result = store.commit(request)
    assert not result.already_committed
    assert result.end_offsets == {a.stream_id: 15, b.stream_id: 40, c.stream_id: 5}
    for stream, end in ((a, 15), (b, 40), (c, 5)):
        meta = store.get_stream(stream.stream_id)
        assert meta.end_offset == end and meta.ranges == (Range(0, 1, 0, 0, end),)
    sso = store.get_object(request.sso.object_id)
    assert (sso.state, sso.type, sso.size, sso.node_id, sso.order_id, sso.committed_ns) == (
        ObjectState.COMMITTED, ObjectType.STREAM_SET_OBJECT, 1234, 1, 1, clock.now)
    assert sso.key == object_key(sso.object_id)
    assert sso.ranges == (StreamRange(a.stream_id, 0, 10), StreamRange(b.stream_id, 0, 20),
                          StreamRange(c.stream_id, 0, 5))
    so = store.get_object(request.stream_objects[1].object_id)
    assert (so.type, so.state, so.node_id, so.order_id) == (
        ObjectType.STREAM_OBJECT, ObjectState.COMMITTED, None, None)
    assert so.ranges == (StreamRange(b.stream_id, 20, 40),)
    assert refs(store, a.stream_id) == [
        (sso.object_id, ObjectType.STREAM_SET_OBJECT, 0, 10),
        (request.stream_objects[0].object_id, ObjectType.STREAM_OBJECT, 10, 15)]
    # Two more uploads: the node's SSO list grows in commit order.
    store.commit(upload(store, n1, [rng(a, 15, 16)]))
    store.commit(upload(store, n1, [rng(c, 5, 6)]))
    assert [o.order_id for o in store.node_stream_set_objects(1)] == [1, 2, 3]
    assert store.node_stream_set_objects(2) == []
    assert len(store.list_objects(ObjectState.COMMITTED, ObjectType.STREAM_OBJECT)) == 2
    assert len(store.list_objects(node_id=1)) == 3


@pytest.mark.parametrize("case", ["gap", "overlap", "behind_end", "gap_inside_request",
                                  "overlap_inside_request", "empty_range", "one_bad_stream"])
def test_contiguity_violations_change_nothing(store, case):
    n1 = store.register_node(1, "w1")
    a, b = store.create_stream(1, n1.node_epoch), store.create_stream(1, n1.node_epoch)
    store.commit(upload(store, n1, [rng(a, 0, 10), rng(b, 0, 10)]))
    sso, sos = {
        "gap": ([rng(a, 12, 20)], []),
        "overlap": ([rng(a, 5, 20)], []),
        "behind_end": ([rng(a, 0, 10)], []),
        "gap_inside_request": ([rng(a, 10, 20)], [rng(a, 25, 30)]),
        "overlap_inside_request": ([rng(a, 10, 20)], [rng(a, 15, 30)]),
        "empty_range": ([rng(a, 10, 10)], []),
        "one_bad_stream": ([rng(a, 10, 20), rng(b, 11, 20)], [rng(a, 20, 30)]),
    }[case]
    request = upload(store, n1, sso, sos=sos)
    before = snapshot(store)
    with pytest.raises(MetadataError, match=r"\[\d+, \d+\)"):
        store.commit(request)
    assert snapshot(store) == before
    assert all(store.get_object(i).state == ObjectState.PREPARED for i in request.object_ids())
    assert store.get_stream(a.stream_id).end_offset == 10


def test_stale_stream_epoch_is_fenced(store):
    n1 = store.register_node(1, "w1")
    n2 = store.register_node(2, "w2")
    s = store.create_stream(1, n1.node_epoch)
    stale = upload(store, n1, [rng(s, 0, 10, epoch=0)])
    store.close_stream(s.stream_id, 0, 1)
    store.open_stream(s.stream_id, 2, n2.node_epoch)  # epoch 1 on node 2
    before = snapshot(store)
    fenced = rf"stream {s.stream_id} epoch 0.*epoch 1 on node 2"
    with pytest.raises(StreamFencedError, match=fenced):
        store.commit(stale)
    assert snapshot(store) == before
    # Node 2 committing with the epoch node 1 had is fenced too, as is a commit to a closed stream.
    with pytest.raises(StreamFencedError):
        store.commit(upload(store, n2, [rng(s, 0, 10, epoch=0)]))
    store.close_stream(s.stream_id, 1, 2)
    with pytest.raises(StreamFencedError, match="CLOSED"):
        store.commit(upload(store, n2, [rng(s, 0, 10, epoch=1)]))
    assert store.get_stream(s.stream_id).end_offset == 0


def test_commit_retry_is_idempotent(store, clock):
    n1 = store.register_node(1, "w1")
    a, b = store.create_stream(1, n1.node_epoch), store.create_stream(1, n1.node_epoch)
    request = upload(store, n1, [rng(a, 0, 10), rng(b, 0, 7)], sos=[rng(a, 10, 12)])
    first = store.commit(request)
    before = snapshot(store)
    clock.advance(TTL * 2)  # a retry after the objects' expiry is still a retry
    again = store.commit(request)
    assert again.already_committed and again.end_offsets == first.end_offsets
    assert snapshot(store) == before
    # Not a retry: same objects, different size or ranges.
    sso = request.sso
    for changed in (CommitSSO(sso.object_id, sso.size + 1, sso.ranges),
                    CommitSSO(sso.object_id, sso.size, (rng(a, 0, 10),))):
        with pytest.raises(MetadataError, match="not a retry"):
            store.commit(CommitRequest(1, n1.node_epoch, sso=changed,
                                       stream_objects=request.stream_objects))
    # A committed object next to a fresh one.
    [fresh] = store.prepare_objects(1, TTL)
    with pytest.raises(MetadataError, match="mixes"):
        store.commit(CommitRequest(1, n1.node_epoch, sso=sso, stream_objects=(
            CommitStreamObject(fresh, 5, rng(a, 12, 13)),)))
    assert store.get_object(fresh).state == ObjectState.PREPARED
    assert snapshot(store)[:2] == before[:2]


def test_expired_prepared_object_cannot_be_committed(store, clock):
    n1 = store.register_node(1, "w1")
    s = store.create_stream(1, n1.node_epoch)
    request = upload(store, n1, [rng(s, 0, 10)])
    clock.advance(TTL)
    before = snapshot(store)
    with pytest.raises(MetadataError, match="expired"):
        store.commit(request)
    assert snapshot(store) == before
    assert [o.object_id for o in store.objects_to_delete(0)] == [request.sso.object_id]


def test_unknown_objects_and_streams_are_refused(store):
    n1 = store.register_node(1, "w1")
    s = store.create_stream(1, n1.node_epoch)
    with pytest.raises(MetadataError, match="object 999"):
        store.commit(CommitRequest(1, 0, sso=CommitSSO(999, 1, (rng(s, 0, 1),))))
    with pytest.raises(MetadataError, match="stream 555"):
        store.commit(upload(store, n1, [rng(555, 0, 1)]))
    with pytest.raises(MetadataError, match="no objects"):
        store.commit(CommitRequest(1, 0))
    [x] = store.prepare_objects(1, TTL)
    with pytest.raises(MetadataError, match="twice"):
        store.commit(CommitRequest(1, 0, sso=CommitSSO(x, 1, (rng(s, 0, 1),)), stream_objects=(
            CommitStreamObject(x, 1, rng(s, 1, 2)),)))


def test_deleted_stream_ranges_are_ignored(store):
    n1 = store.register_node(1, "w1")
    a, b = store.create_stream(1, n1.node_epoch), store.create_stream(1, n1.node_epoch)
    request = upload(store, n1, [rng(a, 0, 10), rng(b, 0, 10)], sos=[rng(b, 10, 20)])
    store.delete_stream(b.stream_id, 0)
    result = store.commit(request)
    assert result.end_offsets == {a.stream_id: 10, b.stream_id: 0}
    assert store.get_stream(b.stream_id).end_offset == 0
    sso = store.get_object(request.sso.object_id)
    assert sso.state == ObjectState.COMMITTED and sso.ranges == (StreamRange(a.stream_id, 0, 10),)
    so = store.get_object(request.stream_objects[0].object_id)
    assert so.state == ObjectState.MARK_DESTROYED and so.ranges == ()
    assert refs(store, b.stream_id) == []
    assert store.commit(request).already_committed


# ---- compaction --------------------------------------------------------------------------------

def test_compaction_swaps_objects_atomically(store, open_same, clock):
    n1 = store.register_node(1, "w1")
    a, b = store.create_stream(1, n1.node_epoch), store.create_stream(1, n1.node_epoch)
    first = upload(store, n1, [rng(a, 0, 10), rng(b, 0, 5)])
    second = upload(store, n1, [rng(a, 10, 20)], sos=[rng(b, 5, 8)])
    store.commit(first)
    store.commit(second)
    old_ids = [first.sso.object_id, second.sso.object_id]

    # Refused compactions change nothing.
    before = snapshot(store)
    for bad, message in (([rng(a, 0, 15), rng(b, 0, 5)], "lose"),        # drops [15, 20)
                         ([rng(a, 0, 25), rng(b, 0, 5)], "not held"),    # invents [20, 25)
                         ([rng(a, 0, 20)], "lose"),                      # drops b [0, 5)
                         ([rng(a, 0, 12), rng(a, 10, 20), rng(b, 0, 5)], "overlap")):
        with pytest.raises(MetadataError, match=message):
            store.commit(upload(store, n1, bad, compacted=old_ids))
    after_refusals = snapshot(store)
    assert after_refusals[:2] == before[:2]
    assert [o for o in after_refusals[2] if o.state != ObjectState.PREPARED] == [
        o for o in before[2] if o.state != ObjectState.PREPARED]

    # A reader on its own connection sees the old objects or the new one, never a mix.
    reader = open_same(clock=clock)
    stop, seen, failures = threading.Event(), set(), []

    def read_loop():
        while not stop.is_set():
            got = reader.get_object_refs(a.stream_id, 0, 20)
            offsets = [(r.start_offset, r.end_offset) for r in got]
            seen.add(tuple(r.object_id for r in got))
            if offsets not in ([(0, 10), (10, 20)], [(0, 20)]):
                failures.append(offsets)

    thread = threading.Thread(target=read_loop)
    thread.start()
    try:
        compaction = upload(store, n1, [rng(a, 0, 20), rng(b, 0, 5)], compacted=old_ids)
        clock.advance(SECOND)
        result = store.commit(compaction)
        time.sleep(0.05)
    finally:
        stop.set()
        thread.join()
        reader.close()
    assert failures == [] and len(seen) >= 1
    new_id = compaction.sso.object_id
    assert result.end_offsets == {a.stream_id: 20, b.stream_id: 8}  # ends do not move
    assert refs(store, a.stream_id) == [(new_id, ObjectType.STREAM_SET_OBJECT, 0, 20)]
    assert refs(store, b.stream_id) == [(new_id, ObjectType.STREAM_SET_OBJECT, 0, 5),
                                        (second.stream_objects[0].object_id,
                                         ObjectType.STREAM_OBJECT, 5, 8)]
    for object_id in old_ids:
        old = store.get_object(object_id)
        assert old.state == ObjectState.MARK_DESTROYED and old.mark_destroyed_ns == clock.now
    assert [(o.object_id, o.order_id) for o in store.node_stream_set_objects(1)] == [(new_id, 3)]
    # A compaction of objects that are gone already is refused; its retry is recognised.
    assert store.commit(compaction).already_committed
    with pytest.raises(MetadataError, match="not COMMITTED"):
        store.commit(upload(store, n1, [rng(a, 0, 20), rng(b, 0, 5)], compacted=old_ids))


def test_compaction_may_drop_trimmed_and_deleted_data(store):
    n1 = store.register_node(1, "w1")
    a, b = store.create_stream(1, n1.node_epoch), store.create_stream(1, n1.node_epoch)
    old = upload(store, n1, [rng(a, 0, 10), rng(b, 0, 10)])
    store.commit(old)
    store.commit(upload(store, n1, [rng(a, 10, 20)]))
    store.trim_stream(a.stream_id, 0, 5)
    store.delete_stream(b.stream_id, 0)
    compaction = upload(store, n1, [], sos=[rng(a, 5, 10)], compacted=[old.sso.object_id])
    store.commit(compaction)
    assert [r[2:] for r in refs(store, a.stream_id)] == [(5, 10), (10, 20)]
    # Everything of the object was dead from its commit on (a trim with no upper bound came
    # first; a trim destroys only what it kills): a compaction with no new object drops it.
    store.trim_stream(a.stream_id, 0, 30)
    third = upload(store, n1, [rng(a, 20, 30)])
    store.commit(third)
    assert store.get_object(third.sso.object_id).state == ObjectState.COMMITTED
    store.commit(CommitRequest(1, n1.node_epoch, compacted_ids=(third.sso.object_id,)))
    assert store.get_object(third.sso.object_id).state == ObjectState.MARK_DESTROYED


# ---- reads -------------------------------------------------------------------------------------

def test_get_object_refs_order_overlap_and_limit(store):
    n1 = store.register_node(1, "w1")
    a, other = store.create_stream(1, n1.node_epoch), store.create_stream(1, n1.node_epoch)
    ids = []
    for start in range(0, 80, 20):
        request = upload(store, n1, [rng(a, start, start + 10), rng(other, start, start + 20)],
                         sos=[rng(a, start + 10, start + 20)])
        store.commit(request)
        ids += [request.sso.object_id, request.stream_objects[0].object_id]
    spans = [(r[2], r[3]) for r in refs(store, a.stream_id)]
    assert spans == [(x, x + 10) for x in range(0, 80, 10)]
    assert [r[0] for r in refs(store, a.stream_id)] == ids
    assert [r[2:] for r in refs(store, a.stream_id, 15, 35)] == [(10, 20), (20, 30), (30, 40)]
    assert [r[2:] for r in refs(store, a.stream_id, 10, 20)] == [(10, 20)]
    assert [r[2:] for r in refs(store, a.stream_id, 9, 10)] == [(0, 10)]
    assert [r[2:] for r in refs(store, a.stream_id, 5, 80, limit=3)] == [(0, 10), (10, 20),
                                                                         (20, 30)]
    assert refs(store, a.stream_id, 80, 100) == [] and refs(store, a.stream_id, 5, 5) == []
    assert refs(store, a.stream_id, 0, 80, limit=0) == []
    ref = store.get_object_refs(a.stream_id, 0, 1)[0]
    assert (ref.key, ref.size, ref.stream_id) == (object_key(ids[0]), 100, a.stream_id)


def test_get_object_refs_at_finds_the_object_of_each_point_in_one_read(store):
    n1 = store.register_node(1, "w1")
    a, other = store.create_stream(1, n1.node_epoch), store.create_stream(1, n1.node_epoch)
    for start in range(0, 40, 20):
        store.commit(upload(store, n1, [rng(a, start, start + 10), rng(other, start, start + 20)],
                            sos=[rng(a, start + 10, start + 20)]))
    points = [(a.stream_id, p) for p in (0, 9, 10, 19, 25, 39, 40)] + [(other.stream_id, 5), (other.stream_id, 5),
                                                                       (other.stream_id, 33), (999, 0)]
    got = store.get_object_refs_at(points)
    # The same as get_object_refs of each point, with a ref's kind (StreamObject or SSO range).
    for sid, pos in set(points):
        one = store.get_object_refs(sid, pos, pos + 1, limit=1)
        assert got.get((sid, pos)) == (one[0] if one else None), (sid, pos)
    assert set(got) == set(points) - {(a.stream_id, 40), (999, 0)}
    assert got[(a.stream_id, 19)].type == ObjectType.STREAM_OBJECT
    assert got[(a.stream_id, 9)].type == ObjectType.STREAM_SET_OBJECT
    many = [(other.stream_id, p % 40) for p in range(1200)]           # more than one statement
    assert len(store.get_object_refs_at(many)) == 40
    assert store.get_object_refs_at([]) == {}


# ---- object lifecycle --------------------------------------------------------------------------

def test_prepare_objects_ids_and_keys(store, clock):
    ids = store.prepare_objects(3, TTL)
    assert ids == sorted(ids) and len(set(ids)) == 3
    o = store.get_object(ids[0])
    assert (o.state, o.size, o.type, o.key, o.prepared_ns, o.expire_ns) == (
        ObjectState.PREPARED, 0, None, object_key(ids[0]), clock.now, clock.now + TTL)
    clock.advance(TTL)
    assert store.remove_objects(ids) == ids
    assert store.prepare_objects(1, TTL)[0] > ids[-1]  # ids are never reused
    with pytest.raises(ValueError):
        store.prepare_objects(0, TTL)
    with pytest.raises(MetadataError, match="does not exist"):
        store.get_object(ids[0])


def test_objects_to_delete_and_remove(store, clock):
    n1 = store.register_node(1, "w1")
    s = store.create_stream(1, n1.node_epoch)
    committed = upload(store, n1, [rng(s, 0, 10)])
    store.commit(committed)
    destroyed = upload(store, n1, [rng(s, 10, 20)])
    store.commit(destroyed)
    [abandoned] = store.prepare_objects(1, 10 * SECOND)
    with pytest.raises(MetadataError, match="not committed"):
        store.mark_destroyed([abandoned])
    store.mark_destroyed([destroyed.sso.object_id])
    store.mark_destroyed([destroyed.sso.object_id])  # again: no-op
    assert refs(store, s.stream_id) == [(committed.sso.object_id, ObjectType.STREAM_SET_OBJECT,
                                         0, 10)]
    assert store.objects_to_delete(5 * SECOND) == []
    clock.advance(5 * SECOND)
    assert [o.object_id for o in store.objects_to_delete(5 * SECOND)] == [
        destroyed.sso.object_id]
    clock.advance(5 * SECOND)
    due = store.objects_to_delete(5 * SECOND)
    assert [o.object_id for o in due] == [destroyed.sso.object_id, abandoned]
    assert due[1].key == object_key(abandoned)
    everything = [committed.sso.object_id, destroyed.sso.object_id, abandoned, 424242]
    assert store.remove_objects(everything) == [destroyed.sso.object_id, abandoned]
    assert store.get_object(committed.sso.object_id).state == ObjectState.COMMITTED
    assert store.objects_to_delete(0) == []
    assert [o.object_id for o in store.list_objects()] == [committed.sso.object_id]
    assert count_rows(store, "sso_ranges") == 1


# ---- KV ----------------------------------------------------------------------------------------

def test_kv(store):
    assert store.get_kv("p") is None
    store.put_kv("p", b"1")
    store.put_kv("p", b"2")
    assert store.get_kv("p") == b"2"
    assert store.put_kv_if_absent("p", b"3") == b"2"
    assert store.put_kv_if_absent("q", b"\x00\xff") == b"\x00\xff"
    store.delete_kv("p")
    store.delete_kv("p")
    assert store.get_kv("p") is None and store.get_kv("q") == b"\x00\xff"


def test_get_kv_and_node_reads_both_or_names_the_unknown_node(store):
    node = store.register_node(3, "/wal3")
    assert store.get_kv_and_node("opened/p", 3) == (None, store.get_node(3))
    store.put_kv("opened/p", b"\x00{}")
    store.fence_node(3)
    value, got = store.get_kv_and_node("opened/p", 3)
    assert value == b"\x00{}" and got == store.get_node(3) and got.node_epoch == node.node_epoch + 1 and got.failover
    with pytest.raises(MetadataError, match="node 4 is not registered"):
        store.get_kv_and_node("opened/p", 4)


def test_put_kv_if_absent_has_one_winner(open_same):
    stores = [open_same() for _ in range(4)]
    results = []
    threads = [threading.Thread(target=lambda s=s, i=i: results.append(
        s.put_kv_if_absent("leader", str(i).encode()))) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 4


def test_get_streams_reads_the_ids_asked(store):
    from s3stream.metadata import base
    node = store.register_node(1, "w1")
    made = [store.create_stream(1, node.node_epoch) for _ in range(7)]
    store.delete_stream(made[2].stream_id, made[2].epoch)
    chunk, base.GET_STREAMS_CHUNK = base.GET_STREAMS_CHUNK, 3          # several reads
    try:
        got = store.get_streams([m.stream_id for m in made[1:]] + [made[1].stream_id, 10_000])
    finally:
        base.GET_STREAMS_CHUNK = chunk
    assert sorted(got) == [m.stream_id for m in made[1:]]               # the missing id is absent
    assert got[made[2].stream_id].state.value == "DELETED"
    assert got[made[3].stream_id] == store.get_stream(made[3].stream_id)
    assert store.get_streams([]) == {}


def test_replace_kv_compares_key_and_guard(store):
    assert store.replace_kv("k", None, b"1")                 # absent -> created
    assert not store.replace_kv("k", None, b"2")             # no longer absent
    assert not store.replace_kv("k", b"0", b"2")             # wrong expected value
    assert store.get_kv("k") == b"1"
    assert store.replace_kv("k", b"1", b"2") and store.get_kv("k") == b"2"
    store.put_kv("lease", b"epoch-1")
    assert not store.replace_kv("k", b"2", b"3", guard=("lease", b"epoch-0"))   # stale token
    assert not store.replace_kv("k", b"2", b"3", guard=("nolease", b"epoch-1"))  # guard absent
    assert store.get_kv("k") == b"2"
    assert store.replace_kv("k", b"2", b"3", guard=("lease", b"epoch-1")) and store.get_kv("k") == b"3"
    assert not store.replace_kv("new", None, b"1", guard=("lease", b"epoch-0"))    # create, stale token
    assert store.get_kv("new") is None
    assert store.replace_kv("new", None, b"1", guard=("lease", b"epoch-1")) and store.get_kv("new") == b"1"
    assert not store.replace_kv("gone", b"1", b"2") and store.get_kv("gone") is None  # absent, expected a value


def test_replace_kv_has_one_winner_per_value(open_same):
    """Four stores race to advance a counter by compare-and-set: every increment is counted once."""
    stores = [open_same() for _ in range(4)]
    stores[0].put_kv("n", b"0")
    wins = []

    def bump(s):
        done = 0
        while done < 10:
            current = s.get_kv("n")
            if s.replace_kv("n", current, str(int(current) + 1).encode()):
                done += 1
        wins.append(done)

    threads = [threading.Thread(target=bump, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins == [10] * 4 and stores[0].get_kv("n") == b"40"


# ---- concurrency -------------------------------------------------------------------------------

def test_threads_share_one_store(store):
    node = store.register_node(1, "w1")
    errors = []

    def work():
        try:
            s = store.create_stream(1, node.node_epoch)
            for i in range(20):
                store.commit(upload(store, node, [rng(s, i, i + 1)]))
                store.get_object_refs(s.stream_id, 0, i + 1)
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [o.order_id for o in store.node_stream_set_objects(1)] == list(range(1, 81))
    assert all(s.end_offset == 20 for s in store.list_streams())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_opens_its_own_connection(store):
    node = store.register_node(1, "w1")
    s = store.create_stream(1, node.node_epoch)
    store.commit(upload(store, node, [rng(s, 0, 10)]))
    pid = os.fork()
    if pid == 0:  # the child uses the inherited store object, then leaves without cleanup
        try:
            store.commit(upload(store, node, [rng(s, 10, 20)]))
            code = 0 if store.get_stream(s.stream_id).end_offset == 20 else 1
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    store.commit(upload(store, node, [rng(s, 20, 30)]))  # the parent's connection still works
    assert store.get_stream(s.stream_id).end_offset == 30


WORKER = textwrap.dedent("""
    import os, sys, time
    from s3stream.metadata import (CommitRange, CommitRequest, CommitSSO, CommitStreamObject,
                                   open_metadata)

    url, node_id, uploads, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    store = open_metadata(url)
    node = store.register_node(node_id, f"/wal/{node_id}")
    streams = [store.create_stream(node_id, node.node_epoch).stream_id for _ in range(3)]
    open(f"{go}.ready{node_id}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.001)
    ends = dict.fromkeys(streams, 0)
    for i in range(uploads):
        sso_id, so_id = store.prepare_objects(2, 60 * 10**9)
        ranges = tuple(CommitRange(s, 0, ends[s], ends[s] + 10) for s in streams)
        first = streams[0]
        so = CommitStreamObject(so_id, 10, CommitRange(first, 0, ends[first] + 10,
                                                       ends[first] + 15))
        result = store.commit(CommitRequest(node_id, node.node_epoch,
                                            sso=CommitSSO(sso_id, 100, ranges),
                                            stream_objects=(so,)))
        ends = {s: e + 10 for s, e in ends.items()}
        ends[first] += 5
        assert result.end_offsets == ends, (result, ends)
    store.close()
    print(" ".join(map(str, streams)))
""")


def test_two_processes_commit_to_one_database(tmp_path, meta_url, open_same):
    go = str(tmp_path / "go")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, meta_url, str(node_id), "50", go],
                                cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
               for node_id in (1, 2)]
    deadline = time.monotonic() + 30
    def fail(why):
        for w in workers:       # a worker still waiting for `go` must not keep us waiting
            w.kill()
        pytest.fail(f"{why}: {[w.communicate() for w in workers]}")

    while not all(os.path.exists(f"{go}.ready{n}") for n in (1, 2)):
        if not all(w.poll() is None for w in workers):
            fail("a worker exited before starting")
        if time.monotonic() > deadline:
            fail("workers did not get ready")
        time.sleep(0.01)
    open(go, "w").close()
    outputs = [w.communicate(timeout=60) for w in workers]
    for worker, (out, err) in zip(workers, outputs):
        assert worker.returncode == 0 and "locked" not in err, err
    store = open_same()
    assert len(store.list_objects(ObjectState.COMMITTED)) == 200
    for node_id, (out, _) in zip((1, 2), outputs):
        ssos = store.node_stream_set_objects(node_id)
        assert [o.order_id for o in ssos] == list(range(1, 51))
        streams = [int(x) for x in out.split()]
        assert [store.get_stream(s).end_offset for s in streams] == [750, 500, 500]
        spans = [(r.start_offset, r.end_offset)
                 for r in store.get_object_refs(streams[0], 0, 750, limit=1000)]
        assert len(spans) == 100 and spans[0][0] == 0 and spans[-1][1] == 750
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))


def test_list_kv_by_prefix(store):
    m = store
    for k in ("assignment/a", "assignment/b", "assignmentx", "opened/a", "assignment/\u00e9"):
        m.put_kv(k, k.encode())
    assert list(m.list_kv("assignment/")) == ["assignment/a", "assignment/b", "assignment/\u00e9"]
    assert m.list_kv("assignment/")["assignment/b"] == b"assignment/b"
    assert m.list_kv("nothing/") == {}


def test_get_kvs_and_put_kvs_read_and_write_many_keys_at_once(store, open_same):
    """get_kvs returns the keys that exist (any number, more than one statement's worth); put_kvs
    writes all its items in one transaction, the last value of a key given twice, and notifies
    every key's feed (issue 53: an agent's batch of opens)."""
    feed = open_same().kv_changes(("opened/",))
    try:
        items = [(f"opened/p{i:04d}", b"%d" % i) for i in range(1200)]
        store.put_kvs(items + [("opened/p0001", b"last")])
        store.put_kvs([])
        assert feed.wait(5)
        keys = [k for k, _ in items] + ["opened/none", "opened/p0002"]
        found = store.get_kvs(keys)
        assert len(found) == 1200 and found["opened/p0001"] == b"last" and found["opened/p1199"] == b"1199"
        assert "opened/none" not in found and store.get_kvs([]) == {}
        assert store.list_kv("opened/") == found
    finally:
        feed.close()


def test_replace_kvs_writes_each_item_that_holds_what_it_expects(store, open_same):
    """replace_kvs compares each key as replace_kv does, in one transaction: the items that hold
    their expected value (None: absent) are written and reported True, the others left as they
    are; the written keys are pushed to the feeds."""
    store.put_kv("assignment/a", b"a1")
    store.put_kv("assignment/b", b"b1")
    feed = open_same().kv_changes(("assignment/",))
    try:
        done = store.replace_kvs([("assignment/a", b"a1", b"a2"), ("assignment/b", b"stale", b"b2"),
                                  ("assignment/c", None, b"c1"), ("assignment/a2", b"x", b"y")])
        assert done == [True, False, True, False]
        assert store.list_kv("assignment/") == {"assignment/a": b"a2", "assignment/b": b"b1", "assignment/c": b"c1"}
        assert feed.wait(5)
        assert store.replace_kvs([("assignment/c", None, b"c2")]) == [False] and store.replace_kvs([]) == []
        # A key given twice: in turn, the second sees the first's write.
        assert store.replace_kvs([("assignment/d", None, b"d1"), ("assignment/d", b"d1", b"d2"),
                                  ("assignment/c", b"c1", b"c3")]) == [True, True, True]
        assert store.get_kv("assignment/d") == b"d2" and store.get_kv("assignment/c") == b"c3"
        many = [(f"assignment/m{i}", None, b"m") for i in range(1200)]     # set-based where it can be
        assert store.replace_kvs(many) == [True] * 1200
        assert store.replace_kvs([(k, b"m", b"n") for k, _, _ in many[:600]] + [(k, b"x", b"n") for k, _, _ in many[600:]]) \
            == [True] * 600 + [False] * 600
    finally:
        feed.close()


def test_racing_commits_keep_streams_contiguous(open_same):
    """Several stores (connections) commit to the same two streams at once, each from the end
    offset it last read: exactly the commits that continue the end win, so each stream's end is
    the sum of its committed ranges, which tile it without gaps, and no id is handed out twice."""
    import random
    setup = open_same()
    node = setup.register_node(1, "w1")
    streams = [setup.create_stream(1, node.node_epoch).stream_id for _ in range(2)]
    committed, errors, lock = [], [], threading.Lock()

    def work(seed):
        s, rnd = open_same(), random.Random(seed)
        try:
            for _ in range(15):
                ends = {x: s.get_stream(x).end_offset for x in streams}
                chosen = [x for x in streams if rnd.random() < 0.7] or streams[:1]
                ranges = tuple(CommitRange(x, 0, ends[x], ends[x] + rnd.randint(1, 5)) for x in chosen)
                [object_id] = s.prepare_objects(1, TTL)
                try:
                    s.commit(CommitRequest(1, node.node_epoch, sso=CommitSSO(object_id, 1, ranges)))
                except MetadataError as e:
                    if "contiguous" not in str(e):
                        raise
                    continue
                with lock:
                    committed.append((object_id, ranges))
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and committed
    ids = [object_id for object_id, _ in committed]
    assert len(set(ids)) == len(ids)
    ssos = setup.node_stream_set_objects(1)
    assert sorted(o.object_id for o in ssos) == sorted(ids)
    assert [o.order_id for o in ssos] == list(range(1, len(ids) + 1))
    for x in streams:
        spans = sorted((r.start_offset, r.end_offset) for _, ranges in committed for r in ranges
                       if r.stream_id == x)
        end = setup.get_stream(x).end_offset
        assert end == sum(e - s for s, e in spans)
        assert [s for s, _ in spans] == [0] + [e for _, e in spans[:-1]]
        assert [(r.start_offset, r.end_offset) for r in setup.get_object_refs(x, 0, end, limit=1000)] == spans


# ---- PostgreSQL --------------------------------------------------------------------------------

def pg_execute(url, *statements):
    import psycopg
    results = []
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in statements:
            cursor = conn.execute(statement)
            results.append(cursor.fetchall() if cursor.description else None)
    return results


def test_postgres_schema_types_and_reopen(pg_url, clock):
    from s3stream.metadata import PostgresMetadataStore
    s = PostgresMetadataStore(pg_url, clock=clock)
    node = s.register_node(1, "/wal/1")
    s.put_kv("k", b"v")
    s.close()
    s.close()  # idempotent
    with pytest.raises(MetadataError, match="closed"):
        s.get_kv("k")
    [version, types] = pg_execute(
        pg_url, "SELECT value FROM schema_info WHERE name = 'schema_version'",
        "SELECT DISTINCT data_type FROM information_schema.columns WHERE table_schema = current_schema()")
    assert version == [(2,)]
    assert {t for (t,) in types} == {"bigint", "text", "bytea", "boolean"}
    s = PostgresMetadataStore(pg_url, clock=clock)  # reopening is idempotent
    assert s.get_node(1) == node and s.get_kv("k") == b"v"
    s.close()


def test_postgres_processes_starting_at_once_create_the_schema_once(pg_url):
    from s3stream.metadata import PostgresMetadataStore
    stores, errors = [], []

    def start():
        try:
            stores.append(PostgresMetadataStore(pg_url, pool_min=0))
        except Exception as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(stores) == 6
    stores[0].put_kv("k", b"v")
    assert all(s.get_kv("k") == b"v" for s in stores)
    for s in stores:
        s.close()


def test_postgres_foreign_database_is_refused(pg_url):
    from s3stream.metadata import PostgresMetadataStore
    pg_execute(pg_url, "CREATE TABLE orders (id int)")
    with pytest.raises(ConfigError, match="something else") as e:
        PostgresMetadataStore(pg_url)
    assert pg_url in str(e.value) and "CREATE DATABASE" in str(e.value)
    assert pg_execute(pg_url, "SELECT to_regclass('streams') IS NULL") == [[(True,)]]  # nothing created


def test_postgres_newer_schema_version_is_refused(pg_url):
    from s3stream.metadata import PostgresMetadataStore
    PostgresMetadataStore(pg_url).close()
    pg_execute(pg_url, "UPDATE schema_info SET value = 99 WHERE name = 'schema_version'")
    with pytest.raises(ConfigError, match="schema version 99") as e:
        PostgresMetadataStore(pg_url)
    assert pg_url in str(e.value)


def test_open_metadata_postgres_urls(pg_url, clock):
    from s3stream.metadata import PostgresMetadataStore
    for scheme in ("postgresql://", "postgres://"):
        s = open_metadata(scheme + pg_url.split("://", 1)[1], clock=clock, pool_max=2)
        assert isinstance(s, PostgresMetadataStore)
        assert s.register_node(1, "w").heartbeat_ns == clock.now
        s.close()


def test_postgres_unreachable_url_is_a_config_error_without_the_password():
    from testservers.postgres import free_port
    port = free_port()   # nothing listens there
    for url in (f"postgresql://meta_user:s3cret-pw@127.0.0.1:{port}/meta",
                f"postgresql://127.0.0.1:{port}/meta?user=meta_user&password=s3cret-pw"):
        started = time.monotonic()
        with pytest.raises(ConfigError, match="cannot connect") as e:
            open_metadata(url, connect_timeout_s=2)
        message = str(e.value)
        assert "s3cret-pw" not in message and f"127.0.0.1:{port}" in message and "running" in message
        assert time.monotonic() - started < 10


def test_postgres_is_imported_only_when_used(tmp_path):
    """SQLite users never import psycopg; without it, a PostgreSQL URL says what to install."""
    script = textwrap.dedent(f"""
        import sys
        from s3stream.errors import ConfigError
        from s3stream.metadata import open_metadata
        open_metadata({str(tmp_path / "m.db")!r}).close()
        assert "psycopg" not in sys.modules and "psycopg_pool" not in sys.modules
        sys.modules["psycopg"] = None     # as if it were not installed
        try:
            open_metadata("postgresql://127.0.0.1/meta")
        except ConfigError as e:
            assert 'pip install "psycopg[binary]" psycopg-pool' in str(e), e
        else:
            raise AssertionError("no ConfigError")
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def _wait_for_lock_waiter(pg_url, deadline_s=10.0):
    """The pid of the backend of pg_url's database waiting for a row lock."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        [rows] = pg_execute(pg_url, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                    "AND wait_event_type = 'Lock'")
        if rows:
            return rows[0][0]
        time.sleep(0.01)
    pytest.fail("no backend started waiting for the lock")


def test_postgres_idle_connections_the_server_ended_are_replaced_without_an_error(pg_url, clock):
    """Pooled connections the server closed while they sat idle are found (a failed BEGIN, a
    one-statement read that failed on a closed connection, a socket with the server's last
    message before a write is sent) and replaced: every operation, read or write, succeeds at
    once."""
    from s3stream.metadata import PostgresMetadataStore
    s = PostgresMetadataStore(pg_url, clock=clock, pool_min=3, pool_max=3)

    def end_every_session() -> None:
        pids = pg_execute(pg_url, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                  "AND pid <> pg_backend_pid()")[0]
        assert pids
        pg_execute(pg_url, *[f"SELECT pg_terminate_backend({pid})" for (pid,) in pids])
        deadline = time.monotonic() + 10
        while pg_execute(pg_url, f"SELECT count(*) FROM pg_stat_activity WHERE pid IN "
                                 f"({', '.join(str(pid) for (pid,) in pids)})")[0][0][0]:
            assert time.monotonic() < deadline, "the terminated backends did not exit"
            time.sleep(0.01)

    try:
        node = s.register_node(1, "w1")
        s.put_kv("k", b"v0")
        # More of each than the pool holds: every connection was ended.
        end_every_session()
        for _ in range(4):
            assert s.get_kv("k") == b"v0"
        end_every_session()
        for i in range(4):
            s.heartbeat(1, node.node_epoch)
            s.put_kv("k", b"v%d" % (i + 1))
        end_every_session()
        streams = [s.create_stream(1, node.node_epoch) for _ in range(4)]      # transactions
        assert len({m.stream_id for m in streams}) == 4
        assert s.get_kv("k") == b"v4"
        assert s.get_node(1).node_epoch == node.node_epoch
    finally:
        s.close()


def test_postgres_lost_connections_become_busy_errors_then_recover(pg_url, clock):
    import psycopg
    from s3stream.metadata import PostgresMetadataStore
    s = PostgresMetadataStore(pg_url, clock=clock, pool_min=2, pool_max=2)
    node = s.register_node(1, "w1")
    stream = s.create_stream(1, node.node_epoch)

    # Idle pooled connections killed by the server: the next operations succeed on fresh ones
    # (or say the store is busy), never raise a psycopg error.
    pg_execute(pg_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                       "datname = current_database() AND pid <> pg_backend_pid()")
    outcomes = []
    for _ in range(3):
        try:
            s.heartbeat(1, node.node_epoch)
            outcomes.append("ok")
        except MetadataBusyError:
            outcomes.append("busy")
    assert outcomes[-1] == "ok"

    # A connection killed in the middle of an operation (waiting for a row lock): MetadataBusyError,
    # nothing applied, and the pool discards the dead connection.
    lost_before = sum(s._pool.get_stats().get(k, 0) for k in ("returns_bad", "connections_lost"))
    result = []
    with psycopg.connect(pg_url) as holder:
        holder.execute("SELECT 1 FROM streams WHERE stream_id = %s FOR UPDATE", (stream.stream_id,))

        def close():
            try:
                result.append(s.close_stream(stream.stream_id, 0, 1))
            except Exception as e:  # checked below
                result.append(e)

        thread = threading.Thread(target=close)
        thread.start()
        pg_execute(pg_url, f"SELECT pg_terminate_backend({_wait_for_lock_waiter(pg_url)})")
        thread.join(10)
        holder.rollback()
    [error] = result
    assert isinstance(error, MetadataBusyError) and not isinstance(error, psycopg.Error), error
    assert "connection" in str(error)
    assert sum(s._pool.get_stats().get(k, 0) for k in ("returns_bad", "connections_lost")) > lost_before
    assert s.get_stream(stream.stream_id).state == StreamState.OPENED
    assert s.close_stream(stream.stream_id, 0, 1).state == StreamState.CLOSED
    s.close()


def test_postgres_lock_timeout_is_a_busy_error(pg_url):
    import psycopg
    from s3stream.metadata import PostgresMetadataStore
    s = PostgresMetadataStore(pg_url, lock_timeout_s=0.2)
    node = s.register_node(1, "w1")
    stream = s.create_stream(1, node.node_epoch)
    with psycopg.connect(pg_url) as holder:
        holder.execute("SELECT 1 FROM streams WHERE stream_id = %s FOR UPDATE", (stream.stream_id,))
        with pytest.raises(MetadataBusyError, match="lock_timeout_s"):
            s.close_stream(stream.stream_id, 0, 1)
        holder.rollback()
    assert s.close_stream(stream.stream_id, 0, 1).state == StreamState.CLOSED
    # KV writes are one statement each, sent alone: the timeout holds for them too, and does
    # not stay behind in the pooled session.
    s.put_kv("k", b"1")
    with psycopg.connect(pg_url) as holder:
        holder.execute("SELECT 1 FROM kv WHERE key = 'k' FOR UPDATE")
        for write in (lambda: s.put_kv("k", b"2"), lambda: s.replace_kv("k", b"1", b"2"), lambda: s.delete_kv("k")):
            with pytest.raises(MetadataBusyError, match="lock_timeout_s"):
                write()
        assert s.put_kv_if_absent("k", b"2") == b"1"     # a lock on a row that exists is no conflict
        holder.rollback()
    assert s.get_kv("k") == b"1"
    assert [s._read_rows("SHOW lock_timeout")[0][0] for _ in range(8)] == ["0"] * 8
    s.close()


def test_postgres_plans_its_transactions_with_its_own_page_cost_and_leaves_the_session_alone(pg_url):
    """random_page_cost 1.1 (postgres._SET_PAGE_COST) in the store's read and write
    transactions, and in its statements sent alone; the pooled sessions keep the server's."""
    from s3stream.metadata import PostgresMetadataStore
    s = PostgresMetadataStore(pg_url)
    try:
        default = s._read_rows("SHOW random_page_cost")[0][0]
        assert default != "1.1"
        for write in (False, True):
            with s._transaction(write=write) as db:
                assert db.execute("SHOW random_page_cost").fetchone()[0] == "1.1"
        assert s._write_alone([("SELECT current_setting('random_page_cost')", ())]) == [("1.1",)]
        assert {s._read_rows("SHOW random_page_cost")[0][0] for _ in range(8)} == {default}
    finally:
        s.close()


def test_postgres_opens_run_beside_the_nodes_commit_and_a_fence_waits_for_them(pg_url):
    """The node row's locks: what a commit and a heartbeat hold (FOR NO KEY UPDATE) does not
    stop the node's opens, creates and reserves (FOR KEY SHARE: a node opening 10,000
    partitions did not let its uploads commit, nor its heartbeats through); what changes the
    node's epoch (fence_node, register_node: FOR UPDATE) waits for them, and they for it."""
    import psycopg
    from s3stream.metadata import PostgresMetadataStore
    s = PostgresMetadataStore(pg_url, lock_timeout_s=0.3)
    node = s.register_node(1, "w1")
    a, b = s.create_stream(1, node.node_epoch), s.create_stream(1, node.node_epoch)
    s.close_stream(a.stream_id, a.epoch, 1)
    row = "SELECT 1 FROM nodes WHERE node_id = 1 FOR "
    with psycopg.connect(pg_url) as holder:
        holder.execute(row + "NO KEY UPDATE")                 # a commit of node 1 in flight
        assert s.open_streams([a.stream_id], 1, node.node_epoch)[0].epoch == a.epoch + 1
        c = s.create_stream(1, node.node_epoch)
        assert s.reserve_offsets(b.stream_id, b.epoch, 1, node.node_epoch, 100).reserved_end == 100
        holder.rollback()
        holder.execute(row + "KEY SHARE")                     # an open of node 1 in flight
        s.heartbeat(1, node.node_epoch)
        s.commit(CommitRequest(1, node.node_epoch, closes=((c.stream_id, c.epoch),)))
        for change in (lambda: s.fence_node(1), lambda: s.register_node(1, "w1")):
            with pytest.raises(MetadataBusyError, match="lock_timeout_s"):
                change()
        holder.rollback()
        holder.execute(row + "UPDATE")                        # a fence of node 1 in flight
        for op in (lambda: s.open_streams([c.stream_id], 1, node.node_epoch),
                   lambda: s.create_stream(1, node.node_epoch),
                   lambda: s.reserve_offsets(b.stream_id, b.epoch, 1, node.node_epoch, 200),
                   lambda: s.heartbeat(1, node.node_epoch)):
            with pytest.raises(MetadataBusyError, match="lock_timeout_s"):
                op()
        holder.rollback()
    assert s.get_node(1).node_epoch == node.node_epoch
    assert s.fence_node(1).node_epoch == node.node_epoch + 1
    s.close()


# ---- pushed KV changes (ChangeFeed) ----------------------------------------------------------

def test_a_close_commit_writes_its_kv_entries_in_the_same_transaction(store, open_same):
    """CommitRequest.kv: written (and pushed to the feeds) by the commit that closes the streams,
    not by one that fails; refused without closes."""
    n1 = store.register_node(1, "w1")
    a = store.create_stream(1, n1.node_epoch)
    b = store.create_stream(1, n1.node_epoch)
    feed = open_same().kv_changes(("closed/",))
    try:
        request = upload(store, n1, sos=[rng(a, 0, 10)])
        request = CommitRequest(1, n1.node_epoch, stream_objects=request.stream_objects,
                                closes=((a.stream_id, 0),), kv=(("closed/p", b'{"v": 1}'),))
        store.commit(request)
        assert store.get_kv("closed/p") == b'{"v": 1}'
        assert store.get_stream(a.stream_id).state == StreamState.CLOSED
        assert feed.wait(5)
        # A fenced close writes nothing, its entries included.
        with pytest.raises(StreamFencedError):
            store.commit(CommitRequest(1, n1.node_epoch, closes=((b.stream_id, 7),), kv=(("closed/q", b"x"),)))
        assert store.get_kv("closed/q") is None
        with pytest.raises(MetadataError, match="only with the closes"):
            store.commit(CommitRequest(1, n1.node_epoch, stream_objects=upload(store, n1, sos=[rng(b, 0, 5)]).stream_objects,
                                       kv=(("closed/q", b"x"),)))
        assert store.get_kv("closed/q") is None and store.get_stream(b.stream_id).end_offset == 0
    finally:
        feed.close()


def test_a_commit_with_a_kv_guard_applies_only_while_the_key_holds_what_it_read(store):
    """CommitRequest.kv_guard (the Spark sink's exactly-once commit): a commit whose guard no
    longer holds raises KVConflictError and commits nothing (objects, ends, closes, kv); a
    retry of a commit that was applied is answered as such, though the key moved since."""
    n1 = store.register_node(1, "w1")
    a = store.create_stream(1, n1.node_epoch)
    store.put_kv("sink/writer/w", b"4")
    stale = CommitRequest(1, n1.node_epoch, stream_objects=upload(store, n1, sos=[rng(a, 0, 10)]).stream_objects,
                          closes=((a.stream_id, 0),), kv=(("sink/writer/w", b"5"),), kv_guard=("sink/writer/w", b"3"))
    with pytest.raises(KVConflictError, match="sink/writer/w"):
        store.commit(stale)
    after = store.get_stream(a.stream_id)
    assert (after.end_offset, after.state, store.get_kv("sink/writer/w")) == (0, StreamState.OPENED, b"4")
    absent = CommitRequest(1, n1.node_epoch, stream_objects=stale.stream_objects, closes=stale.closes,
                           kv=(("sink/writer/w", b"5"),), kv_guard=("sink/writer/w", None))
    with pytest.raises(KVConflictError):
        store.commit(absent)
    good = CommitRequest(1, n1.node_epoch, stream_objects=stale.stream_objects, closes=stale.closes,
                         kv=(("sink/writer/w", b"5"),), kv_guard=("sink/writer/w", b"4"))
    assert not store.commit(good).already_committed
    after = store.get_stream(a.stream_id)
    assert (after.end_offset, after.state, store.get_kv("sink/writer/w")) == (10, StreamState.CLOSED, b"5")
    assert store.commit(good).already_committed
    with pytest.raises(MetadataError, match="only with the closes"):
        store.commit(CommitRequest(1, n1.node_epoch, stream_objects=stale.stream_objects, kv_guard=("k", None)))


def test_change_feed_wakes_on_writes_under_its_prefixes(store, open_same, meta_url):
    """Both stores push a committed KV write to every feed listening for its prefix (another
    store, as another process would be): PostgreSQL by LISTEN/NOTIFY, SQLite by datagrams
    between the processes of its host."""
    feed = store.kv_changes(("assignment/", "closed/"))
    other = open_same()
    try:
        assert feed.pushes
        assert not feed.wait(0.1)
        t0 = time.monotonic()
        other.put_kv("assignment/p1", b"1")
        assert feed.wait(5) and time.monotonic() - t0 < 1.0
        other.put_kv("opened/p1", b"1")                     # not a prefix of this feed
        other.put_kv_if_absent("assignment/p1", b"2")       # nothing written: nothing pushed
        assert not feed.wait(0.3)
        other.delete_kv("closed/none")                      # nothing deleted
        assert not feed.wait(0.1)
        other.put_kv_if_absent("closed/p1", b"x")
        assert feed.wait(5)
        other.delete_kv("closed/p1")
        assert feed.wait(5)
        feed.wake()                                         # from another thread, as stop() does
        assert feed.wait(5)
    finally:
        feed.close()


def test_a_feed_s_wake_ends_a_wait_in_progress_once(store):
    """wake() from another thread ends a wait already blocked (an agent's task that ended asks
    its loop to look again: PostgreSQL's feed selects on a socket pair beside its connection),
    and is used up by it: the next wait blocks until its timeout."""
    feed = store.kv_changes(("x/",))
    try:
        result: list[bool] = []
        waiter = threading.Thread(target=lambda: result.append(feed.wait(30)))
        waiter.start()
        time.sleep(0.2)
        feed.wake()
        waiter.join(10)
        assert result == [True] and not waiter.is_alive()
        assert not feed.wait(0.2)
    finally:
        feed.close()


def test_a_commit_reads_each_stream_s_last_range_only(store, monkeypatch):
    """A stream gains a range at every open by another owner; a commit checks and extends only
    the last one, and loads only that (its cost must not grow with the stream's history of
    owners). What it commits is as before."""
    import s3stream.metadata.postgres as pg_store
    import s3stream.metadata.sqlite as sqlite_store
    nodes = {1: store.register_node(1, "/wal/1"), 2: store.register_node(2, "/wal/2")}
    a, b = (store.create_stream(1, nodes[1].node_epoch) for _ in range(2))
    owner = 1
    for i in range(12):            # data from each owner, then the other one opens both
        metas = [store.get_stream(s.stream_id) for s in (a, b)]
        request = upload(store, nodes[owner], sos=[rng(m, m.end_offset, m.end_offset + 3, m.epoch) for m in metas])
        store.commit(dataclasses.replace(request, closes=tuple((m.stream_id, m.epoch) for m in metas)))
        owner = 3 - owner
        store.open_streams([a.stream_id, b.stream_id], owner, nodes[owner].node_epoch)
    before = {s.stream_id: store.get_stream(s.stream_id) for s in (a, b)}
    assert [len(m.ranges) for m in before.values()] == [13, 13]
    seen = []

    def spy(real):
        def apply(db, request, now, rows, streams, *args, **kwargs):
            seen.append({sid: m.ranges for sid, m in streams.items()})
            return real(db, request, now, rows, streams, *args, **kwargs)
        return apply

    monkeypatch.setattr(sqlite_store, "_apply_commit", spy(sqlite_store._apply_commit))
    monkeypatch.setattr(pg_store, "_apply_commit", spy(pg_store._apply_commit))
    result = store.commit(upload(store, nodes[owner], sos=[rng(m, m.end_offset, m.end_offset + 4, m.epoch)
                                                           for m in before.values()]))
    assert seen == [{sid: m.ranges[-1:] for sid, m in before.items()}]
    after = {s.stream_id: store.get_stream(s.stream_id) for s in (a, b)}
    assert result.end_offsets == {sid: m.end_offset + 4 for sid, m in before.items()}
    assert {sid: m.ranges[:-1] for sid, m in after.items()} == {sid: m.ranges[:-1] for sid, m in before.items()}
    assert [m.ranges[-1].end_offset for m in after.values()] == [m.end_offset + 4 for m in before.values()]


def test_commits_are_pushed_to_the_feeds_of_streams_a_reader_tails(store, open_same):
    """A commit that extends a stream wakes a change feed on its commit_key. On PostgreSQL the
    commit sends that notice only while such a feed is open (each NOTIFY wakes every listening
    session and serialises the committing transactions): the feed registers a tailing_key and
    its close removes it; a tailing key of another stream, or of a longer id sharing the
    prefix, does not count. SQLite's datagrams go out anyway."""
    node = store.register_node(1, "/wal/1")
    tailed, other = store.create_stream(1, node.node_epoch), store.create_stream(1, node.node_epoch)
    ends = {tailed.stream_id: 0, other.stream_id: 0}

    def extend(stream) -> None:
        store.commit(upload(store, node, sos=[rng(stream, ends[stream.stream_id], ends[stream.stream_id] + 5)]))
        ends[stream.stream_id] += 5

    store.put_kv(tailing_key(int(f"{other.stream_id}0"), "longer"), b"")
    listener = None
    if not isinstance(store, SqliteMetadataStore):
        import psycopg
        from s3stream.metadata.postgres import KV_CHANNEL
        listener = psycopg.connect(store.url, autocommit=True)
        listener.execute(f"LISTEN {KV_CHANNEL}")

    def notices() -> list[str]:
        return [n.payload for n in listener.notifies(timeout=0.3) if n.payload.startswith("commit/")]

    feed = open_same().kv_changes((commit_key(tailed.stream_id),))
    try:
        assert feed.pushes and not feed.wait(0.1)
        assert len(store.list_kv("tailing/")) == (1 if listener else 0) + 1
        t0 = time.monotonic()
        extend(tailed)
        assert feed.wait(5) and time.monotonic() - t0 < 1.0
        extend(other)                      # no feed on it (the "longer" key is another stream's)
        if listener is not None:
            assert notices() == [commit_key(tailed.stream_id)]
    finally:
        feed.close()
    try:
        assert list(store.list_kv("tailing/")) == [tailing_key(int(f"{other.stream_id}0"), "longer")]
        extend(tailed)
        if listener is not None:
            assert notices() == []
        assert store.get_stream(tailed.stream_id).end_offset == 10
    finally:
        if listener is not None:
            listener.close()


def test_sqlite_change_feed_is_woken_by_another_process(tmp_path):
    """A KV write committed by another process wakes the feed at once; a socket left by a
    process that died is removed by the next write; a closed feed leaves no socket."""
    from s3stream.metadata.hostfeed import feed_directory
    path = str(tmp_path / "meta.db")
    store = SqliteMetadataStore(path)
    feed = store.kv_changes(("assignment/",))
    directory = feed_directory(path)
    stale = os.path.join(directory, "999999-dead.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dead.bind(stale)
    dead.close()                            # the file stays, nobody listens: a process that died
    try:
        writer = ("from s3stream.metadata import SqliteMetadataStore\n"
                  f"s = SqliteMetadataStore({path!r}); s.put_kv('assignment/p1', b'1'); s.close()\n")
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", writer], check=True, timeout=60)
        assert feed.wait(5)
        assert time.monotonic() - t0 < 30
        assert not os.path.exists(stale)
        subprocess.run([sys.executable, "-c", writer.replace("assignment/", "opened/")], check=True, timeout=60)
        assert not feed.wait(0.3)           # not under its prefixes
    finally:
        feed.close()
        store.close()
    assert not os.path.exists(feed.path) and not os.path.exists(directory)


def test_sqlite_change_feed_takes_a_write_of_many_keys_in_one_datagram(tmp_path):
    """A write of a few keys reaches each feed as one datagram naming them; a write of 10,000
    (a failover's reassignment) as one naming their first path segments, not a datagram (a
    wake-up of its process) per key. A feed wakes if a key or a segment could be under its
    prefixes, and only then."""
    from s3stream.metadata.hostfeed import RECEIVE_BYTES, SEGMENT
    store = SqliteMetadataStore(str(tmp_path / "meta.db"))
    counted, hears_b, hears_c, hears_b_x = (store.kv_changes((p,)) for p in ("b/", "b/", "c/", "b/x"))

    def datagrams():
        out = []
        while True:
            try:
                out.append(counted._sock.recv(RECEIVE_BYTES))
            except BlockingIOError:
                return out

    try:
        store.put_kvs([("a/1", b"1"), ("b/2", b"1")])
        assert datagrams() == [b"a/1\0b/2"]
        keys = [f"a/{i:05d}" for i in range(10_000)]
        keys.insert(5000, "b/x")
        store.put_kvs([(k, b"1") for k in keys])
        assert datagrams() == [SEGMENT + b"a/\0" + SEGMENT + b"b/"]
        assert hears_b.wait(1) and hears_b_x.wait(1)
        assert not hears_c.wait(0.2)
        assert store.replace_kvs([("c/1", None, b"1"), ("a/00001", None, b"2")]) == [True, False]
        assert hears_c.wait(1) and not hears_b.wait(0.2)
    finally:
        for feed in (counted, hears_b, hears_c, hears_b_x):
            feed.close()
        store.close()


def test_sqlite_change_feed_polls_where_no_socket_fits(tmp_path, monkeypatch):
    """A temporary directory too long for a socket address: the feed does not push (callers
    poll), and writes still succeed."""
    import tempfile
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    store = SqliteMetadataStore(str(tmp_path / "meta.db"))
    try:
        feed = store.kv_changes(("assignment/",))
        assert not feed.pushes
        store.put_kv("assignment/p1", b"1")
        assert store.get_kv("assignment/p1") == b"1"
        feed.wake()
        assert feed.wait(1)
    finally:
        store.close()


def test_pg_change_feed_survives_a_lost_connection(pg_url):
    store, writer = open_metadata(pg_url), open_metadata(pg_url)
    feed = store.kv_changes(("assignment/",))
    try:
        pid = feed._conn.info.backend_pid
        pg_execute(pg_url, f"SELECT pg_terminate_backend({pid})")
        assert feed.wait(5)                    # lost, reconnected: "look again"
        assert feed._conn is not None and feed._conn.info.backend_pid != pid
        writer.put_kv("assignment/p2", b"1")
        assert feed.wait(5)
    finally:
        feed.close()
        store.close()
        writer.close()


def test_pg_change_feed_takes_a_burst_of_notices_in_one_wait(pg_url):
    """A burst of writes (a failover reassigning thousands of partitions) reaches a feed in
    many reads of its socket: one wait takes them all, so its caller runs one pass for the
    burst, not one per read; the next wait, with nothing new, times out."""
    store, writer = open_metadata(pg_url), open_metadata(pg_url)
    feed = store.kv_changes(("assignment/",))
    try:
        for t in range(20):
            writer.put_kvs([(f"assignment/p{t}-{i:04d}", b"x" * 40) for i in range(500)])
        time.sleep(1.0)                         # delivered to the feed's socket, not read yet
        assert feed.wait(5)
        assert not feed.wait(0.3)
        writer.put_kv("assignment/last", b"1")
        assert feed.wait(5)
    finally:
        feed.close()
        store.close()
        writer.close()


def test_pg_write_of_many_keys_sends_a_notice_per_segment(pg_url):
    """A write of a few keys notifies each key; a write of more than NOTICES_PER_WRITE (a batch
    of opened/ records, a failover's reassignment) one notice per first path segment, not one
    per key (each reaches every listening session). A feed wakes if a key or a segment could be
    under its prefixes, and only then; commit keys stay per stream, for tailing readers only."""
    import psycopg
    from s3stream.metadata.postgres import KV_CHANNEL, NOTICES_PER_WRITE
    store = open_metadata(pg_url)
    hears_b, hears_c, hears_b_x = (store.kv_changes((p,)) for p in ("b/", "c/", "b/x"))
    listener = psycopg.connect(pg_url, autocommit=True)
    listener.execute(f"LISTEN {KV_CHANNEL}")

    def notices():
        return [n.payload for n in listener.notifies(timeout=0.3)]

    try:
        store.put_kvs([("a/1", b"1"), ("b/2", b"1")])
        assert notices() == ["a/1", "b/2"]
        keys = [f"a/{i:05d}" for i in range(5000)]
        keys.insert(2500, "b/x")
        store.put_kvs([(k, b"1") for k in keys])
        assert notices() == ["\x01a/", "\x01b/"]
        assert hears_b.wait(1) and hears_b_x.wait(1)
        assert not hears_c.wait(0.2)
        many = [(f"c/{i}", None, b"1") for i in range(NOTICES_PER_WRITE + 1)]
        assert store.replace_kvs(many + [("a/00001", None, b"2")]) == [True] * len(many) + [False]
        assert notices() == ["\x01c/"]
        assert hears_c.wait(1) and not hears_b.wait(0.2)
    finally:
        listener.close()
        for feed in (hears_b, hears_c, hears_b_x):
            feed.close()
        store.close()


# ---- schema version 2: health, offset reservations, lost ranges (issue 26) ------------------------

_V2_COLUMNS = (("nodes", "health"), ("streams", "reserved_end"), ("ranges", "lost"))


def _downgrade_to_v1(execute) -> None:
    for table, column in _V2_COLUMNS:
        execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    execute("UPDATE schema_info SET value = 1 WHERE name = 'schema_version'")


def test_version_1_metadata_is_upgraded_in_place(meta_url, open_same):
    """A store made by the previous release (schema 1) opens, gains the version 2 columns, and
    keeps its data; its streams have no reservation (the next append or open reserves)."""
    first = open_same()
    node = first.register_node(1, "/wal/1")
    made = first.create_stream(1, node.node_epoch)
    first.put_kv("k", b"v")
    first.close()
    if meta_url.startswith("sqlite"):
        raw = sqlite3.connect(meta_url[len("sqlite:///"):])
        _downgrade_to_v1(lambda sql: raw.execute(sql))
        raw.commit()
        raw.close()
    else:
        _downgrade_to_v1(lambda sql: pg_execute(meta_url, sql))
    store = open_same()
    assert store.get_kv("k") == b"v"
    got = store.get_stream(made.stream_id)
    assert (got.reserved_end, got.ranges[0].lost) == (0, False)
    assert store.get_node(1).health is None
    store.heartbeat(1, node.node_epoch, '{"serving": true}')
    assert store.get_node(1).health == '{"serving": true}'


def test_reservations_are_fenced_and_abandon_skips_past_them(store):
    n1 = store.register_node(1, "/wal/1")
    s = store.create_stream(1, n1.node_epoch, reserve=100)
    assert (s.end_offset, s.reserved_end) == (0, 100)
    store.prepare_objects(1, 10 * SECOND)
    store.commit(CommitRequest(1, n1.node_epoch, sso=CommitSSO(1, 10, (rng(s.stream_id, 0, 40),))))
    assert store.reserve_offsets(s.stream_id, 0, 1, n1.node_epoch, 50).reserved_end == 100   # never lowered
    assert store.reserve_offsets(s.stream_id, 0, 1, n1.node_epoch, 300).reserved_end == 300
    with pytest.raises(StreamFencedError):
        store.reserve_offsets(s.stream_id, 1, 1, n1.node_epoch, 400)          # stale stream epoch
    store.fence_node(1)
    with pytest.raises(StreamFencedError):
        store.reserve_offsets(s.stream_id, 0, 1, n1.node_epoch, 400)          # a fenced node reserves nothing
    with pytest.raises(StreamFencedError):
        store.abandon_stream(s.stream_id, 0, 2)                               # not its owner
    gone = store.abandon_stream(s.stream_id, 0, 1)
    assert (gone.state, gone.end_offset, gone.owner_node_id) == (StreamState.CLOSED, 300, None)
    assert [(r.start_offset, r.end_offset, r.lost) for r in gone.ranges] == [(0, 40, False), (40, 300, True)]
    assert gone.lost_range_at(40) == gone.ranges[1] and gone.lost_range_at(39) is None
    assert store.abandon_stream(s.stream_id, 0, 1) == gone                   # a repeat changes nothing
    n2 = store.register_node(2, "/wal/2")
    reopened = store.open_stream(s.stream_id, 2, n2.node_epoch, reserve=10)
    assert (reopened.end_offset, reopened.reserved_end) == (300, 310)
    assert [(r.node_id, r.start_offset, r.lost) for r in reopened.ranges] == [(1, 0, False), (1, 40, True),
                                                                             (2, 300, False)]
    # The next owner commits above the lost range; reads below it still find their objects.
    store.prepare_objects(1, 10 * SECOND)
    store.commit(CommitRequest(2, n2.node_epoch, sso=CommitSSO(2, 10, (rng(s.stream_id, 300, 305, 1),))))
    assert [r.object_id for r in store.get_object_refs(s.stream_id, 0, 400)] == [1, 2]


def test_abandon_without_reservation_closes_at_the_committed_end(store):
    n1 = store.register_node(1, "/wal/1")
    s = store.create_stream(1, n1.node_epoch)
    gone = store.abandon_stream(s.stream_id, 0, 1)
    assert (gone.state, gone.end_offset, [r.lost for r in gone.ranges]) == (StreamState.CLOSED, 0, [False])


def test_sqlite_a_writer_waits_for_the_write_lock_then_writes(tmp_path):
    """A write that finds SQLite's write lock held by another connection tries again (on its own
    short schedule, SQLite's busy handler off) until the holder commits, then writes; past
    busy_timeout_s it is MetadataBusyError; either way the connection keeps its busy timeout."""
    import sqlite3
    from s3stream.metadata import SqliteMetadataStore
    path = tmp_path / "meta.db"
    store = SqliteMetadataStore(str(path), busy_timeout_s=5.0)
    holder = sqlite3.connect(str(path), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    done: list = []
    writer = threading.Thread(target=lambda: done.append(store.put_kv("k", b"v")))
    writer.start()
    writer.join(0.2)
    # (read beside it: the store's own connection is the waiting writer's until it is through)
    assert writer.is_alive() and holder.execute("SELECT count(*) FROM kv").fetchone()[0] == 0
    holder.execute("COMMIT")
    writer.join(10)
    assert done == [None] and store.get_kv("k") == b"v"
    assert store._conn.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
    impatient = SqliteMetadataStore(str(path), busy_timeout_s=0.1)
    holder.execute("BEGIN IMMEDIATE")
    with pytest.raises(MetadataBusyError, match="busy_timeout_s"):
        impatient.put_kv("k", b"w")
    holder.execute("ROLLBACK")
    assert impatient._conn.execute("PRAGMA busy_timeout").fetchone()[0] == 100
    impatient.put_kv("k", b"w")
    assert store.get_kv("k") == b"w"
    holder.close()
    impatient.close()
    store.close()


def test_racing_commits_guarded_by_one_absent_key_apply_once(open_same, clock, monkeypatch):
    """Two commits of disjoint streams, each guarded by the same absent KV key (two Spark
    drivers committing a writer's first micro-batch): exactly one applies, the other is refused
    (KVConflictError), whatever their interleaving. Both are held right after their guard check
    until the other arrives or 1 s passes: on PostgreSQL, SELECT ... FOR UPDATE of a row that does
    not exist locks nothing, so before the fix both passed their checks and both applied."""
    import threading
    from s3stream.metadata import sql as sql_store     # both stores' commits check the guard there
    stores = [open_same(clock=clock), open_same(clock=clock)]
    key = "sink/writer/racing"
    requests = []
    for i, s in enumerate(stores):
        node = s.register_node(10 + i, f"w{i}")
        stream = s.create_stream(node.node_id, node.node_epoch)
        sos = upload(s, node, sos=[rng(stream, 0, 10)]).stream_objects
        requests.append(CommitRequest(node.node_id, node.node_epoch, stream_objects=sos,
                                      closes=((stream.stream_id, 0),), kv=((key, b"0"),), kv_guard=(key, None)))
    arrived = threading.Condition()
    count = [0]
    real = sql_store._kv_holds

    def held(db, k, expected, guard, lock=""):
        ok = real(db, k, expected, guard, lock)
        if k == key:
            with arrived:
                count[0] += 1
                arrived.notify_all()
                arrived.wait_for(lambda: count[0] >= 2, 1.0)
        return ok

    monkeypatch.setattr(sql_store, "_kv_holds", held)
    outcomes: list = [None, None]

    def commit(i: int) -> None:
        try:
            stores[i].commit(requests[i])
            outcomes[i] = "applied"
        except KVConflictError:
            outcomes[i] = "refused"

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcomes) == ["applied", "refused"], outcomes
