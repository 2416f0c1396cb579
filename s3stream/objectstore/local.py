"""An object store in a local directory: one file per object, written atomically.

Keys map to relative paths under the root ("a/b/c" -> root/a/b/c), so unlike S3 this store
cannot hold both a key "a" and keys under "a/". A put writes a temporary file
in the target's directory, fsyncs it, renames it over the target and fsyncs the directory, so a
reader sees no object or the whole of it, and a returned put survives a crash.
"""
from __future__ import annotations

import errno
import os
import stat
import threading
import uuid
from typing import Iterable, Iterator

from ..errors import ConfigError, ObjectNotFoundError, ObjectStoreError, ObjectStorePermanentError
from .base import ObjectInfo, default_multipart_threshold

MiB = 1024 * 1024

#: Temporary files start with this; list() skips them and keys may not use it.
TEMP_PREFIX = ".s3stream-tmp."


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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalObjectStore:
    """ObjectStore on a directory (created if missing). `part_size` is only reported: local puts
    are single writes. Thread-safe: puts of one key race benignly (last rename wins)."""

    def __init__(self, root: str, part_size: int = 16 * MiB, multipart_threshold: int | None = None) -> None:
        if part_size <= 0:
            raise ConfigError(f"part_size must be positive, got {part_size}")
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
        # Directories whose entries are known durable; each new one is fsynced once, with its
        # parents, so the directory itself survives a crash.
        self._durable_dirs: set[str] = {self.root}

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

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store `data` under `key` atomically and durably."""
        path = self._path(key)
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, TEMP_PREFIX + uuid.uuid4().hex)
        try:
            try:
                self._ensure_dir(directory)
                f = open(tmp, "xb")
            except FileNotFoundError:
                # The directory vanished behind our back (removed externally): forget and retry.
                with self._lock:
                    self._durable_dirs = {self.root}
                self._ensure_dir(directory)
                f = open(tmp, "xb")
            try:
                with f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            # The rename is durable only once the directory entry is.
            _fsync_dir(directory)
        except (FileExistsError, NotADirectoryError, IsADirectoryError) as e:
            # Files and directories share one namespace; S3 keys do not.
            raise ObjectStoreError(
                f"local put of {key!r} in {self.url} failed: a directory cannot also be an object, "
                f"so this store cannot hold both a key and keys under it + '/' ({e})") from e
        except OSError as e:
            if isinstance(e, PermissionError) or e.errno == errno.EROFS:
                raise ObjectStorePermanentError(
                    f"local put of {key!r} in {self.url} was refused: {e}; make the directory writable "
                    "by this process (retrying cannot help)") from e
            raise ObjectStoreError(f"local put of {key!r} in {self.url} failed: {e}") from e

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
                           if _may_match(key_dir + d + "/", prefix)]
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
        """Nothing to release; present for the interface."""

    def __repr__(self) -> str:
        return f"LocalObjectStore({self.root!r})"


def _may_match(dir_key: str, prefix: str) -> bool:
    return dir_key.startswith(prefix) or prefix.startswith(dir_key)


def check_range(start: int, end: int | None) -> None:
    """Raise ValueError unless 0 <= start <= end (end=None: to the end of the object)."""
    if start < 0 or (end is not None and end < start):
        raise ValueError(f"invalid byte range [{start}, {end}): need 0 <= start <= end")
