"""Cluster: the shared view of nodes, assignments, migrations, failovers and their history.

State in metadata KV (JSON values):
- `assignment/<partition>`: {"node", "version"[, "reason", "from_node"]}: where the partition should be
  open; every change bumps the version (a migration is one version). A node that could not open
  it hands it on with the reason.
- `opened/<partition>`: {"node", "node_epoch", "version", "leader_epoch", "at", "seconds"}:
  written by the incarnation of a node that opened it for that version and serves it;
  `closed/<partition>` likewise by the one that closed it (with the bytes its close uploaded).
- `failover/<node>/<node epoch>/<attempt>`: {"node", "node_epoch", "at_ns"[, "done"]}: claims of
  the right to fail that epoch of a node over (one claimant at a time; see `claim_failover`),
  marked done once that failover ended (`reassign_orphans` leaves a standing one's partitions).
- `history/<at ns>-<node>-<judge>`: {"kind", "node", "node_epoch", "judge", "judge_epoch",
  "reason", "at_ns", ...}: every failover, migration fallback and `forget`, with what was
  replayed or given up (`failover_history`).
Nodes register (node epoch + 1) and heartbeat through the metadata store, with their health.

Migration: `migrate` changes an assignment and returns once the target's own agent (its current
incarnation) reports the partition open at that version and serving, which takes time in the
un-uploaded tail, never in the history. If the source still holds the partition when the time is
up, it is failed over only if it is silent by the failure detector's rules (counted by `migrate`
itself while it waits); a source that is alive is never fenced by a migration (NodeAliveError
naming it). Anything else is an error naming the state found.

A Cluster takes a metadata URL and an object store URL as StreamClient does, and closes what it
opened (`close()`, or use it as a context manager), or ready-made stores, which it leaves open.
"""
from __future__ import annotations

import itertools
import json
import logging
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..config import Config
from ..errors import ConfigError, FencedLeaderError, NodeAliveError, S3StreamError
from ..engine.failover import FailoverReport, fail_over as recover_node
from ..latency import DURATION_BUCKETS, LatencyHistogram
from ..metadata import ChangeFeed, MetadataStore, NodeMeta, StreamState, open_metadata
from ..objectstore import ObjectStore, open_object_store
from .config import ClusterConfig
from .detector import FailureDetector
from .partition import PARTITION_KV_PREFIX, partition_kv_key
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
#: Assignments one metadata write of `migrate_many` changes: a drain's first opens start after
#: the first write. A failover reassigns all its node's partitions in one write (_reassign_from).
ASSIGN_BATCH = 1000
#: History entries kept (the oldest are removed beyond this).
HISTORY_KEPT = 2000
#: Streams and moves a failover's history entry names one by one (it counts them all).
HISTORY_DETAIL = 1000


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
    """What `Cluster.forget` did; with `already`, what the earlier call that gave the node up
    recorded (`previous`: its history entry, None if it is no longer kept or the node was failed
    over or retired instead) and this call changed nothing."""
    node_id: int
    fenced_epoch: int
    streams: list[ForgottenStream]
    reassigned: dict[str, int]
    #: Partitions no live node that can serve could take: still assigned to the node, they move
    #: by themselves once a node's agent runs (`reassign_orphans`), or by `migrate`.
    waiting: list[str] = field(default_factory=list)
    already: bool = False
    previous: dict | None = None


@dataclass
class FailoverOutcome:
    """What `Cluster.fail_over_node` (an operator's failover) did: the replay's report, the
    partitions moved and those waiting for a live node (as in ForgetReport); with `already`,
    nothing was done (`previous`: the history entry of what gave the node up, if kept).
    `forced`: the node was alive by the failure detector's rules and failed over anyway."""
    node_id: int
    report: FailoverReport | None
    reassigned: dict[str, int]
    waiting: list[str]
    already: bool = False
    previous: dict | None = None
    forced: bool = False


@dataclass
class BatchMigrationReport:
    """What Cluster.migrate_many (or drain) did: the moves asked for (name -> node), the seconds
    until all were served at their targets (or the timeout), and those not served by then."""
    moves: dict[str, int]
    seconds: float
    waiting: list[str]

    @property
    def done(self) -> bool:
        return not self.waiting


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


_METADATA_METHODS = ("get_kv", "list_kv", "replace_kv", "get_node", "list_nodes", "kv_changes")
_STORE_METHODS = ("put", "get", "size", "delete", "list")


