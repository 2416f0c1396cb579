"""Migration time against history size, under load, next to a Kafka-style copy baseline.

1. The driver builds partitions with the histories asked (default 16 MiB, 256 MiB, 1 GiB),
   committed to objects.
2. Baseline (article 003): the time to copy each partition's whole history to a target, as a
   Kafka reassignment does: read every batch from the store, append it to a file on the target's
   disk, fsync.
3. Two Spark tasks act as nodes 1 and 2; producers write to every partition wherever it is open
   (so the un-uploaded tail at each migration is up to the upload threshold, `--tail`). The driver
   migrates each partition back and forth `--migrations` times and records each report.
4. Every acknowledged record is read back (by the driver's own client, after the nodes closed
   their partitions: nothing of the nodes' is read) and checked byte for byte.

Targets: p99 < 0.5 s for every history with a tail of at most 16 MiB; flat in history (1 GiB
within 1.5x of 16 MiB); at least 100x faster than the copy at 1 GiB.
"""
from __future__ import annotations

import argparse
import os
import threading
import time

from wal.benchkit import parse_size, progress as progress_bar, pyplot, save_figure


from .common import (
    MiB, add_common_args, assign_metrics_ports, deployment, format_placement, latency_summary, new_run_id, node_spec,
    placement, progress, publish, run_nodes, verdict, verify_acks,
)

TARGETS = dict(p99_s=0.5, flatness=1.5, speedup=100.0)
#: Node ids of the driver's own clients: the one that writes the histories, the copy baseline's.
BUILDER_NODE_ID, COPIER_NODE_ID = 100, 101


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m spark_bench migration", description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--histories", default="16M,256M,1G", help="history size per partition")
    ap.add_argument("--tail", type=parse_size, default=16 * MiB,
                    help="most un-uploaded bytes a partition has when it moves (the upload threshold)")
    ap.add_argument("--migrations", type=int, default=10, help="migrations per partition")
    ap.add_argument("--pause", type=float, default=0.3, help="seconds of load between migrations")
    ap.add_argument("--inflight", type=int, default=8, help="appends in flight per producer")
    args = ap.parse_args(argv)
    args.upload_threshold = args.tail
    return args


