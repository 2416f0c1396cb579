"""MetadataStore on one SQLite file, shared by the threads and processes of one machine.

Schema (version 2, recorded as the `schema_version` row of `schema_info`; a version 1 file is
upgraded in place by adding the columns marked v2):

    schema_info(name PK, value)                 the 'schema_version' row
    kv(key PK, value BLOB)
    nodes(node_id PK, node_epoch, failover, wal_path, heartbeat_ns, health v2)
    streams(stream_id PK AUTOINCREMENT, epoch, state, owner_node_id, start_offset, end_offset,
            reserved_end v2)
    ranges(stream_id, range_index, node_id, epoch, start_offset, end_offset, lost v2)
                                                PK (stream_id, range_index)
    objects(object_id PK AUTOINCREMENT, key, size, type, state, node_id, order_id,
            prepared_ns, expire_ns, committed_ns, mark_destroyed_ns)
                                                index (state), index (node_id, order_id)
    sso_ranges(object_id, stream_id, start_offset, end_offset)
                                                PK (object_id, stream_id, start_offset),
                                                index (stream_id, end_offset)
    stream_objects(object_id PK, stream_id, start_offset, end_offset)
                                                index (stream_id, end_offset, start_offset)

The (stream_id, end_offset) indexes cover get_object_refs: an index range scan from the first
range ending after the wanted start, in offset order, stopping after `limit` rows.

AUTOINCREMENT keeps object and stream ids from ever being reused, even after their rows are gone.

List membership follows `objects.state`: a stream's StreamObjects are its `stream_objects` rows
whose object is COMMITTED, a node's SSO list is its COMMITTED SSOs by `order_id`, and
`get_object_refs` joins on COMMITTED. Marking an object for destruction therefore only changes its
state; its `sso_ranges` / `stream_objects` rows stay until `remove_objects` deletes the object, so
`ObjectMeta.ranges` still says what a MARK_DESTROYED object held.

Concurrency: the database runs in WAL journal mode with `synchronous=FULL` (a commit that
acknowledges an upload must survive power loss) and a busy timeout. Every write is one
`BEGIN IMMEDIATE` transaction that takes SQLite's write lock before reading its preconditions, so
writers of several processes queue on the busy timeout instead of failing on a lock upgrade, and
checks and changes can never interleave. A writer that finds the lock taken tries again every
0.1-2 ms (randomised), not on SQLite's own schedule, which sleeps 1, 2, 5, 10, 15, 20, 25 ... ms
between tries whatever the holder does (`python -m s3stream.bench_metadata --quick`, 4 processes
writing at once: p99 6.84 -> 1.48 ms, max 54.9 -> 5.6 ms). Reads run in a plain transaction (one snapshot). Each
process uses one connection, guarded by a lock; a forked child opens its own.

Where the MetadataStore contract is silent, this store decides:
- commit: an object past its expiry can no longer be committed, even if still PREPARED (the
  lifecycle may already be deleting its data): MetadataError. A request with `compacted_ids` is a
  compaction: its ranges are not appended at the stream ends (no stream epoch fencing, no end
  offset change) but must lie within the ranges of the compacted objects and, above each stream's
  start offset, cover them completely, so COMMITTED ranges of a stream never overlap and no data
  is lost. A StreamObject of a DELETED stream is committed and at once marked for destruction (no
  stream holds it any more). The retry check ignores ranges of DELETED streams, and accepts
  objects MARK_DESTROYED since the first attempt when all their ranges are dead (trimmed or
  deleted meanwhile).
- trim_stream and delete_stream mark for destruction an SSO only when the range they killed was
  its last live one; an SSO committed with its ranges already dead waits for compaction.
- SSO order ids are 1 + the largest order id of the node's SSO rows in any state (commit order).
- trim_stream has no upper bound (the engine checks against its confirm offset) and works on
  OPENED and CLOSED streams alike at the current epoch.
- close_stream clears the owner; delete_stream of a DELETED stream at its epoch is a no-op;
  close/trim/delete of a DELETED stream raise StreamNotFoundError (except that no-op).
- mark_destroyed skips objects already MARK_DESTROYED and raises MetadataError for PREPARED or
  unknown ones; get_object_refs does not check the stream's state.
- Unknown nodes raise MetadataError; prepare_objects raises ValueError for count < 1 or ttl < 0.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sqlite3
import threading
import time
from typing import Any, Callable, Iterator, Protocol, Sequence

import tenacity

from ..errors import (ConfigError, KVConflictError, MetadataBusyError, MetadataError, NodeAliveError, StreamFencedError,
                      StreamNotClosedError, StreamNotFoundError)
from .base import (ChangeFeed, commit_notices, CommitRange, CommitRequest, CommitResult, MetadataStore, NodeMeta, ObjectMeta,
                   ObjectRef, ObjectState, ObjectType, Range, StreamMeta, StreamRange, StreamState,
                   object_key)
from .hostfeed import HostNotifier

SCHEMA_VERSION = 2

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS kv (
        key TEXT PRIMARY KEY, value BLOB NOT NULL) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS nodes (
        node_id INTEGER PRIMARY KEY, node_epoch INTEGER NOT NULL, failover INTEGER NOT NULL,
        wal_path TEXT NOT NULL, heartbeat_ns INTEGER NOT NULL, health TEXT)""",
    """CREATE TABLE IF NOT EXISTS streams (
        stream_id INTEGER PRIMARY KEY AUTOINCREMENT, epoch INTEGER NOT NULL, state TEXT NOT NULL,
        owner_node_id INTEGER, start_offset INTEGER NOT NULL, end_offset INTEGER NOT NULL,
        reserved_end INTEGER NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS ranges (
        stream_id INTEGER NOT NULL REFERENCES streams (stream_id), range_index INTEGER NOT NULL,
        node_id INTEGER NOT NULL, epoch INTEGER NOT NULL,
        start_offset INTEGER NOT NULL, end_offset INTEGER NOT NULL, lost INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (stream_id, range_index)) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS objects (
        object_id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, size INTEGER NOT NULL,
        type TEXT, state TEXT NOT NULL, node_id INTEGER, order_id INTEGER,
        prepared_ns INTEGER NOT NULL, expire_ns INTEGER NOT NULL,
        committed_ns INTEGER, mark_destroyed_ns INTEGER)""",
    "CREATE INDEX IF NOT EXISTS objects_by_state ON objects (state)",
    """CREATE INDEX IF NOT EXISTS objects_by_node_order ON objects (node_id, order_id)
        WHERE node_id IS NOT NULL""",
    """CREATE TABLE IF NOT EXISTS sso_ranges (
        object_id INTEGER NOT NULL REFERENCES objects (object_id),
        stream_id INTEGER NOT NULL REFERENCES streams (stream_id),
        start_offset INTEGER NOT NULL, end_offset INTEGER NOT NULL,
        PRIMARY KEY (object_id, stream_id, start_offset)) WITHOUT ROWID""",
    """CREATE INDEX IF NOT EXISTS sso_ranges_by_stream
        ON sso_ranges (stream_id, end_offset)""",
    """CREATE TABLE IF NOT EXISTS stream_objects (
        object_id INTEGER PRIMARY KEY REFERENCES objects (object_id),
        stream_id INTEGER NOT NULL REFERENCES streams (stream_id),
        start_offset INTEGER NOT NULL, end_offset INTEGER NOT NULL)""",
    """CREATE INDEX IF NOT EXISTS stream_objects_by_stream
        ON stream_objects (stream_id, end_offset, start_offset)""",
    # Added without a version bump: CREATE INDEX IF NOT EXISTS upgrades older files in place.
    """CREATE INDEX IF NOT EXISTS streams_by_owner ON streams (owner_node_id)
        WHERE owner_node_id IS NOT NULL""",
)

