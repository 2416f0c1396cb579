"""s3stream.records (the native codec, _native/kafkarecords.pyx) against its pure-Python twin,
s3stream.records.reference: byte-identical batches from the same arguments, equal decodes, and
for every kind of bad batch the same exception with the same message. Then the records
benchmark, end to end."""
from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from s3stream import records as native
from s3stream.records import reference
from s3stream.errors import DecompressionLimitError, InvalidArgumentError, RecordBatchLengthError, UnsupportedMagicError
from s3stream.records import Record

from test_records import CODECS, HEADER, rebuild, small_batch

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_INT64 = (1 << 63) - 1

binaries = st.binary(max_size=40) | st.binary(min_size=100, max_size=1500).map(lambda b: b[:16] * 60)
headers = st.lists(st.tuples(st.text(max_size=6), st.none() | st.binary(max_size=12)), max_size=3)
timestamps = st.none() | st.integers(0, MAX_INT64) | st.integers(1_600_000_000_000, 1_800_000_000_000)
records_st = st.lists(st.builds(Record, key=st.none() | binaries, value=st.none() | binaries, timestamp=timestamps,
                                headers=headers), min_size=1, max_size=8)
producers = st.tuples(st.integers(-1, MAX_INT64), st.integers(-1, (1 << 15) - 1), st.integers(-1, (1 << 31) - 1),
                      st.booleans())


def outcome(call, *args, **kwargs):
    """What call returns, or (type, message) of what it raises."""
    try:
        return call(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - compared, not swallowed
        return type(e), str(e)


def same_decode(buf: bytes, **limit):
    """decode_batch and iter_batches (strict, and skipping a partial tail) of both codecs over
    buf: equal results or equal errors."""
    result = outcome(native.decode_batch, buf, **limit)
    assert result == outcome(reference.decode_batch, buf, **limit)
    for skip in (False, True):
        assert outcome(lambda: list(native.iter_batches(buf, skip_partial_tail=skip, **limit))) \
            == outcome(lambda: list(reference.iter_batches(buf, skip_partial_tail=skip, **limit)))
    return result


def raises_alike(buf: bytes) -> type:
    result = same_decode(buf)
    assert isinstance(result, tuple), "the batch decoded"
    return result[0]


@pytest.mark.parametrize("codec", CODECS)
@SETTINGS
@given(records=records_st, producer=producers, base_offset=st.integers(0, 1 << 62), log_append_time=st.booleans(),
       leader_epoch=st.integers(-1, (1 << 31) - 1), now_ms=st.integers(0, MAX_INT64))
def test_same_bytes_and_same_decode(codec, records, producer, base_offset, log_append_time, leader_epoch, now_ms):
    producer_id, producer_epoch, base_sequence, transactional = producer
    args = dict(base_offset=base_offset, compression=codec, producer_id=producer_id, producer_epoch=producer_epoch,
                base_sequence=base_sequence, is_transactional=transactional, timestamp_type=int(log_append_time),
                partition_leader_epoch=leader_epoch, now_ms=now_ms)
    buf = outcome(native.encode_batch, records, **args)
    assert buf == outcome(reference.encode_batch, records, **args)
    if isinstance(buf, tuple):                       # a transactional batch without a producer id
        assert buf[0] is InvalidArgumentError and transactional and producer_id == -1
        return
    decoded = same_decode(buf)
    assert [(r.key, r.value, r.headers) for r in decoded.records] == [(r.key, r.value, r.headers) for r in records]
    same_decode(buf[:-1])                            # truncated, alone or after a whole one
    same_decode(buf + buf[:-1])


@SETTINGS
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6), codecs=st.lists(st.sampled_from(CODECS), min_size=6,
                                                                                    max_size=6))
def test_iter_batches_alike(sizes, codecs):
    parts, offset = [], 0
    for i, (size, codec) in enumerate(zip(sizes, codecs)):
        parts.append(native.encode_batch([Record(b"%d" % i, b"v" * j, j) for j in range(size)], compression=codec,
                                         base_offset=offset))
        offset += size
    buf = b"".join(parts)
    assert list(native.iter_batches(buf)) == list(reference.iter_batches(buf))


