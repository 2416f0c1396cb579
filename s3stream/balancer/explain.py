"""Actions as one readable line (logs) and as a JSON-able dict (`s3stream balance plan`)."""
from __future__ import annotations

from .action import Action
from .goals import PartitionCountCap
from .model import BYTES_IN, BYTES_OUT, ClusterModel

_UNITS = ((1 << 30, "GiB/s"), (1 << 20, "MiB/s"), (1 << 10, "KiB/s"))


def format_rate(bytes_per_s: float) -> str:
    """12.5 MiB/s, 512 B/s."""
    for size, unit in _UNITS:
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.1f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def action_to_dict(action: Action, model: ClusterModel | None = None) -> dict:
    """The action as plain JSON types. With the model it was planned on (before the move),
    the partition's traffic is included too."""
    out = {
        "partition": action.partition,
        "source": action.source,
        "dest": action.dest,
        "goal": action.goal,
        "score": round(action.score, 6),
        "load_change": action.load_change,
        "scores": {name: round(s, 6) for name, s in action.scores.items()},
        "swap": action.swap,
    }
    if model is not None:
        p = model.partition(action.partition)
        out["bytes_in_per_s"] = p.value(BYTES_IN)
        out["bytes_out_per_s"] = p.value(BYTES_OUT)
    return out


def explain_action(action: Action, model: ClusterModel | None = None) -> str:
    """One line: what moves where, why (the proposing goal and its score) and every goal's
    score, e.g. `move orders-3 node 1 -> node 4 for bytes_in_distribution (moves 12.0 MiB/s);
    score 0.5123; bytes_in_distribution=0.5246 bytes_out_distribution=0.5000 ...`."""
    if action.goal == PartitionCountCap.name:
        change = f"moves {action.load_change:g} partition"
    else:
        change = f"moves {format_rate(action.load_change)}"
    line = f"move {action.partition} node {action.source} -> node {action.dest}"
    if action.swap is not None:
        line = f"swap {action.partition} (node {action.source} -> {action.dest}) with {action.swap} (back)"
    if action.goal:
        line += f" for {action.goal} ({change})"
    line += f"; score {action.score:.4f}"
    if action.scores:
        line += "; " + " ".join(f"{name}={s:.4f}" for name, s in action.scores.items())
    if model is not None:
        p = model.partition(action.partition)
        line += f"; traffic in {format_rate(p.bytes_in_per_s)} out {format_rate(p.bytes_out_per_s)}"
    return line
