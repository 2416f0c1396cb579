"""The deterministic simulation of the cluster protocol (issue 32, item 5; tests/cluster_sim.py):
10,000 seeds find no lost, overwritten or duplicated record, no offset acknowledged twice, no
false failover, no node left dead and no partition left unavailable; a seed replays exactly;
and each known bug, reintroduced one at a time, is caught."""
from __future__ import annotations

import logging

import pytest

import cluster_sim

#: Seeds in CI (the issue asks for at least 10,000 within 5 minutes on 2 cores).
SEEDS = 10_000

#: A seed known to catch each mutant (found by `python3 tests/cluster_sim.py --mutant NAME`), run
#: first. Should the simulation change so that it no longer catches its mutant, the test searches
#: the next SEARCH seeds on both cores and names the seed to put here.
KNOWN = {
    "zombie-ack": 1,
    "naive-detector": 80,
    "false-close": 929,
    "any-opened": 102,
    "sick-serves": 0,
    "no-settle": 163,
    "stale-fence": 2783,
    "reused-claim": 1413,
    "close-any-incarnation": 2172,
}

#: How far past KNOWN the test searches. The rarest mutants are caught by about one seed in two
#: thousand (of seeds 0-1999 before 6d0d735: reused-claim 1, stale-fence 1, false-close 2,
#: close-any-incarnation 4): a search of 1,500 seeds missed one of them about half the time once the
#: simulation changed.
SEARCH = 10_000


@pytest.fixture(autouse=True)
def quiet():
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def test_ten_thousand_seeds_break_no_invariant():
    summary = cluster_sim.run_many(list(range(SEEDS)), workers=2)
    print(f"\nsimulation: {summary['seeds']} seeds in {summary['seconds']} s ({summary['seeds_per_second']} seeds/s), "
          f"{summary['distinct_interleavings']} distinct fault interleavings; totals {summary['totals']}")
    assert summary["seeds"] == SEEDS
    assert summary["failed"] == 0, [(f["seed"], f["problems"][:3]) for f in summary["failures"]]
    totals = summary["totals"]
    assert totals["acknowledged"] > 100 * SEEDS and totals["failovers"] > SEEDS // 2   # the faults did bite
    # Moves happened: a close that always fails (as SimClient.close_streams did for a while,
    # refusing the close's timing argument) leaves only failovers to move partitions.
    assert totals["migrated"] > SEEDS // 2, totals
    assert summary["distinct_interleavings"] > SEEDS // 2


def test_a_seed_replays_exactly():
    first, again = cluster_sim.run_seed(4242), cluster_sim.run_seed(4242)
    assert first == again and first["ok"] and first["steps"] > 1000


@pytest.mark.parametrize("mutant", sorted(KNOWN))
def test_each_known_bug_is_caught(mutant):
    known = KNOWN[mutant]
    result = cluster_sim.run_seed(known, mutant)
    if not result["ok"]:
        print(f"\n{mutant}: seed {known}: {result['problems'][0]}")
        return
    summary = cluster_sim.run_many(list(range(known + 1, known + 1 + SEARCH)), mutant, workers=2, stop_at_first=True)
    assert summary["failed"], f"mutant {mutant} was not caught by seeds {known}-{known + SEARCH}"
    caught = summary["failures"][0]
    print(f"\n{mutant}: seed {caught['seed']} (KNOWN has {known}, which no longer catches it: update it): "
          f"{caught['problems'][0]}")
