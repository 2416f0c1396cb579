"""The mirror's Spark load test end to end in local mode, shortened: source nodes and mirror
workers as Spark tasks, one worker SIGKILLed and replaced, a consumer failing over to the target."""
import json
import shutil

import pytest

pytestmark = pytest.mark.slow    # the whole module: soaks, campaigns, fault runs or Spark (README: quick tier)

pytest.importorskip("pyspark")
if not shutil.which("java"):
    pytest.skip("PySpark needs Java", allow_module_level=True)


def test_spark_mirror_loses_nothing_across_a_kill_and_a_consumer_failover(tmp_path):
    from spark_bench import main
    report = main(["mirror", "--quick", "--duration", "18", "--lead", "5", "--rate", "2", "--out", str(tmp_path),
                   "--store", f"file://{tmp_path}/objects", "--wal-capacity", "64M"])
    assert report["records"] > 0 and report["records"] == report["source_batches"] == report["acked"]
    assert report["lost"] == 0 and report["duplicates"] == 0 and report["translation_errors"] == 0
    assert report["in_order"] and report["caught_up"]
    assert report["killed"] and report["kill"]["recovered_s"] is not None
    assert report["consumer"]["read_on_source"] > 0 and report["consumer"]["read_on_target"] > 0
    assert report["consumer"]["skipped"] == 0 and report["consumer"]["read_twice"] == 0
    assert report["lag_samples"] > 0 and report["lag_p50_s"] <= report["lag_p99_s"]
    saved = json.loads((tmp_path / "report.json").read_text())
    assert {"records", "lost", "duplicates", "translation_errors", "lag_p50_s", "lag_p99_s", "mb_s"} <= saved.keys()
    assert (tmp_path / "lag.png").stat().st_size > 0
