"""`s3stream streams`, `s3stream migrate` and `s3stream node`: what the metadata holds (streams,
objects, nodes, partitions), moving a partition to another node, forgetting a lost node and the
failover history."""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter, defaultdict

import click

import wal

from ..cluster import Cluster, ClusterConfig, MigrationReport
from ..cluster.cluster import ForgetReport, can_serve, node_health
from ..config import Config
from ..errors import S3StreamError
from ..metadata import MetadataStore, ObjectState, ObjectType
from .common import emit_json, json_option, meta_option, open_meta, open_store, store_option, table, user_errors


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
                  heartbeat_age_s=round((now - n.heartbeat_ns) / 1e9, 3), wal_path=n.wal_path,
                  serving=can_serve(n), problems=node_health(n).get("problems", []))
             for n in meta.list_nodes()]
    cluster = Cluster(meta, store=None)     # assignment reads touch only the metadata
    partitions = [dict(name=name, assigned_node=a["node"], version=a["version"], open_on=cluster.owner(name),
                       reason=a.get("reason"))
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
    lines.append(table(["id", "epoch", "failover", "heartbeat age", "serving", "WAL"],
                       [[n["node_id"], n["node_epoch"], "yes" if n["failover"] else "no",
                         f"{n['heartbeat_age_s']:.1f} s",
                         "yes" if n["serving"] else "no: " + "; ".join(n["problems"]), n["wal_path"]]
                        for n in report["nodes"]]))
    if report["partitions"]:
        lines.append(f"Partitions ({len(report['partitions'])})")
        lines.append(table(["name", "assigned to", "version", "open on", "why there"],
                           [[p["name"], p["assigned_node"], p["version"], none(p["open_on"]), p["reason"] or "-"]
                            for p in report["partitions"]]))
    return "\n".join(lines)


@click.command()
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


@click.command()
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
            report = cluster.with_close_record(cluster.migrate(partition, node, timeout=timeout))
        except S3StreamError as e:
            raise click.ClickException(
                f"{e}. Is node {node} running a NodeAgent? The partition stays assigned to node {node} and "
                "opens there once its agent runs; or migrate it to another node.") from e
    if as_json:
        emit_json(dict({f.name: getattr(report, f.name) for f in dataclasses.fields(report) if f.repr}, moved=True))
    else:
        click.echo(format_migration(report))


# ---- node: forget, history -------------------------------------------------------------------------

@click.group()
def node() -> None:
    """Operate on nodes: give up a lost one, list failovers."""


def format_forget(report: ForgetReport) -> str:
    lines = [f"Forgot node {report.node_id}: fenced at epoch {report.fenced_epoch}; {len(report.streams)} streams "
             "it held are closed"]
    rows = [[f.stream_id, f.partition or "-", f.committed_end,
             f"[{f.committed_end}, {f.given_up_end})" if f.given_up else "-", f"{f.given_up:,}"]
            for f in report.streams]
    if rows:
        lines.append(table(["stream", "partition meta of", "committed end", "offsets given up", "count"], rows))
    lost = [f for f in report.streams if f.given_up]
    lines.append(f"  {len(lost)} streams resume above offsets the node may have acknowledged; what its lost WAL "
                 "held there is gone (reads there raise OffsetsLostError)" if lost else
                 "  no stream gives up any offset")
    for name, target in sorted(report.reassigned.items()):
        lines.append(f"  partition {name!r} -> node {target}")
    return "\n".join(lines)


@node.command()
@click.argument("node_id", metavar="NODE", type=click.IntRange(min=0))
@click.option("--wal-lost", is_flag=True, required=True,
              help="Required: say that NODE's WAL is gone with its host (what it had not uploaded is lost).")
@meta_option
@click.option("--reason", default="its host and WAL were lost", show_default=True, help="Recorded in the history.")
@json_option
@user_errors
def forget(node_id: int, wal_lost: bool, meta_url: str, reason: str, as_json: bool) -> None:
    """Give up NODE, whose host died with its WAL: fence it, close every stream it held without
    the data only its WAL had, and reassign its partitions to live nodes.

    Each stream resumes above every offset NODE could have acknowledged (nodes reserve offsets
    in metadata before taking them), so no acknowledged offset ever holds another record; the
    offsets skipped are printed per stream and recorded in the failover history. Use it only when
    the WAL cannot come back: a node whose WAL is readable is failed over without losing anything
    (its peers do that by themselves).
    """
    with contextlib.closing(open_meta(meta_url)) as meta:
        if node_id not in {n.node_id for n in meta.list_nodes()}:
            raise click.ClickException(f"node {node_id} is not registered in the metadata; `s3stream streams` "
                                       "lists the nodes")
        report = Cluster(meta, store=None).forget(node_id, wal_lost=wal_lost, reason=reason)
    if as_json:
        emit_json(dict(node_id=report.node_id, fenced_epoch=report.fenced_epoch, reassigned=report.reassigned,
                       streams=[dict(vars(f), given_up=f.given_up) for f in report.streams]))
    else:
        click.echo(format_forget(report))


@node.command()
@meta_option
@json_option
@user_errors
def history(meta_url: str, as_json: bool) -> None:
    """List every failover, migration fallback and forget (oldest first): who judged whom, why,
    and what was replayed or given up."""
    with contextlib.closing(open_meta(meta_url)) as meta:
        entries = Cluster(meta, store=None).failover_history()
    if as_json:
        emit_json(entries)
        return
    rows = [[time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e["at_ns"] / 1e9)), e["kind"], e["node"],
             e.get("node_epoch", "-"), "-" if e.get("judge") is None else e["judge"],
             "yes" if e.get("ok") else "no",
             e.get("replayed", sum(s["given_up"][1] - s["given_up"][0] for s in e.get("streams", []))),
             e.get("reason") if e.get("ok") else f"{e.get('reason')}: {e.get('error')}"]
            for e in entries]
    click.echo(f"Failover history ({len(entries)})")
    click.echo(table(["at (UTC)", "kind", "node", "epoch", "judge", "ok", "replayed/given up", "reason"], rows))
