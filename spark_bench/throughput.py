"""Distributed ingest throughput: N Spark tasks, each a node producing to its own partitions.

Reports aggregate and per-node MB/s, append latency p50/p99/p99.9 (call to acknowledgement),
object-store write requests per GiB, the scaling over the node counts asked (default 1, 2, 4:
each count is one Spark job whose tasks all run at once), and each node's MB/s over time: its
first seconds against the rest of the run (steady state: target >= 0.9 of the first seconds;
a node that slows once its WAL wraps or uploads start shows here). With --verify (the default
in cluster mode) every acknowledged record is read back by the driver's own client after each
run and the report counts the lost ones. The nodes start producing together, once every
node's partitions are open. With --retention (the default on the default RAM-disk store when
not verifying) each node trims its partitions as it goes and deletes what it trimmed, as a
Kafka topic with retention.bytes would, so the store holds a bounded amount of the run.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os

from benchmarks.kit import fmt_size, parse_size, progress as progress_bar, pyplot, save_figure
from s3stream.engine.uploadpolicy import request_cost_per_gib, requests_floor

from .common import (
    GiB, MiB, add_common_args, assign_metrics_ports, deployment, format_placement, latency_summary, new_run_id,
    node_spec,
    placement, progress, run_nodes, verdict, verify_acks, write_json,
)
from .node import run_nodes_of_partition

#: The first seconds of a node's run, compared with the rest (its steady state).
HEAD_SECONDS = 2
STEADY_TARGET = 0.9
#: Retention per partition on the default store, a directory on /dev/shm standing in for S3:
#: without it, the store holds every byte of every run in this machine's memory (tens of GB
#: at full speed, more than /dev/shm has on a small machine), and on a VM whose host takes
#: freed memory back, new pages cost a host fault each, so the store, not the engine, sets
#: the steady state (tests/bench/store_first_touch.py). With it, the store's footprint stays
#: about retention x partitions plus a second of ingest, pages are reused, and the stand-in
#: keeps S3's property that the bytes it holds cost the node nothing.
DEFAULT_RETENTION = 64 * MiB


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m spark_bench throughput", description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--nodes", default=None,
                    help="node counts to run, e.g. 1,2,4 (default 1,2,4; with --standalone N: 1, 2, 4... up to N)")
    ap.add_argument("--partitions", type=int, default=4, help="partitions per node")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds each job produces")
    ap.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                    help="read every acknowledged record back after each run and count the lost ones "
                         "(default: on in cluster mode, off in local mode)")
    ap.add_argument("--retention", type=parse_size, default=None, metavar="SIZE",
                    help="each node trims its partitions to their last SIZE bytes as it goes and deletes "
                         "what it trimmed (0: keep everything; default: %s per partition on the default "
                         "RAM-disk store when not verifying, else 0)" % fmt_size(DEFAULT_RETENTION))
    args = ap.parse_args(argv)
    if args.nodes is None:
        limit = args.standalone or 4
        counts = [c for c in (1, 2, 4, 8, 16, 32) if c < limit] + [limit]
        args.nodes = ",".join(map(str, counts))
    return args


def run(argv=None) -> dict:
    args = parse(argv)
    counts = [int(x) for x in args.nodes.split(",")]
    with deployment(args, "throughput", max(counts)) as dep:
        verify = dep.cluster_mode if args.verify is None else args.verify
        if args.retention is None:
            args.retention = DEFAULT_RETENTION if args.store is None and not verify else 0
        runs = [_run_count(args, dep, n, verify) for n in progress_bar(counts, desc="node counts", unit="run")]
    base = runs[0]["mb_s"] if runs else 0
    for r in runs:
        r["scaling"] = r["mb_s"] / base if base else None
    lost = sum(r["verification"]["lost"] for r in runs) if verify else None
    report = dict(kind="throughput", **dep.describe(), batch=args.batch, partitions_per_node=args.partitions,
                  duration=args.duration, store=dep.store, retention_per_partition=args.retention or None,
                  verified=verify, lost=lost, runs=runs)
    write_json(dep.out, report)
    report["plots"] = plot(report, dep.out)
    print(format_report(report))
    return report


def _run_count(args, dep, n: int, verify: bool) -> dict:
    """One Spark job of `n` nodes producing for --duration seconds; its row of the report."""
    from s3stream.cluster import Cluster
    from s3stream.metadata import open_metadata
    from s3stream.objectstore import open_object_store
    run_work = os.path.join(dep.work, f"n{n}")
    os.makedirs(run_work, exist_ok=True)
    run_meta = args.meta or f"sqlite:///{run_work}/meta.db"
    wal_dir = run_work if dep.wal_dir else None
    run_id = new_run_id()
    m = open_metadata(run_meta)
    store = open_object_store(dep.store)
    try:
        cluster = Cluster(m, store)
        specs = []
        for node in range(1, n + 1):
            names = [f"n{n}-p{node}-{i}" for i in range(args.partitions)]
            for name in names:
                cluster.assign(name, node)
            specs.append(node_spec(args, node, wal_dir, dep.store, run_meta, names, args.duration,
                                   cluster=dict(agent_interval=0.02), keep_acks=verify, run_id=run_id))
            specs[-1].update(retention=args.retention or None, start_together=n)
        progress(f"{n} node(s) x {args.partitions} partitions for {args.duration:g} s on {dep.master}")
        assign_metrics_ports(specs, args.metrics_port, args.metrics_addr)
        store_before = _store_bytes(dep.store)
        results = run_nodes(dep.spark, specs, run_nodes_of_partition, seconds=args.duration)
        total = sum(r["bytes"] for r in results)
        seconds = max(r["seconds"] for r in results)
        lat = [x for r in results for x in r["latencies"]]
        # counted by the nodes as they committed: retention may have deleted the objects since
        requests = sum(r["upload"]["write_requests"] for r in results)
        objects = sum(r["upload"]["objects"] for r in results)
        triggers: dict[str, int] = {}
        for r in results:
            for trigger, counts in r["upload"].get("triggers", {}).items():
                triggers[trigger] = triggers.get(trigger, 0) + counts["objects"]
        uploaded = sum(r["upload"]["bytes"] for r in results)
        row = dict(nodes=n, mb_s=total / seconds / 1e6, bytes=total,
                   per_node_mb_s=[r["bytes"] / r["seconds"] / 1e6 for r in results],
                   latency=latency_summary(lat), requests_per_gib=requests / (total / GiB) if total else None,
                   # the floor for what was uploaded (uploadpolicy.requests_floor at S3's 16 MiB
                   # parts), and what the requests cost at S3 Standard's price
                   request_floor_per_gib=requests_floor(uploaded, objects, 16 * MiB) / (total / GiB)
                   if total else None,
                   usd_per_gib=request_cost_per_gib(requests / (total / GiB)) if total else None,
                   objects_by_trigger=triggers,
                   timeline={r["node_id"]: r["timeline"] for r in results},
                   steady_state={r["node_id"]: steady_state(r["timeline"], r["seconds"]) for r in results},
                   placement=placement(results), trims=sum(r.get("trims", 0) for r in results),
                   store_bytes_before=store_before, store_bytes_at_end=_store_bytes(dep.store),
                   errors=[e for r in results for e in r["errors"]][:20])
    finally:
        m.close()
        store.close()
    progress(f"  {row['mb_s']:.0f} MB/s, p99 {row['latency']['p99_ms']:.1f} ms; "
             f"placement: {format_placement(row['placement'])}")
    if verify:
        row["verification"] = verify_acks(dep.store, run_meta, results, args.batch)
        v = row["verification"]
        progress(f"  verified through the driver's own client: {v['acknowledged']} acknowledged, {v['lost']} lost")
    return row


def steady_state(timeline: list, seconds: float, head: int = HEAD_SECONDS) -> dict:
    """One node's MB/s per 1-second interval (`timeline`: (second, bytes acknowledged in it))
    and its throughput over the first `head` seconds against the rest. The run's last, partial
    second joins the one before when under half a second (a few ms of draining would read as
    a spike). The rest is None when the run is too short for it (under one second after the
    head)."""
    intervals = max(1, math.ceil(seconds))
    lengths = [1.0] * intervals
    lengths[-1] = seconds - (intervals - 1) or 1.0
    if intervals > 1 and lengths[-1] < 0.5:
        tail = lengths.pop()
        lengths[-1] += tail
    acked = [0] * len(lengths)
    for second, nbytes in timeline:
        acked[min(int(second), len(lengths) - 1)] += nbytes
    first_seconds = min(head, seconds)
    first = sum(b for second, b in timeline if second < head) / first_seconds / 1e6 if first_seconds > 0 else None
    rest = sum(b for second, b in timeline if second >= head)
    steady = rest / (seconds - head) / 1e6 if seconds >= head + 1 else None
    return dict(series_mb_s=[b / length / 1e6 for b, length in zip(acked, lengths)], interval_seconds=lengths,
                head_seconds=head,
                first_mb_s=first, steady_mb_s=steady,
                ratio=steady / first if steady is not None and first else None)


def _store_bytes(url: str) -> int | None:
    """Bytes in a file:// store's directory (None for other stores): its footprint."""
    if not url.startswith("file://"):
        return None
    total = 0
    for root, _, files in os.walk(url[len("file://"):]):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass                        # deleted meanwhile
    return total


