"""Prometheus metrics of StreamClients, read at scrape time (docs/metrics.md lists every metric).

    client = StreamClient(..., metrics=True)          # or metrics=registry; wrappers installed
    s3stream.metrics.serve(9108)                      # /metrics on :9108 (or your own exporter)

or, for a client built without `metrics=`, `handle = s3stream.metrics.instrument(client, registry)`
(then only what the engine counts anyway is exported: no object store or metadata latencies,
unless its stores were InstrumentedObjectStore / InstrumentedMetadataStore already);
`handle.unregister()` removes it (client.close() does so for `metrics=`).

Nothing runs per append. The engine's counters (appends, bytes, WAL batches, uploads, cache
reads) already exist in `StreamClient.stats()`; one collector per registry reads every
registered client's stats when it is scraped and yields them with a `node` label, so two
clients (two nodes) in one process share a registry without duplicate series. Latency
histograms come from:
- object store PUT/GET/DELETE and every metadata operation: the Instrumented* wrappers the client
  installs with `metrics=` (a microsecond per call, against milliseconds of I/O);
- fetches: the reader times each Stream.fetch (fetch_cached, the inline tail read, is not timed);
- appends, sampled: the native append path keeps the submission time and WAL end of one append
  in 64 (every stream; a counter test per append) and the WAL logs when its durable end moved;
  a scrape observes the samples durable since the previous one (`StreamClient.append_latencies`);
- WAL writes and their fdatasync: the WAL's writer threads time both and count them in fixed
  buckets, once per group of batches written together (one fdatasync), without the GIL;
- migrations, failovers (process-wide) and compaction rounds (per node, when compaction is attached).
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .latency import LatencyHistogram
from .metadata import MetadataStore
from .engine.uploadpolicy import TRIGGERS
from .metadata.wrappers import InstrumentedMetadataStore
from .objectstore import ObjectStore
from .objectstore.wrappers import InstrumentedObjectStore
from .engine.upload import RETRY_STEPS

if TYPE_CHECKING:
    from .client import StreamClient

log = logging.getLogger("s3stream.metrics")

PREFIX = "s3stream_"


def instrumented_stores(store: ObjectStore, meta: MetadataStore) -> tuple[ObjectStore, MetadataStore]:
    """`store` and `meta` wrapped to time their calls (unless they are already)."""
    if not isinstance(store, InstrumentedObjectStore):
        store = InstrumentedObjectStore(store)
    if not isinstance(meta, InstrumentedMetadataStore):
        meta = InstrumentedMetadataStore(meta)
    return store, meta


def instrument(client: "StreamClient", registry: CollectorRegistry | None = None) -> "ClientMetrics":
    """Export `client`'s metrics on `registry` (default: prometheus_client.REGISTRY), labelled
    node=<its node id>. ValueError if a client of that node is registered there already."""
    registry = REGISTRY if registry is None else registry
    handle = ClientMetrics(client, registry)
    _collector_for(registry).add(handle)
    return handle


def serve(port: int, registry: CollectorRegistry | None = None, addr: str = "0.0.0.0"):
    """Serve `registry` (default: prometheus_client.REGISTRY) on http://addr:port/metrics in a
    daemon thread, with the process-wide metrics (migrations, failovers) on it even before a
    client registers. Returns prometheus_client's (server, thread); server.shutdown() stops it."""
    registry = REGISTRY if registry is None else registry
    _collector_for(registry)
    return start_http_server(port, addr=addr, registry=registry)


