"""No wedge (issue 10, case 6): transient metadata errors are retried, permanent object-store
refusals stop uploads at once with a clear error, and close() is bounded while the store is down;
in every case what was acknowledged stays in the WAL and comes back at the next start."""
from __future__ import annotations

import sqlite3
import threading
import time

import boto3
import pytest

import s3stream
from s3stream import RecordBatch, StreamClient
from s3stream.metadata import SqliteMetadataStore, open_metadata
from s3stream.objectstore import FaultInjectingObjectStore, LocalObjectStore
from conftest import KiB, MiB, lock_node_row, small_config
from test_engine import read_all

CONFIG = small_config(upload_threshold=256 * KiB, split_size=64 * KiB, cache_size=2 * MiB, reclaim_interval=None)


def payloads(stream) -> list[bytes]:
    return [bytes(p) for _, _, p in read_all(stream)]


def restart_and_read(tmp_path, store, meta, stream_id: int) -> list[bytes]:
    """Start node 1 again (recovery replays its WAL) and read the stream back."""
    client = StreamClient(1, str(tmp_path / "n1.wal"), store, meta, CONFIG)
    try:
        return payloads(client.open_stream(stream_id))
    finally:
        client.close()


def closes_within(client: StreamClient, seconds: float, **kw) -> dict:
    """Liveness, not speed: close() must return; a hang fails the test instead of the run."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(client.close(**kw)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"close() did not return within {seconds} s"
    return out


def uploads_go_on_after_the_lock(client: StreamClient, s, release: threading.Timer) -> None:
    """Appends through a metadata lock held until `release` runs: uploads were retried, none failed."""
    for i in range(40):                                 # seals and uploads blocks meanwhile
        s.append(RecordBatch(bytes([i]) * 16 * KiB, 1)).result()
    release.join()
    deadline = time.monotonic() + 60
    while s.committed_offset < 32 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.committed_offset >= 32                     # uploads went on after the lock
    stats = client.stats()["upload"]
    assert stats["prepare_retries"] + stats["commit_retries"] > 0
    assert client._uploader.failure is None
    assert s.append(RecordBatch(b"later", 1)).result().base_offset == 40


def test_metadata_locked_past_its_busy_timeout_is_retried(tmp_path):
    """SQLite: another process holds the database's write lock (PostgreSQL: the next test)."""
    db = str(tmp_path / "meta.db")
    meta = SqliteMetadataStore(db, busy_timeout_s=0.05)
    client = StreamClient(1, str(tmp_path / "n1.wal"), LocalObjectStore(str(tmp_path / "objects")), meta, CONFIG)
    s = client.create_stream()
    # Another process holds SQLite's write lock for a second, 20x the busy timeout.
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    release = threading.Timer(1.0, lambda: other.execute("COMMIT"))
    release.start()
    try:
        uploads_go_on_after_the_lock(client, s, release)
    finally:
        release.cancel()
        client.close()
        other.close()
    got = restart_and_read(tmp_path, LocalObjectStore(str(tmp_path / "objects")), SqliteMetadataStore(db), s.stream_id)
    assert got == [bytes([i]) * 16 * KiB for i in range(40)] + [b"later"]


def test_node_row_locked_past_the_lock_timeout_is_retried(tmp_path, pg_url):
    """PostgreSQL: another session holds the node's row lock past the store's lock_timeout_s."""
    meta = open_metadata(pg_url, lock_timeout_s=0.05)
    client = StreamClient(1, str(tmp_path / "n1.wal"), LocalObjectStore(str(tmp_path / "objects")), meta, CONFIG)
    s = client.create_stream()
    release = lock_node_row(pg_url, 1, 1.0)            # 20x the lock timeout: every commit waits
    try:
        uploads_go_on_after_the_lock(client, s, release)
    finally:
        release.join()
        client.close()
        meta.close()
    got = restart_and_read(tmp_path, LocalObjectStore(str(tmp_path / "objects")), pg_url, s.stream_id)
    assert got == [bytes([i]) * 16 * KiB for i in range(40)] + [b"later"]


def test_permanent_put_refusal_stops_uploads_at_once(tmp_path, metadata_url):
    store = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    meta = metadata_url
    client = StreamClient(1, str(tmp_path / "n1.wal"), store, meta, CONFIG)
    s = client.create_stream()
    acked = []
    store.fail_next_puts(1000, s3stream.ObjectStorePermanentError("injected: access denied"))
    deadline = time.monotonic() + 60
    with pytest.raises(s3stream.ObjectStorePermanentError, match="access denied"):
        i = 0
        while time.monotonic() < deadline:                     # a block fills, its PUT is refused
            i += 1
            s.append(RecordBatch(b"%d" % i, 1)).result()
            acked.append(b"%d" % i)
            s.append(RecordBatch(bytes(8 * KiB), 1)).result()
            acked.append(bytes(8 * KiB))
    assert client.stats()["upload"]["put_retries"] == 0          # refused once, never retried
    report = closes_within(client, 60)
    assert report["left_in_wal"] == [s.stream_id]
    store.clear()
    assert restart_and_read(tmp_path, store, meta, s.stream_id)[:len(acked)] == acked


