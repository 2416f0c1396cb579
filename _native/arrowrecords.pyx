# cython: boundscheck=False, wraparound=False, cdivision=True
"""Kafka record batches (v2) straight from Arrow columns: the Spark sink's encoder.

A Spark task hands the sink Arrow record batches; making an s3stream.Record of each row cost
more than the rest of the write (measured: 1 KiB values, ~5 us a row in Python against ~1 us
for the object's encoding and PUT). This reads the columns' buffers as Arrow lays them out
(a validity bitmap, int32 offsets and the bytes of a binary or string column; int64 values of a
timestamp column) and writes the records as s3stream.records' encoder does, byte for byte: no
headers, attributes 0, timestampDelta against the batch's first timestamp, null keys and values
as length -1. The batch header is kafkarecords' (pack_header, seal_batch: the CRC).

The caller (pyspark_s3stream.sink) passes the buffers of one Arrow array per column and checks
types; every offset read here is checked against its buffer's length, so a malformed array
raises ValueError rather than reading out of bounds.
"""
from libc.stdint cimport int32_t, int64_t, uint32_t
from libc.string cimport memcpy, memset
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING

from _native.kafkarecords cimport BATCH_HEADER, BatchHeader, pack_header, put_varint, seal_batch, varint_size

cdef struct Column:
    const unsigned char* valid      # NULL: no nulls
    Py_ssize_t valid_len
    const unsigned char* offsets    # int32 values, little-endian as Arrow stores them
    Py_ssize_t offsets_len
    const unsigned char* data
    Py_ssize_t data_len
    Py_ssize_t at                   # the array's offset into its buffers
    bint present


cdef inline int32_t _offset(const Column* c, Py_ssize_t j) noexcept nogil:
    cdef int32_t v
    memcpy(&v, c.offsets + 4 * j, 4)
    return v


cdef inline bint _null(const Column* c, Py_ssize_t i) noexcept nogil:
    cdef Py_ssize_t j
    if not c.present:
        return True
    if c.valid == NULL:
        return False
    j = c.at + i
    return not ((c.valid[j >> 3] >> (j & 7)) & 1)


cdef inline object _bytes_view(object buffer):
    """A view of the buffer's bytes as unsigned (pyarrow exports its buffers as signed chars)."""
    return memoryview(buffer).cast("B")


cdef int _column(Column* c, object valid, object offsets, object data, Py_ssize_t at, Py_ssize_t n,
                 str name) except -1:
    cdef const unsigned char[::1] v
    c.present = offsets is not None
    c.valid, c.offsets, c.data, c.at = NULL, NULL, NULL, at
    c.valid_len = c.offsets_len = c.data_len = 0
    if not c.present:
        return 0
    if valid is not None:
        v = _bytes_view(valid)
        c.valid_len = v.shape[0]
        if c.valid_len > 0:
            c.valid = &v[0]
        if (at + n + 7) // 8 > c.valid_len:
            raise ValueError(f"column {name}: its validity bitmap is shorter than its {n} rows")
    v = _bytes_view(offsets)
    c.offsets_len = v.shape[0]
    if c.offsets_len < 4 * (at + n + 1):
        raise ValueError(f"column {name}: {c.offsets_len} bytes of offsets for {n} rows at {at}")
    c.offsets = &v[0]
    if data is not None:
        v = _bytes_view(data)
        c.data_len = v.shape[0]
        if c.data_len > 0:
            c.data = &v[0]
    return 0


cdef inline Py_ssize_t _length(const Column* c, Py_ssize_t i, str name) except -2:
    """The row's byte length (-1: null), its offsets checked against the data buffer."""
    cdef int32_t a, b
    if _null(c, i):
        return -1
    a = _offset(c, c.at + i)
    b = _offset(c, c.at + i + 1)
    if a < 0 or b < a or b > c.data_len:
        raise ValueError(f"column {name}: row {i} spans bytes [{a}, {b}) of a {c.data_len}-byte buffer")
    return b - a


cdef inline unsigned char* _put(unsigned char* p, const Column* c, Py_ssize_t i, Py_ssize_t length) noexcept nogil:
    p = put_varint(p, length)
    if length > 0:
        memcpy(p, c.data + _offset(c, c.at + i), <size_t>length)
        p += length
    return p