@pytest.mark.parametrize("make", [
    lambda m: m.encode_batch([]),
    lambda m: m.encode_batch([Record(b"k")], compression="brotli"),
    lambda m: m.encode_batch([Record(b"k"), (b"k", b"v")]),
    lambda m: m.encode_batch(iter([Record(b"k"), "not a record"])),
    lambda m: m.encode_batch([Record(b"k")], producer_epoch=1 << 15),
    lambda m: m.encode_batch([Record(b"k"), Record(b"l")], base_offset=MAX_INT64),
    lambda m: m.encode_batch([Record(b"k")], is_transactional=True),
    lambda m: m.encode_batch([Record(b"k")], now_ms=-1),
    lambda m: m.decode_batch("a str"),
])
def test_bad_arguments_alike(make):
    result = outcome(make, native)
    assert result == outcome(make, reference)
    assert isinstance(result, tuple) and issubclass(result[0], InvalidArgumentError)


def test_records_whose_fields_were_forced_raise_type_error():
    """A Record's fields are checked when it is made; one changed behind its back (it is frozen)
    must raise, not be read as something else."""
    for field, value in [("key", "str"), ("value", 5), ("headers", [("h", b"v")]), ("headers", (("h", "v"),)),
                         ("headers", ((b"h", b"v"),)), ("headers", (("h",),)), ("timestamp", 1.5)]:
        record = Record(b"k", b"v", 1)
        object.__setattr__(record, field, value)
        with pytest.raises(TypeError):
            native.encode_batch([record])
    unset = Record.__new__(Record)                   # no field set at all
    assert outcome(native.encode_batch, [unset])[0] is AttributeError
    assert outcome(native.encode_batch, [unset]) == outcome(reference.encode_batch, [unset])


def test_record_subclasses_are_read_through_their_attributes():
    class Traced(Record):
        @property
        def value(self):
            return b"from the property"

        @value.setter
        def value(self, value):
            pass

    record = Traced(b"k", b"stored", 7)
    buf = native.encode_batch([record], now_ms=1)
    assert buf == reference.encode_batch([record], now_ms=1)
    assert native.decode_batch(buf).records[0].value == b"from the property"


# ---- bad batches: the same error, with the same message, from both ----------------------------

@pytest.mark.parametrize("magic", [m for m in range(256) if m != 2])
def test_wrong_magic(magic):
    buf = bytearray(small_batch())
    buf[16] = magic
    assert raises_alike(bytes(buf)) is UnsupportedMagicError


@pytest.mark.parametrize("codec", CODECS)
def test_every_flipped_byte(codec):
    good = small_batch(codec)
    for position in range(len(good)):
        for flip in (0x01, 0x04, 0x80, 0xFF):
            buf = bytearray(good)
            buf[position] ^= flip
            same_decode(bytes(buf))


@pytest.mark.parametrize("codec", CODECS)
def test_every_truncation(codec):
    good = small_batch(codec)
    for cut in range(len(good)):
        assert raises_alike(good[:cut]) is RecordBatchLengthError
        assert raises_alike(good + good[:cut] if cut else good + b"\0") is RecordBatchLengthError
        tolerated = native.iter_batches(good + good[:cut] if cut else good + b"\0", skip_partial_tail=True)
        assert list(tolerated) == [native.decode_batch(good)]


