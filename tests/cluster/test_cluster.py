"""Partitions, migration under load and failover with real parts (three nodes in one process;
a SIGKILLed and a SIGSTOPped node process), over SQLite and PostgreSQL metadata."""
from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from testpaths import CHILDREN

import pytest

import s3stream
from s3stream import RecordBatch, StreamClient
from s3stream.cluster import Cluster, ClusterConfig, NodeAgent, open_partition, partition_on, partitions_on, read_partition
from s3stream.metadata import open_metadata
from s3stream.objectstore import LocalObjectStore
from s3stream.cluster.partition import PartitionMovedError
from conftest import is_postgres, small_config

FAST = ClusterConfig(agent_interval=0.01, heartbeat_interval=0.1, heartbeat_timeout=1.0, migration_timeout=5.0)


class InProcessCluster:
    def __init__(self, tmp: Path, metadata_url: str, nodes=(1, 2, 3), config=FAST, store_query: str = ""):
        self.tmp, self.metadata_url, self.store_query = tmp, metadata_url, store_query
        self.meta = open_metadata(metadata_url)
        self.store = LocalObjectStore(str(tmp / "objects"))
        self.cluster = Cluster(self.meta, self.store, config, small_config())
        self.clients = {}
        self.agents = {}
        for n in nodes:
            self.start(n)

    def start(self, n):
        self.clients[n] = StreamClient(n, self.tmp / f"node{n}.wal", f"file://{self.tmp}/objects{self.store_query}",
                                       self.metadata_url, small_config())
        self.agents[n] = NodeAgent(self.clients[n], self.cluster)

    def partition(self, name):
        owner = self.cluster.owner(name)
        client = self.clients.get(owner)
        return None if client is None else partition_on(client, name)

    def close(self):
        for a in self.agents.values():
            a.stop()
        for c in self.clients.values():
            c.close()
        self.meta.close()


class Producer(threading.Thread):
    """Appends numbered records to a partition, following it as it moves."""

    def __init__(self, c: InProcessCluster, name: str):
        super().__init__(daemon=True)
        self.c, self.name = c, name
        self.acked: list[tuple[int, bytes]] = []
        self.retries = 0
        self.stop = threading.Event()

    def run(self):
        i = 0
        while not self.stop.is_set():
            payload = b"%s-%08d" % (self.name.encode(), i)
            p = self.c.partition(self.name)
            if p is None:
                self.retries += 1
                time.sleep(0.001)
                continue
            try:
                base = p.append(RecordBatch(payload, 1)).result(10).base_offset
            except (PartitionMovedError, s3stream.StreamClosedError, s3stream.StreamFencedError):
                self.retries += 1
                time.sleep(0.001)
                continue
            self.acked.append((base, payload))
            i += 1


def records_of(c: InProcessCluster, name: str) -> list[tuple[int, bytes]]:
    p = c.partition(name)
    out, pos = [], p.log.start_offset
    while pos < p.log.confirm_offset:
        res = p.fetch(pos)
        out += [(b.base_offset, b.payload) for b in res.batches]
        pos = res.end_offset
    return out


