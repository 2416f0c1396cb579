"""Object stores: the ObjectStore interface, its local-directory and S3 implementations, the
instrumenting and fault-injecting wrappers, `open_object_store(url)` to pick one by URL, and
`probe_conditional_put(store)` to tell whether a store honours put_if_absent."""
from __future__ import annotations

from typing import Any, Mapping
from urllib.parse import parse_qs, unquote, urlsplit

from ..errors import ConfigError
from ..urls import url_scheme
from .base import ObjectInfo, ObjectStore, probe_conditional_put
from .local import LocalObjectStore
from .s3 import S3ObjectStore
from .wrappers import FaultInjectingObjectStore, InstrumentedObjectStore

# URL query parameter -> (constructor argument, parser)
_S3_PARAMS = {
    "multipart_threshold": ("multipart_threshold", int),
    "endpoint_url": ("endpoint_url", str),
    "region": ("region_name", str),
    "part_size": ("part_size", int),
    "max_concurrency": ("max_concurrency", int),
    "max_attempts": ("max_attempts", int),
    "connect_timeout": ("connect_timeout", float),
    "read_timeout": ("read_timeout", float),
}
_FILE_PARAMS = {"part_size": ("part_size", int), "multipart_threshold": ("multipart_threshold", int),
                "recycle_bytes": ("recycle_bytes", int), "recycle_delay": ("recycle_delay", float),
                "preallocate_bytes": ("preallocate_bytes", int)}
_ACCEPTED = "file:///absolute/path, a plain directory path, s3://bucket[/prefix]"
_TRUE = {"1", "true", "yes"}
_FALSE = {"0", "false", "no"}


def open_object_store(url: str, **kw: Any) -> ObjectStore:
    """Open the object store at `url`:

    - "file:///abs/path[?part_size=...&multipart_threshold=...&recycle_bytes=...&recycle_delay=...
      &preallocate_bytes=...]"
      or a plain directory path: a LocalObjectStore (the directory is created);
    - "s3://bucket[/prefix][?endpoint_url=...&region=...&part_size=...&max_concurrency=...
      &max_attempts=...&connect_timeout=...&read_timeout=...&create_bucket=1]": an S3ObjectStore.
      The bucket must exist unless create_bucket=1, which creates it if missing.

    Keyword arguments go to the store's constructor and override the URL's query parameters.
    Raises ConfigError for an unsupported scheme, anything else that looks like a URL
    (`s3:/bucket`, `s3//bucket`: s3stream.urls says what does), unknown or malformed parameters,
    or a missing bucket. A directory whose name looks like a URL is named `./s3:/...`.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"object store URL {url!r} is empty or not a string; use {_ACCEPTED}")
    scheme = url_scheme(url, what="object store URL", schemes=("file", "s3"), accepted=_ACCEPTED)
    if scheme is None:
        return LocalObjectStore(url, **kw)
    parts = urlsplit(url)
    if parts.fragment:
        raise ConfigError(f"object store URL {url!r} has a fragment ('#...'); remove it")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(
                f"file URL {url!r} names host {parts.netloc!r}; use file:///absolute/path "
                f"(three slashes) or a plain path")
        args = _parse_query(url, parts.query, _FILE_PARAMS, allowed_flags=())
        args.update(kw)
        return LocalObjectStore(unquote(parts.path), **args)
    if not parts.netloc:                        # s3, the only other scheme url_scheme lets through
        raise ConfigError(f"S3 URL {url!r} has no bucket; use s3://bucket[/prefix]")
    args = _parse_query(url, parts.query, _S3_PARAMS, allowed_flags=("create_bucket",))
    create = args.pop("create_bucket", False)
    args.update(kw)
    create = bool(args.pop("create_bucket", create))
    store = S3ObjectStore(parts.netloc, unquote(parts.path).strip("/"), **args)
    try:
        store.ensure_bucket(create=create)
    except BaseException:
        store.close()
        raise
    return store


def _parse_query(url: str, query: str, params: Mapping[str, tuple[str, type]],
                 allowed_flags: tuple[str, ...]) -> dict[str, Any]:
    values = parse_qs(query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(values) - set(params) - set(allowed_flags))
    if unknown:
        known = ", ".join(sorted([*params, *allowed_flags])) or "none"
        raise ConfigError(
            f"unknown parameter(s) {', '.join(unknown)} in object store URL {url!r}; "
            f"known: {known}")
    args: dict[str, Any] = {}
    for name, given in values.items():
        if len(given) > 1:
            raise ConfigError(f"parameter {name} is given {len(given)} times in {url!r}")
        value = given[0]
        if name in allowed_flags:
            lowered = value.lower()
            if lowered not in _TRUE | _FALSE:
                raise ConfigError(f"parameter {name}={value!r} in {url!r} must be 1 or 0")
            args[name] = lowered in _TRUE
            continue
        arg, parse = params[name]
        try:
            args[arg] = parse(value)
        except ValueError:
            raise ConfigError(
                f"parameter {name}={value!r} in {url!r} is not a valid {parse.__name__}") from None
    return args


__all__ = [
    "FaultInjectingObjectStore", "InstrumentedObjectStore", "LocalObjectStore", "ObjectInfo",
    "ObjectStore", "S3ObjectStore", "open_object_store", "probe_conditional_put",
]
