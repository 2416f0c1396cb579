"""The balancer under load: a skewed cluster balances itself, and again after a hot spot moves.

1. 4 nodes (Spark tasks), 32 partitions whose produce rates follow a Zipf law (rank k gets
   1/k^s of the traffic). The driver places them in blocks, the hottest 8 on node 1, so the
   hottest node starts at >= 2x the mean.
2. Every node runs a balancer candidate from --warmup seconds on (the first seconds show the
   skew); one leads through the lease and moves partitions while the others only renew their
   report. Halfway through, the coldest partition turns as hot as the hottest.
3. Every acknowledged record is read back by the driver's own client and checked byte for byte.

Report (report.json, and traffic.png: each node's bytes-in over time, the change and the moves
marked): imbalance_before / imbalance_after (max node bytes-in rate / mean, over the first and
the last 10 s), seconds_to_balance (the later of: from the start, from the change, until the
imbalance stays <= the target), moves (and moves in the last 10 s), acked, lost, and the
planner's time for 10,000 partitions on 100 nodes (simulated).

Targets: imbalance_after <= 1.15, balanced within 60 s of the start and of the change, at most 2
moves in the last 10 s, lost = 0, planning < 1 s.
"""
from __future__ import annotations

import argparse
import time

from benchmarks.kit import pyplot, save_figure

from .common import (
    KiB, add_common_args, assign_metrics_ports, deployment, format_placement, new_run_id, node_spec, placement,
    progress, run_nodes, publish, verdict, verify_acks,
)
from .node import run_nodes_of_partition

TARGETS = dict(imbalance_after=1.15, seconds_to_balance=60.0, moves_last_10s=2, plan_seconds=1.0)
#: The imbalance windows of the report (seconds).
WINDOW = 10


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m spark_bench balance", description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--partitions", type=int, default=32)
    ap.add_argument("--duration", type=float, default=None, help="seconds of load (default 150; --quick 70)")
    ap.add_argument("--rate", type=float, default=16.0, help="total produce rate, MB/s")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the partitions' rates")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds before the balancers start")
    ap.add_argument("--quick", action="store_true", help="a shorter run (under 2 minutes in all)")
    ap.add_argument("--lead", type=float, default=15.0,
                    help="seconds between planning the run and its second 0, for Spark to start the nodes")
    ap.set_defaults(batch=16 * KiB)
    args = ap.parse_args(argv)
    if args.duration is None:
        args.duration = 70.0 if args.quick else 150.0
    return args


def zipf_rates(n: int, s: float, total: float) -> list[float]:
    weights = [1.0 / (k ** s) for k in range(1, n + 1)]
    scale = total / sum(weights)
    return [w * scale for w in weights]


def balancer_config(quick: bool) -> dict:
    """BalancerConfig keywords for the test: rounds every 2 s, 4 s after a move (the nodes report
    every 0.5 s over 3 s windows), a 10 % band, and a detect threshold far under the traffic."""
    return dict(bytes_in_detect_threshold=256 * KiB, bytes_out_detect_threshold=256 * KiB,
                bytes_in_deviation_ratio=0.1, loop_interval_s=2.0, settle_s=3.0 if quick else 4.0,
                lease_ttl_s=3.0, metrics_window_s=10.0, action_rate_limit_per_s=5.0, max_actions_per_plan=8)


def run(argv=None) -> dict:
    args = parse(argv)
    with deployment(args, "balance", args.nodes) as dep:
        report = _run(args, dep)
    return publish(report, dep.out, plot, format_report)