def encode_columns(v_valid, v_offsets, v_data, Py_ssize_t v_at,
                   k_valid, k_offsets, k_data, Py_ssize_t k_at,
                   t_valid, t_values, Py_ssize_t t_at, int64_t t_per_ms,
                   Py_ssize_t n, int64_t now_ms, Py_ssize_t max_records, Py_ssize_t max_bytes):
    """[(batch, record count)] of rows 0..n-1: each batch holds at most `max_records` records
    and about `max_bytes` (at least one record). Values (v_*) and keys (k_*; k_offsets None: no
    key column) are binary or string arrays' buffers; t_values (None: no timestamp column) int64s
    in units of 1/t_per_ms ms. Null timestamps take `now_ms`."""
    cdef Column value, key
    cdef const unsigned char[::1] tv
    cdef const unsigned char* t_valid_p = NULL
    cdef const unsigned char* t_p = NULL
    cdef Py_ssize_t start = 0, i, stop, vlen, klen, j
    cdef int64_t ts, base_ts, max_ts, raw
    cdef size_t body, size, total
    cdef BatchHeader header
    cdef unsigned char* out
    cdef unsigned char* p
    cdef list batches = []
    if max_records < 1 or max_bytes < 1 or t_per_ms < 1:
        raise ValueError("max_records, max_bytes and t_per_ms must be positive")
    _column(&value, v_valid, v_offsets, v_data, v_at, n, "value")
    if not value.present:
        raise ValueError("the value column is required")
    _column(&key, k_valid, k_offsets, k_data, k_at, n, "key")
    if t_values is not None:
        tv = _bytes_view(t_values)
        if tv.shape[0] < 8 * (t_at + n):
            raise ValueError(f"column timestamp: {tv.shape[0]} bytes for {n} rows at {t_at}")
        t_p = &tv[0] if tv.shape[0] else NULL
        if t_valid is not None:
            tv = _bytes_view(t_valid)
            if (t_at + n + 7) // 8 > tv.shape[0]:
                raise ValueError("column timestamp: its validity bitmap is shorter than its rows")
            t_valid_p = &tv[0] if tv.shape[0] else NULL
    while start < n:
        # Size the batch: records until max_records or max_bytes.
        total = BATCH_HEADER
        stop = start
        base_ts = max_ts = 0
        while stop < n and stop - start < max_records and (stop == start or total < <size_t>max_bytes):
            ts = _timestamp(t_p, t_valid_p, t_at, stop, t_per_ms, now_ms)
            if stop == start:
                base_ts = max_ts = ts
            elif ts > max_ts:
                max_ts = ts
            vlen = _length(&value, stop, "value")
            klen = _length(&key, stop, "key")
            body = 1 + varint_size(ts - base_ts) + varint_size(stop - start) + varint_size(klen) + varint_size(vlen)
            body += (klen if klen > 0 else 0) + (vlen if vlen > 0 else 0) + 1
            total += varint_size(<int64_t>body) + body
            stop += 1
        if total > 0x7FFFFFFF:
            raise ValueError(f"rows {start}..{stop - 1} make a batch of {total} bytes, over 2 GiB")
        batch = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>total)
        out = <unsigned char*>PyBytes_AS_STRING(batch)
        p = out + BATCH_HEADER
        for i in range(start, stop):
            ts = _timestamp(t_p, t_valid_p, t_at, i, t_per_ms, now_ms)
            vlen = _length(&value, i, "value")
            klen = _length(&key, i, "key")
            body = 1 + varint_size(ts - base_ts) + varint_size(i - start) + varint_size(klen) + varint_size(vlen)
            body += (klen if klen > 0 else 0) + (vlen if vlen > 0 else 0) + 1
            p = put_varint(p, <int64_t>body)
            p[0] = 0
            p = put_varint(p + 1, ts - base_ts)
            p = put_varint(p, i - start)
            p = _put(p, &key, i, klen)
            p = _put(p, &value, i, vlen)
            p[0] = 0                                   # no headers
            p += 1
        if <size_t>(p - out) != total:
            raise SystemError(f"arrowrecords: sized a batch at {total} bytes, wrote {p - out}")
        header.base_offset = 0
        header.batch_length = <int32_t>(total - 12)
        header.partition_leader_epoch = -1
        header.crc = 0
        header.attributes = 0
        header.last_offset_delta = <int32_t>(stop - start - 1)
        header.base_timestamp = base_ts
        header.max_timestamp = max_ts
        header.producer_id = -1
        header.producer_epoch = -1
        header.base_sequence = -1
        header.count = <int32_t>(stop - start)
        pack_header(out, &header)
        seal_batch(out, total)
        batches.append((batch, stop - start))
        start = stop
    return batches


cdef inline int64_t _timestamp(const unsigned char* values, const unsigned char* valid, Py_ssize_t at,
                               Py_ssize_t i, int64_t per_ms, int64_t now_ms) except? -1:
    cdef int64_t raw, ms
    cdef Py_ssize_t j = at + i
    if values == NULL or (valid != NULL and not ((valid[j >> 3] >> (j & 7)) & 1)):
        return now_ms
    memcpy(&raw, values + 8 * j, 8)
    ms = raw // per_ms if raw >= 0 else -((-raw + per_ms - 1) // per_ms)
    if ms < 0:
        raise ValueError(f"row {i}: timestamp {raw} is before 1970; Kafka timestamps are ms since the epoch, >= 0")
    return ms
