"""`s3stream inspect` on what a new user has at hand (issue 50, item 8): a WAL kept as objects,
read without writing anything there (the node goes on unfenced), and an object named by the id
`s3stream streams --objects` prints, resolved through the metadata."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import wal
from s3stream import RecordBatch, StreamClient
from s3stream.metadata import ObjectState, open_metadata
from s3stream.objectstore import LocalObjectStore
from wal import objectinspect
from wal.objectlog import ObjectWAL
from cli_helpers import fails, ok, run
from conftest import small_config


def tree(root: Path) -> dict[str, tuple[str, int]]:
    """Every object file under `root`: its content's hash and its mtime. A local store's
    temporary file (a write of the running node still in flight, renamed or removed when it
    ends) is no object: seen in one snapshot and gone in the next, it made the test flaky."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(".s3stream-tmp.")}


class ReadOnlyStore:
    """A store that lets reads through and fails the test on any write."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.url = inner.url
        self.calls: list[str] = []

    def list(self, prefix: str = ""):
        self.calls.append("list")
        return self.inner.list(prefix)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        self.calls.append("get")
        return self.inner.get(key, start, end)

    def put_if_absent(self, key, data):
        raise AssertionError(f"inspect wrote {key!r}")

    put = put_if_absent

    def delete(self, keys):
        raise AssertionError(f"inspect deleted {list(keys)!r}")


@pytest.fixture
def object_wal_node(tmp_path):
    """Node 1 running with its WAL as objects, 20 records on stream A and 10 on stream B, all
    still only in the WAL (below the upload threshold)."""
    wal_url = f"objects+file://{tmp_path}/wal"
    meta_url = f"sqlite:///{tmp_path}/meta.db"
    client = StreamClient(1, wal_url, f"file://{tmp_path}/objects", meta_url, small_config())
    a, b = client.create_stream(), client.create_stream()
    for i in range(20):
        a.append(RecordBatch(b"a%03d" % i, 1)).result(10)
    for i in range(10):
        b.append(RecordBatch(b"b%03d" % i, 2)).result(10)
    yield client, wal_url, (a, b)
    client.close()


def test_inspect_reads_a_wal_of_objects_without_writing_to_it(tmp_path, object_wal_node):
    client, wal_url, (a, b) = object_wal_node
    before = tree(tmp_path / "wal")
    result = run("inspect", "wal", wal_url, "--records", "--json")
    data = json.loads(ok(result))
    assert tree(tmp_path / "wal") == before                 # no fence, no hole, no delete
    assert data["kind"] == "objects" and data["info"]["node_id"] == 1 and data["recovery"]["error"] is None
    assert [(s["stream_id"], s["records"], s["first_offset"], s["end_offset"]) for s in data["streams"]] == [
        (a.stream_id, 20, 0, 20), (b.stream_id, 10, 0, 20)]
    assert data["info"]["counts"]["fence"] >= 1 and data["info"]["counts"]["data"] >= 1
    # The node was not fenced: it goes on acknowledging, and a second look sees that too.
    assert a.append(RecordBatch(b"after", 1)).result(10).base_offset == 20
    text = ok(run("inspect", "wal", wal_url, "--node-id", "1", "--objects"))
    assert "read only: no fence, no hole, no delete" in text and "valid records   31" in text
    assert "Objects (" in text and "fence" in text

    # What it read is what a recovery replays: the same records, in the same order.
    inspected = json.loads(ok(run("inspect", "wal", wal_url, "--records", "--json")))["records"]
    store = LocalObjectStore(str(tmp_path / "wal"))
    seen = ReadOnlyStore(store)
    log = objectinspect.snapshot(seen, 1)
    scan = objectinspect.ScanResult()
    mine = [(r.offset, r.data) for r in objectinspect.records(seen, log, scan)]
    assert set(seen.calls) == {"list", "get"} and scan.error is None
    with ObjectWAL.open(store, node_id=1, recovery=True) as recovered:      # fences the node: last
        replayed = [(r.offset, r.data) for r in recovered.recover()]
    assert mine == replayed and [r["offset"] for r in inspected] == [o for o, _ in replayed]


def test_inspect_wal_of_objects_errors(tmp_path, object_wal_node):
    _, wal_url, _ = object_wal_node
    fails(run("inspect", "wal", wal_url, "--node-id", "7"), 1, "no WAL objects of node 7", "nodes 1")
    fails(run("inspect", "wal", f"objects+file://{tmp_path}/nowhere"), 1, "no WAL directory")
    assert not (tmp_path / "nowhere").exists()              # a mistyped URL creates nothing
    (tmp_path / "empty").mkdir()
    fails(run("inspect", "wal", f"objects+file://{tmp_path}/empty"), 1, "holds no WAL objects")
    store = LocalObjectStore(str(tmp_path / "wal"))
    key = next(k.key for k in store.list("node-1/") if k.size > objectinspect.HEADER_BYTES)
    raw = bytearray(store.get(key))
    raw[objectinspect.HEADER_BYTES + 40] ^= 0xFF              # inside the body's first record
    (tmp_path / "wal" / key).write_bytes(bytes(raw))
    result = run("inspect", "wal", wal_url)
    fails(result, 1, "is damaged at logical offset")
    assert "valid records" in result.stdout                  # the summary first


@pytest.fixture
def engine_meta(tmp_path):
    """A node's data after a clean close, and its metadata URL."""
    meta_url = f"sqlite:///{tmp_path}/meta.db"
    client = StreamClient(1, tmp_path / "n1.wal", f"file://{tmp_path}/objects", meta_url, small_config())
    stream = client.create_stream()
    for i in range(40):
        stream.append(RecordBatch(bytes([i]) * 4000, 1)).result(10)
    client.close()
    return meta_url


def test_inspect_object_by_the_id_streams_prints(tmp_path, engine_meta):
    listing = json.loads(ok(run("streams", "--meta", engine_meta, "--objects", "--json")))
    [obj] = [o for o in listing["object_list"] if o["state"] == ObjectState.COMMITTED.value]
    assert obj["ranges"] == [[1, 0, 40]]
    text = ok(run("streams", "--meta", engine_meta, "--objects"))
    assert f"  {obj['object_id']} " in text and obj["key"] in text
    store = f"file://{tmp_path}/objects"
    data = json.loads(ok(run("inspect", "object", str(obj["object_id"]), "--meta", engine_meta, "--store", store,
                             "--verify", "--json")))
    assert data["key"] == obj["key"] and data["metadata"]["object_id"] == obj["object_id"]
    assert data["verify"] == [None] * len(data["index"]) and data["index"][-1]["end_offset"] == 40
    out = ok(run("inspect", "object", str(obj["object_id"]), "--store", store, env={"S3STREAM_META": engine_meta}))
    assert f"Object {obj['object_id']} (COMMITTED {obj['type']}" in out
    fails(run("inspect", "object", "999", "--meta", engine_meta, "--store", store), 1, "object 999 is not in the "
          "metadata", "s3stream streams --objects")
    fails(run("inspect", "object", str(obj["object_id"]), "--meta", engine_meta), 1, obj["key"], "pass --store")
    fails(run("inspect", "object", str(obj["object_id"]), "--store", store), 1, "looks like an object id",
          "--meta")
    with open_metadata(engine_meta) as meta:
        meta.mark_destroyed([obj["object_id"]])
    (tmp_path / "objects" / obj["key"]).unlink()
    fails(run("inspect", "object", str(obj["object_id"]), "--meta", engine_meta, "--store", store), 1,
          "MARK_DESTROYED in the metadata", "is not in")
