"""The Spark load tests run end to end in local mode (tiny sizes): Spark tasks act as nodes."""
import json
import shutil

import pytest

pytest.importorskip("pyspark")
if not shutil.which("java"):
    pytest.skip("PySpark needs Java", allow_module_level=True)


def test_spark_throughput_smoke(tmp_path):
    from spark_bench import main
    report = main(["throughput", "--nodes", "1,2", "--partitions", "1", "--duration", "1.5",
                   "--out", str(tmp_path), "--store", f"file://{tmp_path}/objects", "--wal-capacity", "64M"])
    assert [r["nodes"] for r in report["runs"]] == [1, 2]
    assert all(r["mb_s"] > 0 and not r["errors"] for r in report["runs"])
    assert len(report["runs"][1]["per_node_mb_s"]) == 2
    assert json.loads((tmp_path / "report.json").read_text())["kind"] == "throughput"


def test_spark_throughput_retention_keeps_the_store_small_and_loses_nothing(tmp_path):
    """With retention each node trims its partitions as it goes and deletes what it trimmed:
    the store ends far smaller than what was acknowledged, and every acknowledged record above
    the start offsets reads back (those below count as trimmed, not lost)."""
    from spark_bench import main
    report = main(["throughput", "--nodes", "1", "--partitions", "2", "--duration", "3", "--batch", "16K",
                   "--upload-threshold", "1M", "--retention", "1M", "--verify", "--out", str(tmp_path),
                   "--store", f"file://{tmp_path}/objects", "--wal-capacity", "64M"])
    assert report["retention_per_partition"] == 1 << 20
    run = report["runs"][0]
    assert not run["errors"] and run["trims"] > 0
    v = run["verification"]
    assert v["lost"] == 0 and v["mismatched"] == 0
    assert 0 < v["trimmed"] < v["acknowledged"]
    assert run["store_bytes_at_end"] - run["store_bytes_before"] < 0.7 * run["bytes"], run


def test_spark_migration_smoke_loses_nothing(tmp_path):
    from spark_bench import main
    report = main(["migration", "--histories", "4M,16M", "--migrations", "3", "--tail", "4M", "--pause", "0.1",
                   "--out", str(tmp_path), "--store", f"file://{tmp_path}/objects", "--wal-capacity", "64M"])
    assert all(r["migrations"] == 3 and r["failed_over"] == 0 for r in report["histories"])
    assert report["verification"]["acknowledged"] > 0
    assert report["verification"]["lost"] == 0
    assert not report["failures"]


def test_spark_balance_smoke_converges_and_loses_nothing(tmp_path):
    """Four Spark tasks as nodes, the hottest 8 of 32 Zipf partitions on node 1: the nodes'
    balancers (one leads) spread the load, then rebalance after the cold partition turns hot."""
    from spark_bench import main
    report = main(["balance", "--duration", "36", "--warmup", "6", "--lead", "10", "--out", str(tmp_path),
                   "--store", f"file://{tmp_path}/objects", "--wal-capacity", "64M"])
    assert report["imbalance_before"] > 2.0
    assert report["imbalance_before_change"] < 1.3 and report["imbalance_after"] < 1.3
    assert report["moves"] > 0 and len(report["leaders"]) >= 1
    assert report["acked"] > 1000 and report["lost"] == 0
    assert all(m["outcome"] == "moved" for m in report["move_log"])
    saved = json.loads((tmp_path / "report.json").read_text())
    assert {"imbalance_before", "imbalance_after", "seconds_to_balance", "moves", "acked", "lost"} <= saved.keys()
    assert (tmp_path / "traffic.png").stat().st_size > 0
