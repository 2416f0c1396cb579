# cython: language_level=3
"""Aligned buffers and positioned I/O for O_DIRECT files and block devices, and the durable
whole-file write of the local object store.

O_DIRECT needs the buffer address, the file offset and the length aligned to the logical block
size; `AlignedBuffer` is page-aligned memory exposing the buffer protocol so Python code can
fill or read it without copies. `write_file_durably` writes, syncs and renames a file in one
release of the GIL. Every errno is turned into an exception here, in `io_error` and `os_error`.
"""
import os

from libc.stdlib cimport free
from libc.string cimport memset
from libc.errno cimport errno, EINTR, EIO
from libc.stdio cimport rename
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from posix.fcntl cimport open as c_open, O_WRONLY, O_RDONLY, O_CREAT, O_EXCL, O_CLOEXEC, O_DIRECTORY
from posix.unistd cimport close as c_close, fsync, ftruncate, unlink
from posix.uio cimport iovec, writev
from posix.types cimport off_t

from _native.sysdeps cimport posix_memalign, pwrite_full, pread_full, fdatasync
from _native.objcodec cimport GatheredObject, Segment

ALIGNMENT = 4096


cdef object io_error(int err, str what):
    """An errno as an exception naming the operation (OSError subclass chosen by errno)."""
    if err == -1:
        return EOFError(f"{what}: unexpected end of file")
    return OSError(err, f"{what}: {os.strerror(err)}")


cdef object os_error(int err, object filename=None, object filename2=None):
    """An errno as the os module reports it (same subclass, same message), for calls that stand
    in for os.open, os.fsync, os.replace and a file's write."""
    if filename is None:
        return OSError(err, os.strerror(err))
    if filename2 is None:
        return OSError(err, os.strerror(err), filename)
    return OSError(err, os.strerror(err), filename, None, filename2)


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


cdef enum:
    WRITEV_MAX = 1024             # IOV_MAX on Linux


cdef int writev_full(int fd, const Segment* segs, size_t nsegs) noexcept nogil:
    """Write every segment, in order, at the descriptor's position; returns 0 or an errno.
    Retries short writes and EINTR."""
    cdef iovec iov[WRITEV_MAX]
    cdef size_t seg = 0, skip = 0, k, left, wanted
    cdef ssize_t n
    while seg < nsegs:
        k = 0
        wanted = 0
        while k < WRITEV_MAX and seg + k < nsegs:
            iov[k].iov_base = <void*>(segs[seg + k].ptr + (skip if k == 0 else 0))
            iov[k].iov_len = segs[seg + k].length - (skip if k == 0 else 0)
            wanted += iov[k].iov_len
            k += 1
        n = writev(fd, iov, <int>k)
        if n < 0:
            if errno == EINTR:
                continue
            return errno
        if n == 0 and wanted:
            return EIO
        left = <size_t>n
        # Advance past what was written (and past empty segments, which writev never reports).
        while seg < nsegs and (left or segs[seg].length == skip):
            if left >= segs[seg].length - skip:
                left -= segs[seg].length - skip
                seg += 1
                skip = 0
            else:
                skip += left
                left = 0
    return 0


cdef int truncate_to(int fd, size_t size) noexcept nogil:
    """ftruncate, retried on EINTR; returns 0 or an errno."""
    while ftruncate(fd, <off_t>size) != 0:
        if errno != EINTR:
            return errno
    return 0


cdef int sync_file(int fd) noexcept nogil:
    """fsync, retried on EINTR; returns 0 or an errno."""
    while fsync(fd) != 0:
        if errno != EINTR:
            return errno
    return 0


cdef enum Step:
    STEP_NONE, STEP_OPEN, STEP_WRITE, STEP_RENAME, STEP_DIR_OPEN, STEP_DIR_SYNC


def write_file_durably(str path, object data, int fd=-1, str rename_to=None, str sync_dir=None) -> int:
    """Write `data` as the whole content of the file `path` and fsync it; then, with `rename_to`,
    rename it to that path; then, with `sync_dir`, fsync that directory. All of it in one release
    of the GIL, which matters when the caller shares its process with busy Python threads: each
    re-take of the GIL can wait a switch interval.

    The file is created (O_EXCL, mode 0o666 less the umask) unless `fd` is an open, writable
    descriptor of it at position 0 (a recycled file: overwritten and truncated to the new size);
    `fd` is closed in every case. `data` is a GatheredObject (written from its segments with
    writev, no join) or any contiguous buffer. If anything fails up to and including the rename,
    the file at `path` is removed (unless its exclusive create was what failed) and OSError is
    raised as the os module would raise it (same subclass, errno, message and file names).
    Returns the bytes written. No view of `data` is kept once this returns or raises."""
    cdef bytes path_b = os.fsencode(path)
    cdef bytes target_b = os.fsencode(rename_to) if rename_to is not None else None
    cdef bytes dir_b = os.fsencode(sync_dir) if sync_dir is not None else None
    cdef const char* c_path = path_b
    cdef const char* c_target = NULL
    cdef const char* c_dir = NULL
    cdef Py_buffer view
    cdef bint have_view = False
    cdef Segment single
    cdef const Segment* segs = NULL
    cdef size_t nsegs = 0, size = 0
    cdef GatheredObject gathered
    cdef int err = 0, dfd
    cdef Step step = STEP_NONE
    cdef bint owns_file = fd >= 0
    if target_b is not None:
        c_target = target_b
    if dir_b is not None:
        c_dir = dir_b
    try:
        if isinstance(data, GatheredObject):
            gathered = <GatheredObject>data
            gathered._check()
            segs = gathered.segs
            nsegs = gathered.nsegs
            size = gathered.size
        else:
            PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
            have_view = True
            single.ptr = <const unsigned char*>view.buf
            single.length = <size_t>view.len
            segs = &single
            nsegs = 1
            size = single.length
    except BaseException:
        if fd >= 0:
            c_close(fd)
            unlink(c_path)
        raise
    with nogil:
        if fd < 0:
            fd = c_open(c_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0o666)
            if fd < 0:
                err = errno
                step = STEP_OPEN
            else:
                owns_file = True
        if not err:
            step = STEP_WRITE
            err = writev_full(fd, segs, nsegs)
            if not err:
                err = truncate_to(fd, size)         # a recycled file may be longer
            if not err:
                err = sync_file(fd)
            # Linux frees the descriptor even when close reports EINTR (Python ignores it too).
            if c_close(fd) != 0 and not err and errno != EINTR:
                err = errno
        if not err and c_target != NULL:
            if rename(c_path, c_target) != 0:
                err = errno
                step = STEP_RENAME
        if err and owns_file:
            unlink(c_path)
        if not err and c_dir != NULL:
            dfd = c_open(c_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
            if dfd < 0:
                err = errno
                step = STEP_DIR_OPEN
            else:
                err = sync_file(dfd)
                step = STEP_DIR_SYNC
                c_close(dfd)
    if have_view:
        PyBuffer_Release(&view)
    if not err:
        return size
    if step == STEP_OPEN:
        raise os_error(err, path)
    if step == STEP_RENAME:
        raise os_error(err, path, rename_to)
    if step == STEP_DIR_OPEN:
        raise os_error(err, sync_dir)
    raise os_error(err)
