"""One node of a load test: the body of a Spark task (or of any process).

The node opens its own WAL, joins the cluster (shared object store and metadata), runs a
NodeAgent (it opens the partitions assigned to it and closes those moved away) and one producer
per partition of the test, which appends while the partition is open here and idles while it is
elsewhere. It stops after `duration` seconds or when the driver sets the KV key `bench/stop`.
It returns its measurements: bytes, latencies, a per-second timeline (bytes acknowledged in
each 1-second interval since the node started, by the time each append completed), and (if
asked) every acknowledgement, so the driver can check that nothing acknowledged was lost.
"""
from __future__ import annotations

import collections
import hashlib
import os
import threading
import time

KiB, MiB = 1024, 1024 * 1024


def payload_for(partition: str, node: int, seq: int, size: int) -> bytes:
    """Deterministic payload; its first 16 bytes name it, so the driver can check it byte for byte."""
    head = hashlib.blake2b(f"{partition}/{node}/{seq}".encode(), digest_size=16).digest()
    return (head * (size // 16 + 1))[:size]


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def run_node(spec: dict) -> dict:
    """Run one node as described by `spec` (see spark_bench.common.node_spec); returns its stats."""
    import s3stream
    import wal
    from s3stream.bench import completion_ns
    from s3stream.cluster import Cluster, ClusterConfig, NodeAgent
    from s3stream.metadata import open_metadata
    from s3stream.objectstore import open_object_store
    from s3stream.partition import PartitionMovedError

    node_id = spec["node_id"]
    cfg = s3stream.Config(upload_threshold=spec["upload_threshold"], split_size=min(spec["split_size"], spec["upload_threshold"]),
                          cache_size=max(4 * spec["upload_threshold"], 256 * MiB), max_batch_bytes=max(spec["batch"], 1 * MiB),
                          upload_interval=spec.get("upload_interval"),
                          wal=wal.WALConfig(capacity=spec["wal_capacity"], full_timeout=60))
    ccfg = ClusterConfig(**spec["cluster"])
    client = s3stream.StreamClient(node_id, os.path.join(spec["workdir"], f"node{node_id}.wal"),
                                   spec["store_url"], spec["meta_url"], cfg)
    meta = open_metadata(spec["meta_url"])
    store = open_object_store(spec["store_url"])
    agent = NodeAgent(client, Cluster(meta, store, ccfg, cfg))
    meta.put_kv(f"bench/ready/{node_id}", b"1")
    stop = threading.Event()
    lock = threading.Lock()
    latencies: list[int] = []
    acks: list[tuple[str, int, str]] = []
    timeline: collections.Counter = collections.Counter()
    sent = [0]
    errors: list[str] = []
    start_ns = time.monotonic_ns()
    start = start_ns / 1e9                  # the same clock as time.monotonic()
    keep_acks = spec.get("keep_acks", False)
    inflight_max = spec.get("inflight", 32)

    def produce(name: str) -> None:
        seq = 0
        window: collections.deque = collections.deque()
        while not stop.is_set():
            p = client._partitions.get(name)
            if p is None or not p.is_open:
                while window:                       # settle what was sent before it moved
                    _settle(window.popleft())
                time.sleep(0.005)
                continue
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
            window.append((fut, t0, data, name))
            seq += 1
            if len(window) >= inflight_max:
                _settle(window.popleft())
        while window:
            _settle(window.popleft())

    def _settle(item) -> None:
        fut, t0, data, name = item
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
            timeline[(acked - start_ns) // 1_000_000_000] += len(data)
            if keep_acks:
                acks.append((name, base, digest(data)))

    threads = [threading.Thread(target=produce, args=(n,), daemon=True) for n in spec["partitions"]]
    for t in threads:
        t.start()
    deadline = start + spec["duration"]
    while time.monotonic() < deadline:
        if meta.get_kv("bench/stop") is not None or agent.fenced:
            break
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    stats = client.stats()
    agent.stop()
    client.close()
    meta.close()
    store.close()
    return dict(node_id=node_id, bytes=sent[0], seconds=elapsed, latencies=latencies, acks=acks,
                timeline=sorted(timeline.items()), errors=errors + list(agent.errors)[:20],
                upload=stats["upload"], wal=stats["wal"])
