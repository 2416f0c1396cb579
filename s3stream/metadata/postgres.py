"""MetadataStore on a PostgreSQL database, shared by the processes of several hosts (psycopg 3
with a psycopg_pool connection pool per process).

Schema (version 2, recorded as the `schema_version` row of `schema_info`; version 1 is upgraded
in place, as in SQLite): the tables, columns,
keys and indexes of the SQLite store (see s3stream.metadata.sqlite), with BIGINT for every id,
offset, epoch and time, BOOLEAN for `nodes.failover`, BYTEA for KV values and `COLLATE "C"` on KV
keys (so that keys sort, and `list_kv` range-scans, by code point as in SQLite). Stream and
object ids are identity columns: their sequences never hand out an id twice, even after rows
are removed or a transaction rolls back. The (stream_id, end_offset) indexes of `sso_ranges` and
`stream_objects` make `get_object_refs` an index range scan, as in SQLite.

The store creates the schema in the database the URL names, in one transaction under a
transaction-scoped advisory lock, so processes starting at once neither race nor see half a
schema. A database with other tables but no s3stream schema version, or a newer schema version,
is refused with ConfigError.

Concurrency: row locks, READ COMMITTED. Every write is one transaction that first locks the rows
whose state it checks, always in the same order (the node row, then stream rows by id, then
object rows by id), and reads its preconditions only after that; every statement of a READ
COMMITTED transaction sees what committed before it began, so a check reads the state that the
lock now freezes. This gives each operation what SQLite's BEGIN IMMEDIATE gives it, but per row:
writers of the same node, stream or object queue (up to `lock_timeout_s`), while commits of
different nodes to different streams run in parallel. A commit locks its node row FOR NO KEY
UPDATE, which serialises a node's commits (SSO order ids); a heartbeat's UPDATE takes the same
lock. create_stream, open_streams, reserve_offsets and a node's close_stream hold it FOR KEY
SHARE, which conflicts only with FOR UPDATE: they run beside the node's commits and heartbeats
(a node opening 10,000 partitions in batches does not stop its uploads' commits, nor they its
opens). What changes the node's epoch, fence_node and register_node, locks the row FOR UPDATE
first, and so waits for all of them, and they for it.
Reads run in REPEATABLE READ READ ONLY transactions: one snapshot, never a serialization failure.
SERIALIZABLE was the alternative: it needs no explicit locks but retries whole transactions on
every false conflict of its page-grained predicate locks (hot indexes such as objects by state
would make those frequent under load), and a queue on a row lock is cheaper and fairer than a
retry loop. The fixed lock order rules out deadlocks; should one happen all the same (40P01) it
surfaces as MetadataBusyError, which the uploader retries.

Errors: precondition failures raise what the SQLite store raises (the checks are shared with it:
s3stream.metadata.sql). A connection failure at construction is a ConfigError naming the URL
without its password. During an operation, a lock wait past `lock_timeout_s` (55P03), a deadlock,
a lost connection, a server shutdown or no free pooled connection within `pool_timeout_s` raise
MetadataBusyError naming the database and the cause. A pooled connection found dead when its
transaction begins (the server closed it while it was idle) is discarded and the operation starts
again on another one, since nothing was sent (a KV write, which goes as one query with no BEGIN,
looks at the socket before it sends: see _write_alone); a connection lost later is discarded by
the pool when it is returned (psycopg_pool replaces connections returned in a bad state), and the
error is MetadataBusyError: if it happened during COMMIT the outcome is unknown, and a retried
commit is recognised as such.

Outages: while the server is down, an operation waits up to `pool_timeout_s` for the pool to
reconnect, then raises MetadataBusyError. The pool retries a lost connection every
RECONNECT_DELAY_S (psycopg_pool's own schedule, 1, 2, 4, 8 ... s, would leave a store idle for up
to 8-16 s after a few seconds' outage), so operations succeed again within about that delay of
the server accepting connections; one waiting in the pool gets the new connection at once.

Connection poolers (PgBouncer in transaction mode): every transaction may run on another server
session, so the store keeps no state in a session. Its settings (lock_timeout, and
random_page_cost: _SET_PAGE_COST) are SET LOCAL at the start of each transaction, schema creation
takes a transaction-scoped advisory lock, and NOTIFY is sent inside the writing transaction. Two
things do need a session: psycopg's server-side prepared statements (`prepare_threshold=none` in
the URL turns them off) and LISTEN, which PgChangeFeed holds on a connection of its own
(`listen_url=` names a direct connection for it; without one, a store told `pgbouncer=1` hands
out polling change feeds). See PostgresMetadataStore.

Fork safety: a forked child must not share the parent's sockets. On the first operation in a
new process the store opens a new pool; the parent's pool is left untouched (never closed from
the child, which would end the parent's sessions).

Every choice s3stream.metadata.sql lists under "Where the MetadataStore contract is silent"
holds here too; times come from the injected clock, never from the server's now().
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Iterator, Sequence
from urllib.parse import unquote

import psycopg
import psycopg.conninfo
from psycopg_pool import ConnectionPool

from ..errors import ConfigError, MetadataBusyError, MetadataError
from .base import (TAILING_PREFIX, ChangeFeed, commit_key, commit_notices, tailing_key, redact_url, CommitRequest,
                   CommitResult, NodeMeta, ObjectMeta, StreamMeta, object_key)
from .hostfeed import names_any, segments
# The checks and loaders are shared with the SQLite store: both stores must decide alike. They take
# any connection-like object whose execute() takes qmark SQL; _Db adapts a psycopg connection.
from .sql import (KV_BATCH, SCHEMA_VERSION, SqlMetadataStore, _MARK_DESTROYED, _NODE_COLUMNS, _PREPARED, _RANGE_COLUMNS,
                  _Connection, _Cursor, _apply_commit, _check_prepare, _check_request_shape, _check_unchanged,
                  _closes_only, _ids, _load_objects, _node_meta, _node_row, _open_rows, _send_load_streams,
                  _send_node_check, _unknown_object, _unknown_stream)

log = logging.getLogger("s3stream.metadata")

_SCHEMA = (
    """CREATE TABLE kv (
        key TEXT COLLATE "C" PRIMARY KEY, value BYTEA NOT NULL)""",
    """CREATE TABLE nodes (
        node_id BIGINT PRIMARY KEY, node_epoch BIGINT NOT NULL, failover BOOLEAN NOT NULL,
        wal_path TEXT NOT NULL, heartbeat_ns BIGINT NOT NULL, health TEXT)""",
    """CREATE TABLE streams (
        stream_id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, epoch BIGINT NOT NULL,
        state TEXT NOT NULL, owner_node_id BIGINT,
        start_offset BIGINT NOT NULL, end_offset BIGINT NOT NULL, reserved_end BIGINT NOT NULL DEFAULT 0)""",
    """CREATE TABLE ranges (
        stream_id BIGINT NOT NULL REFERENCES streams (stream_id), range_index BIGINT NOT NULL,
        node_id BIGINT NOT NULL, epoch BIGINT NOT NULL,
        start_offset BIGINT NOT NULL, end_offset BIGINT NOT NULL, lost BOOLEAN NOT NULL DEFAULT FALSE,
        PRIMARY KEY (stream_id, range_index))""",
    # BY DEFAULT: prepare_objects draws ids from the sequence first, to insert each row with its key.
    """CREATE TABLE objects (
        object_id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, key TEXT NOT NULL,
        size BIGINT NOT NULL, type TEXT, state TEXT NOT NULL, node_id BIGINT, order_id BIGINT,
        prepared_ns BIGINT NOT NULL, expire_ns BIGINT NOT NULL,
        committed_ns BIGINT, mark_destroyed_ns BIGINT)""",
    # (state, object_id): the reclaimer's bounded scan reads each state's objects in id order and
    # stops at its limit (an index on state alone returns them in heap order: all must be sorted).
    "CREATE INDEX objects_by_state ON objects (state, object_id)",
    """CREATE INDEX objects_by_node_order ON objects (node_id, order_id)
        WHERE node_id IS NOT NULL""",
    """CREATE TABLE sso_ranges (
        object_id BIGINT NOT NULL REFERENCES objects (object_id),
        stream_id BIGINT NOT NULL REFERENCES streams (stream_id),
        start_offset BIGINT NOT NULL, end_offset BIGINT NOT NULL,
        PRIMARY KEY (object_id, stream_id, start_offset))""",
    "CREATE INDEX sso_ranges_by_stream ON sso_ranges (stream_id, end_offset)",
    """CREATE TABLE stream_objects (
        object_id BIGINT PRIMARY KEY REFERENCES objects (object_id),
        stream_id BIGINT NOT NULL REFERENCES streams (stream_id),
        start_offset BIGINT NOT NULL, end_offset BIGINT NOT NULL)""",
    """CREATE INDEX stream_objects_by_stream
        ON stream_objects (stream_id, end_offset, start_offset)""",
    """CREATE INDEX streams_by_owner ON streams (owner_node_id)
        WHERE owner_node_id IS NOT NULL""",
)

#: Version 1 -> 2: the node's health, the streams' reserved ends, lost ranges (issue 26).
_UPGRADE_1_TO_2 = (
    "ALTER TABLE nodes ADD COLUMN health TEXT",
    "ALTER TABLE streams ADD COLUMN reserved_end BIGINT NOT NULL DEFAULT 0",
    "ALTER TABLE ranges ADD COLUMN lost BOOLEAN NOT NULL DEFAULT FALSE",
)

#: pg_advisory_xact_lock key of schema creation: b"s3stream" as a big-endian int64.
_SCHEMA_LOCK_KEY = int.from_bytes(b"s3stream", "big") - (1 << 63)

_BEGIN_WRITE = "BEGIN ISOLATION LEVEL READ COMMITTED"
_BEGIN_READ = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"
#: The planner's cost of a random page read, for this store's transactions only (SET LOCAL).
#: PostgreSQL's default, 4, is for spinning disks: with it, a batch's statements (the ranges of
#: 1,000 streams among 20,000, the objects at 500 points) scan whole tables of tens of thousands
#: of rows rather than look the rows up by index (EXPLAIN ANALYZE on the database of a failover
#: of 10,000 partitions): 6.4-9.0 ms against 1.5-3.7 ms each, a run of 10 timed from the client.
#: Metadata is small and read hot; 1.1 is the usual value for SSDs and cached data.
_SET_PAGE_COST = "SET LOCAL random_page_cost = 1.1"

#: Seconds between the pool's attempts to replace a lost connection (with +-20% jitter).
RECONNECT_DELAY_S = 0.5

#: s3stream's own parameters in a postgresql:// URL's query string, taken out before libpq sees
#: the URL (libpq refuses parameters it does not know).
URL_PARAMETERS = ("pgbouncer", "prepare_threshold", "listen_url")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# Every live store, so that a forked child can replace their locks (a thread of the parent may
# have held one at the fork).
_STORES: "weakref.WeakSet[PostgresMetadataStore]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class PostgresMetadataStore(SqlMetadataStore):
    """The metadata of one cluster in the PostgreSQL database that `url` names
    (`postgresql://user:password@host:port/dbname?...`, or any libpq connection string); the
    schema is created if the database is empty.

    `clock` gives the time in nanoseconds (inject a fake one in tests). Each process keeps a
    pool of `pool_min` to `pool_max` connections, shared by its threads; an operation waits up
    to `pool_timeout_s` for a free one (also while the server is down: the default, 30 s like
    `lock_timeout_s`, lets an operation ride out a short outage; lower it to fail sooner).
    `connect_timeout_s` bounds each connection attempt; `lock_timeout_s` bounds how long an
    operation waits for a row another transaction holds (like SQLite's busy_timeout_s) before
    it raises MetadataBusyError.

    A postgresql:// URL's query may hold, besides libpq's own parameters, these of s3stream's
    (for a connection pooler in transaction mode, such as PgBouncer):

    - `pgbouncer=1`: the URL reaches the server through a pooler in transaction mode. Implies
      `prepare_threshold=none`, and `kv_changes` feeds poll (`pushes` False) unless `listen_url`
      is given: a LISTEN through the pooler would hold no session, and hear nothing.
    - `prepare_threshold=none` turns psycopg's server-side prepared statements off (through
      PgBouncer 1.18 in transaction mode they fail with DuplicatePreparedStatement, since clients
      share server sessions); `prepare_threshold=N` prepares a query after N runs on a
      connection (psycopg's default, 5, when the parameter is absent and pgbouncer is not 1;
      PgBouncer 1.21+ with max_prepared_statements can take them).
    - `listen_url=` a URL-encoded postgresql:// URL of the same database reached directly (not
      through the pooler): change feeds LISTEN there, so KV changes are pushed.

    For example (one line): `postgresql://s3stream@pgbouncer:6432/meta?pgbouncer=1&listen_url=
    postgresql%3A%2F%2Fs3stream%40db%3A5432%2Fmeta`. A malformed value is a ConfigError naming it;
    so is a parameter neither libpq nor s3stream knows. `pgbouncer` (attribute) says whether the
    URL had pgbouncer=1.
    """

    _arrays = True                   # lists bind as one array parameter (sql._in)

    def __init__(self, url: str, *, clock: Callable[[], int] = time.time_ns, pool_min: int = 1,
                 pool_max: int = 4, connect_timeout_s: float = 10.0, lock_timeout_s: float = 30.0,
                 pool_timeout_s: float = 30.0) -> None:
        url = os.fspath(url)
        self.url = url
        # libpq gets the URL without s3stream's parameters; messages show it with them, every
        # password hidden (the listen URL's too).
        self._conninfo, own = _split_url(url)
        shown = [f"{name}={redact_url(value) if name == 'listen_url' else value}" for name, value in own.items()]
        self.display_url = redact_url(self._conninfo) + (("&" if "?" in self._conninfo else "?") + "&".join(shown)
                                                         if shown else "")
        self.pgbouncer = _flag(own.get("pgbouncer", "0"), "pgbouncer", self.display_url)
        self._prepare: dict[str, int | None] = {}    # absent: psycopg's default
        if "prepare_threshold" in own:
            self._prepare["prepare_threshold"] = _prepare_threshold(own["prepare_threshold"], self.display_url)
        elif self.pgbouncer:
            self._prepare["prepare_threshold"] = None
        self._listen_conninfo: str | None = own.get("listen_url") or (None if self.pgbouncer else self._conninfo)
        self._check_conninfo(self._conninfo, "metadata URL")
        if "listen_url" in own:
            self._check_conninfo(own["listen_url"], "listen_url of metadata URL")
        if not 0 <= pool_min <= pool_max or pool_max < 1:
            raise ConfigError(f"pool sizes must satisfy 0 <= pool_min <= pool_max and pool_max >= 1, got "
                              f"pool_min={pool_min}, pool_max={pool_max}")
        for name, value in (("connect_timeout_s", connect_timeout_s), ("lock_timeout_s", lock_timeout_s),
                            ("pool_timeout_s", pool_timeout_s)):
            if value <= 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        self._clock = clock
        self._pool_min, self._pool_max = pool_min, pool_max
        # libpq takes whole seconds and treats 1 as 2: round up, at least 2.
        self._connect_timeout = max(2, int(-(-connect_timeout_s // 1)))
        self._lock_timeout_s = lock_timeout_s
        self._pool_timeout_s = pool_timeout_s
        # SET LOCAL, sent with BEGIN in one round trip: a session setting would not follow the
        # transactions through a pooler in transaction mode (and would leak into others' sessions).
        self._settings = (f"SET LOCAL lock_timeout = {max(1, int(lock_timeout_s * 1000))}", _SET_PAGE_COST)
        self._begin_read = "; ".join((_BEGIN_READ, *self._settings))
        self._lock = threading.Lock()
        self._closed = False
        self._init_schema()
        self._pid = os.getpid()
        self._pool = self._new_pool()
        self._abandoned: list[ConnectionPool] = []   # pools of a parent process, never closed here
        _STORES.add(self)

    # ---- connections and transactions ------------------------------------------------------

    def _check_conninfo(self, conninfo: str, what: str) -> None:
        try:
            psycopg.conninfo.conninfo_to_dict(conninfo)
        except psycopg.Error as e:
            raise ConfigError(
                f"{what} {self.display_url} is not a valid PostgreSQL URL: {self._scrub(e)}; besides "
                f"libpq's parameters a metadata URL takes {', '.join(URL_PARAMETERS)} (listen_url URL-encoded, "
                f"e.g. urllib.parse.quote(url, safe=''))") from None

    def _connect_kwargs(self) -> dict[str, Any]:
        # client_encoding is one of the few startup parameters PgBouncer passes on; anything
        # else (options=-c ...) it refuses, or ignores if told to: settings are SET LOCAL instead.
        return dict(autocommit=True, connect_timeout=self._connect_timeout, client_encoding="UTF8", **self._prepare)

    def _init_schema(self) -> None:
        try:
            conn = psycopg.connect(self._conninfo, **self._connect_kwargs())
        except psycopg.Error as e:
            raise ConfigError(
                f"cannot connect to metadata database {self.display_url}: {self._scrub(e)}; check that the "
                f"PostgreSQL server is running and reachable at that host and port, that the database "
                f"exists, and the user name and password") from None
        try:
            with conn:
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_KEY,))
                    version = None
                    if _one(conn.execute("SELECT to_regclass('schema_info') IS NOT NULL"))[0]:
                        row = conn.execute(
                            "SELECT value FROM schema_info WHERE name = 'schema_version'").fetchone()
                        version = None if row is None else row[0]
                    if version is None:
                        foreign = _one(conn.execute(
                            "SELECT count(*) FROM pg_catalog.pg_tables WHERE schemaname = current_schema() "
                            "AND tablename <> 'schema_info'"))[0]
                        if foreign:
                            raise ConfigError(
                                f"metadata database {self.display_url} is a database of something else (it "
                                f"has {foreign} tables but no s3stream schema version); create an empty "
                                f"database for s3stream (CREATE DATABASE s3stream) and put its name in the URL")
                        conn.execute("CREATE TABLE IF NOT EXISTS schema_info "
                                     "(name TEXT PRIMARY KEY, value BIGINT NOT NULL)")
                        for statement in _SCHEMA:
                            conn.execute(statement)
                        conn.execute("INSERT INTO schema_info VALUES ('schema_version', %s)", (SCHEMA_VERSION,))
                    elif version == 1:
                        for statement in _UPGRADE_1_TO_2:
                            conn.execute(statement)
                        conn.execute("UPDATE schema_info SET value = 2 WHERE name = 'schema_version'")
                    elif version != SCHEMA_VERSION:
                        raise ConfigError(
                            f"metadata database {self.display_url} has schema version {version}, this "
                            f"s3stream reads version {SCHEMA_VERSION}; use a matching s3stream release")
        except psycopg.Error as e:
            raise ConfigError(f"cannot set up the s3stream schema in metadata database {self.display_url}: "
                              f"{self._scrub(e)}; check that the user may create tables there") from None

    def _new_pool(self) -> ConnectionPool:
        pool = _ReconnectingPool(self._conninfo, min_size=self._pool_min, max_size=self._pool_max,
                                 kwargs=self._connect_kwargs(), open=False, timeout=self._pool_timeout_s,
                                 name=f"s3stream-metadata-{os.getpid()}")
        pool.open(wait=False)
        return pool

    def _pool_here(self) -> ConnectionPool:
        """This process's pool: a forked child opens its own on first use."""
        with self._lock:
            if self._closed:
                raise MetadataError(f"metadata store {self.display_url} is closed")
            if self._pid != os.getpid():
                # The parent's pool and its sockets stay as they are: closing them here would end
                # the parent's sessions. Keep a reference so that nothing is collected either.
                self._abandoned.append(self._pool)
                self._pool, self._pid = self._new_pool(), os.getpid()
            return self._pool

    def _getconn(self, pool: ConnectionPool) -> psycopg.Connection:
        try:
            return pool.getconn()
        except psycopg.OperationalError as e:   # PoolTimeout, or PoolClosed by a concurrent close()
            raise MetadataBusyError(
                f"metadata database {self.display_url}: no connection within pool_timeout_s "
                f"({self._pool_timeout_s:g} s; {self._pool_max} connections, all busy or the server "
                f"unreachable): {self._scrub(e)}") from e

    def _begin(self, pool: ConnectionPool, begin: str) -> psycopg.Connection:
        """A connection from the pool with a transaction begun; a connection the server closed
        while it was idle is given back (the pool discards it) and another one tried."""
        attempt = 0
        while True:
            conn = self._getconn(pool)
            try:
                # Never prepared (a prepared statement holds one command): simple protocol, one round trip.
                conn.execute(begin, prepare=False)
                return conn
            except psycopg.Error as e:
                pool.putconn(conn)
                if not conn.closed or attempt >= self._pool_max:
                    raise self._busy(e, "beginning a transaction") from e
            attempt += 1

    def _live_conn(self, pool: ConnectionPool) -> psycopg.Connection:
        """A pooled connection that the server has not ended while it was idle (such a socket
        has the server's last message to read): those are discarded before anything is sent on
        them, so that a write never needs sending again."""
        for _ in range(self._pool_max + 1):
            conn = self._getconn(pool)
            if not select.select([conn.fileno()], [], [], 0)[0]:
                return conn
            conn.close()
            pool.putconn(conn)
        raise MetadataBusyError(f"metadata database {self.display_url}: every pooled connection was found "
                                "closed by the server; the pool is reconnecting")

    @contextlib.contextmanager
    def _transaction(self, write: bool) -> Iterator["_Db"]:
        """One transaction on a pooled connection: commits if the body returns, rolls back if it
        raises; transient PostgreSQL errors become MetadataBusyError, others MetadataError."""
        pool = self._pool_here()
        if write:
            conn = self._live_conn(pool)
        else:
            conn = self._begin(pool, self._begin_read)
        committing = False
        try:
            # A write runs in pipeline mode: BEGIN, and statements whose results nobody reads
            # (locks, updates, inserts), travel with the next one that is read, and with COMMIT.
            # Each round trip costs this process a GIL hand-over when it comes back, which under
            # load (producer threads) is what made PostgreSQL operations slow, not the server.
            with conn.pipeline() if write else contextlib.nullcontext():
                if write:
                    conn.execute(_BEGIN_WRITE, prepare=False)
                    for setting in self._settings:       # one statement each: a pipeline's are prepared
                        conn.execute(setting, prepare=False)
                yield _Db(conn)
                committing = True
                conn.execute("COMMIT")
        except BaseException as e:
            if not conn.closed:
                with contextlib.suppress(psycopg.Error):
                    conn.execute("ROLLBACK")
            if isinstance(e, psycopg.OperationalError):
                raise self._busy(e, "committing" if committing and write else "in a transaction") from e
            if isinstance(e, psycopg.Error):
                raise MetadataError(f"metadata database {self.display_url}: {self._scrub(e)}") from e
            raise
        finally:
            pool.putconn(conn)   # a closed connection is discarded and replaced by the pool

    def _read_rows(self, sql: str, params: Sequence = ()) -> list[tuple]:
        """The rows of one read-only statement, sent alone on an autocommit connection: its own
        transaction and snapshot, as BEGIN; SELECT; COMMIT would give it, in one round trip
        instead of three (under load each costs this process a wake-up and a GIL hand-over). A
        connection the server closed while it was idle is given back and another one tried (a
        read is safe to repeat)."""
        pool = self._pool_here()
        attempt = 0
        while True:
            conn = self._getconn(pool)
            try:
                return _Db(conn).execute(sql, params).fetchall()
            except psycopg.OperationalError as e:
                if not conn.closed or attempt >= self._pool_max:
                    raise self._busy(e, "reading") from e
            except psycopg.Error as e:
                raise MetadataError(f"metadata database {self.display_url}: {self._scrub(e)}") from e
            finally:
                pool.putconn(conn)
            attempt += 1

    def _write_alone(self, statements: Sequence[tuple[str, Sequence]]) -> list[tuple]:
        """Run `statements` (SQL with ? placeholders, and their parameters) as ONE transaction in
        ONE round trip, and return the rows of the last: they go as one simple query (bound by
        the client), whose statements PostgreSQL runs as an implicit transaction, after the SET LOCAL
        settings, committing at the end (NOTIFYs delivered then) or rolling all back on an
        error. A transaction of them would cost this process two or more wake-ups under load.
        Each statement reads what committed before it (READ COMMITTED). A connection lost once
        the query went out is MetadataBusyError with the outcome unknown."""
        sql = "; ".join([*self._settings, *(_Db._sql(s) for s, _ in statements)])
        params = [v for _, ps in statements for v in ps]
        pool = self._pool_here()
        conn = self._live_conn(pool)
        try:
            with psycopg.ClientCursor(conn) as cursor:
                cursor.execute(sql, params)
                while cursor.nextset():
                    pass
                return cursor.fetchall() if cursor.description is not None else []
        except psycopg.OperationalError as e:
            raise self._busy(e, "committing") from e
        except psycopg.Error as e:
            raise MetadataError(f"metadata database {self.display_url}: {self._scrub(e)}") from e
        finally:
            pool.putconn(conn)

    def _lock_node(self, db: _Connection, node_id: int, mode: str) -> None:
        db.execute(f"SELECT 1 FROM nodes WHERE node_id = ? FOR {mode}", (node_id,))

    def _lock_rows(self, db: _Connection, table: str, key: str, ids: Sequence[int]) -> None:
        """FOR UPDATE, in ascending id order: the fixed order (nodes, then streams, then
        objects) that rules out deadlocks."""
        ids = sorted(set(ids))
        if ids:
            db.execute(f"SELECT 1 FROM {table} WHERE {key} = ANY(?) ORDER BY {key} FOR UPDATE", (ids,))

    def _busy(self, e: psycopg.Error, when: str) -> MetadataBusyError:
        sqlstate = getattr(e, "sqlstate", None)
        if sqlstate == "55P03":
            cause = (f"a row stayed locked by another transaction past lock_timeout_s "
                     f"({self._lock_timeout_s:g} s)")
        elif sqlstate in ("40001", "40P01"):
            cause = "a serialization failure or deadlock with another transaction"
        elif sqlstate == "57014":
            cause = "the statement was cancelled (statement_timeout or a cancel request)"
        else:
            cause = "the connection failed or the server is shutting down"
        outcome = "; the commit's outcome is unknown (a retried commit is recognised)" if when == "committing" else ""
        return MetadataBusyError(f"metadata database {self.display_url} {when}: {cause}: {self._scrub(e)}{outcome}")

    def _scrub(self, e: BaseException) -> str:
        """The error's text without the URLs' passwords, should libpq ever quote them."""
        text = str(e).strip()
        for conninfo in (self._conninfo, self._listen_conninfo):
            password = _password(conninfo) if conninfo else None
            if password:
                text = text.replace(password, "***")
        return text

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool = self._pool if self._pid == os.getpid() else None
        if pool is not None:
            pool.close()

    # ---- nodes -----------------------------------------------------------------------------

    def register_node(self, node_id: int, wal_path: str) -> NodeMeta:
        with self._transaction(write=True) as db:
            # The upsert's own row lock would be FOR NO KEY UPDATE, which a KEY SHARE holder
            # (an open of the old incarnation) does not stop: the epoch changes, so FOR UPDATE.
            self._lock_node(db, node_id, "UPDATE")
            row = _one(db.execute(
                f"INSERT INTO nodes (node_id, node_epoch, failover, wal_path, heartbeat_ns) VALUES (?, 0, FALSE, ?, ?) "
                f"ON CONFLICT (node_id) DO UPDATE SET "
                f"node_epoch = nodes.node_epoch + 1, failover = FALSE, wal_path = EXCLUDED.wal_path, "
                f"heartbeat_ns = EXCLUDED.heartbeat_ns, health = NULL RETURNING {_NODE_COLUMNS}",
                (node_id, wal_path, self._clock())))
            return _node_meta(row)

    def fence_node(self, node_id: int, failover: bool = True,
                   if_unchanged: tuple[int, int] | None = None) -> NodeMeta:
        with self._transaction(write=True) as db:
            self._lock_node(db, node_id, "UPDATE")      # the epoch changes: see the module docstring
            _check_unchanged(_node_meta(_node_row(db, node_id)), if_unchanged)
            return _node_meta(_one(db.execute(
                f"UPDATE nodes SET node_epoch = node_epoch + 1, failover = ? WHERE node_id = ? "
                f"RETURNING {_NODE_COLUMNS}", (bool(failover), node_id))))

    # ---- streams ---------------------------------------------------------------------------

    def open_streams(self, stream_ids: Sequence[int], node_id: int, node_epoch: int,
                     reserve: int = 0) -> list[StreamMeta]:
        with self._transaction(write=True) as db:
            # Locks as they are read (node, then streams), none sent only to lock. The node's row
            # and the streams' are read in one round trip, the writes travel with COMMIT.
            check = _send_node_check(db, node_id, node_epoch, lock=" FOR KEY SHARE")
            return _open_rows(db, stream_ids, node_id, reserve,
                              f"INSERT INTO ranges ({_RANGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?) "
                              "ON CONFLICT (stream_id, range_index) "
                              "DO UPDATE SET node_id = EXCLUDED.node_id, epoch = EXCLUDED.epoch, "
                              "start_offset = EXCLUDED.start_offset, end_offset = EXCLUDED.end_offset",
                              lock=" FOR UPDATE", check=check, write=_write_open_rows)

    # ---- objects ---------------------------------------------------------------------------

    def prepare_objects(self, count: int, ttl_ns: int) -> list[int]:
        _check_prepare(count, ttl_ns)
        with self._transaction(write=True) as db:
            now = self._clock()
            # The key derives from the id: take the ids from the sequence first.
            ids = sorted(_ids(db.execute(
                "SELECT nextval(pg_get_serial_sequence('objects', 'object_id')) FROM generate_series(1, ?)",
                (count,))))
            db.executemany("INSERT INTO objects (object_id, key, size, state, prepared_ns, expire_ns) "
                           "VALUES (?, ?, 0, ?, ?, ?)",
                           [(object_id, object_key(object_id), _PREPARED, now, now + ttl_ns) for object_id in ids])
            return ids

    def commit(self, request: CommitRequest) -> CommitResult:
        with self._transaction(write=True) as db:
            now = self._clock()
            # Rows are locked by the statements that read them (node, streams, objects: the lock
            # order), all sent before any result is read: one round trip (a compaction's adds one).
            object_ids = request.object_ids()
            _check_request_shape(request, object_ids)
            if request.kv_guard is not None:
                # The guard's check takes the key's row FOR UPDATE, which locks nothing while
                # the key is absent: two commits guarded by one absent key (and touching
                # different streams) would both pass. Every guarded commit takes the key's
                # advisory lock first, so they check one after the other.
                db.execute("SELECT pg_advisory_xact_lock(hashtextextended(?, 0))", (request.kv_guard[0],))
            check = _send_node_check(db, request.node_id, request.node_epoch, lock=" FOR NO KEY UPDATE")
            ranges = request.all_ranges()
            request_streams = {r.stream_id for r in ranges} | {sid for sid, _ in request.closes}
            stream_ids = set(request_streams)
            if request.compacted_ids:
                # A compaction checks the streams of the objects it replaces too. Those rows are
                # written once, by the commit that committed the object.
                compacted = list(request.compacted_ids)
                stream_ids.update(_ids(db.execute(
                    "SELECT stream_id FROM sso_ranges WHERE object_id = ANY(?) "
                    "UNION SELECT stream_id FROM stream_objects WHERE object_id = ANY(?)", (compacted, compacted))))
            # One statement each for every object and every stream of the request (a round trip
            # per row made a commit of 4 streams 24 statements), sent before any result is read.
            load = _send_load_streams(db, "WHERE stream_id = ANY(?)", (sorted(stream_ids),), lock=" FOR UPDATE",
                                      last_range=True, no_ranges=_closes_only(request))
            object_rows = db.execute("SELECT object_id, state, expire_ns FROM objects WHERE object_id = ANY(?) "
                                     "ORDER BY object_id FOR UPDATE",
                                     (sorted(set(object_ids) | set(request.compacted_ids)),)).fetchall()
            check()
            locked = load()
            named = set(object_ids)
            rows = {object_id: (state, expire_ns) for object_id, state, expire_ns in object_rows
                    if object_id in named}
            # From here on, the SQLite store's commit, statement for statement (_apply_commit).
            for object_id in object_ids:
                if object_id not in rows:
                    raise _unknown_object(object_id)
            wanted = sorted(request_streams)
            streams = {m.stream_id: m for m in locked if m.stream_id in request_streams}
            for stream_id in wanted:
                if stream_id not in streams:
                    raise _unknown_stream(stream_id)
            result = _apply_commit(db, request, now, rows, streams, _set_stream_ends, _insert_refs, lock=" FOR UPDATE")
            if request.kv:
                db.executemany(_PUT_KV, [(k, bytes(v)) for k, v in request.kv])
            _notify(db, commit_notices(request))       # tailing readers, waiters on request.kv
            return result

    def objects_to_delete(self, destroy_delay_ns: int, limit: int | None = None) -> list[ObjectMeta]:
        with self._transaction(write=False) as db:
            now = self._clock()
            # Two ordered scans of (state, object_id), each stopping at the limit, merged and cut
            # again (LIMIT NULL: none): the cost follows the limit, not the objects waiting. The
            # ids come first, so the objects and their ranges load by primary key.
            ids = _ids(db.execute(
                "SELECT object_id FROM ("
                "(SELECT object_id FROM objects WHERE state = ? AND expire_ns <= ? ORDER BY object_id LIMIT ?) "
                "UNION ALL (SELECT object_id FROM objects WHERE state = ? AND mark_destroyed_ns <= ? "
                "ORDER BY object_id LIMIT ?)) AS due ORDER BY 1 LIMIT ?",
                (_PREPARED, now, limit, _MARK_DESTROYED, now - destroy_delay_ns, limit, limit)))
            return _load_objects(db, "o.object_id = ANY(?)", (sorted(ids),)) if ids else []

    # ---- KV --------------------------------------------------------------------------------

    # Every KV write notifies KV_CHANNEL with the key, in its own transaction: PostgreSQL delivers
    # the notification to the listeners (kv_changes) when, and only if, the write commits.

    # Each is one statement that notifies only if it wrote (a data-modifying WITH), sent alone
    # (_write_alone): one round trip.

    def put_kv(self, key: str, value: bytes) -> None:
        self._write_alone([(_NOTIFYING.format(f"{_PUT_KV} RETURNING key"), (key, bytes(value), KV_CHANNEL))])

    def put_kvs(self, items: Sequence[tuple[str, bytes]]) -> None:
        # One upsert of two arrays per KV_BATCH keys, all in one transaction, a pipeline: one
        # round trip, the arrays bound in binary. Sent alone (_write_alone: a simple query) they
        # were bound as text by this process: 500 records of 200 bytes took 4.1 ms of its CPU and
        # 9.2 ms in all, against 0.7 and 3.7 ms (a failover of 10,000 partitions publishes
        # 20 such batches of opened/ records).
        unique = list(dict(items).items())           # a key twice: its last value, as put_kv in turn would
        if not unique:
            return
        upsert = ("INSERT INTO kv SELECT * FROM unnest(?::text[], ?::bytea[]) "
                  "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value")
        with self._transaction(write=True) as db:
            for i in range(0, len(unique), KV_BATCH):
                chunk = unique[i:i + KV_BATCH]
                db.execute(upsert, ([k for k, _ in chunk], [bytes(v) for _, v in chunk]))
            _notify(db, [k for k, _ in unique])

    def put_kv_if_absent(self, key: str, value: bytes) -> bytes:
        # A concurrent insert of the key makes this wait for it, then do nothing; the SELECT,
        # a statement of its own, sees the winner's row.
        rows = self._write_alone([
            (_NOTIFYING.format("INSERT INTO kv VALUES (?, ?) ON CONFLICT (key) DO NOTHING RETURNING key"),
             (key, bytes(value), KV_CHANNEL)),
            ("SELECT value FROM kv WHERE key = ?", (key,))])
        if not rows:
            raise MetadataError("the metadata database returned no row where one was expected")
        return bytes(rows[0][0])

    def replace_kv(self, key: str, expected: bytes | None, value: bytes,
                   guard: tuple[str, bytes] | None = None) -> bool:
        # The guard's row is locked first (every guarded write takes that order: guard, then
        # key) and kept until commit, so it cannot change before the write. The key's row is
        # compared by the write itself: an UPDATE that waited for a concurrent writer checks
        # its WHERE again on the row that writer left, and an insert racing a concurrent
        # creator does nothing.
        statements: list[tuple[str, Sequence]] = []
        holds_params: tuple
        holds, holds_params = "TRUE", ()
        if guard is not None:
            statements.append(("SELECT 1 FROM kv WHERE key = ? FOR UPDATE", (guard[0],)))
            holds, holds_params = "EXISTS (SELECT 1 FROM kv WHERE key = ? AND value = ?)", (guard[0], bytes(guard[1]))
        if expected is None:
            write = f"INSERT INTO kv SELECT ?, ? WHERE {holds} ON CONFLICT (key) DO NOTHING RETURNING key"
            params: tuple = (key, bytes(value), *holds_params)
        else:
            write = f"UPDATE kv SET value = ? WHERE key = ? AND value = ? AND {holds} RETURNING key"
            params = (bytes(value), key, bytes(expected), *holds_params)
        statements.append((_NOTIFYING.format(write), (*params, KV_CHANNEL)))
        return bool(self._write_alone(statements))

    def replace_kvs(self, items: Sequence[tuple[str, bytes | None, bytes]]) -> list[bool]:
        # One transaction; each write compares its row itself, as replace_kv's does. Keys given
        # once (the usual case: a failover reassigning 1,000 partitions) take two set-based
        # statements, an insert of the absent ones and an update of the rest, not a round trip each.
        done = []
        with self._transaction(write=True) as db:
            if len({key for key, _, _ in items}) == len(items):
                new = [(key, bytes(value)) for key, expected, value in items if expected is None]
                old = [(key, bytes(expected), bytes(value)) for key, expected, value in items if expected is not None]
                written: set[str] = set()
                if new:
                    written.update(row[0] for row in db.execute(
                        "INSERT INTO kv SELECT * FROM unnest(?::text[], ?::bytea[]) ON CONFLICT (key) DO NOTHING "
                        "RETURNING key", [list(column) for column in zip(*new)]).fetchall())
                if old:
                    written.update(row[0] for row in db.execute(
                        "WITH v (key, expected, value) AS (SELECT * FROM unnest(?::text[], ?::bytea[], ?::bytea[])) "
                        "UPDATE kv SET value = v.value FROM v WHERE kv.key = v.key AND kv.value = v.expected "
                        "RETURNING kv.key", [list(column) for column in zip(*old)]).fetchall())
                done = [key in written for key, _, _ in items]
            else:
                for key, expected, value in items:          # in turn: a later one sees an earlier one's write
                    if expected is None:
                        row = db.execute("INSERT INTO kv VALUES (?, ?) ON CONFLICT (key) DO NOTHING RETURNING key",
                                         (key, bytes(value))).fetchone()
                    else:
                        row = db.execute("UPDATE kv SET value = ? WHERE key = ? AND value = ? RETURNING key",
                                         (bytes(value), key, bytes(expected))).fetchone()
                    done.append(row is not None)
            _notify(db, [key for (key, _, _), ok in zip(items, done) if ok])
        return done

    def delete_kv(self, key: str) -> None:
        self._write_alone([(_NOTIFYING.format("DELETE FROM kv WHERE key = ? RETURNING key"), (key, KV_CHANNEL))])

    def kv_changes(self, prefixes: Sequence[str]) -> ChangeFeed:
        """Pushed KV changes: LISTEN on a connection of the feed's own (see PgChangeFeed), to
        `listen_url` if given. Through a transaction-mode pooler without one (`pgbouncer=1`), a
        feed that does not push: callers poll."""
        if self._listen_conninfo is None:
            return ChangeFeed(prefixes)
        return PgChangeFeed(self, prefixes)

