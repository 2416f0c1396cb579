"""The metadata model (article 002) and the MetadataStore interface.

Model:
- KV: small key -> bytes records (e.g. a partition name -> its meta stream id).
- Stream: id, epoch, state (OPENED/CLOSED/DELETED), owner node, start offset (after trim), end
  offset (committed to objects), reserved end (its owner takes no offset at or beyond it), ranges
  (which node wrote which offset span at which epoch, in order; a `lost` range was given up
  with a lost WAL and holds no data), and its StreamObjects.
- Node: id, node epoch (bumped at each start), failover flag, WAL location, heartbeat and the
  health it carried, and its StreamSetObjects in commit order.
- Object: id (never reused), key, size, type (SO / SSO), state PREPARED -> COMMITTED ->
  MARK_DESTROYED -> (row removed once the store object is deleted), prepared / expiry / commit /
  mark-destroy times, and for an SSO the stream ranges it holds.

Contract of every implementation:
- Every operation is one transaction that checks its preconditions and either applies all of
  its changes or none.
- Fencing: an operation naming a stream epoch other than the stream's current one, or a node
  epoch other than the node's current one, raises StreamFencedError and changes nothing.
- Reservations: an owner takes offsets only below its stream's reserved end, which only its
  current incarnation can raise (`reserve_offsets`, checked against the node epoch), so once a
  node is fenced its reserved ends bound every offset it may have acknowledged: what
  `abandon_stream` skips when the node's WAL is lost.
- Contiguity: a commit's ranges for a stream start exactly at the stream's end offset and are
  contiguous; otherwise MetadataError and nothing changes.
- Idempotence: a commit retried after a timeout (all its objects already COMMITTED with the same
  ranges) succeeds again without changing anything.
- Several processes may share one store (SQLite file, PostgreSQL server).
- Times are integers in nanoseconds from the store's injected clock.
"""
from __future__ import annotations

import abc
import hashlib
import re
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Sequence


def redact_url(url: str) -> str:
    """`url` with its password (URL user info or a password= parameter) replaced by ***."""
    scheme, sep, rest = url.partition("://")
    if sep:
        netloc, slash, path = rest.partition("/")
        if "@" in netloc:
            userinfo, host = netloc.rsplit("@", 1)
            if ":" in userinfo:
                userinfo = userinfo.split(":", 1)[0] + ":***"
            rest = f"{userinfo}@{host}{slash}{path}"
        url = scheme + sep + rest
    return re.sub(r"(password\s*=\s*)('[^']*'|[^&\s]*)", r"\1***", url)


class StreamState(str, Enum):
    OPENED = "OPENED"
    CLOSED = "CLOSED"
    DELETED = "DELETED"


class ObjectState(str, Enum):
    PREPARED = "PREPARED"
    COMMITTED = "COMMITTED"
    MARK_DESTROYED = "MARK_DESTROYED"


class ObjectType(str, Enum):
    STREAM_OBJECT = "SO"
    STREAM_SET_OBJECT = "SSO"


def object_key(object_id: int) -> str:
    """The store key of an object: a short hash first spreads keys over S3 partitions."""
    digest = hashlib.blake2b(object_id.to_bytes(8, "little"), digest_size=2).hexdigest()
    return f"{digest}/{object_id:016x}.obj"


@dataclass(frozen=True)
class Range:
    """The span of a stream written while it was open on `node_id` at `epoch`; a `lost` range
    holds nothing (given up with the node's lost WAL: `abandon_stream`)."""
    index: int
    node_id: int
    epoch: int
    start_offset: int
    end_offset: int
    lost: bool = False


@dataclass(frozen=True)
class StreamMeta:
    stream_id: int
    epoch: int
    state: StreamState
    owner_node_id: int | None
    start_offset: int
    end_offset: int
    ranges: tuple[Range, ...] = ()
    reserved_end: int = 0           # its owner takes no offset at or beyond this (while OPENED)

    def lost_range_at(self, offset: int) -> Range | None:
        """The lost range holding `offset`, if any."""
        for r in self.ranges:
            if r.lost and r.start_offset <= offset < r.end_offset:
                return r
        return None


