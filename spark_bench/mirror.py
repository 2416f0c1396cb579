"""The mirror under load: a source cluster, a target cluster, mirror workers as Spark tasks, one
SIGKILLed and replaced mid-run, and a consumer group that fails over from the source to the target.

1. Two clusters in the work dir (each its own SQLite metadata and object-store directory; the
   --source-*/--target-* options name others). Spark tasks act as source nodes: each opens its
   share of 16 partitions and appends paced batches (`--rate` MB/s in all) whose payloads name
   them (common.payload_for), keeping every acknowledgement with its time.
2. Other Spark tasks each supervise a child process running a MirrorWorker of flow A->target
   (worker id = task number, its WAL dir in the work dir). At 40 % of the load the first task
   SIGKILLs its child and starts a replacement on the same worker id and WAL dir, which replays
   the WAL and adopts the dead incarnation's leases.
3. On the driver: a monitor samples each target partition's committed end every 0.2 s (when a
   record is readable on the target), and a consumer reads the source partitions, committing its
   positions to group `bench-consumer` on the source every second. At 2/3 of the load it stops,
   waits until the leader worker's checkpoint sync has translated its final positions exactly onto
   the target (or runs sync_checkpoints itself after a timeout, and says so), joins the group on
   the target and reads on from the translated offsets to the end.
4. When the load has ended and the target holds every source record, the driver stops the
   workers and reads both clusters whole: each source batch must be on the target exactly once,
   in order, and the consumer must have read each exactly once across the failover.

Report (report.json, lag.png: replication lag over time, the kill and the failover marked):
records (batches mirrored), lost, duplicates, translation_errors (the consumer's committed source
positions whose translated target offset holds another record), lag_p50_s / lag_p99_s (from the
source's acknowledgement of an append to its commit on the target, to within the 0.2 s sampling),
mb_s (mirrored bytes / seconds from the load's start until the target had caught up).

Targets: lost = 0, duplicates = 0, translation_errors = 0; the consumer skips and repeats nothing.
Run it with `python -m spark_bench mirror [--quick]` or `s3stream bench --kind spark-mirror`.
As a script (`python -m spark_bench.mirror CHILD-SPEC-JSON`) this module is a worker's child process.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.kit import percentiles, pyplot, save_figure


from .common import (KiB, MiB, add_common_args, assign_metrics_ports, deployment, new_run_id, progress, publish,
                     refuse_used_metadata, run_nodes, serve_task_metrics, stop_task_metrics, verdict)
from .common import digest, payload_for
from .node import where_am_i
from s3stream.cluster import open_partition, read_partition

TARGETS = dict(lost=0, duplicates=0, translation_errors=0)
PARTITIONS = 16
SOURCE_ALIAS = "A"
FLOW = "A->target"
GROUP = "bench-consumer"
SAMPLE_INTERVAL = 0.2


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m spark_bench mirror", description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--source-nodes", type=int, default=2, help="Spark tasks acting as source nodes")
    ap.add_argument("--workers", type=int, default=2, help="mirror workers (Spark tasks, each with a child)")
    ap.add_argument("--rate", type=float, default=None, help="total produce rate, MB/s (default 8; --quick 4)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of load (default 90; --quick 36)")
    ap.add_argument("--lead", type=float, default=None,
                    help="seconds between planning the run and its second 0, for Spark to start the tasks")
    ap.add_argument("--catchup", type=float, default=60.0, help="most seconds the mirror may take to catch up")
    ap.add_argument("--checkpoint-interval", type=float, default=1.0, help="the leader's sync_checkpoints period")
    ap.add_argument("--quick", action="store_true", help="a shorter, lighter run (about a minute in all)")
    for side in ("source", "target"):
        ap.add_argument(f"--{side}-meta", default=None, help=f"the {side} cluster's metadata URL "
                        f"(default: sqlite in the work dir)")
        ap.add_argument(f"--{side}-store", default=None, help=f"the {side} cluster's object store URL "
                        f"(default: a directory {side}/ under --store's)")
    ap.set_defaults(batch=32 * KiB, upload_threshold=4 * MiB, wal_capacity=256 * MiB)
    args = ap.parse_args(argv)
    if args.rate is None:
        args.rate = 4.0 if args.quick else 8.0
    if args.duration is None:
        args.duration = 36.0 if args.quick else 90.0
    if args.lead is None:
        args.lead = 10.0 if args.quick else 15.0
    return args


# ---- engine settings shared by the tasks and the driver --------------------------------------------

def engine_config(spec: dict, upload_interval: float | None = 0.2):
    """A node's Config: small blocks uploaded every 0.2 s, so a record is committed (readable by
    the mirror, or on the target) soon after its append."""
    import s3stream
    import wal
    return s3stream.Config(upload_threshold=spec["upload_threshold"], split_size=min(spec["upload_threshold"], 8 * MiB),
                           upload_interval=upload_interval, cache_size=max(4 * spec["upload_threshold"], 64 * MiB),
                           max_batch_bytes=max(spec["batch"], 1 * MiB),
                           wal=wal.WALConfig(capacity=spec["wal_capacity"], full_timeout=60))


def reader_client(store: str, meta: str):
    """A reader of a cluster (read_partition, its metadata for consumer groups): not a node, no
    WAL, nothing written but what the caller writes through its metadata (s3stream.open_reader)."""
    import s3stream
    return s3stream.open_reader(meta, store)


def wall_ns(monotonic_ns: int) -> int:
    return monotonic_ns + (time.time_ns() - time.monotonic_ns())


# ---- Spark tasks ------------------------------------------------------------------------------------

def run_tasks_of_partition(specs) -> list[dict]:
    """The body of a Spark task: a source node or a mirror worker's supervisor, by `role`."""
    return [run_source(spec) if spec["role"] == "source" else run_supervisor(spec) for spec in specs]


