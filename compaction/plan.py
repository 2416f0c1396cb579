"""What to compact and into what: pure functions over metadata and object indexes, no I/O.

An output is a list of `Piece`s: consecutive index entries (data blocks) of one stream in one
input object. Inputs are read piece by piece, so an output never needs more than its own bytes
in memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from s3stream.metadata import ObjectMeta, StreamMeta, StreamState
from s3stream.objectformat import IndexEntry


@dataclass(frozen=True)
class Piece:
    """Index entries of one stream, consecutive in one input object (one ranged GET)."""
    source: ObjectMeta
    entries: tuple[IndexEntry, ...]

    @property
    def stream_id(self) -> int:
        return self.entries[0].stream_id

    @property
    def start_offset(self) -> int:
        return self.entries[0].start_offset

    @property
    def end_offset(self) -> int:
        return self.entries[-1].end_offset

    @property
    def nbytes(self) -> int:
        return sum(e.block_size for e in self.entries)


@dataclass
class Output:
    """One object to write: a StreamSetObject (several streams) or a StreamObject (one run)."""
    kind: str                                  # "sso" or "so"
    streams: list[tuple[int, list[Piece]]]     # (stream id ascending, its pieces in offset order)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for _, pieces in self.streams for p in pieces)


@dataclass
class GroupPlan:
    """One commit of SSO compaction: `inputs` are replaced by `outputs`."""
    inputs: list[ObjectMeta]
    outputs: list[Output] = field(default_factory=list)
    dropped_bytes: int = 0                    # trimmed or deleted data left behind
    force_split: bool = False

    @property
    def sso(self) -> Output | None:
        return next((o for o in self.outputs if o.kind == "sso"), None)


def is_dead(stream: StreamMeta | None, end_offset: int) -> bool:
    """Data ending at `end_offset` is no longer needed: the stream is gone or trimmed past it."""
    return stream is None or stream.state == StreamState.DELETED or end_offset <= stream.start_offset


def referenced(source: ObjectMeta, e: IndexEntry) -> bool:
    """Whether metadata says `source` holds the data of index entry `e`. An object may hold
    blocks no range of it names (a StreamSetObject committed without the ranges of streams
    fenced meanwhile, or whose tails their close had committed already): those are garbage."""
    return any(r.stream_id == e.stream_id and r.start_offset <= e.start_offset and e.end_offset <= r.end_offset
               for r in source.ranges)


def dead_bytes(index: Sequence[IndexEntry], streams: dict[int, StreamMeta]) -> int:
    return sum(e.block_size for e in index if is_dead(streams.get(e.stream_id), e.end_offset))


def group_inputs(objects: Sequence[ObjectMeta], max_bytes: int) -> list[list[ObjectMeta]]:
    """Consecutive groups (in the given order) of at most `max_bytes` each; an object larger than
    that forms a group of its own (it is still read and written in chunks)."""
    groups: list[list[ObjectMeta]] = []
    total = 0
    for o in objects:
        if groups and total + o.size <= max_bytes:
            groups[-1].append(o)
            total += o.size
        else:
            groups.append([o])
            total = o.size
    return groups


def _pieces(source: ObjectMeta, entries: Iterable[IndexEntry]) -> list[Piece]:
    """Split one object's entries of one stream into runs of adjacent blocks."""
    out: list[list[IndexEntry]] = []
    for e in entries:
        if out and out[-1][-1].block_position + out[-1][-1].block_size == e.block_position \
                and out[-1][-1].end_offset == e.start_offset:
            out[-1].append(e)
        else:
            out.append([e])
    return [Piece(source, tuple(run)) for run in out]


def _runs(pieces: list[Piece]) -> list[list[Piece]]:
    """Contiguous offset runs (pieces sorted by start offset)."""
    runs: list[list[Piece]] = []
    for p in pieces:
        if runs and runs[-1][-1].end_offset == p.start_offset:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def split_pieces(pieces: list[Piece], max_bytes: int) -> list[list[Piece]]:
    """Cut a contiguous run into about equal parts of at most `max_bytes` (whole blocks), so that
    the last part is not a sliver."""
    total = sum(p.nbytes for p in pieces)
    parts = max(1, math.ceil(total / max_bytes))
    target = total / parts
    out: list[list[Piece]] = [[]]
    size = done = 0
    for p in pieces:
        for e in p.entries:
            # cut at the block boundary nearest to each multiple of the target
            if size and (size + e.block_size > max_bytes
                         or done + e.block_size / 2 > target * len(out)):
                out.append([])
                size = 0
            current = out[-1]
            if current and current[-1].source.object_id == p.source.object_id and \
                    current[-1].entries[-1].block_position + current[-1].entries[-1].block_size \
                    == e.block_position:
                current[-1] = Piece(p.source, current[-1].entries + (e,))
            else:
                current.append(Piece(p.source, (e,)))
            size += e.block_size
            done += e.block_size
    return out


