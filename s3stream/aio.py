"""s3stream for asyncio: AsyncStreamClient, AsyncStream (AsyncPartition: s3stream.cluster.aio).

    async with AsyncStreamClient(1, "/data/wal", "file:///data/objects", "sqlite:////data/meta.db") as client:
        async with await client.create_stream() as stream:
            offset = (await stream.append(RecordBatch(b"..."))).base_offset
            batches = (await stream.fetch(offset)).batches

Completion. An append is the engine's native call, made on the loop (microseconds, no thread).
Its acknowledgement reaches the loop through one `add_done_callback` on the engine's callback
thread, which queues the settled append and wakes the loop with `call_soon_threadsafe` once per
burst (the callback thread settles appends in WAL-order bursts; one wake-up then settles them
all). No concurrent.futures.Future, no thread per call. `append_nowait` returns the asyncio
Future itself, for pipelining: appends complete in offset order per stream.

Blocking calls (starting and closing the client, open/create/close/trim of streams, fetches
that read objects) run in one bounded executor owned by the client, `executor_threads` threads
(default 4): enough for a few object reads and a close at once; more wait their turn. A fetch
the log cache can serve (the tail, where a consumer that keeps up reads) is a memory copy done
inline (Stream.fetch_cached). Starting the client (WAL recovery, registration) may take seconds:
it runs on the executor too.

Backpressure: like the sync append, an append blocks (here: the loop) while the node's
un-uploaded data exceeds Config.cache_size or the WAL is full, up to append_timeout /
the WAL's full_timeout, then raises WALFullError (from append_nowait). Size cache_size and the WAL so that this stays
exceptional.

Cancellation. Cancelling `await stream.append(...)` does not un-append: the record already has
its offset and becomes durable (or fails) as any other; the cancelled caller only stops waiting,
and the stream takes later appends as usual (a task cancelled before it ran never appended).
An append whose await returned is acknowledged:
readable after close and reopen, like a sync append's result(). A cancelled fetch or trim still
queued is dropped; one already running finishes in the background, its result discarded. A
cancelled close (of a stream, a partition or the client) keeps running in the background: a
later close awaits the same one. Nothing is left waiting on the loop either way.

Errors are the sync API's (S3StreamError subclasses), raised from the await; an append refused
at once (closed or fenced stream, invalid batch) raises from `append_nowait` itself.

Throughput: `python tests/bench/aio_throughput.py --seconds 3 --rounds 4`, one stream, 100-byte
batches, local store, SQLite, on a 2-core VM shared with other work (medians of 4 rounds that
varied by up to 2x; indicative):

    sync append().result() loop ................................   5,700 appends/s
    await stream.append() loop .................................   4,100 appends/s
    sync append, 256 pending ................................... 590,000 appends/s
    append_nowait, 256 pending, one wake-up per burst (this) ... 176,000 appends/s
    append_nowait, 256 pending, call_soon_threadsafe per append  145,000 appends/s
    AppendFuture's own __await__ (wrap_future), 256 pending ....  32,000 appends/s
    fetch of 100 cached records: inline 29,000/s, on the executor 13,800/s

One at a time, an await pays two thread hops (WAL writer -> callback thread -> loop) where a
blocking result() pays one. Pipelined, an append costs about 6 us in all (the sync pipeline's,
under 2 us): the callback's registration, its run on the callback thread, the asyncio Future.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable
from typing import Any, Callable, TypeVar

from .client import StreamClient
from .config import Config
from .metadata import MetadataStore
from .objectstore import ObjectStore
from .records.producers import Producer, new_producer
from .batches import AppendFuture, AppendResult, FetchResult, RecordBatch, records_batch
from .records import Record
from .stream import Stream

__all__ = ["DEFAULT_EXECUTOR_THREADS", "AsyncStream", "AsyncStreamClient"]

log = logging.getLogger("s3stream.aio")

#: Threads of an AsyncStreamClient's executor unless given: the blocking calls it runs wait on
#: I/O (object GETs, metadata, fsync), so a few threads serve a loop's concurrent ones.
DEFAULT_EXECUTOR_THREADS = 4

T = TypeVar("T")


class _Settler:
    """Moves settled appends from the engine's callback thread to one event loop, waking the
    loop once per burst of callbacks rather than once per append."""

    __slots__ = ("_loop", "_ready", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ready: collections.deque = collections.deque()
        self._scheduled = False

    def watch(self, handle: AppendFuture) -> "asyncio.Future[AppendResult]":
        """An asyncio Future of this loop settled like `handle`."""
        future = self._loop.create_future()
        handle.add_done_callback(functools.partial(self._settled, future))
        return future

    def _settled(self, future: asyncio.Future, handle: AppendFuture) -> None:
        # Callback thread. The flag is read after the append to the queue and cleared by the
        # loop before it drains: an entry is never left queued without a wake-up on its way.
        self._ready.append((future, handle))
        if not self._scheduled:
            self._scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:
                pass                  # the loop is closed: nobody can be waiting on it

    def _drain(self) -> None:
        self._scheduled = False
        ready = self._ready
        while ready:
            future, handle = ready.popleft()
            if future.done():
                continue              # cancelled: the caller stopped waiting; the append stands
            try:
                future.set_result(handle.result(0))
            except Exception as e:
                future.set_exception(e)

    @property
    def idle(self) -> bool:
        """Nothing queued for the loop (for tests)."""
        return not self._ready and not self._scheduled


def _retrieve(future: asyncio.Future) -> None:
    """Done callback of work that outlives a cancelled await (a start, a close): its error is
    kept for the next call, which awaits the same future; asyncio need not report it."""
    if not future.cancelled() and future.exception() is not None:
        log.debug("background start or close ended with an error", exc_info=future.exception())


class AsyncStreamClient:
    """StreamClient for asyncio code: its arguments, plus `executor_threads` (the size of the one
    executor that runs this client's blocking calls, DEFAULT_EXECUTOR_THREADS). Nothing blocks in
    the constructor: the StreamClient is built on the executor by `start()` (or `async with`,
    or the first call that needs it). `AsyncStreamClient.wrap(client)` takes over a running
    StreamClient instead. The client belongs to the event loop it started on."""

    def __init__(self, node_id: int, wal_path: str | os.PathLike, object_store: str | ObjectStore,
                 metadata: str | MetadataStore, config: Config | None = None, *,
                 executor_threads: int = DEFAULT_EXECUTOR_THREADS, **client_kwargs: Any) -> None:
        self._make: Callable[[], StreamClient] | None = functools.partial(
            StreamClient, node_id, wal_path, object_store, metadata, config, **client_kwargs)
        self._client: StreamClient | None = None
        self._executor = ThreadPoolExecutor(executor_threads, thread_name_prefix="s3stream-aio")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._settler: _Settler | None = None
        self._starting: asyncio.Future | None = None
        self._closing: asyncio.Future | None = None

    @classmethod
    def wrap(cls, client: StreamClient, *, executor_threads: int = DEFAULT_EXECUTOR_THREADS) -> "AsyncStreamClient":
        """An async face over a running StreamClient; closing it closes `client`."""
        self = cls.__new__(cls)
        self._make = None
        self._client = client
        self._executor = ThreadPoolExecutor(executor_threads, thread_name_prefix="s3stream-aio")
        self._loop = self._settler = self._starting = self._closing = None
        return self

    @property
    def client(self) -> StreamClient:
        """The StreamClient underneath (started)."""
        if self._client is None:
            raise RuntimeError("the AsyncStreamClient is not started: await client.start() or use async with")
        return self._client

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._settler = _Settler(loop)
        elif loop is not self._loop:
            raise RuntimeError("this AsyncStreamClient belongs to another event loop")
        return loop

    def watch_append(self, append: Callable[[], AppendFuture], what: str = "append_nowait") -> "asyncio.Future[AppendResult]":
        """Call `append` (an engine append, returning its AppendFuture) and return an asyncio
        Future of it, settled on this client's loop: how AsyncStream and the cluster layer's
        AsyncPartition await appends without a thread per call. On another loop, RuntimeError
        naming `what`, before anything is appended."""
        settler = self._settler
        if settler is None or asyncio.get_running_loop() is not self._loop:
            raise RuntimeError(f"{what} must be called on the AsyncStreamClient's event loop")
        return settler.watch(append())

    async def start(self) -> "AsyncStreamClient":
        """Build the StreamClient (WAL recovery, registration) on the executor; once."""
        loop = self._bind_loop()
        if self._client is None:
            if self._closing is not None:
                raise RuntimeError("this AsyncStreamClient was closed before it started")
            if self._starting is None:
                make = self._make
                assert make is not None, "only a wrapped client has no factory, and it has its client"
                # Shielded: a cancelled start still finishes, and close() then closes it.
                self._starting = loop.run_in_executor(self._executor, make)
                self._starting.add_done_callback(_retrieve)
            self._client = await asyncio.shield(self._starting)
        return self

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking call on the executor (cancelling drops it if still queued)."""
        # Binds the loop on first use: a wrapped client has its StreamClient without start().
        loop = self._bind_loop()
        if self._client is None:
            await self.start()
        if self._closing is not None and self._closing.done():
            # The client is closed and its executor gone: every call only raises why (a closed
            # stream, a closed client), at once, as the sync API does.
            return fn(*args)
        return await loop.run_in_executor(self._executor, fn, *args)

    def run_to_end(self, fn: Callable[..., T], *args: Any) -> "asyncio.Future[T]":
        """Start a blocking call on the executor that runs to its end even if its caller is
        cancelled (closes); the caller awaits it through asyncio.shield."""
        loop = self._bind_loop()
        future: asyncio.Future[T]
        if self._closing is not None and self._closing.done():
            future = loop.create_future()
            try:
                future.set_result(fn(*args))
            except Exception as e:
                future.set_exception(e)
        else:
            future = loop.run_in_executor(self._executor, fn, *args)
        future.add_done_callback(_retrieve)
        return future

    # ---- streams and partitions ------------------------------------------------------------

    async def create_stream(self) -> "AsyncStream":
        """A new stream, opened by this node (StreamClient.create_stream)."""
        return AsyncStream(self, await self.run(lambda: self.client.create_stream()))

    async def open_stream(self, stream_id: int) -> "AsyncStream":
        """Open an existing stream on this node (StreamClient.open_stream)."""
        return AsyncStream(self, await self.run(lambda: self.client.open_stream(stream_id)))

    async def new_producer(self, producer_id: int | None = None) -> Producer:
        """s3stream.new_producer on this client's metadata, on the executor."""
        return await self.run(new_producer, self.client, producer_id)

    # ---- close --------------------------------------------------------------------------------

    async def close(self, timeout: float | None = None, retire: bool = False) -> dict:
        """StreamClient.close on the executor, then the executor's shutdown. Once: a second
        call (or one after a cancelled close) awaits the first."""
        if self._closing is None:
            self._bind_loop()
            self._closing = asyncio.ensure_future(self._close(timeout, retire))
            self._closing.add_done_callback(_retrieve)
        return await asyncio.shield(self._closing)

    async def _close(self, timeout: float | None, retire: bool) -> dict:
        try:
            client = self._client
            if client is None and self._starting is not None:
                try:
                    client = await self._starting
                except Exception:
                    return {}          # it never started: start() raised why
            if client is None:
                return {}
            # This task runs on the client's loop (close() bound it).
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, functools.partial(client.close, timeout, retire))
        finally:
            # Cancelled fetches may still run: they finish, then the threads exit.
            self._executor.shutdown(wait=False)

    async def __aenter__(self) -> "AsyncStreamClient":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class AsyncStream:
    """A Stream (see s3stream.stream) for asyncio code. Offsets and ids are the Stream's
    (`stream.stream_id`, `confirm_offset`, ... are read without blocking); `sync` is the Stream."""

    def __init__(self, client: AsyncStreamClient, stream: Stream) -> None:
        self._client = client
        self.sync = stream
        self._closing: asyncio.Future | None = None

    stream_id = property(lambda self: self.sync.stream_id)
    epoch = property(lambda self: self.sync.epoch)
    start_offset = property(lambda self: self.sync.start_offset)
    next_offset = property(lambda self: self.sync.next_offset)
    confirm_offset = property(lambda self: self.sync.confirm_offset)
    committed_offset = property(lambda self: self.sync.committed_offset)
    is_open = property(lambda self: self.sync.is_open)

    def append_nowait(self, batch: RecordBatch) -> "asyncio.Future[AppendResult]":
        """Append now (one native call); the Future completes on this loop once the batch is
        durable, or with the error why it never will be. Raises at once for an invalid batch or
        a closed or fenced stream. Call it from the client's loop."""
        return self._client.watch_append(lambda: self.sync.append(batch))

    async def append(self, batch: RecordBatch) -> AppendResult:
        """Append and wait until durable. Cancelling the wait does not undo the append (see the
        module docstring)."""
        return await self.append_nowait(batch)

    async def append_records(self, records: Iterable[Record], *, compression: str | None = None) -> AppendResult:
        """Stream.append_records (one Kafka record batch, one offset per record), awaited."""
        return await self.append_nowait(records_batch(records, compression))

    async def fetch(self, start_offset: int, end_offset: int | None = None, max_bytes: int = 1 << 20) -> FetchResult:
        """Stream.fetch: inline when the log cache serves it, else on the executor."""
        cached = self.sync.fetch_cached(start_offset, end_offset, max_bytes)
        if cached is not None:
            return cached
        return await self._client.run(self.sync.fetch, start_offset, end_offset, max_bytes)

    async def trim(self, new_start_offset: int) -> None:
        """Stream.trim (a metadata write) on the executor."""
        await self._client.run(self.sync.trim, new_start_offset)

    async def close(self, timeout: float | None = None) -> None:
        """Stream.close on the executor, to its end even if this await is cancelled; a second
        call awaits the first."""
        if self._closing is None:
            self._closing = self._client.run_to_end(self.sync.close, timeout)
        await asyncio.shield(self._closing)

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._closing is not None or self.sync.is_open:
            await self.close()

    def __repr__(self) -> str:
        return f"<AsyncStream {self.sync!r}>"
