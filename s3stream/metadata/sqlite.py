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
between tries whatever the holder does (`python -m benchmarks.metadata --quick`, 4 processes
writing at once: p99 6.84 -> 1.48 ms, max 54.9 -> 5.6 ms). Reads run in a plain transaction (one snapshot). Each
process uses one connection, guarded by a lock; a forked child opens its own.

Where the MetadataStore contract is silent, this store decides as the PostgreSQL one does: the
rules, checks and shared statements are s3stream.metadata.sql's (SqlMetadataStore), which lists
those decisions.
"""
from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from typing import Callable, Iterator, Sequence, cast

import tenacity

from ..errors import ConfigError, MetadataBusyError, MetadataError
from .base import (ChangeFeed, commit_notices, CommitRequest, CommitResult, NodeMeta, ObjectMeta, StreamMeta,
                   object_key)
from .hostfeed import HostNotifier
from .sql import (SCHEMA_VERSION, SqlMetadataStore, _MARK_DESTROYED, _PREPARED, _RANGE_COLUMNS, _Connection,
                  _apply_commit, _check_node_epoch, _check_prepare, _check_request_shape, _check_unchanged,
                  _closes_only, _kv_holds, _load_objects, _node_meta, _node_row, _open_rows, _streams_by_id,
                  _unknown_object, _unknown_stream)

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


class SqliteMetadataStore(SqlMetadataStore):
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

    def _read_rows(self, sql: str, params: Sequence = ()) -> list[tuple]:
        with self._transaction(write=False) as db:
            return db.execute(sql, params).fetchall()

    # A write transaction holds SQLite's one write lock from BEGIN IMMEDIATE on: no row needs
    # locking, and no writer comes between a check and its change.

    def _lock_node(self, db: _Connection, node_id: int, mode: str) -> None:
        pass

    def _lock_rows(self, db: _Connection, table: str, key: str, ids: Sequence[int]) -> None:
        pass

    def _insert_id(self, db: _Connection, sql: str, params: Sequence, id_column: str) -> int:
        """The rowid (`id_column` is the table's INTEGER PRIMARY KEY, the rowid itself)."""
        row_id = cast(sqlite3.Cursor, db.execute(sql, params)).lastrowid
        assert row_id is not None, "lastrowid is set after a successful INSERT"
        return row_id

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

    def fence_node(self, node_id: int, failover: bool = True,
                   if_unchanged: tuple[int, int] | None = None) -> NodeMeta:
        with self._transaction(write=True) as db:
            _check_unchanged(_node_meta(_node_row(db, node_id)), if_unchanged)
            db.execute("UPDATE nodes SET node_epoch = node_epoch + 1, failover = ? "
                       "WHERE node_id = ?", (int(failover), node_id))
            return _node_meta(_node_row(db, node_id))

    # ---- streams ---------------------------------------------------------------------------

    def open_streams(self, stream_ids: Sequence[int], node_id: int, node_epoch: int,
                     reserve: int = 0) -> list[StreamMeta]:
        with self._transaction(write=True) as db:
            _check_node_epoch(db, node_id, node_epoch)
            return _open_rows(db, stream_ids, node_id, reserve,
                              f"INSERT OR REPLACE INTO ranges ({_RANGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)")

    # ---- objects ---------------------------------------------------------------------------

    def prepare_objects(self, count: int, ttl_ns: int) -> list[int]:
        _check_prepare(count, ttl_ns)
        with self._transaction(write=True) as db:
            now = self._clock()
            # The key derives from the id, which exists only once the row is inserted.
            ids = [self._insert_id(db, "INSERT INTO objects (key, size, state, prepared_ns, expire_ns) "
                                       "VALUES ('', 0, ?, ?, ?)", (_PREPARED, now, now + ttl_ns), "object_id")
                   for _ in range(count)]
            db.executemany("UPDATE objects SET key = ? WHERE object_id = ?",
                           [(object_key(object_id), object_id) for object_id in ids])
            return ids

    def commit(self, request: CommitRequest) -> CommitResult:
        result = self._commit(request)
        self._notifier.notify_many(commit_notices(request))    # tailing readers, waiters on request.kv
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
                    raise _unknown_object(object_id)
                rows[object_id] = row
            ranges = request.all_ranges()
            # The streams by lists of ids (one each made a failover's close of 20,000 streams
            # 40,000 statements, 0.48 s of the one writer's time).
            wanted = sorted({r.stream_id for r in ranges} | {sid for sid, _ in request.closes})
            streams = _streams_by_id(db, wanted, last_range=True, no_ranges=_closes_only(request))
            for stream_id in wanted:
                if stream_id not in streams:
                    raise _unknown_stream(stream_id)
            result = _apply_commit(db, request, now, rows, streams, _set_stream_ends, _insert_refs)
            db.executemany("INSERT OR REPLACE INTO kv VALUES (?, ?)", [(k, bytes(v)) for k, v in request.kv])
            return result

    def objects_to_delete(self, destroy_delay_ns: int, limit: int | None = None) -> list[ObjectMeta]:
        with self._transaction(write=False) as db:
            now = self._clock()
            # Two index range scans on (state), lowest ids first, cut at the limit (-1: none).
            return _load_objects(
                db, "o.object_id IN (SELECT object_id FROM objects WHERE state = ? AND expire_ns <= ? UNION "
                    "SELECT object_id FROM objects WHERE state = ? AND mark_destroyed_ns <= ? "
                    "ORDER BY 1 LIMIT ?)",
                (_PREPARED, now, _MARK_DESTROYED, now - destroy_delay_ns, -1 if limit is None else limit))

    # ---- KV --------------------------------------------------------------------------------

    # Every KV write that changed something wakes the feeds of this host's processes
    # (kv_changes) once it has committed.

    def put_kv(self, key: str, value: bytes) -> None:
        with self._transaction(write=True) as db:
            db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, bytes(value)))
        self._notifier.notify(key)

    def put_kvs(self, items: Sequence[tuple[str, bytes]]) -> None:
        if not items:
            return
        with self._transaction(write=True) as db:
            db.executemany("INSERT OR REPLACE INTO kv VALUES (?, ?)", [(k, bytes(v)) for k, v in items])
        self._notifier.notify_many(key for key, _ in items)

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

    def replace_kvs(self, items: Sequence[tuple[str, bytes | None, bytes]]) -> list[bool]:
        done = []
        with self._transaction(write=True) as db:    # BEGIN IMMEDIATE: no writer in between
            for key, expected, value in items:
                done.append(_kv_holds(db, key, expected, None))
                if done[-1]:
                    db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, bytes(value)))
        self._notifier.notify_many(key for (key, _, _), written in zip(items, done) if written)
        return done

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


