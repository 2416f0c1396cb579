"""Upload of sealed log-cache blocks: split, prepare, PUT, commit in block order, trim the WAL.

Per block:
1. plan (native, CacheBlock.plan): a stream with at least `split_size` bytes in the block
   becomes its own StreamObject; the other streams share one StreamSetObject;
2. prepare object ids in metadata (PREPARED, with expiry), on the uploader's thread in block
   order, so SSO ids rise with block order;
3. encode straight from the cache's buffers (native, without the GIL) and PUT, each object a
   task on the upload pool, retrying store errors with backoff;
4. once every PUT of the block returned and its WAL records are durable, commit everything in
   ONE metadata transaction, retried (a commit is idempotent);
5. mark the block committed in the cache and trim the WAL to the block's last record.

Steps 1-3 of up to `Config.upload_pipeline` blocks run at once (a slow PUT slows ingest only
once the cache bound is reached); commits (4-5) stay strictly in block order, so the WAL is
trimmed only below what is committed.

The encode-and-PUT threads run below the appenders: at `upload_nice`, and with `upload_idle`
under SCHED_IDLE while uploads keep up (`behind()` false), so an appender or the WAL writer that
wakes takes the core at once; behind, they return to `upload_nice` so a busy host cannot starve
them (see Config).

Failure rules: an object is committed only after its PUT returned; a failed PUT is retried, never
skipped; acknowledged data stays in the WAL until its commit, so a crash at any step loses
nothing (restart recovery uploads it again under fresh ids; the orphans of the first attempt stay
PREPARED and the lifecycle deletes them after expiry). A commit refused because a stream was
fenced drops that stream's ranges (it moved away; its new owner continues from the committed
end) and commits the rest; a fenced node stops uploading altogether.
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import tenacity

from _native.logcache import CacheBlock, CacheSlice, encode_slices

from .config import Config
from .errors import (
    MetadataBusyError, ObjectStoreError, ObjectStorePermanentError, OperationTimeoutError, S3StreamError,
    StreamFencedError,
)
from .metadata import (
    CommitRange, CommitRequest, CommitResult, CommitSSO, CommitStreamObject, MetadataStore, StreamState,
    object_key,
)
from .objectstore import ObjectStore
from .objectstore.base import PutData, data_size, write_requests

log = logging.getLogger("s3stream.upload")

#: Payloads of at least this many bytes are not copied into the object's buffer: the object is
#: written (LocalObjectStore: writev) or cut into parts (S3) straight from the log cache. perf on
#: 64 KiB records into 1,000 streams put that copy at 16% of the process's samples. Smaller
#: payloads are copied (one iovec each would cost more than the copy).
GATHER_MIN_BYTES = 8192


def _commit_range(s: CacheSlice) -> CommitRange:
    return CommitRange(s.stream_id, s.epoch, s.start_offset, s.end_offset)


@dataclass
class _InFlight:
    """A block whose objects are being encoded and PUT; each task's result is its commit entry."""
    block: CacheBlock
    puts: list[Future]

    def ready(self) -> bool:
        return all(f.done() for f in self.puts)


def _transient_store_error(e: BaseException) -> bool:
    """Worth retrying: the store failed (down, throttling, a timeout), not refused for good."""
    return isinstance(e, (ObjectStoreError, OSError)) and not isinstance(e, ObjectStorePermanentError)


def _transient_metadata_error(e: BaseException) -> bool:
    """Worth retrying: the metadata store was busy or unreachable (not a refusal: fenced, bad)."""
    return isinstance(e, (MetadataBusyError, OSError))


class UploadAborted(S3StreamError):
    """The client was closed or failed while a block was still being uploaded."""


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's nice value by `nice` (Linux, where each thread has its own;
    elsewhere, or if refused, the thread keeps the process's priority)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        log.debug("could not lower the priority of upload thread %s", threading.current_thread().name)


