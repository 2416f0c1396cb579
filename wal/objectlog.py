"""ObjectWAL: the write-ahead log kept as objects on an object store (no local disk).

The same promise as the ring on a file (`wal.log`): an append is acknowledged once durable, here
once the PUT of the object holding it was answered with success, in offset order; recovery (and a
peer's failover, from any host) replays every acknowledged record. The in-memory half is the
same native Ring, so the engine's append path, the lease deadline, group commit and the record
framing (32-byte headers, CRC-32C) are shared; one object is one batch of the ring exactly as it
would be written to the file, behind a 128-byte object header, and one Scanner reads both.

Objects (docs/wal-format.md, "A WAL of objects"): `node-{node_id}/{seq:020d}`, one sequence per
node, every one written with put-if-absent. Kinds: DATA (one batch; `prev` links it to the
object before it in the log), FENCE (a session's start: `prev` names the log's last object) and
HOLE (a fence put into a missing sequence). A session (an instance of the node, or a peer
recovering it) opens the log so:

1. it lists the node's objects and reads their headers; S is the newest FENCE;
2. it walks the objects of S's session from S + DATA_GAP + 1 on, in sequence, while each is a
   DATA object of S's generation that links to the one before: the log's last object is the
   last one walked (or S's `prev`). A missing sequence on the way gets a HOLE (put-if-absent): a
   PUT still in flight there fails, so nothing after it is ever acknowledged; if that PUT won,
   the object is read and the walk goes on;
3. it writes its FENCE at the next free sequence F (put-if-absent; if that fails, another writer
   took it: back to 1). Every sequence below F is now decided for good;
4. the log is the chain of `prev` links back from the last object, down to the trim; its
   records are replayed in order;
5. its own objects start at F + DATA_GAP + 1, linked from the log's last object. An older writer
   that failed a PUT against a FENCE or HOLE stops taking batches within the ring's buffer count
   (at most 258 of them), so its stray PUTs land in the gap and never collide with ours; they
   are on no chain and are never replayed.

Trim: `trim(offset)` frees ring space at once; it is persisted lazily, stamped into every later
object's header (`trim`, `trim_seq`), and objects wholly below it are deleted in batches by the
trimmer thread, as are the older fences and stray objects found at open. Never deleted: the
session's own FENCE, and every HOLE, whoever put it. A HOLE is what refuses the PUT of the writer
it fenced, and that writer (paused, cut off, retrying) may land its PUT at any later time: with
the HOLE gone it would be acknowledged and lost (issue 50). HOLEs are 128 bytes, one per open
that fenced a live session; an open reads headers from the newest object down to the newest
FENCE and the trim's sequence, so old ones cost a LIST entry each, not a GET. A record replayed
although it was trimmed is one the engine already uploaded: replay skips it.

One writer per host: `HostLock` lets an engine refuse a second instance of a node on one host
before it fences the first; writers on other hosts are fenced by the store, and learn it at their
next PUT (`on_fenced`).

Stores: anything with `put_if_absent(key, data) -> bool`, `get(key, start=0, end=None)` (a
missing key raises KeyError), `list(prefix)` (objects with `.key` and `.size`, ascending) and
`delete(keys)`, such as s3stream's object stores. At open the store is probed: one that ignores
put-if-absent is refused unless `conditional_writes=False` is passed with an `ack_check` that
fences by other means (s3stream checks the node epoch in its metadata after every PUT).
"""
from __future__ import annotations

import collections
import fcntl
import hashlib
import logging
import os
import struct
import tempfile
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

from _native import walrecord
from _native.checksum import crc32c
from _native.walring import Ring
from _native.walscan import Scanner

from .config import DEFAULT_CAPACITY, WALConfig
from .errors import (
    RecordTooLargeError, WALClosedError, WALConfigError, WALCorruptError, WALFencedError, WALFullError, WALInUseError,
    WALIOError,
)
from .log import Record, RecoveryResult
from .ringwal import RingWAL

log = logging.getLogger("wal")

BLOCK = walrecord.BLOCK
MAGIC = b"S3WO"
VERSION = 1
KIND_DATA = 1
KIND_FENCE = 2
KIND_HOLE = 3
_KINDS = {KIND_DATA: "data", KIND_FENCE: "fence", KIND_HOLE: "hole"}
#: magic, version, kind, node id, generation, node epoch, seq, prev, start, trim, trim seq,
#: capacity (of the ring that wrote it: where its laps end), body length
_HEAD = struct.Struct("<4sHHIIQQQQQQQI")
_CRC = struct.Struct("<I")
HEADER_BYTES = 128
_PAD = HEADER_BYTES - _HEAD.size - _CRC.size
assert _PAD >= 0
NO_SEQ = (1 << 64) - 1
#: Sequence numbers are printed with this many digits, so keys sort as numbers.
SEQ_DIGITS = 20
#: Sequences a session leaves free after its FENCE: more than an older writer can still PUT after
#: its first failed PUT (it takes no batch past its ring's buffers: WALConfig bounds them to 256).
DATA_GAP = 260
#: Deletes per request (S3's DeleteObjects takes at most 1000 keys).
DELETE_BATCH = 1000


