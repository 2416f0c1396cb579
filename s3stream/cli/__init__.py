"""The `s3stream` command: look inside WALs, objects and metadata, move partitions, run benchmarks.

    s3stream inspect wal PATH            a WAL's header and what recovery would read from it
    s3stream inspect object PATH|KEY     an object's footer and index; --verify decodes every block
    s3stream streams --meta URL          streams, objects, nodes and partitions in the metadata
    s3stream migrate PARTITION NODE      move a partition to a node that runs a NodeAgent
    s3stream balance plan                the moves the balancer would make now (live, or a recorded state)
    s3stream balance record|status       save the state it plans from; its lease, nodes' reports, last round
    s3stream balance run                 run a balancer candidate in the foreground (moves partitions)
    s3stream mirror run                  run a mirror worker: copy a source cluster's partitions here
    s3stream mirror status               flows, offset maps, leases, workers, heartbeats of the mirror
    s3stream bench                       the engine, WAL or Spark benchmarks

`inspect`, `streams`, `balance plan`, `balance status` and `mirror status` only read. User errors (a missing file, a
corrupt WAL or object, a bad URL) print one line saying what was wrong and what to do, and exit with
status 1; usage errors exit 2.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import logging
import os
import threading
import time
from collections import Counter, defaultdict
from typing import Any, Callable, Iterator, Sequence
from urllib.parse import unquote, urlsplit

import click

import wal
from _native import objcodec
from wal.benchkit import parse_size

from .balancer import (BYTES_IN, BYTES_OUT, NEUTRAL, Action, BalancerConfig, ClusterModel, NodeState, action_to_dict,
                       explain_action, plan)
from .balancer.bench_plan import imbalance
from .balancer.explain import format_rate
from .balancer.lease import LEASE_KEY
from .balancer.loop import LAST_ROUND_KEY, Balancer, live_model
from .recovery import WAL_RECORD
from .cluster import Cluster, ClusterConfig, MigrationReport
from .config import Config
from .errors import ConfigError, S3StreamError
from .loadreport import read_reports
from .metadata import MetadataStore, ObjectState, ObjectType, open_metadata, redact_url
from .objectformat import FOOTER_SIZE, IndexEntry, read_blocks, read_index
from .objectstore import LocalObjectStore, ObjectStore, open_object_store

META_HELP = ("Metadata URL: sqlite:////abs/path.db, sqlite:///rel/path.db or a path ending in .db "
             "(env S3STREAM_META).")
STORE_HELP = "Object store URL: file:///dir, a directory path, or s3://bucket/prefix?... (env S3STREAM_STORE)."


# ---- shared helpers -------------------------------------------------------------------------------

def user_errors(fn: Callable) -> Callable:
    """Turn the library's errors (and OS errors such as a permission denied) into one-line
    click errors: no traceback for a corrupt file or a bad URL."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (S3StreamError, wal.WALError) as e:
            raise click.ClickException(str(e)) from e
        except OSError as e:
            where = f" ({e.filename})" if e.filename else ""
            raise click.ClickException(f"{e.strerror or e}{where}") from e
    return wrapper


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


def table(headers: list[str], rows: list[list[Any]], indent: str = "  ") -> str:
    """Rows under headers in aligned columns."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = [headers] + cells
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def _local_path(url: str) -> str | None:
    """The path of a local object store URL (file:// or a plain path); None for other schemes."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    return unquote(parts.path) if parts.scheme.lower() == "file" else None


def _sqlite_path(url: str) -> str | None:
    """The database file a SQLite metadata URL names (the rules of open_metadata); None otherwise."""
    if url.startswith("sqlite:///") and len(url) > len("sqlite:///"):
        return url[len("sqlite:///"):]
    if "://" not in url and url.endswith(".db"):
        return url
    return None


def open_store(url: str) -> ObjectStore:
    """The object store at `url`, which must already exist (opening a local store would create
    its directory, which hides a mistyped path)."""
    path = _local_path(url)
    if path is not None and not os.path.isdir(path):
        raise click.ClickException(
            f"no object store directory at {path!r} (from store URL {url!r}); check the path")
    try:
        return open_object_store(url)
    except S3StreamError as e:
        raise click.ClickException(f"cannot open object store {url!r}: {e}") from e


def open_meta(url: str) -> MetadataStore:
    """The metadata store at `url`, which must already exist (SQLite would create an empty one)."""
    path = _sqlite_path(url)
    if path is not None and os.path.isdir(path):
        raise click.ClickException(f"metadata path {path!r} (from metadata URL {url!r}) is a directory; "
                                   "give the database file")
    if path is not None and not os.path.isfile(path):
        raise click.ClickException(
            f"no metadata database at {path!r} (from metadata URL {url!r}); check the path "
            "(sqlite:////abs/path.db has four slashes)")
    try:
        return open_metadata(url)
    except S3StreamError as e:
        raise click.ClickException(f"cannot open metadata {redact_url(url)!r}: {e}") from e


def meta_option(fn: Callable) -> Callable:
    return click.option("--meta", "meta_url", required=True, envvar="S3STREAM_META", metavar="URL",
                        help=META_HELP)(fn)


def store_option(required: bool, help: str = STORE_HELP) -> Callable:
    return click.option("--store", "store_url", required=required, envvar="S3STREAM_STORE", metavar="URL",
                        help=help)


def json_option(fn: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(fn)


def metrics_option(fn: Callable) -> Callable:
    return click.option("--metrics-port", type=click.IntRange(0, 65535), default=0, metavar="PORT",
                        help="Serve Prometheus metrics on http://0.0.0.0:PORT/metrics (docs/metrics.md) "
                             "[default: 0, off].")(fn)


def serve_metrics(port: int) -> None:
    """Start /metrics on `port` (0: do nothing) on prometheus_client's default registry."""
    if not port:
        return
    from .metrics import serve
    try:
        serve(port)
    except OSError as e:
        raise click.ClickException(f"cannot serve metrics on port {port}: {e.strerror or e}; choose another "
                                   "--metrics-port") from e
    click.echo(f"metrics on http://0.0.0.0:{port}/metrics")


def _iso(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9)) if ns else "-"


# ---- the group ------------------------------------------------------------------------------------

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


@main.group()
def inspect() -> None:
    """Look inside a WAL or an object (read-only)."""


# ---- inspect wal ----------------------------------------------------------------------------------

def read_wal_header(path: str) -> tuple[wal.Header, tuple[str, str]]:
    """The newest valid header slot of the WAL at `path`, and both slots' states."""
    header, states = wal.read_header(path)
    if header is None:
        what = ("never formatted (all zero)" if states == ("empty", "empty") else
                "a corrupt WAL header" if "corrupt" in states else "not an s3stream WAL")
        raise click.ClickException(f"{path}: {what} (header slots: {states[0]}, {states[1]}); "
                                   "nothing to inspect")
    return header, states


def describe_record(record: wal.Record) -> dict:
    """A WAL record's position and, if its body is long enough to carry one, its stream header."""
    row: dict[str, Any] = dict(offset=record.offset, end=record.end, length=len(record.data))
    if len(record.data) >= WAL_RECORD.size:
        stream_id, epoch, base, count = WAL_RECORD.unpack_from(record.data)
        row.update(stream_id=stream_id, epoch=epoch, base_offset=base, count=count,
                   payload_bytes=len(record.data) - WAL_RECORD.size)
    return row


def scan_wal(path: str, header: wal.Header, keep_records: bool) -> dict:
    """Recover the WAL read-only (recovery=True opens the file O_RDONLY: nothing is written)."""
    records: list[dict] = []
    streams: dict[int, dict] = {}
    first = last_end = None
    error = None
    with wal.WriteAheadLog.open(path, node_id=header.node_id, node_epoch=header.node_epoch,
                                recovery=True) as w:
        try:
            for record in w.recover():
                row = describe_record(record)
                first = record.offset if first is None else first
                last_end = record.end
                if keep_records:
                    records.append(row)
                if "stream_id" in row:
                    s = streams.setdefault(row["stream_id"], dict(records=0, bytes=0, epochs=set(),
                                                                  first_offset=row["base_offset"]))
                    s["records"] += 1
                    s["bytes"] += row["payload_bytes"]
                    s["epochs"].add(row["epoch"])
                    s["end_offset"] = row["base_offset"] + row["count"]
        except wal.WALCorruptError as e:    # a clean WAL that cannot be read to its end
            error = str(e)
        result = w.recovery_result
        info = dict(path=path, direct_io=w.direct_io, block_device=w.is_block_device, data_capacity=w.capacity)
    recovery = dict(records=result.records, bytes=result.record_bytes, first_offset=first, end_offset=last_end,
                    end=result.end, stop_reason=result.stop_reason, error=error)
    stream_rows = [dict(stream_id=sid, epochs=sorted(s.pop("epochs")), **s) for sid, s in sorted(streams.items())]
    return dict(info=info, recovery=recovery, streams=stream_rows, records=records if keep_records else None)


def header_dict(header: wal.Header, states: tuple[str, str]) -> dict:
    return dict(node_id=header.node_id, node_epoch=header.node_epoch, generation=header.generation,
                capacity=header.capacity, trim_offset=header.trim_offset, clean_shutdown=header.clean_shutdown,
                clean_end=header.clean_end, write_seq=header.write_seq, write_time_ns=header.write_time_ns,
                slots=list(states))


def format_wal(report: dict) -> str:
    h, info, rec = report["header"], report["info"], report["recovery"]
    clean = ("yes: closed cleanly at offset %d" % h["clean_end"] if h["clean_shutdown"]
             else "no: the writer crashed or is still running")
    span = "none" if rec["first_offset"] is None else f"[{rec['first_offset']}, {rec['end_offset']})"
    lines = [
        f"WAL {info['path']}" + (" (block device)" if info["block_device"] else ""),
        f"  node            {h['node_id']} epoch {h['node_epoch']}",
        f"  generation      {h['generation']} (writer sessions)",
        f"  capacity        {h['capacity']:,} bytes ({info['data_capacity']:,} of data area)",
        f"  trim offset     {h['trim_offset']}",
        f"  clean shutdown  {clean}",
        f"  write seq       {h['write_seq']} at {_iso(h['write_time_ns'])} (slots: {', '.join(h['slots'])})",
        "Recovery (read-only scan)",
        f"  valid records   {rec['records']:,} ({rec['bytes']:,} bytes)",
        f"  offsets         {span}; a new writer session resumes at {rec['end']}",
        f"  stopped at      {rec['stop_reason']}",
    ]
    if report["streams"]:
        lines.append(f"Streams in the WAL ({len(report['streams'])})")
        lines.append(table(["stream", "epochs", "records", "bytes", "offsets"],
                           [[s["stream_id"], ",".join(map(str, s["epochs"])), s["records"], s["bytes"],
                             f"[{s['first_offset']}, {s['end_offset']})"] for s in report["streams"]]))
    if report["records"] is not None:
        lines.append(f"Records ({len(report['records'])})")
        lines.append(table(["offset", "length", "stream", "epoch", "base", "count"],
                           [[r["offset"], r["length"], r.get("stream_id", "-"), r.get("epoch", "-"),
                             r.get("base_offset", "-"), r.get("count", "-")] for r in report["records"]]))
    return "\n".join(lines)


@inspect.command("wal")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--node-id", type=click.IntRange(min=0), metavar="N",
              help="The node the WAL should belong to: fail if its header names another. Default: the "
                   "node in the header.")
