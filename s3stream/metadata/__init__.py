"""Cluster metadata: the model and MetadataStore contract (base), its SQLite and PostgreSQL
implementations, and `open_metadata(url)` to pick an implementation from a URL."""
from __future__ import annotations

import os
import re

from ..errors import ConfigError
from ..urls import url_scheme
from .base import (CommitRange, CommitRequest, CommitResult, CommitSSO, CommitStreamObject,
                   ChangeFeed, MetadataStore, NodeMeta, ObjectMeta, ObjectRef, ObjectState, ObjectType, Range,
                   StreamMeta, StreamRange, StreamState, commit_key, object_key, redact_url, tailing_key)
from .sqlite import SqliteMetadataStore


def __getattr__(name: str):
    # PostgresMetadataStore is imported on first use: SQLite users need no psycopg.
    if name == "PostgresMetadataStore":
        return _postgres_store_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _postgres_store_class() -> type:
    try:
        from .postgres import PostgresMetadataStore
    except ImportError as e:
        raise ConfigError(f"PostgreSQL metadata needs psycopg 3 and psycopg_pool ({e}); install them with "
                          f'pip install "psycopg[binary]" psycopg-pool') from e
    return PostgresMetadataStore


_SUPPORTED = ("sqlite:////absolute/path.db, sqlite:///relative/path.db, a file path ending in "
              ".db, or postgresql://user:password@host:port/dbname (postgres:// too)")


def open_metadata(url: str, *, create: bool = True, **kw) -> MetadataStore:
    """The MetadataStore for `url`; keyword arguments go to the store's constructor.

    As in SQLAlchemy, `sqlite:///` is followed by the path: `sqlite:////var/lib/m.db` is
    absolute, `sqlite:///m.db` relative to the working directory. `postgresql://` and
    `postgres://` URLs (libpq's syntax) open a PostgresMetadataStore on that database; psycopg is
    imported only then. Through PgBouncer in transaction mode add `?pgbouncer=1` (and optionally
    `listen_url=`, a direct URL for pushed changes): see PostgresMetadataStore.

    `create`: a SQLite file that does not exist is created (its directory must exist); with
    False it is refused instead (tools that read an existing cluster). A PostgreSQL database is
    never created. ConfigError for anything else that looks like a URL (`postgresql:/host`,
    `sqlite://x.db`: s3stream.urls), and for a SQLite file that cannot be opened, naming its
    path, whether its directory exists, and the URL forms.
    """
    url = os.fspath(url)
    shown = _redacted(url)
    scheme = url_scheme(url, what="metadata URL", schemes=("sqlite", "postgresql", "postgres"), accepted=_SUPPORTED,
                        shown=shown)
    if scheme == "sqlite":
        rest = url[len("sqlite:"):]
        if not rest.startswith("///") or rest == "///":
            raise ConfigError(f"metadata URL {shown!r} names no file (in-memory and remote SQLite are not "
                              "supported): the path comes after three slashes, sqlite:////absolute/path.db (four "
                              "in all) or sqlite:///relative/path.db")
        return SqliteMetadataStore(rest[len("///"):], create=create, **kw)
    if scheme in ("postgresql", "postgres"):
        return _postgres_store_class()(url, **kw)
    if url.endswith(".db"):
        return SqliteMetadataStore(url, create=create, **kw)
    raise ConfigError(f"unsupported metadata URL {shown!r}; use {_SUPPORTED}")


def _redacted(url: str) -> str:
    """redact_url, also for a malformed URL (`postgresql:/user:secret@host`) whose user info
    redact_url does not find."""
    url = redact_url(url)
    return url if "://" in url else re.sub(r":[^:@/]*@", ":***@", url)


__all__ = [
    "ChangeFeed", "CommitRange", "CommitRequest", "CommitResult", "CommitSSO", "CommitStreamObject",
    "MetadataStore", "NodeMeta", "ObjectMeta", "ObjectRef", "ObjectState", "ObjectType",
    "PostgresMetadataStore", "Range", "SqliteMetadataStore", "StreamMeta", "StreamRange",
    "StreamState", "commit_key", "object_key", "open_metadata", "redact_url", "tailing_key",
]
