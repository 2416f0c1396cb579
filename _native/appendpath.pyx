# cython: language_level=3
"""The engine's append path: one native call per append, from the batch to the WAL and the cache.

`StreamWriter.append(batch)` (the base of s3stream's Stream) does, under the path's append lock:
assign the stream's offsets, frame the WAL record (stream id, epoch, base offset, count, then the
payload) straight into the ring's open batch, and copy the payload into the stream's slice of the
log cache's active block. Holding one lock across both keeps the cache's blocks in WAL order (see
logcache.pyx). No Python object is created per append beyond the returned AppendFuture.

A Kafka record batch (`RecordBatch.kafka`) is stored with its real base offset in its first 8
bytes (baseOffset, big-endian, outside the batch's CRC), as a broker sets it on append, so that a
tool parsing the stored payload reads the stream's offsets: the WAL record takes those 8 bytes
from its prefix and the rest from the payload (no extra copy), and the log cache's copy of the
payload has them written over. Any other payload is stored byte for byte.

Durability is the ring's: an AppendFuture is done when the WAL's acknowledged watermark passes
its record (durable, and within the node's lease when the node holds one: walring.pyx). Each writer keeps a queue of (WAL end, stream end offset) of its pending appends; its
confirm offset, the bound of every read, advances along that queue as the watermark moves. No
thread runs per record to complete anything: waiting in `result()` sleeps on the ring's
condition, and the only per-record work after the append call is a reader's or waiter's.

Callbacks (`add_done_callback`, `future()`) run on the engine's callback thread
(`run_callbacks`), in WAL order, never on the WAL's writer threads: a callback that blocks
delays later callbacks only, never an acknowledgement.

The append lock is taken by trylock with the GIL, else waited for without the GIL; the ring may
wait (bounded by its full_timeout) for space while it is held. The cache's lock is never held
while waiting, so sealing and uploading (which free WAL space) never wait for an appender.
"""
import heapq
import logging
import threading

from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport realloc, free
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
cimport cython

from _native.sysdeps cimport (
    monotonic_ns, pthread_mutex_init, pthread_mutex_destroy, pthread_mutex_unlock,
    pthread_mutex_trylock, pthread_mutex_lock, trylock_spinning,
)
from _native.endian cimport store32, store64
from _native.kafkarecords cimport BATCH_HEADER, store_be64
from _native.walrecord cimport RECORD_HEADER_SIZE
from _native.walring cimport Ring
from _native.logcache cimport LogCache, CacheSlice, CacheBlock, held_owner

log = logging.getLogger("s3stream.append")

cdef enum:
    WAL_PREFIX = 28          # u64 stream id | u64 epoch | u64 base offset | u32 count

cdef enum:
    LATENCY_SAMPLE_EVERY = 64    # a power of two: appends between latency samples
    LATENCY_SAMPLES = 1024       # the ring of samples kept for take_latency_samples

# Writer states (s3stream.Stream names them).
OPEN = 0
CLOSING = 1
CLOSED = 2
FENCED = 3

cdef enum:
    W_OPEN = 0
    W_CLOSING = 1
    W_CLOSED = 2
    W_FENCED = 3

# Failpoints for tests: names -> armed. Checked only where the append path can fail after its
# record is in the WAL (the insert into the log cache).
cdef bint _fail_insert = False

# Tries of the ring's and the cache's mutex, with the GIL, before waiting for them without it.
# Both are held briefly (the WAL writer, a seal); an appender that gave up the GIL while holding
# the append lock would hand it to the other appenders only for them to block on that lock and
# be woken one by one (a convoy: 2-3 context switches per append it affects).
cdef int _lock_attempts = 1000


def set_lock_attempts(int attempts) -> None:
    """Tune the tries above (benchmarks); at least 1."""
    global _lock_attempts
    _lock_attempts = max(1, attempts)

#: Error types used before an engine exists (RecordBatch validation); s3stream sets its own.
_error_types = {"invalid_batch": ValueError}


#: RecordBatch subclasses a stream refuses (a tuple), and the error it raises for one:
#: refusal(writer, batch). s3stream.cluster.producers registers ProducedBatch, whose sequences
#: only a partition checks. Looked at only for subclasses, off the path of RecordBatch itself.
_refused_types = ()
_refusal = None


