# cython: language_level=3
"""Kafka record batches v2 (magic 2): the native core of s3stream.records.

It encodes records into a batch (header, records section, CRC-32C) and decodes a batch into its
header fields and record tuples. Compression is not here: s3stream.records passes a `compress`
callable to encode_batch and a `decompress` one to decode_batch, so this module only reads and
writes uncompressed records sections. The format, the checks and every error message are those of
the pure-Python twin, s3stream/records/reference.py (tests compare the two byte for byte and error
for error); s3stream/records/__init__.py documents the format.

Bytes are read through a Cursor (pointer and end): every varint, key, value and header is checked
against the end of its record, every record against the end of the section, before it is read.
"""
from libc.stdint cimport int16_t, int32_t, int64_t, uint16_t, uint32_t, uint64_t, INT32_MAX, INT64_MAX, INT64_MIN
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memset
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBuffer_FillInfo, PyBUF_SIMPLE
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_Check
from cpython.long cimport PyLong_Check
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_DECREF, Py_INCREF, Py_XDECREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM, PyTuple_GET_ITEM, PyTuple_GET_SIZE, PyTuple_Check
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeUTF8, PyUnicode_Check

from _native.checksum cimport crc32c_update

from types import MemberDescriptorType

cdef extern from "Python.h":
    # tp_alloc of a tuple subclass without fields of its own (a NamedTuple): how tuple.__new__
    # makes one, without building a plain tuple first.
    object PyType_GenericAlloc(PyTypeObject* type, Py_ssize_t nitems)
    # Borrowed-pointer forms of the macros the encoder reads records with: no reference counting
    # of the temporaries Cython would make of `object` arguments.
    bint Bytes_CheckExact "PyBytes_CheckExact"(PyObject* o) nogil
    bint Bytes_Check "PyBytes_Check"(PyObject* o) nogil
    Py_ssize_t Bytes_GET_SIZE "PyBytes_GET_SIZE"(PyObject* o) nogil
    char* Bytes_AS_STRING "PyBytes_AS_STRING"(PyObject* o) nogil
    bint Tuple_Check "PyTuple_Check"(PyObject* o) nogil
    Py_ssize_t Tuple_GET_SIZE "PyTuple_GET_SIZE"(PyObject* o) nogil
    PyObject* Tuple_GET_ITEM "PyTuple_GET_ITEM"(PyObject* o, Py_ssize_t i) nogil
    bint Unicode_Check "PyUnicode_Check"(PyObject* o) nogil
    bint Unicode_IS_COMPACT_ASCII "PyUnicode_IS_COMPACT_ASCII"(PyObject* o) nogil
    void* Unicode_DATA "PyUnicode_DATA"(PyObject* o) nogil
    Py_ssize_t Unicode_GET_LENGTH "PyUnicode_GET_LENGTH"(PyObject* o) nogil
    PyObject* Py_None_Ptr "Py_None"
    PyObject** Sequence_Fast_ITEMS "PySequence_Fast_ITEMS"(PyObject* o) nogil
    Py_ssize_t List_GET_SIZE "PyList_GET_SIZE"(PyObject* o) nogil
    PyTypeObject* Py_TYPE(PyObject* o) nogil

cdef extern from *:
    """
    /* Bytes of a zigzag varint holding z: 1 for z < 2^7, 2 for z < 2^14, ... 10 for 2^63 and up
       (by its bit count: a table, as a division by 7 sits on the encoder's critical path). */
    static const unsigned char s3s_varint_bytes_by_bits[65] = {
        1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5,
        5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 10};
    static inline size_t s3s_varint_bytes(unsigned long long z) {
        return s3s_varint_bytes_by_bits[64 - __builtin_clzll(z | 1)];
    }
    """
    size_t s3s_varint_bytes(uint64_t z) nogil
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member

cdef extern from "structmember.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
    int T_OBJECT_EX

cdef enum:
    LENGTH_END = 12               # baseOffset, batchLength: not counted by batchLength
    MAGIC_AT = 16
    CRC_AT = 17
    CRC_FROM = 21                 # the CRC covers attributes to the end of the batch
    MIN_BATCH_LENGTH = BATCH_HEADER - LENGTH_END
    MAGIC = 2
    CODEC_MASK = 0x07
    CODECS = 5                    # none, gzip, snappy, lz4, zstd
    TIMESTAMP_TYPE_BIT = 0x08

HEADER_SIZE = BATCH_HEADER

# ---- the Python types this module makes and raises ------------------------------------------

#: The exception types raised, by kind; s3stream.records names its own (set_error_types).
_error_types = {"invalid_argument": ValueError, "invalid": ValueError, "magic": ValueError,
                "checksum": ValueError, "length": ValueError, "compression": ValueError}
cdef object _record_type = None       # s3stream.records.Record
cdef object _consumed_type = None     # s3stream.records.ConsumedRecord (a NamedTuple)

# Where a Record keeps its fields: the offsets of its slots (__slots__, as dataclass(slots=True)
# makes them), read straight from an instance of exactly that class; -1 where a field is not
# such a slot. Four attribute lookups a record were a third of the encoder's time.
cdef Py_ssize_t _key_slot = -1, _value_slot = -1, _timestamp_slot = -1, _headers_slot = -1


def set_error_types(**types) -> None:
    """Name the exception types raised: invalid_argument (encode_batch's records), invalid (a
    batch whose records do not decode), magic, checksum, length, compression (its header)."""
    unknown = set(types) - set(_error_types)
    if unknown:
        raise ValueError(f"unknown error kinds {sorted(unknown)}")
    _error_types.update(types)


def set_record_types(record, consumed) -> None:
    """The record class encode_batch takes and the tuple subclass decode_batch returns."""
    global _record_type, _consumed_type, _key_slot, _value_slot, _timestamp_slot, _headers_slot
    if not (isinstance(consumed, type) and issubclass(consumed, tuple)
            and consumed.__basicsize__ == tuple.__basicsize__ and consumed.__itemsize__ == tuple.__itemsize__):
        raise TypeError(f"{consumed!r} is not a tuple subclass without fields of its own (a NamedTuple)")
    _record_type, _consumed_type = record, consumed
    _key_slot, _value_slot = _slot_offset(record, "key"), _slot_offset(record, "value")
    _timestamp_slot, _headers_slot = _slot_offset(record, "timestamp"), _slot_offset(record, "headers")


cdef Py_ssize_t _slot_offset(object cls, str name) except -2:
    """The offset of slot `name` in instances of `cls`, or -1 if it is not a plain slot of it."""
    descriptor = cls.__dict__.get(name) if isinstance(cls, type) else None
    if type(descriptor) is not MemberDescriptorType or descriptor.__objclass__ is not cls:
        return -1
    if (<PyMemberDescrObject*>descriptor).d_member.type != T_OBJECT_EX:
        return -1
    return (<PyMemberDescrObject*>descriptor).d_member.offset


