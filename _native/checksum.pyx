# cython: language_level=3
"""CRC-32C (Castagnoli) over any buffer: the checksum of WAL records and object blocks.

The implementation (_native/crc32c.h) uses the CPU's SSE4.2 `crc32` instruction, three streams
interleaved, where the CPU has it, and slicing-by-8 tables elsewhere; the choice is made once at
import. `S3STREAM_CRC32C=table` in the environment forces the table version (for comparison).
Measured here: see `python -m pytest tests/bench --benchmark-enable -k crc`.
"""
import os

from libc.stdint cimport uint32_t
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE

cdef extern from "crc32c.h" nogil:
    int s3s_crc32c_init(int allow_hw)
    uint32_t s3s_crc32c(uint32_t crc, const unsigned char* p, size_t n)
    uint32_t s3s_crc32c_sw(uint32_t crc, const unsigned char* p, size_t n)
    uint32_t s3s_crc32c_hw(uint32_t crc, const unsigned char* p, size_t n)
    int s3s_crc32c_hw_ok

#: True when the hardware instruction is in use.
HARDWARE = bool(s3s_crc32c_init(os.environ.get("S3STREAM_CRC32C", "") != "table"))


cdef uint32_t crc32c_update(uint32_t crc, const unsigned char* data, size_t length) noexcept nogil:
    return s3s_crc32c(crc, data, length)


cdef uint32_t _run(int which, data, uint32_t crc) except? 0xFFFFFFFF:
    cdef Py_buffer view
    cdef uint32_t out
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        with nogil:
            if which == 0:
                out = s3s_crc32c(crc, <const unsigned char*>view.buf, <size_t>view.len)
            elif which == 1:
                out = s3s_crc32c_sw(crc, <const unsigned char*>view.buf, <size_t>view.len)
            else:
                out = s3s_crc32c_hw(crc, <const unsigned char*>view.buf, <size_t>view.len)
    finally:
        PyBuffer_Release(&view)
    return out


def crc32c(data, uint32_t crc=0) -> int:
    """CRC-32C of a bytes-like object, continuing from `crc` (the CRC of what came before)."""
    return _run(0, data, crc)


def crc32c_table(data, uint32_t crc=0) -> int:
    """The table implementation, whatever the CPU (tests and benchmarks)."""
    return _run(1, data, crc)


def crc32c_hardware(data, uint32_t crc=0) -> int:
    """The SSE4.2 implementation; RuntimeError where the CPU or build has none."""
    if not s3s_crc32c_hw_ok:
        raise RuntimeError("no hardware CRC-32C on this machine or build")
    return _run(2, data, crc)
