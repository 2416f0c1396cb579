"""AutoBalancer core (article 001): a cluster model, scoring goals and a planner of partition moves.

Pure logic, no I/O: nodes' metrics reports and the metadata's assignment go in
(`ClusterModel.from_reports`), a bounded list of `Action`s comes out (`plan`). Executing them
through migration, one batch per loop interval, under the balancer lease, is the caller's job.
"""
from __future__ import annotations

from .action import NEUTRAL, Action
from .config import BalancerConfig
from .explain import action_to_dict, explain_action
from .goals import (BytesInCap, BytesInDistribution, BytesOutCap, BytesOutDistribution, Goal, PartitionCountCap,
                    default_goals)
from .model import BYTES_IN, BYTES_OUT, PARTITIONS, ClusterModel, NodeLoad, NodeState, PartitionLoad
from .planner import plan, score_action

__all__ = [
    "NEUTRAL", "Action", "BalancerConfig", "action_to_dict", "explain_action",
    "BytesInCap", "BytesInDistribution", "BytesOutCap", "BytesOutDistribution", "Goal", "PartitionCountCap",
    "default_goals", "BYTES_IN", "BYTES_OUT", "PARTITIONS", "ClusterModel", "NodeLoad", "NodeState",
    "PartitionLoad", "plan", "score_action",
]
