"""The ObjectStore contract, one test body over a local directory, S3 in-process (moto) and S3
over real HTTP (moto's server, SeaweedFS, rclone's serve s3: tests/s3servers.py); plus URL
parsing, multipart abort, retries, conditional creates and the wrappers."""
from __future__ import annotations

import io
import itertools
import random
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError, EndpointConnectionError
from moto import mock_aws

from s3stream.errors import ConfigError, InvalidArgumentError, ObjectNotFoundError, ObjectStoreError
from s3stream.objectstore import (
    FaultInjectingObjectStore, InstrumentedObjectStore, LocalObjectStore, ObjectInfo, ObjectStore,
    S3ObjectStore, open_object_store, probe_conditional_put,
)
from s3stream.objectstore import s3 as s3_module
from s3stream.objectstore.local import POOL_DIR

from testservers import s3 as s3servers

KiB = 1024
MiB = 1024 * KiB
# moto enforces S3's 5 MiB minimum for every part but the last, so parts are 5 MiB and the
# multipart object is 12 MiB: three parts (5 + 5 + 2).
PART_SIZE = 5 * MiB
BIG_SIZE = 12 * MiB


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


@dataclass
class Backend:
    kind: str
    store: Any
    raw_client: Any = None  # a boto3 client on the same S3, for checks behind the store's back
    bucket: str = ""

    @property
    def is_s3(self) -> bool:
        return self.kind != "local"

    @property
    def over_http(self) -> bool:
        """An S3 server on loopback (not moto in-process)."""
        return self.kind in HTTP_SERVERS


#: The S3 servers reached over real HTTP.
HTTP_SERVERS = ("moto_http", "seaweedfs", "rclone")
#: Whether each backend honours If-None-Match: * (put_if_absent refuses an existing key), as
#: found: moto 5.2.1 (in process and its server), SeaweedFS 4.48 and the local store do; rclone
#: 1.75's serve s3 ignores the header and overwrites.
HONOURS_CONDITIONAL_PUT = {"local": True, "moto": True, "moto_http": True, "seaweedfs": True, "rclone": False}


def on(*kinds: str):
    """Run a test over these backends only (instead of skipping inside it, after the setup)."""
    return pytest.mark.parametrize("backend", kinds, indirect=True)


S3_KINDS = ("moto", *HTTP_SERVERS)
HONOURING = tuple(kind for kind, honours in HONOURS_CONDITIONAL_PUT.items() if honours)


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Fake credentials, and nothing from the host's AWS configuration."""
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


@pytest.fixture(scope="session")
def raw_clients():
    """A boto3 client per S3 server, shared by the session (making one costs about 70 ms)."""
    clients: dict[str, Any] = {}

    def client(endpoint: str):
        if endpoint not in clients:
            clients[endpoint] = s3servers.s3_client(endpoint)
        return clients[endpoint]

    yield client
    for made in clients.values():
        made.close()


@pytest.fixture(params=["local", "moto", *HTTP_SERVERS])
def backend(request, tmp_path, aws_env, raw_clients):
    if request.param == "local":
        store = LocalObjectStore(str(tmp_path / "objects"), part_size=PART_SIZE)
        yield Backend("local", store)
        store.close()
        return
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    if request.param == "moto":
        with mock_aws():
            raw = boto3.client("s3", region_name="us-east-1")
            raw.create_bucket(Bucket=bucket)
            # A prefix here (none over HTTP) so both key mappings are exercised.
            store = S3ObjectStore(bucket, "streams/v1", region_name="us-east-1",
                                  part_size=PART_SIZE)
            yield Backend("moto", store, raw, bucket)
            store.close()
        return
    endpoint = request.getfixturevalue("moto_endpoint" if request.param == "moto_http"
                                       else f"{request.param}_endpoint")
    raw = raw_clients(endpoint)
    raw.create_bucket(Bucket=bucket)
    store = S3ObjectStore(bucket, endpoint_url=endpoint, region_name="us-east-1",
                          part_size=PART_SIZE)
    yield Backend(request.param, store, raw, bucket)
    store.close()


# -- the contract ------------------------------------------------------------------------------

def test_is_an_object_store(backend):
    assert isinstance(backend.store, ObjectStore)
    assert backend.store.url.startswith("s3://" if backend.is_s3 else "file:///")


def test_put_get_roundtrip(backend):
    store = backend.store
    store.put("a", b"hello world")
    store.put("dir/b", memoryview(b"from a memoryview"))
    store.put("empty", b"")
    assert store.get("a") == b"hello world"
    assert store.get("dir/b") == b"from a memoryview"
    assert store.get("empty") == b""
    assert store.size("a") == 11
    assert store.size("empty") == 0


def test_ranged_gets(backend):
    data = payload(1000)
    backend.store.put("obj", data)
    get = backend.store.get
    assert get("obj", 0, 10) == data[:10]
    assert get("obj", 500, 600) == data[500:600]
    assert get("obj", 990) == data[990:]
    assert get("obj", 990, 1000) == data[990:]
    assert get("obj", 990, 5000) == data[990:]  # clipped at the end
    assert get("obj", 7, 7) == b""
    assert get("obj", 1000) == b""  # starts at the end
    assert get("obj", 2000, 3000) == b""  # starts past the end
    with pytest.raises(ValueError):
        get("obj", 10, 5)
    with pytest.raises(ValueError):
        get("obj", -1)


def test_missing_key(backend):
    store = backend.store
    with pytest.raises(ObjectNotFoundError) as info:
        store.get("nope")
    assert "nope" in str(info.value)
    with pytest.raises(ObjectNotFoundError):
        store.get("nope", 5, 10)
    with pytest.raises(ObjectNotFoundError):
        store.size("nope")
    assert isinstance(info.value, ObjectStoreError) and isinstance(info.value, KeyError)


def test_overwrite_with_identical_bytes(backend):
    data = payload(4096, seed=1)
    backend.store.put("k", data)
    backend.store.put("k", data)  # a retried put
    assert backend.store.get("k") == data
    assert list(backend.store.list()) == [ObjectInfo("k", 4096)]


