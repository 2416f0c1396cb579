"""The benchmarks run end to end (tiny sizes) and write their reports: they must not rot."""
import json
import os

import pytest


def test_wal_bench_quick(tmp_path):
    from wal import bench
    report = bench.run(["--quick", "--out", str(tmp_path), "--capacity", "256M", "--duration", "0.3",
                        "--warmup", "0.1", "--raw-bytes", "16M", "--raw-adjacent", "8M", "--sync-count", "50"])
    assert (tmp_path / "report.json").exists()
    assert {c["name"] for c in report["cases"]} >= {"4 KiB x1", "64 KiB x4"}
    assert all(c["mb_s"] > 0 for c in report["cases"])


def test_engine_bench_quick(tmp_path):
    from s3stream import bench
    report = bench.run(["--quick", "--out", str(tmp_path), "--ingest", "24M", "--dataset", "16M", "--rounds", "2",
                        "--store-dir", str(tmp_path / "store")])
    data = json.loads((tmp_path / "report.json").read_text())
    assert [r["streams"] for r in data["runs"]] == [1000, 10]
    assert all(r["mb_s"] > 0 and r["wal_only"]["mb_s"] > 0 for r in report["runs"])
    assert data["runs"][1]["catchup"]["bytes"] == data["runs"][1]["bytes"]   # everything read back
    pytest.importorskip("matplotlib")
    assert os.path.exists(tmp_path / "engine.png")
