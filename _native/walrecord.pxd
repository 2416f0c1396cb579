# WAL record codec: constants, the record header layout and its checks. See docs/wal-format.md.
from libc.stdint cimport uint8_t, uint32_t, uint64_t

cdef enum:
    BLOCK_SIZE = 4096
    HEADER_SLOT_SIZE = 4096
    HEADER_AREA_SIZE = 8192
    RECORD_HEADER_SIZE = 32
    RECORD_TYPE_DATA = 1
    RECORD_TYPE_PADDING = 2

# 'S3WR' read as a little-endian u32
cdef enum:
    RECORD_MAGIC = 0x52573353

# Outcomes of checking one record; 0 is success, the rest say why a scan stopped.
cdef enum:
    REC_OK = 0
    REC_BAD_MAGIC = 1
    REC_BAD_HEADER_CRC = 2
    REC_BAD_OFFSET = 3
    REC_BAD_TYPE = 4
    REC_BAD_LENGTH = 5
    REC_BAD_BODY_CRC = 6
    REC_OLD_GENERATION = 7
    REC_END_OF_SPACE = 8

cdef struct RecordHeader:
    uint8_t rtype
    uint32_t body_len
    uint32_t body_crc
    uint64_t offset
    uint32_t generation

cdef inline uint64_t align_up(uint64_t x) noexcept nogil:
    return (x + (BLOCK_SIZE - 1)) & ~(<uint64_t>(BLOCK_SIZE - 1))

cdef inline uint64_t record_start(uint64_t pos) noexcept nogil:
    # A record header never straddles a 4 KiB block: where fewer than RECORD_HEADER_SIZE bytes
    # remain in the block, the next record starts at the next block. Writer and reader agree.
    if (pos & (BLOCK_SIZE - 1)) > BLOCK_SIZE - RECORD_HEADER_SIZE:
        return align_up(pos)
    return pos

cdef void encode_record_header(unsigned char* p, uint8_t rtype, uint32_t body_len, uint32_t body_crc,
                               uint64_t offset, uint32_t generation) noexcept nogil
cdef int decode_record_header(const unsigned char* p, RecordHeader* out) noexcept nogil
