"""Thresholds of the AutoBalancer, with the reasoning behind each default, checked when created.

Defaults come from article 001 (AutoMQ's AutoBalancer) where it names a number, otherwise from
AutoMQ's controller configuration (`AutoBalancerControllerConfig`, `AutoMQConfig`) at the time of
writing; the few that neither gives are ours and say so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


@dataclass(frozen=True)
class BalancerConfig:
    """Everything the balancer's goals, planner and loop need to know, in bytes/s and seconds.

    Soft goals (traffic balance, article 3.4.1):
    bytes_in_detect_threshold / bytes_out_detect_threshold: while the cluster's mean node traffic is
        below this, a node below it is taken as balanced (the goal is ignored): at low traffic the
        measurement error is large and balancing buys nothing. AutoMQ: 1 MiB/s each.
    bytes_in_deviation_ratio / bytes_out_deviation_ratio: a node is balanced when its traffic is in
        [mean * (1 - ratio), mean * (1 + ratio)]. AutoMQ's code default is 0.1; its doc string
        still says 0.2 (the value of earlier releases). We follow the code: 0.1.
    distribution_linear_range: bytes/s of deviation beyond the band over which a node's score falls
        linearly from 1.0 to 0.1, before it decays logarithmically towards 0 (the article's `var`).
        AutoMQ uses the node's network baseline bandwidth, 1 GiB/s by default; ours is 0, which
        stands for the mean node traffic (scale-free: scores of nodes carrying KiB/s or GiB/s
        alike say how far out of the band they are; see goals._Distribution).
    bytes_in_weight / bytes_out_weight: weights of the two soft goals in an action's combined score
        (article: weighted sum of normalised scores). AutoMQ: 1.0 each.
    min_action_load_ratio: a move whose traffic change on the goal's resource is below this fraction
        of the mean node traffic is not worth its cost (each move closes and reopens a partition).
        AutoMQ's "trivial change ratio" is 0.05, but it judges the sum of all moves off one broker;
        we judge each move, where any such floor strands load: a node made of many small
        partitions (10,000 Zipf partitions on 100 nodes: a 2x-loaded node held 356 partitions of
        < 1 % of the mean each) could never be brought back into the band. Ours: 0.001, which
        skips only near-idle partitions.

    Hard goals (caps, article 3.4.2: an action a hard goal scores below 0.5 is rejected):
    partition_count_cap: most partitions one node may hold. Neither the article nor AutoMQ gives
        one; 4000 is the per-broker figure commonly quoted for Apache Kafka.
    bytes_in_cap_per_node / bytes_out_cap_per_node: most traffic one node may carry. AutoMQ's
        (earlier) capacity goals allowed 80 % of a broker's network capacity; with its default
        baseline bandwidth of 1 GiB/s that is 0.8 GiB/s.

    Planner and loop:
    max_actions_per_plan: moves in one plan (one executed batch). AutoMQ: execution concurrency 50.
    action_rate_limit_per_s: moves per second the executor may start. AutoMQ runs a batch of 50
        every 5 s: 10 moves/s.
    loop_interval_s: seconds between two balancing rounds. AutoMQ: anomaly detect interval 60 s.
    metrics_window_s: metrics reports older than this are ignored (a node without a fresh report
        has unknown load). AutoMQ: accepted metrics delay 1 min.
    settle_s: seconds after a round that moved partitions before the next plan, so that the
        nodes' reports describe the new placement (a moved partition's rate restarts on its new
        node). Ours: 10 s, a report window.
    lease_ttl_s: the balancer's lease lasts this long unless renewed (every third of it): the
        longest a dead leader delays its successor. Ours: 15 s.
    slow_append_p99_ms / slow_fetch_p99_ms: a node whose reported append / fetch p99 latency
        exceeds this is slow and receives no partitions. AutoMQ flags a broker slow when its
        pending append or fetch latency passes 10 s (`AbnormalLatency(10000)`).
    """

    bytes_in_detect_threshold: float = 1 * MiB
    bytes_out_detect_threshold: float = 1 * MiB
    bytes_in_deviation_ratio: float = 0.1
    bytes_out_deviation_ratio: float = 0.1
    distribution_linear_range: float = 0.0
    bytes_in_weight: float = 1.0
    bytes_out_weight: float = 1.0
    min_action_load_ratio: float = 0.001

    partition_count_cap: int = 4000
    bytes_in_cap_per_node: float = 0.8 * GiB
    bytes_out_cap_per_node: float = 0.8 * GiB

    max_actions_per_plan: int = 50
    action_rate_limit_per_s: float = 10.0
    loop_interval_s: float = 60.0
    metrics_window_s: float = 60.0
    settle_s: float = 10.0
    lease_ttl_s: float = 15.0
    slow_append_p99_ms: float = 10_000.0
    slow_fetch_p99_ms: float = 10_000.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"BalancerConfig.{f.name} must be a finite number, got {value!r}; "
                                  f"pass e.g. {f.default!r}")
        for name in ("partition_count_cap", "max_actions_per_plan"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"BalancerConfig.{name} must be a positive integer, got {value!r}; "
                                  f"pass e.g. {_default(name)!r}")
        for name in ("bytes_in_deviation_ratio", "bytes_out_deviation_ratio"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise ConfigError(f"BalancerConfig.{name} must be a fraction strictly between 0 and 1 (the "
                                  f"allowed deviation around the mean), got {value!r}; AutoMQ uses 0.1")
        if not 0.0 <= self.min_action_load_ratio < 1.0:
            raise ConfigError(f"BalancerConfig.min_action_load_ratio must be in [0, 1) (a fraction of the mean "
                              f"node traffic), got {self.min_action_load_ratio!r}; pass e.g. 0.001")
        for name in ("bytes_in_detect_threshold", "bytes_out_detect_threshold"):
            if getattr(self, name) < 0:
                raise ConfigError(f"BalancerConfig.{name} must be >= 0 bytes/s (0 balances any traffic), "
                                  f"got {getattr(self, name)!r}")
        # The logarithmic tail of the broker score divides by log(band + range): it must exceed 1.
        if self.distribution_linear_range != 0 and self.distribution_linear_range < 1.0:
            raise ConfigError(f"BalancerConfig.distribution_linear_range must be 0 (the mean node traffic) or at "
                              f"least 1 byte/s, got {self.distribution_linear_range!r}; AutoMQ uses the network "
                              f"baseline, 1 GiB/s")
        for name in ("bytes_in_weight", "bytes_out_weight"):
            if getattr(self, name) < 0:
                raise ConfigError(f"BalancerConfig.{name} must be >= 0 (0 disables the goal's vote), "
                                  f"got {getattr(self, name)!r}")
        for name in ("bytes_in_cap_per_node", "bytes_out_cap_per_node", "action_rate_limit_per_s",
                     "loop_interval_s", "metrics_window_s", "settle_s", "lease_ttl_s", "slow_append_p99_ms",
                     "slow_fetch_p99_ms"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"BalancerConfig.{name} must be > 0, got {getattr(self, name)!r}; "
                                  f"pass e.g. {_default(name)!r}")


def _default(name: str):
    return next(f.default for f in fields(BalancerConfig) if f.name == name)
