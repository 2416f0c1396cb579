"""Cluster metadata: the model and MetadataStore contract (base), its SQLite implementation, and
`open_metadata(url)` to pick an implementation from a URL."""
from __future__ import annotations

import os

from ..errors import ConfigError
from .base import (CommitRange, CommitRequest, CommitResult, CommitSSO, CommitStreamObject,
                   MetadataStore, NodeMeta, ObjectMeta, ObjectRef, ObjectState, ObjectType, Range,
                   StreamMeta, StreamRange, StreamState, object_key)
from .sqlite import SqliteMetadataStore

_SUPPORTED = ("sqlite:////absolute/path.db, sqlite:///relative/path.db, a file path ending in "
              ".db, or postgresql://... (not implemented yet)")


def open_metadata(url: str, **kw) -> MetadataStore:
    """The MetadataStore for `url`; keyword arguments go to the store's constructor.

    As in SQLAlchemy, `sqlite:///` is followed by the path: `sqlite:////var/lib/m.db` is
    absolute, `sqlite:///m.db` relative to the working directory.
    """
    url = os.fspath(url)
    if url.startswith("sqlite:"):
        if not url.startswith("sqlite:///") or len(url) == len("sqlite:///"):
            raise ConfigError(f"metadata URL {url!r} names no file (in-memory and remote SQLite "
                              f"are not supported); use {_SUPPORTED}")
        return SqliteMetadataStore(url[len("sqlite:///"):], **kw)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme.startswith("postgres"):
        raise ConfigError("PostgreSQL metadata is not implemented yet")
    if not scheme and url.endswith(".db"):
        return SqliteMetadataStore(url, **kw)
    raise ConfigError(f"unsupported metadata URL {url!r}; use {_SUPPORTED}")


__all__ = [
    "CommitRange", "CommitRequest", "CommitResult", "CommitSSO", "CommitStreamObject",
    "MetadataStore", "NodeMeta", "ObjectMeta", "ObjectRef", "ObjectState", "ObjectType", "Range",
    "SqliteMetadataStore", "StreamMeta", "StreamRange", "StreamState", "object_key",
    "open_metadata",
]