#: Version 1 -> 2: the node's health, the streams' reserved ends, lost ranges (issue 26).
_UPGRADE_1_TO_2 = (
    "ALTER TABLE nodes ADD COLUMN health TEXT",
    "ALTER TABLE streams ADD COLUMN reserved_end INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE ranges ADD COLUMN lost INTEGER NOT NULL DEFAULT 0",
)

_STREAM_COLUMNS = "stream_id, epoch, state, owner_node_id, start_offset, end_offset, reserved_end"
_RANGE_COLUMNS = "stream_id, range_index, node_id, epoch, start_offset, end_offset"
_OBJECT_COLUMNS = ("o.object_id, o.key, o.size, o.type, o.state, o.node_id, o.order_id, "
                   "o.prepared_ns, o.expire_ns, o.committed_ns, o.mark_destroyed_ns")
_NODE_COLUMNS = "node_id, node_epoch, failover, wal_path, heartbeat_ns, health"

_PREPARED = ObjectState.PREPARED.value
_COMMITTED = ObjectState.COMMITTED.value
_MARK_DESTROYED = ObjectState.MARK_DESTROYED.value
_SO = ObjectType.STREAM_OBJECT.value
_SSO = ObjectType.STREAM_SET_OBJECT.value
_NO_OFFSET = (1 << 63) - 1
#: The COMMITTED SSOs holding a range of stream ? that ends in (?, ?] and no live range of any
#: stream (a range is live while its stream is not DELETED and it ends above the stream's start
#: offset). Run after a trim or a delete moved the stream's start from the first bound to the
#: second: an SSO dies with its last live range, so only the ranges that died just now are looked
#: at, whatever the stream's history. Nothing can read these SSOs any more.
_DEAD_SSOS = f"""
    SELECT DISTINCT d.object_id FROM sso_ranges d JOIN objects o ON o.object_id = d.object_id
    WHERE d.stream_id = ? AND d.end_offset > ? AND d.end_offset <= ? AND o.state = '{_COMMITTED}'
      AND NOT EXISTS (SELECT 1 FROM sso_ranges r JOIN streams s ON s.stream_id = r.stream_id
                      WHERE r.object_id = d.object_id AND s.state != '{StreamState.DELETED.value}'
                        AND r.end_offset > s.start_offset)
    ORDER BY d.object_id"""


def _where(path: str) -> str:
    """`path`, and for a relative one where it lands."""
    return repr(path) if os.path.isabs(path) else f"{path!r} ({os.path.abspath(path)}, relative to the working directory)"


