"""s3stream.records, the Kafka record batch v2 codec, against kafka-python as an independent oracle
(its own builder, reader, CRC-32C and codec modules: gzip, python-snappy, lz4, zstandard), both
ways; then every kind of bad batch raising its own error and nothing else."""
from __future__ import annotations

import random
import struct
import subprocess
import sys
import warnings

import cramjam
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

with warnings.catch_warnings():  # kafka-python loads its protocol schemas with deprecated importlib calls
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka import codec as kafka_codec
    from kafka.record.default_records import DefaultRecordBatchBuilder
    from kafka.record.memory_records import MemoryRecords
    from kafka.record.util import calc_crc32c

from s3stream import records as native_records
from s3stream.errors import (
    DecompressionLimitError, InvalidArgumentError, InvalidBatchError, InvalidRecordBatchError, RecordBatchChecksumError, RecordBatchLengthError,
    UnsupportedCompressionError, UnsupportedMagicError,
)
from s3stream.records import (
    COMPRESSION_CODECS, LOG_APPEND_TIME, ConsumedRecord, Record, decode_batch, encode_batch, iter_batches,
)

CODECS = list(COMPRESSION_CODECS)
CODEC_IDS = {name: i for i, name in enumerate(COMPRESSION_CODECS)}
HEADER = struct.Struct(">qiibIhiqqqhii")
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

binaries = st.binary(max_size=64) | st.binary(min_size=200, max_size=2000).map(lambda b: b[:20] * 40)
headers = st.lists(st.tuples(st.text(max_size=8), st.none() | st.binary(max_size=16)), max_size=3)
timestamps = st.integers(0, (1 << 63) - 1) | st.integers(1_600_000_000_000, 1_800_000_000_000)
records_st = st.lists(st.builds(Record, key=st.none() | binaries, value=st.none() | binaries, timestamp=timestamps,
                                headers=headers), min_size=1, max_size=8)


def expected(records, base_offset=0):
    return [(base_offset + i, r.timestamp, r.key, r.value, tuple(r.headers)) for i, r in enumerate(records)]


def ours(batch):
    return [(r.offset, r.timestamp, r.key, r.value, r.headers) for r in batch.records]


def kafka_read(buf):
    """Every batch kafka-python finds in buf, CRC checked by it, with its records."""
    memory = MemoryRecords(bytes(buf))
    batches = []
    while memory.has_next():
        batch = memory.next_batch()
        assert batch.validate_crc()
        batches.append((batch, [(r.offset, r.timestamp, r.key, r.value, tuple(r.headers)) for r in batch]))
    return batches


def kafka_build(records, codec, producer=(-1, -1, -1, False)):
    builder = DefaultRecordBatchBuilder(2, CODEC_IDS[codec], producer[3], producer[0], producer[1], producer[2], 1 << 30)
    for offset, r in enumerate(records):
        assert builder.append(offset, r.timestamp, r.key, r.value, list(r.headers)) is not None
    return bytes(builder.build())


def rebuild(batch: bytes, *, attributes=None, payload=None, count=None, batch_length=None) -> bytes:
    """batch with fields replaced and its CRC recomputed (kafka-python's CRC-32C), to reach the
    checks that come after the CRC."""
    fields = list(HEADER.unpack_from(batch))
    body = batch[HEADER.size:] if payload is None else payload
    if attributes is not None:
        fields[5] = attributes
    if count is not None:
        fields[12] = count
    fields[1] = HEADER.size - 12 + len(body) if batch_length is None else batch_length
    out = bytearray(HEADER.pack(*fields) + body)
    struct.pack_into(">I", out, 17, calc_crc32c(bytes(out[21:])))
    return bytes(out)


def test_kafka_python_has_every_codec():
    # Without them kafka-python could not check compressed batches: fail rather than skip.
    assert kafka_codec.has_gzip() and kafka_codec.has_snappy() and kafka_codec.has_lz4() and kafka_codec.has_zstd()