def run_source(spec: dict) -> dict:
    """A source node: open its partitions, append paced batches until origin + duration, keep
    every acknowledgement (partition, base, seq, digest, wall ns of the ack), close, and record
    the partitions' committed ends under bench/<run>/source-done/<node> in the source KV."""
    import s3stream
    from benchmarks.engine import completion_ns, watch_completion
    from s3stream.metadata import open_metadata
    node_id = spec["node_id"]
    wal_dir = spec["wal_dir"] or tempfile.mkdtemp(prefix=f"s3stream-source{node_id}-", dir=spec.get("node_dir"))
    client = s3stream.StreamClient(node_id, os.path.join(wal_dir, f"source{node_id}.wal"), spec["store"],
                                   spec["meta"], engine_config(spec), metrics=bool(spec.get("metrics_port")))
    metrics_server = serve_task_metrics(spec)
    parts = {name: open_partition(client, name) for name in spec["partitions"]}
    interval_ns = int(spec["batch"] / spec["rate_per_partition"] * 1e9)
    origin_ns = int(spec["origin"] * 1e9)
    deadline_ns = origin_ns + int(spec["duration"] * 1e9)
    lock = threading.Lock()
    acks: list[tuple] = []
    errors: list[str] = []

    def produce(name: str) -> None:
        window: collections.deque = collections.deque()
        part, seq = parts[name], 0
        next_ns = max(origin_ns, time.time_ns())
        while True:
            now = time.time_ns()
            if next_ns >= deadline_ns:
                break
            if next_ns > now:
                time.sleep((next_ns - now) / 1e9)
            next_ns = max(next_ns, time.time_ns() - 100_000_000) + interval_ns
            data = payload_for(name, node_id, seq, spec["batch"])
            try:
                fut = part.append(s3stream.RecordBatch(data, 1))
            except s3stream.S3StreamError as e:
                errors.append(f"{name}: {e!r}")
                continue
            watch_completion(fut)
            window.append((fut, seq, data))
            seq += 1
            while len(window) > 16 or (window and window[0][0].done()):
                settle(name, *window.popleft())
        while window:
            settle(name, *window.popleft())

    def settle(name: str, fut, seq: int, data: bytes) -> None:
        try:
            base = fut.result(60).base_offset
        except Exception as e:  # noqa: BLE001 - not acknowledged: not expected on the target either
            errors.append(f"{name} seq {seq}: {e!r}")
            return
        acked = completion_ns(fut)
        at = wall_ns(acked) if acked is not None else time.time_ns()
        with lock:
            acks.append((name, base, seq, digest(data), len(data), at))

    threads = [threading.Thread(target=produce, args=(n,), daemon=True) for n in spec["partitions"]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in parts.values():
        p.close()
    ends = {name: read_partition(client, name).end_offset for name in parts}
    client.close(retire=True)
    stop_task_metrics(metrics_server)
    meta = open_metadata(spec["meta"])
    try:
        meta.put_kv(f"bench/{spec['run_id']}/source-done/{node_id}", json.dumps(ends).encode())
    finally:
        meta.close()
    return dict(role="source", node_id=node_id, acks=acks, ends=ends, errors=errors[:20], executor=where_am_i())


class Child:
    """A MirrorWorker in a child process (`python -m spark_bench.mirror SPEC`); it prints a JSON
    status line every 0.2 s and, on SIGTERM, stops the worker and prints its final status."""

    def __init__(self, spec: dict, incarnation: int) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.log_path = os.path.join(spec["wal_dir"], f"child-{incarnation}.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "spark_bench.mirror", json.dumps(spec)], env=env,
                                         stdout=subprocess.PIPE, stderr=log, text=True)
        self.last: dict = {}
        self.final: dict | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                status = json.loads(line)
            except ValueError:
                continue
            if "final" in status:
                self.final = status
            else:
                self.last = status

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout: float = 60.0) -> dict | None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self.reader.join(5)
        return self.final

    def tail(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-2000:]


