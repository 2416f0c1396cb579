"""NodeAgent: one node's part in the cluster protocol (docs/migration.md).

Two loops, each on its own thread, so that neither waits for the other:
- the lease keeper heartbeats every heartbeat_interval with the node's health; each heartbeat
  the store accepts at this node's epoch renews the node's lease (StreamClient.renew_lease: the
  engine acknowledges appends only within it). A heartbeat refused because the node's epoch
  moved on means this node was fenced: the client is told at once (StreamClient.fence) and
  the agent stops. A node stuck for longer than unhealthy_grace (a problem for good: its WAL
  failed, uploads stopped) stops heartbeating, so that its lease lapses and a peer fails it
  over; the lease keeper runs until the client is closed, past the agent's own stop.
- the agent loop judges peers (s3stream.cluster.detector: silence counted only while this node
  reaches the store and can serve), claims and runs failovers on its worker pool, publishes
  load reports, and makes the partitions open here equal to those assigned here: it closes
  what moved away and opens what moved here, reporting each only once it is true.

The steps are methods a test or a simulation may call one at a time (`heartbeat_once`,
`judge_once`, `reconcile_once`); the threads only repeat them.
"""
from __future__ import annotations

import gc
import json
import logging
import threading
import zlib
from collections import deque
from collections.abc import Sequence
from typing import Callable

from ..client import StreamClient
from ..errors import ConfigError, MetadataBusyError, S3StreamError, StreamFencedError, StreamNotClosedError
from .cluster import Cluster, put_json
from .detector import FailureDetector
from . import metrics as cluster_metrics
from .loadreport import LoadReporter
from .hold import AppendHold
from .partition import (Partition, close_partitions, closed_key, open_partition, open_partitions, partition_table,
                        partitions_on)
from .runtime import THREADS
from ..threads import thread_nice

log = logging.getLogger("s3stream.cluster")

#: Most partitions one task of the agent opens or closes together (`_submit_batches`): one batch's
#: metadata transactions (an open: a read of the close records, one open of all their streams, one
#: write of the opened/ records; a close: one commit) stay bounded, and max_parallel_moves batches
#: run at once.
OPEN_BATCH = 500
#: The fallback reconciliation (push_fallback_interval) runs at most one part in this many of the
#: agent's time: at 10,000 partitions a pass costs ~40 ms, so it runs every ~4 s, not twice a second.
RECONCILE_SHARE = 100
#: Pushed changes reconcile at most every this many times the last pass's cost: a burst of
#: them (a failover reassigning 10,000 partitions, a thousand at a time) is taken in a few
#: passes, not one per datagram, and the passes leave the opens most of the time. At 10
#: partitions a pass costs well under a millisecond: a move waits for no spacing worth the name
#: (and never for more than half a second).
RECONCILE_SPACING = 2


#: Judgements of peers per heartbeat_interval (NodeAgent._judge_interval).
JUDGES_PER_HEARTBEAT = 4


#: Python's own collection thresholds: a process still at them has not tuned its collector.
PYTHON_GC_DEFAULTS = (700, 10, 10)


def tune_collector(thresholds: tuple[int, int, int] | None) -> None:
    """Set the interpreter's collection thresholds (ClusterConfig.gc_thresholds) if the process
    still has Python's defaults: a program that tuned its own collector keeps its tuning."""
    if thresholds is not None and gc.get_threshold() == PYTHON_GC_DEFAULTS:
        gc.set_threshold(*thresholds)


