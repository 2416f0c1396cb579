"""The s3stream source: partitions of a cluster read as Spark's Kafka source reads topics.

Options (keys are case-insensitive, as Spark passes them; a bad one raises ConfigError naming it):

- `metadata`, `object_store` (required): the cluster's URLs, as StreamClient takes them.
- exactly one of `subscribe` (comma-separated partition names), `subscribePattern` (a Python
  regular expression that a partition's whole name must match) or `assign` (a JSON list of names).
- `startingOffsets`: "earliest", "latest" (streaming only, its default) or JSON {"name": offset}
  with -2 for earliest and -1 for latest; batch default "earliest". Partitions the JSON does not
  name start at earliest. `endingOffsets` (batch only): "latest" (default) or JSON, -1 for latest.
  A streaming query restarted from its checkpoint ignores startingOffsets, as Kafka's does.
- `maxOffsetsPerTrigger` (streaming): at most this many offsets per micro-batch, shared among the
  partitions in proportion to their backlog (Kafka's rule, rounded so the sum never exceeds it).
  Offsets, not rows: a sink's gaps (offsets without records) count, so rows <= offsets.
  There is no `maxBytesPerTrigger`: metadata knows a partition's offsets, not its bytes per
  offset, so a byte limit could only be guessed from offsets (it is refused, with this reason).
- `failOnDataLoss` (default true): offsets a query needs that were trimmed away, given up as lost
  (OffsetsLostError) or whose partition was deleted fail the query with an error naming the
  partition and the offsets; false logs a warning and goes on at the next readable offset.
- `minPartitions`: split offset ranges so that there are at least that many Spark partitions
  (Kafka's rule: one per partition's range otherwise).

Offsets in the checkpoint are {"partition name": next offset}. Partitions that appear later and
match the subscription are read from their earliest offset (Kafka's behaviour): the micro-batch
that finds one records its earliest offset as both its start and end, so that a replayed batch
reads exactly what the first run read even if the partition is trimmed in between.

Reads run on executors through s3stream's reader that is not a node (open_reader): one per
(metadata, object store) per Python worker process, kept in a module-level cache (Spark reuses
its Python workers across tasks). Opening one is cheap on SQLite and a local store (1.3 ms with
its first fetch, against 0.1 ms for a fetch on a kept one, measured here), not so with a
PostgreSQL connection and S3 clients: hence the cache. Records are decoded by the native columnar decoder
(_native.kafkarecords.ColumnBuilder) straight into Arrow buffers, zero-copy into pyarrow arrays,
in batches of up to BATCH_ROWS rows or about BATCH_BYTES bytes.

Batch reads with the option `filterPushdown` true push down filters on `partition` (=, IN) and
`offset` (=, <, <=, >, >=): the ranges read are narrowed and the decoder drops records outside
them, so Spark does not evaluate them again. It is an option because PySpark 4.3 fails any read
whose reader implements pushFilters unless spark.sql.python.filterPushdown.enabled is true (false
by default), and the reader cannot see that configuration: set both.
"""
from __future__ import annotations

# First: a worker without the dependencies says what to set (PYSPARK_PYTHON), not just what is missing.
from . import _dependencies  # noqa: F401

import atexit
import difflib
import json
import logging
import math
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (DataSourceReader, DataSourceStreamReader, EqualTo, Filter, GreaterThan,
                                    GreaterThanOrEqual, In, InputPartition, IsNotNull, LessThan, LessThanOrEqual)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import (ArrayType, BinaryType, IntegerType, LongType, StringType, StructField, StructType,
                               TimestampType)

from _native.kafkarecords import ColumnBuilder
from s3stream import open_reader
from s3stream.errors import (ConfigError, OffsetOutOfRangeError, OffsetsLostError, S3StreamError,
                             StreamNotFoundError)
from s3stream.metadata import StreamState
from s3stream.reader import StreamReader as ClusterReader
from s3stream.records import MAX_DECOMPRESSED_BYTES, decompress_payload
from s3stream.cluster import read_partition

__all__ = ["BatchReader", "FilteringBatchReader", "StreamReader", "OffsetRange", "DataLossError", "SPARK_SCHEMA", "BATCH_ROWS",
           "BATCH_BYTES", "FETCH_BYTES"]

