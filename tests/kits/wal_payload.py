"""Deterministic, self-describing record payloads for crash tests."""
import hashlib
import random
import struct

PREFIX = struct.Struct("<IIII")  # round, thread, seq, length
SIZES = [1, 16, 100, 1000, 4000, 4100, 20000, 60000]


def make_payload(rnd: int, thread: int, seq: int) -> bytes:
    n = random.Random(rnd * 1_000_003 + thread * 10_007 + seq).choice(SIZES)
    prefix = PREFIX.pack(rnd, thread, seq, n)
    filler = hashlib.blake2b(prefix).digest()
    return (prefix + filler * (n // len(filler) + 1))[:max(n, PREFIX.size)]


def parse_payload(data: bytes) -> tuple[int, int, int]:
    """(round, thread, seq) of a payload; AssertionError if it is not exactly what make_payload gives."""
    rnd, thread, seq, _ = PREFIX.unpack_from(data)
    assert data == make_payload(rnd, thread, seq), "payload bytes differ from what was appended"
    return rnd, thread, seq
