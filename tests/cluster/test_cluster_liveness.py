"""Liveness of failover (issue 10, case 7): a long failover never stops the claimant's own
heartbeats, a claim whose claimant died mid-way is taken over, an admin's liveness view follows
the metadata store's clock, and an agent judges silence on its own injectable clock."""
from __future__ import annotations

import pytest

import time

from s3stream import RecordBatch, StreamClient
from s3stream.cluster import Cluster, ClusterConfig, NodeAgent
from s3stream.metadata import MetadataStore, open_metadata
from s3stream.objectstore import FaultInjectingObjectStore, LocalObjectStore
from conftest import MiB, small_config
from test_engine_model import crash

FAST = ClusterConfig(agent_interval=0.01, heartbeat_interval=0.1, heartbeat_timeout=1.0, migration_timeout=5.0)


class FakeClock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000_000

    def __call__(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.ns += int(seconds * 1e9)


@pytest.mark.slow
def test_a_long_failover_does_not_stop_the_claimants_heartbeats(tmp_path, metadata_url):
    meta = open_metadata(metadata_url)
    slow = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    cluster = Cluster(meta, slow, FAST, small_config())
    store, meta_url = f"file://{tmp_path}/objects", metadata_url
    # Node 2 holds data only in its WAL, then dies.
    config = small_config(upload_threshold=8 * MiB, cache_size=16 * MiB, reclaim_interval=None)
    node2 = StreamClient(2, str(tmp_path / "n2.wal"), store, meta_url, config)
    s = node2.create_stream()
    for i in range(20):
        s.append(RecordBatch(bytes([i]) * 1000, 1)).result()
    crash(node2)
    slow.hang_puts(2.0)                        # the failover's replay PUTs take 2 s each
    node1 = StreamClient(1, str(tmp_path / "n1.wal"), store, meta_url, small_config())
    agent = NodeAgent(node1, cluster)
    try:
        # Node 1's heartbeats, sampled until node 2's replay PUT (2 s) has landed, and a bit past.
        beats = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(e[:1] == ("put",) and e[2] == "ok" for e in slow.events):
            beats.append(meta.get_node(1).heartbeat_ns)
            time.sleep(0.02)
        assert meta.get_node(2).failover, "node 2 was not failed over"
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            beats.append(meta.get_node(1).heartbeat_ns)
            time.sleep(0.02)
        changes = sorted(set(beats))
        gaps = [(b - a) / 1e9 for a, b in zip(changes, changes[1:])]
        assert gaps and max(gaps) < FAST.heartbeat_timeout, f"node 1's heartbeats stalled: gaps {max(gaps):.2f} s"
        assert 1 in cluster.live_nodes()
    finally:
        agent.stop()
        node1.close()
        meta.close()


def fake_cluster(tmp_path, open_same_metadata, nodes=(1, 2, 3)) -> tuple[FakeClock, MetadataStore, Cluster]:
    """Metadata and a Cluster on one fake clock, with `nodes` registered (beating at its now)."""
    clock = FakeClock()
    meta = open_same_metadata(clock=clock)
    cluster = Cluster(meta, LocalObjectStore(str(tmp_path / "objects")), FAST, clock=clock)
    for n in nodes:
        meta.register_node(n, f"/wal/{n}")
    return clock, meta, cluster


def stepped_cluster(tmp_path, open_same_metadata) -> tuple[FakeClock, MetadataStore, Cluster]:
    """Metadata and a Cluster whose wall clock and agents' monotonic clock are one fake clock,
    for agents driven step by step (NodeAgent(start=False)): a node's death is clock steps, not
    sleeps."""
    clock = FakeClock()
    meta = open_same_metadata(clock=clock)
    cluster = Cluster(meta, LocalObjectStore(str(tmp_path / "objects")), ClusterConfig(
        agent_interval=0.01, heartbeat_interval=0.5, heartbeat_timeout=60.0, migration_timeout=5.0),
        small_config(), clock=clock, monotonic=clock)
    return clock, meta, cluster


def step(agent: NodeAgent, clock: FakeClock, seconds: float) -> None:
    """Drive `agent` for `seconds` of its fake clock: a heartbeat and a judgement per interval."""
    interval = agent.config.heartbeat_interval
    for _ in range(round(seconds / interval)):
        clock.advance(interval)
        agent.heartbeat_once()
        agent.judge_once(clock())


def test_an_agent_judges_its_peers_four_times_per_heartbeat_interval(tmp_path, open_same_metadata):
    """A peer's silence counts from the judgement that first saw its last heartbeat: an agent
    judges every heartbeat_interval / 4 (agent.JUDGES_PER_HEARTBEAT), so a failover's detection
    comes at most that much after heartbeat_timeout, not a whole heartbeat_interval; a pass
    sooner than that judges nobody."""
    from s3stream.cluster import agent as agent_module
    clock, meta, cluster = stepped_cluster(tmp_path, open_same_metadata)
    node1 = StreamClient(1, str(tmp_path / "n1.wal"), f"file://{tmp_path}/objects", open_same_metadata(clock=clock),
                         small_config())
    agent = NodeAgent(node1, cluster, start=False)
    judged: list[int] = []
    real = agent.judge_once
    agent.judge_once = lambda now: (judged.append(now), real(now))[1]
    try:
        quarter = cluster.config.heartbeat_interval / agent_module.JUDGES_PER_HEARTBEAT
        assert quarter == 0.125
        for _ in range(8):                         # one heartbeat_interval... twice over
            clock.advance(quarter)
            agent.pass_once(reconcile=False)
        assert len(judged) == 8
        clock.advance(quarter * 0.8)
        agent.pass_once(reconcile=False)
        assert len(judged) == 8
    finally:
        node1.close()
        cluster.close()
        meta.close()


def test_a_claim_whose_claimant_died_is_taken_over(tmp_path, open_same_metadata):
    clock, meta, cluster = fake_cluster(tmp_path, open_same_metadata)
    epoch2 = meta.get_node(2).node_epoch
    # Node 3 claims node 2's failover, while alive.
    assert cluster.claim_failover(2, epoch2, 3)
    assert not cluster.claim_failover(2, epoch2, 1)      # a live claimant's fresh claim holds
    assert cluster.claim_failover(2, epoch2, 3)          # and is its own
    # Node 3 dies mid-way: its heartbeat expires; node 1 (still beating) takes the claim over.
    clock.advance(FAST.heartbeat_timeout + 0.5)
    meta.heartbeat(1, meta.get_node(1).node_epoch)
    assert cluster.live_nodes() == [1]
    assert cluster.claim_failover(2, epoch2, 1)
    assert not cluster.claim_failover(2, epoch2, 3)      # the old claimant has lost it
    assert sorted(meta.list_kv(f"failover/2/{epoch2}/")) == [f"failover/2/{epoch2}/0", f"failover/2/{epoch2}/1"]


def test_a_live_claimant_that_takes_too_long_loses_its_claim(tmp_path, open_same_metadata):
    clock, meta, cluster = fake_cluster(tmp_path, open_same_metadata)
    assert cluster.claim_failover(2, 0, 3)
    clock.advance(FAST.heartbeat_timeout + FAST.migration_timeout + 1)
    for n in (1, 3):                                      # both still beating
        meta.heartbeat(n, meta.get_node(n).node_epoch)
    assert cluster.claim_failover(2, 0, 1)


def test_liveness_follows_the_injected_clock(tmp_path, open_same_metadata):
    clock, meta, cluster = fake_cluster(tmp_path, open_same_metadata, nodes=(1, 2))
    assert cluster.live_nodes() == [1, 2]
    clock.advance(FAST.heartbeat_timeout - 0.1)
    meta.heartbeat(2, meta.get_node(2).node_epoch)
    assert cluster.live_nodes() == [1, 2]
    clock.advance(0.2)                                    # node 1's heartbeat is now too old
    assert cluster.live_nodes() == [2]


def test_agent_fails_over_by_its_own_clock_without_waiting(tmp_path, open_same_metadata):
    """The judge counts a peer's silence on its own (injected) clock: a minute-long timeout is
    120 steps of a fake clock, not a minute of sleep; one step short, nobody is failed over."""
    clock, meta, cluster = stepped_cluster(tmp_path, open_same_metadata)
    store = f"file://{tmp_path}/objects"
    node2 = StreamClient(2, str(tmp_path / "n2.wal"), store, open_same_metadata(clock=clock), small_config())
    node2.create_stream().append(RecordBatch(b"x", 1)).result()
    crash(node2)
    node1 = StreamClient(1, str(tmp_path / "n1.wal"), store, open_same_metadata(clock=clock), small_config())
    agent = NodeAgent(node1, cluster, start=False)
    try:
        step(agent, clock, cluster.config.heartbeat_timeout)
        assert not meta.get_node(2).failover              # seen silent for less than the timeout
        step(agent, clock, 2 * cluster.config.heartbeat_interval)
        deadline = time.monotonic() + 30                  # the failover runs on the agent's pool
        while time.monotonic() < deadline and not cluster.failover_history():
            time.sleep(0.01)
        assert meta.get_node(2).failover
        assert not meta.get_node(1).failover
        [entry] = cluster.failover_history()
        assert (entry["kind"], entry["node"], entry["judge"], entry["ok"]) == ("failover", 2, 1, True)
    finally:
        agent.stop()
        node1.close()


def test_a_retired_node_is_not_failed_over_and_starts_again(tmp_path, open_same_metadata):
    """close(retire=True) after a clean close: peers see the node gone, not dead, so nobody
    claims a failover of a WAL on a disk they cannot reach; a close that left data in the WAL
    does not retire. The retired node's next start registers it again and reads its data."""
    clock, meta, cluster = stepped_cluster(tmp_path, open_same_metadata)
    store = f"file://{tmp_path}/objects"
    node2 = StreamClient(2, str(tmp_path / "n2.wal"), store, open_same_metadata(clock=clock), small_config())
    created = node2.create_stream()
    stream_id = created.stream_id
    created.append(RecordBatch(b"kept", 1)).result()
    epoch = node2.node_epoch
    assert node2.close(retire=True)["retired"]
    assert meta.get_node(2).failover
    node1 = StreamClient(1, str(tmp_path / "n1.wal"), store, open_same_metadata(clock=clock), small_config())
    agent = NodeAgent(node1, cluster, start=False)
    try:
        step(agent, clock, 2 * cluster.config.heartbeat_timeout)      # node 2 is long silent
        assert not meta.list_kv("failover/2/")           # nobody claimed it
    finally:
        agent.stop()
        node1.close()
    again = StreamClient(2, str(tmp_path / "n2.wal"), store, open_same_metadata(clock=clock), small_config())
    try:
        assert again.node_epoch > epoch and not meta.get_node(2).failover
        assert bytes(again.open_stream(stream_id).fetch(0, 1).batches[0].payload) == b"kept"
    finally:
        again.close()
