"""The WAL header: two 4 KiB slots written alternately (format: docs/wal-format.md).

Each write goes to slot `write_seq % 2`, so a torn header write damages only the slot being
written; the valid slot with the highest `write_seq` is the header.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, replace

from _native.checksum import crc32c
from _native.walrecord import HEADER_SLOT

MAGIC = b"S3STRWAL"
#: 2: CRC-32C everywhere (version 1 used zlib's CRC-32).
VERSION = 2
_LAYOUT = struct.Struct("<8sIIQQQQQQIIQ")  # 80 bytes, then a u32 CRC of them
_CRC = struct.Struct("<I")
#: The extension at byte 84: facts recovery uses to tell a torn tail from corruption, with a CRC
#: of its own at byte 100. Writers before it left these bytes zero, which fails that CRC: a header
#: without a valid extension reads as "unknown" (0) for each field.
_EXT_AT = _LAYOUT.size + _CRC.size
_EXT = struct.Struct("<IIQ")               # 16 bytes, then a u32 CRC of them
#: The fill mark at byte 104 (preallocate="background"), with its own CRC at byte 112: present
#: only while the first zero-fill of the file runs. Bytes left zero (every other header, and
#: every header of writers before it) fail that CRC and read as "filled".
_FILL_AT = _EXT_AT + _EXT.size + _CRC.size
_FILL = struct.Struct("<Q")


@dataclass(frozen=True)
class Header:
    capacity: int          # total bytes: header area + data area
    trim_offset: int       # logical offset before which records are discarded
    write_seq: int         # bumped on every header write; selects the slot
    write_time_ns: int     # wall clock of the write (informational)
    node_id: int
    node_epoch: int
    generation: int        # bumped each time a writer session starts; stamped in its records
    clean_shutdown: bool
    clean_end: int         # where the last session stopped writing (meaningful if clean)
    # Extension (0 = unknown): how many whole batches a crash can leave written after one that
    # did not land (0 with one writer thread: batches land in order), and the batch size, both
    # the largest of any session since the WAL was made; `salvaged_end`: records below it were
    # salvaged past a corrupt region, so streams may have gaps there (docs/wal-format.md).
    inflight_batches: int = 0
    batch_bytes: int = 0
    salvaged_end: int = 0
    # Fill mark: the data area is zero-filled (and records may lie) only below this physical
    # offset; the filler resumes here. None: filled (also every header written before the field).
    fill_end: int | None = None

    def next(self, **changes) -> "Header":
        return replace(self, write_seq=self.write_seq + 1, **changes)

    def encode(self) -> bytes:
        body = _LAYOUT.pack(MAGIC, VERSION, HEADER_SLOT, self.capacity, self.trim_offset, self.write_seq,
                            self.write_time_ns, self.node_id, self.node_epoch, self.generation,
                            1 if self.clean_shutdown else 0, self.clean_end)
        ext = _EXT.pack(self.inflight_batches, self.batch_bytes, self.salvaged_end)
        slot = body + _CRC.pack(crc32c(body)) + ext + _CRC.pack(crc32c(ext))
        if self.fill_end is not None:
            fill = _FILL.pack(self.fill_end)
            slot += fill + _CRC.pack(crc32c(fill))
        return slot + bytes(HEADER_SLOT - len(slot))


class SlotState:
    EMPTY = "empty"        # all zero: never written
    VALID = "valid"
    CORRUPT = "corrupt"    # our magic, bad checksum
    OTHER_VERSION = "other version"   # our magic, a format version this build does not read
    FOREIGN = "foreign"    # not our magic and not zero


def decode_slot(raw: bytes) -> tuple[str, Header | None]:
    """Classify one slot and decode it if valid."""
    if not any(raw):
        return SlotState.EMPTY, None
    body = raw[:_LAYOUT.size]
    if body[:8] != MAGIC:
        return SlotState.FOREIGN, None
    if slot_version(raw) != VERSION:
        return SlotState.OTHER_VERSION, None
    (crc,) = _CRC.unpack_from(raw, _LAYOUT.size)
    if crc32c(body) != crc:
        return SlotState.CORRUPT, None
    (_, version, slot_size, capacity, trim, seq, wtime, node_id, node_epoch, generation,
     clean, clean_end) = _LAYOUT.unpack(body)
    if slot_size != HEADER_SLOT:
        return SlotState.CORRUPT, None
    ext = raw[_EXT_AT:_EXT_AT + _EXT.size]
    (ext_crc,) = _CRC.unpack_from(raw, _EXT_AT + _EXT.size)
    known = crc32c(ext) == ext_crc
    fill = raw[_FILL_AT:_FILL_AT + _FILL.size]
    (fill_crc,) = _CRC.unpack_from(raw, _FILL_AT + _FILL.size)
    fill_end = _FILL.unpack(fill)[0] if crc32c(fill) == fill_crc else None
    inflight, batch_bytes, salvaged_end = _EXT.unpack(ext) if known else (0, 0, 0)
    return SlotState.VALID, Header(capacity, trim, seq, wtime, node_id, node_epoch, generation,
                                   bool(clean), clean_end, inflight, batch_bytes, salvaged_end,
                                   fill_end=fill_end)


def slot_version(raw: bytes) -> int | None:
    """The format version a slot claims (None if it is not one of ours)."""
    if raw[:8] != MAGIC:
        return None
    return struct.unpack_from("<I", raw, 8)[0]


def pick_header(slot0: bytes, slot1: bytes) -> tuple[Header | None, tuple[str, str]]:
    """The newest valid header of the two slots, and both slots' states."""
    (s0, h0), (s1, h1) = decode_slot(slot0), decode_slot(slot1)
    valid = [h for h in (h0, h1) if h is not None]
    best = max(valid, key=lambda h: h.write_seq) if valid else None
    return best, (s0, s1)