@click.option("--records", "list_records", is_flag=True,
              help="List every valid record: offset, length and its stream header (stream, epoch, base "
                   "offset, count).")
@json_option
@user_errors
def inspect_wal(path: str, node_id: int | None, list_records: bool, as_json: bool) -> None:
    """Print a WAL's header and what recovery would read from it.

    PATH is a WAL file or block device. It is opened read-only, the way a failover reads a dead
    node's WAL, so this never modifies it and works on any node's WAL; on the WAL of a running
    node it shows a snapshot. Exits 1 if the WAL is corrupt (a cleanly shut down WAL that cannot
    be read to its end is reported after the summary).
    """
    header, states = read_wal_header(path)
    if node_id is not None and node_id != header.node_id:
        raise click.ClickException(f"{path} belongs to node {header.node_id} (epoch {header.node_epoch}), "
                                   f"not node {node_id}; drop --node-id to inspect it anyway")
    report = dict(header=header_dict(header, states), **scan_wal(path, header, list_records))
    if as_json:
        emit_json(report)
    else:
        click.echo(format_wal(report))
    if report["recovery"]["error"]:
        raise click.ClickException(report["recovery"]["error"])


@main.command("wal-salvage")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--yes", "apply", is_flag=True,
              help="Write the change. Without it, only report what would be done (nothing is written).")
@json_option
@user_errors
def wal_salvage(path: str, apply: bool, as_json: bool) -> None:
    """Keep the records after a corrupt span in the middle of a WAL.

    A node refuses to start (WALCorruptError) when a damaged record in its WAL is followed by
    more valid records than a crash can leave after a torn write: they were acknowledged. This
    covers the damaged span with padding records, so that recovery reads past it; the span's
    records are lost, and a stream whose offsets then stop at a gap keeps what precedes the gap
    (the node's log names what it drops). Stop the node first. Exits 1 if there is nothing to
    salvage.
    """
    report = wal.salvage(path, apply=apply)
    if as_json:
        emit_json(report)
    elif not report["damaged"]:
        click.echo(f"WAL {path}: no damaged span with valid records after it (valid records end at "
                   f"{report['valid_end']}); nothing to salvage")
    else:
        verb = "covered" if report["applied"] else "would cover (run again with --yes to write it)"
        click.echo(f"WAL {path}: {report['records_before']} valid records up to offset {report['bad_offset']}, "
                   f"then a damaged span [{report['bad_offset']}, {report['resync_offset']}) of "
                   f"{report['lost_bytes']:,} bytes, then {report['records_after']} valid records up to "
                   f"{report['end']}.\nSalvage {verb} the span with padding; its records are lost.")
    if not report["damaged"]:
        raise click.exceptions.Exit(1)


# ---- inspect object -------------------------------------------------------------------------------

@contextlib.contextmanager
def object_location(target: str, store_url: str | None) -> Iterator[tuple[ObjectStore, str, str | None]]:
    """(store, key, local path) of an object: a key in the store at `store_url` (no local path),
    or a local object file, read as a key of a local store on its directory."""
    if store_url is not None:
        store, key, path = open_store(store_url), target, None
    else:
        if not os.path.exists(target):
            raise click.ClickException(f"no such file: {target!r} (to read a key from an object store, "
                                       "pass --store URL)")
        if not os.path.isfile(target):
            raise click.ClickException(f"{target!r} is not a regular file; give an object file such as "
                                       "objects/ab12/0000000000000007.obj")
        path = os.path.abspath(target)
        store, key = LocalObjectStore(os.path.dirname(path)), os.path.basename(path)
    try:
        yield store, key, path
    finally:
        store.close()


def read_footer(store: ObjectStore, key: str, size: int) -> dict:
    if size < FOOTER_SIZE:
        raise click.ClickException(f"object {key} is {size} bytes, smaller than a {FOOTER_SIZE}-byte footer: "
                                   "not an s3stream object, or truncated")
    try:
        position, length, crc, entries = objcodec.parse_footer(store.get(key, size - FOOTER_SIZE, size), size)
    except objcodec.ObjectFormatError as e:
        raise click.ClickException(f"object {key} is corrupt: {e}") from None
    return dict(index_position=position, index_length=length, index_crc=f"{crc:08x}", entries=entries)


