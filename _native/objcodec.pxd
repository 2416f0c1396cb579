# Object codec (objcodec.pyx): the batch descriptor and the encoder shared with the log cache,
# which encodes objects straight from its own buffers.
from libc.stdint cimport uint32_t, uint64_t

cdef struct Piece:
    const unsigned char* data     # payload
    size_t length
    uint64_t base                 # base offset of the batch
    uint32_t count                # records in the batch
    uint64_t stream_id

cdef struct Segment:
    const unsigned char* ptr
    size_t length

cdef class GatheredObject:
    cdef Segment* segs
    cdef size_t nsegs
    cdef readonly size_t size
    cdef object frame                # the memoryview of the frame (headers, small payloads, index)
    cdef object keep                 # what holds the large payloads
    cdef bytes joined                # the whole object, once the buffer protocol asked for it

    cdef int _check(self) except -1

cdef tuple encode_pieces(const Piece* pieces, size_t npieces, size_t block_size, bytearray into=*,
                         size_t gather_min=*, object keep=*)
