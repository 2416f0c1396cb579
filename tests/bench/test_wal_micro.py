"""Microbenchmarks of the WAL hot paths (pytest-benchmark).

Run `pytest tests/bench --benchmark-enable` for timings; with the project's default
`--benchmark-disable` each benchmarked function runs once, so these double as smoke tests.
The full-device benchmark is `python -m benchmarks.wal_disk`.
"""
from __future__ import annotations

import os
import threading

import pytest

from _native import checksum, walrecord
from wal import WALConfig, WriteAheadLog

KiB = 1024
MiB = 1024 * KiB

pytestmark = pytest.mark.benchmark(group="wal-micro", max_time=0.5, min_rounds=5)


# ---- record codec --------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [4 * KiB, 64 * KiB], ids=["4KiB", "64KiB"])
def test_encode_record(benchmark, size):
    data = os.urandom(size)
    offset, generation = 123 * 4096 + 40, 7
    out = benchmark(walrecord.encode_record, offset, generation, data)
    assert len(out) == walrecord.RECORD_HEADER + size
    assert out[walrecord.RECORD_HEADER:] == data
    status, rtype, length, crc, rec_offset, rec_gen = walrecord.decode_record_header_bytes(out)
    assert (status, rtype, length, rec_offset, rec_gen) == (0, walrecord.TYPE_DATA, size, offset, generation)
    assert crc == checksum.crc32c_table(data)


@pytest.mark.parametrize("which", ["crc32c", "crc32c_table"])
def test_crc32c_64k(benchmark, which):
    data = os.urandom(64 * KiB)
    assert benchmark(getattr(checksum, which), data) == checksum.crc32c_table(data)


@pytest.mark.parametrize("which", ["crc32c", "zlib_crc32"])
def test_checksum_1mib(benchmark, which):
    """CRC-32C (the formats' checksum, CPU instruction when present) against zlib's CRC-32 (the
    formats' checksum before version 2) on the same 1 MiB buffer; GB/s = 1.05 / mean in ms."""
    import zlib
    data = os.urandom(1 * MiB)
    fn = checksum.crc32c if which == "crc32c" else zlib.crc32
    expected = checksum.crc32c_table(data) if which == "crc32c" else zlib.crc32(bytes(data))
    assert benchmark(fn, data) == expected


# ---- append path -----------------------------------------------------------------------------------

class _Trimmer(threading.Thread):
    """Keeps the ring from filling: trims to the durable end every `every` bytes."""

    def __init__(self, wal: WriteAheadLog, every: int) -> None:
        super().__init__(name="micro-trimmer", daemon=True)
        self.wal, self.every = wal, every
        self.stopped = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopped.wait(0.002):
                durable = self.wal.durable_end
                if durable - self.wal.trim_offset >= self.every:
                    self.wal.trim(durable)
        except BaseException as e:
            self.error = e

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        if self.error is not None:
            raise self.error


@pytest.fixture
def wal(tmp_path):
    # full_timeout well below the test's patience: a ring that fills shows up as WALFullError.
    w = WriteAheadLog.open(tmp_path / "micro.wal", node_id=1,
                           config=WALConfig(capacity=64 * MiB, full_timeout=10.0))
    w.append(b"warm-up").result()        # start the writer session outside the measurement
    trimmer = _Trimmer(w, 8 * MiB)
    trimmer.start()
    try:
        yield w
    finally:
        try:
            trimmer.stop()
        finally:
            w.close()


def test_append_4k_nowait(benchmark, wal):
    """append() alone: encode into the open batch; the writer thread does the I/O behind it
    (when its batch buffers are all in flight, append waits for one: that is the backpressure)."""
    data = os.urandom(4 * KiB)
    append = wal.append
    calls = [0]
    before = wal.stats()

    def one():
        calls[0] += 1
        return append(data)

    h = benchmark(one)
    assert wal.sync(timeout=30)
    assert h.done() and h.result(0) == h.offset
    after = wal.stats()
    assert after["records"] - before["records"] == calls[0]
    assert after["record_bytes"] - before["record_bytes"] == calls[0] * len(data)


def test_append_4k_sync(benchmark, wal):
    """append(x).result(): one durable record at a time (a pwrite + fdatasync each)."""
    data = os.urandom(4 * KiB)
    append = wal.append

    def one():
        return append(data).result()

    before = wal.stats()
    offset = benchmark(one)
    assert offset + walrecord.RECORD_HEADER + len(data) <= wal.durable_end
    after = wal.stats()
    # nothing to group: one write per append
    assert after["batches"] - before["batches"] == after["records"] - before["records"] >= 1