# ---- pushed changes ------------------------------------------------------------------------------

#: The channel every KV write notifies, with the key as its payload (keys are short; PostgreSQL
#: takes payloads of up to 8,000 bytes).
KV_CHANNEL = "s3stream_kv"


def _set_stream_ends(db: "_Db", ends: list[tuple[int, int, int]]) -> None:
    """Every stream's end and its last range's end, in one statement (a data-modifying WITH
    runs whether or not it is referenced)."""
    ids, new_ends, indexes = (list(column) for column in zip(*ends))
    db.execute("WITH e AS (SELECT * FROM unnest(?::bigint[], ?::bigint[], ?::bigint[]) "
               "AS e (stream_id, end_offset, range_index)), "
               "s AS (UPDATE streams SET end_offset = e.end_offset FROM e WHERE streams.stream_id = e.stream_id) "
               "UPDATE ranges SET end_offset = e.end_offset FROM e WHERE ranges.stream_id = e.stream_id "
               "AND ranges.range_index = e.range_index", (ids, new_ends, indexes))


def _insert_refs(db: _Connection, table: str, rows: list) -> None:
    """A commit's sso_ranges or stream_objects rows in one statement: a statement each took
    0.19 s of PostgreSQL's time for a StreamSetObject of 10,000 streams (a failover's opens
    append a checkpoint to each of them), and more of the node's, to send."""
    if rows:
        db.execute(f"INSERT INTO {table} SELECT * FROM unnest(?::bigint[], ?::bigint[], ?::bigint[], ?::bigint[])",
                   [list(column) for column in zip(*rows)])


