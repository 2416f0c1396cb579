"""Batched opens (issue 53): many partitions open with a bounded number of metadata transactions,
one failing partition does not stop the others, and a node's recovery closes its streams in a few
commits. Over both metadata stores."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from s3stream import RecordBatch, S3StreamError, StreamClient, StreamNotClosedError
from s3stream.cluster import (Cluster, ClusterConfig, NodeAgent, open_partition, open_partitions, partition_on,
                              partitions_on)
from s3stream.cluster.partition import CloseReport, close_partitions
from s3stream.cluster.partition import closed_key
from s3stream.engine import recovery
from s3stream.metadata import StreamState, open_metadata
from conftest import small_config

#: Metadata writes: what a batch's cost is counted in.
WRITES = ("open_streams", "open_stream", "create_stream", "create_streams", "trim_stream", "commit", "close_stream",
          "reserve_offsets", "prepare_objects", "put_kv", "put_kvs", "put_kv_if_absent", "replace_kv", "replace_kvs",
          "delete_stream")


def nodes(tmp_path, metadata_url, ids=(1, 2)):
    store = f"file://{tmp_path}/objects"
    return [StreamClient(n, tmp_path / f"n{n}.wal", store, metadata_url, small_config()) for n in ids]


class Calls:
    """Counts the calls of a client's metadata store by operation while active."""

    def __init__(self, client: StreamClient, names=WRITES + ("get_kv", "get_kvs", "get_streams", "get_stream")):
        self.meta, self.names, self.calls = client.metadata, names, []

    def __enter__(self):
        for name in self.names:
            real = getattr(self.meta, name)
            setattr(self.meta, name, lambda *a, _real=real, _name=name, **k: (self.calls.append(_name), _real(*a, **k))[1])
        return self

    def __exit__(self, *exc):
        for name in self.names:
            delattr(self.meta, name)

    def count(self, *names):
        return sum(self.calls.count(n) for n in names)


def closed_partitions(one: StreamClient, names, version=1):
    """Open `names` on `one`, append a record to each (its name), close each with its record."""
    for name in names:
        p = open_partition(one, name)
        p.append(RecordBatch(name.encode(), 1)).result(10)
        p.close(timeout=10, record=dict(node=one.node_id, version=version))


def test_a_batch_of_opens_costs_a_few_metadata_transactions(tmp_path, metadata_url):
    """Forty partitions closed by node 1 open on node 2 in one batch: ONE transaction opens all
    their streams, one read gets their close records, nothing else is written; each serves
    with its record and takes appends at the next offset."""
    one, two = nodes(tmp_path, metadata_url)
    names = [f"p{i:02d}" for i in range(40)]
    try:
        closed_partitions(one, names)
        with Calls(two) as calls:
            opened = open_partitions(two, [(name, 2) for name in names])
        assert calls.count(*WRITES) == 1 and calls.count("open_streams") == 1, calls.calls
        assert calls.count("get_kvs") == 1 and calls.count("get_kv") == 0, calls.calls
        for name in names:
            p = opened[name]
            assert p is partition_on(two, name) and p.is_open and p.checkpoint.leader_epoch == 2
            assert bytes(p.fetch(0).batches[0].payload) == name.encode()
            assert p.append(RecordBatch(b"more", 1)).result(10).base_offset == 1
            p.trim_checkpoints(10)
        again = open_partitions(two, [(name, 2) for name in names[:3]])
        assert all(again[n] is opened[n] for n in names[:3])            # open already: the same handle
    finally:
        two.close()
        one.close()


