"""Cluster: the shared view of nodes, assignments, migrations, failovers and their history.

State in metadata KV (JSON values):
- `assignment/<partition>`: {"node", "version"[, "reason", "from_node"]}: where the partition should be
  open; every change bumps the version (a migration is one version). A node that could not open
  it hands it on with the reason.
- `opened/<partition>`: {"node", "node_epoch", "version", "leader_epoch", "at", "seconds"}:
  written by the incarnation of a node that opened it for that version and serves it;
  `closed/<partition>` likewise by the one that closed it (with the bytes its close uploaded).
- `failover/<node>/<node epoch>/<attempt>`: {"node", "node_epoch", "at_ns"}: claims of the right
  to fail that epoch of a node over (one claimant at a time; see `claim_failover`).
- `history/<at ns>-<node>-<judge>`: {"kind", "node", "node_epoch", "judge", "judge_epoch",
  "reason", "at_ns", ...}: every failover, migration fallback and `forget`, with what was
  replayed or given up (`failover_history`).
Nodes register (node epoch + 1) and heartbeat through the metadata store, with their health.

Migration: `migrate` changes an assignment and returns once the target's own agent (its current
incarnation) reports the partition open at that version and serving, which takes time in the
un-uploaded tail, never in the history. If the source does not let go in time it is fenced and
failed over; anything else is an error naming the state found.
"""
from __future__ import annotations

import json
import logging
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from ..config import Config
from ..errors import FencedLeaderError, S3StreamError
from ..failover import FailoverReport, fail_over as recover_node
from ..latency import DURATION_BUCKETS, LatencyHistogram
from ..metadata import ChangeFeed, MetadataStore, NodeMeta
from ..objectstore import ObjectStore
from .config import ClusterConfig
from .partition import PARTITION_KV_PREFIX
from .runtime import THREADS, Runtime

log = logging.getLogger("s3stream.cluster")

#: Seconds of every migration this process completed (Cluster.migrate: from the assignment to
#: the target's open), whichever nodes it moved between; exported as s3stream_migration_seconds.
MIGRATION_SECONDS = LatencyHistogram(DURATION_BUCKETS)
#: Seconds of every failover this process ran (fence, replay, close), whichever node it
#: recovered; exported as s3stream_failover_seconds.
FAILOVER_SECONDS = LatencyHistogram(DURATION_BUCKETS)

#: KV prefix of the failover history.
HISTORY_PREFIX = "history/"
#: History entries kept (the oldest are removed beyond this).
HISTORY_KEPT = 2000


@dataclass
class ForgottenStream:
    """A stream a forgotten node held: committed up to `committed_end`; the offsets
    [committed_end, given_up_end) it may have acknowledged were lost with its WAL."""
    stream_id: int
    committed_end: int
    given_up_end: int
    partition: str | None = None         # the partition whose meta stream it is, if any

    @property
    def given_up(self) -> int:
        return self.given_up_end - self.committed_end


@dataclass
class ForgetReport:
    node_id: int
    fenced_epoch: int
    streams: list[ForgottenStream]
    reassigned: dict[str, int]


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
    version: int = 0             # the assignment version the target opened
    #: Where the time went, in seconds, from the nodes' and the driver's wall clocks (one host:
    #: exact; several hosts: within their clock skew): "assign" (writing the assignment),
    #: "to_close" (assignment written -> the
    #: source's agent starts the close), "close", "to_open" (the close's end -> the target's
    #: open that succeeded starts), "open", "to_seen" (the target published it -> migrate saw it);
    #: the close's own (CloseReport.phases) as "close.flush", "close.checkpoint", "close.upload"; and
    #: the open's (Partition.open_phases) as "open.read", "open.streams", "open.checkpoint".
    #: Empty (and tail_bytes, close_seconds 0) if the source had not recorded its close yet when
    #: the target was seen serving (the target may open first): Cluster.with_close_record waits.
    phases: dict = field(default_factory=dict)
    #: What the phases are computed from: the assignment's wall time and seconds, the moment the
    #: target was seen serving (wall), and the target's opened/ record.
    assigned_at: float = field(default=0.0, repr=False)
    assign_seconds: float = field(default=0.0, repr=False)
    seen_at: float = field(default=0.0, repr=False)
    opened: dict = field(default_factory=dict, repr=False)