def _write_open_rows(db: _Connection, range_rows: list, stream_rows: list) -> None:
    """open_streams' new ranges and stream rows, a statement each for all of them (a batch of
    partition opens writes 600 of each: a statement per row took 0.15 s a batch)."""
    if not range_rows:
        return
    db.execute(f"INSERT INTO ranges ({_RANGE_COLUMNS}) SELECT * FROM unnest(?::bigint[], ?::bigint[], ?::bigint[], "
               "?::bigint[], ?::bigint[], ?::bigint[]) ON CONFLICT (stream_id, range_index) "
               "DO UPDATE SET node_id = EXCLUDED.node_id, epoch = EXCLUDED.epoch, "
               "start_offset = EXCLUDED.start_offset, end_offset = EXCLUDED.end_offset",
               [list(column) for column in zip(*range_rows)])
    db.execute("UPDATE streams SET epoch = u.epoch, state = u.state, owner_node_id = u.owner, "
               "reserved_end = u.reserved FROM unnest(?::bigint[], ?::text[], ?::bigint[], ?::bigint[], "
               "?::bigint[]) AS u (epoch, state, owner, reserved, stream_id) WHERE streams.stream_id = u.stream_id",
               [list(column) for column in zip(*stream_rows)])


_PUT_KV = "INSERT INTO kv VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value"

