"""An action: move one partition from one node to another, with the scores that justified it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

#: An action's score for a goal it does not affect (article 001, 3.4.2): below it the action makes
#: the goal worse, above it better.
NEUTRAL = 0.5


@dataclass(frozen=True)
class Action:
    """Move `partition` from node `source` to node `dest`.

    A swap (`swap` set) also moves partition `swap` from `dest` back to `source`: what a single
    move cannot do when every partition of the loaded node is larger than the room on the
    others (a node holding two hot partitions): goals judge it by the net load it shifts.

    A goal proposes an action with empty `scores`; the planner fills in every goal's score in
    [0, 1] (0.5 neutral), the weighted score of the soft goals (`score`), the goal that proposed
    it (`goal`) and `load_change`: what the move shifts on that goal's resource (bytes/s for the
    traffic goals, 1 for the partition-count cap).
    """
    partition: str
    source: int
    dest: int
    scores: Mapping[str, float] = field(default_factory=dict, hash=False)
    load_change: float = 0.0
    goal: str = ""
    score: float = NEUTRAL
    swap: str | None = None

    @property
    def partitions(self) -> tuple[str, ...]:
        return (self.partition,) if self.swap is None else (self.partition, self.swap)
