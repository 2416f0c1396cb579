"""Visibility benchmark (issue 51): how soon a reader that is not a node sees an acknowledged
record, and what the node pays for it in PUTs, with the default Config.

    python3 -m s3stream bench --kind visibility [--quick] [-- --rates 10,100,10000,max --store standard]

A node (default `Config`: `upload_interval` 0.5 s, the visibility deadline; a WAL file; a local
object store in the work directory, optionally behind S3-like injected PUT latency, `--store
standard`: median 30 ms, p99 150 ms; SQLite metadata, whose host feed pushes commits between
processes) appends 1 KiB records (one record per append, `--in-flight` appends outstanding) at
each rate of `--rates` for `--seconds`, `max` as fast as it can. A reader in another process
tails the stream (`open_reader(...).tail`, default poll_interval). Both read the same wall clock:
a record's latency is when the reader yielded it minus when its append was acknowledged (the
callback on the client's callback thread, so at most that thread's lag late). The writer keeps
the stream open until the reader saw every record (or 30 s): records seen only after that are
counted as not seen.

Printed per rate: append-to-seen p50/p99, records not seen, the node's object PUTs per second
(write requests of committed objects; the WAL file makes none) and per GiB beside the floor, the
uploads by trigger. Targets (issue 51): p99 <= 1 s at every rate; <= 4 PUTs/s at 10 and 100
records/s. Anchors: a Kafka consumer sees a record within milliseconds of its acknowledgement;
WarpStream's end-to-end p99 ~0.9 s on S3 Standard; Aiven Inkless ~1.6 s.
Report: report.json and visibility.png in --out (default reports/visibility).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import wal
from benchmarks.kit import log_line, percentiles, publish, pyplot, save_figure

from benchmarks.reader import child_lines
from benchmarks.wal_objects import PROFILES, LatencyStore
from s3stream.client import StreamClient
from s3stream.config import Config, MiB
from s3stream.objectstore import LocalObjectStore
from s3stream.batches import RecordBatch
from s3stream.engine.uploadpolicy import request_cost_per_gib, requests_floor

TARGET_P99_S = 1.0
TARGET_LIGHT_PUTS_PER_S = 4.0
LIGHT_RATES = (10.0, 100.0)
ANCHORS = [
    "Kafka: a consumer sees a record milliseconds after its acknowledgement (no object store in the path)",
    "WarpStream: end-to-end p99 ~0.9 s on S3 Standard (250 ms batches)",
    "Aiven Inkless (diskless Kafka): end-to-end p99 ~1.6 s",
]
GIB = 1 << 30
RECORD = 1024
WAL_CAPACITY = 1 << 30

#: The tailing reader: "ready" once tailing, then one line per batch: [base, count, wall ns],
#: until it has seen `last` or no commit came for `idle` seconds.
TAIL_CHILD = """
import json, sys, time
from s3stream import open_reader
meta, store, sid, last, idle = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
with open_reader(meta, store) as reader:
    print("ready", flush=True)
    for batch in reader.tail(sid, 0, idle_timeout=idle):
        print(json.dumps([batch.base_offset, batch.count, time.time_ns()]), flush=True)
        if batch.base_offset + batch.count >= last:
            break
