"""Every transient fault ends (issue 26, item 3): uploads outlive a frozen S3 server, unexpected
errors anywhere in the upload path, and only the documented permanent errors stop them."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from typing import Iterator

import pytest
from botocore.exceptions import ReadTimeoutError
from prometheus_client import CollectorRegistry

import s3stream
import s3stream.metrics
import s3stream.engine.upload
from s3stream import RecordBatch, StreamClient
from s3stream.errors import ObjectStoreError
from s3stream.metadata import open_metadata
from s3stream.metadata.wrappers import InstrumentedMetadataStore
from s3stream.objectstore import FaultInjectingObjectStore, LocalObjectStore, S3ObjectStore
from conftest import KiB, MiB, small_config


@pytest.fixture
def frozen_moto() -> Iterator[tuple[str, subprocess.Popen]]:
    """A moto S3 server in its own process on 127.0.0.1 (testservers.moto.MotoProcess), so that
    a test can SIGSTOP it; yields (endpoint URL, process). Closing it thaws it first: a failed
    test must not leave it stopped."""
    from testservers.moto import MotoProcess, MotoUnavailable
    try:
        server = MotoProcess()
    except MotoUnavailable as e:
        pytest.skip(str(e))
    try:
        yield server.endpoint, server.proc
    finally:
        server.close()


class Appender:
    """Appends records of random sizes to `streams` on a thread until stopped, keeping what
    was acknowledged per stream (each record is one batch of count 1)."""

    def __init__(self, streams, seed: int, sizes: tuple[int, int], pause: float) -> None:
        self.streams = streams
        self.acked: dict[int, list[bytes]] = {s.stream_id: [] for s in streams}
        self.errors: list[BaseException] = []
        self._rng = random.Random(seed)
        self._sizes = sizes
        self._pause = pause
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="appender", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        try:
            while not self._stop.is_set():
                s = self.streams[n % len(self.streams)]
                payload = (b"%d:%d:" % (s.stream_id, n)).ljust(self._rng.randint(*self._sizes), b"x")
                s.append(RecordBatch(payload, 1)).result(60)
                self.acked[s.stream_id].append(payload)
                n += 1
                time.sleep(self._pause)
        except BaseException as e:      # noqa: BLE001 - reported by the test
            self.errors.append(e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive()


def wait_for(predicate, timeout: float, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def read_committed(client: StreamClient, stream_id: int) -> list[bytes]:
    """Every committed payload of a stream, read through `client` without opening it."""
    out: list[bytes] = []
    pos = 0
    while True:
        result = client.fetch_committed(stream_id, pos)
        if not result.batches:
            return out
        out += [bytes(b.payload) for b in result.batches]
        pos = result.end_offset


#: How long the S3 server stays frozen, and the store URL's client settings (for a manual run with
#: botocore's defaults: S3_FREEZE_SECONDS=40 S3_FREEZE_PARAMS="").
FREEZE_SECONDS = float(os.environ.get("S3_FREEZE_SECONDS", "8"))
DEFAULT_FREEZE_PARAMS = "read_timeout=2&connect_timeout=1&max_attempts=1"
FREEZE_PARAMS = os.environ.get("S3_FREEZE_PARAMS", DEFAULT_FREEZE_PARAMS)
CONFIG = small_config(upload_threshold=256 * KiB, split_size=64 * KiB, cache_size=4 * MiB, upload_interval=0.3,
                      append_timeout=60, reclaim_interval=None)


@pytest.mark.slow
def test_frozen_s3_server_then_resumed_uploads_resume(frozen_moto, tmp_path):
    """The S3 server is SIGSTOPped past the client's read timeout while appends and uploads are
    in flight, then SIGCONTed: uploads resume within seconds and every acknowledged record is
    committed and readable by content. (Before the fix: BufferError in encode_pieces, uploads
    stopped for good.)"""
    endpoint, proc = frozen_moto
    url = f"s3://frozen/data?endpoint_url={endpoint}&create_bucket=1" + (f"&{FREEZE_PARAMS}" if FREEZE_PARAMS else "")
    meta = f"sqlite:///{tmp_path}/meta.db"
    client = StreamClient(1, str(tmp_path / "n1.wal"), url, meta, CONFIG)
    try:
        streams = [client.create_stream() for _ in range(3)]
        appender = Appender(streams, seed=1, sizes=(200, 6 * KiB), pause=0.002)
        assert wait_for(lambda: client.stats()["upload"]["blocks"] >= 3, 30)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(FREEZE_SECONDS)
        frozen = client.stats()["upload"]
        episode = client._uploader.retrying
        os.kill(proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        assert wait_for(lambda: client.stats()["upload"]["blocks"] > frozen["blocks"], 30)
        first_commit = time.monotonic() - resumed
        assert wait_for(lambda: client.stats()["upload"]["retrying"] == 0, 30)
        all_recovered = time.monotonic() - resumed
        # One stream only from here: its objects outgrow every earlier one, so each pool thread's
        # encode buffer has to grow (where a view pinned by a timed-out request broke it).
        appender.stop()
        one = Appender(streams[:1], seed=2, sizes=(200, 6 * KiB), pause=0.0005)
        time.sleep(3)
        one.stop()
        stats = client.stats()["upload"]
        print(f"\nfirst commit {first_commit:.2f} s after the server resumed, every failing step recovered "
              f"{all_recovered:.2f} s after it (frozen {FREEZE_SECONDS:g} s, {FREEZE_PARAMS or 'botocore defaults'}); "
              f"episode while frozen: {episode}; upload stats {stats}")
        if FREEZE_PARAMS == DEFAULT_FREEZE_PARAMS:    # botocore gave up on requests while frozen: retried here
            assert episode is not None and episode.error.__traceback__ is None
            assert frozen["put_retries"] > 0 and frozen["retrying"] > 0
        assert client._uploader.failure is None, client._uploader.failure
        assert not appender.errors and not one.errors, appender.errors + one.errors
        acked = {sid: appender.acked[sid] + one.acked.get(sid, []) for sid in appender.acked}
        assert wait_for(lambda: all(s.committed_offset == len(acked[s.stream_id]) for s in streams), 60), \
            [(s.committed_offset, len(acked[s.stream_id])) for s in streams]
        assert first_commit < 5.0 and all_recovered < 10.0
        assert client._uploader.retrying is None and client.stats()["upload"]["retrying"] == 0
        reader = StreamClient(2, str(tmp_path / "n2.wal"), url, meta, CONFIG)
        try:
            for s in streams:
                assert read_committed(reader, s.stream_id) == acked[s.stream_id]
        finally:
            reader.close()
    finally:
        client.close()


# ---- the S3 store keeps no view of a put's data -----------------------------------------------

class TimingOutS3Client:
    """A boto3 S3 client stand-in whose requests time out, as botocore reports it."""

    def __init__(self) -> None:
        self.aborted = 0

    def put_object(self, **kw):
        raise ReadTimeoutError(endpoint_url="http://127.0.0.1:1/b/" + kw["Key"])

    def create_multipart_upload(self, **kw):
        return {"UploadId": "u1"}

    def upload_part(self, **kw):
        raise ReadTimeoutError(endpoint_url="http://127.0.0.1:1/b/" + kw["Key"])

    def abort_multipart_upload(self, **kw):
        self.aborted += 1

    def close(self) -> None:
        pass


@pytest.mark.parametrize("size", [1 * MiB, 12 * MiB], ids=["put", "multipart"])
def test_a_failed_s3_put_keeps_no_view_of_its_data(size):
    """The root cause: the error of a timed-out put (kept, with its traceback) held a view of the
    caller's buffer in S3ObjectStore.put's frame, so the reused encode buffer could not grow."""
    store = S3ObjectStore("b", client=TimingOutS3Client(), part_size=5 * MiB)
    buffer = bytearray(size)
    with memoryview(buffer)[:size] as data:
        with pytest.raises(ObjectStoreError, match="Read timeout") as raised:
            store.put("k", data)
    assert raised.value.__traceback__ is not None          # the error, traceback and all, is still here
    buffer.extend(bytes(4096))                              # and yet the buffer can grow
    store.close()


# ---- unexpected errors, unit level: a fault-injecting store and metadata store ------------------

class FlakyMetadataStore(InstrumentedMetadataStore):
    """Delegates to a real metadata store; `prepare_objects` and `commit` raise armed errors.
    A commit fault may be armed to land first (the response is lost)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.faults: dict[str, list] = {"prepare_objects": [], "commit": []}

    def arm(self, operation: str, n: int, error: type[BaseException], after_landing: bool = False) -> None:
        self.faults[operation] += [(error, after_landing)] * n

    def _fault(self, operation: str):
        return self.faults[operation].pop(0) if self.faults[operation] else None

    def prepare_objects(self, count, ttl_ns):
        fault = self._fault("prepare_objects")
        if fault:
            raise fault[0](f"injected {fault[0].__name__} in prepare_objects")
        return super().prepare_objects(count, ttl_ns)

    def commit(self, request):
        fault = self._fault("commit")
        if fault and not fault[1]:
            raise fault[0](f"injected {fault[0].__name__} in commit")
        result = super().commit(request)
        if fault:
            raise fault[0](f"injected {fault[0].__name__} in commit, after it landed")
        return result


