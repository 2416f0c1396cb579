"""The engine over S3 implementations other than moto (tests/s3servers.py): SeaweedFS, and
rclone's serve s3, which answers ranged GETs with the whole object's checksum (every read of an
object block failed there with "Expected checksum ... did not match" before the store stopped
validating ranges). The object-store contract over both is in test_objectstore.py."""
from __future__ import annotations

import random

import pytest

from s3stream.objectstore import S3ObjectStore, open_object_store, probe_conditional_put
from test_engine import client, read_all, write_random


@pytest.mark.slow
@pytest.mark.parametrize("store_url", ["seaweedfs", "rclone"], indirect=True)
def test_engine_round_trip(tmp_path, store_url):
    """Node 1 appends to a dozen streams and closes them (uploads); node 2 opens them and reads
    everything back from the objects: index and block reads are ranged GETs."""
    meta = f"sqlite:///{tmp_path}/meta.db"
    rng = random.Random(27)
    a = client(tmp_path, 1, store_url, meta)
    streams = [a.create_stream() for _ in range(12)]
    expected = write_random(streams, rng, 400, hot=streams[:2])
    for s in streams:
        s.close()
    a.close()

    b = client(tmp_path, 2, store_url, meta)
    for sid, batches in expected.items():
        assert read_all(b.open_stream(sid)) == batches
    store = b.object_store
    assert isinstance(store, S3ObjectStore)
    assert store.stats()["get"] > len(expected)     # every byte came from the store
    b.close()


@pytest.mark.parametrize("store_url, honours", [("seaweedfs", True), ("rclone", False)], indirect=["store_url"])
def test_probe_through_a_store_url(store_url, honours):
    """What a WAL on the store would probe at start, through the URL a user gives."""
    store = open_object_store(store_url)
    try:
        assert probe_conditional_put(store) is honours
    finally:
        store.close()
