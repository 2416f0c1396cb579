"""Checkpoints: consumer groups' committed offsets translated from the source to the target.

`sync_checkpoints` reads each source group's committed offsets (s3stream.records.consumer), translates
each mirrored partition's offset with the flow's exact offset map (offsets.OffsetMap.position),
and commits the result to the same group on the target under the target partition's name. A
consumer that fails over to the target resumes from there and reads exactly the records it had
not consumed on the source: none skipped, none twice (within the mirrored range).

What "mirrored" means here: the target log stream's COMMITTED end, read from the target's
metadata (the flow's partition record names the stream). It may lag the flow's acknowledged
position by an upload interval; it never runs ahead of what the target holds durably, and the
checkpointer needs nothing but the two metadata stores.

Rules:
- Exact: an offset in the mirrored range becomes its exact downstream offset, batch-interior
  offsets included (status "exact").
- Never ahead of the target: an upstream offset beyond the mirrored end is clamped to the target's
  mirrored end (status "beyond_end") rather than skipped. A consumer failing over then re-reads the
  records between (it had consumed them upstream): at-least-once for those few, never a skip, which
  a consumer could not detect. "Nothing yet" would be just as safe but leave the target group
  further behind; the next sync, once the records are mirrored, makes it exact.
- Gaps (records the source's retention dropped before they were mirrored) and offsets before the
  flow's first segment translate to the next mirrored record (statuses "gap", "before_start").
- Monotonic: a target offset never moves back. A source group rewound on purpose (a reset) leaves
  the target where it is (status "rewind_kept") unless `follow_rewinds=True`, which commits the
  rewind with allow_rewind (still only while the checkpointer owns the target group, see below).
- Ownership: the checkpointer commits with its own generation of the target group: it joins as
  member `mirror-<flow-id>` when the group has no generation on the target, and reuses a generation
  another checkpointer (a member named `mirror-...`) started, so several flows into one target
  share it without fencing each other. A generation started by any other member means consumers
  run on the target now (they failed over and joined): the group is theirs, the checkpointer
  never fences them and skips the group from then on (reported in `skipped_groups`); a commit
  racing with such a join is refused by the generation guard (StaleGenerationError), with the
  same outcome. A commit refused because another checkpointer joined is retried with its
  generation.
- Each target commit carries, in its metadata, the flow, source partition and upstream offset it
  translates ({"mirror": flow, "source_partition": p, "upstream": u, "status": s}).
"""
from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..records.consumer import ConsumerGroups, StaleGenerationError
from ..errors import StreamNotFoundError
from ..metadata import MetadataStore
from .errors import MirrorError
from .offsets import BEYOND_END, OffsetMap
from .policy import ReplicationPolicy, check_name
from .flowstate import PartitionRecord, load_flow

MEMBER_PREFIX = "mirror-"

#: Times a group is retried when its target generation changes under the sync (another flow's
#: checkpointer joined at the same moment); a consumer's join ends the retries at once.
MAX_ATTEMPTS = 5

#: Statuses of a CheckpointEntry beyond offsets' EXACT, BEFORE_START, GAP, BEYOND_END.
NOT_MIRRORED = "not_mirrored"          # the flow does not mirror this source partition (or nothing yet)
REWIND_KEPT = "rewind_kept"            # the source went back; the target was left where it was
POLICY_MISMATCH = "policy_mismatch"    # the flow mirrors it under another name than the policy gives


@dataclass(frozen=True)
class CheckpointEntry:
    """One group's offset of one partition: upstream (source) and what the target now holds."""
    group: str
    source_partition: str
    target_partition: str | None
    upstream: int
    downstream: int | None           # the translated offset (None: not translated)
    committed: bool                  # this sync changed the target's offset
    status: str


@dataclass
class CheckpointReport:
    """What a sync did: `entries` per (group, partition), groups skipped and why."""
    flow_id: str
    entries: list[CheckpointEntry] = field(default_factory=list)
    skipped_groups: dict[str, str] = field(default_factory=dict)

    @property
    def committed(self) -> int:
        return sum(e.committed for e in self.entries)

    def entry(self, group: str, source_partition: str) -> CheckpointEntry | None:
        return next((e for e in self.entries if e.group == group and e.source_partition == source_partition), None)


