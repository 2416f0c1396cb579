"""Moves go first (s3stream.cluster.hold): while a node agent closes or opens a partition, the
node's partitions' appends wait, within a per-move limit and a share of the time."""
from __future__ import annotations

import threading

import pytest

from s3stream import ConfigError, RecordBatch
from s3stream.cluster import ClusterConfig, partition_on
from s3stream.cluster.hold import AppendHold
from s3stream.cluster import partition_table
from s3stream.cluster.runtime import THREADS
from test_cluster import InProcessCluster


class FakeClock:
    """THREADS with a clock the test moves (events are real; waits are short here)."""

    def __init__(self) -> None:
        self.now = 1_000_000_000

    def monotonic_ns(self) -> int:
        return self.now

    def event(self):
        return THREADS.event()

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * 1e9)


def _waiter(hold: AppendHold) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()
    t = threading.Thread(target=lambda: (hold.wait(), done.set()), daemon=True)
    t.start()
    return t, done


def test_an_append_waits_for_the_move_and_goes_on_when_it_ends():
    hold = AppendHold(THREADS, limit=30.0, share=1.0)
    hold.wait()                                    # no move: no wait, nothing counted
    assert hold.stats["appends_held"] == 0
    with hold.moving():
        t, done = _waiter(hold)
        assert not done.wait(0.2)                  # held while the move runs
        with hold.moving():                        # a second move at once: one episode
            pass
        assert not done.wait(0.1)                  # still held: the first move runs on
    assert done.wait(10)
    t.join(10)
    assert hold.stats["moves_held"] == 1 and hold.stats["appends_held"] == 1
    assert 0.25 <= hold.stats["append_hold_seconds"] <= hold.stats["held_seconds"]


def test_a_move_holds_appends_for_its_limit_and_the_holds_for_their_share_of_the_time():
    """On a clock the test moves (the waits themselves are real: each is woken by the move's
    end, or times out after what is left of the allowance)."""
    clock = FakeClock()
    hold = AppendHold(clock, limit=10.0, share=0.25)  # type: ignore[arg-type]
    with hold.moving():
        clock.advance(15)                          # past the limit: appends pass again
        _, done = _waiter(hold)
        assert done.wait(10)
    assert hold.stats["held_seconds"] == pytest.approx(10)
    # The budget is spent: a move right after holds nothing...
    with hold.moving():
        _, done = _waiter(hold)
        assert done.wait(10)
    assert hold.stats["moves_held"] == 1 and hold.stats["appends_held"] == 0
    # ... and 20 s later it has refilled a quarter of that: 5 s.
    clock.advance(20)
    with hold.moving():
        clock.advance(4)
        _, done = _waiter(hold)
        assert not done.wait(0.2)                  # held: 1 s of its allowance left
        clock.advance(0.5)
    assert done.wait(10)                           # woken by the move's end
    assert hold.stats["moves_held"] == 2 and hold.stats["appends_held"] == 1
    assert hold.stats["held_seconds"] == pytest.approx(14.5)


def test_a_zero_limit_never_holds():
    hold = AppendHold(THREADS, limit=0.0, share=0.25)
    with hold.moving():
        _, done = _waiter(hold)
        assert done.wait(10)
    assert hold.stats == dict(moves_held=0, held_seconds=0.0, appends_held=0, append_hold_seconds=0.0)


@pytest.mark.parametrize("field, value", [("move_hold", -0.1), ("move_hold_share", 0.0), ("move_hold_share", 1.5)])
def test_move_hold_settings_are_checked(field, value):
    with pytest.raises(ConfigError, match=field):
        ClusterConfig(**{field: value})


def test_an_agent_s_moves_hold_its_node_s_appends_and_not_their_own(tmp_path, metadata_url):
    """A migration holds the appends of the source's other partitions while the source closes;
    the close itself (its checkpoint goes to the meta stream) is never held: held, it would
    wait out move_hold and the migration its timeout."""
    config = ClusterConfig(agent_interval=0.01, heartbeat_interval=0.1, heartbeat_timeout=1.0,
                           migration_timeout=5.0, move_hold=30.0, move_hold_share=1.0)
    c = InProcessCluster(tmp_path, metadata_url, nodes=(1, 2), config=config)
    try:
        for name in ("p", "q"):
            c.cluster.assign(name, 1)
            c.cluster.wait_open(name, 1, 5)
        hold = c.agents[1].hold
        assert partition_table(c.clients[1]).hold is hold
        q = partition_on(c.clients[1], "q")
        q.append(RecordBatch(b"before", 1)).result(10)
        # The agent may still be inside the open of p or q when wait_open returns (it holds
        # appends until its open ends), so "before" may have waited: count from here.
        held_before = hold.stats["appends_held"]
        moving = threading.Event()
        release = threading.Event()
        real_close = type(q).close

        def slow_close(self, *args, **kwargs):
            # The close runs held; an append to q from another thread waits behind it.
            moving.set()
            assert release.wait(10)
            return real_close(self, *args, **kwargs)

        import s3stream.cluster.partition as partition_mod
        partition_mod.Partition.close = slow_close
        try:
            mover = threading.Thread(target=lambda: c.cluster.migrate("p", 2), daemon=True)
            mover.start()
            assert moving.wait(10)
            appended = []
            t = threading.Thread(target=lambda: appended.append(q.append(RecordBatch(b"during", 1))), daemon=True)
            t.start()
            t.join(0.3)
            assert not appended                       # held while p's close runs on node 1
            release.set()
            mover.join(20)
            t.join(10)
        finally:
            partition_mod.Partition.close = real_close
        assert appended and appended[0].result(10).base_offset == 1
        assert c.cluster.owner("p") == 2
        assert hold.stats["appends_held"] == held_before + 1 and hold.stats["moves_held"] >= 1
    finally:
        c.close()