log = logging.getLogger(__name__)

#: Rows of an Arrow batch at most, and about its bytes (a batch ends at the stored batch that
#: reaches either).
BATCH_ROWS = 64 * 1024
BATCH_BYTES = 16 * 1024 * 1024
#: Bytes asked of each fetch (the reader returns at least one stored batch).
FETCH_BYTES = 8 * 1024 * 1024

EARLIEST, LATEST = -2, -1
_PARTITION_PREFIX = "partition/"

#: The schema of pyspark_s3stream.SCHEMA, built without a Spark session (executors and the
#: planner's Python workers have none to parse the DDL with).
SPARK_SCHEMA = StructType([
    StructField("key", BinaryType()), StructField("value", BinaryType()), StructField("partition", StringType()),
    StructField("offset", LongType()), StructField("timestamp", TimestampType()),
    StructField("timestampType", IntegerType()),
    StructField("headers", ArrayType(StructType([StructField("key", StringType()),
                                                 StructField("value", BinaryType())]))),
])


class DataLossError(OffsetOutOfRangeError):
    """Offsets a query needs are no longer readable (trimmed, lost, or their partition deleted)
    and failOnDataLoss is true."""


# ---- options ----------------------------------------------------------------------------------

_KNOWN = ("metadata", "object_store", "subscribe", "subscribepattern", "assign", "startingoffsets",
          "endingoffsets", "maxoffsetspertrigger", "failondataloss", "minpartitions", "filterpushdown")
_SPELLED = {"subscribepattern": "subscribePattern", "startingoffsets": "startingOffsets",
            "endingoffsets": "endingOffsets", "maxoffsetspertrigger": "maxOffsetsPerTrigger",
            "failondataloss": "failOnDataLoss", "minpartitions": "minPartitions", "filterpushdown": "filterPushdown"}


def _spelled(key: str) -> str:
    return _SPELLED.get(key, key)


