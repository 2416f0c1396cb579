"""An object store in a local directory: one file per object, written atomically.

Keys map to relative paths under the root ("a/b/c" -> root/a/b/c), so unlike S3 this store
cannot hold both a key "a" and keys under "a/". A put writes a temporary file
in the target's directory, fsyncs it, renames it over the target and fsyncs the directory, so a
reader sees no object or the whole of it, and a returned put survives a crash. A put_if_absent
writes its temporary file the same way and hard-links it to the key instead: the link fails if
the key exists, so of concurrent creators exactly one wins (the file system needs hard links).

With `recycle_bytes`, a delete moves the object's file into a pool (a reserved directory under
the root) instead of unlinking it, up to that many bytes, and a later put overwrites a pooled
file in place rather than creating one. A store with retention then reuses the pages or blocks
it freed instead of returning and allocating them again (see LocalObjectStore). With
`preallocate_bytes`, a background thread also writes a fresh file (zeros) ahead for each put,
of that put's size, into the same pool (holding at most that many bytes), so the next put of
about that size finds its pages allocated even in a store that never deletes: meant for a RAM
disk (tmpfs), where writing a page is what allocates it; on a disk it would write each object
twice.
"""
from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat
import threading
import time
import uuid
from collections import deque
from typing import Iterable, Iterator

from _native.walio import write_file_durably

from ..errors import ConfigError, ObjectNotFoundError, ObjectStoreError, ObjectStorePermanentError
from ..threads import normal_priority
from .base import (
    BytesLike, ObjectInfo, PutData, check_conditional_size, data_size, default_multipart_threshold,
)

MiB = 1024 * 1024

#: Temporary files start with this; list() skips them and keys may not use it.
TEMP_PREFIX = ".s3stream-tmp."
#: The pool of deleted objects' files kept for reuse (recycle_bytes), under the root.
POOL_DIR = TEMP_PREFIX + "pool"
#: How many recent put sizes the preallocating thread remembers (preallocate_bytes).
PREALLOCATE_WANTED = 64
#: The zeros the preallocating thread writes, and how many pieces of them one writev takes.
_ZEROS = bytes(256 * 1024)
IOV_PIECES = 256
#: Seconds close() waits for the preallocating thread to end (it may be writing one file).
PREALLOCATE_JOIN_TIMEOUT = 1.0


