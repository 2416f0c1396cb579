"""A process-level cluster fault harness (issues 26 and 32): real node processes, a real
PostgreSQL server and a real S3 server (moto), or SQLite and a local directory; faults made with
signals (SIGSTOP, kill -9), server stops and deleted disks; a checker that reads back every
committed record and compares it with every acknowledgment the nodes logged.

Pieces, in the order a run uses them:
- payloads (`payload_id`, `make_payload`, `check_payload`): unique, self-describing records;
- servers (`PostgresProcess`, `MotoProcess`) and backends (`Backend`: metadata + object store
  URLs, and what the harness can do to them): `pg-s3` and `sqlite-local`;
- `NodeProcess`: one node id (tests/children/cluster_harness_node.py), restarted as new incarnations;
- `ClusterRun`: starts the backend's nodes, assigns partitions, injects faults (each recorded in
  the fault timeline with its start and end), restarts nodes a supervisor would restart, ends
  the faults, lets the cluster settle, closes the nodes cleanly, reads every partition back;
- `plan_schedule`: the seeded random fault schedule of a campaign;
- `check`: the counts (lost, overwritten, duplicated, offsets acknowledged twice, false
  failovers, unacknowledged gaps outside faults);
- `write_report`: JSON and a PNG timeline.

Times: acknowledgments and faults carry CLOCK_MONOTONIC nanoseconds (one clock for every process
of the host) and wall-clock nanoseconds; the cluster's failover records carry wall-clock ones.
Reports give seconds since the run's start.

Nothing here changes the library: it drives it from outside, as an operator and a supervisor
would. Helpers for tests, not library code (STYLE: helpers shared by tests live with them).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from bisect import bisect_left
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from testservers.moto import MotoProcess
from testservers.postgres import PostgresProcess as _PostgresProcess
from s3stream.cluster import read_partition

HERE = Path(__file__).resolve().parent
NODE_SCRIPT = HERE.parent / "children" / "cluster_harness_node.py"

#: Exit code of a node process whose agent found it fenced (the harness restarts it).
FENCED_EXIT = 75
#: Exit code of a node process that could not start (metadata or store down): restarted.
START_FAILED_EXIT = 2
#: Node id of the read-back client (never a cluster node).
READER_NODE_ID = 9_000
#: Every kind of fault the harness injects.
FAULT_KINDS = ("pause", "kill", "pg-outage", "s3-freeze", "migrate", "lose-host")
#: "Until the end" in windows of wall-clock ns.
FOREVER = 1 << 62
#: Faults that make a node unable to heartbeat: a failover of that node is justified while one lasts.
NODE_DOWN_KINDS = ("pause", "kill", "lose-host")


# ---- payloads -----------------------------------------------------------------------------------

def payload_id(node_id: int, incarnation: int, partition: str, seq: int) -> str:
    return f"n{node_id}-i{incarnation}-{partition}-{seq}"


def _padding(pid: str) -> bytes:
    raw = pid.encode()
    length = 100 + int.from_bytes(hashlib.blake2b(raw, digest_size=2).digest(), "big") % 401
    return hashlib.shake_256(raw).digest(length)


def make_payload(pid: str) -> bytes:
    """`pid|` then 100-500 pseudo-random bytes derived from the id: content that checks itself."""
    return pid.encode() + b"|" + _padding(pid)


def check_payload(raw: bytes) -> str | None:
    """The payload's id if its bytes are what make_payload(id) makes, else None (corrupt)."""
    head, sep, tail = bytes(raw).partition(b"|")
    if not sep:
        return None
    try:
        pid = head.decode()
    except UnicodeDecodeError:
        return None
    return pid if tail == _padding(pid) else None


def payload_node(pid: str) -> tuple[int, int]:
    """(node id, incarnation) of a payload id."""
    node, inc = pid.split("-", 2)[:2]
    return int(node[1:]), int(inc[1:])


# ---- processes ---------------------------------------------------------------------------------