# ---- helpers ----------------------------------------------------------------------------------

def _set_stream_ends(db: _Connection, ends: list[tuple[int, int, int]]) -> None:
    db.executemany("UPDATE streams SET end_offset = ? WHERE stream_id = ?", [(end, sid) for sid, end, _ in ends])
    db.executemany("UPDATE ranges SET end_offset = ? WHERE stream_id = ? AND range_index = ?",
                   [(end, sid, index) for sid, end, index in ends])


def _insert_refs(db: _Connection, table: str, rows: list) -> None:
    """A commit's sso_ranges or stream_objects rows: a statement each, which SQLite runs in C."""
    db.executemany(f"INSERT INTO {table} VALUES (?, ?, ?, ?)", rows)


# SQLite's primary result codes (sqlite3 exports them only from Python 3.11 on, with
# sqlite_errorcode; on 3.10 _busy goes by the message).
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6


def _busy(e: sqlite3.Error) -> bool:
    """SQLite's "database is locked" / "database table is locked" / SQLITE_BUSY: transient."""
    code = getattr(e, "sqlite_errorcode", None)
    return (code is not None and (code & 0xFF) in (_SQLITE_BUSY, _SQLITE_LOCKED)) or (
        isinstance(e, sqlite3.OperationalError) and ("locked" in str(e) or "busy" in str(e)))