def run_supervisor(spec: dict) -> dict:
    """A mirror worker's supervisor: run the worker as a child process until the driver sets
    bench/<run>/stop in the source KV; at `kill_at` (if given) SIGKILL it and start a replacement
    on the same worker id and WAL dir."""
    from s3stream.metadata import open_metadata
    worker_id = spec["worker_id"]
    if spec["wal_dir"] is None:
        spec = dict(spec, wal_dir=tempfile.mkdtemp(prefix=f"s3stream-mirror{worker_id}-", dir=spec.get("node_dir")))
    os.makedirs(spec["wal_dir"], exist_ok=True)
    child = Child(spec, 0)
    incarnations = 1
    kill: dict | None = None
    meta = open_metadata(spec["source_meta"])
    stop_key = f"bench/{spec['run_id']}/stop"
    errors: list[str] = []
    try:
        while meta.get_kv(stop_key) is None and time.time() < spec["give_up_at"]:
            if child.proc.poll() is not None:
                errors.append(f"worker {worker_id} exited with {child.proc.returncode}: {child.tail()}")
                child = Child(spec, incarnations)
                incarnations += 1
            if spec["kill_at"] is not None and kill is None and time.time() >= spec["kill_at"]:
                before = dict(child.last)
                pid = child.proc.pid
                child.kill()
                killed_at = time.time()
                child = Child(spec, incarnations)
                incarnations += 1
                kill = dict(worker_id=worker_id, at=killed_at, pid=pid, replacement_pid=child.proc.pid,
                            status_before=before, recovered_at=None, replayed=None)
            if kill is not None and kill["recovered_at"] is None and child.last.get("running", 0) > 0:
                kill["recovered_at"] = time.time()
                kill["replayed"] = child.last.get("replayed")
                kill["flows_after"] = child.last.get("running")
            time.sleep(0.05)
        final = child.stop()
    finally:
        if child.proc.poll() is None:
            child.kill()
        meta.close()
    if final is None:
        errors.append(f"worker {worker_id} gave no final status: {child.tail()}")
    return dict(role="mirror", worker_id=worker_id, kill=kill, incarnations=incarnations, final=final,
                errors=errors, executor=where_am_i())


def child_main(raw_spec: str) -> None:
    """The child process: a MirrorWorker between the two clusters (see Child)."""
    from s3stream.mirror import MirrorWorker, WorkerConfig
    spec = json.loads(raw_spec)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    config = WorkerConfig(interval=0.5, lease_ttl=4.0, worker_timeout=4.0,
                          checkpoint_interval=spec["checkpoint_interval"], heartbeat_interval=1.0, retry_backoff=1.0,
                          flow_stop_timeout=10.0, poll_interval=0.02, fetch_bytes=1 * MiB,
                          max_in_flight_bytes=4 * MiB, engine=engine_config(spec),
                          metrics=bool(spec.get("metrics_port")))
    serve_task_metrics(spec)               # the process ends with the worker (or is SIGKILLed)
    worker = MirrorWorker(spec["worker_id"], source_store=spec["source_store"], source_meta=spec["source_meta"],
                          target_store=spec["target_store"], target_meta=spec["target_meta"],
                          source_alias=SOURCE_ALIAS, flow_id=FLOW, wal_dir=spec["wal_dir"], config=config).start()
    replayed = worker.target_client.recovered.get("replayed", 0)
    while not stopping.is_set():
        flows = worker.flows()
        print(json.dumps(dict(running=sum(f.state == "running" for f in flows.values()), leases=len(worker.leases()),
                              leader=worker.is_leader, replayed=replayed, checkpoints=worker.checkpoints)), flush=True)
        stopping.wait(0.2)
    final = worker.stop(30)
    print(json.dumps(dict(final=dict(leader=final["leader"], checkpoints=final["checkpoints"],
                                     errors=final["errors"][:10], fatal=final["fatal"]), replayed=replayed,
                          events=list(worker.events)), default=str), flush=True)