class _SilenceWatch:
    """Whether one node is silent by the failure detector's rules (detector.py), judged by this
    process from its own reads of the node's record: `migrate` watches its source while it
    waits, `fail_over_node` a node before failing it over. Silence counts only between reads at
    most 2 x heartbeat_interval apart, and a failed read starts it again."""

    def __init__(self, cluster: "Cluster", node_id: int, start_ns: int) -> None:
        config = cluster.config
        self.cluster = cluster
        self.node_id = node_id
        self.interval_ns = int(config.heartbeat_interval * 1e9)
        self.detector = FailureDetector(config.heartbeat_timeout, 2 * config.heartbeat_interval)
        self.next_ns = start_ns
        self.first: tuple | None = None      # the record's (epoch, heartbeat, failover) when first read
        self.row: NodeMeta | None = None     # the record as last read
        self.changed = False                 # it changed while watched: the node heartbeated (or moved on)
        self.silent = False                  # silent for heartbeat_timeout, counted here

    def observe(self, now_ns: int) -> None:
        """Read the node's record if a read is due."""
        if now_ns < self.next_ns:
            return
        self.next_ns = now_ns + self.interval_ns
        try:
            row = self.cluster.meta.get_node(self.node_id)
        except Exception:   # noqa: BLE001 - a read that fails is this watcher's outage: nobody's silence counts
            self.detector.unreachable()
            self.silent = False
            return
        token = (row.node_epoch, row.heartbeat_ns, row.failover)
        if self.first is None:
            self.first = token
        elif token != self.first:
            self.changed = True
        self.row = row
        self.silent = self.node_id in self.detector.observe(now_ns, [(self.node_id, token)])

    @property
    def decided(self) -> bool:
        return self.changed or self.silent

    def seconds_to_next(self, now_ns: int) -> float:
        return max(0.0, (self.next_ns - now_ns) / 1e9)