def test_partition_checkpoint_survives_moves(tmp_path, metadata_url, monkeypatch):
    c = InProcessCluster(tmp_path, metadata_url, nodes=(1, 2))
    try:
        c.cluster.assign("p", 1)
        assert c.cluster.wait_open("p", 1, 5)["leader_epoch"] == 1
        p = c.partition("p")
        for i in range(5):
            p.append(RecordBatch(b"x%d" % i, 2)).result(10)
        node_reads, together = [], []
        get_node, get_both = c.cluster.meta.get_node, c.cluster.meta.get_kv_and_node
        with monkeypatch.context() as m:
            m.setattr(c.cluster.meta, "get_node", lambda node_id: node_reads.append(node_id) or get_node(node_id))
            m.setattr(c.cluster.meta, "get_kv_and_node",
                      lambda key, node_id: together.append((key, node_id)) or get_both(key, node_id))
            rep = c.cluster.migrate("p", 2)
        # The target's incarnation is read with its opened/ record, not on its own. (The source's
        # record may be read: a close slower than the migration's timeout, under a loaded full
        # run, makes the migration watch the source's heartbeat.)
        assert 2 not in node_reads and together and set(together) == {("opened/p", 2)}
        rep = c.cluster.with_close_record(rep)
        assert (rep.source, rep.target, rep.leader_epoch, rep.failed_over) == (1, 2, 2, False)
        assert rep.tail_bytes == 10            # the five un-uploaded records, nothing older
        assert set(rep.phases) == {"assign", "to_close", "close", "to_open", "open", "to_seen", "close.flush",
                                   "close.checkpoint", "close.upload", "close.upload.put", "close.upload.gate",
                                   "close.upload.commit", "open.read", "open.streams", "open.checkpoint"}
        assert sum(v for k, v in rep.phases.items() if k.startswith("close.") and k.count(".") == 1) \
            <= rep.phases["close"] + 1e-6
        assert sum(v for k, v in rep.phases.items() if k.startswith("open.")) <= rep.phases["open"] + 1e-6
        assert sum(v for k, v in rep.phases.items() if k.count(".") == 2) <= rep.phases["close.upload"] + 1e-6
        assert rep.phases["close"] == rep.close_seconds and rep.phases["open"] == rep.open_seconds
        # One host: one wall clock. A boundary is known only to within the metadata write that
        # marks it: the target opens once the close's commit is visible, before the source hears
        # back and stamps the close's end (the same for the assignment and to_close). So to_open
        # and to_close may be a round trip below 0 under load, never seconds.
        assert all(v > -0.25 for v in rep.phases.values())
        assert sum(v for k, v in rep.phases.items() if "." not in k) <= rep.seconds + 0.005   # inside the migration
        p2 = c.partition("p")
        assert p2.checkpoint.streams == p.checkpoint.streams
        assert [x for _, x in records_of(c, "p")] == [b"x%d" % i for i in range(5)]
        with pytest.raises(PartitionMovedError):
            p.append(RecordBatch(b"stale", 1))
    finally:
        c.close()


def test_moves_trim_old_checkpoints_after_the_open_not_in_it(tmp_path, metadata_url):
    """A hinted open (the agents') that finds CHECKPOINTS_KEPT checkpoints piled up leaves
    their trim to after it says it serves; over many moves the meta stream stays bounded."""
    from s3stream.cluster.partition import CHECKPOINTS_KEPT
    c = InProcessCluster(tmp_path, metadata_url, nodes=(1, 2))
    try:
        c.cluster.assign("p", 1)
        c.cluster.wait_open("p", 1, 5)
        c.partition("p").append(RecordBatch(b"x", 1)).result(10)
        spans = []
        for i in range(3 * CHECKPOINTS_KEPT):
            c.cluster.migrate("p", 2 - i % 2)
            meta = c.partition("p").meta_stream
            spans.append(meta.confirm_offset - meta.start_offset)
        # Two checkpoints per move (the close's, the open's); without trims the span grows by
        # two a move.
        assert max(spans) <= CHECKPOINTS_KEPT + 2, spans
        # An open straight from the hint, with enough checkpoints piled up, defers the trim.
        source = c.partition("p")
        c.agents[1].stop()
        c.agents[2].stop()
        for _ in range(CHECKPOINTS_KEPT):
            source.meta_stream.append(RecordBatch(source.checkpoint.encode(), 1)).result(10)
        record = {"node": source._client.node_id, "version": 999}
        source.close(record=record)
        target = open_partition(c.clients[3 - source._client.node_id], "p", hinted=True)
        meta = target.meta_stream
        assert target.trim_due and meta.confirm_offset - meta.start_offset > CHECKPOINTS_KEPT
        target.trim_checkpoints()
        assert not target.trim_due and meta.confirm_offset - meta.start_offset <= 2
        target.append(RecordBatch(b"y", 1)).result(10)
        res = target.fetch(target.log.start_offset)
        assert [b.payload for b in res.batches] == [b"x", b"y"]
    finally:
        c.close()


