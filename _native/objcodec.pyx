# cython: language_level=3
"""Object codec: data blocks, index and footer of StreamObjects and StreamSetObjects.

Layout (docs/object-format.md):

    [data block]... [index] [footer]

    data block  = header (32) + batches, all of one stream, contiguous offsets
      header    : u32 magic 'S3DB' | u32 version | u64 stream id | u64 start offset
                  | u32 batch count | u32 CRC-32C of the batches
      batch     : u64 base offset | u32 record count | u32 payload length | payload
    index entry = u64 stream id | u64 start | u64 end | u32 record count | u32 block size
                  | u64 block position | u32 batch count | u32 zero            (48 bytes)
    footer      = u64 index position | u32 index length | u32 index CRC | u32 entry count
                  | u16 version | u16 zero | u64 magic 'S3SOBJ01'              (32 bytes)

Little-endian throughout. Entries are sorted by (stream id, start offset). Every read is checked
(lengths, magic, CRCs): a corrupt object raises ObjectFormatError, never returns wrong bytes.
"""
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBuffer_FillInfo
from libc.errno cimport errno, EINTR
from libc.string cimport strerror
cimport cython

from _native.checksum cimport crc32c_update
from _native.endian cimport store16, store32, store64, load16, load32, load64

cdef enum:
    BLOCK_HEADER = 32
    BATCH_HEADER = 16
    INDEX_ENTRY = 48
    FOOTER = 32
    BLOCK_MAGIC = 0x42443353   # 'S3DB'
    FORMAT_VERSION = 2          # 2: CRC-32C (1: zlib's CRC-32)

cdef uint64_t FOOTER_MAGIC = 0x31304A424F535333  # 'S3SOBJ01'

BLOCK_HEADER_SIZE = BLOCK_HEADER
BATCH_HEADER_SIZE = BATCH_HEADER
INDEX_ENTRY_SIZE = INDEX_ENTRY
FOOTER_SIZE = FOOTER
VERSION = FORMAT_VERSION


class ObjectFormatError(ValueError):
    """The bytes are not a valid object (bad magic, version, length or checksum)."""


class ObjectVersionError(ObjectFormatError):
    """An object of a format version this build does not read."""


cdef object _version_error(unsigned int version, str what):
    return ObjectVersionError(
        f"{what} is format version {version}; this build reads version {FORMAT_VERSION} (CRC-32C "
        "checksums): the object was written by another s3stream release. Rewrite it with that release "
        "(or delete the stream) before reading it here.")


cdef struct BlockPlan:
    uint64_t stream_id
    uint64_t start
    uint64_t end
    uint64_t records
    size_t position
    size_t size
    size_t first_piece
    size_t pieces


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void* iov_base
        size_t iov_len
    ssize_t writev(int fd, const iovec* iov, int iovcnt)

cdef enum:
    WRITEV_MAX = 1024             # IOV_MAX on Linux


