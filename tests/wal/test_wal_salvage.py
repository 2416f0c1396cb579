"""Damage in the middle of the WAL (issue 10, case 1): a torn tail is truncated, but a damaged
record followed by acknowledged ones is refused by name, nothing written, and can be salvaged
(API and CLI) keeping every record after the damaged span; the engine then keeps each stream up
to its first gap and reports what it drops."""
from __future__ import annotations

import struct

import pytest
from click.testing import CliRunner

import s3stream
import wal
from s3stream import RecordBatch, StreamClient
from s3stream.cli import main as cli
from wal.header import Header, decode_slot
from conftest import MiB, damage, small_config
from test_engine import read_all
from test_engine_model import crash
from test_wal_torn import _abandon

HEADER_AREA = 8192


def write_sync(target, n: int = 200, size: int = 1000, **config) -> list[wal.AppendHandle]:
    """n records appended one at a time (each its own batch), all acknowledged; then a crash."""
    w = target.open(**config) if config else target.open()
    handles = []
    for i in range(n):
        h = w.append(bytes([i % 251]) * size)
        h.result()
        handles.append(h)
    _abandon(w)
    return handles


def flip(path: str, logical: int) -> None:
    with open(path, "rb") as f:
        f.seek(HEADER_AREA + logical)
        byte = f.read(1)[0]
    damage(path, HEADER_AREA + logical, bytes([byte ^ 0x10]))


