"""A throwaway PostgreSQL server for tests, benchmarks and trying a cluster on one machine: initdb
into a temporary directory, pg_ctl start on a free loopback port, databases created on demand,
pg_ctl stop and remove the directory at the end. `throwaway_pgbouncer` puts a PgBouncer in front
of a server, as deployments that pool connections do.

PostgreSQL and PgBouncer refuse to run as root: as root they run as the `postgres` user in a
directory that user owns. Also usable outside pytest:

    with throwaway_postgres() as server, throwaway_pgbouncer(server.url) as bouncer:
        server.create_database("example")
        url = bouncer.database_url("example") + "?pgbouncer=1"
"""
from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Iterator
from urllib.parse import unquote, urlsplit, urlunsplit

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


def _database_url(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


class MissingBinaries(RuntimeError):
    """initdb / pg_ctl / pgbouncer (or runuser and the postgres user, as root) are not installed."""


def _server_user() -> pwd.struct_passwd | None:
    """The user that PostgreSQL and PgBouncer run as: `postgres` when we are root (both refuse
    to run as root), else None (ourselves)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise MissingBinaries("running as root needs a 'postgres' user to start PostgreSQL or PgBouncer "
                              "(apt-get install postgresql creates it)") from None


class PostgresProcess:
    """One throwaway server's process, the one starter of PostgreSQL for tests, benchmarks and
    harnesses: initdb into `directory` (a new temporary one if None, removed by `close`) on a
    free loopback port (`port`, `url`: the `postgres` database as superuser); `start`, `stop`
    (pg_ctl stop -m `mode`; immediate: every backend killed, as by a crash) and `start` again on
    the same port and data; `close` stops it (and kills a postmaster left behind). As root it
    runs as the `postgres` user, so `directory` and its parents must be reachable by that user
    (pytest's tmp_path is not). `fsync=False` for servers whose durability no test relies on.
    MissingBinaries if PostgreSQL is not installed; RuntimeError if a step fails."""

    def __init__(self, directory: str | None = None, *, fsync: bool = True, max_connections: int = 200) -> None:
        initdb, pg_ctl = find_binary("initdb"), find_binary("pg_ctl")
        if not initdb or not pg_ctl:
            raise MissingBinaries("PostgreSQL's initdb and pg_ctl were found neither on PATH nor in "
                                  "/usr/lib/postgresql/*/bin; install PostgreSQL (apt-get install postgresql)")
        self.initdb, self.pg_ctl = initdb, pg_ctl
        self.as_user: list[str] = []
        owner = _server_user()
        if owner is not None:
            runuser = shutil.which("runuser")
            if not runuser:
                raise MissingBinaries("running as root needs runuser to start PostgreSQL as the postgres user")
            self.as_user = [runuser, "-u", owner.pw_name, "--"]
        self._owned = directory is None
        self.base = tempfile.mkdtemp(prefix="s3stream-pg-") if directory is None else directory
        os.makedirs(self.base, exist_ok=True)
        if owner is not None:
            os.chown(self.base, owner.pw_uid, owner.pw_gid)
        self.data, self.log = os.path.join(self.base, "data"), os.path.join(self.base, "server.log")
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.settings = f"-c fsync={'on' if fsync else 'off'} -c max_connections={max_connections}"
        self.running = False
        try:
            self._run(self.initdb, "-D", self.data, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-locale",
                      "--no-sync")
        except BaseException:
            if self._owned:             # nobody gets the object to close: its directory goes now
                shutil.rmtree(self.base, ignore_errors=True)
            raise

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(self.as_user + list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=self.base, timeout=120)
        if check and done.returncode != 0:
            tail = ""
            with contextlib.suppress(OSError):
                with open(self.log) as f:
                    tail = f.read()[-2000:]
            raise RuntimeError(f"{' '.join(args[:2])} failed ({done.returncode}): {done.stdout[-2000:]}{tail}")
        return done

    def start(self) -> None:
        """Start (again); returns once it accepts connections."""
        self._run(self.pg_ctl, "-D", self.data, "-l", self.log, "-o",
                  f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 {self.settings}",
                  "-w", "-t", "60", "start")
        self.running = True

    def stop(self, mode: str = "immediate", check: bool = False) -> None:
        """pg_ctl stop -m `mode` and wait until the server is gone (a server already stopped is
        no error unless `check`)."""
        self._run(self.pg_ctl, "-D", self.data, "-m", mode, "-w", "-t", "60", "stop", check=check)
        self.running = False

    def server(self) -> PostgresServer:
        """Its client side: URLs, databases, and stop/start for outage tests."""
        return PostgresServer(self.url, self)

    def create_database(self, name: str) -> str:
        return self.server().create_database(name)

    def _postmaster_pid(self) -> int | None:
        try:
            with open(os.path.join(self.data, "postmaster.pid")) as f:
                return int(f.readline())
        except (OSError, ValueError):
            return None

    def close(self, mode: str = "immediate") -> None:
        """Stop it (pg_ctl stop -m `mode`), kill a postmaster that outlived that, and remove its
        directory if this created it."""
        if os.path.isdir(self.data):
            self.stop(mode)
            pid = self._postmaster_pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        if self._owned:
            shutil.rmtree(self.base, ignore_errors=True)


class PostgresServer:
    """A server reachable at `url` (its `postgres` database, as superuser). One a PostgresProcess
    runs can also be stopped and started again on the same port and data (`stop`, `start`), to
    test what its clients do during an outage."""

    def __init__(self, url: str, process: PostgresProcess | None = None) -> None:
        self.url = url
        self._process = process

    def database_url(self, name: str) -> str:
        return _database_url(self.url, name)

    def stop(self, mode: str = "fast") -> None:
        """pg_ctl stop -m `mode` (smart, fast, or immediate: no shutdown checkpoint, sessions cut
        as by a crash) and wait until the server is gone."""
        self._control().stop(mode, check=True)

    def start(self) -> None:
        """Start the stopped server again (same port and data); returns once it accepts connections."""
        self._control().start()

    def _control(self) -> PostgresProcess:
        if self._process is None:
            raise RuntimeError(f"the server at {self.url} was not started by throwaway_postgres: "
                               "it cannot be stopped or started from here")
        return self._process

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


@contextlib.contextmanager
def throwaway_postgres(directory: str | None = None) -> Iterator[PostgresServer]:
    """Start a server (a PostgresProcess in `directory`, a new temporary one if None: removed
    afterwards) and stop it on exit (pg_ctl stop -m fast). MissingBinaries if PostgreSQL is not
    installed; RuntimeError if it fails to start."""
    process = PostgresProcess(directory)
    try:
        process.start()
        yield process.server()
    finally:
        process.close("fast")


def find_pgbouncer() -> str | None:
    """pgbouncer on PATH, else Debian's /usr/sbin/pgbouncer (root's PATH only has /usr/sbin)."""
    found = shutil.which("pgbouncer")
    if found:
        return found
    return "/usr/sbin/pgbouncer" if os.access("/usr/sbin/pgbouncer", os.X_OK) else None


class PgBouncer:
    """A PgBouncer listening at `url` (the server URL's database, through it), passing every
    database name on to the server's database of that name, with `pool_size` server connections
    per database and user."""

    def __init__(self, url: str, pool_mode: str, pool_size: int) -> None:
        self.url = url
        self.pool_mode = pool_mode
        self.pool_size = pool_size

    def database_url(self, name: str) -> str:
        """The URL of the server's database `name` through this PgBouncer."""
        return _database_url(self.url, name)


@contextlib.contextmanager
def throwaway_pgbouncer(server_url: str, pool_mode: str = "transaction", pool_size: int = 5,
                        directory: str | None = None) -> Iterator[PgBouncer]:
    """Start PgBouncer on a free loopback port in front of the PostgreSQL server at `server_url`
    (any of its databases: a wildcard entry maps each name to the server's) and stop it on exit.

    `pool_mode` is PgBouncer's: transaction (a server connection per transaction, as most
    deployments run it), session or statement. Clients are trusted (auth_type trust) under the
    user name of `server_url`, whose password (if any) PgBouncer uses to log in to the server.
    `directory` holds the configuration and log (a new temporary one if None; removed afterwards).
    MissingBinaries if PgBouncer is not installed; RuntimeError if it fails to start."""
    binary = find_pgbouncer()
    if not binary:
        raise MissingBinaries("pgbouncer was found neither on PATH nor at /usr/sbin/pgbouncer; install it "
                              "(apt-get install pgbouncer)")
    if pool_mode not in ("session", "transaction", "statement"):
        raise ValueError(f"pool_mode must be session, transaction or statement, got {pool_mode!r}")
    server = urlsplit(server_url)
    user = unquote(server.username or "postgres")
    password = unquote(server.password or "")
    owner = _server_user()
    base = tempfile.mkdtemp(prefix="s3stream-pgbouncer-") if directory is None else directory
    os.makedirs(base, exist_ok=True)
    port = free_port()
    config, users, log = (os.path.join(base, name) for name in ("pgbouncer.ini", "userlist.txt", "pgbouncer.log"))

    def quoted(value: str) -> str:      # auth_file syntax: "user" "password", quotes doubled
        return '"' + value.replace('"', '""') + '"'

    with open(users, "w") as f:
        f.write(f"{quoted(user)} {quoted(password)}\n")
    with open(config, "w") as f:
        f.write(f"""[databases]
* = host={server.hostname or '127.0.0.1'} port={server.port or 5432}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {users}
admin_users = {user}
pool_mode = {pool_mode}
default_pool_size = {pool_size}
max_client_conn = 500
logfile = {log}
""")
    if owner is not None:
        for path in (base, config, users):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    process = None
    try:
        # Not daemonised: the process is ours to wait for, and to stop by its pid.
        process = subprocess.Popen(
            [binary, "-q", config], cwd=base, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, user=None if owner is None else owner.pw_uid,
            group=None if owner is None else owner.pw_gid, extra_groups=None if owner is None else [])
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                tail = ""
                with contextlib.suppress(OSError), open(log) as logged:
                    tail = logged.read()[-2000:]
                raise RuntimeError(f"pgbouncer did not start listening on 127.0.0.1:{port} "
                                   f"(exit status {process.poll()}): {tail}")
            time.sleep(0.02)
        userinfo = server.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
        yield PgBouncer(urlunsplit(server._replace(netloc=netloc)), pool_mode, pool_size)
    finally:
        if process is not None:
            process.terminate()         # SIGTERM: PgBouncer's immediate shutdown
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if directory is None:
            shutil.rmtree(base, ignore_errors=True)
