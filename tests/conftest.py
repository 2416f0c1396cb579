"""Shared fixtures: WAL targets on a regular file and on a real loop block device."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

import pytest

import testpaths

testpaths.add()     # tests/ and its folders (kits, children, one per package) on sys.path and PYTHONPATH

import wal

KiB = 1024
MiB = 1024 * KiB


@dataclass
class WalTarget:
    """A place to open a fresh WAL of `capacity` total bytes: a file path or a loop device."""
    path: str
    capacity: int
    kind: str

    def config(self, **overrides) -> wal.WALConfig:
        kw = dict(capacity=self.capacity, batch_bytes=64 * KiB, buffers=4, full_timeout=5.0)
        kw.update(overrides)
        return wal.WALConfig(**kw)

    def open(self, node_id: int = 1, **kw) -> wal.WriteAheadLog:
        config = kw.pop("config", None) or self.config()
        return wal.WriteAheadLog.open(self.path, node_id=node_id, config=config, **kw)


def loop_device(image: str, size: int, sizelimit: int | None = None) -> str:
    if os.geteuid() != 0 or not shutil.which("losetup"):
        pytest.skip("loop block devices need root and losetup")
    with open(image, "wb") as f:
        f.truncate(size)
    cmd = ["losetup", "--find", "--show"]
    if sizelimit is not None:
        cmd += ["--sizelimit", str(sizelimit)]
    try:
        return subprocess.check_output(cmd + [image], text=True, stderr=subprocess.PIPE).strip()
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"losetup is not usable here: {e}")


def detach(dev: str) -> None:
    subprocess.run(["losetup", "-d", dev], check=False)


@pytest.fixture(params=["file", "blockdev"])
def wal_target(request, tmp_path):
    """A fresh WAL location of 1 MiB + header; every test using it runs on both kinds."""
    capacity = 1 * MiB + 8 * KiB
    if request.param == "file":
        yield WalTarget(str(tmp_path / "test.wal"), capacity, "file")
        return
    dev = loop_device(str(tmp_path / "device.img"), capacity)
    try:
        yield WalTarget(dev, capacity, "blockdev")
    finally:
        detach(dev)


def read_data_area(path: str) -> bytes:
    with open(path, "rb") as f:
        f.seek(8192)
        return f.read()


def damage(path: str, position: int, data: bytes) -> None:
    """Overwrite bytes at absolute `position` of a closed WAL and flush them."""
    with open(path, "r+b", buffering=0) as f:
        f.seek(position)
        f.write(data)
        os.fsync(f.fileno())


# ---- stream engine fixtures ------------------------------------------------------------------

@pytest.fixture(scope="session")
def moto_endpoint():
    """One moto S3 server over real HTTP on loopback for the whole session."""
    from testservers.moto import moto_thread
    with moto_thread() as endpoint:
        yield endpoint


def _start_s3_server(tmp_path_factory, kind: str):
    """An testservers.s3 server of `kind` ("seaweedfs" or "rclone") in a session temp dir.
    Without its binary the tests using it skip, except in CI ($CI set), where they fail."""
    from testservers import s3 as s3servers
    start = {"seaweedfs": s3servers.start_seaweedfs, "rclone": s3servers.start_rclone}[kind]
    try:
        return start(str(tmp_path_factory.mktemp(kind)))
    except s3servers.ServerUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and {kind} cannot run here: {e}")
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def seaweedfs_endpoint(tmp_path_factory):
    """The http://127.0.0.1:PORT endpoint of one SeaweedFS S3 server (`weed mini`) for the
    session: a second S3 implementation, which enforces conditional writes. Requests are signed
    with the key pair "testing"/"testing" (s3servers.ACCESS_KEY, SECRET_KEY: moto's too). Make a
    bucket with s3servers.fresh_bucket(endpoint), or an object store URL on a fresh bucket with
    s3servers.bucket_url(endpoint) (for open_object_store or a StreamClient); or parametrize
    `store_url` indirectly with "seaweedfs"."""
    with _start_s3_server(tmp_path_factory, "seaweedfs") as server:
        yield server.endpoint


@pytest.fixture(scope="session")
def rclone_endpoint(tmp_path_factory):
    """Like seaweedfs_endpoint, for `rclone serve s3` over a directory: a third S3
    implementation, which ignores If-None-Match (it overwrites) and answers a ranged GET with
    the whole object's checksum header."""
    with _start_s3_server(tmp_path_factory, "rclone") as server:
        yield server.endpoint


@pytest.fixture(params=["local", "s3"])
def store_url(request, tmp_path):
    """An object store URL: a local directory, or a fresh bucket on moto's HTTP server. Indirect
    parameters may also ask for a fresh bucket on SeaweedFS or rclone's serve s3:
    @pytest.mark.parametrize("store_url", ["seaweedfs", "rclone"], indirect=True)."""
    if request.param == "local":
        return f"file://{tmp_path}/objects"
    if request.param in ("seaweedfs", "rclone"):
        from testservers import s3 as s3servers
        return s3servers.bucket_url(request.getfixturevalue(f"{request.param}_endpoint"))
    endpoint = request.getfixturevalue("moto_endpoint")
    bucket = f"b-{os.urandom(4).hex()}"
    return f"s3://{bucket}/data?endpoint_url={endpoint}&create_bucket=1&max_attempts=3"


def small_config(**overrides):
    """An engine config scaled down so tests upload, split and wrap quickly; no visibility
    deadline (upload_interval) unless asked, so that what uploads when is the test's to say,
    and the tail bound of before issue 51 (a quarter of cache_size, at most 8 MiB; the default
    is now twice split_size), so that tests whose store fails or hangs while they append a few
    hundred KiB to a stream still get their appends acknowledged."""
    import s3stream
    kw = dict(upload_interval=None, upload_threshold=1 * MiB, split_size=256 * KiB, object_block_size=64 * KiB, cache_size=4 * MiB,
              max_batch_bytes=128 * KiB, block_cache_size=2 * MiB, readahead_bytes=256 * KiB,
              append_timeout=20, wal=wal.WALConfig(capacity=16 * MiB, full_timeout=20))
    kw.update(overrides)
    kw.setdefault("stream_tail_limit", max(kw["max_batch_bytes"], min(8 * MiB, kw["cache_size"] // 4)))
    return s3stream.Config(**kw)


def pytest_collection_finish(session):
    """Start, at the session's start, what a selected test runs in the background (a test
    module's `start_background(name)`: the 10,000-seed simulation of test_cluster_sim)."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        start = getattr(getattr(item, "module", None), "start_background", None)
        if start is not None:
            start(item.name)


def pytest_sessionfinish(session):
    """Stop background runs whose tests did not collect them (the session ended early): each
    selected module's `stop_background()`."""
    modules = {getattr(item, "module", None) for item in getattr(session, "items", ())}
    for module in modules:
        stop = getattr(module, "stop_background", None)
        if stop is not None:
            stop()


def pytest_terminal_summary(terminalreporter):
    """The 10,000-seed simulation's figures and the fault matrix of tests/cluster/test_fault_matrix.py
    as a table, when they ran."""
    import sys
    for line in getattr(sys.modules.get("test_cluster_sim"), "SUMMARY", None) or ():
        terminalreporter.write_line(f"cluster simulation: {line}")
    module = sys.modules.get("test_fault_matrix")
    rows = getattr(module, "MATRIX", None)
    if not rows:
        return
    tr = terminalreporter
    tr.section("fault matrix: 0 acknowledged records lost and 0 committed objects missing in every cell")
    head = (f"{'store':<10} {'metadata':<9} {'operation':<22} {'fault':<21} {'faulted':>7} {'acked':>6} {'lost':>5} "
            f"{'missing':>8}  errors seen")
    tr.write_line(head)
    for r in rows:
        tr.write_line(f"{r['store']:<10} {r['metadata']:<9} {r['operation']:<22} {r['fault']:<21} {r['faulted']:>7} "
                      f"{r['acknowledged']:>6} {r['lost']:>5} {r['committed_missing']:>8}  "
                      f"{', '.join(r['errors_seen']) or '-'}")


# ---- PostgreSQL ------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def pg_server():
    """A PostgreSQL server for the session (testservers.postgres.PostgresServer): the one at
    $S3STREAM_TEST_PG_URL (a superuser URL), else a throwaway one started from the installed
    binaries. Without binaries the PostgreSQL cases skip, except in CI ($CI set), where they fail:
    they must never silently skip there."""
    from testservers import postgres as pgserver
    url = os.environ.get("S3STREAM_TEST_PG_URL")
    if url:
        yield pgserver.PostgresServer(url)
        return
    try:
        with pgserver.throwaway_postgres() as server:
            yield server
    except pgserver.MissingBinaries as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and PostgreSQL cannot run here: {e}")
        pytest.skip(str(e))


_pg_databases = iter(range(1, 1 << 30))


@pytest.fixture
def pg_url(pg_server):
    """The URL of a fresh, empty database on the session's server, dropped after the test."""
    name = f"s3s_{os.getpid()}_{next(_pg_databases)}"
    url = pg_server.create_database(name)
    yield url
    pg_server.drop_database(name)


# ---- metadata over both stores ---------------------------------------------------------------------

@pytest.fixture(params=["sqlite", "postgres"])
def metadata_url(request, tmp_path):
    """The URL of a fresh metadata database: an SQLite file in tmp_path, or a PostgreSQL database
    (pg_url); every test using it runs on both stores."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/meta.db"
    return request.getfixturevalue("pg_url")


def is_postgres(metadata_url: str) -> bool:
    """Whether a metadata URL names a PostgreSQL database (else an SQLite file)."""
    return metadata_url.startswith(("postgresql:", "postgres:"))


@pytest.fixture
def open_same_metadata(metadata_url):
    """Open another store on the test's metadata database (open_metadata keywords such as clock=
    or lock_timeout_s=); each is closed at the end of the test, before the database is dropped."""
    from s3stream.metadata import open_metadata
    opened = []

    def open_(**kw):
        opened.append(open_metadata(metadata_url, **kw))
        return opened[-1]

    yield open_
    for store in opened:
        store.close()


def lock_node_row(metadata_url: str, node_id: int, seconds: float):
    """Another PostgreSQL session takes node `node_id`'s row FOR UPDATE and holds it `seconds`:
    every commit and heartbeat of that node waits behind it (the PostgreSQL counterpart of
    another process holding SQLite's write lock). Returns the started timer that releases it."""
    import threading

    import psycopg
    conn = psycopg.connect(metadata_url)           # not autocommit: the lock lasts until commit()
    assert conn.execute("SELECT node_id FROM nodes WHERE node_id = %s FOR UPDATE", (node_id,)).fetchall()

    def release():
        conn.commit()
        conn.close()

    timer = threading.Timer(seconds, release)
    timer.start()
    return timer
