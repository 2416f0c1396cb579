"""Shared pieces of the Spark load tests: where they run (local mode, an existing cluster, or a
standalone cluster started for the run), node specs, storage, verification, reports.

Local mode (`--master local[N]`, the default) runs every node as a task of one process; nodes
keep their WALs in the driver's work directory. Cluster mode (any other master, or
`--standalone N`) runs each node in its own one-core executor, which may be on another host:
nodes share nothing but the metadata URL and the object store URL, keep their WALs in a
directory of their executor's own (never the driver's), and the driver checks what they
acknowledged through a client of its own, reading nothing of theirs.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from benchmarks.kit import log_line, parse_size, percentiles, progress_over, publish
from s3stream.cluster import read_partition

KiB, MiB, GiB = 1024, 1024 ** 2, 1024 ** 3

#: Seconds the driver waits for a cluster to give it one executor per node.
EXECUTOR_WAIT = 90.0


def progress(msg: str) -> None:
    log_line(f"[spark_bench {time.strftime('%H:%M:%S')}] {msg}")


def add_common_args(ap: argparse.ArgumentParser) -> None:
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--master", default=None,
                       help="Spark master: local[N] (the default: one process) or spark://host:port of a running "
                            "cluster (cluster mode: nodes share only --meta and --store)")
    where.add_argument("--standalone", type=int, default=None, metavar="N",
                       help="start a Spark standalone cluster of N one-core workers on 127.0.0.1 for the run "
                            "(cluster mode on a single host: SQLite and a local store are allowed)")
    ap.add_argument("--node-dir", default=None,
                    help="cluster mode: directory on each executor's host in which a node makes its WAL "
                         "directory (default: the executor's temp directory)")
    ap.add_argument("--allow-shared-fs", action="store_true",
                    help="cluster mode: accept a SQLite metadata URL or a file:// store (only right when every "
                         "host sees the same file system at the same path)")
    ap.add_argument("--workdir", default=None, help="the driver's files: local-mode WALs, SQLite metadata, "
                    "helper WALs (default: OUT/work)")
    ap.add_argument("--store", default=None, help="object store URL (default: a directory on /dev/shm, "
                    "standing for S3, which does not share the WAL's disk)")
    ap.add_argument("--meta", default=None, help="metadata URL (default: sqlite in the work dir)")
    ap.add_argument("--batch", type=parse_size, default=64 * KiB, help="record batch payload size")
    ap.add_argument("--upload-threshold", type=parse_size, default=16 * MiB, help="log cache block size")
    ap.add_argument("--wal-capacity", type=parse_size, default=512 * MiB, help="each node's WAL file size")
    ap.add_argument("--out", default=None, help="report directory (JSON + PNG)")
    ap.add_argument("--keep", action="store_true", help="keep the work and store directories")
    ap.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                    help="serve each node task's Prometheus metrics on http://ADDR:PORT+i/metrics, i being "
                         "the task's index in its job (0, the default: off)")
    ap.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                    help="the address --metrics-port listens on (default 127.0.0.1: scrape on each executor's "
                         "host; 0.0.0.0 to scrape from another host)")


def is_cluster(master: str) -> bool:
    """True for a master whose executors may be on other hosts (anything but local[...])."""
    return not master.startswith("local")


def shared_fs_only(meta: str | None, store: str | None) -> list[str]:
    """The URLs (None: the default) that work only when every host sees the same file system."""
    found = []
    if meta is None or meta.startswith("sqlite:") or "://" not in meta:
        found.append(f"the metadata {meta or '(default: SQLite in the work dir)'} is a SQLite file")
    if store is None or store.startswith("file:") or "://" not in store:
        found.append(f"the object store {store or '(default: a local directory)'} is a local directory")
    return found


def check_cluster_storage(args) -> None:
    """SystemExit for a run on an existing cluster whose metadata or store lives on this host's
    file system, unless --allow-shared-fs says every host sees it."""
    if args.master is None or not is_cluster(args.master) or args.allow_shared_fs:
        return
    found = shared_fs_only(args.meta, args.store)
    if found:
        raise SystemExit(
            f"cluster mode (--master {args.master}): nodes share nothing but the metadata and the object store, "
            f"but {' and '.join(found)}, which executors on other hosts cannot see. Give --meta "
            "postgresql://user@host/db and --store s3://bucket/prefix, or --allow-shared-fs if every host mounts "
            "the same file system at the same path, or --standalone N for a cluster on this host alone.")


def refuse_used_metadata(url: str, option: str = "--meta") -> None:
    """A metadata URL of the user's must be fresh: one an earlier run used holds its streams and
    partitions, whose objects went with that run's store (by default a directory removed at its
    end), so this run would build on top of them or read back from objects that are gone.
    Refused naming what it holds and the fix; a missing SQLite file is created (fresh)."""
    from s3stream.cluster.partition import PARTITION_KV_PREFIX
    from s3stream.metadata import open_metadata
    meta = open_metadata(url)
    try:
        partitions = sorted(k.removeprefix(PARTITION_KV_PREFIX) for k in meta.list_kv(PARTITION_KV_PREFIX))
        streams = len(meta.list_streams())
    finally:
        meta.close()
    if partitions or streams:
        held = [f"partition(s) {', '.join(partitions[:5])}{' ...' if len(partitions) > 5 else ''}"] if partitions else []
        held += [f"{streams} stream(s)"] if streams else []
        raise SystemExit(f"{option} {url} already holds {' and '.join(held)} from an earlier run (their objects "
                         f"went with that run's store): give {option} a fresh database, or leave it out for SQLite "
                         "in the run's work directory")


def storage(args, name: str, store_query: str = "") -> tuple[str, str, str, str, list[str]]:
    """(out, workdir, store URL, meta URL, directories to remove at the end). `store_query`: the
    query (LocalObjectStore options) the default store's URL gets when it is on /dev/shm (the
    options it is for are meant for a RAM disk); a --store is used as given. A --meta must be
    fresh (refuse_used_metadata), checked before anything is made."""
    if args.meta:
        refuse_used_metadata(args.meta)
    out = os.path.abspath(args.out or os.path.join("reports", f"spark-{name}"))
    work = os.path.abspath(args.workdir or os.path.join(out, "work"))
    cleanup = []
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    cleanup.append(work)
    if args.store:
        store = args.store
    else:
        ram = os.path.isdir("/dev/shm")
        root = f"/dev/shm/s3stream-spark-{os.getpid()}" if ram else os.path.join(work, "objects")
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        cleanup.append(root)
        store = f"file://{root}" + (f"?{store_query}" if store_query and ram else "")
    meta = args.meta or f"sqlite:///{work}/meta.db"
    os.makedirs(out, exist_ok=True)
    return out, work, store, meta, cleanup


def node_spec(args, node_id: int, wal_dir: str | None, store: str, meta: str, partitions: list[str],
              duration: float, cluster: dict, keep_acks: bool = False, inflight: int = 32,
              run_id: str = "bench") -> dict:
    """What one node runs. `wal_dir`: where its WAL goes (local mode: the driver's work dir);
    None in cluster mode, where the node makes its own directory under --node-dir on its executor.
    `run_id` names the run's KV keys (bench/<run_id>/stop), so runs can share one metadata store."""
    return dict(node_id=node_id, wal_dir=wal_dir, node_dir=args.node_dir, store_url=store, meta_url=meta,
                partitions=partitions, duration=duration, batch=args.batch, upload_threshold=args.upload_threshold,
                split_size=8 * MiB, wal_capacity=args.wal_capacity, cluster=cluster, keep_acks=keep_acks,
                inflight=inflight, run_id=run_id, keep_wal=args.keep)


def assign_metrics_ports(specs: list[dict], port: int, addr: str = "127.0.0.1") -> None:
    """Give the job's tasks ports port, port + 1, ... (several share a host; 0: no metrics)
    on `addr`."""
    for i, spec in enumerate(specs):
        spec["metrics_port"] = port + i if port else 0
        spec["metrics_addr"] = addr


def serve_task_metrics(spec: dict):
    """In a task: serve prometheus_client's default registry on spec["metrics_port"]; the
    server (to pass to stop_task_metrics), or None if off or the port is taken (the load test
    runs on without)."""
    port = spec.get("metrics_port") or 0
    if not port:
        return None
    from s3stream.metrics import serve
    try:
        server, _ = serve(port, addr=spec.get("metrics_addr", "127.0.0.1"))
    except OSError as e:
        progress(f"metrics: port {port} not served ({e})")
        return None
    return server


def stop_task_metrics(server) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Everything this process holds on entry left out of Python's cyclic GC until the exit.

    A full (generation 2) collection walks every tracked object and stops every thread of the
    process meanwhile: in a Spark task holding a node (pyspark, s3stream, its clients) it took
    15-50 ms, in the migration driver (pyspark, pandas, pyarrow, the histories' clients) 60-85 ms,
    a few times a minute each (gc.callbacks, one run per case). A move that met one would be
    timed with it. What setup left (imports, clients) is long-lived: frozen, it is not walked
    again, and a collection walks only what was made since. On exit it is handed back
    (gc.unfreeze), so that a reused Spark worker does not keep the cycles of tasks long done.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def new_run_id() -> str:
    return uuid.uuid4().hex[:8]


def spark_session(master: str, name: str, cores: int, cluster: bool = False):
    """A session on `master`. In cluster mode each node gets an executor of one core (so nodes
    run in distinct processes) and the driver waits until `cores` of them registered. A run on
    this host alone (local mode, or a master on loopback) listens on 127.0.0.1 only."""
    try:
        from pyspark.sql import SparkSession
    except ImportError as e:
        raise SystemExit("spark_bench needs pyspark: pip install pyspark (Java 17 must be installed)") from e
    builder = (SparkSession.builder.master(master).appName(name)
               .config("spark.ui.enabled", "false")
               .config("spark.task.maxFailures", "1")
               .config("spark.python.worker.reuse", "false")
               .config("spark.driver.memory", "2g"))
    environ = worker_python()
    if not cluster or master.split("://", 1)[-1].rsplit(":", 1)[0] in ("127.0.0.1", "localhost"):
        # The driver's RPC and block manager on loopback (where executors on this host reach it),
        # not on the address this host's name resolves to; SPARK_LOCAL_IP spares the JVM looking
        # for that address (and warning that the name resolves to loopback).
        builder = builder.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
        environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    if not cluster:
        with environ_set(environ):
            return builder.config("spark.default.parallelism", str(cores)).getOrCreate()
    builder = (builder.config("spark.executor.cores", "1")
               .config("spark.cores.max", str(cores))
               .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
               .config("spark.scheduler.maxRegisteredResourcesWaitingTime", f"{EXECUTOR_WAIT:g}s"))
    with environ_set(environ):
        spark = builder.getOrCreate()
    try:
        wait_for_executors(spark, cores, master)
    except BaseException:
        spark.stop()
        raise
    return spark


def worker_python() -> dict[str, str]:
    """The environment under which a new Spark context starts its Python workers with this
    interpreter, unless the user named one in PYSPARK_PYTHON.

    Spark starts them (tasks, and a Python data source's planning and commits) with
    PYSPARK_PYTHON, read when the context is made, else the `python3` on PATH, in local mode
    too. Run as `/venv/bin/python -m spark_bench` by cron or systemd, with no venv on PATH, that
    is another interpreter, without s3stream's dependencies: every task failed importing them."""
    return {"PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON") or sys.executable}


@contextlib.contextmanager
def environ_set(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set (the JVM that getOrCreate starts inherits them), restored after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def wait_for_executors(spark, count: int, master: str, timeout: float = 10.0) -> None:
    """Wait until `count` executors registered: every node of a run must run at once. (The
    scheduler already waited up to EXECUTOR_WAIT for them while the context started.)"""
    tracker = spark.sparkContext._jsc.sc().statusTracker()
    deadline = time.monotonic() + timeout
    while True:
        executors = len(tracker.getExecutorInfos()) - 1          # the list includes the driver
        if executors >= count:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the cluster at {master} gave {executors} one-core executors in "
                             f"{EXECUTOR_WAIT + timeout:g} s; the run needs {count} at once (one per node): add "
                             "workers or cores, or run fewer nodes")
        time.sleep(0.2)


def payload_for(partition: str, node: int, seq: int, size: int) -> bytes:
    """Deterministic payload; its first 16 bytes name it, so the driver can check it byte for byte."""
    head = hashlib.blake2b(f"{partition}/{node}/{seq}".encode(), digest_size=16).digest()
    return (head * (size // 16 + 1))[:size]


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def run_nodes(spark, specs: list[dict], body, seconds: float | None = None) -> list[dict]:
    """Run every spec as one Spark task, all at once (a barrier stage: the master must offer a
    slot per node, or the stage fails instead of running nodes one after the other). `body`:
    the task's function of its specs (spark_bench.node.run_nodes_of_partition for the nodes).
    `seconds`: how long the nodes are to run, for a bar over that time while the driver waits
    (on a terminal only; the driver's ticker costs the nodes nothing)."""
    rdd = spark.sparkContext.parallelize(specs, len(specs))
    with progress_over(seconds, f"{len(specs)} Spark task(s)") if seconds else contextlib.nullcontext():
        return rdd.barrier().mapPartitions(body).collect()


def verdict(ok: bool | None) -> str:
    """A target's verdict in a load test's summary."""
    return "MET" if ok else "MISSED"


@dataclass
class Deployment:
    """Where a load test runs. `wal_dir` is the directory for the nodes' WALs in local mode,
    None in cluster mode (each node makes its own on its executor)."""
    master: str
    cluster_mode: bool
    single_host: bool
    spark: Any
    out: str
    work: str
    store: str
    meta: str

    @property
    def wal_dir(self) -> str | None:
        return None if self.cluster_mode else self.work

    def describe(self) -> dict:
        return dict(master=self.master, cluster_mode=self.cluster_mode, single_host=self.single_host)


@contextlib.contextmanager
def deployment(args, name: str, slots: int, store_query: str = "") -> Iterator[Deployment]:
    """Check the arguments, make the storage (`store_query`: see storage), start a standalone
    cluster if asked, open a Spark session with `slots` task slots; on exit stop them all and
    remove the storage (unless --keep)."""
    check_cluster_storage(args)
    if args.standalone is not None and args.standalone < max(slots, 1):
        raise SystemExit(f"--standalone {args.standalone} gives {args.standalone} one-core workers, but the run "
                         f"needs {slots} nodes at once: start at least {slots}")
    master = args.master or "local[*]"
    if master == "local[*]":
        master = f"local[{slots}]"
    out, work, store, meta, cleanup = storage(args, name, store_query)
    with contextlib.ExitStack() as stack:
        if not args.keep:
            stack.callback(cleanup_dirs, cleanup)
        if args.standalone is not None:
            progress(f"starting a Spark standalone cluster: {args.standalone} workers x 1 core on 127.0.0.1")
            from .standalone import standalone_cluster
            master = stack.enter_context(standalone_cluster(args.standalone, workdir=os.path.join(work, "standalone")))
            progress(f"single-host cluster at {master}: every node and the driver share this host, so SQLite "
                     "metadata and a local-directory store work here; a cluster of hosts needs PostgreSQL and S3")
        spark = spark_session(master, f"s3stream-{name}", slots, cluster=is_cluster(master))
        stack.callback(spark.stop)
        yield Deployment(master, is_cluster(master), args.standalone is not None, spark, out, work, store, meta)


def placement(results: list[dict]) -> dict:
    """node id -> where it ran: executor host and pids, its WAL path."""
    return {r["node_id"]: dict(r["executor"], wal_path=r["wal_path"]) for r in results}


def format_placement(where: dict) -> str:
    return "; ".join(f"node {node}: {e['host']} executor pid {e['executor_pid']} (python {e['pid']})"
                     for node, e in sorted(where.items()))


def verify_acks(store: str, meta: str, results: list[dict], batch: int) -> dict:
    """Read every acknowledged record back through a reader of the driver's own
    (s3stream.open_reader: no WAL, no node, nothing written; the same metadata and store) and
    compare it byte for byte with the payload its node sent. Call it after the nodes closed their partitions: what they
    acknowledged is then committed to objects, and no node's files are read.

    Returns acknowledged, lost (not read back, or different), mismatched (read back different),
    trimmed (below the partition's start offset: retention trimmed them, so they are not read
    and not lost), by_partition (lost per partition) and unreadable (partition -> error: it could
    not be read, e.g. it was never uploaded; all its records count as lost). Partitions are read
    with read_partition, which opens nothing: the verifier changes no epoch and writes no
    checkpoint."""
    import s3stream
    acks: dict[str, dict[int, tuple[int, int]]] = {}
    for r in results:
        for name, base, node, seq in r["acks"]:
            acks.setdefault(name, {})[base] = (node, seq)
    lost: dict[str, int] = {}
    mismatched = trimmed = 0
    unreadable: dict[str, str] = {}
    reader = s3stream.open_reader(meta, store)
    try:
        for name, expected in acks.items():
            try:
                p = read_partition(reader, name)      # read-only: the partition is not opened
                start = p.start_offset
                pos = max(min(expected), start)
                end = min(max(expected) + 1, p.end_offset)
            except s3stream.S3StreamError as e:
                unreadable[name] = str(e)
                lost[name] = len(expected)
                continue
            good = bad = 0
            gone = sum(1 for base in expected if base < start)
            trimmed += gone
            while pos < end:
                res = p.fetch(pos, end, max_bytes=8 * MiB)
                if not res.batches:
                    break
                for b in res.batches:
                    if b.base_offset not in expected:
                        continue
                    node, seq = expected[b.base_offset]
                    if b.payload == payload_for(name, node, seq, batch):
                        good += 1
                    else:
                        bad += 1
                pos = res.end_offset
            mismatched += bad
            lost[name] = len(expected) - gone - good
    finally:
        reader.close()
    return dict(acknowledged=sum(len(v) for v in acks.values()), lost=sum(lost.values()), mismatched=mismatched,
                trimmed=trimmed, by_partition=lost, unreadable=unreadable)


def latency_summary(latencies_ns: list[int]) -> dict:
    return percentiles(latencies_ns, ps=(0.5, 0.99, 0.999))


def write_json(out: str, report: dict) -> str:
    path = os.path.join(out, "report.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    return path


def cleanup_dirs(dirs: list[str]) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
