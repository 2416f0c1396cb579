"""Objects on the store: encode them, and read them footer -> index -> blocks with range GETs.

Format: docs/object-format.md; codec: _native/objcodec.pyx (pure-Python twin:
s3stream/objectformat_reference.py). A corrupt object raises CorruptDataError naming its key.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from _native import objcodec

from .errors import CorruptDataError, UnsupportedFormatError
from .batches import FetchedBatch as Batch
from .objectstore import ObjectStore

FOOTER_SIZE = objcodec.FOOTER_SIZE
BLOCK_HEADER_SIZE = objcodec.BLOCK_HEADER_SIZE
BATCH_HEADER_SIZE = objcodec.BATCH_HEADER_SIZE
#: The first GET of an object's tail fetches this much, so the index usually comes with the footer.
TAIL_READ = 64 * 1024


class IndexEntry(NamedTuple):
    stream_id: int
    start_offset: int
    end_offset: int
    record_count: int
    block_size: int
    block_position: int
    batch_count: int


class EncodedObject(NamedTuple):
    data: bytes
    # The field shadows tuple.index (mypy flags any such field); obj.index is the object's index.
    index: list[IndexEntry]  # type: ignore[assignment]


def encode_object(streams: Sequence[tuple[int, Sequence[tuple[int, int, bytes | memoryview]]]],
                  block_size: int) -> EncodedObject:
    """Encode (stream_id, [(base, count, payload)]) pairs, stream ids ascending."""
    data, entries = objcodec.encode_object(streams, block_size)
    return EncodedObject(data, [IndexEntry(*e) for e in entries])


def read_index(store: ObjectStore, key: str, size: int) -> list[IndexEntry]:
    """The object's index: one ranged GET of its tail (two if the index is large)."""
    if size < FOOTER_SIZE:
        raise CorruptDataError(f"object {key} is {size} bytes, smaller than a footer")
    tail_start = max(0, size - TAIL_READ)
    return index_from_tail(store, key, size, store.get(key, tail_start, size), tail_start)


def index_from_tail(store: ObjectStore | None, key: str, size: int, tail: bytes | memoryview,
                    tail_start: int) -> list[IndexEntry]:
    """The index of the `size`-byte object whose bytes from `tail_start` on are `tail`; the
    index is fetched from `store` if it begins before `tail_start` (never when tail_start is 0)."""
    try:
        if size < FOOTER_SIZE:
            raise objcodec.ObjectFormatError(f"{size} bytes, smaller than a footer")
        if len(tail) != size - tail_start:
            raise objcodec.ObjectFormatError(f"short read of the object tail ({len(tail)} bytes)")
        pos, length, crc, _ = objcodec.parse_footer(tail, size)
        raw: bytes | memoryview
        if pos >= tail_start:
            raw = memoryview(tail)[pos - tail_start:pos - tail_start + length]
        else:
            assert store is not None, "index_from_tail needs a store unless the tail starts at 0"
            raw = store.get(key, pos, pos + length)
        return [IndexEntry(*e) for e in objcodec.parse_index(raw, crc)]
    except objcodec.ObjectFormatError as e:
        raise _format_error(key, e) from None


def entries_for(index: Sequence[IndexEntry], stream_id: int, start: int, end: int) -> list[IndexEntry]:
    """Index entries of `stream_id` overlapping [start, end), in offset order."""
    return [e for e in index if e.stream_id == stream_id and e.end_offset > start and e.start_offset < end]


def read_blocks(store: ObjectStore, key: str, entries: Sequence[IndexEntry]) -> list[list[Batch]]:
    """Decode consecutive blocks with one ranged GET; returns each block's batches, whose
    payloads are memoryview slices of the GET's buffer (checked, not copied)."""
    if not entries:
        return []
    first = entries[0].block_position
    last = entries[-1].block_position + entries[-1].block_size
    raw = store.get(key, first, last)
    if len(raw) != last - first:
        raise CorruptDataError(f"object {key} is corrupt: short read: {len(raw)} of {last - first} bytes")
    return decode_blocks(key, raw, first, entries)


def decode_blocks(key: str, raw: bytes | memoryview, raw_start: int,
                  entries: Sequence[IndexEntry]) -> list[list[Batch]]:
    """Each entry's batches, decoded (and checked) from `raw`, the object's bytes from
    `raw_start` on; payloads are memoryview slices of `raw`."""
    out: list[list[Batch]] = []
    try:
        for e in entries:
            if e.block_position < raw_start or e.block_position + e.block_size > raw_start + len(raw):
                raise objcodec.ObjectFormatError(
                    f"block at {e.block_position} (+{e.block_size}) is outside the object's bytes")
            batches = objcodec.decode_block(raw, e.block_position - raw_start, e.block_size, e.stream_id, Batch, True)
            if not batches or batches[0][0] != e.start_offset or batches[-1][0] + batches[-1][1] != e.end_offset:
                raise objcodec.ObjectFormatError(
                    f"block of stream {e.stream_id} does not hold offsets [{e.start_offset}, {e.end_offset})")
            out.append(batches)
    except objcodec.ObjectFormatError as e:
        raise _format_error(key, e) from None
    return out


def _format_error(key: str, error: objcodec.ObjectFormatError) -> CorruptDataError:
    if isinstance(error, objcodec.ObjectVersionError):
        return UnsupportedFormatError(f"object {key}: {error}")
    return CorruptDataError(f"object {key} is corrupt: {error}")
