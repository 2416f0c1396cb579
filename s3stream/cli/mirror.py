"""`s3stream mirror run|status`: a mirror worker in the foreground, and the mirror's flows,
leases, workers and heartbeats as the target's metadata records them."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from typing import Any

import click

from wal.sizes import parse_size

from ..config import Config
from .common import (as_number, emit_json, json_option, metrics_option, open_meta, open_store, serve_metrics, table,
                     until_stopped, user_errors)


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except argparse.ArgumentTypeError as e:
        raise click.BadParameter(str(e)) from e


def mirror_event_line(event: dict) -> str:
    """One line per worker event: `12:00:01 worker 1 started A.orders <- orders: upstream 0, ...`."""
    at = as_number(event.get("at"))
    when = "-" if at is None else time.strftime("%H:%M:%S", time.localtime(at))
    line = f"{when} worker {event.get('worker')} {event.get('event')}"
    if event.get("target_partition"):
        line += f" {event['target_partition']}"
        if event.get("source_partition"):
            line += f" <- {event['source_partition']}"
    return line + (f": {event['detail']}" if event.get("detail") else "")


def _ago(seconds: Any) -> str:
    return "-" if as_number(seconds) is None else f"{seconds:.1f} s ago"


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


@click.group()
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
               wal_capacity: int | None, upload_interval: float, metrics_port: int, metrics_addr: str) -> None:
    """Run a mirror worker in the foreground until Ctrl-C, printing its flows' starts and stops.

    The worker claims its share of the source's partitions (leases in the target's metadata),
    copies each into A.NAME on this cluster, and hands partitions over when workers join or
    leave. One worker leads: it writes the heartbeats and translates consumer groups' offsets.
    Ctrl-C stops its flows (each target partition closed), releases its leases and exits.
    --metrics-port: the target node's engine metrics, labelled node=<worker id>.
    """
    from ..mirror import MirrorWorker, WorkerConfig
    engine = Config(upload_interval=upload_interval)
    if wal_capacity is not None:
        # A smaller WAL must still hold two upload blocks: scale the block (and what fits in it) down.
        block = min(engine.upload_threshold, max(wal_capacity // 4, 64 * 1024))
        engine = dataclasses.replace(engine, wal=dataclasses.replace(engine.wal, capacity=wal_capacity),
                                     upload_threshold=block, split_size=min(engine.split_size, block),
                                     max_batch_bytes=min(engine.max_batch_bytes, block))
    config = WorkerConfig(engine=engine, metrics=bool(metrics_port))
    if interval is not None:
        config = dataclasses.replace(config, interval=interval, lease_ttl=max(config.lease_ttl, 3 * interval),
                                     worker_timeout=max(config.worker_timeout, 3 * interval))
    with until_stopped("the mirror worker") as foreground:
        serve_metrics(metrics_port, metrics_addr)
        with contextlib.ExitStack() as stack:
            source_meta = stack.enter_context(contextlib.closing(open_meta(source_meta_url)))
            source_store = stack.enter_context(contextlib.closing(open_store(source_store_url)))
            target_meta = stack.enter_context(contextlib.closing(open_meta(target_meta_url)))
            target_store = stack.enter_context(contextlib.closing(open_store(target_store_url)))
            worker = MirrorWorker(worker_id, source_alias=source_alias, flow_id=flow_id, wal_dir=wal_dir,
                                  config=config, on_event=lambda e: click.echo(mirror_event_line(e)),
                                  source_meta=source_meta, source_store=source_store, target_meta=target_meta,
                                  target_store=target_store)
            foreground.started = True
            # Ctrl-C may come at any moment from here on, the start included (see balance run).
            try:
                worker.start()
                click.echo(f"mirror worker {worker_id} running flow {worker.flow_id}: {source_alias}.NAME for "
                           f"every source partition NAME, passes every {config.interval:g} s; Ctrl-C to stop")
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
    from ..mirror import mirror_status
    with contextlib.closing(open_meta(target_meta_url)) as meta:
        report = mirror_status(meta, flow_id)
    if as_json:
        emit_json(report)
    else:
        click.echo(format_mirror_status(report))
