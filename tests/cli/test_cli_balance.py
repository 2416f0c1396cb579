"""`s3stream balance`: plan on a recorded state and on live SQLite metadata (which it never writes),
record then plan offline, status after a lease is taken, one forced round on a live cluster, and
the user errors (a bad metrics file or threshold: non-zero exit, one line naming it)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from s3stream.balancer.loop import LEASE_KEY
from s3stream.cluster.lease import Lease
from s3stream.balancer.loop import LAST_ROUND_KEY
from cli_helpers import fails, ok, run
from s3stream.cluster import Cluster
from s3stream.cluster.loadreport import REPORT_PREFIX
from s3stream.metadata import open_metadata
from s3stream.objectstore import LocalObjectStore

KiB = 1024
MiB = 1024 * KiB
#: Six partitions of unequal traffic (bytes in/s); bytes out is twice bytes in.
RATES = {"a": 3 * MiB, "b": 2 * MiB, "c": 1.5 * MiB, "d": 1 * MiB, "e": 768 * KiB, "f": 768 * KiB}





def report(node: int, partitions: dict[str, float], at: float) -> dict:
    return {"node": node, "at": at, "window_s": 10.0,
            "partitions": {name: {"bytes_in": rate, "bytes_out": 2 * rate} for name, rate in partitions.items()},
            "append_p99_ms": 1.5, "fetch_p99_ms": 2.5}


def write_state(path: Path, assignment: dict[str, int], now: float = 1_000_000.0, live=(1, 2, 3)) -> Path:
    """A state as `balance record` writes it: every live node reported 5 s before `now`."""
    reports = [report(n, {p: RATES[p] for p, node in assignment.items() if node == n}, now - 5) for n in live]
    path.write_text(json.dumps({"now": now, "assignment": assignment, "live": list(live), "reports": reports}))
    return path


@pytest.fixture
def skewed(tmp_path) -> Path:
    """Three nodes, every partition on node 1."""
    return write_state(tmp_path / "skewed.json", {name: 1 for name in RATES})


# ---- plan on a recorded state ---------------------------------------------------------------------

def test_plan_moves_partitions_off_the_loaded_node(skewed):
    out = ok(run("balance", "plan", "--metrics", skewed))
    assert "Nodes before: imbalance 3.00" in out
    assert "Nodes after" in out and "Actions (" in out
    moves = [line.strip() for line in out.splitlines() if line.strip().startswith("move ")]
    assert moves and all(" node 1 -> node " in m for m in moves)
    assert all("bytes_in_distribution=" in m and "score " in m for m in moves)
    # the node table shows node 1's load before: 6 partitions, their total bytes in
    assert any(line.split()[:4] == ["1", "9.0", "MiB/s", "18.0"] and " 6 " in line for line in out.splitlines())


def test_plan_json_lowers_the_imbalance(skewed):
    plan = json.loads(ok(run("balance", "plan", "--metrics", skewed, "--json")))
    assert plan["imbalance_before"] == pytest.approx(3.0)
    assert plan["imbalance_after"] < plan["imbalance_before"]
    assert plan["imbalance_after"] < 1.2
    assert plan["actions"] and all(a["source"] == 1 for a in plan["actions"])
    assert {a["dest"] for a in plan["actions"]} == {2, 3}
    for a in plan["actions"]:
        assert a["bytes_in_per_s"] == RATES[a["partition"]] and a["score"] > 0.5
    before = {n["node"]: n for n in plan["nodes_before"]}
    after = {n["node"]: n for n in plan["nodes_after"]}
    assert before[1]["partitions"] == 6 and before[1]["bytes_in_per_s"] == sum(RATES.values())
    assert after[1]["partitions"] == 6 - len(plan["actions"])
    assert sum(n["bytes_in_per_s"] for n in after.values()) == pytest.approx(sum(RATES.values()))
    assert all(n["state"] == "ok" for n in after.values())


def test_plan_never_moves_to_an_excluded_node(skewed):
    plan = json.loads(ok(run("balance", "plan", "--metrics", skewed, "--exclude", 2, "--json")))
    assert plan["actions"] and all(a["dest"] == 3 and a["source"] == 1 for a in plan["actions"])
    assert {n["node"]: n["state"] for n in plan["nodes_before"]}[2] == "excluded"
    assert plan["imbalance_after"] < plan["imbalance_before"]


def test_plan_options_bound_and_tune_the_plan(skewed):
    plan = json.loads(ok(run("balance", "plan", "--metrics", skewed, "--max-actions", 1, "--json")))
    assert len(plan["actions"]) == 1
    # Above the mean traffic, the detect threshold leaves the nodes alone: nothing to do.
    out = ok(run("balance", "plan", "--metrics", skewed, "--detect-threshold", "1G"))
    assert "Nothing to move" in out and "--detect-threshold" in out
    # A rate with /s is a size too; a wide band needs fewer moves than the default's.
    wide = json.loads(ok(run("balance", "plan", "--metrics", skewed, "--detect-threshold", "512K/s",
                             "--deviation-ratio", "0.6", "--json")))
    narrow = json.loads(ok(run("balance", "plan", "--metrics", skewed, "--json")))
    assert 0 < len(wide["actions"]) <= len(narrow["actions"])


def test_a_balanced_state_plans_nothing(tmp_path):
    state = write_state(tmp_path / "balanced.json", {"a": 1, "b": 3, "c": 2, "d": 3, "e": 2, "f": 2})
    out = ok(run("balance", "plan", "--metrics", state))
    assert "Nothing to move" in out and "Nodes after" not in out
    assert not any(line.strip().startswith("move ") for line in out.splitlines())
    plan = json.loads(ok(run("balance", "plan", "--metrics", state, "--json")))
    assert plan["actions"] == [] and plan["imbalance_after"] == plan["imbalance_before"] == pytest.approx(1.0)


def test_reports_older_than_the_window_count_as_missing(tmp_path):
    """The recording's 'now' judges freshness: at a 'now' far after the reports every node is
    without metrics, so nothing can receive a partition."""
    state = json.loads(write_state(tmp_path / "s.json", {name: 1 for name in RATES}).read_text())
    state["now"] += 3600
    (tmp_path / "old.json").write_text(json.dumps(state))
    out = ok(run("balance", "plan", "--metrics", tmp_path / "old.json"))
    assert "Nothing to move" in out and "no metrics" in out and "no node can receive" in out


def test_a_swap_moves_its_partner_back_in_the_nodes_after(tmp_path):
    """Node 1 holds two 4 MiB/s partitions, node 2 three small ones (mean 6): no single move helps,
    swapping a 4 with the 2 evens them; the loads after the plan count both halves."""
    mib = {"a": 4 * MiB, "b": 4 * MiB, "c": 2 * MiB, "d": MiB, "e": MiB}
    assignment = {"a": 1, "b": 1, "c": 2, "d": 2, "e": 2}
    reports = [report(n, {p: mib[p] for p, node in assignment.items() if node == n}, 995.0) for n in (1, 2)]
    path = tmp_path / "swap.json"
    path.write_text(json.dumps({"now": 1000.0, "assignment": assignment, "live": [1, 2], "reports": reports}))
    plan = json.loads(ok(run("balance", "plan", "--metrics", path, "--json")))
    (action,) = plan["actions"]
    assert action["source"] == 1 and action["dest"] == 2 and action["swap"] == "c"
    after = {n["node"]: n for n in plan["nodes_after"]}
    assert after[1]["bytes_in_per_s"] == after[2]["bytes_in_per_s"] == 6 * MiB
    assert (after[1]["partitions"], after[2]["partitions"]) == (2, 3)
    assert plan["imbalance_after"] == pytest.approx(1.0)
    out = ok(run("balance", "plan", "--metrics", path))
    assert f"swap {action['partition']} (node 1 -> 2) with c (back)" in out


# ---- bad input ------------------------------------------------------------------------------------

def test_bad_metrics_files_name_the_file_and_the_fix(tmp_path, skewed):
    missing = tmp_path / "missing.json"
    fails(run("balance", "plan", "--metrics", missing), 1, str(missing), "does not exist", "balance record")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    fails(run("balance", "plan", "--metrics", garbage), 1, str(garbage), "not JSON", "balance record")
    cases = {
        "list.json": [1, 2],
        "keys.json": {"now": 1.0, "assignment": {}},
        "now.json": {"now": "yesterday", "assignment": {}, "live": [], "reports": []},
        "assignment.json": {"now": 1.0, "assignment": {"a": "node1"}, "live": [1], "reports": []},
        "reports.json": {"now": 1.0, "assignment": {"a": 1}, "live": [1], "reports": [3]},
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(content))
        fails(run("balance", "plan", "--metrics", path), 1, str(path), "not a recorded cluster state")
    # A report without its time: the model refuses it, the message names the file.
    bad_report = json.loads(skewed.read_text())
    del bad_report["reports"][0]["at"]
    path = tmp_path / "report.json"
    path.write_text(json.dumps(bad_report))
    fails(run("balance", "plan", "--metrics", path), 1, str(path), "'at'")
    fails(run("balance", "plan", "--metrics", tmp_path), 1, str(tmp_path), "directory")


def test_bad_thresholds_name_the_option_and_the_fix(skewed):
    fails(run("balance", "plan", "--metrics", skewed, "--deviation-ratio", "1.5"), 2,
          "--deviation-ratio", "1.5", "strictly between 0 and 1")
    fails(run("balance", "plan", "--metrics", skewed, "--detect-threshold", "lots"), 2,
          "--detect-threshold", "'lots'", "1M")
    fails(run("balance", "plan", "--metrics", skewed, "--detect-threshold", "-1M"), 2, "--detect-threshold")
    fails(run("balance", "plan", "--metrics", skewed, "--max-actions", "0"), 2, "--max-actions", "positive")
    fails(run("balance", "plan", "--metrics", skewed, "--partition-cap", "0"), 2, "--partition-cap")
    fails(run("balance", "plan"), 2, "--meta URL", "--metrics FILE")
    fails(run("balance", "plan", "--meta", "sqlite:////nonexistent/dir/meta.db"), 1, "no metadata database")


# ---- live metadata --------------------------------------------------------------------------------

@pytest.fixture
def live(tmp_path):
    """SQLite metadata with three live nodes, the six partitions on node 1 and fresh reports."""
    url = f"sqlite:///{tmp_path}/meta.db"
    meta = open_metadata(url)
    cluster = Cluster(meta, store=None)
    for n in (1, 2, 3):
        meta.heartbeat(n, meta.register_node(n, "wal").node_epoch)
    for name in RATES:
        cluster.assign(name, 1)
    now = time.time()
    meta.put_kv(f"{REPORT_PREFIX}1", json.dumps(report(1, RATES, now)).encode())
    for n in (2, 3):
        meta.put_kv(f"{REPORT_PREFIX}{n}", json.dumps(report(n, {}, now)).encode())
    try:
        yield url, meta
    finally:
        meta.close()


def test_plan_on_live_metadata_writes_nothing(live):
    url, meta = live
    before = meta.list_kv("")
    nodes = meta.list_nodes()
    out = ok(run("balance", "plan", "--meta", url))
    assert "move " in out and "Nodes after" in out
    plan = json.loads(ok(run("balance", "plan", "--meta", url, "--json")))
    assert plan["actions"] and all(a["source"] == 1 for a in plan["actions"])
    assert plan["imbalance_after"] < plan["imbalance_before"] == pytest.approx(3.0)
    assert meta.list_kv("") == before
    assert meta.list_nodes() == nodes
    assert all(json.loads(v)["node"] == 1 for k, v in before.items() if k.startswith("assignment/"))


def test_record_then_plan_offline(live, tmp_path):
    url, meta = live
    out_path = tmp_path / "state.json"
    kv = meta.list_kv("")
    out = ok(run("balance", "record", "--meta", url, "--out", out_path))
    assert "6 partitions, 3 live nodes and 3 load reports" in out and str(out_path) in out
    assert meta.list_kv("") == kv
    state = json.loads(out_path.read_text())
    assert set(state) == {"now", "assignment", "live", "reports"}
    assert state["assignment"] == {name: 1 for name in RATES} and state["live"] == [1, 2, 3]
    assert abs(state["now"] - time.time()) < 60
    assert sorted(r["node"] for r in state["reports"]) == [1, 2, 3]
    offline = json.loads(ok(run("balance", "plan", "--metrics", out_path, "--json")))
    online = json.loads(ok(run("balance", "plan", "--meta", url, "--json")))
    assert offline["actions"] == online["actions"] and offline["actions"]
    assert offline["nodes_before"] == online["nodes_before"]


def test_status_shows_the_lease_reports_and_last_round(live):
    url, meta = live
    out = ok(run("balance", "status", "--meta", url))
    assert "Lease: none" in out and "Last round: none" in out
    assert Lease(meta, 5, 10.0, key=LEASE_KEY).acquire()
    out = ok(run("balance", "status", "--meta", url))
    assert "held by node 5, epoch 1, expires in" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and line.split()[0].isdigit()}
    assert set(rows) == {"1", "2", "3"} and "9.0 MiB/s" in rows["1"] and " 6 " in rows["1"]
    status = json.loads(ok(run("balance", "status", "--meta", url, "--json")))
    assert status["lease"]["holder"] == 5 and status["lease"]["epoch"] == 1 and status["lease"]["valid"]
    assert 0 < status["lease"]["expires_in_s"] <= 10
    assert status["live_nodes"] == [1, 2, 3]
    node1 = next(n for n in status["nodes"] if n["node"] == 1)
    assert node1["partitions"] == 6 and node1["bytes_in_per_s"] == sum(RATES.values()) and node1["report_age_s"] < 60
    meta.put_kv(LAST_ROUND_KEY, json.dumps({"leader": 5, "epoch": 1, "at": time.time(), "actions": [
        {"partition": "a", "source": 1, "dest": 2, "goal": "bytes_in_distribution", "score": 0.6,
         "load_change": RATES["a"], "scores": {"bytes_in_distribution": 0.6}, "outcome": "moved",
         "seconds": 0.25, "tail_bytes": 4096},
        {"partition": "b", "source": 1, "dest": 3, "swap": "c", "goal": "bytes_in_distribution", "score": 0.55,
         "load_change": MiB, "scores": {}, "outcome": "failed", "error": "node 3 did not open it"}]}).encode())
    out = ok(run("balance", "status", "--meta", url))
    assert "Last round: leader node 5, epoch 1" in out
    assert "move a node 1 -> node 2 for bytes_in_distribution" in out and "moved in 0.25 s" in out
    assert "swap b (node 1 -> 3) with c (back)" in out and ": failed: node 3 did not open it" in out
    assert "2 actions" in out


# ---- run ------------------------------------------------------------------------------------------

def test_run_once_refuses_while_another_candidate_leads(live, tmp_path):
    url, meta = live
    (tmp_path / "objects").mkdir()
    assert Lease(meta, 7, 30.0, key=LEASE_KEY).acquire()
    kv = meta.list_kv("assignment/")
    fails(run("balance", "run", "--meta", url, "--store", tmp_path / "objects", "--node-id", 9, "--once"), 1,
          "node 9 did not get the balancer lease", "node 7 holds it")
    assert meta.list_kv("assignment/") == kv


def test_run_once_with_nothing_to_move_records_the_round_and_releases_the_lease(tmp_path):
    url = f"sqlite:///{tmp_path}/meta.db"
    meta = open_metadata(url)
    try:
        for n in (1, 2):
            meta.heartbeat(n, meta.register_node(n, "wal").node_epoch)
        cluster = Cluster(meta, LocalObjectStore(str(tmp_path / "objects")))
        cluster.assign("a", 1)
        cluster.assign("b", 2)
        now = time.time()
        for n, name in ((1, "a"), (2, "b")):
            meta.put_kv(f"{REPORT_PREFIX}{n}", json.dumps(report(n, {name: MiB}, now)).encode())
        out = ok(run("balance", "run", "--meta", url, "--store", tmp_path / "objects", "--node-id", 9, "--once"))
        assert "node 9 leads the balancer (epoch 1)" in out and "Nothing to move" in out
        last = json.loads(meta.get_kv(LAST_ROUND_KEY))
        assert last["leader"] == 9 and last["epoch"] == 1 and last["actions"] == []
        assert json.loads(meta.get_kv(LEASE_KEY))["expires_ns"] == 0      # released
        assert cluster.assignment("a")["node"] == 1 and cluster.assignment("b")["node"] == 2
    finally:
        meta.close()


@pytest.mark.slow
def test_run_once_moves_partitions_of_a_live_cluster(tmp_path):
    """Three nodes with agents, six producing partitions on node 1: one round moves some off it."""
    from test_balancer_loop import FAST, SKEWED_RATES, records_of, skewed_load, stop_all
    from test_cluster import InProcessCluster

    url = f"sqlite:///{tmp_path}/meta.db"
    c = InProcessCluster(tmp_path, url, nodes=(1, 2, 3), config=FAST)
    producers = []
    try:
        producers = skewed_load(c)
        result = run("balance", "run", "--meta", url, "--store", tmp_path / "objects", "--node-id", 9, "--once",
                     "--detect-threshold", "8K", "--deviation-ratio", "0.15")
        out = ok(result)
        moved = [line for line in out.splitlines() if line.startswith("move ")]
        assert moved and all(" node 1 -> node " in line and ": moved in " in line for line in moved), out
        assert f"Round done: {len(moved)} actions executed" in out
        last = json.loads(c.meta.get_kv(LAST_ROUND_KEY))
        assert last["leader"] == 9 and [a["outcome"] for a in last["actions"]] == ["moved"] * len(moved)
        owners = {c.cluster.assignment(name)["node"] for name in SKEWED_RATES}
        assert owners == {1, 2, 3}
    finally:
        stop_all(producers)
    try:
        for p in producers:
            stored = dict(records_of(c, p.name))
            assert p.acked and all(stored.get(base) == payload for base, payload in p.acked), p.name
    finally:
        c.close()


def test_help_of_the_balance_commands():
    for command in ("plan", "record", "status", "run"):
        result = run("balance", command, "--help")
        assert result.exit_code == 0 and "Usage: " in result.stdout, result.output
    assert "--deviation-ratio" in run("balance", "plan", "--help").stdout
    assert "--once" in run("balance", "run", "--help").stdout
