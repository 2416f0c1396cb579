"""`s3stream mirror`: `status` on the records a running worker keeps (text and --json), `run` in the
foreground until Ctrl-C (a real process: flows start, copy, stop and release on SIGINT), and user
errors (bad URLs, arguments, an unknown flow: non-zero exit, one line naming what was wrong)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cli_helpers import fails, ok, run
from s3stream.metadata import open_metadata
from test_mirror_worker import FLOW, Env, holders, running, wait_for
from s3stream.cluster import read_partition

REPO = Path(__file__).resolve().parents[2]





@pytest.fixture
def env(tmp_path):
    e = Env(tmp_path)
    yield e
    e.close()


def test_status_of_a_running_worker(env):
    for name in ("p0", "p1"):
        env.produce(name, 20)
    w = env.worker(1)
    wait_for(lambda: running(w) == 2 and w.heartbeats >= 1, what="2 flows and a heartbeat", status=w.status)
    env.wait_mirrored()

    def report():
        return json.loads(ok(run("mirror", "status", "--target-meta", env.target_url, "--json")))

    wait_for(lambda: report()["flows"][0]["heartbeats"].get("A", {}).get("lag_records") == 0,
             what="a heartbeat after the catch-up")
    report = report()
    (flow,) = report["flows"]
    assert flow["flow_id"] == FLOW and flow["source_alias"] == "A" and flow["live_workers"] == [1]
    assert flow["leader"]["holder"] == 1 and flow["leader"]["valid"]
    by_target = {p["target_partition"]: p for p in flow["partitions"]}
    assert sorted(by_target) == ["A.p0", "A.p1"]
    for name in ("p0", "p1"):
        p = by_target[f"A.{name}"]
        end = read_partition(env.producer, name).end_offset
        assert p["source_partition"] == name and p["segments"] == 1
        assert p["mirrored_end"] == end and p["mirrored_upstream_end"] == end
        assert p["lease_holder"] == 1 and p["running_on"] == 1
    hb = flow["heartbeats"]["A"]
    assert hb["flows"] == 2 and hb["lag_records"] == 0 and hb["age_s"] < 5 and hb["replication_latency_s"] < 5
    text = ok(run("mirror", "status", "--target-meta", env.target_url))
    assert f"Flow {FLOW} from source A: 2 partitions, 1 live workers [1], leader worker 1" in text
    assert "A.p0" in text and "worker 1: live" in text and "Heartbeat from A" in text
    assert "replication latency" in text
    ok(run("mirror", "status", "--target-meta", env.target_url, "--flow", FLOW))
    fails(run("mirror", "status", "--target-meta", env.target_url, "--flow", "nope"), 1, "no record of flow 'nope'",
          FLOW)
    # After a clean stop: leases free, no live worker, the mirrored ends stay.
    w.stop(10)
    flow = json.loads(ok(run("mirror", "status", "--target-meta", env.target_url, "--json")))["flows"][0]
    assert flow["live_workers"] == [] and all(p["lease_holder"] is None for p in flow["partitions"])
    assert "0 live workers" in ok(run("mirror", "status", "--target-meta", env.target_url))


def test_run_in_the_foreground_until_ctrl_c(env):
    from test_metrics import exit_code_after_ctrl_c, free_port, scrape_url
    for name in ("p0", "p1", "p2"):
        env.produce(name, 15)
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "s3stream", "mirror", "run", "--source-meta", env.source_url, "--source-store",
         env.source_store, "--target-meta", env.target_url, "--target-store", env.target_store, "--alias", "A",
         "--worker-id", "7", "--wal-dir", str(env.tmp / "cli-worker"), "--flow", FLOW, "--interval", "0.1",
         "--wal-capacity", "16M", "--upload-interval", "0.05", "--metrics-port", str(port),
         "--metrics-addr", "127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1"))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: sum(" started A.p" in line for line in lines) == 3 or proc.poll() is not None, timeout=30,
                 what="3 flows started", status=lambda: lines)
        assert proc.poll() is None, (lines, proc.stderr.read())
        env.produce("p1", 10)
        env.wait_mirrored()
        assert holders(env, ["p0", "p1", "p2"]) == {"p0": 7, "p1": 7, "p2": 7}
        # The target node's engine, on --metrics-port: every mirrored record was appended there.
        metrics = scrape_url(port)
        assert metrics[("s3stream_appends_total", (("node", "7"),))] >= 3 * 15 + 10
        assert ("s3stream_metadata_latency_seconds_count", (("node", "7"), ("operation", "commit"))) in metrics
        assert exit_code_after_ctrl_c(proc) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)
    out = "".join(lines)
    assert "mirror worker 7 running flow A-to-B" in out
    assert out.count(" stopped A.p") == 3 and "stopped: worker 7 left flow A-to-B" in out, out
    assert "stopping" in proc.stderr.read()
    assert holders(env, ["p0", "p1", "p2"]) == {"p0": None, "p1": None, "p2": None}
    env.wait_mirrored()


def test_user_errors(tmp_path):
    for db in ("s.db", "t.db"):
        open_metadata(f"sqlite:///{tmp_path}/{db}").close()
    for d in ("s-objects", "t-objects"):
        (tmp_path / d).mkdir()
    base = ["mirror", "run", "--source-meta", f"sqlite:///{tmp_path}/s.db", "--source-store", tmp_path / "s-objects",
            "--target-meta", f"sqlite:///{tmp_path}/t.db", "--target-store", tmp_path / "t-objects",
            "--wal-dir", tmp_path / "w", "--wal-capacity", "16M"]
    fails(run("mirror", "status", "--target-meta", tmp_path / "missing.db"), 1, "no metadata database")
    fails(run("mirror", "status", "--target-meta", "mysql://x/y"), 1)
    fails(run("mirror", "status"), 2, "--target-meta")
    assert "No mirror flows" in ok(run("mirror", "status", "--target-meta", f"sqlite:///{tmp_path}/t.db"))
    missing_store = list(base)
    missing_store[missing_store.index("--source-store") + 1] = tmp_path / "nowhere"
    fails(run(*missing_store, "--alias", "A", "--worker-id", "1"), 1, "no object store directory")
    fails(run(*base, "--alias", "A/B", "--worker-id", "1"), 1, "source alias")
    fails(run(*base, "--alias", "A", "--worker-id", "-1"), 2, "--worker-id")
    fails(run(*base, "--alias", "A", "--worker-id", "1", "--interval", "0"), 2, "--interval")
    fails(run(*base, "--alias", "A", "--worker-id", "1", "--wal-capacity", "12Q"), 2, "not a size")
    small = list(base)
    small[small.index("--wal-capacity") + 1] = "100K"
    fails(run(*small, "--alias", "A", "--worker-id", "1"), 1, "WAL capacity")
    fails(run(*base, "--worker-id", "1"), 2, "--alias")