#: A KV write ({} RETURNING key) that notifies KV_CHANNEL (its last parameter) of each key it wrote.
_NOTIFYING = "WITH w AS ({}) SELECT pg_notify(?, key) FROM w"


#: Keys a write names one by one in its notices, at most; a write of more (a batch of 500 opened/
#: records, a failover's 10,000 reassignments) sends one notice per first path segment instead
#: ("\x01opened/": every key under it, hostfeed.segments), as the SQLite store's datagrams do.
#: Each notice reaches every listening session, and each session's process parses it (psycopg,
#: ~5 us): a failover of 10,000 partitions sent 20,000 to each.
NOTICES_PER_WRITE = 16


def _notify(db: "_Db", keys: str | Sequence[str]) -> None:
    """NOTIFY the change feeds of `keys`, in one statement (delivered at COMMIT): each key, or
    past NOTICES_PER_WRITE, the segments of those that are not commit keys. A stream's commit
    key only while a reader registered its interest (tailing_key: a KV key under
    TAILING_PREFIX + the stream id + "/"; "0" follows "/" in code point order)."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    if len(keys) > NOTICES_PER_WRITE:
        commits = [key for key in keys if key.startswith(_COMMIT_PREFIX)]
        keys = commits + segments(key for key in keys if not key.startswith(_COMMIT_PREFIX))
    if keys:
        db.execute(_NOTIFY_WANTED, (KV_CHANNEL, keys))


_COMMIT_PREFIX = commit_key(0)[:-1]
_NOTIFY_WANTED = (
    "SELECT pg_notify(?, n.key) FROM unnest(?::text[]) AS n (key) "
    f"WHERE left(n.key, {len(_COMMIT_PREFIX)}) <> '{_COMMIT_PREFIX}' OR EXISTS (SELECT 1 FROM kv "
    f"WHERE kv.key >= '{TAILING_PREFIX}' || substr(n.key, {len(_COMMIT_PREFIX) + 1}) || '/' "
    f"AND kv.key < '{TAILING_PREFIX}' || substr(n.key, {len(_COMMIT_PREFIX) + 1}) || '0')")


#: How long a change feed's wait takes the notices already received, at most, before it returns
#: (psycopg makes a Notify of each, some 5 us: a burst of 20,000 takes about 0.1 s).
DRAIN_SECONDS = 0.5


class PgChangeFeed(ChangeFeed):
    """KV changes pushed by PostgreSQL: a connection of its own (not from the pool: it holds a
    LISTEN for its whole life; to the store's `listen_url` if it has one) receives the
    notification of every committed KV write, and `wait` returns True as soon as one names a key
    under the feed's prefixes.

    Notifications that arrive while nobody waits are queued by libpq and seen by the next
    `wait`. If the connection is lost, `wait` reconnects, LISTENs again and returns True: what
    changed meanwhile was not seen, so the caller must look again (it re-reads state after every
    wake-up anyway). `wake` from another thread (an agent's task that ended, an agent stopping)
    writes to a socket pair that `wait` selects on beside the connection, so it returns at once
    (it used to take notifications in 50 ms slices and see a wake only at a slice's end: a
    target's retry after its early open attempt waited up to that long).

    A feed on a stream's `commit_key` (a tailing reader) registers its interest while it is
    open (`tailing_key`, deleted by close): commits notify only the streams that have one
    (_notify). A feed of a process that died leaves its key, which only costs the stream's
    commits their notices."""

    pushes = True

    def __init__(self, store: PostgresMetadataStore, prefixes: Sequence[str]) -> None:
        super().__init__(prefixes)
        self._encoded = tuple(p.encode() for p in self.prefixes)
        self._store = store
        self._conn: psycopg.Connection | None = None
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        try:
            self._connect()
        except BaseException:
            self._wake_r.close()
            self._wake_w.close()
            raise
        token = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._interests = [tailing_key(int(p[len(_COMMIT_PREFIX):]), token) for p in prefixes
                           if p.startswith(_COMMIT_PREFIX) and p[len(_COMMIT_PREFIX):].isdigit()]
        try:
            for key in self._interests:
                store.put_kv(key, b"")
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        conninfo = self._store._listen_conninfo
        assert conninfo is not None      # kv_changes hands out polling feeds without one
        try:
            conn = psycopg.connect(conninfo, **self._store._connect_kwargs())
        except psycopg.Error as e:
            raise self._store._busy(e, "opening a change feed") from e
        try:
            conn.execute(f"LISTEN {KV_CHANNEL}")
        except psycopg.Error as e:
            conn.close()
            raise self._store._busy(e, "opening a change feed") from e
        self._conn = conn

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._closed:
            if self._woken.is_set():
                self._woken.clear()
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                if self._conn is None:
                    self._connect()
                    return True             # changes while disconnected went unseen: look again
                conn = self._conn
                wake_fd = self._wake_r.fileno()
                ready, _, _ = select.select([conn.fileno(), wake_fd], [], [], left)
                if wake_fd in ready:
                    self._drain_wakes()
                    continue                # _woken is set: returns True above
                if ready and self._take_notices(conn):
                    return True
            except (OSError, ValueError):
                return True                 # closed under us (close from another thread)
            except (psycopg.Error, MetadataBusyError):
                self._drop()
                time.sleep(min(max(left, 0.0), 0.1))
        return True

    def _take_notices(self, conn: psycopg.Connection) -> bool:
        """Every notice received by now, whether one names a key under the prefixes. One poll
        takes what one read of the socket holds: a burst of writes (a failover's 10,000
        reassignments and opened/ records, 20,000 notices) is many, and a wait that took one
        and returned had its caller run a pass per read (27 passes of every assignment per
        agent in `s3stream bench --kind notify`). Taken for at most DRAIN_SECONDS at a time."""
        hit = False
        limit = time.monotonic() + DRAIN_SECONDS
        while True:
            notes = list(conn.notifies(timeout=0))
            hit = hit or any(names_any(note.payload.encode(), self._encoded) for note in notes)
            if not notes or time.monotonic() > limit:
                return hit

    def _drain_wakes(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass

    def wake(self) -> None:
        super().wake()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"w")

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def close(self) -> None:
        self._closed = True
        super().close()
        self._drop()
        self._wake_r.close()
        self._wake_w.close()
        interests, self._interests = self._interests, []
        for key in interests:
            try:
                self._store.delete_kv(key)
            except MetadataError as e:   # left behind, it costs the stream's commits their notices
                log.warning("change feed: could not remove its interest %s: %s", key, e)


# ---- helpers -------------------------------------------------------------------------------------

#: The array parameters _Db sends in binary format.
_ARRAY_CASTS = ("::bigint[]", "::text[]", "::bytea[]")


class _Db:
    """A psycopg connection seen through the sqlite3.Connection calls the shared helpers make:
    qmark placeholders, and execute() returning a cursor of its own (so a helper may iterate one
    result while it runs another statement)."""

    __slots__ = ("_conn",)
    #: Lists bind as one array parameter (sql._in).
    arrays = True

    def __init__(self, conn: psycopg.Connection) -> None:
        self._conn = conn

    @staticmethod
    def _sql(sql: str) -> str:
        # The store's SQL has no string literal holding '?' or '%'. Arrays (?::bigint[] and
        # the like: a batch's keys, ids and values) travel in binary: psycopg's text format
        # quotes each text element through a regular expression, in Python (20,000 of them
        # in the failover of a node of 10,000 partitions, before its opens).
        sql = sql.replace("%", "%%")
        for cast in _ARRAY_CASTS:
            sql = sql.replace(f"?{cast}", f"%b{cast}")
        return sql.replace("?", "%s")

    def execute(self, sql: str, params: Sequence = ()) -> psycopg.Cursor:
        return self._conn.execute(self._sql(sql), tuple(params))

    def executemany(self, sql: str, params_seq: Sequence[Sequence]) -> None:
        params_seq = list(params_seq)
        if params_seq:
            with self._conn.cursor() as cursor:
                cursor.executemany(self._sql(sql), params_seq)


def _one(cursor: _Cursor) -> tuple[Any, ...]:
    """The row of a statement that returns exactly one: an aggregate, or INSERT/UPDATE ...
    RETURNING of a row the transaction knows exists."""
    row = cursor.fetchone()
    if row is None:
        raise MetadataError("the metadata database returned no row where one was expected")
    return row


def _split_url(url: str) -> tuple[str, dict[str, str]]:
    """`url` without s3stream's own query parameters (URL_PARAMETERS), and their decoded values.
    libpq's parameters are kept as they were written; a key=value connection string has none of
    s3stream's (libpq reports them as unknown)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("postgresql", "postgres"):
        return url, {}
    base, _, query = rest.partition("?")
    kept, own = [], {}
    for piece in query.split("&") if query else ():
        name, _, value = piece.partition("=")
        name = unquote(name)
        if name not in URL_PARAMETERS:
            kept.append(piece)
        elif name in own:
            raise ConfigError(f"metadata URL {redact_url(f'{scheme}://{base}')}?... gives {name} twice; "
                              f"give it once")
        else:
            own[name] = unquote(value)
    return f"{scheme}://{base}" + ("?" + "&".join(kept) if kept else ""), own


def _flag(value: str, name: str, display_url: str) -> bool:
    if value.lower() not in _TRUE + _FALSE:
        raise ConfigError(f"{name}={value!r} in metadata URL {display_url} must be 1 or 0 "
                          f"(1: the URL goes through PgBouncer or another pooler in transaction mode)")
    return value.lower() in _TRUE


def _prepare_threshold(value: str, display_url: str) -> int | None:
    if value.lower() == "none":
        return None
    if value.isdigit():
        return int(value)
    raise ConfigError(
        f"prepare_threshold={value!r} in metadata URL {display_url} must be none (no server-side prepared "
        f"statements: use it through PgBouncer in transaction mode) or a whole number N >= 0 (prepare a query "
        f"after N runs on a connection; psycopg's default is 5)")


class _ReconnectingPool(ConnectionPool):
    """A ConnectionPool that replaces a lost connection every RECONNECT_DELAY_S until
    reconnect_timeout, instead of after 1, 2, 4, 8 ... s.

    This leans on two names psycopg_pool does not document (checked against 3.3.3; see its
    pool.py): `_add_connection(attempt, growing)`, which a maintenance task calls with attempt None
    for a new connection and again with the same attempt object for each retry, and the class
    constants of `psycopg_pool.base.AttemptWithBackoff` (so named since 3.2.7), which set the
    retry schedule. Were either to change, the pool would fall back to its own schedule (slower
    recovery, nothing wrong); tests/metadata/test_metadata_outage.py would notice."""

    def _add_connection(self, attempt: Any, growing: bool = False) -> None:
        if attempt is None and _QuickAttempt is not None:
            attempt = _QuickAttempt(timeout=self.reconnect_timeout)
        super()._add_connection(attempt, growing=growing)


def _quick_attempt_class() -> type | None:
    try:
        from psycopg_pool.base import AttemptWithBackoff
    except ImportError:         # psycopg_pool before 3.2.7: its own schedule
        return None

    class QuickAttempt(AttemptWithBackoff):
        INITIAL_DELAY = RECONNECT_DELAY_S
        DELAY_BACKOFF = 1.0     # the same delay every time
        DELAY_JITTER = 0.2      # processes that lost the server together do not retry in step
    return QuickAttempt


_QuickAttempt = _quick_attempt_class()


def _password(url: str) -> str | None:
    try:
        password = psycopg.conninfo.conninfo_to_dict(url).get("password")
        return str(password) if password else None
    except psycopg.Error:
        return None


