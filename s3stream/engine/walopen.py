"""Where a node's WAL lives: `wal_path` as a path or a URL, opened as a file ring or as objects.

- a path, or `file:///abs/path`: the ring on a file or block device (`wal.WriteAheadLog`);
  anything else that looks like a URL (`http://...`, `s3:/bucket`) is refused (s3stream.urls);
- `s3://bucket[/prefix][?...]`: a WAL kept as objects on that store (`wal.objectlog.ObjectWAL`),
  with the URL form and options of `object_store` (endpoint_url, region, timeouts...). The
  node's objects go under `prefix/node-{id}/`, so one URL serves every node;
- `objects+URL`: a WAL of objects on the store at any object store URL, e.g.
  `objects+file:///shared/wal` (a local or network directory; tests and benchmarks);
- an ObjectStore instance: a WAL of objects on it (registered as `objects+` its URL).

A WAL of objects needs a store that honours conditional writes (put-if-absent); add
`wal_fencing=epoch` to the URL's query to accept one that does not: every PUT is then
followed, before its records are acknowledged, by a read of the node's epoch in the metadata
(a weaker promise, docs/wal-format.md).
"""
from __future__ import annotations

import os
from typing import Any, Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import wal
from wal.objectlog import HostLock, ObjectWAL

from ..errors import ConfigError, ObjectStorePermanentError
from ..objectstore import ObjectStore, open_object_store
from ..urls import OBJECTS_PREFIX, url_scheme

_ACCEPTED = "a path, file:///absolute/path, s3://bucket[/prefix][?...] or objects+URL (e.g. objects+file:///dir)"
_WAL_PARAMS = ("wal_fencing",)
_FENCING = ("store", "epoch")


def is_object_wal(location: Any) -> bool:
    if isinstance(location, str):
        return location.startswith(OBJECTS_PREFIX) or location.lower().startswith("s3://")
    return not isinstance(location, os.PathLike) and callable(getattr(location, "put_if_absent", None))


def file_path(location: str | os.PathLike) -> str:
    """The absolute path of a file WAL location (a path or file:///path). ConfigError for
    anything else that looks like a URL (`http://...`, `s3:/bucket`: s3stream.urls), which
    would otherwise become a relative path."""
    text = os.fspath(location)
    # s3 is named here so that a malformed s3 URL is told so; a well-formed one is no file.
    scheme = url_scheme(text, what="WAL location", schemes=("file", "s3"), accepted=_ACCEPTED)
    if scheme == "s3":
        raise ConfigError(f"WAL location {text!r} is a WAL of objects, not a file path")
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise ConfigError(f"WAL URL {text!r}: use file:///absolute/path (no host, query or fragment)")
        text = parts.path
    return os.path.abspath(text)


def registered_location(location: Any) -> str:
    """What metadata records as the node's WAL (peers reopen it from there to fail it over)."""
    if is_object_wal(location):
        if isinstance(location, str):
            return location
        return OBJECTS_PREFIX + location.url
    return file_path(location)


