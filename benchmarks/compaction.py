"""Compaction benchmark: a long mixed workload with and without compaction, and read cost.

    python -m benchmarks.compaction [--quick] [--out DIR] [--duration S] [--streams N]

Three runs of the same workload on a fresh node each (without compaction, with, without again):
1,000 streams whose append rates follow a Zipf law (a few hot streams, a long tail of nearly idle
ones), batch sizes 256 B to 32 KiB, a fixed ingest rate (open loop, so latency is comparable), and
time-based retention (every stream is trimmed to what was appended in the last --retention
seconds). Compaction intervals are scaled to the run's length. Reported, each figure next to what
it is judged against:
- object count over time: committed SSOs of the node and StreamObjects of the busiest stream,
  total objects and bytes (bounded with compaction, growing without);
- write amplification of compaction: bytes compaction wrote / bytes uploaded (target <= 2), and
  the total (bytes uploaded + bytes compaction wrote) / bytes uploaded;
- append latency p99 with compaction over without (target <= 1.5), the baseline run once before
  and once after the compaction run; also the median of per-5-s-window p99s, which one burst of
  outside disk activity does not move;
- stored bytes against the bytes retention keeps;
- read cost: distinct objects and GETs per catch-up read of a stream (cold caches), on run A's
  data before compaction, after one SSO compaction round, and after force split + merges.

Objects and the metadata database live on /dev/shm when it exists: the store stands for S3 and the
metadata for a controller quorum, neither of which shares the WAL's disk (the retention trimmer
alone makes ~300 metadata transactions a second, whose fsyncs on the WAL's disk would dominate the
append latency of both runs). The WAL lives in --workdir. Report: report.json and compaction.png
in --out.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import itertools
import json
import os
import random
import shutil
import threading
import time

import wal
from benchmarks.kit import log_line, percentiles, progress, progress_over, pyplot, save_figure

from s3stream import Config, FetchedBatch, RecordBatch, StreamClient
from s3stream.engine.logcache import LogCache
from s3stream.metadata import SqliteMetadataStore
from s3stream.objectstore import LocalObjectStore
from s3stream.engine.readpath import Reader

from compaction import CompactionConfig, Compactor, attach, object_stats

KiB, MiB = 1024, 1024 ** 2
TARGETS = {"write_amplification": 2.0, "p99_ratio": 1.5}
SIZES = (256, 1 * KiB, 4 * KiB, 16 * KiB, 32 * KiB)
SIZE_WEIGHTS = (30, 30, 20, 15, 5)


def _progress(msg: str) -> None:
    log_line(f"[benchmarks.compaction {time.strftime('%H:%M:%S')}] {msg}")


class KeyRecordingStore:
    """Wraps a store and records which keys were read (objects touched by a read)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.url = inner.url
        self.keys: set[str] = set()
        self.gets = 0

    def get(self, key, start=0, end=None):
        self.keys.add(key)
        self.gets += 1
        return self._inner.get(key, start, end)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class Workload:
    """Producers at a fixed byte rate over Zipf-weighted streams, a retention trimmer, and a
    sampler of object counts."""

    def __init__(self, client: StreamClient, args, seed: int) -> None:
        self.client = client
        self.args = args
        self.streams = [client.create_stream() for _ in range(args.streams)]
        weights = [1 / (rank + 1) ** args.zipf for rank in range(args.streams)]
        self.cum = list(itertools.accumulate(weights))
        self.payloads = {size: random.Random(size).randbytes(size) for size in SIZES}
        self.seed = seed
        self.latencies: list[int] = []
        self.appended: dict[int, collections.deque] = {s.stream_id: collections.deque() for s in self.streams}
        self.retained = {s.stream_id: 0 for s in self.streams}
        self.samples: list[dict] = []
        self.trims = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()

    def _producer(self, index: int) -> None:
        rng = random.Random(self.seed * 100 + index)
        rate = self.args.rate / self.args.threads
        window: collections.deque = collections.deque()
        started = time.monotonic()
        sent = 0
        lat = self.latencies
        try:
            while not self._stop.is_set():
                ahead = sent / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(min(ahead, 0.05))
                    continue
                stream = self.streams[bisect.bisect(self.cum, rng.random() * self.cum[-1])]
                size = rng.choices(SIZES, SIZE_WEIGHTS)[0]
                t0 = time.monotonic_ns()
                future = stream.append(RecordBatch(self.payloads[size], 1 + size % 7))
                history, retained, sid = self.appended[stream.stream_id], self.retained, stream.stream_id

                def done(f, t0=t0, size=size, history=history, sid=sid):
                    now = time.monotonic_ns()
                    lat.append((now, now - t0))
                    if f.exception() is None:
                        history.append((now, f.result().base_offset + 1 + size % 7, size))
                        retained[sid] += size

                future.add_done_callback(done)
                window.append(future)
                sent += size
                if len(window) >= 64:
                    window.popleft().result(60)
            while window:
                window.popleft().result(60)
        except BaseException as e:   # noqa: BLE001 - reported after the run
            self.errors.append(e)

    def _trimmer(self) -> None:
        """Time-based retention: trim each stream to its first offset appended within it."""
        try:
            while not self._stop.wait(self.args.trim_every):
                horizon = time.monotonic_ns() - int(self.args.retention * 1e9)
                for s in self.streams:
                    history = self.appended[s.stream_id]
                    offset = None
                    while history and history[0][0] < horizon:
                        _, offset, size = history.popleft()
                        self.retained[s.stream_id] -= size
                    if offset is not None and offset > s.start_offset:
                        s.trim(offset)
                        self.trims += 1
        except BaseException as e:   # noqa: BLE001
            self.errors.append(e)

    def _sampler(self, meta, started: float) -> None:
        while not self._stop.wait(self.args.sample_every):
            stats = object_stats(meta)
            self.samples.append(dict(
                t=time.monotonic() - started, objects=stats["committed"]["count"],
                bytes=stats["committed"]["bytes"], ssos=stats["stream_set_objects"]["count"],
                sos=stats["stream_objects"]["count"],
                max_sos_per_stream=stats["max_stream_objects_per_stream"],
                max_ssos_per_node=stats["max_stream_set_objects_per_node"],
                waiting_deletion=stats["mark_destroyed"]["count"] + stats["prepared"]["count"],
                retained_bytes=sum(self.retained.values())))

    def run(self, meta, duration: float) -> float:
        started = time.monotonic()
        threads = [threading.Thread(target=self._producer, args=(i,)) for i in range(self.args.threads)]
        threads += [threading.Thread(target=self._trimmer), threading.Thread(target=self._sampler,
                                                                             args=(meta, started))]
        for t in threads:
            t.start()
        self._stop.wait(duration)
        self._stop.set()
        for t in threads:
            t.join()
        if self.errors:
            raise self.errors[0]
        return time.monotonic() - started


