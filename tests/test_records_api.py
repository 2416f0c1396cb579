"""Issue 29, records: Stream.append_records and Partition.append_records append Kafka record
batches (one offset per record), FetchedBatch.records() reads them back with their offsets, from
the log cache and from objects, over both object stores; bad input leaves the stream intact."""
from __future__ import annotations

import pytest

from s3stream import (DecompressionLimitError, InvalidArgumentError, InvalidRecordBatchError, Record, RecordBatch,
                      StreamClient, UnsupportedMagicError)
from s3stream.records import decode_batch

from conftest import small_config


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
    p = client.open_partition("orders")
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