class PlanError(Exception):
    """The inputs disagree with metadata (overlapping data): this group is skipped."""


def plan_group(inputs: Sequence[tuple[ObjectMeta, Sequence[IndexEntry]]],
               streams: dict[int, StreamMeta], *, split_size: int, max_output: int,
               force_split: bool) -> GroupPlan:
    """Plan one SSO compaction commit from its inputs and their indexes.

    Live data of each stream (above its start offset, stream not deleted) is gathered in offset
    order. A stream leaves as StreamObjects (one per contiguous run, each cut to `max_output`) if
    the group is force-split, its data is not contiguous, or it has at least `split_size` bytes;
    the others share one new SSO of at most `max_output` bytes (the largest streams leave as
    StreamObjects until the rest fits).
    """
    plan = GroupPlan([o for o, _ in inputs], force_split=force_split)
    by_stream: dict[int, list[Piece]] = {}
    for source, index in inputs:
        per_stream: dict[int, list[IndexEntry]] = {}
        for e in index:
            if is_dead(streams.get(e.stream_id), e.end_offset) or not referenced(source, e):
                plan.dropped_bytes += e.block_size
            else:
                per_stream.setdefault(e.stream_id, []).append(e)
        for stream_id, entries in per_stream.items():
            by_stream.setdefault(stream_id, []).extend(_pieces(source, entries))
    sso_streams: list[tuple[int, list[Piece]]] = []
    for stream_id in sorted(by_stream):
        pieces = sorted(by_stream[stream_id], key=lambda p: p.start_offset)
        for a, b in zip(pieces, pieces[1:]):
            if b.start_offset < a.end_offset:
                raise PlanError(f"stream {stream_id}: objects {a.source.object_id} and "
                                f"{b.source.object_id} both hold offset {b.start_offset}")
        runs = _runs(pieces)
        nbytes = sum(p.nbytes for p in pieces)
        if force_split or len(runs) > 1 or nbytes >= split_size:
            for run in runs:
                for part in split_pieces(run, max_output):
                    plan.outputs.append(Output("so", [(stream_id, part)]))
        else:
            sso_streams.append((stream_id, pieces))
    total = sum(p.nbytes for _, pieces in sso_streams for p in pieces)
    if total > max_output:
        # Too much for one output: the largest streams leave as StreamObjects.
        for stream_id, pieces in sorted(sso_streams, key=lambda s: -sum(p.nbytes for p in s[1])):
            if total <= max_output:
                break
            sso_streams.remove((stream_id, pieces))
            total -= sum(p.nbytes for p in pieces)
            plan.outputs.append(Output("so", [(stream_id, pieces)]))
    if sso_streams:
        plan.outputs.insert(0, Output("sso", sso_streams))
    return plan


# ---- StreamObject merges ---------------------------------------------------------------------

def plan_stream_merges(objects: Sequence[ObjectMeta], *, small_size: int, max_size: int,
                       growth: float) -> list[list[ObjectMeta]]:
    """Groups of a stream's StreamObjects (offset order) to merge into one each.

    Only adjacent (offset-contiguous) objects smaller than `small_size` take part. A group is
    greedy from its first object up to `max_size` bytes, and is merged only if it has two or more
    objects and its total is at least `growth` times its largest member (size tiering: a byte is
    rewritten only when its object grows by that factor); otherwise the next start is tried.
    """
    ordered = sorted(objects, key=lambda o: o.ranges[0].start_offset)
    runs: list[list[ObjectMeta]] = []
    for o in ordered:
        if o.size >= small_size:
            runs.append([])
            continue
        if runs and runs[-1] and runs[-1][-1].ranges[0].end_offset == o.ranges[0].start_offset:
            runs[-1].append(o)
        else:
            runs.append([o])
    groups = []
    for run in runs:
        i = 0
        while i < len(run):
            group, total, j = [run[i]], run[i].size, i + 1
            while j < len(run) and total + run[j].size <= max_size:
                group.append(run[j])
                total += run[j].size
                j += 1
            if len(group) >= 2 and total >= growth * max(o.size for o in group):
                groups.append(group)
                i = j
            else:
                i += 1
    return groups