@cython.final
cdef class GatheredObject:
    """An encoded object whose large payloads were not copied: a list of segments, in order,
    that point into a frame (headers, small payloads, index, footer) and into the memory that
    holds the large payloads (the sealed cache slices in `keep`). `write_to(fd)` writes it with
    writev and no copy; `read(start, end)` copies a range (an S3 part); the buffer protocol joins
    it once, for any other consumer. `release()` (or leaving a `with` block) lets go of the frame
    and the slices; the object is unusable afterwards."""

    def __dealloc__(self):
        free(self.segs)

    def __len__(self):
        return self.size

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def release(self) -> None:
        if self.frame is not None:
            self.frame.release()        # the reused bytearray may be resized again
        self.frame = None
        self.keep = None
        self.nsegs = 0

    cdef int _check(self) except -1:
        if self.frame is None:
            raise ValueError("operation on a released GatheredObject")
        return 0

    def write_to(self, int fd) -> int:
        """Write the whole object at the descriptor's current position (GIL released); returns
        the byte count. OSError as write(2) reports it; short writes are resumed."""
        cdef iovec iov[WRITEV_MAX]
        cdef size_t seg = 0, skip = 0, k, left
        cdef ssize_t n
        cdef int err = 0
        self._check()
        with nogil:
            while seg < self.nsegs:
                k = 0
                while k < WRITEV_MAX and seg + k < self.nsegs:
                    iov[k].iov_base = <void*>(self.segs[seg + k].ptr + (skip if k == 0 else 0))
                    iov[k].iov_len = self.segs[seg + k].length - (skip if k == 0 else 0)
                    k += 1
                n = writev(fd, iov, <int>k)
                if n < 0:
                    if errno == EINTR:
                        continue
                    err = errno
                    break
                left = <size_t>n
                while left and seg < self.nsegs:         # advance past what was written
                    if left >= self.segs[seg].length - skip:
                        left -= self.segs[seg].length - skip
                        seg += 1
                        skip = 0
                    else:
                        skip += left
                        left = 0
        if err:
            raise OSError(err, strerror(err))
        return self.size

    def read(self, size_t start, size_t end) -> bytes:
        """Bytes [start, end) of the object (clipped to its size), copied."""
        cdef size_t seg, at = 0, a, b, pos = 0
        cdef unsigned char* out
        self._check()
        if end > self.size:
            end = self.size
        if start >= end:
            return b""
        result = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>(end - start))
        out = <unsigned char*>PyBytes_AS_STRING(result)
        with nogil:
            for seg in range(self.nsegs):
                a = pos if pos > start else start
                b = pos + self.segs[seg].length
                if b > end:
                    b = end
                if a < b:
                    memcpy(out + at, self.segs[seg].ptr + (a - pos), b - a)
                    at += b - a
                pos += self.segs[seg].length
                if pos >= end:
                    break
        return result

    def tobytes(self) -> bytes:
        return self.read(0, self.size)

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        if self.joined is None:
            self.joined = self.tobytes()
        PyBuffer_FillInfo(buffer, self, PyBytes_AS_STRING(self.joined), <Py_ssize_t>self.size, 1, flags)