def set_refused_batches(tuple types, refusal) -> None:
    """Make StreamWriter.append and append_many raise refusal(writer, batch) for a batch of one
    of `types` (RecordBatch subclasses), before anything is appended."""
    global _refused_types, _refusal
    _refused_types, _refusal = types, refusal


def set_error_types(**types) -> None:
    """Name the exception types raised by this module: invalid_batch (bad RecordBatch)."""
    _error_types.update(types)


def set_failpoint(str name, bint armed) -> None:
    """Arm or disarm a failpoint (tests only). 'cache_insert': the insert into the log cache
    fails after the record is placed in the WAL, as an allocation failure would."""
    global _fail_insert
    if name != "cache_insert":
        raise ValueError(f"unknown failpoint {name!r}")
    _fail_insert = armed


cdef inline AppendResult _result(uint64_t base_offset):
    cdef AppendResult r = AppendResult.__new__(AppendResult)
    r.base_offset = base_offset
    return r


cdef int _check_kafka(object payload) except -1:
    """Refuse a payload said to be a Kafka record batch that is too short for its header or
    whose magic byte is not 2: the append writes its first 8 bytes."""
    cdef Py_buffer view
    cdef int magic = -1
    PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
    try:
        if view.len >= BATCH_HEADER:
            magic = (<const unsigned char*>view.buf)[16]
        if magic != 2:
            why = "too short for its header" if magic == -1 else f"magic byte {magic}"
            raise _error_types["invalid_batch"](
                f"kafka=True says the payload is a Kafka record batch (v2), whose base offset the append sets, but "
                f"these {view.len} bytes are not one ({why}): build it with s3stream.records, or append the bytes "
                f"as they are (kafka=False)")
    finally:
        PyBuffer_Release(&view)
    return 0


@cython.no_gc
@cython.freelist(64)
cdef class RecordBatch:
    """`count` records carried as one opaque payload; they occupy offsets [base, base + count).
    Immutable; the payload is copied when appended, so a bytearray may be reused afterwards.
    `kafka`: the payload is a Kafka record batch (v2), stored with its base offset set to the
    offset it gets, as a broker stores one (records_batch and encoded_batch make such batches);
    otherwise it is stored byte for byte."""

    def __cinit__(self, payload, count=1, kafka=False):
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise _error_types["invalid_batch"](
                f"payload must be bytes-like (bytes, bytearray, memoryview), got {type(payload).__name__}")
        if type(count) is not int or not 0 < count <= 0xFFFFFFFF:
            raise _error_types["invalid_batch"](
                f"a record batch needs an int count between 1 and {0xFFFFFFFF}, got {count!r}")
        if kafka:
            _check_kafka(payload)
        self.payload = payload
        self.count = count
        self.kafka = kafka

    def __eq__(self, other):
        if not isinstance(other, RecordBatch):
            return NotImplemented
        return (self.count == (<RecordBatch>other).count and self.kafka == (<RecordBatch>other).kafka
                and self.payload == (<RecordBatch>other).payload)

    def __hash__(self):
        return hash((bytes(self.payload), self.count, self.kafka))

    def __reduce__(self):
        return (RecordBatch, (self.payload, self.count, self.kafka))

    def __repr__(self):
        kafka = ", kafka=True" if self.kafka else ""
        return f"RecordBatch(payload=<{len(self.payload)} bytes>, count={self.count}{kafka})"


@cython.freelist(64)
cdef class AppendResult:
    """What a completed append returns: the offset of its first record."""

    def __init__(self, uint64_t base_offset):
        self.base_offset = base_offset

    def __eq__(self, other):
        if not isinstance(other, AppendResult):
            return NotImplemented
        return self.base_offset == (<AppendResult>other).base_offset

    def __hash__(self):
        return hash(self.base_offset)

    def __reduce__(self):
        return (AppendResult, (self.base_offset,))

    def __repr__(self):
        return f"AppendResult(base_offset={self.base_offset})"