def _run(args, dep) -> dict:
    from benchmarks.balancer_plan import run as bench_plan
    from s3stream.cluster import Cluster
    from s3stream.metadata import open_metadata
    from s3stream.objectstore import open_object_store
    names = [f"p{i:02d}" for i in range(args.partitions)]           # by rank: p00 is the hottest
    rates = dict(zip(names, zipf_rates(len(names), args.zipf, args.rate * 1e6)))
    cold = names[-1]
    rates_after = dict(rates, **{cold: rates[names[0]]})
    per_node = -(-len(names) // args.nodes)
    initial = {name: 1 + i // per_node for i, name in enumerate(names)}
    change_at = args.warmup + (args.duration - args.warmup) / 2
    meta = open_metadata(dep.meta)
    store = open_object_store(dep.store)
    try:
        cluster = Cluster(meta, store)
        for name, node in initial.items():
            cluster.assign(name, node)
    finally:
        meta.close()
        store.close()
    origin = time.time() + args.lead    # Spark's start and the nodes' open take a few seconds
    ccfg = dict(agent_interval=0.02, report_interval=0.5, report_window=3.0, heartbeat_timeout=10.0)
    run_id = new_run_id()
    specs = []
    for node in range(1, args.nodes + 1):
        spec = node_spec(args, node, dep.wal_dir, dep.store, dep.meta, names, 0, ccfg, keep_acks=True,
                         inflight=4, run_id=run_id)
        spec.update(rates=rates, rates_after=rates_after, change_at=change_at, origin=origin,
                    balancer=balancer_config(args.quick), balancer_start=args.warmup)
        # every node runs until origin + duration, wherever its Spark task started
        spec["duration"] = args.duration + (origin - time.time())
        specs.append(spec)
    progress(f"{args.nodes} nodes, {len(names)} partitions, {args.rate:g} MB/s Zipf(s={args.zipf:g}); hottest "
             f"{rates[names[0]] / 1e6:.2f} MB/s; {cold} turns hot at {change_at:.0f} s; balancers from "
             f"{args.warmup:g} s; {args.duration:g} s in all")
    assign_metrics_ports(specs, args.metrics_port, args.metrics_addr)
    results = run_nodes(dep.spark, specs, run_nodes_of_partition, seconds=origin + args.duration - time.time())
    progress(f"placement: {format_placement(placement(results))}")
    progress("verifying every acknowledged record through the driver's own client")
    verification = verify_acks(dep.store, dep.meta, results, args.batch)
    progress("planning 10,000 partitions on 100 nodes (simulated)")
    planning = bench_plan(partitions=10_000, nodes=100, seed=1)
    return summarize(args, dep, results, verification, planning, rates, rates_after, initial, change_at, origin)


def node_series(results: list[dict], duration: float) -> dict[int, list[float]]:
    """Each node's bytes acknowledged per second, seconds 0 .. duration-1 on the driver's clock."""
    seconds = int(duration)
    series = {}
    for r in results:
        row = [0.0] * seconds
        for second, nbytes in r["timeline"]:
            if 0 <= second < seconds:
                row[int(second)] += nbytes
        series[r["node_id"]] = row
    return series


def imbalance(series: dict[int, list[float]], start: int, end: int) -> float | None:
    """Max node bytes-in rate over mean, over seconds [start, end)."""
    sums = [sum(row[start:end]) for row in series.values()]
    mean = sum(sums) / len(sums) if sums else 0
    return max(sums) / mean if mean else None


def settled_after(series: dict[int, list[float]], start: int, end: int, target: float) -> float | None:
    """Seconds from `start` until the imbalance over each following WINDOW-second window stays
    <= target up to `end` (None: never)."""
    last_bad = None
    for t in range(start, end - WINDOW + 1):
        value = imbalance(series, t, t + WINDOW)
        if value is None or value > target:
            last_bad = t
    if last_bad is None:
        return 0.0
    if last_bad + 1 > end - WINDOW:
        return None
    return float(last_bad + 1 + WINDOW - start)


def summarize(args, dep, results, verification, planning, rates, rates_after, initial, change_at,
              origin: float) -> dict:
    duration = int(args.duration)
    series = node_series(results, duration)
    change = int(change_at)
    target = TARGETS["imbalance_after"]
    moves = sorted((h for r in results if r.get("balancer") for h in r["balancer"]["history"]
                    if h.get("outcome") == "moved"), key=lambda h: h["at"])
    move_seconds = [h["at"] - origin for h in moves]
    from_start = settled_after(series, 0, change, target)
    from_change = settled_after(series, change, duration, target)
    return dict(
        kind="balance", **dep.describe(), nodes=args.nodes, partitions=args.partitions, rate_mb_s=args.rate,
        zipf=args.zipf, duration=args.duration, change_at=change_at, warmup=args.warmup,
        imbalance_before=imbalance(series, 0, WINDOW),
        imbalance_before_change=imbalance(series, change - WINDOW, change),
        imbalance_after=imbalance(series, duration - WINDOW, duration),
        seconds_to_balance=(None if from_start is None or from_change is None else max(from_start, from_change)),
        seconds_to_balance_detail=dict(from_start=from_start, from_change=from_change),
        moves=sum(_migrations(h) for h in moves),
        moves_last_10s=sum(_migrations(h) for h, s in zip(moves, move_seconds) if s >= duration - WINDOW),
        move_log=[dict(h, second=round(s, 2)) for h, s in zip(moves, move_seconds)],
        acked=verification["acknowledged"], lost=verification["lost"], verification=verification,
        plan_seconds_10k_100=planning["plan_seconds"], planning=planning,
        leaders=sorted({r["node_id"] for r in results if r.get("balancer") and r["balancer"]["rounds"]}),
        series={str(k): v for k, v in series.items()}, rates=rates, rates_after=rates_after, initial=initial,
        targets=TARGETS, placement=placement(results),
        errors=[e for r in results for e in r["errors"]][:20]
        + [e for r in results if r.get("balancer") for e in r["balancer"]["errors"]][:20],
    )


def _migrations(action: dict) -> int:
    """Partitions an executed action moved: 2 for a swap."""
    return 2 if action.get("swap") else 1


def plot(report: dict, out: str) -> list[str]:
    plt = pyplot("spark_bench balance")
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(10, 5))
    for node, row in sorted(report["series"].items()):
        ax.plot(range(len(row)), [b / 1e6 for b in row], label=f"node {node}")
    ax.axvline(report["change_at"], color="k", linestyle="--", label="cold partition turns hot")
    ax.axvline(report["warmup"], color="grey", linestyle=":", label="balancers start")
    for m in report["move_log"]:
        ax.axvline(m["second"], color="r", alpha=0.3, linewidth=0.8)
    ax.set_xlabel("seconds (red: a move)")
    ax.set_ylabel("bytes in, MB/s")
    ax.set_title(f"Balancer: {report['nodes']} nodes, {report['partitions']} Zipf partitions; imbalance "
                 f"{report['imbalance_before']:.2f} -> {report['imbalance_after']:.2f}")
    ax.legend(loc="upper right", fontsize=8)
    return [save_figure(plt, fig, out, "traffic.png")]


def format_report(r: dict) -> str:
    t = r["targets"]
    stb = r["seconds_to_balance"]
    lines = [
        "=" * 100,
        f"Balancer under load on {r['master']}: {r['nodes']} nodes, {r['partitions']} partitions, "
        f"{r['rate_mb_s']:g} MB/s Zipf(s={r['zipf']:g}), hot spot at {r['change_at']:.0f} s",
        f"imbalance (max node bytes-in / mean): first {WINDOW} s {r['imbalance_before']:.2f}, before the change "
        f"{r['imbalance_before_change']:.2f}, last {WINDOW} s {r['imbalance_after']:.2f} "
        f"(target <= {t['imbalance_after']}: {verdict(r['imbalance_after'] <= t['imbalance_after'])})",
        f"seconds to balance: from the start {r['seconds_to_balance_detail']['from_start']}, from the change "
        f"{r['seconds_to_balance_detail']['from_change']} (target <= {t['seconds_to_balance']:g}: "
        f"{verdict(stb is not None and stb <= t['seconds_to_balance'])})",
        f"moves: {r['moves']} in all, {r['moves_last_10s']} in the last {WINDOW} s (target <= "
        f"{t['moves_last_10s']}: {verdict(r['moves_last_10s'] <= t['moves_last_10s'])}); leader(s): {r['leaders']}",
        f"acknowledged records: {r['acked']}, lost: {r['lost']}",
        f"planning 10,000 partitions on 100 nodes: {r['plan_seconds_10k_100']:.3f} s (target < "
        f"{t['plan_seconds']:g} s: {verdict(r['plan_seconds_10k_100'] < t['plan_seconds'])})",
    ]
    if r["errors"]:
        lines.append(f"errors: {r['errors'][:5]}")
    return "\n".join(lines)
