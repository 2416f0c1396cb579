"""Balancing goals: how good a node is for a goal, and how much a move helps or hurts it.

Article 001, section 3.4. A goal answers two questions: does a node satisfy me (`is_met`), and is a
move acceptable. A yes/no answer per node is not enough to judge a move (the article's 16 state
transitions: {false, false} => {false, false} may be an improvement or not), so each goal scores
a node in [0, 1] (`broker_score`) and derives a move's score from the scores of the two nodes
involved, before and after the move (`action_score`):

    delta        = min(score(src_after), score(dest_after)) - min(score(src_before), score(dest_before))
    action_score = (delta + 1) / 2                      # delta in [-1, 1] mapped linearly onto [0, 1]

so 0.5 means "no effect", above 0.5 "better", below 0.5 "worse" (AutoMQ: AbstractGoal.scoreDelta
with GoalUtils.linearNormalization(delta, 1, -1)). Taking the minimum judges a move by the worse
of its two nodes: moving load from a node above the band to one below it raises the minimum;
the reverse lowers it.

A hard goal (a cap) vetoes: a move that takes a node from acceptable to unacceptable scores 0.0,
and so does one that leaves a violating node violating without improving it (AutoMQ:
calculateAcceptanceScore). The planner rejects every action a hard goal scores below 0.5.

Each goal can also propose the moves that would fix it (`candidate_actions`). Proposals are few
and targeted (the most loaded sources, the least loaded destinations, for each pair the
partitions whose size best fits the gap, found by bisection in the model's sorted index): the
planner scores every proposal against every goal, so the proposal set bounds its cost per step.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Collection

from .action import NEUTRAL, Action
from .config import BalancerConfig
from .model import BYTES_IN, BYTES_OUT, PARTITIONS, ClusterModel

# Proposal breadth: (sources, destinations, partitions per source/destination pair). The planner
# asks for the narrow set first and for the wide one only when nothing in the narrow set is
# acceptable, so the usual step costs ~2*4*3 scorings.
_NARROW = (2, 4, 3)
_WIDE = (8, 16, 6)


def normalize_delta(before: float, after: float) -> float:
    """Map a change of score in [-1, 1] onto [0, 1], 0.5 for no change (article: normalised
    score difference; AutoMQ GoalUtils.linearNormalization(after - before, max=1, min=-1))."""
    return (after - before + 1.0) / 2.0


class Goal:
    """One balancing goal. Subclasses set `name`, `hard`, `weight` and `resource` and implement
    the three value hooks; everything else is shared.

    Hooks, all on a hypothetical value of the goal's resource for one node, so that before/after
    scores are computed without changing the model:
    _context(model): constants of one model state (mean, bounds), cached per model version.
    _value_score(ctx, value): the node score in [0, 1].
    _value_acceptable(ctx, value): does a node with this value satisfy the goal.
    _participates(model, node_id): is the node judged by this goal at all.

    Because of that cache a goal instance belongs to one planning thread at a time (the balancer
    plans on the one node holding its lease).
    """

    name: str = "goal"
    hard: bool = False
    weight: float = 1.0
    resource: str = BYTES_IN

    # ---- hooks ---------------------------------------------------------------------------------

    def _context(self, model: ClusterModel):
        return None

    def _cached_context(self, model: ClusterModel):
        # The planner scores dozens of moves per model state: compute the mean and bounds once.
        key = (model, model.version)
        if getattr(self, "_context_key", None) != key:
            self._context_key = key
            self._context_value = self._context(model)
        return self._context_value

    def _value_score(self, ctx, value: float) -> float:
        raise NotImplementedError

    def _value_acceptable(self, ctx, value: float) -> bool:
        raise NotImplementedError

    def _participates(self, model: ClusterModel, node_id: int) -> bool:
        return model.node(node_id).alive

    # ---- shared --------------------------------------------------------------------------------

    def broker_score(self, model: ClusterModel, node_id: int) -> float:
        """The node's score for this goal in [0, 1]; 1.0 for a node this goal does not judge."""
        if not self._participates(model, node_id):
            return 1.0
        return self._value_score(self._context(model), model.node_value(node_id, self.resource))

    def node_acceptable(self, model: ClusterModel, node_id: int) -> bool:
        """True if the node satisfies this goal (or is not judged by it)."""
        if not self._participates(model, node_id):
            return True
        return self._value_acceptable(self._context(model), model.node_value(node_id, self.resource))

    def is_met(self, model: ClusterModel) -> bool:
        """True if every node this goal judges satisfies it."""
        ctx = self._cached_context(model)
        value = self._value_acceptable
        return all(value(ctx, model.node_value(n, self.resource))
                   for n in model.node_ids() if self._participates(model, n))

    def load_change(self, model: ClusterModel, action: Action) -> float:
        """What the move shifts on this goal's resource from source to dest (1 for the partition
        count); a swap shifts the difference of its two partitions."""
        value = model.partition(action.partition).value(self.resource)
        if action.swap is not None:
            value -= model.partition(action.swap).value(self.resource)
        return value

    def is_trivial(self, model: ClusterModel, action: Action) -> bool:
        """True if the move changes too little to be worth doing for this goal."""
        return False

    def action_score(self, model: ClusterModel, action: Action) -> float:
        """The move's score for this goal in [0, 1], 0.5 neutral (module docstring formula).

        Only nodes this goal judges enter the minimum (a move off a dead or excluded node is
        scored by its destination alone); a move that changes nothing for the goal is 0.5.
        """
        delta = self.load_change(model, action)
        if delta == 0.0 or action.source == action.dest:
            return NEUTRAL
        ctx = self._cached_context(model)
        score, resource = self._value_score, self.resource
        sides = []
        if self._participates(model, action.source):
            before = model.node_value(action.source, resource)
            sides.append((before, max(0.0, before - delta)))
        if self._participates(model, action.dest):
            before = model.node_value(action.dest, resource)
            sides.append((before, before + delta))
        if not sides:
            return NEUTRAL
        if len(sides) == 2:
            (b1, a1), (b2, a2) = sides
            result = normalize_delta(min(score(ctx, b1), score(ctx, b2)), min(score(ctx, a1), score(ctx, a2)))
        else:
            result = normalize_delta(score(ctx, sides[0][0]), score(ctx, sides[0][1]))
        if self.hard:
            acceptable = self._value_acceptable
            for before, after in sides:
                ok_before, ok_after = acceptable(ctx, before), acceptable(ctx, after)
                if ok_before and not ok_after:
                    return 0.0  # the article's true => false transition: rejected outright
                if not ok_before and not ok_after and result < NEUTRAL:
                    return 0.0
        return result

    def candidate_actions(self, model: ClusterModel, frozen: Collection[str] = (),
                          wide: bool = False) -> list[Action]:
        """Moves that would bring this goal closer to met, none of a partition in `frozen` and
        none onto a node that cannot receive. Empty when the goal is met. `wide` proposes more
        (more sources, destinations and partitions per pair) for when the narrow set fails."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(weight={self.weight})"


# ---- hard goals: caps -------------------------------------------------------------------------


class _Cap(Goal):
    """A hard cap on a node's resource.

    broker_score(value) = 1.0                 if value <= cap
                        = cap / value         otherwise (falls towards 0 as the excess grows)

    The score is flat under the cap on purpose: a cap says nothing about nodes below it, so a
    move between two nodes that both stay under the cap is neutral (0.5) and never vetoed. (AutoMQ's
    earlier capacity goals scored spare capacity, 1 - utilisation, everywhere; with a veto at
    < 0.5 that would forbid every move towards a busier node, even one far below the cap.)
    Judged nodes: alive ones (a dead node serves nothing), including slow and excluded ones, whose
    excess is real.
    """

    hard = True
    weight = 1.0
    cap: float

    def _value_score(self, ctx, value: float) -> float:
        return 1.0 if value <= self.cap else self.cap / value

    def _value_acceptable(self, ctx, value: float) -> bool:
        return value <= self.cap

    def _sources(self, model: ClusterModel, count: int) -> list[int]:
        over = [n for n in model.node_ids()
                if self._participates(model, n) and model.node_value(n, self.resource) > self.cap]
        over.sort(key=lambda n: -model.node_value(n, self.resource))
        return over[:count]

    def _dests(self, model: ClusterModel, count: int, resource: str) -> list[int]:
        receivers = [n.node_id for n in model.nodes() if n.can_receive]
        receivers.sort(key=lambda n: model.node_value(n, resource))
        return receivers[:count]


@dataclass(repr=False, eq=False)
class PartitionCountCap(_Cap):
    """Hard: no node holds more than `cap` partitions. Moves the partitions with the least
    traffic off a node above the cap (they disturb traffic balance least), to the nodes with
    the fewest partitions or the least traffic."""

    cap: int
    name = "partition_count_cap"
    resource = PARTITIONS

    def candidate_actions(self, model: ClusterModel, frozen: Collection[str] = (),
                          wide: bool = False) -> list[Action]:
        n_src, n_dest, n_part = _WIDE if wide else _NARROW
        sources = self._sources(model, n_src)
        if not sources:
            return []
        dests = _unique(self._dests(model, n_dest, PARTITIONS) + self._dests(model, n_dest, BYTES_IN))
        out: list[Action] = []
        for src in sources:
            picks = _unique(_smallest(model.sorted_partitions(src, BYTES_IN), frozen, n_part)
                            + _smallest(model.sorted_partitions(src, BYTES_OUT), frozen, n_part))
            out.extend(Action(name, src, dest) for name in picks for dest in dests
                       if dest != src and model.node_value(dest, PARTITIONS) + 1 <= self.cap)
        return out


class _TrafficCap(_Cap):
    def candidate_actions(self, model: ClusterModel, frozen: Collection[str] = (),
                          wide: bool = False) -> list[Action]:
        n_src, n_dest, n_part = _WIDE if wide else _NARROW
        sources = self._sources(model, n_src)
        if not sources:
            return []
        dests = self._dests(model, n_dest, self.resource)
        out: list[Action] = []
        for src in sources:
            entries = model.sorted_partitions(src, self.resource)
            excess = model.node_value(src, self.resource) - self.cap
            for dest in dests:
                room = self.cap - model.node_value(dest, self.resource)
                if dest == src or room <= 0:
                    continue
                # The smallest partition that clears the excess in one move, and the largest
                # ones that fit the destination's room: either fixes the most per move.
                picks = _around(entries, excess, frozen, n_part, upper=room)
                picks += _around(entries, room, frozen, n_part, upper=room)
                out.extend(Action(name, src, dest) for name in _unique(picks))
        return out


@dataclass(repr=False, eq=False)
class BytesInCap(_TrafficCap):
    """Hard: no node's inbound traffic exceeds `cap` bytes/s."""

    cap: float
    name = "bytes_in_cap"
    resource = BYTES_IN


