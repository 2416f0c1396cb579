"""When bytes are PUT: the one upload policy of a node (issue 51).

Four goals pull on it: objects near `split_size` (requests per GiB, what S3 bills), a small
un-uploaded tail per stream (what a move must upload), records readable by readers that are not
nodes soon after their acknowledgement (visibility), and a bounded PUT rate when traffic is
light. Each trigger below seals a log-cache block (the native append path and LogCache decide
the size rules without the GIL; this module names the triggers, decides the rest and is what
docs/write-path.md's table describes). `Uploader.stats["triggers"]` counts blocks, objects and
bytes per trigger; `s3stream_upload_objects_by_trigger_total` exports the objects.

| trigger    | seals                                        | buys                           |
|------------|----------------------------------------------|--------------------------------|
| `size`     | the whole block at `upload_threshold`        | large StreamSetObjects         |
| `cut`      | a stream's slice at `split_size` (and those  | a busy stream uploads alone as |
|            | at 3/4 of it); the other streams keep filling| its own StreamObject           |
| `tail`     | a stream's slice, when its un-uploaded tail  | backpressure on that stream    |
|            | would pass `stream_tail_limit`               | alone, a bounded move          |
| `deadline` | the whole block, `upload_interval` after its | readers see every record       |
|            | oldest record                                | within about that bound        |
| `close`    | a closing stream's slice (its close PUTs and | a move uploads only what was   |
|            | commits the tail itself)                     | not PUT already                |
| `pressure` | the whole block, when the WAL's untrimmed    | the WAL never fills            |
|            | part passes `wal_pressure`                   |                                |
| `open`     | an earlier epoch's slice, at a reopen        | one slice per epoch            |
| `shutdown` | everything, at the client's close            | nothing left in the WAL        |
| `force`    | everything, at force_upload (a checkpoint)   | committed when the caller asks |
| `recovery` | what a WAL replay left, at its end           | a restart or failover finishes |

The object WAL's own PUT cadence (`wal.WALConfig.put_interval`) is the fifth cost: one PUT per
cadence at most while appends come, see docs/wal-format.md.
"""
from __future__ import annotations

import math

__all__ = ["CUT_TRIGGERS", "DEADLINE_TICK_MAX", "S3_EXPRESS_PUT_USD", "S3_STANDARD_PUT_USD", "TRIGGERS",
           "deadline_sleep", "plan_split", "request_cost_per_gib", "requests_floor", "tail_must_cut"]

#: Every reason a block is sealed (CacheBlock.sealed_by), with what it buys.
TRIGGERS = {
    "size": "the block reached upload_threshold: one large StreamSetObject",
    "cut": "a stream reached split_size: its slice uploads alone as a StreamObject, the others keep filling",
    "tail": "a stream's un-uploaded tail would pass stream_tail_limit: its slice uploads now (backpressure)",
    "deadline": "the block's oldest record is upload_interval old: readers see it",
    "close": "a stream closed: its close PUT and committed its tail itself",
    "pressure": "the WAL's untrimmed part passed wal_pressure: the block's upload frees it",
    "open": "a stream reopened: the slice of its earlier epoch goes up",
    "shutdown": "the client closed: everything goes up",
    "force": "force_upload or a checkpoint asked for everything to be committed now",
    "recovery": "a restart or a failover replayed a WAL: what is left of it goes up",
}

#: Triggers whose block is a cut (LogCache.cut): it holds only the slices of the streams that
#: reached (or came close to) split_size, or the one a tail wait or a close cut out, each of
#: which is its stream's own StreamObject whatever its size.
CUT_TRIGGERS = ("cut", "tail", "close")

#: The deadline ticker looks at least this often (seconds): bounds how late a changed
#: upload_interval or a block's first record is noticed.
DEADLINE_TICK_MAX = 0.5

#: S3 Standard's price of a PUT (us-east-1, USD per request); S3 Express One Zone's.
S3_STANDARD_PUT_USD = 0.005 / 1000
S3_EXPRESS_PUT_USD = 0.00113 / 1000


def plan_split(sealed_by: str, split_size: int) -> int:
    """The split size a block sealed for `sealed_by` is planned with: 1 for a cut (every slice
    its own StreamObject), else `split_size` (streams with that much get their own object, the
    rest share one StreamSetObject)."""
    return 1 if sealed_by in CUT_TRIGGERS else split_size


def tail_must_cut(tail: int, active: int, nbytes: int, limit: int) -> bool:
    """Whether an append of `nbytes` to a stream whose un-uploaded tail is `tail` bytes, `active`
    of them in the active block, must cut that slice out before it waits: only if the part of the
    tail already sealed (going up, freeing room as its blocks commit) cannot free enough for the
    tail to stay within `limit`. Cutting anyway made small objects whenever uploads were behind."""
    return tail - active < tail + nbytes - limit


def deadline_sleep(age_ns: int, interval: float) -> float:
    """How long the deadline ticker sleeps when the active block's oldest record is `age_ns`
    old (0: empty): until that record reaches `interval`, at most DEADLINE_TICK_MAX and at
    least 1 ms."""
    if not age_ns:
        return min(interval, DEADLINE_TICK_MAX)
    return max(0.001, min(DEADLINE_TICK_MAX, interval - age_ns / 1e9))


def requests_floor(nbytes: int, objects: int, part_size: int | None) -> float:
    """The floor of write requests for `nbytes` written in `objects` objects: each object takes a
    request and a request carries about one part (`part_size`: a single PUT goes up to the
    multipart threshold, a multipart upload adds its create and complete). Benchmarks print it
    beside what the store billed."""
    if not part_size:
        return float(objects)
    return max(float(objects), nbytes / part_size)


def request_cost_per_gib(requests_per_gib: float, price: float = S3_STANDARD_PUT_USD) -> float:
    """USD of write requests per GiB written at `requests_per_gib` (NaN stays NaN)."""
    return requests_per_gib * price if not math.isnan(requests_per_gib) else math.nan
