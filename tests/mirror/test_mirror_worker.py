"""MirrorWorker (s3stream.mirror.worker): a flow's partitions shared out over workers by leases,
between two real clusters (SQLite metadata files and local object stores in tmp_path). Two
workers split six partitions; a third joining moves only the excess while the other flows keep
running; a clean stop hands over; new and deleted source partitions; one leader; and SIGKILLed
workers, one restarted on its WAL and one failed over by another worker. Every test checks that
each source record is on the target exactly once, batch for batch.

Run as a script, this file is the child of the crash test: `test_mirror_worker.py TMP WORKER_ID`."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import small_config
from s3stream import RecordBatch, StreamClient
from s3stream.records.consumer import ConsumerGroups
from s3stream.errors import ConfigError, InvalidArgumentError, S3StreamError
from s3stream.metadata import open_metadata
from s3stream.mirror import HEARTBEATS, MirrorWorker, WorkerConfig, latest_heartbeats, load_flow, mirror_status
from s3stream.mirror.worker import leader_key, lease_key, quotas
from s3stream.cluster import open_partition, partitions_on, read_partition

FLOW = "A-to-B"
UPLOAD = 0.05
CHILD = Path(__file__)


def worker_config(**kw) -> WorkerConfig:
    # Short passes; timeouts long enough that a pass delayed by a loaded machine is not a death.
    options = dict(interval=0.1, lease_ttl=3.0, worker_timeout=3.0, checkpoint_interval=0.2, heartbeat_interval=0.2,
                   retry_backoff=0.5, flow_stop_timeout=5.0, poll_interval=0.02, fetch_bytes=64 << 10,
                   max_in_flight_bytes=256 << 10, engine=small_config(upload_interval=UPLOAD))
    options.update(kw)
    return WorkerConfig(**options)


class Env:
    """A source cluster with a producer node and a target cluster; workers started on demand."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.source_url = f"sqlite:///{tmp}/source.db"
        self.target_url = f"sqlite:///{tmp}/target.db"
        self.source_store = f"file://{tmp}/source-objects"
        self.target_store = f"file://{tmp}/target-objects"
        self.producer = StreamClient(1, tmp / "producer.wal", self.source_store, self.source_url,
                                     small_config(upload_interval=UPLOAD))
        self.reader = StreamClient(900, tmp / "target-reader.wal", self.target_store, self.target_url,
                                   small_config())
        self.source_meta = open_metadata(self.source_url)
        self.target_meta = open_metadata(self.target_url)
        self.workers: list[MirrorWorker] = []
        self.partitions: dict[str, object] = {}
        self.rng = random.Random(5)
        self.serial = 0

    def worker(self, worker_id: int, start: bool = True, **kw) -> MirrorWorker:
        config = kw.pop("config", None) or worker_config()
        w = MirrorWorker(worker_id, source_store=self.source_store, source_meta=self.source_url,
                         target_store=self.target_store, target_meta=self.target_url, source_alias="A",
                         flow_id=FLOW, wal_dir=self.tmp / f"w{worker_id}", config=config, **kw)
        self.workers.append(w)
        return w.start() if start else w

    def produce(self, name: str, batches: int) -> None:
        if name not in self.partitions:
            self.partitions[name] = open_partition(self.producer, name)
        part = self.partitions[name]
        futures = []
        for _ in range(batches):
            count = self.rng.randint(1, 8)
            ids = b",".join(b"%s-%d" % (name.encode(), self.serial + i) for i in range(count))
            self.serial += count
            futures.append(part.append(RecordBatch(ids + b"#" + self.rng.randbytes(self.rng.choice((0, 50, 3000))),
                                                   count)))
        for f in futures:
            f.result(30)

    def source_batches(self, name: str) -> list[tuple[int, bytes]]:
        return read_all(read_partition(self.producer, name))

    def target_batches(self, name: str) -> list[tuple[int, bytes]]:
        return read_all(read_partition(self.reader, f"A.{name}"))

    def wait_mirrored(self, names=None, timeout: float = 30.0) -> None:
        """Until every source partition's committed records are committed on the target too,
        then check them batch for batch."""
        names = sorted(self.partitions) if names is None else names
        deadline = time.monotonic() + timeout
        for name in names:
            ends = lambda: (read_partition(self.producer, name).end_offset,  # noqa: E731
                            self.partitions[name].log.confirm_offset)
            while True:
                committed, confirmed = ends()
                if committed == confirmed:
                    break
                assert time.monotonic() < deadline, f"source {name} not committed"
                time.sleep(0.02)
            while True:
                try:
                    end = read_partition(self.reader, f"A.{name}").end_offset
                except S3StreamError:
                    end = -1
                if end >= committed:
                    break
                assert time.monotonic() < deadline, (f"A.{name} mirrored up to {end} of {committed}",
                                                     [w.status() for w in self.workers])
                time.sleep(0.02)
            assert self.target_batches(name) == self.source_batches(name), f"{name}: target differs from source"

    def close(self) -> None:
        for w in self.workers:
            if w.running or w.target_client is not None:
                try:
                    w.stop(10)
                except S3StreamError:
                    pass
        for p in self.partitions.values():
            try:
                p.close()
            except S3StreamError:
                pass
        for c in (self.producer, self.reader):
            try:
                c.close()
            except S3StreamError:
                pass
        self.source_meta.close()
        self.target_meta.close()