def _path_hint(path: str) -> str:
    """What is wrong with a database path SQLite cannot open or that does not exist, and the fix:
    the directory (missing, or not writable), and the URL forms, since the usual cause is
    `sqlite:///data/meta.db` written for /data/meta.db."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        problem = f"its directory {directory} does not exist (create it, or fix the path)"
    elif not os.path.exists(path) and not os.access(directory, os.W_OK | os.X_OK):
        problem = f"its directory {directory} is not writable, so the file cannot be created there"
    elif not os.path.exists(path):
        problem = "the file does not exist"
    else:
        problem = "check the file's permissions"
    return (f"{problem}. In a URL the path comes after three slashes: sqlite:////absolute/path/meta.db (four in "
            "all) for an absolute path, sqlite:///relative.db for one relative to the working directory")


class SqliteMetadataStore(MetadataStore):
    """The metadata of one cluster in the SQLite file `path` (created if absent).

    `clock` gives the time in nanoseconds (inject a fake one in tests); `busy_timeout_s` bounds how
    long an operation waits for another process's write transaction. `create=False` refuses a
    file that does not exist instead of creating it. A file that cannot be opened is a
    ConfigError naming its path, whether its directory exists, and the URL forms (a missing
    directory is not created: it is most often a path given relative by mistake).
    """

    def __init__(self, path: str, *, clock: Callable[[], int] = time.time_ns,
                 busy_timeout_s: float = 30.0, create: bool = True) -> None:
        path = os.fspath(path)
        if not path or path == ":memory:" or path.startswith("file:"):
            raise ConfigError(f"metadata database path {path!r} is not a file path; SQLite "
                              f"metadata must live in a file that all processes can open")
        if os.path.isdir(path):
            raise ConfigError(f"metadata database path {path!r} is a directory; give a file "
                              f"path such as {os.path.join(path, 'metadata.db')!r}")
        if not create and not os.path.exists(path):
            raise ConfigError(f"no metadata database at {_where(path)}: {_path_hint(path)}")
        if busy_timeout_s < 0:
            raise ConfigError(f"busy_timeout_s must be >= 0, got {busy_timeout_s}")
        self.path = path
        self._clock = clock
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()
        self._conn = self._connect()
        try:
            self._init_schema()
        except BaseException:
            self.close()
            raise
        self._notifier = HostNotifier(path)

    # ---- connection and transactions -------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        conn = None
        try:
            # isolation_level=None: the module issues no implicit BEGIN/COMMIT; we issue our own.
            conn = sqlite3.connect(self.path, timeout=self._busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
            # Switching a new database to WAL needs an exclusive lock, and SQLite does not always
            # run the busy handler for it: two processes opening a fresh file at once would see
            # "database is locked". Retry within the busy timeout.
            mode = tenacity.Retrying(
                retry=tenacity.retry_if_exception(lambda e: isinstance(e, sqlite3.OperationalError)
                                                  and "locked" in str(e)),
                wait=tenacity.wait_random_exponential(multiplier=0.005, max=0.2),
                stop=tenacity.stop_after_delay(self._busy_timeout_s), reraise=True,
            )(lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
        except sqlite3.Error as e:
            if conn is not None:
                conn.close()
            hint = f"; {_path_hint(self.path)}" if "unable to open" in str(e) else ""
            raise ConfigError(f"cannot open metadata database {_where(self.path)}: {e}{hint}") from e
        if str(mode).lower() != "wal":
            conn.close()
            raise ConfigError(f"metadata database {self.path!r} cannot use WAL journal mode (got "
                              f"{mode!r}); put it on a local file system")
        return conn

    def _init_schema(self) -> None:
        with self._transaction(write=True, error=ConfigError) as db:
            db.execute("CREATE TABLE IF NOT EXISTS schema_info "
                       "(name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
            row = db.execute(
                "SELECT value FROM schema_info WHERE name = 'schema_version'").fetchone()
            if row is None:
                foreign = db.execute(
                    "SELECT count(*) FROM sqlite_master WHERE type = 'table' "
                    "AND name NOT IN ('schema_info', 'sqlite_sequence')").fetchone()[0]
                if foreign:
                    raise ConfigError(f"{self.path!r} is an SQLite database of something else "
                                      f"(it has tables but no s3stream schema version)")
                db.execute("INSERT INTO schema_info VALUES ('schema_version', ?)",
                           (SCHEMA_VERSION,))
            elif row[0] == 1:
                for statement in _UPGRADE_1_TO_2:
                    db.execute(statement)
                db.execute("UPDATE schema_info SET value = 2 WHERE name = 'schema_version'")
            elif row[0] != SCHEMA_VERSION:
                raise ConfigError(f"metadata database {self.path!r} has schema version {row[0]}, "
                                  f"this s3stream reads version {SCHEMA_VERSION}; use a matching "
                                  f"s3stream release")
            for statement in _SCHEMA:
                db.execute(statement)

    @contextlib.contextmanager
    def _transaction(self, write: bool,
                     error: type[Exception] = MetadataError) -> Iterator[sqlite3.Connection]:
        """One transaction: BEGIN IMMEDIATE (write lock taken up front) or a plain BEGIN.
        Commits if the body returns, rolls back if it raises; SQLite errors become `error`."""
        with self._lock:
            if self._closed:
                raise MetadataError(f"metadata store {self.path!r} is closed")
            if self._pid != os.getpid():
                # A connection must not cross fork(); the parent keeps using (and closes) its own.
                self._conn, self._pid = self._connect(), os.getpid()
            conn = self._conn
            try:
                if write:
                    self._begin_immediate(conn)
                else:
                    conn.execute("BEGIN")
                try:
                    yield conn
                    conn.execute("COMMIT")
                finally:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
            except sqlite3.Error as e:
                if error is MetadataError and _busy(e):
                    raise MetadataBusyError(
                        f"metadata database {self.path!r} stayed locked by another connection past "
                        f"busy_timeout_s ({self._busy_timeout_s:g} s): {e}") from e
                raise error(f"metadata database {self.path!r}: {e}") from e

    def _begin_immediate(self, conn: sqlite3.Connection) -> None:
        """BEGIN IMMEDIATE; while another connection holds the write lock, tried again after
        0.1-2 ms (random, exponential) until busy_timeout_s, with SQLite's own busy handler off
        for it (see the module docstring). Nothing has been done yet, so a try can be repeated."""
        conn.execute("PRAGMA busy_timeout = 0")
        try:
            try:
                conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as e:
                if not _busy(e):
                    raise
            tenacity.Retrying(
                retry=tenacity.retry_if_exception(lambda e: isinstance(e, sqlite3.OperationalError) and _busy(e)),
                wait=tenacity.wait_random_exponential(multiplier=0.0001, max=0.002),
                stop=tenacity.stop_after_delay(self._busy_timeout_s), reraise=True,
            )(conn.execute, "BEGIN IMMEDIATE")
        finally:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                if self._pid == os.getpid():
                    self._conn.close()
                if hasattr(self, "_notifier"):
                    self._notifier.close()

    # ---- nodes -----------------------------------------------------------------------------

    def register_node(self, node_id: int, wal_path: str) -> NodeMeta:
        with self._transaction(write=True) as db:
            now = self._clock()
            row = db.execute("SELECT node_epoch FROM nodes WHERE node_id = ?",
                             (node_id,)).fetchone()
            epoch = 0 if row is None else row[0] + 1
            db.execute("INSERT OR REPLACE INTO nodes (node_id, node_epoch, failover, wal_path, heartbeat_ns) "
                       "VALUES (?, ?, 0, ?, ?)", (node_id, epoch, wal_path, now))
            return NodeMeta(node_id, epoch, False, wal_path, now)

    def get_node(self, node_id: int) -> NodeMeta:
        with self._transaction(write=False) as db:
            return _node_meta(_node_row(db, node_id))

    def list_nodes(self) -> list[NodeMeta]:
        with self._transaction(write=False) as db:
            rows = db.execute(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY node_id").fetchall()
        return [_node_meta(row) for row in rows]

    def heartbeat(self, node_id: int, node_epoch: int, health: str | None = None) -> None:
        with self._transaction(write=True) as db:
            _check_node_epoch(db, node_id, node_epoch)
            db.execute("UPDATE nodes SET heartbeat_ns = ?, health = ? WHERE node_id = ?",
                       (self._clock(), health, node_id))

    def fence_node(self, node_id: int, failover: bool = True,
                   if_unchanged: tuple[int, int] | None = None) -> NodeMeta:
        with self._transaction(write=True) as db:
            _check_unchanged(_node_meta(_node_row(db, node_id)), if_unchanged)
            db.execute("UPDATE nodes SET node_epoch = node_epoch + 1, failover = ? "
                       "WHERE node_id = ?", (int(failover), node_id))
            return _node_meta(_node_row(db, node_id))

    # ---- streams ---------------------------------------------------------------------------

    def create_stream(self, node_id: int, node_epoch: int, reserve: int = 0) -> StreamMeta:
        with self._transaction(write=True) as db:
            _check_node_epoch(db, node_id, node_epoch)
            stream_id = _inserted_id(db.execute(
                "INSERT INTO streams (epoch, state, owner_node_id, start_offset, end_offset, reserved_end) "
                "VALUES (0, ?, ?, 0, 0, ?)", (StreamState.OPENED.value, node_id, reserve)))
            db.execute(f"INSERT INTO ranges ({_RANGE_COLUMNS}) VALUES (?, 0, ?, 0, 0, 0)", (stream_id, node_id))
            return _load_stream(db, stream_id)

    def open_stream(self, stream_id: int, node_id: int, node_epoch: int, reserve: int = 0) -> StreamMeta:
        return self.open_streams([stream_id], node_id, node_epoch, reserve)[0]

    def open_streams(self, stream_ids: Sequence[int], node_id: int, node_epoch: int,
                     reserve: int = 0) -> list[StreamMeta]:
        with self._transaction(write=True) as db:
            _check_node_epoch(db, node_id, node_epoch)
            return _open_rows(db, stream_ids, node_id, reserve,
                              f"INSERT OR REPLACE INTO ranges ({_RANGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)")

    def reserve_offsets(self, stream_id: int, epoch: int, node_id: int, node_epoch: int,
                        reserved_end: int) -> StreamMeta:
        with self._transaction(write=True) as db:
            _check_node_epoch(db, node_id, node_epoch)
            stream = _live_stream(db, stream_id)
            _check_owner(stream, epoch, node_id)
            if reserved_end > stream.reserved_end:
                db.execute("UPDATE streams SET reserved_end = ? WHERE stream_id = ?", (reserved_end, stream_id))
            return _load_stream(db, stream_id)

    def abandon_stream(self, stream_id: int, epoch: int, node_id: int) -> StreamMeta:
        with self._transaction(write=True) as db:
            stream = _live_stream(db, stream_id)
            if stream.state == StreamState.CLOSED and stream.epoch == epoch:
                return stream
            _check_owner(stream, epoch, node_id)
            _abandon(db, stream)
            return _load_stream(db, stream_id)

    def close_stream(self, stream_id: int, epoch: int, node_id: int, node_epoch: int | None = None) -> StreamMeta:
        with self._transaction(write=True) as db:
            if node_epoch is not None:
                _check_node_epoch(db, node_id, node_epoch)
            stream = _live_stream(db, stream_id)
            if stream.state == StreamState.CLOSED and stream.epoch == epoch:
                return stream
            if (stream.state != StreamState.OPENED or stream.epoch != epoch
                    or stream.owner_node_id != node_id):
                raise StreamFencedError(
                    f"stream {stream_id} epoch {epoch} on node {node_id} is fenced: the stream "
                    f"is {stream.state.value} at epoch {stream.epoch} on node "
                    f"{stream.owner_node_id}; reopen it to continue")
            db.execute("UPDATE streams SET state = ?, owner_node_id = NULL WHERE stream_id = ?",
                       (StreamState.CLOSED.value, stream_id))
            return _load_stream(db, stream_id)

    def trim_stream(self, stream_id: int, epoch: int, new_start_offset: int) -> StreamMeta:
        with self._transaction(write=True) as db:
            stream = _live_stream(db, stream_id)
            _check_stream_epoch(stream, epoch)
            if new_start_offset <= stream.start_offset:
                return stream
            db.execute("UPDATE streams SET start_offset = ? WHERE stream_id = ?",
                       (new_start_offset, stream_id))
            db.execute("DELETE FROM ranges WHERE stream_id = ? AND end_offset <= ? AND range_index < ?",
                       (stream_id, new_start_offset, stream.ranges[-1].index))
            _mark_destroyed(db, self._clock(), _ids(db.execute(
                "SELECT object_id FROM stream_objects WHERE stream_id = ? AND end_offset <= ?",
                (stream_id, new_start_offset)))
                + _ids(db.execute(_DEAD_SSOS, (stream_id, stream.start_offset, new_start_offset))))
            return _load_stream(db, stream_id)

    def delete_stream(self, stream_id: int, epoch: int) -> StreamMeta:
        with self._transaction(write=True) as db:
            stream = _load_stream(db, stream_id)
            _check_stream_epoch(stream, epoch)
            if stream.state == StreamState.DELETED:
                return stream
            db.execute("UPDATE streams SET state = ?, owner_node_id = NULL WHERE stream_id = ?",
                       (StreamState.DELETED.value, stream_id))
            _mark_destroyed(db, self._clock(), _ids(db.execute(
                "SELECT object_id FROM stream_objects WHERE stream_id = ?", (stream_id,)))
                + _ids(db.execute(_DEAD_SSOS, (stream_id, stream.start_offset, _NO_OFFSET))))
            return _load_stream(db, stream_id)

    def get_stream(self, stream_id: int) -> StreamMeta:
        with self._transaction(write=False) as db:
            return _load_stream(db, stream_id)

    def _get_streams(self, stream_ids: list[int]) -> list[StreamMeta]:
        if not stream_ids:
            return []
        with self._transaction(write=False) as db:
            return _load_streams(db, f"WHERE stream_id IN ({', '.join('?' * len(stream_ids))})", stream_ids)

    def list_streams(self, include_deleted: bool = False,
                     owner_node_id: int | None = None) -> list[StreamMeta]:
        params: tuple[object, ...]
        if owner_node_id is not None:       # the owner is set only while OPENED
            where, params = "WHERE owner_node_id = ? AND state = ?", (owner_node_id, StreamState.OPENED.value)
        elif include_deleted:
            where, params = "", ()
        else:
            where, params = "WHERE state != ?", (StreamState.DELETED.value,)
        with self._transaction(write=False) as db:
            return _load_streams(db, where, params)

    # ---- objects ---------------------------------------------------------------------------

    def prepare_objects(self, count: int, ttl_ns: int) -> list[int]:
        if count < 1:
            raise ValueError(f"prepare_objects needs count >= 1, got {count}")
        if ttl_ns < 0:
            raise ValueError(f"prepare_objects needs ttl_ns >= 0, got {ttl_ns}")
        with self._transaction(write=True) as db:
            now = self._clock()
            # The key derives from the id, which exists only once the row is inserted.
            ids = [_inserted_id(db.execute("INSERT INTO objects (key, size, state, prepared_ns, expire_ns) "
                                           "VALUES ('', 0, ?, ?, ?)", (_PREPARED, now, now + ttl_ns)))
                   for _ in range(count)]
            db.executemany("UPDATE objects SET key = ? WHERE object_id = ?",
                           [(object_key(object_id), object_id) for object_id in ids])
            return ids

    def commit(self, request: CommitRequest) -> CommitResult:
        result = self._commit(request)
        for key in commit_notices(request):                # tailing readers, waiters on request.kv
            self._notifier.notify(key)
        return result

    def _commit(self, request: CommitRequest) -> CommitResult:
        with self._transaction(write=True) as db:
            now = self._clock()
            _check_node_epoch(db, request.node_id, request.node_epoch)
            object_ids = request.object_ids()
            _check_request_shape(request, object_ids)
            rows = {}
            for object_id in object_ids:
                row = db.execute("SELECT state, expire_ns FROM objects WHERE object_id = ?",
                                 (object_id,)).fetchone()
                if row is None:
                    raise MetadataError(f"commit names object {object_id}, which does not exist "
                                        f"(never prepared, or expired and removed)")
                rows[object_id] = row
            ranges = request.all_ranges()
            streams = {}
            for stream_id in {r.stream_id for r in ranges} | {sid for sid, _ in request.closes}:
                try:
                    streams[stream_id] = _load_stream(db, stream_id, last_range=True)
                except StreamNotFoundError:
                    raise MetadataError(f"commit names stream {stream_id}, which does not "
                                        f"exist") from None
            result = _apply_commit(db, request, now, rows, streams, _set_stream_ends)
            db.executemany("INSERT OR REPLACE INTO kv VALUES (?, ?)", [(k, bytes(v)) for k, v in request.kv])
            return result

    def get_object(self, object_id: int) -> ObjectMeta:
        with self._transaction(write=False) as db:
            found = _load_objects(db, "o.object_id = ?", (object_id,))
        if not found:
            raise MetadataError(f"object {object_id} does not exist")
        return found[0]

    def list_objects(self, state: ObjectState | None = None, type: ObjectType | None = None,
                     node_id: int | None = None) -> list[ObjectMeta]:
        conditions, params = ["1"], []
        for column, value in (("state", state), ("type", type), ("node_id", node_id)):
            if value is not None:
                conditions.append(f"o.{column} = ?")
                params.append(value.value if isinstance(value, (ObjectState, ObjectType))
                              else value)
        with self._transaction(write=False) as db:
            return _load_objects(db, " AND ".join(conditions), params)

    def get_object_refs(self, stream_id: int, start_offset: int, end_offset: int,
                        limit: int = 64) -> list[ObjectRef]:
        if limit <= 0 or start_offset >= end_offset:
            return []
        refs = []
        # COMMITTED ranges of a stream never overlap (commit and compaction checks), so order by
        # end offset equals order by start offset and lets the (stream_id, end_offset) index
        # both find the first range and stop after `limit`.
        with self._transaction(write=False) as db:
            for table, kind in (("sso_ranges", ObjectType.STREAM_SET_OBJECT),
                                ("stream_objects", ObjectType.STREAM_OBJECT)):
                rows = db.execute(
                    f"SELECT o.object_id, o.key, o.size, r.start_offset, r.end_offset "
                    f"FROM {table} r JOIN objects o ON o.object_id = r.object_id "
                    f"WHERE r.stream_id = ? AND r.end_offset > ? AND r.start_offset < ? "
                    f"AND o.state = ? ORDER BY r.end_offset LIMIT ?",
                    (stream_id, start_offset, end_offset, _COMMITTED, limit)).fetchall()
                refs += [ObjectRef(object_id, key, size, kind, stream_id, start, end)
                         for object_id, key, size, start, end in rows]
        refs.sort(key=lambda ref: (ref.start_offset, ref.end_offset, ref.object_id))
        return refs[:limit]

    def node_stream_set_objects(self, node_id: int) -> list[ObjectMeta]:
        with self._transaction(write=False) as db:
            return _load_objects(db, "o.node_id = ? AND o.state = ? AND o.type = ?",
                                 (node_id, _COMMITTED, _SSO), order="o.order_id")

    def mark_destroyed(self, object_ids: Sequence[int]) -> None:
        with self._transaction(write=True) as db:
            to_mark = []
            for object_id in object_ids:
                row = db.execute("SELECT state FROM objects WHERE object_id = ?",
                                 (object_id,)).fetchone()
                if row is None or row[0] == _PREPARED:
                    raise MetadataError(
                        f"object {object_id} cannot be marked for destruction: "
                        f"{'it does not exist' if row is None else 'it is not committed'}")
                if row[0] == _COMMITTED:
                    to_mark.append(object_id)
            _mark_destroyed(db, self._clock(), to_mark)

    def objects_to_delete(self, destroy_delay_ns: int, limit: int | None = None) -> list[ObjectMeta]:
        with self._transaction(write=False) as db:
            now = self._clock()
            # Two index range scans on (state), lowest ids first, cut at the limit (-1: none).
            return _load_objects(
                db, "o.object_id IN (SELECT object_id FROM objects WHERE state = ? AND expire_ns <= ? UNION "
                    "SELECT object_id FROM objects WHERE state = ? AND mark_destroyed_ns <= ? "
                    "ORDER BY 1 LIMIT ?)",
                (_PREPARED, now, _MARK_DESTROYED, now - destroy_delay_ns, -1 if limit is None else limit))

    def remove_objects(self, object_ids: Sequence[int], unused_prepared: bool = False) -> list[int]:
        removed = []
        with self._transaction(write=True) as db:
            now = self._clock()
            for object_id in sorted(set(object_ids)):
                row = db.execute("SELECT state, expire_ns FROM objects WHERE object_id = ?",
                                 (object_id,)).fetchone()
                if row is None or not (row[0] == _MARK_DESTROYED
                                       or (row[0] == _PREPARED and (unused_prepared or row[1] <= now))):
                    continue
                for table in ("sso_ranges", "stream_objects", "objects"):
                    db.execute(f"DELETE FROM {table} WHERE object_id = ?", (object_id,))
                removed.append(object_id)
        return removed

    # ---- KV --------------------------------------------------------------------------------

    def get_kv(self, key: str) -> bytes | None:
        with self._transaction(write=False) as db:
            row = db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    def get_kv_and_node(self, key: str, node_id: int) -> tuple[bytes | None, NodeMeta]:
        with self._transaction(write=False) as db:
            row = db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
            node = _node_meta(_node_row(db, node_id))
        return (None if row is None else bytes(row[0])), node

    # Every KV write that changed something wakes the feeds of this host's processes
    # (kv_changes) once it has committed.

    def put_kv(self, key: str, value: bytes) -> None:
        with self._transaction(write=True) as db:
            db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, bytes(value)))
        self._notifier.notify(key)

    def put_kv_if_absent(self, key: str, value: bytes) -> bytes:
        with self._transaction(write=True) as db:
            inserted = db.execute("INSERT OR IGNORE INTO kv VALUES (?, ?)", (key, bytes(value))).rowcount
            stored = bytes(db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()[0])
        if inserted:
            self._notifier.notify(key)
        return stored

    def replace_kv(self, key: str, expected: bytes | None, value: bytes,
                   guard: tuple[str, bytes] | None = None) -> bool:
        with self._transaction(write=True) as db:    # BEGIN IMMEDIATE: no writer in between
            if not _kv_holds(db, key, expected, guard):
                return False
            db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, bytes(value)))
        self._notifier.notify(key)
        return True

    def delete_kv(self, key: str) -> None:
        with self._transaction(write=True) as db:
            deleted = db.execute("DELETE FROM kv WHERE key = ?", (key,)).rowcount
        if deleted:
            self._notifier.notify(key)

    def kv_changes(self, prefixes: Sequence[str]) -> ChangeFeed:
        """Pushed KV changes from every process of this host on the same database file
        (s3stream.metadata.hostfeed: UNIX datagram sockets); a polling feed where none can be
        made."""
        return self._notifier.feed(prefixes)

    def list_kv(self, prefix: str) -> dict[str, bytes]:
        # A range scan on the primary key: [prefix, prefix + U+10FFFF) holds every key with it.
        with self._transaction(write=False) as db:
            rows = db.execute("SELECT key, value FROM kv WHERE key >= ? AND key < ? ORDER BY key",
                              (prefix, prefix + "\U0010ffff")).fetchall()
        return {k: bytes(v) for k, v in rows}


# ---- helpers (all run inside a transaction) ----------------------------------------------------

class _Cursor(Protocol):
    """What the helpers use of a statement's result: sqlite3's cursor, or psycopg's."""
    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


