"""ClusterConfig: the timing of heartbeats, leases, failure detection and moves."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class ClusterConfig:
    """Timing of the cluster protocol (docs/migration.md).

    heartbeat_interval: seconds between a node's heartbeats; each one that the metadata store
        accepts at the node's epoch renews its lease.
    lease_duration: seconds a node acknowledges appends after the start of its last accepted
        heartbeat (None: heartbeat_timeout / 2). It must outlast a renewal or two
        (> heartbeat_interval), and heartbeat_timeout must exceed it by a margin of at least
        heartbeat_interval: a peer fails a node over only once the node's lease is certainly over.
    heartbeat_timeout: seconds of silence, counted by a judge only while the judge itself
        reaches the metadata store, after which a live node fails the silent one over (if
        auto_failover). After the judge's own outage every peer gets the whole timeout again.
    agent_interval: seconds between a node agent's passes when the metadata store cannot push
        changes (PostgreSQL behind a transaction-mode pooler without listen_url; SQLite where no
        socket can be made): assignment changes are seen within it. push_fallback_interval: with
        a store that pushes KV changes (PostgreSQL LISTEN/NOTIFY; SQLite between the processes
        of its host, s3stream.metadata.hostfeed), agents and migrations wake on each change and
        pass at least this often anyway.
    migration_timeout: seconds a migration waits for the source to let go before fencing and
        failing it over.
    max_parallel_moves: partitions a node opens or closes at once (the agent's thread bound).
    open_attempts: failed opens of one assignment after which the node hands the partition to
        another node, with the reason recorded in the assignment.
    unhealthy_grace: seconds a node may be stuck (its WAL failed, uploads stopped for good by a
        permanent error) before it stops renewing its lease, so that a peer fails it over and
        its partitions move. Uploads that keep failing and being retried (the store down, for
        everyone perhaps) only keep a node from taking partitions and from judging peers.
    report_interval: seconds between a node's load reports (s3stream.cluster.loadreport:
        per-partition bytes in/out per second over the last report_window seconds, and
        append/fetch p99), which the balancer reads.
    agent_priority: nice steps above the process at which the node agent's threads run (its
        loop, its lease keeper, and the pool that closes, opens and fails partitions over), so
        that a move and a heartbeat are not slowed by the node's own producers (which may be
        slowed: backpressure). 0: the process's priority. Raising a thread's priority needs
        CAP_SYS_NICE or an RLIMIT_NICE that allows it (root has both); without, the threads keep
        the process's priority and the agent says so once (INFO). Measured in the migration
        bench at half load on PostgreSQL: moves p99 76 ms at 0, 48 ms at 10.
    move_hold: seconds for which a move (the node agent closing or opening a partition) may hold
        the appends of this node's partitions, so that the move's threads are not queued behind
        producers for the process's GIL and the cores (s3stream.cluster.hold): appends arriving
        meanwhile wait until the move ends, at most this long per move. 0: never held.
        move_hold_share: the most of the time the holds may take in all (a budget of held
        seconds refilled at this many per second, up to move_hold), so moves one after another
        slow producers by at most this share.
    gc_thresholds: the interpreter's collection thresholds (gc.set_threshold) a node agent sets
        when it is made, if the process still has Python's defaults (700, 10, 10): a node that
        holds 10,000 partitions holds a million long-lived objects, and with the defaults the
        collector's full passes over them as a failover opened them took a sixth of its CPU
        (perf: gc_collect_main, visit_decref, visit_reachable); failover of 10,000 on SQLite
        8.6-9.4 s -> 7.9 s, open after a restart 3.0-3.1 -> 2.5-2.7 s. Cycles are still
        collected, 70 times less often. None: the agent leaves the collector alone.
    """
    agent_interval: float = 0.02
    push_fallback_interval: float = 0.5
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 5.0
    lease_duration: float | None = None
    migration_timeout: float = 10.0
    max_parallel_moves: int = 4
    auto_failover: bool = True
    open_attempts: int = 5
    unhealthy_grace: float = 30.0
    report_interval: float = 1.0
    report_window: float = 10.0
    agent_priority: int = 10
    move_hold: float = 0.05
    move_hold_share: float = 0.25
    gc_thresholds: tuple[int, int, int] | None = (50_000, 20, 20)

    def __post_init__(self) -> None:
        for name in ("agent_interval", "push_fallback_interval", "heartbeat_interval", "heartbeat_timeout",
                     "migration_timeout", "report_interval", "report_window", "unhealthy_grace"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive seconds, got {getattr(self, name)}")
        if self.heartbeat_timeout <= 2 * self.heartbeat_interval:
            raise ConfigError(f"heartbeat_timeout ({self.heartbeat_timeout} s) must exceed twice heartbeat_interval "
                              f"({self.heartbeat_interval} s)")
        if self.lease_duration is not None:
            if not self.lease_duration > self.heartbeat_interval:
                raise ConfigError(
                    f"lease_duration ({self.lease_duration} s) must exceed heartbeat_interval "
                    f"({self.heartbeat_interval} s), or every lease runs out before it is renewed; leave it None for "
                    "heartbeat_timeout / 2")
            if self.heartbeat_timeout - self.lease_duration < self.heartbeat_interval:
                raise ConfigError(
                    f"heartbeat_timeout ({self.heartbeat_timeout} s) must exceed lease_duration "
                    f"({self.lease_duration} s) by at least heartbeat_interval ({self.heartbeat_interval} s): a peer "
                    "may fail a node over only once its lease is certainly over. Raise heartbeat_timeout or lower "
                    "lease_duration")
        if self.max_parallel_moves < 1:
            raise ConfigError(f"max_parallel_moves must be >= 1, got {self.max_parallel_moves}")
        if not 0 <= self.agent_priority <= 39:
            raise ConfigError(f"agent_priority must be 0-39 nice steps above the process, got {self.agent_priority}")
        if not self.move_hold >= 0:
            raise ConfigError(f"move_hold must be >= 0 seconds (0: moves never hold appends), got {self.move_hold}")
        if not 0 < self.move_hold_share <= 1:
            raise ConfigError(f"move_hold_share must be a share of the time in (0, 1], got {self.move_hold_share}")
        if self.gc_thresholds is not None and (len(self.gc_thresholds) != 3 or not all(
                isinstance(t, int) and t > 0 for t in self.gc_thresholds)):
            raise ConfigError(f"gc_thresholds must be three positive integers (gc.set_threshold), or None to leave "
                              f"the collector alone; got {self.gc_thresholds!r}")
        if self.open_attempts < 1:
            raise ConfigError(f"open_attempts must be >= 1, got {self.open_attempts}")

    @property
    def lease(self) -> float:
        """The lease in seconds: lease_duration, or heartbeat_timeout / 2."""
        return self.heartbeat_timeout / 2 if self.lease_duration is None else self.lease_duration