def test_an_agent_s_open_says_it_serves_before_its_checkpoint_is_durable_then_waits_for_it(
        tmp_path, metadata_url, monkeypatch):
    """A node agent publishes opened/ once the open's checkpoint is appended, without waiting
    for it to be durable (the appends it takes are acknowledged only after it, in WAL order),
    then waits for it before its upkeep: the checkpoint ends durable and the partition serves."""
    published: list[bool] = []
    real = NodeAgent._publish_opened

    def spy(self, name, version, *args):
        partition = next(p for p in partitions_on(self.client) if p.name == name)
        published.append(partition.open_checkpoint is not None)
        return real(self, name, version, *args)

    monkeypatch.setattr(NodeAgent, "_publish_opened", spy)
    c = InProcessCluster(tmp_path, metadata_url, nodes=(1, 2))
    try:
        c.cluster.assign("p", 1)
        c.cluster.wait_open("p", 1, 5)
        c.partition("p").append(RecordBatch(b"x", 1)).result(10)
        c.cluster.migrate("p", 2)
        # The partition's creation waits for its first checkpoint; the move's open does not.
        assert published == [False, True]
        target = c.partition("p")
        deadline = time.monotonic() + 10
        while target.open_checkpoint is not None:  # the agent's upkeep waits for it
            assert time.monotonic() < deadline, "the agent never waited for the open's checkpoint"
            time.sleep(0.01)
        meta = target.meta_stream
        assert meta.confirm_offset == meta.next_offset and target.checkpoint.leader_epoch == 2
        target.append(RecordBatch(b"y", 1)).result(10)
        assert [b.payload for b in target.fetch(target.log.start_offset).batches] == [b"x", b"y"]
    finally:
        c.close()


def _holding_x_on_node_1(c: InProcessCluster):
    """Partition "p" opened on node 1 with one acknowledged record, b"x"; both agents stopped,
    so that the test closes and opens it by hand."""
    c.cluster.assign("p", 1)
    c.cluster.wait_open("p", 1, 5)
    source = c.partition("p")
    source.append(RecordBatch(b"x", 1)).result(10)
    c.agents[1].stop()
    c.agents[2].stop()
    return source


def test_a_partition_s_close_commits_its_clean_checkpoint_without_waiting_for_the_wal(
        tmp_path, metadata_url, monkeypatch):
    """A close waits for its data streams' pending appends, not for its clean checkpoint in the
    WAL (nobody was told that one is durable): the force upload carries it from the log cache
    and the close's commit makes it durable. The committed checkpoint is the clean one, and the
    next owner reads the data and appends after it."""
    from s3stream.cluster.partition import _committed_checkpoint
    from s3stream.stream import Stream
    c = InProcessCluster(tmp_path, metadata_url, nodes=(1, 2))
    try:
        source = _holding_x_on_node_1(c)
        waits: list[tuple[int, int]] = []
        real = Stream._wait_confirmed

        def spy(self, offset, timeout=None):
            waits.append((self.stream_id, offset))
            return real(self, offset, timeout)

        monkeypatch.setattr(Stream, "_wait_confirmed", spy)
        meta_id, checkpoint_at = source.meta_stream.stream_id, source.meta_stream.next_offset
        source.append(RecordBatch(b"y", 1))                 # pending when the close starts
        source.close(record={"node": 1, "version": 999})
        assert (source.log.stream_id, source.log.next_offset) in waits        # the data: waited for
        assert not [w for w in waits if w[0] == meta_id and w[1] > checkpoint_at], waits
        meta = c.clients[1].metadata.get_stream(meta_id)
        assert meta.end_offset == checkpoint_at + 1
        committed = _committed_checkpoint(c.clients[1], meta)
        assert committed is not None and committed.clean and committed == source.checkpoint
        target = open_partition(c.clients[2], "p", hinted=True)
        target.append(RecordBatch(b"z", 1)).result(10)
        assert [b.payload for b in target.fetch(target.log.start_offset).batches] == [b"x", b"y", b"z"]
    finally:
        c.close()


