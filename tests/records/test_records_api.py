"""Issue 29, records: Stream.append_records and Partition.append_records append Kafka record
batches (one offset per record), FetchedBatch.records() reads them back with their offsets, from
the log cache and from objects, over both object stores; bad input leaves the stream intact."""
from __future__ import annotations

import pytest

from s3stream import (DecompressionLimitError, InvalidArgumentError, InvalidRecordBatchError, Record, RecordBatch,
                      StreamClient, UnsupportedMagicError)
from s3stream.records import decode_batch

from conftest import small_config
from s3stream.cluster import open_partition


def records_of(stream, start: int, end: int) -> list:
    out, pos = [], start
    while pos < end:
        res = stream.fetch(pos, end)
        for batch in res.batches:
            out += list(batch.records())
        pos = res.end_offset
    return out


@pytest.fixture
def client(tmp_path, store_url):
    c = StreamClient(1, tmp_path / "node1.wal", store_url, f"sqlite:///{tmp_path}/meta.db",
                     small_config(reclaim_interval=None))
    yield c
    c.close()


@pytest.mark.parametrize("compression", [None, "gzip", "snappy", "lz4", "zstd"])
def test_records_read_back_with_their_offsets_from_cache_and_objects(client, compression):
    s = client.create_stream()
    s.append(RecordBatch(b"opaque", 3)).result(10)               # offsets 0-2: not records
    first = [Record(b"k%d" % i, b"v" * i, 1_700_000_000_000 + i, (("h", b"%d" % i),)) for i in range(5)]
    second = [Record(None, b"x" * 1000), Record(b"only-key", None, headers=[("n", None)])]
    a = s.append_records(first, compression=compression).result(10)
    b = s.append_records(iter(second), compression=compression).result(10)
    assert (a.base_offset, b.base_offset) == (3, 8) and s.next_offset == 10
    for phase in ("cache", "objects"):
        got = records_of(s, 3, 10)
        assert [r.offset for r in got] == list(range(3, 10)), phase
        assert [(r.key, r.value, r.headers) for r in got] == [(x.key, x.value, x.headers) for x in first + second]
        assert [r.timestamp for r in got[:5]] == [x.timestamp for x in first]
        client.force_upload(30)                                   # the second pass reads objects
    assert s.committed_offset == 10
    stored = bytes(s.fetch(3, 8).batches[0].payload)
    assert decode_batch(stored).compression == compression


def test_a_batch_appended_as_bytes_is_not_records(client):
    s = client.create_stream()
    s.append(RecordBatch(b"not a kafka batch at all, just bytes", 1)).result(10)
    with pytest.raises(InvalidRecordBatchError):
        list(s.fetch(0).batches[0].records())
    # a real record batch appended with another record count than it holds
    from s3stream.records import encode_batch
    s.append(RecordBatch(encode_batch([Record(b"a"), Record(b"b")]), 3)).result(10)
    with pytest.raises(InvalidRecordBatchError, match="appended as 3 records"):
        list(s.fetch(1).batches[0].records())
    bad = bytearray(encode_batch([Record(b"a")]))
    bad[16] = 1                                                   # magic 1
    s.append(RecordBatch(bytes(bad), 1)).result(10)
    with pytest.raises(UnsupportedMagicError):
        list(s.fetch(4).batches[0].records())


def _magic_1() -> bytes:
    """Bytes shaped as a record batch (its length fits) whose magic byte is 1."""
    from s3stream.records import encode_batch
    batch = bytearray(encode_batch([Record(b"a")] * 3))
    batch[16] = 1
    return bytes(batch)


@pytest.mark.parametrize("payload", [b"just bytes", b'{"order": 17, "items": ["a", "b", "c", "d"]}' * 3,
                                     bytes(80), _magic_1()], ids=["short", "json", "zeros", "magic 1"])
def test_records_of_bytes_say_they_are_bytes_not_a_cut_batch(client, payload):
    """Issue 50, item 9: records() of a payload appended as bytes said the batch was truncated
    (pass all of it); a stored payload is whole, so it says what is true: it is not a Kafka
    record batch, read its bytes. The Spark source's decoder (ColumnBuilder) says the same."""
    from _native.kafkarecords import ColumnBuilder
    from s3stream.records import MAX_DECOMPRESSED_BYTES, decompress_payload
    s = client.create_stream()
    s.append(RecordBatch(b"x", 1)).result(10)
    s.append(RecordBatch(payload, 3)).result(10)
    batch = s.fetch(1).batches[0]
    for read in (lambda: list(batch.records()),
                 lambda: ColumnBuilder(b"p").add(batch.payload, 1, 3, 0, 10, decompress_payload, MAX_DECOMPRESSED_BYTES)):
        with pytest.raises(InvalidRecordBatchError) as e:
            read()
        message = str(e.value)
        assert isinstance(e.value, UnsupportedMagicError) == (payload[16:17] == b"\x01")
        assert f"the batch at offset 1 ({len(payload)} bytes over 3 offsets) is not a Kafka record batch" in message
        assert "read its bytes (batch.payload)" in message and "truncated" not in message


