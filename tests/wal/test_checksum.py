"""CRC-32C: the native implementations (hardware and table) against known vectors and the
pure-Python twin; objects and WALs of another format version are refused by name."""
from __future__ import annotations

import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import s3stream
import wal
from _native import checksum, objcodec
from s3stream.objectformat import read_blocks, read_index
from s3stream.objectstore import LocalObjectStore
from wal.header import HEADER_SLOT, MAGIC
from wal.reference import crc32c as reference_crc32c

# RFC 3720 (iSCSI), appendix B.4, and the common check value.
VECTORS = [(b"", 0), (b"123456789", 0xE3069283), (bytes(32), 0x8A9136AA), (b"\xff" * 32, 0x62A8AB43),
           (bytes(range(32)), 0x46DD794E)]


def implementations():
    impls = [checksum.crc32c, checksum.crc32c_table, reference_crc32c]
    try:
        checksum.crc32c_hardware(b"")
        impls.append(checksum.crc32c_hardware)
    except RuntimeError:
        pass
    return impls


@pytest.mark.parametrize("data, want", VECTORS)
def test_known_vectors(data, want):
    for crc in implementations():
        assert crc(data) == want, crc.__name__


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000), st.integers(0, 7), st.integers(0, 2 ** 32 - 1))
def test_native_matches_the_twin(data, skip, seed):
    data = data[skip:]
    want = reference_crc32c(data, seed)
    for crc in implementations()[:2] + implementations()[3:]:
        assert crc(data, seed) == want, crc.__name__


@pytest.mark.parametrize("length", [767, 768, 769, 24575, 24576, 24577, 3 * 24576 + 771, 1 << 20])
def test_long_inputs_through_every_path(length):
    """The hardware version interleaves 3 x 8 KiB, then 3 x 256 bytes: cross every boundary,
    at every alignment, and split anywhere (a CRC continues from the one before)."""
    data = os.urandom(length + 8)
    for off in (0, 1, 5):
        chunk = data[off:off + length]
        want = checksum.crc32c_table(chunk)
        assert checksum.crc32c(chunk) == want
        cut = length // 3 + off
        assert checksum.crc32c(chunk[cut:], checksum.crc32c(chunk[:cut])) == want
    if length <= 24577:
        assert reference_crc32c(data[:length]) == checksum.crc32c(data[:length])


def test_a_version_1_wal_is_refused_by_name(tmp_path):
    path = tmp_path / "old.wal"
    w = wal.WriteAheadLog.open(path, node_id=1, config=wal.WALConfig(capacity=1 << 20))
    w.append(b"x").result()
    w.close()
    with open(path, "r+b") as f:                  # what a version-1 build left: version field 1
        for slot in (0, 1):
            f.seek(slot * HEADER_SLOT + len(MAGIC))
            f.write(struct.pack("<I", 1))
    before = path.read_bytes()
    with pytest.raises(wal.WALVersionError, match="format version 1.*version 2"):
        wal.WriteAheadLog.open(path, node_id=1)
    with pytest.raises(wal.WALVersionError):
        wal.WriteAheadLog.open(path, node_id=1, recovery=True)
    assert path.read_bytes() == before            # nothing was overwritten
    wal.WriteAheadLog.open(path, node_id=1, force_format=True).close()


def test_a_version_1_object_is_refused_by_name(tmp_path):
    data, entries = objcodec.encode_object([(7, [(0, 2, b"payload")])], 4096)
    store = LocalObjectStore(str(tmp_path))
    old_footer = bytearray(data)
    struct.pack_into("<H", old_footer, len(data) - 12, 1)           # footer version
    store.put("old-footer", bytes(old_footer))
    with pytest.raises(s3stream.UnsupportedFormatError, match="old-footer.*format version 1"):
        read_index(store, "old-footer", len(data))
    old_block = bytearray(data)
    struct.pack_into("<I", old_block, 4, 1)                          # data block version
    store.put("old-block", bytes(old_block))
    index = read_index(store, "old-block", len(data))
    with pytest.raises(s3stream.UnsupportedFormatError, match="old-block.*data block is format version 1"):
        read_blocks(store, "old-block", index)
    assert isinstance(s3stream.UnsupportedFormatError("x"), s3stream.CorruptDataError)
