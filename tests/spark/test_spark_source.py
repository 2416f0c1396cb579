"""The Spark source (pyspark_s3stream.source): its columnar decoder against records.decode_batch,
its options, batch reads (offsets, patterns, pushed filters, minPartitions) and streaming reads
(Trigger.AvailableNow, restart from the checkpoint, maxOffsetsPerTrigger, failOnDataLoss, a task
that fails once), each against what a node appended.

One local[2, 2] session for the module (a task may fail once and run again); one node appends
for every test, each test to partitions of its own."""
from __future__ import annotations

import json
import os
import pickle
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

import s3stream  # noqa: E402
from s3stream.errors import ConfigError, InvalidRecordBatchError, S3StreamError  # noqa: E402
from s3stream.records import MAX_DECOMPRESSED_BYTES, Record, decompress_payload, encode_batch, encode_gap  # noqa: E402
from s3stream.batches import FetchedBatch  # noqa: E402

from pyspark.sql.datasource import DataSourceReader, EqualTo, GreaterThanOrEqual, In, LessThan  # noqa: E402

from _native.kafkarecords import ColumnBuilder  # noqa: E402
from pyspark_s3stream.source import (BatchReader, FilteringBatchReader, OffsetRange, SourceOptions, _limit_offsets,  # noqa: E402
                                     arrow_batch, arrow_schema, batch_reader, split_ranges)

from conftest import small_config  # noqa: E402
from s3stream.records import COMPRESSION_CODECS, compress_payload  # noqa: E402
from test_records import HEADER, rebuild  # noqa: E402
from s3stream.cluster import open_partition, read_partition

pytestmark = pytest.mark.slow    # the whole module: soaks, campaigns, fault runs or Spark (README: quick tier)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CODECS = [None, "gzip", "snappy", "lz4", "zstd"]
MAX_MS = ((1 << 63) - 1) // 1000                  # the largest ms timestamp a µs timestamp holds

# ---- the columnar decoder against decode_batch ------------------------------------------------

binaries = st.binary(max_size=40) | st.binary(min_size=100, max_size=1200).map(lambda b: b[:16] * 50)
headers_st = st.lists(st.tuples(st.text(max_size=6), st.none() | st.binary(max_size=12)), max_size=3)
records_st = st.lists(st.builds(Record, key=st.none() | binaries, value=st.none() | binaries,
                                timestamp=st.integers(0, MAX_MS), headers=headers_st), min_size=1, max_size=8)


def expected_rows(batch: FetchedBatch, low: int, high: int, name: str = "p") -> list[dict]:
    """The rows the source must give for `batch`'s records in [low, high), by decode_batch."""
    from s3stream.records import decode_batch
    decoded = decode_batch(batch.payload)
    return [{"key": r.key, "value": r.value, "partition": name, "offset": r.offset, "timestamp": r.timestamp * 1000,
             "timestampType": decoded.timestamp_type,
             "headers": [{"key": k, "value": v} for k, v in r.headers]}
            for r in batch.records() if low <= r.offset < high]


def columnar_rows(batches: list[FetchedBatch], low: int, high: int, name: str = "p") -> list[dict]:
    builder = ColumnBuilder(name.encode())
    for b in batches:
        builder.add(b.payload, b.base_offset, b.count, low, high, decompress_payload, MAX_DECOMPRESSED_BYTES)
    out = arrow_batch(builder.finish(), arrow_schema())
    out.validate(full=True)
    micros = out.column("timestamp").cast(pa.int64()).to_pylist()
    return [dict(row, timestamp=t) for row, t in zip(out.drop_columns(["timestamp"]).to_pylist(), micros)]


@SETTINGS
@given(batches=st.lists(st.tuples(records_st, st.sampled_from(CODECS), st.booleans()), min_size=1, max_size=4),
       gap=st.integers(0, 3), cut=st.tuples(st.integers(0, 40), st.integers(0, 40)))
