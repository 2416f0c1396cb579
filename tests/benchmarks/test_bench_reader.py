"""Smoke test of `s3stream bench --kind reader` (benchmarks/reader.py): a tiny run over both
metadata stores; the report has every part and nothing written was lost. No timing asserts."""
from __future__ import annotations

import pytest

import json

from benchmarks.reader import TARGET_CATCHUP_RATIO, TARGET_VISIBILITY_MS, run


@pytest.mark.slow
def test_reader_bench_quick(tmp_path, pg_url):
    out = tmp_path / "report"
    report = run(["--quick", "--data", "4M", "--rounds", "2", "--commits", "5", "--pg-url", pg_url,
                  "--workdir", str(tmp_path), "--out", str(out)])
    assert json.loads((out / "report.json").read_text())["kind"] == "reader"
    assert report["targets"] == dict(reader_over_node=TARGET_CATCHUP_RATIO, visibility_p99_ms=TARGET_VISIBILITY_MS)
    assert [c["metadata"] for c in report["catchup"]] == ["sqlite", "postgresql"]
    for c in report["catchup"]:
        assert len(c["rounds"]) == 2 and c["records"] == c["batches"] * c["batch_records"] > 0
        for r in c["rounds"]:
            assert r["node"]["bytes"] == r["reader"]["bytes"] == c["bytes"]       # checked in order, too
            assert r["node"]["records"] == r["reader"]["records"] == c["records"]
        assert c["ratio"] > 0 and isinstance(c["met"], bool)
    assert [v["metadata"] for v in report["visibility"]] == ["sqlite", "postgresql"]
    for v in report["visibility"]:
        assert v["commits"] == v["seen"] == 5 and v["lost"] == 0 and v["in_order"]
        assert v["pushes"], f"{v['metadata']}: the tail polled instead of being pushed"
        assert v["from_commit_return"]["samples"] == 5 and len(v["samples_ms"]) == 5
    assert report["plots"] and all(p.endswith(".png") for p in report["plots"])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("s3stream-readerbench-")] == []