@pytest.mark.parametrize("codec", CODECS)
@SETTINGS
@given(records=records_st, base_offset=st.integers(0, 1 << 40))
def test_kafka_python_reads_ours(codec, records, base_offset):
    buf = encode_batch(records, compression=codec, base_offset=base_offset)
    [(batch, read)] = kafka_read(buf)
    assert read == expected(records, base_offset)
    assert batch.compression_type == CODEC_IDS[codec]  # compressed even when it does not pay
    assert (batch.base_offset, batch.last_offset_delta) == (base_offset, len(records) - 1)
    assert batch.first_timestamp == records[0].timestamp
    assert batch.max_timestamp == max(r.timestamp for r in records)
    assert ours(decode_batch(buf)) == read


@pytest.mark.parametrize("codec", CODECS)
@SETTINGS
@given(records=records_st)
def test_we_read_kafka_python(codec, records):
    buf = kafka_build(records, codec)
    batch = decode_batch(buf)
    assert ours(batch) == expected(records)
    assert batch.compression in (codec, None)  # kafka-python sends uncompressed when compression does not pay


@pytest.mark.parametrize("codec", CODECS[1:])
def test_we_read_kafka_python_compressed(codec):
    records = [Record(b"key-%d" % i, b"value " * 100, 1_700_000_000_000 + i, [("trace", b"abc")]) for i in range(50)]
    buf = kafka_build(records, codec)
    assert buf[22] & 7 == CODEC_IDS[codec]  # kafka-python did compress: our decompression is exercised
    batch = decode_batch(buf)
    assert batch.compression == codec
    assert ours(batch) == expected(records)


@SETTINGS
@given(records=records_st, producer_id=st.integers(0, (1 << 63) - 1), producer_epoch=st.integers(0, (1 << 15) - 1),
       base_sequence=st.integers(0, (1 << 31) - 1), transactional=st.booleans())
def test_uncompressed_bytes_equal_kafka_python(records, producer_id, producer_epoch, base_sequence, transactional):
    theirs = kafka_build(records, None, (producer_id, producer_epoch, base_sequence, transactional))
    # kafka-python stamps partitionLeaderEpoch 0 where producers (Java, ours by default) write -1.
    assert encode_batch(records, producer_id=producer_id, producer_epoch=producer_epoch, base_sequence=base_sequence,
                        is_transactional=transactional, partition_leader_epoch=0) == theirs


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("transactional", [False, True])
def test_producer_fields_round_trip(codec, transactional):
    records = [Record(b"k", b"v" * 50, 5), Record(None, b"w" * 50, 3)]
    buf = encode_batch(records, compression=codec, base_offset=100, producer_id=123456789012, producer_epoch=7,
                       base_sequence=2_000_000_000, is_transactional=transactional)
    batch = decode_batch(buf)
    assert (batch.producer_id, batch.producer_epoch, batch.base_sequence, batch.is_transactional) == \
        (123456789012, 7, 2_000_000_000, transactional)
    assert (batch.base_offset, batch.last_offset, batch.next_offset, batch.size) == (100, 101, 102, len(buf))
    assert (batch.partition_leader_epoch, batch.magic, batch.is_control, batch.timestamp_type) == (-1, 2, False, 0)
    assert (batch.base_timestamp, batch.max_timestamp) == (5, 5)
    [(theirs, read)] = kafka_read(buf)
    assert (theirs.producer_id, theirs.producer_epoch, theirs.base_sequence, theirs.is_transactional) == \
        (123456789012, 7, 2_000_000_000, transactional)
    assert theirs.leader_epoch == -1
    assert read == ours(batch) == [(100, 5, b"k", b"v" * 50, ()), (101, 3, None, b"w" * 50, ())]