def append_all(streams, n: int, size: int = 3 * KiB) -> dict[int, list[bytes]]:
    """Append `n` records round-robin (each acknowledged before the next); returns them by stream."""
    acked: dict[int, list[bytes]] = {s.stream_id: [] for s in streams}
    for i in range(n):
        s = streams[i % len(streams)]
        payload = (b"%d:%d:" % (s.stream_id, i)).ljust(size + (i * 37) % size, b"y")
        s.append(RecordBatch(payload, 1)).result(60)
        acked[s.stream_id].append(payload)
    return acked


def assert_committed_and_readable(client: StreamClient, streams, acked) -> None:
    assert wait_for(lambda: all(s.committed_offset == len(acked[s.stream_id]) for s in streams), 30), \
        [(s.committed_offset, len(acked[s.stream_id])) for s in streams]
    for s in streams:
        assert read_committed(client, s.stream_id) == acked[s.stream_id]


def upload_log(caplog) -> tuple[list[str], list[str]]:
    """The WARNING lines that open an episode and the INFO lines that close one."""
    records = [r for r in caplog.records if r.name == "s3stream.upload"]
    opened = [r.getMessage() for r in records if r.levelname == "WARNING" and "are failing" in r.getMessage()]
    recovered = [r.getMessage() for r in records if r.levelname == "INFO" and "recovered after" in r.getMessage()]
    return opened, recovered