def kill_group(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGCONT + SIGKILL to the process group `proc` leads (started with start_new_session)."""
    if proc is None:
        return
    if proc.poll() is None:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)


def wait_stopped(pid: int, timeout: float = 5.0) -> bool:
    """Until the kernel has stopped `pid` (SIGSTOP is delivered asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return True
        except OSError:
            return False
        time.sleep(0.001)
    return False


class PostgresProcess(_PostgresProcess):
    """The harness's PostgreSQL: testservers' server without fsync (no test here rests on its
    durability across a host crash: it is stopped with -m immediate, which keeps the WAL),
    with room for every node's pool."""

    def __init__(self) -> None:
        super().__init__(fsync=False, max_connections=300)


def node_application_name(node_id: int) -> str:
    """The application_name of a node process's PostgreSQL sessions (libpq reads PGAPPNAME)."""
    return f"s3stream-harness-node-{node_id}"


# ---- backends ------------------------------------------------------------------------------------

class Backend:
    """Where a run's metadata and objects live, and the faults the harness can make there."""
    name = "?"
    meta_url = ""
    store_url = ""
    faults: tuple[str, ...] = ("pause", "kill", "migrate", "lose-host")

    def admin_meta(self):
        """A metadata store for the orchestrator, with short waits (its calls must not hang a
        fault's timing for long while the store is down)."""
        raise NotImplementedError

    def stop_metadata(self) -> None:
        raise NotImplementedError(f"{self.name}: the metadata store cannot be stopped")

    def start_metadata(self) -> None:
        raise NotImplementedError

    def freeze_store(self) -> None:
        raise NotImplementedError(f"{self.name}: the object store cannot be frozen")

    def thaw_store(self) -> None:
        raise NotImplementedError

    def in_transaction(self, node_id: int) -> bool:
        """Whether node `node_id` is inside a metadata transaction now (as far as one can tell)."""
        return False

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        from s3stream.metadata import redact_url
        return dict(name=self.name, metadata=redact_url(self.meta_url), store=self.store_url)


class SqliteLocalBackend(Backend):
    name = "sqlite-local"

    def __init__(self, workdir: Path) -> None:
        self.meta_url = f"sqlite:///{workdir}/meta.db"
        self.store_url = f"file://{workdir}/objects"

    def admin_meta(self):
        from s3stream.metadata import open_metadata
        return open_metadata(self.meta_url, busy_timeout_s=5.0)

    def in_transaction(self, node_id: int) -> bool:
        """Someone holds the write lock (the caller has just stopped the only suspect)."""
        import sqlite3
        conn = sqlite3.connect(self.meta_url[len("sqlite:///"):], timeout=0.05, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError:
            return True
        finally:
            conn.close()


class PgS3Backend(Backend):
    """A fresh database on `pg` and a fresh bucket on `moto`; the servers may be shared by runs
    (`services`) or owned by this backend (closed with it)."""
    name = "pg-s3"
    faults = ("pause", "kill", "migrate", "lose-host", "pg-outage", "s3-freeze")

    def __init__(self, pg: PostgresProcess, moto: MotoProcess, owned: bool = False) -> None:
        self.pg, self.moto, self.owned = pg, moto, owned
        if not pg.running:
            pg.start()
        if moto.frozen:
            moto.thaw()
        suffix = f"{os.getpid()}_{os.urandom(3).hex()}"
        self.database = f"harness_{suffix}"
        self.meta_url = pg.create_database(self.database)
        self.store_url = (f"s3://harness-{suffix.replace('_', '-')}/data?endpoint_url={moto.endpoint}"
                          "&create_bucket=1&read_timeout=2&connect_timeout=1&max_attempts=2")

    def admin_meta(self):
        from s3stream.metadata import open_metadata
        return open_metadata(self.meta_url, connect_timeout_s=2.0, pool_timeout_s=3.0, lock_timeout_s=5.0)

    def in_transaction(self, node_id: int) -> bool:
        import psycopg
        try:
            with psycopg.connect(self.meta_url, autocommit=True, connect_timeout=2) as conn:
                return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                                    "AND datname = current_database() AND xact_start IS NOT NULL",
                                    (node_application_name(node_id),)).fetchone()[0] > 0
        except psycopg.Error:
            return False

    def stop_metadata(self) -> None:
        self.pg.stop("immediate")

    def start_metadata(self) -> None:
        self.pg.start()

    def freeze_store(self) -> None:
        self.moto.freeze()

    def thaw_store(self) -> None:
        self.moto.thaw()

    def close(self) -> None:
        if self.moto.frozen:
            self.moto.thaw()
        if not self.pg.running:
            with contextlib.suppress(Exception):
                self.pg.start()
        if self.owned:
            self.moto.close()
            self.pg.close()
        else:
            from testservers.postgres import PostgresServer
            with contextlib.suppress(Exception):      # the shared server keeps no run's database
                PostgresServer(self.pg.url).drop_database(self.database)


@contextlib.contextmanager
def pg_s3_services(log_dir: str | None = None):
    """A PostgreSQL server and a moto server for several runs (each run: its own database and
    bucket). Both are stopped and removed on exit, whatever happened."""
    pg = moto = None
    try:
        pg = PostgresProcess()
        pg.start()
        moto = MotoProcess(log_dir)
        yield pg, moto
    finally:
        if moto is not None:
            moto.close()
        if pg is not None:
            pg.close()


def make_backend_faults(kind: str) -> tuple[str, ...]:
    """The faults a backend of `kind` supports (without starting it)."""
    return {"sqlite-local": SqliteLocalBackend.faults, "pg-s3": PgS3Backend.faults}[kind]


def make_backend(kind: str, workdir: Path, services: tuple[PostgresProcess, MotoProcess] | None = None) -> Backend:
    """`sqlite-local`, or `pg-s3` on `services` (servers of its own if None, closed with it)."""
    if kind == "sqlite-local":
        return SqliteLocalBackend(workdir)
    if kind == "pg-s3":
        if services is not None:
            return PgS3Backend(*services)
        pg = PostgresProcess()
        try:
            pg.start()
            moto = MotoProcess(str(workdir))
        except BaseException:
            pg.close()
            raise
        return PgS3Backend(pg, moto, owned=True)
    raise ValueError(f"unknown backend {kind!r}; use pg-s3 or sqlite-local")


# ---- configuration ----------------------------------------------------------------------------

@dataclass
class RunConfig:
    """What a run starts and how fast its nodes judge each other."""
    nodes: int = 3
    partitions: int = 6
    heartbeat_interval: float = 0.2
    heartbeat_timeout: float = 1.5
    migration_timeout: float = 5.0
    agent_interval: float = 0.05
    rate: float = 100.0                 # appends per second per partition (one producer each)
    upload_interval: float = 0.2
    settle_timeout: float = 60.0        # after the faults end: until every partition acknowledges
    start_timeout: float = 90.0
    restart_delay: float = 1.0          # a supervisor restarts an exited node after this
    forget_first: float = 5.0           # retrying Cluster.forget before the replacement starts anyway
    forget_timeout: float = 30.0        # retrying Cluster.forget in all
    restart_wait: float = 60.0          # a killed or replaced node's fault lasts until it started, at most this
    wal: str = "file"                   # "objects": each node's WAL on the object store (issue 27)
    host_down: float = 6.0              # objects: a lost host's node starts again on a new host after this

    @property
    def gap_limit(self) -> float:
        """Longest time a partition may go without acknowledgments outside faults touching its owner."""
        return self.heartbeat_timeout + 5.0

    def cluster_config(self):
        from s3stream.cluster import ClusterConfig
        return ClusterConfig(agent_interval=self.agent_interval, heartbeat_interval=self.heartbeat_interval,
                             heartbeat_timeout=self.heartbeat_timeout, migration_timeout=self.migration_timeout)


#: The read-back client's block cache: room for a run's small StreamSetObjects, read together.
READ_BACK_CACHE = 64 << 20


def engine_config(**overrides):
    from conftest import small_config
    kw = dict(upload_interval=0.2, close_timeout=30.0)
    kw.update(overrides)
    return small_config(**kw)


# ---- the fault timeline ------------------------------------------------------------------------

@dataclass
class FaultRecord:
    """One injected fault: what, on what, from when to when (monotonic and wall ns)."""
    id: int
    kind: str
    target: str                      # "node 2", "pg", "s3", "p3"
    start_ns: int
    start_wall_ns: int
    nodes: list[int] = field(default_factory=list)       # node ids it stops or moves from/to
    partitions: list[str] = field(default_factory=list)
    is_global: bool = False          # touches every node (the metadata or object store)
    end_ns: int | None = None
    end_wall_ns: int | None = None
    detail: dict = field(default_factory=dict)
    error: str | None = None
    planned: dict | None = None


class Timeline:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.faults: list[FaultRecord] = []
        self.events: list[dict] = []      # node exits and restarts, phases

    def begin(self, kind: str, target: str, **kw) -> FaultRecord:
        with self._lock:
            rec = FaultRecord(len(self.faults), kind, target, time.monotonic_ns(), time.time_ns(), **kw)
            self.faults.append(rec)
            return rec

    @staticmethod
    def end(rec: FaultRecord) -> None:
        rec.end_ns, rec.end_wall_ns = time.monotonic_ns(), time.time_ns()

    def event(self, kind: str, **detail) -> None:
        with self._lock:
            self.events.append(dict(kind=kind, t_ns=time.monotonic_ns(), wall_ns=time.time_ns(), **detail))


# ---- node processes -----------------------------------------------------------------------------

class NodeProcess:
    """One node id: its disk (WAL directory), its logs, and its current process. Restarts are
    new incarnations on the same WAL."""

    def __init__(self, run: "ClusterRun", node_id: int) -> None:
        self.run, self.node_id = run, node_id
        self.disk = run.workdir / "disks" / f"n{node_id}"
        self.log_dir = run.workdir / "logs" / f"n{node_id}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ack_log = self.log_dir / "acks.log"
        self.event_log = self.log_dir / "node.jsonl"
        self.incarnation = 0
        self.proc: subprocess.Popen | None = None
        self.holds: set[str] = set()     # why the supervisor must not restart it now
        self.lost = False
        self.restart_at: float | None = None
        self.fault_lock = threading.Lock()   # one fault at a time per node, held while it lasts
        self.lock = threading.Lock()         # its process and restart state: held only for moments
        self.exits: list[dict] = []

    @property
    def wal(self) -> str:
        """The node's WAL: a file on its disk, or (RunConfig.wal == "objects") a URL on the object
        store (an S3 backend's bucket, else a directory beside the run's objects)."""
        if self.run.config.wal == "objects":
            store = self.run.backend.store_url
            if store.startswith("s3://"):
                return store.replace("/data?", "/wal?", 1)
            return f"objects+file://{self.run.workdir}/wal-objects"
        return str(self.disk / "wal")

    def wal_exists(self) -> bool:
        return self.run.config.wal == "objects" or os.path.exists(self.wal)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self) -> None:
        with self.lock:
            self._spawn()

    def _spawn(self) -> None:
        c = self.run.config
        self.disk.mkdir(parents=True, exist_ok=True)
        self.incarnation += 1
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                   PGAPPNAME=node_application_name(self.node_id))
        for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                           ("AWS_DEFAULT_REGION", "us-east-1")):
            env.setdefault(key, value)
        cmd = [sys.executable, str(NODE_SCRIPT), "--node-id", str(self.node_id), "--incarnation", str(self.incarnation),
               "--wal", str(self.wal), "--ack-log", str(self.ack_log), "--log", str(self.event_log),
               "--meta", self.run.backend.meta_url, "--store", self.run.backend.store_url,
               "--heartbeat-interval", str(c.heartbeat_interval), "--heartbeat-timeout", str(c.heartbeat_timeout),
               "--migration-timeout", str(c.migration_timeout), "--agent-interval", str(c.agent_interval),
               "--rate", str(c.rate), "--upload-interval", str(c.upload_interval)]
        stderr = open(self.log_dir / "stderr.log", "ab")
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                                         start_new_session=True, env=env, cwd=str(self.log_dir))
        finally:
            stderr.close()
        self.restart_at = None
        self.run.timeline.event("spawn", node=self.node_id, incarnation=self.incarnation, pid=self.proc.pid)

    def signal(self, sig: int) -> bool:
        if not self.alive():
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)
            return True
        return False

    def kill(self) -> None:
        """kill -9 (of its whole process group) and reap it."""
        with self.lock:
            kill_group(self.proc)

    def read_events(self) -> list[dict]:
        out = []
        with contextlib.suppress(OSError):
            with open(self.event_log) as f:
                for line in f:
                    with contextlib.suppress(json.JSONDecodeError):
                        out.append(json.loads(line))
        return out


class AckTail:
    """Follows every node's ack log as it grows: acknowledgments (partition, offset, payload id,
    monotonic ns, wall ns, node id) and, per partition, the time of the latest one."""

    def __init__(self) -> None:
        self._files: dict[Path, tuple[int, bytes, int]] = {}    # path -> (position, partial line, node)
        self.acks: list[tuple[str, int, str, int, int, int]] = []
        self.last: dict[str, int] = {}
        self.last_node: dict[str, int] = {}
        self._lock = threading.Lock()

    def watch(self, path: Path, node_id: int) -> None:
        with self._lock:
            self._files.setdefault(path, (0, b"", node_id))

    def poll(self) -> None:
        with self._lock:
            for path, (pos, partial, node) in list(self._files.items()):
                try:
                    with open(path, "rb") as f:
                        f.seek(pos)
                        data = f.read()
                except FileNotFoundError:
                    continue
                if not data:
                    continue
                pos += len(data)
                data = partial + data
                lines = data.split(b"\n")
                partial = lines.pop()
                for line in lines:
                    parts = line.decode(errors="replace").split()
                    if len(parts) != 6 or parts[0] != "ack":
                        continue
                    rec = (parts[1], int(parts[2]), parts[3], int(parts[4]), int(parts[5]), node)
                    self.acks.append(rec)
                    if rec[3] > self.last.get(rec[0], 0):
                        self.last[rec[0]] = rec[3]
                        self.last_node[rec[0]] = node
                self._files[path] = (pos, partial, node)

    def since(self, partition: str, t_ns: int) -> bool:
        return self.last.get(partition, 0) > t_ns


# ---- the run ------------------------------------------------------------------------------------