def test_columns_are_what_decode_batch_reads(batches, gap, cut):
    """Keys, values (nulls too), offsets, timestamps (both types), headers, any codec, a gap (no
    records over its offsets), a range cut inside batches: the same rows as decode_batch's."""
    fetched, base = [], 1000
    for records, codec, log_append in batches:
        raw = encode_batch(records, compression=codec, timestamp_type=int(log_append), now_ms=1_700_000_000_000)
        fetched.append(FetchedBatch(base, len(records), memoryview(raw)))
        base += len(records)
        if gap:
            fetched.append(FetchedBatch(base, gap, memoryview(encode_gap(gap))))
            base += gap
    low, high = 1000 + cut[0], base - cut[1]
    want = [row for b in fetched for row in expected_rows(b, low, high)]
    assert columnar_rows(fetched, low, high) == want


@SETTINGS
@given(edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4),
       cut=st.integers(0, 8), codec=st.sampled_from([None, "snappy"]))
def test_mangled_batches_fail_as_decode_batch_fails(edits, cut, codec):
    """A records section changed behind a valid CRC: the same error (type and message) as the
    record decoder, or the same rows; a batch that fails leaves the builder as it was."""
    good = encode_batch([Record(b"k", b"v" * 30, 1, [("h", b"x")]), Record(None, None, 2, [("é", None)])])
    payload = bytearray(good[HEADER.size:])
    for position, value in edits:
        payload[position % len(payload)] = value
    payload = bytes(payload[:len(payload) - cut])
    if codec:
        payload = compress_payload(COMPRESSION_CODECS.index(codec), payload)
    bad = FetchedBatch(7, 2, memoryview(rebuild(good, payload=payload)))
    try:
        want = expected_rows(bad, 0, 1 << 62)
    except InvalidRecordBatchError as e:
        want = (type(e), str(e))
    builder = ColumnBuilder(b"p")
    first = FetchedBatch(5, 2, memoryview(good))
    builder.add(first.payload, 5, 2, 0, 1 << 62, decompress_payload, MAX_DECOMPRESSED_BYTES)
    try:
        builder.add(bad.payload, 7, 2, 0, 1 << 62, decompress_payload, MAX_DECOMPRESSED_BYTES)
    except InvalidRecordBatchError as e:
        assert want == (type(e), str(e))
        got = arrow_batch(builder.finish(), arrow_schema())
        got.validate(full=True)
        assert got.column("offset").to_pylist() == [5, 6]            # the good batch, as it was
    else:
        if isinstance(want, tuple) and not isinstance(want, list):
            pytest.fail(f"decode_batch raised {want}, the columnar decoder did not")
        assert len(want) == builder.rows - 2


def test_freed_batches_memory_is_reused_and_held_batches_stay_intact():
    """A builder's next batches take the memory of batches Arrow has freed (column_pool) and
    are sized like the last one; a batch still held is never written over, and every batch
    reads back exactly what was added, nulls included."""
    import gc
    from _native.kafkarecords import column_pool
    schema = arrow_schema()
    builder = ColumnBuilder(b"p")

    def batch(seed: int) -> tuple[pa.RecordBatch, list]:
        records = [Record(key=None if i % 7 == 0 else b"k%d-%d" % (seed, i), value=bytes([seed % 256]) * 900 + b"%d" % i,
                          timestamp=seed * 1000 + i) for i in range(300)]
        for j in range(0, 300, 100):
            builder.add(encode_batch(records[j:j + 100]), seed * 1000 + j, 100, 0, 1 << 62, decompress_payload,
                        MAX_DECOMPRESSED_BYTES)
        return arrow_batch(builder.finish(), schema), records

    held, held_records = batch(1)                   # kept for the whole test
    gc.collect()
    for seed in range(2, 8):
        out, records = batch(seed)
        assert out.column("value").to_pylist() == [r.value for r in records]
        assert out.column("key").to_pylist() == [r.key for r in records]
        assert out.column("offset").to_pylist() == list(range(seed * 1000, seed * 1000 + 300))
        pooled = column_pool()[1]
        del out
        gc.collect()
        assert column_pool()[1] > pooled            # the freed batch's value column went back
        assert held.column("value").to_pylist() == [r.value for r in held_records]
        assert held.column("key").to_pylist() == [r.key for r in held_records]


