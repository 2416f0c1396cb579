"""Pure-Python reference of the WAL record codec and recovery scan.

Slow and simple on purpose: tests check the native core against it byte for byte, and it
documents the format in executable form (docs/wal-format.md is the prose).
"""
from __future__ import annotations

import struct

BLOCK = 4096
HEADER_AREA = 8192
RECORD_HEADER = 32
MAGIC = 0x52573353
TYPE_DATA = 1
TYPE_PADDING = 2
_HEAD = struct.Struct("<IB3xIIQI")  # magic, type, body_len, body_crc, offset, generation (28 bytes)


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C (Castagnoli), bit-reflected, byte at a time: the checksum of records and blocks."""
    c = crc ^ 0xFFFFFFFF
    for byte in data:
        c = _CRC32C[(c ^ byte) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def align_up(x: int) -> int:
    return (x + BLOCK - 1) // BLOCK * BLOCK


def record_start(pos: int) -> int:
    """A record header never straddles a block: too little room left means the next block."""
    return align_up(pos) if pos % BLOCK > BLOCK - RECORD_HEADER else pos


def encode_record(offset: int, generation: int, data: bytes, rtype: int = TYPE_DATA) -> bytes:
    head = _HEAD.pack(MAGIC, rtype, len(data), crc32c(data), offset, generation)
    return head + struct.pack("<I", crc32c(head)) + bytes(data)


def scan(ring: bytes, capacity: int, start: int) -> tuple[list[tuple[int, bytes]], int]:
    """Records of a data area `ring` (`capacity` bytes) from logical `start`, and the end offset."""
    records: list[tuple[int, bytes]] = []
    pos = end = start
    last_gen = 0
    limit = start + capacity
    while True:
        q = record_start(pos)
        if q + RECORD_HEADER > limit:
            break
        lap_end = (q // capacity + 1) * capacity
        phys = q % capacity
        head = ring[phys:phys + RECORD_HEADER]
        magic, rtype, length, body_crc, offset, gen = _HEAD.unpack(head[:28])
        if magic != MAGIC or crc32c(head[:28]) != struct.unpack("<I", head[28:])[0]:
            break
        if rtype not in (TYPE_DATA, TYPE_PADDING) or offset != q or gen < last_gen:
            break
        rec_end = q + RECORD_HEADER + length
        if rec_end > lap_end or rec_end > limit:
            break
        if rtype == TYPE_DATA:
            body = ring[phys + RECORD_HEADER:phys + RECORD_HEADER + length]
            if crc32c(body) != body_crc:
                break
            records.append((q, bytes(body)))
        last_gen = gen
        pos = end = rec_end
    return records, end