def verify_block(store: ObjectStore, key: str, entry: IndexEntry) -> str | None:
    """None if the block decodes (CRC, offsets) into what its index entry says, else the problem."""
    try:
        [batches] = read_blocks(store, key, [entry])
    except S3StreamError as e:
        return str(e)
    records = sum(b.count for b in batches)
    if len(batches) != entry.batch_count or records != entry.record_count:
        return (f"block holds {len(batches)} batches / {records} records, the index says "
                f"{entry.batch_count} / {entry.record_count}")
    return None


def format_object(report: dict) -> str:
    f = report["footer"]
    streams = sorted({e["stream_id"] for e in report["index"]})
    where = report["path"] or f"{report['key']} in {report['store']}"
    lines = [f"Object {where}",
             f"  size     {report['size']:,} bytes",
             f"  footer   index at {f['index_position']:,}, {f['index_length']:,} bytes, {f['entries']} entries, "
             f"crc {f['index_crc']}",
             f"  streams  {len(streams)}: {', '.join(map(str, streams[:20]))}{' ...' if len(streams) > 20 else ''}",
             "Index"]
    headers = ["stream", "start", "end", "records", "batches", "block pos", "block size"]
    rows = [[e["stream_id"], e["start_offset"], e["end_offset"], e["record_count"], e["batch_count"],
             e["block_position"], e["block_size"]] for e in report["index"]]
    if report.get("verify") is not None:
        headers.append("verify")
        for row, problem in zip(rows, report["verify"]):
            row.append("OK" if problem is None else "CORRUPT")
    lines.append(table(headers, rows))
    for e, problem in zip(report["index"], report.get("verify") or []):
        if problem is not None:
            lines.append(f"  stream {e['stream_id']} [{e['start_offset']}, {e['end_offset']}): {problem}")
    return "\n".join(lines)


@inspect.command("object")
@click.argument("target", metavar="PATH|KEY")
@store_option(required=False, help="Read KEY from this object store (file:///dir, a directory, s3://bucket/"
                                   "prefix?...; env S3STREAM_STORE). Without it, PATH is a local object file.")
@click.option("--verify", is_flag=True, help="Decode every block and check its CRC and offsets against the "
                                             "index; exit 1 if any block is corrupt.")
@json_option
@user_errors
def inspect_object(target: str, store_url: str | None, verify: bool, as_json: bool) -> None:
    """Print an object's size, footer and index entries.

    PATH|KEY is a local object file (e.g. objects/ab12/0000000000000007.obj) or, with --store, a
    key in that store. Index entries: stream, offsets [start, end), records, and where the block
    is. A corrupt footer or index is an error (exit 1).
    """
    with object_location(target, store_url) as (store, key, path):
        try:
            size = store.size(key)
        except ValueError as e:     # a key the store cannot hold, e.g. with '..' segments
            raise click.ClickException(f"invalid object key {key!r}: {e}") from None
        footer = read_footer(store, key, size)
        index = read_index(store, key, size)
        report: dict[str, Any] = dict(path=path, store=None if path else store.url, key=key, size=size,
                                      footer=footer,
                                      index=[e._asdict() for e in index])
        if verify:
            report["verify"] = [verify_block(store, key, e) for e in index]
    bad = sum(problem is not None for problem in report.get("verify") or [])
    if as_json:
        emit_json(report)
    else:
        click.echo(format_object(report))
        if verify and not bad:
            click.echo(f"verify: OK ({len(index)} blocks)")
    if bad:
        raise click.ClickException(f"object {key} is corrupt: {bad} of {len(index)} blocks failed verification")


# ---- streams --------------------------------------------------------------------------------------

def cluster_report(meta: MetadataStore, include_deleted: bool) -> dict:
    """Streams, object totals, nodes and partitions, from the metadata only."""
    objects = meta.list_objects()
    stream_objects: Counter = Counter()
    set_objects: Counter = Counter()
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for o in objects:
        kind = o.type.value if o.type is not None else "-"
        totals[(kind, o.state.value)][0] += 1
        totals[(kind, o.state.value)][1] += o.size
        if o.state == ObjectState.COMMITTED:
            counter = stream_objects if o.type == ObjectType.STREAM_OBJECT else set_objects
            counter.update({r.stream_id for r in o.ranges})
    streams = [dict(stream_id=m.stream_id, state=m.state.value, epoch=m.epoch, owner_node_id=m.owner_node_id,
                    start_offset=m.start_offset, end_offset=m.end_offset, ranges=len(m.ranges),
                    stream_objects=stream_objects[m.stream_id], stream_set_objects=set_objects[m.stream_id])
               for m in meta.list_streams(include_deleted=include_deleted)]
    now = time.time_ns()
    nodes = [dict(node_id=n.node_id, node_epoch=n.node_epoch, failover=n.failover,
                  heartbeat_age_s=round((now - n.heartbeat_ns) / 1e9, 3), wal_path=n.wal_path)
             for n in meta.list_nodes()]
    cluster = Cluster(meta, store=None)     # assignment reads touch only the metadata
    partitions = [dict(name=name, assigned_node=a["node"], version=a["version"], open_on=cluster.owner(name))
                  for name, a in sorted(cluster.assignments().items())]
    return dict(streams=streams,
                objects=[dict(type=k[0], state=k[1], count=v[0], bytes=v[1]) for k, v in sorted(totals.items())],
                nodes=nodes, partitions=partitions)


def format_cluster(report: dict) -> str:
    def none(v):
        return "-" if v is None else v

    lines = [f"Streams ({len(report['streams'])})"]
    lines.append(table(["id", "state", "epoch", "owner", "start", "end", "ranges", "SOs", "in SSOs"],
                       [[s["stream_id"], s["state"], s["epoch"], none(s["owner_node_id"]), s["start_offset"],
                         s["end_offset"], s["ranges"], s["stream_objects"], s["stream_set_objects"]]
                        for s in report["streams"]]))
    lines.append("Objects")
    lines.append(table(["type", "state", "count", "bytes"],
                       [[o["type"], o["state"], o["count"], f"{o['bytes']:,}"] for o in report["objects"]]))
    lines.append(f"Nodes ({len(report['nodes'])})")
    lines.append(table(["id", "epoch", "failover", "heartbeat age", "WAL"],
                       [[n["node_id"], n["node_epoch"], "yes" if n["failover"] else "no",
                         f"{n['heartbeat_age_s']:.1f} s", n["wal_path"]] for n in report["nodes"]]))
    if report["partitions"]:
        lines.append(f"Partitions ({len(report['partitions'])})")
        lines.append(table(["name", "assigned to", "version", "open on"],
                           [[p["name"], p["assigned_node"], p["version"], none(p["open_on"])]
                            for p in report["partitions"]]))
    return "\n".join(lines)


@main.command()
@meta_option
@click.option("--all", "include_deleted", is_flag=True, help="Include DELETED streams.")
@json_option
@user_errors
def streams(meta_url: str, include_deleted: bool, as_json: bool) -> None:
    """List streams, objects, nodes and partitions from the metadata.

    Streams: id, state, epoch, owner node, start/end offsets (end = committed to objects),
    number of ranges (one per open), StreamObjects (SOs) and StreamSetObjects holding it.
    Objects: count and bytes by type (SO, SSO; '-' while PREPARED) and state. Nodes: epoch,
    failover flag, seconds since the last heartbeat, WAL path. Partitions: assignment and the
    node they are open on.
    """
    with contextlib.closing(open_meta(meta_url)) as meta:
        report = cluster_report(meta, include_deleted)
    if as_json:
        emit_json(report)
    else:
        click.echo(format_cluster(report))


# ---- migrate --------------------------------------------------------------------------------------

