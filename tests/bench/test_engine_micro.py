"""Microbenchmarks of the engine's hot paths (pytest-benchmark).

Run `pytest tests/bench --benchmark-enable` for timings; with the project's default
`--benchmark-disable` each benchmarked function runs once, so these double as smoke tests.
The whole-engine benchmark is `python -m benchmarks.engine`; the WAL's own are in test_wal_micro.py.
"""
from __future__ import annotations

import os
import time

import pytest

import wal
from s3stream import Config, RecordBatch, StreamClient
from s3stream.engine import logcache
from s3stream.batches import FetchedBatch

KiB = 1024
MiB = 1024 * KiB

pytestmark = pytest.mark.benchmark(group="engine-micro", max_time=0.5, min_rounds=5)


@pytest.fixture
def stream(tmp_path):
    # Small blocks so that a long benchmark run uploads and trims the WAL instead of filling it;
    # full_timeout well below the test's patience: a ring that fills shows up as an error.
    config = Config(upload_threshold=4 * MiB, split_size=1 * MiB, max_batch_bytes=64 * KiB, cache_size=16 * MiB,
                    reclaim_interval=None, wal=wal.WALConfig(capacity=64 * MiB, full_timeout=10.0))
    client = StreamClient(1, tmp_path / "node.wal", f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db",
                          config)
    s = client.create_stream()
    s.append(RecordBatch(b"warm-up")).result(30)     # start the WAL's writer session outside the measurement
    try:
        yield s
    finally:
        client.close()


def test_stream_append_128_nowait(benchmark, stream):
    """Stream.append alone: the WAL append and bookkeeping; durability follows behind it (when
    the WAL's buffers or the cache are full, append waits: that is the backpressure)."""
    batch = RecordBatch(os.urandom(128), 1)     # immutable: one object serves every call
    append = stream.append
    first = stream.next_offset
    calls = [0]

    def one():
        calls[0] += 1
        return append(batch)

    last = benchmark(one)
    assert last.result(30).base_offset == first + calls[0] - 1
    assert stream.next_offset == first + calls[0]


def test_stream_append_128_wait(benchmark, stream):
    """append(batch).result(): one durable batch at a time (a WAL write + fdatasync each)."""
    batch = RecordBatch(os.urandom(128), 1)
    append = stream.append
    first = stream.next_offset

    def one():
        return append(batch).result(30)

    result = benchmark(one)
    assert result.base_offset >= first
    assert stream.confirm_offset == stream.next_offset == result.base_offset + 1


def _standalone_log_cache():
    """A log cache like a client's, with `put`, or None where this version has none (the native
    append path fills the cache itself)."""
    make = getattr(logcache, "new_log_cache", None)
    config = Config(upload_threshold=1 * MiB, split_size=1 * MiB, max_batch_bytes=64 * KiB, cache_size=4 * MiB)
    if make is not None:
        cache = make(config, time.monotonic_ns)
    else:
        cache = logcache.LogCache(config.upload_threshold, config.cache_size, time.monotonic_ns)
    if not hasattr(cache, "put") or not hasattr(cache, "mark_committed"):
        return None
    return cache


def test_log_cache_put_128(benchmark):
    """Inserting one durable 128-byte batch into the log cache (what each append costs there)."""
    cache = _standalone_log_cache()
    if cache is None:
        pytest.skip("this log cache has no put(): the native append path fills it")
    payload = os.urandom(128)
    next_offset = [0]
    sealed_blocks = [0]

    def one():
        base = next_offset[0]
        next_offset[0] = base + 1
        sealed = cache.put(7, 1, FetchedBatch(base, 1, payload), (base + 1) * 200)
        if sealed is not None:
            # as if uploaded at once: committed blocks are evicted by size, so memory stays bounded
            cache.mark_committed(sealed)
            sealed_blocks[0] += 1
        return sealed

    benchmark(one)
    n = next_offset[0]
    tail = cache.read(7, n - 1, n, 1 * MiB)
    assert [(b.base_offset, b.payload) for b in tail] == [(n - 1, payload)]
    assert sealed_blocks[0] == n * len(payload) // (1 * MiB)


@pytest.mark.parametrize("hold", [True, False], ids=["held", "copied"])
def test_log_cache_put_64k(benchmark, hold):
    """One durable 64 KiB batch into the log cache: held by reference (what appends of bytes do
    from 8 KiB on) or copied into the cache's chunks (any other buffer, or below 8 KiB)."""
    cache = _standalone_log_cache()
    payload = os.urandom(64 * KiB)
    next_offset = [0]

    def one():
        base = next_offset[0]
        next_offset[0] = base + 1
        sealed = cache.put(7, 1, FetchedBatch(base, 1, payload), (base + 1) * 70000, hold=hold)
        if sealed is not None:
            cache.mark_committed(sealed)
        return sealed

    benchmark(one)
    n = next_offset[0]
    assert [(b.base_offset, b.payload) for b in cache.read(7, n - 1, n, 1 * MiB)] == [(n - 1, payload)]


@pytest.mark.parametrize("gather_min", [8 * KiB, 0], ids=["gathered", "copied"])
def test_encode_object_from_the_cache_16m(benchmark, tmp_path, gather_min):
    """Encoding a 16 MiB block of 64 KiB batches (1,000 streams' worth of slices) and writing it
    to a file, as the uploader does for the local store: payloads left in the cache (writev) or
    copied into the reused buffer first."""
    cache = logcache.LogCache(64 * MiB, 128 * MiB, time.monotonic_ns, FetchedBatch)
    payload = os.urandom(64 * KiB)
    for i in range(256):
        cache.put(i % 250, 1, (i // 250, 1, payload), (i + 1) * 70000)
    block = cache.seal()
    slices = [block.streams[sid] for sid in sorted(block.streams)]
    buffer = bytearray()
    whole, _ = logcache.encode_slices(slices, 512 * KiB)
    path = tmp_path / "object"

    def one():
        data, _ = logcache.encode_slices(slices, 512 * KiB, buffer, gather_min)
        with data, open(path, "wb") as f:
            if gather_min:
                data.write_to(f.fileno())
            else:
                f.write(data)
        return data

    benchmark(one)
    assert path.read_bytes() == whole