class NodeAgent:
    """Keeps one node's open partitions equal to its assignment, holds its lease, and fails
    over dead peers. Two loop threads plus at most `max_parallel_moves` workers."""

    def __init__(self, client: StreamClient, cluster: Cluster, *, start: bool = True) -> None:
        if not isinstance(cluster, Cluster):
            raise ConfigError(f"NodeAgent needs an s3stream.cluster.Cluster, got {cluster!r} "
                              f"({type(cluster).__name__}); e.g. NodeAgent(client, Cluster(metadata_url, store_url))")
        if cluster.meta is not client.metadata:
            _check_same_metadata(client, cluster)
        self.client = client
        self.cluster = cluster
        self.config = cluster.config
        self.node_id = client.node_id
        self.node_epoch = client.node_epoch
        self.runtime = cluster.runtime
        self.clock: Callable[[], int] = cluster.monotonic
        self._busy: set[str] = set()
        # Names a pass wanted to start a task for while one ran (a change came meanwhile).
        self._wanted_while_busy: set[str] = set()
        # Partition -> the assignment version an open task claimed for it is for: a pass that
        # finds it still assigned at that version leaves it to that task (it is not "wanted
        # again": each open finishing would wake another pass of every assignment).
        self._opening: dict[str, int] = {}
        self._not_before: dict[str, tuple[int, int]] = {}   # task name -> (retry not before, failures)
        self._published: dict[str, int] = {}      # partition -> assignment version confirmed open
        self._open_failures: dict[tuple[str, int], list[str]] = {}   # (partition, version) -> errors
        self._lock = threading.Lock()
        self._stop = self.runtime.event()
        self._lease_wake = self.runtime.event()      # set when the lease keeper must stop at once
        self._pool = self.runtime.executor(self.config.max_parallel_moves, f"agent-{self.node_id}")
        self._raised = threading.local()          # this agent's threads that run at agent_priority
        self.detector = FailureDetector(self.config.heartbeat_timeout, 2 * self.config.heartbeat_interval)
        self._last_judged = 0
        self._last_reconciled = 0
        self._reconcile_cost = 0.0           # seconds the last reconciliation took
        self._gone: set[int] = set()             # nodes failed over or forgotten, as last judged
        self._reporter = LoadReporter(self.node_id, self.config.report_window)
        self._last_report = 0.0
        self._renewed_ns: int | None = None       # start of the last accepted heartbeat
        self._unhealthy_since: int | None = None
        self.last_health: dict = {"serving": True}     # what the last heartbeat said
        self.last_served = True
        self._meta_problem: str | None = None
        # Why this agent's own passes fail, if they do for a reason other than the store being
        # away (its view of the cluster is broken): it cannot serve meanwhile.
        self._view_problem: str | None = None
        self._judge_healthy = False
        self._retry_soon = False
        self.fenced = False
        self.errors: deque[str] = deque(maxlen=100)     # the latest failures, bounded
        self.stats = dict(heartbeats=0, heartbeat_failures=0, failovers_started=0, opens=0, open_failures=0,
                          closes=0, close_failures=0, handed_on=0, unexpected_errors=0)
        # This node's moves go first: they hold its partitions' appends (s3stream.cluster.hold).
        self.hold = AppendHold(self.runtime, self.config.move_hold, self.config.move_hold_share)
        partition_table(client).hold = self.hold
        tune_collector(self.config.gc_thresholds)
        # Opened before the first pass reads the assignments, so no change in between is missed.
        self._feed = client.metadata.kv_changes(("assignment/", "closed/"))
        self._threads: list = []
        cluster_metrics.track(self)
        if start:
            # The first lease before the first pass: this node serves nothing before it holds one.
            self.heartbeat_once()
            self._lease_thread = self.runtime.spawn(f"node-lease-{self.node_id}", self._keep_lease)
            self._threads.append(self.runtime.spawn(f"node-agent-{self.node_id}", self._run))

    @property
    def stopped(self) -> bool:
        """Whether `stop()` was called."""
        return self._stop.is_set()

    def stop(self) -> None:
        """Stop moving partitions and judging peers. The lease is kept until the client is
        closed (or fenced): a client closing after its agent stopped still acknowledges the
        appends it waits for, and a client that goes on running stays a node its peers see
        alive, acknowledging only under its lease."""
        self._stop.set()
        self._feed.wake()
        for thread in self._threads:
            thread.join()
        self._pool.shutdown(wait=True)
        self._feed.close()

    # ---- health and the lease ------------------------------------------------------------------

    def health(self) -> dict:
        """What this node's heartbeat says: whether it can serve, and if not why: the engine's
        health, uploads failing for longer than heartbeat_timeout counting as a problem
        (whether it reaches the metadata store is known by whether the heartbeat lands)."""
        health = self.client.health()
        # The engine's problems are for good (fenced, WAL failed, uploads stopped): only those
        # make the node give its partitions up after unhealthy_grace. Uploads that keep failing
        # (the store down, for everyone perhaps) only keep it from taking more and from judging.
        health["stuck"] = not health["serving"]
        if self._view_problem is not None:
            # It cannot see its assignments nor judge: it takes nothing and judges nobody. Not
            # stuck: the partitions it holds still take appends, and giving its lease up would
            # stop them (every node's, when all agents share the fault).
            health["problems"] = [*health["problems"], f"its agent cannot read the cluster: {self._view_problem}"]
            health["serving"] = False
        failing = health.get("uploads_failing_seconds", 0.0)
        if failing > self.config.heartbeat_timeout:
            health["problems"] = [*health["problems"], f"uploads failing for {failing:.0f} s: "
                                                       f"{health.get('uploads_failing')}"]
            health["serving"] = False
        return health

    def heartbeat_once(self) -> bool:
        """One heartbeat: renew the lease if the store accepts it; True if it did."""
        if self.client.fenced:             # the engine saw the fence first (an upload's commit)
            self._fence("its engine was fenced")
            return False
        started = self.clock()
        health = self.health()
        self.last_health = health
        now = started
        if not health["serving"] and self.last_served:
            log.warning("node %d cannot serve: %s", self.node_id, "; ".join(health["problems"]))
        self.last_served = health["serving"]
        if not health["stuck"]:
            self._unhealthy_since = None
        elif self._unhealthy_since is None:
            self._unhealthy_since = now
        if (self._unhealthy_since is not None
                and now - self._unhealthy_since > self.config.unhealthy_grace * 1e9 and not self._meta_problem):
            # Give up this node's partitions: without renewals its lease lapses and a peer
            # fails it over (replaying its WAL), unless it recovers first.
            if self.stats["heartbeats"] and self.stats.get("gave_up", 0) == 0:
                log.error("node %d could not serve for %.0f s (%s): it stops renewing its lease so that a peer "
                          "fails it over", self.node_id, self.config.unhealthy_grace, "; ".join(health["problems"]))
            self.stats["gave_up"] = self.stats.get("gave_up", 0) + 1
            try:
                # Still learn of the failover it waits for: then it stops (its process may restart).
                if self.client.metadata.get_node(self.node_id).node_epoch != self.node_epoch:
                    self._fence("failed over while it could not serve")
            except Exception:   # noqa: BLE001 - asked again at the next heartbeat
                pass
            return False
        try:
            self.client.metadata.heartbeat(self.node_id, self.node_epoch, json.dumps(health, sort_keys=True))
        except StreamFencedError as e:
            self._fence(f"its heartbeat was refused: {e}")
            return False
        except Exception as e:   # noqa: BLE001 - the store is unreachable: the lease runs out, the agent goes on
            # Time unable to serve counts only while the store answers: uploads fail with it, and
            # an outage must not make every node give itself up once it ends.
            self._unhealthy_since = None
            self.stats["heartbeat_failures"] += 1
            if self._meta_problem is None:
                log.warning("node %d cannot heartbeat: %s", self.node_id, e)
            self._meta_problem = str(e)
            self.client.lease_renewal_failed(e)
            return False
        if self._meta_problem is not None:
            log.info("node %d heartbeats again", self.node_id)
        self._meta_problem = None
        self._renewed_ns = started
        self.client.renew_lease(started, self.config.lease)
        self.stats["heartbeats"] += 1
        return True

    def _fence(self, why: str) -> None:
        """This node was fenced: the client stops at once, and so does this agent."""
        if not self.fenced:
            log.error("node %d epoch %d is fenced (%s); it stops", self.node_id, self.node_epoch, why)
        self.fenced = True
        self.client.fence(why)
        self._stop.set()
        self._lease_wake.set()
        self._feed.wake()

    def _keep_lease(self) -> None:
        """Heartbeat every heartbeat_interval until the client is closed or this node fenced
        (not when the agent stops: see stop)."""
        interval = self.config.heartbeat_interval
        self._raise_priority()
        while not self.fenced and not self.client.closed:
            started = self.clock()
            try:
                self.heartbeat_once()
            except Exception:   # noqa: BLE001 - never let the lease keeper die
                log.exception("node %d heartbeat failed", self.node_id)
            self._lease_wake.wait(max(0.0, interval - (self.clock() - started) / 1e9))

    # ---- the agent loop ------------------------------------------------------------------------

    def _raise_priority(self) -> None:
        """Run the calling thread (one of this agent's) at agent_priority, once per thread; only
        with the real runtime (a simulation's threads are not the process's)."""
        if self.runtime is not THREADS or not self.config.agent_priority or getattr(self._raised, "done", False):
            return
        self._raised.done = True
        if not thread_nice(-self.config.agent_priority) and not _PRIORITY_REFUSED:
            _PRIORITY_REFUSED.append(self.node_id)
            log.info("node %d: the agent's threads keep the process's priority (raising it by agent_priority %d needs "
                     "CAP_SYS_NICE or RLIMIT_NICE); moves may wait behind producers for the CPU", self.node_id,
                     self.config.agent_priority)

    def _run(self) -> None:
        self._raise_priority()
        failing = False
        changed = True
        last_problem: str | None = None
        while not self._stop.is_set():
            # After a pass that failed, the next one reconciles: only a pass that read the
            # assignments tells whether the agent's view works again.
            reconcile = changed or failing or self._view_problem is not None
            try:
                self.pass_once(reconcile=reconcile)
                if failing:
                    log.info("node agent %d passes again", self.node_id)
                failing = False
                if reconcile:
                    if self._view_problem is not None:
                        log.info("node agent %d reads the cluster again", self.node_id)
                    self._view_problem = last_problem = None
            except StreamFencedError as e:
                self._fence(str(e))
                return
            except MetadataBusyError as e:   # the store is down or busy: once per episode, then quiet
                if not failing:
                    log.warning("node agent %d cannot reach the metadata store; it retries: %s", self.node_id, e)
                failing = True
                self.errors.append(str(e))
            except Exception as e:   # noqa: BLE001 - the next pass retries
                unexpected = not isinstance(e, (S3StreamError, OSError))
                problem = f"{type(e).__name__}: {e}"
                if problem != last_problem:      # once in a row, not every agent_interval
                    log.error("node agent %d pass failed%s", self.node_id,
                              "; it cannot serve until its passes work" if unexpected else "", exc_info=True)
                last_problem = problem
                self.stats["unexpected_errors"] += unexpected
                self.errors.append(str(e))
                # A failure no step raises on purpose: this agent's own view of the cluster is
                # broken (not the store: that is MetadataBusyError above), and a node that
                # cannot see its assignments must not say it can serve.
                self._view_problem = problem if unexpected else None
            changed = self._wait_for_change()

    def pass_once(self, reconcile: bool = True) -> None:
        """Judge peers and report load when due; reconcile the partitions if `reconcile` (a
        change was pushed, or polling) or if push_fallback_interval passed since the last time."""
        now = self.clock()
        if now - self._last_judged >= self._judge_interval() * 1e9:
            self._last_judged = now
            self.judge_once(now)
        mono = now / 1e9
        if mono - self._last_report >= self.config.report_interval:
            self._last_report = mono             # a report that fails waits for the next interval
            self._reporter.publish(self.client.metadata, partitions_on(self.client))
        if reconcile or now - self._last_reconciled >= self._fallback_interval() * 1e9:
            self._last_reconciled = now
            started = self.clock()
            try:
                self.reconcile_once()
            finally:
                self._reconcile_cost = (self.clock() - started) / 1e9

    def _judge_interval(self) -> float:
        """Seconds between judgements: a peer's silence counts from the judgement that first
        saw its last heartbeat, so judging once per heartbeat_interval put up to that much on
        every failover's detection (heartbeat_timeout + 0-0.5 s by default); JUDGES_PER_HEARTBEAT
        times as often, a read of the node rows each, puts at most a quarter of it."""
        return self.config.heartbeat_interval / JUDGES_PER_HEARTBEAT

    def _fallback_interval(self) -> float:
        """Seconds between reconciliations nothing asked for (a push that got lost):
        push_fallback_interval, or longer where a reconciliation costs more than
        1/RECONCILE_SHARE of that (thousands of partitions), so that at rest this fallback
        takes at most that share of a core however many partitions the node holds."""
        return max(self.config.push_fallback_interval, self._reconcile_cost * RECONCILE_SHARE)

    def _wait_for_change(self) -> bool:
        """Until the next pass: a pushed change of an assignment or of a partition's close (a
        target retries its open when the source lets go), the next judgement, or a moved
        partition's open or close finishing; polling every agent_interval where the store cannot
        push. True if the partitions should be reconciled (a change, a retry, or polling); a
        pass woken only to judge peers reads no assignment."""
        if not self._feed.pushes:
            self._retry_soon = False
            self._stop.wait(self.config.agent_interval)
            return True
        # Spaced by what a pass costs (RECONCILE_SPACING): changes pushed meanwhile wait in the
        # feed and are taken together.
        spacing = min(0.5, RECONCILE_SPACING * self._reconcile_cost)
        since = (self.clock() - self._last_reconciled) / 1e9 - self._reconcile_cost
        if since < spacing:
            self._stop.wait(spacing - since)
        if self._retry_soon:
            # A move that failed (the source had not let go) is retried when the source's close
            # is pushed (closed/), and after agent_interval at the latest.
            self._retry_soon = False
            self._feed.wait(self.config.agent_interval)
            return True
        now = self.clock() / 1e9
        due = min(self._last_judged / 1e9 + self._judge_interval() - now,
                  self._last_report + self.config.report_interval - now,
                  self._last_reconciled / 1e9 + self._fallback_interval() - now)
        # At least agent_interval: a pass that failed before its due steps (the store down)
        # must not spin. At most that while a task runs: one that ends with the source not
        # let go does not wake this loop (_submit), which then retries within agent_interval
        # if no change is pushed first.
        with self._lock:
            busy = bool(self._busy)
        timeout = self.config.agent_interval if busy else max(self.config.agent_interval,
                                                              min(self.config.push_fallback_interval, due))
        return self._feed.wait(timeout)

    # ---- judging peers --------------------------------------------------------------------------

    def _may_judge(self, now: int) -> bool:
        """A node judges only while it can serve and holds a lease it renewed recently."""
        return (self.last_health.get("serving", False) and self._renewed_ns is not None
                and now - self._renewed_ns < self.config.lease * 1e9 and not self.fenced)

    def judge_once(self, now: int) -> list[int]:
        """Read every node's heartbeat record, count peers' silence, and start the failover of
        each peer silent for heartbeat_timeout (claimed first: one judge per failover). Returns
        the nodes whose failover this call started."""
        if not self._may_judge(now):
            if self._judge_healthy:
                self.detector.unreachable()      # no silence counts while this node cannot judge
            self._judge_healthy = False
            return []
        try:
            nodes = self.client.metadata.list_nodes()
        except Exception as e:   # noqa: BLE001 - this judge cannot read the store: nobody's silence counts
            self.detector.unreachable()
            self._judge_healthy = False
            self.errors.append(f"judging peers: {e}")
            return []
        if not self._judge_healthy:
            # Back from an outage of its own (or its first judgement): every peer gets a whole
            # heartbeat_timeout from here.
            self.detector.unreachable()
            self._judge_healthy = True
        peers = [n for n in nodes if n.node_id != self.node_id and not n.failover and not n.walless]
        self._gone = {n.node_id for n in nodes if n.failover}
        suspects = set(self.detector.observe(now, [(n.node_id, (n.node_epoch, n.heartbeat_ns)) for n in peers]))
        started: list[int] = []
        if not self.config.auto_failover:
            return started
        for node in peers:
            if node.node_id not in suspects or f"failover/{node.node_id}" in self._busy:
                continue
            if not self.cluster.claim_failover(node.node_id, node.node_epoch, self.node_id, self.node_epoch):
                continue
            silence = self.detector.silence(node.node_id)
            log.warning("node %d: node %d silent for %.1f s (counted while this node reached the store): failing "
                        "it over", self.node_id, node.node_id, silence)
            self.stats["failovers_started"] += 1
            self._submit(f"failover/{node.node_id}", self.cluster.fail_over, node.node_id,
                         judge=self.node_id, judge_epoch=self.node_epoch, lease_over=True,
                         if_unchanged=(node.node_epoch, node.heartbeat_ns),
                         reason=f"no heartbeat for {silence:.1f} s while node {self.node_id} reached the store")
            started.append(node.node_id)
        return started

    # ---- partitions ------------------------------------------------------------------------------

    def reconcile_once(self) -> None:
        """Close what is open here but assigned elsewhere; open what is assigned here; confirm
        a partition reassigned to this node that already serves it."""
        assigned = self.cluster.assignments()
        # Not those of a node this one is failing over now: that failover reassigns them.
        mine_failing = {n for n in self._gone if f"failover/{n}" in self._busy}
        if self._judge_healthy and any(a["node"] in self._gone - mine_failing for a in assigned.values()):
            # Partitions a failover or forget could not hand on (no live node then) move now.
            if self.cluster.reassign_orphans(skip=mine_failing, assigned=assigned):
                assigned = self.cluster.assignments()
        mine = {name: a["version"] for name, a in assigned.items() if a["node"] == self.node_id}
        open_now = {p.name: p for p in partitions_on(self.client)}
        with self._lock:
            opening = dict(self._opening)
        to_close: list[tuple[str, Partition, int]] = []
        for name, held in open_now.items():
            if name not in mine:
                to_close.append((name, held, assigned.get(name, {}).get("version", 0)))
        serving = self.last_health.get("serving", False) and not self.fenced
        to_open: list[tuple[str, int]] = []
        for name, version in mine.items():
            partition = open_now.get(name)
            if partition is None:
                if serving and opening.get(name) != version:
                    to_open.append((name, version))
            elif (self._published.get(name, 0) < version and partition.is_open and serving
                  and name not in self._busy):
                # Re-assigned to the node that already serves it: confirm the new version. Not
                # while a task of this node runs for it: an open publishes its own record (its
                # seconds and phases) before it ends, and this one would race it.
                self._publish_opened(name, version, partition.leader_epoch, 0.0, {})
            elif not partition.is_open and not partition.closed and name not in self._busy:
                # Half closed (a close failed while it was assigned elsewhere) and assigned here
                # again: finish the close, then the next pass opens it afresh.
                self._submit(name, self._close, partition, version)
        if to_close:
            self._submit_batches(to_close, self._close_batch)
        if to_open:
            self._submit_batches(to_open, self._open_batch, wake=False, opening=True)

    def _publish_opened(self, name: str, version: int, leader_epoch: int, seconds: float,
                        phases: dict[str, float]) -> None:
        self._publish_opened_many([(name, version, leader_epoch, seconds, phases)])

    def _publish_opened_many(self, opened: list[tuple[str, int, int, float, dict[str, float]]]) -> None:
        """Write the `opened/` record of each (name, version, leader epoch, seconds, phases),
        in one metadata write: the moves end when these are seen."""
        if not opened:
            return
        at = self.runtime.wall_ns() / 1e9
        records = [(f"opened/{name}", json.dumps({
            "node": self.node_id, "node_epoch": self.node_epoch, "version": version, "leader_epoch": leader_epoch,
            "at": at, "started": at - seconds, "seconds": seconds, "phases": phases}, sort_keys=True).encode())
            for name, version, leader_epoch, seconds, phases in opened]
        if len(records) == 1:
            self.client.metadata.put_kv(*records[0])
        else:
            self.client.metadata.put_kvs(records)
        for name, version, *_ in opened:
            self._published[name] = version

    def _claim(self, name: str) -> bool:
        """Mark `name` busy for a task of this node, unless one runs for it (it is then wanted
        again once that ends) or it backs off after failing: True if claimed."""
        with self._lock:
            if name in self._busy:
                self._wanted_while_busy.add(name)
                return False
            if self.clock() < self._not_before.get(name, (0, 0))[0]:
                return False
            self._busy.add(name)
            return True

    def _settle(self, name: str, error: Exception | None) -> tuple[bool, bool]:
        """Account for how a task for `name` ended (`error`, None if it succeeded): whether it
        failed, and whether it only found the source still holding the partition."""
        if error is None:
            return False, False
        if isinstance(error, StreamNotClosedError):
            self._retry_soon = True        # the source has not let go yet: no backoff, a pass soon
            return False, True
        if isinstance(error, StreamFencedError):
            if self.client.fenced:
                self._fence(str(error))
            else:
                self.errors.append(f"{name}: {error}")
                self._retry_soon = True
            return True, False
        if isinstance(error, (S3StreamError, OSError)):
            log.warning("node %d: %s failed: %s", self.node_id, name, error)
        else:                              # not raised on purpose: a bug, with its traceback
            self.stats["unexpected_errors"] += 1
            log.error("node %d: %s failed unexpectedly", self.node_id, name, exc_info=error)
        self.errors.append(f"{name}: {error}")
        self._retry_soon = True
        return True, False

    def _release(self, name: str, failed: bool, not_closed: bool, wake: bool = True) -> None:
        """A task for `name` ended: it is no longer busy; a failed one backs off. The loop
        looks again now after a failure, a change that came while it ran, or (`wake`) a success."""
        with self._lock:
            self._busy.discard(name)
            self._opening.pop(name, None)
            again = name in self._wanted_while_busy
            self._wanted_while_busy.discard(name)
            # A move that failed is tried again after a backoff (50 ms doubling to 2 s),
            # not at every pass: a close failing at once (the metadata store refusing it)
            # must not spin.
            tries = self._not_before.get(name, (0, 0))[1] + 1 if failed else 0
            if tries:
                delay = min(2.0, 0.05 * 2 ** (tries - 1))
                self._not_before[name] = (self.clock() + int(delay * 1e9), tries)
            else:
                self._not_before.pop(name, None)
        if failed or again or (wake and not not_closed):
            # The loop looks again now. Not after an open the source had not let go of,
            # unless a change came while it ran: the next try waits for the source's
            # close to be pushed (closed/), or agent_interval (_wait_for_change); woken
            # at once it would spin reads beside that close.
            self._feed.wake()

    def _submit(self, name: str, fn, *args, **kwargs) -> None:
        if not self._claim(name):
            return

        def task():
            self._raise_priority()
            error: Exception | None = None
            try:
                fn(*args, **kwargs)
            except Exception as e:        # noqa: BLE001 - reported, retried by the next pass
                error = e
            self._release(name, *self._settle(name, error))

        try:
            self._pool.submit(task)
        except RuntimeError:               # the pool is shut down: the agent is stopping
            with self._lock:
                self._busy.discard(name)

    def _submit_batches(self, wanted: Sequence[tuple], run: Callable[[list], dict[str, Exception]],
                        wake: bool = True, opening: bool = False) -> None:
        """Run `run` over the items `wanted` (name first) in batches (at most OPEN_BATCH, spread
        over max_parallel_moves workers), each batch one task of the pool: a batch of opens or
        closes costs a few metadata transactions, not a few per partition (issue 53). `run`
        returns the errors by name; each name is settled as a single task's would be. `wake`:
        whether the loop looks again when one succeeded (after a close, not after an open: a
        node taking 10,000 partitions in batches would read every assignment after each).
        `opening`: the items are opens, (name, assignment version): recorded in `_opening`
        until each is settled."""
        claimed = [item for item in wanted if self._claim(item[0])]
        if opening:
            with self._lock:
                self._opening.update((name, version) for name, version in claimed)
        # Spread over the workers: 8 partitions are 4 batches of 2 on 4 workers, not one of 8.
        size = max(1, min(OPEN_BATCH, -(-len(claimed) // self.config.max_parallel_moves)))
        for i in range(0, len(claimed), size):
            batch = claimed[i:i + size]

            def task(batch=batch):
                self._raise_priority()
                try:
                    errors = run(batch)
                except Exception as e:    # noqa: BLE001 - the batch's own failure: each name's
                    errors = {item[0]: e for item in batch}
                for item in batch:
                    self._release(item[0], *self._settle(item[0], errors.get(item[0])), wake=wake)

            try:
                self._pool.submit(task)
            except RuntimeError:           # the pool is shut down: the agent is stopping
                with self._lock:
                    for item in claimed[i:]:
                        self._busy.discard(item[0])
                        self._opening.pop(item[0], None)
                return

    def _open_batch(self, batch: list[tuple[str, int]]) -> dict[str, Exception]:
        """`_open` of many partitions together: opened in a bounded number of metadata
        transactions (open_partitions), published in one write, then their upkeep. Returns the
        errors by partition (those absent succeeded)."""
        if len(batch) == 1:
            name, version = batch[0]
            try:
                self._open(name, version)
            except Exception as e:        # noqa: BLE001 - settled by the caller
                return {name: e}
            return {}
        t0 = self.clock()
        errors: dict[str, Exception] = {}
        serving: list[Partition] = []
        with self.hold.moving():
            results = open_partitions(self.client, batch)
            records = []
            seconds = (self.clock() - t0) / 1e9
            for name, version in batch:
                result = results[name]
                if isinstance(result, Exception):
                    errors[name] = result
                    if not isinstance(result, StreamNotClosedError) and isinstance(result, S3StreamError):
                        self._count_open_failure(name, version, result)
                    continue
                self._open_failures.pop((name, version), None)
                self.stats["opens"] += 1
                if result.is_open:
                    serving.append(result)
                    records.append((name, version, result.leader_epoch, seconds, result.open_phases))
            self._publish_opened_many(records)
        for partition in serving:
            try:
                # After the move, not in it: the open's checkpoint durable, then upkeep.
                partition.trim_checkpoints(self.config.migration_timeout)
            except S3StreamError as e:           # the next open trims what is left
                self.errors.append(f"{partition.name}: after its open (the checkpoint made durable, older ones "
                                   f"trimmed): {e}")
        return errors

    def _open(self, name: str, version: int) -> None:
        # Until the record that the partition serves is written: the move ends when it is seen.
        with self.hold.moving():
            partition = self._open_partition(name, version)
        if partition is not None:
            try:
                # After the move, not in it: the open's checkpoint durable, then upkeep.
                partition.trim_checkpoints(self.config.migration_timeout)
            except S3StreamError as e:           # the next open trims what is left
                self.errors.append(f"{name}: after its open (the checkpoint made durable, older ones trimmed): {e}")

    def _open_partition(self, name: str, version: int) -> Partition | None:
        """`_open` up to its record: the partition if it serves, else None."""
        t0 = self.clock()
        try:
            # Hinted: the source's close record names the streams and the checkpoint.
            partition = open_partition(self.client, name, hinted=True, version=version)
        except StreamNotClosedError:
            raise                             # the source has not let go yet: not a failure
        except S3StreamError as e:
            self._count_open_failure(name, version, e)
            raise
        self._open_failures.pop((name, version), None)
        self.stats["opens"] += 1
        if not partition.is_open:
            return None
        self._publish_opened(name, version, partition.leader_epoch, (self.clock() - t0) / 1e9,
                             partition.open_phases)
        return partition

    def _count_open_failure(self, name: str, version: int, error: S3StreamError) -> None:
        """An open of `name` for `version` failed: after open_attempts of them, hand it on."""
        self.stats["open_failures"] += 1
        failures = self._open_failures.setdefault((name, version), [])
        failures.append(str(error))
        if len(failures) >= self.config.open_attempts:
            self._hand_on(name, version, failures)

    def _hand_on(self, name: str, version: int, failures: list[str]) -> None:
        """This node failed to open `name` open_attempts times: assign it to another node that
        can serve, recording why (shown by `s3stream streams` and the metrics)."""
        others = [n for n in self.cluster.live_nodes(serving=True) if n != self.node_id]
        if not others:
            return
        target = others[zlib.crc32(name.encode()) % len(others)]
        reason = f"node {self.node_id} failed to open it {len(failures)} times: {failures[-1]}"
        if self.cluster.assign(name, target, expected_version=version,
                               note=dict(reason=reason, from_node=self.node_id)):
            self.stats["handed_on"] += 1
            log.warning("partition %s: %s; assigned to node %d", name, reason, target)
            self._open_failures.pop((name, version), None)

    def _close_batch(self, batch: list[tuple[str, Partition, int]]) -> dict[str, Exception]:
        """`_close` of many partitions together (close_partitions: one force upload, one commit
        for all, their close records in it), then their figures in one write. Returns the
        errors by partition (those absent closed)."""
        if len(batch) == 1:
            name, partition, version = batch[0]
            try:
                self._close(partition, version)
            except Exception as e:        # noqa: BLE001 - settled by the caller
                return {name: e}
            return {}
        started = self.runtime.wall_ns() / 1e9
        records = [{"node": self.node_id, "node_epoch": self.node_epoch, "version": version, "started": started}
                   for _, _, version in batch]
        with self.hold.moving():
            results = close_partitions([partition for _, partition, _ in batch], records)
        errors: dict[str, Exception] = {}
        figures = []
        at = self.runtime.wall_ns() / 1e9
        for (name, _, _), record in zip(batch, records):
            result = results[name]
            if isinstance(result, Exception):
                self.stats["close_failures"] += 1
                errors[name] = result
                continue
            self.stats["closes"] += 1
            self._published.pop(name, None)
            figures.append((closed_key(name), json.dumps(dict(
                result.record or record, tail_bytes=result.tail_bytes, seconds=result.seconds, phases=result.phases,
                at=at), sort_keys=True).encode()))
        if figures:
            self.client.metadata.put_kvs(figures)
        return errors

    def _close(self, partition, version: int) -> None:
        started = self.runtime.wall_ns() / 1e9
        record = {"node": self.node_id, "node_epoch": self.node_epoch, "version": version, "started": started}
        try:
            # The close's commit records it (closed/<name>, with the open hint): the target
            # wakes then, not one metadata write later.
            with self.hold.moving():
                report = partition.close(record=record)
        except Exception:
            self.stats["close_failures"] += 1
            raise
        self.stats["closes"] += 1
        self._published.pop(partition.name, None)
        # Then the close's figures for the migration's report, with the same record.
        put_json(self.client.metadata, closed_key(partition.name),
                 dict(report.record or record, tail_bytes=report.tail_bytes, seconds=report.seconds,
                      phases=report.phases, at=self.runtime.wall_ns() / 1e9))


def _check_same_metadata(client: StreamClient, cluster: Cluster) -> None:
    """ConfigError unless the cluster's metadata knows this client's node at its epoch or a
    later one: a Cluster over another database than the client's would give the agent a view
    of assignments and peers that has nothing to do with the node it heartbeats for."""
    try:
        known = cluster.meta.get_node(client.node_id)
    except S3StreamError as e:
        raise ConfigError(f"NodeAgent: the Cluster's metadata does not know node {client.node_id} ({e}), which "
                          "the StreamClient registered in its own: give both the same metadata (one URL, or one "
                          "MetadataStore)") from e
    if known.node_epoch < client.node_epoch:
        raise ConfigError(f"NodeAgent: the Cluster's metadata has node {client.node_id} at epoch {known.node_epoch}, "
                          f"older than the epoch {client.node_epoch} the StreamClient registered: they are two "
                          "different databases; give both the same metadata (one URL, or one MetadataStore)")


#: Nodes whose agents could not raise their threads' priority (logged once per process).
_PRIORITY_REFUSED: list[int] = []

__all__ = ["NodeAgent"]
