"""Issue 32's campaign in CI: a few short seeds of tests/kits/cluster_campaign.py on both backends,
held to the campaign's targets (0 lost, 0 overwritten, 0 duplicated, 0 offsets acknowledged
twice, 0 false failovers, every node live at the end, no partition without acknowledgments for
more than heartbeat_timeout + 5 s when no fault touches its owner); and the harness's own
checks: a seed's schedule replays exactly, and the checker counts what it is shown.

The seeds are chosen so that their schedules hold a lost host and, on pg-s3, PostgreSQL outages
and an S3 stall: the faults that issue 26's fixes (forget, leases, outage-proof detection,
uploads that retry every transient error) made survivable. A seed the code fails gets
xfail(strict=True) with the reason, until a fix makes it XPASS.
"""
from __future__ import annotations

from dataclasses import asdict

import pytest

import cluster_campaign
import cluster_harness as H
from cluster_harness import FaultRecord, RunConfig, check, plan_schedule

pytestmark = pytest.mark.slow    # the whole module: soaks, campaigns, fault runs or Spark (README: quick tier)


# ---- the schedule -----------------------------------------------------------------------------

def test_a_seed_plans_the_same_schedule_every_time():
    config = RunConfig()
    one = plan_schedule(7, 90, H.FAULT_KINDS, config)
    assert one == plan_schedule(7, 90, H.FAULT_KINDS, config)
    assert one != plan_schedule(8, 90, H.FAULT_KINDS, config)
    # What a report stores is what a replay reads back.
    assert [H.PlannedFault(**asdict(f)) for f in one] == one


@pytest.mark.parametrize("seed", range(1, 21))
def test_a_schedule_keeps_its_rules(seed):
    """A fault every 2-5 s (some slots skipped), at most two planned to overlap, never two on one
    node at once, at most one lost host, only the backend's kinds."""
    config = RunConfig()
    kinds = H.make_backend_faults("sqlite-local")
    schedule = plan_schedule(seed, 90, kinds, config)
    assert schedule and all(f.kind in kinds for f in schedule)
    starts = [f.at for f in schedule]
    assert starts == sorted(starts) and 2.0 <= starts[0] <= 5.0
    assert all(b - a >= 2.0 for a, b in zip(starts, starts[1:]))
    assert sum(f.kind == "lose-host" for f in schedule) <= 1
    for f in schedule:
        active = [g for g in schedule if g is not f and g.at <= f.at < g.at + H.planned_span(g, config)]
        assert len(active) <= 1, (f, active)
        if f.kind in ("pause", "kill", "lose-host"):
            assert not [g for g in active if g.kind in ("pause", "kill", "lose-host") and g.slot == f.slot]
        if f.kind == "pause":
            assert 0.5 <= f.seconds <= 8.0
    pg = plan_schedule(seed, 300, H.make_backend_faults("pg-s3"), config)
    for f in pg:
        if f.kind == "pg-outage":
            assert 3.0 <= f.seconds <= 12.0
        if f.kind == "s3-freeze":
            assert 5.0 <= f.seconds <= 15.0
        if f.kind in ("pg-outage", "s3-freeze"):      # one outage of a server at a time
            assert not [g for g in pg if g is not f and g.kind == f.kind and g.at <= f.at < g.at + g.seconds + 2.0]


# ---- the checker ----------------------------------------------------------------------------

S = 1_000_000_000


def ack(partition, offset, pid, t):
    return (partition, offset, pid, t * S, t * S, H.payload_node(pid)[0])


def fault(kind, target, start, end, nodes=(), partitions=(), is_global=False):
    return FaultRecord(0, kind, target, start * S, start * S, list(nodes), list(partitions), is_global, end * S,
                       end * S)