@pytest.mark.parametrize("codec", CODECS[1:])
def test_decompressed_size_limit_alike(codec):
    records = [Record(b"k%d" % i, b"%d" % i * 3_000, i) for i in range(30)]
    size = len(native.encode_batch(records)) - HEADER.size
    buf = native.encode_batch(records, compression=codec)
    for limit in (1, 100, size // 3, size - 1, size, size + 1):
        result = same_decode(buf, max_decompressed_bytes=limit)
        assert (result[0] is DecompressionLimitError if limit < size else len(result.records) == 30), result
    assert same_decode(buf, max_decompressed_bytes=True)[0] is InvalidArgumentError
    same_decode(buf + buf[:40], max_decompressed_bytes=size - 1)     # the iterations raise it, alike
    assert outcome(lambda: list(native.iter_batches(buf + buf[:40], skip_partial_tail=True,
                                                    max_decompressed_bytes=size - 1)))[0] is DecompressionLimitError


@pytest.mark.parametrize("batch_length", [*range(-2, 70), 1 << 20, (1 << 31) - 1, -(1 << 31)])
def test_batch_lengths(batch_length):
    buf = bytearray(small_batch())
    struct.pack_into(">i", buf, 8, batch_length)
    same_decode(bytes(buf))


@pytest.mark.parametrize("codec_id", range(8))
def test_codec_ids(codec_id):
    same_decode(rebuild(small_batch(), attributes=codec_id | 0x08))
    same_decode(rebuild(small_batch(), attributes=codec_id | -0x8000))    # attributes' sign bit set


@pytest.mark.parametrize("count", [-(1 << 31), -1, 0, 1, 2, 3, 1 << 20, (1 << 31) - 1])
@pytest.mark.parametrize("codec", [None, "gzip"])
def test_record_counts(count, codec):
    same_decode(rebuild(small_batch(codec), count=count))


def section(*records: bytes) -> bytes:
    """A records section of records given by their body (after the length varint, < 64 bytes)."""
    return b"".join(bytes([len(body) * 2]) + body for body in records)


def zigzag(value: int) -> bytes:
    z = value << 1 if value >= 0 else (-value << 1) - 1
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    return bytes(out) + bytes([z])


OK_TAIL = zigzag(-1) + zigzag(1) + b"v" + zigzag(0)          # null key, value b"v", no headers


@pytest.mark.parametrize("payload, count", [
    (b"\xff" * 12, 1),                                              # a varint longer than 5 bytes
    (section(b"\x00" + b"\xff" * 9 + b"\x01" + zigzag(0) + OK_TAIL), 1),   # 10-byte varlong, 64 bits: read
    (section(b"\x00" + b"\xff" * 9 + b"\x02" + zigzag(0) + OK_TAIL), 1),   # 65 bits
    (section(b"\x00" + b"\xff" * 10 + zigzag(0) + OK_TAIL), 1),     # 11 bytes
    (section(b"\x00" + zigzag(0) + b"\xff\xff\xff\xff\x0f" + OK_TAIL), 1),  # 5-byte varint, 32 bits: read
    (section(b"\x00" + zigzag(0) + b"\xff\xff\xff\xff\x1f" + OK_TAIL), 1),  # 33 bits
    (section(b"\x00" + zigzag(0) + zigzag(0) + zigzag(-2) + zigzag(1) + b"v" + zigzag(0)), 1),  # key length -2
    (section(b"\x00" + zigzag(0) + zigzag(0) + zigzag(9) + zigzag(1) + b"v" + zigzag(0)), 1),  # key past the end
    (section(b"\x00" + zigzag(0) + zigzag(0) + OK_TAIL[:-1] + zigzag(-1)), 1),         # -1 headers
    (section(b"\x00" + zigzag(0) + zigzag(0) + OK_TAIL[:-1] + zigzag(40)), 1),         # more headers than bytes
    (section(b"\x00" + zigzag(0) + zigzag(0) + OK_TAIL[:-1] + zigzag(1) + zigzag(2) + b"\xff\xfe" + zigzag(-1)), 1),
    (section(b"\x00" + zigzag(0) + zigzag(0) + OK_TAIL[:-1] + zigzag(1) + zigzag(2) + b"ok" + zigzag(-1)), 1),
    (section(b"\x00" + zigzag(0) + zigzag(0) + OK_TAIL[:-1] + zigzag(1) + zigzag(2) + b"ok" + zigzag(-3)), 1),
    (section(b"\x00" + zigzag(0) + zigzag(0) + OK_TAIL + b"\x00"), 1),  # a byte more than its fields
    (section(b"\x00" + zigzag(0) + zigzag(0) + OK_TAIL[:-2]), 1),        # ends inside its fields
    (section(b""), 1),                                              # an empty record
    (section(b"\x00" + zigzag(0) + zigzag(0) + OK_TAIL) + b"\x00", 1),   # a byte after the records
    (section(*[b"\x00" + zigzag(0) + zigzag(i) + OK_TAIL for i in range(2)]), 3),  # fewer records than counted
    (zigzag(-5) + b"\x00" * 8, 1),                                  # a negative record length
    (zigzag(100) + b"\x00" * 8, 1),                                 # a record past the section
])
@pytest.mark.parametrize("codec", [None, "lz4"])
def test_bad_varints_and_lengths(payload, count, codec):
    if codec:
        payload = native.compress_payload(native.COMPRESSION_CODECS.index(codec), payload)
    same_decode(rebuild(small_batch(codec), payload=payload, count=count))


@pytest.mark.parametrize("base_offset, base_timestamp, deltas", [
    (MAX_INT64, 0, (0, 1, 5)),                        # offsets past int64: Python ints, as the twin's
    (-(1 << 63), 0, (0, -1)),
    (0, MAX_INT64, (0, MAX_INT64)),                   # timestamps past int64
    (0, -(1 << 63), (0, -MAX_INT64)),
])
def test_sums_past_int64(base_offset, base_timestamp, deltas):
    payload = section(*[b"\x00" + zigzag(d) + zigzag(d if abs(d) < 1 << 31 else i) + OK_TAIL
                        for i, d in enumerate(deltas)])
    good = small_batch()
    fields = list(HEADER.unpack_from(good))
    fields[0], fields[7] = base_offset, base_timestamp
    buf = rebuild(HEADER.pack(*fields) + good[HEADER.size:], payload=payload, count=len(deltas))
    decoded = same_decode(buf)
    assert not isinstance(decoded, tuple), decoded
    assert decoded.records[-1].offset > MAX_INT64 or decoded.records[-1].offset < -(1 << 63) \
        or decoded.records[-1].timestamp > MAX_INT64 or decoded.records[-1].timestamp < -(1 << 63)


@pytest.mark.parametrize("codec", [None, "snappy"])
@settings(max_examples=100, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4),
       cut=st.integers(0, 8), extra=st.binary(max_size=3), count=st.integers(-1, 4))
