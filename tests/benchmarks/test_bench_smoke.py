"""The benchmarks run end to end (tiny sizes) and write their reports: they must not rot."""
import json
import os

import pytest

pytestmark = pytest.mark.slow    # the whole module: soaks, campaigns, fault runs or Spark (README: quick tier)


def test_wal_bench_quick(tmp_path):
    from benchmarks import wal_disk as bench
    report = bench.run(["--quick", "--out", str(tmp_path), "--capacity", "256M", "--duration", "0.3",
                        "--warmup", "0.1", "--raw-bytes", "16M", "--raw-adjacent", "8M", "--sync-count", "50"])
    assert (tmp_path / "report.json").exists()
    assert {c["name"] for c in report["cases"]} >= {"4 KiB x1", "64 KiB x4"}
    assert all(c["mb_s"] > 0 for c in report["cases"])


def test_engine_bench_quick(tmp_path):
    from benchmarks import engine as bench
    report = bench.run(["--quick", "--out", str(tmp_path), "--ingest", "24M", "--dataset", "16M", "--rounds", "2",
                        "--round-seconds", "0.1", "--open-loop-seconds", "0.2", "--store-dir", str(tmp_path / "store"),
                        "--hot", "24M"])
    data = json.loads((tmp_path / "report.json").read_text())
    assert [r["streams"] for r in data["runs"]] == [1000, 10]
    # the hot partition (issue 51): one stream, local and S3-like PUTs, against the WAL alone,
    # uploaded in cuts of the split size (4 MiB in --quick)
    assert [h["streams"] for h in data["hot"]] == [1, 1] and len({h["profile"] for h in data["hot"]}) == 2
    for h in data["hot"]:
        assert h["mb_s"] > 0 and h["wal_only"]["mb_s"] > 0 and h["ratio_to_wal"] == pytest.approx(
            h["mb_s"] / h["wal_only"]["mb_s"])
        assert h["upload"]["triggers"]["cut"]["objects"] >= 1 and h["met"] == (h["ratio_to_wal"] >= 0.8)
    assert all(r["mb_s"] > 0 and r["wal_only"]["mb_s"] > 0 for r in report["runs"])
    assert [t["size"] for t in data["reads"]["tail"]] == [128, 1024, 65536]
    assert all(t["records_s"] > 0 and t["from_cache"] == 1.0 for t in data["reads"]["tail"])
    reads = data["reads"]["catchup"]
    assert set(reads) == {"local", "s3"}
    for store in ("local", "s3"):
        assert set(reads[store]) == {"stream set objects", "stream objects"}
        for c in reads[store].values():
            assert c["bytes"] == 16 * 1024 * 1024                       # every byte read back
            assert c["ratio"] == pytest.approx((c["mb_s"]) / c["raw_mb_s"])
            assert c["reader"]["object_bytes"] > 0
    assert data["runs"][0]["tail_read"]["records_s"] > 0
    assert data["targets"]["ingest_ratio"] == 0.8

    small = data["small_records"]
    assert [s["size"] for s in small["sizes"]] == [128, 1024, 16384, 65536]
    for s in small["sizes"]:
        assert len(s["per_round"]) == 2
        first = s["unsettled_round"]        # run before the counted rounds, counted in no total
        assert first["ratio"] == pytest.approx(first["engine_records_s"] / first["wal_records_s"])
        # each round is sized to ~0.2 s and cut only after 1.6 s: the totals are the counted rounds'
        assert s["wal"]["records"] == s["rounds"] * s["records_per_round"]["wal"]
        for side in ("wal", "engine", "engine_no_store"):
            assert s[side]["records"] > 0 and s[side]["records_s"] > 0 and s[side]["cpu_s_per_gib"] > 0
        assert s["ratio"] == pytest.approx(s["engine"]["records_s"] / s["wal"]["records_s"])
        assert s["cpu_ratio"] == pytest.approx(s["engine"]["cpu_s_per_gib"] / s["wal"]["cpu_s_per_gib"])
        assert s["ratio_no_store"] == pytest.approx(s["engine_no_store"]["records_s"] / s["wal"]["records_s"])

    loop = {r["size"]: r for r in data["open_loop"]}
    assert set(loop) == {1024, 65536}
    for size, r in loop.items():
        engine_max = next(s["engine"]["records_s"] for s in small["sizes"] if s["size"] == size)
        assert r["max_records_s"] == engine_max
        assert r["target_records_s"] == pytest.approx(0.5 * engine_max)
        # every record timed, from its scheduled send time: never before it
        assert r["latency"]["samples"] == r["send_lag"]["samples"] == r["records"] > 0
        assert 0 <= r["send_lag"]["p50_ms"] <= r["latency"]["p50_ms"] <= r["latency"]["p99_ms"]
        assert r["wal_reference"]["target_records_s"] == r["target_records_s"]
        assert r["wal_reference"]["latency"]["samples"] > 0

    text = bench.format_report(report)
    assert "Small records" in text and "open loop" in text and "WAL alone at 128 B" in text
    assert "objects encoded but not written" in text
    pytest.importorskip("matplotlib")
    assert all(os.path.exists(tmp_path / name) for name in ("engine.png", "small-records.png", "reads.png"))