def test_the_checker_counts_what_went_wrong():
    config = RunConfig(heartbeat_timeout=1.5)
    p = H.make_payload
    acks = [
        ack("a", 0, "n1-i1-a-1", 1),       # fine
        ack("a", 1, "n1-i1-a-2", 2),       # overwritten: offset 1 holds n2-i1-a-9; and lost
        ack("a", 1, "n2-i1-a-9", 30),      # the same offset acknowledged again: acked twice
        ack("a", 2, "n1-i1-a-3", 31),      # lost: nowhere
        ack("a", 3, "n1-i1-a-4", 32),      # misplaced: found at offset 4
    ]
    records = {"a": {0: p("n1-i1-a-1"), 1: p("n2-i1-a-9"), 4: p("n1-i1-a-4"), 5: p("n1-i1-a-4"),
                     6: p("n3-i1-a-7")[:-1] + b"?"}}
    faults = [fault("pause", "node 1", 3, 9, nodes=[1]), fault("pause", "node 2", 4, 6, nodes=[2])]
    failovers = [dict(node=1, at_ns=5 * S, kind="failover", judge=2),      # during node 1's pause
                 dict(node=2, at_ns=20 * S, kind="failover", judge=1),     # node 2 was never stopped
                 dict(node=3, at_ns=21 * S, kind="forget", judge=None),    # a forget is no failover
                 dict(node=3, at_ns=25 * S, kind="migration-fallback", seconds=1.0),   # forced, not false
                 dict(node=2, at_ns=10 * S, seconds=5.0, kind="failover")]  # decided at 5 s: node 2 paused
    r = check(acks, records, faults, failovers, config, window=(0, 40 * S), t0_ns=0, t0_wall_ns=0)
    c = r["counts"]
    assert (c["acknowledged"], c["lost"], c["overwritten"], c["misplaced"]) == (5, 2, 1, 1)
    assert (c["duplicated"], c["acked_twice"], c["corrupt"]) == (1, 1, 1)
    assert (c["failovers"], c["false_failovers"], c["forced_failovers"]) == (4, 1, 1)
    assert r["false_failover_records"][0]["node"] == 2 and r["false_failover_records"][0]["t"] == 20.0
    # Acknowledgments at 1-2 s and 30-32 s: 28 s without any, of which the pause covers 6 s
    # (node 1 owned "a"): 21 s outside faults.
    assert r["partitions"]["a"]["longest_gap"] == 28.0
    assert r["partitions"]["a"]["longest_gap_outside_faults"] == 21.0
    assert not H.targets(dict(r, config=asdict(config), settle=dict(all_live=True, unsettled=[])))["no_loss"]
    # Node 2 had no process serving from 18 to 19 s (it crashed, or could not start): a failover at
    # 20 s (within heartbeat timeout + 1 s of its return) is no false one.
    down = check(acks, records, faults, failovers, config, window=(0, 40 * S), t0_ns=0, t0_wall_ns=0,
                 node_down={2: [(18 * S, 19 * S)]})
    assert down["counts"]["false_failovers"] == 0


def test_the_checker_finds_partitions_left_on_a_failed_over_node():
    """Node 1 is down from 10 s on and failed over at 12 s; "a" is still assigned to it at
    18.5 s (12 + 1.5 + 5), "b" moved: one partition stuck."""
    config = RunConfig(heartbeat_timeout=1.5)
    log = [(1 * S, {"a": [1, 1, 1], "b": [1, 1, 1]}), (13 * S, {"a": [1, 1, 1], "b": [2, 2, 2]})]
    failovers = [dict(node=1, at_ns=12 * S, kind="failover", judge=2, ok=True)]
    r = check([], {"a": {}, "b": {}}, [fault("kill", "node 1", 10, 30, nodes=[1])], failovers, config,
              window=(0, 40 * S), t0_ns=0, t0_wall_ns=0, assignment_log=log, node_down={1: [(10 * S, 30 * S)]})
    assert r["counts"]["stuck_after_failover"] == 1 and r["stuck_after_failover_records"][0]["partition"] == "a"
    back = check([], {"a": {}, "b": {}}, [], failovers, config, window=(0, 40 * S), t0_ns=0, t0_wall_ns=0,
                 assignment_log=log, node_down={1: [(10 * S, 15 * S)]})     # node 1 was back by then
    assert back["counts"]["stuck_after_failover"] == 0


