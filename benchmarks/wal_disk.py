"""WAL throughput benchmark: `python -m benchmarks.wal_disk [--quick] [options]`.

One run measures, on ONE file (the WAL's own, preallocated file):

1. The physical limit: raw sequential pwrite + fdatasync of 1 MiB blocks (O_DIRECT when the
   filesystem allows it) over the file's data area, one write in flight, the way the WAL's single
   writer thread issues them. It is measured before the WAL cases and again after them; the
   higher of the two is the limit the cases are compared with (conservative on a noisy machine).
   Shorter raw runs between the cases follow the drift of a shared disk: each case is also
   compared with the mean of the runs just before and just after it ("ratio adj").
2. WAL append throughput for each record size x producer-thread count (default 4 KiB and
   64 KiB, 1 and 4 threads). Each producer keeps up to `--inflight` appends in flight: a deque of
   handles; append; when the deque holds that many, pop the oldest and wait for `.result()`.
   A case runs `--warmup` seconds untimed, then `--duration` seconds (or `--case-bytes`) timed.
   Throughput counts record payload (body bytes, no headers) appended in the timed window,
   divided by its length; since at most `inflight` records per thread are in flight, this is the
   durable rate up to that bound. Latency is `handle.completed_ns - handle.submitted_ns` of
   every record submitted in the window. A background thread trims the WAL every `--trim-every`
   bytes so the ring never fills.
3. Synchronous appends, one record at a time (`wal.append(x).result()`), interleaved in chunks
   with raw pwrite + fdatasync of the record size (rounded up to a 4 KiB block) and of the bytes
   the WAL really writes per append, on the same file.

Raw writes after the first WAL session go only to the ring's free space (after the clean end of
the closed WAL, before its trim offset plus capacity), so the file stays a valid WAL.

`--first-start` runs a different, shorter comparison instead: for each preallocate mode, a new
WAL of `--capacity` from `WriteAheadLog.open` to its first durable append, then the sequential
append rate (128 KiB records, trimmed as they go) over the first lap of the ring, while a
background fill still runs, and over the second (steady state). The modes run `--rounds` times in
rotating order (the disk drifts); medians are printed. Output `first-start.json`.

Output: a table on stdout (progress on stderr), `report.json` and, if matplotlib is installed,
`throughput.png` and `latency.png` in `--out`. Targets are printed with whether each was met;
nothing is asserted. The exit status is 0 unless the benchmark itself could not run.
"""
from __future__ import annotations

import argparse
import array
import collections
import json
import math
import os
import platform
import stat
import threading
import time

from _native.walio import AlignedBuffer, datasync
from _native.walrecord import BLOCK, HEADER_AREA, RECORD_HEADER

from benchmarks.kit import fmt_size, log_line, parse_size, percentiles, progress, pyplot, save_figure
from wal.config import PREALLOCATE_MODES, GiB, KiB, MiB, WALConfig
from wal.header import pick_header
from wal.log import WriteAheadLog

#: node id stamped in the benchmark's WAL; a file at --path is reused only if it carries it.
BENCH_NODE_ID = 0xBE7C
MB = 1e6

TARGETS = {
    "throughput_ratio": {4 * KiB: 0.8, 64 * KiB: 0.9},   # record size -> min ratio to the limit
    "p99_ms": 5.0,
}

def _size_list(text: str) -> list[int]:
    return [parse_size(t) for t in text.split(",") if t.strip()]


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return vals


def _progress(msg: str) -> None:
    log_line(f"[benchmarks.wal_disk {time.strftime('%H:%M:%S')}] {msg}")


# ---- the file and raw I/O ----------------------------------------------------------------------