@dataclass(frozen=True)
class StreamRange:
    """A stream's offsets [start_offset, end_offset) held in one object."""
    stream_id: int
    start_offset: int
    end_offset: int


@dataclass(frozen=True)
class ObjectMeta:
    object_id: int
    key: str
    size: int                       # 0 while PREPARED
    type: ObjectType | None         # None while PREPARED
    state: ObjectState
    node_id: int | None             # the node whose SSO list holds it (SSO only)
    order_id: int | None            # commit order among the node's SSOs (SSO only)
    prepared_ns: int
    expire_ns: int
    committed_ns: int | None
    mark_destroyed_ns: int | None
    ranges: tuple[StreamRange, ...] = ()   # SSO: every stream range in it; SO: its one range


@dataclass(frozen=True)
class NodeMeta:
    node_id: int
    node_epoch: int
    failover: bool
    wal_path: str
    heartbeat_ns: int
    health: str | None = None       # JSON the node's last heartbeat carried (None: none)

    @property
    def walless(self) -> bool:
        """A writer without a WAL (wal_path WALLESS + what it is), such as the Spark sink's
        committer: it holds streams open only inside its own commits and never heartbeats, so
        there is nothing to fail over and no judge counts its silence."""
        return self.wal_path.startswith(WALLESS)


#: The wal_path prefix of a node that has no WAL (NodeMeta.walless).
WALLESS = "walless:"


@dataclass(frozen=True)
class ObjectRef:
    """Where to read a stream's offsets [start_offset, end_offset) from (read path)."""
    object_id: int
    key: str
    size: int
    type: ObjectType
    stream_id: int
    start_offset: int
    end_offset: int


@dataclass(frozen=True)
class CommitRange:
    """A stream range written by `epoch` of the stream (fencing checks it)."""
    stream_id: int
    epoch: int
    start_offset: int
    end_offset: int


@dataclass(frozen=True)
class CommitStreamObject:
    object_id: int
    size: int
    range: CommitRange


@dataclass(frozen=True)
class CommitSSO:
    object_id: int
    size: int
    ranges: tuple[CommitRange, ...]


@dataclass(frozen=True)
class CommitRequest:
    """One upload of one node: at most one SSO plus any number of SOs, committed atomically.

    `compacted_ids` (compaction only) are COMMITTED objects the new ones replace: they are marked
    for destruction in the same transaction.

    `closes` (stream id, epoch): streams the same transaction closes once its ranges are
    applied, each as `close_stream` would (the node holds it OPENED at that epoch, else
    StreamFencedError; already CLOSED at that epoch: nothing to do). A node's close of a
    partition uploads the streams' tails and closes them in this one transaction; a request may
    hold closes and no object at all.

    `kv` (key, value): KV entries written (as `put_kv`, change feeds notified) in the same
    transaction, only with `closes`: a partition's close records itself (`closed/<name>`) in
    the commit that closes its streams, so that whoever waits for it wakes one write earlier.

    `kv_guard` (key, value or None for absent): the commit applies only if the key holds that
    value when it does, else KVConflictError and nothing changes (a retry of a commit that was
    applied is not checked again). The Spark sink commits a micro-batch's objects with its
    writer's last committed batch as the guard: a second driver's commit of the same batch fails.
    """
    node_id: int
    node_epoch: int
    sso: CommitSSO | None = None
    stream_objects: tuple[CommitStreamObject, ...] = ()
    compacted_ids: tuple[int, ...] = ()
    closes: tuple[tuple[int, int], ...] = ()
    kv: tuple[tuple[str, bytes], ...] = ()
    kv_guard: tuple[str, bytes | None] | None = None

    def object_ids(self) -> list[int]:
        ids = [so.object_id for so in self.stream_objects]
        return ([self.sso.object_id] if self.sso else []) + ids

    def all_ranges(self) -> list[CommitRange]:
        ranges = list(self.sso.ranges) if self.sso else []
        ranges += [so.range for so in self.stream_objects]
        return sorted(ranges, key=lambda r: (r.stream_id, r.start_offset))