def build_history(store: str, meta: str, work: str, names: dict[str, int], batch: int) -> None:
    import s3stream
    import wal
    cfg = s3stream.Config(upload_threshold=64 * MiB, cache_size=256 * MiB,
                          wal=wal.WALConfig(capacity=512 * MiB, full_timeout=60))
    client = s3stream.StreamClient(BUILDER_NODE_ID, os.path.join(work, "builder.wal"), store, meta, cfg)
    payload = os.urandom(batch)
    with progress_bar(total=sum(size // batch * batch for size in names.values()), desc="histories", unit="B",
                      unit_scale=True, unit_divisor=1024) as bar:
        for name, size in names.items():
            p = client.open_partition(name)
            futures = []
            for _ in range(size // batch):
                futures.append(p.append(s3stream.RecordBatch(payload, 1)))
                if len(futures) >= 256:
                    futures.pop(0).result()
                    bar.update(batch)
            for f in futures:
                f.result()
            bar.update(len(futures) * batch)
            p.close()
            progress(f"  history of {name}: {size / MiB:.0f} MiB committed")
    client.close(retire=True)


def copy_baseline(store: str, meta: str, work: str, name: str) -> dict:
    """Kafka-style reassignment of one partition: copy its whole log to the target's disk."""
    import s3stream
    import wal
    cfg = s3stream.Config(upload_threshold=64 * MiB, cache_size=256 * MiB,
                          wal=wal.WALConfig(capacity=256 * MiB, full_timeout=60))
    client = s3stream.StreamClient(COPIER_NODE_ID, os.path.join(work, "copier.wal"), store, meta, cfg)
    p = client.open_partition(name)
    target = os.path.join(work, f"replica-{name}.log")
    t0 = time.perf_counter()
    copied = 0
    with open(target, "wb") as f:
        pos = p.log.start_offset
        while pos < p.log.confirm_offset:
            res = p.fetch(pos, max_bytes=4 * MiB)
            for b in res.batches:
                f.write(b.payload)
                copied += len(b.payload)
            pos = res.end_offset
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    p.close()
    client.close(retire=True)
    os.unlink(target)
    return dict(bytes=copied, seconds=seconds, mb_s=copied / seconds / 1e6)


def run(argv=None) -> dict:
    args = parse(argv)
    histories = {f"h{h}": parse_size(h) for h in args.histories.split(",")}
    with deployment(args, "migration", 2) as dep:
        report = _run(args, dep, histories)
    return publish(report, dep.out, plot, format_report)


def _run(args, dep, histories: dict[str, int]) -> dict:
    from s3stream.cluster import Cluster, ClusterConfig
    from s3stream.metadata import open_metadata
    from s3stream.objectstore import open_object_store
    store, meta_url, work = dep.store, dep.meta, dep.work
    progress(f"building histories {', '.join(histories)}")
    build_history(store, meta_url, work, histories, args.batch)
    progress("Kafka-style copy baseline")
    baseline = {name: copy_baseline(store, meta_url, work, name) for name in histories}
    meta = open_metadata(meta_url)
    ccfg = dict(agent_interval=0.01, heartbeat_interval=0.5, heartbeat_timeout=30.0, migration_timeout=30.0)
    cluster = Cluster(meta, open_object_store(store), ClusterConfig(**ccfg))
    for name in histories:
        cluster.assign(name, 1)
    run_id = new_run_id()
    specs = [node_spec(args, n, dep.wal_dir, store, meta_url, list(histories), 3600.0, ccfg, keep_acks=True,
                       inflight=args.inflight, run_id=run_id) for n in (1, 2)]
    reports: list = []
    failures: list[str] = []
    halt = threading.Event()                                 # the nodes are gone: stop driving them
    moves = progress_bar(total=args.migrations * len(histories), desc="migrations", unit="move")

    def drive() -> None:
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not all(cluster.owner(n) == 1 for n in histories):
                if halt.wait(0.05):
                    return
            time.sleep(1.0)                                  # let the load build up
            for k in range(args.migrations):
                for name in histories:
                    if halt.is_set():
                        return
                    target = 2 if cluster.owner(name) == 1 else 1
                    reports.append(cluster.migrate(name, target))
                    moves.update()                           # after the migration's own clock stopped
                    halt.wait(args.pause / len(histories))
                progress(f"  migrations: {len(reports)} of {args.migrations * len(histories)}")
        except Exception as e:     # noqa: BLE001 - reported; the nodes are stopped either way
            failures.append(repr(e))
        finally:
            meta.put_kv(f"bench/{run_id}/stop", b"1")

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    try:
        progress(f"2 nodes under load on {dep.master}; {args.migrations} migrations per partition")
        assign_metrics_ports(specs, args.metrics_port)
        results = run_nodes(dep.spark, specs)
    finally:
        halt.set()
        driver.join()
        moves.close()
    where = placement(results)
    progress(f"  placement: {format_placement(where)}")
    progress("verifying every acknowledged record through the driver's own client")
    lost = verify_acks(store, meta_url, results, args.batch)
    meta.close()
    report = summarize(args, histories, baseline, reports, results, lost, failures)
    report.update(dep.describe(), placement=where)
    return report


def summarize(args, histories, baseline, reports, results, lost, failures) -> dict:
    rows = []
    for name, size in histories.items():
        mine = [r for r in reports if r.partition == name]
        secs = [int(r.seconds * 1e9) for r in mine]
        lat = latency_summary(secs)
        p99 = lat["p99_ms"] / 1e3 if secs else None
        rows.append(dict(partition=name, history_bytes=size, migrations=len(mine), p50_s=lat["p50_ms"] / 1e3 if secs else None,
                         p99_s=p99, max_s=lat["max_ms"] / 1e3 if secs else None,
                         tail_bytes_mean=sum(r.tail_bytes for r in mine) / len(mine) if mine else None,
                         tail_bytes_max=max((r.tail_bytes for r in mine), default=None),
                         failed_over=sum(r.failed_over for r in mine),
                         close_p50_s=sorted(r.close_seconds for r in mine)[len(mine) // 2] if mine else None,
                         open_p50_s=sorted(r.open_seconds for r in mine)[len(mine) // 2] if mine else None,
                         copy_seconds=baseline[name]["seconds"], copy_mb_s=baseline[name]["mb_s"],
                         speedup=baseline[name]["seconds"] / p99 if p99 else None))
    flat = rows[-1]["p99_s"] / rows[0]["p99_s"] if rows and rows[0]["p99_s"] and rows[-1]["p99_s"] else None
    produced = sum(r["bytes"] for r in results)
    return dict(kind="migration", histories=rows, flatness=flat, targets=TARGETS, tail=args.tail,
                load_mb_s=produced / max(r["seconds"] for r in results) / 1e6 if results else 0,
                verification=lost, failures=failures,
                node_errors=[e for r in results for e in r["errors"]][:20])


def format_report(report: dict) -> str:
    t = TARGETS
    lines = ["=" * 100, f"Migration under load on {report['master']} ({report['load_mb_s']:.0f} MB/s produced), "
             f"un-uploaded tail <= {report['tail'] / MiB:.0f} MiB"]
    lines.append(f"{'history':>10} {'moves':>6} {'p50 s':>7} {'p99 s':>7} {'max s':>7} {'tail MiB':>9} "
                 f"{'copy s':>8} {'speedup':>8}  p99 < {t['p99_s']} s")
    for r in report["histories"]:
        ok = verdict(r["p99_s"] is not None and r["p99_s"] < t["p99_s"])
        lines.append(f"{r['history_bytes'] / MiB:>8.0f}Mi {r['migrations']:>6} {r['p50_s'] or 0:>7.3f} "
                     f"{r['p99_s'] or 0:>7.3f} {r['max_s'] or 0:>7.3f} {(r['tail_bytes_mean'] or 0) / MiB:>9.1f} "
                     f"{r['copy_seconds']:>8.2f} {r['speedup'] or 0:>7.0f}x  {ok}")
    flat = report["flatness"]
    last = report["histories"][-1]
    lines.append("  of which (p50): source close " + ", ".join(f"{r['close_p50_s'] or 0:.3f}" for r in report["histories"])
                 + " s; target open " + ", ".join(f"{r['open_p50_s'] or 0:.3f}" for r in report["histories"])
                 + " s; the rest is agent polling and metadata writes")
    lines.append(f"flat in history: p99 largest / smallest = {flat or 0:.2f} (target <= {t['flatness']}: "
                 f"{verdict(flat and flat <= t['flatness'])})")
    lines.append(f"speedup over the copy at the largest history: {last['speedup'] or 0:.0f}x (target >= "
                 f"{t['speedup']:.0f}x: {verdict((last['speedup'] or 0) >= t['speedup'])})")
    lines.append(f"nodes ran on: {format_placement(report['placement'])}")
    v = report["verification"]
    lines.append(f"acknowledged records: {v['acknowledged']}, lost: {v['lost']} (read back different: "
                 f"{v['mismatched']})" + (f"; unreadable partitions: {v['unreadable']}" if v["unreadable"] else ""))
    if report["failures"] or report["node_errors"]:
        lines.append(f"errors: {report['failures'] + report['node_errors']}")
    if report.get("plots"):
        lines.append("plots: " + ", ".join(report["plots"]))
    return "\n".join(lines)


def plot(report: dict, out: str) -> list[str]:
    plt = pyplot("spark_bench")
    if plt is None:
        return []
    rows = report["histories"]
    xs = [r["history_bytes"] / MiB for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r["p50_s"] for r in rows], marker="o", label="migration p50")
    ax.plot(xs, [r["p99_s"] for r in rows], marker="o", label="migration p99")
    ax.plot(xs, [r["copy_seconds"] for r in rows], marker="s", label="Kafka-style copy of the history")
    ax.axhline(TARGETS["p99_s"], color="red", ls="--", lw=1, label="p99 target 0.5 s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("history of the partition, MiB")
    ax.set_ylabel("seconds")
    ax.set_title("Migration time against history size")
    ax.legend(fontsize=8)
    return [save_figure(plt, fig, out, "migration.png")]
