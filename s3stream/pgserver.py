"""A throwaway PostgreSQL server for tests, benchmarks and trying a cluster on one machine: initdb
into a temporary directory, pg_ctl start on a free loopback port, databases created on demand,
pg_ctl stop and remove the directory at the end.

PostgreSQL refuses to run as root: as root the server runs as the `postgres` user (runuser) in a
directory that user owns. Also usable outside pytest:

    with throwaway_postgres() as server:
        url = server.create_database("example")
"""
from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from typing import Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql


def find_binary(name: str) -> str | None:
    """`name` (initdb, pg_ctl) on PATH, else in the newest /usr/lib/postgresql/*/bin."""
    found = shutil.which(name)
    if found:
        return found

    def version(path: str) -> tuple:
        parts = path.split(os.sep)[-3].split(".")
        return tuple(int(p) if p.isdigit() else 0 for p in parts)

    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=version)
    return candidates[-1] if candidates else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """A server reachable at `url` (its `postgres` database, as superuser)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def database_url(self, name: str) -> str:
        parts = urlsplit(self.url)
        return urlunsplit(parts._replace(path="/" + name))

    def _admin(self) -> psycopg.Connection:
        return psycopg.connect(self.url, autocommit=True, connect_timeout=10)

    def create_database(self, name: str) -> str:
        """Create the empty database `name` (dropping any leftover of that name); its URL."""
        self.drop_database(name)
        with self._admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.database_url(name)

    def drop_database(self, name: str) -> None:
        """Drop `name` if it exists, ending the sessions still connected to it."""
        with self._admin() as conn:
            try:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
            except psycopg.errors.SyntaxError:          # before PostgreSQL 13
                conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                             (name,))
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))


class MissingBinaries(RuntimeError):
    """initdb / pg_ctl (or runuser and the postgres user, as root) are not installed."""


@contextlib.contextmanager
def throwaway_postgres(directory: str | None = None) -> Iterator[PostgresServer]:
    """Start a server in `directory` (a new temporary one if None; removed afterwards) and stop
    it on exit. As root, `directory` and its parents must be reachable by the `postgres` user. MissingBinaries if PostgreSQL is not installed; RuntimeError if it fails to start."""
    initdb, pg_ctl = find_binary("initdb"), find_binary("pg_ctl")
    if not initdb or not pg_ctl:
        raise MissingBinaries("PostgreSQL's initdb and pg_ctl were found neither on PATH nor in "
                              "/usr/lib/postgresql/*/bin; install PostgreSQL (apt-get install postgresql)")
    as_user: list[str] = []
    owner = None
    if os.geteuid() == 0:          # the server refuses to run as root
        runuser = shutil.which("runuser")
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            owner = None
        if not runuser or owner is None:
            raise MissingBinaries("running as root needs runuser and a 'postgres' user to start PostgreSQL")
        as_user = [runuser, "-u", "postgres", "--"]
    base = tempfile.mkdtemp(prefix="s3stream-pg-") if directory is None else directory
    os.makedirs(base, exist_ok=True)
    if owner is not None:
        os.chown(base, owner.pw_uid, owner.pw_gid)
    data, log = os.path.join(base, "data"), os.path.join(base, "server.log")
    port = free_port()

    def run(*args: str) -> None:
        done = subprocess.run(as_user + list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=base)
        if done.returncode != 0:
            tail = ""
            with contextlib.suppress(OSError):
                with open(log) as f:
                    tail = f.read()[-2000:]
            raise RuntimeError(f"{' '.join(args[:2])} failed ({done.returncode}): {done.stdout[-2000:]}{tail}")

    started = False
    try:
        run(initdb, "-D", data, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-locale", "--no-sync")
        run(pg_ctl, "-D", data, "-l", log, "-o",
            f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=on -c max_connections=200",
            "-w", "-t", "60", "start")
        started = True
        yield PostgresServer(f"postgresql://postgres@127.0.0.1:{port}/postgres")
    finally:
        if started:
            subprocess.run(as_user + [pg_ctl, "-D", data, "-m", "fast", "-w", "stop"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=base)
        if directory is None:
            shutil.rmtree(base, ignore_errors=True)
