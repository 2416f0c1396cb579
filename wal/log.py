"""WriteAheadLog: a crash-safe ring of records on a file or a raw block device.

Contract:
- `append(data)` returns an AppendHandle at once; `handle.result()` returns once the record is
  durable (written and flushed). Records are acknowledged in offset order. With an
  acknowledgment deadline (`set_ack_deadline`, a lease), a record is acknowledged only if it was
  durable before the deadline; later ones wait for the next deadline or fail on `revoke_acks`.
- `recover()` yields every record after the trim offset that is intact and continuous, in order,
  and stops cleanly at the first torn, stale or corrupt one. Call it before the first append.
- `trim(offset)` is durable when it returns; space before it may then be overwritten, and
  nothing else ever is (a full ring makes appends wait, then fail with WALFullError).
- The header names the owning node and its epoch: a WAL of another node is refused unless it is
  opened with `recovery=True` (read-only, for failover); an opener with an older epoch is fenced.
"""
from __future__ import annotations

import fcntl
import logging
import os
import stat
import struct
import threading
import time
from typing import Iterator, NamedTuple

from _native import walrecord
from _native.walio import AlignedBuffer, datasync
from _native.walring import Ring
from _native.walscan import Scanner, probe

from .config import DEFAULT_CAPACITY, WALConfig
from .errors import (
    ForeignWALError, RecordTooLargeError, WALClosedError, WALConfigError, WALCorruptError,
    WALFencedError, WALFullError, WALInUseError, WALIOError, WALMidLogCorruptError, WALVersionError,
)
from .fill import ZeroFiller
from .header import VERSION, Header, SlotState, pick_header, slot_version
from .ringwal import RingWAL

log = logging.getLogger("wal")

BLOCK = walrecord.BLOCK
HEADER_AREA = walrecord.HEADER_AREA
HEADER_SLOT = walrecord.HEADER_SLOT
BLKGETSIZE64 = 0x80081272
_ZERO_CHUNK = 1 << 20


class Record(NamedTuple):
    offset: int   # logical WAL offset of the record
    data: bytes

    @property
    def end(self) -> int:
        """The logical offset just past this record: trim to it once its data is safe."""
        return self.offset + walrecord.RECORD_HEADER + len(self.data)


class RecoveryResult(NamedTuple):
    end: int              # where a new writer session resumes
    records: int
    record_bytes: int
    stop_reason: str


def find_gap(fd: int, header: Header, data_capacity: int, scanner: Scanner) -> tuple[int, int, int, int] | None:
    """Tell a torn tail from damage in the middle of the log, once `scanner` (from the trim
    offset) has stopped. A crash leaves, after the first batch that did not land, at most
    `header.inflight_batches` whole batches of the same session (written by other writer
    threads), all within that many batches' bytes. So if valid records of the session (generation
    at least that of the last good record) go on past the damage through more batches than that,
    or farther, they were acknowledged: returns (damaged offset, first valid offset after it, end
    of the valid records there, how many), else None. A header without the extension (a WAL of
    an earlier build) is never judged."""
    if not header.batch_bytes or scanner.stop_reason == walrecord.STOP_END_OF_SPACE:
        return None
    bad = walrecord.next_record_start(scanner.end)
    window = (header.inflight_batches + 2) * header.batch_bytes
    space_end = header.trim_offset + data_capacity
    resync = probe(fd, HEADER_AREA, data_capacity, bad + 1, min(space_end, bad + window), scanner.last_generation)
    if resync < 0:
        return None
    after = Scanner(fd, HEADER_AREA, data_capacity, resync)
    for _ in after:
        pass
    end = min(after.end, space_end)
    if after.paddings <= header.inflight_batches + 1 and end <= bad + window:
        return None
    return bad, resync, end, after.records