def test_discarding_store_drops_puts_only_while_switched(tmp_path):
    from benchmarks.engine import DiscardingStore
    from s3stream.objectstore import LocalObjectStore
    store = DiscardingStore(LocalObjectStore(str(tmp_path)))
    store.put("a", b"kept")
    store.discard = True
    store.put("b", b"dropped")
    store.discard = False
    assert store.get("a") == b"kept"
    assert [o.key for o in store.list()] == ["a"]
    store.delete(["a", "b"])                    # a key never written is no error
    assert list(store.list()) == []


def test_engine_bench_reports_memory_handed_back_to_the_host(tmp_path, monkeypatch):
    """The small-record rounds read free page reporting's counter around each round (a fake
    /sys directory here); the report says how much each side handed back."""
    from benchmarks import engine as bench
    fake = tmp_path / "page_reporting"
    fake.mkdir()
    (fake / "page_reporting_order").write_text("9\n")
    counter = fake / "reported_kib"
    counter.write_text("1000\n")
    monkeypatch.setattr(bench, "PAGE_REPORTING", str(fake))
    assert bench.host_reclaimed_kib() == 1000 and bench.page_reporting_order() == 9
    monkeypatch.setattr(bench, "PAGE_REPORTING", str(tmp_path / "absent"))
    assert bench.host_reclaimed_kib() is None and bench.page_reporting_order() is None
    report = {"small_records": {"threads": 4, "inflight": 256, "round_seconds": 1, "page_reporting_order": 9,
                                "sizes": [{"size": 1024, "rounds": 1, "per_round": [{"ratio": 0.5}], "ratio": 0.5,
                                           "cpu_ratio": 2.0,
                                           **{side: {"records_s": 1.0, "cpu_s_per_gib": 1.0,
                                                     "host_reclaimed_gib": gib}
                                              for side, gib in (("wal", 0.0), ("engine", 3.5))}}]}}
    text = "\n".join(bench._format_small_records(report))
    assert "0.0 GiB in the WAL-alone rounds, 3.5 GiB in the engine rounds" in text


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_metadata_bench_quick(tmp_path, kind, request):
    from benchmarks import metadata as bench_metadata
    url = f"sqlite:///{tmp_path}/m.db" if kind == "sqlite" else request.getfixturevalue("pg_url")
    report = bench_metadata.run(["--meta", url, "--streams", "5,120", "--seconds", "0.05",
                                 "--out", str(tmp_path / "out")])
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    (store,) = data["stores"]
    assert list(store["sizes"]) == ["5", "120"]
    for ops in store["sizes"].values():
        assert {"node start (register_node)", "commit (prepare + SSO of 4 streams)", "move (open + close)",
                "a node's open streams", "objects_to_delete (bounded)"} <= set(ops)
        assert all(op["ops"] > 0 and op["ops_s"] > 0 and op["p50_ms"] <= op["p99_ms"] for op in ops.values())
    from s3stream.metadata import open_metadata
    meta = open_metadata(url)
    try:
        assert len(meta.list_streams()) >= 120 + bench_metadata.HOT
    finally:
        meta.close()
    assert "operations per second" in bench_metadata.format_report(report)


def test_wal_objects_bench_quick(tmp_path):
    """`s3stream bench --kind wal-objects --quick`: the file and the S3 Express-like store, every
    measurement and target in report.json, the plot written."""
    from benchmarks.wal_objects import run as run_wal_objects
    report = run_wal_objects(["--quick", "--out", str(tmp_path / "out"), "--workdir", str(tmp_path)])
    results = report["results"]
    assert set(results) == {"file", "express"}
    for name, r in results.items():
        for key in ("max", "half", "1MB/s", "10MB/s"):
            assert r[key]["records"] > 0 and r[key]["mb_s"] > 0, (name, key, r[key])
    assert results["express"]["put_latency"]["p50"] >= 0.004          # the injected 5 ms median
    assert results["express"]["stats"]["puts"] > 0
    whats = [t["what"] for t in report["targets"]]
    assert any("maximum / file maximum" in w for w in whats) and any("p99 at half load" in w for w in whats)
    assert (tmp_path / "out" / "report.json").exists() and (tmp_path / "out" / "latency.png").exists()


