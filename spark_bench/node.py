"""One node of a load test: the body of a Spark task (or of any process).

The node opens its own WAL, joins the cluster (shared object store and metadata), runs a
NodeAgent (it opens the partitions assigned to it and closes those moved away) and one producer
per partition of the test, which appends while the partition is open here and idles while it is
elsewhere. It stops after `duration` seconds or when the driver sets the KV key
`bench/<run_id>/stop`.
It returns its measurements: bytes, latencies, a per-second timeline (bytes acknowledged in
each 1-second interval since the node started, by the time each append completed) and the same
in 100 ms intervals (`timeline_100ms`, for windows that do not fall on whole seconds), (if asked)
every acknowledgement as (partition, base offset, node, sequence number, digest), so the driver
can read each back and compare it with `common.payload_for`, and where it ran (host, pids, WAL path).

Optional: `start_together` (the number of nodes in the job) holds the producers until every
node's partitions are open, so that the nodes' timelines start together. `retention` (bytes
per partition) trims each partition to its last `retention` bytes of committed records every
0.2 s, and the node deletes what it trimmed within a second (the throughput job's default on
its RAM-disk store, whose footprint would otherwise grow with the run). For the balancer's
load test: `rates` ({partition: bytes/s}) paces each producer instead of letting it run flat
out, `rates_after` and `change_at` (seconds after `origin`) change the rates mid-run;
`origin` (unix seconds, the driver's) aligns every node's timeline on one clock; `balancer`
(BalancerConfig keywords) runs a balancer candidate on the node, from `balancer_start` seconds
after `origin` (the nodes elect one leader through the lease).

Its WAL goes in `spec["wal_dir"]` when given (local mode: the driver's work dir), else in a new
directory under `spec["node_dir"]` (default: the temp dir) on the host it runs on, removed
after a clean close (kept, and named in the result, when a stream's tail stayed in it).
"""
from __future__ import annotations

import collections
import os
import shutil
import socket
import tempfile
import threading
import time
from s3stream.cluster import partition_on

KiB, MiB = 1024, 1024 * 1024
#: A paced producer sleeps only when it is more than this ahead of its schedule, and then sends
#: every batch due within it at once (as a client's linger does): one wake-up per tick instead
#: of one per batch. At 64 KiB batches and 130 MB/s a node's producers woke about 2,000 times a
#: second, each a timed sleep and a GIL hand-over beside the engine's threads.
PACE_TICK_NS = 5_000_000


def _executor_pid() -> int | None:
    """The pid of the JVM that started this Python worker (its nearest `java` ancestor), or None
    where /proc does not say (not Linux, or not under a JVM)."""
    pid = os.getppid()
    for _ in range(4):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            return None
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its closing parenthesis
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        if comm == "java":
            return pid
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
        if pid <= 1:
            return None
    return None


def where_am_i() -> dict:
    """This process's host and pids, and its working directory (a Spark executor's own)."""
    return dict(host=socket.gethostname(), pid=os.getpid(), executor_pid=_executor_pid(), cwd=os.getcwd())


def run_nodes_of_partition(specs) -> list[dict]:
    """The body of a Spark task: run the node(s) of its partition (one, in practice)."""
    return [run_node(spec) for spec in specs]


#: How long a node waits for its partitions to open and for the other nodes at the start.
START_TIMEOUT = 60.0


def _start_together(client, meta, keys: str, node_id: int, partitions: list[str], nodes: int,
                    errors: list[str]) -> None:
    """Wait until this node's partitions are open, say so (KV `<keys>/ready/<node>`), then
    until all `nodes` nodes have: their producers start within a poll of each other, so each
    node's first seconds are measured with the others running too (Spark starts tasks a few
    hundred ms apart, and a node alone on the machine would read faster at first). Bounded by
    START_TIMEOUT; past it the node starts anyway and says so in its errors."""
    deadline = time.monotonic() + START_TIMEOUT
    while not all((p := partition_on(client, n)) is not None and p.is_open for n in partitions):
        if time.monotonic() > deadline:
            errors.append(f"node {node_id}: its partitions were not all open after {START_TIMEOUT:g} s; started anyway")
            break
        time.sleep(0.005)
    meta.put_kv(f"{keys}/ready/{node_id}", b"1")
    while len(meta.list_kv(f"{keys}/ready/")) < nodes:
        if time.monotonic() > deadline:
            errors.append(f"node {node_id}: not all {nodes} nodes were ready after {START_TIMEOUT:g} s; started anyway")
            break
        time.sleep(0.005)