def test_check_crc_false_skips_only_the_batch_crc():
    """add(check_crc=False), as the source calls it for batches read from objects (their block
    checksum covered the bytes): a wrong CRC field passes, every other check still holds."""
    raw = bytearray(encode_batch([Record(b"k", b"v" * 50, 1_700_000_000_000)]))
    raw[17] ^= 0xFF                                 # the CRC field (bytes 17-20)
    with pytest.raises(InvalidRecordBatchError, match="CRC"):
        ColumnBuilder(b"p").add(bytes(raw), 0, 1, 0, 10, decompress_payload, MAX_DECOMPRESSED_BYTES)
    builder = ColumnBuilder(b"p")
    assert builder.add(bytes(raw), 0, 1, 0, 10, decompress_payload, MAX_DECOMPRESSED_BYTES, False) == 1
    assert arrow_batch(builder.finish(), arrow_schema()).column("value").to_pylist() == [b"v" * 50]
    raw[16] = 1                                     # the magic byte: still refused
    with pytest.raises(InvalidRecordBatchError, match="magic"):
        ColumnBuilder(b"p").add(bytes(raw), 0, 1, 0, 10, decompress_payload, MAX_DECOMPRESSED_BYTES, False)


def test_a_damaged_object_fails_the_read_naming_it(tmp_path):
    """The source checks each batch's bytes once, through the object's block checksum: a byte
    flipped in a stored object fails read_range with CorruptDataError, never a wrong row."""
    from pyspark_s3stream.source import read_range
    meta, store = f"sqlite:///{tmp_path}/meta.db", f"file://{tmp_path}/store"
    node = s3stream.StreamClient(1, str(tmp_path / "node.wal"), store, meta, small_config(reclaim_interval=None))
    try:
        append(node, "z-0", 100)
    finally:
        node.close()
    with s3stream.open_reader(meta, store) as one:
        stream_id = read_partition(one, "z-0").log_stream_id
    options = SourceOptions.parse({"metadata": meta, "object_store": store, "subscribe": "z-0"}, streaming=False)
    part = OffsetRange("z-0", stream_id, 0, 100)
    with s3stream.open_reader(meta, store) as reader:
        good = list(read_range(options, part, arrow_schema(), reader))
    assert sum(b.num_rows for b in good) == 100
    objects = [p for p in (tmp_path / "store").rglob("*") if p.is_file() and ".s3stream-tmp." not in str(p)]
    assert objects
    for path in objects:                            # a payload byte of every block's first batch
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0x40
        path.write_bytes(bytes(data))
    with s3stream.open_reader(meta, store) as reader:
        with pytest.raises(s3stream.CorruptDataError):
            list(read_range(options, part, arrow_schema(), reader))


def test_a_batch_of_another_count_or_an_out_of_range_timestamp_is_refused():
    raw = encode_batch([Record(b"k", b"v", 1), Record(b"k", b"v", 2)])
    builder = ColumnBuilder(b"p")
    with pytest.raises(InvalidRecordBatchError, match="appended as 3 records"):
        builder.add(raw, 0, 3, 0, 10, decompress_payload, MAX_DECOMPRESSED_BYTES)
    with pytest.raises(InvalidRecordBatchError, match="out of a timestamp's range"):
        builder.add(encode_batch([Record(b"k", b"v", MAX_MS + 1)]), 0, 1, 0, 10, decompress_payload,
                    MAX_DECOMPRESSED_BYTES)
    assert builder.rows == 0


# ---- planning, without Spark ------------------------------------------------------------------

BASE = {"metadata": "sqlite:///m.db", "object_store": "file:///s"}


