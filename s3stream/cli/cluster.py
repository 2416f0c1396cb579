"""`s3stream streams`, `s3stream migrate` and `s3stream node`: what the metadata holds (streams,
objects, nodes, partitions), moving a partition to another node, failing a dead node over,
forgetting a lost one and the failover history."""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter, defaultdict

import click

import wal

from ..cluster import Cluster, ClusterConfig, MigrationReport
from ..cluster.cluster import FailoverOutcome, ForgetReport, can_serve, node_health
from ..cluster.partition import PARTITION_KV_PREFIX
from ..config import Config
from ..errors import ConfigError, NodeAliveError, S3StreamError
from ..metadata import MetadataStore, NodeMeta, ObjectState, ObjectType, StreamMeta, StreamState
from ..engine.walopen import readable_here
from .common import emit_json, json_option, meta_option, open_meta, open_store, store_option, table, user_errors


# ---- streams --------------------------------------------------------------------------------------

def _when(ns: int | None) -> str:
    return "-" if not ns else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ns / 1e9))


def node_state(node: NodeMeta, now_ns: int, heartbeat_timeout: float, held: int,
               given_up: dict | None) -> tuple[str, str]:
    """(state, why) of a node from the metadata: `held` streams OPENED on it, `given_up` the
    history entry of the failover or forget that fenced it into its current epoch (if kept).
    What a heartbeat last said is only believed while it is fresh: a node that closed or died
    says nothing more."""
    age = (now_ns - node.heartbeat_ns) / 1e9
    if node.walless:
        return "walless", f"a writer without a WAL ({node.wal_path}): never heartbeats, nothing to fail over"
    if node.failover:
        if given_up is not None:
            by = "" if given_up.get("judge") is None else f" by node {given_up['judge']}"
            kind = given_up.get("kind", "failover")
            state = "forgotten" if kind == "forget" else "failed over"
            return state, f"{kind}{by} at {_when(given_up.get('at_ns'))}: {given_up.get('reason')}"
        if held:
            return "fenced", (f"fenced with no failover recorded, and it still holds {held} streams open: "
                              f"`s3stream node fail-over {node.node_id}`")
        return "retired", "left the cluster (closed with retire=True, or fenced) holding no stream"
    if age < heartbeat_timeout:
        if can_serve(node):
            return "serving", "-"
        return "cannot serve", "; ".join(node_health(node).get("problems", [])) or "its heartbeat says so"
    if not held:
        return "closed", f"no heartbeat for {age:.1f} s and it holds no stream open: it closed (or stopped empty)"
    return "silent", (f"no heartbeat for {age:.1f} s and it holds {held} streams open: its peers fail it over, or "
                      f"`s3stream node fail-over {node.node_id}`")


def partition_state(meta_stream: StreamMeta | None) -> tuple[int | None, str]:
    """(the node it is open on, its state) from its meta stream in metadata: a partition's
    streams open and close in one transaction, so the meta stream's state is theirs."""
    if meta_stream is None:
        return None, "never opened"
    if meta_stream.state == StreamState.OPENED:
        return meta_stream.owner_node_id, "open"
    return None, meta_stream.state.value.lower()


