# cython: language_level=3
"""The log cache: records batched per stream in blocks, until uploaded and beyond.

Records enter the *active* block, each stream's payloads back to back in one growable buffer
(a CacheSlice) with three parallel arrays (base offset, record count, position). A large payload
given as `bytes` is not copied: the slice holds a reference to the object instead (immutable,
so what the WAL got is what the object gets), see CacheSlice.add. The engine's
append path inserts a record right after placing it in the WAL, under the engine's append lock,
so blocks hold records in WAL order: every record of block k lies before every record of block
k + 1 in the WAL, which is what lets the WAL be trimmed to block k's end once k is committed. A
record is readable only once durable: the stream's confirm offset (kept by the append path)
bounds every read.

When the active block reaches the upload threshold (or an interval passes, or a stream closes,
or the WAL fills up) it is *sealed*: it never changes again, so the uploader plans and encodes it
without the GIL. Blocks are committed in seal order; committed blocks stay as a tail cache for
readers until evicted by size, oldest first. Uncommitted blocks are never evicted (append
admission and the WAL bound them).

Locking: `mutex` guards the structure. It is taken with the GIL held by trylock, falling back to a
wait without the GIL, so a holder that loses the GIL (a finalizer, a thread switch) never
deadlocks against a waiter.
"""
from collections import deque

cimport cython

from libc.stdint cimport uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.ref cimport Py_INCREF, Py_XDECREF, PyObject
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from _native.sysdeps cimport lock_releasing_gil, pthread_mutex_init, pthread_mutex_destroy, pthread_mutex_unlock

from _native.objcodec cimport Piece, encode_pieces

ACTIVE = "active"
SEALED = "sealed"
COMMITTED = "committed"

cdef enum:
    FIRST_BATCHES = 16
    SIZE_CLASSES = 5
    FIRST_CHUNKS = 4

# Chunk sizes: a slice starts small and each chunk is four times the last (eight times after the
# first), up to 1 MiB, so a stream with little data in a block wastes little and a busy one needs
# few chunks. The first is 2 KiB: an idle partition's two streams keep one checkpoint record
# each in the cache, 4 KiB in all rather than 32 (issue 53: memory per idle partition).
cdef size_t CHUNK_SIZE[5]
CHUNK_SIZE[:] = [2048, 16384, 65536, 262144, 1048576]


cdef class ChunkPool:
    """Payload chunks recycled across blocks. Memory the process touched once is reused rather
    than returned and faulted in again: on this machine a first touch runs at ~1.6 GB/s against
    ~20 GB/s for warm memory, so fresh buffers per block would cost more than the copy itself.
    At most `max_free_bytes` of free chunks are kept. Used with the GIL held only."""

    def __cinit__(self, uint64_t max_free_bytes):
        self.max_free_bytes = max_free_bytes

    def __dealloc__(self):
        cdef int c
        cdef size_t i
        for c in range(SIZE_CLASSES):
            for i in range(self.free_count[c]):
                free(self.free_chunks[c][i])
            free(self.free_chunks[c])

    cdef unsigned char* take(self, int size_class) noexcept:
        """A chunk of the class (NULL if memory is exhausted)."""
        if self.free_count[size_class]:
            self.free_count[size_class] -= 1
            self.free_bytes -= CHUNK_SIZE[size_class]
            self.reused += 1
            return <unsigned char*>self.free_chunks[size_class][self.free_count[size_class]]
        self.allocated += 1
        return <unsigned char*>malloc(CHUNK_SIZE[size_class])

    cdef void give(self, unsigned char* chunk, int size_class) noexcept:
        cdef size_t cap
        cdef void* p
        if self.free_bytes + CHUNK_SIZE[size_class] > self.max_free_bytes:
            free(chunk)
            return
        if self.free_count[size_class] == self.free_cap[size_class]:
            cap = self.free_cap[size_class] * 2 if self.free_cap[size_class] else 64
            p = realloc(self.free_chunks[size_class], cap * sizeof(void*))
            if p == NULL:
                free(chunk)
                return
            self.free_chunks[size_class] = <void**>p
            self.free_cap[size_class] = cap
        self.free_chunks[size_class][self.free_count[size_class]] = chunk
        self.free_count[size_class] += 1
        self.free_bytes += CHUNK_SIZE[size_class]

    def stats(self) -> dict:
        return dict(free_bytes=self.free_bytes, allocated=self.allocated, reused=self.reused)


