"""The deterministic simulation of the cluster protocol (issue 32, item 5; tests/kits/cluster_sim.py):
10,000 seeds find no lost, overwritten or duplicated record, no offset acknowledged twice, no
false failover, no node left dead and no partition left unavailable; a seed replays exactly;
and each known bug, reintroduced one at a time, is caught."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

import cluster_sim

#: Seeds in CI (the issue asks for at least 10,000 within 5 minutes on 2 cores).
SEEDS = 10_000

#: A seed known to catch each mutant (found by `python3 tests/kits/cluster_sim.py --mutant NAME`), run
#: first. Should the simulation change so that it no longer catches its mutant, the test searches
#: the next SEARCH seeds on both cores and names the seed to put here.
KNOWN = {
    "zombie-ack": 35,
    "naive-detector": 232,
    "false-close": 2300,
    "any-opened": 135,
    "sick-serves": 22,
    "no-settle": 2244,
    "stale-fence": 9620,
    "reused-claim": 6016,
    "close-any-incarnation": 5265,
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


class BackgroundSeeds:
    """The 10,000 seeds run by tests/kits/cluster_sim.py in a process of their own, started when the
    session starts (conftest calls `start_background` for a selected test that has one) with
    its workers at SCHED_IDLE: they take the cores only while the other tests leave them idle
    (the fault tests spend most of their time waiting out outages and timeouts), and the test
    collects the summary when its turn comes. The CPU time is the same as a run of its own;
    the CI run's wall time is not spent twice."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="s3stream-sim-")
        self.json = os.path.join(self.dir, "summary.json")
        self.log = open(os.path.join(self.dir, "stderr"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, cluster_sim.__file__, "--seeds", f"0-{SEEDS - 1}", "--workers", "2", "--json", self.json],
            stdout=subprocess.DEVNULL, stderr=self.log, preexec_fn=_idle)

    def summary(self, timeout: float) -> dict:
        """The run's summary with its CPU seconds (its workers' included), waiting up to `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                break
            assert time.monotonic() < deadline, f"the background simulation did not end within {timeout} s"
            time.sleep(0.2)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.log.seek(0)
        assert os.path.exists(self.json), f"the simulation wrote no summary; its stderr: {self.log.read()[-3000:]}"
        with open(self.json) as f:
            summary = json.load(f)
        return dict(summary, cpu_seconds=round(usage.ru_utime + usage.ru_stime, 1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _idle() -> None:
    """In the simulation's process before exec: its own process group (stop kills its workers
    too) and SCHED_IDLE, which the workers it spawns inherit."""
    os.setpgrp()
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


_background: list[BackgroundSeeds] = []
#: The 10,000-seed run's figures once its test ran, for the session's summary (conftest).
SUMMARY: list[str] = []


def start_background(name: str) -> None:
    """conftest: `name` of this module was selected; start what it runs in the background."""
    if name == "test_ten_thousand_seeds_break_no_invariant" and not _background:
        _background.append(BackgroundSeeds())


def stop_background() -> None:
    """conftest, at the session's end: stop a run whose test never collected it."""
    while _background:
        _background.pop().stop()


@pytest.mark.slow
def test_ten_thousand_seeds_break_no_invariant():
    if _background:
        summary = _background[0].summary(timeout=900)
        stop_background()
        SUMMARY.append(f"in the background from the session's start, workers at SCHED_IDLE: {summary['seeds']} "
                       f"seeds, {summary['cpu_seconds']} CPU s on 2 workers, {summary['seconds']} s of wall time "
                       "beside the other tests")
    else:
        summary = cluster_sim.run_many(list(range(SEEDS)), workers=2)
    SUMMARY.append(f"{summary['seeds']} seeds in {summary['seconds']} s ({summary['seeds_per_second']} seeds/s), "
                   f"{summary['failed']} failed, {summary['distinct_interleavings']} distinct fault interleavings; "
                   f"totals {summary['totals']}")
    print("\nsimulation: " + "; ".join(SUMMARY))
    assert summary["seeds"] == SEEDS
    assert summary["failed"] == 0, [(f["seed"], f["problems"][:3]) for f in summary["failures"]]
    totals = summary["totals"]
    assert totals["acknowledged"] > 100 * SEEDS and totals["failovers"] > SEEDS // 2   # the faults did bite
    # Moves happened: a close that always fails (as SimClient.close_streams did for a while,
    # refusing the close's timing argument) leaves only failovers to move partitions.
    assert totals["migrated"] > SEEDS // 2, totals
    assert summary["distinct_interleavings"] > SEEDS // 2


#: Seeds run with hundreds of partitions per node (issue 53): batched opens, closes, failovers
#: and reassignments under the same faults.
MANY_SEEDS, MANY_PARTITIONS = 12, 300


@pytest.mark.slow
def test_seeds_with_hundreds_of_partitions_per_node_break_no_invariant():
    """Three nodes, 100 partitions each, the simulation's faults: nothing lost, overwritten or
    acknowledged twice, every partition acknowledging again at the end; and the faults bit
    (failovers and migrations happened, moving hundreds of partitions in batches)."""
    summary = cluster_sim.run_many(list(range(MANY_SEEDS)), workers=2, partitions=MANY_PARTITIONS)
    SUMMARY.append(f"{summary['seeds']} seeds with {MANY_PARTITIONS} partitions in {summary['seconds']} s: "
                   f"{summary['totals']}")
    assert not summary["failed"], summary["failures"][:2]
    totals = summary["totals"]
    assert totals["acknowledged"] > 1000 * MANY_SEEDS and totals["failovers"] > 0 and totals["migrated"] > 0, totals


def test_a_seed_replays_exactly():
    first, again = cluster_sim.run_seed(4242), cluster_sim.run_seed(4242)
    assert first == again and first["ok"] and first["steps"] > 1000


def _checked(mutant: str, result: dict) -> str:
    """The first problem of a failing seed, which must be a broken invariant the checker found,
    not a simulated thread dying of an error or an agent's move failing of one (a TypeError, say):
    a mutant whose patch no longer fits the code it patches (the any-opened one did not take
    wait_open's `feed` for a while) fails that way and would count as caught."""
    died = [p for p in result["problems"] if "Traceback (most recent call last)" in p or "failed unexpectedly" in p]
    assert not died, f"mutant {mutant}: seed {result['seed']} failed by a thread dying, not an invariant: {died[0]}"
    return result["problems"][0]


@pytest.mark.parametrize("mutant", sorted(KNOWN))
def test_each_known_bug_is_caught(mutant):
    known = KNOWN[mutant]
    result = cluster_sim.run_seed(known, mutant)
    if not result["ok"]:
        print(f"\n{mutant}: seed {known}: {_checked(mutant, dict(result, seed=known))}")
        return
    summary = cluster_sim.run_many(list(range(known + 1, known + 1 + SEARCH)), mutant, workers=2, stop_at_first=True)
    assert summary["failed"], f"mutant {mutant} was not caught by seeds {known}-{known + SEARCH}"
    caught = summary["failures"][0]
    print(f"\n{mutant}: seed {caught['seed']} (KNOWN has {known}, which no longer catches it: update it): "
          f"{_checked(mutant, caught)}")
