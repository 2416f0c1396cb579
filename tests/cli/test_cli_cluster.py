"""`s3stream streams`, `migrate` and `node fail-over` as a new user meets them (issue 50, item 8):
the state shown is the metadata's truth (streams, history), not a stale record; a dead node is
failed over by a command, once; a live one is not, unless forced. Over both metadata stores,
with real clients and agents in this process."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from s3stream import RecordBatch, StreamClient
from s3stream.cluster import Cluster, ClusterConfig, NodeAgent, partition_on
from s3stream.metadata import open_metadata
from s3stream.metadata.base import WALLESS
from s3stream.objectstore import LocalObjectStore
from cli_helpers import fails, ok, run
from conftest import small_config
from test_engine_model import crash

FAST = ClusterConfig(agent_interval=0.01, heartbeat_interval=0.1, heartbeat_timeout=1.0, migration_timeout=5.0,
                     auto_failover=False)


def wait_for(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class Nodes:
    """Nodes with agents in this process; `where` are the --meta and --store options."""

    def __init__(self, tmp: Path, meta_url: str) -> None:
        self.tmp, self.meta_url, self.store_url = tmp, meta_url, f"file://{tmp}/objects"
        self.meta = open_metadata(meta_url)
        self.cluster = Cluster(self.meta, LocalObjectStore(str(tmp / "objects")), FAST, small_config())
        self.clients: dict[int, StreamClient] = {}
        self.agents: dict[int, NodeAgent] = {}
        self.where = ("--meta", meta_url, "--store", self.store_url)

    def start(self, n: int, wal_path=None) -> StreamClient:
        client = StreamClient(n, wal_path or self.tmp / f"n{n}.wal", self.store_url, self.meta_url, small_config())
        self.clients[n] = client
        self.agents[n] = NodeAgent(client, self.cluster)
        return client

    def open_on(self, name: str, n: int) -> None:
        self.cluster.assign(name, n)
        wait_for(lambda: self.cluster.owner(name) == n, what=f"node {n} opens {name}")

    def kill(self, n: int) -> None:
        """Node n dies as a kill -9 leaves it: silent, its WAL file as it was."""
        self.agents.pop(n).stop()
        crash(self.clients.pop(n))

    def close(self) -> None:
        for agent in self.agents.values():
            agent.stop()
        for client in self.clients.values():
            client.close()
        self.meta.close()


@pytest.fixture
def nodes(tmp_path, metadata_url):
    cluster = Nodes(tmp_path, metadata_url)
    yield cluster
    cluster.close()


# ---- streams: the truth ------------------------------------------------------------------------------

def test_streams_shows_what_is_true_after_clean_closes_and_failovers(nodes):
    """Partitions open nowhere once their nodes closed cleanly (not "open on 1" from the last
    opened/ record); closed nodes as closed, a retired one as retired and a failed-over one
    with the reason its failover recorded (not "serving yes" from their last heartbeat)."""
    for n in (1, 2, 3):
        nodes.start(n)
    nodes.open_on("p", 1)
    nodes.open_on("q", 2)
    nodes.open_on("r", 3)
    partition_on(nodes.clients[3], "r").append(RecordBatch(b"x", 1)).result(10)
    nodes.kill(3)
    ok(run("node", "fail-over", "3", *nodes.where, "--heartbeat-timeout", "0.5", "--reason", "host 3 burned"))
    for n in (1, 2):
        nodes.agents.pop(n).stop()
    nodes.clients.pop(1).close()
    nodes.clients.pop(2).close(retire=True)
    data = json.loads(ok(run("streams", "--meta", nodes.meta_url, "--json", "--heartbeat-timeout", "0.001")))
    parts = {p["name"]: p for p in data["partitions"]}
    assert {name: (p["open_on"], p["state"]) for name, p in parts.items()} == {
        "p": (None, "closed"), "q": (None, "closed"), "r": (None, "closed")}
    state = {n["node_id"]: (n["state"], n["serving"]) for n in data["nodes"]}
    assert state == {1: ("closed", False), 2: ("retired", False), 3: ("failed over", False)}
    [three] = [n for n in data["nodes"] if n["node_id"] == 3]
    assert "host 3 burned" in three["why"]
    text = ok(run("streams", "--meta", nodes.meta_url, "--heartbeat-timeout", "0.001"))
    assert "failed over" in text and "host 3 burned" in text and "retired" in text
    assert "serving" not in text.split("Nodes")[1]


def test_streams_shows_a_partition_open_where_its_streams_are(nodes):
    nodes.start(1)
    nodes.open_on("p", 1)
    data = json.loads(ok(run("streams", "--meta", nodes.meta_url, "--json")))
    [p] = data["partitions"]
    assert (p["open_on"], p["state"], p["assigned_node"]) == (1, "open", 1)
    assert [(n["node_id"], n["state"], n["serving"], n["open_streams"]) for n in data["nodes"]] == [
        (1, "serving", True, 2)]


# ---- node fail-over ----------------------------------------------------------------------------------

def test_fail_over_a_dead_node_replays_its_wal_once(nodes):
    """Node 1 dies with records only in its WAL: `node fail-over 1` (it watches node 1's
    silence first) replays them, prints what it replayed per stream, moves its partition to the
    live node 2 and records why; a second run changes nothing and says what the first did."""
    nodes.start(1)
    nodes.start(2)
    nodes.open_on("p", 1)
    partition = partition_on(nodes.clients[1], "p")
    log_id = partition.log.stream_id
    acked = [partition.append(RecordBatch(b"r%d" % i, 1)).result(10).base_offset for i in range(20)]
    assert nodes.meta.get_stream(log_id).end_offset == 0                # all only in the WAL
    nodes.kill(1)
    out = ok(run("node", "fail-over", "1", *nodes.where, "--heartbeat-timeout", "1", "--reason", "host 1 is gone"))
    assert "Failed node 1 over" in out and "partition 'p' -> node 2" in out
    [row] = [line for line in out.splitlines() if line.startswith(f"  {log_id} ")]
    assert "[0, 20)" in row and row.split()[-1] == "20"                 # the log's 20 offsets replayed
    [entry] = nodes.cluster.failover_history()
    assert (entry["kind"], entry["node"], entry["ok"]) == ("failover", 1, True)
    assert "host 1 is gone" in entry["reason"] and "no heartbeat for" in entry["reason"]
    assert {(s["stream_id"], s["committed_end"], s["end"]) for s in entry["streams"]} >= {(log_id, 0, 20)}
    wait_for(lambda: nodes.cluster.owner("p") == 2, what="node 2 opens p")
    moved = partition_on(nodes.clients[2], "p")
    assert [bytes(b.payload) for b in moved.fetch(0, 20, 1 << 20).batches] == [b"r%d" % i for i in acked]
    epoch = nodes.meta.get_node(1).node_epoch
    again = ok(run("node", "fail-over", "1", *nodes.where, "--heartbeat-timeout", "1"))
    assert "already failed over" in again and "nothing changed" in again and "host 1 is gone" in again
    assert any(line.startswith(f"  {log_id} ") and "[0, 20)" in line for line in again.splitlines())
    assert nodes.meta.get_node(1).node_epoch == epoch and len(nodes.cluster.failover_history()) == 1


def test_fail_over_refuses_a_live_node_unless_forced(nodes):
    nodes.start(1)
    nodes.start(2)
    nodes.open_on("p", 1)
    partition_on(nodes.clients[1], "p").append(RecordBatch(b"acknowledged", 1)).result(10)
    epoch = nodes.meta.get_node(1).node_epoch
    fails(run("node", "fail-over", "1", *nodes.where, "--heartbeat-timeout", "1"), 1, "node 1 is alive",
          "--force")
    assert nodes.meta.get_node(1).node_epoch == epoch and not nodes.meta.get_node(1).failover
    assert nodes.cluster.failover_history() == []
    assert partition_on(nodes.clients[1], "p").append(RecordBatch(b"still", 1)).result(10).base_offset == 1
    out = ok(run("node", "fail-over", "1", *nodes.where, "--heartbeat-timeout", "1", "--force"))
    assert "forced" in out and "partition 'p' -> node 2" in out
    [entry] = nodes.cluster.failover_history()
    assert (entry["kind"], entry["node"]) == ("forced-failover", 1)
    wait_for(lambda: nodes.cluster.owner("p") == 2, what="node 2 opens p")
    assert [bytes(b.payload) for b in partition_on(nodes.clients[2], "p").fetch(0, 2).batches] == [b"acknowledged",
                                                                                               b"still"]


def test_fail_over_refuses_what_cannot_work(nodes, tmp_path):
    nodes.start(1)
    nodes.kill(1)
    fails(run("node", "fail-over", "9", *nodes.where), 1, "node 9 is not registered")
    fails(run("node", "fail-over", "1", *nodes.where, "--wal", tmp_path / "elsewhere.wal"), 1,
          "not reachable from this host", "forget 1 --wal-lost")
    fails(run("node", "fail-over", "1", "--meta", nodes.meta_url), 2, "Missing option '--store'")
    nodes.meta.register_node(7, WALLESS + "spark sink committer")
    fails(run("node", "fail-over", "7", *nodes.where), 1, "node 7 is a writer without a WAL")
    assert nodes.cluster.failover_history() == [] and not nodes.meta.get_node(1).failover   # nothing changed
    assert not nodes.meta.get_node(7).failover


def test_fail_over_a_node_whose_wal_is_objects(nodes, tmp_path):
    """A node with its WAL on the store, silent (it never ran an agent): the command reads the
    WAL from the store by its registered URL."""
    client = StreamClient(1, f"objects+file://{tmp_path}/wal", nodes.store_url, nodes.meta_url, small_config())
    try:
        stream = client.create_stream()
        for i in range(10):
            stream.append(RecordBatch(b"w%d" % i, 1)).result(10)
        data = json.loads(ok(run("node", "fail-over", "1", *nodes.where, "--heartbeat-timeout", "0.5", "--json")))
        assert data["report"]["replayed"] == 10 and not data["already"]
        assert [(s["stream_id"], s["committed_end"], s["end"]) for s in data["report"]["streams"]] == [
            (stream.stream_id, 0, 10)]
    finally:
        client.close()
    with StreamClient(2, tmp_path / "n2.wal", nodes.store_url, nodes.meta_url, small_config()) as reader:
        assert [bytes(b.payload) for b in reader.open_stream(stream.stream_id).fetch(0, 10).batches] == [
            b"w%d" % i for i in range(10)]


# ---- node drain ----------------------------------------------------------------------------------------

def test_drain_moves_a_node_s_partitions_to_the_other_live_nodes(nodes):
    """`node drain` moves every partition of a node to the other live nodes, evenly, and
    returns once they serve them; the records stay readable there. Refused: an unknown node,
    a target that is not live. A node with nothing assigned has nothing to drain."""
    for n in (1, 2, 3):
        nodes.start(n)
    names = [f"d{i}" for i in range(6)]
    for name in names:
        nodes.open_on(name, 1)
        partition_on(nodes.clients[1], name).append(RecordBatch(name.encode(), 1)).result(10)
    meta = ("--meta", nodes.meta_url)
    fails(run("node", "drain", "9", *meta), 1, "node 9 is not registered")
    fails(run("node", "drain", "1", *meta, "--to", "9"), 1, "not live nodes that can serve")
    fails(run("node", "drain", "1", *meta, "--to", "2", "--to", "1"), 1, "--to 1 is the node being drained")
    assert {a["node"] for a in nodes.cluster.assignments().values()} == {1}
    data = json.loads(ok(run("node", "drain", "1", *meta, "--json")))
    assert data["moved"] == 6 and data["targets"] == {"2": 3, "3": 3} and data["done"] and data["waiting"] == []
    for name in names:
        owner = nodes.cluster.owner(name)
        assert owner in (2, 3) and partition_on(nodes.clients[1], name) is None
        assert partition_on(nodes.clients[owner], name).fetch(0, 1).batches[0].payload == name.encode()
    assert "nothing to drain" in ok(run("node", "drain", "1", *meta))
    out = ok(run("node", "drain", "2", *meta, "--to", "3", "--limit", "2"))
    assert "drained node 2: 2 partitions (2 to node 3)" in out
    assert sum(a["node"] == 3 for a in nodes.cluster.assignments().values()) == 5


# ---- migrate -------------------------------------------------------------------------------------------

def test_migrate_does_not_fence_a_source_that_is_alive(nodes):
    """Node 1's agent stopped (its lease keeper still heartbeats) and it keeps the partition:
    `migrate` fails naming it and the command that would take it, and fences nobody."""
    nodes.start(1)
    nodes.start(2)
    nodes.open_on("p", 1)
    nodes.agents[1].stop()
    epoch = nodes.meta.get_node(1).node_epoch
    fails(run("migrate", "p", "2", *nodes.where, "--timeout", "1", "--heartbeat-timeout", "1"), 1,
          "node 1 still holds it and is alive", "s3stream node fail-over 1 --force")
    assert nodes.meta.get_node(1).node_epoch == epoch and nodes.cluster.failover_history() == []
    assert partition_on(nodes.clients[1], "p").append(RecordBatch(b"x", 1)).result(10).base_offset == 0
    nodes.agents.pop(1)


def test_migrate_fails_over_a_source_that_is_silent(nodes):
    nodes.start(1)
    nodes.start(2)
    nodes.open_on("p", 1)
    partition_on(nodes.clients[1], "p").append(RecordBatch(b"acknowledged", 1)).result(10)
    nodes.kill(1)
    data = json.loads(ok(run("migrate", "p", "2", *nodes.where, "--timeout", "1", "--heartbeat-timeout", "1",
                             "--json")))
    assert data["failed_over"] and (data["source"], data["target"]) == (1, 2)
    assert partition_on(nodes.clients[2], "p").fetch(0, 1).batches[0].payload == b"acknowledged"
    [entry] = nodes.cluster.failover_history()
    assert entry["kind"] == "migration-fallback"