def test_log_append_time_records_take_max_timestamp():
    buf = encode_batch([Record(b"a", timestamp=10), Record(b"b", timestamp=30), Record(b"c", timestamp=20)],
                       timestamp_type=LOG_APPEND_TIME)
    batch = decode_batch(buf)
    assert batch.timestamp_type == LOG_APPEND_TIME
    assert [r.timestamp for r in batch.records] == [30, 30, 30]
    [(theirs, read)] = kafka_read(buf)
    assert theirs.timestamp_type == 1 and [r[1] for r in read] == [30, 30, 30]


def test_missing_timestamps_take_now():
    batch = decode_batch(encode_batch([Record(b"a"), Record(b"b", timestamp=5), Record(b"c")], now_ms=1000))
    assert [r.timestamp for r in batch.records] == [1000, 5, 1000]
    assert (batch.base_timestamp, batch.max_timestamp) == (1000, 1000)


def test_record_normalises_its_fields():
    record = Record(bytearray(b"k"), memoryview(b"v"), 1, [["h", bytearray(b"x")], ("n", None)])
    assert record == Record(b"k", b"v", 1, (("h", b"x"), ("n", None)))
    assert type(record.key) is bytes and type(record.value) is bytes and type(record.headers) is tuple
    hash(record)
    assert decode_batch(encode_batch([record])).records == [ConsumedRecord(0, 1, b"k", b"v", (("h", b"x"), ("n", None)))]


def test_utf8_header_keys_and_empty_values():
    record = Record(b"", b"", 0, [("ключ-🔑", b""), ("", None)])
    buf = encode_batch([record])
    assert ours(decode_batch(buf)) == [(0, 0, b"", b"", (("ключ-🔑", b""), ("", None)))]
    assert kafka_read(buf)[0][1] == ours(decode_batch(buf))


@pytest.mark.parametrize("make, names", [
    (lambda: encode_batch([]), "at least one record"),
    (lambda: encode_batch([Record(b"k")], compression="brotli"), "'brotli'"),
    (lambda: encode_batch([Record(b"k")], compression="GZIP"), "'gzip', 'snappy', 'lz4', 'zstd'"),
    (lambda: encode_batch([(b"k", b"v")]), "tuple"),
    (lambda: encode_batch([Record(b"k")], producer_epoch=1 << 15), "32768"),
    (lambda: encode_batch([Record(b"k")], base_sequence=-2), "-2"),
    (lambda: encode_batch([Record(b"k")], base_offset=1.0), "1.0"),
    (lambda: encode_batch([Record(b"k")], timestamp_type=2), "2"),
    (lambda: encode_batch([Record(b"k")], is_transactional=True), "producer_id=-1"),
    (lambda: Record("text"), "'text'"),
    (lambda: Record(value=12), "12"),
    (lambda: Record(timestamp=1.5), "1.5"),
    (lambda: Record(timestamp=True), "True"),
    (lambda: Record(timestamp=-1), "-1"),
    (lambda: Record(headers=[(b"bytes-key", b"v")]), "bytes-key"),
    (lambda: Record(headers=[("k", "str value")]), "str value"),
    (lambda: Record(headers=[("k",)]), "('k',)"),
    (lambda: Record(headers=5), "5"),
])
def test_encode_rejects_bad_arguments(make, names):
    with pytest.raises(InvalidArgumentError) as caught:
        make()
    assert type(caught.value) is InvalidArgumentError
    assert names in str(caught.value)


def test_compression_frames_as_kafka_java_writes_them():
    records = [Record(b"k", bytes(range(256)) * 400, 1)]  # 100 KiB: several snappy and lz4 blocks
    payload = {codec: encode_batch(records, compression=codec)[HEADER.size:] for codec in CODECS[1:]}
    assert payload["gzip"][:2] == b"\x1f\x8b"
    assert payload["snappy"][:16] == b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1)  # xerial, version 1
    lz4 = payload["lz4"]
    assert lz4[:4] == b"\x04\x22\x4d\x18"
    assert lz4[4:6] == b"\x60\x40"  # version 1, independent blocks, no checksums or size; 64 KiB blocks
    assert lz4[-4:] == b"\0\0\0\0"  # end mark, no content checksum after it
    assert payload["zstd"][:4] == b"\x28\xb5\x2f\xfd"
    incompressible = [Record(b"k", random.Random(1).randbytes(150_000), 1)]  # lz4 stores such blocks as they are
    for codec in CODECS[1:]:
        for batch in (records, incompressible):
            buf = encode_batch(batch, compression=codec)
            assert kafka_read(buf)[0][1] == ours(decode_batch(buf)) == expected(batch)