# Not tracked by the cyclic GC: every append makes one, and as tracked objects they triggered
# full collections (tens of ms with a large heap) at a rate set by the append rate. A future
# refers to its path (long-lived, refers back only through a pending callback entry, which
# running the callback drops) and to an error that was never raised (no traceback): no cycle.
@cython.no_gc
@cython.freelist(1024)
cdef class AppendFuture:
    """The pending acknowledgement of one append (a light future). `result()` returns an
    AppendResult once the batch is durable in the WAL, or raises why it never will be.
    `future()` gives a concurrent.futures.Future and `await` works in asyncio code; both, like
    `add_done_callback`, complete on the engine's callback thread."""

    def done(self) -> bool:
        return self.error is not None or self.path.ring._settled(self.wal_end) != 0

    cdef object _outcome(self, timeout):
        """None once durable, else why it never will be; TimeoutError if still pending."""
        cdef int state
        if self.error is not None:
            return self.error
        state = self.path.ring._wait(self.wal_end, timeout)
        if state == 1:
            return None
        if state == 2:
            return self.path._wal_failure()
        raise self.path.errors["timeout"](f"append at offset {self.base_offset} not durable after {timeout} s")

    def result(self, timeout=None) -> AppendResult:
        error = self._outcome(timeout)
        if error is not None:
            raise error
        return _result(self.base_offset)

    def exception(self, timeout=None):
        return self._outcome(timeout)

    def add_done_callback(self, fn) -> None:
        """Call `fn(self)` on the engine's callback thread once done (in WAL order)."""
        self.path._add_callback(self, fn)

    def future(self):
        """A concurrent.futures.Future completed with the AppendResult (or the error)."""
        import concurrent.futures
        fut = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()

        def settle(handle):
            err = handle.exception(0)
            if err is None:
                fut.set_result(AppendResult(handle.base_offset))
            else:
                fut.set_exception(err)
        self.add_done_callback(settle)
        return fut

    def __await__(self):
        import asyncio
        return asyncio.wrap_future(self.future()).__await__()

    @property
    def completed_ns(self):
        """CLOCK_MONOTONIC time the append became durable; None if pending (or too old to know)."""
        if self.error is not None:
            return None
        return self.path.ring._completion_time(self.wal_end)

    def __repr__(self):
        return (f"<AppendFuture base_offset={self.base_offset} count={self.count} "
                f"done={self.done()}>")