class _Connection(Protocol):
    """What the helpers shared with the PostgreSQL store use of a connection: statements with
    qmark placeholders (sqlite3.Connection, or postgres._Db around a psycopg connection)."""
    def execute(self, sql: str, params: Sequence[Any] = ..., /) -> _Cursor: ...
    def executemany(self, sql: str, params_seq: Sequence[Sequence[Any]], /) -> object: ...


def _apply_commit(db: _Connection, request: CommitRequest, now: int, rows: dict[int, tuple],
                  streams: dict[int, StreamMeta], set_ends, lock: str = "") -> CommitResult:
    """The part of a commit both stores share, once the node epoch is checked and the objects'
    (state, expire_ns) `rows` and the request's `streams` are loaded (under the store's locks;
    with their last range only, which is all it reads):
    the retry, expiry, append and compaction checks, then the writes. `set_ends(db, ends)`
    moves each stream's end and its last range's end, ends = [(stream id, end, range index)]."""
    ranges = request.all_ranges()
    object_ids = request.object_ids()
    end_offsets = {stream_id: stream.end_offset for stream_id, stream in streams.items()}
    not_prepared = [i for i in object_ids if rows[i][0] != _PREPARED]
    if not_prepared:
        if len(not_prepared) < len(object_ids):
            prepared = [i for i in object_ids if i not in not_prepared]
            raise MetadataError(
                f"commit mixes PREPARED objects {prepared} with object {not_prepared[0]}"
                f" in state {rows[not_prepared[0]][0]}: a commit's objects must all be "
                f"PREPARED, or all COMMITTED by an earlier attempt of the same commit")
        _check_retry(db, request, streams)
        _apply_closes(db, request, streams)
        return CommitResult(end_offsets, already_committed=True)
    if request.kv_guard is not None and not _kv_holds(db, request.kv_guard[0], request.kv_guard[1], None, lock):
        key, expected = request.kv_guard
        raise KVConflictError(f"commit refused: KV key {key!r} no longer holds "
                              f"{'nothing' if expected is None else bytes(expected)!r} (another writer committed "
                              f"since it was read); nothing was committed: read it again")
    for object_id in object_ids:
        if rows[object_id][1] <= now:
            raise MetadataError(
                f"object {object_id} expired at {rows[object_id][1]} ns (now {now}): "
                f"its data may be deleted already; upload it again as a new object")
    deleted = {stream_id for stream_id, stream in streams.items()
               if stream.state == StreamState.DELETED}
    if request.compacted_ids:
        _check_compaction(db, request, streams)
    else:
        for stream_id, group in itertools.groupby(ranges, key=lambda r: r.stream_id):
            if stream_id not in deleted:
                _check_append(request.node_id, streams[stream_id], list(group))

    if request.sso is not None:
        # The node's next order id, computed in the update (one statement, no result to wait for).
        db.execute("UPDATE objects SET state = ?, type = ?, size = ?, node_id = ?, "
                   "order_id = (SELECT COALESCE(MAX(order_id), 0) + 1 FROM objects WHERE node_id = ?), "
                   "committed_ns = ? WHERE object_id = ?",
                   (_COMMITTED, _SSO, request.sso.size, request.node_id, request.node_id, now,
                    request.sso.object_id))
        db.executemany("INSERT INTO sso_ranges VALUES (?, ?, ?, ?)",
                       [(request.sso.object_id, r.stream_id, r.start_offset,
                         r.end_offset)
                        for r in request.sso.ranges if r.stream_id not in deleted])
    # One statement per kind of row for all the StreamObjects (a close commits one per stream).
    live = [so for so in request.stream_objects if so.range.stream_id not in deleted]
    # An SO of a deleted stream: no stream holds it any more, committed straight into destruction.
    db.executemany("UPDATE objects SET state = ?, type = ?, size = ?, "
                   "committed_ns = ?, mark_destroyed_ns = ? WHERE object_id = ?",
                   [(_MARK_DESTROYED, _SO, so.size, now, now, so.object_id)
                    for so in request.stream_objects if so.range.stream_id in deleted])
    db.executemany("UPDATE objects SET state = ?, type = ?, size = ?, committed_ns = ? "
                   "WHERE object_id = ?", [(_COMMITTED, _SO, so.size, now, so.object_id) for so in live])
    db.executemany("INSERT INTO stream_objects VALUES (?, ?, ?, ?)",
                   [(so.object_id, so.range.stream_id, so.range.start_offset, so.range.end_offset)
                    for so in live])
    _mark_destroyed(db, now, request.compacted_ids)
    if not request.compacted_ids:
        ends = []
        for stream_id, group in itertools.groupby(ranges, key=lambda r: r.stream_id):
            if stream_id not in deleted:
                ends.append((stream_id, list(group)[-1].end_offset, streams[stream_id].ranges[-1].index))
                end_offsets[stream_id] = ends[-1][1]
        if ends:
            set_ends(db, ends)
    _apply_closes(db, request, streams)
    return CommitResult(end_offsets)