cdef inline object _field(object record, Py_ssize_t slot, str name):
    """record.<name>, from its slot when the record is exactly a Record."""
    cdef PyObject* value
    if slot >= 0 and type(record) is _record_type:
        value = (<PyObject**>(<char*><PyObject*>record + slot))[0]
        if value != NULL:
            return <object>value
    return getattr(record, name)             # a subclass, or a slot never set (AttributeError)


cdef object _error(str kind, str message):
    return _error_types[kind](message)


cdef object _not_a_batch(object cause, int64_t base_offset, int64_t count, Py_ssize_t size):
    """The error of a stored batch (records [base_offset, base_offset + count), `size` bytes)
    whose payload the decoder refused for its length or its magic byte (`cause`): no Kafka record
    batch at all, but bytes appended as they are. The decoder's own message, written for bytes a
    caller cut or mislabelled, would send the reader looking for the rest of a batch."""
    if isinstance(cause, _error_types["magic"]):
        why = "its magic byte (byte 16) is not 2"
    elif size < BATCH_HEADER:
        why = f"it is shorter than a batch header ({BATCH_HEADER} bytes)"
    else:
        why = "its batchLength (bytes 8-11) does not match its size"
    return type(cause)(f"the batch at offset {base_offset} ({size} bytes over {count} offsets) is not a Kafka record "
                       f"batch (v2): {why}. It was appended as bytes (a RecordBatch of its own), not with "
                       f"append_records or a producer: read its bytes (batch.payload)")


def not_a_record_batch(cause, int64_t base_offset, int64_t count, Py_ssize_t size):
    """The error FetchedBatch.records and ColumnBuilder.add raise, of `cause`'s type, for a
    stored batch whose payload is not a Kafka record batch (`cause`: the decoder's length or
    magic error)."""
    return _not_a_batch(cause, base_offset, count, size)


cdef object _malformed(Py_ssize_t batch_at, str what):
    return _error("invalid", f"record batch at byte {batch_at}: {what}; its CRC matched, so its producer wrote it "
                             f"so: refuse the batch and fix or replace that producer")


# ---- big-endian fields and zigzag varints (the stores are in kafkarecords.pxd) -----------------

cdef inline uint16_t load_be16(const unsigned char* p) noexcept nogil:
    return <uint16_t>((p[0] << 8) | p[1])


cdef inline uint32_t load_be32(const unsigned char* p) noexcept nogil:
    return (<uint32_t>load_be16(p) << 16) | load_be16(p + 2)


cdef inline uint64_t load_be64(const unsigned char* p) noexcept nogil:
    return (<uint64_t>load_be32(p) << 32) | load_be32(p + 4)


cdef inline uint64_t zigzag(int64_t value) noexcept nogil:
    return (<uint64_t>value << 1) ^ (<uint64_t>0 - (<uint64_t>value >> 63))


cdef size_t varint_size(int64_t value) noexcept nogil:
    """Bytes of `value` as a zigzag varint."""
    return s3s_varint_bytes(zigzag(value))


cdef unsigned char* put_varint(unsigned char* p, int64_t value) noexcept nogil:
    """Write `value` zigzag-encoded at `p` (varint_size(value) bytes); returns the byte after it."""
    cdef uint64_t z = zigzag(value)
    while z >= 0x80:
        p[0] = <unsigned char>((z & 0x7F) | 0x80)
        p += 1
        z >>= 7
    p[0] = <unsigned char>z
    return p + 1


cdef int read_varint(Cursor* cursor, const unsigned char* end, int max_bytes, int64_t* value) except -1:
    """The zigzag varint at the cursor, at most `max_bytes` long (5: int32, 10: int64), ending
    before `end`, its value within 32 (64) bits: stored in `value`, the cursor moved past it."""
    cdef const unsigned char* p = cursor.pos
    cdef const unsigned char* limit = end if end - p < max_bytes else p + max_bytes
    cdef int bits = 32 if max_bytes == 5 else 64
    cdef int shift = 0
    cdef uint64_t raw = 0
    cdef unsigned char byte
    while p < limit:
        byte = p[0]
        p += 1
        if byte < 0x80:
            if shift + 7 > bits and byte >> (bits - shift):
                raise _malformed(cursor.batch_at, f"a varint's value does not fit {bits} bits")
            raw |= <uint64_t>byte << shift
            cursor.pos = p
            value[0] = <int64_t>(raw >> 1) ^ -<int64_t>(raw & 1)
            return 0
        raw |= <uint64_t>(byte & 0x7F) << shift
        shift += 7
    if p >= end:
        raise _malformed(cursor.batch_at, "a record ends in the middle of a varint")
    raise _malformed(cursor.batch_at, f"a varint is longer than {max_bytes} bytes")


cdef void pack_header(unsigned char* p, const BatchHeader* header) noexcept nogil:
    store_be64(p, <uint64_t>header.base_offset)
    store_be32(p + 8, <uint32_t>header.batch_length)
    store_be32(p + 12, <uint32_t>header.partition_leader_epoch)
    p[MAGIC_AT] = MAGIC
    store_be32(p + CRC_AT, header.crc)
    store_be16(p + 21, <uint16_t>header.attributes)
    store_be32(p + 23, <uint32_t>header.last_offset_delta)
    store_be64(p + 27, <uint64_t>header.base_timestamp)
    store_be64(p + 35, <uint64_t>header.max_timestamp)
    store_be64(p + 43, <uint64_t>header.producer_id)
    store_be16(p + 51, <uint16_t>header.producer_epoch)
    store_be32(p + 53, <uint32_t>header.base_sequence)
    store_be32(p + 57, <uint32_t>header.count)


cdef void unpack_header(const unsigned char* p, BatchHeader* header) noexcept nogil:
    header.base_offset = <int64_t>load_be64(p)
    header.batch_length = <int32_t>load_be32(p + 8)
    header.partition_leader_epoch = <int32_t>load_be32(p + 12)
    header.crc = load_be32(p + CRC_AT)
    header.attributes = <int16_t>load_be16(p + 21)
    header.last_offset_delta = <int32_t>load_be32(p + 23)
    header.base_timestamp = <int64_t>load_be64(p + 27)
    header.max_timestamp = <int64_t>load_be64(p + 35)
    header.producer_id = <int64_t>load_be64(p + 43)
    header.producer_epoch = <int16_t>load_be16(p + 51)
    header.base_sequence = <int32_t>load_be32(p + 53)
    header.count = <int32_t>load_be32(p + 57)


cdef void seal_batch(unsigned char* batch, size_t size) noexcept nogil:
    """Store the CRC-32C of the `size`-byte batch (its attributes to its end) in its header."""
    store_be32(batch + CRC_AT, crc32c_update(0, batch + CRC_FROM, size - CRC_FROM))


# ---- encoding -------------------------------------------------------------------------------

# One record as _write_record writes it: its key, value and headers (borrowed: whoever fills it
# keeps them alive until it is written; NULL or None for a null key or value), its timestamp and
# the size of its body (the bytes after its length).
cdef struct Planned:
    PyObject* key
    PyObject* value
    PyObject* headers
    int64_t timestamp
    size_t body


