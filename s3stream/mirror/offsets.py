"""The exact offset map of a mirrored partition: upstream (source) offsets -> downstream (target).

Why it can be exact. A flow appends the source's batches to the target in order, one target
batch per source batch with the same record count, and nothing else writes the target partition.
So while a flow runs, downstream = upstream + delta with one constant delta; a record's offset
inside its batch is the same on both sides, so batch-interior offsets translate too. The delta
can change only where the flow (re)starts: a *segment* `(upstream_start, downstream_start)`
begins there, at the flow's first upstream offset and the target's end at that moment. MirrorMaker
2 samples (upstream, downstream) pairs every 100 records and can only round a consumer's offset
down to the last sample; here the whole map is a handful of segments and every offset in range
translates to the one downstream offset that holds the same record.

Segments `[(u0, d0), (u1, d1), ...]`, both columns strictly increasing. Segment i covers the
downstream records [d_i, d_{i+1}) (the last one: up to the target's end), which came from the
upstream records [u_i, u_i + (d_{i+1} - d_i)). Between the end of one segment and the start of the
next, upstream records may be missing (a *gap*: the source's retention dropped them before they
were mirrored, and the flow was told to skip them); they never overlap (no record is mirrored twice).

Bounded metadata. A resume continues exactly where the target ends: its segment would have the
same delta as the previous one, so it is merged (not stored); only a gap adds a segment. A
segment that never received a record (the flow stopped before its first append) is replaced by
the next one. So a partition's map grows only with the gaps its source's retention forced.

`OffsetMap` is pure arithmetic (no I/O) over the segments and, optionally, the downstream end
(the target's end: what has been mirrored so far). Storing the segments is `records.py`'s job.
"""
from __future__ import annotations

import bisect
import json
from typing import Iterable, NamedTuple, Sequence

from ..errors import CorruptDataError, check_int
from .errors import MirrorConflictError, OffsetNotMirroredError

Segment = tuple[int, int]

#: Statuses of OffsetMap.position.
EXACT = "exact"                  # the offset is in the mirrored range: its exact counterpart
BEFORE_START = "before_start"    # before the first mirrored offset: the first mirrored record
GAP = "gap"                      # in a gap: the first mirrored record after it
BEYOND_END = "beyond_end"        # not mirrored yet: the target's end (clamped)


class Position(NamedTuple):
    """A consumer position translated for the target: `downstream` is where a consumer resumes,
    `status` one of EXACT, BEFORE_START, GAP, BEYOND_END (see OffsetMap.position)."""
    downstream: int
    status: str


def add_segment(segments: Sequence[Segment], upstream: int, downstream: int) -> list[Segment]:
    """The segments after a flow (re)starts at `upstream` with the target ending at `downstream`
    (see the module docstring): unchanged when it continues the last segment (same delta); the
    last segment replaced when it received no record; else appended. MirrorConflictError if the
    target end is below the last segment's start (the target lost records or was recreated) or if
    the start would mirror upstream records a second time."""
    check_int("upstream", upstream)
    check_int("downstream", downstream)
    result = list(segments)
    while result:
        last_up, last_down = result[-1]
        if downstream < last_down:
            raise MirrorConflictError(
                f"the target ends at {downstream}, below the start {last_down} of the flow's last segment "
                f"(upstream {last_up}): records the flow wrote are gone (the partition was recreated or "
                f"truncated); delete the flow's map to mirror into it afresh, or mirror into a new partition")
        if downstream == last_down:
            result.pop()                    # it received no record: the new start replaces it
            continue
        if upstream - downstream == last_up - last_down:
            return result                   # a continuation: same delta, nothing to store
        mirrored_end = last_up + (downstream - last_down)
        if upstream < mirrored_end:
            raise MirrorConflictError(
                f"a segment starting at upstream {upstream} would mirror upstream [{upstream}, {mirrored_end}) a "
                f"second time (the last segment mirrored up to {mirrored_end}); resume at {mirrored_end} or later")
        break
    result.append((upstream, downstream))
    return result


def encode_segments(segments: Iterable[Segment]) -> bytes:
    """The KV value: JSON [[upstream_start, downstream_start], ...]."""
    return json.dumps([[u, d] for u, d in segments], separators=(",", ":")).encode()


def decode_segments(raw: bytes, key: str = "the offset map") -> list[Segment]:
    """Parse and check a stored map; CorruptDataError naming `key` if it is not one add_segment
    could have made (so translation never runs on a map it cannot trust)."""
    try:
        value = json.loads(bytes(raw))
        if not isinstance(value, list) or not all(isinstance(s, list) for s in value):
            raise TypeError("not a list of lists")
        segments = [(u, d) for u, d in value]
    except (ValueError, TypeError) as e:
        raise CorruptDataError(f"{key}: not a JSON list of [upstream, downstream] pairs ({e}): {bytes(raw)[:200]!r}; "
                               f"restore it from a backup or delete it to mirror afresh") from e
    for i, (u, d) in enumerate(segments):
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in (u, d)):
            raise CorruptDataError(f"{key}: segment {i} {[u, d]} holds something other than offsets")
        if i and not (d > segments[i - 1][1] and u >= segments[i - 1][0] + (d - segments[i - 1][1])):
            raise CorruptDataError(f"{key}: segment {i} {[u, d]} does not follow segment {i - 1} "
                                   f"{list(segments[i - 1])} (segments must move forward without overlapping)")
    return segments