def _apply_closes(db: _Connection, request: CommitRequest, streams: dict[int, StreamMeta]) -> None:
    """Close the request's `closes` (after its ranges are applied), as close_stream does."""
    to_close = []
    for stream_id, epoch in request.closes:
        stream = streams[stream_id]
        if stream.state == StreamState.CLOSED and stream.epoch == epoch:
            continue
        if (stream.state != StreamState.OPENED or stream.epoch != epoch
                or stream.owner_node_id != request.node_id):
            raise StreamFencedError(
                f"stream {stream_id} epoch {epoch} on node {request.node_id} is fenced: the stream "
                f"is {stream.state.value} at epoch {stream.epoch} on node "
                f"{stream.owner_node_id}; reopen it to continue")
        to_close.append(stream_id)
    if to_close:
        db.executemany("UPDATE streams SET state = ?, owner_node_id = NULL WHERE stream_id = ?",
                       [(StreamState.CLOSED.value, stream_id) for stream_id in to_close])


def _set_stream_ends(db: _Connection, ends: list[tuple[int, int, int]]) -> None:
    db.executemany("UPDATE streams SET end_offset = ? WHERE stream_id = ?", [(end, sid) for sid, end, _ in ends])
    db.executemany("UPDATE ranges SET end_offset = ? WHERE stream_id = ? AND range_index = ?",
                   [(end, sid, index) for sid, end, index in ends])