def test_a_batch_without_close_records_opens_from_committed_checkpoints_in_one_write(tmp_path, metadata_url):
    """Partitions closed without a close record (as after a failover, or a crash and a restart)
    open in a batch from their last committed checkpoints: still ONE metadata write for all."""
    one, two = nodes(tmp_path, metadata_url)
    names = [f"q{i:02d}" for i in range(12)]
    try:
        for name in names:
            p = open_partition(one, name)
            p.append(RecordBatch(name.encode(), 1)).result(10)
            p.close(timeout=10)                                  # no record: no hint
        assert two.metadata.get_kvs([closed_key(n) for n in names]) == {}
        open_partition(one, "q99").close(timeout=10)            # a committed checkpoint, then
        held = open_partition(one, "q99")                        # open on node 1 again: held there
        read, real = [], two.fetch_committed_at
        two.fetch_committed_at = lambda points: (read.extend(points), real(points))[1]
        with Calls(two) as calls:
            opened = open_partitions(two, [(name, 2) for name in names + ["q99"]])
        assert calls.count(*WRITES) == 1 and calls.count("open_streams") == 1, calls.calls
        # Every checkpoint read together, but not the one of a partition still held elsewhere.
        assert len(read) == len(names) and held.meta_stream.stream_id not in {sid for sid, _ in read}
        assert isinstance(opened["q99"], StreamNotClosedError)
        for name in names:
            assert bytes(opened[name].fetch(0).batches[0].payload) == name.encode()
            assert opened[name].append(RecordBatch(b"more", 1)).result(10).base_offset == 1
    finally:
        two.close()
        one.close()


def test_new_partitions_are_created_in_two_metadata_writes(tmp_path, metadata_url):
    """Sixty partitions that do not exist yet, opened in one batch: ONE transaction creates all
    their streams, ONE publishes their keys, nothing else is written; each serves from offset
    0, and once closed, node 2 opens them all with their records (and a checkpoint naming the
    streams created here)."""
    one, two = nodes(tmp_path, metadata_url)
    names = [f"n{i:02d}" for i in range(60)]
    try:
        with Calls(one) as calls:
            opened = open_partitions(one, [(name, 1) for name in names])
        assert calls.count(*WRITES) == 2, calls.calls
        assert calls.count("create_streams") == 1 and calls.count("replace_kvs") == 1, calls.calls
        for name in names:
            p = opened[name]
            assert p is partition_on(one, name) and p.checkpoint.leader_epoch == 1
            assert p.append(RecordBatch(name.encode(), 1)).result(10).base_offset == 0
        ids = {sid for p in opened.values() for sid in (p.meta_stream.stream_id, p.log.stream_id)}
        assert len(ids) == 2 * len(names)
        assert {s.stream_id for s in one.metadata.list_streams()} == ids
        close_partitions([opened[n] for n in names], [dict(node=1, version=1)] * len(names), timeout=10)
        again = open_partitions(two, [(name, 2) for name in names])
        for name in names:
            assert [bytes(b.payload) for b in again[name].fetch(0).batches] == [name.encode()], name
            assert again[name].log.stream_id == opened[name].log.stream_id
    finally:
        two.close()
        one.close()


def test_a_creation_another_node_won_opens_the_winner_s_partition(tmp_path, metadata_url, monkeypatch):
    """Node 2 creates "b" between node 1's read of the keys and its publish: node 1's publish
    of "b" is refused, the streams it made for "b" are destroyed, and its open of "b" is the
    one-by-one open of node 2's partition (held there: StreamNotClosedError). "a" and "c" are
    created; no stream is left that no partition names."""
    one, two = nodes(tmp_path, metadata_url)
    real = one.metadata.replace_kvs
    won = []

    def racing(items):
        if not won:
            won.append(open_partition(two, "b"))
        return real(items)

    try:
        monkeypatch.setattr(one.metadata, "replace_kvs", racing)
        opened = open_partitions(one, [(n, 1) for n in "abc"])
        assert isinstance(opened["b"], StreamNotClosedError), opened["b"]
        assert opened["a"].is_open and opened["c"].is_open and won[0].is_open
        named = {p.meta_stream.stream_id for p in (opened["a"], opened["c"], won[0])}
        named |= {p.log.stream_id for p in (opened["a"], opened["c"], won[0])}
        assert {s.stream_id for s in one.metadata.list_streams()} == named
        assert won[0].append(RecordBatch(b"b", 1)).result(10).base_offset == 0
    finally:
        two.close()
        one.close()