def test_delete_is_idempotent(backend):
    store = backend.store
    store.put("x/1", b"1")
    store.put("x/2", b"22")
    store.delete(["x/1", "never-there"])
    with pytest.raises(ObjectNotFoundError):
        store.get("x/1")
    store.delete(["x/1"])
    store.delete([])
    store.delete(k for k in ["x/2"])  # any iterable
    assert list(store.list()) == []
    # More keys than one DeleteObjects request takes; almost all missing.
    store.put("keep", b"k")
    store.put("x/3", b"3")
    store.delete(itertools.chain([f"gone/{i}" for i in range(2499)], ["x/3"]))
    assert list(store.list()) == [ObjectInfo("keep", 1)]
    if backend.is_s3:
        assert backend.store.stats()["delete"] == 3 + 3  # 2500 keys = 3 batches, plus 3 above


def test_list_by_prefix(backend):
    store = backend.store
    # No key is also a "directory" of others ("a" and "a/1"): the local store cannot hold both.
    objects = {"a/1": 2, "a/10": 3, "a/2": 4, "ab": 5, "b/x/y": 6, "a-b": 7, "a.": 8}
    for key, size in objects.items():
        store.put(key, b"x" * size)
    # SeaweedFS orders keys path segment by path segment (base.py's contract).
    order = (lambda info: info.key.split("/")) if backend.kind == "seaweedfs" else None
    everything = sorted((ObjectInfo(k, s) for k, s in objects.items()), key=order)
    assert list(store.list()) == everything
    assert list(store.list("")) == everything
    assert [o.key for o in store.list("a/")] == ["a/1", "a/10", "a/2"]
    assert [o.key for o in store.list("a")] == sorted(["a-b", "a.", "a/1", "a/10", "a/2", "ab"],
                                                      key=order and (lambda key: key.split("/")))
    assert [o.key for o in store.list("a/1")] == ["a/1", "a/10"]
    assert list(store.list("b/")) == [ObjectInfo("b/x/y", 6)]
    assert list(store.list("b/x/")) == [ObjectInfo("b/x/y", 6)]
    assert list(store.list("zz")) == []
    assert list(store.list("b/x/y/")) == []
    assert list(store.list("../")) == [] and list(store.list("/")) == []


@on("moto")
def test_s3_prefix_isolates_keys(backend):
    backend.raw_client.put_object(Bucket=backend.bucket, Key="other/obj", Body=b"not ours")
    backend.raw_client.put_object(Bucket=backend.bucket, Key="streams/v1x", Body=b"not ours")
    backend.store.put("mine", b"ours")
    assert list(backend.store.list()) == [ObjectInfo("mine", 4)]
    assert backend.raw_client.get_object(
        Bucket=backend.bucket, Key="streams/v1/mine")["Body"].read() == b"ours"
    assert backend.store.url == f"s3://{backend.bucket}/streams/v1"


