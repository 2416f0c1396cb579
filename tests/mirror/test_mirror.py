"""The mirror (s3stream.mirror, issue 13): naming policies, the exact offset map, flows copying a
partition between two real clusters (two metadata stores, two object stores; the target over
SQLite and PostgreSQL), resume and handover, source retention gaps, checkpoint translation of
consumer groups, heartbeats, and bad input. Crashes are in test_mirror_crash.py."""
from __future__ import annotations

import json
import random
import threading
import time

import pytest

from conftest import small_config
from s3stream import RecordBatch, StreamClient
from s3stream.records.consumer import ConsumerGroups
from s3stream.errors import (CorruptDataError, InvalidArgumentError, OffsetOutOfRangeError, S3StreamError,
                             StreamNotClosedError, StreamNotFoundError)
from s3stream.metadata import open_metadata
from s3stream.mirror import (DefaultReplicationPolicy, Heartbeater, IdentityReplicationPolicy, MirrorConflictError,
                             MirrorError, MirrorFlow, MirrorNameError, OffsetMap, OffsetNotMirroredError,
                             SourceTrimmedError, add_segment, latest_heartbeats, load_flow, replication_latency,
                             sync_checkpoints)
from s3stream.mirror.checkpoint import NOT_MIRRORED, POLICY_MISMATCH, REWIND_KEPT
from s3stream.mirror.offsets import BEFORE_START, BEYOND_END, EXACT, GAP, decode_segments, encode_segments
from s3stream.mirror.flowstate import map_key
from s3stream.cluster import open_partition, partitions_on, read_partition

FLOW = "A-to-B"
UPLOAD = 0.05          # seconds: the clusters' upload interval, so committed data appears quickly


# ---- two clusters ----------------------------------------------------------------------------------

class Clusters:
    """A source cluster (SQLite, its own object store) and a target cluster (`target_url`, its own
    object store), with clients started on demand (node ids are per cluster)."""

    def __init__(self, tmp, target_url: str) -> None:
        self.tmp = tmp
        self.source_url = f"sqlite:///{tmp}/source.db"
        self.target_url = target_url
        self.clients: list[StreamClient] = []
        self.metas = []

    def source(self, node: int = 1) -> StreamClient:
        return self._client("source", node, self.source_url)

    def target(self, node: int = 1) -> StreamClient:
        return self._client("target", node, self.target_url)

    def _client(self, cluster: str, node: int, url: str) -> StreamClient:
        client = StreamClient(node, self.tmp / f"{cluster}-{node}.wal", f"file://{self.tmp}/{cluster}-objects", url,
                              small_config(upload_interval=UPLOAD))
        self.clients.append(client)
        return client

    def meta(self, which: str):
        self.metas.append(open_metadata(self.source_url if which == "source" else self.target_url))
        return self.metas[-1]

    def close(self) -> None:
        for c in self.clients:
            try:
                c.close()
            except S3StreamError:
                pass
        for m in self.metas:
            m.close()


@pytest.fixture
def clusters(tmp_path):
    c = Clusters(tmp_path, f"sqlite:///{tmp_path}/target.db")
    yield c
    c.close()


@pytest.fixture
def clusters_any(tmp_path, metadata_url):
    """Like `clusters`, with the target's metadata on SQLite and on PostgreSQL."""
    c = Clusters(tmp_path, metadata_url)
    yield c
    c.close()


# ---- records with identities -----------------------------------------------------------------------

_serial = iter(range(1 << 40))


def make_batch(rng: random.Random, max_count: int = 40, max_bytes: int = 100_000) -> RecordBatch:
    """A batch of `count` records whose payload names them (record ids), padded to a random size."""
    count = rng.randint(1, max_count)
    ids = b",".join(b"r%d" % next(_serial) for _ in range(count))
    pad = rng.choice((0, 10, 300, 5_000, rng.randint(0, max_bytes)))
    return RecordBatch(ids + b"#" + rng.randbytes(pad), count)


def record_ids(payload) -> list[bytes]:
    return bytes(payload).split(b"#", 1)[0].split(b",")


def produce(partition, rng: random.Random, n: int, **kw) -> list[RecordBatch]:
    batches = [make_batch(rng, **kw) for _ in range(n)]
    for f in [partition.append(b) for b in batches]:
        f.result(30)
    return batches


def read_batches(view, start: int | None = None, end: int | None = None) -> list[tuple[int, int, bytes]]:
    """(base, count, payload) of every batch of a Partition (up to its confirm offset) or a
    PartitionReader (up to its committed end)."""
    if hasattr(view, "log"):
        start = view.log.start_offset if start is None else start
        end = view.log.confirm_offset if end is None else end
    else:
        start = view.start_offset if start is None else start
        end = view.end_offset if end is None else end
    out, position = [], start
    while position < end:
        batches = view.fetch(position, end, 1 << 20).batches
        out += [(b.base_offset, b.count, bytes(b.payload)) for b in batches]
        position = batches[-1].end_offset
    return out