@dataclass(repr=False, eq=False)
class BytesOutCap(_TrafficCap):
    """Hard: no node's outbound traffic exceeds `cap` bytes/s."""

    cap: float
    name = "bytes_out_cap"
    resource = BYTES_OUT


# ---- soft goals: traffic distribution ---------------------------------------------------------


@dataclass(frozen=True)
class _Band:
    mean: float
    lower: float
    upper: float
    deviation: float  # mean * ratio: half the band's width


class _Distribution(Goal):
    """Soft: every balanced node's traffic within [mean * (1 - ratio), mean * (1 + ratio)].

    Article 3.4.1: the expected range is load_avg * (1 +- ratio); a node is also satisfied when the
    cluster's mean and its own traffic are below the detect threshold (little traffic, large
    measurement error, nothing to gain). Article 3.4.2 ("broker score for a single goal") and
    AutoMQ's AbstractResourceUsageDistributionGoal give the node score, a step function of
    ua = |load - mean|, with bound = mean * ratio and var = bound + linear_range:

        score = 1.0                                    if ua <= bound (or under the threshold)
              = 1 - 0.9 * (ua - bound) / linear_range  if bound < ua <= var   (linear, 1 -> 0.1)
              = 0.1 * ln(var) / ln(ua)                 if ua > var            (log, 0.1 -> 0)

    (AutoMQ: 1 - StepNormalizer(min=bound, step=var, stepValue=0.9).normalize(ua).) Within the
    band the score is flat, so moves between balanced nodes are neutral; outside it every byte of
    deviation costs, so a move that narrows the gap between an overloaded and an underloaded node
    scores above 0.5 even when neither reaches the band (the article's {false,false} =>
    {false,false} example), and the reverse move scores below 0.5.

    linear_range 0 (the default) stands for the mean itself: a node one mean beyond the band
    scores 0.1, at any scale. AutoMQ's absolute 1 GiB/s (a broker's baseline bandwidth) makes the
    scores of nodes carrying MiB/s differ only in the fifth decimal, which ranks moves alike but
    explains nothing; relative to the mean, an action's score says how much it helps.

    Judged nodes: the balanced ones (alive, not excluded, metrics fresh); the mean is over them.
    """

    hard = False
    deviation_ratio: float
    detect_threshold: float
    linear_range: float
    min_action_load_ratio: float
    weight: float

    def _participates(self, model: ClusterModel, node_id: int) -> bool:
        return model.node(node_id).balanced

    def _context(self, model: ClusterModel) -> _Band:
        mean = model.mean(self.resource)
        deviation = mean * self.deviation_ratio
        return _Band(mean, max(0.0, mean - deviation), mean + deviation, deviation)

    def _ignored(self, band: _Band, value: float) -> bool:
        return band.mean < self.detect_threshold and value < self.detect_threshold

    def _value_score(self, band: _Band, value: float) -> float:
        if self._ignored(band, value):
            return 1.0
        ua = abs(value - band.mean)
        if ua <= band.deviation:
            return 1.0
        span = self.linear_range or max(band.mean, 2.0)
        var = band.deviation + span
        if ua <= var:
            return 1.0 - 0.9 * (ua - band.deviation) / span
        return 0.1 * math.log(var) / math.log(ua)

    def _value_acceptable(self, band: _Band, value: float) -> bool:
        return self._ignored(band, value) or band.lower <= value <= band.upper

    def band(self, model: ClusterModel) -> tuple[float, float, float]:
        """(mean, lower bound, upper bound) of this goal's resource on the model."""
        b = self._context(model)
        return b.mean, b.lower, b.upper

    def is_trivial(self, model: ClusterModel, action: Action) -> bool:
        """A move of less than min_action_load_ratio * mean is not worth its cost."""
        return self.load_change(model, action) < self.min_action_load_ratio * model.mean(self.resource)

    def candidate_actions(self, model: ClusterModel, frozen: Collection[str] = (),
                          wide: bool = False) -> list[Action]:
        """Sources: the nodes above the upper bound, most loaded first (if none, the most loaded
        nodes, to feed nodes below the lower bound). Destinations: the least loaded nodes that can
        receive. For each pair whose gap is g, the partitions around g / 2 (the move that evens
        the pair) that are smaller than g (anything larger makes the pair more uneven)."""
        band = self._context(model)
        n_src, n_dest, n_part = _WIDE if wide else _NARROW
        judged = [n for n in model.nodes() if n.balanced]
        value = {n.node_id: model.node_value(n.node_id, self.resource) for n in judged}
        unmet = [n for n in judged if not self._value_acceptable(band, value[n.node_id])]
        if not unmet:
            return []
        by_load = sorted(judged, key=lambda n: -value[n.node_id])
        over = [n.node_id for n in by_load if value[n.node_id] > band.upper]
        sources = (over or [n.node_id for n in by_load])[:n_src]
        dests = [n.node_id for n in reversed(by_load) if n.can_receive][:n_dest]
        floor = self.min_action_load_ratio * band.mean
        out: list[Action] = []
        for src in sources:
            entries = model.sorted_partitions(src, self.resource)
            for dest in dests:
                gap = value[src] - value[dest]
                if dest == src or gap <= 0:
                    continue
                # Prefer partitions that fit the destination's room below the upper bound: a
                # move that overshoots it is often still an improvement (the source was worse),
                # but leaves a node to fix later, maybe with partitions frozen by this plan.
                room = band.upper - value[dest]
                picks = []
                if room > floor:
                    picks = _around(entries, min(gap, room) / 2.0 if wide else min(gap / 2.0, room), frozen,
                                    n_part, upper=min(gap, room), lower=max(floor, 1e-300))
                if wide or not picks:
                    picks += _around(entries, gap / 2.0, frozen, n_part, upper=gap, lower=max(floor, 1e-300))
                out.extend(Action(name, src, dest) for name in _unique(picks))
        return out


    def swap_candidates(self, model: ClusterModel, frozen: Collection[str] = ()) -> list[Action]:
        """Swaps for when no single move is acceptable: for the most loaded nodes above the band
        and the least loaded nodes, exchange a partition p of the source for a smaller q of the
        destination so that the source sheds about what puts both in the band: p - q near
        min(source - mean, upper - dest). For each p (the source's largest few), the q nearest
        p - that target is found by bisection in the destination's sorted index."""
        band = self._context(model)
        judged = [n for n in model.nodes() if n.balanced]
        value = {n.node_id: model.node_value(n.node_id, self.resource) for n in judged}
        over = sorted((n for n in value if value[n] > band.upper), key=lambda n: -value[n])[:_WIDE[0]]
        dests = sorted((n.node_id for n in judged if n.can_receive), key=lambda n: value[n])[:_WIDE[1]]
        out = []
        for src in over:
            mine = [(v, name) for v, name in reversed(model.sorted_partitions(src, self.resource))
                    if name not in frozen][:2 * _WIDE[2]]
            for dest in dests:
                want = min(value[src] - band.mean, band.upper - value[dest])
                if dest == src or want <= 0:
                    continue
                theirs = model.sorted_partitions(dest, self.resource)
                for v, name in mine:
                    # q in [v - (value[src] - value[dest]), v): the pair ends no further apart
                    for q in _around(theirs, v - want, frozen, 2, upper=v, lower=v - (value[src] - value[dest])):
                        out.append(Action(name, src, dest, swap=q))
        return out