def test_raw_snappy_is_read_too():
    records = [Record(b"k%d" % i, b"v" * 100, i) for i in range(10)]
    plain = encode_batch(records)
    buf = rebuild(plain, attributes=CODEC_IDS["snappy"], payload=bytes(cramjam.snappy.compress_raw(plain[HEADER.size:])))
    assert ours(decode_batch(buf)) == kafka_read(buf)[0][1] == expected(records)


# ---- bad batches ----------------------------------------------------------------------------

def small_batch(codec=None):
    return encode_batch([Record(b"key", b"value" * 20, 1_700_000_000_000, [("h", b"1")]), Record(None, b"v2", 1)],
                        compression=codec, base_offset=5)


def raises_exactly(error, buf, match=None, limit=native_records.MAX_DECOMPRESSED_BYTES):
    with pytest.raises(error, match=match) as caught:
        decode_batch(buf, max_decompressed_bytes=limit)
    assert type(caught.value) is error, repr(caught.value)
    return caught.value


@pytest.mark.parametrize("magic", [0, 1, 3, 0xFF])
def test_wrong_magic(magic):
    buf = bytearray(small_batch())
    buf[16] = magic
    error = raises_exactly(UnsupportedMagicError, bytes(buf))
    assert f"magic byte is {magic if magic < 128 else magic - 256}" in str(error)


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_every_flipped_byte(codec):
    good = small_batch(codec)
    for position in range(len(good)):
        buf = bytearray(good)
        buf[position] ^= 0x04
        if position < 8 or 12 <= position < 16:  # baseOffset, partitionLeaderEpoch: outside the CRC
            assert decode_batch(bytes(buf)).records != [] and decode_batch(bytes(buf)) != decode_batch(good)
        elif position < 12:
            raises_exactly(RecordBatchLengthError, bytes(buf))
        elif position == 16:
            raises_exactly(UnsupportedMagicError, bytes(buf))
        else:
            raises_exactly(RecordBatchChecksumError, bytes(buf), match="have the producer resend it")


@pytest.mark.parametrize("codec", [None, "gzip", "lz4"])
def test_truncated_at_every_cut(codec):
    good = small_batch(codec)
    for cut in range(len(good)):
        raises_exactly(RecordBatchLengthError, good[:cut], match="truncated")
        if cut:  # a whole batch, then a cut one
            with pytest.raises(RecordBatchLengthError):
                list(iter_batches(good + good[:cut]))


def test_iter_batches_yields_the_good_ones_before_a_truncated_tail():
    good = small_batch()
    batches = iter_batches(good + good[:30])
    assert ours(next(batches)) == ours(decode_batch(good))
    with pytest.raises(RecordBatchLengthError):
        next(batches)


@pytest.mark.parametrize("batch_length, error", [
    (-1, RecordBatchLengthError), (0, RecordBatchLengthError), (4, RecordBatchLengthError),
    (48, RecordBatchLengthError), (1 << 30, RecordBatchLengthError),
])
def test_batch_length_inconsistent(batch_length, error):
    buf = bytearray(small_batch())
    struct.pack_into(">i", buf, 8, batch_length)
    raises_exactly(error, bytes(buf))


def test_batch_length_shorter_than_the_buffer():
    good = small_batch()
    shorter = bytearray(good)
    struct.pack_into(">i", shorter, 8, len(good) - 12 - 5)
    raises_exactly(RecordBatchLengthError, bytes(shorter), match="pass exactly one batch")
    with pytest.raises(RecordBatchChecksumError):  # read as a batch of its own, its CRC fails
        list(iter_batches(bytes(shorter)))
    raises_exactly(RecordBatchLengthError, good + good)  # two batches are not one


