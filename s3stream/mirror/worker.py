"""MirrorWorker: run a flow's partitions on a group of workers that share them out by leases.

A flow (one source cluster -> this target cluster, `flow_id`) copies every partition of the
source. Any number of MirrorWorkers (processes, hosts) run it; each is one node of the TARGET
cluster (node id = worker id, its WAL in `wal_dir`) and reads the source through s3stream.open_reader:
a reader that is not a node, so the worker registers nothing in the source cluster and writes
nothing there (it reads the source's partitions, their committed records and its consumer groups'
offsets; everything it writes goes to the target). Each worker, every `interval` seconds:

1. keeps alive: writes its record `mirror/<flow>/workers/<id>` ({"at", "flows", ...}) in the
   target's KV, heartbeats its node in the target, renews the leases it holds. A worker is
   live while its record is newer than `worker_timeout`. A flow whose lease another worker took
   (the lease record changed) stops at once; one whose renewal failed on a metadata error keeps
   running only until the lease it holds expires, since nobody else can take it before.
2. discovers the source's partitions (`partition/<name>` in the source KV, minus the mirror's
   own `heartbeats`, names the `partitions` filter refuses and, given `target_alias`, names that
   came from the target: a cycle). A partition gone from the source stops its flow.
3. balances, incrementally and cooperatively (Kafka's cooperative rebalancing): partition p is
   worked on by whoever holds lease `mirror/<flow>/lease/<target-partition>` (cluster.lease.Lease:
   compare-and-set, epoch + 1 on takeover). With P partitions and W live workers every worker's
   quota is P // W, and P % W of them get one more: those holding the most leases now (ties: the
   lowest id), so that a balanced assignment stays as it is; no quota exceeds ceil(P / W) nor
   `max_flows`. A worker over its quota stops and releases only its excess (flow stopped with
   its target partition closed, then the lease released); a worker under it claims free or
   expired leases. A join or a leave thus moves only what the new quotas demand, and every other
   flow keeps copying (its MirrorFlow is never restarted).
4. leads, if it holds `mirror/<flow>/leader`: writes the heartbeats (the `heartbeats` partition
   has a single writer) every `heartbeat_interval`, aggregated over every live worker's published
   flows, and runs `sync_checkpoints` every `checkpoint_interval`.

Exactly once across handovers is MirrorFlow's: a flow resumes where the target ends. A target
partition has one writer, so a lease alone never lets two flows write: the new holder's start
opens the partition with epoch + 1, refused (StreamNotClosedError) while the old holder still has
it open. Handover cases:
- clean (rebalance, stop()): the old holder closes the partition before it releases the lease;
- crash, restarted: the same worker id and wal_dir replay the WAL (StreamClient does, committing
  every acknowledged append) and the new incarnation adopts its predecessor's leases at once
  (registering the node again fenced that incarnation);
- crash, not restarted: its leases expire after `lease_ttl`, another worker claims them, finds the
  partition still open on the dead node, and, once the dead worker's record and its node's
  heartbeat are both older than `worker_timeout`, fails that node over (Cluster.claim_failover,
  then fail_over(reassign=False): its WAL's records are committed on its behalf) and starts the
  flow. That needs the dead node's WAL (its path in the target's metadata) reachable from this
  host; otherwise the partition waits for the dead worker to be restarted on its WAL, and
  `status()["waiting"]` says so.
A worker whose own node was failed over by a peer (it stalled past worker_timeout) is fenced: its
flows stop and it stops with an error; restart it.

Worker ids must be unique among the workers of a cluster (they are target node ids).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from ..cluster.lease import Lease, expire, is_held, read_lease
from ..cluster import Cluster, ClusterConfig
from ..cluster.partition import PARTITION_KV_PREFIX, partition_kv_key
from ..config import Config
from ..errors import ConfigError, InvalidArgumentError, S3StreamError, StreamFencedError, StreamNotClosedError
from ..metadata import MetadataStore, StreamState
from ..objectstore import ObjectStore, open_object_store
from ..reader import StreamReader, open_reader
from .checkpoint import sync_checkpoints
from .errors import MirrorError
from .flow import FAILED, MirrorFlow
from .heartbeat import HEARTBEATS, Heartbeater
from .policy import DefaultReplicationPolicy, ReplicationPolicy, check_name
from .flowstate import flow_key, flow_prefix

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..client import StreamClient

log = logging.getLogger("s3stream.mirror")

KiB = 1024
MiB = 1024 * KiB


# ---- KV keys (target cluster), beside records.py's flow/partition/map ---------------------------

def workers_prefix(flow_id: str) -> str:
    return flow_prefix(flow_id) + "workers/"


def worker_key(flow_id: str, worker_id: int) -> str:
    return f"{workers_prefix(flow_id)}{worker_id}"


def leases_prefix(flow_id: str) -> str:
    return flow_prefix(flow_id) + "lease/"


def lease_key(flow_id: str, target_partition: str) -> str:
    return leases_prefix(flow_id) + check_name("target partition", target_partition)


def leader_key(flow_id: str) -> str:
    return flow_prefix(flow_id) + "leader"


def heartbeat_summary_key(flow_id: str) -> str:
    """The leader's last heartbeats, per source ({"leader", "at", "heartbeats": {alias: {...}}}): a
    copy in KV for tools that have the target's metadata only (the partition is the record)."""
    return flow_prefix(flow_id) + "last-heartbeats"


