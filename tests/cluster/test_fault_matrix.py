"""The fault matrix (issue 10): each object-store operation and metadata call failing, hanging or
losing its response, on the local store (a failing wrapper) and on S3 through the moto server
(faults injected on the real HTTP path by botocore's event hooks), with the same workload each
time, over SQLite and PostgreSQL metadata. Metadata faults are each store's own: SQLite's write
lock held past its busy timeout; PostgreSQL's node row locked past its lock timeout, and the
server terminating the store's sessions mid-upload. Every cell must end with 0 acknowledged
records lost and 0 committed objects missing; `pytest` prints the matrix as a table at the end
of the run (conftest.pytest_terminal_summary)."""
from __future__ import annotations

import random
import sqlite3
import threading
import time
import zlib
from dataclasses import replace

import pytest
from botocore.awsrequest import AWSResponse

import s3stream
from s3stream import RecordBatch, StreamClient
from s3stream.metadata import ObjectState, open_metadata
from s3stream.objectstore import FaultInjectingObjectStore, open_object_store
from conftest import KiB, MiB, is_postgres, lock_node_row, small_config
from test_engine_faults import LosingCommitResponses

pytestmark = pytest.mark.slow    # the whole module: soaks, campaigns, fault runs or Spark (README: quick tier)

# 8 MiB blocks: a full block's StreamSetObject goes up as a multipart upload (threshold 5 MiB below).
CONFIG = small_config(upload_threshold=8 * MiB, split_size=8 * MiB, cache_size=32 * MiB, reclaim_interval=None,
                      destroy_delay=0.01, max_batch_bytes=512 * KiB,
                      wal=__import__("wal").WALConfig(capacity=64 * MiB, full_timeout=20))
MATRIX: list[dict] = []          # rows for the summary table


class HttpFaults:
    """Faults on one S3 operation of a real boto3 client, before the request is sent: the next
    `n` requests get an HTTP 500 (botocore retries, then the store raises) or wait `hang` s."""

    def __init__(self, store, operation: str, kind: str, n: int, hang: float = 1.0) -> None:
        self.kind, self.left, self.hang, self.hits = kind, n, hang, 0
        self._lock = threading.Lock()
        store._client.meta.events.register(f"before-send.s3.{operation}", self._before_send)

    def _before_send(self, request, **kw):
        with self._lock:
            if self.left <= 0:
                return None
            self.left -= 1
            self.hits += 1
        if self.kind == "hang":
            time.sleep(self.hang)
            return None
        return AWSResponse(request.url, 500, {}, _Body())


class _Body:
    def stream(self, **kw):
        yield b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code><Message>injected</Message></Error>"


SIZES = (1, 900, 20 * KiB, 256 * KiB)


def workload(streams, rng: random.Random, n: int = 130) -> dict:
    """Append n batches of 1 B-256 KiB (8.6 MiB: one full block, multipart on S3, then a small
    tail, one PutObject) over the streams; every acknowledged batch, per stream."""
    futs = []
    for i in range(n):
        s = streams[i % len(streams)]
        p = rng.randbytes(SIZES[i % len(SIZES)])
        futs.append((s.stream_id, s.append(RecordBatch(p, 1)), p))
    acked: dict = {s.stream_id: [] for s in streams}
    for sid, f, p in futs:
        acked[sid].append((f.result(60).base_offset, p))
    return acked


def read_back(client, acked: dict, attempts: int = 50) -> tuple[int, list[str]]:
    """Records of `acked` missing or wrong when read back (errors retried, and named)."""
    lost, errors = 0, []
    opened = {x.stream_id: x for x in client.streams()}
    for sid, batches in acked.items():
        s = opened.get(sid) or client.open_stream(sid)
        got, pos = {}, s.start_offset
        for _ in range(attempts):
            try:
                while pos < s.confirm_offset:
                    res = s.fetch(pos, max_bytes=1 * MiB)
                    for b in res.batches:
                        got[b.base_offset] = bytes(b.payload)
                    pos = res.end_offset
                break
            except (s3stream.ObjectStoreError, s3stream.CorruptDataError) as e:
                errors.append(type(e).__name__)
                time.sleep(0.05)
        lost += sum(1 for base, p in batches if got.get(base) != p)
    return lost, errors


def missing_committed(metadata_url: str, store) -> int:
    meta = open_metadata(metadata_url)
    try:
        keys = {o.key for o in store.list()}
        return sum(1 for o in meta.list_objects(state=ObjectState.COMMITTED) if o.key not in keys)
    finally:
        meta.close()