# ---- the driver's threads ---------------------------------------------------------------------------

def read_batches(reader) -> list[tuple[int, int, str, int]]:
    """(base offset, count, digest, bytes) of every committed batch of a partition reader."""
    out, position, end = [], reader.start_offset, reader.end_offset
    while position < end:
        res = reader.fetch(position, end, 4 * MiB)
        if not res.batches:
            break
        out += [(b.base_offset, b.count, digest(bytes(b.payload)), len(b.payload)) for b in res.batches]
        position = res.end_offset
    return out


class Monitor(threading.Thread):
    """Samples every target partition's committed end (with the time) every SAMPLE_INTERVAL;
    once every source node is done and the target holds all they committed, notes the time
    (`caught_up_at`), tells the consumer to drain, waits for it, and stops the workers."""

    def __init__(self, urls: dict, run_id: str, sources: int, give_up_at: float, consumer: "FailoverConsumer"):
        super().__init__(daemon=True, name="mirror-monitor")
        self.urls, self.run_id, self.sources, self.give_up_at, self.consumer = urls, run_id, sources, give_up_at, consumer
        self.samples: dict[str, list[tuple[float, int]]] = {}
        self.source_ends: dict[str, int] = {}
        self.caught_up_at: float | None = None
        self.abort = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        from s3stream.metadata import open_metadata
        from s3stream.mirror import OffsetMap, load_flow
        target, source = open_metadata(self.urls["target_meta"]), open_metadata(self.urls["source_meta"])
        streams: dict[str, int] = {}
        try:
            while not self.abort.is_set():
                now = time.time()
                if len(streams) < PARTITIONS:
                    streams = {t: r.log_stream_id for t, r in load_flow(target, FLOW).partitions.items()}
                for name, stream_id in streams.items():
                    end = target.get_stream(stream_id).end_offset
                    series = self.samples.setdefault(name, [])
                    if not series or series[-1][1] != end:
                        series.append((now, end))
                if self.caught_up_at is None:
                    done = source.list_kv(f"bench/{self.run_id}/source-done/")
                    if len(done) == self.sources:
                        self.source_ends = {n: e for raw in done.values() for n, e in json.loads(raw).items()}
                        segments = load_flow(target, FLOW).segments
                        ends = {t: s[-1][1] for t, s in self.samples.items()}
                        if all(e == 0 or (segments.get(f"{SOURCE_ALIAS}.{n}") and OffsetMap(
                                segments[f"{SOURCE_ALIAS}.{n}"], ends.get(f"{SOURCE_ALIAS}.{n}", 0)).upstream_end >= e)
                               for n, e in self.source_ends.items()):
                            self.caught_up_at = now
                            self.consumer.drain.set()
                if (self.caught_up_at is not None and not self.consumer.is_alive()) or now > self.give_up_at:
                    if self.caught_up_at is None:
                        self.errors.append("the mirror did not catch up in time: stopping the workers anyway")
                        self.consumer.drain.set()
                    break
                time.sleep(max(0.0, SAMPLE_INTERVAL - (time.time() - now)))
        except Exception as e:  # noqa: BLE001 - reported; the workers are stopped below
            self.errors.append(f"monitor: {e!r}")
        finally:
            source.put_kv(f"bench/{self.run_id}/stop", b"1")
            target.close()
            source.close()

    def readable_at(self, target_name: str, end: int) -> float | None:
        """The first sampled time at which the target partition's committed end was >= `end`."""
        series = self.samples.get(target_name, [])
        i = bisect.bisect_left([e for _, e in series], end)
        return series[i][0] if i < len(series) else None