# Not tracked by the cyclic GC: a slice refers to nothing but its pool (no cycle can pass
# through it), and the GC's clearing would take the pool away before __dealloc__ returns chunks.
@cython.no_gc
cdef class CacheSlice:
    """One stream's contiguous batches inside one block: payloads in chunks from the pool, and
    per batch its base offset, record count, address and length."""

    def __cinit__(self, uint64_t stream_id, uint64_t epoch, int64_t block_id, ChunkPool pool):
        self.stream_id = stream_id
        self.epoch = epoch
        self.block_id = block_id
        self.pool = pool

    def __dealloc__(self):
        cdef size_t i
        if self.owners != NULL:
            for i in range(self.n):
                Py_XDECREF(<PyObject*>self.owners[i])
            free(self.owners)
        for i in range(self.nchunks):
            if self.chunk_class[i] < 0:
                free(self.chunks[i])
            else:
                self.pool.give(self.chunks[i], self.chunk_class[i])
        free(self.chunks)
        free(self.chunk_class)
        free(self.bases)
        free(self.counts)
        free(self.data)
        free(self.lengths)

    cdef unsigned char* _reserve(self, size_t length) except NULL:
        """Room for `length` payload bytes: in the last chunk, or a new one."""
        cdef unsigned char* chunk
        cdef int c = 0
        cdef void* p
        cdef size_t cap
        if self.nchunks and length <= self.room:
            return self.fill
        if self.nchunks:
            c = self.chunk_class[self.nchunks - 1] + 1
            if c >= SIZE_CLASSES or c <= 0:
                c = SIZE_CLASSES - 1
        while c < SIZE_CLASSES - 1 and CHUNK_SIZE[c] < length:
            c += 1
        if self.nchunks == self.chunks_cap:
            cap = self.chunks_cap * 2 if self.chunks_cap else FIRST_CHUNKS
            p = realloc(self.chunks, cap * sizeof(unsigned char*))
            if p == NULL:
                raise MemoryError()
            self.chunks = <unsigned char**>p
            p = realloc(self.chunk_class, cap * sizeof(signed char))
            if p == NULL:
                raise MemoryError()
            self.chunk_class = <signed char*>p
            self.chunks_cap = cap
        if length > CHUNK_SIZE[c]:
            chunk = <unsigned char*>malloc(length)   # larger than any chunk: its own allocation
            c = -1
        else:
            chunk = self.pool.take(c)
        if chunk == NULL:
            raise MemoryError(f"cannot allocate {length} bytes of log cache")
        self.chunks[self.nchunks] = chunk
        self.chunk_class[self.nchunks] = c
        self.nchunks += 1
        self.fill = chunk
        self.room = CHUNK_SIZE[c] if c >= 0 else length
        return chunk

    cdef int add(self, uint64_t base, uint32_t count, const unsigned char* data, size_t length,
                 object owner=None) except -1:
        """Append a batch. With `owner` (an immutable bytes object whose buffer is `data`), keep
        a reference to it instead of copying the payload: the slice's memory is then the
        caller's, released when the slice is. Measured (64 KiB records into 1,000 streams, the
        objects discarded): the copy into recycled chunks cost 0.2 CPU s per GiB, ~17% of the
        throughput, as it writes memory the CPU's caches no longer hold."""
        cdef size_t cap, i
        cdef void* p
        cdef unsigned char* dst
        if self.n and base != self.bases[self.n - 1] + self.counts[self.n - 1]:
            raise AssertionError(f"stream {self.stream_id}: batch at {base} after "
                                 f"{self.bases[self.n - 1] + self.counts[self.n - 1]} in one block")
        if self.n == self.cap:
            cap = self.cap * 2 if self.cap else FIRST_BATCHES
            p = realloc(self.bases, cap * sizeof(uint64_t))
            if p == NULL:
                raise MemoryError()
            self.bases = <uint64_t*>p
            p = realloc(self.counts, cap * sizeof(uint32_t))
            if p == NULL:
                raise MemoryError()
            self.counts = <uint32_t*>p
            p = realloc(self.data, cap * sizeof(unsigned char*))
            if p == NULL:
                raise MemoryError()
            self.data = <const unsigned char**>p
            p = realloc(self.lengths, cap * sizeof(size_t))
            if p == NULL:
                raise MemoryError()
            self.lengths = <size_t*>p
            if self.owners != NULL:
                p = realloc(self.owners, cap * sizeof(void*))
                if p == NULL:
                    raise MemoryError()
                self.owners = <void**>p
            self.cap = cap
        if owner is not None:
            if self.owners == NULL:
                self.owners = <void**>malloc(self.cap * sizeof(void*))
                if self.owners == NULL:
                    raise MemoryError()
                for i in range(self.n):
                    self.owners[i] = NULL
            Py_INCREF(owner)
            self.owners[self.n] = <void*>owner
            dst = <unsigned char*>data
        else:
            dst = self._reserve(length)
            if length:
                memcpy(dst, data, length)
            self.fill = dst + length
            self.room -= length
            if self.owners != NULL:
                self.owners[self.n] = NULL
        self.bases[self.n] = base
        self.counts[self.n] = count
        self.data[self.n] = dst
        self.lengths[self.n] = length
        self.n += 1
        self.size += length
        return 0

    cdef size_t find(self, uint64_t offset) noexcept:
        """Index of the batch holding `offset` (the first batch if before, n if past the end)."""
        cdef size_t lo = 0, hi = self.n, mid
        while lo < hi:
            mid = (lo + hi) // 2
            if self.bases[mid] + self.counts[mid] <= offset:
                lo = mid + 1
            else:
                hi = mid
        return lo

    @property
    def start_offset(self) -> int:
        return self.bases[0] if self.n else 0

    @property
    def end_offset(self) -> int:
        return self.bases[self.n - 1] + self.counts[self.n - 1] if self.n else 0

    def __repr__(self):
        return f"<CacheSlice stream {self.stream_id} [{self.start_offset}, {self.end_offset}) {self.size} bytes>"


