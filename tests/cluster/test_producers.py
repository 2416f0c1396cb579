"""Idempotent producers (issue 29; s3stream.records.producers): a retried batch is taken once and
answers its original offset, across moves and a kill -9; a gap and an old epoch are refused with
their own errors and append nothing."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from s3stream import (DuplicateSequenceError, NotIdempotentError, OutOfOrderSequenceError, ProducedBatch, ProducerFencedError,
                      Record, RecordBatch, StreamClient, InvalidArgumentError, new_producer)
from s3stream.cluster import open_partition, partition as P
from s3stream.records.producers import ProducerTable, producer_header

from conftest import small_config

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def node(tmp_path, n, meta="meta.db"):
    return StreamClient(n, tmp_path / f"n{n}.wal", f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/{meta}",
                        small_config())


def values(partition, end=None):
    out = []
    pos, end = 0, partition.log.next_offset if end is None else end
    while pos < end:
        batches = partition.fetch(pos, end).batches
        for b in batches:
            out += [r.value for r in b.records()]
        pos = batches[-1].end_offset
    return out


def test_a_retry_answers_the_original_offset_a_gap_and_an_old_epoch_append_nothing(tmp_path):
    one = node(tmp_path, 1)
    try:
        p = open_partition(one, "p")
        producer = new_producer(one)
        assert new_producer(one).producer_id == producer.producer_id + 1      # ids come from metadata
        first = producer.batch("p", [Record(value=b"a"), Record(value=b"b")])
        assert p.append(first).result(5).base_offset == 0
        p.append_records([Record(value=b"plain")]).result(5)                 # a plain batch between
        assert p.append(first).result(5).base_offset == 0                   # the answer was lost: retried
        second = producer.batch("p", [Record(value=b"c")])
        skipped = producer.batch("p", [Record(value=b"d")])
        third = producer.batch("p", [Record(value=b"e")])
        assert p.append(second).result(5).base_offset == 3
        end = p.log.next_offset
        with pytest.raises(OutOfOrderSequenceError, match="expects 3"):
            p.append(third)
        assert p.log.next_offset == end
        assert [p.append(b).result(5).base_offset for b in (skipped, third, skipped)] == [4, 5, 4]
        with pytest.raises(InvalidArgumentError, match="built for partition 'q'"):
            p.append(producer.batch("q", [Record(value=b"x")]))
        newer = new_producer(one, producer.producer_id)
        assert newer.epoch == producer.epoch + 1
        with pytest.raises(OutOfOrderSequenceError, match="starts at sequence 0"):
            p.append(P.ProducedBatch.of(third.payload, 1, "p", newer.producer_id, newer.epoch, 7))
        assert p.append_records([Record(value=b"f")], producer=newer).result(5).base_offset == 6
        with pytest.raises(ProducerFencedError, match="epoch 1 of it appended since"):
            p.append(producer.batch("p", [Record(value=b"zombie")]))
        assert p.log.next_offset == 7
        assert values(p)[:2] == [b"a", b"b"] and values(p)[3:] == [b"c", b"d", b"e", b"f"]
        with pytest.raises(InvalidArgumentError, match="never allocated"):
            new_producer(one, 999)
    finally:
        one.close()


@pytest.mark.parametrize("hinted", [True, False])
def test_the_table_moves_with_the_partition(tmp_path, hinted):
    one, two = node(tmp_path, 1), node(tmp_path, 2)
    try:
        p = open_partition(one, "p")
        producer = new_producer(one)
        batches = [producer.batch("p", [Record(value=b"%d" % i)]) for i in range(8)]
        offsets = [p.append(b).result(5).base_offset for b in batches]
        p.close(timeout=10, record={"version": 1})
        q = open_partition(two, "p", hinted=hinted)
        # The last RECENT batches are known to the new owner: retries answer their offsets.
        assert [q.append(b).result(5).base_offset for b in batches[-5:]] == offsets[-5:]
        with pytest.raises(DuplicateSequenceError, match="took them already"):
            q.append(batches[0])                     # too old to be answered: not appended again
        assert q.append(producer.batch("p", [Record(value=b"next")])).result(5).base_offset == 8
        assert q.log.next_offset == 9
    finally:
        one.close()
        two.close()


CHILD = textwrap.dedent("""
    import sys, json
    sys.path.insert(0, {tests!r})
    from s3stream.cluster import open_partition
    from s3stream import StreamClient, Record, new_producer
    from s3stream.cluster import partition as P
    from conftest import small_config
    P.SNAPSHOT_BYTES = {snapshot_bytes}
    tmp = {tmp!r}
    c = StreamClient(1, tmp + "/n1.wal", "file://" + tmp + "/objects", "sqlite:///" + tmp + "/meta.db", small_config())
    p = open_partition(c, "p")
    producer = new_producer(c)
    for i in range({count}):
        b = producer.batch("p", [Record(value=b"v%d" % i)] * (1 + i % 3))
        off = p.append(b).result(10).base_offset
        print(json.dumps([i, off, b.payload.hex(), b.count, b.base_sequence]), flush=True)
    print("done", flush=True)
    sys.stdin.read()
