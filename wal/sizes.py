"""Sizes as people write them on a command line: `parse_size` ('64K', '1.5G') and `fmt_size`
(64 KiB), binary units. The CLI's options and every benchmark parse with these."""
from __future__ import annotations

import argparse
import re

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1024 * GiB}

def parse_size(text: str) -> int:
    """'4K', '64KiB', '1M', '1.5G', '4096' -> bytes (binary units)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 4K, 64KiB, 1M, 1G)")
    return int(float(m.group(1)) * _UNIT[m.group(2).lower()])


def fmt_size(n: int) -> str:
    """Bytes as the largest binary unit that divides them: '64 KiB', '2 GiB', '100 B'."""
    for unit, f in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"
