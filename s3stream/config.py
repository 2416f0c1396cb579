"""Engine configuration with documented defaults, checked as a whole when created."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import wal
from wal import WALConfig

from .errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: Upload threads by default: half the cores, at least 2 (a PUT to S3 mostly waits on the network)
#: and at most 4. Each encode + PUT keeps a core busy while it runs (the object's copy and CRC, a
#: local store's copy); four of them on a 2-core machine took both cores for each block's ~30 ms
#: upload, and appends waited: open-loop p99 at 1 KiB 12.7-18.2 ms with 4 against 8.5-11.6 ms with
#: 2 (5.7-8.2 with 1), at the same throughput (s3stream bench --kind engine, docs/write-path.md).
DEFAULT_UPLOAD_CONCURRENCY = min(4, max(2, (os.cpu_count() or 4) // 2))

#: PUTs in flight by default (Config.put_concurrency): enough to keep one hot stream's 16 MiB
#: objects going behind S3 Standard's 30-150 ms PUTs; encodes stay at upload_concurrency.
DEFAULT_PUT_CONCURRENCY = 8


@dataclass(frozen=True)
class Config:
    """How the engine batches, uploads, caches and reads.

    upload_threshold: the log cache's active block is sealed and uploaded at this many bytes.
        AutoMQ's library default is 100 MiB; 64 MiB here keeps the WAL (2 GiB) and memory of a
        2-core, 24 GiB machine far from full while still making large objects.
    upload_interval: the visibility deadline: seconds after its oldest record came that the
        active block is uploaded whatever its size, so that readers that are not nodes
        (`open_reader`, another process, Spark) see every acknowledged record within about this
        plus a PUT and a commit. 0.5 (default): about 1 s p99 end to end, and a node with
        little traffic makes at most 2 PUTs a second (each a StreamSetObject carrying every
        stream's tail, committed in one metadata transaction): ~5.2 million PUTs, ~$26 a month at S3 Standard's $0.005 per
        1,000 (uploads at size or split_size come first under load, so it costs nothing more
        then). None: never (uploads at size, split_size, a close or WAL pressure only; readers
        see a quiet stream's tail only once it closes).
    split_size: a stream whose slice of the active block reaches this many bytes uploads it at
        once as its own StreamObject (a cut: slices of at least 3/4 of it go along, each its own
        object; the other streams keep filling); in a block sealed for another reason a stream
        with at least this many bytes gets its own StreamObject and the rest share one
        StreamSetObject. 16 MiB: objects near it, one PUT each below S3's multipart threshold
        (32 MiB), make about 68 requests per GiB under load against a floor of 64 (issue 51; 8 MiB
        made ~130). AutoMQ brokers use 8 MiB.
    object_block_size: data block size inside objects, the unit of ranged reads (brokers: 512 KiB).
    max_batch_bytes: largest RecordBatch payload accepted by append.
    cache_size: log cache bytes: data not yet committed plus the recent tail kept for reads. An
        append waits while uncommitted data alone would exceed it (backpressure). Chunks of
        evicted blocks are kept for reuse up to half of it more (touching fresh memory costs
        13x a copy into warm memory on the reference machine).
    block_cache_size: object blocks kept for reads (LRU). GETs in flight hold up to half of it
        more; read-ahead waits for room below that bound (s3stream/engine/readpath.py).
    readahead_bytes: the largest read-ahead window of one stream. A sequential reader's window
        starts at two GETs (2 x read_fetch_size) and doubles each time the reader catches up
        with it, up to this.
    read_fetch_size: bytes per ranged GET; a larger fetch or window is that many GETs at once.
        None (default): 4 MiB, or a quarter of block_cache_size if that is smaller; at most a
        quarter of block_cache_size (cached blocks are kept and evicted a GET at a time).
    read_concurrency: threads that run read-ahead and parallel GETs.
    read_timeout: seconds a read waits for a GET running on another thread (read-ahead's, or
        another reader's) before failing with ObjectStoreError. A reader's own GET is bounded
        by the store (S3: connect_timeout, read_timeout and max_attempts of the URL).
    upload_concurrency: threads that encode and PUT objects (objects in flight at once; default
        half the cores, between 2 and 4: DEFAULT_UPLOAD_CONCURRENCY says why); each
        keeps one encode buffer as large as the largest object it made (at most about
        upload_threshold), reused so that uploads do not fault in fresh memory.
    put_concurrency: PUTs of objects in flight at once (their threads wait on the store; only
        upload_concurrency of them encode at a time). None (default): max(8, upload_concurrency).
        A PUT to S3 mostly waits (30-150 ms): one hot stream with 2 PUTs in flight made 0.49 of
        the WAL alone behind S3-like latency (issue 51). Each PUT in flight holds its encoded
        object (bounded by the upload pipeline's bytes); idle threads keep at most
        upload_concurrency encode buffers. A store whose PUT is a copy on this machine's cores
        (a local directory: `cpu_bound_puts`) gets upload_concurrency PUTs in flight.
    upload_nice: how much lower the CPU priority of those encode-and-PUT threads is than the
        process's (Linux nice, per thread; 0 keeps it, 19 is the lowest). Encoding and the PUT's
        copy keep a core busy each; at 10, appenders and the WAL writer run first when the cores
        are short and uploads use what is left (RocksDB lowers its compaction threads the same
        way). On 2 cores the open-loop append p99 at 1 KiB went from 11.4 to 8.2-8.9 ms, at the
        same throughput (docs/write-path.md). Only ever lowered: never needs privileges.
    upload_idle: run those threads under SCHED_IDLE (Linux) while uploads keep up, so that an
        appender or the WAL writer that wakes takes the core at once instead of waiting for the
        upload thread's time slice to end (a nice value only shares the core). Once uploads fall
        behind (a sealed block waits for a pipeline slot, half of cache_size is uncommitted, or
        the WAL is past wal_pressure) the threads return to upload_nice at once, so a busy host
        cannot starve them. Leaving SCHED_IDLE needs root, CAP_SYS_NICE or an RLIMIT_NICE
        allowing upload_nice; without it (probed at start) the threads stay at upload_nice. On
        2 cores, 1 KiB records at 500,000/s, alternating processes: open-loop p99 3.7-4.8 ms
        against 6.2-9.7 ms with upload_idle=False (nice 19 instead of 10 gave 5.5-6.5 ms).
    upload_pipeline: sealed blocks uploading at once (plan, prepare, encode, PUT); their commits
        stay in block order. Smaller blocks (cuts of split_size, deadline uploads) may go in
        greater number, up to 4 x upload_pipeline, within upload_pipeline x upload_threshold
        bytes in flight. With a 150 ms PUT latency and 4 upload threads, 1 gave 210 MB/s and
        2-4 about 300 MB/s here; 3 leaves room for slower stores.
    stream_tail_limit: most bytes of one stream durable in the WAL but carried by no PUT yet
        (none started), whatever the load: what a move of the stream must PUT at its close (it
        commits the StreamObjects already PUT as they are, and waits, at most a usual PUT's
        time, for those whose PUT is running, issue 51). An append that would pass it waits
        until PUTs carry enough (backpressure on that stream only), first cutting the stream's
        slice out of the active block if the part already sealed would not free enough. Streams
        upload at split_size anyway (a cut), so this bound is backpressure for when uploads fall
        behind: a stream's throughput is bounded by PUTs, not by commit round trips (bytes PUT
        but not yet committed are bounded by cache_size). None (default): twice split_size (32
        MiB: the active slice and one cut waiting for an upload thread), at least max_batch_bytes and at
        most half of cache_size. The 8 MiB it was (issue 28) counted bytes until their commit and
        sealed whole blocks at every wait: 1-2 MiB objects under load. 0: no bound but
        cache_size.
    wal_pressure: fraction of the WAL's capacity; when the untrimmed part of the WAL passes it,
        the active block is sealed and uploaded whatever its size (if it holds at least half of
        the untrimmed span), so small records that fill the WAL faster than the cache (each
        synchronous append takes a 4 KiB WAL block) never wedge the engine.
    prepared_ttl: seconds a PREPARED object id stays valid; one never committed is deleted after.
    append_timeout: seconds an append may wait for backpressure (cache or WAL) before failing.
    close_timeout: seconds StreamClient.close() waits in all for uploads when given no timeout;
        past it, streams not uploaded stay OPENED with their data in the WAL (replayed at the next
        start) and close() reports them, so a store that is down cannot hold close() forever.
    reclaim_interval: seconds between runs of the object reclaimer (expired PREPARED objects,
        destroyed objects past destroy_delay); None disables it on this client.
    destroy_delay: seconds a MARK_DESTROYED object stays readable for in-flight readers.
    offset_reservation: offsets of a stream reserved in metadata for its owner ahead of its
        appends (at each open; extended in the background when half is used, and before the
        append that would pass it). A node never takes an offset beyond its reservation, so if
        its host dies with its WAL, `s3stream node forget --wal-lost` gives up at most this many
        offsets per stream and no offset it acknowledged is ever reused. At 2 million records a
        second into one stream, one extension (a metadata write) per quarter second.
    wal: configuration of the write-ahead log (capacity 2 GiB by default). The WAL holds what
        was acknowledged and not yet uploaded, so its capacity is one of three bounds on how long
        appends are acknowledged while uploads fail, the smallest winning: cache_size (512 MiB),
        stream_tail_limit per stream (8 MiB), and the capacity, which an append waited for one
        at a time fills by at least 4 KiB (1 KiB records written so fill it 4x faster than their
        size). Past the bound appends wait, then fail after append_timeout with WALFullError;
        nothing acknowledged is lost. Measured with every PUT failing, 64 KiB appends over 256
        streams: 250 MiB acknowledged with a 256 MiB WAL, 508 MiB with 1 GiB and with 2 GiB
        (cache_size bound them); 1 KiB appends one at a time: 63 MiB with 256 MiB. Size it as
        ingest rate x the upload outage to ride through, and at least (upload_pipeline + 1) x
        upload_threshold / wal_pressure (512 MiB with the defaults), so that the blocks being
        uploaded do not put the WAL under pressure; raise cache_size (and stream_tail_limit,
        for few streams) to match: Config(cache_size=1 << 30, wal=wal.WALConfig(capacity=4 << 30,
        full_timeout=60.0)). An existing WAL keeps the capacity it was made with; another
        explicit one is refused (start on a new WAL path after a clean close). A new WAL file is
        reserved whole at once (posix_fallocate) and zero-filled once, in the background, while
        appends run (2 GiB in 1.1-2.2 s here, writing 2 GiB to the disk); later starts do not
        fill it again. A WAL of objects has no file: the capacity bounds its untrimmed objects.
    """

    upload_threshold: int = 64 * MiB
    upload_interval: float | None = 0.5
    split_size: int = 16 * MiB
    object_block_size: int = 512 * KiB
    max_batch_bytes: int = 8 * MiB
    cache_size: int = 512 * MiB
    block_cache_size: int = 128 * MiB
    readahead_bytes: int = 32 * MiB
    read_fetch_size: int | None = None
    read_concurrency: int = 4
    read_timeout: float = 60.0
    upload_concurrency: int = DEFAULT_UPLOAD_CONCURRENCY
    upload_nice: int = 10
    upload_idle: bool = True
    upload_pipeline: int = 3
    put_concurrency: int | None = None
    stream_tail_limit: int | None = None
    wal_pressure: float = 0.5
    prepared_ttl: float = 3600.0
    append_timeout: float = 60.0
    close_timeout: float = 120.0
    reclaim_interval: float | None = 60.0
    destroy_delay: float = 60.0
    offset_reservation: int = 1 << 20
    wal: WALConfig = field(default_factory=lambda: WALConfig(capacity=2 * GiB, full_timeout=60.0))

    def __post_init__(self) -> None:
        if not isinstance(self.wal, WALConfig):
            raise ConfigError(f"wal must be a wal.WALConfig, got {self.wal!r} ({type(self.wal).__name__}); "
                              "e.g. Config(wal=wal.WALConfig(capacity=4 << 30))")
        for name in ("prepared_ttl", "append_timeout", "close_timeout", "destroy_delay", "read_timeout",
                     "wal_pressure", "upload_interval", "reclaim_interval"):
            value = getattr(self, name)
            if (value is None and name in ("upload_interval", "reclaim_interval")):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
        if self.read_fetch_size is None and isinstance(self.block_cache_size, int):
            object.__setattr__(self, "read_fetch_size", max(4 * KiB, min(4 * MiB, self.block_cache_size // 4)))
        if self.put_concurrency is None and isinstance(self.upload_concurrency, int):
            object.__setattr__(self, "put_concurrency", max(DEFAULT_PUT_CONCURRENCY, self.upload_concurrency))
        positive = ("upload_threshold", "split_size", "object_block_size", "max_batch_bytes", "cache_size",
                    "block_cache_size", "readahead_bytes", "read_fetch_size", "read_concurrency", "upload_concurrency",
                    "upload_pipeline", "offset_reservation", "put_concurrency")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if (self.put_concurrency or 0) < self.upload_concurrency:
            raise ConfigError(f"put_concurrency ({self.put_concurrency}) < upload_concurrency "
                              f"({self.upload_concurrency}): every encoding thread PUTs what it encoded; raise "
                              "put_concurrency or leave it None")
        if self.stream_tail_limit is None and isinstance(self.cache_size, int) and isinstance(self.max_batch_bytes, int):
            object.__setattr__(self, "stream_tail_limit", max(self.max_batch_bytes, min(
                2 * self.split_size if isinstance(self.split_size, int) else 0, self.cache_size // 2)))
        if self.stream_tail_limit != 0 and (
                isinstance(self.stream_tail_limit, bool) or not isinstance(self.stream_tail_limit, int)
                or not self.max_batch_bytes <= self.stream_tail_limit <= self.cache_size // 2):
            raise ConfigError(
                f"stream_tail_limit must be an integer from max_batch_bytes ({self.max_batch_bytes}) to half of "
                f"cache_size ({self.cache_size // 2}), 0 (no bound) or None (the default), got "
                f"{self.stream_tail_limit!r}")
        if self.split_size > self.upload_threshold:
            raise ConfigError(
                f"split_size ({self.split_size}) > upload_threshold ({self.upload_threshold}): no stream "
                "could ever reach the split size inside one block; lower split_size or raise the threshold")
        if self.cache_size < 2 * self.upload_threshold:
            raise ConfigError(
                f"cache_size ({self.cache_size}) must hold at least two blocks of upload_threshold "
                f"({self.upload_threshold}): one filling while one uploads")
        assert self.read_fetch_size is not None     # set above, and checked positive
        if self.read_fetch_size > self.block_cache_size // 4:
            raise ConfigError(
                f"read_fetch_size ({self.read_fetch_size}) exceeds a quarter of block_cache_size "
                f"({self.block_cache_size}): the block cache keeps whole GETs; lower read_fetch_size or leave it "
                f"None (the default picks min(4 MiB, block_cache_size / 4))")
        if self.object_block_size < 4 * KiB:
            raise ConfigError(f"object_block_size must be at least 4 KiB, got {self.object_block_size}")
        if self.max_batch_bytes > self.upload_threshold:
            raise ConfigError(
                f"max_batch_bytes ({self.max_batch_bytes}) exceeds upload_threshold ({self.upload_threshold})")
        if isinstance(self.upload_nice, bool) or not isinstance(self.upload_nice, int) or not 0 <= self.upload_nice <= 19:
            raise ConfigError(f"upload_nice must be an integer from 0 (the process's priority) to 19 (the lowest), "
                              f"got {self.upload_nice!r}")
        if not isinstance(self.upload_idle, bool):
            raise ConfigError(f"upload_idle must be True or False, got {self.upload_idle!r}")
        if not (isinstance(self.wal_pressure, (int, float)) and 0.1 <= self.wal_pressure <= 0.9):
            raise ConfigError(f"wal_pressure must be a fraction between 0.1 and 0.9, got {self.wal_pressure!r}")
        if self.upload_interval is not None and not self.upload_interval > 0:
            raise ConfigError(f"upload_interval must be positive seconds or None, got {self.upload_interval}")
        if self.reclaim_interval is not None and not self.reclaim_interval > 0:
            raise ConfigError(f"reclaim_interval must be positive seconds or None, got {self.reclaim_interval}")
        for name in ("prepared_ttl", "append_timeout", "close_timeout", "destroy_delay", "read_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive seconds, got {getattr(self, name)}")
        wal_capacity = self.wal.capacity or wal.config.DEFAULT_CAPACITY
        if wal_capacity < 2 * self.upload_threshold:
            raise ConfigError(
                f"the WAL capacity ({wal_capacity}) must be at least twice upload_threshold "
                f"({self.upload_threshold}) so appends continue while a block uploads")
        if self.wal.max_record_bytes is not None and self.wal.max_record_bytes < self.max_batch_bytes + 64:
            raise ConfigError(
                f"wal.max_record_bytes ({self.wal.max_record_bytes}) must exceed max_batch_bytes "
                f"({self.max_batch_bytes}) plus the record header")

    @property
    def wal_config(self) -> WALConfig:
        """The WAL config, with a record limit that fits max_batch_bytes."""
        if self.wal.max_record_bytes is None:
            from dataclasses import replace
            return replace(self.wal, max_record_bytes=self.max_batch_bytes + 64)
        return self.wal
