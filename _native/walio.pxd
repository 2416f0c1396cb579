cdef class AlignedBuffer:
    cdef unsigned char* ptr
    cdef readonly size_t size
    cdef int exports

cdef object io_error(int err, str what)