@pytest.mark.parametrize("options, words", [
    ({}, ["exactly one of", "subscribe"]),
    ({"subscribe": "a", "assign": '["a"]'}, ["exactly one of", "assign"]),
    ({"subscribe": "a", "startingOffsets": "lastest"}, ["startingOffsets", "lastest"]),
    ({"subscribe": "a", "startingOffsets": "latest"}, ["startingOffsets", "batch"]),
    ({"subscribe": "a", "endingOffsets": "earliest"}, ["endingOffsets", "earliest"]),
    ({"subscribe": "a", "startingOffsets": '{"b": 3}'}, ["startingOffsets", "'b'"]),
    ({"subscribe": "a", "startingOffsets": '{"a": -7}'}, ["startingOffsets", "-7"]),
    ({"subscribePattern": "(", }, ["subscribePattern", "regular expression"]),
    ({"assign": "a,b"}, ["assign", "JSON"]),
    ({"subscribe": "a", "minPartitions": "0"}, ["minPartitions", "'0'"]),
    ({"subscribe": "a", "failOnDataLoss": "maybe"}, ["failOnDataLoss", "maybe"]),
    ({"subscribe": "a", "maxOffsetsPerTrigger": "10"}, ["maxOffsetsPerTrigger", "streaming"]),
    ({"subscribe": "a", "maxBytesPerTrigger": "1m"}, ["maxBytesPerTrigger", "maxOffsetsPerTrigger"]),
    ({"subscribe": "a", "startingOffset": "earliest"}, ["startingOffset", "did you mean startingOffsets"]),
])
def test_bad_options_name_the_option(options, words):
    with pytest.raises(ConfigError) as caught:
        SourceOptions.parse({k.lower(): v for k, v in {**BASE, **options}.items()}, streaming=False)
    for word in words:
        assert word in str(caught.value)
    with pytest.raises(ConfigError, match="object_store"):
        SourceOptions.parse({"metadata": "sqlite:///m.db", "subscribe": "a"}, streaming=False)
    with pytest.raises(ConfigError, match="endingOffsets"):
        SourceOptions.parse({**BASE, "subscribe": "a", "endingoffsets": "latest"}, streaming=True)


def test_offsets_are_shared_in_proportion_to_backlog_and_ranges_split():
    start, latest = {"a": 0, "b": 10, "c": 5}, {"a": 300, "b": 110, "c": 5}
    limited = _limit_offsets(start, latest, 100)
    assert limited == {"a": 75, "b": 35, "c": 5}
    assert sum(limited[n] - start[n] for n in start) == 100
    assert _limit_offsets(start, latest, 1000) == latest
    assert sum(_limit_offsets({"a": 0, "b": 0, "c": 0}, {"a": 1, "b": 1, "c": 1}, 2).values()) == 2
    ranges = split_ranges([OffsetRange("a", 1, 0, 90), OffsetRange("b", 2, 0, 10)], 4)
    assert len(ranges) >= 4 and sum(r.end - r.start for r in ranges) == 100
    assert [(r.start, r.end) for r in ranges if r.name == "a"] == [(0, 22), (22, 45), (45, 67), (67, 90)]


# ---- a cluster and a Spark session --------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(metadata URL, store URL, node): one node appends for the whole module."""
    root = tmp_path_factory.mktemp("cluster")
    meta, store = f"sqlite:///{root}/meta.db", f"file://{root}/store"
    os.makedirs(f"{root}/store")
    node = s3stream.StreamClient(1, str(root / "node.wal"), store, meta, small_config(reclaim_interval=None))
    yield meta, store, node
    node.close()


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    session = (SparkSession.builder.master("local[2,2]").appName("test_spark_source")
               .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1").config("spark.sql.shuffle.partitions", "2")
               .config("spark.sql.python.filterPushdown.enabled", "true")
               .config("spark.sql.streaming.pollingDelay", "10ms")
               .getOrCreate())
    yield session
    session.stop()