@dataclass(frozen=True)
class CommitResult:
    #: stream id -> its end offset after the commit
    end_offsets: dict[int, int] = field(default_factory=dict)
    #: True if this was a retry of a commit that had already been applied
    already_committed: bool = False


def commit_key(stream_id: int) -> str:
    """The change-feed key a commit that extends stream `stream_id` notifies (not a KV key: no
    value is stored under it). A tailing reader waits on kv_changes((commit_key(id),)); a
    store may notify a stream's commits only while such a feed is open (PostgreSQL's feed
    registers a `tailing_key`, see commit_notices)."""
    return f"commit/{stream_id}"


#: Where change feeds register their interest in a stream's commits (tailing_key).
TAILING_PREFIX = "tailing/"


def tailing_key(stream_id: int, token: str) -> str:
    """The KV key a change feed on stream `stream_id`'s commits puts (empty) while it is open,
    and deletes when it closes; `token` tells feeds apart. One of a process that died stays,
    which only costs the stream's commits their notices (as if someone tailed it)."""
    return f"{TAILING_PREFIX}{stream_id}/{token}"


def commit_notices(request: "CommitRequest") -> list[str]:
    """The change-feed keys a commit notifies once it is committed: `commit_key` of each stream
    whose committed end it moves (tailing readers), and its `kv` keys. The PostgreSQL store
    sends a stream's commit key only while a change feed on it has a `tailing_key`: each NOTIFY
    wakes every listening session (node agents, migrations) and holds a lock that serialises
    the committing transactions, and at a hundred upload commits a second nobody tailing, the
    notices alone made migrations under load slower (issue 28)."""
    return [commit_key(stream_id) for stream_id in extended_streams(request)] + [key for key, _ in request.kv]


def extended_streams(request: "CommitRequest") -> list[int]:
    """The streams whose committed end a commit moves (a compaction moves none)."""
    if request.compacted_ids:
        return []
    return sorted({r.stream_id for r in request.all_ranges()})


