# cython: language_level=3
"""Recovery scan of the WAL ring (format: docs/wal-format.md).

Yields the continuous run of intact records that starts at the trim offset and stops, cleanly,
at the first position that does not hold a valid record: bad magic (never written), a header
or body checksum mismatch (torn or corrupt), an offset from an earlier lap, or a generation
older than the record before it (left beyond a torn tail by an earlier session). Reads are
large, block-aligned and made with the GIL released, so the scan works under O_DIRECT.
"""
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memcpy, memset
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.bytes cimport PyBytes_FromStringAndSize

from _native.checksum cimport crc32c_update
from _native.sysdeps cimport posix_memalign, pread_full
from _native.walrecord cimport (
    BLOCK_SIZE, RECORD_HEADER_SIZE, RECORD_TYPE_PADDING, RecordHeader,
    REC_OK, REC_BAD_OFFSET, REC_BAD_LENGTH, REC_BAD_BODY_CRC, REC_OLD_GENERATION, REC_END_OF_SPACE,
    align_up, record_start, decode_record_header,
)
from _native.walio cimport io_error


cdef class Scanner:
    """Iterator of (offset, body) over the valid records from `start`.

    After it is exhausted: `end` is the logical offset just past the last valid record (padding
    included), where a writer resumes; `stop_reason` says why the scan ended (walrecord codes).
    """

    def __cinit__(self, int fd, uint64_t header_area, uint64_t capacity, uint64_t start,
                  size_t chunk_size=1 << 20, data=None, uint64_t data_start=0, uint32_t min_generation=0):
        if capacity == 0 or capacity % BLOCK_SIZE:
            raise ValueError(f"capacity must be a positive multiple of {BLOCK_SIZE}")
        if chunk_size < BLOCK_SIZE or chunk_size % BLOCK_SIZE:
            raise ValueError(f"chunk size must be a positive multiple of {BLOCK_SIZE}")
        self.fd = fd
        self.header_area = header_area
        self.capacity = capacity
        self.pos = start
        self.end = start
        self.limit = start + capacity
        self.chunk = chunk_size
        self.buf = NULL
        self.buf_size = 0
        self.buf_len = 0
        self.in_memory = data is not None
        self.last_generation = min_generation
        if self.in_memory:
            self._load(data, data_start, start)

    cdef int _load(self, data, uint64_t data_start, uint64_t start) except -1:
        """Scan `data`, the bytes of logical [data_start, data_start + len) (an object of a WAL
        kept as objects: one batch as the ring wrote it), instead of reading a descriptor."""
        cdef Py_buffer view
        cdef void* p
        if data_start % BLOCK_SIZE:
            raise ValueError(f"data must start at a multiple of {BLOCK_SIZE}, got {data_start}")
        if start < data_start:
            raise ValueError(f"scan start {start} lies before the data's start {data_start}")
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            if posix_memalign(&p, BLOCK_SIZE, <size_t>view.len + BLOCK_SIZE) != 0:
                raise MemoryError(f"cannot allocate a {view.len}-byte scan buffer")
            self.buf = <unsigned char*>p
            self.buf_size = <size_t>view.len + BLOCK_SIZE
            memcpy(self.buf, view.buf, <size_t>view.len)
            self.buf_start = data_start
            self.buf_len = <size_t>view.len
            self.limit = data_start + <uint64_t>view.len
        finally:
            PyBuffer_Release(&view)
        return 0

    def __dealloc__(self):
        free(self.buf)

    cdef int _ensure(self, uint64_t pos, size_t n) except -1:
        """Make logical [pos, pos+n) available in the buffer; the span lies within one lap."""
        cdef uint64_t start, lap_end
        cdef size_t length
        cdef void* p
        cdef int err
        if pos >= self.buf_start and pos + n <= self.buf_start + self.buf_len:
            return 0
        if self.in_memory:
            return 1        # beyond the object's bytes: the caller stops there
        start = pos & ~(<uint64_t>(BLOCK_SIZE - 1))
        lap_end = (start // self.capacity + 1) * self.capacity
        length = <size_t>(align_up(pos + n) - start)
        if length < self.chunk:
            length = self.chunk
        if start + length > lap_end:
            length = <size_t>(lap_end - start)
        if length > self.buf_size:
            free(self.buf)
            self.buf = NULL
            self.buf_size = 0
            if posix_memalign(&p, BLOCK_SIZE, length) != 0:
                raise MemoryError(f"cannot allocate a {length}-byte scan buffer")
            self.buf = <unsigned char*>p
            self.buf_size = length
        self.buf_len = 0
        with nogil:
            err = pread_full(self.fd, self.buf, length, <long long>(self.header_area + start % self.capacity))
        if err:
            raise io_error(err, f"reading WAL at logical offset {start}")
        self.buf_start = start
        self.buf_len = length
        return 0

    cdef object _stop(self, int reason):
        self.stop_reason = reason
        self.finished = True
        raise StopIteration

    def __iter__(self):
        return self

    def __next__(self):
        cdef uint64_t q, lap_end, rec_end
        cdef RecordHeader h
        cdef int rc
        cdef const unsigned char* body
        if self.finished:
            raise StopIteration
        while True:
            q = record_start(self.pos)
            if q + RECORD_HEADER_SIZE > self.limit:
                return self._stop(REC_END_OF_SPACE)
            lap_end = (q // self.capacity + 1) * self.capacity
            if self._ensure(q, RECORD_HEADER_SIZE):
                return self._stop(REC_END_OF_SPACE)
            memset(&h, 0, sizeof(h))
            rc = decode_record_header(self.buf + (q - self.buf_start), &h)
            if rc != REC_OK:
                return self._stop(rc)
            if h.offset != q:
                return self._stop(REC_BAD_OFFSET)
            if h.generation < self.last_generation:
                return self._stop(REC_OLD_GENERATION)
            rec_end = q + RECORD_HEADER_SIZE + h.body_len
            # In memory, a padding record may reach past the object: the ring writes a lap's
            # final padding only up to its header's block.
            if rec_end > lap_end or (rec_end > self.limit and not (
                    self.in_memory and h.rtype == RECORD_TYPE_PADDING)):
                return self._stop(REC_BAD_LENGTH)
            if h.rtype == RECORD_TYPE_PADDING:
                self.last_generation = h.generation
                self.pos = rec_end
                self.end = rec_end
                self.paddings += 1
                continue
            if self._ensure(q, RECORD_HEADER_SIZE + h.body_len):
                return self._stop(REC_BAD_LENGTH)
            body = self.buf + (q - self.buf_start) + RECORD_HEADER_SIZE
            if crc32c_update(0, body, h.body_len) != h.body_crc:
                return self._stop(REC_BAD_BODY_CRC)
            self.last_generation = h.generation
            self.pos = rec_end
            self.end = rec_end
            self.records += 1
            self.record_bytes += h.body_len
            return (q, PyBytes_FromStringAndSize(<const char*>body, h.body_len))


def probe(int fd, uint64_t header_area, uint64_t capacity, uint64_t start, uint64_t limit,
          uint32_t min_generation, size_t chunk_size=1 << 20):
    """The first 4 KiB-aligned logical position in [align_up(start), limit) that holds a valid
    record header (magic, header CRC, its own offset) of generation >= `min_generation`, or -1.
    Used after a scan stops, to see whether valid records continue beyond the damage. Reads
    `chunk_size` at a time with the GIL released."""
    cdef uint64_t pos = align_up(start), chunk_start, lap_end
    cdef size_t length, i
    cdef unsigned char* buf = NULL
    cdef void* p
    cdef int err
    cdef RecordHeader h
    if capacity == 0 or capacity % BLOCK_SIZE or chunk_size < BLOCK_SIZE or chunk_size % BLOCK_SIZE:
        raise ValueError("capacity and chunk size must be positive multiples of the block size")
    if posix_memalign(&p, BLOCK_SIZE, chunk_size) != 0:
        raise MemoryError(f"cannot allocate a {chunk_size}-byte probe buffer")
    buf = <unsigned char*>p
    try:
        while pos < limit:
            chunk_start = pos
            lap_end = (chunk_start // capacity + 1) * capacity
            length = chunk_size
            if chunk_start + length > lap_end:
                length = <size_t>(lap_end - chunk_start)
            if chunk_start + length > align_up(limit):
                length = <size_t>(align_up(limit) - chunk_start)
            with nogil:
                err = pread_full(fd, buf, length, <long long>(header_area + chunk_start % capacity))
            if err:
                raise io_error(err, f"reading WAL at logical offset {chunk_start}")
            i = 0
            while i < length and chunk_start + i < limit:
                memset(&h, 0, sizeof(h))
                if (decode_record_header(buf + i, &h) == REC_OK and h.offset == chunk_start + i
                        and h.generation >= min_generation):
                    return <long long>(chunk_start + i)
                i += BLOCK_SIZE
            pos = chunk_start + length
        return -1
    finally:
        free(buf)