def test_close_is_bounded_while_the_store_is_down(tmp_path, metadata_url):
    store = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    meta = metadata_url
    client = StreamClient(1, str(tmp_path / "n1.wal"), store, meta, CONFIG)
    s = client.create_stream()
    store.fail_puts_matching(lambda key: True)                  # down: every PUT fails, transiently
    for i in range(10):
        s.append(RecordBatch(b"r%d" % i, 1)).result()
    report = closes_within(client, 60, timeout=1.0, retire=True)
    assert report["left_in_wal"] == [s.stream_id] and report["closed"] == []
    assert not report["retired"]                      # its tail is in the WAL: it must come back
    check = open_metadata(meta)
    assert not check.get_node(1).failover
    check.close()
    assert client.stats()["upload"]["put_retries"] > 0
    store.clear()
    assert restart_and_read(tmp_path, store, meta, s.stream_id) == [b"r%d" % i for i in range(10)]


def test_default_close_timeout_comes_from_config(tmp_path, metadata_url):
    store = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    config = small_config(close_timeout=0.5, reclaim_interval=None)
    client = StreamClient(1, str(tmp_path / "n1.wal"), store, metadata_url, config)
    s = client.create_stream()
    store.fail_puts_matching(lambda key: True)
    s.append(RecordBatch(b"x", 1)).result()
    assert closes_within(client, 60)["left_in_wal"] == [s.stream_id]
    with pytest.raises(s3stream.ConfigError, match="close_timeout"):
        small_config(close_timeout=0)


def test_s3_no_such_bucket_is_permanent(moto_endpoint, tmp_path, metadata_url):
    """The real S3 path: the bucket is deleted under a running node."""
    bucket = "wedge-" + str(int(time.time() * 1000))
    url = f"s3://{bucket}/data?endpoint_url={moto_endpoint}&create_bucket=1&max_attempts=2"
    meta = metadata_url
    client = StreamClient(1, str(tmp_path / "n1.wal"), url, meta, CONFIG)
    s = client.create_stream()
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                      aws_access_key_id="test", aws_secret_access_key="test")
    s3.delete_bucket(Bucket=bucket)
    deadline = time.monotonic() + 60                          # liveness bound, not a speed goal
    with pytest.raises(s3stream.ObjectStorePermanentError, match="does not exist"):
        i = 0
        while time.monotonic() < deadline:                     # until the refused PUT reaches appends
            s.append(RecordBatch(bytes([i % 256]) * 4 * KiB, 1)).result()
            i += 1
    report = closes_within(client, 60)
    assert report["left_in_wal"] == [s.stream_id]
    s3.create_bucket(Bucket=bucket)
    got = restart_and_read(tmp_path, url, meta, s.stream_id)
    assert got and all(p == bytes([i % 256]) * 4 * KiB for i, p in enumerate(got))


def test_a_stream_close_that_runs_out_of_time_says_so_and_keeps_the_data(tmp_path, metadata_url):
    store = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    meta = metadata_url
    client = StreamClient(1, str(tmp_path / "n1.wal"), store, meta, CONFIG)
    s = client.create_stream()
    store.fail_puts_matching(lambda key: True)
    s.append(RecordBatch(b"kept", 1)).result()
    with pytest.raises(s3stream.OperationTimeoutError, match="stays in the WAL") as e:
        s.close(0.2)
    assert isinstance(e.value, TimeoutError)
    store.clear()
    client.close()
    assert restart_and_read(tmp_path, store, meta, s.stream_id) == [b"kept"]


def test_a_full_object_store_is_named_when_appends_back_up(tmp_path, metadata_url):
    """A store out of space (ENOSPC on every PUT, retried: space may come back) fills the cache;
    the append that times out names the store's error, not the WAL's capacity."""
    import errno
    store = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    config = small_config(upload_threshold=256 * KiB, split_size=64 * KiB, cache_size=512 * KiB, append_timeout=0.5,
                          reclaim_interval=None)
    client = StreamClient(1, str(tmp_path / "n1.wal"), store, metadata_url, config)
    s = client.create_stream()
    store.fail_next_puts(10**6, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(s3stream.WALFullError, match="No space left on device"):
        for _ in range(100):
            s.append(RecordBatch(bytes(64 * KiB), 1)).result(30)
    store.clear()
    closes_within(client, 60)