@pytest.mark.parametrize("failing", ["create_streams", "replace_kvs"])
def test_a_batch_creation_whose_write_fails_names_the_error_and_the_next_try_creates(tmp_path, metadata_url,
                                                                                     monkeypatch, failing):
    """The creating transaction, or the publishing one, fails (a metadata outage; for the
    publish its outcome unknown: it did write): every partition of the batch gets the error and
    none serves; the next try creates or opens each one, and each partition has one meta stream
    whichever way it went."""
    from s3stream.errors import MetadataBusyError
    one, = nodes(tmp_path, metadata_url, ids=(1,))
    names = [f"f{i}" for i in range(8)]
    real = getattr(one.metadata, failing)

    def broken(*args):
        if failing == "replace_kvs":
            real(*args)                                   # written, but the answer is lost
        raise MetadataBusyError(f"{failing}: the connection failed")

    try:
        monkeypatch.setattr(one.metadata, failing, broken)
        first = open_partitions(one, [(n, 1) for n in names])
        assert all(isinstance(first[n], MetadataBusyError) for n in names), first
        assert partitions_on(one) == []
        monkeypatch.undo()
        again = open_partitions(one, [(n, 1) for n in names])
        keys = one.metadata.get_kvs([f"partition/{n}" for n in names])
        for name in names:
            p = again[name]
            assert p.is_open and p.append(RecordBatch(name.encode(), 1)).result(10).base_offset == 0, name
            assert int(keys[f"partition/{name}"]) == p.meta_stream.stream_id
    finally:
        one.close()


def test_acknowledged_appends_to_a_created_batch_survive_a_kill_9(tmp_path, metadata_url):
    """A child process creates twenty partitions in one batch (their first checkpoints not
    waited for), appends to each and is killed (SIGKILL) once they are acknowledged: node 1,
    started again on its WAL, opens them all with every acknowledged record."""
    script = (
        "import sys\n"
        "from s3stream import RecordBatch, StreamClient\n"
        "from s3stream.cluster import open_partitions\n"
        "from conftest import small_config\n"
        f"c = StreamClient(1, {str(tmp_path / 'n1.wal')!r}, {f'file://{tmp_path}/objects'!r}, "
        f"{metadata_url!r}, small_config())\n"
        "names = [f'k{i:02d}' for i in range(20)]\n"
        "opened = open_partitions(c, [(n, 1) for n in names])\n"
        "fs = [opened[n].append(RecordBatch(n.encode() * 3, 1)) for n in names]\n"
        "[f.result(20) for f in fs]\n"
        "print('acked', flush=True)\n"
        "sys.stdin.read()\n")
    tests = str(Path(__file__).resolve().parents[1])
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                 [str(Path(tests).parent), tests, os.environ.get("PYTHONPATH", "")])))
    try:
        assert child.stdout.readline().strip() == "acked"
    finally:
        child.kill()
        child.wait()
    one, = nodes(tmp_path, metadata_url, ids=(1,))
    try:
        names = [f"k{i:02d}" for i in range(20)]
        opened = open_partitions(one, [(n, 2) for n in names])
        for name in names:
            assert [bytes(b.payload) for b in opened[name].fetch(0).batches] == [name.encode() * 3], name
    finally:
        one.close()


def test_one_partition_held_elsewhere_does_not_stop_the_batch(tmp_path, metadata_url):
    """In a batch for assignment version 2: one partition node 1 still holds (its close not
    done) gets StreamNotClosedError, one that never existed is created, one whose hint names
    a stream opened since falls back to the one-by-one open; the others open. Once node 1
    lets go, the held one opens too, and no offset holds two records."""
    one, two = nodes(tmp_path, metadata_url)
    names = [f"p{i}" for i in range(6)]
    try:
        closed_partitions(one, names)
        held = open_partition(one, "p1")                         # reopened on node 1: held there
        held.append(RecordBatch(b"held", 1)).result(10)
        wanted = [(name, 2) for name in names] + [("fresh", 2)]
        opened = open_partitions(two, wanted)
        assert isinstance(opened["p1"], StreamNotClosedError) and partition_on(two, "p1") is None
        for name in [n for n in names if n != "p1"] + ["fresh"]:
            assert opened[name].is_open, (name, opened[name])
        assert opened["fresh"].log.next_offset == 0
        held.close(timeout=10, record=dict(node=1, version=2))
        [(_, late)] = open_partitions(two, [("p1", 3)]).items()
        assert [bytes(b.payload) for b in late.fetch(0).batches] == [b"p1", b"held"]
        assert late.append(RecordBatch(b"after", 1)).result(10).base_offset == 2
    finally:
        two.close()
        one.close()