cdef class CacheBlock:
    """An upload unit: the slices of the streams that wrote while it was active."""

    def __cinit__(self, int64_t block_id):
        self.block_id = block_id
        self.state = ACTIVE
        self.sealed_by = ""
        self.streams = {}

    def plan(self, uint64_t split_size) -> tuple:
        """The SO/SSO split: (slices sharing the StreamSetObject, slices getting a StreamObject
        each), both by ascending stream id. A stream with at least `split_size` bytes in the
        block gets its own StreamObject. Twin: s3stream.engine.upload_reference.plan_upload."""
        cdef list stream_set = []
        cdef list stream_objects = []
        cdef CacheSlice s
        for stream_id in sorted(self.streams):
            s = self.streams[stream_id]
            if s.size >= split_size:
                stream_objects.append(s)
            else:
                stream_set.append(s)
        return stream_set, stream_objects

    def __repr__(self):
        return f"<CacheBlock {self.block_id} {self.state} {len(self.streams)} streams {self.size} bytes>"


def encode_slices(list slices, size_t block_size, bytearray into=None, size_t gather_min=0) -> tuple:
    """Encode one object straight from sealed slices (stream ids ascending; slices of one stream
    in a row must be contiguous in offsets, as a stream's slices of consecutive blocks are): (bytes,
    index entries), byte for byte what objcodec.encode_object makes of the same batches; with
    `into`, a memoryview of that reused bytearray instead of new bytes (release it before the
    next use); with `into` and `gather_min`, a GatheredObject if any payload has at least
    `gather_min` bytes: those are written from the slices, not copied (it holds the slices).
    The copy runs without the GIL; sealed slices never change, and the list keeps them alive."""
    cdef size_t npieces = 0, k = 0, i
    cdef Piece* pieces
    cdef CacheSlice s
    cdef uint64_t prev = 0, prev_end = 0
    for j, obj in enumerate(slices):
        s = <CacheSlice?>obj
        if s.n == 0:
            raise ValueError(f"stream {s.stream_id} has no batches")
        if j and s.stream_id < prev:
            raise ValueError(f"stream ids must be ascending ({prev} then {s.stream_id})")
        if j and s.stream_id == prev and s.bases[0] != prev_end:
            raise ValueError(f"slices of stream {s.stream_id} must be contiguous: one ends at {prev_end}, "
                             f"the next starts at {s.bases[0]}")
        prev = s.stream_id
        prev_end = s.bases[s.n - 1] + s.counts[s.n - 1]
        npieces += s.n
    pieces = <Piece*>malloc((npieces or 1) * sizeof(Piece))
    if pieces == NULL:
        raise MemoryError()
    try:
        for obj in slices:
            s = <CacheSlice>obj
            for i in range(s.n):
                pieces[k].data = s.data[i]
                pieces[k].length = s.lengths[i]
                pieces[k].base = s.bases[i]
                pieces[k].count = s.counts[i]
                pieces[k].stream_id = s.stream_id
                k += 1
        return encode_pieces(pieces, npieces, block_size, into, gather_min, slices)
    finally:
        free(pieces)