@pytest.mark.parametrize("codec_id", [5, 6, 7])
def test_unknown_codec(codec_id):
    error = raises_exactly(UnsupportedCompressionError, rebuild(small_batch(), attributes=codec_id))
    assert f"codec id {codec_id}" in str(error)


@pytest.mark.parametrize("codec", CODECS[1:])
@pytest.mark.parametrize("garbage", [b"\x00" * 40, b"this is not compressed at all, not in any codec"])
def test_garbage_compressed_payload(codec, garbage):
    buf = rebuild(small_batch(), attributes=CODEC_IDS[codec], payload=garbage)
    raises_exactly(InvalidRecordBatchError, buf, match="does not decompress|snappy")


@pytest.mark.parametrize("codec", CODECS[1:])
def test_truncated_compressed_payload(codec):
    good = encode_batch([Record(b"k", bytes(range(256)) * 300, 1)], compression=codec)
    half = rebuild(good, payload=good[HEADER.size:len(good) // 2])
    raises_exactly(InvalidRecordBatchError, half)


def test_xerial_block_length_past_the_end():
    good = small_batch("snappy")
    payload = bytearray(good[HEADER.size:])
    struct.pack_into(">i", payload, 16, len(payload))
    raises_exactly(InvalidRecordBatchError, rebuild(good, payload=bytes(payload)), match="xerial")


@pytest.mark.parametrize("codec", [None, "gzip"])
def test_record_count_disagrees_with_the_records(codec):
    good = small_batch(codec)
    raises_exactly(InvalidRecordBatchError, rebuild(good, count=3), match="says 3 records")
    raises_exactly(InvalidRecordBatchError, rebuild(good, count=1), match="bytes follow")
    raises_exactly(InvalidRecordBatchError, rebuild(good, count=-1), match="count is -1")
    # A batch emptied by compaction: valid, and Kafka does not read its payload.
    assert decode_batch(rebuild(good, count=0, payload=b"")).records == []
    assert decode_batch(rebuild(good, count=0)).records == []


def test_record_length_disagrees_with_its_fields():
    good = small_batch()
    payload = bytearray(good[HEADER.size:])
    payload[0] += 2  # the first record's length varint (zigzag, one byte): two bytes more
    raises_exactly(InvalidRecordBatchError, rebuild(good, payload=bytes(payload)))
    overlong_varint = rebuild(good, payload=b"\xff" * 12, count=1)
    raises_exactly(InvalidRecordBatchError, overlong_varint, match="longer than 5 bytes")


def test_errors_are_invalid_batch_errors():
    for error in (UnsupportedMagicError, RecordBatchChecksumError, RecordBatchLengthError, UnsupportedCompressionError):
        assert issubclass(error, InvalidRecordBatchError)
    assert issubclass(InvalidRecordBatchError, InvalidBatchError) and issubclass(InvalidRecordBatchError, ValueError)


@pytest.mark.parametrize("codec", [None, "snappy"])
@settings(max_examples=150, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.integers(0, 8))
def test_mangled_records_raise_only_record_batch_errors(codec, edits, cut):
    """Any damage behind a valid CRC decodes or raises InvalidRecordBatchError: never IndexError,
    struct.error, UnicodeDecodeError or a codec's own exception."""
    good = encode_batch([Record(b"k", b"v" * 30, 1, [("h", b"x")]), Record(None, None, 2, [("é", None)])],
                        compression=codec)
    payload = bytearray(good[HEADER.size:])
    for position, value in edits:
        payload[position % len(payload)] = value
    buf = rebuild(good, payload=bytes(payload[:len(payload) - cut]))
    try:
        batch = decode_batch(buf)
    except InvalidRecordBatchError:
        return
    assert len(batch.records) == 2


# ---- several batches ------------------------------------------------------------------------

def test_iter_batches_over_concatenated_batches():
    parts, want, offset = [], [], 0
    for i, codec in enumerate(CODECS * 2):
        records = [Record(b"%d-%d" % (i, j), b"x" * (10 * j), 1000 + j) for j in range(i + 1)]
        parts.append(encode_batch(records, compression=codec, base_offset=offset))
        want.extend(expected(records, offset))
        offset += len(records)
    buf = b"".join(parts)
    batches = list(iter_batches(memoryview(buf)))
    assert [b.compression for b in batches] == CODECS * 2
    assert [b.size for b in batches] == [len(p) for p in parts]
    assert [r for b in batches for r in ours(b)] == want
    assert [r for _, read in kafka_read(buf) for r in read] == want
    assert list(iter_batches(b"")) == []


# ---- a partial last batch, as a Kafka fetch response may end ------------------------------------

@pytest.mark.parametrize("codec", [None, "zstd"])
def test_skip_partial_tail_yields_the_whole_batches(codec):
    good, other = small_batch(codec), encode_batch([Record(b"k", b"v" * 50, 1)], compression=codec, base_offset=7)
    for cut in range(len(other)):
        batches = list(iter_batches(good + other[:cut], skip_partial_tail=True))
        assert [ours(b) for b in batches] == [ours(decode_batch(good))]
    both = list(iter_batches(good + other, skip_partial_tail=True))
    assert [b.base_offset for b in both] == [5, 7] and both[-1].next_offset == 8
    with pytest.raises(RecordBatchLengthError, match="truncated"):   # stored bytes: a cut batch is corruption
        list(iter_batches(good + other[:30]))
    assert list(iter_batches(b"", skip_partial_tail=True)) == []


def test_skip_partial_tail_still_checks_what_the_partial_batch_shows():
    good = small_batch()
    bad_magic = bytearray(good[:40])
    bad_magic[16] = 1
    with pytest.raises(UnsupportedMagicError):
        list(iter_batches(good + bytes(bad_magic), skip_partial_tail=True))
    too_short = bytearray(good[:20])
    struct.pack_into(">i", too_short, 8, 3)
    with pytest.raises(RecordBatchLengthError, match="too small for any batch"):
        list(iter_batches(good + bytes(too_short), skip_partial_tail=True))
    header_length = bytearray(good[:20])
    struct.pack_into(">i", header_length, 8, 30)             # magic 2, shorter than a v2 header
    with pytest.raises(RecordBatchLengthError, match="shorter than the v2 header"):
        list(iter_batches(good + bytes(header_length), skip_partial_tail=True))
    flipped = bytearray(good)                                 # a whole batch is checked whole: its CRC
    flipped[-1] ^= 1
    with pytest.raises(RecordBatchChecksumError):
        list(iter_batches(bytes(flipped) + good[:30], skip_partial_tail=True))


@pytest.mark.parametrize("cut", [1, 11, 12, 30, -1])
def test_skip_partial_tail_with_no_whole_batch_raises(cut):
    """As a Kafka consumer fails a fetch that returned part of one batch: it cannot progress."""
    good = small_batch()
    with pytest.raises(RecordBatchLengthError, match="no whole batch to read; fetch again with a max_bytes") as e:
        list(iter_batches(good[:cut], skip_partial_tail=True))
    if cut >= 12 or cut < 0:
        assert f"batchLength says it is {len(good)} bytes" in str(e.value)


# ---- decompression bombs: bounded by max_decompressed_bytes -----------------------------------

def records_section_size(records) -> int:
    return len(encode_batch(records)) - HEADER.size


@pytest.mark.parametrize("codec", CODECS[1:])
def test_decompressed_size_limit_is_exact(codec):
    records = [Record(b"k%d" % i, b"%d" % i * 20_000, i) for i in range(50)]   # ~1 MiB, compresses well
    size = records_section_size(records)
    buf = encode_batch(records, compression=codec)
    assert len(buf) * 20 < size
    assert ours(decode_batch(buf, max_decompressed_bytes=size)) == expected(records)
    error = raises_exactly(DecompressionLimitError, buf, limit=size - 1)
    assert f"max_decompressed_bytes={size - 1}" in str(error) and "pass a larger max_decompressed_bytes" in str(error)
    assert (f"to {size} bytes" if codec == "snappy" else f"to more than {size - 1} bytes") in str(error)
    assert list(iter_batches(buf + buf, max_decompressed_bytes=size)) == [decode_batch(buf)] * 2
    with pytest.raises(DecompressionLimitError):
        list(iter_batches(buf, max_decompressed_bytes=size - 1))
    with pytest.raises(InvalidArgumentError, match="max_decompressed_bytes"):
        decode_batch(buf, max_decompressed_bytes=0)


def test_a_kafka_java_zstd_frame_without_its_size_is_read():
    """Kafka's Java producer streams zstd (no content size in the frame), so the first output
    buffer is a guess that grows; cramjam's streaming compressor writes such frames too."""
    records = [Record(b"k%d" % i, b"abc%d" % i * 5_000, i) for i in range(40)]
    plain = encode_batch(records)
    compressor = cramjam.zstd.Compressor()
    compressor.compress(plain[HEADER.size:])
    buf = rebuild(plain, attributes=CODEC_IDS["zstd"], payload=bytes(compressor.finish()))
    assert ours(decode_batch(buf)) == expected(records) == kafka_read(buf)[0][1]


def bomb(codec: str, size: int) -> bytes:
    """A batch (CRC and all valid) whose payload decompresses to `size` zero bytes, made in
    16 MiB steps (never `size` bytes at once)."""
    step = bytes(16 << 20)
    if codec == "snappy":                                      # xerial: one 32 KiB block of zeros, repeated
        block = bytes(cramjam.snappy.compress_raw(step[:32 << 10]))
        payload = bytes(native_records._XERIAL_HEADER) + (struct.pack(">i", len(block)) + block) * (size >> 15)
    else:
        compressor = getattr(cramjam, codec).Compressor()
        for _ in range(size // len(step)):
            compressor.compress(step)
        payload = bytes(compressor.finish())
    return rebuild(small_batch(), attributes=CODEC_IDS[codec], payload=payload)


BOMB_CHILD = """
import resource, sys
from s3stream.errors import DecompressionLimitError
from s3stream import records
from s3stream.records import reference as records_reference
buf = open(sys.argv[1], "rb").read()
limit = int(sys.argv[2])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for module in (records, records_reference):
    try:
        module.decode_batch(buf, **({} if limit == 0 else dict(max_decompressed_bytes=limit)))
    except DecompressionLimitError as e:
        print(type(e).__name__, e)
    else:
        print("decoded")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.slow
@pytest.mark.parametrize("codec", CODECS[1:])
def test_decompression_bomb_is_refused_in_bounded_memory(codec, tmp_path):
    """1 GiB of zeros (256 MiB for snappy, whose xerial framing compresses less) in a payload of
    KiBs to MiBs: refused by both codecs, their peak memory rising by about the limit at most
    (measured in a child process: cramjam's own allocations are not Python's)."""
    size = (256 if codec == "snappy" else 1024) << 20
    path = tmp_path / "bomb"
    path.write_bytes(bomb(codec, size))
    for limit, budget in ((0, 64 << 20), (1 << 20, 0)):
        out = subprocess.run([sys.executable, "-c", BOMB_CHILD, str(path), str(limit)], capture_output=True,
                             text=True, timeout=120, check=True).stdout.splitlines()
        shown = limit or native_records.MAX_DECOMPRESSED_BYTES
        assert out[0] == out[1] and out[0].startswith("DecompressionLimitError"), out
        assert f"max_decompressed_bytes={shown}" in out[0]
        assert int(out[2]) < budget + (24 << 20), f"peak memory rose by {int(out[2]) >> 20} MiB"