def cluster_report(meta: MetadataStore, include_deleted: bool,
                   heartbeat_timeout: float = ClusterConfig.heartbeat_timeout, with_objects: bool = False) -> dict:
    """Streams, object totals, nodes and partitions, from the metadata only; with
    `with_objects`, every object (id, key, type, state, size, stream ranges) too."""
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
    listed = meta.list_streams(include_deleted=True)
    streams = [dict(stream_id=m.stream_id, state=m.state.value, epoch=m.epoch, owner_node_id=m.owner_node_id,
                    start_offset=m.start_offset, end_offset=m.end_offset, ranges=len(m.ranges),
                    stream_objects=stream_objects[m.stream_id], stream_set_objects=set_objects[m.stream_id])
               for m in listed if include_deleted or m.state != StreamState.DELETED]
    held = Counter(m.owner_node_id for m in listed if m.state == StreamState.OPENED)
    cluster = Cluster(meta, store=None)     # reads that touch only the metadata
    given_up = cluster.given_up()
    now = time.time_ns()
    nodes = []
    for n in meta.list_nodes():
        state, why = node_state(n, now, heartbeat_timeout, held[n.node_id], given_up.get((n.node_id, n.node_epoch)))
        nodes.append(dict(node_id=n.node_id, node_epoch=n.node_epoch, failover=n.failover, state=state, why=why,
                          heartbeat_age_s=round((now - n.heartbeat_ns) / 1e9, 3), wal_path=n.wal_path,
                          serving=state == "serving", open_streams=held[n.node_id],
                          problems=node_health(n).get("problems", []) if state == "cannot serve" else []))
    by_id = {m.stream_id: m for m in listed}
    meta_streams = {}
    for key, raw in meta.list_kv(PARTITION_KV_PREFIX).items():
        try:
            meta_streams[key[len(PARTITION_KV_PREFIX):]] = int(raw)
        except ValueError:
            continue
    partitions = []
    for name, a in sorted(cluster.assignments().items()):
        meta_id = meta_streams.get(name)
        open_on, state = partition_state(by_id.get(meta_id) if meta_id is not None else None)
        partitions.append(dict(name=name, assigned_node=a["node"], version=a["version"], open_on=open_on,
                               state=state, meta_stream=meta_id, reason=a.get("reason")))
    report = dict(streams=streams,
                  objects=[dict(type=k[0], state=k[1], count=v[0], bytes=v[1]) for k, v in sorted(totals.items())],
                  nodes=nodes, partitions=partitions)
    if with_objects:
        report["object_list"] = [
            dict(object_id=o.object_id, key=o.key, type=o.type.value if o.type is not None else None,
                 state=o.state.value, size=o.size, node_id=o.node_id,
                 ranges=[[r.stream_id, r.start_offset, r.end_offset] for r in o.ranges])
            for o in sorted(objects, key=lambda o: o.object_id)]
    return report


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
    if "object_list" in report:
        lines.append(f"Objects by id ({len(report['object_list'])}; `s3stream inspect object ID --meta URL --store "
                     "URL` reads one)")
        lines.append(table(["id", "key", "type", "state", "size", "node", "streams [start, end)"],
                           [[o["object_id"], o["key"], none(o["type"]), o["state"], f"{o['size']:,}",
                             none(o["node_id"]),
                             " ".join(f"{sid}:[{lo}, {hi})" for sid, lo, hi in o["ranges"]) or "-"]
                            for o in report["object_list"]]))
    lines.append(f"Nodes ({len(report['nodes'])})")
    lines.append(table(["id", "epoch", "state", "heartbeat age", "open streams", "WAL", "why"],
                       [[n["node_id"], n["node_epoch"], n["state"], f"{n['heartbeat_age_s']:.1f} s",
                         n["open_streams"], n["wal_path"], n["why"]]
                        for n in report["nodes"]]))
    if report["partitions"]:
        lines.append(f"Partitions ({len(report['partitions'])})")
        lines.append(table(["name", "assigned to", "version", "state", "open on", "why there"],
                           [[p["name"], p["assigned_node"], p["version"], p["state"], none(p["open_on"]),
                             p["reason"] or "-"]
                            for p in report["partitions"]]))
    return "\n".join(lines)


@click.command()
@meta_option
@click.option("--all", "include_deleted", is_flag=True, help="Include DELETED streams.")
@click.option("--objects", "with_objects", is_flag=True,
              help="List every object too: its id (what `s3stream inspect object ID --meta URL` takes), key, type, "
                   "state, size and the stream ranges it holds.")
@click.option("--heartbeat-timeout", type=click.FloatRange(min=0, min_open=True),
              default=ClusterConfig.heartbeat_timeout, show_default=True, metavar="S",
              help="The cluster's ClusterConfig.heartbeat_timeout: a node whose last heartbeat is older is not "
                   "taken at its word.")
@json_option
@user_errors
def streams(meta_url: str, include_deleted: bool, with_objects: bool, heartbeat_timeout: float,
            as_json: bool) -> None:
    """List streams, objects, nodes and partitions from the metadata.

    Streams: id, state, epoch, owner node, start/end offsets (end = committed to objects),
    number of ranges (one per open), StreamObjects (SOs) and StreamSetObjects holding it.
    Objects: count and bytes by type (SO, SSO; '-' while PREPARED) and state; with --objects,
    each one by id. Nodes: epoch, state (serving, cannot serve, silent, closed, failed over,
    forgotten, retired) and why, from the last heartbeat while it is fresh, the streams it
    holds open and the failover history; WAL path. Partitions: assignment, and whether and
    where they are open by their streams' state.
    """
    with contextlib.closing(open_meta(meta_url)) as meta:
        report = cluster_report(meta, include_deleted, heartbeat_timeout, with_objects)
    if as_json:
        emit_json(report)
    else:
        click.echo(format_cluster(report))