@dataclass(frozen=True)
class SourceOptions:
    """The source's options, checked (module docstring). `starting`/`ending`: "earliest",
    "latest" or {name: offset} (EARLIEST, LATEST or an offset)."""
    metadata: str
    object_store: str
    subscription: str                    # "subscribe", "subscribepattern" or "assign"
    names: tuple[str, ...]               # subscribe, assign
    pattern: str | None                  # subscribepattern
    starting: str | dict[str, int]
    ending: str | dict[str, int]
    max_offsets_per_trigger: int | None
    fail_on_data_loss: bool
    min_partitions: int | None
    filter_pushdown: bool = False

    @classmethod
    def parse(cls, options: Mapping[str, str], streaming: bool) -> "SourceOptions":
        opts = {str(k).lower(): v for k, v in options.items()}
        for key in opts:
            if key in _KNOWN:
                continue
            if key == "maxbytespertrigger":
                raise ConfigError(
                    f"option maxBytesPerTrigger={opts[key]!r} is not supported by the s3stream source: metadata "
                    f"knows a partition's offsets but not its bytes per offset, so a byte limit could only be "
                    f"guessed. Use maxOffsetsPerTrigger (offsets per micro-batch) instead")
            close = difflib.get_close_matches(key, _KNOWN, 1)
            hint = f"did you mean {_spelled(close[0])}?" if close else \
                f"the options are {', '.join(_spelled(k) for k in _KNOWN)}"
            raise ConfigError(f"unknown option {key}={opts[key]!r} for the s3stream source: {hint}")
        for required in ("metadata", "object_store"):
            if not opts.get(required):
                raise ConfigError(f"option {required} is required by the s3stream source: give the cluster's "
                                  f"{'metadata URL (sqlite:///..., postgresql://...)' if required == 'metadata' else 'object store URL (file://..., s3://...)'}"
                                  f" with .option({required!r}, URL)")
        given = [k for k in ("subscribe", "subscribepattern", "assign") if k in opts]
        if len(given) != 1:
            raise ConfigError(
                "the s3stream source needs exactly one of the options subscribe (comma-separated partition names), "
                "subscribePattern (a regular expression over partition names) or assign (a JSON list of names); "
                + (f"got {', '.join(f'{_spelled(k)}={opts[k]!r}' for k in given)}" if given else "got none"))
        kind = given[0]
        names: tuple[str, ...] = ()
        pattern = None
        raw = opts[kind]
        if kind == "subscribe":
            names = tuple(n.strip() for n in raw.split(",") if n.strip())
            if not names:
                raise ConfigError(f"option subscribe={raw!r} names no partition: give comma-separated partition names")
        elif kind == "assign":
            try:
                parsed = json.loads(raw)
            except ValueError as e:
                raise ConfigError(f"option assign={raw!r} is not JSON ({e}): give a JSON list of partition names, "
                                  f'e.g. ["orders-0", "orders-1"]') from None
            if not isinstance(parsed, list) or not parsed or not all(isinstance(n, str) and n for n in parsed):
                raise ConfigError(f"option assign={raw!r} must be a non-empty JSON list of partition names, "
                                  f'e.g. ["orders-0", "orders-1"]')
            names = tuple(dict.fromkeys(parsed))
        else:
            try:
                re.compile(raw)
            except re.error as e:
                raise ConfigError(f"option subscribePattern={raw!r} is not a Python regular expression ({e}); "
                                  f"it must match a partition's whole name, e.g. 'orders-.*'") from None
            pattern = raw
        if streaming and "endingoffsets" in opts:
            raise ConfigError(f"option endingOffsets={opts['endingoffsets']!r} is for batch queries only; a "
                              f"streaming query reads on as records come: remove it (or use spark.read)")
        starting = _parse_offsets("startingOffsets", opts.get("startingoffsets", "latest" if streaming else "earliest"),
                                  allow_latest=streaming, allow_earliest=True)
        ending = _parse_offsets("endingOffsets", opts.get("endingoffsets", "latest"), allow_latest=True,
                                allow_earliest=False)
        for spec, option in ((starting, "startingOffsets"), (ending, "endingOffsets")):
            if isinstance(spec, dict) and kind != "subscribepattern":
                extra = sorted(set(spec) - set(names))
                if extra:
                    raise ConfigError(f"option {option} names {extra}, which the query does not read "
                                      f"({_spelled(kind)}={raw!r}): name only subscribed partitions")
            if isinstance(spec, dict) and pattern is not None:
                extra = sorted(n for n in spec if not re.fullmatch(pattern, n))
                if extra:
                    raise ConfigError(f"option {option} names {extra}, which subscribePattern={raw!r} does not "
                                      f"match: name only subscribed partitions")
        max_offsets = None
        if "maxoffsetspertrigger" in opts:
            if not streaming:
                raise ConfigError(f"option maxOffsetsPerTrigger={opts['maxoffsetspertrigger']!r} is for streaming "
                                  f"queries only: remove it from this batch read")
            max_offsets = _positive_int("maxOffsetsPerTrigger", opts["maxoffsetspertrigger"])
        min_partitions = (_positive_int("minPartitions", opts["minpartitions"]) if "minpartitions" in opts
                          else None)
        fail = _boolean(opts, "failondataloss", True)
        pushdown = _boolean(opts, "filterpushdown", False)
        if pushdown and streaming:
            raise ConfigError("option filterPushdown=true is for batch reads only (Spark pushes no filters into a "
                              "streaming source): remove it")
        return cls(opts["metadata"], opts["object_store"], kind, names, pattern, starting, ending, max_offsets,
                   fail, min_partitions, pushdown)

    def matches(self, name: str) -> bool:
        return bool(re.fullmatch(self.pattern, name)) if self.pattern is not None else name in self.names


def _boolean(opts: Mapping[str, str], key: str, default: bool) -> bool:
    if key not in opts:
        return default
    word = str(opts[key]).strip().lower()
    if word not in ("true", "false"):
        raise ConfigError(f"option {_spelled(key)}={opts[key]!r} must be true or false")
    return word == "true"


def _positive_int(option: str, raw: Any) -> int:
    try:
        value = int(str(raw).strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"option {option}={raw!r} must be a positive integer")
    return value