class RawFile:
    """The WAL file opened for raw positioned writes: O_DIRECT if the filesystem allows it."""

    def __init__(self, path: str) -> None:
        self.note = ""
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        try:
            if not hasattr(os, "O_DIRECT"):
                raise OSError(0, "O_DIRECT is not available on this platform")
            self.fd = os.open(path, flags | os.O_DIRECT)
            self.direct = True
        except OSError as e:
            self.fd = os.open(path, flags)
            self.direct = False
            self.note = f"O_DIRECT refused ({e.strerror}): raw writes are buffered + fdatasync"

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> "RawFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prepare_file(path: str, cfg: WALConfig) -> dict:
    """Create (format) the benchmark WAL at `path`. An existing file is replaced only if it is a
    benchmark WAL (our node id) left by an earlier `--keep` run; anything else is refused."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise SystemExit(f"benchmarks.wal_disk: --path {path!r} exists and is not a regular file; refusing to use it")
        fd = os.open(path, os.O_RDONLY)
        try:
            raw = os.pread(fd, HEADER_AREA, 0)
        finally:
            os.close(fd)
        header, _ = pick_header(raw[:BLOCK], raw[BLOCK:2 * BLOCK]) if len(raw) == HEADER_AREA else (None, None)
        if header is None or header.node_id != BENCH_NODE_ID:
            raise SystemExit(f"benchmarks.wal_disk: --path {path!r} exists and is not a benchmark WAL "
                             f"(node {BENCH_NODE_ID:#x}); refusing to overwrite it. Give a new path.")
        os.unlink(path)
    t0 = time.perf_counter()
    wal = WriteAheadLog.open(path, node_id=BENCH_NODE_ID, config=cfg)
    info = dict(create_seconds=time.perf_counter() - t0, wal_direct_io=wal.direct_io,
                data_capacity=wal.capacity, max_record_bytes=wal.max_record_bytes)
    wal.close()
    return info


def free_region(path: str, cfg: WALConfig) -> tuple[int, int]:
    """Logical [start, end) of the ring that holds no live record of the closed WAL at `path`.
    Raw writes there cannot damage the WAL: a scan stops at the clean end before it."""
    wal = WriteAheadLog.open(path, node_id=BENCH_NODE_ID, config=cfg, recovery=True)
    try:
        h = wal.header
        live_end = max(h.clean_end, h.trim_offset)
        start = -(-live_end // BLOCK) * BLOCK + (BLOCK if live_end else 0)
        return start, h.trim_offset + wal.capacity
    finally:
        wal.close()


def _pieces(logical: int, length: int, data_capacity: int):
    """File extents (offset, length) of a logical ring span, split where the ring wraps."""
    pos = logical % data_capacity
    first = min(length, data_capacity - pos)
    yield HEADER_AREA + pos, first
    if first < length:
        yield HEADER_AREA, length - first


class RawWriter:
    """Sequential pwrite + fdatasync of `size`-byte blocks on `fd`, cycling through the logical
    ring span [start, end) of a WAL whose data area is `data_capacity` bytes."""

    def __init__(self, fd: int, region: tuple[int, int], data_capacity: int, size: int) -> None:
        start, end = region
        self.span = (end - start) // size * size
        if self.span <= 0:
            raise SystemExit(f"benchmarks.wal_disk: only {end - start} free bytes in the WAL for raw {size}-byte writes; "
                             "raise --capacity")
        self.fd, self.start, self.data_capacity, self.size = fd, start, data_capacity, size
        self.buf = AlignedBuffer(size)
        memoryview(self.buf)[:] = os.urandom(size)
        self.i = 0
        self.lat = array.array("q")

    def write_one(self) -> None:
        logical = self.start + (self.i * self.size) % self.span
        self.i += 1
        t = time.monotonic_ns()
        for off, n in _pieces(logical, self.size, self.data_capacity):
            self.buf.pwrite(self.fd, n, off)
        datasync(self.fd)
        self.lat.append(time.monotonic_ns() - t)

    def result(self, elapsed: float, direct: bool, note: str) -> dict:
        res = dict(block_bytes=self.size, bytes=self.i * self.size, writes=self.i, seconds=elapsed,
                   mb_s=self.i * self.size / elapsed / MB if elapsed > 0 else float("nan"),
                   writes_s=self.i / elapsed if elapsed > 0 else float("nan"), direct_io=direct,
                   latency=percentiles(self.lat))
        if note:
            res["note"] = note
        return res


def raw_write_test(path: str, region: tuple[int, int], data_capacity: int, total: int, size: int) -> dict:
    """Sequential pwrite + fdatasync of `size`-byte blocks cycling through the ring `region`,
    `total` bytes in all, one write in flight. Returns throughput and per-write latency."""
    with RawFile(path) as f:
        w = RawWriter(f.fd, region, data_capacity, size)
        count = max(1, total // size)
        t0 = time.monotonic_ns()
        for _ in range(count):
            w.write_one()
        return w.result((time.monotonic_ns() - t0) / 1e9, f.direct, f.note)


# ---- WAL cases ------------------------------------------------------------------------------------

class Trimmer(threading.Thread):
    """Trims the WAL to its durable end whenever that is `every` bytes past the trim offset.
    In a thread of its own so producers never stall on the header write + fdatasync."""

    def __init__(self, wal: WriteAheadLog, every: int) -> None:
        super().__init__(name="bench-trimmer", daemon=True)
        self.wal, self.every = wal, every
        self.stopped = threading.Event()
        self.trims = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopped.wait(0.005):
                durable = self.wal.durable_end
                if durable - self.wal.trim_offset >= self.every:
                    self.wal.trim(durable)
                    self.trims += 1
        except BaseException as e:     # reported with the case
            self.error = e

    def stop(self) -> None:
        self.stopped.set()
        self.join()


class Producer(threading.Thread):
    def __init__(self, wal, payload: bytes, inflight: int, clock: dict, budget: int | None,
                 barrier: threading.Barrier, result_timeout: float) -> None:
        super().__init__(name="bench-producer", daemon=True)
        self.wal, self.payload, self.inflight = wal, payload, inflight
        self.clock, self.budget, self.barrier = clock, budget, barrier
        self.result_timeout = result_timeout
        self.records = 0                 # appended in the timed window
        self.stop_ns = 0
        self.lat = array.array("q")
        self.unknown = 0                 # completed_ns was None
        self.error: BaseException | None = None

    def _settle(self, h, ws: int) -> None:
        h.result(self.result_timeout)
        if h.submitted_ns >= ws:
            c = h.completed_ns
            if c is None:
                self.unknown += 1
            else:
                self.lat.append(c - h.submitted_ns)

    def run(self) -> None:
        dq: collections.deque = collections.deque()
        append, payload, inflight = self.wal.append, self.payload, self.inflight
        now = time.monotonic_ns
        try:
            self.barrier.wait()
            ws, we = self.clock["window_start"], self.clock["window_end"]
            budget = self.budget
            records = 0
            while True:
                t = now()
                if t >= ws:
                    if budget is not None:
                        if records >= budget:
                            break
                    elif t >= we:
                        break
                    records += 1
                dq.append(append(payload))
                if len(dq) >= inflight:
                    self._settle(dq.popleft(), ws)
            self.stop_ns = t
            self.records = records
            while dq:
                self._settle(dq.popleft(), ws)
        except BaseException as e:     # reported with the case; never leave the barrier hanging
            self.error = e
            self.barrier.abort()


def run_case(path: str, cfg: WALConfig, size: int, threads: int, args, limit_hint: float | None) -> dict:
    """One record size x thread count on a freshly reopened WAL.

    The WAL is closed and reopened for every case (instead of reused) so each case starts from
    the same state: a new writer session with empty batch buffers, stats() counting this case
    alone, and a ring trimmed to empty by the previous case, so reopening scans nothing. It
    also exercises close + reopen of a WAL that has wrapped its ring many times.
    """
    payloads = [os.urandom(size) for _ in range(threads)]
    clock: dict = {}
    producers: list[Producer] = []
    errors: list[str] = []
    stats: dict = {}
    wal = WriteAheadLog.open(path, node_id=BENCH_NODE_ID, config=cfg)
    trimmer = Trimmer(wal, args.trim_every)
    try:
        wal.trim(wal.trim_offset)           # starts the writer session (recovery scan, header write)

        def set_clock() -> None:
            t0 = time.monotonic_ns()
            clock["window_start"] = t0 + int(args.warmup * 1e9)
            clock["window_end"] = clock["window_start"] + int(args.duration * 1e9)

        barrier = threading.Barrier(threads, action=set_clock)
        budget = None
        if args.case_bytes:
            budget = max(1, args.case_bytes // size // threads)
        producers = [Producer(wal, payloads[i], args.inflight, clock, budget, barrier, args.result_timeout)
                     for i in range(threads)]
        trimmer.start()
        t_case = time.perf_counter()
        try:
            for p in producers:
                p.start()
            for p in producers:
                p.join()
        finally:
            trimmer.stop()
        case_seconds = time.perf_counter() - t_case
        errors += [repr(p.error) for p in producers if p.error is not None and
                   not isinstance(p.error, threading.BrokenBarrierError)]
        if trimmer.error is not None:
            errors.append(f"trimmer: {trimmer.error!r}")
        synced = wal.sync(args.result_timeout)
        if not synced:
            errors.append(f"wal.sync() timed out after {args.result_timeout} s")
        stats = wal.stats()
        if synced and not errors:
            wal.trim(wal.durable_end)       # leave an empty ring for the next session
    finally:
        wal.close()
    records = sum(p.records for p in producers)
    ws = clock.get("window_start", 0)
    stop = max((p.stop_ns for p in producers), default=0)
    seconds = (stop - ws) / 1e9 if stop > ws else float("nan")
    payload = records * size
    lat = array.array("q")
    for p in producers:
        lat.extend(p.lat)
    batches = stats.get("batches", 0)
    res = dict(
        name=f"{fmt_size(size)} x{threads}", record_bytes=size, threads=threads, inflight=args.inflight,
        seconds=seconds, case_seconds=case_seconds, records=records, payload_bytes=payload,
        mb_s=payload / seconds / MB if seconds > 0 else float("nan"),
        records_s=records / seconds if seconds > 0 else float("nan"),
        latency=percentiles(lat), latency_unknown=sum(p.unknown for p in producers),
        trims=trimmer.trims,
        stats=dict(stats, avg_batch_bytes=(stats.get("bytes_written", 0) / batches) if batches else None,
                   written_per_payload=(stats.get("bytes_written", 0) / stats["record_bytes"])
                   if stats.get("record_bytes") else None),
        errors=errors,
    )
    res["queue_floor_ms"] = queue_floor_ms(res, cfg, limit_hint) if limit_hint else None
    return res


def first_start(path: str, cfg: WALConfig, record_bytes: int = 128 * KiB - 64, inflight: int = 64,
                laps: int = 2) -> dict:
    """A new WAL at `path`: seconds from `WriteAheadLog.open` to the first durable append, then
    the payload rate of sequential appends over each lap of the ring (trimmed every 64 MiB)."""
    t0 = time.perf_counter()
    wal = WriteAheadLog.open(path, node_id=BENCH_NODE_ID, config=cfg)
    try:
        wal.append(b"first").result(60)
        first = time.perf_counter() - t0
        trimmer = Trimmer(wal, 64 * MiB)
        trimmer.start()
        payload = os.urandom(record_bytes)
        dq: collections.deque = collections.deque()
        lap_rates, fill_done_at = [], None
        try:
            for lap in range(1, laps + 1):
                lap_end = lap * wal.capacity
                start_end, t_lap = wal.durable_end, time.perf_counter()
                while True:
                    h = wal.append(payload)
                    dq.append(h)
                    if len(dq) >= inflight:
                        dq.popleft().result(60)
                    if fill_done_at is None and wal.stats()["fill_complete"]:
                        fill_done_at = wal.durable_end
                    if h.end >= lap_end:
                        break
                while dq:
                    dq.popleft().result(60)
                seconds = time.perf_counter() - t_lap
                lap_rates.append((wal.durable_end - start_end) / seconds / MB)
        finally:
            trimmer.stop()
        return dict(preallocate=cfg.preallocate, first_append_s=first, lap_mb_s=lap_rates,
                    direct_io=wal.direct_io, fill_complete_at_offset=fill_done_at,
                    stats=wal.stats())
    finally:
        wal.close()


def run_first_start(args) -> dict:
    """`--first-start`: each preallocate mode on a new file in --out, `--rounds` times, the order
    rotated each round so that a drifting disk favours no mode."""
    os.makedirs(args.out, exist_ok=True)
    results: dict = {mode: [] for mode in PREALLOCATE_MODES}
    env = dict(cpu_count=os.cpu_count(), filesystem=_fs_type(os.path.abspath(args.out)), loadavg_start=_loadavg())
    bar = progress(total=args.rounds * len(PREALLOCATE_MODES), desc="benchmarks.wal_disk first start", unit="WAL")
    for rnd in range(args.rounds):
        modes = PREALLOCATE_MODES[rnd % 3:] + PREALLOCATE_MODES[:rnd % 3]
        for mode in modes:
            path = os.path.join(args.out, f"first-start-{mode}.wal")
            if os.path.exists(path):
                raise SystemExit(f"benchmarks.wal_disk: {path!r} exists (an interrupted run?); remove it first")
            cfg = WALConfig(capacity=args.capacity, batch_bytes=args.batch_bytes, buffers=args.buffers,
                            writer_threads=args.writer_threads, preallocate=mode)
            try:
                r = first_start(path, cfg)
            finally:
                if os.path.exists(path):
                    os.unlink(path)
            _progress(f"round {rnd + 1}/{args.rounds} preallocate={mode} ({fmt_size(args.capacity)}): first "
                      f"durable append after {r['first_append_s']:.3f} s; laps "
                      + ", ".join(f"{x:.0f} MB/s" for x in r["lap_mb_s"]))
            results[mode].append(r)
            bar.update()
    bar.close()
    env["loadavg_end"] = _loadavg()

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    summary = {mode: dict(first_append_s=median([r["first_append_s"] for r in rs]),
                          lap1_mb_s=median([r["lap_mb_s"][0] for r in rs]),
                          lap2_mb_s=median([r["lap_mb_s"][1] for r in rs]))
               for mode, rs in results.items()}
    report = dict(capacity=args.capacity, batch_bytes=args.batch_bytes, rounds=args.rounds, summary=summary,
                  results=results, environment=env)
    print(f"medians of {args.rounds} round(s), {fmt_size(args.capacity)} WAL, 128 KiB records:")
    print(f"{'preallocate':<12} {'first append':>13} {'lap 1 MB/s':>11} {'lap 2 MB/s':>11}")
    for mode, m in summary.items():
        print(f"{mode:<12} {m['first_append_s']:>11.3f} s {m['lap1_mb_s']:>11.0f} {m['lap2_mb_s']:>11.0f}")
    jpath = os.path.join(args.out, "first-start.json")
    with open(jpath, "w") as f:
        json.dump(report, f, indent=2, default=str)
        f.write("\n")
    print(f"wrote {jpath}", flush=True)
    return report


def queue_floor_ms(case: dict, cfg: WALConfig, limit_mb_s: float) -> float:
    """Little's law: with N bytes always queued, mean latency >= N / throughput. Queued bytes are
    the producers' in-flight records, but at most what the WAL's batch buffers hold (appends
    beyond that block inside append(), after submitted_ns was taken, one per thread)."""
    rec = case["record_bytes"] + RECORD_HEADER
    queued = min(case["threads"] * case["inflight"] * rec, cfg.buffers * cfg.batch_bytes + case["threads"] * rec)
    return queued / (limit_mb_s * MB) * 1e3


def wal_write_bytes(size: int) -> int:
    """Bytes one synchronous append of a `size`-byte record writes: record + header, padded to
    the next block (the batch starts block-aligned after the previous padded batch)."""
    return -(-(size + RECORD_HEADER) // BLOCK) * BLOCK


def run_sync(path: str, cfg: WALConfig, size: int, count: int, result_timeout: float, chunk: int = 50) -> dict:
    """`count` appends of `size` bytes, each waited for before the next, interleaved in chunks of
    `chunk` with as many raw pwrite + fdatasync of the record size rounded to a block, and of the
    bytes the WAL really writes per append, so that all three see the same device conditions.
    Raw writes go to ring space well ahead of where this session's appends can reach."""
    payload = os.urandom(size)
    lat = array.array("q")
    wall = array.array("q")
    unknown = 0
    now = time.monotonic_ns
    raw_sizes = sorted({-(-size // BLOCK) * BLOCK, wal_write_bytes(size)})
    wal = WriteAheadLog.open(path, node_id=BENCH_NODE_ID, config=cfg)
    try:
        for _ in range(20):                 # warm up: session start, first writes
            wal.append(payload).result(result_timeout)
        # Ring space: this session's appends reach at most `ahead` past the durable end; the raw
        # writes use the rest of the free space after that (before trim offset + capacity).
        ahead = count * (wal_write_bytes(size) + BLOCK) + MiB
        rstart = -(-wal.durable_end // BLOCK) * BLOCK + ahead
        rend = wal.trim_offset + wal.capacity
        share = (rend - rstart) // len(raw_sizes) // BLOCK * BLOCK
        with RawFile(path) as f:
            raws = [RawWriter(f.fd, (rstart + k * share, rstart + (k + 1) * share), wal.capacity, rs)
                    for k, rs in enumerate(raw_sizes)]
            raw_time = [0] * len(raws)
            wal_time = 0
            done = 0
            rnd = 0
            while done < count:
                n = min(chunk, count - done)
                # rotate the order so no kind always follows another
                order = [("wal", None)] + [("raw", k) for k in range(len(raws))]
                order = order[rnd % len(order):] + order[:rnd % len(order)]
                rnd += 1
                for kind, k in order:
                    t0 = now()
                    if kind == "wal":
                        for _ in range(n):
                            t = now()
                            h = wal.append(payload)
                            h.result(result_timeout)
                            wall.append(now() - t)
                            c = h.completed_ns
                            if c is None:
                                unknown += 1
                            else:
                                lat.append(c - h.submitted_ns)
                        wal_time += now() - t0
                    else:
                        for _ in range(n):
                            raws[k].write_one()
                        raw_time[k] += now() - t0
                done += n
            raw_results = [w.result(raw_time[k] / 1e9, f.direct, f.note) for k, w in enumerate(raws)]
        stats = wal.stats()
        wal.trim(wal.durable_end)
    finally:
        wal.close()
    elapsed = wal_time / 1e9
    return dict(record_bytes=size, appends=count, seconds=elapsed, appends_s=count / elapsed,
                latency=percentiles(lat), latency_unknown=unknown, call_latency=percentiles(wall),
                stats=stats, raw=raw_results)


# ---- report ---------------------------------------------------------------------------------------

def _f(v, spec: str = ".2f", width: int = 0) -> str:
    s = "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)
    return s.rjust(width) if width else s


def _met(ok) -> str:
    return "n/a" if ok is None else ("MET" if ok else "MISSED")


def _ratio(a, b):
    return a / b if a is not None and b else None


def _throughput_ok(case: dict):
    want = TARGETS["throughput_ratio"].get(case["record_bytes"])
    r = case.get("ratio")
    if want is None or r is None or math.isnan(r):
        return None
    return r >= want


def evaluate_targets(report: dict) -> list[dict]:
    out = []
    p99_max = TARGETS["p99_ms"]
    for c in report["cases"]:
        want = TARGETS["throughput_ratio"].get(c["record_bytes"])
        if want is not None:
            out.append(dict(what=f"{c['name']} throughput ratio >= {want:.2f}", value=c.get("ratio"),
                            met=_throughput_ok(c)))
        p99 = c["latency"]["p99_ms"]
        out.append(dict(what=f"{c['name']} p99 < {p99_max:g} ms", value=p99,
                        met=None if p99 is None else p99 < p99_max))
    s = report.get("sync")
    if s:
        p99 = s["wal"]["latency"]["p99_ms"]
        out.append(dict(what=f"sync {fmt_size(s['wal']['record_bytes'])} p99 < {p99_max:g} ms", value=p99,
                        met=None if p99 is None else p99 < p99_max))
    return out


def format_table(report: dict) -> str:
    cfg, env, params = report["config"], report["environment"], report["params"]
    lines = []
    rule = "=" * 124
    lines.append(rule)
    lines.append(f"WAL benchmark  {report['path']}  ({'O_DIRECT' if env.get('wal_direct_io') else 'buffered'} WAL on "
                 f"{env.get('filesystem')})  cores={env['cpu_count']}  "
                 f"loadavg {env['loadavg_start']} -> {env.get('loadavg_end')}")
    lines.append(f"config: capacity={fmt_size(cfg['capacity'])} batch_bytes={fmt_size(cfg['batch_bytes'])} "
                 f"buffers={cfg['buffers']} writer_threads={cfg['writer_threads']} preallocate={cfg['preallocate']}"
                 f";  {params['inflight']} appends in flight per producer, "
                 + (f"{fmt_size(params['case_bytes'])}" if params["case_bytes"] else f"{params['duration']:g} s")
                 + f" per case after {params['warmup']:g} s warmup, trim every {fmt_size(params['trim_every'])}")
    lines.append("")
    raw = report["raw"]
    st = raw["start"]
    mode = "O_DIRECT" if st["direct_io"] else "buffered"
    lines.append(f"Physical limit: raw sequential {fmt_size(st['block_bytes'])} {mode} pwrite + fdatasync, "
                 "one in flight, same file")
    for k in ("start", "end"):
        r = raw.get(k)
        if r:
            lines.append(f"  {k:5s}: {r['mb_s']:7.1f} MB/s  ({fmt_size(r['bytes'])} in {r['seconds']:.2f} s; "
                         f"per write p50 {_f(r['latency']['p50_ms'])}, p99 {_f(r['latency']['p99_ms'])}, "
                         f"max {_f(r['latency']['max_ms'])} ms)")
    lines.append(f"  limit: {raw['limit_mb_s']:7.1f} MB/s  (the higher of the two)")
    if st.get("note"):
        lines.append(f"  NOTE: {st['note']}")
    lines.append("")
    lines.append("WAL append throughput (record payload only, 1 MB = 1e6 B; latency = completed_ns - submitted_ns)")
    hdr = (f"{'case':<11}{'MB/s':>7}{'rec/s':>9}{'ratio to':>9}{'target':>8}{'met':>7}{'raw adj':>8}{'ratio':>6}"
           f"{'p50 ms':>8}{'p99 ms':>8}{'p999 ms':>8}{'floor':>6}{'p99<5':>7}"
           f"{'batches':>8}{'avg batch':>10}{'trims':>6}{'waits':>6}")
    hdr2 = (f"{'':<11}{'':>7}{'':>9}{'limit':>9}{'':>8}{'':>7}{'MB/s':>8}{'adj':>6}"
            f"{'':>8}{'':>8}{'':>8}{'ms':>6}{'':>7}{'':>8}{'':>10}{'':>6}{'':>6}")
    lines.append(hdr)
    lines.append(hdr2)
    lines.append("-" * len(hdr))
    p99_max = TARGETS["p99_ms"]
    for c in report["cases"]:
        want = TARGETS["throughput_ratio"].get(c["record_bytes"])
        lat = c["latency"]
        p99ok = None if lat["p99_ms"] is None else lat["p99_ms"] < p99_max
        st = c["stats"]
        avg = st.get("avg_batch_bytes")
        adj = c.get("raw_adjacent")
        lines.append(
            f"{c['name']:<11}{_f(c['mb_s'], '.1f', 7)}{_f(c['records_s'], ',.0f', 9)}{_f(c.get('ratio'), '.3f', 9)}"
            f"{(f'>={want:.2f}' if want else '-'):>8}{_met(_throughput_ok(c)):>7}"
            f"{_f(adj['mb_s'] if adj else None, '.0f', 8)}{_f(c.get('ratio_adjacent'), '.2f', 6)}"
            f"{_f(lat['p50_ms'], '.2f', 8)}{_f(lat['p99_ms'], '.2f', 8)}{_f(lat['p999_ms'], '.2f', 8)}"
            f"{_f(c.get('queue_floor_ms'), '.1f', 6)}{_met(p99ok):>7}"
            f"{_f(st.get('batches'), 'd', 8)}{(_f(avg / KiB, '.0f') + ' KiB' if avg else '-'):>10}"
            f"{c['trims']:>6}{_f(st.get('full_waits'), 'd', 6)}")
        if c["latency_unknown"]:
            lines.append(f"  ({c['latency_unknown']} records had completed_ns=None: left out of the latencies)")
        for e in c["errors"]:
            lines.append(f"  ERROR: {e}")
    lines.append("  raw adj = mean of short raw 1 MiB runs just before and just after the case (the disk is shared "
                 "and drifts);")
    lines.append("            ratio adj = MB/s / raw adj.")
    lines.append("  floor = queued bytes (in-flight records, at most what the WAL's buffers hold) / limit: the mean")
    lines.append("          latency Little's law forces at full speed; p99 < 5 ms cannot be met where floor is near or "
                 "above 5 ms.")
    lines.append("  avg batch = bytes_written / batches of wal.stats() for the whole session (warmup and drain "
                 "included); waits = full_waits.")
    s = report.get("sync")
    if s:
        w = s["wal"]
        lines.append("")
        lines.append(f"Synchronous appends: {fmt_size(w['record_bytes'])} records, one at a time, {w['appends']} "
                     f"appends, interleaved in chunks of {s['chunk']} with the raw writes below")
        lines.append(f"  {'':<44}{'p50 ms':>8}{'p99 ms':>8}{'p999 ms':>9}{'ops/s':>9}{'WAL/raw p50':>13}{'p99':>7}")
        lines.append(f"  {'WAL append(x).result() (handle times)':<44}{_f(w['latency']['p50_ms'], '.3f', 8)}"
                     f"{_f(w['latency']['p99_ms'], '.3f', 8)}{_f(w['latency']['p999_ms'], '.3f', 9)}"
                     f"{_f(w['appends_s'], ',.0f', 9)}")
        lines.append(f"  {'  same, wall clock around the call':<44}{_f(w['call_latency']['p50_ms'], '.3f', 8)}"
                     f"{_f(w['call_latency']['p99_ms'], '.3f', 8)}{_f(w['call_latency']['p999_ms'], '.3f', 9)}")
        for r, cmp in zip(w["raw"], s["comparisons"]):
            label = f"raw {fmt_size(r['block_bytes'])} pwrite+fdatasync"
            if r["block_bytes"] == s["wal_write_bytes"]:
                label += " (= WAL's write)"
            lines.append(f"  {label:<44}{_f(r['latency']['p50_ms'], '.3f', 8)}{_f(r['latency']['p99_ms'], '.3f', 8)}"
                         f"{_f(r['latency']['p999_ms'], '.3f', 9)}{_f(r['writes_s'], ',.0f', 9)}"
                         f"{_f(cmp['p50_ratio'], '.2f', 13)}{_f(cmp['p99_ratio'], '.2f', 7)}")
        avg = s.get("wal_avg_write_bytes")
        lines.append(f"  The WAL writes {_f(avg / KiB if avg else None, '.1f')} KiB per append on average "
                     f"({RECORD_HEADER} B header + {w['record_bytes']} B body, padded to {BLOCK} B blocks).")
        if w["latency_unknown"]:
            lines.append(f"  ({w['latency_unknown']} appends had completed_ns=None)")
    lines.append("")
    lines.append("Targets (printed, not asserted)")
    for t in report["targets"]:
        lines.append(f"  {t['what']:<42} {_f(t['value'], '.3f'):>9}  {_met(t['met'])}")
    lines.append(rule)
    return "\n".join(lines)


def write_plots(report: dict, out: str) -> list[str]:
    plt = pyplot("benchmarks.wal_disk")
    if plt is None:
        return []
    files = []
    cases = report["cases"]
    names = [c["name"] for c in cases]
    limit = report["raw"]["limit_mb_s"]

    fig, ax = plt.subplots(figsize=(8, 4.8))
    vals = [c["mb_s"] if c["mb_s"] == c["mb_s"] else 0 for c in cases]
    colors = ["tab:gray" if _throughput_ok(c) is None else ("tab:green" if _throughput_ok(c) else "tab:red")
              for c in cases]
    bars = ax.bar(names, vals, color=colors)
    for b, c in zip(bars, cases):
        ax.annotate(f"{c['mb_s']:.0f}\n({_f(c.get('ratio'))})", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=8)
    adj = [(i, c["raw_adjacent"]["mb_s"]) for i, c in enumerate(cases) if c.get("raw_adjacent")]
    if adj:
        ax.scatter([i for i, _ in adj], [v for _, v in adj], marker="_", s=900, color="black", lw=1, zorder=3,
                   label="raw around the case (mean before/after)")
    ax.axhline(limit, color="black", lw=1.5, label=f"raw limit {limit:.0f} MB/s")
    for ratio, style in ((0.9, "--"), (0.8, ":")):
        ax.axhline(limit * ratio, color="gray", ls=style, lw=1, label=f"{ratio:.0%} of limit")
    ax.set_ylabel("MB/s of record payload (1 MB = 1e6 B)")
    ax.set_title("WAL append throughput per case (green: target met, red: missed)")
    ax.set_ylim(0, max(vals + [limit] + [v for _, v in adj]) * 1.45)
    ax.legend(loc="upper center", ncol=2, fontsize=7)
    files.append(save_figure(plt, fig, out, "throughput.png"))

    fig, ax = plt.subplots(figsize=(10, 4.8))
    groups = [(c["name"], c["latency"]) for c in cases]
    s = report.get("sync")
    if s:
        groups.append((f"sync WAL\n{fmt_size(s['wal']['record_bytes'])}", s["wal"]["latency"]))
        for r in s["wal"]["raw"]:
            groups.append((f"sync raw\n{fmt_size(r['block_bytes'])}", r["latency"]))
    width = 0.27
    for i, (key, label) in enumerate((("p50_ms", "p50"), ("p99_ms", "p99"), ("p999_ms", "p99.9"))):
        xs = [j + (i - 1) * width for j in range(len(groups))]
        ax.bar(xs, [g[1][key] or 0 for g in groups], width, label=label)
    ax.axhline(TARGETS["p99_ms"], color="red", ls="--", lw=1, label=f"p99 target {TARGETS['p99_ms']:g} ms")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g[0] for g in groups], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("latency, ms (log scale)")
    ax.set_title("Append latency percentiles (WAL: completed_ns - submitted_ns)")
    ax.legend(fontsize=8, ncol=4, loc="upper center")
    ax.set_ylim(top=ax.get_ylim()[1] * 8)
    files.append(save_figure(plt, fig, out, "latency.png"))
    return files


def _fs_type(path: str) -> str | None:
    try:
        best, fstype = "", None
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) > len(best):
                    best, fstype = parts[1], parts[2]
        return fstype
    except OSError:
        return None


def _loadavg() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


# ---- command line -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    d = WALConfig()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.wal_disk", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=os.path.join("reports", "wal-bench"), help="output directory")
    ap.add_argument("--path", default=None, help="WAL file (default: OUT/bench.wal; must be new or an earlier "
                    "benchmark WAL)")
    ap.add_argument("--keep", action="store_true", help="keep the WAL file at the end")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: ~1 s per case, 128 MiB raw, 500 sync appends")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g = ap.add_argument_group("WAL config (WALConfig)")
    g.add_argument("--capacity", type=parse_size, default=GiB, help="WAL file size, header included")
    g.add_argument("--batch-bytes", type=parse_size, default=d.batch_bytes)
    g.add_argument("--buffers", type=int, default=d.buffers)
    g.add_argument("--writer-threads", type=int, default=d.writer_threads)
    # Not WALConfig's default ("background"): the cases would share the disk with the first fill
    # and the raw limit would be measured on unfilled extents, so runs would not compare.
    g.add_argument("--preallocate", choices=PREALLOCATE_MODES, default="zeros",
                   help="how the benchmark's new WAL file is preallocated")
    ap.add_argument("--first-start", action="store_true",
                    help="only compare the preallocate modes: time to the first durable append of a new "
                    "WAL and append rates over its first and second lap (give --capacity 2G for the default)")
    ap.add_argument("--rounds", type=int, default=3, help="--first-start: rounds over the modes")
    g = ap.add_argument_group("throughput cases")
    g.add_argument("--sizes", type=_size_list, default=[4 * KiB, 64 * KiB], help="record sizes, e.g. 4K,64K")
    g.add_argument("--threads", type=_int_list, default=[1, 4], help="producer thread counts, e.g. 1,4")
    g.add_argument("--inflight", type=int, default=128, help="appends in flight per producer thread")
    g.add_argument("--duration", type=float, default=None, help="timed seconds per case (default 5, quick 1)")
    g.add_argument("--case-bytes", type=parse_size, default=None,
                   help="run each case for this many payload bytes instead of --duration")
    g.add_argument("--warmup", type=float, default=None, help="untimed seconds before each case "
                   "(default 0.5, quick 0.2)")
    g.add_argument("--trim-every", type=parse_size, default=64 * MiB,
                   help="trim the WAL each time this much is durable past the trim offset")
    g.add_argument("--result-timeout", type=float, default=60.0,
                   help="seconds to wait for one append before reporting the WAL as hung")
    g = ap.add_argument_group("raw limit and sync latency")
    g.add_argument("--raw-bytes", type=parse_size, default=None, help="bytes per raw run (default 512M, quick 128M)")
    g.add_argument("--raw-block", type=parse_size, default=MiB, help="raw write size")
    g.add_argument("--raw-adjacent", type=parse_size, default=None,
                   help="raw bytes written before, between and after the cases, to follow a drifting disk "
                   "(0: off; default 64M, quick 32M)")
    g.add_argument("--sync-count", type=int, default=None, help="synchronous appends (default 2000, quick 500)")
    g.add_argument("--sync-size", type=parse_size, default=4 * KiB, help="synchronous append record size")
    return ap


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table; write report.json (and plots) to --out; return the report."""
    args = build_parser().parse_args(argv)
    if args.first_start:
        return run_first_start(args)
    if args.duration is None:
        args.duration = 1.0 if args.quick else 5.0
    if args.warmup is None:
        args.warmup = 0.2 if args.quick else 0.5
    if args.raw_bytes is None:
        args.raw_bytes = 128 * MiB if args.quick else 512 * MiB
    if args.sync_count is None:
        args.sync_count = 500 if args.quick else 2000
    if args.raw_adjacent is None:
        args.raw_adjacent = 32 * MiB if args.quick else 64 * MiB
    if args.inflight < 1 or args.sync_count < 1 or args.duration <= 0 or args.warmup < 0:
        raise SystemExit("benchmarks.wal_disk: --inflight and --sync-count must be >= 1, --duration > 0, --warmup >= 0")
    if args.raw_block % BLOCK or args.raw_block <= 0 or args.sync_size <= 0:
        raise SystemExit(f"benchmarks.wal_disk: --raw-block must be a positive multiple of {BLOCK}")
    try:
        cfg = WALConfig(capacity=args.capacity, batch_bytes=args.batch_bytes, buffers=args.buffers,
                        writer_threads=args.writer_threads, preallocate=args.preallocate)
    except Exception as e:
        raise SystemExit(f"benchmarks.wal_disk: bad WAL config: {e}") from None
    out = args.out
    os.makedirs(out, exist_ok=True)
    path = args.path or os.path.join(out, "bench.wal")
    data_capacity = args.capacity - HEADER_AREA
    args.trim_every = min(args.trim_every, max(BLOCK, data_capacity // 4))
    report: dict = dict(
        path=path,
        params=dict(sizes=args.sizes, threads=args.threads, inflight=args.inflight, duration=args.duration,
                    case_bytes=args.case_bytes, warmup=args.warmup, trim_every=args.trim_every,
                    raw_bytes=args.raw_bytes, raw_block=args.raw_block, raw_adjacent=args.raw_adjacent,
                    sync_count=args.sync_count,
                    sync_size=args.sync_size, quick=args.quick),
        config=dict(capacity=cfg.capacity, batch_bytes=cfg.batch_bytes, buffers=cfg.buffers,
                    writer_threads=cfg.writer_threads, preallocate=cfg.preallocate),
        targets_spec=dict(throughput_ratio={fmt_size(k): v for k, v in TARGETS["throughput_ratio"].items()},
                          p99_ms=TARGETS["p99_ms"]),
    )
    env = dict(cpu_count=os.cpu_count(), python=platform.python_version(), platform=platform.platform(),
               filesystem=_fs_type(os.path.dirname(os.path.abspath(path))), loadavg_start=_loadavg())
    report["environment"] = env
    max_size = max(args.sizes + [args.sync_size])
    t_all = time.perf_counter()
    created = False
    # one step per phase and per case, advanced between them: nothing inside a timed section
    steps = progress(total=4 + len(args.sizes) * len(args.threads), desc="benchmarks.wal_disk", unit="step")
    try:
        nphase = 4
        _progress(f"phase 0/{nphase}: creating {fmt_size(args.capacity)} WAL at {path} "
                  f"(preallocate={cfg.preallocate})")
        info = prepare_file(path, cfg)
        created = True
        env.update(wal_direct_io=info["wal_direct_io"], wal_create_seconds=info["create_seconds"])
        if max_size > info["max_record_bytes"]:
            raise SystemExit(f"benchmarks.wal_disk: record size {max_size} exceeds the WAL's max record "
                             f"{info['max_record_bytes']}; raise --capacity")
        steps.update()

        _progress(f"phase 1/{nphase}: raw limit, {fmt_size(args.raw_bytes)} of {fmt_size(args.raw_block)} "
                  "pwrite+fdatasync")
        raw_start = raw_write_test(path, free_region(path, cfg), data_capacity, args.raw_bytes, args.raw_block)
        if raw_start.get("note"):
            _progress(raw_start["note"])
        _progress(f"  raw: {raw_start['mb_s']:.1f} MB/s")
        steps.update()

        # A short raw run between cases (before the first, between each two, after the last):
        # the disk is shared and its speed drifts, so each case is also compared with the mean of
        # the raw runs just before and just after it.
        def raw_between():
            if not args.raw_adjacent:
                return None
            return raw_write_test(path, free_region(path, cfg), data_capacity, args.raw_adjacent, args.raw_block)

        cases = []
        combos = [(s, t) for s in args.sizes for t in args.threads]
        between = [raw_between()]
        for i, (size, threads) in enumerate(combos, 1):
            _progress(f"phase 2/{nphase}: case {i}/{len(combos)}: {fmt_size(size)} records x {threads} "
                      f"producer thread(s), {args.inflight} in flight each, "
                      + (f"{fmt_size(args.case_bytes)}" if args.case_bytes else f"{args.duration:g} s")
                      + (f" (raw before: {between[-1]['mb_s']:.0f} MB/s)" if between[-1] else ""))
            c = run_case(path, cfg, size, threads, args, raw_start["mb_s"])
            between.append(raw_between())
            before, after = between[-2], between[-1]
            c["raw_adjacent"] = None if before is None else dict(
                before=before, after=after, mb_s=(before["mb_s"] + after["mb_s"]) / 2)
            cases.append(c)
            lat = c["latency"]
            _progress(f"  {c['name']}: {c['mb_s']:.1f} MB/s, {c['records_s']:,.0f} rec/s, "
                      f"p99 {_f(lat['p99_ms'], '.2f')} ms"
                      + (f" (raw after: {after['mb_s']:.0f} MB/s)" if after else "")
                      + (f", ERRORS: {c['errors']}" if c["errors"] else ""))
            steps.update()
        report["cases"] = cases

        _progress(f"phase 3/{nphase}: {args.sync_count} synchronous {fmt_size(args.sync_size)} appends, "
                  f"interleaved with raw pwrite+fdatasync of the same sizes")
        chunk = 50
        wal_sync = run_sync(path, cfg, args.sync_size, args.sync_count, args.result_timeout, chunk)
        sw = wal_sync["stats"]
        comparisons = [dict(raw_bytes=r["block_bytes"],
                            p50_ratio=_ratio(wal_sync["latency"]["p50_ms"], r["latency"]["p50_ms"]),
                            p99_ratio=_ratio(wal_sync["latency"]["p99_ms"], r["latency"]["p99_ms"]),
                            rate_ratio=_ratio(wal_sync["appends_s"], r["writes_s"]))
                       for r in wal_sync["raw"]]
        report["sync"] = dict(
            wal=wal_sync, comparisons=comparisons, chunk=chunk, wal_write_bytes=wal_write_bytes(args.sync_size),
            wal_avg_write_bytes=sw["bytes_written"] / sw["batches"] if sw.get("batches") else None)
        _progress(f"  WAL sync p50 {_f(wal_sync['latency']['p50_ms'], '.3f')} ms; raw p50 "
                  + ", ".join(f"{fmt_size(r['block_bytes'])} {_f(r['latency']['p50_ms'], '.3f')} ms"
                              for r in wal_sync["raw"]))
        steps.update()

        _progress(f"phase 4/{nphase}: raw limit again, {fmt_size(args.raw_bytes)}")
        raw_end = raw_write_test(path, free_region(path, cfg), data_capacity, args.raw_bytes, args.raw_block)
        _progress(f"  raw: {raw_end['mb_s']:.1f} MB/s")
        steps.update()
        limit = max(raw_start["mb_s"], raw_end["mb_s"])
        report["raw"] = dict(start=raw_start, end=raw_end, limit_mb_s=limit)
        for c in cases:
            c["ratio"] = c["mb_s"] / limit if limit else None
            c["queue_floor_ms"] = queue_floor_ms(c, cfg, limit)
            adj = c.get("raw_adjacent")
            c["ratio_adjacent"] = c["mb_s"] / adj["mb_s"] if adj else None
    finally:
        steps.close()
        if created and not args.keep:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    env["loadavg_end"] = _loadavg()
    report["seconds"] = time.perf_counter() - t_all
    report["wal_file_kept"] = bool(args.keep)
    report["targets"] = evaluate_targets(report)

    print(format_table(report), flush=True)
    files = [] if args.no_plots else write_plots(report, out)
    jpath = os.path.join(out, "report.json")
    report["files"] = files + [jpath]
    with open(jpath, "w") as f:
        json.dump(report, f, indent=2, default=str)
        f.write("\n")
    print(f"wrote {', '.join(report['files'])}  (total {report['seconds']:.1f} s)", flush=True)
    return report


def main() -> None:
    run()


if __name__ == "__main__":
    main()