# ---- migrate --------------------------------------------------------------------------------------

def _timing(heartbeat_timeout: float) -> ClusterConfig:
    """The cluster's timing as far as a command judges a node by it: its heartbeat timeout,
    read at most every half second (the failure detector counts silence only between reads at
    most two heartbeat intervals apart)."""
    try:
        return ClusterConfig(heartbeat_timeout=heartbeat_timeout,
                             heartbeat_interval=min(ClusterConfig.heartbeat_interval, heartbeat_timeout / 4))
    except ConfigError as e:
        raise click.ClickException(f"--heartbeat-timeout {heartbeat_timeout}: {e}") from e


def check_target(cluster: Cluster, partition: str, node_id: int) -> dict:
    """Refuse a migration that cannot succeed: unknown partition or a target that is not live.
    Returns the partition's current assignment."""
    current = cluster.assignment(partition)
    if current is None:
        known = ", ".join(sorted(cluster.assignments())) or "none"
        raise click.ClickException(f"partition {partition!r} has no assignment (known partitions: {known}); "
                                   "`s3stream streams --meta URL` lists them")
    if node_id not in cluster.live_nodes(serving=True):
        nodes = {n.node_id: n for n in cluster.meta.list_nodes()}
        if node_id in nodes and node_id in cluster.live_nodes():
            problems = "; ".join(node_health(nodes[node_id]).get("problems", [])) or "its heartbeat says so"
            raise click.ClickException(f"node {node_id} cannot serve ({problems}): it takes no partition until it "
                                       "can; migrate to another node (`s3stream streams --meta URL` shows them)")
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
             "  failed over   " + ("yes: the source did not let go in time and was silent, so it was fenced and "
                                    "failed over" if report.failed_over else "no")]
    return "\n".join(lines)


@click.command()
@click.argument("partition")
@click.argument("node", type=click.IntRange(min=0))
@meta_option
@store_option(required=True)
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=ClusterConfig.migration_timeout,
              show_default=True, metavar="S",
              help="Seconds to wait for the source to let go and for NODE to open the partition.")
@click.option("--heartbeat-timeout", type=click.FloatRange(min=0, min_open=True),
              default=ClusterConfig.heartbeat_timeout, show_default=True, metavar="S",
              help="The cluster's ClusterConfig.heartbeat_timeout: how long a source that holds on must be silent, "
                   "counted here, to be failed over.")
@json_option
@user_errors
def migrate(partition: str, node: int, meta_url: str, store_url: str, timeout: float, heartbeat_timeout: float,
            as_json: bool) -> None:
    """Move PARTITION to node NODE and print the migration report.

    NODE must be running a StreamClient with a NodeAgent (s3stream.cluster.NodeAgent): its agent
    opens the partition once the source's agent has closed it (force-uploading its tail). A
    target that is not live (unknown, failed over, no heartbeat for 5 s) or says it cannot serve
    is refused before anything changes. If the source still holds the partition after --timeout
    and sent no heartbeat for the heartbeat timeout (counted here while it waited), it is fenced
    and failed over from here, which needs its WAL (see `s3stream streams`) readable by this
    process; a source that is alive is never failed over by a migration (exit 1, naming it:
    `s3stream node fail-over NODE --force` does it on purpose). If NODE does not open the
    partition in time, the command fails (exit 1) and the partition stays assigned to NODE.
    """
    # A failover opens the source's WAL with the capacity in its header, whatever it is.
    failover_config = Config(wal=wal.WALConfig(capacity=None))
    config = _timing(heartbeat_timeout)
    with contextlib.closing(open_meta(meta_url)) as meta, contextlib.closing(open_store(store_url)) as store:
        cluster = Cluster(meta, store, config, engine_config=failover_config)
        current = check_target(cluster, partition, node)
        if current["node"] == node and cluster.owner(partition) == node:
            if as_json:
                emit_json(dict(partition=partition, source=node, target=node, moved=False))
            else:
                click.echo(f"partition {partition!r} is already open on node {node}: nothing to do")
            return
        try:
            report = cluster.with_close_record(cluster.migrate(partition, node, timeout=timeout))
        except NodeAliveError:
            raise                           # its message says what holds the partition and what to do
        except S3StreamError as e:
            raise click.ClickException(
                f"{e}. Is node {node} running a NodeAgent? The partition stays assigned to node {node} and "
                "opens there once its agent runs; or migrate it to another node.") from e
    if as_json:
        emit_json(dict({f.name: getattr(report, f.name) for f in dataclasses.fields(report) if f.repr}, moved=True))
    else:
        click.echo(format_migration(report))