class ClusterRun:
    """One cluster under faults, from start to read-back. Use as a context manager: every process
    it started is killed on exit, whatever happened; the backend is closed if `own_backend`."""

    def __init__(self, workdir: Path, backend: Backend, config: RunConfig | None = None, *,
                 own_backend: bool = False, seed: int | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.backend, self.own_backend = backend, own_backend
        self.config = config or RunConfig()
        self.seed = seed
        self.timeline = Timeline()
        self.tail = AckTail()
        self.nodes: dict[int, NodeProcess] = {}
        self.slots: list[int] = []               # node id per slot (a lost host's slot gets a new id)
        self.partitions = [f"p{i}" for i in range(self.config.partitions)]
        self.assignment_log: list[tuple[int, dict]] = []     # (monotonic ns, {partition: [node, version, owner]})
        self.live_log: list[tuple[int, list[int]]] = []
        self.migrations: list[dict] = []
        self.forgets: list[dict] = []
        self.errors: list[str] = []              # the harness's own trouble (not the cluster's)
        self._stop = threading.Event()           # the run is over: monitors stop
        self._end_faults = threading.Event()     # faults end now (their restore runs)
        self._fault_threads: list[threading.Thread] = []
        self._threads: list[threading.Thread] = []
        self._server_locks = {"pg": threading.Lock(), "s3": threading.Lock()}   # one outage of each at a time
        self._next_node_id = self.config.nodes + 1
        self.t0_ns = time.monotonic_ns()
        self.t0_wall_ns = time.time_ns()
        self.steady_ns: int | None = None
        self.faults_end_ns: int | None = None
        self.shutdown_ns: int | None = None
        self.shutdown_wall_ns: int | None = None
        self.meta = self.monitor_meta = self.store = self.cluster = None

    # ---- lifecycle ----

    def __enter__(self) -> "ClusterRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._end_faults.set()
        for node in self.nodes.values():
            node.holds.add("closed")
            node.kill()
        for t in self._fault_threads + self._threads:
            t.join(30)
        for resource in (self.monitor_meta, self.meta, self.store):
            if resource is not None:
                with contextlib.suppress(Exception):
                    resource.close()
        self.monitor_meta = self.meta = self.store = None
        if self.own_backend:
            self.backend.close()

    def now_s(self, t_ns: int | None = None) -> float:
        return ((time.monotonic_ns() if t_ns is None else t_ns) - self.t0_ns) / 1e9

    def _thread(self, target: Callable, name: str) -> threading.Thread:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def start(self) -> None:
        """Open the orchestrator's view, start the nodes, assign the partitions round-robin, and
        wait until every partition acknowledges appends (bounded by start_timeout)."""
        from s3stream.cluster import Cluster
        from s3stream.objectstore import open_object_store
        self.timeline.event("phase", name="start")
        self.meta = self.backend.admin_meta()
        self.monitor_meta = self.backend.admin_meta()
        self.store = open_object_store(self.backend.store_url)
        self.cluster = Cluster(self.meta, self.store, self.config.cluster_config(), engine_config())
        for i in range(self.config.nodes):
            node = NodeProcess(self, i + 1)
            self.nodes[node.node_id] = node
            self.slots.append(node.node_id)
            self.tail.watch(node.ack_log, node.node_id)
            node.spawn()
        self._thread(self._supervise, "harness-supervisor")
        self._thread(self._monitor_acks, "harness-acks")
        self._thread(self._monitor_meta, "harness-meta")
        deadline = time.monotonic() + self.config.start_timeout
        while set(self.slots) - set(self._live_nodes()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes {sorted(set(self.slots) - set(self._live_nodes()))} did not come up in "
                                   f"{self.config.start_timeout:g} s; see {self.workdir}/logs")
            time.sleep(0.1)
        for i, name in enumerate(self.partitions):
            self.cluster.assign(name, self.slots[i % len(self.slots)])
        t = time.monotonic_ns()
        while not all(self.tail.since(p, t) for p in self.partitions):
            if time.monotonic() > deadline:
                raise RuntimeError(f"partitions {[p for p in self.partitions if not self.tail.since(p, t)]} did not "
                                   f"acknowledge within {self.config.start_timeout:g} s; see {self.workdir}/logs")
            time.sleep(0.05)
        self.steady_ns = time.monotonic_ns()
        self.timeline.event("phase", name="steady")

    def _live_nodes(self) -> list[int]:
        try:
            return self.cluster.live_nodes()
        except Exception:   # noqa: BLE001 - the metadata may be down: nobody is known live
            return []

    # ---- background threads ----

    def _supervise(self) -> None:
        """Restart a node process that exited on its own (fenced, crashed, failed to start), as
        a supervisor such as systemd would: after restart_delay, doubling (up to 4 s) while its
        starts keep failing (the metadata store may be down for a while)."""
        while not self._stop.is_set():
            for node in list(self.nodes.values()):
                with node.lock:
                    if node.holds or node.lost or node.proc is None:
                        continue
                    code = node.proc.poll()
                    if code is None:
                        continue
                    if node.restart_at is None:
                        why = {FENCED_EXIT: "fenced", START_FAILED_EXIT: "start-failed"}.get(code, "crashed")
                        failed_starts = 0
                        for e in reversed(node.exits):
                            if e["why"] != "start-failed":
                                break
                            failed_starts += 1
                        if why == "start-failed":
                            failed_starts += 1
                        delay = min(self.config.restart_delay * 2 ** max(failed_starts - 1, 0), 4.0)
                        node.restart_at = time.monotonic() + delay
                        exit_ = dict(node=node.node_id, incarnation=node.incarnation, code=code, why=why,
                                     t=round(self.now_s(), 3))
                        node.exits.append(exit_)
                        self.timeline.event("exit", **exit_)
                    elif time.monotonic() >= node.restart_at:
                        node._spawn()
            self._stop.wait(0.1)

    def _monitor_acks(self) -> None:
        while not self._stop.is_set():
            self.tail.poll()
            self._stop.wait(0.2)
        self.tail.poll()

    def _monitor_meta(self) -> None:
        """Assignments, owners and live nodes every 0.25 s, recorded on change."""
        from s3stream.cluster import Cluster
        view = Cluster(self.monitor_meta, None, self.config.cluster_config())
        last = last_live = None
        while not self._stop.is_set():
            try:
                assigned = view.assignments()
                opened = {k.split("/", 1)[1]: json.loads(v) for k, v in self.monitor_meta.list_kv("opened/").items()}
                state = {}
                for name, a in assigned.items():
                    o = opened.get(name)
                    state[name] = [a["node"], a["version"], o["node"] if o and o["version"] == a["version"] else None]
                live = view.live_nodes()
            except Exception:   # noqa: BLE001 - the metadata is down: nothing to record
                self._stop.wait(0.25)
                continue
            t = time.monotonic_ns()
            if state != last:
                self.assignment_log.append((t, state))
                last = state
            if live != last_live:
                self.live_log.append((t, live))
                last_live = live
            self._stop.wait(0.25)

    # ---- faults ----

    def _node_for_slot(self, slot: int) -> NodeProcess:
        return self.nodes[self.slots[slot % len(self.slots)]]

    def sleep(self, seconds: float) -> None:
        """Sleep, unless the faults are being ended."""
        self._end_faults.wait(seconds)

    def inject(self, kind: str, *, slot: int = 0, seconds: float = 1.0, choice: int = 0, wait: bool = True,
               planned: dict | None = None, **kw) -> threading.Thread:
        """Start fault `kind` (FAULT_KINDS) on the node in `slot` (or partition `choice` for a
        migration) lasting `seconds` (a pause, an outage, a freeze; for kill, the delay before
        the restart). A pause takes `when`: "now", "burst" (right after a burst of appends, so
        that it lands mid-upload) or "transaction" (while the node is inside a metadata
        transaction, e.g. a commit). Runs in its own thread, joined if `wait`."""
        fn = {"pause": self._pause, "kill": self._kill, "pg-outage": self._pg_outage, "s3-freeze": self._s3_freeze,
              "migrate": self._migrate, "lose-host": self._lose_host}[kind]

        def body():
            try:
                fn(slot=slot, seconds=seconds, choice=choice, planned=planned, **kw)
            except Exception as e:   # noqa: BLE001 - a fault the harness could not make is recorded
                self.errors.append(f"{kind}: {type(e).__name__}: {e}")

        t = threading.Thread(target=body, name=f"fault-{kind}", daemon=True)
        t.start()
        self._fault_threads.append(t)
        if wait:
            t.join()
        return t

    def _skip(self, kind: str, target: str, why: str, planned: dict | None) -> None:
        rec = self.timeline.begin(kind, target, planned=planned, detail=dict(skipped=why))
        self.timeline.end(rec)

    #: How a planned pause picks its moment (PlannedFault.choice % 3).
    PAUSE_MOMENTS = ("now", "burst", "transaction")

    def _pause(self, slot: int, seconds: float, choice: int = 0, planned: dict | None = None,
               when: str | None = None, **_) -> None:
        """SIGSTOP the node in `slot`, SIGCONT after `seconds`."""
        when = when or (self.PAUSE_MOMENTS[choice % 3] if planned else "now")
        node = self._node_for_slot(slot)
        if not node.fault_lock.acquire(blocking=False):
            return self._skip("pause", f"node {node.node_id}", "another fault holds the node", planned)
        try:
            if not node.alive():
                return self._skip("pause", f"node {node.node_id}", "not running", planned)
            node.holds.add("paused")
            detail = dict(seconds=seconds, incarnation=node.incarnation, when=when)
            if when == "burst":
                node.signal(signal.SIGUSR2)
                time.sleep(random.Random(choice).uniform(0.02, 0.08))   # the burst starts within ~20 ms
            if when == "transaction":
                detail["in_transaction"] = self._stop_in_transaction(node)
            else:
                node.signal(signal.SIGSTOP)
                wait_stopped(node.proc.pid)
            rec = self.timeline.begin("pause", f"node {node.node_id}", nodes=[node.node_id], planned=planned,
                                      detail=detail)
            self._end_faults.wait(seconds)
            node.signal(signal.SIGCONT)
            self.timeline.end(rec)
        finally:
            node.holds.discard("paused")
            node.fault_lock.release()

    def _stop_in_transaction(self, node: NodeProcess, attempts: int = 200) -> bool:
        """SIGSTOP the node as soon as it is seen inside a metadata transaction (PostgreSQL: one of
        its sessions has a transaction open; SQLite: someone holds the write lock), checked again
        once it is stopped: whether it was caught mid-transaction (racy: a try, recorded)."""
        for _ in range(attempts):
            if self.backend.in_transaction(node.node_id):
                break
            time.sleep(0.005)
        node.signal(signal.SIGSTOP)
        wait_stopped(node.proc.pid)
        return self.backend.in_transaction(node.node_id)

    def _kill(self, slot: int, seconds: float, planned: dict | None = None, **_) -> None:
        """kill -9 the node in `slot`; start it again on its WAL after `seconds`. The fault lasts
        until the new incarnation has started (its client and agent are up), however many starts
        that takes (the metadata store may be down), bounded by restart_wait."""
        node = self._node_for_slot(slot)
        if not node.fault_lock.acquire(blocking=False):
            return self._skip("kill", f"node {node.node_id}", "another fault holds the node", planned)
        try:
            node.holds.add("killed")
            rec = self.timeline.begin("kill", f"node {node.node_id}", nodes=[node.node_id], planned=planned,
                                      detail=dict(restart_after=seconds, incarnation=node.incarnation,
                                                  was_running=node.alive()))
            node.kill()
            self._end_faults.wait(seconds)
            first = node.incarnation + 1
            node.spawn()
            node.holds.discard("killed")          # from here the supervisor restarts it if it must
            rec.detail["restarted_at"] = self._wait_started(node, first)
            self.timeline.end(rec)
        finally:
            node.holds.discard("killed")
            node.fault_lock.release()

    def _wait_started(self, node: NodeProcess, incarnation: int) -> float | None:
        """Until an incarnation >= `incarnation` of `node` has started (seconds since t0), at most
        restart_wait; None if none did."""
        deadline = time.monotonic() + self.config.restart_wait
        while time.monotonic() < deadline and not self._end_faults.is_set():
            started = [e for e in node.read_events() if e["kind"] == "started" and e["inc"] >= incarnation]
            if started:
                return round(self.now_s(started[0]["t"]), 3)
            time.sleep(0.1)
        return None

    def _pg_outage(self, seconds: float, planned: dict | None = None, **_) -> None:
        if "pg-outage" not in self.backend.faults:
            return self._skip("pg-outage", "pg", f"backend {self.backend.name} has no server to stop", planned)
        if not self._server_locks["pg"].acquire(blocking=False):
            return self._skip("pg-outage", "pg", "the server is already stopped", planned)
        rec = self.timeline.begin("pg-outage", "pg", is_global=True, planned=planned, detail=dict(seconds=seconds))
        try:
            self.backend.stop_metadata()
            self._end_faults.wait(seconds)
        finally:
            for attempt in range(5):
                try:
                    self.backend.start_metadata()
                    break
                except Exception as e:   # noqa: BLE001 - the port may still be in use for a moment
                    rec.error = f"restart attempt {attempt}: {e}"
                    time.sleep(1)
            self.timeline.end(rec)
            self._server_locks["pg"].release()

    def _s3_freeze(self, seconds: float, planned: dict | None = None, **_) -> None:
        if "s3-freeze" not in self.backend.faults:
            return self._skip("s3-freeze", "s3", f"backend {self.backend.name} has no server to freeze", planned)
        if not self._server_locks["s3"].acquire(blocking=False):
            return self._skip("s3-freeze", "s3", "the server is already frozen", planned)
        rec = self.timeline.begin("s3-freeze", "s3", is_global=True, planned=planned, detail=dict(seconds=seconds))
        try:
            self.backend.freeze_store()
            self._end_faults.wait(seconds)
        finally:
            self.backend.thaw_store()
            self.timeline.end(rec)
            self._server_locks["s3"].release()

    def _migrate(self, slot: int, choice: int, planned: dict | None = None, **_) -> None:
        """Cluster.migrate of partition `choice` to the node in `slot`, or the next live slot
        that is not its current owner."""
        name = self.partitions[choice % len(self.partitions)]
        try:
            owner = self.cluster.assignment(name)["node"]
            live = self.cluster.live_nodes()
        except Exception as e:   # noqa: BLE001 - the metadata is down: recorded as the migration's error
            rec = self.timeline.begin("migrate", name, partitions=[name], planned=planned)
            rec.error = f"{type(e).__name__}: {e}"
            self.timeline.end(rec)
            return
        order = [self.slots[(slot + i) % len(self.slots)] for i in range(len(self.slots))]
        targets = [n for n in order if n in live and n != owner]
        if not targets:
            return self._skip("migrate", name, f"no live node but its owner {owner} (live: {live})", planned)
        target = targets[0]
        rec = self.timeline.begin("migrate", name, nodes=[owner, target], partitions=[name], planned=planned,
                                  detail=dict(source=owner, target=target))
        try:
            report = self.cluster.migrate(name, target)
            rec.detail.update(seconds=report.seconds, failed_over=report.failed_over, tail_bytes=report.tail_bytes)
            self.migrations.append(dict(partition=name, source=owner, target=target, at_wall_ns=rec.start_wall_ns,
                                        failed_over=report.failed_over, seconds=report.seconds))
        except Exception as e:   # noqa: BLE001 - recorded: a migration may fail under faults
            rec.error = f"{type(e).__name__}: {e}"
            self.migrations.append(dict(partition=name, source=owner, target=target, at_wall_ns=rec.start_wall_ns,
                                        error=rec.error))
        finally:
            self.timeline.end(rec)

    def _lose_host(self, slot: int, planned: dict | None = None, **_) -> None:
        """kill -9 the node in `slot`, delete its disk, forget it (Cluster.forget(wal_lost=True)),
        start a replacement under a new node id in the same slot. With RunConfig.wal ==
        "objects" the WAL is not on the disk: nothing is forgotten, peers fail the node over from
        the store, and the same node starts again on a new host after `host_down` seconds. A forget that keeps failing
        (the store down, no live node to take the partitions) does not hold the replacement up
        past forget_first: it starts, and the forget is retried up to forget_timeout. The fault
        lasts until the forget is done and the replacement has started."""
        slot = slot % len(self.slots)
        node = self._node_for_slot(slot)
        if not node.fault_lock.acquire(blocking=False):
            return self._skip("lose-host", f"node {node.node_id}", "another fault holds the node", planned)
        rec = self.timeline.begin("lose-host", f"node {node.node_id}", nodes=[node.node_id], planned=planned,
                                  detail=dict(incarnation=node.incarnation))
        try:
            if self.config.wal == "objects":
                node.holds.add("lost")
                node.kill()
                shutil.rmtree(node.disk, ignore_errors=True)
                self._end_faults.wait(self.config.host_down)
                with node.lock:
                    node.holds.discard("lost")
                    node._spawn()
                rec.detail["replacement_started_at"] = self._wait_started(node, node.incarnation)
                return
            node.holds.add("lost")
            node.lost = True
            node.kill()
            shutil.rmtree(node.disk, ignore_errors=True)
            entry: dict = dict(node=node.node_id, ok=False, attempts=[])
            self.forgets.append(entry)
            rec.detail["forget"] = entry
            started = time.monotonic()
            self._forget(entry, started + self.config.forget_first)
            replacement = NodeProcess(self, self._next_node_id)
            self._next_node_id += 1
            self.nodes[replacement.node_id] = replacement
            self.slots[slot] = replacement.node_id
            self.tail.watch(replacement.ack_log, replacement.node_id)
            replacement.spawn()
            rec.detail["replacement"] = replacement.node_id
            rec.nodes.append(replacement.node_id)
            if not entry["ok"]:
                self._forget(entry, started + self.config.forget_timeout)
            rec.detail["replacement_started_at"] = self._wait_started(replacement, 1)
        finally:
            self.timeline.end(rec)
            node.fault_lock.release()

    def _forget(self, entry: dict, deadline: float) -> None:
        """Cluster.forget(node, wal_lost=True), retried while it fails until `deadline`
        (monotonic). First, once: each partition's log committed end (what the lost WAL alone
        held lies above it). `entry` collects the attempts, the report and `ok`."""
        node_id = entry["node"]
        while "committed_ends" not in entry:
            try:
                entry["committed_ends"] = self._committed_ends()
            except Exception as e:   # noqa: BLE001 - the metadata may be down
                if time.monotonic() > deadline:
                    entry["error"] = f"committed ends: {type(e).__name__}: {e}"
                    return
                time.sleep(0.5)
        forget = getattr(self.cluster, "forget", None)
        if forget is None:
            entry["error"] = "Cluster.forget does not exist (issue 26: forget a lost node)"
            return
        while not entry["ok"]:
            try:
                entry["report"] = _jsonable(forget(node_id, wal_lost=True))
                entry["ok"] = True
                entry["at_wall_ns"] = time.time_ns()
                entry.pop("error", None)
            except Exception as e:   # noqa: BLE001 - retried, then recorded
                entry["error"] = f"{type(e).__name__}: {e}"
                if len(entry["attempts"]) < 50:
                    entry["attempts"].append(dict(t=round(self.now_s(), 3), error=entry["error"][:300]))
                if time.monotonic() > deadline:
                    return
                time.sleep(0.5)

    def log_stream_ids(self) -> dict[str, int]:
        """Each partition's log stream id, as its producers logged it (a partition keeps its
        data streams for life)."""
        ids = {}
        for node in self.nodes.values():
            for e in node.read_events():
                if e["kind"] == "producing" and e.get("log_stream") is not None:
                    ids[e["partition"]] = e["log_stream"]
        return ids

    def _committed_ends(self) -> dict[str, int]:
        return {name: self.meta.get_stream(sid).end_offset for name, sid in self.log_stream_ids().items()}

    def run_schedule(self, schedule: list["PlannedFault"], seconds: float,
                     progress: Callable[[float], None] | None = None) -> None:
        """Inject each planned fault at its time (seconds after steady state) until `seconds`."""
        t0 = time.monotonic()
        pending = sorted(schedule, key=lambda f: f.at)
        while not self._end_faults.is_set():
            elapsed = time.monotonic() - t0
            if progress:
                progress(min(elapsed, seconds))
            if elapsed >= seconds:
                break
            while pending and pending[0].at <= elapsed:
                f = pending.pop(0)
                self.inject(f.kind, slot=f.slot, seconds=f.seconds, choice=f.choice, wait=False, planned=asdict(f))
            time.sleep(0.05)

    def end_faults(self) -> None:
        """End every fault now (resume, restart, restore) and wait for their threads."""
        self._end_faults.set()
        for t in self._fault_threads:
            t.join(120)
        self.faults_end_ns = time.monotonic_ns()
        self.timeline.event("phase", name="faults-ended")

    # ---- the end of a run ----

    def settle(self) -> dict:
        """Until every slot's node is live and every partition is open on a live node and
        acknowledges again (bounded by settle_timeout); then whether every node is live: every
        slot's node, and no other registered node left neither live nor failed over/forgotten."""
        t_end = self.faults_end_ns or time.monotonic_ns()
        deadline = time.monotonic() + self.config.settle_timeout
        waiting: list[str] = list(self.partitions)
        down: list[int] = list(self.slots)
        while time.monotonic() < deadline:
            live = set(self._live_nodes())
            down = [n for n in self.slots if n not in live]
            waiting = []
            for name in self.partitions:
                try:
                    owner = self.cluster.owner(name)
                except Exception:   # noqa: BLE001 - the metadata may still be recovering
                    owner = None
                if owner not in live or not self.tail.since(name, t_end):
                    waiting.append(name)
            if not waiting and not down:
                break
            time.sleep(0.1)
        settled = dict(seconds=round((time.monotonic_ns() - t_end) / 1e9, 3), unsettled=waiting, down=down)
        try:
            live = self.cluster.live_nodes()
            registered = self.meta.list_nodes()
            settled["live_nodes"] = live
            settled["dead_nodes"] = sorted(n.node_id for n in registered if n.node_id not in live and not n.failover)
        except Exception as e:   # noqa: BLE001
            settled["live_nodes"], settled["dead_nodes"] = [], []
            settled["error"] = f"{type(e).__name__}: {e}"
        settled["slots"] = list(self.slots)
        settled["all_live"] = set(self.slots) <= set(settled["live_nodes"]) and not settled["dead_nodes"]
        self.timeline.event("phase", name="settled", **settled)
        return settled

    def shutdown(self) -> dict:
        """Stop producing everywhere (SIGUSR1), then close every node cleanly (SIGTERM: agent
        stopped, client.close()). Agents stop within moments of each other, so nobody fails a
        closing peer over. A node that does not exit in time is killed; the caller recovers it."""
        self.shutdown_ns, self.shutdown_wall_ns = time.monotonic_ns(), time.time_ns()
        self.timeline.event("phase", name="shutdown")
        running = [n for n in self.nodes.values() if n.alive()]
        for node in self.nodes.values():
            node.holds.add("shutdown")
        for node in running:
            node.signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        for node in running:
            while time.monotonic() < deadline and node.alive() and not any(
                    e["kind"] == "quiesced" and e["inc"] == node.incarnation for e in node.read_events()):
                time.sleep(0.05)
        for node in running:
            node.signal(signal.SIGTERM)
        out = {}
        for node in self.nodes.values():
            if node.proc is None:
                continue
            try:
                code = node.proc.wait(60)
            except subprocess.TimeoutExpired:
                node.kill()
                code = "killed after 60 s"
            closed = [e for e in node.read_events() if e["kind"] == "closed" and e["inc"] == node.incarnation]
            out[node.node_id] = dict(code=code, clean=bool(closed and closed[-1]["clean"]) and code == 0,
                                     lost=node.lost, report=closed[-1]["report"] if closed else None)
        self._stop.set()
        return out

    def recover_unclean(self, closes: dict) -> list[dict]:
        """Fail over (from the orchestrator) each node that did not close cleanly and whose WAL
        still exists, so that the read-back sees everything its WAL holds."""
        done = []
        for node_id, c in closes.items():
            node = self.nodes[node_id]
            if c["clean"] or node.lost or not node.wal_exists():
                continue
            entry = dict(node=node_id)
            try:
                rep = self.cluster.fail_over(node_id, reassign=False)
                entry.update(replayed=rep.replayed, records=rep.records)
            except Exception as e:   # noqa: BLE001
                entry["error"] = f"{type(e).__name__}: {e}"
            done.append(entry)
        return done

    def read_back(self) -> tuple[dict[str, dict[int, bytes]], list[str], dict[str, int], dict[str, list]]:
        """Every committed record of every partition through a fresh client (its own node id and
        WAL): ({partition: {offset: payload}}, read errors, {partition: log stream id},
        {partition: [[start, end), ...] given up by a forget}: offsets that read as lost)."""
        from s3stream import StreamClient
        records: dict[str, dict[int, bytes]] = {}
        errors: list[str] = []
        log_ids: dict[str, int] = {}
        lost_ranges: dict[str, list] = {}
        reader_dir = self.workdir / "reader"
        reader_dir.mkdir(exist_ok=True)
        client = StreamClient(READER_NODE_ID, reader_dir / "wal", self.backend.store_url, self.backend.meta_url,
                              engine_config(block_cache_size=READ_BACK_CACHE))
        try:
            parts = {}
            for name in self.partitions:
                try:
                    parts[name] = read_partition(client, name)
                except Exception as e:   # noqa: BLE001 - reported: what could not be read is lost
                    records[name] = {}
                    errors.append(f"{name}: {type(e).__name__}: {e}")
            _read_objects_together(client, self.meta, parts.values())
            for name, part in parts.items():
                got: dict[int, bytes] = {}
                records[name] = got
                try:
                    log_ids[name] = part.log_stream_id
                    pos, end = part.start_offset, part.end_offset
                    while pos < end:
                        try:
                            res = part.fetch(pos, end, max_bytes=4 << 20)
                        except Exception as e:   # noqa: BLE001 - by name: OffsetsLostError is new
                            if type(e).__name__ != "OffsetsLostError" or not getattr(e, "end", 0) > pos:
                                raise
                            lost_ranges.setdefault(name, []).append([e.start, e.end])
                            pos = e.end          # a forgotten node's offsets: nothing to read there
                            continue
                        if not res.batches:
                            errors.append(f"{name}: fetch at {pos} returned nothing (end {end})")
                            break
                        for b in res.batches:
                            payload = bytes(b.payload)
                            for i in range(b.count):
                                got[b.base_offset + i] = payload
                        pos = res.end_offset
                except Exception as e:   # noqa: BLE001 - reported: what could not be read is lost
                    errors.append(f"{name}: {type(e).__name__}: {e}")
        finally:
            client.close(retire=True)
        return records, errors, log_ids, lost_ranges

    def failovers(self) -> tuple[list[dict], str]:
        """The cluster's failover records, wall ns: Cluster.failover_history() where it exists,
        else the failover claims in KV (`failover/<node>/<epoch>/<n>`), plus migrations that fell
        back to a failover (which claim nothing)."""
        history = getattr(self.cluster, "failover_history", None)
        out: list[dict] = []
        source = "failover_history"
        if history is not None:
            try:
                out = [dict(h) if not isinstance(h, dict) else h for h in (_jsonable(x) for x in history())]
            except Exception as e:   # noqa: BLE001
                self.errors.append(f"failover_history: {type(e).__name__}: {e}")
                history = None
        if history is None:
            source = "kv-claims"
            first: dict[tuple[int, int], dict] = {}
            for key, raw in self.meta.list_kv("failover/").items():
                parts = key.split("/")
                if len(parts) != 4:
                    continue
                node, epoch, attempt = int(parts[1]), int(parts[2]), int(parts[3])
                value = json.loads(raw)
                k = (node, epoch)
                if k not in first or attempt < first[k]["attempt"]:
                    first[k] = dict(judge=value.get("node"), node=node, node_epoch=epoch, reason="heartbeat expired",
                                    at_ns=value.get("at_ns"), kind="failover", attempt=attempt)
            out = sorted(first.values(), key=lambda f: f["at_ns"] or 0)
            for m in self.migrations:
                if m.get("failed_over"):
                    out.append(dict(judge=None, node=m["source"], node_epoch=None, kind="migration-fallback",
                                    reason=f"migration of {m['partition']} timed out", at_ns=m["at_wall_ns"]))
        return out, source

    def finish(self) -> dict:
        """End the faults, settle, close the nodes, recover what did not close, read back and
        check: the run's result (see `check`), with everything the report needs."""
        self.end_faults()
        settled = self.settle()
        closes = self.shutdown()
        recovered = self.recover_unclean(closes)
        self.tail.poll()
        records, read_errors, log_ids, lost_ranges = self.read_back()
        given_up = self.given_up_ranges(log_ids, lost_ranges)
        node_down = self.down_windows()
        failovers, failover_source = self.failovers()
        node_errors: dict[int, Counter] = {}
        node_events: dict[int, list[dict]] = {}
        for node in self.nodes.values():
            events = node.read_events()
            node_events[node.node_id] = events
            node_errors[node.node_id] = Counter(e["type"] for e in events if e["kind"] == "error")
        result = check(self.tail.acks, records, self.timeline.faults, failovers, self.config,
                       window=(self.steady_ns or self.t0_ns, self.shutdown_ns), t0_ns=self.t0_ns,
                       t0_wall_ns=self.t0_wall_ns, given_up=given_up, assignment_log=self.assignment_log,
                       shutdown_wall_ns=self.shutdown_wall_ns, node_down=node_down)
        result.update(
            backend=self.backend.describe(), seed=self.seed, config=asdict(self.config),
            settle=settled, closes={str(k): v for k, v in closes.items()}, recovered_after_close=recovered,
            read_errors=read_errors, log_stream_ids=log_ids, failover_source=failover_source,
            lost_ranges_read=lost_ranges, given_up_ranges={str(k): v for k, v in given_up.items()},
            node_down={str(n): [[round((a - self.t0_wall_ns) / 1e9, 3), round((b - self.t0_wall_ns) / 1e9, 3)
                                 if b < FOREVER else None] for a, b in w] for n, w in node_down.items()},
            faults=[self.fault_json(f) for f in self.timeline.faults],
            events=[dict(e, t=round(self.now_s(e["t_ns"]), 3)) for e in self.timeline.events],
            node_errors={str(k): dict(v) for k, v in node_errors.items()},
            node_exits={str(n.node_id): n.exits for n in self.nodes.values()},
            migrations=self.migrations, forgets=self.forgets, harness_errors=self.errors,
            assignment_timeline=[[round(self.now_s(t), 3), s] for t, s in self.assignment_log],
            live_timeline=[[round(self.now_s(t), 3), s] for t, s in self.live_log],
            steady_at=round(self.now_s(self.steady_ns), 3) if self.steady_ns else None,
            faults_ended_at=round(self.now_s(self.faults_end_ns), 3) if self.faults_end_ns else None,
            shutdown_at=round(self.now_s(self.shutdown_ns), 3) if self.shutdown_ns else None,
            workdir=str(self.workdir))
        if read_errors:
            result["counts"]["read_errors"] = len(read_errors)
        result["targets"] = targets(result)
        return result

    def given_up_ranges(self, log_ids: dict[str, int], lost_ranges: dict[str, list]
                        ) -> dict[int, dict[str, list[list[int]]]]:
        """Per lost host, per partition: the offset ranges [start, end) given up with its WAL.
        The ranges the read-back found lost (OffsetsLostError: only a forget makes them), and
        those its forget's report names; without either (no forget API), the offsets at or
        above the committed end read just before the forget, if the forget succeeded."""
        by_stream = {sid: name for name, sid in log_ids.items()}
        out: dict[int, dict[str, list[list[int]]]] = {}
        lost_nodes = [f.nodes[0] for f in self.timeline.faults if f.kind == "lose-host" and f.nodes]
        for node in lost_nodes:
            ranges: dict[str, list[list[int]]] = {name: [list(r) for r in rs] for name, rs in lost_ranges.items()}
            fg = next((f for f in self.forgets if f["node"] == node), {})
            report = fg.get("report") if isinstance(fg.get("report"), dict) else {}
            for s in report.get("streams", []):
                name = by_stream.get(s.get("stream_id"))
                if name is not None and "committed_end" in s and "given_up_end" in s:
                    ranges.setdefault(name, []).append([s["committed_end"], s["given_up_end"]])
            if not ranges and fg.get("ok"):
                ranges = {name: [[end, FOREVER]] for name, end in (fg.get("committed_ends") or {}).items()}
            out[node] = ranges
        return out

    def down_windows(self) -> dict[int, list[tuple[int, int]]]:
        """Per node id, the wall-clock windows when no process of it was serving: before its
        first incarnation started, and from each incarnation's end (killed, lost, crashed; not a
        fenced exit, which a failover caused) to the next one's start. A failover then is no
        false one, whatever fault caused it."""
        ends: dict[tuple[int, int], int] = {}
        for f in self.timeline.faults:
            if f.kind in ("kill", "lose-host") and f.nodes and "incarnation" in f.detail:
                key = (f.nodes[0], f.detail["incarnation"])
                ends[key] = min(ends.get(key, FOREVER), f.start_wall_ns)
        for e in self.timeline.events:
            # A fenced node's exit follows its failover: no window of its own, or every failover
            # would justify itself.
            if e["kind"] == "exit" and e["why"] != "fenced":
                key = (e["node"], e["incarnation"])
                ends[key] = min(ends.get(key, FOREVER), e["wall_ns"])
        out: dict[int, list[tuple[int, int]]] = {}
        for node in self.nodes.values():
            starts = {e["inc"]: e["wall"] for e in node.read_events() if e["kind"] == "started"}
            down, pos = [], self.t0_wall_ns
            for a, b in sorted((starts[i], ends.get((node.node_id, i), FOREVER)) for i in starts):
                if a > pos:
                    down.append((pos, a))
                pos = max(pos, b)
            if pos < FOREVER:
                down.append((pos, FOREVER))
            out[node.node_id] = down
        return out

    def fault_json(self, f: FaultRecord) -> dict:
        return dict(id=f.id, kind=f.kind, target=f.target, start=round(self.now_s(f.start_ns), 3),
                    end=round(self.now_s(f.end_ns), 3) if f.end_ns else None, nodes=f.nodes, partitions=f.partitions,
                    is_global=f.is_global, detail=_jsonable(f.detail), error=f.error, planned=f.planned)


def _jsonable(x):
    """A report object (dataclass, dict, list, scalar) as JSON-able data."""
    import dataclasses
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if hasattr(x, "__dict__"):
        return _jsonable(vars(x))
    return str(x)


# ---- the schedule ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlannedFault:
    at: float            # seconds after steady state
    kind: str
    slot: int            # the node's slot (a lost host's replacement takes its slot)
    seconds: float       # pause / outage / freeze length; kill: delay before the restart
    choice: int          # a migration's partition index (and more, as the kind needs)


#: Relative weights of the fault kinds in a campaign.
WEIGHTS = {"pause": 4, "kill": 3, "pg-outage": 1, "s3-freeze": 1, "migrate": 3, "lose-host": 1}


def planned_span(f: PlannedFault, config: RunConfig) -> float:
    """How long a planned fault is expected to hold its target."""
    if f.kind == "migrate":
        return config.migration_timeout
    if f.kind == "lose-host":
        return 5.0
    return f.seconds


def plan_schedule(seed: int, seconds: float, kinds: Iterable[str], config: RunConfig,
                  max_concurrent: int = 2, max_lost_hosts: int = 1) -> list[PlannedFault]:
    """The fault schedule of a seed: a fault every 2-5 s, at most `max_concurrent` planned to
    overlap, never two on one node at once. Only random.Random(seed) decides: the same seed (and
    arguments) gives the same schedule, whatever happens at run time."""
    rng = random.Random(seed)
    kinds = [k for k in FAULT_KINDS if k in set(kinds)]
    weights = [WEIGHTS[k] for k in kinds]
    out: list[PlannedFault] = []
    lost = 0
    t = rng.uniform(2.0, 5.0)
    while t < seconds:
        kind = rng.choices(kinds, weights)[0]
        slot = rng.randrange(config.nodes)
        choice = rng.randrange(1 << 30)
        if kind == "pause":
            length = rng.uniform(0.5, 1.2) if rng.random() < 0.5 else rng.uniform(2.0, 8.0)
        elif kind == "kill":
            length = rng.uniform(0.5, 5.0)
        elif kind == "pg-outage":
            length = rng.uniform(3.0, 12.0)
        elif kind == "s3-freeze":
            length = rng.uniform(5.0, 15.0)
        else:
            length = 0.0
        f = PlannedFault(round(t, 3), kind, slot, round(length, 3), choice)
        active = [g for g in out if g.at <= t < g.at + planned_span(g, config)]
        node_kinds = ("pause", "kill", "lose-host")
        busy = {g.slot for g in active if g.kind in node_kinds}
        ok = len(active) < max_concurrent and not (kind in node_kinds and slot in busy)
        # One server, one outage at a time (with a margin for its stop and start).
        ok = ok and not any(g.kind == kind and g.at <= t < g.at + g.seconds + 2.0
                            for g in out if kind in ("pg-outage", "s3-freeze"))
        if kind == "lose-host":
            ok = ok and lost < max_lost_hosts and not any(g.kind in node_kinds for g in active)
        if ok:
            out.append(f)
            lost += kind == "lose-host"
        t += rng.uniform(2.0, 5.0)
    return out


# ---- the checker ----------------------------------------------------------------------------------

def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def longest_uncovered(a: int, b: int, covered: list[tuple[int, int]]) -> int:
    """The longest part of [a, b] outside the (merged, sorted) intervals `covered`."""
    best, pos = 0, a
    for c0, c1 in covered:
        if c1 <= pos:
            continue
        if c0 >= b:
            break
        best = max(best, min(c0, b) - pos)
        pos = max(pos, c1)
        if pos >= b:
            break
    return max(best, b - pos)


#: A partition has resumed once it acknowledges for RESUMED_FOR seconds with no gap over RESUME_GAP.
RESUMED_FOR = 1.0
RESUME_GAP = 0.5


def resumed_at(times: list[int], after_ns: int, end_ns: int | None = None) -> int | None:
    """The first time >= `after_ns` from which `times` (sorted ns) run steadily for RESUMED_FOR
    seconds, or until `end_ns` (the end of the observed window), whichever is sooner (`after_ns`
    itself if they ran through it); None if they never do."""
    gap, span = int(RESUME_GAP * 1e9), int(RESUMED_FOR * 1e9)
    i = bisect_left(times, after_ns)
    if i > 0 and i < len(times) and times[i] - times[i - 1] <= gap:
        start = after_ns                     # acknowledging through the fault's end
    elif i < len(times):
        start = times[i]
    else:
        return None
    for j in range(i + 1, len(times)):
        if times[j] - times[j - 1] > gap:
            start = times[j]
        elif times[j] - start >= span:
            return start
    if end_ns is not None and end_ns - times[-1] <= gap:
        return start                         # steady until the window closed
    return None


def check(acks: list[tuple[str, int, str, int, int, int]], records: dict[str, dict[int, bytes]],
          faults: list[FaultRecord], failovers: list[dict], config: RunConfig, *, window: tuple[int, int | None],
          t0_ns: int, t0_wall_ns: int, given_up: dict[int, dict[str, list[int]]] | None = None,
          assignment_log: list[tuple[int, dict]] = (), shutdown_wall_ns: int | None = None,
          node_down: dict[int, list[tuple[int, int]]] | None = None) -> dict:
    """Compare every acknowledgment with the read-back, and the failovers with the faults.

    Counts: acknowledged; lost (an acknowledged payload neither at its offset nor anywhere
    else); overwritten (the acknowledged offset holds another record); misplaced (found, but at
    another offset); duplicated (one payload at two offsets); acked_twice (two acknowledgments of
    one partition offset with different payloads); corrupt (a record whose bytes do not check);
    given_up (acknowledged by a host lost with its WAL, in the offsets its forget gave up,
    `given_up` = {node: {partition: [[start, end), ...]}}: not lost by the engine, reported
    apart); false_failovers (a failover of a node no pause, kill or lost host stopped at that
    moment, nor was down per `node_down` (wall ns windows per node), until the harness's
    shutdown)."""
    grace_ns = int((config.heartbeat_timeout + 1.0) * 1e9)
    start_ns, end_ns = window
    end_ns = end_ns or max((a[3] for a in acks), default=start_ns)

    given_up = given_up or {}

    # Where each payload is stored.
    where: dict[str, list[tuple[str, int]]] = defaultdict(list)
    corrupt = 0
    stored_ids: dict[str, dict[int, str | None]] = {}
    for name, recs in records.items():
        ids = {}
        for off, raw in recs.items():
            pid = check_payload(raw)
            ids[off] = pid
            if pid is None:
                corrupt += 1
            else:
                where[pid].append((name, off))
        stored_ids[name] = ids
    duplicated = sum(1 for places in where.values() if len(places) > 1)

    acked_ids = set()
    lost = overwritten = misplaced = given_up_count = 0
    lost_examples: list[dict] = []
    lost_times: dict[str, list[float]] = defaultdict(list)
    by_offset: dict[tuple[str, int], set[str]] = defaultdict(set)
    for name, off, pid, t, wall, node in acks:
        acked_ids.add(pid)
        if any(a <= off < b for a, b in given_up.get(payload_node(pid)[0], {}).get(name, ())):
            given_up_count += 1
            continue
        by_offset[(name, off)].add(pid)
        at = stored_ids.get(name, {}).get(off, "<absent>")
        if at == pid:
            continue
        if at != "<absent>":
            overwritten += 1
        if where.get(pid):
            misplaced += 1
        else:
            lost += 1
        if len(lost_times[name]) < 2000:
            lost_times[name].append(round((t - t0_ns) / 1e9, 3))
        if len(lost_examples) < 20:
            lost_examples.append(dict(partition=name, offset=off, payload=pid, t=round((t - t0_ns) / 1e9, 3),
                                      stored=at))
    acked_twice = sum(1 for pids in by_offset.values() if len(pids) > 1)
    unacked_present = sum(1 for pid in where if pid not in acked_ids)

    # False failovers: a node failed over while no pause, kill or loss of it was under way.
    down: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for f in faults:
        if f.kind in NODE_DOWN_KINDS and not f.detail.get("skipped"):
            end = f.end_wall_ns if f.end_wall_ns is not None else FOREVER
            if f.kind == "lose-host":
                end = FOREVER                   # the lost id never comes back
            for n in f.nodes[:1]:
                down[n].append((f.start_wall_ns, end + grace_ns))
    for n, windows in (node_down or {}).items():
        down[n] += [(a, min(b, FOREVER) + grace_ns) for a, b in windows]
    false_failovers = []
    forced = []
    counted = []
    for fo in failovers:
        if fo.get("kind") == "forget":
            continue
        at = fo.get("at_ns") or 0
        if shutdown_wall_ns is not None and at >= shutdown_wall_ns:
            continue
        # A history entry is written when the failover is over: it was decided `seconds` before.
        decided = at - int(float(fo.get("seconds") or 0) * 1e9)
        entry = dict(fo, t=round((decided - t0_wall_ns) / 1e9, 3))
        counted.append(entry)
        if any(a <= decided <= b for a, b in down.get(fo.get("node"), [])):
            continue
        if fo.get("kind") == "migration-fallback":
            forced.append(entry)       # migrate's documented fallback: the source did not let go in time
        else:
            false_failovers.append(entry)

    # Partitions left on a failed-over node: still assigned to it heartbeat_timeout + 5 s after
    # its failover ended, while it was still down (nothing else would serve them).
    limit_ns = int(config.gap_limit * 1e9)
    stuck = []
    for fo in counted:
        if fo.get("kind") not in ("failover", "migration-fallback") or fo.get("ok") is False:
            continue
        check_at = (fo.get("at_ns") or 0) + limit_ns
        if shutdown_wall_ns is not None and check_at >= shutdown_wall_ns:
            continue
        if not any(a <= check_at <= b for a, b in (node_down or {}).get(fo.get("node"), [])):
            continue
        mono = t0_ns + (check_at - t0_wall_ns)
        state = None
        for t, s in assignment_log:
            if t > mono:
                break
            state = s
        for name, (node, version, owner) in sorted((state or {}).items()):
            if node == fo.get("node"):
                stuck.append(dict(partition=name, node=node, t=round((check_at - t0_wall_ns) / 1e9, 3)))

    # Time without acknowledgments per partition, and the part of it outside faults touching it.
    times: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for name, off, pid, t, wall, node in acks:
        if start_ns <= t <= end_ns:
            times[name].append((t, node))
    assigned_nodes: dict[str, list[tuple[int, set]]] = defaultdict(list)
    for t, state in assignment_log:
        for name, (node, version, owner) in state.items():
            assigned_nodes[name].append((t, {node, owner} - {None}))
    fault_spans = [(f, f.start_ns, f.end_ns or end_ns) for f in faults if not f.detail.get("skipped")]
    partitions_out = {}
    worst_unexcused = 0.0
    for name in records.keys() | times.keys():
        ts = sorted(times.get(name, []))
        points = [(start_ns, None)] + ts + [(end_ns, None)]
        longest = longest_free = 0
        longest_at = free_at = None
        for (a, na), (b, nb) in zip(points, points[1:]):
            gap = b - a
            if gap <= 0:
                continue
            if gap > longest:
                longest, longest_at = gap, a
            owners = {na, nb} - {None}
            for t, nodes in assigned_nodes.get(name, []):
                if a - int(1e9) <= t <= b:
                    owners |= nodes
            covered = _union([(s, e) for f, s, e in fault_spans
                              if f.is_global or name in f.partitions or owners & set(f.nodes)])
            free = longest_uncovered(a, b, covered)
            if free > longest_free:
                longest_free, free_at = free, a
        partitions_out[name] = dict(acks=len(ts), longest_gap=round(longest / 1e9, 3),
                                    longest_gap_at=round((longest_at - t0_ns) / 1e9, 3) if longest_at else None,
                                    longest_gap_outside_faults=round(longest_free / 1e9, 3),
                                    outside_faults_at=round((free_at - t0_ns) / 1e9, 3) if free_at else None)
        worst_unexcused = max(worst_unexcused, longest_free / 1e9)

    # Seconds to resume after each fault ends: until every partition it touched acknowledges
    # steadily again (RESUMED_FOR seconds with no pause over RESUME_GAP), 0 if it never stopped.
    resume = []
    for f, s, e in fault_spans:
        if f.end_ns is None:
            continue
        touched = set(f.partitions)
        if f.is_global:
            touched = set(records) | set(times)
        else:
            for name, ts in times.items():
                if any(n in f.nodes for t, n in ts if s - int(2e9) <= t <= s):
                    touched.add(name)
        worst: float | None = 0.0
        for name in sorted(touched):
            at = resumed_at([t for t, n in times.get(name, [])], f.end_ns, end_ns)
            if at is None:
                worst = None
                break
            worst = max(worst, (at - f.end_ns) / 1e9)
        resume.append(dict(fault=f.id, kind=f.kind, target=f.target,
                           seconds=None if worst is None else round(worst, 3)))

    counts = dict(acknowledged=len(acks), lost=lost, overwritten=overwritten, misplaced=misplaced,
                  duplicated=duplicated, acked_twice=acked_twice, corrupt=corrupt, given_up=given_up_count,
                  unacknowledged_present=unacked_present, records_read=sum(len(r) for r in records.values()),
                  failovers=len(counted), false_failovers=len(false_failovers),
                  forced_failovers=len(forced), stuck_after_failover=len(stuck),
                  longest_gap=max((p["longest_gap"] for p in partitions_out.values()), default=0.0),
                  longest_gap_outside_faults=round(worst_unexcused, 3),
                  resume_seconds=max((r["seconds"] for r in resume if r["seconds"] is not None), default=0.0),
                  never_resumed=sum(1 for r in resume if r["seconds"] is None))
    return dict(counts=counts, partitions=partitions_out, lost_examples=lost_examples, lost_times=dict(lost_times),
                failover_records=counted, false_failover_records=false_failovers,
                forced_failover_records=forced, stuck_after_failover_records=stuck, resume=resume,
                ack_timeline=ack_timeline(acks, t0_ns))


def ack_timeline(acks, t0_ns: int, bucket: float = 1.0) -> dict:
    """Per partition: acknowledgments per `bucket` seconds since t0, and the node that made most
    of each bucket's."""
    counts: dict[str, Counter] = defaultdict(Counter)
    owners: dict[str, dict[int, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for name, off, pid, t, wall, node in acks:
        b = int((t - t0_ns) / 1e9 / bucket)
        counts[name][b] += 1
        owners[name][b][node] += 1
    out = {}
    for name, c in sorted(counts.items()):
        last = max(c)
        out[name] = dict(bucket_seconds=bucket, counts=[c.get(i, 0) for i in range(last + 1)],
                         owner=[owners[name][i].most_common(1)[0][0] if owners[name][i] else None
                                for i in range(last + 1)])
    return out


def targets(result: dict) -> dict[str, bool]:
    """The campaign's targets (issue 32), each True when met."""
    c = result["counts"]
    limit = result["config"]["heartbeat_timeout"] + 5.0
    return dict(no_loss=c["lost"] == 0 and not result.get("read_errors"), no_overwrite=c["overwritten"] == 0,
                no_duplicate=c["duplicated"] == 0, no_offset_acked_twice=c["acked_twice"] == 0,
                no_corrupt=c["corrupt"] == 0, no_false_failover=c["false_failovers"] == 0,
                all_nodes_live=bool(result["settle"].get("all_live")),
                every_partition_serving=not result["settle"]["unsettled"],
                no_gap_outside_faults=c["longest_gap_outside_faults"] <= limit)


# ---- reports --------------------------------------------------------------------------------------

def row(scenario: str, result: dict) -> str:
    """One line of the scenario table."""
    c = result["counts"]
    return (f"{scenario:<34} {result['backend']['name']:<12} acked {c['acknowledged']:>6}  lost {c['lost']:>4}  "
            f"overwritten {c['overwritten']:>4}  unwritable {c['longest_gap']:>6.2f} s  "
            f"false failovers {c['false_failovers']:>2}  resume {c['resume_seconds']:>6.2f} s"
            + (f"  (never resumed: {c['never_resumed']})" if c["never_resumed"] else ""))


ROW_HEADER = ("scenario, backend, acknowledged, lost, overwritten, seconds a partition was unwritable, "
              "false failovers, seconds to resume after the fault ends")


def write_report(result: dict, out_dir: Path, stem: str) -> tuple[Path, Path | None]:
    """`stem`.json and `stem`.png (the timeline) in `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    png = out_dir / f"{stem}.png"
    try:
        plot_timeline(result, png)
    except Exception as e:   # noqa: BLE001 - the JSON is the report; the picture is a help
        result.setdefault("harness_errors", []).append(f"plot: {type(e).__name__}: {e}")
        path.write_text(json.dumps(result, indent=1, default=str))
        return path, None
    return path, png


COLOURS = {"pause": "tab:orange", "kill": "tab:red", "pg-outage": "tab:purple",
           "s3-freeze": "tab:brown", "migrate": "tab:blue", "lose-host": "black"}


def plot_timeline(result: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    faults = [f for f in result["faults"] if not (f["detail"] or {}).get("skipped")]
    rows = sorted({f["target"] for f in faults}, key=lambda s: (s[0] != "p" and s not in ("pg", "s3"), s))
    rows = sorted(rows, key=lambda s: (0 if s in ("pg", "s3") else 1 if s.startswith("node") else 2, s))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 8), sharex=True,
                                      gridspec_kw=dict(height_ratios=[max(1, len(rows)) * 0.4 + 1, 3]))
    end = result.get("shutdown_at") or 0
    for f in faults:
        y = rows.index(f["target"])
        s, e = f["start"], f["end"] if f["end"] is not None else end
        top.broken_barh([(s, max(e - s, 0.05))], (y - 0.35, 0.7), color=COLOURS.get(f["kind"], "grey"),
                        alpha=0.8 if not f["error"] else 0.4)
    labelled = set()
    for fo in result["failover_records"]:
        target = f"node {fo.get('node')}"
        false = any(x is fo or (x.get("at_ns") == fo.get("at_ns") and x.get("node") == fo.get("node"))
                    for x in result["false_failover_records"])
        if target not in rows:
            rows.append(target)
        label = "false failover" if false else "failover"
        top.plot([fo["t"]], [rows.index(target)], marker="X", color="red" if false else "green", markersize=10,
                 linestyle="none", label=None if label in labelled else label)
        labelled.add(label)
    top.set_yticks(range(len(rows)), rows)
    top.set_ylim(-0.8, len(rows) - 0.2)
    for kind, colour in COLOURS.items():
        if any(f["kind"] == kind for f in faults):
            top.plot([], [], color=colour, linewidth=8, label=kind)
    if top.get_legend_handles_labels()[0]:
        top.legend(loc="upper right", fontsize=7, ncol=4)
    c = result["counts"]
    top.set_title(f"{result['backend']['name']} seed {result.get('seed')}: acked {c['acknowledged']}, lost "
                  f"{c['lost']}, overwritten {c['overwritten']}, acked twice {c['acked_twice']}, duplicated "
                  f"{c['duplicated']}, false failovers {c['false_failovers']}")
    for name, tl in result["ack_timeline"].items():
        xs = [i * tl["bucket_seconds"] for i in range(len(tl["counts"]))]
        bottom.step(xs, [n / tl["bucket_seconds"] for n in tl["counts"]], where="post", label=name, linewidth=1)
    lost = [t for ts in result.get("lost_times", {}).values() for t in ts]
    if lost:
        bottom.plot(lost, [0] * len(lost), marker="|", color="red", markersize=14, linestyle="none",
                    label=f"lost ({result['counts']['lost']})")
    for marker in ("steady_at", "faults_ended_at", "shutdown_at"):
        if result.get(marker):
            for ax in (top, bottom):
                ax.axvline(result[marker], color="grey", linestyle=":", linewidth=1)
    bottom.set_ylabel("acknowledgments / s")
    bottom.set_xlabel("seconds since start")
    bottom.legend(loc="upper right", fontsize=7, ncol=6)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def _read_objects_together(client, meta, parts) -> None:
    """Bring the blocks the partitions' log streams hold in StreamSetObjects into the reader's
    cache with the product's batched point read (`fetch_committed_at`: blocks of one object up to
    256 KiB apart share one ranged GET), so that the fetches after it, one partition at a time,
    read the same decoded blocks without a GET each. Hundreds of slow partitions leave every
    StreamSetObject holding a small block of each: read one stream at a time, a GET per block
    (7,000 GETs of moto, 24 s, for 240 partitions of a 16 s run). Only if those objects fit in
    a quarter of the block cache; what this does not read (or fails to), the fetches read alone
    and report."""
    from s3stream.metadata import ObjectType
    points = []
    objects: dict[int, int] = {}
    for part in parts:
        pos, end = part.start_offset, part.end_offset
        while pos < end:
            refs = meta.get_object_refs(part.log_stream_id, pos, end, limit=1000)
            if not refs or refs[-1].end_offset <= pos:
                break
            for ref in refs:
                if ref.type == ObjectType.STREAM_SET_OBJECT:
                    points.append((part.log_stream_id, max(pos, ref.start_offset)))
                    objects[ref.object_id] = ref.size
            pos = refs[-1].end_offset
    if points and sum(objects.values()) <= client.config.block_cache_size // 4:
        try:
            client.fetch_committed_at(points)
        except Exception:   # noqa: BLE001 - a hint only: the fetches read alone and say why
            pass