def records_by_offset(batches) -> dict[int, bytes]:
    """offset -> record id, batch-interior offsets included."""
    out = {}
    for base, count, payload in batches:
        ids = record_ids(payload)
        assert len(ids) == count
        out.update({base + i: rid for i, rid in enumerate(ids)})
    return out


def held(client: StreamClient, name: str):
    """The partition `name` as open on `client` (a flow holds its target partition open)."""
    return next(p for p in partitions_on(client) if p.name == name)


def wait_committed(reader, end: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while reader.end_offset < end:
        assert time.monotonic() < deadline, f"committed end stuck at {reader.end_offset} < {end}"
        time.sleep(0.01)


def source_ready(source: StreamClient, partition, timeout: float = 20.0):
    """The source partition's reader once everything appended so far is committed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            reader = read_partition(source, partition.name)
            break
        except S3StreamError:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    wait_committed(reader, partition.log.confirm_offset, timeout)
    return reader


def assert_mirrored_exactly(source_batches, target_batches, offsets: OffsetMap) -> None:
    """Target batches are the source's, batch for batch (count, payload), at base + delta; every
    upstream offset in the mirrored range translates to the offset of the same record."""
    assert [(c, p) for _, c, p in target_batches] == [(c, p) for _, c, p in source_batches]
    for (ub, _, _), (db, _, _) in zip(source_batches, target_batches):
        assert offsets.translate(ub) == db and offsets.upstream_of(db) == ub
    up, down = records_by_offset(source_batches), records_by_offset(target_batches)
    errors = [u for u, rid in up.items() if down.get(offsets.translate(u)) != rid]
    assert errors == [], f"{len(errors)} upstream offsets translate to another record"
    end = source_batches[-1][0] + source_batches[-1][1]
    assert offsets.translate(end) == target_batches[-1][0] + target_batches[-1][1]


# ---- policy ------------------------------------------------------------------------------------------

def test_policy_names_round_trip():
    policy = DefaultReplicationPolicy()
    assert policy.target_name("A", "orders") == "A.orders"
    assert policy.upstream("A.orders") == ("A", "orders")
    assert policy.upstream("orders") is None and policy.upstream(".orders") is None
    assert policy.upstream("B.A.orders") == ("B", "A.orders")
    assert policy.source_chain("B.A.orders") == ["B", "A"]
    assert policy.is_cycle("B", "B.orders") and policy.is_cycle("A", "B.A.orders") and not policy.is_cycle("C", "A.x")
    dunder = DefaultReplicationPolicy("__")
    name = dunder.target_name("east", "orders.v2")
    assert name == "east__orders.v2" and dunder.upstream(name) == ("east", "orders.v2")

    identity = IdentityReplicationPolicy()
    assert identity.target_name("A", "orders") == "orders" and identity.upstream("orders") is None
    assert IdentityReplicationPolicy("A").upstream("orders") == ("A", "orders")

    for bad in ("", "a/b", "x\x00", None, 3):
        with pytest.raises(MirrorNameError) as e:
            policy.target_name("A", bad)
        assert repr(bad) in str(e.value) and "orders-0" in str(e.value)
    with pytest.raises(MirrorNameError, match="contains the separator '.'.*'us_east'"):
        policy.target_name("us.east", "orders")
    with pytest.raises(MirrorNameError):
        DefaultReplicationPolicy("/")
    # The errors are also the engine's argument errors (and ValueErrors).
    with pytest.raises(InvalidArgumentError):
        policy.upstream("")
    with pytest.raises(ValueError):
        identity.target_name("A/B", "orders")


# ---- the offset map ------------------------------------------------------------------------------------

def test_segments_merge_replace_and_refuse():
    assert add_segment([], 10, 0) == [(10, 0)]
    assert add_segment([(10, 0)], 40, 30) == [(10, 0)]                 # same delta: a continuation, merged
    assert add_segment([(10, 0)], 60, 30) == [(10, 0), (60, 30)]       # a gap: upstream [40, 60) skipped
    assert add_segment([(10, 0), (60, 30)], 70, 40) == [(10, 0), (60, 30)]
    # The last segment got no record (downstream unchanged): the new start replaces it ...
    assert add_segment([(10, 0), (60, 30)], 65, 30) == [(10, 0), (65, 30)]
    # ... or merges back into the one before when it continues it.
    assert add_segment([(10, 0), (60, 30)], 40, 30) == [(10, 0)]
    assert add_segment([(10, 5)], 0, 5) == [(0, 5)]
    with pytest.raises(MirrorConflictError, match=r"mirror upstream \[35, 40\) a second time"):
        add_segment([(10, 0)], 35, 30)
    with pytest.raises(MirrorConflictError, match="the target ends at 20, below the start 30"):
        add_segment([(10, 0), (60, 30)], 70, 20)
    with pytest.raises(InvalidArgumentError):
        add_segment([], -1, 0)
    # A resume never grows the map: a thousand restarts, one segment.
    segments = [(7, 3)]
    for end in range(3, 1003):
        segments = add_segment(segments, OffsetMap(segments).resume_position(end), end)
    assert segments == [(7, 3)]


def test_map_translation_hand_computed():
    # Upstream [10, 40) -> downstream [0, 30); a gap: upstream [40, 60) never mirrored;
    # upstream [60, 80) -> downstream [30, 50), the target's end.
    m = OffsetMap([(10, 0), (60, 30)], downstream_end=50)
    assert m.mirrored == (10, 80) and m.upstream_end == 80 and m.downstream_start == 0
    assert [m.translate(u) for u in (10, 13, 39, 40, 60, 61, 75, 80)] == [0, 3, 29, 30, 30, 31, 45, 50]
    for u, why in ((9, "before the flow's first"), (41, "in a gap"), (59, "in a gap"), (81, "not mirrored yet")):
        with pytest.raises(OffsetNotMirroredError, match=why) as e:
            m.translate(u)
        assert e.value.offset == u and e.value.mirrored == (10, 80)
        assert isinstance(e.value, OffsetOutOfRangeError)
    assert m.position(5) == (0, BEFORE_START)
    assert m.position(40) == (30, EXACT) and m.position(45) == (30, GAP)
    assert m.position(70) == (40, EXACT) and m.position(100) == (50, BEYOND_END)
    assert [m.upstream_of(d) for d in (0, 29, 30, 31, 50)] == [10, 39, 60, 61, 80]
    with pytest.raises(OffsetNotMirroredError, match="downstream offset 51"):
        m.upstream_of(51)
    assert m.resume_position(50) == 80 and m.resume_position(35) == 65
    with pytest.raises(MirrorConflictError):
        m.resume_position(29)

    # The target's end inside the first segment: the later segment is not mirrored yet.
    short = OffsetMap([(10, 0), (60, 30)], downstream_end=20)
    assert short.upstream_end == 30 and short.position(70) == (20, BEYOND_END)
    with pytest.raises(OffsetNotMirroredError):
        short.translate(60)
    # A nonzero delta (the target held 5 records before the flow), no end: pure arithmetic.
    assert OffsetMap([(0, 5)]).translate(1_000_000) == 1_000_005
    with pytest.raises(InvalidArgumentError):
        m.translate(1.5)
    with pytest.raises(InvalidArgumentError):
        m.translate(-1)


def test_map_encoding_and_corrupt_values():
    segments = [(10, 0), (60, 30)]
    assert encode_segments(segments) == b"[[10,0],[60,30]]"
    assert decode_segments(encode_segments(segments)) == segments
    for bad in (b"not json", b"{}", b"[[1]]", b"[[1, -2]]", b"[[1, true]]", b"[[10, 0], [20, 30]]",
                b"[[10, 0], [60, 0]]"):
        with pytest.raises(CorruptDataError, match="mirror/x/map/y"):
            decode_segments(bad, "mirror/x/map/y")


# ---- flows ---------------------------------------------------------------------------------------------

def test_flow_copies_batches_exactly(clusters_any):
    """Varied batches (1-40 records, 0-100 KB), some before the flow starts and some while it
    runs, into a target partition that already held 5 records of its own: batch for batch, every
    offset translating exactly, memory bounded."""
    rng = random.Random(1)
    source, target = clusters_any.source(), clusters_any.target()
    own = open_partition(target, "A.orders")
    for _ in range(5):
        own.append(RecordBatch(b"local#", 1)).result(10)
    own.close()
    orders = open_partition(source, "orders")
    produce(orders, rng, 150)
    source_ready(source, orders)
    flow = MirrorFlow(source, target, "orders", "A.orders", FLOW, source_alias="A", max_in_flight_bytes=256 << 10,
                      fetch_bytes=128 << 10).start()
    produce(orders, rng, 150)                 # while the flow runs
    reader = source_ready(source, orders)
    assert flow.wait_position(reader.end_offset, 30)
    metrics = flow.metrics()
    source_batches = read_batches(reader)
    target_batches = read_batches(held(target, "A.orders"), start=5)
    assert_mirrored_exactly(source_batches, target_batches, flow.offset_map())
    assert flow.offset_map().segments == ((0, 5),)
    assert metrics.records == reader.end_offset and metrics.batches == 300
    assert metrics.bytes == sum(len(p) for _, _, p in source_batches)
    assert metrics.lag_records == 0 and metrics.source_end == reader.end_offset
    assert metrics.upstream_position == reader.end_offset and metrics.downstream_position == reader.end_offset + 5
    assert metrics.last_append_latency is not None and metrics.last_append_latency < 10
    assert metrics.mirrored_as_of is not None and metrics.error is None and metrics.state == "running"
    # Bounded: never more than the budget in flight, plus one batch when alone.
    assert 0 < metrics.peak_in_flight_bytes <= (256 << 10) + (128 << 10)
    final = flow.stop()
    assert final.state == "stopped"
    # Stopping released the partition: its records are committed and readable from anywhere.
    state = load_flow(clusters_any.meta("target"), FLOW)
    assert state.source_alias == "A" and state.segments == {"A.orders": [(0, 5)]}
    assert state.partitions["A.orders"].source_partition == "orders"
    committed = read_partition(target, "A.orders")
    assert committed.end_offset == reader.end_offset + 5
    assert read_batches(committed, start=5) == target_batches


def test_resume_after_stop_and_handover_to_another_node(clusters):
    """A flow stopped mid-way and continued by another node of the target cluster copies every
    record once; the map stays one segment; a configured start inside a batch rounds down to it."""
    rng = random.Random(2)
    source, target1, target2 = clusters.source(), clusters.target(1), clusters.target(2)
    orders = open_partition(source, "orders")
    batches = produce(orders, rng, 400, max_bytes=2_000)
    reader = source_ready(source, orders)
    source_batches = read_batches(reader)
    interior = source_batches[3][0] + 1 if source_batches[3][1] > 1 else source_batches[3][0]
    first = MirrorFlow(source, target1, "orders", "A.orders", FLOW, source_alias="A", start_offset=interior,
                       fetch_bytes=4_096, max_in_flight_bytes=8_192).start()
    assert first.offset_map().segments == ((source_batches[3][0], 0),)
    assert first.wait_position(source_batches[200][0], 30)
    stopped = first.stop()
    assert stopped.state == "stopped" and stopped.upstream_position >= source_batches[200][0]
    # Node 1 let go of the partition: node 2 takes the flow over.
    produce(orders, rng, 50, max_bytes=2_000)
    reader = source_ready(source, orders)
    second = MirrorFlow(source, target2, "orders", "A.orders", FLOW, source_alias="A",
                        start_offset=0).start()          # start_offset is ignored on resume
    assert second.offset_map().segments == ((source_batches[3][0], 0),)
    # It resumed where the first stopped (one segment, copied exactly once below); its thread
    # may already have moved on by the time metrics() reads the position.
    assert second.metrics().upstream_position >= stopped.upstream_position
    assert second.wait_caught_up(30)
    target_batches = read_batches(held(target2, "A.orders"))
    assert_mirrored_exactly(read_batches(reader, start=source_batches[3][0]), target_batches, second.offset_map())
    assert len(target_batches) == len(batches) + 50 - 3
    # While node 2 holds it, node 1 cannot start the flow: the engine refuses a second writer.
    with pytest.raises(StreamNotClosedError):
        MirrorFlow(source, target1, "orders", "A.orders", FLOW, source_alias="A").start()
    second.stop()


def test_flow_waits_for_its_source_and_stops_promptly(clusters):
    """A flow started before its source partition exists waits for it (no error, lag unknown),
    copies it once it appears, and stop() returns promptly while it polls."""
    rng = random.Random(7)
    source, target = clusters.source(), clusters.target()
    flow = MirrorFlow(source, target, "later", "A.later", FLOW, source_alias="A", poll_interval=0.01).start()
    time.sleep(0.05)
    m = flow.metrics()
    assert m.state == "running" and m.source_end is None and m.lag_records is None and m.upstream_position == 0
    later = open_partition(source, "later")
    produce(later, rng, 30, max_count=4, max_bytes=1_000)
    reader = source_ready(source, later)
    assert flow.wait_position(reader.end_offset, 20)
    assert_mirrored_exactly(read_batches(reader), read_batches(held(target, "A.later")), flow.offset_map())
    t0 = time.monotonic()
    flow.stop(timeout=5)
    assert time.monotonic() - t0 < 5
    with pytest.raises(MirrorError, match="stopped at upstream"):
        flow.wait_position(reader.end_offset + 1, 5)


def test_source_retention_gap(clusters):
    """The source trims records the stopped flow had not mirrored: the restart fails with
    SourceTrimmedError, appending nothing; with skip_trimmed it records a gap segment, and the
    map translates around it."""
    rng = random.Random(3)
    source, target = clusters.source(), clusters.target()
    orders = open_partition(source, "orders")
    produce(orders, rng, 20, max_count=5, max_bytes=500)
    source_ready(source, orders)
    flow = MirrorFlow(source, target, "orders", "A.orders", FLOW, source_alias="A").start()
    assert flow.wait_caught_up(20)
    mirrored_end = flow.stop().upstream_position
    produce(orders, rng, 20, max_count=5, max_bytes=500)
    before = read_batches(source_ready(source, orders))
    trim_at = next(b for b, _, _ in before if b > mirrored_end + 10)
    orders.log.trim(trim_at)
    failing = MirrorFlow(source, target, "orders", "A.orders", FLOW, source_alias="A")
    with pytest.raises(SourceTrimmedError, match=f"no longer holds upstream \\[{mirrored_end}, {trim_at}\\)") as e:
        failing.start()
    assert (e.value.position, e.value.source_start) == (mirrored_end, trim_at)
    assert failing.metrics().state == "failed" and failing.metrics().records == 0

    skipping = MirrorFlow(source, target, "orders", "A.orders", FLOW, source_alias="A", skip_trimmed=True).start()
    assert skipping.wait_caught_up(20)
    m = skipping.offset_map()
    assert m.segments == ((0, 0), (trim_at, mirrored_end))
    assert m.translate(mirrored_end) == mirrored_end and m.translate(trim_at) == mirrored_end
    with pytest.raises(OffsetNotMirroredError, match="in a gap"):
        m.translate(mirrored_end + 1)
    assert m.position(mirrored_end + 1) == (mirrored_end, GAP)
    target_batches = read_batches(held(target, "A.orders"))
    kept = [b for b in before if b[0] < mirrored_end or b[0] >= trim_at]
    assert [(c, p) for _, c, p in target_batches] == [(c, p) for _, c, p in kept]
    assert skipping.stop().segments == 2


class GatedSource:
    """A source client whose partitions stay unreadable until `open` is set: a flow's copy loop
    then meets the source's state only after the test has arranged it."""

    def __init__(self, client: StreamClient) -> None:
        self.client = client
        self.open = threading.Event()

    @property
    def metadata(self):
        return self.client.metadata

    def check_usable(self) -> None:
        """Called first by read_partition: while gated, no partition is readable."""
        if not self.open.is_set():
            raise StreamNotFoundError("the source's partitions are gated")
        self.client.check_usable()

    def fetch_committed(self, *args, **kw):
        return self.client.fetch_committed(*args, **kw)


@pytest.mark.parametrize("skip_trimmed", [False, True])
def test_source_trimmed_while_running(clusters, skip_trimmed):
    """Retention removes records the running flow has not reached: it fails with
    SourceTrimmedError, or with skip_trimmed continues after the gap (here the segment that got
    no record is replaced by the one after the gap)."""
    rng = random.Random(8)
    real, target = clusters.source(), clusters.target()
    gated = GatedSource(real)
    flow = MirrorFlow(gated, target, "orders", "A.orders", FLOW, source_alias="A", poll_interval=0.01,
                      skip_trimmed=skip_trimmed).start()
    assert flow.offset_map().segments == ((0, 0),)
    orders = open_partition(real, "orders")
    produce(orders, rng, 20, max_count=5, max_bytes=500)
    batches = read_batches(source_ready(real, orders))
    trim_at = batches[5][0]
    orders.log.trim(trim_at)
    gated.open.set()
    if not skip_trimmed:
        with pytest.raises(SourceTrimmedError, match=f"\\[0, {trim_at}\\)"):
            flow.wait_caught_up(20)
        assert flow.metrics().state == "failed"
        flow.stop()
        return
    assert flow.wait_caught_up(20)
    assert flow.offset_map().segments == ((trim_at, 0),)
    assert_mirrored_exactly(batches[5:], read_batches(held(target, "A.orders")), flow.offset_map())
    flow.stop()


def test_bad_input_and_conflicts(clusters):
    rng = random.Random(4)
    source, target = clusters.source(), clusters.target()
    orders = open_partition(source, "orders")
    produce(orders, rng, 10, max_count=3, max_bytes=200)
    reader = source_ready(source, orders)
    kw = dict(source_alias="A")
    with pytest.raises(MirrorNameError, match="flow id must be .* got 'a/b'"):
        MirrorFlow(source, target, "orders", "A.orders", "a/b", **kw)
    with pytest.raises(MirrorNameError, match="target partition"):
        MirrorFlow(source, target, "orders", "", FLOW, **kw)
    with pytest.raises(MirrorNameError, match="into itself"):
        MirrorFlow(source, source, "orders", "orders", FLOW, **kw)
    with pytest.raises(InvalidArgumentError, match="max_in_flight_bytes"):
        MirrorFlow(source, target, "orders", "A.orders", FLOW, max_in_flight_bytes=0, **kw)
    with pytest.raises(InvalidArgumentError, match="poll_interval"):
        MirrorFlow(source, target, "orders", "A.orders", FLOW, poll_interval=0, **kw)
    with pytest.raises(MirrorNameError, match="cycle|back there"):
        MirrorFlow.for_source(source, target, "B.orders", FLOW, source_alias="A", target_alias="B")
    with pytest.raises(OffsetOutOfRangeError, match=f"start_offset 999 is outside .* \\[0, {reader.end_offset}\\]"):
        MirrorFlow(source, target, "orders", "A.orders", FLOW, start_offset=999, **kw).start()

    # The target partition already has a writer on this node.
    producer = open_partition(target, "A.orders")
    with pytest.raises(MirrorConflictError, match="already open on node 1"):
        MirrorFlow(source, target, "orders", "A.orders", FLOW, **kw).start()
    producer.close()

    flow = MirrorFlow.for_source(source, target, "orders", FLOW, source_alias="A").start()
    assert flow.target_partition == "A.orders" and flow.key == (FLOW, "A.orders")
    assert flow.wait_caught_up(20)
    with pytest.raises(MirrorError, match="was started already"):
        flow.start()
    flow.stop()
    # Another source under the same flow id, or another source partition into the same target.
    with pytest.raises(MirrorConflictError, match="copies from source alias 'A'.*not 'C'"):
        MirrorFlow(source, target, "orders", "C.orders", FLOW, source_alias="C").start()
    with pytest.raises(MirrorConflictError, match="already mirrors source partition 'orders'"):
        MirrorFlow(source, target, "payments", "A.orders", FLOW, **kw).start()
    # Something else wrote the target while the flow was stopped: the resume refuses.
    intruder = open_partition(target, "A.orders")
    intruder.append(RecordBatch(b"intruder#", 1)).result(10)
    intruder.close()
    with pytest.raises(MirrorConflictError, match="something else wrote the target"):
        MirrorFlow(source, target, "orders", "A.orders", FLOW, **kw).start()
    # A map that was tampered with.
    meta = clusters.meta("target")
    meta.put_kv(map_key(FLOW, "A.orders"), b"[[5, 0], [3, 1]]")
    with pytest.raises(CorruptDataError, match="does not follow"):
        MirrorFlow(source, target, "orders", "A.orders", FLOW, **kw).start()
    # Every refusal left the target partition free to open again.
    open_partition(target, "A.orders").close()


# ---- checkpoints ---------------------------------------------------------------------------------------

def test_checkpoints_translate_exactly(clusters_any):
    """Source groups commit at batch starts, inside batches, at the mirrored end and beyond it;
    after a sync the target groups hold the exact translations (clamped beyond the mirrored end),
    and a consumer resuming on the target reads exactly the records after its source offset.
    Target offsets never move back; a group whose consumers joined on the target is theirs."""
    rng = random.Random(5)
    source, target = clusters_any.source(), clusters_any.target()
    own = open_partition(target, "A.orders")            # 7 local records: translation is not the identity
    for _ in range(7):
        own.append(RecordBatch(b"local#", 1)).result(10)
    own.close()
    orders, payments = open_partition(source, "orders"), open_partition(source, "payments")
    produce(orders, rng, 60, max_count=9, max_bytes=300)
    produce(payments, rng, 5, max_count=3, max_bytes=100)
    reader = source_ready(source, orders)
    flow = MirrorFlow(source, target, "orders", "A.orders", FLOW, source_alias="A").start()
    assert flow.wait_caught_up(20)
    flow.stop()                                          # uploads: the target's committed end is the mirrored end
    mirrored_end = reader.end_offset
    produce(orders, rng, 10, max_count=9, max_bytes=300)  # committed on the source, not mirrored
    reader = source_ready(source, orders)
    source_batches = read_batches(reader)
    up = records_by_offset(source_batches)
    target_batches = read_batches(read_partition(target, "A.orders"))
    down = records_by_offset(target_batches)
    where = {rid: d for d, rid in down.items() if rid != b"local"}

    source_meta, target_meta = clusters_any.meta("source"), clusters_any.meta("target")
    src_groups, tgt_groups = ConsumerGroups(source_meta), ConsumerGroups(target_meta)
    interior = next(b + 2 for b, c, _ in source_batches if c > 3)
    beyond = reader.end_offset - 1
    wanted = {"g-start": source_batches[10][0], "g-interior": interior, "g-end": mirrored_end, "g-beyond": beyond,
              "g-zero": 0}
    for group, offset in wanted.items():
        generation = src_groups.join(group, "consumer-1")
        src_groups.commit(group, "orders", offset, generation)
        src_groups.commit(group, "payments", 2, generation)

    report = sync_checkpoints(source_meta, target_meta, FLOW, DefaultReplicationPolicy())
    assert report.skipped_groups == {}
    for group, offset in wanted.items():
        entry = report.entry(group, "orders")
        expected = where[up[offset]] if offset < mirrored_end else 7 + mirrored_end
        assert entry.downstream == expected == tgt_groups.committed(group, "A.orders"), group
        assert entry.status == (BEYOND_END if offset > mirrored_end else EXACT) and entry.committed
        assert entry.target_partition == "A.orders" and entry.upstream == offset
        # The consumer resumes on the target: exactly the source records from its offset on
        # (up to what is mirrored), none skipped, none twice.
        resumed = [down[d] for d in sorted(down) if d >= expected]
        assert resumed == [up[u] for u in sorted(up) if offset <= u < mirrored_end]
        assert report.entry(group, "payments").status == NOT_MIRRORED
    assert tgt_groups.generation("g-start") == 1
    raw = json.loads(target_meta.get_kv("consumer/g-interior/offsets/A.orders"))
    assert json.loads(raw["metadata"]) == {"mirror": FLOW, "source_partition": "orders", "upstream": interior,
                                           "status": EXACT}

    # Idempotent: a second sync changes nothing and joins no new generation.
    again = sync_checkpoints(source_meta, target_meta, FLOW, DefaultReplicationPolicy())
    assert again.committed == 0 and tgt_groups.generation("g-start") == 1

    # Once the rest is mirrored, the clamped group becomes exact.
    resumed_flow = MirrorFlow(source, target, "orders", "A.orders", FLOW, source_alias="A").start()
    assert resumed_flow.wait_caught_up(20)
    resumed_flow.stop()
    down = records_by_offset(read_batches(read_partition(target, "A.orders")))
    where = {rid: d for d, rid in down.items() if rid != b"local"}
    report = sync_checkpoints(source_meta, target_meta, FLOW)
    assert report.entry("g-beyond", "orders").status == EXACT
    assert tgt_groups.committed("g-beyond", "A.orders") == where[up[beyond]]

    # A rewind on the source does not move the target back, unless asked to follow.
    generation = src_groups.join("g-start", "consumer-2")
    src_groups.commit("g-start", "orders", 1, generation, allow_rewind=True)
    before = tgt_groups.committed("g-start", "A.orders")
    report = sync_checkpoints(source_meta, target_meta, FLOW)
    assert report.entry("g-start", "orders").status == REWIND_KEPT
    assert tgt_groups.committed("g-start", "A.orders") == before
    sync_checkpoints(source_meta, target_meta, FLOW, groups=["g-start"], follow_rewinds=True)
    assert tgt_groups.committed("g-start", "A.orders") == where[up[1]] < before

    # The group's consumers fail over and join on the target: the checkpointer leaves it alone.
    target_generation = tgt_groups.join("g-end", "consumer-on-b")
    tgt_groups.commit("g-end", "A.orders", where[up[mirrored_end]] + 1, target_generation)
    src_groups.commit("g-end", "orders", beyond + 1, src_groups.generation("g-end"))
    report = sync_checkpoints(source_meta, target_meta, FLOW)
    assert "consumer-on-b" in report.skipped_groups["g-end"]
    assert tgt_groups.generation("g-end") == target_generation       # not fenced by the mirror
    assert tgt_groups.committed("g-end", "A.orders") == where[up[mirrored_end]] + 1

    # Another policy than the flow's names other partitions: reported, nothing committed.
    report = sync_checkpoints(source_meta, target_meta, FLOW, IdentityReplicationPolicy(), groups=["g-zero"])
    assert report.entry("g-zero", "orders").status == POLICY_MISMATCH and report.committed == 0
    with pytest.raises(MirrorError, match="flow 'nope' has no records"):
        sync_checkpoints(source_meta, target_meta, "nope", DefaultReplicationPolicy())


class JoinBeforeFirstCommit:
    """The target's metadata, where `member` joins group `group` just before the checkpointer's
    first offset commit lands (a race injected at the worst moment)."""

    def __init__(self, inner, group: str, member: str) -> None:
        self.inner, self.group, self.member, self.done = inner, group, member, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def replace_kv(self, key, expected, value, guard=None):
        if "/offsets/" in key and not self.done:
            self.done = True
            ConsumerGroups(self.inner).join(self.group, self.member)
        return self.inner.replace_kv(key, expected, value, guard)


def test_checkpointers_of_two_flows_share_a_group(clusters):
    """Flows from two sources into one target sync the same group without fencing each other,
    even when one joins during the other's commit; a consumer joining then ends the sync of it."""
    rng = random.Random(9)
    source, target = clusters.source(), clusters.target()
    orders, payments = open_partition(source, "orders"), open_partition(source, "payments")
    produce(orders, rng, 10, max_count=4, max_bytes=100)
    produce(payments, rng, 10, max_count=4, max_bytes=100)
    source_ready(source, orders)
    source_ready(source, payments)
    for flow in (MirrorFlow(source, target, "orders", "A.orders", "A-to-B", source_alias="A").start(),
                 MirrorFlow(source, target, "payments", "C.payments", "C-to-B", source_alias="C").start()):
        assert flow.wait_caught_up(20)
        flow.stop()
    source_meta, target_meta = clusters.meta("source"), clusters.meta("target")
    src, tgt = ConsumerGroups(source_meta), ConsumerGroups(target_meta)
    for group in ("g", "h"):
        generation = src.join(group, "consumer-1")
        src.commit(group, "orders", 3, generation)
        src.commit(group, "payments", 4, generation)
    racing = JoinBeforeFirstCommit(target_meta, "g", "mirror-C-to-B")
    report = sync_checkpoints(source_meta, racing, "A-to-B", groups=["g"])
    assert report.skipped_groups == {} and report.entry("g", "orders").committed
    assert tgt.generation("g") == 2 and tgt.committed("g", "A.orders") == 3     # retried with C's generation
    report = sync_checkpoints(source_meta, target_meta, "C-to-B", groups=["g"])
    assert report.entry("g", "payments").committed and report.entry("g", "orders").status == NOT_MIRRORED
    assert tgt.generation("g") == 2 and tgt.committed("g", "C.payments") == 4

    consumer = JoinBeforeFirstCommit(target_meta, "h", "consumer-on-b")
    report = sync_checkpoints(source_meta, consumer, "A-to-B", groups=["h"])
    assert "consumer-on-b" in report.skipped_groups["h"] and report.entries == []
    assert tgt.committed("h", "A.orders") is None and tgt.generation("h") == 2


# ---- heartbeats ----------------------------------------------------------------------------------------

def test_heartbeats_latest_per_source(clusters):
    rng = random.Random(6)
    source, target = clusters.source(), clusters.target()
    orders, payments = open_partition(source, "orders"), open_partition(source, "payments")
    produce(orders, rng, 10, max_count=3, max_bytes=100)
    produce(payments, rng, 10, max_count=3, max_bytes=100)
    source_ready(source, orders)
    source_ready(source, payments)
    flows = [MirrorFlow(source, target, "orders", "A.orders", FLOW, source_alias="A").start(),
             MirrorFlow(source, target, "payments", "C.payments", "C-to-B", source_alias="C").start()]
    for f in flows:
        assert f.wait_caught_up(20)
    now = [1000.0]
    beater = Heartbeater(target, flows, target_alias="B", retain_records=4, clock=lambda: now[0])
    assert latest_heartbeats(target) == {}
    for i in range(8):
        now[0] = 1000.0 + i
        written = beater.beat()
    assert [(h.source, h.target, h.at, h.flows, h.lag_records) for h in written] == [
        ("A", "B", 1007.0, 1, 0), ("C", "B", 1007.0, 1, 0)]
    latest = latest_heartbeats(target)
    assert set(latest) == {"A", "C"} and latest["A"].at == 1007.0 and latest["A"].offset == written[0].offset
    assert 0 < latest["A"].mirrored_as_of <= time.time()
    assert latest["A"].age(1010.0) == 3.0
    hb_partition = next(p for p in partitions_on(target) if p.name == "heartbeats")
    assert hb_partition.log.start_offset > 0                          # kept bounded (retain_records)
    assert replication_latency(target, now=latest["C"].mirrored_as_of + 2.5)["C"] == pytest.approx(2.5)

    # In the background; then read from another node of the target, once uploaded.
    background = Heartbeater(target, lambda: flows[:1], target_alias="B", interval=0.02).start()
    deadline = time.monotonic() + 10
    while background.beats < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    background.stop()
    beater.stop()
    assert not any(p.name == "heartbeats" for p in partitions_on(target))     # released
    other = clusters.target(2)
    latest = latest_heartbeats(other)
    assert latest["A"].at > 1007.0 and latest["C"].at == 1007.0
    for f in flows:
        f.stop()
    with pytest.raises(InvalidArgumentError, match="interval"):
        Heartbeater(target, [], interval=0)


def test_an_idempotent_producers_batches_are_copied_across_a_retention_gap(clusters):
    """A source partition written by an idempotent producer, whose first batches retention
    removes before the flow reaches them: the target takes every copy as it is (a copy's producer
    is the source cluster's: its id may be one of the target's own producers', and the skipped
    batches would look like lost sequences to the target's producer checks), and stores each Kafka batch with its target offset in its header,
    as a broker does (kafka-python reads them)."""
    from kafka.record.default_records import DefaultRecordBatch
    from s3stream import Record, new_producer
    source, target = clusters.source(), clusters.target()
    own = open_partition(target, "A.orders")
    # The target's own producer: ids are per cluster, so it has the source producer's id.
    local = new_producer(target)
    own.append(local.batch("A.orders", [Record(value=b"local")])).result(10)
    own.close()
    orders = open_partition(source, "orders")
    producer = new_producer(source)
    assert producer.producer_id == local.producer_id
    for i in range(30):
        orders.append(producer.batch("orders", [Record(value=b"v%d-%d" % (i, j)) for j in range(3)])).result(10)
    before = read_batches(source_ready(source, orders))
    orders.log.trim(before[10][0])                          # the first ten batches are gone
    flow = MirrorFlow(source, target, "orders", "A.orders", FLOW, source_alias="A", skip_trimmed=True).start()
    assert flow.wait_caught_up(20)
    assert flow.metrics().error is None
    copied = read_batches(held(target, "A.orders"), start=1)
    flow.stop()
    assert [p for _, _, p in copied] != [] and len(copied) == 20
    for base, count, payload in copied:
        header = DefaultRecordBatch(bytearray(payload))
        assert header.base_offset == base and count == 3
        assert header.producer_id == producer.producer_id
