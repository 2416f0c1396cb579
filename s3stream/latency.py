"""LatencyHistogram: fixed-bucket latency counts, observed by the engine's wrappers and read at
scrape time by s3stream.metrics (which needs prometheus-client; this module needs nothing).

Why not prometheus_client.Histogram directly: those register themselves on one registry, while
a histogram here belongs to one store wrapper, reader or runner of one node, and the metrics
collector (one per registry) reads every registered node's histograms when it is scraped. A
snapshot is a plain dict, so it also shows in `StreamClient.stats()` and JSON reports.
"""
from __future__ import annotations

import bisect
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

#: Upper bounds (seconds) for operations from tens of microseconds to seconds: appends, WAL
#: writes, object PUTs and GETs, metadata transactions, fetches.
LATENCY_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                      0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Upper bounds (seconds) for whole procedures: migrations, failovers, compaction rounds.
DURATION_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                                       120.0, 300.0, 600.0)


class LatencyHistogram:
    """Counts of observations per bucket (`bounds` ascending, plus +Inf), their sum and count.
    `observe` is a bisect and three adds under a lock (about a microsecond): meant for calls that
    cost far more (I/O, transactions), never for a per-record path."""

    __slots__ = ("bounds", "_counts", "_sum", "_lock")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"histogram bounds must be strictly ascending, got {bounds!r}")
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        """Count one observation of `seconds` (in the first bucket whose bound is >= it)."""
        i = bisect.bisect_left(self.bounds, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    @contextmanager
    def time(self) -> Iterator[None]:
        """Observe the wall time of the `with` block (also when it raises)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.observe(time.perf_counter() - t0)

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def snapshot(self) -> dict:
        """{"bounds": upper bounds, "counts": per bucket (not cumulative; the last is +Inf),
        "sum": seconds, "count": observations}."""
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        return dict(bounds=list(self.bounds), counts=counts, sum=total, count=sum(counts))


__all__ = ["DURATION_BUCKETS", "LATENCY_BUCKETS", "LatencyHistogram"]
