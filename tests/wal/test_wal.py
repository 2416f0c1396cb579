"""The WAL on real files and loop block devices: appends, recovery, wrap-around, trims, headers."""
from __future__ import annotations

import os
import random
import threading

import pytest

import wal
from wal import reference
from conftest import KiB, MiB, damage, read_data_area


def payload(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n)


def test_append_recover_roundtrip(wal_target):
    rng = random.Random(1)
    bodies = [payload(rng, rng.choice([0, 1, 31, 100, 4064, 4096, 5000, 70_000])) for _ in range(60)]
    with wal_target.open() as w:
        handles = [w.append(b) for b in bodies]
        offsets = [h.result(timeout=10) for h in handles]
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
        assert w.durable_end == handles[-1].end
    with wal_target.open() as w:
        recs = list(w.recover())
        assert w.previous_shutdown_clean
    assert [r.offset for r in recs] == offsets
    assert [r.data for r in recs] == bodies


def test_native_scan_matches_reference_and_codec(wal_target):
    rng = random.Random(2)
    with wal_target.open() as w:
        # 72 records of up to 3 blocks each fit the 1 MiB ring even if every one goes out in a
        # batch of its own (a busy writer): 200 did not always (CI, 2026-11-28: WALFullError).
        hs = [w.append(payload(rng, rng.randrange(0, 9000))) for _ in range(72)]
        hs[-1].result()
    with wal_target.open() as w:
        recs = list(w.recover())
        end = w.recovery_result.end
    ref_recs, ref_end = reference.scan(read_data_area(wal_target.path)[:wal_target.capacity - 8192],
                                       wal_target.capacity - 8192, 0)
    assert [(r.offset, r.data) for r in recs] == ref_recs
    assert end == ref_end
    from _native.walrecord import encode_record
    for off, data in ref_recs[:50]:
        assert encode_record(off, 1, data) == reference.encode_record(off, 1, data)


