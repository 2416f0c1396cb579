# cython: language_level=3
"""Group-commit append engine of the WAL ring (format: docs/wal-format.md).

Appenders encode records straight into the open batch, a 4 KiB-aligned buffer that covers a
contiguous span of logical offsets. Writer threads take sealed batches, or seal the open one
the moment they are idle, and write each with one pwrite, followed by one fdatasync for it and
any sealed batches queued behind it that follow it on the device; appends that arrive while a
write is in flight gather in the next batch (group commit). Writers run entirely without the
GIL and never touch Python objects, so durability never waits for the interpreter.

A record is acknowledged when every batch up to and including its own is durable: the durable
watermark advances strictly in offset order even when several writers finish out of order, so
completions are in offset order. Space before the trim offset is the only space reused; a full
ring makes appenders wait (bounded) instead of overwriting.

Acknowledgment deadline (a node's lease, docs/migration.md): durable is not yet acknowledged.
The acknowledged watermark follows the durable one only while CLOCK_MONOTONIC is before
`ack_deadline_ns` (no deadline by default), checked by the writer when a batch becomes durable and
by `set_ack_deadline` when the lease is renewed; records made durable after the deadline wait,
unacknowledged, for a renewal, or fail once `revoke_acks` says the lease is gone for good (the
node was fenced). Every record acknowledged was durable before the deadline. Waits, callbacks and
`done()` follow the acknowledged watermark; `wait_durable`, `durable_end` and `trim` the durable
one (uploads and trims need durability, not acknowledgment).

Locking rules (they keep this deadlock-free and keep the GIL out of the writers' way):
- `mutex` guards all ring state and is held only briefly.
- A thread holding the GIL takes `mutex` only by trylock (`_lock_with_gil`); when that fails it
  releases the GIL, waits for the holder to finish, and tries again. So no thread ever holds
  `mutex` while waiting for the GIL: writers, which never take the GIL, never wait on Python.
- Nothing that can allocate a GC-tracked Python object runs while `mutex` is held.
- Threads waiting for durability (`_wait`) sleep on `done_cv` under their own `wait_mutex`,
  never under `mutex`: waking after each batch, they would otherwise all retake `mutex` just
  when appenders want it. Writers take `wait_mutex` only to broadcast, after each batch once
  they have released `mutex` (a broadcast to sleepers is a system call, and appenders spin for
  `mutex`); waiters read the watermark and failure state, which only writers change, under
  `wait_mutex` alone, and every change is followed by a broadcast, so none is missed.
- The dispatcher sleeps on its own `dispatch_cv`, signalled only when callbacks are queued, so a
  WAL without callbacks never wakes it.
- An append whose placement had to wait registers its callback after releasing `mutex`; until
  it has, its record's end sits in `pending_ends` and the dispatcher stops short of it, so
  callbacks still run in offset order.
"""
import heapq
import logging

from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t, INT64_MAX
from libc.stdlib cimport free, malloc, calloc
from libc.string cimport memcpy, memset
from libc.errno cimport errno, ETIMEDOUT, EIO
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.bytearray cimport PyByteArray_FromStringAndSize, PyByteArray_AS_STRING

from _native.checksum cimport crc32c_update
from _native.sysdeps cimport (
    pthread_mutex_t, pthread_cond_t, pthread_condattr_t, pthread_mutex_init, pthread_mutex_destroy,
    pthread_mutex_lock, pthread_mutex_trylock, trylock_spinning, pthread_mutex_unlock, pthread_condattr_init,
    pthread_condattr_setclock, pthread_condattr_destroy, pthread_cond_init, pthread_cond_destroy,
    pthread_cond_wait, pthread_cond_timedwait, pthread_cond_signal, pthread_cond_broadcast,
    CLOCK_MONOTONIC, timespec, posix_memalign, pwrite_full, fdatasync, monotonic_ns, deadline_after,
)
from _native.walrecord cimport (
    BLOCK_SIZE, RECORD_HEADER_SIZE, RECORD_TYPE_DATA, RECORD_TYPE_PADDING,
    align_up, record_start, encode_record_header,
)

log = logging.getLogger("wal")

cdef enum:
    SLOT_FREE = 0
    SLOT_OPEN = 1
    SLOT_SEALED = 2
    SLOT_WRITING = 3
    SLOT_WRITTEN = 4

cdef enum:
    PLACE_OK = 0
    PLACE_WAIT_SPACE = 1
    PLACE_WAIT_BUFFER = 2
    PLACE_CLOSED = 3
    PLACE_FAILED = 4
    PLACE_NOMEM = 5

cdef enum:
    COMPLETION_LOG = 16384
    PENDING_SLOTS = 256
    # Below this size, CRC and copy run with the GIL held (about 0.3 ms at 1 MiB). Releasing the
    # GIL costs far more whenever another Python thread is busy: taking it back then waits for
    # the interpreter's switch interval (5 ms).
    NOGIL_BYTES = 1048576

# Upper bounds (ns) of the write latency buckets (a group's pwrites, then its fdatasync, timed by the writer):
# s3stream.latency.LATENCY_BUCKETS in nanoseconds, plus +Inf (write_hist has one more slot).
cdef int64_t WRITE_BOUNDS_NS[17]
WRITE_BOUNDS_NS[:] = [100_000, 250_000, 500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000,
                      25_000_000, 50_000_000, 100_000_000, 250_000_000, 500_000_000, 1_000_000_000,
                      2_500_000_000, 5_000_000_000, 10_000_000_000, 30_000_000_000]

cdef uint64_t NO_SEQ = 0xFFFFFFFFFFFFFFFF


cdef class AppendHandle:
    """The pending acknowledgement of one appended record (a lightweight future).

    `offset` is the record's logical WAL offset and `end` the offset just past it; pass `end` to
    `trim` once the record's data is safe elsewhere. `result()` returns `offset` once the record
    is durable, or raises the WAL's failure.
    """

    def done(self) -> bool:
        return self.ring._settled(self.end) != 0

    def result(self, timeout=None) -> int:
        cdef int state = self.ring._wait(self.end, timeout)
        if state == 1:
            return self.offset
        if state == 2:
            raise self.ring._failure()
        raise TimeoutError(f"WAL record at offset {self.offset} not durable after {timeout} s")

    def exception(self, timeout=None):
        cdef int state = self.ring._wait(self.end, timeout)
        if state == 1:
            return None
        if state == 2:
            return self.ring._failure()
        raise TimeoutError(f"WAL record at offset {self.offset} not durable after {timeout} s")

    def add_done_callback(self, fn) -> None:
        """Call `fn(handle)` once settled. Callbacks given to `append` run in offset order;
        one added later may run before earlier records' callbacks."""
        self.ring._add_callback(self, fn)

    @property
    def completed_ns(self):
        """CLOCK_MONOTONIC time the record became durable, None if pending or too old to know."""
        return self.ring._completion_time(self.end)

    def __repr__(self):
        return f"<AppendHandle offset={self.offset} end={self.end} done={self.done()}>"


