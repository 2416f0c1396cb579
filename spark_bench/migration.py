"""Migration time against history size, under a saturating or a paced load, next to a Kafka-style
copy baseline (issue 28).

1. The driver builds partitions with the histories asked (default 16 MiB, 256 MiB, 1 GiB),
   committed to objects.
2. Baseline (article 003, Apache Kafka's reassignment): the time to copy each partition's whole
   history to a target: read every batch from the store, append it to a file on the target's
   disk, fsync.
3. Load. `--load 1` (the default) saturates: every producer runs flat out (closed loop,
   `--inflight` appends in flight). Below 1, the driver first runs a calibration job (the same two
   nodes, producers flat out, no migrations, `--calibration-seconds` of load) to measure this
   run's saturating acknowledged rate, then paces every producer so that the total is `load` x
   that rate, split evenly across the partitions. `--rate MB/S` paces at that total instead,
   without calibrating: an A/B of two builds at one load (the calibrated rate drifted from 215 to
   395 MB/s between runs of one session here, and moves slow with the load).
4. Two Spark tasks act as nodes 1 and 2, the partitions assigned to them in turn; producers
   write to every partition wherever it is open. After `--warmup-seconds` of load, quiet windows
   (`--quiet-seconds` each, no migrations) alternate with `--windows` migrating windows, starting
   and ending quiet; in all, the driver migrates each partition back and forth `--migrations`
   times and records each migration, with the tail the source's close uploaded. Every node's
   timeline (100 ms steps) is on the driver's clock. The throughput ratio compares each migrating
   window with the mean of the quiet windows on either side of it, so a rate that drifts by
   itself (it does here: a saturated job acknowledged 620-670 MB/s in its seconds 3-5 and about
   320 MB/s from second 8 on, without a single migration) is not counted as the migrations'
   cost. The calibration (`--load` below 1) also measures after the warm-up.
5. Every acknowledged record (the calibration's too) is read back by the driver's own client,
   after the nodes closed their partitions (nothing of the nodes' is read), and checked byte for
   byte.

Targets (issue 28): p99 < 0.100 s for every history at saturating load, p99 < 0.050 s at half
load; flat in history (p99 of the largest history / p99 of the smallest <= 1.3); acknowledged
throughput during the migrations >= 0.8 x the same run's throughput without them; 0 lost. The
anchors beside ours: AutoMQ, about 1.5 s per partition reassignment (their docs); Apache Kafka,
the time to copy the history (measured here). The tail a migration moved is measured (mean and
max per history), not assumed from the upload threshold.

The nodes run with `--tail-limit` (Config.stream_tail_limit) 2 MiB by default, a quarter of the
engine's default: the slow moves are those whose close PUTs a full tail, and the half-load target
needs the smaller one. `--tail-limit 8M` measures the engine's default. Measured on PostgreSQL at
a fixed 150 MB/s (about half this VM's saturating rate; the calibrated rate itself falls with
the bound): at 4 MiB, 37 of 360 moves (12 runs) took over 50 ms, and in 21 of them the close's
PUT was the phase furthest above its median (the store call for 4 MiB on /dev/shm: p90 17 ms,
max 39 ms). Two runs each: moves p90 56 ms at 4 MiB, 42 ms at 2 MiB, 33 ms at 1 MiB; the worst
history's p99 65-94 ms at 4 MiB (5 runs), 46 and 53 ms at 2 MiB. Producers flat out
acknowledged 310 MB/s at 4 MiB, 260 MB/s at 2 MiB and 159 MB/s at 1 MiB (one run each, one
session): below 2 MiB the bound throttles them.

A close's PUT into a store that only grows costs about 4 ms per MiB under load on this VM, most
of it the guest faulting in fresh memory (the writev, not the fsync): this VM hands freed pages back to
its host (free page reporting), and a store that only grows writes every object into pages never
touched, at 390-670 MB/s against 3.6-3.9 GB/s into owned ones (tests/bench/store_first_touch.py).
The default store (a /dev/shm directory) therefore runs with `--store-preallocate` 64 MiB
(LocalObjectStore preallocate_bytes; only when the store is on /dev/shm): a thread in each node
process writes files ahead, off the puts' path, and a close's 4 MiB PUT took 3-4 ms instead of
15-27 ms (half load, PostgreSQL). `--store-preallocate 0` measures without it.

`--meta postgres` starts a throwaway PostgreSQL server on 127.0.0.1 for the run and stops it
after (testservers.postgres); `--meta postgresql://user@host/db` uses a server of yours, which must not
hold the run's partitions yet (a database an earlier run used is refused: its objects are gone).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterator

from benchmarks.kit import parse_size, progress as progress_bar, pyplot, save_figure


from .common import (
    MiB, add_common_args, assign_metrics_ports, deployment, format_placement, frozen_heap, is_cluster,
    latency_summary, new_run_id, node_spec, placement, progress, publish, run_nodes, verdict, verify_acks,
)
from .node import run_nodes_of_partition
from s3stream.cluster import open_partition

#: Issue 28's targets, by its names.
TARGETS = dict(p99_s_at_saturation=0.100, p99_s_at_half_load=0.050, flatness=1.3,
               throughput_ratio_during_migrations=0.8, lost=0)
#: What others take for one partition reassignment, printed beside ours.
ANCHORS = dict(automq_s=1.5, automq="AutoMQ: about 1.5 s per partition reassignment (their docs)",
               kafka="Apache Kafka: a reassignment copies the history (the copy column, measured here)")
#: Node ids of the driver's own clients: the one that writes the histories, the copy baseline's.
BUILDER_NODE_ID, COPIER_NODE_ID = 100, 101
#: The nodes' cluster settings (the driver's Cluster uses the same).
CLUSTER = dict(agent_interval=0.01, heartbeat_interval=0.5, heartbeat_timeout=30.0, migration_timeout=30.0)
#: Seconds the driver waits for a job's nodes to serve the partitions assigned to them.
START_TIMEOUT = 300.0


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m spark_bench migration", description=__doc__.split("\n\n")[0],
                                 conflict_handler="resolve")       # --meta below replaces the common one
    add_common_args(ap)
    ap.add_argument("--meta", default=None,
                    help="metadata URL: sqlite:///path, postgresql://user@host/db, or the word postgres: a "
                         "throwaway PostgreSQL server on 127.0.0.1, started for the run and stopped after "
                         "(default: SQLite in the work dir)")
    ap.add_argument("--histories", default="16M,256M,1G", help="history size per partition")
    ap.add_argument("--tail", dest="upload_threshold", type=parse_size, default=argparse.SUPPRESS,
                    help="alias of --upload-threshold, kept for old command lines: the log cache block size, "
                         "not a bound on the tail a migration moves (the report measures that)")
    ap.add_argument("--tail-limit", dest="stream_tail_limit", type=parse_size, default=2 * MiB,
                    help="the nodes' Config.stream_tail_limit: most un-uploaded bytes per stream, what a close "
                         "uploads at most (default 2 MiB, a quarter of the Config default: the slow moves are those "
                         "whose close PUTs a full tail, and the half-load target needs the smaller tail; a smaller "
                         "bound throttles producers at saturation; 0: no bound)")
    ap.add_argument("--store-preallocate", type=parse_size, default=64 * MiB,
                    help="the default store's preallocate_bytes (LocalObjectStore): each node process writes a "
                         "file ahead for each put, of its size, keeping up to that many bytes of them, so that a "
                         "close's PUT copies into pages already allocated (default 64M; 0: off; ignored with "
                         "--store, whose URL says it)")
    ap.add_argument("--migrations", type=int, default=10, help="migrations per partition")
    ap.add_argument("--pause", type=float, default=0.3, help="seconds of load between rounds of migrations")
    ap.add_argument("--inflight", type=int, default=8, help="appends in flight per producer")
    ap.add_argument("--load", type=float, default=1.0,
                    help="fraction of the saturating load: 1 (the default) runs every producer flat out; below "
                         "1 a calibration job measures this run's saturating acknowledged rate first, and every "
                         "producer is paced so that the total is LOAD x that rate")
    ap.add_argument("--rate", type=float, default=None, metavar="MB/S",
                    help="pace the producers at this total (MB/s, split evenly) instead of calibrating: for A/B "
                         "comparisons at one fixed load, which the calibrated rate (it drifts by a third between "
                         "runs here) does not give; the p99 target is still the one of --load")
    ap.add_argument("--calibration-seconds", type=int, default=4,
                    help="whole seconds of flat-out load the calibration job measures (--load below 1)")
    ap.add_argument("--quiet-seconds", type=float, default=2.0,
                    help="seconds of each window without migrations (one before, between and after the migrating "
                         "windows): the throughput the migrations' is compared with")
    ap.add_argument("--windows", type=int, default=3,
                    help="migrating windows, each between two quiet ones; the rounds of migrations are split among them")
    ap.add_argument("--warmup-seconds", type=float, default=6.0,
                    help="seconds of load after every partition opened before anything is measured (here the "
                         "rate of a fresh job falls for its first 5-8 s, migrations or not)")
    args = ap.parse_args(argv)
    if not 0 < args.load <= 1:
        ap.error(f"--load is a fraction of the saturating load, in (0, 1]; got {args.load:g}")
    if args.rate is not None and not args.rate > 0:
        ap.error(f"--rate is the producers' total in MB/s, above 0; got {args.rate:g}")
    if args.calibration_seconds < 1 or args.quiet_seconds < 0.5 or args.windows < 1 or args.warmup_seconds < 0:
        ap.error("--calibration-seconds must be at least 1, --quiet-seconds at least 0.5, --windows at least 1 and "
                 "--warmup-seconds at least 0")
    return args


def p99_target(load: float) -> tuple[float, str]:
    """The p99 target that applies at `load` (a fraction of saturation), and why."""
    if load <= 0.5:
        return TARGETS["p99_s_at_half_load"], "half load or less: p99 < 0.05 s"
    if load >= 1:
        return TARGETS["p99_s_at_saturation"], "saturating load: p99 < 0.1 s"
    return TARGETS["p99_s_at_saturation"], (f"load {load:g} is above half: the saturation target p99 < 0.1 s "
                                            "applies (the 0.05 s one is for half load or less)")


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
            p = open_partition(client, name)
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
    p = open_partition(client, name)
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
    throwaway = args.meta == "postgres"
    with contextlib.ExitStack() as stack:
        if throwaway:
            args.meta = stack.enter_context(throwaway_metadata(args))
        query = f"preallocate_bytes={args.store_preallocate}" if args.store_preallocate else ""
        with deployment(args, "migration", 2, store_query=query) as dep:
            report = _run(args, dep, histories)
    report["metadata"] = "postgresql (a throwaway server)" if throwaway else dep.meta.split(":", 1)[0]
    return publish(report, dep.out, plot, format_report)


@contextlib.contextmanager
def throwaway_metadata(args) -> Iterator[str]:
    """`--meta postgres`: a throwaway PostgreSQL server (on 127.0.0.1) for the run; yields the URL of
    a new database on it and stops the server on exit."""
    if args.master and is_cluster(args.master) and \
            args.master.split("://", 1)[-1].rsplit(":", 1)[0] not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"--meta postgres starts a server on 127.0.0.1, which the executors of {args.master} "
                         "on other hosts cannot reach: give --meta postgresql://user@host/db")
    from testservers.postgres import MissingBinaries, throwaway_postgres
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(throwaway_postgres())
        except MissingBinaries as e:
            raise SystemExit(f"--meta postgres: {e}") from None
        url = server.create_database("spark_bench_migration")
        progress(f"metadata: a throwaway PostgreSQL server for the run, {url}")
        yield url


def run_job(args, dep, cluster, meta, histories: dict[str, int], script: Callable,
            rates: dict[str, float] | None = None) -> tuple[list[dict], list[str]]:
    """Run nodes 1 and 2 as one Spark job, producers flat out or paced at `rates` (bytes/s per
    partition). Once both nodes are live, the driver assigns the partitions to them in turn, so
    that both nodes carry load before the migrations as during them (with every partition on one
    node, the quiet phase would measure one process against two). It assigns only then, at new
    versions: a node that starts alone takes over the partitions of an earlier job's node that
    retired (orphans), and an earlier job's `opened` record must not count. Once every partition
    is served where it is assigned, `script(clock, halt)` drives the job from a thread of the
    driver: `clock()` is seconds since the job's origin, the second 0 of every node's timeline;
    `halt` is set once the nodes are gone. The nodes stop when the script returns. Returns the
    nodes' results and the script's failures."""
    home = {name: 1 + i % 2 for i, name in enumerate(histories)}
    run_id = new_run_id()
    origin = time.time()
    specs = [node_spec(args, n, dep.wal_dir, dep.store, dep.meta, list(histories), 3600.0, CLUSTER, keep_acks=True,
                       inflight=args.inflight, run_id=run_id) for n in (1, 2)]
    for spec in specs:
        spec["origin"] = origin
        spec["stream_tail_limit"] = args.stream_tail_limit
        if rates is not None:
            spec["rates"] = rates
    assign_metrics_ports(specs, args.metrics_port, args.metrics_addr)
    failures: list[str] = []
    halt = threading.Event()

    def clock() -> float:
        return time.time() - origin

    def drive() -> None:
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not {1, 2} <= set(cluster.live_nodes(serving=True)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"after {START_TIMEOUT:g} s nodes 1 and 2 were not both live")
                if halt.wait(0.05):
                    return
            for name, node in home.items():
                cluster.assign(name, node)
            while not all(cluster.owner(name) == node for name, node in home.items()):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"after {START_TIMEOUT:g} s the nodes did not serve the partitions assigned "
                                       f"to them: {home}")
                if halt.wait(0.05):
                    return
            script(clock, halt)
        except Exception as e:     # noqa: BLE001 - reported; the nodes are stopped either way
            failures.append(repr(e))
        finally:
            meta.put_kv(f"bench/{run_id}/stop", b"1")

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    try:
        results = run_nodes(dep.spark, specs, run_nodes_of_partition)
    finally:
        halt.set()
        driver.join()
    return results, failures


def wait_until(clock: Callable[[], float], halt: threading.Event, at: float) -> None:
    """Wait until clock() reaches `at`; RuntimeError if the nodes stopped first."""
    if halt.wait(max(0.0, at - clock())):
        raise RuntimeError("the nodes stopped before the driver was done with them")


def total_timeline(results: list[dict], key: str = "timeline") -> dict[int, int]:
    """Bytes acknowledged by every node in each second of the job's clock (in each 100 ms with
    key="timeline_100ms")."""
    total: collections.Counter = collections.Counter()
    for r in results:
        for step, nbytes in r[key]:
            total[step] += nbytes
    return dict(total)


def window_rate(ticks: dict[int, int], kind: str, start: float, end: float) -> dict:
    """The acknowledged bytes and MB/s in the 100 ms steps of the job's clock inside [start, end)."""
    first, last = math.ceil(start * 10 - 1e-9), math.floor(end * 10 + 1e-9)
    steps = max(0, last - first)
    nbytes = sum(ticks.get(k, 0) for k in range(first, last))
    return dict(kind=kind, start_s=start, end_s=end, seconds=steps / 10, bytes=nbytes,
                mb_s=nbytes / (steps / 10) / 1e6 if steps else None)