def read_all(reader) -> list[tuple[int, bytes]]:
    """(count, payload) of every committed batch: the same list on both sides means batch for
    batch, none lost, none twice (payloads name their records)."""
    out, position, end = [], reader.start_offset, reader.end_offset
    while position < end:
        batches = reader.fetch(position, end, 1 << 20).batches
        out += [(b.count, bytes(b.payload)) for b in batches]
        position = batches[-1].end_offset
    return out


@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path)
    yield e
    e.close()


def wait_for(condition, timeout: float = 20.0, what: str = "condition", status=None):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {status() if status else ''}"
        time.sleep(0.02)


def holders(env: Env, names) -> dict[str, int | None]:
    """Lease holder of each target partition now (None: free or expired)."""
    now = time.time_ns()
    out = {}
    for name in names:
        raw = env.target_meta.get_kv(lease_key(FLOW, f"A.{name}"))
        record = None if raw is None else json.loads(raw)
        out[name] = record["holder"] if record and record["expires_ns"] > now else None
    return out


def running(w: MirrorWorker) -> int:
    return sum(f.state == "running" for f in w.flows().values())


def balanced(workers, per_worker) -> callable:
    return lambda: all(running(w) == n and len(w.leases()) == n for w, n in zip(workers, per_worker))


NAMES = [f"p{i}" for i in range(6)]


# ---- tests -----------------------------------------------------------------------------------------

def test_quotas_keep_a_balanced_assignment():
    assert quotas(6, {1: 0, 2: 0}) == {1: 3, 2: 3}
    assert quotas(6, {1: 3, 2: 3, 3: 0}) == {1: 2, 2: 2, 3: 2}
    # The extra partition stays with whoever holds the most: nothing moves needlessly.
    assert quotas(7, {1: 3, 2: 4}) == {2: 4, 1: 3}
    assert quotas(7, {1: 4, 2: 3, 3: 0}) == {1: 3, 2: 2, 3: 2}
    assert quotas(6, {1: 2, 2: 2, 3: 1, 4: 1}) == {1: 2, 2: 2, 3: 1, 4: 1}
    assert quotas(0, {1: 0}) == {1: 0} and quotas(5, {}) == {}


def test_config_and_arguments_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="lease_ttl"):
        WorkerConfig(interval=1.0, lease_ttl=1.5)
    with pytest.raises(ConfigError, match="max_flows"):
        WorkerConfig(max_flows=0)
    with pytest.raises(ConfigError, match="interval"):
        WorkerConfig(interval=-1)
    kw = dict(source_store="x", source_meta="y", target_store="z", target_meta="w", wal_dir=tmp_path)
    with pytest.raises(InvalidArgumentError, match="worker_id"):
        MirrorWorker(-1, source_alias="A", **kw)
    with pytest.raises(S3StreamError, match="source alias"):
        MirrorWorker(1, source_alias="A/B", **kw)