def test_the_checker_gives_up_only_what_a_forgotten_host_held_alone():
    """A host lost with its WAL and forgotten: its acknowledgments at or above the committed end
    when it was forgotten are given up (reported apart); below it they must be there."""
    config = RunConfig()
    p = H.make_payload
    acks = [ack("a", 0, "n1-i1-a-1", 1), ack("a", 1, "n1-i1-a-2", 2), ack("a", 2, "n1-i1-a-3", 3)]
    records = {"a": {0: p("n1-i1-a-1"), 2: p("n4-i1-a-1")}}
    r = check(acks, records, [fault("lose-host", "node 1", 3.5, 4, nodes=[1, 4])], [], config,
              window=(0, 5 * S), t0_ns=0, t0_wall_ns=0, given_up={1: {"a": [[2, 3]]}})
    c = r["counts"]
    assert (c["lost"], c["given_up"], c["overwritten"], c["acked_twice"]) == (1, 1, 0, 0)
    nothing_given_up = check(acks, records, [], [], config, window=(0, 5 * S), t0_ns=0, t0_wall_ns=0)
    assert (nothing_given_up["counts"]["lost"], nothing_given_up["counts"]["given_up"]) == (2, 0)
    assert nothing_given_up["counts"]["overwritten"] == 1


def test_resuming_means_acknowledging_steadily_again():
    ms = 1_000_000
    steady = list(range(0, 3000 * ms, 10 * ms))
    assert H.resumed_at(steady, 1000 * ms) == 1000 * ms                 # never stopped
    stalled = [t for t in steady if not 500 * ms < t < 2000 * ms] + [2500 * ms + i * 10 * ms for i in range(200)]
    stalled = sorted(set(stalled))
    assert H.resumed_at(stalled, 600 * ms) == 2000 * ms
    assert H.resumed_at([0, 10 * ms], 5 * ms) is None
    assert H.longest_uncovered(0, 10, [(2, 3), (5, 9)]) == 2
    assert H.longest_uncovered(0, 10, []) == 10
    assert H.longest_uncovered(0, 10, [(-5, 20)]) == 0


# ---- short seeds ----------------------------------------------------------------------------

#: (backend, seed, seconds): each schedule holds a lost host; the pg-s3 one PostgreSQL outages and
#: an S3 stall too. About a minute in all on 2 cores; more seeds run with tests/kits/cluster_campaign.py
#: (a second SQLite seed, 15, was dropped from CI for its 24 s).
SEEDS = [("sqlite-local", 4, 20), ("pg-s3", 12, 30)]


@pytest.mark.parametrize("backend,seed,seconds", SEEDS)
def test_campaign_seed_meets_every_target(backend, seed, seconds, tmp_path, capsys):
    if backend == "pg-s3":
        from testservers.postgres import find_binary
        if not find_binary("pg_ctl"):
            pytest.skip("PostgreSQL is not installed")
    config = cluster_campaign.campaign_config(settle_timeout=15.0)
    schedule = plan_schedule(seed, seconds, H.make_backend_faults(backend), config)
    assert any(f.kind == "lose-host" for f in schedule), "the seed no longer plans a lost host: pick another"
    result = cluster_campaign.run_seed(backend, seed, seconds, config, tmp_path, progress=False)
    with capsys.disabled():
        print("\n" + cluster_campaign.summary_line(f"{backend}-seed{seed}", result))
    missed = {k: v for k, v in result["targets"].items() if not v}
    assert not missed, (f"targets missed: {sorted(missed)}; counts {result['counts']}; settle {result['settle']}; "
                        f"report {tmp_path}/{backend}-seed{seed}.json")
