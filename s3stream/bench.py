"""Engine benchmark: ingest, object-store requests per GiB, catch-up and tail reads.

    python -m s3stream.bench [--quick] [--out DIR]

Everything is measured in one run, each figure next to the limit it is judged against:
- WAL-only ingest: the same producers (64 KiB batches, 128 in flight each) appending straight to
  a WAL on the same file: the ceiling for the engine, whose appends go through that WAL.
- Engine ingest into 1,000 streams on the local store: MB/s, append latency p50/p99/p999 (call
  to future completion), ratio to WAL-only (target >= 0.7).
- Object-store write requests (PUT + multipart parts, as S3 would count them) and objects
  created per GiB ingested, for 10 and for 1,000 streams, against the floor of one request per
  part size.
- Catch-up read of the 10-stream data set from objects by a fresh node (cold block cache, files
  evicted from the page cache) against a raw sequential read of the same object files, equally
  cold (target >= 0.7); tail read from the log cache.

For the 1,000-stream ingest the object store directory defaults to /dev/shm when it exists: the
store stands for S3, which does not share the WAL's disk (on-disk objects would halve the disk
bandwidth the WAL gets). The 10-stream data set is stored on disk next to the WAL, because the
catch-up read is judged against reading those files from the device.
Report: JSON and PNG plots in --out.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import threading
import time

import wal
from wal.bench import fmt_size, parse_size, percentiles

from . import Config, RecordBatch, StreamClient
from .metadata import ObjectState, SqliteMetadataStore
from .objectstore import InstrumentedObjectStore, LocalObjectStore
from .reporting import pyplot, save_figure

KiB, MiB, GiB = 1024, 1024 ** 2, 1024 ** 3
TARGETS = {"ingest_ratio": 0.7, "catchup_ratio": 0.7}


def _progress(msg: str) -> None:
    print(f"[s3stream.bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Producers:
    """`threads` producers, each keeping up to `inflight` appends pending, until `total` bytes.
    `submit(i, payload)` returns an object with .result(); latency = submit to completion."""

    def __init__(self, submit, payload: bytes, threads: int, inflight: int, total: int) -> None:
        self.submit, self.payload, self.threads, self.inflight, self.total = submit, payload, threads, inflight, total
        self.latencies: list[int] = []
        self.sent = 0
        self._lock = threading.Lock()

    def run(self) -> float:
        per_thread = self.total // self.threads // len(self.payload)

        def body(t: int) -> None:
            window: collections.deque = collections.deque()
            lat: list[int] = []

            def track(handle_or_future, t0: int) -> None:
                # completion time from the completion itself, not from when the producer looks
                handle_or_future.add_done_callback(lambda _f: lat.append(time.monotonic_ns() - t0))

            for i in range(per_thread):
                t0 = time.monotonic_ns()
                f = self.submit(t + i * self.threads, self.payload)
                track(f, t0)
                window.append(f)
                if len(window) >= self.inflight:
                    window.popleft().result()
            while window:
                window.popleft().result()
            with self._lock:
                self.latencies += lat
                self.sent += per_thread * len(self.payload)

        start = time.perf_counter()
        workers = [threading.Thread(target=body, args=(t,)) for t in range(self.threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - start


class WalOnly:
    """The same producers appending straight to a WAL on the same disk: the engine's ceiling."""

    def __init__(self, path: str, cfg: wal.WALConfig, payload: bytes, threads: int) -> None:
        if os.path.exists(path):
            os.unlink(path)
        self.path, self.payload, self.threads = path, payload, threads
        self.wal = wal.WriteAheadLog.open(path, node_id=999, config=cfg)
        self.trim_every = cfg.capacity // 4
        self.next_trim = self.trim_every

    def _submit(self, i: int, data: bytes):
        h = self.wal.append(data)
        if h.end > self.next_trim:
            self.next_trim = h.end + self.trim_every
            self.wal.trim(max(self.wal.durable_end - self.trim_every, self.wal.trim_offset))
        return h

    def run(self, total: int) -> tuple[int, float, list[int]]:
        p = Producers(self._submit, self.payload, self.threads, 128, total)
        elapsed = p.run()
        return p.sent, elapsed, p.latencies

    def close(self) -> None:
        self.wal.close()
        os.unlink(self.path)