def check_key(key: str) -> None:
    """Raise ValueError unless `key` can name a file under the root."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty string, got {key!r}")
    if key.startswith("/") or os.path.isabs(key):
        raise ValueError(f"object key {key!r} is absolute; keys are relative like 'a/b/c'")
    if "\0" in key or "\\" in key:
        raise ValueError(f"object key {key!r} contains a NUL or backslash; use '/'-separated names")
    for part in key.split("/"):
        # Empty, "." and ".." segments would alias another key or escape the root.
        if part in ("", ".", ".."):
            raise ValueError(
                f"object key {key!r} has an empty, '.' or '..' segment; use names like 'a/b/c'")
        if part.startswith(TEMP_PREFIX):
            raise ValueError(f"object key {key!r}: segments starting {TEMP_PREFIX!r} are reserved")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_zeros(fd: int, size: int) -> None:
    """Write `size` zero bytes at the start of `fd` (pwritev of one shared zero buffer: one
    release of the GIL per IOV_PIECES pieces). Written, not fallocated: on tmpfs an fallocated
    page is allocated but not touched, and the first touch is the cost to move off the puts."""
    done = 0
    while done < size:
        pieces = min(IOV_PIECES, -(-(size - done) // len(_ZEROS)))
        last = size - done - (pieces - 1) * len(_ZEROS)
        iov = [memoryview(_ZEROS)] * (pieces - 1) + [memoryview(_ZEROS)[:last]]
        done += os.pwritev(fd, iov, done)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_create_error(e: OSError, path: str) -> bool:
    """Whether `e`, from write_file_durably, is its create of `path` failing (not its rename,
    whose error names two files, nor its directory fsync, which names the directory)."""
    return e.filename == path and e.filename2 is None


class LocalObjectStore:
    """ObjectStore on a directory (created if missing). `part_size` is only reported: local puts
    are single writes. Thread-safe: puts of one key race benignly (last rename wins).

    `recycle_bytes` (default 0: off) keeps up to that many bytes of deleted objects' files in a
    pool and overwrites them in place for later puts, best fit by size. On a RAM disk this turns
    a put into a copy into pages already owned, instead of allocating and zeroing fresh ones
    (and, on a VM that hands freed memory back to its host, instead of the host faulting them
    in again: 3.6-3.9 GB/s against 390-670 MB/s here, `tests/bench/store_first_touch.py`); on
    a disk it saves the block allocation. The pool costs its bytes of storage while it is
    full. A pooled file is reused only `recycle_delay` seconds after its delete, so a get that
    opened the object just before the delete still reads it whole. The bound counts this
    process's deletes; files pooled by a process that exited are reused or removed by the next
    store opened on the root.

    `preallocate_bytes` (default 0: off) has one background thread (started by the first put
    in each process, stopped by close()) write a fresh file for each put, as large as that put
    and written with zeros, ready at once, while the pool holds less than that many bytes. A
    put that finds one of about its size then pays for a copy, not an allocation, even when
    the store only grows: the cost of the allocation (on this VM, the host faulting in memory
    it was handed back) moves off the put's path, which is what a migration's close waits on
    (issue 28). The thread replaces what the puts take, one file per put; it does not fill the
    pool up to the bound (in a migration bench's node the pool held 2-6 MiB of 64, and 88 % of
    the closes' PUTs found a file of their size). Filling it, in the mix of recent sizes, was
    measured on 2026-11-28 and not kept: the closes' store calls took 0.52 ms on average
    instead of 0.55, the pool filled with the small objects' files unless they were left out,
    and every object was written twice. A put that finds no pooled file writes a new one as
    before. The files cost their bytes of storage; the next store opened on the root adopts
    them like recycled ones."""

    #: A put here is a copy on this machine's cores, not a wait on a network: the uploader keeps
    #: no more of them in flight than it has encoding threads (Config.put_concurrency is for
    #: stores whose PUTs wait, issue 51).
    cpu_bound_puts = True

    def __init__(self, root: str, part_size: int = 16 * MiB, multipart_threshold: int | None = None,
                 recycle_bytes: int = 0, recycle_delay: float = 1.0, preallocate_bytes: int = 0) -> None:
        if part_size <= 0:
            raise ConfigError(f"part_size must be positive, got {part_size}")
        if isinstance(recycle_bytes, bool) or not isinstance(recycle_bytes, int) or recycle_bytes < 0:
            raise ConfigError(f"recycle_bytes must be an int >= 0 (0 turns recycling off), got {recycle_bytes!r}")
        if isinstance(recycle_delay, bool) or not isinstance(recycle_delay, (int, float)) or not recycle_delay >= 0:
            raise ConfigError(f"recycle_delay must be a number of seconds >= 0, got {recycle_delay!r}")
        if isinstance(preallocate_bytes, bool) or not isinstance(preallocate_bytes, int) or preallocate_bytes < 0:
            raise ConfigError(
                f"preallocate_bytes must be an int >= 0 (0 turns preallocation off), got {preallocate_bytes!r}")
        # Reported like part_size, so request counts match what an S3 store would do.
        self.multipart_threshold = multipart_threshold or default_multipart_threshold(part_size)
        self.root = os.path.abspath(root)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot use {self.root!r} as an object store directory: {e}") from e
        self.part_size = part_size
        self.url = "file://" + self.root
        self._lock = threading.Lock()
        # Temporary names: this store's random token, the process (a forked child shares the
        # token and the count) and a count. Not uuid4 per put: os.urandom gives up the GIL, and
        # in a busy process each re-take of it can wait a switch interval.
        self._temp_token = uuid.uuid4().hex
        self._temp_count = itertools.count()
        # Directories whose entries are known durable; each new one is fsynced once, with its
        # parents, so the directory itself survives a crash.
        self._durable_dirs: set[str] = {self.root}
        self.recycle_bytes = recycle_bytes
        self.recycle_delay = float(recycle_delay)
        self._pool_dir = os.path.join(self.root, POOL_DIR)
        # (usable from, monotonic; path; size), in the order they were pooled.
        self._pool: deque[tuple[float, str, int]] = deque()
        self._pool_bytes = 0
        self.recycled = 0       # puts that overwrote a pooled file
        self.preallocate_bytes = preallocate_bytes
        self.preallocated = 0   # files the preallocating thread made
        # Sizes of recent puts, which the preallocating thread makes files of.
        self._wanted: deque[int] = deque(maxlen=PREALLOCATE_WANTED)
        self._filler_cond = threading.Condition(self._lock)
        self._filler: threading.Thread | None = None
        self._filler_pid = 0
        self._closed = False
        if recycle_bytes or preallocate_bytes:
            self._adopt_pool()

    def _adopt_pool(self) -> None:
        """Take over the files a previous store left in the pool (up to the bound; the rest are
        removed): deleted objects' files usable `recycle_delay` after they were pooled (their
        ctime: the rename), preallocated ones at once."""
        try:
            os.makedirs(self._pool_dir, exist_ok=True)
            names = sorted(os.listdir(self._pool_dir))
        except OSError as e:
            raise ConfigError(f"cannot use {self._pool_dir!r} as the store's recycling pool: {e}") from e
        offset = time.monotonic() - time.time()
        for name in names:
            path = os.path.join(self._pool_dir, name)
            try:
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    continue
                if self._pool_bytes + st.st_size > max(self.recycle_bytes, self.preallocate_bytes):
                    os.unlink(path)
                    continue
            except OSError:
                continue    # taken or removed by another store on the same root
            # A deleted object's file waits out recycle_delay; a preallocated one (named like
            # a temporary file) never held an object anyone reads.
            delay = 0.0 if name.startswith(TEMP_PREFIX) else self.recycle_delay
            self._pool.append((st.st_ctime + offset + delay, path, st.st_size))
            self._pool_bytes += st.st_size

    def _pool_take(self, size: int, into: str) -> int | None:
        """A pooled file renamed to `into` and opened for overwrite (its descriptor), or None."""
        while True:
            now = time.monotonic()
            with self._lock:
                best, best_key = None, None
                for i, (ready, path, length) in enumerate(self._pool):
                    if ready > now:
                        break   # ordered by readiness: the rest are younger
                    key = (0, length) if length >= size else (1, -length)  # smallest that fits, else largest
                    if best_key is None or key < best_key:
                        best, best_key = i, key
                if best is None:
                    return None
                _, path, length = self._pool[best]
                del self._pool[best]
                self._pool_bytes -= length
            try:
                os.rename(path, into)
                fd = os.open(into, os.O_WRONLY | os.O_CLOEXEC)
            except OSError:
                try:
                    os.unlink(into)
                except OSError:
                    pass
                continue    # another store on the root took it, or it is gone: try the next
            self.recycled += 1
            return fd

    def _want(self, size: int) -> None:
        """Ask the preallocating thread (started here if this process has none) for a file of
        `size` bytes, the size of a put just made."""
        if 0 < size <= self.preallocate_bytes:
            with self._lock:
                if self._closed:
                    return
                self._wanted.append(size)
                if self._filler_pid != os.getpid():       # none yet, or a forked child's parent's
                    self._filler_pid = os.getpid()
                    self._filler = threading.Thread(target=self._fill, name="s3stream-store-prealloc", daemon=True)
                    self._filler.start()
                self._filler_cond.notify()

    def _fill(self) -> None:
        """The preallocating thread: while the pool holds less than preallocate_bytes, make a
        file of the next wanted size. A write that fails (the file system is full) ends the
        thread; puts then allocate as they would without it. At the process's priority, though
        the first put may come from a node agent's thread (s3stream.threads)."""
        normal_priority()
        while True:
            with self._lock:
                # Every put notifies (after taking a pooled file, if it found one).
                while not self._closed and not (
                        self._wanted and self._pool_bytes + self._wanted[0] <= self.preallocate_bytes):
                    self._filler_cond.wait()
                if self._closed:
                    return
                size = self._wanted.popleft()
                self._pool_bytes += size                # reserved: concurrent deletes see it
            path = os.path.join(self._pool_dir, f"{TEMP_PREFIX}{self._temp_token}.{os.getpid()}."
                                                f"{next(self._temp_count)}")
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                try:
                    _write_zeros(fd, size)
                finally:
                    os.close(fd)
            except OSError:
                _unlink_quietly(path)
                with self._lock:
                    self._pool_bytes -= size
                return
            with self._lock:
                # Ready now: first, so the pool stays ordered by readiness (_pool_take).
                self._pool.appendleft((time.monotonic(), path, size))
                self.preallocated += 1

    def _pool_give(self, path: str) -> bool:
        """Move the object file at `path` into the pool if it fits; False if it was not."""
        try:
            st = os.lstat(path)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode):
            return False
        with self._lock:
            if self._pool_bytes + st.st_size > self.recycle_bytes:
                return False
            self._pool_bytes += st.st_size     # reserved before the rename: concurrent deletes
        dst = os.path.join(self._pool_dir, uuid.uuid4().hex)
        try:
            os.rename(path, dst)
        except OSError:
            with self._lock:
                self._pool_bytes -= st.st_size
            return False
        with self._lock:
            self._pool.append((time.monotonic() + self.recycle_delay, dst, st.st_size))
        return True

    def _path(self, key: str) -> str:
        check_key(key)
        return os.path.join(self.root, *key.split("/"))

    def _ensure_dir(self, directory: str) -> None:
        with self._lock:
            if directory in self._durable_dirs:
                return
        os.makedirs(directory, exist_ok=True)
        chain = []
        d = directory
        while d != self.root:
            chain.append(d)
            d = os.path.dirname(d)
        chain.append(self.root)
        for d in chain:
            _fsync_dir(d)
        with self._lock:
            self._durable_dirs.update(chain)

    def put(self, key: str, data: PutData) -> None:
        """Store `data` under `key` atomically and durably (a Gathered object from its pieces,
        with writev: no join)."""
        path = self._path(key)
        directory = os.path.dirname(path)
        with self._write_errors("put", key):
            # The rename is durable only once the directory entry is: fsynced in the same call.
            self._write_temp(directory, data, rename_to=path)

    def put_if_absent(self, key: str, data: BytesLike) -> bool:
        """Store `data` under `key` only if no object has that key: True if this call created
        it, False if the key was taken. The whole object is written and fsynced under a
        temporary name, then hard-linked to the key (the link fails if the key exists: atomic
        against every other creator, on this host or another that shares the directory)."""
        path = self._path(key)
        check_conditional_size(data_size(data), self.multipart_threshold, self.url)
        directory = os.path.dirname(path)
        with self._write_errors("put_if_absent", key):
            tmp = self._write_temp(directory, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                try:
                    taken_by_directory = stat.S_ISDIR(os.lstat(path).st_mode)
                except FileNotFoundError:
                    taken_by_directory = False      # deleted since: it did exist
                if taken_by_directory:
                    raise ObjectStoreError(
                        f"local put_if_absent of {key!r} in {self.url} failed: a directory cannot also be "
                        f"an object, so this store cannot hold both a key and keys under it + '/'") from None
                return False
            except OSError as e:
                if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise ObjectStorePermanentError(
                        f"local put_if_absent of {key!r} in {self.url} failed: the file system refused a hard "
                        f"link ({e}); conditional creates need one that supports them") from e
                raise
            finally:
                _unlink_quietly(tmp)                # the key keeps the file
            _fsync_dir(directory)
            return True

    def _write_temp(self, directory: str, data: PutData, rename_to: str | None = None) -> str:
        """A temporary file in `directory` (made durable first) holding `data`, fsynced: a
        recycled file if the pool has one, else a new one. Removed again if writing fails.
        With `rename_to`, renamed to that path in `directory` and the directory fsynced too.
        The writes, syncs and rename happen in one native call without the GIL: in a process
        whose other threads keep the GIL busy, each re-take of it can cost a switch interval."""
        tmp = os.path.join(directory, f"{TEMP_PREFIX}{self._temp_token}.{os.getpid()}.{next(self._temp_count)}")
        sync_dir = directory if rename_to is not None else None
        writing = False
        try:
            self._ensure_dir(directory)
            fd = self._pool_take(data_size(data), tmp) if self._pool else None
            if self.preallocate_bytes:
                self._want(data_size(data))
            writing = True
            write_file_durably(tmp, data, -1 if fd is None else fd, rename_to, sync_dir)
        except FileNotFoundError as e:
            if writing and not _is_create_error(e, tmp):
                raise
            # The directory vanished behind our back (removed externally): forget and retry.
            with self._lock:
                self._durable_dirs = {self.root}
            self._ensure_dir(directory)
            write_file_durably(tmp, data, -1, rename_to, sync_dir)
        return tmp

    @contextlib.contextmanager
    def _write_errors(self, op: str, key: str) -> Iterator[None]:
        """Map OSErrors of a write to the store's errors."""
        try:
            yield
        except (FileExistsError, NotADirectoryError, IsADirectoryError) as e:
            # Files and directories share one namespace; S3 keys do not.
            raise ObjectStoreError(
                f"local {op} of {key!r} in {self.url} failed: a directory cannot also be an object, "
                f"so this store cannot hold both a key and keys under it + '/' ({e})") from e
        except OSError as e:
            if isinstance(e, PermissionError) or e.errno == errno.EROFS:
                raise ObjectStorePermanentError(
                    f"local {op} of {key!r} in {self.url} was refused: {e}; make the directory writable "
                    "by this process (retrying cannot help)") from e
            raise ObjectStoreError(f"local {op} of {key!r} in {self.url} failed: {e}") from e

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes [start, end) of the object, clipped to its size."""
        check_range(start, end)
        path = self._path(key)
        if end is not None and start == end:
            return b""
        try:
            with open(path, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise IsADirectoryError(path)
                f.seek(start)
                return f.read() if end is None else f.read(end - start)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
            raise ObjectNotFoundError(f"no object {key!r} in {self.url}") from e
        except OSError as e:
            raise ObjectStoreError(f"local get of {key!r} in {self.url} failed: {e}") from e

    def size(self, key: str) -> int:
        """Size in bytes; ObjectNotFoundError if missing."""
        path = self._path(key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError) as e:
            raise ObjectNotFoundError(f"no object {key!r} in {self.url}") from e
        except OSError as e:
            raise ObjectStoreError(f"local size of {key!r} in {self.url} failed: {e}") from e
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFoundError(f"no object {key!r} in {self.url}")
        return st.st_size

    def delete(self, keys: Iterable[str]) -> None:
        """Remove the objects; missing keys are ignored. Empty directories are left in place
        (removing them would race with a concurrent put into them)."""
        for key in keys:
            path = self._path(key)
            if self.recycle_bytes and self._pool_give(path):
                continue
            try:
                os.unlink(path)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                pass
            except OSError as e:
                raise ObjectStoreError(f"local delete of {key!r} in {self.url} failed: {e}") from e

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """ObjectInfo of every object whose key starts with `prefix`, keys ascending."""
        # Only the deepest directory that the prefix fully names needs walking.
        base_key = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        if base_key:
            try:
                check_key(base_key)
            except ValueError:
                return  # no valid key starts so (and "../" must not walk outside the root)
        base = os.path.join(self.root, *base_key.split("/")) if base_key else self.root
        found: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(base):
            rel = os.path.relpath(dirpath, self.root)
            key_dir = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            # Prune subtrees that cannot hold a matching key.
            dirnames[:] = [d for d in dirnames
                           if not d.startswith(TEMP_PREFIX) and _may_match(key_dir + d + "/", prefix)]
            for name in filenames:
                key = key_dir + name
                if name.startswith(TEMP_PREFIX) or not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # deleted while we walked
                if stat.S_ISREG(st.st_mode):
                    found.append(ObjectInfo(key, st.st_size))
        found.sort()
        yield from found

    def close(self) -> None:
        """Stop the preallocating thread (waiting up to PREALLOCATE_JOIN_TIMEOUT); the pool stays on
        disk for the next store on the root."""
        with self._lock:
            self._closed = True
            self._filler_cond.notify_all()
            filler = self._filler if self._filler_pid == os.getpid() else None
        if filler is not None:
            filler.join(PREALLOCATE_JOIN_TIMEOUT)

    def __repr__(self) -> str:
        return f"LocalObjectStore({self.root!r})"


def _may_match(dir_key: str, prefix: str) -> bool:
    return dir_key.startswith(prefix) or prefix.startswith(dir_key)


def check_range(start: int, end: int | None) -> None:
    """Raise ValueError unless 0 <= start <= end (end=None: to the end of the object)."""
    if start < 0 or (end is not None and end < start):
        raise ValueError(f"invalid byte range [{start}, {end}): need 0 <= start <= end")