def _with_close(report: MigrationReport, closed: dict | None) -> MigrationReport:
    """`report` with what the source's close record `closed` says, if it is this version's."""
    mine = closed if closed and closed["version"] == report.version else {}
    opened = report.opened
    if "seconds" not in mine or "started" not in opened:     # its figures come after the close's commit
        return report
    phases = dict(assign=report.assign_seconds, to_close=mine["started"] - report.assigned_at, close=mine["seconds"],
                  to_open=opened["started"] - mine["at"], open=opened["seconds"], to_seen=report.seen_at - opened["at"])
    phases.update({f"close.{k}": v for k, v in mine.get("phases", {}).items()})
    phases.update({f"open.{k}": v for k, v in opened.get("phases", {}).items()})
    return dataclasses.replace(report, tail_bytes=mine.get("tail_bytes", 0), close_seconds=mine.get("seconds", 0.0),
                               phases=phases)


def get_json(meta: MetadataStore, key: str) -> dict | None:
    raw = meta.get_kv(key)
    return None if raw is None else json.loads(raw)


def put_json(meta: MetadataStore, key: str, value: dict) -> None:
    meta.put_kv(key, json.dumps(value, sort_keys=True).encode())


def node_health(node: NodeMeta) -> dict:
    """The health a node's last heartbeat carried ({} if none: an older node, or none yet)."""
    if not node.health:
        return {}
    try:
        health = json.loads(node.health)
    except ValueError:
        return {}
    return health if isinstance(health, dict) else {}


def can_serve(node: NodeMeta) -> bool:
    """Whether the node's last heartbeat said it can serve (a node that says nothing can)."""
    return not node.failover and node_health(node).get("serving", True)


