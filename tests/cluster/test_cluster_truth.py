"""Close and migrate say only what happened; liveness means able to serve (issue 32, items 1-3),
over both metadata stores, with real clients in one process."""
from __future__ import annotations

import dataclasses
import json
import time

import pytest

from s3stream import RecordBatch, StreamClient
from s3stream.cluster import Cluster, ClusterConfig, NodeAgent, PartitionMovedError, open_partition, partition_on
from s3stream.errors import (ConfigError, NodeAliveError, ObjectStorePermanentError, OperationTimeoutError,
                             S3StreamError)
from s3stream.metadata import StreamState, open_metadata
from s3stream.objectstore import FaultInjectingObjectStore, LocalObjectStore
from conftest import small_config
from test_engine_model import crash

pytestmark = pytest.mark.slow    # the whole module: soaks, campaigns, fault runs or Spark (README: quick tier)

FAST = ClusterConfig(agent_interval=0.01, heartbeat_interval=0.1, heartbeat_timeout=1.0, migration_timeout=3.0,
                     open_attempts=3)


def wait_for(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def faulty(tmp_path):
    return FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))


def test_a_failed_close_serves_again_and_a_second_close_finishes(tmp_path, metadata_url, faulty):
    client = StreamClient(1, tmp_path / "n1.wal", faulty, metadata_url, small_config())
    try:
        partition = open_partition(client, "p")
        for i in range(10):
            partition.append(RecordBatch(b"%d" % i, 1)).result(10)
        faulty.fail_puts_matching(lambda key: True)           # the store refuses every upload
        with pytest.raises((OperationTimeoutError, S3StreamError)):
            partition.close(timeout=0.5)
        assert not partition.closed and partition.is_open      # serving again: not reported closed
        assert partition_on(client, "p") is partition
        assert partition.append(RecordBatch(b"after", 1)).result(10).base_offset == 10
        state = {client.metadata.get_stream(s.stream_id).state
                 for s in (partition.meta_stream, *partition.streams.values())}
        assert state == {StreamState.OPENED}
        faulty.clear()
        report = partition.close(timeout=20)                  # finishes every step
        assert partition.closed and report.seconds > 0 and partition_on(client, "p") is None
        assert partition.close() is report                    # a closed partition says what did it
        state = {client.metadata.get_stream(s.stream_id).state
                 for s in (partition.meta_stream, *partition.streams.values())}
        assert state == {StreamState.CLOSED}
        with pytest.raises(PartitionMovedError):
            partition.append(RecordBatch(b"late", 1))
    finally:
        faulty.clear()
        client.close()


class Node:
    def __init__(self, tmp_path, n, metadata_url, store, cluster):
        self.client = StreamClient(n, tmp_path / f"n{n}.wal", store, metadata_url, small_config())
        self.agent = NodeAgent(self.client, cluster)

    def stop(self):
        self.agent.stop()
        self.client.close()


def test_migrate_does_not_fail_over_a_source_that_is_alive(tmp_path, metadata_url, faulty):
    """The source cannot close (its store refuses uploads) but heartbeats: the migration does
    not fence it (that would stop every partition of a node that works); it fails naming the
    source, nothing is recorded, and the source still serves. Failing it over is then the
    operator's decision (fail_over_node with force, `s3stream node fail-over --force`): the
    target opens, with every acknowledged record."""
    meta = open_metadata(metadata_url)
    plain = f"file://{tmp_path}/objects"
    cluster = Cluster(meta, LocalObjectStore(str(tmp_path / "objects")), FAST, small_config())
    source = Node(tmp_path, 1, metadata_url, faulty, cluster)
    target = Node(tmp_path, 2, metadata_url, plain, cluster)
    try:
        cluster.assign("p", 1)
        wait_for(lambda: cluster.owner("p") == 1, what="node 1 opens p")
        acked = [partition_on(source.client, "p").append(RecordBatch(b"%d" % i, 1)).result(10).base_offset
                 for i in range(20)]
        epoch = meta.get_node(1).node_epoch
        faulty.fail_puts_matching(lambda key: True)
        with pytest.raises(NodeAliveError, match="node 1 still holds it and is alive") as alive:
            cluster.migrate("p", 2, timeout=2.0)
        assert "s3stream node fail-over 1 --force" in str(alive.value)
        assert cluster.failover_history() == [] and not meta.list_kv("failover/")
        node1 = meta.get_node(1)
        assert (node1.node_epoch, node1.failover) == (epoch, False) and not source.client.fenced
        assert cluster.assignment("p")["node"] == 2 and cluster.partition_holder("p") == 1
        outcome = cluster.fail_over_node(1, force=True, reason="test: its store refuses it")
        assert outcome.forced and not outcome.already and outcome.report is not None
        [entry] = cluster.failover_history()
        assert (entry["kind"], entry["node"], entry["ok"]) == ("forced-failover", 1, True)
        assert "its store refuses it" in entry["reason"]
        wait_for(lambda: cluster.owner("p") == 2, what="node 2 opens p")
        moved = partition_on(target.client, "p")
        assert moved.append(RecordBatch(b"new", 1)).result(10).base_offset == 20
        assert [bytes(b.payload) for b in moved.fetch(0, 20, 1 << 20).batches] == [b"%d" % i for i in acked]
    finally:
        faulty.clear()
        source.stop()
        target.stop()
        meta.close()


