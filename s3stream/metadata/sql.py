"""What the SQL metadata stores share: the rules both follow, written once, so that the SQLite
store (s3stream.metadata.sqlite) and the PostgreSQL one (s3stream.metadata.postgres) decide
alike. Here are the row decoding, the request checks, the commit's checks and writes
(_apply_commit), and SqlMetadataStore, the operations whose statements are the same in both
dialects. A store adds what its database does differently, through a few hooks:

- `_transaction(write)`: how a transaction begins, what it locks up front, how the database's
  errors map (SQLite: BEGIN IMMEDIATE, the database's one write lock; PostgreSQL: READ COMMITTED
  in a pipeline, REPEATABLE READ for reads, lock waits and lost connections as
  MetadataBusyError);
- `_read_rows(sql, params)`: one read-only statement in a snapshot of its own;
- `_lock_node` / `_lock_rows`: PostgreSQL's row locks, taken before the state they guard is read
  and always in one order (node, streams by id, objects by id); nothing on SQLite, whose writer
  already holds the whole database.

What differs in a way that matters stays in the store: commit and open_streams (their lock
order, PostgreSQL's single round trip), the node upserts, how object ids are drawn, the KV
writes and how their changes are pushed, the schema and its creation.

The module's functions run inside a transaction on a `_Connection` (statements with qmark
placeholders); their `lock` arguments (" FOR UPDATE" and the like) are empty on SQLite.

Where the MetadataStore contract is silent, both stores decide:
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

import abc
import contextlib
import itertools
from typing import Any, Callable, Iterator, Protocol, Sequence

from ..errors import (KVConflictError, MetadataError, NodeAliveError, StreamFencedError, StreamNotClosedError,
                      StreamNotFoundError)
from .base import (CommitRange, CommitRequest, CommitResult, MetadataStore, NodeMeta, ObjectMeta, ObjectRef,
                   ObjectState, ObjectType, Range, StreamMeta, StreamRange, StreamState)

#: The schema version of both stores: their tables, columns, keys and indexes are the same, in
#: each dialect's types, and a version 1 database is upgraded in place alike.
SCHEMA_VERSION = 2
#: Keys per statement of get_kvs and put_kvs (bound parameters stay far below either store's limit).
KV_BATCH = 500

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


class SqlMetadataStore(MetadataStore):
    """A MetadataStore on an SQL database: the operations whose statements and checks are the
    same in SQLite and PostgreSQL, over the hooks a store implements (see the module docstring).
    A store sets `_clock` (the time in nanoseconds) and implements commit, open_streams and the
    rest of MetadataStore itself."""

    _clock: Callable[[], int]
    #: Whether the database binds a list as one array parameter (PostgreSQL): see _in.
    _arrays = False

    # ---- dialect hooks ---------------------------------------------------------------------

    @abc.abstractmethod
    def _transaction(self, write: bool) -> contextlib.AbstractContextManager[_Connection]:
        """One transaction: commits if the body returns, rolls back if it raises, and raises
        MetadataError (MetadataBusyError for what is transient) for the database's errors. A
        write transaction leaves no other writer room between its checks and its changes, with
        what `_lock_node` and `_lock_rows` add."""

    @abc.abstractmethod
    def _read_rows(self, sql: str, params: Sequence = ()) -> list[tuple]:
        """The rows of one read-only statement, in a snapshot of its own."""

    @abc.abstractmethod
    def _lock_node(self, db: _Connection, node_id: int, mode: str) -> None:
        """Lock the node row (if it exists) FOR `mode` before its state is read, the first lock
        of any operation: "KEY SHARE" where a change of the node's epoch (register_node,
        fence_node: "UPDATE") must wait for the operation, "NO KEY UPDATE" where the operation
        writes the row's other columns (a heartbeat) or must also go one at a time per node (a
        commit). KEY SHARE conflicts only with UPDATE: a node's opens, creates and reserves
        run beside its commits and heartbeats, and a fence waits for all of them."""

    @abc.abstractmethod
    def _lock_rows(self, db: _Connection, table: str, key: str, ids: Sequence[int]) -> None:
        """Lock the rows of `table` whose `key` is in `ids` before their state is read, in
        ascending id order (missing rows are skipped: the caller's checks find them)."""

    # ---- nodes -----------------------------------------------------------------------------

    def get_node(self, node_id: int) -> NodeMeta:
        rows = self._read_rows(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE node_id = ?", (node_id,))
        if not rows:
            raise _unregistered(node_id)
        return _node_meta(rows[0])

    def list_nodes(self) -> list[NodeMeta]:
        return [_node_meta(row) for row in self._read_rows(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY node_id")]

    def heartbeat(self, node_id: int, node_epoch: int, health: str | None = None) -> None:
        with self._transaction(write=True) as db:
            self._lock_node(db, node_id, "NO KEY UPDATE")
            _check_node_epoch(db, node_id, node_epoch)
            db.execute("UPDATE nodes SET heartbeat_ns = ?, health = ? WHERE node_id = ?",
                       (self._clock(), health, node_id))

    # ---- streams ---------------------------------------------------------------------------

    def create_stream(self, node_id: int, node_epoch: int, reserve: int = 0) -> StreamMeta:
        return self.create_streams(1, node_id, node_epoch, reserve)[0]

    def create_streams(self, count: int, node_id: int, node_epoch: int, reserve: int = 0) -> list[StreamMeta]:
        if count <= 0:
            return []
        with self._transaction(write=True) as db:
            self._lock_node(db, node_id, "KEY SHARE")
            _check_node_epoch(db, node_id, node_epoch)
            # One statement for the streams (the rows of a counting CTE), one for their ranges:
            # a batch of 500 new partitions creates its 1,000 streams in one round trip or two,
            # not 1,000 transactions.
            ids = sorted(row[0] for row in db.execute(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
                "INSERT INTO streams (epoch, state, owner_node_id, start_offset, end_offset, reserved_end) "
                "SELECT 0, ?, ?, 0, 0, ? FROM n RETURNING stream_id",
                (count, StreamState.OPENED.value, node_id, reserve)).fetchall())
            db.executemany(f"INSERT INTO ranges ({_RANGE_COLUMNS}) VALUES (?, 0, ?, 0, 0, 0)",
                           [(stream_id, node_id) for stream_id in ids])
            return [StreamMeta(stream_id, 0, StreamState.OPENED, node_id, 0, 0, (Range(0, node_id, 0, 0, 0),),
                               reserve) for stream_id in ids]

    def open_stream(self, stream_id: int, node_id: int, node_epoch: int, reserve: int = 0) -> StreamMeta:
        return self.open_streams([stream_id], node_id, node_epoch, reserve)[0]

    def reserve_offsets(self, stream_id: int, epoch: int, node_id: int, node_epoch: int,
                        reserved_end: int) -> StreamMeta:
        with self._transaction(write=True) as db:
            # The node row FOR KEY SHARE: a fence (FOR UPDATE) waits for this, and this for it.
            self._lock_node(db, node_id, "KEY SHARE")
            _check_node_epoch(db, node_id, node_epoch)
            self._lock_rows(db, "streams", "stream_id", [stream_id])
            stream = _live_stream(db, stream_id)
            _check_owner(stream, epoch, node_id)
            if reserved_end > stream.reserved_end:
                db.execute("UPDATE streams SET reserved_end = ? WHERE stream_id = ?", (reserved_end, stream_id))
            return _load_stream(db, stream_id)

    def abandon_stream(self, stream_id: int, epoch: int, node_id: int) -> StreamMeta:
        with self._transaction(write=True) as db:
            self._lock_rows(db, "streams", "stream_id", [stream_id])
            stream = _live_stream(db, stream_id)
            if stream.state == StreamState.CLOSED and stream.epoch == epoch:
                return stream
            _check_owner(stream, epoch, node_id)
            _abandon(db, stream)
            return _load_stream(db, stream_id)

    def close_stream(self, stream_id: int, epoch: int, node_id: int, node_epoch: int | None = None) -> StreamMeta:
        with self._transaction(write=True) as db:
            if node_epoch is not None:
                self._lock_node(db, node_id, "KEY SHARE")
                _check_node_epoch(db, node_id, node_epoch)
            self._lock_rows(db, "streams", "stream_id", [stream_id])
            stream = _live_stream(db, stream_id)
            if not _to_close(stream, epoch, node_id):
                return stream
            db.execute("UPDATE streams SET state = ?, owner_node_id = NULL WHERE stream_id = ?",
                       (StreamState.CLOSED.value, stream_id))
            return _load_stream(db, stream_id)

    def trim_stream(self, stream_id: int, epoch: int, new_start_offset: int) -> StreamMeta:
        with self._transaction(write=True) as db:
            self._lock_rows(db, "streams", "stream_id", [stream_id])
            stream = _live_stream(db, stream_id)
            _check_stream_epoch(stream, epoch)
            if new_start_offset <= stream.start_offset:
                return stream
            db.execute("UPDATE streams SET start_offset = ? WHERE stream_id = ?", (new_start_offset, stream_id))
            db.execute("DELETE FROM ranges WHERE stream_id = ? AND end_offset <= ? AND range_index < ?",
                       (stream_id, new_start_offset, stream.ranges[-1].index))
            below = _ids(db.execute("SELECT object_id FROM stream_objects WHERE stream_id = ? AND end_offset <= ?",
                                    (stream_id, new_start_offset)))
            below += _ids(db.execute(_DEAD_SSOS, (stream_id, stream.start_offset, new_start_offset)))
            self._lock_rows(db, "objects", "object_id", below)
            _mark_destroyed(db, self._clock(), below)
            return _load_stream(db, stream_id)

    def delete_stream(self, stream_id: int, epoch: int) -> StreamMeta:
        with self._transaction(write=True) as db:
            self._lock_rows(db, "streams", "stream_id", [stream_id])
            stream = _load_stream(db, stream_id)
            _check_stream_epoch(stream, epoch)
            if stream.state == StreamState.DELETED:
                return stream
            db.execute("UPDATE streams SET state = ?, owner_node_id = NULL WHERE stream_id = ?",
                       (StreamState.DELETED.value, stream_id))
            held = _ids(db.execute("SELECT object_id FROM stream_objects WHERE stream_id = ?", (stream_id,)))
            held += _ids(db.execute(_DEAD_SSOS, (stream_id, stream.start_offset, _NO_OFFSET)))
            self._lock_rows(db, "objects", "object_id", held)
            _mark_destroyed(db, self._clock(), held)
            return _load_stream(db, stream_id)

    def get_stream(self, stream_id: int) -> StreamMeta:
        with self._transaction(write=False) as db:
            return _load_stream(db, stream_id)

    def _get_streams(self, stream_ids: list[int]) -> list[StreamMeta]:
        if not stream_ids:
            return []
        with self._transaction(write=False) as db:
            where, params = _in(_takes_arrays(db), "stream_id", stream_ids)
            return _load_streams(db, f"WHERE {where}", params, by_id=True)

    def list_streams(self, include_deleted: bool = False, owner_node_id: int | None = None,
                     last_range: bool = False) -> list[StreamMeta]:
        params: tuple[object, ...]
        if owner_node_id is not None:       # the owner is set only while OPENED
            where, params = "WHERE owner_node_id = ? AND state = ?", (owner_node_id, StreamState.OPENED.value)
        elif include_deleted:
            where, params = "", ()
        else:
            where, params = "WHERE state != ?", (StreamState.DELETED.value,)
        with self._transaction(write=False) as db:
            return _load_streams(db, where, params, last_range=last_range)

    # ---- objects ---------------------------------------------------------------------------

    def get_object(self, object_id: int) -> ObjectMeta:
        with self._transaction(write=False) as db:
            found = _load_objects(db, "o.object_id = ?", (object_id,))
        if not found:
            raise MetadataError(f"object {object_id} does not exist")
        return found[0]

    def list_objects(self, state: ObjectState | None = None, type: ObjectType | None = None,
                     node_id: int | None = None) -> list[ObjectMeta]:
        conditions, params = ["1 = 1"], []
        for column, value in (("state", state), ("type", type), ("node_id", node_id)):
            if value is not None:
                conditions.append(f"o.{column} = ?")
                params.append(value.value if isinstance(value, (ObjectState, ObjectType)) else value)
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
            for table, kind in _REF_TABLES:
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

    def get_object_refs_at(self, points: Sequence[tuple[int, int]]) -> dict[tuple[int, int], ObjectRef]:
        # One statement per KV_BATCH points, all in one read transaction: the points as a
        # VALUES list (PostgreSQL: two arrays, see _in) joined on the (stream_id, end_offset)
        # indexes (the ranges of a stream's COMMITTED objects never overlap: at most one row
        # per point and table).
        unique = list(dict.fromkeys(points))
        out: dict[tuple[int, int], ObjectRef] = {}
        with self._transaction(write=False) as db:
            for i in range(0, len(unique), KV_BATCH):
                chunk = unique[i:i + KV_BATCH]
                params: list[Any]
                if _takes_arrays(db):
                    values, params = "SELECT * FROM unnest(?::bigint[], ?::bigint[])", [list(c) for c in zip(*chunk)]
                else:
                    values = "VALUES " + ", ".join(["(CAST(? AS BIGINT), CAST(? AS BIGINT))"] * len(chunk))
                    params = [v for point in chunk for v in point]
                for table, kind in _REF_TABLES:
                    rows = db.execute(
                        f"WITH p (sid, off) AS ({values}) "
                        f"SELECT p.sid, p.off, o.object_id, o.key, o.size, r.start_offset, r.end_offset "
                        f"FROM p JOIN {table} r ON r.stream_id = p.sid AND r.end_offset > p.off "
                        f"AND r.start_offset <= p.off JOIN objects o ON o.object_id = r.object_id "
                        f"WHERE o.state = ?", (*params, _COMMITTED)).fetchall()
                    for sid, off, object_id, key, size, start, end in rows:
                        out[(sid, off)] = ObjectRef(object_id, key, size, kind, sid, start, end)
        return out

    def node_stream_set_objects(self, node_id: int) -> list[ObjectMeta]:
        with self._transaction(write=False) as db:
            return _load_objects(db, "o.node_id = ? AND o.state = ? AND o.type = ?",
                                 (node_id, _COMMITTED, _SSO), order="o.order_id")

    def mark_destroyed(self, object_ids: Sequence[int]) -> None:
        with self._transaction(write=True) as db:
            self._lock_rows(db, "objects", "object_id", object_ids)
            to_mark = []
            for object_id in object_ids:
                row = db.execute("SELECT state FROM objects WHERE object_id = ?", (object_id,)).fetchone()
                if row is None or row[0] == _PREPARED:
                    raise MetadataError(
                        f"object {object_id} cannot be marked for destruction: "
                        f"{'it does not exist' if row is None else 'it is not committed'}")
                if row[0] == _COMMITTED:
                    to_mark.append(object_id)
            _mark_destroyed(db, self._clock(), to_mark)

    def remove_objects(self, object_ids: Sequence[int], unused_prepared: bool = False) -> list[int]:
        removed = []
        with self._transaction(write=True) as db:
            now = self._clock()
            wanted = sorted(set(object_ids))
            self._lock_rows(db, "objects", "object_id", wanted)
            for object_id in wanted:
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
        rows = self._read_rows("SELECT value FROM kv WHERE key = ?", (key,))
        return bytes(rows[0][0]) if rows else None

    def get_kv_and_node(self, key: str, node_id: int) -> tuple[bytes | None, NodeMeta]:
        # One statement: a migration's driver reads the target's opened/ record and its node
        # row (the incarnation check) in one round trip once the record is pushed.
        rows = self._read_rows(f"SELECT (SELECT value FROM kv WHERE key = ?), {_NODE_COLUMNS} FROM nodes "
                               "WHERE node_id = ?", (key, node_id))
        if not rows:
            raise _unregistered(node_id)
        value = rows[0][0]
        return (None if value is None else bytes(value)), _node_meta(rows[0][1:])

    def get_kvs(self, keys: Sequence[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        unique = list(dict.fromkeys(keys))
        for i in range(0, len(unique), KV_BATCH):
            chunk = unique[i:i + KV_BATCH]
            where, params = _in(self._arrays, "key", chunk, "text")
            rows = self._read_rows(f"SELECT key, value FROM kv WHERE {where}", params)
            found.update((k, bytes(v)) for k, v in rows)
        return found

    def list_kv(self, prefix: str) -> dict[str, bytes]:
        # A range scan on the primary key: [prefix, prefix + U+10FFFF) holds every key with it
        # (keys sort by code point: SQLite's BINARY collation, PostgreSQL's "C").
        rows = self._read_rows("SELECT key, value FROM kv WHERE key >= ? AND key < ? ORDER BY key",
                               (prefix, prefix + "\U0010ffff"))
        return {k: bytes(v) for k, v in rows}


# ---- helpers (all run inside a transaction) ----------------------------------------------------

class _Cursor(Protocol):
    """What the helpers use of a statement's result: sqlite3's cursor, or psycopg's."""
    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


class _Connection(Protocol):
    """What the shared helpers use of a connection: statements with qmark placeholders
    (sqlite3.Connection, or postgres._Db around a psycopg connection)."""
    def execute(self, sql: str, params: Sequence[Any] = ..., /) -> _Cursor: ...
    def executemany(self, sql: str, params_seq: Sequence[Sequence[Any]], /) -> object: ...


def _takes_arrays(db: _Connection) -> bool:
    """Whether `db` binds a list as one array parameter (PostgreSQL's, postgres._Db.arrays)."""
    return getattr(db, "arrays", False)


def _in(arrays: bool, column: str, values: Sequence, cast: str = "bigint") -> tuple[str, tuple]:
    """`column IN (?, ?, ...)` of `values`, and its parameters; with `arrays` (PostgreSQL),
    `column = ANY(?::cast[])` and one array: psycopg parses a statement of more than 50
    parameters again each time, in Python (0.7 ms for 500, timeit), and PostgreSQL plans
    each such text anew, where one array's statement is parsed, and prepared, once."""
    if arrays:
        return f"{column} = ANY(?::{cast}[])", (list(values),)
    return f"{column} IN ({', '.join('?' * len(values))})", tuple(values)


def _closes_only(request: CommitRequest) -> bool:
    """Whether the commit only closes streams (no object, range or compaction): it reads no
    stream's ranges (_send_load_streams' `no_ranges`)."""
    return not (request.sso or request.stream_objects or request.compacted_ids)


def _apply_commit(db: _Connection, request: CommitRequest, now: int, rows: dict[int, tuple],
                  streams: dict[int, StreamMeta], set_ends, insert_refs, lock: str = "") -> CommitResult:
    """The part of a commit both stores share, once the node epoch is checked and the objects'
    (state, expire_ns) `rows` and the request's `streams` are loaded (under the store's locks;
    with their last range only, which is all it reads):
    the retry, expiry, append and compaction checks, then the writes. `set_ends(db, ends)`
    moves each stream's end and its last range's end, ends = [(stream id, end, range index)].
    `insert_refs(db, table, rows)` inserts sso_ranges or stream_objects rows (object id,
    stream id, start, end)."""
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
        insert_refs(db, "sso_ranges", [(request.sso.object_id, r.stream_id, r.start_offset, r.end_offset)
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
    insert_refs(db, "stream_objects", [(so.object_id, so.range.stream_id, so.range.start_offset,
                                        so.range.end_offset) for so in live])
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
    to_close = [stream_id for stream_id, epoch in request.closes
                if _to_close(streams[stream_id], epoch, request.node_id)]
    # KV_BATCH to a statement: a failover closes 20,000 streams (a statement each took 0.4 s
    # of a PostgreSQL failover, pipelined).
    for i in range(0, len(to_close), KV_BATCH):
        chunk = to_close[i:i + KV_BATCH]
        where, params = _in(_takes_arrays(db), "stream_id", chunk)
        db.execute(f"UPDATE streams SET state = ?, owner_node_id = NULL WHERE {where}",
                   (StreamState.CLOSED.value, *params))


def _to_close(stream: StreamMeta, epoch: int, node_id: int) -> bool:
    """Whether closing the stream at `epoch` for `node_id` changes it: False for a stream CLOSED
    at that epoch already (a retried close), True while `node_id` holds it OPENED at `epoch`,
    StreamFencedError otherwise."""
    if stream.state == StreamState.CLOSED and stream.epoch == epoch:
        return False
    if stream.state != StreamState.OPENED or stream.epoch != epoch or stream.owner_node_id != node_id:
        raise StreamFencedError(
            f"stream {stream.stream_id} epoch {epoch} on node {node_id} is fenced: the stream "
            f"is {stream.state.value} at epoch {stream.epoch} on node "
            f"{stream.owner_node_id}; reopen it to continue")
    return True


def _unregistered(node_id: int) -> MetadataError:
    return MetadataError(f"node {node_id} is not registered; call register_node first")


def _unknown_object(object_id: int) -> MetadataError:
    """What a commit naming an object without a row raises."""
    return MetadataError(f"commit names object {object_id}, which does not exist "
                         f"(never prepared, or expired and removed)")


def _unknown_stream(stream_id: int) -> MetadataError:
    """What a commit naming a stream without a row raises."""
    return MetadataError(f"commit names stream {stream_id}, which does not exist")


def _check_prepare(count: int, ttl_ns: int) -> None:
    """prepare_objects' arguments: ValueError for a count below 1 or a negative TTL."""
    if count < 1:
        raise ValueError(f"prepare_objects needs count >= 1, got {count}")
    if ttl_ns < 0:
        raise ValueError(f"prepare_objects needs ttl_ns >= 0, got {ttl_ns}")


def _ids(cursor: _Cursor) -> list[int]:
    return [row[0] for row in cursor]


def _node_row(db: _Connection, node_id: int, lock: str = "") -> tuple:
    row = db.execute(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE node_id = ?{lock}",
                     (node_id,)).fetchone()
    if row is None:
        raise _unregistered(node_id)
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
    """StreamFencedError unless `node_epoch` is the node's; `lock` (PostgreSQL: " FOR KEY SHARE" and
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
            raise _unregistered(node_id)
        if node_epoch != row[1]:
            raise StreamFencedError(f"node {node_id} epoch {node_epoch} is fenced (current "
                                    f"{row[1]}): this node instance was replaced; stop it")
    return check


#: Where a stream's committed ranges are, and the kind of object each table's rows are in.
_REF_TABLES = (("sso_ranges", ObjectType.STREAM_SET_OBJECT), ("stream_objects", ObjectType.STREAM_OBJECT))
#: A stream row's state: a lookup, not an Enum call (a failover loads 20,000 rows).
_STATES = {state.value: state for state in StreamState}


def _load_streams(db: _Connection, where: str, params: Sequence, lock: str = "",
                  last_range: bool = False, by_id: bool = False, no_ranges: bool = False) -> list[StreamMeta]:
    """The streams `where` selects, with their ranges (`last_range`: only the last one;
    `no_ranges`: none). Both statements are sent before either result is read (PostgreSQL's
    pipeline: one round trip); `lock` (" FOR UPDATE") locks the streams' rows, by the first of
    them. `by_id`: `where` names stream_id alone (see _send_load_streams)."""
    return _send_load_streams(db, where, params, lock, last_range, by_id, no_ranges)()


def _send_load_streams(db: _Connection, where: str, params: Sequence, lock: str = "",
                       last_range: bool = False, by_id: bool = False,
                       no_ranges: bool = False) -> Callable[[], list[StreamMeta]]:
    """_load_streams in two halves: sends its statements and returns what reads their results
    (statements sent in between travel with them on PostgreSQL). `last_range`: each stream's
    last range only, found through the primary key (what a commit checks and extends): a stream
    gains a range at every open, and a commit must not cost more the more owners it had.
    `no_ranges`: none are read (`ranges` empty: a commit that only closes streams checks their
    state and epoch, not their ranges; a failover's closes of 20,000 streams read 20,000).
    `by_id`: `where` names stream_id alone, so the ranges are selected by it directly, through
    their primary key, not joined to the streams it selects (PostgreSQL hash-joined a scan of
    every range: 6.9 ms a call in a failover of 10,000 partitions, pg_stat_statements; selected
    by id, 2.4 ms for 1,000 streams among 20,000, a run of 10 timed from the client)."""
    stream_rows = db.execute(f"SELECT {_STREAM_COLUMNS} FROM streams {where} ORDER BY stream_id{lock}", params)
    range_rows: Any = None
    if no_ranges:
        pass                              # ranges stay empty
    elif by_id and not last_range:
        range_rows = db.execute(f"SELECT {_RANGE_COLUMNS}, lost FROM ranges {where} ORDER BY stream_id, range_index",
                                params)
    elif last_range:
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
        # fetchall(): psycopg makes the rows in one call, where iterating takes a Python call
        # per row (a failover of 10,000 partitions loads some 170,000).
        ranges: dict[int, list[Range]] = {}
        for stream_id, index, node_id, epoch, start, end, lost in ([] if range_rows is None else range_rows.fetchall()):
            ranges.setdefault(stream_id, []).append(Range(index, node_id, epoch, start, end, bool(lost)))
        return [StreamMeta(stream_id, epoch, _STATES[state], owner, start, end,
                           tuple(ranges.get(stream_id, ())), reserved)
                for stream_id, epoch, state, owner, start, end, reserved in stream_rows.fetchall()]
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
    found = _load_streams(db, "WHERE stream_id = ?", (stream_id,), last_range=last_range, by_id=True)
    if not found:
        raise StreamNotFoundError(f"stream {stream_id} does not exist")
    return found[0]


def _open_rows(db: _Connection, stream_ids: Sequence[int], node_id: int, reserve: int,
               put_range: str, lock: str = "", check: Callable[[], None] | None = None,
               write: Callable[[_Connection, list, list], None] | None = None) -> list[StreamMeta]:
    """open_streams once the node's epoch is checked: each stream at epoch + 1, owned by
    `node_id`, with a new range from its end (`put_range`: the store's statement that inserts or
    replaces a ranges row) and `reserve` offsets reserved. The streams are read together (`lock`
    on PostgreSQL: " FOR UPDATE" locks their rows) and written together, a statement for all of
    them per table, so that the number of statements does not grow with the streams. `check`
    (the node's, from _send_node_check) runs once the streams are read; what is returned is what
    the writes make of the streams, not read again (on PostgreSQL the writes then travel with
    COMMIT). `write(db, range_rows, stream_rows)`: the store's set-based writes of those rows,
    used when no stream is named twice (else a statement per row, `put_range` and an UPDATE)."""
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
        # Built, not dataclasses.replace()d: a failover's opens make 20,000 of them.
        loaded[stream_id] = StreamMeta(
            stream_id, epoch, StreamState.OPENED, node_id, stream.start_offset, stream.end_offset,
            kept + (Range(index, node_id, epoch, stream.end_offset, stream.end_offset, False),),
            stream.end_offset + reserve)
    if write is not None and len(set(stream_ids)) == len(stream_ids):
        write(db, range_rows, stream_rows)
    else:
        db.executemany(put_range, range_rows)
        db.executemany("UPDATE streams SET epoch = ?, state = ?, owner_node_id = ?, reserved_end = ? "
                       "WHERE stream_id = ?", stream_rows)
    return [loaded[stream_id] for stream_id in stream_ids]


def _streams_by_id(db: _Connection, stream_ids: Sequence[int], lock: str = "",
                   last_range: bool = False, no_ranges: bool = False) -> dict[int, StreamMeta]:
    """The rows of `stream_ids` that exist (as _load_streams), KV_BATCH ids to a statement, in
    id order (rows locked with `lock` are locked in that order)."""
    ids = sorted(set(stream_ids))
    out: dict[int, StreamMeta] = {}
    for i in range(0, len(ids), KV_BATCH):
        chunk = ids[i:i + KV_BATCH]
        where, params = _in(_takes_arrays(db), "stream_id", chunk)
        out.update((m.stream_id, m) for m in _load_streams(db, f"WHERE {where}", params, lock, last_range,
                                                           by_id=True, no_ranges=no_ranges))
    return out


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
