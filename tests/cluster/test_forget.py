"""A way back from a lost host (issue 26, item 4): offset reservations bound what a node may
acknowledge, and `node forget --wal-lost` resumes its streams above them, over both metadata
stores."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from s3stream import OffsetsLostError, RecordBatch, StreamClient, StreamFencedError
from s3stream.cluster import Cluster, ClusterConfig, NodeAgent, open_partition
from s3stream.metadata import StreamState, open_metadata
from cli_helpers import ok, run
from conftest import small_config
from test_engine_model import crash

FAST = ClusterConfig(agent_interval=0.01, heartbeat_interval=0.1, heartbeat_timeout=1.0)


def node(tmp_path, n, metadata_url, **config):
    return StreamClient(n, tmp_path / f"n{n}.wal", f"file://{tmp_path}/objects", metadata_url, small_config(**config))


# ---- reservations in the engine ------------------------------------------------------------------

def test_appends_stay_within_the_reservation_which_grows_ahead(tmp_path, metadata_url):
    client = node(tmp_path, 1, metadata_url, offset_reservation=64)
    try:
        stream = client.create_stream()
        assert stream.reserved_end == 64
        for i in range(500):
            stream.append(RecordBatch(b"r%d" % i, 1)).result(10)
            assert stream.next_offset <= client.metadata.get_stream(stream.stream_id).reserved_end
        # Counts larger than the reservation: reserved before the append takes the offsets.
        stream.append(RecordBatch(b"big", 1000)).result(10)
        assert client.metadata.get_stream(stream.stream_id).reserved_end >= stream.next_offset == 1500
    finally:
        client.close()


def test_an_append_that_cannot_reserve_fails_without_an_offset(tmp_path, metadata_url):
    """Once the node is fenced its reservation is frozen: appends go on only below it (until the
    fence reaches the client), and the one that would pass it fails without taking an offset."""
    client = node(tmp_path, 1, metadata_url, offset_reservation=16)
    try:
        stream = client.create_stream()
        for i in range(16):
            stream.append(RecordBatch(b"x", 1)).result(10)
        with open_metadata(metadata_url) as other:
            other.fence_node(1)                       # another instance took over: no more reservations
            frozen = other.get_stream(stream.stream_id).reserved_end
        taken = []
        with pytest.raises(StreamFencedError):
            for _ in range(1000):
                taken.append(stream.append(RecordBatch(b"y", 1)).base_offset)
        assert stream.next_offset <= frozen and all(o < frozen for o in taken)
    finally:
        client.close()


# ---- forget ------------------------------------------------------------------------------------

def test_forget_resumes_above_everything_the_lost_node_acknowledged(tmp_path, metadata_url):
    """Node 1 acknowledges records, some uploaded, some only in its WAL; its host dies with the
    WAL. `forget` closes its streams above its reservation: node 2 opens the partition, its
    appends take offsets above every one node 1 acknowledged, committed records still read,
    the given-up ones raise OffsetsLostError, and the history says what was given up."""
    n1 = node(tmp_path, 1, metadata_url, offset_reservation=1000)
    part = open_partition(n1, "orders")
    log_id = part.log.stream_id
    acked = {}
    for i in range(50):                             # 1.5 MiB: past the 1 MiB upload threshold
        payload = b"up-%d-" % i + bytes(30_000)
        acked[part.append(RecordBatch(payload, 1)).result(10).base_offset] = payload
    # Up: the first 50 and the partition's checkpoint (a stream of its own, left in the active
    # block when the log's slice is cut at the split size).
    n1.force_upload(30)
    for i in range(50, 80):                         # these stay only in the WAL
        acked[part.append(RecordBatch(b"wal-%d" % i, 1)).result(10).base_offset] = b"wal-%d" % i
    committed = n1.metadata.get_stream(log_id).end_offset
    assert 0 < committed < 80
    crash(n1)
    os.remove(tmp_path / "n1.wal")                  # the host died with its disk

    n2 = node(tmp_path, 2, metadata_url)
    meta = open_metadata(metadata_url)
    try:
        cluster = Cluster(meta, None)
        meta.heartbeat(2, n2.node_epoch)
        cluster.assign("orders", 1)
        report = cluster.forget(1, wal_lost=True)
        by_stream = {f.stream_id: f for f in report.streams}
        assert by_stream[log_id].committed_end == committed
        assert by_stream[log_id].given_up_end >= max(acked) + 1 == 80
        assert report.reassigned == {"orders": 2}
        [entry] = cluster.failover_history()
        assert entry["kind"] == "forget" and entry["node"] == 1 and entry["ok"]
        assert {s["stream_id"] for s in entry["streams"]} == set(by_stream)

        moved = open_partition(n2, "orders")           # its checkpoint survives (a committed one)
        assert moved.log.stream_id == log_id
        new = moved.append(RecordBatch(b"after", 1)).result(10).base_offset
        assert new >= by_stream[log_id].given_up_end > max(acked)
        for offset in range(committed):
            assert bytes(moved.fetch(offset, offset + 1).batches[0].payload) == acked[offset]
        with pytest.raises(OffsetsLostError) as lost:
            moved.fetch(committed, committed + 1)
        assert (lost.value.start, lost.value.end) == (committed, by_stream[log_id].given_up_end)
        assert bytes(moved.fetch(new, new + 1).batches[0].payload) == b"after"
    finally:
        meta.close()
        n2.close()


def test_a_forgotten_node_that_is_alive_stops_and_its_offsets_are_never_reused(tmp_path, metadata_url):
    """`forget` of a node that is in fact alive (its WAL was thought lost): fenced, it can
    neither commit nor reserve; whatever it still acknowledges lies below the offsets its
    successor starts at."""
    n1 = node(tmp_path, 1, metadata_url, offset_reservation=100)
    stream = n1.create_stream()
    for i in range(10):
        stream.append(RecordBatch(b"a%d" % i, 1)).result(10)
    with open_metadata(metadata_url) as meta:
        report = Cluster(meta, None).forget(1, wal_lost=True)
    [gone] = report.streams
    late = []
    for i in range(200):
        try:
            late.append(stream.append(RecordBatch(b"late", 1)).result(10).base_offset)
        except StreamFencedError:
            break
    assert late and max(late) < gone.given_up_end        # acknowledged only within the reservation
    n2 = node(tmp_path, 2, metadata_url)
    try:
        reopened = n2.open_stream(stream.stream_id)
        assert reopened.append(RecordBatch(b"b", 1)).result(10).base_offset == gone.given_up_end
    finally:
        n2.close()
        n1.close()


def test_forget_cli_prints_what_is_given_up(tmp_path):
    url = f"sqlite:///{tmp_path}/meta.db"
    n1 = node(tmp_path, 1, url, offset_reservation=500)
    s = n1.create_stream()
    s.append(RecordBatch(b"x", 3)).result(10)
    crash(n1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    refused = subprocess.run([sys.executable, "-m", "s3stream", "node", "forget", "1", "--meta", url],
                             capture_output=True, text=True, env=env)
    assert refused.returncode != 0 and "--wal-lost" in refused.stderr
    done = subprocess.run([sys.executable, "-m", "s3stream", "node", "forget", "1", "--wal-lost", "--meta", url,
                           "--json"], capture_output=True, text=True, env=env, check=True)
    [stream] = json.loads(done.stdout)["streams"]
    assert (stream["stream_id"], stream["committed_end"], stream["given_up_end"]) == (s.stream_id, 0, 500)
    listed = subprocess.run([sys.executable, "-m", "s3stream", "node", "history", "--meta", url],
                            capture_output=True, text=True, env=env, check=True)
    assert "forget" in listed.stdout and "its host and WAL were lost" in listed.stdout


# ---- issue 50, item 5: the forget happened, says what it gave up, and happens once ----------------

def _lost_node_with_a_partition(tmp_path, metadata_url):
    """Node 1 served partition `orders` (assigned to it) and died with its WAL; nobody else runs."""
    n1 = node(tmp_path, 1, metadata_url, offset_reservation=1000)
    part = open_partition(n1, "orders")
    for i in range(30):
        part.append(RecordBatch(b"r%d" % i, 1)).result(10)
    ids = {part.meta_stream.stream_id, *(s.stream_id for s in part.streams.values())}
    crash(n1)
    os.remove(tmp_path / "n1.wal")
    return ids


def test_forget_with_no_live_node_happens_and_its_partitions_wait(tmp_path, metadata_url):
    """No live node can take the partition: the forget still happens (fenced, streams closed
    above the reservation, recorded) and says the partition waits, assigned to the forgotten
    node, which it stays until a node runs its agent: that node takes it by itself."""
    ids = _lost_node_with_a_partition(tmp_path, metadata_url)
    meta = open_metadata(metadata_url)
    n2 = None
    try:
        cluster = Cluster(meta, None, FAST)
        cluster.assign("orders", 1)
        report = cluster.forget(1, wal_lost=True)
        assert not report.already and report.reassigned == {} and report.waiting == ["orders"]
        assert {f.stream_id for f in report.streams} == ids
        assert sum(f.given_up for f in report.streams) > 0
        assert all(meta.get_stream(i).state == StreamState.CLOSED for i in ids)
        [entry] = cluster.failover_history()
        assert entry["kind"] == "forget" and entry["ok"] and entry["waiting"] == ["orders"]
        assert cluster.assignment("orders")["node"] == 1
        n2 = node(tmp_path, 2, metadata_url)
        agent = NodeAgent(n2, Cluster(meta, None, FAST))
        try:
            deadline = time.monotonic() + 20
            while cluster.owner("orders") != 2:
                assert time.monotonic() < deadline, "node 2 did not take the waiting partition"
                time.sleep(0.02)
        finally:
            agent.stop()
    finally:
        if n2 is not None:
            n2.close()
        meta.close()


def test_forget_twice_changes_nothing_and_reports_the_first(tmp_path, metadata_url):
    ids = _lost_node_with_a_partition(tmp_path, metadata_url)
    meta = open_metadata(metadata_url)
    try:
        cluster = Cluster(meta, None, FAST)
        first = cluster.forget(1, wal_lost=True)
        epoch = meta.get_node(1).node_epoch
        again = cluster.forget(1, wal_lost=True)
        assert again.already and not first.already
        assert meta.get_node(1).node_epoch == epoch == first.fenced_epoch == again.fenced_epoch   # not fenced again
        assert len(cluster.failover_history()) == 1                   # no second row
        assert [(f.stream_id, f.committed_end, f.given_up_end) for f in again.streams] == \
            [(f.stream_id, f.committed_end, f.given_up_end) for f in first.streams]
        assert {f.stream_id for f in again.streams} == ids
    finally:
        meta.close()


def test_forget_cli_succeeds_prints_each_stream_and_is_idempotent(tmp_path, metadata_url):
    """`node forget` with no live node: exit 0, the offsets given up per stream and what happens
    to the partition; a second run exits 0 saying it was already forgotten, with the first
    run's figures, and records nothing more."""
    ids = _lost_node_with_a_partition(tmp_path, metadata_url)
    with open_metadata(metadata_url) as meta:
        Cluster(meta, None).assign("orders", 1)
    done = run("node", "forget", "1", "--wal-lost", "--meta", metadata_url)
    out = ok(done)
    assert "Forgot node 1" in out and "offsets given up" in out
    for stream_id in ids:
        assert f"\n  {stream_id} " in out                             # a row per stream
    assert "partition 'orders' waits" in out and "stays assigned to node 1" in out and "NodeAgent" in out
    first = json.loads(ok(run("node", "history", "--meta", metadata_url, "--json")))
    again = run("node", "forget", "1", "--wal-lost", "--meta", metadata_url)
    out2 = ok(again)
    assert "already forgotten" in out2 and "nothing changed" in out2
    for stream_id in ids:
        assert f"\n  {stream_id} " in out2
    as_json = json.loads(ok(run("node", "forget", "1", "--wal-lost", "--meta", metadata_url, "--json")))
    assert as_json["already"] and {s["stream_id"] for s in as_json["streams"]} == ids
    assert json.loads(ok(run("node", "history", "--meta", metadata_url, "--json"))) == first