cdef class StreamWriter:
    """The native half of a stream open on this node: its offsets and its append."""

    def __dealloc__(self):
        free(self.q_wal)
        free(self.q_end)

    def _init_writer(self, AppendPath path, uint64_t stream_id, uint64_t epoch, uint64_t next_offset,
                     uint64_t reserved_end=0xFFFFFFFFFFFFFFFF, uint64_t reserve_soft=0xFFFFFFFFFFFFFFFF):
        self.path = path
        self.stream_id = stream_id
        self.epoch = epoch
        self.next_off = next_offset
        self.confirmed = next_offset
        self.wstate = W_OPEN
        self.reserved_end = reserved_end
        self.reserve_soft = reserve_soft

    def _set_reservation(self, uint64_t reserved_end, uint64_t reserve_soft) -> None:
        """Offsets below `reserved_end` are reserved for this writer in metadata (appends never
        take one beyond); past `reserve_soft` an append asks the path's `reserve` hook to extend
        the reservation ahead of need. Only ever raised."""
        if reserved_end > self.reserved_end or self.reserved_end == 0xFFFFFFFFFFFFFFFF:
            self.reserved_end = reserved_end
            self.reserve_soft = reserve_soft

    def _tail_committed(self, uint64_t nbytes) -> None:
        """`nbytes` of this writer's tail were committed to objects: they leave its tail."""
        self.tail = self.tail - nbytes if self.tail > nbytes else 0

    @property
    def reserved_end(self) -> int:
        """The end of this stream's offsets reserved for this node (appends stay below it)."""
        return self.reserved_end

    cdef int _check_open(self) except -1:
        """Raise why this stream takes no appends (fenced, closed, failed); 0 if it does."""
        if self.wstate == W_FENCED:
            raise self.path.errors["fenced"](
                f"stream {self.stream_id} epoch {self.epoch} was fenced: it was opened elsewhere with a newer "
                "epoch (or this node was fenced). Stop writing; reopen the stream to continue.")
        if self.wstate != W_OPEN:
            raise self.path.errors["closed"](
                f"stream {self.stream_id} is {('open', 'closing', 'closed')[self.wstate]} on this node; "
                "open it again to append")
        if self.failure is not None:
            raise self.failure
        return 0

    def _check_writable(self) -> None:
        """Raise why this stream takes no appends, trims or deletes here (fenced, closed, failed)."""
        self._check_open()

    cdef int _push_pending(self, uint64_t wal_end, uint64_t end_offset) except -1:
        """Queue an append's (WAL end, end offset) for the confirm offset (cache lock held)."""
        cdef size_t cap, live, i
        cdef void* p
        if self.q_head == self.q_cap:
            # Drop what is durable first: nothing else drains the queue while no one reads the
            # stream, and without this it would grow by an entry per append for good.
            self._advance_confirm()
        if self.q_tail == self.q_head:
            self.q_tail = self.q_head = 0
        if self.q_head == self.q_cap:
            live = self.q_head - self.q_tail
            if self.q_tail and live <= self.q_cap // 2:
                # Slide the live entries down rather than grow.
                for i in range(live):
                    self.q_wal[i] = self.q_wal[self.q_tail + i]
                    self.q_end[i] = self.q_end[self.q_tail + i]
                self.q_tail, self.q_head = 0, live
            else:
                cap = self.q_cap * 2 if self.q_cap else 64
                p = realloc(self.q_wal, cap * sizeof(uint64_t))
                if p == NULL:
                    raise MemoryError()
                self.q_wal = <uint64_t*>p
                p = realloc(self.q_end, cap * sizeof(uint64_t))
                if p == NULL:
                    raise MemoryError()
                self.q_end = <uint64_t*>p
                self.q_cap = cap
        self.q_wal[self.q_head] = wal_end
        self.q_end[self.q_head] = end_offset
        self.q_head += 1
        return 0

    cdef void _advance_confirm(self) noexcept:
        """Move the confirm offset over the appends now durable (cache lock held)."""
        cdef uint64_t durable = self.path.ring.acked_hint()
        while self.q_tail < self.q_head and self.q_wal[self.q_tail] <= durable:
            self.confirmed = self.q_end[self.q_tail]
            self.q_tail += 1

    def append(self, batch) -> AppendFuture:
        """Append a RecordBatch; the returned AppendFuture completes once it is durable.
        Raises at once for an invalid batch or a stream that is closed or fenced."""
        if type(batch) is not RecordBatch:
            if not isinstance(batch, RecordBatch):
                raise _error_types["invalid_batch"](f"append takes a RecordBatch, got {type(batch).__name__}")
            if isinstance(batch, _refused_types):
                raise _refusal(self, batch)
        if self.path is None:
            raise RuntimeError("this StreamWriter was never opened by a client")
        return self.path._append(self, (<RecordBatch>batch).payload, (<RecordBatch>batch).count,
                                 (<RecordBatch>batch).kafka)

    def append_many(self, batches) -> list:
        """Append several RecordBatches in order; their AppendFutures, in the same order. On an
        error, the batches before the failing one are appended and the error is raised."""
        cdef list out = []
        if self.path is None:
            raise RuntimeError("this StreamWriter was never opened by a client")
        for batch in batches:
            if not isinstance(batch, RecordBatch):
                raise _error_types["invalid_batch"](f"append_many takes RecordBatches, got {type(batch).__name__}")
            if type(batch) is not RecordBatch and isinstance(batch, _refused_types):
                raise _refusal(self, batch)
            out.append(self.path._append(self, (<RecordBatch>batch).payload, (<RecordBatch>batch).count,
                                         (<RecordBatch>batch).kafka))
        return out

    @property
    def next_offset(self) -> int:
        """The offset the next append gets."""
        return self.next_off

    @property
    def confirm_offset(self) -> int:
        """Every offset below this is durable (acknowledged and readable)."""
        self.path.cache.acquire()
        self._advance_confirm()
        self.path.cache.release()
        return self.confirmed

    def _pending_entries(self) -> int:
        """Entries of the confirm queue (tests: it must stay bounded by the appends in flight)."""
        return self.q_head - self.q_tail

    def _writer_state(self) -> int:
        return self.wstate

    def _set_writer_state(self, int state) -> None:
        """Change the state with no append in flight (takes the append lock): after this returns
        with CLOSING, no append of this stream can still be placed."""
        self.path._lock_append()
        self.wstate = state
        self.path._unlock_append()

    def _mark_fenced(self) -> None:
        """Refuse further appends at once (no wait for appends in flight)."""
        self.wstate = W_FENCED

    def _wait_confirmed(self, uint64_t offset, timeout=None) -> None:
        """Block until every append below `offset` is durable; TimeoutError after `timeout`. A
        stream failed by an append waits only for the appends before that one: the rest never
        entered the cache and will never be served here."""
        cdef uint64_t need = 0
        cdef size_t i
        cdef int state
        if self.failure is not None and offset > self.failed_at:
            offset = self.failed_at
        self.path.cache.acquire()
        self._advance_confirm()
        if self.confirmed < offset:
            for i in range(self.q_tail, self.q_head):
                need = self.q_wal[i]
                if self.q_end[i] >= offset:
                    break
        self.path.cache.release()
        if need == 0:
            return
        state = self.path.ring._wait(need, timeout)
        if state == 2:
            raise self.path._wal_failure()
        if state == 0:
            raise self.path.errors["timeout"](
                f"stream {self.stream_id}: appends below {offset} not durable after {timeout} s")