class ClientMetrics:
    """One client's registration on one registry (see `instrument`)."""

    def __init__(self, client: "StreamClient", registry: CollectorRegistry) -> None:
        self.client = client
        self.registry = registry
        self.node = str(client.node_id)
        self._lock = threading.Lock()
        self.append_latency = LatencyHistogram()

    def unregister(self) -> None:
        """Stop exporting this client (idempotent)."""
        collector = _collectors.get(self.registry)
        if collector is not None:
            collector.remove(self)

    # ---- scrape ------------------------------------------------------------------------------

    def collect_into(self, families: "Families") -> None:
        client = self.client
        with self._lock:
            for seconds in client.append_latencies():
                self.append_latency.observe(seconds)
        stats = client.stats()
        node = self.node
        f = families
        f.gauge("node_epoch", "Epoch of the node (bumped at each start)", node, stats["node_epoch"])
        f.gauge("open_streams", "Streams open on the node", node, stats["open_streams"])
        f.gauge("uncommitted_bytes", "Bytes appended but not yet committed to objects (admission counts these)",
                node, stats["uncommitted_bytes"])
        append = stats["append"]
        f.counter("appends", "Appends accepted (one per RecordBatch)", node, append["appends"])
        f.counter("append_bytes", "Payload bytes of accepted appends", node, append["bytes"])
        f.counter("append_lock_waits", "Appends that found the append lock taken", node, append["lock_waits"])
        f.counter("append_admission_waits", "Appends that waited for cache_size to free (uploads behind)", node,
                  append["admission_waits"])
        f.counter("append_admission_wait_seconds", "Seconds appends waited for cache_size to free", node,
                  append["admission_wait_seconds"])
        f.counter("append_tail_waits", "Appends that waited for their stream's un-uploaded tail to fall below "
                  "stream_tail_limit (uploads behind that stream)", node, append["tail_waits"])
        f.counter("append_tail_wait_seconds", "Seconds appends waited for their stream's tail", node,
                  append["tail_wait_seconds"])
        f.histogram("append_latency_seconds", "Append latency, submission to durable in the WAL, of one append "
                    "in 64 (sampled; _count counts samples, not appends)", node, self.append_latency.snapshot())
        w = stats["wal"]
        if "records" in w:
            f.counter("wal_records", "Records written to the WAL", node, w["records"])
            f.counter("wal_record_bytes", "Bytes of WAL records (headers included)", node, w["record_bytes"])
            f.counter("wal_batches", "WAL batch writes (one pwrite each; an fdatasync covers a group)", node,
                      w["batches"])
            f.counter("wal_syncs", "WAL fdatasyncs (one per group of batches written together)", node, w["syncs"])
            f.counter("wal_written_bytes", "Bytes written to the WAL device (aligned batches)", node, w["bytes_written"])
            f.counter("wal_full_waits", "Appends that waited for WAL space", node, w["full_waits"])
            f.counter("wal_buffer_waits", "Appends that waited for a free WAL batch buffer", node, w["buffer_waits"])
            f.counter("wal_wait_seconds", "Seconds appends waited for WAL space or a batch buffer", node,
                      w["wait_seconds"])
        if w.get("kind") == "objects":
            f.counter("wal_puts", "WAL objects written (one PUT each; wal_write_seconds times them)", node, w["puts"])
            f.counter("wal_put_bytes", "Bytes of WAL objects written (object headers included)", node, w["put_bytes"])
            f.counter("wal_put_retries", "WAL PUTs the store failed, retried", node, w["put_retries"])
            f.counter("wal_fences", "WAL fence and hole objects written (one per open or gap)", node, w["fences"])
            f.counter("wal_deletes", "WAL objects deleted below the trim", node, w["deletes"])
            f.counter("wal_delete_requests", "WAL delete requests (up to 1000 objects each)", node,
                      w["delete_requests"])
        if "used_bytes" in w:
            f.gauge("wal_used_bytes", "WAL bytes from the trim offset to the last record placed", node, w["used_bytes"])
            f.gauge("wal_capacity_bytes", "WAL data area size", node, w["capacity"])
        if "write_latency" in w:
            f.histogram("wal_write_seconds", "WAL batch writes (pwrite), as timed by the WAL's writer", node,
                        w["write_latency"])
            f.histogram("wal_fsync_seconds", "WAL fdatasync after each batch write, as timed by the WAL's writer",
                        node, w["fsync_latency"])
        cache = stats["cache"]
        f.gauge("log_cache_bytes", "Bytes in the log cache (active and sealed blocks)", node, cache["bytes"])
        f.gauge("upload_queue_blocks", "Sealed log cache blocks waiting for upload or commit", node,
                cache["sealed_blocks"])
        f.gauge("visibility_lag_seconds", "Age of the oldest acknowledged record not yet committed to objects "
                "(what readers that are not nodes wait for; near upload_interval while uploads keep up)", node,
                stats.get("visibility_lag_s", 0.0))
        up = stats["upload"]
        f.counter("upload_blocks", "Log cache blocks uploaded and committed", node, up["blocks"])
        f.counter("upload_objects", "Objects uploaded, by type", node, up["stream_set_objects"], type="stream_set")
        f.counter("upload_objects", "Objects uploaded, by type", node, up["stream_objects"], type="stream")
        f.counter("upload_bytes", "Bytes of objects uploaded", node, up["bytes"])
        for trigger in TRIGGERS:
            f.counter("upload_objects_by_trigger", "Objects uploaded, by why their block was sealed "
                      "(s3stream.engine.uploadpolicy)", node, up.get("triggers", {}).get(trigger, {}).get("objects", 0),
                      trigger=trigger)
        for step in RETRY_STEPS:
            f.counter("upload_retries", "Upload steps that failed and were retried, by step", node,
                      up.get(f"{step}_retries", 0), step=step)
        f.counter("upload_unexpected_retries", "Upload steps retried after an error of no known kind (a bug's "
                  "BufferError, RuntimeError...; also counted by step)", node, up.get("unexpected_retries", 0))
        f.counter("upload_retry_episodes", "Episodes of upload failures: from a first failure until every failing "
                  "step recovered", node, up.get("retry_episodes", 0))
        f.gauge("upload_retrying_steps", "Upload steps failing now and being retried (0: uploads are not failing)",
                node, up.get("retrying", 0))
        f.counter("upload_expired_reuploads", "Blocks uploaded again under new ids: their object ids expired "
                  "(prepared_ttl) while their steps were failing", node, up.get("expired_reuploads", 0))
        f.counter("upload_encode_buffers_replaced", "Encode buffers replaced because a view of them outlived "
                  "their object", node, up.get("encode_buffers_replaced", 0))
        read = stats["read"]
        f.counter("log_cache_hits", "Reads (fetch chunks) served by the log cache", node, read["cache_reads"])
        f.counter("block_cache_hits", "Object blocks a fetch found in the block cache (or in flight)", node,
                  read["block_hits"] + read["block_waits"])
        f.counter("block_cache_misses", "Object blocks a fetch had to GET", node, read["block_fetches"])
        f.counter("object_reads", "Object range reads (GETs of data) by the reader", node, read["object_reads"])
        f.counter("object_read_bytes", "Bytes of object range reads by the reader", node, read["object_bytes"])
        f.counter("readahead_bytes", "Bytes read ahead", node, read["readahead_bytes"])
        f.gauge("block_cache_bytes", "Bytes in the block cache", node, read["block_cache_bytes"])
        f.gauge("read_inflight_bytes", "Bytes of object reads in flight", node, read["inflight_bytes"])
        f.histogram("fetch_latency_seconds", "Stream.fetch latency (log cache or objects)", node, read["fetch_latency"])
        store = client.object_store
        if isinstance(store, InstrumentedObjectStore):
            counts = store.stats()
            for op in ("put", "get", "delete", "list", "size"):
                f.counter("object_store_calls", "Object store calls, by operation", node, counts[op], operation=op)
            f.counter("object_store_requests", "S3 requests of puts (multipart parts counted) and gets", node,
                      counts["put_requests"], operation="put")
            f.counter("object_store_requests", "S3 requests of puts (multipart parts counted) and gets", node,
                      counts["get_requests"], operation="get")
            f.counter("object_store_written_bytes", "Bytes put to the object store", node, counts["bytes_written"])
            f.counter("object_store_read_bytes", "Bytes got from the object store", node, counts["bytes_read"])
            f.counter("object_store_deleted_keys", "Keys deleted from the object store", node, counts["deleted_keys"])
            f.counter("object_store_errors", "Object store calls that raised", node, counts["errors"])
            for op, n in store.inflight().items():
                f.gauge("object_store_inflight", "Object store calls in progress (put: uploads in flight)", node, n,
                        operation=op)
            for op, snap in store.latencies().items():
                f.histogram("object_store_latency_seconds", "Object store call latency, by operation", node, snap,
                            operation=op)
        meta = client.metadata
        if isinstance(meta, InstrumentedMetadataStore):
            errors = meta.errors()
            for op, snap in meta.latencies().items():
                f.histogram("metadata_latency_seconds", "Metadata store operation latency (prepare_objects, "
                            "commit, open_stream...)", node, snap, operation=op)
                f.counter("metadata_errors", "Metadata operations that raised, by operation", node,
                          errors.get(op, 0), operation=op)
        compaction = stats.get("compaction")
        if isinstance(compaction, dict):
            _compaction_metrics(f, node, compaction)


