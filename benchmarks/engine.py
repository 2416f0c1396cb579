"""Engine benchmark: ingest, small records, open-loop latency, requests per GiB, reads.

    python -m benchmarks.engine [--quick] [--out DIR]

Everything is measured in one run, each figure next to the limit it is judged against:
- WAL-only ingest: the same producers (64 KiB batches, 128 in flight each) appending straight to
  a WAL on the same file: the ceiling for the engine, whose appends go through that WAL.
- Engine ingest into 1,000 streams on the local store: MB/s, append latency p50/p99/p999 (call
  to completion), ratio to WAL-only (target >= 0.8).
- Small records (128 B to 64 KiB, one record per batch, 4 threads x 256 in flight): records/s
  of the engine (one stream per thread) against the WAL alone, in alternating rounds after an
  untimed warm-up of cache_size + one block through the engine, so that the rounds see the
  steady state in which the cache recycles its memory (target >= 0.8 at every size; the WAL
  alone >= 250,000 records/s at 128 B), and CPU seconds per GiB
  ingested of each (getrusage around each round; the engine's includes the uploads of the
  blocks its round sealed).
- Append latency in open loop: producers on a fixed schedule at half the engine's measured
  maximum records/s, latency from each record's scheduled send time to its completion, so a
  stalled append delays the measurement of those behind it (target p99 < 10 ms).
- Object-store write requests (PUT + multipart parts, as S3 would count them) and objects
  created per GiB ingested, for 10 and for 1,000 streams, against the floor of one request per
  part size.
- Catch-up read of the 10-stream data set from objects by a fresh node (cold block cache, files
  evicted from the page cache) against a raw sequential read of the same object files, equally
  cold (target >= 0.7); tail read from the log cache.

For the 1,000-stream and small-record runs the object store directory defaults to /dev/shm when
it exists: the store stands for S3, which does not share the WAL's disk (on-disk objects would
halve the disk bandwidth the WAL gets). The 10-stream data set is stored on disk next to the
WAL, because the catch-up read is judged against reading those files from the device.
Report: JSON and PNG plots in --out.
"""
from __future__ import annotations

import argparse
import array
import collections
import contextlib
import gc
import os
import resource
import shutil
import threading
import time

import wal
from benchmarks.wal_disk import Trimmer
from benchmarks.kit import fmt_size, log_line, parse_size, percentiles, periodic, progress, publish, pyplot, save_figure

from s3stream import Config, RecordBatch, StreamClient
from s3stream.engine.lifecycle import ObjectReclaimer
from s3stream.metadata import ObjectState, SqliteMetadataStore
from s3stream.objectstore import InstrumentedObjectStore, LocalObjectStore
from s3stream.engine.uploadpolicy import request_cost_per_gib, requests_floor
from benchmarks.engine_reads import catchup_local, catchup_s3, format_catchup, tail_read, tail_read_sizes
from testservers.moto import moto_process

KiB, MiB, GiB = 1024, 1024 ** 2, 1024 ** 3
TARGETS = {"ingest_ratio": 0.8, "catchup_ratio": 0.7, "small_record_ratio": 0.8,
           "wal_records_s_128": 250_000, "open_loop_p99_ms": 10.0}
#: The small-record case: record sizes, producers, appends each keeps in flight.
SMALL_SIZES = (128, 1 * KiB, 16 * KiB, 64 * KiB)
SMALL_THREADS, SMALL_INFLIGHT = 4, 256
#: The open-loop latency run: sizes, the share of the measured maximum rate, the in-flight bound.
OPEN_LOOP_SIZES = (1 * KiB, 64 * KiB)
OPEN_LOOP_LOAD, OPEN_LOOP_INFLIGHT = 0.5, 4096
#: An open-loop producer sleeps at least this long, then sends every record that fell due (each
#: still timed from its own scheduled time): at 100,000/s, waking for every record means a GIL
#: handover per record, which makes the producers themselves late (reported as send_lag).
OPEN_LOOP_TICK_NS = 200_000


def _progress(msg: str) -> None:
    log_line(f"[benchmarks.engine {time.strftime('%H:%M:%S')}] {msg}")


# ---- completion times of append handles -----------------------------------------------------------

def watch_completion(handle) -> None:
    """Make `completion_ns(handle)` work once `handle` is done. A handle that carries its own
    `completed_ns` (the WAL's AppendHandle, the engine's once its write path returns one) needs
    nothing; a concurrent.futures.Future gets a done-callback stamping the time. That callback
    costs about as much as the append: never call this in a loop that measures throughput."""
    # the type first: on a WAL handle hasattr(handle, ...) would run the property (a mutex)
    if not (hasattr(type(handle), "completed_ns") or hasattr(handle, "completed_ns")):
        handle.add_done_callback(_stamp_completion)


def _stamp_completion(future) -> None:
    future.bench_completed_ns = time.monotonic_ns()


def completion_ns(handle) -> int | None:
    """CLOCK_MONOTONIC ns (the clock of time.monotonic_ns) at which the append completed: the
    handle's `completed_ns`, else the stamp of `watch_completion`; None if unknown (pending, not
    watched, the WAL's completion log no longer covers it, or the stamp's callback is still to
    run just after the future completed)."""
    done = getattr(handle, "completed_ns", None)
    return done if done is not None else getattr(handle, "bench_completed_ns", None)


def append_latency_ns(handle, called_ns: int) -> int:
    """Latency of a completed append: `completed_ns - submitted_ns` when the handle has both,
    else from `called_ns` (taken just before the call) to its completion. An unknown completion
    counts as now: the caller has just seen the handle done."""
    done = completion_ns(handle)
    if done is None:
        done = time.monotonic_ns()
    return done - getattr(handle, "submitted_ns", called_ns)


# ---- producers ----------------------------------------------------------------------------------

class Producers:
    """`threads` producers, each keeping up to `inflight` appends pending, until `total` bytes.
    `submit(i, payload)` returns a handle or future; latency = submit to completion."""

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

            def settle() -> None:
                called, handle = window.popleft()
                handle.result()
                lat.append(append_latency_ns(handle, called))

            for i in range(per_thread):
                called = time.monotonic_ns()
                handle = self.submit(t + i * self.threads, self.payload)
                # from the completion itself, not from when the producer looks
                watch_completion(handle)
                window.append((called, handle))
                if len(window) >= self.inflight:
                    settle()
            while window:
                settle()
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