def test_migrate_fails_over_a_source_that_is_silent(tmp_path, metadata_url):
    """The source dies holding the partition (no peer judges: auto_failover off): the migration
    counts its silence while it waits, fails it over (history: migration-fallback, with the
    silence), and reports success once the target's current incarnation serves, every
    acknowledged record there."""
    config = dataclasses.replace(FAST, auto_failover=False)
    meta = open_metadata(metadata_url)
    store = f"file://{tmp_path}/objects"
    cluster = Cluster(meta, LocalObjectStore(str(tmp_path / "objects")), config, small_config())
    source = Node(tmp_path, 1, metadata_url, store, cluster)
    target = Node(tmp_path, 2, metadata_url, store, cluster)
    try:
        cluster.assign("p", 1)
        wait_for(lambda: cluster.owner("p") == 1, what="node 1 opens p")
        acked = [partition_on(source.client, "p").append(RecordBatch(b"%d" % i, 1)).result(10).base_offset
                 for i in range(20)]
        source.agent.stop()
        crash(source.client)                       # silent from now on, its WAL left as a kill -9 leaves it
        report = cluster.migrate("p", 2, timeout=2.0)
        assert report.failed_over and report.target == 2
        opened = json.loads(meta.get_kv("opened/p"))
        assert (opened["node"], opened["node_epoch"]) == (2, target.client.node_epoch)
        [entry] = cluster.failover_history()
        assert (entry["kind"], entry["node"], entry["ok"]) == ("migration-fallback", 1, True)
        assert "sent no heartbeat for" in entry["reason"]
        moved = partition_on(target.client, "p")
        assert [bytes(b.payload) for b in moved.fetch(0, 20, 1 << 20).batches] == [b"%d" % i for i in acked]
    finally:
        target.stop()
        meta.close()


def test_a_node_that_cannot_open_hands_the_partition_on(tmp_path, metadata_url, monkeypatch):
    """Node 2 cannot open `p`: after open_attempts tries its agent assigns `p` to another node
    that can serve, with the reason, which the CLI report shows."""
    meta = open_metadata(metadata_url)
    cluster = Cluster(meta, LocalObjectStore(str(tmp_path / "objects")), FAST, small_config())
    nodes = {n: Node(tmp_path, n, metadata_url, f"file://{tmp_path}/objects", cluster) for n in (2, 3)}
    try:
        from s3stream.cluster import agent as agent_module
        real = agent_module.open_partition

        def cannot_open(client, name, **kw):
            if client is nodes[2].client:
                raise S3StreamError(f"injected: node 2 cannot open {name!r}")
            return real(client, name, **kw)
        monkeypatch.setattr(agent_module, "open_partition", cannot_open)
        cluster.assign("p", 2)
        wait_for(lambda: cluster.assignment("p")["node"] == 3, what="p handed to node 3")
        assignment = cluster.assignment("p")
        assert assignment["from_node"] == 2 and "failed to open it 3 times" in assignment["reason"]
        wait_for(lambda: cluster.owner("p") == 3, what="node 3 opens p")
        assert nodes[2].agent.stats["handed_on"] == 1 and nodes[2].agent.stats["open_failures"] == 3
        from s3stream.cli.cluster import cluster_report, format_cluster
        assert "failed to open it 3 times" in format_cluster(cluster_report(meta, False))
    finally:
        for node in nodes.values():
            node.stop()
        meta.close()


