"""The planner: a bounded list of partition moves that brings a cluster model closer to its goals.

Article 001, 3.4 (a heuristic in the manner of Cruise Control): on a snapshot of the model, goals
are taken in priority order, hard goals first. While a goal is not met, it proposes moves; each
proposal is scored by every goal, and

- rejected if any hard goal scores it below 0.5 (veto), if its destination is dead, slow, excluded
  or without fresh metrics, if its partition already moved in this plan, if it changes too little
  on the proposing goal's resource, or if it lowers a goal optimised earlier in this plan below 0.5;
- otherwise ranked by the weighted mean of the soft goals' scores (article: since every score is
  normalised to [0, 1], a weighted sum compares them on one scale), the proposing goal's own score
  breaking ties. The proposing goal must score it above 0.5, and for a soft goal so must the
  weighted mean: the best such action is applied to the snapshot and recorded.

A goal's loop ends when the goal is met, when no proposal is acceptable, or at the plan's action
budget. The planner cannot oscillate within a plan: a moved partition is frozen, and every applied
action strictly raises the proposing goal's worst node score among the two nodes it touches. On a
model where every goal is met it plans nothing, so replanning the outcome of a converged plan is
empty.

Cost per step: is_met is O(nodes); proposals are O(nodes log nodes) to rank nodes plus a bisection
per (source, destination) pair in the model's sorted per-node index; each proposal is scored in
O(goals). Nothing is O(partitions x nodes).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from ..errors import ConfigError
from .action import NEUTRAL, Action
from .config import BalancerConfig
from .goals import Goal, default_goals
from .model import ClusterModel

__all__ = ["Action", "plan", "score_action"]

#: An action must beat 0.5 by more than float noise to count as an improvement.
SCORE_EPSILON = 1e-9


def plan(model: ClusterModel, goals: Sequence[Goal] | None = None,
         config: BalancerConfig | None = None) -> list[Action]:
    """Plan up to config.max_actions_per_plan moves for `model` (unchanged: the planner works on
    a snapshot). `goals` default to default_goals(config); hard goals are optimised first, then
    the soft ones, each group in the given order."""
    config = config or BalancerConfig()
    goals = default_goals(config) if goals is None else list(goals)
    names = [g.name for g in goals]
    if len(set(names)) != len(names):
        raise ConfigError(f"goal names must be unique, got {names}; give each goal once")
    ordered = [g for g in goals if g.hard] + [g for g in goals if not g.hard]
    snapshot = model.snapshot()
    moved: set[str] = set()
    optimized: list[Goal] = []
    actions: list[Action] = []
    for goal in ordered:
        while len(actions) < config.max_actions_per_plan and not goal.is_met(snapshot):
            best = _best_action(snapshot, goal, ordered, optimized, moved)
            if best is None:
                break
            snapshot.move(best.partition, best.dest)
            if best.swap is not None:
                snapshot.move(best.swap, best.source)
            moved.update(best.partitions)
            actions.append(best)
        optimized.append(goal)
    return actions


def score_action(model: ClusterModel, action: Action, goals: Sequence[Goal]) -> Action:
    """`action` with every goal's score and the soft goals' weighted score filled in (for
    explaining a move an operator proposes; no veto is applied here)."""
    scores = {g.name: g.action_score(model, action) for g in goals}
    return replace(action, scores=scores, score=_weighted(scores, [g for g in goals if not g.hard]))


def _weighted(scores: dict[str, float], soft: Sequence[Goal]) -> float:
    total = sum(g.weight for g in soft)
    if total <= 0:
        return NEUTRAL
    return sum(scores[g.name] * g.weight for g in soft) / total


def _best_action(model: ClusterModel, goal: Goal, goals: Sequence[Goal], optimized: Sequence[Goal],
                 moved: set[str]) -> Action | None:
    hard = [g for g in goals if g.hard]
    soft = [g for g in goals if not g.hard]
    optimized_names = [g.name for g in optimized]
    proposals: tuple[Callable[[], list[Action]], ...] = (
        lambda: goal.candidate_actions(model, frozen=moved, wide=False),
        lambda: goal.candidate_actions(model, frozen=moved, wide=True),
        # Last, where the goal has them: swaps, when no single move is acceptable.
        lambda: getattr(goal, "swap_candidates", lambda *a, **k: [])(model, frozen=moved))
    for propose in proposals:
        best: Action | None = None
        best_key = None
        seen: set[tuple[str, int, str | None]] = set()
        for candidate in propose():
            key = (candidate.partition, candidate.dest, candidate.swap)
            if key in seen or moved.intersection(candidate.partitions) or candidate.dest == candidate.source:
                continue
            seen.add(key)
            if model.partition(candidate.partition).node_id != candidate.source:
                continue
            if candidate.swap is not None and model.partition(candidate.swap).node_id != candidate.dest:
                continue
            if not model.node(candidate.dest).can_receive or goal.is_trivial(model, candidate):
                continue
            if candidate.swap is not None and not model.node(candidate.source).can_receive:
                continue
            scores: dict[str, float] = {}
            vetoed = False
            for g in hard:
                s = scores[g.name] = g.action_score(model, candidate)
                if s < NEUTRAL:
                    vetoed = True
                    break
            if vetoed:
                continue
            for g in soft:
                scores[g.name] = g.action_score(model, candidate)
            own = scores[goal.name]
            if own <= NEUTRAL + SCORE_EPSILON:
                continue
            if any(scores[name] < NEUTRAL for name in optimized_names):
                continue
            combined = _weighted(scores, soft)
            if not goal.hard and combined <= NEUTRAL + SCORE_EPSILON:
                continue
            rank = (combined, own)
            if best_key is None or rank > best_key:
                best_key = rank
                best = replace(candidate, scores=scores, score=combined, goal=goal.name,
                               load_change=goal.load_change(model, candidate))
        if best is not None:
            return best
    return None