def test_mangled_sections_alike(codec, edits, cut, extra, count):
    """Any records section behind a valid CRC: the same records or the same error."""
    good = native.encode_batch([Record(b"k", b"v" * 30, 1, [("h", b"x")]), Record(None, None, 2, [("é", None)])],
                               base_offset=7, timestamp_type=count % 2)
    payload = bytearray(good[HEADER.size:])
    for position, value in edits:
        payload[position % len(payload)] = value
    payload = bytes(payload[:len(payload) - cut]) + extra
    if codec:
        payload = native.compress_payload(native.COMPRESSION_CODECS.index(codec), payload)
    same_decode(rebuild(good, payload=payload, count=count))


@settings(max_examples=100, deadline=None)
@given(payload=st.binary(max_size=60), count=st.integers(0, 3))
def test_random_sections_alike(payload, count):
    same_decode(rebuild(small_batch(), payload=payload, count=count))


# ---- the benchmark ----------------------------------------------------------------------------

def test_bench_records_quick(tmp_path):
    from benchmarks.records import run
    report = run(["--quick", "--out", str(tmp_path), "--workdir", str(tmp_path), "--append-round", "2M",
                  "--seconds", "0.01"])
    assert (tmp_path / "report.json").exists()
    assert report["implementations"][:2] == ["native", "reference"]
    assert [(c["value_size"], c["compression"]) for c in report["cases"]] == [
        (100, None), (100, "zstd"), (1024, None), (1024, "zstd")]
    for case in report["cases"]:
        for name in report["implementations"]:
            assert set(case["impls"][name]) == {"encode_records_s", "decode_records_s", "encode_mb_s", "decode_mb_s"}
            assert all(v > 0 for v in case["impls"][name].values())
        others = report["implementations"][1:]
        assert set(case["ratios"]) == {f"{op}_native_{n}" for op in ("encode", "decode") for n in others}
        assert all(isinstance(r, float) and r > 0 for r in case["ratios"].values())
    assert [a["value_size"] for a in report["append"]] == [100, 1024]
    for a in report["append"]:
        assert a["append_records_records_s"] > 0 and a["append_records_s"] > 0
        assert isinstance(a["ratio"], float) and a["ratio"] > 0 and a["target_ratio"] == 0.9
    assert [a["value_size"] for a in report["idempotent"]] == [100, 1024]
    for a in report["idempotent"]:
        assert a["idempotent_records_s"] > 0 and a["plain_records_s"] > 0 and a["target_ratio"] == 0.95
    assert report["targets"] == {"append_records_over_append": 0.9, "idempotent_over_plain": 0.95}