class FailoverConsumer(threading.Thread):
    """Reads the source partitions, committing positions to GROUP on the source every second;
    at `failover_at` fails over to the target (see the module docstring) and reads on until
    drained. `consumed`: (partition, digest, side) of every batch read."""

    def __init__(self, urls: dict, names: list[str], work: str, failover_at: float, sync_timeout: float):
        super().__init__(daemon=True, name="mirror-consumer")
        self.urls, self.names, self.work = urls, names, work
        self.failover_at, self.sync_timeout = failover_at, sync_timeout
        self.drain = threading.Event()
        self.abort = threading.Event()
        self.consumed: list[tuple[str, str, str]] = []
        self.committed_source: dict[str, int] = {}
        self.target_offsets: dict[str, int] = {}
        self.checkpoint_statuses: dict[str, str] = {}
        self.synced_by = None
        self.failed_over_at: float | None = None
        self.sync_wait_s: float | None = None
        self.errors: list[str] = []

    def _read(self, client, names: dict[str, str], positions: dict[str, int], side: str) -> int:
        """One pass over the partitions (`names`: consumer name -> partition name on this side):
        everything committed past each position. Returns the batches read."""
        import s3stream
        read = 0
        for name, part in names.items():
            try:
                reader = read_partition(client, part)
            except s3stream.StreamNotFoundError:
                continue
            if name not in positions:
                positions[name] = reader.start_offset
            end = reader.end_offset
            while positions[name] < end:
                res = reader.fetch(positions[name], end, 1 * MiB)
                if not res.batches:
                    break
                self.consumed += [(name, digest(bytes(b.payload)), side) for b in res.batches]
                read += len(res.batches)
                positions[name] = res.end_offset
        return read

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - reported
            self.errors.append(f"consumer: {e!r}")

    def _run(self) -> None:
        from s3stream.records.consumer import ConsumerGroups
        from s3stream.mirror import sync_checkpoints
        u = self.urls
        source = reader_client(u["source_store"], u["source_meta"])
        target = reader_client(u["target_store"], u["target_meta"])
        try:
            groups = ConsumerGroups(source.metadata)
            generation = groups.join(GROUP, "consumer-1")
            positions: dict[str, int] = {}
            last_commit = 0.0
            while time.time() < self.failover_at and not self.abort.is_set():
                read = self._read(source, {n: n for n in self.names}, positions, "source")
                if time.time() - last_commit >= 1.0:
                    for name, pos in positions.items():
                        groups.commit(GROUP, name, pos, generation)
                    last_commit = time.time()
                if not read:
                    time.sleep(0.05)
            for name, pos in positions.items():
                groups.commit(GROUP, name, pos, generation)
            self.committed_source = dict(positions)
            self.failed_over_at = time.time()
            self._wait_for_checkpoint(target.metadata)
            if self.synced_by is None:
                sync_checkpoints(source.metadata, target.metadata, FLOW, groups=[GROUP])
                self.synced_by = "driver (the leader's sync did not land in time)"
            self.sync_wait_s = time.time() - self.failed_over_at
            target_groups = ConsumerGroups(target.metadata)
            self.target_offsets = target_groups.offsets(GROUP)
            target_generation = target_groups.join(GROUP, "consumer-1")   # the group is the consumers' now
            names = {n: f"{SOURCE_ALIAS}.{n}" for n in self.names}
            tpos = {n: self.target_offsets[t] for n, t in names.items() if t in self.target_offsets}
            last_commit = 0.0
            while not self.abort.is_set():
                draining = self.drain.is_set()
                read = self._read(target, names, tpos, "target")
                if time.time() - last_commit >= 1.0 or draining:
                    for name, pos in tpos.items():
                        target_groups.commit(GROUP, names[name], pos, target_generation)
                    last_commit = time.time()
                if draining:          # the target was complete before this pass: it read to the end
                    break
                if not read:
                    time.sleep(0.05)
        finally:
            source.close()
            target.close()

    def _wait_for_checkpoint(self, target_meta) -> None:
        """Until every position committed on the source is on the target, translated exactly by
        the leader's sync (the commit's metadata names the upstream offset and its status)."""
        deadline = time.time() + self.sync_timeout
        while time.time() < deadline and not self.abort.is_set():
            statuses = {}
            for name, upstream in self.committed_source.items():
                raw = target_meta.get_kv(f"consumer/{GROUP}/offsets/{SOURCE_ALIAS}.{name}")
                meta = json.loads(json.loads(raw)["metadata"] or "{}") if raw is not None else {}
                if meta.get("upstream") == upstream:
                    statuses[name] = meta.get("status")
            if len(statuses) == len(self.committed_source) and all(s == "exact" for s in statuses.values()):
                self.checkpoint_statuses = statuses
                self.synced_by = "the leader worker's checkpoint sync"
                return
            time.sleep(0.1)


# ---- the run ----------------------------------------------------------------------------------------

def cluster_urls(args, dep) -> dict:
    root = dep.store.rstrip("/")
    return dict(source_meta=args.source_meta or f"sqlite:///{dep.work}/source.db",
                target_meta=args.target_meta or f"sqlite:///{dep.work}/target.db",
                source_store=args.source_store or f"{root}/source", target_store=args.target_store or f"{root}/target")


def run(argv=None) -> dict:
    args = parse(argv)
    for option, url in (("--source-meta", args.source_meta), ("--target-meta", args.target_meta)):
        if url:
            refuse_used_metadata(url, option)
    with deployment(args, "mirror", args.source_nodes + args.workers) as dep:
        report = _run(args, dep)
    return publish(report, dep.out, plot, format_report)