class Cluster:
    """An admin view of the cluster: any process with the shared metadata and store may use it."""

    def __init__(self, metadata: MetadataStore | str, store: ObjectStore | str | None,
                 config: ClusterConfig | None = None,
                 engine_config: Config | None = None, clock: Callable[[], int] | None = None,
                 monotonic: Callable[[], int] | None = None, runtime: Runtime = THREADS,
                 recover: Callable[..., FailoverReport] = recover_node) -> None:
        """`metadata` and `store` are URLs (as StreamClient takes them: "sqlite:////data/meta.db",
        "postgresql://...", "file:///data/objects", "s3://bucket/prefix?...") or ready-made stores.
        What this Cluster opens from a URL it owns and `close()` closes; stores it is handed stay
        open. Anything else is refused here (ConfigError), before it can fail later inside a
        node agent's loop.
        `store` may be None for a view that only reads and assigns (fail_over needs it).
        `clock` gives the time in ns that heartbeats are stamped with by the metadata store
        (inject the same fake one into both in tests); `live_nodes` compares them with it.
        `monotonic` is the clock of node agents' failure detection and leases (the native
        append path checks leases on CLOCK_MONOTONIC: only tests that drive the detector alone
        replace it). `runtime` gives both by default, and the waits and threads; `recover`
        replays a node's WAL on its behalf (s3stream.engine.failover.fail_over). A simulation
        replaces the last two (tests/kits/cluster_sim.py)."""
        self._owned: list = []
        self.meta: MetadataStore = self._open_owned(metadata, "metadata", _METADATA_METHODS, open_metadata,
                                                    "'sqlite:////data/meta.db' or 'postgresql://user@host/db'")
        try:
            self.store: ObjectStore | None = None if store is None else self._open_owned(
                store, "store", _STORE_METHODS, open_object_store, "'file:///data/objects' or 's3://bucket/prefix'")
        except BaseException:
            self.close()
            raise
        self.config = config or ClusterConfig()
        self.engine_config = engine_config
        self.runtime = runtime
        self.clock = clock or runtime.wall_ns
        self.monotonic = monotonic or runtime.monotonic_ns
        self._recover = recover
        # assignments(): each key's last value read and what it decodes to (see there).
        self._decoded: dict[str, tuple[bytes, str, dict]] = {}

    def _open_owned(self, value, what: str, methods: tuple[str, ...], opener: Callable, example: str):
        """`value` if it is a store (it has `methods`), else the store opened from the URL `value`
        (owned: closed by `close`)."""
        if isinstance(value, str):
            if not value.strip():
                raise ConfigError(f"Cluster: the {what} URL is empty; give a URL such as {example}, or a store")
            opened = opener(value)
            self._owned.append(opened)
            return opened
        if all(callable(getattr(value, m, None)) for m in methods):
            return value
        raise ConfigError(f"Cluster: {what} must be a URL such as {example} or an open {what} store, got "
                          f"{value!r} ({type(value).__name__})")

    def close(self) -> None:
        """Close the stores this Cluster opened from URLs (not those it was handed)."""
        while self._owned:
            self._owned.pop().close()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- assignment ----------------------------------------------------------------------------

    def assignment(self, name: str) -> dict | None:
        return get_json(self.meta, f"assignment/{name}")

    def assignments(self) -> dict[str, dict]:
        """Every partition's assignment ({"node", "version", ...}: read them, do not change
        them: a value unchanged since the last call is the same dict). A node agent reads them
        all at each reconciliation: what did not change is not decoded again (10,000
        partitions: a lookup each instead of a JSON parse)."""
        before, now = self._decoded, {}
        out = {}
        for key, raw in self.meta.list_kv("assignment/").items():
            seen = before.get(key)
            if seen is None or seen[0] != raw:
                seen = (raw, key.split("/", 1)[1], json.loads(raw))
            now[key] = seen
            out[seen[1]] = seen[2]
        self._decoded = now
        return out

    def assign(self, name: str, node_id: int, guard: tuple[str, bytes] | None = None,
               expected_version: int | None = None, note: dict | None = None) -> int:
        """Point the partition at `node_id`; returns the new assignment version. The version is
        bumped by compare-and-set, so concurrent assigners (any host) never reuse one. With
        `guard` = (KV key, value), the write happens only while that key holds that value (a
        leader's lease: see s3stream.cluster.lease); else FencedLeaderError. With
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

    def assign_many(self, moves: dict[str, int], note: dict | None = None,
                    from_node: int | None = None) -> dict[str, int]:
        """`assign` of many partitions (name -> node), in one metadata write for all of them
        (compare-and-set each, as `assign`): a failover reassigns a dead node's partitions at
        once. A partition another assigner changed meanwhile is read again and written in the
        next round (one read and one write for all such). `from_node`: only the partitions
        still assigned to that node move (a failover's reassignment, which another node's
        `reassign_orphans` may race: each partition moves once, not twice). Returns each moved
        partition's new version (with `from_node`, those not on it are left out)."""
        versions: dict[str, int] = {}
        todo = dict(moves)
        while todo:
            current = self.meta.get_kvs([f"assignment/{name}" for name in todo])
            items, names = [], []
            for name, node_id in todo.items():
                raw = current.get(f"assignment/{name}")
                was = json.loads(raw) if raw is not None else None
                if from_node is not None and (was is None or was["node"] != from_node):
                    continue
                version = (was["version"] if was is not None else 0) + 1
                value = json.dumps(dict(note or {}, node=node_id, version=version), sort_keys=True).encode()
                items.append((f"assignment/{name}", raw, value))
                names.append((name, version))
            written = self.meta.replace_kvs(items) if items else []
            todo = {}
            for (name, version), ok in zip(names, written):
                if ok:
                    versions[name] = version
                else:
                    todo[name] = moves[name]
        return versions

    def owner(self, name: str) -> int | None:
        """The node the partition is open on now (None while it moves)."""
        a, o = self.assignment(name), get_json(self.meta, f"opened/{name}")
        if a and o and o["version"] == a["version"] and o["node"] == a["node"]:
            return o["node"]
        return None

    def live_nodes(self, serving: bool = False, nodes: list[NodeMeta] | None = None) -> list[int]:
        """Nodes whose heartbeat is younger than heartbeat_timeout by `clock` (an admin's view:
        node agents judge by their own clocks, see s3stream.cluster.detector); with `serving`,
        only those whose last heartbeat said they can serve. `nodes`: the node rows, if the
        caller read them."""
        now = self.clock()
        timeout = int(self.config.heartbeat_timeout * 1e9)
        return sorted(n.node_id for n in (self.meta.list_nodes() if nodes is None else nodes)
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
                     feed: ChangeFeed | None = None,
                     watch: _SilenceWatch | None = None) -> tuple[dict | None, NodeMeta | None]:
        """`wait_open`, and `node`'s row read with the record (None without `node`, or after
        `timeout`): `migrate`'s check of the target's incarnation costs no read of its own."""
        return self._wait_record(
            f"opened/{name}", lambda o: o["version"] >= version and (node is None or o["node"] == node), timeout,
            feed, node, watch)

    def _wait_record(self, key: str, wanted: Callable[[dict], bool], timeout: float,
                     feed: ChangeFeed | None = None, node: int | None = None,
                     watch: _SilenceWatch | None = None) -> tuple[dict | None, NodeMeta | None]:
        """The JSON record at `key` once `wanted(record)`, and (`node`) that node's row read
        with it (get_kv_and_node: one round trip where the store can); (None, None) after
        `timeout`. Woken by the store's pushes where it has them, else polling every 2 ms. A
        `feed` given is left open (closing it is the caller's: after its clock stopped). A
        `watch` reads its node's record whenever one is due meanwhile."""
        deadline = self.monotonic() + int(timeout * 1e9)
        own = feed is None
        feed = self.meta.kv_changes((key,)) if feed is None else feed
        try:
            while True:
                raw, row = (self.meta.get_kv(key), None) if node is None else self.meta.get_kv_and_node(key, node)
                record = None if raw is None else json.loads(raw)
                if record and wanted(record):
                    return record, row
                now = self.monotonic()
                left = (deadline - now) / 1e9
                if left <= 0:
                    return None, None
                if watch is not None:
                    watch.observe(now)
                    left = min(left, max(0.001, watch.seconds_to_next(self.monotonic())))
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
        takes appends). If the source still holds the partition after `timeout`, it is failed
        over (kind `migration-fallback`) only if it is silent by the failure detector's rules,
        counted here while the move waited; NodeAliveError if it is alive; otherwise
        S3StreamError naming the state found. `guard`: as for `assign` (a leader's lease)."""
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
        # The source's silence is counted while the move waits, by the failure detector's rules,
        # from a heartbeat interval on: a move that ends sooner (all but the stuck ones) reads
        # nothing more for it.
        watch = (_SilenceWatch(self, source, t0 + int(self.config.heartbeat_interval * 1e9))
                 if source is not None and source != to_node else None)
        opened, target = self._wait_opened(name, version, timeout, node=to_node, feed=feed, watch=watch)
        failed_over = False
        # The target's row read with its record when it serves; read again only after a
        # fallback or to fail.
        current = self._opened_by_current(opened, version, to_node, target)
        if not current and watch is not None:
            opened, failed_over = self._fallback(name, version, to_node, timeout, watch)
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

    def migrate_many(self, moves: dict[str, int], timeout: float | None = None) -> "BatchMigrationReport":
        """Move many partitions at once (name -> target node): assigned in writes of
        ASSIGN_BATCH (assign_many), closed by their sources' agents and opened by the targets'
        in batches (a few metadata transactions per batch, not per partition). Returns once
        every target's current incarnation serves its partitions at their new versions, or
        after `timeout` (default: migration_timeout, plus one per 1,000 partitions) with those
        not open yet named (`waiting`). It does not fail sources over: a source that does not
        let go is an operator's matter (`migrate` of one partition, or `node fail-over`)."""
        t0 = self.monotonic()
        names = sorted(moves)
        timeout = (self.config.migration_timeout * (1 + len(names) // 1000)) if timeout is None else timeout
        serving = set(self.live_nodes(serving=True))
        bad = sorted({node for node in moves.values() if node not in serving})
        if bad:
            raise S3StreamError(f"cannot migrate to nodes {bad}: they are not live nodes that can serve (no recent "
                                f"heartbeat, failed over, or their last heartbeat said they cannot); such nodes: "
                                f"{sorted(serving)}")
        feed = self.meta.kv_changes(("opened/",))
        try:
            versions: dict[str, int] = {}
            for i in range(0, len(names), ASSIGN_BATCH):
                versions.update(self.assign_many({name: moves[name] for name in names[i:i + ASSIGN_BATCH]}))
            deadline = t0 + int(timeout * 1e9)
            waiting = set(names)
            while waiting:
                # Read at each look: a target that restarted meanwhile serves under its new epoch.
                epochs = {n.node_id: n.node_epoch for n in self.meta.list_nodes() if not n.failover}
                found = self.meta.get_kvs([f"opened/{name}" for name in sorted(waiting)])
                for key, raw in found.items():
                    record = json.loads(raw)
                    name = key.split("/", 1)[1]
                    if (record["version"] == versions[name] and record["node"] == moves[name]
                            and record.get("node_epoch") == epochs.get(record["node"])):
                        waiting.discard(name)
                left = (deadline - self.monotonic()) / 1e9
                if not waiting or left <= 0:
                    break
                feed.wait(min(left, self.config.push_fallback_interval))
        finally:
            feed.close()
        return BatchMigrationReport(dict(moves), (self.monotonic() - t0) / 1e9, sorted(waiting))

    def drain(self, node_id: int, to_nodes: list[int] | None = None, limit: int | None = None,
              timeout: float | None = None) -> "BatchMigrationReport":
        """Move the partitions assigned to `node_id` (the first `limit` by name, or all) to
        `to_nodes` (default: every other live node that can serve), spread evenly, with
        migrate_many: what to do before taking a node out of service."""
        targets = sorted(to_nodes if to_nodes is not None else
                         [n for n in self.live_nodes(serving=True) if n != node_id])
        if not targets:
            raise S3StreamError(f"cannot drain node {node_id}: no other live node can serve")
        mine = sorted(name for name, a in self.assignments().items() if a["node"] == node_id)[:limit]
        return self.migrate_many({name: targets[i % len(targets)] for i, name in enumerate(mine)}, timeout)

    def _fallback(self, name: str, version: int, to_node: int, timeout: float,
                  watch: _SilenceWatch) -> tuple[dict | None, bool]:
        """`migrate` after `timeout` without the target's open: fail the source over only if it
        still holds the partition and is silent by the failure detector's rules; then wait for
        the target again. Returns (the target's opened/ record or None, whether the source was
        failed over). NodeAliveError if the source holds it and is alive: fencing it would stop
        every partition of a node that works (its agent may be stuck, or the target cannot
        open), which is an operator's decision (`s3stream node fail-over NODE --force`)."""
        source = watch.node_id
        opened_key = f"opened/{name}"
        closed = get_json(self.meta, f"closed/{name}")
        if (closed and closed["version"] >= version) or self.partition_holder(name) != source:
            # The source let go, or never held it (its agent never opened it), or it was failed
            # over meanwhile: there is nothing to take from the source. The target did not open.
            return get_json(self.meta, opened_key), False
        # Decide by the rules: keep reading its record until it heartbeats or its silence is
        # counted in full (at most heartbeat_timeout more if the wait was too short to decide).
        limit = self.monotonic() + int((self.config.heartbeat_timeout + 2 * self.config.heartbeat_interval) * 1e9)
        while not watch.decided and self.monotonic() < limit:
            watch.observe(self.monotonic())
            if watch.decided:
                break
            opened = get_json(self.meta, opened_key)
            if self._opened_by_current(opened, version, to_node):
                return opened, False            # it let go late
            self.runtime.sleep(max(0.001, watch.seconds_to_next(self.monotonic())))
        row = watch.row
        if watch.silent and row is not None and not row.failover:
            log.warning("migration of %s: node %d did not let go in %.1f s and is silent (no heartbeat for %.1f s "
                        "counted here): failing it over", name, source, timeout, watch.detector.silence(source))
            try:
                self.fail_over(source, reassign=False, kind="migration-fallback", lease_over=True,
                               if_unchanged=(row.node_epoch, row.heartbeat_ns),
                               reason=f"did not close {name!r} for migration to node {to_node} within {timeout} s "
                                      f"and sent no heartbeat for {watch.detector.silence(source):.1f} s")
            except NodeAliveError:
                pass                            # it heartbeated at the last moment: alive after all
            else:
                return self.wait_open(name, version, timeout, node=to_node), True
        row = self.meta.get_node(source)
        if row.failover or (watch.first is not None and row.node_epoch != watch.first[0]):
            # Failed over by a peer, or restarted (its recovery closes what it held): the
            # partition is let go of without us.
            return self.wait_open(name, version, timeout, node=to_node), False
        opened = get_json(self.meta, opened_key)
        if self._opened_by_current(opened, version, to_node):
            return opened, False
        health = node_health(row)
        said = ("its last heartbeat says it can serve" if can_serve(row) else
                "its last heartbeat says it cannot serve: " + "; ".join(health.get("problems", [])))
        raise NodeAliveError(
            f"partition {name!r} was not opened by node {to_node} within {timeout} s: node {source} still holds it "
            f"and is alive (it heartbeated while this migration waited; {said}). A migration fails its source "
            f"over only once it is silent for heartbeat_timeout ({self.config.heartbeat_timeout} s). The partition "
            f"stays assigned to node {to_node}, which opens it once node {source}'s agent closes it; look at node "
            f"{source}'s log for why it does not, or take the partition from it by failing the whole node over: "
            f"`s3stream node fail-over {source} --force`")

    def partition_holder(self, name: str) -> int | None:
        """The node holding partition `name` open now by its streams' state in metadata (its
        meta stream OPENED there), or None (closed, or never opened)."""
        raw = self.meta.get_kv(partition_kv_key(name))
        if raw is None:
            return None
        try:
            meta = self.meta.get_stream(int(raw))
        except (ValueError, S3StreamError):
            return None
        return meta.owner_node_id if meta.state == StreamState.OPENED else None

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
        found = self._latest_claim(prefix)
        now = self.clock()
        if found is not None:
            key, holder = found
            latest = int(key.rsplit("/", 1)[1])
            if holder["node"] == claimant and holder.get("node_epoch") in (claimant_epoch, None):
                return True
            if holder["node"] != claimant and self._claim_holds(holder, self.live_nodes(), now):
                return False
            log.warning("failover claim %d of node %d (epoch %d) by node %d is stale: claiming it again",
                        latest, node_id, node_epoch, holder["node"])
            attempt = latest + 1
        else:
            attempt = 0
        value = json.dumps({"node": claimant, "node_epoch": claimant_epoch, "at_ns": now}).encode()
        return self.meta.put_kv_if_absent(f"{prefix}{attempt}", value) == value

    def _claim_holds(self, holder: dict, live: list[int], now: int) -> bool:
        """Whether a failover claim (`holder`, its record) still stands: its claimant is live
        and the claim is younger than the heartbeat timeout plus the migration timeout."""
        stale_ns = int((self.config.heartbeat_timeout + self.config.migration_timeout) * 1e9)
        return holder["node"] in live and now - holder["at_ns"] < stale_ns

    def _latest_claim(self, prefix: str) -> tuple[str, dict] | None:
        """The newest failover claim under `prefix` (`failover/<node>/`, or with the epoch),
        by the numbers after it (epoch, then attempt): its key and record; None if none."""
        claims = self.meta.list_kv(prefix)
        if not claims:
            return None
        key = max(claims, key=lambda k: tuple(int(part) for part in k[len(prefix):].split("/")))
        return key, json.loads(claims[key])

    def _failing_over(self, node_id: int, live: list[int], now: int) -> bool:
        """Whether a live node's claim to fail over `node_id` (fenced) stands and its failover
        has not ended: that failover reassigns the node's partitions itself once it has closed
        their streams."""
        found = self._latest_claim(f"failover/{node_id}/")
        return found is not None and not found[1].get("done") and self._claim_holds(found[1], live, now)

    def fail_over(self, node_id: int, reassign: bool = True, *, judge: int | None = None,
                  judge_epoch: int | None = None, kind: str = "failover", reason: str = "requested",
                  lease_over: bool = False, if_unchanged: tuple[int, int] | None = None,
                  wal_path: str | None = None) -> FailoverReport:
        """Fence `node_id`, commit its WAL on its behalf, close its streams; then (if
        `reassign`) spread its partitions over the live nodes that can serve (those none can
        take stay assigned to it: `reassign_orphans` moves them later). Recorded in the
        failover history (`kind`, `judge`, `reason`, `decided_ns` when it started, `at_ns` when
        it ended, what was replayed per stream) whether it succeeds or not.

        Unless `lease_over` (a judge counted heartbeat_timeout of the node's silence: its lease
        ran out before), the node may be alive and acknowledging under its lease: its WAL is
        read only once that lease is certainly over, `lease` after the fence (a forced failover
        takes that much longer). A judge passes what it saw of the node as `if_unchanged`: if
        the node heartbeated since, the fence is refused (NodeAliveError, recorded) and nothing
        else happens. `wal_path`: where to read its WAL (default: where it registered it)."""
        return self._fail_over(node_id, reassign, judge=judge, judge_epoch=judge_epoch, kind=kind, reason=reason,
                               lease_over=lease_over, if_unchanged=if_unchanged, wal_path=wal_path)[0]

    def _fail_over(self, node_id: int, reassign: bool, *, judge: int | None, judge_epoch: int | None, kind: str,
                   reason: str, lease_over: bool, if_unchanged: tuple[int, int] | None,
                   wal_path: str | None) -> tuple[FailoverReport, dict[str, int], list[str]]:
        """`fail_over`, and the partitions it moved and those left waiting for a live node. A
        judge's failover, however it ends, marks its claim done (`_end_claim`)."""
        try:
            return self._run_failover(node_id, reassign, judge=judge, judge_epoch=judge_epoch, kind=kind,
                                      reason=reason, lease_over=lease_over, if_unchanged=if_unchanged,
                                      wal_path=wal_path)
        finally:
            if judge is not None and if_unchanged is not None:
                self._end_claim(node_id, if_unchanged[0], judge, judge_epoch)

    def _end_claim(self, node_id: int, node_epoch: int, claimant: int, claimant_epoch: int | None) -> None:
        """Mark the claimant's claim to fail over that incarnation of `node_id` done: other
        nodes' agents no longer leave the node's partitions to it (reassign_orphans). If this
        write fails, the claim still stops counting once it is stale."""
        try:
            found = self._latest_claim(f"failover/{node_id}/{node_epoch}/")
            if found is not None:
                key, holder = found
                if holder["node"] == claimant and holder.get("node_epoch") in (claimant_epoch, None):
                    self.meta.put_kv(key, json.dumps(dict(holder, done=True)).encode())
        except S3StreamError as e:
            log.warning("failover of node %d: its claim could not be marked done (%s); it counts until it is "
                        "stale", node_id, e)

    def _run_failover(self, node_id: int, reassign: bool, *, judge: int | None, judge_epoch: int | None, kind: str,
                      reason: str, lease_over: bool, if_unchanged: tuple[int, int] | None,
                      wal_path: str | None) -> tuple[FailoverReport, dict[str, int], list[str]]:
        if self.store is None:
            raise S3StreamError(f"cannot fail node {node_id} over: this Cluster view has no object store to "
                                "commit its WAL to; make it with one")
        # The incarnation judged (claimed for), or the current one for an unjudged failover.
        epoch = if_unchanged[0] if if_unchanged is not None else self.meta.get_node(node_id).node_epoch
        entry = dict(kind=kind, node=node_id, node_epoch=epoch, judge=judge, judge_epoch=judge_epoch,
                     reason=reason, decided_ns=self.clock())
        where = {} if wal_path is None else dict(wal_path=wal_path)
        try:
            report = self._recover(node_id, store=self.store, metadata=self.meta, config=self.engine_config,
                                   settle=0.0 if lease_over else self.config.lease, sleep=self.runtime.sleep,
                                   if_unchanged=if_unchanged, **where)
        except BaseException as e:
            self.record_history(dict(entry, ok=False, error=str(e)))
            raise
        FAILOVER_SECONDS.observe(report.seconds)
        moved: dict[str, int] = {}
        waiting: list[str] = []
        try:
            if reassign:
                moved, waiting = self._reassign_from(node_id)
        finally:
            # At most HISTORY_DETAIL streams (those it replayed records of) and moves named: a
            # failover of 10,000 partitions must not write (and each later entry read) megabytes.
            replayed = [dict(stream_id=r.stream_id, committed_end=r.committed_end, end=r.end)
                        for r in report.streams if r.end > r.committed_end]
            self.record_history(dict(entry, ok=True, fenced_epoch=report.fenced_epoch, records=report.records,
                                     replayed=report.replayed, streams_closed=report.streams_closed,
                                     seconds=round(report.seconds, 6), waiting=waiting,
                                     reassigned=dict(itertools.islice(moved.items(), HISTORY_DETAIL)),
                                     reassigned_count=len(moved), streams=replayed[:HISTORY_DETAIL],
                                     streams_replayed=len(replayed)))
        return report, moved, waiting

    def fail_over_node(self, node_id: int, *, force: bool = False, reason: str = "an operator's failover",
                       wal_path: str | None = None) -> FailoverOutcome:
        """An operator's failover of a dead node whose WAL this process can read (a file path
        reachable from here, or a WAL of objects): `s3stream node fail-over`.

        It first judges the node by the failure detector's rules, reading its record for up to
        heartbeat_timeout: a node that heartbeats meanwhile is alive and refused (NodeAliveError)
        unless `force`, which fences it at once and reads its WAL only once its lease is over. A
        node already given up (failed over, forgotten or retired, holding no stream) is left as
        it is (`already`, with the history entry that did it). A failover that stopped half-way
        (fenced, streams still open) is finished. Partitions no live node can take stay
        assigned to it (`waiting`) and move once a node's agent runs."""
        node = self.meta.get_node(node_id)
        if node.walless:
            raise S3StreamError(f"node {node_id} is a writer without a WAL ({node.wal_path}): there is no WAL to "
                                "replay and nothing to fail over")
        if node.failover and not self.meta.list_streams(owner_node_id=node_id, last_range=True):
            return FailoverOutcome(node_id, None, {}, self._waiting_on(node_id), already=True,
                                   previous=self._given_up_entry(node))
        # Where they go, by whoever moves them: during a failover's wait for the lease, the
        # agents of live nodes may take them first (reassign_orphans).
        assigned = self._waiting_on(node_id)
        if node.failover:
            # Fenced by a failover or forget that did not finish: its lease is over or runs
            # out within one (settle), and nobody renews it.
            report, _, waiting = self._fail_over(node_id, True, judge=None, judge_epoch=None, kind="failover",
                                                 reason=f"{reason} (finishing one that stopped half-way)",
                                                 lease_over=False, if_unchanged=None, wal_path=wal_path)
            return FailoverOutcome(node_id, report, self._placed(assigned, node_id), waiting)
        watch = _SilenceWatch(self, node_id, self.monotonic())
        if not force:
            limit = self.monotonic() + int((self.config.heartbeat_timeout + 2 * self.config.heartbeat_interval) * 1e9)
            while not watch.decided and self.monotonic() < limit:
                watch.observe(self.monotonic())
                if not watch.decided:
                    self.runtime.sleep(max(0.001, watch.seconds_to_next(self.monotonic())))
            if not watch.silent or watch.row is None:
                row = self.meta.get_node(node_id)
                age = (self.clock() - row.heartbeat_ns) / 1e9
                raise NodeAliveError(
                    f"node {node_id} is alive: its heartbeat record changed while this command watched it (its last "
                    f"heartbeat {age:.1f} s ago by this host's clock), so it is not failed over. Stop it (its own "
                    "close uploads what it holds), move its partitions with `s3stream migrate`, or pass --force to "
                    f"fence it now: its WAL is then read once its lease ({self.config.lease} s) is over")
            row = watch.row
            report, _, waiting = self._fail_over(
                node_id, True, judge=None, judge_epoch=None, kind="failover", lease_over=True,
                if_unchanged=(row.node_epoch, row.heartbeat_ns), wal_path=wal_path,
                reason=f"{reason}: no heartbeat for {watch.detector.silence(node_id):.1f} s counted by the command")
        else:
            report, _, waiting = self._fail_over(node_id, True, judge=None, judge_epoch=None,
                                                 kind="forced-failover", reason=f"{reason} (forced)",
                                                 lease_over=False, if_unchanged=None, wal_path=wal_path)
        return FailoverOutcome(node_id, report, self._placed(assigned, node_id), waiting, forced=force)

    def _placed(self, names: list[str], node_id: int) -> dict[str, int]:
        """Where the partitions `names` are assigned now, those moved off `node_id`."""
        now = self.assignments()
        return {name: now[name]["node"] for name in names if name in now and now[name]["node"] != node_id}

    def _reassign_from(self, node_id: int) -> tuple[dict[str, int], list[str]]:
        """Spread the partitions assigned to `node_id` over the live nodes that can serve, or
        (none can: the object store is down for everyone, say) over the live ones, which open
        them once they can serve again. Returns the moves this call made (a concurrent
        `reassign_orphans` may have made some first), and the partitions left assigned to
        `node_id` because no node is live (they wait for one: `reassign_orphans`)."""
        live = ([n for n in self.live_nodes(serving=True) if n != node_id]
                or [n for n in self.live_nodes() if n != node_id])
        mine = sorted(name for name, a in self.assignments().items() if a["node"] == node_id)
        if not live:
            return {}, mine
        wanted = {name: live[i % len(live)] for i, name in enumerate(mine)}
        # One write for all: in writes of 1,000, each woke every agent for a pass over all the
        # assignments while the opens of the ones before ran (a failover of 10,000 on SQLite:
        # 0.83 s of writes among the opens, against 0.12 s for one; post-detection time, 8 pairs
        # alternated with fo.py: 1.89 -> 1.76 s mean).
        done = self.assign_many(wanted, note=dict(reason=f"node {node_id} failed over", from_node=node_id),
                                from_node=node_id)
        return {name: wanted[name] for name in done}, []

    def _waiting_on(self, node_id: int) -> list[str]:
        """Partitions still assigned to `node_id`."""
        return sorted(name for name, a in self.assignments().items() if a["node"] == node_id)

    def reassign_orphans(self, nodes: list[NodeMeta] | None = None, skip: Iterable[int] = (),
                         assigned: dict[str, dict] | None = None) -> dict[str, int]:
        """Reassign the partitions still assigned to nodes that were failed over or forgotten
        (their failover could not reassign them: no live node then), but those of the nodes
        in `skip` (a failover the caller runs reassigns them itself) and of the nodes a live
        node's claim says it is failing over (that failover reassigns them once their streams
        are closed: moved sooner, their targets' opens would find the streams still open and
        retry until then). Any node may call it; the versioned assignment makes concurrent
        callers move each partition once. `assigned`: the assignments, if the caller read them."""
        nodes = self.meta.list_nodes() if nodes is None else nodes
        gone = {n.node_id for n in nodes if n.failover} - set(skip)
        assigned = self.assignments() if assigned is None else assigned
        held = sorted({a["node"] for a in assigned.values()} & gone)
        moved: dict[str, int] = {}
        if not held:
            return moved
        live, now = self.live_nodes(nodes=nodes), self.clock()
        for node_id in held:
            if not self._failing_over(node_id, live, now):
                moved.update(self._reassign_from(node_id)[0])     # none live yet: the next call tries again
        return moved

    # ---- a lost host -----------------------------------------------------------------------------

    def forget(self, node_id: int, *, wal_lost: bool, reason: str = "its host and WAL were lost") -> ForgetReport:
        """Give up a node whose WAL is lost with its host (an operator's decision: nothing does
        this by itself). Fences it (so a node that is in fact alive stops: no commit, heartbeat
        or reservation of it succeeds from now on), then closes every stream it held open
        without its un-uploaded data: each resumes above every offset the node could have
        acknowledged (its reservation, which the fence froze), and the skipped offsets are
        recorded as lost (reads there raise OffsetsLostError). Its partitions are reassigned to
        the live nodes that can serve; those none can take stay assigned to it (`waiting`) and
        move once a node's agent runs. The failover history records what was given up.

        Idempotent: a node already given up (forgotten, failed over or retired) that holds no
        stream is left as it is, and the report (`already`) carries what the forget that did it
        recorded. A forget that stopped half-way (fenced, streams still open) is finished.
        `wal_lost` must be True: if the WAL is readable, fail the node over instead (nothing lost)."""
        if not wal_lost:
            raise S3StreamError(f"forget node {node_id} only if its WAL is lost (wal_lost=True); if the WAL is "
                                "readable, fail the node over instead: its acknowledged records are replayed")
        node = self.meta.get_node(node_id)
        if node.failover:
            fenced = node                       # fenced already: a fence more would change nothing
            held = self.meta.list_streams(owner_node_id=node_id)
            if not held:
                previous = self._given_up_entry(node)
                streams = [] if previous is None else [
                    ForgottenStream(s["stream_id"], s["committed_end"], s["given_up"][1], s.get("partition"))
                    for s in previous.get("streams", []) if "given_up" in s]
                return ForgetReport(node_id, node.node_epoch, streams,
                                    {} if previous is None else previous.get("reassigned", {}),
                                    self._waiting_on(node_id), already=True, previous=previous)
        else:
            fenced = self.meta.fence_node(node_id, failover=True)
            held = self.meta.list_streams(owner_node_id=node_id)
        partitions = self._meta_stream_partitions()
        forgotten = []
        for m in held:
            after = self.meta.abandon_stream(m.stream_id, m.epoch, node_id)
            forgotten.append(ForgottenStream(m.stream_id, m.end_offset, after.end_offset,
                                             partitions.get(m.stream_id)))
        entry = dict(kind="forget", node=node_id, node_epoch=fenced.node_epoch - 1, judge=None, judge_epoch=None,
                     reason=reason, ok=True, fenced_epoch=fenced.node_epoch,
                     streams=[dict(stream_id=f.stream_id, committed_end=f.committed_end,
                                   given_up=[f.committed_end, f.given_up_end], partition=f.partition)
                              for f in forgotten])
        moved: dict[str, int] = {}
        waiting: list[str] = []
        try:
            moved, waiting = self._reassign_from(node_id)
        finally:
            self.record_history(dict(entry, reassigned=moved, waiting=waiting))
        for f in forgotten:
            if f.given_up:
                log.error("forgot node %d: stream %d gives up offsets [%d, %d) (its WAL is lost)", node_id,
                          f.stream_id, f.committed_end, f.given_up_end)
        return ForgetReport(node_id, fenced.node_epoch, forgotten, moved, waiting)

    def _meta_stream_partitions(self) -> dict[int, str]:
        """Meta stream id -> the partition it is the meta stream of."""
        partitions = {}
        for key, raw in self.meta.list_kv(PARTITION_KV_PREFIX).items():
            try:
                partitions[int(raw)] = key[len(PARTITION_KV_PREFIX):]
            except ValueError:
                continue
        return partitions

    def _given_up_entry(self, node: NodeMeta) -> dict | None:
        """The history entry of the failover or forget that fenced `node` into its current
        epoch (None: it retired, or the entry is no longer kept)."""
        return self.given_up(node.node_id).get(node.node_epoch)

    def given_up(self, node_id: int | None = None) -> dict[Any, dict]:
        """The newest successful failover, migration fallback or forget of each (node, fenced
        epoch) in the history: {fenced epoch: entry} for `node_id`, or with None
        {(node, fenced epoch): entry} for every node (what `s3stream streams` shows)."""
        out: dict = {}
        for entry in self.failover_history():
            if not entry.get("ok") or "fenced_epoch" not in entry:
                continue
            if node_id is None:
                out[(entry["node"], entry["fenced_epoch"])] = entry
            elif entry["node"] == node_id:
                out[entry["fenced_epoch"]] = entry
        return out

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
