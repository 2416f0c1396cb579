"""The engine on a WAL kept as objects (wal_path=s3://... or objects+URL): kill -9 of a node
whose host is then gone, failed over by a peer that reads its WAL from the store alone; round
trips with the WAL on moto's server and SeaweedFS; a store ignoring conditional writes (rclone)
refused."""
from __future__ import annotations

import random
import shutil

import pytest

import wal
from s3stream import ConfigError, RecordBatch, S3StreamError, StreamClient
from s3stream.engine.failover import fail_over
from s3stream.metadata import open_metadata
from s3stream.objectstore import open_object_store
from conftest import small_config
from test_engine import read_all, write_random
from test_engine_faults import committed_objects_all_stored, run_child, verify_after_crash


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("store_url", ["moto", "seaweedfs"], indirect=True)
def test_round_trip_with_the_wal_on_an_s3_server(tmp_path, store_url):
    """Node 1's WAL and objects on one S3 server (moto's, SeaweedFS): it appends, is abandoned
    without a close (its process gone), and node 2, with its own WAL on the server too, fails it
    over and reads everything back."""
    meta_url = f"sqlite:///{tmp_path}/meta.db"
    wal_url = store_url.replace("/data?", "/wal?")
    rng = random.Random(7)
    a = StreamClient(1, wal_url, store_url, meta_url, small_config())
    assert isinstance(a.write_ahead_log, wal.ObjectWAL)
    streams = [a.create_stream() for _ in range(4)]
    expected = write_random(streams, rng, 300)
    assert a.write_ahead_log.stats()["puts"] >= 1
    meta = open_metadata(meta_url)
    store = open_object_store(store_url)
    try:
        report = fail_over(1, store=store, metadata=meta)
        assert report.streams_closed == 4
        with pytest.raises(S3StreamError, match="fenced"):   # node 1 was fenced (metadata and store)
            streams[0].append(RecordBatch(b"late")).result(10)
        b = StreamClient(2, wal_url, store_url, meta_url, small_config())
        for sid, batches in expected.items():
            assert read_all(b.open_stream(sid)) == batches
        b.close()
    finally:
        a.close(timeout=5)
        store.close()
        meta.close()


@pytest.mark.parametrize("store_url", ["rclone"], indirect=True)
def test_a_store_ignoring_conditional_writes_is_refused(tmp_path, store_url):
    """rclone's serve s3 overwrites on If-None-Match: * (tests/objectstore/test_s3_servers.py): a WAL there
    could not fence a paused node. Refused at start, naming the store, unless the URL accepts
    the weaker epoch check."""
    meta_url = f"sqlite:///{tmp_path}/meta.db"
    wal_url = store_url.replace("/data?", "/wal?")
    with pytest.raises(ConfigError, match="ignores conditional writes") as e:
        StreamClient(1, wal_url, store_url, meta_url, small_config())
    assert wal_url.split("?")[0].split("/wal")[0] in str(e.value)
    c = StreamClient(1, wal_url + "&wal_fencing=epoch", store_url, meta_url, small_config())
    s = c.create_stream()
    assert s.append(RecordBatch(b"x" * 100)).result(10).base_offset == 0
    c.close()
