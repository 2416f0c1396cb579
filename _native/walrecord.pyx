# cython: language_level=3
"""WAL record codec (see docs/wal-format.md).

A record is a 32-byte header followed by its body:

    0  u32 magic 'S3WR'     4  u8 type (1 data, 2 padding)   5  u8[3] zero
    8  u32 body length      12 u32 CRC-32C of the body       16 u64 logical offset of the record
    24 u32 writer generation                                 28 u32 CRC-32C of bytes 0..28

All integers are little-endian. The logical offset makes bytes left from an earlier lap of the
ring fail validation; the generation (bumped each time the WAL is opened for writing) makes
records left beyond a torn tail by an earlier session fail it too.
"""
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING

from _native.checksum cimport crc32c_update
from _native.endian cimport store32, store64, load32, load64

BLOCK = BLOCK_SIZE
HEADER_SLOT = HEADER_SLOT_SIZE
HEADER_AREA = HEADER_AREA_SIZE
RECORD_HEADER = RECORD_HEADER_SIZE
MAGIC = RECORD_MAGIC
TYPE_DATA = RECORD_TYPE_DATA
TYPE_PADDING = RECORD_TYPE_PADDING
STOP_END_OF_SPACE = REC_END_OF_SPACE

STOP_REASONS = {
    REC_OK: "ok",
    REC_BAD_MAGIC: "bad record magic (end of log or unwritten space)",
    REC_BAD_HEADER_CRC: "record header checksum mismatch (torn or corrupt write)",
    REC_BAD_OFFSET: "record offset mismatch (stale data from an earlier lap)",
    REC_BAD_TYPE: "unknown record type",
    REC_BAD_LENGTH: "record length runs past the end of the ring lap",
    REC_BAD_BODY_CRC: "record body checksum mismatch (torn or corrupt write)",
    REC_OLD_GENERATION: "record from an earlier writer session beyond a torn tail",
    REC_END_OF_SPACE: "reached one full ring capacity past the trim offset",
}


cdef void encode_record_header(unsigned char* p, uint8_t rtype, uint32_t body_len, uint32_t body_crc,
                               uint64_t offset, uint32_t generation) noexcept nogil:
    store32(p, RECORD_MAGIC)
    p[4] = rtype
    p[5] = 0
    p[6] = 0
    p[7] = 0
    store32(p + 8, body_len)
    store32(p + 12, body_crc)
    store64(p + 16, offset)
    store32(p + 24, generation)
    store32(p + 28, crc32c_update(0, p, 28))


cdef int decode_record_header(const unsigned char* p, RecordHeader* out) noexcept nogil:
    if load32(p) != RECORD_MAGIC:
        return REC_BAD_MAGIC
    if crc32c_update(0, p, 28) != load32(p + 28):
        return REC_BAD_HEADER_CRC
    out.rtype = p[4]
    out.body_len = load32(p + 8)
    out.body_crc = load32(p + 12)
    out.offset = load64(p + 16)
    out.generation = load32(p + 24)
    if out.rtype != RECORD_TYPE_DATA and out.rtype != RECORD_TYPE_PADDING:
        return REC_BAD_TYPE
    return REC_OK


def next_record_start(uint64_t pos) -> int:
    """Where a record following position `pos` starts (the block-straddling rule)."""
    return record_start(pos)


def encode_record(uint64_t offset, uint32_t generation, data, int rtype=RECORD_TYPE_DATA) -> bytes:
    """Header + body of one record as bytes (the ring writes the same bytes in place)."""
    cdef Py_buffer view
    cdef unsigned char* out
    cdef uint32_t crc
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if view.len > 0xFFFFFFFF:
            raise ValueError("record body longer than 4 GiB")
        result = PyBytes_FromStringAndSize(NULL, RECORD_HEADER_SIZE + view.len)
        out = <unsigned char*>PyBytes_AS_STRING(result)
        crc = crc32c_update(0, <const unsigned char*>view.buf, <size_t>view.len)
        encode_record_header(out, <uint8_t>rtype, <uint32_t>view.len, crc, offset, generation)
        if view.len:
            memcpy(out + RECORD_HEADER_SIZE, view.buf, <size_t>view.len)
    finally:
        PyBuffer_Release(&view)
    return result


def decode_record_header_bytes(data) -> tuple:
    """(status, type, body_len, body_crc, offset, generation) of the header at data[:32]."""
    cdef Py_buffer view
    cdef RecordHeader h
    cdef int status
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if view.len < RECORD_HEADER_SIZE:
            raise ValueError(f"a record header is {RECORD_HEADER_SIZE} bytes, got {view.len}")
        memset(&h, 0, sizeof(h))
        status = decode_record_header(<const unsigned char*>view.buf, &h)
    finally:
        PyBuffer_Release(&view)
    return (status, h.rtype, h.body_len, h.body_crc, h.offset, h.generation)