def test_batches_larger_and_smaller_than_the_last_alike():
    """The encoder writes into a buffer sized by the last batch and grows it: any order of sizes
    gives the twin's bytes."""
    for size in (1, 3 << 20, 10, 200_000, 1, 70_000):
        records = [Record(b"k%d" % i, bytes([i % 251]) * (size // 7 + i), i) for i in range(7)]
        for codec in (None, "lz4"):
            assert native.encode_batch(records, compression=codec) == reference.encode_batch(records, compression=codec)


def test_records_list_read_in_place_or_copied_alike():
    """A list of Records is read in place; with a subclass among them (whose attributes run
    Python code, which may change the list) it is copied first. Same bytes either way."""
    emptied: list[list] = []

    class Changing(Record):
        @property
        def value(self):
            for records in emptied:                  # the caller's list, emptied mid-encode
                records.clear()
            return b"changed"

        @value.setter
        def value(self, value):
            pass

    plain = [Record(b"k%d" % i, b"v", i) for i in range(5)]
    assert native.encode_batch(plain, now_ms=1) == native.encode_batch(tuple(plain), now_ms=1) \
        == reference.encode_batch(plain, now_ms=1)
    shared = plain[:2] + [Changing(b"c", b"ignored", 9)] + plain[2:]
    want = reference.encode_batch(list(shared), now_ms=1)
    emptied.append(shared)
    assert native.encode_batch(shared, now_ms=1) == want and shared == []


def test_encode_records_is_encode_batch_with_defaults(monkeypatch):
    records = [Record(b"k", b"v", 5), Record(None, b"w"), Record(b"x", None, 7, [("h", b"1")])]
    monkeypatch.setattr(native.time, "time", lambda: 1_700_000_000.5)
    for codec in native.COMPRESSION_CODECS:
        assert native.encode_records(iter(records), codec) == (
            native.encode_batch(records, compression=codec, now_ms=1_700_000_000_500), 3)
    for bad in ([], [Record(b"k"), "not a record"]):
        assert outcome(native.encode_records, bad) == outcome(native.encode_batch, bad)
    assert outcome(native.encode_records, records, "brotli") == outcome(native.encode_batch, records,
                                                                         compression="brotli")


@pytest.mark.parametrize("container", [list, tuple])
def test_a_later_record_of_the_wrong_type_is_reported_first_alike(container):
    """Both check every record's type and timestamp before they encode one, even though the
    native codec encodes each record as soon as it has checked it."""
    forced = Record(b"k", b"v", 1)
    object.__setattr__(forced, "headers", "not a tuple")
    records = container([forced, Record(b"y"), "not a record"])
    result = outcome(native.encode_batch, records)
    assert result == outcome(reference.encode_batch, records) and result[0] is InvalidArgumentError
    negative = Record(b"x", None, 5)
    object.__setattr__(negative, "timestamp", -3)    # the twin does not look at timestamps until it packs
    assert outcome(native.encode_batch, container([forced, negative]))[0] is InvalidArgumentError
    assert outcome(native.encode_batch, container([forced, Record(b"y")]))[0] is TypeError
