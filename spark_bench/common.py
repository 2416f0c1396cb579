"""Shared pieces of the Spark load tests: the Spark session, node specs, storage, reports."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from wal.bench import parse_size, percentiles

KiB, MiB, GiB = 1024, 1024 ** 2, 1024 ** 3


def progress(msg: str) -> None:
    print(f"[spark_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--master", default="local[*]", help="Spark master (default local[*]: one machine)")
    ap.add_argument("--workdir", default=None, help="WAL files and SQLite metadata (default: OUT/work)")
    ap.add_argument("--store", default=None, help="object store URL (default: a directory on /dev/shm, "
                    "standing for S3, which does not share the WAL's disk)")
    ap.add_argument("--meta", default=None, help="metadata URL (default: sqlite in the work dir)")
    ap.add_argument("--batch", type=parse_size, default=64 * KiB, help="record batch payload size")
    ap.add_argument("--upload-threshold", type=parse_size, default=16 * MiB, help="log cache block size")
    ap.add_argument("--wal-capacity", type=parse_size, default=512 * MiB, help="each node's WAL file size")
    ap.add_argument("--out", default=None, help="report directory (JSON + PNG)")
    ap.add_argument("--keep", action="store_true", help="keep the work and store directories")


def storage(args, name: str) -> tuple[str, str, str, str, list[str]]:
    """(out, workdir, store URL, meta URL, directories to remove at the end)."""
    out = os.path.abspath(args.out or os.path.join("reports", f"spark-{name}"))
    work = os.path.abspath(args.workdir or os.path.join(out, "work"))
    cleanup = []
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    cleanup.append(work)
    if args.store:
        store = args.store
    else:
        root = f"/dev/shm/s3stream-spark-{os.getpid()}" if os.path.isdir("/dev/shm") else os.path.join(work, "objects")
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        cleanup.append(root)
        store = f"file://{root}"
    meta = args.meta or f"sqlite:///{work}/meta.db"
    os.makedirs(out, exist_ok=True)
    return out, work, store, meta, cleanup


def node_spec(args, node_id: int, work: str, store: str, meta: str, partitions: list[str], duration: float,
              cluster: dict, keep_acks: bool = False, inflight: int = 32) -> dict:
    return dict(node_id=node_id, workdir=work, store_url=store, meta_url=meta, partitions=partitions,
                duration=duration, batch=args.batch, upload_threshold=args.upload_threshold,
                split_size=8 * MiB, wal_capacity=args.wal_capacity, cluster=cluster, keep_acks=keep_acks,
                inflight=inflight)


def spark_session(master: str, name: str, cores: int):
    try:
        from pyspark.sql import SparkSession
    except ImportError as e:
        raise SystemExit("spark_bench needs pyspark: pip install pyspark (Java 17 must be installed)") from e
    return (SparkSession.builder.master(master).appName(name)
            .config("spark.ui.enabled", "false")
            .config("spark.task.maxFailures", "1")
            .config("spark.python.worker.reuse", "false")
            .config("spark.driver.memory", "2g")
            .config("spark.default.parallelism", str(cores))
            .getOrCreate())


def run_nodes(spark, specs: list[dict]) -> list[dict]:
    """Run every spec as one Spark task (all at once: the master must offer enough slots)."""
    from spark_bench.node import run_node
    rdd = spark.sparkContext.parallelize(specs, len(specs))
    return rdd.map(run_node).collect()


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
