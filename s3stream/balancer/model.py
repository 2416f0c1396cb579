"""The balancer's cluster model: nodes, partitions and each node's aggregated load (article 001, 3.3).

The model mirrors the metadata's structure (which partition lives on which node, which nodes are
alive) and the loads the nodes report. A planner never works on the live model: it takes a
`snapshot()` (a cheap copy), tries moves on it, and the live model keeps taking updates meanwhile,
as AutoMQ's controller does.

Invariants kept by every mutation, each in O(1) (plus O(log n) + a memmove for the sorted indexes):
- `node_value(n, r)` is the sum of resource r over the partitions on n ("partitions" counts them);
- `mean(r)` is that sum over the *balanced* nodes (alive, not excluded, metrics fresh) divided by
  their number: moving a partition never rescans the cluster.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from ..errors import InvalidArgumentError
from .config import BalancerConfig

#: Traffic resources a partition reports, in bytes/s.
BYTES_IN = "bytes_in"
BYTES_OUT = "bytes_out"
#: The count of partitions on a node, handled like a resource where each partition weighs 1.
PARTITIONS = "partitions"
RESOURCES = (BYTES_IN, BYTES_OUT, PARTITIONS)


@dataclass(frozen=True)
class NodeState:
    """What the balancer knows about a node besides its load.

    alive: the node holds its lease; a dead node never receives a partition (failover handles it).
    slow: reported latencies above the configured thresholds (or an operator said so): keep what
        it has, receive nothing more (AutoMQ's slow-broker rule).
    excluded: an operator keeps the balancer from placing partitions here; moves off it are fine.
    metrics_stale: alive but no fresh metrics report: its load is unknown, so it is neither a
        destination (it would look empty and attract everything) nor part of the balanced mean.
    """
    node_id: int
    alive: bool = True
    slow: bool = False
    excluded: bool = False
    metrics_stale: bool = False

    @property
    def balanced(self) -> bool:
        """True if this node takes part in traffic balance (its load counts in the mean)."""
        return self.alive and not self.excluded and not self.metrics_stale

    @property
    def can_receive(self) -> bool:
        """True if the balancer may move a partition onto this node."""
        return self.balanced and not self.slow


@dataclass(frozen=True)
class PartitionLoad:
    """One partition, the node that serves it and its reported traffic (bytes/s)."""
    name: str
    node_id: int
    bytes_in_per_s: float = 0.0
    bytes_out_per_s: float = 0.0

    def value(self, resource: str) -> float:
        """This partition's share of `resource` (1 for PARTITIONS)."""
        if resource == BYTES_IN:
            return self.bytes_in_per_s
        if resource == BYTES_OUT:
            return self.bytes_out_per_s
        if resource == PARTITIONS:
            return 1.0
        raise InvalidArgumentError(f"unknown resource {resource!r}; use one of {RESOURCES}")


@dataclass(frozen=True)
class NodeLoad:
    """A node's aggregated load at one moment."""
    bytes_in_per_s: float
    bytes_out_per_s: float
    partition_count: int


class ClusterModel:
    """Nodes, partitions and per-node load, updated incrementally (see the module docstring)."""

    def __init__(self) -> None:
        self._nodes: dict[int, NodeState] = {}
        self._partitions: dict[str, PartitionLoad] = {}
        self._members: dict[int, set[str]] = {}
        self._load: dict[str, dict[int, float]] = {r: {} for r in RESOURCES}
        self._balanced_total: dict[str, float] = {r: 0.0 for r in RESOURCES}
        self._balanced_count = 0
        # resource -> node -> [(value, name)] ascending; built on first use, then kept up to date.
        self._sorted: dict[str, dict[int, list[tuple[float, str]]]] = {}
        #: Bumped by every change, so that callers can cache what they derive from a state.
        self.version = 0

    # ---- nodes ---------------------------------------------------------------------------------

    def add_node(self, node: NodeState | int) -> None:
        """Add a node (a NodeState, or an id for a healthy node) or replace its state."""
        state = node if isinstance(node, NodeState) else NodeState(int(node))
        self.version += 1
        old = self._nodes.get(state.node_id)
        if old is not None and old.balanced:
            self._count_balanced(state.node_id, -1)
        self._nodes[state.node_id] = state
        if old is None:
            self._members[state.node_id] = set()
            for r in RESOURCES:
                self._load[r][state.node_id] = 0.0
            for index in self._sorted.values():
                index[state.node_id] = []
        if state.balanced:
            self._count_balanced(state.node_id, +1)

    def set_node_state(self, node_id: int, **flags: bool) -> None:
        """Change some of a node's flags (alive, slow, excluded, metrics_stale)."""
        self.add_node(replace(self.node(node_id), **flags))

    def remove_node(self, node_id: int) -> None:
        """Forget a node. It must hold no partitions: move or remove them first."""
        state = self.node(node_id)
        if self._members[node_id]:
            raise InvalidArgumentError(f"node {node_id} still holds {len(self._members[node_id])} partitions; "
                                       f"move or remove them before removing the node")
        if state.balanced:
            self._count_balanced(node_id, -1)
        self.version += 1
        del self._nodes[node_id], self._members[node_id]
        for r in RESOURCES:
            del self._load[r][node_id]
        for index in self._sorted.values():
            del index[node_id]

    def node(self, node_id: int) -> NodeState:
        """The state of one node; InvalidArgumentError if unknown."""
        try:
            return self._nodes[node_id]
        except KeyError:
            raise InvalidArgumentError(f"unknown node {node_id!r}; add it with add_node first") from None

    def nodes(self) -> list[NodeState]:
        """All nodes, by id."""
        return [self._nodes[n] for n in sorted(self._nodes)]

    def node_ids(self) -> list[int]:
        """All node ids, ascending."""
        return sorted(self._nodes)

    # ---- partitions ----------------------------------------------------------------------------

    def add_partition(self, partition: PartitionLoad) -> None:
        """Add a partition on its node (which must exist)."""
        if partition.name in self._partitions:
            raise InvalidArgumentError(f"partition {partition.name!r} is already in the model; "
                                       f"use move() or update_load()")
        self.node(partition.node_id)
        _check_load(partition.name, partition.bytes_in_per_s, partition.bytes_out_per_s)
        self._partitions[partition.name] = partition
        self._attach(partition)

    def remove_partition(self, name: str) -> PartitionLoad:
        """Remove a partition (it was deleted) and return it."""
        partition = self.partition(name)
        self._detach(partition)
        del self._partitions[name]
        return partition

    def update_load(self, name: str, bytes_in_per_s: float, bytes_out_per_s: float) -> None:
        """Replace a partition's reported traffic."""
        _check_load(name, bytes_in_per_s, bytes_out_per_s)
        old = self.partition(name)
        new = replace(old, bytes_in_per_s=float(bytes_in_per_s), bytes_out_per_s=float(bytes_out_per_s))
        self._detach(old)
        self._partitions[name] = new
        self._attach(new)

    def move(self, name: str, to_node: int) -> PartitionLoad:
        """Move a partition to `to_node` (any known node: the planner, not the model, decides what
        is allowed) and return its previous placement."""
        old = self.partition(name)
        self.node(to_node)
        if old.node_id == to_node:
            return old
        self._detach(old)
        new = replace(old, node_id=to_node)
        self._partitions[name] = new
        self._attach(new)
        return old

    def partition(self, name: str) -> PartitionLoad:
        """One partition; InvalidArgumentError if unknown."""
        try:
            return self._partitions[name]
        except KeyError:
            raise InvalidArgumentError(f"unknown partition {name!r}") from None

    def partitions(self) -> list[PartitionLoad]:
        """All partitions, by name."""
        return [self._partitions[n] for n in sorted(self._partitions)]

    def partition_count(self) -> int:
        return len(self._partitions)

    def partitions_on(self, node_id: int) -> frozenset[str]:
        """Names of the partitions a node holds."""
        self.node(node_id)
        return frozenset(self._members[node_id])

    def assignment(self) -> dict[str, int]:
        """{partition: node id}, the shape the metadata uses."""
        return {name: p.node_id for name, p in self._partitions.items()}

    # ---- loads ---------------------------------------------------------------------------------

    def node_load(self, node_id: int) -> NodeLoad:
        """A node's aggregated load."""
        self.node(node_id)
        return NodeLoad(self._load[BYTES_IN][node_id], self._load[BYTES_OUT][node_id],
                        len(self._members[node_id]))

    def node_value(self, node_id: int, resource: str) -> float:
        """A node's aggregated `resource` (hot path of the goals: no checks beyond the lookup)."""
        return self._load[resource][node_id]

    def mean(self, resource: str) -> float:
        """Mean `resource` over the balanced nodes (0.0 when there are none)."""
        if self._balanced_count == 0:
            return 0.0
        return self._balanced_total[resource] / self._balanced_count

    def sorted_partitions(self, node_id: int, resource: str) -> list[tuple[float, str]]:
        """[(value, name)] of the node's partitions, ascending by `resource`. The list is the
        model's own index, kept sorted as partitions move: read it, do not change it."""
        index = self._sorted.get(resource)
        if index is None:
            index = {n: [] for n in self._nodes}
            for p in self._partitions.values():
                index[p.node_id].append((p.value(resource), p.name))
            for entries in index.values():
                entries.sort()
            self._sorted[resource] = index
        return index[node_id]

    def snapshot(self) -> ClusterModel:
        """A copy to plan on: O(partitions) shallow copies, no per-partition objects are made
        (node states and partition loads are immutable and shared)."""
        copy = ClusterModel.__new__(ClusterModel)
        copy._nodes = dict(self._nodes)
        copy._partitions = dict(self._partitions)
        copy._members = {n: set(m) for n, m in self._members.items()}
        copy._load = {r: dict(v) for r, v in self._load.items()}
        copy._balanced_total = dict(self._balanced_total)
        copy._balanced_count = self._balanced_count
        copy.version = 0
        copy._sorted = {r: {n: list(e) for n, e in index.items()} for r, index in self._sorted.items()}
        return copy

    # ---- building from the metadata and the nodes' reports -------------------------------------

    @classmethod
    def from_reports(cls, assignment: Mapping[str, int], reports: Iterable[Mapping], *, now: float,
                     live: Iterable[int], slow: Iterable[int] = (), excluded: Iterable[int] = (),
                     config: BalancerConfig | None = None, window: float | None = None) -> ClusterModel:
        """Build a model from the metadata's view and the nodes' metrics reports.

        assignment: {partition: node id}, from the metadata.
        live / slow / excluded: node ids that hold a lease / that an operator (or another
            detector) marked slow / that must not receive partitions. Nodes named only by the
            assignment are dead.
        reports: dicts {"node": id, "at": unix seconds, "partitions": {name: {"bytes_in": B/s,
            "bytes_out": B/s}}, "append_p99_ms": x, "fetch_p99_ms": y}. A report older than
            `window` seconds (default config.metrics_window_s) before `now` is ignored: the load
            it describes is history. A partition takes its load from the newest fresh report
            that names it (it may have moved since an older one); a partition no fresh report
            names gets zero load but stays in the model. A live node is slow when its newest
            fresh report's append or fetch p99 exceeds the configured threshold, and
            metrics_stale when it has no fresh report at all. Partitions that the assignment
            does not know (deleted since) are ignored.
        """
        config = config or BalancerConfig()
        window = config.metrics_window_s if window is None else window
        live, slow, excluded = set(live), set(slow), set(excluded)
        fresh = [r for r in reports if _report_time(r) >= now - window]
        fresh.sort(key=_report_time)  # oldest first: newer reports overwrite
        newest_by_node: dict[int, Mapping] = {}
        loads: dict[str, tuple[float, float]] = {}
        for report in fresh:
            node_id = _report_node(report)
            newest_by_node[node_id] = report
            for name, traffic in (report.get("partitions") or {}).items():
                if name in assignment:
                    loads[name] = _report_load(node_id, name, traffic)

        model = cls()
        for node_id in sorted(live | slow | excluded | set(assignment.values())):
            newest = newest_by_node.get(node_id)
            is_slow = node_id in slow or (newest is not None and (
                _latency(newest, "append_p99_ms") > config.slow_append_p99_ms
                or _latency(newest, "fetch_p99_ms") > config.slow_fetch_p99_ms))
            model.add_node(NodeState(node_id, alive=node_id in live, slow=is_slow, excluded=node_id in excluded,
                                     metrics_stale=node_id in live and newest is None))
        for name in sorted(assignment):
            bytes_in, bytes_out = loads.get(name, (0.0, 0.0))
            model.add_partition(PartitionLoad(name, assignment[name], bytes_in, bytes_out))
        return model

    # ---- internals -----------------------------------------------------------------------------

    def _count_balanced(self, node_id: int, sign: int) -> None:
        self._balanced_count += sign
        for r in RESOURCES:
            self._balanced_total[r] += sign * self._load[r][node_id]

    def _attach(self, p: PartitionLoad) -> None:
        self.version += 1
        self._members[p.node_id].add(p.name)
        balanced = self._nodes[p.node_id].balanced
        for r in RESOURCES:
            v = p.value(r)
            self._load[r][p.node_id] += v
            if balanced:
                self._balanced_total[r] += v
        for r, index in self._sorted.items():
            bisect.insort(index[p.node_id], (p.value(r), p.name))

    def _detach(self, p: PartitionLoad) -> None:
        self.version += 1
        self._members[p.node_id].discard(p.name)
        balanced = self._nodes[p.node_id].balanced
        for r in RESOURCES:
            v = p.value(r)
            # Sums of floats drift when terms are taken back out; an empty node is exactly 0.
            left = self._load[r][p.node_id] - v if self._members[p.node_id] else 0.0
            if balanced:
                self._balanced_total[r] += left - self._load[r][p.node_id]
            self._load[r][p.node_id] = left
        for r, index in self._sorted.items():
            entries = index[p.node_id]
            key = (p.value(r), p.name)
            i = bisect.bisect_left(entries, key)
            if i < len(entries) and entries[i] == key:
                del entries[i]


def _check_load(name: str, bytes_in: float, bytes_out: float) -> None:
    for label, v in (("bytes_in_per_s", bytes_in), ("bytes_out_per_s", bytes_out)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise InvalidArgumentError(f"partition {name!r}: {label} must be a finite number >= 0, got {v!r}")


def _report_time(report: Mapping) -> float:
    at = report.get("at")
    if isinstance(at, bool) or not isinstance(at, (int, float)):
        raise InvalidArgumentError(f"metrics report needs a numeric 'at' (unix seconds), got {at!r}: {report!r:.200}")
    return float(at)


def _report_node(report: Mapping) -> int:
    node = report.get("node")
    if isinstance(node, bool) or not isinstance(node, int):
        raise InvalidArgumentError(f"metrics report needs an integer 'node', got {node!r}: {report!r:.200}")
    return node


def _report_load(node_id: int, name: str, traffic: Mapping) -> tuple[float, float]:
    try:
        bytes_in = float(traffic.get("bytes_in", 0.0))
        bytes_out = float(traffic.get("bytes_out", 0.0))
    except (TypeError, ValueError, AttributeError):
        raise InvalidArgumentError(f"metrics report of node {node_id}: partition {name!r} needs numeric "
                                   f"'bytes_in'/'bytes_out', got {traffic!r}") from None
    _check_load(name, bytes_in, bytes_out)
    return bytes_in, bytes_out


def _latency(report: Mapping, key: str) -> float:
    value = report.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"metrics report of node {report.get('node')}: {key} must be a number, got {value!r}")
    return float(value)


def imbalance(model: ClusterModel, resource: str = BYTES_IN) -> float:
    """Max node load / mean node load over the balanced nodes (1.0 is perfect)."""
    mean = model.mean(resource)
    if mean <= 0:
        return 1.0
    return max(model.node_value(n.node_id, resource) for n in model.nodes() if n.balanced) / mean