class WALStore(Protocol):
    """What ObjectWAL needs of an object store (s3stream.objectstore's stores have it)."""

    @property
    def url(self) -> str: ...

    def put_if_absent(self, key: str, data: bytes | bytearray) -> bool: ...

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes: ...

    def list(self, prefix: str = "") -> Iterator: ...

    def delete(self, keys) -> None: ...


@dataclass(frozen=True)
class ObjectHeader:
    kind: int
    node_id: int
    generation: int
    node_epoch: int     # the node's epoch for its own sessions; 0 for a peer's recovery
    seq: int
    prev: int           # DATA: the object before it in the log; FENCE: the log's last object
    start: int          # DATA: logical offset of the body's first byte (4 KiB aligned)
    trim: int           # the writer's trim offset when it wrote this object
    trim_seq: int       # every object of the log below this sequence held only trimmed records
    capacity: int       # the writing ring's capacity (records never cross its laps)
    body_len: int

    @property
    def end(self) -> int:
        return self.start + self.body_len

    def encode(self) -> bytes:
        head = _HEAD.pack(MAGIC, VERSION, self.kind, self.node_id, self.generation, self.node_epoch, self.seq,
                          self.prev, self.start, self.trim, self.trim_seq, self.capacity, self.body_len)
        return head + _CRC.pack(crc32c(head)) + bytes(_PAD)

    @classmethod
    def decode(cls, raw: bytes, key: str) -> "ObjectHeader":
        if len(raw) < _HEAD.size + _CRC.size:
            raise WALCorruptError(f"WAL object {key!r} is {len(raw)} bytes, shorter than its header")
        head = raw[:_HEAD.size]
        (crc,) = _CRC.unpack_from(raw, _HEAD.size)
        magic, version, kind, node_id, gen, epoch, seq, prev, start, trim, trim_seq, capacity, body_len = \
            _HEAD.unpack(head)
        if magic != MAGIC:
            raise WALCorruptError(f"object {key!r} is not an s3stream WAL object (magic {magic!r})")
        if crc != crc32c(head):
            raise WALCorruptError(f"WAL object {key!r}: header checksum mismatch (the store corrupted it)")
        if version != VERSION:
            raise WALCorruptError(f"WAL object {key!r} has format version {version}; this build reads {VERSION}")
        if kind not in _KINDS:
            raise WALCorruptError(f"WAL object {key!r} has unknown kind {kind}")
        return cls(kind, node_id, gen, epoch, seq, prev, start, trim, trim_seq, capacity, body_len)


def node_prefix(node_id: int) -> str:
    return f"node-{node_id}/"


def object_key(node_id: int, seq: int) -> str:
    return f"{node_prefix(node_id)}{seq:0{SEQ_DIGITS}d}"


def _seq_of(key: str, prefix: str) -> int | None:
    tail = key[len(prefix):]
    return int(tail) if len(tail) == SEQ_DIGITS and tail.isdigit() else None


def probe_conditional_writes(store: WALStore, node_id: int) -> bool:
    """True if `store` refuses a second put-if-absent of one key (it honours If-None-Match);
    False if it silently overwrote. Leaves nothing behind."""
    key = f"{node_prefix(node_id)}probe-{uuid.uuid4().hex}"
    try:
        if not store.put_if_absent(key, b"1"):
            raise WALIOError(f"store {store.url}: a put-if-absent of the new key {key!r} was refused")
        return not store.put_if_absent(key, b"2")
    finally:
        store.delete([key])