def test_headers_given_as_a_mapping_are_its_items_in_order():
    """Issue 50, item 9: Kafka's headers are an ordered list that may repeat a key; a dict is
    taken as its items (as confluent-kafka takes one), and a malformed list names the form."""
    from s3stream.records import encode_batch
    as_dict = Record(value=b"v", timestamp=1, headers={"h": b"v", "g": None})
    assert as_dict.headers == (("h", b"v"), ("g", None))
    assert as_dict == Record(value=b"v", timestamp=1, headers=[("h", b"v"), ("g", None)])
    assert decode_batch(encode_batch([as_dict])).records[0].headers == (("h", b"v"), ("g", None))
    with pytest.raises(InvalidArgumentError, match=r'give them as pairs: headers=\[\("h", b"v"\)\]'):
        Record(headers=["h"])


@pytest.mark.parametrize("records, kwargs", [
    ([], {}),
    (["a str is not a record"], {}),
    ([Record(b"k")], {"compression": "brotli"}),
])
def test_bad_records_append_nothing(client, records, kwargs):
    s = client.create_stream()
    s.append_records([Record(b"k", b"v")]).result(10)
    with pytest.raises(InvalidArgumentError):
        s.append_records(records, **kwargs)
    assert s.next_offset == 1
    s.append_records([Record(b"k2", b"v2")]).result(10)
    assert [r.key for r in records_of(s, 0, 2)] == [b"k", b"k2"]


def test_record_rejects_values_that_are_not_bytes():
    with pytest.raises(InvalidArgumentError, match="encode"):
        Record(value="text")
    with pytest.raises(InvalidArgumentError):
        Record(headers=[(b"bytes-key", b"v")])
    with pytest.raises(InvalidArgumentError, match="UTF-8"):
        Record(headers=[("\udc80", b"v")])                   # a lone surrogate cannot be encoded


def test_partition_append_records(client):
    p = open_partition(client, "orders")
    r = p.append_records([Record(b"id-1", b"{}"), Record(b"id-2", b"{}")], compression="zstd").result(10)
    got = []
    for batch in p.fetch(r.base_offset).batches:
        got += list(batch.records())
    assert [(x.offset, x.key) for x in got] == [(r.base_offset, b"id-1"), (r.base_offset + 1, b"id-2")]


def test_records_past_the_decompressed_limit_are_refused_and_readable_with_a_larger_one(client):
    s = client.create_stream()
    records = [Record(b"k%d" % i, b"z" * 100_000) for i in range(20)]           # 2 MB, compresses to KiBs
    s.append_records(records, compression="zstd").result(10)
    batch = s.fetch(0).batches[0]
    with pytest.raises(DecompressionLimitError, match="max_decompressed_bytes=1048576"):
        list(batch.records(max_decompressed_bytes=1 << 20))
    assert [r.offset for r in batch.records(max_decompressed_bytes=4 << 20)] == list(range(20))
    assert len(list(batch.records())) == 20                                     # the default: 64 MiB


def kafka_python_batch(records, codec=None, producer=(-1, -1, -1), transactional=False) -> bytes:
    """A batch built by kafka-python (another Kafka client library)."""
    from test_records import kafka_build
    return kafka_build(records, codec, (*producer, transactional))