def engine_config(args) -> Config:
    return Config(upload_threshold=args.upload_threshold, split_size=args.split_size,
                  object_block_size=64 * KiB, max_batch_bytes=64 * KiB, cache_size=4 * args.upload_threshold,
                  block_cache_size=16 * MiB, readahead_bytes=1 * MiB, reclaim_interval=1.0,
                  destroy_delay=args.destroy_delay, wal=wal.WALConfig(capacity=512 * MiB, full_timeout=60))


def compaction_config(args) -> CompactionConfig:
    return CompactionConfig(sso_interval=args.sso_interval, force_split_age=args.force_split_age,
                            so_interval=args.so_interval, split_size=args.split_size,
                            small_object_size=args.split_size, stream_object_max_size=16 * MiB,
                            memory_budget=args.memory_budget, read_chunk=1 * MiB,
                            object_block_size=64 * KiB, throttle_bytes_per_s=args.throttle)


def _meta_path(args, name: str) -> str:
    return os.path.join(args.store_dir, f"{name}-meta.db")


def _slope_per_minute(samples: list[dict], key: str) -> float:
    """Least-squares slope of `key` over the second half of the run, per minute."""
    half = samples[len(samples) // 2:]
    if len(half) < 2:
        return 0.0
    ts = [s["t"] for s in half]
    ys = [s[key] for s in half]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return 60 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0


def latency_report(samples: list[tuple[int, int]], started_ns: int, warmup: float, window: float) -> dict:
    """Percentiles after the warm-up, plus the median over `window`-second windows of each
    window's p99: one burst of outside disk activity moves the overall p99 but not that median."""
    kept = [(t, lat) for t, lat in samples if t - started_ns >= warmup * 1e9]
    out = percentiles([lat for _, lat in kept])
    windows: dict[int, list[int]] = collections.defaultdict(list)
    for t, lat in kept:
        windows[int((t - started_ns) / (window * 1e9))].append(lat)
    p99s = sorted(percentiles(w)["p99_ms"] for w in windows.values() if len(w) >= 100)
    out["window_p99_median_ms"] = p99s[len(p99s) // 2] if p99s else None
    out["window_p99_ms"] = p99s
    return out


def run_case(args, name: str, with_compaction: bool) -> dict:
    workdir = os.path.join(args.workdir, name)
    store_dir = os.path.join(args.store_dir, name)
    for d in (workdir, store_dir):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    meta = SqliteMetadataStore(_meta_path(args, name))
    store = LocalObjectStore(store_dir)
    client = StreamClient(1, os.path.join(workdir, "node1.wal"), store, meta, engine_config(args))
    workload = Workload(client, args, seed=1)
    runner = attach(client, compaction_config(args)) if with_compaction else None
    _progress(f"run {name}: {args.streams} streams, {args.rate / MiB:.0f} MiB/s for {args.duration:.0f} s, "
              f"compaction {'on' if with_compaction else 'off'}")
    started_ns = time.monotonic_ns()
    with progress_over(args.duration, f"run {name}"):
        elapsed = workload.run(meta, args.duration)
    stats = client.stats()
    if runner is not None:
        runner.stop()
    compaction_stats = stats.get("compaction")
    uploaded = stats["upload"]["bytes"]
    streams = [s.stream_id for s in workload.streams]
    client.close()
    result = dict(name=name, compaction=with_compaction, seconds=elapsed, uploaded_bytes=uploaded,
                  appends=len(workload.latencies), trims=workload.trims,
                  latency=latency_report(workload.latencies, started_ns, args.warmup, 5.0),
                  samples=workload.samples,
                  final=object_stats(meta), streams=streams)
    if compaction_stats:
        totals = compaction_stats["totals"]
        result["compaction_totals"] = totals
        result["write_amplification"] = (uploaded + totals["bytes_written"]) / uploaded
        result["peak_memory"] = compaction_stats["peak_memory"]
        result["memory_budget"] = compaction_stats["memory_budget"]
    result["bounds"] = dict(
        max_objects=max((s["objects"] for s in workload.samples), default=0),
        max_ssos_per_node=max((s["max_ssos_per_node"] for s in workload.samples), default=0),
        max_sos_per_stream=max((s["max_sos_per_stream"] for s in workload.samples), default=0),
        last_half_max_objects=max((s["objects"] for s in workload.samples[len(workload.samples) // 2:]), default=0),
        objects_per_minute=_slope_per_minute(workload.samples, "objects"),
        ssos_per_minute=_slope_per_minute(workload.samples, "ssos"))
    last = workload.samples[-1] if workload.samples else None
    if last:
        result["storage_over_retained"] = last["bytes"] / max(1, last["retained_bytes"])
    meta.close()
    return result


def read_cost(args, store_dir: str, meta: SqliteMetadataStore, stream_ids: list[int]) -> dict:
    """Distinct objects and GETs per catch-up read of each stream, with cold caches."""
    out = {}
    for stream_id in stream_ids:
        m = meta.get_stream(stream_id)
        store = KeyRecordingStore(LocalObjectStore(store_dir))
        reader = Reader(store, meta, LogCache(64 * MiB, 128 * MiB, time.monotonic_ns, FetchedBatch),
                        Config(block_cache_size=64 * MiB, readahead_bytes=1 * MiB, read_fetch_size=1 * MiB))
        pos = m.start_offset
        nbytes = 0
        try:
            while pos < m.end_offset:
                batches = reader.read(stream_id, pos, m.end_offset, 1 * MiB)
                nbytes += sum(len(b.payload) for b in batches)
                pos = batches[-1].end_offset
        finally:
            reader.close()
        out[str(stream_id)] = dict(objects=len(store.keys), gets=store.gets, bytes=nbytes)
    return out


def read_cost_case(args, base: dict) -> dict:
    """Read cost on run A's data: as uploaded, after an SSO compaction round, after force split
    and StreamObject merges."""
    meta = SqliteMetadataStore(_meta_path(args, base["name"]))
    store_dir = os.path.join(args.store_dir, base["name"])
    ranks = [r for r in (0, 9, 99, 499) if r < len(base["streams"])]
    chosen = [base["streams"][r] for r in ranks]
    stages = {"uploaded": read_cost(args, store_dir, meta, chosen)}
    config = compaction_config(args)
    node = meta.get_node(1)
    compactor = Compactor(LocalObjectStore(store_dir), meta, 1, node.node_epoch, config)
    compactor.compact_stream_sets()
    stages["sso_compacted"] = read_cost(args, store_dir, meta, chosen)
    old = Compactor(LocalObjectStore(store_dir), meta, 1, node.node_epoch, config,
                    clock=lambda: time.time_ns() + int(config.force_split_age * 2e9))
    old.compact_stream_sets()
    old.compact_stream_objects()
    stages["split_and_merged"] = read_cost(args, store_dir, meta, chosen)
    meta.close()
    return dict(ranks=ranks, streams=chosen, stages=stages)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compaction", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="reports/compaction-bench", help="report directory (JSON + PNG)")
    ap.add_argument("--workdir", default=None, help="WAL and metadata directory (default: OUT/work)")
    ap.add_argument("--store-dir", default=None, help="object store directory (default: /dev/shm/...)")
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of stream append rates")
    ap.add_argument("--rate", type=float, default=8 * MiB, help="ingest bytes per second")
    ap.add_argument("--threads", type=int, default=2, help="producer threads")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per run (three runs)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of latency samples left out")
    ap.add_argument("--retention", type=float, default=25.0, help="seconds of data each stream keeps")
    ap.add_argument("--trim-every", type=float, default=3.0)
    ap.add_argument("--sample-every", type=float, default=1.0)
    ap.add_argument("--upload-threshold", type=int, default=8 * MiB)
    ap.add_argument("--split-size", type=int, default=1 * MiB)
    ap.add_argument("--sso-interval", type=float, default=4.0)
    ap.add_argument("--force-split-age", type=float, default=16.0)
    ap.add_argument("--so-interval", type=float, default=8.0)
    ap.add_argument("--memory-budget", type=int, default=64 * MiB)
    ap.add_argument("--throttle", type=int, default=48 * MiB, help="compaction bytes/s (read + written)")
    ap.add_argument("--destroy-delay", type=float, default=2.0)
    ap.add_argument("--quick", action="store_true", help="tiny sizes and seconds (CI smoke run)")
    ap.add_argument("--keep", action="store_true", help="keep the work and store directories")
    return ap


def run(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.streams, args.rate = min(args.streams, 100), 2 * MiB
        args.duration = min(args.duration, 4.0)
        args.retention, args.trim_every, args.sample_every = 2.0, 0.5, 0.25
        args.upload_threshold, args.split_size = 1 * MiB, 128 * KiB
        args.sso_interval, args.force_split_age, args.so_interval = 0.5, 1.5, 1.0
        args.memory_budget, args.destroy_delay, args.warmup = 8 * MiB, 0.2, 0.5
    os.makedirs(args.out, exist_ok=True)
    args.workdir = os.path.abspath(args.workdir or os.path.join(args.out, "work"))
    own_store = args.store_dir is None
    if own_store:
        args.store_dir = (os.path.join("/dev/shm", f"compaction-bench-{os.getpid()}") if os.path.isdir("/dev/shm")
                          else os.path.join(args.workdir, "objects"))
    try:
        # A, B, A again: the baseline brackets the compaction run in time, so slow drift of the
        # machine (other processes, the disk) does not land on one side only.
        with progress(total=4, desc="benchmarks.compaction", unit="phase") as phases:
            base = run_case(args, "without", with_compaction=False)
            phases.update()
            comp = run_case(args, "with", with_compaction=True)
            phases.update()
            again = run_case(args, "without-again", with_compaction=False)
            phases.update()
            _progress("read cost before and after compaction")
            reads = read_cost_case(args, base)
            phases.update()
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
            if own_store:
                shutil.rmtree(args.store_dir, ignore_errors=True)
    def baseline(key):
        return (base["latency"][key] + again["latency"][key]) / 2

    report = dict(args={k: v for k, v in vars(args).items()}, targets=TARGETS, runs=[base, comp, again],
                  read_cost=reads, p99_ratio=comp["latency"]["p99_ms"] / baseline("p99_ms"),
                  window_p99_ratio=comp["latency"]["window_p99_median_ms"] / baseline("window_p99_median_ms"),
                  p50_ratio=comp["latency"]["p50_ms"] / baseline("p50_ms"),
                  compaction_write_ratio=comp["compaction_totals"]["bytes_written"] / comp["uploaded_bytes"])
    for r in report["runs"]:
        r.pop("streams")
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    report["plots"] = write_plots(report, args.out)
    print(format_report(report))
    return report


def format_report(report: dict) -> str:
    runs = report["runs"]
    comp = runs[1]
    a = report["args"]
    lines = [f"compaction bench: {a['streams']} streams (Zipf {a['zipf']}), {a['rate'] / MiB:.0f} MiB/s, "
             f"{a['duration']:.0f} s per run, retention {a['retention']:.0f} s",
             f"{'':34}" + "".join(f"{r['name']:>16}" for r in runs)]

    def row(label, get):
        cells = []
        for r in runs:
            v = get(r)
            cells.append(f"{v:>16,}" if isinstance(v, int) else f"{v:>16,.2f}")
        lines.append(f"{label:34}" + "".join(cells))

    row("objects at end", lambda r: r["final"]["committed"]["count"])
    row("max objects (2nd half of run)", lambda r: r["bounds"]["last_half_max_objects"])
    row("object growth /min (2nd half)", lambda r: r["bounds"]["objects_per_minute"])
    row("SSO growth /min (2nd half)", lambda r: r["bounds"]["ssos_per_minute"])
    row("max SSOs per node", lambda r: r["bounds"]["max_ssos_per_node"])
    row("max StreamObjects per stream", lambda r: r["bounds"]["max_sos_per_stream"])
    row("stored / retained bytes (end)", lambda r: r.get("storage_over_retained", 0.0))
    row("append p50 ms", lambda r: r["latency"]["p50_ms"])
    row("append p99 ms", lambda r: r["latency"]["p99_ms"])
    row("append p99 ms, median of 5 s", lambda r: r["latency"]["window_p99_median_ms"] or 0.0)
    t = comp["compaction_totals"]
    lines += [
        f"p99 with / without (mean of both baseline runs): {report['p99_ratio']:.2f}; median-of-windows p99 "
        f"ratio {report['window_p99_ratio']:.2f} (target <= {TARGETS['p99_ratio']})",
        f"compaction bytes written / bytes uploaded: {report['compaction_write_ratio']:.2f} (target <= "
        f"{TARGETS['write_amplification']}); total write amplification (uploaded + compaction) / uploaded: "
        f"{comp['write_amplification']:.2f}",
        f"uploaded {comp['uploaded_bytes'] / MiB:,.0f} MiB; compaction read {t['bytes_read'] / MiB:,.0f} MiB, "
        f"wrote {t['bytes_written'] / MiB:,.0f} MiB, dropped {t['bytes_dropped'] / MiB:,.0f} MiB in {t['commits']} "
        f"commits ({t['failed_commits']} refused and re-planned)",
        f"compaction peak memory {comp['peak_memory'] / MiB:.1f} MiB of a {comp['memory_budget'] / MiB:.0f} MiB "
        f"budget; throttled {t['throttled_seconds']:.1f} s",
        "read cost (distinct objects / GETs per catch-up read, cold caches) on the first baseline run's data:",
    ]
    rc = report["read_cost"]
    for rank, sid in zip(rc["ranks"], rc["streams"]):
        cells = [f"{rc['stages'][st][str(sid)]['objects']}/{rc['stages'][st][str(sid)]['gets']}"
                 for st in ("uploaded", "sso_compacted", "split_and_merged")]
        lines.append(f"  stream rank {rank + 1:>4}: as uploaded {cells[0]:>9}, after SSO compaction {cells[1]:>9}, "
                     f"after force split + merges {cells[2]:>9}")
    return "\n".join(lines)


def write_plots(report: dict, out: str) -> list[str]:
    plt = pyplot("benchmarks.compaction")
    if plt is None:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for run, style in zip(report["runs"], ("--", "-", ":")):
        label = "with compaction" if run["compaction"] else run["name"]
        t = [s["t"] for s in run["samples"]]
        axes[0].plot(t, [s["objects"] for s in run["samples"]], style, label=f"objects, {label}")
        axes[1].plot(t, [s["bytes"] / MiB for s in run["samples"]], style, label=f"stored, {label}")
        if run["compaction"]:
            axes[1].plot(t, [s["retained_bytes"] / MiB for s in run["samples"]], "-.", label="retained payload")
            axes[2].plot(t, [s["ssos"] for s in run["samples"]], label="SSOs of the node")
            axes[2].plot(t, [s["max_sos_per_stream"] for s in run["samples"]], label="max SOs of one stream")
    axes[0].set(title="committed objects", xlabel="s", ylabel="objects")
    axes[1].set(title="committed bytes", xlabel="s", ylabel="MiB")
    axes[2].set(title="bounds with compaction", xlabel="s", ylabel="objects")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return [save_figure(plt, fig, out, "compaction.png")]


def main() -> None:
    run()


if __name__ == "__main__":
    main()