# ---- node: fail-over, forget, history --------------------------------------------------------------

@click.group()
def node() -> None:
    """Operate on nodes: drain one, fail a dead one over, give up a lost one, list failovers."""


def _partition_names(meta: MetadataStore) -> dict[int, str]:
    """Meta stream id -> its partition's name."""
    out = {}
    for key, raw in meta.list_kv(PARTITION_KV_PREFIX).items():
        try:
            out[int(raw)] = key[len(PARTITION_KV_PREFIX):]
        except ValueError:
            continue
    return out


def _placement_lines(node_id: int, reassigned: dict[str, int], waiting: list[str], gone: str) -> list[str]:
    lines = [f"  partition {name!r} -> node {target}" for name, target in sorted(reassigned.items())]
    if waiting:
        names = ", ".join(repr(n) for n in waiting)
        one = len(waiting) == 1
        lines.append(f"  partition{'' if one else 's'} {names} wait{'s' if one else ''}: no live node could take "
                     f"{'it' if one else 'them'}, so {'it stays' if one else 'they stay'} assigned to node {node_id} "
                     f"({gone}) and {'serves' if one else 'serve'} nowhere. "
                     f"{'It moves by itself' if one else 'They move by themselves'} to a node that can serve as soon "
                     "as one runs its NodeAgent (start one); or move it with `s3stream migrate PARTITION NODE` once "
                     "NODE runs")
    return lines


def _previous_line(node_id: int, previous: dict | None, what: str) -> str:
    if previous is None:
        return (f"Node {node_id} was already given up (it retired, or the record of its failover is no longer "
                f"kept): nothing to {what}, nothing changed")
    by = "" if previous.get("judge") is None else f" by node {previous['judge']}"
    kind = "forgotten" if previous.get("kind") == "forget" else f"failed over ({previous.get('kind')}{by})"
    return (f"Node {node_id} was already {kind} at {_when(previous.get('at_ns'))}, fenced at epoch "
            f"{previous.get('fenced_epoch')} ({previous.get('reason')}): nothing changed. What that did:")