def test_two_workers_split_six_partitions_exactly_once(env):
    for name in NAMES:
        env.produce(name, 30)
    w1, w2 = env.worker(1), env.worker(2)
    wait_for(balanced([w1, w2], [3, 3]), what="3 + 3 flows", status=lambda: [w1.status(), w2.status()])
    assert sorted(w1.leases() + w2.leases()) == [f"A.{n}" for n in NAMES]
    for name in NAMES:                          # more while they run
        env.produce(name, 20)
    env.wait_mirrored()
    state = load_flow(env.target_meta, FLOW)
    assert {t: r.source_partition for t, r in state.partitions.items()} == {f"A.{n}": n for n in NAMES}
    assert all(len(state.segments[f"A.{n}"]) == 1 for n in NAMES)
    assert set(w1.status()["live_workers"]) == {1, 2} and w1.status()["quota"] == 3


def test_join_moves_only_the_excess(env):
    for name in NAMES:
        env.produce(name, 10)
    w1, w2 = env.worker(1), env.worker(2)
    wait_for(balanced([w1, w2], [3, 3]), what="3 + 3 flows")
    before = holders(env, NAMES)
    flows_before = {**w1.flows(), **w2.flows()}
    stops_before = sum(e["event"] == "stopped" for w in (w1, w2) for e in w.events)
    w3 = env.worker(3)
    wait_for(balanced([w1, w2, w3], [2, 2, 2]), what="2 + 2 + 2 flows",
             status=lambda: [w.status() for w in (w1, w2, w3)])
    for name in NAMES:
        env.produce(name, 10)
    env.wait_mirrored()
    after = holders(env, NAMES)
    moved = [n for n in NAMES if before[n] != after[n]]
    assert len(moved) == 2 and all(after[n] == 3 for n in moved), (before, after)
    # Only the two moved flows stopped; the four others are the very flow objects that ran before.
    # (a worker records a stop after it released the lease: the new holder may run before that)
    stops = lambda: sum(e["event"] == "stopped" for w in (w1, w2) for e in w.events) - stops_before  # noqa: E731
    wait_for(lambda: stops() >= 2, timeout=5, what="the two stops recorded")
    assert stops() == 2
    flows_after = {**w1.flows(), **w2.flows()}
    kept = [n for n in NAMES if n not in moved]
    assert all(flows_after[f"A.{n}"] is flows_before[f"A.{n}"] for n in kept)
    assert all(flows_after[f"A.{n}"].state == "running" for n in kept)
    # Each moved partition's map is still one segment: the new holder continued exactly.
    state = load_flow(env.target_meta, FLOW)
    assert all(len(state.segments[f"A.{n}"]) == 1 for n in NAMES)


def test_clean_stop_hands_over_within_a_bound(env):
    for name in NAMES:
        env.produce(name, 10)
    w1, w2 = env.worker(1), env.worker(2)
    wait_for(balanced([w1, w2], [3, 3]), what="3 + 3 flows")
    stop_producing = threading.Event()

    def keep_producing():
        while not stop_producing.is_set():
            for name in NAMES:
                env.produce(name, 2)
            time.sleep(0.02)

    producer = threading.Thread(target=keep_producing, daemon=True)
    producer.start()
    try:
        final = w1.stop(10)
        assert final["leases"] == [] and final["flows"] == {}
        assert env.target_meta.get_kv(f"mirror/{FLOW}/workers/1") is None
        t0 = time.monotonic()
        wait_for(balanced([w2], [6]), timeout=10, what="w2 running all 6", status=w2.status)
        assert time.monotonic() - t0 < 5        # about one interval plus six starts
    finally:
        stop_producing.set()
        producer.join()
    env.wait_mirrored()
    assert holders(env, NAMES) == {n: 2 for n in NAMES}