def append(node, name: str, count: int, first: int = 0, seed: int = 0, compression=None) -> list[Record]:
    """`count` records appended to `name` in a few batches, then uploaded (committed)."""
    rng = random.Random(seed * 7919 + first)
    partition = open_partition(node, name)
    records = [Record(None if i % 5 == 0 else b"k%d" % i, None if i % 7 == 3 else b"%s-%d" % (name.encode(), i)
                      + bytes(rng.randrange(40)), 1_700_000_000_000 + i,
                      (("n", b"%d" % i), ("none", None)) if i % 3 == 0 else ())
               for i in range(first, first + count)]
    for at in range(0, count, 25):
        partition.append_records(records[at:at + 25], compression=compression).result(10)
    node.force_upload(30)
    return records


def reader(spark, meta, store, **options):
    r = spark.read.format("s3stream").option("metadata", meta).option("object_store", store)
    for key, value in options.items():
        r = r.option(key, value)
    return r.load()


def rows_of(df) -> list[tuple]:
    return sorted((r["partition"], r["offset"], r["key"], r["value"], r["timestamp"].timestamp(),
                   r["timestampType"], tuple((h["key"], h["value"]) for h in r["headers"])) for r in df.collect())


def want_rows(name: str, records: list[Record], first: int = 0) -> list[tuple]:
    return [(name, first + i, r.key, r.value, r.timestamp / 1000, 0, tuple(r.headers)) for i, r in enumerate(records)]


# ---- batch ------------------------------------------------------------------------------------

def test_batch_read_is_what_was_appended(spark, cluster):
    from pyspark.sql.types import StructType
    from pyspark_s3stream import SCHEMA
    from pyspark_s3stream.source import SPARK_SCHEMA
    assert StructType.fromDDL(SCHEMA) == SPARK_SCHEMA
    meta, store, node = cluster
    want = []
    for i, codec in enumerate([None, "zstd", "lz4"]):
        want += want_rows(f"b-{i}", append(node, f"b-{i}", 60 + i * 10, compression=codec))
    df = reader(spark, meta, store, subscribe="b-0,b-1,b-2")
    assert df.schema == SPARK_SCHEMA
    assert rows_of(df) == sorted(want)
    # assign, and a pattern: only the names it matches whole
    assert rows_of(reader(spark, meta, store, assign='["b-1"]')) == sorted(w for w in want if w[0] == "b-1")
    assert rows_of(reader(spark, meta, store, subscribePattern="b-[02]")) == sorted(w for w in want if w[0] != "b-1")
    assert reader(spark, meta, store, subscribePattern="b-").count() == 0
    # JSON offsets: -2 earliest, -1 latest; unnamed partitions from earliest to latest
    got = rows_of(reader(spark, meta, store, subscribe="b-0,b-1,b-2",
                         startingOffsets=json.dumps({"b-0": 10, "b-1": -2}),
                         endingOffsets=json.dumps({"b-0": 20, "b-2": 5, "b-1": -1})))
    assert got == sorted([w for w in want if (w[0] == "b-0" and 10 <= w[1] < 20) or w[0] == "b-1"
                          or (w[0] == "b-2" and w[1] < 5)])
    with pytest.raises(Exception, match="endingOffsets"):
        reader(spark, meta, store, subscribe="b-0", endingOffsets='{"b-0": 1000}').collect()
    with pytest.raises(Exception, match="startingOffsets"):
        reader(spark, meta, store, subscribe="b-0", startingOffsets="latest").collect()


