"""The compaction benchmark runs end to end at tiny sizes and writes its report: it must not rot."""
import json
import os

import pytest


@pytest.mark.slow
def test_compaction_bench_quick(tmp_path):
    from benchmarks import compaction as bench
    report = bench.run(["--quick", "--streams", "40", "--duration", "2", "--out", str(tmp_path),
                        "--store-dir", str(tmp_path / "store")])
    data = json.loads((tmp_path / "report.json").read_text())
    without, with_, again = data["runs"]
    assert not without["compaction"] and with_["compaction"] and not again["compaction"]
    assert with_["compaction_totals"]["commits"] >= 1 and with_["write_amplification"] > 1
    assert with_["peak_memory"] <= with_["memory_budget"]
    assert set(data["read_cost"]["stages"]) == {"uploaded", "sso_compacted", "split_and_merged"}
    assert report["p99_ratio"] > 0
    pytest.importorskip("matplotlib")
    assert os.path.exists(tmp_path / "compaction.png")