def test_new_partition_picked_up_and_deleted_one_stopped(env):
    env.produce("p0", 10)
    env.produce("p1", 10)
    w = env.worker(1)
    wait_for(lambda: running(w) == 2, what="2 flows")
    env.produce("p2", 10)
    wait_for(lambda: running(w) == 3, what="the new partition's flow")
    env.wait_mirrored()
    env.source_meta.delete_kv("partition/p1")        # the source forgets p1
    # The worker forgets the lease first, then stops the flow, then releases the lease: wait for all.
    wait_for(lambda: "A.p1" not in w.flows() and "A.p1" not in w.leases()
             and holders(env, ["p1"]) == {"p1": None}, what="p1's flow to stop and its lease to be released")
    # (the event is noted after the release: a full run once checked in between)
    wait_for(lambda: any(e["event"] == "stopped" and e["target_partition"] == "A.p1" and "deleted" in e["detail"]
                         for e in w.events), what="the flow's stopped event")
    env.produce("p0", 5)
    env.wait_mirrored(["p0", "p2"])
    assert sorted(w.flows()) == ["A.p0", "A.p2"]


def test_exactly_one_leader_runs_checkpoints_and_heartbeats(env):
    for name in NAMES[:4]:
        env.produce(name, 20)
    src = ConsumerGroups(env.source_meta)
    generation = src.join("billing", "consumer-1")
    src.commit("billing", "p0", 17, generation)
    w1, w2 = env.worker(1), env.worker(2)
    wait_for(balanced([w1, w2], [2, 2]), what="2 + 2 flows")
    env.wait_mirrored()
    target_groups = ConsumerGroups(env.target_meta)
    wait_for(lambda: target_groups.committed("billing", "A.p0") == 17, what="the checkpoint of billing")
    leaders = [w for w in (w1, w2) if w.is_leader]
    assert len(leaders) == 1
    leader, other = leaders[0], (w2 if leaders[0] is w1 else w1)
    # The heartbeats partition has one writer, the leader's node; its beats cover all 4 flows,
    # the other worker's as its record publishes them.
    wait_for(lambda: latest_heartbeats(leader.target_client).get("A") is not None
             and latest_heartbeats(leader.target_client)["A"].flows == 4, what="a heartbeat of 4 flows")
    assert other.checkpoints == 0 and other.heartbeats == 0 and leader.checkpoints > 0
    assert json.loads(env.target_meta.get_kv(leader_key(FLOW)))["holder"] == leader.worker_id
    leaders = [leader]
    report = mirror_status(env.target_meta, FLOW)["flows"][0]
    assert report["heartbeats"]["A"]["flows"] == 4 and report["leader"]["holder"] == leaders[0].worker_id
    assert sorted(report["live_workers"]) == [1, 2]
    # The leader leaves: the other takes the lease, the heartbeats partition and the checkpoints.
    leaders[0].stop(10)
    wait_for(lambda: other.is_leader and other.heartbeats > 0 and other.checkpoints > 0, timeout=10,
             what="the other worker to lead", status=other.status)
    assert HEARTBEATS in [p.name for p in partitions_on(other.target_client)]


def source_nodes(env: Env) -> list[str]:
    """Every row of the source cluster's nodes table."""
    import sqlite3
    conn = sqlite3.connect(env.source_url.removeprefix("sqlite:///"))
    try:
        return sorted(map(repr, conn.execute("SELECT * FROM nodes").fetchall()))
    finally:
        conn.close()