def _compaction_metrics(f: "Families", node: str, c: dict) -> None:
    """The compaction add-on's stats source (compaction.runner.attach), read as data: s3stream
    does not import compaction."""
    totals = c.get("totals", {})
    f.counter("compaction_rounds", "Compaction rounds run", node, c.get("rounds", 0))
    f.counter("compaction_errors", "Compaction rounds that failed", node, c.get("errors", 0))
    f.counter("compaction_read_bytes", "Bytes compaction read", node, totals.get("bytes_read", 0))
    f.counter("compaction_written_bytes", "Bytes compaction wrote", node, totals.get("bytes_written", 0))
    for kind, snap in (c.get("round_seconds") or {}).items():
        f.histogram("compaction_round_seconds", "Compaction round duration, by kind", node, snap, kind=kind)
    objects = c.get("objects") or {}
    for kind, name in (("stream_set_objects", "stream_set"), ("stream_objects", "stream"),
                       ("mark_destroyed", "mark_destroyed"), ("prepared", "prepared")):
        if kind in objects:
            f.gauge("objects", "Objects in metadata, by type or state (cluster-wide, read by compaction)", node,
                    objects[kind]["count"], type=name)
            f.gauge("object_bytes", "Bytes of objects in metadata, by type or state", node,
                    objects[kind]["bytes"], type=name)


