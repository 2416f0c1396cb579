"""The first zero-fill of a new WAL file (preallocate="background"): it completes, never writes
over a record, survives SIGKILL, and appends that catch up with it wait instead of overtaking."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

from testpaths import CHILDREN

import pytest

import wal
from wal.fill import ZeroFiller
from wal.header import HEADER_SLOT, Header, pick_header
from conftest import KiB, MiB, detach, loop_device, read_data_area
from wal_payload import parse_payload

CHILD = CHILDREN / "wal_fill_child.py"


def config(capacity: int, **kw) -> wal.WALConfig:
    kw = dict(capacity=capacity, batch_bytes=64 * KiB, full_timeout=10.0, preallocate="background") | kw
    return wal.WALConfig(**kw)


def wait_filled(w: wal.WriteAheadLog, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not w.stats()["fill_complete"]:
        assert time.monotonic() < deadline, f"first fill stuck at {w.stats()['filled_bytes']}"
        time.sleep(0.01)


def read_header(path) -> Header:
    with open(path, "rb") as f:
        raw = f.read(2 * HEADER_SLOT)
    header, _ = pick_header(raw[:HEADER_SLOT], raw[HEADER_SLOT:])
    return header


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(ZeroFiller, "chunk_bytes", 64 * KiB)


def test_fill_completes_and_the_file_reads_zeros_past_the_records(tmp_path, small_chunks):
    path = tmp_path / "w"
    capacity = 4 * MiB + 8 * KiB
    assert wal.WriteAheadLog.preallocate(path, config(capacity))
    # The file is only reserved (its blocks are allocated, nothing written yet).
    assert os.stat(path).st_size == capacity and os.stat(path).st_blocks * 512 >= capacity
    rng = random.Random(1)
    bodies = [rng.randbytes(rng.randrange(1, 9000)) for _ in range(50)]
    with wal.WriteAheadLog.open(path, node_id=1, config=config(capacity)) as w:
        assert w.header.fill_end == 0
        hs = [w.append(b) for b in bodies]
        end = hs[-1].end
        hs[-1].result(10)
        wait_filled(w)
        stats = w.stats()
        assert stats["filled_bytes"] == w.capacity and stats["fill_complete"]
    assert read_header(path).fill_end is None           # a filled WAL's header is the old format
    data = read_data_area(str(path))
    tail = -(-end // 4096) * 4096
    assert data[tail:] == bytes(len(data) - tail)
    with wal.WriteAheadLog.open(path, node_id=1, config=config(capacity)) as w:
        assert [r.data for r in w.recover()] == bodies
        assert w.stats()["fill_complete"]


def test_appends_racing_a_slow_filler_are_all_recovered(tmp_path, small_chunks, monkeypatch):
    monkeypatch.setattr(ZeroFiller, "before_chunk", lambda offset: time.sleep(0.002))
    path = tmp_path / "w"
    capacity = 8 * MiB + 8 * KiB
    appended: dict[int, list[bytes]] = {0: [], 1: []}
    with wal.WriteAheadLog.open(path, node_id=1, config=config(capacity)) as w:
        def producer(t: int) -> None:
            rng = random.Random(t)
            hs = []
            for _ in range(400):
                body = bytes([t]) + rng.randbytes(rng.randrange(0, 12000))
                hs.append((w.append(body), body))
            for h, body in hs:
                h.result(30)
                appended[t].append((h.offset, body))

        threads = [threading.Thread(target=producer, args=(t,)) for t in appended]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert w.stats()["full_waits"] > 0, "the appenders should have caught up with the filler"
        # Closed mid-fill: the next session resumes it.
        assert not w.stats()["fill_complete"]
    expected = sorted(rec for recs in appended.values() for rec in recs)
    mark = read_header(path).fill_end
    assert mark is not None and expected[-1][0] < mark
    monkeypatch.setattr(ZeroFiller, "before_chunk", None)
    with wal.WriteAheadLog.open(path, node_id=1, config=config(capacity)) as w:
        assert [(r.offset, r.data) for r in w.recover()] == expected
        w.start()
        wait_filled(w)
    with wal.WriteAheadLog.open(path, node_id=1, config=config(capacity)) as w:
        assert [(r.offset, r.data) for r in w.recover()] == expected


@pytest.mark.slow
def test_appends_catching_up_with_the_filler_wait_rather_than_overtake(tmp_path, small_chunks, monkeypatch):
    permits = threading.Semaphore(2)
    open_gate = threading.Event()

    def gate(offset: int) -> None:
        while not open_gate.is_set() and not permits.acquire(timeout=0.01):
            pass

    monkeypatch.setattr(ZeroFiller, "before_chunk", gate)
    path = tmp_path / "w"
    w = wal.WriteAheadLog.open(path, node_id=1, config=config(4 * MiB + 8 * KiB, full_timeout=2.0))
    try:
        w.start()
        deadline = time.monotonic() + 10
        while w.header.fill_end != 128 * KiB:        # two chunks let through, persisted
            assert time.monotonic() < deadline
            time.sleep(0.005)
        handles = []
        with pytest.raises(wal.WALFullError, match="first fill is behind"):
            for _ in range(1000):
                handles.append(w.append(os.urandom(3000)))
        assert handles and all(h.end <= 128 * KiB for h in handles)
        assert w.header.fill_end == 128 * KiB and w.stats()["filled_bytes"] == 128 * KiB
        for h in handles:
            h.result(10)
        # An append that waits at the mark goes through once the filler moves it on.
        blocked = []
        th = threading.Thread(target=lambda: blocked.append(w.append(os.urandom(3000)).result(10)))
        th.start()
        time.sleep(0.3)
        assert not blocked, "the append overtook the filler"
        mark_before = w.header.fill_end
        permits.release()
        th.join(5)
        assert blocked and blocked[0] >= mark_before - 3100
        assert w.stats()["full_waits"] >= 2
        # It waited at least the 0.3 s it was held, and the counters say so.
        assert w.stats()["wait_max_seconds"] >= 0.25
        assert w.stats()["wait_seconds"] >= w.stats()["wait_max_seconds"]
    finally:
        open_gate.set()
        w.close()
    with wal.WriteAheadLog.open(path, node_id=1, config=config(4 * MiB + 8 * KiB)) as w2:
        assert len(list(w2.recover())) == len(handles) + 1


def test_close_stops_the_filler_within_a_chunk(tmp_path):
    # The default chunk on a 1 GiB WAL: close must not wait for the whole fill.
    path = tmp_path / "w"
    with wal.WriteAheadLog.open(path, node_id=1, config=config(1024 * MiB)) as w:
        w.append(b"x").result(10)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 2.0
    mark = read_header(path).fill_end
    assert mark is not None and 0 < mark < 1024 * MiB - 8 * KiB


def _run_child(path: str, rnd: int, capacity: int, kill_after: float) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CHILD.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(CHILD), path, str(rnd), str(capacity)],
                            stdout=subprocess.PIPE, text=True, env=env)
    acks: dict = {}
    ready = threading.Event()

    def reader():
        for line in proc.stdout:
            kind, *rest = line.split()
            if kind == "ready":
                ready.set()
            elif kind == "ack":
                t, s, off, end = map(int, rest)
                acks[(rnd, t, s)] = (off, end)

    th = threading.Thread(target=reader)
    th.start()
    try:
        assert ready.wait(60), "child did not start"
        time.sleep(kill_after)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        th.join()
    return acks


def _recovered(path: str) -> tuple[dict, Header]:
    with wal.WriteAheadLog.open(path, node_id=1, recovery=True) as w:
        recs = {parse_payload(r.data): r.offset for r in w.recover()}       # byte for byte
        return recs, w.header


def test_sigkill_mid_fill_loses_no_acknowledged_record_and_the_fill_resumes(tmp_path):
    path = str(tmp_path / "fill.wal")
    capacity = 32 * MiB + 8 * KiB
    acked: dict = {}
    marks = []
    for rnd in range(3):
        acks = _run_child(path, rnd, capacity, kill_after=0.3 + 0.1 * rnd)
        assert len(acks) > 20, "the child should acknowledge records before it is killed"
        acked.update(acks)
        recs, header = _recovered(path)
        assert header.fill_end is not None, "killed mid-fill: the mark must still be there"
        marks.append(header.fill_end)
        for key, (off, end) in acked.items():
            assert recs.get(key) == off, f"acknowledged record {key} lost"
            assert end <= header.fill_end, "a record was placed beyond the persisted fill mark"
    assert marks == sorted(marks) and marks[-1] > marks[0], "each session resumes the fill"
    with wal.WriteAheadLog.open(path, node_id=1, config=config(capacity)) as w:
        assert len(list(w.recover())) >= len(acked)
        w.start()
        wait_filled(w)
    recs, header = _recovered(path)
    assert header.fill_end is None
    for key, (off, _) in acked.items():
        assert recs.get(key) == off, f"acknowledged record {key} zeroed by the resumed fill"


def test_an_old_format_header_opens_as_fully_filled(tmp_path):
    path = tmp_path / "w"
    capacity = 4 * MiB + 8 * KiB
    w = wal.WriteAheadLog.open(path, node_id=1, config=config(capacity))
    w.close()                         # formatted with an empty fill mark, never started
    assert read_header(path).fill_end == 0
    # A header written by a build before the fill mark: bytes 104.. of both slots are zero.
    with open(path, "r+b") as f:
        for slot in (0, HEADER_SLOT):
            f.seek(slot + 104)
            f.write(bytes(HEADER_SLOT - 104))
    header = read_header(path)
    assert header is not None and header.fill_end is None
    with wal.WriteAheadLog.open(path, node_id=1, config=config(capacity)) as w:
        assert w.stats()["fill_complete"]
        h = w.append(os.urandom(1 * MiB - 100))      # no fill limit: goes far past any chunk
        h.result(10)
        assert w.stats()["fill_complete"] and w.stats()["filled_bytes"] == w.capacity


def test_the_fill_mark_is_invisible_to_readers_of_the_old_format():
    h = Header(capacity=4 * MiB, trim_offset=0, write_seq=3, write_time_ns=1, node_id=1, node_epoch=0,
                   generation=1, clean_shutdown=False, clean_end=0)
    marked = h.encode()
    with_mark = replace(h, fill_end=64 * KiB).encode()
    assert with_mark[:104] == marked[:104] and not any(marked[104:])
    assert pick_header(with_mark, bytes(HEADER_SLOT))[0].fill_end == 64 * KiB


@pytest.mark.parametrize("mode", ["zeros", "fallocate"])
def test_other_modes_need_no_fill(tmp_path, mode):
    path = tmp_path / "w"
    with wal.WriteAheadLog.open(path, node_id=1, config=config(1 * MiB + 8 * KiB, preallocate=mode)) as w:
        w.append(b"x").result(10)
        assert w.header.fill_end is None and w.stats()["fill_complete"]


def test_a_block_device_needs_no_fill(tmp_path):
    dev = loop_device(str(tmp_path / "device.img"), 1 * MiB + 8 * KiB)
    try:
        with wal.WriteAheadLog.open(dev, node_id=1, config=config(None)) as w:
            w.append(os.urandom(200 * KiB)).result(10)
            assert w.header.fill_end is None and w.stats()["fill_complete"]
    finally:
        detach(dev)


def test_records_above_the_mark_are_never_zeroed(tmp_path, small_chunks):
    # Cannot happen within this build (the ring stays below the mark); can with a file formatted
    # over an older WAL. The session moves the mark past the records instead of zeroing them.
    path = tmp_path / "w"
    capacity = 2 * MiB + 8 * KiB
    bodies = [os.urandom(5000) for _ in range(40)]
    with wal.WriteAheadLog.open(path, node_id=1, config=config(capacity, preallocate="zeros")) as w:
        for h in [w.append(b) for b in bodies]:
            h.result(10)
        end = w.durable_end
    fd = os.open(path, os.O_RDWR)
    try:
        wal.WriteAheadLog._write_slot(fd, read_header(path).next(fill_end=0))
    finally:
        os.close(fd)
    with wal.WriteAheadLog.open(path, node_id=1, config=config(capacity)) as w:
        assert [r.data for r in w.recover()] == bodies
        w.append(b"after").result(10)
        assert w.header.fill_end is None or w.header.fill_end >= end
        wait_filled(w)
    with wal.WriteAheadLog.open(path, node_id=1, config=config(capacity)) as w:
        assert [r.data for r in w.recover()] == bodies + [b"after"]