class OffsetMap:
    """Translation over `segments` (see the module docstring). `downstream_end`, the target's
    end, bounds what is mirrored; None leaves the last segment unbounded (pure arithmetic)."""

    def __init__(self, segments: Sequence[Segment], downstream_end: int | None = None) -> None:
        if not segments:
            raise OffsetNotMirroredError("the flow has mirrored nothing yet (its offset map is empty)", 0, None)
        self.segments: tuple[Segment, ...] = tuple((int(u), int(d)) for u, d in segments)
        self._ups = [u for u, _ in self.segments]
        self._downs = [d for _, d in self.segments]
        if downstream_end is not None:
            check_int("downstream_end", downstream_end)
        self.downstream_end = downstream_end

    # ---- the mirrored range ----------------------------------------------------------------------

    @property
    def upstream_start(self) -> int:
        return self._ups[0]

    @property
    def downstream_start(self) -> int:
        return self._downs[0]

    @property
    def upstream_end(self) -> int | None:
        """The upstream offset of the target's end: every upstream offset below it that is not in
        a gap is mirrored (it equals the flow's position once its appends are durable)."""
        end = self.downstream_end
        if end is None:
            return None
        if end <= self._downs[0]:
            return self._ups[0]
        i = bisect.bisect_right(self._downs, end) - 1
        return self._ups[i] + (end - self._downs[i])

    @property
    def mirrored(self) -> tuple[int, int | None]:
        """The upstream range [start, end] that translates (end None: unbounded)."""
        return self.upstream_start, self.upstream_end

    def _extent(self, i: int) -> int | None:
        """How many records segment i holds (None: the last, unbounded here)."""
        return self._downs[i + 1] - self._downs[i] if i + 1 < len(self._downs) else None

    def resume_position(self, downstream_end: int) -> int:
        """The upstream offset a flow continues from when the target ends at `downstream_end`:
        the record after the last one the target holds. MirrorConflictError if the target ends
        below the last segment's start."""
        check_int("downstream_end", downstream_end)
        last_up, last_down = self.segments[-1]
        if downstream_end < last_down:
            add_segment(self.segments, last_up, downstream_end)      # raises, with the explanation
        return last_up + (downstream_end - last_down)

    # ---- translation ----------------------------------------------------------------------------

    def _not_mirrored(self, offset: int, why: str) -> OffsetNotMirroredError:
        return OffsetNotMirroredError(
            f"upstream offset {offset} {why}; the flow has mirrored upstream [{self.upstream_start}, "
            f"{self.upstream_end if self.downstream_end is not None else '...'}]: translate an offset in that "
            f"range, or use position() for a consumer's offset", offset, self.mirrored)

    def translate(self, upstream: int) -> int:
        """The downstream offset of the record at upstream offset `upstream` (or, at the mirrored
        end, the target's end). Exact for every offset in the mirrored range, batch-interior
        ones included; OffsetNotMirroredError outside it or in a gap."""
        check_int("upstream", upstream)
        if upstream < self._ups[0]:
            raise self._not_mirrored(upstream, "is before the flow's first mirrored offset")
        end = self.upstream_end
        if end is not None and upstream > end:
            raise self._not_mirrored(upstream, "is not mirrored yet")
        i = bisect.bisect_right(self._ups, upstream) - 1
        extent = self._extent(i)
        if extent is not None and upstream > self._ups[i] + extent:
            raise self._not_mirrored(
                upstream, f"is in a gap: upstream [{self._ups[i] + extent}, {self._ups[i + 1]}) was removed by "
                          f"the source's retention before it was mirrored")
        return self._downs[i] + (upstream - self._ups[i])

    def position(self, upstream: int) -> Position:
        """Where a consumer whose next upstream offset is `upstream` resumes on the target: the
        downstream offset of the first target record it has not consumed. Never past a record
        it has not seen (it may see some twice only when BEYOND_END: clamped to the target's end,
        the rest arrives there later), so a consumer that fails over skips nothing.

        EXACT: the exact translation. BEFORE_START: the offset precedes the flow's first
        mirrored offset; the target has nothing of it, its next record is the first mirrored one.
        GAP: the records after it up to the next segment were never mirrored; the next segment's
        first record. BEYOND_END: not mirrored yet; the target's end."""
        check_int("upstream", upstream)
        if upstream < self._ups[0]:
            down, status = self._downs[0], BEFORE_START
        else:
            i = bisect.bisect_right(self._ups, upstream) - 1
            extent = self._extent(i)
            if extent is not None and upstream > self._ups[i] + extent:
                down, status = self._downs[i + 1], GAP
            else:
                down, status = self._downs[i] + (upstream - self._ups[i]), EXACT
        end = self.downstream_end
        if end is not None and down > end:
            return Position(end, BEYOND_END)
        return Position(down, status)

    def upstream_of(self, downstream: int) -> int:
        """The inverse of translate: the upstream offset of the record at `downstream` (at the
        target's end: the mirrored end). OffsetNotMirroredError outside [downstream_start, end]."""
        check_int("downstream", downstream)
        end = self.downstream_end
        if downstream < self._downs[0] or (end is not None and downstream > end):
            raise OffsetNotMirroredError(
                f"downstream offset {downstream} is outside what the flow wrote to the target "
                f"[{self._downs[0]}, {end if end is not None else '...'}]", downstream, self.mirrored)
        i = bisect.bisect_right(self._downs, downstream) - 1
        return self._ups[i] + (downstream - self._downs[i])

    def __eq__(self, other) -> bool:
        return (isinstance(other, OffsetMap) and self.segments == other.segments
                and self.downstream_end == other.downstream_end)

    def __repr__(self) -> str:
        return f"OffsetMap({[list(s) for s in self.segments]}, downstream_end={self.downstream_end})"