def set_thread_idle(idle: bool, tid: int = 0) -> bool:
    """Move thread `tid` of this process (0: the caller) into SCHED_IDLE (`idle`) or back to
    SCHED_OTHER, keeping its nice value. False if refused or not Linux: leaving SCHED_IDLE needs
    root, CAP_SYS_NICE or an RLIMIT_NICE that allows the thread's nice value (sched(7))."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        return False
    return True


def may_switch_idle(nice: int) -> bool:
    """Whether a thread at `nice` below the process may enter SCHED_IDLE and leave it again:
    probed by a round trip on a throwaway thread, so no thread is left stuck in SCHED_IDLE."""
    result = [False]

    def probe() -> None:
        lower_thread_priority(nice)
        result[0] = set_thread_idle(True) and set_thread_idle(False)

    thread = threading.Thread(target=probe, name="s3stream-sched-probe")
    thread.start()
    thread.join()
    return result[0]


class Uploader:
    """Uploads sealed blocks (see the module docstring). `wait_durable(wal_end)` blocks until
    the WAL holds everything before `wal_end` durably (raising if it never will); `trim_wal`,
    `on_committed` and `on_fenced` are the client's hooks, run on the uploader's thread."""

    def __init__(self, *, node_id: int, node_epoch: int, store: ObjectStore, metadata: MetadataStore,
                 cache, trim_wal: Callable[[int], None], config: Config,
                 on_committed: Callable[[CacheBlock, CommitResult], None],
                 on_fenced: Callable[[list[int] | None], None],
                 wait_durable: Callable[[int], None] = lambda end: None,
                 on_failure: Callable[[BaseException], None] = lambda e: None,
                 behind: Callable[[], bool] = lambda: True) -> None:
        self._node_id = node_id
        self._node_epoch = node_epoch
        self._store = store
        # The store's multipart settings, for the write requests S3 would bill (fixed per store).
        self._parts = (getattr(store, "part_size", None), getattr(store, "multipart_threshold", None))
        self._meta = metadata
        self._cache = cache
        self._trim_wal = trim_wal
        self._config = config
        self._on_committed = on_committed
        self._on_fenced = on_fenced
        self._wait_durable = wait_durable
        self._on_failure = on_failure
        self._cond = threading.Condition()
        self._queue: deque[CacheBlock] = deque()       # sealed, not started
        self._inflight: deque[_InFlight] = deque()     # started, not committed (block order)
        self._committed_id = -1          # highest block id committed (blocks commit in id order)
        self._failure: BaseException | None = None
        self._stopping = False
        self._aborted = False
        self._behind = behind
        self._tids: list[int] = []       # the pool's threads; guarded by _cond, as _idle
        self._idle = False
        self.idle_ok = config.upload_idle and may_switch_idle(config.upload_nice)
        if config.upload_idle and not self.idle_ok:
            log.info("upload threads stay at upload_nice: this process may not move a thread out of SCHED_IDLE "
                     "(that needs CAP_SYS_NICE or an RLIMIT_NICE allowing it)")
        self._pool = ThreadPoolExecutor(max_workers=config.upload_concurrency, thread_name_prefix="s3stream-put",
                                        initializer=self._init_thread)
        # One encode buffer per pool thread, reused: fresh memory per object would be faulted in
        # page by page, which costs more here than the copy into it.
        self._buffers: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        for _ in range(config.upload_concurrency):
            self._buffers.put(bytearray())
        # The latest error a retry loop met, (what, error), for messages about a full cache/WAL.
        self.last_retry_error: tuple[str, BaseException | None] | None = None
        self._thread = threading.Thread(target=self._run, name="s3stream-upload", daemon=True)
        # write_requests: what S3 bills for the committed objects' PUTs (multipart parts counted),
        # kept here because retention may delete the objects before anyone lists them.
        self.stats = dict(blocks=0, objects=0, stream_objects=0, stream_set_objects=0, bytes=0,
                          write_requests=0, put_retries=0, prepare_retries=0, commit_retries=0, max_inflight=0,
                          priority_switches=0)
        self._thread.start()

    # ---- queueing and waiting ------------------------------------------------------------------

    def submit(self, block: CacheBlock) -> None:
        with self._cond:
            self._queue.append(block)
            self._cond.notify_all()

    def wait_committed(self, block_id: int, timeout: float | None = None) -> None:
        """Block until block `block_id` (and every earlier one) is committed."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._committed_id >= block_id or self._failure is not None or self._aborted, timeout)
            if self._committed_id >= block_id:
                return
            if self._failure is not None:
                raise UploadAborted(f"uploads stopped: {self._failure}") from self._failure
            if self._aborted:
                raise UploadAborted("the client was closed before the upload finished")
            if not ok:
                raise OperationTimeoutError(f"block {block_id} not committed within {timeout} s; its data stays "
                                            "in the WAL and the log cache")

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    @property
    def pending_blocks(self) -> int:
        """Blocks sealed but not yet committed."""
        with self._cond:
            return len(self._queue) + len(self._inflight)

    def close(self, timeout: float | None = None) -> None:
        """Upload everything queued, then stop. On timeout, abort what is left (it stays in the
        WAL and is uploaded at the next start)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.abort()
            self._thread.join()
        self._pool.shutdown(wait=True)

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    # ---- the upload loop -------------------------------------------------------------------------

    def _next_step(self) -> str:
        """What the loop does next (condition held): start, commit, stop or wait."""
        if self._aborted or self._failure is not None:
            return "stop"
        if self._inflight and self._inflight[0].ready():
            return "commit"
        if self._queue and len(self._inflight) < self._config.upload_pipeline:
            return "start"
        if self._stopping and not self._queue and not self._inflight:
            return "stop"
        return "wait"

    def _run(self) -> None:
        while True:
            self._pace()
            with self._cond:
                if (step := self._next_step()) == "wait":
                    self._cond.wait()
                    continue
                if step == "stop":
                    return
                block = self._queue.popleft() if step == "start" else self._inflight[0].block
            try:
                if step == "start":
                    self._start(block)
                else:
                    self._finish(self._inflight[0])
            except BaseException as e:   # noqa: BLE001 - any failure stops uploads; data stays in the WAL
                if not isinstance(e, UploadAborted):
                    log.exception("upload of block %d failed; uploads stop", block.block_id)
                with self._cond:
                    self._failure = e
                    self._cond.notify_all()
                self._on_failure(e)
                return

    def _notify(self, _future=None) -> None:
        with self._cond:
            self._cond.notify_all()

    def _start(self, block: CacheBlock) -> None:
        """Plan, prepare ids (in block order) and hand encode + PUT of each object to the pool."""
        stream_set, stream_objects = block.plan(self._config.split_size)
        n = len(stream_objects) + (1 if stream_set else 0)
        ttl_ns = int(self._config.prepared_ttl * 1e9)
        ids = iter(self._retrying("prepare", _transient_metadata_error, "prepare_retries")(
            self._meta.prepare_objects, n, ttl_ns))
        job = _InFlight(block, [])
        if stream_set:
            ranges = tuple(_commit_range(s) for s in stream_set)
            job.puts.append(self._pool.submit(self._encode_and_put, next(ids), stream_set,
                                              lambda oid, size: CommitSSO(oid, size, ranges)))
        for s in stream_objects:
            job.puts.append(self._pool.submit(self._encode_and_put, next(ids), [s],
                                              lambda oid, size, r=_commit_range(s): CommitStreamObject(oid, size, r)))
        with self._cond:
            self._inflight.append(job)
            self.stats["max_inflight"] = max(self.stats["max_inflight"], len(self._inflight))
        for f in job.puts:
            f.add_done_callback(self._notify)

    def _init_thread(self) -> None:
        """Pool thread start: run `upload_nice` below the process, in the pool's current mode."""
        lower_thread_priority(self._config.upload_nice)
        with self._cond:
            self._tids.append(threading.get_native_id())
            if self._idle:
                set_thread_idle(True)

    def _pace(self) -> None:
        """Uploader thread, at every step: the pool's threads go into SCHED_IDLE while uploads
        keep up, and back to upload_nice at once when a sealed block waits for a pipeline slot,
        half of cache_size is uncommitted or the WAL is past wal_pressure (`behind`), even in
        the middle of a PUT."""
        if not self.idle_ok:
            return
        try:
            behind = bool(self._queue) or self._behind()
        except Exception:   # noqa: BLE001 - a hook's failure must not stop uploads: run at upload_nice
            log.debug("uploads_behind hook failed; upload threads leave SCHED_IDLE", exc_info=True)
            behind = True
        with self._cond:
            if behind != self._idle:
                return
            self._idle = not behind
            for tid in self._tids:
                set_thread_idle(self._idle, tid)
            self.stats["priority_switches"] += 1

    def _encode_and_put(self, object_id: int, slices: list, entry):
        """Pool task: encode `slices` into one object (in a reused buffer, payloads of
        GATHER_MIN_BYTES or more left where the cache holds them), PUT it; returns its commit
        entry."""
        buffer = self._buffers.get_nowait()        # never empty: one per pool thread
        try:
            data, _ = encode_slices(slices, self._config.object_block_size, buffer, GATHER_MIN_BYTES)
            with data:
                self._put(object_key(object_id), data)
                return entry(object_id, data_size(data))
        finally:
            self._buffers.put(buffer)

    def _finish(self, job: _InFlight) -> None:
        """Commit the head block (its PUTs are done), then trim the WAL below it."""
        entries = [f.result() for f in job.puts]      # re-raises a PUT that failed for good
        if self._aborted:
            raise UploadAborted("aborted before commit")
        block = job.block
        self._wait_durable(block.wal_end)
        sso = next((e for e in entries if isinstance(e, CommitSSO)), None)
        sos = tuple(e for e in entries if isinstance(e, CommitStreamObject))
        result = self._commit(CommitRequest(self._node_id, self._node_epoch, sso=sso, stream_objects=sos))
        self.stats["blocks"] += 1
        self.stats["objects"] += len(entries)
        self.stats["stream_objects"] += len(sos)
        self.stats["stream_set_objects"] += 1 if sso else 0
        self.stats["bytes"] += sum(e.size for e in entries)
        self.stats["write_requests"] += sum(write_requests(e.size, *self._parts) for e in entries)
        self._cache.mark_committed(block)
        self._on_committed(block, result)
        try:
            self._trim_wal(block.wal_end)
        except Exception:   # noqa: BLE001 - the WAL failing is reported by its own appends
            log.exception("WAL trim to %d failed", block.wal_end)
        with self._cond:
            self._inflight.popleft()
            self._committed_id = block.block_id
            self._cond.notify_all()

    def _retrying(self, what: str, retry_on: Callable[[BaseException], bool], counter: str) -> tenacity.Retrying:
        """Retry while `retry_on(error)` (transient errors), with backoff, until aborted (close
        past its timeout, or the client failing): never on a permanent error."""
        def before_sleep(state: tenacity.RetryCallState) -> None:
            self.stats[counter] += 1
            self.last_retry_error = (what, state.outcome.exception() if state.outcome else None)
            log.warning("%s failed (attempt %d), retrying: %s", what, state.attempt_number,
                        state.outcome.exception() if state.outcome else None)

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(retry_on),
            wait=tenacity.wait_exponential(multiplier=0.02, max=2.0),
            stop=lambda state: self._aborted,
            before_sleep=before_sleep,
            reraise=True,
        )

    def _put(self, key: str, data: PutData) -> None:
        self._retrying(f"PUT {key}", _transient_store_error, "put_retries")(self._store.put, key, data)

    def _commit(self, request: CommitRequest) -> CommitResult:
        commit = self._retrying("commit", _transient_metadata_error, "commit_retries")
        while True:
            try:
                return commit(self._meta.commit, request)
            except StreamFencedError:
                remaining = self._without_fenced(request)
                if remaining is None:
                    return CommitResult()
                request = remaining

    def _without_fenced(self, request: CommitRequest) -> CommitRequest | None:
        """Drop the ranges of streams that moved away; raise if this whole node is fenced."""
        node = self._meta.get_node(self._node_id)
        if node.node_epoch != self._node_epoch:
            self._on_fenced(None)
            raise StreamFencedError(
                f"node {self._node_id} epoch {self._node_epoch} was fenced (now {node.node_epoch}); "
                "it stops uploading: its WAL is recovered by failover")
        fenced = set()
        for r in request.all_ranges():
            m = self._meta.get_stream(r.stream_id)
            if m.state == StreamState.DELETED:
                continue
            if m.epoch != r.epoch or m.owner_node_id != self._node_id or m.state != StreamState.OPENED:
                fenced.add(r.stream_id)
        if not fenced:
            raise StreamFencedError("commit was fenced but no fenced stream was found")
        log.warning("streams %s were fenced: their uncommitted data is dropped", sorted(fenced))
        self._on_fenced(sorted(fenced))
        sso = request.sso
        if sso is not None:
            ranges = tuple(r for r in sso.ranges if r.stream_id not in fenced)
            sso = CommitSSO(sso.object_id, sso.size, ranges) if ranges else None
        sos = tuple(so for so in request.stream_objects if so.range.stream_id not in fenced)
        if sso is None and not sos:
            return None
        return CommitRequest(request.node_id, request.node_epoch, sso=sso, stream_objects=sos)
