"""No acknowledgment after a fence (issue 26, item 1): the WAL's acknowledgment deadline, the
engine's lease and its one fenced state."""
from __future__ import annotations

import threading
import time

import pytest

import wal
from s3stream import LeaseExpiredError, RecordBatch, StreamClient, StreamFencedError
from s3stream.cluster import ClusterConfig
from s3stream.errors import ConfigError
from conftest import small_config


# ---- the WAL ---------------------------------------------------------------------------------

def test_wal_holds_acknowledgments_past_the_deadline_until_renewed(wal_target):
    log = wal_target.open()
    try:
        log.set_ack_deadline(time.monotonic_ns() - 1)        # the lease ran out already
        handle = log.append(b"held")
        assert log.sync(5)                                   # durable...
        assert not handle.done() and log.acked_end < log.durable_end    # ...not acknowledged
        with pytest.raises(TimeoutError):
            handle.result(0.05)
        log.set_ack_deadline(time.monotonic_ns() + 10**9)    # renewed: acknowledged at once
        assert handle.result(0) == handle.offset
        assert log.acked_end == log.durable_end
        log.set_ack_deadline(None)                           # no deadline: acknowledged when durable
        assert log.append(b"free").result(5) >= 0
    finally:
        log.close()


def test_wal_revoked_acknowledgments_fail_and_callbacks_run(wal_target):
    log = wal_target.open()
    try:
        log.set_ack_deadline(time.monotonic_ns() - 1)
        seen = []
        handle = log.append(b"never", callback=lambda h: seen.append(h.exception()))
        assert log.sync(5)
        fenced = RuntimeError("fenced")
        log.revoke_acks(fenced)
        assert handle.exception(1) is fenced
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [fenced]
        log.set_ack_deadline(None)                           # revoked for good: no effect
        assert log.append(b"after").exception(1) is fenced
        assert log.acked_end < log.durable_end
    finally:
        log.close()


def test_wal_acknowledges_only_what_was_durable_before_the_deadline(wal_target):
    """Appends racing a deadline: every one acknowledged completed (per the WAL's completion
    log) before the deadline; the others are held, then revoked."""
    log = wal_target.open()
    try:
        deadline = time.monotonic_ns() + 30_000_000          # 30 ms of lease
        log.set_ack_deadline(deadline)
        handles = []
        end = time.monotonic() + 0.1
        while time.monotonic() < end:
            handles.append(log.append(b"x" * 100))
            time.sleep(0.0005)
        assert log.sync(5)
        acked = [h for h in handles if h.done()]
        held = [h for h in handles if not h.done()]
        assert acked and held
        for h in acked:
            assert h.completed_ns < deadline
        assert all(h.end > acked[-1].end for h in held)      # in offset order
        log.revoke_acks(RuntimeError("gone"))
        assert all(isinstance(h.exception(1), RuntimeError) for h in held)
    finally:
        log.close()


# ---- the engine ------------------------------------------------------------------------------

@pytest.fixture
def client(tmp_path):
    c = StreamClient(1, tmp_path / "n1.wal", f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db",
                     small_config())
    yield c
    c.close()


def test_engine_refuses_appends_once_the_lease_runs_out(client):
    stream = client.create_stream()
    assert client.lease_remaining is None                   # no lease: acknowledged when durable
    stream.append(RecordBatch(b"a")).result(5)
    client.renew_lease(time.monotonic_ns(), 0.2)
    assert 0 < client.lease_remaining <= 0.2
    stream.append(RecordBatch(b"b")).result(5)
    time.sleep(0.25)
    client.lease_renewal_failed("metadata database x: connection refused")
    with pytest.raises(LeaseExpiredError, match="lease ran out .* connection refused"):
        stream.append(RecordBatch(b"c"))
    assert stream.next_offset == 2                          # the refused append took no offset
    assert client.stats()["append"]["lease_refusals"] == 1
    client.renew_lease(time.monotonic_ns(), 5.0)            # renewed: appends resume
    assert stream.append(RecordBatch(b"d")).result(5).base_offset == 2
    assert client.stats()["lease"]["remaining_seconds"] > 4


def test_engine_fence_fails_what_is_not_acknowledged_and_stops(client):
    """Appenders racing a lapse of the lease, then the fence: every append either was
    acknowledged (before), or failed with StreamFencedError (held, then revoked), or was
    refused (LeaseExpiredError / StreamFencedError); none stays pending, and the readable
    confirm offset is the end of what was acknowledged."""
    stream = client.create_stream()
    client.renew_lease(time.monotonic_ns(), 0.05)
    futures, refused = [], []
    stop = threading.Event()

    def produce():
        while not stop.is_set():
            try:
                futures.append(stream.append(RecordBatch(b"p" * 64)))
            except (LeaseExpiredError, StreamFencedError) as e:
                refused.append(type(e))
                time.sleep(0.001)

    threads = [threading.Thread(target=produce) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    client.fence("a failover took over (test)")
    stop.set()
    for t in threads:
        t.join()
    outcomes = [f.exception(5) for f in futures]
    acked = [f for f, e in zip(futures, outcomes) if e is None]
    failed = [e for e in outcomes if e is not None]
    assert acked and refused
    assert all(isinstance(e, StreamFencedError) for e in failed)
    assert max(f.base_offset for f in acked) < min((f.base_offset for f, e in zip(futures, outcomes) if e),
                                                   default=1 << 62)
    assert client.fenced and not client.health()["serving"]
    with pytest.raises(StreamFencedError, match="a failover took over"):
        stream.append(RecordBatch(b"z"))
    client.renew_lease(time.monotonic_ns(), 10.0)           # a fenced client never acknowledges again
    with pytest.raises(StreamFencedError):
        stream.append(RecordBatch(b"z"))


# ---- configuration ---------------------------------------------------------------------------

def test_lease_defaults_to_half_the_heartbeat_timeout_and_is_validated():
    assert ClusterConfig().lease == 2.5
    assert ClusterConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5).lease == 0.75
    assert ClusterConfig(heartbeat_interval=0.1, heartbeat_timeout=1.0, lease_duration=0.5).lease == 0.5
    with pytest.raises(ConfigError, match="must exceed heartbeat_interval"):
        ClusterConfig(heartbeat_interval=0.5, heartbeat_timeout=5.0, lease_duration=0.4)
    with pytest.raises(ConfigError, match="by at least heartbeat_interval"):
        ClusterConfig(heartbeat_interval=0.5, heartbeat_timeout=5.0, lease_duration=4.8)


def test_wal_deadline_is_no_deadline_by_default(tmp_path):
    log = wal.WriteAheadLog.open(str(tmp_path / "w.wal"), node_id=1,
                                 config=wal.WALConfig(capacity=1 << 20, batch_bytes=64 << 10, buffers=4))
    try:
        assert log.append(b"x").result(5) >= 0
        assert log.acked_end == log.durable_end
    finally:
        log.close()
