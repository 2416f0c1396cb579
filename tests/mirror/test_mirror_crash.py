"""Exactly once across a crash of the mirror worker (s3stream.mirror.flow): a child process runs a
flow while the source keeps growing and is SIGKILLed mid-copy, with acknowledged appends still
only in its target WAL. The flow then resumes (a) on the same node, whose next start replays that
WAL, several kills in a row, or (b) on another node after the dead one is failed over. Either way
the target holds every source record exactly once, batch for batch and in order, and every
upstream offset translates exactly.

Run as a script, this file is the child: `test_mirror_crash.py TMP SOURCE_URL TARGET_URL NODE`."""
from __future__ import annotations

import pytest

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import small_config
from s3stream import RecordBatch, StreamClient
from s3stream.cluster import Cluster, open_partition, partitions_on, read_partition
from s3stream.errors import StreamNotFoundError
from s3stream.metadata import open_metadata
from s3stream.mirror import MirrorFlow
from s3stream.objectstore import LocalObjectStore
from test_mirror import read_batches

FLOW = "A-to-B"
CHILD = Path(__file__)

def target_client(tmp: Path, node: int, target_url: str, **config) -> StreamClient:
    return StreamClient(node, tmp / f"target-{node}.wal", f"file://{tmp}/target-objects", target_url,
                        small_config(**config))


def source_client(tmp: Path, node: int, source_url: str, **config) -> StreamClient:
    return StreamClient(node, tmp / f"source-{node}.wal", f"file://{tmp}/source-objects", source_url,
                        small_config(**config))


def start_flow(source: StreamClient, target: StreamClient) -> MirrorFlow:
    # Small fetches and a small in-flight budget: many appends in flight at any moment.
    return MirrorFlow(source, target, "orders", "A.orders", FLOW, source_alias="A", fetch_bytes=16 << 10,
                      max_in_flight_bytes=64 << 10).start()


def child_main(tmp: str, source_url: str, target_url: str, node: str) -> None:
    """Run the flow on target node `node` and print its mirrored position until killed."""
    tmp_path = Path(tmp)
    source = source_client(tmp_path, 9, source_url)                 # reads only
    # No upload interval on the target: up to the 1 MiB upload threshold of what the flow
    # appended is only in the target's WAL when the child is killed.
    target = target_client(tmp_path, int(node), target_url)
    print(f"recovered {target.recovered['replayed']}", flush=True)
    flow = start_flow(source, target)
    print(f"started {flow.metrics().upstream_position}", flush=True)
    while True:
        m = flow.metrics()
        if m.error:
            print(f"error {m.error}", flush=True)
            return
        print(f"progress {m.upstream_position}", flush=True)
        time.sleep(0.003)


# ---- parent ------------------------------------------------------------------------------------------

class Producer(threading.Thread):
    """Appends batches of 1-20 records (20 B - 16 KB) to the source partition until stopped."""

    def __init__(self, partition, seed: int) -> None:
        super().__init__(daemon=True)
        self.partition, self.rng = partition, random.Random(seed)
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def batch(self) -> RecordBatch:
        count = self.rng.randint(1, 20)
        return RecordBatch(self.rng.randbytes(self.rng.choice((20, 500, 4_000, 16_000))), count)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                for f in [self.partition.append(self.batch()) for _ in range(20)]:
                    f.result(30)
                time.sleep(0.01)
        except BaseException as e:   # reported by the test
            self.error = e


def run_child(tmp: Path, source_url: str, target_url: str, node: int, kill_after: int) -> tuple[int, int, int]:
    """Start the child; SIGKILL it once its mirrored position passes `kill_after`. Returns
    (records its client replayed at start, position it started at, last position it printed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CHILD.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(CHILD), str(tmp), source_url, target_url, str(node)],
                            stdout=subprocess.PIPE, text=True, env=env)
    replayed = started = position = None
    deadline = time.monotonic() + 30
    try:
        for line in proc.stdout:
            kind, _, value = line.strip().partition(" ")
            if kind == "recovered":
                replayed = int(value)
            elif kind == "started":
                started = position = int(value)
            elif kind == "progress":
                position = int(value)
                if position >= kill_after:
                    break
            elif kind == "error":
                raise AssertionError(f"the child's flow failed: {value}")
            assert time.monotonic() < deadline, f"the child did not pass {kill_after} (at {position})"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    return replayed, started, position


def wait_committed(source: StreamClient, end: int, timeout: float = 20.0):
    """The source partition's reader once its committed end reaches `end`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            reader = read_partition(source, "orders")
            if reader.end_offset >= end:
                return reader
        except StreamNotFoundError:      # its first checkpoint is not uploaded yet
            pass
        assert time.monotonic() < deadline, f"the source did not commit up to {end}"
        time.sleep(0.01)