def test_batches_built_elsewhere_append_checked_and_bad_ones_append_nothing(client):
    """append_encoded: a kafka-python batch appends with one offset per record and reads back;
    wrong magic, a bad CRC, a truncated batch, an unknown codec and a transactional batch each
    get their error and leave the stream as it was."""
    from s3stream import RecordBatchChecksumError, RecordBatchLengthError, UnsupportedCompressionError
    stream = client.create_stream()
    records = [Record(key=b"k%d" % i, value=b"v" * i, timestamp=1_700_000_000_000 + i) for i in range(5)]
    good = kafka_python_batch(records, codec="zstd")
    assert stream.append_encoded(good).result(5).base_offset == 0
    assert stream.append_encoded(bytearray(good)).result(5).base_offset == 5
    end = stream.next_offset

    def with_byte(at, value):
        bad = bytearray(good)
        bad[at] = value
        return bytes(bad)
    crc_broken = bytearray(good)
    crc_broken[-1] ^= 0xFF
    codec_7 = bytearray(kafka_python_batch(records))
    codec_7[22] |= 0x07                                                 # attributes' codec bits: 7
    from _native.checksum import crc32c
    codec_7[17:21] = crc32c(bytes(codec_7[21:])).to_bytes(4, "big")      # a valid CRC over it
    for bad, error in ((with_byte(16, 1), UnsupportedMagicError), (bytes(crc_broken), RecordBatchChecksumError),
                       (good[:-3], RecordBatchLengthError), (bytes(codec_7), UnsupportedCompressionError),
                       (kafka_python_batch(records, producer=(3, 0, 0), transactional=True), InvalidRecordBatchError),
                       (b"", RecordBatchLengthError)):
        with pytest.raises(error):
            stream.append_encoded(bad)
        assert stream.next_offset == end
    got = records_of(stream, 0, end)
    assert [(r.offset, r.key, r.value, r.timestamp) for r in got] == [
        (i + 5 * k, r.key, r.value, r.timestamp) for k in range(2) for i, r in enumerate(records)]


def test_a_batch_from_an_idempotent_kafka_producer_is_taken_once(client):
    """Partition.append_encoded: a batch whose header names a producer id and sequence is taken
    idempotently (its retry answers the first offset); the next sequence continues."""
    from s3stream import OutOfOrderSequenceError
    p = open_partition(client, "orders")
    first = kafka_python_batch([Record(value=b"a"), Record(value=b"b")], producer=(42, 0, 0))
    assert p.append_encoded(first).result(5).base_offset == 0
    assert p.append_encoded(first).result(5).base_offset == 0
    with pytest.raises(OutOfOrderSequenceError):
        p.append_encoded(kafka_python_batch([Record(value=b"c")], producer=(42, 0, 5)))
    assert p.append_encoded(kafka_python_batch([Record(value=b"c")], producer=(42, 0, 2))).result(5).base_offset == 2
    assert p.log.next_offset == 3


# ---- stored Kafka batches carry their offsets (issue 50, item 10) --------------------------------

def kafka_python_offsets(payload) -> tuple[int, list[int]]:
    """(base offset, record offsets) of a stored payload as kafka-python parses it, CRC checked."""
    from test_records import kafka_read
    [(batch, records)] = kafka_read(payload)
    return batch.base_offset, [r[0] for r in records]


def test_stored_kafka_batches_carry_their_offsets_plain_payloads_their_bytes(tmp_path, store_url):
    """A Kafka batch appended (append_records, compressed or not, small or held-size; a batch
    built by kafka-python, whose header says another offset; a producer's batch) is stored with
    its base offset in its header, as a broker stores it: kafka-python reads the stream's offsets
    from the payload, its CRC intact, from the log cache, from objects and after a crash and
    recovery from the WAL. A payload appended as bytes stays byte for byte, a Kafka batch's too."""
    import os
    from s3stream import new_producer
    from s3stream.records import encode_batch
    from test_engine_model import crash
    config = small_config(reclaim_interval=None)
    client = StreamClient(1, tmp_path / "node1.wal", store_url, f"sqlite:///{tmp_path}/meta.db", config)
    as_bytes = encode_batch([Record(value=b"kept as bytes")] * 2)
    elsewhere = bytearray(kafka_python_batch([Record(value=b"e%d" % i, timestamp=1) for i in range(3)]))
    elsewhere[:8] = (12345).to_bytes(8, "big")                          # outside the CRC: still valid
    try:
        s = client.create_stream()
        p = open_partition(client, "p")
        producer = new_producer(client)
        s.append(RecordBatch(b"x", 1)).result(10)
        s.append_records([Record(value=b"a"), Record(value=b"b")]).result(10)
        s.append_records([Record(value=os.urandom(20_000))] * 2, compression="gzip").result(10)  # held-size
        s.append_records([Record(value=os.urandom(9_000))]).result(10)
        s.append_encoded(bytes(elsewhere)).result(10)
        s.append(RecordBatch(as_bytes, 2)).result(10)
        s.append(RecordBatch(b"plain bytes " * 1000, 4)).result(10)
        p.append(RecordBatch(b"plain", 1)).result(10)
        p.append(producer.batch("p", [Record(value=b"p%d" % i) for i in range(3)])).result(10)
        plain = {0: b"x", 9: as_bytes, 11: b"plain bytes " * 1000}
        kafka = {1: 2, 3: 2, 5: 1, 6: 3}

        def check(phase):
            batches = s.fetch(0, max_bytes=1 << 30).batches
            assert [b.base_offset for b in batches] == sorted([*plain, *kafka]), phase
            for b in batches:
                if b.base_offset in plain:
                    assert b.payload == plain[b.base_offset], phase
                    continue
                want = list(range(b.base_offset, b.base_offset + kafka[b.base_offset]))
                assert kafka_python_offsets(b.payload) == (b.base_offset, want), phase
                assert [r.offset for r in b.records()] == want, phase
            [produced] = p.fetch(1).batches
            assert kafka_python_offsets(produced.payload) == (1, [1, 2, 3]), phase

        check("log cache")
        client.force_upload(30)
        check("objects")
        s.append_records([Record(value=b"c")]).result(10)
        s.append(RecordBatch(b"y", 1)).result(10)
        plain[16], kafka[15] = b"y", 1
        crash(client)
        client = StreamClient(1, tmp_path / "node1.wal", store_url, f"sqlite:///{tmp_path}/meta.db", config)
        s = client.open_stream(s.stream_id)
        p = open_partition(client, "p")
        batches = s.fetch(15, max_bytes=1 << 30).batches
        assert kafka_python_offsets(batches[0].payload) == (15, [15]) and batches[1].payload == b"y"
        check("recovered")
    finally:
        client.close()


