"""Upload of sealed log-cache blocks: split, prepare, PUT, commit in block order, trim the WAL.

Per block:
1. plan (native, CacheBlock.plan): a stream with at least `split_size` bytes in the block
   becomes its own StreamObject; the other streams share one StreamSetObject (every slice of a
   block a cut sealed is its own StreamObject: uploadpolicy.plan_split, which also lists why
   blocks are sealed);
2. prepare object ids in metadata (PREPARED, with expiry), on the uploader's thread in block
   order, so SSO ids rise with block order: BLOCK_IDS_AHEAD at a time, so that most blocks
   take theirs from those prepared ahead and their one metadata transaction is the commit;
3. encode straight from the cache's buffers (native, without the GIL) and PUT, each object a
   task on the upload pool, retrying store errors with backoff;
4. once every PUT of the block returned and its WAL records are durable, commit everything in
   ONE metadata transaction, retried (a commit is idempotent);
5. mark the block committed in the cache and trim the WAL to the block's last record, or to
   the oldest record of a later block still to commit if lower (LogCache.trim_point: a cut
   moves slices on into the next block).

Steps 1-3 of up to `Config.upload_pipeline` blocks (or more, smaller ones, within as many blocks of
`upload_threshold` bytes: _pipeline_has_room) run at once (a slow PUT slows ingest only
once the cache bound is reached); commits (4-5) stay strictly in block order, so the WAL is
trimmed only below what is committed.

A close goes first (`upload_and_close`, on the closing caller's thread, not the pool's): it
uploads only the closing streams' un-uploaded tails, their slices in every uncommitted block, as
one StreamObject per run of slices not PUT already (a slice whose StreamObject a block in flight
has PUT, or PUTs within about a PUT's time, is reused: _reusable_puts), and commits them with the streams' close in ONE metadata
transaction, without waiting for older blocks. Commits are serialised by a gate (a block's, or a
close's, one at a time), which keeps a tail and a block from committing the same offsets: a
close whose tail was partly committed by a block during its PUT uploads again while holding the
gate. Once a close committed, the blocks holding its streams' slices leave them out (not
uploaded if not yet planned, their ranges dropped from the commit if already PUT); the WAL is
trimmed in block order as before, and recovery skips records below a stream's committed end.

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

Every transient fault ends: only PERMANENT_ERRORS stop uploads. Any other error of a step (plan,
prepare, encode, PUT, the wait for the WAL to be durable, commit) is retried with backoff (20 ms
doubling to RETRY_BACKOFF_CAP, jittered) until it succeeds or the client closes, whatever its
type: a store that timed out, a metadata store that was unreachable, but also an error nobody
expected (a BufferError, a RuntimeError), which is counted apart (`unexpected_retries`). Each
retry is counted per step in `stats` (`<step>_retries`); the failures of an episode (from the
first failure while none is being retried until every failing step succeeded) are logged once:
a WARNING at the first, an INFO with the retries and seconds once they recovered. Retrying is
safe at every step: a PUT that failed after the object landed writes the same bytes under the
same key again; a commit is idempotent; the PUTs of an object re-encode it only if the encoding
(or something other than the store) failed, into the same bytes. A block whose object ids expired
(prepared_ttl) while its steps were failing is uploaded again under fresh ids.
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, TypeVar

from _native.logcache import CacheBlock, CacheSlice, encode_slices

from ..config import Config
from ..errors import (
    MetadataError, ObjectStoreError, ObjectStorePermanentError, OperationTimeoutError, S3StreamError,
    StreamFencedError,
)
from ..metadata import (
    CommitRange, CommitRequest, CommitResult, CommitSSO, CommitStreamObject, MetadataStore, StreamState,
    object_key,
)
from ..objectstore import ObjectStore
from ..objectstore.base import PutData, cpu_bound_puts, data_size, write_requests
from ..threads import thread_nice
from .uploadpolicy import plan_split

log = logging.getLogger("s3stream.upload")

#: Payloads of at least this many bytes are not copied into the object's buffer: the object is
#: written (LocalObjectStore: writev) or cut into parts (S3) straight from the log cache. perf on
#: 64 KiB records into 1,000 streams put that copy at 16% of the process's samples. Smaller
#: payloads are copied (one iovec each would cost more than the copy).
GATHER_MIN_BYTES = 8192


def _commit_range(s: CacheSlice) -> CommitRange:
    return CommitRange(s.stream_id, s.epoch, s.start_offset, s.end_offset)


T = TypeVar("T")

#: The first wait between two attempts of a failing step; it doubles at each failure up to
#: RETRY_BACKOFF_CAP and is jittered (half of it to all of it), so the steps that failed together
#: do not retry in lockstep.
RETRY_BACKOFF_FIRST = 0.02
#: The longest wait between two attempts: a step that failed through an outage tries again within
#: this once the store answers (plus the time its attempt in flight takes: for S3, the botocore
#: client's own timeouts and retries, see S3ObjectStore).
RETRY_BACKOFF_CAP = 0.5

#: Object ids prepared ahead for closes (topped up when half are used), so that a close commits
#: without a prepare transaction of its own. Unused ones expire as PREPARED (prepared_ttl) and
#: the reclaimer removes them; a clean shutdown removes them at once.
CLOSE_SPARE_IDS = 8
#: Object ids prepared ahead for blocks, in the same pool: a block's prepare asks for this many
#: more, so that the next blocks take theirs without a transaction. At the 2 MiB stream tail
#: limit and 100 MB/s a node uploads about 50 objects a second; one transaction each for their
#: ids was a third of the node's metadata work (PostgreSQL, py-spy) beside their commits.
BLOCK_IDS_AHEAD = 16
#: The longest a block's commit waits for the closes that announced themselves (a close goes
#: first: from its start, blocks do not take the commit gate, so that the close finds it free
#: when its PUTs are done); past it the block takes the gate in turn as before.
CLOSE_PRIORITY_MAX_WAIT = 1.0
#: How long the queue's head may wait for an older sealed block to be submitted before that is
#: logged (Uploader._head_in_order; the window between a seal and its submit is microseconds).
OUT_OF_ORDER_WARN_S = 5.0

#: At most this many times upload_pipeline blocks in flight, however small (_pipeline_has_room).
PIPELINE_BLOCKS_MAX = 4

#: How long a close waits for a running PUT of its tail before it has seen any PUT's latency.
REUSE_WAIT_FIRST = 0.05

#: Steps whose failures are retried, each counted in `Uploader.stats` as "<step>_retries".
RETRY_STEPS = ("plan", "prepare", "encode", "put", "durable", "commit")


class _CommitGate:
    """One metadata commit at a time, a block's or a close's, and closes first. A close
    announces itself when it starts (`close_coming`); a block's commit that reaches the gate
    after that waits for it (`for_block`, up to `max_wait`), so that the close, once its PUTs are
    done, finds the gate free instead of waiting for a block's commit that started meanwhile
    (measured at half load on PostgreSQL: up to 14 ms). A block waits only for the closes
    announced before it reached the gate: closes one after another cannot starve the blocks.
    The blocks' commits wait instead; the producers do not."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._announced = 0              # closes announced so far (a close's ticket: its number)
        self._pending: set[int] = set()  # tickets of the closes announced and not ended

    def acquire(self, timeout: float = -1) -> bool:
        """Take it (a close's way: closes do not wait for each other's announcement); False if
        it stayed taken for `timeout` seconds (-1: no bound)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._held, None if timeout < 0 else timeout):
                return False
            self._held = True
            return True

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def for_block(self, max_wait: float) -> Iterator[None]:
        """Held for a block's commit: taken once the closes announced before now have ended,
        or after `max_wait` seconds, whichever comes first."""
        with self._cond:
            arrived = self._announced
            self._cond.wait_for(lambda: not any(t < arrived for t in self._pending), max_wait)
            self._cond.wait_for(lambda: not self._held)
            self._held = True
        try:
            yield
        finally:
            self.release()

    @contextlib.contextmanager
    def close_coming(self) -> Iterator[None]:
        with self._cond:
            ticket = self._announced
            self._announced += 1
            self._pending.add(ticket)
        try:
            yield
        finally:
            with self._cond:
                self._pending.discard(ticket)
                self._cond.notify_all()


@dataclass
class _InFlight:
    """A block whose objects are being encoded and PUT; each task's result is its commit entry.
    `prepared_at` (the uploader's clock): when its object ids were prepared."""
    block: CacheBlock
    puts: list[Future]
    prepared_at: float = 0.0

    def ready(self) -> bool:
        return all(f.done() for f in self.puts)


class UploadAborted(S3StreamError):
    """The client was closed or failed while a block was still being uploaded."""


class _PreparedExpired(Exception):
    """A block's commit was refused after its object ids' prepared_ttl had passed: upload it again."""


#: The errors that stop uploads for good; every other error of an upload step is retried:
#: - ObjectStorePermanentError: the store refused in a way no retry can fix (S3: AccessDenied,
#:   NoSuchBucket, InvalidAccessKeyId, SignatureDoesNotMatch..., objectstore.s3.PERMANENT_CODES; a
#:   local directory not writable or on a read-only file system);
#: - StreamFencedError from a commit once the node itself is fenced (a stream that moved away only
#:   drops its ranges: the rest is committed and uploads go on);
#: - UploadAborted: the client closed past its timeout, or stopped (fenced).
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (ObjectStorePermanentError, StreamFencedError, UploadAborted)
# What a retry loop lets through: the permanent errors, and an expiry the block's upload handles.
_NOT_RETRIED = PERMANENT_ERRORS + (_PreparedExpired,)


class _EncodeBuffers:
    """The pool threads' encode buffers, one per thread: `get` gives one that holds memory if any
    is idle (the last returned), `put` keeps at most `keep` idle buffers that hold memory (the rest are let go
    and replaced by empty ones): put_concurrency threads, upload_concurrency buffers' memory."""

    def __init__(self, count: int, keep: int) -> None:
        self._idle = [bytearray() for _ in range(count)]
        self._keep = keep
        self._lock = threading.Lock()

    def get(self) -> bytearray:
        with self._lock:                    # never empty: one per pool thread
            for i in range(len(self._idle) - 1, -1, -1):
                if len(self._idle[i]):
                    return self._idle.pop(i)
            return self._idle.pop()

    def put(self, buffer: bytearray) -> None:
        with self._lock:
            if len(buffer) and sum(1 for b in self._idle if len(b)) >= self._keep:
                buffer = bytearray()
            self._idle.append(buffer)


def _unexpected(error: BaseException) -> bool:
    """An error the upload steps do not raise on purpose (not a store, metadata or WAL error, nor
    an OSError): retried all the same, counted apart and logged with its traceback."""
    return not isinstance(error, (S3StreamError, OSError))


def _without_traceback(error: BaseException) -> BaseException:
    """`error` (and its causes) without their tracebacks, to be kept for messages: a traceback
    keeps every frame it passed through alive, with their locals (views of reused encode buffers
    among them). Only for an error that is handled, never raised again."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        pending += [e.__cause__, e.__context__]
    return error


def _release(data) -> None:
    """Let go of an encoded object (a view of an encode buffer, or a GatheredObject)."""
    try:
        data.release()
    except (AttributeError, BufferError, ValueError):
        pass    # bytes; or a view still exported: the buffer is then replaced (_return_buffer)


def _exported(buffer: bytearray) -> bool:
    """Whether a view of `buffer` is alive somewhere: it cannot be resized then."""
    try:
        buffer.append(0)
    except BufferError:
        return True
    del buffer[-1]
    return False


class RetryEpisode(NamedTuple):
    """Upload steps failing now and being retried (`Uploader.retrying`): what failed last and
    its error (without traceback), seconds since the episode's first failure, retries so far."""
    what: str
    error: BaseException
    seconds: float
    retries: int


def lower_thread_priority(nice: int) -> None:
    """Run the calling thread `nice` steps below the process (its nice value the process's plus
    `nice`, whichever thread started it: s3stream.threads; elsewhere than Linux, or if refused,
    it keeps its priority)."""
    thread_nice(max(0, nice))


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
    the WAL holds everything before `wal_end` durably (raising if it does not in time); `trim_wal`,
    `on_committed` and `on_fenced` are the client's hooks, run on the uploader's thread. `clock`
    (seconds) times retry episodes and the age of prepared object ids; `rng` jitters backoffs.

    `stats` counts, besides what was uploaded: the retries of each step ("<step>_retries" for
    RETRY_STEPS), those of unexpected errors ("unexpected_retries"), the episodes of failures
    ("retry_episodes"), the steps failing now ("retrying"), blocks uploaded again because their
    object ids expired ("expired_reuploads") and encode buffers replaced because a view of them
    outlived its object ("encode_buffers_replaced")."""

    def __init__(self, *, node_id: int, node_epoch: int, store: ObjectStore, metadata: MetadataStore,
                 cache, trim_wal: Callable[[int], None], config: Config,
                 on_committed: Callable[[CacheBlock, CommitResult], None],
                 on_fenced: Callable[[list[int] | None], None],
                 wait_durable: Callable[[int], None] = lambda end: None,
                 on_failure: Callable[[BaseException], None] = lambda e: None,
                 behind: Callable[[], bool] = lambda: True,
                 clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
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
        self._queue: deque[CacheBlock] = deque()       # sealed, not started (block id order)
        self._last_started: int | None = None            # the id of the block started last
        self._out_of_order_since: float | None = None    # the queue's head waits for an older block
        self._inflight: deque[_InFlight] = deque()     # started, not committed (block order)
        self._starting: CacheBlock | None = None      # taken from the queue, not yet in flight
        self._committed_id = -1          # highest block id committed (blocks commit in id order)
        # One metadata commit at a time, a block's or a close's (see the module docstring);
        # closes go first.
        self._gate = _CommitGate()
        # Tails uploaded by a close: (stream id, epoch) -> its end offset, kept while a block
        # still to commit holds a slice of it; blocks leave those slices out. Written under the
        # gate; read by the planner without it (an entry exists only once committed).
        self._closed_tails: dict[tuple[int, int], int] = {}
        # The StreamObject PUT of each slice of a block in flight (id of the slice -> (slice,
        # its PUT's future)), so that a close commits what was PUT already rather than PUT
        # those bytes again (_reusable_puts). Guarded by _cond.
        self._slice_puts: dict[int, tuple[CacheSlice, Future]] = {}
        # Seconds of the last PUTs of the pool (successful ones): how long a close waits for a
        # running PUT of its tail before it PUTs those bytes itself.
        self._put_seconds: deque[float] = deque(maxlen=100)
        # Called (on a pool thread) as each StreamObject's PUT of a block ends: the client wakes
        # appends waiting for their stream's tail to be PUT.
        self.on_put: Callable[[Future | None], None] | None = None   # a StreamObject's PUT started or ended
        # Object ids prepared ahead for closes, (id, prepared at), so that a close's one metadata
        # transaction is its commit: topped up by the blocks' own prepare calls (no extra
        # transaction) and by a close that finds too few; used within half of prepared_ttl.
        self._spare_ids: deque[tuple[int, float]] = deque()
        self._spare_lock = threading.Lock()
        self._close_prepares = 0         # closes that found no spare id (guarded by _spare_lock)
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
        # put_concurrency threads PUT (mostly waiting on the store), upload_concurrency of them
        # encode at a time (the CPU part). A store whose PUT is a copy on our cores (a local
        # directory) gets no more PUTs than encoders: more would only take cores from appends.
        puts = config.upload_concurrency if cpu_bound_puts(store) else max(
            config.put_concurrency or 0, config.upload_concurrency)
        self._pool = ThreadPoolExecutor(max_workers=puts, thread_name_prefix="s3stream-put",
                                        initializer=self._init_thread)
        self._encode_slots = threading.BoundedSemaphore(config.upload_concurrency)
        # One encode buffer per pool thread, reused: fresh memory per object would be faulted in
        # page by page, which costs more here than the copy into it. Idle, at most
        # upload_concurrency of them keep their memory (_return_buffer).
        self._buffers = _EncodeBuffers(puts, keep=config.upload_concurrency)
        self._clock = clock
        self._rng = rng or random.Random()
        # Retry episodes (guarded by _retry_lock, as the retry counters of stats): the steps
        # failing now, when the episode's first failure was, and its retries so far.
        self._retry_lock = threading.Lock()
        self._failing = 0
        self._episode_start: float | None = None
        self._episode_retries = 0
        # The latest error a retry loop met in the current episode, (what, error without its
        # traceback), for messages about a full cache/WAL; None once every step recovered.
        self.last_retry_error: tuple[str, BaseException | None] | None = None
        self._thread = threading.Thread(target=self._run, name="s3stream-upload", daemon=True)
        # write_requests: what S3 bills for the committed objects' PUTs (multipart parts counted),
        # kept here because retention may delete the objects before anyone lists them.
        self.stats: dict[str, Any] = dict(blocks=0, objects=0, stream_objects=0, stream_set_objects=0, bytes=0,
                          write_requests=0, max_inflight=0, priority_switches=0,
                          **{f"{step}_retries": 0 for step in RETRY_STEPS},
                          unexpected_retries=0, retry_episodes=0, retrying=0, expired_reuploads=0,
                          encode_buffers_replaced=0, closes=0, close_objects=0, close_bytes=0,
                          close_conflicts=0, closed_tail_bytes_skipped=0, close_objects_reused=0,
                          # per trigger (why its block was sealed: CacheBlock.sealed_by, or
                          # "close" for a close's own objects; uploadpolicy.TRIGGERS): blocks,
                          # objects and bytes committed, the smallest object and block (bytes)
                          triggers={})
        self._thread.start()

    def stats_snapshot(self) -> dict[str, Any]:
        """A copy of `stats`, its per-trigger counts included (taken under the lock they are
        counted under)."""
        with self._retry_lock:
            snap = dict(self.stats)
            snap["triggers"] = {t: dict(c) for t, c in self.stats["triggers"].items()}
        return snap

    # ---- queueing and waiting ------------------------------------------------------------------

    def submit(self, block: CacheBlock) -> None:
        """Queue a sealed block. Blocks are started (and so committed) in block id order,
        whatever order their sealers submit them in: a seal and its submit are two steps, and a
        block sealed later (by an appender, a close, the WAL pressure or the age timer) may be
        submitted first. Committed first, it would leave a gap in each stream it shares with
        the older block, which the metadata store refuses for good."""
        with self._cond:
            i = len(self._queue)
            while i and self._queue[i - 1].block_id > block.block_id:
                i -= 1
            self._queue.insert(i, block)
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
        """The permanent error that stopped uploads (PERMANENT_ERRORS, or a failure outside the
        retried steps), or None while they run."""
        return self._failure

    @property
    def retrying(self) -> RetryEpisode | None:
        """The episode of failures being retried now, or None when no step is failing."""
        with self._retry_lock:
            last = self.last_retry_error
            if self._episode_start is None or last is None or last[1] is None:
                return None
            return RetryEpisode(last[0], last[1], self._clock() - self._episode_start, self._episode_retries)

    def pending_block_ids(self) -> list[int]:
        """Ids of the blocks sealed but not yet committed."""
        with self._cond:
            starting = [] if self._starting is None else [self._starting.block_id]
            return [b.block_id for b in self._queue] + starting + [job.block.block_id for job in self._inflight]

    @property
    def pending_blocks(self) -> int:
        """Blocks sealed but not yet committed."""
        with self._cond:
            return len(self._queue) + (self._starting is not None) + len(self._inflight)

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
        self._discard_spares()

    def _discard_spares(self) -> None:
        """Let go of the ids prepared ahead (never PUT), so that a clean shutdown leaves no
        PREPARED object behind; if metadata is unreachable they expire instead."""
        with self._spare_lock:
            ids = [i for i, _ in self._spare_ids]
            self._spare_ids.clear()
        if ids:
            try:
                self._meta.remove_objects(ids, unused_prepared=True)
            except Exception as e:   # noqa: BLE001 - they expire after prepared_ttl and are reclaimed
                log.info("the %d object ids prepared ahead stay PREPARED until they expire: %s", len(ids), e)

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
        if self._queue and self._pipeline_has_room(self._queue[0]):
            return "start" if self._head_in_order() else "wait"
        if self._stopping and not self._queue and not self._inflight:
            return "stop"
        return "wait"

    def _pipeline_has_room(self, block: CacheBlock) -> bool:
        """Whether `block` may start uploading now (condition held): fewer than upload_pipeline
        blocks are in flight, or (up to PIPELINE_BLOCKS_MAX x that many) their bytes with it
        stay within upload_pipeline blocks of upload_threshold. Cut blocks are a split size
        each: counted in blocks, a hot stream's PUTs in flight were a quarter of a full
        pipeline's bytes, and its throughput about 3 x split_size per PUT round trip."""
        pipeline = self._config.upload_pipeline
        if len(self._inflight) < pipeline:
            return True
        if len(self._inflight) >= PIPELINE_BLOCKS_MAX * pipeline:
            return False
        inflight = sum(job.block.size for job in self._inflight)
        return inflight + block.size <= pipeline * self._config.upload_threshold

    def _head_in_order(self) -> bool:
        """Whether the queue's head is the oldest sealed block not started yet (condition
        held): the next id after the last one started, or else (the first block, or ids that
        did not follow) no sealed block below it waits to be submitted. Logged if the head
        waits for an older block for OUT_OF_ORDER_WARN_S (a block sealed but never submitted
        would stop uploads: a bug, said so)."""
        head = self._queue[0].block_id
        if self._last_started is not None and head == self._last_started + 1:
            self._out_of_order_since = None
            return True
        started = {job.block.block_id for job in self._inflight}
        missing = [i for i in self._cache.sealed_ids() if i < head and i not in started]
        if not missing:
            self._out_of_order_since = None
            return True
        now = time.monotonic()
        if self._out_of_order_since is None:
            self._out_of_order_since = now
        elif now - self._out_of_order_since >= OUT_OF_ORDER_WARN_S:
            log.warning("block %d waits for older sealed blocks %s to be submitted for upload (%.1f s)", head,
                        missing[:5], now - self._out_of_order_since)
            self._out_of_order_since = now
        return False

    def _run(self) -> None:
        while True:
            self._pace()
            with self._cond:
                if (step := self._next_step()) == "wait":
                    # Bounded: a head waiting for an older block looks again (and says so).
                    self._cond.wait(None if self._out_of_order_since is None else 0.1)
                    continue
                if step == "stop":
                    return
                if step == "start":
                    # Pending while it starts too (planned, ids prepared), before it is in flight:
                    # force_upload must not miss it in between.
                    block = self._queue.popleft()
                    self._starting = block
                    self._last_started = block.block_id
                else:
                    block = self._inflight[0].block
            try:
                if step == "start":
                    self._start(block)
                else:
                    self._finish(self._inflight[0])
            except BaseException as e:   # noqa: BLE001 - a permanent error stops uploads; data stays in the WAL
                if not isinstance(e, UploadAborted):
                    log.exception("upload of block %d failed for good; uploads stop (the data stays in the WAL "
                                  "and is uploaded at the next start)", block.block_id)
                with self._cond:
                    self._failure = e
                    self._starting = None
                    self._cond.notify_all()
                self._on_failure(e)
                return

    def _notify(self, _future=None) -> None:
        with self._cond:
            self._cond.notify_all()

    def _start(self, block: CacheBlock) -> None:
        """Start uploading `block` (behind the blocks in flight)."""
        job = _InFlight(block, [])
        self._launch(job)
        with self._cond:
            self._inflight.append(job)
            self._starting = None
            self.stats["max_inflight"] = max(self.stats["max_inflight"], len(self._inflight))

    def _launch(self, job: _InFlight) -> None:
        """Plan, prepare ids (in block order) and hand encode + PUT of each object to the pool."""
        block = job.block
        split = plan_split(block.sealed_by, self._config.split_size)
        stream_set, stream_objects = self._retry(f"plan of block {block.block_id}",
                                                 lambda: block.plan(split), "plan")
        if self._closed_tails:
            stream_set = [s for s in stream_set if not self._uploaded_by_close(s)]
            stream_objects = [s for s in stream_objects if not self._uploaded_by_close(s)]
        n = len(stream_objects) + (1 if stream_set else 0)
        job.prepared_at = self._clock()
        if n == 0:                      # every slice was a closed stream's tail, committed already
            job.puts = []
            return
        with self._spare_lock:
            reserve = CLOSE_SPARE_IDS // 2 if self._close_prepares else 0   # left for closes
        ahead = self._ids_ahead(n, reserve, job.prepared_at)
        if ahead is not None:
            taken, job.prepared_at = ahead
        else:
            ttl_ns = int(self._config.prepared_ttl * 1e9)
            more = BLOCK_IDS_AHEAD + self._spares_wanted()
            prepared = self._retry(f"prepare of {n} object ids for block {block.block_id}",
                                   lambda: self._meta.prepare_objects(n + more, ttl_ns), "prepare")
            self._keep_spares(prepared[n:], job.prepared_at)
            taken = prepared[:n]
        ids = iter(taken)
        puts = []
        if stream_set:
            ranges = tuple(_commit_range(s) for s in stream_set)
            puts.append(self._pool.submit(self._encode_and_put, next(ids), stream_set,
                                          lambda oid, size: CommitSSO(oid, size, ranges)))
        for s in stream_objects:
            future = self._pool.submit(self._encode_and_put, next(ids), [s],
                                       lambda oid, size, r=_commit_range(s): CommitStreamObject(oid, size, r))
            puts.append(future)
            with self._cond:
                self._slice_puts[id(s)] = (s, future)
            if self.on_put is not None:
                future.add_done_callback(self.on_put)
        job.puts = puts
        for f in puts:
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
        entry. Retried until it succeeds (or a permanent error): after a store error the same
        encoded bytes go again; after any other error (the encoding's own, say) the object and
        its buffer are let go and it is encoded again, into a buffer no view holds."""
        key = object_key(object_id)
        buffer = self._buffers.get()        # never empty: one per pool thread
        if self.on_put is not None and len(slices) == 1:
            self.on_put(None)                       # started: put_bytes counts it now
        data = None
        step = "encode"

        def attempt():
            nonlocal buffer, data, step
            try:
                if data is None:
                    step = "encode"
                    with self._encode_slots:
                        data, _ = encode_slices(slices, self._config.object_block_size, buffer, GATHER_MIN_BYTES)
                step = "put"
                started = time.perf_counter()
                self._put(key, data)
                self._put_seconds.append(time.perf_counter() - started)
                return entry(object_id, data_size(data))
            except (ObjectStoreError, OSError):
                raise
            except BaseException:
                if data is not None:
                    _release(data)
                    data = None
                self._return_buffer(buffer)
                buffer = self._buffers.get()
                raise

        try:
            return self._retry(f"PUT {key}", attempt, lambda: step)
        finally:
            if data is not None:
                _release(data)
                data = None
            self._return_buffer(buffer)

    def _put(self, key: str, data: PutData) -> None:
        """One attempt to PUT an encoded object."""
        self._store.put(key, data)

    def _return_buffer(self, buffer: bytearray) -> None:
        """Give an encode buffer back for reuse; one some view still holds (it could not be
        resized) is replaced by a new one instead, left to be freed with its last view."""
        if _exported(buffer):
            log.debug("an encode buffer of %d bytes is still exported after its object; replaced", len(buffer))
            with self._retry_lock:
                self.stats["encode_buffers_replaced"] += 1
            buffer = bytearray()
        self._buffers.put(buffer)

    def _finish(self, job: _InFlight) -> None:
        """Commit the head block (its PUTs are done), then trim the WAL below it."""
        entries = [f.result() for f in job.puts]      # re-raises a PUT that failed for good
        if self._aborted:
            raise UploadAborted("aborted before commit")
        block = job.block
        self._retry(f"wait for the WAL to be durable up to {block.wal_end}",
                    lambda: self._wait_durable(block.wal_end), "durable")
        sso = next((e for e in entries if isinstance(e, CommitSSO)), None)
        sos = tuple(e for e in entries if isinstance(e, CommitStreamObject))
        with self._gate.for_block(CLOSE_PRIORITY_MAX_WAIT):
            request = self._without_closed_tails(CommitRequest(self._node_id, self._node_epoch, sso=sso,
                                                               stream_objects=sos)) if entries else None
            try:
                result = self._commit(request, job) if request is not None else CommitResult()
            except _PreparedExpired:
                log.warning("block %d was not committed before its object ids expired (prepared_ttl %g s) while "
                            "uploads were failing; uploading it again under new ids", block.block_id,
                            self._config.prepared_ttl)
                with self._retry_lock:
                    self.stats["expired_reuploads"] += 1
                self._launch(job)
                return
            self.stats["blocks"] += 1
            self.stats["objects"] += len(entries)
            self.stats["stream_objects"] += len(sos)
            self.stats["stream_set_objects"] += 1 if sso else 0
            self.stats["bytes"] += sum(e.size for e in entries)
            self.stats["write_requests"] += sum(write_requests(e.size, *self._parts) for e in entries)
            with self._retry_lock:
                self._count_trigger(block.sealed_by or "size", entries)
            # Forgotten before the streams' tails shrink (_on_committed), so that put_bytes never
            # counts a slice both as PUT and as gone from the tail.
            with self._cond:
                for s in block.streams.values():
                    self._slice_puts.pop(id(s), None)
            self._cache.mark_committed(block)
            self._on_committed(block, result)
            with self._cond:
                self._committed_id = block.block_id
            # A closed tail is remembered while some block still to commit holds a slice of it:
            # by the slices themselves, since a cut may have moved one into a later block. Only
            # the tails this block held a slice of can have lost their last one now (a node
            # closing 10,000 partitions has 20,000 closed tails, and the cache thousands of
            # blocks: looking at every tail at every commit took minutes).
            if self._closed_tails:
                for key in {(s.stream_id, s.epoch) for s in block.streams.values()}:
                    if key in self._closed_tails and not self._cache.uncommitted_slices(*key):
                        del self._closed_tails[key]
        trim = self._cache.trim_point(block)
        try:
            self._trim_wal(trim)
        except Exception:   # noqa: BLE001 - the WAL failing is reported by its own appends
            log.exception("WAL trim to %d failed", trim)
        with self._cond:
            self._inflight.popleft()
            self._cond.notify_all()

    def _count_trigger(self, trigger: str, entries: list) -> None:
        """Count a commit's objects under what made them (stats["triggers"]); _retry_lock held."""
        if not entries:
            return
        counts = self.stats["triggers"].setdefault(trigger, dict(blocks=0, objects=0, bytes=0, min_object=None,
                                                                 min_block=None))
        size = sum(e.size for e in entries)
        counts["blocks"] += 1
        counts["objects"] += len(entries)
        counts["bytes"] += size
        smallest = min(e.size for e in entries)
        counts["min_object"] = smallest if counts["min_object"] is None else min(counts["min_object"], smallest)
        counts["min_block"] = size if counts["min_block"] is None else min(counts["min_block"], size)

    # ---- a close's own upload -------------------------------------------------------------------

    def _uploaded_by_close(self, s: CacheSlice) -> bool:
        """Whether slice `s` lies in a tail a close has committed already."""
        done = self._closed_tails.get((s.stream_id, s.epoch))
        if done is None or s.end_offset > done:
            return False
        with self._retry_lock:
            self.stats["closed_tail_bytes_skipped"] += s.size
        return True

    def _without_closed_tails(self, request: CommitRequest) -> CommitRequest | None:
        """`request` without the ranges a close committed already (gate held); None if nothing
        is left. An SSO keeps its object (its bytes of those ranges are never referenced); a
        StreamObject left out stays PREPARED and the reclaimer deletes it after expiry, unless
        the close committed it itself (_reusable_puts)."""
        if not self._closed_tails:
            return request

        def keep(r: CommitRange) -> bool:
            done = self._closed_tails.get((r.stream_id, r.epoch))
            return done is None or r.end_offset > done

        sso = request.sso
        if sso is not None and not all(keep(r) for r in sso.ranges):
            ranges = tuple(r for r in sso.ranges if keep(r))
            sso = CommitSSO(sso.object_id, sso.size, ranges) if ranges else None
        sos = tuple(so for so in request.stream_objects if keep(so.range))
        if sso is None and not sos:
            return None
        if sso is request.sso and len(sos) == len(request.stream_objects):
            return request
        return CommitRequest(request.node_id, request.node_epoch, sso=sso, stream_objects=sos)

    def upload_and_close(self, streams: list[tuple[int, int]], timeout: float | None,
                         timing: dict | None = None, kv: tuple[tuple[str, bytes], ...] = ()) -> CommitResult:
        """Close `streams` ((stream id, epoch), whose appends have stopped and are durable, or
        are carried by this close alone: Client.close_streams' `not_durable`): PUT
        each one's un-uploaded tail as a StreamObject on the calling thread, ahead of the
        background uploads, and commit them with the streams' close in one metadata
        transaction, without waiting for older blocks (module docstring). Store and metadata
        errors are retried until `timeout` (None: no bound), then OperationTimeoutError;
        StreamFencedError if a stream moved away; UploadAborted if uploads stopped for good.
        `timing`, if given, receives the seconds spent: "put" (ids, encode, PUTs), "gate"
        (waiting for a block's commit to end), "commit". `kv`: KV entries the same commit writes
        (CommitRequest.kv)."""
        deadline = None if timeout is None else self._clock() + timeout
        timing = {} if timing is None else timing
        for phase in ("put", "gate", "commit"):
            timing.setdefault(phase, 0.0)
        with self._gate.close_coming():
            return self._upload_and_close(streams, deadline, timing, kv)

    def _upload_and_close(self, streams: list[tuple[int, int]], deadline: float | None, timing: dict,
                          kv: tuple[tuple[str, bytes], ...]) -> CommitResult:
        hold = False
        while True:
            held = False
            try:
                t0 = time.perf_counter()
                if hold:
                    self._enter_gate(deadline)
                    held = True
                t1 = time.perf_counter()
                tails = {key: self._cache.uncommitted_slices(*key) for key in streams}
                tails = {key: slices for key, slices in tails.items() if slices}
                entries, new = self._put_tails(tails, deadline)
                t2 = time.perf_counter()
                if not held:
                    self._enter_gate(deadline)
                    held = True
                t3 = time.perf_counter()
                timing["put"] += t2 - t1
                timing["gate"] += (t1 - t0) + (t3 - t2)
                # Gate held from here: no block commits until this close has.
                if any(s.block_id <= self._committed_id for slices in tails.values() for s in slices):
                    # A block committed part of a tail during the PUTs: upload what is left
                    # again, this time holding the gate throughout (the orphans expire).
                    assert not hold, "a block committed while a close held the gate"
                    with self._retry_lock:
                        self.stats["close_conflicts"] += 1
                    hold = True
                    continue
                request = CommitRequest(self._node_id, self._node_epoch, stream_objects=tuple(entries),
                                        closes=tuple(streams), kv=tuple(kv))
                result = self._until(deadline, f"commit of the close of streams {[k[0] for k in streams]}",
                                     lambda: self._meta.commit(request), "commit")
                timing["commit"] += time.perf_counter() - t3
                for key, slices in tails.items():
                    self._closed_tails[key] = slices[-1].end_offset
                with self._retry_lock:
                    # Counted once: the objects PUT here; those reused are counted with their block.
                    self.stats["closes"] += 1
                    self.stats["objects"] += len(new)
                    self.stats["stream_objects"] += len(new)
                    self.stats["bytes"] += sum(e.size for e in new)
                    self.stats["close_objects"] += len(new)
                    self.stats["close_bytes"] += sum(e.size for e in new)
                    self.stats["close_objects_reused"] += len(entries) - len(new)
                    self.stats["write_requests"] += sum(write_requests(e.size, *self._parts) for e in new)
                    self._count_trigger("close", new)
                return result
            finally:
                if held:
                    self._gate.release()

    def _enter_gate(self, deadline: float | None) -> None:
        """Take the commit gate (a block's commit holds it while it runs), within `deadline`."""
        left = -1 if deadline is None else max(0.0, deadline - self._clock())
        if not self._gate.acquire(timeout=left):
            raise OperationTimeoutError(
                "a close could not commit within its timeout: a block's commit kept the gate (the metadata "
                f"store is not answering: {self._why()}); the data stays in the WAL and the log cache")

    def _why(self) -> str:
        episode = self.retrying
        return f"{episode.what}: {episode.error}" if episode else "no failure recorded"

    def _spares_wanted(self) -> int:
        """How many ids to prepare ahead for closes along with a prepare call: none until this
        node has closed a stream (a node that never moves anything keeps no PREPARED ids), then
        CLOSE_SPARE_IDS whenever fewer than half are left."""
        with self._spare_lock:
            if not self._close_prepares:
                return 0
            return CLOSE_SPARE_IDS if len(self._spare_ids) < CLOSE_SPARE_IDS // 2 else 0

    def _keep_spares(self, ids: list[int], prepared_at: float) -> None:
        with self._spare_lock:
            self._spare_ids.extend((i, prepared_at) for i in ids)

    def _ids_ahead(self, n: int, keep: int, now: float) -> tuple[list[int], float] | None:
        """`n` ids prepared ahead and young enough (prepared within half of prepared_ttl), the
        oldest first, leaving at least `keep`, and when the first of them was prepared; None if
        there are too few."""
        with self._spare_lock:
            while self._spare_ids and now - self._spare_ids[0][1] >= self._config.prepared_ttl / 2:
                self._spare_ids.popleft()          # too old to be committed surely in time
            if len(self._spare_ids) - keep < n:
                return None
            prepared_at = self._spare_ids[0][1]
            return [self._spare_ids.popleft()[0] for _ in range(n)], prepared_at

    def _close_ids(self, n: int, deadline: float | None) -> list[int]:
        """`n` prepared object ids for a close: spares prepared ahead if there are enough young
        ones (no metadata transaction), else `n` more (and spares) prepared now."""
        now = self._clock()
        ahead = self._ids_ahead(n, 0, now)
        if ahead is not None:
            return ahead[0]
        ttl_ns = int(self._config.prepared_ttl * 1e9)
        with self._spare_lock:
            self._close_prepares += 1
        spares = self._spares_wanted()
        prepared = self._until(deadline, f"prepare of {n} object ids for a close",
                               lambda: self._meta.prepare_objects(n + spares, ttl_ns), "prepare")
        self._keep_spares(prepared[n:], now)
        return prepared[:n]

    def put_bytes(self, stream_id: int, epoch: int) -> int:
        """Bytes of the stream's tail (slices of blocks not yet committed) that a StreamObject
        PUT carries already or is carrying (its upload thread started it): what a close of it
        commits without PUTting again (_reusable_puts waits at most _reuse_wait for those still
        running, all at once). A stream's tail bound counts only the rest (client._tail_wait),
        so one stream keeps as many PUTs in flight as the pool has threads, whatever the PUT
        latency (issue 51: a hot stream behind S3's 30-150 ms PUTs)."""
        carried = 0
        with self._cond:
            for s, future in self._slice_puts.values():
                if s.stream_id != stream_id or s.epoch != epoch:
                    continue
                if future.running() or (future.done() and not future.cancelled() and future.exception() is None):
                    carried += s.size
        return carried

    def _reuse_wait(self) -> float:
        """How long a close waits for the running PUTs of its tail: the 0.9 quantile of the
        pool's recent PUTs (50 ms before there are any). A PUT slower than most is a stalled
        one: the close PUTs those bytes itself rather than wait behind it (issue 28: a close
        does not wait for background uploads)."""
        recent = sorted(self._put_seconds)
        return recent[int(len(recent) * 0.9)] if len(recent) >= 10 else REUSE_WAIT_FIRST

    def _reusable_puts(self, slices: list[CacheSlice], deadline: float | None) -> dict[int, CommitStreamObject]:
        """Of a closing stream's tail, the slices whose StreamObject a block in flight has PUT
        (waited for, at most _reuse_wait, if its PUT is still running): id of the slice -> that
        object's commit entry. The close commits those objects itself, so what it PUTs is only
        the rest (the active block's slice, slices in StreamSetObjects, not yet planned, or
        whose PUT is slow or failed): the tail bound sets backpressure, not how long a move
        takes."""
        with self._cond:
            # (an entry holds its slice, so its id cannot be another slice's)
            found = [(s, self._slice_puts[id(s)][1]) for s in slices if id(s) in self._slice_puts]
        reused = {}
        until = self._clock() + self._reuse_wait()
        if deadline is not None:
            until = min(until, deadline)
        for s, future in found:
            try:
                entry = future.result(max(0.0, until - self._clock()))
            except Exception:      # noqa: BLE001 - failed, aborted or not done in time: PUT it again here
                continue
            if isinstance(entry, CommitStreamObject) and entry.range == _commit_range(s):
                reused[id(s)] = entry
        return reused

    def _put_tails(self, tails: dict[tuple[int, int], list[CacheSlice]], deadline: float | None) -> tuple[list, list]:
        """The commit entries of each tail, in offset order: the StreamObjects blocks in flight
        PUT already (_reusable_puts), and one new StreamObject (ids prepared ahead) per run of
        slices between them. Returns (every entry, the entries PUT here)."""
        if not tails:
            return [], []
        plan: list[tuple[tuple[int, int], list[CacheSlice] | CommitStreamObject]] = []
        for key, slices in sorted(tails.items()):
            reused = self._reusable_puts(slices, deadline)
            run: list[CacheSlice] = []
            for s in slices:
                if id(s) in reused:
                    if run:
                        plan.append((key, run))
                        run = []
                    plan.append((key, reused[id(s)]))
                else:
                    run.append(s)
            if run:
                plan.append((key, run))
        ids = iter(self._close_ids(sum(1 for _, item in plan if isinstance(item, list)), deadline))
        entries, new = [], []
        for (stream_id, epoch), item in plan:
            if isinstance(item, CommitStreamObject):
                entries.append(item)
                continue
            object_id = next(ids)
            data, _ = encode_slices(item, self._config.object_block_size, bytearray(), GATHER_MIN_BYTES)
            try:
                self._until(deadline, f"PUT {object_key(object_id)} (the tail of stream {stream_id})",
                            lambda: self._put(object_key(object_id), data), "put")
                size = data_size(data)
            finally:
                _release(data)
            entry = CommitStreamObject(
                object_id, size, CommitRange(stream_id, epoch, item[0].start_offset, item[-1].end_offset))
            entries.append(entry)
            new.append(entry)
        return entries, new

    def _until(self, deadline: float | None, what: str, call: Callable[[], T], step: str) -> T:
        """`call()` until it returns, retrying what `_retry` retries (counted in stats as
        "<step>_retries"), within `deadline`."""
        failures = 0
        while True:
            if self._failure is not None or self._aborted:
                raise UploadAborted(f"uploads stopped ({self._failure or 'the client closed'}) while {what} "
                                    "was pending")
            try:
                return call()
            except ObjectStorePermanentError as e:
                # As in the background: a store refusing for good stops uploads for good.
                log.error("%s failed for good; uploads stop (the data stays in the WAL): %s", what, e)
                with self._cond:
                    if self._failure is None:
                        self._failure = e
                    self._cond.notify_all()
                self._on_failure(e)
                raise
            except _NOT_RETRIED:
                raise
            except Exception as e:   # noqa: BLE001 - transient, as in _retry
                failures += 1
                last = f"{type(e).__name__}: {e}"
                with self._retry_lock:
                    self.stats[f"{step}_retries"] += 1
                    self.stats["unexpected_retries"] += _unexpected(e)
            delay = min(RETRY_BACKOFF_CAP, RETRY_BACKOFF_FIRST * 2 ** min(failures - 1, 16))
            if deadline is not None and self._clock() + delay > deadline:
                raise OperationTimeoutError(f"{what} kept failing ({failures} attempts) until the timeout; the "
                                            f"last error: {last}. Its data stays in the WAL and the log cache: a "
                                            "later close, or the node's next start, uploads it")
            with self._cond:
                self._cond.wait_for(lambda: self._aborted, delay * (0.5 + 0.5 * self._rng.random()))

    def _retry(self, what: str, call: Callable[[], T], step: str | Callable[[], str]) -> T:
        """`call()` until it returns: every error but PERMANENT_ERRORS is retried with backoff
        (UploadAborted once the client aborts). `step` names the step that failed (a callable:
        read at each failure) for the counters; `what` names the operation in messages."""
        failures = 0        # counted ones: those met before the client aborted
        recovered = False
        try:
            while True:
                try:
                    result = call()
                    recovered = True
                    return result
                except _NOT_RETRIED:
                    raise
                except Exception as e:   # noqa: BLE001 - every other failure is transient: see the module docstring
                    if not self._aborted:
                        failures += 1
                        self._failed(what, step if isinstance(step, str) else step(), e, failures == 1)
                    last = str(e)
                # Raised here, not in the except clause, so that it keeps no link to the error.
                if self._aborted:
                    raise UploadAborted(f"the client was closed while {what} was failing and being retried "
                                        f"({last})")
                delay = min(RETRY_BACKOFF_CAP, RETRY_BACKOFF_FIRST * 2 ** min(failures - 1, 16))
                with self._cond:
                    self._cond.wait_for(lambda: self._aborted, delay * (0.5 + 0.5 * self._rng.random()))
        finally:
            if failures:
                self._step_ended(recovered)

    def _failed(self, what: str, step: str, error: BaseException, first: bool) -> None:
        """Count a failure to be retried; log it if it opens an episode."""
        unexpected = _unexpected(error)
        with self._retry_lock:
            self.stats[f"{step}_retries"] += 1
            self.stats["unexpected_retries"] += unexpected
            if first:
                self._failing += 1
                self.stats["retrying"] = self._failing
            opens = self._episode_start is None
            if opens:
                self._episode_start = self._clock()
                self._episode_retries = 0
                self.stats["retry_episodes"] += 1
            self._episode_retries += 1
        if opens:
            # The traceback goes into the message, not into the record (exc_info): a handler that
            # keeps records would keep the failed call's frames alive.
            detail = "\n" + "".join(traceback.format_exception(error)).rstrip() if unexpected else ""
            log.warning("uploads are failing and being retried every %g s at most until they recover (retries are "
                        "counted in stats()['upload'] and s3stream_upload_retries_total): %s failed: %s: %s%s",
                        RETRY_BACKOFF_CAP, what, type(error).__name__, error, detail)
        else:
            log.debug("%s failed, retrying: %s: %s", what, type(error).__name__, error)
        kept = (what, _without_traceback(error))
        with self._retry_lock:
            self.last_retry_error = kept

    def _step_ended(self, recovered: bool) -> None:
        """A step that had failed ended (recovered, or gave up); the last one ends the episode."""
        with self._retry_lock:
            self._failing -= 1
            self.stats["retrying"] = self._failing
            if self._failing or self._episode_start is None:
                return
            seconds = self._clock() - self._episode_start
            retries = self._episode_retries
            last = self.last_retry_error
            self._episode_start = None
            self.last_retry_error = None
        if recovered:
            log.info("uploads recovered after %d retries in %.1f s (the last failure: %s: %s)", retries, seconds,
                     *(last if last else ("?", None)))

    def _commit(self, request: CommitRequest, job: _InFlight) -> CommitResult:
        """Commit `request`, retried; the ranges of streams found fenced are dropped. Raises
        _PreparedExpired if metadata refuses the commit once the objects' ids may have expired."""
        block_id = job.block.block_id

        def commit() -> CommitResult:
            try:
                return self._meta.commit(request)
            except MetadataError:
                # An expired PREPARED object is refused atomically: nothing was committed, and
                # the same request can never succeed. (Any other refusal goes on being retried.)
                if self._clock() - job.prepared_at >= self._config.prepared_ttl:
                    raise _PreparedExpired() from None
                raise

        while True:
            try:
                return self._retry(f"commit of block {block_id}", commit, "commit")
            except StreamFencedError:
                remaining = self._retry(f"fence check of block {block_id}",
                                        lambda: self._without_fenced(request), "commit")
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