_Family = TypeVar("_Family", CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily)


class Families:
    """Metric families of one scrape, by name; samples added in any order (what a process
    source given to `add_process_source` fills)."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def _family(self, kind: type[_Family], name: str, doc: str, labels: Iterable[str]) -> _Family:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = kind(PREFIX + name, doc, labels=list(labels))
        elif not isinstance(family, kind):
            raise TypeError(f"metric family {name} is a {type(family).__name__}, not a {kind.__name__}")
        return family

    def counter(self, name: str, doc: str, node: str, value: float, **labels: str) -> None:
        self._family(CounterMetricFamily, name, doc, ["node", *labels]).add_metric([node, *labels.values()], value)

    def gauge(self, name: str, doc: str, node: str, value: float, **labels: str) -> None:
        self._family(GaugeMetricFamily, name, doc, ["node", *labels]).add_metric([node, *labels.values()], value)

    def histogram(self, name: str, doc: str, node: str | None, snap: dict, **labels: str) -> None:
        names = ([] if node is None else ["node"]) + list(labels)
        values = ([] if node is None else [node]) + list(labels.values())
        self._family(HistogramMetricFamily, name, doc, names).add_metric(values, _buckets(snap), snap["sum"])

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


def _buckets(snap: dict) -> list[tuple[str, float]]:
    out = []
    running = 0
    for bound, n in zip(snap["bounds"], snap["counts"]):
        running += n
        out.append((repr(float(bound)), running))
    out.append(("+Inf", snap["count"]))
    return out


class _RegistryCollector(Collector):
    """The one collector of a registry: every registered client's metrics, and the process's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: list[ClientMetrics] = []

    def add(self, handle: ClientMetrics) -> None:
        with self._lock:
            for other in self._handles:
                if other.node == handle.node:
                    raise ValueError(f"a client of node {handle.node} is registered on this registry already; "
                                     "unregister it (or close it) first")
            self._handles.append(handle)

    def remove(self, handle: ClientMetrics) -> None:
        with self._lock:
            if handle in self._handles:
                self._handles.remove(handle)

    def describe(self) -> list[Metric]:
        # Names are not declared: this is the only s3stream collector on a registry, and an
        # empty describe() keeps registration from running a whole collect().
        return []

    def collect(self) -> Iterator[Metric]:
        families = Families()
        with self._lock:
            handles = list(self._handles)
        for handle in handles:
            try:
                handle.collect_into(families)
            except Exception:                    # noqa: BLE001 - one closing client must not fail the scrape
                log.warning("metrics of node %s could not be read", handle.node, exc_info=True)
        for source in list(_process_sources):
            try:
                source(families)
            except Exception:                    # noqa: BLE001 - one source must not fail the scrape
                log.warning("process metrics source %r failed", source, exc_info=True)
        yield from families


#: Sources of process-wide metrics, filled at every scrape of every registry: how a layer above
#: the engine (the cluster layer: migrations, failovers, its agents) exports through the same
#: collector without the engine importing it.
_process_sources: list[Callable[[Families], None]] = []


def add_process_source(source: Callable[[Families], None]) -> None:
    """Have `source(families)` add its samples to every scrape (once per source)."""
    if source not in _process_sources:
        _process_sources.append(source)


_collectors: "weakref.WeakKeyDictionary[CollectorRegistry, _RegistryCollector]" = weakref.WeakKeyDictionary()
_collectors_lock = threading.Lock()


def _collector_for(registry: CollectorRegistry) -> _RegistryCollector:
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = _collectors[registry] = _RegistryCollector()
            registry.register(collector)
        return collector


__all__ = ["ClientMetrics", "Families", "add_process_source", "instrument", "instrumented_stores", "serve"]