def test_unexpected_errors_in_every_step_are_retried_counted_and_logged_once(tmp_path, caplog, monkeypatch):
    """RuntimeError and BufferError from PUT, encode, prepare, commit (before and after it
    landed) and the WAL durability wait: uploads recover, each step counts its retries, and
    each episode logs one WARNING and one INFO line."""
    caplog.set_level("DEBUG", logger="s3stream.upload")
    store = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    meta = FlakyMetadataStore(open_metadata(f"sqlite:///{tmp_path}/meta.db"))
    encode_faults = [BufferError("injected: Existing exports of data: object cannot be re-sized")] * 6
    real_encode = s3stream.engine.upload.encode_slices

    def flaky_encode(*args):
        if encode_faults:
            raise encode_faults.pop()
        return real_encode(*args)
    monkeypatch.setattr(s3stream.engine.upload, "encode_slices", flaky_encode)
    client = StreamClient(1, str(tmp_path / "n1.wal"), store, meta, CONFIG)
    durable_faults = [RuntimeError("injected: the durability wait failed")] * 4
    real_wait = client._uploader._wait_durable

    def flaky_wait(end: int) -> None:
        if durable_faults:
            raise durable_faults.pop()
        real_wait(end)
    client._uploader._wait_durable = flaky_wait
    try:
        streams = [client.create_stream() for _ in range(3)]
        store.fail_next_puts(8, RuntimeError)
        meta.arm("prepare_objects", 3, RuntimeError)
        meta.arm("commit", 2, ConnectionResetError)
        meta.arm("commit", 2, RuntimeError, after_landing=True)
        t0 = time.monotonic()
        acked = append_all(streams, 600)
        assert_committed_and_readable(client, streams, acked)
        stats = client.stats()["upload"]
        opened, recovered = upload_log(caplog)
        print(f"\nrecovered in {time.monotonic() - t0:.2f} s; upload stats {stats}; {len(opened)} episodes")
        assert client._uploader.failure is None
        assert not encode_faults and not durable_faults and not any(meta.faults.values())
        assert stats["put_retries"] == 8 and stats["encode_retries"] == 6 and stats["prepare_retries"] == 3
        assert stats["commit_retries"] == 4 and stats["durable_retries"] == 4
        assert stats["unexpected_retries"] == 8 + 6 + 3 + 2 + 4            # not the ConnectionResetErrors
        assert stats["retrying"] == 0 and client._uploader.retrying is None
        assert 1 <= len(opened) == len(recovered) == stats["retry_episodes"] <= 6
        assert any("RuntimeError" in m and "Traceback" in m for m in opened)
        registry = CollectorRegistry()
        handle = s3stream.metrics.instrument(client, registry)
        try:
            for step in s3stream.engine.upload.RETRY_STEPS:
                assert registry.get_sample_value("s3stream_upload_retries_total",
                                                 {"node": "1", "step": step}) == stats[f"{step}_retries"]
            assert registry.get_sample_value("s3stream_upload_unexpected_retries_total", {"node": "1"}) == 23
            assert registry.get_sample_value("s3stream_upload_retry_episodes_total",
                                             {"node": "1"}) == stats["retry_episodes"]
            assert registry.get_sample_value("s3stream_upload_retrying_steps", {"node": "1"}) == 0
        finally:
            handle.unregister()
    finally:
        client.close()
        meta.close()