@dataclass(repr=False, eq=False)
class BytesInDistribution(_Distribution):
    """Soft: inbound traffic balanced within +-deviation_ratio of the mean (see _Distribution)."""

    deviation_ratio: float
    detect_threshold: float
    linear_range: float
    min_action_load_ratio: float
    weight: float = 1.0
    name = "bytes_in_distribution"
    resource = BYTES_IN


@dataclass(repr=False, eq=False)
class BytesOutDistribution(_Distribution):
    """Soft: outbound traffic balanced within +-deviation_ratio of the mean (see _Distribution)."""

    deviation_ratio: float
    detect_threshold: float
    linear_range: float
    min_action_load_ratio: float
    weight: float = 1.0
    name = "bytes_out_distribution"
    resource = BYTES_OUT


def default_goals(config: BalancerConfig | None = None) -> list[Goal]:
    """The goals in priority order: the hard caps, then inbound and outbound traffic balance."""
    c = config or BalancerConfig()
    return [
        PartitionCountCap(c.partition_count_cap),
        BytesInCap(c.bytes_in_cap_per_node),
        BytesOutCap(c.bytes_out_cap_per_node),
        BytesInDistribution(c.bytes_in_deviation_ratio, c.bytes_in_detect_threshold, c.distribution_linear_range,
                            c.min_action_load_ratio, c.bytes_in_weight),
        BytesOutDistribution(c.bytes_out_deviation_ratio, c.bytes_out_detect_threshold, c.distribution_linear_range,
                             c.min_action_load_ratio, c.bytes_out_weight),
    ]