"""


def measure(rate: float | None, seconds: float, work: str, store_kind: str, in_flight: int) -> dict:
    """One rate (None: as fast as the node goes): append for `seconds`, the reader tailing."""
    name = "max" if rate is None else f"{rate:g}"
    root = os.path.join(work, f"rate-{name}")
    os.makedirs(root)
    meta_url = f"sqlite:///{root}/meta.db"
    local = LocalObjectStore(os.path.join(root, "objects"))
    store: Any = LatencyStore(local, *PROFILES[store_kind]) if store_kind in PROFILES else local
    config = Config(reclaim_interval=None, wal=wal.WALConfig(capacity=WAL_CAPACITY))
    client = StreamClient(1, os.path.join(root, "node.wal"), store, meta_url, config)
    acked: dict[int, int] = {}
    child = None
    try:
        stream = client.create_stream()
        child = subprocess.Popen([sys.executable, "-c", TAIL_CHILD, meta_url, f"file://{root}/objects",
                                  str(stream.stream_id), str(1 << 62), "60"], stdout=subprocess.PIPE, text=True)
        lines = child_lines(child.stdout)
        if lines.get(timeout=60) != "ready":
            raise RuntimeError(f"the tailing reader did not start (exit code {child.poll()})")
        payload = os.urandom(RECORD)
        slots = threading.Semaphore(in_flight)

        def done(future) -> None:
            at = time.time_ns()
            slots.release()
            try:
                acked[future.result().base_offset] = at
            except Exception:           # noqa: BLE001 - counted: its offset is never seen
                pass

        before = client.stats()["upload"]
        started = time.monotonic()
        sent = 0
        while True:
            now = time.monotonic() - started
            if now >= seconds:
                break
            if rate is not None and sent >= rate * now:
                time.sleep(min(0.01, (sent + 1) / rate - now))
                continue
            slots.acquire()
            client_future = stream.append(RecordBatch(payload, 1))
            client_future.add_done_callback(done)
            sent += 1
        for _ in range(in_flight):      # every append answered
            slots.acquire()
        elapsed = time.monotonic() - started
        last = max(acked) + 1 if acked else 0
        seen: dict[int, int] = {}
        until = time.monotonic() + 30
        while (len(seen) < len(acked)) and time.monotonic() < until:
            try:
                line = lines.get(timeout=max(0.01, until - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            base, count, at = json.loads(line)
            for o in range(base, base + count):
                seen[o] = at
        wait_s = time.monotonic() - started - elapsed
        after = client.stats()["upload"]
    finally:
        if child is not None:
            child.kill()
            child.wait()
        client.close()
    lat = [seen[o] - acked[o] for o in acked if o in seen]
    requests = after["write_requests"] - before["write_requests"]
    nbytes = after["bytes"] - before["bytes"]
    objects = after["objects"] - before["objects"]
    window = elapsed + wait_s          # uploads continue until the reader saw the last record
    per_gib = requests / (nbytes / GIB) if nbytes else None
    floor = requests_floor(nbytes, objects, getattr(store, "part_size", 16 * MiB)) / (nbytes / GIB) if nbytes else None
    triggers = {t: c["objects"] - before["triggers"].get(t, {}).get("objects", 0)
                for t, c in after["triggers"].items()}
    return dict(rate=name, records=len(acked), records_per_s=len(acked) / elapsed, mb_s=len(acked) * RECORD / elapsed / 1e6,
                latency=percentiles(lat), not_seen=len(acked) - len(lat), last_offset=last,
                puts_per_s=requests / window, requests=requests, objects=objects, bytes=nbytes,
                requests_per_gib=per_gib, floor_per_gib=floor,
                usd_per_gib=request_cost_per_gib(per_gib) if per_gib is not None else None,
                triggers={t: n for t, n in triggers.items() if n})


def judge(rows: list[dict]) -> list[dict]:
    targets = []
    for r in rows:
        p99 = r["latency"]["p99_ms"]
        ok = p99 is not None and p99 / 1e3 <= TARGET_P99_S and r["not_seen"] == 0
        targets.append(dict(what=f"{r['rate']} rec/s: append-to-seen p99 <= 1 s, all seen", ours=p99, target=1e3,
                            met=ok))
        if r["rate"] in {f"{x:g}" for x in LIGHT_RATES}:
            targets.append(dict(what=f"{r['rate']} rec/s: PUTs/s <= {TARGET_LIGHT_PUTS_PER_S:g}", ours=r["puts_per_s"],
                                target=TARGET_LIGHT_PUTS_PER_S, met=r["puts_per_s"] <= TARGET_LIGHT_PUTS_PER_S))
    return targets


def format_report(report: dict) -> str:
    lines = [f"Visibility to a reader in another process, default Config (upload_interval "
             f"{report['upload_interval']} s), 1 KiB records, store: {report['store']}", ""]
    lines.append(f"{'rate rec/s':>10} {'got rec/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'not seen':>8} "
                 f"{'PUTs/s':>7} {'req/GiB':>8} {'floor':>6} {'$/GiB':>8}  uploads by trigger")
    for r in report["rows"]:
        lat = r["latency"]
        fmt = lambda x, f: "-" if x is None else format(x, f)       # noqa: E731
        lines.append(f"{r['rate']:>10} {r['records_per_s']:>10.0f} {fmt(lat['p50_ms'], '8.0f')} "
                     f"{fmt(lat['p99_ms'], '8.0f')} {r['not_seen']:>8} {r['puts_per_s']:>7.2f} "
                     f"{fmt(r['requests_per_gib'], '8.0f')} {fmt(r['floor_per_gib'], '6.0f')} "
                     f"{fmt(r['usd_per_gib'], '8.5f')}  {r['triggers']}")
    lines += ["", "Targets (issue 51):"]
    for t in report["targets"]:
        lines.append(f"  {'met ' if t['met'] else 'MISSED'} {t['what']}: ours {t['ours']}, target {t['target']}")
    lines += ["", "Anchors (published):"] + [f"  {a}" for a in ANCHORS]
    return "\n".join(lines)


def plot(report: dict, out: str) -> list[str]:
    plt = pyplot("benchmarks.visibility")
    if plt is None:
        return []
    rows = report["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(rows))
    axes[0].bar([i - 0.2 for i in x], [r["latency"]["p50_ms"] or 0 for r in rows], 0.4, label="p50")
    axes[0].bar([i + 0.2 for i in x], [r["latency"]["p99_ms"] or 0 for r in rows], 0.4, label="p99")
    axes[0].axhline(TARGET_P99_S * 1e3, color="red", linestyle="--", label="target p99")
    axes[0].set_xticks(list(x), [r["rate"] for r in rows])
    axes[0].set_xlabel("records/s")
    axes[0].set_ylabel("append to seen, ms")
    axes[0].legend()
    axes[1].bar(list(x), [r["puts_per_s"] for r in rows])
    axes[1].axhline(TARGET_LIGHT_PUTS_PER_S, color="red", linestyle="--", label="target at 10, 100 rec/s")
    axes[1].set_xticks(list(x), [r["rate"] for r in rows])
    axes[1].set_ylabel("object PUTs per second")
    axes[1].legend()
    return [save_figure(plt, fig, out, "visibility.png")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="s3stream bench --kind visibility", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="10,100,10000,max", help="records a second, comma-separated; max: unpaced")
    p.add_argument("--seconds", type=float, default=None, help="seconds of appends per rate (default 10; --quick 3)")
    p.add_argument("--store", choices=["local", *PROFILES], default="local",
                   help="the object store: local, or local behind injected S3-like PUT latency")
    p.add_argument("--in-flight", type=int, default=64, help="appends outstanding at most")
    p.add_argument("--workdir", default=None, help="where WALs, objects and metadata go (default: a temporary directory)")
    p.add_argument("--out", default=os.path.join("reports", "visibility"), help="report directory")
    p.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    return p


def run(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    seconds = args.seconds or (3.0 if args.quick else 10.0)
    try:
        rates = [None if r.strip() == "max" else float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rates must be numbers or max, got {args.rates!r}")
    if args.quick:
        rates = [r for r in rates if r is None or r <= 100][:2] or rates[:1]
    if args.in_flight < 1:
        parser.error(f"--in-flight must be at least 1, got {args.in_flight}")
    work = tempfile.mkdtemp(prefix="s3stream-visibility-", dir=args.workdir)
    rows = []
    try:
        for rate in rates:
            log_line(f"visibility: {'max' if rate is None else f'{rate:g}'} records/s for {seconds:g} s")
            rows.append(measure(rate, seconds, work, args.store, args.in_flight))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = dict(kind="visibility", store=args.store, seconds=seconds, upload_interval=Config().upload_interval,
                  rows=rows, anchors=ANCHORS)
    report["targets"] = judge(rows)
    report["met"] = all(t["met"] for t in report["targets"])
    return publish(report, args.out, plot, format_report)


if __name__ == "__main__":
    run()