def _run(args, dep) -> dict:
    urls = cluster_urls(args, dep)
    names = [f"p{i:02d}" for i in range(PARTITIONS)]
    run_id = new_run_id()
    origin = time.time() + args.lead
    load_end = origin + args.duration
    give_up_at = load_end + args.catchup
    common = dict(run_id=run_id, origin=origin, batch=args.batch, upload_threshold=args.upload_threshold,
                  wal_capacity=args.wal_capacity, node_dir=args.node_dir)
    specs = []
    for i in range(args.source_nodes):
        mine = names[i::args.source_nodes]
        specs.append(dict(common, role="source", node_id=i + 1, partitions=mine, store=urls["source_store"],
                          meta=urls["source_meta"], duration=args.duration,
                          rate_per_partition=args.rate * 1e6 / PARTITIONS, wal_dir=dep.wal_dir))
    kill_at = origin + 0.4 * args.duration
    for w in range(1, args.workers + 1):
        specs.append(dict(common, **urls, role="mirror", worker_id=w, kill_at=kill_at if w == 1 else None,
                          checkpoint_interval=args.checkpoint_interval, give_up_at=give_up_at + 60,
                          wal_dir=None if dep.wal_dir is None else os.path.join(dep.wal_dir, f"mirror{w}")))
    consumer = FailoverConsumer(urls, names, dep.work, origin + 2 / 3 * args.duration,
                                sync_timeout=max(10.0, 5 * args.checkpoint_interval))
    monitor = Monitor(urls, run_id, args.source_nodes, give_up_at, consumer)
    progress(f"{args.source_nodes} source nodes, {PARTITIONS} partitions at {args.rate:g} MB/s for "
             f"{args.duration:g} s; {args.workers} mirror workers (worker 1 SIGKILLed at "
             f"{0.4 * args.duration:.0f} s); the consumer fails over at {2 / 3 * args.duration:.0f} s")
    consumer.start()
    monitor.start()
    try:
        assign_metrics_ports(specs, args.metrics_port, args.metrics_addr)
        results = run_nodes(dep.spark, specs, body=run_tasks_of_partition, seconds=load_end - time.time())
    except BaseException:
        monitor.abort.set()         # it sets the stop key on its way out: no worker child outlives the run
        consumer.abort.set()
        raise
    finally:
        monitor.join(30)
        consumer.abort.set()
        consumer.join(30)
    progress("reading both clusters whole")
    verification = verify(urls, names)
    return summarize(args, dep, urls, results, verification, monitor, consumer, origin, kill_at)


def verify(urls: dict, names: list[str]) -> dict:
    """Every batch of both clusters, per source partition name: (base, count, digest, bytes)."""
    source = reader_client(urls["source_store"], urls["source_meta"])
    target = reader_client(urls["target_store"], urls["target_meta"])
    try:
        return dict(source={n: read_batches(read_partition(source, n)) for n in names},
                    target={n: read_batches(read_partition(target, f"{SOURCE_ALIAS}.{n}")) for n in names})
    finally:
        source.close()
        target.close()


def compare(source: list, target: list) -> dict:
    """lost: source batches not on the target; duplicates: extra copies on the target;
    foreign: target batches that are no source batch; in_order: the same list of batches."""
    want = collections.Counter(d for _, _, d, _ in source)
    have = collections.Counter(d for _, _, d, _ in target)
    return dict(records=sum(min(have[d], n) for d, n in want.items()),
                lost=sum(max(0, n - have[d]) for d, n in want.items()),
                duplicates=sum(max(0, n - max(want[d], 1)) for d, n in have.items()),
                foreign=sum(n for d, n in have.items() if d not in want),
                in_order=[(c, d) for _, c, d, _ in source] == [(c, d) for _, c, d, _ in target],
                bytes=sum(size for _, _, _, size in target))


