"""`s3stream inspect wal|object` and `s3stream wal-salvage`: look inside a WAL (a file, or a WAL
of objects) or an object (read only), and keep the records after a corrupt span of a WAL."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable, Iterator
from urllib.parse import unquote, urlsplit

import click

import wal
from _native import objcodec
from wal import objectinspect

from ..errors import ObjectNotFoundError, S3StreamError
from ..metadata import ObjectMeta
from ..objectformat import FOOTER_SIZE, IndexEntry, read_blocks, read_index
from ..objectstore import LocalObjectStore, ObjectStore
from ..engine.recovery import WAL_RECORD
from ..engine.walopen import OBJECTS_PREFIX, is_object_wal
from ..engine.walopen import open_store as open_wal_store
from .common import META_HELP, emit_json, iso_time, json_option, open_meta, open_store, store_option, table, user_errors


@click.group()
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


class _Summary:
    """What a scan of WAL records found: the span of offsets, per-stream figures and (if kept)
    every record's row."""

    def __init__(self, keep_records: bool) -> None:
        self.keep = keep_records
        self.rows: list[dict] = []
        self.streams: dict[int, dict] = {}
        self.first: int | None = None
        self.last_end: int | None = None

    def add(self, records: Iterable[wal.Record]) -> None:
        for record in records:
            row = describe_record(record)
            self.first = record.offset if self.first is None else self.first
            self.last_end = record.end
            if self.keep:
                self.rows.append(row)
            if "stream_id" in row:
                s = self.streams.setdefault(row["stream_id"], dict(records=0, bytes=0, epochs=set(),
                                                                   first_offset=row["base_offset"]))
                s["records"] += 1
                s["bytes"] += row["payload_bytes"]
                s["epochs"].add(row["epoch"])
                s["end_offset"] = row["base_offset"] + row["count"]

    def stream_rows(self) -> list[dict]:
        return [dict(stream_id=sid, epochs=sorted(s["epochs"]), **{k: v for k, v in s.items() if k != "epochs"})
                for sid, s in sorted(self.streams.items())]


def scan_wal(path: str, header: wal.Header, keep_records: bool) -> dict:
    """Recover the WAL read-only (recovery=True opens the file O_RDONLY: nothing is written)."""
    summary = _Summary(keep_records)
    error = None
    with wal.WriteAheadLog.open(path, node_id=header.node_id, node_epoch=header.node_epoch,
                                recovery=True) as w:
        try:
            summary.add(w.recover())
        except wal.WALCorruptError as e:    # a clean WAL that cannot be read to its end
            error = str(e)
        result = w.recovery_result
        assert result is not None       # set when the scan ends, before any WALCorruptError it raises
        info = dict(path=path, direct_io=w.direct_io, block_device=w.is_block_device, data_capacity=w.capacity)
    recovery = dict(records=result.records, bytes=result.record_bytes, first_offset=summary.first,
                    end_offset=summary.last_end, end=result.end, stop_reason=result.stop_reason, error=error)
    return dict(info=info, recovery=recovery, streams=summary.stream_rows(),
                records=summary.rows if keep_records else None)


def header_dict(header: wal.Header, states: tuple[str, str]) -> dict:
    return dict(node_id=header.node_id, node_epoch=header.node_epoch, generation=header.generation,
                capacity=header.capacity, trim_offset=header.trim_offset, clean_shutdown=header.clean_shutdown,
                clean_end=header.clean_end, write_seq=header.write_seq, write_time_ns=header.write_time_ns,
                slots=list(states))


def _streams_and_records(report: dict) -> list[str]:
    lines = []
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
    return lines


def format_wal(report: dict) -> str:
    if report.get("kind") == "objects":
        return format_object_wal(report)
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
        f"  write seq       {h['write_seq']} at {iso_time(h['write_time_ns'])} (slots: {', '.join(h['slots'])})",
        "Recovery (read-only scan)",
        f"  valid records   {rec['records']:,} ({rec['bytes']:,} bytes)",
        f"  offsets         {span}; a new writer session resumes at {rec['end']}",
        f"  stopped at      {rec['stop_reason']}",
    ]
    return "\n".join(lines + _streams_and_records(report))


# ---- inspect wal: a WAL of objects ---------------------------------------------------------------

def _check_wal_store(location: str) -> None:
    """A WAL of objects on a local directory must exist: opening it would create it, and hide
    a mistyped path."""
    inner = location[len(OBJECTS_PREFIX):] if location.startswith(OBJECTS_PREFIX) else location
    parts = urlsplit(inner)
    path = unquote(parts.path) if parts.scheme.lower() == "file" else inner if "://" not in inner else None
    if path is not None and not os.path.isdir(path):
        raise click.ClickException(f"no WAL directory at {path!r} (from WAL URL {location!r}); check the path")