def test_a_close_whose_checkpoint_misses_the_log_cache_fails_and_commits_nothing(tmp_path, metadata_url,
                                                                                 monkeypatch):
    """The close does not wait for its checkpoint, but an append of it that failed at once (in
    the WAL, not in the log cache) fails the close before its commit: no CLOSED stream, no
    closed/ record, the data still where it was."""
    from _native import appendpath
    from s3stream.cluster import partition as P
    from s3stream.metadata import StreamState
    c = InProcessCluster(tmp_path, metadata_url, nodes=(1, 2))
    try:
        source = _holding_x_on_node_1(c)
        real = P._write_checkpoint

        def doomed(*args, **kwargs):
            appendpath.set_failpoint("cache_insert", True)
            try:
                return real(*args, **kwargs)
            finally:
                appendpath.set_failpoint("cache_insert", False)

        monkeypatch.setattr(P, "_write_checkpoint", doomed)
        with pytest.raises(s3stream.AppendFailedError, match="reached the WAL but not the log cache"):
            source.close(record={"node": 1, "version": 999})
        meta = c.clients[1].metadata
        assert meta.get_stream(source.meta_stream.stream_id).state == StreamState.OPENED
        assert meta.get_stream(source.log.stream_id).state == StreamState.OPENED
        assert meta.get_kv(P.closed_key("p")) is None
        assert [b.payload for b in source.fetch(source.log.start_offset).batches] == [b"x"]
    finally:
        c.close()


def test_a_target_waits_for_the_source_s_close_without_spinning(tmp_path, metadata_url, monkeypatch):
    """A partition assigned to node 2 while node 1 still holds it (its agent stopped): node 2's
    agent tries, finds it held, and tries again when a change is pushed or within
    agent_interval, not as fast as its tries fail (each failed try used to wake its loop at
    once: on both stores it spun hundreds of reads a second beside the source's close). Once
    node 1 closes it for that version, node 2 opens it."""
    config = ClusterConfig(agent_interval=0.05, heartbeat_interval=0.1, heartbeat_timeout=30.0, migration_timeout=5.0)
    c = InProcessCluster(tmp_path, metadata_url, nodes=(1, 2), config=config)
    try:
        c.cluster.assign("p", 1)
        assert c.cluster.wait_open("p", 1, 5)
        c.agents[1].stop()
        tries: list[float] = []
        from s3stream.cluster import agent as agent_module
        real = agent_module.open_partition
        monkeypatch.setattr(agent_module, "open_partition", lambda client, *a, **k: (
            tries.append(time.monotonic()) if client is c.clients[2] else None, real(client, *a, **k))[1])
        version = c.cluster.assign("p", 2)
        time.sleep(1.0)
        held = len(tries)
        assert 1 <= held <= 1.0 / config.agent_interval + 5, held
        partition_on(c.clients[1], "p").close(record=dict(node=1, version=version))
        opened = c.cluster.wait_open("p", version, 5, node=2)
        assert opened is not None and opened["node"] == 2
    finally:
        c.close()


def test_the_agent_s_threads_run_above_the_process_and_what_they_start_does_not(tmp_path, metadata_url):
    """agent_priority: a node agent's loop, lease keeper and move workers run that many nice
    steps above the process; threads they happen to start (pools started lazily by a move: the
    reads, the store's preallocation) run at the process's priority or below, never above. Here
    the first PUT of each node is a close's (its tail, from an agent's worker), which starts the
    store's preallocating thread."""
    from s3stream.errors import ConfigError
    for bad in (-1, 40):
        with pytest.raises(ConfigError, match=f"agent_priority must be 0-39 nice steps above the process, got {bad}"):
            ClusterConfig(agent_priority=bad)
    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread nice values are Linux's")
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), base - 1)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), base)
    except OSError:
        pytest.skip("this process may not raise a thread's priority (CAP_SYS_NICE, RLIMIT_NICE)")
    config = ClusterConfig(agent_interval=0.01, heartbeat_interval=0.1, heartbeat_timeout=1.0, migration_timeout=5.0,
                           agent_priority=5)
    c = InProcessCluster(tmp_path, metadata_url, nodes=(1, 2), config=config, store_query="?preallocate_bytes=1048576")
    try:
        c.cluster.assign("p", 1)
        assert c.cluster.wait_open("p", 1, 5)
        c.partition("p").append(RecordBatch(b"x", 1)).result(10)
        c.cluster.migrate("p", 2)
        c.partition("p").append(RecordBatch(b"y", 1)).result(10)
        c.cluster.migrate("p", 1)
        nice = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()
                if t.native_id is not None and t.is_alive()}
        agents = {n: v for n, v in nice.items() if n.startswith(("node-agent-", "node-lease-", "agent-"))}
        assert {"node-agent-1", "node-agent-2", "node-lease-1", "node-lease-2"} <= agents.keys()
        assert any(n.startswith("agent-2") for n in agents)          # the worker that opened it on node 2
        assert "s3stream-store-prealloc" in nice
        assert set(agents.values()) == {base - 5}, agents
        others = {n: v for n, v in nice.items() if n not in agents}
        assert all(v >= base for v in others.values()), others
    finally:
        c.close()