def summarize(args, dep, urls, results, verification, monitor: Monitor, consumer: FailoverConsumer, origin: float,
              kill_at: float) -> dict:
    from s3stream.mirror import OffsetMap, OffsetNotMirroredError, load_flow
    from s3stream.metadata import open_metadata
    meta = open_metadata(urls["target_meta"])
    try:
        segments = load_flow(meta, FLOW).segments
    finally:
        meta.close()
    names = sorted(verification["source"])
    per_partition = {n: compare(verification["source"][n], verification["target"][n]) for n in names}
    totals = {k: sum(p[k] for p in per_partition.values()) for k in ("records", "lost", "duplicates", "foreign",
                                                                       "bytes")}

    # Lag: from the source's acknowledgement to the sample at which the target's committed end
    # covered the batch's translated offsets.
    lags: list[tuple[float, float]] = []          # (ack seconds after origin, lag seconds)
    unmeasured = 0
    sources = [r for r in results if r["role"] == "source"]
    for r in sources:
        for name, base, _seq, _digest, _size, at_ns in r["acks"]:
            target = f"{SOURCE_ALIAS}.{name}"
            try:
                downstream = OffsetMap(segments[target]).translate(base)
            except (KeyError, OffsetNotMirroredError):
                unmeasured += 1
                continue
            seen = monitor.readable_at(target, downstream + 1)
            if seen is None:
                unmeasured += 1
                continue
            lags.append((at_ns / 1e9 - origin, max(0.0, seen - at_ns / 1e9)))
    lag = percentiles([int(v * 1e9) for _, v in lags], ps=(0.5, 0.99))
    lag_series = collections.defaultdict(list)
    for second, value in lags:
        lag_series[int(second)].append(value)
    series = [dict(second=s, p50=sorted(v)[len(v) // 2], p99=sorted(v)[min(len(v) - 1, int(0.99 * len(v)))],
                   max=max(v)) for s, v in sorted(lag_series.items())]

    # The consumer: positions translated exactly, every source batch read once across the failover.
    translation_errors, translation_detail = 0, {}
    for name, upstream in consumer.committed_source.items():
        src = {b: d for b, _, d, _ in verification["source"][name]}
        tgt = {b: d for b, _, d, _ in verification["target"][name]}
        downstream = consumer.target_offsets.get(f"{SOURCE_ALIAS}.{name}")
        src_end = verification["source"][name][-1][0] + verification["source"][name][-1][1] \
            if verification["source"][name] else 0
        tgt_end = verification["target"][name][-1][0] + verification["target"][name][-1][1] \
            if verification["target"][name] else 0
        if upstream >= src_end:
            ok = downstream == tgt_end
        else:
            ok = downstream is not None and upstream in src and src[upstream] == tgt.get(downstream)
        if not ok:
            translation_errors += 1
            translation_detail[name] = dict(upstream=upstream, downstream=downstream)
    if not consumer.committed_source:
        translation_errors = None            # the consumer never committed: nothing was checked
    read = collections.Counter((n, d) for n, d, _ in consumer.consumed)
    expected = collections.Counter((n, d) for n in names for _, _, d, _ in verification["source"][n])
    consumer_report = dict(
        batches_read=len(consumer.consumed), read_on_source=sum(s == "source" for *_, s in consumer.consumed),
        read_on_target=sum(s == "target" for *_, s in consumer.consumed),
        skipped=sum(max(0, n - read[k]) for k, n in expected.items()),
        read_twice=sum(max(0, n - max(expected[k], 1)) for k, n in read.items()),
        failover_second=None if consumer.failed_over_at is None else consumer.failed_over_at - origin,
        checkpoint_synced_by=consumer.synced_by, checkpoint_wait_s=consumer.sync_wait_s,
        checkpoint_statuses=consumer.checkpoint_statuses, committed_source=consumer.committed_source,
        target_offsets=consumer.target_offsets, translation_detail=translation_detail, errors=consumer.errors)

    kills = [dict(r["kill"], second=r["kill"]["at"] - origin,
                  recovered_s=None if r["kill"]["recovered_at"] is None else r["kill"]["recovered_at"] - r["kill"]["at"])
             for r in results if r["role"] == "mirror" and r.get("kill")]
    mirror_seconds = (monitor.caught_up_at or time.time()) - origin
    acked = sum(len(r["acks"]) for r in sources)
    return dict(
        kind="mirror", **dep.describe(), partitions=PARTITIONS, source_nodes=args.source_nodes, workers=args.workers,
        rate_mb_s=args.rate, duration=args.duration, batch=args.batch, clusters=urls,
        records=totals["records"], lost=totals["lost"], duplicates=totals["duplicates"],
        translation_errors=translation_errors,
        lag_p50_s=None if lag["p50_ms"] is None else lag["p50_ms"] / 1e3,
        lag_p99_s=None if lag["p99_ms"] is None else lag["p99_ms"] / 1e3,
        lag_max_s=None if lag["max_ms"] is None else lag["max_ms"] / 1e3,
        lag_samples=lag["samples"], lag_unmeasured=unmeasured, lag_resolution_s=SAMPLE_INTERVAL,
        mb_s=totals["bytes"] / mirror_seconds / 1e6, mirrored_bytes=totals["bytes"], mirror_seconds=mirror_seconds,
        caught_up=monitor.caught_up_at is not None,
        catch_up_after_load_s=None if monitor.caught_up_at is None else monitor.caught_up_at - origin - args.duration,
        acked=acked, source_batches=sum(len(v) for v in verification["source"].values()),
        foreign=totals["foreign"], in_order=all(p["in_order"] for p in per_partition.values()),
        segments={t: s for t, s in sorted(segments.items())},
        killed=bool(kills), kill=kills[0] if kills else None, kill_planned_second=kill_at - origin,
        consumer=consumer_report, lag_series=series, per_partition=per_partition, targets=TARGETS,
        workers_final={r["worker_id"]: dict(r["final"]["final"] if r["final"] else {}, incarnations=r["incarnations"])
                       for r in results if r["role"] == "mirror"},
        events=[e for r in results if r["role"] == "mirror" and r["final"] for e in r["final"]["events"]][-200:],
        placement={f"{r['role']}-{r.get('node_id', r.get('worker_id'))}": r["executor"] for r in results},
        errors=([e for r in results for e in r["errors"]] + monitor.errors + consumer.errors)[:40],
    )


def plot(report: dict, out: str) -> list[str]:
    plt = pyplot("spark_bench mirror")
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(10, 5))
    s = report["lag_series"]
    for key, style in (("p50", "-"), ("p99", "--"), ("max", ":")):
        ax.plot([p["second"] for p in s], [p[key] for p in s], style, label=f"lag {key}")
    if report["kill"]:
        ax.axvline(report["kill"]["second"], color="r", label=f"worker {report['kill']['worker_id']} SIGKILLed")
    if report["consumer"]["failover_second"] is not None:
        ax.axvline(report["consumer"]["failover_second"], color="k", linestyle="--", label="consumer fails over")
    ax.set_xlabel("seconds (by source acknowledgement)")
    ax.set_ylabel("append on source -> readable on target, s")
    ax.set_title(f"Mirror: {report['partitions']} partitions at {report['rate_mb_s']:g} MB/s, "
                 f"{report['workers']} workers; lag p50 {_s(report['lag_p50_s'])}, p99 {_s(report['lag_p99_s'])}")
    ax.legend(loc="upper right", fontsize=8)
    return [save_figure(plt, fig, out, "lag.png")]


