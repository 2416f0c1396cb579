# Recovery scanner of the WAL ring (walscan.pyx): its state, for modules that cimport it.
from libc.stdint cimport uint32_t, uint64_t


cdef class Scanner:
    cdef int fd
    cdef uint64_t header_area
    cdef uint64_t capacity
    cdef uint64_t pos
    cdef uint64_t limit
    cdef unsigned char* buf
    cdef size_t buf_size
    cdef uint64_t buf_start
    cdef size_t buf_len
    cdef size_t chunk
    cdef bint finished
    cdef bint in_memory
    cdef readonly int stop_reason
    cdef readonly uint64_t end
    cdef readonly uint32_t last_generation
    cdef readonly uint64_t records
    cdef readonly uint64_t record_bytes
    cdef readonly uint64_t paddings

    cdef int _ensure(self, uint64_t pos, size_t n) except -1
    cdef int _load(self, data, uint64_t data_start, uint64_t start) except -1
    cdef object _stop(self, int reason)