def _events(store: FaultInjectingObjectStore, op: str, outcome: str) -> int:
    return sum(1 for e in store.events if e[0] == op and e[2] == outcome)


class SessionTerminator(threading.Thread):
    """Until stopped, the server ends every other session of the database (pg_terminate_backend)
    every `interval` s: idle pooled connections and ones in the middle of a transaction alike.
    `terminated` counts the sessions it ended, `busy` those of them that were in the middle of an
    operation (not idle): the faults the engine had to retry through."""

    def __init__(self, metadata_url: str, interval: float = 0.02) -> None:
        import psycopg
        super().__init__(daemon=True)
        self.interval, self.terminated, self.busy = interval, 0, 0
        self.stop = threading.Event()
        self._conn = psycopg.connect(metadata_url, autocommit=True)

    def run(self) -> None:
        with self._conn as conn:
            while True:
                for ended, state in conn.execute(
                        "SELECT pg_terminate_backend(pid), state FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchall():
                    self.terminated += ended
                    self.busy += ended and state != "idle"
                if self.stop.wait(self.interval):
                    return


def run_cell(tmp_path, store_kind: str, url: str, metadata_url: str, op: str, fault: str) -> None:
    """One cell: arm the fault, run the workload through close, read everything back through a
    fresh node (with read faults armed for GET cells), reclaim (delete faults for DELETE cells).
    `fired` counts the faults that really happened, from the injectors' own records."""
    metadata_kind = "postgres" if is_postgres(metadata_url) else "sqlite"
    inner = open_object_store(url)
    store = FaultInjectingObjectStore(inner)
    # A lock wait past 50 ms is MetadataBusyError, on either store.
    meta = open_metadata(metadata_url, **{"postgres": dict(lock_timeout_s=0.05),
                                          "sqlite": dict(busy_timeout_s=0.05)}[metadata_kind])
    rng = random.Random(zlib.crc32(f"{store_kind}/{op}/{fault}".encode()))
    # DELETE cells need StreamObjects (a trim destroys those; StreamSetObjects go by compaction).
    config = replace(CONFIG, split_size=1 * MiB) if op == "DeleteObjects" else CONFIG
    if fault == "sessions terminated":         # many uploads while sessions end, not one or two
        config = replace(CONFIG, upload_threshold=1 * MiB, split_size=1 * MiB, upload_interval=0.1)
    client = StreamClient(1, str(tmp_path / "n1.wal"), store,
                          LosingCommitResponses(meta, 2) if fault == "lost commit response" else meta, config)
    streams = [client.create_stream() for _ in range(3)]
    http = HttpFaults(inner, op, fault, n=4) if op in ("PutObject", "UploadPart", "CreateMultipartUpload") else None
    if op == "put":
        {"fail": lambda: store.fail_next_puts(4), "hang": lambda: store.hang_puts(0.5),
         "lost response": lambda: store.put_timeout_after_landing(3)}[fault]()
    locker = terminator = None
    if fault == "locked":                       # another connection holds SQLite's write lock for 1 s
        locker = sqlite3.connect(metadata_url[len("sqlite:///"):], isolation_level=None, check_same_thread=False)
        locker.execute("BEGIN IMMEDIATE")
        threading.Timer(1.0, lambda: locker.execute("COMMIT")).start()
    elif fault == "row locked":                 # another session holds node 1's row for 1 s
        lock_node_row(metadata_url, 1, 1.0)
    elif fault == "sessions terminated":
        terminator = SessionTerminator(metadata_url)
        terminator.start()
    acked = workload(streams, rng)
    if terminator is not None:
        # Sessions end all through the uploads (the tails too, by upload_interval) but not during
        # the streams' close: the uploader retries MetadataBusyError, a close is not retried (its
        # caller sees the error and may close again).
        deadline = time.monotonic() + 60
        while any(s.committed_offset < s.confirm_offset for s in streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        terminator.stop.set()
        terminator.join()
    if op == "DeleteObjects":
        client.force_upload(120)              # in the background's split StreamObjects, several per stream
    elif op in ("UploadPart", "CreateMultipartUpload"):
        # The full block goes up as one multipart StreamSetObject through the uploader. Left to a
        # close, the streams' tails go up as StreamObjects of their own (a close uploads its
        # streams first, issue 28), each under the multipart threshold: on a loaded machine the
        # uploader had not started the block when the close came, and the fault never fired.
        client.force_upload(120)
    client.close_streams(streams, timeout=120)
    stats = client.stats()["upload"]
    fired = {"put": (_events(store, "put", "ok") if fault == "hang" else        # each waited 0.5 s
                     _events(store, "put", "injected_failure") + _events(store, "put", "timeout_after_landing")),
             "metadata": (terminator.busy if terminator is not None          # ended mid-operation
                          else stats["prepare_retries"] + stats["commit_retries"])}.get(op, http.hits if http else 0)
    store.clear()
    if http is not None:
        http.left = 0
    client.close()
    if locker is not None:
        locker.close()
    # Read back through a fresh node: from the store (nothing in its cache).
    reader_meta = open_metadata(metadata_url)
    inner2 = open_object_store(url)
    store2 = FaultInjectingObjectStore(inner2)
    reader = StreamClient(2, str(tmp_path / "n2.wal"), store2, reader_meta, config)
    read_http = HttpFaults(inner2, "GetObject", fault, n=6, hang=0.3) if op == "GetObject" else None
    errors: list[str] = []
    if op == "get" and fault == "fail":
        store2.fail_next_gets(6)
    elif op == "get" and fault == "corrupt":
        store2.corrupt_gets(lambda key: True)
        _, errors = read_back(reader, acked, attempts=2)      # every read hits a corrupt block
        assert "CorruptDataError" in errors, "a corrupt GET was not detected"
        store2.clear()
    lost, more = read_back(reader, acked)
    errors += more
    if op == "get":
        fired = _events(store2, "get", "injected_failure" if fault == "fail" else "corrupted")
    elif read_http is not None:
        fired = read_http.hits
    if op == "DeleteObjects":
        for s in reader.streams():                           # read_back opened them
            s.trim(acked[s.stream_id][-1][0])
        delete_http = HttpFaults(inner2, "DeleteObjects", fault, n=2)
        time.sleep(0.05)                                      # past destroy_delay
        try:
            reader.reclaimer.run_once()
        except s3stream.S3StreamError:
            errors.append("reclaim")
        fired, delete_http.left = delete_http.hits, 0
        reader.reclaimer.run_once()                 # the next run deletes what the failed one left
        left = reader_meta.list_objects(state=ObjectState.MARK_DESTROYED)
        assert left == [], f"objects the failed DELETE left were never deleted: {left}"
        lost, _ = read_back(reader, {sid: batches[-1:] for sid, batches in acked.items()})
    reader.close()
    reader_meta.close()
    missing = missing_committed(metadata_url, inner2)
    inner2.close()
    MATRIX.append(dict(store=store_kind, metadata=metadata_kind, operation=op, fault=fault, faulted=fired,
                       acknowledged=sum(len(b) for b in acked.values()), lost=lost, committed_missing=missing,
                       errors_seen=sorted(set(errors))))
    assert fired > 0, "the fault never fired: the cell tested nothing"
    assert lost == 0 and missing == 0


S3_CELLS = [("PutObject", "fail"), ("PutObject", "hang"), ("CreateMultipartUpload", "fail"),
            ("UploadPart", "fail"), ("UploadPart", "hang"), ("GetObject", "fail"), ("GetObject", "hang"),
            ("DeleteObjects", "fail"), ("put", "lost response")]
# (metadata store, operation, fault): the object-store cells on both stores, each store's own
# metadata faults on it alone.
LOCAL_CELLS = ([(meta, op, fault) for meta in ("sqlite", "postgres")
                for op, fault in [("put", "fail"), ("put", "hang"), ("put", "lost response"), ("get", "fail"),
                                  ("get", "corrupt"), ("metadata", "lost commit response")]]
               + [("sqlite", "metadata", "locked"),
                  ("postgres", "metadata", "row locked"), ("postgres", "metadata", "sessions terminated")])


@pytest.mark.parametrize("op,fault", S3_CELLS, ids=[f"{o}-{f}".replace(" ", "_") for o, f in S3_CELLS])
def test_fault_matrix_s3(tmp_path, moto_endpoint, metadata_url, op, fault):
    bucket = f"fm-{random.getrandbits(32):08x}"
    url = (f"s3://{bucket}/data?endpoint_url={moto_endpoint}&create_bucket=1&max_attempts=2"
           f"&part_size={5 * MiB}&multipart_threshold={5 * MiB}")
    run_cell(tmp_path, "s3 (moto)", url, metadata_url, op, fault)


@pytest.mark.parametrize("metadata_url,op,fault", LOCAL_CELLS, indirect=["metadata_url"],
                         ids=[f"{o}-{f}-{m}".replace(" ", "_") for m, o, f in LOCAL_CELLS])
def test_fault_matrix_local(tmp_path, metadata_url, op, fault):
    run_cell(tmp_path, "local", f"file://{tmp_path}/objects", metadata_url, op, fault)