class Cluster:
    """An admin view of the cluster: any process with the shared metadata and store may use it."""

    def __init__(self, metadata: MetadataStore, store: ObjectStore | None, config: ClusterConfig | None = None,
                 engine_config: Config | None = None, clock: Callable[[], int] | None = None,
                 monotonic: Callable[[], int] | None = None, runtime: Runtime = THREADS,
                 recover: Callable[..., FailoverReport] = recover_node) -> None:
        """`store` may be None for a view that only reads and assigns (fail_over needs it).
        `clock` gives the time in ns that heartbeats are stamped with by the metadata store
        (inject the same fake one into both in tests); `live_nodes` compares them with it.
        `monotonic` is the clock of node agents' failure detection and leases (the native
        append path checks leases on CLOCK_MONOTONIC: only tests that drive the detector alone
        replace it). `runtime` gives both by default, and the waits and threads; `recover`
        replays a node's WAL on its behalf (s3stream.failover.fail_over). A simulation
        replaces the last two (tests/cluster_sim.py)."""
        self.meta = metadata
        self.store = store
        self.config = config or ClusterConfig()
        self.engine_config = engine_config
        self.runtime = runtime
        self.clock = clock or runtime.wall_ns
        self.monotonic = monotonic or runtime.monotonic_ns
        self._recover = recover

    # ---- assignment ----------------------------------------------------------------------------

    def assignment(self, name: str) -> dict | None:
        return get_json(self.meta, f"assignment/{name}")

    def assignments(self) -> dict[str, dict]:
        return {k.split("/", 1)[1]: json.loads(v) for k, v in self.meta.list_kv("assignment/").items()}

    def assign(self, name: str, node_id: int, guard: tuple[str, bytes] | None = None,
               expected_version: int | None = None, note: dict | None = None) -> int:
        """Point the partition at `node_id`; returns the new assignment version. The version is
        bumped by compare-and-set, so concurrent assigners (any host) never reuse one. With
        `guard` = (KV key, value), the write happens only while that key holds that value (a
        leader's lease: see s3stream.balancer.lease); else FencedLeaderError. With
        `expected_version`, only if the assignment is still at that version (else returns 0,
        nothing written). `note` is recorded with it (a reason, the node it came from)."""
        return self._assign(name, node_id, guard, expected_version, note, self.meta.get_kv(f"assignment/{name}"))

    def _assign(self, name: str, node_id: int, guard: tuple[str, bytes] | None, expected_version: int | None,
                note: dict | None, raw: bytes | None) -> int:
        """`assign`, given the assignment's value as read a moment ago (`raw`; read again if it
        changed since)."""
        key = f"assignment/{name}"
        while True:
            current = json.loads(raw)["version"] if raw is not None else 0
            if expected_version is not None and current != expected_version:
                return 0
            value = json.dumps(dict(note or {}, node=node_id, version=current + 1), sort_keys=True).encode()
            if self.meta.replace_kv(key, raw, value, guard=guard):
                return current + 1
            if guard is not None and self.meta.get_kv(guard[0]) != guard[1]:
                raise FencedLeaderError(
                    f"not assigning {name!r} to node {node_id}: {guard[0]!r} no longer holds this "
                    "leader's lease (another leader took over); the deposed leader stops acting")
            raw = self.meta.get_kv(key)

    def owner(self, name: str) -> int | None:
        """The node the partition is open on now (None while it moves)."""
        a, o = self.assignment(name), get_json(self.meta, f"opened/{name}")
        if a and o and o["version"] == a["version"] and o["node"] == a["node"]:
            return o["node"]
        return None

    def live_nodes(self, serving: bool = False) -> list[int]:
        """Nodes whose heartbeat is younger than heartbeat_timeout by `clock` (an admin's view:
        node agents judge by their own clocks, see s3stream.cluster.detector); with `serving`,
        only those whose last heartbeat said they can serve."""
        now = self.clock()
        timeout = int(self.config.heartbeat_timeout * 1e9)
        return sorted(n.node_id for n in self.meta.list_nodes()
                      if not n.failover and now - n.heartbeat_ns < timeout and (not serving or can_serve(n)))

    # ---- migration ----------------------------------------------------------------------------

    def wait_open(self, name: str, version: int, timeout: float, node: int | None = None,
                  feed: ChangeFeed | None = None) -> dict | None:
        """The `opened/` record of `name` once some node (`node`, if given) reports `version`
        open; None after `timeout`. Woken by the store's pushes where it has them, else polling
        every 2 ms. `feed`: one of `kv_changes((opened_key,))`, opened before the change waited
        for and closed by the caller, else one is opened (and closed) here."""
        return self._wait_opened(name, version, timeout, node, feed)[0]

    def _wait_opened(self, name: str, version: int, timeout: float, node: int | None = None,
                     feed: ChangeFeed | None = None) -> tuple[dict | None, NodeMeta | None]:
        """`wait_open`, and `node`'s row read with the record (None without `node`, or after
        `timeout`): `migrate`'s check of the target's incarnation costs no read of its own."""
        return self._wait_record(
            f"opened/{name}", lambda o: o["version"] >= version and (node is None or o["node"] == node), timeout,
            feed, node)

    def _wait_record(self, key: str, wanted: Callable[[dict], bool], timeout: float,
                     feed: ChangeFeed | None = None,
                     node: int | None = None) -> tuple[dict | None, NodeMeta | None]:
        """The JSON record at `key` once `wanted(record)`, and (`node`) that node's row read
        with it (get_kv_and_node: one round trip where the store can); (None, None) after
        `timeout`. Woken by the store's pushes where it has them, else polling every 2 ms. A
        `feed` given is left open (closing it is the caller's: after its clock stopped)."""
        deadline = self.monotonic() + int(timeout * 1e9)
        own = feed is None
        feed = self.meta.kv_changes((key,)) if feed is None else feed
        try:
            while True:
                raw, row = (self.meta.get_kv(key), None) if node is None else self.meta.get_kv_and_node(key, node)
                record = None if raw is None else json.loads(raw)
                if record and wanted(record):
                    return record, row
                left = (deadline - self.monotonic()) / 1e9
                if left <= 0:
                    return None, None
                if feed.pushes:
                    feed.wait(min(left, self.config.push_fallback_interval))
                else:
                    self.runtime.sleep(min(left, 0.002))
        finally:
            if own:
                feed.close()

    def _opened_by_current(self, opened: dict | None, version: int, node_id: int,
                           node: NodeMeta | None = None) -> bool:
        """Whether `opened` says the current incarnation of `node_id` serves `version`; `node`:
        its row read with `opened` (else read here)."""
        if not opened or opened["version"] != version or opened["node"] != node_id:
            return False
        node = self.meta.get_node(node_id) if node is None else node
        return not node.failover and opened.get("node_epoch", node.node_epoch) == node.node_epoch

    def migrate(self, name: str, to_node: int, timeout: float | None = None,
                guard: tuple[str, bytes] | None = None) -> MigrationReport:
        """Move a partition to `to_node`: the source closes it (force upload of its tail), the
        target opens it with a new epoch. Returns only once the target's current incarnation
        reports it open at the new version (its agent publishes that only while the partition
        takes appends). Falls back to fencing and failing over the source if it does not let
        go within the timeout; otherwise S3StreamError naming the state found. `guard`: as for
        `assign` (a leader's lease)."""
        timeout = self.config.migration_timeout if timeout is None else timeout
        serving = self.live_nodes(serving=True)
        if to_node not in serving:
            raise S3StreamError(
                f"cannot migrate {name!r} to node {to_node}: it is not a live node that can serve (no recent "
                f"heartbeat, failed over, or its last heartbeat said it cannot serve); such nodes: {serving}")
        raw = self.meta.get_kv(f"assignment/{name}")
        source = json.loads(raw)["node"] if raw is not None else None
        # Listening before the move starts: a new listener is a connection (PostgreSQL: a
        # server process), whose set-up would compete with the close and the open for the CPU.
        # Closed once the move is over (that took 0.1-4 ms of the driver's under load, after the
        # target had served).
        feed = self.meta.kv_changes((f"opened/{name}",))
        try:
            report = self._migrate(name, to_node, timeout, guard, raw, source, feed)
        finally:
            feed.close()
        MIGRATION_SECONDS.observe(report.seconds)
        return _with_close(report, get_json(self.meta, f"closed/{name}"))

    def _migrate(self, name: str, to_node: int, timeout: float, guard: tuple[str, bytes] | None,
                 raw: bytes | None, source: int | None, feed: ChangeFeed) -> MigrationReport:
        """`migrate` from its assignment on, with the assignment as read (`raw`), its node
        (`source`) and a feed on the opened/ record, opened before."""
        t0 = self.monotonic()
        version = self._assign(name, to_node, guard, None, None, raw)
        assign_seconds = (self.monotonic() - t0) / 1e9
        assigned_at = self.runtime.wall_ns() / 1e9
        opened, target = self._wait_opened(name, version, timeout, node=to_node, feed=feed)
        failed_over = False
        # The target's row read with its record when it serves; read again only after a
        # fallback or to fail.
        current = self._opened_by_current(opened, version, to_node, target)
        if not current and source is not None and source != to_node:
            closed = get_json(self.meta, f"closed/{name}")
            if not closed or closed["version"] < version:
                log.warning("migration of %s: node %d did not let go in %.1f s: failing it over", name, source, timeout)
                self.fail_over(source, reassign=False, kind="migration-fallback",
                               reason=f"did not close {name!r} for migration to node {to_node} within {timeout} s")
                failed_over = True
                opened = self.wait_open(name, version, timeout, node=to_node)
        if not current and not self._opened_by_current(opened, version, to_node):
            found = dict(assignment=self.assignment(name), opened=get_json(self.meta, f"opened/{name}"),
                         closed=get_json(self.meta, f"closed/{name}"), serving_nodes=self.live_nodes(serving=True))
            raise S3StreamError(f"partition {name!r} was not opened by node {to_node} at version {version} within "
                                f"{timeout} s{' after failing the source over' if failed_over else ''}; found {found}")
        assert opened is not None
        # The migration is over once the target is seen serving; reading the source's record of
        # its close is bookkeeping for the report, not part of the move.
        seconds = (self.monotonic() - t0) / 1e9
        return MigrationReport(name, source, to_node, seconds, 0, opened["leader_epoch"], failed_over,
                               open_seconds=opened.get("seconds", 0.0), version=version, assigned_at=assigned_at,
                               assign_seconds=assign_seconds, seen_at=self.runtime.wall_ns() / 1e9, opened=opened)

    def with_close_record(self, report: MigrationReport, timeout: float = 2.0) -> MigrationReport:
        """`report` with the source's close (tail, close seconds, phases) filled in, waiting up to
        `timeout` for the source to record it: the target may open as soon as the close's commit
        marks the streams CLOSED and records it (closed/), before the source's agent adds the
        close's figures to that record, and migrate returns as soon as the target serves. Unchanged if it is complete, or if there
        was no source to close (a first assignment, a failover)."""
        if report.phases or report.source is None or report.source == report.target or report.failed_over:
            return report
        closed, _ = self._wait_record(f"closed/{report.partition}",
                                      lambda c: c["version"] > report.version or (c["version"] == report.version
                                                                                   and "seconds" in c), timeout)
        return _with_close(report, closed)

    # ---- failover ------------------------------------------------------------------------------

    def claim_failover(self, node_id: int, node_epoch: int, claimant: int, claimant_epoch: int | None = None) -> bool:
        """Win the right to fail over this epoch of `node_id`, through KV. Claims are numbered
        attempts (`failover/<node>/<epoch>/<n>`, written if absent) naming the claimant's node
        and incarnation (`claimant_epoch`; None: any): a claim is the claimant's own only in
        that incarnation, so a restarted node does not inherit its old claims. A later attempt
        may be claimed once the latest claimant is no longer live (it died mid-way) or its
        claim is older than the heartbeat timeout plus the migration timeout, so a claim never
        blocks a failover for good. True if `claimant` now holds the latest claim."""
        prefix = f"failover/{node_id}/{node_epoch}/"
        claims = {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in self.meta.list_kv(prefix).items()}
        now = self.clock()
        if claims:
            latest = max(claims)
            holder = claims[latest]
            if holder["node"] == claimant and holder.get("node_epoch") in (claimant_epoch, None):
                return True
            stale_ns = int((self.config.heartbeat_timeout + self.config.migration_timeout) * 1e9)
            if (holder["node"] != claimant and holder["node"] in self.live_nodes()
                    and now - holder["at_ns"] < stale_ns):
                return False
            log.warning("failover claim %d of node %d (epoch %d) by node %d is stale: claiming it again",
                        latest, node_id, node_epoch, holder["node"])
            attempt = latest + 1
        else:
            attempt = 0
        value = json.dumps({"node": claimant, "node_epoch": claimant_epoch, "at_ns": now}).encode()
        return self.meta.put_kv_if_absent(f"{prefix}{attempt}", value) == value

    def fail_over(self, node_id: int, reassign: bool = True, *, judge: int | None = None,
                  judge_epoch: int | None = None, kind: str = "failover", reason: str = "requested",
                  lease_over: bool = False, if_unchanged: tuple[int, int] | None = None) -> FailoverReport:
        """Fence `node_id`, commit its WAL on its behalf, close its streams; then (if
        `reassign`) spread its partitions over the live nodes that can serve. Recorded in the
        failover history (`kind`, `judge`, `reason`, `decided_ns` when it started, `at_ns` when it
        ended) whether it succeeds or not.

        Unless `lease_over` (a judge counted heartbeat_timeout of the node's silence: its lease
        ran out before), the node may be alive and acknowledging under its lease: its WAL is
        read only once that lease is certainly over, `lease` after the fence (a migration
        fallback or an operator's failover takes that much longer). A judge passes what it saw
        of the node as `if_unchanged`: if the node heartbeated since, the fence is refused
        (NodeAliveError, recorded) and nothing else happens."""
        if self.store is None:
            raise S3StreamError(f"cannot fail node {node_id} over: this Cluster view has no object store to "
                                "commit its WAL to; make it with one")
        # The incarnation judged (claimed for), or the current one for an unjudged failover.
        epoch = if_unchanged[0] if if_unchanged is not None else self.meta.get_node(node_id).node_epoch
        entry = dict(kind=kind, node=node_id, node_epoch=epoch, judge=judge, judge_epoch=judge_epoch,
                     reason=reason, decided_ns=self.clock())
        try:
            report = self._recover(node_id, store=self.store, metadata=self.meta, config=self.engine_config,
                                   settle=0.0 if lease_over else self.config.lease, sleep=self.runtime.sleep,
                                   if_unchanged=if_unchanged)
        except BaseException as e:
            self.record_history(dict(entry, ok=False, error=str(e)))
            raise
        FAILOVER_SECONDS.observe(report.seconds)
        moved: dict[str, int] = {}
        try:
            if reassign:
                moved = self._reassign_from(node_id)
        finally:
            self.record_history(dict(entry, ok=True, fenced_epoch=report.fenced_epoch, records=report.records,
                                     replayed=report.replayed, streams_closed=report.streams_closed,
                                     seconds=round(report.seconds, 6), reassigned=moved))
        return report

    def _reassign_from(self, node_id: int) -> dict[str, int]:
        """Spread the partitions assigned to `node_id` over the live nodes that can serve, or
        (none can: the object store is down for everyone, say) over the live ones, which open
        them once they can serve again."""
        live = ([n for n in self.live_nodes(serving=True) if n != node_id]
                or [n for n in self.live_nodes() if n != node_id])
        mine = sorted(name for name, a in self.assignments().items() if a["node"] == node_id)
        if mine and not live:
            raise S3StreamError(f"node {node_id} failed over but no live node can take its partitions {mine}")
        moved = {}
        for i, name in enumerate(mine):
            moved[name] = live[i % len(live)]
            self.assign(name, moved[name], note=dict(reason=f"node {node_id} failed over", from_node=node_id))
        return moved

    def reassign_orphans(self, nodes: list[NodeMeta] | None = None) -> dict[str, int]:
        """Reassign the partitions still assigned to nodes that were failed over or forgotten
        (their failover could not reassign them: no live node then). Any node may call it; the
        versioned assignment makes concurrent callers move each partition once."""
        nodes = self.meta.list_nodes() if nodes is None else nodes
        gone = {n.node_id for n in nodes if n.failover}
        moved: dict[str, int] = {}
        for node_id in sorted({a["node"] for a in self.assignments().values()} & gone):
            try:
                moved.update(self._reassign_from(node_id))
            except S3StreamError:
                pass                      # no live node yet: the next call tries again
        return moved

    # ---- a lost host -----------------------------------------------------------------------------

    def forget(self, node_id: int, *, wal_lost: bool, reason: str = "its host and WAL were lost") -> ForgetReport:
        """Give up a node whose WAL is lost with its host (an operator's decision: nothing does
        this by itself). Fences it (so a node that is in fact alive stops: no commit, heartbeat
        or reservation of it succeeds from now on), then closes every stream it held open
        without its un-uploaded data: each resumes above every offset the node could have
        acknowledged (its reservation, which the fence froze), and the skipped offsets are
        recorded as lost (reads there raise OffsetsLostError). Its partitions are reassigned to
        the live nodes that can serve; the failover history records what was given up.
        `wal_lost` must be True: if the WAL is readable, fail the node over instead (nothing lost)."""
        if not wal_lost:
            raise S3StreamError(f"forget node {node_id} only if its WAL is lost (wal_lost=True); if the WAL is "
                                "readable, fail the node over instead: its acknowledged records are replayed")
        fenced = self.meta.fence_node(node_id, failover=True)
        partitions = {}
        for key, raw in self.meta.list_kv(PARTITION_KV_PREFIX).items():
            try:
                partitions[int(raw)] = key.split("/", 1)[1]
            except ValueError:
                continue
        forgotten = []
        for m in self.meta.list_streams(owner_node_id=node_id):
            after = self.meta.abandon_stream(m.stream_id, m.epoch, node_id)
            forgotten.append(ForgottenStream(m.stream_id, m.end_offset, after.end_offset,
                                             partitions.get(m.stream_id)))
        entry = dict(kind="forget", node=node_id, node_epoch=fenced.node_epoch - 1, judge=None, judge_epoch=None,
                     reason=reason, ok=True, fenced_epoch=fenced.node_epoch,
                     streams=[dict(stream_id=f.stream_id, committed_end=f.committed_end,
                                   given_up=[f.committed_end, f.given_up_end], partition=f.partition)
                              for f in forgotten])
        moved: dict[str, int] = {}
        try:
            moved = self._reassign_from(node_id)
        finally:
            self.record_history(dict(entry, reassigned=moved))
        for f in forgotten:
            if f.given_up:
                log.error("forgot node %d: stream %d gives up offsets [%d, %d) (its WAL is lost)", node_id,
                          f.stream_id, f.committed_end, f.given_up_end)
        return ForgetReport(node_id, fenced.node_epoch, forgotten, moved)

    # ---- history -------------------------------------------------------------------------------

    def record_history(self, entry: dict) -> None:
        """Add a failover-history entry (stamped with `at_ns` by `clock`), keeping the newest
        HISTORY_KEPT."""
        at = self.clock()
        entry = dict(entry, at_ns=at)
        key = f"{HISTORY_PREFIX}{at:020d}-{entry.get('node')}-{entry.get('judge')}"
        put_json(self.meta, key, entry)
        keys = sorted(self.meta.list_kv(HISTORY_PREFIX))
        for old in keys[:max(0, len(keys) - HISTORY_KEPT)]:
            self.meta.delete_kv(old)

    def failover_history(self, since_ns: int = 0) -> list[dict]:
        """Every failover, migration fallback and forget recorded (oldest first), at or after
        `since_ns`: dicts with kind, node, node_epoch, judge, judge_epoch, reason, at_ns, ok,
        and what was replayed (records, replayed, streams_closed) or given up (streams)."""
        out = []
        for key, raw in self.meta.list_kv(HISTORY_PREFIX).items():
            entry = json.loads(raw)
            if entry.get("at_ns", 0) >= since_ns:
                out.append(entry)
        return out