def test_a_batch_whose_shared_transaction_is_refused_opens_each_alone(tmp_path, metadata_url, monkeypatch):
    """A stream of one partition is opened elsewhere between the read of the close records and
    the shared transaction: that transaction is refused whole, so each partition opens on its
    own, and only the held one fails."""
    one, two = nodes(tmp_path, metadata_url)
    names = ["a", "b", "c"]
    try:
        closed_partitions(one, names)
        hint = json.loads(two.metadata.get_kv(closed_key("b")))["hint"]
        real = two.open_streams
        grabbed = []

        def racing(ids):
            if not grabbed:                   # node 1 takes b's meta stream back, just before
                grabbed.append(one.open_stream(int(hint["meta"])))
            return real(ids)

        monkeypatch.setattr(two, "open_streams", racing)
        opened = open_partitions(two, [(n, 2) for n in names])
        assert isinstance(opened["b"], StreamNotClosedError), opened["b"]
        assert opened["a"].is_open and opened["c"].is_open
        assert two.metadata.get_stream(int(hint["meta"])).owner_node_id == 1
    finally:
        two.close()
        one.close()


def test_a_batch_of_closes_is_one_commit_and_the_next_owner_opens_from_its_hints(tmp_path, metadata_url):
    """close_partitions: twenty partitions of node 1 close with one force upload and ONE metadata
    commit that writes their twenty close records; node 2 opens them all in one transaction
    from those hints, every acknowledged record in place."""
    one, two = nodes(tmp_path, metadata_url)
    names = [f"c{i:02d}" for i in range(20)]
    try:
        parts = [open_partition(one, name) for name in names]
        for p in parts:
            for i in range(3):
                p.append(RecordBatch(b"%s-%d" % (p.name.encode(), i), 1)).result(10)
        with Calls(one) as calls:
            reports = close_partitions(parts, [dict(node=1, version=1) for _ in parts], timeout=10)
        # Object ids may be prepared ahead on the way (a pre-allocation, not the close's).
        assert calls.count(*WRITES) - calls.count("prepare_objects") == 1 and calls.count("commit") == 1, calls.calls
        assert all(isinstance(reports[n], CloseReport) for n in names) and partition_on(one, names[0]) is None
        assert all(not p.is_open and p.close() is reports[p.name] for p in parts)
        records = two.metadata.get_kvs([closed_key(n) for n in names])
        assert len(records) == 20 and all("hint" in json.loads(r) for r in records.values())
        with Calls(two) as calls:
            opened = open_partitions(two, [(n, 2) for n in names])
        assert calls.count("open_streams") == 1 and calls.count(*WRITES) == 1, calls.calls
        for name in names:
            assert [bytes(b.payload) for b in opened[name].fetch(0).batches] == [b"%s-%d" % (name.encode(), i)
                                                                                 for i in range(3)]
    finally:
        two.close()
        one.close()


def test_a_batch_of_closes_whose_commit_fails_serves_again_and_closes_later(tmp_path, metadata_url, monkeypatch):
    """The shared commit fails: every partition of the batch serves again (takes appends at the
    next offset), and a later close of each, alone, finishes; nothing acknowledged is lost."""
    [one] = nodes(tmp_path, metadata_url, ids=(1,))
    try:
        parts = [open_partition(one, f"f{i}") for i in range(4)]
        for p in parts:
            p.append(RecordBatch(b"first", 1)).result(10)
        real = one.close_streams

        def refused(*a, **k):
            monkeypatch.setattr(one, "close_streams", real)
            raise S3StreamError("injected: the metadata store refused the commit")
        monkeypatch.setattr(one, "close_streams", refused)
        reports = close_partitions(parts, timeout=10)
        assert all(isinstance(reports[p.name], S3StreamError) for p in parts)
        for p in parts:
            assert p.is_open and p.append(RecordBatch(b"second", 1)).result(10).base_offset == 1
            p.close(timeout=10)
        for p in parts:
            q = open_partition(one, p.name)
            assert [bytes(b.payload) for b in q.fetch(0).batches] == [b"first", b"second"]
    finally:
        one.close()


