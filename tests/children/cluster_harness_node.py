"""One cluster node in its own process, for the fault harness (tests/kits/cluster_harness.py).

A StreamClient with its own WAL, a NodeAgent, and one producer thread per partition the agent
has open here: producers start when a partition opens on this node and stop when it moves away
(PartitionMovedError, or no longer open here). Every acknowledged append is one line

    ack <partition> <offset> <payload-id> <monotonic_ns> <wall_ns>

written with one write(2) to the ack log (O_APPEND), so kill -9 loses no line already written.
Payloads never repeat (a failed append is not retried with the same payload): a payload found at
two offsets is a duplicate the engine made. Errors and events go to the node's JSON-lines log.

Signals: SIGUSR1 stops producing (the harness's quiesce before shutdown); SIGUSR2 makes every
producer send a burst of pipelined appends (so that a pause right after lands mid-upload or
mid-commit); SIGTERM closes cleanly (agent stopped, client.close(): every tail uploaded and
committed) and exits 0 (3 if the close left data in the WAL). A node whose agent finds it fenced
exits with FENCED_EXIT, as a node under a supervisor would, and the harness restarts it.

Usage: see `python3 tests/children/cluster_harness_node.py --help` (the harness builds the command line).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback

# Signals are caught from the first moment, before the slow imports: a node the harness signals
# while it is still starting (a restart just before the run ends) must not die of SIGUSR1.
STOP, QUIESCE, BURST_REQUESTED = threading.Event(), threading.Event(), threading.Event()
signal.signal(signal.SIGTERM, lambda *_: STOP.set())
signal.signal(signal.SIGUSR1, lambda *_: QUIESCE.set())
signal.signal(signal.SIGUSR2, lambda *_: BURST_REQUESTED.set())

from cluster_harness import FENCED_EXIT, make_payload, payload_id  # noqa: E402

from s3stream import RecordBatch, StreamClient  # noqa: E402
from s3stream.cluster import Cluster, ClusterConfig, NodeAgent, partition_on, partitions_on  # noqa: E402

from conftest import small_config  # noqa: E402

#: Appends a burst (SIGUSR2) sends per producer without waiting between them.
BURST = 200


class Logs:
    """The ack log and the event log, each line one O_APPEND write."""

    def __init__(self, ack_path: str, log_path: str, node_id: int, incarnation: int) -> None:
        self.ack_fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.node_id, self.incarnation = node_id, incarnation

    def ack(self, partition: str, offset: int, pid: str) -> None:
        os.write(self.ack_fd, f"ack {partition} {offset} {pid} {time.monotonic_ns()} {time.time_ns()}\n".encode())

    def event(self, kind: str, **detail) -> None:
        line = dict(t=time.monotonic_ns(), wall=time.time_ns(), node=self.node_id, inc=self.incarnation, kind=kind,
                    **detail)
        os.write(self.log_fd, (json.dumps(line, default=str) + "\n").encode())

    def error(self, error: BaseException, partition: str | None = None, where: str = "append") -> None:
        self.event("error", type=type(error).__name__, partition=partition, where=where, message=str(error)[:300])


class Node:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.logs = Logs(args.ack_log, args.log, args.node_id, args.incarnation)
        self.quiesced = threading.Event()
        self.producers: dict[str, Producer] = {}
        self._seq_lock = threading.Lock()
        self._seq = 0
        self.client: StreamClient | None = None
        self.agent: NodeAgent | None = None

    def next_seq(self) -> int:
        with self._seq_lock:
            self._seq += 1
            return self._seq

    def start(self) -> None:
        a = self.args
        self.logs.event("starting", wal=a.wal)
        config = small_config(upload_interval=a.upload_interval, close_timeout=a.close_timeout)
        self.client = StreamClient(a.node_id, a.wal, a.store, a.meta, config)
        cluster_config = ClusterConfig(agent_interval=a.agent_interval, heartbeat_interval=a.heartbeat_interval,
                                       heartbeat_timeout=a.heartbeat_timeout, migration_timeout=a.migration_timeout)
        cluster = Cluster(self.client.metadata, self.client.object_store, cluster_config, config)
        self.agent = NodeAgent(self.client, cluster)
        self.logs.event("started", node_epoch=self.client.node_epoch, recovered=self.client.recovered)

    def reconcile(self) -> None:
        """A producer for each partition open here (a new one for a partition reopened here)."""
        assert self.client is not None
        if self.quiesced.is_set():
            return
        for partition in partitions_on(self.client):
            current = self.producers.get(partition.name)
            if current is not None and current.partition is partition and current.is_alive():
                continue
            if current is not None and current.is_alive():
                continue                     # the old one notices the partition moved and stops
            producer = Producer(self, partition)
            self.producers[partition.name] = producer
            self.logs.event("producing", partition=partition.name, leader_epoch=partition.leader_epoch,
                            log_stream=partition.log.stream_id)
            producer.start()

    def burst(self) -> None:
        for producer in list(self.producers.values()):
            producer.burst_requested = True

    def quiesce(self) -> None:
        self.quiesced.set()
        for producer in list(self.producers.values()):
            producer.join(30)
        self.logs.event("quiesced")

    def shutdown(self) -> int:
        self.quiesce()
        assert self.agent is not None and self.client is not None
        self.agent.stop()
        report = self.client.close(timeout=self.args.close_timeout)
        clean = not report["left_in_wal"] and not report["errors"]
        self.logs.event("closed", clean=clean, report=report)
        return 0 if clean else 3


class Producer(threading.Thread):
    """Appends to one partition at `rate` per second while it is open on this node."""

    def __init__(self, node: Node, partition) -> None:
        super().__init__(name=f"producer-{partition.name}", daemon=True)
        self.node, self.partition, self.name_ = node, partition, partition.name
        self.burst_requested = False

    def _payload(self) -> tuple[str, bytes]:
        a = self.node.args
        pid = payload_id(a.node_id, a.incarnation, self.name_, self.node.next_seq())
        return pid, make_payload(pid)

    def _on_done(self, pid: str, future) -> None:
        if future.exception() is None:
            self.node.logs.ack(self.name_, future.base_offset, pid)

    def _append(self):
        """One append, its acknowledgment logged by a callback whenever it completes; None if the
        partition moved away (the producer stops)."""
        pid, payload = self._payload()
        future = self.partition.append(RecordBatch(payload, 1))
        future.add_done_callback(lambda f, pid=pid: self._on_done(pid, f))
        return future

    def run(self) -> None:
        node, logs = self.node, self.node.logs
        interval = 1.0 / node.args.rate
        due = time.monotonic()
        while not node.quiesced.is_set():
            client = node.client
            if client is None or partition_on(client, self.name_) is not self.partition or not self.partition.is_open:
                logs.event("stopped-producing", partition=self.name_, why="not open here")
                return
            try:
                if self.burst_requested:
                    self.burst_requested = False
                    futures = [self._append() for _ in range(BURST)]
                    futures[-1].result(60)
                else:
                    self._append().result(60)
            except Exception as e:   # noqa: BLE001 - counted, retried with a new payload after a pause
                # By name: the class may move while the cluster package is restructured.
                if type(e).__name__ == "PartitionMovedError":
                    logs.event("stopped-producing", partition=self.name_, why="moved")
                    return
                logs.error(e, self.name_)
                time.sleep(0.05)
                continue
            due = max(due + interval, time.monotonic() - 1.0)
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--node-id", type=int, required=True)
    ap.add_argument("--incarnation", type=int, required=True)
    ap.add_argument("--wal", required=True, help="the WAL file (its directory is the node's disk)")
    ap.add_argument("--ack-log", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--meta", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--heartbeat-interval", type=float, default=0.2)
    ap.add_argument("--heartbeat-timeout", type=float, default=1.5)
    ap.add_argument("--migration-timeout", type=float, default=5.0)
    ap.add_argument("--agent-interval", type=float, default=0.05)
    ap.add_argument("--rate", type=float, default=100.0, help="appends per second per partition")
    ap.add_argument("--upload-interval", type=float, default=0.2)
    ap.add_argument("--close-timeout", type=float, default=30.0)
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s n{args.node_id}.{args.incarnation} %(name)s %(levelname)s %(message)s")
    node = Node(args)
    try:
        node.start()
    except Exception as e:   # noqa: BLE001 - the harness restarts the node, as a supervisor would
        node.logs.error(e, where="start")
        traceback.print_exc()
        return 2
    quiescing = None
    while not STOP.is_set():
        if getattr(node.agent, "fenced", False):
            node.logs.event("fenced")
            sys.stderr.flush()
            os._exit(FENCED_EXIT)          # no close: a fenced node can commit nothing
        if QUIESCE.is_set() and quiescing is None:
            quiescing = threading.Thread(target=node.quiesce, daemon=True)
            quiescing.start()
        if BURST_REQUESTED.is_set():
            BURST_REQUESTED.clear()
            node.burst()
        node.reconcile()
        STOP.wait(0.01)
    return node.shutdown()


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stderr.flush()
    os._exit(code)       # without waiting for the library's daemon threads