def _s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f} s"


def format_report(r: dict) -> str:
    c, k = r["consumer"], r["kill"]
    lines = [
        "=" * 100,
        f"Mirror under load on {r['master']}: {r['partitions']} partitions, {r['rate_mb_s']:g} MB/s for "
        f"{r['duration']:g} s, {r['source_nodes']} source nodes, {r['workers']} mirror workers",
        f"records mirrored: {r['records']} of {r['source_batches']} source batches ({r['acked']} acknowledged); "
        f"{r['mb_s']:.2f} MB/s over {r['mirror_seconds']:.1f} s; caught up {_s(r['catch_up_after_load_s'])} after "
        f"the load; in order: {r['in_order']}",
        f"lost: {r['lost']} ({verdict(r['lost'] == 0)}), duplicates: {r['duplicates']} "
        f"({verdict(r['duplicates'] == 0)}), translation_errors: {r['translation_errors']} "
        f"({verdict(r['translation_errors'] == 0)})",
        f"lag (source ack -> committed on target, +-{r['lag_resolution_s']} s): p50 {_s(r['lag_p50_s'])}, p99 "
        f"{_s(r['lag_p99_s'])}, max {_s(r['lag_max_s'])} over {r['lag_samples']} batches",
        (f"kill: worker {k['worker_id']} (pid {k['pid']}) SIGKILLed at {k['second']:.1f} s, replaced by pid "
         f"{k['replacement_pid']}, flows running again after {_s(k['recovered_s'])}, WAL records replayed: "
         f"{k['replayed']}") if k else "kill: DID NOT HAPPEN",
        f"consumer: {c['read_on_source']} batches on the source, failed over at {_s(c['failover_second'])} "
        f"(checkpoint by {c['checkpoint_synced_by']}, waited {_s(c['checkpoint_wait_s'])}), {c['read_on_target']} on "
        f"the target; skipped {c['skipped']}, read twice {c['read_twice']}",
    ]
    if r["errors"]:
        lines.append(f"errors: {r['errors'][:5]}")
    return "\n".join(lines)

if __name__ == "__main__":
    child_main(sys.argv[1])
