"""The data pipeline on Spark through the s3stream data source, with a Python worker killed
(issue 30).

1. A node (the driver's, then closed) creates `--inputs` input partitions and `--outputs` output
   partitions, and appends two warm-up records to each input. The query starts; the producer
   starts once the warm-up records are visible in the outputs (Spark's Python readers and
   writers are running then): the latency measures the pipeline, its start is `warm_up_s`.
2. A producer process (a node of its own, its WAL in the work dir) appends records of
   `--record-size` bytes to the input partitions at `--rate` MB/s for `--duration` seconds,
   `--batch-records` a batch. Each value starts with "input index:sequence:append time in ns:".
   It uploads every `--upload-interval` seconds, so what it appends becomes readable soon.
3. A streaming query reads the inputs through the connector (`readStream.format("s3stream")`,
   `maxOffsetsPerTrigger`), parses each value, drops the records whose sequence is a multiple
   of 5 (a filter), gives the rest a key ("k" + sequence mod 97) and an output partition
   (sequence mod `--outputs`), and writes them through the connector
   (`writeStream.format("s3stream")`, exactly once). Spark runs local[2, 4]: a failed task runs
   again.
4. Halfway, one of Spark's Python workers is killed (SIGKILL): its task fails and runs again.
5. A tail on every output partition, in the driver (s3stream's reader), notes when each record
   becomes visible there; its latency is that time minus the append time in its value (same host,
   same clock).
6. When the producer has stopped and the outputs hold every expected record (or `--drain` seconds
   passed), the query stops; every output partition is read whole and each acknowledged input
   record that passes the filter must be there exactly once (lost, duplicated).

Targets (issue 30): 0 lost, 0 duplicated with the kill (the warm-up records too); the figures:
records/s, MB/s and the end-to-end latency p50/p99 (append to visible in the output partition;
issue 51: p99 <= 2 s).
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import threading
import time

from benchmarks.kit import parse_size, pyplot, save_figure

from .common import cleanup_dirs, environ_set, latency_summary, progress, publish, storage, verdict, worker_python
from s3stream.cluster import open_partition, read_partition

FILTER_MOD = 5          # records whose sequence is a multiple of this are dropped by the query
KEY_MOD = 97
WARM_INPUT = -1         # the input index in the warm-up records' values
WARM_SEQS = (1, 2)      # their sequences: both pass the filter and reach both outputs (seq mod 2)
TARGET_P99_S = 2.0      # issue 51: end-to-end p99 (append -> visible in an output partition)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="spark_bench pipeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=4, help="input partitions")
    ap.add_argument("--outputs", type=int, default=2, help="output partitions")
    ap.add_argument("--rate", type=float, default=8.0, help="MB/s the producer appends")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds the producer appends")
    ap.add_argument("--record-size", type=parse_size, default=1024, help="bytes of each record's value")
    ap.add_argument("--batch-records", type=int, default=64, help="records per appended batch")
    ap.add_argument("--upload-interval", type=float, default=None,
                    help="the producer node's Config.upload_interval (what it appends becomes readable then; "
                         "default: the Config's)")
    ap.add_argument("--max-offsets", type=int, default=50_000, help="maxOffsetsPerTrigger of the query")
    ap.add_argument("--trigger", type=float, default=0.0, help="processing-time trigger, seconds (0: back to back)")
    ap.add_argument("--drain", type=float, default=90.0, help="seconds to wait after the producer for the outputs")
    ap.add_argument("--no-kill", action="store_true", help="do not kill a Python worker")
    ap.add_argument("--meta", default=None, help="metadata URL (default: SQLite in the work dir); `postgres`: a "
                    "throwaway PostgreSQL server on 127.0.0.1 for the run")
    ap.add_argument("--store", default=None, help="object store URL (default: a directory on /dev/shm)")
    ap.add_argument("--out", default=None, help="report directory (default reports/spark-pipeline)")
    ap.add_argument("--workdir", default=None, help="WALs, SQLite metadata, Spark's checkpoint (default: OUT/work)")
    ap.add_argument("--keep", action="store_true", help="keep the work and store directories")
    ap.add_argument("--quick", action="store_true", help="a short run: 6 s at 2 MB/s")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration, args.rate, args.drain = min(args.duration, 6.0), min(args.rate, 2.0), min(args.drain, 60.0)
    return args


def produce(spec: dict, acks) -> None:
    """The producer process: appends at the rate asked; sends (input index, first seq, count) of
    every acknowledged batch on `acks`, then None, or ("error", its text) if it failed."""
    import s3stream
    from s3stream.records import Record
    interval = spec["upload_interval"]
    config = s3stream.Config(**({} if interval is None else {"upload_interval": interval}))
    client = s3stream.StreamClient(node_id=2, wal_path=spec["wal"], object_store=spec["store"],
                                   metadata=spec["meta"], config=config)
    try:
        parts = [open_partition(client, f"in-{i}") for i in range(spec["inputs"])]
        pad = b"x" * spec["record_size"]
        per_batch = spec["batch_records"] * spec["record_size"]
        interval = per_batch / (spec["rate"] * 1e6)
        seq = [0] * len(parts)
        start = time.monotonic()
        n = 0
        pending = []
        while time.monotonic() - start < spec["duration"]:
            i = n % len(parts)
            now = time.time_ns()
            first = seq[i]
            records = []
            for s in range(first, first + spec["batch_records"]):
                head = f"{i}:{s}:{now}:".encode()
                records.append(Record(key=None, value=head + pad[len(head):]))
            seq[i] += spec["batch_records"]
            pending.append((parts[i].append_records(records), i, first, len(records)))
            n += 1
            while len(pending) > 64 or (pending and pending[0][0].done()):
                fut, i0, f0, c0 = pending.pop(0)
                fut.result()
                acks.put((i0, f0, c0))
            wait = start + n * interval - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        for fut, i0, f0, c0 in pending:
            fut.result()
            acks.put((i0, f0, c0))
        client.force_upload()
    except BaseException as e:
        acks.put(("error", f"{type(e).__name__}: {e}"))
        raise
    finally:
        client.close()
        acks.put(None)


class Tail(threading.Thread):
    """Notes when each record becomes visible in the output partitions (driver side)."""

    def __init__(self, meta: str, store: str, names: list[str]) -> None:
        super().__init__(daemon=True)
        import s3stream
        self.reader = s3stream.open_reader(meta, store)
        self.names = names
        self.seen: dict[tuple[int, int], int] = {}       # (input, seq) -> times seen
        self.warm_seen = 0                               # warm-up records seen
        self.latencies: list[tuple[float, float]] = []   # (seconds since start, latency s)
        self.lock = threading.Lock()
        self.t0 = time.time()
        self.threads = []

    def run(self) -> None:
        for name in self.names:
            t = threading.Thread(target=self._tail, args=(name,), daemon=True)
            t.start()
            self.threads.append(t)
        for t in self.threads:
            t.join()

    def _tail(self, name: str) -> None:
        from s3stream.errors import S3StreamError
        try:
            part = read_partition(self.reader, name)
            for batch in self.reader.tail(part.log_stream_id, 0, max_bytes=8 << 20, poll_interval=0.05):
                now = time.time_ns()
                rows = []
                for record in batch.records():
                    i, s, t, _ = record.value.split(b":", 3)
                    rows.append(((int(i), int(s)), (now - int(t)) / 1e9))
                with self.lock:
                    for key, latency in rows:
                        if key[0] == WARM_INPUT:
                            self.warm_seen += 1
                            continue
                        self.seen[key] = self.seen.get(key, 0) + 1
                        self.latencies.append((now / 1e9 - self.t0, latency))
        except S3StreamError:
            if not self.reader.closed:
                raise

    def count(self) -> int:
        with self.lock:
            return len(self.seen)

    def warm(self) -> int:
        """Warm-up records seen."""
        with self.lock:
            return self.warm_seen

    def close(self) -> None:
        self.reader.close()


def python_workers() -> list[int]:
    """PIDs of Spark's Python workers: children of a pyspark.daemon process that run it too."""
    daemons, procs = set(), {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if b"pyspark.daemon" in cmd:
            procs[int(pid)] = ppid
    for pid, ppid in procs.items():
        if ppid not in procs:
            daemons.add(pid)
    return sorted(pid for pid, ppid in procs.items() if ppid in daemons)


def spark_session(name: str):
    from pyspark.sql import SparkSession
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    with environ_set(worker_python()):
        return (SparkSession.builder.master("local[2,4]").appName(name)
                .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
                .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.memory", "2g")
                .config("spark.sql.shuffle.partitions", "2").getOrCreate())


def start_query(spark, args, meta: str, store: str, checkpoint: str):
    from pyspark.sql import functions as F
    df = (spark.readStream.format("s3stream").option("metadata", meta).option("object_store", store)
          .option("subscribe", ",".join(f"in-{i}" for i in range(args.inputs)))
          .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", args.max_offsets).load())
    fields = F.split(F.col("value").cast("string"), ":", 4)
    seq = fields.getItem(1).cast("long")
    out = (df.select("value", seq.alias("seq")).where(F.col("seq") % FILTER_MOD != 0)
           .select("value", F.concat(F.lit("k"), (F.col("seq") % KEY_MOD).cast("string")).alias("key"),
                   F.concat(F.lit("out-"), (F.col("seq") % args.outputs).cast("string")).alias("partition")))
    writer = (out.writeStream.format("s3stream").option("metadata", meta).option("object_store", store)
              .option("checkpointLocation", checkpoint))
    if args.trigger > 0:
        writer = writer.trigger(processingTime=f"{args.trigger} seconds")
    return writer.start()


def run(argv=None) -> dict:
    args = parse_args(argv or [])
    if args.meta != "postgres":
        return _run(args)
    from testservers.postgres import MissingBinaries, throwaway_postgres
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(throwaway_postgres())
        except MissingBinaries as e:
            raise SystemExit(f"--meta postgres: {e}") from None
        args.meta = server.create_database("spark_bench_pipeline")
        progress(f"metadata: a throwaway PostgreSQL server for the run, {args.meta}")
        return _run(args)


def _run(args) -> dict:

    import s3stream
    from s3stream.records import Record
    out, work, store, meta, cleanup = storage(args, "pipeline")
    inputs = [f"in-{i}" for i in range(args.inputs)]
    outputs = [f"out-{i}" for i in range(args.outputs)]
    progress(f"pipeline: {args.inputs} inputs -> {args.outputs} outputs, {args.rate:g} MB/s for {args.duration:g} s")
    client = s3stream.StreamClient(node_id=1, wal_path=os.path.join(work, "wal-setup"), object_store=store, metadata=meta)
    parts = {name: open_partition(client, name) for name in inputs + outputs}
    # Warm-up records (input index WARM_INPUT) in every input: the query's first micro-batch with
    # data starts its Python readers and writers; the producer starts once they came out.
    for name in inputs:
        parts[name].append_records([Record(key=None, value=f"{WARM_INPUT}:{s}:{time.time_ns()}:".encode())
                                    for s in WARM_SEQS]).result()
    client.close()
    spark = spark_session("spark_bench pipeline")
    tail = Tail(meta, store, outputs)
    tail.start()
    ctx = multiprocessing.get_context("spawn")
    acks = ctx.Queue()
    spec = {"wal": os.path.join(work, "wal-producer"), "store": store, "meta": meta, "inputs": args.inputs,
            "record_size": args.record_size, "batch_records": args.batch_records, "rate": args.rate,
            "duration": args.duration, "upload_interval": args.upload_interval}
    query = None
    kill = None
    acked: list[tuple[int, int, int]] = []
    try:
        query = start_query(spark, args, meta, store, os.path.join(work, "checkpoint"))
        # The query's first micro-batches start the JVM's code paths and Python workers (readers and
        # writers): the producer starts once the warm-up records are out, so that latency measures
        # the pipeline, not its start (reported apart as `warm_up_s`).
        warm_started = time.time()
        warm_deadline = warm_started + 120
        while tail.warm() < len(inputs) * len(WARM_SEQS) and time.time() < warm_deadline:
            if query.exception() is not None:
                raise RuntimeError(f"the streaming query failed: {query.exception()}")
            time.sleep(0.05)
        warm_up_s = time.time() - warm_started
        if tail.warm() < len(inputs) * len(WARM_SEQS):
            raise RuntimeError(f"the warm-up records did not come out in 120 s ({tail.warm()} of "
                               f"{len(inputs) * len(WARM_SEQS)} seen)")
        progress(f"warm-up: {tail.warm()} records through the pipeline in {warm_up_s:.1f} s")
        producer = ctx.Process(target=produce, args=(spec, acks), daemon=True)
        t_start = time.time()
        producer.start()
        kill_at = t_start + args.duration / 2
        done = False
        while not done:
            try:
                item = acks.get(timeout=0.2)
            except Exception:     # queue.Empty
                item = ()
            if item is None:
                done = True
            elif item and item[0] == "error":
                raise RuntimeError(f"the producer failed: {item[1]}")
            elif item:
                acked.append(item)
            if kill is None and not args.no_kill and time.time() >= kill_at:
                workers = python_workers()
                if workers:
                    os.kill(workers[0], signal.SIGKILL)
                    kill = {"pid": workers[0], "second": time.time() - t_start, "workers_seen": len(workers)}
                    progress(f"killed Python worker {workers[0]} (of {len(workers)}) at {kill['second']:.1f} s")
            if query.exception() is not None:
                raise RuntimeError(f"the streaming query failed: {query.exception()}")
            if not producer.is_alive() and not done and acks.empty():
                raise RuntimeError(f"the producer died (exit code {producer.exitcode})")
        producer.join(30)
        t_produced = time.time()
        expected = {(i, s) for i, first, count in acked for s in range(first, first + count) if s % FILTER_MOD}
        progress(f"producer done: {sum(c for _, _, c in acked)} records acknowledged, {len(expected)} expected out")
        deadline = time.time() + args.drain
        while tail.count() < len(expected) and time.time() < deadline:
            if query.exception() is not None:
                raise RuntimeError(f"the streaming query failed: {query.exception()}")
            time.sleep(0.2)
        t_drained = time.time()
        batches = max((p["batchId"] for p in query.recentProgress), default=-1) + 1
    finally:
        if query is not None:
            with contextlib.suppress(Exception):
                query.stop()
        spark.stop()
    # Verify from the outputs read whole (not from the tail).
    counts: dict[tuple[int, int], int] = {}
    out_bytes = 0
    warm_out = 0
    with s3stream.open_reader(meta, store) as reader:
        for name in outputs:
            part = read_partition(reader, name)
            position, end = part.start_offset, part.end_offset
            while position < end:
                res = part.fetch(position, end, 8 << 20)
                for batch in res.batches:
                    for record in batch.records():
                        i, s, _, _ = record.value.split(b":", 3)
                        key = (int(i), int(s))
                        if key[0] == WARM_INPUT:
                            warm_out += 1
                            continue
                        counts[key] = counts.get(key, 0) + 1
                        out_bytes += len(record.value)
                position = res.batches[-1].base_offset + res.batches[-1].count
    tail.close()
    lost = len(expected - counts.keys())
    duplicated = sum(c - 1 for c in counts.values() if c > 1)
    unexpected = len(counts.keys() - expected)
    lat = [latency for _, latency in tail.latencies]
    elapsed = t_drained - t_start
    report = {
        "kind": "spark-pipeline", "inputs": args.inputs, "outputs": args.outputs, "rate_mb_s": args.rate,
        "duration": args.duration, "record_size": args.record_size, "max_offsets_per_trigger": args.max_offsets,
        "metadata": meta.split(":", 1)[0], "store": store.split(":", 1)[0],
        "acknowledged": sum(c for _, _, c in acked), "expected": len(expected), "written": sum(counts.values()),
        "lost": lost, "duplicated": duplicated, "unexpected": unexpected,
        "seconds": elapsed, "drain_s": t_drained - t_produced,
        "records_s": sum(counts.values()) / elapsed if elapsed else None,
        "mb_s": out_bytes / elapsed / 1e6 if elapsed else None,
        "latency": latency_summary([int(x * 1e9) for x in lat]) if lat else None,
        "latency_series": _series(tail.latencies),
        "micro_batches": batches, "kill": kill, "warm_up_s": warm_up_s, "warm_up_records_out": warm_out,
        "targets": {"lost": 0, "duplicated": 0, "latency_p99_s": TARGET_P99_S},
        "ok": (lost == 0 and duplicated == 0 and unexpected == 0 and len(expected) > 0
               and warm_out == len(inputs) * len(WARM_SEQS) and (kill is not None or args.no_kill)),
    }
    if not args.keep:
        cleanup_dirs(cleanup)
    return publish(report, out, plot, format_report)


def _series(points: list[tuple[float, float]]) -> list[dict]:
    """Latency p50/p99 and records per whole second of the run."""
    by_second: dict[int, list[float]] = {}
    for t, latency in points:
        by_second.setdefault(int(t), []).append(latency)
    out = []
    for second in sorted(by_second):
        values = sorted(by_second[second])
        out.append({"second": second, "records": len(values), "p50": values[len(values) // 2],
                    "p99": values[min(len(values) - 1, int(len(values) * 0.99))]})
    return out


def plot(report: dict, out: str) -> list[str]:
    plt = pyplot("spark_bench pipeline")
    if plt is None or not report["latency_series"]:
        return []
    s = report["latency_series"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    ax1.plot([p["second"] for p in s], [p["p50"] for p in s], label="p50")
    ax1.plot([p["second"] for p in s], [p["p99"] for p in s], "--", label="p99")
    ax1.set_ylabel("append -> visible in output, s")
    ax2.plot([p["second"] for p in s], [p["records"] for p in s], label="records made visible")
    ax2.set_ylabel("records / s")
    ax2.set_xlabel("seconds since the tail started")
    if report["kill"]:
        for ax in (ax1, ax2):
            ax.axvline(report["kill"]["second"], color="r", label="Python worker SIGKILLed")
    ax1.legend()
    ax2.legend()
    return [save_figure(plt, fig, out, "pipeline.png")]


def format_report(r: dict) -> str:
    lat = r["latency"] or {}
    kill = r["kill"]
    return "\n".join([
        "=" * 100,
        f"Spark pipeline through the s3stream data source: {r['inputs']} inputs -> {r['outputs']} outputs, "
        f"{r['rate_mb_s']:g} MB/s for {r['duration']:g} s, records of {r['record_size']} B, metadata {r['metadata']}",
        f"records: {r['acknowledged']} acknowledged in, {r['expected']} expected out (the filter drops 1 in "
        f"{FILTER_MOD}), {r['written']} written; {r['micro_batches']} micro-batches",
        f"lost: {r['lost']} ({verdict(r['lost'] == 0)}; target 0), duplicated: {r['duplicated']} "
        f"({verdict(r['duplicated'] == 0)}; target 0), unexpected: {r['unexpected']}",
        f"throughput: {r['records_s']:.0f} records/s, {r['mb_s']:.2f} MB/s over {r['seconds']:.1f} s "
        f"(drained {r['drain_s']:.1f} s after the producer stopped)",
        f"end-to-end latency (append -> visible in the output partition): p50 {lat.get('p50_ms', 0) / 1000:.3f} s, "
        f"p99 {lat.get('p99_ms', 0) / 1000:.3f} s ({verdict(lat.get('p99_ms', 1e12) <= TARGET_P99_S * 1000)}; "
        f"issue 51's target <= {TARGET_P99_S:g} s), max {lat.get('max_ms', 0) / 1000:.3f} s",
        f"warm-up (before the producer starts; the first micro-batches with data start Spark's Python readers "
        f"and writers): {r['warm_up_s']:.1f} s, {r['warm_up_records_out']} warm-up records out exactly once",
        f"kill: {'Python worker %d SIGKILLed at %.1f s' % (kill['pid'], kill['second']) if kill else 'none'}",
        "=" * 100,
    ])