def _which_node(store: ObjectStore, location: str, node_id: int | None) -> int:
    found = objectinspect.wal_nodes(store)
    if node_id is not None:
        if node_id not in found:
            raise click.ClickException(f"{location} holds no WAL objects of node {node_id} (it has nodes "
                                       f"{', '.join(map(str, found)) or 'none'}); check --node-id")
        return node_id
    if len(found) == 1:
        return found[0]
    if not found:
        raise click.ClickException(f"{location} holds no WAL objects (no node-N/ keys); check the URL and its prefix")
    raise click.ClickException(f"{location} holds the WALs of nodes {', '.join(map(str, found))}: pick one with "
                               "--node-id N")


def scan_object_wal(store: ObjectStore, location: str, node_id: int | None, keep_records: bool) -> dict:
    """A node's WAL of objects as recovery would read it, reading only (wal.objectinspect: no
    fence, no hole, no delete), so the node, if it runs, goes on undisturbed."""
    node = _which_node(store, location, node_id)
    log = objectinspect.snapshot(store, node)
    summary = _Summary(keep_records)
    result = objectinspect.ScanResult()
    summary.add(objectinspect.records(store, log, result))
    fence = log.fence
    info = dict(location=location, where=log.where, node_id=node, counts=log.counts(),
                bytes=sum(size for _, size, _ in log.objects),
                fence=None if fence is None else dict(seq=fence.seq, generation=fence.generation,
                                                      node_epoch=fence.node_epoch),
                trim=log.trim, trim_seq=log.trim_seq, last=None if log.last == objectinspect.NO_SEQ else log.last,
                chain=[h.seq for h in log.chain], stopped_at=log.stopped_at, stop_reason=log.stop_reason)
    objects = [dict(seq=seq, size=size, kind=objectinspect.KIND_NAMES[h.kind] if h else "other",
                    generation=h.generation if h else None, node_epoch=h.node_epoch if h else None,
                    prev=None if h is None or h.prev == objectinspect.NO_SEQ else h.prev,
                    start=h.start if h else None, end=h.end if h else None)
               for seq, size, h in log.objects]
    recovery = dict(records=result.records, bytes=result.record_bytes, first_offset=summary.first,
                    end_offset=summary.last_end, end=result.end, error=result.error,
                    stop_reason=result.error or "end of the log's objects")
    return dict(kind="objects", info=info, objects=objects, recovery=recovery, streams=summary.stream_rows(),
                records=summary.rows if keep_records else None)


def format_object_wal(report: dict) -> str:
    info, rec = report["info"], report["recovery"]
    counts = info["counts"]
    fence = info["fence"]
    chain = info["chain"]
    span = "none" if rec["first_offset"] is None else f"[{rec['first_offset']}, {rec['end_offset']})"
    session = ("none (no session opened this log)" if fence is None else
               f"fence at object {fence['seq']}, generation {fence['generation']}, written at node epoch "
               f"{fence['node_epoch']} (a peer's recovery writes 0)")
    lines = [
        f"WAL of objects {info['where']} (read only: no fence, no hole, no delete)",
        f"  node            {info['node_id']}",
        f"  objects         {sum(counts.values())} ({counts['data']} data, {counts['fence']} fences, "
        f"{counts['hole']} holes, {counts['other']} other), {info['bytes']:,} bytes",
        f"  newest session  {session}",
        f"  trim            offset {info['trim']} (objects below {info['trim_seq']} hold only trimmed records)",
        f"  log             {len(chain)} data objects" + (f" [{chain[0]} .. {chain[-1]}]" if chain else "")
        + f"; its newest session ends at {info['stop_reason']}",
        "Recovery (read-only scan)",
        f"  valid records   {rec['records']:,} ({rec['bytes']:,} bytes)",
        f"  offsets         {span}; a new session resumes at {rec['end']}",
        f"  stopped at      {rec['stop_reason']}",
    ]
    if report.get("list_objects"):
        lines.append(f"Objects ({len(report['objects'])})")
        lines.append(table(["seq", "kind", "size", "generation", "epoch", "prev", "offsets"],
                           [[o["seq"], o["kind"], o["size"], o["generation"], o["node_epoch"],
                             "-" if o["prev"] is None else o["prev"],
                             f"[{o['start']}, {o['end']})" if o["kind"] == "data" else "-"]
                            for o in report["objects"]]))
    return "\n".join(lines + _streams_and_records(report))


class WALLocation(click.ParamType):
    """A WAL file (it must exist and not be a directory) or the URL of a WAL of objects."""
    name = "PATH|URL"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        if isinstance(value, str) and is_object_wal(value):
            return value
        return os.fsdecode(click.Path(exists=True, dir_okay=False).convert(value, param, ctx))


@inspect.command("wal")
@click.argument("path", metavar="PATH|URL", type=WALLocation())
@click.option("--node-id", type=click.IntRange(min=0), metavar="N",
              help="The node the WAL should belong to: fail if its header names another. Default: the "
                   "node in the header; for a WAL of objects, the one node under the URL.")
@click.option("--records", "list_records", is_flag=True,
              help="List every valid record: offset, length and its stream header (stream, epoch, base "
                   "offset, count).")
