# Kafka record batches v2 (kafkarecords.pyx): the batch header, the records section's varints and
# its decoder, for any module of the core that encodes or reads Kafka records in its own buffers.
from libc.stdint cimport int16_t, int32_t, int64_t, uint16_t, uint32_t, uint64_t

cdef enum:
    BATCH_HEADER = 61             # baseOffset .. recordsCount: the records section follows

# A read position in a buffer: reads check against an end they are given (the records section's
# or a record's), which is never past `end`; `batch_at` names the batch in errors.
cdef struct Cursor:
    const unsigned char* pos
    const unsigned char* end
    Py_ssize_t batch_at

# The fields of a batch header, as stored (magic is always 2; seal_batch computes the CRC).
cdef struct BatchHeader:
    int64_t base_offset
    int32_t batch_length
    int32_t partition_leader_epoch
    uint32_t crc
    int16_t attributes
    int32_t last_offset_delta
    int64_t base_timestamp
    int64_t max_timestamp
    int64_t producer_id
    int16_t producer_epoch
    int32_t base_sequence
    int32_t count

# Big-endian stores of a batch's fields (the append path writes a batch's baseOffset with one).
cdef inline void store_be16(unsigned char* p, uint16_t v) noexcept nogil:
    p[0] = (v >> 8) & 0xFF
    p[1] = v & 0xFF


cdef inline void store_be32(unsigned char* p, uint32_t v) noexcept nogil:
    store_be16(p, <uint16_t>(v >> 16))
    store_be16(p + 2, <uint16_t>(v & 0xFFFF))


cdef inline void store_be64(unsigned char* p, uint64_t v) noexcept nogil:
    store_be32(p, <uint32_t>(v >> 32))
    store_be32(p + 4, <uint32_t>(v & 0xFFFFFFFFu))


cdef size_t varint_size(int64_t value) noexcept nogil
cdef unsigned char* put_varint(unsigned char* p, int64_t value) noexcept nogil
cdef int read_varint(Cursor* cursor, const unsigned char* end, int max_bytes, int64_t* value) except -1
cdef void pack_header(unsigned char* p, const BatchHeader* header) noexcept nogil
cdef void unpack_header(const unsigned char* p, BatchHeader* header) noexcept nogil
cdef void seal_batch(unsigned char* batch, size_t size) noexcept nogil
cdef list decode_records(Cursor* cursor, const BatchHeader* header)