class ChangeFeed:
    """Wakes a waiter when KV keys under its prefixes may have changed, so that node agents and
    migrations react to a change at once instead of polling for it.

    `pushes` says whether writes by other processes wake it. This base feed does not push: its
    `wait` only sleeps, and callers keep polling. A store that can push (PostgreSQL
    LISTEN/NOTIFY; SQLite by datagrams between the processes of its host) returns its own feed
    from `MetadataStore.kv_changes`. A wake-up only says
    "look again": it may be spurious, and callers always re-read the keys they care about, so a
    notification lost with a connection costs a poll interval, never a decision."""

    pushes = False

    def __init__(self, prefixes: Sequence[str]) -> None:
        self.prefixes = tuple(prefixes)
        self._woken = threading.Event()

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds; True if a change (or `wake`) came, else False."""
        woken = self._woken.wait(timeout)
        self._woken.clear()
        return woken

    def wake(self) -> None:
        """Make the current or next `wait` return True (used to stop a waiting loop)."""
        self._woken.set()

    def close(self) -> None:
        self.wake()


#: Stream ids per read of get_streams (under SQLite's bound on a statement's parameters).
GET_STREAMS_CHUNK = 500


class MetadataStore(abc.ABC):
    """See the module docstring for the contract; errors are s3stream.errors classes."""

    # ---- nodes -----------------------------------------------------------------------------

    @abc.abstractmethod
    def register_node(self, node_id: int, wal_path: str) -> NodeMeta:
        """Create the node or bump its epoch (a (re)start): returns the new NodeMeta.
        Clears the failover flag and records a heartbeat."""

    @abc.abstractmethod
    def get_node(self, node_id: int) -> NodeMeta:
        """MetadataError if unknown."""

    @abc.abstractmethod
    def list_nodes(self) -> list[NodeMeta]: ...

    @abc.abstractmethod
    def heartbeat(self, node_id: int, node_epoch: int, health: str | None = None) -> None:
        """Record a heartbeat (the store's time) carrying `health` (JSON text, or None).
        StreamFencedError if `node_epoch` is not the node's current epoch."""

    @abc.abstractmethod
    def fence_node(self, node_id: int, failover: bool = True,
                   if_unchanged: tuple[int, int] | None = None) -> NodeMeta:
        """Bump the node's epoch so its current instance can no longer commit, heartbeat or
        open streams (failover); sets the failover flag. Returns the new NodeMeta. With
        `if_unchanged` = (node epoch, heartbeat ns) as a judge last saw them: only if they are
        still so, else NodeAliveError and nothing changes (a heartbeat that landed after the
        judge looked renewed a lease the judge does not know of)."""

    # ---- streams ---------------------------------------------------------------------------

    @abc.abstractmethod
    def create_stream(self, node_id: int, node_epoch: int, reserve: int = 0) -> StreamMeta:
        """A new stream OPENED on the node at epoch 0, offsets 0, one empty range, offsets
        [0, reserve) reserved."""

    def create_streams(self, count: int, node_id: int, node_epoch: int, reserve: int = 0) -> list[StreamMeta]:
        """`create_stream` `count` times, in one transaction where the store can (all or none),
        ids ascending: a node agent creates the streams of a batch of new partitions at once."""
        return [self.create_stream(node_id, node_epoch, reserve) for _ in range(count)]

    @abc.abstractmethod
    def open_stream(self, stream_id: int, node_id: int, node_epoch: int, reserve: int = 0) -> StreamMeta:
        """Open on this node with epoch + 1 and a new range starting at the end offset (an
        empty last range is replaced instead), reserving `reserve` offsets from the end offset.
        Allowed if CLOSED, or OPENED by this same node (a restart). StreamNotClosedError if
        OPENED by another node; StreamNotFoundError if missing or DELETED; StreamFencedError if
        the node epoch is stale."""

    @abc.abstractmethod
    def open_streams(self, stream_ids: Sequence[int], node_id: int, node_epoch: int,
                     reserve: int = 0) -> list[StreamMeta]:
        """`open_stream` of several streams in one transaction (all or none), in that order: a
        partition's open (its meta stream and data streams) is one metadata write."""

    @abc.abstractmethod
    def reserve_offsets(self, stream_id: int, epoch: int, node_id: int, node_epoch: int,
                        reserved_end: int) -> StreamMeta:
        """Raise the stream's reserved end to `reserved_end` (a lower value changes nothing).
        StreamFencedError unless the stream is OPENED by this node at `epoch` and `node_epoch`
        is the node's current epoch."""

    @abc.abstractmethod
    def abandon_stream(self, stream_id: int, epoch: int, node_id: int) -> StreamMeta:
        """Close a stream that `node_id` holds OPENED at `epoch` without its un-uploaded data
        (the node's WAL is lost): offsets [end offset, reserved end) become a lost range, the
        end offset moves to the reserved end, and the stream is CLOSED, so the next owner
        continues above every offset the node may have acknowledged. StreamFencedError unless
        the stream is OPENED by that node at that epoch; a repeat after it succeeded (CLOSED
        at the same epoch) returns the stream unchanged."""

    @abc.abstractmethod
    def close_stream(self, stream_id: int, epoch: int, node_id: int, node_epoch: int | None = None) -> StreamMeta:
        """OPENED -> CLOSED. StreamFencedError unless epoch and owner match, and (if given)
        `node_epoch` is still the node's epoch: a failover closes what the incarnation it fenced
        held, never what a newer incarnation of that node opened since. Closing an already
        CLOSED stream at the same epoch is a no-op."""

    @abc.abstractmethod
    def trim_stream(self, stream_id: int, epoch: int, new_start_offset: int) -> StreamMeta:
        """Raise the start offset (lower values are a no-op). StreamObjects wholly below it are
        marked for destruction, and so are StreamSetObjects whose last live range this trim ended
        (every range they hold is below its stream's start, or of a DELETED stream): with
        retention, a node's store shrinks as it trims, without waiting for compaction. Ranges
        wholly below the start are dropped (the last range always stays), so a stream's ranges
        grow with its moves since its start, not with its history. StreamFencedError if the
        epoch is stale."""

    @abc.abstractmethod
    def delete_stream(self, stream_id: int, epoch: int) -> StreamMeta:
        """-> DELETED; its StreamObjects are marked for destruction, and the StreamSetObjects
        whose last live range was this stream's (see trim_stream). StreamFencedError if the
        epoch is stale; StreamNotFoundError if missing."""

    @abc.abstractmethod
    def get_stream(self, stream_id: int) -> StreamMeta:
        """StreamNotFoundError if missing (DELETED streams are returned)."""

    def get_streams(self, stream_ids: Iterable[int]) -> dict[int, StreamMeta]:
        """The streams with these ids (DELETED ones included; missing ids are absent), in one
        read per GET_STREAMS_CHUNK ids: what a caller holding a set of ids (compaction: the
        streams of a node's StreamSetObjects) needs, without listing every stream."""
        ids = sorted(set(stream_ids))
        out: dict[int, StreamMeta] = {}
        for i in range(0, len(ids), GET_STREAMS_CHUNK):
            out.update((m.stream_id, m) for m in self._get_streams(ids[i:i + GET_STREAMS_CHUNK]))
        return out

    @abc.abstractmethod
    def _get_streams(self, stream_ids: list[int]) -> list[StreamMeta]:
        """get_streams for at most GET_STREAMS_CHUNK ids, one transaction."""

    @abc.abstractmethod
    def list_streams(self, include_deleted: bool = False, owner_node_id: int | None = None,
                     last_range: bool = False) -> list[StreamMeta]:
        """Every stream (DELETED ones only if `include_deleted`), by id; with `owner_node_id`,
        only the streams OPENED on that node, found through an index: a node's own streams cost
        the same however many other streams the cluster holds. `last_range`: each stream's
        `ranges` hold its last range only (a stream gains one at every open: a restart or a
        failover, which needs none of the older ones, must not cost more the longer the
        streams have lived)."""

    # ---- objects ---------------------------------------------------------------------------

    @abc.abstractmethod
    def prepare_objects(self, count: int, ttl_ns: int) -> list[int]:
        """Reserve `count` new object ids (ascending, never reused) as PREPARED, expiring
        `ttl_ns` from now, with keys object_key(id)."""

    @abc.abstractmethod
    def commit(self, request: CommitRequest) -> CommitResult:
        """Apply one upload atomically (see the module contract). Preconditions: the node epoch
        is current; every object is PREPARED (or all are COMMITTED with these same ranges: a
        retry); every range's stream exists, is OPENED, owned by the node at that epoch (else
        StreamFencedError), and its ranges are contiguous from its end offset. Ranges of DELETED
        streams are ignored. Effects: objects COMMITTED (type, size, commit time; the SSO joins
        the node's SSO list with the next order id); SOs join their streams; each stream's end
        offset and its last range's end advance; `compacted_ids` are marked for destruction;
        the streams of `closes` are CLOSED (see CommitRequest)."""

    @abc.abstractmethod
    def get_object(self, object_id: int) -> ObjectMeta:
        """MetadataError if unknown."""

    @abc.abstractmethod
    def list_objects(self, state: ObjectState | None = None, type: ObjectType | None = None,
                     node_id: int | None = None) -> list[ObjectMeta]: ...

    @abc.abstractmethod
    def get_object_refs(self, stream_id: int, start_offset: int, end_offset: int,
                        limit: int = 64) -> list[ObjectRef]:
        """COMMITTED objects holding data of the stream overlapping [start_offset, end_offset),
        ordered by start offset, at most `limit`. StreamObjects and StreamSetObject ranges alike."""

    def get_object_refs_at(self, points: Sequence[tuple[int, int]]) -> dict[tuple[int, int], ObjectRef]:
        """The COMMITTED object holding each (stream_id, offset) point, in one read for all
        of them where the store can (this default: a get_object_refs each); points no
        committed object holds are absent. What a batch of partition opens needs: the object
        of each one's last checkpoint."""
        out: dict[tuple[int, int], ObjectRef] = {}
        for stream_id, offset in dict.fromkeys(points):
            refs = self.get_object_refs(stream_id, offset, offset + 1, limit=1)
            if refs and refs[0].start_offset <= offset:
                out[(stream_id, offset)] = refs[0]
        return out

    @abc.abstractmethod
    def node_stream_set_objects(self, node_id: int) -> list[ObjectMeta]:
        """The node's COMMITTED SSOs in commit order."""

    @abc.abstractmethod
    def mark_destroyed(self, object_ids: Sequence[int]) -> None:
        """COMMITTED -> MARK_DESTROYED (and out of stream/node lists), now."""

    @abc.abstractmethod
    def objects_to_delete(self, destroy_delay_ns: int, limit: int | None = None) -> list[ObjectMeta]:
        """PREPARED objects past expiry, and MARK_DESTROYED ones marked at least
        `destroy_delay_ns` ago, lowest ids first, at most `limit` (None: all): the lifecycle
        deletes their store objects, then calls `remove_objects`."""

    @abc.abstractmethod
    def remove_objects(self, object_ids: Sequence[int], unused_prepared: bool = False) -> list[int]:
        """Remove the rows of objects that are still expired-PREPARED or MARK_DESTROYED;
        returns the ids removed (an object committed meanwhile is kept). `unused_prepared`: the
        caller prepared these ids and never PUT them (ids prepared ahead for closes, let go at
        shutdown): PREPARED rows are removed before they expire too."""

    # ---- KV --------------------------------------------------------------------------------

    @abc.abstractmethod
    def get_kv(self, key: str) -> bytes | None: ...

    def get_kv_and_node(self, key: str, node_id: int) -> tuple[bytes | None, NodeMeta]:
        """`get_kv(key)` and `get_node(node_id)` together: one round trip (and one snapshot)
        where the store can, two reads otherwise. MetadataError if the node is unknown."""
        return self.get_kv(key), self.get_node(node_id)

    def get_kvs(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The keys of `keys` that exist and their values, read in one round trip where the
        store can (an agent's batch of opens reads every partition's close record at once)."""
        found = {}
        for key in keys:
            value = self.get_kv(key)
            if value is not None:
                found[key] = value
        return found

    @abc.abstractmethod
    def put_kv(self, key: str, value: bytes) -> None: ...

    def put_kvs(self, items: Sequence[tuple[str, bytes]]) -> None:
        """`put_kv` of every (key, value), in one transaction where the store can: all written
        or none (an agent publishes a batch of opens in one write). Change feeds are notified
        of each key."""
        for key, value in items:
            self.put_kv(key, value)

    @abc.abstractmethod
    def put_kv_if_absent(self, key: str, value: bytes) -> bytes:
        """Store `value` unless the key exists; returns the value now stored."""

    @abc.abstractmethod
    def replace_kv(self, key: str, expected: bytes | None, value: bytes,
                   guard: tuple[str, bytes] | None = None) -> bool:
        """Compare and set, in one transaction: store `value` if the key's value is `expected`
        (None: the key is absent) and, when `guard` = (key, value) is given, the guard key holds
        exactly that value. True if written. A guard is a fencing token: a leader writes only
        while its lease (the guard) is still the one it holds, so a deposed leader's write is
        refused even if it does not know yet that it was deposed."""

    @abc.abstractmethod
    def delete_kv(self, key: str) -> None: ...

    def replace_kvs(self, items: Sequence[tuple[str, bytes | None, bytes]]) -> list[bool]:
        """`replace_kv` (no guard) of each (key, expected, value), in one transaction where the
        store can: each written only if its key holds `expected` (None: absent); which were,
        in order. A failover reassigns a dead node's partitions with it."""
        return [self.replace_kv(key, expected, value) for key, expected, value in items]

    @abc.abstractmethod
    def list_kv(self, prefix: str) -> dict[str, bytes]:
        """Every key starting with `prefix` and its value, keys ascending."""

    def kv_changes(self, prefixes: Sequence[str]) -> ChangeFeed:
        """A ChangeFeed for KV keys starting with any of `prefixes` (see ChangeFeed), and for
        commits: a commit that extends a stream notifies commit_key(stream id). Open it before
        reading the state it guards, so that no change in between goes unseen."""
        return ChangeFeed(prefixes)

    def close(self) -> None:
        pass

    def __enter__(self) -> "MetadataStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
