"""Issue 28: a close uploads only its own streams' tails, goes first, and a stream's tail stays
bounded whatever the load; nothing acknowledged is lost if the node dies during such a close."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from s3stream import RecordBatch, StreamClient
from s3stream.metadata import ObjectState, ObjectType, SqliteMetadataStore
from s3stream.objectstore import LocalObjectStore

from close_kill_child import ThreadGatedStore, digest
from conftest import KiB, MiB, small_config
from s3stream.cluster import open_partition

HERE = Path(__file__).parent
CHILDREN = HERE.parent / "children"


def client(tmp_path, store, **overrides):
    cfg = small_config(reclaim_interval=None, **overrides)
    return StreamClient(1, tmp_path / "node1.wal", store, f"sqlite:///{tmp_path}/meta.db", cfg)


def two_nodes(tmp_path):
    """Nodes 1 and 2 sharing one SQLite database and one local store."""
    store, meta = f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db"
    return tuple(StreamClient(n, tmp_path / f"n{n}.wal", store, meta, small_config()) for n in (1, 2))


def read_stream(c, stream_id):
    """Every committed batch of the stream, as [(base, payload)]."""
    out, pos = [], 0
    end = c.metadata.get_stream(stream_id).end_offset
    while pos < end:
        res = c.fetch_committed(stream_id, pos, end)
        out += [(b.base_offset, bytes(b.payload)) for b in res.batches]
        pos = res.end_offset
    return out


@pytest.mark.slow
def test_close_uploads_only_its_streams_while_background_uploads_stall(tmp_path):
    """Stream A closes while B keeps the node loaded and every background PUT is stalled: the
    close returns (it does not wait behind B's blocks), its own PUTs hold exactly A's tail and
    nothing of B, one StreamObject per closed stream, committed with A CLOSED; B's blocks commit
    later without A's ranges, and every byte of both reads back."""
    store = ThreadGatedStore(LocalObjectStore(str(tmp_path / "objects")), hang_background=1.5)
    c = client(tmp_path, store, upload_threshold=256 * KiB, split_size=64 * KiB, stream_tail_limit=2 * MiB)
    try:
        a, b = c.create_stream(), c.create_stream()
        written = {a.stream_id: [], b.stream_id: []}
        for i in range(60):
            for s in (a, b):
                payload = os.urandom(2000 + 13 * i)
                written[s.stream_id].append((s.append(RecordBatch(payload, 1)).result(10).base_offset, payload))
        tail = sum(len(p) for _, p in written[a.stream_id])             # nothing of A is up yet
        assert 0 < c.unuploaded_bytes(a) <= tail    # (slices whose stalled PUT started are not counted)
        t0 = time.monotonic()
        a.close(timeout=10)
        took = time.monotonic() - t0
        assert took < 1.5, f"the close waited for the stalled background uploads ({took:.2f} s)"
        mine = [(key, size) for name, key, size in store.puts if not name.startswith("s3stream-put")]
        assert len(mine) == 1                                           # one SO: A's tail
        stats = c.stats()["upload"]
        assert stats["closes"] == 1 and stats["close_objects"] == 1 and stats["close_bytes"] == mine[0][1]
        meta = c.metadata
        assert meta.get_stream(a.stream_id).state.value == "CLOSED"
        assert meta.get_stream(a.stream_id).end_offset == 60
        so = [o for o in meta.list_objects(state=ObjectState.COMMITTED, type=ObjectType.STREAM_OBJECT)
              if o.key == mine[0][0]]
        assert len(so) == 1
        refs = meta.get_object_refs(a.stream_id, 0, 60)
        assert [(r.key, r.start_offset, r.end_offset) for r in refs] == [(mine[0][0], 0, 60)]
        assert not meta.get_object_refs(b.stream_id, 0, 60)             # B's data is not up yet
        # The object holds A's tail and no byte of B: A's payloads plus the format's framing.
        assert tail < mine[0][1] < tail + 16 * KiB
        for i in range(20):
            payload = os.urandom(3000)
            written[b.stream_id].append((b.append(RecordBatch(payload, 1)).result(10).base_offset, payload))
        b.close(timeout=30)
        c.force_upload(30)
        assert c._uploader.stats["closed_tail_bytes_skipped"] > 0      # later blocks left A's (and B's) tails out
        for sid, batches in written.items():
            assert read_stream(c, sid) == batches
    finally:
        c.close()


def test_a_close_commits_ahead_of_a_block_whose_puts_ended_during_its_own(tmp_path):
    """A close goes first: from its start, a block's commit does not take the commit gate, so
    the close finds it free once its PUTs are done. Here the close's PUT takes 0.4 s and a
    block of another stream is PUT meanwhile: the block commits after the close (before the
    change it committed first, and the close waited for it), and both read back."""
    store = ThreadGatedStore(LocalObjectStore(str(tmp_path / "objects")), hang_others=0.4)
    c = client(tmp_path, store, upload_threshold=256 * KiB, split_size=64 * KiB)
    try:
        a, b = c.create_stream(), c.create_stream()
        pa = [os.urandom(3000) for _ in range(10)]
        for p in pa:
            a.append(RecordBatch(p, 1)).result(10)
        commits: list[tuple[str, float]] = []
        meta = c._uploader._meta
        real = meta.commit
        meta.commit = lambda request: (commits.append(("close" if request.closes else "block", time.monotonic())),
                                       real(request))[1]
        try:
            closing = threading.Thread(target=a.close, kwargs=dict(timeout=10))
            closing.start()
            time.sleep(0.1)                                   # the close is in its PUT
            pb = [os.urandom(3000) for _ in range(10)]
            for p in pb:
                b.append(RecordBatch(p, 1)).result(10)
            t0 = time.monotonic()
            c.force_upload(10)                                # B's block: PUT at once, then its commit
            closing.join(10)
        finally:
            del meta.commit
        kinds = [k for k, _ in commits]
        assert kinds[:2] == ["close", "block"], commits
        assert commits[1][1] - t0 > 0.1                       # the block's commit waited for the close
        assert c._uploader.stats["close_conflicts"] == 0
        assert [p for _, p in read_stream(c, a.stream_id)] == pa
        assert [p for _, p in read_stream(c, b.stream_id)] == pb
    finally:
        c.close()


@pytest.mark.slow
def test_a_stream_tail_stays_bounded_under_a_store_slower_than_the_producer(tmp_path):
    """A producer that outruns the store (every background PUT takes 60 ms): the stream's
    un-uploaded tail never exceeds stream_tail_limit plus the batches in flight, appends wait
    for it (counted), and a close at any moment has at most that much to upload."""
    limit = 512 * KiB
    store = ThreadGatedStore(LocalObjectStore(str(tmp_path / "objects")), hang_background=0.06)
    c = client(tmp_path, store, upload_threshold=1 * MiB, split_size=256 * KiB, stream_tail_limit=limit)
    seen: list[int] = []
    stop = threading.Event()
    try:
        s = c.create_stream()
        batch = 16 * KiB

        def sample() -> None:
            while not stop.is_set():
                seen.append(c.unuploaded_bytes(s))
                time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        futures = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:
            futures.append(s.append(RecordBatch(os.urandom(batch), 1)))
            if len(futures) > 8:
                futures.pop(0).result(30)
        for f in futures:
            f.result(30)
        stop.set()
        sampler.join()
        appended = s.next_offset * batch
        assert appended > 4 * limit                       # the producer did outrun the uploads
        assert max(seen) <= limit + batch, f"tail reached {max(seen)} bytes (limit {limit})"
        assert c.stats()["append"]["tail_waits"] > 0
        before = c.unuploaded_bytes(s)
        assert before <= limit + batch
        s.close(timeout=30)
        assert c.stats()["upload"]["close_bytes"] <= before + 64 * KiB
    finally:
        stop.set()
        c.close()


def test_a_stream_reopened_on_the_same_node_after_its_close_takes_appends(tmp_path):
    """Closed here (its tail still in the active block), reopened here at epoch + 1: the new
    epoch gets a slice of its own; both epochs' records read back."""
    c = client(tmp_path, f"file://{tmp_path}/objects")
    try:
        s = c.create_stream()
        first = [os.urandom(1000) for _ in range(5)]
        for p in first:
            s.append(RecordBatch(p, 1)).result(10)
        s.close(timeout=10)
        again = c.open_stream(s.stream_id)
        second = [os.urandom(1000) for _ in range(5)]
        for p in second:
            again.append(RecordBatch(p, 1)).result(10)
        again.close(timeout=10)
        assert read_stream(c, s.stream_id) == list(enumerate(first + second))
    finally:
        c.close()


def test_a_close_racing_a_block_commit_uploads_only_what_is_left(tmp_path, monkeypatch):
    """A block holding part of the tail commits while the close's own PUT is in flight: the close
    notices, uploads the rest again holding the commit gate, and the stream stays dense. (A
    block's commit waits for an announced close for CLOSE_PRIORITY_MAX_WAIT, set to 0 here: the
    race remains for a block waiting longer, or whose commit began before the close.)"""
    from s3stream.engine import upload
    monkeypatch.setattr(upload, "CLOSE_PRIORITY_MAX_WAIT", 0.0)
    store = ThreadGatedStore(LocalObjectStore(str(tmp_path / "objects")), hang_others=0.3)
    c = client(tmp_path, store, upload_threshold=128 * KiB, split_size=32 * KiB, upload_idle=False)
    try:
        s = c.create_stream()
        written = []
        gate = threading.Event()
        put = c._uploader._put

        def slow_background_put(key, data):
            gate.wait(10)                     # background PUTs wait until the close has begun its own
            put(key, data)

        c._uploader._put = slow_background_put
        for i in range(50):
            payload = os.urandom(4000)
            written.append((s.append(RecordBatch(payload, 1)).result(10).base_offset, payload))
        closer = threading.Thread(target=s.close, kwargs=dict(timeout=20))
        closer.start()
        time.sleep(0.05)
        gate.set()                            # the sealed block commits during the close's PUT
        closer.join(30)
        assert not closer.is_alive()
        assert c._uploader.stats["close_conflicts"] == 1
        assert c.metadata.get_stream(s.stream_id).state.value == "CLOSED"
        assert read_stream(c, s.stream_id) == written
    finally:
        c.close()


@pytest.mark.parametrize("mode", ["close-put", "close-done"])
def test_kill_9_during_a_scoped_close_loses_nothing(tmp_path, mode):
    """kill -9 while a close uploads its tail (its PUT hangs), or right after it committed (the
    blocks holding that tail still in the WAL, uncommitted): the restart's recovery replays the
    WAL, skips what the close committed, and every acknowledged record of both streams reads
    back, once, at its offset."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, str(CHILDREN / "close_kill_child.py"), str(tmp_path), mode],
                             stdout=subprocess.PIPE, text=True, env=env)
    acks: dict[int, dict[int, str]] = {}
    wait_for = "closing" if mode == "close-put" else "closed"
    try:
        assert child.stdout is not None
        for line in child.stdout:
            word, *rest = line.split()
            if word == "ids":
                acks = {int(x): {} for x in rest}
            elif word == "ack":
                acks[int(rest[0])][int(rest[1])] = rest[2]
            elif word == wait_for:
                break
        else:
            pytest.fail(f"the child exited early ({child.wait()})")
        if mode == "close-put":
            time.sleep(0.3)                   # inside the close's hanging PUT
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert acks and all(len(v) == 120 for v in acks.values())
    c = client(tmp_path, f"file://{tmp_path}/objects", upload_threshold=256 * KiB, split_size=64 * KiB)
    try:
        for sid, expected in acks.items():
            got = read_stream(c, sid)
            assert [base for base, _ in got] == list(range(len(got)))           # dense, no duplicate
            assert {base: digest(p) for base, p in got} == expected
        meta = SqliteMetadataStore(str(tmp_path / "meta.db"))
        a = min(acks)
        assert meta.get_stream(a).end_offset == 120
        meta.close()
    finally:
        c.close()


@pytest.mark.slow
def test_an_append_waiting_on_its_tail_is_refused_when_its_stream_closes(tmp_path):
    """An appender held by the tail bound (background PUTs stalled) while its stream closes: the
    close uploads the tail itself, and the waiting append is refused at once as closed, instead
    of waiting out append_timeout for a tail that is no longer this node's to upload."""
    import s3stream
    store = ThreadGatedStore(LocalObjectStore(str(tmp_path / "objects")), hang_background=3)
    c = client(tmp_path, store, upload_threshold=1 * MiB, split_size=256 * KiB, stream_tail_limit=256 * KiB,
               append_timeout=60)
    try:
        s = c.create_stream()
        outcome: list[BaseException | None] = []

        def produce() -> None:
            try:
                while True:
                    s.append(RecordBatch(os.urandom(64 * KiB), 1)).result(30)
            except BaseException as e:      # noqa: BLE001 - the outcome is the test's
                outcome.append(e)

        producer = threading.Thread(target=produce)
        producer.start()
        deadline = time.monotonic() + 10
        # (a wait ends once a PUT of the tail starts: it holds for good once every upload thread
        # is in a stalled PUT)
        while c._tail_waiters == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c._tail_waiters == 1                       # held by the bound
        s.close(timeout=10)
        producer.join(10)                                 # liveness bound (append_timeout is 60 s)
        assert not producer.is_alive()
        assert isinstance(outcome[0], s3stream.StreamClosedError), outcome
        assert c.metadata.get_stream(s.stream_id).end_offset == s.next_offset
    finally:
        c.close(timeout=1)


def test_blocks_take_object_ids_prepared_ahead(tmp_path):
    """Blocks take their object ids from those prepared ahead (BLOCK_IDS_AHEAD at a time): 24
    uploaded blocks cost two prepare transactions, not 24; their ids rise with block order; a
    clean shutdown leaves no PREPARED object."""
    from s3stream.engine.upload import BLOCK_IDS_AHEAD
    c = client(tmp_path, f"file://{tmp_path}/objects")
    try:
        s = c.create_stream()
        calls: list[int] = []
        meta = c._uploader._meta
        real = meta.prepare_objects
        meta.prepare_objects = lambda count, ttl_ns: (calls.append(count), real(count, ttl_ns))[1]
        try:
            for _ in range(24):
                s.append(RecordBatch(os.urandom(2000), 1)).result(10)
                c.force_upload(timeout=10)
        finally:
            del meta.prepare_objects
        assert calls == [1 + BLOCK_IDS_AHEAD] * 2, calls
        committed = sorted(c.metadata.list_objects(state=ObjectState.COMMITTED), key=lambda o: o.order_id)
        ids = [o.object_id for o in committed]
        assert len(ids) == 24 and ids == sorted(ids)          # in commit (block) order
        assert len(c.metadata.list_objects(state=ObjectState.PREPARED)) == 2 * (1 + BLOCK_IDS_AHEAD) - 24
        assert [b for _, b in read_stream(c, s.stream_id)] and c.metadata.get_stream(s.stream_id).end_offset == 24
    finally:
        c.close()
    meta = SqliteMetadataStore(str(tmp_path / "meta.db"))
    assert meta.list_objects(state=ObjectState.PREPARED) == []
    meta.close()


def test_a_close_is_one_metadata_transaction(tmp_path):
    """Once this node has closed a stream (that close prepared ids ahead), a stream's close
    writes metadata once: the commit of its tail with its CLOSED state. A clean shutdown lets
    the ids prepared ahead go: no PREPARED object is left."""
    c = client(tmp_path, f"file://{tmp_path}/objects")
    try:
        first = c.create_stream()
        first.append(RecordBatch(os.urandom(2000), 1)).result(10)
        first.close(timeout=10)                            # prepares its id and spares
        s = c.create_stream()
        s.append(RecordBatch(os.urandom(2000), 1)).result(10)
        calls: list[str] = []
        meta = c._uploader._meta
        for name in ("prepare_objects", "commit", "close_stream"):
            real = getattr(meta, name)
            setattr(meta, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
        try:
            s.close(timeout=10)
        finally:
            for name in ("prepare_objects", "commit", "close_stream"):
                delattr(meta, name)
        assert calls == ["commit"]
        assert c.metadata.get_stream(s.stream_id).end_offset == 1
    finally:
        c.close()
    meta = SqliteMetadataStore(str(tmp_path / "meta.db"))
    assert meta.list_objects(state=ObjectState.PREPARED) == []
    meta.close()


def test_a_partition_open_is_one_metadata_write(tmp_path):
    """A partition closed on node 1 opens on node 2 with one metadata write (its streams opened
    together) besides reads; the older checkpoints are trimmed only every few moves."""
    one, two = two_nodes(tmp_path)
    writes = ("open_streams", "open_stream", "create_stream", "trim_stream", "commit", "close_stream",
              "reserve_offsets", "prepare_objects", "put_kv", "put_kv_if_absent")
    try:
        p = open_partition(one, "p")
        p.append(RecordBatch(b"r0", 1)).result(10)
        p.close(timeout=10)
        calls: list[str] = []
        meta = two.metadata
        for name in writes:
            real = getattr(meta, name)
            setattr(meta, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
        try:
            q = open_partition(two, "p")
        finally:
            for name in writes:
                delattr(meta, name)
        assert calls == ["open_streams"]
        assert q.checkpoint.leader_epoch == 2 and q.log.next_offset == 1
        for i in range(6):                                 # moves back and forth: the meta stream stays short
            q.close(timeout=10)
            q = open_partition((one if i % 2 == 0 else two), "p")
        assert q.meta_stream.confirm_offset - q.meta_stream.start_offset <= 8
    finally:
        one.close()
        two.close()


def test_a_hinted_open_reads_one_key_and_a_stale_hint_still_opens_the_newest_checkpoint(tmp_path, monkeypatch):
    """A close asked to record itself writes closed/<name> in its commit, with the open hint:
    the next hinted open reads that key and opens the streams, reading no checkpoint back. A
    hint left stale by a later open and a close that recorded nothing still opens at the
    newest checkpoint (it is read from the meta stream)."""
    import json
    from s3stream.cluster import partition as P
    one, two = two_nodes(tmp_path)
    try:
        p = open_partition(one, "p")
        p.append(RecordBatch(b"r0", 1)).result(10)
        report = p.close(timeout=10, record={"version": 3})
        stored = json.loads(one.metadata.get_kv("closed/p"))
        assert stored == report.record and stored["version"] == 3 and stored["tail_bytes"] == report.tail_bytes > 0
        assert stored["hint"]["meta"] == p.meta_stream.stream_id
        reads: list[str] = []
        meta = two.metadata
        names = ("get_kv", "get_stream", "list_objects", "get_objects")
        for name in names:
            real = getattr(meta, name, None)
            if real is not None:
                setattr(meta, name, lambda *a, _real=real, _name=name, **k: (reads.append(_name), _real(*a, **k))[1])

        def no_read_back(*a, **k):
            raise AssertionError("the hinted open read the checkpoint back")
        try:
            with monkeypatch.context() as m:
                m.setattr(P, "_committed_checkpoint", no_read_back)
                m.setattr(P, "_last_checkpoint", no_read_back)
                q = open_partition(two, "p", hinted=True)
        finally:
            for name in names:
                meta.__dict__.pop(name, None)
        assert reads == ["get_kv"]
        assert q.checkpoint.leader_epoch == 2 and q.log.next_offset == 1
        q.append(RecordBatch(b"r1", 1)).result(10)
        q.close(timeout=10)                          # no record: closed/p still holds the first close's hint
        q = open_partition(one, "p", hinted=True)     # the hint's epochs are stale: read the newest checkpoint
        assert q.checkpoint.leader_epoch == 3 and q.log.next_offset == 2
        assert [bytes(b.payload) for b in q.log.fetch(0, 2).batches] == [b"r0", b"r1"]
    finally:
        one.close()
        two.close()


def test_an_open_for_a_newer_assignment_waits_for_the_source_without_locking(tmp_path):
    """An agent tries to open a partition as soon as it is assigned there, usually before the
    source's close. While the last close's record is of an older assignment version and the
    source holds the partition, the open reads the meta stream's state and raises
    StreamNotClosedError: no open transaction (whose row locks the source's close commit would
    wait for). Once the source closed for this version, it opens from the hint as before."""
    from s3stream.errors import StreamNotClosedError
    one, two = two_nodes(tmp_path)
    try:
        p = open_partition(one, "p")
        p.append(RecordBatch(b"r0", 1)).result(10)
        p.close(timeout=10, record={"version": 1})
        p = open_partition(one, "p", hinted=True, version=2)    # moved back to node 1 at version 2
        p.append(RecordBatch(b"r1", 1)).result(10)
        calls: list[str] = []
        meta = two.metadata
        for name in ("open_streams", "get_stream"):
            real = getattr(meta, name)
            setattr(meta, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
        try:
            with pytest.raises(StreamNotClosedError, match="open on node 1"):
                open_partition(two, "p", hinted=True, version=3)
            assert calls == ["get_stream"]
            p.close(timeout=10, record={"version": 3})
            calls.clear()
            q = open_partition(two, "p", hinted=True, version=3)
            assert calls == ["open_streams"]
        finally:
            for name in ("open_streams", "get_stream"):
                meta.__dict__.pop(name, None)
        assert [bytes(b.payload) for b in q.log.fetch(0, 2).batches] == [b"r0", b"r1"]
    finally:
        one.close()
        two.close()


def test_blocks_submitted_out_of_order_commit_in_block_order(tmp_path):
    """A seal and its submit are two steps: a block sealed later (here by hand; in the engine by
    an appender, a close, the WAL pressure or the age timer racing each other) may reach the
    uploader first. It waits for the older block, so the stream's ranges commit in order;
    committed first, it would leave a gap that the metadata store refuses for good (uploads
    stopped, the node failed over: seen at saturation in the migration bench)."""
    c = client(tmp_path, f"file://{tmp_path}/objects")
    try:
        s = c.create_stream()
        payloads = [os.urandom(1000) for _ in range(4)]
        blocks = []
        for pair in (payloads[:2], payloads[2:]):
            for p in pair:
                s.append(RecordBatch(p, 1)).result(10)
            blocks.append(c._cache.seal())
        older, newer = blocks
        assert newer.block_id == older.block_id + 1
        c._uploader.submit(newer)
        time.sleep(0.3)                # the uploader would start (and try to commit) it now
        assert c.metadata.get_stream(s.stream_id).end_offset == 0
        c._uploader.submit(older)
        c._uploader.wait_committed(newer.block_id, timeout=10)
        assert c._uploader.failure is None and c._uploader.retrying is None
        assert read_stream(c, s.stream_id) == list(enumerate(payloads))
    finally:
        c.close()


def test_a_block_waits_for_the_closes_announced_before_it_and_no_later_one():
    """The commit gate: a block's commit that arrives while close A is announced waits for A
    (A's commit goes first), but a close B announced after the block arrived does not hold it
    back, so closes one after another cannot starve the blocks' commits."""
    from s3stream.engine.upload import _CommitGate
    gate = _CommitGate()
    took: list[str] = []
    a = gate.close_coming()
    a.__enter__()

    def commit_block() -> None:
        with gate.for_block(30.0):
            took.append("block")

    block = threading.Thread(target=commit_block)
    block.start()
    time.sleep(0.1)
    assert not took                         # A announced before the block came: the block waits
    b = gate.close_coming()
    b.__enter__()                           # B announced after the block came
    a.__exit__(None, None, None)
    block.join(5.0)
    assert took == ["block"], "the block waited for a close announced after it"
    b.__exit__(None, None, None)
