"""The cluster layer's Prometheus metrics, added to every s3stream scrape of this process
(s3stream.metrics.add_process_source): migrations and failovers this process ran, and per node
agent its lease, health, heartbeats, failovers started and partitions it opened, closed or
handed on (docs/metrics.md)."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from ..metrics import Families, add_process_source
from .cluster import FAILOVER_SECONDS, MIGRATION_SECONDS

if TYPE_CHECKING:
    from .agent import NodeAgent

_agents: "weakref.WeakSet[NodeAgent]" = weakref.WeakSet()

#: NodeAgent.stats counters exported, with their help.
AGENT_COUNTERS = {
    "heartbeats": "Heartbeats the metadata store accepted (each renews the node's lease)",
    "heartbeat_failures": "Heartbeats that failed (the metadata store did not answer)",
    "failovers_started": "Failovers of silent peers this node's agent claimed and started",
    "opens": "Partitions this node's agent opened",
    "open_failures": "Opens of a partition that failed (retried; handed on after open_attempts)",
    "closes": "Partitions this node's agent closed (moved away)",
    "close_failures": "Closes that failed (the partition serves again; retried)",
    "handed_on": "Partitions this node could not open and assigned to another node, with the reason",
    "unexpected_errors": "Moves (opens, closes, failovers) that failed of an error no step raises on purpose: a bug "
                         "(logged with its traceback; retried)",
}

#: NodeAgent.hold.stats exported (s3stream.cluster.hold), with their help.
HOLD_COUNTERS = {
    "moves_held": "Moves (closes, opens) during which this node's partitions' appends waited for the move",
    "held_seconds": "Seconds moves held this node's appends (each at most move_hold, in all at most move_hold_share "
                    "of the time)",
    "appends_held": "Appends that waited for a move on their node",
    "append_hold_seconds": "Seconds appends waited for moves on their node, summed over the appends",
}


def track(agent: "NodeAgent") -> None:
    """Export `agent`'s metrics while it runs or its client (whose lease it keeps) is open."""
    _agents.add(agent)


def _collect(families: Families) -> None:
    families.histogram("migration_seconds", "Migrations this process ran (Cluster.migrate), assignment to open",
                       None, MIGRATION_SECONDS.snapshot())
    families.histogram("failover_seconds", "Failovers this process ran (Cluster.fail_over): fence, replay, close",
                       None, FAILOVER_SECONDS.snapshot())
    for agent in list(_agents):
        if agent.stopped and agent.client.closed:
            # Done, though not yet garbage collected: another agent of the same node id (a
            # restart, a later test) must not be shadowed by its last figures.
            continue
        node = str(agent.node_id)
        for name, doc in AGENT_COUNTERS.items():
            families.counter(f"agent_{name}_total", doc, node, agent.stats.get(name, 0))
        for name, doc in HOLD_COUNTERS.items():
            families.counter(f"agent_{name}_total", doc, node, agent.hold.stats[name])
        families.gauge("node_serving", "1 if the node's last heartbeat said it can serve, else 0", node,
                       1.0 if agent.last_health.get("serving", False) else 0.0)
        remaining = agent.client.lease_remaining
        families.gauge("lease_remaining_seconds", "Seconds left on the node's lease (negative: ran out)", node,
                       float("nan") if remaining is None else remaining)


add_process_source(_collect)
