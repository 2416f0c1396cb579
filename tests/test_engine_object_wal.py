"""The engine on a WAL kept as objects (wal_path=s3://... or objects+URL): kill -9 of a node
whose host is then gone, failed over by a peer that reads its WAL from the store alone."""
from __future__ import annotations

import random
import shutil

from s3stream import StreamClient
from s3stream.failover import fail_over
from s3stream.metadata import open_metadata
from s3stream.objectstore import open_object_store
from conftest import small_config
from test_engine_faults import committed_objects_all_stored, run_child, verify_after_crash


def test_kill9_then_a_peer_fails_over_from_the_store(tmp_path, metadata_url):
    """Node 1 appends with its WAL on the store and is killed with its host (its directory is
    deleted); node 2, which never saw that host, fails it over and reads every acknowledged
    batch. Node 1 then starts again on a new host, over the same WAL URL."""
    url = f"file://{tmp_path}/objects"
    wal_url = f"objects+file://{tmp_path}/wal-objects"
    rng = random.Random(27)
    (tmp_path / "peer").mkdir()
    peer = StreamClient(2, tmp_path / "peer" / "node2.wal", url, metadata_url, small_config(reclaim_interval=None))
    meta = open_metadata(metadata_url)
    store = open_object_store(url)
    total = 0
    try:
        for rnd in range(3):
            host = tmp_path / f"host{rnd}"
            host.mkdir()
            if rnd:
                shutil.copy(tmp_path / "stream_ids", host / "stream_ids")
            acks = run_child(host, rnd, nstreams=3, rng=rng, url=url, metadata_url=metadata_url,
                             wal_location=wal_url)
            if rnd == 0:
                shutil.copy(host / "stream_ids", tmp_path / "stream_ids")
            shutil.rmtree(host)                     # the host died with its disk
            host.mkdir()
            shutil.copy(tmp_path / "stream_ids", host / "stream_ids")
            report = fail_over(1, store=store, metadata=meta)
            assert report.records > 0
            total += verify_after_crash(host, rnd, acks, url, metadata_url, client=peer)
    finally:
        peer.close()
        store.close()
        meta.close()
    assert total > 50
    committed_objects_all_stored(url, metadata_url)