def check_target(cluster: Cluster, partition: str, node_id: int) -> dict:
    """Refuse a migration that cannot succeed: unknown partition or a target that is not live.
    Returns the partition's current assignment."""
    current = cluster.assignment(partition)
    if current is None:
        known = ", ".join(sorted(cluster.assignments())) or "none"
        raise click.ClickException(f"partition {partition!r} has no assignment (known partitions: {known}); "
                                   "`s3stream streams --meta URL` lists them")
    if node_id not in cluster.live_nodes():
        nodes = {n.node_id: n for n in cluster.meta.list_nodes()}
        why = ("is not registered in the metadata" if node_id not in nodes else
               "was failed over" if nodes[node_id].failover else
               f"has not sent a heartbeat for {(time.time_ns() - nodes[node_id].heartbeat_ns) / 1e9:.1f} s")
        raise click.ClickException(f"node {node_id} {why}: start its StreamClient with a NodeAgent, then "
                                   "migrate again")
    return current


def format_migration(report: MigrationReport) -> str:
    source = "-" if report.source is None else report.source
    lines = [f"Migrated partition {report.partition!r}: node {source} -> node {report.target}",
             f"  seconds       {report.seconds:.3f}",
             f"  tail bytes    {report.tail_bytes:,} (force-uploaded by the source on close)",
             f"  leader epoch  {report.leader_epoch}",
             "  failed over   " + ("yes: the source did not let go in time and was fenced and failed over"
                                    if report.failed_over else "no")]
    return "\n".join(lines)


@main.command()
@click.argument("partition")
@click.argument("node", type=click.IntRange(min=0))
@meta_option
@store_option(required=True)
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=ClusterConfig.migration_timeout,
              show_default=True, metavar="S",
              help="Seconds to wait for the source to let go and for NODE to open the partition.")
@json_option
@user_errors
def migrate(partition: str, node: int, meta_url: str, store_url: str, timeout: float, as_json: bool) -> None:
    """Move PARTITION to node NODE and print the migration report.

    NODE must be running a StreamClient with a NodeAgent (s3stream.cluster.NodeAgent): its agent
    opens the partition once the source's agent has closed it (force-uploading its tail). A
    target that is not live (unknown, failed over, or no heartbeat for 5 s) is refused before
    anything changes. If the source does not let go within --timeout, it is fenced and failed
    over from here, which needs its WAL path (see `s3stream streams`) readable by this process.
    If NODE does not open the partition in time, the command fails (exit 1) and the partition
    stays assigned to NODE.
    """
    # A failover opens the source's WAL with the capacity in its header, whatever it is.
    failover_config = Config(wal=wal.WALConfig(capacity=None))
    with contextlib.closing(open_meta(meta_url)) as meta, contextlib.closing(open_store(store_url)) as store:
        cluster = Cluster(meta, store, engine_config=failover_config)
        current = check_target(cluster, partition, node)
        if current["node"] == node and cluster.owner(partition) == node:
            if as_json:
                emit_json(dict(partition=partition, source=node, target=node, moved=False))
            else:
                click.echo(f"partition {partition!r} is already open on node {node}: nothing to do")
            return
        try:
            report = cluster.migrate(partition, node, timeout=timeout)
        except S3StreamError as e:
            raise click.ClickException(
                f"{e}. Is node {node} running a NodeAgent? The partition stays assigned to node {node} and "
                "opens there once its agent runs; or migrate it to another node.") from e
    if as_json:
        emit_json(dict(vars(report), moved=True))
    else:
        click.echo(format_migration(report))


# ---- balance --------------------------------------------------------------------------------------

class SizeType(click.ParamType):
    """A size or rate in bytes (4096, 512K, 1M, 1.5GiB; binary units, an optional /s), parsed as
    the benchmarks parse sizes."""
    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip()
        try:
            return parse_size(text[:-2] if text.lower().endswith("/s") else text)
        except argparse.ArgumentTypeError as e:
            self.fail(str(e), param, ctx)


SIZE = SizeType()
_BALANCER_DEFAULTS = BalancerConfig()
#: Balancer options -> the BalancerConfig fields each sets (one value for bytes in and out alike).
BALANCER_FIELDS = {
    "max_actions": ("max_actions_per_plan",),
    "deviation_ratio": ("bytes_in_deviation_ratio", "bytes_out_deviation_ratio"),
    "detect_threshold": ("bytes_in_detect_threshold", "bytes_out_detect_threshold"),
    "partition_cap": ("partition_count_cap",),
    "node_cap": ("bytes_in_cap_per_node", "bytes_out_cap_per_node"),
    "interval": ("loop_interval_s",),
}
RECORD_FIX = "record one with `s3stream balance record --meta URL --out FILE`"