def _parse_offsets(option: str, raw: str, allow_latest: bool, allow_earliest: bool) -> str | dict[str, int]:
    text = str(raw).strip()
    word = text.lower()
    if word in ("earliest", "latest"):
        if (word == "latest" and not allow_latest) or (word == "earliest" and not allow_earliest):
            why = ("a batch query starting at the latest offsets would read nothing" if word == "latest"
                   else "a query ending at the earliest offsets would read nothing")
            raise ConfigError(f"option {option}={raw!r} is not allowed here: {why}; use "
                              f"{'earliest or JSON offsets' if word == 'latest' else 'latest or JSON offsets'}")
        return word
    try:
        parsed = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"option {option}={raw!r} is neither earliest, latest nor JSON ({e}): give e.g. "
                          f'{{"orders-0": 42, "orders-1": -2}} (-2 earliest, -1 latest)') from None
    if not isinstance(parsed, dict) or not all(isinstance(k, str) and type(v) is int for k, v in parsed.items()):
        raise ConfigError(f"option {option}={raw!r} must be a JSON object of partition name to integer offset, "
                          f'e.g. {{"orders-0": 42, "orders-1": -2}} (-2 earliest, -1 latest)')
    for name, offset in parsed.items():
        if offset < EARLIEST or (offset == EARLIEST and not allow_earliest) or (offset == LATEST and not allow_latest):
            raise ConfigError(f"option {option}: offset {offset} for partition {name!r} is not allowed; use an offset "
                              f"of 0 or more{', -2 (earliest)' if allow_earliest else ''}"
                              f"{' or -1 (latest)' if allow_latest else ''}")
    return parsed


def check_schema(schema: StructType | None) -> None:
    """ConfigError unless `schema` is the source's (a user-given schema cannot change it)."""
    if schema is not None and schema != SPARK_SCHEMA:
        raise ConfigError(f"the s3stream source's schema is fixed ({SPARK_SCHEMA.simpleString()}); got "
                          f"{schema.simpleString()}: drop .schema(...) and select or cast columns after load()")


# ---- the cluster, as the driver sees it -------------------------------------------------------

@dataclass(frozen=True)
class PartitionState:
    name: str
    stream_id: int
    start_offset: int           # earliest readable offset
    end_offset: int             # committed end (the latest offset)


class Cluster:
    """Partitions and their committed ranges, read by the driver through a reader that is not a
    node. Log stream ids are remembered (a partition's log never changes)."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.reader: ClusterReader = open_reader(options.metadata, options.object_store)
        self._stream_ids: dict[str, int] = {}

    def names(self) -> list[str]:
        """Subscribed partitions that exist, sorted."""
        if self.options.pattern is None:
            return sorted(self.options.names)
        listed = self.reader.metadata.list_kv(_PARTITION_PREFIX)
        names = (key[len(_PARTITION_PREFIX):] for key in listed)
        return sorted(n for n in names if n and "/" not in n and self.options.matches(n))

    def state(self, name: str) -> PartitionState | None:
        """A partition's committed range now; None if it does not exist (yet, or any more)."""
        stream_id = self._stream_ids.get(name)
        try:
            if stream_id is None:
                stream_id = self._stream_ids[name] = read_partition(self.reader, name).log_stream_id
            stream = self.reader.metadata.get_stream(stream_id)
        except StreamNotFoundError:
            return None
        if stream.state == StreamState.DELETED:
            return None
        return PartitionState(name, stream_id, stream.start_offset, stream.end_offset)

    def states(self, names: Sequence[str] | None = None) -> dict[str, PartitionState]:
        found = {}
        for name in self.names() if names is None else names:
            state = self.state(name)
            if state is not None:
                found[name] = state
        return found

    def close(self) -> None:
        self.reader.close()


def _resolve(option: str, spec: str | dict[str, int], states: Mapping[str, PartitionState],
             default: int) -> dict[str, int]:
    """Offsets per partition for a startingOffsets/endingOffsets spec (EARLIEST/LATEST resolved
    against `states`; partitions a JSON spec does not name take `default`)."""
    out = {}
    for name, state in states.items():
        wanted = (EARLIEST if spec == "earliest" else LATEST) if isinstance(spec, str) else spec.get(name, default)
        out[name] = (state.start_offset if wanted == EARLIEST else state.end_offset if wanted == LATEST
                     else wanted)
    return out