cdef tuple encode_pieces(const Piece* pieces, size_t npieces, size_t block_size, bytearray into=None,
                         size_t gather_min=0, object keep=None):
    """Encode an object from `npieces` batches, grouped by stream (stream ids ascending, offsets
    contiguous within a stream: the caller checks). Each stream's batches are cut into blocks of
    at most `block_size` bytes; a batch larger than that gets a block of its own. Returns (object,
    index entries as tuples). The object is bytes; with `into`, it is written into that bytearray
    (grown if needed, never shrunk: memory reused across objects is not faulted in again) and
    returned as a memoryview of its first bytes. With `into` and `gather_min`, payloads of at
    least `gather_min` bytes are not copied: the object is a GatheredObject over `into` and the
    payloads' own memory, which `keep` must hold (same bytes once joined). Planning is
    O(batches); the copy and checksums run with the GIL released, so the payload memory must
    stay alive and unchanged for the call (and, gathered, until the object is released)."""
    cdef BlockPlan* blocks
    cdef size_t nblocks = 0, i, j, pos = 0, total, index_pos, index_len, frame_size, nseg = 0
    cdef size_t nref = 0, ref_bytes = 0
    cdef unsigned char* out
    cdef unsigned char* p
    cdef unsigned char* bp
    cdef unsigned char* seg_start
    cdef unsigned char* crc_from
    cdef uint32_t crc
    cdef Segment* segs = NULL
    cdef GatheredObject gathered
    if npieces == 0:
        raise ValueError("an object needs at least one batch")
    if block_size < BLOCK_HEADER + BATCH_HEADER:
        raise ValueError(f"block size {block_size} too small")
    blocks = <BlockPlan*>malloc(npieces * sizeof(BlockPlan))   # at most one block per batch
    if blocks == NULL:
        raise MemoryError()
    try:
        for i in range(npieces):
            if (nblocks == 0 or blocks[nblocks - 1].stream_id != pieces[i].stream_id
                    or blocks[nblocks - 1].size + BATCH_HEADER + pieces[i].length > block_size):
                blocks[nblocks].stream_id = pieces[i].stream_id
                blocks[nblocks].start = pieces[i].base
                blocks[nblocks].records = 0
                blocks[nblocks].position = pos
                blocks[nblocks].size = BLOCK_HEADER
                blocks[nblocks].first_piece = i
                blocks[nblocks].pieces = 0
                nblocks += 1
                pos += BLOCK_HEADER
            blocks[nblocks - 1].size += BATCH_HEADER + pieces[i].length
            blocks[nblocks - 1].end = pieces[i].base + pieces[i].count
            blocks[nblocks - 1].records += pieces[i].count
            blocks[nblocks - 1].pieces += 1
            pos += BATCH_HEADER + pieces[i].length
            if gather_min and into is not None and pieces[i].length >= gather_min:
                nref += 1
                ref_bytes += pieces[i].length
        index_pos = pos
        index_len = nblocks * INDEX_ENTRY
        total = index_pos + index_len + FOOTER
        frame_size = total - ref_bytes
        if into is None:
            result = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>total)
            out = <unsigned char*>PyBytes_AS_STRING(result)
        else:
            if <size_t>PyByteArray_GET_SIZE(into) < frame_size:
                PyByteArray_Resize(into, <Py_ssize_t>frame_size)
            out = <unsigned char*>PyByteArray_AS_STRING(into)
            # A slice of a view keeps the bytearray exported (not resizable) while it lives.
            result = memoryview(into)[:frame_size]
        if nref:
            segs = <Segment*>malloc((2 * nref + 1) * sizeof(Segment))
            if segs == NULL:
                raise MemoryError()
        with nogil:
            p = out
            seg_start = out
            for i in range(nblocks):
                bp = p
                p += BLOCK_HEADER
                crc = 0
                crc_from = p
                for j in range(blocks[i].first_piece, blocks[i].first_piece + blocks[i].pieces):
                    store64(p, pieces[j].base)
                    store32(p + 8, pieces[j].count)
                    store32(p + 12, <uint32_t>pieces[j].length)
                    if nref and pieces[j].length >= gather_min:
                        p += BATCH_HEADER
                        crc = crc32c_update(crc, crc_from, <size_t>(p - crc_from))
                        crc = crc32c_update(crc, pieces[j].data, pieces[j].length)
                        crc_from = p
                        segs[nseg].ptr = seg_start
                        segs[nseg].length = <size_t>(p - seg_start)
                        segs[nseg + 1].ptr = pieces[j].data
                        segs[nseg + 1].length = pieces[j].length
                        nseg += 2
                        seg_start = p
                    else:
                        memcpy(p + BATCH_HEADER, pieces[j].data, pieces[j].length)
                        p += BATCH_HEADER + pieces[j].length
                store32(bp, BLOCK_MAGIC)
                store32(bp + 4, FORMAT_VERSION)
                store64(bp + 8, blocks[i].stream_id)
                store64(bp + 16, blocks[i].start)
                store32(bp + 24, <uint32_t>blocks[i].pieces)
                store32(bp + 28, crc32c_update(crc, crc_from, <size_t>(p - crc_from)))
            # p is now where the index goes in the frame (index_pos in the object)
            for i in range(nblocks):
                bp = p + i * INDEX_ENTRY
                store64(bp, blocks[i].stream_id)
                store64(bp + 8, blocks[i].start)
                store64(bp + 16, blocks[i].end)
                store32(bp + 24, <uint32_t>blocks[i].records)
                store32(bp + 28, <uint32_t>blocks[i].size)
                store64(bp + 32, blocks[i].position)
                store32(bp + 40, <uint32_t>blocks[i].pieces)
                store32(bp + 44, 0)
            bp = p + index_len
            store64(bp, index_pos)
            store32(bp + 8, <uint32_t>index_len)
            store32(bp + 12, crc32c_update(0, p, index_len))
            store32(bp + 16, <uint32_t>nblocks)
            store16(bp + 20, FORMAT_VERSION)
            store16(bp + 22, 0)
            store64(bp + 24, FOOTER_MAGIC)
            if nref:
                segs[nseg].ptr = seg_start
                segs[nseg].length = <size_t>(bp + FOOTER - seg_start)
                nseg += 1
        entries = [(blocks[i].stream_id, blocks[i].start, blocks[i].end, blocks[i].records,
                    blocks[i].size, blocks[i].position, blocks[i].pieces) for i in range(nblocks)]
        if nref:
            gathered = GatheredObject.__new__(GatheredObject)
            gathered.segs, segs = segs, NULL
            gathered.nsegs = nseg
            gathered.size = total
            gathered.frame = result
            gathered.keep = keep
            result = gathered
    finally:
        free(blocks)
        free(segs)
    return result, entries


