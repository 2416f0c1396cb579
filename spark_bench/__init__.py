"""PySpark-driven load tests: each Spark task acts as one node (its own WAL file, the shared
object store and metadata).

    python -m spark_bench throughput [--nodes 1,2,4] [--duration S] [--verify] ...
    python -m spark_bench migration  [--histories 16M,256M,1G] [--tail 16M] [--migrations N] ...
    python -m spark_bench balance    [--nodes 4] [--partitions 32] [--rate MB/s] [--quick] ...
    python -m spark_bench mirror     [--workers 2] [--rate MB/s] [--duration S] [--quick] ...

Where they run (options of both):
    (default) or --master local[N]   one process; the nodes' WALs in the driver's work dir
    --master spark://host:port       a running cluster: one one-core executor per node; nodes share
                                     only --meta (postgresql://...) and --store (s3://...); their WALs
                                     stay on their executors' hosts (--node-dir); SQLite or file://
                                     need --allow-shared-fs
    --standalone N                   start a standalone cluster of N workers on 127.0.0.1 for the run

Each run writes a JSON report and PNG plots, and shows progress on stderr.
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
    elif kind == "balance":
        from .balance import run
    elif kind == "mirror":
        from .mirror import run
    else:
        print(f"unknown load test {kind!r}: choose throughput, migration, balance or mirror\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    return run(rest)