def test_a_node_that_cannot_serve_says_so_takes_nothing_and_judges_nobody(tmp_path, metadata_url, faulty):
    """Node 1's uploads stop for good (the store refuses them permanently): its heartbeat says
    it cannot serve, migrations to it are refused, it opens nothing assigned to it, and it
    fails no silent peer over."""
    meta = open_metadata(metadata_url)
    cluster = Cluster(meta, LocalObjectStore(str(tmp_path / "objects")), FAST, small_config())
    dead = StreamClient(5, tmp_path / "n5.wal", f"file://{tmp_path}/objects", metadata_url, small_config())
    crash(dead)                                                        # a silent peer
    sick = Node(tmp_path, 1, metadata_url, faulty, cluster)
    try:
        faulty.fail_next_puts(1, ObjectStorePermanentError("injected: access denied"))
        stream = sick.client.create_stream()
        stream.append(RecordBatch(b"x", 1)).result(10)
        with pytest.raises(S3StreamError):
            stream.close(timeout=10)                                   # its upload fails for good
        wait_for(lambda: not json.loads(meta.get_node(1).health or "{}").get("serving", True),
                 what="the heartbeat says node 1 cannot serve")
        assert "access denied" in json.loads(meta.get_node(1).health)["problems"][0]
        assert 1 not in cluster.live_nodes(serving=True) and 1 in cluster.live_nodes()
        with pytest.raises(S3StreamError, match="not a live node that can serve"):
            cluster.migrate("p", 1)
        cluster.assign("p", 1)
        time.sleep(2 * FAST.heartbeat_timeout)
        assert partition_on(sick.client, "p") is None                      # it takes no partition
        assert not meta.get_node(5).failover and not meta.list_kv("failover/")   # nobody judged
    finally:
        sick.stop()
        meta.close()


def test_a_client_closing_after_its_agent_stopped_keeps_its_lease(tmp_path, metadata_url):
    """agent.stop() then client.close(), the usual order: the lease is still renewed while the
    client closes, so its partitions' appends are acknowledged and the close finishes well
    within its timeout (it hung once the lease lapsed); once closed, the heartbeats stop."""
    meta = open_metadata(metadata_url)
    cluster = Cluster(meta, LocalObjectStore(str(tmp_path / "objects")), FAST, small_config())
    node = Node(tmp_path, 1, metadata_url, f"file://{tmp_path}/objects", cluster)
    try:
        cluster.assign("p", 1)
        wait_for(lambda: cluster.owner("p") == 1, what="node 1 opens p")
        node.agent.stop()
        time.sleep(3 * FAST.lease)                                     # the lease would have lapsed by now
        partition = partition_on(node.client, "p")
        assert partition.append(RecordBatch(b"after stop", 1)).result(5).base_offset >= 0
        t0 = time.monotonic()
        report = node.client.close(timeout=30)
        assert time.monotonic() - t0 < 10 and not report["errors"] and not report["left_in_wal"], report
        beat = meta.get_node(1).heartbeat_ns
        time.sleep(3 * FAST.heartbeat_interval)
        assert meta.get_node(1).heartbeat_ns == beat                   # closed: no more heartbeats
    finally:
        meta.close()


# ---- issue 50, item 3: a Cluster from URLs; an agent whose view is broken cannot serve --------------