def test_a_copy_of_a_stored_batch_takes_the_offset_it_gets_there(client):
    """FetchedBatch.as_record_batch (the mirror's copy): a Kafka batch stored with its offset is
    appended as one, so its copy carries its new offset; bytes stay bytes, and so does a Kafka
    batch stored before offsets were written (header 0 at another offset)."""
    from s3stream.records import encode_batch
    source, target = client.create_stream(), client.create_stream()
    as_bytes = encode_batch([Record(value=b"old")] * 2)
    source.append(RecordBatch(b"x", 1)).result(10)
    source.append_records([Record(value=b"a"), Record(value=b"b")]).result(10)
    source.append(RecordBatch(as_bytes, 2)).result(10)
    target.append(RecordBatch(b"pad", 1)).result(10)
    copies = [b.as_record_batch() for b in source.fetch(0).batches]
    assert [c.kafka for c in copies] == [False, True, False]
    for c in copies:
        target.append(c).result(10)
    x, kafka, old = target.fetch(1).batches
    assert (x.payload, old.payload) == (b"x", as_bytes)
    assert kafka_python_offsets(kafka.payload) == (2, [2, 3])
    assert [r.offset for r in old.records()] == [4, 5]                 # shifted from its header's 0


def test_a_kafka_batch_is_said_so_and_kept_so():
    """RecordBatch(kafka=True) refuses what is no Kafka batch; the flag is part of the batch's
    identity and survives pickling (a kept batch appends as the original would)."""
    import pickle
    from s3stream import InvalidBatchError
    from s3stream.batches import records_batch
    batch = records_batch([Record(value=b"v")])
    assert batch.kafka and "kafka=True" in repr(batch)
    assert pickle.loads(pickle.dumps(batch)) == batch and pickle.loads(pickle.dumps(batch)).kafka
    assert RecordBatch(batch.payload, batch.count) != batch
    for payload, why in ((b"short", "too short"), (b"\x00" * 16 + b"\x01" + bytes(60), "magic byte 1")):
        with pytest.raises(InvalidBatchError, match=f"kafka=True says .*{why}.*kafka=False"):
            RecordBatch(payload, 1, True)


def test_batches_written_around_the_append_path_take_their_offset():
    """For writers of objects (the Spark sink): with_base_offset sets a batch's offset, its CRC
    still valid; encode_gap takes one too."""
    from s3stream.records import encode_batch, encode_gap, with_base_offset
    moved = with_base_offset(encode_batch([Record(value=b"v", timestamp=1)] * 3), 1000)
    assert kafka_python_offsets(moved) == (1000, [1000, 1001, 1002])
    gap = decode_batch(encode_gap(5, base_offset=70))
    assert (gap.base_offset, gap.last_offset, gap.records) == (70, 74, [])
    with pytest.raises(InvalidArgumentError, match="at least 61 bytes"):
        with_base_offset(b"short", 1)
