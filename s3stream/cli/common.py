"""What the command groups of `s3stream` share: library errors as one-line messages, JSON and
table output, opening a metadata or object store that must already exist, the common options,
and /metrics."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import time
from typing import Any, Callable, Iterator
from urllib.parse import unquote, urlsplit

import click

import wal

from ..errors import S3StreamError
from ..metadata import MetadataStore, open_metadata, redact_url
from ..objectstore import ObjectStore, open_object_store
from ..urls import looks_like_url

META_HELP = ("Metadata URL: sqlite:////abs/path.db, sqlite:///rel/path.db or a path ending in .db "
             "(env S3STREAM_META).")
STORE_HELP = "Object store URL: file:///dir, a directory path, or s3://bucket/prefix?... (env S3STREAM_STORE)."


def user_errors(fn: Callable) -> Callable:
    """Turn the library's errors (and OS errors such as a permission denied) into one-line
    click errors: no traceback for a corrupt file or a bad URL."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (S3StreamError, wal.WALError) as e:
            raise click.ClickException(str(e)) from e
        except OSError as e:
            where = f" ({e.filename})" if e.filename else ""
            raise click.ClickException(f"{e.strerror or e}{where}") from e
    return wrapper


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


def table(headers: list[str], rows: list[list[Any]], indent: str = "  ") -> str:
    """Rows under headers in aligned columns."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = [headers] + cells
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def _local_path(url: str) -> str | None:
    """The path of a local object store URL (file:// or a plain path); None for other schemes,
    and for anything else that looks like a URL (open_object_store refuses it, saying why)."""
    if not looks_like_url(url):
        return url
    scheme, _, rest = url.partition(":")
    return unquote(urlsplit(url).path) if scheme.lower() == "file" and rest.startswith("//") else None


def open_store(url: str) -> ObjectStore:
    """The object store at `url`, which must already exist (opening a local store would create
    its directory, which hides a mistyped path)."""
    path = _local_path(url)
    if path is not None and not os.path.isdir(path):
        raise click.ClickException(
            f"no object store directory at {path!r} (from store URL {url!r}); check the path")
    try:
        return open_object_store(url)
    except S3StreamError as e:
        raise click.ClickException(f"cannot open object store {url!r}: {e}") from e


def open_meta(url: str) -> MetadataStore:
    """The metadata store at `url`, which must already exist (SQLite would create an empty one:
    open_metadata's create=False refuses it, saying how to fix the path)."""
    try:
        return open_metadata(url, create=False)
    except S3StreamError as e:
        raise click.ClickException(f"cannot open metadata {redact_url(url)!r}: {e}") from e


def meta_option(fn: Callable) -> Callable:
    return click.option("--meta", "meta_url", required=True, envvar="S3STREAM_META", metavar="URL",
                        help=META_HELP)(fn)


def store_option(required: bool, help: str = STORE_HELP) -> Callable:
    return click.option("--store", "store_url", required=required, envvar="S3STREAM_STORE", metavar="URL",
                        help=help)


def json_option(fn: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(fn)


def metrics_option(fn: Callable) -> Callable:
    fn = click.option("--metrics-addr", default="0.0.0.0", show_default=True, metavar="ADDR",
                      envvar="S3STREAM_METRICS_ADDR",
                      help="Address --metrics-port listens on (127.0.0.1: this host only).")(fn)
    return click.option("--metrics-port", type=click.IntRange(0, 65535), default=0, metavar="PORT",
                        help="Serve Prometheus metrics on http://ADDR:PORT/metrics (docs/metrics.md) "
                             "[default: 0, off].")(fn)


def serve_metrics(port: int, addr: str = "0.0.0.0") -> None:
    """Start /metrics on `addr`:`port` (port 0: do nothing) on prometheus_client's default registry."""
    if not port:
        return
    from ..metrics import serve
    try:
        serve(port, addr=addr)
    except OSError as e:
        raise click.ClickException(f"cannot serve metrics on {addr} port {port}: {e.strerror or e}; choose another "
                                   "--metrics-port (or --metrics-addr)") from e
    click.echo(f"metrics on http://{addr}:{port}/metrics")


def stop_on_signals() -> None:
    """Make Ctrl-C (SIGINT) and SIGTERM raise KeyboardInterrupt in the main thread, for the
    commands that run until stopped: they then stop cleanly (flows closed, leases released)
    when a supervisor stops them with SIGTERM too, and also when they were started from a
    non-interactive shell's background job, which inherits SIGINT ignored (Python then
    installs no handler of its own: Ctrl-C did nothing at all)."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)


class Foreground:
    """What `until_stopped` yields: set `started` once the command's threads run; from then on
    the command stops them itself on KeyboardInterrupt."""
    started = False


@contextlib.contextmanager
def until_stopped(what: str) -> Iterator[Foreground]:
    """stop_on_signals() for a command that runs until stopped, plus its start: a signal that
    comes while it opens its stores, before `started` is set, ends it with exit 0 and a line
    saying so (not click's "Aborted!" and exit 1: a supervisor's SIGTERM right after the start is
    a clean stop). Once started, an interrupt escaping the command's own handling is re-raised."""
    state = Foreground()
    stop_on_signals()
    try:
        yield state
    except KeyboardInterrupt:
        if state.started:
            raise
        click.echo(f"stopped before {what} started", err=True)


def iso_time(ns: int) -> str:
    """Local time of a nanosecond timestamp, '-' for 0."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9)) if ns else "-"


def as_number(value: Any) -> float | None:
    """`value` as a float if it is a number (not a bool) in a JSON record, else None."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