cdef class Ring:
    """The in-memory half of the WAL: offsets, batches, writers. The `wal` package owns the
    file, the header and recovery, and hands the Ring where to resume."""

    def __cinit__(self, int fd, uint64_t header_area, uint64_t capacity, size_t batch_size,
                  int nbatches, uint32_t generation, uint64_t resume_offset, uint64_t trim_offset,
                  resume_block, double full_timeout, size_t max_record, errors):
        cdef pthread_condattr_t attr
        cdef void* p
        cdef int i
        cdef Py_buffer view
        self.batches = NULL
        self.resume_block = NULL
        self.log_end = NULL
        self.log_ns = NULL
        if capacity == 0 or capacity % BLOCK_SIZE:
            raise ValueError(f"ring capacity must be a positive multiple of {BLOCK_SIZE}")
        if batch_size < 2 * BLOCK_SIZE or batch_size % BLOCK_SIZE:
            raise ValueError(f"batch size must be a multiple of {BLOCK_SIZE} and at least {2 * BLOCK_SIZE}")
        if nbatches < 2:
            raise ValueError("the ring needs at least 2 batch buffers")
        if max_record + RECORD_HEADER_SIZE + BLOCK_SIZE > capacity:
            raise ValueError(f"max record {max_record} does not fit a ring of {capacity} bytes")
        if trim_offset > resume_offset or resume_offset - trim_offset > capacity:
            raise ValueError(f"resume offset {resume_offset} is not within one ring of trim offset {trim_offset}")
        self.full_error, self.closed_error, self.failed_error, self.too_large_error = errors
        self.fd = fd
        self.header_area = header_area
        self.capacity = capacity
        self.batch_size = batch_size
        self.nbatches = nbatches
        self.generation = generation
        self.max_record = max_record
        self.next_offset = resume_offset
        self._trim_offset = trim_offset
        self._fill_end = NO_SEQ
        self._durable_end = resume_offset
        self._acked_end = resume_offset
        self.ack_deadline_ns = INT64_MAX
        self._appended_end = resume_offset
        self.dispatched_end = resume_offset
        self.failed_seq = NO_SEQ
        self.full_timeout_ns = <int64_t>(full_timeout * 1e9)
        self.callbacks = []
        self.batches = <Batch*>calloc(nbatches, sizeof(Batch))
        self.log_end = <uint64_t*>calloc(COMPLETION_LOG, sizeof(uint64_t))
        self.log_ns = <int64_t*>calloc(COMPLETION_LOG, sizeof(int64_t))
        if self.batches == NULL or self.log_end == NULL or self.log_ns == NULL:
            raise MemoryError("cannot allocate WAL ring state")
        for i in range(nbatches):
            if posix_memalign(&p, BLOCK_SIZE, batch_size) != 0:
                raise MemoryError(f"cannot allocate {nbatches} WAL batch buffers of {batch_size} bytes")
            memset(p, 0, batch_size)
            self.batches[i].buf = <unsigned char*>p
            self.batches[i].buf_size = batch_size
        if resume_offset % BLOCK_SIZE:
            # The session resumes inside a block an earlier session wrote: its first write
            # rewrites that block with the same leading bytes, so even a torn rewrite keeps them.
            PyObject_GetBuffer(resume_block, &view, PyBUF_SIMPLE)
            try:
                if view.len != BLOCK_SIZE:
                    raise ValueError(f"resume block must be {BLOCK_SIZE} bytes, got {view.len}")
                self.resume_block = <unsigned char*>malloc(BLOCK_SIZE)
                if self.resume_block == NULL:
                    raise MemoryError()
                memcpy(self.resume_block, view.buf, BLOCK_SIZE)
            finally:
                PyBuffer_Release(&view)
        pthread_mutex_init(&self.mutex, NULL)
        pthread_mutex_init(&self.wait_mutex, NULL)
        pthread_condattr_init(&attr)
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        pthread_cond_init(&self.work_cv, &attr)
        pthread_cond_init(&self.space_cv, &attr)
        pthread_cond_init(&self.done_cv, &attr)
        pthread_cond_init(&self.dispatch_cv, &attr)
        pthread_cond_init(&self.reg_cv, &attr)
        pthread_condattr_destroy(&attr)
        memset(self.pending_ends, 0, sizeof(self.pending_ends))
        self.initialized = True

    def __dealloc__(self):
        cdef int i
        if self.batches != NULL:
            for i in range(self.nbatches):
                free(self.batches[i].buf)
            free(self.batches)
        if self.initialized:
            pthread_cond_destroy(&self.work_cv)
            pthread_cond_destroy(&self.space_cv)
            pthread_cond_destroy(&self.done_cv)
            pthread_cond_destroy(&self.dispatch_cv)
            pthread_cond_destroy(&self.reg_cv)
            pthread_mutex_destroy(&self.wait_mutex)
            pthread_mutex_destroy(&self.mutex)
        free(self.resume_block)
        free(self.log_end)
        free(self.log_ns)

    # ---- locking helpers -------------------------------------------------------------------

    cdef void _lock_with_gil(self) noexcept:
        # Take the mutex while holding the GIL without ever holding the mutex while waiting
        # for the GIL (see the module docstring): try; if busy, wait for the holder without
        # the GIL, let go, and try again with it.
        while pthread_mutex_trylock(&self.mutex) != 0:
            with nogil:
                pthread_mutex_lock(&self.mutex)
                pthread_mutex_unlock(&self.mutex)

    cdef void _wake_waiters(self) noexcept nogil:
        """Wake durability waiters and, if callbacks are queued, the dispatcher (mutex held)."""
        self._wake_durability_waiters(self.ncallbacks or self.dispatch_stop)

    cdef void _wake_durability_waiters(self, bint dispatcher) noexcept nogil:
        """Wake durability waiters, and the dispatcher if `dispatcher` (mutex held or not)."""
        pthread_mutex_lock(&self.wait_mutex)
        pthread_cond_broadcast(&self.done_cv)
        pthread_mutex_unlock(&self.wait_mutex)
        if dispatcher:
            pthread_cond_signal(&self.dispatch_cv)

    cdef int _reserve_pending(self) noexcept nogil:
        """A free pending-registration slot (mutex held; waits if all are taken)."""
        cdef int i
        while True:
            for i in range(PENDING_SLOTS):
                if self.pending_ends[i] == 0:
                    self.pending_ends[i] = NO_SEQ     # reserved; the end is set once placed
                    self.pending_count += 1
                    return i
            pthread_cond_wait(&self.reg_cv, &self.mutex)

    cdef void _release_pending(self, int slot) noexcept nogil:
        self.pending_ends[slot] = 0
        self.pending_count -= 1
        pthread_cond_signal(&self.reg_cv)
        pthread_cond_signal(&self.dispatch_cv)

    cdef uint64_t _dispatchable_end(self) noexcept nogil:
        """Callbacks of records ending at or below this may run (mutex held)."""
        cdef uint64_t upto = self._acked_end
        cdef int i
        if self.pending_count:
            for i in range(PENDING_SLOTS):
                if self.pending_ends[i] != 0 and self.pending_ends[i] - 1 < upto:
                    upto = self.pending_ends[i] - 1
        return upto

    # ---- placement (mutex held) -------------------------------------------------------------

    cdef Batch* _slot(self, uint64_t seq) noexcept nogil:
        return &self.batches[seq % <uint64_t>self.nbatches]

    cdef void _seal(self, Batch* b, bint wrap) noexcept nogil:
        """Close the open batch: pad to the block boundary (or to the end of the ring lap)."""
        cdef uint64_t p = b.pos
        cdef uint64_t q = record_start(p)
        cdef uint64_t lap_end, end, write_end
        if wrap:
            lap_end = (q // self.capacity + 1) * self.capacity
            encode_record_header(b.buf + (q - b.start), RECORD_TYPE_PADDING,
                                 <uint32_t>(lap_end - q - RECORD_HEADER_SIZE), 0, q, self.generation)
            end = lap_end
            write_end = align_up(q + RECORD_HEADER_SIZE)
        else:
            if q == p and (p & (BLOCK_SIZE - 1)) != 0:
                encode_record_header(b.buf + (p - b.start), RECORD_TYPE_PADDING,
                                     <uint32_t>(align_up(p) - p - RECORD_HEADER_SIZE), 0, p, self.generation)
            end = align_up(p)
            write_end = end
        b.write_len = <size_t>(write_end - b.start)
        b.state = SLOT_SEALED
        self.has_open = False
        self.open_seq += 1
        self.next_offset = end
        if self.idle_writers > 0:
            pthread_cond_signal(&self.work_cv)

    cdef int _place(self, size_t body_len, uint64_t* out_pos) noexcept nogil:
        """Find where the next record goes, opening/sealing batches as needed. Mutex held."""
        cdef size_t rec_len = RECORD_HEADER_SIZE + body_len
        cdef Batch* b
        cdef uint64_t q, lap_end
        cdef size_t need
        cdef void* p
        while True:
            if self.io_errno:
                return PLACE_FAILED
            if self.stopping:
                return PLACE_CLOSED
            if not self.has_open:
                if self.open_seq - self.done_seq >= <uint64_t>self.nbatches:
                    return PLACE_WAIT_BUFFER
                b = self._slot(self.open_seq)
                b.start = self.next_offset & ~(<uint64_t>(BLOCK_SIZE - 1))
                b.pos = self.next_offset
                b.data_end = 0
                b.records = 0
                b.write_len = 0
                b.error = 0
                b.state = SLOT_OPEN
                if b.start < self.next_offset:
                    memcpy(b.buf, self.resume_block, <size_t>(self.next_offset - b.start))
                self.has_open = True
            b = self._slot(self.open_seq)
            q = record_start(b.pos)
            # Before the lap check: a wrap's padding block must not land beyond the fill either.
            if q + rec_len > self._fill_end:
                return PLACE_WAIT_SPACE
            lap_end = (q // self.capacity + 1) * self.capacity
            if q + rec_len > lap_end:
                # The padding record that ends the lap is written too (its header's block): like
                # a record, it waits for that block to be trimmed, which in a ring full to within
                # a block holds the oldest live record.
                if align_up(q + RECORD_HEADER_SIZE) - self._trim_offset > self.capacity:
                    return PLACE_WAIT_SPACE
                self._seal(b, True)
                continue
            if b.start < q and q % self.capacity == 0:
                # The record opens a lap (the one before ended within a record header of its
                # end, so without a padding record) but the batch began in the lap before. A
                # batch is one pwrite from the physical place of its start, so it would run
                # past the ring's end: end the batch at the lap's end, or, holding nothing yet
                # (a session resumed in the lap's last block), start it at the lap's beginning.
                if b.records > 0:
                    self._seal(b, False)
                    continue
                b.start = q
                b.pos = q
            need = <size_t>(q - b.start) + rec_len
            if need + BLOCK_SIZE > b.buf_size:
                if b.records > 0:
                    self._seal(b, False)
                    continue
                # A record larger than a batch gets a batch of its own, sized for it.
                if posix_memalign(&p, BLOCK_SIZE, <size_t>align_up(need) + BLOCK_SIZE) != 0:
                    return PLACE_NOMEM
                memcpy(p, b.buf, <size_t>(q - b.start))
                free(b.buf)
                b.buf = <unsigned char*>p
                b.buf_size = <size_t>align_up(need) + BLOCK_SIZE
            if align_up(q + rec_len) - self._trim_offset > self.capacity:
                return PLACE_WAIT_SPACE
            out_pos[0] = q
            return PLACE_OK

    cdef int _place_and_copy(self, const unsigned char* prefix, size_t plen,
                             const unsigned char* data, size_t n, uint32_t crc,
                             uint64_t* out_pos, bint may_wait) noexcept nogil:
        """Place and encode one record (mutex held). Waits for space only if `may_wait`."""
        cdef int rc
        cdef int w
        cdef Batch* b
        cdef unsigned char* dst
        cdef timespec deadline
        cdef bint have_deadline = False
        cdef int64_t waited_from = 0, waited
        while True:
            rc = self._place(plen + n, out_pos)
            if rc != PLACE_WAIT_SPACE and rc != PLACE_WAIT_BUFFER:
                break
            if not may_wait:
                return rc
            if not have_deadline:
                waited_from = monotonic_ns()
                deadline_after(&deadline, self.full_timeout_ns)
                have_deadline = True
            if rc == PLACE_WAIT_SPACE:
                self.stat_full_waits += 1
            else:
                self.stat_buffer_waits += 1
            w = pthread_cond_timedwait(&self.space_cv, &self.mutex, &deadline)
            if w == ETIMEDOUT:
                rc = self._place(plen + n, out_pos)
                break
        if have_deadline:
            waited = monotonic_ns() - waited_from
            self.stat_wait_ns += waited
            if waited > self.stat_wait_max_ns:
                self.stat_wait_max_ns = waited
        if rc != PLACE_OK:
            return rc
        b = self._slot(self.open_seq)
        dst = b.buf + (out_pos[0] - b.start)
        encode_record_header(dst, RECORD_TYPE_DATA, <uint32_t>(plen + n), crc, out_pos[0], self.generation)
        if plen:
            memcpy(dst + RECORD_HEADER_SIZE, prefix, plen)
        memcpy(dst + RECORD_HEADER_SIZE + plen, data, n)
        n += plen
        b.pos = out_pos[0] + RECORD_HEADER_SIZE + n
        b.data_end = b.pos
        self._appended_end = b.pos
        b.records += 1
        self.stat_records += 1
        self.stat_record_bytes += n
        if self.idle_writers > 0:
            pthread_cond_signal(&self.work_cv)
        return PLACE_OK

    cdef int place_record(self, const unsigned char* prefix, size_t plen,
                          const unsigned char* data, size_t n, uint64_t* out_pos, int attempts) except -1:
        """Encode one record whose body is `prefix + data` into the ring (GIL held); returns 0
        with its logical offset in `out_pos`, or raises the configured errors. Waits without the
        GIL (at most `full_timeout`) for space or a free batch buffer. The native append path of
        the engine calls this directly; it never registers a callback. The mutex is tried up to
        `attempts` times with the GIL before waiting for it without the GIL: the engine's caller
        holds its append lock, which every other appender waits for, so giving up the GIL there
        only hands it to threads that will block (and must then be woken one by one)."""
        cdef uint32_t crc
        cdef int rc = PLACE_WAIT_SPACE
        if n + plen > self.max_record:
            raise self.too_large_error(f"record of {n + plen} bytes exceeds the WAL's maximum record size of "
                                       f"{self.max_record} bytes; split it or raise max_record_bytes")
        if n < NOGIL_BYTES:
            crc = crc32c_update(crc32c_update(0, prefix, plen), data, n)
            if trylock_spinning(&self.mutex, attempts):
                rc = self._place_and_copy(prefix, plen, data, n, crc, out_pos, False)
                pthread_mutex_unlock(&self.mutex)
            else:
                self.stat_lock_waits += 1       # GIL held: no other thread counts meanwhile
        else:
            with nogil:
                crc = crc32c_update(crc32c_update(0, prefix, plen), data, n)
        if rc == PLACE_WAIT_SPACE or rc == PLACE_WAIT_BUFFER:
            with nogil:
                pthread_mutex_lock(&self.mutex)
                rc = self._place_and_copy(prefix, plen, data, n, crc, out_pos, True)
                pthread_mutex_unlock(&self.mutex)
        if rc != PLACE_OK:
            raise self._place_error(rc, n + plen)
        return 0

    cdef uint64_t durable_hint(self) noexcept nogil:
        """The durable watermark read without the mutex: monotonic, possibly a moment old."""
        return self._durable_end

    cdef uint64_t acked_hint(self) noexcept nogil:
        """The acknowledged watermark read without the mutex: monotonic, possibly a moment old."""
        return self._acked_end

    cdef bint acks_stopped(self) noexcept nogil:
        """No record not yet acknowledged ever will be: the WAL failed or acks were revoked."""
        return self.revoked or self.io_errno != 0

    cdef uint64_t untrimmed_hint(self) noexcept nogil:
        """Bytes of the ring between the trim offset and the append position, read without the
        mutex (for pressure checks that tolerate a moment's staleness)."""
        cdef uint64_t end = self._appended_end
        cdef uint64_t trim = self._trim_offset
        return end - trim if end > trim else 0

    cdef object failure(self):
        """The WAL's failure as an exception, or None while it works."""
        return self._failure() if self.io_errno else None

    # ---- public append ------------------------------------------------------------------------

    def append(self, data, callback=None, prefix=None) -> AppendHandle:
        """Append one record whose body is `prefix + data` (prefix: optional small header,
        saving the caller a copy of `data`); returns its handle at once. Raises the configured
        errors when the WAL is closed or failed, or when the ring stays full for `full_timeout`."""
        cdef Py_buffer view
        cdef Py_buffer pview
        cdef uint32_t crc
        cdef uint64_t pos = 0
        cdef int rc
        cdef size_t n, plen = 0
        cdef const unsigned char* src
        cdef const unsigned char* psrc = NULL
        cdef AppendHandle handle = AppendHandle.__new__(AppendHandle)
        cdef list entry = None
        cdef int slot = -1
        cdef bint waited
        handle.ring = self
        if callback is not None:
            entry = [0, 0, handle, callback]
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        if prefix is not None:
            try:
                PyObject_GetBuffer(prefix, &pview, PyBUF_SIMPLE)
            except BaseException:
                PyBuffer_Release(&view)
                raise
            psrc = <const unsigned char*>pview.buf
            plen = <size_t>pview.len
        try:
            n = <size_t>view.len
            src = <const unsigned char*>view.buf
            if n + plen > self.max_record:
                raise self.too_large_error(f"record of {n + plen} bytes exceeds the WAL's maximum record size of "
                                           f"{self.max_record} bytes; split it or raise max_record_bytes")
            handle.submitted_ns = monotonic_ns()
            if entry is None:
                self.place_record(psrc, plen, src, n, &pos, 1)
                handle.offset = pos
                handle.end = pos + RECORD_HEADER_SIZE + plen + n
                return handle
            rc = PLACE_WAIT_SPACE
            waited = True
            # One trylock: when the writer holds the mutex, the nogil path below lets other
            # Python threads run meanwhile (measured faster than spinning with the GIL).
            if n < NOGIL_BYTES and pthread_mutex_trylock(&self.mutex) == 0:
                # Fast path, GIL and mutex held (taken by trylock): place without waiting.
                crc = crc32c_update(crc32c_update(0, psrc, plen), src, n)
                rc = self._place_and_copy(psrc, plen, src, n, crc, &pos, False)
                if rc == PLACE_OK:
                    waited = False
                    handle.offset = pos
                    handle.end = pos + RECORD_HEADER_SIZE + plen + n
                    if entry is not None:
                        entry[0] = handle.end
                        entry[1] = self.callback_seq
                        self.callback_seq += 1
                        heapq.heappush(self.callbacks, entry)
                        self.ncallbacks += 1
                pthread_mutex_unlock(&self.mutex)
            elif n >= NOGIL_BYTES:
                with nogil:
                    crc = crc32c_update(crc32c_update(0, psrc, plen), src, n)
            else:
                self.stat_lock_waits += 1
                crc = crc32c_update(crc32c_update(0, psrc, plen), src, n)
            if waited and (rc == PLACE_WAIT_SPACE or rc == PLACE_WAIT_BUFFER):
                # Slow path: wait without the GIL; the mutex is released before the GIL is
                # taken back, so the callback is registered afterwards (pending slot).
                with nogil:
                    pthread_mutex_lock(&self.mutex)
                    if entry is not None:
                        slot = self._reserve_pending()
                    rc = self._place_and_copy(psrc, plen, src, n, crc, &pos, True)
                    if entry is not None:
                        if rc == PLACE_OK:
                            self.pending_ends[slot] = pos + RECORD_HEADER_SIZE + plen + n
                        else:
                            self._release_pending(slot)
                    pthread_mutex_unlock(&self.mutex)
                if rc == PLACE_OK:
                    handle.offset = pos
                    handle.end = pos + RECORD_HEADER_SIZE + plen + n
                    if entry is not None:
                        self._register(handle, callback, slot)
        finally:
            PyBuffer_Release(&view)
            if prefix is not None:
                PyBuffer_Release(&pview)
        if rc != PLACE_OK:
            raise self._place_error(rc, n + plen)
        return handle

    cdef object _place_error(self, int rc, size_t n):
        if rc == PLACE_CLOSED:
            return self.closed_error("the WAL is closed; reopen it to append")
        if rc == PLACE_FAILED:
            return self._failure()
        if rc == PLACE_NOMEM:
            return MemoryError(f"cannot allocate a WAL batch buffer for a {n}-byte record")
        if rc == PLACE_WAIT_SPACE and self._fill_end != NO_SEQ:
            return self.full_error(
                f"WAL first fill is behind: no room for a {n}-byte record within {self.full_timeout_ns / 1e9:g} s "
                f"because the new WAL file is zero-filled only up to {self._fill_end} of {self.capacity} bytes "
                "(preallocate='background'; appends wait for it rather than overwrite it). The disk is slower "
                "than the appends: retry, raise full_timeout, or create WALs with preallocate='zeros'.")
        if rc == PLACE_WAIT_SPACE:
            return self.full_error(
                f"WAL full: no room for a {n}-byte record within {self.full_timeout_ns / 1e9:g} s; "
                f"untrimmed {self.next_offset - self._trim_offset} of {self.capacity} bytes. "
                "Trim records whose data is safe elsewhere, or give the WAL more capacity.")
        return self.full_error(
            f"WAL writer backlog: all {self.nbatches} batch buffers stayed in flight for "
            f"{self.full_timeout_ns / 1e9:g} s (the device is not keeping up)")

    cdef object _failure(self):
        import os
        if self.revoked:
            return self.revoked_error
        if self.external_error is not None:
            # A fresh instance per raiser: one exception raised in several threads would
            # collect all their tracebacks.
            return type(self.external_error)(*self.external_error.args)
        return self.failed_error(
            f"WAL write failed ({os.strerror(self.io_errno)}); records not yet durable are lost "
            "to this session and the WAL accepts no more appends: reopen it to recover")

    # ---- writers -------------------------------------------------------------------------------

    def run_writer(self) -> None:
        """Body of one writer thread: returns once `stop()` was called and all is written."""
        with nogil:
            self._writer_loop()

    cdef void _writer_loop(self) noexcept nogil:
        cdef int64_t took, synced
        cdef uint64_t seq, i, group
        cdef Batch* b
        cdef Batch* nb
        cdef int err
        cdef Batch* ob
        cdef bint wake_dispatcher
        pthread_mutex_lock(&self.mutex)
        while True:
            if self.write_seq < self.open_seq:
                pass
            elif self.has_open and self._slot(self.open_seq).records > 0:
                self._seal(self._slot(self.open_seq), False)
            elif self.stopping:
                break
            else:
                self.idle_writers += 1
                pthread_cond_wait(&self.work_cv, &self.mutex)
                self.idle_writers -= 1
                continue
            # This batch, and the sealed ones queued behind it that follow it on the device
            # (not across the end of the ring), in one group: their pwrites, then one fdatasync.
            # A device whose syncs slow down then costs one sync per backlog, not per batch, so
            # the buffers free as fast as it writes (group commit across batches).
            seq = self.write_seq
            b = self._slot(seq)
            group = 1
            while self.write_seq + group < self.open_seq:
                nb = self._slot(self.write_seq + group)
                if (nb.state != SLOT_SEALED or b.start % self.capacity + b.write_len
                        != nb.start % self.capacity):
                    break
                b = nb
                group += 1
            for i in range(group):
                self._slot(seq + i).state = SLOT_WRITING
            self.write_seq += group
            err = self.io_errno
            pthread_mutex_unlock(&self.mutex)
            took = synced = -1
            if err == 0:
                took = monotonic_ns()
                for i in range(group):
                    b = self._slot(seq + i)
                    err = pwrite_full(self.fd, b.buf, b.write_len,
                                      <long long>(self.header_area + b.start % self.capacity))
                    if err:
                        break
                synced = monotonic_ns()
                if err == 0 and fdatasync(self.fd) != 0:
                    err = errno
                took, synced = synced - took, monotonic_ns() - synced
            pthread_mutex_lock(&self.mutex)
            self._retire(seq, group, err, took, synced)
            # Wake outside the mutex: a broadcast with sleepers is a system call, and appenders
            # spin for this mutex with the GIL (a state change made under the mutex and woken
            # for after it loses no wake-up: a sleeper checked before the change, under it).
            wake_dispatcher = self.ncallbacks or self.dispatch_stop
            pthread_mutex_unlock(&self.mutex)
            self._wake_durability_waiters(wake_dispatcher)
            pthread_cond_broadcast(&self.space_cv)
            pthread_mutex_lock(&self.mutex)
        self._wake_waiters()
        pthread_cond_signal(&self.dispatch_cv)
        pthread_mutex_unlock(&self.mutex)

    cdef void _retire(self, uint64_t seq, uint64_t group, int err, int64_t took, int64_t synced) noexcept nogil:
        """Batches [seq, seq + group) were written (err 0; `took`/`synced` ns, -1 untimed) or
        failed (errno `err`): count them and move the watermarks. Mutex held."""
        cdef uint64_t i
        cdef Batch* b
        if err == 0 and took >= 0:
            _count_latency(self.write_hist, &self.write_ns_sum, took)
            if synced >= 0:
                _count_latency(self.sync_hist, &self.sync_ns_sum, synced)
            self.stat_syncs += 1
        for i in range(group):
            b = self._slot(seq + i)
            b.state = SLOT_WRITTEN
            b.error = err
            if err:
                if seq + i < self.failed_seq:
                    self.failed_seq = seq + i
                if self.io_errno == 0:
                    self.io_errno = err
            else:
                self.stat_batches += 1
                self.stat_bytes_written += b.write_len
        self._advance()

    # ---- external writers (a WAL kept as objects) ----------------------------------------------

    def take_batch(self, double timeout, double seal_gap, Py_ssize_t reserve=0, uint64_t seal_bytes=0):
        """For writers outside the ring (wal.objectlog: each PUTs a batch as one object): wait,
        GIL released, at most `timeout` seconds for the next batch to write and return it as
        (seq, start offset, bytes), the bytes a copy made after the batch left the appenders'
        hands (a bytearray that starts with `reserve` zero bytes for the caller's header, so
        that the batch is copied once). A sealed batch is taken at once; the open one is sealed and taken once it holds
        a record and `seal_gap` seconds have passed since the previous take, or at once when it
        holds `seal_bytes` or more (0: no such size): that bounds the write rate at low load,
        where batches are small, and adds no wait where they are large. A full batch seals
        itself. None on timeout; False once `stop()`
        was called and every batch was taken. Every batch taken must be given back to
        `finish_batch`, in any order; acknowledgments follow in offset order."""
        cdef int64_t gap_ns = <int64_t>(seal_gap * 1e9)
        cdef int64_t until = monotonic_ns() + <int64_t>(timeout * 1e9)
        cdef int64_t now = 0, wake_at
        cdef timespec ts
        cdef uint64_t seq = 0
        cdef int outcome = 0        # 0 timed out, 1 took a batch, 2 stopped and drained
        cdef Batch* b
        cdef char* dst
        with nogil:
            pthread_mutex_lock(&self.mutex)
            while True:
                now = monotonic_ns()
                wake_at = until
                if self.write_seq < self.open_seq:
                    outcome = 1
                    break
                if self.has_open and self._slot(self.open_seq).records > 0:
                    b = self._slot(self.open_seq)
                    if self.stopping or now - self.last_take_ns >= gap_ns or (
                            seal_bytes and b.pos - b.start >= seal_bytes):
                        self._seal(self._slot(self.open_seq), False)
                        outcome = 1
                        break
                    if self.last_take_ns + gap_ns < wake_at:
                        wake_at = self.last_take_ns + gap_ns
                elif self.stopping:
                    outcome = 2
                    break
                if now >= until:
                    break
                deadline_after(&ts, wake_at - now)
                self.idle_writers += 1
                pthread_cond_timedwait(&self.work_cv, &self.mutex, &ts)
                self.idle_writers -= 1
            if outcome == 1:
                seq = self.write_seq
                self._slot(seq).state = SLOT_WRITING
                self.write_seq += 1
                self.last_take_ns = now
            pthread_mutex_unlock(&self.mutex)
        if outcome == 0:
            return None
        if outcome == 2:
            return False
        b = self._slot(seq)     # SLOT_WRITING: no appender or writer touches it until finished
        out = PyByteArray_FromStringAndSize(NULL, reserve + <Py_ssize_t>b.write_len)
        dst = PyByteArray_AS_STRING(out)
        memset(dst, 0, reserve)
        with nogil:                     # megabytes: let the appenders run meanwhile
            memcpy(dst + reserve, b.buf, b.write_len)
        return (seq, b.start, out)

    def finish_batch(self, uint64_t seq, error=None, int64_t took_ns=-1) -> None:
        """Batch `seq` (from `take_batch`) is durable (`error` None; `took_ns` its write time,
        for the latency histogram) or never will be: then `error`, an exception, becomes the
        WAL's failure (the first one given is kept), the batch and every later one fail, and
        appends are refused."""
        cdef bint wake_dispatcher
        if error is not None and self.external_error is None:
            self.external_error = error
        self._lock_with_gil()
        self._retire(seq, 1, 0 if error is None else EIO, -1 if error is not None else took_ns, -1)
        wake_dispatcher = self.ncallbacks or self.dispatch_stop
        pthread_mutex_unlock(&self.mutex)
        with nogil:
            self._wake_durability_waiters(wake_dispatcher)
            pthread_cond_broadcast(&self.space_cv)
            if error is not None:
                pthread_mutex_lock(&self.mutex)
                self._wake_waiters()
                pthread_mutex_unlock(&self.mutex)

    @property
    def retired_batches(self) -> int:
        """Batches retired in order (written, or failed): every batch of a lower sequence is too."""
        return self.done_seq

    cdef void _advance(self) noexcept nogil:
        """Retire written batches in offset order, moving the durable watermark. Mutex held."""
        cdef Batch* b
        cdef void* p
        cdef uint64_t i
        cdef int64_t now
        while self.done_seq < self.write_seq:
            b = self._slot(self.done_seq)
            if b.state != SLOT_WRITTEN:
                break
            if self.done_seq < self.failed_seq and b.data_end > self._durable_end:
                self._durable_end = b.data_end
                now = monotonic_ns()
                i = self.log_count % COMPLETION_LOG
                self.log_end[i] = b.data_end
                self.log_ns[i] = now
                self.log_count += 1
                # Durable at `now` at the latest: acknowledged only if that is within the lease.
                if now < self.ack_deadline_ns and not self.revoked:
                    self._acked_end = self._durable_end
                else:
                    self.stat_held_advances += 1
            if b.buf_size != self.batch_size:
                if posix_memalign(&p, BLOCK_SIZE, self.batch_size) == 0:
                    free(b.buf)
                    b.buf = <unsigned char*>p
                    b.buf_size = self.batch_size
            b.state = SLOT_FREE
            self.done_seq += 1

    def stop(self) -> None:
        """Refuse new appends; writers drain what was accepted, then return."""
        self._lock_with_gil()
        self.stopping = True
        pthread_cond_broadcast(&self.work_cv)
        pthread_cond_broadcast(&self.space_cv)
        self._wake_waiters()
        pthread_mutex_unlock(&self.mutex)

    # ---- waiting and callbacks ----------------------------------------------------------------

    cdef int _settled_locked(self, uint64_t end, bint acked) noexcept nogil:
        """1 if everything before `end` is acknowledged (`acked`) or durable, 2 if it never
        will be, else 0."""
        if (self._acked_end if acked else self._durable_end) >= end:
            return 1
        if acked and self.revoked:
            return 2
        if self.io_errno and self.done_seq > self.failed_seq:
            return 2
        return 0

    cdef int _settled(self, uint64_t end) noexcept:
        cdef int s
        if self._acked_end >= end:      # the watermark only grows: no mutex to say yes
            return 1
        self._lock_with_gil()
        s = self._settled_locked(end, True)
        pthread_mutex_unlock(&self.mutex)
        return s

    cdef int _wait(self, uint64_t end, timeout) except -1:
        """Wait for the acknowledgment of everything before `end`: 1 acknowledged, 2 failed (or
        revoked), 0 timed out."""
        return self._wait_for(end, timeout, True)

    cdef int _wait_for(self, uint64_t end, timeout, bint acked) except -1:
        """1 acknowledged (`acked`) or durable, 2 failed, 0 timed out."""
        cdef int s
        cdef timespec deadline
        cdef bint forever = timeout is None
        cdef int64_t delay = 0
        if (self._acked_end if acked else self._durable_end) >= end:    # most waits: no mutex
            return 1
        if not forever:
            delay = <int64_t>(float(timeout) * 1e9)
        s = self._settled_locked(end, acked)    # what only writers change, read without a lock
        if s == 0 and (forever or delay > 0):
            with nogil:
                deadline_after(&deadline, delay)
                pthread_mutex_lock(&self.wait_mutex)
                while True:
                    s = self._settled_locked(end, acked)
                    if s != 0:
                        break
                    if forever:
                        pthread_cond_wait(&self.done_cv, &self.wait_mutex)
                    elif pthread_cond_timedwait(&self.done_cv, &self.wait_mutex, &deadline) == ETIMEDOUT:
                        s = self._settled_locked(end, acked)
                        break
                pthread_mutex_unlock(&self.wait_mutex)
        return s

    def wait_durable(self, uint64_t end, timeout=None) -> bool:
        """Block until everything before logical offset `end` is durable (acknowledged or not);
        False on timeout. Raises the WAL's failure if that can never happen."""
        cdef int s = self._wait_for(end, timeout, False)
        if s == 2:
            raise self._failure()
        return s == 1

    # ---- the acknowledgment deadline (a lease) ------------------------------------------------

    def set_ack_deadline(self, int64_t deadline_ns) -> None:
        """Acknowledge durable records only before CLOCK_MONOTONIC `deadline_ns` (a lease renewed
        until then; INT64_MAX: no deadline). If it lies ahead, everything durable now is
        acknowledged at once (records held while the lease had run out). Ignored once revoked."""
        cdef bint wake = False
        self._lock_with_gil()
        if not self.revoked:
            self.ack_deadline_ns = deadline_ns
            if monotonic_ns() < deadline_ns and self._acked_end < self._durable_end:
                self._acked_end = self._durable_end
                wake = True
        pthread_mutex_unlock(&self.mutex)
        if wake:
            with nogil:
                pthread_mutex_lock(&self.mutex)
                self._wake_waiters()
                pthread_mutex_unlock(&self.mutex)

    def revoke_acks(self, error) -> None:
        """Acknowledge nothing more, ever: records not acknowledged yet fail with `error` (the
        node was fenced: its lease is gone for good). Durable records stay in the WAL."""
        self._lock_with_gil()
        self.revoked_error = error
        self.revoked = True
        self.ack_deadline_ns = 0
        pthread_mutex_unlock(&self.mutex)
        with nogil:
            pthread_mutex_lock(&self.mutex)
            self._wake_waiters()
            pthread_cond_signal(&self.dispatch_cv)
            pthread_mutex_unlock(&self.mutex)

    @property
    def acked_end(self) -> int:
        """Everything before this WAL offset is acknowledged (durable within the deadline)."""
        return self._acked_end

    @property
    def acks_revoked(self) -> bool:
        return self.revoked

    cdef void _add_callback(self, AppendHandle handle, fn) except *:
        self._register(handle, fn, -1)

    cdef void _register(self, AppendHandle handle, fn, int slot) except *:
        """Queue `fn` for the dispatcher, or call it now if the dispatcher is already past the
        record; frees the record's pending slot (if any) in the same critical section."""
        cdef list entry = [handle.end, 0, handle, fn]
        cdef bint now
        self._lock_with_gil()
        now = handle.end <= self.dispatched_end
        if not now:
            entry[1] = self.callback_seq
            self.callback_seq += 1
            heapq.heappush(self.callbacks, entry)
            self.ncallbacks += 1
            pthread_cond_signal(&self.dispatch_cv)   # it may be durable already
        if slot >= 0:
            self._release_pending(slot)
        pthread_mutex_unlock(&self.mutex)
        if now:
            _call(fn, handle)

    cdef bint _dispatch_all_locked(self) noexcept nogil:
        return self.dispatch_stop or self.revoked or (self.io_errno != 0 and self.done_seq > self.failed_seq)

    def run_dispatcher(self) -> None:
        """Body of the callback thread: runs append callbacks in offset order as records become
        durable (or fail). Returns after `stop_dispatcher()` once nothing is left to call."""
        cdef uint64_t upto
        cdef bint finished
        cdef list ready
        while True:
            ready = []
            with nogil:
                pthread_mutex_lock(&self.mutex)
                # Sleep while nothing is queued or nothing queued can run yet: a WAL without
                # callbacks never wakes this thread (or takes the GIL) per write.
                while ((self.ncallbacks == 0 or self._dispatchable_end() <= self.dispatched_end)
                       and not self._dispatch_all_locked()):
                    pthread_cond_wait(&self.dispatch_cv, &self.mutex)
                pthread_mutex_unlock(&self.mutex)
            self._lock_with_gil()
            finished = self._dispatch_all_locked()
            upto = NO_SEQ if finished else self._dispatchable_end()
            while self.callbacks and (<list>self.callbacks[0])[0] <= upto:
                ready.append(heapq.heappop(self.callbacks))
                self.ncallbacks -= 1
            if upto > self.dispatched_end:
                self.dispatched_end = upto
            finished = self.dispatch_stop
            pthread_mutex_unlock(&self.mutex)
            for entry in ready:
                _call(entry[3], entry[2])
            if finished:
                return

    def stop_dispatcher(self) -> None:
        """Make `run_dispatcher` call what is left (failing what is not durable) and return."""
        self._lock_with_gil()
        self.dispatch_stop = True
        pthread_cond_signal(&self.dispatch_cv)
        pthread_mutex_unlock(&self.mutex)

    def _completion_time(self, uint64_t end):
        cdef uint64_t lo, hi, mid, first
        cdef int64_t ns = -1
        self._lock_with_gil()
        if self.log_count and self.log_end[(self.log_count - 1) % COMPLETION_LOG] >= end:
            first = self.log_count - COMPLETION_LOG if self.log_count > COMPLETION_LOG else 0
            lo = first
            hi = self.log_count - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if self.log_end[mid % COMPLETION_LOG] >= end:
                    hi = mid
                else:
                    lo = mid + 1
            # If the first kept entry already covers `end`, an evicted one may have been first.
            if lo > first or first == 0:
                ns = self.log_ns[lo % COMPLETION_LOG]
        pthread_mutex_unlock(&self.mutex)
        return None if ns < 0 else ns

    # ---- trim and state --------------------------------------------------------------------

    def trim(self, uint64_t offset) -> None:
        """Let space before `offset` be reused. The caller has already made this durable in the
        header: reuse before that would let a crash strand the records after `offset`."""
        self._lock_with_gil()
        if offset > self._durable_end:
            pthread_mutex_unlock(&self.mutex)
            raise ValueError(f"cannot trim to {offset}: only offsets up to {self._durable_end} are durable")
        if offset > self._trim_offset:
            self._trim_offset = offset
            pthread_cond_broadcast(&self.space_cv)
        pthread_mutex_unlock(&self.mutex)

    def set_fill_end(self, fill_end) -> None:
        """Place records only below logical offset `fill_end` (None: anywhere), for the first
        zero-fill of a new WAL file: the caller persists the fill mark before it raises this, and
        the filler never writes below the mark. Appends reaching it wait as for trim space."""
        cdef uint64_t v = NO_SEQ if fill_end is None else <uint64_t>fill_end
        self._lock_with_gil()
        self._fill_end = v
        pthread_cond_broadcast(&self.space_cv)
        pthread_mutex_unlock(&self.mutex)

    @property
    def fill_end(self):
        """The fill limit set by `set_fill_end` (None: none)."""
        return None if self._fill_end == NO_SEQ else self._fill_end

    @property
    def durable_end(self) -> int:
        cdef uint64_t v
        self._lock_with_gil()
        v = self._durable_end
        pthread_mutex_unlock(&self.mutex)
        return v

    @property
    def trim_offset(self) -> int:
        return self._trim_offset

    @property
    def appended_end(self) -> int:
        """Logical end of the last record accepted (durable once `durable_end` reaches it)."""
        cdef uint64_t v
        self._lock_with_gil()
        v = self._appended_end
        pthread_mutex_unlock(&self.mutex)
        return v

    @property
    def append_end(self) -> int:
        """Logical offset where the next record would be placed (before alignment rules)."""
        cdef uint64_t v
        self._lock_with_gil()
        v = self._slot(self.open_seq).pos if self.has_open else self.next_offset
        pthread_mutex_unlock(&self.mutex)
        return v

    @property
    def failed(self) -> bool:
        return self.io_errno != 0

    @property
    def error(self):
        """Why the WAL takes no more appends (its write failed), or None while it works."""
        return self._failure() if self.io_errno else None

    def stats(self) -> dict:
        cdef uint64_t records, record_bytes, batches, written, waits, buffer_waits, syncs, held
        cdef uint64_t hist[18]
        cdef uint64_t sync_hist[18]
        cdef int64_t write_ns, sync_ns, wait_ns, wait_max_ns
        self._lock_with_gil()
        records, record_bytes = self.stat_records, self.stat_record_bytes
        batches, written, waits = self.stat_batches, self.stat_bytes_written, self.stat_full_waits
        buffer_waits = self.stat_buffer_waits
        wait_ns, wait_max_ns = self.stat_wait_ns, self.stat_wait_max_ns
        syncs = self.stat_syncs
        held = self.stat_held_advances
        memcpy(hist, self.write_hist, sizeof(hist))     # no Python object while the mutex is held
        memcpy(sync_hist, self.sync_hist, sizeof(sync_hist))
        write_ns, sync_ns = self.write_ns_sum, self.sync_ns_sum
        pthread_mutex_unlock(&self.mutex)
        return dict(records=records, record_bytes=record_bytes, batches=batches,
                    bytes_written=written, full_waits=waits, buffer_waits=buffer_waits,
                    syncs=syncs, wait_seconds=wait_ns / 1e9, wait_max_seconds=wait_max_ns / 1e9,
                    lock_waits=self.stat_lock_waits, held_advances=held,
                    write_latency=_histogram(hist, write_ns), fsync_latency=_histogram(sync_hist, sync_ns))


cdef void _count_latency(uint64_t* hist, int64_t* total, int64_t ns) noexcept nogil:
    """Count `ns` in its WRITE_BOUNDS_NS bucket of `hist` (18 slots: the last is +Inf)."""
    cdef int bucket = 0
    while bucket < 17 and ns > WRITE_BOUNDS_NS[bucket]:
        bucket += 1
    hist[bucket] += 1
    total[0] += ns


cdef dict _histogram(const uint64_t* hist, int64_t total_ns):
    """s3stream.latency's snapshot shape: bounds (s), per-bucket counts, sum (s), count."""
    counts = [hist[i] for i in range(18)]
    return dict(bounds=[WRITE_BOUNDS_NS[i] / 1e9 for i in range(17)], counts=counts,
                sum=total_ns / 1e9, count=sum(counts))


cdef void _call(fn, handle) noexcept:
    try:
        fn(handle)
    except BaseException:
        log.exception("WAL append callback %r raised", fn)
