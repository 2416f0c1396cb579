"""A flipped byte anywhere in an object (block header, payload, index, footer) makes a read raise
CorruptDataError; it never returns bytes that differ from what was written. Both ways of reading
an object are covered: a small StreamObject read whole in one GET, and footer -> index -> ranged
block GETs (StreamSetObjects, and StreamObjects larger than four GETs)."""
from __future__ import annotations

import random
import time

import pytest

import s3stream
from s3stream import FetchedBatch, RecordBatch, StreamClient
from s3stream.engine.logcache import LogCache
from s3stream.metadata import ObjectState, ObjectType, SqliteMetadataStore
from s3stream.objectformat import read_index
from s3stream.objectstore import LocalObjectStore
from s3stream.engine.readpath import Reader

from conftest import KiB, MiB, small_config

# Streams of a few blocks each: one large enough for its own StreamObject, two that share a
# StreamSetObject. Batches of varied sizes, so blocks hold several of them.
SIZES = {0: 300 * KiB, 1: 40 * KiB, 2: 24 * KiB}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("corrupt")
    rng = random.Random(7)
    data: dict[int, list[bytes]] = {}
    client = StreamClient(1, root / "n1.wal", f"file://{root}/objects", f"sqlite:///{root}/meta.db",
                          small_config(object_block_size=16 * KiB))
    streams = [client.create_stream() for _ in SIZES]
    for s, total in zip(streams, SIZES.values()):
        batches, size = [], 0
        while size < total:
            payload = rng.randbytes(rng.choice((100, 1000, 3000, 9000)))
            batches.append(payload)
            size += len(payload)
        for payload in batches:
            s.append(RecordBatch(payload, 1 + len(payload) % 3))
        data[s.stream_id] = batches
    client.force_upload(30)             # the background's objects (SSOs, split SOs), not closes' tails
    for s in streams:
        s.close()
    client.close()
    return root, data


def _read_everything(root, data, config, max_bytes: int) -> tuple[dict[int, list[bytes]], dict]:
    """Every stream read from offset 0 by a fresh reader (nothing cached); and its stats."""
    meta = SqliteMetadataStore(str(root / "meta.db"))
    reader = Reader(LocalObjectStore(str(root / "objects")), meta,
                    LogCache(1 * MiB, 2 * MiB, time.monotonic_ns, FetchedBatch), config)
    out = {}
    try:
        for sid in data:
            end = meta.get_stream(sid).end_offset
            got, pos = [], 0
            while pos < end:
                batches = reader.read(sid, pos, end, max_bytes)
                got += [bytes(b.payload) for b in batches]
                pos = batches[-1].end_offset
            out[sid] = got
        stats = reader.snapshot()
    finally:
        reader.close()
        meta.close()
    return out, stats


def _positions(root, size: int, key: str, rng: random.Random) -> list[int]:
    """Every byte of the footer, the index and each block's header, plus a sample of payload bytes."""
    index = read_index(LocalObjectStore(str(root / "objects")), key, size)
    index_start = max(e.block_position + e.block_size for e in index)
    picks = set(range(index_start, size))
    for e in index:
        picks.update(range(e.block_position, e.block_position + 48))   # block header + first batch header
        picks.update(rng.sample(range(e.block_position, e.block_position + e.block_size), 6))
    return sorted(picks)


@pytest.mark.parametrize("fetch, max_bytes", [(16 * KiB, 64 * KiB), (4 * MiB, 1 * MiB)],
                         ids=["ranged-gets", "whole-objects"])
@pytest.mark.slow
def test_a_flipped_byte_anywhere_raises_never_returns_wrong_bytes(written, fetch, max_bytes):
    root, data = written
    config = small_config(read_fetch_size=fetch, object_block_size=16 * KiB, block_cache_size=16 * MiB)

    def read_all():
        return _read_everything(root, data, config, max_bytes)[0]

    got, stats = _read_everything(root, data, config, max_bytes)
    assert got == data
    assert (stats["whole_object_reads"] > 0) == (fetch == 4 * MiB)      # both ways of reading are covered
    meta = SqliteMetadataStore(str(root / "meta.db"))
    objects = meta.list_objects(state=ObjectState.COMMITTED)
    meta.close()
    assert {o.type for o in objects} == {ObjectType.STREAM_OBJECT, ObjectType.STREAM_SET_OBJECT}
    rng = random.Random(fetch)
    caught = tried = 0
    for obj in objects:
        path = root / "objects" / obj.key
        good = path.read_bytes()
        positions = _positions(root, obj.size, obj.key, rng)
        tried += len(positions)
        try:
            for pos in positions:
                bad = bytearray(good)
                bad[pos] ^= 1 << rng.randrange(8)
                path.write_bytes(bytes(bad))
                try:
                    got = read_all()
                except s3stream.CorruptDataError:
                    caught += 1
                    continue
                assert got == data, f"{obj.key}: a flipped bit at byte {pos} of {obj.size} returned wrong bytes"
        finally:
            path.write_bytes(good)
    # Every position sampled is covered by a check: nothing passes unnoticed either.
    assert caught == tried
    assert read_all() == data          # stored data intact once repaired
