"""Upload of sealed log-cache blocks: split, prepare, PUT, commit in block order, trim the WAL.

Per block (strictly one after another, so commits are in block order and SSO ids rise):
1. plan: a stream with at least `split_size` bytes in the block becomes its own StreamObject;
   the other streams share one StreamSetObject;
2. prepare object ids in metadata (PREPARED, with expiry);
3. encode (native codec) and PUT the objects concurrently, retrying store errors with backoff;
4. commit everything in ONE metadata transaction, retried (a commit is idempotent);
5. mark the block committed in the cache and trim the WAL to the block's last record.

Failure rules: an object is committed only after its PUT returned; a failed PUT is retried, never
skipped; acknowledged data stays in the WAL until its commit, so a crash at any step loses
nothing (restart recovery uploads it again under fresh ids; the orphans of the first attempt stay
PREPARED and the lifecycle deletes them after expiry). A commit refused because a stream was
fenced drops that stream's ranges (it moved away; its new owner continues from the committed
end) and commits the rest; a fenced node stops uploading altogether.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import tenacity

from .config import Config
from .errors import ObjectStoreError, S3StreamError, StreamFencedError
from .logcache import CacheBlock, LogCache, StreamSlice
from .metadata import (
    CommitRange, CommitRequest, CommitResult, CommitSSO, CommitStreamObject, MetadataStore, StreamState,
    object_key,
)
from .objectformat import encode_object
from .objectstore import ObjectStore

log = logging.getLogger("s3stream.upload")


@dataclass
class UploadPlan:
    stream_set: list[StreamSlice]     # streams sharing the StreamSetObject (ascending ids)
    stream_objects: list[StreamSlice]  # streams getting a StreamObject each


def plan_upload(block: CacheBlock, split_size: int) -> UploadPlan:
    plan = UploadPlan([], [])
    for stream_id in sorted(block.streams):
        s = block.streams[stream_id]
        (plan.stream_objects if s.size >= split_size else plan.stream_set).append(s)
    return plan


def _commit_range(s: StreamSlice) -> CommitRange:
    return CommitRange(s.stream_id, s.epoch, s.start_offset, s.end_offset)


class UploadAborted(S3StreamError):
    """The client was closed or failed while a block was still being uploaded."""


class Uploader:
    def __init__(self, *, node_id: int, node_epoch: int, store: ObjectStore, metadata: MetadataStore,
                 cache: LogCache, trim_wal: Callable[[int], None], config: Config,
                 on_committed: Callable[[CacheBlock, CommitResult], None],
                 on_fenced: Callable[[list[int] | None], None]) -> None:
        self._node_id = node_id
        self._node_epoch = node_epoch
        self._store = store
        self._meta = metadata
        self._cache = cache
        self._trim_wal = trim_wal
        self._config = config
        self._on_committed = on_committed
        self._on_fenced = on_fenced
        self._cond = threading.Condition()
        self._queue: deque[CacheBlock] = deque()
        self._committed_id = -1          # highest block id committed (blocks commit in id order)
        self._failure: BaseException | None = None
        self._stopping = False
        self._aborted = False
        self._pool = ThreadPoolExecutor(max_workers=config.upload_concurrency, thread_name_prefix="s3stream-put")
        self._thread = threading.Thread(target=self._run, name="s3stream-upload", daemon=True)
        self.stats = dict(blocks=0, objects=0, stream_objects=0, stream_set_objects=0, bytes=0,
                          put_retries=0, prepare_retries=0, commit_retries=0)
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
                raise TimeoutError(f"block {block_id} not committed within {timeout} s")

    @property
    def failure(self) -> BaseException | None:
        return self._failure

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

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping or self._aborted)
                if self._aborted or (not self._queue and self._stopping) or self._failure is not None:
                    return
                block = self._queue[0]
            try:
                result = self._upload(block)
            except BaseException as e:   # noqa: BLE001 - any failure stops uploads; data stays in the WAL
                if not isinstance(e, UploadAborted):
                    log.exception("upload of block %d failed; uploads stop", block.block_id)
                with self._cond:
                    self._failure = e
                    self._cond.notify_all()
                return
            self._cache.mark_committed(block)
            self._on_committed(block, result)
            try:
                self._trim_wal(block.wal_end)
            except Exception:   # noqa: BLE001 - the WAL failing is reported by its own appends
                log.exception("WAL trim to %d failed", block.wal_end)
            with self._cond:
                self._queue.popleft()
                self._committed_id = block.block_id
                self._cond.notify_all()

    def _retrying(self, what: str, retry_on: tuple[type[BaseException], ...], counter: str) -> tenacity.Retrying:
        def before_sleep(state: tenacity.RetryCallState) -> None:
            self.stats[counter] += 1
            log.warning("%s failed (attempt %d), retrying: %s", what, state.attempt_number,
                        state.outcome.exception() if state.outcome else None)

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(retry_on),
            wait=tenacity.wait_exponential(multiplier=0.02, max=2.0),
            stop=lambda state: self._aborted,
            before_sleep=before_sleep,
            reraise=True,
        )

    def _upload(self, block: CacheBlock) -> CommitResult:
        plan = plan_upload(block, self._config.split_size)
        n = len(plan.stream_objects) + (1 if plan.stream_set else 0)
        ttl_ns = int(self._config.prepared_ttl * 1e9)
        ids = self._retrying("prepare", (OSError,), "prepare_retries")(self._meta.prepare_objects, n, ttl_ns)
        objects: list[tuple[int, bytes]] = []
        sso = None
        next_id = iter(ids)
        if plan.stream_set:
            oid = next(next_id)
            enc = encode_object([(s.stream_id, s.batches) for s in plan.stream_set], self._config.object_block_size)
            objects.append((oid, enc.data))
            sso = CommitSSO(oid, len(enc.data), tuple(_commit_range(s) for s in plan.stream_set))
        sos = []
        for s in plan.stream_objects:
            oid = next(next_id)
            enc = encode_object([(s.stream_id, s.batches)], self._config.object_block_size)
            objects.append((oid, enc.data))
            sos.append(CommitStreamObject(oid, len(enc.data), _commit_range(s)))
        futures = [self._pool.submit(self._put, object_key(oid), data) for oid, data in objects]
        for f in futures:
            f.result()
        if self._aborted:
            raise UploadAborted("aborted before commit")
        request = CommitRequest(self._node_id, self._node_epoch, sso=sso, stream_objects=tuple(sos))
        result = self._commit(request)
        self.stats["blocks"] += 1
        self.stats["objects"] += len(objects)
        self.stats["stream_objects"] += len(sos)
        self.stats["stream_set_objects"] += 1 if sso else 0
        self.stats["bytes"] += sum(len(d) for _, d in objects)
        return result

    def _put(self, key: str, data: bytes) -> None:
        self._retrying(f"PUT {key}", (ObjectStoreError, OSError), "put_retries")(self._store.put, key, data)

    def _commit(self, request: CommitRequest) -> CommitResult:
        commit = self._retrying("commit", (OSError,), "commit_retries")
        while True:
            try:
                return commit(self._meta.commit, request)
            except StreamFencedError:
                request = self._without_fenced(request)
                if request is None:
                    return CommitResult()

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