def _run_threads(body, args_per_thread: list[tuple]) -> None:
    """Run `body(*args)` in one thread per tuple; re-raise the first error of any of them."""
    errors: list[BaseException] = []

    def guarded(*args) -> None:
        try:
            body(*args)
        except BaseException as e:     # noqa: BLE001 - re-raised by the caller's thread
            errors.append(e)

    workers = [threading.Thread(target=guarded, args=a) for a in args_per_thread]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def lean_producers(appends: list, arg, records: int, inflight: int, seconds: float) -> tuple[int, float]:
    """One thread per callable in `appends`, each calling `append(arg)` `records` times (or until
    `seconds` pass, checked every `inflight` records) while keeping `inflight` pending. The loop
    does only the append, a deque push and `.result()` of the oldest: no clock read, no
    callback, so the producers cost the least they can. Returns (records appended, seconds)."""
    done = [0] * len(appends)
    deadline = time.monotonic() + seconds
    monotonic = time.monotonic

    def body(index: int, append) -> None:
        window: collections.deque = collections.deque()
        push, pop = window.append, window.popleft
        sent = 0
        while sent < records and monotonic() < deadline:
            chunk = min(inflight, records - sent)
            for _ in range(chunk):
                push(append(arg))
                if len(window) >= inflight:
                    pop().result()
            sent += chunk
        while window:
            pop().result()
        done[index] = sent

    start = time.perf_counter()
    _run_threads(body, list(enumerate(appends)))
    return sum(done), time.perf_counter() - start


