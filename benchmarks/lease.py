"""What the lease costs appends (issue 26): one node's append throughput with its lease held
and renewed (as a NodeAgent renews it, every heartbeat_interval) against the same node without
a lease, in alternating rounds of one run, so that drift of the disk hits both alike.

    python3 -m s3stream bench --kind lease [-- --rounds 24 --seconds 1 --size 1024]

Reports records/s per round, the median of the pairs' ratios (target: within 3%, i.e. >= 0.97), and
writes report.json and a PNG under reports/lease/.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import wal
from benchmarks.kit import periodic

from benchmarks.engine import DiscardingStore, lean_producers
from s3stream.client import StreamClient
from s3stream.config import Config, GiB, MiB
from s3stream.metadata import SqliteMetadataStore
from s3stream.objectstore import LocalObjectStore
from s3stream.batches import RecordBatch

#: The issue's target: the lease costs at most 3% of the append throughput.
TARGET_RATIO = 0.97


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="s3stream bench --kind lease", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=24, help="alternating pairs of rounds")
    p.add_argument("--seconds", type=float, default=1.0, help="seconds per round")
    p.add_argument("--size", type=int, default=1024, help="record payload bytes")
    p.add_argument("--threads", type=int, default=4, help="producer threads, one stream each")
    p.add_argument("--lease", type=float, default=2.5, help="lease seconds (ClusterConfig default: 2.5)")
    p.add_argument("--renew-every", type=float, default=0.5, help="seconds between renewals (heartbeat_interval)")
    p.add_argument("--workdir", default=None, help="where the WAL goes (default: a temporary directory)")
    p.add_argument("--out", default="reports/lease", help="report directory")
    p.add_argument("--quick", action="store_true", help="2 pairs of 1 s rounds")
    return p


def run(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.rounds, args.seconds = 2, 1.0
    work = tempfile.mkdtemp(prefix="s3stream-lease-", dir=args.workdir)
    store_dir = tempfile.mkdtemp(prefix="s3stream-lease-store-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    config = Config(upload_threshold=64 * MiB, cache_size=512 * MiB, reclaim_interval=None,
                    wal=wal.WALConfig(capacity=2 * GiB, full_timeout=60.0))
    store = DiscardingStore(LocalObjectStore(store_dir))
    store.discard = True                # the store is not what is measured
    client = StreamClient(1, os.path.join(work, "node1.wal"), store, SqliteMetadataStore(os.path.join(work, "m.db")),
                          config)
    rounds: list[dict] = []
    try:
        streams = [client.create_stream() for _ in range(args.threads)]
        batch = RecordBatch(os.urandom(args.size), 1)
        appends = [s.append for s in streams]
        lean_producers(appends, batch, 1 << 40, 64, max(2.0, args.seconds))      # warm-up, uncounted

        def renew() -> None:
            client.renew_lease(time.monotonic_ns(), args.lease)

        for pair in range(args.rounds):
            for mode in (("lease", "none") if pair % 2 == 0 else ("none", "lease")):
                if mode == "lease":
                    renew()
                    with periodic(renew, args.renew_every, "lease-renewer"):
                        records, seconds = lean_producers(appends, batch, 1 << 40, 64, args.seconds)
                else:
                    client.write_ahead_log.set_ack_deadline(None)
                    records, seconds = lean_producers(appends, batch, 1 << 40, 64, args.seconds)
                rounds.append(dict(pair=pair, mode=mode, records=records, seconds=seconds,
                                   records_per_s=records / seconds))
                print(f"  pair {pair + 1}/{args.rounds} {mode:>5}: {records / seconds:,.0f} records/s", flush=True)
        stats = client.stats()
    finally:
        client.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(store_dir, ignore_errors=True)
    with_lease = statistics.median(r["records_per_s"] for r in rounds if r["mode"] == "lease")
    without = statistics.median(r["records_per_s"] for r in rounds if r["mode"] == "none")
    # The disk's speed drifts between rounds: each pair's ratio compares neighbours, and the
    # median of those is what is judged.
    pairs = [[r["records_per_s"] for r in rounds if r["pair"] == p] for p in range(args.rounds)]
    pair_ratios = [next(r["records_per_s"] for r in rounds if r["pair"] == p and r["mode"] == "lease")
                   / next(r["records_per_s"] for r in rounds if r["pair"] == p and r["mode"] == "none")
                   for p in range(args.rounds) if len(pairs[p]) == 2]
    ratio = statistics.median(pair_ratios)
    report = dict(kind="lease", size=args.size, threads=args.threads, rounds=rounds, lease_s=args.lease,
                  renew_every_s=args.renew_every, median_with_lease=with_lease, median_without=without,
                  pair_ratios=pair_ratios, ratio=ratio, target_ratio=TARGET_RATIO, met=ratio >= TARGET_RATIO,
                  lease_refusals=stats["append"]["lease_refusals"], held_advances=stats["wal"]["held_advances"])
    print(format_report(report))
    write_report(report, args.out)
    return report


def format_report(report: dict) -> str:
    return "\n".join([
        f"Lease cost, {report['size']} B records, {report['threads']} producers, one node (store discarding):",
        f"  with the lease held (renewed every {report['renew_every_s']} s): {report['median_with_lease']:,.0f} "
        f"records/s (median)",
        f"  without a lease:                                   {report['median_without']:,.0f} records/s (median)",
        f"  pair ratios {', '.join(f'{r:.2f}' for r in report['pair_ratios'])}",
        f"  median pair ratio {report['ratio']:.3f} (target >= {report['target_ratio']}: within 3%) "
        f"{'met' if report['met'] else 'MISSED'}; appends refused for an expired lease: {report['lease_refusals']}, "
        f"durable advances held: {report['held_advances']}"])


def write_report(report: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for mode, colour in (("lease", "tab:blue"), ("none", "tab:orange")):
        xs = [r["pair"] + (0.0 if mode == "lease" else 0.35) for r in report["rounds"] if r["mode"] == mode]
        ax.bar(xs, [r["records_per_s"] for r in report["rounds"] if r["mode"] == mode], width=0.35, color=colour,
               label="lease held" if mode == "lease" else "no lease")
    ax.set_xlabel("pair of rounds")
    ax.set_ylabel("records/s")
    ax.set_title(f"Appends with and without the lease: ratio {report['ratio']:.3f} (target >= 0.97)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "lease.png"), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    run()