def test_workers_leave_the_source_nodes_untouched(env):
    """The source side is an open_reader: no node registered or heartbeated in the source, no
    WAL for it, while the workers copy, checkpoint a consumer group and stop."""
    for name in NAMES[:2]:
        env.produce(name, 20)
    src = ConsumerGroups(env.source_meta)
    src.commit("billing", "p0", 7, src.join("billing", "consumer-1"))
    before = source_nodes(env)
    assert [n.node_id for n in env.source_meta.list_nodes()] == [1]      # the producer only
    w1, w2 = env.worker(1), env.worker(2)
    wait_for(balanced([w1, w2], [1, 1]), what="1 + 1 flows")
    env.wait_mirrored()
    wait_for(lambda: ConsumerGroups(env.target_meta).committed("billing", "A.p0") == 7,
             what="the checkpoint of billing")
    assert source_nodes(env) == before
    for w in (w1, w2):
        w.stop(10)
    assert source_nodes(env) == before
    assert sorted(os.listdir(env.tmp / "w1")) == ["target-1.wal"]


# ---- crashes -----------------------------------------------------------------------------------------

def child_main(tmp: str, worker_id: str) -> None:
    """A worker whose target node never uploads on a timer (what it appends stays in its WAL
    up to the 1 MiB threshold), printing its running flows until killed."""
    tmp_path = Path(tmp)
    config = worker_config(engine=small_config())
    w = MirrorWorker(int(worker_id), source_store=f"file://{tmp}/source-objects",
                     source_meta=f"sqlite:///{tmp}/source.db", target_store=f"file://{tmp}/target-objects",
                     target_meta=f"sqlite:///{tmp}/target.db", source_alias="A", flow_id=FLOW,
                     wal_dir=tmp_path / f"w{worker_id}", config=config).start()
    while True:
        flows = w.flows()
        copied = sum((f.metrics().records or 0) for f in flows.values())
        print(f"flows {len(flows)} copied {copied}", flush=True)
        time.sleep(0.05)


class Child:
    def __init__(self, tmp: Path, worker_id: int) -> None:
        # The repository under test first (an installed copy of s3stream may be elsewhere).
        path = [str(CHILD.parents[2]), str(CHILD.parent), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        self.proc = subprocess.Popen([sys.executable, str(CHILD), str(tmp), str(worker_id)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.last = ""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.last = line.strip()

    def flows_and_copied(self) -> tuple[int, int]:
        parts = self.last.split()
        return (int(parts[1]), int(parts[3])) if len(parts) == 4 else (0, 0)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.mark.slow
def test_sigkilled_workers_restarted_and_failed_over(env):
    """Two child workers (3 flows each) are SIGKILLed mid-copy, acknowledged appends still only in
    their target WALs. Worker 1 is restarted on its WAL (same id and wal_dir: it replays it and
    adopts its leases at once); worker 2 is not: worker 3, on this host, fails its node over once
    its record and heartbeat are stale, and takes its partitions. Every record once, in order."""
    for name in NAMES:
        env.produce(name, 40)
    children = [Child(env.tmp, 1), Child(env.tmp, 2)]
    try:
        wait_for(lambda: all(c.flows_and_copied()[0] == 3 for c in children), timeout=30, what="3 + 3 child flows",
                 status=lambda: [(c.last, c.proc.poll(), c.proc.poll() is not None and c.proc.stderr.read())
                                 for c in children])
        for name in NAMES:
            env.produce(name, 40)
        wait_for(lambda: all(c.flows_and_copied()[1] > 0 for c in children), what="copies under way")
    finally:
        for c in children:
            c.kill()
    for name in NAMES:
        env.produce(name, 10)
    w1 = env.worker(1)
    w3 = env.worker(3)
    # Worker 1's acknowledged appends were in its WAL only: its restart committed them.
    assert w1.target_client.recovered["replayed"] > 0
    env.wait_mirrored(timeout=40)
    wait_for(lambda: len(w1.leases()) + len(w3.leases()) == 6, what="all 6 leases held",
             status=lambda: [w1.status(), w3.status()])
    events = [e for w in (w1, w3) for e in w.events]
    assert any(e["event"] == "failed-over" and "worker 2" in e["detail"] for e in events), events
    state = load_flow(env.target_meta, FLOW)
    assert all(len(state.segments[f"A.{n}"]) == 1 for n in NAMES)


if __name__ == "__main__":
    child_main(*sys.argv[1:])
