# cython: language_level=3
"""Aligned buffers and positioned I/O for O_DIRECT files and block devices.

O_DIRECT needs the buffer address, the file offset and the length aligned to the logical block
size; `AlignedBuffer` is page-aligned memory exposing the buffer protocol so Python code can
fill or read it without copies. Every errno is turned into an exception here, in `io_error`.
"""
import os

from libc.stdlib cimport free
from libc.string cimport memset
from libc.errno cimport errno

from _native.sysdeps cimport posix_memalign, pwrite_full, pread_full, fdatasync

ALIGNMENT = 4096


cdef object io_error(int err, str what):
    """The one place an errno becomes an exception (OSError subclass chosen by errno)."""
    if err == -1:
        return EOFError(f"{what}: unexpected end of file")
    return OSError(err, f"{what}: {os.strerror(err)}")


cdef class AlignedBuffer:
    """`size` bytes of zeroed, 4 KiB-aligned memory with the buffer protocol (read/write)."""

    def __cinit__(self, size_t size):
        cdef void* p = NULL
        if size == 0 or size % 4096:
            raise ValueError(f"AlignedBuffer size must be a positive multiple of 4096, got {size}")
        if posix_memalign(&p, 4096, size) != 0:
            raise MemoryError(f"cannot allocate {size} aligned bytes")
        memset(p, 0, size)
        self.ptr = <unsigned char*>p
        self.size = size
        self.exports = 0

    def __dealloc__(self):
        free(self.ptr)

    def __len__(self):
        return self.size

    def __getbuffer__(self, Py_buffer* view, int flags):
        view.buf = self.ptr
        view.obj = self
        view.len = <Py_ssize_t>self.size
        view.readonly = 0
        view.itemsize = 1
        view.format = "B"
        view.ndim = 1
        view.shape = NULL
        view.strides = NULL
        view.suboffsets = NULL
        view.internal = NULL
        self.exports += 1

    def __releasebuffer__(self, Py_buffer* view):
        self.exports -= 1

    def pwrite(self, int fd, size_t length, long long offset):
        """Write the first `length` bytes at `offset` (GIL released)."""
        cdef int err
        if length > self.size:
            raise ValueError(f"length {length} exceeds buffer size {self.size}")
        with nogil:
            err = pwrite_full(fd, self.ptr, length, offset)
        if err:
            raise io_error(err, f"pwrite of {length} bytes at {offset}")

    def pread(self, int fd, size_t length, long long offset):
        """Fill the first `length` bytes from `offset` (GIL released)."""
        cdef int err
        if length > self.size:
            raise ValueError(f"length {length} exceeds buffer size {self.size}")
        with nogil:
            err = pread_full(fd, self.ptr, length, offset)
        if err:
            raise io_error(err, f"pread of {length} bytes at {offset}")


def datasync(int fd) -> None:
    """fdatasync with the GIL released."""
    cdef int rc
    cdef int err = 0
    with nogil:
        rc = fdatasync(fd)
        if rc != 0:
            err = errno
    if rc != 0:
        raise io_error(err, "fdatasync")
