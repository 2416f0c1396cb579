# Little-endian loads and stores of fixed-width integers, byte by byte (any alignment): the one
# definition every codec of the core cimports (WAL records, objects, the append path's prefix).
from libc.stdint cimport uint16_t, uint32_t, uint64_t


cdef inline void store16(unsigned char* p, uint16_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF


cdef inline void store32(unsigned char* p, uint32_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF
    p[2] = (v >> 16) & 0xFF
    p[3] = (v >> 24) & 0xFF


cdef inline void store64(unsigned char* p, uint64_t v) noexcept nogil:
    store32(p, <uint32_t>(v & 0xFFFFFFFFu))
    store32(p + 4, <uint32_t>(v >> 32))


cdef inline uint16_t load16(const unsigned char* p) noexcept nogil:
    return <uint16_t>(p[0] | (p[1] << 8))


cdef inline uint32_t load32(const unsigned char* p) noexcept nogil:
    return (<uint32_t>p[0]) | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline uint64_t load64(const unsigned char* p) noexcept nogil:
    return (<uint64_t>load32(p)) | (<uint64_t>load32(p + 4) << 32)