# A records section being written, straight into the bytes object it ends in (resized as it
# grows, and to its size at the end): the batch itself, after its header, when it is not
# compressed; else the section alone, for the codec.
cdef struct Section:
    PyObject* out                                    # owned; NULL if a resize failed
    size_t start                                     # where the section starts in it
    size_t used
    size_t cap                                       # bytes of section it has room for

# The first size of a batch's section: the last batch's, and a little more (never over 1 MiB).
cdef size_t _section_hint = 16384


cdef extern from "Python.h":
    int _PyBytes_Resize(PyObject** bytes, Py_ssize_t size) except -1


cdef unsigned char* _reserve(Section* section, size_t size) except NULL:
    """Room for `size` more bytes at the end of the section."""
    cdef size_t cap
    if section.used + size > section.cap:
        cap = section.cap * 2 if section.cap * 2 > section.used + size else section.used + size
        _PyBytes_Resize(&section.out, <Py_ssize_t>(section.start + cap))
        section.cap = cap
    return <unsigned char*>Bytes_AS_STRING(section.out) + section.start + section.used


cdef object _finish(Section* section):
    """The section's bytes object, cut to what was written (the section's reference moves to it)."""
    _PyBytes_Resize(&section.out, <Py_ssize_t>(section.start + section.used))
    result = <object>section.out                     # a new reference ...
    Py_DECREF(result)                                # ... for the section's, which it takes over
    section.out = NULL
    return result


cdef int _not_bytes(PyObject* data) except -1:
    raise TypeError(f"a record's key, value or header value is bytes or None, got {type(<object>data).__name__}")


cdef inline size_t _bytes_size(PyObject* data) except 0:
    """Bytes of `data` (bytes or None) in a record: its length varint and its bytes."""
    cdef Py_ssize_t length
    if data == Py_None_Ptr:
        return 1                                     # length -1
    if not Bytes_CheckExact(data) and not Bytes_Check(data):
        _not_bytes(data)
    length = Bytes_GET_SIZE(data)
    return varint_size(length) + <size_t>length


cdef inline unsigned char* _put_bytes(unsigned char* p, PyObject* data) noexcept:
    cdef Py_ssize_t length
    if data == NULL or data == Py_None_Ptr:
        return put_varint(p, -1)
    length = Bytes_GET_SIZE(data)
    p = put_varint(p, length)
    memcpy(p, Bytes_AS_STRING(data), <size_t>length)
    return p + length


cdef inline const char* _header_key(PyObject* key, Py_ssize_t* length) except NULL:
    """The UTF-8 bytes of a header key (a str): its own data when it is ASCII (the usual
    case), else the UTF-8 form the str caches."""
    if Unicode_IS_COMPACT_ASCII(key):
        length[0] = Unicode_GET_LENGTH(key)
        return <const char*>Unicode_DATA(key)
    return PyUnicode_AsUTF8AndSize(<object>key, length)


cdef int _add_record(object record, Section* section, int64_t timestamp, Py_ssize_t offset_delta,
                     int64_t base_timestamp) except -1:
    """Check the record's key, value and headers and write it at the end of the section, in one
    visit of its objects (they are read twice otherwise: once to size the batch, once to copy)."""
    cdef object key = _field(record, _key_slot, "key"), value = _field(record, _value_slot, "value")
    cdef object headers = _field(record, _headers_slot, "headers")
    cdef PyObject* pairs = <PyObject*>headers
    cdef PyObject* header
    cdef Planned plan
    cdef size_t body = 1                             # attributes: unused, always 0
    cdef size_t size
    cdef Py_ssize_t i, count, key_length
    cdef unsigned char* start
    body += varint_size(timestamp - base_timestamp) + varint_size(offset_delta)
    body += _bytes_size(<PyObject*>key) + _bytes_size(<PyObject*>value)
    if not Tuple_Check(pairs):
        raise TypeError(f"record headers are a tuple of (str, bytes or None) pairs, got {type(headers).__name__}")
    count = Tuple_GET_SIZE(pairs)
    body += varint_size(count)
    for i in range(count):
        header = Tuple_GET_ITEM(pairs, i)
        if not Tuple_Check(header) or Tuple_GET_SIZE(header) != 2 or not Unicode_Check(Tuple_GET_ITEM(header, 0)):
            raise TypeError(f"a record header is a (str key, bytes or None value) pair, got {<object>header!r:.80}")
        # A non-ASCII str keeps the UTF-8 form made here: _write_record gets it again, no copy.
        _header_key(Tuple_GET_ITEM(header, 0), &key_length)
        body += varint_size(key_length) + <size_t>key_length + _bytes_size(Tuple_GET_ITEM(header, 1))
    size = varint_size(<int64_t>body) + body
    start = _reserve(section, size)
    plan.key, plan.value, plan.headers = <PyObject*>key, <PyObject*>value, pairs    # alive: held above
    plan.timestamp, plan.body = timestamp, body
    if <size_t>(_write_record(start, &plan, offset_delta, base_timestamp) - start) != size:
        raise SystemError(f"kafkarecords: sized a record at {size} bytes, wrote another number")
    section.used += size
    return 0


cdef unsigned char* _write_record(unsigned char* p, const Planned* plan, Py_ssize_t offset_delta,
                                  int64_t base_timestamp) except NULL:
    cdef Py_ssize_t i, count = Tuple_GET_SIZE(plan.headers), key_length
    cdef const char* key
    cdef PyObject* header
    p = put_varint(p, <int64_t>plan.body)
    p[0] = 0
    p = put_varint(p + 1, plan.timestamp - base_timestamp)
    p = put_varint(p, offset_delta)
    p = _put_bytes(p, plan.key)
    p = _put_bytes(p, plan.value)
    p = put_varint(p, count)
    for i in range(count):
        header = Tuple_GET_ITEM(plan.headers, i)
        key = _header_key(Tuple_GET_ITEM(header, 0), &key_length)
        p = put_varint(p, key_length)
        memcpy(p, key, <size_t>key_length)
        p = _put_bytes(p + key_length, Tuple_GET_ITEM(header, 1))
    return p


cdef int _check_batch_size(size_t payload) except -1:
    """The error of a batch of a `payload`-byte records section too big for the format."""
    cdef size_t batch_length = MIN_BATCH_LENGTH + payload
    if batch_length > INT32_MAX:
        raise _error("invalid_argument", f"the batch would be {batch_length + LENGTH_END} bytes, over the format's "
                                         f"2 GiB; split the records over several batches")
    return 0


cdef int64_t _checked_timestamp(object record, int64_t now_ms) except? -1:
    """The record's timestamp (`now_ms` if it has none), once it is checked to be a Record."""
    cdef int64_t value
    if type(record) is not _record_type and not isinstance(record, _record_type):
        raise _error("invalid_argument", f"records must be s3stream.records.Record instances, got "
                                         f"{type(record).__name__} {record!r:.60}")
    timestamp = _field(record, _timestamp_slot, "timestamp")
    if timestamp is None:
        return now_ms
    if not PyLong_Check(timestamp):
        raise TypeError(f"a record's timestamp is an int or None, got {type(timestamp).__name__}")
    value = timestamp
    if value < 0:
        raise _error("invalid_argument", f"record timestamp must be 0 or more, got {timestamp}")
    return value