def test_many_migrations_under_load_lose_nothing(tmp_path, metadata_url):
    c = InProcessCluster(tmp_path, metadata_url)
    names = ["a", "b"]
    try:
        for i, name in enumerate(names):
            c.cluster.assign(name, 1 + i)
            c.cluster.wait_open(name, 1, 5)
        producers = [Producer(c, n) for n in names]
        for p in producers:
            p.start()
        rng = random.Random(3)
        reports = []
        for i in range(int(os.environ.get("MIGRATIONS", "20"))):
            name = names[i % 2]
            target = rng.choice([n for n in c.clients if n != c.cluster.owner(name)])
            time.sleep(0.02)
            reports.append(c.cluster.migrate(name, target))
        for p in producers:
            p.stop.set()
            p.join()
        assert all(not r.failed_over for r in reports)
        durations = sorted(r.seconds for r in reports)
        assert durations[-1] < 5
        for p in producers:
            assert len(p.acked) > 50
            stored = dict(records_of(c, p.name))
            for base, payload in p.acked:
                assert stored.get(base) == payload, f"acknowledged record at {base} of {p.name} lost"
            # offsets are dense and in order: no duplicates, no gaps
            assert sorted(stored) == list(range(len(stored)))
    finally:
        c.close()


@pytest.mark.slow
def test_migrations_racing_failovers_keep_offsets_dense(tmp_path, metadata_url):
    """A partition under load is migrated while, a few milliseconds into each move, its source
    is failed over (fenced, its WAL committed on its behalf, its streams closed): whichever wins
    (the source's scoped close committing its tail, or the failover committing the WAL), every
    acknowledged record is read back at its offset and the offsets stay dense. The failed-over
    node restarts before the next round."""
    c = InProcessCluster(tmp_path, metadata_url)
    try:
        c.cluster.assign("a", 1)
        c.cluster.wait_open("a", 1, 5)
        producer = Producer(c, "a")
        producer.start()
        rng = random.Random(7)
        outcomes = []
        for _ in range(6):
            time.sleep(0.05)
            source = c.cluster.owner("a")
            target = rng.choice([n for n in c.clients if n != source])
            result: list = []
            mover = threading.Thread(target=lambda: result.append(_try(lambda: c.cluster.migrate("a", target))))
            mover.start()
            time.sleep(rng.uniform(0.0, 0.03))
            failover = _try(lambda: c.cluster.fail_over(source, reassign=False, reason="test: racing a migration"))
            mover.join(30)
            assert not mover.is_alive()
            assert not isinstance(failover, Exception), failover
            outcomes.append((type(result[0]).__name__, getattr(result[0], "failed_over", None),
                             getattr(result[0], "close_seconds", None)))
            # The source restarts; the partition ends up open on the target either way.
            c.agents[source].stop()
            c.clients[source].close(timeout=5)
            c.start(source)
            if c.cluster.owner("a") != target or c.partition("a") is None:
                version = c.cluster.assign("a", target)
                assert c.cluster.wait_open("a", version, 10, node=target)
        producer.stop.set()
        producer.join()
        assert len(producer.acked) > 50, outcomes
        stored = dict(records_of(c, "a"))
        for base, payload in producer.acked:
            assert stored.get(base) == payload, f"acknowledged record at {base} lost ({outcomes})"
        assert sorted(stored) == list(range(len(stored)))        # dense: no gap, no offset twice
    finally:
        c.close()


