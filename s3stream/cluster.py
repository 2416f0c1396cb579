"""Nodes, assignment, migration and failover over shared metadata (article 000).

State in metadata KV (JSON values):
- `assignment/<partition>`: {"node": id, "version": n}: where the partition should be open;
  every change bumps the version (a migration is one version).
- `opened/<partition>`: {"node", "version", "leader_epoch", "at"}: written by the node that
  opened it for that version; `closed/<partition>` likewise by the node that closed it, with
  the bytes its close force-uploaded.
Nodes register (node epoch + 1) and heartbeat through the metadata store.

Each node runs a NodeAgent: a bounded background loop that heartbeats and makes the node's open
partitions equal to its assignment, closing what was moved away (force upload of the tail only)
and opening what was moved to it (epoch + 1). `Cluster.migrate` changes an assignment and waits
for the target to report the partition open, which takes time in the un-uploaded tail, never in
the history. If the source does not let go in time, it is fenced and failed over.

Failover: when a node's heartbeat is older than the timeout (or on request), one live node,
elected through KV, fences it, commits its WAL's records on its behalf (s3stream.failover) and
reassigns its partitions to the live nodes.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from .client import StreamClient
from .config import Config
from .errors import ConfigError, FencedLeaderError, S3StreamError, StreamFencedError, StreamNotClosedError
from .failover import FailoverReport, fail_over
from .latency import DURATION_BUCKETS, LatencyHistogram
from .loadreport import LoadReporter
from .metadata import MetadataStore
from .objectstore import ObjectStore

log = logging.getLogger("s3stream.cluster")


@dataclass(frozen=True)
class ClusterConfig:
    """agent_interval: seconds between a node agent's passes when the metadata store cannot push
        changes (SQLite: assignment changes are seen within it). push_fallback_interval: with a
        store that pushes KV changes (PostgreSQL LISTEN/NOTIFY), agents and migrations wake on
        each change and pass at least this often anyway. heartbeat_interval / heartbeat_timeout: a node silent for the timeout is failed over
        (if auto_failover). migration_timeout: seconds a migration waits for the source to let go
        before fencing and failing it over. max_parallel_moves: partitions a node opens or closes
        at once (the agent's thread bound). report_interval: seconds between a node's load reports
        (s3stream.loadreport: per-partition bytes in/out per second over the last report_window
        seconds, and append/fetch p99), which the balancer reads."""
    agent_interval: float = 0.02
    push_fallback_interval: float = 0.5
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 5.0
    migration_timeout: float = 10.0
    max_parallel_moves: int = 4
    auto_failover: bool = True
    report_interval: float = 1.0
    report_window: float = 10.0

    def __post_init__(self) -> None:
        for name in ("agent_interval", "push_fallback_interval", "heartbeat_interval", "heartbeat_timeout",
                     "migration_timeout", "report_interval", "report_window"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive seconds, got {getattr(self, name)}")
        if self.heartbeat_timeout <= 2 * self.heartbeat_interval:
            raise ConfigError("heartbeat_timeout must exceed twice heartbeat_interval")
        if self.max_parallel_moves < 1:
            raise ConfigError(f"max_parallel_moves must be >= 1, got {self.max_parallel_moves}")


@dataclass
class MigrationReport:
    partition: str
    source: int | None
    target: int
    seconds: float
    tail_bytes: int          # bytes the source force-uploaded for this partition
    leader_epoch: int
    failed_over: bool        # the source did not let go in time and was fenced
    close_seconds: float = 0.0   # the source's close (wait for appends, force upload, commit)
    open_seconds: float = 0.0    # the target's open (epoch + 1, checkpoint read and write)


#: Seconds of every migration this process completed (Cluster.migrate: from the assignment to
#: the target's open), whichever nodes it moved between; exported as s3stream_migration_seconds.
MIGRATION_SECONDS = LatencyHistogram(DURATION_BUCKETS)


def _get(meta: MetadataStore, key: str) -> dict | None:
    raw = meta.get_kv(key)
    return None if raw is None else json.loads(raw)


def _put(meta: MetadataStore, key: str, value: dict) -> None:
    meta.put_kv(key, json.dumps(value).encode())


class Cluster:
    """An admin view of the cluster: any process with the shared metadata and store may use it."""

    def __init__(self, metadata: MetadataStore, store: ObjectStore | None, config: ClusterConfig | None = None,
                 engine_config: Config | None = None, clock: Callable[[], int] = time.time_ns) -> None:
        """`store` may be None for a view that only reads and assigns (fail_over needs it).
        `clock` gives the time in ns that heartbeats are judged by: the clock the metadata
        store stamps them with (inject the same fake one into both in tests)."""
        self.meta = metadata
        self.store = store
        self.config = config or ClusterConfig()
        self.engine_config = engine_config
        self.clock = clock

    # ---- assignment ----------------------------------------------------------------------------

    def assignment(self, name: str) -> dict | None:
        return _get(self.meta, f"assignment/{name}")

    def assignments(self) -> dict[str, dict]:
        return {k.split("/", 1)[1]: json.loads(v) for k, v in self.meta.list_kv("assignment/").items()}

    def assign(self, name: str, node_id: int, guard: tuple[str, bytes] | None = None) -> int:
        """Point the partition at `node_id`; returns the new assignment version. The version is
        bumped by compare-and-set, so concurrent assigners (any host) never reuse one. With
        `guard` = (KV key, value), the write happens only while that key holds that value (a
        leader's lease: see s3stream.balancer.lease); else FencedLeaderError."""
        key = f"assignment/{name}"
        while True:
            raw = self.meta.get_kv(key)
            version = (json.loads(raw)["version"] if raw is not None else 0) + 1
            value = json.dumps({"node": node_id, "version": version}).encode()
            if self.meta.replace_kv(key, raw, value, guard=guard):
                return version
            if guard is not None and self.meta.get_kv(guard[0]) != guard[1]:
                raise FencedLeaderError(
                    f"not assigning {name!r} to node {node_id}: {guard[0]!r} no longer holds this "
                    "leader's lease (another leader took over); the deposed leader stops acting")

    def owner(self, name: str) -> int | None:
        """The node the partition is open on now (None while it moves)."""
        a, o = self.assignment(name), _get(self.meta, f"opened/{name}")
        if a and o and o["version"] == a["version"]:
            return o["node"]
        return None

    def live_nodes(self) -> list[int]:
        now = self.clock()
        timeout = int(self.config.heartbeat_timeout * 1e9)
        return sorted(n.node_id for n in self.meta.list_nodes() if not n.failover and now - n.heartbeat_ns < timeout)

    # ---- migration ----------------------------------------------------------------------------

    def wait_open(self, name: str, version: int, timeout: float) -> dict | None:
        """The `opened/` record of `name` once some node reports `version` open; None after
        `timeout`. Woken by the store's pushes where it has them, else polling every 2 ms."""
        deadline = time.monotonic() + timeout
        feed = self.meta.kv_changes((f"opened/{name}",))
        try:
            while True:
                o = _get(self.meta, f"opened/{name}")
                if o and o["version"] >= version:
                    return o
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if feed.pushes:
                    feed.wait(min(left, self.config.push_fallback_interval))
                else:
                    time.sleep(min(left, 0.002))
        finally:
            feed.close()

    def migrate(self, name: str, to_node: int, timeout: float | None = None,
                guard: tuple[str, bytes] | None = None) -> MigrationReport:
        """Move a partition to `to_node`: the source closes it (force upload of its tail), the
        target opens it with a new epoch. Falls back to fencing + failover of the source if it
        does not let go within the timeout. `guard`: as for `assign` (a leader's lease)."""
        timeout = self.config.migration_timeout if timeout is None else timeout
        if to_node not in self.live_nodes():
            raise S3StreamError(
                f"cannot migrate {name!r} to node {to_node}: it is not a live node (no recent heartbeat, or failed "
                f"over); live nodes: {self.live_nodes()}")
        current = self.assignment(name)
        source = current["node"] if current else None
        t0 = time.perf_counter()
        version = self.assign(name, to_node, guard=guard)
        opened = self.wait_open(name, version, timeout)
        failed_over = False
        if opened is None and source is not None and source != to_node:
            closed = _get(self.meta, f"closed/{name}")
            if not closed or closed["version"] < version:
                log.warning("migration of %s: node %d did not let go in %.1f s: failing it over", name, source, timeout)
                self.fail_over(source, reassign=False)
                failed_over = True
                opened = self.wait_open(name, version, timeout)
        if opened is None:
            raise S3StreamError(f"partition {name!r} was not opened on node {to_node} within {timeout} s")
        closed = _get(self.meta, f"closed/{name}")
        mine = closed if closed and closed["version"] == version else {}
        report = MigrationReport(name, source, to_node, time.perf_counter() - t0, mine.get("tail_bytes", 0),
                                 opened["leader_epoch"], failed_over, mine.get("seconds", 0.0),
                                 opened.get("seconds", 0.0))
        MIGRATION_SECONDS.observe(report.seconds)
        return report

    # ---- failover ------------------------------------------------------------------------------

    def claim_failover(self, node_id: int, node_epoch: int, claimant: int) -> bool:
        """Win the right to fail over this epoch of `node_id`, through KV. Claims are numbered
        attempts (`failover/<node>/<epoch>/<n>`, written if absent): a later attempt may be
        claimed only once the latest claimant is no longer live (it died mid-way) or its claim is
        older than the heartbeat timeout plus the migration timeout, so a claim never blocks a
        failover for good. True if `claimant` now holds the latest claim."""
        prefix = f"failover/{node_id}/{node_epoch}/"
        claims = {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in self.meta.list_kv(prefix).items()}
        now = self.clock()
        if claims:
            latest = max(claims)
            holder = claims[latest]
            stale_ns = int((self.config.heartbeat_timeout + self.config.migration_timeout) * 1e9)
            if holder["node"] == claimant:
                return True
            if holder["node"] in self.live_nodes() and now - holder["at_ns"] < stale_ns:
                return False
            log.warning("failover claim %d of node %d (epoch %d) by node %d is stale: claiming it again",
                        latest, node_id, node_epoch, holder["node"])
            attempt = latest + 1
        else:
            attempt = 0
        value = json.dumps({"node": claimant, "at_ns": now}).encode()
        return self.meta.put_kv_if_absent(f"{prefix}{attempt}", value) == value

    def fail_over(self, node_id: int, reassign: bool = True) -> FailoverReport:
        """Fence `node_id`, commit its WAL on its behalf, close its streams; then (if `reassign`)
        spread its partitions over the live nodes."""
        if self.store is None:
            raise S3StreamError(f"cannot fail node {node_id} over: this Cluster view has no object store to "
                                "commit its WAL to; make it with one")
        report = fail_over(node_id, store=self.store, metadata=self.meta, config=self.engine_config)
        if reassign:
            live = [n for n in self.live_nodes() if n != node_id]
            if not live:
                raise S3StreamError(f"node {node_id} failed over but no live node can take its partitions")
            mine = sorted(name for name, a in self.assignments().items() if a["node"] == node_id)
            for i, name in enumerate(mine):
                self.assign(name, live[i % len(live)])
        return report


class NodeAgent:
    """Keeps one node's open partitions equal to its assignment, heartbeats, and fails over dead
    peers. One loop thread plus at most `max_parallel_moves` workers."""

    def __init__(self, client: StreamClient, cluster: Cluster) -> None:
        self.client = client
        self.cluster = cluster
        self.config = cluster.config
        self.node_id = client.node_id
        self._busy: set[str] = set()
        self._published: dict[str, int] = {}      # partition -> assignment version confirmed open
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=self.config.max_parallel_moves,
                                        thread_name_prefix=f"agent-{self.node_id}")
        self._last_heartbeat = 0.0
        self._reporter = LoadReporter(self.node_id, self.config.report_window)
        self._last_report = 0.0
        # Opened before the first pass reads the assignments, so no change in between is missed.
        self._feed = client.metadata.kv_changes(("assignment/", "closed/"))
        self._retry_soon = False
        self.fenced = False
        self.errors: deque[str] = deque(maxlen=100)     # the latest failures, bounded
        self._thread = threading.Thread(target=self._run, name=f"node-agent-{self.node_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._feed.wake()
        self._thread.join()
        self._pool.shutdown(wait=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._pass()
                except StreamFencedError as e:
                    log.error("node %d is fenced; its agent stops: %s", self.node_id, e)
                    self.fenced = True
                    return
                except Exception as e:   # noqa: BLE001 - the next pass retries
                    log.exception("node agent %d pass failed", self.node_id)
                    self.errors.append(str(e))
                self._wait_for_change()
        finally:
            self._feed.close()

    def _wait_for_change(self) -> None:
        """Until the next pass: a pushed change of an assignment or of a partition's close (a
        target retries its open when the source lets go), the next heartbeat, or a moved
        partition's open or close finishing; polling every agent_interval where the store cannot
        push."""
        if not self._feed.pushes:
            self._retry_soon = False
            self._stop.wait(self.config.agent_interval)
            return
        if self._retry_soon:
            # A move that failed (the source had not let go) is retried when the source's close
            # is pushed (closed/), and after agent_interval at the latest: its close may have
            # landed while the open was under way, its push consumed unseen.
            self._retry_soon = False
            self._feed.wait(self.config.agent_interval)
            return
        now = time.monotonic()
        due = min(self._last_heartbeat + self.config.heartbeat_interval,
                  self._last_report + self.config.report_interval) - now
        self._feed.wait(max(0.0, min(self.config.push_fallback_interval, due)))

    def _pass(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat >= self.config.heartbeat_interval:
            self.client.metadata.heartbeat(self.node_id, self.client.node_epoch)
            self._last_heartbeat = now
            if self.config.auto_failover:
                self._fail_over_dead_peers()
        if now - self._last_report >= self.config.report_interval:
            self._reporter.publish(self.client.metadata, self.client.partitions())
            self._last_report = now
        assigned = self.cluster.assignments()
        mine = {name: a["version"] for name, a in assigned.items() if a["node"] == self.node_id}
        open_now = {p.name: p for p in self.client.partitions()}
        for name, partition in open_now.items():
            if name not in mine:
                version = assigned.get(name, {}).get("version", 0)
                self._submit(name, self._close, partition, version)
        for name, version in mine.items():
            if name not in open_now:
                self._submit(name, self._open, name, version)
            elif self._published.get(name, 0) < version:
                # Re-assigned to the node that already has it open: confirm the new version.
                p = open_now[name]
                _put(self.client.metadata, f"opened/{name}", {"node": self.node_id, "version": version,
                                                            "leader_epoch": p.leader_epoch, "at": time.time(),
                                                            "seconds": 0.0})
                self._published[name] = version

    def _submit(self, name: str, fn, *args) -> None:
        with self._lock:
            if name in self._busy:
                return
            self._busy.add(name)

        def task():
            try:
                fn(*args)
            except StreamNotClosedError:
                self._retry_soon = True    # the source has not let go yet: a pass soon
            except Exception as e:        # noqa: BLE001 - reported, retried by the next pass
                log.exception("node %d: moving partition %s failed", self.node_id, name)
                self.errors.append(f"{name}: {e}")
                self._retry_soon = True
            finally:
                with self._lock:
                    self._busy.discard(name)

        self._pool.submit(task)

    def _open(self, name: str, version: int) -> None:
        t0 = time.perf_counter()
        partition = self.client.open_partition(name)
        _put(self.client.metadata, f"opened/{name}", {"node": self.node_id, "version": version,
                                                    "leader_epoch": partition.leader_epoch, "at": time.time(),
                                                    "seconds": time.perf_counter() - t0})
        self._published[name] = version

    def _close(self, partition, version: int) -> None:
        report = partition.close()
        _put(self.client.metadata, f"closed/{partition.name}",
             {"node": self.node_id, "version": version, "tail_bytes": report.tail_bytes,
              "seconds": report.seconds, "at": time.time()})

    def _fail_over_dead_peers(self) -> None:
        """Claim and start the failover of each peer whose heartbeat expired. The failover runs
        on the agent's pool, never in this loop: a long WAL replay must not stop this node's own
        heartbeats (the loop keeps running; the busy set keeps it from starting twice)."""
        now = self.cluster.clock()
        timeout = int(self.config.heartbeat_timeout * 1e9)
        for node in self.client.metadata.list_nodes():
            if node.node_id == self.node_id or node.failover or now - node.heartbeat_ns < timeout:
                continue
            if f"failover/{node.node_id}" in self._busy:
                continue
            if not self.cluster.claim_failover(node.node_id, node.node_epoch, self.node_id):
                continue
            log.warning("node %d: node %d missed heartbeats for %.1f s: failing it over", self.node_id,
                        node.node_id, (now - node.heartbeat_ns) / 1e9)
            self._submit(f"failover/{node.node_id}", self.cluster.fail_over, node.node_id)