@pytest.mark.slow
def test_uploads_resume_within_the_backoff_cap_after_an_outage(tmp_path, caplog):
    """Every PUT fails for 3 s (long enough for the backoff to reach its cap), then the store
    answers: the first commit follows within about RETRY_BACKOFF_CAP."""
    caplog.set_level("INFO", logger="s3stream.upload")
    store = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    client = StreamClient(1, str(tmp_path / "n1.wal"), store, f"sqlite:///{tmp_path}/meta.db", CONFIG)
    try:
        streams = [client.create_stream() for _ in range(3)]
        store.fail_puts_matching(lambda key: True)
        acked = append_all(streams, 150)
        time.sleep(3)
        failing = client.stats()["upload"]
        assert failing["blocks"] == 0 and failing["retrying"] > 0
        store.clear()
        resumed = time.monotonic()
        assert wait_for(lambda: client.stats()["upload"]["blocks"] > 0, 10)
        first_commit = time.monotonic() - resumed
        assert_committed_and_readable(client, streams, acked)
        stats = client.stats()["upload"]
        opened, recovered = upload_log(caplog)
        print(f"\nfirst commit {first_commit:.3f} s after the store answered again (backoff cap "
              f"{s3stream.engine.upload.RETRY_BACKOFF_CAP} s); {stats['put_retries']} PUT retries in "
              f"{stats['retry_episodes']} episode(s); {recovered}")
        assert first_commit < 1.5
        assert len(opened) == len(recovered) == stats["retry_episodes"] == 1
        assert stats["put_retries"] >= 10 and stats["unexpected_retries"] == 0
    finally:
        client.close()


def test_a_view_kept_by_a_timed_out_put_does_not_stop_uploads(tmp_path):
    """A request that timed out but still holds its body (a view of the encode buffer): the
    buffer is replaced, not reused, and nothing fails."""
    store = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    client = StreamClient(1, str(tmp_path / "n1.wal"), store, f"sqlite:///{tmp_path}/meta.db", CONFIG)
    try:
        streams = [client.create_stream() for _ in range(3)]
        store.put_keeps_view(3)
        acked = append_all(streams[:2], 200)
        # Larger objects next (one stream): a reused, pinned buffer would have to grow.
        more = append_all(streams[2:], 300)
        acked.update(more)
        assert_committed_and_readable(client, streams, acked)
        stats = client.stats()["upload"]
        print(f"\nupload stats {stats}; kept views {len(store.kept_views)}")
        assert len(store.kept_views) == 3
        assert stats["put_retries"] == 3 and stats["encode_buffers_replaced"] >= 1
        assert client._uploader.failure is None
    finally:
        store.release_kept_views()
        client.close()


def test_object_ids_that_expire_while_failing_are_uploaded_again(tmp_path):
    """PUTs fail for longer than prepared_ttl: the commit is refused (expired ids), the block is
    uploaded again under new ids, and everything is committed."""
    store = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    config = small_config(upload_threshold=256 * KiB, split_size=64 * KiB, cache_size=4 * MiB, upload_interval=0.3,
                          prepared_ttl=1.0, reclaim_interval=None)
    client = StreamClient(1, str(tmp_path / "n1.wal"), store, f"sqlite:///{tmp_path}/meta.db", config)
    try:
        streams = [client.create_stream() for _ in range(2)]
        store.fail_puts_matching(lambda key: True)
        acked = append_all(streams, 60)
        time.sleep(1.5)
        store.clear()
        assert_committed_and_readable(client, streams, acked)
        stats = client.stats()["upload"]
        print(f"\nupload stats {stats}")
        assert stats["expired_reuploads"] >= 1 and client._uploader.failure is None
    finally:
        client.close()


