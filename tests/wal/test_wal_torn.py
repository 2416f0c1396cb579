"""Torn and corrupt tails: recovery returns exactly the intact prefix, on files and block devices."""
from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest

import wal
from wal import reference
from conftest import KiB, damage, read_data_area

HEADER_AREA = 8192


def write_log(target, seed: int, n: int = 120) -> list[tuple[int, int, bytes]]:
    """Append n random records in small groups (several batches); return (offset, end, body).
    The WAL is left without a clean shutdown, as after a crash."""
    rng = random.Random(seed)
    out = []
    w = target.open()
    for i in range(n):
        body = rng.randbytes(rng.choice([1, 40, 500, 3000, 4070, 9000]))
        h = w.append(body)
        out.append((h, body))
        if i % 7 == 6:
            h.result()
    w.sync()
    recs = [(h.offset, h.end, body) for h, body in out]
    _abandon(w)
    return recs


def _abandon(w: wal.WriteAheadLog) -> None:
    """Stop writers and release the file without a clean-shutdown header (a crash, as the
    on-disk state goes: everything acknowledged is already durable)."""
    import os
    if w._filler is not None:       # a crash stops every thread, the first fill's included
        w._filler.stop()
    w._ring.stop()
    for t in w._writers:
        t.join()
    w._closed = True
    os.close(w._fd)


def recover_all(target) -> tuple[list[tuple[int, bytes]], int]:
    with target.open() as w:
        recs = [(r.offset, r.data) for r in w.recover()]
        return recs, w.recovery_result.end


def expected_prefix(records, damaged_at: int):
    """Records that lie wholly before a damaged byte at logical `damaged_at`."""
    return [(o, b) for o, e, b in records if e <= damaged_at]


def check_against_reference(target, recs) -> None:
    cap = target.capacity - HEADER_AREA
    with target.open(recovery=True) as w:
        start = w.trim_offset
    ref, _ = reference.scan(read_data_area(target.path)[:cap], cap, start)
    assert recs == ref


@pytest.mark.parametrize("seed", range(4))
def test_flipped_byte_in_tail_records(wal_target, seed):
    records = write_log(wal_target, seed)
    rng = random.Random(100 + seed)
    image = bytearray(open(wal_target.path, "rb").read())
    for _ in range(12):
        # A byte of the header or body of one of the last 25 records.
        idx = rng.randrange(len(records) - 25, len(records))
        offset, end, body = records[idx]
        pos = rng.randrange(offset, end)
        damage(wal_target.path, HEADER_AREA + pos, bytes([image[HEADER_AREA + pos] ^ (1 << rng.randrange(8))]))
        before = open(wal_target.path, "rb").read()
        try:
            recs, _ = recover_all(wal_target)
        except wal.WALMidLogCorruptError as e:
            # Whole batches of acknowledged records follow the damage: refused, not truncated.
            assert e.bad_offset == offset and e.records_after > 0
            assert e.resync_offset > pos and e.end == records[-1][1] + (-records[-1][1]) % 4096
            assert open(wal_target.path, "rb").read() == before        # nothing written
        else:
            assert recs == [(o, b) for o, _, b in records[:idx]]
            check_against_reference(wal_target, recs)
        # Restore the byte, and the header (a writer session rewrote it), for the next round.
        damage(wal_target.path, 0, bytes(image))


@pytest.mark.parametrize("seed", range(4))
def test_torn_tail_truncated_at_many_positions(wal_target, seed):
    """Zero everything from a position in the last records on (the writes never landed)."""
    records = write_log(wal_target, seed)
    rng = random.Random(200 + seed)
    image = bytes(open(wal_target.path, "rb").read())
    positions = [rng.randrange(records[-30][0], records[-1][1]) for _ in range(10)]
    positions += [records[-1][1] - 1, records[-5][0], records[-5][0] + 31, records[-5][0] + 32]
    for pos in positions:
        damage(wal_target.path, HEADER_AREA + pos, bytes(len(image) - HEADER_AREA - pos))
        recs, _ = recover_all(wal_target)
        assert recs == expected_prefix(records, pos)
        check_against_reference(wal_target, recs)
        damage(wal_target.path, 0, image)


