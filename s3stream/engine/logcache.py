"""The log cache: durable records batched per stream in blocks, until uploaded and beyond.

Native (_native/logcache.pyx, which states the rules): the engine's append path copies each
payload into its stream's slice of the active block right after placing the record in the WAL;
sealed blocks are planned and encoded into objects straight from those buffers.
"""
from __future__ import annotations

from typing import Callable

from _native.logcache import ACTIVE, COMMITTED, SEALED, CacheBlock, CacheSlice, LogCache, encode_slices

from ..config import Config
from ..batches import FetchedBatch

__all__ = ["ACTIVE", "COMMITTED", "SEALED", "CacheBlock", "CacheSlice", "LogCache", "encode_slices",
           "new_log_cache"]


def new_log_cache(config: Config, clock: Callable[[], int]) -> LogCache:
    """The log cache a client (or a failover) uses under `config`; reads return FetchedBatch."""
    return LogCache(config.upload_threshold, config.cache_size, clock, FetchedBatch, config.split_size)