def test_pushed_filters_narrow_what_is_read(spark, cluster):
    meta, store, node = cluster
    want = []
    for name in ("f-0", "f-1", "f-2"):
        want += want_rows(name, append(node, name, 50))
    options = {**BASE, "metadata": meta, "object_store": store, "subscribepattern": "f-.*"}
    assert not hasattr(BatchReader(options), "pushFilters") or \
        BatchReader.pushFilters is DataSourceReader.pushFilters       # PySpark refuses it unless configured
    source = batch_reader({**options, "filterpushdown": "true"})
    assert type(source) is FilteringBatchReader and type(batch_reader(options)) is BatchReader
    assert pickle.loads(pickle.dumps(source)).options == source.options
    filters = [In(("partition",), ("f-0", "f-2")), GreaterThanOrEqual(("offset",), 10), LessThan(("offset",), 20),
               EqualTo(("key",), b"k12"), EqualTo(("partition",), 3)]
    assert list(source.pushFilters(filters)) == filters[3:]
    assert [(r.name, r.start, r.end) for r in source.partitions()] == [("f-0", 10, 20), ("f-2", 10, 20)]
    df = reader(spark, meta, store, subscribePattern="f-.*", filterPushdown="true").where(
        "partition in ('f-0', 'f-2') and offset >= 10 and offset < 20")
    plan = df._jdf.queryExecution().executedPlan().toString()
    assert "Filter " not in plan, plan                    # the source guarantees them: Spark does not filter
    assert rows_of(df) == sorted(w for w in want if w[0] in ("f-0", "f-2") and 10 <= w[1] < 20)
    exact = reader(spark, meta, store, subscribePattern="f-.*", filterPushdown="true").where("offset = 7 and partition = 'f-1'")
    assert rows_of(exact) == [w for w in want if w[:2] == ("f-1", 7)]


def test_min_partitions_splits_ranges(spark, cluster):
    meta, store, node = cluster
    records = append(node, "m-0", 100)
    df = reader(spark, meta, store, subscribe="m-0", minPartitions="4")
    assert df.rdd.getNumPartitions() == 4
    assert rows_of(df) == want_rows("m-0", records)
    assert reader(spark, meta, store, subscribe="m-0").rdd.getNumPartitions() == 1


def test_bad_options_fail_the_query_naming_the_option(spark, cluster):
    meta, store, _ = cluster
    with pytest.raises(Exception, match="minPartitions"):
        reader(spark, meta, store, subscribe="x", minPartitions="many").collect()
    query = (spark.readStream.format("s3stream").option("metadata", meta).option("object_store", store)
             .option("subscribe", "x").option("maxBytesPerTrigger", "1000").load()
             .writeStream.format("memory").queryName("never").start())
    try:
        with pytest.raises(Exception, match="maxBytesPerTrigger"):
            query.awaitTermination(30)
    finally:
        query.stop()


# ---- streaming ----------------------------------------------------------------------------------