cdef class AppendPath:
    """Ties one WAL ring to one log cache for a node's streams (see the module docstring).

    on_sealed(block): a block was sealed by an append (threshold reached): upload it.
    on_pressure(): the WAL's untrimmed bytes passed `pressure_bytes`: seal and upload now.
    admit_wait(nbytes): block until `nbytes` more uncommitted bytes fit `admit_limit` (raise on
        timeout); called without any lock held.
    map_error(exc): the engine's exception for an error of the WAL.
    errors: exception types by role: invalid_batch, closed, fenced, append_failed.
    lease_expired(): the exception for an append made after the ring's acknowledgment deadline
        (the node's lease ran out): it is refused before it takes an offset.
    reserve(writer, end): an append needs the stream's offsets up to `end` (past the writer's
        soft mark): extend the writer's reservation in metadata, in the background while `end`
        is still within the reservation, else before returning (raising if it cannot).
    tail_limit, tail_wait(writer, nbytes): a stream's un-uploaded tail (`StreamWriter.tail`:
        appended, not yet committed) is bounded: an append that would take a non-empty tail past
        `tail_limit` first calls `tail_wait`, without any lock held, which returns once there is
        room (or raises). So a stream's close never has more than about tail_limit to upload
        (plus the batches of appends racing past the check together). 0: no bound.
    """

    def __cinit__(self, Ring ring, LogCache cache, uint64_t max_batch_bytes, uint64_t admit_limit,
                  uint64_t pressure_bytes, on_sealed, on_pressure, admit_wait, map_error, dict errors,
                  lease_expired=None, reserve=None, uint64_t tail_limit=0, tail_wait=None):
        pthread_mutex_init(&self.append_mutex, NULL)
        self.mutex_ready = True
        self.ring = ring
        self.cache = cache
        self.max_batch_bytes = max_batch_bytes
        self.admit_limit = admit_limit
        self.pressure_bytes = pressure_bytes
        self.on_sealed = on_sealed
        self.on_pressure = on_pressure
        self.admit_wait = admit_wait
        self.map_error = map_error
        self.errors = errors
        self.lease_expired = lease_expired
        self.reserve = reserve
        self.tail_limit = tail_limit if tail_wait is not None else 0
        self.tail_wait = tail_wait
        self.cb_cond = threading.Condition()
        self.cb_heap = []

    def __dealloc__(self):
        if self.mutex_ready:
            pthread_mutex_destroy(&self.append_mutex)

    cdef void _lock_append(self) noexcept:
        if pthread_mutex_trylock(&self.append_mutex) != 0:
            self.stat_lock_waits += 1           # GIL held: no other thread counts meanwhile
            with nogil:
                pthread_mutex_lock(&self.append_mutex)

    cdef void _unlock_append(self) noexcept:
        pthread_mutex_unlock(&self.append_mutex)

    cdef object _wal_failure(self):
        return self.map_error(self.ring._failure())

    cdef AppendFuture _append(self, StreamWriter w, object payload, uint32_t count, bint kafka):
        cdef Py_buffer view
        cdef unsigned char prefix[WAL_PREFIX + 8]     # + a Kafka batch's base offset
        cdef uint64_t pos = 0, base, wal_end
        cdef size_t n
        cdef int seal = 0
        cdef CacheBlock sealed = None
        cdef CacheSlice s
        cdef AppendFuture fut
        cdef const unsigned char* data
        cdef bint have_view = False
        cdef uint64_t i
        if type(payload) is bytes:          # the common case: no buffer protocol round trip
            data = <const unsigned char*>PyBytes_AS_STRING(payload)
            n = <size_t>PyBytes_GET_SIZE(payload)
        else:
            PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
            have_view = True
            data = <const unsigned char*>view.buf
            n = <size_t>view.len
        try:
            if n > self.max_batch_bytes:
                raise self.errors["invalid_batch"](
                    f"batch payload of {n} bytes exceeds max_batch_bytes ({self.max_batch_bytes}); split it "
                    "or raise Config.max_batch_bytes")
            if kafka and n < BATCH_HEADER:
                # Checked when the batch was made; a bytearray may have shrunk since.
                raise self.errors["invalid_batch"](
                    f"a Kafka record batch of {n} bytes is shorter than its header ({BATCH_HEADER} bytes)")
            if self.refusal is not None:
                raise self.refusal[0](self.refusal[1])
            if self.uncommitted + n > self.admit_limit:
                self.admit_wait(n)
            if self.tail_limit and w.tail and w.tail + n > self.tail_limit:
                self.tail_wait(w, n)
            fut = AppendFuture.__new__(AppendFuture)
            fut.path = self
            fut.count = count
            fut.submitted_ns = monotonic_ns()
            if fut.submitted_ns >= self.ring.ack_deadline_ns:
                # Past the lease it could never be acknowledged: refuse it before it takes an
                # offset (a renewal lets the next one through).
                self.stat_lease_refusals += 1
                if self.lease_expired is not None:
                    raise self.lease_expired()
                raise self.errors["closed"]("appends are refused: the node's lease has expired")
            while True:
                # Offsets are taken only within the stream's reservation in metadata, so that a
                # node whose WAL is lost never acknowledged an offset beyond what `forget` skips.
                if w.next_off + count > w.reserve_soft and self.reserve is not None:
                    self.reserve(w, w.next_off + count)
                    if w.next_off + count > w.reserved_end:
                        continue
                self._lock_append()
                try:
                    w._check_open()
                    base = w.next_off
                    if base + count > w.reserved_end and self.reserve is not None:
                        continue        # appenders raced past the reservation: extend it first
                    store64(prefix, w.stream_id)
                    store64(prefix + 8, w.epoch)
                    store64(prefix + 16, base)
                    store32(prefix + 24, count)
                    try:
                        if kafka:
                            # The batch's baseOffset comes from the prefix, the rest from the payload.
                            store_be64(prefix + WAL_PREFIX, base)
                            self.ring.place_record(prefix, WAL_PREFIX + 8, data + 8, n - 8, &pos, _lock_attempts)
                        else:
                            self.ring.place_record(prefix, WAL_PREFIX, data, n, &pos, _lock_attempts)
                    except BaseException as e:
                        raise self.map_error(e) from e
                    # The record is in the WAL from here on: its offsets are taken whatever happens.
                    w.next_off = base + count
                    wal_end = pos + RECORD_HEADER_SIZE + WAL_PREFIX + n
                    fut.base_offset = base
                    fut.wal_end = wal_end
                    if not trylock_spinning(&self.cache.mutex, _lock_attempts):
                        self.cache.acquire()
                    try:
                        if _fail_insert:
                            raise MemoryError("failpoint cache_insert")
                        s = w.slice
                        if s is None or s.block_id != self.cache.active.block_id:
                            s = self.cache._slice_for(w.stream_id, w.epoch)
                            w.slice = s
                        # A Kafka batch is copied, never held (the caller's bytes keep their
                        # baseOffset), and its copy takes the offset.
                        seal = self.cache.insert(s, base, count, data, n, pos, wal_end, True,
                                                 None if kafka else held_owner(payload, n))
                        if kafka:
                            store_be64(<unsigned char*>s.data[s.n - 1], base)
                        self.uncommitted += n
                        w.tail += n
                        w._push_pending(wal_end, base + count)
                        if seal == 1:
                            sealed = self.cache._seal_locked("size")
                        elif seal == 2:
                            # This stream reached the split size: it uploads now as its own
                            # StreamObject; the other streams keep filling (issue 51).
                            sealed = self.cache._cut_locked(self.cache.cut_min, w.stream_id)
                    except BaseException as e:
                        # Durable in the WAL but not in the cache: this stream can no longer be
                        # served consistently here. Fail this append and every later one, clearly.
                        fut.error = self.errors["append_failed"](
                            f"stream {w.stream_id}: the append at offset {base} reached the WAL but not the log "
                            f"cache ({e!r}); the stream stops taking appends here. Close it and open it again "
                            "(what was acknowledged before it is kept).")
                        w.failure = fut.error
                        w.failed_at = base
                    finally:
                        self.cache.release()
                finally:
                    self._unlock_append()
                break
        finally:
            if have_view:
                PyBuffer_Release(&view)
        self.stat_appends += 1
        self.stat_bytes += n
        if (self.stat_appends & (LATENCY_SAMPLE_EVERY - 1)) == 0 and fut.error is None:
            i = self.samples_taken % LATENCY_SAMPLES
            self.sample_ns[i] = fut.submitted_ns
            self.sample_end[i] = fut.wal_end
            self.samples_taken += 1
        if sealed is not None:
            self.on_sealed(sealed)
        if not self.pressure_signalled and self.ring.untrimmed_hint() > self.pressure_bytes:
            self.pressure_signalled = True
            self.on_pressure()
        return fut

    # ---- accounting used by the client and the uploader -----------------------------------------

    def released(self, uint64_t nbytes) -> None:
        """`nbytes` of admitted data were committed: they no longer count against admission."""
        self.cache.acquire()
        self.uncommitted = self.uncommitted - nbytes if self.uncommitted > nbytes else 0
        self.cache.release()

    def pressure_handled(self) -> None:
        """The uploader acted on WAL pressure; the next append above the mark signals again."""
        self.pressure_signalled = False

    def untrimmed_bytes(self) -> int:
        return self.ring.untrimmed_hint()

    def refuse(self, error_type, str message) -> None:
        """From now on every append raises `error_type(message)` (client closed, fenced, failed)."""
        self.refusal = (error_type, message)

    def stats(self) -> dict:
        return dict(appends=self.stat_appends, bytes=self.stat_bytes, lock_waits=self.stat_lock_waits,
                    lease_refusals=self.stat_lease_refusals)

    def take_latency_samples(self) -> list:
        """[(submitted_ns, wal_end)] of the appends sampled (one in LATENCY_SAMPLE_EVERY, all
        streams) since the last call, oldest first; at most the last LATENCY_SAMPLES of them. The
        append is durable once the WAL's durable end passes `wal_end`; the WAL's completion log
        says when. Sampling costs an append a counter test; this is for a metrics scraper."""
        cdef uint64_t first = self.samples_read
        cdef uint64_t i
        if self.samples_taken - first > LATENCY_SAMPLES:
            first = self.samples_taken - LATENCY_SAMPLES
        out = [(self.sample_ns[i % LATENCY_SAMPLES], self.sample_end[i % LATENCY_SAMPLES])
               for i in range(first, self.samples_taken)]
        self.samples_read = self.samples_taken
        return out

    # ---- callbacks ---------------------------------------------------------------------------

    def _add_callback(self, AppendFuture fut, fn) -> None:
        with self.cb_cond:
            heapq.heappush(self.cb_heap, (fut.wal_end, self.cb_seq, fut, fn))
            self.cb_seq += 1
            self.cb_cond.notify()

    def run_callbacks(self) -> None:
        """Body of the engine's callback thread: runs callbacks in WAL order as their appends
        settle. Returns after `stop_callbacks()` once none is left (the WAL is closed by then,
        so every append has settled)."""
        cdef AppendFuture head
        cdef uint64_t durable
        cdef list ready
        cdef bint everything = False
        while True:
            with self.cb_cond:
                while not self.cb_heap and not self.cb_stop:
                    self.cb_cond.wait()
                if not self.cb_heap:
                    return
                head = self.cb_heap[0][2]
                everything = self.cb_stop
            if head.error is None and not everything:
                self.ring._wait(head.wal_end, 0.05)     # bounded: re-checks stop and new heads
            durable = self.ring.acked_hint()
            everything = everything or self.ring.acks_stopped()
            ready = []
            with self.cb_cond:
                while self.cb_heap and (everything or self.cb_heap[0][0] <= durable
                                        or (<AppendFuture>self.cb_heap[0][2]).error is not None):
                    ready.append(heapq.heappop(self.cb_heap))
            for entry in ready:
                try:
                    entry[3](entry[2])
                except BaseException:
                    log.exception("append callback %r raised", entry[3])

    def stop_callbacks(self) -> None:
        """Make `run_callbacks` run what is queued and return."""
        with self.cb_cond:
            self.cb_stop = True
            self.cb_cond.notify_all()