def test_visibility_bench_quick(tmp_path):
    """`s3stream bench --kind visibility`: a reader in another process sees every record of a
    paced stream before the writer closes it, with the node's PUTs per second and the uploads
    by trigger in report.json (issue 51)."""
    from benchmarks.visibility import run as run_visibility
    report = run_visibility(["--rates", "50", "--seconds", "1.5", "--out", str(tmp_path / "out"),
                             "--workdir", str(tmp_path)])
    [row] = report["rows"]
    assert row["rate"] == "50" and row["records"] >= 60 and row["not_seen"] == 0
    assert row["latency"]["samples"] == row["records"] and row["latency"]["p99_ms"] > 0
    assert row["puts_per_s"] > 0 and set(row["triggers"]) <= {"deadline", "cut", "size"}
    assert {t["what"].split(":")[0] for t in report["targets"]} == {"50 rec/s"}
    assert (tmp_path / "out" / "report.json").exists()


def test_wake_bench_quick(tmp_path):
    """The wake-up probe runs every case, the producers append in theirs and nobody else's, and
    each case's percentiles come from its own samples (issue 28's tail, benchmarks.wake)."""
    from benchmarks import wake as bench_wake
    report = bench_wake.run(["--quick", "--out", str(tmp_path), "--busy", "1", "--workdir", str(tmp_path)])
    assert set(report["cases"]) == set(bench_wake.CASES)
    for case, s in report["cases"].items():
        assert s["samples"] > 50, (case, s)
        assert 0 <= s["p50_ms"] <= s["p99_ms"] <= s["p999_ms"] <= s["max_ms"], (case, s)
    appended = {r["case"]: r["appended"] for r in report["rounds"]}
    assert all((n > 0) == ("appends" in case) for case, n in appended.items()), appended
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["cases"] == report["cases"] and (tmp_path / "wake.png").stat().st_size > 0
    assert saved["plots"] == [str(tmp_path / "wake.png")]


def test_scale_bench_quick(tmp_path):
    """`s3stream bench --kind scale --quick` (issue 53): node processes open, reopen after a
    kill -9, fail over and drain every partition, a third node appends to busy partitions alone
    and among them all, and the report has each phase's figures."""
    from benchmarks.scale import run as run_scale
    report = run_scale(["--quick", "--partitions", "6", "--drain", "3", "--idle", "0.5", "--busy", "2",
                        "--load", "0.5", "--out", str(tmp_path / "out"), "--workdir", str(tmp_path)])
    [row] = report["rows"]
    assert row["partitions"] == 6 and row["metadata"] == "sqlite" and row["drain"] == 3
    assert 0 < row["first_open_s"] and 0 < row["open_after_restart_s"]
    # Decided no sooner than the timeout after A's last heartbeat (itself at most an interval,
    # under load a little more, before the kill: B judges from before it).
    assert row["heartbeat_timeout_s"] / 2 <= row["failover_detect_s"] <= row["failover_s"]["p50"] \
        <= row["failover_s"]["all"]
    assert row["rss_mib"] > 0 and row["idle_cpu_percent"] >= 0
    assert row["restart_ops_per_partition"].get("open_streams", 0) > 0        # counted from the new process
    assert row["busy"] == 2 and row["busy_alone"]["bytes"] > 0 and row["busy_among_idle"]["bytes"] > 0
    assert row["busy_ratio"] == round(row["busy_among_idle"]["mb_s"] / row["busy_alone"]["mb_s"], 3)
    assert (tmp_path / "out" / "report.json").exists() and (tmp_path / "out" / "scale.png").exists()


def test_notify_bench_quick(tmp_path, pg_url):
    """`s3stream bench --kind notify` (issue 53): a burst of reassignments and opened/ records,
    with nobody listening, with listening agents' feeds, and with their passes: every case
    measured, the listeners woken (and reading) only where they listen."""
    from benchmarks.notify import CASES, run as run_notify
    report = run_notify(["--partitions", "50", "--listeners", "2", "--rounds", "1", "--meta", pg_url,
                         "--out", str(tmp_path / "out")])
    assert [r["case"] for r in report["rows"]] == list(CASES)
    by_case = {case: [r for r in report["rows"] if r["case"] == case] for case in CASES}
    assert all(r["wakes_each"] == 0 and r["last_wake_after_s"] is None for r in by_case["quiet"])
    assert all(r["wakes_each"] >= 1 and r["passes_each"] == 0 for r in by_case["listening"])
    assert all(r["passes_each"] >= 1 for r in by_case["listening+passes"])
    assert report["assignments"] == 150 and set(report["medians"]) == set(CASES)
    assert (tmp_path / "out" / "report.json").exists() and (tmp_path / "out" / "notify.png").exists()