def sync_checkpoints(source_meta: MetadataStore, target_meta: MetadataStore, flow_id: str,
                     policy: ReplicationPolicy | None = None, groups: Iterable[str] | None = None, *,
                     follow_rewinds: bool = False, clock: Callable[[], int] = time.time_ns) -> CheckpointReport:
    """Translate the committed offsets of `groups` (default: every group of the source) for the
    partitions flow `flow_id` mirrors, and commit them to the target (see the module docstring).
    `policy`, if given, is checked against the flow's records: a partition the flow mirrors under
    another name than the policy gives is reported (POLICY_MISMATCH) and not synced, since its
    target consumers would look for the policy's name. `clock` stamps the target's records (ns).
    MirrorError if the flow never ran."""
    check_name("flow id", flow_id, "A-to-B")
    state = load_flow(target_meta, flow_id)
    if state.source_alias is None:
        raise MirrorError(f"flow {flow_id!r} has no records in the target's metadata (KV mirror/{flow_id}/): it never "
                          f"started there; start its MirrorFlows first, or check the flow id and the target metadata")
    source_alias = state.source_alias
    member = MEMBER_PREFIX + flow_id
    by_source: dict[str, PartitionRecord] = {r.source_partition: r for r in state.partitions.values()}
    maps: dict[str, OffsetMap | None] = {}

    def offset_map(record: PartitionRecord) -> OffsetMap | None:
        if record.target_partition not in maps:
            segments = state.segments.get(record.target_partition)
            try:
                end = target_meta.get_stream(record.log_stream_id).end_offset
            except StreamNotFoundError:
                end = None
            maps[record.target_partition] = (OffsetMap(segments, end) if segments and end is not None
                                             and end > segments[0][1] else None)
        return maps[record.target_partition]

    source_groups = ConsumerGroups(source_meta)
    target_groups = ConsumerGroups(target_meta, clock)

    def sync_one(group: str, source_partition: str, upstream: int,
                  generation: int | None) -> tuple[CheckpointEntry, int | None]:
        """Translate and commit one partition's offset; the entry, and the generation used
        (joined here if the group had none on the target)."""
        record = by_source.get(source_partition)
        entry = functools.partial(CheckpointEntry, group=group, source_partition=source_partition, upstream=upstream)
        if record is None:
            return entry(target_partition=None, downstream=None, committed=False,
                                   status=NOT_MIRRORED), generation
        target = record.target_partition
        if policy is not None and policy.target_name(source_alias, source_partition) != target:
            return entry(target_partition=target, downstream=None, committed=False,
                                   status=POLICY_MISMATCH), generation
        offsets_map = offset_map(record)
        if offsets_map is None:
            return entry(target_partition=target, downstream=None, committed=False,
                                   status=NOT_MIRRORED), generation
        downstream, status = offsets_map.position(upstream)
        if generation is None:
            generation = target_groups.join(group, member)
        stored = target_groups.committed(group, target)
        rewind = stored is not None and downstream < stored
        if rewind and not follow_rewinds:
            return entry(target_partition=target, downstream=stored, committed=False,
                                   status=REWIND_KEPT), generation
        metadata = json.dumps({"mirror": flow_id, "source_partition": source_partition, "upstream": upstream,
                               "status": status}, sort_keys=True)
        changed = target_groups.commit(group, target, downstream, generation, metadata, allow_rewind=rewind)
        return entry(target_partition=target, downstream=downstream, committed=changed,
                               status=status), generation

    report = CheckpointReport(flow_id)
    names = source_groups.groups() if groups is None else [check_name("group", g, "billing") for g in groups]
    for group in names:
        offsets = source_groups.offsets(group)
        for _ in range(MAX_ATTEMPTS):
            generation, owner = target_groups.generation_owner(group) or (None, None)
            if owner is not None and not owner.startswith(MEMBER_PREFIX):
                report.skipped_groups[group] = (f"active on the target: generation {generation} was started by "
                                                f"member {owner!r}, the group's consumers commit there now")
                break
            entries: list[CheckpointEntry] = []
            try:
                for source_partition, upstream in offsets.items():
                    entry, generation = sync_one(group, source_partition, upstream, generation)
                    entries.append(entry)
            except StaleGenerationError:
                continue        # someone joined meanwhile: judge the owner again from a fresh read
            report.entries += entries
            break
        else:
            report.skipped_groups[group] = (f"its target generation changed {MAX_ATTEMPTS} times during the sync "
                                            f"(checkpointers of several flows joining at once); the next sync retries")
    return report


__all__ = ["BEYOND_END", "CheckpointEntry", "CheckpointReport", "MEMBER_PREFIX", "NOT_MIRRORED", "POLICY_MISMATCH",
           "REWIND_KEPT", "sync_checkpoints"]
