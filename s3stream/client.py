"""StreamClient: one node's engine (WAL, log cache, uploader, reader) over shared storage.

Lifecycle of a node:
1. register in metadata (node epoch + 1: an older instance of this node is fenced);
2. open its WAL with that epoch and recover it: records above each stream's committed end are
   uploaded and committed again, then the streams this node held open are closed, ready to be
   reopened here or elsewhere;
3. serve create/open of streams; appends go to the WAL, then the log cache, then objects;
4. `close()` closes every open stream (force upload), then the WAL cleanly.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

import wal
from _native.appendpath import AppendPath

from .config import Config
from .errors import (
    AppendFailedError, ConfigError, InvalidBatchError, LeaseExpiredError, NodeConflictError,
    OperationTimeoutError, S3StreamError, StreamClosedError, StreamFencedError, StreamNotClosedError, StreamNotFoundError, WALCorruptError,
    WALError, WALFullError, check_int,
)
from .engine.lifecycle import ObjectReclaimer, ReclaimerThread
from .engine.logcache import CacheBlock, new_log_cache
from .metadata import CommitResult, MetadataStore, StreamMeta, open_metadata
from .objectstore import ObjectStore, open_object_store
from .engine.failover import fail_over
from .engine.readpath import Reader
from .reader import fetch_committed
from .batches import FetchedBatch, FetchResult
from .engine.recovery import close_node_streams, replay_wal
from .stream import Stream
from .engine.upload import UploadAborted, Uploader
from .engine.uploadpolicy import deadline_sleep, tail_must_cut
from .engine import walopen
from .engine.walopen import epoch_checker, open_node_wal, registered_location
from wal.objectlog import HostLock
from .threads import normal_priority

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("s3stream")

T = TypeVar("T")

def _check_store_args(object_store, metadata) -> None:
    """ConfigError for an object store or metadata argument that is neither a URL nor a store
    (a number, None, an empty string): refused before anything is written."""
    if isinstance(object_store, str):
        if not object_store.strip():
            raise ConfigError("object_store is an empty string (it would write into the working directory); use "
                              "file:///absolute/path or s3://bucket[/prefix]")
    elif not all(callable(getattr(object_store, m, None)) for m in ("put", "get", "size", "delete", "list")):
        raise ConfigError(f"object_store must be a URL string or an ObjectStore, got {object_store!r} "
                          f"({type(object_store).__name__}); e.g. 'file:///data/objects'")
    if isinstance(metadata, str):
        if not metadata.strip():
            raise ConfigError("metadata is an empty string; use sqlite:////absolute/path/meta.db")
    elif not all(callable(getattr(metadata, m, None)) for m in ("register_node", "open_stream", "get_object_refs")):
        raise ConfigError(f"metadata must be a URL string or a MetadataStore, got {metadata!r} "
                          f"({type(metadata).__name__}); e.g. 'sqlite:////data/meta.db'")


def _wal_open_error(error: BaseException, node_id: int, location: str) -> BaseException:
    """The engine's error for one met while opening node `node_id`'s WAL at `location` (the
    error itself when it is already the engine's, or not the WAL's)."""
    if isinstance(error, wal.WALInUseError):
        return NodeConflictError(f"node {node_id} is already running on this host: {error}. Stop that instance "
                                 "first, or start this one with another node id")
    if isinstance(error, wal.WALConfigError):
        return ConfigError(str(error))
    if isinstance(error, wal.WALCorruptError):
        return WALCorruptError.from_wal(error)
    if isinstance(error, wal.WALError):
        return WALError(str(error))
    if isinstance(error, OSError):
        return WALError(f"cannot open or create the WAL at {location!r}: {error.strerror or error} "
                        f"(errno {error.errno}); free space or fix the path and its permissions")
    return error


class _StartingHeartbeat:
    """Heartbeats a registered node while it starts: a node registered (its epoch bumped) but
    silent is failed over by its peers after their heartbeat_timeout, and opening and replaying
    a WAL of objects took 2-6 s on a loaded host (issue 50, item 12: one node was fenced six
    times in a row while starting). Each heartbeat says the node cannot serve yet, so peers give
    it nothing meanwhile; the node's agent heartbeats once the client is made."""

    INTERVAL = 0.25
    HEALTH = json.dumps(dict(serving=False, stuck=False, problems=["starting: opening and replaying its WAL"]),
                        sort_keys=True)

    def __init__(self, meta: MetadataStore, node_id: int, node_epoch: int) -> None:
        self._meta, self._node_id, self._node_epoch = meta, node_id, node_epoch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="s3stream-starting", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.INTERVAL):
            try:
                self._meta.heartbeat(self._node_id, self._node_epoch, self.HEALTH)
            except StreamFencedError:
                return                  # fenced while starting: the start fails at its next step
            except Exception as e:      # noqa: BLE001 - the store is away: the start's own calls say so
                log.debug("node %d: heartbeat while starting failed: %s", self._node_id, e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class StreamClient:
    """The engine of one node. See the module docstring for its lifecycle.

    `object_store` and `metadata` are URLs ("file:///dir", "s3://bucket/prefix?endpoint_url=...",
    "sqlite:////path/meta.db") or ready-made store objects (shared, not closed by this client).

    `metrics`: True exports Prometheus metrics on prometheus_client's default registry; a
    CollectorRegistry exports them on that one (see s3stream.metrics and docs/metrics.md). The
    object and metadata stores are then wrapped to time their calls. `self.metrics` is the registration
    (None without), removed by close().
    """

    # Made by _start_registered.
    _wal: wal.WAL
    _uploader: Uploader

    def __init__(self, node_id: int, wal_path: str | os.PathLike, object_store: str | ObjectStore,
                 metadata: str | MetadataStore, config: Config | None = None, *,
                 clock: Callable[[], int] = time.monotonic_ns,
                 metrics: "bool | CollectorRegistry" = False) -> None:
        if isinstance(node_id, bool) or not isinstance(node_id, int) or not 0 <= node_id < 1 << 63:
            raise ConfigError(f"node_id must be a non-negative integer, got {node_id!r}")
        self.config = config or Config()
        if not isinstance(self.config, Config):
            raise ConfigError(f"config must be an s3stream.Config, got {type(self.config).__name__}")
        self.node_id = node_id
        self._clock = clock
        _check_store_args(object_store, metadata)
        self._owns_store = isinstance(object_store, str)
        self._owns_meta = isinstance(metadata, str)
        self._store: ObjectStore = open_object_store(object_store) if isinstance(object_store, str) else object_store
        self._meta: MetadataStore = open_metadata(metadata) if isinstance(metadata, str) else metadata
        self.metrics = None
        if metrics is not False and metrics is not None:
            from .metrics import instrumented_stores
            self._store, self._meta = instrumented_stores(self._store, self._meta)
        self._lock = threading.Lock()
        self._streams: dict[int, Stream] = {}
        self._addons: dict[str, Any] = {}
        self._latency_pending: collections.deque[tuple[int, int]] = collections.deque(maxlen=4096)
        self._closed = False
        self._fenced = False
        self._fence_reason: str | None = None
        # The node's lease (renew_lease): CLOCK_MONOTONIC ns until which appends are acknowledged,
        # None while nobody renews one; and why the latest renewal failed, for error messages.
        self._lease_until: int | None = None
        self._lease_problem: str | None = None
        self._admit_cond = threading.Condition()
        # Appends that waited for admission (backpressure: the cache full of uncommitted data),
        # and the seconds they waited in all: a stall of appends with a cause to name.
        self._admit_waits = 0
        self._admit_wait_ns = 0
        self._tail_waiters = 0               # appenders waiting for their stream's tail (guarded by _admit_cond)
        self._tail_waits = 0
        self._tail_wait_ns = 0
        self._recovering = True
        self._host_lock: HostLock | None = None
        try:
            walopen.check_location(wal_path)
            location = registered_location(wal_path)
        except BaseException:
            self._close_owned()            # a mistyped WAL URL: nothing is left open
            raise
        with self._opening(location):
            # Where the WAL lives decides these (engine/walopen.py): no second instance of this
            # node on this host before the epoch bump, the old WAL bound, a new file zero-filled
            # before the registration.
            self._host_lock = walopen.claim(location, node_id)
            self._bind_wal(node_id, location)
            walopen.prepare(location, self.config.wal_config)
        try:
            node = self._meta.register_node(node_id, location)
        except BaseException:
            self._close_owned()
            raise
        self.node_epoch = node.node_epoch
        self._append_path: AppendPath | None = None      # made once recovery is done
        starting = _StartingHeartbeat(self._meta, node_id, self.node_epoch)
        try:
            self._start_registered(wal_path, location, clock)
        finally:
            starting.stop()
        self._append_path = AppendPath(
            self._wal.start(), self._cache, self.config.max_batch_bytes, self.config.cache_size,
            int(self._wal.capacity * self.config.wal_pressure),
            self._uploader.submit, self._on_wal_pressure, self._admit, self._map_wal_error,
            dict(invalid_batch=InvalidBatchError, closed=StreamClosedError, fenced=StreamFencedError,
                 append_failed=AppendFailedError, timeout=OperationTimeoutError),
            self._lease_expired_error, self._reserve_offsets,  # type: ignore[arg-type]  # a Stream is its writer
            self.config.stream_tail_limit or 0, self._tail_wait)  # type: ignore[arg-type]
        # Extends streams' offset reservations ahead of their appends (one thread, idle mostly).
        self._reserver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s3stream-reserve",
                                            initializer=normal_priority)
        self._reserving: set[int] = set()
        # User callbacks (AppendFuture.add_done_callback, future(), await) run here, never on
        # the WAL's writer threads or the uploader's.
        self._callbacks = threading.Thread(target=self._append_path.run_callbacks, name="s3stream-callbacks",
                                           daemon=True)
        self._callbacks.start()
        self.reclaimer = ObjectReclaimer(self._store, self._meta, self.config.destroy_delay)
        self._reclaim_thread = None
        if self.config.reclaim_interval is not None:
            self._reclaim_thread = ReclaimerThread(self.reclaimer, self.config.reclaim_interval)
        self._stats_sources: dict[str, Callable[[dict], dict]] = {}
        self._ticker = None
        if self.config.upload_interval is not None:
            self._ticker = threading.Thread(target=self._tick, args=(self.config.upload_interval,),
                                            name="s3stream-interval", daemon=True)
            self._ticker.start()
        if metrics is not False and metrics is not None:
            from .metrics import instrument
            try:
                self.metrics = instrument(self, None if metrics is True else metrics)
            except BaseException:
                self.close()
                raise

    def _start_registered(self, wal_path, location: str, clock: Callable[[], int]) -> None:
        """The constructor's part between the registration and the append path: open the WAL,
        make the cache, reader and uploader, recover. On a failure it closes what it opened and
        the stores the client owns."""
        node_id = self.node_id
        with self._opening(location):
            self._wal = open_node_wal(wal_path, node_id=node_id, node_epoch=self.node_epoch,
                                      config=self.config.wal_config,
                                      epoch_check=epoch_checker(self._meta, node_id, self.node_epoch))
        self._wal.on_fenced(self._wal_fenced)
        self._cache = new_log_cache(self.config, clock)
        self._reader = Reader(self._store, self._meta, self._cache, self.config)
        self._uploader = Uploader(node_id=node_id, node_epoch=self.node_epoch, store=self._store,
                                  metadata=self._meta, cache=self._cache, trim_wal=self._trim_wal,
                                  config=self.config, on_committed=self._on_committed, on_fenced=self._on_fenced,
                                  wait_durable=self._wait_wal_durable, on_failure=self._on_upload_failure,
                                  behind=self._uploads_behind)
        self._uploader.on_put = self._on_put
        try:
            self.recovered = self._recover()
            # Alive and done: heartbeat once more before the agent (if any) takes over.
            self._meta.heartbeat(node_id, self.node_epoch)
            self._wal.start()
        except BaseException:
            self._uploader.abort()
            self._uploader.close()
            self._wal.close()
            self._close_owned()
            raise

    @contextlib.contextmanager
    def _opening(self, location: str) -> Iterator[None]:
        """A step of the start before the WAL is open: on any error, close the stores this
        client owns and raise the engine's error for it (_wal_open_error)."""
        try:
            yield
        except BaseException as e:
            self._close_owned()
            mapped = _wal_open_error(e, self.node_id, location)
            if mapped is e:
                raise
            raise mapped from e

    # ---- streams ------------------------------------------------------------------------------

    def create_stream(self) -> Stream:
        """A new stream, opened by this node."""
        self.check_usable()
        return self._register(self._meta_call(self._meta.create_stream, self.node_id, self.node_epoch,
                                              self.config.offset_reservation))

    def create_streams(self, count: int) -> list[Stream]:
        """`count` new streams, opened by this node, created in ONE metadata transaction (all or
        none), ids ascending: a node agent's batch of new partitions creates theirs together."""
        check_int("count", count)
        self.check_usable()
        metas = self._meta_call(self._meta.create_streams, count, self.node_id, self.node_epoch,
                                self.config.offset_reservation)
        return [self._register(meta) for meta in metas]

    def open_stream(self, stream_id: int) -> Stream:
        """Open an existing stream on this node with epoch + 1. StreamNotClosedError if another
        node holds it open; StreamNotFoundError if it does not exist or was destroyed;
        InvalidArgumentError if the id is not an int (a bool is not a stream id)."""
        check_int("stream_id", stream_id)
        self.check_usable()
        with self._lock:
            if stream_id in self._streams:
                raise StreamNotClosedError(f"stream {stream_id} is already open on this client")
        return self._register(self._meta_call(self._meta.open_stream, stream_id, self.node_id, self.node_epoch,
                                              self.config.offset_reservation))

    def fetch_committed(self, stream_id: int, start_offset: int, end_offset: int | None = None,
                        max_bytes: int = 1 << 20, known: StreamMeta | None = None) -> "FetchResult":
        """Read a stream's committed records (what its objects hold) without opening it: no
        epoch change, nothing written, whichever node owns it. For readers that own nothing:
        a verifier, a mirror's source side, an audit. The readable range is [start, end) of the
        stream in metadata (`end_offset` default: its committed end); a stream open elsewhere may
        hold acknowledged records beyond it in its owner's WAL, readable here once uploaded.
        StreamNotFoundError for a stream that does not exist or was deleted; OffsetOutOfRangeError
        outside that range. `known`: the stream as the caller just read it from metadata (it is
        not read again: a batch of partition opens has every meta stream's row already)."""
        self.check_usable()
        return fetch_committed(self._meta, self._reader, stream_id, start_offset, end_offset, max_bytes, known)

    def fetch_committed_at(self, points: Sequence[tuple[int, int]]) -> dict[tuple[int, int], FetchedBatch]:
        """The committed batch holding each (stream_id, offset) point, read together: one
        metadata read for all, and a few ranged GETs per object (a batch of partition opens
        reads each one's last checkpoint so). A point that is not committed, or whose read
        failed, is absent: read it with fetch_committed, which says why. Nothing is opened."""
        self.check_usable()
        return self._reader.read_points(points)

    # ---- add-ons: per-client state of the layers above ------------------------------------------

    def addon(self, key: str, make: Callable[["StreamClient"], T]) -> T:
        """The add-on stored under `key`, made by `make(self)` on first use: how a layer above
        the engine keeps per-client state (the cluster layer's partitions) without the engine
        knowing it. An add-on with a `close(timeout)` method returning a list of errors is
        closed first by `close()`, before the streams."""
        with self._lock:
            found = self._addons.get(key)
            if found is None:
                found = self._addons[key] = make(self)
            return found

    def find_addon(self, key: str) -> Any | None:
        """The add-on stored under `key`, or None if none was made (never makes one)."""
        with self._lock:
            return self._addons.get(key)

    @property
    def metadata(self) -> MetadataStore:
        """The metadata store of this client's cluster (shared: do not close it), for add-ons
        that keep their own records there (the mirror, the balancer, consumer offsets)."""
        return self._meta

    @property
    def object_store(self) -> ObjectStore:
        """The object store this client uploads to (shared: do not close it), for add-ons that
        read or write objects of their own (compaction, its reclaimer)."""
        return self._store

    @property
    def write_ahead_log(self) -> wal.WAL:
        """This node's write-ahead log, for what observes it (metrics: `stats()`,
        `appended_end`, `completion_time`). Appending to it directly bypasses every stream."""
        return self._wal

    def append_latencies(self) -> list[float]:
        """Seconds from submission to durable of the appends sampled (one in 64, every stream)
        since the last call that are durable by now; the still pending ones are returned by a
        later call. For a metrics scraper: sampling costs an append a counter test."""
        with self._lock:
            pending = self._latency_pending
            pending.extend(self._appends().take_latency_samples())
            durable = self._wal.durable_end
            out = []
            while pending and pending[0][1] <= durable:
                submitted, end = pending.popleft()
                done = self._wal.completion_time(end)
                if done is not None:        # None: older than the WAL's completion log
                    out.append(max(0, done - submitted) / 1e9)
            return out

    def open_streams(self, stream_ids: list[int]) -> list[Stream]:
        """Open several existing streams on this node, each with epoch + 1, in ONE metadata
        transaction (all of them or none: StreamNotClosedError if another node holds one open,
        StreamNotFoundError if one does not exist). A partition's open uses it."""
        for stream_id in stream_ids:
            check_int("stream_id", stream_id)
        self.check_usable()
        with self._lock:
            here = [sid for sid in stream_ids if sid in self._streams]
        if here:
            raise StreamNotClosedError(f"streams {here} are already open on this client")
        metas = self._meta_call(self._meta.open_streams, list(stream_ids), self.node_id, self.node_epoch,
                                self.config.offset_reservation)
        return [self._register(meta) for meta in metas]

    def opened(self, stream_id: int) -> Stream | None:
        """The handle of stream `stream_id` if it is open on this client, else None."""
        with self._lock:
            return self._streams.get(stream_id)

    def unuploaded_bytes(self, stream: Stream) -> int:
        """Bytes of the stream that no PUT has carried or started to carry yet (bounded by
        Config.stream_tail_limit): what its close uploads. Bytes PUT but not yet committed are
        not counted: the close commits those objects as they are (and waits, at most a usual
        PUT's time, for those whose PUT is running)."""
        return max(0, self._unput_tail(stream))

    def _register(self, meta: StreamMeta) -> Stream:
        # The active block may still hold this stream's slice of an earlier epoch here (closed
        # here, its tail uploaded by that close): seal it, so this epoch starts a slice of its own.
        sealed = self._cache.seal(meta.stream_id, "open")
        if sealed is not None:
            self._uploader.submit(sealed)
        stream = Stream(self, meta)
        with self._lock:
            self._streams[meta.stream_id] = stream
        return stream

    def _forget(self, stream: Stream) -> None:
        with self._lock:
            if self._streams.get(stream.stream_id) is stream:
                del self._streams[stream.stream_id]

    def streams(self) -> list[Stream]:
        """The streams open on this client."""
        with self._lock:
            return list(self._streams.values())

    def list_streams(self) -> list[StreamMeta]:
        """Metadata of every stream in the cluster."""
        return self._meta.list_streams()

    # ---- write path (called by Stream) -----------------------------------------------------------

    def _appends(self) -> AppendPath:
        """The append path. It is None only while the constructor recovers the WAL, when no
        append, close or stats can reach it; the upload hooks recovery runs check for None."""
        if self._append_path is None:
            raise RuntimeError(f"the client of node {self.node_id} is still recovering its WAL")
        return self._append_path

    def _admit(self, nbytes: int) -> None:
        """Backpressure (called by the append path when admission is full): wait while
        uncommitted data would exceed the cache size; WALFullError after append_timeout."""
        path = self._appends()
        started = time.monotonic_ns()
        try:
            self._wait_for_room(lambda: path.uncommitted + nbytes > path.admit_limit and path.uncommitted > 0,
                                lambda: f"backpressure: {path.uncommitted} bytes not yet uploaded (cache_size "
                                        f"{self.config.cache_size}) for {self.config.append_timeout} s; ")
        finally:
            self._admit_waits += 1
            self._admit_wait_ns += time.monotonic_ns() - started

    def _wait_for_room(self, blocked: Callable[[], bool], why: Callable[[], str]) -> None:
        """Wait on the admission condition (notified as blocks commit) while `blocked()`, at most
        append_timeout; then WALFullError saying `why()` and what keeps uploads behind."""
        deadline = time.monotonic() + self.config.append_timeout
        with self._admit_cond:
            while blocked():
                self.check_usable()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WALFullError(why() + self._why_uploads_lag())
                self._admit_cond.wait(min(left, 0.5))

    def _unput_tail(self, stream: Stream) -> int:
        """Bytes of the stream's un-uploaded tail that no PUT has carried yet: what its close
        would PUT (the StreamObjects already PUT it commits as they are)."""
        return stream.tail - self._uploader.put_bytes(stream.stream_id, stream.epoch)

    def _on_put(self, _future) -> None:
        """A StreamObject's PUT started or ended (an upload thread): wake the appends waiting
        for their stream's tail to be PUT, if any."""
        if self._tail_waiters:
            with self._admit_cond:
                self._admit_cond.notify_all()

    def _tail_wait(self, stream: Stream, nbytes: int) -> None:
        """Backpressure per stream (the append path calls it when an append would take the
        stream's un-uploaded tail past Config.stream_tail_limit): unless enough of that tail is
        PUT already (a close commits those objects as they are), cut the stream's slice out of
        the active block if that is needed for it to go up, and wait until the part not yet PUT
        has room; WALFullError after append_timeout. Uploads count as behind meanwhile
        (`_uploads_behind`). So the bound is on what a move must PUT, and a stream's throughput
        is bounded by PUTs, not by commit round trips."""
        limit = self.config.stream_tail_limit or 0

        def blocked() -> bool:
            # A stream that is closing (or closed, fenced) stops waiting: its append is refused
            # with the reason right after (its tail may never be committed here again).
            if not (stream.tail and stream.is_open and stream.tail + nbytes > limit):
                return False
            unput = self._unput_tail(stream)
            return bool(unput) and unput + nbytes > limit

        if not blocked():
            return
        # Cut alone (the other streams' slices stay), and only if needed (uploadpolicy).
        if tail_must_cut(self._unput_tail(stream), self._cache.active_bytes(stream.stream_id), nbytes, limit):
            sealed = self._cache.cut(stream.stream_id, "tail")
            if sealed is not None:
                self._uploader.submit(sealed)
        started = time.monotonic_ns()
        with self._admit_cond:
            self._tail_waiters += 1
        try:
            self._wait_for_room(blocked,
                                lambda: f"backpressure: stream {stream.stream_id} has {self._unput_tail(stream)} bytes "
                                        f"not yet uploaded (stream_tail_limit {limit}) after "
                                        f"{self.config.append_timeout} s; ")
        finally:
            with self._admit_cond:
                self._tail_waiters -= 1
            self._tail_waits += 1
            self._tail_wait_ns += time.monotonic_ns() - started

    def _reserve_offsets(self, stream: Stream, need_end: int) -> None:
        """Append path hook: an append needs `stream`'s offsets up to `need_end`, past its soft
        mark. Within the reservation it is extended in the background; beyond it, on this
        appender's thread before the append takes an offset (raising what the metadata store
        raised: the append fails, no offset taken)."""
        target = need_end + self.config.offset_reservation
        if need_end <= stream.reserved_end:
            with self._lock:
                if stream.stream_id in self._reserving:
                    return
                self._reserving.add(stream.stream_id)
            try:
                self._reserver.submit(self._extend_reservation, stream, target, True)
            except RuntimeError:             # the client is closing
                with self._lock:
                    self._reserving.discard(stream.stream_id)
            return
        self._extend_reservation(stream, target, False)

    def _extend_reservation(self, stream: Stream, target: int, background: bool) -> None:
        try:
            with stream._reserve_lock:
                if stream.reserved_end >= target:
                    return
                meta = self._meta_call(self._meta.reserve_offsets, stream.stream_id, stream.epoch, self.node_id,
                                       self.node_epoch, target, stream=stream)
                stream._set_reservation(meta.reserved_end, meta.reserved_end - self.config.offset_reservation // 2)
        except Exception as e:
            if not background:
                raise
            # The next append past the soft mark tries again; one past the reservation raises it.
            log.warning("stream %d: extending its offset reservation failed: %s", stream.stream_id, e)
        finally:
            if background:
                with self._lock:
                    self._reserving.discard(stream.stream_id)

    def _release(self, nbytes: int) -> None:
        if nbytes:
            self._appends().released(nbytes)
            with self._admit_cond:
                self._admit_cond.notify_all()

    def _on_wal_pressure(self) -> None:
        """The WAL's untrimmed bytes passed Config.wal_pressure (called by an append): seal the
        active block if it holds at least half of them, so its upload and commit free the WAL."""
        path = self._appends()
        try:
            untrimmed = path.untrimmed_bytes()
            sealed = self._cache.seal_if_span(untrimmed // 2, self._wal.start().appended_end)
            if sealed is not None:
                self._uploader.submit(sealed)
        finally:
            path.pressure_handled()

    def _uploads_behind(self) -> bool:
        """Uploader hook: half of cache_size is uncommitted, or the WAL's untrimmed bytes passed
        wal_pressure (also while recovering, with no append path yet): uploads must not wait
        for idle cores then."""
        path = self._append_path
        return (path is None or self._tail_waiters > 0 or 2 * path.uncommitted > path.admit_limit
                or path.untrimmed_bytes() > path.pressure_bytes)

    def _wait_wal_durable(self, wal_end: int) -> None:
        """Uploader hook: block until the WAL holds everything before `wal_end` durably."""
        if self._recovering:
            return               # replayed records were read back from the WAL: durable
        try:
            durable = self._wal.start().wait_durable(wal_end, self.config.append_timeout)
        except wal.WALError as e:
            raise self._map_wal_error(e) from e
        if not durable:
            raise WALError(f"WAL records up to {wal_end} not durable after {self.config.append_timeout} s: "
                           "the WAL device is not keeping up")

    def _why_uploads_lag(self) -> str:
        """What keeps data from leaving the WAL: the upload steps failing now, if any."""
        episode = self._uploader.retrying
        if episode is None:
            return "the object store is not keeping up"
        return (f"uploads have been failing for {episode.seconds:.0f} s and are being retried ({episode.retries} "
                f"retries so far; the last: {episode.what}: {type(episode.error).__name__}: {episode.error}); they "
                "resume within a second of the object store and the metadata store answering again: fix the "
                "outage (the network, the service, a full disk) and they catch up")

    def _map_wal_error(self, error: BaseException) -> S3StreamError:
        if isinstance(error, S3StreamError):
            return error
        if isinstance(error, wal.WALFencedError):
            # Permanent: the uploader stops at once instead of waiting for records that can
            # never be durable here (the client is fenced as a whole by _wal_fenced).
            return StreamFencedError(f"node {self.node_id} epoch {self.node_epoch} was fenced: {error}")
        if isinstance(error, wal.WALFullError):
            return WALFullError(f"{error} ({self._why_uploads_lag()})")
        if isinstance(error, wal.WALClosedError):
            return StreamClosedError(f"the client is closed: {error}")
        if isinstance(error, wal.RecordTooLargeError):
            return InvalidBatchError(str(error))
        return WALError(str(error))

    def force_upload(self, timeout: float | None = None) -> None:
        """Upload everything appended so far (the active block, sealed at whatever size) and
        return once it is all committed; OperationTimeoutError after `timeout`."""
        self.check_usable()
        sealed = self._cache.seal(reason="force")
        if sealed is not None:
            self._uploader.submit(sealed)
        pending = self._uploader.pending_block_ids()
        if pending:
            self._uploader.wait_committed(max(pending), timeout)

    def close_streams(self, streams: list[Stream], timeout: float | None = None, timing: dict | None = None,
                      kv: tuple[tuple[str, bytes], ...] = (), not_durable: tuple[Stream, ...] = ()) -> None:
        """Close several streams together: wait for their pending appends, then upload their
        un-uploaded tails only (each at most about Config.stream_tail_limit; nothing of other
        streams, nothing older), on this thread ahead of the background uploads, and commit
        them with the streams' CLOSED state in one metadata transaction (Uploader.upload_and_close).

        Says only what happened: a stream is closed here once it is CLOSED in metadata. If a
        step fails this raises, and the streams not marked CLOSED serve again (open, appends
        accepted), so that calling it again does every step left. `timing`, if given, receives
        where the upload's time went (Uploader.upload_and_close). `kv`: KV entries written by
        the commit that closes them all (CommitRequest.kv); not written when they close one by
        one (a stream was fenced) or none was open.

        `not_durable`: streams of `streams` whose last appends are not waited for: nobody was
        told they are durable (a partition's clean checkpoint), and the log cache holds them from
        the append on, so the close's own object carries them and its commit makes them durable.
        The WAL still writes them; recovery skips them as below the committed end."""
        closing = [s for s in streams if s._begin_close(timeout, wait=not any(s is n for n in not_durable))]
        closed: set[int] = set()
        try:
            if self._uploader.failure is not None:
                raise self._upload_failure()
            if closing:
                try:
                    self._uploader.upload_and_close([(s.stream_id, s.epoch) for s in closing], timeout, timing, kv)
                    closed.update(s.stream_id for s in closing)
                    self._seal_closed_tails(closing)
                except StreamFencedError as e:
                    # One of them moved away (or the node was fenced): each is closed on its own,
                    # and the fenced ones say so.
                    fenced = e
                    for s in closing:
                        try:
                            if len(closing) > 1:
                                self._uploader.upload_and_close([(s.stream_id, s.epoch)], timeout)
                                closed.add(s.stream_id)
                                self._seal_closed_tails([s])
                                continue
                        except StreamFencedError as one:
                            fenced = one
                        s._fence()
                    raise fenced from None
                except UploadAborted:
                    if self._uploader.failure is not None:
                        raise self._upload_failure() from None
                    raise
        finally:
            for s in closing:
                s._end_close(s.stream_id in closed)

    def _seal_closed_tails(self, streams: list[Stream]) -> None:
        """After a close: their tails are committed (they leave the tail count; appenders
        waiting on it wake and are refused). The active block may hold slices of those tails:
        each is cut out (a block of its own, which goes up with nothing left in it to upload),
        so that the WAL behind it can be trimmed; the other streams' slices keep filling."""
        for s in streams:
            s._tail_committed(s.tail)
        with self._admit_cond:
            self._admit_cond.notify_all()
        for s in streams:
            sealed = self._cache.cut(s.stream_id, "close")
            if sealed is not None:
                self._uploader.submit(sealed)

    def _on_committed(self, block: CacheBlock, result: CommitResult) -> None:
        with self._lock:
            for stream_id, slice_ in block.streams.items():
                stream = self._streams.get(stream_id)
                if stream is not None and stream.epoch == slice_.epoch:
                    stream._committed(slice_.end_offset)
                    stream._tail_committed(slice_.size)
        self._release(block.admitted)

    def _on_upload_failure(self, error: BaseException) -> None:
        if self._append_path is not None:
            failure = self._upload_failure()
            self._append_path.refuse(type(failure), str(failure))

    def _on_fenced(self, stream_ids: list[int] | None, reason: str | None = None) -> None:
        """Streams `stream_ids` moved away, or (None) this whole node was fenced: then it stops
        at once (see `fence`)."""
        with self._lock:
            if stream_ids is None:
                first = not self._fenced
                self._fenced = True
                self._fence_reason = self._fence_reason or reason
                targets = list(self._streams.values())
            else:
                first = False
                targets = [self._streams[s] for s in stream_ids if s in self._streams]
        if first:
            error = StreamFencedError(self._fenced_message())
            if self._append_path is not None:
                self._append_path.refuse(StreamFencedError, str(error))
            # What is durable but not yet acknowledged is never acknowledged now: it fails. The
            # records stay in the WAL, where the failover (if any) finds them.
            self._wal.revoke_acks(error)
            self._uploader.abort()
            log.error("%s", error)
        for stream in targets:
            stream._fence()

    def _wal_fenced(self, error: BaseException) -> None:
        """The WAL's hook (a thread of its own): another writer took the node's WAL of objects
        over, a newer instance of the node or a peer failing it over. Stop as a fenced node."""
        self._on_fenced(None, f"its WAL was taken over: {error}")

    def _fenced_message(self) -> str:
        why = f" ({self._fence_reason})" if self._fence_reason else ""
        return (f"node {self.node_id} epoch {self.node_epoch} was fenced{why}: another instance, a failover "
                "or `node forget` took over; this client stops, and appends it had not acknowledged fail. "
                "Retry them on the partition's new owner; start the node again to rejoin")

    # ---- the node's lease (renewed by the cluster layer) -------------------------------------------

    def renew_lease(self, renewed_ns: int, duration: float) -> None:
        """The cluster layer renewed this node's lease: a heartbeat sent at time.monotonic_ns()
        `renewed_ns` (read before sending it) was accepted by the metadata store at this node's
        epoch. From now on appends are acknowledged only until `renewed_ns + duration`, checked
        natively where they complete; appends made after it are refused (LeaseExpiredError) and
        durable ones wait for the next renewal. A peer may fail this node over only after its
        heartbeat_timeout, which exceeds the lease (docs/migration.md, "No acknowledgment after
        a fence"). A client whose lease nobody renews has none and acknowledges whatever is
        durable (a node outside a cluster)."""
        until = renewed_ns + int(duration * 1e9)
        with self._lock:
            if self._fenced or self._closed:
                return
            if self._lease_until is not None and until <= self._lease_until:
                return
            self._lease_until = until
            self._lease_problem = None
            self._wal.set_ack_deadline(until)

    def lease_renewal_failed(self, error: BaseException | str) -> None:
        """A renewal failed (the metadata store did not answer, say): named by the errors of
        appends refused once the lease has run out."""
        self._lease_problem = str(error)

    @property
    def lease_remaining(self) -> float | None:
        """Seconds left on the lease (negative once it ran out); None without a lease."""
        until = self._lease_until
        return None if until is None else (until - time.monotonic_ns()) / 1e9

    def fence(self, reason: str) -> None:
        """This node was fenced: its node epoch was bumped in metadata (a failover, `node forget`
        or a newer instance of it took over), as its agent learned. It stops at once: appends
        are refused, those not yet acknowledged fail with StreamFencedError, every stream handle
        is fenced and uploads stop (their commits would be refused). The WAL keeps its records
        for the failover. One fenced state: the same as when an upload's commit finds the fence."""
        self._on_fenced(None, reason)

    @property
    def fenced(self) -> bool:
        return self._fenced

    @property
    def closed(self) -> bool:
        """close() was called (appends are refused from then on)."""
        return self._closed

    def health(self) -> dict:
        """Whether this node can serve, and if not why: {"serving": bool, "problems": [str]},
        plus, while uploads are failing and being retried, for how long and what fails
        (uploads_failing_seconds, uploads_failing). It cannot serve once it is closed or fenced,
        its WAL failed, or uploads stopped for good. A node agent sends it with each heartbeat
        (and counts uploads failing for longer than its heartbeat_timeout as unable to serve):
        a node that cannot serve takes no partitions and judges no peer. A client that holds no
        lease (no agent heartbeats for it) reads its node's row here to learn of a takeover."""
        problems: list[str] = []
        if self._closed:
            problems.append(f"the client of node {self.node_id} is closed")
        else:
            if not self._fenced and self._lease_until is None:
                self._check_node_epoch()
            if self._fenced:
                problems.append(self._fenced_message())
            wal_error = self._wal.start().error
            if wal_error is not None:
                problems.append(f"its WAL failed: {wal_error}")
            if self._uploader.failure is not None:
                problems.append(f"uploads stopped: {self._uploader.failure}")
        episode = self._uploader.retrying
        failing = dict(uploads_failing_seconds=round(episode.seconds, 3),
                       uploads_failing=f"{episode.what}: {episode.error}") if episode is not None else {}
        return dict(serving=not problems, problems=problems, **failing)

    def _check_node_epoch(self) -> None:
        """For a node that no agent keeps (no lease, so no heartbeat learns of a fence): read
        its row, and stop as fenced if another instance or a failover took the node over. An
        idle old instance on another host would otherwise say it serves until its next PUT or
        commit is refused. No answer from the store proves nothing: it is asked again next time."""
        try:
            node = self._meta.get_node(self.node_id)
        except Exception as e:      # noqa: BLE001 - the store is away; uploads will say so
            log.debug("node %d: reading its row for health() failed: %s", self.node_id, e)
            return
        if node.node_epoch != self.node_epoch or node.failover:
            self._on_fenced(None, f"node {self.node_id} is at epoch {node.node_epoch} in metadata"
                                  f"{' (failed over)' if node.failover else ''}")

    def _lease_expired_error(self) -> LeaseExpiredError:
        """The error of an append refused because the lease ran out (the append path's hook)."""
        until = self._lease_until
        ago = (time.monotonic_ns() - until) / 1e9 if until is not None else 0.0
        why = f"; renewing it failed: {self._lease_problem}" if self._lease_problem else ""
        return LeaseExpiredError(
            f"node {self.node_id} acknowledges nothing: its lease ran out {ago:.2f} s ago{why}. Retry the "
            "append: it goes through once the lease is renewed (the metadata store answers again), or on the "
            "partition's new owner if this node was failed over")

    def _trim_wal(self, offset: int) -> None:
        if self._recovering:         # recovery trims once, after its scan
            return
        self._wal.trim(offset)
        # Appenders signal WAL pressure when they cross the mark; if they are all waiting for
        # space, nobody crosses it again, so the uploader looks once more after each trim.
        path = self._append_path
        if path is not None and path.untrimmed_bytes() > path.pressure_bytes:
            self._on_wal_pressure()

    def _tick(self, interval: float) -> None:
        """The visibility deadline (upload_interval): seal the active block once its oldest
        record is `interval` old, sleeping until then (uploadpolicy.deadline_sleep)."""
        age = int(interval * 1e9)
        while not self._closed:
            time.sleep(deadline_sleep(self._cache.age(), interval))
            sealed = self._cache.seal_if_older(age)
            if sealed is not None:
                self._uploader.submit(sealed)

    def _meta_call(self, fn, *args, stream: Stream | None = None):
        try:
            return fn(*args)
        except StreamFencedError:
            if stream is not None:
                stream._fence()
            raise

    def check_usable(self) -> None:
        """Raise why this client can serve no more: closed (StreamClosedError), fenced
        (StreamFencedError), or its uploads failed for good (their S3StreamError)."""
        if self._closed:
            raise StreamClosedError(f"the client of node {self.node_id} is closed")
        if self._fenced:
            raise StreamFencedError(self._fenced_message())
        if self._uploader.failure is not None:
            raise self._upload_failure()

    def _upload_failure(self) -> S3StreamError:
        failure = self._uploader.failure
        if isinstance(failure, S3StreamError):
            return failure
        return S3StreamError(f"uploads failed and stopped; un-uploaded data stays in the WAL: {failure}")

    def _bind_wal(self, node_id: int, wal_path: str) -> None:
        """A node's identity is bound to its WAL (issue 10, case 2). If node `node_id` was last
        registered with another WAL and still holds streams open (their un-uploaded tail is in
        that WAL): refuse while that WAL is in use on this host, recover it first (failover) if
        it can be read here, else refuse, naming both WALs. Nothing is changed on a refusal."""
        nodes = {n.node_id: n for n in self._meta.list_nodes()}
        prev = nodes.get(node_id)
        if prev is None or walopen.same_wal(prev.wal_path, wal_path):
            return
        held = [m.stream_id for m in self._meta.list_streams(owner_node_id=node_id, last_range=True)]
        if not held:
            return                         # nothing can be waiting in the old WAL
        old = prev.wal_path
        try:
            walopen.check_not_in_use_here(old)
        except wal.WALInUseError:
            raise NodeConflictError(
                f"node {node_id} is running on this host with WAL {old!r}; a second instance with WAL "
                f"{wal_path!r} would fence it and lose what it has not uploaded. Stop it first, or use "
                "another node id for this instance.") from None
        if not walopen.readable_here(old):
            raise NodeConflictError(
                f"node {node_id} holds {len(held)} streams open whose un-uploaded tail is in its WAL {old!r}, "
                f"which this host cannot read; starting it with WAL {wal_path!r} would lose that tail. Start "
                f"node {node_id} with that WAL, or fail it over from a host that can read it "
                "(s3stream.engine.failover.fail_over), then start it with the new WAL.")
        log.warning("node %d was registered with WAL %s and starts with %s: recovering the old WAL first",
                    node_id, old, wal_path)
        fail_over(node_id, store=self._store, metadata=self._meta, config=self.config, wal_path=old)

    # ---- recovery -----------------------------------------------------------------------------

    def _recover(self) -> dict:
        """Upload and commit what the WAL holds above each stream's committed end, then close
        the streams this node left open. Returns counts for logs and tests."""
        # One read for both steps; their ends, not their history.
        held = self._meta.list_streams(owner_node_id=self.node_id, last_range=True)
        try:
            result = replay_wal(self._wal.recover(), self.node_id, self._meta, self._cache, self._uploader,
                                self._wal.salvaged_end, held)
        except wal.WALCorruptError as e:
            raise WALCorruptError.from_wal(e, f"node {self.node_id} cannot start: ") from e
        closed = close_node_streams(self._meta, self.node_id, self.node_epoch, held)
        self._recovering = False
        if result["last_end"] is not None:
            self._wal.trim(result["last_end"])
        result.update(streams_closed=closed,
                      stop_reason=self._wal.recovery_result.stop_reason if self._wal.recovery_result else None)
        if result["records"]:
            log.info("node %d recovered %d WAL records (%d uploaded), closed %d streams", self.node_id,
                     result["records"], result["replayed"], closed)
        return result

    # ---- closing ------------------------------------------------------------------------------

    def close(self, timeout: float | None = None, retire: bool = False) -> dict:
        """Close every open stream (force upload + CLOSED), then the WAL (clean shutdown).

        `retire`: the node leaves the cluster for good (or until it starts again): once
        everything is uploaded and the WAL closed cleanly, it is marked in metadata as failed
        over, so peers' agents never take its silence for a crash and try to fail it over from
        a WAL they cannot reach (another host's disk). Its next start registers it again. If
        anything stayed in the WAL, it is not retired: its next start (or a failover) replays it.

        Waits at most `timeout` seconds in all (default: Config.close_timeout) for uploads: a
        store that is down or refusing cannot hold close() forever. Streams whose data could not
        be uploaded in time stay OPENED with their tail in the WAL, which the node's next start
        (or a failover) replays. Returns {"closed": stream ids closed, "left_in_wal": stream ids
        whose tail stayed in the WAL, "fenced": stream ids another node took over (not closed
        here: their tail is in this WAL for that node to replay), "errors": messages, "retired":
        bool}; also logged as a warning."""
        if self._closed:
            return dict(closed=[], left_in_wal=[], fenced=[], errors=[], retired=False)
        if self.metrics is not None:
            self.metrics.unregister()
        deadline = time.monotonic() + (self.config.close_timeout if timeout is None else timeout)

        def remaining() -> float:
            return max(0.0, deadline - time.monotonic())

        errors: list[BaseException] = []
        closed: list[int] = []
        left: list[int] = []
        # Everything up at once first (one upload of the whole cache, not an object per stream):
        # the closes below then find no tail left and only mark their streams CLOSED.
        sealed = self._cache.seal(reason="shutdown")
        if sealed is not None:
            self._uploader.submit(sealed)
            try:
                self._uploader.wait_committed(sealed.block_id, remaining())
            except S3StreamError as e:
                log.warning("client of node %d: the last uploads before closing did not finish: %s", self.node_id, e)
        for addon in list(self._addons.values()):
            close_addon = getattr(addon, "close", None)
            if close_addon is not None:
                errors.extend(close_addon(remaining()))
        fenced: list[int] = []
        for stream in self.streams():
            if stream._state == Stream.FENCED:
                # Another node owns it now; its tail is in this WAL for that node's failover to
                # replay. Not closed here: say so.
                fenced.append(stream.stream_id)
                self._forget(stream)
                continue
            try:
                stream.close(remaining())
                closed.append(stream.stream_id)
            except (S3StreamError, TimeoutError) as e:
                errors.append(e)
                left.append(stream.stream_id)
        self._closed = True
        self._appends().refuse(StreamClosedError, f"the client of node {self.node_id} is closed")
        if self._reclaim_thread is not None:
            self._reclaim_thread.stop()
        sealed = self._cache.seal(reason="shutdown")
        if sealed is not None:
            self._uploader.submit(sealed)
        self._uploader.close(remaining())
        self._reader.close()
        self._reserver.shutdown(wait=True)
        self._wal.close()
        self._appends().stop_callbacks()
        self._callbacks.join()
        retired = False
        if retire and not left and not errors:
            try:
                self._meta.fence_node(self.node_id, failover=True)
                retired = True
            except S3StreamError as e:
                errors.append(e)
        self._close_owned()
        if errors:
            log.warning("client of node %d closed with errors: %s", self.node_id, errors)
        if left:
            log.warning("client of node %d: streams %s were not uploaded before close gave up; their data "
                        "stays in WAL %s and is replayed at the node's next start", self.node_id, left, self._wal.path)
        return dict(closed=closed, left_in_wal=left, fenced=fenced, errors=[str(e) for e in errors], retired=retired)

    def _close_owned(self) -> None:
        """Close the stores this client opened from URLs (not the ones it was handed), and let
        another instance of the node start on this host."""
        lock = getattr(self, "_host_lock", None)
        if lock is not None:
            lock.release()
        if self._owns_meta:
            self._meta.close()
        if self._owns_store:
            self._store.close()

    def __enter__(self) -> "StreamClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        path = self._appends()
        engine = dict(node_id=self.node_id, node_epoch=self.node_epoch, open_streams=len(self._streams),
                      uncommitted_bytes=path.uncommitted, cache=self._cache.stats(),
                      append=dict(path.stats(), admission_waits=self._admit_waits,
                                  admission_wait_seconds=self._admit_wait_ns / 1e9,
                                  tail_waits=self._tail_waits, tail_wait_seconds=self._tail_wait_ns / 1e9),
                      upload=self._uploader.stats_snapshot(),
                      # How late readers that are not nodes are: the oldest record not yet
                      # committed (0: none). Near upload_interval while uploads keep up.
                      visibility_lag_s=self._cache.lag() / 1e9,
                      read=self._reader.snapshot(), wal=self._wal.stats(),
                      lease=dict(remaining_seconds=self.lease_remaining, fenced=self._fenced))
        return dict(engine, **{name: source(engine) for name, source in list(self._stats_sources.items())})

    # ---- extension point for add-ons (compaction) -----------------------------------------------

    def add_stats_source(self, name: str, source: Callable[[dict], dict]) -> None:
        """Include `source(engine_stats)` under `name` in stats(): how an add-on such as
        compaction (which s3stream does not import) reports through the client."""
        if not name or name in self.stats().keys() - self._stats_sources.keys():
            raise ValueError(f"stats source name {name!r} is empty or taken by the engine")
        self._stats_sources[name] = source