def image(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("where", ["body", "header"])
def test_damage_mid_log_is_refused_by_name_and_nothing_is_written(wal_target, where):
    handles = write_sync(wal_target)
    bad = handles[100]
    flip(wal_target.path, bad.offset + (40 if where == "body" else 9))
    before = image(wal_target.path)
    w = wal_target.open()
    with pytest.raises(wal.WALMidLogCorruptError) as e:
        list(w.recover())
    w.close()
    assert isinstance(e.value, wal.WALCorruptError)
    assert (e.value.bad_offset, e.value.records_after) == (bad.offset, 99)
    assert e.value.resync_offset == handles[101].offset and e.value.end == handles[-1].end + (-handles[-1].end) % 4096
    assert str(bad.offset) in str(e.value) and "wal-salvage" in str(e.value)
    # Starting a writer session is refused the same way, before any header is written.
    w = wal_target.open()
    with pytest.raises(wal.WALMidLogCorruptError):
        w.start()
    w.close()
    assert image(wal_target.path) == before


def test_salvage_keeps_every_record_after_the_damaged_span(wal_target):
    handles = write_sync(wal_target)
    flip(wal_target.path, handles[100].offset + 500)
    before = image(wal_target.path)
    dry = wal.salvage(wal_target.path)
    assert dry["damaged"] and not dry["applied"]
    assert (dry["bad_offset"], dry["resync_offset"], dry["records_after"], dry["records_before"]) == (
        handles[100].offset, handles[101].offset, 99, 100)
    assert image(wal_target.path) == before                      # a dry run writes nothing
    done = wal.salvage(wal_target.path, apply=True)
    assert done["applied"] and done["valid_end"] >= handles[-1].end
    with wal_target.open() as w:
        recs = [r.data for r in w.recover()]
        assert w.salvaged_end == done["end"]
    assert recs == [bytes([i % 251]) * 1000 for i in range(200) if i != 100]
    again = wal.salvage(wal_target.path)                         # idempotent: nothing left to do
    assert not again["damaged"]


def test_damage_in_the_last_batch_is_a_torn_tail(wal_target):
    handles = write_sync(wal_target, n=50)
    flip(wal_target.path, handles[-1].offset + 100)
    with wal_target.open() as w:
        assert len(list(w.recover())) == 49


def test_damage_followed_only_by_unwritten_space_is_a_torn_tail(wal_target):
    """A crash mid-write: the record is damaged and nothing after it landed."""
    handles = write_sync(wal_target, n=50)
    start = handles[30].offset + 64
    damage(wal_target.path, HEADER_AREA + start, bytes(handles[-1].end + 4096 - start))
    with wal_target.open() as w:
        assert len(list(w.recover())) == 30
        assert w.recovery_result.end == handles[30].offset      # past record 29 and its padding
    assert not wal.salvage(wal_target.path)["damaged"]


def test_batches_in_flight_with_several_writers_are_allowed_for(tmp_path):
    """With writer threads, a crash may leave up to `buffers` whole batches after one that did
    not land; the header records that, so such a tail is truncated, not refused."""
    path = str(tmp_path / "w.wal")
    cfg = wal.WALConfig(capacity=4 * MiB, writer_threads=2, buffers=4)
    w = wal.WriteAheadLog.open(path, node_id=1, config=cfg)
    handles = []
    for i in range(40):
        h = w.append(bytes([i]) * 900)
        h.result()
        handles.append(h)
    _abandon(w)
    header = decode_slot(image(path)[:4096])[1] or decode_slot(image(path)[4096:8192])[1]
    assert (header.inflight_batches, header.batch_bytes) == (4, cfg.batch_bytes + 4096)
    # The record 4 batches from the end did not land; the 3 after it did.
    flip(path, handles[-4].offset + 50)
    with wal.WriteAheadLog.open(path, node_id=1, config=cfg) as w:
        assert len(list(w.recover())) == 36
    # 30 whole batches after the damage are more than any crash leaves.
    flip(path, handles[-4].offset + 50)
    flip(path, handles[5].offset + 50)
    with pytest.raises(wal.WALMidLogCorruptError) as e:
        with wal.WriteAheadLog.open(path, node_id=1, config=cfg) as w:
            list(w.recover())
    assert e.value.bad_offset == handles[5].offset and e.value.records_after == 34


def test_header_extension_round_trips_and_old_headers_are_never_judged():
    h = Header(capacity=1 << 20, trim_offset=4096, write_seq=3, write_time_ns=1, node_id=7, node_epoch=2,
               generation=5, clean_shutdown=False, clean_end=0, inflight_batches=4, batch_bytes=1 << 20,
               salvaged_end=123456)
    assert decode_slot(h.encode()) == ("valid", h)
    old = bytearray(h.encode())
    old[84:104] = bytes(20)                  # what a writer before the extension left there
    state, decoded = decode_slot(bytes(old))
    assert state == "valid"
    assert (decoded.inflight_batches, decoded.batch_bytes, decoded.salvaged_end) == (0, 0, 0)
    torn = bytearray(h.encode())
    torn[90] ^= 1                            # a damaged extension reads as unknown, not as garbage
    assert decode_slot(bytes(torn))[1].batch_bytes == 0


def test_cli_salvage_reports_then_writes(tmp_path):
    path = str(tmp_path / "w.wal")
    w = wal.WriteAheadLog.open(path, node_id=1, config=wal.WALConfig(capacity=4 * MiB))
    handles = [w.append(b"x" * 700) for _ in range(30)]
    for h in handles:
        h.result()
    w.close()
    runner = CliRunner()
    r = runner.invoke(cli, ["wal-salvage", path])
    assert r.exit_code == 1 and "nothing to salvage" in r.output
    # Damage a record in the middle of a log whose writer crashed (no clean shutdown).
    w = wal.WriteAheadLog.open(path, node_id=1, config=wal.WALConfig(capacity=4 * MiB))
    more = []
    for i in range(20):
        h = w.append(b"y" * 700)
        h.result()
        more.append(h)
    _abandon(w)
    flip(path, more[3].offset + 40)
    before = image(path)
    r = runner.invoke(cli, ["wal-salvage", path])
    assert r.exit_code == 0 and "would cover" in r.output and str(more[3].offset) in r.output
    assert image(path) == before
    r = runner.invoke(cli, ["wal-salvage", path, "--yes", "--json"])
    assert r.exit_code == 0, r.output
    assert '"applied": true' in r.output
    with wal.WriteAheadLog.open(path, node_id=1) as w:
        assert len(list(w.recover())) == 30 + 20 - 1
    r = runner.invoke(cli, ["wal-salvage", str(tmp_path / "missing.wal")])
    assert r.exit_code != 0


def _record_of(path: str, stream_id: int, base: int) -> int:
    """Logical WAL offset of the engine record of `stream_id` at `base`."""
    header = decode_slot(image(path)[:4096])[1] or decode_slot(image(path)[4096:8192])[1]
    with wal.WriteAheadLog.open(path, node_id=header.node_id, node_epoch=header.node_epoch, recovery=True) as w:
        for r in w.recover():
            sid, _epoch, b, _n = struct.unpack_from("<QQQI", r.data)
            if (sid, b) == (stream_id, base):
                return r.offset
    raise AssertionError("record not found")


def test_engine_refuses_a_damaged_wal_then_salvage_keeps_the_other_streams(tmp_path):
    wal_path = str(tmp_path / "node1.wal")
    store, meta = f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db"
    config = small_config(upload_threshold=4 * MiB, cache_size=16 * MiB, reclaim_interval=None)
    client = StreamClient(1, wal_path, store, meta, config)
    streams = [client.create_stream() for _ in range(3)]
    for i in range(60):
        for s in streams:
            s.append(RecordBatch(f"{s.stream_id}:{i}".encode() * 20, 1)).result()
    ids = [s.stream_id for s in streams]
    crash(client)
    victim = _record_of(wal_path, ids[1], 30)
    flip(wal_path, victim + 100)
    before = image(wal_path)
    with pytest.raises(s3stream.WALCorruptError) as e:
        StreamClient(1, wal_path, store, meta, config)
    assert isinstance(e.value, s3stream.WALError) and e.value.bad_offset == victim
    assert e.value.records_after > 80 and "wal-salvage" in str(e.value)
    assert image(wal_path) == before                   # no trim, nothing overwritten
    report = wal.salvage(wal_path, apply=True)
    assert report["bad_offset"] == victim
    client = StreamClient(1, wal_path, store, meta, config)
    try:
        assert client.recovered["dropped"] == {ids[1]: dict(from_offset=30, records=29)}
        handles = {sid: client.open_stream(sid) for sid in ids}
        got = {sid: [(base, bytes(payload)) for base, _, payload in read_all(h)] for sid, h in handles.items()}
        for sid in (ids[0], ids[2]):
            assert got[sid] == [(i, f"{sid}:{i}".encode() * 20) for i in range(60)]
        assert got[ids[1]] == [(i, f"{ids[1]}:{i}".encode() * 20) for i in range(30)]
        # The damaged stream goes on from where it now ends.
        assert handles[ids[1]].append(RecordBatch(b"after", 1)).result().base_offset == 30
    finally:
        client.close()