def decode_json(raw: bytes | None) -> Any:
    """The JSON value of a KV record; None if absent or unreadable."""
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


# ---- configuration -------------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerConfig:
    """How a MirrorWorker balances and runs its flows (seconds unless named otherwise).

    interval: seconds between passes (keep-alive, discovery, balancing). A join, a leave or a new
        source partition is acted on within about one interval.
    lease_ttl: a lease not renewed for this long may be taken by another worker. Renewed every
        interval, so it must exceed two intervals; a crashed worker's partitions stand still for
        up to lease_ttl (plus a failover).
    worker_timeout: a worker whose record is older than this is not live: the others take its
        share. Also how old a dead worker's node heartbeat must be before it is failed over.
    checkpoint_interval / heartbeat_interval: the leader's sync_checkpoints and heartbeats.
    max_flows: flows (one thread each) this worker runs at most; partitions beyond the workers'
        maxima stay unassigned (status()["unassigned"]).
    retry_backoff: after a flow failed (or could not start), this worker leaves its partition to
        others for this long before claiming it again.
    flow_stop_timeout: seconds a flow's stop waits for its copy loop (then its partition closes).
    max_in_flight_bytes, fetch_bytes, poll_interval, skip_trimmed: each flow's (MirrorFlow).
    engine: the target node's engine Config (default Config()); the source reader (open_reader)
        uses its read settings (block cache, read-ahead, read_timeout).
    metrics: the target node's StreamClient(metrics=...): True or a prometheus_client registry
        exports its metrics (labelled with the worker id); False, none.
    """
    interval: float = 1.0
    lease_ttl: float = 10.0
    worker_timeout: float = 10.0
    checkpoint_interval: float = 10.0
    heartbeat_interval: float = 1.0
    max_flows: int = 64
    retry_backoff: float = 5.0
    flow_stop_timeout: float = 10.0
    max_in_flight_bytes: int = 8 * MiB
    fetch_bytes: int = 1 * MiB
    poll_interval: float = 0.05
    skip_trimmed: bool = False
    engine: Config | None = None
    metrics: "bool | CollectorRegistry" = False

    def __post_init__(self) -> None:
        for name in ("interval", "lease_ttl", "worker_timeout", "checkpoint_interval", "heartbeat_interval",
                     "retry_backoff", "flow_stop_timeout", "poll_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or not math.isfinite(value):
                raise ConfigError(f"WorkerConfig.{name} must be positive seconds, got {value!r}")
        for name in ("max_flows", "max_in_flight_bytes", "fetch_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"WorkerConfig.{name} must be a positive integer, got {value!r}")
        if self.lease_ttl <= 2 * self.interval:
            raise ConfigError(f"WorkerConfig.lease_ttl ({self.lease_ttl}) must exceed twice the interval "
                              f"({self.interval}): a lease is renewed once per interval")
        if self.worker_timeout <= 2 * self.interval:
            raise ConfigError(f"WorkerConfig.worker_timeout ({self.worker_timeout}) must exceed twice the interval "
                              f"({self.interval}): a worker's record is written once per interval")
        if not isinstance(self.skip_trimmed, bool):
            raise ConfigError(f"WorkerConfig.skip_trimmed must be a bool, got {self.skip_trimmed!r}")
        if self.engine is not None and not isinstance(self.engine, Config):
            raise ConfigError(f"WorkerConfig.engine must be an s3stream.Config or None, got {self.engine!r}")

    def flow_options(self) -> dict:
        return dict(max_in_flight_bytes=self.max_in_flight_bytes, fetch_bytes=self.fetch_bytes,
                    poll_interval=self.poll_interval, skip_trimmed=self.skip_trimmed)


def quotas(partitions: int, held: dict[int, int]) -> dict[int, int]:
    """Each live worker's quota: `partitions` // workers, plus one for the partitions % workers
    workers holding the most now (ties: lowest id), so a balanced assignment is kept as it is.
    `held`: live worker id -> leases it holds."""
    if not held:
        return {}
    base, extra = divmod(partitions, len(held))
    order = sorted(held, key=lambda w: (-held[w], w))
    return {w: base + (1 if i < extra else 0) for i, w in enumerate(order)}


class _Stores(NamedTuple):
    """A worker's stores and metadata, as given (URLs or ready-made objects)."""
    source_store: str | ObjectStore
    source_meta: str | MetadataStore
    target_store: str | ObjectStore
    target_meta: str | MetadataStore


@dataclass(frozen=True)
class _PublishedFlow:
    """A flow of another worker as its record publishes it: what a Heartbeater reads of a flow."""
    source_alias: str
    lag_records: int | None
    mirrored_as_of: float | None

    def metrics(self) -> "_PublishedFlow":
        return self


# ---- the worker ----------------------------------------------------------------------------------

class MirrorWorker:
    """One worker of flow `flow_id` (default "<source_alias>->target"); see the module docstring.

    Stores and metadata are URLs or ready-made objects (shared ones are not closed here).
    `partitions`: a filter on source partition names (True: mirror it). `policy` names target
    partitions (default DefaultReplicationPolicy). `target_alias`: this cluster's alias, for the
    heartbeats and to leave out source partitions that came from it.
    `on_event`: called (on the worker's thread) with each event dict (flow started, stopped,
    released, failed; leadership; failovers), also kept in `events`. `clock`: unix seconds."""

    def __init__(self, worker_id: int, *, source_store: str | ObjectStore, source_meta: str | MetadataStore,
                 target_store: str | ObjectStore, target_meta: str | MetadataStore, source_alias: str,
                 flow_id: str | None = None, wal_dir: str | os.PathLike, config: WorkerConfig | None = None,
                 policy: ReplicationPolicy | None = None, partitions: Callable[[str], bool] | None = None,
                 target_alias: str | None = None,
                 on_event: Callable[[dict], None] | None = None, clock: Callable[[], float] = time.time) -> None:
        if isinstance(worker_id, bool) or not isinstance(worker_id, int) or not 0 <= worker_id < 1 << 63:
            raise InvalidArgumentError(f"worker_id must be an int in [0, 2**63), got {worker_id!r}; "
                                       f"it is the worker's node id in the target cluster")
        self.worker_id = worker_id
        self.source_alias = check_name("source alias", source_alias, "A")
        self.flow_id = check_name("flow id", f"{source_alias}->target" if flow_id is None else flow_id, "A->B")
        self.target_alias = None if target_alias is None else check_name("target alias", target_alias, "B")
        self.config = config or WorkerConfig()
        if not isinstance(self.config, WorkerConfig):
            raise ConfigError(f"config must be a WorkerConfig, got {type(self.config).__name__}")
        self.policy = policy or DefaultReplicationPolicy()
        if partitions is not None and not callable(partitions):
            raise InvalidArgumentError(f"partitions must be a callable(name) -> bool or None, got {partitions!r}")
        self.partition_filter = partitions
        if wal_dir is None or not os.fspath(wal_dir):
            raise InvalidArgumentError("wal_dir must name a directory for the worker's WALs, e.g. /var/lib/mirror/1")
        self.wal_dir = os.path.abspath(os.fspath(wal_dir))
        self._stores = _Stores(source_store, source_meta, target_store, target_meta)
        self.on_event = on_event
        self.clock = clock
        self._ns = lambda: int(self.clock() * 1e9)
        self.events: deque[dict] = deque(maxlen=1000)
        self.errors: deque[str] = deque(maxlen=100)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._target: StreamClient | None = None
        self._source: StreamReader | None = None
        self._flows: dict[str, MirrorFlow] = {}          # target partition -> running flow
        self._leases: dict[str, Lease] = {}              # target partition -> lease held
        self._sources: dict[str, str] = {}               # target partition -> source partition (last discovery)
        self._pending: dict[str, str] = {}               # lease held, flow not started: why
        self._waiting: dict[str, str] = {}               # pending on a dead worker we cannot fail over
        self._renewed: dict[str, float] = {}             # target partition -> monotonic time of last renewal
        self._backoff: dict[str, float] = {}             # target partition -> monotonic time to claim again
        self._left_out: set[str] = set()                 # source partitions the policy cannot name
        self._leader: Lease | None = None
        self._heartbeater: Heartbeater | None = None
        self._next_beat = 0.0
        self._next_checkpoint = 0.0
        self._live: list[int] = []
        self._records: dict[int, dict] = {}
        self._quota: int | None = None
        self._unassigned = 0
        self._last_keepalive = float("-inf")
        self._failover_store: ObjectStore | None = None
        self.fatal: BaseException | None = None
        self._stopped: dict | None = None
        self.passes = 0
        self.checkpoints = 0
        self.last_checkpoint: dict | None = None
        self.heartbeats = 0

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "MirrorWorker":
        """Open the target node (it replays this worker's WAL if it crashed) and the source
        reader, register in the target, and run the loop on a thread of its own."""
        from ..client import StreamClient
        if self._thread is not None:
            raise MirrorError(f"worker {self.worker_id} was started already; create a new MirrorWorker")
        os.makedirs(self.wal_dir, exist_ok=True)
        engine = self.config.engine or Config()
        s = self._stores
        target = StreamClient(self.worker_id, os.path.join(self.wal_dir, f"target-{self.worker_id}.wal"),
                              s.target_store, s.target_meta, engine, metrics=self.config.metrics)
        try:
            source = open_reader(s.source_meta, s.source_store, engine)
        except BaseException:
            target.close(retire=True)
            raise
        self._source, self._target = source, target
        try:
            self._adopt_previous_leases()
            self._publish()
        except BaseException:
            source.close()
            target.close(retire=True)
            self._source = self._target = None
            raise
        replayed = target.recovered.get("replayed", 0)
        self._event("joined", detail=f"node {self.worker_id} of the target, WAL records replayed: {replayed}")
        self._thread = threading.Thread(target=self._run, name=f"mirror-worker-{self.worker_id}", daemon=True)
        self._thread.start()
        return self

    def _clients(self) -> tuple[StreamReader, "StreamClient"]:
        """(source reader, target node): what start() opened."""
        source, target = self._source, self._target
        if source is None or target is None:
            raise MirrorError(f"mirror worker {self.worker_id} is not started: call start() first")
        return source, target

    @property
    def target_meta(self) -> MetadataStore:
        return self._clients()[1].metadata

    @property
    def source_meta(self) -> MetadataStore:
        return self._clients()[0].metadata

    @property
    def target_client(self) -> "StreamClient":
        return self._clients()[1]

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def flows(self) -> dict[str, MirrorFlow]:
        """The flows running here now, by target partition."""
        with self._lock:
            return dict(self._flows)

    def leases(self) -> list[str]:
        """The target partitions whose leases this worker holds (running or pending)."""
        with self._lock:
            return sorted(self._leases)

    @property
    def is_leader(self) -> bool:
        return self._leader is not None and self._leader.token is not None

    def _run(self) -> None:
        # Workers started together see each other before the first claim: one interval to join.
        self._stop.wait(self.config.interval)
        while not self._stop.is_set():
            try:
                self.run_once()
            except StreamFencedError as e:
                self._fenced(e)
                return
            except Exception as e:  # noqa: BLE001 - reported; the next pass retries
                log.exception("mirror worker %d: pass failed", self.worker_id)
                self.errors.append(f"pass: {e}")
            self._stop.wait(self.config.interval)

    def stop(self, timeout: float = 30.0) -> dict:
        """Stop every flow (each closes its target partition), release the leases, leave (the
        record is deleted, so the others take the partitions over at their next pass) and close
        the source reader and the target node. Returns within about `timeout` seconds plus the
        partitions' closes (a force upload of each tail). Returns the final status()."""
        if self._stopped is not None:
            return self._stopped
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(0.1, deadline - time.monotonic())

        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(left())
            if self._thread.is_alive():
                log.warning("mirror worker %d: its pass did not end within %.1f s; stopping its flows anyway",
                            self.worker_id, timeout)
        for target in sorted(self.leases()):
            self._drop(target, "worker stopping", timeout=min(self.config.flow_stop_timeout, left()))
        self._step_down()
        final = self.status()
        if self._source is not None and self._target is not None:
            try:
                self.target_meta.delete_kv(worker_key(self.flow_id, self.worker_id))
            except S3StreamError as e:
                log.warning("mirror worker %d: deleting its record: %s", self.worker_id, e)
            self._source.close()
            try:
                self._target.close(timeout=left(), retire=True)
            except S3StreamError as e:
                log.warning("mirror worker %d: closing its target node: %s", self.worker_id, e)
        if self._failover_store is not None:
            self._failover_store.close()
            self._failover_store = None
        self._event("left")
        self._stopped = final
        return final

    def __enter__(self) -> "MirrorWorker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- one pass ----------------------------------------------------------------------------

    def run_once(self) -> None:
        """One pass (see the module docstring); the loop calls it every interval."""
        self.passes += 1
        self._keepalive(force=True)
        self._reap_failed()
        sources = self._discover()
        with self._lock:
            self._sources = sources
        for target in [t for t in self.leases() if t not in sources]:
            self._drop(target, f"source partition {self._sources_name(target)!r} was deleted")
        self._live, self._records = self._live_workers()
        lease_records = self._lease_records(sources)
        quota = self._compute_quota(sources, lease_records)
        self._release_excess(quota)
        self._retry_pending()
        self._claim(sources, lease_records, quota)
        self._lead()
        self._publish()

    def _sources_name(self, target: str) -> str:
        flow = self._flows.get(target)
        return flow.source_partition if flow is not None else target

    def _keepalive(self, force: bool = False) -> None:
        """Heartbeat the target node, write this worker's record and renew its leases (at most once
        per interval unless forced): called between slow steps so a long pass never lets them lapse."""
        now = time.monotonic()
        if not force and now - self._last_keepalive < self.config.interval:
            return
        self._last_keepalive = now
        target_client = self.target_client
        # StreamFencedError from the target: a peer failed this node over; the loop stops.
        target_client.metadata.heartbeat(target_client.node_id, target_client.node_epoch)
        self._publish()
        for target in self.leases():
            lease = self._leases.get(target)
            if lease is None:
                continue
            try:
                held = lease.acquire()
            except S3StreamError as e:
                # Nobody can take it before it expires: keep copying until then.
                if time.monotonic() - self._renewed.get(target, 0.0) < self.config.lease_ttl * 0.9:
                    self.errors.append(f"renewing lease of {target}: {e}")
                    continue
                held = False
            if held:
                self._renewed[target] = time.monotonic()
            else:
                self._drop(target, "lease lost (another worker took it)", release_lease=False)

    def _reap_failed(self) -> None:
        for target, flow in self.flows().items():
            if flow.state == FAILED:
                error = flow.error
                self.errors.append(f"flow {target}: {error}")
                self._drop(target, f"failed: {error}", backoff=True)

    def _discover(self) -> dict[str, str]:
        """{target partition: source partition} of every source partition this flow mirrors."""
        out: dict[str, str] = {}
        for key in self.source_meta.list_kv(PARTITION_KV_PREFIX):
            name = key.removeprefix(PARTITION_KV_PREFIX)
            if not name or name == HEARTBEATS or "/" in name:
                continue
            if self.partition_filter is not None and not self.partition_filter(name):
                continue
            if self.target_alias is not None and getattr(self.policy, "is_cycle", lambda *a: False)(
                    self.target_alias, name):
                continue
            try:
                out[self.policy.target_name(self.source_alias, name)] = name
            except MirrorError as e:
                if name not in self._left_out:
                    self._left_out.add(name)
                    self.errors.append(f"source partition {name!r} left out: {e}")
        return out

    def _live_workers(self) -> tuple[list[int], dict[int, dict]]:
        now = self.clock()
        records: dict[int, dict] = {}
        for key, raw in self.target_meta.list_kv(workers_prefix(self.flow_id)).items():
            record = decode_json(raw)
            try:
                records[int(key.rsplit("/", 1)[1])] = record if isinstance(record, dict) else {}
            except ValueError:
                continue
        live = sorted(w for w, r in records.items() if isinstance(r.get("at"), (int, float))
                      and now - r["at"] < self.config.worker_timeout)
        if self.worker_id not in live:
            live = sorted(live + [self.worker_id])
        return live, records

    def _lease_records(self, sources: dict[str, str]) -> dict[str, dict]:
        """The valid (unexpired) lease records of current partitions, by target partition."""
        now = self._ns()
        prefix = leases_prefix(self.flow_id)
        out = {}
        for key, raw in self.target_meta.list_kv(prefix).items():
            target, record = key[len(prefix):], read_lease(raw)
            if target in sources and is_held(record, now):
                out[target] = record
        return out

    def _compute_quota(self, sources: dict[str, str], lease_records: dict[str, dict]) -> int:
        held = {w: 0 for w in self._live}
        for target, record in lease_records.items():
            if record.get("holder") in held:
                held[record["holder"]] += 1
        held[self.worker_id] = len(self._leases)
        quota = min(quotas(len(sources), held)[self.worker_id], self.config.max_flows)
        claimed = len(set(lease_records) | set(self._leases))
        self._quota, self._unassigned = quota, max(0, len(sources) - claimed)
        return quota

    def _release_excess(self, quota: int) -> None:
        held = self.leases()
        excess = len(held) - quota
        if excess <= 0:
            return
        # Pending ones first (nothing runs there), then from the end of the name order.
        order = sorted(t for t in held if t in self._pending) + sorted((t for t in held if t not in self._pending),
                                                                       reverse=True)
        for target in order[:excess]:
            self._drop(target, f"rebalance: quota {quota} of {len(self._sources)} partitions over "
                               f"{len(self._live)} live workers")
            self._keepalive()

    def _retry_pending(self) -> None:
        for target in sorted(self._pending):
            if self._stop.is_set():
                return
            source = self._sources.get(target)
            if source is not None and target in self._leases:
                self._start_flow(target, source)
                self._keepalive()

    def _claim(self, sources: dict[str, str], lease_records: dict[str, dict], quota: int) -> None:
        room = quota - len(self._leases)
        if room <= 0:
            return
        now = time.monotonic()
        free = sorted(t for t in sources if t not in lease_records and t not in self._leases
                      and self._backoff.get(t, 0.0) <= now)
        if not free:
            return
        # Workers claiming at once start at different places of the list: fewer lost races.
        index = self._live.index(self.worker_id) if self.worker_id in self._live else 0
        shift = (index * len(free)) // max(1, len(self._live))
        for target in free[shift:] + free[:shift]:
            if room <= 0 or self._stop.is_set():
                return
            lease = Lease(self.target_meta, self.worker_id, self.config.lease_ttl, key=lease_key(self.flow_id, target),
                          clock=self._ns)
            if not lease.acquire():
                continue
            with self._lock:
                self._leases[target] = lease
            self._renewed[target] = time.monotonic()
            self._event("claimed", target, sources[target], f"lease epoch {lease.epoch}")
            room -= 1
            self._start_flow(target, sources[target])
            self._keepalive()

    def _start_flow(self, target: str, source: str) -> None:
        try:
            flow = MirrorFlow.for_source(*self._clients(), source, self.flow_id,
                                         source_alias=self.source_alias, target_alias=self.target_alias,
                                         policy=self.policy, **self.config.flow_options())
            if flow.target_partition != target:
                raise MirrorError(f"policy {self.policy!r} names {source!r} {flow.target_partition!r}, not {target!r}")
            flow.start()
        except StreamNotClosedError as e:
            reason = f"target partition still open elsewhere: {e}"
            with self._lock:
                first = target not in self._pending
                self._pending[target] = reason
            if first:
                self._event("waiting", target, source, str(e))
            self._free_partition(target)
            return
        except S3StreamError as e:
            self.errors.append(f"starting flow {target}: {e}")
            self._drop(target, f"could not start: {e}", backoff=True)
            return
        with self._lock:
            self._flows[target] = flow
            self._pending.pop(target, None)
            self._waiting.pop(target, None)
        m = flow.metrics()
        self._event("started", target, source, f"upstream {m.upstream_position}, downstream {m.downstream_position}")

    def _drop(self, target: str, reason: str, *, release_lease: bool = True, backoff: bool = False,
              timeout: float | None = None) -> None:
        """Stop the flow (closing its target partition), then release the lease."""
        with self._lock:
            flow = self._flows.pop(target, None)
            lease = self._leases.pop(target, None)
            self._pending.pop(target, None)
            self._waiting.pop(target, None)
        self._renewed.pop(target, None)
        if backoff:
            self._backoff[target] = time.monotonic() + self.config.retry_backoff
        metrics = None
        if flow is not None:
            metrics = flow.stop(timeout=self.config.flow_stop_timeout if timeout is None else timeout, release=True)
        if lease is not None and release_lease:
            try:
                lease.release()
            except S3StreamError as e:          # the others wait for its expiry instead
                self.errors.append(f"releasing lease of {target}: {e}")
        if flow is not None or lease is not None:
            detail = reason if metrics is None else f"{reason}; mirrored up to upstream {metrics.upstream_position}"
            self._event("stopped" if flow is not None else "released", target,
                        flow.source_partition if flow is not None else None, detail)

    # ---- dead workers --------------------------------------------------------------------------

    def _free_partition(self, target: str) -> None:
        """The target partition is open on another node: if that node is a dead worker of this
        flow (record and node heartbeat older than worker_timeout), fail it over when its WAL is
        reachable from here; else say what it waits for."""
        try:
            holder = self._holder_node(target)
            if holder is None or holder == self.worker_id:
                return
            reason = self._failover_dead(holder)
        except S3StreamError as e:
            reason = f"failover of the node holding {target} failed: {e}"
            self.errors.append(reason)
        if reason is not None:
            with self._lock:
                if target in self._pending or target == HEARTBEATS:
                    self._waiting[target] = reason

    def _holder_node(self, name: str) -> int | None:
        """The target node that holds partition `name` open (its meta stream's owner), if any."""
        raw = self.target_meta.get_kv(partition_kv_key(name))
        if raw is None:
            return None
        meta = self.target_meta.get_stream(int(raw))
        return meta.owner_node_id if meta.state == StreamState.OPENED else None

    def _failover_dead(self, node_id: int) -> str | None:
        """Fail over `node_id` if it is a dead worker of this flow; None when done (or not needed),
        else why not."""
        now = self.clock()
        record = self._records.get(node_id)
        if record is None:
            return (f"held by node {node_id}, which is not a worker of flow {self.flow_id!r}: stop the writer "
                    f"there (the mirror must be a mirrored partition's only writer)")
        at = record.get("at")
        if isinstance(at, (int, float)) and now - at < self.config.worker_timeout:
            return f"held by live worker {node_id} (it releases it at its next pass)"
        node = self.target_meta.get_node(node_id)
        if node.failover:
            return None
        silent = now - node.heartbeat_ns / 1e9
        if silent < self.config.worker_timeout:
            return f"held by worker {node_id}, whose node still heartbeats ({silent:.1f} s ago)"
        if not os.path.exists(node.wal_path):
            return (f"held by dead worker {node_id}: its WAL {node.wal_path!r} is not reachable from this host, so "
                    f"it cannot be failed over from here; restart worker {node_id} on its WAL (same worker id and "
                    f"wal_dir), which replays it and releases its partitions")
        cluster = self._cluster()
        if not cluster.claim_failover(node_id, node.node_epoch, self.worker_id):
            return f"worker {node_id} is being failed over by another worker"
        self._event("failover", detail=f"dead worker {node_id} (silent {silent:.1f} s): committing its WAL "
                                       f"{node.wal_path} on its behalf")
        report = cluster.fail_over(node_id, reassign=False)
        self._event("failed-over", detail=f"worker {node_id}: {report.replayed} WAL records committed, "
                                          f"{report.streams_closed} streams closed in {report.seconds:.2f} s")
        return None

    def _cluster(self) -> Cluster:
        store = self._stores.target_store
        if isinstance(store, str):
            if self._failover_store is None:
                self._failover_store = open_object_store(store)
            store = self._failover_store
        interval = self.config.interval
        timeout = max(self.config.worker_timeout, 2 * interval + 0.001)
        return Cluster(self.target_meta, store, ClusterConfig(heartbeat_interval=interval, heartbeat_timeout=timeout),
                       engine_config=self.config.engine or Config(), clock=self._ns)

    def _adopt_previous_leases(self) -> None:
        """Expire the leases an earlier incarnation of this worker still holds (it was fenced when
        this one registered its node, and its partitions closed by the WAL replay), so this one
        need not wait lease_ttl to claim them."""
        now = self._ns()
        keys = dict(self.target_meta.list_kv(leases_prefix(self.flow_id)))
        raw = self.target_meta.get_kv(leader_key(self.flow_id))
        if raw is not None:
            keys[leader_key(self.flow_id)] = raw
        for key, raw in keys.items():
            record = read_lease(raw)
            if is_held(record, now) and record["holder"] == self.worker_id:
                expire(self.target_meta, key, raw)

    def _fenced(self, error: BaseException) -> None:
        self.fatal = error
        message = (f"worker {self.worker_id} was fenced: a peer failed its target node over while it was "
                   f"unresponsive ({error}); its flows stop; restart it")
        log.error("mirror: %s", message)
        self.errors.append(message)
        for target in self.leases():
            self._drop(target, "fenced", release_lease=False, timeout=1.0)
        self._step_down()
        self._event("fenced", detail=message)

    # ---- leadership ---------------------------------------------------------------------------

    def _lead(self) -> None:
        if self._leader is None:
            self._leader = Lease(self.target_meta, self.worker_id, self.config.lease_ttl,
                                 key=leader_key(self.flow_id), clock=self._ns)
        was = self._leader.token is not None
        if not self._leader.acquire():
            if was:
                self._event("follower", detail="lost the leader lease")
                self._stop_heartbeater()
            return
        if not was:
            self._event("leader", detail=f"leader lease epoch {self._leader.epoch}: heartbeats and checkpoints")
            self._next_beat = self._next_checkpoint = 0.0
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + self.config.heartbeat_interval
            self._beat()
        if now >= self._next_checkpoint:
            self._next_checkpoint = now + self.config.checkpoint_interval
            self._checkpoint()

    def _published_flows(self) -> list:
        """Every live worker's flows: this worker's own, the others' from their records."""
        out: list = list(self.flows().values())
        for worker in self._live:
            if worker == self.worker_id:
                continue
            flows = self._records.get(worker, {}).get("flows")
            for entry in (flows.values() if isinstance(flows, dict) else ()):
                if isinstance(entry, dict) and entry.get("state") == "running":
                    out.append(_PublishedFlow(self.source_alias, entry.get("lag_records"),
                                              entry.get("mirrored_as_of")))
        return out

    def _beat(self) -> None:
        if self._heartbeater is None:
            self._heartbeater = Heartbeater(self.target_client, self._published_flows, target_alias=self.target_alias,
                                            interval=self.config.heartbeat_interval,
                                            append_timeout=max(1.0, self.config.lease_ttl / 3), clock=self.clock)
        try:
            beats = self._heartbeater.beat()
        except StreamNotClosedError as e:
            self.errors.append(f"heartbeat: {e}")
            self._free_partition(HEARTBEATS)
            return
        except S3StreamError as e:
            self.errors.append(f"heartbeat: {e}")
            self._stop_heartbeater()
            return
        with self._lock:
            self._waiting.pop(HEARTBEATS, None)
        self.heartbeats += len(beats)
        if not beats:
            return
        summary = {"leader": self.worker_id, "at": self.clock(),
                   "heartbeats": {hb.source: dataclasses.asdict(hb) for hb in beats}}
        key = heartbeat_summary_key(self.flow_id)
        # Only the leader writes the summary: without a lease token (stepped down since the pass
        # began) it is not written, rather than written unguarded.
        token = None if self._leader is None else self._leader.token
        current = self.target_meta.get_kv(key)
        if token is None or not self.target_meta.replace_kv(key, current, json.dumps(summary, sort_keys=True).encode(),
                                                            guard=token):
            log.info("mirror worker %d: heartbeat summary not recorded (leadership or record changed)",
                     self.worker_id)

    def _checkpoint(self) -> None:
        if self.target_meta.get_kv(flow_key(self.flow_id)) is None:
            return                  # no flow of it started yet: nothing to translate
        report = sync_checkpoints(self.source_meta, self.target_meta, self.flow_id, self.policy)
        self.checkpoints += 1
        self.last_checkpoint = {"at": self.clock(), "entries": len(report.entries), "committed": report.committed,
                                "skipped_groups": dict(report.skipped_groups)}

    def _stop_heartbeater(self) -> None:
        if self._heartbeater is not None:
            self._heartbeater.stop(timeout=1.0, release=True)
            self._heartbeater = None

    def _step_down(self) -> None:
        self._stop_heartbeater()
        if self._leader is not None:
            try:
                self._leader.release()
            except S3StreamError as e:
                self.errors.append(f"releasing the leader lease: {e}")

    # ---- observation --------------------------------------------------------------------------

    def _flow_entries(self) -> dict[str, dict]:
        out = {}
        for target, flow in self.flows().items():
            m = flow.metrics()
            out[target] = {"source_partition": m.source_partition, "state": m.state,
                           "upstream_position": m.upstream_position, "downstream_position": m.downstream_position,
                           "lag_records": m.lag_records, "mirrored_as_of": m.mirrored_as_of, "error": m.error}
        return out

    def _publish(self) -> None:
        with self._lock:
            pending, waiting = dict(self._pending), dict(self._waiting)
        record = {"worker": self.worker_id, "at": self.clock(), "timeout": self.config.worker_timeout,
                  "node": self.target_client.node_id, "wal_path": os.path.join(self.wal_dir, f"target-{self.worker_id}.wal"),
                  "leader": self.is_leader, "flows": self._flow_entries(), "pending": pending, "waiting": waiting}
        self.target_meta.put_kv(worker_key(self.flow_id, self.worker_id), json.dumps(record, sort_keys=True).encode())

    def _event(self, kind: str, target: str | None = None, source: str | None = None, detail: str = "") -> None:
        event = {"at": self.clock(), "worker": self.worker_id, "event": kind, "target_partition": target,
                 "source_partition": source, "detail": detail}
        self.events.append(event)
        log.info("mirror worker %d: %s %s %s", self.worker_id, kind, target or "", detail)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # noqa: BLE001 - a broken observer must not stop the worker
                log.exception("mirror worker %d: on_event failed", self.worker_id)

    def status(self) -> dict:
        """This worker now: flows with their metrics, leases held, live workers, quota, pending and
        waiting partitions (why), leadership, checkpoints and heartbeats run, errors."""
        flows = {t: dataclasses.asdict(f.metrics()) for t, f in self.flows().items()}
        with self._lock:
            pending, waiting, leases = dict(self._pending), dict(self._waiting), sorted(self._leases)
            sources = dict(self._sources)
        return {"worker_id": self.worker_id, "flow_id": self.flow_id, "source_alias": self.source_alias,
                "running": self.running, "leader": self.is_leader, "live_workers": list(self._live),
                "partitions": len(sources), "quota": self._quota, "unassigned": self._unassigned,
                "leases": leases, "flows": flows, "pending": pending, "waiting": waiting,
                "checkpoints": self.checkpoints, "last_checkpoint": self.last_checkpoint,
                "heartbeats": self.heartbeats, "errors": list(self.errors),
                "fatal": None if self.fatal is None else str(self.fatal)}

    def __repr__(self) -> str:
        return f"<MirrorWorker {self.worker_id} flow={self.flow_id} leases={len(self._leases)}>"
