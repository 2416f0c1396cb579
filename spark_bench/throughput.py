"""Distributed ingest throughput: N Spark tasks, each a node producing to its own partitions.

Reports aggregate and per-node MB/s, append latency p50/p99/p99.9 (call to acknowledgement),
object-store write requests per GiB, and the scaling over the node counts asked (default 1, 2, 4:
each count is one Spark job whose tasks all run at once).
"""
from __future__ import annotations

import argparse
import os

from s3stream.reporting import pyplot, save_figure

from .common import (
    GiB, add_common_args, cleanup_dirs, latency_summary, node_spec, progress, run_nodes, spark_session, storage,
    write_json,
)


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m spark_bench throughput", description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--nodes", default="1,2,4", help="node counts to run, e.g. 1,2,4")
    ap.add_argument("--partitions", type=int, default=4, help="partitions per node")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds each job produces")
    return ap.parse_args(argv)


def run(argv=None) -> dict:
    args = parse(argv)
    counts = [int(x) for x in args.nodes.split(",")]
    out, work, store, meta, cleanup = storage(args, "throughput")
    spark = spark_session(args.master if args.master != "local[*]" else f"local[{max(counts)}]",
                          "s3stream-throughput", max(counts))
    from s3stream.cluster import Cluster
    from s3stream.metadata import open_metadata
    from s3stream.objectstore import open_object_store
    runs = []
    try:
        for n in counts:
            run_work = os.path.join(work, f"n{n}")
            os.makedirs(run_work, exist_ok=True)
            run_meta = args.meta or f"sqlite:///{run_work}/meta.db"
            m = open_metadata(run_meta)
            cluster = Cluster(m, open_object_store(store))
            specs = []
            for node in range(1, n + 1):
                names = [f"n{n}-p{node}-{i}" for i in range(args.partitions)]
                for name in names:
                    cluster.assign(name, node)
                specs.append(node_spec(args, node, run_work, store, run_meta, names, args.duration,
                                       cluster=dict(agent_interval=0.02)))
            progress(f"{n} node(s) x {args.partitions} partitions for {args.duration:g} s")
            results = run_nodes(spark, specs)
            total = sum(r["bytes"] for r in results)
            seconds = max(r["seconds"] for r in results)
            lat = [x for r in results for x in r["latencies"]]
            requests = _write_requests(open_object_store(store), m)
            runs.append(dict(nodes=n, mb_s=total / seconds / 1e6, bytes=total,
                             per_node_mb_s=[r["bytes"] / r["seconds"] / 1e6 for r in results],
                             latency=latency_summary(lat), requests_per_gib=requests / (total / GiB) if total else None,
                             timeline={r["node_id"]: r["timeline"] for r in results},
                             errors=[e for r in results for e in r["errors"]][:20]))
            m.close()
            progress(f"  {runs[-1]['mb_s']:.0f} MB/s, p99 {runs[-1]['latency']['p99_ms']:.1f} ms")
    finally:
        spark.stop()
        if not args.keep:
            cleanup_dirs(cleanup)
    base = runs[0]["mb_s"] if runs else 0
    for r in runs:
        r["scaling"] = r["mb_s"] / base if base else None
    report = dict(kind="throughput", master=args.master, batch=args.batch, partitions_per_node=args.partitions,
                  duration=args.duration, store=store, runs=runs)
    write_json(out, report)
    report["plots"] = plot(report, out)
    print(format_report(report))
    return report


def _write_requests(store, meta) -> int:
    """Write requests an S3 store would have made for the committed objects."""
    from s3stream.objectstore.base import write_requests
    part = getattr(store, "part_size", None)
    threshold = getattr(store, "multipart_threshold", None)
    return sum(write_requests(o.size, part, threshold) for o in meta.list_objects())


def format_report(report: dict) -> str:
    lines = ["=" * 90, f"Spark throughput ({report['master']}, batch {report['batch']} B, "
             f"{report['partitions_per_node']} partitions/node, {report['duration']:g} s per run)"]
    lines.append(f"{'nodes':>5} {'MB/s':>8} {'scaling':>8} {'per node MB/s':>30} {'p50 ms':>7} {'p99 ms':>7} "
                 f"{'p999 ms':>8} {'req/GiB':>8}")
    for r in report["runs"]:
        per = ", ".join(f"{x:.0f}" for x in r["per_node_mb_s"])
        lat = r["latency"]
        lines.append(f"{r['nodes']:>5} {r['mb_s']:>8.0f} {r['scaling']:>8.2f} {per:>30} {lat['p50_ms']:>7.1f} "
                     f"{lat['p99_ms']:>7.1f} {lat['p999_ms']:>8.1f} {r['requests_per_gib'] or 0:>8.1f}")
    lines.append("Nodes share this machine's 2 cores and one disk: scaling shows contention, not the design's limit.")
    if report.get("plots"):
        lines.append("plots: " + ", ".join(report["plots"]))
    return "\n".join(lines)


def plot(report: dict, out: str) -> list[str]:
    plt = pyplot("spark_bench")
    if plt is None:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for r in report["runs"]:
        for node, tl in r["timeline"].items():
            axes[0].plot([t for t, _ in tl], [b / 1e6 for _, b in tl], label=f"{r['nodes']} nodes: node {node}")
    axes[0].set_xlabel("second")
    axes[0].set_ylabel("MB acknowledged")
    axes[0].set_title("Throughput over time per node")
    axes[0].legend(fontsize=6)
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
    return [save_figure(plt, fig, out, "throughput.png")]