cdef int _check_records(object records, Py_ssize_t start, int64_t now_ms) except -1:
    """_checked_timestamp of records[start:] (read afresh: an error's message may have run code)."""
    while start < len(records):
        _checked_timestamp(records[start], now_ms)
        start += 1
    return 0


cdef bint _all_records(object records):
    """Whether `records` is a list of Records, exactly: its items are then read in place, not
    copied to a tuple first. No Python code runs while such records are encoded (their fields
    are read from their slots, compression comes after), so the list cannot change meanwhile."""
    cdef Py_ssize_t i
    cdef PyObject** items
    if type(records) is not list or _record_type is None:
        return False
    items = Sequence_Fast_ITEMS(<PyObject*>records)
    for i in range(List_GET_SIZE(<PyObject*>records)):
        if <PyObject*>Py_TYPE(items[i]) != <PyObject*>_record_type:
            return False
    return True


cdef bytes _new_batch(size_t payload):
    """An uninitialised batch of a `payload`-byte records section, or the error of one too big."""
    _check_batch_size(payload)
    return PyBytes_FromStringAndSize(NULL, <Py_ssize_t>(BATCH_HEADER + payload))


def encode_batch(records, int64_t now_ms, int64_t base_offset, int16_t attributes, int32_t partition_leader_epoch,
                 int64_t producer_id, int16_t producer_epoch, int32_t base_sequence, compress) -> bytes:
    """One batch of `records` (Records, at least one), its arguments checked by the caller
    (s3stream.records.prepare_batch, or encode_records for the defaults). Records without a
    timestamp take `now_ms`. With a codec in `attributes`, the records section is passed to
    `compress(codec, section)`, whose result (a bytes-like object) becomes the batch's payload.

    Each record is visited once: checked (type and timestamp; a later record's such error still
    comes first, as in the twin), sized and written at the end of the batch, which starts at the
    last batch's size and grows as needed (measured: 100 records of 100 B, 4.6 us a batch when
    all were checked, then all sized, then all written; 3.7 us so)."""
    global _section_hint
    cdef object held = records if type(records) is tuple or _all_records(records) else tuple(records)
    cdef PyObject** items = Sequence_Fast_ITEMS(<PyObject*>held)
    cdef Py_ssize_t n = len(held), i
    cdef int codec = attributes & CODEC_MASK
    cdef int64_t timestamp
    cdef bint adding
    cdef Section section
    cdef BatchHeader header
    cdef unsigned char* out
    cdef Py_buffer compressed
    if n == 0 or n - 1 > INT32_MAX:
        raise ValueError(f"a record batch holds 1 to {<int64_t>INT32_MAX + 1} records, got {n}")
    if _record_type is None:
        raise RuntimeError("set_record_types() was not called (s3stream.records calls it)")
    section.start = 0 if codec else BATCH_HEADER
    section.used, section.cap = 0, _section_hint
    batch = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>(section.start + section.cap))
    Py_INCREF(batch)
    section.out = <PyObject*>batch
    batch = None                                     # the section's reference is its only one (to resize it)
    try:
        adding = False
        try:
            for i in range(n):
                record = <object>items[i]
                timestamp = _checked_timestamp(record, now_ms)
                if i == 0:
                    header.base_timestamp = header.max_timestamp = timestamp
                elif timestamp > header.max_timestamp:
                    header.max_timestamp = timestamp
                adding = True
                _add_record(record, &section, timestamp, i, header.base_timestamp)
                adding = False
        except BaseException:
            # The twin checks every record's type and timestamp before it encodes any: so
            # does this for the records after the one whose fields failed, then re-raises.
            if adding:
                _check_records(held, i + 1, now_ms)
            raise
        _section_hint = min(max(section.used + section.used // 8, 256), 1 << 20)
        if codec:
            PyObject_GetBuffer(compress(codec, _finish(&section)), &compressed, PyBUF_SIMPLE)
            try:
                result = _new_batch(<size_t>compressed.len)
                memcpy(PyBytes_AS_STRING(result) + BATCH_HEADER, compressed.buf, <size_t>compressed.len)
            finally:
                PyBuffer_Release(&compressed)
        else:
            _check_batch_size(section.used)
            result = _finish(&section)
    finally:
        Py_XDECREF(section.out)
    out = <unsigned char*>PyBytes_AS_STRING(result)
    header.base_offset = base_offset
    header.batch_length = <int32_t>(PyBytes_GET_SIZE(result) - LENGTH_END)
    header.partition_leader_epoch = partition_leader_epoch
    header.crc = 0
    header.attributes = attributes
    header.last_offset_delta = <int32_t>(n - 1)
    header.producer_id = producer_id
    header.producer_epoch = producer_epoch
    header.base_sequence = base_sequence
    header.count = <int32_t>n
    pack_header(out, &header)
    seal_batch(out, <size_t>PyBytes_GET_SIZE(result))
    return result


# ---- decoding -------------------------------------------------------------------------------

cdef inline object _sum(int64_t a, int64_t b):
    """a + b as an int, past int64 if it must be (a damaged base offset or timestamp): the
    twin's Python ints do not wrap."""
    cdef object big
    if (b > 0 and a > INT64_MAX - b) or (b < 0 and a < INT64_MIN - b):
        big = a
        return big + b
    return a + b


cdef inline object _consumed(object offset, object timestamp, object key, object value, object headers):
    cdef object record = PyType_GenericAlloc(<PyTypeObject*>_consumed_type, 5)
    # PyTuple_SET_ITEM steals a reference: each item gets one first.
    Py_INCREF(offset)
    PyTuple_SET_ITEM(record, 0, offset)
    Py_INCREF(timestamp)
    PyTuple_SET_ITEM(record, 1, timestamp)
    Py_INCREF(key)
    PyTuple_SET_ITEM(record, 2, key)
    Py_INCREF(value)
    PyTuple_SET_ITEM(record, 3, value)
    Py_INCREF(headers)
    PyTuple_SET_ITEM(record, 4, headers)
    return record


cdef object _read_nullable(Cursor* cursor, const unsigned char* end, str what):
    cdef int64_t length
    read_varint(cursor, end, 5, &length)
    if length < 0:
        if length != -1:
            raise _malformed(cursor.batch_at, f"{what} length is {length} (only -1, null, may be negative)")
        return None
    if length > end - cursor.pos:
        raise _malformed(cursor.batch_at, f"{what} of {length} bytes runs past its record ({end - cursor.pos} bytes "
                                          f"left)")
    data = PyBytes_FromStringAndSize(<const char*>cursor.pos, <Py_ssize_t>length)
    cursor.pos += length
    return data


cdef inline const unsigned char* _record_start(Cursor* cursor, int32_t i, int32_t count, int64_t* length,
                                               int64_t* timestamp_delta, int64_t* offset_delta) except NULL:
    """Frame record `i` of `count` at the cursor (decode_records and ColumnBuilder): its length
    read and checked against the section, its attributes skipped, its timestamp and offset deltas
    read; returns the record's end, the cursor left at its key."""
    cdef Py_ssize_t at = cursor.batch_at
    cdef const unsigned char* record_end
    if cursor.pos >= cursor.end:
        raise _malformed(at, f"it says {count} records but its records end after {i}")
    read_varint(cursor, cursor.end, 5, length)
    if length[0] < 0 or length[0] > cursor.end - cursor.pos:
        raise _malformed(at, f"record {i} claims {length[0]} bytes, {cursor.end - cursor.pos} are left")
    record_end = cursor.pos + length[0]
    if cursor.pos >= record_end:
        raise _malformed(at, f"record {i} is empty")
    cursor.pos += 1                                  # record attributes: unused
    read_varint(cursor, record_end, 10, timestamp_delta)
    read_varint(cursor, record_end, 5, offset_delta)
    return record_end


cdef list decode_records(Cursor* cursor, const BatchHeader* header):
    """The header.count records from the cursor to its end (an uncompressed records section),
    as ConsumedRecords; the section must hold exactly those."""
    cdef list records = []
    cdef int32_t count = header.count, i
    cdef int64_t length, timestamp_delta, offset_delta, header_count, key_length, j
    cdef const unsigned char* record_end
    cdef Py_ssize_t at = cursor.batch_at
    cdef object log_append_time = header.max_timestamp if header.attributes & TIMESTAMP_TYPE_BIT else None
    cdef object headers
    for i in range(count):
        record_end = _record_start(cursor, i, count, &length, &timestamp_delta, &offset_delta)
        key = _read_nullable(cursor, record_end, "a key")
        value = _read_nullable(cursor, record_end, "a value")
        read_varint(cursor, record_end, 5, &header_count)
        if header_count < 0 or header_count > record_end - cursor.pos:
            raise _malformed(at, f"record {i} claims {header_count} headers in {record_end - cursor.pos} bytes")
        headers = PyTuple_New(<Py_ssize_t>header_count)
        for j in range(header_count):
            read_varint(cursor, record_end, 5, &key_length)
            if key_length < 0 or key_length > record_end - cursor.pos:
                raise _malformed(at, f"a header key of {key_length} bytes does not fit its record "
                                     f"({record_end - cursor.pos} bytes left)")
            try:
                header_key = PyUnicode_DecodeUTF8(<char*>cursor.pos, <Py_ssize_t>key_length, NULL)
            except UnicodeDecodeError as e:
                raise _malformed(at, f"a header key is not UTF-8 ({e})") from None
            cursor.pos += key_length
            pair = (header_key, _read_nullable(cursor, record_end, "a header value"))
            Py_INCREF(pair)
            PyTuple_SET_ITEM(headers, <Py_ssize_t>j, pair)
        if cursor.pos != record_end:
            raise _malformed(at, f"record {i} says {length} bytes but its fields take "
                                 f"{length - (record_end - cursor.pos)}")
        records.append(_consumed(
            _sum(header.base_offset, offset_delta),
            _sum(header.base_timestamp, timestamp_delta) if log_append_time is None else log_append_time,
            key, value, headers))
    if cursor.pos != cursor.end:
        raise _malformed(at, f"{cursor.end - cursor.pos} bytes follow its {count} records")
    return records


cdef int _check_header(const unsigned char* data, Py_ssize_t size, Py_ssize_t at, bint whole, bint partial_ok,
                       BatchHeader* header, bint check_crc=True) except -1:
    """The header of the batch at byte `at` of data[:size], every check before its records: 0,
    or 1 (header unread) if `partial_ok` and data ends inside the batch, after checking what the
    bytes there show (its length, its magic byte). Without `check_crc`, the batch's CRC is not
    recomputed (the caller checked these bytes with another checksum)."""
    cdef Py_ssize_t available = size - at, end
    cdef bint partial
    cdef Py_ssize_t batch_length                     # int32 in the batch; + 12 must not wrap
    cdef int magic
    cdef uint32_t actual_crc
    cdef int codec
    if available < LENGTH_END:
        if partial_ok:
            return 1
        raise _error("length", f"record batch at byte {at}: the buffer ends after {available} bytes, inside the "
                               f"batch's first 12 (baseOffset, batchLength); pass the whole batch (it was truncated)")
    batch_length = <int32_t>load_be32(data + at + 8)
    if batch_length < MAGIC_AT + 1 - LENGTH_END:
        raise _error("length", f"record batch at byte {at}: batchLength is {batch_length}, too small for any batch "
                               f"(a v2 batch has {MIN_BATCH_LENGTH} or more); these bytes are not a record batch or "
                               f"its length was damaged")
    end = at + LENGTH_END + batch_length
    partial = end > size
    if partial:
        if not partial_ok:
            raise _error("length", f"record batch at byte {at}: batchLength {batch_length} says the batch is "
                                   f"{batch_length + LENGTH_END} bytes but the buffer holds {available}; the batch "
                                   f"was truncated: pass all of it")
        if available <= MAGIC_AT:
            return 1
    elif whole and end != size:
        raise _error("length", f"record batch at byte {at}: batchLength {batch_length} says the batch is "
                               f"{batch_length + LENGTH_END} bytes but the buffer holds {available}; pass exactly "
                               f"one batch, or several to iter_batches")
    magic = data[at + MAGIC_AT]
    if magic != MAGIC:
        raise _error("magic", f"record batch at byte {at}: magic byte is {magic if magic < 128 else magic - 256}, "
                              f"only 2 (record batch v2, Kafka 0.11+) is read; upgrade the producer or have it use "
                              f"message format v2")
    if batch_length < MIN_BATCH_LENGTH:
        raise _error("length", f"record batch at byte {at}: batchLength is {batch_length}, shorter than the v2 "
                               f"header ({MIN_BATCH_LENGTH}); its length was damaged: have the producer resend the "
                               f"batch")
    if partial:
        return 1
    unpack_header(data + at, header)
    actual_crc = crc32c_update(0, data + at + CRC_FROM, <size_t>(end - at - CRC_FROM)) if check_crc else header.crc
    if actual_crc != header.crc:
        raise _error("checksum", f"record batch at byte {at}: CRC-32C of its {end - at - CRC_FROM} bytes after the "
                                 f"CRC is {actual_crc:#010x}, the batch says {header.crc:#010x}; it was damaged after "
                                 f"it was written: have the producer resend it (or read another copy)")
    codec = header.attributes & CODEC_MASK
    if codec >= CODECS:
        raise _error("compression", f"record batch at byte {at}: compression codec id {codec} (attributes "
                                    f"{header.attributes:#06x}) is not one of 0 none, 1 gzip, 2 snappy, 3 lz4, 4 "
                                    f"zstd; have the producer use one of those")
    if header.count < 0:
        raise _malformed(at, f"its record count is {header.count}")
    return 0


def decode_batch(buf, Py_ssize_t at, bint whole, bint partial_ok, decompress, max_decompressed):
    """The batch at byte `at` of `buf` (which must end where the batch does, with `whole`):
    (base_offset, batch_length, partition_leader_epoch, crc, attributes, last_offset_delta,
    base_timestamp, max_timestamp, producer_id, producer_epoch, base_sequence, records); None if
    `partial_ok` and `buf` ends inside the batch. A compressed payload is passed to
    `decompress(codec, payload, at, max_decompressed)` (payload: a slice of memoryview(buf)),
    which returns the records section as a bytes-like object."""
    cdef Py_buffer view, section
    cdef BatchHeader header
    cdef Cursor cursor
    cdef int codec
    cdef list records
    if at < 0:
        raise ValueError(f"a batch's position is 0 or more, got {at}")
    if _consumed_type is None:
        raise RuntimeError("set_record_types() was not called (s3stream.records calls it)")
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        if _check_header(<const unsigned char*>view.buf, view.len, at, whole, partial_ok, &header):
            return None
        codec = header.attributes & CODEC_MASK
        cursor.batch_at = at
        if header.count == 0:        # emptied by compaction, kept for its producer state: Kafka reads no payload
            records = []
        elif codec:
            whole_view = buf if isinstance(buf, memoryview) else memoryview(buf)
            payload = whole_view[at + BATCH_HEADER:at + LENGTH_END + header.batch_length]
            PyObject_GetBuffer(decompress(codec, payload, at, max_decompressed), &section, PyBUF_SIMPLE)
            try:
                cursor.pos = <const unsigned char*>section.buf
                cursor.end = cursor.pos + section.len
                records = decode_records(&cursor, &header)
            finally:
                PyBuffer_Release(&section)
        else:
            cursor.pos = <const unsigned char*>view.buf + at + BATCH_HEADER
            cursor.end = <const unsigned char*>view.buf + at + LENGTH_END + header.batch_length
            records = decode_records(&cursor, &header)
    finally:
        PyBuffer_Release(&view)
    return (header.base_offset, header.batch_length, header.partition_leader_epoch, header.crc, header.attributes,
            header.last_offset_delta, header.base_timestamp, header.max_timestamp, header.producer_id,
            header.producer_epoch, header.base_sequence, records)


# ---- columnar decoding (the Spark source's Arrow batches) -------------------------------------
# decode_records's checks, record for record, but the fields go straight into column buffers laid
# out as Arrow's (validity bitmaps, int32 offsets, data), which pyarrow wraps without a copy: no
# Python object per record. pyspark_s3stream.source builds its Arrow batches from them.

cdef extern from *:
    bint add_overflow "__builtin_add_overflow"(int64_t a, int64_t b, int64_t* out) noexcept nogil


# Memory of ColumnBuffers that were freed, kept for the next batches' buffers: a batch's columns
# are handed to Arrow (and by PySpark to the JVM) and freed a batch later, and memory given back
# to the system comes back as fresh pages, faulted in and zeroed again (on a VM that returns freed
# memory to its host, faulted in by the host too): perf of the Spark source's read put a third of
# its time there. Blocks of at least POOL_MIN_BYTES, up to POOL_BYTES in all per process, as
# (capacity, address); used and fed with the GIL held.
DEF POOL_MIN_BYTES = 64 * 1024
DEF POOL_BYTES = 96 * 1024 * 1024
cdef list _pool = []
cdef Py_ssize_t _pool_bytes = 0


cdef unsigned char* _pool_take(Py_ssize_t capacity, Py_ssize_t* cap):
    """A pooled block of at least `capacity` bytes and at most twice that (its capacity in
    `cap`), or NULL."""
    global _pool_bytes
    cdef Py_ssize_t i, best = -1, size
    for i in range(len(_pool)):
        size = (<tuple>_pool[i])[0]
        if capacity <= size <= 2 * capacity and (best < 0 or size < (<tuple>_pool[best])[0]):
            best = i
    if best < 0:
        return NULL
    size, address = _pool.pop(best)
    _pool_bytes -= size
    cap[0] = size
    return <unsigned char*><size_t>address


cdef void _pool_give(unsigned char* data, Py_ssize_t cap):
    """Keep `data` for a later buffer, or free it (too small, or the pool is full)."""
    global _pool_bytes
    if cap >= POOL_MIN_BYTES and _pool_bytes + cap <= POOL_BYTES and _pool is not None:
        _pool.append((cap, <size_t>data))
        _pool_bytes += cap
    else:
        free(data)


def column_pool() -> tuple:
    """(blocks, bytes) kept for ColumnBuffers now (the pool's bound: POOL_BYTES)."""
    return len(_pool), _pool_bytes


cdef class ColumnBuffer:
    """Bytes a ColumnBuilder wrote, owned here and exported read-only through the buffer protocol
    (pyarrow.py_buffer wraps it without copying). Once handed out it never grows again. Made
    with room for `capacity` bytes (from the pool of freed buffers if it has a block of about
    that size); its memory goes back to the pool when it is freed."""
    cdef unsigned char* data
    cdef Py_ssize_t size
    cdef Py_ssize_t cap
    cdef bint exported

    def __cinit__(self, Py_ssize_t capacity=0):
        self.size = 0
        self.data = NULL
        if capacity >= POOL_MIN_BYTES:
            self.data = _pool_take(capacity, &self.cap)
        if self.data == NULL:
            self.cap = capacity if capacity > 64 else 64
            self.data = <unsigned char*>malloc(<size_t>self.cap)
            if self.data == NULL:
                raise MemoryError()

    def __dealloc__(self):
        if self.data != NULL:
            _pool_give(self.data, self.cap)

    def __len__(self):
        return self.size

    def __getbuffer__(self, Py_buffer* view, int flags):
        self.exported = True
        PyBuffer_FillInfo(view, self, self.data, self.size, 1, flags)

    def __releasebuffer__(self, Py_buffer* view):
        pass


cdef unsigned char* _room(ColumnBuffer buffer, Py_ssize_t more) except NULL:
    """Room for `more` bytes at the end of `buffer` (not zeroed)."""
    cdef Py_ssize_t need = buffer.size + more, cap
    cdef unsigned char* grown
    if need > buffer.cap:
        if buffer.exported:
            raise RuntimeError("a ColumnBuffer handed out by finish() cannot grow")
        cap = buffer.cap * 2 if buffer.cap * 2 > need else need
        grown = <unsigned char*>realloc(buffer.data, <size_t>cap)
        if grown == NULL:
            raise MemoryError()
        buffer.data, buffer.cap = grown, cap
    return buffer.data + buffer.size


cdef ColumnBuffer _like(ColumnBuffer last):
    """A new, empty buffer with room for a bit more than `last` held: a builder's batches are
    alike, so its columns rarely grow (each growth copies) and their blocks come from the pool."""
    return ColumnBuffer(last.size + last.size // 8)


cdef inline int _put_int32(ColumnBuffer buffer, int32_t value) except -1:
    (<int32_t*>_room(buffer, 4))[0] = value
    buffer.size += 4


cdef inline int _put_int64(ColumnBuffer buffer, int64_t value) except -1:
    (<int64_t*>_room(buffer, 8))[0] = value
    buffer.size += 8


cdef int _set_bit(ColumnBuffer bitmap, Py_ssize_t index, bint value) except -1:
    """Bit `index` of a validity bitmap (least significant bit first, as Arrow's)."""
    cdef Py_ssize_t byte = index >> 3
    if byte >= bitmap.size:
        memset(_room(bitmap, byte + 1 - bitmap.size), 0, <size_t>(byte + 1 - bitmap.size))
        bitmap.size = byte + 1
    if value:
        bitmap.data[byte] |= <unsigned char>(1 << (index & 7))
    else:
        bitmap.data[byte] &= <unsigned char>~(1 << (index & 7))


cdef class _BinaryColumn:
    """A nullable binary (or string) column: validity bitmap, int32 offsets, data."""
    cdef ColumnBuffer valid, offsets, data
    cdef Py_ssize_t length, nulls

    def __cinit__(self):
        self.valid, self.offsets, self.data = ColumnBuffer(), ColumnBuffer(), ColumnBuffer()
        self.reset()

    cdef int reset(self) except -1:
        """Empty, in new buffers sized for a batch like the last one (see _like)."""
        self.valid, self.offsets, self.data = _like(self.valid), _like(self.offsets), _like(self.data)
        self.length = self.nulls = 0
        _put_int32(self.offsets, 0)

    cdef int truncate(self, Py_ssize_t length, Py_ssize_t nulls) except -1:
        """Back to its first `length` items (of which `nulls` null), as they were."""
        self.length, self.nulls = length, nulls
        self.offsets.size = (length + 1) * 4
        self.data.size = (<int32_t*>self.offsets.data)[length]

    cdef int append(self, const unsigned char* data, int64_t length) except -1:
        """One item: `length` bytes at `data`, or null for a length of -1."""
        cdef Py_ssize_t end
        if length >= 0:
            end = self.data.size + length
            if end > INT32_MAX:
                raise OverflowError("a column's data reached 2 GiB: finish() its batch sooner")
            memcpy(_room(self.data, length), data, <size_t>length)
            self.data.size = end
        else:
            self.nulls += 1
        _set_bit(self.valid, self.length, length >= 0)
        _put_int32(self.offsets, <int32_t>self.data.size)
        self.length += 1

    cdef tuple take(self):
        """(validity bitmap or None if no item is null, offsets, data, null count); reset."""
        result = (self.valid if self.nulls else None, self.offsets, self.data, self.nulls)
        self.reset()
        return result


cdef int _check_utf8(const unsigned char* data, int64_t length, Py_ssize_t at) except -1:
    """A header key must be UTF-8 text (an Arrow string, as the record decoder's str)."""
    cdef int64_t i
    for i in range(length):
        if data[i] >= 0x80:
            try:
                PyUnicode_DecodeUTF8(<const char*>data, <Py_ssize_t>length, NULL)
            except UnicodeDecodeError as e:
                raise _malformed(at, f"a header key is not UTF-8 ({e})") from None
            return 0
    return 0


cdef int _read_length(Cursor* cursor, const unsigned char* end, str what, int64_t* length) except -1:
    """A nullable field's length (-1: null) checked against `end`, as _read_nullable checks it."""
    read_varint(cursor, end, 5, length)
    if length[0] < 0:
        if length[0] != -1:
            raise _malformed(cursor.batch_at, f"{what} length is {length[0]} (only -1, null, may be negative)")
    elif length[0] > end - cursor.pos:
        raise _malformed(cursor.batch_at, f"{what} of {length[0]} bytes runs past its record "
                                          f"({end - cursor.pos} bytes left)")
    return 0


cdef class ColumnBuilder:
    """Records of fetched batches as Arrow column buffers for the schema of Spark's Kafka source
    (key, value, partition, offset, timestamp in microseconds, timestampType, headers).

    add() decodes one stored batch (a Kafka record batch v2 appended with append_records) with
    every check decode_batch makes, and keeps its records whose offsets are in [low, high); a
    batch that fails leaves the builder as it was. finish() hands the buffers out and starts
    empty again."""
    cdef bytes partition
    cdef _BinaryColumn keys, values, header_keys, header_values
    cdef ColumnBuffer offsets, timestamps, timestamp_types, header_starts
    cdef readonly Py_ssize_t rows
    cdef Py_ssize_t headers

    def __cinit__(self, bytes partition):
        self.partition = partition
        self.keys, self.values = _BinaryColumn(), _BinaryColumn()
        self.header_keys, self.header_values = _BinaryColumn(), _BinaryColumn()
        self.offsets, self.timestamps, self.timestamp_types = ColumnBuffer(), ColumnBuffer(), ColumnBuffer()
        self.header_starts = ColumnBuffer()
        self._reset()

    cdef int _reset(self) except -1:
        self.offsets, self.timestamps = _like(self.offsets), _like(self.timestamps)
        self.timestamp_types, self.header_starts = _like(self.timestamp_types), _like(self.header_starts)
        _put_int32(self.header_starts, 0)
        self.rows = self.headers = 0

    @property
    def nbytes(self) -> int:
        """Bytes the columns hold so far (what the batch will weigh)."""
        return (self.keys.data.size + self.values.data.size + self.header_keys.data.size
                + self.header_values.data.size + self.rows * 32)

    def add(self, buf, int64_t base_offset, int64_t count, int64_t low, int64_t high, decompress,
            Py_ssize_t max_decompressed, bint check_crc=True):
        """Decode the stored batch `buf` (records [base_offset, base_offset + count)), keeping the
        records in [low, high); returns how many it kept. `decompress` as decode_batch's. Raises
        as decode_batch does, and InvalidRecordBatchError for a batch whose records are not the
        `count` it was appended with (FetchedBatch.records's check); a gap (no records) adds none.
        `check_crc=False` skips the batch's CRC (every other check stays): for batches read from
        objects, whose block checksum (CRC-32C over the same bytes) was checked by the read, and
        which were checked whole when appended."""
        cdef Py_buffer view, section
        cdef BatchHeader header
        cdef Cursor cursor
        cdef int codec
        cdef Py_ssize_t rows = self.rows, headers = self.headers
        cdef Py_ssize_t key_nulls = self.keys.nulls, value_nulls = self.values.nulls
        cdef Py_ssize_t header_value_nulls = self.header_values.nulls
        PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
        try:
            try:
                _check_header(<const unsigned char*>view.buf, view.len, 0, True, False, &header, check_crc)
            except (_error_types["length"], _error_types["magic"]) as e:
                raise _not_a_batch(e, base_offset, count, view.len) from None
            if (header.count != 0 and header.count != count) or header.last_offset_delta != count - 1:
                raise _error("invalid", f"the batch at offset {base_offset} was appended as {count} records, but "
                                        f"its payload is a record batch of {header.count} (last offset delta "
                                        f"{header.last_offset_delta}): it was not appended with append_records; "
                                        f"read it as bytes (payload)")
            if header.count == 0:
                return 0
            codec = header.attributes & CODEC_MASK
            cursor.batch_at = 0
            try:
                if codec:
                    payload = memoryview(buf)[BATCH_HEADER:LENGTH_END + header.batch_length]
                    PyObject_GetBuffer(decompress(codec, payload, 0, max_decompressed), &section, PyBUF_SIMPLE)
                    try:
                        cursor.pos = <const unsigned char*>section.buf
                        cursor.end = cursor.pos + section.len
                        self._decode(&cursor, &header, base_offset - header.base_offset, low, high)
                    finally:
                        PyBuffer_Release(&section)
                else:
                    cursor.pos = <const unsigned char*>view.buf + BATCH_HEADER
                    cursor.end = <const unsigned char*>view.buf + LENGTH_END + header.batch_length
                    self._decode(&cursor, &header, base_offset - header.base_offset, low, high)
            except BaseException:
                self._truncate(rows, headers, key_nulls, value_nulls, header_value_nulls)
                raise
        finally:
            PyBuffer_Release(&view)
        return self.rows - rows

    cdef int _truncate(self, Py_ssize_t rows, Py_ssize_t headers, Py_ssize_t key_nulls, Py_ssize_t value_nulls,
                       Py_ssize_t header_value_nulls) except -1:
        self.keys.truncate(rows, key_nulls)
        self.values.truncate(rows, value_nulls)
        self.header_keys.truncate(headers, 0)
        self.header_values.truncate(headers, header_value_nulls)
        self.offsets.size = self.timestamps.size = rows * 8
        self.timestamp_types.size = rows * 4
        self.header_starts.size = (rows + 1) * 4
        self.rows, self.headers = rows, headers

    cdef int _decode(self, Cursor* cursor, const BatchHeader* header, int64_t shift, int64_t low,
                     int64_t high) except -1:
        """decode_records, into the columns (the records of [low, high) only)."""
        cdef int32_t count = header.count, i
        cdef int64_t length, timestamp_delta, offset_delta, header_count, key_length, value_length, j
        cdef int64_t name_length, data_length
        cdef int64_t offset, timestamp
        cdef const unsigned char* record_end
        cdef const unsigned char* key
        cdef const unsigned char* value
        cdef const unsigned char* headers_at
        cdef Py_ssize_t at = cursor.batch_at
        cdef bint log_append_time = header.attributes & TIMESTAMP_TYPE_BIT
        cdef int32_t timestamp_type = 1 if log_append_time else 0
        cdef bint keep
        for i in range(count):
            record_end = _record_start(cursor, i, count, &length, &timestamp_delta, &offset_delta)
            _read_length(cursor, record_end, "a key", &key_length)
            key = cursor.pos
            if key_length > 0:
                cursor.pos += key_length
            _read_length(cursor, record_end, "a value", &value_length)
            value = cursor.pos
            if value_length > 0:
                cursor.pos += value_length
            read_varint(cursor, record_end, 5, &header_count)
            if header_count < 0 or header_count > record_end - cursor.pos:
                raise _malformed(at, f"record {i} claims {header_count} headers in {record_end - cursor.pos} bytes")
            if add_overflow(header.base_offset, offset_delta, &offset) or \
                    add_overflow(offset, shift, &offset):
                raise _malformed(at, f"record {i}'s offset does not fit 64 bits")
            if log_append_time:
                timestamp = header.max_timestamp
            elif add_overflow(header.base_timestamp, timestamp_delta, &timestamp):
                raise _malformed(at, f"record {i}'s timestamp does not fit 64 bits")
            keep = low <= offset < high
            for j in range(header_count):
                read_varint(cursor, record_end, 5, &name_length)
                if name_length < 0 or name_length > record_end - cursor.pos:
                    raise _malformed(at, f"a header key of {name_length} bytes does not fit its record "
                                         f"({record_end - cursor.pos} bytes left)")
                _check_utf8(cursor.pos, name_length, at)
                if keep:
                    self.header_keys.append(cursor.pos, name_length)
                cursor.pos += name_length
                _read_length(cursor, record_end, "a header value", &data_length)
                if keep:
                    self.header_values.append(cursor.pos, data_length)
                    self.headers += 1
                if data_length > 0:
                    cursor.pos += data_length
            if cursor.pos != record_end:
                raise _malformed(at, f"record {i} says {length} bytes but its fields take "
                                     f"{length - (record_end - cursor.pos)}")
            if not keep:
                continue
            if timestamp > INT64_MAX // 1000 or timestamp < INT64_MIN // 1000:
                raise _malformed(at, f"record {i}'s timestamp {timestamp} ms is out of a timestamp's range")
            self.keys.append(key, key_length)
            self.values.append(value, value_length)
            _put_int64(self.offsets, offset)
            _put_int64(self.timestamps, timestamp * 1000)
            _put_int32(self.timestamp_types, timestamp_type)
            _put_int32(self.header_starts, <int32_t>self.headers)
            self.rows += 1
        if cursor.pos != cursor.end:
            raise _malformed(at, f"{cursor.end - cursor.pos} bytes follow its {count} records")
        return 0

    def finish(self):
        """The columns so far, and the builder empty again: a dict of
        rows; key, value: (validity or None, offsets, data, null count); partition: (offsets,
        data); offset, timestamp (µs), timestampType: data; headers: list offsets, header count,
        header keys (validity, offsets, data, nulls), header values (the same). Buffers are
        ColumnBuffers (read-only buffer protocol)."""
        cdef Py_ssize_t rows = self.rows, i, name_length = len(self.partition)
        cdef ColumnBuffer partition_offsets = ColumnBuffer((rows + 1) * 4)
        cdef ColumnBuffer partition_data = ColumnBuffer(rows * name_length)
        cdef unsigned char* names
        cdef int32_t* starts
        if rows * name_length > INT32_MAX:
            raise OverflowError("the partition column reached 2 GiB: finish() its batch sooner")
        starts = <int32_t*>_room(partition_offsets, (rows + 1) * 4)
        for i in range(rows + 1):
            starts[i] = <int32_t>(i * name_length)
        partition_offsets.size = (rows + 1) * 4
        names = _room(partition_data, rows * name_length)
        for i in range(rows):
            memcpy(names + i * name_length, PyBytes_AS_STRING(self.partition), <size_t>name_length)
        partition_data.size = rows * name_length
        result = {"rows": rows, "key": self.keys.take(), "value": self.values.take(),
                  "partition": (partition_offsets, partition_data), "offset": self.offsets,
                  "timestamp": self.timestamps, "timestampType": self.timestamp_types,
                  "headers": (self.header_starts, self.headers, self.header_keys.take(), self.header_values.take())}
        self._reset()
        return result