class HostLock:
    """One writer of a node's log of objects per host: an exclusive flock on a file named for
    (`location`, `node_id`) under the temporary directory, held from `acquire` to `release` (or
    the process's end, kill -9 included). The store's fencing makes a second writer safe, not
    useful: it fences the first. This lock lets an engine refuse a second instance on one host
    before it takes over, as the file WAL's own lock does; writers on other hosts are fenced by
    the store and learn it at their next PUT (`ObjectWAL.on_fenced`)."""

    def __init__(self, fd: int, path: str) -> None:
        self._fd: int | None = fd
        self.path = path

    @staticmethod
    def path_for(location: str, node_id: int) -> str:
        digest = hashlib.sha256(f"{location}\0{node_id}".encode()).hexdigest()[:32]
        return os.path.join(tempfile.gettempdir(), "s3stream-wal-locks", f"node-{node_id}-{digest}.lock")

    @classmethod
    def acquire(cls, location: str, node_id: int) -> "HostLock":
        """The lock, or WALInUseError if another instance on this host holds it."""
        path = cls.path_for(location, node_id)
        os.makedirs(os.path.dirname(path), mode=0o1777, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise WALInUseError(f"node {node_id}'s WAL at {location} is in use by another instance on this host "
                                f"(lock {path}); one node, one instance") from None
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class ObjectWAL(RingWAL):
    """A WAL kept as objects. Open with `ObjectWAL.open(store, node_id=...)`; the methods are
    those of `wal.WriteAheadLog` (see `wal.interface.WAL`)."""

    def __init__(self, store: WALStore, *, node_id: int, node_epoch: int, config: WALConfig, recovery: bool,
                 ack_check: Callable[[], None] | None) -> None:
        self._store = store
        self._node_id = node_id
        self._node_epoch = node_epoch
        self._config = config
        self._recovery = recovery
        self._ack_check = ack_check
        self._prefix = node_prefix(node_id)
        self._capacity = config.capacity or DEFAULT_CAPACITY
        self._max_record = 0 if recovery else config.record_limit(self._capacity)
        self._lock = threading.RLock()
        self._ring: Ring | None = None
        self._threads: list[threading.Thread] = []
        self._dispatcher: threading.Thread | None = None
        self._closed = False
        self._stopping = threading.Event()
        # Decided at open (the fence): headers below the fence, the session's generation.
        self._headers: dict[int, ObjectHeader] = {}
        self._unread: dict[int, int] = {}       # seq -> size of the objects below the headers read
        self._fence_seq = 0
        self._generation = 0
        self._trim = 0
        self._trim_seq = 0
        self._chain: list[ObjectHeader] = []     # the DATA objects to replay, in order
        self._last = NO_SEQ                      # the log's last object when this session began
        self._recovered: RecoveryResult | None = None
        self._live: dict[int, int] = {}
        self._first_data_seq = 0
        self._deletable: list[int] = []
        # Objects trimmed in memory (seq, end), deleted once an object stamped with a trim at or
        # past their end has landed: recovery takes its trim from the stamps it finds.
        self._awaiting: list[tuple[int, int]] = []
        self._persisted_trim = 0
        self._trim_cv = threading.Condition(self._lock)
        self._trimmer: threading.Thread | None = None
        self._stats = dict(puts=0, put_bytes=0, put_retries=0, put_hedges=0, fences=0, deletes=0,
                           delete_requests=0, gets=0, get_bytes=0, lists=0)
        # Latencies of the last data PUT attempts (each its own, hedged or not).
        self._recent_put_ns: collections.deque[int] = collections.deque(maxlen=200)
        self._hedge_pool = ThreadPoolExecutor(2 * config.puts_in_flight, thread_name_prefix="wal-put-hedge")
        self._stats_lock = threading.Lock()
        self._on_close: list[Callable[[], object]] = []
        self._on_fenced: list[Callable[[BaseException], object]] = []
        self._fenced_by: BaseException | None = None
        self._permanent: tuple[type[BaseException], ...] = ()
        self._put_ns: list[int] = []

    # ---- opening and fencing ---------------------------------------------------------------

    @classmethod
    def open(cls, store: WALStore, *, node_id: int, node_epoch: int = 0, config: WALConfig | None = None,
             recovery: bool = False, conditional_writes: bool = True,
             ack_check: Callable[[], None] | None = None,
             permanent_errors: tuple[type[BaseException], ...] = ()) -> "ObjectWAL":
        """Open node `node_id`'s WAL on `store`, fencing every earlier writer of it (a restarted
        node's old instance, a paused one, or, with `recovery=True`, the node itself when a peer
        recovers it: that open writes only the fence and reads).

        `conditional_writes=False` accepts a store that ignores put-if-absent, for a caller that
        fences by other means: `ack_check()` runs after every PUT and before its records are
        acknowledged, and raises if this writer was fenced. Without it, such a store is refused.
        """
        config = config or WALConfig()
        if node_id < 0 or node_epoch < 0:
            raise WALConfigError(f"node_id and node_epoch must be non-negative, got {node_id}, {node_epoch}")
        if conditional_writes:
            if not probe_conditional_writes(store, node_id):
                raise WALConfigError(
                    f"object store {store.url} ignores conditional writes (a put with If-None-Match: * overwrote "
                    "an existing object), so a WAL there cannot fence a paused writer. Use a store that honours "
                    "them (AWS S3, SeaweedFS, MinIO), a local WAL path, or open with conditional_writes=False "
                    "and an ack_check that fences by other means (docs/wal-format.md: weaker guarantees)")
        elif ack_check is None and not recovery:
            raise WALConfigError("conditional_writes=False needs an ack_check: without put-if-absent nothing "
                                 "else stops a paused writer from acknowledging after a newer one took over")
        wal = cls(store, node_id=node_id, node_epoch=node_epoch, config=config, recovery=recovery,
                  ack_check=ack_check)
        wal._permanent = permanent_errors
        wal._fence()
        return wal

    def _list(self) -> dict[int, int]:
        self._count(lists=1)
        out = {}
        for info in self._store.list(self._prefix):
            seq = _seq_of(info.key, self._prefix)
            if seq is not None:
                out[seq] = info.size
        return out

    def _read_headers(self, seqs) -> None:
        todo = [s for s in seqs if s not in self._headers]
        if not todo:
            return

        def read(seq: int) -> tuple[int, ObjectHeader | None]:
            key = object_key(self._node_id, seq)
            try:
                raw = self._store.get(key, 0, HEADER_BYTES)
            except KeyError:
                return seq, None            # deleted meanwhile by a trimmer: below its trim
            self._count(gets=1, get_bytes=len(raw))
            return seq, ObjectHeader.decode(raw, f"{self._store.url}/{key}")

        with ThreadPoolExecutor(max(1, min(self._config.recovery_threads, len(todo))),
                                thread_name_prefix="wal-recover") as pool:
            for seq, header in pool.map(read, todo):
                if header is not None:
                    if header.seq != seq or header.node_id != self._node_id:
                        raise WALCorruptError(
                            f"WAL object {self._store.url}/{object_key(self._node_id, seq)} says it is node "
                            f"{header.node_id}'s object {header.seq}: it was copied or renamed; remove it")
                    self._headers[seq] = header

    def _read_needed_headers(self, listing: dict[int, int]) -> int:
        """Read the headers an open needs and return the sequence below which none was read.

        It needs the newest FENCE (the session to walk), the trim stamps, and every object from
        the trim's sequence up (the log's chain). Below both lie only trimmed data, stray objects
        and the markers of earlier sessions: HOLEs are never deleted (each fences a writer that
        may still exist), so a node opened a thousand times has a thousand of them, and reading
        their headers at every open would make it slower with every restart. Headers are read
        from the newest object down until a FENCE is among them."""
        seqs = sorted(listing, reverse=True)
        chunk = max(1, self._config.recovery_threads)
        taken = 0
        fence = None
        while taken < len(seqs) and fence is None:
            part = seqs[taken:taken + chunk]
            taken += len(part)
            self._read_headers(part)
            fence = max((s for s in part if s in self._headers and self._headers[s].kind == KIND_FENCE), default=None)
        if fence is None:
            return 0                        # no session yet: everything was read
        trim_seq = max(self._headers[s].trim_seq for s in seqs[:taken] if s in self._headers)
        floor = min(trim_seq, fence)
        self._read_headers([s for s in seqs[taken:] if s >= floor])
        return floor

    def _fence(self) -> None:
        """Steps 1-4 of the module docstring: decide the log and write this session's FENCE."""
        attempts = self._config.fence_attempts
        for _ in range(attempts):
            listing = self._list()
            floor = self._read_needed_headers(listing)
            self._unread = {seq: size for seq, size in listing.items() if seq < floor}
            headers = {seq: h for seq, h in self._headers.items() if seq >= floor}
            owner_epochs = [h.node_epoch for h in headers.values() if h.kind == KIND_DATA]
            if not self._recovery and owner_epochs and max(owner_epochs) > self._node_epoch:
                raise WALFencedError(
                    f"WAL of node {self._node_id} at {self._store.url} was written at node epoch "
                    f"{max(owner_epochs)}; this opener's epoch {self._node_epoch} is stale. Stop this instance.")
            trim = max((h.trim for h in headers.values()), default=0)
            trim_seq = max((h.trim_seq for h in headers.values()), default=0)
            fences = [seq for seq, h in headers.items() if h.kind == KIND_FENCE]
            session = headers[max(fences)] if fences else None
            last = session.prev if session is not None else NO_SEQ
            generation = max((h.generation for h in headers.values()), default=0) + 1
            seq = max(session.seq + DATA_GAP + 1 if session is not None else 0, trim_seq)
            top = max(listing, default=-1)
            # Walk S's session; its next sequence gets a HOLE, so that its writer, if it still
            # runs, fails there (or it won that PUT: read it and walk on).
            while session is not None:
                h = self._headers.get(seq)
                if h is None:
                    if self._put_marker(KIND_HOLE, seq, generation, last, trim, trim_seq):
                        break
                    self._read_headers([seq])
                    h = self._headers.get(seq)
                    if h is None:
                        raise WALIOError(f"WAL object {object_key(self._node_id, seq)} at {self._store.url} "
                                         "exists (a put-if-absent was refused) but cannot be read")
                if h.kind != KIND_DATA or h.generation != session.generation or (
                        h.prev != last and last != NO_SEQ and h.prev >= trim_seq):
                    break
                last = seq
                seq += 1
            # Past every object and the hole: the stray PUTs of a writer stopped at the hole land
            # below fence + DATA_GAP.
            fence = max(top, seq if session is not None else -1) + 1
            if not self._put_marker(KIND_FENCE, fence, generation, last, trim, trim_seq):
                continue                    # another writer took it since the listing: look again
            self._fence_seq = fence
            self._generation = generation
            self._trim, self._trim_seq = trim, trim_seq
            self._last = last
            self._chain = self._walk_back(last)
            return
        raise WALFencedError(f"WAL of node {self._node_id} at {self._store.url}: other writers kept taking the "
                             f"next sequence through {attempts} attempts to fence them; stop the other instance")

    def _put_marker(self, kind: int, seq: int, generation: int, prev: int, trim: int, trim_seq: int) -> bool:
        """A FENCE or HOLE at `seq`; False if the sequence was taken."""
        header = ObjectHeader(kind, self._node_id, generation, 0 if self._recovery else self._node_epoch,
                              seq, prev, 0, trim, trim_seq, self._capacity, 0)
        done = self._put(object_key(self._node_id, seq), header.encode())
        if done:
            self._headers[seq] = header
            self._count(fences=1)
        return done

    def _walk_back(self, last: int) -> list[ObjectHeader]:
        """The log: DATA objects linked back from `last` down to the trim, oldest first."""
        chain: list[ObjectHeader] = []
        seq = last
        while seq != NO_SEQ and seq >= self._trim_seq:
            h = self._headers.get(seq)
            if h is None:
                break                       # deleted by a trimmer: wholly trimmed, as is all before it
            if h.kind != KIND_DATA:
                raise WALCorruptError(f"WAL of node {self._node_id} at {self._store.url}: object {seq} is a "
                                      f"{_KINDS[h.kind]} where the log links to data")
            if h.end <= self._trim:
                break
            chain.append(h)
            seq = h.prev
        chain.reverse()
        return chain

    # ---- recovery ---------------------------------------------------------------------------

    def recover(self) -> Iterator[Record]:
        """Yield the acknowledged records not yet trimmed, in order (see the module docstring).
        Raises WALCorruptError when an object of the log is damaged or does not continue the one
        before it (objects are written whole, so nothing else can explain it)."""
        with self._lock:
            self._check_open()
            if self._ring is not None:
                raise WALClosedError("recover() must run before the first append or trim of a session")
        end = self._trim
        records = record_bytes = 0
        generation = 0
        window = max(1, self._config.recovery_threads)
        chain = self._chain
        with ThreadPoolExecutor(window, thread_name_prefix="wal-recover") as pool:
            bodies = {i: pool.submit(self._get_body, chain[i]) for i in range(min(window, len(chain)))}
            for i, h in enumerate(chain):
                body = bodies.pop(i).result()
                if i + window < len(chain):
                    bodies[i + window] = pool.submit(self._get_body, chain[i + window])
                where = f"{self._store.url}/{object_key(self._node_id, h.seq)}"
                if body is None:
                    # Deleted by a trimmer after our listing: wholly below its trim.
                    end = h.end
                    continue
                if i and h.start != -(-end // BLOCK) * BLOCK and h.start > self._trim:
                    raise WALCorruptError(
                        f"WAL object {where} starts at logical offset {h.start}, but the object before it in the "
                        f"log ends at {end}: the log is missing data")
                scanner = Scanner(-1, 0, h.capacity, max(h.start, self._trim), data=body, data_start=h.start,
                                  min_generation=generation)
                for offset, data in scanner:
                    yield Record(offset, data)
                if scanner.stop_reason != walrecord.STOP_END_OF_SPACE or walrecord.next_record_start(
                        scanner.end) < h.end:
                    reason = walrecord.STOP_REASONS.get(scanner.stop_reason, str(scanner.stop_reason))
                    raise WALCorruptError(
                        f"WAL object {where} is damaged at logical offset {scanner.end} ({reason}): it was "
                        "written whole, so the store lost or changed data")
                records += scanner.records
                record_bytes += scanner.record_bytes
                generation = scanner.last_generation
                end = max(end, scanner.end)
        self._recovered = RecoveryResult(end, records, record_bytes, "end of the log's objects")

    def _get_body(self, h: ObjectHeader) -> bytes | None:
        key = object_key(self._node_id, h.seq)
        try:
            raw = self._store.get(key)
        except KeyError:
            return None
        self._count(gets=1, get_bytes=len(raw))
        if len(raw) != HEADER_BYTES + h.body_len:
            raise WALCorruptError(f"WAL object {self._store.url}/{key} is {len(raw)} bytes; its header says "
                                  f"{HEADER_BYTES + h.body_len}")
        return raw[HEADER_BYTES:]

    @property
    def recovery_result(self) -> RecoveryResult | None:
        return self._recovered

    # ---- writing -----------------------------------------------------------------------------

    def _start(self) -> Ring:
        with self._lock:
            if self._ring is not None:
                return self._ring
            self._check_open()
            if self._recovery:
                raise WALClosedError(f"WAL of node {self._node_id} at {self._store.url} is open for recovery; "
                                     "it takes no appends")
            if self._recovered is None:
                for _ in self.recover():
                    pass
            assert self._recovered is not None
            resume = -(-self._recovered.end // BLOCK) * BLOCK
            trim = max(self._trim, resume - self._capacity)
            cfg = self._config
            ring = Ring(-1, 0, self._capacity, cfg.object_bytes, max(cfg.buffers, cfg.puts_in_flight + 2),
                        self._generation, resume, trim, None, cfg.full_timeout, self._max_record,
                        (WALFullError, WALClosedError, WALIOError, RecordTooLargeError))
            self._trim = trim
            # The log's objects not yet trimmed (seq -> logical end): the replayed ones now, this
            # session's from when their batch is taken (so an object in flight is never skipped).
            self._live = {h.seq: h.end for h in self._chain if h.end > trim}
            self._first_data_seq = self._fence_seq + DATA_GAP + 1
            # An object taken but not yet in _live is at or above the first one not retired.
            self._trim_seq = min(min(self._live, default=NO_SEQ), self._first_data_seq + ring.retired_batches)
            self._ring = ring
            self._threads = [threading.Thread(target=self._put_loop, args=(ring,), name=f"wal-put-{i}", daemon=True)
                             for i in range(cfg.puts_in_flight)]
            self._dispatcher = threading.Thread(target=ring.run_dispatcher, name="wal-callbacks", daemon=True)
            self._trimmer = threading.Thread(target=self._trim_loop, name="wal-trimmer", daemon=True)
            # Everything of earlier sessions but the live log and the HOLEs (older fences, stray
            # and trimmed objects) is the trimmer's; this session's FENCE stays. A HOLE stays for
            # good: it is what refuses the PUT of the writer it fenced, and that writer (paused,
            # partitioned away, retrying) may exist for as long as it likes. Below the headers
            # read at open, objects of a marker's size are kept unread for the same reason.
            self._deletable = sorted(
                [s for s, h in self._headers.items()
                 if s != self._fence_seq and s not in self._live and h.kind != KIND_HOLE]
                + [s for s, size in self._unread.items() if size != HEADER_BYTES])
            self._persisted_trim = trim
            for t in [*self._threads, self._dispatcher, self._trimmer]:
                t.start()
            return ring

    def _put_loop(self, ring: Ring) -> None:
        cfg = self._config
        while True:
            item = ring.take_batch(0.5, cfg.put_interval, HEADER_BYTES, cfg.seal_bytes)
            if item is None:
                continue
            if not isinstance(item, tuple):
                return                  # stopped, every batch taken
            batch_seq, start, data = item
            seq = self._first_data_seq + batch_seq
            body_len = len(data) - HEADER_BYTES
            with self._lock:
                self._live[seq] = start + body_len
                trim, trim_seq = self._trim, self._trim_seq
            header = ObjectHeader(KIND_DATA, self._node_id, self._generation, self._node_epoch, seq,
                                  self._last if batch_seq == 0 else seq - 1, start, trim, trim_seq,
                                  self._capacity, body_len)
            data[:HEADER_BYTES] = header.encode()
            error: BaseException | None = ring.error
            took = -1
            if error is None:
                t0 = time.monotonic_ns()
                try:
                    if not self._put_data(object_key(self._node_id, seq), data):
                        error = WALFencedError(
                            f"WAL of node {self._node_id} at {self._store.url}: object {seq} was written by another "
                            "writer (a newer instance or a peer recovering this node fenced this one); nothing from "
                            "it on is acknowledged. Stop this instance.")
                    elif self._ack_check is not None:
                        self._check_acks()
                except BaseException as e:     # noqa: BLE001 - becomes the WAL's failure
                    error = e if isinstance(e, Exception) else WALIOError(f"WAL PUT interrupted: {e!r}")
                took = time.monotonic_ns() - t0
                if error is None:
                    self._count(puts=1, put_bytes=len(data))
                    with self._lock:
                        if trim > self._persisted_trim:
                            self._persisted_trim = trim
                            self._trim_cv.notify()
                    with self._stats_lock:
                        if len(self._put_ns) < 100_000:
                            self._put_ns.append(took)
            if error is not None and not isinstance(error, Exception):
                error = WALIOError(str(error))
            if isinstance(error, WALFencedError):
                self._fenced(error)
            if error is not None and not isinstance(error, (WALFencedError, WALIOError, WALClosedError)):
                error = WALIOError(f"WAL PUT to {self._store.url} failed for good: {error}")
            ring.finish_batch(batch_seq, error, took)

    def _put_data(self, key: str, data) -> bool:
        """A data object's PUT, hedged: when it has not answered after the `hedge_quantile` of
        the recent PUTs' latencies, a second PUT of the same bytes races it, and the first
        answer counts. Both are put-if-absent of one key, so at most one creates the object;
        the other is refused and reads it back: ours. One slow request then delays its object,
        and every acknowledgment after it (they are in order), by about that quantile plus a
        typical PUT instead of its whole tail (The Tail at Scale, Dean and Barroso)."""
        delay = self._hedge_delay()
        if delay is None:
            return self._attempt(key, data, False)
        first = self._hedge_pool.submit(self._attempt, key, data, True)
        try:
            return first.result(timeout=delay)
        except FutureTimeout:
            pass
        self._count(put_hedges=1)
        second = self._hedge_pool.submit(self._attempt, key, data, True)
        done, _ = futures_wait([first, second], return_when=FIRST_COMPLETED)
        winner = next(iter(done))
        error = winner.exception()
        if error is None:
            return winner.result()
        other = second if winner is first else first
        return other.result()           # the other attempt's answer (or its error)

    def _attempt(self, key: str, data, verify_refusal: bool) -> bool:
        """One PUT of a data object (retried on failures), its latency recorded for the hedge
        delay: each attempt's own, so hedging does not shrink the estimate it is based on."""
        t0 = time.monotonic_ns()
        done = self._put(key, data, until_stopped=True, verify_refusal=verify_refusal)
        with self._stats_lock:
            self._recent_put_ns.append(time.monotonic_ns() - t0)
        return done

    def _hedge_delay(self) -> float | None:
        q = self._config.hedge_quantile
        if not q:
            return None
        with self._stats_lock:
            recent = sorted(self._recent_put_ns)
        if len(recent) < 20:
            return None
        return recent[min(len(recent) - 1, int(len(recent) * q))] / 1e9

    def _put(self, key: str, data, until_stopped: bool = False, verify_refusal: bool = False) -> bool:
        """put_if_absent with retries: a store's transient failure is retried (with backoff
        capped at `put_retry_max`) for `put_retry_seconds`, or for as long as the WAL is open
        when `until_stopped`; a fault that ends lets the WAL go on by itself. After a failed
        try (or always, with `verify_refusal`: a hedged PUT races its twin), a refusal may be our
        own PUT: the object is read back, and holding our bytes it counts as written."""
        cfg = self._config
        delay = 0.01
        give_up = time.monotonic() + cfg.put_retry_seconds
        tried = False
        while True:
            try:
                if self._store.put_if_absent(key, data):
                    return True
                if not tried and not verify_refusal:
                    return False
                self._count(gets=1)
                return self._store.get(key) == data
            except KeyError:
                pass                    # deleted between the refusal and the read: not ours, try again
            except Exception as e:      # noqa: BLE001 - the store's own retries are exhausted
                if isinstance(e, self._permanent) or (
                        (not until_stopped or self._stopping.is_set()) and time.monotonic() >= give_up):
                    raise WALIOError(f"WAL object {key!r} could not be written to {self._store.url}: {e}") from e
                self._count(put_retries=1)
                log.warning("WAL PUT of %s to %s failed (%s); retrying", key, self._store.url, e)
            tried = True
            time.sleep(delay)
            delay = min(delay * 2, cfg.put_retry_max)

    def _check_acks(self) -> None:
        """`ack_check` until it answers: WALFencedError stops the WAL; any other error (the
        metadata store is away) is retried while the WAL is open, the records unacknowledged."""
        assert self._ack_check is not None
        delay = 0.01
        while True:
            try:
                self._ack_check()
                return
            except WALFencedError:
                raise
            except Exception as e:      # noqa: BLE001 - no answer yet: nothing is acknowledged meanwhile
                if self._stopping.is_set():
                    raise WALIOError(f"WAL fencing check failed while closing: {e}") from e
                log.warning("WAL fencing check failed (%s); retrying", e)
                time.sleep(delay)
                delay = min(delay * 2, self._config.put_retry_max)

    def on_fenced(self, fn: Callable[[BaseException], object]) -> None:
        """Call `fn(error)` once, on a thread of its own, when a PUT finds that another writer
        fenced this one (a newer instance of the node, or a peer recovering it): every append
        from that object on fails, and the owner should stop at once rather than at its next
        metadata call. Called at once if that already happened."""
        with self._lock:
            self._on_fenced.append(fn)
            error = self._fenced_by
        if error is not None:
            threading.Thread(target=fn, args=(error,), name="wal-fenced", daemon=True).start()

    def _fenced(self, error: BaseException) -> None:
        with self._lock:
            if self._fenced_by is not None:
                return
            self._fenced_by = error
            callbacks = list(self._on_fenced)
        for fn in callbacks:
            threading.Thread(target=fn, args=(error,), name="wal-fenced", daemon=True).start()

    def on_close(self, fn: Callable[[], object]) -> None:
        """Run `fn` once the WAL is closed (the opener's store, say)."""
        self._on_close.append(fn)

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._stats[k] += v

    # ---- trimming ----------------------------------------------------------------------------

    def trim(self, offset: int) -> None:
        """Discard records before logical `offset`: their ring space is free at once; the trim
        is stamped into the next objects, and the objects wholly below it are deleted in the
        background (module docstring: a crash before that replays them, and replay skips them)."""
        with self._lock:
            ring = self._start()
            if offset <= self._trim:
                return
            durable = ring.durable_end
            if offset > durable:
                raise ValueError(f"cannot trim WAL to {offset}: records are durable only up to {durable}")
            ring.trim(offset)
            self._trim = offset
            below = sorted(seq for seq, end in self._live.items() if end <= offset)
            self._awaiting.extend((seq, self._live.pop(seq)) for seq in below)
            # An object taken but not yet in _live is at or above the first one not retired.
            self._trim_seq = min(min(self._live, default=NO_SEQ), self._first_data_seq + ring.retired_batches)
            self._trim_cv.notify()

    def _trim_loop(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._awaiting and self._awaiting[0][1] <= self._persisted_trim:
                        persisted = [seq for seq, end in self._awaiting if end <= self._persisted_trim]
                        self._awaiting = [(seq, end) for seq, end in self._awaiting if end > self._persisted_trim]
                        self._deletable.extend(persisted)
                    if self._deletable or self._closed:
                        break
                    self._trim_cv.wait()
                if not self._deletable:
                    return
                batch = self._deletable[:DELETE_BATCH]
                del self._deletable[:DELETE_BATCH]
            if not batch:
                continue
            keys = [object_key(self._node_id, s) for s in batch]
            try:
                self._store.delete(keys)
            except Exception as e:      # noqa: BLE001 - junk stays; deleted by a later trim
                log.warning("WAL trim: deleting %d objects from %s failed (%s); they will be retried",
                            len(keys), self._store.url, e)
                with self._lock:
                    self._deletable.extend(batch)
                if self._stopping.wait(1.0):
                    return
                continue
            self._count(deletes=len(keys), delete_requests=1)

    # ---- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Write out everything appended (its PUTs end), stop the threads. Objects wholly below
        the trim that are not deleted yet stay for the next session to delete."""
        with self._lock:
            if self._closed:
                return
            ring = self._ring
        if ring is not None:
            ring.stop()
            # PUTs that keep failing are retried for put_retry_seconds more, then given up.
            deadline = time.monotonic() + self._config.put_retry_seconds
            for t in self._threads:
                t.join(max(0.0, deadline - time.monotonic()))
            self._stopping.set()
            for t in self._threads:
                t.join()
            if self._dispatcher is not None:
                ring.stop_dispatcher()
                self._dispatcher.join()
        self._stopping.set()
        with self._lock:
            self._closed = True
            self._trim_cv.notify_all()
        if self._trimmer is not None:
            self._trimmer.join(timeout=self._config.put_retry_seconds)
        self._hedge_pool.shutdown(wait=False)
        for fn in self._on_close:
            fn()

    def _check_open(self) -> None:
        if self._closed:
            raise WALClosedError(f"WAL of node {self._node_id} at {self._store.url} is closed")

    # ---- introspection -------------------------------------------------------------------------

    @property
    def path(self) -> str:
        return f"{self._store.url.rstrip('/')}/{self._prefix}"

    @property
    def store(self) -> WALStore:
        return self._store

    @property
    def node_id(self) -> int:
        return self._node_id

    @property
    def node_epoch(self) -> int:
        return self._node_epoch

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def fence_seq(self) -> int:
        return self._fence_seq

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def max_record_bytes(self) -> int:
        return self._max_record

    @property
    def previous_shutdown_clean(self) -> bool:
        return False

    @property
    def salvaged_end(self) -> int:
        return 0

    @property
    def trim_offset(self) -> int:
        return self._trim

    @property
    def durable_end(self) -> int:
        ring = self._ring
        if ring is not None:
            return ring.durable_end
        return self._recovered.end if self._recovered else self._trim

    def stats(self) -> dict:
        """The ring's counters plus the store requests: `puts` (data objects), `fences`,
        `put_bytes`, `put_retries`, `deletes` (objects) in `delete_requests`, `gets`, `lists`,
        and `put_latency` percentiles (seconds) of this session's data PUTs."""
        ring = self._ring
        stats = ring.stats() if ring is not None else {}
        if ring is not None:
            stats.update(used_bytes=max(0, ring.appended_end - ring.trim_offset), capacity=self._capacity)
        with self._stats_lock:
            stats.update(self._stats)
            lat = sorted(self._put_ns)
        if lat:
            stats["put_latency"] = {f"p{q}": lat[min(len(lat) - 1, int(len(lat) * q / 100))] / 1e9
                                    for q in (50, 99)}
        stats.update(kind="objects", store=self._store.url)
        return stats

    def __repr__(self) -> str:
        return f"<ObjectWAL {self.path} node={self._node_id}@{self._node_epoch} generation={self._generation}>"