def _ids(cursor: _Cursor) -> list[int]:
    return [row[0] for row in cursor]


def _inserted_id(cursor: sqlite3.Cursor) -> int:
    """The rowid of the row an INSERT on `cursor` just made."""
    row_id = cursor.lastrowid
    assert row_id is not None, "lastrowid is set after a successful INSERT"
    return row_id


# SQLite's primary result codes (sqlite3 exports them only from Python 3.11 on, with
# sqlite_errorcode; on 3.10 _busy goes by the message).
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6


def _busy(e: sqlite3.Error) -> bool:
    """SQLite's "database is locked" / "database table is locked" / SQLITE_BUSY: transient."""
    code = getattr(e, "sqlite_errorcode", None)
    return (code is not None and (code & 0xFF) in (_SQLITE_BUSY, _SQLITE_LOCKED)) or (
        isinstance(e, sqlite3.OperationalError) and ("locked" in str(e) or "busy" in str(e)))


def _node_row(db: _Connection, node_id: int, lock: str = "") -> tuple:
    row = db.execute(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE node_id = ?{lock}",
                     (node_id,)).fetchone()
    if row is None:
        raise MetadataError(f"node {node_id} is not registered; call register_node first")
    return row


def _node_meta(row: tuple) -> NodeMeta:
    node_id, epoch, failover, wal_path, heartbeat_ns, health = row
    return NodeMeta(node_id, epoch, bool(failover), wal_path, heartbeat_ns, health)


def _check_unchanged(node: NodeMeta, expected: tuple[int, int] | None) -> None:
    """NodeAliveError unless the node's (epoch, heartbeat) is `expected` (None: no condition)."""
    if expected is not None and (node.node_epoch, node.heartbeat_ns) != tuple(expected):
        raise NodeAliveError(f"node {node.node_id} heartbeated (or restarted) since it was judged silent: epoch "
                             f"{node.node_epoch}, heartbeat {node.heartbeat_ns}, judged at {tuple(expected)}; "
                             "it is alive: not fenced")


def _check_node_epoch(db: _Connection, node_id: int, node_epoch: int, lock: str = "") -> None:
    """StreamFencedError unless `node_epoch` is the node's; `lock` (PostgreSQL: " FOR SHARE" and
    the like) locks the node row in the same statement."""
    _send_node_check(db, node_id, node_epoch, lock)()


def _send_node_check(db: _Connection, node_id: int, node_epoch: int, lock: str = "") -> Callable[[], None]:
    """_check_node_epoch in two halves: sends the node row's read and returns the check of its
    result. Statements sent in between travel with it (PostgreSQL's pipeline: one round trip for
    all of them), and take their locks after the node row's."""
    cursor = db.execute(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE node_id = ?{lock}", (node_id,))

    def check() -> None:
        row = cursor.fetchone()
        if row is None:
            raise MetadataError(f"node {node_id} is not registered; call register_node first")
        if node_epoch != row[1]:
            raise StreamFencedError(f"node {node_id} epoch {node_epoch} is fenced (current "
                                    f"{row[1]}): this node instance was replaced; stop it")
    return check


def _load_streams(db: _Connection, where: str, params: Sequence, lock: str = "",
                  last_range: bool = False) -> list[StreamMeta]:
    """The streams `where` selects, with their ranges (`last_range`: only the last one). Both
    statements are sent before either result is read (PostgreSQL's pipeline: one round trip);
    `lock` (" FOR UPDATE") locks the streams' rows, by the first of them."""
    return _send_load_streams(db, where, params, lock, last_range)()


def _send_load_streams(db: _Connection, where: str, params: Sequence, lock: str = "",
                       last_range: bool = False) -> Callable[[], list[StreamMeta]]:
    """_load_streams in two halves: sends its statements and returns what reads their results
    (statements sent in between travel with them on PostgreSQL). `last_range`: each stream's
    last range only, found through the primary key (what a commit checks and extends): a stream
    gains a range at every open, and a commit must not cost more the more owners it had."""
    stream_rows = db.execute(f"SELECT {_STREAM_COLUMNS} FROM streams {where} ORDER BY stream_id{lock}", params)
    if last_range:
        range_rows = db.execute(
            f"SELECT {', '.join(f'r.{c}' for c in _RANGE_COLUMNS.split(', '))}, r.lost FROM (SELECT stream_id, "
            f"(SELECT max(range_index) FROM ranges m WHERE m.stream_id = streams.stream_id) AS last "
            f"FROM streams {where}) s JOIN ranges r ON r.stream_id = s.stream_id AND r.range_index = s.last "
            f"ORDER BY r.stream_id", params)
    else:
        range_rows = db.execute(f"SELECT {_RANGE_COLUMNS}, lost "
                                f"FROM ranges WHERE stream_id IN (SELECT stream_id FROM streams {where}) "
                                f"ORDER BY stream_id, range_index", params)

    def load() -> list[StreamMeta]:
        ranges: dict[int, list[Range]] = {}
        for stream_id, index, node_id, epoch, start, end, lost in range_rows:
            ranges.setdefault(stream_id, []).append(Range(index, node_id, epoch, start, end, bool(lost)))
        return [StreamMeta(stream_id, epoch, StreamState(state), owner, start, end,
                           tuple(ranges.get(stream_id, ())), reserved)
                for stream_id, epoch, state, owner, start, end, reserved in stream_rows]
    return load


def _check_owner(stream: StreamMeta, epoch: int, node_id: int) -> None:
    """StreamFencedError unless `node_id` holds the stream OPENED at `epoch`."""
    if stream.state != StreamState.OPENED or stream.epoch != epoch or stream.owner_node_id != node_id:
        raise StreamFencedError(
            f"stream {stream.stream_id} epoch {epoch} on node {node_id} is fenced: the stream is "
            f"{stream.state.value} at epoch {stream.epoch} on node {stream.owner_node_id}")


def _abandon(db: _Connection, stream: StreamMeta) -> None:
    """abandon_stream's changes (the owner checked): the offsets its owner may have taken and
    not committed become a lost range, the end moves past them, the stream is CLOSED."""
    if stream.reserved_end > stream.end_offset:
        index = stream.ranges[-1].index + 1 if stream.ranges else 0
        db.execute(f"INSERT INTO ranges ({_RANGE_COLUMNS}, lost) VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (stream.stream_id, index, stream.owner_node_id, stream.epoch, stream.end_offset,
                    stream.reserved_end, True))
        db.execute("UPDATE streams SET end_offset = ? WHERE stream_id = ?", (stream.reserved_end, stream.stream_id))
    db.execute("UPDATE streams SET state = ?, owner_node_id = NULL WHERE stream_id = ?",
               (StreamState.CLOSED.value, stream.stream_id))