class WalOnly:
    """A WAL on the same disk as the engine's, appended to directly: the engine's ceiling. A
    trimmer thread keeps its ring from filling, so producers never stall on trims."""

    def __init__(self, path: str, cfg: wal.WALConfig) -> None:
        if os.path.exists(path):
            os.unlink(path)
        self.path = path
        self.wal = wal.WriteAheadLog.open(path, node_id=999, config=cfg)
        self.wal.trim(self.wal.trim_offset)      # start the writer session outside any measurement
        self.trimmer = Trimmer(self.wal, (cfg.capacity or wal.config.DEFAULT_CAPACITY) // 4)
        self.trimmer.start()

    def run(self, payload: bytes, threads: int, total: int) -> tuple[int, float, list[int]]:
        p = Producers(lambda _i, data: self.wal.append(data), payload, threads, 128, total)
        elapsed = p.run()
        return p.sent, elapsed, p.latencies

    def close(self) -> None:
        self.trimmer.stop()
        self.wal.close()
        os.unlink(self.path)
        if self.trimmer.error is not None:
            raise self.trimmer.error


def engine_ingest(workdir: str, store_dir: str, config: Config, payload: bytes, threads: int, total: int,
                  nstreams: int, rounds: int = 1, keep_open: bool = False,
                  compare_wal: bool = True, put_latency: tuple[float, float] | None = None
                  ) -> tuple[dict, StreamClient | None, list]:
    """Ingest `total` bytes into `nstreams` streams in `rounds` parts, each right after an equal
    WAL-only part on the same disk, so that drift of the device affects both alike (no WAL-only
    parts if not `compare_wal`: building a data set). `put_latency` (median, p99 seconds): every
    PUT of the store is delayed by a lognormal draw (S3-like)."""
    local = LocalObjectStore(store_dir)
    if put_latency is not None:
        from benchmarks.wal_objects import LatencyStore
        store = InstrumentedObjectStore(LatencyStore(local, *put_latency))   # type: ignore[arg-type]
    else:
        store = InstrumentedObjectStore(local)
    meta = SqliteMetadataStore(os.path.join(workdir, "meta.db"))
    client = StreamClient(1, os.path.join(workdir, "node1.wal"), store, meta, config)
    walonly = WalOnly(os.path.join(workdir, "walonly.wal"), config.wal) if compare_wal else None
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
        b, t, l = walonly.run(payload, threads, total // rounds) if walonly else (1, 1.0, [0])
        wsent, welapsed, wlat = wsent + b, welapsed + t, wlat + l
        p = Producers(lambda i, data: streams[i % nstreams].append(RecordBatch(data, 1)), payload, threads, 128,
                      total // rounds)
        t = p.run()
        sent, elapsed, lat = sent + p.sent, elapsed + t, lat + p.latencies
        per_round.append(dict(wal_mb_s=b / welapsed / 1e6 if rounds == 1 else None,
                              ratio=(p.sent / t) / (b / (welapsed - sum(r["wal_s"] for r in per_round))),
                              wal_s=welapsed - sum(r["wal_s"] for r in per_round)))
    stop.set()
    if walonly:
        walonly.close()
    t0 = time.perf_counter()
    if not keep_open:
        for s in streams:
            s.close()
    drain = time.perf_counter() - t0
    _wait_uploads(client)     # blocks still in flight count their objects under their trigger when they commit
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
        request_floor_per_gib=requests_floor(stats["bytes_written"], len(objects), store.part_size) / gib,
    )
    result["ratio_to_wal"] = result["mb_s"] / result["wal_only"]["mb_s"]
    if keep_open:
        return result, client, streams
    client.close()
    meta.close()
    return result, None, []


#: Free page reporting (virtio-balloon): the guest hands free 2^order-page blocks back to the host,
#: and the next write to such a page faults it in on the host side again.
PAGE_REPORTING = "/sys/module/page_reporting/parameters"


def host_reclaimed_kib() -> int | None:
    """KiB of freed memory this VM has handed back to its host so far (free page reporting), or
    None where the kernel does not report free pages. The stand-in store writes objects into
    fresh RAM-disk pages; each page the host took back costs a host fault on that write, which
    a store on another machine (S3) never charges to the node. Reading it around a round tells
    how much of the round's store cost is this VM's, not the engine's."""
    try:
        with open(os.path.join(PAGE_REPORTING, "reported_kib")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def page_reporting_order() -> int | None:
    try:
        with open(os.path.join(PAGE_REPORTING, "page_reporting_order")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _wait_uploads(client: StreamClient, timeout: float = 120.0) -> None:
    """Wait until no sealed block waits for upload (the active block stays: a later round's
    data fills it): the uploads a round caused are then counted in that round's CPU time."""
    deadline = time.monotonic() + timeout
    while client.stats()["cache"].get("sealed_blocks", 0) and time.monotonic() < deadline:
        time.sleep(0.005)


class DiscardingStore:
    """A local store whose puts can be switched to discard their data (untimed deletes of keys
    never written are then no-ops). Only for the diagnostic rounds of the small-record bench: the
    engine with its uploads encoded but not written, to tell the engine's own cost from the cost
    of the stand-in store (a kernel copy into fresh page-cache pages of a RAM disk)."""

    def __init__(self, inner: LocalObjectStore) -> None:
        self.inner = inner
        self.discard = False
        self.url = inner.url

    def put(self, key: str, data) -> None:
        if not self.discard:
            self.inner.put(key, data)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class SmallRecordBench:
    """Records of one size, one per batch, from `threads` producers: the engine (one stream per
    producer, through its own WAL) against the same producers appending to a WAL alone, on the
    same disk, in alternating rounds. Then appends on a fixed schedule (open loop) for latency."""

    def __init__(self, workdir: str, store_dir: str, config: Config, threads: int = SMALL_THREADS,
                 inflight: int = SMALL_INFLIGHT, recycle_bytes: int = 0) -> None:
        self.threads, self.inflight = threads, inflight
        self.meta = SqliteMetadataStore(os.path.join(workdir, "meta.db"))
        # Nothing reads the objects these rounds delete (the streams are trimmed past them and
        # the reclaimer runs with no destroy delay), so pooled files are reusable at once.
        self.store = store = DiscardingStore(LocalObjectStore(store_dir, recycle_bytes=recycle_bytes,
                                                              recycle_delay=0))
        self.client = StreamClient(1, os.path.join(workdir, "node1.wal"), store, self.meta, config)
        self.walonly = WalOnly(os.path.join(workdir, "walonly.wal"), config.wal)
        self.reclaimer = ObjectReclaimer(store, self.meta, destroy_delay=0)
        self.config = config
        self.warmed = False

    def warm_up(self, streams: list, batch: RecordBatch) -> float:
        """Untimed: append cache_size + one block through the engine once, so that the rounds
        measure the steady state (the log cache recycling its memory) rather than the first
        touch of fresh memory, which costs ~13x a warm copy on this machine. Returns seconds."""
        per_thread = (self.config.cache_size + self.config.upload_threshold) // len(batch.payload) // len(streams)
        count, elapsed = lean_producers([s.append for s in streams], batch, per_thread, self.inflight, 120.0)
        _wait_uploads(self.client)
        self.trim_history(streams)          # its objects go right before the first engine round
        self.warmed = True
        return elapsed

    def trim_history(self, streams: list) -> None:
        """Untimed: trim the streams to what is committed; the objects that frees are deleted
        by the next drop_history (of these streams or others)."""
        for s in streams:
            if s.committed_offset > s.start_offset:
                s.trim(s.committed_offset)

    def drop_history(self, streams: list) -> int:
        """Untimed, right before the engine writes to the store: trim the streams to what is
        committed and delete every object trimmed so far, so that GiBs of rounds do not pile up
        in the store (a RAM disk) and the writes that follow reuse their pages. Deleted earlier,
        those pages would be handed back to this VM's host meanwhile (free page reporting) and
        faulted in again by the next writes: a cost of the VM, not of the engine. Returns how
        many objects it deleted."""
        self.trim_history(streams)
        return self.reclaimer.run_once()

    @contextlib.contextmanager
    def retention(self, streams: list, every: float = 0.2):
        """While the block runs, trim the streams to what is committed and delete the objects
        that frees every `every` seconds (yields a dict counting the objects deleted): the
        store's footprint stays bounded and its writes reuse pages freed a moment before, as a
        store with retention would. Without it, the 3 s open loop at 64 KiB writes ~2.7 GB into
        the RAM disk, past the pages freed before it, and on this VM the host's work of backing
        fresh pages slowed the WAL's own disk: `perf sched` showed the WAL writer blocked in
        I/O for 10-31 ms per write during a 160 ms stall, while the PUT threads ran."""
        done = dict(objects_deleted=0, errors=0)

        def run() -> None:
            try:
                done["objects_deleted"] += self.drop_history(streams)
            except Exception:   # noqa: BLE001 - counted; the loop's figures stand without it
                done["errors"] += 1

        with periodic(run, every, "bench-retention"):
            yield done

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            try:
                self.walonly.close()
            finally:
                self.meta.close()

    def _round(self, appends: list, arg, records: int, seconds: float, settle=None,
               discard: bool = False) -> tuple[int, float, float, int]:
        """(records, seconds, CPU seconds, KiB the VM handed back to its host meanwhile)."""
        self.store.discard = discard
        try:
            cpu, reclaimed = _cpu_seconds(), host_reclaimed_kib()
            count, elapsed = lean_producers(appends, arg, records, self.inflight, seconds)
            if settle is not None:
                settle()
            after = host_reclaimed_kib()
            return count, elapsed, _cpu_seconds() - cpu, (after - reclaimed) if reclaimed is not None else 0
        finally:
            self.store.discard = False

    def throughput(self, size: int, rounds: int, round_seconds: float) -> tuple[dict, list]:
        """Records/s and CPU s/GiB of both sides at `size`. Each side's record count is set from a
        short probe so that a round lasts about `round_seconds` (the two differ by orders of
        magnitude when the engine is slow). A third side, "engine_no_store", is the engine with
        its objects encoded but not written (DiscardingStore): what the engine costs without the
        stand-in store. One full round of every side runs before the `rounds` counted and is
        reported apart ("unsettled_round"). Returns the result and the streams, still open."""
        payload = os.urandom(size)
        streams = [self.client.create_stream() for _ in range(self.threads)]
        batch = RecordBatch(payload, 1)         # immutable: one object serves every append
        settle = lambda: _wait_uploads(self.client)                             # noqa: E731
        sides = dict(wal=([self.walonly.wal.append] * self.threads, payload, None, False),
                     engine=([s.append for s in streams], batch, settle, False),
                     engine_no_store=([s.append for s in streams], batch, settle, True))
        warm_up = 0.0 if self.warmed else self.warm_up(streams, batch)
        per_thread = {}
        for name, (appends, arg, settle, discard) in sides.items():     # the probe also warms them up
            count, elapsed, _, _ = self._round(appends, arg, 1 << 40, max(0.05, round_seconds / 4), settle, discard)
            per_thread[name] = max(self.inflight, int(count / elapsed * round_seconds / self.threads))
        self.trim_history(streams)
        totals = {name: [0, 0.0, 0.0, 0] for name in sides}
        per_round = []
        unsettled = None
        for n in range(rounds + 1):
            rates = {}
            for name, (appends, arg, settle, discard) in sides.items():
                if name == "engine":
                    self.drop_history(streams)      # the pages of what it deletes are reused at once
                count, elapsed, cpu, reclaimed = self._round(appends, arg, per_thread[name], 3 * round_seconds + 1,
                                                             settle, discard)
                rates[name] = count / elapsed
                if n:
                    for i, v in enumerate((count, elapsed, cpu, reclaimed)):
                        totals[name][i] += v
            result = dict(wal_records_s=rates["wal"], engine_records_s=rates["engine"],
                          ratio=rates["engine"] / rates["wal"], ratio_no_store=rates["engine_no_store"] / rates["wal"])
            if n:
                per_round.append(result)
            else:
                # Untimed: the first full-length round of a size writes more into the stand-in store
                # than the size before it did (3.9 GB in 2.9 s at 16 KiB after 2.6 GB rounds at 1 KiB),
                # and this VM's host faults the extra pages of the RAM disk in: 4.8 s of system time in
                # that round against 1.5-1.7 s in each of the next three (0.63 against 0.86-0.92).
                # Shown, never counted.
                unsettled = result
        res = dict(size=size, rounds=rounds, warm_up_seconds=warm_up, unsettled_round=unsettled, per_round=per_round,
                   records_per_round=dict(wal=per_thread["wal"] * self.threads,
                                          engine=per_thread["engine"] * self.threads))
        for name, (count, elapsed, cpu, reclaimed) in totals.items():
            res[name] = dict(records=count, seconds=elapsed, records_s=count / elapsed, mb_s=count * size / elapsed / 1e6,
                             cpu_seconds=cpu, cpu_s_per_gib=cpu / (count * size / GiB),
                             host_reclaimed_gib=reclaimed / MiB)
        res["ratio"] = res["engine"]["records_s"] / res["wal"]["records_s"]
        res["cpu_ratio"] = res["engine"]["cpu_s_per_gib"] / res["wal"]["cpu_s_per_gib"]
        res["ratio_no_store"] = res["engine_no_store"]["records_s"] / res["wal"]["records_s"]
        return res, streams

    def open_loop(self, appends: list, arg, rate: float, seconds: float, inflight: int = OPEN_LOOP_INFLIGHT) -> dict:
        """Call `append(arg)` at `rate` per second in total, one producer per callable in
        `appends`, each on a fixed schedule (staggered), never waiting for completions except to
        keep at most `inflight` pending. Latency runs from each record's scheduled send time to
        its completion, so a stall counts for every record scheduled during it."""
        threads = len(appends)
        interval = threads * 1e9 / rate
        per_thread = max(1, int(rate * seconds / threads))
        # Samples in arrays, not lists: the cyclic GC walks every item of a list in each full
        # collection, so millions of samples made the harness pause its own producers. Each
        # array is allocated at its final size and written before the schedule starts, so the
        # harness's own memory growth (tens of MB at 1 KiB, first touched under the GIL) is not
        # charged to the records it measures.
        records = per_thread * threads
        latencies = array.array("q", bytes(8 * records))
        send_lags = array.array("q", bytes(8 * records))    # how late the producers called append
        filled = [0]
        own = [(array.array("q", bytes(8 * per_thread)), array.array("q", bytes(8 * per_thread)))
               for _ in range(threads)]
        unknown, capped, last_send = [0], [0], [0]
        lock = threading.Lock()
        start = time.monotonic_ns() + 10_000_000        # let every thread start before the schedule does

        def body(index: int, append) -> None:
            first = start + index * interval / threads
            window: collections.deque = collections.deque()
            lat, lag = own[index]
            missing = waits = harvested = 0

            def harvest(block: bool) -> None:
                nonlocal missing, harvested
                while window:
                    scheduled, called, handle = window[0]
                    if block:
                        handle.result()
                        block = False
                    elif not handle.done():
                        return
                    window.popleft()
                    done = completion_ns(handle)
                    if done is None:
                        missing += 1
                        done = time.monotonic_ns()
                    lat[harvested] = done - scheduled
                    lag[harvested] = called - scheduled
                    harvested += 1

            sent = 0
            while sent < per_thread:
                due = min(per_thread, int((time.monotonic_ns() - first) // interval) + 1)
                if due <= sent:                 # ahead of the schedule: collect, then sleep
                    harvest(False)
                    gap = first + sent * interval - time.monotonic_ns()
                    if gap > 0:
                        time.sleep(max(gap, OPEN_LOOP_TICK_NS) / 1e9)
                    continue
                while sent < due:               # on time, or late: send every record now due
                    called = time.monotonic_ns()
                    handle = append(arg)
                    watch_completion(handle)
                    window.append((int(first + sent * interval), called, handle))
                    sent += 1
                    if len(window) >= inflight:
                        waits += 1
                        harvest(True)
            sent_ns = time.monotonic_ns()
            while window:
                harvest(True)
            with lock:
                latencies[filled[0]:filled[0] + harvested] = lat[:harvested]
                send_lags[filled[0]:filled[0] + harvested] = lag[:harvested]
                filled[0] += harvested
                unknown[0] += missing
                capped[0] += waits
                last_send[0] = max(last_send[0], sent_ns)

        # Setup's objects (the engine, boto3, moto...) move out of the GC's generations: a full
        # collection, set off by the harness's own allocations, then does not walk them while
        # the producers wait (a pause of the harness, 10-36 ms here, not of what it measures).
        gc.freeze()
        try:
            _run_threads(body, list(enumerate(appends)))
        finally:
            gc.unfreeze()
        del latencies[filled[0]:], send_lags[filled[0]:]
        send_seconds = (last_send[0] - start) / 1e9
        return dict(target_records_s=rate, achieved_records_s=records / send_seconds, records=records,
                    seconds=send_seconds, threads=threads, inflight_bound=inflight, inflight_bound_hits=capped[0],
                    completion_unknown=unknown[0], latency=percentiles(latencies), send_lag=percentiles(send_lags))


def small_records(workdir: str, store_dir: str, config: Config, sizes, rounds: int, round_seconds: float,
                  open_loop_sizes, open_loop_seconds: float, recycle_bytes: int = 0) -> tuple[dict, list[dict]]:
    """The small-record throughput and CPU at each size, then the open-loop latency at the sizes
    asked (at OPEN_LOOP_LOAD of the engine's records/s just measured at that size), with the WAL
    alone on the same schedule as a reference: the floor these producers reach."""
    bench = SmallRecordBench(workdir, store_dir, config, recycle_bytes=recycle_bytes)
    sizes_out, open_loop = [], []
    try:
        for size in sizes:
            _progress(f"small records: {fmt_size(size)}, {rounds} rounds of ~{round_seconds:g} s "
                      "alternating WAL alone and engine")
            res, streams = bench.throughput(size, rounds, round_seconds)
            sizes_out.append(res)
            _progress(f"  WAL {res['wal']['records_s']:,.0f} rec/s, engine {res['engine']['records_s']:,.0f} rec/s")
            if size in open_loop_sizes:
                rate = res["engine"]["records_s"] * OPEN_LOOP_LOAD
                _progress(f"open loop: {fmt_size(size)} at {rate:,.0f} rec/s for {open_loop_seconds:g} s, "
                          "WAL alone then engine")
                payload = os.urandom(size)
                reference = bench.open_loop([bench.walonly.wal.append] * len(streams), payload, rate,
                                            open_loop_seconds)
                bench.drop_history(streams)     # the rounds' objects, right before the store is written
                with bench.retention(streams) as retained:
                    engine = bench.open_loop([s.append for s in streams], RecordBatch(payload, 1), rate,
                                             open_loop_seconds)
                open_loop.append(dict(engine, size=size, max_records_s=res["engine"]["records_s"],
                                      load=OPEN_LOOP_LOAD, wal_reference=reference, retention=retained))
            bench.trim_history(streams)         # deleted before the next size's first engine round
            bench.client.close_streams(streams)
    finally:
        bench.close()
    return dict(threads=bench.threads, inflight=bench.inflight, streams=bench.threads, batch_records=1,
                round_seconds=round_seconds, sizes=sizes_out, page_reporting_order=page_reporting_order(),
                store_recycle_bytes=recycle_bytes, store_recycled_puts=bench.store.inner.recycled), open_loop


def _size_list(text: str) -> tuple[int, ...]:
    return tuple(parse_size(t) for t in text.split(",") if t.strip())


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="reports/engine-bench", help="report directory (JSON + PNG)")
    ap.add_argument("--workdir", default=None, help="WAL and metadata directory (default: OUT/work)")
    ap.add_argument("--store-dir", default=None, help="object store directory (default: /dev/shm/... if present)")
    ap.add_argument("--ingest", type=parse_size, default=None, help="bytes ingested into 1,000 streams "
                    "(default 2G; --quick 96M)")
    ap.add_argument("--dataset", type=parse_size, default=None, help="bytes ingested into 10 streams "
                    "(default 1G; --quick 64M)")
    ap.add_argument("--batch", type=parse_size, default=64 * KiB, help="batch payload size")
    ap.add_argument("--threads", type=int, default=4, help="producer threads")
    ap.add_argument("--rounds", type=int, default=4,
                    help="alternate this many WAL-only and engine rounds (the disk's speed drifts)")
    ap.add_argument("--record-sizes", type=_size_list, default=SMALL_SIZES,
                    help="record sizes of the small-record case (default 128,1K,16K,64K)")
    ap.add_argument("--round-seconds", type=float, default=None,
                    help="length of each small-record round (default 2; --quick 0.2)")
    ap.add_argument("--open-loop-sizes", type=_size_list, default=OPEN_LOOP_SIZES,
                    help="record sizes of the open-loop latency run, among --record-sizes (default 1K,64K)")
    ap.add_argument("--open-loop-seconds", type=float, default=None,
                    help="length of each open-loop latency run (default 3; --quick 0.4)")
    ap.add_argument("--store-recycle", type=parse_size, default=2 * GiB,
                    help="small records: the local store keeps this much of deleted objects' files and "
                    "overwrites them for later puts (LocalObjectStore recycle_bytes; default 2G, 0: off)")
    ap.add_argument("--only", choices=("all", "reads", "hot"), default="all",
                    help="reads: only the read cases (data sets built without the WAL-only comparison); "
                    "hot: only the hot partition (one stream against the WAL alone, issue 51)")
    ap.add_argument("--hot", type=parse_size, default=None, help="bytes into the one hot stream, per store "
                    "profile (default 1G; --quick 64M)")
    ap.add_argument("--no-s3", action="store_true", help="skip the catch-up reads on S3 through a moto server")
    ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    ap.add_argument("--keep", action="store_true", help="keep the work and store directories")
    return ap


def run(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not set(args.open_loop_sizes) <= set(args.record_sizes):
        parser.error("--open-loop-sizes must be among --record-sizes (the open loop runs at half the rate "
                     "measured there)")
    defaults = (96 * MiB, 64 * MiB, 0.2, 0.4, 64 * MiB) if args.quick else (2 * GiB, 1 * GiB, 2.0, 3.0, 1 * GiB)
    for name, value in zip(("ingest", "dataset", "round_seconds", "open_loop_seconds", "hot"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    os.makedirs(args.out, exist_ok=True)
    base_work = os.path.abspath(args.workdir or os.path.join(args.out, "work"))
    base_store = os.path.abspath(args.store_dir) if args.store_dir else (os.path.join("/dev/shm", f"s3stream-bench-{os.getpid()}")
                                    if os.path.isdir("/dev/shm") else os.path.join(base_work, "objects"))
    # WALs zero-filled at creation (not the default's fill in the background): every round then
    # measures the steady state, on written extents, without a filler sharing the disk.
    config = Config(wal=wal.WALConfig(preallocate="zeros")) if not args.quick else Config(
        upload_threshold=16 * MiB, split_size=4 * MiB, cache_size=64 * MiB,
        wal=wal.WALConfig(capacity=256 * MiB, full_timeout=60, preallocate="zeros"))
    payload = os.urandom(args.batch)
    report: dict = dict(config=dict(upload_threshold=config.upload_threshold, split_size=config.split_size,
                                    object_block_size=config.object_block_size, wal_capacity=config.wal.capacity,
                                    batch=args.batch, threads=args.threads, inflight=128,
                                    store_dir=base_store, workdir=base_work), targets=TARGETS, only=args.only)
    runs = []
    cases = (("1000 streams", args.ingest, 1000), ("10 streams", args.dataset, 10))
    ingests = cases if args.only == "all" else cases[1:] if args.only == "reads" else ()
    # one step per ingest, the reads, the small records and the hot partition, advanced between them
    phases = progress(total=len(ingests) + {"all": 3, "reads": 1, "hot": 1}[args.only], desc="benchmarks.engine",
                      unit="phase")
    try:
        if args.only in ("all", "hot"):
            report["hot"] = hot_partition(args, config, payload, base_work, base_store)
            phases.update()
        if args.only == "hot":
            ingests = ()
        for name, total, nstreams in ingests:
            work = os.path.join(base_work, str(nstreams))
            # The 10-stream data set is read back cold from disk, so its objects live on disk.
            store = os.path.join(base_store if nstreams == 1000 else work, "objects")
            for d in (work, store):
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
            _progress(f"ingest of {fmt_size(total)} into {name}" +
                      (", alternating with WAL-only rounds" if args.only == "all" else ""))
            keep = nstreams == 1000
            res, client, streams = engine_ingest(work, store, config, payload, args.threads, total, nstreams,
                                                 rounds=args.rounds, keep_open=keep, compare_wal=args.only == "all")
            if client is not None:
                _progress("tail read from the log cache")
                res["tail_read"] = tail_read(client, streams)
                for s in streams:
                    s.close()
                client.close()
            if nstreams == 1000 and not args.keep:
                # Nothing later reads it. Kept, its GiBs of RAM-disk pages left the small-record
                # rounds less memory the host still backs: of the WAL alone, 16 KiB made 0.55
                # with it kept against 0.82 with it removed, 64 KiB 0.69 against 0.86.
                shutil.rmtree(store, ignore_errors=True)
            runs.append(res)
            phases.update()
        if args.only != "hot":
            report["reads"] = read_cases(args, config, payload, base_work)
            phases.update()
        if args.only == "all":
            work, store = os.path.join(base_work, "small"), os.path.join(base_store, "small")
            for d in (work, store):
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
            report["small_records"], report["open_loop"] = small_records(
                work, store, config, args.record_sizes, args.rounds, args.round_seconds,
                set(args.open_loop_sizes), args.open_loop_seconds, args.store_recycle)
            phases.update()
    finally:
        phases.close()
        if not args.keep:
            shutil.rmtree(base_store, ignore_errors=True)
            shutil.rmtree(base_work, ignore_errors=True)
    report["runs"] = runs
    return publish(report, args.out, write_plots, format_report)


#: Issue 51: one stream at 64 KiB appends against the WAL alone, on a local store and behind
#: S3 Standard-like PUTs (median 30 ms, p99 150 ms, as `--kind wal-objects` injects).
HOT_TARGET_RATIO = 0.8
HOT_PROFILES = (("local store", None), ("S3 Standard-like PUTs (30 ms median, 150 ms p99)", (0.030, 0.150)))


def hot_partition(args, config: Config, payload: bytes, base_work: str, base_store: str) -> list[dict]:
    """One hot partition: every producer appends to one stream, alternating with the WAL alone
    (same producers, same disk); the tail bound must not cap it per upload round trip."""
    out = []
    for name, latency in HOT_PROFILES:
        work, store = os.path.join(base_work, "hot"), os.path.join(base_store, "hot")
        for d in (work, store):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
        _progress(f"one hot stream, {fmt_size(args.hot)} of {fmt_size(len(payload))} appends, {name}, "
                  "alternating with WAL-only rounds")
        res, _, _ = engine_ingest(work, store, config, payload, args.threads, args.hot, 1, rounds=args.rounds,
                                  put_latency=latency)
        res.update(profile=name, target_ratio=HOT_TARGET_RATIO, met=res["ratio_to_wal"] >= HOT_TARGET_RATIO)
        out.append(res)
        shutil.rmtree(store, ignore_errors=True)
    return out


def read_cases(args, config: Config, payload: bytes, base_work: str) -> dict:
    """Catch-up reads of the 10-stream data set as uploaded (StreamSetObjects) and of the same
    volume written as StreamObjects (split_size 4 MiB), on the local store and on S3."""
    from dataclasses import replace
    layouts = {"stream set objects": os.path.join(base_work, "10")}
    so_work = os.path.join(base_work, "10-so")
    shutil.rmtree(so_work, ignore_errors=True)
    os.makedirs(os.path.join(so_work, "objects"))
    # steps, advanced between them: the StreamObjects ingest, the tail reads, then the catch-up
    # read of each of the two layouts from the local store and from S3
    with progress(total=2 + 2 * (1 if args.no_s3 else 2), desc="reads", unit="step") as steps:
        _progress(f"ingest of {fmt_size(args.dataset)} into 10 streams as StreamObjects (split_size 4 MiB)")
        engine_ingest(so_work, os.path.join(so_work, "objects"),
                      replace(config, split_size=min(4 * MiB, config.split_size)),
                      payload, args.threads, args.dataset, 10, compare_wal=False)
        layouts["stream objects"] = so_work
        steps.update()
        _progress("tail reads of 128 B, 1 KiB and 64 KiB records from the log cache")
        tail_store = os.path.join(so_work, "tail-objects")
        os.makedirs(tail_store, exist_ok=True)
        tail = tail_read_sizes(so_work, tail_store, config, per_stream=(2 if args.quick else 16) * MiB,
                               rounds=10 if args.quick else 200)
        steps.update()
        out: dict = dict(local={}, s3={})
        for layout, work in layouts.items():
            _progress(f"catch-up read of {layout} from the local store (fresh node, cold caches)")
            out["local"][layout] = catchup_local(work, os.path.join(work, "objects"), config)
            steps.update()
        if not args.no_s3:
            with moto_process() as moto:          # its own process: it does not share the reader's GIL
                endpoint = moto.endpoint
                for i, (layout, work) in enumerate(layouts.items()):
                    _progress(f"catch-up read of {layout} from S3 through moto (fresh node, cold caches)")
                    out["s3"][layout] = catchup_s3(work, os.path.join(work, "objects"), config, endpoint,
                                                   f"catchup-{i}")
                    steps.update()
    return dict(catchup=out, tail=tail)


def _met(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def format_report(report: dict) -> str:
    lines = ["=" * 100, "s3stream engine benchmark (" + ", ".join(f"{k}={v}" for k, v in report["config"].items()) + ")"]
    for r in report["runs"] if report.get("only") == "all" else []:
        lat = r["latency"]
        rr = ", ".join(f"{x:.2f}" for x in r["round_ratios"])
        lines.append(f"\nIngest into {r['streams']} streams: {r['mb_s']:.0f} MB/s "
                     f"({fmt_size(r['bytes'])} in {r['seconds']:.1f} s; close/drain {r['close_seconds']:.2f} s)")
        verdict = (f"target >= {TARGETS['ingest_ratio']}: {_met(r['ratio_to_wal'] >= TARGETS['ingest_ratio'])}"
                   if r["streams"] == 1000 else "not judged: the data set of the cold reads, its objects written "
                   "to the WAL's own disk")
        lines.append(f"  WAL-only, same producers, same disk, alternating rounds: {r['wal_only']['mb_s']:.0f} MB/s  ->  ratio "
                     f"{r['ratio_to_wal']:.2f} ({verdict}; per round {rr})")
        lines.append(f"  append latency p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms, p99.9 {lat['p999_ms']:.1f} ms"
                     f"  (WAL-only p99 {r['wal_only']['latency']['p99_ms']:.1f} ms)")
        lines.append(f"  object store: {r['put_requests']} write requests = {r['requests_per_gib']:.1f} per GiB "
                     f"(floor {r['request_floor_per_gib']:.0f} per GiB at the part size; "
                     f"${request_cost_per_gib(r['requests_per_gib']):.5f} per GiB at S3 Standard); {r['objects']} objects = "
                     f"{r['objects_per_gib']:.1f} per GiB ({r['stream_objects']} SO, {r['stream_set_objects']} SSO)")
        if "tail_read" in r:
            t = r["tail_read"]
            lines.append(f"  tail read (newest record of each stream, a fetch each): {t['mb_s']:.0f} MB/s, "
                         f"{t['records_s']:,.0f} records/s, {t['fetches_s']:,.0f} fetches/s; "
                         f"{t['from_cache']:.0%} from the log cache, {t['object_gets']} GETs")
    reads = report.get("reads")
    if reads:
        lines.append("\nTail reads from the log cache (4 streams, the newest MiB of each, fetch max_bytes 1 MiB)")
        for t in reads["tail"]:
            lines.append(f"  {fmt_size(t['size']):>6} records: {t['mb_s']:,.0f} MB/s, {t['records_s']:,.0f} records/s "
                         f"({t['from_cache']:.0%} of fetches from the log cache)")
        lines.append("\nCatch-up reads (fetch 1 MiB at a time, stream after stream, fresh node; benchmarks/engine_reads.py)")
        for store, cases in reads["catchup"].items():
            for layout, c in cases.items():
                judged = store == "local" or layout == "stream objects"
                lines.append(format_catchup(f"{store}, {layout}", c, TARGETS["catchup_ratio"] if judged else None))
        if reads["catchup"].get("s3"):
            lines.append("  (on moto a ranged GET costs about a whole-object GET, so reading StreamSetObjects slice by "
                         "slice is bound by moto; S3 is judged on StreamObjects)")
    lines += _format_small_records(report)
    for r in report.get("hot", []):
        lat = r["latency"]
        lines.append(f"\nOne hot stream (issue 51), {r['profile']}: {r['mb_s']:.0f} MB/s against the WAL alone "
                     f"{r['wal_only']['mb_s']:.0f} MB/s -> ratio {r['ratio_to_wal']:.2f} (target >= "
                     f"{r['target_ratio']}: {_met(r['met'])}; per round "
                     + ", ".join(f"{x:.2f}" for x in r["round_ratios"]) + ")")
        lines.append(f"  append latency p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms; "
                     f"{r['requests_per_gib']:.1f} write requests per GiB (floor {r['request_floor_per_gib']:.0f}, "
                     f"${request_cost_per_gib(r['requests_per_gib']):.5f} per GiB at S3 Standard); uploads by trigger "
                     + ", ".join(f"{t} {c['objects']}" for t, c in r["upload"].get("triggers", {}).items()))
    if report.get("plots"):
        lines.append("\nplots: " + ", ".join(report["plots"]))
    lines.append("=" * 100)
    return "\n".join(lines)


def _format_small_records(report: dict) -> list[str]:
    small = report.get("small_records")
    if not small:
        return []
    want = TARGETS["small_record_ratio"]
    lines = [f"\nSmall records, one per batch: {small['threads']} threads x {small['inflight']} in flight; the engine "
             f"(one stream per thread) against the WAL alone, same disk, {small['sizes'][0]['rounds']} alternating "
             f"rounds of ~{small['round_seconds']:g} s after an untimed warm-up of cache_size + one block "
             f"({small['sizes'][0].get('warm_up_seconds', 0):.1f} s); at each size, one more round of every side "
             "first, shown in brackets and not counted: it writes past the store's footprint so far, whose pages "
             "this VM's host faults in",
             f"  {'size':>6} {'WAL rec/s':>11} {'engine rec/s':>13}  {f'ratio (>= {want})':<19} {'per round':<30}"
             f"{'CPU s/GiB: WAL':>15} {'engine':>8} {'ratio':>7}"]
    for r in small["sizes"]:
        rounds = ", ".join(f"{x['ratio']:.2f}" for x in r["per_round"])
        if r.get("unsettled_round"):
            rounds = f"({r['unsettled_round']['ratio']:.2f}) {rounds}"
        lines.append(f"  {fmt_size(r['size']):>6} {r['wal']['records_s']:>11,.0f} {r['engine']['records_s']:>13,.0f}  "
                     f"{r['ratio']:>5.2f} {_met(r['ratio'] >= want):<13} {rounds:<30}"
                     f"{r['wal']['cpu_s_per_gib']:>15.1f} {r['engine']['cpu_s_per_gib']:>8.1f} {r['cpu_ratio']:>7.2f}")
    if all("engine_no_store" in r for r in small["sizes"]):
        lines.append("  The same engine with its objects encoded but not written (a discarding store), same rounds: "
                     "the engine's own cost, without the stand-in store's kernel copy into a RAM disk")
        for r in small["sizes"]:
            rounds = ", ".join(f"{x['ratio_no_store']:.2f}" for x in r["per_round"])
            if r.get("unsettled_round"):
                rounds = f"({r['unsettled_round']['ratio_no_store']:.2f}) {rounds}"
            lines.append(f"  {fmt_size(r['size']):>6} {'':>11} {r['engine_no_store']['records_s']:>13,.0f}  "
                         f"{r['ratio_no_store']:>5.2f} {'':<13} {rounds:<30}{'':>15} "
                         f"{r['engine_no_store']['cpu_s_per_gib']:>8.1f}")
    reclaimed = {side: sum(r.get(side, {}).get("host_reclaimed_gib", 0.0) for r in small["sizes"])
                 for side in ("wal", "engine", "engine_no_store")}
    if small.get("page_reporting_order") is not None:
        lines.append(f"  This VM handed freed memory back to its host during the rounds (free page reporting, order "
                     f"{small['page_reporting_order']}): {reclaimed['wal']:.1f} GiB in the WAL-alone rounds, "
                     f"{reclaimed['engine']:.1f} GiB in the engine rounds, {reclaimed['engine_no_store']:.1f} GiB with "
                     "the discarding store.")
        lines.append("  The stand-in store's deleted objects are such memory: every page it writes next is faulted "
                     "back in by the host, a cost of this VM that an object store on another machine never charges "
                     "to the node (docs/write-path.md, 'Measuring against the WAL alone'). So the earlier rounds' "
                     "objects are deleted (untimed) right before each engine round and open loop, whose writes then "
                     "reuse their pages as a store whose deletions keep pace with its writes would.")
    if small.get("store_recycle_bytes"):
        lines.append(f"  The store keeps up to {fmt_size(small['store_recycle_bytes'])} of deleted objects' files and "
                     f"overwrites them (LocalObjectStore recycle_bytes, --store-recycle): "
                     f"{small.get('store_recycled_puts', 0):,} puts reused one.")
    tiny = [r for r in small["sizes"] if r["size"] == 128]
    if tiny:
        rate, floor = tiny[0]["wal"]["records_s"], TARGETS["wal_records_s_128"]
        lines.append(f"  WAL alone at 128 B: {rate:,.0f} records/s (target >= {floor:,}: {_met(rate >= floor)})")
    lines.append("  CPU: user + system seconds of the whole process per GiB of payload (the engine's includes "
                 "uploading the blocks its rounds sealed); ratio = engine / WAL alone")
    if report.get("open_loop"):
        first = report["open_loop"][0]
        lines.append(f"\nAppend latency in open loop at {first['load']:g} x the engine's measured maximum: "
                     f"{first['threads']} producers on fixed schedules, at most {first['inflight_bound']} in flight, "
                     "latency from each record's scheduled send time to its completion; during the engine's loop "
                     "the streams are trimmed to what is committed and the freed objects deleted every 0.2 s "
                     "(a store with retention: its writes reuse the pages just freed)")
        for r in report["open_loop"]:
            lat, limit = r["latency"], TARGETS["open_loop_p99_ms"]
            behind = r["achieved_records_s"] < 0.95 * r["target_records_s"]
            lines.append(f"  {fmt_size(r['size']):>6}: {r['target_records_s']:,.0f} rec/s asked (max "
                         f"{r['max_records_s']:,.0f}), {r['achieved_records_s']:,.0f} sent"
                         f"{' (the producers fell behind their schedule)' if behind else ''}: p50 "
                         f"{lat['p50_ms']:.2f} ms, p99 {lat['p99_ms']:.2f} ms, p99.9 {lat['p999_ms']:.2f} ms "
                         f"(target p99 < {limit:g} ms: {_met(lat['p99_ms'] < limit)})")
            ref = r["wal_reference"]["latency"]
            lines.append(f"  {'':>6}  of which the producers were late calling append: p99 "
                         f"{r['send_lag']['p99_ms']:.2f} ms; WAL alone on the same schedule: p50 {ref['p50_ms']:.2f} ms, "
                         f"p99 {ref['p99_ms']:.2f} ms, p99.9 {ref['p999_ms']:.2f} ms")
    return lines


def write_plots(report: dict, out: str) -> list[str]:
    plt = pyplot("benchmarks.engine")
    if plt is None:
        return []
    paths = []
    if report.get("reads"):
        paths.append(_plot_reads(plt, report, out))
    if report.get("only") in ("reads", "hot"):
        return paths
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
    paths.append(save_figure(plt, fig, out, "engine.png"))
    if report.get("small_records"):
        paths.append(_plot_small_records(plt, report, out))
    return paths


def _plot_reads(plt, report: dict, out: str) -> str:
    cases = [(f"{store}\n{layout}", c) for store, by_layout in report["reads"]["catchup"].items()
             for layout, c in by_layout.items()]
    x = list(range(len(cases)))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.bar([i - 0.2 for i in x], [c["raw_mb_s"] for _, c in cases], 0.4, label="raw read of the objects")
    ax.bar([i + 0.2 for i in x], [c["mb_s"] for _, c in cases], 0.4, label="engine catch-up")
    for i, (_, c) in enumerate(cases):
        ax.annotate(f"{c['ratio']:.2f}", (i + 0.2, c["mb_s"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [name for name, _ in cases], fontsize=8)
    ax.set_ylabel("MB/s")
    ax.set_title(f"Catch-up reads, fresh node (target >= {TARGETS['catchup_ratio']} x raw)")
    ax.legend(fontsize=8)
    return save_figure(plt, fig, out, "reads.png")


def _plot_small_records(plt, report: dict, out: str) -> str:
    sizes = report["small_records"]["sizes"]
    names = [fmt_size(r["size"]) for r in sizes]
    x = list(range(len(sizes)))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, key, label in ((axes[0], "records_s", "records/s"), (axes[1], "cpu_s_per_gib", "CPU s per GiB")):
        sides = [("wal", "WAL alone"), ("engine", "engine")]
        if all("engine_no_store" in r for r in sizes):
            sides.append(("engine_no_store", "engine, objects discarded"))
        width = 0.8 / len(sides)
        for k, (side, name) in enumerate(sides):
            ax.bar([i + (k - (len(sides) - 1) / 2) * width for i in x], [r[side][key] for r in sizes], width,
                   label=name)
        ax.set_xticks(x, names)
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    axes[0].set_title(f"Small records (target engine >= {TARGETS['small_record_ratio']} x WAL)")
    axes[1].set_title("CPU per GiB ingested")
    loop = report.get("open_loop") or []
    ox = list(range(len(loop)))
    for i, (key, label) in enumerate((("p50_ms", "p50"), ("p99_ms", "p99"), ("p999_ms", "p99.9"))):
        axes[2].bar([j + (i - 1) * 0.27 for j in ox], [r["latency"][key] for r in loop], 0.27, label=label)
    axes[2].scatter(ox, [r["wal_reference"]["latency"]["p99_ms"] for r in loop], marker="x",
                    color="black", zorder=3, label="WAL alone p99")
    axes[2].axhline(TARGETS["open_loop_p99_ms"], color="black", ls="--", lw=1, label="p99 target")
    axes[2].set_xticks(ox, [f"{fmt_size(r['size'])}\n{r['target_records_s']:,.0f}/s" for r in loop])
    axes[2].set_yscale("log")
    top = max([r["latency"]["p999_ms"] for r in loop] + [TARGETS["open_loop_p99_ms"]])
    axes[2].set_ylim(top=top * 30)           # room for the legend above the bars
    axes[2].set_ylabel("ms")
    axes[2].set_title("Open-loop append latency at half the max rate")
    axes[2].legend(fontsize=7, ncol=3, loc="upper center")
    return save_figure(plt, fig, out, "small-records.png")


def main() -> None:
    run()


if __name__ == "__main__":
    main()