def encode_object(streams, size_t block_size):
    """Encode an object from `streams`: a sequence of (stream_id, batches), stream ids strictly
    ascending, each batches a sequence of (base_offset, count, payload) with contiguous offsets.
    Returns (object bytes, index entries as tuples). A batch larger than `block_size` gets a
    block of its own. The copy and checksums run with the GIL released."""
    cdef Py_buffer* bufs = NULL
    cdef Piece* pieces = NULL
    cdef size_t npieces = 0, k = 0, i
    cdef uint64_t sid, prev_sid = 0, expect, base
    cdef uint32_t count
    cdef bint first_stream = True
    for _, batches in streams:
        npieces += len(batches)
    if npieces == 0:
        raise ValueError("an object needs at least one batch")
    pieces = <Piece*>malloc(npieces * sizeof(Piece))
    bufs = <Py_buffer*>malloc(npieces * sizeof(Py_buffer))
    if pieces == NULL or bufs == NULL:
        free(pieces); free(bufs)
        raise MemoryError()
    try:
        for stream_id, batches in streams:
            sid = stream_id
            if not first_stream and sid <= prev_sid:
                raise ValueError(f"stream ids must be strictly ascending ({prev_sid} then {sid})")
            if len(batches) == 0:
                raise ValueError(f"stream {sid} has no batches")
            first_stream = False
            prev_sid = sid
            expect = batches[0][0]
            for base_offset, cnt, payload in batches:
                base = base_offset
                count = cnt
                if count == 0:
                    raise ValueError(f"stream {sid}: batch at {base} has count 0")
                if base != expect:
                    raise ValueError(f"stream {sid}: batch at {base} is not contiguous (expected {expect})")
                expect = base + count
                PyObject_GetBuffer(payload, &bufs[k], PyBUF_SIMPLE)
                pieces[k].data = <const unsigned char*>bufs[k].buf
                pieces[k].length = <size_t>bufs[k].len
                pieces[k].base = base
                pieces[k].count = count
                pieces[k].stream_id = sid
                k += 1
        return encode_pieces(pieces, npieces, block_size)
    finally:
        for i in range(k):
            PyBuffer_Release(&bufs[i])
        free(bufs)
        free(pieces)


def parse_footer(data, uint64_t object_size):
    """(index position, index length, index CRC, entry count) from the last FOOTER bytes."""
    cdef Py_buffer view
    cdef const unsigned char* p
    cdef uint64_t pos
    cdef uint32_t length, crc, entries
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if view.len < FOOTER:
            raise ObjectFormatError(f"object footer needs {FOOTER} bytes, got {view.len}")
        p = <const unsigned char*>view.buf + view.len - FOOTER
        if load64(p + 24) != FOOTER_MAGIC:
            raise ObjectFormatError("bad object footer magic: not an s3stream object or truncated")
        if load16(p + 20) != FORMAT_VERSION:
            raise _version_error(load16(p + 20), "the object")
        if load16(p + 22) != 0:
            raise ObjectFormatError("object footer's reserved bytes are not zero")
        pos = load64(p)
        length = load32(p + 8)
        crc = load32(p + 12)
        entries = load32(p + 16)
    finally:
        PyBuffer_Release(&view)
    if length != <uint64_t>entries * INDEX_ENTRY or pos + length + FOOTER != object_size:
        raise ObjectFormatError(
            f"object footer is inconsistent: index at {pos}+{length} with {entries} entries "
            f"in an object of {object_size} bytes")
    return pos, length, crc, entries