def test_multipart_put(backend):
    data = payload(BIG_SIZE, seed=2)
    backend.store.put("big", data)
    assert backend.store.size("big") == BIG_SIZE
    assert backend.store.get("big") == data
    # A range across the first part boundary.
    assert backend.store.get("big", PART_SIZE - 10, PART_SIZE + 10) == data[PART_SIZE - 10:
                                                                           PART_SIZE + 10]
    backend.store.put("big", memoryview(data))  # retried, from a memoryview
    assert backend.store.get("big") == data
    if backend.is_s3:
        stats = backend.store.stats()
        assert stats["upload_part"] == 2 * (BIG_SIZE // PART_SIZE)   # the last part takes the remainder
        assert stats["create_multipart"] == stats["complete_multipart"] == 2
        assert stats["put"] == 0 and stats["abort_multipart"] == 0


def gathered(size: int, seed: int):
    """An object encoded the uploader's way, its large payloads not copied, and its bytes."""
    import time
    from s3stream import FetchedBatch
    from s3stream.engine.logcache import LogCache, encode_slices
    rng = random.Random(seed)
    cache = LogCache(1 << 30, 1 << 31, time.monotonic_ns, FetchedBatch)
    offset = wal_end = 0
    while wal_end < size:
        data = payload(rng.choice([100, 3000, 64 * 1024, 300 * 1024]), seed=offset)
        wal_end += len(data) + 64
        cache.put(1 + offset % 3, 1, (offset // 3, 1, data), wal_end)
        offset += 1
    block = cache.seal()
    slices = [block.streams[sid] for sid in sorted(block.streams)]
    whole, _ = encode_slices(slices, 1 << 20)
    obj, _ = encode_slices(slices, 1 << 20, bytearray(), 8192)
    assert len(obj) == len(whole) and not isinstance(obj, (bytes, memoryview))
    middle = (len(whole) // 3, 2 * len(whole) // 3)
    assert obj.read(*middle) == whole[middle[0]:middle[1]]
    assert bytes(memoryview(obj)) == whole          # what a store that does not know it sees
    return obj, whole


def test_gathered_objects_are_stored_whole(backend):
    """The uploader's objects in pieces, one request and multipart, direct and wrapped: every
    byte lands in order; on a recycled longer file, nothing of the old one is left."""
    for key, size, store in (("small", 200 * KiB, backend.store), ("big", BIG_SIZE, backend.store),
                             ("wrapped", BIG_SIZE, InstrumentedObjectStore(backend.store))):
        obj, whole = gathered(size, seed=len(key))
        with obj:
            store.put(key, obj)
        assert backend.store.get(key) == whole
    if not backend.is_s3:
        return
    stats = backend.store.stats()
    assert stats["put"] >= 1 and stats["upload_part"] >= 2 * (BIG_SIZE // PART_SIZE)


def test_local_gathered_put_overwrites_a_longer_recycled_file(tmp_path):
    store = LocalObjectStore(tmp_path, recycle_bytes=64 * MiB, recycle_delay=0)
    store.put("old", payload(3 * MiB, seed=9))
    store.delete(["old"])
    obj, whole = gathered(1 * MiB, seed=4)
    with obj:
        store.put("new", obj)
    assert store.recycled == 1 and store.get("new") == whole


def test_concurrent_puts_and_gets(backend):
    store = backend.store
    store.put("shared", b"same bytes from everyone")
    # moto races on concurrent overwrites of one key (it closes the replaced object's buffer
    # while another request still reads it), so only the local store rewrites "shared" here.
    rewrite_shared = not backend.is_s3

    def work(thread: int) -> None:
        for i in range(10):
            key = f"t{thread}/{i}"
            data = payload(1000 + i, seed=thread * 100 + i)
            store.put(key, data)
            if rewrite_shared:
                store.put("shared", b"same bytes from everyone")
            assert store.get(key) == data
            assert store.get(key, 10, 20) == data[10:20]
            assert store.get("shared") == b"same bytes from everyone"
            assert store.size(key) == len(data)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    assert len(list(store.list())) == 8 * 10 + 1


def test_empty_and_bad_keys(backend):
    with pytest.raises(ValueError):
        backend.store.put("", b"x")
    if backend.kind == "local":
        for bad in ["../escape", "/abs", "a//b", "a/./b", "a/../b", "a/", ".s3stream-tmp.x"]:
            with pytest.raises(ValueError):
                backend.store.put(bad, b"x")


# -- conditional create (put_if_absent) --------------------------------------------------------

def test_probe_tells_which_stores_honour_conditional_puts(backend):
    """Each backend as it is: honoured by the local store, moto and SeaweedFS; rclone's serve s3
    ignores If-None-Match, and the probe says so. The probe leaves no object behind."""
    assert probe_conditional_put(backend.store) is HONOURS_CONDITIONAL_PUT[backend.kind]
    assert probe_conditional_put(InstrumentedObjectStore(backend.store), "wal/") is HONOURS_CONDITIONAL_PUT[backend.kind]
    assert list(backend.store.list()) == []


def test_put_if_absent_creates_once(backend):
    store = backend.store
    first = payload(3000, seed=5)
    assert store.put_if_absent("wal/0001", first) is True
    assert store.get("wal/0001") == first
    if not HONOURS_CONDITIONAL_PUT[backend.kind]:
        assert store.put_if_absent("wal/0001", b"overwrites") is True      # what ignoring means
        assert store.get("wal/0001") == b"overwrites"
        return
    assert store.put_if_absent("wal/0001", b"someone else") is False
    assert store.put_if_absent("wal/0001", first) is False                 # same bytes: still not this call's
    assert store.get("wal/0001") == first and store.size("wal/0001") == 3000
    # Any bytes-like; an empty object is an object.
    assert store.put_if_absent("wal/0002", bytearray(b"from a bytearray")) is True
    assert store.put_if_absent("wal/0003", memoryview(b"from a memoryview")) is True
    assert store.put_if_absent("wal/0004", b"") is True and store.put_if_absent("wal/0004", b"x") is False
    assert store.get("wal/0002") == b"from a bytearray" and store.get("wal/0003") == b"from a memoryview"
    assert store.get("wal/0004") == b""
    # A key that a plain put wrote is taken too.
    store.put("plain", b"p")
    assert store.put_if_absent("plain", b"q") is False and store.get("plain") == b"p"
    # A deleted key is free again.
    store.delete(["wal/0001"])
    assert store.put_if_absent("wal/0001", b"again") is True
    assert [i.key for i in store.list("wal/")] == ["wal/0001", "wal/0002", "wal/0003", "wal/0004"]
    if backend.kind == "local":
        # No temporary file left beside a refused or a created object.
        assert sorted(p.name for p in (tmp_root(store) / "wal").iterdir()) == ["0001", "0002", "0003", "0004"]


def tmp_root(store):
    import pathlib
    return pathlib.Path(store.root)


@on(*HONOURING)
def test_put_if_absent_concurrent_creators(backend):
    """Of creators racing for one key, exactly one wins, and the object is the winner's.
    (SeaweedFS makes the losers wait in steps of about 1 s: a few seconds here.)"""
    store = backend.store
    for round_ in range(3):
        key = f"fence/{round_}"
        barrier = threading.Barrier(4)

        def create(writer: int) -> bool:
            barrier.wait()
            return store.put_if_absent(key, f"writer {writer}".encode())

        with ThreadPoolExecutor(4) as pool:
            won = list(pool.map(create, range(4)))
        assert won.count(True) == 1, (round_, won)
        assert store.get(key) == f"writer {won.index(True)}".encode()


@on(*HTTP_SERVERS)
def test_empty_objects_do_not_stall_the_next_request(backend, aws_env):
    """SeaweedFS answers a PUT of an empty body that expects a 100-continue at once, and then
    the next request on the connection hung until the read timeout: the store sends empty
    bodies (and conditional puts) without the expectation."""
    store = S3ObjectStore(backend.bucket, endpoint_url=backend.raw_client.meta.endpoint_url,
                          region_name="us-east-1", part_size=PART_SIZE, read_timeout=2, max_attempts=1)
    try:
        for i in range(3):
            store.put(f"empty/{i}", b"")
            store.put(f"one/{i}", b"1")
            assert store.put_if_absent(f"fence/{i}", b"") is True
            assert store.get(f"one/{i}") == b"1"
            store.put_if_absent(f"fence/{i}", b"x")
        assert store.get("empty/0") == b""
        assert store.get("fence/0") == (b"" if HONOURS_CONDITIONAL_PUT[backend.kind] else b"x")
    finally:
        store.close()


def test_put_if_absent_refuses_more_than_one_request(backend):
    """A conditional create is one PUT: data over the multipart threshold is refused before
    anything is written."""
    store = backend.store
    limit = store.multipart_threshold
    store.put_if_absent("at-limit", bytes(limit))
    with pytest.raises(InvalidArgumentError, match="multipart_threshold"):
        store.put_if_absent("too-big", bytes(limit + 1))
    with pytest.raises(ObjectNotFoundError):
        store.get("too-big")
    if backend.is_s3:
        assert store.stats()["put_if_absent"] == 1


def test_local_put_if_absent_on_a_directory(tmp_path):
    store = LocalObjectStore(str(tmp_path))
    store.put("d/x", b"1")
    with pytest.raises(ObjectStoreError, match="cannot hold both"):
        store.put_if_absent("d", b"2")
    store.put("f", b"1")
    with pytest.raises(ObjectStoreError, match="cannot hold both"):
        store.put_if_absent("f/x", b"2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["x"]


def test_local_put_if_absent_uses_the_recycling_pool(tmp_path):
    store = LocalObjectStore(str(tmp_path), recycle_bytes=1 << 20, recycle_delay=0)
    store.put("old", b"o" * 5000)
    store.delete(["old"])
    assert store.put_if_absent("new", b"n" * 100) is True
    assert store.recycled == 1 and store.get("new") == b"n" * 100


class _Answer:
    """A raw HTTP body for a canned botocore response (read whole, streamed or read in chunks)."""

    def __init__(self, body: bytes) -> None:
        self.body = io.BytesIO(body)

    def stream(self, **kw):
        yield self.body.read()

    def read(self, amt=None):
        return self.body.read(amt)


def error_response(request, status: int, code: str) -> AWSResponse:
    return AWSResponse(request.url, status, {}, _Answer(
        f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>injected</Message></Error>"
        .encode()))


#: The S3 servers over HTTP that honour If-None-Match.
CONDITIONAL_HTTP = tuple(kind for kind in HTTP_SERVERS if HONOURS_CONDITIONAL_PUT[kind])


@pytest.mark.parametrize("landed", ["ours", "theirs", "nothing"])
@on(*CONDITIONAL_HTTP)
def test_put_if_absent_after_a_lost_answer(backend, landed):
    """The first request reaches the store but its answer is lost (a 500 after the write landed);
    botocore retries, and the retry is refused (412). The store reads the object back: its own
    bytes mean this call created it (True); another writer's mean it did not (False). When the
    first attempt wrote nothing, the retry simply creates the object."""
    store = backend.store
    attempts = []

    def answer_lost(request, **kw):
        attempts.append(request.url)
        if len(attempts) > 1:
            return None                             # the retry goes to the server
        if landed != "nothing":
            backend.raw_client.put_object(Bucket=backend.bucket, Key="wal/7", IfNoneMatch="*",
                                          Body=b"mine" if landed == "ours" else b"theirs")
        return error_response(request, 500, "InternalError")

    store._client.meta.events.register("before-send.s3.PutObject", answer_lost)
    assert store.put_if_absent("wal/7", b"mine") is (landed != "theirs")
    assert len(attempts) == 2
    assert store.get("wal/7") == (b"theirs" if landed == "theirs" else b"mine")
    # The read back: only after a refused retry.
    assert store.stats()["get"] == (2 if landed != "nothing" else 1)
    # Refused at the first attempt: a definite answer, nothing read back.
    store._client.meta.events.unregister("before-send.s3.PutObject", answer_lost)
    assert store.put_if_absent("wal/7", b"mine") is False
    assert store.stats()["get"] == (2 if landed != "nothing" else 1)


@on(*CONDITIONAL_HTTP)
def test_put_if_absent_retries_conflicts(backend, monkeypatch):
    """409 ConditionalRequestConflict (another conditional write of the key in flight) is
    retried until a definite answer, a bounded number of times."""
    monkeypatch.setattr(s3_module, "CONFLICT_BACKOFF", 0.0)
    store = backend.store
    conflicts = []

    def conflict(request, **kw):
        if len(conflicts) < limit:
            conflicts.append(request.url)
            return error_response(request, 409, "ConditionalRequestConflict")
        return None

    store._client.meta.events.register("before-send.s3.PutObject", conflict)
    limit = 3
    assert store.put_if_absent("k", b"v") is True and len(conflicts) == 3
    conflicts.clear()
    assert store.put_if_absent("k", b"v") is False and len(conflicts) == 3    # no read back: definite
    assert store.stats()["get"] == 0
    conflicts.clear()
    limit = 1000
    with pytest.raises(ObjectStoreError, match="ConditionalRequestConflict"):
        store.put_if_absent("other", b"v")
    assert len(conflicts) == s3_module.CONFLICT_RETRIES + 1


# -- local specifics ---------------------------------------------------------------------------

def test_local_put_is_atomic_for_readers(tmp_path):
    store = LocalObjectStore(str(tmp_path))
    data = payload(20 * MiB, seed=3)
    seen = {"missing": 0, "full": 0}
    done = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not done.is_set():
                try:
                    got = store.get("big")
                except ObjectNotFoundError:
                    seen["missing"] += 1
                else:
                    assert got == data, f"partial read of {len(got)} bytes"
                    seen["full"] += 1
                for info in store.list():
                    assert info == ObjectInfo("big", len(data))
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    store.put("big", data)
    while seen["full"] == 0 and not errors:
        done.wait(0.01)
    done.set()
    thread.join()
    assert not errors, errors[0]
    assert seen["full"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["big"]  # no temp file left


def test_local_key_cannot_also_be_a_directory(tmp_path):
    store = LocalObjectStore(str(tmp_path))
    store.put("a", b"x")
    with pytest.raises(ObjectStoreError, match="cannot hold both"):
        store.put("a/1", b"y")
    store.put("b/1", b"y")
    with pytest.raises(ObjectStoreError, match="cannot hold both"):
        store.put("b", b"x")
    with pytest.raises(ObjectNotFoundError):
        store.get("b")
    with pytest.raises(ObjectNotFoundError):
        store.size("b")
    with pytest.raises(ObjectNotFoundError):
        store.get("a/1")
    store.delete(["b", "a/1"])  # neither is an object: nothing to do
    assert list(store.list()) == [ObjectInfo("a", 1), ObjectInfo("b/1", 1)]


def test_local_failed_put_leaves_nothing(tmp_path):
    store = LocalObjectStore(str(tmp_path / "s"))

    class Exploding:
        """Not bytes-like: the write fails after the temp file was created."""

    with pytest.raises(TypeError):
        store.put("k", Exploding())  # type: ignore[arg-type]
    assert list(store.list()) == []
    assert list((tmp_path / "s").iterdir()) == []



@pytest.fixture
def tiny_fs(tmp_path):
    """A 64 KiB tmpfs (root only): writes past it fail with ENOSPC, as on a full disk."""
    import subprocess
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mountpoint)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def test_local_put_on_a_full_disk_leaves_no_temp_file(tiny_fs):
    """ENOSPC in the middle of a put (one buffer, a memoryview, pieces; a new file and a
    recycled one; put_if_absent too): an ObjectStoreError that says so, not the permanent kind
    (space may come back), and nothing left behind but the objects that fitted."""
    store = LocalObjectStore(str(tiny_fs / "s"), recycle_bytes=MiB, recycle_delay=0)
    store.put("a/small", b"x" * 1000)
    obj, whole = gathered(300 * KiB, seed=1)
    too_big = payload(300 * KiB)
    attempts = [("put", too_big), ("put", memoryview(bytearray(too_big))), ("put", obj),
                ("put_if_absent", too_big)]
    with obj:
        for op, data in attempts:
            with pytest.raises(ObjectStoreError, match="No space left on device") as raised:
                getattr(store, op)("a/big", data)
            assert type(raised.value) is ObjectStoreError and raised.value.__cause__.errno == 28
            assert raised.value.args[0].startswith(f"local {op} of 'a/big' in {store.url} failed: ")
            assert sorted(p.name for p in (tiny_fs / "s" / "a").iterdir()) == ["small"]
        store.delete(["a/small"])                  # pooled: the next put overwrites its file
        with pytest.raises(ObjectStoreError, match="No space left on device"):
            store.put("a/big", too_big)
    assert store.recycled == 1
    assert list((tiny_fs / "s" / "a").iterdir()) == []
    assert list(store.list()) == []
    store.put("a/fits", b"y" * 1000)               # the space came back
    assert store.get("a/fits") == b"y" * 1000


def test_local_recycling_reuses_deleted_files(tmp_path):
    """With recycle_bytes, a delete pools the object's file (up to the bound) and a later put
    overwrites a pooled file in place, best fit by size; the pool is never listed, and every
    object reads back exactly what was put."""
    store = LocalObjectStore(str(tmp_path), recycle_bytes=3000, recycle_delay=0)
    store.put("a/x", b"1" * 1000)
    store.put("a/y", b"2" * 1500)
    store.put("b", b"3" * 800)
    inode_y = (tmp_path / "a" / "y").stat().st_ino
    store.delete(["a/x", "a/y", "b"])           # b does not fit: 1000 + 1500 + 800 > 3000
    pool = tmp_path / POOL_DIR
    assert sorted(p.stat().st_size for p in pool.iterdir()) == [1000, 1500]
    assert list(store.list()) == [] and not (tmp_path / "b").exists()
    store.put("c", b"4" * 1200)                 # the smallest pooled file that fits: y's
    assert (tmp_path / "c").stat().st_ino == inode_y and store.recycled == 1
    assert store.get("c") == b"4" * 1200 and store.size("c") == 1200
    store.put("d", b"5" * 2000)                 # none fits: the largest, extended
    assert store.get("d") == b"5" * 2000 and store.recycled == 2
    assert list(pool.iterdir()) == []
    store.put("e", b"6" * 10)                   # pool empty: a new file
    assert store.recycled == 2
    assert [i.key for i in store.list()] == ["c", "d", "e"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".s3stream-tmp.")] == [POOL_DIR]


def test_local_recycling_waits_out_the_delay_and_survives_a_restart(tmp_path):
    """A pooled file is not reused before recycle_delay (a get that opened it may still be
    reading); a store opened later adopts what an earlier one pooled, up to its own bound."""
    store = LocalObjectStore(str(tmp_path), recycle_bytes=1 << 20, recycle_delay=30)
    store.put("k", b"a" * 4096)
    with open(tmp_path / "k", "rb") as reader:  # a get in progress while the object is deleted
        store.delete(["k"])
        store.put("j", b"b" * 4096)             # too soon: a fresh file
        assert store.recycled == 0
        assert reader.read() == b"a" * 4096
    later = LocalObjectStore(str(tmp_path), recycle_bytes=1 << 20, recycle_delay=0)
    later.put("m", b"c" * 100)
    assert later.recycled == 1 and later.get("m") == b"c" * 100
    assert list((tmp_path / POOL_DIR).iterdir()) == []
    store.put("x", b"y"); store.delete(["x", "j"])
    assert len(list((tmp_path / POOL_DIR).iterdir())) == 2
    LocalObjectStore(str(tmp_path), recycle_bytes=1000)       # only x's 1 byte fits: j's file goes
    assert [p.stat().st_size for p in (tmp_path / POOL_DIR).iterdir()] == [1]


def _wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.005)


def test_local_preallocation_writes_files_ahead_in_the_sizes_of_puts(tmp_path):
    """With preallocate_bytes, a put asks the store's thread for a file of its size, written
    ahead in the pool; the next put of that size overwrites it in place (truncated to its own
    length), the pool never holds more than the bound, and nothing of it is listed or read."""
    store = LocalObjectStore(str(tmp_path), preallocate_bytes=10_000)
    pool = tmp_path / POOL_DIR
    store.put("a", b"1" * 3000)                     # nothing ahead yet: a new file
    assert store.recycled == 0
    _wait_for(lambda: store.preallocated == 1, "a file preallocated for the put's size")
    [made] = pool.iterdir()
    assert made.stat().st_size == 3000 and made.read_bytes() == bytes(3000)   # written, not a hole
    inode = made.stat().st_ino
    store.put("b", b"2" * 2000)                     # the 3000-byte file, truncated
    assert store.recycled == 1 and store.get("b") == b"2" * 2000 and store.size("b") == 2000
    assert (tmp_path / "b").stat().st_ino == inode
    _wait_for(lambda: store.preallocated == 2, "a file for the second put")
    for i in range(8):                              # wishes of 3000 bytes: only three fit
        store.put(f"c/{i}", bytes([i]) * 3000)
    _wait_for(lambda: store.preallocated >= 5, "the pool refilled")
    time.sleep(0.05)
    assert sum(p.stat().st_size for p in pool.iterdir()) <= 10_000
    assert [i.key for i in store.list()] == ["a", "b"] + [f"c/{i}" for i in range(8)]
    assert all(store.get(f"c/{i}") == bytes([i]) * 3000 for i in range(8))
    store.close()
    assert not store._filler.is_alive()
    store.put("after-close", b"x")                  # still a store; no thread again
    assert store.get("after-close") == b"x" and not store._filler.is_alive()


def test_local_preallocated_files_go_ahead_of_deleted_ones_still_waiting(tmp_path):
    """A deleted object's file waits out recycle_delay in the pool; a file preallocated after
    it is ready at once and taken first."""
    store = LocalObjectStore(str(tmp_path), recycle_bytes=1 << 20, recycle_delay=30, preallocate_bytes=1 << 20)
    store.put("old", b"o" * 4000)
    _wait_for(lambda: store.preallocated == 1, "a file preallocated")
    store.delete(["old"])                           # pooled behind it, not ready for 30 s
    store.put("new", b"n" * 4000)                   # takes the preallocated file
    _wait_for(lambda: store.preallocated == 2, "another file preallocated")
    store.put("next", b"x" * 4000)
    assert store.recycled == 2 and not (tmp_path / "old").exists()
    assert store.get("next") == b"x" * 4000 and store.get("new") == b"n" * 4000
    store.close()


def test_local_preallocation_adopted_by_the_next_store(tmp_path):
    """Files preallocated by a store that closed are adopted by the next one on the root and
    overwritten by its puts."""
    first = LocalObjectStore(str(tmp_path), preallocate_bytes=1 << 20)
    first.put("k", b"a" * 5000)
    _wait_for(lambda: first.preallocated == 1, "a file preallocated")
    first.close()
    later = LocalObjectStore(str(tmp_path), preallocate_bytes=1 << 20)
    later.put("m", b"b" * 5000)
    assert later.recycled == 1 and later.get("m") == b"b" * 5000
    later.close()


@pytest.mark.parametrize("kw, message", [(dict(recycle_bytes=-1), "recycle_bytes"),
                                         (dict(preallocate_bytes=-1), "preallocate_bytes"),
                                         (dict(preallocate_bytes=True), "preallocate_bytes"),
                                         (dict(recycle_bytes=True), "recycle_bytes"),
                                         (dict(recycle_bytes=1.5), "recycle_bytes"),
                                         (dict(recycle_delay=-1), "recycle_delay"),
                                         (dict(recycle_delay="1"), "recycle_delay")])
def test_local_recycling_settings_are_checked(tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message):
        LocalObjectStore(str(tmp_path), **kw)
    store = open_object_store(f"file://{tmp_path}?recycle_bytes=4096&recycle_delay=0.5&preallocate_bytes=8192")
    assert (store.recycle_bytes, store.recycle_delay, store.preallocate_bytes) == (4096, 0.5, 8192)

# -- S3 specifics --------------------------------------------------------------------------------

@on(*S3_KINDS)
def test_failed_multipart_upload_is_aborted(backend, monkeypatch):
    client = backend.store._client
    real_upload_part = client.upload_part
    calls = itertools.count()

    def flaky_upload_part(**kw):
        if next(calls) >= 1:
            raise ClientError({"Error": {"Code": "InternalError", "Message": "boom"}}, "UploadPart")
        return real_upload_part(**kw)

    monkeypatch.setattr(client, "upload_part", flaky_upload_part)
    with pytest.raises(ObjectStoreError) as info:
        backend.store.put("big", payload(BIG_SIZE))
    assert "big" in str(info.value) and isinstance(info.value.__cause__, ClientError)
    assert backend.raw_client.list_multipart_uploads(Bucket=backend.bucket).get("Uploads", []) == []
    assert backend.store.stats()["abort_multipart"] == 1
    with pytest.raises(ObjectNotFoundError):
        backend.store.size("big")


def test_unreachable_endpoint_raises_after_retries(aws_env):
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = S3ObjectStore("bucket", endpoint_url=f"http://127.0.0.1:{port}",
                          region_name="us-east-1", max_attempts=2, connect_timeout=0.5)
    try:
        with pytest.raises(ObjectStoreError) as info:
            store.put("k", b"data")
        assert "put" in str(info.value) and "'k'" in str(info.value)
        assert isinstance(info.value.__cause__, EndpointConnectionError)
        with pytest.raises(ObjectStoreError):
            store.get("k")
        assert store.stats()["put"] == 1 and store.stats()["get"] == 1
    finally:
        store.close()


@on(*HTTP_SERVERS)
def test_transient_error_is_retried(backend):
    attempts = []

    class Raw:
        def stream(self, **kw):
            yield (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
                   b"<Message>try again</Message></Error>")

    def first_attempt_fails(request, **kw):
        attempts.append(request.url)
        if len(attempts) == 1:
            return AWSResponse(request.url, 500, {}, Raw())
        return None  # send it for real

    backend.store._client.meta.events.register("before-send.s3.PutObject", first_attempt_fails)
    backend.store.put("k", b"data")
    assert len(attempts) == 2
    assert backend.store.stats()["put"] == 1  # one request from the store's point of view
    assert backend.store.get("k") == b"data"


@on(*HTTP_SERVERS)
def test_gets_validate_whole_objects_not_ranges(backend):
    """A whole-object get is validated against the server's checksum of the object (each of
    these servers keeps one); a range is not, since a server may answer it with the whole
    object's checksum (rclone does) and the object format's block CRCs check what ranges read."""
    bodies = []
    backend.store._client.meta.events.register(
        "after-call.s3.GetObject", lambda parsed, **kw: bodies.append(type(parsed["Body"]).__name__))
    data = payload(5000, seed=11)
    backend.store.put("obj", data)
    assert backend.store.get("obj") == data
    assert backend.store.get("obj", 100, 200) == data[100:200]
    assert backend.store.get("obj", 4000) == data[4000:]
    assert bodies == ["StreamingChecksumBody", "StreamingBody", "StreamingBody"]


@on("moto_http")
def test_whole_object_checksum_mismatch_is_an_error(backend):
    backend.store.put("obj", b"the real bytes")

    def corrupted(request, **kw):
        headers = {"x-amz-checksum-crc32": "AAAAAA==", "content-length": "14"}
        return AWSResponse(request.url, 200, headers, _Answer(b"the real bytez"))

    backend.store._client.meta.events.register("before-send.s3.GetObject", corrupted)
    with pytest.raises(ObjectStoreError, match="checksum"):
        backend.store.get("obj")


@on("rclone")
def test_rclone_answers_ranges_with_the_whole_objects_checksum(backend):
    """Why ranged gets are not validated: through rclone's serve s3, a client with botocore's
    default validation fails every ranged GET ("Expected checksum ... did not match"); the
    store reads them."""
    from botocore.exceptions import FlexibleChecksumError
    data = payload(1000, seed=12)
    backend.store.put("obj", data)
    default_validation = backend.raw_client      # botocore's default: "when_supported"
    with pytest.raises(FlexibleChecksumError, match="Expected checksum"):
        default_validation.get_object(Bucket=backend.bucket, Key="obj", Range="bytes=10-19")["Body"].read()
    assert backend.store.get("obj", 10, 20) == data[10:20]


@on(*S3_KINDS)
def test_missing_bucket_is_an_object_store_error(backend):
    store = S3ObjectStore("no-such-bucket-here", client=backend.store._client,
                          part_size=PART_SIZE)
    with pytest.raises(ObjectStoreError, match="does not exist"):
        store.put("k", b"x")
    store.close()


# -- open_object_store -------------------------------------------------------------------------

def test_open_local_by_path_and_url(tmp_path):
    by_path = open_object_store(str(tmp_path / "p" / "q"))
    assert isinstance(by_path, LocalObjectStore) and (tmp_path / "p" / "q").is_dir()
    by_url = open_object_store(f"file://{tmp_path}/u%20v?part_size=6291456")
    assert isinstance(by_url, LocalObjectStore) and (tmp_path / "u v").is_dir()
    assert by_url.part_size == 6 * MiB and by_url.url == f"file://{tmp_path}/u v"
    with pytest.raises(ConfigError, match="file:///"):
        open_object_store("file://relative/path")
    with pytest.raises(ConfigError, match="endpoint_url"):
        open_object_store(f"file://{tmp_path}/x?endpoint_url=http://x")


def test_open_s3_with_query_parameters(aws_env):
    with mock_aws():
        store = open_object_store(
            "s3://my-bucket/some/prefix/?region=us-east-1&part_size=8388608&max_concurrency=4"
            "&max_attempts=3&connect_timeout=1.5&read_timeout=7&create_bucket=1")
        try:
            assert isinstance(store, S3ObjectStore)
            assert store.url == "s3://my-bucket/some/prefix"
            assert store.part_size == 8 * MiB and store.max_concurrency == 4
            config = store._client.meta.config
            assert config.connect_timeout == 1.5 and config.read_timeout == 7
            assert config.retries["total_max_attempts"] == 3
            assert store._client.meta.region_name == "us-east-1"
            store.put("k", b"v")
            assert open_object_store("s3://my-bucket/some/prefix").get("k") == b"v"
        finally:
            store.close()
        with pytest.raises(ConfigError, match="create_bucket=1"):
            open_object_store("s3://missing-bucket")
        # keyword arguments override the query
        store = open_object_store("s3://my-bucket?part_size=8388608", part_size=6 * MiB)
        assert store.part_size == 6 * MiB
        store.close()


@on(*HTTP_SERVERS)
def test_open_s3_endpoint_url(backend):
    endpoint = backend.store._client.meta.endpoint_url
    store = open_object_store(f"s3://{backend.bucket}/pre?endpoint_url={endpoint}&region=us-east-1")
    try:
        store.put("k", b"over http")
        assert backend.raw_client.get_object(
            Bucket=backend.bucket, Key="pre/k")["Body"].read() == b"over http"
    finally:
        store.close()


@pytest.mark.parametrize("url, message", [
    ("http://example.com/x", "supported: file:///"),
    ("gs://bucket", "unsupported object store URL scheme 'gs'"),
    ("s3://bucket?colour=blue&endpoint_url=http://x", "unknown parameter(s) colour"),
    ("s3://bucket?part_size=big", "part_size='big'"),
    ("s3://bucket?create_bucket=maybe", "must be 1 or 0"),
    ("s3://bucket?region=a&region=b", "2 times"),
    ("s3:///prefix-only", "no bucket"),
    ("s3://bucket?part_size=1024", "minimum part size"),
])
def test_open_rejects_bad_urls(url, message, aws_env):
    with pytest.raises(ConfigError) as info:
        open_object_store(url)
    assert message in str(info.value)


# -- wrappers ----------------------------------------------------------------------------------

def test_wrappers_forward(backend):
    for wrapper in (InstrumentedObjectStore(backend.store),
                    FaultInjectingObjectStore(backend.store)):
        assert isinstance(wrapper, ObjectStore)
        assert wrapper.url == backend.store.url
        assert wrapper.part_size == PART_SIZE


def test_fault_injection(backend):
    store = FaultInjectingObjectStore(backend.store, seed=7)
    store.fail_next_puts(2)
    for _ in range(2):
        with pytest.raises(ObjectStoreError):
            store.put("a", b"first")
    with pytest.raises(ObjectNotFoundError):
        store.get("a")  # nothing was written
    store.put("a", b"first")

    store.fail_next_puts(1, exc=TimeoutError("custom"))
    with pytest.raises(TimeoutError):
        store.put("b", b"x")

    store.fail_puts_matching(lambda key: key.startswith("bad/"))
    with pytest.raises(ObjectStoreError):
        store.put("bad/1", b"x")
    store.put("good/1", b"x")

    store.put_timeout_after_landing(1)
    with pytest.raises(ObjectStoreError, match="timed out"):
        store.put("landed", b"it is there")
    assert backend.store.get("landed") == b"it is there"
    store.put("landed", b"it is there")  # the caller's retry succeeds

    store.fail_next_gets(1)
    with pytest.raises(ObjectStoreError):
        store.get("a")
    assert store.get("a") == b"first"

    store.corrupt_gets(lambda key: key == "a")
    corrupted = store.get("a")
    assert corrupted != b"first" and len(corrupted) == 5
    assert sum(x != y for x, y in zip(corrupted, b"first")) == 1
    assert store.get("landed") == b"it is there"

    store.clear()
    assert store.get("a") == b"first"
    store.put("bad/2", b"now fine")

    ticks = []
    store.hang_puts(0.05)
    store._sleep = ticks.append  # an injected clock keeps the test fast
    store.put("slow", b"x")
    assert ticks == [0.05]

    assert ("put", "a", "injected_failure") in store.events
    assert ("put", "landed", "timeout_after_landing") in store.events
    assert ("get", "a", "corrupted") in store.events
    assert ("get", "a", "ObjectNotFoundError") in store.events
    assert store.events[-1] == ("put", "slow", "ok")


def test_instrumented_counts(backend):
    store = InstrumentedObjectStore(backend.store)
    store.put("small", b"12345")
    big = payload(BIG_SIZE)
    store.put("big", big)
    assert store.get("small") == b"12345"
    assert store.get("big", 0, 100) == big[:100]
    store.get("small", 2, 2)
    with pytest.raises(ObjectNotFoundError):
        store.get("missing")
    store.size("small")
    store.delete(["small", "missing"])
    assert len(list(store.list())) == 1
    stats = store.stats()
    assert stats["put"] == 2
    parts = BIG_SIZE // PART_SIZE                 # the last part takes the remainder
    assert stats["put_requests"] == 1 + (parts + 2)  # small; create + parts + complete
    assert stats["bytes_written"] == 5 + BIG_SIZE
    assert stats["get"] == 4 and stats["get_requests"] == 3
    assert stats["bytes_read"] == 5 + 100
    assert stats["size"] == 1 and stats["delete"] == 1 and stats["deleted_keys"] == 2
    assert stats["list"] == 1 and stats["errors"] == 1
    if backend.is_s3:
        assert backend.store.stats()["upload_part"] == parts
    store.reset()
    assert set(store.stats().values()) == {0}


def test_write_requests_rule():
    from s3stream.objectstore.base import write_requests
    mib = 1024 * 1024
    assert write_requests(16 * mib + 8192, 16 * mib, 32 * mib) == 1      # a block plus its index: one PUT
    assert write_requests(32 * mib, 16 * mib, 32 * mib) == 1
    assert write_requests(32 * mib + 1, 16 * mib, 32 * mib) == 2 + 2      # 2 parts, the last one a byte longer
    assert write_requests(64 * mib + 9000, 16 * mib, 32 * mib) == 4 + 2   # an upload block + index: 4 parts
    assert write_requests(10 * mib, None, None) == 1                      # a store that never splits


@on("local", "moto")
def test_instrumented_counts_conditional_puts(backend):
    """A put_if_absent counts as a put of one request, under its own name too (refusals apart),
    and is timed apart from plain puts."""
    store = InstrumentedObjectStore(backend.store)
    assert store.put_if_absent("w/1", b"abc") is True
    assert store.put_if_absent("w/1", b"abcd") is False
    with pytest.raises(InvalidArgumentError):
        store.put_if_absent("w/2", bytes(backend.store.multipart_threshold + 1))
    stats = store.stats()
    assert stats["put"] == stats["put_requests"] == stats["put_if_absent"] == 3
    assert stats["put_if_absent_refused"] == 1 and stats["errors"] == 1
    assert stats["bytes_written"] == 3                      # only what was created
    latencies = store.latencies()
    assert latencies["put_if_absent"]["count"] == 3 and latencies["put"]["count"] == 0
    assert store.inflight()["put_if_absent"] == 0


@on("local", "moto")
def test_fault_injection_conditional_puts(backend):
    store = FaultInjectingObjectStore(backend.store)
    store.fail_next_puts_if_absent(1)
    with pytest.raises(ObjectStoreError, match="injected"):
        store.put_if_absent("w/1", b"mine")
    with pytest.raises(ObjectNotFoundError):
        backend.store.get("w/1")                            # nothing was written
    store.fail_next_puts_if_absent(1, exc=TimeoutError("custom"))
    with pytest.raises(TimeoutError):
        store.put_if_absent("w/1", b"mine")

    # The answer is lost after the object landed: the caller's retry is refused, and reading
    # the object back tells it the object is its own.
    store.fail_next_puts(5)                                 # plain puts' faults leave these alone
    store.put_if_absent_answer_lost(1)
    with pytest.raises(ObjectStoreError, match="timed out"):
        store.put_if_absent("w/1", b"mine")
    assert store.put_if_absent("w/1", b"mine") is False and store.get("w/1") == b"mine"
    with pytest.raises(ObjectStoreError):
        store.put("plain", b"p")
    store.clear()

    ticks: list[float] = []
    store._sleep = ticks.append
    store.hang_puts_if_absent(0.5)
    store.put("plain", b"p")                                # plain puts do not hang
    assert store.put_if_absent("w/2", b"x") is True and ticks == [0.5]
    store.hang_puts_if_absent(0)

    assert probe_conditional_put(store) is True
    store.ignore_put_if_absent_condition()                  # a server that ignores If-None-Match
    assert probe_conditional_put(store) is False
    assert store.put_if_absent("w/2", b"y") is True and backend.store.get("w/2") == b"y"
    store.clear()
    assert store.put_if_absent("w/2", b"z") is False

    outcomes = [(key, outcome) for op, key, outcome in store.events if op == "put_if_absent"]
    assert outcomes[:4] == [("w/1", "injected_failure"), ("w/1", "injected_failure"), ("w/1", "answer_lost"),
                            ("w/1", "refused")]
    assert ("w/2", "condition_ignored") in outcomes and outcomes[-1] == ("w/2", "refused")
    assert [key for key, _ in outcomes if key.startswith("s3stream-probe-")]