def interleaved_ratio(windows: list[dict]) -> float | None:
    """Bytes acknowledged in the migrating windows / what the quiet windows on either side of
    each would have acknowledged in its time (their mean rate): a drift of the rate by itself
    cancels out."""
    done = expected = 0.0
    for i, w in enumerate(windows):
        if w["kind"] != "migrating" or not w["seconds"]:
            continue
        around = [q["mb_s"] for q in (windows[i - 1] if i else None, windows[i + 1] if i + 1 < len(windows) else None)
                  if q and q["kind"] == "quiet" and q["mb_s"]]
        if not around:
            continue
        done += w["bytes"]
        expected += sum(around) / len(around) * 1e6 * w["seconds"]
    return done / expected if expected else None


def aggregate(windows: list[dict], kind: str) -> dict | None:
    """The windows of `kind` taken together: their seconds, bytes and MB/s."""
    mine = [w for w in windows if w["kind"] == kind]
    seconds, nbytes = sum(w["seconds"] for w in mine), sum(w["bytes"] for w in mine)
    return dict(windows=len(mine), seconds=seconds, mb_s=nbytes / seconds / 1e6 if seconds else None) if mine else None


def acked_rate(timeline: dict[int, int], start: float, end: float) -> dict:
    """Acknowledged MB/s over the whole seconds of the job's clock inside [start, end) (None if
    none is)."""
    first, last = math.ceil(start), math.floor(end)
    seconds = max(0, last - first)
    nbytes = sum(timeline.get(s, 0) for s in range(first, last))
    return dict(start_s=start, end_s=end, whole_seconds=seconds, mb_s=nbytes / seconds / 1e6 if seconds else None)