def parse_index(data, uint32_t expected_crc):
    """Index entries (stream id, start, end, records, block size, block position, batches)."""
    cdef Py_buffer view
    cdef const unsigned char* p
    cdef size_t n, i
    cdef list out = []
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if view.len % INDEX_ENTRY:
            raise ObjectFormatError(f"index length {view.len} is not a multiple of {INDEX_ENTRY}")
        p = <const unsigned char*>view.buf
        if crc32c_update(0, p, <size_t>view.len) != expected_crc:
            raise ObjectFormatError("object index checksum mismatch")
        n = <size_t>view.len // INDEX_ENTRY
        for i in range(n):
            out.append((load64(p), load64(p + 8), load64(p + 16), load32(p + 24), load32(p + 28),
                        load64(p + 32), load32(p + 40)))
            p += INDEX_ENTRY
    finally:
        PyBuffer_Release(&view)
    return out


def decode_block(data, size_t offset=0, size_t length=0, expected_stream=None, batch_type=None,
                 bint views=False):
    """Batches [(base, count, payload)] of the block at data[offset:offset+length] (length 0:
    to the end). Checks magic, version, stream id, CRC and every length before returning.

    views=False: each payload is a copy (bytes). views=True: each payload is a slice of
    memoryview(data), no copy: the batches keep `data` alive. batch_type (a tuple subclass such
    as a NamedTuple): build those instead of plain tuples."""
    cdef Py_buffer view
    cdef object whole = None
    cdef object payload
    cdef tuple item
    cdef size_t at
    cdef const unsigned char* b
    cdef const unsigned char* p
    cdef const unsigned char* end
    cdef uint32_t nbatches, i, plen
    cdef uint64_t sid, base, expect
    cdef list out = []
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if length == 0:
            if offset > <size_t>view.len:
                raise ObjectFormatError("block offset past the buffer")
            length = <size_t>view.len - offset
        if offset + length > <size_t>view.len or length < BLOCK_HEADER:
            raise ObjectFormatError(f"block of {length} bytes at {offset} does not fit a {view.len}-byte buffer")
        b = <const unsigned char*>view.buf + offset
        end = b + length
        if load32(b) != BLOCK_MAGIC:
            raise ObjectFormatError("bad data block magic")
        if load32(b + 4) != FORMAT_VERSION:
            raise _version_error(load32(b + 4), "the data block")
        sid = load64(b + 8)
        if expected_stream is not None and sid != <uint64_t>expected_stream:
            raise ObjectFormatError(f"data block belongs to stream {sid}, index says {expected_stream}")
        if crc32c_update(0, b + BLOCK_HEADER, length - BLOCK_HEADER) != load32(b + 28):
            raise ObjectFormatError(f"data block checksum mismatch (stream {sid})")
        nbatches = load32(b + 24)
        expect = load64(b + 16)
        p = b + BLOCK_HEADER
        for i in range(nbatches):
            if end - p < BATCH_HEADER:
                raise ObjectFormatError("batch header runs past the block")
            base = load64(p)
            plen = load32(p + 12)
            if base != expect:
                raise ObjectFormatError(f"batch offsets not contiguous in block ({base} != {expect})")
            if <size_t>(end - p - BATCH_HEADER) < plen:
                raise ObjectFormatError("batch payload runs past the block")
            expect = base + load32(p + 8)
            if views:
                if whole is None:
                    whole = data if isinstance(data, memoryview) else memoryview(data)
                at = <size_t>(p + BATCH_HEADER - <const unsigned char*>view.buf)
                payload = whole[at:at + plen]
            else:
                payload = PyBytes_FromStringAndSize(<const char*>(p + BATCH_HEADER), plen)
            item = (base, load32(p + 8), payload)
            out.append(item if batch_type is None else tuple.__new__(batch_type, item))
            p += BATCH_HEADER + plen
        if p != end:
            raise ObjectFormatError("data block has trailing bytes")
    finally:
        PyBuffer_Release(&view)
    return out