def _try(call):
    """call()'s result, or the S3StreamError it raised (a migration that lost its race)."""
    try:
        return call()
    except s3stream.S3StreamError as e:
        return e


NODE = CHILDREN / "cluster_node_child.py"


NODE_APPLICATION_NAME = "s3stream-test-node-process"     # the node process's PostgreSQL sessions


def wait_stopped(proc: subprocess.Popen) -> None:
    """Until the kernel has stopped `proc` (SIGSTOP is delivered asynchronously)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.001)


def in_a_transaction(metadata_url: str) -> bool:
    """Whether the stopped node process is inside a metadata transaction (may hold a lock)."""
    if is_postgres(metadata_url):
        import psycopg
        with psycopg.connect(metadata_url, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                                "AND datname = current_database() AND xact_start IS NOT NULL",
                                (NODE_APPLICATION_NAME,)).fetchone()[0] > 0
    conn = sqlite3.connect(metadata_url[len("sqlite:///"):], timeout=0.2, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError:
        return True
    finally:
        conn.close()


def pause_outside_a_transaction(proc: subprocess.Popen, metadata_url: str) -> None:
    """SIGSTOP the node, retrying until it is not paused inside a metadata transaction. Neither
    store breaks the lock of a paused process: SQLite's write lock, or PostgreSQL's row locks
    (no idle_in_transaction_session_timeout is set), would hold every other node up. This test
    is about fencing a paused node."""
    for _ in range(100):
        proc.send_signal(signal.SIGSTOP)
        wait_stopped(proc)
        if not in_a_transaction(metadata_url):
            return
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError("node 1 was inside a metadata transaction at every attempt to pause it")


def start_node_process(tmp: Path, node_id: int, partitions: list[str], metadata_url: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(NODE.parent), os.environ.get("PYTHONPATH", "")]),
               PGAPPNAME=NODE_APPLICATION_NAME)      # libpq names the process's sessions with it
    return subprocess.Popen([sys.executable, str(NODE), str(tmp), str(node_id), ",".join(partitions), metadata_url],
                            stdout=subprocess.PIPE, text=True, env=env)


def collect(proc: subprocess.Popen, acks: dict, ready: threading.Event) -> threading.Thread:
    def reader():
        for line in proc.stdout:
            kind, *rest = line.split()
            if kind == "ready":
                ready.set()
            elif kind == "ack":
                acks[(rest[0], int(rest[1]))] = rest[2].encode()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    return t


def test_a_view_without_a_store_reads_and_assigns_but_does_not_fail_over(tmp_path):
    """Cluster(meta, None) (what the CLI's metadata-only commands make): assignments and live
    nodes work; fail_over says it needs the object store instead of failing inside."""
    meta = open_metadata(f"sqlite:///{tmp_path}/meta.db")
    try:
        view = Cluster(meta, None, FAST)
        meta.register_node(1, "/wal")
        assert view.assign("p0", 1) == 1
        assert view.assignments() == {"p0": {"node": 1, "version": 1}}
        assert view.live_nodes() == [1]
        with pytest.raises(s3stream.S3StreamError, match="no object store"):
            view.fail_over(1)
        assert not meta.get_node(1).failover      # nothing was fenced
    finally:
        meta.close()


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(int(os.environ.get("FAILOVER_ROUNDS", "1"))))
@pytest.mark.parametrize("how", ["kill", "zombie"])
def test_failover_of_a_dead_node_process(tmp_path, metadata_url, how, round_):
    """Node 1 runs in its own process, producing to its partitions. It is SIGKILLed (or
    SIGSTOPped: a zombie). Node 2 sees its heartbeat expire, fails it over and serves its
    partitions: every record node 1 acknowledged is there. A zombie that wakes up is fenced and
    stops writing, and nothing it appends after the failover becomes readable."""
    meta = open_metadata(metadata_url)
    cluster = Cluster(meta, LocalObjectStore(str(tmp_path / "objects")), FAST, small_config())
    for name in ("p0", "p1"):
        cluster.assign(name, 1)
    acks: dict = {}
    ready = threading.Event()
    proc = start_node_process(tmp_path, 1, ["p0", "p1"], metadata_url)
    reader = collect(proc, acks, ready)
    node2 = None
    try:
        assert ready.wait(60), "node 1 did not start"
        time.sleep(0.8)
        node2 = StreamClient(2, tmp_path / "node2.wal", f"file://{tmp_path}/objects", metadata_url,
                             small_config())
        agent2 = NodeAgent(node2, cluster)
        if how == "kill":
            proc.send_signal(signal.SIGKILL)
        else:
            pause_outside_a_transaction(proc, metadata_url)
        time.sleep(0.3)                          # let the pipe drain what node 1 printed before
        stopped_with = dict(acks)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sorted(p.name for p in partitions_on(node2)) != ["p0", "p1"]:
            time.sleep(0.05)
        assert sorted(p.name for p in partitions_on(node2)) == ["p0", "p1"], agent2.errors
        if how == "zombie":
            proc.send_signal(signal.SIGCONT)
            time.sleep(1.5)                      # it wakes, heartbeats, learns it is fenced
            quiet = len(acks)
            time.sleep(0.5)
            assert len(acks) == quiet, "the fenced zombie must stop writing"
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        reader.join(5)
        for name in ("p0", "p1"):
            p = partition_on(node2, name)
            stored = {}
            pos = p.log.start_offset
            while pos < p.log.confirm_offset:
                res = p.fetch(pos)
                stored.update((b.base_offset, b.payload) for b in res.batches)
                pos = res.end_offset
            end = p.log.confirm_offset           # what the failover committed for node 1
            before = {off: pl for (n, off), pl in stopped_with.items() if n == name}
            assert before, "node 1 acknowledged records before it stopped"
            after_fencing = 0
            for (n, off), payload in acks.items():
                if n != name:
                    continue
                if off < end:
                    # durable in node 1's WAL before the failover (even if its ack line was
                    # printed after a zombie woke up): committed on its behalf, byte for byte
                    assert stored.get(off) == payload, f"{name}: acknowledged record at {off} lost"
                else:
                    after_fencing += 1               # a zombie's write after it was fenced
            assert all(off < end for off in before)
            if how == "kill":
                assert after_fencing == 0
            # nothing the zombie writes later ever becomes readable here
            time.sleep(0.2)
            assert p.log.confirm_offset == end
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if node2 is not None:
            agent2.stop()
            node2.close()
        meta.close()


def test_migrate_to_current_owner_and_to_a_dead_node(tmp_path, metadata_url):
    c = InProcessCluster(tmp_path, metadata_url, nodes=(1, 2))
    try:
        c.cluster.assign("p", 1)
        c.cluster.wait_open("p", 1, 5)
        rep = c.cluster.migrate("p", 1, timeout=5)          # already there: confirmed, not stuck
        assert rep.target == 1 and c.cluster.owner("p") == 1
        with pytest.raises(s3stream.S3StreamError, match="not a live node"):
            c.cluster.migrate("p", 7)
        assert c.cluster.owner("p") == 1                    # nothing changed
    finally:
        c.close()


def test_failover_of_an_unreadable_wal_changes_nothing(tmp_path, metadata_url):
    from s3stream.engine.failover import fail_over
    meta = open_metadata(metadata_url)
    node = meta.register_node(5, str(tmp_path / "missing.wal"))
    meta.create_stream(5, node.node_epoch)       # open: its tail would be in that WAL
    with pytest.raises(s3stream.WALError, match="cannot open its WAL"):
        fail_over(5, store=LocalObjectStore(str(tmp_path / "o")), metadata=meta)
    assert meta.get_node(5).node_epoch == node.node_epoch and not meta.get_node(5).failover
    meta.close()


def test_failover_reads_a_small_wal_with_any_engine_config(tmp_path, metadata_url):
    """The failing-over node's config need not match the dead node's WAL size."""
    import wal
    from s3stream.engine.failover import fail_over
    small = small_config(wal=wal.WALConfig(capacity=4 * 1024 * 1024 + 8192, full_timeout=5),
                         max_batch_bytes=64 * 1024)
    c = StreamClient(5, tmp_path / "n5.wal", f"file://{tmp_path}/objects", metadata_url, small)
    s = c.create_stream()
    s.append(RecordBatch(b"durable", 1)).result(10)
    c._uploader.abort()                                        # dies before uploading
    c._wal._ring.stop()
    meta = open_metadata(metadata_url)
    rep = fail_over(5, store=LocalObjectStore(str(tmp_path / "objects")), metadata=meta)   # default Config()
    assert rep.replayed == 1 and rep.streams_closed == 1
    other = StreamClient(6, tmp_path / "n6.wal", f"file://{tmp_path}/objects", metadata_url, small_config())
    assert other.open_stream(s.stream_id).fetch(0).batches[0].payload == b"durable"
    other.close()
    meta.close()


def test_read_partition_reads_committed_records_without_opening(tmp_path, metadata_url):
    """A client that owns nothing reads a partition open on another node: what is committed,
    with no epoch change and no write; the rest once the owner uploads it."""
    c = InProcessCluster(tmp_path, metadata_url, nodes=(1, 2))
    try:
        c.cluster.assign("p", 1)
        c.cluster.wait_open("p", 1, 5)
        p = c.partition("p")
        for i in range(5):
            p.append(RecordBatch(b"r%d" % i, 1)).result(10)
        with pytest.raises(s3stream.StreamNotFoundError, match="no committed checkpoint yet|no partition"):
            read_partition(c.clients[2], "p")                    # nothing uploaded yet
        c.clients[1].force_upload(10)
        deadline = time.monotonic() + 10
        while c.meta.get_stream(p.log.stream_id).end_offset < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        before = c.meta.get_stream(p.log.stream_id)
        reader = read_partition(c.clients[2], "p")
        assert (reader.log_stream_id, reader.start_offset, reader.end_offset) == (p.log.stream_id, 0, 5)
        assert [bytes(b.payload) for b in reader.fetch(0).batches] == [b"r%d" % i for i in range(5)]
        after = c.meta.get_stream(p.log.stream_id)
        assert (after.epoch, after.owner_node_id) == (before.epoch, 1)     # still node 1's
        p.append(RecordBatch(b"more", 1)).result(10)                      # the owner goes on
        assert reader.fetch(0, 6).end_offset == 5                         # capped at the committed end
        with pytest.raises(s3stream.OffsetOutOfRangeError, match="committed range"):
            reader.fetch(6, 7)
        with pytest.raises(s3stream.StreamNotFoundError, match="no partition 'nope'"):
            read_partition(c.clients[2], "nope")
    finally:
        c.close()


def test_a_node_agent_tunes_an_untuned_collector_and_only_that(tmp_path, metadata_url):
    """gc_thresholds: a node agent raises the interpreter's collection thresholds if the process
    still has Python's defaults (700, 10, 10); a process that tuned its own keeps them, and None
    leaves the collector alone. Nonsense is refused naming the setting."""
    import gc
    from s3stream.cluster.agent import PYTHON_GC_DEFAULTS
    from s3stream.errors import ConfigError
    for bad in ((0, 10, 10), (700, 10), "fast"):
        with pytest.raises(ConfigError, match="gc_thresholds must be three positive integers"):
            ClusterConfig(gc_thresholds=bad)
    saved = gc.get_threshold()
    meta = open_metadata(metadata_url)
    client = StreamClient(1, tmp_path / "node1.wal", f"file://{tmp_path}/objects", meta, small_config())
    cluster = Cluster(meta, LocalObjectStore(str(tmp_path / "objects")))
    try:
        for config, before, after in ((ClusterConfig(), PYTHON_GC_DEFAULTS, ClusterConfig().gc_thresholds),
                                      (ClusterConfig(gc_thresholds=None), PYTHON_GC_DEFAULTS, PYTHON_GC_DEFAULTS),
                                      (ClusterConfig(), (1000, 5, 5), (1000, 5, 5))):
            gc.set_threshold(*before)
            NodeAgent(client, Cluster(meta, cluster.store, config), start=False).stop()
            assert gc.get_threshold() == after, (config.gc_thresholds, before)
        assert ClusterConfig().gc_thresholds == (50_000, 20, 20)
    finally:
        gc.set_threshold(*saved)
        client.close()
        meta.close()