def test_a_permanent_error_still_stops_uploads(tmp_path, caplog):
    """ObjectStorePermanentError (access denied) is not retried: uploads stop at once and
    appends are refused with it; what was acknowledged stays in the WAL."""
    store = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    meta = f"sqlite:///{tmp_path}/meta.db"
    client = StreamClient(1, str(tmp_path / "n1.wal"), store, meta, CONFIG)
    s = client.create_stream()
    store.fail_next_puts(1000, s3stream.ObjectStorePermanentError("injected: access denied"))
    acked = []
    with pytest.raises(s3stream.ObjectStorePermanentError, match="access denied"):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            payload = b"%d" % len(acked)
            s.append(RecordBatch(payload, 1)).result(30)
            acked.append(payload)
            time.sleep(0.005)
    stats = client.stats()["upload"]
    assert isinstance(client._uploader.failure, s3stream.ObjectStorePermanentError)
    assert stats["put_retries"] == 0 and stats["retry_episodes"] == 0
    assert [r for r in caplog.records if r.name == "s3stream.upload" and "failed for good" in r.getMessage()]
    report = client.close(timeout=5)
    assert report["left_in_wal"] == [s.stream_id]
    store.clear()
    again = StreamClient(1, str(tmp_path / "n1.wal"), store, meta, CONFIG)
    try:
        assert read_committed(again, s.stream_id) == acked
    finally:
        again.close()


def test_close_while_failing_gives_up_in_time_and_ends_the_episode(tmp_path, caplog):
    """close() past its timeout aborts the steps being retried: they stop within their backoff,
    the episode ends without a "recovered" line, and the data stays in the WAL."""
    caplog.set_level("INFO", logger="s3stream.upload")
    store = FaultInjectingObjectStore(LocalObjectStore(str(tmp_path / "objects")))
    client = StreamClient(1, str(tmp_path / "n1.wal"), store, f"sqlite:///{tmp_path}/meta.db", CONFIG)
    s = client.create_stream()
    store.fail_puts_matching(lambda key: True)
    acked = append_all([s], 20)
    assert wait_for(lambda: client._uploader.stats["put_retries"] >= 5, 10)
    t0 = time.monotonic()
    report = client.close(timeout=1.0)
    took = time.monotonic() - t0
    print(f"\nclose gave up after {took:.2f} s (timeout 1 s); upload stats {client._uploader.stats}")
    assert report["left_in_wal"] == [s.stream_id] and took < 5
    assert client._uploader.stats["retrying"] == 0 and client._uploader.retrying is None
    opened, recovered = upload_log(caplog)
    assert len(opened) == 1 and recovered == []
    store.clear()
    again = StreamClient(1, str(tmp_path / "n1.wal"), store, f"sqlite:///{tmp_path}/meta.db", CONFIG)
    try:
        assert read_committed(again, s.stream_id) == acked[s.stream_id]
    finally:
        again.close()


def test_force_upload_waits_for_a_block_that_is_still_starting(tmp_path):
    """A block sealed by the upload threshold is taken from the queue and planned (its object
    ids prepared in metadata) before it is in flight. force_upload called in between, with
    nothing left in the active block, still waits for it (it once saw no pending block there and
    returned at once: CI caught it as a compaction test finding no StreamSetObject)."""
    c = StreamClient(1, tmp_path / "n1.wal", f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db",
                     small_config(reclaim_interval=None))
    started, release = threading.Event(), threading.Event()
    real = c.metadata.prepare_objects

    def slow_prepare(*a, **k):
        if threading.current_thread().name.startswith("s3stream-upload") and not started.is_set():
            started.set()
            release.wait(10)
        return real(*a, **k)
    try:
        s = c.create_stream()
        c.metadata.prepare_objects = slow_prepare                     # type: ignore[method-assign]
        appended = 0
        while c._uploader.pending_blocks == 0:                        # until the threshold seals a block
            s.append(RecordBatch(b"x" * (64 * KiB), 1)).result(10)
            appended += 1
        assert started.wait(10), "the uploader did not start the sealed block"
        done = threading.Thread(target=c.force_upload, args=(20,))
        done.start()
        done.join(0.5)
        assert done.is_alive(), "force_upload returned while the block it must wait for was still starting"
        release.set()
        done.join(20)
        assert not done.is_alive()
        assert c.metadata.get_stream(s.stream_id).end_offset == appended
    finally:
        release.set()
        c.metadata.__dict__.pop("prepare_objects", None)
        c.close()
