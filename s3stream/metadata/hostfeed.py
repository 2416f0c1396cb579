"""KV changes pushed between the processes of one host, for the SQLite store.

SQLite has no LISTEN/NOTIFY, and its database is shared only by the processes of one machine,
so those processes tell each other directly. Every change feed binds a UNIX datagram socket in
a directory that belongs to the database file (under the temporary directory, named by a hash
of the file's real path); every KV write that commits sends its key to each socket there. A
waiting feed wakes when a key under its prefixes arrives.

As with PostgreSQL, a wake-up only says "look again": callers re-read what they care about,
and keep a fallback poll (push_fallback_interval), so a lost datagram costs one such interval,
never a decision. Datagrams between UNIX sockets are not dropped silently: a receiver whose
queue is full makes the send fail (EAGAIN), and a receiver with a full queue has wake-ups
pending anyway. A socket left by a process that died refuses the send (ECONNREFUSED) and is
removed by the sender; the last feed to close removes the directory. Where no socket can be made (a temporary directory whose path is too
long for a socket address, no permission), `HostNotifier.feed` returns a feed that does not
push, and callers poll as before.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import select
import socket
import tempfile
import threading
import time
import uuid
from typing import Iterable, Sequence

from .base import ChangeFeed

log = logging.getLogger(__name__)

#: Longest path a UNIX socket address holds on Linux (sun_path is 108 bytes with its NUL).
MAX_SOCKET_PATH = 107
#: Bytes of a key a datagram carries (prefixes are far shorter; keys are short anyway).
MAX_PAYLOAD = 1024
#: Bytes of keys one datagram carries, keys separated by NUL. A write of more keys (a failover's
#: reassignment of 10,000) sends, instead, their first path segments ("assignment/"), each
#: after SEGMENT: one datagram per feed and write, not one per key (each a wake-up of its
#: process, and 10,000 of them filled the sender's buffer).
DATAGRAM_BYTES = 16 << 10
#: Marks an entry that stands for every key under it (a path segment, "assignment/").
SEGMENT = b"\x01"
#: What a feed reads of a datagram at most (above DATAGRAM_BYTES: never cut).
RECEIVE_BYTES = 64 << 10
SUFFIX = ".sock"


def feed_directory(db_path: str) -> str:
    """The directory holding the sockets of every feed on the database file `db_path`."""
    digest = hashlib.sha256(os.path.realpath(db_path).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"s3stream-kv-{digest}")


def segments(keys: Iterable[str]) -> list[str]:
    """The distinct first path segments of `keys` (each up to and including its first "/", a
    key without one whole), each marked SEGMENT: what a write of many keys sends instead of
    them (the PostgreSQL store's notices too)."""
    mark = SEGMENT.decode()
    return list(dict.fromkeys(mark + (key[:key.index("/") + 1] if "/" in key else key) for key in keys))


def pack_keys(keys: Iterable[str]) -> bytes:
    """One datagram for a write of `keys` (each cut to MAX_PAYLOAD bytes): the keys, NUL
    between them, if they fit in DATAGRAM_BYTES; else their `segments`. Empty if there are no
    keys."""
    keys = list(keys)
    raw = [key.encode()[:MAX_PAYLOAD] for key in keys]
    if sum(len(k) + 1 for k in raw) <= DATAGRAM_BYTES + 1:
        return b"\0".join(raw)
    return b"\0".join(segment.encode()[:MAX_PAYLOAD] for segment in segments(keys))


def names_any(payload: bytes, prefixes: tuple[bytes, ...]) -> bool:
    """Whether a datagram names a key under `prefixes`: one of its keys, or one of its segments
    (every key under it) that a prefix starts with, or that starts with a prefix."""
    for entry in payload.split(b"\0"):
        if entry.startswith(SEGMENT):
            segment = entry[len(SEGMENT):]
            if segment.startswith(prefixes) or any(p.startswith(segment) for p in prefixes):
                return True
        elif entry.startswith(prefixes):
            return True
    return False


class HostNotifier:
    """The sending side, one per store: `notify(key)` after a KV write committed."""

    def __init__(self, db_path: str) -> None:
        self.directory = feed_directory(db_path)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def notify(self, key: str) -> None:
        """Send `key` to every feed on this database (best effort: errors are only logged)."""
        self.notify_many((key,))

    def notify_many(self, keys: Iterable[str]) -> None:
        """Send `keys` to every feed on this database, as many to a datagram as DATAGRAM_BYTES
        holds (one listing of the directory for all)."""
        keys = list(keys)
        if not keys:
            return
        payload = pack_keys(keys)
        try:
            names = os.listdir(self.directory)
        except OSError:
            return                          # no feed was ever made on this database
        for name in names:
            if name.endswith(SUFFIX):
                self._send(os.path.join(self.directory, name), payload)

    def _send(self, path: str, payload: bytes) -> None:
        with self._lock:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            sock = self._sock
        try:
            sock.sendto(payload, path)
        except BlockingIOError:
            pass                            # its queue is full: it has wake-ups pending
        except (ConnectionRefusedError, FileNotFoundError):
            # Left by a process that died (or closed just now): nobody listens there.
            with contextlib.suppress(OSError):
                os.unlink(path)
        except OSError as e:
            log.debug("KV change not sent to %s: %s", path, e)

    def feed(self, prefixes: Sequence[str]) -> ChangeFeed:
        """A feed woken by KV writes under `prefixes` from any process of this host; a polling
        feed (pushes False) where no socket can be bound."""
        try:
            return HostChangeFeed(self.directory, prefixes)
        except OSError as e:
            log.warning("KV changes on this host cannot be pushed (%s): agents poll instead", e)
            return ChangeFeed(prefixes)

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class HostChangeFeed(ChangeFeed):
    """A feed bound to a socket of its own in the database's feed directory (see the module
    docstring). `wake` sends an empty datagram to it, so a waiting `wait` returns at once."""

    pushes = True

    def __init__(self, directory: str, prefixes: Sequence[str]) -> None:
        super().__init__(prefixes)
        self.path = os.path.join(directory, f"{os.getpid()}-{uuid.uuid4().hex[:12]}{SUFFIX}")
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
            raise OSError(errno.ENAMETOOLONG, f"socket path {self.path!r} is longer than {MAX_SOCKET_PATH} bytes")
        self._directory = directory
        self._prefixes = tuple(p.encode() for p in self.prefixes)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            for attempt in range(3):
                os.makedirs(directory, mode=0o700, exist_ok=True)
                try:
                    self._sock.bind(self.path)
                    break
                except FileNotFoundError:
                    if attempt == 2:    # the last feed's close removed the directory meanwhile: again
                        raise
            self._sock.setblocking(False)
        except OSError:
            self._sock.close()
            raise
        self._closed = False

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._closed:
            if self._woken.is_set():
                self._woken.clear()
                self._drain()               # the wake's own datagram
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                ready, _, _ = select.select([self._sock], [], [], left)
            except (OSError, ValueError):
                return True                 # closed under us
            if ready and self._drain():
                return True
        return True

    def _drain(self) -> bool:
        """Read every queued datagram; True if one named a key under the prefixes."""
        hit = False
        while True:
            try:
                payload = self._sock.recv(RECEIVE_BYTES)
            except (BlockingIOError, OSError):
                return hit
            hit = hit or names_any(payload, self._prefixes)

    def wake(self) -> None:
        super().wake()
        with contextlib.suppress(OSError):
            self._sock.sendto(b"", self.path)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        super().close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self._directory)       # the last feed on this database leaves nothing behind
        self._sock.close()