# ---- proposal helpers -------------------------------------------------------------------------


def _unique(items: list) -> list:
    return list(dict.fromkeys(items))


def _smallest(entries: list[tuple[float, str]], frozen: Collection[str], count: int) -> list[str]:
    out = []
    for _, name in entries:
        if name not in frozen:
            out.append(name)
            if len(out) == count:
                break
    return out


def _around(entries: list[tuple[float, str]], target: float, frozen: Collection[str], count: int,
            upper: float, lower: float = 0.0) -> list[str]:
    """Up to `count` partition names whose values are nearest `target` (from both sides), with
    lower <= value <= upper, skipping frozen ones. O(log n + count) unless many neighbours are
    frozen."""
    i = bisect.bisect_left(entries, (target,))
    below, above = i - 1, i
    out: list[str] = []
    budget = 4 * count + 16  # frozen neighbours are skipped, but not without bound
    while len(out) < count and budget > 0 and (below >= 0 or above < len(entries)):
        budget -= 1
        take_below = below >= 0 and (above >= len(entries)
                                     or target - entries[below][0] <= entries[above][0] - target)
        if take_below:
            v, name = entries[below]
            below -= 1
            if v < lower:
                below = -1  # everything further down is smaller still
                continue
        else:
            v, name = entries[above]
            above += 1
            if v > upper:
                above = len(entries)
                continue
        if name not in frozen and lower <= v <= upper:
            out.append(name)
    return out
