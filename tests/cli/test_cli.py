"""The `s3stream` command on real data: WALs (clean, left by a killed process, corrupt), objects
(intact, corrupted copies), metadata, a migration between two live nodes, a quick benchmark and the
user errors (exit status != 0, one line, no traceback)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

import wal
from s3stream import RecordBatch, StreamClient
from cli_helpers import fails, run
from s3stream.cluster import Cluster, ClusterConfig, NodeAgent, partition_on
from s3stream.metadata import ObjectState, ObjectType, SqliteMetadataStore, open_metadata
from s3stream.objectstore import LocalObjectStore, open_object_store
from conftest import small_config

TESTS = Path(__file__).parent.parent
FAST = ClusterConfig(agent_interval=0.01, heartbeat_interval=0.1, heartbeat_timeout=1.0, migration_timeout=5.0,
                     auto_failover=False)




def fingerprint(path: Path) -> tuple:
    st = path.stat()
    return hashlib.sha256(path.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns


# ---- data -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    """One node's data after a clean close: stream 1 large enough for its own StreamObject (a
    cut at the split size), its rest and streams 2 and 3 sharing a StreamSetObject."""
    tmp = tmp_path_factory.mktemp("engine")
    client = StreamClient(1, tmp / "node1.wal", f"file://{tmp}/objects", f"sqlite:///{tmp}/meta.db", small_config())
    streams = [client.create_stream() for _ in range(3)]
    futures = [streams[i % 3].append(RecordBatch(bytes([i % 256]) * (5000 if i % 3 == 0 else 100), 2))
               for i in range(300)]
    for f in futures:
        f.result(10)
    client.close()
    return tmp


def committed(tmp: Path, kind: ObjectType):
    meta = SqliteMetadataStore(str(tmp / "meta.db"))
    try:
        return next(o for o in meta.list_objects(state=ObjectState.COMMITTED) if o.type == kind)
    finally:
        meta.close()


@pytest.fixture(scope="module")
def killed_wal(tmp_path_factory) -> Path:
    """The WAL of a node process that appended 30 batches to 3 streams and exited without closing."""
    tmp = tmp_path_factory.mktemp("killed")
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(TESTS)!r})
        from conftest import small_config
        from s3stream import RecordBatch, StreamClient
        tmp = {str(tmp)!r}
        client = StreamClient(1, tmp + "/node1.wal", "file://" + tmp + "/objects", "sqlite:///" + tmp + "/meta.db",
                              small_config())
        streams = [client.create_stream() for _ in range(3)]
        futures = [streams[i % 3].append(RecordBatch(b"%03d" % i * 10, 2)) for i in range(30)]
        for f in futures:
            f.result(10)
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    return tmp / "node1.wal"


# ---- the console script ----------------------------------------------------------------------------

def test_console_script_is_installed():
    exe = shutil.which("s3stream")
    assert exe, "the s3stream console script is missing: pip install -e ."
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for command in ("inspect", "streams", "migrate", "bench"):
        assert command in out.stdout


def test_help_of_every_command():
    for args in (["inspect", "wal"], ["inspect", "object"], ["streams"], ["migrate"], ["bench"], ["node", "fail-over"],
                 ["node", "forget"], ["node", "history"]):
        result = run(*args, "--help")
        assert result.exit_code == 0 and "Usage: " in result.stdout, result.output
    assert "NodeAgent" in run("migrate", "--help").stdout


# ---- inspect wal -----------------------------------------------------------------------------------

def test_inspect_wal_clean(engine_dir):
    path = engine_dir / "node1.wal"
    before = fingerprint(path)
    text = run("inspect", "wal", path)
    assert text.exit_code == 0, text.output
    assert "clean shutdown  yes" in text.stdout and "node            1 epoch 0" in text.stdout
    data = json.loads(run("inspect", "wal", path, "--json").stdout)
    h = data["header"]
    assert h["node_id"] == 1 and h["clean_shutdown"] and h["generation"] == 1
    assert h["capacity"] == small_config().wal.capacity and h["slots"] == ["valid", "valid"]
    # everything was uploaded and trimmed: recovery has nothing to replay
    assert data["recovery"]["records"] == 0 and data["recovery"]["error"] is None
    assert h["trim_offset"] > 0
    assert fingerprint(path) == before


def test_inspect_wal_left_by_a_killed_process(killed_wal):
    before = fingerprint(killed_wal)
    result = run("inspect", "wal", killed_wal, "--records", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert not data["header"]["clean_shutdown"]
    rec = data["recovery"]
    assert rec["records"] == 30 and rec["first_offset"] == 0 and rec["error"] is None
    assert "bad record magic" in rec["stop_reason"]
    assert [(r["stream_id"], r["base_offset"], r["count"]) for r in data["records"][:4]] == [
        (1, 0, 2), (2, 0, 2), (3, 0, 2), (1, 2, 2)]
    assert all(r["payload_bytes"] == 30 and r["length"] == 30 + 28 for r in data["records"])
    assert [(s["stream_id"], s["records"], s["first_offset"], s["end_offset"]) for s in data["streams"]] == [
        (1, 10, 0, 20), (2, 10, 0, 20), (3, 10, 0, 20)]
    text = run("inspect", "wal", killed_wal, "--records", "--node-id", "1")
    assert text.exit_code == 0 and "clean shutdown  no" in text.stdout and "valid records   30" in text.stdout
    assert "Records (30)" in text.stdout
    fails(run("inspect", "wal", killed_wal, "--node-id", "2"), 1, "belongs to node 1")
    assert fingerprint(killed_wal) == before       # read-only, every time


def test_inspect_wal_clean_but_damaged(tmp_path):
    path = tmp_path / "lost.wal"
    with wal.WriteAheadLog.open(path, node_id=5, config=wal.WALConfig(capacity=1 << 20)) as w:
        for i in range(20):
            w.append(b"record %d" % i)
    with wal.WriteAheadLog.open(path, node_id=5, recovery=True) as w:
        tenth = list(w.recover())[10]
    with open(path, "r+b") as f:            # flip a byte in the body of the 11th record
        f.seek(8192 + tenth.offset + 32)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = run("inspect", "wal", path)
    fails(result, 1, "lost or corrupted data")
    assert "valid records   10" in result.stdout and "checksum mismatch" in result.stdout


def test_inspect_wal_errors(tmp_path, engine_dir):
    fails(run("inspect", "wal", tmp_path / "missing.wal"), 2, "does not exist")
    fails(run("inspect", "wal", tmp_path), 2, "is a directory")
    (tmp_path / "zero.wal").write_bytes(bytes(64 * 1024))
    fails(run("inspect", "wal", tmp_path / "zero.wal"), 1, "never formatted")
    (tmp_path / "tiny.wal").write_bytes(b"x" * 100)
    fails(run("inspect", "wal", tmp_path / "tiny.wal"), 1, "too small")
    fails(run("inspect", "wal", engine_dir / "meta.db"), 1, "not an s3stream WAL")
    broken = tmp_path / "broken.wal"
    raw = bytearray((engine_dir / "node1.wal").read_bytes())
    raw[20] ^= 0xFF
    raw[4096 + 20] ^= 0xFF                    # inside both header slots (their first 84 bytes)
    broken.write_bytes(bytes(raw))
    fails(run("inspect", "wal", broken), 1, "corrupt WAL header")


# ---- inspect object --------------------------------------------------------------------------------

def test_inspect_object_file_and_key(engine_dir):
    so = committed(engine_dir, ObjectType.STREAM_OBJECT)
    path = engine_dir / "objects" / so.key
    result = run("inspect", "object", path, "--verify")
    assert result.exit_code == 0, result.output
    assert f"{so.size:,} bytes" in result.stdout and "verify: OK" in result.stdout
    data = json.loads(run("inspect", "object", so.key, "--store", f"file://{engine_dir}/objects", "--json").stdout)
    assert data["size"] == so.size and data["key"] == so.key
    assert data["footer"]["entries"] == len(data["index"]) > 1
    index = data["index"]
    assert {e["stream_id"] for e in index} == {1}
    # The stream's first StreamObject: it reached the split size there and went up alone (a cut).
    assert index[0]["start_offset"] == 0 and 0 < index[-1]["end_offset"] < 200
    assert all(a["end_offset"] == b["start_offset"] for a, b in zip(index, index[1:]))
    assert data["footer"]["index_position"] == index[-1]["block_position"] + index[-1]["block_size"]
    sso = committed(engine_dir, ObjectType.STREAM_SET_OBJECT)
    data = json.loads(run("inspect", "object", sso.key, "--store", engine_dir / "objects", "--verify",
                          "--json").stdout)
    assert {e["stream_id"] for e in data["index"]} == {1, 2, 3} and data["verify"] == [None] * len(data["index"])


def test_inspect_object_in_s3(engine_dir, moto_endpoint):
    so = committed(engine_dir, ObjectType.STREAM_OBJECT)
    url = f"s3://cli-{os.urandom(4).hex()}/data?endpoint_url={moto_endpoint}"
    store = open_object_store(url + "&create_bucket=1")
    store.put(so.key, (engine_dir / "objects" / so.key).read_bytes())
    store.close()
    result = run("inspect", "object", so.key, "--store", url, "--verify", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["size"] == so.size and data["store"].startswith("s3://")
    assert data["verify"] == [None] * len(data["index"])
    fails(run("inspect", "object", "ab/none.obj", "--store", url), 1, "ab/none.obj")


def test_inspect_object_corrupt_copies(engine_dir, tmp_path):
    so = committed(engine_dir, ObjectType.STREAM_OBJECT)
    good = (engine_dir / "objects" / so.key).read_bytes()
    index = json.loads(run("inspect", "object", engine_dir / "objects" / so.key, "--json").stdout)["index"]
    bad = bytearray(good)
    bad[index[1]["block_position"] + 100] ^= 0xFF         # inside the second block
    copy = tmp_path / "bad.obj"
    copy.write_bytes(bytes(bad))
    assert run("inspect", "object", copy).exit_code == 0   # footer and index are intact
    result = run("inspect", "object", copy, "--verify")
    fails(result, 1, f"1 of {len(index)} blocks failed verification")
    assert "CORRUPT" in result.stdout and "checksum mismatch" in result.stdout
    data = json.loads(run("inspect", "object", copy, "--verify", "--json").stdout)
    assert [p is None for p in data["verify"]] == [i != 1 for i in range(len(index))]
    truncated = tmp_path / "truncated.obj"
    truncated.write_bytes(good[:-10])
    fails(run("inspect", "object", truncated), 1, "is corrupt")
    tiny = tmp_path / "tiny.obj"
    tiny.write_bytes(b"abc")
    fails(run("inspect", "object", tiny), 1, "smaller than")


def test_inspect_object_errors(engine_dir, tmp_path):
    fails(run("inspect", "object", tmp_path / "missing.obj"), 1, "no such file")
    fails(run("inspect", "object", tmp_path), 1, "not a regular file")
    fails(run("inspect", "object", "ab/0001.obj", "--store", engine_dir / "objects"), 1, "no object")
    fails(run("inspect", "object", "../x", "--store", engine_dir / "objects"), 1, "invalid object key")
    fails(run("inspect", "object", "k", "--store", tmp_path / "nowhere"), 1, "no object store directory")
    assert not (tmp_path / "nowhere").exists()           # a mistyped store is not created
    fails(run("inspect", "object", "k", "--store", "ftp://host/x"), 1, "unsupported object store URL scheme")
    fails(run("inspect", "object", "k", "--store", "s3://"), 1, "no bucket")


# ---- streams ---------------------------------------------------------------------------------------

def test_streams_text_and_json(engine_dir):
    url = f"sqlite:///{engine_dir}/meta.db"
    data = json.loads(run("streams", "--meta", url, "--json").stdout)
    assert [(s["stream_id"], s["state"], s["end_offset"], s["ranges"], s["stream_objects"], s["stream_set_objects"])
            for s in data["streams"]] == [(1, "CLOSED", 200, 1, 1, 1), (2, "CLOSED", 200, 1, 0, 1),
                                          (3, "CLOSED", 200, 1, 0, 1)]
    kinds = {(o["type"], o["state"]): o["count"] for o in data["objects"]}
    assert kinds == {("SO", "COMMITTED"): 1, ("SSO", "COMMITTED"): 1}
    assert [(n["node_id"], n["failover"]) for n in data["nodes"]] == [(1, False)]
    assert data["nodes"][0]["heartbeat_age_s"] >= 0 and data["partitions"] == []
    text = run("streams", "--meta", engine_dir / "meta.db")   # a plain path works too
    assert text.exit_code == 0, text.output
    assert "Streams (3)" in text.stdout and "Nodes (1)" in text.stdout and "COMMITTED" in text.stdout
    env = run("streams", "--json", env={"S3STREAM_META": str(engine_dir / "meta.db")})
    assert env.exit_code == 0 and json.loads(env.stdout)["streams"] == data["streams"]


def test_streams_errors(tmp_path, engine_dir):
    fails(run("streams", "--meta", tmp_path / "missing.db"), 1, "no metadata database")
    assert not (tmp_path / "missing.db").exists()          # not created by looking
    # Three slashes where four were meant: the library names the relative path it became, its
    # missing directory and the URL forms.
    fails(run("streams", "--meta", f"sqlite://{tmp_path}/meta.db"), 1,
          f"'{str(tmp_path)[1:]}/meta.db' ({os.getcwd()}{tmp_path}/meta.db, relative to the working directory)",
          "does not exist", "sqlite:////absolute/path/meta.db")
    fails(run("streams", "--meta", "s3:/bkt/meta.db"), 1, "unsupported metadata URL scheme 's3'")
    (tmp_path / "dir.db").mkdir()
    fails(run("streams", "--meta", tmp_path / "dir.db"), 1, "is a directory")
    fails(run("streams", "--meta", "mysql://x/y"), 1, "unsupported metadata URL")
    fails(run("streams", "--meta", "postgresql://127.0.0.1:1/y"), 1, "cannot connect")   # nothing listens there
    err = fails(run("streams", "--meta", "postgresql://u:s3cr3t@127.0.0.1:1/y"), 1, "postgresql://u:***@127.0.0.1:1/y")
    assert "s3cr3t" not in err
    shutil.copy(engine_dir / "node1.wal", tmp_path / "notsqlite.db")
    fails(run("streams", "--meta", tmp_path / "notsqlite.db"), 1, "not a database")
    fails(run("streams"), 2, "Missing option '--meta'")


# ---- migrate ---------------------------------------------------------------------------------------

class TwoNodes:
    """Nodes 1 and 2 in this process, each a StreamClient with a NodeAgent; partition p0 on node 1."""

    def __init__(self, tmp: Path, meta_url: str) -> None:
        self.tmp = tmp
        self.meta_url, self.store_url = meta_url, f"file://{tmp}/objects"
        self.meta = open_metadata(meta_url)
        self.cluster = Cluster(self.meta, LocalObjectStore(str(tmp / "objects")), FAST, small_config())
        self.clients = {n: StreamClient(n, tmp / f"node{n}.wal", self.store_url, self.meta_url, small_config())
                        for n in (1, 2)}
        self.agents = {n: NodeAgent(c, self.cluster) for n, c in self.clients.items()}
        self.cluster.assign("p0", 1)
        deadline = time.monotonic() + 10
        while self.cluster.owner("p0") != 1:
            assert time.monotonic() < deadline, "p0 did not open on node 1"
            time.sleep(0.01)

    def close(self) -> None:
        for agent in self.agents.values():
            agent.stop()
        for client in self.clients.values():
            client.close()
        self.meta.close()


@pytest.fixture
def two_nodes(tmp_path, metadata_url):
    """Over SQLite and PostgreSQL metadata: the migrate command opens either by URL."""
    nodes = TwoNodes(tmp_path, metadata_url)
    yield nodes
    nodes.close()


def test_migrate(two_nodes):
    n = two_nodes
    partition = partition_on(n.clients[1], "p0")
    for i in range(50):
        partition.append(RecordBatch(b"%d" % i * 100, 1)).result(10)
    where = ("--meta", n.meta_url, "--store", n.store_url)
    result = run("migrate", "p0", "2", *where)
    assert result.exit_code == 0, result.output
    assert "node 1 -> node 2" in result.stdout and "failed over   no" in result.stdout
    assert n.cluster.owner("p0") == 2
    data = json.loads(run("migrate", "p0", "1", *where, "--json", "--timeout", "10").stdout)
    assert data["source"] == 2 and data["target"] == 1 and data["moved"] and not data["failed_over"]
    assert data["leader_epoch"] == 3 and data["seconds"] > 0
    again = run("migrate", "p0", "1", *where)
    assert again.exit_code == 0 and "already open on node 1" in again.stdout
    listing = json.loads(run("streams", "--meta", n.meta_url, "--json").stdout)
    [meta_stream] = [int(v) for v in n.meta.list_kv("partition/").values()]
    assert listing["partitions"] == [dict(name="p0", assigned_node=1, version=3, open_on=1, state="open",
                                          meta_stream=meta_stream, reason=None)]
    assert partition_on(n.clients[1], "p0").fetch(0, 50).batches[0].payload == b"0" * 100


@pytest.mark.slow
def test_migrate_does_not_fail_over_a_source_that_is_alive(two_nodes):
    """Node 1's agent stops (its lease keeper goes on heartbeating) with the partition open: the
    migration fences nobody (it did before, stopping a node that works) and says what to do;
    a silent source is failed over (tests/cli/test_cli_cluster.py)."""
    n = two_nodes
    partition_on(n.clients[1], "p0").append(RecordBatch(b"acknowledged", 1)).result(10)
    n.agents[1].stop()        # node 1 keeps the partition open and stops answering
    result = run("migrate", "p0", "2", "--meta", n.meta_url, "--store", n.store_url, "--timeout", "2",
                 "--heartbeat-timeout", "1")
    fails(result, 1, "node 1 still holds it and is alive", "s3stream node fail-over 1 --force")
    assert not n.meta.get_node(1).failover and n.cluster.failover_history() == []
    assert partition_on(n.clients[1], "p0").append(RecordBatch(b"still", 1)).result(10).base_offset == 1
    n.agents.pop(1)


def test_migrate_refuses_what_cannot_work(two_nodes, tmp_path):
    n = two_nodes
    where = ("--meta", n.meta_url, "--store", n.store_url)
    fails(run("migrate", "nope", "2", *where), 1, "known partitions: p0")
    fails(run("migrate", "p0", "9", *where), 1, "node 9 is not registered")
    fails(run("migrate", "p0", "-1", *where), 2, "")
    fails(run("migrate", "p0", "2", "--meta", n.meta_url), 2, "Missing option '--store'")
    fails(run("migrate", "p0", "2", "--meta", n.meta_url, "--store", tmp_path / "none"), 1, "no object store")
    n.meta.fence_node(2)                        # node 2 was failed over: it cannot take the partition
    fails(run("migrate", "p0", "2", *where), 1, "node 2 was failed over")
    assert n.cluster.owner("p0") == 1           # nothing changed
    n.agents.pop(2).stop()                      # its agent stops on its own (fenced); keep close() quiet


# ---- bench -----------------------------------------------------------------------------------------

def test_bench_wal_quick(tmp_path):
    out = tmp_path / "wal-bench"
    result = run("bench", "--kind", "wal", "--quick", "--out", out, "--capacity", "64M", "--duration", "0.2",
                 "--warmup", "0.05", "--raw-bytes", "8M", "--raw-adjacent", "0", "--sync-count", "20",
                 "--sizes", "4K", "--threads", "1", "--no-plots")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["params"]["quick"] and [c["name"] for c in report["cases"]] == ["4 KiB x1"]
    assert report["cases"][0]["mb_s"] > 0


def test_bench_errors_of_the_benchmark(tmp_path):
    result = run("bench", "--kind", "wal", "--out", tmp_path, "--sizes", "nonsense")
    assert result.exit_code == 2 and "error: argument --sizes: not a size" in result.stderr, result.output
    assert not (tmp_path / "report.json").exists()
    fails(run("bench", "--kind", "nosuch"), 2, "Invalid value for '--kind'")
    result = run("bench", "--kind", "wal", "--", "--help")   # the benchmark's own options
    assert result.exit_code == 0 and "--capacity" in result.stdout


BENCH_KINDS = {"engine", "wal", "lease", "metadata", "scale", "spark-throughput", "spark-migration", "spark-balance",
               "spark-mirror", "spark-pipeline", "spark-datasource", "wal-objects", "records", "reader", "wake",
               "visibility", "notify"}


def test_bench_kinds_come_from_entry_points(monkeypatch):
    import importlib.metadata
    registered = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="s3stream.benchmarks")}
    assert set(registered) == BENCH_KINDS, "entry points missing or stale: pip install -e ."
    assert registered["spark-throughput"].startswith("spark_bench:")
    listed = run("bench", "--kind", "nosuch").stderr
    assert all(repr(kind) in listed for kind in BENCH_KINDS), listed
    help_text = run("bench", "--help").stdout
    assert f"--kind [{'|'.join(sorted(BENCH_KINDS))}]" in help_text and "[default:" in help_text

    extra = importlib.metadata.EntryPoint("fake", "json:dumps", "s3stream.benchmarks")
    everything = importlib.metadata.entry_points

    def with_fake(**selection):
        found = everything(**selection)
        return importlib.metadata.EntryPoints([*found, extra]) if selection.get("group") == "s3stream.benchmarks" \
            else found

    monkeypatch.setattr(importlib.metadata, "entry_points", with_fake)
    assert "'fake'" in run("bench", "--kind", "nosuch").stderr
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **selection: importlib.metadata.EntryPoints([]))
    fails(run("bench"), 1, "no benchmarks are registered", "pip install -e")


def test_cli_does_not_import_spark_bench():
    code = "import s3stream.cli, sys; assert 'spark_bench' not in sys.modules, 'imported'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    code = ("import sys; from s3stream.cli import main; main(['bench', '--help'], standalone_mode=False); "
            "assert 'spark_bench' not in sys.modules, 'imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_bench_spark(monkeypatch, tmp_path):
    import spark_bench
    calls = []
    monkeypatch.setattr(spark_bench, "main", lambda argv: calls.append(argv))
    assert run("bench", "--kind", "spark-migration", "--out", tmp_path, "--migrations", "2").exit_code == 0
    assert calls[-1] == ["migration", "--out", str(tmp_path), "--migrations", "2"]
    assert run("bench", "--kind", "spark-throughput", "--quick").exit_code == 0
    assert calls[-1][0] == "throughput" and "--duration" in calls[-1] and "--quick" not in calls[-1]
    assert run("bench", "--kind", "spark-balance", "--quick", "--out", tmp_path).exit_code == 0
    assert calls[-1] == ["balance", "--quick", "--wal-capacity", "128M", "--out", str(tmp_path)]

    def needs_pyspark(argv):
        raise ModuleNotFoundError("No module named 'pyspark'", name="pyspark")

    monkeypatch.setattr(spark_bench, "main", needs_pyspark)
    fails(run("bench", "--kind", "spark-throughput"), 1, "install pyspark")
    monkeypatch.setitem(sys.modules, "spark_bench", types.SimpleNamespace())     # no entry function
    fails(run("bench", "--kind", "spark-migration"), 1, "the spark-migration benchmark is not available",
          "spark_bench:bench_migration")
    monkeypatch.setitem(sys.modules, "spark_bench", None)      # import fails
    fails(run("bench", "--kind", "spark-migration"), 1, "the spark-migration benchmark is not available",
          'pip install -e ".[bench]"')