def _load_stream(db: _Connection, stream_id: int, last_range: bool = False) -> StreamMeta:
    found = _load_streams(db, "WHERE stream_id = ?", (stream_id,), last_range=last_range)
    if not found:
        raise StreamNotFoundError(f"stream {stream_id} does not exist")
    return found[0]


def _open_rows(db: _Connection, stream_ids: Sequence[int], node_id: int, reserve: int,
               put_range: str, lock: str = "", check: Callable[[], None] | None = None) -> list[StreamMeta]:
    """open_streams once the node's epoch is checked: each stream at epoch + 1, owned by
    `node_id`, with a new range from its end (`put_range`: the store's statement that inserts or
    replaces a ranges row) and `reserve` offsets reserved. The streams are read together (`lock`
    on PostgreSQL: " FOR UPDATE" locks their rows) and written together, a statement for all of
    them per table, so that the number of statements does not grow with the streams. `check`
    (the node's, from _send_node_check) runs once the streams are read; what is returned is what
    the writes make of the streams, not read again (on PostgreSQL the writes then travel with
    COMMIT)."""
    loaded = _streams_by_id(db, stream_ids, lock)
    if check is not None:
        check()
    range_rows, stream_rows = [], []
    for stream_id in stream_ids:
        stream = loaded.get(stream_id)
        if stream is None:
            raise StreamNotFoundError(f"stream {stream_id} does not exist")
        if stream.state == StreamState.DELETED:
            raise StreamNotFoundError(f"stream {stream_id} was deleted")
        if stream.state == StreamState.OPENED and stream.owner_node_id != node_id:
            raise StreamNotClosedError.held(stream_id, stream.owner_node_id, stream.epoch)
        epoch = stream.epoch + 1
        last = stream.ranges[-1]
        # An empty last range recorded nothing: the new holder takes its place.
        index = last.index if last.start_offset == last.end_offset else last.index + 1
        range_rows.append((stream_id, index, node_id, epoch, stream.end_offset, stream.end_offset))
        stream_rows.append((epoch, StreamState.OPENED.value, node_id, stream.end_offset + reserve, stream_id))
        # What these rows make of it, should the stream be named again.
        kept = stream.ranges[:-1] if index == last.index else stream.ranges
        loaded[stream_id] = dataclasses.replace(
            stream, epoch=epoch, state=StreamState.OPENED, owner_node_id=node_id,
            reserved_end=stream.end_offset + reserve,
            ranges=kept + (Range(index, node_id, epoch, stream.end_offset, stream.end_offset, False),))
    db.executemany(put_range, range_rows)
    db.executemany("UPDATE streams SET epoch = ?, state = ?, owner_node_id = ?, reserved_end = ? WHERE stream_id = ?",
                   stream_rows)
    return [loaded[stream_id] for stream_id in stream_ids]


def _streams_by_id(db: _Connection, stream_ids: Sequence[int], lock: str = "") -> dict[int, StreamMeta]:
    ids = sorted(set(stream_ids))
    if not ids:
        return {}
    return {m.stream_id: m for m in _load_streams(db, f"WHERE stream_id IN ({', '.join('?' * len(ids))})", ids, lock)}


def _live_stream(db: _Connection, stream_id: int) -> StreamMeta:
    stream = _load_stream(db, stream_id)
    if stream.state == StreamState.DELETED:
        raise StreamNotFoundError(f"stream {stream_id} was deleted")
    return stream


def _check_stream_epoch(stream: StreamMeta, epoch: int) -> None:
    if epoch != stream.epoch:
        raise StreamFencedError(f"stream {stream.stream_id} epoch {epoch} is fenced (current "
                                f"epoch {stream.epoch}); reopen the stream to continue")


def _load_objects(db: _Connection, where: str, params: Sequence,
                  order: str = "o.object_id") -> list[ObjectMeta]:
    ranges: dict[int, list[StreamRange]] = {}
    for object_id, *fields in db.execute(
            f"SELECT r.object_id, r.stream_id, r.start_offset, r.end_offset "
            f"FROM sso_ranges r JOIN objects o ON o.object_id = r.object_id WHERE ({where}) "
            f"UNION ALL SELECT r.object_id, r.stream_id, r.start_offset, r.end_offset "
            f"FROM stream_objects r JOIN objects o ON o.object_id = r.object_id WHERE ({where}) "
            f"ORDER BY 1, 2, 3", (*params, *params)):
        ranges.setdefault(object_id, []).append(StreamRange(*fields))
    objects = []
    for (object_id, key, size, type_, state, node_id, order_id, prepared_ns, expire_ns,
         committed_ns, mark_destroyed_ns) in db.execute(
            f"SELECT {_OBJECT_COLUMNS} FROM objects o WHERE ({where}) ORDER BY {order}", params):
        objects.append(ObjectMeta(
            object_id, key, size, None if type_ is None else ObjectType(type_),
            ObjectState(state), node_id, order_id, prepared_ns, expire_ns, committed_ns,
            mark_destroyed_ns, tuple(ranges.get(object_id, ()))))
    return objects


def _mark_destroyed(db: _Connection, now: int, object_ids: Sequence[int]) -> None:
    db.executemany("UPDATE objects SET state = ?, mark_destroyed_ns = ? "
                   "WHERE object_id = ? AND state = ?",
                   [(_MARK_DESTROYED, now, object_id, _COMMITTED) for object_id in object_ids])


def _check_request_shape(request: CommitRequest, object_ids: list[int]) -> None:
    """Checks that need no database: a malformed request is a caller bug."""
    if not object_ids and not request.compacted_ids and not request.closes:
        raise MetadataError("commit request has no objects, no compacted ids and no closes")
    if request.closes and request.compacted_ids:
        raise MetadataError("a compaction's commit closes no stream")
    if (request.kv or request.kv_guard) and not request.closes:
        raise MetadataError("a commit writes KV entries only with the closes they record")
    closed = [stream_id for stream_id, _ in request.closes]
    if len(set(closed)) != len(closed):
        raise MetadataError(f"commit request closes a stream twice: {closed}")
    named = object_ids + list(request.compacted_ids)
    if len(set(named)) != len(named):
        raise MetadataError(f"commit request names an object twice: {named}")
    sizes = ([request.sso.size] if request.sso else []) + [
        so.size for so in request.stream_objects]
    if any(size < 0 for size in sizes):
        raise MetadataError(f"commit request has a negative object size: {sizes}")
    for r in request.all_ranges():
        if r.start_offset >= r.end_offset:
            raise MetadataError(f"commit range of stream {r.stream_id} [{r.start_offset}, "
                                f"{r.end_offset}) is empty; every range must hold data")


