"""Node load reports: what each node tells the balancer about its partitions' traffic.

Every partition counts the bytes appended to it and fetched from it (`TrafficMeter`: a few
integer adds per call) and samples the latency of one append and one fetch in SAMPLE_EVERY.
Each node's agent publishes, every `ClusterConfig.report_interval`, one report under the KV key
`balancer/metrics/<node id>`:

    {"node": 3, "at": unix seconds, "window_s": 10.0,
     "partitions": {"orders": {"bytes_in": B/s, "bytes_out": B/s}, ...}, "idle": n,
     "append_p99_ms": x, "fetch_p99_ms": y}

rates being averages over the last `window_s` seconds, or since the partition opened on this
node if that is later (a moved partition's rate is its rate here, not diluted by the time it was
elsewhere). A partition with no traffic in the window is not listed, only counted (`idle`): the
balancer gives a partition no report names zero load, and a node with 10,000 idle partitions
writes a report of a few bytes.

Why KV and not an internal stream, as article 001 does with a Kafka topic: a report matters only
until the next one, so the balancer needs the newest report of each node, now, from any host. In
KV that is one row per node, overwritten, read with one range scan and bounded by the cluster's
size. In a stream it would become readable to other hosts only once its node uploads (seconds
later, by design), would grow until trimmed, and every read would cost object GETs. The article
uses a topic because Kafka has no small shared store; we have one.
"""
from __future__ import annotations

import collections
import json
import time
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from ..metadata import MetadataStore
    from .partition import Partition

#: KV prefix of the nodes' load reports.
REPORT_PREFIX = "balancer/metrics/"
#: One append (and one fetch) in this many has its latency measured.
SAMPLE_EVERY = 64
#: Latency samples a meter keeps (the newest).
SAMPLES_KEPT = 256


class TrafficMeter:
    """Traffic through one partition on this node. Updated by the threads that append and fetch
    (integer adds under the GIL), read by the node's reporter."""

    __slots__ = ("bytes_in", "bytes_out", "appends", "fetches", "append_samples", "fetch_ms", "opened")

    def __init__(self) -> None:
        self.bytes_in = 0
        self.bytes_out = 0
        self.appends = 0
        self.fetches = 0
        # (monotonic ns at submission, the append's future): its latency is read once it is done,
        # from the completion time the engine records, so no callback runs on the engine's thread.
        self.append_samples: collections.deque = collections.deque(maxlen=SAMPLES_KEPT)
        self.fetch_ms: collections.deque = collections.deque(maxlen=SAMPLES_KEPT)
        self.opened = time.monotonic()

    def append_latencies_ms(self) -> list[float]:
        out = []
        for submitted, future in list(self.append_samples):
            done = future.completed_ns
            if done is not None:
                out.append((done - submitted) / 1e6)
        return out


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


class LoadReporter:
    """Builds a node's report from its open partitions' meters. Rates are taken over the last
    `window_s` seconds: the reporter keeps, per partition, the counters it saw at each report."""

    def __init__(self, node_id: int, window_s: float = 10.0) -> None:
        self.node_id = node_id
        self.window_s = window_s
        self._seen: dict[str, collections.deque] = {}    # name -> deque of (t, bytes_in, bytes_out)

    def report(self, partitions: Iterable["Partition"], now: float | None = None) -> dict:
        t = time.monotonic()
        out: dict[str, dict] = {}
        appends: list[float] = []
        fetches: list[float] = []
        live = set()
        idle = 0
        for p in partitions:
            m = p.meter
            live.add(p.name)
            seen = self._seen.get(p.name)
            if seen is None or seen[0][0] < m.opened:
                # First sight, or reopened here since: count from its open.
                seen = self._seen[p.name] = collections.deque([(m.opened, 0, 0)])
            seen.append((t, m.bytes_in, m.bytes_out))
            while len(seen) > 2 and seen[1][0] <= t - self.window_s:
                seen.popleft()
            t0, in0, out0 = seen[0]
            if m.bytes_in == in0 and m.bytes_out == out0:
                idle += 1                  # no traffic in the window: counted, not listed
            else:
                span = max(t - t0, 1e-3)
                out[p.name] = {"bytes_in": (m.bytes_in - in0) / span, "bytes_out": (m.bytes_out - out0) / span}
            appends += m.append_latencies_ms()
            fetches += list(m.fetch_ms)
        for name in list(self._seen):
            if name not in live:
                del self._seen[name]
        return {"node": self.node_id, "at": time.time() if now is None else now, "window_s": self.window_s,
                "partitions": out, "idle": idle, "append_p99_ms": _p99(appends), "fetch_p99_ms": _p99(fetches)}

    def publish(self, meta: "MetadataStore", partitions: Iterable["Partition"]) -> dict:
        report = self.report(partitions)
        meta.put_kv(f"{REPORT_PREFIX}{self.node_id}", json.dumps(report, sort_keys=True).encode())
        return report


def read_reports(meta: "MetadataStore") -> list[dict]:
    """Every node's latest report (a report that does not parse is skipped: it is replaced within
    a report interval)."""
    out = []
    for raw in meta.list_kv(REPORT_PREFIX).values():
        try:
            report = json.loads(raw)
        except ValueError:
            continue
        if isinstance(report, dict):
            out.append(report)
    return out
