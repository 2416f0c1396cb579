"""Failure detection that an outage of the metadata store cannot fool (docs/migration.md).

A judge (a node's agent) reads every node's heartbeat record now and then. A peer is silent
while its record stays the same; the judge counts that silence on its own monotonic clock, and
only over time during which the judge itself could read the store:

- two successful reads more than `max_credit` seconds apart count as an outage (below): the
  judge was paused, starved of CPU, or its read waited that long for the store (during an
  outage shorter than the pool's timeout reads do not fail, they wait: seen in the fault
  campaign, seed 40, where a judge's read blocked for 10 s and the silence its peer had before
  the outage was then charged on: the peer, still reconnecting, was failed over 0.3 s after
  the store came back); nearer reads count the time between them;
- a read that fails (the store is down, for the judge at least) resets every peer's silence:
  after an outage each node has a whole `timeout` to heartbeat again, so nobody is failed over
  because everyone's heartbeats went stale together;
- a new record (heartbeat, new epoch, failover flag) resets that peer's silence.

A peer whose silence reaches `timeout` is a suspect. Why this is safe with leases: the record a
judge last saw was written after its node started that renewal, so the node's lease ends less
than `lease` after the judge first saw it; the judge suspects it only `timeout` > lease later.
Pure logic: time comes from the caller, so tests and the simulation drive it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable


@dataclass
class _Peer:
    token: Hashable
    silent_ns: int = 0


class FailureDetector:
    """Silence of each peer, counted on the judge's clock only while the judge reads the store."""

    def __init__(self, timeout: float, max_credit: float) -> None:
        self.timeout_ns = int(timeout * 1e9)
        self.max_credit_ns = int(max_credit * 1e9)
        self._peers: dict[int, _Peer] = {}
        self._last_read_ns: int | None = None
        self.outages = 0            # failed reads and long gaps that reset every peer's silence

    def observe(self, now_ns: int, records: Iterable[tuple[int, Hashable]]) -> list[int]:
        """A successful read at `now_ns` of every node's (node id, record token); returns the
        ids whose silence reached the timeout (suspects), ascending."""
        credit = 0
        if self._last_read_ns is not None:
            gap = now_ns - self._last_read_ns
            if gap > self.max_credit_ns:
                self.unreachable()      # the judge did not see the store in between
            else:
                credit = max(0, gap)
        self._last_read_ns = now_ns
        seen: dict[int, _Peer] = {}
        for node_id, token in records:
            peer = self._peers.get(node_id)
            if peer is None or peer.token != token:
                seen[node_id] = _Peer(token)
            else:
                peer.silent_ns += credit
                seen[node_id] = peer
        self._peers = seen
        return sorted(n for n, p in seen.items() if p.silent_ns >= self.timeout_ns)

    def unreachable(self) -> None:
        """A read failed: the judge cannot tell silence from its own outage. Every peer's
        silence starts again from zero at the next successful read."""
        self.outages += 1
        self._last_read_ns = None
        for peer in self._peers.values():
            peer.silent_ns = 0

    def silence(self, node_id: int) -> float:
        """Seconds of counted silence of `node_id` (0 if unknown)."""
        peer = self._peers.get(node_id)
        return 0.0 if peer is None else peer.silent_ns / 1e9

    def forget(self, node_id: int) -> None:
        """Start `node_id`'s silence again (after failing it over, say)."""
        self._peers.pop(node_id, None)