@click.option("--objects", "list_objects", is_flag=True,
              help="A WAL of objects: list each object (sequence, kind, size, generation, node epoch, link, "
                   "offsets).")
@json_option
@user_errors
def inspect_wal(path: str, node_id: int | None, list_records: bool, list_objects: bool, as_json: bool) -> None:
    """Print a WAL's header and what recovery would read from it.

    PATH is a WAL file or block device, opened read-only, the way a failover reads a dead node's
    WAL. A URL is a WAL of objects (s3://bucket/prefix?..., objects+file:///dir: what a node's
    wal_path names; `s3stream streams` lists them): its objects are listed and read, and nothing
    is written there (a failover's open would write a fence that stops the node). Either way
    this never modifies the WAL and works on any node's; on a running node's it shows a
    snapshot. Exits 1 if the WAL is corrupt (after the summary).
    """
    if is_object_wal(path):
        _check_wal_store(path)
        store, owned, _ = open_wal_store(path)
        try:
            report = scan_object_wal(store, path, node_id, list_records)
        finally:
            if owned:
                store.close()
        report["list_objects"] = list_objects
        if as_json:
            emit_json(report)
        else:
            click.echo(format_object_wal(report))
        if report["recovery"]["error"]:
            raise click.ClickException(report["recovery"]["error"])
        return
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


@click.command("wal-salvage")
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

def resolve_object_id(target: str, meta_url: str | None, store_url: str | None) -> ObjectMeta | None:
    """The metadata of object `target` if it is an object id (digits) to resolve through the
    metadata at `meta_url`; None if `target` is a path or a key. An id without --meta, or
    without --store to read it from, is refused with what to pass."""
    if not target.isdigit() or (meta_url is None and (store_url is None and os.path.exists(target))):
        return None
    if meta_url is None:
        raise click.ClickException(f"{target!r} looks like an object id: pass --meta URL to find its key (and "
                                   "--store URL to read it), or give its key with --store, or an object file")
    with contextlib.closing(open_meta(meta_url)) as meta:
        try:
            found = meta.get_object(int(target))
        except S3StreamError as e:
            raise click.ClickException(f"object {target} is not in the metadata ({e}); `s3stream streams --objects "
                                       "--meta URL` lists the object ids") from None
    if store_url is None:
        raise click.ClickException(f"object {target} is {found.key} ({found.state.value}): pass --store URL, the "
                                   "object store the cluster writes to, to read it")
    return found


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
    meta = report.get("metadata")
    if meta is not None:
        where = (f"{meta['object_id']} ({meta['state']} {meta['type'] or '-'}"
                 + (f" of node {meta['node_id']}" if meta["node_id"] is not None else "") + f"): {where}")
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
@click.argument("target", metavar="PATH|KEY|ID")
@store_option(required=False, help="Read KEY (or object ID) from this object store (file:///dir, a directory, "
                                   "s3://bucket/prefix?...; env S3STREAM_STORE). Without it, PATH is a local object "
                                   "file.")
@click.option("--meta", "meta_url", envvar="S3STREAM_META", metavar="URL",
              help="Resolve an object ID (as `s3stream streams --objects` prints it) to its key through this "
                   "metadata. " + META_HELP)
@click.option("--verify", is_flag=True, help="Decode every block and check its CRC and offsets against the "
                                             "index; exit 1 if any block is corrupt.")
@json_option
@user_errors
def inspect_object(target: str, store_url: str | None, meta_url: str | None, verify: bool, as_json: bool) -> None:
    """Print an object's size, footer and index entries.

    PATH|KEY|ID is a local object file (e.g. objects/ab12/0000000000000007.obj), or with --store
    a key in that store, or with --meta and --store an object id (its key is read from the
    metadata; `s3stream streams --objects` lists the ids). Index entries: stream, offsets
    [start, end), records, and where the block is. A corrupt footer or index is an error (exit 1).
    """
    resolved = resolve_object_id(target, meta_url, store_url)
    with object_location(resolved.key if resolved else target, store_url) as (store, key, path):
        try:
            size = store.size(key)
        except ValueError as e:     # a key the store cannot hold, e.g. with '..' segments
            raise click.ClickException(f"invalid object key {key!r}: {e}") from None
        except ObjectNotFoundError as e:
            if resolved is None:
                raise
            raise click.ClickException(f"object {resolved.object_id} ({resolved.state.value} in the metadata) is not "
                                       f"in {store.url} as {key}: {e}. Is --store the cluster's object store?"
                                       ) from None
        footer = read_footer(store, key, size)
        index = read_index(store, key, size)
        report: dict[str, Any] = dict(path=path, store=None if path else store.url, key=key, size=size,
                                      footer=footer,
                                      index=[e._asdict() for e in index])
        if resolved is not None:
            report["metadata"] = dict(object_id=resolved.object_id, state=resolved.state.value,
                                      type=resolved.type.value if resolved.type else None, node_id=resolved.node_id,
                                      size=resolved.size)
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
