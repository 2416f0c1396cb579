"""Telling a URL from a path, for the locations s3stream takes as text: object stores, WALs and
metadata. One rule for all three, so that a mistyped URL is refused instead of becoming a
relative path (`s3:/bucket/x` used to make the directory `./s3:/bucket/x`).

A value looks like a URL when it starts with a scheme as RFC 3986 spells one (a letter, then
letters, digits, `+`, `-` or `.`), of two characters or more (one letter and a colon is a
Windows drive, `C:\\data`), followed by `:` and then

- `/` (`s3:/bucket`, `http://host`, `foo:/x`): whatever the scheme, or
- anything, when the scheme is one s3stream knows (`s3:bucket`, `sqlite:meta.db`).

A known scheme followed by `//` without its colon (`s3//bucket`, `S3//x`) is a URL missing its
colon. Everything else is a path: `data/wal`, `./s3:/x` (the way to name such a directory),
`backup:2024` (a colon in a file name), `C:/data`.
"""
from __future__ import annotations

import re
from collections.abc import Collection

from .errors import ConfigError

#: Schemes that s3stream reads somewhere (objects+ prefixes any of them in a WAL location).
KNOWN_SCHEMES = frozenset({"file", "s3", "sqlite", "postgres", "postgresql"})
OBJECTS_PREFIX = "objects+"

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]+):")
_COLON_MISSING = re.compile(r"(?:objects\+)?(?:file|s3|sqlite|postgres|postgresql)//", re.IGNORECASE)


def _known(scheme: str) -> bool:
    return scheme.removeprefix(OBJECTS_PREFIX) in KNOWN_SCHEMES


def looks_like_url(value: str) -> bool:
    """Whether `value` reads as a URL (well formed or not) by the rule of the module docstring."""
    match = _SCHEME.match(value)
    if match is None:
        return _COLON_MISSING.match(value) is not None
    return value[match.end():].startswith("/") or _known(match.group(1).lower())


def url_scheme(value: str, *, what: str, schemes: Collection[str], accepted: str,
               shown: str | None = None) -> str | None:
    """The scheme (lower case) of `value` if it is a URL of one of `schemes` written
    `scheme://...`; None if it is a path. ConfigError naming `what`, the value (as `shown`, e.g.
    with its password redacted) and `accepted` (the forms the caller takes) for anything that
    looks like a URL but is not one of those: another scheme, a single slash or none after the
    colon, a missing colon, spaces around it."""
    shown = value if shown is None else shown
    stripped = value.strip()
    if stripped != value and looks_like_url(stripped):
        raise ConfigError(f"{what} {shown!r} has spaces around it; remove them (use {accepted})")
    match = _SCHEME.match(value)
    if match is None:
        if _COLON_MISSING.match(value):
            head = value.split("//", 1)[0]
            raise ConfigError(f"{what} {shown!r} looks like a URL without the ':' after {head!r}: write "
                              f"{head}://...; use {accepted} (for a relative directory of that name, ./{shown})")
        return None
    scheme, rest = match.group(1).lower(), value[match.end():]
    if not rest.startswith("/") and not _known(scheme):
        return None
    if scheme not in schemes:
        raise ConfigError(f"unsupported {what} scheme {match.group(1)!r} in {shown!r}; supported: {accepted}")
    if not rest.startswith("//"):
        raise ConfigError(f"{what} {shown!r} is not a URL: '{match.group(1)}:' must be followed by two slashes "
                          f"({scheme}://...); use {accepted}")
    return scheme