def run_available_now(spark, meta, store, out, checkpoint, transform=None, **options):
    """One Trigger.AvailableNow run into parquet `out`; its query's progress."""
    r = (spark.readStream.format("s3stream").option("metadata", meta).option("object_store", store)
         .option("startingOffsets", "earliest"))
    for key, value in options.items():
        r = r.option(key, value)
    df = r.load()
    if transform is not None:
        df = transform(df)
    query = (df.writeStream.format("parquet").option("path", out).option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
    try:
        query.awaitTermination(60)
        if query.exception() is not None:
            raise query.exception()
        return query.recentProgress
    finally:
        query.stop()


def parquet_rows(spark, out) -> list[tuple]:
    return rows_of(spark.read.parquet(out))


def test_streaming_resumes_from_its_checkpoint_with_limits(spark, cluster, tmp_path):
    meta, store, node = cluster
    out, checkpoint = str(tmp_path / "out"), str(tmp_path / "checkpoint")
    want = want_rows("s-0", append(node, "s-0", 120)) + want_rows("s-1", append(node, "s-1", 80))
    progress = run_available_now(spark, meta, store, out, checkpoint, subscribePattern="s-.*",
                                 maxOffsetsPerTrigger="50")
    batches = [p for p in progress if p["numInputRows"] > 0]
    assert len(batches) == 4 and all(p["numInputRows"] <= 50 for p in batches), progress
    assert parquet_rows(spark, out) == sorted(want)
    # more records, and a new partition the pattern matches: the restart reads exactly those
    want += want_rows("s-0", append(node, "s-0", 30, first=120), first=120) + want_rows("s-2", append(node, "s-2", 10))
    run_available_now(spark, meta, store, out, checkpoint, subscribePattern="s-.*")
    assert parquet_rows(spark, out) == sorted(want)
    offsets = f"{checkpoint}/offsets"
    newest = max((f for f in os.listdir(offsets) if f.isdigit()), key=int)
    with open(f"{offsets}/{newest}") as f:
        last = json.loads(f.read().splitlines()[-1])
    assert last == {"s-0": 150, "s-1": 80, "s-2": 10}


def test_fail_on_data_loss(spark, cluster, tmp_path):
    meta, store, node = cluster
    want = want_rows("d-0", append(node, "d-0", 40))
    for fail in ("true", "false"):
        out, checkpoint = str(tmp_path / f"out-{fail}"), str(tmp_path / f"checkpoint-{fail}")
        run_available_now(spark, meta, store, out, checkpoint, subscribe="d-0", failOnDataLoss=fail)
    more = append(node, "d-0", 60, first=40)
    open_partition(node, "d-0").log.trim(70)                        # offsets 40..69 gone before any read
    with pytest.raises(Exception, match=r"d-0.*\[40, 70\).*failOnDataLoss"):
        run_available_now(spark, meta, store, str(tmp_path / "out-true"), str(tmp_path / "checkpoint-true"),
                          subscribe="d-0")
    run_available_now(spark, meta, store, str(tmp_path / "out-false"), str(tmp_path / "checkpoint-false"),
                      subscribe="d-0", failOnDataLoss="false")
    assert parquet_rows(spark, str(tmp_path / "out-false")) == sorted(want + want_rows("d-0", more, first=40)[30:])


def test_a_task_that_fails_once_gives_each_record_once(spark, cluster, tmp_path):
    from pyspark.sql.functions import col, udf
    meta, store, node = cluster
    want = want_rows("t-0", append(node, "t-0", 50)) + want_rows("t-1", append(node, "t-1", 50))
    marker = str(tmp_path / "failed-once")

    @udf("long")
    def fail_once(offset):
        if offset == 25 and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError("injected: the first attempt of this task fails")
        return offset

    out = str(tmp_path / "out")
    run_available_now(spark, meta, store, out, str(tmp_path / "checkpoint"), subscribe="t-0,t-1",
                      transform=lambda df: df.withColumn("offset", fail_once(col("offset"))))
    assert os.path.exists(marker)
    assert parquet_rows(spark, out) == sorted(want)


def test_a_task_finds_trimmed_offsets_itself(cluster):
    """read_range (a task) asked for offsets trimmed after planning: DataLossError naming the
    partition and offsets, or, with failOnDataLoss false, the records from the new start on."""
    from pyspark_s3stream.source import DataLossError, read_range
    meta, store, node = cluster
    records = append(node, "e-0", 60)
    open_partition(node, "e-0").log.trim(25)
    with s3stream.open_reader(meta, store) as one:
        stream_id = read_partition(one, "e-0").log_stream_id
    part = OffsetRange("e-0", stream_id, 10, 60)
    for fail in ("true", "false"):
        options = SourceOptions.parse({"metadata": meta, "object_store": store, "subscribe": "e-0",
                                       "failondataloss": fail}, streaming=True)
        with s3stream.open_reader(meta, store) as cluster_reader:
            if fail == "true":
                with pytest.raises(DataLossError, match=r"'e-0'.*\[10, 25\).*failOnDataLoss"):
                    list(read_range(options, part, arrow_schema(), cluster_reader))
            else:
                got = pa.Table.from_batches(list(read_range(options, part, arrow_schema(), cluster_reader)))
                assert got.column("offset").to_pylist() == list(range(25, 60))
                assert got.column("value").to_pylist() == [r.value for r in records[25:]]