def calibrate(args, dep, cluster, meta, histories: dict[str, int]) -> tuple[dict, list[dict]]:
    """The saturating acknowledged rate of this run: the two nodes, producers flat out, no
    migrations, for `--calibration-seconds` whole seconds after the load built up. Returns the
    measurement (with the job's per-second timeline) and the nodes' results (their acknowledged
    records are verified too)."""
    window: dict[str, int] = {}

    def script(clock, halt) -> None:
        start = math.ceil(clock() + args.warmup_seconds)
        wait_until(clock, halt, start)
        wait_until(clock, halt, start + args.calibration_seconds)
        window.update(start=start, end=start + args.calibration_seconds)

    results, failures = run_job(args, dep, cluster, meta, histories, script)
    if not window or failures:
        raise SystemExit(f"the calibration job failed: {failures or 'it ended early'}; node errors: "
                         f"{[e for r in results for e in r['errors']][:5]}")
    timeline = total_timeline(results)
    measured = acked_rate(timeline, window["start"], window["end"])
    if not measured["mb_s"]:
        raise SystemExit(f"the calibration job acknowledged nothing in {window}")
    return dict(measured, timeline=sorted(timeline.items())), results


def _run(args, dep, histories: dict[str, int]) -> dict:
    from s3stream.cluster import Cluster, ClusterConfig
    from s3stream.metadata import open_metadata
    from s3stream.objectstore import open_object_store
    store, meta_url, work = dep.store, dep.meta, dep.work
    progress(f"building histories {', '.join(histories)}")
    build_history(store, meta_url, work, histories, args.batch)
    progress("Kafka-style copy baseline")
    baseline = {name: copy_baseline(store, meta_url, work, name) for name in histories}
    # From here to the verification the driver only drives and times the jobs: what it built
    # so far (clients, Spark) stays out of the cyclic GC's full walks (frozen_heap).
    with frozen_heap():
        meta = open_metadata(meta_url)
        cluster = Cluster(meta, open_object_store(store), ClusterConfig(**CLUSTER))
        calibration, rates, earlier = None, None, []
        if args.rate is not None:
            rates = {name: args.rate * 1e6 / len(histories) for name in histories}
            progress(f"--rate: producers paced at {args.rate:g} MB/s in all, no calibration")
        elif args.load < 1:
            progress(f"calibration: the saturating rate, producers flat out for {args.calibration_seconds} s, "
                     "no migrations")
            calibration, earlier = calibrate(args, dep, cluster, meta, histories)
            paced = args.load * calibration["mb_s"] * 1e6
            rates = {name: paced / len(histories) for name in histories}
            calibration.update(paced_mb_s=paced / 1e6, paced_partition_mb_s=paced / len(histories) / 1e6)
            progress(f"  saturating: {calibration['mb_s']:.0f} MB/s acknowledged; load {args.load:g}: producers paced "
                     f"at {paced / 1e6:.0f} MB/s in all, {paced / len(histories) / 1e6:.1f} MB/s per partition")
        moves: list[dict] = []
        windows: list[tuple[str, float, float]] = []
        bar = progress_bar(total=args.migrations * len(histories), desc="migrations", unit="move")
        # The rounds (each partition moves once) of each migrating window, as even as they split.
        groups = [n for n in (args.migrations // args.windows + (i < args.migrations % args.windows)
                              for i in range(args.windows)) if n]

        def quiet_window(clock, halt, start: float) -> float:
            start = math.ceil(start * 10) / 10        # on the nodes' 100 ms steps: all of it is measured
            end = start + args.quiet_seconds
            wait_until(clock, halt, end + 0.1)        # the nodes' last 100 ms step is whole
            windows.append(("quiet", start, end))
            return clock()

        def script(clock, halt) -> None:
            at = math.ceil(clock() + args.warmup_seconds)
            wait_until(clock, halt, at)
            for rounds in groups:
                at = quiet_window(clock, halt, at)
                for _ in range(rounds):
                    for name in histories:
                        if halt.is_set():
                            raise RuntimeError(f"the nodes stopped after {len(moves)} migrations")
                        target = 2 if cluster.owner(name) == 1 else 1
                        began = clock()
                        report = cluster.migrate(name, target)
                        ended = clock()
                        # the source's record of its close, if the target served first (bookkeeping)
                        moves.append(dict(report=cluster.with_close_record(report), start_s=began, end_s=ended))
                        bar.update()                                 # after the migration's own clock stopped
                        halt.wait(args.pause / len(histories))
                windows.append(("migrating", at, clock()))
                at = clock()
                progress(f"  migrations: {len(moves)} of {args.migrations * len(histories)}")
            quiet_window(clock, halt, at)

        try:
            progress(f"2 nodes under load {args.load:g} on {dep.master}: {args.quiet_seconds} s without migrations, "
                     f"then {args.migrations} migrations per partition")
            results, failures = run_job(args, dep, cluster, meta, histories, script, rates)
        finally:
            bar.close()
    where = placement(results)
    progress(f"  placement: {format_placement(where)}")
    progress("verifying every acknowledged record through the driver's own client")
    lost = verify_acks(store, meta_url, earlier + results, args.batch)
    meta.close()
    report = summarize(args, histories, baseline, moves, windows, results, lost, failures, calibration)
    report["node_errors"] = [e for r in earlier + results for e in r["errors"]][:20]
    report.update(dep.describe(), placement=where)
    return report