def test_a_cluster_opens_urls_closes_what_it_opened_and_refuses_what_is_neither(tmp_path, metadata_url):
    """Cluster(metadata URL, store URL), as StreamClient takes them: agents built on such views
    serve and move a partition; close() closes what the Cluster opened and leaves what it was
    handed open. Anything else is refused at construction, naming the value."""
    store_url = f"file://{tmp_path}/objects"
    nodes = {}
    with Cluster(metadata_url, store_url, FAST, small_config()) as admin:
        try:
            for n in (1, 2):
                client = StreamClient(n, tmp_path / f"n{n}.wal", store_url, metadata_url, small_config())
                nodes[n] = (client, NodeAgent(client, Cluster(metadata_url, store_url, FAST)))
            admin.assign("p", 1)
            wait_for(lambda: admin.owner("p") == 1, what="node 1 opens p")
            partition_on(nodes[1][0], "p").append(RecordBatch(b"x", 1)).result(10)
            report = admin.migrate("p", 2, timeout=10)
            assert (report.source, report.target, report.failed_over) == (1, 2, False)
            assert partition_on(nodes[2][0], "p").fetch(0, 1).batches[0].payload == b"x"
        finally:
            for client, agent in nodes.values():
                agent.stop()
                agent.cluster.close()
                client.close()
    with pytest.raises(S3StreamError):
        admin.meta.list_kv("assignment/")           # closed with the Cluster that opened it
    with open_metadata(metadata_url) as handed:
        Cluster(handed, None).close()
        assert json.loads(handed.get_kv("assignment/p"))["node"] == 2     # still open: it was handed in
    for metadata, store, named in ((123, None, "123"), (metadata_url, 5, "5"), ("", None, "empty"),
                                   ({"url": metadata_url}, None, "dict")):
        with pytest.raises(ConfigError, match=named):
            Cluster(metadata, store)
    with pytest.raises(ConfigError, match="unsupported metadata URL"):
        Cluster("mysql://host/db", None)


def test_an_agent_must_share_its_clients_metadata(tmp_path, metadata_url):
    """A NodeAgent is refused a view that is no Cluster (a URL), and a Cluster over another
    database than its client's: it would read assignments and judge peers of another cluster."""
    client = StreamClient(1, tmp_path / "n1.wal", f"file://{tmp_path}/objects", metadata_url, small_config())
    try:
        with pytest.raises(ConfigError, match="needs an s3stream.cluster.Cluster"):
            NodeAgent(client, metadata_url)                                    # type: ignore[arg-type]
        with Cluster(f"sqlite:///{tmp_path}/other.db", None, FAST) as elsewhere:
            with pytest.raises(ConfigError, match="does not know node 1"):
                NodeAgent(client, elsewhere)
    finally:
        client.close()


def test_an_agent_whose_view_is_broken_cannot_serve_takes_nothing_and_judges_nobody(tmp_path, metadata_url):
    """Node 1's agent cannot read the cluster (its passes fail of an error no step raises on
    purpose, as with a Cluster of strings before): its heartbeat says it cannot serve and why,
    migrations to it are refused, and it fails no silent peer over. It recovers when its view
    works again."""
    meta = open_metadata(metadata_url)
    cluster = Cluster(meta, LocalObjectStore(str(tmp_path / "objects")), FAST, small_config())
    dead = StreamClient(5, tmp_path / "n5.wal", f"file://{tmp_path}/objects", metadata_url, small_config())
    crash(dead)                                                        # a silent peer
    view = Cluster(meta, LocalObjectStore(str(tmp_path / "objects")), FAST, small_config())
    node = Node(tmp_path, 1, metadata_url, f"file://{tmp_path}/objects", view)
    try:
        def broken():
            raise AttributeError("'str' object has no attribute 'list_kv'")
        view.assignments = broken                                       # type: ignore[method-assign]
        wait_for(lambda: not json.loads(meta.get_node(1).health or "{}").get("serving", True),
                 what="the heartbeat says node 1 cannot serve")
        health = json.loads(meta.get_node(1).health)
        [problem] = health["problems"]
        assert "its agent cannot read the cluster" in problem and "list_kv" in problem
        assert not health["stuck"]                     # its partitions still take appends: it keeps its lease
        assert 1 not in cluster.live_nodes(serving=True) and 1 in cluster.live_nodes()
        with pytest.raises(S3StreamError, match="not a live node that can serve"):
            cluster.migrate("p", 1)
        time.sleep(2 * FAST.heartbeat_timeout)
        assert not meta.get_node(5).failover and not meta.list_kv("failover/")   # nobody judged
        del view.assignments                                            # its view works again
        wait_for(lambda: json.loads(meta.get_node(1).health or "{}").get("serving"),
                 what="node 1 serves again")
        wait_for(lambda: meta.get_node(5).failover, what="node 1 judges its silent peer again")
    finally:
        node.stop()
        meta.close()