""")


@pytest.mark.parametrize("snapshot_bytes", [1 << 30, 600])
def test_the_table_survives_a_kill_9(tmp_path, snapshot_bytes):
    """Node 1 appends producers' batches and is SIGKILLed; restarted, it opens the partition
    again (its last checkpoint is not a close's: the table is read back from the log) and
    every retry answers its original offset. With small snapshots, several were written and
    the read back starts at the newest."""
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(tests=HERE, tmp=str(tmp_path), count=40,
                                                                   snapshot_bytes=snapshot_bytes)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    acked = []
    for line in child.stdout:
        if line.strip() == "done":
            break
        acked.append(json.loads(line))
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert len(acked) == 40
    from s3stream.records.producers import ProducedBatch
    one = node(tmp_path, 1)
    try:
        read_back: list = []
        real = P._read_back_producers
        P._read_back_producers = lambda log, start, table: (read_back.append(start), real(log, start, table))[1]
        try:
            p = open_partition(one, "p")
        finally:
            P._read_back_producers = real
        end = p.log.next_offset
        assert read_back, "the open after the crash read the table back from the log"
        if snapshot_bytes < 1 << 20:
            assert read_back[0] > 0                   # from the newest snapshot, not the open's
        pid = next(iter(p.producers.snapshot()))
        for i, off, payload, count, seq in acked[-5:]:
            batch = ProducedBatch.of(bytes.fromhex(payload), count, "p", int(pid), 0, seq)
            assert p.append(batch).result(5).base_offset == off
        assert p.log.next_offset == end
    finally:
        one.close()


def test_an_old_retry_is_a_duplicate_a_gap_is_out_of_order(tmp_path):
    """Issue 50, item 9: a retry older than the batches a partition answers was said to have
    lost batches between, though it is stored: it is DuplicateSequenceError (an
    OutOfOrderSequenceError), naming where it lies; a gap stays OutOfOrderSequenceError."""
    one = node(tmp_path, 1)
    try:
        p = open_partition(one, "p")
        producer = new_producer(one)
        batches = [producer.batch("p", [Record(value=b"%d" % i)] * 2) for i in range(8)]
        offsets = [p.append(b).result(5).base_offset for b in batches]
        end = p.log.next_offset
        with pytest.raises(DuplicateSequenceError) as e:
            p.append(batches[1])
        assert f"sent sequences 2-3 to partition 'p' again: it took them already (it expects 16 next)" in str(e.value)
        assert f"the batch is in the log before offset {offsets[3]}" in str(e.value) and "lost" not in str(e.value)
        producer.batch("p", [Record(value=b"never sent")])
        with pytest.raises(OutOfOrderSequenceError, match="lost or never sent") as gap:
            p.append(producer.batch("p", [Record(value=b"after a gap")]))
        assert not isinstance(gap.value, DuplicateSequenceError)
        assert p.log.next_offset == end
    finally:
        one.close()


def test_sequences_before_the_expected_one_wrap_as_sequences_do():
    from s3stream.records.producers import MAX_SEQUENCE
    table = ProducerTable()
    table.record(7, 0, MAX_SEQUENCE - 9, 10, 100)            # sequences MAX-9 .. MAX: next is 0
    table.record(7, 0, 0, 10, 110)
    for offset in range(120, 170, 10):                       # five more: the first two fall out of RECENT
        table.record(7, 0, (offset - 110), 10, offset)
    with pytest.raises(DuplicateSequenceError):
        table.check(7, 0, MAX_SEQUENCE - 9, 10, "p")          # before the wrap, taken
    with pytest.raises(DuplicateSequenceError):
        table.check(7, 0, 0, 10, "p")
    with pytest.raises(OutOfOrderSequenceError) as ahead:
        table.check(7, 0, 70, 10, "p")                       # expects 60: a gap
    assert not isinstance(ahead.value, DuplicateSequenceError)
    assert table.check(7, 0, 60, 10, "p") is None


# ---- a batch kept for a retry (issue 50, item 2) ---------------------------------------------------

def test_a_produced_batch_stays_one_pickled_or_copied_and_shows_its_producer():
    import copy
    import pickle
    batch = ProducedBatch.of(encode_with_producer(7, 2, 40, 3), 3, "orders", 7, 2, 40)
    for kept in (pickle.loads(pickle.dumps(batch)), copy.copy(batch), copy.deepcopy(batch)):
        assert type(kept) is ProducedBatch and kept == batch and kept.kafka
        assert (kept.partition, kept.producer_id, kept.epoch, kept.base_sequence) == ("orders", 7, 2, 40)
    assert repr(batch).startswith("ProducedBatch(partition='orders', producer_id=7, epoch=2, base_sequence=40, count=3")


def encode_with_producer(producer_id, epoch, sequence, count, value=b"x"):
    from s3stream.records import encode_batch
    return encode_batch([Record(value=value)] * count, producer_id=producer_id, producer_epoch=epoch,
                        base_sequence=sequence)


def test_a_plain_batch_whose_header_names_a_producer_is_taken_once(tmp_path):
    """As a Kafka broker reads a batch's producer from its header, a partition takes a plain
    RecordBatch carrying a producer's batch idempotently (a ProducedBatch kept as bytes, another
    client's batch); a mirror's copy (copied=True) is appended as it is; bytes stay bytes."""
    one = node(tmp_path, 1)
    try:
        p = open_partition(one, "p")
        producer = new_producer(one)
        first = producer.batch("p", [Record(value=b"a"), Record(value=b"b")])
        assert p.append(first).result(5).base_offset == 0
        as_bytes = RecordBatch(bytes(first.payload), first.count)
        assert p.append(as_bytes).result(5).base_offset == 0                     # its retry, as bytes
        other = RecordBatch(encode_with_producer(9999, 0, 0, 2), 2)              # another client's
        assert [p.append(other).result(5).base_offset for _ in range(2)] == [2, 2]
        with pytest.raises(OutOfOrderSequenceError):
            p.append(RecordBatch(encode_with_producer(9999, 0, 5, 1), 1))
        assert p.append(first, copied=True).result(5).base_offset == 4           # a copy: no check
        assert p.append(RecordBatch(b"x" * 100, 1)).result(5).base_offset == 6
        assert p.log.next_offset == 7
        assert p.producers.check(9999, 0, 2, 1, "p") is None                      # it continues at 2
    finally:
        one.close()


def test_a_stream_refuses_a_produced_batch_naming_its_partition(tmp_path):
    """A stream keeps no producer sequences: Stream.append of a ProducedBatch would append it
    again on each retry, so it is refused (NotIdempotentError), nothing appended."""
    one = node(tmp_path, 1)
    try:
        s = one.create_stream()
        batch = new_producer(one).batch("orders", [Record(value=b"a")])
        for append in (s.append, lambda b: s.append_many([RecordBatch(b"fine"), b])):
            with pytest.raises(NotIdempotentError, match=r"append it to its partition, s3stream.cluster.open_partition\(client, 'orders'\)"):
                append(batch)
        assert s.next_offset == 1                                                # the batch before it only
        p = open_partition(one, "orders")
        assert [p.append(batch).result(5).base_offset for _ in range(2)] == [0, 0]
    finally:
        one.close()


RETRY_CHILD = textwrap.dedent("""
    import sys, json, pickle
    sys.path.insert(0, {tests!r})
    from s3stream.cluster import open_partition
    from s3stream import StreamClient, Record, new_producer
    from conftest import small_config
    tmp = {tmp!r}
    c = StreamClient(1, tmp + "/n1.wal", "file://" + tmp + "/objects", "sqlite:///" + tmp + "/meta.db", small_config())
    p = open_partition(c, "p")
    producer = new_producer(c)
    batches = [producer.batch("p", [Record(value=b"%d.%d" % (i, k)) for k in range(1 + i % 3)]) for i in range({count})]
    with open(tmp + "/batches.pickle", "wb") as f:
        pickle.dump(batches, f)              # kept, to retry them after a crash
    for i, b in enumerate(batches[:-1]):
        print(json.dumps([i, p.append(b).result(10).base_offset]), flush=True)
    p.append(batches[-1])                    # its answer never comes: the process dies first
    print("sent", flush=True)
    sys.stdin.read()
""")


def test_pickled_batches_retried_after_a_kill_9_are_taken_once(tmp_path):
    """Issue 50, item 2: a process pickles its producer's batches before appending them and is
    SIGKILLed; a new process retries the pickled batches. Each answers its original offset (the
    recent ones, the one whose answer never came) or is a DuplicateSequenceError (older ones),
    also as plain RecordBatches of the same bytes: the log holds every batch once, densely."""
    import pickle
    count = 50
    child = subprocess.Popen([sys.executable, "-c", RETRY_CHILD.format(tests=HERE, tmp=str(tmp_path), count=count)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    acked = {}
    for line in child.stdout:
        if line.strip() == "sent":
            break
        i, offset = json.loads(line)
        acked[i] = offset
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert len(acked) == count - 1
    with open(tmp_path / "batches.pickle", "rb") as f:
        batches = pickle.load(f)
    assert all(type(b) is ProducedBatch and b.partition == "p" for b in batches)
    one = node(tmp_path, 1)
    try:
        p = open_partition(one, "p")
        last = p.append(batches[-1]).result(10).base_offset                   # durable before the kill, or now
        end = p.log.next_offset
        assert last == acked[count - 2] + batches[-2].count and end == last + batches[-1].count
        for i in range(count - 5, count - 1):                                  # answered from the table
            assert p.append(batches[i]).result(5).base_offset == acked[i]
            assert p.append(RecordBatch(batches[i].payload, batches[i].count)).result(5).base_offset == acked[i]
        for i in (0, 30, count - 6):                                           # older: taken, not answered
            for again in (batches[i], RecordBatch(batches[i].payload, batches[i].count)):
                with pytest.raises(DuplicateSequenceError, match="took them already"):
                    p.append(again)
        assert p.log.next_offset == end
        records = []
        pos = 0
        while pos < end:
            fetched = p.fetch(pos, end).batches
            records += [(r.offset, r.value) for b in fetched for r in b.records()]
            pos = fetched[-1].end_offset
        assert [offset for offset, _ in records] == list(range(end))          # dense
        assert [value for _, value in records] == [b"%d.%d" % (i, k) for i in range(count) for k in range(1 + i % 3)]
    finally:
        one.close()


def test_producer_header_takes_only_producer_batches():
    from s3stream.records import encode_batch
    with_id = encode_batch([Record(value=b"x")] * 3, producer_id=7, producer_epoch=2, base_sequence=40)
    assert producer_header(with_id, 3) == (7, 2, 40)
    assert producer_header(with_id, 2) is None                              # another count
    assert producer_header(encode_batch([Record(value=b"x")]), 1) is None   # no producer
    damaged = bytearray(with_id)
    damaged[-1] ^= 1
    assert producer_header(bytes(damaged), 3) is None                       # CRC
    assert producer_header(b"\x00" * 80, 1) is None


# ---- against a model --------------------------------------------------------------------------

ops = st.lists(st.one_of(
    st.tuples(st.just("new"), st.integers(1, 3)),
    st.tuples(st.just("retry"), st.integers(0, 10)),
    st.tuples(st.just("move"), st.booleans()),
    st.tuples(st.just("plain"), st.just(0)),
    st.tuples(st.just("crash"), st.just(0)),
), min_size=1, max_size=40)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=ops)
def test_retries_against_a_model(tmp_path_factory, steps):
    """New batches, retries of any earlier batch (its first answer lost), plain appends, moves
    between two nodes, and the owner's death (as a kill -9 leaves it) and failover to a new
    node: a retry of one of the last RECENT batches answers its original offset and appends
    nothing; an older one is refused (OutOfOrderSequenceError) and appends nothing; the log
    holds each batch once, in order."""
    from s3stream.cluster import Cluster, ClusterConfig
    from s3stream.objectstore import LocalObjectStore
    from test_engine_model import crash
    tmp = tmp_path_factory.mktemp("model")
    nodes = [node(tmp, 1), node(tmp, 2)]
    from s3stream.metadata import open_metadata
    meta = open_metadata(f"sqlite:///{tmp}/meta.db")
    cluster = Cluster(meta, LocalObjectStore(str(tmp / "objects")), ClusterConfig(), small_config())
    try:
        p = open_partition(nodes[0], "p")
        producer = new_producer(nodes[0])
        sent: list = []                    # (batch, offset)
        model: list[bytes] = []
        for kind, arg in steps:
            if kind == "new":
                batch = producer.batch("p", [Record(value=b"%d.%d" % (len(sent), k)) for k in range(arg)])
                sent.append((batch, p.append(batch).result(5).base_offset))
                model += [r for r in [b"%d.%d" % (len(sent) - 1, k) for k in range(arg)]]
            elif kind == "retry" and sent:
                index = len(sent) - 1 - arg % len(sent)
                batch, offset = sent[index]
                if len(sent) - index <= 5:
                    assert p.append(batch).result(5).base_offset == offset
                else:
                    with pytest.raises(OutOfOrderSequenceError):
                        p.append(batch)
            elif kind == "plain":
                p.append_records([Record(value=b"plain")]).result(5)
                model.append(b"plain")
            elif kind == "move":
                p.close(timeout=10, record={"version": 0})
                target = nodes[1] if p._client is nodes[0] else nodes[0]
                p = open_partition(target, "p", hinted=arg)
            elif kind == "crash":
                dead = p._client
                crash(dead)
                cluster.fail_over(dead.node_id, reassign=False, lease_over=True, reason="test: the owner died")
                nodes[nodes.index(dead)] = node(tmp, max(n.node_id for n in nodes) + 1)
                p = open_partition(nodes[0], "p", hinted=True)
            assert p.log.next_offset == len(model)
        assert values(p) == model
    finally:
        for n in nodes:
            n.close()
        meta.close()


def test_a_snapshot_after_producers_stop_reads_nothing_back(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "SNAPSHOT_BYTES", 500)
    one = node(tmp_path, 1)
    try:
        p = open_partition(one, "p")
        producer = new_producer(one)
        for i in range(10):
            p.append(producer.batch("p", [Record(value=b"x" * 100)])).result(5)
        assert p._scan_from is not None
        for i in range(20):
            p.append_records([Record(value=b"y" * 100)]).result(5)
        assert p._scan_from is None                  # producers stopped: the snapshot says so
        last = P.Checkpoint.decode(p.meta_stream.fetch(p.meta_stream.next_offset - 1).batches[-1].payload)
        assert last.scan_from is None and json.dumps(last.producers) == json.dumps(p.producers.snapshot())
        assert ProducerTable.restore(last.producers).snapshot() == p.producers.snapshot()   # round trip
    finally:
        one.close()


def test_the_table_survives_a_failover(tmp_path):
    """Node 1 dies (as a kill -9 leaves it) with producers' batches in its WAL only; a failover
    commits them on its behalf, node 2 opens the partition (the table read back from the log
    after the marker snapshot) and every retry of the last batches answers its offset."""
    from s3stream.cluster import Cluster, ClusterConfig
    from s3stream.metadata import open_metadata
    from s3stream.objectstore import LocalObjectStore
    from test_engine_model import crash
    one, two = node(tmp_path, 1), node(tmp_path, 2)
    meta = open_metadata(f"sqlite:///{tmp_path}/meta.db")
    try:
        p = open_partition(one, "p")
        producer = new_producer(one)
        sent = [(b, p.append(b).result(5).base_offset)
                for b in (producer.batch("p", [Record(value=b"%d" % i)] * 2) for i in range(12))]
        crash(one)
        Cluster(meta, LocalObjectStore(str(tmp_path / "objects")), ClusterConfig(), small_config()).fail_over(
            1, reassign=False, lease_over=True, reason="test: node 1 died")
        q = open_partition(two, "p")
        end = q.log.next_offset
        assert end == 24
        assert [q.append(b).result(5).base_offset for b, _ in sent[-5:]] == [off for _, off in sent[-5:]]
        with pytest.raises(OutOfOrderSequenceError):
            q.append(sent[0][0])
        assert q.log.next_offset == end
        assert q.append(producer.batch("p", [Record(value=b"on")])).result(5).base_offset == end
    finally:
        two.close()
        meta.close()


def test_records_that_do_not_encode_take_no_sequence(tmp_path):
    one = node(tmp_path, 1)
    try:
        p = open_partition(one, "p")
        producer = new_producer(one)
        assert p.append(producer.batch("p", [Record(value=b"a")])).result(5).base_offset == 0
        with pytest.raises(InvalidArgumentError):
            producer.batch("p", [Record(value=b"ok"), "not a record"])
        # Had the bad batch taken sequences 1-2, this one would be a gap.
        assert p.append(producer.batch("p", [Record(value=b"b")])).result(5).base_offset == 1
    finally:
        one.close()


def test_a_moving_partition_refuses_a_producer_batch_as_moved(tmp_path):
    """The first producer batch writes a snapshot first; on a partition that is moving away the
    caller gets PartitionMovedError (retry on the new owner), not the meta stream's error."""
    from s3stream.cluster import PartitionMovedError
    one = node(tmp_path, 1)
    try:
        p = open_partition(one, "p")
        producer = new_producer(one)
        batch = producer.batch("p", [Record(value=b"a")])
        p.close(timeout=10)
        with pytest.raises(PartitionMovedError):
            p.append(batch)
    finally:
        one.close()