def format_report(report: dict) -> str:
    retention = report.get("retention_per_partition")
    lines = ["=" * 90, f"Spark throughput ({report['master']}"
             f"{', single-host cluster' if report['single_host'] else ''}, batch {report['batch']} B, "
             f"{report['partitions_per_node']} partitions/node, {report['duration']:g} s per run, "
             f"retention {fmt_size(retention) + ' per partition' if retention else 'none'})"]
    lines.append(f"{'nodes':>5} {'MB/s':>8} {'scaling':>8} {'per node MB/s':>30} {'p50 ms':>7} {'p99 ms':>7} "
                 f"{'p999 ms':>8} {'req/GiB':>8}")
    for r in report["runs"]:
        per = ", ".join(f"{x:.0f}" for x in r["per_node_mb_s"])
        lat = r["latency"]
        lines.append(f"{r['nodes']:>5} {r['mb_s']:>8.0f} {r['scaling']:>8.2f} {per:>30} {lat['p50_ms']:>7.1f} "
                     f"{lat['p99_ms']:>7.1f} {lat['p999_ms']:>8.1f} {r['requests_per_gib'] or 0:>8.1f}")
    for r in report["runs"]:
        if r.get("request_floor_per_gib") is not None:
            lines.append(f"{r['nodes']:>5} node(s): {r['requests_per_gib']:.1f} write requests per GiB against a floor of "
                         f"{r['request_floor_per_gib']:.1f}; ${r['usd_per_gib']:.5f} per GiB at S3 Standard")
        if r.get("objects_by_trigger"):
            lines.append(f"{r['nodes']:>5} node(s): objects by upload trigger (s3stream.engine.uploadpolicy): "
                         + ", ".join(f"{t} {n}" for t, n in sorted(r["objects_by_trigger"].items())))
    if not report["cluster_mode"] or report["single_host"]:
        lines.append("Nodes share this machine's cores and disk: scaling shows contention, not the design's limit.")
    for r in report["runs"]:
        lines.append(f"{r['nodes']:>5} node(s) ran on: {format_placement(r['placement'])}")
        if r.get("store_bytes_at_end") is not None:
            grew = r["store_bytes_at_end"] - (r["store_bytes_before"] or 0)
            lines.append(f"{'':>5} the store grew by {grew / GiB:.2f} GiB for {r['bytes'] / GiB:.2f} GiB acknowledged "
                         f"({r['trims']} trims)")
        if "verification" in r:
            v = r["verification"]
            lines.append(f"{'':>5} verified: {v['acknowledged']} acknowledged records, {v['lost']} lost "
                         f"(read back different: {v['mismatched']}; trimmed by retention: {v['trimmed']})"
                         + (f"; unreadable partitions: {v['unreadable']}" if v["unreadable"] else ""))
    lines.append(f"Steady state: each node's MB/s after its first {HEAD_SECONDS} s against those first seconds "
                 f"(target >= {STEADY_TARGET})")
    for r in report["runs"]:
        parts = []
        for node, st in r["steady_state"].items():
            if st["ratio"] is None:
                parts.append(f"node {node}: {st['first_mb_s'] or 0:.0f} MB/s, too short for a steady state")
            else:
                parts.append(f"node {node}: {st['first_mb_s']:.0f} -> {st['steady_mb_s']:.0f} MB/s = "
                             f"{st['ratio']:.2f} {verdict(st['ratio'] >= STEADY_TARGET)}")
        lines.append(f"{r['nodes']:>5} node(s): " + "; ".join(parts))
    missed = any(st["ratio"] is not None and st["ratio"] < STEADY_TARGET
                 for r in report["runs"] for st in r["steady_state"].values())
    if missed and str(report.get("store", "")).startswith("file://") and not report.get("retention_per_partition"):
        lines.append("  The store is a local directory standing in for S3, keeping every byte (no retention): once "
                     "its new bytes outgrow the memory the host still backs, it takes them at the first-touch "
                     "speed of fresh pages (python3 tests/bench/store_first_touch.py measures it; "
                     "docs/write-path.md, 'What bounds the main job's steady state').")
    if report.get("plots"):
        lines.append("plots: " + ", ".join(report["plots"]))
    return "\n".join(lines)


