"""Pure-Python reference of the object codec (see docs/object-format.md). Slow and plain: tests
compare the native codec with it byte for byte."""
from __future__ import annotations

import struct

from wal.reference import crc32c

BLOCK_MAGIC = 0x42443353
FOOTER_MAGIC = 0x31304A424F535333
VERSION = 2
_BLOCK = struct.Struct("<IIQQII")
_BATCH = struct.Struct("<QII")
_ENTRY = struct.Struct("<QQQIIQII")
_FOOTER = struct.Struct("<QIIIHHQ")


def encode_object(streams, block_size: int) -> tuple[bytes, list[tuple]]:
    blocks: list[tuple[int, list[tuple[int, int, bytes]]]] = []
    for stream_id, batches in streams:
        current: list = []
        size = _BLOCK.size
        for base, count, payload in batches:
            if current and size + _BATCH.size + len(payload) > block_size:
                blocks.append((stream_id, current))
                current, size = [], _BLOCK.size
            current.append((base, count, bytes(payload)))
            size += _BATCH.size + len(payload)
        blocks.append((stream_id, current))
    out = bytearray()
    entries = []
    for stream_id, batches in blocks:
        body = b"".join(_BATCH.pack(b, c, len(p)) + p for b, c, p in batches)
        position = len(out)
        out += _BLOCK.pack(BLOCK_MAGIC, VERSION, stream_id, batches[0][0], len(batches), crc32c(body)) + body
        start, end = batches[0][0], batches[-1][0] + batches[-1][1]
        entries.append((stream_id, start, end, end - start, _BLOCK.size + len(body), position, len(batches)))
    index = b"".join(_ENTRY.pack(*e, 0) for e in entries)
    index_pos = len(out)
    out += index + _FOOTER.pack(index_pos, len(index), crc32c(index), len(entries), VERSION, 0, FOOTER_MAGIC)
    return bytes(out), entries


def decode_object(data: bytes) -> dict[int, list[tuple[int, int, bytes]]]:
    """Every stream's batches, checking magic and checksums (ValueError if corrupt)."""
    index_pos, index_len, index_crc, n, version, reserved, magic = _FOOTER.unpack_from(data, len(data) - _FOOTER.size)
    if magic != FOOTER_MAGIC or version != VERSION or reserved:
        raise ValueError("bad footer")
    index = data[index_pos:index_pos + index_len]
    if crc32c(index) != index_crc:
        raise ValueError("bad index checksum")
    out: dict[int, list] = {}
    for i in range(n):
        sid, start, end, _, size, pos, nb, _ = _ENTRY.unpack_from(index, i * _ENTRY.size)
        magic, version, bsid, bstart, bn, crc = _BLOCK.unpack_from(data, pos)
        body = data[pos + _BLOCK.size:pos + size]
        if magic != BLOCK_MAGIC or bsid != sid or crc32c(body) != crc:
            raise ValueError("bad block")
        p = 0
        for _ in range(bn):
            b, c, length = _BATCH.unpack_from(body, p)
            out.setdefault(sid, []).append((b, c, body[p + _BATCH.size:p + _BATCH.size + length]))
            p += _BATCH.size + length
    return out