def node_tail_limit(args) -> int:
    """The stream_tail_limit the nodes run with (spark_bench.node's Config for these arguments)."""
    import s3stream
    return s3stream.Config(upload_threshold=args.upload_threshold, split_size=min(8 * MiB, args.upload_threshold),
                           cache_size=max(4 * args.upload_threshold, 256 * MiB),
                           max_batch_bytes=max(args.batch, MiB), stream_tail_limit=args.stream_tail_limit,
                           ).stream_tail_limit


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def summarize(args, histories, baseline, moves, windows, results, lost, failures, calibration) -> dict:
    timeline = total_timeline(results)
    target, applies = p99_target(args.load)
    rows = []
    for name, size in histories.items():
        mine = [m for m in moves if m["report"].partition == name]
        reports = [m["report"] for m in mine]
        lat = latency_summary([int(r.seconds * 1e9) for r in reports])
        p99 = lat["p99_ms"] / 1e3 if reports else None
        # the producers' rate in the seconds (of the job's clock) that its migrations touched
        touched = {s for m in mine for s in range(math.floor(m["start_s"]), math.floor(m["end_s"]) + 1)}
        producers = sum(timeline.get(s, 0) for s in touched) / len(touched) / 1e6 if touched else None
        rows.append(dict(partition=name, history_bytes=size, migrations=len(reports),
                         p50_s=lat["p50_ms"] / 1e3 if reports else None, p99_s=p99,
                         max_s=lat["max_ms"] / 1e3 if reports else None,
                         tail_bytes_mean=sum(r.tail_bytes for r in reports) / len(reports) if reports else None,
                         tail_bytes_max=max((r.tail_bytes for r in reports), default=None),
                         failed_over=sum(r.failed_over for r in reports),
                         close_p50_s=_median([r.close_seconds for r in reports]),
                         open_p50_s=_median([r.open_seconds for r in reports]),
                         copy_seconds=baseline[name]["seconds"], copy_mb_s=baseline[name]["mb_s"],
                         speedup=baseline[name]["seconds"] / p99 if p99 else None,
                         producers_mb_s=producers,
                         p99_met=p99 is not None and p99 < target))
    by_size = sorted((r for r in rows if r["p99_s"]), key=lambda r: r["history_bytes"])
    flat = by_size[-1]["p99_s"] / by_size[0]["p99_s"] if len(by_size) >= 2 else None
    ticks = total_timeline(results, "timeline_100ms")
    measured = [window_rate(ticks, *w) for w in windows]
    quiet, migrating = aggregate(measured, "quiet"), aggregate(measured, "migrating")
    ratio = interleaved_ratio(measured)
    # the plain one, all migrating windows against all quiet ones (drift not corrected)
    plain = migrating["mb_s"] / quiet["mb_s"] if quiet and migrating and quiet["mb_s"] and migrating["mb_s"] else None
    produced = sum(r["bytes"] for r in results)
    return dict(kind="migration", targets=TARGETS, anchors=ANCHORS, load=args.load, inflight=args.inflight,
                p99_target_s=target, p99_target_applies=applies, calibration=calibration, rate_mb_s=args.rate,
                upload_threshold=args.upload_threshold, stream_tail_limit=node_tail_limit(args),
                histories=rows, flatness=flat,
                warmup_seconds=args.warmup_seconds, windows=measured, quiet=quiet, migrating=migrating,
                throughput_ratio=ratio, throughput_ratio_plain=plain,
                load_mb_s=produced / max(r["seconds"] for r in results) / 1e6 if results else 0,
                moves=[dict(partition=m["report"].partition, source=m["report"].source, target=m["report"].target,
                            start_s=m["start_s"], end_s=m["end_s"], seconds=m["report"].seconds,
                            assigned_at=m["report"].assigned_at, tail_bytes=m["report"].tail_bytes,
                            close_seconds=m["report"].close_seconds,
                            open_seconds=m["report"].open_seconds, failed_over=m["report"].failed_over,
                            phases=m["report"].phases)
                       for m in moves],
                phases=_phase_summary([m["report"].phases for m in moves]),
                timeline=sorted(timeline.items()), verification=lost, failures=failures)


