"""Microbenchmarks of appending Kafka record batches (pytest-benchmark), beside plain payloads of
the same size: what the append path's handling of a Kafka batch (its base offset written into
the stored header, as a broker does) costs next to a payload it leaves alone.

Run `pytest tests/bench/test_append_records_micro.py --benchmark-enable`.
"""
from __future__ import annotations

import os

import pytest

import wal
from s3stream import Config, Record, RecordBatch, StreamClient
from s3stream.batches import records_batch

KiB = 1024
MiB = 1024 * KiB

pytestmark = pytest.mark.benchmark(group="append-records", max_time=0.5, min_rounds=5)


@pytest.fixture
def stream(tmp_path):
    config = Config(upload_threshold=4 * MiB, split_size=1 * MiB, max_batch_bytes=128 * KiB, cache_size=16 * MiB,
                    reclaim_interval=None, wal=wal.WALConfig(capacity=64 * MiB, full_timeout=10.0))
    client = StreamClient(1, tmp_path / "node.wal", f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db",
                          config)
    s = client.create_stream()
    s.append(RecordBatch(b"warm-up")).result(30)
    try:
        yield s
    finally:
        client.close()


def _kafka(size: int) -> RecordBatch:
    """One record whose value makes the batch about `size` bytes, as append_records builds it."""
    return records_batch([Record(value=os.urandom(max(1, size - 80)))])


@pytest.mark.parametrize("size", [128, 64 * KiB], ids=["128B", "64KiB"])
@pytest.mark.parametrize("kind", ["kafka", "plain"])
def test_append_nowait(benchmark, stream, kind, size):
    """Stream.append of one prebuilt batch, not waited for (the WAL's writer follows behind)."""
    kafka = _kafka(size)
    batch = kafka if kind == "kafka" else RecordBatch(bytes(kafka.payload), kafka.count)
    append = stream.append
    first = stream.next_offset
    calls = [0]

    def one():
        calls[0] += 1
        return append(batch)

    last = benchmark(one)
    assert last.result(30).base_offset == first + calls[0] - 1