def _split(url: str) -> tuple[str, dict[str, str]]:
    """The store URL and the WAL's own options of an object WAL URL."""
    store_url = url[len(OBJECTS_PREFIX):] if url.startswith(OBJECTS_PREFIX) else url
    parts = urlsplit(store_url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    own = {k: v for k, v in query if k in _WAL_PARAMS}
    rest = [(k, v) for k, v in query if k not in _WAL_PARAMS]
    fencing = own.get("wal_fencing", "store")
    if fencing not in _FENCING:
        raise ConfigError(f"wal_fencing={fencing!r} in WAL URL {url!r}: use store (put-if-absent, the default) or "
                          "epoch (for a store that ignores conditional writes)")
    return urlunsplit(parts._replace(query=urlencode(rest))), own


# ---- what differs between a file WAL and a WAL of objects, decided here only ----------------------

def check_location(location: Any) -> None:
    """ConfigError for a `wal_path` that is neither a path, a URL nor an ObjectStore."""
    if not is_object_wal(location) and not isinstance(location, (str, os.PathLike)):
        raise ConfigError(f"wal_path must be a path, a URL (file:///..., s3://bucket/prefix, objects+URL) or an "
                          f"ObjectStore, got {location!r} ({type(location).__name__})")


def claim(location: str, node_id: int) -> HostLock | None:
    """Before node `node_id` registers with its WAL at `location` (registered_location): refuse
    a second instance of it on this host, before a new epoch fences the running one and loses
    what it has not uploaded. A file WAL's own lock says so (wal.WALInUseError; two starting at
    the same instant: it still stops the second, after the bump), and its directory must be
    writable (ConfigError); a WAL of objects gets a lock file per node and location, returned to
    be held while the client lives. Instances on other hosts are fenced by the store."""
    if is_object_wal(location):
        return HostLock.acquire(location, node_id)
    wal.WriteAheadLog.check_not_in_use(location)
    _check_file_location(location)
    return None


def prepare(location: str, config: wal.WALConfig) -> None:
    """The slow part of a new file WAL (zero-filling it), before the node registers: a node
    registered but silent for longer than the heartbeat timeout is failed over by its peers (4
    nodes zero-filling 512 MiB each at once took over 5 s). Nothing for a WAL of objects."""
    if not is_object_wal(location):
        wal.WriteAheadLog.preallocate(location, config)


def same_wal(a: str, b: str) -> bool:
    """Whether two registered locations name one WAL (file paths: the same file)."""
    if a == b:
        return True
    if is_object_wal(a) or is_object_wal(b):
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_not_in_use_here(location: str) -> None:
    """wal.WALInUseError if a process of this host has the file WAL at `location` open (a WAL of
    objects is fenced by its store instead: nothing to check here)."""
    if not is_object_wal(location):
        wal.WriteAheadLog.check_not_in_use(location)


def readable_here(location: str) -> bool:
    """Whether this host can read the WAL at `location`: a WAL of objects from anywhere, a file
    WAL only where its file is."""
    return is_object_wal(location) or os.path.exists(file_path(location))


def opened_before_fence(location: str) -> bool:
    """Failover's order: a WAL file is opened before its node is fenced (one that cannot be read
    must not leave the node fenced with its streams open and nobody to replay them); a WAL of
    objects after (opening writes its own fence into the store, which a node found alive must
    not get)."""
    return not is_object_wal(location)


def _check_file_location(location: str) -> None:
    """ConfigError, before anything is registered, for a WAL path that cannot be created: its
    directory is missing or not writable (a raw FileNotFoundError came out of open before)."""
    path = os.path.abspath(os.fspath(location))
    if os.path.exists(path):
        return
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ConfigError(f"cannot create the WAL {path!r}: its directory {parent!r} does not exist; create it "
                          "or give another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot create the WAL {path!r}: its directory {parent!r} is not writable by this "
                          "process; fix its permissions or give another path")


def open_store(location: Any) -> tuple[ObjectStore, bool, dict[str, str]]:
    """(store, whether the caller owns it, WAL options) of an object WAL location."""
    if not isinstance(location, str):
        return location, False, {}
    store_url, own = _split(location)
    try:
        return open_object_store(store_url), True, own
    except ConfigError as e:
        raise ConfigError(f"WAL {location!r}: {e}") from e


def open_node_wal(location: Any, *, node_id: int, node_epoch: int = 0, config: wal.WALConfig | None = None,
                  recovery: bool = False, epoch_check: Callable[[], None] | None = None):
    """Open node `node_id`'s WAL at `location` (module docstring). A WAL of objects closes the
    store it opened when the WAL closes. `epoch_check` raises once the node was fenced: used
    after every PUT when the URL says `wal_fencing=epoch`."""
    if not is_object_wal(location):
        return wal.WriteAheadLog.open(file_path(location), node_id=node_id, node_epoch=node_epoch, config=config,
                                      recovery=recovery)
    store, owned, own = open_store(location)
    weak = own.get("wal_fencing") == "epoch"
    try:
        w = ObjectWAL.open(store, node_id=node_id, node_epoch=node_epoch, config=config, recovery=recovery,
                           conditional_writes=not weak, ack_check=epoch_check if weak else None,
                           permanent_errors=(ObjectStorePermanentError,))
    except BaseException:
        if owned:
            store.close()
        raise
    if owned:
        w.on_close(store.close)
    return w


def epoch_checker(meta, node_id: int, node_epoch: int) -> Callable[[], None]:
    """For `wal_fencing=epoch`: raise wal.WALFencedError once node `node_id` has a newer epoch or
    was failed over."""
    def check() -> None:
        node = meta.get_node(node_id)
        if node.node_epoch != node_epoch or node.failover:
            raise wal.WALFencedError(f"node {node_id} at epoch {node_epoch} was fenced (now epoch {node.node_epoch}"
                                     f"{', failed over' if node.failover else ''}): its WAL PUT is not acknowledged")
    return check