def verify_exactly_once(source: StreamClient, target: StreamClient, flow: MirrorFlow) -> int:
    """The target partition is the source partition, batch for batch, offsets equal (the flow
    started on an empty target at the source's start), and the map one segment. Returns the
    number of records checked."""
    reader = read_partition(source, "orders")
    end = reader.end_offset
    assert flow.wait_position(end, 30)
    partition = next(p for p in partitions_on(target) if p.name == "A.orders")
    source_batches = read_batches(reader, 0, end)
    target_batches = read_batches(partition, 0, partition.log.confirm_offset)
    assert len(target_batches) == len(source_batches), "records lost or duplicated"
    assert target_batches == source_batches
    offsets = flow.offset_map()
    assert offsets.segments == ((0, 0),)
    for base, count, _ in source_batches:
        assert offsets.translate(base) == base and offsets.translate(base + count - 1) == base + count - 1
    return end


@pytest.mark.slow
def test_sigkill_and_restart_on_the_same_node(tmp_path):
    source_url, target_url = f"sqlite:///{tmp_path}/source.db", f"sqlite:///{tmp_path}/target.db"
    source = source_client(tmp_path, 1, source_url, upload_interval=0.05)
    orders = open_partition(source, "orders")
    producer = Producer(orders, seed=7)
    for f in [orders.append(producer.batch()) for _ in range(600)]:     # about 3 MB before the first child
        f.result(30)
    wait_committed(source, orders.log.confirm_offset)
    producer.start()
    try:
        replays, position = [], 0
        for cycle in range(4):
            kill_after = position + 800 + random.randint(0, 800)
            acknowledged = position
            replayed, started, position = run_child(tmp_path, source_url, target_url, 1, kill_after)
            replays.append(replayed)
            # Every append the killed child saw acknowledged survived (its WAL replayed).
            assert acknowledged <= started <= kill_after <= position
    finally:
        producer.stop.set()
        producer.join(30)
    assert producer.error is None
    target = target_client(tmp_path, 1, target_url)         # the same node and WAL: the last kill's tail replays
    replays.append(target.recovered["replayed"])
    assert sum(replays[1:]) > 0, f"no kill left acknowledged appends in the WAL to replay: {replays}"
    wait_committed(source, orders.log.confirm_offset)
    flow = start_flow(source, target)
    checked = verify_exactly_once(source, target, flow)
    assert checked > position
    flow.stop()
    target.close()
    source.close()


@pytest.mark.slow
def test_sigkill_then_failover_to_another_node(tmp_path):
    source_url, target_url = f"sqlite:///{tmp_path}/source.db", f"sqlite:///{tmp_path}/target.db"
    source = source_client(tmp_path, 1, source_url, upload_interval=0.05)
    orders = open_partition(source, "orders")
    producer = Producer(orders, seed=8)
    for f in [orders.append(producer.batch()) for _ in range(600)]:
        f.result(30)
    wait_committed(source, orders.log.confirm_offset)
    _, _, position = run_child(tmp_path, source_url, target_url, 1, 1500)
    # Node 1 of the target is dead: another node fails it over (fence, replay its WAL, close its
    # streams) and takes the flow.
    meta = open_metadata(target_url)
    report = Cluster(meta, LocalObjectStore(str(tmp_path / "target-objects")),
                     engine_config=small_config()).fail_over(1, reassign=False)
    assert report.replayed > 0 and report.streams_closed > 0
    for f in [orders.append(producer.batch()) for _ in range(100)]:
        f.result(30)
    wait_committed(source, orders.log.confirm_offset)
    target = target_client(tmp_path, 2, target_url)
    flow = start_flow(source, target)
    assert flow.metrics().upstream_position >= position      # nothing acknowledged was lost
    verify_exactly_once(source, target, flow)
    flow.stop()
    target.close()
    source.close()
    meta.close()


if __name__ == "__main__":
    child_main(*sys.argv[1:5])