def plot(report: dict, out: str) -> list[str]:
    plt = pyplot("spark_bench")
    if plt is None:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    labels, ratios = [], []
    for r in report["runs"]:
        for node, st in r["steady_state"].items():
            labels.append(f"{r['nodes']}n/{node}")
            ratios.append(st["ratio"] or 0)
    axes[0].bar(range(len(ratios)), ratios)
    axes[0].axhline(STEADY_TARGET, color="black", ls="--", lw=1, label=f"target {STEADY_TARGET}")
    axes[0].set_xticks(range(len(labels)), labels, fontsize=7)
    axes[0].set_xlabel("nodes in the run / node")
    axes[0].set_ylabel(f"MB/s after {HEAD_SECONDS} s / first {HEAD_SECONDS} s")
    axes[0].set_title("Steady state per node")
    axes[0].legend(fontsize=8)
    xs = [r["nodes"] for r in report["runs"]]
    axes[1].plot(xs, [r["mb_s"] for r in report["runs"]], marker="o")
    axes[1].set_xlabel("nodes")
    axes[1].set_ylabel("aggregate MB/s")
    axes[1].set_title("Scaling")
    for key, label in (("p50_ms", "p50"), ("p99_ms", "p99"), ("p999_ms", "p99.9")):
        axes[2].plot(xs, [r["latency"][key] for r in report["runs"]], marker="o", label=label)
    axes[2].set_xlabel("nodes")
    axes[2].set_ylabel("append latency, ms")
    axes[2].set_yscale("log")
    axes[2].legend()
    axes[2].set_title("Latency percentiles")
    return [save_figure(plt, fig, out, "throughput.png"), _plot_over_time(plt, report, out)]


def _plot_over_time(plt, report: dict, out: str) -> str:
    """MB/s acknowledged per second, one panel per run, one line per node."""
    runs = report["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.8), squeeze=False, sharey=True)
    for ax, r in zip(axes[0], runs):
        for node, st in r["steady_state"].items():
            series = st["series_mb_s"]
            edges = [0.0] + list(itertools.accumulate(st["interval_seconds"]))
            ax.step(edges, series + series[-1:], where="post", label=f"node {node}")
        ax.axvline(HEAD_SECONDS, color="grey", ls=":", lw=1)
        ax.set_xlabel("second of the run")
        ax.set_title(f"{r['nodes']} node(s)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("MB/s acknowledged")
    return save_figure(plt, fig, out, "throughput-over-time.png")
