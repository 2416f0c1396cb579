"""Compaction configuration with documented defaults, checked as a whole when created."""
from __future__ import annotations

from dataclasses import dataclass

from s3stream.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True)
class CompactionConfig:
    """How often, how much and how fast compaction reorganises one node's objects.

    sso_interval: seconds between StreamSetObject compactions of the node (AutoMQ: 20 min).
    force_split_age: an SSO whose oldest data is at least this many seconds old is split entirely
        into StreamObjects, so small streams' data does not stay in SSOs for ever (AutoMQ: 120 min).
    split_size: during SSO compaction a stream whose merged data reaches this many bytes leaves as
        its own StreamObject (the engine's default split size, 8 MiB).
    garbage_ratio: an SSO already written by compaction is rewritten before its force-split age
        once at least this fraction of its bytes is trimmed or of deleted streams.
    so_interval: seconds between StreamObject compactions of the streams this node is
        responsible for (AutoMQ: 60 min).
    stream_object_max_size: merged StreamObjects grow up to this many bytes (also bounded by half
        the memory budget, see below).
    small_object_size: only StreamObjects smaller than this take part in merges; bigger ones are
        already cheap to read and are left alone (default: 8 MiB, the split size).
    merge_growth: a group of adjacent small StreamObjects is merged only when the result is at
        least this many times the size of its largest member, so a byte is rewritten at most
        log_growth(small_object_size / smallest object) times.
    memory_budget: the most object bytes compaction holds at once. An output object holds at most
        half of it (its batches plus their encoded copy make the other half), inputs are read
        block range by block range in chunks of at most `read_chunk` bytes, and one commit never
        takes more input bytes than the budget (a larger backlog takes several commits).
    read_chunk: bytes of consecutive blocks fetched by one ranged GET.
    throttle_bytes_per_s: token bucket rate for bytes read plus bytes written (None: unlimited),
        so compaction leaves CPU, disk and network to foreground appends.
    chunk_pause: seconds slept between chunks (0 still yields the GIL to other threads).
    prepared_ttl: seconds an output object id stays PREPARED before the lifecycle may delete it;
        a compaction round must commit within it.
    object_block_size: data block size of output objects (the engine's default, 512 KiB).
    """

    sso_interval: float = 20 * 60.0
    force_split_age: float = 120 * 60.0
    split_size: int = 8 * MiB
    garbage_ratio: float = 0.5
    so_interval: float = 60 * 60.0
    stream_object_max_size: int = 1024 * MiB
    small_object_size: int = 8 * MiB
    merge_growth: float = 2.0
    memory_budget: int = 256 * MiB
    read_chunk: int = 4 * MiB
    throttle_bytes_per_s: int | None = 64 * MiB
    chunk_pause: float = 0.0
    prepared_ttl: float = 3600.0
    object_block_size: int = 512 * KiB

    def __post_init__(self) -> None:
        for name in ("split_size", "stream_object_max_size", "small_object_size", "memory_budget",
                     "read_chunk", "object_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"compaction {name} must be a positive integer, got {value!r}")
        for name in ("sso_interval", "force_split_age", "so_interval", "prepared_ttl"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"compaction {name} must be positive seconds, got "
                                  f"{getattr(self, name)!r}")
        if not self.chunk_pause >= 0:
            raise ConfigError(f"compaction chunk_pause must be >= 0 seconds, got {self.chunk_pause!r}")
        if not 0 < self.garbage_ratio <= 1:
            raise ConfigError(f"compaction garbage_ratio must be in (0, 1], got {self.garbage_ratio!r}")
        if not self.merge_growth > 1:
            raise ConfigError(f"compaction merge_growth must be > 1 (a merge must grow objects), "
                              f"got {self.merge_growth!r}")
        if self.throttle_bytes_per_s is not None and (
                not isinstance(self.throttle_bytes_per_s, int) or self.throttle_bytes_per_s <= 0):
            raise ConfigError(f"compaction throttle_bytes_per_s must be a positive integer or None, "
                              f"got {self.throttle_bytes_per_s!r}")
        if self.memory_budget < 1 * MiB:
            raise ConfigError(f"compaction memory_budget must be at least 1 MiB, got "
                              f"{self.memory_budget}")
        if 4 * self.read_chunk > self.memory_budget:
            raise ConfigError(f"compaction read_chunk ({self.read_chunk}) must be at most a quarter "
                              f"of memory_budget ({self.memory_budget}): a chunk is held raw and "
                              f"decoded next to a half-built output")
        if self.object_block_size < 4 * KiB or 4 * self.object_block_size > self.memory_budget:
            raise ConfigError(f"compaction object_block_size ({self.object_block_size}) must be at "
                              f"least 4 KiB and at most a quarter of memory_budget")
        if self.small_object_size > self.stream_object_max_size:
            raise ConfigError(f"compaction small_object_size ({self.small_object_size}) exceeds "
                              f"stream_object_max_size ({self.stream_object_max_size})")

    @property
    def max_output_size(self) -> int:
        """The largest object compaction writes: a little under half the memory budget (the
        re-encoded copy may carry slightly more block and index headers than its inputs)."""
        return self.memory_budget // 2 - self.memory_budget // 64

    @property
    def merged_object_size(self) -> int:
        """The size merged StreamObjects grow to: the configured maximum within the budget."""
        return min(self.stream_object_max_size, self.max_output_size)

    def check_engine(self, max_batch_bytes: int) -> None:
        """A batch is never split, so the largest block (one batch plus headers) must fit twice
        in an output; ConfigError otherwise."""
        if 2 * (max_batch_bytes + 4 * KiB) > self.max_output_size:
            raise ConfigError(
                f"compaction memory_budget ({self.memory_budget}) is too small for batches of "
                f"max_batch_bytes ({max_batch_bytes}): it must be at least "
                f"{4 * (max_batch_bytes + 4 * KiB)} bytes")
