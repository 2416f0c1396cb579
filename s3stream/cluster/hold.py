"""Moves go first: while a node agent closes or opens a partition, the node's producers wait.

A move is a chain of short steps (metadata round trips, a PUT, hand-offs between threads), and
each step's thread must take the process's GIL back when it wakes. Producers appending flat out
hold that GIL and both cores; the move's thread then waits behind them at every step
(benchmarks.wake: 3-5 ms p99 per wake-up in a node under appends on a busy host, 0.1-0.2 ms
for the same thread in a process of its own). Raising the agent's thread priority does not help
with the GIL, and neither did SCHED_FIFO (tried on 2026-11-28, benchmarks.wake's appends+busy case).

So, as issue 28 allows ("producers may be slowed, never the move"), a node's agent holds
`Partition.append` on its node while it closes or opens a partition: appends that arrive
meanwhile wait until the move ends, and never longer than the move's allowance:

- at most `limit` seconds per move (ClusterConfig.move_hold), however long it runs;
- in all at most `share` of the time (ClusterConfig.move_hold_share): the allowance is a budget
  of held seconds that refills at `share` seconds per second, up to `limit`, so moves one after
  another (a balancer emptying a node) slow its producers by that share at most.

In asyncio code (s3stream.aio) `AsyncPartition.append` waits without blocking the loop, and
`append_nowait` does not wait. Only Partition.append waits, before anything else it does (no
lock taken): the move's own
appends (the checkpoints, which go to the meta stream) pass, and an append already submitted is
never held back. Appends of the partition that is moving are refused as before once they pass.
The waits use the agent's Runtime, so the simulation drives them like every other wait.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runtime import Runtime


class AppendHold:
    """The hold of one node (its client's partition table): `moving()` around a move, `wait()`
    in each append. `stats`: "moves_held" (moves that held appends), "held_seconds" (the time
    they held, budgeted), "appends_held" (appends that waited), "append_hold_seconds" (their
    waits, summed)."""

    def __init__(self, runtime: Runtime, limit: float, share: float) -> None:
        self._runtime = runtime
        self.limit_ns = int(limit * 1e9)
        self.share = share
        self._free = runtime.event()
        self._free.set()
        self._lock = threading.Lock()       # held for a few statements, never across a wait
        self._moves = 0                     # moves running now
        self._started = 0                   # when the running ones began holding
        self._until = 0                     # appends wait until then at most
        self._budget = self.limit_ns        # held ns left to spend
        self._refilled = runtime.monotonic_ns()
        self._released = 0                  # when the last hold ended
        self.stats = dict(moves_held=0, held_seconds=0.0, appends_held=0, append_hold_seconds=0.0)

    @contextlib.contextmanager
    def moving(self) -> Iterator[None]:
        """Hold appends while the block runs, within the allowance (module docstring)."""
        if self.limit_ns <= 0:
            yield
            return
        with self._lock:
            if self._moves == 0:
                now = self._runtime.monotonic_ns()
                self._budget = min(self.limit_ns, self._budget + int((now - self._refilled) * self.share))
                self._refilled = now
                self._started, self._until = now, now + self._budget
                if self._budget > 0:
                    self._free.clear()
                    self.stats["moves_held"] += 1
            self._moves += 1
        try:
            yield
        finally:
            with self._lock:
                self._moves -= 1
                if self._moves == 0:
                    now = self._runtime.monotonic_ns()
                    held = max(0, min(now, self._until) - self._started)
                    self._budget -= held
                    self._refilled = now
                    self.stats["held_seconds"] += held / 1e9
                    self._released = now
                    self._free.set()

    def remaining(self) -> float:
        """Seconds an append arriving now would wait at most (0: none): for a caller that must
        not block, such as an event loop (s3stream.aio), to wait its own way."""
        if self._free.is_set():
            return 0.0
        return max(0, self._until - self._runtime.monotonic_ns()) / 1e9

    def count_wait(self, seconds: float) -> None:
        """An append that waited `seconds` its own way (`remaining`)."""
        with self._lock:
            self.stats["appends_held"] += 1
            self.stats["append_hold_seconds"] += seconds

    def wait(self) -> None:
        """An append's turn: return at once unless a move holds appends, else when it ends or
        its allowance is spent."""
        if self._free.is_set():
            return
        now = self._runtime.monotonic_ns()
        left = self._until - now
        if left <= 0:
            return
        released = self._free.wait(left / 1e9)
        end = self._runtime.monotonic_ns()
        if released:
            # The hold ended when the move let go, not when this thread got to run again: the
            # wake-up's latency is the scheduler's, and counted it made an append's wait longer
            # than the hold itself.
            end = min(end, max(now, self._released))
        self.count_wait((end - now) / 1e9)


__all__ = ["AppendHold"]
