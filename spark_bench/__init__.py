"""PySpark-driven load tests: each Spark task acts as one node (its own WAL file, the shared
object store and metadata).

    python -m spark_bench throughput [--nodes 1,2,4] [--duration S] [--verify] ...
    python -m spark_bench migration  [--histories 16M,256M,1G] [--tail 16M] [--migrations N] ...
    python -m spark_bench migration-campaign [--rounds 2] [--cases sqlite-0.5,...] [-- ARGS]
                                     the migration test in issue 28's four cases, several rounds
    python -m spark_bench balance    [--nodes 4] [--partitions 32] [--rate MB/s] [--quick] ...
    python -m spark_bench mirror     [--workers 2] [--rate MB/s] [--duration S] [--quick] ...
    python -m spark_bench pipeline   [--inputs 4] [--outputs 2] [--rate MB/s] [--duration S] [--quick] ...
                                     a streaming query through the s3stream data source, a Python
                                     worker killed; exactly once checked (issue 30)
    python -m spark_bench datasource [--gib 1] [--reps 3] [--quick]
                                     batch read and write through the data source against Parquet

Where they run (options of both):
    (default) or --master local[N]   one process; the nodes' WALs in the driver's work dir
    --master spark://host:port       a running cluster: one one-core executor per node; nodes share
                                     only --meta (postgresql://...) and --store (s3://...); their WALs
                                     stay on their executors' hosts (--node-dir); SQLite or file://
                                     need --allow-shared-fs
    --standalone N                   start a standalone cluster of N workers on 127.0.0.1 for the run

Each run writes a JSON report and PNG plots, and shows progress on stderr.

`s3stream bench --kind spark-throughput` (and spark-migration, spark-balance, spark-mirror) runs
them through `bench_throughput` and its siblings, registered as entry points of the group
`s3stream.benchmarks` (pyproject.toml): s3stream finds them there and never imports this package.
"""
from __future__ import annotations

import sys

USAGE = __doc__


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    kind, rest = argv[0], argv[1:]
    if kind == "throughput":
        from .throughput import run
    elif kind == "migration":
        from .migration import run
    elif kind == "migration-campaign":
        from .migration_campaign import run
    elif kind == "balance":
        from .balance import run
    elif kind == "mirror":
        from .mirror import run
    elif kind == "pipeline":
        from .pipeline import run
    elif kind == "datasource":
        from .datasource import run
    else:
        print(f"unknown load test {kind!r}: choose throughput, migration, migration-campaign, balance, mirror, pipeline or datasource\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    return run(rest)


#: spark_bench has no --quick of its own for every test: these small settings stand for it (options
#: given after them win).
QUICK = {
    "throughput": ["--nodes", "1,2", "--partitions", "1", "--duration", "1.5", "--wal-capacity", "64M"],
    "migration": ["--histories", "4M,16M", "--migrations", "3", "--tail", "4M", "--pause", "0.1",
                  "--wal-capacity", "64M"],
    "balance": ["--quick", "--wal-capacity", "128M"],
    "mirror": ["--quick"],
    "pipeline": ["--quick"],
    "datasource": ["--quick"],
}


def _bench(test: str, argv: list[str]) -> dict:
    """Run load test `test` for `s3stream bench`: a leading --quick stands for QUICK[test]."""
    if argv[:1] == ["--quick"]:
        argv = QUICK[test] + argv[1:]
    try:
        return main([test] + argv)
    except ImportError as e:
        raise SystemExit(f"the Spark load test is not available: install pyspark (pip install pyspark): {e}") from None


def bench_throughput(argv: list[str]) -> dict:
    """`s3stream bench --kind spark-throughput`: the throughput load test (--quick: 1 and 2 nodes, 1.5 s)."""
    return _bench("throughput", argv)


def bench_migration(argv: list[str]) -> dict:
    """`s3stream bench --kind spark-migration`: partition migration under load (--quick: small histories)."""
    return _bench("migration", argv)


def bench_balance(argv: list[str]) -> dict:
    """`s3stream bench --kind spark-balance`: the balancer on a skewed cluster (--quick: its own quick run)."""
    return _bench("balance", argv)


def bench_pipeline(argv: list[str]) -> dict:
    """`s3stream bench --kind spark-pipeline`: a streaming query through the data source, a worker killed."""
    return _bench("pipeline", argv)


def bench_datasource(argv: list[str]) -> dict:
    """`s3stream bench --kind spark-datasource`: batch read and write through the data source against Parquet."""
    return _bench("datasource", argv)


def bench_mirror(argv: list[str]) -> dict:
    """`s3stream bench --kind spark-mirror`: mirroring under load with a worker killed (--quick: its own)."""
    return _bench("mirror", argv)