def run_node(spec: dict) -> dict:
    """Run one node as described by `spec` (see spark_bench.common.node_spec); returns its stats."""
    import s3stream
    import wal
    from benchmarks.engine import completion_ns
    from s3stream.cluster import Cluster, ClusterConfig, NodeAgent
    from s3stream.metadata import open_metadata
    from s3stream.objectstore import open_object_store
    from s3stream.cluster import PartitionMovedError

    from .common import frozen_heap, payload_for, serve_task_metrics, stop_task_metrics

    node_id = spec["node_id"]
    retention = spec.get("retention")
    # With retention, what the node trims leaves the store within a second (nothing reads it
    # meanwhile: the job's readers, if any, come after the run), so the store's footprint stays
    # near retention x partitions instead of growing with the run.
    reclaim = dict(reclaim_interval=0.25, destroy_delay=0.5) if retention else {}
    cfg = s3stream.Config(upload_threshold=spec["upload_threshold"], split_size=min(spec["split_size"], spec["upload_threshold"]),
                          cache_size=max(4 * spec["upload_threshold"], 256 * MiB), max_batch_bytes=max(spec["batch"], 1 * MiB),
                          stream_tail_limit=spec.get("stream_tail_limit"),
                          # the Config's visibility deadline unless the spec names one (None: never)
                          **({"upload_interval": spec["upload_interval"]} if "upload_interval" in spec else {}),
                          wal=wal.WALConfig(capacity=spec["wal_capacity"], full_timeout=60), **reclaim)
    ccfg = ClusterConfig(**spec["cluster"])
    own_dir = spec.get("wal_dir") is None
    wal_dir = (tempfile.mkdtemp(prefix=f"s3stream-node{node_id}-", dir=spec.get("node_dir")) if own_dir
               else spec["wal_dir"])
    wal_path = os.path.join(wal_dir, f"node{node_id}.wal")
    client = s3stream.StreamClient(node_id, wal_path, spec["store_url"], spec["meta_url"], cfg,
                                   metrics=bool(spec.get("metrics_port")))
    metrics_server = serve_task_metrics(spec)
    meta = open_metadata(spec["meta_url"])
    store = open_object_store(spec["store_url"])
    agent = NodeAgent(client, Cluster(meta, store, ccfg, cfg))
    errors: list[str] = []
    keys = f"bench/{spec.get('run_id', 'bench')}"
    if spec.get("start_together"):
        _start_together(client, meta, keys, node_id, spec["partitions"], spec["start_together"], errors)
    else:
        meta.put_kv(f"{keys}/ready/{node_id}", b"1")
    stop = threading.Event()
    lock = threading.Lock()
    latencies: list[int] = []
    acks: list[tuple[str, int, str]] = []
    timeline: collections.Counter = collections.Counter()
    ticks: collections.Counter = collections.Counter()      # the same per 100 ms
    sent = [0]
    start_ns = time.monotonic_ns()
    start = start_ns / 1e9                  # the same clock as time.monotonic()
    # The timeline's second 0: the driver's origin when given (every node on one clock), else now.
    origin_ns = start_ns - (time.time_ns() - int(spec["origin"] * 1e9)) if "origin" in spec else start_ns
    keep_acks = spec.get("keep_acks", False)
    inflight_max = spec.get("inflight", 32)
    rates, rates_after = spec.get("rates"), spec.get("rates_after") or spec.get("rates")
    change_at_ns = origin_ns + int(spec.get("change_at", 1e9) * 1e9)

    def pace(name: str, next_ns: int) -> int:
        """Wait until this partition's next send is due at its rate, or less than PACE_TICK_NS
        ahead of it; the next due time."""
        rate = (rates_after if time.monotonic_ns() >= change_at_ns else rates)[name]
        now = time.monotonic_ns()
        if next_ns > now + PACE_TICK_NS:
            stop.wait((next_ns - now) / 1e9)
            now = next_ns
        # Never more than 100 ms of backlog: a partition that was elsewhere does not burst here.
        return max(next_ns, now - 100_000_000) + int(spec["batch"] / rate * 1e9)

    def produce(name: str) -> None:
        seq = 0
        window: collections.deque = collections.deque()
        next_ns = time.monotonic_ns()
        while not stop.is_set():
            p = partition_on(client, name)
            if p is None or not p.is_open:
                while window:                       # settle what was sent before it moved
                    _settle(window.popleft())
                time.sleep(0.005)
                next_ns = time.monotonic_ns()
                continue
            if rates is not None:
                next_ns = pace(name, next_ns)
                if stop.is_set():
                    break
            data = payload_for(name, node_id, seq, spec["batch"])
            t0 = time.monotonic_ns()
            try:
                fut = p.append(s3stream.RecordBatch(data, 1))
            except (PartitionMovedError, s3stream.StreamClosedError, s3stream.StreamFencedError):
                continue
            except s3stream.S3StreamError as e:
                errors.append(repr(e))
                time.sleep(0.01)
                continue
            window.append((fut, t0, data, name, seq))
            seq += 1
            if len(window) >= inflight_max:
                _settle(window.popleft())
        while window:
            _settle(window.popleft())

    def _settle(item) -> None:
        fut, t0, data, name, seq = item
        try:
            base = fut.result(60).base_offset
        except Exception:     # noqa: BLE001 - not acknowledged: the producer would retry it
            return
        done = time.monotonic_ns()
        # the interval the acknowledgement fell in: its own time when the handle carries it (the
        # producer may settle it later), else now
        acked = completion_ns(fut) or done
        with lock:
            latencies.append(done - t0)
            sent[0] += len(data)
            timeline[(acked - origin_ns) // 1_000_000_000] += len(data)
            ticks[(acked - origin_ns) // 100_000_000] += len(data)
            if keep_acks:
                # No digest: the verifier regenerates the payload from (name, node, seq) and
                # compares it byte for byte (hashing every acknowledged byte here took ~7% of
                # the box's CPU beside the nodes at half load, perf).
                acks.append((name, base, node_id, seq))

    trimmed = [0]

    def retain() -> None:
        """Size-based retention (Kafka's retention.bytes): trim each partition open here to
        its last `retention` bytes of committed records (one record per offset)."""
        keep = max(1, retention // spec["batch"])
        for name in spec["partitions"]:
            p = partition_on(client, name)
            if p is None or not p.is_open:
                continue
            log = p.log
            target = log.committed_offset - keep
            if target <= log.start_offset:
                continue
            try:
                log.trim(target)
            except (s3stream.StreamClosedError, s3stream.StreamFencedError):
                continue                    # it moved away meanwhile; its new owner trims it
            except s3stream.S3StreamError as e:
                errors.append(repr(e))
                continue
            trimmed[0] += 1

    # The setup's objects out of the cyclic GC's full walks while the load runs (frozen_heap).
    with frozen_heap():
        threads = [threading.Thread(target=produce, args=(n,), daemon=True) for n in spec["partitions"]]
        for t in threads:
            t.start()
        balancer = None
        balancer_at = origin_ns + int(spec.get("balancer_start", 0) * 1e9)
        deadline = start + spec["duration"]
        next_trim = start
        while time.monotonic() < deadline:
            if meta.get_kv(f"{keys}/stop") is not None or agent.fenced:
                break
            if retention and time.monotonic() >= next_trim:
                retain()
                next_trim = time.monotonic() + 0.2
            if balancer is None and spec.get("balancer") is not None and time.monotonic_ns() >= balancer_at:
                from s3stream.balancer import BalancerConfig
                from s3stream.balancer.loop import Balancer
                balancer = Balancer(Cluster(meta, store, ccfg, cfg), node_id, BalancerConfig(**spec["balancer"])).start()
            time.sleep(0.05)
        if balancer is not None:
            balancer.stop()
        stop.set()
        for t in threads:
            t.join()
    elapsed = time.monotonic() - start
    stats = client.stats()
    agent.stop()
    closed = client.close(retire=True)
    stop_task_metrics(metrics_server)
    if closed["left_in_wal"]:
        errors.append(f"node {node_id}: streams {closed['left_in_wal']} were not uploaded at close; their tail "
                      f"stays in {wal_path} on {socket.gethostname()}")
    elif own_dir and not spec.get("keep_wal"):
        shutil.rmtree(wal_dir, ignore_errors=True)
    meta.close()
    store.close()
    return dict(node_id=node_id, bytes=sent[0], seconds=elapsed, latencies=latencies, acks=acks,
                timeline=sorted(timeline.items()), timeline_100ms=sorted(ticks.items()), errors=errors + list(agent.errors)[:20],
                upload=stats["upload"], wal=stats["wal"], wal_path=wal_path, executor=where_am_i(), trims=trimmed[0],
                balancer=None if balancer is None else dict(history=list(balancer.history), rounds=balancer.rounds,
                                                            moves=balancer.moves, errors=list(balancer.errors)))
