"""A reader that is not a node: committed records of any stream or partition, from any host.

`open_reader(metadata=URL, object_store=URL)` needs neither a WAL nor a node id: it registers
nothing, opens no stream and writes nothing, to metadata or to the store, so any number of
processes on any hosts can read while the streams' owners keep appending. It reads what is
committed to objects (what metadata names): a stream open on some node may hold acknowledged
records beyond that in its owner's WAL, readable here once they are uploaded.

- `fetch_committed(stream_id, start, end)`: as StreamClient.fetch_committed. A stream's committed
  range is read from metadata at most every RANGE_RECHECK seconds while fetches stay inside it (a
  catch-up reader would otherwise query metadata on every fetch, which a node never does: on
  PostgreSQL that query cost more than a 1 MiB fetch). Committed ranges only grow at the end, so
  such a fetch never returns an offset that is not committed; a trim or delete is seen within
  RANGE_RECHECK, or at once if the objects are gone (the read fails and metadata is asked).
- A partition's committed records: `s3stream.cluster.read_partition(reader, name)`.
- `tail(stream_id, start)`: every committed batch from `start` on, as it is committed. It waits
  on the metadata store's pushed changes where it has them (commits notify `commit/<stream id>`:
  PostgreSQL LISTEN/NOTIFY, SQLite between the processes of its host) and polls every
  `poll_interval` otherwise, and in any case at least that often.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Sequence

from .config import Config
from .errors import (ConfigError, CorruptDataError, InvalidArgumentError, ObjectNotFoundError, OffsetsLostError,
                     S3StreamError, StreamNotFoundError, check_int)
from .engine.logcache import new_log_cache
from .metadata import MetadataStore, StreamMeta, StreamState, commit_key, open_metadata
from .objectstore import ObjectStore, open_object_store
from .engine.readpath import Reader, fetch_end
from .batches import FetchedBatch, FetchResult

__all__ = ["StreamReader", "open_reader", "fetch_committed"]

#: Seconds a StreamReader serves fetches inside a stream's committed range as last read from
#: metadata before it reads the range again (module docstring).
RANGE_RECHECK = 1.0
#: Streams whose committed range a StreamReader remembers.
KNOWN_RANGES = 4096


def fetch_committed(meta: MetadataStore, reader: Reader, stream_id: int, start_offset: int,
                    end_offset: int | None, max_bytes: int, known: StreamMeta | None = None) -> FetchResult:
    """A stream's committed batches in [start_offset, end_offset) (default, and at most: its
    committed end), read through `reader` without opening the stream (StreamClient.fetch_committed's
    contract; the bounds are read.fetch_end's). `known`: the stream as the caller just read it
    from metadata (not read again)."""
    _check_fetch(stream_id, start_offset, end_offset, max_bytes)
    if known is not None and known.stream_id != stream_id:
        raise InvalidArgumentError(f"known describes stream {known.stream_id}, not {stream_id}")
    return _fetch_in(known or meta.get_stream(stream_id), reader, start_offset, end_offset, max_bytes)


def _check_fetch(stream_id: int, start_offset: int, end_offset: int | None, max_bytes: int) -> None:
    check_int("stream_id", stream_id)
    check_int("start_offset", start_offset)
    if end_offset is not None:
        check_int("end_offset", end_offset)
    check_int("max_bytes", max_bytes, minimum=1)


def _fetch_in(stream: StreamMeta, reader: Reader, start_offset: int, end_offset: int | None,
              max_bytes: int) -> FetchResult:
    """fetch_committed against `stream` as metadata described it."""
    stream_id = stream.stream_id
    if stream.state == StreamState.DELETED:
        raise StreamNotFoundError(f"stream {stream_id} was deleted")
    end = fetch_end(stream_id, start_offset, end_offset, stream.start_offset, stream.end_offset,
                    "its committed range")
    if start_offset == end:
        return FetchResult([])
    return FetchResult(reader.read(stream_id, start_offset, end, max_bytes, stream_end=stream.end_offset))


class StreamReader:
    """Committed records of any stream, read without being a node (module docstring).
    Thread-safe; close() it (or use it as a context manager) to stop its read-ahead threads."""

    def __init__(self, metadata: str | MetadataStore, object_store: str | ObjectStore,
                 config: Config | None = None) -> None:
        self.config = config or Config()
        if not isinstance(self.config, Config):
            raise ConfigError(f"config must be an s3stream.Config, got {type(self.config).__name__}")
        for name, value, kind in (("metadata", metadata, MetadataStore), ("object_store", object_store, ObjectStore)):
            if not isinstance(value, (str, kind)):
                raise ConfigError(f"{name} must be a URL or a {kind.__name__}, got {type(value).__name__} {value!r:.60}")
        self._owns_meta, self._owns_store = isinstance(metadata, str), isinstance(object_store, str)
        self._meta: MetadataStore = open_metadata(metadata) if isinstance(metadata, str) else metadata
        try:
            self._store: ObjectStore = (open_object_store(object_store) if isinstance(object_store, str)
                                        else object_store)
        except BaseException:
            if self._owns_meta:
                self._meta.close()
            raise
        # An empty log cache: this reader holds no un-uploaded data, so every read goes to objects.
        self._reader = Reader(self._store, self._meta, new_log_cache(self.config, time.monotonic_ns), self.config)
        self._closed = threading.Event()
        self._partitions: Any = None
        # stream id -> (its metadata, time.monotonic() when read): see RANGE_RECHECK.
        self._known: OrderedDict[int, tuple[StreamMeta, float]] = OrderedDict()
        self._known_lock = threading.Lock()

    @property
    def metadata(self) -> MetadataStore:
        """The metadata store read (shared: do not close it)."""
        return self._meta

    @property
    def object_store(self) -> ObjectStore:
        """The object store read (shared: do not close it)."""
        return self._store

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def stats(self) -> dict:
        return self._reader.snapshot()

    def check_usable(self) -> None:
        """Raise S3StreamError if this reader is closed."""
        if self._closed.is_set():
            raise S3StreamError("this reader is closed; open another with s3stream.open_reader")

    def fetch_committed(self, stream_id: int, start_offset: int, end_offset: int | None = None,
                        max_bytes: int = 1 << 20, known: StreamMeta | None = None) -> FetchResult:
        """Batches of the stream's committed records from the one holding `start_offset` towards
        `end_offset` (default, and at most: the committed end, as read from metadata at most
        RANGE_RECHECK seconds ago, or `known`: the stream as the caller just read it),
        up to `max_bytes` (at least one batch).
        StreamNotFoundError for a stream that does not exist or was deleted, OffsetOutOfRangeError
        for a start outside its committed range (s3stream.engine.readpath.fetch_end)."""
        self.check_usable()
        if known is not None:
            return fetch_committed(self._meta, self._reader, stream_id, start_offset, end_offset, max_bytes, known)
        _check_fetch(stream_id, start_offset, end_offset, max_bytes)
        with self._known_lock:
            seen = self._known.get(stream_id)
        if seen is not None and time.monotonic() - seen[1] < RANGE_RECHECK:
            stream = seen[0]
            # An end past the committed end as last read is capped there, as None is: what was
            # committed since is seen within RANGE_RECHECK, like the committed end itself.
            end = stream.end_offset if end_offset is None else min(end_offset, stream.end_offset)
            if stream.start_offset <= start_offset < end:
                try:
                    return _fetch_in(stream, self._reader, start_offset, end, max_bytes)
                except (CorruptDataError, ObjectNotFoundError, OffsetsLostError):
                    pass              # trimmed or deleted since, maybe: metadata says how
        return _fetch_in(self._stream(stream_id), self._reader, start_offset, end_offset, max_bytes)

    def fetch_committed_at(self, points: Sequence[tuple[int, int]]) -> dict[tuple[int, int], FetchedBatch]:
        """StreamClient.fetch_committed_at: the committed batch holding each (stream_id,
        offset) point, read together; those not found are absent."""
        self.check_usable()
        return self._reader.read_points(points)

    def _stream(self, stream_id: int) -> StreamMeta:
        """The stream's metadata, read now and remembered for fetch_committed."""
        read_at = time.monotonic()
        stream = self._meta.get_stream(stream_id)
        with self._known_lock:
            self._known[stream_id] = (stream, read_at)
            self._known.move_to_end(stream_id)
            if len(self._known) > KNOWN_RANGES:
                self._known.popitem(last=False)
        return stream

    def tail(self, stream_id: int, start_offset: int = 0, *, max_bytes: int = 1 << 20,
             poll_interval: float = 0.1, idle_timeout: float | None = None) -> Iterator[FetchedBatch]:
        """Every committed batch of the stream from the one holding `start_offset` on, in order,
        as commits make them readable; it ends when the reader closes, the stream is deleted
        (StreamNotFoundError), or no commit came for `idle_timeout` seconds (None: never).
        OffsetOutOfRangeError if the records it needs next were trimmed away."""
        check_int("start_offset", start_offset)
        if not poll_interval > 0:
            raise ConfigError(f"poll_interval must be positive seconds, got {poll_interval!r}")
        self.check_usable()
        feed = self._meta.kv_changes((commit_key(stream_id),))
        try:
            position = start_offset
            idle_since = time.monotonic()
            while not self._closed.is_set():
                end = self._stream(stream_id).end_offset
                if position < end:
                    result = self.fetch_committed(stream_id, position, end, max_bytes)
                    for batch in result.batches:
                        yield batch
                    position = result.end_offset if result.end_offset is not None else end
                    idle_since = time.monotonic()
                    continue
                if idle_timeout is not None and time.monotonic() - idle_since >= idle_timeout:
                    return
                wait = poll_interval if idle_timeout is None else min(
                    poll_interval, max(0.0, idle_timeout - (time.monotonic() - idle_since)))
                feed.wait(wait) if feed.pushes else self._closed.wait(wait)
        finally:
            feed.close()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._reader.close()
        if self._owns_store:
            self._store.close()
        if self._owns_meta:
            self._meta.close()

    def __enter__(self) -> "StreamReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_reader(metadata: str | MetadataStore, object_store: str | ObjectStore,
                config: Config | None = None) -> StreamReader:
    """A StreamReader on the cluster whose metadata and object store these are (URLs as
    StreamClient takes them, or open stores, which stay the caller's to close)."""
    return StreamReader(metadata, object_store, config)
