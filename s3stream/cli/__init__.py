"""The `s3stream` command: look inside WALs, objects and metadata, move partitions, run benchmarks.

    s3stream inspect wal PATH|URL        a WAL's header (a file's) or objects (a WAL of objects') and what
                                         recovery would read from it
    s3stream inspect object PATH|KEY|ID  an object's footer and index; --verify decodes every block
    s3stream streams --meta URL          streams, objects, nodes and partitions in the metadata
    s3stream migrate PARTITION NODE      move a partition to a node that runs a NodeAgent
    s3stream node fail-over NODE         fail a dead node over from here (its WAL reachable from this host)
    s3stream node forget NODE --wal-lost give up a node whose WAL is lost with its host
    s3stream node drain NODE             move a node's partitions to the other live nodes, in batches
    s3stream node history                every failover, migration fallback and forget
    s3stream balance plan                the moves the balancer would make now (live, or a recorded state)
    s3stream balance record|status       save the state it plans from; its lease, nodes' reports, last round
    s3stream balance run                 run a balancer candidate in the foreground (moves partitions)
    s3stream mirror run                  run a mirror worker: copy a source cluster's partitions here
    s3stream mirror status               flows, offset maps, leases, workers, heartbeats of the mirror
    s3stream bench                       the engine, WAL or Spark benchmarks

`inspect`, `streams`, `balance plan`, `balance status` and `mirror status` only read. User errors (a missing file, a
corrupt WAL or object, a bad URL) print one line saying what was wrong and what to do, and exit with
status 1; usage errors exit 2.

One module per command group: inspect (inspect wal|object, wal-salvage), cluster (streams,
migrate, node), balance, mirror, bench; common holds what they share. This module makes the `main`
group and registers theirs.
"""
from __future__ import annotations

import logging

import click

from . import balance, bench, cluster, inspect, mirror


@click.group(context_settings=dict(help_option_names=["-h", "--help"]))
@click.version_option(package_name="s3stream", prog_name="s3stream")
@click.option("-v", "--verbose", is_flag=True, help="Log the library's progress (INFO) to stderr.")
def main(verbose: bool) -> None:
    """Inspect and operate s3stream: append-only streams on object storage behind a WAL.

    URLs: metadata as sqlite:////abs/path.db (or $S3STREAM_META), object stores as file:///dir,
    a directory, or s3://bucket/prefix?endpoint_url=... (or $S3STREAM_STORE).
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


for command in (inspect.inspect, inspect.wal_salvage, cluster.streams, cluster.migrate, cluster.node, balance.balance,
                mirror.mirror, bench.bench):
    main.add_command(command)