def read_header(path: str | os.PathLike) -> tuple[Header | None, tuple[str, str]]:
    """The newest valid header of the WAL at `path` (None if neither slot is valid) and the
    states of both header slots (SlotState values: empty, valid, corrupt, other version,
    foreign). Reads only the header area, read-only and without the WAL's lock, so it works on
    any node's WAL, in use or not (on a WAL being written it is a snapshot). Raises
    WALCorruptError if the file is too small to hold a header."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read(HEADER_AREA)
    if len(raw) < HEADER_AREA:
        raise WALCorruptError(f"{path} is {len(raw)} bytes, too small to be a WAL (its header alone takes "
                              f"{HEADER_AREA})")
    return pick_header(raw[:HEADER_SLOT], raw[HEADER_SLOT:HEADER_AREA])


def salvage(path: str | os.PathLike, *, apply: bool = False) -> dict:
    """Look for damage in the middle of the WAL at `path` (what open refuses with
    WALMidLogCorruptError) and, with `apply=True`, cover the damaged span with padding records so
    that the valid records after it are recovered again; everything in the span is lost. The
    header then records `salvaged_end`, below which the engine's replay accepts that a stream's
    offsets stop at a gap (it keeps what comes before and reports what it drops). Needs the WAL
    not in use. Returns what was found and done; the log is unchanged without `apply`."""
    path = os.fspath(path)
    WriteAheadLog.check_not_in_use(path)
    fd, _ = WriteAheadLog._open_fd(path, WALConfig(), read_only=not apply)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        buf = AlignedBuffer(HEADER_AREA)
        buf.pread(fd, HEADER_AREA, 0)
        raw = bytes(buf)
        header, states = pick_header(raw[:HEADER_SLOT], raw[HEADER_SLOT:])
        if header is None:
            raise WALCorruptError(f"{path!r} holds no valid WAL header ({states[0]}, {states[1]}): "
                                  "nothing to salvage")
        cap = header.capacity - HEADER_AREA
        scanner = Scanner(fd, HEADER_AREA, cap, header.trim_offset)
        for _ in scanner:
            pass
        report = dict(path=path, trim_offset=header.trim_offset, valid_end=scanner.end,
                      records_before=scanner.records, damaged=False, applied=False)
        gap = find_gap(fd, header, cap, scanner)
        if gap is None:
            return report
        bad, resync, end, n = gap
        report.update(damaged=True, bad_offset=bad, resync_offset=resync, end=end, records_after=n,
                      lost_bytes=resync - bad)
        if not apply:
            return report
        pos = bad
        while pos < resync:        # one padding record per ring lap the span touches
            seg_end = min(resync, (pos // cap + 1) * cap)
            block = pos - pos % BLOCK
            page = AlignedBuffer(BLOCK)
            page.pread(fd, BLOCK, HEADER_AREA + block % cap)
            rec = walrecord.encode_record(pos, scanner.last_generation, bytes(seg_end - pos - walrecord.RECORD_HEADER),
                                          walrecord.TYPE_PADDING)
            memoryview(page)[pos - block:pos - block + walrecord.RECORD_HEADER] = rec[:walrecord.RECORD_HEADER]
            page.pwrite(fd, BLOCK, HEADER_AREA + block % cap)
            pos = seg_end
        datasync(fd)
        WriteAheadLog._write_slot(fd, header.next(write_time_ns=time.time_ns(),
                                                  salvaged_end=max(header.salvaged_end, end)))
        check = Scanner(fd, HEADER_AREA, cap, header.trim_offset)
        for _ in check:
            pass
        if check.end < end:
            raise WALCorruptError(f"salvage of {path!r} covered [{bad}, {resync}) but the log still reads "
                                  f"only to {check.end}, not {end}: more damage lies beyond; run it again")
        report.update(applied=True, valid_end=check.end)
        log.warning("WAL %s salvaged: [%d, %d) covered with padding (%d bytes lost); %d records after it kept",
                    path, bad, resync, resync - bad, n)
        return report
    except BlockingIOError:
        raise WALInUseError(f"WAL {path!r} is in use by another writer on this host; stop it first") from None
    finally:
        os.close(fd)


class WriteAheadLog(RingWAL):
    """A WAL on one file or block device. Open with `WriteAheadLog.open(...)`."""

    def __init__(self, *, path: str, fd: int, header: Header, config: WALConfig, node_id: int,
                 node_epoch: int, direct_io: bool, block_device: bool, recovery: bool) -> None:
        self._path = path
        self._fd = fd
        self._header = header
        self._config = config
        self._node_id = node_id
        self._node_epoch = node_epoch
        self._direct_io = direct_io
        self._block_device = block_device
        self._recovery = recovery
        self._data_capacity = header.capacity - HEADER_AREA
        # A read-only recovery open writes nothing: the record limit only matters to writers.
        self._max_record = 0 if recovery else config.record_limit(self._data_capacity)
        self._previous_clean = header.clean_shutdown
        self._lock = threading.RLock()          # lifecycle: start, trim, close
        self._ring: Ring | None = None
        self._writers: list[threading.Thread] = []
        self._dispatcher: threading.Thread | None = None
        self._filler: ZeroFiller | None = None
        self._recovered: RecoveryResult | None = None
        self._closed = False

    # ---- opening --------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike, *, node_id: int, node_epoch: int = 0,
             config: WALConfig | None = None, recovery: bool = False,
             force_format: bool = False) -> "WriteAheadLog":
        """Open (creating and formatting if needed) the WAL at `path`.

        A regular file that does not exist is created and preallocated to `config.capacity`;
        a raw block device is used whole. `recovery=True` opens another node's WAL read-only to
        recover its records (failover). `force_format=True` overwrites a device or file whose
        header is not a WAL's; without it such a path is refused, so foreign data is never lost.
        """
        config = config or WALConfig()
        path = os.fspath(path)
        if node_id < 0 or node_epoch < 0:
            raise WALConfigError(f"node_id and node_epoch must be non-negative, got {node_id}, {node_epoch}")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise WALConfigError(f"WAL path {path!r} is a directory; give a file path or a block device")
        if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise WALConfigError(f"WAL path {path!r} is neither a regular file nor a block device")
        if recovery and st is None:
            raise WALConfigError(f"no WAL at {path!r} to recover")
        block_device = st is not None and stat.S_ISBLK(st.st_mode)
        if st is None:
            cls._create_file(path, config)
        fd, direct = cls._open_fd(path, config, read_only=recovery)
        try:
            if not recovery:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise WALInUseError(
                        f"WAL {path!r} is in use by another writer on this host; one WAL, one writer") from None
            size = cls._device_size(fd) if block_device else os.fstat(fd).st_size
            header = cls._read_or_format(fd, path, size, config, node_id, node_epoch, block_device,
                                         recovery, force_format)
            if not recovery:
                if header.node_id != node_id:
                    raise ForeignWALError(
                        f"WAL {path!r} belongs to node {header.node_id} (epoch {header.node_epoch}), "
                        f"not node {node_id}. Open it with recovery=True to recover it on that node's "
                        "behalf, or give this node its own WAL path.")
                if node_epoch < header.node_epoch:
                    raise WALFencedError(
                        f"WAL {path!r} was last opened by node {node_id} at epoch {header.node_epoch}; "
                        f"this opener's epoch {node_epoch} is stale. Stop this instance.")
            return cls(path=path, fd=fd, header=header, config=config, node_id=node_id,
                       node_epoch=node_epoch, direct_io=direct, block_device=block_device,
                       recovery=recovery)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def preallocate(cls, path: str | os.PathLike, config: WALConfig | None = None) -> bool:
        """Create the WAL file at `path` and preallocate it to `config.capacity` if nothing is
        there yet (zero-filling a large file takes seconds with preallocate="zeros"; "background"
        and "fallocate" are instant); True if it was created. `open` then only formats it. A
        node does this before it registers, so that peers never see it registered but silent
        while it zero-fills."""
        path = os.fspath(path)
        if os.path.exists(path):
            return False
        try:
            cls._create_file(path, config or WALConfig())
        except FileExistsError:             # another opener created it meanwhile
            return False
        return True

    @staticmethod
    def check_not_in_use(path: str | os.PathLike) -> None:
        """WALInUseError if a writer on this host holds the WAL at `path` open (nothing if the
        path does not exist yet). Lets a caller refuse to start before it changes anything
        else; open() checks again, under the lock it then holds."""
        try:
            fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (FileNotFoundError, IsADirectoryError):
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WALInUseError(
                f"WAL {os.fspath(path)!r} is in use by another writer on this host; one WAL, one writer") from None
        finally:
            os.close(fd)

    @staticmethod
    def _create_file(path: str, config: WALConfig) -> None:
        capacity = config.capacity or DEFAULT_CAPACITY
        WALConfig.check_capacity(capacity, "capacity")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if config.preallocate in ("fallocate", "background"):
                # "background": reserved now, zero-filled by the session's ZeroFiller.
                os.posix_fallocate(fd, 0, capacity)
            else:
                zeros = bytes(_ZERO_CHUNK)
                for off in range(0, capacity, _ZERO_CHUNK):
                    os.pwrite(fd, zeros[:min(_ZERO_CHUNK, capacity - off)], off)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    @staticmethod
    def _open_fd(path: str, config: WALConfig, read_only: bool) -> tuple[int, bool]:
        flags = (os.O_RDONLY if read_only else os.O_RDWR) | getattr(os, "O_CLOEXEC", 0)
        if config.direct_io is not False:
            try:
                return os.open(path, flags | os.O_DIRECT), True
            except OSError as e:
                if config.direct_io:
                    raise WALConfigError(f"O_DIRECT is required but {path!r} refuses it: {e}") from e
        return os.open(path, flags), False

    @staticmethod
    def _device_size(fd: int) -> int:
        (size,) = struct.unpack("<Q", fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8))
        return size

    @classmethod
    def _read_or_format(cls, fd: int, path: str, size: int, config: WALConfig, node_id: int,
                        node_epoch: int, block_device: bool, recovery: bool, force_format: bool) -> Header:
        if size < HEADER_AREA:
            raise WALConfigError(f"{path!r} is {size} bytes, too small to hold a WAL")
        buf = AlignedBuffer(HEADER_AREA)
        buf.pread(fd, HEADER_AREA, 0)
        raw = bytes(buf)
        header, states = pick_header(raw[:HEADER_SLOT], raw[HEADER_SLOT:])
        if header is not None and not force_format:
            if header.capacity > size:
                raise WALCorruptError(
                    f"WAL {path!r} header says {header.capacity} bytes but the "
                    f"{'device' if block_device else 'file'} has only {size}: truncated or wrong device")
            if config.capacity is not None and not block_device and not recovery and config.capacity != header.capacity:
                raise WALConfigError(
                    f"WAL {path!r} has capacity {header.capacity}, the config asks for {config.capacity}; "
                    "a WAL cannot be resized: use its capacity or a new path")
            if states[0] != states[1]:
                log.warning("WAL %s header slots differ (%s, %s): using write %d", path, *states,
                            header.write_seq)
            return header
        if SlotState.OTHER_VERSION in states and not force_format:
            versions = sorted({v for v in (slot_version(raw[:HEADER_SLOT]), slot_version(raw[HEADER_SLOT:]))
                               if v is not None and v != VERSION})
            raise WALVersionError(
                f"{path!r} is a WAL of format version {', '.join(map(str, versions))}; this build reads and "
                f"writes version {VERSION} (CRC-32C checksums). Recover its records with the s3stream release "
                "that wrote it, or pass force_format=True if its contents may be destroyed.")
        if recovery:
            raise WALCorruptError(f"{path!r} holds no valid WAL header ({states[0]}, {states[1]}): nothing to recover")
        if not force_format and states != (SlotState.EMPTY, SlotState.EMPTY):
            what = "a corrupt WAL header" if SlotState.CORRUPT in states else "data that is not an s3stream WAL"
            raise WALCorruptError(
                f"{path!r} holds {what} (slots: {states[0]}, {states[1]}). Refusing to overwrite it; "
                "pass force_format=True if its contents may be destroyed.")
        if block_device:
            capacity = size - size % BLOCK
            if size % BLOCK:
                raise WALConfigError(f"block device {path!r} size {size} is not a multiple of {BLOCK} bytes")
        else:
            capacity = config.capacity or size
            if capacity > size:
                os.ftruncate(fd, capacity)
        WALConfig.check_capacity(capacity, "device size" if block_device else "capacity")
        # A file to zero-fill in the background starts with an empty fill mark (a device is used
        # as it is). The file was fallocated by _create_file, unless it already existed.
        fill_end = 0 if config.preallocate == "background" and not block_device else None
        header = Header(capacity=capacity, trim_offset=0, write_seq=0, write_time_ns=time.time_ns(),
                        node_id=node_id, node_epoch=node_epoch, generation=0, clean_shutdown=True,
                        clean_end=0, fill_end=fill_end)
        # Both slots, so a stale foreign slot can never win later.
        cls._write_slot(fd, header)
        cls._write_slot(fd, header.next())
        return header.next()

    @staticmethod
    def _write_slot(fd: int, header: Header) -> None:
        buf = AlignedBuffer(HEADER_SLOT)
        memoryview(buf)[:] = header.encode()
        buf.pwrite(fd, HEADER_SLOT, (header.write_seq % 2) * HEADER_SLOT)
        datasync(fd)

    def _write_header(self, **changes) -> None:
        header = self._header.next(write_time_ns=time.time_ns(), **changes)
        self._write_slot(self._fd, header)
        self._header = header

    # ---- recovery ---------------------------------------------------------------------------

    def recover(self) -> Iterator[Record]:
        """Yield the intact, continuous records after the trim offset, in order.

        Must run before the first append or trim of this session. After it is exhausted,
        `recovery_result` tells where it stopped and why. A WAL that was shut down cleanly but
        cannot be read to its recorded end raises WALCorruptError at the end of the iteration.
        """
        with self._lock:
            self._check_open()
            if self._ring is not None:
                raise WALClosedError("recover() must run before the first append or trim of a session")
        scanner = Scanner(self._fd, HEADER_AREA, self._data_capacity, self._header.trim_offset)
        for offset, data in scanner:
            yield Record(offset, data)
        self._finish_scan(scanner)

    def _finish_scan(self, scanner: Scanner) -> RecoveryResult:
        reason = walrecord.STOP_REASONS.get(scanner.stop_reason, str(scanner.stop_reason))
        recovered = self._recovered = RecoveryResult(scanner.end, scanner.records, scanner.record_bytes, reason)
        h = self._header
        gap = find_gap(self._fd, h, self._data_capacity, scanner)
        if gap is not None:
            bad, resync, end, n = gap
            raise WALMidLogCorruptError(
                f"WAL {self._path!r}: the record at logical offset {bad} is damaged ({reason}), but {n} valid "
                f"records of the same writer session follow it, in [{resync}, {end}): more than a crash can "
                "leave after a torn write, so acknowledged data lies beyond the damage. Nothing was trimmed "
                f"or overwritten. To keep those {n} records and lose only what lies in [{bad}, {resync}), run "
                f"`python -m s3stream wal-salvage {self._path} --yes` (or wal.salvage(path, apply=True)) with "
                "the node stopped, then start it again; `python -m s3stream inspect wal PATH` shows the log.",
                path=str(self._path), bad_offset=bad, resync_offset=resync, end=end, records_after=n)
        if h.clean_shutdown and h.generation > 0 and (
                walrecord.next_record_start(scanner.end) != walrecord.next_record_start(h.clean_end)):
            raise WALCorruptError(
                f"WAL {self._path!r} was shut down cleanly at offset {h.clean_end} but its records "
                f"can be read only to {scanner.end} ({reason}): the device lost or corrupted data")
        return recovered

    @property
    def recovery_result(self) -> RecoveryResult | None:
        return self._recovered

    # ---- writing -----------------------------------------------------------------------------

    def _start(self) -> Ring:
        """Begin a writer session: find the end of the log, bump the generation, start writers."""
        with self._lock:
            if self._ring is not None:
                return self._ring
            self._check_open()
            if self._recovery:
                raise WALClosedError(f"WAL {self._path!r} is open read-only for recovery; it takes no appends")
            recovered = self._recovered
            if recovered is None:
                scanner = Scanner(self._fd, HEADER_AREA, self._data_capacity, self._header.trim_offset)
                for _ in scanner:
                    pass
                recovered = self._finish_scan(scanner)
            resume = recovered.end
            resume_block = None
            if resume % BLOCK:
                buf = AlignedBuffer(BLOCK)
                buf.pread(self._fd, BLOCK, HEADER_AREA + (resume - resume % BLOCK) % self._data_capacity)
                resume_block = bytes(buf)
            generation = self._header.generation + 1
            cfg = self._config
            # What a crash of this session can leave behind a torn write (see find_gap), kept as
            # the largest of any session: stale batches of an earlier one may still lie there.
            inflight = cfg.buffers if cfg.writer_threads > 1 else 0
            # A block device needs no fill, whatever a header copied onto it says.
            fill_end = None if self._block_device else self._header.fill_end
            if fill_end is not None and resume > fill_end:
                # Records above the mark cannot come from a session of this build; they can
                # from a file formatted over an old WAL (force_format). Never zero them.
                fill_end = -(-resume // BLOCK) * BLOCK
                if fill_end >= self._data_capacity:
                    fill_end = None
            self._write_header(node_id=self._node_id, node_epoch=self._node_epoch,
                               generation=generation, clean_shutdown=False, clean_end=0,
                               inflight_batches=max(inflight, self._header.inflight_batches),
                               batch_bytes=max(cfg.batch_bytes + BLOCK, self._header.batch_bytes),
                               fill_end=fill_end)
            ring = Ring(self._fd, HEADER_AREA, self._data_capacity, cfg.batch_bytes + BLOCK, cfg.buffers,
                        generation, resume, self._header.trim_offset, resume_block, cfg.full_timeout,
                        self._max_record, (WALFullError, WALClosedError, WALIOError, RecordTooLargeError))
            if fill_end is not None:
                # Before any append: records stay below the persisted mark (which is in the first
                # lap, so logical and physical offsets agree there).
                ring.set_fill_end(fill_end)
            self._writers = [threading.Thread(target=ring.run_writer, name=f"wal-writer-{i}", daemon=True)
                             for i in range(cfg.writer_threads)]
            # Callbacks (given to append or added to a handle later) run on this thread; it
            # sleeps until some are queued.
            self._dispatcher = threading.Thread(target=ring.run_dispatcher, name="wal-callbacks", daemon=True)
            for t in self._writers + [self._dispatcher]:
                t.start()
            self._ring = ring
            if fill_end is not None:
                self._filler = ZeroFiller(self._fd, HEADER_AREA, self._data_capacity, fill_end,
                                          self._fill_advanced)
                self._filler.start()
            return ring

    def _fill_advanced(self, fill_end: int | None) -> bool:
        """The filler has written zeros below `fill_end` (None: the whole data area): persist
        the mark, then let the ring place records below it. False once the WAL is closing."""
        with self._lock:
            if self._closed:
                return False
            ring = self._ring
            assert ring is not None, "the filler starts after the ring"
            self._write_header(fill_end=fill_end)
            ring.set_fill_end(fill_end)
            if fill_end is None:
                log.info("WAL %s: first fill complete", self._path)
            return True

    def trim(self, offset: int) -> None:
        """Discard records before logical `offset` (a record's offset or end). Durable on return.
        Trimming backwards or to the current trim offset does nothing."""
        with self._lock:
            ring = self._start()
            if offset <= self._header.trim_offset:
                return
            durable = ring.durable_end
            if offset > durable:
                raise ValueError(f"cannot trim WAL to {offset}: records are durable only up to {durable}")
            self._write_header(trim_offset=offset)
            ring.trim(offset)

    # ---- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Write out everything appended, record a clean shutdown and release the file. A first
        fill still running stops after its current chunk; the next session resumes it."""
        filler = self._filler
        if filler is not None:
            # Outside the lock: the filler takes it to record its progress.
            filler.stop()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ring = self._ring
            try:
                if ring is not None:
                    ring.stop()
                    for t in self._writers:
                        t.join()
                    if self._dispatcher is not None:
                        ring.stop_dispatcher()
                        self._dispatcher.join()
                    if not ring.failed:
                        self._write_header(clean_shutdown=True, clean_end=ring.append_end)
            finally:
                os.close(self._fd)

    def _check_open(self) -> None:
        if self._closed:
            raise WALClosedError(f"WAL {self._path!r} is closed")

    # ---- introspection -------------------------------------------------------------------------

    @property
    def path(self) -> str:
        return self._path

    @property
    def node_id(self) -> int:
        return self._node_id

    @property
    def node_epoch(self) -> int:
        return self._node_epoch

    @property
    def header(self) -> Header:
        return self._header

    @property
    def capacity(self) -> int:
        """Bytes of the data area (the ring)."""
        return self._data_capacity

    @property
    def max_record_bytes(self) -> int:
        return self._max_record

    @property
    def direct_io(self) -> bool:
        """True if writes bypass the page cache (O_DIRECT); False means buffered + fdatasync."""
        return self._direct_io

    @property
    def is_block_device(self) -> bool:
        return self._block_device

    @property
    def previous_shutdown_clean(self) -> bool:
        return self._previous_clean

    @property
    def salvaged_end(self) -> int:
        """Records below this logical offset were recovered past a salvaged corrupt span
        (`salvage`): a stream's offsets may stop at a gap there. 0 if never salvaged."""
        return self._header.salvaged_end

    @property
    def trim_offset(self) -> int:
        return self._header.trim_offset

    @property
    def durable_end(self) -> int:
        """Every record ending at or before this logical offset is durable."""
        ring = self._ring
        if ring is not None:
            return ring.durable_end
        return self._recovered.end if self._recovered else self._header.trim_offset

    def stats(self) -> dict:
        """The ring's counters and `used_bytes` (logical bytes from the trim offset to the last
        record placed) of `capacity` (none of these before the session starts), and the first
        fill's progress:
        `filled_bytes` of the data area zero-filled, `fill_complete` (preallocate="background")."""
        ring = self._ring
        stats = ring.stats() if ring is not None else {}
        if ring is not None:
            # Bytes between the trim offset and the last record placed: what uploads must free.
            stats.update(used_bytes=max(0, ring.appended_end - ring.trim_offset), capacity=self._data_capacity)
        fill_end = self._header.fill_end
        stats.update(filled_bytes=self._data_capacity if fill_end is None else fill_end,
                     fill_complete=fill_end is None)
        filler = self._filler
        if filler is not None and filler.error is not None:
            stats["fill_error"] = str(filler.error)
        return stats

    def __repr__(self) -> str:
        mode = "O_DIRECT" if self._direct_io else "buffered"
        return (f"<WriteAheadLog {self._path!r} node={self._node_id}@{self._node_epoch} "
                f"capacity={self._data_capacity} {mode}>")