cdef class LogCache:
    """Blocks of durable records per stream; see the module docstring.

    `batch_type(base, count, payload)` builds what `read` returns; `clock()` gives block ages in ns.
    """

    def __cinit__(self, uint64_t upload_threshold, uint64_t cache_size, clock, batch_type=tuple,
                  uint64_t split_size=0):
        pthread_mutex_init(&self.mutex, NULL)
        self.mutex_ready = True
        self.threshold = upload_threshold
        self.split_size = split_size
        # A cut takes along the slices this close to the split size: they would be cut alone
        # moments later (streams at one rate reach it together), one commit instead of several;
        # smaller ones wait, so that objects stay near the split size (requests per GiB).
        self.cut_min = split_size - split_size // 4
        self.cache_size = cache_size
        self.clock = clock
        self.batch_type = batch_type
        self.blocks = deque()
        self.pool = ChunkPool(cache_size // 2)
        self.active = self._new_block()

    def __dealloc__(self):
        if self.mutex_ready:
            pthread_mutex_destroy(&self.mutex)

    cdef void acquire(self) noexcept:
        lock_releasing_gil(&self.mutex)

    cdef void release(self) noexcept:
        pthread_mutex_unlock(&self.mutex)

    cdef CacheBlock _new_block(self):
        cdef CacheBlock block = CacheBlock(self.next_id)
        self.next_id += 1
        return block

    cdef CacheSlice _slice_for(self, uint64_t stream_id, uint64_t epoch):
        """The stream's slice in the active block, created if needed (lock held)."""
        cdef CacheSlice s = self.active.streams.get(stream_id)
        if s is None:
            s = CacheSlice(stream_id, epoch, self.active.block_id, self.pool)
            self.active.streams[stream_id] = s
        elif s.epoch != epoch:
            raise AssertionError(f"stream {stream_id} changed epoch inside block {self.active.block_id}")
        return s

    cdef int insert(self, CacheSlice s, uint64_t base, uint32_t count, const unsigned char* data,
                    size_t length, uint64_t wal_start, uint64_t wal_end, bint admitted,
                    object owner=None) except -1:
        """Add a batch to `s`, a slice of the active block (lock held); with `owner`, by
        reference (see CacheSlice.add). Returns 1 when the block has reached the upload
        threshold (the caller seals it: _seal_locked), 2 when the slice has reached split_size
        (the caller cuts it out: _cut_locked), else 0."""
        cdef CacheBlock block = self.active
        cdef int64_t now
        cdef bint first = s.n == 0
        s.add(base, count, data, length, owner)
        if first:
            now = self.clock()
            s.wal_start = wal_start
            s.first_ns = now
            if block.created_ns == 0:
                block.created_ns = now
        if block.wal_end == 0:          # the block's first record
            block.wal_start = wal_start
        block.size += length
        if admitted:
            block.admitted += length
            s.admitted += length
        if wal_end > block.wal_end:
            block.wal_end = wal_end
        self.nbytes += length
        if block.size >= self.threshold:
            return 1
        return 2 if self.split_size and s.size >= self.split_size else 0

    cdef CacheBlock _seal_locked(self, str reason="size"):
        cdef CacheBlock block = self.active
        block.state = SEALED
        block.sealed_by = reason
        self.blocks.append(block)
        self.active = self._new_block()
        return block

    cdef CacheBlock _cut_locked(self, uint64_t keep_below, object stream_id):
        """Seal the active block with only its slices of at least `keep_below` bytes (and
        `stream_id`'s, if given); the others move on into the new active block, where their
        streams keep filling them (lock held). None if no slice would be sealed.

        A stream that reached its split size (or its tail bound) thus uploads as its own
        StreamObject at once, without cutting every other stream's object short: sealing the
        whole block there made blocks of 1-2 MiB under load (issue 51). The moved slices'
        records lie before the sealed block's in the WAL: the WAL is trimmed only up to the
        oldest record of any uncommitted block (trim_point), and the new block takes their
        oldest record's time (upload_interval counts from it)."""
        cdef CacheBlock old = self.active
        cdef CacheBlock new
        cdef CacheSlice s
        moving = [sid for sid, sl in old.streams.items()
                  if (<CacheSlice>sl).size < keep_below and sid != stream_id]
        if len(moving) == len(old.streams):
            return None
        new = self._new_block()
        for sid in moving:
            s = old.streams.pop(sid)
            s.block_id = new.block_id
            new.streams[sid] = s
            old.size -= s.size
            old.admitted -= s.admitted
            new.size += s.size
            new.admitted += s.admitted
            if s.n:
                if new.wal_end == 0 or s.wal_start < new.wal_start:
                    new.wal_start = s.wal_start
                if new.created_ns == 0 or s.first_ns < new.created_ns:
                    new.created_ns = s.first_ns
                new.wal_end = old.wal_end     # an upper bound of the moved records' ends
        if moving:
            old.wal_start = 0
            old.created_ns = 0
            for sl in old.streams.values():
                s = <CacheSlice>sl
                if s.n and (old.wal_start == 0 or s.wal_start < old.wal_start):
                    old.wal_start = s.wal_start
                if s.n and (old.created_ns == 0 or s.first_ns < old.created_ns):
                    old.created_ns = s.first_ns
        old.state = SEALED
        old.sealed_by = "cut"
        self.blocks.append(old)
        self.active = new
        return old

    # ---- the Python face (recovery replay, the uploader, readers, tools) -------------------------

    def put(self, uint64_t stream_id, uint64_t epoch, batch, uint64_t wal_end, uint64_t wal_start=0,
            hold=None):
        """Add a durable batch `(base, count, payload)` whose WAL record ends at `wal_end`;
        returns the block it sealed if the threshold was reached. (Recovery's path: appends
        go through the native append path instead.) A `bytes` payload is held by reference
        rather than copied if `hold`, or by default from HOLD_MIN_BYTES on, as appends are."""
        cdef Py_buffer view
        cdef CacheBlock sealed = None
        base, count, payload = batch
        PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
        if hold is None:
            owner = held_owner(payload, view.len)
        else:
            owner = payload if hold and type(payload) is bytes else None
        self.acquire()
        try:
            # Recovery replays whole blocks up to the threshold: no cuts (nothing waits on them).
            if self.insert(self._slice_for(stream_id, epoch), base, count,
                           <const unsigned char*>view.buf, <size_t>view.len, wal_start, wal_end, False, owner) == 1:
                sealed = self._seal_locked()
        finally:
            self.release()
            PyBuffer_Release(&view)
        return sealed

    def seal(self, stream_id=None, str reason="force"):
        """Seal the active block if it holds anything (or, with `stream_id`, that stream)."""
        self.acquire()
        try:
            if not self.active.streams or (stream_id is not None and stream_id not in self.active.streams):
                return None
            return self._seal_locked(reason)
        finally:
            self.release()

    def cut(self, stream_id=None, str reason="cut"):
        """Seal the active block with `stream_id`'s slice (if it has one; with None, none in
        particular) and every slice of at least cut_min bytes; the others stay active
        (_cut_locked). Without a split size, the whole block is sealed. None if nothing was."""
        cdef CacheBlock sealed
        self.acquire()
        try:
            if not self.active.streams or (stream_id is not None and stream_id not in self.active.streams):
                return None
            sealed = self._cut_locked(self.cut_min, stream_id)
            if sealed is not None:
                sealed.sealed_by = reason
            return sealed
        finally:
            self.release()

    def active_bytes(self, uint64_t stream_id) -> int:
        """Bytes of the stream's slice in the active block (0 if it has none)."""
        cdef CacheSlice s
        self.acquire()
        try:
            s = self.active.streams.get(stream_id)
            return 0 if s is None else s.size
        finally:
            self.release()

    def age(self) -> int:
        """Nanoseconds since the active block's oldest record came (0 while it is empty)."""
        self.acquire()
        try:
            return self.clock() - self.active.created_ns if self.active.created_ns else 0
        finally:
            self.release()

    def seal_if_older(self, int64_t age_ns):
        """Seal the active block if its oldest record came `age_ns` ago or more (the
        visibility deadline: upload_interval)."""
        self.acquire()
        try:
            if self.active.streams and self.active.created_ns and self.clock() - self.active.created_ns >= age_ns:
                return self._seal_locked("deadline")
            return None
        finally:
            self.release()

    def lag(self) -> int:
        """Nanoseconds since the oldest record not yet committed came (0: none): how late a
        reader that is not a node is (at least; a close's commit of a tail counts once its
        block commits). The visibility deadline (upload_interval) keeps it near that bound
        while uploads keep up; above it, uploads are behind."""
        cdef CacheBlock b
        cdef int64_t oldest = 0
        self.acquire()
        try:
            for b in list(self.blocks) + [self.active]:
                if b.state != COMMITTED and b.created_ns and (oldest == 0 or b.created_ns < oldest):
                    oldest = b.created_ns
            return self.clock() - oldest if oldest else 0
        finally:
            self.release()

    def trim_point(self, CacheBlock block) -> int:
        """How far the WAL may be trimmed once `block` (and every block before it) is
        committed: its end, or the oldest record of a later block still to commit (a slice
        moved on by a cut is older than the block it left), whichever is lower."""
        cdef CacheBlock b
        cdef uint64_t end = block.wal_end
        self.acquire()
        try:
            for b in list(self.blocks) + [self.active]:
                if b.block_id > block.block_id and b.state != COMMITTED and b.wal_end and b.wal_start < end:
                    end = b.wal_start
            return end
        finally:
            self.release()

    def seal_if_span(self, uint64_t wal_bytes, uint64_t appended_end):
        """Seal the active block if its records span at least `wal_bytes` of the WAL up to
        `appended_end` (the WAL-pressure rule: only sealing this block would free that much)."""
        self.acquire()
        try:
            if self.active.streams and appended_end - self.active.wal_start >= wal_bytes:
                return self._seal_locked("pressure")
            return None
        finally:
            self.release()

    def mark_committed(self, CacheBlock block) -> None:
        cdef CacheBlock oldest
        self.acquire()
        try:
            block.state = COMMITTED
            while self.nbytes > self.cache_size and self.blocks:
                oldest = self.blocks[0]
                if oldest.state != COMMITTED:
                    break
                self.blocks.popleft()
                self.nbytes -= oldest.size
        finally:
            self.release()

    def drop_stream(self, uint64_t stream_id) -> None:
        """Forget a stream's committed data (after trim past it or destroy); uncommitted stays."""
        cdef CacheBlock block
        cdef CacheSlice s
        self.acquire()
        try:
            for block in self.blocks:
                if block.state == COMMITTED and stream_id in block.streams:
                    s = block.streams.pop(stream_id)
                    block.size -= s.size
                    self.nbytes -= s.size
        finally:
            self.release()

    def sealed_ids(self) -> list:
        """The ids of the sealed blocks not yet committed, oldest first (the order they were
        sealed in, which is their id order)."""
        cdef CacheBlock block
        self.acquire()
        try:
            return [block.block_id for block in self.blocks if block.state == SEALED]
        finally:
            self.release()

    def uncommitted_slices(self, uint64_t stream_id, uint64_t epoch) -> list:
        """The stream's slices written at `epoch` in blocks not yet committed (sealed ones, then
        the active one), in block order: its un-uploaded tail, contiguous in offsets. A slice of
        the active block keeps growing while the stream takes appends."""
        cdef CacheBlock block
        cdef CacheSlice s
        self.acquire()
        try:
            out = []
            for block in list(self.blocks) + [self.active]:
                if block.state == COMMITTED:
                    continue
                s = block.streams.get(stream_id)
                if s is not None and s.epoch == epoch and s.n:
                    out.append(s)
            return out
        finally:
            self.release()

    def read(self, uint64_t stream_id, uint64_t start, uint64_t end, uint64_t max_bytes) -> list:
        """Cached batches of the stream from the one containing `start`, up to `end` or
        `max_bytes` (at least one batch). Empty if the cache does not hold `start`. The caller
        bounds `end` by the confirm offset (only durable data is read).

        The payloads are copied, under the lock, into one bytes object per read, and handed out
        as read-only memoryview slices of it (one allocation per fetch, not per batch)."""
        cdef list out = []
        cdef uint64_t size, pos
        cdef size_t i, length, at = 0
        cdef CacheSlice s
        cdef CacheBlock block
        cdef bytes buf = None
        cdef object whole = None
        cdef char* dst = NULL
        cdef int phase
        self.acquire()
        try:
            # Phase 0 sizes the read, phase 1 copies it into one buffer: same walk both times.
            for phase in range(2):
                size = 0
                pos = start
                for block in list(self.blocks) + [self.active]:
                    s = block.streams.get(stream_id)
                    if s is None or s.n == 0:
                        continue
                    if s.bases[s.n - 1] + s.counts[s.n - 1] <= pos:
                        continue
                    if s.bases[0] > pos:
                        break          # a hole: the data at `pos` is in objects, not here
                    i = s.find(pos)
                    while i < s.n:
                        length = s.lengths[i]
                        if s.bases[i] >= end or (size and size + length > max_bytes):
                            break
                        if phase == 1:
                            memcpy(dst + at, s.data[i], length)
                            out.append(self.batch_type(s.bases[i], s.counts[i], whole[at:at + length]))
                            at += length
                        size += length
                        pos = s.bases[i] + s.counts[i]
                        i += 1
                    if i < s.n:
                        break
                if phase == 0:
                    if size == 0 and pos == start:
                        return out
                    buf = PyBytes_FromStringAndSize(NULL, size)
                    dst = <char*>buf
                    whole = memoryview(buf)
            return out
        finally:
            self.release()

    @property
    def size(self) -> int:
        return self.nbytes

    def stats(self) -> dict:
        cdef CacheBlock block
        self.acquire()
        try:
            sealed = sum(1 for block in self.blocks if block.state == SEALED)
            return dict(bytes=self.nbytes, blocks=len(self.blocks) + 1, sealed_blocks=sealed,
                        active_bytes=self.active.size, pool=self.pool.stats())
        finally:
            self.release()
