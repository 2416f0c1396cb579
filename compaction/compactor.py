"""Compactor: one node's StreamSetObject compaction and StreamObject merges, one round at a time.

A round of SSO compaction (see docs/compaction.md for the policy and its invariants):
1. list the node's SSOs; SSOs whose oldest data passed `force_split_age` are split entirely into
   StreamObjects; SSOs written by uploads since the last round (plus compacted SSOs that became
   mostly garbage) are merged;
2. per commit (inputs of at most `memory_budget` bytes): read the inputs' indexes, plan the
   outputs (compaction/plan.py), prepare their ids, write each output by reading its input
   blocks chunk by chunk, encode, PUT;
3. ONE metadata commit swaps the inputs for the outputs and marks the inputs for destruction.
A failure before the commit leaves PREPARED outputs that the lifecycle deletes after expiry; the
inputs stay committed and readable. After the commit the inputs are MARK_DESTROYED and deleted by
the lifecycle after its destroy delay, which lets in-flight readers finish.

Which SSOs were written by compaction, and the age of their oldest data, is kept in the KV record
`compaction/node/<id>` (metadata assigns a compacted SSO the next order id and the commit time of
its commit, so neither tells the data's age). The record is written before the commit it
describes and pruned to the node's live SSOs, so it is never missing an entry; a stale entry only
names an id that is gone.

Crash-test hook: if the environment variable S3STREAM_COMPACTION_HOOK is `after_put` (outputs PUT,
commit not made) or `after_commit` (committed, inputs not yet deleted), the compactor prints
`compaction-hook <point>` to stderr when it reaches that point of its first commit and sleeps
S3STREAM_COMPACTION_HOOK_SLEEP seconds (default 3600) so that a test can SIGKILL it there.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, fields
from typing import Callable, Sequence

from s3stream.errors import MetadataError, ObjectNotFoundError, StreamFencedError
from s3stream.metadata import (
    CommitRange, CommitRequest, CommitSSO, CommitStreamObject, MetadataStore, ObjectMeta,
    ObjectState, ObjectType, StreamMeta, StreamRange, StreamState, object_key,
)
from s3stream.objectformat import TAIL_READ, Batch, IndexEntry, encode_object, read_blocks, read_index
from s3stream.objectstore import ObjectStore

from .config import CompactionConfig
from .limits import Gate, MemoryMeter, TokenBucket
from .plan import Output, Piece, PlanError, dead_bytes, group_inputs, is_dead, plan_group, \
    plan_stream_merges

log = logging.getLogger("compaction")

HOOK_ENV = "S3STREAM_COMPACTION_HOOK"
HOOK_SLEEP_ENV = "S3STREAM_COMPACTION_HOOK_SLEEP"
_STATE_KEY = "compaction/node/{}"


@dataclass
class CompactionResult:
    """What one round (or, summed, a compactor's life) did."""
    commits: int = 0
    failed_commits: int = 0            # refused by metadata (inputs changed meanwhile): re-planned
    objects_compacted: int = 0         # inputs swapped out (marked for destruction)
    objects_expired: int = 0           # StreamObjects wholly below the start offset, marked
    stream_set_objects_written: int = 0
    stream_objects_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_dropped: int = 0             # trimmed or deleted data left behind by a commit
    seconds: float = 0.0
    throttled_seconds: float = 0.0

    def add(self, other: "CompactionResult") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Compactor:
    """Compacts the objects of node `node_id`, committing as that node at `node_epoch` (a restart
    of the node fences this compactor: its commits raise StreamFencedError).

    `clock` must be the metadata store's clock (ns; ages are compared with its commit times).
    `gate` pauses or stops the compactor between chunks (a runner shares one).
    """

    def __init__(self, store: ObjectStore, metadata: MetadataStore, node_id: int, node_epoch: int,
                 config: CompactionConfig | None = None, *, clock: Callable[[], int] = time.time_ns,
                 gate: Gate | None = None) -> None:
        self.config = config or CompactionConfig()
        self._store = store
        self._meta = metadata
        self.node_id = node_id
        self.node_epoch = node_epoch
        self._clock = clock
        self.gate = gate or Gate()
        self.memory = MemoryMeter()
        self._bucket = TokenBucket(self.config.throttle_bytes_per_s, self.config.read_chunk)
        self._indexes: dict[int, list[IndexEntry]] = {}   # objects are immutable: cache freely
        self._state: dict[int, int] = {}
        self._hook = os.environ.get(HOOK_ENV)
        self.totals = CompactionResult()

    # ---- rounds --------------------------------------------------------------------------------

    def run_once(self) -> CompactionResult:
        """One SSO compaction round, then one StreamObject round."""
        result = self.compact_stream_sets()
        result.add(self.compact_stream_objects())
        return result

    def compact_stream_sets(self) -> CompactionResult:
        """Merge the node's fresh SSOs; split the old ones into StreamObjects."""
        return self._round(self._stream_set_round)

    def compact_stream_objects(self) -> CompactionResult:
        """Merge small adjacent StreamObjects of the streams this node is responsible for (open
        here, or closed with this node their last writer); expire those below the start offset."""
        return self._round(self._stream_object_round)

    def _round(self, body: Callable[[CompactionResult], None]) -> CompactionResult:
        result = CompactionResult()
        started = time.monotonic()
        waited = self._bucket.waited
        try:
            body(result)
        finally:
            result.seconds = time.monotonic() - started
            result.throttled_seconds = self._bucket.waited - waited
            self.totals.add(result)
        return result

    def _stream_set_round(self, result: CompactionResult) -> None:
        ssos = self._meta.node_stream_set_objects(self.node_id)
        state = self._load_state(ssos)
        if not ssos:
            return
        # Only the streams these objects hold, not every stream in the cluster.
        streams = self._meta.get_streams(r.stream_id for o in ssos for r in o.ranges)
        oldest_allowed = self._clock() - int(self.config.force_split_age * 1e9)
        data_time = {o.object_id: state.get(o.object_id, o.committed_ns or 0) for o in ssos}
        old = [o for o in ssos if data_time[o.object_id] <= oldest_allowed]
        old_ids = {o.object_id for o in old}
        fresh, garbage = [], []
        for o in ssos:
            if o.object_id in old_ids:
                continue
            if o.object_id not in state:
                fresh.append(o)
            elif self._garbage_ratio(o, streams) >= self.config.garbage_ratio:
                garbage.append(o)
        for group in group_inputs(old, self.config.memory_budget):
            self._compact_group(group, streams, data_time, result, force_split=True)
        merge = sorted(fresh + garbage, key=lambda o: o.order_id or 0)
        for group in group_inputs(merge, self.config.memory_budget):
            if len(group) == 1 and group[0].object_id not in state \
                    and not self._has_dead_range(group[0], streams):
                continue   # nothing to gain: it waits for the next uploads
            self._compact_group(group, streams, data_time, result, force_split=False)

    def _stream_object_round(self, result: CompactionResult) -> None:
        batch: list[_Merge] = []
        for listed in self._meta.list_streams():
            if not self._responsible(listed):
                continue
            # Fresh per stream: a round is long next to trims, and a stale plan is refused.
            stream = self._meta.get_stream(listed.stream_id)
            objects = self._stream_objects(stream)
            expired = [o for o in objects if o.ranges[0].end_offset <= stream.start_offset]
            if expired:
                # Committed by a compaction planned before a trim: nothing can read them.
                self._meta.mark_destroyed([o.object_id for o in expired])
                result.objects_expired += len(expired)
            live = [o for o in objects if o not in expired]
            groups = plan_stream_merges(live, small_size=self.config.small_object_size,
                                        max_size=self.config.merged_object_size,
                                        growth=self.config.merge_growth)
            if not groups and live:
                # A trim cut into the first object: rewrite it without the dead head when that
                # head is most of what the stream stores (else it goes with the next trims).
                head = min(live, key=lambda o: o.ranges[0].start_offset)
                if self._dead_head(head, stream, result) >= \
                        self.config.garbage_ratio * sum(o.size for o in live):
                    groups = [[head]]
            for group in groups:
                self.gate.checkpoint()
                planned = self._plan_merge(stream, group, result)
                if planned is not None:
                    batch.append(planned)
                if sum(o.size for m in batch for o in m.inputs) >= self.config.memory_budget:
                    self._commit_merges(batch, result)
                    batch = []
        if batch:
            self._commit_merges(batch, result)

    def _stream_objects(self, stream: StreamMeta) -> list[ObjectMeta]:
        """The stream's committed StreamObjects (those below its start offset included)."""
        if stream.end_offset <= 0:
            return []
        refs = self._meta.get_object_refs(stream.stream_id, 0, stream.end_offset, limit=1 << 30)
        return [ObjectMeta(r.object_id, r.key, r.size, ObjectType.STREAM_OBJECT, ObjectState.COMMITTED,
                           None, None, 0, 0, None, None,
                           (StreamRange(r.stream_id, r.start_offset, r.end_offset),))
                for r in refs if r.type == ObjectType.STREAM_OBJECT]

    def _responsible(self, stream: StreamMeta) -> bool:
        if stream.state == StreamState.OPENED:
            return stream.owner_node_id == self.node_id
        return stream.state == StreamState.CLOSED and bool(stream.ranges) and \
            stream.ranges[-1].node_id == self.node_id

    # ---- SSO groups ------------------------------------------------------------------------------

    def _compact_group(self, group: list[ObjectMeta], streams: dict[int, StreamMeta],
                       data_time: dict[int, int], result: CompactionResult, force_split: bool) -> None:
        self.gate.checkpoint()
        try:
            inputs = [(o, self._index(o, result)) for o in group]
            plan = plan_group(inputs, streams, split_size=self.config.split_size,
                              max_output=self.config.max_output_size, force_split=force_split)
        except (PlanError, ObjectNotFoundError) as e:
            # An input vanished (another compactor of this node?) or disagrees with metadata.
            log.info("node %d: SSO compaction of %s skipped: %s", self.node_id,
                     [o.object_id for o in group], e)
            result.failed_commits += 1
            return
        oldest = min(data_time[o.object_id] for o in group)
        self._execute(plan.inputs, plan.outputs, streams, result, sso_data_time=oldest,
                      dropped=plan.dropped_bytes)

    def _plan_merge(self, stream: StreamMeta, group: list[ObjectMeta],
                    result: CompactionResult) -> "_Merge | None":
        pieces: list[Piece] = []
        dropped = 0
        try:
            for o in group:
                index = self._index(o, result)
                dropped += dead_bytes(index, {stream.stream_id: stream})
                entries = [e for e in index if e.stream_id == stream.stream_id
                           and not is_dead(stream, e.end_offset)]
                if entries:
                    pieces.append(Piece(o, tuple(entries)))
        except ObjectNotFoundError as e:
            log.info("stream %d: merge of %s skipped: %s", stream.stream_id,
                     [o.object_id for o in group], e)
            result.failed_commits += 1
            return None
        return _Merge(group, [Output("so", [(stream.stream_id, pieces)])] if pieces else [],
                      stream, dropped)

    def _commit_merges(self, batch: list["_Merge"], result: CompactionResult) -> None:
        """Write the merged StreamObjects of several streams; commit them at once (one metadata
        transaction for many merges). If a trim destroyed an input meanwhile, commit the merges
        whose inputs are all still committed."""
        outputs = [out for m in batch for out in m.outputs]
        ids = iter(self._meta.prepare_objects(len(outputs), int(self.config.prepared_ttl * 1e9))
                   if outputs else [])
        written = []
        for m in batch:
            sos = []
            for out in m.outputs:
                object_id = next(ids)
                size, ranges = self._write(out, object_id, {m.stream.stream_id: m.stream}, result)
                sos.append(CommitStreamObject(object_id, size, ranges[0]))
            written.append((m.inputs, sos, m.dropped))
        for attempt in range(2):
            request = CommitRequest(self.node_id, self.node_epoch,
                                    stream_objects=tuple(so for _, sos, _ in written for so in sos),
                                    compacted_ids=tuple(o.object_id for inputs, _, _ in written
                                                        for o in inputs))
            if self._commit(request, result, log_level=logging.DEBUG if attempt == 0 else logging.INFO):
                for inputs, sos, dropped in written:
                    result.objects_compacted += len(inputs)
                    result.stream_objects_written += len(sos)
                    result.bytes_dropped += dropped
                return
            written = [w for w in written if all(
                self._meta.get_object(o.object_id).state == ObjectState.COMMITTED for o in w[0])]
            if not written:
                return

    # ---- writing and committing -----------------------------------------------------------------

    def _execute(self, inputs: Sequence[ObjectMeta], outputs: list[Output],
                 streams: dict[int, StreamMeta], result: CompactionResult,
                 sso_data_time: int | None, dropped: int) -> None:
        """Write `outputs`, then one commit swapping `inputs` for them."""
        ids = self._meta.prepare_objects(len(outputs), int(self.config.prepared_ttl * 1e9)) \
            if outputs else []
        sso = None
        stream_objects = []
        for output, object_id in zip(outputs, ids):
            size, ranges = self._write(output, object_id, streams, result)
            if output.kind == "sso":
                # Recorded before the commit: the record never misses a compacted SSO.
                self._remember(object_id, sso_data_time)
                sso = CommitSSO(object_id, size, tuple(ranges))
            else:
                stream_objects.append(CommitStreamObject(object_id, size, ranges[0]))
        request = CommitRequest(self.node_id, self.node_epoch, sso=sso,
                                stream_objects=tuple(stream_objects),
                                compacted_ids=tuple(o.object_id for o in inputs))
        if not self._commit(request, result):
            return
        result.objects_compacted += len(inputs)
        result.bytes_dropped += dropped
        result.stream_set_objects_written += 1 if sso else 0
        result.stream_objects_written += len(stream_objects)

    def _commit(self, request: CommitRequest, result: CompactionResult,
                log_level: int = logging.INFO) -> bool:
        """One compaction commit; False if metadata refused it because its inputs changed
        (trimmed away, compacted elsewhere): the outputs stay PREPARED and expire, and the next
        round plans again from fresh metadata. StreamFencedError (node restarted) propagates."""
        self._crash_point("after_put")
        try:
            self._meta.commit(request)
        except StreamFencedError:
            raise
        except MetadataError as e:
            log.log(log_level, "node %d: compaction commit of %s refused: %s", self.node_id,
                    list(request.compacted_ids), e)
            result.failed_commits += 1
            return False
        result.commits += 1
        self._crash_point("after_commit")
        return True

    def _write(self, output: Output, object_id: int, streams: dict[int, StreamMeta],
               result: CompactionResult) -> tuple[int, list[CommitRange]]:
        """Read the output's blocks chunk by chunk, encode, PUT; its size and ranges."""
        held = 0
        encoded = None
        try:
            contents: list[tuple[int, list[Batch]]] = []
            for stream_id, pieces in output.streams:
                start = streams[stream_id].start_offset
                batches: list[Batch] = []
                for piece in pieces:
                    for chunk in _chunks(piece, self.config.read_chunk):
                        got = self._read_chunk(chunk, result)
                        kept = [b for b in got if b.end_offset > start]
                        nbytes = sum(len(b.payload) for b in kept)
                        self.memory.hold(nbytes)
                        held += nbytes
                        batches += kept
                if batches:
                    contents.append((stream_id, batches))
            encoded = encode_object(contents, self.config.object_block_size)
            self.memory.hold(len(encoded.data))
            ranges = [CommitRange(stream_id, streams[stream_id].epoch, batches[0].base_offset,
                                  batches[-1].end_offset) for stream_id, batches in contents]
            del contents, batches
            self.memory.release(held)
            held = 0
            self.gate.checkpoint()
            self._bucket.take(len(encoded.data))
            self._store.put(object_key(object_id), encoded.data)
            result.bytes_written += len(encoded.data)
            return len(encoded.data), ranges
        finally:
            self.memory.release(held + (len(encoded.data) if encoded is not None else 0))

    def _read_chunk(self, chunk: Piece, result: CompactionResult) -> list[Batch]:
        self.gate.checkpoint()
        time.sleep(self.config.chunk_pause)   # even 0 lets appending threads have the GIL
        self._bucket.take(chunk.nbytes)
        # The raw range and its decoded copy are both held until the raw bytes are dropped.
        self.memory.hold(2 * chunk.nbytes)
        try:
            blocks = read_blocks(self._store, chunk.source.key, chunk.entries)
        finally:
            self.memory.release(2 * chunk.nbytes)
        result.bytes_read += chunk.nbytes
        return [b for block in blocks for b in block]

    def _index(self, o: ObjectMeta, result: CompactionResult) -> list[IndexEntry]:
        index = self._indexes.get(o.object_id)
        if index is None:
            index = read_index(self._store, o.key, o.size)
            result.bytes_read += min(o.size, TAIL_READ)
            if len(self._indexes) > 4096:
                self._indexes.clear()
            self._indexes[o.object_id] = index
        return index

    def _has_dead_range(self, o: ObjectMeta, streams: dict[int, StreamMeta]) -> bool:
        # No ranges at all: every stream in it was deleted before its upload committed.
        return not o.ranges or any(is_dead(streams.get(r.stream_id), r.end_offset) for r in o.ranges)

    def _dead_head(self, o: ObjectMeta, stream: StreamMeta, result: CompactionResult) -> int:
        """Bytes of a StreamObject below the stream's start offset."""
        if o.ranges[0].start_offset >= stream.start_offset:
            return 0       # decided from metadata alone: no GET
        return dead_bytes(self._index(o, result), {stream.stream_id: stream})

    def _garbage_ratio(self, o: ObjectMeta, streams: dict[int, StreamMeta]) -> float:
        if not self._has_dead_range(o, streams):
            return 0.0     # decided from metadata alone: no GET
        index = self._index(o, CompactionResult())
        total = sum(e.block_size for e in index)
        return dead_bytes(index, streams) / total if total else 1.0

    # ---- the node's compaction record ------------------------------------------------------------

    def _load_state(self, ssos: list[ObjectMeta]) -> dict[int, int]:
        """Compacted SSO id -> data time, pruned to the node's live SSOs."""
        raw = self._meta.get_kv(_STATE_KEY.format(self.node_id))
        recorded = {int(k): v for k, v in json.loads(raw)["ssos"].items()} if raw else {}
        live = {o.object_id for o in ssos}
        state = {k: v for k, v in recorded.items() if k in live}
        if state != recorded:
            self._save_state(state)
        self._state = state
        return state

    def _remember(self, object_id: int, data_time: int | None) -> None:
        self._state[object_id] = data_time if data_time is not None else self._clock()
        self._save_state(self._state)

    def _save_state(self, state: dict[int, int]) -> None:
        self._meta.put_kv(_STATE_KEY.format(self.node_id),
                          json.dumps({"ssos": {str(k): v for k, v in sorted(state.items())}}).encode())

    def compacted_stream_set_objects(self) -> dict[int, int]:
        """Ids of the node's SSOs written by compaction -> the time of their oldest data (ns)."""
        return self._load_state(self._meta.node_stream_set_objects(self.node_id))

    def _crash_point(self, point: str) -> None:
        if self._hook == point:
            self._hook = None
            print(f"compaction-hook {point}", file=sys.stderr, flush=True)
            time.sleep(float(os.environ.get(HOOK_SLEEP_ENV, "3600")))


@dataclass
class _Merge:
    """StreamObjects of one stream to replace by `outputs` (none if all their data is dead)."""
    inputs: list[ObjectMeta]
    outputs: list[Output]
    stream: StreamMeta
    dropped: int


def _chunks(piece: Piece, max_bytes: int) -> list[Piece]:
    out: list[list[IndexEntry]] = [[]]
    size = 0
    for e in piece.entries:
        if out[-1] and size + e.block_size > max_bytes:
            out.append([])
            size = 0
        out[-1].append(e)
        size += e.block_size
    return [Piece(piece.source, tuple(entries)) for entries in out]

