"""WAL configuration with documented, measured defaults."""
from __future__ import annotations

from dataclasses import dataclass

from _native.walrecord import BLOCK, HEADER_AREA, RECORD_HEADER

from .errors import WALConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: Data capacity given to a new WAL file when the config names none (AutoMQ's default).
DEFAULT_CAPACITY = 2 * GiB
#: Smallest data area accepted: a few batches must fit.
MIN_DATA_CAPACITY = 64 * KiB
#: How a new WAL file gets its space (WALConfig.preallocate).
PREALLOCATE_MODES = ("background", "zeros", "fallocate")
#: The most PUTs an object WAL keeps in flight (wal.objectlog.DATA_GAP relies on the bound).
MAX_PUTS_IN_FLIGHT = 64


@dataclass(frozen=True)
class WALConfig:
    """How a WAL is laid out and written.

    capacity: total bytes of a new WAL file, header included (None: 2 GiB). An existing WAL
        keeps the capacity in its header; a different explicit value is an error. Block devices
        use their whole size.
    batch_bytes: the most bytes one batch (one pwrite) carries. 1 MiB: sequential O_DIRECT +
        fdatasync writes here reach ~780 MB/s at 1 MiB against ~670 MB/s at 256 KiB.
    buffers: batch buffers; at most `buffers - 1` are in flight while one batch fills, so WAL
        memory is bounded by `buffers * batch_bytes`. A writer that finds sealed batches queued
        behind the one it takes writes them in the same group, with one fdatasync for all.
    writer_threads: threads issuing pwrite + fdatasync (the GIL is never held by them).
    full_timeout: seconds an append waits for ring space (trim) or a free buffer before
        raising WALFullError.
    max_record_bytes: largest record body (None: a quarter of the data capacity, at most 64 MiB).
    direct_io: None tries O_DIRECT and falls back to buffered writes + fdatasync where the
        filesystem refuses it; True requires it; False never uses it.
    object_bytes, puts_in_flight, put_interval, seal_bytes, hedge_quantile, recovery_threads,
    fence_attempts, put_retry_seconds, put_retry_max: a WAL kept as objects
        (wal.objectlog.ObjectWAL; the file's settings batch_bytes, writer_threads, direct_io and
        preallocate do not apply to it, `capacity` bounds its bytes not yet trimmed and
        `buffers` its batches in memory, at least puts_in_flight + 2). An object holds one batch
        of at most `object_bytes` (a larger record gets one of its own). `puts_in_flight` PUTs
        run at once, each on its own thread; a writer that is free seals the open batch at once
        (group commit across PUTs) unless the previous PUT started less than `put_interval`
        seconds ago and it holds less than `seal_bytes` (0: no such size): at low load that
        bounds the PUT rate to 1 / put_interval (a record waits at most that long for its PUT
        to start), while at high load, where objects fill up, nothing waits for the interval.
        put_interval 0.05 (default): at most 20 PUTs a second while appends come, ~$259 a month
        at S3 Standard's request price, an acknowledgement within a PUT's latency plus 50 ms;
        0.005 for S3 Express One Zone-like stores (~5 ms PUTs): 200 a second, ~$586 a month at
        Express prices ($2,592 at Standard's). docs/wal-format.md has the table (issue 51). A
        data PUT still unanswered after the `hedge_quantile` of the last 200 PUTs' latencies (0:
        never) gets a twin racing it, the first answer counting: about 1 - hedge_quantile more
        PUTs for a bounded tail (wal.objectlog). `recovery_threads` GETs run at once during
        recovery. Opening fences earlier writers by taking the next sequence: `fence_attempts`
        tries when another writer keeps taking it. A PUT the store fails is retried with
        backoff up to `put_retry_max` seconds between tries for as long as the WAL is open (a
        fenced or permanent error stops it); a fence for `put_retry_seconds`.
    preallocate: how a new WAL file gets its space. "background" (default): `posix_fallocate`
        (instant), then the writer session zero-fills the data area in a thread while appends
        run; appends never pass the filled end (they wait for it, see docs/wal-format.md,
        invariant 8). "zeros" writes the whole file before `open` returns (seconds for 2 GiB;
        later O_DIRECT writes need no extent conversion). "fallocate" is instant and never
        filled: every write of the first lap converts an unwritten extent (slower).
        Measured here in one run (`python -m benchmarks.wal_disk --first-start --capacity 2G`, medians of
        3 rounds, 128 KiB records, 1 MiB batches; the disk drifts between runs): open of a new
        2 GiB WAL to its first durable append 0.025 s background, 2.64 s zeros, 0.007 s
        fallocate; appends over the first lap 874, 1478, 980 MB/s (background shares the disk
        with its filler, which finished 2 GiB of zeros while the ring wrote its first ~400 MB);
        second lap 1666, 1633, 1646 MB/s. So background reaches the end of the first lap
        sooner than zeros (2.5 s against 4.1 s from open) and equals it afterwards.
    """

    capacity: int | None = None
    batch_bytes: int = 1 * MiB
    buffers: int = 4
    writer_threads: int = 1
    full_timeout: float = 30.0
    max_record_bytes: int | None = None
    direct_io: bool | None = None
    preallocate: str = "background"
    object_bytes: int = 2 * MiB
    puts_in_flight: int = 8
    put_interval: float = 0.05
    seal_bytes: int = 0
    hedge_quantile: float = 0.9
    recovery_threads: int = 16
    fence_attempts: int = 20
    put_retry_seconds: float = 30.0
    put_retry_max: float = 0.5

    def __post_init__(self) -> None:
        # Types first: a float or a bool would pass the range checks and break the ring later.
        for name, optional in (("capacity", True), ("batch_bytes", False), ("buffers", False),
                               ("writer_threads", False), ("max_record_bytes", True), ("object_bytes", False),
                               ("seal_bytes", False), ("puts_in_flight", False), ("recovery_threads", False),
                               ("fence_attempts", False)):
            value = getattr(self, name)
            if (value is None and not optional) or (value is not None and (
                    isinstance(value, bool) or not isinstance(value, int))):
                raise WALConfigError(f"{name} must be an int{' or None' if optional else ''}, got {value!r} "
                                     f"({type(value).__name__})")
        if isinstance(self.full_timeout, bool) or not isinstance(self.full_timeout, (int, float)):
            raise WALConfigError(f"full_timeout must be a number of seconds, got {self.full_timeout!r}")
        if self.direct_io is not None and not isinstance(self.direct_io, bool):
            raise WALConfigError(f"direct_io must be None, True or False, got {self.direct_io!r}")
        if self.capacity is not None:
            self.check_capacity(self.capacity, "capacity")
        if self.batch_bytes < 2 * BLOCK or self.batch_bytes % BLOCK:
            raise WALConfigError(
                f"batch_bytes must be a multiple of {BLOCK} and at least {2 * BLOCK}, got {self.batch_bytes}")
        if not 2 <= self.buffers <= 256:
            raise WALConfigError(f"buffers must be between 2 and 256, got {self.buffers}")
        if not 1 <= self.writer_threads <= 16:
            raise WALConfigError(f"writer_threads must be between 1 and 16, got {self.writer_threads}")
        if self.writer_threads >= self.buffers:
            raise WALConfigError(
                f"writer_threads ({self.writer_threads}) must be below buffers ({self.buffers}): "
                "one buffer must stay free to gather the next batch")
        if not self.full_timeout > 0:
            raise WALConfigError(f"full_timeout must be positive seconds, got {self.full_timeout}")
        if self.max_record_bytes is not None and self.max_record_bytes < 1:
            raise WALConfigError(f"max_record_bytes must be positive, got {self.max_record_bytes}")
        if isinstance(self.hedge_quantile, bool) or not isinstance(self.hedge_quantile, (int, float)) or not (
                self.hedge_quantile == 0 or 0.5 <= self.hedge_quantile < 1):
            raise WALConfigError(f"hedge_quantile must be 0 (no hedging) or in [0.5, 1), got {self.hedge_quantile!r}")
        for name in ("put_interval", "put_retry_seconds", "put_retry_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise WALConfigError(f"{name} must be a non-negative number of seconds, got {value!r}")
        if self.object_bytes < 2 * BLOCK or self.object_bytes % BLOCK:
            raise WALConfigError(
                f"object_bytes must be a multiple of {BLOCK} and at least {2 * BLOCK}, got {self.object_bytes}")
        if self.seal_bytes < 0:
            raise WALConfigError(f"seal_bytes must be 0 (none) or a positive number of bytes, got {self.seal_bytes}")
        if not 1 <= self.puts_in_flight <= MAX_PUTS_IN_FLIGHT:
            raise WALConfigError(f"puts_in_flight must be between 1 and {MAX_PUTS_IN_FLIGHT}, got {self.puts_in_flight}")
        if not 1 <= self.recovery_threads <= 256:
            raise WALConfigError(f"recovery_threads must be between 1 and 256, got {self.recovery_threads}")
        if self.fence_attempts < 1:
            raise WALConfigError(f"fence_attempts must be at least 1, got {self.fence_attempts}")
        if self.preallocate not in PREALLOCATE_MODES:
            raise WALConfigError(f"preallocate must be one of {', '.join(map(repr, PREALLOCATE_MODES))}, "
                                 f"got {self.preallocate!r}")

    @staticmethod
    def check_capacity(capacity: int, what: str) -> None:
        if capacity % BLOCK:
            raise WALConfigError(f"WAL {what} must be a multiple of {BLOCK} bytes, got {capacity}")
        if capacity - HEADER_AREA < MIN_DATA_CAPACITY:
            raise WALConfigError(
                f"WAL {what} of {capacity} bytes is too small: it needs {HEADER_AREA} header bytes "
                f"plus at least {MIN_DATA_CAPACITY} of data area")

    def record_limit(self, data_capacity: int) -> int:
        """The maximum record body for a ring of `data_capacity` bytes."""
        fits = data_capacity - RECORD_HEADER - 2 * BLOCK
        limit = self.max_record_bytes if self.max_record_bytes is not None else min(64 * MiB, data_capacity // 4)
        if limit > fits:
            raise WALConfigError(
                f"max_record_bytes {limit} cannot fit a WAL whose data area is {data_capacity} bytes "
                f"(at most {fits})")
        return limit