def _check_append(node_id: int, stream: StreamMeta, ranges: list[CommitRange]) -> None:
    """An upload: the stream is held by the node at the ranges' epoch; ranges continue its end."""
    for r in ranges:
        if (stream.state != StreamState.OPENED or stream.owner_node_id != node_id
                or stream.epoch != r.epoch):
            raise StreamFencedError(
                f"stream {stream.stream_id} epoch {r.epoch} on node {node_id} is fenced: the "
                f"stream is {stream.state.value} at epoch {stream.epoch} on node "
                f"{stream.owner_node_id}; stop writing it and reopen it to continue")
    expected = stream.end_offset
    for r in ranges:
        if r.start_offset != expected:
            problem = "leaves a gap" if r.start_offset > expected else "overlaps committed data"
            raise MetadataError(
                f"stream {stream.stream_id}: commit range [{r.start_offset}, {r.end_offset}) "
                f"{problem}: expected it to start at offset {expected} (stream end offset "
                f"{stream.end_offset}); ranges must be contiguous from the end offset")
        expected = r.end_offset
    last = stream.ranges[-1] if stream.ranges else None
    if last is None or (last.node_id, last.epoch) != (node_id, stream.epoch):
        raise MetadataError(f"stream {stream.stream_id}: its last range {last} is not the one "
                            f"opened by node {node_id} at epoch {stream.epoch}")


def _check_compaction(db: _Connection, request: CommitRequest,
                      streams: dict[int, StreamMeta]) -> None:
    """A compaction: the compacted objects are COMMITTED; per live stream, the new ranges lie
    within the compacted ones and cover them above the stream's start offset."""
    old: dict[int, list[tuple[int, int]]] = {}
    for object_id in request.compacted_ids:
        row = db.execute("SELECT state FROM objects WHERE object_id = ?",
                         (object_id,)).fetchone()
        if row is None or row[0] != _COMMITTED:
            raise MetadataError(f"compacted object {object_id} is "
                                f"{'missing' if row is None else row[0]}, not COMMITTED: "
                                f"it was compacted or destroyed already; plan the compaction "
                                f"again")
        for stream_id, start, end in db.execute(
                "SELECT stream_id, start_offset, end_offset FROM sso_ranges WHERE object_id = ? "
                "UNION ALL SELECT stream_id, start_offset, end_offset FROM stream_objects "
                "WHERE object_id = ?", (object_id, object_id)):
            old.setdefault(stream_id, []).append((start, end))
    new: dict[int, list[tuple[int, int]]] = {}
    for r in request.all_ranges():
        new.setdefault(r.stream_id, []).append((r.start_offset, r.end_offset))
    for stream_id in sorted(set(old) | set(new)):
        stream = streams.get(stream_id)
        if stream is None:
            stream = _load_stream(db, stream_id)
        if stream.state == StreamState.DELETED:
            continue
        new_ranges = new.get(stream_id, [])
        for (_, previous_end), (start, end) in zip(new_ranges, new_ranges[1:]):
            if start < previous_end:
                raise MetadataError(f"compaction ranges of stream {stream_id} overlap at "
                                    f"[{start}, {previous_end})")
        old_merged = _merge(old.get(stream_id, []))
        outside = _uncovered(_merge(new_ranges), old_merged)
        if outside:
            raise MetadataError(f"compaction range of stream {stream_id} {outside[0]} is not "
                                f"held by the compacted objects {list(request.compacted_ids)}")
        live = [(max(start, stream.start_offset), end) for start, end in old_merged
                if end > stream.start_offset]
        lost = _uncovered(live, _merge(new_ranges))
        if lost:
            raise MetadataError(f"compaction would lose stream {stream_id} offsets {lost[0]} "
                                f"held by the compacted objects {list(request.compacted_ids)}")


def _check_retry(db: _Connection, request: CommitRequest,
                 streams: dict[int, StreamMeta]) -> None:
    """All objects are past PREPARED: accept only a repeat of the commit that put them there."""
    deleted = {stream_id for stream_id, stream in streams.items()
               if stream.state == StreamState.DELETED}

    def recorded(object_id: int, table: str) -> list[tuple[int, int, int]]:
        return [row for row in db.execute(
            f"SELECT stream_id, start_offset, end_offset FROM {table} WHERE object_id = ? "
            f"ORDER BY stream_id, start_offset", (object_id,)) if row[0] not in deleted]

    def mismatch(object_id: int, what: str) -> MetadataError:
        return MetadataError(f"object {object_id} is already committed with a different {what}: "
                             f"this request is not a retry of the commit that committed it")

    def check(object_id: int, type_: str, size: int, table: str,
              ranges: Sequence[CommitRange], may_be_destroyed: bool) -> None:
        state, actual_type, actual_size, node_id = db.execute(
            "SELECT state, type, size, node_id FROM objects WHERE object_id = ?",
            (object_id,)).fetchone()
        if state != _COMMITTED and not (may_be_destroyed and state == _MARK_DESTROYED):
            raise MetadataError(f"object {object_id} is {state}: it cannot be committed (again)")
        if actual_type != type_:
            raise mismatch(object_id, "type")
        if actual_size != size:
            raise mismatch(object_id, "size")
        if type_ == _SSO and node_id != request.node_id:
            raise mismatch(object_id, "node")
        wanted = sorted((r.stream_id, r.start_offset, r.end_offset) for r in ranges
                        if r.stream_id not in deleted)
        if recorded(object_id, table) != wanted:
            raise mismatch(object_id, "ranges")

    def dead(r: CommitRange) -> bool:
        """A trim or a delete since the first commit may have destroyed what holds only such ranges."""
        return r.stream_id in deleted or r.end_offset <= streams[r.stream_id].start_offset

    if request.sso is not None:
        check(request.sso.object_id, _SSO, request.sso.size, "sso_ranges", request.sso.ranges,
              may_be_destroyed=all(map(dead, request.sso.ranges)))
    for so in request.stream_objects:
        check(so.object_id, _SO, so.size, "stream_objects", (so.range,), may_be_destroyed=dead(so.range))


def _merge(intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif start < end:
            merged.append((start, end))
    return merged


def _uncovered(needed: list[tuple[int, int]],
               covering: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `needed` outside `covering` (both merged and sorted)."""
    gaps = []
    for start, end in needed:
        position = start
        for cover_start, cover_end in covering:
            if cover_end <= position:
                continue
            if cover_start >= end:
                break
            if cover_start > position:
                gaps.append((position, cover_start))
            position = cover_end
            if position >= end:
                break
        if position < end:
            gaps.append((position, end))
    return gaps


def _kv_holds(db: _Connection, key: str, expected: bytes | None, guard: tuple[str, bytes] | None,
              lock: str = "") -> bool:
    """True if `key` holds `expected` (None: absent) and the guard key (if any) its value.
    `lock` is appended to each SELECT (PostgreSQL: FOR UPDATE, to hold the rows until commit)."""
    checks = ([guard] if guard is not None else []) + [(key, expected)]
    for k, want in checks:
        row = db.execute(f"SELECT value FROM kv WHERE key = ?{lock}", (k,)).fetchone()
        if (None if row is None else bytes(row[0])) != (None if want is None else bytes(want)):
            return False
    return True