def test_group_commit_coalesces_concurrent_appends(tmp_path):
    cfg = wal.WALConfig(capacity=16 * MiB, batch_bytes=256 * KiB)
    with wal.WriteAheadLog.open(tmp_path / "w", node_id=1, config=cfg) as w:
        body = os.urandom(1000)
        handles: list = []

        def producer():
            mine = [w.append(body) for _ in range(2000)]
            handles.extend(mine)

        threads = [threading.Thread(target=producer) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for h in handles:
            h.result(timeout=10)
        stats = w.stats()
    assert stats["records"] == 8000
    # One fdatasync per record would be 8000 batches; group commit writes far fewer.
    assert stats["batches"] < 8000 / 4, stats


def test_a_backlog_of_sealed_batches_goes_out_with_one_fdatasync(tmp_path):
    """Small batches, many buffers and producers faster than one fdatasync per batch: the writer
    writes the sealed batches queued behind the one it takes in the same group, with one sync,
    and every record is recovered in order after a reopen."""
    cfg = wal.WALConfig(capacity=64 * MiB, batch_bytes=8 * KiB, buffers=16)
    bodies = {t: [bytes([t]) * 3000 + i.to_bytes(4, "little") for i in range(1500)] for t in range(4)}
    offsets: dict = {}
    with wal.WriteAheadLog.open(tmp_path / "w", node_id=1, config=cfg) as w:
        def producer(t):
            hs = [(w.append(b), b) for b in bodies[t]]
            offsets.update((h.result(timeout=30), b) for h, b in hs)

        threads = [threading.Thread(target=producer, args=(t,)) for t in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = w.stats()
    assert stats["records"] == 6000
    assert stats["syncs"] < stats["batches"], stats          # some groups held several batches
    with wal.WriteAheadLog.open(tmp_path / "w", node_id=1, config=cfg) as w:
        recs = list(w.recover())
    assert [(r.offset, r.data) for r in recs] == sorted(offsets.items())


def test_callbacks_run_in_offset_order(wal_target):
    seen: list[int] = []
    lock = threading.Lock()

    def cb(h):
        with lock:
            seen.append(h.offset)

    with wal_target.open() as w:
        def producer(seed):
            rng = random.Random(seed)
            for _ in range(150):
                w.append(payload(rng, rng.randrange(1, 2000)), callback=cb)

        threads = [threading.Thread(target=producer, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert w.sync(timeout=10)
    assert len(seen) == 450
    assert seen == sorted(seen)


def test_wraps_many_times_with_trims(wal_target):
    """Ten laps of the ring with trims; after a clean close, or none, exactly the untrimmed
    records come back."""
    rng = random.Random(3)
    cap = wal_target.capacity - 8192
    live: list[tuple[int, bytes, int]] = []   # (offset, body, end)
    written = 0
    w = wal_target.open(config=wal_target.config(full_timeout=2.0))
    while written < 10 * cap:
        body = payload(rng, rng.randrange(1, 20 * KiB))
        h = w.append(body)
        h.result(timeout=10)
        live.append((h.offset, body, h.end))
        written += len(body)
        # keep at most ~60% of the ring untrimmed
        while live[-1][2] - live[0][0] > 0.6 * cap:
            live.pop(0)
            w.trim(live[0][0])
    w.close()
    with wal_target.open() as w2:
        recs = list(w2.recover())
    assert [(r.offset, r.data) for r in recs] == [(o, b) for o, b, _ in live]
    assert live[-1][2] > 10 * cap  # offsets are logical and kept growing past ten laps


def test_full_ring_waits_then_fails_and_overwrites_nothing(wal_target):
    cfg = wal_target.config(full_timeout=0.3)
    body = os.urandom(30 * KiB)
    acked = []
    with wal_target.open(config=cfg) as w:
        with pytest.raises(wal.WALFullError, match="WAL full"):
            while True:
                h = w.append(body)
                h.result(timeout=10)
                acked.append(h)
        assert len(acked) * len(body) > 0.9 * (wal_target.capacity - 8192) * 0.9
        # Space freed by a trim is reused.
        w.trim(acked[5].offset)
        h = w.append(body)
        h.result(timeout=10)
        acked.append(h)
    with wal_target.open() as w:
        recs = list(w.recover())
    assert [r.offset for r in recs] == [h.offset for h in acked[5:]]
    assert all(r.data == body for r in recs)


def test_full_ring_append_proceeds_when_trim_arrives(tmp_path):
    cfg = wal.WALConfig(capacity=72 * KiB + 8192, batch_bytes=16 * KiB, full_timeout=10)
    with wal.WriteAheadLog.open(tmp_path / "w", node_id=1, config=cfg) as w:
        hs = []
        while w.durable_end < 60 * KiB:
            hs.append(w.append(b"a" * 8000))
            hs[-1].result()
        timer = threading.Timer(0.3, lambda: w.trim(hs[-1].end))
        timer.start()
        extra = [w.append(b"b" * 8000) for _ in range(4)]   # blocks until the trim
        for h in extra:
            h.result(timeout=10)
        timer.join()
    with wal.WriteAheadLog.open(tmp_path / "w", node_id=1, config=cfg) as w:
        assert [r.data for r in w.recover()] == [b"b" * 8000] * 4


def test_record_too_large_is_refused_and_log_intact(wal_target):
    with wal_target.open(config=wal_target.config(max_record_bytes=100 * KiB)) as w:
        w.append(b"keep").result()
        with pytest.raises(wal.RecordTooLargeError, match="exceeds"):
            w.append(bytes(100 * KiB + 1))
        w.append(b"also").result()
    with wal_target.open() as w:
        assert [r.data for r in w.recover()] == [b"keep", b"also"]


def test_record_larger_than_batch_gets_its_own_write(tmp_path):
    cfg = wal.WALConfig(capacity=4 * MiB, batch_bytes=16 * KiB)
    big = os.urandom(700 * KiB)
    with wal.WriteAheadLog.open(tmp_path / "w", node_id=1, config=cfg) as w:
        hs = [w.append(b"x" * 100), w.append(big), w.append(b"y" * 100)]
        for h in hs:
            h.result()
    with wal.WriteAheadLog.open(tmp_path / "w", node_id=1, config=cfg) as w:
        assert [r.data for r in w.recover()] == [b"x" * 100, big, b"y" * 100]


@pytest.mark.parametrize("kwargs, match", [
    (dict(capacity=0), "too small"),
    (dict(capacity=8192 + 4096), "too small"),
    (dict(capacity=1 * MiB + 100), "multiple of 4096"),
    (dict(batch_bytes=5000), "batch_bytes"),
    (dict(buffers=1), "buffers"),
    (dict(writer_threads=4, buffers=4), "writer_threads"),
    (dict(full_timeout=0), "full_timeout"),
    (dict(preallocate="maybe"), "preallocate"),
])
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(wal.WALConfigError, match=match):
        wal.WALConfig(**kwargs)


def test_preallocate_modes():
    assert wal.WALConfig().preallocate == "background"
    for mode in ("background", "zeros", "fallocate"):
        assert wal.WALConfig(preallocate=mode).preallocate == mode
    with pytest.raises(wal.WALConfigError, match="'background', 'zeros', 'fallocate'"):
        wal.WALConfig(preallocate="zero")


def test_bad_paths_are_refused(tmp_path):
    with pytest.raises(wal.WALConfigError, match="is a directory"):
        wal.WriteAheadLog.open(tmp_path, node_id=1)
    with pytest.raises(wal.WALConfigError, match="no WAL"):
        wal.WriteAheadLog.open(tmp_path / "absent", node_id=1, recovery=True)
    with pytest.raises(wal.WALConfigError, match="cannot fit"):
        wal.WriteAheadLog.open(tmp_path / "w", node_id=1,
                               config=wal.WALConfig(capacity=128 * KiB, max_record_bytes=1 * MiB))


def test_foreign_garbage_is_not_overwritten(tmp_path):
    p = tmp_path / "precious"
    original = os.urandom(256 * KiB)
    p.write_bytes(original)
    with pytest.raises(wal.WALCorruptError, match="not an s3stream WAL"):
        wal.WriteAheadLog.open(p, node_id=1)
    assert p.read_bytes() == original
    with wal.WriteAheadLog.open(p, node_id=1, force_format=True) as w:
        w.append(b"mine").result()
    with wal.WriteAheadLog.open(p, node_id=1) as w:
        assert [r.data for r in w.recover()] == [b"mine"]


def test_other_nodes_wal_needs_recovery_mode(wal_target):
    with wal_target.open(node_id=7) as w:
        w.append(b"from node 7").result()
    with pytest.raises(wal.ForeignWALError, match="belongs to node 7"):
        wal_target.open(node_id=8)
    with wal_target.open(node_id=8, recovery=True) as w:
        assert [r.data for r in w.recover()] == [b"from node 7"]
        with pytest.raises(wal.WALClosedError, match="read-only"):
            w.append(b"nope")
    # recovery left it untouched and still node 7's
    with wal_target.open(node_id=7) as w:
        assert [r.data for r in w.recover()] == [b"from node 7"]


def test_stale_epoch_is_fenced(wal_target):
    with wal_target.open(node_id=1, node_epoch=5) as w:
        w.append(b"a").result()
    with pytest.raises(wal.WALFencedError, match="stale"):
        wal_target.open(node_id=1, node_epoch=4)
    with wal_target.open(node_id=1, node_epoch=6) as w:
        assert [r.data for r in w.recover()] == [b"a"]


def test_capacity_mismatch_is_refused(tmp_path):
    with wal.WriteAheadLog.open(tmp_path / "w", node_id=1, config=wal.WALConfig(capacity=1 * MiB)):
        pass
    with pytest.raises(wal.WALConfigError, match="cannot be resized"):
        wal.WriteAheadLog.open(tmp_path / "w", node_id=1, config=wal.WALConfig(capacity=2 * MiB))


def test_trim_rules(wal_target):
    with wal_target.open() as w:
        hs = [w.append(b"r%d" % i) for i in range(10)]
        hs[-1].result()
        with pytest.raises(ValueError, match="durable only up to"):
            w.trim(hs[-1].end + 4096)
        w.trim(hs[4].offset)
        w.trim(hs[2].offset)      # backwards: no-op
        assert w.trim_offset == hs[4].offset
    with wal_target.open() as w:
        assert [r.data for r in w.recover()] == [b"r%d" % i for i in range(4, 10)]


def test_header_slots_alternate_and_one_corrupt_slot_still_opens(wal_target):
    with wal_target.open() as w:
        hs = [w.append(b"rec%d" % i) for i in range(20)]
        hs[-1].result()
        for i in (3, 6, 9):
            w.trim(hs[i].offset)
    last_seq = w.header.write_seq   # the clean-shutdown write of close()
    assert w.header.clean_shutdown
    # Ruin the newest slot (the clean-shutdown write): the previous one still opens the WAL.
    damage(wal_target.path, (last_seq % 2) * 4096 + 20, b"\xff\xff\xff\xff")
    with wal_target.open() as w:
        assert w.header.write_seq == last_seq - 1
        recs = [r.data for r in w.recover()]
    assert recs == [b"rec%d" % i for i in range(9, 20)]
    # Both slots ruined: a clear error, nothing written.
    damage(wal_target.path, 20, b"\xff\xff\xff\xff")
    damage(wal_target.path, 4096 + 20, b"\xff\xff\xff\xff")
    with pytest.raises(wal.WALCorruptError, match="corrupt WAL header"):
        wal_target.open()


def test_read_header_reads_without_opening(tmp_path):
    p = tmp_path / "w"
    with wal.WriteAheadLog.open(p, node_id=3, node_epoch=2, config=wal.WALConfig(capacity=1 * MiB)) as w:
        w.append(b"x").result()
        running = w.header
        header, states = wal.read_header(p)     # while in use: a snapshot, no lock taken
        assert header == running and not header.clean_shutdown
    header, states = wal.read_header(str(p))
    assert isinstance(header, wal.Header) and header == w.header
    assert (header.node_id, header.node_epoch, header.capacity, header.clean_shutdown) == (3, 2, 1 * MiB, True)
    assert states == (wal.SlotState.VALID, wal.SlotState.VALID)
    damage(str(p), (header.write_seq % 2) * 4096 + 20, b"\xff\xff\xff\xff")
    older, states = wal.read_header(p)
    assert older.write_seq == header.write_seq - 1 and wal.SlotState.CORRUPT in states
    (tmp_path / "zero").write_bytes(bytes(8192))
    assert wal.read_header(tmp_path / "zero") == (None, (wal.SlotState.EMPTY, wal.SlotState.EMPTY))
    (tmp_path / "tiny").write_bytes(b"S3STRWAL")
    with pytest.raises(wal.WALCorruptError, match="too small to be a WAL"):
        wal.read_header(tmp_path / "tiny")


def test_clean_shutdown_that_lost_data_is_reported(tmp_path):
    p = tmp_path / "w"
    with wal.WriteAheadLog.open(p, node_id=1, config=wal.WALConfig(capacity=1 * MiB)) as w:
        hs = [w.append(b"z" * 3000) for _ in range(5)]
        hs[-1].result()
    damage(str(p), 8192 + hs[3].offset + 40, b"\x00\x01")
    with wal.WriteAheadLog.open(p, node_id=1) as w:
        it = w.recover()
        assert [next(it).data for _ in range(3)] == [b"z" * 3000] * 3
        with pytest.raises(wal.WALCorruptError, match="shut down cleanly"):
            next(it)


def test_unaligned_block_device_is_refused(tmp_path):
    from conftest import detach, loop_device
    dev = loop_device(str(tmp_path / "odd.img"), 2 * MiB, sizelimit=1 * MiB + 512)
    try:
        with pytest.raises(wal.WALConfigError, match="not a multiple of 4096"):
            wal.WriteAheadLog.open(dev, node_id=1)
    finally:
        detach(dev)


def test_second_writer_process_is_refused(tmp_path):
    p = tmp_path / "w"
    with wal.WriteAheadLog.open(p, node_id=1, config=wal.WALConfig(capacity=1 * MiB)) as w:
        w.append(b"x").result()
        with pytest.raises(wal.WALInUseError, match="in use"):
            wal.WriteAheadLog.open(p, node_id=1)


def test_callbacks_stay_in_offset_order_when_appends_wait(tmp_path):
    """Large records and few buffers make appends wait for space (callbacks registered after the
    ring mutex is released): the dispatcher must still run them in offset order."""
    cfg = wal.WALConfig(capacity=8 * MiB, batch_bytes=64 * KiB, buffers=2)
    seen: list[int] = []
    lock = threading.Lock()

    def cb(h):
        with lock:
            seen.append(h.offset)

    with wal.WriteAheadLog.open(tmp_path / "w", node_id=1, config=cfg) as w:
        def producer(seed):
            rng = random.Random(seed)
            for i in range(120):
                w.append(payload(rng, rng.choice([100, 40 * KiB, 70 * KiB])), callback=cb)
                if i % 20 == 19:
                    live = w.durable_end
                    if live > 4 * MiB:
                        w.trim(live)

        threads = [threading.Thread(target=producer, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert w.sync(timeout=20)
    assert len(seen) == 480
    assert seen == sorted(seen)


def test_add_done_callback_fires_without_append_callbacks(tmp_path):
    with wal.WriteAheadLog.open(tmp_path / "w", node_id=1, config=wal.WALConfig(capacity=1 * MiB)) as w:
        fired = threading.Event()
        h = w.append(b"x")
        h.add_done_callback(lambda _h: fired.set())
        assert fired.wait(5)
        h.result()
        late = threading.Event()
        h.add_done_callback(lambda _h: late.set())   # already durable: runs at once
        assert late.is_set()


def lap_end_ring(tmp_path, resume: int, resume_block: bytes | None, full_timeout: float = 5.0):
    """A Ring of 256 KiB over a fresh file (8 KiB header area) resuming at `resume`, its
    writer not started yet; returns (fd, ring)."""
    from _native.walring import Ring
    path = tmp_path / "ring"
    with open(path, "wb") as f:
        f.truncate(8192 + 256 * KiB)
    fd = os.open(path, os.O_RDWR)
    errors = (wal.WALFullError, wal.WALClosedError, wal.WALIOError, wal.RecordTooLargeError)
    return fd, Ring(fd, 8192, 256 * KiB, 64 * KiB, 4, 7, resume, resume, resume_block, full_timeout, 64 * KiB,
                    errors)


def write_out(ring, handles) -> list[int]:
    writer = threading.Thread(target=ring.run_writer)
    writer.start()
    try:
        return [h.result(timeout=10) for h in handles]
    finally:
        ring.stop()
        writer.join()


@pytest.mark.parametrize("tail", [0, 16, 31])
def test_a_batch_whose_records_reach_the_lap_end_does_not_run_past_the_ring(tmp_path, tail):
    """Two records placed in one batch, the first ending `tail` bytes before the end of the lap
    (too close for a padding record), the second opening the next lap: the second lands at the
    ring's physical start, not beyond its end (where a restart would never find it)."""
    from _native.walscan import Scanner
    cap, block = 256 * KiB, 4096
    resume = 3 * cap - 2 * block      # two blocks before the end of the third lap
    fd, ring = lap_end_ring(tmp_path, resume, None)
    try:
        first = os.urandom(2 * block - 32 - tail)
        second = os.urandom(100)
        # Placed before the writer runs, so both are in the same batch.
        assert write_out(ring, [ring.append(first), ring.append(second)]) == [resume, 3 * cap]
        assert os.fstat(fd).st_size == 8192 + cap, "a write ran past the ring's end"
        assert list(Scanner(fd, 8192, cap, resume)) == [(resume, first), (3 * cap, second)]
    finally:
        os.close(fd)


def test_a_session_resumed_in_the_last_bytes_of_a_lap_writes_from_the_next_lap(tmp_path):
    """Resumed 16 bytes before the lap's end, the first record opens the next lap: its batch
    starts at the ring's physical start, not in the block the session resumed in."""
    from _native.walscan import Scanner
    cap = 256 * KiB
    fd, ring = lap_end_ring(tmp_path, 3 * cap - 16, bytes(4096))
    try:
        body = os.urandom(100)
        assert write_out(ring, [ring.append(body)]) == [3 * cap]
        assert os.fstat(fd).st_size == 8192 + cap, "a write ran past the ring's end"
        assert list(Scanner(fd, 8192, cap, 3 * cap)) == [(3 * cap, body)]
    finally:
        os.close(fd)


def test_a_wrap_of_a_full_ring_waits_for_space_and_overwrites_nothing(tmp_path):
    """The ring is full to within a block and the next record does not fit in the lap: the
    padding record that ends the lap would go in the block where the oldest live record lies.
    It waits for space like a record (and times out as WAL full), overwriting nothing."""
    from _native.walscan import Scanner
    cap, block = 256 * KiB, 4096
    trim = 2 * cap - block + 100            # live records start 100 bytes into the ring's last block
    resume_block = bytes(4096)
    fd, ring = lap_end_ring(tmp_path, trim, resume_block, full_timeout=0.2)
    try:
        wanted = 3 * cap - block             # fill the ring up to here, one block short of the trim's
        writer = threading.Thread(target=ring.run_writer)
        writer.start()
        try:
            bodies, offsets, pos = [], [], trim
            while pos < wanted:
                # One at a time, each ending on a block boundary: each its own batch, packed.
                end = min(wanted, (pos + 32 * KiB) // block * block, (pos // cap + 1) * cap)
                bodies.append(os.urandom(end - pos - 32))
                h = ring.append(bodies[-1])
                offsets.append(h.result(timeout=10))
                assert h.end == end
                pos = end
            # 5000 bytes do not fit before the lap's end: the lap must be closed first.
            with pytest.raises(wal.WALFullError):
                ring.append(os.urandom(5000)).result(timeout=10)
        finally:
            ring.stop()
            writer.join()
        assert list(Scanner(fd, 8192, cap, trim)) == list(zip(offsets, bodies))
    finally:
        os.close(fd)


@pytest.mark.parametrize("seed", range(16))
def test_ring_model_random_appends_and_trims_over_many_laps(tmp_path, seed):
    """A Ring of 64 KiB driven at random against a model: records of every size near the block
    and lap edges, appended alone or in bursts (several per batch), trims, a ring full at times.
    After every round, the scan from the trim offset gives exactly the records appended since,
    and no write ever lands past the ring's end. One writer thread or two."""
    from _native.walring import Ring
    from _native.walscan import Scanner
    rng = random.Random(seed)
    cap, block, header = 64 * KiB, 4096, 8192
    path = tmp_path / "ring"
    with open(path, "wb") as f:
        f.truncate(header + cap)
    fd = os.open(path, os.O_RDWR)
    start = rng.randrange(0, 5 * cap)
    errors = (wal.WALFullError, wal.WALClosedError, wal.WALIOError, wal.RecordTooLargeError)
    ring = Ring(fd, header, cap, rng.choice([8, 12, 16]) * KiB, rng.choice([2, 4]), 1, start, start,
                bytes(block) if start % block else None, 0.02, 20 * KiB, errors)
    writers = [threading.Thread(target=ring.run_writer) for _ in range(rng.choice([1, 2]))]
    for writer in writers:
        writer.start()
    live: list[tuple[int, bytes]] = []
    trim = start
    sizes = [0, 1, 7, 8, 100, block - 64, block - 33, block - 32, block - 31, block, block + 1, 2 * block - 40,
             9000, 20 * KiB]
    try:
        for _ in range(60):
            burst = [os.urandom(rng.choice(sizes)) for _ in range(rng.choice([1, 1, 2, 3, 5, 8]))]
            handles = []
            for body in burst:
                try:
                    handles.append((ring.append(body), body))
                except wal.WALFullError:
                    break
            for h, body in handles:
                try:
                    live.append((h.result(timeout=10), body))
                except wal.WALFullError:
                    pass        # the record could not be placed in time: never acknowledged
            assert os.fstat(fd).st_size == header + cap, "a write ran past the ring's end"
            assert list(Scanner(fd, header, cap, trim)) == live
            if live and (rng.random() < 0.4 or ring.appended_end - trim > cap * 3 // 4):
                keep = rng.randrange(0, len(live))
                trim = live[keep][0]
                ring.trim(trim)
                del live[:keep]
    finally:
        ring.stop()
        for writer in writers:
            writer.join()
        os.close(fd)
    assert live and live[-1][0] > start + cap       # it went around the ring
