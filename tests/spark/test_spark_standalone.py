"""The Spark load tests on a real Spark standalone cluster (a master and two one-core workers on
127.0.0.1, started once for the module): each node runs in its own executor process, keeps its
WAL in a directory of its own, and the driver verifies what the nodes acknowledged through a
client of its own. The metadata and store URLs are fixtures, to run the same bodies over
PostgreSQL and S3."""
import os
import shutil

import pytest

pytest.importorskip("pyspark")
if not shutil.which("java"):
    pytest.skip("PySpark needs Java", allow_module_level=True)

from spark_bench import migration, throughput  # noqa: E402
from spark_bench.common import shared_fs_only  # noqa: E402

pytestmark = pytest.mark.slow    # the whole module: soaks, campaigns, fault runs or Spark (README: quick tier)

#: Tiny jobs: a few seconds each on two cores (sizes as in tests/spark/test_spark_bench.py).
JOB_ARGS = {
    "throughput": ["--nodes", "2", "--partitions", "1", "--duration", "3", "--verify"],
    # The measuring windows as short as test_spark_bench's smoke run: this test is about cluster mode.
    "migration": ["--histories", "4M,16M", "--migrations", "3", "--tail", "4M", "--pause", "0.1",
                  "--quiet-seconds", "1", "--windows", "2", "--warmup-seconds", "1"],
}


@pytest.fixture(scope="module")
def spark_master(tmp_path_factory, moto_endpoint):
    """Started after the moto server set the AWS variables, which the workers and so their
    executors inherit."""
    from spark_bench.standalone import standalone_cluster
    with standalone_cluster(2, workdir=str(tmp_path_factory.mktemp("standalone"))) as url:
        yield url


@pytest.fixture
def meta_url(pg_url):
    """The cluster's metadata: a fresh PostgreSQL database (the nodes share nothing else but S3)."""
    return pg_url


@pytest.fixture
def store_url(moto_endpoint):
    """The cluster's object store: a fresh bucket on the moto server, over real HTTP."""
    return f"s3://b-{os.urandom(4).hex()}/bench?endpoint_url={moto_endpoint}&create_bucket=1&max_attempts=3"


def run_cluster_job(kind: str, master: str, meta_url: str, store_url: str, tmp_path) -> dict:
    """Run load test `kind` on the cluster at `master`; its report. The driver's files go under
    tmp_path/driver; --allow-shared-fs only for URLs that need it (SQLite, file://)."""
    argv = [*JOB_ARGS[kind], "--master", master, "--meta", meta_url, "--store", store_url,
            "--wal-capacity", "64M", "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "driver")]
    if shared_fs_only(meta_url, store_url):
        argv.append("--allow-shared-fs")
    return (throughput if kind == "throughput" else migration).run(argv)


def assert_nodes_apart(where: dict, tmp_path) -> None:
    """Each node ran in an executor process of its own, with its WAL outside the driver's files
    (and removed after its clean close)."""
    assert sorted(where) == [1, 2]
    executors = [w["executor_pid"] for w in where.values()]
    assert None not in executors and len(set(executors)) == 2, where
    assert os.getpid() not in [w["pid"] for w in where.values()]
    for w in where.values():
        wal_dir = os.path.dirname(w["wal_path"])
        assert not w["wal_path"].startswith(str(tmp_path)), w
        assert os.path.basename(wal_dir).startswith("s3stream-node"), w
        assert not os.path.exists(wal_dir), f"node WAL directory {wal_dir} left behind after a clean close"


def test_cluster_mode_refuses_sqlite_metadata_without_allow_shared_fs(tmp_path):
    argv = ["--master", "spark://127.0.0.1:7077", "--meta", f"sqlite:///{tmp_path}/meta.db",
            "--store", "s3://bucket/prefix", "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="SQLite.*--allow-shared-fs"):
        throughput.run(argv)
    with pytest.raises(SystemExit, match="local directory.*--allow-shared-fs"):
        migration.run([*argv[:3], "postgresql://u@db/bench", "--store", f"file://{tmp_path}/objects",
                       "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()            # refused before anything was made
    assert shared_fs_only("postgresql://u@db/bench", "s3://bucket/prefix") == []


def test_master_and_standalone_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        throughput.parse(["--master", "spark://127.0.0.1:7077", "--standalone", "2"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_throughput_on_standalone_cluster_loses_nothing(spark_master, meta_url, store_url, tmp_path):
    report = run_cluster_job("throughput", spark_master, meta_url, store_url, tmp_path)
    assert report["master"] == spark_master and report["cluster_mode"] and report["verified"]
    (row,) = report["runs"]
    assert row["nodes"] == 2 and row["mb_s"] > 0 and not row["errors"]
    assert row["verification"]["acknowledged"] > 0
    assert row["verification"]["lost"] == 0 and report["lost"] == 0
    assert_nodes_apart(row["placement"], tmp_path)


def test_migration_on_standalone_cluster_loses_nothing(spark_master, meta_url, store_url, tmp_path):
    report = run_cluster_job("migration", spark_master, meta_url, store_url, tmp_path)
    assert report["master"] == spark_master and report["cluster_mode"]
    assert all(r["migrations"] == 3 and r["failed_over"] == 0 for r in report["histories"])
    assert not report["failures"]
    assert report["verification"]["acknowledged"] > 0
    assert report["verification"]["lost"] == 0
    assert_nodes_apart(report["placement"], tmp_path)
