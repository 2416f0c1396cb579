# Object codec (objcodec.pyx): the batch descriptor and the encoder shared with the log cache,
# which encodes objects straight from its own buffers.
from libc.stdint cimport uint32_t, uint64_t

cdef struct Piece:
    const unsigned char* data     # payload
    size_t length
    uint64_t base                 # base offset of the batch
    uint32_t count                # records in the batch
    uint64_t stream_id

cdef tuple encode_pieces(const Piece* pieces, size_t npieces, size_t block_size, bytearray into=*)