#: The phases of a migration (MigrationReport.phases), in order.
PHASES = ("assign", "to_close", "close", "close.flush", "close.checkpoint", "close.upload", "close.upload.put",
          "close.upload.gate", "close.upload.commit", "to_open", "open", "open.read", "open.streams", "open.checkpoint",
          "to_seen")


def _phase_summary(phases: list[dict]) -> dict:
    """Per phase, p50 and max seconds over the migrations that recorded it."""
    out = {}
    for name in PHASES:
        values = sorted(p[name] for p in phases if name in p)
        if values:
            out[name] = dict(p50_s=values[len(values) // 2], max_s=values[-1])
    return out


def _mb_s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def targets_met(report: dict) -> dict[str, bool]:
    """Issue 28's targets for one report, each met or not (the summary's verdicts, and what
    migration_campaign counts)."""
    t, flat, ratio, v = report["targets"], report["flatness"], report["throughput_ratio"], report["verification"]
    return dict(p99=all(r["p99_met"] for r in report["histories"]),
                flatness=flat is not None and flat <= t["flatness"],
                throughput_ratio=ratio is not None and ratio >= t["throughput_ratio_during_migrations"],
                lost=v["acknowledged"] > 0 and v["lost"] == t["lost"])


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def format_report(report: dict) -> str:
    t, load, target = TARGETS, report["load"], report["p99_target_s"]
    lines = ["=" * 124]
    head = f"Migration under load on {report['master']}, {report['metadata']} metadata: "
    rate = report.get("rate_mb_s")
    if rate:
        head += (f"a fixed rate, judged as load {load:g} (--rate, not calibrated: producers paced at {rate:.0f} MB/s "
                 f"in all, {rate / len(report['histories']):.1f} MB/s per partition)")
    elif report["calibration"]:
        c = report["calibration"]
        head += (f"load {load:g} of saturation (calibrated: {c['mb_s']:.0f} MB/s acknowledged flat out in "
                 f"{c['whole_seconds']} s; producers paced at {c['paced_mb_s']:.0f} MB/s in all, "
                 f"{c['paced_partition_mb_s']:.1f} MB/s per partition)")
    else:
        head += f"load {load:g} of saturation (producers flat out, {report['inflight']} appends in flight each)"
    lines.append(head)
    quiet, migrating, ratio = report["quiet"], report["migrating"], report["throughput_ratio"]
    met = targets_met(report)
    if quiet and migrating:
        least = t["throughput_ratio_during_migrations"]
        lines.append(f"acknowledged throughput after {report['warmup_seconds']:g} s of warm-up: "
                     f"{_mb_s(quiet['mb_s'])} MB/s without migrations ({quiet['windows']} windows, "
                     f"{quiet['seconds']:.1f} s), {_mb_s(migrating['mb_s'])} MB/s during them ({migrating['windows']} "
                     f"windows, {migrating['seconds']:.1f} s); ratio, each migrating window against the quiet ones "
                     f"on either side: {_ratio(ratio)} (target >= {least}: "
                     f"{verdict(met['throughput_ratio'])}; all against all: "
                     f"{_ratio(report['throughput_ratio_plain'])})")
        lines.append("  windows (MB/s): " + ", ".join(
            f"{'Q' if w['kind'] == 'quiet' else 'M'} {_mb_s(w['mb_s'])}" for w in report["windows"]))
    else:
        lines.append("acknowledged throughput with and without migrations: not measured (the job ended early)")
    lines.append(f"{'history':>10} {'moves':>5} {'p50 s':>7} {'p99 s':>7} {'max s':>7} {'tail MiB':>9} {'max MiB':>8} "
                 f"{'close p50':>9} {'open p50':>8} {'copy s':>7} {'speedup':>8} {'MB/s':>6}  p99 < {target:g} s")
    for r in report["histories"]:
        lines.append(f"{r['history_bytes'] / MiB:>8.0f}Mi {r['migrations']:>5} {r['p50_s'] or 0:>7.3f} "
                     f"{r['p99_s'] or 0:>7.3f} {r['max_s'] or 0:>7.3f} {(r['tail_bytes_mean'] or 0) / MiB:>9.1f} "
                     f"{(r['tail_bytes_max'] or 0) / MiB:>8.1f} {r['close_p50_s'] or 0:>9.3f} "
                     f"{r['open_p50_s'] or 0:>8.3f} "
                     f"{r['copy_seconds']:>7.2f} {r['speedup'] or 0:>7.1f}x {_mb_s(r['producers_mb_s']):>6}  "
                     f"{verdict(r['p99_met'])}")
    lines.append(f"  p99 target: {report['p99_target_applies']}. tail: what the source's close uploaded (mean, max); "
                 f"close/open: the source's close and the target's open, p50 s; MB/s: acknowledged by the producers "
                 f"in the seconds that history's migrations touched; upload threshold (block size) "
                 f"{report['upload_threshold'] / MiB:g} MiB, stream tail limit {report['stream_tail_limit'] / MiB:g} MiB")
    if report.get("phases"):
        lines.append("  where the time went (p50 / max s over every migration): " + ", ".join(
            f"{name} {v['p50_s']:.3f} / {v['max_s']:.3f}" for name, v in report["phases"].items())
            + " (to_close: assignment -> the source's close starts; to_open: the close's end -> the target's open "
              "starts; to_seen: the target published it -> the driver saw it)")
    failed_over = sum(r["failed_over"] for r in report["histories"])
    if failed_over:
        lines.append(f"  {failed_over} migration(s) fell back to failing the source over (it did not let go in time)")
    flat = report["flatness"]
    lines.append(f"flat in history: p99 largest / smallest = {_ratio(flat)} "
                 f"(target <= {t['flatness']}: {verdict(met['flatness'])})")
    worst = max((r["p99_s"] for r in report["histories"] if r["p99_s"] is not None), default=None)
    copies = ", ".join(f"{r['copy_seconds']:.2f} s for {r['history_bytes'] / MiB:.0f} MiB" for r in report["histories"])
    lines.append(f"anchors: {ANCHORS['automq']}; Apache Kafka copies the history: {copies} (measured here); "
                 f"ours, worst p99: {'n/a' if worst is None else f'{worst:.3f} s'}")
    lines.append(f"nodes ran on: {format_placement(report['placement'])}")
    v = report["verification"]
    lines.append(f"acknowledged records: {v['acknowledged']}, lost: {v['lost']} (read back different: "
                 f"{v['mismatched']}; target {t['lost']}: {verdict(met['lost'])})"
                 + (f"; unreadable partitions: {v['unreadable']}" if v["unreadable"] else ""))
    if report["failures"] or report["node_errors"]:
        lines.append(f"errors: {report['failures'] + report['node_errors']}")
    if report.get("plots"):
        lines.append("plots: " + ", ".join(report["plots"]))
    return "\n".join(lines)


def _history_axis(ax, sizes_mib: list[float]) -> None:
    """A log x axis with a tick at each history size, labelled in MiB."""
    ax.set_xscale("log")
    ax.set_xticks(sizes_mib, [f"{size:g}" for size in sizes_mib])
    ax.minorticks_off()
    ax.set_xlabel("history of the partition, MiB")


def plot(report: dict, out: str) -> list[str]:
    plt = pyplot("spark_bench")
    if plt is None:
        return []
    rows = [r for r in report["histories"] if r["p99_s"] is not None]
    if not rows:
        return []
    xs = [r["history_bytes"] / MiB for r in rows]
    fig, (times, tails, load) = plt.subplots(1, 3, figsize=(17, 4.8))
    times.plot(xs, [r["p50_s"] for r in rows], marker="o", label="migration p50")
    times.plot(xs, [r["p99_s"] for r in rows], marker="o", label="migration p99")
    times.plot(xs, [r["copy_seconds"] for r in rows], marker="s", label="Apache Kafka: copy of the history (here)")
    times.axhline(ANCHORS["automq_s"], color="grey", ls="-.", lw=1, label="AutoMQ: about 1.5 s (their docs)")
    for name, value in (("saturation", TARGETS["p99_s_at_saturation"]), ("half load", TARGETS["p99_s_at_half_load"])):
        applies = value == report["p99_target_s"]
        times.axhline(value, color="red" if applies else "salmon", ls="--" if applies else ":", lw=1,
                      label=f"p99 target at {name}: {value:g} s" + (" (this run)" if applies else ""))
    times.set_yscale("log")
    _history_axis(times, xs)
    times.set_ylabel("seconds")
    times.set_title(f"Migration time against history size, load {report['load']:g}")
    times.legend(fontsize=7)
    tails.plot(xs, [r["tail_bytes_mean"] / MiB for r in rows], marker="o", label="tail moved, mean")
    tails.plot(xs, [r["tail_bytes_max"] / MiB for r in rows], marker="^", label="tail moved, max")
    tails.axhline(report["upload_threshold"] / MiB, color="grey", ls=":", lw=1,
                  label="upload threshold (block size)")
    _history_axis(tails, xs)
    tails.set_ylabel("MiB the source's close uploaded")
    tails.set_title("Measured tail against history size")
    tails.set_ylim(bottom=0)
    tails.legend(fontsize=7)
    if report["timeline"]:
        # one step per second of the job, [s, s + 1) holding what was acknowledged in it; a second
        # without acknowledgements (a stall) is absent from the timeline and drawn as 0
        acked = dict(report["timeline"])
        ends = [w["end_s"] for w in report["windows"]]
        seconds = list(range(min(acked), math.ceil(max([max(acked) + 1] + ends)) + 1))
        rates = [acked.get(s, 0) / 1e6 for s in seconds]
        load.step(seconds, rates, where="post", label="acknowledged MB/s")
    labelled = set()
    for w in report["windows"]:
        quiet = w["kind"] == "quiet"
        key = "quiet" if quiet else "migrating"
        label = None
        if key not in labelled and report.get(key):
            labelled.add(key)
            label = (f"{'without migrations' if quiet else 'migrations'}: {_mb_s(report[key]['mb_s'])} MB/s "
                     f"({report[key]['windows']} windows)")
        load.axvspan(w["start_s"], w["end_s"], color="tab:green" if quiet else "tab:orange", alpha=0.15, label=label)
    paced = report["calibration"]["paced_mb_s"] if report["calibration"] else report.get("rate_mb_s")
    if paced:
        load.axhline(paced, color="grey", ls=":", lw=1, label="paced rate")
    load.set_xlabel("seconds of the job")
    load.set_ylabel("MB/s")
    load.set_title("Throughput with and without migrations")
    load.set_ylim(bottom=0)
    load.legend(fontsize=7)
    return [save_figure(plt, fig, out, "migration.png")]
