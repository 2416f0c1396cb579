"""Pure-Python reference of the upload planner (the native one is CacheBlock.plan in
_native/logcache.pyx). Slow and plain: tests compare the two (hypothesis)."""
from __future__ import annotations

from typing import Mapping


def plan_upload(sizes: Mapping[int, int], split_size: int) -> tuple[list[int], list[int]]:
    """The SO/SSO split of one block, from each stream's bytes in it: (stream ids sharing the
    StreamSetObject, stream ids getting a StreamObject each), both ascending. A stream with at
    least `split_size` bytes gets its own StreamObject."""
    stream_set = sorted(s for s, size in sizes.items() if size < split_size)
    stream_objects = sorted(s for s, size in sizes.items() if size >= split_size)
    return stream_set, stream_objects