CRASHING_NODE = """
import json, os, sys
from s3stream import RecordBatch, StreamClient
from conftest import small_config
c = StreamClient(1, sys.argv[1] + "/n1.wal", "file://" + sys.argv[1] + "/objects", sys.argv[2], small_config())
acked = {}
for _ in range(20):
    s = c.create_stream()
    acked[s.stream_id] = s.append(RecordBatch(b"%d" % s.stream_id, 1)).result(10).base_offset
print(json.dumps(acked), flush=True)
os._exit(0)                      # as a crash leaves it: nothing closed, the tail in the WAL only
"""


def test_recovery_closes_a_node_s_streams_in_a_few_commits(tmp_path, metadata_url, monkeypatch):
    """A node restarted on its WAL after a crash closes the streams its last incarnation held
    in commits of CLOSE_BATCH streams each, not one transaction per stream; every acknowledged
    record is readable."""
    done = subprocess.run([sys.executable, "-c", CRASHING_NODE, str(tmp_path), metadata_url],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    acked = {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    monkeypatch.setattr(recovery, "CLOSE_BATCH", 7)
    meta = open_metadata(metadata_url)
    assert all(meta.get_stream(sid).state == StreamState.OPENED for sid in acked)
    commits: list[int] = []
    real = type(meta).commit
    monkeypatch.setattr(type(meta), "commit", lambda self, request: (commits.append(len(request.closes)),
                                                                     real(self, request))[1])
    try:
        again = StreamClient(1, tmp_path / "n1.wal", f"file://{tmp_path}/objects", meta, small_config())
        try:
            assert [n for n in commits if n] == [7, 7, 6], commits
            for sid, offset in acked.items():
                m = meta.get_stream(sid)
                assert m.state == StreamState.CLOSED and m.end_offset == offset + 1
                assert bytes(again.fetch_committed(sid, offset).batches[0].payload) == b"%d" % sid
        finally:
            again.close()
    finally:
        meta.close()


def test_recovery_s_closes_list_again_when_a_stream_was_taken_since_the_replay(metadata_url):
    """A failover and a restart list the node's streams once, before the WAL's replay, for the
    replay and the closes. Should one of them be taken meanwhile (a failover of the node racing
    its restart closed it and another node opened it), the closes list again: the rest close,
    the taken one is left to its new owner, nothing raises."""
    meta = open_metadata(metadata_url)
    try:
        n1, n2 = meta.register_node(1, "w1"), meta.register_node(2, "w2")
        ids = [meta.create_stream(1, n1.node_epoch).stream_id for _ in range(3)]
        held = meta.list_streams(owner_node_id=1)
        taken = meta.get_stream(ids[0])
        meta.close_stream(ids[0], taken.epoch, 1)
        meta.open_stream(ids[0], 2, n2.node_epoch)
        assert recovery.close_node_streams(meta, 1, n1.node_epoch, held) == 2
        assert [meta.get_stream(i).state for i in ids] == [StreamState.OPENED, StreamState.CLOSED, StreamState.CLOSED]
        assert meta.get_stream(ids[0]).owner_node_id == 2
    finally:
        meta.close()


def test_a_drain_moves_a_node_s_partitions_in_batches_and_loses_nothing(tmp_path, metadata_url):
    """Cluster.drain: node 1's thirty partitions move to node 2 (its agent closes them in
    batches, node 2's opens them in batches); every acknowledged record is read there, each
    partition takes appends at the next offset, and a drain of an empty node is done at once."""
    from test_cluster import InProcessCluster
    c = InProcessCluster(tmp_path, metadata_url, nodes=(1, 2))
    names = [f"d{i:02d}" for i in range(30)]
    try:
        first = c.cluster.migrate_many({name: 1 for name in names}, timeout=30)
        assert first.done, first.waiting
        for name in names:
            partition_on(c.clients[1], name).append(RecordBatch(name.encode(), 1)).result(10)
        report = c.cluster.drain(1, timeout=30)
        assert report.done and report.moves == {name: 2 for name in names}, report
        assert c.agents[1].stats["closes"] == 30 and c.agents[1].stats["close_failures"] == 0
        for name in names:
            moved = partition_on(c.clients[2], name)
            assert moved is not None and partition_on(c.clients[1], name) is None
            assert [bytes(b.payload) for b in moved.fetch(0).batches] == [name.encode()]
            assert moved.append(RecordBatch(b"after", 1)).result(10).base_offset == 1
        assert c.cluster.drain(1).moves == {}
        with pytest.raises(S3StreamError, match="not live nodes that can serve"):
            c.cluster.migrate_many({"d00": 9})
    finally:
        c.close()


def test_a_failover_s_reassignment_moves_each_partition_once_beside_another_mover(metadata_url, monkeypatch):
    """A failover reassigns a dead node's partitions with assign_many(from_node=) while another
    node's reassign_orphans may move some of them first: those it finds moved meanwhile (its
    compare-and-set fails) are read again and left where they are, not moved a second time (a
    second move made every partition open twice after a failover of 10,000). Without
    from_node, a conflicting item is read again and written."""
    from s3stream.cluster import Cluster
    cluster = Cluster(metadata_url, None)
    try:
        names = [f"p{i}" for i in range(10)]
        cluster.assign_many({name: 1 for name in names})
        stale = cluster.meta.get_kvs([f"assignment/{name}" for name in names])
        for name in names[:5]:
            cluster.assign(name, 3)                   # the other mover got there first
        real, reads = cluster.meta.get_kvs, []

        def first_read_stale(keys):
            reads.append(len(keys))
            return {k: stale[k] for k in keys if k in stale} if len(reads) == 1 else real(keys)
        monkeypatch.setattr(cluster.meta, "get_kvs", first_read_stale)
        moved = cluster.assign_many({name: 2 for name in names}, from_node=1)
        assert set(moved) == set(names[5:]) and set(moved.values()) == {2}
        assert reads == [10, 5]                       # the five that failed, read again once
        now = cluster.assignments()
        assert [(now[n]["node"], now[n]["version"]) for n in names] == [(3, 2)] * 5 + [(2, 2)] * 5
        reads.clear()                                 # its first read stale again
        assert cluster.assign_many({name: 1 for name in names[:5]}) == {name: 3 for name in names[:5]}
        assert reads == [5, 5]                        # without from_node: read again, and written
    finally:
        cluster.close()


def test_a_failover_reassigns_all_its_node_s_partitions_in_one_write(metadata_url, monkeypatch):
    """A failover's reassignment is one metadata write however many partitions the node held
    (issue 53: in writes of 1,000, each woke every agent for a pass over all assignments while
    the opens ran), spread over the live nodes; those already moved are left alone."""
    from s3stream.cluster import Cluster
    cluster = Cluster(metadata_url, None)
    try:
        for node_id in (1, 2, 3):
            row = cluster.meta.register_node(node_id, f"/wal/{node_id}")
            cluster.meta.heartbeat(node_id, row.node_epoch)
        names = [f"p{i:04d}" for i in range(2500)]
        cluster.assign_many({name: 1 for name in names[:1200]})
        cluster.assign_many({name: 1 for name in names[1200:]})
        cluster.assign(names[0], 3)                   # moved already: stays where it is
        cluster.meta.fence_node(1)
        writes = []
        real = cluster.meta.replace_kvs
        monkeypatch.setattr(cluster.meta, "replace_kvs", lambda items: writes.append(len(items)) or real(items))
        moved, waiting = cluster._reassign_from(1)
        assert writes == [2499] and waiting == []
        assert set(moved) == set(names[1:]) and set(moved.values()) == {2, 3}
        now = cluster.assignments()
        assert {now[name]["node"] for name in names} == {2, 3} and now[names[0]]["version"] == 2
    finally:
        cluster.close()


def test_orphans_wait_for_the_failover_a_live_node_claimed(metadata_url):
    """Another node's agent leaves a fenced node's partitions to the failover a live node
    claimed, until that failover is done (its claim marked) or the claim is stale: moved
    sooner, their targets' opens would find the streams still open and retry until the
    failover closed them."""
    from s3stream.cluster import Cluster
    cluster = Cluster(metadata_url, None)
    try:
        rows = {}
        for node_id in (1, 2, 3):
            rows[node_id] = cluster.meta.register_node(node_id, f"/wal/{node_id}")
            cluster.meta.heartbeat(node_id, rows[node_id].node_epoch)
        names = [f"p{i}" for i in range(6)]
        cluster.assign_many({name: 1 for name in names})
        assert cluster.claim_failover(1, rows[1].node_epoch, 2, rows[2].node_epoch)
        cluster.meta.fence_node(1)
        assert cluster.reassign_orphans() == {}                     # node 2's failover is under way
        assert {a["node"] for a in cluster.assignments().values()} == {1}
        # Its claimant done (however the failover ended): the partitions left on node 1 move.
        cluster._end_claim(1, rows[1].node_epoch, 2, rows[2].node_epoch)
        assert set(cluster.reassign_orphans()) == set(names)
        assert {a["node"] for a in cluster.assignments().values()} == {2, 3}

        # A stale claim does not hold them either.
        cluster.assign_many({name: 3 for name in names})
        assert cluster.claim_failover(3, rows[3].node_epoch, 2, rows[2].node_epoch)
        cluster.meta.fence_node(3)
        assert cluster.reassign_orphans() == {}
        stale = cluster.clock() - int((cluster.config.heartbeat_timeout + cluster.config.migration_timeout + 1) * 1e9)
        key = f"failover/3/{rows[3].node_epoch}/0"
        cluster.meta.put_kv(key, json.dumps(dict(node=2, node_epoch=rows[2].node_epoch, at_ns=stale)).encode())
        assert set(cluster.reassign_orphans()) == set(names)
        assert {a["node"] for a in cluster.assignments().values()} == {2}
    finally:
        cluster.close()


def test_a_pass_leaves_an_open_in_flight_to_its_task(tmp_path, metadata_url):
    """An agent's pass that finds partitions still being opened for the version they are
    assigned at leaves them to the task that opens them: none is "wanted again", so the opens
    ending wake no pass (a node taking 10,000 partitions ran a pass of every assignment per
    batch that ended). One re-assigned meanwhile (a newer version) is wanted again, as before."""
    names = [f"p{i}" for i in range(4)]
    client = nodes(tmp_path, metadata_url, ids=(1,))[0]
    cluster = Cluster(metadata_url, f"file://{tmp_path}/objects", ClusterConfig(max_parallel_moves=2))
    agent = NodeAgent(client, cluster, start=False)
    gate, entered = threading.Event(), threading.Semaphore(0)
    real = agent._open_batch

    def held(batch):
        entered.release()
        assert gate.wait(30), "the test never opened the gate"
        return real(batch)

    agent._open_batch = held                                  # type: ignore[method-assign]
    wakes = []
    real_wake = agent._feed.wake
    agent._feed.wake = lambda: (wakes.append(1), real_wake())[1]   # type: ignore[method-assign]
    try:
        cluster.assign_many({name: 1 for name in names})
        agent.reconcile_once()
        for _ in range(2):                                    # 4 partitions: 2 batches of 2
            assert entered.acquire(timeout=30)
        agent.reconcile_once()                                # the same versions, still opening
        assert agent._wanted_while_busy == set() and set(agent._opening) == set(names)
        cluster.assign("p0", 1)                               # a newer version of one of them
        agent.reconcile_once()
        assert agent._wanted_while_busy == {"p0"}
        gate.set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (agent._busy or len(partitions_on(client)) < 4):
            time.sleep(0.01)
        assert not agent._busy and not agent._opening and len(partitions_on(client)) == 4
        assert len(wakes) == 1                                # p0's, wanted again; the others none
    finally:
        gate.set()
        agent.stop()
        client.close()
        cluster.close()