def engine_ingest(workdir: str, store_dir: str, config: Config, payload: bytes, threads: int, total: int,
                  nstreams: int, rounds: int = 1, keep_open: bool = False) -> tuple[dict, StreamClient | None, list]:
    """Ingest `total` bytes into `nstreams` streams in `rounds` parts, each right after an equal
    WAL-only part on the same disk, so that drift of the device affects both alike."""
    store = InstrumentedObjectStore(LocalObjectStore(store_dir))
    meta = SqliteMetadataStore(os.path.join(workdir, "meta.db"))
    client = StreamClient(1, os.path.join(workdir, "node1.wal"), store, meta, config)
    walonly = WalOnly(os.path.join(workdir, "walonly.wal"), config.wal, payload, threads)
    streams = [client.create_stream() for _ in range(nstreams)]
    stop = threading.Event()

    def report_progress():
        while not stop.wait(2.0):
            _progress(f"  ingest {nstreams} streams: {client.stats()['wal'].get('record_bytes', 0) / MiB:,.0f} MiB")

    threading.Thread(target=report_progress, daemon=True).start()
    sent = wsent = 0
    elapsed = welapsed = 0.0
    lat: list[int] = []
    wlat: list[int] = []
    per_round = []
    for _ in range(rounds):
        b, t, l = walonly.run(total // rounds)
        wsent, welapsed, wlat = wsent + b, welapsed + t, wlat + l
        p = Producers(lambda i, data: streams[i % nstreams].append(RecordBatch(data, 1)), payload, threads, 128,
                      total // rounds)
        t = p.run()
        sent, elapsed, lat = sent + p.sent, elapsed + t, lat + p.latencies
        per_round.append(dict(wal_mb_s=b / welapsed / 1e6 if rounds == 1 else None,
                              ratio=(p.sent / t) / (b / (welapsed - sum(r["wal_s"] for r in per_round))),
                              wal_s=welapsed - sum(r["wal_s"] for r in per_round)))
    stop.set()
    walonly.close()
    t0 = time.perf_counter()
    if not keep_open:
        for s in streams:
            s.close()
    drain = time.perf_counter() - t0
    upload = dict(client.stats()["upload"])
    stats = store.stats()
    objects = [o for o in meta.list_objects(state=ObjectState.COMMITTED)]
    gib = sent / GiB
    result = dict(
        streams=nstreams, mb_s=sent / elapsed / 1e6, seconds=elapsed, bytes=sent, close_seconds=drain,
        latency=percentiles(lat), upload=upload, rounds=rounds, round_ratios=[r["ratio"] for r in per_round],
        wal_only=dict(mb_s=wsent / welapsed / 1e6, seconds=welapsed, bytes=wsent, latency=percentiles(wlat)),
        put_requests=stats["put_requests"], objects=len(objects),
        stream_objects=sum(1 for o in objects if o.type.value == "SO"),
        stream_set_objects=sum(1 for o in objects if o.type.value == "SSO"),
        requests_per_gib=stats["put_requests"] / gib, objects_per_gib=len(objects) / gib,
        request_floor_per_gib=GiB / store.part_size,
    )
    result["ratio_to_wal"] = result["mb_s"] / result["wal_only"]["mb_s"]
    if keep_open:
        return result, client, streams
    client.close()
    meta.close()
    return result, None, []


def _evict(paths: list[str]) -> None:
    """Drop the files from the page cache (clean pages; no root needed) so reads are cold."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def catchup_read(workdir: str, store_dir: str, config: Config) -> dict:
    """A fresh node reads every stream from its start (cold caches) vs raw reads of the objects.
    Both passes start with the object files evicted from the page cache."""
    meta = SqliteMetadataStore(os.path.join(workdir, "meta.db"))
    paths = [os.path.join(store_dir, o.key) for o in meta.list_objects(state=ObjectState.COMMITTED)]
    meta.close()
    _evict(paths)
    t0 = time.perf_counter()
    raw = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(MiB):
                raw += len(chunk)
    raw_s = time.perf_counter() - t0
    _evict(paths)
    client = StreamClient(2, os.path.join(workdir, "node2.wal"), f"file://{store_dir}",
                          f"sqlite:///{workdir}/meta.db", config)
    ids = [m.stream_id for m in client.list_streams()]
    t0 = time.perf_counter()
    got = 0
    for sid in ids:
        s = client.open_stream(sid)
        pos = s.start_offset
        while pos < s.confirm_offset:
            res = s.fetch(pos, max_bytes=MiB)
            got += res.total_bytes
            pos = res.end_offset
    read_s = time.perf_counter() - t0
    stats = dict(client.stats()["read"])
    client.close()
    return dict(bytes=got, mb_s=got / read_s / 1e6, raw_bytes=raw, raw_mb_s=raw / raw_s / 1e6,
                ratio=(got / read_s) / (raw / raw_s), reader=stats, store="disk, page cache evicted")


def tail_read(streams, rounds: int = 3) -> dict:
    """Fetch the newest data of every stream from the log cache (the client is still open)."""
    t0 = time.perf_counter()
    got = 0
    for _ in range(rounds):
        for s in streams:
            start = max(s.start_offset, s.confirm_offset - 16)
            got += s.fetch(start, max_bytes=MiB).total_bytes
    el = time.perf_counter() - t0
    return dict(bytes=got, mb_s=got / el / 1e6)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m s3stream.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="reports/engine-bench", help="report directory (JSON + PNG)")
    ap.add_argument("--workdir", default=None, help="WAL and metadata directory (default: OUT/work)")
    ap.add_argument("--store-dir", default=None, help="object store directory (default: /dev/shm/... if present)")
    ap.add_argument("--ingest", type=parse_size, default=2 * GiB, help="bytes ingested into 1,000 streams")
    ap.add_argument("--dataset", type=parse_size, default=1 * GiB, help="bytes ingested into 10 streams")
    ap.add_argument("--batch", type=parse_size, default=64 * KiB, help="batch payload size")
    ap.add_argument("--threads", type=int, default=4, help="producer threads")
    ap.add_argument("--rounds", type=int, default=4,
                    help="alternate this many WAL-only and engine rounds (the disk's speed drifts)")
    ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    ap.add_argument("--keep", action="store_true", help="keep the work and store directories")
    return ap


def run(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.ingest, args.dataset = 96 * MiB, 64 * MiB
    os.makedirs(args.out, exist_ok=True)
    base_work = os.path.abspath(args.workdir or os.path.join(args.out, "work"))
    base_store = os.path.abspath(args.store_dir) if args.store_dir else (os.path.join("/dev/shm", f"s3stream-bench-{os.getpid()}")
                                    if os.path.isdir("/dev/shm") else os.path.join(base_work, "objects"))
    config = Config() if not args.quick else Config(upload_threshold=16 * MiB, split_size=4 * MiB,
                                                    cache_size=64 * MiB,
                                                    wal=wal.WALConfig(capacity=256 * MiB, full_timeout=60))
    payload = os.urandom(args.batch)
    report: dict = dict(config=dict(upload_threshold=config.upload_threshold, split_size=config.split_size,
                                    object_block_size=config.object_block_size, wal_capacity=config.wal.capacity,
                                    batch=args.batch, threads=args.threads, inflight=128,
                                    store_dir=base_store, workdir=base_work), targets=TARGETS)
    runs = []
    try:
        for name, total, nstreams in (("1000 streams", args.ingest, 1000), ("10 streams", args.dataset, 10)):
            work = os.path.join(base_work, str(nstreams))
            # The 10-stream data set is read back cold from disk, so its objects live on disk.
            store = os.path.join(base_store if nstreams == 1000 else work, "objects")
            for d in (work, store):
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
            _progress(f"ingest of {fmt_size(total)} into {name}, alternating with WAL-only rounds")
            keep = nstreams == 1000
            res, client, streams = engine_ingest(work, store, config, payload, args.threads, total, nstreams,
                                                 rounds=args.rounds, keep_open=keep)
            if client is not None:
                _progress("tail read from the log cache")
                res["tail_read"] = tail_read(streams)
                for s in streams:
                    s.close()
                client.close()
            if nstreams == 10:
                _progress("catch-up read from objects (fresh node, cold caches)")
                res["catchup"] = catchup_read(work, store, config)
            runs.append(res)
    finally:
        if not args.keep:
            shutil.rmtree(base_store, ignore_errors=True)
            shutil.rmtree(base_work, ignore_errors=True)
    report["runs"] = runs
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    report["plots"] = write_plots(report, args.out)
    print(format_report(report))
    return report


def format_report(report: dict) -> str:
    lines = ["=" * 100, "s3stream engine benchmark (" + ", ".join(f"{k}={v}" for k, v in report["config"].items()) + ")"]
    for r in report["runs"]:
        lat = r["latency"]
        rr = ", ".join(f"{x:.2f}" for x in r["round_ratios"])
        lines.append(f"\nIngest into {r['streams']} streams: {r['mb_s']:.0f} MB/s "
                     f"({fmt_size(r['bytes'])} in {r['seconds']:.1f} s; close/drain {r['close_seconds']:.2f} s)")
        lines.append(f"  WAL-only, same producers, same disk, alternating rounds: {r['wal_only']['mb_s']:.0f} MB/s  ->  ratio "
                     f"{r['ratio_to_wal']:.2f} (target >= {TARGETS['ingest_ratio']}: "
                     f"{'MET' if r['ratio_to_wal'] >= TARGETS['ingest_ratio'] else 'MISSED'}; per round {rr})")
        lines.append(f"  append latency p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms, p99.9 {lat['p999_ms']:.1f} ms"
                     f"  (WAL-only p99 {r['wal_only']['latency']['p99_ms']:.1f} ms)")
        lines.append(f"  object store: {r['put_requests']} write requests = {r['requests_per_gib']:.1f} per GiB "
                     f"(floor {r['request_floor_per_gib']:.0f} per GiB at the part size); {r['objects']} objects = "
                     f"{r['objects_per_gib']:.1f} per GiB ({r['stream_objects']} SO, {r['stream_set_objects']} SSO)")
        if "tail_read" in r:
            lines.append(f"  tail read from the log cache: {r['tail_read']['mb_s']:.0f} MB/s")
        if "catchup" in r:
            c = r["catchup"]
            lines.append(f"  catch-up read of {c['bytes'] / MiB:,.0f} MiB "
                         f"from objects: {c['mb_s']:.0f} MB/s; raw read of the same objects {c['raw_mb_s']:.0f} MB/s"
                         f"  ->  ratio {c['ratio']:.2f} (target >= {TARGETS['catchup_ratio']}: "
                         f"{'MET' if c['ratio'] >= TARGETS['catchup_ratio'] else 'MISSED'})")
    if report.get("plots"):
        lines.append("\nplots: " + ", ".join(report["plots"]))
    lines.append("=" * 100)
    return "\n".join(lines)


def write_plots(report: dict, out: str) -> list[str]:
    plt = pyplot("s3stream.bench")
    if plt is None:
        return []
    runs = report["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    names = [f"{r['streams']} streams" for r in runs]
    x = range(len(runs))
    axes[0].bar([i - 0.2 for i in x], [r["wal_only"]["mb_s"] for r in runs], 0.4, label="WAL only")
    axes[0].bar([i + 0.2 for i in x], [r["mb_s"] for r in runs], 0.4, label="engine")
    axes[0].set_xticks(list(x), names)
    axes[0].set_ylabel("MB/s")
    axes[0].set_title("Ingest throughput")
    axes[0].legend()
    for i, (key, label) in enumerate((("p50_ms", "p50"), ("p99_ms", "p99"), ("p999_ms", "p99.9"))):
        axes[1].bar([j + (i - 1) * 0.27 for j in x], [r["latency"][key] for r in runs], 0.27, label=label)
    axes[1].set_xticks(list(x), names)
    axes[1].set_ylabel("ms")
    axes[1].set_title("Append latency")
    axes[1].legend()
    axes[2].bar([i - 0.2 for i in x], [r["requests_per_gib"] for r in runs], 0.4, label="write requests / GiB")
    axes[2].bar([i + 0.2 for i in x], [r["objects_per_gib"] for r in runs], 0.4, label="objects / GiB")
    axes[2].axhline(runs[0]["request_floor_per_gib"], color="black", ls="--", lw=1, label="floor (1 per part)")
    axes[2].set_xticks(list(x), names)
    axes[2].set_title("Object-store cost")
    axes[2].legend(fontsize=8)
    return [save_figure(plt, fig, out, "engine.png")]


def main() -> None:
    run()


if __name__ == "__main__":
    main()
