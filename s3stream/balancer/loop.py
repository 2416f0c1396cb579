"""The continuous balancer: on the one node holding the lease, plan from the nodes' load reports
and move partitions through `Cluster.migrate`, at a bounded rate, until the goals are met.

Every node that may lead runs a `Balancer` (so does `s3stream balance run`, which can run
anywhere with the cluster's metadata and store). Each wakes every lease_ttl_s / 3 to take or
renew the lease; only the holder plans, every loop_interval_s, and not before settle_s after a
round that moved something, so that the reports describe the new placement before it plans
again. A round:

1. builds a ClusterModel from the assignments, the live nodes and the nodes' reports (reports
   older than metrics_window_s are ignored; a node with none receives nothing);
2. plans at most max_actions_per_plan moves (hard goals veto, soft goals score; nothing when the
   goals are met, which is what keeps the loop from oscillating);
3. migrates them one by one, at most action_rate_limit_per_s, each assignment guarded by the
   lease, so a deposed leader's move is refused (FencedLeaderError) and it stops the round.

Every action is logged with its goal scores (`explain_action`) and kept, with its outcome, in
`history` (bounded) and in the KV key `balancer/last_round` for `s3stream balance status`.
"""
from __future__ import annotations

import collections
import json
import logging
import threading
import time
from typing import Callable, Iterable

from ..cluster import Cluster
from ..errors import FencedLeaderError, S3StreamError
from ..cluster.loadreport import read_reports
from .action import Action
from .config import BalancerConfig
from .explain import action_to_dict, explain_action
from ..cluster.lease import Lease
from .model import ClusterModel
from .planner import plan

log = logging.getLogger("s3stream.balancer")

#: The balancer leader's lease (s3stream.cluster.lease): one leader acts at a time.
LEASE_KEY = "balancer/lease"
LAST_ROUND_KEY = "balancer/last_round"


def live_model(cluster: Cluster, config: BalancerConfig, excluded: Iterable[int] = (),
               now: float | None = None) -> ClusterModel:
    """The cluster as the balancer sees it now: assignments, live nodes and fresh reports."""
    assignment = {name: a["node"] for name, a in cluster.assignments().items()}
    return ClusterModel.from_reports(assignment, read_reports(cluster.meta), now=time.time() if now is None else now,
                                     live=cluster.live_nodes(), excluded=excluded, config=config)


class Balancer:
    """A balancer candidate for node `node_id` (any id unique among candidates). `start()` runs
    the loop on a thread of its own; `run_once()` runs one round in the caller's thread."""

    def __init__(self, cluster: Cluster, node_id: int, config: BalancerConfig | None = None, *,
                 excluded: Iterable[int] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.node_id = node_id
        self.config = config or BalancerConfig()
        self.excluded = set(excluded)
        self.clock = clock
        self.lease = Lease(cluster.meta, node_id, self.config.lease_ttl_s, key=LEASE_KEY, clock=cluster.clock)
        self.history: collections.deque[dict] = collections.deque(maxlen=1000)
        self.rounds = 0
        self.moves = 0
        self.errors: collections.deque[str] = collections.deque(maxlen=100)
        self._last_move = float("-inf")
        self._next_plan = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        return self.lease.token is not None

    # ---- the loop ------------------------------------------------------------------------------

    def start(self) -> "Balancer":
        self._thread = threading.Thread(target=self._run, name=f"balancer-{self.node_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        # A stop may come (a signal) between the thread's creation and its start.
        if self._thread is not None and self._thread.ident is not None:
            self._thread.join()
        try:
            self.lease.release()
        except S3StreamError as e:        # the successor waits for the expiry instead
            log.warning("balancer %d: releasing the lease failed: %s", self.node_id, e)

    def _run(self) -> None:
        tick = self.config.lease_ttl_s / 3
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception as e:  # noqa: BLE001 - reported; the next tick retries
                log.exception("balancer %d: round failed", self.node_id)
                self.errors.append(str(e))
            due = max(self._next_plan, self._last_move + self.config.settle_s) - self.clock()
            self._stop.wait(max(0.01, min(tick, due)) if self.is_leader else tick)

    def run_once(self, force: bool = False) -> list[dict]:
        """Renew or take the lease; if leading and a plan is due (or `force`), plan and execute.
        Returns the round's actions with their outcomes ([] when not leading or nothing is due)."""
        if not self.lease.acquire():
            return []
        now = self.clock()
        if not force and now < max(self._next_plan, self._last_move + self.config.settle_s):
            return []
        self._next_plan = now + self.config.loop_interval_s
        self.rounds += 1
        model = live_model(self.cluster, self.config, self.excluded)
        actions = plan(model, config=self.config)
        done = self._execute(model, actions)
        summary = {"leader": self.node_id, "epoch": self.lease.epoch, "at": time.time(), "actions": done}
        try:
            self.cluster.meta.put_kv(LAST_ROUND_KEY, json.dumps(summary).encode())
        except S3StreamError as e:
            log.warning("balancer %d: recording the round failed: %s", self.node_id, e)
        return done

    def _execute(self, model: ClusterModel, actions: list[Action]) -> list[dict]:
        done: list[dict] = []
        gap = 1.0 / self.config.action_rate_limit_per_s
        started = float("-inf")
        for action in actions:
            if self._stop.is_set():
                break
            wait = started + gap - self.clock()
            if wait > 0 and self._stop.wait(wait):
                break
            if not self.lease.acquire():                        # renewed before each move
                log.warning("balancer %d lost its lease: the round stops", self.node_id)
                break
            started = self.clock()
            entry = action_to_dict(action, model)
            log.info("balancer %d (epoch %d): %s", self.node_id, self.lease.epoch, explain_action(action, model))
            try:
                report = self.cluster.migrate(action.partition, action.dest, guard=self.lease.token)
                seconds, tail = report.seconds, report.tail_bytes
                self.moves += 1
                if action.swap is not None:
                    back = self.cluster.migrate(action.swap, action.source, guard=self.lease.token)
                    seconds, tail = seconds + back.seconds, tail + back.tail_bytes
                    self.moves += 1
                entry.update(outcome="moved", seconds=round(seconds, 4), tail_bytes=tail)
                self._last_move = self.clock()
            except FencedLeaderError as e:
                entry.update(outcome="fenced", error=str(e))
                log.warning("balancer %d: %s", self.node_id, e)
                done.append(entry)
                self.history.append(entry)
                break
            except S3StreamError as e:
                entry.update(outcome="failed", error=str(e))
                self.errors.append(str(e))
                log.warning("balancer %d: moving %s failed: %s", self.node_id, action.partition, e)
            entry["at"] = time.time()
            done.append(entry)
            self.history.append(entry)
        return done