def format_forget(report: ForgetReport) -> str:
    if report.already:
        lines = [_previous_line(report.node_id, report.previous, "forget")]
        if report.previous is not None and report.previous.get("kind") != "forget":
            lines.append(f"  its WAL was replayed: {report.previous.get('replayed', 0)} records committed on its "
                         "behalf; nothing was given up")
    else:
        lines = [f"Forgot node {report.node_id}: fenced at epoch {report.fenced_epoch}; {len(report.streams)} "
                 "streams it held are closed"]
    rows = [[f.stream_id, f.partition or "-", f.committed_end,
             f"[{f.committed_end}, {f.given_up_end})" if f.given_up else "-", f"{f.given_up:,}"]
            for f in report.streams]
    if rows:
        lines.append(table(["stream", "partition meta of", "committed end", "offsets given up", "count"], rows))
    if not report.already or report.previous is not None and report.previous.get("kind") == "forget":
        lost = [f for f in report.streams if f.given_up]
        lines.append(f"  {len(lost)} streams resume above offsets the node may have acknowledged "
                     f"({sum(f.given_up for f in lost):,} offsets given up); what its lost WAL held there is gone "
                     "(reads there raise OffsetsLostError)" if lost else "  no stream gives up any offset")
    lines += _placement_lines(report.node_id, report.reassigned, report.waiting, "forgotten")
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
    offsets given up are printed per stream and recorded in the failover history. Partitions no
    live node can take stay assigned to NODE and move once a node runs its agent (the command
    still succeeds and says so). Running it again on a node already given up changes nothing
    and prints what the first run did. Use it only when the WAL cannot come back: a node whose
    WAL is readable is failed over without losing anything (its peers do that by themselves, or
    `s3stream node fail-over NODE`).
    """
    with contextlib.closing(open_meta(meta_url)) as meta:
        if node_id not in {n.node_id for n in meta.list_nodes()}:
            raise click.ClickException(f"node {node_id} is not registered in the metadata; `s3stream streams` "
                                       "lists the nodes")
        report = Cluster(meta, store=None).forget(node_id, wal_lost=wal_lost, reason=reason)
    if as_json:
        emit_json(dict(node_id=report.node_id, fenced_epoch=report.fenced_epoch, reassigned=report.reassigned,
                       waiting=report.waiting, already=report.already, previous=report.previous,
                       streams=[dict(vars(f), given_up=f.given_up) for f in report.streams]))
    else:
        click.echo(format_forget(report))


def _replayed_rows(streams: list[dict], partitions: dict[int, str]) -> list[list]:
    return [[s["stream_id"], partitions.get(s["stream_id"], "-"), s["committed_end"], s["end"],
             f"[{s['committed_end']}, {s['end']})" if s["end"] > s["committed_end"] else "-",
             f"{s['end'] - s['committed_end']:,}"] for s in streams]


def format_fail_over(outcome: FailoverOutcome, partitions: dict[int, str], wal_path: str) -> str:
    report = outcome.report
    if report is None:
        lines = [_previous_line(outcome.node_id, outcome.previous, "fail over")]
        streams = (outcome.previous or {}).get("streams", [])
        streams = [s for s in streams if "end" in s]
    else:
        forced = " (forced: it may have been alive; its WAL was read once its lease was over)" if outcome.forced else ""
        lines = [f"Failed node {outcome.node_id} over{forced}: fenced at epoch {report.fenced_epoch}; its WAL "
                 f"{wal_path} held {report.records} records, {report.replayed} committed on its behalf; "
                 f"{report.streams_closed} streams closed in {report.seconds:.3f} s"]
        streams = [dataclasses.asdict(s) for s in report.streams]
    if streams:
        lines.append(table(["stream", "partition meta of", "committed end", "end now", "offsets replayed", "count"],
                           _replayed_rows(streams, partitions)))
    lines += _placement_lines(outcome.node_id, outcome.reassigned, outcome.waiting, "failed over")
    return "\n".join(lines)


@node.command("fail-over")
@click.argument("node_id", metavar="NODE", type=click.IntRange(min=0))
@meta_option
@store_option(required=True)
@click.option("--wal", "wal_location", metavar="PATH|URL",
              help="NODE's WAL as this host reaches it: a file path, or a WAL of objects (s3://bucket/prefix?..., "
                   "objects+file:///dir). Default: the location NODE registered (`s3stream streams`).")
@click.option("--force", is_flag=True,
              help="Fail NODE over even if it is alive (it heartbeats): it is fenced at once, stops, and its WAL is "
                   "read once its lease is over. Every partition it serves moves.")
@click.option("--heartbeat-timeout", type=click.FloatRange(min=0, min_open=True),
              default=ClusterConfig.heartbeat_timeout, show_default=True, metavar="S",
              help="The cluster's ClusterConfig.heartbeat_timeout: how long NODE must be silent, counted here, to be "
                   "dead by the failure detector's rules.")
@click.option("--reason", default="an operator's failover (s3stream node fail-over)", show_default=True,
              help="Recorded in the history.")
@json_option
@user_errors
def fail_over(node_id: int, meta_url: str, store_url: str, wal_location: str | None, force: bool,
              heartbeat_timeout: float, reason: str, as_json: bool) -> None:
    """Fail NODE over: fence it, replay its WAL on its behalf (what it acknowledged is committed
    to the store), close its streams and reassign its partitions to live nodes.

    For a dead node whose WAL this host can read: a file (a shared volume) or a WAL of objects.
    NODE must be dead by the failure detector's rules: the command watches its heartbeat record
    for --heartbeat-timeout and refuses (exit 1) a node that heartbeats meanwhile, unless
    --force. Prints what was replayed per stream and records the failover in the history
    (`s3stream node history`). Running it again on a node already failed over changes nothing
    and prints what the first run did. A node whose WAL is lost with its host: `s3stream node
    forget NODE --wal-lost`.
    """
    config = _timing(heartbeat_timeout)
    # The WAL is opened with the capacity in its header, whatever it is.
    engine = Config(wal=wal.WALConfig(capacity=None))
    with contextlib.closing(open_meta(meta_url)) as meta, contextlib.closing(open_store(store_url)) as store:
        nodes = {n.node_id: n for n in meta.list_nodes()}
        if node_id not in nodes:
            raise click.ClickException(f"node {node_id} is not registered in the metadata; `s3stream streams` "
                                       "lists the nodes")
        location = wal_location or nodes[node_id].wal_path
        if not nodes[node_id].walless and not readable_here(location):
            raise click.ClickException(
                f"node {node_id}'s WAL {location!r} is not reachable from this host (no such file); give its path "
                "here with --wal PATH (a shared volume), or, if it is lost with its host, `s3stream node forget "
                f"{node_id} --wal-lost`")
        cluster = Cluster(meta, store, config, engine)
        if not as_json and not force and not nodes[node_id].failover:
            click.echo(f"watching node {node_id}'s heartbeat for {heartbeat_timeout} s (the failure detector's rule) "
                       "before failing it over", err=True)
        outcome = cluster.fail_over_node(node_id, force=force, reason=reason, wal_path=wal_location)
        partitions = _partition_names(meta)
    if as_json:
        emit_json(dict(node_id=node_id, already=outcome.already, forced=outcome.forced, previous=outcome.previous,
                       reassigned=outcome.reassigned, waiting=outcome.waiting,
                       report=None if outcome.report is None else dataclasses.asdict(outcome.report)))
    else:
        click.echo(format_fail_over(outcome, partitions, location))


@node.command()
@click.argument("node_id", metavar="NODE", type=click.IntRange(min=0))
@meta_option
@click.option("--to", "to_nodes", type=click.IntRange(min=0), multiple=True, metavar="N",
              help="A node to move the partitions to (repeat it for several); default: every other live node "
                   "that can serve. The partitions are spread evenly over them.")
@click.option("--limit", type=click.IntRange(min=1), default=None, metavar="K",
              help="Move only the first K of NODE's partitions (by name).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="S",
              help="Seconds to wait until every target serves its partitions (default: the migration timeout, "
                   f"{ClusterConfig.migration_timeout:g} s, once more per 1,000 partitions).")
@click.option("--heartbeat-timeout", type=click.FloatRange(min=0, min_open=True),
              default=ClusterConfig.heartbeat_timeout, show_default=True, metavar="S",
              help="The cluster's ClusterConfig.heartbeat_timeout: which nodes count as live targets.")
@json_option
@user_errors
def drain(node_id: int, meta_url: str, to_nodes: tuple[int, ...], limit: int | None, timeout: float | None,
          heartbeat_timeout: float, as_json: bool) -> None:
    """Move NODE's partitions to other nodes before taking NODE out of service (Cluster.drain):
    assigned in writes of 1,000, closed by NODE's agent and opened by the targets' agents in
    batches. It waits until every target serves its partitions at the new assignment, or
    --timeout; those not served by then are named (exit 1): they stay assigned to their
    targets, which open them once the source lets go. Nothing is fenced: a NODE that does not
    let go (its agent stopped) keeps its partitions until `s3stream node fail-over NODE`.
    The balancer, if one runs, may later move partitions back unless NODE is stopped."""
    with contextlib.closing(open_meta(meta_url)) as meta:
        cluster = Cluster(meta, store=None, config=_timing(heartbeat_timeout))
        if node_id not in {n.node_id for n in meta.list_nodes()}:
            raise click.ClickException(f"node {node_id} is not registered in the metadata; `s3stream streams "
                                       "--meta URL` lists the nodes")
        if node_id in to_nodes:
            raise click.ClickException(f"--to {node_id} is the node being drained; name other nodes, or leave "
                                       "--to out for every other live node")
        report = cluster.drain(node_id, list(to_nodes) or None, limit, timeout)
    targets = Counter(report.moves.values())
    if as_json:
        emit_json(dict(node=node_id, moved=len(report.moves), targets={str(n): c for n, c in sorted(targets.items())},
                       seconds=round(report.seconds, 3), waiting=report.waiting, done=report.done))
    elif not report.moves:
        click.echo(f"node {node_id} has no partition assigned: nothing to drain")
    else:
        spread = ", ".join(f"{count:,} to node {n}" for n, count in sorted(targets.items()))
        click.echo(f"drained node {node_id}: {len(report.moves):,} partitions ({spread}) served at their targets "
                   f"in {report.seconds:.2f} s" if report.done else
                   f"node {node_id}: {len(report.moves):,} partitions reassigned ({spread})")
    if report.waiting:
        shown = ", ".join(report.waiting[:10]) + (", ..." if len(report.waiting) > 10 else "")
        raise click.ClickException(
            f"{len(report.waiting):,} of {len(report.moves):,} partitions were not served at their targets after "
            f"{report.seconds:.1f} s ({shown}): they stay assigned there and open once node {node_id}'s agent "
            f"lets them go and the targets' agents run; `s3stream streams --meta URL` shows where each is")


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
