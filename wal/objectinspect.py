"""Reading a WAL of objects without writing to it: what `s3stream inspect wal` shows of one.

A session that opens a node's log of objects (wal.objectlog) writes a FENCE, and a HOLE where
the log's newest session stops; both stop the node's current writer. Inspecting must not: this
module only lists the node's objects and reads them (no PUT, no delete), and decides the log
the way an opener would (docs/wal-format.md, "A WAL of objects", invariants 2 and 4) up to the
point where the opener would write:

1. S is the newest FENCE; the log's newest session is walked from S + DATA_GAP + 1 on while
   each object is DATA of S's generation linked to the one before. Where an opener would put
   its HOLE (the first missing sequence), this stops: a writer that is still running may PUT
   there next, so on a live node the result is a snapshot of what it had written so far;
2. the log is the chain of `prev` links back from the last object walked, down to the largest
   trim stamped in a header; its DATA bodies are scanned with the same native Scanner.

So on the log of a node that is down, this reads exactly what a recovery would replay; on a
running node, what recovery would replay if the node stopped now.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

from _native import walrecord
from _native.walscan import Scanner

from .errors import WALCorruptError
from .log import Record
from .objectlog import (
    DATA_GAP, HEADER_BYTES, KIND_DATA, KIND_FENCE, KIND_HOLE, NO_SEQ, ObjectHeader, WALStore, node_prefix, object_key,
)

#: Kind names for reports.
KIND_NAMES = {KIND_DATA: "data", KIND_FENCE: "fence", KIND_HOLE: "hole"}
_SEQ = re.compile(r"\d{20}")
_NODE = re.compile(r"node-(\d+)/")


@dataclass
class ObjectLogSnapshot:
    """A node's log of objects as read at one moment (see the module docstring).

    `objects`: every object under the node's prefix as (seq, size, header or None: a key that
    is no WAL object, e.g. a probe); `chain`: the DATA objects recovery would replay, oldest
    first; `last`: the log's last object (NO_SEQ: none); `stopped_at` and `stop_reason`: where
    and why the walk of the newest session ended (the sequence an opener would fence)."""
    store_url: str
    node_id: int
    objects: list[tuple[int, int, ObjectHeader | None]]
    fence: ObjectHeader | None
    trim: int
    trim_seq: int
    last: int
    chain: list[ObjectHeader]
    stopped_at: int | None
    stop_reason: str
    other_keys: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.store_url.rstrip('/')}/{node_prefix(self.node_id)}"

    def counts(self) -> dict[str, int]:
        """Objects by kind ("other": a key under the prefix that is no WAL object)."""
        out = dict.fromkeys([*KIND_NAMES.values(), "other"], 0)
        for _, _, header in self.objects:
            out["other" if header is None else KIND_NAMES[header.kind]] += 1
        out["other"] += len(self.other_keys)
        return out


def wal_nodes(store: WALStore) -> list[int]:
    """The node ids that have objects in `store` (under `node-{id}/`)."""
    nodes = set()
    for info in store.list("node-"):
        match = _NODE.match(info.key)
        if match:
            nodes.add(int(match.group(1)))
    return sorted(nodes)


def _read_header(store: WALStore, node_id: int, seq: int) -> ObjectHeader | None:
    key = object_key(node_id, seq)
    try:
        raw = store.get(key, 0, HEADER_BYTES)
    except KeyError:
        return None                     # deleted since the listing (trimmed by a running writer)
    header = ObjectHeader.decode(raw, f"{store.url}/{key}")
    if header.seq != seq or header.node_id != node_id:
        raise WALCorruptError(f"WAL object {store.url}/{key} says it is node {header.node_id}'s object "
                              f"{header.seq}: it was copied or renamed")
    return header


def snapshot(store: WALStore, node_id: int, threads: int = 8) -> ObjectLogSnapshot:
    """List node `node_id`'s objects in `store`, read every header and decide the log, reading
    only (see the module docstring). WALCorruptError for an object whose header is damaged."""
    prefix = node_prefix(node_id)
    listing: dict[int, int] = {}
    other: list[str] = []
    for info in store.list(prefix):
        tail = info.key[len(prefix):]
        if _SEQ.fullmatch(tail):
            listing[int(tail)] = info.size
        else:
            other.append(info.key)
    seqs = sorted(listing)
    with ThreadPoolExecutor(max(1, min(threads, len(seqs)))) as pool:
        found = list(pool.map(lambda seq: _read_header(store, node_id, seq), seqs))
    headers = {seq: h for seq, h in zip(seqs, found) if h is not None}
    objects = [(seq, listing[seq], headers.get(seq)) for seq in seqs if seq in headers]
    trim = max((h.trim for h in headers.values()), default=0)
    trim_seq = max((h.trim_seq for h in headers.values()), default=0)
    fences = [seq for seq, h in headers.items() if h.kind == KIND_FENCE]
    fence = headers[max(fences)] if fences else None
    if fence is None:
        return ObjectLogSnapshot(store.url, node_id, objects, None, trim, trim_seq, NO_SEQ, [], None,
                                 "no session ever opened this log (no FENCE)", other)
    last = fence.prev
    seq = max(fence.seq + DATA_GAP + 1, trim_seq)
    while True:
        h = headers.get(seq)
        if h is None:
            reason = f"sequence {seq} is free (where the node writes next, or an opener would put its HOLE)"
            break
        if h.kind != KIND_DATA or h.generation != fence.generation or (
                h.prev != last and last != NO_SEQ and h.prev >= trim_seq):
            reason = (f"object {seq} does not continue the newest session ({KIND_NAMES[h.kind]}, generation "
                      f"{h.generation})")
            break
        last = seq
        seq += 1
    chain: list[ObjectHeader] = []
    at = last
    while at != NO_SEQ and at >= trim_seq:
        h = headers.get(at)
        if h is None or h.end <= trim:
            break                       # deleted by a trimmer, or wholly trimmed: so is all before it
        if h.kind != KIND_DATA:
            raise WALCorruptError(f"WAL of node {node_id} at {store.url}: object {at} is a {KIND_NAMES[h.kind]} where "
                                  "the log links to data")
        chain.append(h)
        at = h.prev
    chain.reverse()
    return ObjectLogSnapshot(store.url, node_id, objects, fence, trim, trim_seq, last, chain, seq, reason, other)


@dataclass
class ScanResult:
    """What `records` read: records and their bytes, the logical end, and the damage that
    stopped it (None: it read the whole chain)."""
    records: int = 0
    record_bytes: int = 0
    end: int = 0
    error: str | None = None


def records(store: WALStore, log: ObjectLogSnapshot, result: ScanResult) -> Iterator[Record]:
    """The records recovery would replay from `log`, in order (reading each DATA object once).
    Damage (an object shorter than its header says, a body that does not continue the one
    before, a record that fails its checks) ends the scan with `result.error` set: the store
    lost or changed data."""
    end = log.trim
    generation = 0
    result.end = end
    for i, h in enumerate(log.chain):
        key = object_key(log.node_id, h.seq)
        where = f"{store.url}/{key}"
        try:
            raw = store.get(key)
        except KeyError:
            end = max(end, h.end)       # trimmed and deleted since the snapshot
            continue
        if len(raw) != HEADER_BYTES + h.body_len:
            result.error = f"WAL object {where} is {len(raw)} bytes; its header says {HEADER_BYTES + h.body_len}"
            return
        if i and h.start != -(-end // walrecord.BLOCK) * walrecord.BLOCK and h.start > log.trim:
            result.error = (f"WAL object {where} starts at logical offset {h.start}, but the object before it in the "
                            f"log ends at {end}: the log is missing data")
            return
        scanner = Scanner(-1, 0, h.capacity, max(h.start, log.trim), data=raw[HEADER_BYTES:], data_start=h.start,
                          min_generation=generation)
        for offset, data in scanner:
            yield Record(offset, data)
        result.records += scanner.records
        result.record_bytes += scanner.record_bytes
        end = max(end, scanner.end)
        result.end = end
        if scanner.stop_reason != walrecord.STOP_END_OF_SPACE or walrecord.next_record_start(scanner.end) < h.end:
            reason = walrecord.STOP_REASONS.get(scanner.stop_reason, str(scanner.stop_reason))
            result.error = f"WAL object {where} is damaged at logical offset {scanner.end} ({reason})"
            return
        generation = scanner.last_generation