def test_torn_sector_in_the_middle_of_a_batch(wal_target):
    """One 512-byte sector of a multi-record batch did not land: recovery stops before it even
    though later records of the same batch are intact."""
    records = write_log(wal_target, 9)
    offset, end, _ = records[-10]
    sector = (offset + 40) // 512 * 512
    damage(wal_target.path, HEADER_AREA + sector, bytes(512))
    try:
        recs, _ = recover_all(wal_target)
    except wal.WALMidLogCorruptError as e:
        # With one writer thread a later batch lands only after this one did: if more than one
        # whole batch follows, the sector was lost after it was acknowledged (not torn by a crash).
        assert e.bad_offset <= sector < e.resync_offset and e.records_after > 0
    else:
        assert recs == expected_prefix(records, sector)
        assert len(recs) < len(records) - 9


def test_new_session_after_torn_tail_never_revives_stale_records(wal_target):
    """A torn write leaves an intact record C after a torn B. The next session overwrites B
    with D, ending exactly where C starts. C (older generation) must not follow D."""
    w = wal_target.open()
    a = w.append(b"A" * 100)
    a.result()
    b = w.append(b"B" * 5000)
    b.result()
    c = w.append(b"C" * 100)
    c.result()
    _abandon(w)
    assert b.offset % 4096 == 0 and c.offset == b.offset + 2 * 4096  # B took 2 blocks
    damage(wal_target.path, HEADER_AREA + b.offset + 2000, b"\xee")  # B torn, C intact
    w = wal_target.open()
    assert [r.data for r in w.recover()] == [b"A" * 100]
    d = w.append(b"D" * 5000)     # same size as B: its batch ends where C starts
    d.result()
    assert (d.offset, d.end) == (b.offset, b.end)
    _abandon(w)
    with wal_target.open() as w:
        datas = [r.data for r in w.recover()]
        assert w.recovery_result.stop_reason.startswith("record from an earlier writer session")
    assert datas == [b"A" * 100, b"D" * 5000]


def test_session_resumes_inside_a_torn_block(wal_target):
    """The valid run ends mid-block (the rest of the log torn). The new session rewrites that
    block with the same leading bytes, so the old records and the new ones all recover."""
    w = wal_target.open()
    hs = [w.append(b"%04d" % i * 50) for i in range(40)]
    w.sync()
    _abandon(w)
    # Group commit decides the batches, so find a record that starts inside a block holding
    # three earlier records, and tear the log from there on. Not that record alone: whole
    # batches after it would be more than a torn write leaves (how many depends on how the
    # appends were grouped), which recovery refuses as damage mid-log (test_wal_salvage).
    k = next(i for i in range(3, len(hs)) if hs[i].offset // 4096 == hs[i - 3].offset // 4096)
    end = (hs[-1].offset // 4096 + 2) * 4096
    damage(wal_target.path, HEADER_AREA + hs[k].offset, bytes(end - hs[k].offset))
    w = wal_target.open()
    assert len(list(w.recover())) == k
    assert w.recovery_result.end % 4096 != 0
    new = [w.append(b"new%d" % i) for i in range(3)]
    w.sync()
    assert new[0].offset == hs[k].offset
    w.close()
    with wal_target.open() as w:
        datas = [r.data for r in w.recover()]
    assert datas == [b"%04d" % i * 50 for i in range(k)] + [b"new0", b"new1", b"new2"]


def test_killed_during_header_write_keeps_previous_slot(tmp_path):
    """A header write torn across the slot: the other slot still holds a valid header."""
    p = tmp_path / "w"
    cfg = wal.WALConfig(capacity=1 * 1024 * KiB)
    with wal.WriteAheadLog.open(p, node_id=1, config=cfg) as w:
        hs = [w.append(b"x%d" % i) for i in range(5)]
        hs[-1].result()
        w.trim(hs[2].offset)
        seq = w.header.write_seq
    # tear the slot of the last write in its second half (CRC no longer matches)
    damage(str(p), (w.header.write_seq % 2) * 4096 + 60, b"\x00" * 20)
    with wal.WriteAheadLog.open(p, node_id=1, config=cfg) as w2:
        assert w2.header.write_seq == w.header.write_seq - 1 >= seq
        assert [r.data for r in w2.recover()] == [b"x2", b"x3", b"x4"]


@pytest.mark.slow
def test_abandoned_process_state_matches_crash(tmp_path):
    """Sanity for the helpers above: a child that exits without closing leaves the same state."""
    p = tmp_path / "w"
    code = textwrap.dedent(f"""
        import os, wal
        w = wal.WriteAheadLog.open({str(p)!r}, node_id=1, config=wal.WALConfig(capacity=1 << 20))
        for i in range(50):
            w.append(b"r%d" % i)
        w.sync()
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", code], check=True)
    with wal.WriteAheadLog.open(p, node_id=1) as w:
        assert not w.previous_shutdown_clean
        assert [r.data for r in w.recover()] == [b"r%d" % i for i in range(50)]
