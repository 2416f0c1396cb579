"""moto's S3 server on 127.0.0.1, the one starter for tests, benchmarks and harnesses.

Two ways to run it, because the callers want different things:
- `moto_thread()`: in this process, on a thread (ThreadedMotoServer): starts in milliseconds;
  the session fixture of the tests and the object-WAL bench use it.
- `MotoProcess` / `moto_process()`: in a process of its own, in its own session. It does not
  share the caller's GIL (a reader bench would measure moto's Python otherwise), SIGSTOP freezes
  it whole (`freeze`, `thaw`: a frozen S3 server for the fault tests), and closing it kills its
  group. A failed start raises MotoUnavailable with the reason.

Both set the AWS credentials every test server accepts (testservers.s3.set_credentials) in the
environment if none are set, and yield or hold the endpoint URL.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import IO, Iterator

from .s3 import free_ports, set_credentials

#: How long a moto process may take to answer its first request.
START_TIMEOUT = 30.0


class MotoUnavailable(RuntimeError):
    """moto's server did not start (moto[server] missing, or it exited or did not answer)."""


@contextlib.contextmanager
def moto_thread() -> Iterator[str]:
    """moto's server on a thread of this process; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer
    set_credentials()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)     # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


class MotoProcess:
    """moto's server in its own process and session on 127.0.0.1 (`endpoint`), its output in
    `log_dir`/moto.log if given. `freeze` / `thaw` SIGSTOP / SIGCONT the whole group; `close`
    thaws and kills it."""

    def __init__(self, log_dir: str | None = None, start_timeout: float = START_TIMEOUT) -> None:
        set_credentials()
        self.port = free_ports(1)[0]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log: IO[bytes] | int = open(os.path.join(log_dir, "moto.log"), "ab") if log_dir else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self._log, stderr=self._log, start_new_session=True)
        self.frozen = False
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                return
            except (urllib.error.URLError, OSError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    code = self.proc.poll()
                    self.close()
                    raise MotoUnavailable(f"the moto server on port {self.port} did not start within "
                                          f"{start_timeout:g} s (exit code {code}); is moto[server] installed?")
                time.sleep(0.1)

    def freeze(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.frozen = False

    def close(self, timeout: float = 10.0) -> None:
        """SIGCONT, then SIGKILL to the group; waits at most `timeout` for the process."""
        if self.proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        self.frozen = False
        if not isinstance(self._log, int):
            self._log.close()

    def __enter__(self) -> MotoProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def moto_process(log_dir: str | None = None) -> Iterator[MotoProcess]:
    """A MotoProcess, closed at the end."""
    server = MotoProcess(log_dir)
    try:
        yield server
    finally:
        server.close()