def balancer_options(fn: Callable) -> Callable:
    """--exclude and the thresholds of the plan, shared by `balance plan` and `balance run`."""
    d = _BALANCER_DEFAULTS
    options = [
        click.option("--exclude", "excluded", type=click.IntRange(min=0), multiple=True, metavar="NODE",
                     help="Move no partition onto NODE (repeatable); moves off it are allowed."),
        click.option("--max-actions", type=int, default=None, metavar="N",
                     help=f"Most moves in one plan [default: {d.max_actions_per_plan}]."),
        click.option("--deviation-ratio", type=float, default=None, metavar="R",
                     help=f"A node is balanced while its bytes in and out are within mean * (1 +/- R) "
                          f"[default: {d.bytes_in_deviation_ratio}]."),
        click.option("--detect-threshold", type=SIZE, default=None, metavar="SIZE",
                     help="Bytes/s (e.g. 512K, 1M): while the mean node traffic is below it, nodes below it "
                          "count as balanced [default: 1M]."),
        click.option("--partition-cap", type=int, default=None, metavar="N",
                     help=f"Most partitions one node may hold [default: {d.partition_count_cap}]."),
        click.option("--node-cap", type=SIZE, default=None, metavar="SIZE",
                     help="Most bytes/s in (and out) one node may carry, e.g. 800M [default: 0.8G]."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def balancer_config(**values: Any) -> BalancerConfig:
    """The default BalancerConfig with the options given (not None) applied. A value it refuses
    is a usage error naming the option, with BalancerConfig's reason and suggested value."""
    config = _BALANCER_DEFAULTS
    for name, value in values.items():
        if value is None:
            continue
        try:
            config = dataclasses.replace(config, **{field: value for field in BALANCER_FIELDS[name]})
        except ConfigError as e:
            raise click.BadParameter(str(e), param_hint=f"'--{name.replace('_', '-')}'") from None
    return config


def _recording_problem(data: Any) -> str | None:
    """What keeps `data` from being a state written by `balance record`, or None."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def node_id(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(data, dict):
        return f"it holds a JSON {type(data).__name__}, not an object"
    missing = [k for k in ("now", "assignment", "live", "reports") if k not in data]
    if missing:
        return f"it has no {', '.join(map(repr, missing))} (keys found: {', '.join(sorted(data)) or 'none'})"
    if not number(data["now"]):
        return f"'now' must be unix seconds, got {data['now']!r}"
    assignment = data["assignment"]
    if not isinstance(assignment, dict) or not all(node_id(v) for v in assignment.values()):
        return f"'assignment' must map partition names to node ids, got {assignment!r:.120}"
    if not isinstance(data["live"], list) or not all(node_id(v) for v in data["live"]):
        return f"'live' must be a list of node ids, got {data['live']!r:.120}"
    if not isinstance(data["reports"], list) or not all(isinstance(r, dict) for r in data["reports"]):
        return f"'reports' must be a list of load report objects, got {data['reports']!r:.120}"
    return None


def load_recording(path: str) -> dict:
    """The cluster state that `balance record` wrote to `path`; a one-line error naming the file
    and the fix if it cannot be read or is not that shape."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise click.ClickException(f"metrics file {path!r} does not exist; check the path, or {RECORD_FIX}") from None
    except IsADirectoryError:
        raise click.ClickException(f"metrics file {path!r} is a directory; give the file `balance record` "
                                   "wrote") from None
    except OSError as e:
        raise click.ClickException(f"cannot read metrics file {path!r}: {e.strerror or e}") from None
    except ValueError as e:         # JSONDecodeError, UnicodeDecodeError
        raise click.ClickException(f"metrics file {path!r} is not JSON ({e}); {RECORD_FIX}") from None
    problem = _recording_problem(data)
    if problem is not None:
        raise click.ClickException(f"metrics file {path!r} is not a recorded cluster state: {problem}; {RECORD_FIX}")
    return data


def recorded_model(path: str, config: BalancerConfig, excluded: tuple[int, ...]) -> ClusterModel:
    """The model of a recorded state, as the balancer would have seen it at its 'now'."""
    data = load_recording(path)
    try:
        return ClusterModel.from_reports(data["assignment"], data["reports"], now=data["now"], live=data["live"],
                                         excluded=excluded, config=config)
    except S3StreamError as e:
        raise click.ClickException(f"metrics file {path!r}: {e}; fix that report or {RECORD_FIX}") from None


def node_state(node: NodeState) -> str:
    """'ok', or why the balancer treats the node apart: dead, excluded, slow, no metrics."""
    flags = [name for name, on in (("dead", not node.alive), ("excluded", node.excluded), ("slow", node.slow),
                                   ("no metrics", node.metrics_stale)) if on]
    return ", ".join(flags) or "ok"


def node_rows(model: ClusterModel) -> list[dict]:
    rows = []
    for node in model.nodes():
        load = model.node_load(node.node_id)
        rows.append(dict(node=node.node_id, bytes_in_per_s=load.bytes_in_per_s, bytes_out_per_s=load.bytes_out_per_s,
                         partitions=load.partition_count, state=node_state(node), alive=node.alive, slow=node.slow,
                         excluded=node.excluded, metrics_stale=node.metrics_stale))
    return rows


def plan_report(model: ClusterModel, config: BalancerConfig) -> tuple[dict, list[str]]:
    """What `balance plan` prints: node loads before and after the plan and its actions (JSON),
    and one explaining line per action."""
    actions = plan(model, config=config)
    after = model.snapshot()
    for action in actions:
        after.move(action.partition, action.dest)
        if action.swap is not None:         # a swap also moves its partner back to the source
            after.move(action.swap, action.source)
    report = dict(nodes_before=node_rows(model), nodes_after=node_rows(after),
                  actions=[action_to_dict(a, model) for a in actions],
                  imbalance_before=round(imbalance(model), 4), imbalance_after=round(imbalance(after), 4),
                  mean_bytes_in_per_s=model.mean(BYTES_IN), mean_bytes_out_per_s=model.mean(BYTES_OUT))
    return report, [explain_action(a, model) for a in actions]


def format_nodes(rows: list[dict]) -> str:
    return table(["node", "bytes in", "bytes out", "partitions", "state"],
                 [[r["node"], format_rate(r["bytes_in_per_s"]), format_rate(r["bytes_out_per_s"]), r["partitions"],
                   r["state"]] for r in rows])


def why_nothing(report: dict, config: BalancerConfig) -> list[str]:
    """Hints for an empty plan."""
    rows = report["nodes_before"]
    if not any(r["partitions"] for r in rows):
        return ["no partition is assigned"]
    hints = []
    if not any(r["state"] == "ok" for r in rows):
        hints.append("no node can receive a partition (each is dead, excluded, slow or without a fresh metrics "
                     "report)")
    if (report["mean_bytes_in_per_s"] < config.bytes_in_detect_threshold
            and report["mean_bytes_out_per_s"] < config.bytes_out_detect_threshold):
        hints.append(f"the mean node traffic (in {format_rate(report['mean_bytes_in_per_s'])}, out "
                     f"{format_rate(report['mean_bytes_out_per_s'])}) is below the detect threshold "
                     f"({format_rate(config.bytes_in_detect_threshold)}), so nodes below it count as balanced; "
                     "lower it with --detect-threshold")
    return hints


def format_plan(report: dict, lines_of_actions: list[str], config: BalancerConfig) -> str:
    balanced = sum(r["alive"] and not r["excluded"] and not r["metrics_stale"] for r in report["nodes_before"])
    lines = [f"Nodes before: imbalance {report['imbalance_before']:.2f} (max node bytes in / mean "
             f"{format_rate(report['mean_bytes_in_per_s'])} over {balanced} balanced nodes)",
             format_nodes(report["nodes_before"])]
    if not report["actions"]:
        lines.append("Nothing to move: the goals are met, or no move would improve them.")
        lines += [f"  ({hint})" for hint in why_nothing(report, config)]
        return "\n".join(lines)
    lines += [f"Nodes after the plan: imbalance {report['imbalance_after']:.2f}",
              format_nodes(report["nodes_after"]),
              f"Actions ({len(report['actions'])})"]
    lines += [f"  {line}" for line in lines_of_actions]
    return "\n".join(lines)


def entry_line(entry: dict) -> str:
    """One executed action (an entry of Balancer.history or of the last round) and its outcome."""
    try:
        action = Action(entry["partition"], entry["source"], entry["dest"], scores=entry.get("scores") or {},
                        load_change=entry.get("load_change", 0.0), goal=entry.get("goal", ""),
                        score=entry.get("score", NEUTRAL), swap=entry.get("swap"))
        line = explain_action(action)
    except (KeyError, TypeError, ValueError):
        return json.dumps(entry, default=str)
    outcome = entry.get("outcome")
    if outcome == "moved":
        line += f": moved in {entry.get('seconds', 0.0):.2f} s, {entry.get('tail_bytes', 0):,} tail bytes uploaded"
    elif outcome is not None:
        line += f": {outcome}: {entry.get('error', '')}"
    return line


def _kv_json(meta: MetadataStore, key: str) -> Any:
    """The JSON record at `key`, None if absent; an unreadable record becomes {"unreadable": its bytes}."""
    raw = meta.get_kv(key)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return {"unreadable": raw.decode("utf-8", "replace")}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def status_report(meta: MetadataStore) -> dict:
    """The balancer lease, each node's latest load report and the last round, from the metadata."""
    now = time.time()
    lease = _kv_json(meta, LEASE_KEY)
    if isinstance(lease, dict) and _number(lease.get("expires_ns")) is not None:
        lease["expires_in_s"] = round(lease["expires_ns"] / 1e9 - now, 3)
        lease["valid"] = lease["expires_in_s"] > 0
    live = Cluster(meta, store=None).live_nodes()
    reports = {r["node"]: r for r in read_reports(meta) if _number(r.get("node")) is not None}
    nodes = []
    for node in sorted(set(live) | set(reports)):
        r = reports.get(node, {})
        traffic = [t for t in (r.get("partitions") or {}).values() if isinstance(t, dict)]
        at = _number(r.get("at"))
        nodes.append(dict(node=node, live=node in live, report_age_s=None if at is None else round(now - at, 3),
                          window_s=r.get("window_s"), partitions=len(traffic),
                          bytes_in_per_s=sum(_number(t.get("bytes_in")) or 0.0 for t in traffic),
                          bytes_out_per_s=sum(_number(t.get("bytes_out")) or 0.0 for t in traffic),
                          append_p99_ms=r.get("append_p99_ms"), fetch_p99_ms=r.get("fetch_p99_ms")))
    return dict(lease=lease, live_nodes=live, nodes=nodes, last_round=_kv_json(meta, LAST_ROUND_KEY))


def format_lease(lease: Any) -> str:
    if lease is None:
        return "Lease: none (no balancer has run on this cluster)"
    if "expires_in_s" not in lease:
        return f"Lease: unreadable record {json.dumps(lease)[:200]}"
    if lease["valid"]:
        return (f"Lease: held by node {lease.get('holder')}, epoch {lease.get('epoch')}, expires in "
                f"{lease['expires_in_s']:.1f} s ({_iso(lease['expires_ns'])}) unless renewed")
    return (f"Lease: free (last held by node {lease.get('holder')}, epoch {lease.get('epoch')}, "
            f"{'released' if lease['expires_ns'] == 0 else 'expired'} {-lease['expires_in_s']:.1f} s ago): "
            "no balancer leads now")


def format_status(report: dict) -> str:
    def ms(v: Any) -> str:
        return "-" if _number(v) is None else f"{v:.1f} ms"

    lines = [format_lease(report["lease"]),
             f"Nodes ({len(report['live_nodes'])} live; load reports: "
             f"{sum(n['report_age_s'] is not None for n in report['nodes'])})"]
    lines.append(table(["node", "live", "report age", "bytes in", "bytes out", "partitions", "append p99",
                        "fetch p99"],
                       [[n["node"], "yes" if n["live"] else "no",
                         "none" if n["report_age_s"] is None else f"{n['report_age_s']:.1f} s",
                         format_rate(n["bytes_in_per_s"]), format_rate(n["bytes_out_per_s"]), n["partitions"],
                         ms(n["append_p99_ms"]), ms(n["fetch_p99_ms"])] for n in report["nodes"]]))
    last = report["last_round"]
    if not isinstance(last, dict):
        lines.append("Last round: none recorded")
    elif "unreadable" in last:
        lines.append(f"Last round: unreadable record {last['unreadable'][:200]!r}")
    else:
        actions = last.get("actions") or []
        at = _number(last.get("at"))
        when = "-" if at is None else _iso(int(at * 1e9))
        lines.append(f"Last round: leader node {last.get('leader')}, epoch {last.get('epoch')}, at {when}: "
                     f"{len(actions)} actions" + ("" if actions else " (nothing to move)"))
        lines += [f"  {entry_line(e)}" for e in actions if isinstance(e, dict)]
    return "\n".join(lines)


def follow_balancer(balancer: Balancer, running: Callable[[], bool], poll_s: float = 0.1) -> list[dict]:
    """Print each action the balancer executes once its outcome is known, and its lease changes,
    until running() is false (then print what is left). Returns the entries printed."""
    printed: list[dict] = []
    last: dict | None = None
    leading = False
    while True:
        more = running()
        if balancer.is_leader != leading:
            leading = not leading
            click.echo(f"node {balancer.node_id} " + (f"leads the balancer (epoch {balancer.lease.epoch})" if leading
                                                      else "no longer holds the balancer lease"))
        entries = balancer.history.copy()       # one C call: consistent while the loop appends
        start = next((i + 1 for i in range(len(entries) - 1, -1, -1) if entries[i] is last), 0)
        for entry in list(entries)[start:]:
            click.echo(entry_line(entry))
            printed.append(entry)
        if entries:
            last = entries[-1]
        if not more:
            return printed
        time.sleep(poll_s)


def lease_holder_message(meta: MetadataStore, node_id: int) -> str:
    lease = _kv_json(meta, LEASE_KEY) or {}
    expires = _number(lease.get("expires_ns"))
    left = "" if expires is None else f" for another {max(0.0, expires / 1e9 - time.time()):.1f} s"
    return (f"node {node_id} did not get the balancer lease: node {lease.get('holder')} holds it (epoch "
            f"{lease.get('epoch')}){left} and only the leader plans; stop that balancer or wait for its lease "
            "to expire, then run again")


def run_one_round(balancer: Balancer) -> None:
    """One forced round in a worker thread, its actions printed as they complete."""
    outcome: dict[str, Any] = {}

    def round_() -> None:
        try:
            outcome["done"] = balancer.run_once(force=True)
            outcome["leading"] = balancer.is_leader
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = e

    worker = threading.Thread(target=round_, name=f"balance-once-{balancer.node_id}", daemon=True)
    worker.start()
    try:
        follow_balancer(balancer, worker.is_alive)
    except KeyboardInterrupt:
        click.echo("interrupted: no further move starts (a move under way finishes first)", err=True)
        raise
    finally:
        balancer.stop()         # no move starts after this
        worker.join()
        balancer.lease.release()
    if "error" in outcome:
        raise outcome["error"]
    if not outcome["leading"] and not outcome["done"]:
        raise click.ClickException(lease_holder_message(balancer.cluster.meta, balancer.node_id))
    done = outcome["done"]
    if not done:
        click.echo("Nothing to move: the goals are met, or no move would improve them "
                   "(`s3stream balance plan` says why)")
        return
    failed = [e for e in done if e.get("outcome") != "moved"]
    if failed:
        raise click.ClickException(f"{len(failed)} of {len(done)} actions did not complete (see above); "
                                   "`s3stream streams --meta URL` shows where each partition is open")
    click.echo(f"Round done: {len(done)} actions executed")


@main.group()
def balance() -> None:
    """Plan and run the AutoBalancer: partition moves that even out node traffic.

    `plan` and `status` only read; `record` saves the live state to plan on it offline; `run`
    moves partitions.
    """


@balance.command("plan")
@click.option("--meta", "meta_url", envvar="S3STREAM_META", metavar="URL",
              help=META_HELP + " Not needed with --metrics.")
@click.option("--metrics", "metrics_path", metavar="FILE",
              help="Plan on a state saved by `s3stream balance record` (as of its recording) instead of the "
                   "live cluster.")
@balancer_options
@json_option
@user_errors
def balance_plan(meta_url: str | None, metrics_path: str | None, excluded: tuple[int, ...], as_json: bool,
                 **thresholds: Any) -> None:
    """Print the moves the balancer would make now, without making any.

    The state comes from the metadata (assignments, live nodes, the nodes' load reports; nothing
    is written) or, with --metrics, from a recorded file. Text: each node's bytes in/out per
    second, partition count and state before and after the plan (imbalance: max node bytes in /
    mean over the balanced nodes), then one line per move with the goal that proposed it and
    every goal's score. --json: nodes_before, nodes_after, actions, imbalance_before/after.
    """
    config = balancer_config(**thresholds)
    if metrics_path is not None:
        model = recorded_model(metrics_path, config, excluded)
    elif meta_url is not None:
        with contextlib.closing(open_meta(meta_url)) as meta:
            model = live_model(Cluster(meta, store=None), config, excluded)
    else:
        raise click.UsageError("give --meta URL (plan on the live cluster) or --metrics FILE (plan on a state "
                               "saved by `s3stream balance record`)")
    report, lines = plan_report(model, config)
    if as_json:
        emit_json(report)
    else:
        click.echo(format_plan(report, lines, config))


@balance.command("record")
@meta_option
@click.option("--out", "out_path", required=True, metavar="FILE", type=click.Path(dir_okay=False),
              help="Where to write the state (JSON; replaced if it exists).")
@user_errors
def balance_record(meta_url: str, out_path: str) -> None:
    """Save what the balancer plans from (assignments, live nodes, load reports, the time) to
    FILE, to plan on it later with `s3stream balance plan --metrics FILE`."""
    with contextlib.closing(open_meta(meta_url)) as meta:
        cluster = Cluster(meta, store=None)
        assignment = {name: a["node"] for name, a in sorted(cluster.assignments().items())}
        reports = read_reports(meta)
        live = cluster.live_nodes()
    state = dict(now=time.time(), assignment=assignment, live=live, reports=reports)
    # Written aside and renamed: a failed write never leaves a truncated state behind.
    tmp = f"{out_path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, out_path)
    click.echo(f"Recorded {len(assignment)} partitions, {len(live)} live nodes and {len(reports)} load reports "
               f"to {out_path}; plan on it with `s3stream balance plan --metrics {out_path}`")


@balance.command("status")
@meta_option
@json_option
@user_errors
def balance_status(meta_url: str, as_json: bool) -> None:
    """Print who holds the balancer lease (epoch, expiry), each node's latest load report (age,
    traffic, p99 latencies) and the actions of the last round with their outcomes."""
    with contextlib.closing(open_meta(meta_url)) as meta:
        report = status_report(meta)
    if as_json:
        emit_json(report)
    else:
        click.echo(format_status(report))


@balance.command("run")
@meta_option
@store_option(required=True)
@click.option("--node-id", type=click.IntRange(min=0), required=True, metavar="N",
              help="This candidate's id for the lease (unique among balancer candidates).")
@click.option("--interval", type=float, default=None, metavar="S",
              help=f"Seconds between plans while leading [default: {_BALANCER_DEFAULTS.loop_interval_s:g}].")
@click.option("--once", is_flag=True, help="Take the lease, plan and execute one round now, then stop.")
@balancer_options
@metrics_option
@user_errors
def balance_run(meta_url: str, store_url: str, node_id: int, once: bool, excluded: tuple[int, ...],
                metrics_port: int, **thresholds: Any) -> None:
    """Run a balancer candidate in the foreground until Ctrl-C, printing each move it makes.

    Candidates compete for one lease; the holder plans every --interval seconds from the nodes'
    load reports and migrates partitions (nodes must run NodeAgents). A source that does not let
    go in time is failed over from here, which needs its WAL readable by this process. Ctrl-C
    lets the move under way finish and releases the lease. --once: one forced round, exit 1 if
    another candidate holds the lease or a move fails. --metrics-port: the durations of the
    migrations and failovers this candidate ran (s3stream_migration_seconds, _failover_seconds).
    """
    config = balancer_config(**thresholds)
    serve_metrics(metrics_port)
    # A failover opens the source's WAL with the capacity in its header, whatever it is.
    failover_config = Config(wal=wal.WALConfig(capacity=None))
    with contextlib.closing(open_meta(meta_url)) as meta, contextlib.closing(open_store(store_url)) as store:
        balancer = Balancer(Cluster(meta, store, engine_config=failover_config), node_id, config, excluded=excluded)
        if once:
            run_one_round(balancer)
            return
        balancer.start()
        click.echo(f"balancer candidate {node_id} running: plans every {config.loop_interval_s:g} s while it holds "
                   "the lease; Ctrl-C to stop")
        try:
            follow_balancer(balancer, lambda: True)
        except KeyboardInterrupt:
            click.echo("stopping (a move under way finishes first)", err=True)
        finally:
            balancer.stop()
        click.echo(f"stopped: {balancer.moves} moves in {balancer.rounds} rounds")


# ---- mirror ---------------------------------------------------------------------------------------

def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except argparse.ArgumentTypeError as e:
        raise click.BadParameter(str(e)) from e


def mirror_event_line(event: dict) -> str:
    """One line per worker event: `12:00:01 worker 1 started A.orders <- orders: upstream 0, ...`."""
    at = _number(event.get("at"))
    when = "-" if at is None else time.strftime("%H:%M:%S", time.localtime(at))
    line = f"{when} worker {event.get('worker')} {event.get('event')}"
    if event.get("target_partition"):
        line += f" {event['target_partition']}"
        if event.get("source_partition"):
            line += f" <- {event['source_partition']}"
    return line + (f": {event['detail']}" if event.get("detail") else "")


def _ago(seconds: Any) -> str:
    return "-" if _number(seconds) is None else f"{seconds:.1f} s ago"


def format_mirror_status(report: dict) -> str:
    if not report["flows"]:
        return "No mirror flows recorded in this cluster's metadata (KV mirror/...)"
    lines: list[str] = []
    for flow in report["flows"]:
        leader = flow["leader"]
        lead = ("none" if leader is None else
                f"worker {leader['holder']} (epoch {leader['epoch']})" if leader["valid"] else
                f"free (last worker {leader['holder']})")
        live = flow["live_workers"]
        lines.append(f"Flow {flow['flow_id']} from source {flow['source_alias'] or '?'}: "
                     f"{len(flow['partitions'])} partitions, {len(live)} live workers {live or ''}, leader {lead}")
        rows = [[p["target_partition"], p["source_partition"] or "-", p["segments"],
                 "-" if p["mirrored_end"] is None else p["mirrored_end"],
                 "-" if p["mirrored_upstream_end"] is None else p["mirrored_upstream_end"],
                 "free" if p["lease_holder"] is None else f"worker {p['lease_holder']}",
                 "-" if p["running_on"] is None else f"worker {p['running_on']}"] for p in flow["partitions"]]
        if rows:
            lines.append(table(["target", "source", "segments", "mirrored end", "upstream end", "lease", "running"],
                               rows))
        for w in flow["workers"]:
            state = "live" if w["live"] else "silent"
            lines.append(f"  worker {w['worker']}: {state}, record {_ago(w['age_s'])}, {len(w['flows'])} flows"
                         + (", leader" if w["leader"] else ""))
            for target, why in sorted((w.get("waiting") or {}).items()):
                lines.append(f"    {target} waits: {why}")
        if not flow["heartbeats"]:
            lines.append("  Heartbeats: none recorded yet (no leader has written one)")
        for source, hb in flow["heartbeats"].items():
            latency = hb["replication_latency_s"]
            lines.append(f"  Heartbeat from {source}: {_ago(hb['age_s'])}, {hb['flows']} flows, lag "
                         f"{'-' if hb['lag_records'] is None else hb['lag_records']} records, replication latency "
                         f"{'unknown' if latency is None else f'{latency:.2f} s'}")
    return "\n".join(lines)


@main.group()
def mirror() -> None:
    """Mirror every partition of a source cluster into this one (issue 13).

    `run` runs a worker of a flow (several workers share its partitions by leases); `status`
    reads the flows, leases, workers and heartbeats from the target's metadata (nothing written).
    """


@mirror.command("run")
@click.option("--source-meta", "source_meta_url", required=True, metavar="URL", help="The source's metadata URL.")
@click.option("--source-store", "source_store_url", required=True, metavar="URL", help="The source's object store.")
@click.option("--target-meta", "target_meta_url", required=True, metavar="URL",
              help="This (target) cluster's metadata URL.")
@click.option("--target-store", "target_store_url", required=True, metavar="URL",
              help="This (target) cluster's object store.")
@click.option("--alias", "source_alias", required=True, metavar="A",
              help="The source cluster's alias: its partition NAME is mirrored as A.NAME.")
@click.option("--worker-id", type=click.IntRange(min=0), required=True, metavar="N",
              help="This worker's id: its node id in the target cluster, unique among the workers.")
@click.option("--wal-dir", required=True, type=click.Path(file_okay=False), metavar="DIR",
              help="Where the worker's WALs live; restart a crashed worker with the same id and DIR.")
@click.option("--flow", "flow_id", default=None, metavar="ID", help="The flow id [default: A->target].")
@click.option("--interval", type=click.FloatRange(min=0, min_open=True), default=None, metavar="S",
              help="Seconds between the worker's passes (balancing, discovery, keep-alive) [default: 1].")
@click.option("--wal-capacity", callback=_size, default=None, metavar="SIZE",
              help="The target WAL's capacity for a new WAL, e.g. 256M (uploads then happen at least every "
                   "quarter of it) [default: the engine's, 2G].")
@click.option("--upload-interval", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              metavar="S", help="Seconds after which mirrored records are uploaded on the target even if few.")
@metrics_option
@user_errors
def mirror_run(source_meta_url: str, source_store_url: str, target_meta_url: str, target_store_url: str,
               source_alias: str, worker_id: int, wal_dir: str, flow_id: str | None, interval: float | None,
               wal_capacity: int | None, upload_interval: float, metrics_port: int) -> None:
    """Run a mirror worker in the foreground until Ctrl-C, printing its flows' starts and stops.

    The worker claims its share of the source's partitions (leases in the target's metadata),
    copies each into A.NAME on this cluster, and hands partitions over when workers join or
    leave. One worker leads: it writes the heartbeats and translates consumer groups' offsets.
    Ctrl-C stops its flows (each target partition closed), releases its leases and exits.
    --metrics-port: the target node's engine metrics, labelled node=<worker id>.
    """
    from .mirror import MirrorWorker, WorkerConfig
    engine = Config(upload_interval=upload_interval)
    if wal_capacity is not None:
        # A smaller WAL must still hold two upload blocks: scale the block (and what fits in it) down.
        block = min(engine.upload_threshold, max(wal_capacity // 4, 64 * 1024))
        engine = dataclasses.replace(engine, wal=dataclasses.replace(engine.wal, capacity=wal_capacity),
                                     upload_threshold=block, split_size=min(engine.split_size, block),
                                     max_batch_bytes=min(engine.max_batch_bytes, block))
    defaults = WorkerConfig()
    timing = {} if interval is None else dict(interval=interval, lease_ttl=max(defaults.lease_ttl, 3 * interval),
                                              worker_timeout=max(defaults.worker_timeout, 3 * interval))
    config = WorkerConfig(engine=engine, metrics=bool(metrics_port), **timing)
    serve_metrics(metrics_port)
    with contextlib.ExitStack() as stack:
        stores = {name: stack.enter_context(contextlib.closing(opener(url))) for name, url, opener in (
            ("source_meta", source_meta_url, open_meta), ("source_store", source_store_url, open_store),
            ("target_meta", target_meta_url, open_meta), ("target_store", target_store_url, open_store))}
        worker = MirrorWorker(worker_id, source_alias=source_alias, flow_id=flow_id, wal_dir=wal_dir, config=config,
                              on_event=lambda e: click.echo(mirror_event_line(e)), **stores)
        worker.start()
        click.echo(f"mirror worker {worker_id} running flow {worker.flow_id}: {source_alias}.NAME for every source "
                   f"partition NAME, passes every {config.interval:g} s; Ctrl-C to stop")
        try:
            while worker.running:
                time.sleep(0.1)
        except KeyboardInterrupt:
            click.echo("stopping: flows close their target partitions, leases are released", err=True)
        finally:
            final = worker.stop()
        if worker.fatal is not None:
            raise click.ClickException(str(final["errors"][-1] if final["errors"] else worker.fatal))
        click.echo(f"stopped: worker {worker_id} left flow {worker.flow_id}")


@mirror.command("status")
@click.option("--target-meta", "target_meta_url", required=True, metavar="URL",
              help="The target cluster's metadata URL (where the mirror keeps its records).")
@click.option("--flow", "flow_id", default=None, metavar="ID", help="Only this flow [default: every flow recorded].")
@json_option
@user_errors
def mirror_status_command(target_meta_url: str, flow_id: str | None, as_json: bool) -> None:
    """Print each flow's partitions (source partition, offset map segments, mirrored end, lease
    holder, worker running it), its workers (live or silent, what they wait for), its leader and
    the last heartbeat per source with the replication latency it implies. Reads only."""
    from .mirror import mirror_status
    with contextlib.closing(open_meta(target_meta_url)) as meta:
        report = mirror_status(meta, flow_id)
    if as_json:
        emit_json(report)
    else:
        click.echo(format_mirror_status(report))


# ---- bench ----------------------------------------------------------------------------------------

#: The entry point group of the benchmarks `bench --kind` runs (pyproject.toml): each is a callable taking
#: the benchmark's argv, where a leading --quick asks for a short smoke run, and returning its report.
BENCH_GROUP = "s3stream.benchmarks"
INSTALL_FIX = 'install s3stream from its source checkout: pip install -e ".[bench]"'


def benchmark_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The installed benchmarks by name (nothing is imported until one is loaded)."""
    found = importlib.metadata.entry_points(group=BENCH_GROUP)
    return {ep.name: ep for ep in sorted(found, key=lambda ep: ep.name)}


class BenchmarkKind(click.Choice):
    """--kind: one of the benchmarks registered as entry points, looked up when --kind is parsed
    or shown rather than when the CLI is imported."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> Sequence[str]:
        return tuple(benchmark_entry_points())

    @choices.setter
    def choices(self, value: Sequence[str]) -> None:
        """Choice.__init__ sets fixed choices; these come from the entry points instead."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not self.choices:
            raise click.ClickException(f"no benchmarks are registered (entry point group {BENCH_GROUP}): "
                                       f"{INSTALL_FIX}")
        return super().convert(value, param, ctx)


def load_benchmark(kind: str) -> Callable[[list[str]], Any]:
    """The callable registered for benchmark `kind`; a one-line error if it cannot be imported."""
    entry_point = benchmark_entry_points()[kind]
    try:
        entry = entry_point.load()
    except (ImportError, AttributeError) as e:
        raise click.ClickException(f"the {kind} benchmark is not available: {entry_point.value} cannot be loaded "
                                   f"({e}); {INSTALL_FIX}") from None
    if not callable(entry):
        raise click.ClickException(f"the {kind} benchmark is not available: {entry_point.value} is not callable; "
                                   f"{INSTALL_FIX}")
    return entry


def run_benchmark(run: Callable[[list[str]], Any], argv: list[str]) -> None:
    """Run an argparse-based benchmark, turning its exits into click's."""
    try:
        result = run(argv)
    except SystemExit as e:
        if e.code in (None, 0):
            return
        if isinstance(e.code, int):
            raise click.exceptions.Exit(e.code) from None
        raise click.ClickException(str(e.code)) from None
    if isinstance(result, int) and not isinstance(result, bool) and result:
        raise click.exceptions.Exit(result)


@main.command(context_settings=dict(ignore_unknown_options=True),
              short_help="Run the engine, WAL or Spark benchmarks.")
@click.option("--kind", type=BenchmarkKind(), default="spark-throughput", show_default=True,
              help="Which benchmark (see above).")
@click.option("--quick", is_flag=True, help="A short smoke run (seconds; the Spark tests: small sizes) instead "
                                            "of the full benchmark.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Report directory (report.json and PNG plots). Default: the benchmark's own, e.g. "
                   "reports/engine-bench.")
@click.argument("bench_args", nargs=-1, type=click.UNPROCESSED, metavar="[BENCH OPTIONS]...")
@user_errors
def bench(kind: str, quick: bool, out: str | None, bench_args: tuple[str, ...]) -> None:
    """Run a benchmark on embedded defaults; print its results and write its report.

    The default is the main job: the Spark load test, Spark tasks acting as nodes (each its own
    WAL file) over a local object store and SQLite metadata, for 1, 2 and 4 nodes. The kinds are
    the entry points of the group s3stream.benchmarks; those installed with s3stream:

    \b
    spark-throughput  spark_bench: aggregate and per-node MB/s, latency, scaling (needs pyspark, Java)
    spark-migration   spark_bench: partition migration time under load against a copy baseline
    spark-balance     spark_bench: the balancer on a Zipf-skewed 4-node cluster, and after a
                      hot spot moves: imbalance before/after, seconds to balance, moves, lost
    spark-mirror      spark_bench: mirror 16 partitions under load, a worker SIGKILLed, a consumer failover
    engine            s3stream.bench: ingest into 10 and 1,000 streams against WAL-only
                      ingest, small records (128 B-64 KiB) and CPU per GiB against the WAL
                      alone, open-loop append latency, object-store requests per GiB,
                      catch-up and tail reads
    wal               wal.bench: WAL throughput and latency against the raw disk limit
    metadata          s3stream.bench_metadata: metadata operations per second with 10 and
                      100,000 streams (SQLite; PostgreSQL with --start-postgres or --meta URL)

    Other options go to the benchmark itself: `s3stream bench --kind wal --quick --capacity 256M`;
    list them with `s3stream bench --kind wal -- --help`.
    """
    argv = (["--quick"] if quick else []) + (["--out", out] if out else []) + list(bench_args)
    run_benchmark(load_benchmark(kind), argv)


if __name__ == "__main__":
    main()