# ---- input partitions and their split ---------------------------------------------------------

class OffsetRange(InputPartition):
    """Offsets [start, end) of one partition (its log stream `stream_id`): one Spark task."""

    def __init__(self, name: str, stream_id: int, start: int, end: int) -> None:
        self.name, self.stream_id, self.start, self.end = name, stream_id, start, end

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OffsetRange) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((self.name, self.start, self.end))


def split_ranges(ranges: list[OffsetRange], min_partitions: int | None) -> list[OffsetRange]:
    """One range per partition, or, when that is fewer than `min_partitions`, each range cut into
    pieces in proportion to its size so that there are at least min_partitions (as far as
    offsets allow)."""
    if not min_partitions or len(ranges) >= min_partitions:
        return ranges
    total = sum(r.end - r.start for r in ranges)
    out: list[OffsetRange] = []
    for r in ranges:
        size = r.end - r.start
        parts = min(size, max(1, math.ceil(size * min_partitions / total)))
        for i in range(parts):
            out.append(OffsetRange(r.name, r.stream_id, r.start + size * i // parts, r.start + size * (i + 1) // parts))
    return out


def _limit_offsets(start: Mapping[str, int], latest: Mapping[str, int], max_offsets: int) -> dict[str, int]:
    """`latest` cut down to at most `max_offsets` offsets past `start` in all, shared in proportion
    to each partition's backlog (largest remainders get the offsets rounding leaves)."""
    backlog = {n: latest[n] - start[n] for n in latest if n in start and latest[n] > start[n]}
    total = sum(backlog.values())
    if total <= max_offsets:
        return dict(latest)
    shares = {n: max_offsets * b / total for n, b in backlog.items()}
    taken = {n: int(s) for n, s in shares.items()}
    left = max_offsets - sum(taken.values())
    for n in sorted(shares, key=lambda n: (taken[n] - shares[n], n))[:left]:
        taken[n] += 1
    out = dict(latest)
    for n, t in taken.items():
        out[n] = start[n] + t
    return out


# ---- reading (executors) ----------------------------------------------------------------------

_readers: dict[tuple[str, str], ClusterReader] = {}
_readers_lock = threading.Lock()


def shared_reader(metadata: str, object_store: str) -> ClusterReader:
    """This process's reader of the cluster (opened once: read() runs once per task)."""
    key = (metadata, object_store)
    with _readers_lock:
        reader = _readers.get(key)
        if reader is None:
            reader = _readers[key] = open_reader(metadata, object_store)
        return reader


@atexit.register
def close_shared_readers() -> None:
    with _readers_lock:
        readers = list(_readers.values())
        _readers.clear()
    for reader in readers:
        try:
            reader.close()
        except Exception:                    # exiting: nothing to do about it
            log.debug("closing an s3stream reader failed", exc_info=True)


def _data_loss(fail: bool, part: OffsetRange, start: int, end: int, why: str) -> None:
    message = (f"partition {part.name!r} (log stream {part.stream_id}): offsets [{start}, {end}) cannot be read: "
               f"{why}. Some data may have been lost because it is not available any more. ")
    if fail:
        raise DataLossError(message + "If you want your query to go on without it, set the source option "
                                      "failOnDataLoss to false.")
    log.warning("%sfailOnDataLoss is false: going on at offset %d.", message, end)


def read_range(options: SourceOptions, part: OffsetRange, types: "pa.Schema",
               reader: ClusterReader | None = None) -> Iterator[pa.RecordBatch]:
    """The records of `part` as Arrow batches of `types` (the schema Spark expects)."""
    if reader is None:
        reader = shared_reader(options.metadata, options.object_store)
    builder = ColumnBuilder(part.name.encode("utf-8"))
    position = part.start
    while position < part.end:
        try:
            result = reader.fetch_committed(part.stream_id, position, part.end, FETCH_BYTES)
        except OffsetsLostError as e:
            resume = min(max(e.end, position + 1), part.end)
            _data_loss(options.fail_on_data_loss, part, position, resume,
                       f"they were given up with a lost WAL (offsets [{e.start}, {e.end}) of the stream)")
            position = resume
            continue
        except (OffsetOutOfRangeError, StreamNotFoundError):
            try:
                stream = reader.metadata.get_stream(part.stream_id)
            except StreamNotFoundError:
                stream = None
            if stream is None or stream.state == StreamState.DELETED:
                _data_loss(options.fail_on_data_loss, part, position, part.end, "the partition's log was deleted")
                break
            if position >= stream.start_offset:
                raise
            resume = min(stream.start_offset, part.end)
            _data_loss(options.fail_on_data_loss, part, position, resume,
                       f"the partition was trimmed: it starts at offset {stream.start_offset} now")
            position = resume
            continue
        for batch in result.batches:
            # Read from objects: their block checksums covered these bytes (one CRC per byte).
            builder.add(batch.payload, batch.base_offset, batch.count, position, part.end, decompress_payload,
                        MAX_DECOMPRESSED_BYTES, False)
            if builder.rows >= BATCH_ROWS or builder.nbytes >= BATCH_BYTES:
                yield arrow_batch(builder.finish(), types)
        position = result.batches[-1].end_offset if result.batches else part.end
    if builder.rows:
        yield arrow_batch(builder.finish(), types)


def _binary_array(kind: pa.DataType, rows: int, column: tuple) -> pa.Array:
    valid, offsets, data, nulls = column
    return pa.Array.from_buffers(kind, rows, [None if valid is None else pa.py_buffer(valid), pa.py_buffer(offsets),
                                              pa.py_buffer(data)], null_count=nulls)


def arrow_batch(columns: dict, types: "pa.Schema") -> pa.RecordBatch:
    """A ColumnBuilder's finish() as an Arrow batch of `types` (no copy of its buffers)."""
    rows = columns["rows"]
    header_starts, header_count, header_keys, header_values = columns["headers"]
    headers_type = types.field("headers").type
    element_type = headers_type.value_type
    pairs = pa.Array.from_buffers(element_type, header_count, [None], children=[
        _binary_array(element_type.field("key").type, header_count, header_keys),
        _binary_array(element_type.field("value").type, header_count, header_values)])
    arrays = [
        _binary_array(types.field("key").type, rows, columns["key"]),
        _binary_array(types.field("value").type, rows, columns["value"]),
        pa.Array.from_buffers(types.field("partition").type, rows,
                              [None, pa.py_buffer(columns["partition"][0]), pa.py_buffer(columns["partition"][1])]),
        pa.Array.from_buffers(types.field("offset").type, rows, [None, pa.py_buffer(columns["offset"])]),
        pa.Array.from_buffers(types.field("timestamp").type, rows, [None, pa.py_buffer(columns["timestamp"])]),
        pa.Array.from_buffers(types.field("timestampType").type, rows, [None, pa.py_buffer(columns["timestampType"])]),
        pa.Array.from_buffers(headers_type, rows, [None, pa.py_buffer(header_starts)], children=[pairs]),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=types)


def arrow_schema() -> "pa.Schema":
    from pyspark.sql.pandas.types import to_arrow_schema
    return to_arrow_schema(SPARK_SCHEMA, timezone="UTC")


class _Reading:
    """What both readers share: checked options, the driver's Cluster (opened when needed, never
    pickled to executors) and read()."""

    def __init__(self, options: Mapping[str, str], schema: StructType | None, streaming: bool) -> None:
        check_schema(schema)
        self.options = SourceOptions.parse(options, streaming)
        self._types = arrow_schema()
        self._cluster: Cluster | None = None

    @property
    def cluster(self) -> Cluster:
        if self._cluster is None:
            self._cluster = Cluster(self.options)
        return self._cluster

    def __getstate__(self) -> dict:
        state = dict(vars(self))
        state["_cluster"] = None
        return state

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, OffsetRange):          # Spark's InputPartition(None) for no ranges
            return iter(())
        return read_range(self.options, partition, self._types)

    def _close_cluster(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None


# ---- batch ------------------------------------------------------------------------------------

#: Columns no row has a null in (key and value may be null).
_NEVER_NULL = ("partition", "offset", "timestamp", "timestamptype", "headers")


def _column(f: Filter) -> str | None:
    ref: tuple[str, ...] = getattr(f, "attribute", ())
    return ref[0].lower() if len(ref) == 1 else None


def _is_offset(value: Any) -> bool:
    return type(value) is int


class BatchReader(_Reading, DataSourceReader):
    """spark.read.format("s3stream"): the records between startingOffsets and endingOffsets of
    the subscribed partitions, as of planning. With the option filterPushdown true the data
    source makes a FilteringBatchReader instead (batch_reader; module docstring: PySpark refuses
    a reader with pushFilters unless its configuration allows them, so only that subclass has
    the method)."""

    def __init__(self, options: Mapping[str, str], schema: StructType | None = None) -> None:
        super().__init__(options, schema, streaming=False)
        self.only: set[str] | None = None       # partitions the pushed filters allow (None: all)
        self.low, self.high = 0, None           # offsets the pushed filters allow: [low, high)

    def _only(self, names: set[str]) -> None:
        self.only = names if self.only is None else self.only & names

    def ranges(self) -> list[OffsetRange]:
        """The offset ranges to read, one per partition (before minPartitions' split)."""
        options, cluster = self.options, self.cluster
        names = [n for n in cluster.names() if self.only is None or n in self.only]
        states = cluster.states(names)
        if options.subscription == "assign":
            missing = [n for n in names if n not in states]
            if missing:
                raise ConfigError(f"option assign names partitions that do not exist (or have no committed "
                                  f"checkpoint yet): {missing}")
        starts = _resolve("startingOffsets", options.starting, states, EARLIEST)
        ends = _resolve("endingOffsets", options.ending, states, LATEST)
        out = []
        for name, state in states.items():
            start, end = starts[name], ends[name]
            if end > state.end_offset:
                raise OffsetOutOfRangeError(
                    f"option endingOffsets: partition {name!r} ends at {end}, past its committed end "
                    f"{state.end_offset}: use -1 (latest) or an offset up to {state.end_offset}")
            if start > end:
                raise OffsetOutOfRangeError(
                    f"option startingOffsets: partition {name!r} starts at {start}, after where it ends ({end}): "
                    f"give a starting offset up to the ending one")
            if start < state.start_offset:
                _data_loss(options.fail_on_data_loss, OffsetRange(name, state.stream_id, start, end), start,
                           min(state.start_offset, end),
                           f"the partition was trimmed: it starts at offset {state.start_offset} now")
                start = min(state.start_offset, end)
            start = max(start, self.low)
            end = end if self.high is None else min(end, self.high)
            if start < end:
                out.append(OffsetRange(name, state.stream_id, start, end))
        return out

    def partitions(self) -> list[InputPartition]:
        try:
            return list(split_ranges(self.ranges(), self.options.min_partitions))
        finally:
            self._close_cluster()


def batch_reader(options: Mapping[str, str], schema: StructType | None = None) -> BatchReader:
    """The reader of a batch read: a FilteringBatchReader if the option filterPushdown is true."""
    wanted = {str(k).lower(): v for k, v in options.items()}.get("filterpushdown", "")
    cls = FilteringBatchReader if str(wanted).strip().lower() == "true" else BatchReader
    return cls(options, schema)


class FilteringBatchReader(BatchReader):
    """A BatchReader that takes pushed filters (option filterPushdown true)."""

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        """Take filters on partition (=, IN) and offset (=, <, <=, >, >=) with literal values of
        the column's type, and IS NOT NULL of the columns that are never null; return every other
        one for Spark to apply."""
        kept = []
        for f in filters:
            column = _column(f)
            if isinstance(f, IsNotNull) and column in _NEVER_NULL:
                pass                                   # true of every row
            elif column == "partition" and isinstance(f, EqualTo) and isinstance(f.value, str):
                self._only({f.value})
            elif (column == "partition" and isinstance(f, In) and f.value
                  and all(isinstance(v, str) for v in f.value)):
                self._only(set(f.value))
            elif column == "offset" and isinstance(f, (EqualTo, GreaterThan, GreaterThanOrEqual, LessThan,
                                                        LessThanOrEqual)) and _is_offset(f.value):
                low, high = {EqualTo: (f.value, f.value + 1), GreaterThan: (f.value + 1, None),
                             GreaterThanOrEqual: (f.value, None), LessThan: (None, f.value),
                             LessThanOrEqual: (None, f.value + 1)}[type(f)]
                if low is not None:
                    self.low = max(self.low, low)
                if high is not None:
                    self.high = high if self.high is None else min(self.high, high)
            else:
                kept.append(f)
        return iter(kept)


# ---- streaming --------------------------------------------------------------------------------

class StreamReader(_Reading, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """spark.readStream.format("s3stream"): micro-batches over the subscribed partitions."""

    def __init__(self, options: Mapping[str, str], schema: StructType | None = None) -> None:
        super().__init__(options, schema, streaming=True)
        self._target: dict[str, int] | None = None      # Trigger.AvailableNow: where to stop

    def initialOffset(self) -> dict:
        states = self.cluster.states()
        if self.options.subscription == "assign":
            missing = [n for n in self.options.names if n not in states]
            if missing:
                raise ConfigError(f"option assign names partitions that do not exist (or have no committed "
                                  f"checkpoint yet): {missing}")
        offsets = _resolve("startingOffsets", self.options.starting, states, EARLIEST)
        for name, offset in offsets.items():
            if offset > states[name].end_offset:
                raise OffsetOutOfRangeError(
                    f"option startingOffsets: partition {name!r} starts at {offset}, past its committed end "
                    f"{states[name].end_offset}: use -1 (latest) or an offset up to it")
        return offsets

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_offsets_per_trigger is not None:
            return ReadMaxRows(self.options.max_offsets_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = {n: s.end_offset for n, s in self.cluster.states().items()}

    def _latest(self) -> dict[str, PartitionState]:
        states = self.cluster.states()
        if self._target is not None:
            states = {n: s for n, s in states.items() if n in self._target}
        return states

    def reportLatestOffset(self) -> dict:
        return {n: s.end_offset for n, s in self._latest().items()}

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        states = self._latest()
        latest: dict[str, int] = {}
        for name, offset in start.items():
            if name not in states:
                _data_loss(self.options.fail_on_data_loss, OffsetRange(name, -1, offset, offset), offset, offset,
                           "the partition was deleted (or is unreadable)")
                continue
            end = states[name].end_offset
            if self._target is not None:
                end = min(end, self._target[name])
            latest[name] = max(end, offset)
        for name, state in states.items():
            if name not in start:      # new: a batch that starts and ends at its earliest offset
                latest[name] = state.start_offset
        if isinstance(limit, ReadMaxRows):
            return _limit_offsets(start, latest, limit.max_rows)
        if not isinstance(limit, ReadAllAvailable):
            raise ConfigError(f"the s3stream source honours ReadAllAvailable and ReadMaxRows "
                              f"(maxOffsetsPerTrigger), not {limit!r}")
        return latest

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        ranges = []
        for name, until in sorted(end.items()):
            since = start.get(name, until)
            if since >= until:
                continue
            state = self.cluster.state(name)
            if state is None:
                _data_loss(self.options.fail_on_data_loss, OffsetRange(name, -1, since, until), since, until,
                           "the partition was deleted")
                continue
            if since < state.start_offset:
                # Found here as well as by the tasks: the driver fails (or skips) before any task runs.
                resume = min(state.start_offset, until)
                _data_loss(self.options.fail_on_data_loss, OffsetRange(name, state.stream_id, since, until), since,
                           resume, f"the partition was trimmed: it starts at offset {state.start_offset} now")
                since = resume
                if since >= until:
                    continue
            ranges.append(OffsetRange(name, state.stream_id, since, until))
        return list(split_ranges(ranges, self.options.min_partitions))

    def commit(self, end: dict) -> None:
        """Nothing to do: the offsets live in Spark's checkpoint, as Kafka's source keeps them."""

    def stop(self) -> None:
        self._close_cluster()
